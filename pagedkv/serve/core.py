"""The engine's core: the one place that touches the engine, on whichever side of the
transport it runs (a thread of the server's process, or a process of its own).

:class:`EngineCore` submits and cancels requests, each under the key the client gave it,
steps the engine, and after each step reports every request's new token ids and whether
it has ended. It never sees text. :func:`run_core` is its loop: the commands that wait,
then a step while the engine has work; while it is idle, a :class:`~.messages.Beat` at
least every ``beat`` seconds, so that silence means a stuck engine, not an idle one.

A server runs for days, so nothing here may end silently. A command that fails fails
alone; a step that fails fails every request in flight, and the engine is then checked
(:meth:`EngineCore.problem`): with its queues empty and its pool's audit passing it serves
on, otherwise (or when two steps fail in a row) it is dead (:class:`~.messages.Dead`).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from ..errors import ConfigError
from .messages import (Answer, Beat, Cancel, Dead, PoolRead, ReadPool, Stepped, StepFailed,
                       Stop, Stopped, Submit)
from .pool import pool_counts, pool_map, pool_report

__all__ = ["EngineCore", "run_core", "BEAT"]

log = logging.getLogger("pagedkv.serve")
BEAT = 1.0      # seconds between beats of an idle core


@dataclass(eq=False)
class _Running:
    req: object                # the engine's Request
    want_pool: bool
    sent: dict = field(default_factory=dict)   # sequence id -> tokens already reported


class EngineCore:
    """The engine, and the requests in it by key. At most ``max_waiting`` requests wait
    for admission (a submit beyond is refused with 429)."""

    def __init__(self, engine, *, max_waiting: int = 64, pool_interval: float = 0.25):
        self.engine, self.max_waiting, self.pool_interval = engine, max_waiting, pool_interval
        self.requests: dict = {}            # key -> _Running
        self.unadmitted: set = set()        # keys still waiting for admission
        self.totals = dict(requests=0, rejected=0, prompt_tokens=0, generated_tokens=0,
                           steps=0, failed_steps=0, step_seconds=0.0)
        self._failed_in_a_row = 0
        self._pool_sent = 0.0

    def busy(self) -> bool:
        return self.engine.has_work()

    def handle(self, command):
        """One command from the client; its answer, or None."""
        if isinstance(command, Submit):
            return self.submit(command)
        if isinstance(command, Cancel):
            try:
                self.cancel(command.key)
            except Exception:  # noqa: BLE001 (a bug: logged; the next failed step checks)
                log.exception("cancel failed")
                self.requests.pop(command.key, None)
            return None
        if isinstance(command, ReadPool):
            try:
                return PoolRead(command.token, pool_report(self.engine, command.audit))
            except Exception as exc:  # noqa: BLE001 (the reader gets the error)
                log.exception("reading the pool failed")
                return PoolRead(command.token, error=f"{type(exc).__name__}: {exc}")
        raise TypeError(f"the engine's core takes Submit, Cancel, ReadPool or Stop, "
                        f"got {type(command).__name__}")

    def submit(self, s: Submit) -> Answer:
        """The engine's answer to a request: accepted, or refused with a status."""
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_waiting:
            self.totals["rejected"] += 1
            return Answer(s.key, 429, f"{waiting} requests are waiting for the engine "
                                      f"already (at most {self.max_waiting}); try again later")
        try:
            req = self.engine.submit(s.prompt, s.params)
        except ConfigError as exc:      # the engine refused it and is unchanged
            self.totals["rejected"] += 1
            return Answer(s.key, 400, str(exc))
        except Exception as exc:  # noqa: BLE001 (a bug: the request fails, not the loop)
            log.exception("submit failed")
            self.totals["rejected"] += 1
            return Answer(s.key, 500, f"the engine failed to take the request: {exc}")
        self.requests[s.key] = _Running(req, s.want_pool)
        self.unadmitted.add(s.key)
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(s.prompt)
        pool = pool_map(self.engine.memory.manager, self._owners(), s.key) \
            if s.want_pool else None        # the pool as it is before the request runs
        return Answer(s.key, pool=pool)

    def cancel(self, key) -> None:
        """Take the request out of the engine and free its blocks (if it is still there)."""
        r = self.requests.pop(key, None)
        self.unadmitted.discard(key)
        if r is not None:
            self.engine.cancel(r.req)
            self._forget(r.req)

    def stop(self) -> None:
        for key in list(self.requests):
            self.cancel(key)

    def step(self) -> list:
        """One engine step: ``[Stepped]``; or, if it failed, ``[StepFailed]`` with every
        request in it cancelled, and ``Dead`` after it if the engine cannot serve on."""
        t = time.monotonic()
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 (every request in it fails; check the rest)
            log.exception("engine step failed")
            return self._failed(f"the engine failed: {type(exc).__name__}: {exc}")
        self._failed_in_a_row = 0
        now = time.monotonic()
        self.totals["steps"] += 1
        self.totals["step_seconds"] += now - t
        pools = now - self._pool_sent >= self.pool_interval and \
            any(r.want_pool for r in self.requests.values())
        owners = self._owners() if pools else {}
        reports = []
        for key, r in list(self.requests.items()):
            updates = self._news(r)
            pool = pool_map(self.engine.memory.manager, owners, key) if pools and r.want_pool \
                else None
            done = r.req.done
            if done:
                del self.requests[key]
                self._forget(r.req)
            if updates or pool is not None or done:
                reports.append((key, updates, pool, done))
        if pools:
            self._pool_sent = now
        return [Stepped(reports, self._admitted(t), self.stats(), now)]

    def _failed(self, error: str) -> list:
        self.totals["failed_steps"] += 1
        self._failed_in_a_row += 1
        keys = list(self.requests)
        for key in keys:
            try:
                self.cancel(key)
            except Exception:  # noqa: BLE001 (the health check that follows says so)
                log.exception("cancel after a failed step failed")
                self.requests.pop(key, None)
        out = [StepFailed(keys, error, self.stats())]
        problem = self.problem()
        if problem is not None:
            out.append(Dead(f"{problem} (after: {error})"))
        return out

    def _admitted(self, t: float) -> dict:
        """The requests that left the waiting queue in the step that began at ``t``."""
        if not self.unadmitted:
            return {}
        waiting = {id(r) for r in self.engine.scheduler.waiting}
        out = {}
        for key in list(self.unadmitted):
            r = self.requests.get(key)
            if r is None or id(r.req) not in waiting:
                self.unadmitted.discard(key)
                out[key] = t
        return out

    def _news(self, r: _Running) -> list:
        """(sequence id, new token ids, ended) for each sequence with something new, in the
        order of their ids; O(new tokens) a sequence, not a copy of all it generated
        (``perf/core_report.py``: 0.20 against 0.74 ms a step for 256 requests)."""
        req, out, sent, new = r.req, [], r.sent, 0
        if len(req.live) == 1 and not req.finished:    # (most requests: one sequence)
            seqs = ((req.live[0], False),)
        else:
            seqs = sorted([(seq, False) for seq in req.live] +
                          [(seq, True) for seq in req.finished], key=lambda p: p[0].seq_id)
        for seq, ended in seqs:
            seen = sent.get(seq.seq_id, 0)
            if seen < 0:
                continue                        # its end was reported already
            n = len(seq.tokens) - seq.prompt_len
            if n > seen or ended:
                out.append((seq.seq_id, seq.tokens[seq.prompt_len + seen:], ended))
                sent[seq.seq_id] = -1 if ended else n
                new += n - seen
        self.totals["generated_tokens"] += new
        return out

    def problem(self) -> str | None:
        """After a failed step: None if the engine can serve on (its queues empty, its
        pool passing the audit, and not two failures in a row), else what is wrong."""
        mem = self.engine.memory
        try:
            if self.busy():
                return "requests are left in the engine's queues"
            mem.manager.audit()
            if mem.swapper is not None:
                mem.swapper.audit()
            if mem.manager.allocator.num_used:
                return f"{mem.manager.allocator.num_used} blocks are still held"
        except Exception as exc:  # noqa: BLE001 (reported as the reason)
            return f"the pool's audit failed: {type(exc).__name__}: {exc}"
        if self._failed_in_a_row >= 2:
            return "two engine steps failed in a row"
        return None

    def _forget(self, req) -> None:
        finished = self.engine.finished
        for i in range(len(finished) - 1, -1, -1):   # (a server's list would only grow)
            if finished[i] is req:
                del finished[i]

    def _owners(self) -> dict:
        m, owners = self.engine.memory.manager, {}
        for key, r in self.requests.items():
            for seq in r.req.live:
                if seq.seq_id in m:
                    for b in m.block_table(seq.seq_id).tolist():
                        owners.setdefault(b, set()).add(key)
        return owners

    def stats(self) -> dict:
        """The engine's numbers ``/metrics`` shows, from counters: O(1)."""
        e = self.engine
        return dict(pool=pool_counts(e.memory.manager), running=len(e.scheduler.running),
                    waiting=len(e.scheduler.waiting), swapped=len(e.scheduler.swapped),
                    prompt_tokens_prefilled=e.memory.counts.prompt_tokens,
                    prompt_tokens_cached=e.memory.counts.cached_tokens,
                    drafted_tokens=e.memory.counts.drafted,
                    accepted_tokens=e.memory.counts.accepted, **self.totals)


def run_core(core: EngineCore, take, put, beat: float = BEAT) -> bool:
    """The core's loop: ``take(wait)`` gives every command waiting (waiting up to ``wait``
    seconds for the first; None: not at all), ``put`` sends a message up. Steps while
    the engine has work; while it is idle, a beat at least every ``beat`` seconds.
    Returns True after a :class:`~.messages.Stop`, False once the engine is dead."""
    while True:
        commands = take(None if core.busy() else beat)
        for command in commands:
            if isinstance(command, Stop):
                core.stop()
                put(Stopped())
                return True
            answer = core.handle(command)
            if answer is not None:
                put(answer)
        if not core.busy():
            put(Beat(core.stats(), time.monotonic()))
            continue
        for message in core.step():
            put(message)
            if isinstance(message, Dead):
                return False
