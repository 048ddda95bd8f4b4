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
import copy
import datetime
import json
import platform
import statistics
import sys
import time

import numpy as np

from .. import allocator, fast, manager

BLOCK_SIZE = 16
IMPLEMENTATIONS = {"teaching": (allocator.BlockAllocator, manager.KVCacheManager),
                   "fast": (fast.BlockAllocator, fast.KVCacheManager)}


def new_manager(impl: str, num_blocks: int, **hints):
    """An empty manager of ``impl`` ("teaching" or "fast") over ``num_blocks`` blocks of
    ``BLOCK_SIZE`` tokens; ``hints`` size the fast manager's arrays."""
    alloc_cls, manager_cls = IMPLEMENTATIONS[impl]
    return manager_cls(alloc_cls(num_blocks, BLOCK_SIZE * 2, xp=np), BLOCK_SIZE,
                       **(hints if impl == "fast" else {}))


def decode_batch(impl: str, num_seqs: int = 1024, seq_len: int = 511):
    """The decode trace's batch: ``num_seqs`` sequences of ``seq_len`` tokens. With the
    default 511, one step fills every last block and the step after it needs a new block for
    every sequence."""
    m = new_manager(impl, num_seqs * (seq_len // BLOCK_SIZE + 16), max_seqs=num_seqs,
                    max_seq_len=2048)
    for s in range(num_seqs):
        m.add(s, seq_len)
    return m


def _copy(m):
    """A copy of manager ``m`` (its allocator and pool too; the array module is shared)."""
    return copy.deepcopy(m, {id(m.allocator.xp): m.allocator.xp})


def _timed(call) -> float:
    t = time.perf_counter()
    call()
    return (time.perf_counter() - t) * 1e6


def bench_alloc_free(impl: str, repeat: int, n: int = 200_000) -> list[float]:
    """Nanoseconds per ``free(allocate())`` on a pool that already has blocks in use."""
    alloc = IMPLEMENTATIONS[impl][0](4096, 64, xp=np)
    alloc.allocate_n(100)
    allocate, free = alloc.allocate, alloc.free

    def loop(k):
        t = time.perf_counter()
        for _ in range(k):
            free(allocate())
        return (time.perf_counter() - t) / k * 1e9

    loop(n // 2)                               # warm up
    return [loop(n) for _ in range(repeat)]


def bench_decode_step(impl: str, repeat: int, loop_steps: int = 0):
    """Microseconds of the step that needs a new block in every sequence, right after the
    batch is set up (``repeat`` times); with ``loop_steps``, also the steps of a decode loop
    that continues from the last one: (boundary steps, the others)."""
    built = decode_batch(impl)
    first, boundary, plain = [], [], []
    for r in range(repeat):
        m = _copy(built)
        m.step()                               # token 512: fills every last block
        first.append(_timed(m.step))           # token 513: a new block for every sequence
        for _ in range(loop_steps if r == repeat - 1 else 0):
            new_block = m.num_tokens(0) % BLOCK_SIZE == 0
            (boundary if new_block else plain).append(_timed(m.step))
        del m
    return first, boundary, plain


def bench_fork_beams(impl: str, repeat: int) -> list[float]:
    """Microseconds to fork a 2048-token sequence into 4 beams and step the 4 beams once."""
    beams = ("b0", "b1", "b2", "b3")
    built = new_manager(impl, 256, max_seq_len=4096)
    built.add("prompt", 2048)
    out = []
    for _ in range(repeat):
        m = _copy(built)
        out.append(_timed(lambda: (m.fork("prompt", *beams), m.step(beams))))
        del m
    return out


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
    r.update(python=platform.python_version(), numpy=np.__version__, machine=platform.machine(),
             cpu=_cpu_name(), date=datetime.datetime.now(datetime.timezone.utc)
             .strftime("%Y-%m-%d %H:%M UTC"))
    return r


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


ROWS = [("one block allocated and freed", "alloc_free_ns", "ns"),
        ("decode step, 1024 seqs x 512 tokens (new blocks)", "decode_step_us", "us"),
        ("  the same inside a running decode loop", "decode_step_in_loop_us", "us"),
        ("  a step in that loop that needs no new block", "decode_step_no_new_block_us", "us"),
        ("fork 2048 tokens into 4 beams, one token each", "fork_beams_us", "us")]


def report(r: dict) -> None:
    """The results as a table."""
    print(f"{'operation':<52} {'fast':>10} {'teaching':>10}")
    for label, key, unit in ROWS:
        teach = r.get("teaching_" + key)
        print(f"{label:<52} {r[key]:>8.1f}{unit} " +
              (f"{teach:>8.1f}{unit}" if teach is not None else ""))
    for peer, name in (("nano_vllm", "nano-vllm's block manager"),
                       ("vllm_block_pool", "vLLM's BlockPool")):
        if peer + "_decode_step_us" in r:
            print(f"{name} ({r[peer]}), same traces, same process:")
            print(f"{'  one block allocated and freed':<52} {r[peer + '_alloc_free_ns']:>8.1f}ns")
            print(f"{'  decode step (no arrays built)':<52} {r[peer + '_decode_step_us']:>8.1f}us")
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
        r.update(peers.vllm_block_pool(args.repeat))
    r["command"] = " ".join(["python -m pagedkv.bench", *argv])
    if args.json:
        print(json.dumps(r))
    else:
        report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
