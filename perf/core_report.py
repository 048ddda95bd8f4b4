"""What the server's engine core costs a step besides the engine's own step.

    python perf/core_report.py [--requests 256] [--steps 300]

:meth:`pagedkv.serve.core.EngineCore.step` steps the engine, then builds the step's report:
each request's new token ids (``_news``), who was admitted, and the counters ``/metrics``
reads. That report is host time the in-process benchmark does not spend, on every step of a
served run. Here the engine is a stub whose step appends one token to each of ``--requests``
one-sequence requests (prompts and outputs of 100-1,024 and 1-800 tokens, seed 0, as far
into nano-vllm's workload as a run gets), so what is timed is the core's own work: the median
``step`` over ``--steps`` steps, and the pickling of one step's message (the process
transport sends it to the server). Prints milliseconds; no GPU needed.
"""
from __future__ import annotations

import argparse
import pathlib
import pickle
import random
import statistics
import sys
import time
from types import SimpleNamespace as NS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pagedkv.config import SamplingParams  # noqa: E402
from pagedkv.model.requests import Request, Sequence  # noqa: E402
from pagedkv.serve import core as core_mod  # noqa: E402


class StubEngine:
    """The parts of an :class:`~pagedkv.model.engine.Engine` the core reads; ``step`` gives
    every request one token."""

    def __init__(self, reqs):
        self.reqs, self.finished = reqs, []
        self.scheduler = NS(waiting=[], running=reqs, swapped=[])
        counts = NS(prompt_tokens=0, cached_tokens=0, drafted=0, accepted=0)
        self.memory = NS(counts=counts, manager=None, swapper=None)

    def step(self):
        for r in self.reqs:
            r.live[0].tokens.append(1)

    def has_work(self):
        return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args(argv)
    rng = random.Random(0)
    reqs = []
    for i in range(args.requests):
        prompt, made = rng.randint(100, 1024), rng.randint(1, 800)
        seq = Sequence(i, list(range(prompt + made)), prompt)
        reqs.append(Request(i, list(range(prompt)), SamplingParams(max_new_tokens=4096), 0,
                            live=[seq]))
    core_mod.pool_counts = lambda manager: {}        # (the stub has no pool)
    core = core_mod.EngineCore(StubEngine(reqs))
    for i, r in enumerate(reqs):
        core.requests[i] = core_mod._Running(r, False)
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        message = core.step()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    for _ in range(100):
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    pickling = (time.perf_counter() - t) / 100
    print(f"{args.requests} requests: EngineCore.step {1e3 * statistics.median(times):.3f} ms "
          f"a step (median of {args.steps}, the stub's own step included); pickling its "
          f"message {1e3 * pickling:.3f} ms ({len(data)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
