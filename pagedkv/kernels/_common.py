"""What every kernel family shares: dtype names, shape checks, compiling CUDA source with CuPy.

A kernel family is one CUDA C file (``*.cu``, package data beside the Python module that
launches it), with ``common.cuh`` put in front of it. CuPy compiles the source at first use with
NVRTC (CUDA's run-time compiler) into a ``RawModule``; we keep one compiled module per (source,
template arguments) so a second call costs nothing.
"""
from __future__ import annotations

import functools
import importlib.resources

import numpy as np

from .. import backend
from ..errors import ConfigError
from .kv8 import INT8, is_cache8, read_rows

try:  # NumPy has no bfloat16; ml_dtypes gives the references one.
    import ml_dtypes
    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test/notebook dependency
    ml_dtypes = None
    BF16 = None

#: The dtypes the kernels accept, and the number each one has inside the CUDA templates.
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
#: The attention kernels' last template argument: what the cache holds. 0: numbers of the
#: query's dtype (DT); 1: int8 numbers with float16 scales (pagedkv.kernels.kv8).
KV_CODES = {"same": 0, INT8: 1}

#: What the attention kernels are compiled for: head sizes, block (page) sizes, and up to
#: MAX_GROUP query heads per kv head.
HEAD_DIMS = (64, 128, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_GROUP = 8

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


def contiguous_on_device(a):
    """``a`` as a C-contiguous CuPy array (a copy only if it is not one already)."""
    cp = backend.xp
    if not isinstance(a, cp.ndarray):
        a = cp.asarray(a)
    return a if a.flags.c_contiguous else cp.ascontiguousarray(a)


def is_cupy(a) -> bool:
    """True for a CuPy array, or an int8 cache on CuPy (only possible when the backend found
    a GPU)."""
    if is_cache8(a):
        a = a.raw
    return backend.on_gpu and isinstance(a, backend.xp.ndarray)


def check_int32(a, name: str, ndim: int):
    if str(a.dtype) != "int32":
        raise ConfigError(f"{name} must be int32, got {a.dtype}")
    if a.ndim != ndim:
        raise ConfigError(f"{name} must have {ndim} dimension(s), got shape {tuple(a.shape)}")


def check_cache(cache) -> str:
    """A one-layer cache is [num_blocks, 2, block_size, kv_heads, head_dim], C-contiguous, or
    a :class:`~pagedkv.kernels.kv8.Cache8` of that shape (then the dtype is ``"int8"``)."""
    if is_cache8(cache):
        return INT8
    if cache.ndim != 5 or cache.shape[1] != 2:
        raise ConfigError("cache must have shape [num_blocks, 2, block_size, kv_heads, head_dim], "
                          f"got {tuple(cache.shape)}")
    if not cache.flags.c_contiguous:
        raise ConfigError("cache must be C-contiguous")
    return dtype_name(cache)


def _check_q(q, cache, rows: str, head_dims, what: str):
    """The checks decode and prefill share: ``q`` ``[rows, q_heads, head_dim]`` against the
    cache, a built head size and block size, a group of 1 to MAX_GROUP. Returns the
    dtype."""
    kv_dtype = check_cache(cache)
    if q.ndim != 3:
        raise ConfigError(f"q must have shape [{rows}, q_heads, head_dim], got "
                          f"{tuple(q.shape)}")
    if kv_dtype == INT8:
        dtype_name(q)                     # an int8 cache serves a query of any float dtype
    elif q.dtype != cache.dtype:
        raise ConfigError(f"q has dtype {q.dtype}, the cache {cache.dtype}")
    _, _, block_size, kv_heads, head_dim = cache.shape
    _, q_heads, qd = q.shape
    if qd != head_dim:
        raise ConfigError(f"q has head_dim {qd}, the cache {head_dim}")
    if head_dim not in head_dims:
        raise ConfigError(what.format(head_dims=head_dims, head_dim=head_dim))
    if block_size not in BLOCK_SIZES:
        raise ConfigError(f"block_size must be one of {BLOCK_SIZES}, got {block_size}")
    if q_heads % kv_heads or not 1 <= q_heads // kv_heads <= MAX_GROUP:
        raise ConfigError(f"q_heads ({q_heads}) must be 1 to {MAX_GROUP} times kv_heads "
                          f"({kv_heads})")
    return kv_dtype


def _check_out(out, q) -> None:
    if out is not None and (tuple(out.shape) != tuple(q.shape) or out.dtype != q.dtype):
        raise ConfigError(f"out must be {tuple(q.shape)} {q.dtype}, got "
                          f"{tuple(out.shape)} {out.dtype}")


def check_decode(q, cache, block_tables, seq_lens, out=None) -> str:
    """Shapes and dtypes of a decode-attention call (cheap: no data is read). Returns the dtype.

    ``q`` ``[batch, q_heads, head_dim]``; ``cache`` ``[num_blocks, 2, block_size, kv_heads,
    head_dim]``; ``block_tables`` int32 ``[batch, max_blocks]``; ``seq_lens`` int32 ``[batch]``;
    ``q_heads`` is 1 to MAX_GROUP times ``kv_heads``.
    """
    kv_dtype = _check_q(q, cache, "batch", HEAD_DIMS,
                        "head_dim must be one of {head_dims}, got {head_dim}")
    batch = q.shape[0]
    check_int32(block_tables, "block_tables", 2)
    check_int32(seq_lens, "seq_lens", 1)
    if block_tables.shape[0] != batch or seq_lens.shape[0] != batch:
        raise ConfigError(f"block_tables {tuple(block_tables.shape)} and seq_lens "
                          f"{tuple(seq_lens.shape)} must have batch={batch} rows")
    _check_out(out, q)
    return kv_dtype


def check_lengths(cache, block_tables, seq_lens):
    """Lengths and the table entries they use, on the host (NumPy arrays: on a GPU this would
    wait for the device, so the CuPy paths trust them)."""
    num_blocks, _, block_size = cache.shape[:3]
    lens = np.asarray(seq_lens)
    if lens.size and (lens.min() < 0 or lens.max() > block_tables.shape[1] * block_size):
        raise ConfigError(f"seq_lens must lie in [0, max_blocks * block_size = "
                          f"{block_tables.shape[1] * block_size}], got {lens.min()} to "
                          f"{lens.max()}")
    used = np.arange(block_tables.shape[1])[None, :] * block_size < lens[:, None]
    if np.any((block_tables[used] < 0) | (block_tables[used] >= num_blocks)):
        raise ConfigError(f"block_tables map a token to a block outside [0, {num_blocks})")


#: Head sizes the prefill kernel is built for (its registers hold a 16-row tile of O).
PREFILL_HEAD_DIMS = (64, 128)


def check_prefill(q, cache, block_tables, query_start, seq_lens, out=None) -> str:
    """Shapes and dtypes of a prefill-attention call (cheap: no data is read). Returns the
    dtype.

    ``q`` ``[total_new_tokens, q_heads, head_dim]`` (the new tokens of every sequence, one
    after another); ``cache`` as for decode; ``block_tables`` int32 ``[batch, max_blocks]``;
    ``query_start`` int32 ``[batch + 1]`` (sequence ``b``'s new tokens are rows
    ``query_start[b]`` to ``query_start[b + 1] - 1`` of ``q``); ``seq_lens`` int32 ``[batch]``
    (each sequence's length, its new tokens included).
    """
    kv_dtype = _check_q(q, cache, "total_new_tokens", PREFILL_HEAD_DIMS,
                        "prefill attention takes head_dim {head_dims}, got {head_dim}")
    check_int32(block_tables, "block_tables", 2)
    check_int32(query_start, "query_start", 1)
    check_int32(seq_lens, "seq_lens", 1)
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch or query_start.shape[0] != batch + 1:
        raise ConfigError(f"seq_lens {tuple(seq_lens.shape)}, block_tables "
                          f"{tuple(block_tables.shape)} and query_start "
                          f"{tuple(query_start.shape)} must have batch, batch and batch + 1 "
                          f"rows")
    _check_out(out, q)
    return kv_dtype


def check_prefill_lengths(q, cache, block_tables, query_start, seq_lens):
    """Offsets, lengths and the table entries they use, on the host (NumPy arrays; the CuPy
    path trusts them, as reading them back would wait for the device)."""
    starts, lens = np.asarray(query_start), np.asarray(seq_lens)
    qlens = np.diff(starts)
    if starts[0] != 0 or starts[-1] != q.shape[0] or np.any(qlens < 0):
        raise ConfigError(f"query_start must rise from 0 to the {q.shape[0]} rows of q, got "
                          f"{starts[0]} ... {starts[-1]}"
                          + (" (it falls somewhere)" if np.any(qlens < 0) else ""))
    if np.any(qlens > lens):
        b = int(np.argmax(qlens > lens))
        raise ConfigError(f"sequence {b} has {qlens[b]} new tokens but seq_len {lens[b]}: a "
                          f"sequence's length counts its new tokens")
    check_lengths(cache, block_tables, lens)


def as_float(a, dtype: str) -> np.ndarray:
    """A NumPy float64 copy of an array of any supported dtype (bf16 may arrive as uint16
    bits); an int8 cache dequantized."""
    if is_cache8(a):
        from .kv8 import dequantize_cache
        return dequantize_cache(a, np.float64)
    a = backend.to_numpy(a)
    if dtype == "bfloat16" and a.dtype == np.uint16:
        a = a.view(BF16)
    return a.astype(np.float64)


def read_kv(cache, blocks, offsets, kv: int, kv_dtype: str) -> np.ndarray:
    """float32 K (``kv`` 0) or V (1) rows ``cache[blocks, kv, offsets]`` (index arrays that
    broadcast), ``[..., kv_heads, head_dim]``: widened, or dequantized from an int8 cache."""
    if kv_dtype == INT8:
        return read_rows(cache, blocks, offsets, kv)
    return as_float(cache[blocks, kv, offsets], kv_dtype).astype(np.float32)


def to_dtype(a: np.ndarray, dtype: str, like) -> np.ndarray:
    """Cast float data to ``dtype`` the way ``like`` stores it (bf16 bits stay uint16)."""
    if dtype == "bfloat16":
        if BF16 is None:
            raise ConfigError("bfloat16 on NumPy needs the ml_dtypes package")
        out = a.astype(BF16)
        return out.view(np.uint16) if like.dtype == np.uint16 else out
    return a.astype(dtype)


@functools.lru_cache(maxsize=None)
def load_source(filename: str) -> str:
    """``common.cuh`` followed by the CUDA file ``filename`` of this package."""
    here = importlib.resources.files(__package__)
    return here.joinpath("common.cuh").read_text() + "\n" + here.joinpath(filename).read_text()


def cuda_between(filename: str, start: str, end: str | None = None) -> str:
    """The lines of a CUDA file from the one containing ``start`` up to (not including) the
    first later one containing ``end`` (to the end of the file without ``end``): how a chapter
    shows one piece of a kernel."""
    lines = importlib.resources.files(__package__).joinpath(filename).read_text().splitlines()
    i = next(n for n, line in enumerate(lines) if start in line)
    j = next((n for n, line in enumerate(lines[i + 1:], i + 1) if end and end in line),
             len(lines))
    return "\n".join(lines[i:j]).rstrip()


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
    def driver_attr():
        from cupy_backends.cuda.api import driver
        return driver.funcGetAttribute(getattr(driver, f"CU_FUNC_ATTRIBUTE_{name.upper()}"),
                                       fn.ptr)
    for get in (lambda: getattr(fn, name), lambda: fn.attributes[name], driver_attr):
        try:
            return int(get())
        except Exception:
            pass
    return default


def allow_dynamic_smem(fn, nbytes: int) -> None:
    """Let ``fn`` use ``nbytes`` of dynamic shared memory (above 48 KiB a kernel must ask)."""
    if nbytes <= 48 * 1024:
        return
    try:                      # CuPy's RawKernel (what RawModule.get_function returns)
        fn.max_dynamic_shared_size_bytes = int(nbytes)
    except AttributeError:    # a bare cupy.cuda.Function
        from cupy_backends.cuda.api import driver
        driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                int(nbytes))


def nvrtc_target() -> str:
    """The ``-arch`` option CuPy passes to NVRTC on this GPU (for the benchmark's report)."""
    try:
        from cupy.cuda import compiler
        return str(compiler._get_arch_for_options_for_nvrtc(compiler._get_arch()))
    except Exception as exc:  # a private CuPy function: report, never fail
        return f"unknown ({type(exc).__name__})"
