"""The oracle: the same model with a plain contiguous cache, one sequence at a time.

Each sequence keeps, per layer, one growing K array and one V array ``[tokens, kv_heads, D]``;
attention is ordinary causal softmax attention over them. Forking a sequence copies all of its
arrays at once (eager copies, no sharing). Nothing here touches pagedkv's pool, manager or kernels:
the tests check that paging changes nothing by comparing :mod:`pagedkv.model.llama` with this.
"""
from __future__ import annotations

import numpy as np

from .llama import Llama

__all__ = ["ContiguousCache", "reference_forward", "dense_causal_attention", "reference_generate"]


class ContiguousCache:
    """One sequence's K and V, one contiguous array per layer."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype=np.float32):
        empty = np.zeros((0, kv_heads, head_dim), dtype=dtype)
        self.k = [empty] * layers
        self.v = [empty] * layers

    def __len__(self) -> int:
        return len(self.k[0])

    def append(self, i: int, k, v) -> None:
        self.k[i] = np.concatenate([self.k[i], k])
        self.v[i] = np.concatenate([self.v[i], v])

    def copy(self) -> "ContiguousCache":
        """An eager copy: every byte of every layer."""
        new = ContiguousCache.__new__(ContiguousCache)
        new.k = [a.copy() for a in self.k]
        new.v = [a.copy() for a in self.v]
        return new

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k + self.v)


def dense_causal_attention(q, k, v, scale):
    """q [n, heads, D] are the last n of the len(k) positions; each attends to itself and
    everything before it."""
    n, heads, d = q.shape
    length, kv_heads = k.shape[0], k.shape[1]
    qg = q.astype(np.float32).reshape(n, kv_heads, heads // kv_heads, d)
    s = np.einsum("nhgd,lhd->hgnl", qg, k.astype(np.float32)) * scale
    mask = np.arange(length)[None, :] > (length - n + np.arange(n))[:, None]
    s[..., mask] = -np.inf
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hgnl,lhd->nhgd", p, v.astype(np.float32)).reshape(n, heads, d)


def reference_forward(model: Llama, cache: ContiguousCache, tokens) -> np.ndarray:
    """Feed ``tokens`` (continuing the sequence in ``cache``); float32 logits of every one."""
    if model.xp is not np:
        raise TypeError("the reference runs on NumPy")
    tokens = np.asarray(tokens, dtype=np.int32)
    positions = np.arange(len(cache), len(cache) + len(tokens), dtype=np.int32)
    x = model.embed(tokens)
    for i in range(model.config.layers):
        q, k, v = model.qkv(i, x, positions)
        cache.append(i, k, v)
        o = dense_causal_attention(q, cache.k[i], cache.v[i], model.scale)
        x = model.finish_layer(i, x, o.astype(model.dtype))
    return model.logits(x)


class RefSeq:
    """One sequence of the oracle: its tokens (prompt first), score and cache."""

    def __init__(self, tokens, prompt_len: int, score: float = 0.0, cache=None):
        self.tokens, self.prompt_len, self.score, self.cache = tokens, prompt_len, score, cache

    @property
    def generated(self) -> list:
        return self.tokens[self.prompt_len:]


def _log_probs(row) -> np.ndarray:
    """log-softmax of one row of float32 logits, in float32."""
    z = row - row.max()
    return z - np.log(np.exp(z).sum())


_MASK = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix(x: int) -> int:
    """splitmix64's finaliser, on a Python int (mod 2**64)."""
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _uniform(seed: int, counter: int) -> float:
    """The ``counter``-th number of the stream ``seed`` starts: 24 bits in [0, 1)."""
    return (_mix((_mix(seed) + counter * _GOLDEN) & _MASK) >> 40) / 2.0**24


def _sample_seed(base: int, i: int) -> int:
    """Sample ``i`` of a request seeded ``base`` draws from a stream of its own."""
    return _mix((base + (i + 1) * _GOLDEN) & _MASK)


def _choose(row, p, counter: int, seed: int, banned=()) -> int:
    """One token from one row of float32 logits (``p``: the request's settings): the most
    likely at temperature 0. Else ``p_i = exp(z_i - max z)``, ``z = row / T`` in float32;
    the kept tokens are the ``top_k`` most likely (all those tied with the k-th too), then of
    those the most likely whose probabilities reach ``top_p`` of their total (ties kept
    whole); ``u`` from the sequence's stream picks, walking the kept tokens in token
    order, the first whose running total passes ``u`` times the kept total. ``banned``
    tokens are never chosen."""
    row = row.astype(np.float32).copy()
    row[list(banned)] = -np.inf
    if p.temperature == 0:
        return int(np.argmax(row))
    z = row / np.float32(p.temperature)
    w = np.exp((z - z.max()).astype(np.float64)).astype(np.float32)
    w[w < np.finfo(np.float32).tiny] = 0
    values = sorted(set(w[w > 0].tolist()), reverse=True)
    k = p.top_k if 0 < p.top_k < len(values) + 1 else 0
    floor = values[-1]
    if k:                                     # the k-th largest, counting ties
        floor = next(v for v in values if int((w >= v).sum()) >= k)
    whole = float(w[w >= floor].astype(np.float64).sum())
    for v in values:                          # the largest cut with top_p of the mass
        if v >= floor and float(w[w >= v].astype(np.float64).sum()) >= p.top_p * whole:
            floor = v
            break
    kept = w >= floor
    total = float(np.where(kept, w, 0).astype(np.float64).sum())
    u, running = _uniform(seed, counter), 0.0
    for t in np.flatnonzero(kept).tolist():
        running += float(w[t])
        if running > u * total:
            return t
    return int(np.flatnonzero(kept)[-1])


def _rank_candidates(live, logits, width: int, stop_ids):
    """Beam search's step, written out: every (beam, token) among each beam's 2 *
    ``width`` most likely, scored by the beam's score plus the token's log-probability,
    best first (ties: lower beam, then lower token). Walking down: a stop token ranked
    in the first ``width`` ends a hypothesis; other tokens continue, until ``width``
    continue."""
    cands = []
    for b, seq in enumerate(live):
        lp = _log_probs(logits[b])
        for t in np.argsort(-lp, kind="stable")[:2 * width].tolist():
            cands.append((seq.score + float(lp[t]), b, t))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    continuing, ended = [], []
    for rank, (score, b, t) in enumerate(cands):
        if t not in stop_ids:
            continuing.append((b, t, score))
        elif rank < width:
            ended.append((b, t, score))
        if len(continuing) == width:
            break
    return continuing, ended


def _best(seqs, width: int) -> list:
    """The ``width`` hypotheses with the highest log-probability per generated token
    (ties: the smaller list of generated tokens first)."""
    def per_token(s):
        return s.score / max(1, len(s.tokens) - s.prompt_len)
    return sorted(seqs, key=lambda s: (-per_token(s), s.tokens[s.prompt_len:]))[:width]


def reference_generate(model: Llama, prompt, params, stop_ids=()) -> list:
    """The same requests as :class:`~pagedkv.model.engine.Engine`, one at a time, each
    sequence with its own contiguous cache (a fork copies the whole cache). Greedy, sampled,
    ``n`` samples or beam search, choosing tokens with its own few lines above (nothing
    from the engine or its sampler, so that a bug in the engine's choosing shows) and the
    same random streams: sample ``i`` of a request seeded ``params.seed`` draws its
    ``j``-th token from stream ``(_sample_seed(seed, i), j)``. Returns the finished
    sequences in the engine's output order."""
    stop_ids = frozenset(int(t) for t in stop_ids)
    c = model.config
    first = RefSeq(list(prompt), len(prompt),
                   cache=ContiguousCache(c.layers, c.kv_heads, c.head_dim, model.dtype))
    logits = reference_forward(model, first.cache, prompt)[-1:]
    live, finished = [first], []
    if params.n > 1:
        live += [RefSeq(list(prompt), len(prompt), cache=first.cache.copy())
                 for _ in range(params.n - 1)]
        logits = logits[[0] * params.n]
    seeds = {id(seq): _sample_seed(params.seed or 0, i) for i, seq in enumerate(live)}
    while True:
        if params.beam_width > 1:
            k = params.beam_width
            continuing, ended = _rank_candidates(live, logits, k, stop_ids)
            finished += [RefSeq(live[b].tokens + [t], len(prompt), score)
                         for b, t, score in ended]
            live = [RefSeq(live[b].tokens + [t], len(prompt), score, live[b].cache.copy())
                    for b, t, score in continuing]
            if len(finished) >= k or not live or len(live[0].generated) >= params.max_new_tokens:
                return _best(finished + live, k)
        else:
            for seq, row in zip(live, logits):
                j = len(seq.generated)
                banned = stop_ids if j < params.min_tokens else ()
                seq.tokens.append(_choose(row, params, j, seeds[id(seq)], banned))
            for seq in list(live):
                end = seq.tokens[-1] in stop_ids and not params.ignore_eos
                if end or len(seq.generated) >= params.max_new_tokens:
                    live.remove(seq)
                    finished.append(seq)
            if not live:
                return finished
        logits = np.concatenate([reference_forward(model, s.cache, [s.tokens[-1]])
                                 for s in live])
