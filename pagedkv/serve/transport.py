"""Two ways to reach the engine's core: a thread of the server's process, or a process of
its own. Both carry the same messages (:mod:`.messages`) and run the same loop
(:func:`~.core.run_core`); the client (:mod:`.client`) does not know which it has.

A transport has ``start(receive)`` (make the core, return its
:class:`~.messages.Ready`; from then on every message from the core is passed to
``receive``, on a thread of the transport's), ``send(message)``, which never waits, and
``stop(timeout)``, which is bounded. ``send`` only puts the message in a queue: the core's
own (a thread), or one a writer thread empties into the pipe (a process), so that a core
that is busy, stopped or hung never holds up the caller, the HTTP layer's event loop. The
queue is bounded by the client, which has at most ``--max-waiting`` submits unanswered.

Why a process of its own (``--engine process``, the default): a Python process runs one
thread at a time, and while the HTTP layer writes chunks, an engine on a thread waits for
the interpreter; on a GPU, where a step is a millisecond or two, that wait is most of the
step (one H200, 2026-12-03: the same requests at 0.38 of the engine's in-process rate).
So, as vLLM does with its engine core, the core runs in a child process and the text is
made in the server's (:class:`~.texts.Texts`): the child never decodes.
"""
from __future__ import annotations

import logging
import multiprocessing
import queue
import threading

from ..errors import PagedKVError
from .core import EngineCore, run_core
from .messages import Dead, Ready, Stop, Stopped, merged

__all__ = ["ThreadTransport", "ProcessTransport", "EngineStartError"]

log = logging.getLogger("pagedkv.serve")
READ_AT_ONCE = 64       # messages the reader takes from the pipe at most before handing on


class EngineStartError(PagedKVError):
    """The engine could not be made, or did not say it was ready in time."""


def _take(inbox: queue.SimpleQueue):
    def take(wait):
        out = []
        try:
            if wait is not None:
                out.append(inbox.get(timeout=wait))
            while True:
                out.append(inbox.get_nowait())
        except queue.Empty:
            return out
    return take


class ThreadTransport:
    """The core on a thread of this process, over ``engine`` (made already: see
    :func:`~.start.make_engine`); ``info`` is what making it chose."""

    def __init__(self, engine, info: dict | None = None, *, max_waiting: int = 64,
                 pool_interval: float = 0.25):
        self.core = EngineCore(engine, max_waiting=max_waiting, pool_interval=pool_interval)
        self.info = info or {}
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = None

    def start(self, receive) -> Ready:
        def run():
            try:
                run_core(self.core, _take(self._inbox), receive)
            except BaseException as exc:  # noqa: BLE001 (a bug: say so, answer everyone)
                log.exception("the engine loop failed")
                receive(Dead(f"the engine loop failed: {type(exc).__name__}: {exc}"))
        self._thread = threading.Thread(target=run, name="pagedkv-engine", daemon=True)
        ready = Ready(self.core.engine.config, self.info, self.core.stats())
        self._thread.start()
        return ready

    def send(self, message) -> None:
        self._inbox.put(message)

    def stop(self, timeout: float = 5.0) -> None:
        if self._thread is not None and self._thread.is_alive():
            self.send(Stop())
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()


class ProcessTransport:
    """The core in a child process, which makes its engine from ``spec`` (an
    :class:`~.start.EngineSpec`: what is left to the machine is decided there)."""

    def __init__(self, spec, *, max_waiting: int = 64, pool_interval: float = 0.25,
                 log_level: str = "INFO"):
        ctx = multiprocessing.get_context("spawn")   # (CUDA cannot be forked)
        self._conn, child = ctx.Pipe()
        self._child_conn = child
        self._proc = ctx.Process(target=_child, name="pagedkv-engine", daemon=True,
                                 args=(child, spec, max_waiting, pool_interval, log_level))
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ending = threading.Event()      # stop() was called: an EOF is expected

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self, receive, timeout: float = 600.0) -> Ready:
        """Start the child and wait (bounded) until its engine is ready."""
        self._proc.start()
        self._child_conn.close()
        if not self._conn.poll(timeout):
            self._proc.kill()
            raise EngineStartError(f"the engine process did not start within {timeout:g} s")
        try:
            first = self._conn.recv()
        except EOFError:
            self._proc.join(10)
            raise EngineStartError(f"the engine process ended as it started (exit status "
                                   f"{self._proc.exitcode})") from None
        if not isinstance(first, Ready):
            self._proc.join(10)
            raise EngineStartError(f"the engine process failed to start: "
                                   f"{getattr(first, 'reason', first)}")
        for target, name in ((self._write, "writer"), (self._read, "reader")):
            threading.Thread(target=target, args=(receive,), name=f"pagedkv-engine-{name}",
                             daemon=True).start()
        return first

    def send(self, message) -> None:
        self._outbox.put(message)

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the child to stop; past ``timeout`` seconds (a stopped or hung child),
        kill it."""
        self._ending.set()
        if self._proc.is_alive():
            self.send(Stop())
            self._proc.join(timeout)
            if self._proc.is_alive():
                log.warning("the engine process did not stop within %.1f s: killed", timeout)
                self._proc.kill()
                self._proc.join(5)
        self._outbox.put(None)              # the writer's end

    @property
    def alive(self) -> bool:
        return self._proc.is_alive()

    def _write(self, receive) -> None:
        """The writer's thread: the queue into the pipe (here a full pipe waits)."""
        while True:
            message = self._outbox.get()
            if message is None:
                return
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:   # the child is gone: the reader says so
                log.debug("sending to the engine process failed: %s", exc)
                return

    def _read(self, receive) -> None:
        """The reader's thread: every message from the child, in order, until it stops
        or dies. Messages that wait in the pipe are read together (at most
        ``READ_AT_ONCE``) and consecutive steps handed on as one (:func:`.messages.merged`):
        a reader that fell behind the core catches up in fewer, larger pieces of work,
        so the pipe does not fill and hold the engine up."""
        try:
            while True:
                batch = [self._conn.recv()]
                while len(batch) < READ_AT_ONCE and self._conn.poll():
                    batch.append(self._conn.recv())
                for message in merged(batch):
                    receive(message)
                    if isinstance(message, (Stopped, Dead)):
                        return
        except (EOFError, OSError):
            if not self._ending.is_set():
                self._proc.join(5)
                receive(Dead(f"the engine process ended (exit status "
                             f"{self._proc.exitcode})"))
        except BaseException as exc:  # noqa: BLE001 (a bug here: say so, answer everyone)
            log.exception("reading from the engine process failed")
            receive(Dead(f"reading from the engine process failed: {exc}"))


def pipe_take(conn):
    """The core's ``take`` over its end of the pipe: every command waiting, after waiting
    up to ``wait`` seconds for the first (None: not at all)."""
    def take(wait):
        out = []
        if wait is None or conn.poll(wait):
            while conn.poll():
                out.append(conn.recv())
        return out
    return take


def _child(conn, spec, max_waiting, pool_interval, log_level) -> None:
    """The engine's process: make the engine, say it is ready, then serve the pipe."""
    from .start import make_engine
    logging.basicConfig(level=log_level, format="%(levelname)s: %(message)s")
    try:
        engine, info = make_engine(spec)
    except BaseException as exc:  # noqa: BLE001 (reported to the parent, then exit 1)
        log.exception("making the engine failed")
        conn.send(Dead(f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None
    core = EngineCore(engine, max_waiting=max_waiting, pool_interval=pool_interval)
    conn.send(Ready(engine.config, info, core.stats()))

    take = pipe_take(conn)
    try:
        if not run_core(core, take, conn.send):
            raise SystemExit(1)
    except (EOFError, OSError):                  # the parent is gone: nothing to serve
        raise SystemExit(0) from None
