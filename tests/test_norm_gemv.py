"""RMSNorm (and SwiGLU) folded into the projection after it: ``norm_gemv`` against the plain
model's own methods on NumPy, the fast runner folding or not against the plain runner, and on
a GPU the one kernel against the launches it replaces (rms_norm, the few-row multiply,
silu_mul), bit for bit, and three graph nodes fewer a layer.

Seeds are fixed in the code.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels.fused import rms_norm, silu_mul
from pagedkv.kernels.gemm import gemm
from pagedkv.kernels.norm_gemv import norm_gemv
from pagedkv.model import Llama, LlamaConfig, PagedKV, random_weights
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import FastRunner

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
SEED = 1357
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_weights(TINY, SEED), xp=np)


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
def test_folding_takes_three_nodes_a_layer_out_of_the_graph():
    """At batch 1 the graph loses both norms and SwiGLU in every layer and the final norm:
    3 x layers + 1 nodes fewer; float16 tokens equal to the unfolded graph's."""
    m16 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    prompt = [np.random.default_rng(SEED).integers(1, TINY.vocab_size, 12).tolist()]
    runs = [_tokens(m16, "fast", prompt, fold_rows=f) for f in (0, 1)]
    nodes = [e.runner.graph_nodes(1) for e, _ in runs]
    assert None not in nodes, nodes
    assert nodes[0] - nodes[1] == 3 * TINY.layers + 1, nodes
    assert runs[0][1] == runs[1][1]
