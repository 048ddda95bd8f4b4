"""Host (CPU) time of one decode-attention call, piece by piece, on a GPU machine.

    python perf/host_profile.py [--torch]

The problem is one short sequence, so the GPU finishes each launch long before the host has
issued the next one: wall time per call is the host's time. Each piece is timed over many calls
(median of 7 rounds), the GPU synchronised after each round.
"""
from __future__ import annotations

import statistics
import sys
import time

import numpy as np

from pagedkv import backend
from pagedkv.bench.kernels import make_problem
from pagedkv.kernels import decode_plan, paged_decode_attention
from pagedkv.kernels._common import check_decode
from pagedkv.kernels.attention import _choose, _contiguous, _scratch


def per_call_us(fn, n=2000, rounds=7):
    cp = backend.xp
    for _ in range(200):
        fn()
    cp.cuda.Device().synchronize()
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        out.append((time.perf_counter() - t) / n * 1e6)
        cp.cuda.Device().synchronize()
    return statistics.median(out)


def main():
    cp = backend.xp
    if "--torch" in sys.argv:      # as in the benchmark's process, which also runs the peers
        import torch
        torch.zeros(1, device="cuda")
        print("torch", torch.__version__, "imported")
    for dtype, qh, splits in (("float16", 32, None), ("float16", 64, None), ("float16", 64, 1)):
        q, cache, tables, lens = make_problem([256], qh, 8, 128, 16, dtype, 3)
        out = cp.empty_like(q)
        plan = decode_plan(q, cache, tables, num_splits=splits)
        kv = check_decode(q, cache, tables, lens)
        parts = {
            "public call (out given)": lambda: paged_decode_attention(
                q, cache, tables, lens, out=out, num_splits=splits),
            "public call (new out)": lambda: paged_decode_attention(
                q, cache, tables, lens, num_splits=splits),
            "check_decode": lambda: check_decode(q, cache, tables, lens, out),
            "_choose (cached plan)": lambda: _choose(q, cache, tables, kv, splits, None),
            "plan.run (out given)": lambda: plan.run(q, cache, tables, lens, out),
            "_contiguous x3": lambda: (_contiguous(q), _contiguous(tables), _contiguous(lens)),
            "_scratch": lambda: _scratch(4096),
            "cp.empty_like(q)": lambda: cp.empty_like(q),
            "np.int32 + np.float32 boxing x4": lambda: (np.int32(8), np.int32(16),
                                                       np.int32(256), np.float32(0.1)),
        }
        print(f"{dtype} 1 x 256 {qh}/8, {plan.path}, {plan.num_splits} split(s):")
        for name, fn in parts.items():
            print(f"  {name:32s} {per_call_us(fn):7.2f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
