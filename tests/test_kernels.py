"""Tests of pagedkv.kernels: the NumPy paths always, the CuPy kernels when a GPU is usable.

Every case draws fresh random data from a fixed seed that is printed (pytest shows it on failure);
pages are scattered by a random permutation of block ids; outputs are NaN-poisoned before a run
and must come back fully written.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import (copy_blocks, dense_attention, copy_blocks_ref, gather_kv,
                             paged_decode_attention, paged_decode_attention_ref, write_kv,
                             write_kv_ref)
from pagedkv.kernels._common import BF16, to_device

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def _bfloat16_needs_ml_dtypes(request):
    """NumPy has no bfloat16; ml_dtypes (in requirements.txt) gives it one."""
    spec = getattr(request.node, "callspec", None)
    if BF16 is None and spec and "bfloat16" in map(str, spec.params.values()):
        pytest.skip("bfloat16 cases need ml_dtypes, which is not installed")
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no usable GPU: {backend.reason}")


def rng_for(seed):
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def make_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype, spare_blocks=5):
    """q, cache, block_tables, seq_lens with each sequence's pages at random places in the pool."""
    dt = DTYPES[dtype]
    lens = np.asarray(lens, np.int32)
    per_seq = -(-lens // block_size)
    max_blocks = max(1, int(per_seq.max()))
    num_blocks = int(per_seq.sum()) + spare_blocks
    cache = rng.standard_normal((num_blocks, 2, block_size, kv_heads, head_dim)).astype(dt)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(-7, 10**6, (len(lens), max_blocks)).astype(np.int32)  # padding: junk
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    q = rng.standard_normal((len(lens), q_heads, head_dim)).astype(dt)
    return q, cache, tables, lens


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


# ------------------------------------------------------------------ NumPy paths (CI)

def test_reference_matches_naive_gather():
    rng = rng_for(101)
    q, cache, tables, lens = make_case(rng, [1, 17, 97, 4097], 8, 2, 64, 16, "float32")
    ref = paged_decode_attention_ref(q, cache, tables, lens)
    for b in range(len(lens)):
        k, v = gather_kv(cache, tables[b], lens[b])
        assert k.shape == (lens[b], 2, 64)
        naive = dense_attention(q[b], k, v)
        assert rel_err(naive, ref[b]) < 1e-5


def test_reference_single_token_is_its_value():
    # With one token the softmax weight is 1: the output is that token's V row, per group.
    rng = rng_for(102)
    q, cache, tables, lens = make_case(rng, [1, 1], 4, 2, 64, 8, "float32")
    ref = paged_decode_attention_ref(q, cache, tables, lens)
    for b in range(2):
        v = cache[tables[b, 0], 1, 0]                        # [kv_heads, D]
        np.testing.assert_allclose(ref[b], np.repeat(v, 2, axis=0), rtol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim,group,block_size",
                         [(64, 1, 8), (128, 4, 16), (256, 8, 32), (128, 2, 32), (64, 8, 16)])
def test_numpy_algorithm_matches_reference(dtype, head_dim, group, block_size):
    seed = 1000 + head_dim + 10 * group + block_size + len(dtype)
    rng = rng_for(seed)
    kv_heads = 2
    q, cache, tables, lens = make_case(rng, [1, 17, 97, 3 * block_size + 5], group * kv_heads,
                                       kv_heads, head_dim, block_size, dtype)
    ref = paged_decode_attention_ref(q, cache, tables, lens)
    for splits in (1, 3):
        out = np.full(q.shape, np.nan).astype(q.dtype)
        paged_decode_attention(q, cache, tables, lens, out=out, num_splits=splits)
        assert not np.isnan(out.astype(np.float32)).any()
        assert rel_err(out, ref) < TOL[dtype], (dtype, splits)


def test_numpy_long_sequence_with_splits():
    rng = rng_for(103)
    q, cache, tables, lens = make_case(rng, [4097, 33], 8, 8, 64, 32, "float16")
    ref = paged_decode_attention_ref(q, cache, tables, lens)
    out = paged_decode_attention(q, cache, tables, lens, num_splits=5)
    assert rel_err(out, ref) < TOL["float16"]


def test_choose_num_splits_fills_the_gpu_and_cuts_whole_tiles():
    from pagedkv.kernels import choose_num_splits
    sms, occ, tile = 132, 3, 32
    assert choose_num_splits(2 * sms * occ, 8192, sms, occ, tile) == 1      # two full waves
    assert choose_num_splits(sms * occ, 8192, sms, occ, tile) == 2          # one to two waves
    for work, max_len in [(1, 100000), (8, 32768), (128, 4096), (5, 65), (3, 64)]:
        s = choose_num_splits(work, max_len, sms, occ, tile)
        per_split = -(-(-(-max_len // s)) // tile) * tile
        assert 1 <= s and (s - 1) * per_split < max_len                    # no empty split
        assert work * s <= 2 * sms or s == 1                                # ~2 CTAs per SM
        assert s == 1 or max_len // s >= tile                               # splits hold tiles


def test_write_kv_ref_skips_padding():
    rng = rng_for(104)
    cache = rng.standard_normal((6, 2, 4, 2, 8)).astype(np.float16)
    before = cache.copy()
    slots = np.array([5, -1, 0, 23, -1, 9], np.int32)
    k = rng.standard_normal((6, 2, 8)).astype(np.float16)
    v = rng.standard_normal((6, 2, 8)).astype(np.float16)
    write_kv(cache, k, v, slots)
    expect = before.copy()
    for t, s in enumerate(slots):
        if s >= 0:
            expect[s // 4, 0, s % 4] = k[t]
            expect[s // 4, 1, s % 4] = v[t]
    np.testing.assert_array_equal(cache, expect)
    assert not np.array_equal(cache, before)


def test_copy_blocks_ref_several_pairs_and_layers():
    rng = rng_for(105)
    layers = [rng.standard_normal((10, 2, 4, 2, 8)).astype(np.float32) for _ in range(3)]
    before = [a.copy() for a in layers]
    pairs = np.array([[0, 7], [3, 1], [0, 9]], np.int32)
    copy_blocks(layers, pairs)
    for a, b in zip(layers, before):
        expect = b.copy()
        for s, d in pairs:
            expect[d] = b[s]
        np.testing.assert_array_equal(a, expect)


def test_bad_inputs_raise_config_error():
    rng = rng_for(106)
    q, cache, tables, lens = make_case(rng, [5, 9], 4, 2, 64, 16, "float16")
    bad_calls = [
        lambda: paged_decode_attention(q.astype(np.float32), cache, tables, lens),  # dtype
        lambda: paged_decode_attention(q[:, :3], cache, tables, lens),        # 3 heads over 2
        lambda: paged_decode_attention(q[0], cache, tables, lens),            # q not 3-d
        lambda: paged_decode_attention(q, cache[:, 0], tables, lens),         # cache not 5-d
        lambda: paged_decode_attention(q, cache, tables.astype(np.int64), lens),
        lambda: paged_decode_attention(q, cache, tables, lens[:1]),
        lambda: paged_decode_attention(q, cache, tables, lens, num_splits=0),
        lambda: paged_decode_attention(q, cache, tables, np.array([5, 999], np.int32)),
        lambda: paged_decode_attention(q, cache, tables, lens, out=np.empty((2, 4, 64))),
        lambda: paged_decode_attention(np.zeros((2, 18, 64), np.float16),
                                       np.zeros((3, 2, 16, 1, 64), np.float16), tables, lens),
        lambda: paged_decode_attention(np.zeros((2, 2, 96), np.float16),
                                       np.zeros((3, 2, 16, 2, 96), np.float16), tables, lens),
        lambda: paged_decode_attention(q, np.zeros((3, 2, 64, 2, 64), np.float16), tables, lens),
        lambda: paged_decode_attention(q.astype(np.float64), cache.astype(np.float64), tables,
                                       lens),
        lambda: write_kv(cache, q[:, :2], q[:, :2], np.array([0], np.int32)),   # length
        lambda: write_kv(cache, q[:, :2], q[:, :2].astype(np.float32), np.array([0, 1], np.int32)),
        lambda: write_kv(cache, q[:, :2], q[:, :2], np.array([0, 1], np.int64)),
        lambda: write_kv(cache, q[:, :2], q[:, :2], np.array([0, 10**6], np.int32)),
        lambda: copy_blocks(cache, np.array([[0, 1, 2]], np.int32)),
        lambda: copy_blocks(cache, np.array([[0, 99]], np.int32)),
        lambda: copy_blocks(cache, np.array([[0, 1], [2, 1]], np.int32)),     # dst twice
        lambda: copy_blocks(cache, np.array([[0, 1], [1, 2]], np.int32)),     # dst is a src
        lambda: copy_blocks([cache, cache[:2]], np.array([[0, 1]], np.int32)),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ConfigError):
            call()
            pytest.fail(f"bad call {i} raised nothing")


# ------------------------------------------------------------------ CuPy kernels (GPU)

def _gpu_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype):
    q, cache, tables, lens = make_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype)
    return (q, cache, tables, lens), (to_device(q), to_device(cache), to_device(tables),
                                      to_device(lens))


def _poisoned_like(dq):
    cp = backend.xp
    out = cp.empty_like(dq)
    if out.dtype == np.uint16:
        out.fill(0x7FC0)                                 # a bf16 NaN's bits
    else:
        out.fill(np.nan)
    return out


def _host(a, dtype):
    a = backend.to_numpy(a)
    return a.view(BF16) if a.dtype == np.uint16 else a


GPU_ATTN_CASES = (
    [(dt, d, 4, 16) for dt in DTYPES for d in (64, 128, 256)]
    + [(dt, 128, 4, bs) for dt in DTYPES for bs in (8, 32)]
    + [(dt, 128, g, 16) for dt in DTYPES for g in (1, 2, 3, 8)]
    + [("float16", 256, 8, 8), ("bfloat16", 64, 1, 32), ("float32", 256, 2, 32)]
)


@gpu
@pytest.mark.parametrize("dtype,head_dim,group,block_size", GPU_ATTN_CASES)
def test_gpu_decode_matches_reference(dtype, head_dim, group, block_size):
    seed = 2000 + head_dim * 7 + group * 13 + block_size + 100 * len(dtype)
    rng = rng_for(seed)
    kv_heads = 2
    host, dev = _gpu_case(rng, [1, 17, 97, 4097, 3 * block_size + 1], group * kv_heads,
                          kv_heads, head_dim, block_size, dtype)
    ref = paged_decode_attention_ref(*host)
    for splits in (None, 1, 4):
        out = _poisoned_like(dev[0])
        res = paged_decode_attention(*dev, out=out, num_splits=splits)
        assert res is out
        got = _host(out, dtype).astype(np.float64)
        assert np.isfinite(got).all(), f"unwritten or NaN output (splits={splits})"
        assert rel_err(got, ref) < TOL[dtype], (splits, rel_err(got, ref))


@gpu
def test_gpu_decode_many_splits_and_big_batch():
    rng = rng_for(3001)
    host, dev = _gpu_case(rng, list(rng.integers(1, 700, 40)), 32, 8, 128, 16, "bfloat16")
    ref = paged_decode_attention_ref(*host)
    for splits in (None, 2, 7, 40):
        got = _host(paged_decode_attention(*dev, num_splits=splits), "bfloat16")
        assert rel_err(got.astype(np.float64), ref) < TOL["bfloat16"], splits


@gpu
@pytest.mark.parametrize("config", [(4, 4, 1, 0), (4, 2, 4, 0), (8, 2, 2, 0), (4, 2, 2, 2),
                                    (4, 1, 6, 0), (8, 1, 2, 2)])
def test_gpu_decode_other_launch_configs(config):
    # (warps, tokens per tile, ring stages, chunks per thread): the benchmark's sweep tries these
    from pagedkv.kernels import attention as attn_mod
    rng = rng_for(3050 + sum(config))
    host, dev = _gpu_case(rng, [1, 17, 97, 2049, 33], 16, 4, 128, 16, "float16")
    ref = paged_decode_attention_ref(*host)
    for splits in (1, 3):
        out = _poisoned_like(dev[0])
        attn_mod._decode_cupy(*dev, 1 / np.sqrt(128), out, splits, "float16", *config)
        got = _host(out, "float16").astype(np.float64)
        assert np.isfinite(got).all() and rel_err(got, ref) < TOL["float16"], (config, splits)


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_gpu_write_kv_matches_reference(dtype):
    rng = rng_for(3100 + len(dtype))
    cache = rng.standard_normal((50, 2, 16, 4, 128)).astype(DTYPES[dtype])
    slots = rng.permutation(50 * 16)[:300].astype(np.int32)
    slots[rng.random(300) < 0.2] = -1
    k = rng.standard_normal((300, 4, 128)).astype(DTYPES[dtype])
    v = rng.standard_normal((300, 4, 128)).astype(DTYPES[dtype])
    dcache = to_device(cache)
    write_kv(dcache, to_device(k), to_device(v), to_device(slots))
    write_kv_ref(cache, k, v, slots)
    np.testing.assert_array_equal(_host(dcache, dtype).view(np.uint8), cache.view(np.uint8))


@gpu
def test_gpu_write_kv_odd_row_width():
    # kv_heads * head_dim * 2 bytes = 6 bytes per row: falls back to 2-byte chunks.
    rng = rng_for(3200)
    cache = rng.standard_normal((4, 2, 8, 1, 3)).astype(np.float16)
    slots = np.array([3, -1, 17, 30], np.int32)
    k, v = (rng.standard_normal((4, 1, 3)).astype(np.float16) for _ in range(2))
    dcache = to_device(cache)
    write_kv(dcache, to_device(k), to_device(v), to_device(slots))
    write_kv_ref(cache, k, v, slots)
    np.testing.assert_array_equal(backend.to_numpy(dcache), cache)


@gpu
def test_gpu_copy_blocks_matches_reference():
    rng = rng_for(3300)
    layers = [rng.standard_normal((64, 2, 16, 8, 128)).astype(np.float16) for _ in range(3)]
    perm = rng.permutation(64).astype(np.int32)
    pairs = np.stack([perm[:20], perm[20:40]], axis=1)
    dev = [to_device(a) for a in layers]
    copy_blocks(dev, pairs)
    copy_blocks_ref(layers, pairs)
    for a, b in zip(dev, layers):
        np.testing.assert_array_equal(backend.to_numpy(a), b)
    one = to_device(layers[0])
    copy_blocks(one, np.array([[perm[50], perm[51]]], np.int32))
    copy_blocks_ref(layers[0], np.array([[perm[50], perm[51]]], np.int32))
    np.testing.assert_array_equal(backend.to_numpy(one), layers[0])
