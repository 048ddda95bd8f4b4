"""The front door (:mod:`pagedkv.serve.limits`) on a real uvicorn server in this process,
set up as ``python -m pagedkv.serve`` sets it up (its HTTP protocol with a deadline on every
head), over a core that answers at once: a body sent in pieces, bodies of exactly
``max_body`` bytes, the deadline on a request's head, and a body read without its
``Content-Length``. Each server binds 127.0.0.1 on a free port, every wait is bounded, and
the test stops it. The whole file runs in a few seconds (it is mutation.py's runner for
limits.py)."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from pagedkv.serve.app import create_app
from pagedkv.serve.client import EngineClient
from pagedkv.serve.limits import Limits, protocol_class, raise_open_files_limit
from pagedkv.serve.models import ByteTokenizer, Served
from pagedkv.serve.process import free_port

from _serving import Instant

MODEL = "tiny-random-llama"
TOK = ByteTokenizer()
JSON = {"Content-Type": "application/json"}
AT_ONCE = 5.0       # seconds that stand for "at once" against a --read-timeout of 30


@contextlib.contextmanager
def front(**limits):
    """A server on the application behind its front door, as ``main()`` runs it."""
    limits = Limits(**{"read_timeout": 30.0, **limits})
    served = Served(MODEL, None, TOK, 2048, ByteTokenizer.vocab_size, 13)
    client = EngineClient(Instant(), TOK).start()
    app = create_app(client, served, limits)

    async def asgi(scope, receive, send):   # (a function: mutmut's trampolines hide
        await app(scope, receive, send)      # from uvicorn that the app's __call__ is async)
    config = uvicorn.Config(asgi, host="127.0.0.1", interface="asgi3",
                            port=free_port(), log_level="warning", access_log=False,
                            limit_concurrency=limits.max_connections, lifespan="off",
                            http=protocol_class(limits), timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    end = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < end and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(10)
        client.stop()
        assert not thread.is_alive(), "the server did not stop"


def _connect(url: str, timeout: float = AT_ONCE) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=timeout)


def _post_head(url: str, head_end: bytes, what: str) -> bytes:
    """Send a POST /v1/completions head of JSON, ending with ``head_end`` (its last
    headers, the blank line and whatever of the body), and return the answer."""
    s = _connect(url)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\n" + head_end)
    reply = _answer(s, what)
    s.close()
    return reply


def _answer(s: socket.socket, what: str) -> bytes:
    """The next answer on ``s``, its head and its body (by its Content-Length); the test
    fails, saying ``what`` it waited for, if none comes within the socket's timeout."""
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            part = s.recv(4096)
            assert part, f"closed without an answer (waiting for {what}): {data[:200]}"
            data += part
        head, body = data.split(b"\r\n\r\n", 1)
        length = [int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                  if line.startswith(b"content-length:")]
        while len(body) < sum(length):
            part = s.recv(4096)
            assert part, f"closed mid-answer (waiting for {what}): {data[:200]}"
            body += part
    except socket.timeout:
        raise AssertionError(f"no answer within {s.gettimeout():g} s: expected {what}") \
            from None
    return head + b"\r\n\r\n" + body


def _padded(size: int) -> bytes:
    """A small completion's body, padded with spaces to exactly ``size`` bytes."""
    body = json.dumps(dict(model=MODEL, prompt="ok", max_tokens=2)).encode()
    assert len(body) <= size
    return body + b" " * (size - len(body))


def test_a_body_in_pieces_is_refused_as_it_passes_the_limit():
    """A chunked body sent in pieces, with pauses between them: no answer while it is
    under --max-body; 413 at once when a piece takes it past (the rest never sent), not
    after it has been read whole or when --read-timeout (30 s) ends it."""
    with front(max_body=1000) as url:
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        piece = b"%x\r\n%s\r\n" % (300, b" " * 300)
        for _ in range(3):                              # 900 bytes: under the limit
            s.sendall(piece)
            time.sleep(0.1)
        s.settimeout(0.3)
        with pytest.raises(socket.timeout):
            s.recv(1)                                   # nothing answered yet
        s.settimeout(AT_ONCE)
        s.sendall(piece)                                # 1,200 bytes: past it
        reply = _answer(s, "413 for a body past --max-body")
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"the request body has 1200+ bytes; at most 1000 are accepted" in reply
        s.close()


@pytest.mark.parametrize("how", ["declared", "streamed"])
def test_a_body_of_exactly_max_body_bytes_is_accepted(how):
    """A body of exactly --max-body bytes is answered (200), with a Content-Length or
    chunked; one byte more is refused (413)."""
    size = 700
    with front(max_body=size) as url:
        for n, status in ((size, 200), (size + 1, 413)):
            body = _padded(n)
            content = body if how == "declared" else iter([body[:n // 2], body[n // 2:]])
            r = httpx.post(url + "/v1/completions", content=content, headers=JSON,
                           timeout=AT_ONCE)
            assert r.status_code == status, (n, r.text)
            if status == 413:
                assert f"at most {size} are accepted (--max-body)" in \
                    r.json()["error"]["message"]
            else:
                assert r.json()["choices"][0]["text"] == "ok"


def test_a_declared_length_past_the_limit_is_refused_before_the_body():
    """A Content-Length past --max-body is answered 413 at once, before any of the body
    is sent."""
    with front(max_body=1000) as url:
        reply = _post_head(url, b"Content-Length: 1001\r\n\r\n",
                           "413 for a declared length past --max-body")
        assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
        assert b"has 1001+ bytes; at most 1000" in reply


def test_half_a_body_gets_408_naming_what_came():
    """A body that stops coming is answered 408 when --read-timeout ends, saying how
    much came."""
    with front(read_timeout=0.5) as url:
        reply = _post_head(url, b"Content-Length: 100\r\n\r\n{\"mo", "408 for half a body")
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        assert b"did not arrive within 0.5 s (4 bytes came)" in reply


def test_a_silent_connection_is_closed_and_a_busy_one_is_not():
    """With --read-timeout 0.5: a connection that sends nothing, or half a head, is closed;
    one that asks a request every 0.2 s for 1.2 s is answered every time (each answer
    arms the deadline again), then closed once it sends half a head; a connection whose
    body was refused (413) while it was still sending is closed too."""
    with front(read_timeout=0.5, max_body=10) as url:
        for sent in (b"", b"GET /health HTTP/1.1\r\nHost: 127.0"):
            s = _connect(url)
            s.sendall(sent)
            assert s.recv(1024) == b"", "not closed"
            s.close()
        s = _connect(url)
        for _ in range(6):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _answer(s, "200 from /health").startswith(b"HTTP/1.1 200")
            time.sleep(0.2)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0")
        reply = s.recv(4096)
        assert reply == b"", reply[:200]
        s.close()
        s = _connect(url)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        assert _answer(s, "413").startswith(b"HTTP/1.1 413")
        s.settimeout(2.5)           # (uvicorn's own keep-alive timeout would close it at 5)
        try:
            assert s.recv(4096) == b"", "not closed"
        except socket.timeout:
            raise AssertionError("a connection still sending a body it was answered "
                                 "for is not closed within 2.5 s") from None
        s.close()


def test_a_client_gone_mid_body_is_answered_nothing(caplog):
    """A client that closes its connection mid-body: one line in the log naming what
    came (of a length declared, or of '?' for a chunked body), and the server answers the
    next request."""
    with caplog.at_level("INFO", logger="pagedkv.serve"), front() as url:
        for length, sent, came in (
                (b"Content-Length: 100", b'{"mo', "4 of 100"),
                (b"Transfer-Encoding: chunked", b'6\r\n{"mod"\r\n', "6 of ?")):
            caplog.clear()
            s = _connect(url)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                      b"Content-Type: application/json\r\n" + length + b"\r\n\r\n" + sent)
            time.sleep(0.1)
            s.close()
            end = time.monotonic() + AT_ONCE
            while not any("went away" in r.message for r in caplog.records):
                assert time.monotonic() < end, [r.message for r in caplog.records]
                time.sleep(0.02)
            (line,) = [r.message for r in caplog.records if "went away" in r.message]
            assert line == (f"a client went away while sending POST /v1/completions "
                            f"({came} bytes came)")
        r = httpx.post(url + "/v1/completions", json=dict(model=MODEL, prompt="ab",
                                                          max_tokens=2), timeout=AT_ONCE)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "ab"


def test_the_open_files_limit_is_raised_to_the_hard_limit():
    """The soft limit of open files is raised to the hard one, and the limit returned."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        got = raise_open_files_limit()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert got == now and now >= soft
        assert now == hard or hard == resource.RLIM_INFINITY
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
