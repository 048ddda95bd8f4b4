"""Benchmarks of the bookkeeping: the traces and timers behind ``python -m pagedkv.bench``, which
the chapter "Making the bookkeeping fast" also measures with. (The GPU kernels have their own:
``python -m pagedkv.bench.kernels``.)

Every trace runs on either implementation, ``"teaching"`` (:mod:`pagedkv.allocator`,
:mod:`pagedkv.manager`) or ``"fast"`` (:mod:`pagedkv.fast`), through their common API. The pool
is a small NumPy array: bookkeeping never touches KV bytes, so its size does not matter here.
"""
from __future__ import annotations

import copy
import cProfile
import functools
import platform
import pstats
import statistics
import time

import numpy as np

from .. import allocator, fast, manager

__all__ = ["BLOCK_SIZE", "IMPLEMENTATIONS", "new_manager", "decode_batch", "copy_manager",
           "time_us", "median_us", "step_times", "bench_alloc_free", "bench_decode_step",
           "bench_fork_beams", "profile_rows", "own_time_by_module", "cpu_name"]

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
    default 511, one step fills every last block and the step after it needs a new block
    for every sequence."""
    m = new_manager(impl, num_seqs * (seq_len // BLOCK_SIZE + 16), max_seqs=num_seqs,
                    max_seq_len=2048)
    for s in range(num_seqs):
        m.add(s, seq_len)
    return m


def copy_manager(m):
    """A copy of manager ``m`` (its allocator and pool too; the array module is shared)."""
    return copy.deepcopy(m, {id(m.allocator.xp): m.allocator.xp})


def time_us(call) -> float:
    """Microseconds one ``call()`` takes."""
    t = time.perf_counter()
    call()
    return (time.perf_counter() - t) * 1e6


def median_us(call, repeat: int = 7, number: int = 1, setup=None) -> float:
    """The median over ``repeat`` rounds of the microseconds per ``call()``, each round
    ``number`` calls; ``setup()``, if given, runs untimed before each round."""
    rounds = []
    for _ in range(repeat):
        if setup is not None:
            setup()
        t = time.perf_counter()
        for _ in range(number):
            call()
        rounds.append((time.perf_counter() - t) * 1e6 / number)
    return statistics.median(rounds)


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


def step_times(batch, repeat: int, step=None) -> list[float]:
    """Microseconds of the step that needs a new block in every sequence of a
    :func:`decode_batch`, on ``repeat`` copies of it. ``step(m)`` takes the step
    (default ``m.step()``)."""
    out = []
    for _ in range(repeat):
        m = copy_manager(batch)
        m.step()                               # token 512: fills every last block
        out.append(time_us(functools.partial(step or type(m).step, m)))  # 513: new blocks
        del m                                  # before the next copy is made
    return out


def bench_decode_step(impl: str, repeat: int, loop_steps: int = 0):
    """Microseconds of the step that needs a new block in every sequence, right after the
    batch is set up (``repeat`` times); with ``loop_steps``, also the steps of a decode loop
    that continues from one more copy: (first steps, loop steps with new blocks, the
    others)."""
    built = decode_batch(impl)
    first = step_times(built, repeat)
    m = copy_manager(built)
    boundary, plain = [], []
    for _ in range(loop_steps):
        new_block = m.num_tokens(0) % BLOCK_SIZE == 0
        (boundary if new_block else plain).append(time_us(m.step))
    return first, boundary, plain


def bench_fork_beams(impl: str, repeat: int) -> list[float]:
    """Microseconds to fork a 2048-token sequence into 4 beams and step the 4 beams once."""
    beams = ("b0", "b1", "b2", "b3")
    built = new_manager(impl, 256, max_seq_len=4096)
    built.add("prompt", 2048)

    def fork_and_step(m):
        m.fork("prompt", *beams)
        m.step(beams)

    # each copy is dropped as soon as its time is taken, before the next one is made
    return [time_us(functools.partial(fork_and_step, copy_manager(built)))
            for _ in range(repeat)]


def profile_rows(call) -> list[tuple[str, str, int, float]]:
    """Run ``call()`` under cProfile: (where, function, calls, own seconds) for each function
    it ran, the largest own time (not counting what the function calls) first. ``where`` is a
    module of pagedkv, "NumPy" (its C methods and its Python) or "Python built-ins". The
    profiler adds its own cost to every call, so these add up to more than a plain timing."""
    profile = cProfile.Profile()
    profile.runcall(call)
    rows = []
    for (file, _, name), (_, calls, own, _, _) in pstats.Stats(profile).stats.items():
        if "pagedkv" in file:
            where = "pagedkv/" + file.replace("\\", "/").split("/pagedkv/", 1)[1]
        elif "numpy" in file or "numpy" in name:
            where = "NumPy"
        else:
            where = "Python built-ins"
        rows.append((where, name, calls, own))
    return sorted(rows, key=lambda row: -row[3])


def own_time_by_module(rows) -> dict:
    """:func:`profile_rows` summed by where the functions live (seconds, largest first)."""
    out: dict = {}
    for where, _, _, own in rows:
        out[where] = out.get(where, 0.0) + own
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def cpu_name() -> str:
    """The processor's model name, for saying where a timing was taken."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
