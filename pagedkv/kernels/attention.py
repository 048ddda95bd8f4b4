"""Decode attention through page tables (PagedAttention), with split-K ("flash-decoding").

At a decode step every sequence brings one new query token per head and attends over all its
past keys and values, which live in blocks scattered through the cache. Three versions:

* :func:`gather_kv` + :func:`dense_attention` — the naive one: copy a sequence's blocks into one
  contiguous K and V, then ordinary softmax attention. Easy, but it moves every byte twice.
* :func:`paged_decode_attention_ref` — the float64 NumPy reference (the tests' oracle): each
  token position is turned into its slot through the page table and read from there.
* :func:`paged_decode_attention` — the real thing: on CuPy arrays one CUDA kernel reads K and V
  straight out of the blocks (``PAGED_DECODE_SOURCE``), on NumPy arrays the same algorithm
  (a page at a time, online softmax, splits merged at the end) runs in float32 NumPy.

Shapes: ``q`` ``[batch, q_heads, head_dim]``; ``cache`` ``[num_blocks, 2, block_size, kv_heads,
head_dim]``; ``block_tables`` int32 ``[batch, max_blocks]``; ``seq_lens`` int32 ``[batch]``.
``q_heads`` is a multiple ``group`` (1–8) of ``kv_heads``: query head ``i`` reads kv head
``i // group`` (grouped-query attention; ``group == 1`` is ordinary multi-head attention).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .. import backend
from ..errors import ConfigError
from ._common import (DTYPE_CODES, as_float, check_cache, check_int32, fn_attr,
                      is_cupy, kernel, sm_count, to_dtype)

__all__ = ["paged_decode_attention", "paged_decode_attention_ref", "gather_kv", "dense_attention",
           "choose_num_splits", "PAGED_DECODE_SOURCE", "HEAD_DIMS", "BLOCK_SIZES", "MAX_GROUP"]

HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8

PAGED_DECODE_SOURCE = r"""
// ============================================================================================
// Paged decode attention. Read this first:
//  * A kernel runs as a grid of thread blocks ("CTAs"). Here one CTA handles one
//    (sequence b, kv head h, split) triple: blockIdx.z = b, blockIdx.y = h, blockIdx.x = split.
//    All GROUP query heads that share kv head h are handled by the same CTA, so every K/V byte
//    is read from memory once and used GROUP times.
//  * Inside a CTA, threads form "token groups" of TPT threads. A token group reads one token's
//    K row (head_dim numbers) together: each thread takes 16 consecutive bytes (one uint4), so
//    the group's loads are one contiguous stretch of memory, the fastest access there is.
//  * Each token group walks its own tokens (every NGROUPS-th one) and keeps its own running
//    softmax (max m, sum l, weighted sum acc). At the end the groups, then the warps, are merged.
//  * Numbers are stored as DT (0 float32, 1 float16, 2 bfloat16) but all arithmetic is float32.
// ============================================================================================

// Minus infinity, spelled as its bit pattern (no headers needed).
#define NEG_INF __uint_as_float(0xff800000u)

// ---- stored numbers <-> float32 ------------------------------------------------------------
template <int DT> struct Num;
template <> struct Num<0> {  // float32: a 16-byte load holds 4 numbers, nothing to convert
    static constexpr int PER_VEC = 4;
    __device__ static void unpack(const uint4& r, float* f) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    __device__ static void store(void* p, long long i, float x) { ((float*)p)[i] = x; }
};
template <> struct Num<1> {  // float16: 8 per 16 bytes; the cvt instruction widens each one
    static constexpr int PER_VEC = 8;
    __device__ static float widen(unsigned short h) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
    }
    __device__ static void unpack(const uint4& r, float* f) {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = widen((unsigned short)(w[i] & 0xffff));
            f[2 * i + 1] = widen((unsigned short)(w[i] >> 16));
        }
    }
    __device__ static void store(void* p, long long i, float x) {
        unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        ((unsigned short*)p)[i] = h;
    }
};
template <> struct Num<2> {  // bfloat16: the top half of a float32, so widening is a shift
    static constexpr int PER_VEC = 8;
    __device__ static void unpack(const uint4& r, float* f) {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    __device__ static void store(void* p, long long i, float x) {
        unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        ((unsigned short*)p)[i] = h;
    }
};

// ---- asynchronous copies global -> shared (Ampere and later) ---------------------------------
// cp.async.cg copies 16 bytes without passing through registers; with ok == false it copies 0
// bytes and fills the 16 with zeros. commit closes a group of copies; wait<N> blocks until at
// most N groups of this thread are still in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
    unsigned s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// ---- the kernel ----------------------------------------------------------------------------
// q            [batch][q_heads][HEAD_DIM]                          (as uint4 chunks)
// cache        [num_blocks][2][BLOCK_SIZE][kv_heads][HEAD_DIM]     (as uint4 chunks)
// block_tables [batch][max_blocks]   physical block of each sequence's logical block
// seq_lens     [batch]
// out          [batch][q_heads][HEAD_DIM]   written when there is one split
// part_o, part_lse: each split's normalised output and log2-sum-exp, merged by merge_splits
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS, int UNROLL, int STAGES,
          int CHUNKS>
__global__ void __launch_bounds__(NWARPS * 32)
paged_decode(const uint4* __restrict__ q, const uint4* __restrict__ cache,
             const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
             void* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse,
             int kv_heads, int max_blocks, int split_tokens, float scale_log2) {
    using N = Num<DT>;
    constexpr int VEC = N::PER_VEC;                     // numbers per 16-byte load
    constexpr int ROW_VECS = HEAD_DIM / VEC;            // 16-byte loads per head row
    constexpr int NV = CHUNKS > 0 ? CHUNKS              // 16-byte loads per thread per row:
                     : (ROW_VECS < 32 ? 1 : ROW_VECS / 32);  //   as few as a warp allows
    constexpr int TPT = ROW_VECS / NV;                  // threads per token group
    static_assert(TPT * NV == ROW_VECS && TPT <= 32 && 32 % TPT == 0, "bad CHUNKS");
    constexpr int E = NV * VEC;                         // numbers of a row one thread holds
    constexpr int GPW = 32 / TPT;                       // token groups per warp
    constexpr int NGROUPS = NWARPS * GPW;               // token groups per CTA
    constexpr int TILE = NGROUPS * UNROLL;              // tokens per trip round the loop

    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int num_splits = gridDim.x, q_heads = kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = warp * GPW + lane / TPT;  // my token group
    const int lig = lane % TPT;               // my place in it: I own chunks lig, lig+TPT, ...

    const int len = seq_lens[b];
    const int t_begin = split * split_tokens;                 // this split's tokens:
    const int t_end = min(len, t_begin + split_tokens);       //   [t_begin, t_end)

    // My slice of each query head, pre-multiplied by scale * log2(e) so that exp2 can be used.
    float qf[GROUP][E];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        #pragma unroll
        for (int n = 0; n < NV; ++n) {
            float tmp[VEC];
            N::unpack(q[((long long)b * q_heads + h * GROUP + g) * ROW_VECS + n * TPT + lig], tmp);
            #pragma unroll
            for (int j = 0; j < VEC; ++j) qf[g][n * VEC + j] = tmp[j] * scale_log2;
        }
    }

    // Running softmax of my token group, per query head: max score m, sum of exp2(s - m) l,
    // and acc = sum of exp2(s - m) * V over the tokens seen so far (my E numbers of it).
    float m[GROUP], l[GROUP], acc[GROUP][E];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -1e30f; l[g] = 0.f;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }

    // Token t of the sequence lives in physical block table[t / BLOCK_SIZE], row t % BLOCK_SIZE.
    const int* table = block_tables + (long long)b * max_blocks;
    const long long row = (long long)kv_heads * ROW_VECS;  // uint4s from one token to the next
    const uint4* head = cache + h * ROW_VECS + lig;        // my chunk of kv head h in row 0

    // The loop runs over "tiles" of TILE tokens; in a tile, token group grp takes tokens
    // tile_start + u * NGROUPS + grp for u = 0 .. UNROLL-1. Loads go through a ring of STAGES
    // shared-memory slots: while the arithmetic works on tile i, the loads of the next STAGES-1
    // tiles are already on their way (cp.async copies global -> shared without using registers).
    // Each thread reads back only the 16-byte chunks it asked for itself, so no barrier is needed:
    // "cp.async.wait_group N" waits until at most N of my requested groups are still in flight.
    __shared__ uint4 ring[STAGES][UNROLL][2][NV][NWARPS * 32];
    const int n_tiles = t_end > t_begin ? (t_end - t_begin + TILE - 1) / TILE : 0;
    int blk[UNROLL];  // the blocks of the tile to request next (looked up one tile ahead)

    // lookup(tile): fetch the block ids of my tokens of that tile from the page table.
    // request(tile): start copying those tokens' K and V rows into the tile's ring slot.
#define LOOKUP(tile_)                                                                       \
    _Pragma("unroll") for (int u = 0; u < UNROLL; ++u) {                                    \
        int t = t_begin + (tile_) * TILE + u * NGROUPS + grp;                               \
        blk[u] = ((tile_) < n_tiles && t < t_end) ? table[t / BLOCK_SIZE] : 0;              \
    }
#define REQUEST(tile_)                                                                      \
    if ((tile_) < n_tiles) {                                                                \
        const int slot_ = (tile_) % STAGES;                                                 \
        _Pragma("unroll") for (int u = 0; u < UNROLL; ++u) {                                \
            int t = t_begin + (tile_) * TILE + u * NGROUPS + grp;                           \
            bool ok = t < t_end;  /* a token past the end reads zeros, never garbage */     \
            const uint4* p = head + ((long long)blk[u] * 2 * BLOCK_SIZE + t % BLOCK_SIZE) * row; \
            _Pragma("unroll") for (int n = 0; n < NV; ++n) {                                \
                cp_async16(&ring[slot_][u][0][n][threadIdx.x], ok ? p + n * TPT : cache, ok); \
                cp_async16(&ring[slot_][u][1][n][threadIdx.x],                              \
                           ok ? p + BLOCK_SIZE * row + n * TPT : cache, ok);                \
            }                                                                               \
        }                                                                                   \
    }                                                                                       \
    cp_async_commit();  /* one group per tile, empty past the end, so the count stays right */

    LOOKUP(0)
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { REQUEST(i) LOOKUP(i + 1) }

    for (int tile = 0; tile < n_tiles; ++tile) {
        // 1. Ask for tile + STAGES - 1, look up the blocks of the one after, wait for this tile.
        REQUEST(tile + STAGES - 1)
        LOOKUP(tile + STAGES)
        cp_async_wait<STAGES - 1>();
        const int slot = tile % STAGES;
        const int tb = t_begin + tile * TILE;

        // 2. Scores s = q . k: my partial dot product, then a butterfly sum over the group's
        //    TPT threads (__shfl_xor_sync swaps registers between threads of a warp).
        float s[UNROLL][GROUP];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) s[u][g] = 0.f;
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                float kf[VEC];
                N::unpack(ring[slot][u][0][n][threadIdx.x], kf);
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) s[u][g] += qf[g][n * VEC + j] * kf[j];
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                #pragma unroll
                for (int o = TPT / 2; o > 0; o /= 2)
                    s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
                if (tb + u * NGROUPS + grp >= t_end) s[u][g] = NEG_INF;  // past the end
            }
        }
        // 3. Online softmax: raise the running max, rescale what was summed so far, add the
        //    new tokens' weights p = exp2(s - m) and p * V.
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = m[g];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
            const float corr = exp2f(m[g] - mx);
            m[g] = mx;
            l[g] *= corr;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= corr;
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                float vf[VEC];
                N::unpack(ring[slot][u][1][n][threadIdx.x], vf);
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float p = exp2f(s[u][g] - m[g]);
                    if (n == 0) l[g] += p;
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[g][n * VEC + j] += p * vf[j];
                }
            }
        }
    }

    // 4. Merge the token groups of each warp (threads TPT, 2*TPT, ... apart hold the same
    //    numbers of different groups): two running softmaxes (m1, l1, a1), (m2, l2, a2) combine
    //    to m = max(m1, m2), l = l1 * 2^(m1-m) + l2 * 2^(m2-m), and a likewise.
    #pragma unroll
    for (int o = TPT; o < 32; o *= 2) {
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float om = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float ol = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float nm = fmaxf(m[g], om);
            const float c1 = exp2f(m[g] - nm), c2 = exp2f(om - nm);
            l[g] = l[g] * c1 + ol * c2;
            #pragma unroll
            for (int e = 0; e < E; ++e)
                acc[g][e] = acc[g][e] * c1 + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * c2;
            m[g] = nm;
        }
    }

    // 5. Merge the warps through shared memory (memory all threads of the CTA can see), one
    //    query head at a time, and write the result: the output itself when there is one split,
    //    else this split's normalised output and its log2-sum-exp for merge_splits.
    __shared__ float sm_acc[NWARPS][HEAD_DIM];
    __shared__ float sm_m[NWARPS], sm_l[NWARPS];
    #pragma unroll  // (unrolled so that acc[g] stays in registers: g must be a constant)
    for (int g = 0; g < GROUP; ++g) {
        if (lane < TPT) {
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                #pragma unroll
                for (int j = 0; j < VEC; ++j)
                    sm_acc[warp][(n * TPT + lig) * VEC + j] = acc[g][n * VEC + j];
            }
            if (lane == 0) { sm_m[warp] = m[g]; sm_l[warp] = l[g]; }
        }
        __syncthreads();  // wait until every warp has written
        const long long qrow = (long long)b * q_heads + h * GROUP + g;
        for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) {
            float mx = -1e30f;
            #pragma unroll
            for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, sm_m[w]);
            float lsum = 0.f, o = 0.f;
            #pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float c = exp2f(sm_m[w] - mx);
                lsum += sm_l[w] * c;
                o += sm_acc[w][d] * c;
            }
            const float res = lsum > 0.f ? o / lsum : 0.f;
            if (num_splits == 1) {
                N::store(out, qrow * HEAD_DIM + d, res);
            } else {
                part_o[(qrow * num_splits + split) * HEAD_DIM + d] = res;
                if (d == 0) part_lse[qrow * num_splits + split] = lsum > 0.f ? mx + log2f(lsum) : NEG_INF;
            }
        }
        __syncthreads();  // before the next head overwrites shared memory
    }
}

// Merge the splits of one query head (blockIdx.x) : thread d makes output number d.
// Split i saw weights summing to 2^lse_i and produced o_i normalised; the whole softmax is
// out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M), with M = max_i lse_i for safety.
template <int DT>
__global__ void merge_splits(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                             void* __restrict__ out, int num_splits, int head_dim) {
    const long long qrow = blockIdx.x;
    const float* lse = part_lse + qrow * num_splits;
    float mx = NEG_INF;
    for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, lse[i]);
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float lsum = 0.f, o = 0.f;
        if (mx > NEG_INF) {
            for (int i = 0; i < num_splits; ++i) {
                const float w = exp2f(lse[i] - mx);
                lsum += w;
                o += w * part_o[(qrow * num_splits + i) * head_dim + d];
            }
        }
        Num<DT>::store(out, qrow * head_dim + d, lsum > 0.f ? o / lsum : 0.f);
    }
}
"""


# --------------------------------------------------------------------------- checks

def _check(q, cache, block_tables, seq_lens, out):
    kv_dtype = check_cache(cache)
    if q.ndim != 3:
        raise ConfigError(f"q must have shape [batch, q_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype != cache.dtype:
        raise ConfigError(f"q has dtype {q.dtype}, the cache {cache.dtype}")
    _, _, block_size, kv_heads, head_dim = cache.shape
    batch, q_heads, qd = q.shape
    if qd != head_dim:
        raise ConfigError(f"q has head_dim {qd}, the cache {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ConfigError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if block_size not in BLOCK_SIZES:
        raise ConfigError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if q_heads % kv_heads or not 1 <= q_heads // kv_heads <= MAX_GROUP:
        raise ConfigError(f"q_heads ({q_heads}) must be 1 to {MAX_GROUP} times kv_heads "
                          f"({kv_heads})")
    check_int32(block_tables, "block_tables", 2)
    check_int32(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ConfigError(f"block_tables {tuple(block_tables.shape)} and seq_lens "
                          f"{tuple(seq_lens.shape)} must have batch={batch} rows")
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ConfigError(f"out must be {tuple(q.shape)} {q.dtype}, got "
                          f"{tuple(out.shape)} {out.dtype}")
    return kv_dtype


def _check_lengths(cache, block_tables, seq_lens):
    """Host-side checks of lengths and table entries (NumPy path only: on the GPU they'd sync)."""
    num_blocks, _, block_size = cache.shape[:3]
    lens = np.asarray(seq_lens)
    if lens.size and (lens.min() < 0 or lens.max() > block_tables.shape[1] * block_size):
        raise ConfigError(f"seq_lens must lie in [0, max_blocks * block_size = "
                          f"{block_tables.shape[1] * block_size}]")
    used = np.arange(block_tables.shape[1])[None, :] * block_size < lens[:, None]
    if np.any((block_tables[used] < 0) | (block_tables[used] >= num_blocks)):
        raise ConfigError(f"block_tables map a token to a block outside [0, {num_blocks})")


# --------------------------------------------------------------------------- the naive version

def gather_kv(cache, block_table, seq_len):
    """Copy one sequence's K and V out of its blocks into contiguous ``[seq_len, kv_heads, D]``."""
    block_size = cache.shape[2]
    n = -(-int(seq_len) // block_size)                  # blocks in use (ceiling division)
    blocks = np.asarray(block_table[:n])
    k = cache[blocks, 0].reshape(-1, *cache.shape[3:])[:seq_len]
    v = cache[blocks, 1].reshape(-1, *cache.shape[3:])[:seq_len]
    return k, v


def dense_attention(q, k, v, scale=None):
    """Ordinary softmax attention of one token: q ``[q_heads, D]``, k/v ``[L, kv_heads, D]``."""
    q_heads, d = q.shape
    group = q_heads // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qg = q.reshape(k.shape[1], group, d).astype(np.float32)       # [kv_heads, group, D]
    s = np.einsum("hgd,lhd->hgl", qg, k.astype(np.float32)) * scale
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("hgl,lhd->hgd", p, v.astype(np.float32)).reshape(q_heads, d)


# --------------------------------------------------------------------------- the reference

def paged_decode_attention_ref(q, cache, block_tables, seq_lens, *, scale=None):
    """Float64 NumPy reference; returns float64 ``[batch, q_heads, head_dim]``.

    Every token position ``t < seq_len`` becomes a slot ``table[t // B] * B + t % B`` and K/V are
    read from there. Works on NumPy or CuPy inputs (CuPy ones are copied to the host).
    """
    kv_dtype = _check(q, cache, block_tables, seq_lens, None)
    qf, kv = as_float(q, kv_dtype), as_float(cache, kv_dtype)
    tables, lens = backend.to_numpy(block_tables), backend.to_numpy(seq_lens)
    _check_lengths(kv, tables, lens)
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


# --------------------------------------------------------------------------- NumPy algorithm

def _decode_numpy(q, cache, block_tables, seq_lens, scale, num_splits, kv_dtype):
    """The kernel's algorithm in float32 NumPy: one page of every sequence per step, an online
    softmax per split, the splits merged at the end."""
    _check_lengths(cache, block_tables, seq_lens)
    num_blocks, _, bs, kv_heads, d = cache.shape
    batch, q_heads, _ = q.shape
    group = q_heads // kv_heads
    max_blocks = block_tables.shape[1]
    qf = as_float(q, kv_dtype).astype(np.float32).reshape(batch, kv_heads, group, d) * scale
    pages_per_split = -(-max_blocks // num_splits)
    m = np.full((num_splits, batch, kv_heads, group), -np.inf, np.float32)
    l = np.zeros_like(m)
    acc = np.zeros((num_splits, batch, kv_heads, group, d), np.float32)
    for j in range(max_blocks):                          # page j of every sequence at once
        si = j // pages_per_split
        pos = j * bs + np.arange(bs)                     # token positions of page j
        valid = pos[None, :] < seq_lens[:, None]         # [batch, bs]
        if not valid.any():
            continue
        blk = np.where(valid[:, 0], block_tables[:, j], 0)
        k = as_float(cache[blk, 0], kv_dtype).astype(np.float32)   # [batch, bs, kv_heads, d]
        v = as_float(cache[blk, 1], kv_dtype).astype(np.float32)
        s = np.einsum("bhgd,bthd->bhgt", qf, k)
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


# --------------------------------------------------------------------------- GPU launch

def _config(group: int, kv_dtype: str, head_dim: int):
    """(warps per CTA, tokens per group per tile, ring stages, chunks per thread; 0 = auto).

    Chosen from the H200 sweep in perf/LOG.md: two 16-byte chunks per thread (so 8 threads share
    a 128-dim fp16 row and the score needs 3 shuffle rounds, not 4), two tokens per group per
    tile, a ring of two tiles. Groups of 5–8 heads keep one chunk (registers would spill).
    """
    if group <= 4:
        return 4, 2, 2, 2
    return 4, 2, 3, 0


def _chunks(kv_dtype: str, head_dim: int, chunks: int) -> int:
    """16-byte chunks of a head row per thread (the kernel's NV)."""
    row_vecs = head_dim // (4 if kv_dtype == "float32" else 8)
    return chunks or (1 if row_vecs < 32 else row_vecs // 32)


def smem_bytes(kv_dtype: str, head_dim: int, nwarps: int, unroll: int, stages: int,
               chunks: int = 0) -> int:
    """Static shared memory of one CTA: the load ring plus the warp-merge arrays."""
    nv = _chunks(kv_dtype, head_dim, chunks)
    return stages * unroll * 2 * nv * nwarps * 32 * 16 + nwarps * (head_dim + 2) * 4


def _ctas_per_sm(fn, threads: int, smem: int) -> int:
    """CTAs that fit on one SM at once: limited by registers, threads, and shared memory."""
    regs = fn_attr(fn, "num_regs", 128)
    per_warp = -(-regs * 32 // 256) * 256                # registers are handed out per warp
    return max(1, min(65536 // (per_warp * threads // 32), 2048 // threads, 32,
                      (228 * 1024) // (smem + 1024)))


def choose_num_splits(work: int, max_len: int, sms: int, ctas_per_sm: int, tile: int) -> int:
    """How many pieces to cut each sequence into, so that the whole GPU is busy.

    ``work`` = batch × kv_heads CTAs would run without splitting; ``ctas_per_sm`` of them fit on
    each of the ``sms`` multiprocessors at once. The rule was fitted to H200 measurements
    (perf/LOG.md): two CTAs per SM already saturate memory bandwidth, extra waves cost little
    once there are at least two of them, and every split adds a merge.

    * two or more full waves of CTAs: no split;
    * one to two waves: 2 splits (a second wave that is only partly full costs more than a merge);
    * less than one wave: enough splits for about two CTAs per SM, all resident at once.
    """
    slots = sms * ctas_per_sm
    if work >= 2 * slots:
        s = 1
    elif work >= slots:
        s = 2
    else:
        s = max(1, (2 * sms) // work)
    s = max(1, min(s, max_len // (2 * tile)))          # at least two tiles per split
    per_split = -(-(-(-max_len // s)) // tile) * tile    # a whole number of tiles each ...
    return -(-max_len // per_split)                      # ... which may leave fewer splits


@functools.lru_cache(maxsize=256)
def _plan(q_shape, cache_shape, itemsize, kv_dtype, max_blocks, num_splits, nwarps=None,
          unroll=None, stages=None, chunks=None):
    """Kernel, split count and split length for one problem shape (cached: decode steps repeat)."""
    batch, q_heads, _ = q_shape
    _, _, bs, kv_heads, d = cache_shape
    group = q_heads // kv_heads
    dw, du, ds, dc = _config(group, kv_dtype, d)
    nwarps, unroll, stages = nwarps or dw, unroll or du, stages or ds
    nv = _chunks(kv_dtype, d, dc if chunks is None else chunks)
    while stages > 1 and smem_bytes(kv_dtype, d, nwarps, unroll, stages, nv) > 48 * 1024:
        stages -= 1                                      # stay within 48 KiB of static smem
    code = DTYPE_CODES[kv_dtype]
    fn = kernel(PAGED_DECODE_SOURCE, f"paged_decode<{code}, {d}, {group}, {bs}, {nwarps}, "
                                     f"{unroll}, {stages}, {nv}>")
    threads = nwarps * 32
    tpt = d // (4 if kv_dtype == "float32" else 8) // nv  # threads per token group
    tile = nwarps * (32 // tpt) * unroll                  # tokens per tile
    max_len = max_blocks * bs                            # an upper bound known without a sync
    if num_splits is None:
        occupancy = _ctas_per_sm(fn, threads, smem_bytes(kv_dtype, d, nwarps, unroll, stages, nv))
        num_splits = choose_num_splits(batch * kv_heads, max_len, sm_count(), occupancy, tile)
    num_splits = max(1, min(int(num_splits), -(-max_len // tile)))
    split_tokens = -(-(-(-max_len // num_splits)) // tile) * tile  # a whole number of tiles
    num_splits = -(-max_len // split_tokens)             # rounding up may leave one fewer
    merge = kernel(PAGED_DECODE_SOURCE, f"merge_splits<{code}>") if num_splits > 1 else None
    return fn, merge, threads, num_splits, split_tokens


_workspace = {}


def _scratch(nbytes: int):
    """A reused float32 scratch buffer for the split results (grown when too small).

    Reuse is safe because every launch goes to the current stream in order; it saves two
    allocations per decode step, which matter when the kernel itself takes ~40 µs.
    """
    cp = backend.xp
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    buf = _workspace.get(key)
    if buf is None or buf.nbytes < nbytes:
        buf = _workspace[key] = cp.empty((max(nbytes, 1 << 20) + 3) // 4, cp.float32)
    return buf


def _contiguous(a):
    cp = backend.xp
    if not isinstance(a, cp.ndarray):
        a = cp.asarray(a)
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def _decode_cupy(q, cache, block_tables, seq_lens, scale, out, num_splits, kv_dtype,
                 nwarps=None, unroll=None, stages=None, chunks=None):
    cp = backend.xp
    batch, q_heads, d = q.shape
    kv_heads = cache.shape[3]
    fn, merge, threads, num_splits, split_tokens = _plan(
        q.shape, cache.shape, cache.itemsize, kv_dtype, block_tables.shape[1],
        num_splits, nwarps, unroll, stages, chunks)
    q, block_tables, seq_lens = _contiguous(q), _contiguous(block_tables), _contiguous(seq_lens)
    if out is None:
        out = cp.empty_like(q)
    elif not out.flags.c_contiguous:
        raise ConfigError("out must be C-contiguous")
    if num_splits > 1:
        n = batch * q_heads * num_splits
        scratch = _scratch(4 * n * (d + 1))
        part_o, part_lse = scratch[:n * d], scratch[n * d:n * (d + 1)]
    else:
        part_o = part_lse = out                          # unused by the kernel
    fn((num_splits, kv_heads, batch), (threads,),
       (q, cache, block_tables, seq_lens, out, part_o, part_lse, np.int32(kv_heads),
        np.int32(block_tables.shape[1]), np.int32(split_tokens),
        np.float32(scale * 1.4426950408889634)))       # log2(e): the kernel uses exp2
    if merge is not None:
        merge((batch * q_heads,), (min(d, 256),),
              (part_o, part_lse, out, np.int32(num_splits), np.int32(d)))
    return out


def paged_decode_attention(q, cache, block_tables, seq_lens, *, scale=None, out=None,
                           num_splits=None):
    """Attention of one new query token per sequence over its paged K/V.

    ``scale`` defaults to ``1/sqrt(head_dim)``. ``num_splits`` cuts each sequence into that many
    pieces handled in parallel and merged after (flash-decoding); by default it is chosen from
    batch × kv_heads against the GPU's size (and is 1 on NumPy). uint16 arrays are taken as
    bfloat16 bits (for CuPy builds without a bfloat16 dtype). ``out`` may be given.

    On NumPy arrays the kernel's algorithm runs in NumPy (float32 arithmetic) and checks lengths
    and table entries; on CuPy arrays they are trusted (checking them would stall the GPU).
    """
    kv_dtype = _check(q, cache, block_tables, seq_lens, out)
    if num_splits is not None and int(num_splits) < 1:
        raise ConfigError(f"num_splits must be ≥ 1, got {num_splits}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    if is_cupy(cache):
        return _decode_cupy(q, cache, block_tables, seq_lens, scale, out, num_splits, kv_dtype)
    res = _decode_numpy(q, cache, np.asarray(block_tables), np.asarray(seq_lens), scale,
                        int(num_splits or 1), kv_dtype)
    res = to_dtype(res, kv_dtype, q)
    if out is None:
        return res
    out[...] = res
    return out
