"""The HTTP layer: it only translates. A request body becomes a :class:`~.loop.Job` for
the engine loop; the loop's events become OpenAI chunks (server-sent events) or one JSON
answer. A stream whose client goes away is cancelled, which frees its blocks.

Nothing here waits without a deadline, and nothing slow runs on the event loop: a body is
read within a time limit and a size limit (:mod:`.limits`), then parsed, checked and
tokenized on a worker thread. Events cross from the engine's thread in batches (one
wake-up of the event loop for everything a step produced), and a stream that falls behind
sends what has piled up as one chunk rather than one chunk a token.
"""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import metrics
from .limits import Guard, Limits, read_body
from .loop import Job
from .protocol import ApiError, Ids, parse_body, parse_chat, parse_completion

__all__ = ["create_app", "Mailbox", "coalesce"]

log = logging.getLogger("pagedkv.serve")
STATIC = resources.files("pagedkv.serve") / "static"
DISCONNECT_POLL = 0.25   # seconds between checks of a non-streaming request's client
ANSWER_TIMEOUT = 60.0    # seconds for the engine to accept or refuse a request
POOL_MAX_AGE = 0.25      # seconds a GET /pool answer is reused for other callers


def _error(exc: ApiError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class Mailbox:
    """Events from the engine's thread into one event loop, in order. The engine's thread
    only appends to a list; the event loop is woken once for all that piled up (waking
    it costs a system call, and a step makes an event for every request)."""

    def __init__(self, aloop):
        self.aloop, self.lock, self.pending = aloop, threading.Lock(), []

    def put(self, queue: asyncio.Queue, event: dict) -> None:     # any thread
        with self.lock:
            self.pending.append((queue, event))
            if len(self.pending) > 1:
                return                          # a wake-up is on its way already
        self.aloop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:                 # the event loop
        with self.lock:
            batch, self.pending = self.pending, []
        for queue, event in batch:
            queue.put_nowait(event)


class Channel:
    """A job's events, carried from the engine's thread into this event loop."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox, self.queue = mailbox, asyncio.Queue()

    def emit(self, event: dict) -> None:       # called on the engine's thread
        self.mailbox.put(self.queue, event)

    async def get(self) -> dict:
        return await self.queue.get()

    async def get_all(self) -> list:
        """The next event and every one already waiting behind it."""
        events = [await self.queue.get()]
        while not self.queue.empty():
            events.append(self.queue.get_nowait())
        return events


def coalesce(events: list) -> list:
    """Consecutive deltas of one choice as one delta (their texts joined): a stream that
    fell behind catches up in one chunk."""
    out = []
    for ev in events:
        last = out[-1] if out else None
        if ev["type"] == "delta" and last is not None and last["type"] == "delta" and \
                last["index"] == ev["index"] and last["finish_reason"] is None:
            out[-1] = dict(last, text=last["text"] + ev["text"],
                           finish_reason=ev["finish_reason"])
        else:
            out.append(ev)
    return out


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def create_app(loop, served, limits: Limits | None = None, *, audit: bool = False):
    """The application over a started :class:`~.loop.EngineLoop` and its
    :class:`~.models.Served` model, behind the front door's checks (:class:`Limits`).
    ``audit``: ``GET /pool`` runs the pool's audit too (O(blocks), on the engine's
    thread)."""
    limits = limits or Limits()
    registry = metrics.registry_for(loop)
    parsing = ThreadPoolExecutor(2, thread_name_prefix="pagedkv-parse")
    mailboxes: dict = {}

    def mailbox() -> Mailbox:
        aloop = asyncio.get_running_loop()
        box = mailboxes.get(aloop)
        if box is None:
            box = mailboxes[aloop] = Mailbox(aloop)
        return box

    def dead_error() -> ApiError:
        return ApiError(f"the engine is not running: {loop.dead}", status=503,
                        kind="server_error")

    def read(parse, raw: bytes):
        """On a worker thread: the body parsed, checked against the model, tokenized."""
        try:
            return parse(parse_body(raw), served)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 (a bug: the request fails, cleanly)
            log.exception("reading a request failed")
            raise ApiError(f"the server could not read the request: {exc}", status=500,
                           kind="server_error") from None

    async def start(spec):
        """Submit the job; wait (bounded) for the engine's answer: accepted or refused."""
        if loop.stopping:
            raise ApiError("the server is shutting down", status=503, kind="server_error")
        if loop.dead:
            raise dead_error()
        channel = Channel(mailbox())
        job = Job(spec.prompt, spec.params, channel.emit, spec.stop, spec.want_pool,
                  spec.stream)
        loop.submit(job)
        try:
            first = await asyncio.wait_for(channel.get(), ANSWER_TIMEOUT)
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:
            loop.cancel(job)                    # (queued after the submit: runs after it)
            if isinstance(exc, asyncio.CancelledError):
                raise                           # the client went away first
            raise ApiError(f"the engine did not answer within {ANSWER_TIMEOUT:g} s",
                           status=503, kind="server_error") from None
        if first["type"] == "rejected":
            kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(
                first["status"], "server_error")
            raise ApiError(first["message"], first["param"], first["status"], kind=kind)
        return job, channel

    async def stream(job, channel, ids, spec):
        started, cancelled = set(), True
        try:
            while True:
                out = []
                for ev in coalesce(await channel.get_all()):
                    if ev["type"] == "delta":
                        first = ev["index"] not in started
                        started.add(ev["index"])
                        choice = ids.delta_choice(ev["index"], ev["text"],
                                                  ev["finish_reason"], first)
                        out.append(_sse(ids.chunk([choice])))
                    elif ev["type"] == "pool":
                        out.append(_sse(ids.chunk([], pool=ev["pool"])))
                    elif ev["type"] == "error":
                        cancelled = False
                        out.append(_sse(ApiError(ev["message"], status=500,
                                                 kind="server_error").body()))
                        yield b"".join(out)
                        return
                    elif ev["type"] == "done":
                        cancelled = False
                        if ev.get("cancelled"):          # (the server is stopping)
                            out.append(_sse(ApiError("the server is shutting down",
                                                     status=503, kind="server_error").body()))
                        else:
                            if spec.include_usage:
                                out.append(_sse(ids.chunk([], usage=ev["usage"])))
                            out.append(b"data: [DONE]\n\n")
                        yield b"".join(out)
                        return
                if out:
                    yield b"".join(out)
        finally:                                # the client went away mid-stream
            if cancelled:
                loop.cancel(job)

    async def collect(request, job, channel, ids):
        n = job.params.n
        texts, reasons = [""] * n, [None] * n
        checked = time.monotonic()
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(channel.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    ev = None
                if time.monotonic() - checked >= DISCONNECT_POLL:
                    checked = time.monotonic()
                    if await request.is_disconnected():     # nobody is waiting for it
                        loop.cancel(job)
                        return Response(status_code=499)
                if ev is None or ev["type"] == "pool":
                    continue
                if ev["type"] == "delta":
                    texts[ev["index"]] += ev["text"]
                    reasons[ev["index"]] = ev["finish_reason"] or reasons[ev["index"]]
                elif ev["type"] == "error":
                    return _error(ApiError(ev["message"], status=500, kind="server_error"))
                elif ev.get("cancelled"):
                    return _error(ApiError("the server is shutting down", status=503,
                                           kind="server_error"))
                elif ev["type"] == "done":
                    return JSONResponse(ids.whole(texts, reasons, ev["usage"]))
        except asyncio.CancelledError:
            loop.cancel(job)
            raise

    async def generate(request: Request, parse):
        try:
            raw = await read_body(request, limits)
            spec = await asyncio.get_running_loop().run_in_executor(parsing, read, parse,
                                                                    raw)
            job, channel = await start(spec)
        except ApiError as exc:
            retry = {"Retry-After": "1"} if exc.status in (429, 503) else None
            return _error(exc, retry)
        ids = Ids(spec.kind, served.name)
        if spec.stream:
            return StreamingResponse(stream(job, channel, ids, spec),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, job, channel, ids)

    async def completions(request):
        return await generate(request, parse_completion)

    async def chat(request):
        return await generate(request, parse_chat)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "pagedkv",
             "max_model_len": served.context}]})

    async def health(request):
        """200 while the engine serves; 503, with the reason, once it cannot."""
        if loop.dead or not loop.alive:
            return _error(dead_error() if loop.dead else ApiError(
                "the engine loop is not running", status=503, kind="server_error"))
        return JSONResponse({"status": "ok"})

    last_look = {"at": -1e9, "answer": None}

    async def pool(request):
        """The pool, read on the engine's thread at most every POOL_MAX_AGE seconds
        however many clients ask (every other caller gets the same answer)."""
        now = time.monotonic()
        if last_look["answer"] is None or now - last_look["at"] > POOL_MAX_AGE:
            last_look.update(at=now, answer=asyncio.wrap_future(loop.pool(audit)))
        try:
            answer = await asyncio.wait_for(asyncio.shield(last_look["answer"]),
                                            ANSWER_TIMEOUT)
        except (RuntimeError, asyncio.TimeoutError) as exc:
            last_look["answer"] = None
            return _error(ApiError(f"the engine did not answer: {exc}", status=503,
                                   kind="server_error"))
        return JSONResponse(answer)

    async def prometheus(request):
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    async def index(request):
        return FileResponse(str(STATIC / "index.html"))

    async def http_error(request, exc: HTTPException):
        # an unknown path or method, in OpenAI's error shape like everything else
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(f"{request.method} {request.url.path}: {exc.detail}",
                               status=exc.status_code, kind=kind))

    app = Starlette(exception_handlers={HTTPException: http_error}, routes=[
        Route("/", index),
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/pool", pool),
        Route("/metrics", prometheus),
        Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
    ])
    return Guard(_Alive(app, loop, dead_error), limits)


class _Alive:
    """ASGI middleware: once the engine is dead, every endpoint but ``/metrics`` (and
    ``/health``, which says why) answers 503."""

    def __init__(self, app, loop, dead_error):
        self.app, self.loop, self.dead_error = app, loop, dead_error

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.loop.dead and \
                scope["path"] not in ("/metrics", "/health"):
            await _error(self.dead_error())(scope, receive, send)
            return
        await self.app(scope, receive, send)
