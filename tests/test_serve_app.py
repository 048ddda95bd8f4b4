"""The application in this process, over a core that answers at once (no model, no
server): what the HTTP layer makes of the client's events, and what the front door lets
in. Each test is a fraction of a second."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

import httpx
import pytest

from pagedkv.serve.app import create_app
from pagedkv.serve.client import EngineClient
from pagedkv.serve.limits import PAGE_HEADERS, Limits
from pagedkv.serve.models import ByteTokenizer, Served

from _serving import Instant

MODEL = "tiny-random-llama"
TOK = ByteTokenizer()


class SlowTokenizer(ByteTokenizer):
    """0.4 s to encode a long text."""

    def encode(self, text, controls=True):
        if len(text) > 1000:
            time.sleep(0.4)
        return super().encode(text, controls)


def _app(limits=None, tokenizer=TOK, interval=1):
    served = Served(MODEL, None, tokenizer, 2048, ByteTokenizer.vocab_size, 13)
    client = EngineClient(Instant(), TOK, stream_interval=interval).start()
    return create_app(client, served, limits or Limits()), client


def _run(main):
    """``asyncio.run(main())`` on a thread of its own (a browser test's driver may run an
    event loop on this one)."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(lambda: asyncio.run(main())).result()


def _call(app, method, path, **kw):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=10) as c:
            return await c.request(method, path, **kw)
    return _run(main)


def _chunks(r) -> list:
    lines = [x[6:] for x in r.text.splitlines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-3:]
    return [json.loads(x) for x in lines[:-1]]


def _body(**kw):
    return {**dict(model=MODEL, prompt="abcdefghij", max_tokens=10, temperature=0,
                   stream=True), **kw}


@pytest.mark.parametrize("interval", [1, 4])
def test_a_stream_has_its_timings_in_its_last_chunk(interval):
    """With or without the usage chunk, the last chunk before [DONE] carries the
    request's timings; ``--stream-interval`` makes fewer chunks of the same text."""
    app, client = _app(interval=interval)
    try:
        for usage in (False, True):
            r = _call(app, "POST", "/v1/completions", json=_body(
                stream_options={"include_usage": usage}))
            chunks = _chunks(r)
            assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == \
                "abcdefghij"
            assert all("timings" not in c for c in chunks[:-1])
            t = chunks[-1]["timings"]
            assert t["completion_tokens"] == 10 and t["prompt_tokens"] == 10
            assert set(t) >= {"queued_ms", "prefill_ms", "decode_ms", "decode_tokens_per_s"}
            assert ("usage" in chunks[-1]) == usage
            texts = [c for c in chunks if c["choices"]]     # (a late reader's coalesce)
            assert len(texts) <= (10 if interval == 1 else 4)   # a, bcde, fghi, j
        r = _call(app, "POST", "/v1/completions", json=_body(stream=False))
        assert r.json()["timings"]["completion_tokens"] == 10
        assert r.json()["choices"][0]["text"] == "abcdefghij"
        assert client.stats["finished"] == 3
    finally:
        client.stop()


def test_large_bodies_never_hold_up_small_ones():
    """Four long string prompts take 0.4 s each to tokenize; a small request
    sent among them is answered at once (large bodies are parsed on a worker of their
    own)."""
    app, client = _app(tokenizer=SlowTokenizer())

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1",
                                     timeout=30) as c:
            big = dict(model=MODEL, prompt="\u20ac" * 25_000, max_tokens=1)   # 75 kB
            slow = [asyncio.create_task(c.post("/v1/completions", json=big))
                    for _ in range(4)]
            await asyncio.sleep(0.1)
            t = time.monotonic()
            small = await c.post("/v1/completions", json=dict(model=MODEL, prompt=[5, 6],
                                                              max_tokens=2))
            took = time.monotonic() - t
            return small, took, await asyncio.gather(*slow)
    try:
        small, took, slow = _run(main)
    finally:
        client.stop()
    assert small.status_code == 200 and took < 0.3, took
    assert all(r.status_code == 400 and "context" in r.json()["error"]["message"]
               for r in slow)


def test_the_api_key():
    """With a key: 401 (an OpenAI error object) without it or with a wrong one, 200 with
    it; the page and, by default, /health and /metrics need none."""
    app, client = _app(Limits(api_key="s3cret"))
    try:
        for headers, words in (({}, "has no key"),
                               ({"Authorization": "Bearer nope"}, "has a wrong key")):
            for path in ("/v1/models", "/pool"):
                r = _call(app, "GET", path, headers=headers)
                assert r.status_code == 401, r.text
                err = r.json()["error"]
                assert words in err["message"] and err["code"] == "invalid_api_key"
                assert err["type"] == "invalid_request_error"
        ok = {"Authorization": "Bearer s3cret"}
        assert _call(app, "GET", "/v1/models", headers=ok).status_code == 200
        r = _call(app, "POST", "/v1/completions", json=_body(stream=False), headers=ok)
        assert r.status_code == 200
        for path in ("/", "/health", "/metrics", "/static/app.js"):
            assert _call(app, "GET", path).status_code == 200, path
    finally:
        client.stop()
    app, client = _app(Limits(api_key="s3cret", key_for_probes=True))
    try:
        for path in ("/health", "/metrics"):
            assert _call(app, "GET", path).status_code == 401, path
    finally:
        client.stop()


def test_the_page_has_its_security_headers():
    app, client = _app()
    try:
        for path in ("/", "/static/app.js"):
            r = _call(app, "GET", path)
            for name, value in PAGE_HEADERS:
                assert r.headers[name.decode()] == value.decode(), (path, name)
        assert "content-security-policy" not in _call(app, "GET", "/v1/models").headers
    finally:
        client.stop()


def test_host_and_cors_refusals_are_openai_errors():
    """Starlette's middlewares refuse a foreign Host and a disallowed preflight in plain
    text: they reach the client as error objects; an allowed origin's preflight passes
    and its answer names it."""
    page = "http://127.0.0.1:9"
    app, client = _app(Limits(allow_origins=(page,)))
    try:
        r = _call(app, "GET", "/v1/models", headers={"Host": "evil.example"})
        assert r.status_code == 400
        assert "Host 'evil.example' is not this server's" in r.json()["error"]["message"]
        ask = {"Access-Control-Request-Method": "POST",
               "Access-Control-Request-Headers": "content-type"}
        r = _call(app, "OPTIONS", "/v1/completions", headers={"Origin": page, **ask})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = _call(app, "OPTIONS", "/v1/completions",
                  headers={"Origin": "http://evil.example", **ask})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "permission_error"
        r = _call(app, "POST", "/v1/completions", json=_body(stream=False),
                  headers={"Origin": page})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == page
        r = _call(app, "POST", "/v1/completions", json=_body(stream=False),
                  headers={"Origin": "http://evil.example"})
        assert r.status_code == 403 and "may not use this server" in r.text
    finally:
        client.stop()


def test_every_address_with_allowed_hosts_refuses_a_rebound_name():
    app, client = _app(Limits(host="0.0.0.0", allowed_hosts=("my.host",)))
    try:
        r = _call(app, "GET", "/pool", headers={"Host": "rebound.example:8000"})
        assert r.status_code == 400 and "answers to my.host" in r.text
        assert _call(app, "GET", "/v1/models", headers={"Host": "my.host:8000"}) \
            .status_code == 200
    finally:
        client.stop()


def test_allowed_hosts():
    from pagedkv.serve.limits import allowed_hosts
    assert allowed_hosts(Limits()) == ["127.0.0.1", "localhost", "[::1]"]
    assert allowed_hosts(Limits(host="0.0.0.0")) == ["*"]
    assert allowed_hosts(Limits(host="0.0.0.0", allowed_hosts=("my.host",))) == ["my.host"]
    assert allowed_hosts(Limits(host="10.0.0.5", allowed_hosts=("*.lan",))) == \
        ["10.0.0.5", "*.lan"]


def test_a_non_loopback_bind_is_warned_about(caplog):
    from pagedkv.serve.__main__ import _warn_if_exposed
    with caplog.at_level("WARNING", logger="pagedkv.serve"):
        _warn_if_exposed(Limits())
        assert not caplog.records
        _warn_if_exposed(Limits(host="0.0.0.0"))
        (record,) = caplog.records
        assert "other machines can reach" in record.message
        assert "--api-key" in record.message and "DNS name rebound" in record.message
        caplog.clear()
        _warn_if_exposed(Limits(host="0.0.0.0", api_key="k", allowed_hosts=("h",)))
        (record,) = caplog.records
        assert "--api-key" not in record.message and "rebound" not in record.message


def test_the_content_type_and_origin_checks():
    """A POST body must be application/json (parameters and case aside): 415 otherwise,
    naming what came; a page of this server's own origin may post, another site's gets
    403 unless --allow-origin names it or is '*'."""
    app, client = _app()
    try:
        body = json.dumps(_body(stream=False)).encode()
        for kind in ("application/json", "application/json; charset=utf-8",
                     " Application/JSON "):
            r = _call(app, "POST", "/v1/completions", content=body,
                      headers={"Content-Type": kind})
            assert r.status_code == 200, (kind, r.text)
        for headers, words in (({"Content-Type": "text/plain"}, "got 'text/plain'"),
                               ({}, "got no Content-Type")):
            r = _call(app, "POST", "/v1/completions", content=body, headers=headers)
            assert r.status_code == 415, r.text
            assert r.json()["error"]["type"] == "invalid_request_error"
            assert r.json()["error"]["message"] == \
                f"a request body must be application/json, {words}"
        own = {"Origin": "http://127.0.0.1", "Content-Type": "application/json"}
        assert _call(app, "POST", "/v1/completions", content=body,
                     headers=own).status_code == 200
        other = dict(own, Origin="http://127.0.0.1:9")
        r = _call(app, "GET", "/v1/models", headers=other)
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        assert r.json()["error"]["message"] == (
            "Origin 'http://127.0.0.1:9' may not use this server (its own pages may; "
            "others need --allow-origin)")
    finally:
        client.stop()
    for origins in (("*",), ("http://127.0.0.1:9",)):
        app, client = _app(Limits(allow_origins=origins))
        try:
            r = _call(app, "GET", "/v1/models", headers={"Origin": "http://127.0.0.1:9"})
            assert r.status_code == 200, (origins, r.text)
            r = _call(app, "GET", "/v1/models", headers={"Origin": "http://other:1"})
            assert r.status_code == (200 if origins == ("*",) else 403), origins
        finally:
            client.stop()


def test_which_names_are_loopback():
    """Loopback addresses and 'localhost' are loopback; an IPv6 address is named in
    brackets; every address (0.0.0.0, '::' or '') answers to any Host."""
    from pagedkv.serve.limits import allowed_hosts, is_loopback
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("10.0.0.5") and not is_loopback("example.com")
    assert allowed_hosts(Limits(host="::")) == allowed_hosts(Limits(host="")) == ["*"]
    assert allowed_hosts(Limits(host="fe80::1")) == ["[fe80::1]"]
    assert allowed_hosts(Limits(host="::1", allowed_hosts=("a",))) == \
        ["127.0.0.1", "localhost", "[::1]", "a"]


def test_a_request_without_a_host_is_checked_too():
    """An HTTP/1.0 request has no Host (let through only where any Host is allowed): its
    Origin is still checked (403), and without one it passes."""
    from pagedkv.serve.limits import Guard
    guard = Guard(None, Limits(host="0.0.0.0"))
    scope = dict(type="http", method="GET", path="/v1/models", headers=[
        (b"origin", b"http://evil.example")])
    status, kind, message = guard.check(scope)
    assert (status, kind) == (403, "permission_error") and "evil.example" in message
    assert guard.check(dict(scope, headers=[])) is None
