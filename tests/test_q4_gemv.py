"""Q4_1 weights read as stored: the dequantizer on a block built by hand and against gguf's,
the quantizer against gguf's copy of llama.cpp's reference, ``q4_gemv``'s NumPy path against
dequantize-then-matmul, the kernel's own CUDA source on the CPU emulator (perf/emu), on a GPU
the kernel against the float product, the loader's blocks against its float weights, and the
fast runner with ``weights="q4_1"`` against the fp16 runner on the dequantized model.

Seeds are fixed in the code (SEED, printed in failure messages).
"""
import importlib.util
import pathlib
import shutil

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import BF16
from pagedkv.kernels.q4_gemv import (BLOCK_BYTES, QK, dequantize_q4_1, q4_gemv,
                                     quantize_q4_1)
from pagedkv.model import Llama, LlamaConfig, ModelNotFound, PagedKV, random_weights
from pagedkv.model.engine import Engine
from pagedkv.model.gguf import Q4_PROJECTIONS, load_gguf, quantize_weights_q4
from pagedkv.model.llama import Batch
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import FastRunner
from pagedkv.model import runner as runner_module

ROOT = pathlib.Path(__file__).resolve().parents[1]
SEED = 4141
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")
TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)


def _block(d: float, m: float, q) -> np.ndarray:
    """One Q4_1 block by hand: d and m as fp16 bytes, then byte j = q[j] | q[j + 16] << 4."""
    q = np.asarray(q, np.uint8)
    packed = q[:16] | (q[16:] << 4)
    return np.concatenate([np.float16(d).reshape(1).view(np.uint8),
                           np.float16(m).reshape(1).view(np.uint8), packed])


def _random_blocks(rng, n: int, k: int) -> np.ndarray:
    """Blocks of a random [n, k] matrix: quantized Gaussian weights, as a model has."""
    return quantize_q4_1(rng.standard_normal((n, k)).astype(np.float32) * 0.05)


def _reference(x, blocks, out=None):
    """float64 x @ w.T of the blocks' weights, decoded here with plain loops over the bytes
    (sharing nothing with dequantize_q4_1), plus out when accumulating."""
    n, k = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES * QK
    w = np.empty((n, k))
    for r in range(n):
        for b in range(k // QK):
            blk = blocks[r, b * BLOCK_BYTES:(b + 1) * BLOCK_BYTES]
            d, m = (float(v) for v in blk[:4].view(np.float16))
            for j in range(16):
                w[r, b * QK + j] = d * (blk[4 + j] & 15) + m
                w[r, b * QK + 16 + j] = d * (blk[4 + j] >> 4) + m
    prod = np.asarray(x, np.float64) @ w.T
    return prod if out is None else prod + np.asarray(out, np.float64)


# ------------------------------------------------------------------ the format

def test_dequantize_a_block_built_by_hand():
    q = [(7 * i + 3) % 16 for i in range(32)]
    blocks = np.stack([np.concatenate([_block(0.5, -2.0, q), _block(0.25, 1.0, q[::-1])]),
                       np.concatenate([_block(0.0, 3.0, q), _block(-1.0, 0.0, q)])])
    assert blocks.shape == (2, 2 * BLOCK_BYTES)
    got = dequantize_q4_1(blocks)
    assert got.dtype == np.float32 and got.shape == (2, 64)
    q = np.array(q, np.float32)
    want = np.stack([np.concatenate([0.5 * q - 2.0, 0.25 * q[::-1] + 1.0]),
                     np.concatenate([np.full(32, 3.0), -q])])
    assert np.array_equal(got, want)


def test_dequantize_and_quantize_agree_with_gguf():
    """gguf-py's Q4_1 (the GGUF project's own NumPy port of llama.cpp's reference
    quantizer and dequantizer): the same bytes and the same floats."""
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType as T
    rng = np.random.default_rng(SEED)
    w = rng.standard_normal((37, 192)).astype(np.float32)
    w[3, 32:64] = 1.5                                       # a constant block: d = 0
    w[5] *= 1e-3
    ours = quantize_q4_1(w)
    assert np.array_equal(ours, quants.quantize(w, T.Q4_1)), SEED
    assert np.array_equal(dequantize_q4_1(ours), quants.dequantize(ours, T.Q4_1)), SEED


def test_quantize_rounds_to_the_nearest_level():
    rng = np.random.default_rng(SEED + 1)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    blocks = quantize_q4_1(w)
    err = np.abs(dequantize_q4_1(blocks) - w).reshape(8, 4, QK)
    d = blocks.reshape(8, 4, BLOCK_BYTES)[..., :2].copy().view(np.float16).astype(np.float32)
    # half a step, plus the fp16 rounding of d (15 steps) and m
    assert np.all(err <= 0.5 * d + 16 * np.abs(d) * 2.0 ** -11 + 2.0 ** -10 * 4), SEED


def test_refuses_what_is_not_blocks():
    x = np.zeros((2, 64), np.float32)
    good = np.zeros((3, 2 * BLOCK_BYTES), np.uint8)
    with pytest.raises(ConfigError, match="uint8"):
        q4_gemv(x, good.astype(np.int8), np.zeros((2, 3), np.float32))
    with pytest.raises(ConfigError, match="uint8"):
        q4_gemv(x, good[:, :30], np.zeros((2, 3), np.float32))
    with pytest.raises(ConfigError, match="shapes do not fit"):
        q4_gemv(x[:, :32], good, np.zeros((2, 3), np.float32))
    with pytest.raises(ConfigError, match="shapes do not fit"):
        q4_gemv(x, good, np.zeros((2, 4), np.float32))
    with pytest.raises(ConfigError, match="1 to 8 rows"):
        q4_gemv(np.zeros((9, 64), np.float32), good, np.zeros((9, 3), np.float32))
    with pytest.raises(ConfigError, match="float32 or x's dtype"):
        q4_gemv(x, good, np.zeros((2, 3), np.float16))
    with pytest.raises(ConfigError, match="multiple of 32"):
        quantize_q4_1(np.zeros((2, 48), np.float32))


# ------------------------------------------------------------------ the NumPy path

@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("dtype,out_dtype", [(np.float32, np.float32),
                                             (np.float16, np.float16),
                                             (np.float16, np.float32)])
def test_numpy_path_is_dequantize_then_matmul(m, dtype, out_dtype):
    rng = np.random.default_rng(SEED + m)
    blocks = _random_blocks(rng, 24, 96)
    x = rng.standard_normal((m, 96)).astype(dtype)
    got = np.full((m, 24), np.nan, out_dtype)
    q4_gemv(x, blocks, got)
    want = (x.astype(np.float32) @ dequantize_q4_1(blocks).T).astype(out_dtype)
    assert np.array_equal(got, want), SEED
    acc = rng.standard_normal((m, 24)).astype(out_dtype)
    before = acc.copy()
    q4_gemv(x, blocks, acc, accumulate=True)
    tol = 2.0 ** -10 if out_dtype == np.float16 else 1e-5
    ref = _reference(x, blocks, before)
    assert np.allclose(acc, ref, rtol=tol, atol=tol), SEED


# ------------------------------------------------------------------ the CUDA source, on the CPU

EMU_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int hdr[8];          // M K N accumulate grid x_bytes out_bytes (one number's)
    if (std::fread(hdr, 4, 8, f) != 8) return 2;
    const int M = hdr[0], K = hdr[1], N = hdr[2], acc = hdr[3], grid = hdr[4];
    std::vector<char> x((size_t)M * K * hdr[5]), out((size_t)M * N * hdr[6]);
    std::vector<unsigned> w((size_t)N * K / 32 * 5);
    auto rd = [&](void* p, size_t n) { if (n && std::fread(p, 1, n, f) != n) std::exit(2); };
    rd(x.data(), x.size()); rd(w.data(), w.size() * 4); rd(out.data(), out.size());
    std::fclose(f);
    gridDim = {(unsigned)grid, 1u, 1u};
    for (int c = 0; c < grid; ++c)
        emu::run_cta(c, 0, 256, (size_t)4 * M * K, [&] {
            KERNEL(x.data(), w.data(), out.data(), K, N, acc);
        });
    FILE* g = std::fopen(argv[2], "wb");
    std::fwrite(out.data(), 1, out.size(), g);
    std::fclose(g);
    return 0;
}
"""


def _emulate():
    spec = importlib.util.spec_from_file_location("emulate", ROOT / "perf/emu/emulate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_emulated(x, blocks, out, accumulate, rows_per_warp, grid):
    codes = {np.dtype(np.float32): 0, np.dtype(np.float16): 1, BF16: 2}
    name = f"q4_gemv<{codes[x.dtype]}, {codes[out.dtype]}, {x.shape[0]}, {rows_per_warp}>"
    emu = _emulate()
    hdr = np.array([x.shape[0], x.shape[1], blocks.shape[0], int(accumulate), grid,
                    x.itemsize, out.itemsize, 0], np.int32)
    bits = emu._execute(emu.binary("q4_gemv.cu", name, EMU_MAIN), [hdr, x, blocks, out],
                        (-1,))
    return bits.view(out.dtype).reshape(out.shape)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
@pytest.mark.parametrize("dtype,out_dtype,m,r,n,k,grid", [
    (np.float16, np.float16, 1, 1, 40, 64, 2),      # grid-stride: 16 warps for 40 rows
    (np.float16, np.float32, 3, 2, 37, 96, 1),      # a last warp with one row of its two
    (np.float32, np.float32, 8, 4, 33, 32, 1),      # R * M = 32 lanes write
    (np.float16, np.float16, 5, 4, 70, 288, 2),     # 36 quarter blocks: lanes wrap around
    ("bfloat16", np.float32, 2, 1, 9, 64, 1),       # bf16 x, float32 out
])
def test_the_cuda_source_on_the_cpu_emulator(dtype, out_dtype, m, r, n, k, grid):
    """The kernel's own source (perf/emu): block and nibble indexing, the rows a warp owns,
    the lane that writes each output, accumulate. fp32 sums of at most 288 products are
    within 1e-5 of the float64 reference; an fp16 output is further rounded (2^-11)."""
    rng = np.random.default_rng(SEED + 7 * m + n)
    if dtype == "bfloat16":
        if BF16 is None:
            pytest.skip("bfloat16 on NumPy needs ml_dtypes")
        dtype = BF16
    blocks = _random_blocks(rng, n, k)
    x = rng.standard_normal((m, k)).astype(dtype)
    tol = 2.0 ** -10 if out_dtype == np.float16 else 1e-5
    for accumulate in (False, True):
        out = rng.standard_normal((m, n)).astype(out_dtype)
        want = _reference(x, blocks, out if accumulate else None)
        got = _run_emulated(x, blocks, out, accumulate, r, grid)
        assert np.isfinite(got).all()
        assert np.allclose(got, want, rtol=tol, atol=tol), (SEED, accumulate,
                                                            np.abs(got - want).max())


# ------------------------------------------------------------------ on the GPU

SMOL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]   # q|k|v, o, gate|up, down


@gpu
@pytest.mark.parametrize("m", [1, 2, 4, 8])
@pytest.mark.parametrize("rows_per_warp", [1, 2, 4])
def test_kernel_against_the_float_product(m, rows_per_warp):
    """SmolLM2's four projections, x ~ N(0, 1), weights ~ N(0, 0.05^2) rounded to Q4_1, so
    the outputs are ~2 in size. Against the float64 product of the dequantized weights:
    fp32 sums of at most 1536 products err by ~1e-5, and an fp16 output adds one rounding
    (2^-11 relative): rtol 2^-10, atol 1e-3. Against the fp16 few-row gemv on those weights
    rounded to fp16 (what weights="fp16" runs): each weight moves by up to 2^-11 of itself,
    and both outputs are rounded to fp16, so a looser 2e-2."""
    from pagedkv.kernels.gemm import gemm
    cp, rng = backend.xp, np.random.default_rng(SEED + m)
    for n, k in SMOL_SHAPES:
        blocks = _random_blocks(rng, n, k)
        w = dequantize_q4_1(blocks)
        x = rng.standard_normal((m, k)).astype(np.float16)
        base = (rng.standard_normal((m, n)) * 0.1).astype(np.float16)
        for out_dtype, accumulate in ((np.float16, False), (np.float32, False),
                                      (np.float16, True)):
            out = cp.asarray(base.astype(out_dtype)) if accumulate else \
                cp.full((m, n), np.nan, out_dtype)
            q4_gemv(cp.asarray(x), cp.asarray(blocks), out, accumulate=accumulate,
                    rows_per_warp=rows_per_warp)
            got = cp.asnumpy(out).astype(np.float64)
            want = x.astype(np.float64) @ w.T.astype(np.float64)
            if accumulate:
                want += base.astype(np.float64)
            assert np.allclose(got, want, rtol=2.0 ** -10, atol=1e-3), (n, k, out_dtype)
            fp16 = cp.asarray(base if accumulate else np.zeros((m, n), np.float16))
            gemm(cp.asarray(x), cp.asarray(w.astype(np.float16)), fp16, transpose_b=True,
                 accumulate=accumulate, method="gemv")
            assert np.allclose(got, cp.asnumpy(fp16), rtol=2e-2, atol=2e-2), (n, k)


# ------------------------------------------------------------------ the loader and the runner

def test_the_loaders_blocks_are_its_float_weights():
    """Dequantized, the kept blocks are exactly load_gguf's float32 projections (q and k's
    rows unpermuted, q|k|v and gate|up concatenated as the model concatenates them)."""
    pytest.importorskip("gguf", reason="reading the model file needs the gguf package")
    try:
        ckpt = load_gguf(keep_q4=True)
    except ModelNotFound as exc:
        pytest.skip(str(exc))
    w = ckpt.weights
    for i in (0, ckpt.config.layers - 1):
        floats = dict(wqkv=np.concatenate([w[f"{i}.{n}"] for n in ("wq", "wk", "wv")], 1),
                      wo=w[f"{i}.wo"], w_down=w[f"{i}.w_down"],
                      w_gate_up=np.concatenate([w[f"{i}.w_gate"], w[f"{i}.w_up"]], 1))
        for name in Q4_PROJECTIONS:
            assert np.array_equal(dequantize_q4_1(ckpt.q4[f"{i}.{name}"]), floats[name].T), \
                (i, name)


@pytest.fixture(scope="module")
def tiny_q4():
    blocks, deq = quantize_weights_q4(random_weights(TINY, SEED), TINY.layers)
    return Llama(TINY, deq, xp=np), blocks


def _generate(model, prompts, **runner_options):
    engine = Engine(model, num_blocks=200, block_size=16, max_seqs=16, stop_ids=(0,),
                    audit=True, runner="fast")
    engine.runner = FastRunner(model, engine.runner.kv, max_batch=16, **runner_options)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    return [r.outputs()[0].generated for r in reqs]


def test_runner_q4_equals_fp16_on_the_dequantized_model(tiny_q4, monkeypatch):
    """One prompt, five and eleven (decode passes of 1, up to 5 and up to 11 rows): the
    tokens of the fp16 runner on the dequantized weights. The Q4_1 kernel runs for every
    projection of each decode pass of at most 8 rows, and never for a larger one."""
    model, blocks = tiny_q4
    rows = []
    real = runner_module.q4_gemv
    monkeypatch.setattr(runner_module, "q4_gemv",
                        lambda x, *a, **k: rows.append(x.shape[0]) or real(x, *a, **k))
    rng = np.random.default_rng(SEED)
    for count in (1, 5, 11):
        prompts = [rng.integers(1, TINY.vocab_size, int(n)).tolist()
                   for n in rng.integers(1, 30, count)]
        rows.clear()
        fp16 = _generate(model, prompts)
        assert rows == []
        q4 = _generate(model, prompts, weights="q4_1", q4_blocks=blocks)
        assert q4 == fp16, (SEED, count)
        assert len(rows) % (4 * TINY.layers) == 0 and max(rows, default=0) <= 8, rows
        if count <= 8:
            assert len(rows) >= 4 * TINY.layers * 11, rows   # every one of 11 decode steps


def test_runner_reads_the_blocks_it_is_given(tiny_q4):
    """Blocks of other weights change the logits: the q4 path is not the fp16 one."""
    model, blocks = tiny_q4
    other, _ = quantize_weights_q4(random_weights(TINY, SEED + 1), TINY.layers)
    prompt = [[5, 17, 3, 9]]
    assert _generate(model, prompt, weights="q4_1", q4_blocks=other) != \
        _generate(model, prompt)


def test_runner_refuses_bad_q4_options(tiny_q4):
    model, blocks = tiny_q4
    kv = PagedKV.for_model(model, 8, 16)
    with pytest.raises(ConfigError, match="with q4_blocks"):
        FastRunner(model, kv, weights="q4_1")
    with pytest.raises(ConfigError, match="with q4_blocks"):
        FastRunner(model, kv, weights="q8", q4_blocks=blocks)
    with pytest.raises(ConfigError, match="with q4_blocks"):
        FastRunner(model, kv, q4_blocks=blocks)
    bad = dict(blocks, **{"1.wo": blocks["1.wo"][:, :-BLOCK_BYTES]})
    with pytest.raises(ConfigError, match=r"q4_blocks\['1.wo'\]"):
        FastRunner(model, kv, weights="q4_1", q4_blocks=bad)
    assert FastRunner(model, kv, weights="q4_1", q4_blocks=blocks).fold_rows == 0


@gpu
def test_runner_q4_on_the_gpu_equals_fp16_on_the_dequantized_model():
    """float32 on the GPU, through captured graphs: one decode step over the same random
    cache gives the fp16 runner's logits on the dequantized weights to float32 rounding (the
    sums run in another order, so a greedy token may differ only where two logits nearly
    tie); q4_gemv takes gemm's place one for one, one launch a projection in
    every bucket."""
    cp = backend.xp
    blocks, deq = quantize_weights_q4(random_weights(TINY, SEED), TINY.layers)
    model = Llama(TINY, deq, dtype=np.float32)
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    kvs = [PagedKV.for_model(model, 16, 16) for _ in range(2)]
    pool = rng.normal(size=kvs[0].allocator.pool.view(cp.float32).shape).astype(np.float32)
    runners = []
    for kv, options in zip(kvs, (dict(fold_rows=0), dict(weights="q4_1", q4_blocks=blocks))):
        kv.allocator.pool.view(cp.float32)[...] = cp.asarray(pool)
        runners.append(FastRunner(model, kv, max_batch=8, **options))
    for b in (1, 3, 8):
        lens = rng.integers(1, 33, b).astype(np.int32)
        tables = rng.permutation(16)[:2 * b].reshape(b, 2).astype(np.int32)
        pos = lens - 1
        slots = (tables[np.arange(b), pos // 16] * 16 + pos % 16).astype(np.int32)
        batch = Batch(rng.integers(1, TINY.vocab_size, b).astype(np.int32), pos, slots,
                      np.ones(b, np.int32), lens, tables, np.zeros((0, 2), np.int32))
        (l16, g16), (l4, g4) = ((backend.to_numpy(lg), g) for lg, g in
                                (r.decode(batch) for r in runners))
        assert np.allclose(l4, l16, rtol=1e-4, atol=1e-4 * np.abs(l16).max()), b
        top2 = np.sort(l16, axis=1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-3
        assert np.array_equal(np.asarray(g4)[clear], np.asarray(g16)[clear]), b
    nodes = [[r.graph_nodes(b) for b in (1, 4, 8)] for r in runners]
    # one launch a projection in every bucket: the fp16 graph's at one row (its few-row
    # kernel); cuBLAS may take more above it
    assert None not in nodes[0] and nodes[1] == [nodes[0][0]] * 3, nodes
    assert all(q <= f for q, f in zip(nodes[1], nodes[0])), nodes
