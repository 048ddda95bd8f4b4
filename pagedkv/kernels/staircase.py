"""Chapter 9's staircase: seven versions of paged decode attention, each with its NumPy mirror.

Steps 1–5 are teaching kernels (``staircase.cu``); step 6 is the package's CUDA-core kernel and
step 7 its tensor-core kernel (:mod:`pagedkv.kernels.attention`). :func:`run_step` runs step
``n`` on CuPy arrays (its CUDA kernel) or on NumPy arrays (its mirror: the same loop structure
in NumPy, float32 arithmetic), so a chapter prints the same check on a CPU and on a GPU.
The teaching kernels take float16 and bfloat16.
"""
from __future__ import annotations

import math

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from . import attention
from ._common import (BLOCK_SIZES, DTYPE_CODES, HEAD_DIMS, MAX_GROUP, as_float, check_decode,
                      check_lengths, is_cupy, kernel, load_source, sm_count, to_dtype)

__all__ = ["STEPS", "run_step", "step_kernel", "all_names", "step1_mirror", "step2_mirror",
           "step3_mirror", "step4_mirror", "step5_mirror", "step6_mirror", "step7_mirror"]

#: What each step adds, in a few words (the chapter's table and plot use these).
STEPS = {
    1: "one thread per (sequence, head), two passes",
    2: "a warp per (sequence, head), 16-byte loads",
    3: "online softmax: one pass",
    4: "one CTA per kv head: all heads of a group",
    5: "split-K for few, long sequences",
    6: "production: cp.async ring, token groups",
    7: "tensor cores (mma.sync)",
}
NWARPS = 4          # warps per CTA in steps 4 and 5


def step_kernel(step: int, dt: int, head_dim: int, group: int, block_size: int) -> str:
    """The template instance a teaching step launches (steps 1–5)."""
    if step == 1:
        return f"step1_thread<{dt}, {head_dim}, {block_size}>"
    if step in (2, 3):
        return f"step{step}_{'warp' if step == 2 else 'online'}<{dt}, {head_dim}, {block_size}>"
    name = "step4_group" if step == 4 else "step5_split"
    return f"{name}<{dt}, {head_dim}, {group}, {block_size}, {NWARPS}>"


def all_names(quick: bool = False) -> list[str]:
    """Every instance the launchers can ask for (for perf/compile_check.py)."""
    names = []
    for dt in (1,) if quick else (1, 2):
        for d in (128,) if quick else HEAD_DIMS:
            for bs in (16,) if quick else BLOCK_SIZES:
                for g in (4, 8) if quick else range(1, MAX_GROUP + 1):
                    names += [step_kernel(s, dt, d, g, bs) for s in range(1, 6)]
                names.append(f"merge_splits<{dt}>")
    return sorted(set(names))


# --------------------------------------------------------------------------- NumPy mirrors
# Each mirror walks the data the way its kernel's threads do; what the GPU does in parallel
# (threads, warps, CTAs) becomes a loop or an array axis.

def _rows(cache, table, n, kv, h, kv_dtype):
    """The first ``n`` token rows of kv head ``h`` (kv = 0: K, 1: V) of one sequence, float32."""
    bs = cache.shape[2]
    t = np.arange(n)
    return as_float(cache[table[t // bs], kv, t % bs, h], kv_dtype).astype(np.float32)


def step1_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype):
    """Step 1: one (sequence, query head) at a time (a GPU thread each), two passes."""
    batch, q_heads, d = q.shape
    group = q_heads // cache.shape[3]
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        for qh in range(q_heads):
            k = _rows(cache, block_tables[b], seq_lens[b], 0, qh // group, kv_dtype)
            v = _rows(cache, block_tables[b], seq_lens[b], 1, qh // group, kv_dtype)
            s = k @ (as_float(q[b, qh], kv_dtype).astype(np.float32) * scale)
            m = s.max(initial=-1e30)                     # pass 1: the largest score
            p = np.exp(s - m)                            # pass 2: weights and the V sum
            out[b, qh] = p @ v / p.sum() if len(s) else 0.0
    return out


def step2_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype):
    """Step 2: the same two passes, seen by a warp: a row is ``head_dim / 8`` chunks of
    8 numbers, one per thread; each thread's partial dot product, then their sum (the
    shuffle butterfly)."""
    batch, q_heads, d = q.shape
    group = q_heads // cache.shape[3]
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        n = seq_lens[b]
        for qh in range(q_heads):
            k = _rows(cache, block_tables[b], n, 0, qh // group, kv_dtype)
            v = _rows(cache, block_tables[b], n, 1, qh // group, kv_dtype)
            k = k.reshape(n, d // 8, 8)                  # thread c holds chunk c of a row
            qc = as_float(q[b, qh], kv_dtype).astype(np.float32).reshape(d // 8, 8)
            qc = qc * scale
            partial = (k * qc).sum(axis=-1)              # [tokens, threads of a row]
            s = partial.sum(axis=-1)                     # the butterfly
            p = np.exp(s - s.max(initial=-1e30))
            out[b, qh] = p @ v / p.sum() if n else 0.0
    return out


def _online(k, v, qs, trip):
    """One running softmax over the rows of k, v, ``trip`` tokens at a time (step 3)."""
    m, l, acc = np.float32(-1e30), np.float32(0), np.zeros(v.shape[1], np.float32)
    for t0 in range(0, len(k), trip):
        s = k[t0:t0 + trip] @ qs
        m_new = max(m, s.max())
        corr, p = np.exp(m - m_new), np.exp(s - m_new)
        l = l * corr + p.sum()
        acc = acc * corr + p @ v[t0:t0 + trip]
        m = m_new
    return m, l, acc


def step3_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype):
    """Step 3: one pass, an online softmax over trips of ``32 / (head_dim / 8)`` tokens."""
    batch, q_heads, d = q.shape
    group, trip = q_heads // cache.shape[3], 32 // (d // 8)
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        for qh in range(q_heads):
            k = _rows(cache, block_tables[b], seq_lens[b], 0, qh // group, kv_dtype)
            v = _rows(cache, block_tables[b], seq_lens[b], 1, qh // group, kv_dtype)
            qs = as_float(q[b, qh], kv_dtype).astype(np.float32) * scale
            m, l, acc = _online(k, v, qs, trip)
            out[b, qh] = acc / l if l > 0 else 0.0
    return out


def _merge(states):
    """Combine running softmaxes (m, l, acc) of the same heads: exact, in any order."""
    ms = np.stack([s[0] for s in states])                # [parts, heads]
    mx = ms.max(axis=0)
    w = np.exp(ms - mx)
    lsum = (w * np.stack([s[1] for s in states])).sum(axis=0)
    o = (w[..., None] * np.stack([s[2] for s in states])).sum(axis=0)
    res = np.divide(o, lsum[:, None], out=np.zeros_like(o), where=lsum[:, None] > 0)
    return res, np.where(lsum > 0, mx + np.log(np.where(lsum > 0, lsum, 1)), -np.inf)


def _attend_range(qg, k, v, t_begin, t_end, trip):
    """Steps 4–5 for one (sequence, kv head): warp w takes trips w, w + NWARPS, ... of
    tokens [t_begin, t_end), with one running softmax per query head (rows of ``qg``)."""
    states = []
    for w in range(NWARPS):
        m = np.full(len(qg), -1e30, np.float32)
        l = np.zeros(len(qg), np.float32)
        acc = np.zeros((len(qg), v.shape[1]), np.float32)
        for t0 in range(t_begin + w * trip, t_end, NWARPS * trip):
            t1 = min(t0 + trip, t_end)
            s = qg @ k[t0:t1].T                          # [heads, tokens]: K read once
            m_new = np.maximum(m, s.max(axis=1))
            corr, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
            l = l * corr + p.sum(axis=1)
            acc = acc * corr[:, None] + p @ v[t0:t1]
            m = m_new
        states.append((m, l, acc))
    return _merge(states)                            # (normalised result, natural lse)


def step4_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype, num_splits=1):
    """Step 4: one (sequence, kv head), a CTA, at a time: all its query heads together.
    With ``num_splits`` > 1 this is step 5: each piece of the sequence, then merged."""
    batch, q_heads, d = q.shape
    kv_heads, bs = cache.shape[3], cache.shape[2]
    group, trip = q_heads // kv_heads, 32 // (d // 8)
    split_tokens = _split_tokens(block_tables.shape[1] * bs, num_splits, NWARPS * trip)
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(kv_heads):
            k = _rows(cache, block_tables[b], n, 0, h, kv_dtype)
            v = _rows(cache, block_tables[b], n, 1, h, kv_dtype)
            heads = slice(h * group, (h + 1) * group)
            qg = as_float(q[b, heads], kv_dtype).astype(np.float32) * scale
            parts = [_attend_range(qg, k, v, t, min(n, t + split_tokens), trip)
                     for t in range(0, max(n, 1), split_tokens)]
            res, lse = (parts[0] if len(parts) == 1 else        # step 5: weigh by e^lse
                        _merge([(lse, np.ones_like(lse), r) for r, lse in parts]))
            out[b, heads] = res
    return out


def step5_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype, num_splits=3):
    """Step 5: step 4 on ``num_splits`` pieces of each sequence, merged by their lse."""
    return step4_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype, num_splits)


def _tile_shape(kv_dtype, head_dim, group):
    """Step 6's launch shape: (token groups per CTA, tokens per group per tile, threads
    per token group, 16-byte chunks per thread), as the package's kernel chooses it."""
    nwarps, unroll, _, chunks = attention.cuda_core_config(group, kv_dtype, head_dim)
    nv = attention._chunks(kv_dtype, head_dim, chunks)
    vec = 4 if kv_dtype == "float32" else 8             # numbers in 16 bytes
    tpt = head_dim // vec // nv                         # threads that share a row
    return nwarps * (32 // tpt), unroll, tpt, nv


def _merge2(m, l, acc):
    """Merge running softmaxes in base 2 along axis 0: m, l [parts, heads], acc
    [parts, heads, D]. Returns (m, l, acc) of all parts together."""
    mx = m.max(axis=0)
    w = np.exp2(m - mx)
    return mx, (w * l).sum(axis=0), (w[..., None] * acc).sum(axis=0)


def _tiles6(qg, k, v, t_begin, t_end, shape):
    """One CTA of step 6 on tokens [t_begin, t_end): each token group keeps its own
    running softmax per query head, in base 2; returns the groups' states merged."""
    ngroups, unroll, tpt, nv = shape
    tile, (heads, d) = ngroups * unroll, qg.shape
    m = np.full((ngroups, heads), -1e30, np.float32)      # per token group, per head
    l = np.zeros((ngroups, heads), np.float32)
    acc = np.zeros((ngroups, heads, d), np.float32)
    for tb in range(t_begin, t_end, tile):
        t = tb + np.arange(tile).reshape(unroll, ngroups)  # group g: tb + u*ngroups + g
        ok = t < t_end                                     # past the end: zeros, -inf
        kt = np.where(ok[..., None], k[np.minimum(t, t_end - 1)], 0)
        vt = np.where(ok[..., None], v[np.minimum(t, t_end - 1)], 0)
        # thread lig holds chunks lig, lig + tpt, ...: a partial dot product each,
        # then the butterfly sums the tpt partials of a row
        kc = kt.reshape(unroll, ngroups, nv, tpt, d // (nv * tpt))
        qc = qg.reshape(heads, nv, tpt, d // (nv * tpt))
        partial = np.einsum("ugnlj,hnlj->ughl", kc, qc)
        s = np.where(ok[..., None], partial.sum(axis=-1), -np.inf)  # [unroll, grp, h]
        mx = np.maximum(m, s.max(axis=0))
        corr, p = np.exp2(m - mx), np.exp2(s - mx)
        l = l * corr + p.sum(axis=0)
        acc = acc * corr[..., None] + np.einsum("ugh,ugd->ghd", p, vt)
        m = mx
    return _merge2(m, l, acc)


def step6_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype, num_splits=1):
    """Step 6 (the package's CUDA-core kernel): a CTA per (sequence, kv head, split);
    token groups of ``tpt`` threads walk tiles of tokens, each with its own running
    softmax in base 2 (``exp2``, q pre-scaled by log2 e); groups merged, then splits
    weighed by ``2^lse``."""
    batch, q_heads, d = q.shape
    kv_heads, bs = cache.shape[3], cache.shape[2]
    group = q_heads // kv_heads
    shape = _tile_shape(kv_dtype, d, group)
    tile, max_len = shape[0] * shape[1], block_tables.shape[1] * bs
    splits = max(1, min(int(num_splits), cdiv(max_len, tile)))
    split_tokens = cdiv(cdiv(max_len, splits), tile) * tile   # whole tiles, as on a GPU
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(kv_heads):
            k = _rows(cache, block_tables[b], n, 0, h, kv_dtype)
            v = _rows(cache, block_tables[b], n, 1, h, kv_dtype)
            heads = slice(h * group, (h + 1) * group)
            qg = as_float(q[b, heads], kv_dtype).astype(np.float32)
            qg = qg * np.float32(scale * math.log2(math.e))
            parts = [_tiles6(qg, k, v, t, min(n, t + split_tokens), shape)
                     for t in range(0, max_len, split_tokens)]
            m, l, acc = _merge2(*(np.stack(x) for x in zip(*parts)))
            out[b, heads] = np.divide(acc, l[:, None], out=np.zeros_like(acc),
                                      where=l[:, None] > 0)
    return out


def step7_mirror(q, cache, block_tables, seq_lens, scale, kv_dtype):
    """Step 7 (tensor cores): tiles of 16 tokens; S = Q K^T accumulated in float32,
    the weights P rounded to the storage dtype (as the tensor cores take them) before
    O += P V."""
    batch, q_heads, d = q.shape
    kv_heads = cache.shape[3]
    group = q_heads // kv_heads
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        n = int(seq_lens[b])
        for h in range(kv_heads):
            k = _rows(cache, block_tables[b], n, 0, h, kv_dtype)
            v = _rows(cache, block_tables[b], n, 1, h, kv_dtype)
            qg = as_float(q[b, h * group:(h + 1) * group], kv_dtype).astype(np.float32)
            states = []
            for w in range(NWARPS):                      # warp w: tiles w, w + 4, ...
                m = np.full(group, -1e30, np.float32)
                l, acc = np.zeros(group, np.float32), np.zeros((group, d), np.float32)
                for t0 in range(16 * w, n, 16 * NWARPS):
                    s = (qg @ k[t0:t0 + 16].T) * scale   # [heads, 16] (fewer at the end)
                    m_new = np.maximum(m, s.max(axis=1))
                    corr, p = np.exp(m - m_new), np.exp(s - m_new[:, None])
                    l = l * corr + p.sum(axis=1)
                    p16 = to_dtype(p, kv_dtype, p).astype(np.float32)  # as the mma takes
                    acc = acc * corr[:, None] + p16 @ v[t0:t0 + 16]
                    m = m_new
                states.append((m, l, acc))
            out[b, h * group:(h + 1) * group] = _merge(states)[0]
    return out


MIRRORS = {1: step1_mirror, 2: step2_mirror, 3: step3_mirror, 4: step4_mirror,
           5: step5_mirror, 6: step6_mirror, 7: step7_mirror}


# --------------------------------------------------------------------------- launches

def _split_tokens(max_len: int, num_splits: int, tile: int) -> int:
    """Tokens per split: a whole number of ``tile``s, enough for ``num_splits`` pieces."""
    return max(tile, cdiv(cdiv(max_len, max(1, num_splits)), tile) * tile)


def _launch(step, q, cache, block_tables, seq_lens, out, scale, kv_dtype, num_splits):
    cp = backend.xp
    batch, q_heads, d = q.shape
    kv_heads, bs = cache.shape[3], cache.shape[2]
    group, code = q_heads // kv_heads, DTYPE_CODES[kv_dtype]
    source = load_source("staircase.cu")
    fn = kernel(source, step_kernel(step, code, d, group, bs))
    q, block_tables, seq_lens = (cp.ascontiguousarray(cp.asarray(a))
                                 for a in (q, block_tables, seq_lens))
    ints = (np.int32(kv_heads), np.int32(block_tables.shape[1]))
    if step == 1:
        n = batch * q_heads
        fn((cdiv(n, 128),), (128,), (q, cache, block_tables, seq_lens, out, np.int32(batch),
                                     np.int32(q_heads), *ints, np.float32(scale)))
    elif step in (2, 3):
        n = batch * q_heads
        fn((cdiv(n, 4),), (128,), (q, cache, block_tables, seq_lens, out, np.int32(batch),
                                   np.int32(q_heads), *ints, np.float32(scale)))
    elif step == 4:
        fn((kv_heads, batch), (NWARPS * 32,), (q, cache, block_tables, seq_lens, out, *ints,
                                               np.float32(scale)))
    else:
        trip = 32 // (d // 8)
        max_len = block_tables.shape[1] * bs
        if num_splits is None:
            num_splits = attention.choose_num_splits(batch * kv_heads, max_len, sm_count(), 4,
                                                     NWARPS * trip)
        split_tokens = _split_tokens(max_len, num_splits, NWARPS * trip)
        num_splits = cdiv(max_len, split_tokens)
        part_o = cp.empty(batch * q_heads * num_splits * d, cp.float32)
        part_lse = cp.empty(batch * q_heads * num_splits, cp.float32)
        fn((num_splits, kv_heads, batch), (NWARPS * 32,),
           (q, cache, block_tables, seq_lens, part_o, part_lse, *ints, np.int32(split_tokens),
            np.float32(scale)))
        kernel(source, f"merge_splits<{code}>")(
            (batch * q_heads,), (min(d, 256),),
            (part_o, part_lse, out, np.int32(num_splits), np.int32(d)))
    return out


def run_step(step: int, q, cache, block_tables, seq_lens, *, out=None, num_splits=None):
    """Decode attention by staircase step ``step`` (1–7): on CuPy arrays the step's CUDA kernel,
    on NumPy arrays its mirror. Steps 1–5 and 7 take float16 or bfloat16."""
    if step not in STEPS:
        raise ConfigError(f"step must be one of {list(STEPS)}, got {step}")
    kv_dtype = check_decode(q, cache, block_tables, seq_lens, out)
    if step != 6 and kv_dtype == "float32":
        raise ConfigError(f"step {step} takes float16 or bfloat16, got float32")
    if step >= 6 and is_cupy(cache):
        return attention.paged_decode_attention(q, cache, block_tables, seq_lens, out=out,
                                                num_splits=num_splits,
                                                tensor_cores=step == 7)
    scale = 1.0 / math.sqrt(q.shape[2])
    if is_cupy(cache):
        out = backend.xp.empty_like(q) if out is None else out
        return _launch(step, q, cache, block_tables, seq_lens, out, scale, kv_dtype,
                       num_splits if step == 5 else None)
    tables, lens = np.asarray(block_tables), np.asarray(seq_lens)
    check_lengths(cache, tables, lens)
    if step == 6:
        res = step6_mirror(q, cache, tables, lens, scale, kv_dtype, int(num_splits or 1))
    elif step == 5:
        res = step5_mirror(q, cache, tables, lens, scale, kv_dtype, int(num_splits or 3))
    else:
        res = MIRRORS[step](q, cache, tables, lens, scale, kv_dtype)
    res = to_dtype(res, kv_dtype, q)
    if out is None:
        return res
    out[...] = res
    return out
