"""Benchmark of the KV kernels on a GPU: ``python -m pagedkv.bench.kernels [--json PATH]``.

For every shape × dtype of ``bench/decode_shapes.json`` (pages scattered at random) it times, in
one process: our ``paged_decode_attention``; FlashInfer's ``BatchDecodeWithPagedKVCacheWrapper``
on the very same cache memory (best of use_tensor_cores False/True) when FlashInfer imports;
PyTorch SDPA on the same K/V gathered contiguous when PyTorch imports; and a 2 GiB
device-to-device copy as the memory ceiling. Outputs are checked against FlashInfer and against
the float64 reference (on a few sequences) before anything is timed. Times are medians of CUDA
event timings after warm-up; bandwidth is K+V bytes read / time in decimal TB/s. It also times
``write_kv`` and ``copy_blocks`` moving ≥ 256 MB against the copy bandwidth.
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
from ..kernels import attention as attn
from ..kernels import copy_blocks, paged_decode_attention, paged_decode_attention_ref, write_kv
from ..kernels.cache_ops import _copy_blocks_launch
from ..kernels._common import BF16, fn_attr, nvrtc_target

ROOT = pathlib.Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- timing

def _events(kind):
    if kind == "torch":
        import torch
        return (lambda: torch.cuda.Event(enable_timing=True), torch.cuda.synchronize,
                lambda a, b: a.elapsed_time(b))
    cp = backend.xp
    return cp.cuda.Event, lambda: cp.cuda.Device().synchronize(), cp.cuda.get_elapsed_time


def time_fn(fn, kind="cupy", warmup=5, reps=30, target_ms=1.0):
    """Median milliseconds per call of ``fn()``, by CUDA events.

    Each of the ``reps`` measurements brackets ``inner`` back-to-back calls (enough for about
    ``target_ms``), so that the GPU time is measured rather than the Python launch gaps of a
    short kernel. Returns (median ms per call, median ms of single calls bracketed alone).
    """
    event, sync, elapsed = _events(kind)
    for _ in range(warmup):
        fn()
    sync()

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

    single = measure(1, max(5, reps // 3))
    inner = max(1, min(50, math.ceil(target_ms / max(single, 1e-3))))
    return measure(inner, reps), single


def time_cupy(fn, warmup=5, reps=30):
    return time_fn(fn, "cupy", warmup, reps)


def time_torch(fn, warmup=5, reps=30):
    return time_fn(fn, "torch", warmup, reps)


def copy_bandwidth(nbytes=2 << 30):
    """Bytes read + written per second of a device-to-device copy of ``nbytes``."""
    cp = backend.xp
    src = cp.random.randint(0, 255, nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    ms, _ = time_cupy(lambda: cp.cuda.runtime.memcpyAsync(
        dst.data.ptr, src.data.ptr, nbytes, cp.cuda.runtime.memcpyDeviceToDevice,
        cp.cuda.get_current_stream().ptr), reps=20)
    return 2 * nbytes / (ms * 1e-3), ms


# --------------------------------------------------------------------------- problem set-up

def _torch_dtype(name):
    import torch
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _cupy_randn(shape, dtype, rng):
    """Random normal data of ``dtype`` on the GPU (bf16 as CuPy's dtype or as uint16 bits)."""
    cp = backend.xp
    x = rng.standard_normal(shape, dtype=cp.float32)
    if dtype == "bfloat16":
        bits = (x.view(cp.uint32) + 0x8000) >> 16           # round to nearest (ties away)
        return bits.astype(cp.uint16)
    return x.astype(dtype)


def make_problem(batch, seq_len, q_heads, kv_heads, head_dim, block_size, dtype, seed):
    cp = backend.xp
    rng = cp.random.default_rng(seed)
    per_seq = -(-seq_len // block_size)
    num_blocks = batch * per_seq
    cache = _cupy_randn((num_blocks, 2, block_size, kv_heads, head_dim), dtype, rng)
    perm = np.random.default_rng(seed).permutation(num_blocks).astype(np.int32)
    tables = cp.asarray(perm.reshape(batch, per_seq))
    lens = cp.full((batch,), seq_len, cp.int32)
    q = _cupy_randn((batch, q_heads, head_dim), dtype, rng)
    return q, cache, tables, lens


def to_torch(a, dtype):
    import torch
    t = torch.from_dlpack(a)
    return t.view(torch.bfloat16) if dtype == "bfloat16" and t.dtype == torch.uint16 else t


def host_float(a):
    a = backend.to_numpy(a)
    return (a.view(BF16) if a.dtype == np.uint16 else a).astype(np.float64)


def rel_err(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def reference_subset(q, cache, tables, lens, rows):
    """Float64 reference for a few sequences: copy only their blocks to the host."""
    t = backend.to_numpy(tables)[rows]
    used = np.unique(t)
    remap = np.searchsorted(used, t).astype(np.int32)
    sub = backend.to_numpy(cache[backend.xp.asarray(used)])
    if sub.dtype == np.uint16:
        sub = sub.view(BF16)
    qh = backend.to_numpy(q)[rows]
    if qh.dtype == np.uint16:
        qh = qh.view(BF16)
    return paged_decode_attention_ref(qh, sub, remap, backend.to_numpy(lens)[rows])


# --------------------------------------------------------------------------- peers

def load_peers():
    peers, notes = {}, {}
    try:
        import torch
        peers["torch"] = torch
        notes["torch"] = torch.__version__
    except Exception as exc:
        notes["torch"] = f"not importable: {type(exc).__name__}: {exc}"
    if "torch" in peers:
        try:
            import flashinfer
            peers["flashinfer"] = flashinfer
            notes["flashinfer"] = getattr(flashinfer, "__version__", "?")
        except Exception as exc:
            notes["flashinfer"] = f"not importable: {type(exc).__name__}: {exc}"
    return peers, notes


class FlashInferDecode:
    """FlashInfer's paged decode over our cache memory (zero-copy through DLPack)."""

    def __init__(self, flashinfer, torch, q, cache, tables, lens, dtype, use_tensor_cores):
        batch, q_heads, d = q.shape
        _, _, bs, kv_heads, _ = cache.shape
        self.q, self.cache = to_torch(q, dtype), to_torch(cache, dtype)
        t_tables = torch.from_dlpack(tables)
        t_lens = torch.from_dlpack(lens)
        pages = (t_lens + bs - 1) // bs
        indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
        indptr[1:] = torch.cumsum(pages, 0)
        cols = torch.arange(t_tables.shape[1], device="cuda")[None, :]
        indices = t_tables[cols < pages[:, None]].to(torch.int32).contiguous()
        last = ((t_lens - 1) % bs + 1).to(torch.int32)
        self.workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        self.w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=use_tensor_cores)
        tdt = _torch_dtype(dtype)
        self.w.plan(indptr, indices, last, q_heads, kv_heads, d, bs,
                    pos_encoding_mode="NONE", q_data_type=tdt, kv_data_type=tdt)
        self.out = torch.empty_like(self.q)

    def __call__(self):
        return self.w.run(self.q, self.cache, out=self.out)


# --------------------------------------------------------------------------- the runs

#: launch configurations the --sweep option tries: (warps per CTA, tokens per tile, ring stages)
SWEEP = ((4, 4, 1, 0), (4, 4, 2, 0), (4, 2, 3, 0), (4, 2, 4, 0), (8, 2, 2, 0), (4, 1, 6, 0),
         (4, 2, 2, 2), (4, 1, 4, 2), (4, 1, 3, 2), (8, 1, 2, 2))


def bench_decode(shape, dtype, spec, peers, args, rows, log):
    cp = backend.xp
    batch, seq_len = shape["batch"], shape["seq_len"]
    q_heads, kv_heads = shape["q_heads"], shape["kv_heads"]
    d, bs = spec["head_dim"], spec["block_size"]
    item = 4 if dtype == "float32" else 2
    kv_bytes = 2 * batch * seq_len * kv_heads * d * item
    seed = zlib.crc32(repr((batch, seq_len, q_heads, kv_heads, dtype)).encode())
    q, cache, tables, lens = make_problem(batch, seq_len, q_heads, kv_heads, d, bs, dtype, seed)
    base = dict(dtype=dtype, batch=batch, seq_len=seq_len, q_heads=q_heads, kv_heads=kv_heads,
                head_dim=d, block_size=bs)

    def row(impl, ms, **extra):
        r = dict(impl=impl, **base, us=round(ms * 1e3, 2), tbps=round(kv_bytes / (ms * 1e-3) / 1e12, 4),
                 **extra)
        rows.append(r)
        return r

    # correctness first: poisoned output, reference on two sequences, FlashInfer on all
    out = cp.empty_like(q)
    out.fill(0x7FC0 if out.dtype == np.uint16 else np.nan)
    paged_decode_attention(q, cache, tables, lens, out=out)
    got = host_float(out)
    assert np.isfinite(got).all(), "our output has NaN / unwritten entries"
    pick = [0, batch - 1] if batch > 1 else [0]
    ref = reference_subset(q, cache, tables, lens, pick)
    err_ref = rel_err(got[pick], ref)
    tol = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-4}[dtype]
    assert err_ref < tol, f"error vs reference {err_ref:.2e} ≥ {tol}"

    # ours
    fn, _, _, splits, _ = _plan(q, cache, tables)
    ms, single = time_cupy(lambda: paged_decode_attention(q, cache, tables, lens, out=out),
                           reps=args.reps)
    row("pagedkv", ms, us_single_call=round(single * 1e3, 2), err_vs_ref=err_ref,
        num_splits=splits, regs=fn_attr(fn, "num_regs", -1),
        spill_bytes=fn_attr(fn, "local_size_bytes", -1))
    msg = [f"pagedkv {ms*1e3:8.1f} us (splits {splits}, err {err_ref:.1e})"]
    # the same launches without the public function's argument checks: the Python share
    ms_l, _ = time_cupy(lambda: attn._decode_cupy(q, cache, tables, lens, 1 / math.sqrt(d), out,
                                                  None, dtype), reps=args.reps)
    row("pagedkv.launch_only", ms_l)
    msg.append(f"launch only {ms_l*1e3:6.1f} us")

    if args.sweep:   # other launch configurations and split counts, same data
        best_sweep = None
        for nw, un, st, ch in SWEEP:
            for sp in (None, 1, 2, 4, 8, 16, 32):
                if attn.smem_bytes(dtype, d, nw, un, st, ch) > 48 * 1024:
                    continue
                try:
                    ms2, _ = time_cupy(lambda: attn._decode_cupy(
                        q, cache, tables, lens, 1 / math.sqrt(d), out, sp, dtype, nw, un, st, ch),
                        reps=max(10, args.reps // 3))
                except Exception as exc:
                    log(f"    sweep {nw}w x{un} {st} stages, splits {sp}: "
                        f"{type(exc).__name__}: {exc}")
                    continue
                r = row("pagedkv.sweep", ms2, nwarps=nw, unroll=un, stages=st, chunks=ch,
                        splits=sp if sp else "auto")
                if best_sweep is None or r["us"] < best_sweep["us"]:
                    best_sweep = r
        log(f"    sweep best: {best_sweep['nwarps']} warps x{best_sweep['unroll']} "
            f"{best_sweep['stages']} stages {best_sweep['chunks']} chunks, splits "
            f"{best_sweep['splits']}: {best_sweep['us']:.1f} us vs default {ms*1e3:.1f} us")

    torch = peers.get("torch")
    if "flashinfer" in peers:
        best = None
        for tc in (False, True):
            try:
                fi = FlashInferDecode(peers["flashinfer"], torch, q, cache, tables, lens, dtype, tc)
                fo = fi()
                torch.cuda.synchronize()
                err_fi = rel_err(got, fo.float().cpu().numpy().astype(np.float64))
                assert err_fi < 2 * tol, f"differs from FlashInfer ({'tc' if tc else 'cc'}) by {err_fi:.2e}"
                ms_fi, single = time_torch(fi, reps=args.reps)
                row("flashinfer.tc" if tc else "flashinfer.cuda", ms_fi, err_vs_ours=err_fi,
                    us_single_call=round(single * 1e3, 2))
                msg.append(f"fi[{'tc' if tc else 'cc'}] {ms_fi*1e3:8.1f} us (diff {err_fi:.1e})")
                if best is None or ms_fi < best:
                    best = ms_fi
                del fi
            except AssertionError:
                raise
            except Exception as exc:
                msg.append(f"fi[{tc}] failed: {type(exc).__name__}: {str(exc)[:200]}")
        if best is not None:
            row("flashinfer", best)
    if torch is not None:
        try:
            tq = to_torch(q, dtype).reshape(batch, q_heads, 1, d)
            tc_ = to_torch(cache, dtype)
            tt = torch.from_dlpack(tables).long()
            # gather each sequence's pages into contiguous [B, H, L, D] K and V (not timed)
            kc = tc_[tt, 0].reshape(batch, -1, kv_heads, d)[:, :seq_len].transpose(1, 2).contiguous()
            vc = tc_[tt, 1].reshape(batch, -1, kv_heads, d)[:, :seq_len].transpose(1, 2).contiguous()
            sdpa = torch.nn.functional.scaled_dot_product_attention
            kw = {"enable_gqa": True} if q_heads != kv_heads else {}
            so = sdpa(tq, kc, vc, **kw)
            err_sdpa = rel_err(got, so.reshape(batch, q_heads, d).float().cpu().numpy())
            ms_s, single = time_torch(lambda: sdpa(tq, kc, vc, **kw), reps=args.reps)
            row("sdpa_contiguous", ms_s, err_vs_ours=err_sdpa,
                us_single_call=round(single * 1e3, 2))
            msg.append(f"sdpa {ms_s*1e3:8.1f} us")
        except Exception as exc:
            msg.append(f"sdpa failed: {type(exc).__name__}: {str(exc)[:200]}")
    log(f"  {dtype:8s} b{batch:<4d} L{seq_len:<6d} {q_heads}/{kv_heads}: " + " | ".join(msg))


def _plan(q, cache, tables, num_splits=None):
    """The launcher's choice for this problem: (kernel, merge kernel, threads, splits, length)."""
    dt = "bfloat16" if cache.dtype == np.uint16 else str(cache.dtype)
    return attn._plan(tuple(q.shape), tuple(cache.shape), cache.itemsize, dt, tables.shape[1],
                      num_splits)


def bench_cache_ops(rows, log, copy_bw):
    cp = backend.xp
    rng = cp.random.default_rng(7)
    bs, kv_heads, d = 16, 8, 128
    # write_kv: 131072 tokens of K and V, fp16 -> 512 MiB read + 512 MiB written, random slots
    tokens, n = 131072, 8192                 # n: copy_blocks pairs, so 2n blocks are needed
    num_blocks = max(tokens // bs, 2 * n) + 64
    cache = cp.empty((num_blocks, 2, bs, kv_heads, d), cp.float16)
    k = _cupy_randn((tokens, kv_heads, d), "float16", rng)
    v = _cupy_randn((tokens, kv_heads, d), "float16", rng)
    slots = cp.asarray(np.random.default_rng(8).permutation(num_blocks * bs)[:tokens]
                       .astype(np.int32))
    write_kv(cache, k, v, slots)
    sample = np.random.default_rng(9).choice(tokens, 64, replace=False)
    s_host = backend.to_numpy(slots)[sample]
    kc = backend.to_numpy(cache[cp.asarray(s_host // bs), 0, cp.asarray(s_host % bs)])
    assert np.array_equal(kc, backend.to_numpy(k)[sample]), "write_kv wrote the wrong rows"
    ms, _ = time_cupy(lambda: write_kv(cache, k, v, slots), reps=20)
    moved = 2 * (k.nbytes + v.nbytes)
    rows.append(dict(impl="pagedkv.write_kv", dtype="float16", tokens=tokens, kv_heads=kv_heads,
                     head_dim=d, block_size=bs, us=round(ms * 1e3, 2),
                     tbps=round(moved / (ms * 1e-3) / 1e12, 4),
                     fraction_of_copy=round(moved / (ms * 1e-3) / copy_bw, 4)))
    log(f"  write_kv   {moved/1e6:7.0f} MB moved in {ms*1e3:8.1f} us = "
        f"{moved/(ms*1e-3)/1e12:.3f} TB/s = {moved/(ms*1e-3)/copy_bw:.1%} of copy")
    # copy_blocks: 8192 (src, dst) pairs of 64 KiB blocks -> 512 MiB read + 512 MiB written
    perm = np.random.default_rng(10).permutation(num_blocks).astype(np.int32)
    pairs = np.stack([perm[:n], perm[n:2 * n]], axis=1)
    copy_blocks(cache, pairs)
    for src, dst in pairs[:: n // 16]:   # compare bits: blocks never written hold any bytes
        assert bool((cache[int(src)].view(cp.uint16) == cache[int(dst)].view(cp.uint16)).all())
    dpairs = cp.asarray(pairs)
    # the launch alone: the host-side check of 8192 pairs (np.unique) would dominate the timing
    ms, _ = time_cupy(lambda: _copy_blocks_launch([cache], dpairs), reps=20)
    moved = 2 * n * (cache.nbytes // num_blocks)
    rows.append(dict(impl="pagedkv.copy_blocks", dtype="float16", pairs=n, kv_heads=kv_heads,
                     head_dim=d, block_size=bs, us=round(ms * 1e3, 2),
                     tbps=round(moved / (ms * 1e-3) / 1e12, 4),
                     fraction_of_copy=round(moved / (ms * 1e-3) / copy_bw, 4)))
    log(f"  copy_blocks{moved/1e6:7.0f} MB moved in {ms*1e3:8.1f} us = "
        f"{moved/(ms*1e-3)/1e12:.3f} TB/s = {moved/(ms*1e-3)/copy_bw:.1%} of copy")


def summary(rows, log):
    """The table, and geometric means of FlashInfer's time over ours (> 1: we are faster)."""
    keyf = lambda r: (r["dtype"], r["batch"], r["seq_len"], r["q_heads"], r["kv_heads"])
    by = {}
    for r in rows:
        if "batch" in r and r["impl"] in ("pagedkv", "flashinfer", "sdpa_contiguous"):
            by.setdefault(keyf(r), {})[r["impl"]] = r
    log("")
    log(f"{'dtype':9s}{'batch':>6s}{'seq':>7s}{'heads':>7s} | {'pagedkv us':>10s} {'TB/s':>6s} | "
        f"{'flashinf us':>11s} {'TB/s':>6s} | {'sdpa us':>9s} {'TB/s':>6s} | {'fi/ours':>7s}")
    ratios, faster = [], 0
    for k, v in by.items():
        o, f, s = v.get("pagedkv"), v.get("flashinfer"), v.get("sdpa_contiguous")
        ratio = f["us"] / o["us"] if (o and f) else None
        if ratio is not None:
            ratios.append(ratio)
            faster += ratio > 1
        fmt = lambda r: (f"{r['us']:10.1f} {r['tbps']:6.2f}" if r else f"{'-':>10s} {'-':>6s}")
        log(f"{k[0]:9s}{k[1]:6d}{k[2]:7d}{k[3]:>4d}/{k[4]:<2d} | {fmt(o)} | {fmt(f)} | {fmt(s)} | "
            + (f"{ratio:7.3f}" if ratio else "      -"))
    if ratios:
        gm = math.exp(sum(map(math.log, ratios)) / len(ratios))
        log(f"geometric mean of FlashInfer time / pagedkv time over {len(ratios)} cases: "
            f"{gm:.3f}; pagedkv faster on {faster}")
        return gm, faster
    return None, 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=str(ROOT / "bench" / "decode_shapes.json"))
    ap.add_argument("--json", help="write the rows (and the run's description) here")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--sweep", action="store_true", help="also time other launch configurations")
    ap.add_argument("--only", type=int, nargs="*", help="indices of shapes to run")
    ap.add_argument("--dtypes", nargs="*")
    args = ap.parse_args(argv)
    if not backend.on_gpu:
        print(f"no usable GPU ({backend.reason}): nothing to time")
        return 0
    log = lambda s: print(s, flush=True)
    spec = json.loads(pathlib.Path(args.shapes).read_text())
    peers, notes = load_peers()
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                **backend.describe(), nvrtc_target=nvrtc_target(), peers=notes,
                cupy_bfloat16=_has_bf16(), python=sys.version.split()[0])
    log(json.dumps(meta))
    bw, ms = copy_bandwidth()
    meta["copy_bandwidth_tbps"] = round(bw / 1e12, 4)
    log(f"device-to-device copy of 2 GiB: {ms*1e3:.0f} us = {bw/1e12:.3f} TB/s (read + written)")
    rows = []
    t0 = time.time()
    shapes = [s for i, s in enumerate(spec["shapes"]) if args.only is None or i in args.only]
    for dtype in args.dtypes or spec["dtype"]:
        for shape in shapes:
            try:
                bench_decode(shape, dtype, spec, peers, args, rows, log)
                free_memory(peers)
            except AssertionError as exc:
                log(f"  FAILED CHECK {dtype} {shape}: {exc}")
                meta.setdefault("failed_checks", []).append(f"{dtype} {shape}: {exc}")
            if args.json:  # after every shape, so a run cut short still leaves its rows
                pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}))
    try:
        bench_cache_ops(rows, log, bw)
    except AssertionError as exc:
        log(f"  FAILED CHECK cache ops: {exc}")
        meta.setdefault("failed_checks", []).append(f"cache ops: {exc}")
    meta["seconds"] = round(time.time() - t0, 1)
    gm, faster = summary(rows, log)
    meta["geomean_flashinfer_over_pagedkv"] = gm
    meta["pagedkv_faster_cases"] = faster
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 1 if meta.get("failed_checks") else 0


def free_memory(peers):
    backend.xp.get_default_memory_pool().free_all_blocks()
    if "torch" in peers:
        peers["torch"].cuda.empty_cache()


def _has_bf16():
    cp = backend.xp
    try:
        cp.asarray(np.zeros(2, BF16))
        return True
    except Exception as exc:
        return f"no ({type(exc).__name__})"


if __name__ == "__main__":
    sys.exit(main())
