"""The model's small operations fused into one kernel each, for the fast decode path.

The plain forward pass (:mod:`pagedkv.model.llama`) writes each operation of a layer as a
few array expressions: clear, and on a GPU about 60 kernel launches a layer. The fast path
(:mod:`pagedkv.model.runner`) does the same arithmetic in five launches besides the matrix
multiplies:

* :func:`rms_norm` — RMSNorm of each row, times the norm's weight;
* :func:`rope_write_kv` — rotary positions on q and k, straight out of the fused q|k|v
  projection, and k and v written into the paged cache at their slots (``write_kv``);
* :func:`silu_mul` — SwiGLU's ``SiLU(gate) * up``;
* :func:`embed` — the token embeddings' rows;
* :func:`argmax_rows` — greedy decoding's choice, on the device.

Each writes into an ``out`` array it is given (a CUDA graph replays fixed addresses) and runs
on NumPy arrays as its reference: the same arithmetic, written plainly, which is both the CPU
path and the oracle the CUDA kernels are tested against. The references in turn are tested
against the plain model's own methods.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..errors import ConfigError
from ._common import DTYPE_CODES, dtype_name, is_cupy, kernel, load_source
from .kv8 import Cache8, store_rows
from .pdl import launch

__all__ = ["rms_norm", "rope_write_kv", "silu_mul", "embed", "argmax_rows", "FUSED_SOURCE"]

FUSED_SOURCE = "fused.cu"


def _fn(name: str, a):
    return kernel(load_source(FUSED_SOURCE), f"{name}<{DTYPE_CODES[dtype_name(a)]}>")


def _out(out, shape, dtype, like):
    if out is None:
        return (backend.xp if is_cupy(like) else np).empty(shape, dtype)
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        raise ConfigError(f"out must be {tuple(shape)} {np.dtype(dtype)}, got "
                          f"{tuple(out.shape)} {out.dtype}")
    return out


def rms_norm(x, w, eps: float, out=None):
    """``x / sqrt(mean(x**2) + eps) * w`` for each row of ``x`` [rows, width]; the product
    before ``w`` rounded to x's dtype, as :meth:`pagedkv.model.llama.Llama.rms_norm` does."""
    out = _out(out, x.shape, x.dtype, x)
    if is_cupy(x):
        _fn("rms_norm", x)((x.shape[0],), (256,),
                           (x, w, out, np.int32(x.shape[1]), np.float32(eps)))
        return out
    x32 = x.astype(np.float32)
    r = 1.0 / np.sqrt((x32 * x32).mean(axis=-1, keepdims=True) + np.float32(eps))
    out[...] = (x32 * r).astype(x.dtype) * w
    return out


def rope_write_kv(qkv, positions, slots, cos, sin, q_out, cache, q_heads: int,
                  kv_heads: int):
    """Rotary positions on q and k, and k, v into ``cache`` at ``slots``.

    ``qkv`` [tokens, (q_heads + 2 kv_heads) * D] is the fused projection's output (q, k, v
    side by side); ``positions`` and ``slots`` int32 [tokens] (a negative slot is padding:
    nothing is written); ``cos``, ``sin`` float32 [context, D / 2]; ``q_out`` [tokens,
    q_heads, D] receives the rotated q; ``cache`` is one layer's [num_blocks, 2, block_size,
    kv_heads, D], or an int8 :class:`~pagedkv.kernels.kv8.Cache8`, into which the rotated k
    (rounded to qkv's dtype, as a 16-bit cache would hold it) and v are quantized. The slots
    are trusted (they come from the manager's plan).
    """
    d = q_out.shape[2]
    if is_cupy(qkv) and isinstance(cache, Cache8):
        if d % 64 or d > 256:
            raise ConfigError(f"rope_write_kv writes an int8 cache for head_dim a multiple "
                              f"of 64 up to 256, got {d}")
        _fn("rope_write_kv8", qkv)(                       # a warp per k or v head row
            (qkv.shape[0],), (128,),
            (qkv, positions, slots, cos, sin, q_out, cache.raw, np.int32(q_heads),
             np.int32(kv_heads), np.int32(d), np.int32(cache.shape[2])))
        return q_out
    if is_cupy(qkv):
        _fn("rope_write_kv", qkv)(
            (qkv.shape[0],), (128,),
            (qkv, positions, slots, cos, sin, q_out, cache, np.int32(q_heads),
             np.int32(kv_heads), np.int32(d), np.int32(cache.shape[2])))
        return q_out
    t, half = qkv.shape[0], d // 2
    heads = qkv[:, :(q_heads + kv_heads) * d].reshape(t, q_heads + kv_heads, d)
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    x1, x2 = heads[..., :half].astype(np.float32), heads[..., half:].astype(np.float32)
    rotated = np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(qkv.dtype)
    q_out[...] = rotated[:, :q_heads]
    keep = slots >= 0
    block_size = cache.shape[2]
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    k, v = rotated[keep, q_heads:], qkv[keep, (q_heads + kv_heads) * d:].reshape(-1, kv_heads, d)
    if isinstance(cache, Cache8):
        store_rows(cache, blocks, offsets, k, v)
        return q_out
    cache[blocks, 0, offsets] = k
    cache[blocks, 1, offsets] = v
    return q_out


def silu_mul(gate_up, out=None):
    """``SiLU(gate) * up`` for ``gate_up`` [tokens, 2 ffn] (gate first), in float32, rounded
    once to the input's dtype."""
    t, ffn = gate_up.shape[0], gate_up.shape[1] // 2
    out = _out(out, (t, ffn), gate_up.dtype, gate_up)
    if is_cupy(gate_up):
        total = t * ffn
        _fn("silu_mul", gate_up)(((total + 255) // 256,), (256,),
                                 (gate_up, out, np.int32(ffn), np.int64(total)))
        return out
    g, u = gate_up[:, :ffn].astype(np.float32), gate_up[:, ffn:].astype(np.float32)
    out[...] = (g / (1.0 + np.exp(-g)) * u).astype(gate_up.dtype)
    return out


def embed(tokens, table, out=None):
    """Rows ``table[tokens]`` (``tokens`` int32 [T], ``table`` [vocab, width])."""
    out = _out(out, (tokens.shape[0], table.shape[1]), table.dtype, table)
    if is_cupy(table):
        launch(_fn("embed", table), (tokens.shape[0],), (256,),
               (tokens, table, out, np.int32(table.shape[1])))
        return out
    out[...] = table[tokens]
    return out


def argmax_rows(logits, out=None):
    """int32 index of each row's largest value (the first of equals), ``logits`` float32."""
    if str(logits.dtype) != "float32":
        raise ConfigError(f"logits must be float32, got {logits.dtype}")
    out = _out(out, (logits.shape[0],), np.int32, logits)
    if is_cupy(logits):
        fn = kernel(load_source(FUSED_SOURCE), "argmax_rows")
        launch(fn, (logits.shape[0],), (1024,), (logits, out, np.int32(logits.shape[1])))
        return out
    out[...] = np.argmax(logits, axis=1)
    return out
