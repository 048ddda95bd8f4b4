"""Bookkeeping benchmarks: ``python -m pagedkv.bench [--json] [--repeat N]``.

Times the manager's hot paths on the CPU (the pool is a small NumPy array: bookkeeping never
touches KV bytes, so its size does not matter here):

* ``alloc_free_ns``  — one block allocated and freed (``free(allocate())`` in a loop);
* ``decode_step_us`` — 1024 sequences of 512 tokens each append one token: every sequence needs
  a new block (512 is a multiple of the block size 16), and the step's slot mapping and block
  tables are built;
* ``decode_step_in_loop_us`` — the same kind of step (a new block for every sequence) taken
  inside a running decode loop rather than right after the batch was built (warm caches);
* ``decode_step_no_new_block_us`` — the steps of that loop that need no new block;
* ``fork_beams_us``  — a 2048-token sequence forked into 4 beams, each then appending one token
  (one batched step for the 4 beams).

Each number is the median over repetitions (the minimum is printed beside it); timings vary with
what else the machine is doing.

Each repetition drops its manager before the next one is built. Dropping it between building
the next batch and timing its step put the release of a few megabytes of arrays right before
the timed step, and every other repetition then took 3-5 times longer: the cost of that memory
churn, not of the step.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np

from ..allocator import BlockAllocator
from ..manager import KVCacheManager

BLOCK_SIZE = 16


def _alloc_free(alloc: BlockAllocator, n: int) -> float:
    allocate, free = alloc.allocate, alloc.free
    t = time.perf_counter()
    for _ in range(n):
        free(allocate())
    return (time.perf_counter() - t) / n * 1e9


def bench_alloc_free(repeat: int) -> list[float]:
    alloc = BlockAllocator(4096, 64, xp=np)
    alloc.allocate_n(100)                     # not a fresh pool
    _alloc_free(alloc, 100_000)               # warm up
    return [_alloc_free(alloc, 200_000) for _ in range(repeat)]


def _decode_batch(num_seqs=1024, seq_len=511):
    blocks = num_seqs * (seq_len // BLOCK_SIZE + 8)
    m = KVCacheManager(BlockAllocator(blocks, BLOCK_SIZE * 2, xp=np), BLOCK_SIZE,
                       max_seqs=num_seqs, max_seq_len=2048)
    for s in range(num_seqs):
        m.add(s, seq_len)
    return m


def bench_decode_step(repeat: int) -> tuple[list[float], list[float], list[float]]:
    """(boundary step right after the batch is built, boundary steps inside a running decode
    loop, steps inside the loop that need no new block), in microseconds."""
    cold, warm, plain = [], [], []
    for _ in range(repeat):
        m = _decode_batch()                   # 511 tokens each
        m.step()                              # token 511 still fits the 32nd block
        t = time.perf_counter()
        plan = m.step()                       # token 512 needs a new block in every sequence
        cold.append((time.perf_counter() - t) * 1e6)
        assert plan.slot_mapping.shape == (1024,) and plan.block_tables.shape == (1024, 33)
        for _ in range(3 * BLOCK_SIZE):       # keep decoding: 3 more block boundaries
            boundary = m.num_tokens(0) % BLOCK_SIZE == 0
            t = time.perf_counter()
            m.step()
            (warm if boundary else plain).append((time.perf_counter() - t) * 1e6)
        del m, plan                           # before the next batch is built: see above
    return cold, warm, plain


def bench_fork_beams(repeat: int) -> list[float]:
    out = []
    beams = ("b0", "b1", "b2", "b3")
    for _ in range(repeat):
        m = KVCacheManager(BlockAllocator(256, BLOCK_SIZE * 2, xp=np), BLOCK_SIZE,
                           max_seq_len=4096)
        m.add("prompt", 2048)
        t = time.perf_counter()
        m.fork("prompt", *beams)
        plan = m.step(beams)
        out.append((time.perf_counter() - t) * 1e6)
        assert plan.block_tables.shape == (4, 129)
        del m, plan
    return out


def run(repeat: int = 7) -> dict:
    af = bench_alloc_free(repeat)
    cold, warm, plain = bench_decode_step(repeat * 3)
    fork = bench_fork_beams(repeat * 20)
    med = statistics.median
    return {
        "alloc_free_ns": round(med(af), 1), "alloc_free_ns_min": round(min(af), 1),
        "decode_step_us": round(med(cold), 1), "decode_step_us_min": round(min(cold), 1),
        "decode_step_in_loop_us": round(med(warm), 1),
        "decode_step_in_loop_us_min": round(min(warm), 1),
        "decode_step_no_new_block_us": round(med(plain), 1),
        "decode_step_no_new_block_us_min": round(min(plain), 1),
        "fork_beams_us": round(med(fork), 1), "fork_beams_us_min": round(min(fork), 1),
        "python": platform.python_version(), "numpy": np.__version__,
        "machine": platform.machine(),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=7, help="repetitions (default 7)")
    p.add_argument("--peers", action="store_true",
                   help="also run the traces through nano-vllm's block manager if importable")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    r = run(args.repeat)
    if args.peers:
        from .peers import nano_vllm
        r.update(nano_vllm(args.repeat))
    if args.json:
        print(json.dumps(r))
        return 0
    rows = [("one block allocated and freed", "alloc_free_ns", "ns"),
            ("decode step, 1024 seqs x 512 tokens (new blocks)", "decode_step_us", "us"),
            ("  the same inside a running decode loop", "decode_step_in_loop_us", "us"),
            ("  a step in that loop that needs no new block", "decode_step_no_new_block_us",
             "us"),
            ("fork 2048 tokens into 4 beams, one token each", "fork_beams_us", "us")]
    print(f"{'operation':<52} {'median':>9} {'min':>9}")
    for label, key, unit in rows:
        lo = r.get(key + "_min")
        print(f"{label:<52} {r[key]:>7.1f}{unit} " + (f"{lo:>7.1f}{unit}" if lo else ""))
    if "nano_vllm_alloc_free_ns" in r:
        print("nano-vllm's block manager, same traces, same process:")
        for label, key, unit in (("one block allocated and freed", "alloc_free_ns", "ns"),
                                 ("decode step (no arrays built)", "decode_step_us", "us"),
                                 ("  the same inside a running decode loop",
                                  "decode_step_in_loop_us", "us")):
            print(f"{label:<52} {r['nano_vllm_' + key]:>7.1f}{unit}")
    elif "nano_vllm" in r:
        print(f"nano-vllm: {r['nano_vllm']}")
    print(f"(Python {r['python']}, NumPy {r['numpy']}, {r['machine']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
