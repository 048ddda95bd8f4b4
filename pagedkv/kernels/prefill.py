"""Causal prefill attention through page tables, on tensor cores.

A prefill step brings several new tokens per sequence: a whole prompt, or a chunk of one that
may start in the middle of a block (after a prefix-cache hit or an earlier chunk). Their K/V
are written into the cache first (``write_kv`` / ``rope_write_kv``); then the token at position
``p`` attends to positions ``0 .. p`` of its own sequence. :func:`paged_prefill_attention` runs
``paged_prefill.cu`` on CuPy arrays and :func:`~pagedkv.kernels.reference.prefill_numpy` (the
kernel's algorithm in float32) on NumPy arrays.

Shapes (vLLM V1's "varlen" layout): ``q`` ``[total_new_tokens, q_heads, head_dim]``, the new
tokens of every sequence one after another; ``query_start`` int32 ``[batch + 1]``, sequence
``b``'s rows are ``query_start[b] .. query_start[b + 1] - 1``; ``seq_lens`` int32 ``[batch]``,
each sequence's length with its new tokens; ``cache`` ``[num_blocks, 2, block_size, kv_heads,
head_dim]``; ``block_tables`` int32 ``[batch, max_blocks]``. Query head ``i`` reads kv head
``i // group`` (grouped-query attention).

The kernel reads K/V once per query tile of ``rows_per_cta`` rows (a row: one new token and
one query head of a group), where running the decode kernel once per new token reads them once
per token. It reads an int8 cache (:class:`~pagedkv.kernels.kv8.Cache8`) too: template
argument ``KV8``, half the bytes, each tile turned into ``q``'s dtype once it has landed.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ._common import (DTYPE_CODES, INT8, dtype_name, PREFILL_HEAD_DIMS, allow_dynamic_smem, check_prefill,
                      contiguous_on_device, fn_attr, is_cupy, kernel, load_source, to_dtype)
from .kv8 import Cache8
from .reference import prefill_numpy

__all__ = ["paged_prefill_attention", "prefill_plan", "PrefillPlan", "prefill_config",
           "prefill_name", "grid_ctas", "PREFILL_SOURCE", "PREFILL_HEAD_DIMS"]

PREFILL_SOURCE = "paged_prefill.cu"


def prefill_config(head_dim: int):
    """(warps per CTA, 16-row pieces per warp, keys per K/V tile, ring stages): the launch
    shape for ``head_dim``. Four warps of one 16-row piece each (64 query rows a CTA), K/V
    tiles of 64 keys, two in flight: with Q, O and a 16 x 64 tile of scores in registers
    this is 166 registers a thread at head_dim 64 and 222 at 128, no spills (nvcc 13,
    sm_90). Not yet tuned on a GPU: perf/prefill_check.py times the alternatives beside it."""
    return (4, 1, 64, 2)


def prefill_name(dt: int, head_dim: int, group: int, block_size: int, config=None,
                 kv8: bool = False) -> str:
    """The template instance of ``paged_prefill`` for these parameters (``dt``: q's dtype
    code; ``kv8``: an int8 cache)."""
    nwarps, mt, kv_tile, stages = config or prefill_config(head_dim)
    return (f"paged_prefill<{dt}, {head_dim}, {group}, {block_size}, {nwarps}, {mt}, "
            f"{kv_tile}, {stages}{', 1' if kv8 else ''}>")


def grid_ctas(total_tokens: int, batch: int, group: int, rows_per_cta: int) -> int:
    """CTAs along the grid's x, enough for every query tile without reading the lengths
    (they are on the GPU): sequence b has ceil(n_b * group / rows) tiles, and these add up to
    fewer than ceil(total * group / rows) + batch. The spare CTAs return at once."""
    if total_tokens == 0 or batch == 0:
        return 0
    return cdiv(total_tokens * group, rows_per_cta) + batch - 1


def _smem(head_dim: int, kv_tile: int, stages: int, kv8: bool = False) -> int:
    """Dynamic shared memory of one CTA: STAGES tiles of kv_tile K rows and kv_tile V rows of
    head_dim + 8 two-byte numbers; with an int8 cache, STAGES tiles of int8 rows and their
    scale pairs, and one tile of two-byte numbers."""
    tile16 = 2 * kv_tile * (head_dim + 8) * 2
    if kv8:
        return stages * (2 * kv_tile * head_dim + kv_tile * head_dim // 32 * 4) + tile16
    return stages * tile16


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """How one problem shape is launched; made (and cached) by :func:`prefill_plan`.

    ``rows_per_cta`` query rows (new token x query head of a group) per CTA; ``kv_tile`` keys
    per K/V tile; ``registers`` and ``spill_bytes`` (local memory per thread) as the compiler
    reported them.
    """
    kernel: str
    threads: int
    rows_per_cta: int
    kv_tile: int
    smem_bytes: int
    registers: int
    spill_bytes: int
    _fn: object = dataclasses.field(repr=False, compare=False)

    def run(self, q, cache, block_tables, query_start, seq_lens, out=None, scale=None):
        """Launch on CuPy arrays of the shapes this plan was made for, without checking them
        (:func:`paged_prefill_attention` checks)."""
        cp = backend.xp
        total, q_heads, d = q.shape
        kv_heads, batch = cache.shape[3], seq_lens.shape[0]
        scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
        if out is None:
            out = cp.empty_like(q)
        elif not out.flags.c_contiguous:
            raise ConfigError("out must be C-contiguous")
        x = grid_ctas(total, batch, q_heads // kv_heads, self.rows_per_cta)
        if x:
            self._fn((x, kv_heads), (self.threads,),
                     (q, cache.raw if isinstance(cache, Cache8) else cache, block_tables,
                      query_start, seq_lens, out, np.int32(batch),
                      np.int32(kv_heads), np.int32(block_tables.shape[1]),
                      np.float32(scale * 1.4426950408889634)),   # log2(e): the kernel uses exp2
                     shared_mem=self.smem_bytes)
        return out


def prefill_plan(q, cache, block_tables, query_start=None, seq_lens=None, *,
                 config=None) -> PrefillPlan:
    """The GPU launch :func:`paged_prefill_attention` would make for these arrays' shapes
    (``query_start`` and ``seq_lens`` default to one sequence). ``config`` overrides the
    launch shape: (warps per CTA, 16-row pieces per warp, keys per tile, ring stages)."""
    batch = block_tables.shape[0]
    if query_start is None:
        query_start = np.zeros(batch + 1, np.int32)
    if seq_lens is None:
        seq_lens = np.zeros(batch, np.int32)
    kv_dtype = check_prefill(q, cache, block_tables, query_start, seq_lens)
    return _choose(q, cache, kv_dtype, config)


def _choose(q, cache, kv_dtype, config):
    if dtype_name(q) == "float32":
        raise ConfigError("the prefill kernel takes float16 or bfloat16 on the GPU, got "
                          "float32")
    if config is not None:
        config = tuple(int(c) for c in config)
        nwarps, mt, kv_tile, stages = config
        if not (nwarps >= 1 and mt >= 1 and kv_tile % 16 == 0 and kv_tile > 0 and stages >= 2):
            raise ConfigError(f"config (warps, pieces per warp, keys per tile, stages) must "
                              f"be >= 1, >= 1, a multiple of 16, >= 2; got {config}")
    return _plan(q.shape[1], tuple(cache.shape), kv_dtype, config, dtype_name(q))


@functools.lru_cache(maxsize=64)
def _plan(q_heads, cache_shape, kv_dtype, config, q_dtype=None):
    _, _, bs, kv_heads, d = cache_shape
    kv8 = kv_dtype == INT8
    group, code = q_heads // kv_heads, DTYPE_CODES[q_dtype or kv_dtype]
    nwarps, mt, kv_tile, stages = config or prefill_config(d)
    name = prefill_name(code, d, group, bs, (nwarps, mt, kv_tile, stages), kv8)
    fn = kernel(load_source(PREFILL_SOURCE), name)
    smem = _smem(d, kv_tile, stages, kv8)
    allow_dynamic_smem(fn, smem)
    return PrefillPlan(name, nwarps * 32, nwarps * mt * 16, kv_tile, smem,
                       fn_attr(fn, "num_regs", -1), fn_attr(fn, "local_size_bytes", -1), fn)


_checked = {}   # (shapes, dtypes, options) already checked -> their PrefillPlan


def paged_prefill_attention(q, cache, block_tables, query_start, seq_lens, *, scale=None,
                            out=None, config=None):
    """Causal attention of each sequence's new tokens over its paged K/V.

    Sequence ``b``'s new tokens (rows ``query_start[b] .. query_start[b + 1] - 1`` of ``q``)
    sit at positions ``seq_lens[b] - n_b .. seq_lens[b] - 1``; the one at position ``p``
    attends to positions ``0 .. p``. Their K/V must be in the cache already. ``scale`` (> 0)
    defaults to ``1/sqrt(head_dim)``; ``out`` may be given. uint16 arrays are taken as
    bfloat16 bits. ``config`` overrides the GPU launch shape (see :func:`prefill_plan`).

    On NumPy arrays the kernel's algorithm runs in NumPy (float32 arithmetic; float32 data is
    accepted there) and the offsets, lengths and table entries are checked; on CuPy arrays
    (float16 or bfloat16) they are trusted, since reading them would stall the GPU. Positions
    past a sequence's length are never read, whatever the pool holds there.
    """
    config = None if config is None else tuple(config)
    if scale is not None and not float(scale) > 0:
        raise ConfigError(f"scale must be positive (the kernel takes row maxima of the raw "
                          f"scores), got {scale}")
    if is_cupy(cache):
        key = (q.shape, q.dtype, cache.shape, cache.dtype, block_tables.shape,
               block_tables.dtype, query_start.shape, query_start.dtype, seq_lens.shape,
               seq_lens.dtype, None if out is None else (out.shape, out.dtype), config)
        plan = _checked.get(key)
        if plan is None or not cache.flags.c_contiguous:
            kv_dtype = check_prefill(q, cache, block_tables, query_start, seq_lens, out)
            plan = _choose(q, cache, kv_dtype, config)
            if len(_checked) >= 1024:
                _checked.clear()
            _checked[key] = plan
        q, block_tables, query_start, seq_lens = (
            contiguous_on_device(a) for a in (q, block_tables, query_start, seq_lens))
        return plan.run(q, cache, block_tables, query_start, seq_lens, out, scale)
    kv_dtype = check_prefill(q, cache, block_tables, query_start, seq_lens, out)
    scale = 1.0 / math.sqrt(q.shape[2]) if scale is None else float(scale)
    res = prefill_numpy(q, cache, np.asarray(block_tables), np.asarray(query_start),
                        np.asarray(seq_lens), scale, kv_dtype)
    res = to_dtype(res, dtype_name(q), q)
    if out is None:
        return res
    out[...] = res
    return out
