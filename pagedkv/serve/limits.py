"""What one client may cost the others, and who may ask: the server's front door.

Well-kept pieces do what they can:

* **Host** (a DNS name rebound to 127.0.0.1 is refused): Starlette's
  ``TrustedHostMiddleware``, on the names of the address the server is bound to
  (``127.0.0.1``, ``localhost`` and ``[::1]`` on loopback), or ``--allowed-host``'s;
* **CORS** for ``--allow-origin``'s pages (preflights answered, responses readable):
  Starlette's ``CORSMiddleware``;
* **connections**: uvicorn's ``limit_concurrency`` answers a request with 503 once
  ``--max-connections`` are open (its plain-text 503 goes around the application, so it
  is the one refusal that is not an OpenAI error object), and its ``timeout_keep_alive``
  closes a kept-alive connection that stays idle.

What stays ours, because they cannot do it:

* **a deadline on every request head** (:func:`protocol_class`): uvicorn bounds no head.
  A connection that has not sent a whole head within ``--read-timeout`` seconds of
  opening, or of its last response ending, is closed (h11 still waiting for the head, or
  still receiving a body after the answer was sent);
* **bodies**: at most ``--max-body`` bytes (413), read within ``--read-timeout`` seconds
  (408); a client that goes away mid-body is one line in the log (:func:`read_body`);
* **the Origin, the API key and the Content-Type** (:class:`Guard`): CORS tells a browser
  which answers a page may read, not which requests may run, so a request from another
  site's page is refused here (403) unless ``--allow-origin`` names it; with
  ``--api-key`` every endpoint but the page (and, by default, ``/health`` and
  ``/metrics``) needs ``Authorization: Bearer KEY`` (401); a ``POST`` body must be
  ``application/json`` (415), which a page on another site cannot send without asking;
* **the page's security headers**, and **refusals in OpenAI's shape**
  (:class:`PlainErrors`: the Starlette middlewares answer in plain text).
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import secrets
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.requests import ClientDisconnect

from .protocol import ApiError, quote

__all__ = ["Limits", "Guard", "PlainErrors", "front_door", "read_body", "protocol_class",
           "raise_open_files_limit", "ClientGone", "LOOPBACK_NAMES", "PAGE_HEADERS"]

log = logging.getLogger("pagedkv.serve")
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")
#: What the chat page (``/`` and ``/static``) is sent with: its own scripts and styles
#: only, never in a frame, never sniffed as another type, no referrer.
PAGE_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; img-src 'self' data:; "
                                 b"base-uri 'none'; form-action 'self'; "
                                 b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"), (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer")]


@dataclass(frozen=True)
class Limits:
    max_body: int = 1 << 20            # bytes of a request body (1 MiB)
    read_timeout: float = 30.0         # seconds for a request's head, and for its body
    max_connections: int = 1000
    host: str = "127.0.0.1"            # the address the server is bound to
    allowed_hosts: tuple = ()          # Host names besides the bound address's ("*": any)
    allow_origins: tuple = ()          # other sites whose pages may call it ("*": any)
    api_key: str | None = None
    key_for_probes: bool = False       # /health and /metrics need the key too


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def allowed_hosts(limits: Limits) -> list:
    """The Host names the server answers to: ``--allowed-host``'s and the bound
    address's (loopback's names on loopback); any, bound to every address (0.0.0.0 or
    ``::``) with no ``--allowed-host``."""
    if limits.host in ("0.0.0.0", "::", ""):
        return list(limits.allowed_hosts) or ["*"]
    own = LOOPBACK_NAMES if is_loopback(limits.host) else \
        (f"[{limits.host}]" if ":" in limits.host else limits.host,)
    return [*own, *limits.allowed_hosts]


def front_door(app, limits: Limits):
    """``app`` behind the checks, outermost first: refusals reshaped, CORS, Host, then
    :class:`Guard`'s."""
    hosts = allowed_hosts(limits)
    app = TrustedHostMiddleware(Guard(app, limits), allowed_hosts=hosts, www_redirect=False)
    if limits.allow_origins:
        app = CORSMiddleware(app, allow_origins=list(limits.allow_origins),
                             allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"],
                             expose_headers=["Retry-After"])

    def explain(scope, text: str) -> tuple:
        headers = dict(scope["headers"])
        if text == "Invalid host header":
            host = headers.get(b"host", b"").decode("latin-1")
            return "invalid_request_error", (
                f"Host {quote(host)} is not this server's; it answers to "
                f"{', '.join(hosts)} (--allowed-host names more)")
        if text.startswith("Disallowed CORS"):
            origin = headers.get(b"origin", b"").decode("latin-1")
            return "permission_error", f"{text} ({quote(origin)}; see --allow-origin)"
        return "invalid_request_error", text
    return PlainErrors(app, explain)


class PlainErrors:
    """ASGI middleware: a refusal sent as plain text by what it wraps goes out as an
    OpenAI error object (same status and headers), in ``explain(scope, text)``'s words
    (a pair: the error's type and its message)."""

    def __init__(self, app, explain):
        self.app, self.explain = app, explain

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = None

        async def reshape(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400 and \
                    dict(message.get("headers", ())).get(b"content-type", b"") \
                    .startswith(b"text/plain"):
                start = message               # held until its body comes
                return
            if start is None or message["type"] != "http.response.body":
                return await send(message)
            kind, text = self.explain(scope, message.get("body", b"").decode("utf-8",
                                                                               "replace"))
            body = json.dumps(ApiError(text, status=start["status"], kind=kind).body())
            headers = [(k, v) for k, v in start.get("headers", ())
                       if k not in (b"content-type", b"content-length")]
            await send(dict(start, headers=headers + [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode())]))
            await send({"type": "http.response.body", "body": body.encode()})
        await self.app(scope, receive, reshape)


class Guard:
    """ASGI middleware: the ``Origin``, API-key and ``Content-Type`` checks before the
    application sees a request, and the page's security headers."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits
        self.key = None if limits.api_key is None else f"Bearer {limits.api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        problem = self.check(scope)
        if problem is not None:
            status, kind, message = problem
            body = json.dumps(ApiError(message, status=status, kind=kind,
                                       code="invalid_api_key" if status == 401 else None)
                              .body()).encode()
            await send({"type": "http.response.start", "status": status, "headers": [
                (b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        if scope["path"] == "/" or scope["path"].startswith("/static/"):
            async def page(message):
                if message["type"] == "http.response.start":
                    message = dict(message, headers=[*message.get("headers", ()),
                                                     *PAGE_HEADERS])
                await send(message)
            return await self.app(scope, receive, page)
        await self.app(scope, receive, send)

    def check(self, scope) -> tuple | None:
        """None, or (status, error type, message) for a request that is refused."""
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        origin = headers.get("origin")
        if origin is not None:
            origin = origin.decode("latin-1")
            own = "http://" + headers.get("host", b"").decode("latin-1")
            if origin != own and "*" not in self.limits.allow_origins and \
                    origin not in self.limits.allow_origins:
                return 403, "permission_error", (
                    f"Origin {quote(origin)} may not use this server (its own pages may; "
                    f"others need --allow-origin)")
        if self.key is not None and self._needs_key(scope["path"]) and \
                not secrets.compare_digest(headers.get("authorization", b""), self.key):
            given = "no key" if "authorization" not in headers else "a wrong key"
            return 401, "invalid_request_error", (
                f"this server needs its API key (Authorization: Bearer KEY, as given with "
                f"--api-key); the request has {given}")
        if scope["method"] == "POST":
            kind = headers.get("content-type", b"").decode("latin-1")
            kind = kind.split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, "invalid_request_error", (
                    f"a request body must be application/json, got "
                    f"{quote(kind) if kind else 'no Content-Type'}")
        return None

    def _needs_key(self, path: str) -> bool:
        if path == "/" or path.startswith("/static/"):
            return False
        return self.limits.key_for_probes or path not in ("/health", "/metrics")


class ClientGone(Exception):
    """The client went away while its request was being read."""


async def read_body(request, limits: Limits) -> bytes:
    """The request's body, at most ``max_body`` bytes (413) within ``read_timeout``
    seconds (408). A client that goes away meanwhile is a line in the log and
    :class:`ClientGone`."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body:
        raise _too_large(int(declared), limits)
    parts, size = [], 0

    async def read():
        nonlocal size
        async for chunk in request.stream():
            size += len(chunk)
            if size > limits.max_body:
                raise _too_large(size, limits)
            parts.append(chunk)
    try:
        await asyncio.wait_for(read(), limits.read_timeout)
    except asyncio.TimeoutError:
        raise ApiError(f"the request body did not arrive within {limits.read_timeout:g} s "
                       f"({size} bytes came)", status=408) from None
    except ClientDisconnect:
        log.info("a client went away while sending %s %s (%d of %s bytes came)",
                 request.method, request.url.path, size, declared or "?")
        raise ClientGone() from None
    return b"".join(parts)


def _too_large(size: int, limits: Limits) -> ApiError:
    return ApiError(f"the request body has {size}+ bytes; at most {limits.max_body} are "
                    f"accepted (--max-body)", status=413)


def protocol_class(limits: Limits):
    """uvicorn's HTTP/1.1 protocol with a deadline on every request head: armed when the
    connection opens and again when each response ends; when it passes, the connection
    is closed if h11 is still waiting for a whole head, or still receiving a body it has
    already answered."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadDeadline(H11Protocol):
        deadline = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def on_response_complete(self):
            super().on_response_complete()
            self._arm()

        def _arm(self):
            if self.deadline is not None:
                self.deadline.cancel()
            self.deadline = self.loop.call_later(limits.read_timeout, self._late)

        def _late(self):
            c = self.conn
            late = c.their_state is h11.IDLE or \
                (c.our_state is h11.DONE and c.their_state is not h11.DONE)
            if late and not self.transport.is_closing():
                self.transport.close()

        def connection_lost(self, exc):
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

    return HeadDeadline


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to its hard limit (as servers do, so
    that ``max_connections`` rather than the system's default bounds them); the limit."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft
