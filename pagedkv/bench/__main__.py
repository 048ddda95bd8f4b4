"""Bookkeeping benchmarks: ``python -m pagedkv.bench [--json] [--repeat N] [--peers]``.

Times the bookkeeping's hot paths on the CPU, for the fast path (:mod:`pagedkv.fast`) and the
teaching core (:mod:`pagedkv.allocator`, :mod:`pagedkv.manager`) on the same traces. The pool
is a small NumPy array: bookkeeping never touches KV bytes, so its size does not matter here.

* ``alloc_free_ns`` -- one block allocated and freed (``free(allocate())`` in a loop);
* ``decode_step_us`` -- 1024 sequences of 512 tokens each take one token: every sequence needs
  a new block (512 is a multiple of the block size 16), and the step's slot mapping and block
  tables are built;
* ``decode_step_in_loop_us`` -- the same kind of step (a new block for every sequence) inside a
  running decode loop rather than right after the batch was set up;
* ``decode_step_no_new_block_us`` -- the steps of that loop that need no new block;
* ``fork_beams_us`` -- a 2048-token sequence forked into 4 beams, each then taking one token
  (one step over the 4 beams);
* ``prefix_hit_us`` -- a 2048-token prompt whose 128 blocks are cached and idle admitted in a
  pool of 65,536 blocks, hashing included (and ``prefix_hit_list_us``, the prompt a list of
  Python ints rather than an array; see :mod:`pagedkv.bench.prefix`);
* ``teaching_*`` -- the same traces on the teaching core.

With ``--peers``, the same traces through nano-vllm's block manager and vLLM's ``BlockPool``
when their sources are importable (see :mod:`pagedkv.bench.peers`), in the same process.

Each number is the median over repetitions (the minimum is reported beside it); timings vary
with what else the machine is doing. Each repetition's batch is a copy of one batch built once
(building 1024 sequences on the teaching core takes about a second), and is dropped before the
next copy is made: dropping a manager right before a timed step put the release of megabytes
of arrays into the timing.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys

import numpy as np

from . import BLOCK_SIZE, bench_alloc_free, bench_decode_step, bench_fork_beams, cpu_name
from . import prefix


def run(repeat: int = 7) -> dict:
    """Every benchmark: medians and minima, with what ran them."""
    r: dict = {}

    def put(key, values):
        r[key] = round(statistics.median(values), 1)
        r[key + "_min"] = round(min(values), 1)

    put("alloc_free_ns", bench_alloc_free("fast", repeat))
    put("teaching_alloc_free_ns", bench_alloc_free("teaching", repeat))
    first, boundary, plain = bench_decode_step("fast", 3 * repeat, loop_steps=8 * BLOCK_SIZE)
    put("decode_step_us", first)
    put("decode_step_in_loop_us", boundary)
    put("decode_step_no_new_block_us", plain)
    put("teaching_decode_step_us", bench_decode_step("teaching", repeat)[0])
    put("fork_beams_us", bench_fork_beams("fast", 20 * repeat))
    put("teaching_fork_beams_us", bench_fork_beams("teaching", 20 * repeat))
    put("prefix_hit_us", prefix.prefix_hit(50 * repeat, "fast", as_array=True))
    put("prefix_hit_list_us", prefix.prefix_hit(50 * repeat, "fast"))
    put("teaching_prefix_hit_us", prefix.prefix_hit(20 * repeat))
    r.update(python=platform.python_version(), numpy=np.__version__, machine=platform.machine(),
             cpu=cpu_name(), date=datetime.datetime.now(datetime.timezone.utc)
             .strftime("%Y-%m-%d %H:%M UTC"))
    return r


ROWS = [("one block allocated and freed", "alloc_free_ns", "ns"),
        ("decode step, 1024 seqs x 512 tokens (new blocks)", "decode_step_us", "us"),
        ("  the same inside a running decode loop", "decode_step_in_loop_us", "us"),
        ("  a step in that loop that needs no new block", "decode_step_no_new_block_us", "us"),
        ("fork 2048 tokens into 4 beams, one token each", "fork_beams_us", "us"),
        ("admit a cached 2048-token prompt, an array", "prefix_hit_us", "us"),
        ("  the same, the prompt a list of ints", "prefix_hit_list_us", "us")]
#: The teaching core's number beside a row, where its key is not ``teaching_`` + the row's.
TEACHING = {"prefix_hit_us": None, "prefix_hit_list_us": "teaching_prefix_hit_us"}


def report(r: dict) -> None:
    """The results as a table."""
    print(f"{'operation':<52} {'fast':>10} {'teaching':>10}")
    for label, key, unit in ROWS:
        teach = r.get(TEACHING.get(key, "teaching_" + key))
        print(f"{label:<52} {r[key]:>8.1f}{unit} " +
              (f"{teach:>8.1f}{unit}" if teach is not None else ""))
    for peer, name in (("nano_vllm", "nano-vllm's block manager"),
                       ("vllm_block_pool", "vLLM's BlockPool")):
        if peer + "_decode_step_us" in r:
            print(f"{name} ({r[peer]}), same traces, same process:")
            print(f"{'  one block allocated and freed':<52} {r[peer + '_alloc_free_ns']:>8.1f}ns")
            print(f"{'  decode step (no arrays built)':<52} {r[peer + '_decode_step_us']:>8.1f}us")
            if peer + "_prefix_hit_us" in r:
                print(f"{'  admit a cached 2048-token prompt (list)':<52} "
                      f"{r[peer + '_prefix_hit_us']:>8.1f}us")
        elif peer in r:
            print(f"{name}: {r[peer]}")
    print(f"(Python {r['python']}, NumPy {r['numpy']}, {r['cpu']}, {r['date']})")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench",
                                description="Time the bookkeeping (fast path and teaching core).")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=7, help="repetitions (default 7)")
    p.add_argument("--peers", action="store_true",
                   help="also run the traces through nano-vllm and vLLM if their sources are "
                        "importable (see pagedkv/bench/peers.py)")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    r = run(args.repeat)
    if args.peers:
        from . import peers
        r.update(peers.nano_vllm(args.repeat))
        if "nano_vllm_decode_step_us" in r:
            try:
                hits = prefix.nano_vllm_prefix_hit(args.repeat)
                r["nano_vllm_prefix_hit_us"] = round(statistics.median(hits), 1)
                r["nano_vllm_prefix_hit_us_min"] = round(min(hits), 1)
            except Exception as exc:          # a stand-in without the cache's calls
                r["nano_vllm_prefix_hit"] = f"not run ({type(exc).__name__}: {exc})"
        r.update(peers.vllm_block_pool(args.repeat))
    r["command"] = " ".join(["python -m pagedkv.bench", *argv])
    if args.json:
        print(json.dumps(r))
    else:
        report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
