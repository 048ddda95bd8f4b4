"""The 8-bit K/V cache: int8 numbers, and a float16 scale for every 32 of them.

A head row of 64 numbers takes 68 bytes here (64 numbers and two scales) against 128 in
float16, so a decode step reads about half the bytes and a pool of the same size holds about
1.9 times the tokens. Why these 8 bits: on SmolLM2-135M, int8 with a scale per 32 numbers (the
numbers of llama.cpp's ``q8_0``) kept the float16 cache's top-1 choice more often than int8
with one scale per head row or e4m3 with either (``perf/kv8_accuracy.py``, ``perf/LOG.md``).

**Layout.** One layer's block is :func:`layer_block_bytes` bytes::

    values [2][block_size][kv_heads][head_dim]               int8: K (0) then V (1)
    scales [block_size][kv_heads][head_dim / 32][2]          float16: K's scale, V's scale

The values sit as the 16-bit cache's numbers do; the scales follow them in the same block, so
a block is still one stretch of bytes in every layer, named by one block id: copy-on-write
copies, swaps and transfers move its bytes and need to know nothing of what they mean. A
(K scale, V scale) pair is 4 bytes: one load brings a thread both scales of the 16 or 32
numbers it reads.

**Rounding** (the same in NumPy and in every CUDA kernel that writes the cache): a K or V row
of one head, as the model computed it in its own dtype, is cut into runs of 32 numbers. For
each run, ``amax = max |x|`` (float32), ``scale = float16(amax / 127)`` (nearest, ties to
even) and ``q = rint(x / scale)`` (IEEE division, ties to even), clamped to [-127, 127]; a run
of zeros has scale 0 and q 0. The stored number means ``q * scale``.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..errors import ConfigError
from ..spec import INT8, NUMS_PER_SCALE

__all__ = ["Cache8", "layer_block_bytes", "quantize", "dequantize", "store_rows",
           "read_rows", "dequantize_cache", "is_cache8", "NUMS_PER_SCALE", "INT8"]


def layer_block_bytes(block_size: int, kv_heads: int, head_dim: int) -> int:
    """Bytes of one block in one layer: the values, then the scales (a multiple of 16)."""
    return block_size * kv_heads * (2 * head_dim + head_dim // NUMS_PER_SCALE * 4)


def _xp(a):
    return backend.xp if backend.on_gpu and isinstance(a, backend.xp.ndarray) else np


def _view(raw, offset: int, shape, dtype, strides):
    """A view of ``raw``'s bytes from ``offset`` (NumPy or CuPy), no copy."""
    if _xp(raw) is np:
        return np.ndarray(shape, dtype, buffer=raw, offset=offset, strides=strides)
    cp = backend.xp
    return cp.ndarray(shape, dtype, memptr=raw.data + offset, strides=strides)


class Cache8:
    """One layer's 8-bit K/V: ``raw``, uint8 ``[num_blocks, layer_block_bytes]`` (C-contiguous:
    what the kernels are given), seen as ``values`` int8 ``[num_blocks, 2, block_size,
    kv_heads, head_dim]`` and ``scales`` float16 ``[num_blocks, block_size, kv_heads,
    head_dim / 32, 2]`` (views of ``raw``: writing them writes it). ``shape`` is the values'
    shape, the shape a 16-bit layer cache has."""

    dtype = np.dtype(np.int8)
    ndim = 5

    def __init__(self, raw, block_size: int, kv_heads: int, head_dim: int):
        bb = layer_block_bytes(block_size, kv_heads, head_dim)
        if head_dim % NUMS_PER_SCALE:
            raise ConfigError(f"an int8 cache needs head_dim a multiple of {NUMS_PER_SCALE}, "
                              f"got {head_dim}")
        if raw.ndim != 2 or raw.shape[1] != bb or str(raw.dtype) != "uint8" \
                or not raw.flags.c_contiguous:
            raise ConfigError(f"an int8 layer cache is C-contiguous uint8 [num_blocks, {bb}] "
                              f"for block_size {block_size}, kv_heads {kv_heads}, head_dim "
                              f"{head_dim}; got {raw.dtype} {tuple(raw.shape)}")
        self.raw = raw
        nb, h, d, g = raw.shape[0], kv_heads, head_dim, head_dim // NUMS_PER_SCALE
        self.shape = (nb, 2, block_size, h, d)
        self.values = _view(raw, 0, self.shape, np.int8,
                            (bb, block_size * h * d, h * d, d, 1))
        self.scales = _view(raw, 2 * block_size * h * d, (nb, block_size, h, g, 2),
                            np.float16, (bb, h * g * 4, g * 4, 4, 2))

    @classmethod
    def zeros(cls, num_blocks: int, block_size: int, kv_heads: int, head_dim: int, xp=None):
        xp = xp or backend.xp
        raw = xp.zeros((num_blocks, layer_block_bytes(block_size, kv_heads, head_dim)),
                       np.uint8)
        return cls(raw, block_size, kv_heads, head_dim)

    @property
    def block_size(self) -> int:
        return self.shape[2]

    @property
    def nbytes(self) -> int:
        return int(self.raw.nbytes)

    @property
    def flags(self):
        return self.raw.flags

    def copy(self) -> "Cache8":
        return Cache8(self.raw.copy(), *self.shape[2:])

    def __repr__(self) -> str:
        return (f"Cache8(num_blocks={self.shape[0]}, block_size={self.shape[2]}, "
                f"kv_heads={self.shape[3]}, head_dim={self.shape[4]}, "
                f"{'cupy' if _xp(self.raw) is not np else 'numpy'})")


def is_cache8(a) -> bool:
    return isinstance(a, Cache8)


def quantize(x):
    """``x`` ``[..., head_dim]`` (any float dtype, NumPy or CuPy) as int8 numbers ``[...,
    head_dim]`` and float16 scales ``[..., head_dim / 32]``, by the module's rounding."""
    xp = _xp(x)
    xf = x.astype(np.float32)
    runs = xf.reshape(*xf.shape[:-1], -1, NUMS_PER_SCALE)
    amax = xp.abs(runs).max(axis=-1)
    scale = (amax / np.float32(127)).astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    q = xp.where(s > 0, runs / xp.where(s > 0, s, np.float32(1)), np.float32(0))
    q = xp.clip(xp.rint(q), -127, 127).astype(np.int8)
    return q.reshape(xf.shape), scale


def dequantize(q, scale, dtype=np.float32):
    """What int8 numbers ``[..., head_dim]`` with their scales ``[..., head_dim / 32]`` mean,
    as ``dtype`` (``q * scale``: exact in float32)."""
    runs = q.astype(dtype).reshape(*q.shape[:-1], -1, NUMS_PER_SCALE)
    return (runs * scale.astype(dtype)[..., None]).reshape(q.shape)


def store_rows(cache: Cache8, blocks, offsets, k, v) -> None:
    """Quantize ``k``, ``v`` ``[n, kv_heads, head_dim]`` into token rows ``offsets`` of
    ``blocks`` (the NumPy reference of every kernel that writes an int8 cache)."""
    for kv, x in ((0, k), (1, v)):
        q, s = quantize(x)
        cache.values[blocks, kv, offsets] = q
        cache.scales[blocks, offsets, :, :, kv] = s


def read_rows(cache: Cache8, blocks, offsets, kv: int, dtype=np.float32):
    """Token rows ``offsets`` of ``blocks`` (K: ``kv`` 0, V: 1), ``[n, kv_heads, head_dim]``,
    dequantized to ``dtype``."""
    return dequantize(cache.values[blocks, kv, offsets], cache.scales[blocks, offsets, :, :, kv],
                      dtype)


def dequantize_cache(cache: Cache8, dtype=np.float64) -> np.ndarray:
    """The whole layer as a ``dtype`` NumPy array ``[num_blocks, 2, block_size, kv_heads,
    head_dim]`` (for the float64 oracles)."""
    values = backend.to_numpy(cache.values).astype(dtype)
    scales = backend.to_numpy(cache.scales).astype(dtype)       # [nb, bs, h, g, 2]
    nb, _, bs, h, d = cache.shape
    runs = values.reshape(nb, 2, bs, h, -1, NUMS_PER_SCALE)
    per = np.moveaxis(scales, -1, 1)[..., None]                  # [nb, 2, bs, h, g, 1]
    with np.errstate(invalid="ignore", over="ignore"):    # unwritten slots may hold junk
        return (runs * per).reshape(nb, 2, bs, h, d)

