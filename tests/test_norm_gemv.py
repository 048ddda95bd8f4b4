"""RMSNorm (and SwiGLU) folded into the projection after it, and RoPE with the K/V write
folded into the q|k|v one: ``norm_gemv`` against the plain model's own methods on NumPy,
``norm_gemv_rope`` against ``norm_gemv`` then ``rope_write_kv`` (on NumPy, and its CUDA source
on the CPU emulator), the fast runner folding or not against the plain runner, and on a GPU
each kernel against the launches it replaces, bit for bit, and four graph nodes fewer a
layer.

Seeds are fixed in the code.
"""
import importlib.util
import pathlib
import shutil

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels.fused import rms_norm, rope_write_kv, silu_mul
from pagedkv.kernels.gemm import gemm
from pagedkv.kernels.norm_gemv import norm_gemv, norm_gemv_rope, norm_gemv_rope_unfused
from pagedkv.model import Llama, PagedKV, random_weights
from pagedkv.model import runner as runner_module
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import FastRunner
from _tiny import TINY

ROOT = pathlib.Path(__file__).resolve().parents[1]

SEED = 1357
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


def test_reference_is_the_models_norm_then_projection(tiny):
    """The NumPy path: the model's rms_norm then its matrix multiply; with ``silu``, the
    model's SwiGLU of the two halves (``Llama.finish_layer``'s arithmetic)."""
    rng, layer = np.random.default_rng(SEED), tiny.layers[0]
    x = rng.standard_normal((3, TINY.hidden)).astype(np.float32)
    out = np.full((3, 3 * TINY.heads * 64 // 2), np.nan, np.float32)
    wqkv = layer.wqkv[:, :out.shape[1]]
    norm_gemv(x, layer.attn_norm, TINY.norm_eps, wqkv.T, out)
    assert np.array_equal(out, tiny.rms_norm(x, layer.attn_norm) @ wqkv)
    act = np.full((3, TINY.ffn), np.nan, np.float32)
    norm_gemv(x, layer.mlp_norm, TINY.norm_eps, layer.w_gate_up.T, act, silu=True)
    gate_up = tiny.rms_norm(x, layer.mlp_norm) @ layer.w_gate_up
    g, u = gate_up[:, :TINY.ffn], gate_up[:, TINY.ffn:]
    assert np.array_equal(act, (g / (1.0 + np.exp(-g)) * u).astype(np.float32))


def test_refuses_shapes_that_do_not_fit(tiny):
    x = np.zeros((2, TINY.hidden), np.float32)
    w = np.zeros((10, TINY.hidden), np.float32)
    with pytest.raises(ConfigError, match="shapes do not fit"):
        norm_gemv(x, tiny.norm, 1e-5, w, np.zeros((2, 9), np.float32))
    with pytest.raises(ConfigError, match="2 N rows"):
        norm_gemv(x, tiny.norm, 1e-5, w[:9], np.zeros((2, 4), np.float32), silu=True)
    for bad in (-1, 9, True):
        with pytest.raises(ConfigError, match="fold_rows must be"):
            FastRunner(tiny, PagedKV.for_model(tiny, 8, 16), fold_rows=bad)


def _rope_case(xp, dtype, m, block_size, seed, *, hidden=64, heads=4, kv_heads=2, d=64,
               num_blocks=5, context=100):
    """Arguments of a ``norm_gemv_rope`` call on ``xp`` arrays: random x, weights and
    positions; distinct slots, the last row padding (slot -1) when there are two or more;
    NaN in qkv, q_out and the cache (what is never written stays NaN)."""
    rng = np.random.default_rng(seed)
    n = (heads + 2 * kv_heads) * d
    rand = lambda *s: xp.asarray(rng.standard_normal(s).astype(dtype))  # noqa: E731
    x, norm_w, w = rand(m, hidden), rand(hidden), rand(n, hidden) * 0.05
    positions = rng.integers(0, context, m).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:m].astype(np.int32)
    slots[-1] = -1 if m > 1 else slots[-1]
    ang = np.outer(np.arange(context), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos, sin = (xp.asarray(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    nan = lambda *s: xp.full(s, np.nan, dtype)  # noqa: E731
    return (x, norm_w, 1e-5, w, nan(m, n), xp.asarray(positions), xp.asarray(slots), cos, sin,
            nan(m, heads, d), nan(num_blocks, 2, block_size, kv_heads, d), heads, kv_heads)


def _fresh(case):
    """The same call with its own copies of the three outputs (qkv, q_out, cache)."""
    case = list(case)
    for i in (4, 9, 10):
        case[i] = case[i].copy()
    return case


def _bits(a):
    return a.view(f"uint{8 * a.dtype.itemsize}")


@pytest.mark.parametrize("m,block_size", [(1, 16), (2, 32), (8, 16)])
def test_rope_reference_is_norm_gemv_then_rope_write_kv(m, block_size):
    """The NumPy path: norm_gemv into qkv, then rope_write_kv from it, every output's bits
    (NaN where nothing is written: the padding row's slot, the blocks no slot names)."""
    case = _rope_case(np, np.float32, m, block_size, SEED + m)
    got, want = _fresh(case), _fresh(case)
    assert norm_gemv_rope(*got) is got[9]
    x, norm_w, eps, w, qkv, positions, slots, cos, sin, q_out, cache, heads, kvh = want
    norm_gemv(x, norm_w, eps, w, qkv)
    rope_write_kv(qkv, positions, slots, cos, sin, q_out, cache, heads, kvh)
    for i in (4, 9, 10):
        assert np.array_equal(_bits(got[i]), _bits(want[i])), i
    written = ~np.isnan(got[10]).all(axis=(3, 4))                # [block, k|v, offset]
    assert written.sum() == 2 * int((slots >= 0).sum())


def test_rope_refuses_shapes_that_do_not_fit():
    case = _rope_case(np, np.float32, 2, 16, SEED)
    bad = {4: case[4][:, :-2], 9: case[9][:, :3], 10: case[10][..., :32],
           7: case[7][:, :16], 3: case[3][:-1]}
    for i, a in bad.items():
        call = list(case)
        call[i] = a
        with pytest.raises(ConfigError, match="shapes do not fit"):
            norm_gemv_rope(*call)
    for i, a, what in ((5, case[5].astype(np.int64), "int32"),
                       (6, case[6][:1], "one entry per row")):
        call = list(case)
        call[i] = a
        with pytest.raises(ConfigError, match=what):
            norm_gemv_rope(*call)


def _emulator():
    spec = importlib.util.spec_from_file_location("emulate", ROOT / "perf/emu/emulate.py")
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    return emulate


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m,block_size", [(1, 16), (2, 32), (8, 16), (8, 32)])
def test_rope_kernel_source_on_the_cpu_emulator(dtype, m, block_size):
    """norm_gemv_rope_t's own CUDA source, run on the CPU (perf/emu): the same bits as
    norm_gemv_t then rope_write_kv emulated alike, and within rounding of the NumPy
    reference, NaN exactly where the reference wrote nothing. A GPU run checks the rest
    (the device's own arithmetic)."""
    seed = SEED + 10 * m + block_size
    same, err = _emulator().check_norm_gemv_rope(dtype, m, block_size, seed)
    assert same, seed
    assert err < (1e-2 if dtype == np.float16 else 1e-5), (seed, err)


def _tokens(model, runner, prompts, fold_rows=None):
    engine = Engine(model, num_blocks=200, block_size=16, stop_ids=(0,), audit=True,
                    runner=runner)
    if fold_rows is not None:          # read by every pass: set before the first
        engine.runner.fold_rows = fold_rows
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=16))
    return engine, [r.outputs()[0].generated for r in reqs]


@pytest.mark.parametrize("fold_rows", [0, 1, 8])
def test_fast_runner_folding_or_not_equals_plain(tiny, fold_rows):
    """One prompt (every decode pass a single row) and five (passes of up to five rows): the
    same tokens as the plain runner whether the passes fold or not."""
    rng = np.random.default_rng(SEED)
    for lengths in ((9,), (5, 17, 1, 33, 16)):
        prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]
        _, plain = _tokens(tiny, "plain", prompts)
        engine, fast = _tokens(tiny, "fast", prompts, fold_rows=fold_rows)
        assert engine.runner.fold_rows == fold_rows
        assert fast == plain, (fold_rows, lengths)


# ------------------------------------------------------------------ on the GPU

@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m", [1, 2, 8])
def test_kernel_equals_the_launches_it_replaces(dtype, m):
    """rms_norm then the few-row multiply (then silu_mul): the same bits, outputs poisoned
    first; the head's float32 logits too. SmolLM2's widths: 576 in, 960 / 2 x 1536 / 49152
    out."""
    cp, rng = backend.xp, np.random.default_rng(SEED + m)
    rand = lambda *s: cp.asarray(rng.standard_normal(s).astype(dtype))  # noqa: E731
    x, nw = rand(m, 576), rand(576)
    for n, silu, out_dtype in ((960, False, dtype), (1536, True, dtype),
                               (49152, False, np.float32)):
        w = rand(2 * n if silu else n, 576) * 0.05
        got = cp.full((m, n), np.nan, out_dtype)
        norm_gemv(x, nw, 1e-5, w, got, silu=silu)
        h = rms_norm(x, nw, 1e-5)
        prod = cp.full((m, w.shape[0]), np.nan, dtype if silu else out_dtype)
        gemm(h, w, prod, transpose_b=True, method="gemv")
        want = silu_mul(prod) if silu else prod
        assert cp.array_equal(got, want), (n, silu)


@gpu
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_rope_kernel_equals_the_launches_it_replaces(dtype, m, block_size):
    """norm_gemv then rope_write_kv on the GPU: the same bits in qkv, q_out and the cache
    (NaN-poisoned first: a padding row and unnamed slots stay so). SmolLM2's shapes: 576
    in, 9 q heads and 3 kv heads of 64."""
    case = _rope_case(backend.xp, dtype, m, block_size, SEED + m, hidden=576, heads=9,
                      kv_heads=3, num_blocks=7, context=2048)
    got, want = _fresh(case), _fresh(case)
    norm_gemv_rope(*got)
    norm_gemv_rope_unfused(*want)
    for i, what in ((4, "qkv"), (9, "q_out"), (10, "cache")):
        assert backend.xp.array_equal(_bits(got[i]), _bits(want[i])), what
    slots = case[6].get()
    written = ~backend.xp.isnan(got[10]).all(axis=(3, 4))
    assert int(written.sum()) == 2 * int((slots >= 0).sum())


@gpu
def test_folding_takes_four_nodes_a_layer_out_of_the_graph(monkeypatch):
    """At batch 1 the graph loses both norms, SwiGLU and RoPE's launch in every layer and the
    final norm: 4 x layers + 1 nodes fewer than unfolded, of which one a layer is RoPE's (the
    runner with the two launches norm_gemv_rope replaces); float16 tokens equal in all
    three."""
    m16 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    prompt = [np.random.default_rng(SEED).integers(1, TINY.vocab_size, 12).tolist()]
    runs = [_tokens(m16, "fast", prompt, fold_rows=f) for f in (0, 1)]
    with monkeypatch.context() as patch:
        patch.setattr(runner_module, "norm_gemv_rope", norm_gemv_rope_unfused)
        runs.append(_tokens(m16, "fast", prompt, fold_rows=1))
    nodes = [e.runner.graph_nodes(1) for e, _ in runs]
    assert None not in nodes, nodes
    assert nodes[0] - nodes[1] == 4 * TINY.layers + 1, nodes
    assert nodes[2] - nodes[1] == TINY.layers, nodes
    assert runs[0][1] == runs[1][1] == runs[2][1]
