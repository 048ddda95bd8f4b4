"""Chapter 6 (the simulation): preempt the longest request instead of the newest, and the mean
of a workload's lengths computed without drawing them."""
from __future__ import annotations

import math
import random
import numpy as np

from pagedkv import sim

from ._seeds import names_its_seed

__all__ = ["preempt_longest", "expected_length"]


def preempt_longest(batch) -> int:
    """Whom preemption takes: the running request with the most tokens (the newest of
    equally long ones), which gives back the most memory at once. A drop-in for
    :func:`pagedkv.sim.newest`: the index of that request in ``batch``."""
    return len(batch) - 1 - int(np.argmax(batch.lens[::-1]))  # the last of the longest


def _lognormal_cdf(x: float, mu: float, sigma: float) -> float:
    if x <= 0:
        return 0.0
    return 0.5 * (1 + math.erf((math.log(x) - mu) / (sigma * math.sqrt(2))))


def expected_length(spec) -> float:
    """The exact mean of a length drawn from a preset's ``spec``, without drawing:
    ``("uniform", lo, hi)``, or ``("lognormal", m, sigma, lo, hi)`` rounded to an
    integer and clipped to [lo, hi]. A length (at least lo) is at least k > lo when
    the lognormal is at least k - 1/2, so the mean is lo plus the sum of those
    chances for k = lo + 1 ... hi."""
    if spec[0] == "uniform":
        return (spec[1] + spec[2]) / 2
    _, m, sigma, lo, hi = spec
    mu = math.log(m) - sigma ** 2 / 2        # so that the lognormal's own mean is m
    return lo + sum(1 - _lognormal_cdf(k - 0.5, mu, sigma)
                    for k in range(lo + 1, hi + 1))


# ------------------------------------------------------------------------------------ checks
@names_its_seed
def check_preempt_longest(impl=preempt_longest, seed=4, trials=300):
    """By hand on random batches (which request it names, the batch left as it was), then
    inside ``serve`` with every token written and verified, against a spy that checks each
    preempted request was the longest running."""
    rng = random.Random(seed)
    for _ in range(trials):
        batch = sim.Running()
        reqs = [sim.Request(rid, 0, 1, 50) for rid in range(rng.randrange(1, 9))]
        for r in reqs:
            batch.add(r, rng.randrange(1, 8))        # few lengths: ties happen
        lens = batch.lens.tolist()
        want = max(range(len(lens)), key=lambda i: (lens[i], i))  # the newest of the longest
        got = impl(batch)
        assert got == want, (lens, got, want)
        assert batch.lens.tolist() == lens and batch.ids == [r.rid for r in reqs]

    def spy(batch):
        i = impl(batch)
        assert batch.lens[i] == batch.lens.max(), "a shorter request was preempted"
        return i

    workload = sim.make_workload("chat", n=40, seed=seed, rate=2.0)
    policy = sim.PagedPolicy(sim.MiB, 16, write=True, max_len=workload.max_len)
    run = sim.serve(workload, policy, preempt=spy)
    assert run.completions == 40 and run.preemptions > 0 and run.corrupted_tokens == 0
    assert run.prefill_tokens == sum(r.prompt for r in workload.requests) + run.recomputed_tokens
    policy.manager.audit()
    return {"batches": trials, "preemptions in the served run": run.preemptions}


@names_its_seed
def check_expected_length(impl=expected_length, seed=0, n=200_000):
    """Against the mean of ``n`` lengths drawn by ``make_workload`` for every preset, within
    four standard errors, and by hand where the answer is plain."""
    assert impl(("uniform", 4, 32)) == 18
    assert abs(impl(("lognormal", 50.0, 0.5, 7, 7)) - 7) < 1e-12     # clipped to one value
    for name in sim.PRESETS:
        prompts, outputs = sim.make_workload(name, n=n, seed=seed).lengths()
        for part, drawn in (("prompt", prompts), ("output", outputs)):
            got = impl(sim.PRESETS[name][part])
            tolerance = 4 * drawn.std() / math.sqrt(n)
            assert abs(got - drawn.mean()) < tolerance, (name, part, got, drawn.mean())
    return {"presets": len(sim.PRESETS), "draws each": n}


# ---------------------------------------------------- wrong answers the checks must reject
def _preempt_shortest(batch):
    return int(np.argmin(batch.lens))


def _preempt_oldest_of_the_longest(batch):
    return int(np.argmax(batch.lens))


def _preempt_longest_final(batch):
    return len(batch) - 1 - int(np.argmax(batch.finals[::-1]))


def _mean_unclipped(spec):
    return (spec[1] + spec[2]) / 2 if spec[0] == "uniform" else spec[1]


def _mean_without_the_sigma_shift(spec):
    if spec[0] == "uniform":
        return (spec[1] + spec[2]) / 2
    _, m, sigma, lo, hi = spec
    return expected_length(("lognormal", m * math.exp(sigma ** 2 / 2), sigma, lo, hi))


WRONG = {
    "preempt_longest": [sim.newest, _preempt_shortest, _preempt_oldest_of_the_longest,
                        _preempt_longest_final],
    "expected_length": [_mean_unclipped, _mean_without_the_sigma_shift],
}
