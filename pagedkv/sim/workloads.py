"""Workloads: requests with a prompt length, an output length and an arrival step.

A workload is drawn from a named preset (:data:`PRESETS`) with a fixed seed, so the same
call always gives the same requests. Lengths are in tokens; time is counted in decode
steps.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import count, positive_int
from ..errors import ConfigError

__all__ = ["Request", "Workload", "PRESETS", "make_workload"]


@dataclass(frozen=True, slots=True)
class Request:
    rid: int
    arrival: int   # the decode step at which the request arrives
    prompt: int    # prompt tokens (written at admission: the prefill)
    output: int    # tokens generated, one per decode step

    @property
    def total(self) -> int:
        """The length the request's sequence ends with."""
        return self.prompt + self.output


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple
    max_len: int   # the longest a request may grow: what max-length reservation holds
    seed: int

    def __post_init__(self):
        for r in self.requests:
            if r.prompt < 1 or r.output < 1 or r.arrival < 0:
                raise ConfigError(f"request {r.rid}: prompt and output must be at least "
                                  f"1 token and the arrival step non-negative, got {r}")
            if r.total > self.max_len:
                raise ConfigError(f"request {r.rid} grows to {r.total} tokens, past "
                                  f"the workload's max_len={self.max_len}")

    def __len__(self) -> int:
        return len(self.requests)

    def lengths(self):
        """(prompt lengths, output lengths) as NumPy arrays."""
        return (np.array([r.prompt for r in self.requests]),
                np.array([r.output for r in self.requests]))

    @property
    def longest(self) -> int:
        """The longest final length of any request."""
        return max((r.total for r in self.requests), default=0)


#: Length distributions. ``uniform`` draws integers in [lo, hi]. ``lognormal`` has mean
#: ``m`` before rounding and clipping (mu = ln(m) - sigma^2 / 2) and is clipped to [lo,
#: hi]; ``m`` is set so that the mean *after* clipping is the target: ``chat`` follows
#: the ShareGPT means reported in the vLLM paper (161 input, 338 output tokens; m =
#: 166.0 and 358.1), ``alpaca`` its Alpaca means (19.3 and 58.5; m = 19.3 and 58.6). The
#: sigmas are our choice (the paper shows histograms, not parameters): long tails, as
#: conversations and instructions have. Prompt and output are each clipped to 1024 for
#: ``chat``, so no request passes 2048 tokens.
PRESETS = {
    "default": dict(prompt=("uniform", 4, 32), output=("uniform", 32, 256), max_len=288,
                    n=100),
    "chat": dict(prompt=("lognormal", 166.0, 1.0, 4, 1024),
                 output=("lognormal", 358.1, 0.8, 4, 1024), max_len=2048, n=1000),
    "alpaca": dict(prompt=("lognormal", 19.3, 0.6, 2, 256),
                   output=("lognormal", 58.6, 0.8, 2, 512), max_len=2048, n=1000),
}


def _draw(rng, spec, n):
    kind = spec[0]
    if kind == "uniform":
        return rng.integers(spec[1], spec[2] + 1, size=n)
    _, mean, sigma, lo, hi = spec
    x = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def make_workload(preset: str = "default", *, n: int | None = None, seed: int = 0,
                  rate: float | None = None) -> Workload:
    """``n`` requests from ``preset`` (its own count when ``n`` is None), drawn with
    ``seed``. ``rate`` (requests per decode step) gives Poisson arrivals; ``None``
    puts every request in the queue at step 0."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    n = p["n"] if n is None else positive_int(n, "the number of requests")
    if rate is not None and (isinstance(rate, bool) or not rate > 0
                             or not np.isfinite(rate)):
        raise ConfigError(f"the arrival rate must be a positive number, got {rate!r}")
    rng = np.random.default_rng(count(seed, "the seed"))
    prompts, outputs = _draw(rng, p["prompt"], n), _draw(rng, p["output"], n)
    if rate is None:
        arrivals = np.zeros(n, dtype=np.int64)
    else:  # a Poisson process: exponential gaps; arrival step = floor of the arrival time
        times = np.cumsum(rng.exponential(1.0 / rate, size=n))
        arrivals = np.floor(times).astype(np.int64)
    reqs = tuple(Request(i, int(a), int(pl), int(ol))
                 for i, (a, pl, ol) in enumerate(zip(arrivals, prompts, outputs)))
    return Workload(preset, reqs, int(p["max_len"]), int(seed))
