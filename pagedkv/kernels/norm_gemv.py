"""RMSNorm folded into the projection that follows it: one launch where there were two.

At batch 1 the decode step is bound by its kernel count (chapter 12), and a third of a layer's
launches do little arithmetic: two RMSNorms and SwiGLU's ``SiLU(gate) * up`` each read a row
of a few hundred numbers and write it back. :func:`norm_gemv` does ``rms_norm(x) @ w.T`` in
one kernel (``norm_gemv.cu``): the few-row multiply of ``gemv.cu``, whose CTAs normalize the
rows themselves as they load them; with ``silu=True`` it also applies SwiGLU to the two halves
of the product, so a layer's MLP is two launches (this one and the down projection).
:func:`norm_gemv_rope` is the attention's side: the q|k|v projection with rotary positions
and the K/V write (:func:`~pagedkv.kernels.fused.rope_write_kv`) done by the CTAs that compute
each head's numbers, so norm, projection, RoPE and K/V write are one launch.

The arithmetic is the unfused path's, rounding for rounding, so on NumPy :func:`norm_gemv` is
literally the three calls it replaces (:func:`~pagedkv.kernels.fused.rms_norm`, the product,
:func:`~pagedkv.kernels.fused.silu_mul`), and :func:`norm_gemv_rope` the two it replaces
(:func:`norm_gemv`, :func:`~pagedkv.kernels.fused.rope_write_kv`): the references, and the
CPU path. On a GPU each is tested against the launches it replaces.
"""
from __future__ import annotations

import importlib.resources

import numpy as np

from ..checks import cdiv
from ..errors import ConfigError
from ._common import (DTYPE_CODES, check_int32, dtype_name, is_cupy, kernel, load_source,
                      sm_count)
from .fused import FUSED_SOURCE, rms_norm, rope_write_kv, silu_mul
from .kv8 import Cache8
from .gemm import GEMV_MAX_ROWS, gemv_outputs_per_warp
from .pdl import launch

__all__ = ["norm_gemv", "norm_gemv_rope", "norm_gemv_rope_unfused", "NORM_GEMV_SOURCE"]

NORM_GEMV_SOURCE = "norm_gemv.cu"
NORM_MAX_K = 1024          # the longest row norm_gemv.cu keeps in shared memory


def _source() -> str:
    """fused.cu's helpers (``round_to``, ``cta_sum``), gemv.cu's (``dots_rows``), then
    this kernel."""
    here = importlib.resources.files(__package__)
    return "\n".join([load_source(FUSED_SOURCE), here.joinpath("gemv.cu").read_text(),
                      here.joinpath(NORM_GEMV_SOURCE).read_text()])


def norm_gemv(x, norm_w, eps: float, w, out, *, silu: bool = False):
    """``out = rms_norm(x, norm_w, eps) @ w.T``; with ``silu``, ``out = SiLU(g) * u`` where
    ``[g | u]`` is that product (``w`` holds gate's rows, then up's).

    ``x`` [M, K] (M at most 8, K a multiple of 8 up to 1024), ``w`` [N, K] ([2N, K] with
    ``silu``), ``out`` [M, N], float32 or x's dtype. Returns ``out``."""
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    if w.shape[1] != k or tuple(out.shape) != (m, n) or (silu and w.shape[0] % 2):
        raise ConfigError(f"norm_gemv shapes do not fit: x {tuple(x.shape)}, w "
                          f"{tuple(w.shape)}, out {tuple(out.shape)}"
                          f"{' (silu: w holds 2 N rows)' if silu else ''}")
    if not is_cupy(x):
        h = rms_norm(x, norm_w, eps)
        if not silu:
            out[...] = h @ w.T
            return out
        return silu_mul((h @ w.T).astype(x.dtype), out=out)
    _check_launch(x, (x, "x"), (w, "w"), (out, "out"))
    dt, dt_out = DTYPE_CODES[dtype_name(x)], DTYPE_CODES[dtype_name(out)]
    r = 1 if silu else gemv_outputs_per_warp(m)
    fn = kernel(_source(), f"norm_gemv_t<{dt}, {dt_out}, {m}, {int(silu)}, {r}>")
    launch(fn, (min(cdiv(n, 8 * r), 8 * sm_count()),), (256,),
           (x, norm_w, np.float32(eps), w, out, np.int32(k), np.int32(n)))
    return out


def _check_launch(x, *arrays):
    """What the CUDA kernels need beyond fitting shapes."""
    m, k = x.shape
    if m > GEMV_MAX_ROWS or k % 8 or k > NORM_MAX_K:
        raise ConfigError(f"norm_gemv takes at most {GEMV_MAX_ROWS} rows and K a multiple "
                          f"of 8 up to {NORM_MAX_K}; got x {tuple(x.shape)}")
    for a, what in arrays:
        if not a.flags.c_contiguous:
            raise ConfigError(f"{what} must be C-contiguous")


def norm_gemv_rope(x, norm_w, eps: float, w, qkv, positions, slots, cos, sin, q_out, cache,
                   q_heads: int, kv_heads: int):
    """``norm_gemv(x, norm_w, eps, w, qkv)`` then ``rope_write_kv(qkv, positions, slots,
    cos, sin, q_out, cache, q_heads, kv_heads)``, in one launch on a GPU: the same bits in
    ``qkv``, ``q_out`` and ``cache``. The arguments are those two functions'; every array
    but ``positions``, ``slots`` (int32), ``cos``, ``sin`` (float32) and an int8 ``cache``
    (:class:`~pagedkv.kernels.kv8.Cache8`: ``norm_gemv_rope8_t``, a CTA per k or v head)
    has x's dtype. Returns ``q_out``."""
    m, k = x.shape
    d = q_out.shape[-1]
    n = (q_heads + 2 * kv_heads) * d
    if (tuple(w.shape) != (n, k) or tuple(qkv.shape) != (m, n)
            or tuple(q_out.shape) != (m, q_heads, d)
            or tuple(cache.shape[3:]) != (kv_heads, d)
            or d % 2 or tuple(cos.shape[1:]) != (d // 2,) or cos.shape != sin.shape):
        raise ConfigError(f"norm_gemv_rope shapes do not fit: x {tuple(x.shape)}, w "
                          f"{tuple(w.shape)}, qkv {tuple(qkv.shape)}, q_out "
                          f"{tuple(q_out.shape)}, cache {tuple(cache.shape)}, cos "
                          f"{tuple(cos.shape)}, sin {tuple(sin.shape)} for {q_heads} q heads "
                          f"and {kv_heads} kv heads")
    for a, what in ((positions, "positions"), (slots, "slots")):
        check_int32(a, what, 1)
        if a.shape[0] != m:
            raise ConfigError(f"{what} must have one entry per row of x ({m}), got "
                              f"{a.shape[0]}")
    if not is_cupy(x):
        return norm_gemv_rope_unfused(x, norm_w, eps, w, qkv, positions, slots, cos, sin,
                                      q_out, cache, q_heads, kv_heads)
    _check_launch(x, (x, "x"), (w, "w"), (qkv, "qkv"), (q_out, "q_out"), (cache, "cache"),
                  (positions, "positions"), (slots, "slots"), (cos, "cos"), (sin, "sin"))
    int8 = isinstance(cache, Cache8)
    dts = {dtype_name(a) for a in (x, norm_w, w, qkv, q_out) + (() if int8 else (cache,))}
    if len(dts) > 1 or str(cos.dtype) != "float32" or str(sin.dtype) != "float32":
        raise ConfigError(f"norm_gemv_rope takes x, norm_w, w, qkv, q_out and cache in one "
                          f"dtype (got {sorted(dts)}) and float32 cos, sin (got {cos.dtype}, "
                          f"{sin.dtype})")
    block_size, buf = cache.shape[2], cache.raw if int8 else cache
    if int8:                            # k and v heads a CTA each, then q's pairs
        if d % 64 or d > 256:
            raise ConfigError(f"norm_gemv_rope writes an int8 cache for head_dim a multiple "
                              f"of 64 up to 256, got {d}")
        fn = kernel(_source(), f"norm_gemv_rope8_t<{DTYPE_CODES[dtype_name(x)]}, {m}>")
        grid = 2 * kv_heads + min(cdiv(q_heads * d // 2, 8), 8 * sm_count())
    else:
        fn = kernel(_source(), f"norm_gemv_rope_t<{DTYPE_CODES[dtype_name(x)]}, {m}>")
        grid = min(cdiv(n // 2, 8), 8 * sm_count())
    launch(fn, (grid,), (256,),
           (x, norm_w, np.float32(eps), w, qkv, positions, slots, cos, sin, q_out, buf,
            np.int32(k), np.int32(q_heads), np.int32(kv_heads), np.int32(d),
            np.int32(block_size)))
    return q_out


def norm_gemv_rope_unfused(x, norm_w, eps: float, w, qkv, positions, slots, cos, sin, q_out,
                           cache, q_heads: int, kv_heads: int):
    """What :func:`norm_gemv_rope` replaces, as two calls (two launches on a GPU): its
    NumPy path, and what the GPU kernel is tested and timed against."""
    norm_gemv(x, norm_w, eps, w, qkv)
    return rope_write_kv(qkv, positions, slots, cos, sin, q_out, cache, q_heads, kv_heads)
