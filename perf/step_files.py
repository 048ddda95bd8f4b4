"""Which files of ``pagedkv/`` one decode step of the engine enters, counted, not traced by hand.

    python perf/step_files.py [--runner fast|plain]

Four requests on the tiny random model (``tests/_tiny.py``) are prefilled and decode for a
few steps; then one more ``Engine.step()`` runs under ``sys.setprofile``, which sees every
Python call. Prints each file of the package the step called into (in first-call order,
with its number of calls), how many times the step moved from one file to another, and the
same count without the kernels' wrappers (``kernels/``) and the small helpers
(``backend.py``, ``checks.py``). ``--runner fast`` (the default) is the engine a GPU runs,
with the fast bookkeeping and the overlapped loop, here on NumPy; ``plain`` is the teaching
path. No GPU needed.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from _tiny import tiny_llama  # noqa: E402

from pagedkv.config import SamplingParams  # noqa: E402
from pagedkv.model.engine import Engine  # noqa: E402

HELPERS = ("kernels/", "backend.py", "checks.py")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runner", choices=("fast", "plain"), default="fast")
    args = p.parse_args(argv)
    fast = args.runner == "fast"
    engine = Engine(tiny_llama(0), num_blocks=64, block_size=16, runner=args.runner,
                    bookkeeping="fast" if fast else "teaching", overlap=fast,
                    max_context=256 if fast else None)
    for i in range(4):
        engine.submit([1 + i, 2, 3, 4, 5], SamplingParams(max_new_tokens=20))
    for _ in range(3):                                  # the prefill, then decodes
        engine.step()
    calls: dict = {}
    moves, last = [0], [None]

    def profile(frame, event, arg):
        if event != "call" or "/pagedkv/" not in frame.f_code.co_filename:
            return
        name = frame.f_code.co_filename.split("/pagedkv/", 1)[1]
        calls[name] = calls.get(name, 0) + 1
        if name != last[0]:
            moves[0] += 1
            last[0] = name

    sys.setprofile(profile)
    engine.step()
    sys.setprofile(None)
    core = [f for f in calls if not f.startswith(HELPERS)]
    print(f"runner {args.runner!r}: one decode step called into {len(calls)} files of "
          f"pagedkv/, moving between files {moves[0]} times")
    for f, n in calls.items():
        print(f"  {f:24} {n:5} calls{'' if f in core else '   (kernel or helper)'}")
    print(f"without kernels/ and the helpers: {len(core)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
