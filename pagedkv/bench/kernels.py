"""Benchmark of the KV kernels on a GPU: ``python -m pagedkv.bench.kernels [--json PATH]``.

For every shape × dtype of ``bench/decode_shapes.json`` (pages scattered at random) it times, in
one process: our ``paged_decode_attention`` (the automatic choice, and the other kernel);
FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper`` on the very same cache memory, both its
CUDA-core and its tensor-core path, when FlashInfer imports (a group FlashInfer might crash on
is first tried in a child process); PyTorch SDPA on the same K/V gathered contiguous when the
lengths are equal; and, for the paging tax, our kernel again on the same K/V with each
sequence's blocks consecutive and the identity page table (``pagedkv.identity_table``). The
tax is ours / SDPA − 1; ours / identity − 1 is the part the scattered blocks cost. The
``tax_sweep`` of the shapes file times the same columns against sequence length (rows
``tax_sweep.*``). FlashInfer's JIT modules are prebuilt through the installed release's own API
(0.2.x or 0.7), or compile at first use where it has none known here; the run's meta records
``flashinfer_version`` and ``flashinfer_prebuilt``. Outputs are checked against the float64
reference (on two sequences) and the peers before anything is timed. Times are medians of CUDA-event timings after warm-up;
bandwidth is K+V bytes read / time in decimal TB/s. Ceilings: a 2 GiB device-to-device copy
(bytes read + written) and a read-only kernel over 2 GiB. ``--staircase`` times chapter 9's
seven steps; ``write_kv`` and ``copy_blocks`` are timed moving 1 GB.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import pathlib
import statistics
import sys
import time
import zlib

import numpy as np

from .. import backend
from ..kernels import copy_blocks, decode_plan, paged_decode_attention, write_kv
from ..kernels import paged_decode_attention_ref
from ..kernels._common import BF16, kernel, nvrtc_target, sm_count
from ..kernels.staircase import STEPS, run_step
from .kernel_peers import (FlashInferDecode, load_peers, prebuild_flashinfer, probe_flashinfer,
                           to_torch)

ROOT = pathlib.Path(__file__).resolve().parents[2]
RATED_TBPS = 4.8      # the H200's HBM3e bandwidth by NVIDIA's datasheet (the floor's rate)
TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}


# --------------------------------------------------------------------------- timing

def _events(kind):
    if kind == "torch":
        import torch
        return (lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize,
                lambda a, b: a.elapsed_time(b))
    cp = backend.xp
    return cp.cuda.Event, lambda: cp.cuda.Device().synchronize(), cp.cuda.get_elapsed_time


def time_fn(fn, kind="cupy", warmup=5, reps=30, target_ms=1.0):
    """(median ms per call, median ms of single calls bracketed alone), by CUDA events.

    Each of the ``reps`` measurements brackets enough back-to-back calls to last about
    ``target_ms``, so the GPU time is measured rather than the launch gaps of a short kernel.
    Calls over 20 ms get 2 warm-ups and 3 measurements; shorter ones are warmed up for at
    least 25 ms first.
    """
    event, sync, elapsed = _events(kind)

    def measure(inner, n):
        out = []
        for _ in range(n):
            a, b = event(), event()
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            out.append(elapsed(a, b) / inner)
        return statistics.median(out)

    first = measure(1, 1)                                 # also compiles, loads, warms up
    if first > 20:
        return measure(1, 3), first
    # at least `warmup` calls and 25 ms of them: an idle GPU runs at a low clock (345 MHz on
    # the H200) and takes a while to speed up, which the first calls would otherwise pay
    t_end = time.perf_counter() + 0.025
    n = 0
    while n < warmup or time.perf_counter() < t_end:
        fn()
        n += 1
        if n % 64 == 0:
            sync()
    sync()
    single = measure(1, max(5, reps // 3))
    inner = max(1, min(50, math.ceil(target_ms / max(single, 1e-3))))
    return measure(inner, reps), single


def copy_bandwidth(nbytes=2 << 30):
    """Bytes read + written per second of a device-to-device copy of ``nbytes``."""
    cp = backend.xp
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    ms, _ = time_fn(lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
        cp.cuda.get_current_stream().ptr), reps=20)
    return 2 * nbytes / (ms * 1e-3), ms


READ_SOURCE = r"""
// Read every 16-byte chunk of p once and fold it into one word (so the loads stay).
extern "C" __global__ void read_all(const uint4* p, long long n, unsigned* sink) {
    unsigned x = 0;
    #pragma unroll 4
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const uint4 v = p[i];
        x ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (x == 0x9e3779b9u) sink[0] = x;
}
"""


def read_bandwidth(nbytes=2 << 30):
    """Bytes per second of a kernel that only reads ``nbytes`` (no writes): a read ceiling."""
    cp = backend.xp
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    sink = cp.zeros(1, cp.uint32)
    fn = kernel(READ_SOURCE, "read_all")
    n = np.int64(nbytes // 16)
    ms, _ = time_fn(lambda: fn((sm_count() * 8,), (512,), (src, n, sink)), reps=20)
    return nbytes / (ms * 1e-3), ms


# --------------------------------------------------------------------------- problems

def _cupy_randn(shape, dtype, rng):
    """Random normal data of ``dtype`` on the GPU (bf16 as uint16 bits)."""
    cp = backend.xp
    x = rng.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        return ((x.view(cp.uint32) + 0x8000) >> 16).astype(cp.uint16)   # round to nearest
    return x.astype(dtype)


def shape_lengths(shape, seed):
    """Each sequence's length: ``seq_len``, or for ``"seq_len": "mixed"`` random lengths from 1
    to ``max_len`` (the first two are 1 and ``max_len``)."""
    if shape["seq_len"] != "mixed":
        return np.full(shape["batch"], shape["seq_len"], np.int32)
    lens = np.random.default_rng(seed).integers(1, shape["max_len"] + 1, shape["batch"])
    lens[:2] = 1, shape["max_len"]
    return lens.astype(np.int32)


def make_problem(lens, q_heads, kv_heads, head_dim, block_size, dtype, seed):
    """q, cache, block tables, lengths on the GPU; every page at a random place in the pool."""
    cp = backend.xp
    lens = np.asarray(lens, np.int32)
    rng = cp.random.default_rng(seed)
    pages = -(-lens // block_size)
    cache = _cupy_randn((int(pages.sum()), 2, block_size, kv_heads, head_dim), dtype, rng)
    perm = np.random.default_rng(seed).permutation(int(pages.sum())).astype(np.int32)
    tables = np.zeros((len(lens), int(pages.max())), np.int32)
    for b, start in enumerate(np.concatenate([[0], np.cumsum(pages)[:-1]])):
        tables[b, :pages[b]] = perm[start:start + pages[b]]
    q = _cupy_randn((len(lens), q_heads, head_dim), dtype, rng)
    return q, cache, cp.asarray(tables), cp.asarray(lens)


def contiguous_layout(cache, tables):
    """The same K/V with each sequence's blocks side by side, and its identity page table:
    block ``i`` of sequence ``b`` is block ``b * nblocks + i`` (``nblocks``: the table's
    width). A table entry past a sequence's end points at a copy of what the scattered
    table's padding pointed at, which no kernel reads. Our kernel on this layout does the
    same lookups and arithmetic as on the scattered one; only where the blocks lie differs."""
    xp = backend.xp
    batch, nblocks = tables.shape
    cache_c = cache[xp.asarray(tables).reshape(-1)]      # block b*nblocks+i = tables[b, i]
    return cache_c, xp.arange(batch * nblocks, dtype=xp.int32).reshape(batch, nblocks)


def host_float(a):
    a = backend.to_numpy(a)
    return (a.view(BF16) if a.dtype == np.uint16 else a).astype(np.float64)


def rel_err(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def reference_subset(q, cache, tables, lens, rows):
    """Float64 reference for a few sequences: copy only their blocks to the host."""
    t = backend.to_numpy(tables)[rows]
    n = -(-backend.to_numpy(lens)[rows] // cache.shape[2])
    used = np.unique(np.concatenate([t[i, :n[i]] for i in range(len(rows))]))
    remap = np.where(np.arange(t.shape[1])[None, :] < n[:, None],
                     np.searchsorted(used, t), 0).astype(np.int32)
    sub = backend.to_numpy(cache[backend.xp.asarray(used)])
    qh = backend.to_numpy(q)[rows]
    if sub.dtype == np.uint16:
        sub, qh = sub.view(BF16), qh.view(BF16)
    return paged_decode_attention_ref(qh, sub, remap, backend.to_numpy(lens)[rows])


# --------------------------------------------------------------------------- the runs

def bench_decode(shape, dtype, spec, peers, args, rows, log, prefix="", both_kernels=True):
    """Time one shape: ours (the automatic choice; with ``both_kernels`` the other kernel too),
    ours on the identity table, FlashInfer, SDPA. ``prefix`` starts every row's ``impl`` (the
    length sweep's rows are ``tax_sweep.*``, apart from the shapes' table)."""
    cp = backend.xp
    q_heads, kv_heads = shape["q_heads"], shape["kv_heads"]
    d, bs = spec["head_dim"], spec["block_size"]
    seed = zlib.crc32(repr((shape, dtype)).encode())
    lens = shape_lengths(shape, seed)
    kv_bytes = 2 * int(lens.sum()) * kv_heads * d * (4 if dtype == "float32" else 2)
    q, cache, tables, dlens = make_problem(lens, q_heads, kv_heads, d, bs, dtype, seed)
    base = dict(dtype=dtype, batch=len(lens), seq_len=shape["seq_len"], q_heads=q_heads,
                kv_heads=kv_heads, head_dim=d, block_size=bs, kv_bytes=kv_bytes,
                floor_us=round(kv_bytes / RATED_TBPS / 1e6, 2))

    def row(impl, ms, **extra):
        r = dict(impl=prefix + impl, **base, us=round(ms * 1e3, 2),
                 tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 4), **extra)
        rows.append(r)
        return r

    # correctness first: poisoned output, reference on two sequences, for both our kernels
    pick = [0, len(lens) - 1] if len(lens) > 1 else [0]
    ref = reference_subset(q, cache, tables, dlens, pick)
    out = cp.empty_like(q)
    paths = [None] if dtype == "float32" or not both_kernels else [None, False, True]
    got, msg = None, []
    for tc in paths:
        out.fill(0x7FC0 if out.dtype == np.uint16 else np.nan)
        plan = decode_plan(q, cache, tables, tensor_cores=tc)
        paged_decode_attention(q, cache, tables, dlens, out=out, tensor_cores=tc)
        res = host_float(out)
        assert np.isfinite(res).all(), f"{plan.path}: NaN or unwritten output"
        err = rel_err(res[pick], ref)
        assert err < TOL[dtype], f"{plan.path}: error vs reference {err:.2e} ≥ {TOL[dtype]}"
        got = res if tc is None else got
        ms, single = time_fn(lambda: paged_decode_attention(q, cache, tables, dlens, out=out,
                                                            tensor_cores=tc), reps=args.reps)
        extra = dict(path=plan.path, num_splits=plan.num_splits, regs=plan.registers,
                     spill_bytes=plan.spill_bytes, err_vs_ref=err,
                     us_single_call=round(single * 1e3, 2))
        row("pagedkv" if tc is None else f"pagedkv.{plan.path}", ms, **extra)
        msg.append(f"{'auto ' if tc is None else ''}{plan.path} {ms * 1e3:7.1f} us "
                   f"(splits {plan.num_splits}, err {err:.1e})")
        if tc is None:   # the same launches without the argument checks: the Python share
            ms_l, _ = time_fn(lambda: plan.run(q, cache, tables, dlens, out), reps=args.reps)
            row("pagedkv.launch_only", ms_l, path=plan.path)

    # the paging tax's first part: the same K/V, each sequence's blocks consecutive, the
    # identity page table; ours(scattered) / ours(identity) - 1 is what the scatter costs
    cache_c, tables_c = contiguous_layout(cache, tables)
    out.fill(0x7FC0 if out.dtype == np.uint16 else np.nan)
    plan = decode_plan(q, cache_c, tables_c)
    paged_decode_attention(q, cache_c, tables_c, dlens, out=out)
    res = host_float(out)
    err = rel_err(res[pick], ref)
    assert err < TOL[dtype], f"identity table: error vs reference {err:.2e} ≥ {TOL[dtype]}"
    same = bool(np.array_equal(res, got))    # the same arithmetic: bit for bit, expected
    ms_c, single = time_fn(lambda: paged_decode_attention(q, cache_c, tables_c, dlens,
                                                          out=out), reps=args.reps)
    row("pagedkv.identity_table", ms_c, path=plan.path, num_splits=plan.num_splits,
        err_vs_ref=err, bitwise_equal_to_scattered=same,
        us_single_call=round(single * 1e3, 2))
    msg.append(f"identity table {ms_c * 1e3:7.1f} us" + ("" if same else " (not bitwise)"))
    del cache_c, tables_c

    torch = peers.get("torch")
    fi_best, fi_note = None, ""
    if "flashinfer" in peers and dtype != "float32":
        ok = {True: True, False: True}
        if q_heads // kv_heads not in (1, 2, 3, 4, 8):
            ok, fi_note = probe_flashinfer(q_heads, kv_heads, dtype)
            log(f"    FlashInfer probe {q_heads}/{kv_heads} {dtype}: {ok} ({fi_note})")
            rows.append(dict(impl="flashinfer.probe", **base, ran_tensor_cores=ok[True],
                             ran_cuda_cores=ok[False], note=fi_note))
        for tc in (False, True):
            name = "flashinfer.tc" if tc else "flashinfer.cuda"
            if not ok[tc]:
                msg.append(f"{name} did not run (see probe)")
                continue
            fi = FlashInferDecode(peers["flashinfer"], torch, q, cache, tables, dlens, dtype, tc)
            fo = fi()
            torch.cuda.synchronize()
            err_fi = rel_err(got, fo.float().cpu().numpy().astype(np.float64))
            assert err_fi < 2 * TOL[dtype], f"differs from {name} by {err_fi:.2e}"
            ms_fi, single = time_fn(fi, "torch", reps=args.reps)
            r = row(name, ms_fi, err_vs_ours=err_fi, us_single_call=round(single * 1e3, 2),
                    backend=fi.backend)
            msg.append(f"{name} {ms_fi * 1e3:7.1f} us")
            if fi_best is None or r["us"] < fi_best["us"]:
                fi_best = r
            del fi
        if fi_best is not None:
            row("flashinfer", fi_best["us"] / 1e3, path=fi_best["impl"].split(".")[1])
    if torch is not None and shape["seq_len"] != "mixed":
        tq = to_torch(q, dtype).reshape(len(lens), q_heads, 1, d)
        tc_, tt = to_torch(cache, dtype), torch.from_dlpack(tables).long()
        L = int(lens[0])   # gather each sequence's pages into contiguous [B, H, L, D] (not timed)
        kc = tc_[tt, 0].reshape(len(lens), -1, kv_heads, d)[:, :L].transpose(1, 2).contiguous()
        vc = tc_[tt, 1].reshape(len(lens), -1, kv_heads, d)[:, :L].transpose(1, 2).contiguous()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        kw = {"enable_gqa": True} if q_heads != kv_heads else {}
        so = sdpa(tq, kc, vc, **kw)
        err_sdpa = rel_err(got, so.reshape(len(lens), q_heads, d).float().cpu().numpy())
        assert err_sdpa < 2 * TOL[dtype], f"differs from SDPA by {err_sdpa:.2e}"
        ms_s, single = time_fn(lambda: sdpa(tq, kc, vc, **kw), "torch", reps=args.reps)
        row("sdpa_contiguous", ms_s, err_vs_ours=err_sdpa, us_single_call=round(single * 1e3, 2))
        msg.append(f"sdpa {ms_s * 1e3:7.1f} us")
        del kc, vc
    log(f"  {dtype:8s} b{len(lens):<4d} L{shape['seq_len']!s:<6s} {q_heads}/{kv_heads}: "
        + " | ".join(msg))


def bench_tax_sweep(sweep, spec, peers, args, rows, log):
    """The paging tax against sequence length: for each head layout and length of
    ``sweep`` (``batch``, ``heads`` [[q, kv], ...], ``seq_lens``, ``dtype``), ours on the
    scattered table, ours on the identity table, FlashInfer and SDPA, as rows
    ``tax_sweep.*``."""
    for q_heads, kv_heads in sweep["heads"]:
        for L in sweep["seq_lens"]:
            shape = dict(batch=sweep["batch"], seq_len=L, q_heads=q_heads, kv_heads=kv_heads)
            bench_decode(shape, sweep["dtype"], spec, peers, args, rows, log,
                         prefix="tax_sweep.", both_kernels=False)
            free_memory(peers)


def bench_staircase(shapes, spec, rows, log, reps):
    """Chapter 9's seven steps on each shape (fp16), each checked against step 6 first."""
    d, bs = spec["head_dim"], spec["block_size"]
    for shape in shapes:
        lens = shape_lengths(shape, 1)
        q, cache, tables, dlens = make_problem(lens, shape["q_heads"], shape["kv_heads"], d,
                                               bs, "float16", 1)
        kv_bytes = 2 * int(lens.sum()) * shape["kv_heads"] * d * 2
        prod = host_float(run_step(6, q, cache, tables, dlens))
        for step in STEPS:
            out = run_step(step, q, cache, tables, dlens)
            err = rel_err(host_float(out), prod)
            assert err < 2e-3, f"staircase step {step} differs from step 6 by {err:.1e}"
            ms, _ = time_fn(lambda: run_step(step, q, cache, tables, dlens, out=out), reps=reps)
            rows.append(dict(impl="staircase", step=step, what=STEPS[step], dtype="float16",
                             batch=len(lens), seq_len=shape["seq_len"], q_heads=shape["q_heads"],
                             kv_heads=shape["kv_heads"], head_dim=d, block_size=bs,
                             kv_bytes=kv_bytes, us=round(ms * 1e3, 2),
                             tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 4),
                             floor_us=round(kv_bytes / RATED_TBPS / 1e6, 2), err_vs_step6=err))
            log(f"  staircase b{len(lens)} L{shape['seq_len']} {shape['q_heads']}/"
                f"{shape['kv_heads']} step {step}: {ms * 1e3:10.1f} us ({STEPS[step]})")
        free_memory({})


def bench_cache_ops(rows, log, copy_bw):
    cp = backend.xp
    rng = cp.random.default_rng(7)
    bs, kv_heads, d = 16, 8, 128
    tokens, n = 131072, 8192                 # n: copy_blocks pairs, so 2n blocks are needed
    num_blocks = max(tokens // bs, 2 * n) + 64
    cache = cp.empty((num_blocks, 2, bs, kv_heads, d), cp.float16)
    k, v = (_cupy_randn((tokens, kv_heads, d), "float16", rng) for _ in range(2))
    slots = np.random.default_rng(8).permutation(num_blocks * bs)[:tokens].astype(np.int32)
    dslots = cp.asarray(slots)
    write_kv(cache, k, v, slots)
    sample = np.random.default_rng(9).choice(tokens, 64, replace=False)
    kc = backend.to_numpy(cache[cp.asarray(slots[sample] // bs), 0, cp.asarray(slots[sample] % bs)])
    assert np.array_equal(kc, backend.to_numpy(k)[sample]), "write_kv wrote the wrong rows"
    perm = np.random.default_rng(10).permutation(num_blocks).astype(np.int32)
    pairs = np.stack([perm[:n], perm[n:2 * n]], axis=1)
    copy_blocks(cache, pairs)
    for src, dst in pairs[:: n // 16]:   # compare bits: blocks never written hold any bytes
        assert bool((cache[int(src)].view(cp.uint16) == cache[int(dst)].view(cp.uint16)).all())
    dpairs = cp.asarray(pairs)
    # on the device: the host-side checks of 131072 slots / 8192 pairs would dominate the timing
    for name, fn, moved in [
            ("write_kv", lambda: write_kv(cache, k, v, dslots, validate=False),
             2 * (k.nbytes + v.nbytes)),
            ("copy_blocks", lambda: copy_blocks(cache, dpairs, validate=False),
             2 * n * (cache.nbytes // num_blocks))]:
        ms, _ = time_fn(fn, reps=20)
        bw = moved / (ms * 1e-3)
        rows.append(dict(impl=f"pagedkv.{name}", dtype="float16", us=round(ms * 1e3, 2),
                         bytes_moved=moved, tbps=round(bw / 1e12, 4),
                         fraction_of_copy=round(bw / copy_bw, 4)))
        log(f"  {name:12s}{moved / 1e6:7.0f} MB moved in {ms * 1e3:8.1f} us = "
            f"{bw / 1e12:.3f} TB/s = {bw / copy_bw:.1%} of copy")


def _gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def paging_tax(rows, prefix=""):
    """Per shape (rows whose ``impl`` starts with ``prefix``): ours on the scattered table,
    ours on the identity table, SDPA on contiguous K/V, FlashInfer; and

    * ``tax`` = ours / SDPA − 1: what paging costs against no page table at all;
    * ``indirection`` = ours / ours on the identity table − 1: the part of it that comes
      from the blocks being scattered (the lookups and address arithmetic are the same in
      both, so they are not in it);
    * ``rest`` = ours on the identity table / SDPA − 1: the part that is not the scatter;
    * ``fi_over_ours`` = FlashInfer's time / ours (> 1: ours is faster).

    Returns {(dtype, batch, seq_len, q_heads, kv_heads): dict of those (None where a column
    did not run)}, in the rows' order."""
    impls = {prefix + k: k for k in ("pagedkv", "pagedkv.identity_table", "sdpa_contiguous",
                                     "flashinfer")}
    by = {}
    for r in rows:
        if r["impl"] in impls:
            key = (r["dtype"], r["batch"], r["seq_len"], r["q_heads"], r["kv_heads"])
            by.setdefault(key, {})[impls[r["impl"]]] = r["us"]
    out = {}
    for key, us in by.items():
        if "pagedkv" not in us:
            continue
        o, i, s, f = (us.get(k) for k in ("pagedkv", "pagedkv.identity_table",
                                          "sdpa_contiguous", "flashinfer"))
        out[key] = dict(ours_us=o, identity_us=i, sdpa_us=s, flashinfer_us=f,
                        tax=o / s - 1 if s else None,
                        indirection=o / i - 1 if i else None,
                        rest=i / s - 1 if i and s else None,
                        fi_over_ours=f / o if f else None)
    return out


def tax_goals(cases, tax_goal=0.03):
    """The issue's goals over :func:`paging_tax`'s cases: geometric means of the tax and its
    parts (as ratios − 1), and FlashInfer's time over ours per GQA group."""
    pick = lambda name: [1 + c[name] for c in cases.values() if c[name] is not None]
    gm1 = lambda xs: None if not xs else _gm(xs) - 1
    groups = {}
    for k, c in cases.items():
        if c["fi_over_ours"] is not None:
            groups.setdefault(k[3] // k[4], []).append(c["fi_over_ours"])
    by_group = {g: _gm(v) for g, v in sorted(groups.items())}
    tax = gm1(pick("tax"))
    return dict(geomean_tax=tax, tax_cases=len(pick("tax")),
                geomean_indirection=gm1(pick("indirection")),
                indirection_cases=len(pick("indirection")),
                geomean_rest=gm1(pick("rest")), tax_goal=tax_goal,
                tax_goal_met=None if tax is None else tax <= tax_goal,
                flashinfer_over_pagedkv_by_group=by_group,
                ahead_of_flashinfer_every_group=(all(x > 1 for x in by_group.values())
                                                 if by_group else None))


def summary(rows, log):
    """The table, geometric means of FlashInfer's time over ours (> 1: we are faster), and
    the paging tax (ours against SDPA on contiguous K/V, and against ours on the identity
    table)."""
    by = {}
    for r in rows:
        if r["impl"] in ("pagedkv", "flashinfer", "sdpa_contiguous"):
            key = (r["dtype"], r["batch"], r["seq_len"], r["q_heads"], r["kv_heads"])
            by.setdefault(key, {})[r["impl"]] = r
    cases = paging_tax(rows)
    pct = lambda x: f"{x:+7.1%}" if x is not None else f"{'-':>7s}"
    fmt = lambda x: "-" if x is None else f"{x:+.1%}"
    tick = {True: "met", False: "not met", None: "-"}
    log(f"\n{'dtype':9s}{'batch':>6s}{'seq':>7s}{'heads':>7s} | {'ours us':>8s} {'path':>5s} | "
        f"{'FI us':>8s} {'path':>5s} | {'sdpa us':>8s} | {'ident us':>8s} | {'FI/ours':>7s} "
        f"{'sdpa/ours':>9s} | {'tax':>7s} {'scatter':>7s}")
    ratios, g8 = [], []
    for k, v in by.items():
        o, f, s = v["pagedkv"], v.get("flashinfer"), v.get("sdpa_contiguous")
        ratio = f["us"] / o["us"] if f else None
        if ratio:
            ratios.append(ratio)
            if k[3] == 8 * k[4]:
                g8.append(ratio)
        c = cases.get(k, {})
        cell = lambda r: f"{r['us']:8.1f} {'tc' if r.get('path', '').startswith('t') else 'cc':>5s}"
        log(f"{k[0]:9s}{k[1]:6d}{k[2]!s:>7s}{k[3]:>4d}/{k[4]:<2d} | {cell(o)} | "
            + (cell(f) if f else f"{'not run':>14s}") + " | "
            + (f"{s['us']:8.1f}" if s else f"{'-':>8s}") + " | "
            + (f"{c['identity_us']:8.1f}" if c.get("identity_us") else f"{'-':>8s}") + " | "
            + (f"{ratio:7.3f}" if ratio else f"{'-':>7s}")
            + (f" {s['us'] / o['us']:9.3f}" if s else f" {'-':>9s}")
            + f" | {pct(c.get('tax'))} {pct(c.get('indirection'))}")
    res = dict(geomean_flashinfer_over_pagedkv=_gm(ratios), cases=len(ratios),
               pagedkv_faster_cases=sum(r > 1 for r in ratios),
               geomean_group8=_gm(g8), group8_cases=len(g8))
    log(f"geometric mean of FlashInfer time / ours: {res['geomean_flashinfer_over_pagedkv']} over "
        f"{len(ratios)} cases (ours faster on {res['pagedkv_faster_cases']}); group 8: "
        f"{res['geomean_group8']} over {len(g8)}")
    goals = tax_goals(cases)
    res["paging_tax"] = goals
    if goals["geomean_tax"] is not None or goals["geomean_indirection"] is not None:
        log(f"paging tax (ours / SDPA on contiguous K/V - 1), geometric mean: "
            f"{fmt(goals['geomean_tax'])} over {goals['tax_cases']} cases (goal "
            f"{goals['tax_goal']:.0%}: {tick.get(goals['tax_goal_met'])}); "
            f"the scatter's part (ours / ours on the identity table - 1): "
            f"{fmt(goals['geomean_indirection'])} over {goals['indirection_cases']}; the rest "
            f"(identity table / SDPA - 1): {fmt(goals['geomean_rest'])}")
        log("FlashInfer time / ours by GQA group: " + ", ".join(
            f"{g}: {x:.3f}" for g, x in goals["flashinfer_over_pagedkv_by_group"].items()))
    sweep = paging_tax(rows, "tax_sweep.")
    if sweep:
        log(f"\nlength sweep ({len(sweep)} points): " + "; ".join(
            f"{k[3]}/{k[4]} L{k[2]}: tax {fmt(c['tax'])}, scatter {fmt(c['indirection'])}"
            for k, c in sweep.items()))
        res["tax_sweep"] = [dict(zip(("dtype", "batch", "seq_len", "q_heads", "kv_heads"), k),
                                 **c) for k, c in sweep.items()]
    return res


def free_memory(peers):
    backend.xp.get_default_memory_pool().free_all_blocks()
    if "torch" in peers:
        peers["torch"].cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=str(ROOT / "bench" / "decode_shapes.json"))
    ap.add_argument("--json", help="write the rows (and the run's description) here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--only", type=int, nargs="*", help="indices of shapes to run")
    ap.add_argument("--dtypes", nargs="*")
    ap.add_argument("--staircase", action="store_true", help="also time chapter 9's steps")
    ap.add_argument("--no-peers", action="store_true", help="time our kernels only")
    ap.add_argument("--no-flashinfer", action="store_true", help="peers without FlashInfer")
    ap.add_argument("--no-tax-sweep", action="store_true",
                    help="skip the paging tax against sequence length (tax_sweep of shapes)")
    args = ap.parse_args(argv)
    if not backend.on_gpu:
        print(f"no usable GPU ({backend.reason}): nothing to time")
        return 0
    log = lambda s: print(s, flush=True)
    spec = json.loads(pathlib.Path(args.shapes).read_text())
    dtypes = args.dtypes or spec["dtype"]
    peers, notes = ({}, {"peers": "not run (--no-peers)"}) if args.no_peers else load_peers()
    if args.no_flashinfer and peers.pop("flashinfer", None) is not None:
        notes["flashinfer"] = "not run (--no-flashinfer)"
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                command="python -m pagedkv.bench.kernels " + " ".join(argv or sys.argv[1:]),
                **backend.describe(), nvrtc_target=nvrtc_target(), peers=notes,
                python=sys.version.split()[0], rated_tbps=RATED_TBPS)
    log(json.dumps(meta))
    t0 = time.time()
    if "flashinfer" in peers:
        meta.update(prebuild_flashinfer(peers["torch"], [d for d in dtypes if d != "float32"],
                                        spec["head_dim"], peers["flashinfer"]))
        meta["flashinfer_build_s"] = round(time.time() - t0, 1)
        log(f"FlashInfer {meta['flashinfer_version']}: " + (
            f"modules ready after {meta['flashinfer_build_s']} s "
            f"({meta['flashinfer_prebuild']})" if meta["flashinfer_prebuilt"] else
            f"not prebuilt, {meta['flashinfer_prebuild']}; its modules compile at first use"))
    bw, ms = copy_bandwidth()
    rbw, rms = read_bandwidth()
    meta.update(copy_bandwidth_tbps=round(bw / 1e12, 4), read_bandwidth_tbps=round(rbw / 1e12, 4))
    log(f"device-to-device copy of 2 GiB: {ms * 1e3:.0f} us = {bw / 1e12:.3f} TB/s (read + "
        f"written); reading 2 GiB: {rms * 1e3:.0f} us = {rbw / 1e12:.3f} TB/s")
    rows = []

    def save():
        if args.json:   # after every shape, so a run cut short still leaves its rows
            pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))

    shapes = [s for i, s in enumerate(spec["shapes"]) if args.only is None or i in args.only]
    for dtype in dtypes:
        for shape in shapes:
            try:
                bench_decode(shape, dtype, spec, peers, args, rows, log)
            except AssertionError as exc:
                log(f"  FAILED CHECK {dtype} {shape}: {exc}")
                meta.setdefault("failed_checks", []).append(f"{dtype} {shape}: {exc}")
            free_memory(peers)
            save()
    for part, fn in [("tax sweep", lambda: "tax_sweep" in spec and not args.no_tax_sweep
                      and bench_tax_sweep(spec["tax_sweep"], spec, peers, args, rows, log)),
                     ("staircase", lambda: args.staircase and bench_staircase(
            spec["staircase_shapes"], spec, rows, log, max(3, args.reps // 3))),
                     ("cache ops", lambda: bench_cache_ops(rows, log, bw))]:
        try:
            fn()
        except AssertionError as exc:
            log(f"  FAILED CHECK {part}: {exc}")
            meta.setdefault("failed_checks", []).append(f"{part}: {exc}")
        save()
    meta["seconds"] = round(time.time() - t0, 1)
    meta.update(summary(rows, log))
    save()
    return 1 if meta.get("failed_checks") else 0


if __name__ == "__main__":
    sys.exit(main())
