"""Batch-1 decode graph with and without RMSNorm folded into the projections (norm_gemv):
nodes and replay time, SmolLM2-135M's shapes with random float16 weights (no model file).

    python perf/fold_check.py [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pagedkv.model import Llama, LlamaConfig, PagedKV, random_weights
from pagedkv.model.llama import Batch
from pagedkv.model.runner import FastRunner

SMOL = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3,
                   head_dim=64, ffn=1536, rope_base=100000.0, context=2048)


def measure(model, fold_rows: int, steps: int = 200) -> dict:
    kv = PagedKV.for_model(model, 64, 16)
    runner = FastRunner(model, kv, max_batch=1, max_context=1024, fold_rows=fold_rows)
    one = np.ones(1, np.int32)
    batch = Batch(one, one * 100, one * 100, one, one * 101, np.arange(7, dtype=np.int32)[None],
                  np.zeros((0, 2), np.int32))
    for _ in range(5):
        runner.decode(batch)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.decode(batch)
        times.append(time.perf_counter() - t)
    return dict(fold_rows=fold_rows, nodes=runner.graph_nodes(1),
                step_ms_median=1e3 * float(np.median(times)),
                step_ms_min=1e3 * float(np.min(times)),
                greedy=int(runner._greedy_host[0]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    model = Llama(SMOL, random_weights(SMOL, 0), dtype=np.float16)
    rows = [measure(model, f) for f in (0, 1, 0, 1)]       # twice each, interleaved
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(what="batch-1 decode graph, SmolLM2 shapes, random fp16 weights",
                           runs=rows), f, indent=1)


if __name__ == "__main__":
    main()
