"""The 8-bit cache's kernels timed beside float16's, on a GPU: does reading half the bytes halve
the time?

    python perf/kv8_kernels.py --json perf/results/kv8-kernels-h100-DATE.json

SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head dim 64, blocks of 16, float16
queries), every page at a random place in the pool:

* **decode attention** (``paged_decode_attention``, its automatic kernel and splits) at
  batches 1, 8, 64, 256 and contexts 128, 512, 2048: milliseconds a call for the float16 cache
  and the int8 one, and each one's K/V bytes read over its time (against the device-to-device
  copy bandwidth measured in the same process);
* **prefill attention** (``paged_prefill_attention``): 4 prompts of 512 and 1 of 2048;
* **the K/V write** (``rope_write_kv``) of 256 decode rows and of 2048 prefill rows.

Each call is timed by CUDA events (``pagedkv.bench.kernels.time_fn``: the median of many
calls); each int8 result is checked against the float16 one (relative error, printed). About a
minute on an H100.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import backend  # noqa: E402
from pagedkv.bench.kernels import copy_bandwidth, make_problem, time_fn  # noqa: E402
from pagedkv.kernels import (decode_plan, paged_decode_attention, paged_prefill_attention,  # noqa: E402
                             write_kv)
from pagedkv.kernels.fused import rope_write_kv  # noqa: E402
from pagedkv.kernels.kv8 import Cache8  # noqa: E402
from pagedkv.spec import KVSpec  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def to_int8(cache):
    """The float16 cache's numbers written into an int8 one (every slot of every block)."""
    cp = backend.xp
    nb = cache.shape[0]
    c8 = Cache8.zeros(nb, BS, KVH, D, cp)
    slots = cp.arange(nb * BS, dtype=cp.int32)
    k = cache[:, 0].reshape(-1, KVH, D)
    v = cache[:, 1].reshape(-1, KVH, D)
    write_kv(c8, cp.ascontiguousarray(k), cp.ascontiguousarray(v), slots, validate=False)
    return c8


def rel(a, b):
    a, b = (backend.to_numpy(x).astype(np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def decode_rows(copy_bw):
    rows = []
    row_bytes = {"float16": KVSpec(1, KVH, D, "float16").bytes_per_token,
                 "int8": KVSpec(1, KVH, D, "int8").bytes_per_token}   # one layer's
    for batch in (1, 8, 64, 256):
        for ctx in (128, 512, 2048):
            q, cache, tables, lens = make_problem(np.full(batch, ctx, np.int32), H, KVH, D, BS,
                                                  "float16", seed=batch + ctx)
            c8 = to_int8(cache)
            row = {"batch": batch, "context": ctx}
            outs = {}
            for name, c in (("float16", cache), ("int8", c8)):
                plan = decode_plan(q, c, tables)
                ms, _ = time_fn(lambda: paged_decode_attention(q, c, tables, lens))
                outs[name] = paged_decode_attention(q, c, tables, lens)
                nbytes = batch * ctx * row_bytes[name]
                row[name] = {"ms": ms, "kernel": plan.kernel, "splits": plan.num_splits,
                             "kv_bytes": nbytes, "bytes_per_s": nbytes / (ms * 1e-3),
                             "of_copy_bw": nbytes / (ms * 1e-3) / copy_bw}
            row["int8_over_float16"] = row["int8"]["ms"] / row["float16"]["ms"]
            row["rel_err"] = rel(outs["int8"], outs["float16"])
            rows.append(row)
            print(f"decode b{batch:>3} ctx{ctx:>5}: float16 {row['float16']['ms']:.4f} ms "
                  f"({100 * row['float16']['of_copy_bw']:.0f} % of copy), int8 "
                  f"{row['int8']['ms']:.4f} ms ({100 * row['int8']['of_copy_bw']:.0f} %), "
                  f"ratio {row['int8_over_float16']:.2f}, rel err {row['rel_err']:.1e}",
                  flush=True)
    return rows


def prefill_rows():
    cp, rows = backend.xp, []
    for n, length in ((4, 512), (1, 2048)):
        lens = np.full(n, length, np.int32)
        q, cache, tables, dl = make_problem(lens, H, KVH, D, BS, "float16", seed=length)
        q = cp.asarray(np.random.default_rng(0).standard_normal((n * length, H, D)),
                       dtype=cp.float16)
        qs = cp.asarray(np.arange(n + 1, dtype=np.int32) * length)
        c8 = to_int8(cache)
        row, outs = {"prompts": n, "length": length}, {}
        for name, c in (("float16", cache), ("int8", c8)):
            ms, _ = time_fn(lambda: paged_prefill_attention(q, c, tables, qs, dl))
            outs[name] = paged_prefill_attention(q, c, tables, qs, dl)
            row[name] = {"ms": ms}
        row["int8_over_float16"] = row["int8"]["ms"] / row["float16"]["ms"]
        row["rel_err"] = rel(outs["int8"], outs["float16"])
        rows.append(row)
        print(f"prefill {n} x {length}: float16 {row['float16']['ms']:.3f} ms, int8 "
              f"{row['int8']['ms']:.3f} ms, ratio {row['int8_over_float16']:.2f}, rel err "
              f"{row['rel_err']:.1e}", flush=True)
    return rows


def write_rows():
    cp, rows = backend.xp, []
    rng = np.random.default_rng(1)
    ang = np.outer(np.arange(4096), 10000.0 ** (-np.arange(0, D, 2) / D))
    cos, sin = (cp.asarray(f(ang).astype(np.float32)) for f in (np.cos, np.sin))
    for t in (256, 2048):
        nb = t // BS + 1
        qkv = cp.asarray(rng.standard_normal((t, (H + 2 * KVH) * D)), dtype=cp.float16)
        pos = cp.asarray(rng.integers(0, 4096, t).astype(np.int32))
        slots = cp.asarray(rng.permutation(nb * BS)[:t].astype(np.int32))
        q_out = cp.empty((t, H, D), cp.float16)
        caches = {"float16": cp.zeros((nb, 2, BS, KVH, D), cp.float16),
                  "int8": Cache8.zeros(nb, BS, KVH, D, cp)}
        row = {"rows": t}
        for name, c in caches.items():
            ms, _ = time_fn(lambda: rope_write_kv(qkv, pos, slots, cos, sin, q_out, c, H, KVH))
            row[name] = {"ms": ms}
        rows.append(row)
        print(f"rope_write_kv {t} rows: float16 {row['float16']['ms'] * 1e3:.1f} us, int8 "
              f"{row['int8']['ms'] * 1e3:.1f} us", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json")
    args = p.parse_args(argv)
    if not backend.on_gpu:
        p.error(f"this times CUDA kernels: no GPU here ({backend.reason})")
    copy_bw, _ = copy_bandwidth()
    print(f"device-to-device copy: {copy_bw / 1e12:.2f} TB/s", flush=True)
    r = {"command": "python perf/kv8_kernels.py " + " ".join(sys.argv[1:] if argv is None
                                                             else argv),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "machine": backend.describe(), "copy_bytes_per_s": copy_bw,
         "shape": {"q_heads": H, "kv_heads": KVH, "head_dim": D, "block_size": BS},
         "decode": decode_rows(copy_bw), "prefill": prefill_rows(), "write": write_rows()}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
