"""What one client may cost the others: the bounds the server keeps at its front door.

* **Connections**: at most ``max_connections`` open at once (one more is closed as soon as
  it is accepted, so that file descriptors never run out), and a connection that has not
  sent a whole request head within ``read_timeout`` seconds is closed.
* **Bodies**: at most ``max_body`` bytes (413), read within ``read_timeout`` seconds (408).
* **Who may ask**: a request's ``Host`` must name this server (with the default loopback
  address: ``127.0.0.1``, ``localhost`` or ``::1``), and a browser's ``Origin`` must be
  this server's own page or one given with ``--allow-origin``. A page on another site or
  port cannot make the server generate, and a DNS name rebound to 127.0.0.1 is refused.
* **What it sends**: a ``POST`` body must be ``application/json`` (415 otherwise), which a
  browser never sends across origins without asking first.

Each refusal is an OpenAI error object, as everywhere else in the server.
"""
from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from .protocol import ApiError

__all__ = ["Limits", "Guard", "read_body", "protocol_class", "raise_open_files_limit"]

log = logging.getLogger("pagedkv.serve")
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass(frozen=True)
class Limits:
    max_body: int = 1 << 20            # bytes of a request body (1 MiB)
    read_timeout: float = 30.0         # seconds for a request's head, and for its body
    max_connections: int = 1000
    host: str = "127.0.0.1"            # the address the server is bound to
    allow_origins: frozenset = field(default_factory=frozenset)   # "*": any origin


def _hostname(value: str) -> str:
    """The name part of a ``Host`` header or a URL's netloc (no port, no brackets)."""
    return (urlsplit("//" + value).hostname or "").lower()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def allowed_hosts(limits: Limits) -> frozenset | None:
    """The names a ``Host`` header may give, or None for any (bound to every address, or
    ``--allow-origin '*'``)."""
    if "*" in limits.allow_origins or limits.host in ("0.0.0.0", "::", ""):
        return None
    names = set(LOOPBACK_NAMES) if _is_loopback(limits.host) else {limits.host.lower()}
    names |= {_hostname(urlsplit(o).netloc) for o in limits.allow_origins}
    return frozenset(names)


class Guard:
    """ASGI middleware: the ``Host``, ``Origin`` and ``Content-Type`` checks, before the
    application sees the request."""

    def __init__(self, app, limits: Limits):
        self.app, self.limits = app, limits
        self.hosts = allowed_hosts(limits)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            problem = self.check(scope)
            if problem is not None:
                status, kind, message = problem
                body = json.dumps(ApiError(message, status=status, kind=kind).body())
                await send({"type": "http.response.start", "status": status, "headers": [
                    (b"content-type", b"application/json"), (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": body.encode()})
                return
        await self.app(scope, receive, send)

    def check(self, scope) -> tuple | None:
        """None, or (status, error type, message) for a request that is refused."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        host = headers.get("host", "")
        if self.hosts is not None and _hostname(host) not in self.hosts:
            return 400, "invalid_request_error", (
                f"Host {host!r} is not this server's; it answers to "
                f"{', '.join(sorted(self.hosts))} (see --allow-origin)")
        origin = headers.get("origin")
        if origin is not None and origin != f"http://{host}" and \
                "*" not in self.limits.allow_origins and \
                origin not in self.limits.allow_origins:
            return 403, "permission_error", (
                f"Origin {origin!r} may not use this server (its own pages may; "
                f"others need --allow-origin)")
        if scope["method"] == "POST":
            kind = headers.get("content-type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                return 415, "invalid_request_error", (
                    f"a request body must be application/json, got "
                    f"{kind or 'no Content-Type'!r}")
        return None


async def read_body(request, limits: Limits) -> bytes:
    """The request's body, at most ``max_body`` bytes (413) within ``read_timeout``
    seconds (408)."""
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
    return b"".join(parts)


def _too_large(size: int, limits: Limits) -> ApiError:
    return ApiError(f"the request body has {size}+ bytes; at most {limits.max_body} are "
                    f"accepted (--max-body)", status=413)


def protocol_class(limits: Limits):
    """uvicorn's HTTP/1.1 protocol, with the connection cap and the head's deadline."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class BoundedH11(H11Protocol):
        refused = False
        deadline = None

        def connection_made(self, transport):
            if len(self.connections) >= limits.max_connections:
                self.refused = True             # never registered: nothing to undo
                transport.abort()
                _warn_once(f"{limits.max_connections} connections are open: new ones "
                           f"are closed (--max-connections)")
                return
            super().connection_made(transport)
            self.deadline = self.loop.call_later(limits.read_timeout, self._head_late)

        def _head_late(self):
            if self.cycle is None and not self.transport.is_closing():
                self.transport.close()          # no whole request head in time

        def connection_lost(self, exc):
            if self.refused:
                return
            if self.deadline is not None:
                self.deadline.cancel()
            super().connection_lost(exc)

    return BoundedH11


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


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
