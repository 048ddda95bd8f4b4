"""What the server tests share: waiting (bounded) for an idle pool, reading a metric, a core
that answers at once, a core that answers nothing (the test speaks for it), a job's sink."""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time

import httpx

from pagedkv.config import EngineConfig
from pagedkv.serve.messages import Answer, Ready, Stepped, Submit
from pagedkv.serve.process import get_json

TIMEOUT = 30.0      # seconds any one call may take


def idle(server, deadline: float = 10.0) -> dict:
    """Wait (bounded) until the engine holds nothing; return the pool."""
    end = time.monotonic() + deadline
    while True:
        pool = get_json(server.url + "/pool")
        if pool["used"] == 0 and pool["running"] == pool["waiting"] == pool["sequences"] == 0:
            return pool
        if time.monotonic() > end:
            raise AssertionError(f"the pool did not empty within {deadline} s: {pool}")
        time.sleep(0.05)


def within(seconds: float, what: str, call, *args, **kw):
    """``call(*args, **kw)``'s result, which must come within ``seconds``; else the test
    fails saying what it expected (a fault names itself, rather than a client giving up
    after its own timeout)."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(call, *args, **kw).result(seconds)
    except concurrent.futures.TimeoutError:
        raise AssertionError(f"no answer within {seconds:g} s: expected {what}") from None
    finally:
        pool.shutdown(wait=False)


def metric(server, name: str) -> float:
    """One sample of ``GET /metrics`` by name (a labelled one: its first)."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics:\n{text}")


STATS = dict(pool=dict(total=8, used=0, free=8, cached=0), running=0, waiting=0,
             swapped=0, prompt_tokens_prefilled=0, prompt_tokens_cached=0,
             drafted_tokens=0, accepted_tokens=0, requests=0,
             rejected=0, prompt_tokens=0, generated_tokens=0, steps=0, failed_steps=0,
             step_seconds=0.0)


class Instant:
    """A core on a thread that answers every request at once: its answer is the prompt
    again, one token a step (each step its own message, as a real core sends them)."""

    def start(self, receive):
        self.inbox = queue.SimpleQueue()
        threading.Thread(target=self._run, args=(receive,), daemon=True).start()
        return Ready(EngineConfig(num_blocks=8, stop_ids=(0,)), {}, STATS)

    def _run(self, receive):
        while (m := self.inbox.get()) is not None:
            if not isinstance(m, Submit):
                continue
            receive(Answer(m.key))
            tokens = (m.prompt * m.params.max_new_tokens)[:m.params.max_new_tokens]
            for i, t in enumerate(tokens):
                last = i == len(tokens) - 1
                receive(Stepped([(m.key, [(0, [t], last)], None, last)],
                                {m.key: time.monotonic()} if i == 0 else {}, STATS,
                                time.monotonic()))

    def send(self, m):
        self.inbox.put(m)

    def stop(self, timeout=1.0):
        self.inbox.put(None)


class Silent:
    """A transport whose core takes everything and answers nothing (a stalled engine);
    the test speaks for the core through ``receive``."""

    def __init__(self):
        self.sent, self.receive = [], None

    def start(self, receive):
        self.receive = receive
        return Ready(EngineConfig(num_blocks=8, stop_ids=(0,)), {}, {"rejected": 0})

    def send(self, message):
        self.sent.append(message)

    def stop(self, timeout=1.0):
        pass


class Events:
    def __init__(self):
        self.events, self.got = [], threading.Event()

    def __call__(self, events):
        self.events += events
        self.got.set()
