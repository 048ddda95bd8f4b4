"""The HTTP layer: it only translates. A request body becomes a :class:`~.loop.Job` for
the engine loop; the loop's events become OpenAI chunks (server-sent events) or one JSON
answer. A stream whose client goes away is cancelled, which frees its blocks.
"""
from __future__ import annotations

import asyncio
import json
import time
from importlib import resources

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from . import metrics
from .loop import Job, pool_counts, pool_map
from .protocol import ApiError, Ids, parse_chat, parse_completion

__all__ = ["create_app"]

STATIC = resources.files("pagedkv.serve") / "static"
DISCONNECT_POLL = 0.25   # seconds between checks of a non-streaming request's client


def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


class Channel:
    """A job's events, carried from the engine's thread into this event loop."""

    def __init__(self):
        self.aloop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def emit(self, event: dict) -> None:       # called on the engine's thread
        self.aloop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self) -> dict:
        return await self.queue.get()


async def _body(request: Request):
    raw = await request.body()
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ApiError(f"the request body is not valid JSON ({len(raw)} bytes)") from None


def _sse(obj) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


def create_app(loop, served) -> Starlette:
    """The application over a started :class:`~.loop.EngineLoop` and its
    :class:`~.models.Served` model."""
    registry = metrics.registry_for(loop)

    async def start(spec):
        """Submit the job; wait for the engine's answer (accepted or refused)."""
        if loop.stopping:
            raise ApiError("the server is shutting down", status=503, kind="server_error")
        channel = Channel()
        job = Job(spec.prompt, spec.params, channel.emit, spec.stop, spec.want_pool)
        loop.submit(job)
        try:
            first = await channel.get()
        except asyncio.CancelledError:          # gone before the engine answered
            loop.cancel(job)                    # (queued after the submit: runs after it)
            raise
        if first["type"] == "rejected":
            kind = {429: "rate_limit_error", 503: "server_error"}.get(
                first["status"], "invalid_request_error")
            raise ApiError(first["message"], first["param"], first["status"], kind=kind)
        return job, channel

    async def stream(job, channel, ids, spec):
        started, cancelled = set(), True
        try:
            while True:
                ev = await channel.get()
                if ev["type"] == "delta":
                    first = ev["index"] not in started
                    started.add(ev["index"])
                    choice = ids.delta_choice(ev["index"], ev["text"], ev["finish_reason"],
                                              first)
                    yield _sse(ids.chunk([choice]))
                elif ev["type"] == "pool":
                    yield _sse(ids.chunk([], pool=ev["pool"]))
                elif ev["type"] == "error":
                    cancelled = False
                    yield _sse(ApiError(ev["message"], kind="server_error").body())
                    return
                elif ev["type"] == "done" and ev.get("cancelled"):
                    cancelled = False                # (the server is stopping)
                    yield _sse(ApiError("the server is shutting down",
                                        kind="server_error").body())
                    return
                elif ev["type"] == "done":
                    cancelled = False
                    if spec.include_usage:
                        yield _sse(ids.chunk([], usage=ev["usage"]))
                    yield b"data: [DONE]\n\n"
                    return
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
                if ev is None:
                    continue
                if ev["type"] == "delta":
                    texts[ev["index"]] += ev["text"]
                    reasons[ev["index"]] = ev["finish_reason"] or reasons[ev["index"]]
                elif ev["type"] == "error" or ev.get("cancelled"):
                    message = ev.get("message", "the server is shutting down")
                    return _error(ApiError(message, status=500 if "message" in ev else 503,
                                           kind="server_error"))
                elif ev["type"] == "done":
                    return JSONResponse(ids.whole(texts, reasons, ev["usage"]))
        except asyncio.CancelledError:
            loop.cancel(job)
            raise

    async def generate(request: Request, parse):
        try:
            spec = parse(await _body(request), served)
            job, channel = await start(spec)
        except ApiError as exc:
            return _error(exc)
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

    async def pool(request):
        """The pool now, and the manager's audit (run on the engine's thread)."""
        def look(engine):
            m = engine.manager
            try:
                m.audit()
                audit = "ok"
            except Exception as exc:  # noqa: BLE001 (reported, not raised)
                audit = f"{type(exc).__name__}: {exc}"
            return dict(blocks=pool_map(m, {}), audit=audit, **pool_counts(m),
                        block_size=engine.block_size, running=len(engine.running),
                        waiting=len(engine.waiting), sequences=len(m.seq_ids))
        return JSONResponse(await asyncio.wrap_future(loop.call(look)))

    async def prometheus(request):
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    async def index(request):
        return FileResponse(str(STATIC / "index.html"))

    async def http_error(request, exc: HTTPException):
        # an unknown path or method, in OpenAI's error shape like everything else
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(f"{request.method} {request.url.path}: {exc.detail}",
                               status=exc.status_code, kind=kind))

    return Starlette(exception_handlers={HTTPException: http_error}, routes=[
        Route("/", index),
        Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/pool", pool),
        Route("/metrics", prometheus),
        Mount("/static", StaticFiles(directory=str(STATIC)), name="static"),
    ])
