"""What every kernel family shares: dtype names, shape checks, compiling CUDA source with CuPy.

A kernel family is one CUDA C source string beside the Python function that launches it. CuPy
compiles the source at first use with NVRTC (CUDA's run-time compiler) into a ``RawModule``; we
keep one compiled module per (source, template arguments) so a second call costs nothing.
"""
from __future__ import annotations

import functools

import numpy as np

from .. import backend
from ..errors import ConfigError

try:  # NumPy has no bfloat16; ml_dtypes gives the references one.
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test/notebook dependency
    ml_dtypes = None
    BF16 = None

#: The dtypes the kernels accept, and the number each one has inside the CUDA templates.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

#: Compiler options for every module: C++17, and fast (approximate) exp2/division. CuPy itself adds
#: the ``-arch`` option for the GPU it runs on (``sm_90`` machine code on an H200).
NVRTC_OPTIONS = ("-std=c++17", "--use_fast_math")


def dtype_name(a) -> str:
    """'float16', 'bfloat16' or 'float32' for an array.

    uint16 arrays are taken as bfloat16 bit patterns: that is how a CuPy build without a bfloat16
    dtype (and any code that only moves the bits) holds bf16 data.
    """
    name = "bfloat16" if a.dtype == np.uint16 else str(a.dtype)
    if name not in DTYPE_CODES:
        raise ConfigError("KV data must be float16, bfloat16 (or its uint16 bits) or float32, "
                          f"got {a.dtype}")
    return name


def to_device(a):
    """A CuPy copy of a NumPy array; bf16 becomes CuPy's bfloat16 if it has one, else uint16 bits."""
    cp = backend.xp
    if BF16 is not None and a.dtype == BF16:
        try:
            return cp.asarray(a)
        except Exception:
            return cp.asarray(a.view(np.uint16))
    return cp.asarray(a)


def is_cupy(a) -> bool:
    """True for a CuPy array (only possible when the backend found a GPU)."""
    return backend.on_gpu and isinstance(a, backend.xp.ndarray)


def check_int32(a, name: str, ndim: int):
    if str(a.dtype) != "int32":
        raise ConfigError(f"{name} must be int32, got {a.dtype}")
    if a.ndim != ndim:
        raise ConfigError(f"{name} must have {ndim} dimension(s), got shape {tuple(a.shape)}")


def check_cache(cache) -> str:
    """A one-layer cache is [num_blocks, 2, block_size, kv_heads, head_dim], C-contiguous."""
    if cache.ndim != 5 or cache.shape[1] != 2:
        raise ConfigError("cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], "
                          f"got {tuple(cache.shape)}")
    if not cache.flags.c_contiguous:
        raise ConfigError("cache must be C-contiguous")
    return dtype_name(cache)


def as_float(a, dtype: str) -> np.ndarray:
    """A NumPy float64 copy of an array of any supported dtype (bf16 may arrive as uint16 bits)."""
    a = backend.to_numpy(a)
    if dtype == "bfloat16" and a.dtype == np.uint16:
        a = a.view(BF16)
    return a.astype(np.float64)


def to_dtype(a: np.ndarray, dtype: str, like) -> np.ndarray:
    """Cast float data to ``dtype`` the way ``like`` stores it (bf16 bits stay uint16)."""
    if dtype == "bfloat16":
        if BF16 is None:
            raise ConfigError("bfloat16 on NumPy needs the ml_dtypes package")
        out = a.astype(BF16)
        return out.view(np.uint16) if like.dtype == np.uint16 else out
    return a.astype(dtype)


@functools.lru_cache(maxsize=None)
def module(source: str, name_expressions: tuple[str, ...] = ()):
    """Compile ``source`` once (per process) into a CuPy RawModule."""
    cp = backend.xp
    return cp.RawModule(code=source, options=NVRTC_OPTIONS,
                        name_expressions=list(name_expressions) or None)


@functools.lru_cache(maxsize=None)
def kernel(source: str, name: str):
    """The compiled kernel ``name`` (a template instance such as ``f<1, 128>`` is fine)."""
    if "<" in name:
        return module(source, (name,)).get_function(name)
    return module(source).get_function(name)


@functools.lru_cache(maxsize=None)
def sm_count() -> int:
    cp = backend.xp
    return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])


def fn_attr(fn, name: str, default: int) -> int:
    """A compiled kernel's attribute (num_regs, shared_size_bytes, local_size_bytes...)."""
    for get in (lambda: getattr(fn, name), lambda: fn.attributes[name]):
        try:
            return int(get())
        except Exception:
            pass
    return default


def nvrtc_target() -> str:
    """The ``-arch`` option CuPy passes to NVRTC on this GPU (for the benchmark's report)."""
    try:
        from cupy.cuda import compiler
        return str(compiler._get_arch_for_options_for_nvrtc(compiler._get_arch()))
    except Exception as exc:  # a private CuPy function: report, never fail
        return f"unknown ({type(exc).__name__})"
