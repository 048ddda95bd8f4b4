"""When the host works and when the GPU works: a timeline of an engine's steps.

:func:`attach` wraps an engine's step and its runner's device calls so that every step
leaves spans on one clock (seconds from :meth:`Timeline.start`):

* **host** spans, from ``time.perf_counter``: each ``step`` call, and inside it the time the
  host spends *waiting* for the GPU (``wait``: a landing, or a synchronous pass);
* **device** spans, from CUDA events recorded on the stream that runs the work, before and
  after it (``decode``: a decode pass, its upload included; ``prefill`` passes; ``draw``:
  the sampler; ``swap`` copies). An event's time is when the stream reached it, so a span
  is the stream's busy time, not the host's call. On NumPy there is no device: the
  "device" spans are the host's own time in those calls.

From the device spans :meth:`Timeline.summary` gives the share of the wall time the GPU
was idle: time between spans, when it waited for the host. The recorder keeps at most
``limit`` spans of each kind (then counts the rest without keeping them), so a long run
cannot grow it without bound.
"""
from __future__ import annotations

import functools
import time

import numpy as np

__all__ = ["Timeline", "attach", "busy_seconds"]


class Timeline:
    """Host and device spans of a run (the module's text); ``xp`` the engine's array
    module, ``limit`` the spans kept of each kind."""

    def __init__(self, xp, limit: int = 100_000):
        self.on_gpu = xp is not np
        self.xp, self.limit = xp, int(limit)
        self.host: list = []          # (name, start s, end s)
        self._device: list = []       # (name, start, end): events (GPU) or seconds
        self.dropped = 0              # spans not kept past the limit
        self._t0 = self._event0 = None

    def start(self) -> None:
        """Start the clock: the device drained, then one event and one host time taken
        together, so that both kinds of span read from the same zero."""
        if self.on_gpu:
            self.xp.cuda.Device().synchronize()
            self._event0 = self.xp.cuda.Event()
            self._event0.record(self.xp.cuda.Stream.null)
            self._event0.synchronize()
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0

    def _keep(self, spans: list, span) -> None:
        if len(spans) < self.limit:
            spans.append(span)
        else:
            self.dropped += 1

    def host_span(self, name: str, start: float, end: float) -> None:
        self._keep(self.host, (name, start, end))

    def device_call(self, name: str, stream, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, its device work between two events on ``stream``."""
        if not self.on_gpu:
            t = self.now()
            out = fn(*args, **kwargs)
            self._keep(self._device, (name, t, self.now()))
            return out
        begin = self.xp.cuda.Event()
        begin.record(stream)
        out = fn(*args, **kwargs)
        end = self.xp.cuda.Event()
        end.record(stream)
        self._keep(self._device, (name, begin, end))
        return out

    def device(self) -> list:
        """The device spans as (name, start s, end s), on the host's clock (waits for
        the device to reach the last event)."""
        if not self.on_gpu:
            return list(self._device)
        get = self.xp.cuda.get_elapsed_time          # milliseconds between two events
        out = []
        for name, begin, end in self._device:
            end.synchronize()
            out.append((name, get(self._event0, begin) / 1e3, get(self._event0, end) / 1e3))
        return out

    def summary(self) -> dict:
        """Wall time (from the start to the last span's end), the device's busy and idle
        seconds within it, its idle share, and the host's waiting."""
        device = self.device()
        wall = max([e for _, _, e in device] + [e for _, _, e in self.host], default=0.0)
        busy = busy_seconds(device)
        wait = sum(e - s for n, s, e in self.host if n == "wait")
        step = sum(e - s for n, s, e in self.host if n == "step")
        return dict(wall_s=wall, device_busy_s=busy, device_idle_s=wall - busy,
                    device_idle_share=(wall - busy) / wall if wall else 0.0,
                    host_step_s=step, host_wait_s=wait, steps=sum(
                        1 for n, *_ in self.host if n == "step"), dropped=self.dropped)

    def to_json(self, first: int = 0, count: int | None = None) -> dict:
        """Steps ``first`` .. ``first + count`` and the device spans between their starts
        and ends, in milliseconds from the first one's start (for a plot)."""
        steps = [h for h in self.host if h[0] == "step"][first:]
        steps = steps[:count] if count is not None else steps
        if not steps:
            return dict(host=[], device=[])
        lo, hi = steps[0][1], steps[-1][2]
        ms = lambda spans: [(n, round(1e3 * (s - lo), 4), round(1e3 * (e - lo), 4))  # noqa
                            for n, s, e in spans if e >= lo and s <= hi]
        return dict(host=ms(self.host), device=ms(self.device()))


def busy_seconds(spans) -> float:
    """Seconds covered by the union of (name, start, end) spans."""
    busy, reach = 0.0, float("-inf")
    for _, s, e in sorted(spans, key=lambda x: x[1]):
        if e > reach:
            busy += e - max(s, reach)
            reach = e
    return busy


def attach(engine, timeline: Timeline | None = None) -> Timeline:
    """Record ``engine``'s steps on ``timeline`` (a new one by default) from now on: its
    ``step`` (host), its runner's passes, draws and swap copies (device: ``prefill``,
    ``decode``, ``draw``, ``swap``), and the host's waits in ``land``. Returns the
    timeline, started."""
    tl = timeline or Timeline(engine.model.xp)
    runner = engine.runner
    null = tl.xp.cuda.Stream.null if tl.on_gpu else None
    stream = getattr(runner, "stream", None) or null     # where the runner queues its work
    for name, label in (("prefill", "prefill"), ("_decode_pass", "decode"),
                        ("_draw", "draw"), ("swap", "swap")):
        fn = getattr(runner, name)

        @functools.wraps(fn)
        def on_device(*args, fn=fn, label=label, **kwargs):
            return tl.device_call(label, stream, fn, *args, **kwargs)
        setattr(runner, name, on_device)
    land = runner.land

    @functools.wraps(land)
    def waiting(*args, **kwargs):
        t = tl.now()
        out = land(*args, **kwargs)
        tl.host_span("wait", t, tl.now())
        return out
    runner.land = waiting
    step = engine.step

    @functools.wraps(step)
    def stepping(*args, **kwargs):
        t = tl.now()
        out = step(*args, **kwargs)
        tl.host_span("step", t, tl.now())
        return out
    engine.step = stepping
    tl.start()
    return tl
