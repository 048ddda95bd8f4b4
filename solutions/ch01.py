"""Chapter 1 (Why paging): best fit against first fit, and the waste of a block size."""
from __future__ import annotations

import numpy as np

from pagedkv.checks import cdiv, positive_int
from pagedkv.contiguous import FirstFit

from ._seeds import names_its_seed

__all__ = ["BestFit", "replay", "block_waste"]


class BestFit(FirstFit):
    """Ranges placed best fit: from the shortest free hole that holds them
    (the first of equally short ones). Freeing and merging are FirstFit's."""

    def alloc(self, n: int):
        n = positive_int(n, "n")
        fits = [i for i, length in enumerate(self.lengths) if length >= n]
        if not fits:
            return None
        i = min(fits, key=lambda i: self.lengths[i])  # the first of equals
        start = self.starts[i]
        if self.lengths[i] == n:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += n
            self.lengths[i] -= n
        self.free_total -= n
        return start


def replay(policy, *, size=1024, steps=3000, lengths=(8, 128), lifetimes=(1, 40), seed=0):
    """Serve a random trace with a contiguous allocator ``policy`` (a class like FirstFit).

    Each step, the requests whose lifetime is over leave, then one request arrives with a length
    and a lifetime drawn uniformly from the given ranges; a request that finds no hole long
    enough is refused. The trace depends on ``seed`` only, so two policies see the same one.
    Returns the counts: served, refused, refused although the free slots added up to enough
    (external fragmentation), and the mean number of free holes.
    """
    rng = np.random.default_rng(seed)
    need = rng.integers(lengths[0], lengths[1] + 1, size=steps).tolist()
    life = rng.integers(lifetimes[0], lifetimes[1] + 1, size=steps).tolist()
    space, live = policy(size), []                      # live: (end step, start, length)
    out = {"served": 0, "refused": 0, "refused_with_room": 0}
    holes = 0
    for t in range(steps):
        for item in [x for x in live if x[0] == t]:
            live.remove(item)
            space.free(item[1], item[2])
        start = space.alloc(need[t])
        if start is None:
            out["refused"] += 1
            out["refused_with_room"] += space.free_total >= need[t]
        else:
            out["served"] += 1
            live.append((t + life[t], start, need[t]))
        holes += len(space.holes())
    out["mean_holes"] = round(holes / steps, 2)
    return out


def block_waste(lengths, block_size: int) -> float:
    """The share of reserved slots left empty when each sequence takes
    whole blocks."""
    lengths = np.asarray(lengths, dtype=np.int64)
    reserved = int((cdiv(lengths, block_size) * block_size).sum())
    return 1 - int(lengths.sum()) / reserved


# ------------------------------------------------------------------------------------ checks
def _best_fit_oracle(free: np.ndarray, n: int):
    """Best fit on a slot-by-slot model: ``free[i]`` is True for a free slot."""
    runs, i = [], 0
    while i < len(free):
        if free[i]:
            j = i
            while j < len(free) and free[j]:
                j += 1
            runs.append((j - i, i))                         # (length, start)
            i = j
        else:
            i += 1
    fits = [r for r in runs if r[0] >= n]
    return min(fits)[1] if fits else None                 # shortest, then lowest start


@names_its_seed
def check_BestFit(impl=BestFit, seed=1, ops=2000):
    """Hand-worked placements, then random allocs and frees against the slot model."""
    a = impl(20)
    s0, _, s2, _ = a.alloc(6), a.alloc(2), a.alloc(3), a.alloc(4)   # 0, 6, 8, 11; hole 15+5
    a.free(s0, 6)
    a.free(s2, 3)                                       # holes (0, 6), (8, 3), (15, 5)
    assert a.alloc(3) == 8, "3 slots belong in the hole of 3 at 8"
    assert a.alloc(5) == 15, "5 slots belong in the hole of 5 at 15"
    assert a.alloc(4) == 0 and a.alloc(3) is None       # hole (4, 2) left: 3 do not fit
    b = impl(12)
    x, _, y, _ = b.alloc(2), b.alloc(3), b.alloc(2), b.alloc(5)
    b.free(y, 2)
    b.free(x, 2)                                         # two holes of 2: take the first
    assert b.alloc(2) == 0, "of equally short holes, best fit takes the first"

    rng = np.random.default_rng(seed)
    size = 64
    space, free, live = impl(size), np.ones(size, dtype=bool), []
    for _ in range(ops):
        if live and rng.random() < 0.45:
            start, n = live.pop(int(rng.integers(len(live))))
            space.free(start, n)
            free[start:start + n] = True
        else:
            n = int(rng.integers(1, 17))
            want = _best_fit_oracle(free, n)
            got = space.alloc(n)
            assert got == want, f"seed {seed}: alloc({n}) gave {got}, best fit is {want}"
            if got is not None:
                free[got:got + n] = False
                live.append((got, n))
        assert space.free_total == int(free.sum())
    return {"operations": ops, "agreed with the slot model": True}


def check_replay(impl=replay):
    """Counts add up, the trace is the same for both policies, and a memory that holds every
    request refuses none."""
    first = impl(FirstFit, steps=400, seed=3)
    assert first["served"] + first["refused"] == 400
    assert 0 <= first["refused_with_room"] <= first["refused"]
    assert first == impl(FirstFit, steps=400, seed=3), "the same seed must give the same run"
    roomy = impl(FirstFit, size=128 * 41, steps=400, seed=3)
    assert roomy["refused"] == 0 and roomy["served"] == 400
    tiny = impl(FirstFit, size=100, steps=50, lengths=(101, 110), seed=3)
    assert tiny["refused"] == 50 and tiny["refused_with_room"] == 0
    return {"FirstFit": first, "BestFit": impl(BestFit, steps=400, seed=3)}


@names_its_seed
def check_block_waste(impl=block_waste, seed=0):
    """Against a per-sequence loop, on random lengths and block sizes."""
    rng = np.random.default_rng(seed)
    for _ in range(200):
        lengths = rng.integers(1, 500, size=int(rng.integers(1, 30))).tolist()
        bs = int(rng.integers(1, 64))
        reserved = sum(-(-n // bs) * bs for n in lengths)
        want = 1 - sum(lengths) / reserved
        got = impl(lengths, bs)
        assert abs(got - want) < 1e-12, f"seed {seed}: lengths {lengths}, block {bs}: {got}"
    assert impl([16, 32], 16) == 0 and impl([1], 1) == 0
    assert impl([17], 16) == 1 - 17 / 32
    return {"cases": 200}


# ---------------------------------------------------- wrong answers the checks must reject
class _WorstFit(FirstFit):
    def alloc(self, n):
        fits = [i for i, length in enumerate(self.lengths) if length >= n]
        if not fits:
            return None
        i = max(fits, key=lambda i: self.lengths[i])
        start = self.starts[i]
        if self.lengths[i] == n:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += n
            self.lengths[i] -= n
        self.free_total -= n
        return start


class _LastOfEquals(FirstFit):
    def alloc(self, n):
        fits = [i for i, length in enumerate(self.lengths) if length >= n]
        if not fits:
            return None
        i = max(fits, key=lambda i: (-self.lengths[i], i))
        start = self.starts[i]
        if self.lengths[i] == n:
            del self.starts[i], self.lengths[i]
        else:
            self.starts[i] += n
            self.lengths[i] -= n
        self.free_total -= n
        return start


def _replay_never_frees(policy, **kw):
    return replay(policy, **{**kw, "lifetimes": (10**9, 10**9)})


WRONG = {
    "BestFit": [FirstFit, _WorstFit, _LastOfEquals],
    "replay": [_replay_never_frees],
    "block_waste": [lambda lengths, bs: 1 - sum(lengths) / (len(lengths) * bs * 2),
                    lambda lengths, bs: block_waste(lengths, bs) if bs > 1 else 0.5],
}
