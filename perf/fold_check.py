"""Batch-1 decode graph with and without RMSNorm folded into the projections (norm_gemv),
and with and without RoPE and the K/V write folded into the q|k|v one (norm_gemv_rope):
nodes and replay time, SmolLM2-135M's shapes with random float16 weights (no model file).

    python perf/fold_check.py [--json FILE] [--no-rope-fold]

Three passes, each twice, interleaved: unfolded (fold_rows 0); folded, but with the two
launches norm_gemv_rope replaces (norm_gemv then rope_write_kv: the pass before it); folded
(fold_rows 1). ``--no-rope-fold`` leaves out the last.
"""
from __future__ import annotations

import argparse
import contextlib
import json
from unittest import mock

import numpy as np

from decode_timing import SMOL, batch_of, time_decode
from pagedkv.kernels.norm_gemv import norm_gemv_rope_unfused
from pagedkv.model import Llama, PagedKV, random_weights
from pagedkv.model import runner as runner_module
from pagedkv.model.runner import FastRunner


def measure(model, fold_rows: int, rope_fold: bool = True, steps: int = 200) -> dict:
    """Nodes, step times and the greedy token of one runner; ``rope_fold=False`` has its
    folded pass call norm_gemv then rope_write_kv where it would call norm_gemv_rope."""
    unfused = mock.patch.object(runner_module, "norm_gemv_rope", norm_gemv_rope_unfused)
    with unfused if not rope_fold else contextlib.nullcontext():
        return _measure(model, fold_rows, steps) | dict(rope_fold=rope_fold and fold_rows > 0)


def _measure(model, fold_rows: int, steps: int) -> dict:
    kv = PagedKV.for_model(model, 64, 16)
    runner = FastRunner(model, kv, max_batch=1, max_context=1024, fold_rows=fold_rows)
    row, _ = time_decode(runner, batch_of(1), steps)
    return dict(fold_rows=fold_rows) | row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--no-rope-fold", action="store_true",
                    help="leave out the pass with norm_gemv_rope")
    args = ap.parse_args()
    model = Llama(SMOL, random_weights(SMOL, 0), dtype=np.float16)
    passes = [(0, False), (1, False)] + ([] if args.no_rope_fold else [(1, True)])
    rows = [measure(model, f, r) for f, r in passes * 2]     # twice each, interleaved
    for r in rows:
        print(json.dumps(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(what="batch-1 decode graph, SmolLM2 shapes, random fp16 weights; "
                                "rope_fold: norm_gemv_rope, else norm_gemv + rope_write_kv",
                           runs=rows), f, indent=1)


if __name__ == "__main__":
    main()
