"""Tests of causal prefill attention (pagedkv.kernels.prefill): the NumPy path and its float64
reference always, against an oracle written here; the CUDA kernel when a GPU is usable, and its
source on the CPU emulator (perf/emu) when g++ is there.

Every case draws its data from a printed seed; pages are scattered by a random permutation; the
pool is NaN wherever no token was written, and the tables' padding holds junk block ids, so a
stray read shows; GPU outputs are NaN-poisoned first and must come back fully written.
"""
from __future__ import annotations

import importlib.util
import math
import pathlib
import shutil

import numpy as np
import pytest

from _attn_cases import (DTYPES, TOL, host, make_case, make_prefill_case, poisoned_like,
                         rel_err, rng_for, to_gpu)
from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import (paged_decode_attention, paged_prefill_attention,
                             paged_prefill_attention_ref, prefill_plan)

ROOT = pathlib.Path(__file__).resolve().parents[1]


from _attn_cases import _bfloat16_needs_ml_dtypes, gpu  # noqa: F401 (a fixture)


def oracle(q, cache, tables, query_start, seq_lens, scale=None):
    """Causal attention in float64, the plain way: each sequence's blocks joined into one
    contiguous K and V, every query head given its kv head's copy, a dense softmax under a
    lower-triangular mask. Shares no code with pagedkv."""
    f64 = lambda a: np.asarray(a).astype(np.float32).astype(np.float64)   # noqa: E731
    q, cache = f64(q), f64(cache)
    _, _, bs, kv_heads, d = cache.shape
    group = q.shape[1] // kv_heads
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = np.full(q.shape, np.nan)
    for b, length in enumerate(seq_lens):
        lo, hi = query_start[b], query_start[b + 1]
        n = hi - lo
        if n == 0:
            continue
        nblocks = -(-length // bs)
        k = np.concatenate([cache[tables[b, j], 0] for j in range(nblocks)])[:length]
        v = np.concatenate([cache[tables[b, j], 1] for j in range(nblocks)])[:length]
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [L, q_heads, d]
        s = np.einsum("nhd,lhd->hnl", q[lo:hi], k) * scale
        allowed = np.tril(np.ones((n, length), bool), k=length - n)   # key <= own position
        s = np.where(allowed, s, -np.inf)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        out[lo:hi] = np.einsum("hnl,lhd->nhd", w, v)
    return out


# (new tokens per sequence, tokens already cached per sequence): chunks that start mid-block,
# length-1 chunks, prefix hits, whole prompts, several sequences of different lengths
LAYOUTS = [
    ([1], [0]),
    ([7], [0]),
    ([16], [0]),
    ([100], [0]),
    ([1, 1, 1], [0, 5, 40]),
    ([7, 16, 1, 100], [3, 16, 90, 29]),
    ([33, 0, 65], [17, 4, 0]),                 # a sequence with no new tokens
]
SHAPES = [(dt, d, g, bs) for dt in DTYPES for d, g, bs in
          [(64, 3, 16), (64, 1, 8), (128, 4, 32), (128, 8, 16), (64, 8, 32), (128, 3, 8)]]


# ------------------------------------------------------------------ NumPy paths (CI)

def test_oracle_is_right_on_a_tiny_case():
    # one token at position 1 over keys 0 and 1: softmax of two scores, worked by hand
    cache = np.zeros((2, 2, 8, 1, 64), np.float32)
    cache[1, 0, 0, 0, 0], cache[1, 0, 1, 0, 0] = 1.0, 2.0                 # K
    cache[1, 1, 0, 0, :], cache[1, 1, 1, 0, :] = 10.0, 20.0               # V
    q = np.zeros((1, 1, 64), np.float32)
    q[0, 0, 0] = 8.0                                                       # scores 1 and 2
    tables, qs, lens = np.array([[1]], np.int32), np.array([0, 1], np.int32), \
        np.array([2], np.int32)
    w = np.exp([1.0, 2.0]) / np.exp([1.0, 2.0]).sum()
    expect = w @ [10.0, 20.0]
    for f in (oracle, paged_prefill_attention_ref, paged_prefill_attention):
        np.testing.assert_allclose(np.asarray(f(q, cache, tables, qs, lens), np.float64)[0, 0],
                                   expect, rtol=1e-6)


@pytest.mark.parametrize("dtype,head_dim,group,block_size", SHAPES)
def test_reference_and_numpy_path_match_the_oracle(dtype, head_dim, group, block_size):
    rng = rng_for(4000 + head_dim + 10 * group + block_size + len(dtype))
    kv_heads = 2 if group < 8 else 1
    for qlens, prefix in LAYOUTS:
        case = make_prefill_case(rng, qlens, prefix, group * kv_heads, kv_heads, head_dim,
                                 block_size, dtype, junk=np.nan)
        assert not np.isfinite(case[1].astype(np.float32)).all()     # the junk is there
        want = oracle(*case)
        ref = paged_prefill_attention_ref(*case)
        assert ref.dtype == np.float64 and rel_err(ref, want) < 1e-10, (qlens, prefix)
        out = paged_prefill_attention(*case)
        assert out.dtype == case[0].dtype
        got = host(out)
        assert np.isfinite(got).all(), (qlens, prefix)
        assert rel_err(got, want) < TOL[dtype], (qlens, prefix, rel_err(got, want))


def test_scale_and_out():
    rng = rng_for(4100)
    case = make_prefill_case(rng, [5, 9], [3, 0], 4, 2, 64, 8, "float32")
    out = np.full(case[0].shape, np.nan, np.float32)
    res = paged_prefill_attention(*case, scale=0.3, out=out)
    assert res is out
    assert rel_err(out, oracle(*case, scale=0.3)) < TOL["float32"]
    assert rel_err(paged_prefill_attention_ref(*case, scale=0.3), oracle(*case, scale=0.3)) < 1e-10


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_length_one_chunks_equal_decode(dtype):
    # One new token per sequence is a decode step: the same numbers as the decode kernel's path.
    rng = rng_for(4200 + len(dtype))
    for group, bs in [(3, 16), (1, 8), (8, 32)]:
        lens = [1, 5, 17, 40, 3 * bs]
        q, cache, tables, seq_lens = make_case(rng, lens, 2 * group, 2, 64, bs, dtype,
                                               junk=np.nan)
        qs = np.arange(len(lens) + 1, dtype=np.int32)
        pre = host(paged_prefill_attention(q, cache, tables, qs, seq_lens))
        dec = host(paged_decode_attention(q, cache, tables, seq_lens))
        assert rel_err(pre, dec) < TOL[dtype], (group, bs)


def test_a_prefill_equals_its_tokens_as_decode_rows():
    # What FastRunner.prefill does today: each new token a decode row of length position + 1.
    rng = rng_for(4300)
    q, cache, tables, qs, lens = make_prefill_case(rng, [9, 20], [7, 0], 6, 2, 64, 8,
                                                   "float32", junk=np.nan)
    seq = np.repeat(np.arange(2), np.diff(qs))
    positions = np.concatenate([np.arange(lens[b] - n, lens[b])
                                for b, n in enumerate(np.diff(qs))]).astype(np.int32)
    rows = paged_decode_attention(q, cache, tables[seq], positions + 1)
    assert rel_err(paged_prefill_attention(q, cache, tables, qs, lens), rows) < 1e-5


def test_chunks_give_the_whole_prompts_result():
    # A prompt prefilled in chunks (each starting where the last stopped, mid-block) gives the
    # rows of the prompt prefilled at once.
    rng = rng_for(4400)
    q, cache, tables, qs, lens = make_prefill_case(rng, [45], [0], 3, 1, 64, 16, "float32")
    whole = paged_prefill_attention(q, cache, tables, qs, lens)
    cuts = [0, 5, 6, 21, 45]
    for a, b in zip(cuts, cuts[1:]):
        part = paged_prefill_attention(q[a:b], cache, tables, np.array([0, b - a], np.int32),
                                       np.array([b], np.int32))
        np.testing.assert_allclose(part, whole[a:b], rtol=1e-5, atol=1e-6)


def test_no_new_tokens_at_all():
    rng = rng_for(4500)
    _, cache, tables, _, lens = make_prefill_case(rng, [3, 4], [1, 2], 2, 1, 64, 8, "float16")
    q = np.zeros((0, 2, 64), np.float16)
    out = paged_prefill_attention(q, cache, tables, np.zeros(3, np.int32), lens)
    assert out.shape == (0, 2, 64)


def test_bad_inputs_raise_config_error():
    rng = rng_for(4600)
    q, cache, tables, qs, lens = make_prefill_case(rng, [5, 9], [2, 0], 4, 2, 64, 16, "float16")
    i32 = lambda *v: np.array(v, np.int32)                                # noqa: E731
    call = paged_prefill_attention
    bad_calls = {
        "q dtype": lambda: call(q.astype(np.float32), cache, tables, qs, lens),
        "q heads 3 over 2": lambda: call(q[:, :3], cache, tables, qs, lens),
        "q 2-d": lambda: call(q[0], cache, tables, qs, lens),
        "cache 4-d": lambda: call(q, cache[:, 0], tables, qs, lens),
        "float64": lambda: call(q.astype(np.float64), cache.astype(np.float64), tables, qs,
                                lens),
        "head_dim 256": lambda: call(np.zeros((14, 2, 256), np.float16),
                                     np.zeros((3, 2, 16, 2, 256), np.float16), tables, qs, lens),
        "head_dim 96": lambda: call(np.zeros((14, 2, 96), np.float16),
                                    np.zeros((3, 2, 16, 2, 96), np.float16), tables, qs, lens),
        "block_size 64": lambda: call(q, np.zeros((3, 2, 64, 2, 64), np.float16), tables, qs,
                                      lens),
        "group 9": lambda: call(np.zeros((14, 9, 64), np.float16),
                                np.zeros((3, 2, 16, 1, 64), np.float16), tables, qs, lens),
        "tables int64": lambda: call(q, cache, tables.astype(np.int64), qs, lens),
        "query_start int64": lambda: call(q, cache, tables, qs.astype(np.int64), lens),
        "seq_lens int64": lambda: call(q, cache, tables, qs, lens.astype(np.int64)),
        "query_start short": lambda: call(q, cache, tables, qs[:2], lens),
        "seq_lens short": lambda: call(q, cache, tables, qs, lens[:1]),
        "tables short": lambda: call(q, cache, tables[:1], qs, lens),
        "query_start from 1": lambda: call(q, cache, tables, i32(1, 5, 14), lens),
        "query_start ends early": lambda: call(q, cache, tables, i32(0, 5, 13), lens),
        "query_start falls": lambda: call(q, cache, tables, i32(0, 15, 14), lens),
        "more new tokens than length": lambda: call(q, cache, tables, qs, i32(4, 9)),
        "length past the table": lambda: call(q, cache, tables, qs,
                                              i32(7, tables.shape[1] * 16 + 1)),
        "block outside the pool": lambda: call(q, cache, np.full_like(tables, 10**6), qs, lens),
        "out shape": lambda: call(q, cache, tables, qs, lens, out=np.empty((14, 4, 32),
                                                                          np.float16)),
        "out dtype": lambda: call(q, cache, tables, qs, lens, out=np.empty(q.shape)),
        "scale 0": lambda: call(q, cache, tables, qs, lens, scale=0.0),
        "scale negative": lambda: call(q, cache, tables, qs, lens, scale=-0.1),
    }
    out = np.full(q.shape, 7, np.float16)
    for what, bad in bad_calls.items():
        with pytest.raises(ConfigError):
            bad()
            pytest.fail(f"{what}: raised nothing")
    with pytest.raises(ConfigError, match="seq_len"):
        call(q, cache, tables, qs, i32(4, 9), out=out)
    assert (out == 7).all()                                   # a refused call wrote nothing
    with pytest.raises(ConfigError, match="float16 or bfloat16"):
        prefill_plan(q.astype(np.float32), cache.astype(np.float32), tables)


@pytest.mark.skipif(shutil.which("g++") is None, reason="the emulator needs g++")
def test_the_cuda_source_on_the_cpu_emulator():
    # The kernel's own CUDA source, run on the CPU (perf/emu): its fragment layouts, masks,
    # page-table reads and the host's grid size, on a NaN pool; a GPU run checks the rest.
    spec = importlib.util.spec_from_file_location("emulate", ROOT / "perf/emu/emulate.py")
    emulate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(emulate)
    rng = rng_for(4700)
    case = make_prefill_case(rng, [7, 70, 1], [0, 9, 30], 6, 2, 64, 16, "float16",
                             junk=np.nan)
    got = emulate.run_prefill(*case).astype(np.float64)
    assert np.isfinite(got).all()
    assert rel_err(got, oracle(*case)) < TOL["float16"]


# ------------------------------------------------------------------ the CUDA kernel (GPU)

# Each (dtype, head_dim, group, block_size) is one compiled instance: SmolLM2's shape (fp16,
# 64, 3) at every block size, a Llama-8B-like one (bf16, 128, 4), and every dtype x head_dim x
# group in {1, 3, 4, 8} at block size 16.
GPU_SHAPES = sorted(
    {(dt, d, g, 16) for dt in ("float16", "bfloat16") for d in (64, 128) for g in (1, 3, 4, 8)}
    | {("float16", 64, 3, bs) for bs in (8, 32)} | {("bfloat16", 128, 4, bs) for bs in (8, 32)}
    | {("float16", 128, 8, 8), ("bfloat16", 64, 1, 32)})
GPU_LAYOUTS = LAYOUTS + [
    ([512], [0]),
    ([512], [37]),                              # a chunk after a 37-token prefix
    ([7, 100, 512, 1, 16, 100, 7, 512], [0, 5, 16, 0, 33, 100, 8, 300]),   # batch 8
]


def _run_gpu(case, **kw):
    dev = to_gpu(case)
    out = poisoned_like(dev[0])
    res = paged_prefill_attention(*dev, out=out, **kw)
    assert res is out
    return host(out)


@gpu
@pytest.mark.parametrize("dtype,head_dim,group,block_size", GPU_SHAPES)
def test_gpu_prefill_matches_reference(dtype, head_dim, group, block_size):
    rng = rng_for(5000 + 7 * head_dim + 13 * group + block_size + 100 * len(dtype))
    kv_heads = 3 if group < 8 else 1
    for qlens, prefix in GPU_LAYOUTS:
        case = make_prefill_case(rng, qlens, prefix, group * kv_heads, kv_heads, head_dim,
                                 block_size, dtype, junk=np.nan)
        ref = paged_prefill_attention_ref(*case)
        got = _run_gpu(case)
        assert np.isfinite(got).all(), f"unwritten or NaN output: {qlens} {prefix}"
        assert rel_err(got, ref) < TOL[dtype], (qlens, prefix, rel_err(got, ref))


@gpu
@pytest.mark.parametrize("config", [(4, 1, 64, 2), (4, 1, 32, 2), (4, 1, 64, 3), (2, 1, 64, 2),
                                    (8, 1, 64, 2), (4, 2, 32, 2), (4, 1, 128, 2)],
                         ids=lambda c: "x".join(map(str, c)))
def test_gpu_launch_shapes(config):
    # The default launch and the shapes perf/prefill_check.py times beside it.
    rng = rng_for(5500 + sum(config))
    for dtype, d, g in [("float16", 64, 3), ("bfloat16", 128, 4)]:
        case = make_prefill_case(rng, [7, 300, 1, 100], [0, 40, 9, 0], 3 * g, 3, d, 16, dtype,
                                 junk=np.nan)
        got = _run_gpu(case, config=config)
        assert np.isfinite(got).all() and rel_err(got, oracle(*case)) < TOL[dtype], config


@gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gpu_length_one_chunks_equal_decode(dtype):
    rng = rng_for(5600 + len(dtype))
    for group, bs in [(3, 16), (1, 8), (8, 32), (4, 16)]:
        lens = [1, 5, 17, 40, 3 * bs, 1000]
        host_case = make_case(rng, lens, 3 * group, 3, 64 if group != 4 else 128, bs, dtype,
                              junk=np.nan)
        q, cache, tables, seq_lens = to_gpu(host_case)
        qs = backend.xp.arange(len(lens) + 1, dtype=np.int32)
        pre = host(paged_prefill_attention(q, cache, tables, qs, seq_lens))
        for tc in (False, True):
            dec = host(paged_decode_attention(q, cache, tables, seq_lens, tensor_cores=tc))
            assert rel_err(pre, dec) < TOL[dtype], (group, bs, tc)


@gpu
def test_gpu_long_chunks_and_a_long_prefix():
    rng = rng_for(5700)
    case = make_prefill_case(rng, [2048, 1, 700], [0, 4000, 3000], 9, 3, 64, 16, "float16",
                             junk=np.nan)
    got = _run_gpu(case)
    assert np.isfinite(got).all() and rel_err(got, paged_prefill_attention_ref(*case)) < \
        TOL["float16"]


@gpu
def test_gpu_checks_hold_after_a_good_call_with_the_same_shapes():
    cp = backend.xp
    rng = rng_for(5800)
    host_case = make_prefill_case(rng, [5, 9], [2, 0], 6, 2, 64, 16, "float16")
    q, cache, tables, qs, lens = to_gpu(host_case)
    out = cp.empty_like(q)
    for _ in range(2):                                   # checked, then looked up
        paged_prefill_attention(q, cache, tables, qs, lens, out=out)
    strided = cp.zeros(cache.shape[:4] + (2 * cache.shape[4],), cache.dtype)[..., ::2]
    for bad in [dict(cache=strided), dict(out=out.astype(cp.float32)),
                dict(tables=tables.astype(cp.int64)), dict(qs=qs.astype(cp.int64)),
                dict(lens=lens[:1]), dict(q=q.astype(cp.float32)),
                dict(q=q.astype(cp.float32), cache=cache.astype(cp.float32),
                     out=out.astype(cp.float32))]:
        args = dict(q=q, cache=cache, tables=tables, qs=qs, lens=lens, out=out)
        args.update(bad)
        with pytest.raises(ConfigError):
            paged_prefill_attention(args["q"], args["cache"], args["tables"], args["qs"],
                                    args["lens"], out=args["out"])
            pytest.fail(f"{list(bad)} raised nothing")
    out.fill(np.nan)
    got = host(paged_prefill_attention(q, cache, tables, qs, lens, out=out))
    assert rel_err(got, oracle(*host_case)) < TOL["float16"]
