"""What the server tests share: waiting (bounded) for an idle pool, reading a metric."""
from __future__ import annotations

import time

import httpx

from pagedkv.serve.process import get_json

TIMEOUT = 30.0      # seconds any one call may take


def idle(server, deadline: float = 10.0) -> dict:
    """Wait (bounded) until the engine holds nothing; return the pool."""
    end = time.monotonic() + deadline
    while True:
        pool = get_json(server.url + "/pool")
        if pool["used"] == 0 and pool["running"] == pool["waiting"] == pool["sequences"] == 0:
            return pool
        if time.monotonic() > end:
            raise AssertionError(f"the pool did not empty within {deadline} s: {pool}")
        time.sleep(0.05)


def metric(server, name: str) -> float:
    """One sample of ``GET /metrics`` by name (a labelled one: its first)."""
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} is not in /metrics:\n{text}")
