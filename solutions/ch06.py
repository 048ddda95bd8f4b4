"""Chapter 6 (the simulation): preempt the longest request instead of the newest, and the mean
of a workload's lengths computed without drawing them."""
from __future__ import annotations

import math
import random
import numpy as np

from pagedkv import sim

__all__ = ["preempt_longest", "expected_length"]


def preempt_longest(queue, batch, policy, watch, step: int) -> None:
    """Preemption by recomputation of the running request with the most tokens
    (the newest of equally long ones): it gives back the most memory at once. It
    goes back to the head of the queue with all its tokens, as with
    :func:`pagedkv.sim.recompute`."""
    i = len(batch) - 1 - int(np.argmax(batch.lens[::-1]))  # the last of the longest
    req, length = batch.reqs.pop(i), int(batch.lens[i])
    batch.lens, batch.finals = np.delete(batch.lens, i), np.delete(batch.finals, i)
    policy.release(req.rid)
    queue.waiting.appendleft((req, length))
    watch.preempted(step, req.rid, length)


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
class _Watch:
    def __init__(self):
        self.calls = []

    def preempted(self, step, rid, length):
        self.calls.append((step, rid, length))


class _Policy:
    def __init__(self):
        self.released = []

    def release(self, rid):
        self.released.append(rid)


def check_preempt_longest(impl=preempt_longest, seed=4, trials=300):
    """By hand on random batches (which request leaves, where it goes, what is released and
    told), then inside ``serve`` with every token written and verified, against a spy that
    checks each preempted request was the longest running."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    for _ in range(trials):
        batch, queue = sim.Running(), sim.Queue([])
        reqs = [sim.Request(rid, 0, 1, 50) for rid in range(rng.randrange(1, 9))]
        for r in reqs:
            batch.add(r, rng.randrange(1, 8))        # few lengths: ties happen
        queue.waiting.append(("someone waiting", 3))
        lens = batch.lens.tolist()
        want = max(range(len(lens)), key=lambda i: (lens[i], i))     # the newest of the longest
        policy, watch = _Policy(), _Watch()
        impl(queue, batch, policy, watch, 17)
        gone = reqs[want]
        assert batch.ids == [r.rid for r in reqs if r is not gone], (lens, batch.ids)
        assert batch.lens.tolist() == lens[:want] + lens[want + 1:]
        assert batch.finals.tolist() == [r.total for r in reqs if r is not gone]
        assert list(queue.waiting) == [(gone, lens[want]), ("someone waiting", 3)]
        assert policy.released == [gone.rid] and watch.calls == [(17, gone.rid, lens[want])]

    def spy(queue, batch, policy, watch, step):
        before = dict(zip(batch.ids, batch.lens.tolist()))
        impl(queue, batch, policy, watch, step)
        (gone,) = set(before) - set(batch.ids)
        assert before[gone] == max(before.values()), "a shorter request was preempted"

    workload = sim.make_workload("chat", n=40, seed=seed, rate=2.0)
    policy = sim.PagedPolicy(sim.MiB, 16, write=True, max_len=workload.max_len)
    run = sim.serve(workload, policy, preempt=spy)
    assert run.completions == 40 and run.preemptions > 0 and run.corrupted_tokens == 0
    assert run.prefill_tokens == sum(r.prompt for r in workload.requests) + run.recomputed_tokens
    policy.manager.audit()
    return {"seed": seed, "batches": trials, "preemptions in the served run": run.preemptions}


def check_expected_length(impl=expected_length, seed=0, n=200_000):
    """Against the mean of ``n`` lengths drawn by ``make_workload`` for every preset, within
    four standard errors, and by hand where the answer is plain."""
    print(f"seed={seed}")
    assert impl(("uniform", 4, 32)) == 18
    assert abs(impl(("lognormal", 50.0, 0.5, 7, 7)) - 7) < 1e-12     # clipped to one value
    for name in sim.PRESETS:
        prompts, outputs = sim.make_workload(name, n=n, seed=seed).lengths()
        for part, drawn in (("prompt", prompts), ("output", outputs)):
            got = impl(sim.PRESETS[name][part])
            tolerance = 4 * drawn.std() / math.sqrt(n)
            assert abs(got - drawn.mean()) < tolerance, (name, part, got, drawn.mean())
    return {"seed": seed, "presets": len(sim.PRESETS), "draws each": n}


# ---------------------------------------------------- wrong answers the checks must reject
def _preempt_shortest(queue, batch, policy, watch, step):
    i = int(np.argmin(batch.lens))
    req, length = batch.reqs.pop(i), int(batch.lens[i])
    batch.lens, batch.finals = np.delete(batch.lens, i), np.delete(batch.finals, i)
    policy.release(req.rid)
    queue.waiting.appendleft((req, length))
    watch.preempted(step, req.rid, length)


def _preempt_longest_to_the_back(queue, batch, policy, watch, step):
    i = len(batch) - 1 - int(np.argmax(batch.lens[::-1]))
    req, length = batch.reqs.pop(i), int(batch.lens[i])
    batch.lens, batch.finals = np.delete(batch.lens, i), np.delete(batch.finals, i)
    policy.release(req.rid)
    queue.waiting.append((req, length))              # behind everyone who waits
    watch.preempted(step, req.rid, length)


def _preempt_oldest_of_the_longest(queue, batch, policy, watch, step):
    i = int(np.argmax(batch.lens))
    req, length = batch.reqs.pop(i), int(batch.lens[i])
    batch.lens, batch.finals = np.delete(batch.lens, i), np.delete(batch.finals, i)
    policy.release(req.rid)
    queue.waiting.appendleft((req, length))
    watch.preempted(step, req.rid, length)


def _mean_unclipped(spec):
    return (spec[1] + spec[2]) / 2 if spec[0] == "uniform" else spec[1]


def _mean_without_the_sigma_shift(spec):
    if spec[0] == "uniform":
        return (spec[1] + spec[2]) / 2
    _, m, sigma, lo, hi = spec
    return expected_length(("lognormal", m * math.exp(sigma ** 2 / 2), sigma, lo, hi))


WRONG = {
    "preempt_longest": [sim.recompute, _preempt_shortest, _preempt_longest_to_the_back,
                        _preempt_oldest_of_the_longest],
    "expected_length": [_mean_unclipped, _mean_without_the_sigma_shift],
}
