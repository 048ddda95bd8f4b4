"""The engine on the shared scheduler with a token budget: chunked prefill beside decodes.

The answers are token-identical to the contiguous-cache oracle (float32 NumPy) with and
without a budget, with the prefix cache, under preemption by recompute and by swap, for
greedy, sampled, n-way sampled and beam requests; a step never computes more tokens than
its budget; and a long prompt that arrives while others decode no longer stops them: every
running request gains a token at every step while the prompt is prefilled a chunk a step.
"""
import numpy as np
import pytest

from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from _tiny import TINY

single_thread_blas()

SEED = 20261202
STOP = (0,)
BS = 8
PARAMS = {
    "greedy": SamplingParams(max_new_tokens=14),
    "sampled": SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5),
    "n3": SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=6),
    "beam3": SamplingParams(max_new_tokens=8, beam_width=3),
}
# (prefix caching, preemption, host blocks, pool)
CONFIGS = {
    "roomy": (False, "recompute", 0, "roomy"),
    "cache": (True, "recompute", 0, "roomy"),
    "recompute": (False, "recompute", 0, "tight"),
    "cache+recompute": (True, "recompute", 0, "tight"),
    "swap": (False, "swap", 64, "tight"),
}



def _prompts():
    rng = np.random.default_rng(SEED)
    head = rng.integers(1, TINY.vocab_size, 21).tolist()      # a shared "system prompt"
    return [head + rng.integers(1, TINY.vocab_size, n).tolist() for n in (3, 30, 11, 47)]


@pytest.fixture(scope="module")
def expected(tiny):
    print(f"seed={SEED}")
    return {k: [[s.generated for s in reference_generate(tiny, p, params, STOP)]
                for p in _prompts()] for k, params in PARAMS.items()}


class Budget:
    """Counts, after every step, the tokens the step computed: prefill tokens computed
    (``counts.computed_tokens``) plus one per sequence that decoded."""

    def __init__(self):
        self.computed, self.steps, self.prefill_steps = 0, [], 0

    def __call__(self, engine):
        new = engine.memory.counts.computed_tokens - self.computed
        self.computed = engine.memory.counts.computed_tokens
        decoded = engine.history[-1]["decoded"]
        self.steps.append(new + decoded)
        self.prefill_steps += new > 0


def _run(model, params, config, budget):
    caching, preemption, host_blocks, pool = CONFIGS[config]
    prompts = _prompts()
    worst = max(params.width * -(-(len(p) + params.max_new_tokens) // BS) for p in prompts)
    blocks = worst + 2 if pool == "tight" else 300
    watch = Budget()
    engine = Engine(model, num_blocks=blocks, block_size=BS, stop_ids=STOP, audit=True,
                    prefix_caching=caching, preemption=preemption,
                    host_blocks=host_blocks, token_budget=budget, on_step=watch)
    reqs = engine.generate(prompts, params)
    assert engine.memory.manager.allocator.num_free == blocks and len(engine.memory.manager) == 0
    return engine, watch, [[s.generated for s in r.outputs()] for r in reqs]


@pytest.mark.parametrize("budget", [None, 40, 13])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(PARAMS))
def test_answers_do_not_change_with_a_budget(tiny, expected, kind, config, budget):
    engine, watch, got = _run(tiny, PARAMS[kind], config, budget)
    assert got == expected[kind]
    if budget is not None:
        assert max(watch.steps) <= budget, watch.steps
        if config == "roomy":
            assert watch.prefill_steps > 1      # the prompts could not all go in one step


@pytest.mark.parametrize("budget", [40, 13])
@pytest.mark.parametrize("config", [c for c, v in CONFIGS.items() if v[3] == "tight"])
def test_budgeted_runs_preempt_too(tiny, expected, config, budget):
    """In every tight configuration a budgeted run preempts as well (the sampled requests
    do), so the answers are checked across preemptions under a budget."""
    engine, watch, got = _run(tiny, PARAMS["sampled"], config, budget)
    assert engine.memory.counts.preemptions > 0
    assert got == expected["sampled"]
    assert max(watch.steps) <= budget, watch.steps


def test_a_long_prompt_does_not_stop_the_decodes(tiny):
    """Four requests decode; then a 300-token prompt arrives. Without a budget the step
    that admits it computes all 300 tokens at once; with a budget of 64 no step computes
    more than 64, and the four still gain a token at every step."""
    rng = np.random.default_rng(SEED)
    short = [rng.integers(1, TINY.vocab_size, 6).tolist() for _ in range(4)]
    long = rng.integers(1, TINY.vocab_size, 300).tolist()
    params = SamplingParams(max_new_tokens=40)
    out = {}
    for budget in (None, 64):
        watch = Budget()
        engine = Engine(tiny, num_blocks=200, block_size=BS, stop_ids=(), on_step=watch,
                        token_budget=budget)
        first = [engine.submit(p, params) for p in short]
        for _ in range(5):
            engine.step()
        lengths = [[len(r.live[0].tokens)] for r in first]
        late = engine.submit(long, SamplingParams(max_new_tokens=4))
        while not late.live or not late.live[0].generated:
            engine.step()
            for got, r in zip(lengths, first):
                got.append(len(r.live[0].tokens))
        engine.run()
        gains = np.diff(np.array(lengths), axis=1)
        out[budget] = (max(watch.steps), gains, [r.outputs()[0].generated for r in first],
                       late.outputs()[0].generated)
    (big, _, answers, late_all), (small, gains, answers64, late64) = \
        out[None], out[64]
    assert big >= 300 and small <= 64
    assert gains.shape[1] >= 300 // 64 and (gains == 1).all()
    assert answers == answers64 and late_all == late64


@pytest.mark.parametrize("budget", [None, 13])
@pytest.mark.parametrize("config", ["cache", "swap"])
@pytest.mark.parametrize("kind", ["greedy", "beam3", "n3"])
def test_the_fast_runner_prefills_through_its_decode_pass(tiny, expected, kind, config,
                                                          budget):
    """The fast runner's prefill (a row per new token through the decode kernels) gives the
    oracle's answers too, chunked or not, with cache hits and swaps (its NumPy path)."""
    caching, preemption, host_blocks, pool = CONFIGS[config]
    params, prompts = PARAMS[kind], _prompts()
    worst = max(params.width * -(-(len(p) + params.max_new_tokens) // BS) for p in prompts)
    blocks = worst + 2 if pool == "tight" else 300
    engine = Engine(tiny, num_blocks=blocks, block_size=BS, stop_ids=STOP, audit=True,
                    prefix_caching=caching, preemption=preemption, max_seqs=16,
                    host_blocks=host_blocks, token_budget=budget, runner="fast-eager")
    reqs = engine.generate(prompts, params)
    assert [[s.generated for s in r.outputs()] for r in reqs] == expected[kind]


def test_cancelling_a_request_in_the_middle_of_its_prefill(tiny):
    """A long prompt prefilled a chunk a step is cancelled half way: its blocks come back,
    the scheduler forgets it, and the others' answers do not change."""
    rng = np.random.default_rng(SEED)
    short = [rng.integers(1, TINY.vocab_size, 6).tolist() for _ in range(2)]
    long = rng.integers(1, TINY.vocab_size, 200).tolist()
    params = SamplingParams(max_new_tokens=12)
    alone = Engine(tiny, num_blocks=200, block_size=BS, stop_ids=())
    expect = [r.outputs()[0].generated for r in alone.generate(short, params)]
    e = Engine(tiny, num_blocks=200, block_size=BS, stop_ids=(), audit=True, token_budget=32)
    first = [e.submit(p, params) for p in short]
    e.step()
    late = e.submit(long, params)
    e.step()
    e.step()
    assert late in e.scheduler.prefilling and 0 < e.memory.manager.num_tokens(late.live[0].seq_id)
    assert e.cancel(late) is True
    assert late not in e.scheduler.prefilling and late not in e.scheduler.running
    e.run()
    assert [r.outputs()[0].generated for r in first] == expect
    assert e.memory.manager.allocator.num_free == 200
