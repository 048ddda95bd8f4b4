"""``python -m pagedkv``: run the default simulation and print its dashboard.

``python -m pagedkv --scale 10000`` also times that many ``chat`` completions, bookkeeping only.
"""
from __future__ import annotations

import argparse
import sys

from . import backend
from .errors import PagedKVError
from .sim import PRESETS, dashboard, scale_run, simulate


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pagedkv", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="default", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8, help="sequences served at once")
    ap.add_argument("--requests", type=int, default=None, help="completions (preset's default)")
    ap.add_argument("--scale", type=int, default=0, metavar="N",
                    help="also time N chat completions, bookkeeping only")
    args = ap.parse_args(argv)
    try:
        print(f"backend: {backend.name} ({backend.reason}); seed {args.seed}")
        run = simulate(args.preset, seed=args.seed, block_size=args.block_size,
                       max_seqs=args.concurrency, n=args.requests)
        print(dashboard(run))
        if args.scale:
            big = scale_run(args.scale, seed=args.seed)
            print(f"scale: {big.completions} chat completions ({big.tokens_generated} decode "
                  f"tokens, {big.steps} steps, up to {big.peak_running} at once, "
                  f"{big.preemptions} preemptions), bookkeeping only, in {big.seconds:.2f} s")
    except PagedKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0 if run.corrupted_tokens == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
