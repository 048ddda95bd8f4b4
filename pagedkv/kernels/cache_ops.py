"""Moving K/V bytes: ``write_kv`` scatters new tokens into their slots, ``copy_blocks`` copies
whole blocks for copy-on-write. Both move bytes and do no arithmetic, so their speed limit is the
GPU's memory bandwidth; the kernels below try to reach it.

Layout (shared with the memory manager): one layer's cache is an array
``[num_blocks, 2, block_size, kv_heads, head_dim]``; index 0 of axis 1 holds K, index 1 holds V.
A *slot* is ``block * block_size + offset``. The slot rule, the same on NumPy and CuPy: a
negative slot is padding and is skipped (−1 by convention); a slot at or past
``num_blocks * block_size`` raises :class:`~pagedkv.errors.ConfigError` and nothing is written.

An int8 cache (:class:`~pagedkv.kernels.kv8.Cache8`) takes the same calls: ``write_kv``
quantizes as it writes (``write_kv8`` in ``fused.cu``: a warp per head row finds its runs'
largest numbers, then rounds), ``copy_blocks`` copies its blocks' bytes, scales and all.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ._common import (DTYPE_CODES, INT8, check_cache, check_int32, dtype_name, is_cupy, kernel,
                      load_source)
from .kv8 import Cache8, store_rows

__all__ = ["write_kv", "write_kv_ref", "copy_blocks", "copy_blocks_ref", "CACHE_OPS_SOURCE"]

CACHE_OPS_SOURCE = r"""
// A GPU runs a kernel as a grid of thread blocks ("CTAs"); every thread runs the same function
// and finds its own piece of work from its indices: threadIdx.x (0 .. blockDim.x-1 inside the
// block) and blockIdx.x/.y (which block of the grid). Memory is fastest when the 32 threads of a
// warp touch one contiguous stretch, and when each thread moves 16 bytes at once: the type
// `Vec` below is such a chunk (uint4 = four 32-bit words), or a narrower one when a row is not a
// multiple of 16 bytes. Neither kernel looks at the values: K and V are just bytes here.

// write_kv: token t's K row and V row (kv_heads * head_dim elements each) go to its slot.
//   k, v         [num_tokens][row_vecs]           the new keys and values
//   slot_mapping [num_tokens]                      slot = block * block_size + offset; < 0: skip
//   cache        [num_blocks][2][block_size][row_vecs]
// One thread copies one Vec of K and the same Vec of V; the grid covers tokens x row_vecs.
template <typename Vec>
__global__ void write_kv(const Vec* __restrict__ k, const Vec* __restrict__ v,
                         const int* __restrict__ slot_mapping, Vec* __restrict__ cache,
                         long long total, int row_vecs, int block_size, long long num_slots) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;  // this thread's Vec
    if (i >= total) return;                 // the last block of the grid may overhang
    int token = (int)(i / row_vecs);        // which token
    int c = (int)(i - (long long)token * row_vecs);  // which Vec of that token's row
    int slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;  // padding (the host refuses slots past the end)
    long long block = slot / block_size, offset = slot % block_size;
    // Row `offset` of the K half of `block`, then the same row of the V half, one block_size later.
    long long k_row = (block * 2 * block_size + offset) * row_vecs;
    long long v_row = k_row + (long long)block_size * row_vecs;
    Vec kk = k[i], vv = v[i];               // both loads are issued before either store
    cache[k_row + c] = kk;
    cache[v_row + c] = vv;
}

// copy_blocks: for every pair (src, dst) and every layer, block dst becomes a copy of block src.
//   caches  [layers]   the address of each layer's cache (all the same shape)
//   pairs   [n][2]     (src, dst) block ids
// A block is cut into chunks of blockDim.x * UNROLL Vecs; one CTA copies one chunk:
// blockIdx.x = pair * chunks + chunk, blockIdx.y = layer. Each thread first loads its UNROLL
// Vecs, then stores them, so several loads are in flight at once (memory answers a few hundred
// nanoseconds after it is asked; many small CTAs keep the GPU full, as in write_kv).
template <typename Vec, int UNROLL>
__global__ void copy_blocks(const unsigned long long* __restrict__ caches,
                            const int* __restrict__ pairs, int block_vecs, int chunks) {
    const int pair = blockIdx.x / chunks, chunk = blockIdx.x % chunks;
    Vec* cache = reinterpret_cast<Vec*>(caches[blockIdx.y]);
    const Vec* src = cache + (long long)pairs[2 * pair] * block_vecs;
    Vec* dst = cache + (long long)pairs[2 * pair + 1] * block_vecs;
    const int base = chunk * blockDim.x * UNROLL + threadIdx.x;
    Vec buf[UNROLL];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {   // all loads first ...
        int j = base + u * blockDim.x;
        if (j < block_vecs) buf[u] = src[j];
    }
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {   // ... then all stores
        int j = base + u * blockDim.x;
        if (j < block_vecs) dst[j] = buf[u];
    }
}
"""

_VEC_TYPES = ((16, "uint4"), (8, "uint2"), (4, "unsigned int"), (2, "unsigned short"))


def _vec(row_bytes: int, *arrays) -> tuple[int, str]:
    """The widest chunk (16, 8, 4 or 2 bytes) that divides a row and every array's address."""
    for width, ctype in _VEC_TYPES:
        if row_bytes % width == 0 and all(a.data.ptr % width == 0 for a in arrays):
            return width, ctype
    raise ConfigError(f"rows of {row_bytes} bytes cannot be copied in 2-byte units")


# --------------------------------------------------------------------------- write_kv

def _check_write(cache, k, v, slot_mapping):
    dtype = check_cache(cache)
    _, _, block_size, kv_heads, head_dim = cache.shape
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 3 or tuple(a.shape[1:]) != (kv_heads, head_dim):
            raise ConfigError(f"{name} must have shape [tokens, {kv_heads}, {head_dim}] to match "
                              f"the cache, got {tuple(a.shape)}")
        if dtype == INT8:
            dtype_name(a)                 # int8 caches quantize any float dtype
        elif a.dtype != cache.dtype:
            raise ConfigError(f"{name} has dtype {a.dtype}, the cache {cache.dtype}")
    if k.shape != v.shape:
        raise ConfigError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    check_int32(slot_mapping, "slot_mapping", 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ConfigError(f"slot_mapping has {slot_mapping.shape[0]} entries for "
                          f"{k.shape[0]} tokens")
    return dtype


def _check_slots(slots, num_slots: int) -> None:
    """Refuse a slot at or past the end of the cache (negative slots are padding)."""
    top = int(slots.max()) if slots.size else -1     # on CuPy: one read back from the device
    if top >= num_slots:
        raise ConfigError(f"slot_mapping holds slot {top}, past the cache's "
                          f"{num_slots} slots (num_blocks * block_size); negative slots are "
                          "padding, larger ones are errors")


def write_kv_ref(cache, k, v, slot_mapping):
    """NumPy reference: ``cache[slot // B, 0, slot % B] = k[t]`` (and V) for every slot ≥ 0."""
    _check_write(cache, k, v, slot_mapping)
    num_blocks, _, block_size = cache.shape[:3]
    slots = np.asarray(slot_mapping)
    _check_slots(slots, num_blocks * block_size)
    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    if isinstance(cache, Cache8):
        store_rows(cache, blocks, offsets, k[keep], v[keep])
        return cache
    cache[blocks, 0, offsets] = k[keep]
    cache[blocks, 1, offsets] = v[keep]
    return cache


def write_kv(cache, k, v, slot_mapping, *, validate=True):
    """Write ``k``, ``v`` ``[tokens, kv_heads, head_dim]`` into ``cache`` at the slots.

    Negative slots are padding and are skipped; a slot ≥ ``num_blocks * block_size``
    raises :class:`ConfigError` before anything is written. Works on NumPy arrays (the
    reference) and on CuPy arrays (one kernel launch). On the GPU the slot mapping may be
    a NumPy array (the manager's plans are: it is checked on the host, then uploaded) or
    a CuPy array (checked on the device, which costs one synchronisation).
    ``validate=False`` (GPU only) skips that check, for slots a manager plan produced or
    to time the kernel alone: the kernel then skips a slot past the end instead of
    raising. Returns ``cache``, modified in place.
    """
    if not is_cupy(cache):
        return write_kv_ref(cache, k, v, slot_mapping)
    cp = backend.xp
    _check_write(cache, k, v, slot_mapping)
    if validate:
        _check_slots(slot_mapping, cache.shape[0] * cache.shape[2])
    k, v = cp.ascontiguousarray(k), cp.ascontiguousarray(v)
    slot_mapping = cp.ascontiguousarray(cp.asarray(slot_mapping))
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return cache
    if isinstance(cache, Cache8):
        _, _, block_size, kv_heads, head_dim = cache.shape
        rows = 2 * num_tokens * kv_heads                 # a warp per K or V head row
        fn = kernel(load_source("fused.cu"), f"write_kv8<{DTYPE_CODES[dtype_name(k)]}>")
        fn(((rows + 3) // 4,), (128,),
           (k, v, slot_mapping, cache.raw, np.int32(num_tokens), np.int32(kv_heads),
            np.int32(head_dim), np.int32(block_size), np.int64(cache.shape[0] * block_size)))
        return cache
    row_bytes = cache.shape[3] * cache.shape[4] * cache.itemsize
    width, ctype = _vec(row_bytes, cache, k, v)
    row_vecs = row_bytes // width
    total = num_tokens * row_vecs
    threads = 256
    fn = kernel(CACHE_OPS_SOURCE, f"write_kv<{ctype}>")
    fn(((total + threads - 1) // threads,), (threads,),
       (k, v, slot_mapping, cache, np.int64(total), np.int32(row_vecs),
        np.int32(cache.shape[2]), np.int64(cache.shape[0] * cache.shape[2])))
    return cache


# --------------------------------------------------------------------------- copy_blocks

def _as_layers(cache):
    layers = list(cache) if isinstance(cache, (list, tuple)) else [cache]
    layers = [a.raw if isinstance(a, Cache8) else a for a in layers]   # int8: its bytes
    if not layers:
        raise ConfigError("copy_blocks needs at least one cache")
    first = layers[0]
    if first.ndim < 1:
        raise ConfigError("a cache must have a block axis (axis 0)")
    for a in layers[1:]:
        if a.shape != first.shape or a.dtype != first.dtype or type(a) is not type(first):
            raise ConfigError("all layers' caches must have the same shape, dtype and array type; "
                              f"got {tuple(first.shape)} {first.dtype} and {tuple(a.shape)} {a.dtype}")
    return layers


def _check_pairs(pairs, num_blocks: int) -> np.ndarray:
    """Pairs come from the manager's plan (host memory): validate them on the host."""
    p = backend.to_numpy(pairs)
    check_int32(p, "pairs", 2)
    if p.shape[1] != 2:
        raise ConfigError(f"pairs must have shape [n, 2] of (src, dst), got {tuple(p.shape)}")
    if p.size and (p.min() < 0 or p.max() >= num_blocks):
        raise ConfigError(f"pairs hold a block id outside [0, {num_blocks})")
    if len(np.unique(p[:, 1])) != len(p) or np.intersect1d(p[:, 0], p[:, 1]).size:
        raise ConfigError("each destination block must appear once and never as a source "
                          "(the copies run in parallel)")
    return np.ascontiguousarray(p)


def copy_blocks_ref(cache, pairs):
    """NumPy reference: ``cache[dst] = cache[src]`` for each pair (and for each layer in a list)."""
    layers = _as_layers(cache)
    p = _check_pairs(pairs, layers[0].shape[0])
    for layer in layers:
        layer[p[:, 1]] = layer[p[:, 0]]
    return cache


def copy_blocks(cache, pairs, *, validate=True):
    """Copy block ``src`` onto block ``dst`` for every row of ``pairs`` (int32 ``[n, 2]``).

    ``cache`` is one layer's cache or a list/tuple of them (one per layer); axis 0 is the block
    axis. On the GPU all pairs of all layers are copied by one kernel launch. Destinations must be
    distinct and must not be sources. Returns ``cache``.

    ``validate=False`` (GPU only) skips the host-side check of the pairs and accepts them
    already on the device: for pairs a :class:`~pagedkv.manager.KVCacheManager` plan produced
    (it guarantees them), or to time the kernel alone.
    """
    layers = _as_layers(cache)
    if not is_cupy(layers[0]):
        return copy_blocks_ref(cache, pairs)
    if validate:
        pairs = _check_pairs(pairs, layers[0].shape[0])
    if pairs.shape[0] == 0:
        return cache
    for a in layers:
        if not a.flags.c_contiguous:
            raise ConfigError("every cache must be C-contiguous")
    _copy_blocks_launch(layers, backend.xp.asarray(pairs))
    return cache


@functools.lru_cache(maxsize=64)
def _pointer_table(ptrs: tuple):
    """The layers' addresses as a device array, made once per set of caches: an upload per call
    would be a host-to-device copy that waits for the GPU to finish its earlier work."""
    return backend.xp.asarray(np.array(ptrs, dtype=np.uint64))


def _copy_blocks_launch(layers, pairs):
    """The launch alone: ``pairs`` already checked and on the GPU (int32 [n, 2])."""
    block_bytes = layers[0].nbytes // layers[0].shape[0]
    width, ctype = _vec(block_bytes, *layers)
    ptrs = _pointer_table(tuple(a.data.ptr for a in layers))
    threads, unroll = 256, 2
    block_vecs = block_bytes // width
    chunks = cdiv(block_vecs, threads * unroll)
    fn = kernel(CACHE_OPS_SOURCE, f"copy_blocks<{ctype}, {unroll}>")
    fn((pairs.shape[0] * chunks, len(layers)), (threads,),
       (ptrs, pairs, np.int32(block_vecs), np.int32(chunks)))
