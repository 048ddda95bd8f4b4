"""One forward pass per engine step: a step's last prefill pack and its decode rows as one
flattened batch (``FastRunner.mixed``, ``Engine(single_pass=True)``).

The runner's single pass gives the logits (and the decode rows' greedy tokens and the
cache) that a prefill pass and then a decode pass give, by either of its two routes. The
engine's answers with the single pass are token for token those with two passes (and the
contiguous-cache oracle's) over chunked prefill, prefix-cache hits, preemption by recompute
and by swap, parallel samples, beams, seeded sampling and stop conditions; and the single
pass really ran, with requests back from a recompute decoded in the pass that prefills
them. Seeds are fixed and printed.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.model import Llama, LlamaConfig, PagedKV, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.llama import Batch
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import FastRunner

single_thread_blas()

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
SEED = 20261203
STOP = (0,)
BS = 8
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


@pytest.fixture(scope="module")
def tiny():
    print(f"seed={SEED}")
    return Llama(TINY, random_weights(TINY, SEED), xp=np)


# ------------------------------------------------------------------ the runner

def _i32(a):
    return np.asarray(a, dtype=np.int32)


def _tables(manager, ids):
    tables = [manager.block_table(i) for i in ids]
    out = np.full((len(ids), max(map(len, tables))), -1, np.int32)
    for row, t in zip(out, tables):
        row[:len(t)] = t
    return out


def _prefill_batch(manager, parts, tokens):
    """A prefill Batch: ``parts`` is (seq id, new tokens) with their plans made here."""
    slots, copies, toks, positions = [], [], [], []
    for seq_id, n in parts:
        start = manager.num_tokens(seq_id) if seq_id in manager.seq_ids else 0
        plan = manager.append(seq_id, n) if start else manager.add(seq_id, n)
        slots.append(plan.slots)
        copies.append(plan.copies)
        toks += tokens[seq_id][start:start + n]
        positions += range(start, start + n)
    ids = [i for i, _ in parts]
    return Batch(_i32(toks), _i32(positions), _i32(np.concatenate(slots)),
                 _i32([n for _, n in parts]), _i32([manager.num_tokens(i) for i in ids]),
                 _tables(manager, ids), _i32(np.concatenate(copies)).reshape(-1, 2))


def _scene(model, runner_options):
    """A pool and a runner where three sequences are in the cache and a fourth is forked from
    the third (its decode copies a shared, partly filled block); then the step's parts: a
    new 12-token prompt, a chunk of 7 in the middle of a block of a sequence half
    prefilled, and one token for each of the four decoding sequences."""
    kv = PagedKV.for_model(model, 64, BS)
    runner = FastRunner(model, kv, max_batch=32, **runner_options)
    rng = np.random.default_rng(SEED)
    tokens = {i: rng.integers(1, TINY.vocab_size, 40).tolist() for i in range(6)}
    m = kv.manager
    runner.prefill(_prefill_batch(m, [(0, 5), (1, 17), (2, 11), (4, 10)], tokens))
    m.fork(2, 3)
    tokens[3] = list(tokens[2])
    prefill = _prefill_batch(m, [(5, 12), (4, 7)], tokens)
    ids = [0, 1, 2, 3]
    lengths = [m.num_tokens(i) for i in ids]
    plan = m.step(ids)
    decode = Batch(_i32([tokens[i][n] for i, n in zip(ids, lengths)]), plan.seq_lens - 1,
                   plan.slot_mapping, np.ones(4, np.int32), plan.seq_lens,
                   plan.block_tables, plan.copies)
    assert len(decode.copies) == 1                 # the fork's shared block, copied
    return kv, runner, prefill, decode


@pytest.mark.parametrize("route", ["eager", "rows"])
def test_the_single_pass_computes_what_two_passes_do(tiny, route):
    """Same logits (float tolerance), same greedy tokens, same cache: ``mixed`` against
    ``prefill`` then ``decode`` on a copy of the same pool. "rows" takes the short-prefill
    route (the prefill's tokens as rows beside the decode rows: on a GPU one graph
    replay), chosen here by telling the NumPy runner it has graphs."""
    kv2, two, prefill, decode = _scene(tiny, {})
    kv1, one, prefill1, decode1 = _scene(tiny, {"single_pass": True})
    assert all(np.array_equal(a, b) for a, b in zip(prefill, prefill1))
    if route == "rows":
        two.graphs = one.graphs = True             # (on NumPy: the same kernels, no graph)
    assert one._short(prefill, beside=len(decode.tokens)) == (route == "rows")
    p_logits, _ = two.prefill(prefill)
    d_logits, d_greedy = two.decode(decode)
    first, logits, greedy = one.mixed(prefill1, decode1)
    assert first.shape == p_logits.shape == (2, TINY.vocab_size)
    assert logits.shape == d_logits.shape == (4, TINY.vocab_size)
    np.testing.assert_allclose(first, p_logits, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(logits, d_logits, rtol=1e-4, atol=1e-4)
    assert greedy == d_greedy == np.argmax(d_logits, axis=1).tolist()
    for a, b in zip(kv1.layers, kv2.layers):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_the_single_pass_refusals(tiny):
    kv, runner, prefill, decode = _scene(tiny, {"single_pass": True})
    with pytest.raises(ConfigError, match="one new token per decode row"):
        runner.mixed(prefill, prefill)
    with pytest.raises(ConfigError, match="single_pass needs a fast runner"):
        Engine(tiny, num_blocks=8, single_pass=True)
    assert Engine(tiny, num_blocks=8, runner="fast").runner.single_pass is False


# ------------------------------------------------------------------ the engine

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=14),
    "sampled": SamplingParams(max_new_tokens=10, temperature=0.9, top_p=0.9, seed=5),
    "n3": SamplingParams(max_new_tokens=8, temperature=1.0, n=3, seed=6),
    "beam3": SamplingParams(max_new_tokens=8, beam_width=3),
    "stops": SamplingParams(max_new_tokens=12, temperature=1.3, seed=8),
    "min3": SamplingParams(max_new_tokens=12, temperature=1.3, seed=9, min_tokens=3),
}
ORACLE: dict = {}
# (prefix caching, preemption, host blocks, pool)
CONFIGS = {
    "roomy": (False, "recompute", 0, "roomy"),
    "cache": (True, "recompute", 0, "roomy"),
    "recompute": (False, "recompute", 0, "tight"),
    "cache+recompute": (True, "recompute", 0, "tight"),
    "swap": (False, "swap", 64, "tight"),
}
STOPS = (0, 1, 2, 3, 4, 5)          # "stops" and "min3": a stop token is likely early


def _prompts():
    rng = np.random.default_rng(SEED)
    head = rng.integers(1, TINY.vocab_size, 21).tolist()      # a shared "system prompt"
    return [head + rng.integers(1, TINY.vocab_size, n).tolist()
            for n in (3, 30, 11, 47, 6, 19)]


class Watch:
    """What the single pass did over a run: passes, and sequences that were prefilled and
    decoded in one pass (requests back from a recompute)."""

    def __init__(self, engine):
        self.passes = self.both = 0
        run = engine.run_mixed

        def run_mixed(rows, schedule):
            run(rows, schedule)
            self.passes += 1
            decoded = {s.seq_id for s in schedule.seqs}
            self.both += sum(seq.seq_id in decoded for _, (seq, *_) in rows)
        engine.run_mixed = run_mixed


def _run(model, kind, config, budget, single_pass, stagger, runner="fast-eager"):
    caching, preemption, host_blocks, pool = CONFIGS[config]
    params, prompts = PARAMS[kind], _prompts()
    stops = STOPS if kind in ("stops", "min3") else STOP
    worst = max(params.width * -(-(len(p) + params.max_new_tokens) // BS) for p in prompts)
    blocks = worst + 2 if pool == "tight" else 300
    engine = Engine(model, num_blocks=blocks, block_size=BS, stop_ids=stops, audit=True,
                    prefix_caching=caching, preemption=preemption, max_seqs=16,
                    host_blocks=host_blocks, token_budget=budget, runner=runner,
                    single_pass=single_pass)
    watch = Watch(engine)
    reqs = []
    for i, p in enumerate(prompts):               # arrivals while others decode
        reqs.append(engine.submit(p, params))
        for _ in range(stagger if i % 2 else 0):
            engine.step()
    engine.run()
    assert engine.manager.allocator.num_free == blocks and len(engine.manager) == 0
    return engine, watch, [[s.generated for s in r.outputs()] for r in reqs]


def _oracle(model, kind):
    if kind not in ORACLE:
        stops = STOPS if kind == "stops" else STOP
        ORACLE[kind] = [[s.generated for s in reference_generate(model, p, PARAMS[kind],
                                                                 stops)]
                        for p in _prompts()]
    return ORACLE[kind]


RUNS: dict = {}


@pytest.mark.parametrize("stagger", [0, 2])
@pytest.mark.parametrize("budget", [None, 40, 13])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(PARAMS))
def test_single_pass_answers_equal_two_passes(tiny, kind, config, budget, stagger):
    _, _, two = _run(tiny, kind, config, budget, False, stagger)
    engine, watch, one = _run(tiny, kind, config, budget, True, stagger)
    assert one == two
    if kind != "min3":                             # (the oracle has no min_tokens)
        assert one == _oracle(tiny, kind)
    r = RUNS.setdefault(config, dict(runs=0, passes=0, both=0, preemptions=0, swapped=0))
    r["runs"] += 1
    r["passes"] += watch.passes
    r["both"] += watch.both
    r["preemptions"] += engine.counts.preemptions
    r["swapped"] += engine.counts.swapped_out


def test_the_runs_above_took_the_single_pass_and_preempted():
    """(Runs after the ones above.) Every configuration ran single passes; every tight one
    preempted (and the swap one swapped); a request back from a recompute was prefilled
    and decoded in one pass."""
    every = len(PARAMS) * 3 * 2                    # kinds x budgets x staggers, per config
    if set(RUNS) != set(CONFIGS) or any(r["runs"] != every for r in RUNS.values()):
        pytest.skip("run with all the tests above, in this process")
    print(RUNS)
    assert all(r["passes"] > 0 for r in RUNS.values())
    assert all(RUNS[c]["preemptions"] > 0 for c, v in CONFIGS.items() if v[3] == "tight")
    assert RUNS["swap"]["swapped"] > 0
    assert RUNS["recompute"]["both"] + RUNS["cache+recompute"]["both"] > 0


@pytest.mark.parametrize("kind", ["stops", "min3"])
def test_stop_conditions_were_exercised(tiny, kind):
    """The "stops" and "min3" workloads end answers early at a stop token; "min3" never
    before its third token."""
    _, _, answers = _run(tiny, kind, "roomy", 13, True, 2)
    ends = [a for ans in answers for a in ans if len(a) < PARAMS[kind].max_new_tokens]
    assert ends and all(a[-1] in STOPS for a in ends)
    if kind == "min3":
        assert all(t not in STOPS for ans in answers for a in ans for t in a[:3])


# ------------------------------------------------------------------ on the GPU

@gpu
@pytest.mark.parametrize("route", ["eager", "rows"])
def test_the_single_pass_on_the_gpu(route):
    """The same scene on CuPy in float16 (a float tolerance for the prefill kernel's 16-bit
    arithmetic); "rows" replays the decode graph once for both parts."""
    cp = backend.xp
    m = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    options = {} if route == "rows" else {"graphs": False}
    kv2, two, prefill, decode = _scene(m, options)
    kv1, one, prefill1, decode1 = _scene(m, dict(options, single_pass=True))
    assert one._short(prefill, beside=len(decode.tokens)) == (route == "rows")
    p_logits, _ = two.prefill(prefill)
    p_logits = p_logits.copy()
    d_logits, d_greedy = two.decode(decode)
    first, logits, greedy = one.mixed(prefill1, decode1)
    tol = dict(rtol=2e-2, atol=5e-2)
    np.testing.assert_allclose(cp.asnumpy(first), cp.asnumpy(p_logits), **tol)
    np.testing.assert_allclose(cp.asnumpy(logits), cp.asnumpy(d_logits), **tol)
    top2 = np.sort(cp.asnumpy(d_logits), axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 0.1        # rows without a near tie
    assert (np.array(greedy)[clear] == np.array(d_greedy)[clear]).all()


@gpu
@pytest.mark.parametrize("runner", ["fast", "fast-eager"])
@pytest.mark.parametrize("kind", ["greedy", "n3", "beam3"])
def test_the_engine_single_pass_on_the_gpu(kind, runner):
    """float32 on the GPU (the runners' attention is then the plain path's, in float32):
    the same answers with one pass a step and with two, with graphs and without."""
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    _, _, two = _run(m32, kind, "cache+recompute", 13, False, 2, runner)
    engine, watch, one = _run(m32, kind, "cache+recompute", 13, True, 2, runner)
    assert one == two and watch.passes > 0
