"""Tests of pagedkv.kernels.sampling: a batch sampled in one call (NumPy; CuPy with a GPU).

The oracle is the exact categorical distribution, computed here in float64 with a loop per
row and nothing from the module under test: the softmax of ``logits / T``, cut to the
tokens at or above the ``k``-th largest probability (ties all in), then to the tokens at or
above the largest value whose share of their mass is at least ``top_p`` (ties all in).
Draws are compared with it by Pearson's chi-square test, failing below a p-value of 1e-6; a
draw outside the oracle's support fails at once. Every case prints its seed.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from _backends import XP_PARAMS, host, resolve
from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels.fused import argmax_rows
from pagedkv.kernels.sampling import (derive_seed, kept_tokens, sample_rows, splitmix64,
                                      uniforms)

MASK = 2**64 - 1


@pytest.fixture(params=XP_PARAMS)
def xp(request):
    return resolve(request.param)


def rng_for(seed):
    print(f"seed = {seed}")
    return np.random.default_rng(seed)


# ------------------------------------------------------------------ the oracle

def oracle_probs(logits, t, top_p=1.0, top_k=0, cut=None):
    """The exact distribution of one row (float64); ``cut`` forces the kept count (a wrong
    oracle, to show that the check rejects it)."""
    z = np.asarray(logits, np.float64) / t
    p = np.exp(z - z.max())
    p /= p.sum()
    desc = np.sort(p[p > 0])[::-1]                 # most likely first
    last = len(desc) - 1                           # index of the smallest value kept
    if 0 < top_k < len(desc):
        last = top_k - 1
    while last + 1 < len(desc) and desc[last + 1] == desc[last]:
        last += 1                                  # ties with the k-th are in
    if top_p < 1:
        mass = math.fsum(desc[:last + 1])
        i = 0
        while True:
            while i + 1 <= last and desc[i + 1] == desc[i]:
                i += 1                             # a value's ties count together
            if math.fsum(desc[:i + 1]) >= top_p * mass:
                break
            i += 1
        last = i
    thr = desc[last] if cut is None else desc[cut - 1]
    q = np.where(p >= thr, p, 0.0)
    return q / q.sum()


def chi2_sf(x, df):
    """P(chi-square with ``df`` degrees of freedom > x): 1 - the regularised lower incomplete
    gamma function P(df/2, x/2), summed from its power series."""
    a, h = df / 2, x / 2
    if h <= 0:
        return 1.0
    term = total = 1.0 / a
    n = 0
    while term > total * 1e-17:
        n += 1
        term *= h / (a + n)
        total += term
    return max(0.0, 1.0 - math.exp(a * math.log(h) - h - math.lgamma(a)) * total)


def fits(draws, q, alpha=1e-6):
    """(does the sample fit q, chi-square statistic, its p-value): no draw outside q's
    support, and Pearson's chi-square over the tokens with expected count >= 5 (the rest
    pooled into one cell) not beyond its 1 - alpha quantile."""
    n = len(draws)
    counts = np.bincount(draws, minlength=len(q))
    if np.any(counts[q == 0] > 0):
        return False, math.inf, 0.0
    big, small = n * q >= 5, (n * q < 5) & (q > 0)
    obs, exp = list(counts[big]), list(n * q[big])
    if small.any():
        obs.append(counts[small].sum())
        exp.append(n * q[small].sum())
    stat = float(sum((o - e) ** 2 / e for o, e in zip(obs, exp)))
    pvalue = chi2_sf(stat, max(1, len(obs) - 1))
    return pvalue >= alpha, stat, pvalue


def draw(xp, logits_row, n, t, top_p, top_k, seed, counter0=0):
    """n tokens for one row of logits: n copies of it, counters counter0 .. counter0+n-1."""
    rows = xp.asarray(np.tile(np.asarray(logits_row, np.float32), (n, 1)))
    return host(sample_rows(rows, t, top_p, top_k, seed,
                            np.arange(counter0, counter0 + n))).astype(np.int64)


# ------------------------------------------------------------------ random numbers

def splitmix64_py(x):
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


def test_splitmix64_matches_python_integers(xp):
    rng = rng_for(11)
    xs = [int(v) for v in rng.integers(0, 2**63, 200, dtype=np.uint64)] + [0, 1, MASK, 2**63]
    got = host(splitmix64(xp.asarray(np.array(xs, dtype=np.uint64)), xp))
    assert [int(v) for v in got] == [splitmix64_py(v) for v in xs]
    # the published first output of splitmix64 seeded with 0
    assert splitmix64_py(0x9E3779B97F4A7C15) == 0xE220A8397B1DCDAF


def test_uniforms_are_the_hash_of_seed_and_counter(xp):
    rng = rng_for(12)
    seeds = rng.integers(0, 2**63, 100, dtype=np.uint64)
    counters = rng.integers(0, 10**6, 100)
    got = host(uniforms(xp.asarray(seeds), xp.asarray(counters), xp))
    want = [(splitmix64_py((splitmix64_py(int(s)) + int(c) * 0x9E3779B97F4A7C15) & MASK)
             >> 40) / 2**24 for s, c in zip(seeds, counters)]
    assert got.dtype == np.float32 and got.tolist() == want


def test_uniforms_are_uniform_and_pairs_independent():
    n = 200_000
    u = uniforms(np.full(n + 1, 20261203, dtype=np.uint64), np.arange(n + 1))
    assert u.min() >= 0 and u.max() < 1
    ok, stat, pvalue = fits(np.minimum((u[:n] * 50).astype(np.int64), 49), np.full(50, 1 / 50))
    print("1-D chi-square", stat, "p-value", pvalue)
    assert ok
    # consecutive counters: the pairs fill a 10 x 10 grid evenly
    cell = np.minimum((u[:n] * 10).astype(np.int64), 9) * 10 + \
        np.minimum((u[1:] * 10).astype(np.int64), 9)
    ok, stat, pvalue = fits(cell, np.full(100, 1 / 100))
    print("pairs chi-square", stat, "p-value", pvalue)
    assert ok
    # neighbouring seeds too
    v = uniforms(np.arange(n, dtype=np.uint64), np.zeros(n, dtype=np.int64))
    ok, stat, pvalue = fits(np.minimum((v * 50).astype(np.int64), 49), np.full(50, 1 / 50))
    assert ok, (stat, pvalue)
    assert abs(np.corrcoef(u[:n], v)[0, 1]) < 0.02


def test_derived_seeds_differ():
    seeds = {derive_seed(7, i) for i in range(1000)} | {derive_seed(8, i) for i in range(1000)}
    assert len(seeds) == 2000 and all(0 <= s < 2**64 for s in seeds)


# ------------------------------------------------------------------ greedy and the kept set

def test_temperature_zero_is_argmax_first_of_equals(xp):
    rng = rng_for(21)
    logits = rng.normal(size=(64, 500)).astype(np.float32)
    logits[::3, 400] = logits[::3, 7] = 50.0                  # two equal maxima: 7 wins
    logits[5, :] = 1.0                                         # all equal: token 0
    d = xp.asarray(logits)
    got = host(sample_rows(d, 0.0, rng.uniform(0.1, 1, 64), rng.integers(0, 9, 64),
                           rng.integers(0, 2**32, 64), rng.integers(0, 99, 64)))
    assert got.dtype == np.int32
    assert got.tolist() == np.argmax(logits, axis=1).tolist()
    assert got.tolist() == host(argmax_rows(d)).tolist()
    assert got[0] == 7 and got[5] == 0


def test_top_k_one_is_argmax(xp):
    rng = rng_for(22)
    logits = rng.normal(size=(300, 200)).astype(np.float32)
    got = host(sample_rows(xp.asarray(logits), rng.uniform(0.2, 3, 300), 1.0, 1, 5,
                           np.arange(300)))
    assert got.tolist() == np.argmax(logits, axis=1).tolist()


def _p_away_from_prefixes(rng, logits, t, k, gap=1e-4):
    """A top_p in (0.05, 0.99) at least ``gap`` away from every prefix share of the row's
    top-k (so float32 rounding cannot move the cut)."""
    shares = np.cumsum(np.sort(oracle_probs(logits, t, 1.0, k))[::-1])
    while True:
        p = rng.uniform(0.05, 0.99)
        if np.min(np.abs(shares - p)) > gap:
            return p


def test_kept_set_is_the_smallest_prefix_with_the_mass(xp):
    rng = rng_for(23)
    rows, vocab = 120, 60
    scale = rng.uniform(0.3, 4, (rows, 1))
    logits = (rng.normal(size=(rows, vocab)) * scale).astype(np.float32)
    t = rng.uniform(0.3, 2.0, rows)
    k = rng.choice([0, 1, 3, 10, 59, 60, 100], rows)
    p = np.array([1.0 if i % 7 == 0 else _p_away_from_prefixes(rng, logits[i], t[i], k[i])
                  for i in range(rows)])
    got = host(kept_tokens(xp.asarray(logits), t, p, k))
    for i in range(rows):
        want = oracle_probs(logits[i], t[i], p[i], k[i]) > 0
        assert got[i].tolist() == want.tolist(), (i, t[i], p[i], k[i])


def test_top_p_at_a_prefix_mass_boundary():
    probs = np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])   # most likely 1, 3, 4; 2 and 5 equal
    logits = np.log(probs).astype(np.float32)[None, :]
    for top_p, want in [(0.549, [1, 3]), (0.551, [1, 3, 4]), (0.749, [1, 3, 4]),
                        (0.751, [1, 3, 4, 2, 5]), (0.849, [1, 3, 4, 2, 5]),
                        (0.951, [0, 1, 2, 3, 4, 5]),
                        (1e-6, [1]), (1.0, [0, 1, 2, 3, 4, 5])]:
        got = np.flatnonzero(kept_tokens(logits, 1.0, top_p, 0)[0])
        assert sorted(got.tolist()) == sorted(want), top_p
    # equal tokens at the top-k cut: both stay (five tokens for k = 4)
    assert np.flatnonzero(kept_tokens(logits, 1.0, 1.0, 4)[0]).tolist() == [1, 2, 3, 4, 5]
    assert np.flatnonzero(kept_tokens(logits, 1.0, 1.0, 3)[0]).tolist() == [1, 3, 4]


def test_masked_tokens_are_never_drawn(xp):
    rng = rng_for(24)
    logits = rng.normal(size=(4000, 30)).astype(np.float32)
    logits[:, [0, 5]] = 20.0
    logits[:, [0, 5]] = -np.inf                                # as min_tokens masks end tokens
    got = host(sample_rows(xp.asarray(logits), 1.0, 1.0, 0, 3, np.arange(4000)))
    assert not np.isin(got, [0, 5]).any()
    assert len(np.unique(got)) == 28


# ------------------------------------------------------------------ top-k and top-p together

# probabilities [.4, .3, .2, .1]: top-k first, then top-p of what top-k kept (its mass, not
# the row's): (top_k, top_p, the tokens kept), each worked by hand
TOGETHER = [
    (2, 0.5, [0]),            # top-k keeps .7; .4 >= .5 * .7: the first alone
    (2, 0.6, [0, 1]),         # .4 < .42: both
    (3, 0.75, [0, 1]),        # .7 >= .75 * .9 = .675 (of the row's mass, .7 < .75: three)
    (3, 0.8, [0, 1, 2]),      # .7 < .72
    (1, 0.1, [0]),
    (4, 0.5, [0, 1]),         # top-k keeps all: top-p alone (.4 < .5 <= .7)
    (0, 0.35, [0]),           # top-k off
    (2, 1.0, [0, 1]),         # top-p off
]


@pytest.mark.parametrize("top_k, top_p, want", TOGETHER)
def test_top_k_and_top_p_together_keep_exactly_the_rules_tokens(xp, top_k, top_p, want):
    """The rule's set, worked by hand, for probabilities [.4, .3, .2, .1]: the kept set,
    and 2,000 draws that fall only in it (all of them on the first token where it is
    alone)."""
    logits = np.log(np.array([0.4, 0.3, 0.2, 0.1])).astype(np.float32)
    kept = host(kept_tokens(xp.asarray(logits[None, :]), 1.0, top_p, top_k))[0]
    assert np.flatnonzero(kept).tolist() == want
    drawn = draw(xp, logits, 2000, 1.0, top_p, top_k, 60 + top_k)
    assert set(np.unique(drawn).tolist()) == set(want)


COMBINED = [  # (temperature, top_p, top_k): each cut by both, top-p inside top-k's set
    (0.6, 0.6, 6), (1.0, 0.8, 8), (1.7, 0.5, 3), (1.0, 0.75, 12)]


@pytest.mark.parametrize("t, top_p, top_k", COMBINED)
def test_combined_settings_follow_the_exact_distribution(xp, t, top_p, top_k):
    """Histograms of 20,000 draws against the oracle's distribution for settings where
    top-k and top-p both cut (checked here: the set differs from either alone), on a row
    with ties at the k-th token."""
    seed = 81 + COMBINED.index((t, top_p, top_k))
    rng = rng_for(seed)
    logits = np.concatenate([np.log([0.4, 0.3, 0.2, 0.1]),
                             rng.normal(size=20) - 3]).astype(np.float32)
    logits[[4, 5]] = logits[2]                      # ties with the third most likely
    q = oracle_probs(logits, t, top_p, top_k)
    alone = [oracle_probs(logits, t, 1.0, top_k), oracle_probs(logits, t, top_p, 0)]
    assert all(np.count_nonzero(q) != np.count_nonzero(a) for a in alone)
    tokens = draw(xp, logits, 20_000, t, top_p, top_k, seed)
    ok, stat, pvalue = fits(tokens, q)
    print(f"kept {np.count_nonzero(q)} tokens, chi-square {stat:.1f}, p-value {pvalue:.3g}")
    assert ok


# ------------------------------------------------------------------ distributions

CONFIGS = [  # (temperature, top_p, top_k)
    (1.0, 1.0, 0), (0.7, 0.9, 0), (1.3, 0.8, 10), (0.5, 1.0, 5), (2.0, 0.5, 0), (1.0, 0.95, 25)]


@pytest.mark.parametrize("t, top_p, top_k", CONFIGS)
def test_draws_follow_the_exact_distribution(xp, t, top_p, top_k):
    seed = 31 + CONFIGS.index((t, top_p, top_k))
    rng = rng_for(seed)
    logits = (rng.normal(size=40) * 2).astype(np.float32)
    q = oracle_probs(logits, t, top_p, top_k)
    tokens = draw(xp, logits, 20_000, t, top_p, top_k, seed)
    ok, stat, pvalue = fits(tokens, q)
    print(f"kept {np.count_nonzero(q)} tokens, chi-square {stat:.1f}, p-value {pvalue:.3g}")
    assert ok


def test_the_check_rejects_a_top_p_cut_off_by_one(xp):
    probs = np.array([0.3, 0.25, 0.2, 0.15, 0.1])
    logits = np.log(probs).astype(np.float32)
    tokens = draw(xp, logits, 20_000, 1.0, 0.7, 0, 41)
    right = oracle_probs(logits, 1.0, 0.7)
    assert np.count_nonzero(right) == 3                       # 0.55 < 0.7 <= 0.75
    assert fits(tokens, right)[0]
    for wrong in (2, 4):                                      # one rank too few, one too many
        assert not fits(tokens, oracle_probs(logits, 1.0, 0.7, cut=wrong))[0]
    # a subtler wrong cut: the right set, but a token's mass moved by 10% to its neighbour
    bent = right.copy()
    bent[2] *= 0.9
    bent[1] += right[2] * 0.1
    assert not fits(tokens, bent)[0]


def test_a_large_vocabulary_follows_the_distribution(xp):
    rng = rng_for(42)
    logits = (rng.normal(size=4096) * 3).astype(np.float32)
    q = oracle_probs(logits, 0.8, 0.9, 0)
    tokens = draw(xp, logits, 20_000, 0.8, 0.9, 0, 42)
    ok, stat, pvalue = fits(tokens, q)
    print(f"kept {np.count_nonzero(q)} of 4096, chi-square {stat:.1f}, p-value {pvalue:.3g}")
    assert ok


def exact_inverse_cdf(logits, t, top_p, top_k, u):
    """The token sample_rows must choose for uniform ``u``, one row, the sums in long double
    (x87's 80 bits on x86) from the rule's float32 probabilities: the rule, without
    rounding. Thresholds by a sort; the walk in token order."""
    z = logits / np.float32(t)
    p = np.exp((z - z.max()).astype(np.float64)).astype(np.float32)
    desc = np.sort(p[p > 0])[::-1]
    tk = desc[top_k - 1] if 0 < top_k < len(desc) else desc[-1]
    kept = p >= tk
    if top_p < 1:
        head = desc[desc >= tk].astype(np.longdouble)
        cum = np.cumsum(head)
        ok = cum >= np.longdouble(top_p) * cum[-1]
        i = int(np.argmax(ok))
        while i + 1 < len(desc) and desc[i + 1] == desc[i]:
            i += 1
        kept = p >= desc[i]
    cum = np.cumsum(np.where(kept, p, 0).astype(np.longdouble))
    past = cum > np.longdouble(u) * cum[-1]
    return int(np.argmax(past)) if past.any() else int(np.flatnonzero(kept)[-1])


def test_a_large_vocabulary_chooses_the_exact_inverse_cdf(xp):
    rng = rng_for(43)
    rows, vocab = 60, 49_152
    logits = (rng.normal(size=(rows, vocab)) * 2).astype(np.float32)
    t, p = rng.uniform(0.5, 1.5, rows), rng.choice([0.5, 0.9, 1.0], rows)
    k = rng.choice([0, 0, 40], rows)
    seeds, counters = rng.integers(0, 2**62, rows), np.arange(rows)
    got = host(sample_rows(xp.asarray(logits), t, p, k, seeds, counters))
    u = uniforms(seeds, counters)
    want = [exact_inverse_cdf(logits[i], t[i], p[i], k[i], u[i]) for i in range(rows)]
    assert got.tolist() == want


# ------------------------------------------------------------------ determinism, independence

def test_same_seed_and_counter_same_token(xp):
    rng = rng_for(51)
    logits = xp.asarray(rng.normal(size=(50, 100)).astype(np.float32))
    seeds, counters = rng.integers(0, 2**40, 50), rng.integers(0, 10**9, 50)
    a = host(sample_rows(logits, 1.0, 0.95, 0, seeds, counters))
    b = host(sample_rows(logits, 1.0, 0.95, 0, seeds, counters))
    assert a.tolist() == b.tolist()
    c = host(sample_rows(logits, 1.0, 0.95, 0, seeds + 1, counters))
    assert (a != c).sum() > 25                                # another seed: another draw


def test_successive_counters_draw_independently(xp):
    # a two-token vocabulary at probability 1/2: pairs of successive draws are 4 equal cells
    logits = np.zeros(2, np.float32)
    tokens = draw(xp, logits, 40_001, 1.0, 1.0, 0, 52)
    ok, stat, pvalue = fits(tokens[:-1] * 2 + tokens[1:], np.full(4, 0.25))
    print("pairs chi-square", stat, "p-value", pvalue)
    assert ok


def test_a_rows_token_depends_on_its_own_row_alone(xp):
    rng = rng_for(53)
    rows, vocab = 64, 300
    logits = rng.normal(size=(rows, vocab)).astype(np.float32)
    t, p, k = rng.uniform(0, 2, rows), rng.uniform(0.2, 1, rows), rng.integers(0, 50, rows)
    t[::4] = 0
    seeds, counters = rng.integers(0, 2**62, rows), rng.integers(0, 1000, rows)
    base = host(sample_rows(xp.asarray(logits), t, p, k, seeds, counters))
    other = rng.permutation(rows)[:rows // 2]                 # change half the rows entirely
    logits2, t2, p2, k2 = logits.copy(), t.copy(), p.copy(), k.copy()
    logits2[other] = rng.normal(size=(len(other), vocab)) * 5
    t2[other], p2[other], k2[other] = rng.uniform(0, 2, len(other)), 0.3, 2
    again = host(sample_rows(xp.asarray(logits2), t2, p2, k2, seeds, counters))
    same = np.setdiff1d(np.arange(rows), other)
    assert again[same].tolist() == base[same].tolist()
    # and a row alone draws what it drew in the batch
    for i in same[:8]:
        alone = host(sample_rows(xp.asarray(logits[i:i + 1]), t[i], p[i], k[i], seeds[i],
                                 counters[i]))
        assert alone[0] == base[i]


# ------------------------------------------------------------------ the rule's edges (NumPy)

def test_probabilities_are_the_rules_bits():
    """``p = exp(z - max z)``, ``z = logits / T`` in float32 (T rounded to float32), the exp
    in float64 rounded to float32, bit for bit; T = 0 counts as T = 1; a p below float32's
    smallest normal number is 0."""
    from pagedkv.kernels.sampling import probabilities
    rng = rng_for(95)
    logits = (rng.normal(size=(6, 30)) * 4).astype(np.float32)
    t = np.array([0.7, 1.0, 1.3, 0.1, 2.9, 0.0])
    z = logits / np.where(t > 0, t, 1).astype(np.float32)[:, None]
    want = np.exp((z - z.max(axis=1, keepdims=True)).astype(np.float64)).astype(np.float32)
    got = probabilities(logits, t)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    assert np.array_equal(got[5], probabilities(logits[5:], np.ones(1))[0])   # T = 0: T = 1
    tiny = np.finfo(np.float32).tiny
    edge = np.array([[0.0, -88.0, -87.0, -40.0]], np.float32)   # exp(-88) < tiny < exp(-87)
    assert probabilities(edge, np.ones(1))[0].tolist() == [1.0, 0.0, np.float32(np.exp(-87.0)),
                                                           np.float32(np.exp(-40.0))]
    assert np.exp(-88.0) < tiny < np.exp(-87.0)


def test_a_uniform_of_zero_draws_the_first_kept_token():
    """u = 0 exactly (seed 7, counter 2043136: the hash's top 24 bits are all 0) draws
    the first kept token in token order: the tokens before it, not kept, are never
    drawn (their running mass is 0, not above 0)."""
    assert uniforms(np.array([7]), np.array([2043136]))[0] == 0
    logits = np.log(np.array([[0.01, 0.02, 0.5, 0.3, 0.17]])).astype(np.float32)
    assert host(kept_tokens(logits, 1.0, 0.9, 0))[0].tolist() == [False, False, True, True,
                                                                  True]
    assert sample_rows(logits, 1.0, 0.9, 0, 7, 2043136).tolist() == [2]
    assert sample_rows(logits, 1.0, 1.0, 0, 7, 2043136).tolist() == [0]


def test_a_greedy_rows_kept_set_is_its_first_argmax_alone():
    """A row at T = 0 keeps one token, its first largest logit (whatever top-p and top-k
    say); a sampled row beside it keeps by the rule."""
    logits = np.array([[1.0, 3.0, 3.0, 0.0], [1.0, 3.0, 3.0, 0.0]], np.float32)
    assert kept_tokens(logits, [0.0, 1.0], 1.0, 0).tolist() == [[False, True, False, False],
                                                                [True, True, True, True]]
    assert kept_tokens(logits, 0.0, 0.5, 3).tolist() == [[False, True, False, False]] * 2


def test_top_p_of_one_keeps_every_token_however_unlikely():
    """top_p = 1 keeps every token whose p is above 0, even one whose p adds nothing to
    the float64 mass (e**-40 beside 1)."""
    logits = np.array([[0.0, -40.0, -3.0]], np.float32)
    assert kept_tokens(logits, 1.0, 1.0, 0)[0].tolist() == [True, True, True]
    assert kept_tokens(logits, 1.0, 1.0, 2)[0].tolist() == [True, False, True]


def test_a_prefix_whose_mass_is_exactly_top_p_is_enough():
    """p = [1, .5, .5] exactly (mass 2): top_p 0.5 keeps the first token alone (its mass,
    1, is top_p's share exactly); a hair more keeps the tied pair too."""
    from pagedkv.kernels.sampling import probabilities
    logits = np.log(np.array([[1.0, 0.5, 0.5]])).astype(np.float32)
    assert probabilities(logits, np.ones(1))[0].tolist() == [1.0, 0.5, 0.5]
    assert kept_tokens(logits, 1.0, 0.5, 0)[0].tolist() == [True, False, False]
    assert kept_tokens(logits, 1.0, 0.5001, 0)[0].tolist() == [True, True, True]


def test_derived_seeds_are_splitmix64_of_the_seed_moved_by_the_golden_step():
    """``derive_seed(seed, i) = splitmix64(seed + (i + 1) * GOLDEN)`` (mod 2**64), in Python
    integers here: what the contiguous oracle's sampler derives independently."""
    golden = 0x9E3779B97F4A7C15
    for seed, i in [(0, 0), (5, 1), (2**64 - 1, 3), (123456789, 7)]:
        assert derive_seed(seed, i) == splitmix64_py((seed + (i + 1) * golden) & MASK)


# ------------------------------------------------------------------ packed parameters

def test_packed_parameters_draw_what_the_arrays_draw():
    """``pack_rows`` lays five lists of host numbers out as one uint64 [5, rows] array
    (temperature and top-p as float64 bits, then top-k, seed and counter), and
    ``sample_packed`` draws from it what ``sample_rows`` draws from the arrays."""
    from pagedkv.kernels.sampling import pack_rows, sample_packed
    rng = rng_for(91)
    rows = 40
    logits = rng.normal(size=(rows, 50)).astype(np.float32) * 2
    t = rng.choice([0.0, 0.5, 1.0, 1.7], rows).tolist()
    p = rng.choice([1.0, 0.9, 0.5], rows).tolist()
    k = rng.choice([0, 1, 5, 20], rows).tolist()
    seeds = rng.integers(0, 2**63, rows).tolist()
    seeds[0] = 2**64 - 1                                  # the largest seed survives
    counters = rng.integers(0, 10**6, rows).tolist()
    packed = pack_rows(t, p, k, seeds, counters)
    assert packed.dtype == np.uint64 and packed.shape == (5, rows)
    assert packed[0].view(np.float64).tolist() == t and packed[1].view(np.float64).tolist() == p
    assert packed[2:].tolist() == [k, seeds, counters]
    want = sample_rows(logits, np.array(t), np.array(p), np.array(k),
                       np.array(seeds, np.uint64), np.array(counters))
    assert sample_packed(logits, packed).tolist() == want.tolist()
    assert len(set(want[np.array(t) > 0].tolist())) > 5   # sampled rows, not all greedy
    with pytest.raises(ConfigError, match="logits must be a float32 array"):
        sample_packed(logits.astype(np.float64), packed)


# ------------------------------------------------------------------ bad input

@pytest.mark.parametrize("kw, match", [
    (dict(logits=np.zeros((2, 5), np.float16)), "float32"),
    (dict(logits=np.zeros(5, np.float32)), r"\[rows, vocab\]"),
    (dict(logits=np.zeros((0, 5), np.float32)), "rows and a vocabulary"),
    (dict(temperature=-0.1), "temperature must be numbers >= 0"),
    (dict(temperature=[1.0, 1.0, 1.0]), "one per row"),
    (dict(top_p=0.0), r"top_p must be numbers in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be numbers in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be integers >= 0"),
    (dict(top_k=2.5), "top_k must be integers >= 0"),
    (dict(seeds=-3), "seeds must be integers"),
    (dict(seeds=2**64), "seeds must be integers"),
    (dict(counters=[1, -1]), "counters must be integers >= 0"),
])
def test_bad_input_is_refused(kw, match):
    args = dict(logits=np.zeros((2, 5), np.float32), temperature=1.0, top_p=1.0, top_k=0,
                seeds=1, counters=0)
    args.update(kw)
    with pytest.raises(ConfigError, match=match):
        sample_rows(**args)


def test_bad_logits_are_named_in_full():
    with pytest.raises(ConfigError, match=r"^logits must be a float32 array \[rows, vocab\], "
                                          r"got float16 \(2, 5\)$"):
        sample_rows(np.zeros((2, 5), np.float16), 1.0, 1.0, 0, 1, 0)
    with pytest.raises(ConfigError, match=r"^logits must be a float32 array \[rows, vocab\], "
                                          r"got list \(\)$"):
        sample_rows([[0.0, 1.0]], 1.0, 1.0, 0, 1, 0)
    with pytest.raises(ConfigError, match=r"^logits must have rows and a vocabulary, got "
                                          r"\(2, 0\)$"):
        sample_rows(np.zeros((2, 0), np.float32), 1.0, 1.0, 0, 1, 0)


def test_parameters_given_as_arrays_are_checked_too():
    """Host arrays are checked as lists and scalars are: values, and one per row."""
    logits = np.zeros((2, 5), np.float32)
    with pytest.raises(ConfigError, match="temperature must be numbers >= 0"):
        sample_rows(logits, np.array([-1.0, 1.0]), 1.0, 0, 1, 0)
    with pytest.raises(ConfigError, match=r"temperature must be a scalar or 2 values \(one "
                                          r"per row\), got shape \(2, 1\)"):
        sample_rows(logits, np.ones((2, 1)), 1.0, 0, 1, 0)


def test_a_vocabulary_of_one_token_is_accepted():
    assert sample_rows(np.zeros((3, 1), np.float32), 1.0, 1.0, 0, 1, 0).tolist() == [0] * 3


def test_largest_seed_is_accepted():
    assert sample_rows(np.zeros((2, 5), np.float32), 1.0, 1.0, 0, 2**64 - 1, 0).shape == (2,)


# ------------------------------------------------------------------ GPU against NumPy

def _gpu_case(rng, rows, vocab):
    """Random rows with every kind of parameter, some ties and some masked tokens."""
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4, (rows, 1))).astype(
        np.float32)
    logits[::5, :vocab // 3] = np.round(logits[::5, :vocab // 3])     # many equal values
    logits[::7, :50] = -np.inf                                        # masked tokens
    t = rng.choice([0.0, 0.3, 0.7, 1.0, 1.5], rows)
    p = rng.choice([1.0, 0.9, 0.5, 0.95, 0.2], rows)
    k = rng.choice([0, 0, 1, 20, 50, vocab], rows)
    seeds, counters = rng.integers(0, 2**62, rows), rng.integers(0, 10**6, rows)
    return logits, t, p, k, seeds, counters


def _on_a_boundary(row, t, p, k, j, tol=1e-4) -> bool:
    """Can token ``j``'s place in a kept set turn on the order of float32 sums? Its
    probability (float64 here) ties the top-p threshold within ``tol`` (the mass of the
    tokens above it, with or without its equals, straddles p), or its logit ties the k-th
    largest, or its probability is below float32's smallest normal number."""
    z = row.astype(np.float64) / t
    prob = np.exp(z - z[np.isfinite(z)].max())
    prob /= prob.sum()
    above, level = prob[prob > prob[j]].sum(), prob[prob >= prob[j]].sum()
    top_p_tie = p < 1 and above - tol <= p <= level + tol
    top_k_tie = 0 < k < len(row) and (row > row[j]).sum() < k <= (row >= row[j]).sum()
    return bool(top_p_tie or top_k_tie or prob[j] < np.finfo(np.float32).tiny)


def test_boundary_rule_tells_ties_from_clear_cases():
    row = np.log(np.array([0.5, 0.3, 0.2, 1e-3], np.float32))
    assert _on_a_boundary(row, 1.0, 0.8, 0, 2)         # the mass above it: 0.8 = p
    assert not _on_a_boundary(row, 1.0, 0.6, 0, 2)     # 0.8 above: clearly out
    assert not _on_a_boundary(row, 1.0, 0.6, 0, 0)     # clearly in
    assert _on_a_boundary(np.array([2, 1, 1, 0], np.float32), 1.0, 1.0, 2, 2)   # k's tie
    assert not _on_a_boundary(np.array([2, 1, 1, 0], np.float32), 1.0, 1.0, 2, 3)


@pytest.mark.skipif(not backend.on_gpu, reason=f"needs a GPU: {backend.reason}")
@pytest.mark.parametrize("vocab", [1000, 49_152, 151_936])     # the last: p in global memory
def test_gpu_kernel_keeps_and_draws_what_the_reference_does(vocab):
    cp = backend.xp
    rng = rng_for(71 + vocab)
    rows = 512 if vocab < 100_000 else 64
    logits, t, p, k, seeds, counters = _gpu_case(rng, rows, vocab)
    assert host(uniforms(cp.asarray(seeds), cp.asarray(counters), cp)).tolist() == \
        uniforms(seeds, counters).tolist()                   # bit for bit
    d = cp.asarray(logits)
    kept_gpu, kept_ref = host(kept_tokens(d, t, p, k)), kept_tokens(logits, t, p, k)
    sampled = t > 0        # (a greedy row keeps one token: its token is checked below)
    kept_differ = int((kept_gpu != kept_ref)[sampled].any(axis=1).sum())
    on_cpu = sample_rows(logits, t, p, k, seeds, counters)
    on_gpu = host(sample_rows(d, t, p, k, seeds, counters))
    on_gpu_dev = host(sample_rows(d, *(cp.asarray(a) for a in (t, p, k, seeds, counters))))
    differ = int((on_cpu != on_gpu).sum())
    print(f"{kept_differ} kept sets and {differ} tokens of {rows} rows differ (near-ties)")
    for r in np.flatnonzero(sampled & (kept_gpu != kept_ref).any(axis=1)):
        for j in np.flatnonzero(kept_gpu[r] != kept_ref[r]):      # each on a boundary
            assert _on_a_boundary(logits[r], t[r], p[r], k[r], j), (r, j)
    assert kept_differ <= rows // 50 and differ <= 2
    assert on_gpu.tolist() == on_gpu_dev.tolist()
    assert on_gpu[t == 0].tolist() == np.argmax(logits[t == 0], axis=1).tolist()
    assert kept_gpu[np.arange(rows), on_gpu][sampled].all()       # a kept token, always


# ------------------------------------------------------------------ the device path's plumbing

class _DeviceArray(np.ndarray):
    """A NumPy array that stands for a device array (CuPy's, to the module): as CuPy does,
    its arithmetic refuses a host array beside it (scalars are fine)."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if any(type(a) is np.ndarray for a in inputs):
            raise TypeError(f"{ufunc.__name__}: a host array beside a device array")
        args = [a.view(np.ndarray) if isinstance(a, _DeviceArray) else a for a in inputs]
        out = getattr(ufunc, method)(*args, **kwargs)
        return out.view(_DeviceArray) if isinstance(out, np.ndarray) else out


class _FakeCuPy:
    """Stands in for CuPy on a CPU: NumPy's functions, answering with device arrays, and
    NumPy's types; ``uploads`` counts the host arrays moved to the "device" by
    ``asarray``."""
    ndarray = _DeviceArray

    def __init__(self):
        self.uploads = 0

    def asarray(self, a, dtype=None):
        if not isinstance(a, _DeviceArray):
            self.uploads += 1
        return np.asarray(a, dtype).view(_DeviceArray)

    def __getattr__(self, name):
        f = getattr(np, name)
        if not callable(f) or isinstance(f, type):
            return f

        def on_device(*args, **kwargs):
            out = f(*args, **kwargs)
            return out.view(_DeviceArray) if isinstance(out, np.ndarray) else out
        return on_device


@pytest.fixture
def fake_gpu(monkeypatch):
    """The module's GPU path on a CPU: ``backend`` says a GPU is in use, with
    :class:`_FakeCuPy` as its array module, and the kernel's launch is a stand-in that
    records what it is handed and answers as the rule does (``reference_rows`` on the
    decoded parameters; with ``details``, the thresholds too)."""
    from pagedkv.kernels import sampling
    fake = _FakeCuPy()
    fake.launches = []

    def launch(logits, params, details=False):
        assert isinstance(logits, _DeviceArray) and isinstance(params, _DeviceArray)
        assert params.dtype == np.uint64 and params.shape == (5, logits.shape[0])
        fake.launches.append((np.asarray(params).copy(), details))
        lg, par = np.asarray(logits), np.asarray(params)
        t, tp = par[:2].view(np.float64)
        out = sampling.reference_rows(lg, t, tp, par[2].astype(np.int64), par[3], par[4])
        if not details:
            return out.view(_DeviceArray)
        thr, mass = sampling.thresholds(sampling.probabilities(lg, t), tp,
                                        par[2].astype(np.int64))
        return out.view(_DeviceArray), thr.view(_DeviceArray), mass.view(_DeviceArray)

    monkeypatch.setattr(backend, "on_gpu", True)
    monkeypatch.setattr(backend, "xp", fake)
    monkeypatch.setattr(sampling, "_launch", launch)
    return fake


def _params_by_hand(t, tp, tk, s, c):
    """The kernel's [5, rows] uint64 parameters, as its docstring lays them out: T and
    top_p as float64 bits, then top_k, seed and counter."""
    return np.stack([np.asarray(t, np.float64).view(np.uint64),
                     np.asarray(tp, np.float64).view(np.uint64),
                     np.asarray(tk, np.uint64), np.asarray(s, np.uint64),
                     np.asarray(c, np.uint64)])


def test_device_logits_launch_the_kernel_once_with_the_rows_parameters(fake_gpu):
    """On a GPU (a stand-in for CuPy and the kernel here), device logits are sampled by
    one launch, handed the five per-row parameters in order (scalars spread to every row,
    T and top_p as float64 bits), uploaded as one array, and the launch's tokens are the
    answer."""
    rng = rng_for(101)
    logits = rng.normal(size=(4, 30)).astype(np.float32) * 3
    t, tp, tk = [0.0, 0.7, 1.0, 1.9], 0.9, [0, 2, 5, 30]
    seeds, counters = np.array([3, 2**64 - 1, 11, 12], np.uint64), 17
    want = sample_rows(logits, t, tp, tk, seeds, counters)       # host logits: NumPy
    assert fake_gpu.launches == [] and fake_gpu.uploads == 0
    got = sample_rows(fake_gpu.asarray(logits), t, tp, tk, seeds, counters)
    assert fake_gpu.uploads == 2                                 # the logits, the parameters
    assert len(fake_gpu.launches) == 1
    params, details = fake_gpu.launches[0]
    assert details is False
    assert params.tolist() == _params_by_hand(t, [tp] * 4, tk, seeds, [counters] * 4).tolist()
    assert isinstance(got, _DeviceArray) and np.asarray(got).tolist() == want.tolist()


def test_device_logits_check_host_parameters_and_take_device_ones_as_they_are(fake_gpu):
    """On a GPU, host parameters are checked as on NumPy (values, one per row); a device
    array is not checked (that would wait for the device) but must hold one value per
    row, and is handed to the kernel as it is, without a trip through the host."""
    logits = fake_gpu.asarray(np.zeros((3, 5), np.float32))
    with pytest.raises(ConfigError, match="top_p must be numbers in"):
        sample_rows(logits, 1.0, 1.5, 0, 1, 0)
    with pytest.raises(ConfigError, match=r"^seeds must be a scalar or 3 values \(one per "
                                          r"row\), got shape \(2,\)$"):
        sample_rows(logits, 1.0, 1.0, 0, [1, 2], 0)
    with pytest.raises(ConfigError, match=r"^top_k must be 3 values \(one per row\), got "
                                          r"shape \(2,\)$"):
        sample_rows(logits, 1.0, 1.0, fake_gpu.asarray(np.array([1, 2])), 1, 0)
    with pytest.raises(ConfigError, match="logits must be a float32 array"):
        sample_rows(fake_gpu.asarray(np.zeros((3, 5), np.float16)), 1.0, 1.0, 0, 1, 0)
    with pytest.raises(ConfigError, match="logits must have rows and a vocabulary"):
        sample_rows(fake_gpu.asarray(np.zeros((3, 0), np.float32)), 1.0, 1.0, 0, 1, 0)
    assert fake_gpu.launches == []
    dev = [fake_gpu.asarray(np.array(a)) for a in
           ([1.0, 0.5, 2.0], [1.0, 0.9, 0.3], [0, 2, 1], [5, 6, 7], [0, 1, 2])]
    uploads = fake_gpu.uploads
    sample_rows(logits, *dev)
    assert fake_gpu.uploads == uploads                   # nothing went through the host
    assert fake_gpu.launches[0][0].tolist() == _params_by_hand(
        *(np.asarray(a) for a in dev)).tolist()


def test_host_logits_are_sampled_on_the_host_even_with_a_gpu(fake_gpu):
    """With a GPU in use, NumPy logits (a packed batch's too) are sampled by the NumPy
    rule: the kernel is never launched and nothing is uploaded."""
    from pagedkv.kernels.sampling import pack_rows, sample_packed
    logits = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]])).astype(np.float32)
    assert sample_rows(logits, 0.0, 1.0, 0, 1, 0).tolist() == [0, 2]
    assert sample_packed(logits, pack_rows([0.0, 0.0], [1.0, 1.0], [0, 0], [1, 1],
                                           [0, 0])).tolist() == [0, 2]
    assert kept_tokens(logits, 1.0, 0.5, 0).tolist() == [[True, False, False],
                                                         [False, False, True]]
    assert fake_gpu.launches == [] and fake_gpu.uploads == 0


def test_a_packed_batch_on_the_device_is_one_launch_of_the_packed_array(fake_gpu):
    """``sample_packed`` with device logits checks the logits, uploads the packed array
    as it is and launches the kernel once with it; its tokens are the answer."""
    from pagedkv.kernels.sampling import pack_rows, sample_packed
    rng = rng_for(103)
    logits = rng.normal(size=(3, 20)).astype(np.float32)
    lists = ([0.0, 0.8, 1.2], [1.0, 0.9, 0.6], [0, 3, 0], [1, 2, 3], [9, 8, 7])
    packed = pack_rows(*lists)
    want = sample_rows(logits, *(np.array(a) for a in lists))
    got = sample_packed(fake_gpu.asarray(logits), packed)
    assert len(fake_gpu.launches) == 1
    assert fake_gpu.launches[0][0].tolist() == packed.tolist()
    assert np.asarray(got).tolist() == want.tolist()
    with pytest.raises(ConfigError, match="logits must be a float32 array"):
        sample_packed(fake_gpu.asarray(np.zeros((3, 20))), packed)


def test_device_kept_sets_come_from_the_kernels_thresholds(fake_gpu):
    """``kept_tokens`` on device logits launches the kernel once for its thresholds
    (``details``), with seeds and counters 0, and keeps ``p >= threshold`` (a greedy row:
    its argmax alone), as the NumPy rule keeps."""
    rng = rng_for(107)
    logits = (rng.normal(size=(5, 40)) * 2).astype(np.float32)
    t, tp, tk = [0.0, 0.6, 1.0, 1.0, 2.0], [1.0, 0.8, 0.5, 1.0, 0.95], [0, 0, 4, 7, 0]
    want = kept_tokens(logits, t, tp, tk)
    got = kept_tokens(fake_gpu.asarray(logits), t, tp, tk)
    assert len(fake_gpu.launches) == 1
    params, details = fake_gpu.launches[0]
    assert details is True
    assert params.tolist() == _params_by_hand(t, tp, tk, [0] * 5, [0] * 5).tolist()
    assert np.asarray(got).tolist() == want.tolist()
    assert want[0].sum() == 1 and want[3].sum() == 7     # greedy: one; top-k 7: seven
