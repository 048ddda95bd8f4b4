"""Decode graphs with and without programmatic dependent launch (pagedkv/kernels/pdl.py):
nodes, replay time and outputs per bucket, SmolLM2-135M's shapes with random float16
weights (no model file).

    python perf/pdl_check.py [--json FILE] [--buckets 1,2,8,64,256] [--steps 200]

For each bucket, a runner without and one with ``pdl``, twice each, interleaved; every run
decodes the same batch (``b`` rows at position 100, each with its own blocks). The logits
of the two settings are compared bit for bit (the arithmetic is the same; only when each
kernel may start changes).
"""
from __future__ import annotations

import json

import numpy as np

from decode_timing import (arguments, batch_of, host, smol_and_pool, time_decode,
                           write_result)
from pagedkv.kernels.pdl import programmatic_available
from pagedkv.model.runner import FastRunner


def measure(model, kv, b: int, pdl: bool, steps: int) -> tuple[dict, np.ndarray]:
    runner = FastRunner(model, kv, max_batch=max(b, 1), max_context=1024, pdl=pdl)
    row, logits = time_decode(runner, batch_of(b), steps)
    return dict(bucket=b, pdl=pdl) | row, host(logits)


def main():
    args = arguments("1,2,8,64,256")
    print(f"programmatic launch available: {programmatic_available()}")
    buckets = [int(b) for b in args.buckets.split(",")]
    model, kv = smol_and_pool(buckets)
    rows, same = [], {}
    for b in buckets:
        logits = {}
        for pdl in (False, True, False, True):          # twice each, interleaved
            row, logits[pdl] = measure(model, kv, b, pdl, args.steps)
            rows.append(row)
            print(json.dumps(row))
        same[b] = bool(np.array_equal(logits[False], logits[True]))
        print(f"bucket {b}: logits bit for bit {same[b]}")
    summary = {}
    for b in buckets:
        ms = {p: float(np.mean([r["step_ms_median"] for r in rows
                                if r["bucket"] == b and r["pdl"] == p])) for p in (False, True)}
        summary[str(b)] = dict(off_ms=ms[False], on_ms=ms[True], saved_ms=ms[False] - ms[True],
                               logits_identical=same[b])
        print(f"bucket {b:>4}: {ms[False]:.3f} -> {ms[True]:.3f} ms")
    if args.json:
        write_result(args.json, "decode graph replay with and without programmatic dependent "
                     "launch, SmolLM2 shapes, random fp16 weights",
                     available=programmatic_available(), runs=rows, summary=summary)


if __name__ == "__main__":
    main()
