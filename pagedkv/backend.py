"""The array backend: CuPy when a CUDA device is usable, NumPy otherwise.

The choice is made once, at import, and reported by :func:`describe`. Set the environment
variable ``PAGEDKV_BACKEND`` to ``numpy`` or ``cupy`` to override it; asking for ``cupy`` on a
machine without a usable GPU is an error rather than a silent fallback.

Everything else in the package asks this module for ``xp`` (the array module in use) instead of
importing NumPy or CuPy itself, so one code path serves both.
"""
from __future__ import annotations

import os

import numpy as np

from .errors import BackendError, PoolTooLarge

__all__ = ["xp", "name", "reason", "on_gpu", "describe", "to_numpy", "synchronize", "claim_bytes"]


def _cupy_if_usable():
    """Return (cupy module or None, why) without raising."""
    try:
        import cupy
    except Exception as exc:  # ImportError, or a broken CUDA install
        return None, f"CuPy is not importable ({type(exc).__name__}: {exc})"
    try:
        if not cupy.is_available():
            return None, "CuPy is installed but no CUDA device is usable"
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return None, f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    return cupy, "a CUDA device is usable"


def _choose(request: str | None):
    request = (request or "auto").strip().lower()
    if request not in ("auto", "numpy", "cupy"):
        raise BackendError(
            f"PAGEDKV_BACKEND must be 'numpy', 'cupy' or unset, got {request!r}")
    if request == "numpy":
        return np, "numpy", "PAGEDKV_BACKEND=numpy"
    cupy, why = _cupy_if_usable()
    if cupy is not None:
        return cupy, "cupy", why if request == "auto" else "PAGEDKV_BACKEND=cupy"
    if request == "cupy":
        raise BackendError(f"PAGEDKV_BACKEND=cupy was asked for, but {why}")
    return np, "numpy", why


xp, name, reason = _choose(os.environ.get("PAGEDKV_BACKEND"))
on_gpu: bool = name == "cupy"


def describe() -> dict:
    """What runs: the backend, why, and for a GPU its name, memory and compute capability."""
    info = {"backend": name, "reason": reason, "numpy": np.__version__}
    if on_gpu:
        dev = xp.cuda.Device()
        props = xp.cuda.runtime.getDeviceProperties(dev.id)
        free, total = xp.cuda.runtime.memGetInfo()
        gpu_name = props["name"]
        info.update(
            cupy=xp.__version__,
            device=gpu_name.decode() if isinstance(gpu_name, bytes) else str(gpu_name),
            compute_capability=f"{props['major']}.{props['minor']}",
            memory_total_bytes=int(total),
            memory_free_bytes=int(free),
            multiprocessors=int(props["multiProcessorCount"]),
        )
    return info


def to_numpy(a) -> np.ndarray:
    """A NumPy copy (or the array itself) of a NumPy or CuPy array."""
    if on_gpu and isinstance(a, xp.ndarray):
        return xp.asnumpy(a)
    return np.asarray(a)


def synchronize() -> None:
    """Wait for queued device work (a no-op on NumPy)."""
    if on_gpu:
        xp.cuda.runtime.deviceSynchronize()


def claim_bytes(nbytes: int, module=None):
    """``nbytes`` of memory as a 1-D uint8 array. On a GPU the bytes come from ``cudaMalloc``
    directly, not CuPy's caching pool, so that dropping the array gives them back to the device."""
    module = xp if module is None else module      # NumPy or CuPy
    try:
        if module is np:
            return np.empty(nbytes, dtype=np.uint8)
        mem = module.cuda.Memory(nbytes)
        return module.ndarray((nbytes,), dtype=module.uint8,
                              memptr=module.cuda.MemoryPointer(mem, 0))
    except MemoryError as exc:  # NumPy's and CuPy's out-of-memory errors are MemoryErrors
        where = "host memory" if module is np else "GPU memory"
        raise PoolTooLarge(f"cannot claim a pool of {nbytes:,} bytes ({nbytes / 2**30:.1f} GiB) "
                           f"in {where}: {exc}") from None
