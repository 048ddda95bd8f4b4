"""The overlapped loop (``Engine(overlap=True)``, pagedkv/model/overlap.py) against the plain
loop as oracle: the same tokens, request for request, under late stops, prefix caching,
preemption by recompute and swap, token budgets, requests that arrive and leave mid-run,
sampled and beam requests beside greedy ones, cancellation while a step is in flight, and
both bookkeepings; the pool is whole at the end and audited after every step. Then the
manager's reserve/commit split on its own. Seeds are fixed and printed.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.fast.prefix import PrefixCachingManager as FastPrefix
from pagedkv.fast import BlockAllocator as FastAllocator
from pagedkv.prefix_cache import PrefixCachingManager
from pagedkv.allocator import BlockAllocator

single_thread_blas()

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
SEED = 8086
STOPS = (0, 7, 9)            # end tokens common enough to stop many sequences early
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_weights(TINY, SEED), xp=np)


def _prompts(seed, n=7):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, int(k)).tolist() for k in rng.integers(1, 40, n)]


def _run(model, prompts, params, *, arrivals=None, cancel=None, **options):
    """Every request's outputs; ``arrivals[i]``: the step count before request ``i`` is
    submitted; ``cancel``: {request index: step count} to cancel it at."""
    kw = dict(num_blocks=300, block_size=16, stop_ids=STOPS, audit=True,
              runner="fast-eager") | options
    engine = Engine(model, **kw)
    arrivals = arrivals or [0] * len(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs, steps = [None] * len(prompts), 0
    while steps <= max(arrivals) or engine.waiting or engine.running or engine.swapped:
        for i, at in enumerate(arrivals):
            if at == steps:
                reqs[i] = engine.submit(prompts[i], params[i])
        for i, at in (cancel or {}).items():
            if at == steps and reqs[i] is not None:
                engine.cancel(reqs[i])
        engine.step()
        steps += 1
    assert engine.manager.allocator.num_free == kw["num_blocks"] or kw.get("prefix_caching")
    engine.manager.audit()
    return engine, [[s.generated for s in r.outputs()] for r in reqs]


GREEDY = SamplingParams(max_new_tokens=30)
CASES = {
    "late stops": dict(),
    "prefix caching": dict(prefix_caching=True),
    "fast bookkeeping": dict(bookkeeping="fast", prefix_caching=True),
    "recompute": dict(num_blocks=14),
    "swap": dict(num_blocks=14, preemption="swap", host_blocks=64),
    "budget": dict(token_budget=24, max_seqs=4),
    "single pass": dict(runner="fast-eager", single_pass=True, token_budget=24),
}


@pytest.mark.parametrize("name", list(CASES))
def test_overlap_gives_the_plain_loops_tokens(tiny, name):
    print(f"seed={SEED}")
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]                  # requests join a running batch
    plain_engine, plain = _run(tiny, prompts, GREEDY, arrivals=arrivals, **CASES[name])
    engine, ahead = _run(tiny, prompts, GREEDY, arrivals=arrivals, overlap=True,
                         **CASES[name])
    assert ahead == plain
    assert engine.ahead.ahead > 0 and engine.ahead.flying is None
    stopped = sum(len(o[0]) < GREEDY.max_new_tokens for o in plain)
    assert stopped > 0                                  # some stopped on an end token
    if "num_blocks" in CASES[name]:
        assert engine.counts.preemptions > 0


def test_overlap_beside_sampled_beam_and_min_tokens_requests(tiny):
    """Requests that cannot go ahead make their steps plain; the tokens stay the same."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED + 1, 6)
    params = [GREEDY, SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=3),
              GREEDY, SamplingParams(max_new_tokens=10, beam_width=3),
              SamplingParams(max_new_tokens=20, min_tokens=15), GREEDY]
    arrivals = [0, 0, 2, 20, 40, 41]
    _, plain = _run(tiny, prompts, params, arrivals=arrivals)
    engine, ahead = _run(tiny, prompts, params, arrivals=arrivals, overlap=True)
    assert ahead == plain
    assert engine.ahead.ahead > 0 and engine.ahead.plain > 0


def test_blocks_named_ahead_are_found_by_their_tokens(tiny):
    """The blocks a generated answer filled are named at commit by their true ids: its
    prompt + answer, submitted again, finds as many cached tokens as after the plain loop."""
    prompts = _prompts(SEED + 2, 5)
    found = []
    for overlap in (False, True):
        engine, out = _run(tiny, prompts, GREEDY, prefix_caching=True, overlap=overlap)
        before = engine.counts.cached_tokens
        again = [p + o[0] for p, o in zip(prompts, out)]
        engine.generate(again, SamplingParams(max_new_tokens=1))
        found.append((out, engine.counts.cached_tokens - before))
    assert found[0] == found[1]
    assert found[1][1] >= 16 * len(prompts)             # every answer's blocks, found


def test_cancel_while_a_step_is_in_flight(tiny):
    """A cancelled request keeps a prefix of its answer; the others are unchanged; every
    block comes back."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED + 3, 5)
    _, plain = _run(tiny, prompts, GREEDY)
    long = [i for i, p in enumerate(plain) if len(p[0]) == GREEDY.max_new_tokens]
    assert len(long) >= 2                              # two that would run to their limit
    cancel = {long[0]: 4, long[1]: 11}
    engine, ahead = _run(tiny, prompts, GREEDY, cancel=cancel, overlap=True)
    for i, (a, p) in enumerate(zip(ahead, plain)):
        if i in cancel:
            assert p[0][:len(a[0])] == a[0] and len(a[0]) < len(p[0])
        else:
            assert a == p
    assert engine.manager.allocator.num_free == 300


def test_overlap_needs_a_fast_runner(tiny):
    with pytest.raises(ConfigError, match="fast runner"):
        Engine(tiny, num_blocks=16, overlap=True)


# ------------------------------------------------------------------ reserve and commit

MANAGERS = {"teaching": (PrefixCachingManager, BlockAllocator),
            "fast": (FastPrefix, FastAllocator)}


@pytest.mark.parametrize("kind", list(MANAGERS))
def test_reserve_then_commit_is_step(kind):
    """Random steps: reserve + commit gives the plans, tables and cache of step."""
    manager_cls, alloc_cls = MANAGERS[kind]
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    a, b = (manager_cls(alloc_cls(64, 64), 4) for _ in range(2))
    for m in (a, b):
        for i in range(3):
            m.add(i, m.prompt([1, 2, 3, i + 1, 5][:i + 2]))
    for _ in range(30):
        ids = sorted(rng.choice(3, int(rng.integers(1, 4)), replace=False).tolist())
        tokens = rng.integers(0, 8, len(ids)).tolist()
        pa = a.step(ids, tokens)
        pb = b.reserve(ids)
        assert b.pending() == {i: 1 for i in ids}
        b.audit()                                      # a pending slot is allowed for
        b.commit(ids, tokens)
        assert np.array_equal(pa.slot_mapping, pb.slot_mapping)
        assert np.array_equal(pa.block_tables, pb.block_tables)
        assert not b.pending()
    a.audit(), b.audit()
    for i in range(3):
        assert a.block_table(i).tolist() == b.block_table(i).tolist()
    probe = [1, 2, 3, 1] + [0] * 20
    assert a.cached_prefix(a.prompt(probe)) == b.cached_prefix(b.prompt(probe))


@pytest.mark.parametrize("kind", list(MANAGERS))
def test_reserve_refusals(kind):
    manager_cls, alloc_cls = MANAGERS[kind]
    m = manager_cls(alloc_cls(8, 64), 4)
    m.add(0, m.prompt([1, 2, 3]))
    m.reserve([0])
    with pytest.raises(ConfigError, match="named twice"):
        m.reserve([0, 0])
    m.reserve([0])                                     # a second pending slot
    assert m.pending() == {0: 2}
    with pytest.raises(ConfigError, match="one token per sequence"):
        m.commit([0], [1, 2])
    m.commit([0], [4])
    m.commit([0], [6])
    assert m._tail[0] == [6]          # 4 filled the first block (named), 6 starts the next
    with pytest.raises(ConfigError, match="no reserved slot"):
        m.commit([0], [4])
    m.reserve([0])
    m.free(0)                                          # freed before its token is known
    m.commit([0], [5])
    assert not m.pending() and m.allocator.num_free == 8


# ------------------------------------------------------------------ the GPU

@gpu
@pytest.mark.parametrize("name", ["late stops", "prefix caching", "swap", "budget"])
def test_overlap_on_the_gpu_gives_the_plain_loops_tokens(name):
    """float32, CUDA graphs: the overlapped loop's tokens are the plain fast loop's."""
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]
    opts = CASES[name] | dict(runner="fast")
    _, plain = _run(m32, prompts, GREEDY, arrivals=arrivals, **opts)
    engine, ahead = _run(m32, prompts, GREEDY, arrivals=arrivals, overlap=True, **opts)
    assert ahead == plain
    assert engine.ahead.ahead > 0 and engine.runner._graphs
