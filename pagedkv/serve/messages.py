"""What the engine's client and its core say to each other: one class a kind of message.

The same messages cross a thread's queue (``--engine thread``) or a pipe to the engine's
process (``--engine process``, pickled); the client (:mod:`.client`) and the core
(:mod:`.core`) do not know which. Down, from the client: :class:`Submit`, :class:`Cancel`,
:class:`ReadPool`, :class:`Stop`. Up, from the core: :class:`Ready` once, then
:class:`Answer` (a submit accepted or refused), :class:`Stepped` after every step,
:class:`Beat` while the engine is idle, :class:`PoolRead`, :class:`StepFailed`,
:class:`Dead` and :class:`Stopped`. Every message from the core is progress: the
client's watchdog measures the engine's silence from the last one.

A step's news for each request is a plain tuple ``(key, updates, pool map or None,
done)``, each update ``(sequence id, new token ids, ended)``: at 256 requests a step,
pickling and unpickling them as tuples took 0.17 ms, as a dataclass each 1.4 ms (this
machine's CPU, 2026-12-07), a cost the engine's process would pay every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import EngineConfig, SamplingParams

__all__ = ["Submit", "Cancel", "ReadPool", "Stop", "Ready", "Answer", "Stepped", "Beat",
           "PoolRead", "StepFailed", "Dead", "Stopped", "merged"]


# ---------------------------------------------------------------------- down: commands
@dataclass(frozen=True)
class Submit:
    key: int                   # the client's name for the request, from now on
    prompt: list
    params: SamplingParams
    want_pool: bool = False    # block maps seen from this request (the chat page)


@dataclass(frozen=True)
class Cancel:
    key: int                   # the request leaves the engine, its blocks go back


@dataclass(frozen=True)
class ReadPool:
    token: int                 # names the answer (a PoolRead)
    audit: bool = False        # run the manager's audit too (O(blocks))


@dataclass(frozen=True)
class Stop:
    """Cancel every request and end."""


# ---------------------------------------------------------------------- up: news
@dataclass(frozen=True)
class Ready:
    config: EngineConfig       # the engine as it was made (the machine's choices resolved)
    info: dict                 # what else was chosen: CUDA graphs captured, seconds
    stats: dict


@dataclass(frozen=True)
class Answer:
    """The engine's answer to a :class:`Submit`: accepted (``status`` 200) or refused."""
    key: int
    status: int = 200          # 400: the engine refuses it; 429: too many waiting
    message: str = ""
    pool: str | None = None    # the block map before it runs, if it asked for maps


@dataclass(frozen=True)
class Stepped:
    """After a step: the news of every request that has some (the tuples above), the
    requests admitted in it (key -> the time, ``time.monotonic()``), the core's numbers."""
    reports: list
    admitted: dict
    stats: dict
    at: float                  # time.monotonic() after the step (system-wide on Linux)


@dataclass(frozen=True)
class Beat:
    """The core is idle and alive."""
    stats: dict
    at: float


@dataclass(frozen=True)
class PoolRead:
    token: int
    report: dict | None = None
    error: str | None = None


@dataclass(frozen=True)
class StepFailed:
    """A step raised: every request in it is cancelled and gets ``error``."""
    keys: list
    error: str
    stats: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Dead:
    """The engine cannot serve any more (after a failed step, or its process ended)."""
    reason: str


@dataclass(frozen=True)
class Stopped:
    """The core ended, as asked."""


def merged(messages: list) -> list:
    """``messages`` in order, each run of consecutive :class:`Stepped` as one: what a reader
    that fell behind the core hands on at once. Per request, each sequence's new tokens
    are joined (ended if it ended in the last of them), the newest pool map is kept, and
    the request is done if it ended in any of them; the admissions are joined (each at
    its first time), the numbers are the last step's. The client then decodes a request's
    news once for several steps, not once a step; other messages keep their place."""
    out: list = []
    run: list = []
    for m in [*messages, None]:
        if isinstance(m, Stepped):
            run.append(m)
            continue
        if run:
            out.append(run[0] if len(run) == 1 else _joined(run))
            run = []
        if m is not None:
            out.append(m)
    return out


def _joined(steps: list) -> Stepped:
    news: dict = {}                     # key -> [{sequence id: [tokens, ended]}, pool, done]
    for step in steps:
        for key, updates, pool, done in step.reports:
            n = news.get(key)
            if n is None:
                news[key] = [{sid: [list(t), e] for sid, t, e in updates}, pool, done]
                continue
            seqs = n[0]
            for sid, tokens, ended in updates:
                have = seqs.get(sid)
                if have is None:
                    seqs[sid] = [list(tokens), ended]
                else:
                    have[0].extend(tokens)
                    have[1] = ended
            if pool is not None:
                n[1] = pool
            n[2] = n[2] or done
    admitted: dict = {}
    for step in reversed(steps):        # the earliest time wins
        admitted.update(step.admitted)
    reports = [(key, [(sid, t, e) for sid, (t, e) in seqs.items()], pool, done)
               for key, (seqs, pool, done) in news.items()]
    return Stepped(reports, admitted, steps[-1].stats, steps[-1].at)
