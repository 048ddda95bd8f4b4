"""Split-count sweep of both decode kernels on the GPU (no peers): for every shape of
``bench/decode_shapes.json`` and both dtypes, how long each kernel takes with each number of
splits, next to the split count the automatic rule (``choose_num_splits``) picks.

    python perf/split_sweep.py --json OUT.json

Every launch is checked against the automatic plan's output before it is timed; times are of the
bare launch (``DecodePlan.run``), median of CUDA-event timings as in ``pagedkv.bench.kernels``.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

from pagedkv.bench.kernels import host_float, make_problem, rel_err, shape_lengths, time_fn
from pagedkv.kernels import decode_plan, paged_decode_attention
from pagedkv.kernels.attention import _ctas_per_sm

MANY = [1, 2, 3, 4, 6, 8]              # splits tried when there are many (sequence, head) pairs
FEW = [8, 16, 24, 32, 48, 64]           # ... and when there are few


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    spec = json.loads(pathlib.Path("bench/decode_shapes.json").read_text())
    rows = []
    for dtype in spec["dtype"]:
        for i, shape in enumerate(spec["shapes"]):
            lens = shape_lengths(shape, seed=i)
            qh, kh = shape["q_heads"], shape["kv_heads"]
            q, cache, tables, lens_d = make_problem(lens, qh, kh, spec["head_dim"],
                                                    spec["block_size"], dtype, 3)
            ref = host_float(paged_decode_attention(q, cache, tables, lens_d))
            auto = decode_plan(q, cache, tables)
            work = len(lens) * kh
            line = [f"auto {auto.path[:2]} s{auto.num_splits}"]
            paths = [False, True] if qh // kh >= 4 else [False]
            for tc in paths:
                for s in (MANY if work >= 64 else FEW):
                    plan = decode_plan(q, cache, tables, tensor_cores=tc, num_splits=s)
                    if plan.num_splits != s:        # rounding to whole tiles merged two counts
                        continue
                    out = plan.run(q, cache, tables, lens_d)
                    err = rel_err(host_float(out), ref)
                    assert err < 1e-2, (dtype, shape, tc, s, err)
                    ms, _ = time_fn(lambda: plan.run(q, cache, tables, lens_d, out),
                                    reps=args.reps)
                    occ = _ctas_per_sm(plan._fn, plan.threads, plan.smem_bytes or 0)
                    rows.append(dict(dtype=dtype, batch=len(lens), seq_len=shape["seq_len"],
                                     q_heads=qh, kv_heads=kh, path=plan.path, num_splits=s,
                                     auto_path=auto.path, auto_splits=auto.num_splits,
                                     ctas_per_sm=occ, us=round(ms * 1e3, 2)))
                    line.append(f"{'tc' if tc else 'cc'} s{s} {ms * 1e3:.1f}")
            print(f"{dtype:8s} b{len(lens):<4d} L{shape['seq_len']!s:<6s} {qh}/{kh}: "
                  + " | ".join(line), flush=True)
            del q, cache, tables, lens_d
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
