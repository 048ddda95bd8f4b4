"""Decode attention through page tables (PagedAttention), with split-K ("flash-decoding").

At a decode step every sequence brings one new query token per head and attends over all its
past keys and values, which live in blocks scattered through the cache.
:func:`paged_decode_attention` is the one the package uses: on CuPy arrays it launches one of two
CUDA kernels, on NumPy arrays it runs :func:`~pagedkv.kernels.reference.decode_numpy`.

* ``paged_decode.cu`` (CUDA cores): float32 arithmetic on every dtype; chapter 9's step 6.
* ``paged_decode_tc.cu`` (tensor cores, ``mma.sync``): float16 and bfloat16; chapter 9's
  step 7. Chosen automatically when the group (query heads per kv head) is at least
  :data:`TENSOR_CORE_MIN_GROUP` (5), where the arithmetic, not memory, would limit the
  CUDA-core kernel.

Both read an int8 cache too (:class:`~pagedkv.kernels.kv8.Cache8`, template argument ``KV8``:
half the bytes, scaled as they are read); ``q`` and ``out`` then have the model's dtype.

Shapes: ``q`` ``[batch, q_heads, head_dim]``; ``cache`` ``[num_blocks, 2, block_size, kv_heads,
head_dim]``; ``block_tables`` int32 ``[batch, max_blocks]``; ``seq_lens`` int32 ``[batch]``.
``q_heads`` is a multiple ``group`` (1–8) of ``kv_heads``: query head ``i`` reads kv head
``i // group`` (grouped-query attention; ``group == 1`` is ordinary multi-head attention).
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ._common import (DTYPE_CODES, INT8, dtype_name, allow_dynamic_smem, check_decode, contiguous_on_device,
                      fn_attr, is_cupy, kernel, load_source, sm_count, to_dtype)
from .kv8 import Cache8
from .pdl import launch
from .reference import decode_numpy

__all__ = ["paged_decode_attention", "decode_plan", "DecodePlan", "choose_num_splits",
           "uses_tensor_cores", "TENSOR_CORE_MIN_GROUP"]

#: The automatic choice takes the tensor-core kernel for fp16/bf16 from this group size up.
#: Measured on the H200 (perf/LOG.md, v5): at 4 query heads per kv head the CUDA-core kernel
#: is still as fast or 1-8 % faster; from 5 heads up the tensor cores win by 17-50 %.
TENSOR_CORE_MIN_GROUP = 5


def uses_tensor_cores(kv_dtype: str, group: int, q_dtype: str | None = None) -> bool:
    """The automatic choice: tensor cores for float16/bfloat16 (or an int8 cache read by a
    float16/bfloat16 ``q_dtype``) with ``group`` query heads per kv head at least
    :data:`TENSOR_CORE_MIN_GROUP`; CUDA cores otherwise."""
    sixteen = ("float16", "bfloat16")
    if kv_dtype == INT8:
        return (q_dtype or "float16") in sixteen and group >= TENSOR_CORE_MIN_GROUP
    return kv_dtype in sixteen and group >= TENSOR_CORE_MIN_GROUP


# --------------------------------------------------------------------------- kernel names

def _per_vec(kv_dtype: str) -> int:
    """Numbers of the cache in one 16-byte load."""
    return {"float32": 4, INT8: 16}.get(kv_dtype, 8)


def _chunks(kv_dtype: str, head_dim: int, chunks: int) -> int:
    """16-byte chunks of a head row per thread (the CUDA-core kernel's NV; 0 = as few as fit)."""
    row_vecs = head_dim // _per_vec(kv_dtype)
    return chunks or (1 if row_vecs < 32 else row_vecs // 32)


def cuda_core_config(group: int, kv_dtype: str, head_dim: int):
    """(warps per CTA, tokens per group per tile, ring stages, chunks per thread).

    Chosen from the H200 sweep in perf/LOG.md: two 16-byte chunks per thread (so 8 threads share
    a 128-dim fp16 row and the score needs 3 shuffle rounds, not 4), two tokens per group per
    tile, a ring of two tiles. Groups of 5–8 heads keep one chunk (registers would spill).
    An int8 cache takes one chunk (16 numbers: as many as two chunks of float16).
    """
    chunks = 2 if group <= 4 and kv_dtype != INT8 else 0
    stages = 2 if group <= 4 else 3
    nv = _chunks(kv_dtype, head_dim, chunks)
    while stages > 1 and _cc_smem(kv_dtype, head_dim, 4, 2, stages, nv) > 48 * 1024:
        stages -= 1                                      # stay within 48 KiB of static smem
    return 4, 2, stages, nv


def _cc_smem(kv_dtype, head_dim, nwarps, unroll, stages, nv) -> int:
    """Static shared memory of one CUDA-core CTA: the load ring (with an int8 cache, and its
    ring of 4-byte scale pairs) plus the warp-merge arrays."""
    pairs = stages * unroll * nv * nwarps * 32 * 4 if kv_dtype == INT8 else 0
    return stages * unroll * 2 * nv * nwarps * 32 * 16 + pairs + nwarps * (head_dim + 2) * 4


def _kv8_arg(kv8: bool) -> str:
    """The templates' last argument, written only for an int8 cache (KV8 = 1)."""
    return ", 1" if kv8 else ""


def cuda_core_name(dt: int, head_dim: int, group: int, block_size: int, config=None,
                   kv8: bool = False) -> str:
    """The template instance of ``paged_decode`` for these parameters (default config);
    ``dt`` is q's dtype code, ``kv8`` an int8 cache."""
    kv_dtype = INT8 if kv8 else [k for k, v in DTYPE_CODES.items() if v == dt][0]
    nwarps, unroll, stages, nv = config or cuda_core_config(group, kv_dtype, head_dim)
    return (f"paged_decode<{dt}, {head_dim}, {group}, {block_size}, {nwarps}, {unroll}, "
            f"{stages}, {nv}{_kv8_arg(kv8)}>")


def tensor_core_config(head_dim: int):
    """(warps per CTA, ring stages per warp) of the tensor-core kernel."""
    return 4, (3 if head_dim <= 128 else 2)


def _tc_smem(head_dim: int, nwarps: int, stages: int, kv8: bool = False) -> int:
    """Dynamic shared memory of one tensor-core CTA: per warp, STAGES tiles of 16 K and 16 V
    rows of head_dim + 8 two-byte numbers; with an int8 cache, STAGES tiles of int8 rows and
    their scale pairs, and one tile of two-byte numbers."""
    tile16 = 2 * 16 * (head_dim + 8) * 2
    if kv8:
        return nwarps * (stages * (2 * 16 * head_dim + 16 * head_dim // 32 * 4) + tile16)
    return nwarps * stages * tile16


def tensor_core_name(dt: int, head_dim: int, group: int, block_size: int, config=None,
                     kv8: bool = False) -> str:
    nwarps, stages = config or tensor_core_config(head_dim)
    return (f"paged_decode_tc<{dt}, {head_dim}, {group}, {block_size}, {nwarps}, {stages}"
            f"{_kv8_arg(kv8)}>")


# --------------------------------------------------------------------------- splits

def _ctas_per_sm(fn, threads: int, smem: int) -> int:
    """CTAs that fit on one SM at once: limited by registers, threads, and shared memory."""
    regs = fn_attr(fn, "num_regs", 128)
    per_warp = cdiv(regs * 32, 256) * 256                # registers are handed out per warp
    return max(1, min(65536 // (per_warp * threads // 32), 2048 // threads, 32,
                      (228 * 1024) // (smem + 1024)))


def choose_num_splits(work: int, max_len: int, sms: int, ctas_per_sm: int, tile: int,
                      saturate: int = 2) -> int:
    """How many pieces to cut each sequence into, so that the whole GPU is busy.

    ``work`` = batch × kv_heads CTAs would run without splitting; ``ctas_per_sm`` of them fit on
    each of the ``sms`` multiprocessors at once; ``saturate`` of them per SM already keep the
    memory busy: 2 for the CUDA-core kernel, 1 for the tensor-core kernel (each of its warps
    keeps three 16-token tiles in flight). The rule was fitted to H200 measurements
    (perf/LOG.md); every split adds a merge, so a split must buy more than that.

    * fewer than ``saturate`` CTAs per SM: enough splits for about ``saturate`` per SM, all
      resident at once;
    * a second wave too thin to keep memory busy (fewer than ``saturate`` CTAs per SM after one
      full wave, and no third wave): 2 splits;
    * otherwise no split.
    """
    slots = sms * ctas_per_sm
    if work < saturate * sms:
        s = (saturate * sms) // max(work, 1)
    elif slots < work < 2 * slots and work - slots < saturate * sms:
        s = 2
    else:
        s = 1
    s = max(1, min(s, max_len // (2 * tile)))          # at least two tiles per split
    per_split = cdiv(cdiv(max_len, s), tile) * tile    # a whole number of tiles each ...
    return cdiv(max_len, per_split)                      # ... which may leave fewer splits


# --------------------------------------------------------------------------- plans

@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """How one problem shape is launched on the GPU; made (and cached) by :func:`decode_plan`.

    ``path`` is ``"tensor-cores"`` or ``"cuda-cores"``; ``kernel`` the template instance;
    ``num_splits`` pieces per sequence of ``split_tokens`` tokens each; ``registers`` and
    ``spill_bytes`` (local memory per thread) as the compiler reported them.
    """
    path: str
    kernel: str
    threads: int
    num_splits: int
    split_tokens: int
    smem_bytes: int
    registers: int
    spill_bytes: int
    _fn: object = dataclasses.field(repr=False, compare=False)
    _merge: object = dataclasses.field(repr=False, compare=False)

    def scratch_floats(self, batch: int, q_heads: int, head_dim: int) -> int:
        """float32 numbers of scratch the split results need (0 without splits)."""
        return batch * q_heads * self.num_splits * (head_dim + 1) if self.num_splits > 1 else 0

    def run(self, q, cache, block_tables, seq_lens, out=None, scale=None, scratch=None):
        """Launch on CuPy arrays of the shape this plan was made for, without re-checking them
        (for a decode loop whose shapes do not change; :func:`paged_decode_attention` checks).
        ``scratch`` (float32, :meth:`scratch_floats` long) holds the split results; by default a
        buffer shared by every launch on the stream, which may be replaced by a larger one (a
        CUDA graph, whose addresses are fixed, must bring its own). With splits, a second
        kernel merges them."""
        cp = backend.xp
        batch, q_heads, d = q.shape
        kv_heads = cache.shape[3]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        q, block_tables, seq_lens = (contiguous_on_device(a) for a in (q, block_tables, seq_lens))
        if out is None:
            out = cp.empty_like(q)
        elif not out.flags.c_contiguous:
            raise ConfigError("out must be C-contiguous")
        if self.num_splits > 1:
            n = batch * q_heads * self.num_splits
            if scratch is None:
                scratch = _scratch(4 * n * (d + 1))
            elif scratch.size < n * (d + 1) or scratch.dtype != np.float32:
                raise ConfigError(f"scratch must hold {n * (d + 1)} float32 numbers")
            part_o, part_lse = scratch[:n * d], scratch[n * d:n * (d + 1)]
        else:
            part_o = part_lse = out                      # unused by the kernel
        launch(self._fn, (self.num_splits, kv_heads, batch), (self.threads,),
               (q, cache.raw if isinstance(cache, Cache8) else cache, block_tables, seq_lens,
                out, part_o, part_lse, np.int32(kv_heads),
                np.int32(block_tables.shape[1]), np.int32(self.split_tokens),
                np.float32(scale * 1.4426950408889634)),   # log2(e): the kernels use exp2
               shared_mem=self.smem_bytes if self.path == "tensor-cores" else 0)
        if self._merge is not None:
            launch(self._merge, (batch * q_heads,), (min(d, 256),),
                   (part_o, part_lse, out, np.int32(self.num_splits), np.int32(d)))
        return out


def decode_plan(q, cache, block_tables, *, num_splits=None, tensor_cores=None,
                config=None) -> DecodePlan:
    """The GPU launch :func:`paged_decode_attention` would make for these arrays' shapes.

    ``tensor_cores``: None chooses (fp16/bf16 and group ≥ :data:`TENSOR_CORE_MIN_GROUP`),
    True/False forces. ``config`` overrides the launch shape: (warps, tokens per tile, stages,
    chunks) for CUDA cores, (warps, stages) for tensor cores.
    """
    kv_dtype = check_decode(q, cache, block_tables, np.zeros(q.shape[0], np.int32))
    return _choose(q, cache, block_tables, kv_dtype, num_splits, tensor_cores, config)


def _choose(q, cache, block_tables, kv_dtype, num_splits, tensor_cores, config=None):
    if num_splits is not None and int(num_splits) < 1:
        raise ConfigError(f"num_splits must be ≥ 1, got {num_splits}")
    group, q_dtype = q.shape[1] // cache.shape[3], dtype_name(q)
    if tensor_cores is None:
        tensor_cores = uses_tensor_cores(kv_dtype, group, q_dtype)
    elif tensor_cores and q_dtype == "float32":
        raise ConfigError("the tensor-core kernel takes float16 or bfloat16, got float32")
    return _plan(tuple(q.shape), tuple(cache.shape), kv_dtype, int(block_tables.shape[1]),
                 None if num_splits is None else int(num_splits), bool(tensor_cores),
                 None if config is None else tuple(config), q_dtype)


@functools.lru_cache(maxsize=256)
def _plan(q_shape, cache_shape, kv_dtype, max_blocks, num_splits, tensor_cores, config,
          q_dtype=None):
    batch, q_heads, _ = q_shape
    _, _, bs, kv_heads, d = cache_shape
    kv8 = kv_dtype == INT8
    group, code = q_heads // kv_heads, DTYPE_CODES[q_dtype or kv_dtype]
    if tensor_cores:
        nwarps, stages = config or tensor_core_config(d)
        name = tensor_core_name(code, d, group, bs, (nwarps, stages), kv8)
        source = "paged_decode_tc.cu"
        smem, tile = _tc_smem(d, nwarps, stages, kv8), nwarps * 16
    else:
        nwarps, unroll, stages, nv = config or cuda_core_config(group, kv_dtype, d)
        nv = _chunks(kv_dtype, d, nv)
        name = cuda_core_name(code, d, group, bs, (nwarps, unroll, stages, nv), kv8)
        source, smem = "paged_decode.cu", _cc_smem(kv_dtype, d, nwarps, unroll, stages, nv)
        tpt = d // _per_vec(kv_dtype) // nv                  # threads per token group
        tile = nwarps * (32 // tpt) * unroll                    # tokens per tile
    fn = kernel(load_source(source), name)
    if tensor_cores:
        allow_dynamic_smem(fn, smem)
    threads = nwarps * 32
    max_len = max_blocks * bs                            # an upper bound known without a sync
    if num_splits is None:
        occupancy = _ctas_per_sm(fn, threads, smem)
        num_splits = choose_num_splits(batch * kv_heads, max_len, sm_count(), occupancy, tile,
                                       saturate=1 if tensor_cores else 2)
    num_splits = max(1, min(num_splits, cdiv(max_len, tile)))
    split_tokens = cdiv(cdiv(max_len, num_splits), tile) * tile  # a whole number of tiles
    num_splits = cdiv(max_len, split_tokens)             # rounding up may leave one fewer
    merge = kernel(load_source(source), f"merge_splits<{code}>") if num_splits > 1 else None
    return DecodePlan("tensor-cores" if tensor_cores else "cuda-cores", name, threads,
                      num_splits, split_tokens, smem if tensor_cores else 0,
                      fn_attr(fn, "num_regs", -1), fn_attr(fn, "local_size_bytes", -1), fn,
                      merge)


_workspace = {}


def _scratch(nbytes: int):
    """A reused float32 scratch buffer for the split results (grown when too small).

    Reuse is safe because every launch goes to the current stream in order; it saves two
    allocations per decode step, which matter when the kernel itself takes ~40 µs.
    """
    cp = backend.xp
    key = (cp.cuda.Device().id, cp.cuda.get_current_stream().ptr)
    buf = _workspace.get(key)
    if buf is None or buf.nbytes < nbytes:
        buf = _workspace[key] = cp.empty((max(nbytes, 1 << 20) + 3) // 4, cp.float32)
    return buf


# --------------------------------------------------------------------------- the public call

_checked = {}   # (shapes, dtypes, options) already checked -> their DecodePlan


def paged_decode_attention(q, cache, block_tables, seq_lens, *, scale=None, out=None,
                           num_splits=None, tensor_cores=None):
    """Attention of one new query token per sequence over its paged K/V.

    ``scale`` defaults to ``1/sqrt(head_dim)``. ``num_splits`` cuts each sequence into that many
    pieces handled in parallel and merged after (flash-decoding); by default it is chosen from
    batch × kv_heads against the GPU's size (and is 1 on NumPy). ``tensor_cores`` picks the GPU
    kernel (None: automatic, see :func:`decode_plan`). uint16 arrays are taken as bfloat16 bits
    (for CuPy builds without a bfloat16 dtype). ``out`` may be given. ``cache`` may be an int8
    :class:`~pagedkv.kernels.kv8.Cache8`; ``q`` and ``out`` then have any float dtype (on a
    GPU: float16 or bfloat16, or float32 on the CUDA-core kernel).

    On NumPy arrays the kernel's algorithm runs in NumPy (float32 arithmetic) and checks lengths
    and table entries; on CuPy arrays they are trusted (checking them would stall the GPU).
    Positions past a sequence's length are never used, whatever the pool holds there.
    """
    if is_cupy(cache):
        # A decode loop calls this with the same shapes step after step: the checks and the
        # plan are made once per shapes, dtypes and options, then looked up (about 10 µs of
        # Python saved per call, as much as a short kernel takes).
        key = (q.shape, q.dtype, cache.shape, cache.dtype, block_tables.shape,
               block_tables.dtype, seq_lens.shape, seq_lens.dtype,
               None if out is None else (out.shape, out.dtype), num_splits, tensor_cores)
        plan = _checked.get(key)
        if plan is None or not cache.flags.c_contiguous:
            kv_dtype = check_decode(q, cache, block_tables, seq_lens, out)
            plan = _choose(q, cache, block_tables, kv_dtype, num_splits, tensor_cores)
            if len(_checked) >= 1024:
                _checked.clear()
            _checked[key] = plan
        return plan.run(q, cache, block_tables, seq_lens, out, scale)
    kv_dtype = check_decode(q, cache, block_tables, seq_lens, out)
    if num_splits is not None and int(num_splits) < 1:
        raise ConfigError(f"num_splits must be ≥ 1, got {num_splits}")
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    res = decode_numpy(q, cache, np.asarray(block_tables), np.asarray(seq_lens), scale,
                       int(num_splits or 1), kv_dtype)
    res = to_dtype(res, dtype_name(q), q)
    if out is None:
        return res
    out[...] = res
    return out
