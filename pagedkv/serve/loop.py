"""The engine loop: one thread owns the engine; everything else talks to it through a queue.

The HTTP layer puts commands in :attr:`EngineLoop.inbox` (submit a job, cancel one, run a
function on the engine's thread) and gets events back through each job's ``emit``
callback. Between commands the thread steps the engine while it has work, and after each
step looks at every request's sequences: the tokens that are new are decoded (one token at
a time, never the whole answer again) into text deltas, and a sequence that left ``live``
(or whose text reached a stop string) ends its choice. Nothing outside this thread touches
the engine.

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

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..errors import ConfigError

__all__ = ["Job", "EngineLoop", "pool_map", "pool_counts", "FREE", "CACHED", "MINE",
           "SHARED", "OTHERS", "USED"]

log = logging.getLogger("pagedkv.serve")

# one character a block in a pool map
FREE, CACHED, MINE, SHARED, OTHERS, USED = ".", "c", "m", "s", "o", "u"


@dataclass
class Choice:
    """One sequence's answer as the client sees it."""
    index: int
    decoder: object            # the tokenizer's incremental decoder
    seen: int = 0              # generated tokens already decoded
    text: str = ""             # their text (cut at a stop string)
    sent: int = 0              # characters of it already sent
    tokens: int = 0            # tokens this choice generated (its usage)
    finish_reason: str | None = None


@dataclass(eq=False)        # a job is itself: hashable, compared by identity
class Job:
    """One HTTP request's work: what to run and where its events go."""
    prompt: list
    params: object             # a SamplingParams
    emit: object               # called (on the engine thread) with each event
    stop: tuple = ()           # stop strings
    want_pool: bool = False    # send block maps (the chat page asks for them)
    stream: bool = True        # deltas as they come (else one per choice, at its end)
    req: object = None         # the engine's Request, once submitted
    choices: dict = field(default_factory=dict)   # sequence id -> Choice
    last_pool: str | None = None


def pool_map(manager, owners: dict, me=None) -> str:
    """The pool as a string, one character a block: free, cached idle (the prefix cache
    keeps it, nobody maps it), and for a block somebody maps: with ``me`` (a job), mine
    alone, shared (mine and another sequence's) or others'; without, used or shared.
    ``owners`` maps a block to the set of jobs whose sequences map it. O(blocks)."""
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


class EngineLoop:
    """Owns ``engine`` on a thread of its own; ``tokenizer`` turns tokens into text.

    At most ``max_waiting`` requests wait for admission: a submit beyond that is rejected
    with status 429. Call :meth:`start`, then :meth:`submit`, :meth:`cancel` and
    :meth:`call` from any thread; :meth:`stop` ends the thread (cancelling what runs).
    """

    def __init__(self, engine, tokenizer, *, max_waiting: int = 64,
                 pool_interval: float = 0.25, on_dead=None):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_waiting = max_waiting
        self.pool_interval = pool_interval   # seconds between block maps
        self.on_dead = on_dead               # called once, on the engine's thread
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict = {}                 # request id -> Job (this thread only)
        self.totals = dict(requests=0, rejected=0, cancelled=0, failed=0, prompt_tokens=0,
                           generated_tokens=0, steps=0, failed_steps=0,
                           step_seconds=0.0)
        self.dead: str | None = None         # why the engine cannot serve any more
        self.stopping = False
        self._failed_in_a_row = 0
        self._pool_sent = 0.0                # when block maps were last sent
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

    def call(self, fn) -> Future:
        """Run ``fn(engine)`` on the engine's thread; its result (or error) in a future."""
        fut: Future = Future()
        self.inbox.put(("call", (fn, fut)))
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

    # ------------------------------------------------------------ the engine's thread
    def _busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or e.swapped)

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
                if self._busy() and self.dead is None:
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
        cmds = [] if self._busy() else [self.inbox.get()]
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

    def _shut_down(self) -> None:
        for job in list(self.jobs.values()):
            self._cancel(job)
        self._drain(503, "the server is shutting down")

    def _refuse_until_stopped(self) -> None:
        """A dead loop still answers: every submit gets 503, every call an error."""
        while True:
            kind, arg = self.inbox.get()
            if kind == "stop":
                return
            self._refuse(kind, arg, 503, f"the engine is not running: {self.dead}")

    def _drain(self, status: int, message: str) -> None:
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            self._refuse(kind, arg, status, message)

    def _refuse(self, kind: str, arg, status: int, message: str) -> None:
        if kind == "submit":
            arg.emit(dict(type="rejected", status=status, param=None, message=message))
        elif kind == "call":
            arg[1].set_exception(RuntimeError(message))

    # ------------------------------------------------------------ commands
    def _submit(self, job: Job) -> None:
        waiting = len(self.engine.waiting)
        if waiting >= self.max_waiting:
            self.totals["rejected"] += 1
            job.emit(dict(type="rejected", status=429, param=None,
                          message=f"{waiting} requests are waiting for the engine already "
                                  f"(at most {self.max_waiting}); try again later"))
            return
        try:
            job.req = self.engine.submit(job.prompt, job.params)
        except ConfigError as exc:      # the engine refused it and is unchanged
            self.totals["rejected"] += 1
            job.emit(dict(type="rejected", status=400, param=None, message=str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 (a bug: the request fails, not the loop)
            log.exception("submit failed")
            self.totals["rejected"] += 1
            job.emit(dict(type="rejected", status=500, param=None,
                          message=f"the engine failed to take the request: {exc}"))
            return
        self.jobs[job.req.request_id] = job
        self.totals["requests"] += 1
        self.totals["prompt_tokens"] += len(job.prompt)
        job.emit(dict(type="accepted", request_id=job.req.request_id))
        if job.want_pool:
            self._send_pool(job, self._owners())

    def _cancel(self, job: Job) -> None:
        """The client went away (or the server stops): free the request's blocks."""
        if job.req is None or self.jobs.pop(job.req.request_id, None) is None:
            return
        self.engine.cancel(job.req)
        self._forget(job.req)
        self.totals["cancelled"] += 1
        job.emit(dict(type="done", usage=self._usage(job), cancelled=True))

    def _call(self, arg) -> None:
        fn, fut = arg
        try:
            fut.set_result(fn(self.engine))
        except Exception as exc:  # noqa: BLE001 (handed to the caller)
            fut.set_exception(exc)

    # ------------------------------------------------------------ a step
    def _step(self) -> None:
        """One engine step; then each job's new text, ends and block maps."""
        t = time.perf_counter()
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 (every request in it fails; check the rest)
            self._step_failed(exc)
            return
        self._failed_in_a_row = 0
        self.totals["steps"] += 1
        now = time.monotonic()
        self.totals["step_seconds"] += time.perf_counter() - t
        pools = any(j.want_pool for j in self.jobs.values()) and \
            now - self._pool_sent >= self.pool_interval
        owners = self._owners() if pools else {}
        for job in list(self.jobs.values()):
            try:
                self._advance(job)
                if pools and job.want_pool:
                    self._send_pool(job, owners)
                if len(job.choices) == job.params.n and \
                        all(c.finish_reason for c in job.choices.values()):
                    self._finish(job)
            except Exception as exc:  # noqa: BLE001 (this job fails, the others go on)
                log.exception("request %s failed", job.req.request_id)
                self._fail(job, f"the server failed on this request: {exc}")
        if pools:
            self._pool_sent = now

    def _step_failed(self, exc: Exception) -> None:
        """Fail every request in flight; serve on only if the engine is whole again."""
        log.exception("engine step failed")
        self.totals["failed_steps"] += 1
        self._failed_in_a_row += 1
        for job in list(self.jobs.values()):
            self._fail(job, f"the engine failed: {type(exc).__name__}: {exc}")
        problem = self._health()
        if problem is None and self._failed_in_a_row >= 2:
            problem = "two engine steps failed in a row"
        if problem is not None:
            self._die(f"{problem} (after: {type(exc).__name__}: {exc})")

    def _health(self) -> str | None:
        """None if the engine is empty and its pool passes the audit, else what is not."""
        e = self.engine
        try:
            if self._busy():
                return "requests are left in the engine's queues"
            e.manager.audit()
            if e.swapper is not None:
                e.swapper.audit()
            if e.manager.allocator.num_used:
                return f"{e.manager.allocator.num_used} blocks are still held"
        except Exception as exc:  # noqa: BLE001 (reported as the reason)
            return f"the pool's audit failed: {type(exc).__name__}: {exc}"
        return None

    def _fail(self, job: Job, message: str) -> None:
        """The request fails: an error to its client, its blocks back if it has any."""
        self.totals["failed"] += 1
        if job.req is not None and self.jobs.pop(job.req.request_id, None) is not None:
            try:
                self.engine.cancel(job.req)
                self._forget(job.req)
            except Exception:  # noqa: BLE001 (the health check that follows says so)
                log.exception("cancel after a failure failed")
        job.emit(dict(type="error", message=message))

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        log.error("the engine is dead: %s", reason)
        self.dead = reason
        for job in list(self.jobs.values()):
            job.emit(dict(type="error", message=f"the engine is not running: {reason}"))
        self.jobs.clear()
        self._drain(503, f"the engine is not running: {reason}")
        self.stats = self._stats()
        if self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:  # noqa: BLE001
                log.exception("on_dead failed")

    # ------------------------------------------------------------ what a step made
    def _advance(self, job: Job) -> None:
        """Decode what is new in each of the request's sequences since the last step, and
        send it (a choice that does not stream: once, when it ends)."""
        req, stop_ids = job.req, self.engine.stop_ids
        live = {id(s) for s in req.live}
        for seq in sorted(req.live + req.finished, key=lambda s: s.seq_id):
            ch = job.choices.get(seq.seq_id)
            if ch is None:
                ch = job.choices[seq.seq_id] = Choice(len(job.choices),
                                                      self.tokenizer.decoder())
            gen, ended = seq.generated, id(seq) not in live
            if ch.finish_reason or (len(gen) == ch.seen and not ended):
                continue
            eos = ended and bool(gen) and gen[-1] in stop_ids and not job.params.ignore_eos
            new = gen[ch.seen:len(gen) - 1] if eos else gen[ch.seen:]
            self.totals["generated_tokens"] += len(gen) - ch.seen
            ch.seen = len(gen)
            if self._extend(ch, new, job.stop):
                reason = "stop"
            elif ended:
                reason = "stop" if eos else "length"
            else:
                reason = None
            if reason:
                ch.finish_reason, ch.tokens = reason, len(gen)
            self._send_text(job, ch)

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

    def _send_text(self, job: Job, ch: Choice) -> None:
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

    def _finish(self, job: Job) -> None:
        """Every choice has ended: a request that a stop string ended still runs in the
        engine, so cancel it; then the job is done."""
        self.jobs.pop(job.req.request_id, None)
        if job.req.live:
            self.engine.cancel(job.req)
        self._forget(job.req)
        job.emit(dict(type="done", usage=self._usage(job)))

    def _forget(self, req) -> None:
        finished = self.engine.finished
        for i in range(len(finished) - 1, -1, -1):   # (a server's list would only grow)
            if finished[i] is req:
                del finished[i]

    def _usage(self, job: Job) -> dict:
        gen = sum(c.tokens or c.seen for c in job.choices.values())
        n = len(job.prompt)
        return dict(prompt_tokens=n, completion_tokens=gen, total_tokens=n + gen)

    # ------------------------------------------------------------ block maps
    def _owners(self) -> dict:
        m, owners = self.engine.manager, {}
        for job in self.jobs.values():
            for seq in job.req.live:
                if seq.seq_id in m:
                    for b in m.block_table(seq.seq_id).tolist():
                        owners.setdefault(b, set()).add(job)
        return owners

    def _send_pool(self, job: Job, owners: dict) -> None:
        blocks = pool_map(self.engine.manager, owners, job)
        if blocks != job.last_pool:
            job.last_pool = blocks
            job.emit(dict(type="pool", pool=blocks))

    def _stats(self) -> dict:
        """The numbers ``/metrics`` shows, from counters: O(1)."""
        e = self.engine
        return dict(pool=pool_counts(e.manager), running=len(e.running),
                    waiting=len(e.waiting), swapped=len(e.swapped),
                    prompt_tokens_prefilled=e.counts.prompt_tokens,
                    prompt_tokens_cached=e.counts.cached_tokens,
                    dead=self.dead is not None, time=time.time(), **self.totals)
