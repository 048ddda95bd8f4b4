"""Decode passes of 2 to 8 rows through our few-row multiply (``gemm_method="gemv"``, every
norm folded: ``fold_rows`` = the bucket) against the default (cuBLAS's multiplies from 2
rows, norms unfolded): nodes, replay time and greedy tokens per bucket, SmolLM2-135M's
shapes with random float16 weights (no model file).

    python perf/rows_check.py [--json FILE] [--buckets 2,4,8] [--steps 200] [--per-warp 1]

``--per-warp 1,4`` measures the few-row kernel with each of those outputs per warp
(``GEMV_OUTPUTS_PER_WARP``, ``gemv.cu``'s ``dots_rows``; settings "few-row/R"). Each setting
twice, interleaved, on the same batch (perf/decode_timing.py). The logits are
not compared bit for bit: cuBLAS adds its sums in another order; the greedy tokens are.
"""
from __future__ import annotations

import json

import numpy as np

from decode_timing import (arguments, batch_of, host, smol_and_pool, time_decode,
                           write_result)
from pagedkv.kernels import gemm as gemm_module
from pagedkv.model.runner import FastRunner


def runner_for(model, kv, b: int, setting: str) -> FastRunner:
    """``"default"``, or ``"few-row"`` / ``"few-row/R"``: our multiply for every projection,
    every norm folded, R outputs a warp (captured now, with that choice)."""
    if setting == "default":
        runner = FastRunner(model, kv, max_batch=b, max_context=1024)
    else:
        per_warp = dict(gemm_module.GEMV_OUTPUTS_PER_WARP)
        if "/" in setting:
            gemm_module.GEMV_OUTPUTS_PER_WARP[b] = int(setting.split("/")[1])
        try:
            runner = FastRunner(model, kv, max_batch=b, max_context=1024,
                                gemm_method="gemv", fold_rows=b)
            runner.capture_all()
        finally:
            gemm_module.GEMV_OUTPUTS_PER_WARP.update(per_warp)
    return runner


def main():
    args = arguments("2,4,8", ("--per-warp", ""))
    settings = ["default"] + ([f"few-row/{r}" for r in args.per_warp.split(",")]
                              if args.per_warp else ["few-row"])
    buckets = [int(b) for b in args.buckets.split(",")]
    model, kv = smol_and_pool(buckets)
    rows, summary = [], {}
    for b in buckets:
        greedy = {}
        for name in settings * 2:                       # twice each, interleaved
            runner = runner_for(model, kv, b, name)
            row, logits = time_decode(runner, batch_of(b), args.steps)
            greedy[name] = host(logits).argmax(axis=1).tolist()
            rows.append(dict(bucket=b, setting=name) | row)
            print(json.dumps(rows[-1]))
        ms = {n: float(np.mean([r["step_ms_median"] for r in rows
                                if r["bucket"] == b and r["setting"] == n])) for n in settings}
        nodes = {n: next(r["nodes"] for r in rows if r["bucket"] == b and r["setting"] == n)
                 for n in settings}
        same = all(greedy[n] == greedy["default"] for n in settings)
        summary[str(b)] = dict(ms=ms, nodes=nodes, greedy_identical=same)
        print(f"bucket {b}: " + "; ".join(f"{n} {nodes[n]} nodes {ms[n]:.3f} ms"
                                          for n in settings)
              + f"; greedy tokens the same: {same}")
    if args.json:
        write_result(args.json, f"decode graph replay, the default (cuBLAS from "
                     f"{gemm_module.GEMV_AUTO_ROWS + 1} rows) against the few-row multiply "
                     f"with every norm folded, SmolLM2 shapes, random fp16 weights",
                     runs=rows, summary=summary)


if __name__ == "__main__":
    main()
