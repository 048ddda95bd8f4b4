"""Decode and prefill attention in NumPy: the references every kernel is checked against.

* :func:`gather_kv` + :func:`dense_attention` — the naive way: copy a sequence's blocks into one
  contiguous K and V, then ordinary softmax attention. Easy, but it moves every byte three times.
* :func:`paged_decode_attention_ref` — the float64 reference (the tests' oracle): each token
  position becomes a slot through the page table and is read from there.
* :func:`decode_numpy` — the production kernel's algorithm in float32 NumPy (a page of every
  sequence per step, an online softmax per split, the splits merged at the end): what
  :func:`~pagedkv.kernels.paged_decode_attention` runs on NumPy arrays.
* :func:`paged_prefill_attention_ref` — the float64 reference of causal prefill attention
  (several new tokens per sequence, each attending to the positions up to its own).
* :func:`prefill_numpy` — the prefill kernel's algorithm in float32 NumPy (K/V tiles, an online
  softmax, tiles above the causal diagonal never read): what
  :func:`~pagedkv.kernels.paged_prefill_attention` runs on NumPy arrays.

Only the first ``seq_len`` tokens of a sequence are ever used. The rest of its last block, and
the pages past the end of a shorter row, hold whatever the pool held before (pools are not
cleared, so that may be NaN or Inf): such positions must contribute nothing.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import cdiv
from ._common import (INT8, as_float, check_decode, check_lengths, check_prefill,
                      check_prefill_lengths, dtype_name, read_kv)

__all__ = ["gather_kv", "dense_attention", "paged_decode_attention_ref", "decode_numpy",
           "paged_prefill_attention_ref", "prefill_numpy"]


def gather_kv(cache, block_table, seq_len):
    """One sequence's K and V copied out of its blocks: ``[seq_len, kv_heads, D]`` each
    (float32 from an int8 cache)."""
    block_size = cache.shape[2]
    n = cdiv(int(seq_len), block_size)                  # blocks in use (ceiling division)
    blocks = np.asarray(block_table[:n])
    if not isinstance(cache, np.ndarray):               # an int8 cache, dequantized
        at = (blocks[:, None], np.arange(block_size)[None, :])
        k, v = (read_kv(cache, *at, kv, INT8).reshape(-1, *cache.shape[3:])[:seq_len]
                for kv in (0, 1))
        return k, v
    k = cache[blocks, 0].reshape(-1, *cache.shape[3:])[:seq_len]
    v = cache[blocks, 1].reshape(-1, *cache.shape[3:])[:seq_len]
    return k, v


def dense_attention(q, k, v, scale=None):
    """Softmax attention of one token: q ``[q_heads, D]``, k/v ``[L, kv_heads, D]``."""
    q_heads, d = q.shape
    group = q_heads // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(k.shape[1], group, d).astype(np.float32)       # [kv_heads, group, D]
    s = np.einsum("hgd,lhd->hgl", qg, k.astype(np.float32)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hgl,lhd->hgd", p, v.astype(np.float32)).reshape(q_heads, d)


def paged_decode_attention_ref(q, cache, block_tables, seq_lens, *, scale=None):
    """Float64 NumPy reference; returns float64 ``[batch, q_heads, head_dim]``.

    Every token position ``t < seq_len`` becomes a slot ``table[t // B] * B + t % B`` and K/V are
    read from there. Works on NumPy or CuPy inputs (CuPy ones are copied to the host).
    """
    kv_dtype = check_decode(q, cache, block_tables, seq_lens)
    qf, kv = as_float(q, dtype_name(q)), as_float(cache, kv_dtype)
    tables, lens = backend.to_numpy(block_tables), backend.to_numpy(seq_lens)
    check_lengths(kv, tables, lens)
    num_blocks, _, block_size, kv_heads, d = kv.shape
    batch, q_heads, _ = qf.shape
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flat_k = kv[:, 0].reshape(-1, kv_heads, d)          # [num_blocks * B, kv_heads, D] by slot
    flat_v = kv[:, 1].reshape(-1, kv_heads, d)
    out = np.zeros((batch, q_heads, d))
    for b in range(batch):
        t = np.arange(lens[b])
        slots = tables[b, t // block_size].astype(np.int64) * block_size + t % block_size
        k, v = flat_k[slots], flat_v[slots]             # [L, kv_heads, D]
        qb = qf[b].reshape(kv_heads, group, d)
        s = np.einsum("hgd,lhd->hgl", qb, k) * scale
        if len(t):
            p = np.exp(s - s.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[b] = np.einsum("hgl,lhd->hgd", p, v).reshape(q_heads, d)
    return out


def decode_numpy(q, cache, block_tables, seq_lens, scale, num_splits, kv_dtype):
    """The kernel's algorithm in float32 NumPy; returns float32 ``[batch, q_heads, D]``.

    Page ``j`` of every sequence is read in one step; the pages are cut into
    ``num_splits`` contiguous runs, each with its own online softmax (running max ``m``,
    sum ``l``, weighted sum ``acc``), merged at the end. Positions past a sequence's end
    read block 0 (any block would do) and are then zeroed and masked, so junk there never
    reaches the result.
    """
    check_lengths(cache, block_tables, seq_lens)
    num_blocks, _, bs, kv_heads, d = cache.shape
    batch, q_heads, _ = q.shape
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]
    qf = as_float(q, dtype_name(q)).astype(np.float32).reshape(batch, kv_heads, group, d)
    qf = qf * scale
    pages_per_split = cdiv(max_blocks, num_splits)
    m = np.full((num_splits, batch, kv_heads, group), -np.inf, np.float32)
    l = np.zeros_like(m)
    acc = np.zeros((num_splits, batch, kv_heads, group, d), np.float32)
    for j in range(max_blocks):                      # page j of every sequence at once
        si = j // pages_per_split
        pos = j * bs + np.arange(bs)                     # token positions of page j
        valid = pos[None, :] < seq_lens[:, None]         # [batch, bs]
        if not valid.any():
            continue
        blk = np.where(valid[:, 0], block_tables[:, j], 0)
        keep = valid[:, :, None, None]               # zero what is not ours: 0 * NaN = NaN
        at = (blk[:, None], np.arange(bs)[None, :])      # [batch, bs] rows
        with np.errstate(invalid="ignore", over="ignore"):   # junk scales, zeroed next
            k = np.where(keep, read_kv(cache, *at, 0, kv_dtype), 0).astype(np.float32)
            v = np.where(keep, read_kv(cache, *at, 1, kv_dtype), 0).astype(np.float32)
        s = np.einsum("bhgd,bthd->bhgt", qf, k)          # [batch, kv_heads, group, bs]
        s = np.where(valid[:, None, None, :], s, -np.inf)
        new_m = np.maximum(m[si], s.max(axis=-1))
        safe_m = np.where(np.isinf(new_m), 0.0, new_m)   # rows with nothing valid yet
        corr = np.exp(m[si] - safe_m)
        p = np.exp(s - safe_m[..., None])
        l[si] = l[si] * corr + p.sum(axis=-1)
        acc[si] = acc[si] * corr[..., None] + np.einsum("bhgt,bthd->bhgd", p, v)
        m[si] = new_m
    # merge: out = sum_i e^(m_i - M) acc_i / sum_i e^(m_i - M) l_i
    big_m = m.max(axis=0)
    w = np.exp(m - np.where(np.isinf(big_m), 0.0, big_m))
    num, den = (w[..., None] * acc).sum(axis=0), (w * l).sum(axis=0)
    res = np.divide(num, den[..., None], out=np.zeros_like(num), where=den[..., None] > 0)
    return res.reshape(batch, q_heads, d)


# --------------------------------------------------------------------------- prefill

def paged_prefill_attention_ref(q, cache, block_tables, query_start, seq_lens, *, scale=None):
    """Float64 NumPy reference of causal prefill; returns float64 ``[total_new_tokens, q_heads,
    head_dim]``.

    Sequence ``b`` brings ``n = query_start[b + 1] - query_start[b]`` new tokens at positions
    ``seq_lens[b] - n`` to ``seq_lens[b] - 1`` (their K/V already in the cache); the token at
    position ``p`` attends to positions ``0 .. p``, each read from slot
    ``table[t // B] * B + t % B``. Works on NumPy or CuPy inputs (CuPy ones are copied).
    """
    kv_dtype = check_prefill(q, cache, block_tables, query_start, seq_lens)
    qf, kv = as_float(q, dtype_name(q)), as_float(cache, kv_dtype)
    tables, starts, lens = (backend.to_numpy(a) for a in (block_tables, query_start, seq_lens))
    check_prefill_lengths(qf, kv, tables, starts, lens)
    _, _, block_size, kv_heads, d = kv.shape
    q_heads = qf.shape[1]
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flat_k = kv[:, 0].reshape(-1, kv_heads, d)          # [num_blocks * B, kv_heads, D] by slot
    flat_v = kv[:, 1].reshape(-1, kv_heads, d)
    out = np.zeros(qf.shape)
    for b in range(len(lens)):
        first, n, length = int(starts[b]), int(starts[b + 1] - starts[b]), int(lens[b])
        if n == 0:
            continue
        t = np.arange(length)
        slots = tables[b, t // block_size].astype(np.int64) * block_size + t % block_size
        k, v = flat_k[slots], flat_v[slots]             # [L, kv_heads, D]
        qb = qf[first:first + n].reshape(n, kv_heads, group, d)
        s = np.einsum("nhgd,lhd->hgnl", qb, k) * scale
        positions = np.arange(length - n, length)       # of the new tokens
        s = np.where(t[None, :] <= positions[:, None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[first:first + n] = np.einsum("hgnl,lhd->nhgd", p, v).reshape(n, q_heads, d)
    return out


#: Keys per K/V tile in :func:`prefill_numpy` (the GPU kernel's default tile).
PREFILL_KV_TILE = 64


def prefill_numpy(q, cache, block_tables, query_start, seq_lens, scale, kv_dtype,
                  kv_tile=PREFILL_KV_TILE):
    """The prefill kernel's algorithm in float32 NumPy; returns float32 ``[total_new_tokens,
    q_heads, D]``.

    For each sequence, the rows are its new tokens times its query heads (grouped by kv head:
    the kernel feeds one K/V tile to every head of a group). K and V are read through the page
    table ``kv_tile`` positions at a time, only up to the last new token's position: a tile
    above the causal diagonal is never read. Each tile updates an online softmax (running max
    ``m``, sum ``l``, weighted sum ``acc``); within a tile, a key past a row's own position is
    masked. Positions past the sequence's end are never read (they may hold junk).
    """
    check_prefill_lengths(q, cache, block_tables, query_start, seq_lens)
    _, _, bs, kv_heads, d = cache.shape
    q_heads = q.shape[1]
    group = q_heads // kv_heads
    out = np.zeros(q.shape, np.float32)
    qf = as_float(q, dtype_name(q)).astype(np.float32) * np.float32(scale)
    for b in range(len(seq_lens)):
        first, n, length = int(query_start[b]), int(query_start[b + 1] - query_start[b]), \
            int(seq_lens[b])
        if n == 0:
            continue
        qb = qf[first:first + n].reshape(n, kv_heads, group, d).transpose(1, 0, 2, 3)
        positions = np.arange(length - n, length)            # [n]
        m = np.full((kv_heads, n, group), -np.inf, np.float32)
        l = np.zeros_like(m)
        acc = np.zeros((kv_heads, n, group, d), np.float32)
        for t0 in range(0, length, kv_tile):     # up to the last new token's position
            t = np.arange(t0, min(t0 + kv_tile, length))
            blocks = block_tables[b, t // bs]
            k = read_kv(cache, blocks, t % bs, 0, kv_dtype)      # [T, kv_heads, D]
            v = read_kv(cache, blocks, t % bs, 1, kv_dtype)
            s = np.einsum("hngd,thd->hngt", qb, k)
            s = np.where(t[None, None, None, :] <= positions[None, :, None, None], s, -np.inf)
            new_m = np.maximum(m, s.max(axis=-1))            # finite: key 0 is in every row's past
            corr = np.exp(m - new_m)
            p = np.exp(s - new_m[..., None])
            l = l * corr + p.sum(axis=-1)
            acc = acc * corr[..., None] + np.einsum("hngt,thd->hngd", p, v)
            m = new_m
        res = acc / l[..., None]                             # [kv_heads, n, group, D]
        out[first:first + n] = res.transpose(1, 0, 2, 3).reshape(n, q_heads, d)
    return out
