"""Tests of pagedkv.kernels: the NumPy paths always, the CuPy kernels when a GPU is usable.

Every case draws fresh random data from a fixed seed that is printed (pytest shows it on failure);
pages are scattered by a random permutation of block ids; outputs are NaN-poisoned before a run
and must come back fully written. The staircase kernels of chapter 9 have their own file,
tests/test_staircase.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from _attn_cases import (DTYPES, TOL, host, make_case, poisoned_like, rel_err, rng_for,
                         to_gpu)
from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import (copy_blocks, copy_blocks_ref, decode_plan, dense_attention,
                             gather_kv, paged_decode_attention, paged_decode_attention_ref,
                             write_kv, write_kv_ref)
from pagedkv.kernels._common import to_device
from pagedkv.kernels.attention import uses_tensor_cores


from _attn_cases import _bfloat16_needs_ml_dtypes, gpu  # noqa: F401 (a fixture)


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
    assert choose_num_splits(sms * occ, 8192, sms, occ, tile) == 1          # one full wave
    assert choose_num_splits(sms * occ + 1, 8192, sms, occ, tile) == 2      # a thin 2nd wave
    assert choose_num_splits(sms * occ + 2 * sms, 8192, sms, occ, tile) == 1  # a full 2nd wave
    # the tensor-core kernel: one CTA per SM keeps memory busy (the v6 sweep in perf/LOG.md)
    assert choose_num_splits(512, 2048, sms, 2, 64, saturate=1) == 1       # 64 x 2048, 8 kv
    assert choose_num_splits(128, 8192, sms, 2, 64, saturate=1) == 1       # 16 x 8192
    assert choose_num_splits(8, 32768, sms, 2, 64, saturate=1) == 16       # 1 x 32768
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


JUNK = [np.nan, np.inf, -np.inf]


@pytest.mark.parametrize("junk", JUNK, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_numpy_decode_ignores_junk_in_unwritten_slots(junk, dtype):
    # A pool is not cleared: the tail of a last block and the pages past a shorter row's end
    # (read from block 0 by the NumPy path) may hold NaN or Inf. They must contribute nothing.
    rng = rng_for(150 + JUNK.index(junk) + 10 * len(dtype))
    for group, bs in [(1, 16), (4, 8), (8, 32)]:
        q, cache, tables, lens = make_case(rng, [1, 5, 17, 40, 2 * bs + 3], 2 * group, 2, 64,
                                           bs, dtype, junk=junk)
        assert not np.isfinite(cache.astype(np.float32)).all()     # the junk is really there
        ref = paged_decode_attention_ref(q, cache, tables, lens)
        assert np.isfinite(ref).all()
        for splits in (1, 3):
            out = paged_decode_attention(q, cache, tables, lens, num_splits=splits)
            got = host(out)
            assert np.isfinite(got).all(), (group, bs, splits)
            assert rel_err(got, ref) < TOL[dtype], (group, bs, splits)


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_numpy_lengths_that_fill_their_last_block(block_size):
    # Lengths bs, 2 bs, 3 bs end exactly on a block boundary; the longest row fills its
    # block table exactly. Checked against the reference and against gather + dense attention.
    bs = block_size
    rng = rng_for(160 + bs)
    for lens in ([bs, 2 * bs, 3 * bs], [3 * bs, 3 * bs], [1, bs, 3 * bs - 1, 3 * bs]):
        q, cache, tables, lens = make_case(rng, lens, 8, 2, 64, bs, "float32", junk=np.nan)
        assert tables.shape[1] * bs == lens.max()                  # a full table
        ref = paged_decode_attention_ref(q, cache, tables, lens)
        for b in range(len(lens)):
            naive = dense_attention(q[b], *gather_kv(cache, tables[b], lens[b]))
            assert rel_err(naive, ref[b]) < 1e-5
        for splits in (1, 2, 3):
            got = paged_decode_attention(q, cache, tables, lens, num_splits=splits)
            assert rel_err(got, ref) < TOL["float32"], (lens.tolist(), splits)


def test_write_kv_slot_rule_on_numpy():
    # Negative slots are padding (skipped, whatever the value); a slot past the cache raises
    # ConfigError and writes nothing, even when the other slots are fine.
    rng = rng_for(170)
    cache = rng.standard_normal((3, 2, 4, 1, 8)).astype(np.float32)
    k, v = (rng.standard_normal((4, 1, 8)).astype(np.float32) for _ in range(2))
    before = cache.copy()
    write_kv(cache, k, v, np.array([-1, -2, -1000, 11], np.int32))
    expect = before.copy()
    expect[2, 0, 3], expect[2, 1, 3] = k[3], v[3]
    np.testing.assert_array_equal(cache, expect)
    for bad in (12, 10**6):
        with pytest.raises(ConfigError, match="past the cache"):
            write_kv(cache, k, v, np.array([0, 1, bad, 2], np.int32))
        np.testing.assert_array_equal(cache, expect)


def test_tensor_cores_chosen_for_large_groups_of_half_precision():
    assert [uses_tensor_cores("float16", g) for g in range(1, 9)] == [False] * 4 + [True] * 4
    assert [uses_tensor_cores("bfloat16", g) for g in range(1, 9)] == [False] * 4 + [True] * 4
    assert not any(uses_tensor_cores("float32", g) for g in range(1, 9))


# ------------------------------------------------------------------ CuPy kernels (GPU)

def _gpu_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype, **kw):
    host_case = make_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype, **kw)
    return host_case, to_gpu(host_case)


GPU_ATTN_CASES = (
    [(dt, d, 4, 16) for dt in DTYPES for d in (64, 128, 256)]
    + [(dt, 128, 4, bs) for dt in DTYPES for bs in (8, 32)]
    + [(dt, 128, g, 16) for dt in DTYPES for g in (1, 2, 3, 8)]
    + [("float16", 256, 8, 8), ("bfloat16", 64, 1, 32), ("float32", 256, 2, 32),
       ("bfloat16", 256, 8, 32), ("float16", 64, 8, 8)]
)
PATHS = {"cuda-cores": False, "tensor-cores": True}


def _paths(dtype):
    return ["cuda-cores"] if dtype == "float32" else list(PATHS)


@gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype,head_dim,group,block_size", GPU_ATTN_CASES)
def test_gpu_decode_matches_reference(dtype, head_dim, group, block_size, path):
    if path not in _paths(dtype):
        pytest.skip("tensor cores take float16 and bfloat16")
    seed = 2000 + head_dim * 7 + group * 13 + block_size + 100 * len(dtype)
    rng = rng_for(seed)
    kv_heads = 2
    host_case, dev = _gpu_case(rng, [1, 17, 97, 4097, 3 * block_size + 1, 2 * block_size],
                               group * kv_heads, kv_heads, head_dim, block_size, dtype)
    ref = paged_decode_attention_ref(*host_case)
    for splits in (None, 1, 4):
        out = poisoned_like(dev[0])
        res = paged_decode_attention(*dev, out=out, num_splits=splits,
                                     tensor_cores=PATHS[path])
        assert res is out
        got = host(out)
        assert np.isfinite(got).all(), f"unwritten or NaN output (splits={splits})"
        assert rel_err(got, ref) < TOL[dtype], (splits, rel_err(got, ref))


@gpu
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group", range(1, 9))
def test_gpu_every_group_on_both_paths(group, dtype, path):
    # Groups 1-8, 5 and 7 included (FlashInfer 0.2.14's plan crashes on some of these).
    rng = rng_for(2500 + 10 * group + len(dtype) + 3 * len(path))
    host_case, dev = _gpu_case(rng, [1, 15, 16, 33, 64, 1000, 2048], 3 * group, 3, 128, 16,
                               dtype)
    ref = paged_decode_attention_ref(*host_case)
    for splits in (None, 1, 3):
        out = poisoned_like(dev[0])
        paged_decode_attention(*dev, out=out, num_splits=splits, tensor_cores=PATHS[path])
        got = host(out)
        assert np.isfinite(got).all() and rel_err(got, ref) < TOL[dtype], (splits,)


@gpu
@pytest.mark.parametrize("junk", JUNK, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype,group,block_size",
                         [("float16", 8, 16), ("bfloat16", 4, 8), ("float32", 2, 32),
                          ("bfloat16", 1, 16), ("float16", 5, 32)])
def test_gpu_decode_ignores_junk_in_unwritten_slots(junk, dtype, group, block_size):
    rng = rng_for(2600 + JUNK.index(junk) + group + block_size)
    host_case, dev = _gpu_case(rng, [1, 5, 17, 40, 3 * block_size, 2 * block_size + 3],
                               2 * group, 2, 128, block_size, dtype, junk=junk)
    ref = paged_decode_attention_ref(*host_case)
    for path in _paths(dtype):
        for splits in (None, 1, 3):
            got = host(paged_decode_attention(*dev, num_splits=splits, tensor_cores=PATHS[path]))
            assert np.isfinite(got).all(), (path, splits)
            assert rel_err(got, ref) < TOL[dtype], (path, splits)


@gpu
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_gpu_lengths_that_fill_their_last_block(block_size):
    bs = block_size
    rng = rng_for(2700 + bs)
    for lens in ([bs, 2 * bs, 3 * bs], [3 * bs, 3 * bs], [1, bs, 3 * bs - 1, 3 * bs]):
        host_case, dev = _gpu_case(rng, lens, 16, 2, 128, bs, "float16", junk=np.nan)
        ref = paged_decode_attention_ref(*host_case)
        for path in PATHS:
            for splits in (None, 1, 2, 3):
                got = host(paged_decode_attention(*dev, num_splits=splits,
                                                  tensor_cores=PATHS[path]))
                assert rel_err(got, ref) < TOL["float16"], (lens, path, splits)


@gpu
def test_gpu_decode_mixed_lengths_1_to_8192():
    rng = rng_for(2800)
    lens = np.concatenate([[1, 8192, 16, 4096], rng.integers(1, 8193, 20)])
    host_case, dev = _gpu_case(rng, lens, 64, 8, 128, 16, "bfloat16", spare_blocks=0)
    ref = paged_decode_attention_ref(*host_case)
    for path in PATHS:
        got = host(paged_decode_attention(*dev, tensor_cores=PATHS[path]))
        assert np.isfinite(got).all() and rel_err(got, ref) < TOL["bfloat16"], path


@gpu
def test_gpu_checks_hold_after_a_good_call_with_the_same_shapes():
    # The public call remembers the shapes it has checked; a bad call must still be refused.
    cp = backend.xp
    rng = rng_for(3050)
    host_case, (q, cache, tables, lens) = _gpu_case(rng, [5, 9], 8, 2, 64, 16, "float16")
    ref = paged_decode_attention_ref(*host_case)
    out = cp.empty_like(q)
    for _ in range(2):                                   # checked, then looked up
        paged_decode_attention(q, cache, tables, lens, out=out)
    strided = cp.zeros(cache.shape[:4] + (2 * cache.shape[4],), cache.dtype)[..., ::2]
    assert strided.shape == cache.shape and not strided.flags.c_contiguous
    for bad in [dict(cache=strided), dict(out=out.astype(cp.float32)),
                dict(tables=tables.astype(cp.int64)), dict(num_splits=0),
                dict(lens=lens[:1]), dict(q=q.astype(cp.float32))]:
        args = dict(q=q, cache=cache, tables=tables, lens=lens, out=out, num_splits=None)
        args.update(bad)
        with pytest.raises(ConfigError):
            paged_decode_attention(args["q"], args["cache"], args["tables"], args["lens"],
                                   out=args["out"], num_splits=args["num_splits"])
            pytest.fail(f"{list(bad)} raised nothing")
    out.fill(np.nan)
    got = host(paged_decode_attention(q, cache, tables, lens, out=out))
    assert rel_err(got, ref) < TOL["float16"]


@gpu
def test_gpu_automatic_choice_of_kernel():
    rng = rng_for(2900)
    for dtype, group, path in [("float16", 8, "tensor-cores"), ("bfloat16", 5, "tensor-cores"),
                               ("float16", 4, "cuda-cores"), ("float32", 8, "cuda-cores")]:
        _, dev = _gpu_case(rng, [5, 9], 2 * group, 2, 64, 16, dtype)
        assert decode_plan(dev[0], dev[1], dev[2]).path == path, (dtype, group)
    with pytest.raises(ConfigError):
        decode_plan(dev[0], dev[1], dev[2], tensor_cores=True)    # float32


@gpu
@pytest.mark.parametrize("config", [(4, 2), (2, 3), (8, 2), (4, 4), (1, 2)])
def test_gpu_tensor_core_launch_configs(config):
    # (warps per CTA, ring stages per warp)
    rng = rng_for(2950 + sum(config))
    host_case, dev = _gpu_case(rng, [1, 17, 97, 2049, 33], 32, 4, 128, 16, "bfloat16")
    ref = paged_decode_attention_ref(*host_case)
    for splits in (1, 3):
        out = poisoned_like(dev[0])
        decode_plan(dev[0], dev[1], dev[2], num_splits=splits, tensor_cores=True,
                    config=config).run(*dev, out=out)
        got = host(out)
        assert np.isfinite(got).all() and rel_err(got, ref) < TOL["bfloat16"], (config, splits)


@gpu
def test_gpu_decode_many_splits_and_big_batch():
    rng = rng_for(3001)
    host_case, dev = _gpu_case(rng, list(rng.integers(1, 700, 40)), 32, 8, 128, 16, "bfloat16")
    ref = paged_decode_attention_ref(*host_case)
    for splits in (None, 2, 7, 40):
        got = host(paged_decode_attention(*dev, num_splits=splits))
        assert rel_err(got, ref) < TOL["bfloat16"], splits


@gpu
@pytest.mark.parametrize("config", [(4, 4, 1, 0), (4, 2, 4, 0), (8, 2, 2, 0), (4, 2, 2, 2),
                                    (4, 1, 6, 0), (8, 1, 2, 2)])
def test_gpu_decode_other_launch_configs(config):
    # (warps, tokens per tile, ring stages, chunks per thread): the benchmark's sweep tries these
    rng = rng_for(3050 + sum(config))
    host_case, dev = _gpu_case(rng, [1, 17, 97, 2049, 33], 16, 4, 128, 16, "float16")
    ref = paged_decode_attention_ref(*host_case)
    for splits in (1, 3):
        out = poisoned_like(dev[0])
        plan = decode_plan(dev[0], dev[1], dev[2], num_splits=splits, tensor_cores=False,
                           config=config)
        plan.run(*dev, out=out)
        got = host(out)
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
    np.testing.assert_array_equal(backend.to_numpy(dcache).view(np.uint8), cache.view(np.uint8))


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


@gpu
@pytest.mark.parametrize("slots_on", ["numpy", "cupy"])
def test_gpu_write_kv_slot_rule(slots_on):
    # The same rule as on NumPy, whether the slot mapping is on the host or on the device.
    rng = rng_for(3400)
    cache = rng.standard_normal((3, 2, 4, 2, 8)).astype(np.float16)
    k, v = (rng.standard_normal((4, 2, 8)).astype(np.float16) for _ in range(2))
    put = (lambda a: a) if slots_on == "numpy" else to_device
    dcache, dk, dv = to_device(cache), to_device(k), to_device(v)
    write_kv(dcache, dk, dv, put(np.array([-1, -2, -1000, 11], np.int32)))
    write_kv_ref(cache, k, v, np.array([-1, -2, -1000, 11], np.int32))
    np.testing.assert_array_equal(backend.to_numpy(dcache), cache)
    for bad in (12, 10**6):
        with pytest.raises(ConfigError, match="past the cache"):
            write_kv(dcache, dk, dv, put(np.array([0, 1, bad, 2], np.int32)))
        np.testing.assert_array_equal(backend.to_numpy(dcache), cache)


# ------------------------------------------------------- the kernel's own source on a CPU

def _emulator():
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "perf/emu/emulate.py"
    spec = importlib.util.spec_from_file_location("emulate", path)
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    return emulate


@pytest.mark.skipif(__import__("shutil").which("g++") is None,
                    reason="the emulator needs g++")
def test_the_split_kernel_on_the_cpu_emulator():
    """The tensor-core kernel's own source on the CPU emulator (perf/emu), three splits run
    in three orders, merged by merge_splits: the reference's numbers, the same bits in
    every order."""
    emulate = _emulator()
    case = make_case(rng_for(4800), [1, 150, 300], 6, 2, 64, 16, "float16", junk=np.nan,
                     max_blocks=24)
    apart = emulate.run_decode_tc(*case, num_splits=3)
    ref = paged_decode_attention_ref(*case)
    assert rel_err(apart.astype(np.float64), ref) < TOL["float16"]
    for order in ([2, 0, 1], [1, 2, 0]):
        again = emulate.run_decode_tc(*case, num_splits=3, order=order)
        assert np.array_equal(again.view(np.uint16), apart.view(np.uint16)), order
