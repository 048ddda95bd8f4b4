"""Tensor parallelism of attention: each rank holds the K/V of its share of KV heads.

With ``world`` ranks (GPUs), rank ``r`` owns KV heads ``r * kv_heads / world`` onwards
and the query heads that read them (grouped-query attention: query head ``h`` reads KV
head ``h // group``, so a rank's query heads are one contiguous run too). It keeps
their columns of the q, k, v projection, their rows of the output projection, and a
pool whose blocks hold only its heads. The blocks are the same on every rank: one manager, one page table
per sequence, planned once; every rank writes and reads the same block ids.

Attention then needs no communication until the output projection: rank ``r``'s heads
times its rows of ``wo`` is a partial sum of the layer's output, and one all-reduce (a
sum over the ranks: NCCL's ``allReduce`` on GPUs, a Python ``sum`` here) adds them up.
Everything else (norms, feed-forward, logits) is computed whole on every rank.
"""
from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError
from .llama import Batch, Llama, PagedKV, attend

__all__ = ["Shard", "shard", "shard_caches", "tp_forward"]


class Shard(NamedTuple):
    """What rank ``rank`` of ``world`` holds of each layer."""
    rank: int
    heads: range          # its query heads
    kv_heads: range       # its KV heads
    wqkv: list            # per layer: its columns of q, k and v, in that order
    wo: list              # per layer: its rows of the output projection


def shard(model: Llama, rank: int, world: int) -> Shard:
    """Rank ``rank``'s part of ``model``'s attention weights (views, no copy of ``wo``).
    Raises :class:`ConfigError` if the KV heads do not split evenly."""
    c = model.config
    if world < 1 or c.kv_heads % world:
        raise ConfigError(f"{c.kv_heads} KV heads do not split evenly over {world} "
                          f"ranks")
    if not 0 <= rank < world:
        raise ConfigError(f"rank must be in [0, {world}), got {rank!r}")
    nk, nq, d = c.kv_heads // world, c.heads // world, c.head_dim
    heads, kv = range(rank * nq, (rank + 1) * nq), range(rank * nk, (rank + 1) * nk)
    q_cols = np.arange(heads.start * d, heads.stop * d)
    k_cols = c.heads * d + np.arange(kv.start * d, kv.stop * d)
    v_cols = k_cols + c.kv_heads * d
    cols = np.concatenate([q_cols, k_cols, v_cols])
    return Shard(rank, heads, kv, [layer.wqkv[:, cols] for layer in model.layers],
                 [layer.wo[heads.start * d:heads.stop * d] for layer in model.layers])


def shard_caches(model: Llama, world: int, num_blocks: int, block_size: int) -> list:
    """One cache per rank, each holding ``kv_heads / world`` heads per token, and one
    manager for all: rank 0's plans the page tables every rank's cache reads (the other
    ranks' caches hold only their pools)."""
    c = model.config
    spec = replace(model.kv_spec(), kv_heads=c.kv_heads // world)
    first = PagedKV(spec, num_blocks, block_size, xp=model.xp)
    shared = lambda allocator, block_size: first.manager          # noqa: E731
    return [first] + [PagedKV(spec, num_blocks, block_size, xp=model.xp, manager_cls=shared)
                      for _ in range(world - 1)]


def _qkv(model: Llama, part: Shard, i: int, x, positions):
    """Rank ``part``'s q [T, its heads, D], k and v [T, its KV heads, D], layer ``i``."""
    d, nq, nk = model.config.head_dim, len(part.heads), len(part.kv_heads)
    h = model.linear(model.rms_norm(x, model.layers[i].attn_norm), part.wqkv[i])
    q = h[:, :nq * d].reshape(-1, nq, d)
    k = h[:, nq * d:(nq + nk) * d].reshape(-1, nk, d)
    v = model.xp.ascontiguousarray(h[:, (nq + nk) * d:]).reshape(-1, nk, d)
    return model.rope(q, positions), model.rope(k, positions), v


def feed_forward(model: Llama, i: int, x):
    """Layer ``i``'s feed-forward and its residual, through ``Llama.finish_layer`` (an
    attention output of zeros adds exactly nothing: the projection is already in ``x``).
    """
    zeros = model.xp.zeros((x.shape[0], model.config.heads * model.config.head_dim),
                           dtype=x.dtype)
    return model.finish_layer(i, x, zeros)


def tp_forward(model: Llama, parts: list, caches: list, batch: Batch, all_reduce=sum):
    """:func:`~pagedkv.model.llama.forward` with attention split over the ranks of
    ``parts`` (one :class:`Shard` and one cache each). ``all_reduce`` adds the ranks'
    partial outputs of a layer (on GPUs: NCCL's all-reduce, one per layer)."""
    xp = model.xp
    for kv in caches:
        kv.copy(batch.copies)
    dev = {name: xp.asarray(getattr(batch, name))
           for name in ("tokens", "positions", "slots", "block_tables", "seq_lens")}
    x = model.embed(dev["tokens"])
    for i in range(model.config.layers):
        partial = []
        for part, kv in zip(parts, caches):     # on GPUs: each rank, at the same time
            q, k, v = _qkv(model, part, i, x, dev["positions"])
            kv.write(i, k, v, dev["slots"])
            o = attend(model, kv, q, i, batch, dev)
            partial.append(model.linear(o.reshape(o.shape[0], -1), part.wo[i]))
        x = feed_forward(model, i, x + all_reduce(partial))
    last = np.cumsum(batch.query_lens) - 1
    return model.logits(x[xp.asarray(last)])
