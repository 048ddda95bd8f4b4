"""The 8-bit K/V cache (pagedkv.kernels.kv8): its bytes, its rounding, every kernel that writes
or reads it, and the engine on it.

* The oracles here share no code with the package: they read a block's bytes by the layout
  the module documents (int8 numbers, then float16 scale pairs) and attend in float64.
* NumPy paths always; the CUDA kernels' own source on the CPU emulator (perf/emu) where g++
  is found, for one shape each (SmolLM2's); the CUDA kernels on a GPU when there is one.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import shutil

import numpy as np
import pytest

from _attn_cases import BF16, TOL, make_case, make_prefill_case, rel_err, rng_for
from _tiny import TINY
from pagedkv import backend
from pagedkv.config import EngineConfig, SamplingParams
from pagedkv.errors import ConfigError
from pagedkv.kernels import (copy_blocks, paged_decode_attention, paged_prefill_attention,
                             write_kv)
from pagedkv.kernels.fused import rope_write_kv
from pagedkv.kernels.kv8 import Cache8, layer_block_bytes
from pagedkv.kernels.norm_gemv import norm_gemv_rope
from pagedkv.model import Llama, PagedKV, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.spec import KVSpec

single_thread_blas()
SEED = 8088
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")
emulator = pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")


# ------------------------------------------------------------------ the oracle's own reading

def oracle_layer(cache: Cache8) -> np.ndarray:
    """A layer's K/V as float64 [num_blocks, 2, bs, h, d], read from its bytes by the
    documented layout alone: per block, int8 [2][bs][h][d], then float16 [bs][h][d/32][2]."""
    raw = backend.to_numpy(cache.raw)
    nb, _, bs, h, d = cache.shape
    nvals = 2 * bs * h * d
    vals = raw[:, :nvals].copy().view(np.int8).reshape(nb, 2, bs, h, d).astype(np.float64)
    sc = raw[:, nvals:].copy().view(np.float16).reshape(nb, bs, h, d // 32, 2)
    out = np.empty_like(vals)
    with np.errstate(invalid="ignore", over="ignore"):   # junk where nothing was written
        _fill(out, vals, sc, d)
    return out


def _fill(out, vals, sc, d):
    for kv in range(2):
        for g in range(d // 32):
            out[:, kv, :, :, 32 * g:32 * (g + 1)] = (
                vals[:, kv, :, :, 32 * g:32 * (g + 1)]
                * sc[:, :, :, g, kv].astype(np.float64)[..., None])


def oracle_attention(q, kv, tables, starts, lens, bs):
    """Causal attention in float64: sequence b's new rows (``starts``) at its last positions."""
    q = np.asarray(q, np.float64) if q.dtype != BF16 else q.astype(np.float64)
    _, _, _, h, d = kv.shape
    group = q.shape[1] // h
    out = np.zeros(q.shape)
    for b, length in enumerate(lens):
        rows = range(starts[b], starts[b + 1])
        t = np.arange(length)
        blocks, offs = tables[b, t // bs], t % bs
        k, v = kv[blocks, 0, offs], kv[blocks, 1, offs]        # [L, h, d]
        for i, r in enumerate(rows):
            pos = length - len(rows) + i
            for head in range(q.shape[1]):
                s = k[:pos + 1, head // group] @ q[r, head] / math.sqrt(d)
                p = np.exp(s - s.max())
                out[r, head] = p @ v[:pos + 1, head // group] / p.sum()
    return out


def to_int8(cache, tables, lens, rng, dtype=None):
    """The positions in use of a 16-bit test cache written into a fresh int8 cache (its
    other bytes random junk), through write_kv."""
    nb, _, bs, h, d = cache.shape
    c8 = Cache8.zeros(nb, bs, h, d, np)
    c8.raw[...] = rng.integers(0, 256, c8.raw.shape)
    for b, n in enumerate(lens):
        t = np.arange(n)
        slots = (tables[b, t // bs] * bs + t % bs).astype(np.int32)
        blk, off = slots // bs, slots % bs
        write_kv(c8, cache[blk, 0, off], cache[blk, 1, off], slots)
    return c8


def _emulator():
    path = pathlib.Path(__file__).resolve().parents[1] / "perf/emu/emulate.py"
    spec = importlib.util.spec_from_file_location("emulate", path)
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    return emulate


# ------------------------------------------------------------------ bytes and capacity

def test_spec_counts_numbers_and_scales():
    f16 = KVSpec(30, 3, 64, "float16")                     # SmolLM2-135M
    i8 = KVSpec(30, 3, 64, "int8")
    assert f16.bytes_per_token == 23_040 and not f16.quantized
    assert i8.quantized and i8.row_bytes == 64 + 2 * 2 and i8.bytes_per_token == 12_240
    assert i8.block_bytes(16) == 16 * 12_240
    assert i8.block_bytes(16) == 30 * layer_block_bytes(16, 3, 64)
    gib = 2**30
    assert i8.tokens_that_fit(gib) / f16.tokens_that_fit(gib) == pytest.approx(23040 / 12240,
                                                                                rel=1e-4)
    assert i8.blocks_that_fit(gib, 16) == gib // (16 * 12_240)
    assert f16.blocks_that_fit(gib, 16) == gib // (16 * 23_040)
    with pytest.raises(ConfigError, match="multiple of 32"):
        KVSpec(2, 2, 48, "int8")


def test_paged_kv_lays_blocks_out_as_bytes():
    """Block b of every layer is one stretch of bytes: its numbers, then its scales; the
    pool is half (plus scales) of float16's for the same blocks."""
    m = Llama(TINY, random_weights(TINY, SEED), xp=np, dtype=np.float16)
    kv8, kv16 = (PagedKV.for_model(m, 10, 16, kv_dtype=k) for k in ("int8", None))
    assert isinstance(kv8.layers[0], Cache8) and len(kv8.layers) == TINY.layers
    assert kv8.allocator.pool.nbytes / kv16.allocator.pool.nbytes == pytest.approx(68 / 128)
    layer = kv8.layers[1]
    raw = kv8.allocator.pool.reshape(TINY.layers, 10, -1)
    layer.values[3, 1, 5, 1, 7] = -9                       # V, block 3, row 5, head 1, number 7
    layer.scales[3, 5, 1, 0, 1] = 0.5
    bb = layer_block_bytes(16, 2, 64)
    assert raw[1, 3, ((1 * 16 + 5) * 2 + 1) * 64 + 7].view(np.int8) == -9
    at = 2 * 16 * 2 * 64 + ((5 * 2 + 1) * 2 + 0) * 4 + 2
    assert raw[1, 3, at:at + 2].view(np.float16)[0] == 0.5
    assert raw.shape[2] == bb


def test_config_and_cache_refuse_other_dtypes():
    with pytest.raises(ConfigError, match="kv_dtype"):
        EngineConfig(num_blocks=4, kv_dtype="int4")
    m = Llama(TINY, random_weights(TINY, SEED), xp=np)            # float32 on NumPy
    with pytest.raises(ConfigError, match="kv_dtype"):
        PagedKV.for_model(m, 4, 16, kv_dtype="float16")
    with pytest.raises(ConfigError, match="uint8"):
        Cache8(np.zeros((4, 100), np.uint8), 16, 2, 64)


# ------------------------------------------------------------------ the rounding

@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=["f16", "bf16", "f32"])
def test_write_kv_rounds_each_run_of_32_to_its_scale(dtype):
    """Each run's scale is float16(max |x| / 127) (within float16's rounding), every number
    within half a step of x, none past +-127 steps; padding slots write nothing."""
    rng = rng_for(8101)
    nb, bs, h, d, t = 6, 16, 2, 128, 20
    c = Cache8.zeros(nb, bs, h, d, np)
    c.raw[...] = rng.integers(0, 256, c.raw.shape)
    before = c.raw.copy()
    k = (rng.standard_normal((t, h, d)) * np.exp(2 * rng.standard_normal((t, h, 1)))).astype(dtype)
    v = rng.standard_normal((t, h, d)).astype(dtype)
    k[0, 0] = 0                                       # a row of zeros: scale 0, numbers 0
    v[1, 1, :32] = 1e-3 * np.arange(32)
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[5] = -1
    write_kv(c, k, v, slots)
    kv = oracle_layer(c)
    raw = c.raw.reshape(nb, -1)
    nvals = 2 * bs * h * d
    for i, s in enumerate(slots):
        if s < 0:
            continue
        b, o = divmod(int(s), bs)
        for j, x in enumerate((k[i], v[i])):
            x = x.astype(np.float64)                        # [h, d]
            runs = x.reshape(h, -1, 32)
            scale = raw[b, nvals:].copy().view(np.float16).reshape(bs, h, -1, 2)[o, :, :, j]
            want = np.abs(runs).max(-1) / 127
            assert np.all(np.abs(scale - want) <= np.spacing(want.astype(np.float16)) / 2
                          + 1e-12), (i, j)
            got = kv[b, j, o]
            step = scale.astype(np.float64)[..., None].repeat(32, -1).reshape(h, d)
            assert np.all(np.abs(got - x) <= step / 2 * (1 + 1e-6) + 1e-12), (i, j)
    assert not kv[slots[0] // bs, 0, slots[0] % bs, 0].any()   # the zero row
    padding_block = np.ones(nb, bool)
    padding_block[slots[slots >= 0] // bs] = False
    assert np.array_equal(c.raw[padding_block], before[padding_block])


def test_rope_write_kv_into_int8_is_write_kv_of_its_rows(tiny):
    """rope_write_kv (and norm_gemv_rope) into an int8 cache store the same bytes as the
    rotated k, rounded to the model's dtype, and v written by write_kv."""
    rng = rng_for(8102)
    c, t = TINY, 5
    qkv = rng.standard_normal((t, (c.heads + 2 * c.kv_heads) * c.head_dim)).astype(np.float32)
    pos = rng.integers(0, 100, t).astype(np.int32)
    slots = np.array([3, 17, -1, 40, 41], np.int32)
    q = np.empty((t, c.heads, c.head_dim), np.float32)
    a = Cache8.zeros(4, 16, c.kv_heads, c.head_dim, np)
    f = np.zeros((4, 2, 16, c.kv_heads, c.head_dim), np.float32)
    rope_write_kv(qkv, pos, slots, tiny.cos, tiny.sin, q, a, c.heads, c.kv_heads)
    rope_write_kv(qkv, pos, slots, tiny.cos, tiny.sin, q, f, c.heads, c.kv_heads)
    b = Cache8.zeros(4, 16, c.kv_heads, c.head_dim, np)
    keep = slots[slots >= 0]
    write_kv(b, f[keep // 16, 0, keep % 16], f[keep // 16, 1, keep % 16], keep)
    assert np.array_equal(a.raw, b.raw)
    x = rng.standard_normal((2, c.hidden)).astype(np.float32)
    layer = tiny.layers[0]
    g = Cache8.zeros(4, 16, c.kv_heads, c.head_dim, np)
    qkv2 = np.empty((2, qkv.shape[1]), np.float32)
    norm_gemv_rope(x, layer.attn_norm, c.norm_eps, np.ascontiguousarray(layer.wqkv.T), qkv2,
                   pos[:2], slots[:2], tiny.cos, tiny.sin, q[:2], g, c.heads, c.kv_heads)
    assert g.values[0, 0, 3].any() and g.values[1, 1, 1].any()


def test_copy_blocks_moves_numbers_and_scales():
    rng = rng_for(8103)
    layers = [Cache8.zeros(5, 8, 2, 64, np) for _ in range(3)]
    for layer in layers:
        layer.raw[...] = rng.integers(0, 256, layer.raw.shape)
    before = [layer.raw.copy() for layer in layers]
    copy_blocks(layers, np.array([[1, 3], [4, 0]], np.int32))
    for layer, old in zip(layers, before):
        assert np.array_equal(layer.raw[3], old[1]) and np.array_equal(layer.raw[0], old[4])
        assert np.array_equal(layer.raw[[1, 2, 4]], old[[1, 2, 4]])


# ------------------------------------------------------------------ attention reads it

CASES = [("float16", 64, 3, 16), ("bfloat16", 128, 4, 8), ("float32", 64, 2, 32),
         ("float16", 256, 8, 16)]


@pytest.mark.parametrize("dtype,head_dim,group,block_size", CASES)
def test_numpy_decode_and_prefill_read_int8_like_the_oracle(dtype, head_dim, group,
                                                            block_size):
    """The NumPy paths (the kernels' algorithms) on an int8 cache with junk in every
    unwritten byte, against float64 attention over the bytes as the oracle reads them."""
    rng = rng_for(8200 + head_dim + group + block_size)
    q, cache, tables, lens = make_case(rng, [1, 17, 70, 2 * block_size], 2 * group, 2,
                                       head_dim, block_size, dtype)
    c8 = to_int8(cache, tables, lens, rng)
    kv = oracle_layer(c8)
    starts = np.arange(len(lens) + 1)
    want = oracle_attention(q, kv, tables, starts, lens, block_size)
    for splits in (1, 3):
        got = paged_decode_attention(q, c8, tables, lens, num_splits=splits)
        assert got.dtype == q.dtype
        assert rel_err(got.astype(np.float64), want) < TOL[dtype], splits
    if head_dim > 128:                                # (prefill takes head_dim 64 and 128)
        return
    q, cache, tables, qs, lens = make_prefill_case(rng, [7, 1, 40], [0, 33, 9], 2 * group,
                                                   2, head_dim, block_size, dtype)
    c8 = to_int8(cache, tables, lens, rng)
    want = oracle_attention(q, oracle_layer(c8), tables, qs, lens, block_size)
    got = paged_prefill_attention(q, c8, tables, qs, lens)
    assert rel_err(got.astype(np.float64), want) < TOL[dtype]


def test_int8_attention_is_near_the_unrounded_one():
    """What the rounding costs: attention over the int8 cache within 2 % of attention over
    the float16 numbers it was written from."""
    rng = rng_for(8301)
    q, cache, tables, lens = make_case(rng, [50, 300], 6, 2, 64, 16, "float16")
    exact = paged_decode_attention(q, cache, tables, lens).astype(np.float64)
    rounded = paged_decode_attention(q, to_int8(cache, tables, lens, rng), tables, lens)
    assert rel_err(rounded.astype(np.float64), exact) < 2e-2


# ------------------------------------------------------------------ the engine

def _engine_tokens(model, runner, kv_dtype, params, num_blocks=200, **options):
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 17, 1, 33, 16)]
    engine = Engine(model, num_blocks=num_blocks, block_size=16, stop_ids=(0,), audit=True,
                    runner=runner, kv_dtype=kv_dtype, **options)
    reqs = engine.generate(prompts, params)
    assert engine.memory.manager.allocator.num_free == num_blocks
    return engine, [[s.generated for s in r.outputs()] for r in reqs]


def test_engine_generates_on_the_int8_cache_with_both_runners(tiny):
    """Greedy and beams through the whole stack, plain and fast runners: the same tokens on
    both, on a pool of int8 blocks; swap preemption moves int8 blocks and changes nothing."""
    for params in (SamplingParams(max_new_tokens=16), SamplingParams(max_new_tokens=8,
                                                                     beam_width=3)):
        e, plain = _engine_tokens(tiny, "plain", "int8", params)
        assert isinstance(e.runner.kv.layers[0], Cache8)
        _, fast = _engine_tokens(tiny, "fast", "int8", params)
        assert fast == plain
    params = SamplingParams(max_new_tokens=24)
    _, roomy = _engine_tokens(tiny, "fast", "int8", params)
    e, swapped = _engine_tokens(tiny, "fast", "int8", params, num_blocks=10,
                                preemption="swap", host_blocks=40)
    assert e.memory.counts.preemptions > 0 and swapped == roomy


def test_engine_int8_greedy_is_the_oracles():
    """The engine on the int8 cache against a one-sequence oracle of this file: the same
    model, each token's K/V read back from the int8 bytes of its row (by the layout alone)."""
    model = Llama(TINY, random_weights(TINY, SEED), xp=np)
    params = SamplingParams(max_new_tokens=12)
    _, got = _engine_tokens(model, "plain", "int8", params)
    rng = np.random.default_rng(SEED)
    prompts = [rng.integers(1, TINY.vocab_size, n).tolist() for n in (5, 17, 1, 33, 16)]
    for prompt, answer in zip(prompts, got):
        assert answer[0] == _oracle_greedy(model, prompt, 12)


def _oracle_greedy(model, prompt, new):
    """Greedy decoding, one sequence, K/V kept as int8 rows with their scales, computed here
    (max |x| per 32, float16 scale, round half to even) and attended in float64."""
    c, tokens = model.config, list(prompt)
    ks = [[] for _ in range(c.layers)]
    vs = [[] for _ in range(c.layers)]

    def int8_row(x):                                  # [h, d] float32 -> dequantized float64
        runs = x.astype(np.float64).reshape(x.shape[0], -1, 32)
        s = (np.float32(np.abs(x).reshape(runs.shape).max(-1)) / np.float32(127)).astype(
            np.float16).astype(np.float64)[..., None]
        q = np.clip(np.round(np.divide(runs, s, out=np.zeros_like(runs), where=s > 0)),
                    -127, 127)
        return (q * s).reshape(x.shape)

    out = []
    for step in range(len(prompt) + new - 1):
        pos = np.array([step], np.int32)
        x = model.embed(np.array([tokens[step]]))
        for i in range(c.layers):
            q, k, v = model.qkv(i, x, pos)
            ks[i].append(int8_row(k[0]))
            vs[i].append(int8_row(v[0]))
            kk, vv, g = np.array(ks[i]), np.array(vs[i]), c.heads // c.kv_heads
            o = np.zeros((c.heads, c.head_dim))
            for head in range(c.heads):
                s = kk[:, head // g] @ q[0, head].astype(np.float64) * model.scale
                p = np.exp(s - s.max())
                o[head] = p @ vv[:, head // g] / p.sum()
            x = model.finish_layer(i, x, o[None].astype(model.dtype))
        if step >= len(prompt) - 1:
            t = int(np.argmax(model.logits(x)[0]))
            out.append(t)
            if t == 0 or len(out) == new:
                break
            tokens.append(t)
    return out


# ------------------------------------------------------------------ the CUDA source, emulated

@emulator
def test_write_kernels_on_the_emulator_are_the_references_bit_for_bit():
    """write_kv8 and rope_write_kv8 (fused.cu), run on the CPU emulator: the NumPy
    references' bytes exactly (the same rounding), junk left where nothing is written."""
    emu, rng = _emulator(), rng_for(8401)
    nb, bs, h, d, t, qh = 5, 16, 3, 64, 9, 9
    c = Cache8.zeros(nb, bs, h, d, np)
    c.raw[...] = rng.integers(0, 256, c.raw.shape)
    k = (rng.standard_normal((t, h, d)) * np.exp(rng.standard_normal((t, h, 1)))).astype(
        np.float16)
    v = rng.standard_normal((t, h, d)).astype(np.float16)
    k[0, 0] = 0
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[3] = -1
    ref = c.copy()
    write_kv(ref, k, v, slots)
    assert np.array_equal(emu.run_write_kv8(c, k, v, slots).raw, ref.raw)
    qkv = rng.standard_normal((t, (qh + 2 * h) * d)).astype(np.float16)
    ang = np.outer(np.arange(64), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 64, t).astype(np.int32)
    q_out = np.full((t, qh, d), np.nan, np.float16)
    ref, q_ref = c.copy(), q_out.copy()
    rope_write_kv(qkv, pos, slots, cos, sin, q_ref, ref, qh, h)
    q_got, got = emu.run_rope_write_kv8(qkv, pos, slots, cos, sin, q_out, c, qh, h)
    assert np.array_equal(got.raw, ref.raw)
    assert np.array_equal(q_got.view(np.uint16), q_ref.view(np.uint16))


@emulator
def test_norm_gemv_rope8_on_the_emulator_is_its_two_launches():
    """norm_gemv_rope8_t (a CTA per k or v head) against norm_gemv_t then rope_write_kv8,
    emulated: the same bits in qkv, q_out and the cache; the NumPy reference within
    rounding."""
    same, err = _emulator().check_norm_gemv_rope8(np.float16, 2, 16, 8402)
    assert same and err < 1e-2


@emulator
@pytest.mark.parametrize("tensor_cores", [False, True], ids=["cuda-cores", "tensor-cores"])
def test_decode_kernels_on_the_emulator_read_int8(tensor_cores):
    """paged_decode.cu and paged_decode_tc.cu with KV8 = 1 at SmolLM2's shape (float16, head
    dim 64, 3 query heads a kv head, blocks of 16), two splits merged, junk in every
    unwritten byte: the oracle's numbers."""
    rng = rng_for(8403)
    q, cache, tables, lens = make_case(rng, [1, 40, 150], 6, 2, 64, 16, "float16",
                                       max_blocks=10)
    c8 = to_int8(cache, tables, lens, rng)
    want = oracle_attention(q, oracle_layer(c8), tables, np.arange(4), lens, 16)
    got = _emulator().run_decode(q, c8, tables, lens, tensor_cores=tensor_cores,
                                 num_splits=2)
    assert rel_err(got.astype(np.float64), want) < TOL["float16"]


@emulator
def test_prefill_kernel_on_the_emulator_reads_int8():
    rng = rng_for(8404)
    q, cache, tables, qs, lens = make_prefill_case(rng, [7, 100], [0, 30], 6, 2, 64, 16,
                                                   "float16")
    c8 = to_int8(cache, tables, lens, rng)
    want = oracle_attention(q, oracle_layer(c8), tables, qs, lens, 16)
    got = _emulator().run_prefill(q, c8, tables, qs, lens)
    assert np.isfinite(got.astype(np.float64)).all()
    assert rel_err(got.astype(np.float64), want) < TOL["float16"]


# ------------------------------------------------------------------ the CUDA kernels

def _dev8(c8):
    return Cache8(backend.xp.asarray(c8.raw), *c8.shape[2:])


GPU_CASES = [("float16", 64, 3, 16), ("float16", 64, 3, 8), ("float16", 64, 3, 32),
             ("bfloat16", 128, 4, 16), ("float16", 128, 8, 16), ("bfloat16", 256, 6, 32)]


@gpu
@pytest.mark.parametrize("dtype,head_dim,group,block_size", GPU_CASES)
def test_gpu_decode_and_prefill_read_int8(dtype, head_dim, group, block_size):
    from _attn_cases import host, poisoned_like, to_gpu
    rng = rng_for(8500 + head_dim + group + block_size)
    q, cache, tables, lens = make_case(rng, [1, 17, 97, 4097, 3 * block_size + 1], 2 * group,
                                       2, head_dim, block_size, dtype)
    c8 = to_int8(cache, tables, lens, rng)
    want = oracle_attention(q, oracle_layer(c8), tables, np.arange(len(lens) + 1), lens,
                            block_size)
    dq, dt, dl = to_gpu((q, tables, lens))
    for tc in (False, True) if dtype != "float32" else (False,):
        for splits in (None, 1, 4):
            out = poisoned_like(dq)
            paged_decode_attention(dq, _dev8(c8), dt, dl, out=out, num_splits=splits,
                                   tensor_cores=tc)
            got = host(out)
            assert np.isfinite(got).all() and rel_err(got, want) < TOL[dtype], (tc, splits)
    if head_dim > 128:
        return
    q, cache, tables, qs, lens = make_prefill_case(rng, [7, 300, 1], [0, 33, 900], 2 * group,
                                                   2, head_dim, block_size, dtype)
    c8 = to_int8(cache, tables, lens, rng)
    want = oracle_attention(q, oracle_layer(c8), tables, qs, lens, block_size)
    dq, dt, dqs, dl = to_gpu((q, tables, qs, lens))
    out = poisoned_like(dq)
    paged_prefill_attention(dq, _dev8(c8), dt, dqs, dl, out=out)
    assert rel_err(host(out), want) < TOL[dtype]


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_write_kernels_are_the_references_bit_for_bit(dtype):
    """write_kv8, rope_write_kv8 and norm_gemv_rope8_t on the GPU: the NumPy references'
    bytes (write_kv, rope_write_kv), and norm_gemv_rope's bytes those of its two launches."""
    from _attn_cases import DTYPES
    from pagedkv.kernels.norm_gemv import norm_gemv_rope_unfused
    xp, dt, rng = backend.xp, DTYPES[dtype], rng_for(8601)
    nb, bs, h, d, t, qh = 9, 16, 3, 64, 37, 9
    c = Cache8.zeros(nb, bs, h, d, np)
    c.raw[...] = rng.integers(0, 256, c.raw.shape)
    k, v = (rng.standard_normal((t, h, d)).astype(dt) for _ in range(2))
    slots = rng.permutation(nb * bs)[:t].astype(np.int32)
    slots[3] = -1
    ref, dev = c.copy(), _dev8(c)
    write_kv(ref, k, v, slots)
    write_kv(dev, xp.asarray(k), xp.asarray(v), slots)
    assert np.array_equal(dev.raw.get(), ref.raw)
    qkv = rng.standard_normal((t, (qh + 2 * h) * d)).astype(dt)
    ang = np.outer(np.arange(64), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, 64, t).astype(np.int32)
    q_ref = np.empty((t, qh, d), dt)
    ref, dev = c.copy(), _dev8(c)
    rope_write_kv(qkv, pos, slots, cos, sin, q_ref, ref, qh, h)
    q_dev = xp.empty((t, qh, d), dt)
    rope_write_kv(xp.asarray(qkv), xp.asarray(pos), xp.asarray(slots), xp.asarray(cos),
                  xp.asarray(sin), q_dev, dev, qh, h)
    assert np.array_equal(dev.raw.get(), ref.raw)
    for m in (1, 2):
        x = xp.asarray(rng.standard_normal((m, 576)).astype(dt))
        nw = xp.asarray(rng.standard_normal(576).astype(dt))
        w = xp.asarray((0.05 * rng.standard_normal((qkv.shape[1], 576))).astype(dt))
        outs = []
        for fn in (norm_gemv_rope, norm_gemv_rope_unfused):
            qkv_o, q_o, cache_o = xp.empty((m, qkv.shape[1]), dt), xp.empty((m, qh, d), dt), \
                _dev8(c)
            fn(x, nw, 1e-5, w, qkv_o, xp.asarray(pos[:m]), xp.asarray(slots[:m]),
               xp.asarray(cos), xp.asarray(sin), q_o, cache_o, qh, h)
            outs.append((qkv_o.get(), q_o.get(), cache_o.raw.get()))
        for a, b in zip(*outs):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), m


@gpu
def test_gpu_engine_on_the_int8_cache():
    """float16 on the GPU, the int8 cache: the fast runner's graphs give the eager kernels'
    tokens; every first token (a prefill's) is the plain runner's and the float16 cache's."""
    model = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    params = SamplingParams(max_new_tokens=16)
    _, fast = _engine_tokens(model, "fast", "int8", params)
    _, eager = _engine_tokens(model, "fast-eager", "int8", params)
    _, plain = _engine_tokens(model, "plain", "int8", params)
    _, f16 = _engine_tokens(model, "fast", None, params)
    assert fast == eager
    assert [a[0][0] for a in fast] == [a[0][0] for a in plain] == [a[0][0] for a in f16]
