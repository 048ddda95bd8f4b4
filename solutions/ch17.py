"""Chapter 17 (speculative decoding): a rewind of a page table, checked slot by slot; the
rejection rule for a drafter that is not sure of its guess, checked against the target
distribution exactly."""
from __future__ import annotations

import random
from fractions import Fraction

from pagedkv.allocator import BlockAllocator
from pagedkv.manager import KVCacheManager

from ._seeds import names_its_seed

__all__ = ["rewind", "accept_one"]


def rewind(table: list, length: int, n: int, block_size: int) -> tuple[list, list]:
    """A sequence of ``length`` tokens mapped by ``table`` (physical block ids, in order)
    keeps its first ``n`` tokens (1 <= n <= length): the blocks it keeps, and the blocks it
    gives back, the last first (the order ``free`` returns them in). A block that still
    holds one of the ``n`` tokens stays, the partly filled last one too."""
    if not 1 <= n <= length or len(table) != -(-length // block_size):
        raise ValueError(f"cannot keep {n} of {length} tokens in {len(table)} blocks")
    keep = -(-n // block_size)
    return list(table[:keep]), list(reversed(table[keep:]))


@names_its_seed
def check_rewind(impl=rewind, seed=17) -> dict:
    """Random sequences grown on the teaching manager (their blocks scattered by other
    sequences), rewound by ``impl``: the blocks kept are exactly those that hold one of the
    kept tokens, slot by slot, and the freed ones are the rest, last first; the manager's
    own ``truncate`` agrees."""
    rng = random.Random(seed)
    cases = cut_inside = 0
    for _ in range(300):
        bs = rng.choice([1, 2, 4, 16])
        m = KVCacheManager(BlockAllocator(64, 16 * 8), bs)
        for s in range(3):                             # three sequences, interleaved
            m.add(s, rng.randrange(1, 2 * bs + 1))
        for _ in range(6):
            m.append(rng.randrange(3), rng.randrange(1, bs + 1))
        length = m.num_tokens(0)
        table = m.block_table(0).tolist()
        n = rng.randrange(1, length + 1)
        kept, freed = impl(list(table), length, n, bs)
        slots = m.slots(0).tolist()                    # the oracle: slot by slot
        holding = []
        for slot in slots[:n]:
            if slot // bs not in holding:
                holding.append(slot // bs)
        assert kept == holding, (table, length, n, bs, kept)
        assert freed == [b for b in reversed(table) if b not in holding], (freed, table)
        m.truncate(0, n)
        assert m.block_table(0).tolist() == kept
        m.audit()
        cases += 1
        cut_inside += n % bs != 0
    return {"cases": cases, "cut inside a block": cut_inside}


def accept_one(p: list, q: list, draft: int, u_accept: float, u_sample: float) -> int:
    """One guess of a drafter that is not sure: ``draft`` was drawn from its distribution
    ``q``; the target's is ``p`` (both lists of probabilities over the same tokens). Keep
    the guess with probability ``min(1, p[draft] / q[draft])`` (``u_accept`` below it);
    else draw from the residual ``max(p - q, 0)``, renormalised, at ``u_sample``. Returns
    the token that stands at this position."""
    if u_accept * q[draft] < p[draft]:
        return draft
    residual = [max(a - b, 0) for a, b in zip(p, q)]
    total, running = sum(residual), 0
    for token, r in enumerate(residual):
        running += r
        if running > u_sample * total:
            return token
    return max(t for t, r in enumerate(residual) if r > 0)


@names_its_seed
def check_accept_one(impl=accept_one, seed=1717) -> dict:
    """Exactly, with fractions: over every draft (drawn from ``q``) and every pair of
    uniforms on a grid of 1/12, the token ``impl`` returns is distributed as ``p``, for
    random ``p`` and ``q`` over four tokens in quarters (a grid of 1/12 then meets every
    threshold the rule has exactly: ``p(d) / q(d)`` and the residual's running shares),
    a ``q`` with tokens ``p`` lacks and one that equals ``p`` included."""
    rng = random.Random(seed)
    grid = [Fraction(i, 12) for i in range(12)]
    cases = 0

    def quarters():
        cuts = sorted(rng.randrange(5) for _ in range(3))
        return [Fraction(b - a, 4) for a, b in zip([0] + cuts, cuts + [4])]
    for _ in range(40):
        p, q = quarters(), quarters()
        lacks = ([Fraction(k, 4) for k in (0, 0, 2, 2)], [Fraction(k, 4) for k in (3, 1, 0, 0)])
        for target, drafter in ((p, q), (p, p), lacks):
            out = [Fraction(0)] * 4
            for d, qd in enumerate(drafter):
                if qd == 0:
                    continue
                for ua in grid:
                    for us in grid:
                        out[impl(target, drafter, d, ua, us)] += qd / 144
            assert out == target, (target, drafter, out)
            cases += 1
    return {"distributions": cases, "uniform pairs each": 144}


def _accept_by_p(p, q, draft, u_accept, u_sample):
    """Wrong: keeps the guess with probability ``p(draft)``, the point-mass rule, as if
    the drafter were sure."""
    if u_accept < p[draft]:
        return draft
    return accept_one(p, q, draft, 1.0 - 1e-12, u_sample)


def _resample_from_p(p, q, draft, u_accept, u_sample):
    """Wrong: after a rejection it draws from ``p`` itself, not from the residual."""
    if u_accept * q[draft] < p[draft]:
        return draft
    running = 0
    for token, a in enumerate(p):
        running += a
        if running > u_sample:
            return token
    return len(p) - 1


def _keep_the_partial_block_out(table, length, n, block_size):
    """Wrong: frees the partly filled block too (n // block_size blocks kept)."""
    keep = max(n // block_size, 1)
    return list(table[:keep]), list(reversed(table[keep:]))


def _free_first_to_last(table, length, n, block_size):
    """Wrong: gives the blocks back in table order, not the last first."""
    keep = -(-n // block_size)
    return list(table[:keep]), list(table[keep:])


WRONG = {"rewind": [_keep_the_partial_block_out, _free_first_to_last],
         "accept_one": [_accept_by_p, _resample_from_p]}
