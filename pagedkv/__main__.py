"""python -m pagedkv: serve a workload from a paged pool and print its dashboard.

Every token's keys and values are written into the pool and read back through the page
tables before a request leaves; the manager's invariant audit runs as it goes. With
--scale N, the same bookkeeping then serves N chat-like completions without writing K/V,
and the time is printed.

Bad input is reported in one line on stderr, with exit status 2; a run that finds a
corrupted token exits with status 1.
"""
from __future__ import annotations

import argparse
import os
import sys

PROG = "python -m pagedkv"
POOL_BYTES = 32 << 20          # the simulation's pool (simulate's default)
SCALE_POOL_BYTES = 256 << 20   # the --scale run's pool
SCALE_CONCURRENCY = 256


class _Parser(argparse.ArgumentParser):
    def error(self, message):   # one line, not the usage block
        self.exit(2, f"{PROG}: error: {message}\n")


def _int_at_least(low: int, what: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value
    return parse


def _parser() -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    ap = _Parser(prog=PROG, description=doc[0].split(": ", 1)[1] + "\n\n" + doc[1],
                 epilog=doc[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    positive = _int_at_least(1, "a positive integer")
    ap.add_argument("--preset", default="default", choices=("default", "chat", "alpaca"),
                    help="the workload: default (100 short requests), chat (ShareGPT-like "
                         "lengths) or alpaca (Alpaca-like lengths); default: %(default)s")
    ap.add_argument("--seed", type=_int_at_least(0, "a non-negative integer"), default=0,
                    metavar="N", help="seed of the workload's random draws; default: 0")
    ap.add_argument("--block-size", type=positive, default=16, metavar="N",
                    help="tokens per block; default: 16")
    ap.add_argument("--concurrency", type=positive, default=8, metavar="N",
                    help="most requests served at once; default: 8")
    ap.add_argument("--requests", type=positive, default=None, metavar="N",
                    help="how many requests to serve; default: the preset's own count "
                         "(100, 1000, 1000)")
    ap.add_argument("--scale", type=positive, default=None, metavar="N",
                    help="then serve N chat completions, 256 at a time, bookkeeping only, "
                         "and print how long that took")
    ap.add_argument("--bookkeeping", choices=("teaching", "fast"), default="teaching",
                    help="allocator and manager for the --scale run: the teaching core, or "
                         "pagedkv.fast; default: %(default)s")
    return ap


def _available_bytes() -> int:
    """Memory this machine can still give: MemAvailable on Linux, else total physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _check_memory(option: str, n: int, preset: str, max_seqs: int, pool: int) -> str | None:
    """Why ``n`` requests cannot be served in this machine's memory, or None if they can."""
    from .sim.report import memory_needed
    need, have = memory_needed(preset, n, max_seqs, pool), _available_bytes() // 2
    if need <= have:
        return None
    per_request = (memory_needed(preset, 10**6, max_seqs, 0) + 10**6 - 1) // 10**6
    most = max((have - pool) // per_request, 0)
    return (f"{option} {n} would need about {_size(need)} of memory ({per_request} B per "
            f"request, {_size(pool)} pool); half of what is available here is {_size(have)}: "
            f"use at most {most:,}")


def _size(nbytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if nbytes < 1000 or unit == "PB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1000


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    n = args.requests if args.requests is not None else {"default": 100}.get(args.preset, 1000)
    from .errors import PagedKVError
    try:
        from . import backend                     # raises BackendError for a bad choice
        from .sim import check_bookkeeping, dashboard, scale_run, simulate
        if args.scale:
            check_bookkeeping(args.bookkeeping)
    except (PagedKVError, ImportError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for problem in (_check_memory("--requests", n, args.preset, args.concurrency, POOL_BYTES),
                    args.scale and _check_memory("--scale", args.scale, "chat",
                                                 SCALE_CONCURRENCY, SCALE_POOL_BYTES)):
        if problem:
            print(f"{PROG}: error: {problem}", file=sys.stderr)
            return 2
    try:
        print(f"backend: {backend.name} ({backend.reason}); seed {args.seed}")
        run = simulate(args.preset, seed=args.seed, block_size=args.block_size,
                       max_seqs=args.concurrency, n=n, pool_bytes=POOL_BYTES)
        print(dashboard(run))
        if args.scale:
            big = scale_run(args.scale, seed=args.seed, pool_bytes=SCALE_POOL_BYTES,
                            max_seqs=SCALE_CONCURRENCY, bookkeeping=args.bookkeeping)
            print(f"scale: {big.completions} chat completions, {big.tokens_generated} decode "
                  f"tokens, {big.steps} steps, up to {big.peak_running} at once,")
            print(f"  {big.preemptions} preemptions; {args.bookkeeping} bookkeeping only: "
                  f"{big.seconds:.2f} s")
    except (PagedKVError, MemoryError) as exc:
        print(f"{PROG}: error: {str(exc).splitlines()[0] or type(exc).__name__}",
              file=sys.stderr)
        return 2
    return 0 if run.corrupted_tokens == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
