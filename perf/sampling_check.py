"""Sampling a batch on the device, timed beside greedy decoding and today's per-request path.

    python perf/sampling_check.py --json OUT.json           # on a GPU: batch 64 and 256
    python perf/sampling_check.py --quick --json OUT.json   # anywhere (NumPy on a CPU)

For each batch size (vocabulary 49,152, SmolLM2's; logits float32, normal with sd 3, from a
fixed seed), it first checks, then times:

* ``checks``: the device's tokens against NumPy's for the same inputs (rows that differ are
  float32 near-ties; a few at most), and greedy rows (temperature 0) against ``argmax_rows``;
* ``sample_rows``: :func:`pagedkv.kernels.sampling.sample_rows` at temperature 0.7, top-p 0.9
  (top-k off), the per-row parameters already on the device (as an engine keeps them), and
  again with host parameters (each call uploads them: ``sample_rows_host_params``);
* ``argsort``: the stable sort inside it alone, its largest part;
* ``argmax_rows``: greedy decoding's kernel (:mod:`pagedkv.kernels.fused`), the floor;
* ``engine_today``: what the engine does now for a sampled request: one call per request of
  the host sampler ``sample`` on its row of device logits (its array operations run on the
  device, and its token is downloaded), over all the rows, per step and per request;
* ``download_numpy``: the path with the host doing the work: the logits downloaded, then
  ``sample`` on each row in NumPy; per step and per request.

On a GPU the first three are medians of CUDA-event timings (``pagedkv.bench.kernels.time_fn``);
the per-request paths, which wait for the device, are medians of wall-clock steps. On a CPU
(``--quick`` or no GPU) everything is wall clock, with smaller batches: only the checks mean
anything there. The JSON has the date, the machine and the backend.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import backend  # noqa: E402
from pagedkv.kernels.fused import argmax_rows  # noqa: E402
from pagedkv.kernels.sampling import sample_rows  # noqa: E402

try:
    from pagedkv.model.sampling import sample as host_sample  # noqa: E402
except ImportError:
    from pagedkv.model.generate import sample as host_sample  # noqa: E402

VOCAB = 49_152
T, TOP_P = 0.7, 0.9


def wall(fn, reps, sync):
    """Median wall-clock ms of ``fn`` (after one warm-up call), the device synchronised."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def run_batch(rows, vocab, reps, xp, gpu):
    rng = np.random.default_rng(20261203 + rows)
    logits_h = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    seeds_h = rng.integers(0, 2**62, rows)
    counters_h = rng.integers(0, 1000, rows)
    t_h, p_h, k_h = np.full(rows, T), np.full(rows, TOP_P), np.zeros(rows, np.int64)
    logits = xp.asarray(logits_h)
    t, p, k, seeds, counters = (xp.asarray(a) for a in (t_h, p_h, k_h, seeds_h, counters_h))
    sync = (lambda: xp.cuda.Device().synchronize()) if gpu else (lambda: None)

    # checks: the device against NumPy on the same inputs; greedy rows against argmax_rows
    n_check = min(rows, 64)
    mine = backend.to_numpy(sample_rows(logits[:n_check], t[:n_check], p[:n_check],
                                        k[:n_check], seeds[:n_check], counters[:n_check]))
    ref = sample_rows(logits_h[:n_check], t_h[:n_check], p_h[:n_check], k_h[:n_check],
                      seeds_h[:n_check], counters_h[:n_check])
    greedy = backend.to_numpy(sample_rows(logits, 0.0, 1.0, 0, seeds, counters))
    out = {"batch": rows, "vocab": vocab, "temperature": T, "top_p": TOP_P,
           "checked_rows": n_check, "rows_differing_from_numpy": int((mine != ref).sum()),
           "greedy_equals_argmax_rows": bool((greedy == backend.to_numpy(
               argmax_rows(logits))).all())}

    if gpu:
        from pagedkv.bench.kernels import time_fn
        event = lambda fn: time_fn(fn, "cupy", reps=reps)[0]  # noqa: E731
    else:
        event = lambda fn: wall(fn, max(3, reps // 10), sync)  # noqa: E731
    greedy_out = xp.empty(rows, dtype=np.int32)
    out["sample_rows_ms"] = event(lambda: sample_rows(logits, t, p, k, seeds, counters))
    out["sample_rows_host_params_ms"] = event(
        lambda: sample_rows(logits, t_h, p_h, k_h, seeds_h, counters_h))
    out["argsort_ms"] = event(lambda: xp.argsort(logits, axis=1, kind="stable"))
    out["argmax_rows_ms"] = event(lambda: argmax_rows(logits, out=greedy_out))

    u = np.random.default_rng(7).random(rows)
    steps = max(2, reps // 10)

    def engine_today():                       # one host-sampler call per request, on the device
        for i in range(rows):
            host_sample(logits[i:i + 1], T, TOP_P, u[i:i + 1])

    def download_numpy():                     # download, then NumPy per request
        h = backend.to_numpy(logits)
        for i in range(rows):
            host_sample(h[i:i + 1], T, TOP_P, u[i:i + 1])

    for name, fn in (("engine_today", engine_today), ("download_numpy", download_numpy)):
        ms = wall(fn, steps, sync)
        out[f"{name}_step_ms"] = ms
        out[f"{name}_per_request_ms"] = ms / rows
    out["download_ms"] = wall(lambda: backend.to_numpy(logits), max(3, reps // 3), sync)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small batches, few repetitions")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--batches", type=int, nargs="*", help="batch sizes (default 64 256)")
    args = ap.parse_args(argv)
    gpu = backend.on_gpu
    xp = backend.xp
    batches = args.batches or ([4, 16] if args.quick or not gpu else [64, 256])
    reps = 5 if args.quick else 30
    results = {"meta": {"date": datetime.datetime.now().isoformat(timespec="seconds"),
                        "machine": platform.node(), "python": platform.python_version(),
                        **backend.describe(), "quick": args.quick,
                        "timer": "CUDA events (medians)" if gpu else "wall clock (medians)"},
               "batches": []}
    for rows in batches:
        r = run_batch(rows, VOCAB, reps, xp, gpu)
        results["batches"].append(r)
        print(json.dumps(r), flush=True)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    bad = [r for r in results["batches"]
           if not r["greedy_equals_argmax_rows"] or r["rows_differing_from_numpy"] > 2]
    if bad:
        print("CHECK FAILED:", bad)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
