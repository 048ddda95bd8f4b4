"""Chapter 9 (attention kernels): write_kv's NumPy reference from scratch, and the split-K merge
of two partial softmaxes."""
from __future__ import annotations


import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kernels import dense_attention, write_kv

__all__ = ["write_kv_numpy", "merge_partials"]


def write_kv_numpy(cache, k, v, slot_mapping):
    """Token ``t``'s K and V rows go to slot ``slot_mapping[t]`` of ``cache``, laid
    out ``[num_blocks, 2, block_size, kv_heads, head_dim]``: block
    ``slot // block_size``, row ``slot % block_size``, K at index 0 of axis 1 and V
    at 1. A negative slot is padding and is skipped; a slot past the last one is
    refused before anything is written."""
    num_blocks, _, block_size = cache.shape[:3]
    slots = np.asarray(slot_mapping)
    if slots.size and slots.max() >= num_blocks * block_size:
        raise ConfigError(f"slot {slots.max()} is past the cache's "
                          f"{num_blocks * block_size} slots")
    keep = slots >= 0
    block, row = np.divmod(slots[keep], block_size)
    cache[block, 0, row] = k[keep]
    cache[block, 1, row] = v[keep]
    return cache


def merge_partials(o1, lse1, o2, lse2):
    """Attention over tokens A and B from attention over each alone.

    ``o1`` [heads, D] is the softmax-weighted sum of A's V rows, normalised over A
    alone, and ``lse1`` [heads] the log of A's sum of ``exp(score)`` (``-inf`` when
    A is empty, ``o1`` then 0); the same for B. The whole softmax weighs each part
    by its share of the total, ``exp(lse_i - lse)``, with
    ``lse = log(exp(lse1) + exp(lse2))`` computed from the larger one so that
    nothing overflows. Returns (o, lse)."""
    m = np.maximum(lse1, lse2)
    safe = np.where(np.isneginf(m), 0.0, m)          # both empty: no weight at all
    w1, w2 = np.exp(lse1 - safe), np.exp(lse2 - safe)
    total = w1 + w2
    o = np.divide(w1[:, None] * o1 + w2[:, None] * o2, total[:, None],
                  out=np.zeros_like(o1), where=total[:, None] > 0)
    lse = np.where(total > 0, safe + np.log(np.where(total > 0, total, 1.0)), -np.inf)
    return o, lse


# ------------------------------------------------------------------------------------ checks
def check_write_kv_numpy(impl=write_kv_numpy, seed=9, trials=200):
    """Against ``pagedkv.kernels.write_kv`` on a twin cache: random shapes and dtypes, distinct
    slots with padding (-1 and other negatives) among them; a slot past the end must raise
    ``ConfigError`` and leave the cache untouched."""
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    for _ in range(trials):
        blocks, bs = int(rng.integers(1, 9)), int(rng.choice([1, 2, 4, 16]))
        heads, dim = int(rng.integers(1, 4)), int(rng.choice([2, 8, 64]))
        dtype = rng.choice([np.float16, np.float32])
        cache = rng.standard_normal((blocks, 2, bs, heads, dim)).astype(dtype)
        n = int(rng.integers(0, blocks * bs + 1))
        slots = rng.permutation(blocks * bs)[:n].astype(np.int32)
        slots[rng.random(n) < 0.3] = -1
        slots[rng.random(n) < 0.1] = -int(rng.integers(2, 1000))
        k, v = (rng.standard_normal((n, heads, dim)).astype(dtype) for _ in range(2))
        want = write_kv(cache.copy(), k, v, slots)
        try:
            got = impl(cache.copy(), k, v, slots)
        except Exception as exc:                          # a crash is a wrong answer too
            raise AssertionError(f"slots {slots.tolist()}: {exc!r}") from exc
        assert got.shape == want.shape and np.array_equal(got, want), (blocks, bs, slots)
        if n:                                             # one slot past the end
            bad = slots.copy()
            bad[int(rng.integers(n))] = blocks * bs + int(rng.integers(0, 3))
            before = cache.copy()
            try:
                impl(cache, k, v, bad)
            except ConfigError:
                pass
            else:
                raise AssertionError(f"slot {bad.max()} of a {blocks * bs}-slot cache accepted")
            assert np.array_equal(cache, before), "a refused write changed the cache"
    return {"seed": seed, "trials": trials}


def _part(q, k, v, scale):
    """One part's normalised output and log-sum-exp, in float64: [heads, D], [heads]."""
    if len(k) == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    s = q @ k.T * scale                                   # [heads, tokens]
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(axis=1, keepdims=True), m[:, 0] + np.log(p.sum(axis=1))


def check_merge_partials(impl=merge_partials, seed=10, trials=300):
    """Split random keys at a random point (either part may be empty), attend over each part,
    merge, and compare with ``dense_attention`` over all of them; scores up to about 1000
    (where ``exp`` of an lse overflows), and both parts empty."""
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    for _ in range(trials):
        heads, d, n = int(rng.integers(1, 5)), int(rng.choice([4, 16, 64])), int(rng.integers(1, 40))
        spread = float(rng.choice([1.0, 30.0, 300.0]))   # scores up to about 1000
        q = rng.standard_normal((heads, d)) * spread
        k, v = rng.standard_normal((n, 1, d)), rng.standard_normal((n, 1, d))
        scale = 1 / np.sqrt(d)
        cut = int(rng.integers(0, n + 1))
        o, lse = impl(*_part(q, k[:cut, 0], v[:cut, 0], scale),
                      *_part(q, k[cut:, 0], v[cut:, 0], scale))
        want = dense_attention(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
        assert np.isfinite(o).all() and np.allclose(o, want, atol=1e-4), (cut, n, spread)
        s = q @ k[:, 0].T * scale
        assert np.allclose(lse, np.log(np.exp(s - s.max(1, keepdims=True)).sum(1)) + s.max(1))
    empty = _part(np.ones((2, 4)), np.zeros((0, 4)), np.zeros((0, 4)), 0.5)
    o, lse = impl(*empty, *empty)
    assert np.array_equal(o, np.zeros((2, 4))) and np.isneginf(lse).all(), (o, lse)
    return {"seed": seed, "trials": trials}


# ---------------------------------------------------- wrong answers the checks must reject
def _write_minus_one_too(cache, k, v, slot_mapping):
    bs = cache.shape[2]
    if np.asarray(slot_mapping).max(initial=-1) >= cache.shape[0] * bs:
        raise ConfigError("slot past the end")
    for t, s in enumerate(np.asarray(slot_mapping).tolist()):   # -1: the last block's last row
        if s >= -1:
            cache[s // bs, 0, s % bs], cache[s // bs, 1, s % bs] = k[t], v[t]
    return cache


def _write_as_if_k_and_v_interleaved(cache, k, v, slot_mapping):
    slots = np.asarray(slot_mapping)
    if slots.size and slots.max() >= cache.shape[0] * cache.shape[2]:
        raise ConfigError("slot past the end")
    flat = cache.reshape(-1, 2, *cache.shape[3:])          # reads the layout as [slots, 2, ...]
    keep = slots >= 0
    flat[slots[keep], 0], flat[slots[keep], 1] = k[keep], v[keep]
    return cache


def _write_unchecked(cache, k, v, slot_mapping):
    slots = np.asarray(slot_mapping)
    for t, s in enumerate(slots.tolist()):                  # writes until the bad slot fails
        if s >= 0:
            b, r = divmod(s, cache.shape[2])
            if b >= cache.shape[0]:
                raise ConfigError("slot past the end")
            cache[b, 0, r], cache[b, 1, r] = k[t], v[t]
    return cache


def _merge_by_token_share(o1, lse1, o2, lse2):
    n1, n2 = np.isfinite(lse1).astype(float), np.isfinite(lse2).astype(float)
    total = np.maximum(n1 + n2, 1)
    return (n1[:, None] * o1 + n2[:, None] * o2) / total[:, None], np.logaddexp(lse1, lse2)


def _merge_without_the_max(o1, lse1, o2, lse2):
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        w1, w2 = np.exp(lse1), np.exp(lse2)
        return ((w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None],
                np.log(w1 + w2))


def _merge_forgetting_empty_parts(o1, lse1, o2, lse2):
    with np.errstate(invalid="ignore"):
        m = np.maximum(lse1, lse2)
        w1, w2 = np.exp(lse1 - m), np.exp(lse2 - m)
        return (w1[:, None] * o1 + w2[:, None] * o2) / (w1 + w2)[:, None], m + np.log(w1 + w2)


WRONG = {
    "write_kv_numpy": [_write_minus_one_too, _write_as_if_k_and_v_interleaved, _write_unchecked],
    "merge_partials": [_merge_by_token_share, _merge_without_the_max,
                       _merge_forgetting_empty_parts],
}
