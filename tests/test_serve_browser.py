"""The chat page in Debian's Chromium (Playwright; see conftest.py): served by a real
``python -m pagedkv.serve --model tiny --prefix-caching`` process on a free port.

A message is sent, the answer streams in, and the block map changes: cells of this
conversation appear while it answers, and after it its full blocks show as cached. Two
tabs with the same (default) system prompt share its blocks while both answer. The page
loads nothing from outside the server and logs no console errors. A page on another site
may use the server only when ``--allow-origin`` names that site (CORS), and with
``--api-key`` the chat page asks for the key.
"""
from __future__ import annotations

import contextlib
import http.server
import os
import threading
import time
from urllib.parse import urlsplit

import pytest

from pagedkv.serve.process import ServerProcess, get_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT_MS = 60_000


def _idle(server, deadline: float = 20.0) -> dict:
    end = time.monotonic() + deadline
    while True:
        pool = get_json(server.url + "/pool")
        if pool["used"] == 0 and pool["running"] == pool["waiting"] == 0:
            return pool
        assert time.monotonic() < end, f"the pool did not empty: {pool}"
        time.sleep(0.05)


def _count(page, name: str) -> int:
    return int(page.text_content(f"#n-{name}"))


@pytest.fixture(scope="module")
def server():
    env = {**os.environ, "PYTHONPATH": ROOT}
    with ServerProcess("--model", "tiny", "--prefix-caching", "--audit", "--num-blocks", 320,
                       env=env, timeout=60) as s:
        yield s
    assert s.proc.returncode == 0, s.log()


def _open(context, server, problems):
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and problems.append(m.text))
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))

    def local(request):
        if urlsplit(request.url).netloc not in (urlsplit(server.url).netloc, ""):
            problems.append(f"external: {request.url}")
    page.on("request", local)
    page.goto(server.url + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
    return page


def _send(page, text: str, max_tokens: int):
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#input", text)
    page.press("#input", "Enter")


def _until(page, expression: str, timeout_ms: int = WAIT_MS) -> None:
    """Wait (bounded) until ``expression`` is true in the page. (Playwright's
    wait_for_function evaluates its predicate with eval, which the page's
    Content-Security-Policy forbids; page.evaluate goes through the debugger.)"""
    end = time.monotonic() + timeout_ms / 1000
    while not page.evaluate(expression):
        assert time.monotonic() < end, f"not within {timeout_ms} ms: {expression}"
        time.sleep(0.05)


def _answered(page):
    _until(page, "!document.getElementById('send').disabled")


def test_chat_page_streams_and_draws_the_pool(server, browser):
    problems = []
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = _open(context, server, problems)
    assert page.text_content("#model") == "tiny-random-llama"
    assert page.locator("#pool .block").count() == 320        # one cell a block
    assert _count(page, "free") == 320
    _send(page, "Hello there", 300)
    _until(page, "document.getElementById('n-mine').textContent > 0")  # while it runs
    mine_early = _count(page, "mine")
    _answered(page)
    answer = page.locator(".msg.assistant").last.text_content()
    assert len(answer) > 100, answer
    assert page.locator(".msg.user").last.text_content() == "Hello there"
    assert "prompt tokens" in page.text_content("#status")
    _until(page, "document.getElementById('n-mine').textContent == 0 && "
                 "document.getElementById('n-cached').textContent > 0")  # the prefix cache
    assert mine_early > 0 and _count(page, "cached") >= 300 // 16
    # the next turn finds the conversation so far in the cache
    _send(page, "And again", 20)
    _answered(page)
    assert page.locator(".msg.assistant").count() == 2
    assert not page.locator(".msg.error").count()
    os.makedirs(os.path.join(ROOT, "artifacts", "screenshots"), exist_ok=True)
    page.screenshot(path=os.path.join(ROOT, "artifacts", "screenshots", "serve_chat.png"))
    context.close()
    assert not problems, problems


def test_two_tabs_share_the_system_prompt(server, browser):
    problems = []
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    one, two = _open(context, server, problems), _open(context, server, problems)
    _send(one, "First tab", 600)
    _until(one, "document.getElementById('n-mine').textContent > 0")
    _send(two, "Second tab", 100)
    _until(two, "document.getElementById('peak-shared').textContent > 0")
    # the default system prompt's full blocks, held by both answers at once
    assert int(two.text_content("#peak-shared")) >= 3
    _answered(two)
    assert not two.locator(".msg.error").count()
    context.close()                 # the first tab is still answering: it is cancelled
    pool = _idle(server)
    assert pool["audit"] == "ok"
    assert not problems, problems


def test_bad_input_shows_the_servers_message(server, browser):
    problems = []
    context = browser.new_context()
    page = _open(context, server, problems)
    _send(page, "x", 5000)                     # more than the 2,048-token context
    page.wait_for_selector(".msg.error", timeout=WAIT_MS)
    assert "HTTP 400" in page.text_content(".msg.error")
    assert "exceed the model's context" in page.text_content(".msg.error")
    context.close()
    # (the failed fetch logs a console error for the 400 response: expected here)
    assert all("400" in p for p in problems), problems


# ---------------------------------------------------------------------- other origins

PAGE = "<!doctype html><title>another site</title><p>a page of another site</p>"
ASK = """async (url) => {
  try {
    const r = await fetch(url + "/v1/chat/completions", {method: "POST",
      headers: {"Content-Type": "application/json"}, body: JSON.stringify({
        model: "tiny-random-llama", max_tokens: 5, temperature: 0, stream: true,
        messages: [{role: "user", content: "hi"}]})});
    return r.status + " " + (await r.text());
  } catch (e) { return "blocked: " + e; }
}"""


@contextlib.contextmanager
def _site():
    """Another web site on 127.0.0.1 (a free port): one page, PAGE."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_cors_lets_in_the_allowed_sites_pages_only(browser):
    """--allow-origin names one site: a page there streams an answer through CORS (the
    preflight answered by Starlette's middleware); a page on another site is blocked by
    the browser before its request is sent (the server counts no request)."""
    from _serving import metric
    with _site() as allowed, _site() as other:
        env = {**os.environ, "PYTHONPATH": ROOT}
        with ServerProcess("--model", "tiny", "--allow-origin", allowed, env=env,
                           timeout=60) as server:
            context = browser.new_context()
            page = context.new_page()
            page.goto(allowed + "/")
            answer = page.evaluate(ASK, server.url)
            assert answer.startswith("200 ") and "data: [DONE]" in answer, answer
            before = metric(server, "pagedkv_requests_total")
            page.goto(other + "/")
            assert page.evaluate(ASK, server.url).startswith("blocked: TypeError")
            assert metric(server, "pagedkv_requests_total") == before
            context.close()
        assert server.proc.returncode == 0


def test_the_chat_page_asks_for_the_api_key(browser):
    """With --api-key the page asks for the key once (a prompt), then chats with it."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    with ServerProcess("--model", "tiny", env=env, timeout=60, api_key="s3cret") as server:
        problems, asked = [], []
        context = browser.new_context()
        page = context.new_page()
        page.on("dialog", lambda d: (asked.append(d.message), d.accept("s3cret")))
        page.on("pageerror", lambda e: problems.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector("body[data-ready='1']", timeout=WAIT_MS)
        assert page.text_content("#model") == "tiny-random-llama"
        _send(page, "Hello", 20)
        _answered(page)
        assert not page.locator(".msg.error").count()
        assert len(page.locator(".msg.assistant").last.text_content()) > 0
        assert asked == ["This server needs its API key (--api-key):"]
        context.close()
        assert not problems, problems
    assert server.proc.returncode == 0
