"""Sampling a batch on the device, timed beside greedy decoding and today's per-request path.

    python perf/sampling_check.py --json OUT.json           # on a GPU: batch 64 and 256
    python perf/sampling_check.py --quick --json OUT.json   # anywhere (NumPy on a CPU)

For each batch size (vocabulary 49,152, SmolLM2's; logits float32, normal with sd 3, from a
fixed seed), it first checks, then times:

* ``checks``: the kernel's kept sets (:func:`pagedkv.kernels.sampling.kept_tokens`) and
  tokens against the NumPy reference's (sort-based) on the same rows, at the timed
  parameters and at mixed ones (top-k, top-p, greedy rows): rows that differ are near-ties
  of float64 sums, a few at most; and greedy rows (temperature 0) against ``argmax_rows``;
* ``sample_rows``: :func:`pagedkv.kernels.sampling.sample_rows` at temperature 0.7, top-p 0.9
  (top-k off), the per-row parameters uploaded from the host as the engine does each step
  (one array), and again with them already on the device (``sample_rows_device_params``);
  and at top-k 50 with top-p 0.9 (``sample_rows_top_k``);
* ``argmax_rows``: greedy decoding's kernel (:mod:`pagedkv.kernels.fused`), the floor, and
  ``ratio``: the sampler's time over it;
* ``engine_call`` and ``greedy_call``: the engine's whole call by wall clock (the parameters
  packed on the host, uploaded, the kernel, the tokens downloaded), beside greedy's argmax
  and download;

On a GPU the kernels are timed with CUDA events (``pagedkv.bench.kernels.time_fn``, medians);
the per-request path, which waits for the device, by wall clock. On a CPU (``--quick`` or no
GPU) everything is wall clock, with smaller batches: only the checks mean anything there.
The JSON has the date, the machine and the backend.
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
from pagedkv.kernels.sampling import (kept_tokens, pack_rows, reference_rows,  # noqa: E402
                                      sample_packed, sample_rows)

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


def _differ(xp, logits_h, t, p, k, seeds, counters):
    """(rows whose kept sets differ, rows whose tokens differ): the backend against NumPy."""
    kept = backend.to_numpy(kept_tokens(xp.asarray(logits_h), t, p, k))
    kept_ref = kept_tokens(logits_h, t, p, k)
    mine = backend.to_numpy(sample_rows(xp.asarray(logits_h), t, p, k, seeds, counters))
    ref = reference_rows(logits_h, t, p, k, seeds, counters)
    return int((kept != kept_ref).any(axis=1).sum()), int((mine != ref).sum())


def run_batch(rows, vocab, reps, xp, gpu):
    rng = np.random.default_rng(20261203 + rows)
    logits_h = (rng.normal(size=(rows, vocab)) * 3).astype(np.float32)
    seeds_h = rng.integers(0, 2**62, rows)
    counters_h = rng.integers(0, 1000, rows)
    t_h, p_h, k_h = np.full(rows, T), np.full(rows, TOP_P), np.zeros(rows, np.int64)
    logits = xp.asarray(logits_h)
    sync = (lambda: xp.cuda.Device().synchronize()) if gpu else (lambda: None)

    # checks: the backend against the NumPy reference on the same inputs
    n_check = min(rows, 64)
    sl = slice(0, n_check)
    kept_d, tok_d = _differ(xp, logits_h[sl], t_h[sl], p_h[sl], k_h[sl], seeds_h[sl],
                            counters_h[sl])
    mixed = (rng.choice([0.0, 0.5, 1.0, 1.3], n_check), rng.choice([1.0, 0.9, 0.5], n_check),
             rng.choice([0, 1, 50, 1000], n_check))
    kept_m, tok_m = _differ(xp, logits_h[sl], *mixed, seeds_h[sl], counters_h[sl])
    greedy = backend.to_numpy(sample_rows(logits, 0.0, 1.0, 0, seeds_h, counters_h))
    out = {"batch": rows, "vocab": vocab, "temperature": T, "top_p": TOP_P,
           "checked_rows": n_check, "kept_sets_differing": kept_d, "tokens_differing": tok_d,
           "mixed_params_kept_sets_differing": kept_m, "mixed_params_tokens_differing": tok_m,
           "greedy_equals_argmax_rows": bool((greedy == backend.to_numpy(
               argmax_rows(logits))).all())}

    if gpu:
        from pagedkv.bench.kernels import time_fn
        event = lambda fn: time_fn(fn, "cupy", reps=reps)[0]  # noqa: E731
    else:
        event = lambda fn: wall(fn, max(3, reps // 10), sync)  # noqa: E731
    greedy_out = xp.empty(rows, dtype=np.int32)
    t, p, k, seeds, counters = (xp.asarray(a) for a in (t_h, p_h, k_h, seeds_h, counters_h))
    out["sample_rows_ms"] = event(
        lambda: sample_rows(logits, t_h, p_h, k_h, seeds_h, counters_h))
    out["sample_rows_device_params_ms"] = event(
        lambda: sample_rows(logits, t, p, k, seeds, counters))
    k50 = np.full(rows, 50)
    out["sample_rows_top_k_ms"] = event(
        lambda: sample_rows(logits, t_h, p_h, k50, seeds_h, counters_h))
    out["argmax_rows_ms"] = event(lambda: argmax_rows(logits, out=greedy_out))
    out["ratio_sample_over_argmax"] = out["sample_rows_ms"] / out["argmax_rows_ms"]

    # the engine's whole call, by wall clock: the parameters packed on the host, one upload,
    # the kernel, the tokens downloaded; beside greedy's argmax and download
    values = [(T, TOP_P, 0, int(sd), int(c)) for sd, c in zip(seeds_h, counters_h)]
    out["engine_call_ms"] = wall(lambda: backend.to_numpy(
        sample_packed(logits, pack_rows(*zip(*values)))), max(3, reps), sync)
    out["greedy_call_ms"] = wall(lambda: backend.to_numpy(
        argmax_rows(logits, out=greedy_out)), max(3, reps), sync)

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
    bad = [r for r in results["batches"] if not r["greedy_equals_argmax_rows"] or max(
        r["kept_sets_differing"], r["tokens_differing"], r["mixed_params_kept_sets_differing"],
        r["mixed_params_tokens_differing"]) > 2]
    if bad:
        print("CHECK FAILED:", bad)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
