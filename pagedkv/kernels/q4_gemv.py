"""A few-row multiply that reads 4-bit weights: GGUF's Q4_1 blocks, dequantized in registers.

SmolLM2's GGUF file stores every projection as Q4_1: blocks of 32 weights, each block 20
bytes -- an fp16 scale ``d``, an fp16 minimum ``m`` and 16 bytes of 4-bit integers ``q``
(byte ``j`` holds ``q[j]`` in its low four bits, ``q[j + 16]`` in its high four) -- and
weight ``i`` is ``d * q[i] + m``. A decode step of a few rows reads each weight once, so
reading these 5 bits a weight instead of fp16's 16 cuts the projections' bytes to 31%
(SmolLM2-135M: 212 MB to 66 MB a step; the fp16 embedding, 57 MB, is still read by the
output head). :func:`q4_gemv` computes ``x @ dequantize(blocks).T`` without ever writing
the fp16 matrix: the kernel (``q4_gemv.cu``) widens each block in registers.

A matrix ``[N, K]`` is held as uint8 ``[N, K / 32 * 20]``: row ``n``'s blocks one after
another, exactly as the file stores them (``gguf.GGUFReader`` gives this array). On NumPy,
:func:`q4_gemv` dequantizes (:func:`dequantize_q4_1`) and multiplies in float32: the CPU
path and the kernel's oracle. :func:`quantize_q4_1` makes blocks from a float matrix the way
llama.cpp's reference quantizer does (round to nearest), so tests need no file.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ._common import (DTYPE_CODES, allow_dynamic_smem, dtype_name, is_cupy, kernel,
                      load_source, sm_count)

__all__ = ["q4_gemv", "dequantize_q4_1", "quantize_q4_1", "QK", "BLOCK_BYTES",
           "Q4_MAX_ROWS", "Q4_MAX_K", "Q4_GEMV_SOURCE"]

QK, BLOCK_BYTES = 32, 20   # weights a block; its bytes: d (fp16), m (fp16), 16 of q
Q4_MAX_ROWS = 8            # rows of x a launch takes
Q4_MAX_K = 4096            # the longest row: M * K float32 of x sit in shared memory
Q4_GEMV_SOURCE = "q4_gemv.cu"
#: Rows of the weight one warp computes at once, by rows of x, when the caller does not say
#: (1 for every M until perf/q4_check.py's sweep of 1, 2 and 4 on the H200 says otherwise).
ROWS_PER_WARP = {m: 1 for m in range(1, Q4_MAX_ROWS + 1)}


def _blocks_shape(blocks) -> tuple[int, int]:
    """(N, K) of a block array, checked."""
    if str(blocks.dtype) != "uint8" or blocks.ndim != 2 or blocks.shape[1] % BLOCK_BYTES:
        raise ConfigError(f"Q4_1 blocks must be uint8 [N, K / {QK} * {BLOCK_BYTES}], got "
                          f"{blocks.dtype} {tuple(blocks.shape)}")
    return blocks.shape[0], blocks.shape[1] // BLOCK_BYTES * QK


def dequantize_q4_1(blocks) -> np.ndarray:
    """float32 ``[N, K]`` from Q4_1 blocks uint8 ``[N, K / 32 * 20]`` (NumPy)."""
    n, k = _blocks_shape(blocks)
    b = np.ascontiguousarray(backend.to_numpy(blocks)).reshape(n, k // QK, BLOCK_BYTES)
    d = np.ascontiguousarray(b[..., 0:2]).view(np.float16).astype(np.float32)   # [n, k/32, 1]
    m = np.ascontiguousarray(b[..., 2:4]).view(np.float16).astype(np.float32)
    qs = b[..., 4:]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)  # low nibbles first
    return (d * q + m).reshape(n, k)


def quantize_q4_1(w) -> np.ndarray:
    """Q4_1 blocks of a float matrix ``[N, K]`` (K a multiple of 32), as llama.cpp's
    ``quantize_row_q4_1_ref``: per block, ``d = (max - min) / 15``, ``m = min``, and
    ``q = min(15, trunc((w - min) / d + 0.5))`` (round to nearest), in float32."""
    w = np.asarray(backend.to_numpy(w), np.float32)
    if w.ndim != 2 or w.shape[1] % QK:
        raise ConfigError(f"quantize_q4_1 takes [N, K] with K a multiple of {QK}, got "
                          f"{tuple(w.shape)}")
    n, k = w.shape
    blk = w.reshape(n, k // QK, QK)
    lo, hi = blk.min(axis=-1, keepdims=True), blk.max(axis=-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    q = np.minimum(15, ((blk - lo) * inv + np.float32(0.5)).astype(np.int32)).astype(np.uint8)
    packed = q[..., :QK // 2] | (q[..., QK // 2:] << 4)
    out = np.concatenate([d.astype(np.float16).view(np.uint8),
                          lo.astype(np.float16).view(np.uint8), packed], axis=-1)
    return out.reshape(n, k // QK * BLOCK_BYTES)


def q4_gemv(x, blocks, out, *, accumulate: bool = False,
            rows_per_warp: int | None = None):
    """``out = x @ dequantize_q4_1(blocks).T`` (``out +=`` with ``accumulate``), float32
    accumulation. ``x`` [M, K] with M at most 8; ``blocks`` uint8 [N, K / 32 * 20];
    ``out`` [M, N], x's dtype or float32. On a GPU ``rows_per_warp`` (1, 2 or 4; default
    ``ROWS_PER_WARP[M]``) is how many rows of the weight one warp computes at once. Returns
    ``out``."""
    n, k = _blocks_shape(blocks)
    if x.ndim != 2 or x.shape[1] != k or tuple(out.shape) != (x.shape[0], n):
        raise ConfigError(f"q4_gemv shapes do not fit: x {tuple(x.shape)}, blocks "
                          f"{tuple(blocks.shape)} (a [{n}, {k}] weight), out "
                          f"{tuple(out.shape)}")
    m = x.shape[0]
    if not 1 <= m <= Q4_MAX_ROWS or k > Q4_MAX_K:
        raise ConfigError(f"q4_gemv takes 1 to {Q4_MAX_ROWS} rows and K up to {Q4_MAX_K}; "
                          f"got x {tuple(x.shape)}")
    if out.dtype != x.dtype and str(out.dtype) != "float32":
        raise ConfigError(f"out must be float32 or x's dtype {x.dtype}, got {out.dtype}")
    if not is_cupy(x):
        prod = x.astype(np.float32) @ dequantize_q4_1(blocks).T
        if accumulate:
            prod += out
        out[...] = prod
        return out
    rows_per_warp = ROWS_PER_WARP[m] if rows_per_warp is None else rows_per_warp
    if rows_per_warp not in (1, 2, 4):
        raise ConfigError(f"rows_per_warp must be 1, 2 or 4, got {rows_per_warp!r}")
    for a, what in ((x, "x"), (blocks, "blocks"), (out, "out")):
        if not is_cupy(a) or not a.flags.c_contiguous:
            raise ConfigError(f"{what} must be a C-contiguous array on the device")
    name = (f"q4_gemv<{DTYPE_CODES[dtype_name(x)]}, {DTYPE_CODES[dtype_name(out)]}, {m}, "
            f"{rows_per_warp}>")
    fn = kernel(load_source(Q4_GEMV_SOURCE), name)
    smem = 4 * m * k
    allow_dynamic_smem(fn, smem)
    fn((min(cdiv(n, 8 * rows_per_warp), 8 * sm_count()),), (256,),
       (x, blocks, out, np.int32(k), np.int32(n), np.int32(accumulate)), shared_mem=smem)
    return out
