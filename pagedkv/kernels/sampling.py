"""Sampling a whole batch in one call, on the device: temperature, top-k, top-p, seeds.

:func:`sample_rows` chooses one token for every row of a batch of logits, each row with its
own temperature, top-p, top-k, seed and step counter: on a GPU one kernel launch
(``sampling.cu``, one block per row) and no sort; on NumPy, :func:`reference_rows`, the
oracle the kernel is tested against, which sorts. The rule both follow, exactly:

1. **Probabilities** (:func:`probabilities`): ``z = logits / T`` in float32, ``T`` rounded
   to float32; ``p = exp(z - max z)``, the exp taken in float64 and rounded to float32 (so
   the GPU's ``p`` is NumPy's, bit for bit, but for a double rounding at a float32 midpoint:
   about one element in 2**28). A ``p`` below float32's smallest normal number (about
   1.2e-38) is 0: a GPU's conversions may flush such subnormals, NumPy's keep them, and a
   token that unlikely could never be drawn anyway. ``p`` is unnormalised; the largest is 1.
2. **Top-k**: ``t_k`` is the largest value with at least ``k`` tokens whose ``p >= t_k``
   (``k = 0``, or ``k`` at least the number of tokens with ``p > 0``: the smallest positive
   ``p``). The top-k set is ``{p >= t_k}``: every token tied with the ``k``-th is kept, so
   the set may hold more than ``k`` tokens when values tie.
3. **Top-p**: ``t`` is the largest value ``>= t_k`` with ``mass{p >= t} >= top_p *
   mass{p >= t_k}`` (mass: the float64 sum of ``p``); ``top_p = 1``: ``t = t_k``. The kept
   set is ``{p >= t}``: the smallest set of the most likely tokens with that share of the
   mass, ties again all in. A token whose ``p`` is 0 is never kept.
4. **A uniform number per row** (:func:`uniforms`): the splitmix64 hash of ``(seed,
   counter)``, its top 24 bits over 2**24 (a float32 in [0, 1)). It holds no state: the
   engine passes each sequence's seed and the number of tokens it has drawn, and the same
   pair gives the same number, bit for bit, on NumPy and CuPy. The row's place in the batch
   is not hashed: a request draws the same tokens whatever batch it shares. The ``n``
   samples of one request take seeds of their own (:func:`derive_seed`).
5. **Choose**: the first kept token, in token order, whose running kept mass (float64,
   from token 0) exceeds ``u * (kept mass)``; if rounding leaves none, the last kept token.
   ``T = 0``: the first largest logit (``argmax``).

A banned token (an end token before ``min_tokens``) is the caller's to give the logit
``-inf``: its ``p`` is 0 and it is never chosen while the row has a finite logit.

Exactness and its limits. Without a sort the kernel finds ``t_k`` and ``t`` by bisection on
the bits of a float32 (for ``p >= 0`` the bit pattern read as an integer orders like the
value), each halving one pass over the row's ``p`` held in shared memory, and stopping as
soon as a single token lies in the range (its value is then the threshold): the exact
thresholds of the rule above, in ~15 passes for top-p 0.9 on 49,152 random logits (~30
when values tie at the cut). The kernel and the reference add the same float64 numbers in different
orders (off by ~1e-16 of the mass), so they differ only at a true near-tie: a mass within
that of ``top_p``'s target, or ``u * mass`` within that of a token's edge. The distribution
sampled is the rule's up to ``u``'s 24 bits. ``perf/sampling_check.py`` times the kernel
beside ``argmax_rows`` and counts the rows whose kept sets differ from the reference's.
"""
from __future__ import annotations

import functools
import importlib.resources
import struct

import numpy as np

from .. import backend
from ..errors import ConfigError

__all__ = ["sample_rows", "sample_packed", "pack_rows", "reference_rows", "probabilities",
           "kept_tokens", "thresholds", "uniforms", "splitmix64", "derive_seed"]

GOLDEN = 0x9E3779B97F4A7C15    # splitmix64's increment: 2**64 / the golden ratio, odd
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
THREADS = 1024                 # the kernel's block: one per row


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


# ---------------------------------------------------------------- the rule, in NumPy

def probabilities(logits, temperature, xp=np):
    """float32 [rows, vocab]: ``exp(z - max z)``, ``z = logits / T`` (float32), the exp in
    float64 rounded to float32 (a row whose ``T`` is 0 counts as ``T = 1`` here)."""
    t = xp.asarray(temperature, dtype=xp.float64).astype(xp.float32)
    z = logits / xp.where(t > 0, t, xp.float32(1))[:, None]
    d = z - z.max(axis=1, keepdims=True)
    p = xp.exp(d.astype(xp.float64)).astype(xp.float32)
    return xp.where(p < np.finfo(np.float32).tiny, xp.float32(0), p)   # no subnormals


def thresholds(p, top_p, top_k):
    """(t, kept mass) per row of NumPy ``p``, found by sorting: the rule's steps 2 and 3."""
    thr, mass = np.ones(len(p), np.float32), np.ones(len(p))
    for r, row in enumerate(p):
        vals, inverse = np.unique(row[row > 0], return_inverse=True)   # ascending
        group = np.bincount(inverse, weights=row[row > 0].astype(np.float64))
        vals, group = vals[::-1], group[::-1]                         # most likely first
        count = np.cumsum(np.bincount(inverse)[::-1])                  # #{p >= vals[i]}
        cum = np.cumsum(group)                                         # mass{p >= vals[i]}
        k = int(top_k[r])
        i = len(vals) - 1 if k <= 0 or k >= count[-1] else int(np.argmax(count >= k))
        if top_p[r] < 1:
            i = int(np.argmax(cum[:i + 1] >= float(top_p[r]) * cum[i]))
        thr[r], mass[r] = vals[i], cum[i]
    return thr, mass


def reference_rows(logits, temperature, top_p, top_k, seeds, counters):
    """The rule in NumPy, row by row with a sort (the kernel's oracle): int32 [rows]."""
    rows = _check(logits)
    t, tp, tk, s, c = (np.asarray(_per_row(a, rows, name, np)) for a, name in zip(
        (temperature, top_p, top_k, seeds, counters), _NAMES))
    p = probabilities(logits, t)
    thr, _ = thresholds(p, tp, tk)
    u = uniforms(s, c).astype(np.float64)
    out = np.argmax(logits, axis=1).astype(np.int32)          # greedy rows: the first argmax
    for r in np.flatnonzero(t > 0):
        kept = p[r] >= thr[r]
        cum = np.cumsum(np.where(kept, p[r], 0).astype(np.float64))
        past = cum > u[r] * cum[-1]
        out[r] = np.argmax(past) if past.any() else np.flatnonzero(kept)[-1]
    return out


# ---------------------------------------------------------------- the kernel

@functools.lru_cache(maxsize=None)
def _kernel():
    source = importlib.resources.files(__package__).joinpath("sampling.cu").read_text()
    # no --use_fast_math: z = x / T must round as NumPy's division does
    return backend.xp.RawModule(code=source, options=("-std=c++17",)).get_function(
        "sample_rows_kernel")


@functools.lru_cache(maxsize=None)
def _smem_limit() -> int:
    cp = backend.xp
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return int(props.get("sharedMemPerBlockOptin", 48 * 1024)) - 2048   # static arrays


def _params(t, tp, tk, s, c, xp):
    """The five per-row parameters as one uint64 [5, rows] array (one upload from the
    host): T and top_p as float64 bits, then top_k, seed and counter."""
    if xp is np or not isinstance(t, xp.ndarray):
        t, tp, tk, s, c = (np.asarray(a) for a in (t, tp, tk, s, c))
        host = np.stack([t.astype(np.float64).view(np.uint64),
                         tp.astype(np.float64).view(np.uint64),
                         tk.astype(np.uint64), s.astype(np.uint64), c.astype(np.uint64)])
        return xp.asarray(host)
    return xp.stack([t.astype(xp.float64).view(xp.uint64), tp.astype(xp.float64).view(
        xp.uint64), tk.astype(xp.uint64), s.astype(xp.uint64), c.astype(xp.uint64)])


def _launch(logits, params, details=False):
    """Run the kernel: int32 tokens [rows] (and each row's threshold and kept mass)."""
    cp = backend.xp
    rows, vocab = logits.shape
    logits = cp.ascontiguousarray(logits)
    fn = _kernel()
    nbytes = 4 * vocab
    use_smem = nbytes <= _smem_limit()
    scratch = cp.empty(1 if use_smem else rows * vocab, dtype=cp.float32)
    if use_smem and nbytes > 48 * 1024:
        fn.max_dynamic_shared_size_bytes = nbytes
    out = cp.empty(rows, dtype=cp.int32)
    thr = cp.empty(rows, dtype=cp.float32) if details else None
    mass = cp.empty(rows, dtype=cp.float64) if details else None
    null = np.uint64(0)
    fn((rows,), (THREADS,), (logits, np.int32(vocab), params, np.int32(rows), scratch,
                             np.int32(use_smem), out, null if thr is None else thr,
                             null if mass is None else mass),
       shared_mem=nbytes if use_smem else 0)
    return (out, thr, mass) if details else out


_NAMES = ("temperature", "top_p", "top_k", "seeds", "counters")


def sample_rows(logits, temperature, top_p, top_k, seeds, counters):
    """int32 [rows]: one token per row of float32 ``logits`` [rows, vocab] (CuPy on the
    device: one kernel launch; NumPy: :func:`reference_rows`), each row with its own
    ``temperature`` (0: greedy), ``top_p`` in (0, 1], ``top_k`` (0: off), ``seeds`` and
    ``counters`` (the row's draw is a function of its logits, its parameters and this pair
    alone). The parameters are arrays of ``rows`` values or scalars, on the host (checked,
    then uploaded as one array) or on the logits' device."""
    xp = _xp(logits)
    if xp is np:
        return reference_rows(logits, temperature, top_p, top_k, seeds, counters)
    rows = _check(logits)
    args = [_per_row(a, rows, name, np if _on_host(a) else xp)
            for a, name in zip((temperature, top_p, top_k, seeds, counters), _NAMES)]
    return _launch(logits, _params(*args, xp=xp))


def pack_rows(temperature, top_p, top_k, seeds, counters) -> np.ndarray:
    """The uint64 [5, rows] array :func:`sample_packed` takes, from five lists of host
    numbers already checked (an engine's requests): one ``struct.pack``, a few microseconds
    for a batch where building NumPy arrays one by one and checking them takes tens."""
    n = len(temperature)
    raw = struct.pack(f"<{2 * n}d{3 * n}Q", *temperature, *top_p, *top_k, *seeds, *counters)
    return np.frombuffer(raw, dtype="<u8").reshape(5, n)


def sample_packed(logits, packed):
    """:func:`sample_rows` for parameters packed by :func:`pack_rows` (not checked again):
    one upload of them, one kernel launch on a GPU; :func:`reference_rows` on NumPy."""
    _check(logits)
    if _xp(logits) is np:
        t, tp = packed[:2].view(np.float64)
        return reference_rows(logits, t, tp, packed[2].astype(np.int64), packed[3],
                              packed[4])
    return _launch(logits, backend.xp.asarray(packed))


def kept_tokens(logits, temperature, top_p, top_k):
    """bool [rows, vocab]: the tokens :func:`sample_rows` may choose for each row (for a
    greedy row, its argmax alone); on a GPU from the kernel's own thresholds."""
    xp = _xp(logits)
    rows = _check(logits)
    t, tp, tk = (_per_row(a, rows, name, np) for a, name in zip(
        (temperature, top_p, top_k), _NAMES))
    p = probabilities(logits, t, xp)
    if xp is np:
        thr, _ = thresholds(p, tp, tk)
    else:
        zeros = np.zeros(rows, np.uint64)
        _, thr, _ = _launch(logits, _params(t, tp, tk, zeros, zeros, xp), details=True)
    keep = p >= xp.asarray(thr)[:, None]
    greedy = xp.arange(p.shape[1])[None, :] == xp.argmax(logits, axis=1)[:, None]
    return xp.where(xp.asarray(np.asarray(t) > 0)[:, None], keep, greedy)


def _on_host(a) -> bool:
    return not (backend.on_gpu and isinstance(a, backend.xp.ndarray))


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
