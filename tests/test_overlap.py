"""The engine's loop with the device running ahead (``depth`` 1, ``Engine(overlap=True)``) and
without (``depth`` 0), both on the CPU, against the contiguous-cache oracle: every request —
greedy, sampled, ``n`` samples, beam search, ``min_tokens``, ``ignore_eos`` — gets the
oracle's answer token for token, under late stops, prefix caching, both bookkeepings,
preemption by recompute and by swap, token budgets, requests that arrive and leave
mid-run, and cancellation while a step is in flight; the pool is audited after every step
and whole at the end. Then the manager's reserve/commit split on its own. Seeds are fixed
and printed.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import ConfigError
from pagedkv.fast import BlockAllocator as FastAllocator
from pagedkv.fast.prefix import PrefixCachingManager as FastPrefix
from pagedkv.model import Llama, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from pagedkv.prefix_cache import PrefixCachingManager
from _engine_cases import CASES, GREEDY, MIXED
from _tiny import TINY

single_thread_blas()

SEED = 8086
STOPS = (0, 7, 9)            # end tokens common enough to stop many sequences early
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


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
    while steps <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == steps:
                reqs[i] = engine.submit(prompts[i], params[i])
        for i, at in (cancel or {}).items():
            if at == steps and reqs[i] is not None:
                engine.cancel(reqs[i])
        engine.step()
        steps += 1
        assert steps < 2_000, "the engine still has work after 2,000 steps"
    m = engine.memory.manager
    assert m.allocator.num_free == kw["num_blocks"] or kw.get("prefix_caching")
    assert len(m) == 0 and not m.pending()
    m.audit()
    return engine, [[s.generated for s in r.outputs()] for r in reqs]


def _oracle(model, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [[s.generated for s in reference_generate(model, p, q, STOPS)]
            for p, q in zip(prompts, params)]


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_request_gets_the_oracles_answer(tiny, name, overlap):
    print(f"seed={SEED}")
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]                  # requests join a running batch
    engine, got = _run(tiny, prompts, MIXED, arrivals=arrivals, overlap=overlap,
                       **CASES[name])
    assert engine.depth == int(overlap)
    assert got == _oracle(tiny, prompts, MIXED)
    stopped = sum(len(o[0]) < p.max_new_tokens for o, p in zip(got, MIXED))
    assert stopped > 0                                  # some stopped on an end token
    if "num_blocks" in CASES[name]:
        assert engine.memory.counts.preemptions > 0
    if name == "recompute":
        assert engine.memory.counts.recomputed_tokens > 0   # answers begun, computed again
    if name == "swap":
        assert engine.memory.counts.swapped_out > 0


@pytest.mark.parametrize("name", ["late stops", "swap", "budget"])
def test_greedy_batches_give_the_same_tokens_ahead_and_not(tiny, name):
    """Greedy requests only (every step of the loop runs ahead): the same answers, and
    the loop ran ahead."""
    prompts = _prompts(SEED + 1)
    _, plain = _run(tiny, prompts, GREEDY, **CASES[name])
    engine, ahead = _run(tiny, prompts, GREEDY, overlap=True, **CASES[name])
    assert ahead == plain == _oracle(tiny, prompts, GREEDY)


def test_blocks_named_ahead_are_found_by_their_tokens(tiny):
    """The blocks a generated answer filled are named at commit by their true ids: its
    prompt + answer, submitted again, finds as many cached tokens ahead as not."""
    prompts = _prompts(SEED + 2, 5)
    found = []
    for overlap in (False, True):
        engine, out = _run(tiny, prompts, GREEDY, prefix_caching=True, overlap=overlap)
        before = engine.memory.counts.cached_tokens
        again = [p + o[0] for p, o in zip(prompts, out)]
        engine.generate(again, SamplingParams(max_new_tokens=1))
        found.append((out, engine.memory.counts.cached_tokens - before))
    assert found[0] == found[1]
    assert found[1][1] >= 16 * len(prompts)             # every answer's blocks, found


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_cancel_while_a_step_is_in_flight(tiny, overlap):
    """A cancelled request keeps a prefix of its answer; the others are unchanged; every
    block comes back."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED + 3, 5)
    _, plain = _run(tiny, prompts, MIXED[:5])
    long = [i for i, p in enumerate(plain) if len(p[0]) == MIXED[i].max_new_tokens
            and MIXED[i].beam_width == 1]
    assert len(long) >= 2                              # two that would run to their limit
    cancel = {long[0]: 4, long[1]: 7}
    engine, got = _run(tiny, prompts, MIXED[:5], cancel=cancel, overlap=overlap)
    for i, (a, p) in enumerate(zip(got, plain)):
        if i in cancel:
            assert all(p[j][:len(a[j])] == a[j] for j in range(len(a)))
            assert len(a[0]) < len(p[0])
        else:
            assert a == p
    assert engine.memory.manager.allocator.num_free == 300


def test_a_step_ahead_lands_one_step_later(tiny):
    """With depth 1 a step's tokens land at the next step; a step with beam rows lands at
    once."""
    engine = Engine(tiny, num_blocks=64, stop_ids=(), runner="fast-eager", overlap=True)
    req = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=3))
    assert engine.step() == [] and len(engine.flight) == 1
    assert req.live[0].num_generated == 0 and req.live[0].planned == 2
    engine.step()                                      # lands the first: two tokens
    assert req.live[0].num_generated == 2 and len(engine.flight) == 1
    assert engine.step() == [req] and req.done
    assert not engine.flight and not engine.has_work()   # nothing left: all landed
    beam = engine.submit([4, 5], SamplingParams(max_new_tokens=3, beam_width=2))
    engine.step()
    assert not engine.flight and len(beam.live) == 2   # ranked on the host, now


def test_overlap_must_be_a_bool(tiny):
    with pytest.raises(ConfigError, match="overlap must be"):
        Engine(tiny, num_blocks=16, overlap="yes")


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
def test_ahead_on_the_gpu_gives_the_oracles_answers(name):
    """float32, CUDA graphs, the device running ahead: every request of every kind gets
    the contiguous oracle's answer (computed on the CPU)."""
    cpu = Llama(TINY, random_weights(TINY, SEED), xp=np)
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]
    opts = CASES[name] | dict(runner="fast")
    engine, got = _run(m32, prompts, MIXED, arrivals=arrivals, **opts)
    assert engine.depth == 1 and engine.runner._graphs
    assert got == _oracle(cpu, prompts, MIXED)
