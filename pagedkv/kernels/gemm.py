"""Matrix multiplies that a CUDA graph can hold: cuBLAS called directly.

``cupy.matmul`` calls cuBLAS too, but CuPy refuses its own cuBLAS calls while a stream is
being captured into a graph (it sets the handle's stream first, and that step raises during a
capture). cuBLAS itself captures fine, so :func:`gemm` calls ``cublasGemmEx`` through
:mod:`ctypes`, on a cuBLAS handle of its own, in the same library CuPy loaded. Chosen over
nvmath-python (NVIDIA's bindings, which also work) because it needs no package beyond CuPy's
own. For a single row a kernel of our own (``gemv.cu``) is a little faster; from a few rows
up cuBLAS is (perf/LOG.md).

Row-major arrays as NumPy lays them out; cuBLAS thinks in columns, so ``C = A @ B`` is asked
for as ``C^T = B^T A^T``, which is the same bytes. ``accumulate=True`` adds the product to
``out`` (cuBLAS's ``beta = 1``): the residual add after a layer's output projection costs no
launch of its own. On NumPy arrays the same call is ``numpy.matmul``.
"""
from __future__ import annotations

import ctypes
import functools

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ._common import DTYPE_CODES, dtype_name, is_cupy, kernel, load_source, sm_count
from .pdl import launch

__all__ = ["gemm"]

# cuBLAS's numbers for what we use (cublas_api.h, library_types.h)
_OP_N, _OP_T = 0, 1
_CUDA_TYPE = {"float32": 0, "float16": 2, "bfloat16": 14}
_COMPUTE_32F = 68
_GEMM_DEFAULT = -1
_WORKSPACE_BYTES = 32 << 20


def _loaded_library(stem: str) -> str:
    """The path of the shared library ``stem`` (e.g. ``libcublas.so``) this process loaded."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            name = path.rsplit("/", 1)[-1]
            if name.startswith(stem):
                return path
    raise ConfigError(f"{stem} is not loaded in this process")


class _Cublas:
    """One cuBLAS handle, its workspace, and the two functions we call."""

    def __init__(self):
        cp = backend.xp
        a = cp.ones((2, 2), cp.float32)
        (a @ a).sum().get()                           # make CuPy load its libcublas
        lib = self.lib = ctypes.CDLL(_loaded_library("libcublas.so"))
        self.handle = ctypes.c_void_p()
        self._check(lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        # A workspace of our own, so that cuBLAS never allocates while a graph is captured.
        self.workspace = cp.empty(_WORKSPACE_BYTES, cp.uint8)
        self._check(lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(
            self.workspace.data.ptr), ctypes.c_size_t(_WORKSPACE_BYTES)), "cublasSetWorkspace")
        f = lib.cublasGemmEx
        vp, i = ctypes.c_void_p, ctypes.c_int
        f.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        f.restype = i
        self.gemm_ex = f
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise ConfigError(f"{what} failed with cuBLAS status {status}")

    def set_stream(self, stream_ptr: int) -> None:
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)),
                    "cublasSetStream")


@functools.lru_cache(maxsize=None)
def _cublas() -> _Cublas:
    return _Cublas()


def _rows(a, name: str):
    if a.ndim != 2 or not a.flags.c_contiguous:
        raise ConfigError(f"{name} must be a C-contiguous matrix, got shape {tuple(a.shape)}")
    return a.shape


#: The most rows the few-row kernel (``gemv.cu``) takes, and the longest row (its shared
#: memory); ``"auto"`` takes it up to GEMV_AUTO_ROWS rows, where it beat cuBLAS on the H200
#: (perf/LOG.md: 0.99 against 1.06 ms a batch-1 step; a 2-row step, its norms folded and
#: launched programmatically, 1.020 against 1.106; at 4 and 8 rows it lost, 1.52 against
#: 1.17 and 3.46 against 1.18: perf/results/rows-h200-2026-12-04.json).
GEMV_MAX_ROWS, GEMV_MAX_K, GEMV_AUTO_ROWS = 8, 1536, 2

#: Outputs each warp of the few-row kernel makes at once, by rows (``gemv.cu``'s
#: ``dots_rows``): the same bits for any choice, and with more rows, fewer reads of shared
#: memory per weight byte. Two from 2 rows on: on the H200 a 2-row step took 0.946 ms
#: against 0.970 with one, and four no better than two (8 rows: 2.99, 2.42, 2.45 ms for 1, 2,
#: 4; perf/results/rows-h200-2026-12-04-per-warp.json). One row: one output a warp, 0.788
#: ms a step against 0.812 with two and 0.847 with four (rows-h200-2026-12-04-per-warp-1row).
GEMV_OUTPUTS_PER_WARP = {1: 1, 2: 2, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2, 8: 2}


def gemv_outputs_per_warp(m: int) -> int:
    """How many outputs a warp of the few-row kernel makes at once for ``m`` rows."""
    return GEMV_OUTPUTS_PER_WARP.get(m, 1)


def gemm(a, b, out, *, accumulate: bool = False, transpose_b: bool = False,
         method: str = "auto"):
    """``out = a @ b`` (``a @ b.T`` with ``transpose_b``), or ``out += ...`` with
    ``accumulate``; float32 accumulation. ``a`` [M, K], ``b`` [K, N] (or [N, K]), ``out``
    [M, N]; ``out`` may be float32 when ``a`` and ``b`` are 16-bit. Returns ``out``.

    On a GPU, ``method`` ``"cublas"`` calls cuBLAS; ``"gemv"`` our kernel for a few rows
    (``gemv.cu``: ``transpose_b``, M at most 8, K a multiple of 8 up to 1536); ``"auto"``
    takes the kernel for up to ``GEMV_AUTO_ROWS`` (2) rows, cuBLAS otherwise."""
    m, k = _rows(a, "a")
    n = b.shape[0] if transpose_b else b.shape[1]
    if (b.shape[1] if transpose_b else b.shape[0]) != k or tuple(out.shape) != (m, n):
        raise ConfigError(f"gemm shapes do not fit: a {tuple(a.shape)}, b {tuple(b.shape)}"
                          f"{' transposed' if transpose_b else ''}, out {tuple(out.shape)}")
    if not is_cupy(a):
        prod = a @ (b.T if transpose_b else b)
        if accumulate:
            out += prod
        else:
            out[...] = prod
        return out
    _rows(b, "b")
    _rows(out, "out")
    t_ab, t_out = dtype_name(a), dtype_name(out)
    if dtype_name(b) != t_ab:
        raise ConfigError(f"a and b must share a dtype, got {a.dtype} and {b.dtype}")
    fits = transpose_b and m <= GEMV_MAX_ROWS and k % 8 == 0 and k <= GEMV_MAX_K
    if method == "gemv" and not fits:
        raise ConfigError(f"the gemv kernel takes b transposed, at most {GEMV_MAX_ROWS} rows "
                          f"and K a multiple of 8 up to {GEMV_MAX_K}; got a {tuple(a.shape)}, "
                          f"b {tuple(b.shape)}{' transposed' if transpose_b else ''}")
    if method not in ("auto", "gemv", "cublas"):
        raise ConfigError(f"method must be 'auto', 'gemv' or 'cublas', got {method!r}")
    if method == "gemv" or (method == "auto" and fits and m <= GEMV_AUTO_ROWS):
        r = gemv_outputs_per_warp(m)
        name = f"gemv_t<{DTYPE_CODES[t_ab]}, {DTYPE_CODES[t_out]}, {m}, {r}>"
        fn = kernel(load_source("gemv.cu"), name)
        launch(fn, (min(cdiv(n, 8 * r), 8 * sm_count()),), (256,),
               (a, b, out, np.int32(k), np.int32(n), np.int32(accumulate)))
        return out
    cb = _cublas()
    cb.set_stream(backend.xp.cuda.get_current_stream().ptr)
    vp = ctypes.c_void_p
    # column-major: out^T [n, m] = op(b)^T [n, k] @ a^T [k, m]
    status = cb.gemm_ex(cb.handle, _OP_T if transpose_b else _OP_N, _OP_N, n, m, k,
                        ctypes.byref(cb.one), vp(b.data.ptr), _CUDA_TYPE[t_ab],
                        k if transpose_b else n, vp(a.data.ptr), _CUDA_TYPE[t_ab], k,
                        ctypes.byref(cb.one if accumulate else cb.zero), vp(out.data.ptr),
                        _CUDA_TYPE[t_out], n, _COMPUTE_32F, _GEMM_DEFAULT)
    cb._check(status, "cublasGemmEx")
    return out
