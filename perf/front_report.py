"""What the server's front costs a step: the engine's report of one step turned into events.

    python perf/front_report.py [--streams 256] [--steps 200] [--interval 1] [--profile]

The HTTP process receives each step's :class:`~pagedkv.serve.messages.Stepped` on the
transport's thread; :class:`~pagedkv.serve.client.EngineClient` decodes every stream's new
token to text (:class:`~pagedkv.serve.texts.Texts`, SmolLM2's tokenizer) and hands each job
its events. Here ``--streams`` streaming jobs get one token a step for ``--steps`` steps
(token ids drawn with seed 0), with a transport that sends nothing and jobs whose events go
to a list: the median milliseconds of ``receive`` a step, without the event loop's own work
(writing the chunks). ``--profile`` prints where the time went. No GPU needed.
"""
from __future__ import annotations

import argparse
import cProfile
import pathlib
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pagedkv.config import SamplingParams  # noqa: E402
from pagedkv.model import Tokenizer, load_gguf  # noqa: E402
from pagedkv.serve.client import EngineClient  # noqa: E402
from pagedkv.serve.messages import Stepped  # noqa: E402
from pagedkv.serve.texts import Job, Texts  # noqa: E402


class Silent:
    def send(self, message) -> None:
        pass


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--profile", action="store_true")
    args = p.parse_args(argv)
    tok = Tokenizer.from_checkpoint(load_gguf(None))
    client = EngineClient(Silent(), tok)
    client.texts = Texts(tok, (tok.eos_id,), args.interval)
    sink: list = []
    for k in range(args.streams):
        job = Job(prompt=[1] * 100, emit=sink.append,
                  params=SamplingParams(max_new_tokens=10**6, ignore_eos=True))
        job.key, job.accepted = k, True
        client.jobs[k] = job
    rng = random.Random(0)
    ids = [rng.randrange(200, 40_000) for _ in range(4096)]

    def step(n: int) -> Stepped:
        reports = [(k, [(k, [ids[(n * 7 + k) % len(ids)]], False)], None, False)
                   for k in range(args.streams)]
        return Stepped(reports, {}, {}, time.monotonic())

    times = []
    for n in range(args.steps):
        message = step(n)
        t = time.perf_counter()
        client.receive(message)
        times.append(time.perf_counter() - t)
        sink.clear()
    print(f"{args.streams} streams, interval {args.interval}: EngineClient.receive "
          f"{1e3 * statistics.median(times):.3f} ms a step (median of {args.steps})")
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        for n in range(args.steps):
            client.receive(step(n))
            sink.clear()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)
    return 0


if __name__ == "__main__":
    sys.exit(main())
