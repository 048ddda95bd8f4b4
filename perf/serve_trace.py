"""Where the GPU's time goes in a serving run, kernel class by kernel class, each beside its floor.

    PAGEDKV_GGUF=/path/SmolLM2.gguf python perf/serve_trace.py --json OUT.json [--kv-dtype int8]
    python perf/serve_trace.py --dry          # no GPU: the classes on a synthetic kernel list

``python -m pagedkv.bench.serve``'s run (nano-vllm's workload by default; the same workload
flags) served once under ``torch.profiler`` (CUDA activities: CUPTI records every kernel of
the process, CuPy's and those replayed from CUDA graphs included). Each kernel's device time is
summed by name (``key_averages``), and each name put in a class:

* ``decode attention`` (``paged_decode``, ``paged_decode_tc``, ``merge_splits``): floor, the
  K/V its decodes read (``bench.serve.decode_kv_tokens`` times the cache's bytes a token) at
  the copy bandwidth measured in the same process;
* ``prefill attention`` (``paged_prefill``): floor, its FLOP (q.k and p.v over each prompt
  token's past) at the matrix-multiply rate measured there;
* ``GEMM`` (cuBLAS's and CUTLASS's kernels, ``gemv_t``, ``norm_gemv_t``, ``norm_gemv_rope``):
  floor, the larger of the weights read once a step at the bandwidth and the layers' FLOP
  (prompt and output tokens) at the rate;
* ``norm, RoPE, K/V write`` (``rms_norm``, ``rope_write_kv``, ``silu_mul``, ``embed``,
  ``write_kv``): floor, the K/V written (every token once) at the bandwidth;
* ``sampling`` (``argmax_rows``, the sampler's kernels): floor, the logits read once a row;
* ``copies`` (memcpy, memset, ``copy_blocks``) and ``other`` (CuPy's elementwise kernels):
  no floor.

Writes the classes (kernels, calls, device seconds, floor seconds and their ratio), the 15
longest kernels, the run's own numbers and its floor (``bench.serve.run_floor``), with the
command, date and card. With ``--dry`` the classes are made from a short synthetic list of
kernel names (marked ``"synthetic": true``): a test of the code, not a result.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: (class, pattern) in order: the first that matches a kernel's name wins.
CLASSES = [
    ("decode attention", r"paged_decode|merge_splits"),
    ("prefill attention", r"paged_prefill"),
    ("GEMM", r"gemm|gemv|cutlass|xmma|nvjet|cublas|Kernel2|sm\d+_"),
    ("norm, RoPE, K/V write", r"rms_norm|rope_write_kv|silu_mul|embed|write_kv"),
    ("sampling", r"argmax|sampl|topk|top_k|softmax|gumbel"),
    ("copies", r"[Mm]emcpy|[Mm]emset|copy_blocks|swap"),
]


def classify(name: str) -> str:
    for cls, pattern in CLASSES:
        if re.search(pattern, name):
            return cls
    return "other"


def class_floors(requests, config, *, kv_bytes_per_token: int, weight_bytes: int,
                 steps: int, bytes_per_s: float, flop_per_s: float) -> dict:
    """Each class's floor in seconds (None: no floor), for ``requests`` served in ``steps``
    steps by a model of ``config``."""
    from pagedkv.bench.serve import decode_kv_tokens
    c = config
    prompt = sum(len(p) for _, p, _ in requests)
    output = sum(o for *_, o in requests)
    layer_weights = c.layers * (c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
                                + 3 * c.hidden * c.ffn)
    attention = 4 * c.layers * c.heads * c.head_dim * sum(
        len(p) * (len(p) + 1) / 2 for _, p, _ in requests)
    gemm_flop = 2.0 * layer_weights * (prompt + output) + 2.0 * c.vocab_size * c.hidden * (
        output + len(requests))
    return {
        "decode attention": decode_kv_tokens(requests) * kv_bytes_per_token / bytes_per_s,
        "prefill attention": attention / flop_per_s,
        "GEMM": max(steps * weight_bytes / bytes_per_s, gemm_flop / flop_per_s),
        "norm, RoPE, K/V write": (prompt + output) * kv_bytes_per_token / bytes_per_s,
        "sampling": (output + len(requests)) * c.vocab_size * 4 / bytes_per_s,
        "copies": None, "other": None}


def summarize(kernels, floors: dict) -> dict:
    """``kernels``: (name, calls, device seconds); the classes' sums beside ``floors``."""
    out = {cls: {"kernels": 0, "calls": 0, "device_s": 0.0} for cls, _ in CLASSES}
    out["other"] = {"kernels": 0, "calls": 0, "device_s": 0.0}
    for name, calls, seconds in kernels:
        row = out[classify(name)]
        row["kernels"] += 1
        row["calls"] += int(calls)
        row["device_s"] += float(seconds)
    for cls, row in out.items():
        f = floors.get(cls)
        row["floor_s"] = f
        row["over_floor"] = row["device_s"] / f if f else None
    return out


def profiled_kernels(prof) -> list:
    """(name, calls, device seconds) of every device event ``prof`` recorded."""
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = getattr(e, "self_cuda_time_total", 0.0)
        kind = str(getattr(e, "device_type", ""))
        if us and "CUDA" in kind.upper():
            rows.append((e.key, int(e.count), us * 1e-6))
    return rows


def run(args) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from pagedkv import backend
    from pagedkv.bench import serve
    from pagedkv.model.blas import single_thread_blas
    requests, n, lo, hi = serve.workload(args)
    single_thread_blas()
    path, model, dtype = serve._load(args)
    torch.zeros(1, device="cuda")                   # CUDA initialised for the profiler
    opts = serve.options(token_budget=args.token_budget, max_seqs=args.max_seqs,
                         kv_dtype=args.kv_dtype)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        p = serve.serve_pagedkv(model, requests, opts)
        backend.synchronize()
        torch.cuda.synchronize()
    kernels = profiled_kernels(prof)
    copy, rate = serve.copy_bandwidth(), serve.matmul_rate()
    floors = class_floors(requests, model.config, kv_bytes_per_token=p["kv_bytes_per_token"],
                          weight_bytes=p["weight_bytes"], steps=p["steps"],
                          bytes_per_s=copy["bytes_per_s"], flop_per_s=rate["flop_per_s"])
    p.pop("stamps"), p.pop("due")
    return {"command": "python perf/serve_trace.py " + " ".join(args.argv),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": backend.describe(), "torch": torch.__version__, "dtype": dtype,
            "workload": {"requests": n, "lengths": [lo, hi], "seed": args.seed},
            "note": "the run under the profiler: its wall time is longer than without",
            "classes": summarize(kernels, floors), "copy": copy, "matmul": rate,
            "longest": sorted(([k, c, s] for k, c, s in kernels), key=lambda r: -r[2])[:15],
            "run": p, "floor": serve.run_floor(requests, p, model.config, copy, rate)}


def dry() -> dict:
    """The classes of a synthetic kernel list (no GPU, no torch): a test of the code."""
    from pagedkv.bench import serve
    from pagedkv.model.gguf import LlamaConfig
    c = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3,
                    head_dim=64, ffn=1536, context=8192)
    reqs = serve.make_requests(4, 8, 16)
    kernels = [("paged_decode<1, 64, 3, 16, 4, 2, 2, 2>", 120, 0.010),
               ("merge_splits<1>", 40, 0.001), ("paged_prefill<1, 64, 3, 16, 4, 1, 64, 2>",
                                                 30, 0.004),
               ("sm90_xmma_gemm_f16f16_f16f32", 400, 0.050), ("gemv_t<1, 1, 4, 2>", 200, 0.02),
               ("norm_gemv_rope_t<1, 2>", 60, 0.003), ("rope_write_kv<1>", 60, 0.002),
               ("rms_norm<1>", 120, 0.001), ("argmax_rows", 20, 0.001),
               ("Memcpy HtoD (Pageable -> Device)", 20, 0.0005), ("cupy_copy__float16", 5, 1e-4)]
    floors = class_floors(reqs, c, kv_bytes_per_token=23040, weight_bytes=269_000_000,
                          steps=20, bytes_per_s=3.0e12, flop_per_s=6.5e14)
    return {"synthetic": True, "classes": summarize(kernels, floors)}


def main(argv=None) -> int:
    from pagedkv.bench import serve
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    serve.workload_arguments(p)
    p.add_argument("--token-budget", type=int, default=2048)
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto")
    p.add_argument("--gguf", metavar="PATH")
    p.add_argument("--dry", action="store_true", help="no GPU: synthetic kernels")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.argv = argv
    args.kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    r = dry() if args.dry else run(args)
    for cls, row in r["classes"].items():
        f = row["floor_s"]
        print(f"{cls:24} {row['kernels']:4} kernels {row['calls']:8} calls "
              f"{row['device_s']:9.4f} s" + (f", floor {f:.4f} s ({row['over_floor']:.1f} x)"
                                             if f else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
