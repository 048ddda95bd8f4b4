"""The prefill kernel on a GPU in one go: its tests, a memory check, then timings beside the old
way (the decode kernel, one row per new token) and torch SDPA (and FlashInfer, if asked).

    python perf/prefill_check.py --json OUT.json     # everything, about 3-4 minutes on an H200
    python perf/prefill_check.py --resources         # registers / spills per variant (nvcc)
    python perf/prefill_check.py --quick --json OUT.json

Sections, each in its own try/except so that one failure still leaves the others' results:

* ``env``: the GPU, CuPy, torch, FlashInfer;
* ``resources``: registers, spill bytes and shared memory of every variant timed, as the loaded
  kernels report them (``--resources``: every instance through ``nvcc -Xptxas -v`` instead);
* ``tests``: ``pytest tests/test_prefill_attention.py`` (the GPU tests run there);
* ``sanitizer``: compute-sanitizer memcheck and racecheck over a few of those tests;
* ``timing``: for SmolLM2-135M's attention (9 query heads, 3 kv heads, d 64, fp16) and a
  Llama-8B-like one (32 / 8, d 128, bf16), block size 16, chunks of 512, 2,048 and 8,192 new
  tokens at batch 1 and 8 (no prefix), and a 512-token chunk after 7,680 cached tokens:
  ``prefill`` (ours, default launch), ``prefill[WxMxKxS]`` (other launch shapes), ``old``
  (``paged_decode_attention`` with a row per new token and length position + 1, 256 rows a
  launch as ``FastRunner.prefill`` does it), ``old_1launch`` (all rows in one launch), ``sdpa``
  (``scaled_dot_product_attention(is_causal=True)`` on contiguous K/V, torch's choice, then
  each backend forced), and with ``--flashinfer`` FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` on the same cache memory (its JIT build at first use
  may take minutes). Outputs are compared with ours on 4,096 sampled rows before timing.

Times: CUDA events, medians over many repetitions, no graphs (``pagedkv.bench.kernels.time_fn``).
FLOPs: 4 x new tokens x average keys per new token x query heads x head_dim, the causal half
counted (a new token at position p sees p + 1 keys). The JSON is rewritten after every section.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RESULTS: dict = {"sections": {}}
T0 = time.time()
DEADLINE = [230.0]     # seconds for the whole script (--deadline)


def cap(seconds, reserve):
    """``seconds``, or less if ``reserve`` seconds must stay for the later sections."""
    left = DEADLINE[0] - (time.time() - T0) - reserve
    return max(10, min(seconds, int(left)))
MODELS = {  # name: (q_heads, kv_heads, head_dim, dtype)
    "smollm2": (9, 3, 64, "float16"),
    "llama8b": (32, 8, 128, "bfloat16"),
}
BLOCK_SIZE = 16
CHUNKS = [(512, 1, 0), (2048, 1, 0), (8192, 1, 0), (512, 8, 0), (2048, 8, 0), (8192, 8, 0),
          (512, 1, 7680), (512, 8, 7680)]          # (new tokens, batch, cached before them)
QUICK_CHUNKS = [(512, 1, 0), (2048, 8, 0), (512, 1, 7680)]
OLD_ROWS_PER_LAUNCH = 256                          # FastRunner's default max_batch


def log(*a):
    print(*a, flush=True)


def save(path):
    if path:
        pathlib.Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))


def section(name, path):
    """Run a section: its result (or error) goes into RESULTS and the JSON."""
    def wrap(fn):
        def run(*a, **kw):
            t = time.time()
            log(f"\n=== {name}")
            try:
                res = fn(*a, **kw)
                RESULTS["sections"][name] = {"ok": True, "s": round(time.time() - t, 1),
                                             "result": res}
            except Exception as exc:
                traceback.print_exc()
                RESULTS["sections"][name] = {"ok": False, "s": round(time.time() - t, 1),
                                             "error": f"{type(exc).__name__}: {exc}"[:2000]}
                res = None
            save(path)
            return res
        return run
    return wrap


# --------------------------------------------------------------------------- env

def env():
    from pagedkv import backend
    from pagedkv.kernels._common import nvrtc_target
    info = dict(backend.describe(), python=platform.python_version(), nvrtc=nvrtc_target())
    try:
        info["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,"
             "temperature.gpu,power.draw", "--format=csv,noheader"], capture_output=True,
            text=True, timeout=20).stdout.strip()
    except Exception as exc:
        info["nvidia_smi"] = repr(exc)
    for mod in ("torch", "flashinfer", "ml_dtypes"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as exc:
            info[mod] = f"not importable: {type(exc).__name__}"
    for k, v in info.items():
        log(f"{k}: {v}")
    if not backend.on_gpu:
        raise RuntimeError(f"no usable GPU: {backend.reason}")
    return info


# --------------------------------------------------------------------------- resources

def configs_for(head_dim):
    from compile_check import PREFILL_SWEEP
    from pagedkv.kernels.prefill import prefill_config
    return [prefill_config(head_dim)] + PREFILL_SWEEP[head_dim]


def loaded_resources():
    """What the loaded (NVRTC-compiled) kernels report, for every variant the timing uses."""
    from pagedkv.kernels.prefill import _plan
    rows = []
    for model, (qh, kvh, d, dtype) in MODELS.items():
        for cfg in configs_for(d):
            p = _plan(qh, (1, 2, BLOCK_SIZE, kvh, d), dtype, cfg)
            rows.append(dict(model=model, config=cfg, kernel=p.kernel, registers=p.registers,
                             spill_bytes=p.spill_bytes, smem_bytes=p.smem_bytes,
                             rows_per_cta=p.rows_per_cta))
            log(f"{model:8s} {str(cfg):16s} regs {p.registers:4d}  local {p.spill_bytes:4d} B  "
                f"smem {p.smem_bytes:6d} B  rows/CTA {p.rows_per_cta}")
    return rows


def nvcc_resources(quick=False):
    """Every prefill instance through nvcc -Xptxas -v (sm_90): registers and spills."""
    import compile_check as cc
    if shutil.which("nvcc") is None:
        raise RuntimeError("nvcc is not on PATH")
    names = cc.prefill_instances(quick)
    rc, text = cc.compile_one("paged_prefill.cu", names)
    rows = cc.report(text)
    if rc:
        log(text[-4000:])
    for name, regs, spill, smem in rows:
        args = re.findall(r"Li(\d+)E", name)           # _Z13paged_prefillILi1ELi64E... -> 1, 64
        name = f"paged_prefill<{', '.join(args)}>" if "paged_prefill" in name else name
        log(f"{name:44s} regs {regs:4d}  spill st/ld {spill[0]}/{spill[1]} B")
    spilled = [r for r in rows if r[2] != (0, 0)]
    log(f"{len(rows)} instances, rc={rc}, registers {min(r[1] for r in rows)}-"
        f"{max(r[1] for r in rows)}, {len(spilled)} with spills")
    return dict(rc=rc, instances=[dict(name=r[0], registers=r[1], spill=r[2]) for r in rows])


# --------------------------------------------------------------------------- tests

def pytest_args(extra):
    return [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
            str(ROOT / "tests/test_prefill_attention.py")] + extra


def run(cmd, timeout, env_extra=None):
    t = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=env)
        out, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
            else (exc.stdout or "")
        out, rc = out + f"\n[timed out after {timeout} s]", "timeout"
    tail = "\n".join(out.strip().splitlines()[-25:])
    log(tail)
    return dict(cmd=" ".join(cmd[2:]), rc=rc, s=round(time.time() - t, 1), tail=tail)


def tests(quick):
    extra = []
    try:
        import xdist  # noqa: F401
        extra = ["-n", "4"]
    except ImportError:
        pass
    if quick:
        extra += ["-k", "not gpu_prefill_matches or float16-64-3-16"]
    return run(pytest_args(extra + ["--durations=5"]), timeout=cap(150, 150))


def sanitizer():
    san = shutil.which("compute-sanitizer") or next(
        (str(p) for p in sorted(pathlib.Path("/usr/local").glob("cuda*/bin/compute-sanitizer"))),
        None)
    if san is None:
        raise RuntimeError("compute-sanitizer not found")
    res = {}
    res["memcheck"] = run([san, "--tool", "memcheck", "--print-limit", "20",
                           "--error-exitcode", "9"] + pytest_args(
        ["-x", "-k", "gpu_launch_shapes or gpu_length_one and not bfloat16 or checks_hold"]),
        cap(60, 130))
    res["racecheck"] = run([san, "--tool", "racecheck", "--racecheck-report", "all",
                            "--print-limit", "20", "--error-exitcode", "9"] + pytest_args(
        ["-x", "-k", "gpu_launch_shapes and (4x1x64x2 or 4x1x64x3 or 8x1x64x2)"]),
        cap(60, 90))
    return res


# --------------------------------------------------------------------------- timing

def make_problem(qh, kvh, d, dtype, qlen, batch, prefix, seed):
    """q [batch * qlen, qh, d], a pool holding every sequence's prefix + new tokens at
    scattered pages, tables, query_start, seq_lens (all on the GPU)."""
    from pagedkv import backend
    from pagedkv.bench.kernels import _cupy_randn
    cp = backend.xp
    rng = cp.random.default_rng(seed)
    length = prefix + qlen
    pages = -(-length // BLOCK_SIZE)
    cache = _cupy_randn((batch * pages, 2, BLOCK_SIZE, kvh, d), dtype, rng)
    perm = np.random.default_rng(seed).permutation(batch * pages).astype(np.int32)
    tables = cp.asarray(perm.reshape(batch, pages))
    q = _cupy_randn((batch * qlen, qh, d), dtype, rng)
    qs = cp.asarray(np.arange(batch + 1, dtype=np.int32) * qlen)
    lens = cp.full(batch, length, np.int32)
    return q, cache, tables, qs, lens


def flops(qh, d, qlen, batch, prefix):
    return 4 * batch * qlen * (prefix + (qlen + 1) / 2) * qh * d


SAMPLE = [None]     # the rows compared between implementations (set per shape)


def host_f64(a):
    """Float64 host copy of the sampled rows of an output [tokens, heads, d] (a full copy of
    the largest outputs would take seconds)."""
    from pagedkv.bench.kernels import host_float
    return host_float(a[SAMPLE[0]] if SAMPLE[0] is not None else a)


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def time_one(shape_key, model, qlen, batch, prefix, args, rows):
    from pagedkv import backend
    from pagedkv.bench.kernels import time_fn
    from pagedkv.kernels import paged_decode_attention, paged_prefill_attention, prefill_plan
    cp = backend.xp
    qh, kvh, d, dtype = MODELS[model]
    fl = flops(qh, d, qlen, batch, prefix)
    q, cache, tables, qs, lens = make_problem(qh, kvh, d, dtype, qlen, batch, prefix,
                                              seed=qlen * 31 + batch * 7 + prefix + d)
    reps = args.reps
    line = [f"{model:8s} new {qlen:5d} x {batch} after {prefix:4d}:"]
    n_rows = batch * qlen                     # compare at most 4,096 rows, spread evenly
    SAMPLE[0] = cp.asarray(np.unique(np.linspace(0, n_rows - 1, min(n_rows, 4096)).astype(
        np.int64)))

    def row(impl, ms, **kw):
        r = dict(shape=shape_key, model=model, new_tokens=qlen, batch=batch, prefix=prefix,
                 impl=impl, us=round(ms * 1e3, 2), tflops=round(fl / (ms * 1e-3) / 1e12, 1),
                 **kw)
        rows.append(r)
        return r

    out = cp.empty_like(q)
    paged_prefill_attention(q, cache, tables, qs, lens, out=out)
    ours = host_f64(out)
    ms, _ = time_fn(lambda: paged_prefill_attention(q, cache, tables, qs, lens, out=out),
                    reps=reps)
    plan = prefill_plan(q, cache, tables, qs, lens)
    row("prefill", ms, config=list(map(int, plan.kernel.split("<")[1][:-1].split(",")[4:])),
        registers=plan.registers)
    line.append(f"ours {ms * 1e3:8.1f} us {fl / ms / 1e9:6.1f} TF")
    best = ms
    for cfg in (configs_for(d)[1:] if not args.no_sweep else []):
        try:
            o2 = cp.empty_like(q)
            paged_prefill_attention(q, cache, tables, qs, lens, out=o2, config=cfg)
            err = rel(host_f64(o2), ours)
            ms2, _ = time_fn(lambda: paged_prefill_attention(q, cache, tables, qs, lens,
                                                             out=o2, config=cfg), reps=reps)
            row(f"prefill[{'x'.join(map(str, cfg))}]", ms2, err_vs_default=err)
            best = min(best, ms2)
            del o2
        except Exception as exc:
            rows.append(dict(shape=shape_key, impl=f"prefill[{'x'.join(map(str, cfg))}]",
                             error=f"{type(exc).__name__}: {exc}"[:300]))
    line.append(f"best shape {best * 1e3:8.1f} us")

    # the old way: every new token a decode row with length position + 1
    if not args.no_old:
        try:
            seq = cp.repeat(cp.arange(batch, dtype=cp.int32), qlen)
            pos = (cp.tile(cp.arange(qlen, dtype=cp.int32), batch) + prefix).astype(cp.int32)
            rtables, rlens = cp.ascontiguousarray(tables[seq]), pos + 1
            n = batch * qlen
            step = OLD_ROWS_PER_LAUNCH
            ob = cp.empty_like(q)
            cuts = [(q[a:a + step], rtables[a:a + step], rlens[a:a + step], ob[a:a + step])
                    for a in range(0, n, step)]

            def old():
                for qq, tt, ll, oo in cuts:
                    paged_decode_attention(qq, cache, tt, ll, out=oo)
            old()
            err = rel(host_f64(ob), ours)
            ms_old, _ = time_fn(old, reps=max(3, reps // 3))
            row("old", ms_old, err_vs_prefill=err, launches=len(cuts))
            line.append(f"old {ms_old * 1e3:9.1f} us (x{ms_old / ms:5.1f})")
            ms1, _ = time_fn(lambda: paged_decode_attention(q, cache, rtables, rlens, out=ob),
                             reps=max(3, reps // 3))
            row("old_1launch", ms1)
            del rtables, cuts, ob
        except Exception as exc:
            rows.append(dict(shape=shape_key, impl="old", error=f"{type(exc).__name__}: {exc}"))
            log("old way failed:", exc)

    # torch SDPA on contiguous K/V (only where the chunk is the whole sequence)
    if not args.no_torch and prefix == 0:
        try:
            import torch
            from pagedkv.bench.kernel_peers import to_torch
            from torch.nn.attention import SDPBackend, sdpa_kernel
            sdpa = torch.nn.functional.scaled_dot_product_attention
            tq = to_torch(q, dtype).view(batch, qlen, qh, d).transpose(1, 2).contiguous()
            tc_, tt = to_torch(cache, dtype), torch.from_dlpack(tables).long()
            kc = tc_[tt, 0].reshape(batch, -1, kvh, d)[:, :qlen].transpose(1, 2).contiguous()
            vc = tc_[tt, 1].reshape(batch, -1, kvh, d)[:, :qlen].transpose(1, 2).contiguous()
            kw = {"is_causal": True, "enable_gqa": qh != kvh}
            so = sdpa(tq, kc, vc, **kw)
            idx = torch.from_dlpack(SAMPLE[0])
            err = rel(so.transpose(1, 2).reshape(batch * qlen, qh, d)[idx].double().cpu()
                      .numpy(), ours)
            ms_s, _ = time_fn(lambda: sdpa(tq, kc, vc, **kw), "torch", reps=reps)
            row("sdpa", ms_s, err_vs_prefill=err)
            line.append(f"sdpa {ms_s * 1e3:8.1f} us (ours/sdpa {ms / ms_s:4.2f})")
            for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
                try:
                    be = getattr(SDPBackend, name)
                    with sdpa_kernel(be):
                        sdpa(tq, kc, vc, **kw)
                        ms_b, _ = time_fn(lambda: sdpa(tq, kc, vc, **kw), "torch", reps=reps)
                    row(f"sdpa.{name.lower()}", ms_b)
                except Exception as exc:
                    rows.append(dict(shape=shape_key, impl=f"sdpa.{name.lower()}",
                                     error=f"{type(exc).__name__}: {exc}"[:300]))
            del tq, kc, vc, so
        except Exception as exc:
            rows.append(dict(shape=shape_key, impl="sdpa", error=f"{type(exc).__name__}: {exc}"))
            log("sdpa failed:", exc)

    # FlashInfer's paged prefill on the very same cache memory
    if args.flashinfer:
        try:
            import flashinfer
            import torch
            from pagedkv.bench.kernel_peers import to_torch
            tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
            pages = tables.shape[1]
            qo = torch.from_dlpack(qs)
            kv_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda") * pages
            indices = torch.from_dlpack(tables).reshape(-1).to(torch.int32).contiguous()
            last = torch.full((batch,), (prefix + qlen - 1) % BLOCK_SIZE + 1,
                              dtype=torch.int32, device="cuda")
            ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(qo, kv_indptr, indices, last, qh, kvh, d, BLOCK_SIZE, causal=True,
                   q_data_type=tdt, kv_data_type=tdt)
            fq, fc = to_torch(q, dtype), to_torch(cache, dtype)
            fo = torch.empty_like(fq)
            w.run(fq, fc, out=fo)
            err = rel(fo[torch.from_dlpack(SAMPLE[0])].double().cpu().numpy(), ours)
            ms_f, _ = time_fn(lambda: w.run(fq, fc, out=fo), "torch", reps=reps)
            row("flashinfer", ms_f, err_vs_prefill=err,
                backend=getattr(w, "_backend", getattr(w, "resolved_backend", None)))
            line.append(f"FI {ms_f * 1e3:8.1f} us (FI/ours {ms_f / ms:4.2f})")
            del w, ws, fo
        except ImportError as exc:
            rows.append(dict(shape=shape_key, impl="flashinfer", error=f"not importable: {exc}"))
        except Exception as exc:
            rows.append(dict(shape=shape_key, impl="flashinfer",
                             error=f"{type(exc).__name__}: {exc}"[:300]))
            log("flashinfer failed:", exc)
    log("  ".join(line))
    del q, cache, tables, qs, lens, out
    cp.get_default_memory_pool().free_all_blocks()


def timing(args):
    rows = RESULTS.setdefault("timing_rows", [])
    chunks = QUICK_CHUNKS if args.quick else CHUNKS
    t_end = time.time() + min(args.timing_budget, DEADLINE[0] - (time.time() - T0) - 5)
    for qlen, batch, prefix in chunks:         # both models per chunk: a cut budget cuts both
        for model in MODELS:
            if time.time() > t_end:
                log(f"timing budget spent: skipping {model} {qlen}x{batch}+{prefix}")
                rows.append(dict(shape=f"{model}/{qlen}x{batch}+{prefix}", skipped="budget"))
                continue
            key = f"{model}/{qlen}x{batch}+{prefix}"
            try:
                time_one(key, model, qlen, batch, prefix, args, rows)
            except Exception as exc:
                traceback.print_exc()
                rows.append(dict(shape=key, error=f"{type(exc).__name__}: {exc}"[:500]))
            save(args.json)
    return f"{len(rows)} rows"


def table():
    """The compact summary: one line per shape."""
    rows = RESULTS.get("timing_rows", [])
    by = {}
    for r in rows:
        if "us" in r:
            by.setdefault(r["shape"], {})[r["impl"]] = r
    log("\n=== summary (µs; TF = TFLOP/s, causal FLOPs)")
    head = (f"{'shape':28s} {'ours':>9s} {'TF':>5s} {'best shape':>18s} {'old':>10s} "
            f"{'gain':>6s} {'sdpa':>9s} {'TF':>5s} {'ours/sdpa':>9s} {'FI':>9s} {'FI/ours':>7s}")
    log(head)
    for shape, d in by.items():
        o = d.get("prefill")
        if o is None:
            continue
        sweep = [r for k, r in d.items() if k.startswith("prefill[")]
        b = min(sweep + [o], key=lambda r: r["us"])
        old, s, f = d.get("old"), d.get("sdpa"), d.get("flashinfer")
        sd = [r for k, r in d.items() if k.startswith("sdpa")]
        sbest = min(sd, key=lambda r: r["us"]) if sd else None
        log(f"{shape:28s} {o['us']:9.1f} {o['tflops']:5.0f} "
            f"{b['us']:7.1f} {b['impl'][7:] or '=':>10s} "
            f"{old['us'] if old else float('nan'):10.1f} "
            f"{old['us'] / o['us'] if old else float('nan'):5.1f}x "
            f"{sbest['us'] if sbest else float('nan'):9.1f} "
            f"{sbest['tflops'] if sbest else float('nan'):5.0f} "
            f"{o['us'] / sbest['us'] if sbest else float('nan'):9.2f} "
            f"{f['us'] if f else float('nan'):9.1f} "
            f"{f['us'] / o['us'] if f else float('nan'):7.2f}")
    if any(r.get("error") for r in rows):
        log("errors:")
        for r in rows:
            if r.get("error"):
                log(f"  {r.get('shape')} {r.get('impl', '')}: {r['error'][:200]}")
    log("sections: " + ", ".join(f"{k} {'ok' if v['ok'] else 'FAILED'} ({v['s']} s)"
                                 for k, v in RESULTS["sections"].items()))
    for k in ("tests", "sanitizer"):
        v = RESULTS["sections"].get(k)
        if v and v["ok"]:
            res = v["result"]
            parts = res.values() if k == "sanitizer" else [res]
            for p in parts:
                log(f"  {p['cmd'][:70]}: rc {p['rc']}, {p['tail'].splitlines()[-1][:120]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json")
    ap.add_argument("--resources", action="store_true",
                    help="only print every instance's registers and spills (nvcc) and exit")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-sanitizer", action="store_true")
    ap.add_argument("--no-sweep", action="store_true", help="time the default launch only")
    ap.add_argument("--no-old", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--flashinfer", action="store_true",
                    help="time FlashInfer's paged prefill too (its JIT build at first use "
                         "can take minutes more)")
    ap.add_argument("--timing-budget", type=float, default=110,
                    help="seconds for the timing section; shapes past it are skipped")
    ap.add_argument("--deadline", type=float, default=230,
                    help="seconds for the whole run: the sections' time limits shrink to fit")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "perf"))
    DEADLINE[0] = args.deadline
    t0 = T0
    RESULTS["argv"] = sys.argv[1:]
    RESULTS["started"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    if args.resources:
        section("resources_nvcc", args.json)(nvcc_resources)(args.quick)
        return 0 if RESULTS["sections"]["resources_nvcc"]["ok"] else 1
    if section("env", args.json)(env)() is None:
        table()
        return 1
    section("resources", args.json)(loaded_resources)()
    if not args.no_tests:
        section("tests", args.json)(tests)(args.quick)
    if not args.no_sanitizer:
        section("sanitizer", args.json)(sanitizer)()
    section("timing", args.json)(timing)(args)
    RESULTS["total_s"] = round(time.time() - t0, 1)
    save(args.json)
    table()
    log(f"total {RESULTS['total_s']} s")
    ok = all(v["ok"] for v in RESULTS["sections"].values())
    t = RESULTS["sections"].get("tests")
    return 0 if ok and (t is None or t["result"]["rc"] == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
