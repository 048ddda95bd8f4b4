"""The engine's one client: what the HTTP layer calls, over either transport.

:meth:`EngineClient.submit`, :meth:`~EngineClient.cancel` and :meth:`~EngineClient.pool`
are called on the event loop and never wait: they put a message in the transport's queue
(:mod:`.transport`). Everything the core sends comes back through
:meth:`~EngineClient.receive`, on the transport's thread, where the text half
(:class:`~.texts.Texts`) turns token ids into each job's events.

A server runs for days, so it must notice an engine that stops answering as well as one
that fails. Every message from the core is progress (a step, or an idle core's beat); a
watchdog thread measures the silence since the last one, and past ``stall_timeout``
seconds the engine is *stalled*: ``GET /health`` says 503 with the reason, every request
in flight gets a 503 error (its cancel is queued, for an engine that comes back), and new
ones are refused at once, until the core speaks again. An engine that dies (its process
killed, or a step failed and its pool no longer passes the audit) makes the client dead:
every request in flight gets a 503, every later submit too, and ``on_dead`` is called.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from concurrent.futures import Future

from .messages import (Answer, Beat, Cancel, Dead, PoolRead, ReadPool, Stepped, StepFailed,
                       Stop, Stopped, Submit)
from .texts import Accepted, Done, Failed, Job, PoolMap, Rejected, Texts, timings

__all__ = ["EngineClient"]

log = logging.getLogger("pagedkv.serve")
WATCH_EVERY = 0.1       # seconds between the watchdog's looks


class EngineClient:
    """The engine behind ``transport``; ``tokenizer`` turns its tokens into text. At
    most ``max_waiting`` submits wait for the engine's answer (503 beyond, with the
    engine's own 429 for requests waiting for admission)."""

    def __init__(self, transport, tokenizer, *, max_waiting: int = 64,
                 stall_timeout: float = 30.0, stream_interval: int = 1, on_dead=None):
        self.transport, self.tokenizer = transport, tokenizer
        self.max_waiting, self.stall_timeout = max_waiting, stall_timeout
        self.stream_interval, self.on_dead = stream_interval, on_dead
        self.lock = threading.Lock()
        self.jobs: dict = {}            # key -> Job: submitted, not ended
        self.unanswered = 0             # of them, the ones the engine has not answered
        self.pools: dict = {}           # token -> Future of a pool report
        self.totals = dict(cancelled=0, failed=0, finished=0, refused=0)
        self.dead: str | None = None    # why the engine cannot serve any more
        self.stopping = False
        self.config = self.info = None  # the engine's EngineConfig, once started
        self.core_stats: dict = {}
        self.heard = self.stepped = time.monotonic()   # the core's last message, step
        self._stalled = False
        self._keys, self._tokens = itertools.count(), itertools.count()
        self._handlers = {Answer: self._answer, Stepped: self._steps, Beat: self._beat,
                          PoolRead: self._pool_read, StepFailed: self._step_failed,
                          Dead: self._dead, Stopped: lambda m: None}
        self._ended = threading.Event()

    def start(self, **kw) -> "EngineClient":
        """Start the transport (bounded: it raises if the engine does not come up)."""
        ready = self.transport.start(self.receive, **kw)
        self.config, self.info, self.core_stats = ready.config, ready.info, ready.stats
        self.texts = Texts(self.tokenizer, ready.config.stop_ids, self.stream_interval)
        self.heard = self.stepped = time.monotonic()
        threading.Thread(target=self._watch, name="pagedkv-watchdog", daemon=True).start()
        return self

    # ------------------------------------------------------------ the event loop's calls
    def submit(self, job: Job) -> Rejected | None:
        """Send ``job`` to the engine (its answer comes as an event); or, at once, why
        not: the engine is dead, stalled or stopping, or too many wait for its answer."""
        with self.lock:
            problem = self.health()
            if problem is None and self.unanswered >= self.max_waiting:
                problem = (f"{self.unanswered} requests are waiting for the engine to "
                           f"answer already (at most {self.max_waiting}: --max-waiting)")
            if problem is not None:
                self.totals["refused"] += 1
                return Rejected(503, problem)
            job.key = next(self._keys)
            self.jobs[job.key] = job
            self.unanswered += 1
            self.transport.send(Submit(job.key, job.prompt, job.params, job.want_pool))
        return None

    def cancel(self, job: Job) -> None:
        """The client went away: the request leaves the engine, its blocks go back."""
        with self.lock:
            if self.jobs.pop(job.key, None) is not None:
                self.unanswered -= not job.accepted
                self.totals["cancelled"] += 1
                self.transport.send(Cancel(job.key))

    def pool(self, audit: bool = False) -> Future:
        """The pool's report (:func:`~.pool.pool_report`), made where the engine runs."""
        fut: Future = Future()
        with self.lock:
            problem = self.health()
            if problem is not None:
                fut.set_exception(RuntimeError(problem))
                return fut
            token = next(self._tokens)
            self.pools[token] = fut
            self.transport.send(ReadPool(token, audit))
        return fut

    def health(self) -> str | None:
        """None while the engine serves; else why not (dead, stopping, or stalled)."""
        if self.dead is not None:
            return f"the engine is not running: {self.dead}"
        if self.stopping:
            return "the server is shutting down"
        silent = time.monotonic() - self.heard
        if silent > self.stall_timeout:
            return (f"the engine has made no progress for {silent:.1f} s "
                    f"(--stall-timeout {self.stall_timeout:g})")
        return None

    @property
    def stats(self) -> dict:
        now = time.monotonic()
        s = dict(self.core_stats, **self.totals, dead=self.dead is not None,
                 stalled=now - self.heard > self.stall_timeout, heard_age=now - self.heard,
                 step_age=now - self.stepped)
        s["rejected"] = self.core_stats.get("rejected", 0) + self.totals["refused"]
        return s

    def request_stop(self) -> None:
        """Every request ends now (503: shutting down) and the core is asked to stop;
        returns at once (uvicorn calls it on the event loop when a signal comes)."""
        with self.lock:
            if self.stopping:
                return
            self.stopping = True
            self._end_all(503, "the server is shutting down")
            self.transport.send(Stop())

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the engine: bounded by ``timeout`` seconds (then a child is killed)."""
        self.request_stop()
        self._ended.set()
        self.transport.stop(timeout)

    # ------------------------------------------------------------ the transport's thread
    def receive(self, message) -> None:
        """One message from the core (on the transport's thread)."""
        with self.lock:
            self.heard = time.monotonic()
            if self._stalled:
                self._stalled = False
                log.warning("the engine is making progress again")
            self._handlers[type(message)](message)

    def _answer(self, a: Answer) -> None:
        job = self.jobs.get(a.key)
        if job is None:
            return                          # gone already; its cancel follows this answer
        self.unanswered -= 1
        if a.status != 200:
            del self.jobs[a.key]
            job.emit([Rejected(a.status, a.message)])
            return
        job.accepted = True
        job.emit([Accepted(a.pool)] + ([PoolMap(a.pool)] if a.pool is not None else []))

    def _steps(self, s: Stepped) -> None:
        self.core_stats, self.stepped = s.stats, self.heard
        for key, t in s.admitted.items():
            job = self.jobs.get(key)
            if job is not None:
                job.admitted = t
        for key, updates, pool, done in s.reports:
            job = self.jobs.get(key)
            if job is not None:
                self._report(job, updates, pool, done)

    def _report(self, job: Job, updates, pool, done: bool) -> None:
        """A job's news from one step, as one list of events."""
        events = [PoolMap(pool)] if pool is not None else []
        try:
            if any(tokens for _, tokens, _ in updates):
                job.first = job.first or self.heard
                job.last = self.heard
            if self.texts.advance(job, updates, events):
                del self.jobs[job.key]
                if not done:                # ended by a stop string: stop it too
                    self.transport.send(Cancel(job.key))
                self.totals["finished"] += 1
                events.append(Done(Texts.usage(job), timings(job, self.heard)))
        except Exception as exc:  # noqa: BLE001 (this job fails, the others go on)
            log.exception("request %s failed", job.key)
            self.jobs.pop(job.key, None)
            self.transport.send(Cancel(job.key))
            self.totals["failed"] += 1
            events.append(Failed(500, f"the server failed on this request: {exc}"))
        job.emit(events)

    def _beat(self, b: Beat) -> None:
        self.core_stats = b.stats

    def _pool_read(self, p: PoolRead) -> None:
        fut = self.pools.pop(p.token, None)
        if fut is None:
            return
        if p.error is None:
            fut.set_result(p.report)
        else:
            fut.set_exception(RuntimeError(p.error))

    def _step_failed(self, f: StepFailed) -> None:
        self.core_stats = f.stats or self.core_stats
        for key in f.keys:
            job = self.jobs.pop(key, None)
            if job is not None:
                self.totals["failed"] += 1
                job.emit([Failed(500, f.error)])

    def _dead(self, d: Dead) -> None:
        if self.dead is not None:
            return
        log.error("the engine is dead: %s", d.reason)
        self.dead = d.reason
        self._end_all(503, f"the engine is not running: {d.reason}")
        if self.on_dead is not None:
            try:
                self.on_dead(d.reason)
            except Exception:  # noqa: BLE001
                log.exception("on_dead failed")

    def _end_all(self, status: int, message: str, cancel: bool = False) -> None:
        """Every job ends with ``message`` (a refusal for one not answered yet, an error
        for one running; counted as failed unless the server stops), and every pool read;
        ``cancel``: their requests leave the engine too (when it comes back)."""
        for key, job in list(self.jobs.items()):
            if cancel:
                self.transport.send(Cancel(key))
            self.totals["failed"] += job.accepted and not self.stopping
            job.emit([Failed(status, message) if job.accepted else Rejected(status, message)])
        self.jobs.clear()
        self.unanswered = 0
        for token in list(self.pools):
            self.pools.pop(token).set_exception(RuntimeError(message))

    # ------------------------------------------------------------ the watchdog's thread
    def _watch(self) -> None:
        """Every WATCH_EVERY seconds: has the core been silent past ``stall_timeout``?"""
        while not self._ended.wait(WATCH_EVERY):
            with self.lock:
                problem = None if self.dead or self.stopping else self.health()
                if problem is None or (self._stalled and not self.jobs and not self.pools):
                    continue
                if not self._stalled:
                    log.error("%s: %d requests in flight fail", problem, len(self.jobs))
                self._stalled = True
                self._end_all(503, problem, cancel=True)
