"""The engine loop with its engine in a process of its own (``--engine process``, the
server's default).

:class:`~.loop.EngineLoop` runs the engine on a thread of the server's process, and a
Python process runs one thread at a time: while the HTTP layer writes chunks, the engine
waits for the interpreter, and on a GPU, where a step is a millisecond or two, that wait
is most of the step (one H200, 2026-12-03: the same requests at 0.38 of the engine's
in-process rate). So, as vLLM does with its engine core, this runs
:class:`~.loop.EngineCore` in a child process. The two talk over a pipe: commands go
down (submit, cancel, read the pool, stop), and up come the answers and, after each step,
one message with every request's new token ids. Text is made up here, by the same
:class:`~.loop.Texts` the thread uses; the child never decodes.

:class:`EngineProcess` has :class:`~.loop.EngineLoop`'s calls, so the HTTP layer does not
know which one it has. A child that dies (its engine dead, a crash, an out-of-memory kill)
makes this one dead too: every job gets an error and ``on_dead`` is called.
"""
from __future__ import annotations

import itertools
import logging
import multiprocessing
import threading
import time
from concurrent.futures import Future

from .loop import EngineCore, Job, Mortal, Texts, pool_report

__all__ = ["EngineProcess"]

log = logging.getLogger("pagedkv.serve")


class EngineProcess(Mortal):
    """:class:`~.loop.EngineLoop`'s interface over an engine in a child process, made
    there by ``make_engine(options)`` (a module-level function: the child imports it);
    ``tokenizer`` turns tokens into text here."""

    def __init__(self, make_engine, options: dict, tokenizer, *, max_waiting: int = 64,
                 pool_interval: float = 0.25, on_dead=None, log_level: str = "INFO"):
        self.on_dead, self.dead, self.stopping = on_dead, None, False
        self.jobs: dict = {}            # key -> Job, accepted (the reader's thread only)
        self._pending: dict = {}        # key -> Job, waiting for the engine's answer
        self._pools: dict = {}          # token -> Future of a pool report
        self.totals = dict(cancelled=0, failed=0)
        self._core_stats: dict = {}
        self._keys, self._tokens = itertools.count(), itertools.count()
        self._lock = threading.Lock()   # one message on the pipe at a time
        self._tokenizer = tokenizer
        ctx = multiprocessing.get_context("spawn")   # (CUDA cannot be forked)
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, name="pagedkv-engine", daemon=True,
                                 args=(child, make_engine, options, max_waiting,
                                       pool_interval, log_level))
        self._child_conn = child
        self.info: dict = {}

    # ------------------------------------------------------------ any thread
    def start(self, timeout: float = 600.0) -> "EngineProcess":
        """Start the child and wait (bounded) until its engine is ready."""
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start within {timeout:g} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self._proc.join(10)
            raise RuntimeError(f"the engine process ended as it started (exit status "
                               f"{self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start: {value}")
        self.info = value
        self._core_stats = value["stats"]
        self.texts = Texts(self._tokenizer, value["stop_ids"])
        self._reader = threading.Thread(target=self._read, name="pagedkv-engine-reader",
                                        daemon=True)
        self._reader.start()
        return self

    def submit(self, job: Job) -> None:
        if self.dead is not None:
            job.emit(dict(type="rejected", status=503, param=None,
                          message=f"the engine is not running: {self.dead}"))
            return
        key = next(self._keys)
        self._pending[key] = job
        self._send(("submit", key, job.prompt, job.params, job.want_pool))

    def cancel(self, job: Job) -> None:
        key = job.key
        if key is None:                 # not answered yet: the key it was sent with
            key = next((k for k, j in list(self._pending.items()) if j is job), None)
        if key is not None:
            self._send(("cancel", key))

    def pool(self, audit: bool = False) -> Future:
        fut: Future = Future()
        if self.dead is not None:
            fut.set_exception(RuntimeError(f"the engine is not running: {self.dead}"))
            return fut
        token = next(self._tokens)
        self._pools[token] = fut
        self._send(("pool", token, audit))
        return fut

    def request_stop(self) -> None:
        """Ask the child to cancel every request and end (returns at once; safe in a
        signal handler: the message is sent from a thread of its own)."""
        self.stopping = True
        threading.Thread(target=self._send, args=(("stop",),), daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._proc.is_alive():
            self.stopping = True
            self._send(("stop",))
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
        if getattr(self, "_reader", None) is not None:
            self._reader.join(timeout)

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and self.dead is None

    @property
    def stats(self) -> dict:
        return dict(self._core_stats, dead=self.dead is not None, time=time.time(),
                    **self.totals)

    def _send(self, message) -> None:
        try:
            with self._lock:
                self._conn.send(message)
        except (OSError, ValueError) as exc:   # the child is gone: the reader says why
            log.debug("sending to the engine process failed: %s", exc)

    # ------------------------------------------------------------ the reader's thread
    def _read(self) -> None:
        """Everything the child sends, in order, until it stops or dies."""
        try:
            while True:
                message = self._conn.recv()
                kind = message[0]
                if kind == "step":
                    self._core_stats = message[2]
                    self._reports(message[1])
                elif kind == "answer":
                    self._answer(*message[1:])
                elif kind == "cancelled":
                    job = self.jobs.pop(message[1], None)
                    if job is not None:
                        self.totals["cancelled"] += 1
                        job.emit(dict(type="done", usage=Texts.usage(job), cancelled=True))
                elif kind == "pool":
                    self._pools.pop(message[1]).set_result(message[2])
                elif kind == "stats":
                    self._core_stats = message[1]
                elif kind == "failed":
                    for key in message[1]:
                        self._fail(key, message[2])
                elif kind == "dead":
                    self._die(message[1])
                    return
                elif kind == "stopped":
                    self._refuse_waiting(503, "the server is shutting down")
                    return
        except (EOFError, OSError):
            if not self.stopping:
                self._proc.join(5)
                self._die(f"the engine process ended (exit status {self._proc.exitcode})")
        except BaseException as exc:  # noqa: BLE001 (a bug here: say so, answer everyone)
            log.exception("reading from the engine process failed")
            self._die(f"reading from the engine process failed: {exc}")

    def _answer(self, key, answer: dict) -> None:
        job = self._pending.pop(key, None)
        if job is None:
            return
        if answer["type"] == "accepted":
            job.key, self.jobs[key] = key, job
        job.emit(answer)
        if "pool" in answer:
            job.emit(dict(type="pool", pool=answer["pool"]))

    def _reports(self, reports) -> None:
        for key, updates, pool, done in reports:
            job = self.jobs.get(key)
            if job is None:
                continue
            try:
                if pool is not None:
                    job.emit(dict(type="pool", pool=pool))
                if self.texts.advance(job, updates):
                    del self.jobs[key]
                    if not done:                # ended by a stop string: stop it too
                        self._send(("cancel", key))
                    job.emit(dict(type="done", usage=Texts.usage(job)))
            except Exception as exc:  # noqa: BLE001 (this job fails, the others go on)
                log.exception("request %s failed", key)
                self._send(("cancel", key))
                self._fail(key, f"the server failed on this request: {exc}")

    def _fail(self, key, message: str) -> None:
        job = self.jobs.pop(key, None)
        if job is not None:
            self.totals["failed"] += 1
            job.emit(dict(type="error", message=message))

    def _refuse_waiting(self, status: int, message: str) -> None:
        for key in list(self._pending):
            job = self._pending.pop(key, None)
            if job is not None:
                job.emit(dict(type="rejected", status=status, param=None, message=message))
        for job in list(self.jobs.values()):
            job.emit(dict(type="done", usage=Texts.usage(job), cancelled=True))
        self.jobs.clear()
        for token in list(self._pools):
            self._pools.pop(token).set_exception(RuntimeError(message))


# ---------------------------------------------------------------------- the child

def _child(conn, make_engine, options, max_waiting, pool_interval, log_level) -> None:
    """The child process: make the engine, say it is ready, then serve the pipe."""
    logging.basicConfig(level=log_level, format="%(levelname)s: %(message)s")
    try:
        engine, info = make_engine(options)
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, then exit 1)
        log.exception("making the engine failed")
        conn.send(("failed to start", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    core = EngineCore(engine, max_waiting=max_waiting, pool_interval=pool_interval)
    conn.send(("ready", dict(info, stop_ids=sorted(engine.config.stop_ids), stats=core.stats())))
    try:
        if not _serve(conn, core):
            raise SystemExit(1)
    except (EOFError, OSError):                  # the parent is gone: nothing to serve
        raise SystemExit(0) from None


def _serve(conn, core: EngineCore) -> bool:
    """Commands and steps until a stop (True) or the engine is dead (False)."""
    while True:
        commands = []
        if not core.busy():
            commands.append(conn.recv())          # idle: wait for work
        while conn.poll():
            commands.append(conn.recv())
        for message in commands:
            if not _command(conn, core, message):
                return True
        if commands:
            conn.send(("stats", core.stats()))
        if core.busy():
            keys = list(core.requests)
            reports, error = core.step()
            if error is None:
                conn.send(("step", reports, core.stats()))
                continue
            conn.send(("failed", keys, error))
            conn.send(("stats", core.stats()))
            problem = core.problem()
            if problem is not None:
                conn.send(("dead", f"{problem} (after: {error})"))
                return False


def _command(conn, core: EngineCore, message) -> bool:
    """One command from the parent; False for the stop."""
    kind = message[0]
    if kind == "submit":
        key, prompt, params, want_pool = message[1:]
        conn.send(("answer", key, core.submit(key, prompt, params, want_pool)))
    elif kind == "cancel":
        try:
            core.cancel(message[1])
        except Exception:  # noqa: BLE001 (a bug: logged; the request is forgotten)
            log.exception("cancel failed")
            core.requests.pop(message[1], None)
        conn.send(("cancelled", message[1]))
    elif kind == "pool":
        conn.send(("pool", message[1], pool_report(core.engine, message[2])))
    elif kind == "stop":
        for key in list(core.requests):
            core.cancel(key)
        conn.send(("stopped",))
        return False
    return True
