"""The chat page in Debian's Chromium (Playwright; see conftest.py): served by a real
``python -m pagedkv.serve --model tiny --prefix-caching`` process on a free port.

A message is sent, the answer streams in, and the block map changes: cells of this
conversation appear while it answers, and after it its full blocks show as cached. Two
tabs with the same (default) system prompt share its blocks while both answer. The page
loads nothing from outside the server and logs no console errors.
"""
from __future__ import annotations

import os
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


def _answered(page):
    page.wait_for_function("!document.getElementById('send').disabled", timeout=WAIT_MS)


def test_chat_page_streams_and_draws_the_pool(server, browser):
    problems = []
    context = browser.new_context(viewport={"width": 1366, "height": 900})
    page = _open(context, server, problems)
    assert page.text_content("#model") == "tiny-random-llama"
    assert page.locator("#pool .block").count() == 320        # one cell a block
    assert _count(page, "free") == 320
    _send(page, "Hello there", 300)
    page.wait_for_function("document.getElementById('n-mine').textContent > 0",
                           timeout=WAIT_MS)                    # its blocks, while it runs
    mine_early = _count(page, "mine")
    _answered(page)
    answer = page.locator(".msg.assistant").last.text_content()
    assert len(answer) > 100, answer
    assert page.locator(".msg.user").last.text_content() == "Hello there"
    assert "prompt tokens" in page.text_content("#status")
    page.wait_for_function("document.getElementById('n-mine').textContent == 0 && "
                           "document.getElementById('n-cached').textContent > 0",
                           timeout=WAIT_MS)                    # kept by the prefix cache
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
    one.wait_for_function("document.getElementById('n-mine').textContent > 0",
                          timeout=WAIT_MS)
    _send(two, "Second tab", 100)
    two.wait_for_function("document.getElementById('peak-shared').textContent > 0",
                          timeout=WAIT_MS)
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
