"""Launch-shape sweep of the tensor-core kernel on the GPU (no peers): which (warps per CTA,
ring stages per warp) is fastest, next to the CUDA-core kernel, on a few shapes.

    python perf/tc_sweep.py --json OUT.json

Each configuration is checked against the default launch's output before it is timed. The
public call and the bare launch (``DecodePlan.run``) are also timed on the one-sequence shapes,
where the host's share of a call is largest.
"""
from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from pagedkv.bench.kernels import host_float, make_problem, rel_err, time_fn
from pagedkv.kernels import decode_plan, paged_decode_attention

SHAPES = [("float16", 128, 2048, 64, 8), ("float16", 16, 8192, 64, 8),
          ("float16", 128, 8192, 32, 8), ("bfloat16", 64, 2048, 32, 8),
          ("bfloat16", 1, 32768, 64, 8), ("bfloat16", 1, 32768, 32, 8)]
CONFIGS = [(4, 3), (4, 2), (4, 4), (2, 3), (2, 4), (8, 2), (8, 3), (1, 4)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for dtype, batch, L, qh, kh in SHAPES:
        q, cache, tables, lens = make_problem([L] * batch, qh, kh, 128, 16, dtype, 3)
        ref = host_float(paged_decode_attention(q, cache, tables, lens, tensor_cores=True))
        line = []
        for tc, configs in ((False, [None]), (True, CONFIGS)):
            for cfg in configs:
                plan = decode_plan(q, cache, tables, tensor_cores=tc, config=cfg)
                out = plan.run(q, cache, tables, lens)
                err = rel_err(host_float(out), ref)
                assert err < 1e-2, (dtype, batch, L, cfg, err)
                ms, _ = time_fn(lambda: plan.run(q, cache, tables, lens, out), reps=args.reps)
                rows.append(dict(dtype=dtype, batch=batch, seq_len=L, q_heads=qh, kv_heads=kh,
                                 path=plan.path, config=cfg, us=round(ms * 1e3, 2),
                                 num_splits=plan.num_splits, regs=plan.registers,
                                 smem=plan.smem_bytes))
                line.append(f"{'tc' + str(cfg) if tc else 'cc'} {ms * 1e3:.1f}")
        if batch == 1:   # the host's share: public call vs bare launch, three times each
            plan = decode_plan(q, cache, tables)
            for i in range(3):
                ms_call, _ = time_fn(lambda: paged_decode_attention(q, cache, tables, lens,
                                                                    out=out), reps=args.reps)
                ms_run, _ = time_fn(lambda: plan.run(q, cache, tables, lens, out), reps=args.reps)
                rows.append(dict(dtype=dtype, batch=batch, seq_len=L, q_heads=qh, kv_heads=kh,
                                 path="public-vs-run", us_call=round(ms_call * 1e3, 2),
                                 us_run=round(ms_run * 1e3, 2)))
                line.append(f"call {ms_call * 1e3:.1f} / run {ms_run * 1e3:.1f}")
        print(f"{dtype:8s} b{batch:<4d} L{L:<6d} {qh}/{kh}: " + " | ".join(line), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
