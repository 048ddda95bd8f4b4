"""Chapter 9 (attention kernels): write_kv's NumPy reference from scratch, the split-K merge
of two partial softmaxes, step 3's mirror written from the text, and step 2's lanes and
butterfly for any head_dim."""
from __future__ import annotations


import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.kernels import dense_attention, paged_decode_attention_ref, write_kv

from ._seeds import names_its_seed

__all__ = ["write_kv_numpy", "merge_partials", "online_mirror", "warp_trip_scores"]


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


def online_mirror(q, cache, block_tables, seq_lens, trip=2):
    """Step 3's mirror: for each (sequence, query head) one pass over its tokens,
    ``trip`` at a time, keeping a running max ``m``, sum ``l`` and weighted sum ``acc``;
    float32 ``[batch, q_heads, D]``. Only a sequence's own rows are read: the rest of
    its last block may hold anything, NaN included."""
    batch, q_heads, d = q.shape
    bs, group = cache.shape[2], q_heads // cache.shape[3]
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        t = np.arange(int(seq_lens[b]))                  # only the sequence's own rows
        rows = cache[block_tables[b][t // bs], :, t % bs].astype(np.float32)
        for qh in range(q_heads):
            k, v = rows[:, 0, qh // group], rows[:, 1, qh // group]
            qs = q[b, qh].astype(np.float32) / np.float32(np.sqrt(d))
            m, l, acc = np.float32(-np.inf), np.float32(0), np.zeros(d, np.float32)
            for t0 in range(0, len(t), trip):
                s = k[t0:t0 + trip] @ qs
                m_new = max(m, s.max())
                corr = np.exp(m - m_new)               # what was summed so far shrinks
                p = np.exp(s - m_new)
                l, acc, m = l * corr + p.sum(), acc * corr + p @ v[t0:t0 + trip], m_new
            out[b, qh] = acc / l if l > 0 else 0.0
    return out


def warp_trip_scores(q_head, k_rows):
    """The scores of one trip of step 2's warp, for any head_dim whose 16-byte chunks
    divide 32 lanes (fp16: 64, 128, 256): lane ``i`` holds chunk ``i % C`` of row
    ``i // C`` (``C = head_dim / 8``) and its partial dot product; ``log2 C`` butterfly
    rounds (lane i adds lane ``i ^ o``, o = C/2, ..., 1) sum a row without crossing into
    the next. Returns the ``32 / C`` rows' scores, read from each row's first lane."""
    d = q_head.shape[0]
    chunks = d // 8
    lanes = np.arange(32)
    row, chunk = lanes // chunks, lanes % chunks
    assert len(k_rows) == 32 // chunks, "a trip reads 32 / C rows"
    qc = q_head.astype(np.float32).reshape(chunks, 8)
    kc = k_rows.astype(np.float32).reshape(len(k_rows), chunks, 8)
    vals = (kc[row, chunk] * qc[chunk]).sum(axis=1)      # each lane's partial dot
    o = chunks // 2
    while o >= 1:                                        # __shfl_xor_sync(..., o)
        vals = vals + vals[lanes ^ o]
        o //= 2
    return vals[::chunks]


# ------------------------------------------------------------------------------------ checks
@names_its_seed
def check_write_kv_numpy(impl=write_kv_numpy, seed=9, trials=200):
    """Against ``pagedkv.kernels.write_kv`` on a twin cache: random shapes and dtypes, distinct
    slots with padding (-1 and other negatives) among them; a slot past the end must raise
    ``ConfigError`` and leave the cache untouched."""
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
    return {"trials": trials}


def _part(q, k, v, scale):
    """One part's normalised output and log-sum-exp, in float64: [heads, D], [heads]."""
    if len(k) == 0:
        return np.zeros((q.shape[0], v.shape[1])), np.full(q.shape[0], -np.inf)
    s = q @ k.T * scale                                   # [heads, tokens]
    m = s.max(axis=1, keepdims=True)
    p = np.exp(s - m)
    return p @ v / p.sum(axis=1, keepdims=True), m[:, 0] + np.log(p.sum(axis=1))


@names_its_seed
def check_merge_partials(impl=merge_partials, seed=10, trials=300):
    """Split random keys at a random point (either part may be empty), attend over each part,
    merge, and compare with ``dense_attention`` over all of them; scores up to about 1000
    (where ``exp`` of an lse overflows), and both parts empty."""
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
    return {"trials": trials}


def _case(rng, lens, q_heads, kv_heads, d, bs):
    """A float16 cache full of NaN but for the sequences' tokens, pages scattered."""
    per = [-(-n // bs) for n in lens]
    blocks = rng.permutation(sum(per) + 2).astype(np.int32)
    tables = np.full((len(lens), max(max(per), 1)), -1, np.int32)
    cache = np.full((len(blocks), 2, bs, kv_heads, d), np.nan, np.float16)
    start = 0
    for s_, (n, p) in enumerate(zip(lens, per)):
        tables[s_, :p] = blocks[start:start + p]
        start += p
        t = np.arange(n)
        slots = (tables[s_, t // bs] * bs + t % bs).astype(np.int32)
        kv = rng.standard_normal((2, n, kv_heads, d)).astype(np.float16)
        write_kv(cache, kv[0], kv[1] * 3, slots)
    q = (rng.standard_normal((len(lens), q_heads, d)) * 2).astype(np.float16)
    return q, cache, tables, np.asarray(lens, np.int32)


@names_its_seed
def check_online_mirror(impl=online_mirror, seed=12, trials=12):
    """Against the float64 reference on NaN-filled pools: lengths from 1 to a few blocks
    (ending on block boundaries too), groups 1 to 4, head_dim 64 and 128, trips 1, 2, 5;
    relative error under 2e-3 (fp16's tolerance in this chapter)."""
    rng = np.random.default_rng(seed)
    for k in range(trials):
        bs, d, group = int(rng.choice([8, 16])), int(rng.choice([64, 128])), k % 4 + 1
        lens = [int(x) for x in rng.integers(1, 5 * bs, 3)] + [2 * bs]
        case = _case(rng, lens, 2 * group, 2, d, bs)
        ref = paged_decode_attention_ref(*case)
        trip = (1, 2, 5)[k % 3]
        with np.errstate(invalid="ignore", over="ignore"):
            got = np.asarray(impl(*case, trip=trip), np.float64)
        assert got.shape == ref.shape and np.isfinite(got).all(), (lens, trip)
        err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
        assert err < 2e-3, (lens, group, d, trip, err)
    return {"cases": trials}


@names_its_seed
def check_warp_trip_scores(impl=warp_trip_scores, seed=13, trials=30):
    """Each trip's scores against float64 dot products, for head_dim 64 (4 rows a trip,
    8 lanes a row), 128 (2 rows, 16 lanes) and 256 (1 row, 32 lanes)."""
    rng = np.random.default_rng(seed)
    for k in range(trials):
        d = (64, 128, 256)[k % 3]
        q = rng.standard_normal(d).astype(np.float16)
        rows = rng.standard_normal((32 // (d // 8), d)).astype(np.float16)
        got = np.asarray(impl(q, rows), np.float64)
        want = rows.astype(np.float64) @ q.astype(np.float64)
        assert got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-3), (
            d, got, want)
    return {"trials": trials, "head_dims": [64, 128, 256]}


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


def _online_without_rescaling(q, cache, block_tables, seq_lens, trip=2):
    """Forgets to shrink l and acc when the max grows."""
    batch, q_heads, d = q.shape
    bs, group = cache.shape[2], q_heads // cache.shape[3]
    out = np.zeros((batch, q_heads, d), np.float32)
    for b in range(batch):
        t = np.arange(int(seq_lens[b]))
        rows = cache[block_tables[b][t // bs], :, t % bs].astype(np.float32)
        for qh in range(q_heads):
            k, v = rows[:, 0, qh // group], rows[:, 1, qh // group]
            qs = q[b, qh].astype(np.float32) / np.float32(np.sqrt(d))
            m, l, acc = np.float32(-np.inf), np.float32(0), np.zeros(d, np.float32)
            for t0 in range(0, len(t), trip):
                s = k[t0:t0 + trip] @ qs
                m = max(m, s.max())
                p = np.exp(s - m)
                l, acc = l + p.sum(), acc + p @ v[t0:t0 + trip]
            out[b, qh] = acc / l
    return out


def _online_reading_whole_blocks(q, cache, block_tables, seq_lens, trip=2):
    """Reads every row of the sequence's blocks: the NaN past its end gets in."""
    bs = cache.shape[2]
    lens = [-(-int(n) // bs) * bs for n in seq_lens]
    return online_mirror(q, cache, block_tables, np.asarray(lens), trip)


def _trip_rounds_over_the_warp(q_head, k_rows):
    """Butterfly over all 32 lanes (five rounds): adds the other rows' partials in."""
    chunks = q_head.shape[0] // 8
    lanes = np.arange(32)
    qc = q_head.astype(np.float32).reshape(chunks, 8)
    kc = k_rows.astype(np.float32).reshape(len(k_rows), chunks, 8)
    vals = (kc[lanes // chunks, lanes % chunks] * qc[lanes % chunks]).sum(axis=1)
    for o in (16, 8, 4, 2, 1):
        vals = vals + vals[lanes ^ o]
    return vals[::chunks]


def _trip_as_for_head_dim_128(q_head, k_rows):
    """Keeps head_dim 128's layout (16 lanes a row, two rows a trip) for every head_dim."""
    d, lanes = q_head.shape[0], np.arange(32)
    flat = np.concatenate([k_rows.astype(np.float32).ravel(), np.zeros(256)])[:256]
    kc = flat.reshape(2, 16, 8)
    qc = np.resize(q_head.astype(np.float32), 128).reshape(16, 8)
    vals = (kc[lanes // 16, lanes % 16] * qc[lanes % 16]).sum(axis=1)
    for o in (8, 4, 2, 1):
        vals = vals + vals[lanes ^ o]
    return vals[::16][:len(k_rows)] if len(k_rows) <= 2 else np.resize(vals[::16], len(k_rows))


WRONG = {
    "write_kv_numpy": [_write_minus_one_too, _write_as_if_k_and_v_interleaved, _write_unchecked],
    "merge_partials": [_merge_by_token_share, _merge_without_the_max,
                       _merge_forgetting_empty_parts],
    "online_mirror": [_online_without_rescaling, _online_reading_whole_blocks],
    "warp_trip_scores": [_trip_rounds_over_the_warp, _trip_as_for_head_dim_128],
}
