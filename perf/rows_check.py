"""Decode passes of 2 to 8 rows through our few-row multiply (``gemm_method="gemv"``, every
norm folded: ``fold_rows`` = the bucket) against the default (cuBLAS's multiplies from 2
rows, norms unfolded): nodes, replay time and greedy tokens per bucket, SmolLM2-135M's
shapes with random float16 weights (no model file).

    python perf/rows_check.py [--json FILE] [--buckets 2,4,8] [--steps 200]

Each setting twice, interleaved, on the same batch (perf/decode_timing.py). The logits are
not compared bit for bit: cuBLAS adds its sums in another order; the greedy tokens are.
"""
from __future__ import annotations

import argparse
import datetime
import json

import numpy as np

from decode_timing import BLOCK_SIZE, BLOCKS_PER_ROW, SMOL, batch_of, host, time_decode
from pagedkv.model import Llama, PagedKV, random_weights
from pagedkv.model.runner import FastRunner

SETTINGS = {"default": {}, "few-row": None}      # few-row: gemv, folded to the bucket


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--buckets", default="2,4,8")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    model = Llama(SMOL, random_weights(SMOL, 0), dtype=np.float16)
    buckets = [int(b) for b in args.buckets.split(",")]
    kv = PagedKV.for_model(model, max(buckets) * BLOCKS_PER_ROW + 8, BLOCK_SIZE)
    rows, summary = [], {}
    for b in buckets:
        greedy = {}
        for name in list(SETTINGS) * 2:                 # twice each, interleaved
            kw = SETTINGS[name] if SETTINGS[name] is not None else dict(
                gemm_method="gemv", fold_rows=b)
            runner = FastRunner(model, kv, max_batch=b, max_context=1024, **kw)
            row, logits = time_decode(runner, batch_of(b), args.steps)
            greedy[name] = host(logits).argmax(axis=1).tolist()
            rows.append(dict(bucket=b, setting=name) | row)
            print(json.dumps(rows[-1]))
        ms = {n: float(np.mean([r["step_ms_median"] for r in rows
                                if r["bucket"] == b and r["setting"] == n])) for n in SETTINGS}
        nodes = {n: next(r["nodes"] for r in rows if r["bucket"] == b and r["setting"] == n)
                 for n in SETTINGS}
        summary[str(b)] = dict(ms=ms, nodes=nodes,
                               greedy_identical=greedy["default"] == greedy["few-row"])
        print(f"bucket {b}: default {nodes['default']} nodes {ms['default']:.3f} ms; few-row "
              f"{nodes['few-row']} nodes {ms['few-row']:.3f} ms; greedy tokens the same: "
              f"{summary[str(b)]['greedy_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(what="decode graph replay, default (cuBLAS from 2 rows) against "
                                "the few-row multiply with every norm folded, SmolLM2 shapes, "
                                "random fp16 weights",
                           date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                               timespec="seconds"), runs=rows, summary=summary), f, indent=1)


if __name__ == "__main__":
    main()
