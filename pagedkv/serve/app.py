"""The HTTP layer: it only translates. A request body becomes a :class:`~.texts.Job` for the
engine's client; the job's events become OpenAI chunks (server-sent events) or one JSON
answer. A stream whose client goes away is cancelled, which frees its blocks.

Nothing on the event loop waits for the engine: a submit or a cancel is a message put in
a queue (:mod:`.transport`), and the answer comes back as an event. Nothing here waits
without a deadline either: a body is read within a time and a size limit
(:mod:`.limits`); a request the engine has not answered, or a stream it has stopped
feeding, ends when the client's watchdog says the engine has stalled (:mod:`.client`).
Nothing slow runs on the event loop: a body is parsed, checked and tokenized on a worker
thread (large bodies on one of their own, so that they never hold up the small ones).
Events cross from the engine's side in batches, one wake-up of the event loop for all a
step brought, and a stream that falls behind sends what has piled up as one chunk.
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
from .limits import ClientGone, Limits, front_door, read_body
from .protocol import ApiError, Ids, parse_body, parse_chat, parse_completion
from .texts import Delta, Done, Failed, Job, PoolMap, Rejected

__all__ = ["create_app", "Mailbox", "coalesce"]

log = logging.getLogger("pagedkv.serve")
STATIC = resources.files("pagedkv.serve") / "static"
DISCONNECT_POLL = 0.25   # seconds between checks of a non-streaming request's client
POOL_MAX_AGE = 0.25      # seconds a GET /pool answer is reused for other callers
LARGE_BODY = 64 << 10    # bytes: a body this large is read by the large bodies' worker
RETRY_AFTER = {"Retry-After": "1"}


def _error(exc: ApiError) -> JSONResponse:
    headers = RETRY_AFTER if exc.status in (429, 503) else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


def _server_error(message: str, status: int) -> ApiError:
    return ApiError(message, status=status, kind="server_error")


class Mailbox:
    """Events into one event loop, in order, from another thread: that thread only
    appends to a list; the event loop is woken once for all that piled up (waking it
    costs a system call, and a step makes events for every request)."""

    def __init__(self, aloop):
        self.aloop, self.lock, self.pending = aloop, threading.Lock(), []

    def put(self, queue: asyncio.Queue, events: list) -> None:   # any thread
        with self.lock:
            self.pending.append((queue, events))
            if len(self.pending) > 1:
                return                          # a wake-up is on its way already
        try:
            self.aloop.call_soon_threadsafe(self._deliver)
        except RuntimeError:                    # the event loop has closed: nobody reads
            log.debug("events for a closed event loop dropped")

    def _deliver(self) -> None:                 # the event loop
        with self.lock:
            batch, self.pending = self.pending, []
        for queue, events in batch:
            queue.put_nowait(events)


class Channel:
    """A job's events, carried into this event loop."""

    def __init__(self, mailbox: Mailbox):
        self.mailbox, self.queue = mailbox, asyncio.Queue()

    def put(self, events: list) -> None:        # the job's emit: the engine's side
        self.mailbox.put(self.queue, events)

    async def get(self) -> list:
        """The events that wait (at least one list's)."""
        events = list(await self.queue.get())
        while not self.queue.empty():
            events += self.queue.get_nowait()
        return events


def coalesce(events: list) -> list:
    """Consecutive deltas of one choice as one delta (their texts joined): a stream that
    fell behind catches up in one chunk."""
    out = []
    for ev in events:
        last = out[-1] if out else None
        if isinstance(ev, Delta) and isinstance(last, Delta) and \
                last.index == ev.index and last.finish_reason is None:
            out[-1] = Delta(ev.index, last.text + ev.text, ev.finish_reason)
        else:
            out.append(ev)
    return out


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def sse_chunks(events, ids: Ids, include_usage: bool, started: set) -> tuple:
    """A stream's events as (bytes to send, whether the stream has ended). The last
    chunk carries the request's ``timings`` (the usage chunk, if asked for)."""
    chunks, end, done = [], False, b""
    for ev in coalesce(events):
        if isinstance(ev, Delta):
            choice = ids.delta_choice(ev.index, ev.text, ev.finish_reason,
                                      ev.index not in started)
            started.add(ev.index)
            chunks.append(ids.chunk([choice]))
        elif isinstance(ev, PoolMap):
            chunks.append(ids.chunk([], pool=ev.pool))
        elif isinstance(ev, Failed):
            chunks.append(_server_error(ev.message, ev.status).body())
            end = True
            break
        elif isinstance(ev, Done):
            if include_usage or not chunks or not chunks[-1]["choices"]:
                chunks.append(ids.chunk([], usage=ev.usage if include_usage else None))
            chunks[-1]["timings"] = ev.timings
            end, done = True, b"data: [DONE]\n\n"
            break
    return b"".join(map(_sse, chunks)) + done, end


def create_app(client, served, limits: Limits | None = None, *, audit: bool = False):
    """The application over a started :class:`~.client.EngineClient` and its
    :class:`~.models.Served` model, behind the front door (:func:`~.limits.front_door`).
    ``audit``: ``GET /pool`` runs the pool's audit too (O(blocks), where the engine
    runs)."""
    limits = limits or Limits()
    registry = metrics.registry_for(client)
    parsers = (ThreadPoolExecutor(2, thread_name_prefix="pagedkv-parse"),
               ThreadPoolExecutor(1, thread_name_prefix="pagedkv-parse-large"))
    mailboxes: dict = {}
    answer_timeout = client.stall_timeout + 10   # (the watchdog answers first)

    def mailbox() -> Mailbox:
        aloop = asyncio.get_running_loop()
        box = mailboxes.get(aloop)
        if box is None:
            box = mailboxes[aloop] = Mailbox(aloop)
        return box

    def read(parse, raw: bytes):
        """On a worker thread: the body parsed, checked against the model, tokenized."""
        try:
            return parse(parse_body(raw), served)
        except ApiError:
            raise
        except Exception as exc:  # noqa: BLE001 (a bug: the request fails, cleanly)
            log.exception("reading a request failed")
            raise _server_error(f"the server could not read the request: {exc}",
                                500) from None

    async def start(spec, arrived: float):
        """Submit the job; wait for the engine's answer: accepted or refused."""
        channel = Channel(mailbox())
        job = Job(spec.prompt, spec.params, channel.put, spec.stop, spec.want_pool,
                  spec.stream, arrived=arrived)
        refused = client.submit(job)            # (never waits)
        try:
            first = [refused] if refused is not None else \
                await asyncio.wait_for(channel.get(), answer_timeout)
        except (asyncio.CancelledError, asyncio.TimeoutError) as exc:
            client.cancel(job)
            if isinstance(exc, asyncio.CancelledError):
                raise                           # the client went away first
            raise _server_error(f"the engine did not answer within {answer_timeout:g} s",
                                503) from None
        if isinstance(first[0], Rejected):
            r = first[0]
            kind = {429: "rate_limit_error", 400: "invalid_request_error"}.get(
                r.status, "server_error")
            raise ApiError(r.message, r.param, r.status, kind=kind)
        return job, channel, first[1:]

    async def stream(job, channel, ids, spec, events):
        started, cancelled = set(), True
        try:
            while True:
                out, end = sse_chunks(events, ids, spec.include_usage, started)
                if out:
                    yield out
                if end:
                    cancelled = False
                    return
                events = await channel.get()
        finally:                                # the client went away mid-stream
            if cancelled:
                client.cancel(job)

    async def collect(request, job, channel, ids, events):
        n = job.params.n
        texts, reasons = [""] * n, [None] * n
        checked = time.monotonic()
        try:
            while True:
                for ev in events:
                    if isinstance(ev, Delta):
                        texts[ev.index] += ev.text
                        reasons[ev.index] = ev.finish_reason or reasons[ev.index]
                    elif isinstance(ev, Failed):
                        return _error(_server_error(ev.message, ev.status))
                    elif isinstance(ev, Done):
                        return JSONResponse(ids.whole(texts, reasons, ev.usage, ev.timings))
                try:
                    events = await asyncio.wait_for(channel.get(), DISCONNECT_POLL)
                except asyncio.TimeoutError:
                    events = []
                if time.monotonic() - checked >= DISCONNECT_POLL:
                    checked = time.monotonic()
                    if await request.is_disconnected():     # nobody is waiting for it
                        client.cancel(job)
                        return Response(status_code=499)
        except asyncio.CancelledError:
            client.cancel(job)
            raise

    async def generate(request: Request, parse):
        arrived = time.monotonic()
        try:
            raw = await read_body(request, limits)
            parser = parsers[len(raw) > LARGE_BODY]
            spec = await asyncio.get_running_loop().run_in_executor(parser, read, parse,
                                                                    raw)
            job, channel, events = await start(spec, arrived)
        except ApiError as exc:
            return _error(exc)
        except ClientGone:
            return Response(status_code=499)    # (nobody reads it)
        ids = Ids(spec.kind, served.name)
        if spec.stream:
            return StreamingResponse(stream(job, channel, ids, spec, events),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await collect(request, job, channel, ids, events)

    async def completions(request):
        return await generate(request, parse_completion)

    async def chat(request):
        return await generate(request, parse_chat)

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": served.name, "object": "model", "created": 0, "owned_by": "pagedkv",
             "max_model_len": served.context}]})

    async def health(request):
        """200 while the engine serves; 503, with the reason, while it is stalled, once
        it is dead, and while the server stops."""
        problem = client.health()
        if problem is not None:
            return _error(_server_error(problem, 503))
        return JSONResponse({"status": "ok"})

    last_look = {"at": -1e9, "answer": None}

    async def pool(request):
        """The pool, read where the engine runs at most every POOL_MAX_AGE seconds
        however many clients ask (every other caller gets the same answer)."""
        now = time.monotonic()
        if last_look["answer"] is None or now - last_look["at"] > POOL_MAX_AGE:
            last_look.update(at=now, answer=asyncio.wrap_future(client.pool(audit)))
        try:
            answer = await asyncio.wait_for(asyncio.shield(last_look["answer"]),
                                            answer_timeout)
        except (RuntimeError, asyncio.TimeoutError) as exc:
            last_look["answer"] = None
            return _error(_server_error(f"the engine did not answer: {exc}", 503))
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
    return front_door(_Alive(app, client), limits)


class _Alive:
    """ASGI middleware: once the engine is dead, every endpoint but ``/metrics`` (and
    ``/health``, which says why) answers 503."""

    def __init__(self, app, client):
        self.app, self.client = app, client

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and self.client.dead and \
                scope["path"] not in ("/metrics", "/health"):
            await _error(_server_error(self.client.health(), 503))(scope, receive, send)
            return
        await self.app(scope, receive, send)
