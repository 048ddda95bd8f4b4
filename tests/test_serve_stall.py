"""An engine that stops answering: the server keeps answering, says so, and stops on time.

A real ``python -m pagedkv.serve --model tiny`` on 127.0.0.1 and a free port; its engine's
process is stopped with SIGSTOP (or, with ``--engine thread``, a step is made to stall),
and everything the event loop answers must still come within a second: ``/health`` (503
once the engine has been silent past ``--stall-timeout``), new requests (503 with
Retry-After), and the requests in flight (an error, not silence). Once the engine runs
again the server serves on, its pool idle. SIGTERM with the engine stopped exits within
``--shutdown-timeout``.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import time

import httpx
import psutil

from pagedkv.serve.process import ServerProcess

from _serving import idle, metric, within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ,
       "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
MODEL = "tiny-random-llama"
TIMEOUT = 30.0
STALL = 1.5             # the servers' --stall-timeout here
LONG = dict(model=MODEL, prompt="a", max_tokens=1500, temperature=0, ignore_eos=True)


def _engine_process(server) -> psutil.Process:
    (child,) = [p for p in psutil.Process(server.proc.pid).children()
                if "spawn_main" in " ".join(p.cmdline())]
    return child


def _quick(method, url, **kw) -> tuple:
    """(the response, seconds it took), with a one-second limit."""
    t = time.monotonic()
    r = httpx.request(method, url, timeout=1.0, **kw)
    return r, time.monotonic() - t


def _first_chunk(lines) -> None:
    next(x for x in lines if x.startswith("data: {"))


def _burst(url: str, n: int, size: int) -> list:
    """``n`` requests at once, each a prompt of ``size`` token ids (not streamed), on a
    thread of their own; their responses."""
    async def main():
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(
                max_connections=n + 10)) as c:
            body = dict(model=MODEL, prompt=[5] * size, max_tokens=20)
            return await asyncio.gather(*(c.post(url, json=body) for _ in range(n)))
    return concurrent.futures.ThreadPoolExecutor(1).submit(asyncio.run, main())


def test_a_stopped_engine_never_freezes_the_server():
    """SIGSTOP the engine's process with a stream and a whole answer running, then send
    80 prompts of 2,000 token ids (more bytes than the pipe to the engine holds):
    /health and new requests answer within a second throughout (200, then 503 past the
    stall timeout), the stream gets an error event and the whole answer a 503, every
    prompt a 503 with Retry-After; after SIGCONT the server serves on, its pool idle."""
    with ServerProcess("--model", "tiny", "--audit", "--stall-timeout", STALL,
                       "--max-waiting", 64, env=ENV, timeout=60) as s:
        url = s.base_url + "/completions"
        child = _engine_process(s)
        whole = concurrent.futures.ThreadPoolExecutor(1).submit(
            httpx.post, url, json=LONG, timeout=TIMEOUT)
        with httpx.stream("POST", url, json=dict(LONG, stream=True),
                          timeout=TIMEOUT) as running:
            lines = running.iter_lines()
            _first_chunk(lines)
            child.suspend()
            stopped = time.monotonic()
            try:
                burst = _burst(url, 80, 2000)
                healths = []
                while time.monotonic() - stopped < STALL + 1:
                    r, took = _quick("GET", s.url + "/health")
                    assert took < 1.0, took
                    healths.append(r.status_code)
                    time.sleep(0.1)
                r, took = _quick("POST", url, json=dict(LONG, stream=True))
                assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
                assert "no progress" in r.json()["error"]["message"] and took < 1.0
                assert metric(s, "pagedkv_engine_stalled") == 1
                assert metric(s, "pagedkv_engine_heard_age_seconds") > STALL
                rest = within(10, "the stream's error event once the engine stalls",
                              list, lines)          # the stream's end
                errors = [json.loads(x[6:])["error"] for x in rest if '"error"' in x]
                assert errors and "no progress" in errors[0]["message"], rest[-3:]
                r = within(10, "503 for the whole answer once the engine stalls",
                           whole.result)
                assert r.status_code == 503 and "no progress" in r.text
                answers = within(10, "503 for each of the burst's requests", burst.result)
            finally:
                child.resume()
        assert healths[0] == 200 and healths[-1] == 503, healths
        assert [r.status_code for r in answers] == [503] * 80
        assert all(r.headers["Retry-After"] == "1" for r in answers)
        words = {r.json()["error"]["message"].split(" (")[0] for r in answers}
        assert {w.split(" for ")[0] for w in words} <= {
            "the engine has made no progress", "64 requests are waiting"}, words
        end = time.monotonic() + 10
        while httpx.get(s.url + "/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < end, "the engine did not come back"
            time.sleep(0.1)
        r = httpx.post(url, json=dict(LONG, max_tokens=3), timeout=TIMEOUT)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        pool = idle(s)
        assert pool["audit"] == "ok" and metric(s, "pagedkv_engine_stalled") == 0
        assert metric(s, "pagedkv_requests_failed_total") >= 1     # (the stream)
        assert "Traceback" not in s.log()
    assert s.proc.returncode == 0


def test_sigterm_with_a_stopped_engine_exits_within_the_shutdown_timeout():
    """SIGTERM while the engine's process is stopped: the open stream ends at once with
    a 503 error event and a whole answer with a 503 error object, the engine's process
    is killed when --shutdown-timeout has passed, and the server exits with status 0."""
    s = ServerProcess("--model", "tiny", "--shutdown-timeout", 2, env=ENV,
                      timeout=60).start()
    try:
        child = _engine_process(s)
        whole = concurrent.futures.ThreadPoolExecutor(1).submit(
            httpx.post, s.base_url + "/completions", json=LONG, timeout=TIMEOUT)
        with httpx.stream("POST", s.base_url + "/completions", json=dict(LONG, stream=True),
                          timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            _first_chunk(lines)
            end = time.monotonic() + 10
            while metric(s, "pagedkv_requests_total") < 2:     # the whole answer's too
                assert time.monotonic() < end
                time.sleep(0.05)
            child.suspend()
            t = time.monotonic()
            s.proc.send_signal(signal.SIGTERM)
            rest = within(10, "the stream's end after SIGTERM", list, lines)
            ended = time.monotonic() - t
        status = s.proc.wait(10)
        took = time.monotonic() - t
        r = within(10, "503 for the whole answer after SIGTERM", whole.result)
    finally:
        s._kill()
    assert r.status_code == 503 and r.json()["error"]["message"] == \
        "the server is shutting down", r.text
    assert any("the server is shutting down" in line for line in rest), rest[-3:]
    assert ended < 1.0, ended
    assert status == 0 and took < 2 + 2, (status, took, s.log())
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert "the engine process did not stop within 1." in s.log()
    assert " s: killed" in s.log()


def test_a_stalled_step_on_the_engines_thread():
    """--engine thread, the 5th step waits 3 s: /health says 503 within the stall, the
    stream in flight gets an error event; when the step ends the server serves on."""
    env = {**ENV, "PAGEDKV_SERVE_STALL": "5:3"}
    with ServerProcess("--model", "tiny", "--engine", "thread", "--audit",
                       "--stall-timeout", 1, env=env, timeout=60) as s:
        with httpx.stream("POST", s.base_url + "/completions", json=dict(LONG, stream=True),
                          timeout=TIMEOUT) as r:
            t = time.monotonic()
            rest = within(10, "the stream's error event once the step stalls", list,
                          r.iter_lines())
            ended = time.monotonic() - t
            r, took = _quick("GET", s.url + "/health")
        assert r.status_code == 503 and "no progress" in r.text and took < 1.0
        assert any("no progress" in line for line in rest), rest[-3:]
        assert ended < 2.5, ended
        end = time.monotonic() + 10
        while httpx.get(s.url + "/health", timeout=TIMEOUT).status_code != 200:
            assert time.monotonic() < end, "the engine did not come back"
            time.sleep(0.1)
        assert idle(s)["audit"] == "ok"
    assert s.proc.returncode == 0
