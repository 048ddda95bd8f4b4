"""The engine loop: one thread owns the engine; everything else talks to it through a queue.

The HTTP layer puts commands in :attr:`EngineLoop.inbox` (submit a job, cancel one, read
the pool) and gets events back through each job's ``emit`` callback. Between commands the
thread steps the engine while it has work. Two halves do the work, so that they can also
live in two processes (:mod:`.engine_process`):

* :class:`EngineCore` touches the engine: it submits and cancels requests (each under a
  key), steps, and reports after each step every sequence's new token ids and whether it
  has ended. It never sees text.
* :class:`Texts` turns those token ids into text, one token at a time (never the whole
  answer again), cuts an answer at a stop string, and makes the events a client sees.

A server runs for days, so nothing here may end silently. A command or a job that fails
fails alone (its request gets an error); a step that fails fails every request in flight,
and the engine is then checked: with its queues empty and its pool's audit passing it
serves on, otherwise (or when two steps fail in a row) the loop is *dead*: ``dead`` says
why, every job and every later submit gets an error, and ``on_dead`` is called once (the
server exits then, non-zero, for a supervisor to restart it).

Events, as dicts with a ``"type"``:

* ``accepted`` / ``rejected`` (``status``, ``message``, ``param``): the answer to a submit;
* ``delta`` (``index``, ``text``, ``finish_reason``): new text of one choice (a job that
  does not stream gets one per choice, when it ends);
* ``pool`` (``pool``): the block map seen from the job (at most every ``pool_interval``
  seconds while it runs);
* ``error`` (``message``): the request failed;
* ``done`` (``usage``): every choice has ended, the request's blocks are back.
"""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["Job", "EngineCore", "Texts", "EngineLoop", "pool_map", "pool_counts",
           "pool_report", "FREE", "CACHED", "MINE", "SHARED", "OTHERS", "USED"]

log = logging.getLogger("pagedkv.serve")

# one character a block in a pool map
FREE, CACHED, MINE, SHARED, OTHERS, USED = ".", "c", "m", "s", "o", "u"


@dataclass
class Choice:
    """One sequence's answer as the client sees it."""
    index: int
    decoder: object            # the tokenizer's incremental decoder
    text: str = ""             # the text decoded so far (cut at a stop string)
    sent: int = 0              # characters of it already sent
    tokens: int = 0            # tokens this choice generated (its usage)
    finish_reason: str | None = None


@dataclass(eq=False)        # a job is itself: hashable, compared by identity
class Job:
    """One HTTP request's work: what to run and where its events go."""
    prompt: list
    params: object             # a SamplingParams
    emit: object               # called with each event (from the loop's thread)
    stop: tuple = ()           # stop strings
    want_pool: bool = False    # send block maps (the chat page asks for them)
    stream: bool = True        # deltas as they come (else one per choice, at its end)
    key: int | None = None     # its request's key in the engine core, once accepted
    choices: dict = field(default_factory=dict)   # sequence id -> Choice


# ---------------------------------------------------------------------- the pool

def pool_map(manager, owners: dict, me=None) -> str:
    """The pool as a string, one character a block: free, cached idle (the prefix cache
    keeps it, nobody maps it), and for a block somebody maps: with ``me``, mine alone,
    shared (mine and another sequence's) or others'; without, used or shared. ``owners``
    maps a block to the set of requests whose sequences map it. O(blocks)."""
    alloc = manager.allocator
    refs = alloc.refcounts().tolist()
    idle = alloc.is_idle
    out = []
    for b, r in enumerate(refs):
        if r == 0:
            out.append(CACHED if idle(b) else FREE)
        elif me is None:
            out.append(SHARED if r > 1 else USED)
        elif me in owners.get(b, ()):
            out.append(SHARED if r > 1 else MINE)
        else:
            out.append(OTHERS)
    return "".join(out)


def pool_counts(manager) -> dict:
    """Blocks in use, free and cached idle, from the allocator's counters (O(1); cached
    idle blocks count as free to the allocator: they are handed out when the free list is
    empty)."""
    alloc = manager.allocator
    total, free, cached = alloc.num_blocks, alloc.num_free, alloc.num_idle
    return {"total": total, "used": total - free, "free": free - cached, "cached": cached}


def pool_report(engine, audit: bool) -> dict:
    """What ``GET /pool`` shows: the map, the counts, the queues, and the manager's audit
    if ``audit`` (O(blocks) either way: ask rarely)."""
    m = engine.memory.manager
    answer = "not run (start the server with --audit)"
    if audit:
        try:
            m.audit()
            answer = "ok"
        except Exception as exc:  # noqa: BLE001 (reported, not raised)
            answer = f"{type(exc).__name__}: {exc}"
    return dict(blocks=pool_map(m, {}), audit=answer, **pool_counts(m),
                block_size=engine.config.block_size, running=len(engine.scheduler.running),
                waiting=len(engine.scheduler.waiting), sequences=len(m.seq_ids))


# ---------------------------------------------------------------------- the engine's half

@dataclass(eq=False)
class _Running:
    req: object                # the engine's Request
    want_pool: bool
    sent: dict = field(default_factory=dict)   # sequence id -> tokens already reported


class EngineCore:
    """The engine, and the requests in it by key. At most ``max_waiting`` requests wait
    for admission (a submit beyond is refused with 429). After each :meth:`step` it
    reports, for every request with news, ``(key, updates, pool map or None, done)``,
    ``updates`` being ``(sequence id, new token ids, ended)`` in sequence order."""

    def __init__(self, engine, *, max_waiting: int = 64, pool_interval: float = 0.25):
        self.engine, self.max_waiting, self.pool_interval = engine, max_waiting, pool_interval
        self.requests: dict = {}            # key -> _Running
        self.totals = dict(requests=0, rejected=0, prompt_tokens=0, generated_tokens=0,
                           steps=0, failed_steps=0, step_seconds=0.0)
        self._failed_in_a_row = 0
        self._pool_sent = 0.0

    def busy(self) -> bool:
        return self.engine.has_work()

    def submit(self, key, prompt, params, want_pool: bool = False) -> dict:
        """The engine's answer to a request: an ``accepted`` or ``rejected`` event."""
        waiting = len(self.engine.scheduler.waiting)
        if waiting >= self.max_waiting:
            self.totals["rejected"] += 1
            return dict(type="rejected", status=429, param=None,
                        message=f"{waiting} requests are waiting for the engine already "
                                f"(at most {self.max_waiting}); try again later")
        try:
            req = self.engine.submit(prompt, params)
        except ConfigError as exc:      # the engine refused it and is unchanged
            self.totals["rejected"] += 1
            return dict(type="rejected", status=400, param=None, message=str(exc))
        except Exception as exc:  # noqa: BLE001 (a bug: the request fails, not the loop)
            log.exception("submit failed")
            self.totals["rejected"] += 1
            return dict(type="rejected", status=500, param=None,
                        message=f"the engine failed to take the request: {exc}")
        self.requests[key] = _Running(req, want_pool)
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(prompt)
        answer = dict(type="accepted", request_id=req.request_id)
        if want_pool:                           # the pool as it is before the request runs
            answer["pool"] = pool_map(self.engine.memory.manager, self._owners(), key)
        return answer

    def cancel(self, key) -> None:
        """Take the request out of the engine and free its blocks (if it is still there)."""
        r = self.requests.pop(key, None)
        if r is not None:
            self.engine.cancel(r.req)
            self._forget(r.req)

    def step(self) -> tuple[list, str | None]:
        """One engine step: (the reports of the requests with news, None), or, if the
        step failed, ([], the error) with every request in it cancelled."""
        t = time.perf_counter()
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 (every request in it fails; check the rest)
            log.exception("engine step failed")
            self.totals["failed_steps"] += 1
            self._failed_in_a_row += 1
            for key in list(self.requests):
                try:
                    self.cancel(key)
                except Exception:  # noqa: BLE001 (the health check that follows says so)
                    log.exception("cancel after a failed step failed")
                    self.requests.pop(key, None)
            return [], f"the engine failed: {type(exc).__name__}: {exc}"
        self._failed_in_a_row = 0
        self.totals["steps"] += 1
        self.totals["step_seconds"] += time.perf_counter() - t
        now = time.monotonic()
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
        return reports, None

    def _news(self, r: _Running) -> list:
        """(sequence id, new token ids, ended) for each sequence with something new."""
        req, out = r.req, []
        live = {id(s) for s in req.live}
        for seq in sorted(req.live + req.finished, key=lambda s: s.seq_id):
            seen = r.sent.get(seq.seq_id, 0)
            if seen < 0:
                continue                        # its end was reported already
            gen, ended = seq.generated, id(seq) not in live
            if len(gen) > seen or ended:
                out.append((seq.seq_id, gen[seen:], ended))
                r.sent[seq.seq_id] = -1 if ended else len(gen)
        self.totals["generated_tokens"] += sum(len(t) for _, t, _ in out)
        return out

    def problem(self) -> str | None:
        """After a failed step: None if the engine can serve on (its queues empty, its
        pool passing the audit, and not two failures in a row), else what is wrong."""
        e = self.engine
        try:
            if self.busy():
                return "requests are left in the engine's queues"
            e.memory.manager.audit()
            if e.memory.swapper is not None:
                e.memory.swapper.audit()
            if e.memory.manager.allocator.num_used:
                return f"{e.memory.manager.allocator.num_used} blocks are still held"
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
                    prompt_tokens_cached=e.memory.counts.cached_tokens, **self.totals)


# ---------------------------------------------------------------------- the text half

class Texts:
    """Token ids into text for one server's jobs: ``tokenizer`` decodes (one token at a
    time), ``stop_ids`` are the end tokens."""

    def __init__(self, tokenizer, stop_ids):
        self.tokenizer, self.stop_ids = tokenizer, frozenset(stop_ids)

    def advance(self, job: Job, updates) -> bool:
        """Decode and send what is new in each of the job's sequences; True once
        every choice has ended (one cut by a stop string ends before its sequence)."""
        for seq_id, tokens, ended in updates:
            ch = job.choices.get(seq_id)
            if ch is None:
                ch = Choice(len(job.choices), self.tokenizer.decoder())
                job.choices[seq_id] = ch
            if ch.finish_reason:
                continue              # cut by a stop string: the rest is not read
            ch.tokens += len(tokens)
            eos = ended and bool(tokens) and tokens[-1] in self.stop_ids and \
                not job.params.ignore_eos
            if self._extend(ch, tokens[:-1] if eos else tokens, job.stop):
                ch.finish_reason = "stop"
            elif ended:
                ch.finish_reason = "stop" if eos else "length"
            self._send_text(job, ch)
        return len(job.choices) == job.params.n and \
            all(c.finish_reason for c in job.choices.values())

    @staticmethod
    def _extend(ch: Choice, tokens, stops) -> bool:
        """Append the text of ``tokens``; True if a stop string now appears (the text is
        then cut before it). Only the end that could hold a new match is searched."""
        before = len(ch.text)
        ch.text += "".join(ch.decoder.step(t) for t in tokens)
        cuts = [i for i in (ch.text.find(s, max(0, before - len(s) + 1)) for s in stops)
                if i >= 0]
        if cuts:
            ch.text = ch.text[:min(cuts)]
        return bool(cuts)

    @staticmethod
    def _send_text(job: Job, ch: Choice) -> None:
        """A delta of what is new and safe to send: while the choice runs, the last
        characters that might begin a stop string are held back."""
        if ch.finish_reason:
            end = len(ch.text)
        elif not job.stream:
            return
        else:
            end = max(ch.sent, len(ch.text) - max(map(len, job.stop), default=1) + 1)
        delta, ch.sent = ch.text[ch.sent:end], max(ch.sent, end)
        if delta or ch.finish_reason:
            job.emit(dict(type="delta", index=ch.index, text=delta,
                          finish_reason=ch.finish_reason))

    @staticmethod
    def usage(job: Job) -> dict:
        gen = sum(c.tokens for c in job.choices.values())
        n = len(job.prompt)
        return dict(prompt_tokens=n, completion_tokens=gen, total_tokens=n + gen)


# ---------------------------------------------------------------------- the loop

class Mortal:
    """What a loop does once when its engine dies (``jobs``, ``dead``, ``on_dead`` are
    the loop's): every job an error, every waiting submit a 503, then ``on_dead``."""

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        log.error("the engine is dead: %s", reason)
        self.dead = reason
        for job in list(self.jobs.values()):
            job.emit(dict(type="error", message=f"the engine is not running: {reason}"))
        self.jobs.clear()
        self._refuse_waiting(503, f"the engine is not running: {reason}")
        if self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_dead failed")


class EngineLoop(Mortal):
    """Owns ``engine`` on a thread of its own; ``tokenizer`` turns tokens into text.

    Call :meth:`start`, then :meth:`submit`, :meth:`cancel` and :meth:`pool` from any
    thread; :meth:`stop` ends the thread (cancelling what runs)."""

    def __init__(self, engine, tokenizer, *, max_waiting: int = 64,
                 pool_interval: float = 0.25, on_dead=None):
        self.engine = engine
        self.core = EngineCore(engine, max_waiting=max_waiting, pool_interval=pool_interval)
        self.texts = Texts(tokenizer, engine.config.stop_ids)
        self.on_dead = on_dead               # called once, on the loop's thread
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict = {}                 # key -> Job (this thread only)
        self.totals = dict(cancelled=0, failed=0)
        self.dead: str | None = None         # why the engine cannot serve any more
        self.stopping = False
        self._keys = itertools.count()
        self.stats = self._stats()           # replaced whole after each step (read anywhere)
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine",
                                        daemon=True)

    # ------------------------------------------------------------ any thread
    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def submit(self, job: Job) -> None:
        self.inbox.put(("submit", job))

    def cancel(self, job: Job) -> None:
        self.inbox.put(("cancel", job))

    def pool(self, audit: bool = False) -> Future:
        """The pool's report (:func:`pool_report`), made on the loop's thread."""
        fut: Future = Future()
        self.inbox.put(("pool", (audit, fut)))
        return fut

    def request_stop(self) -> None:
        """Ask the thread to cancel every request and end (returns at once)."""
        self.stopping = True
        self.inbox.put(("stop", None))

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread.is_alive():
            self.request_stop()
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.dead is None

    # ------------------------------------------------------------ the loop's thread
    def _run(self) -> None:
        """Take the commands that wait, step the engine while it has work, until told
        to stop. Anything that escapes (a bug of this loop) marks it dead, never ends
        the thread silently."""
        try:
            while True:
                for kind, arg in self._commands():
                    if kind == "stop":
                        self._shut_down()
                        return
                    self._command(kind, arg)
                if self.core.busy() and self.dead is None:
                    self._step()
                self.stats = self._stats()
                if self.dead is not None:
                    self._refuse_until_stopped()
                    return
        except BaseException as exc:  # noqa: BLE001 (a bug: say so, answer everyone)
            log.exception("the engine loop failed")
            self._die(f"the engine loop failed: {type(exc).__name__}: {exc}")
            self._refuse_until_stopped()

    def _commands(self) -> list:
        """Every command in the inbox; wait for one only when the engine is idle (a busy
        loop never blocks here: a thread that lets go of the interpreter may wait long to
        get it back from the HTTP layer's)."""
        cmds = [] if self.core.busy() else [self.inbox.get()]
        while True:
            try:
                cmds.append(self.inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _command(self, kind: str, arg) -> None:
        """One command; one that fails fails its own job, and nothing else."""
        try:
            getattr(self, "_" + kind)(arg)
        except Exception as exc:  # noqa: BLE001 (a bug: log it, answer, keep serving)
            log.exception("the engine loop failed on %s", kind)
            if kind in ("submit", "cancel"):
                self._fail(arg, f"the server failed on this request: {exc}")
            elif kind == "pool":
                arg[1].set_exception(exc)

    def _submit(self, job: Job) -> None:
        key = next(self._keys)
        answer = self.core.submit(key, job.prompt, job.params, job.want_pool)
        if answer["type"] == "accepted":
            job.key, self.jobs[key] = key, job
        job.emit(answer)
        if "pool" in answer:
            job.emit(dict(type="pool", pool=answer["pool"]))

    def _cancel(self, job: Job) -> None:
        """The client went away (or the server stops): free the request's blocks."""
        if self.jobs.pop(job.key, None) is None:
            return
        self.core.cancel(job.key)
        self.totals["cancelled"] += 1
        job.emit(dict(type="done", usage=Texts.usage(job), cancelled=True))

    def _pool(self, arg) -> None:
        audit, fut = arg
        fut.set_result(pool_report(self.core.engine, audit))

    def _step(self) -> None:
        """One engine step; then each job's new text, block maps and end."""
        reports, error = self.core.step()
        if error is not None:
            for job in list(self.jobs.values()):
                self._fail(job, error)
            problem = self.core.problem()
            if problem is not None:
                self._die(f"{problem} (after: {error})")
            return
        for key, updates, pool, done in reports:
            job = self.jobs.get(key)
            if job is None:
                continue
            try:
                if pool is not None:
                    job.emit(dict(type="pool", pool=pool))
                if self.texts.advance(job, updates):
                    self._finish(job, done)
            except Exception as exc:  # noqa: BLE001 (this job fails, the others go on)
                log.exception("request %s failed", key)
                self._fail(job, f"the server failed on this request: {exc}")

    def _finish(self, job: Job, done: bool) -> None:
        """Every choice has ended: a request that a stop string ended still runs in the
        engine, so cancel it; then the job is done."""
        del self.jobs[job.key]
        if not done:
            self.core.cancel(job.key)
        job.emit(dict(type="done", usage=Texts.usage(job)))

    def _fail(self, job: Job, message: str) -> None:
        """The request fails: an error to its client, its blocks back if it has any."""
        self.totals["failed"] += 1
        if self.jobs.pop(job.key, None) is not None:
            try:
                self.core.cancel(job.key)
            except Exception:  # noqa: BLE001 (the next failed step's check says so)
                log.exception("cancel after a failure failed")
        job.emit(dict(type="error", message=message))

    # ------------------------------------------------------------ stopping and dying
    def _shut_down(self) -> None:
        for job in list(self.jobs.values()):
            self._cancel(job)
        self._drain(503, "the server is shutting down")

    def _refuse_waiting(self, status: int, message: str) -> None:
        self._drain(status, message)
        self.stats = self._stats()

    def _refuse_until_stopped(self) -> None:
        """A dead loop still answers: every submit gets 503, every pool read an error."""
        while True:
            kind, arg = self.inbox.get()
            if kind == "stop":
                return
            _refuse(kind, arg, 503, f"the engine is not running: {self.dead}")

    def _drain(self, status: int, message: str) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            _refuse(kind, arg, status, message)

    def _stats(self) -> dict:
        return dict(self.core.stats(), dead=self.dead is not None, time=time.time(),
                    **self.totals)


def _refuse(kind: str, arg, status: int, message: str) -> None:
    if kind == "submit":
        arg.emit(dict(type="rejected", status=status, param=None, message=message))
    elif kind == "pool":
        arg[1].set_exception(RuntimeError(message))
