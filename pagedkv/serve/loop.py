"""The engine loop: one thread owns the engine; everything else talks to it through a queue.

The HTTP layer puts commands in :attr:`EngineLoop.inbox` (submit a job, cancel one, run a
function on the engine's thread) and gets events back through each job's ``emit``
callback. Between commands the thread steps the engine while it has work, and after each
step compares every request's sequences with what it had already sent: the tokens that
are new become text deltas, a sequence that left ``live`` (or whose text reached a stop
string) ends its choice. Nothing outside this thread touches the engine.

Events, as dicts with a ``"type"``:

* ``accepted`` / ``rejected`` (``status``, ``message``, ``param``): the answer to a submit;
* ``delta`` (``index``, ``text``, ``finish_reason``): new text of one choice;
* ``pool`` (``pool``): the block map seen from the job (after each step that changed it);
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

__all__ = ["Job", "EngineLoop", "pool_map", "FREE", "CACHED", "MINE", "SHARED", "OTHERS"]

log = logging.getLogger("pagedkv.serve")

# one character a block in a pool map
FREE, CACHED, MINE, SHARED, OTHERS, USED = ".", "c", "m", "s", "o", "u"


@dataclass
class Choice:
    index: int
    seen: int = 0              # generated tokens already looked at
    sent: str = ""             # text already sent
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
    req: object = None         # the engine's Request, once submitted
    choices: dict = field(default_factory=dict)   # sequence id -> Choice
    last_pool: str | None = None
    cancelled: bool = False


def pool_map(manager, owners: dict, me=None) -> str:
    """The pool as a string, one character a block: free, cached idle (the prefix cache
    keeps it, nobody maps it), and for a block somebody maps: with ``me`` (a job), mine
    alone, shared (mine and another sequence's) or others'; without, used or shared.
    ``owners`` maps a block to the set of jobs whose sequences map it."""
    alloc = manager.allocator
    refs = alloc.refcounts().tolist()
    idle = getattr(alloc, "is_idle", lambda b: False)
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
    """Blocks free, used and cached idle (cached idle blocks count as free to the
    allocator: they are handed out when the free list is empty)."""
    alloc = manager.allocator
    total, free = alloc.num_blocks, alloc.num_free
    refs = alloc.refcounts()
    idle = getattr(alloc, "is_idle", None)
    cached = sum(1 for b in range(total) if refs[b] == 0 and idle(b)) if idle else 0
    return {"total": total, "used": total - free, "free": free - cached, "cached": cached}


class EngineLoop:
    """Owns ``engine`` on a thread of its own; ``tokenizer`` turns tokens into text.

    At most ``max_waiting`` requests wait for admission: a submit beyond that is rejected
    with status 429. Call :meth:`start`, then :meth:`submit`, :meth:`cancel` and
    :meth:`call` from any thread; :meth:`stop` ends the thread (cancelling what runs).
    """

    def __init__(self, engine, tokenizer, *, max_waiting: int = 64):
        self.engine, self.tokenizer = engine, tokenizer
        self.max_waiting = max_waiting
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.jobs: dict = {}               # request id -> Job (this thread only)
        self.totals = dict(requests=0, rejected=0, cancelled=0, prompt_tokens=0,
                           generated_tokens=0, steps=0)
        self.stats = self._stats()         # replaced whole after each step (read anywhere)
        self.stopping = False
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
        return self._thread.is_alive()

    # ------------------------------------------------------------ the engine's thread
    def _busy(self) -> bool:
        e = self.engine
        return bool(e.waiting or e.running or getattr(e, "swapped", ()))

    def _run(self) -> None:
        while True:
            try:
                cmds = [self.inbox.get(timeout=None if not self._busy() else 0)]
            except queue.Empty:
                cmds = []
            while True:
                try:
                    cmds.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for kind, arg in cmds:
                if kind == "stop":
                    for job in list(self.jobs.values()):
                        self._cancel(job)
                    self._drain()
                    return
                try:
                    getattr(self, "_" + kind)(arg)
                except Exception:  # noqa: BLE001 (a bug: log it, keep the loop alive)
                    log.exception("the engine loop failed on %s", kind)
            if self._busy():
                self._step()
            self.stats = self._stats()

    def _drain(self) -> None:
        """After the stop: refuse what is still in the inbox."""
        while True:
            try:
                kind, arg = self.inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "submit":
                arg.emit(dict(type="rejected", status=503, param=None,
                              message="the server is shutting down"))
            elif kind == "call":
                arg[1].set_exception(RuntimeError("the server is shutting down"))

    def _submit(self, job: Job) -> None:
        if len(self.engine.waiting) >= self.max_waiting:
            self.totals["rejected"] += 1
            job.emit(dict(type="rejected", status=429, param=None,
                          message=f"{len(self.engine.waiting)} requests are waiting for the "
                                  f"engine already (at most {self.max_waiting}); try again "
                                  f"later"))
            return
        try:
            job.req = self.engine.submit(job.prompt, job.params)
        except ConfigError as exc:      # the engine refused it and is unchanged
            self.totals["rejected"] += 1
            job.emit(dict(type="rejected", status=400, param=None, message=str(exc)))
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
        job.cancelled = True
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

    def _step(self) -> None:
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 (a bug: fail every request, keep serving)
            log.exception("engine step failed")
            for job in list(self.jobs.values()):
                job.emit(dict(type="error", message=f"the engine failed: {exc}"))
                self.jobs.pop(job.req.request_id, None)
                try:
                    self.engine.cancel(job.req)
                except Exception:  # noqa: BLE001
                    log.exception("cancel after a failed step failed")
            return
        self.totals["steps"] += 1
        owners = self._owners() if any(j.want_pool for j in self.jobs.values()) else {}
        for job in list(self.jobs.values()):
            self._advance(job)
            if job.want_pool:
                self._send_pool(job, owners)
            if all(c.finish_reason for c in job.choices.values()) and \
                    len(job.choices) == job.params.n:
                self._finish(job)
        if len(self.engine.history) > 1000:      # a server runs for days: keep it bounded
            del self.engine.history[:-100]

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

    def _advance(self, job: Job) -> None:
        """Send what is new in each of the request's sequences since the last step."""
        req, stop_ids = job.req, self.engine.stop_ids
        live = {id(s) for s in req.live}
        for seq in sorted(req.live + req.finished, key=lambda s: s.seq_id):
            ch = job.choices.get(seq.seq_id)
            if ch is None:
                ch = job.choices[seq.seq_id] = Choice(len(job.choices))
            gen = seq.generated
            if ch.finish_reason or (len(gen) == ch.seen and id(seq) in live):
                continue
            self.totals["generated_tokens"] += len(gen) - ch.seen
            ch.seen = len(gen)
            ended = id(seq) not in live
            eos = bool(gen) and gen[-1] in stop_ids
            text = self.tokenizer.decode(gen[:-1] if eos else gen)
            cuts = [i for i in (text.find(s) for s in job.stop) if i >= 0]
            if cuts:
                text, reason = text[:min(cuts)], "stop"
            elif ended:
                reason = "stop" if eos else "length"
            else:
                reason = None
                hold = max((len(s) for s in job.stop), default=1) - 1
                text = text.rstrip("\ufffd")    # an unfinished UTF-8 character
                text = text[:max(len(ch.sent), len(text) - hold)]
            delta = text[len(ch.sent):]
            ch.sent = text if len(text) > len(ch.sent) else ch.sent
            if reason:
                ch.finish_reason, ch.tokens = reason, len(gen)
            if delta or reason:
                job.emit(dict(type="delta", index=ch.index, text=delta,
                              finish_reason=reason))

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

    def _stats(self) -> dict:
        e = self.engine
        counts = getattr(e, "counts", None)
        return dict(pool=pool_counts(e.manager), running=len(e.running),
                    waiting=len(e.waiting), swapped=len(getattr(e, "swapped", ())),
                    prompt_tokens_prefilled=getattr(counts, "prompt_tokens", 0),
                    prompt_tokens_cached=getattr(counts, "cached_tokens", 0),
                    time=time.time(), **self.totals)
