"""The fast decode path: fused kernels against their NumPy references (and those against the
plain model's own methods), cuBLAS through ctypes against NumPy, the fast runner's engine
against the plain one, and on a GPU the CUDA graphs against the same kernels run eagerly.

Seeds are fixed and appear in the test ids or the code.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import write_kv_ref
from pagedkv.kernels.fused import argmax_rows, embed, rms_norm, rope_write_kv, silu_mul
from pagedkv.kernels.gemm import gemm
from pagedkv.model import Llama, PagedKV, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.llama import Batch
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import FastRunner, buckets, graph_node_count
from _tiny import TINY

single_thread_blas()

SEED = 2468
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


# ------------------------------------------------------------------ references vs the model

def test_rms_norm_reference_is_the_models(tiny):
    x = np.random.default_rng(1).standard_normal((5, TINY.hidden)).astype(np.float32)
    w = tiny.layers[0].attn_norm
    out = np.full_like(x, np.nan)
    rms_norm(x, w, TINY.norm_eps, out=out)
    assert np.array_equal(out, tiny.rms_norm(x, w))


def test_rope_write_kv_reference_is_the_models(tiny):
    """q rotated as Llama.qkv rotates it; k rotated and v as they are, at their slots; a
    padding slot writes nothing."""
    rng = np.random.default_rng(2)
    c = TINY
    t, nq, nk = 6, c.heads * c.head_dim, c.kv_heads * c.head_dim
    qkv = rng.standard_normal((t, nq + 2 * nk)).astype(np.float32)
    positions = np.array([0, 3, 7, 100, 511, 2], np.int32)
    slots = np.array([5, 0, -1, 17, 31, 8], np.int32)
    cache = rng.standard_normal((4, 2, 8, c.kv_heads, c.head_dim)).astype(np.float32)
    expect = cache.copy()
    q_out = np.full((t, c.heads, c.head_dim), np.nan, np.float32)
    rope_write_kv(qkv, positions, slots, tiny.cos, tiny.sin, q_out, cache, c.heads,
                  c.kv_heads)
    q = tiny.rope(qkv[:, :nq].reshape(t, c.heads, c.head_dim), positions)
    k = tiny.rope(qkv[:, nq:nq + nk].reshape(t, c.kv_heads, c.head_dim), positions)
    v = qkv[:, nq + nk:].reshape(t, c.kv_heads, c.head_dim)
    write_kv_ref(expect, k, v, slots)
    assert np.array_equal(q_out, q)
    assert np.array_equal(cache, expect)


def test_silu_mul_embed_argmax_references():
    rng = np.random.default_rng(3)
    gu = rng.standard_normal((4, 20)).astype(np.float32)
    g, u = gu[:, :10], gu[:, 10:]
    assert np.allclose(silu_mul(gu), g / (1 + np.exp(-g)) * u, rtol=1e-6)
    table = rng.standard_normal((9, 3)).astype(np.float32)
    tokens = np.array([8, 0, 8, 4], np.int32)
    assert np.array_equal(embed(tokens, table), table[[8, 0, 8, 4]])
    logits = np.zeros((3, 7), np.float32)
    logits[0, [2, 5]] = 1.0                  # a tie: the first index wins
    logits[1, 6] = 3.0
    logits[2] = -1.0
    assert argmax_rows(logits).tolist() == [2, 6, 0]


def test_fused_refuse_wrong_out_and_dtypes():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ConfigError, match=r"out must be \(2, 4\) float32"):
        rms_norm(x, np.ones(4, np.float32), 1e-5, out=np.ones((3, 4), np.float32))
    with pytest.raises(ConfigError, match="logits must be float32"):
        argmax_rows(np.ones((2, 3), np.float16))
    with pytest.raises(ConfigError, match=r"out must be \(2, 2\) float32"):
        silu_mul(x, out=np.ones((2, 4), np.float32))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gemm_numpy(accumulate, transpose_b):
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 5)).astype(np.float32)
    b = rng.standard_normal((7, 5) if transpose_b else (5, 7)).astype(np.float32)
    out = rng.standard_normal((3, 7)).astype(np.float32)
    expect = (out if accumulate else 0) + a @ (b.T if transpose_b else b)
    gemm(a, b, out, accumulate=accumulate, transpose_b=transpose_b)
    assert np.allclose(out, expect, atol=1e-5)


def test_gemm_refuses_shapes():
    a, b = np.ones((3, 5), np.float32), np.ones((4, 7), np.float32)
    with pytest.raises(ConfigError, match="gemm shapes do not fit"):
        gemm(a, b, np.ones((3, 7), np.float32))


def test_buckets():
    assert buckets(1) == [1]
    assert buckets(5) == [1, 2, 4, 5]
    assert buckets(20) == [1, 2, 4, 8, 16, 20]
    b = buckets(256)
    assert b[:4] == [1, 2, 4, 8] and b[-1] == 256 and b == sorted(set(b))
    assert all(y - x == (8 if x < 64 else 16) for x, y in zip(b[3:], b[4:]))


# ------------------------------------------------------------------ the engine on both runners

def _prompts(seed, lengths=(5, 17, 1, 33, 16)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=20),
    "sampled": SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7),
    "n4": SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=11),
    "beam4": SamplingParams(max_new_tokens=12, beam_width=4),
}


def _generate(model, runner, params, num_blocks=300, prompts=None, **options):
    engine = Engine(model, num_blocks=num_blocks, block_size=16, stop_ids=(0,), audit=True,
                    runner=runner, **options)
    reqs = engine.generate(prompts or _prompts(SEED), params)
    assert engine.memory.manager.allocator.num_free == num_blocks
    return engine, [[s.generated for s in r.outputs()] for r in reqs]


@pytest.mark.parametrize("kind", list(PARAMS))
def test_fast_runner_equals_plain_on_numpy(tiny, kind):
    """Greedy, sampling, parallel samples and beams: the same tokens on both runners."""
    _, plain = _generate(tiny, "plain", PARAMS[kind])
    _, fast = _generate(tiny, "fast", PARAMS[kind])
    assert fast == plain


def test_fast_runner_under_preemption_and_swap(tiny):
    """A pool too small for everyone: recompute and swap preemptions, same tokens."""
    params = SamplingParams(max_new_tokens=24)
    for preemption in ("recompute", "swap"):
        opts = dict(preemption=preemption, host_blocks=40 if preemption == "swap" else 0)
        e_plain, plain = _generate(tiny, "plain", params, num_blocks=10, **opts)
        e_fast, fast = _generate(tiny, "fast", params, num_blocks=10, **opts)
        assert e_fast.memory.counts.preemptions > 0
        assert fast == plain


def test_fast_runner_refusals(tiny):
    with pytest.raises(ConfigError, match="block sizes"):
        FastRunner(tiny, PagedKV.for_model(tiny, 8, 1))
    with pytest.raises(ConfigError, match="gemm_method must be"):
        FastRunner(tiny, PagedKV.for_model(tiny, 8, 16), gemm_method="fastest")
    with pytest.raises(ConfigError, match="fold_rows must be"):
        FastRunner(tiny, PagedKV.for_model(tiny, 8, 16), fold_rows=9)
    with pytest.raises(ConfigError, match="runner must be"):
        Engine(tiny, num_blocks=8, runner="turbo")
    engine = Engine(tiny, num_blocks=64, runner="fast", max_context=64)
    with pytest.raises(ConfigError, match="runner's max context of 64"):
        engine.submit(list(range(1, 50)), SamplingParams(max_new_tokens=20))
    if not backend.on_gpu:
        with pytest.raises(ConfigError, match="CUDA graphs need"):
            FastRunner(tiny, PagedKV.for_model(tiny, 8, 16), graphs=True)
    runner = FastRunner(tiny, PagedKV.for_model(tiny, 8, 16), max_batch=2)
    one = np.ones(3, np.int32)
    batch = Batch(one, one, one, one, one, np.zeros((3, 1), np.int32),
                  np.zeros((0, 2), np.int32))
    with pytest.raises(ConfigError, match="more than max_batch = 2"):
        runner.decode(batch)


# ------------------------------------------------------------------ on the GPU

def _rand(rng, shape, dtype):
    return backend.xp.asarray(rng.standard_normal(shape).astype(dtype))


@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fused_kernels_equal_references(dtype):
    """Each CUDA kernel against its NumPy reference on fresh random data, outputs poisoned
    first (every element must be written)."""
    cp, rng = backend.xp, np.random.default_rng(5)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-5)
    x, w = _rand(rng, (7, 576), dtype), _rand(rng, (576,), dtype)
    out = cp.full((7, 576), np.nan, dtype)
    rms_norm(x, w, 1e-5, out=out)
    assert np.allclose(out.get(), rms_norm(x.get(), w.get(), 1e-5), **tol)
    gu = _rand(rng, (7, 2 * 1536), dtype)
    out = cp.full((7, 1536), np.nan, dtype)
    silu_mul(gu, out=out)
    assert np.allclose(out.get(), silu_mul(gu.get()), **tol)
    table, tokens = _rand(rng, (100, 576), dtype), cp.asarray([99, 0, 5, 5], np.int32)
    out = cp.full((4, 576), np.nan, dtype)
    assert np.array_equal(embed(tokens, table, out=out).get(), table.get()[[99, 0, 5, 5]])
    logits = rng.standard_normal((5, 49152)).astype(np.float32)
    logits[2, [7, 4000]] = 100.0                                   # a tie
    assert argmax_rows(cp.asarray(logits)).get().tolist() == np.argmax(logits, 1).tolist()


@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_rope_write_kv_kernel_equals_reference(dtype):
    cp, rng = backend.xp, np.random.default_rng(6)
    heads, kvh, d, t = 9, 3, 64, 6
    qkv = _rand(rng, (t, (heads + 2 * kvh) * d), dtype)
    positions = cp.asarray([0, 1, 9, 200, 8191, 3], np.int32)
    slots = cp.asarray([5, 0, -1, 77, 127, 64], np.int32)
    ang = np.outer(np.arange(8192), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos, sin = (cp.asarray(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    cache = _rand(rng, (8, 2, 16, kvh, d), dtype)
    ref_cache, ref_q = cache.get(), np.zeros((t, heads, d), dtype)
    q = cp.full((t, heads, d), np.nan, dtype)
    rope_write_kv(qkv, positions, slots, cos, sin, q, cache, heads, kvh)
    rope_write_kv(qkv.get(), positions.get(), slots.get(), cos.get(), sin.get(), ref_q,
                  ref_cache, heads, kvh)
    tol = dict(rtol=2e-3, atol=2e-3) if dtype == np.float16 else dict(rtol=1e-5, atol=1e-5)
    assert np.allclose(q.get(), ref_q, **tol)
    assert np.allclose(cache.get(), ref_cache, **tol)


@gpu
@pytest.mark.parametrize("method", ["cublas", "auto", "gemv"])
@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("transpose_b", [False, True])
@pytest.mark.parametrize("m,k", [(1, 576), (3, 1536), (8, 576), (64, 576)])
def test_gemm_equals_float64(m, k, accumulate, transpose_b, method):
    """cuBLAS, and the few-row kernel (transposed, M <= 8; "auto" takes it up to 2 rows)."""
    if method == "gemv" and (not transpose_b or m > 8):
        pytest.skip("the few-row kernel takes b transposed and at most 8 rows")
    cp, rng = backend.xp, np.random.default_rng(7)
    a = rng.standard_normal((m, k)).astype(np.float16)
    b = rng.standard_normal((960, k) if transpose_b else (k, 960)).astype(np.float16)
    c0 = rng.standard_normal((m, 960)).astype(np.float16)
    out = cp.asarray(c0)
    gemm(cp.asarray(a), cp.asarray(b), out, accumulate=accumulate, transpose_b=transpose_b,
         method=method)
    ref = a.astype(np.float64) @ (b.T if transpose_b else b).astype(np.float64)
    ref += c0 if accumulate else 0
    err = np.linalg.norm(out.get().astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < 1e-3
    logits = cp.full((m, 960), np.nan, np.float32)                 # 16-bit in, float32 out
    gemm(cp.asarray(a), cp.asarray(b), logits, transpose_b=transpose_b, method=method)
    prod = a.astype(np.float64) @ (b.T if transpose_b else b).astype(np.float64)
    assert np.linalg.norm(logits.get() - prod) / np.linalg.norm(prod) < 1e-3


@gpu
def test_gemv_refuses_what_it_cannot_take():
    cp = backend.xp
    a, b = cp.ones((9, 576), cp.float16), cp.ones((960, 576), cp.float16)
    with pytest.raises(ConfigError, match="at most 8 rows"):
        gemm(a, b, cp.ones((9, 960), cp.float16), transpose_b=True, method="gemv")
    with pytest.raises(ConfigError, match="method must be"):
        gemm(a[:1], b, cp.ones((1, 960), cp.float16), transpose_b=True, method="fast")


@gpu
@pytest.mark.parametrize("transpose_b", [False, True])
def test_gemm_captures_into_a_graph(transpose_b):
    """The reason gemm exists: it replays from a CUDA graph, reading its input anew."""
    cp, rng = backend.xp, np.random.default_rng(8)
    a = _rand(rng, (8, 576), np.float16)
    b = _rand(rng, (3072, 576) if transpose_b else (576, 3072), np.float16)
    out = cp.zeros((8, 3072), np.float16)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        gemm(a, b, out, transpose_b=transpose_b)
        s.begin_capture()
        gemm(a, b, out, transpose_b=transpose_b)
        graph = s.end_capture()
        for _ in range(2):
            a[...] = _rand(rng, (8, 576), np.float16)
            graph.launch(s)
            s.synchronize()
            w = b.get().astype(np.float64)
            ref = a.get().astype(np.float64) @ (w.T if transpose_b else w)
            assert np.linalg.norm(out.get() - ref) / np.linalg.norm(ref) < 1e-3


@gpu
@pytest.mark.parametrize("kind", list(PARAMS))
def test_graphs_equal_eager_and_plain_on_gpu(kind):
    """float32 on the GPU: graph, eager and plain give the same tokens. float16: graph and
    eager the same tokens and the same K/V bytes (the same kernels, replayed)."""
    w = random_weights(TINY, SEED)
    m32 = Llama(TINY, w, dtype=np.float32)
    _, plain = _generate(m32, "plain", PARAMS[kind])
    _, graph = _generate(m32, "fast", PARAMS[kind])
    assert graph == plain
    m16 = Llama(TINY, w, dtype=np.float16)
    tokens, pools = [], []
    for runner in ("fast", "fast-eager"):
        engine = Engine(m16, num_blocks=300, block_size=16, stop_ids=(0,), runner=runner,
                        overlap=False)            # no step in flight when the pool is read
        reqs = [engine.submit(p, PARAMS[kind]) for p in _prompts(SEED)]
        for _ in range(6):
            engine.step()
        pools.append(engine.runner.kv.allocator.pool.get())
        engine.run()
        tokens.append([[s.generated for s in r.outputs()] for r in reqs])
    assert tokens[0] == tokens[1]
    assert np.array_equal(pools[0], pools[1])


@gpu
@pytest.mark.parametrize("method", ["cublas", "gemv"])
def test_gemm_method_gives_the_same_tokens(method):
    """``gemm_method`` forces cuBLAS or the few-row kernel for the multiplies of passes of
    1 to 7 rows: float32 logits within rounding of the default's measured choice, the same
    greedy tokens, pass after pass (each runner over its own pool, written alike)."""
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    runners = [FastRunner(m32, PagedKV.for_model(m32, 64, 16), max_batch=8,
                          max_context=512, gemm_method=gm) for gm in ("auto", method)]
    assert runners[1].fold_rows == 0                 # the folds are the "auto" choice's
    rng = np.random.default_rng(SEED)
    for step, n in enumerate((1, 4, 7)):
        pos = np.full(n, 40 + step, np.int32)
        tables = np.arange(n * 4, dtype=np.int32).reshape(n, 4)
        slots = (tables[np.arange(n), pos // 16] * 16 + pos % 16).astype(np.int32)
        batch = Batch(rng.integers(1, TINY.vocab_size, n).astype(np.int32), pos, slots,
                      np.ones(n, np.int32), pos + 1, tables, np.zeros((0, 2), np.int32))
        (la, ga), (lb, gb) = (r.decode(batch) for r in runners)
        assert ga == gb, step
        assert np.allclose(la.get(), lb.get(), rtol=1e-4, atol=1e-4), step


@gpu
def test_graph_replays_after_blocks_move():
    """Preemption by swap and recompute and prefix hits move a sequence's blocks between
    steps: the graph reads the new tables and gives the plain path's tokens (float32)."""
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    params = SamplingParams(max_new_tokens=24)
    shared = _prompts(SEED + 1, (40,))[0]             # a prefix every prompt starts with
    for opts in (dict(preemption="swap", host_blocks=40), dict(preemption="recompute"),
                 dict(prefix_caching=True)):
        blocks = 10 if "preemption" in opts else 300
        prompts = None if "preemption" in opts else [shared + p for p in _prompts(SEED)]
        e_plain, plain = _generate(m32, "plain", params, blocks, prompts, **opts)
        e_fast, fast = _generate(m32, "fast", params, blocks, prompts, **opts)
        assert e_fast.runner._graphs, "the fast engine replayed no graph"
        assert fast == plain, opts
        if "prefix_caching" in opts:
            assert e_fast.memory.counts.cached_tokens > 0


# ------------------------------------------------------------------ graph node counts

def test_graph_nodes_none_without_graphs(tiny):
    runner = FastRunner(tiny, PagedKV.for_model(tiny, 16, 16), max_batch=4, max_context=64)
    assert runner.graph_nodes(1) is None               # NumPy: nothing is captured


@pytest.mark.skipif(backend.on_gpu, reason="a null handle is only tried without a GPU")
def test_graph_node_count_none_when_nothing_answers():
    class NoGraph:
        graph = 0
    assert graph_node_count(NoGraph()) is None


@gpu
def test_graph_node_count_counts_captured_kernels():
    """Five in-place additions captured: five kernel nodes. A fast runner's graph has at
    least one node per operation of its pass (cuBLAS and the attention may add more)."""
    import solutions.ch12 as sol12
    cp = backend.xp
    x, s = cp.zeros(16, cp.float32), cp.cuda.Stream(non_blocking=True)
    with s:
        x += 1                                          # compiled before the capture
        s.synchronize()
        s.begin_capture()
        for _ in range(5):
            x += 1
        graph = s.end_capture()
    assert graph_node_count(graph) == 5
    m16 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    runner = FastRunner(m16, PagedKV.for_model(m16, 16, 16), max_batch=4, max_context=64,
                        fold_rows=0)          # the unfolded pass: one node an operation at least
    runner.capture_all()
    ops = sum(sol12.count_operations(TINY.layers).values())
    assert all(runner.graph_nodes(b) >= ops for b in runner.buckets)
