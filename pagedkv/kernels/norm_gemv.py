"""RMSNorm folded into the projection that follows it: one launch where there were two.

At batch 1 the decode step is bound by its kernel count (chapter 12), and a third of a layer's
launches do little arithmetic: two RMSNorms and SwiGLU's ``SiLU(gate) * up`` each read a row
of a few hundred numbers and write it back. :func:`norm_gemv` does ``rms_norm(x) @ w.T`` in
one kernel (``norm_gemv.cu``): the few-row multiply of ``gemv.cu``, whose CTAs normalize the
rows themselves as they load them; with ``silu=True`` it also applies SwiGLU to the two halves
of the product, so a layer's MLP is two launches (this one and the down projection).

The arithmetic is the unfused path's, rounding for rounding, so on NumPy :func:`norm_gemv` is
literally the three calls it replaces (:func:`~pagedkv.kernels.fused.rms_norm`, the product,
:func:`~pagedkv.kernels.fused.silu_mul`): the reference, and the CPU path. On a GPU it is
tested against those three launches.
"""
from __future__ import annotations

import importlib.resources

import numpy as np

from ..checks import cdiv
from ..errors import ConfigError
from ._common import DTYPE_CODES, dtype_name, is_cupy, kernel, load_source, sm_count
from .fused import FUSED_SOURCE, rms_norm, silu_mul
from .gemm import GEMV_MAX_ROWS

__all__ = ["norm_gemv", "NORM_GEMV_SOURCE"]

NORM_GEMV_SOURCE = "norm_gemv.cu"
NORM_MAX_K = 1024          # the longest row norm_gemv.cu keeps in shared memory


def _source() -> str:
    """fused.cu's helpers (``round_to``, ``cta_sum``), then this kernel."""
    here = importlib.resources.files(__package__)
    return load_source(FUSED_SOURCE) + "\n" + here.joinpath(NORM_GEMV_SOURCE).read_text()


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
    if m > GEMV_MAX_ROWS or k % 8 or k > NORM_MAX_K:
        raise ConfigError(f"norm_gemv takes at most {GEMV_MAX_ROWS} rows and K a multiple "
                          f"of 8 up to {NORM_MAX_K}; got x {tuple(x.shape)}")
    for a, what in ((x, "x"), (w, "w"), (out, "out")):
        if not a.flags.c_contiguous:
            raise ConfigError(f"{what} must be C-contiguous")
    dt, dt_out = DTYPE_CODES[dtype_name(x)], DTYPE_CODES[dtype_name(out)]
    fn = kernel(_source(), f"norm_gemv_t<{dt}, {dt_out}, {m}, {int(silu)}>")
    fn((min(cdiv(n, 8), 8 * sm_count()),), (256,),
       (x, norm_w, np.float32(eps), w, out, np.int32(k), np.int32(n)))
    return out
