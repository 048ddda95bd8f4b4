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


def reference_generate(model: Llama, prompt, params, stop_ids=()) -> list:
    """The same requests as :class:`~pagedkv.model.generate.Engine`, one at a time, each
    sequence with its own contiguous cache (a fork copies the whole cache). Greedy, sampled,
    ``n`` samples or beam search, choosing tokens with the engine's own functions and the same
    order of random draws. Returns the finished sequences in the engine's output order."""
    from .generate import Sequence, beam_select, best_beams, log_softmax_topk, sample

    stop_ids = frozenset(int(t) for t in stop_ids)
    rng = np.random.default_rng(params.seed)
    c = model.config
    caches = {}                                              # seq_id -> ContiguousCache
    ids = iter(range(1 << 62))

    def new(tokens, score=0.0, cache=None):
        s = Sequence(next(ids), list(tokens), len(prompt), score)
        caches[s.seq_id] = cache
        return s

    first = new(prompt, cache=ContiguousCache(c.layers, c.kv_heads, c.head_dim, model.dtype))
    logits = reference_forward(model, caches[first.seq_id], prompt)[-1:]
    live, finished = [first], []
    if params.n > 1:
        live += [new(prompt, cache=caches[first.seq_id].copy()) for _ in range(params.n - 1)]
        logits = logits[[0] * params.n]
    while True:
        if params.beam_width > 1:
            k = params.beam_width
            top_lp, top_ids = log_softmax_topk(logits, 2 * k)
            continuing, ended = beam_select([b.score for b in live], top_lp, top_ids, k,
                                            stop_ids)
            finished += [new(live[b].tokens + [t], score) for b, t, score in ended]
            live = [new(live[b].tokens + [t], score, caches[live[b].seq_id].copy())
                    for b, t, score in continuing]
            if len(finished) >= k or not live or len(live[0].generated) >= params.max_new_tokens:
                return best_beams(finished + live, k)
        else:
            u = rng.random(len(live)) if params.temperature > 0 else None
            for seq, t in zip(live, sample(logits, params.temperature, params.top_p, u)):
                seq.tokens.append(int(t))
            for seq in list(live):
                if seq.tokens[-1] in stop_ids or len(seq.generated) >= params.max_new_tokens:
                    live.remove(seq)
                    finished.append(seq)
            if not live:
                return finished
        logits = np.concatenate([reference_forward(model, caches[s.seq_id], [s.tokens[-1]])
                                 for s in live])
