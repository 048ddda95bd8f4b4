"""A decode step traced (launches, kernels, waits, GPU busy time); the fast path's gain apart.

    PAGEDKV_GGUF=/path/SmolLM2.gguf python perf/step_trace.py --json OUT.json   # a GPU
    python perf/step_trace.py --dry --json OUT.json     # no GPU: a tiny random model on NumPy

One process, SmolLM2-135M-Instruct in float16 (loaded as ``pagedkv.bench.model`` loads it),
the chat prompt of that benchmark, at batch 1 and 64 (``--batches``). Two sections:

* ``timing`` (run first, before torch is imported, as in ``pagedkv.bench.model``): whole
  engine steps of every runner (``plain``: chapter 10's forward pass; ``fast-eager``: the fast
  runner's fused kernels and static buffers launched one by one; ``fast``: the same replayed
  from a CUDA graph) on each bookkeeping (``teaching``, ``fast``), timed as the benchmark times
  them (``pagedkv.bench.model.tokens_per_second``: perf_counter around ``steps - 1`` steps,
  the device synchronised, the best of ``repeat``); and ``runner_ms``: ``runner.decode`` alone
  on one fixed batch, the device synchronised after each call (the step without the engine's
  Python: scheduling, bookkeeping, sampling, the request loop).
* ``trace``: for ``plain`` on the teaching bookkeeping and ``fast-eager`` and ``fast`` on the
  fast one, ``--steps`` engine steps under ``torch.profiler`` (CPU and CUDA activities: CUPTI
  records every kernel of the process, CuPy's included), each step inside a
  ``record_function`` range. From the exported chrome trace, per step: the kernel launches the
  host issued (runtime and driver launch calls, a graph launch counted as one; a driver call
  made inside a runtime call is that call's), the graph launches among them, the host's waits
  for the device (synchronising calls) and their time, the kernels the GPU ran and its busy
  time (the union of kernels and copies; a kernel is the step's through the correlation id
  of the call that launched it, or, if no call of the trace has that id, by its start time:
  ``gpu_unmatched`` counts those), and the step's wall time under the profiler (which
  adds a few µs to every API call: the ``timing`` section has the true step times). For one
  step of each at the first batch: a timeline (host launch calls, host waits, GPU kernels,
  µs from the step's start), kernels by name and API calls by name.

With ``--dry`` the same code runs on a tiny random model with NumPy (no graphs, no torch): the
timing section as on a GPU, and the trace section's parser on a small synthetic trace (marked
``"synthetic": true``), so that the script is tested without a GPU. Its numbers are not
results.
"""
from __future__ import annotations

import argparse
import bisect
import datetime
import gzip
import json
import os
import pathlib
import platform
import re
import statistics
import sys
import tempfile
import time
from collections import Counter

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CONFIGS = [("plain", "teaching"), ("plain", "fast"), ("fast-eager", "teaching"),
           ("fast-eager", "fast"), ("fast", "teaching"), ("fast", "fast")]
TRACED = [("plain", "teaching"), ("fast-eager", "fast"), ("fast", "fast")]
STEP_PREFIX = "step_trace:"
LAUNCH = {"cudaLaunchKernel", "cudaLaunchKernelExC", "cudaLaunchCooperativeKernel",
          "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchCooperativeKernel",
          "cudaGraphLaunch", "cuGraphLaunch"}
GRAPH_LAUNCH = {"cudaGraphLaunch", "cuGraphLaunch"}
WAIT = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
        "cuStreamSynchronize", "cuCtxSynchronize", "cuEventSynchronize", "cuMemcpyDtoH",
        "cuMemcpyHtoD", "cuMemcpy"}
HOST_CATS = {"cuda_runtime", "cuda_driver"}
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------ the trace's parser

def api_name(name: str) -> str:
    """A runtime or driver call's name without its version and stream-mode suffixes
    (``cudaLaunchKernel_v7000``, ``cuLaunchKernel_ptsz``, ``cuMemcpyDtoH_v2``)."""
    return re.sub(r"(_v\d+)?(_ptsz|_ptds)?(_v\d+)?$", "", name)


def _spans(events):
    return sorted(((e["ts"], e["ts"] + e.get("dur", 0.0)) for e in events))


def busy_us(spans) -> float:
    """The length of the union of (start, end) intervals."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def host_launches(api_events) -> list:
    """The launch calls the host issued: runtime and driver launch calls, less the driver
    calls that lie inside a runtime call on the same thread (the runtime made them)."""
    runtime: dict = {}                   # tid -> (starts, ends), sorted: they never overlap
    for e in sorted((e for e in api_events if e.get("cat") == "cuda_runtime"),
                    key=lambda e: e["ts"]):
        starts, ends = runtime.setdefault(e["tid"], ([], []))
        starts.append(e["ts"])
        ends.append(e["ts"] + e.get("dur", 0.0))
    out = []
    for e in api_events:
        if api_name(e["name"]) not in LAUNCH:
            continue
        if e.get("cat") == "cuda_driver" and e["tid"] in runtime:
            starts, ends = runtime[e["tid"]]
            i = bisect.bisect_right(starts, e["ts"]) - 1
            if i >= 0 and e["ts"] + e.get("dur", 0.0) <= ends[i]:
                continue                 # made by the runtime call around it
        out.append(e)
    return out


def parse_trace(events, timeline_step: int | None = None) -> dict:
    """Per-step counts and times from chrome-trace ``events`` (torch.profiler's export):
    each step is a ``user_annotation`` named ``STEP_PREFIX + label + ':' + index``. Returns
    ``{label: {"steps": [...], "median": {...}, "timeline": ..., ...}}``; the timeline,
    kernels by name and API calls by name are kept for step ``timeline_step`` (default: the
    middle one)."""
    events = [e for e in events if e.get("ph") == "X"]
    steps = sorted((e for e in events if e.get("cat") == "user_annotation"
                    and e["name"].startswith(STEP_PREFIX)), key=lambda e: e["ts"])
    api = sorted((e for e in events if e.get("cat") in HOST_CATS), key=lambda e: e["ts"])
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    by_corr: dict = {}
    for e in gpu:
        by_corr.setdefault(e.get("args", {}).get("correlation"), []).append(e)
    api_corrs = {e.get("args", {}).get("correlation") for e in api} - {None}
    orphans = sorted((e for e in gpu if e.get("args", {}).get("correlation") not in api_corrs),
                     key=lambda e: e["ts"])         # no API call of the trace launched them
    out: dict = {}
    for s in steps:
        label = s["name"][len(STEP_PREFIX):].rsplit(":", 1)[0]
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        calls = [e for e in api if t0 <= e["ts"] <= t1]
        launches = host_launches(calls)
        waits = [e for e in calls if api_name(e["name"]) in WAIT]
        corrs = {e.get("args", {}).get("correlation") for e in calls} - {None}
        dev = [g for c in sorted(corrs) for g in by_corr.get(c, [])]
        unmatched = [g for g in orphans if t0 <= g["ts"] <= t1]    # placed by time instead
        dev += unmatched
        kernels = [g for g in dev if g["cat"] == "kernel"]
        row = {"wall_us": s["dur"], "host_launches": len(launches),
               "graph_launches": sum(api_name(e["name"]) in GRAPH_LAUNCH for e in launches),
               "host_waits": len(waits), "host_wait_us": sum(e.get("dur", 0) for e in waits),
               "host_launch_call_us": sum(e.get("dur", 0) for e in launches),
               "gpu_kernels": len(kernels), "gpu_copies": len(dev) - len(kernels),
               "gpu_busy_us": busy_us(_spans(dev)),
               "gpu_kernel_us": sum(g.get("dur", 0) for g in kernels),
               "gpu_unmatched": len(unmatched)}
        entry = out.setdefault(label, {"steps": [], "_raw": []})
        entry["steps"].append(row)
        entry["_raw"].append((t0, launches, waits, dev, calls))
    for label, entry in out.items():
        rows, raw = entry["steps"], entry.pop("_raw")
        entry["median"] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        k = len(raw) // 2 if timeline_step is None else timeline_step
        t0, launches, waits, dev, calls = raw[k]
        rel = lambda spans: [[round(a - t0, 2), round(b - t0, 2)] for a, b in spans]  # noqa
        entry["timeline"] = {
            "step": k, "wall_us": rows[k]["wall_us"],
            "host_launch": rel(_spans(launches)), "host_wait": rel(_spans(waits)),
            "gpu_kernel": rel(_spans([g for g in dev if g["cat"] == "kernel"])),
            "gpu_copy": rel(_spans([g for g in dev if g["cat"] != "kernel"]))}
        names = Counter(_short(g["name"]) for g in dev if g["cat"] == "kernel")
        entry["kernels_by_name"] = dict(names.most_common(25))
        entry["api_calls"] = dict(Counter(api_name(e["name"]) for e in calls).most_common())
    return out


def _short(name: str, n: int = 70) -> str:
    return name if len(name) <= n else name[:n - 3] + "..."


def synthetic_trace() -> list:
    """A tiny chrome trace of two steps (for ``--dry`` and the tests): step 0 launches three
    kernels one by one (one of them by the driver inside a runtime call) and waits once;
    step 1 launches one graph of two kernels and a copy."""
    def x(cat, name, ts, dur, corr=None, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1,
                "tid": tid, "args": {} if corr is None else {"correlation": corr}}
    return [
        x("user_annotation", STEP_PREFIX + "eager:0", 0.0, 100.0),
        x("cuda_runtime", "cudaLaunchKernel", 10.0, 5.0, 1),
        x("cuda_driver", "cuLaunchKernel", 11.0, 3.0, 101),          # inside the one above
        x("cuda_driver", "cuLaunchKernel_ptsz", 20.0, 4.0, 2),       # CuPy's own
        x("cuda_runtime", "cudaLaunchKernel", 30.0, 5.0, 3),
        x("cuda_runtime", "cudaStreamSynchronize", 40.0, 30.0, 4),
        x("kernel", "rms_norm<1>", 16.0, 4.0, 1), x("kernel", "gemv", 25.0, 10.0, 2),
        x("kernel", "gemv", 36.0, 2.0, 3),
        x("user_annotation", STEP_PREFIX + "graph:0", 200.0, 50.0),
        x("cuda_runtime", "cudaGraphLaunch", 205.0, 6.0, 5),
        x("cuda_runtime", "cudaMemcpyAsync", 212.0, 2.0, 6),
        x("cuda_runtime", "cudaStreamSynchronize", 215.0, 20.0, 7),
        x("kernel", "rms_norm<1>", 212.0, 3.0, 5), x("kernel", "gemv", 215.0, 5.0, 5),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 219.0, 2.0, 6),
        x("gpu_user_annotation", STEP_PREFIX + "graph:0", 212.0, 10.0),
    ]


# ------------------------------------------------------------------ the engines

def load_model(args):
    from pagedkv.model import Llama, LlamaConfig, Tokenizer, load_gguf, random_weights
    from pagedkv.bench.model import QUESTION
    if args.dry:
        config = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2,
                             head_dim=64, ffn=128, rope_base=10000.0, context=512)
        return (Llama(config, random_weights(config, 2024), xp=np),
                [int(t) for t in np.random.default_rng(0).integers(1, 96, 37)],
                "a tiny random model (dry run)")
    from pagedkv.model.gguf import model_path
    ckpt = load_gguf(model_path(args.gguf))
    model = Llama(ckpt.config, ckpt.weights, dtype=np.float16)
    return model, Tokenizer.from_checkpoint(ckpt).chat(QUESTION), "SmolLM2-135M-Instruct"


def options(runner: str, bookkeeping: str, max_context: int) -> dict:
    opts = dict(runner=runner, bookkeeping=bookkeeping)
    if runner != "plain":
        opts["max_context"] = max_context
    return opts


def engine_steps(model, prompt, batches, steps, repeat, max_context) -> dict:
    """Whole engine steps of every (runner, bookkeeping), in ms (the benchmark's way)."""
    from pagedkv.bench.model import tokens_per_second
    out = {}
    for runner, bk in CONFIGS:
        key = f"{runner}/{bk}"
        out[key] = {}
        for b in batches:
            r = tokens_per_second(model, prompt, b, steps, repeat,
                                  **options(runner, bk, max_context))
            out[key][str(b)] = r
            log(f"  {key:>20} batch {b:>3}: {r['step_ms']:8.3f} ms a step")
    return out


def _batch_of(engine):
    """Step ``engine`` once and return the Batch its runner decoded (a row whose input token
    the device gave, from the step before, takes token 1 instead: the replays only time)."""
    seen, decode = [], engine.runner._decode_pass
    engine.runner._decode_pass = lambda batch, follow: (seen.append(batch),
                                                        decode(batch, follow))[1]
    try:
        engine.step()
    finally:
        del engine.runner._decode_pass
    batch = seen[-1]
    return batch._replace(tokens=np.where(batch.tokens < 0, 1, batch.tokens).astype(np.int32))


def runner_only(model, prompt, batches, max_context, n=20, rounds=3) -> dict:
    """``runner.decode`` alone on one fixed batch (its K/V written again at the same slots),
    the device synchronised after each call: the median of ``rounds`` means over ``n``."""
    from pagedkv import backend
    from pagedkv.bench.model import _engine
    out = {}
    for runner, bk in (("plain", "teaching"), ("fast-eager", "fast"), ("fast", "fast")):
        out[runner] = {}
        for b in batches:
            engine = _engine(model, prompt, b, 8, **options(runner, bk, max_context))
            batch = _batch_of(engine)
            for _ in range(3):
                engine.runner.decode(batch)
            times = []
            for _ in range(rounds):
                backend.synchronize()
                t = time.perf_counter()
                for _ in range(n):
                    engine.runner.decode(batch)
                    backend.synchronize()
                times.append((time.perf_counter() - t) / n * 1e3)
            out[runner][str(b)] = statistics.median(times)
            log(f"  runner {runner:>10} batch {b:>3}: {out[runner][str(b)]:8.3f} ms a decode")
    return out


def traced_events(model, prompt, b, runner, bk, steps, max_context, warm=3, raw_dir=None):
    """Chrome-trace events of ``steps`` engine steps under torch.profiler, each step in a
    ``record_function`` range named ``STEP_PREFIX + runner + ':' + index``, and the node
    count of each graph the runner captured."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function
    from pagedkv import backend
    from pagedkv.bench.model import _engine
    engine = _engine(model, prompt, b, warm + steps + 4, **options(runner, bk, max_context))
    for _ in range(warm):
        engine.step()
    backend.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()                               # the profiler's own first-step costs
        for k in range(steps):
            with record_function(f"{STEP_PREFIX}{runner}:{k}"):
                engine.step()
        backend.synchronize()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        if raw_dir:                                 # the raw trace, for a second look
            with open(path, "rb") as f, gzip.open(os.path.join(
                    raw_dir, f"trace-{runner}-b{b}.json.gz"), "wb") as g:
                g.write(f.read())
    graphs = getattr(engine.runner, "_graphs", {})
    nodes = {str(k): engine.runner.graph_nodes(k) for k in graphs}
    return events, nodes


def trace_section(model, prompt, batches, steps, max_context, raw_dir=None) -> dict:
    import torch
    torch.zeros(1, device="cuda")                   # CUDA initialised for the profiler
    out: dict = {}
    for b in batches:
        for runner, bk in TRACED:
            t = time.time()
            events, nodes = traced_events(model, prompt, b, runner, bk, steps, max_context,
                                          raw_dir=raw_dir)
            parsed = parse_trace(events)
            if runner not in parsed:
                raise RuntimeError(f"no step of {runner!r} in the trace ({len(events)} "
                                   f"events)")
            r = parsed[runner]
            r["bookkeeping"], r["graph_nodes"] = bk, nodes
            if b != batches[0]:                     # one timeline per runner is enough
                for key in ("timeline", "kernels_by_name", "api_calls"):
                    r.pop(key)
            out.setdefault(runner, {})[str(b)] = r
            m = r["median"]
            if not m["host_launches"] or not m["gpu_kernels"]:
                r["warning"] = ("no launch call or no kernel matched: read api_calls "
                                "and the raw trace before using these counts")
                log(f"  WARNING {runner} batch {b}: {r['warning']}")
            log(f"  traced {runner:>10} batch {b:>3}: {m['host_launches']:5.0f} launches "
                f"({m['graph_launches']:.0f} graph), {m['gpu_kernels']:5.0f} kernels, "
                f"{m['host_waits']:.0f} waits ({m['host_wait_us']:.0f} µs), GPU busy "
                f"{m['gpu_busy_us']:.0f} of {m['wall_us']:.0f} µs  [{time.time() - t:.1f} s]")
    return out


# ------------------------------------------------------------------ main

def machine() -> dict:
    from pagedkv import backend
    info = dict(backend.describe(), host=platform.node(), python=platform.python_version())
    for mod in ("cupy", "torch"):
        if mod in sys.modules:
            info[mod] = sys.modules[mod].__version__
    return info


def run(args) -> dict:
    from pagedkv import backend
    from pagedkv.model.blas import single_thread_blas
    single_thread_blas()
    if not args.dry and not backend.on_gpu:
        raise SystemExit(f"no usable GPU ({backend.reason}); --dry runs on NumPy")
    t0 = time.time()
    model, prompt, name = load_model(args)
    batches = args.batches or ([1, 8] if args.dry else [1, 64])
    r = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
         "command": "python perf/step_trace.py " + " ".join(args.argv), "dry": args.dry,
         "model": name, "dtype": str(model.dtype), "prompt_tokens": len(prompt),
         "max_context": args.max_context, "batches": batches}
    log(f"{name}, {model.dtype} on {backend.name}; prompt {len(prompt)} tokens")
    log("timing (no profiler, torch not imported yet):")
    r["timing"] = {"steps": args.timing_steps, "repeat": args.repeat,
                   "engine_step_ms": engine_steps(model, prompt, batches, args.timing_steps,
                                                  args.repeat, args.max_context),
                   "runner_ms": runner_only(model, prompt, batches, args.max_context)}
    save(args.json, r)
    log("trace:")
    if args.dry:
        r["trace"] = {"synthetic": True, "runs": parse_trace(synthetic_trace())}
    else:
        if args.raw_dir:
            os.makedirs(args.raw_dir, exist_ok=True)
        runs = trace_section(model, prompt, batches, args.steps, args.max_context,
                             args.raw_dir)
        r["trace"] = {"synthetic": False, "steps": args.steps,
                      "torch": sys.modules["torch"].__version__, "runs": runs}
    r["trace"].update(launch_calls=sorted(LAUNCH), wait_calls=sorted(WAIT))
    r["machine"] = machine()
    r["seconds"] = round(time.time() - t0, 1)
    save(args.json, r)
    log(f"done in {r['seconds']} s")
    return r


def save(path, r) -> None:
    if path:
        pathlib.Path(path).write_text(json.dumps(r, indent=1))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python perf/step_trace.py",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument("--gguf", metavar="PATH", help="the model file (default $PAGEDKV_GGUF)")
    p.add_argument("--dry", action="store_true", help="no GPU: a tiny model on NumPy")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (default 1 64; 1 8 with --dry)")
    p.add_argument("--steps", type=int, default=5, help="traced steps per engine")
    p.add_argument("--raw-dir", metavar="DIR", help="also keep each raw chrome trace there "
                   "(gzipped, a few MB each)")
    p.add_argument("--timing-steps", type=int, default=24, help="timed steps (default 24)")
    p.add_argument("--repeat", type=int, default=3, help="timed runs, the best kept")
    p.add_argument("--max-context", type=int, default=1024,
                   help="tokens a fast runner's page table holds (default 1024)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.timing_steps < 2 or args.repeat < 1:
        p.error("--steps >= 1, --timing-steps >= 2 and --repeat >= 1")
    args.argv = argv
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
