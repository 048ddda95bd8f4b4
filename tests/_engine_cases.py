"""What the engine's tests share: the mix of requests and the engine settings the oracle
tests run under (``test_overlap.py`` without guesses, ``test_speculate_engine.py`` with
them), and a bounded loop over ``Engine.step``."""
from pagedkv.model.requests import SamplingParams

GREEDY = SamplingParams(max_new_tokens=30)
MIXED = [GREEDY, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
         SamplingParams(max_new_tokens=10, temperature=1.0, top_k=5, n=3, seed=5),
         SamplingParams(max_new_tokens=10, beam_width=3),
         SamplingParams(max_new_tokens=20, min_tokens=15),
         SamplingParams(max_new_tokens=9, temperature=0.7, min_tokens=6, seed=8),
         SamplingParams(max_new_tokens=14, ignore_eos=True)]
CASES = {
    "late stops": dict(),
    "plain runner": dict(runner="plain"),
    "prefix caching": dict(prefix_caching=True),
    "fast bookkeeping": dict(bookkeeping="fast", prefix_caching=True),
    "recompute": dict(num_blocks=12),
    "swap": dict(num_blocks=12, preemption="swap", host_blocks=64),
    "budget": dict(token_budget=24, max_seqs=6),
}


def drain(engine, limit=2_000):
    """Step until the engine has no work: a loop that stops making progress fails here,
    by name, instead of running until a timeout."""
    for _ in range(limit):
        if not engine.has_work():
            return engine.finished
        engine.step()
    raise AssertionError(f"the engine still has work after {limit} steps")


def generate(engine, prompts, params=None):
    """``engine.generate``, bounded by :func:`drain`."""
    reqs = [engine.submit(p, params) for p in prompts]
    drain(engine)
    return reqs
