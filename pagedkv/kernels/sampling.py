"""Sampling a whole batch in one call, on the device: temperature, top-k, top-p, seeds.

:func:`sample_rows` chooses one token for every row of a batch of logits, each row with its
own temperature, top-p, top-k, seed and step counter, in a fixed number of array operations:
no Python loop over rows, no copy to the host inside. It is written once with array
operations that NumPy and CuPy both have (``xp`` is either module), so the CPU tests run the
very code the GPU runs. Four steps, each a few lines below:

1. **Rank** (:func:`ranked`): ``z = logits / temperature``; each row sorted most likely first
   by a *stable* sort, so equal values keep their token order (the lower token id first);
   ``p = exp(z - max z)``, unnormalised. A row whose temperature is 0 is greedy: its token
   is the first of the ranking, the first of the largest logits, which is ``argmax``.
2. **Filter** (:func:`keep_ranked`): top-k keeps the ``k`` first ranks (``k = 0``: all);
   top-p then keeps the smallest prefix of those whose mass is at least ``top_p`` times
   theirs: a rank stays when the mass ranked *before* it is less than that, so the first
   always stays, and ``top_p = 1`` keeps all ``k``. Ties at a cut go by rank, hence by
   token id: of two equal tokens at the edge, the lower id stays. This is the host
   sampler's rule (``pagedkv.model``'s ``sample``), top-k applied first as vLLM does.
3. **A uniform number per row** (:func:`uniforms`): a counter-based generator, the
   splitmix64 hash of ``(seed, counter)`` in uint64 integer arithmetic. It holds no state:
   the engine passes each sequence's seed and the number of tokens it has drawn, and the
   same pair always gives the same number, bit for bit on NumPy and CuPy. The row's place
   in the batch is deliberately *not* hashed: a request draws the same tokens whatever
   batch it shares. Two rows with the same seed and counter draw the same number, so the
   ``n`` samples of one request need seeds of their own (:func:`derive_seed`).
4. **Choose** (inverse CDF): the token is where ``u * (kept mass)`` falls in the running
   sum of the kept ranks' ``p``, as the host sampler does it.

What the tokens are masked with is the caller's: a banned token (an end token before
``min_tokens``) is given the logit ``-inf`` beforehand; its ``p`` is 0 and it is never
chosen while the row has a finite logit.

Exactness and its limits. The distribution sampled is the softmax of ``logits / T``
restricted to the kept set, up to rounding: ``p`` is float32 and ``u`` has 24 bits (steps of
2**-24), but the running sums behind the top-p cut and the choice are float64. In float32 a
left-to-right sum over 49,152 tokens is off by 1e-5 to 2e-4 of itself (random logits), and
depends on the order it is added in: a GPU scan adds in another order than NumPy's left-to-right
``cumsum``, and with float32 sums the two chose different tokens (a neighbouring rank)
on 16 of 512 rows of SmolLM2's vocabulary; in float64 the difference is ~1e-16, and only a
true near-tie tells them apart: ``u`` within that of a boundary, or a ``p`` whose float32
``exp`` the GPU rounds the other way sitting exactly at a top-p cut. The host sampler's sums
are float32: on a small vocabulary it chooses the same tokens for the same ``u``, on 49,152
tokens it takes a neighbouring rank on some rows, where its sums have drifted.

The cost on a GPU is one sort of the batch's logits (CuPy's stable sort) and a few passes
over them; ``perf/sampling_check.py`` measures it beside ``argmax_rows``.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..errors import ConfigError

__all__ = ["sample_rows", "ranked", "keep_ranked", "kept_tokens", "uniforms", "splitmix64",
           "derive_seed"]

GOLDEN = 0x9E3779B97F4A7C15    # splitmix64's increment: 2**64 / the golden ratio, odd
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _xp(a):
    return backend.xp if backend.on_gpu and isinstance(a, backend.xp.ndarray) else np


# ---------------------------------------------------------------- random numbers

def splitmix64(x, xp=np):
    """splitmix64's finaliser on a uint64 array: every input bit moves every output bit.
    Products wrap modulo 2**64, on NumPy and CuPy alike."""
    u = xp.uint64
    x = (x ^ (x >> u(30))) * u(MIX1)
    x = (x ^ (x >> u(27))) * u(MIX2)
    return x ^ (x >> u(31))


def uniforms(seeds, counters, xp=np):
    """float32 numbers in [0, 1), one per row: the ``counter``-th output of the splitmix64
    stream that starts at ``splitmix64(seed)``, its top 24 bits over 2**24 (exact in
    float32, and below 1)."""
    u = xp.uint64
    start = splitmix64(xp.asarray(seeds, dtype=u), xp)
    state = start + xp.asarray(counters, dtype=u) * u(GOLDEN)
    bits = splitmix64(state, xp) >> u(40)
    return bits.astype(xp.float32) * xp.float32(2.0 ** -24)


def derive_seed(seed: int, index: int) -> int:
    """A seed of its own for sample ``index`` of a request seeded ``seed`` (host integers):
    ``splitmix64(seed + (index + 1) * GOLDEN)``, so different samples draw different
    streams."""
    x = np.array([(seed + (index + 1) * GOLDEN) % 2**64], dtype=np.uint64)
    return int(splitmix64(x)[0])


# ---------------------------------------------------------------- rank, filter, choose

def ranked(logits, temperature, xp=np):
    """(order, p): each row's token ids most likely first (a stable sort: equal values in
    token order) and their unnormalised probabilities ``exp(z - max z)``,
    ``z = logits / temperature`` (a temperature of 0 counts as 1 here: greedy rows take the
    first rank)."""
    t = xp.asarray(temperature, dtype=xp.float32)
    z = logits / xp.where(t > 0, t, xp.float32(1))[:, None]
    order = xp.argsort(xp.float32(0) - z, axis=1, kind="stable")   # 0 - z: -0.0 becomes +0.0
    zs = xp.take_along_axis(z, order, axis=1)
    return order, xp.exp(zs - zs[:, :1])


def keep_ranked(p, top_p, top_k, xp=np):
    """bool [rows, vocab] over the ranks of :func:`ranked`: top-k's first ``k`` ranks
    (``k = 0``: all), then the smallest prefix of those with at least ``top_p`` of their
    mass (a rank stays when the mass before it is below that; ``top_p = 1``: all ``k``)."""
    rows, vocab = p.shape
    k = xp.asarray(top_k, dtype=xp.int64)
    k = xp.where((k > 0) & (k < vocab), k, vocab)
    in_k = xp.arange(vocab)[None, :] < k[:, None]
    pk = xp.where(in_k, p, xp.float32(0)).astype(xp.float64)    # float64 sums: see above
    cum = xp.cumsum(pk, axis=1)
    tp = xp.asarray(top_p, dtype=xp.float32).astype(xp.float64)[:, None]
    return in_k & ((cum - pk < tp * cum[:, -1:]) | (tp >= 1))


def sample_rows(logits, temperature, top_p, top_k, seeds, counters):
    """int32 [rows]: one token per row of float32 ``logits`` [rows, vocab] (CuPy on the
    device, or NumPy), each row with its own ``temperature`` (0: greedy), ``top_p`` in
    (0, 1], ``top_k`` (0: off), ``seeds`` and ``counters`` (the row's draw is a function of
    its logits, its parameters and this pair alone). The parameters are arrays of ``rows``
    values or scalars, on the host or on the logits' device; host values are checked."""
    xp = _xp(logits)
    rows = _check(logits)
    t, tp, tk, s, c = (_per_row(a, rows, name, xp) for a, name in zip(
        (temperature, top_p, top_k, seeds, counters),
        ("temperature", "top_p", "top_k", "seeds", "counters")))
    order, p = ranked(logits, t, xp)
    keep = keep_ranked(p, tp, tk, xp)
    cum = xp.cumsum(xp.where(keep, p, xp.float32(0)).astype(xp.float64), axis=1)
    target = uniforms(s, c, xp).astype(xp.float64)[:, None] * cum[:, -1:]
    last = keep.sum(axis=1) - 1           # rounding may put target at the total: stop there
    pick = xp.minimum((cum <= target).sum(axis=1), last)
    pick = xp.where(xp.asarray(t, dtype=xp.float32) > 0, pick, 0)   # greedy: the first rank
    return order[xp.arange(rows), pick].astype(xp.int32)


def kept_tokens(logits, temperature, top_p, top_k):
    """bool [rows, vocab] in token order: the tokens :func:`sample_rows` may choose for each
    row (all its kept ranks; for a greedy row, its argmax alone)."""
    xp = _xp(logits)
    rows = _check(logits)
    t, tp, tk = (_per_row(a, rows, name, xp) for a, name in zip(
        (temperature, top_p, top_k), ("temperature", "top_p", "top_k")))
    order, p = ranked(logits, t, xp)
    keep = keep_ranked(p, tp, tk, xp)
    keep = xp.where(xp.asarray(t, dtype=xp.float32)[:, None] > 0, keep,
                    xp.arange(p.shape[1])[None, :] == 0)
    out = xp.zeros(keep.shape, dtype=bool)
    out[xp.arange(rows)[:, None], order] = keep        # back from rank order to token order
    return out


# ---------------------------------------------------------------- argument checks

def _check(logits) -> int:
    if getattr(logits, "ndim", None) != 2 or str(logits.dtype) != "float32":
        raise ConfigError("logits must be a float32 array [rows, vocab], got "
                          f"{getattr(logits, 'dtype', type(logits).__name__)} "
                          f"{tuple(getattr(logits, 'shape', ()))}")
    if logits.shape[0] == 0 or logits.shape[1] == 0:
        raise ConfigError(f"logits must have rows and a vocabulary, got {tuple(logits.shape)}")
    return logits.shape[0]


_VALID = {  # name: (test on host values, what they must be); the last three are integers
    "temperature": (lambda a: a >= 0, "numbers >= 0"),
    "top_p": (lambda a: (a > 0) & (a <= 1), "numbers in (0, 1]"),
    "top_k": (lambda a: a >= 0, "integers >= 0"),
    "seeds": (lambda a: a >= 0, "integers in [0, 2**64)"),
    "counters": (lambda a: a >= 0, "integers >= 0"),
}
_INTEGERS = ("top_k", "seeds", "counters")


def _per_row(a, rows: int, name: str, xp):
    """``a`` as ``rows`` values on the logits' device; host values are checked first (a
    device array is taken as it is: checking it would wait for the device)."""
    if not (backend.on_gpu and isinstance(a, backend.xp.ndarray)):
        h = np.asarray(a)
        if h.ndim > 1 or (h.ndim == 1 and len(h) != rows):
            raise ConfigError(f"{name} must be a scalar or {rows} values (one per row), got "
                              f"shape {h.shape}")
        test, what = _VALID[name]
        kinds = "iu" if name in _INTEGERS else "iuf"
        if h.dtype.kind not in kinds or not np.all(test(h)):
            raise ConfigError(f"{name} must be {what}, got {a!r}")
        a = np.broadcast_to(h.astype(np.uint64) if name in _INTEGERS[1:] else h, (rows,))
    elif a.shape != (rows,):
        raise ConfigError(f"{name} must be {rows} values (one per row), got shape {a.shape}")
    return xp.asarray(a)
