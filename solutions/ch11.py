"""Chapter 11 (prefix caching and preemption): the hits predicted without hashes,
token-granular matching as a radix tree does it, and recompute against swap per token.
"""
from __future__ import annotations

import random

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.prefix_cache import PrefixCachingManager

from ._seeds import names_its_seed

__all__ = ["cached_tokens", "radix_tokens", "cheaper"]


def cached_tokens(prompts, block_size: int) -> list[int]:
    """Tokens each prompt finds cached when ``prompts`` are admitted in order and
    nothing is evicted: its leading full blocks whose whole prefix an earlier prompt
    had, never the block that holds its last token."""
    seen = set()                          # every whole prefix ending a full block
    out = []
    for p in prompts:
        found = 0
        for j in range(1, (len(p) - 1) // block_size + 1):
            if tuple(p[:j * block_size]) not in seen:
                break
            found = j * block_size
        out.append(found)
        for j in range(1, len(p) // block_size + 1):
            seen.add(tuple(p[:j * block_size]))
    return out


def radix_tokens(prompts) -> list[int]:
    """Tokens each prompt shares with the longest match among the earlier ones, token by
    token, at most its length minus one."""
    out = []
    for i, p in enumerate(prompts):
        best = 0
        for q in prompts[:i]:
            n = 0
            while n < min(len(p), len(q)) and p[n] == q[n]:
                n += 1
            best = max(best, n)
        out.append(min(best, len(p) - 1))
    return out


def cheaper(parameters: float, kv_bytes: float, flops: float,
            link: float) -> tuple[str, float]:
    """Recompute a preempted token (``2 * parameters`` operations at ``flops`` per
    second) or swap it (``kv_bytes`` out and back at ``link`` bytes per second): the
    cheaper, and how many times slower the other is."""
    recompute = 2 * parameters / flops
    swap = 2 * kv_bytes / link
    if swap < recompute:
        return "swap", recompute / swap
    return "recompute", swap / recompute


# ---------------------------------------------------------------------------- checks
def _prompts(rng, n):
    heads = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9], [7] * 12, []]
    return [rng.choice(heads) + [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
            for _ in range(n)]


@names_its_seed
def check_cached_tokens(impl=cached_tokens, seed=11, rounds=60):
    """Against a real PrefixCachingManager with a pool too large to evict anything."""
    rng = random.Random(seed)
    checked = 0
    for _ in range(rounds):
        bs = rng.choice([1, 2, 3, 4])
        prompts = _prompts(rng, rng.randrange(1, 8))
        m = PrefixCachingManager(BlockAllocator(512, bs, xp=np), bs)
        want = []
        for i, p in enumerate(prompts):
            want.append(m.add(i, p).cached_tokens)
            if rng.random() < 0.5:
                m.free(i)                 # idle, not gone: the pool never runs out
        got = impl(prompts, bs)
        assert list(got) == want, f"block {bs}, {prompts}: {list(got)} != {want}"
        checked += len(prompts)
    assert impl([[1, 2, 3, 4], [1, 2, 3, 4]], 2) == [0, 2], "the last token is computed"
    return {"prompts checked": checked}


@names_its_seed
def check_radix_tokens(impl=radix_tokens, seed=12, rounds=200):
    """Against the definition, written with os.path.commonprefix."""
    import os
    rng = random.Random(seed)
    for _ in range(rounds):
        prompts = _prompts(rng, rng.randrange(1, 7))
        want = [min(max([len(os.path.commonprefix([p, q])) for q in prompts[:i]],
                        default=0), len(p) - 1) for i, p in enumerate(prompts)]
        got = list(impl(prompts))
        assert got == want, f"{prompts}: {got} != {want}"
    assert impl([[5, 6, 7], [5, 6, 8], [5, 6, 7, 1]]) == [0, 2, 3], "the best match"
    return {"rounds": rounds}


def check_cheaper(impl=cheaper):
    """Hand-worked cases: 1 s of compute against 0.5 s of copies, and the other way
    round."""
    kind, ratio = impl(5e11, 0.25e9, 1e12, 1e9)       # recompute 1 s, swap 0.5 s
    assert kind == "swap" and abs(ratio - 2.0) < 1e-9, (kind, ratio)
    kind, ratio = impl(1e11, 1e9, 1e12, 1e9)          # recompute 0.2 s, swap 2 s
    assert kind == "recompute" and abs(ratio - 10.0) < 1e-9, (kind, ratio)
    return {"cases": 2}


# --------------------------------------------------------------------- wrong answers
def _no_last_token_rule(prompts, block_size):
    seen, out = set(), []
    for p in prompts:
        found = 0
        for j in range(1, len(p) // block_size + 1):
            if tuple(p[:j * block_size]) not in seen:
                break
            found = j * block_size
        out.append(found)
        seen.update(tuple(p[:j * block_size])
                    for j in range(1, len(p) // block_size + 1))
    return out


def _blocks_not_prefixes(prompts, block_size):
    """Matches each block by its own tokens only, forgetting what came before it."""
    seen, out = set(), []
    for p in prompts:
        found = 0
        for j in range((len(p) - 1) // block_size):
            if tuple(p[j * block_size:(j + 1) * block_size]) not in seen:
                break
            found = (j + 1) * block_size
        out.append(found)
        seen.update(tuple(p[j * block_size:(j + 1) * block_size])
                    for j in range(len(p) // block_size))
    return out


def _previous_only(prompts):
    out = []
    for i, p in enumerate(prompts):
        q = prompts[i - 1] if i else []
        n = 0
        while n < min(len(p), len(q)) and p[n] == q[n]:
            n += 1
        out.append(min(n, len(p) - 1))
    return out


def _uncapped(prompts):
    return [min(len(p), r + (r == len(p) - 1))
            for p, r in zip(prompts, radix_tokens(prompts))]


WRONG = {
    "cached_tokens": [_no_last_token_rule, _blocks_not_prefixes],
    "radix_tokens": [_previous_only, _uncapped],
    "cheaper": [lambda p, k, f, link: cheaper(p, k / 2, f, link),
                lambda p, k, f, link: ("swap", 1.0)],
}
