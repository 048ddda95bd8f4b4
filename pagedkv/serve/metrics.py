"""``GET /metrics``: the engine's numbers in the Prometheus text format.

A custom collector (prometheus-client's pattern for values that live elsewhere) reads the
engine client's latest ``stats`` snapshot when scraped, so nothing is counted twice and
the HTTP layer never touches the engine. The ages say whether the numbers are fresh: the
last step's, and the last word from the engine's core (a step, or an idle core's beat).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["registry_for", "render", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class ClientCollector:
    def __init__(self, client):
        self.client = client

    def collect(self):
        s = self.client.stats
        blocks = GaugeMetricFamily("pagedkv_blocks", "Blocks of the KV pool, by state "
                                   "(cached: idle, kept by the prefix cache)",
                                   labels=["state"])
        for state in ("used", "free", "cached"):
            blocks.add_metric([state], s["pool"][state])
        yield blocks
        yield GaugeMetricFamily("pagedkv_blocks_total", "Blocks in the KV pool",
                                value=s["pool"]["total"])
        yield GaugeMetricFamily("pagedkv_requests_running", "Requests decoding",
                                value=s["running"])
        yield GaugeMetricFamily("pagedkv_requests_waiting", "Requests waiting for "
                                "admission (and swapped out)",
                                value=s["waiting"] + s["swapped"])
        for name, key, doc in (
                ("pagedkv_requests", "requests", "Requests accepted"),
                ("pagedkv_requests_rejected", "rejected", "Requests refused at submission "
                 "(429 or 503 with Retry-After, or the engine's own 400)"),
                ("pagedkv_requests_finished", "finished", "Requests answered in full"),
                ("pagedkv_requests_cancelled", "cancelled", "Requests cancelled (client gone)"),
                ("pagedkv_requests_failed", "failed", "Requests that failed in the engine "
                 "or the server, or when it stalled (each client got an error)"),
                ("pagedkv_engine_failed_steps", "failed_steps", "Engine steps that raised"),
                ("pagedkv_prompt_tokens", "prompt_tokens", "Prompt tokens submitted"),
                ("pagedkv_generation_tokens", "generated_tokens", "Tokens generated"),
                ("pagedkv_engine_steps", "steps", "Engine steps"),
                ("pagedkv_spec_drafted_tokens", "drafted_tokens", "Tokens guessed and "
                 "verified by speculative decoding (--speculate)"),
                ("pagedkv_spec_accepted_tokens", "accepted_tokens", "Of the guessed "
                 "tokens, the ones the model agreed with (kept)"),
                ("pagedkv_engine_step_seconds", "step_seconds", "Seconds the engine's "
                 "core spent in steps (the rest: its commands, and waiting)")):
            yield CounterMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily("pagedkv_engine_dead", "1 once the engine cannot serve "
                                "(the server exits)", value=int(s["dead"]))
        yield GaugeMetricFamily("pagedkv_engine_stalled", "1 while the engine has been "
                                "silent past --stall-timeout", value=int(s["stalled"]))
        yield GaugeMetricFamily("pagedkv_engine_step_age_seconds", "Seconds since the last "
                                "engine step landed (or the engine started)",
                                value=s["step_age"])
        yield GaugeMetricFamily("pagedkv_engine_heard_age_seconds", "Seconds since the "
                                "engine's core last said anything (a step, or an idle "
                                "beat)", value=s["heard_age"])
        prefilled, cached = s["prompt_tokens_prefilled"], s["prompt_tokens_cached"]
        yield GaugeMetricFamily("pagedkv_prefix_cache_hit_rate", "Share of prefilled prompt "
                                "tokens found in the prefix cache",
                                value=cached / prefilled if prefilled else 0.0)


def registry_for(client) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(ClientCollector(client))
    return registry


def render(registry) -> bytes:
    return generate_latest(registry)
