"""Decode graphs whose attention merges its own splits (``FastRunner(merge_in_attention=
True)``: the split that finishes last merges, common.cuh's ``arrived_last``) against the
default runner, which launches ``merge_splits`` after the attention: nodes, replay time and
logits per bucket, SmolLM2-135M's shapes with random float16 weights (no model file).

    python perf/merge_check.py [--json FILE] [--buckets 1,2,8,64] [--steps 200]

For each bucket whose attention is split, a runner of each kind, twice each, interleaved;
every run decodes the same batch (perf/decode_timing.py). The logits of the two are
compared bit for bit (the same merge arithmetic, in the same order).
"""
from __future__ import annotations

import json

import numpy as np

from decode_timing import (arguments, batch_of, host, smol_and_pool, time_decode,
                           write_result)
from pagedkv.model.runner import FastRunner


def runner_for(model, kv, b: int, in_kernel: bool) -> FastRunner:
    """A runner for ``b`` rows whose split attention merges its own pieces (``in_kernel``)
    or launches merge_splits after itself (the default)."""
    return FastRunner(model, kv, max_batch=max(b, 1), max_context=1024,
                      merge_in_attention=in_kernel)


def main():
    args = arguments("1,2,8,64")
    buckets = [int(b) for b in args.buckets.split(",")]
    model, kv = smol_and_pool(buckets)
    rows, summary = [], {}
    for b in buckets:
        runner = runner_for(model, kv, b, True)
        plan = runner._view(runner._bucket(b)).plan
        splits = 1 if plan is None else plan.num_splits         # (NumPy: no plan)
        if splits == 1:
            print(f"bucket {b}: the attention is not split, nothing to merge")
            continue
        logits = {}
        for in_kernel in (False, True, False, True):        # twice each, interleaved
            row, out = time_decode(runner_for(model, kv, b, in_kernel), batch_of(b),
                                   args.steps)
            row = dict(bucket=b, splits=splits, merge_in_kernel=in_kernel) | row
            logits[in_kernel] = host(out)
            rows.append(row)
            print(json.dumps(row))
        ms = {k: float(np.mean([r["step_ms_median"] for r in rows
                                if r["bucket"] == b and r["merge_in_kernel"] == k]))
              for k in (False, True)}
        nodes = {k: next(r["nodes"] for r in rows
                         if r["bucket"] == b and r["merge_in_kernel"] == k)
                 for k in (False, True)}
        same = bool(np.array_equal(logits[False], logits[True]))
        summary[str(b)] = dict(splits=splits, apart_ms=ms[False], in_kernel_ms=ms[True],
                               apart_nodes=nodes[False], in_kernel_nodes=nodes[True],
                               logits_identical=same)
        print(f"bucket {b:>4} ({splits} splits): {nodes[False]} -> {nodes[True]} nodes, "
              f"{ms[False]:.3f} -> {ms[True]:.3f} ms, logits bit for bit {same}")
    if args.json:
        write_result(args.json, "decode graph replay, attention splits merged by a separate "
                     "kernel or by the last split, SmolLM2 shapes, random fp16 weights",
                     runs=rows, summary=summary)


if __name__ == "__main__":
    main()
