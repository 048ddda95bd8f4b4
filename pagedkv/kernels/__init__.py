"""CuPy kernels (CUDA C in ``*.cu`` files beside their launchers), each with a NumPy reference
used when no GPU is present.

* :mod:`pagedkv.kernels.cache_ops` — ``write_kv`` (new tokens into their slots) and
  ``copy_blocks`` (copy-on-write block copies), both one launch each;
* :mod:`pagedkv.kernels.attention` — ``paged_decode_attention`` (PagedAttention with split-K,
  on CUDA cores or tensor cores) and ``decode_plan`` (the launch it would make);
* :mod:`pagedkv.kernels.prefill` — ``paged_prefill_attention`` (causal attention of several new
  tokens per sequence through the page tables, on tensor cores) and ``prefill_plan``;
* :mod:`pagedkv.kernels.reference` — the NumPy references: gather-then-attend, the float64
  oracles, and the kernels' algorithms in NumPy;
* :mod:`pagedkv.kernels.kv8` — the 8-bit cache (``Cache8``: int8 numbers, a float16 scale per
  32), which every kernel above writes and reads as well;
* :mod:`pagedkv.kernels.staircase` — chapter 9's seven steps from a plain loop to tensor cores.
"""
from .attention import DecodePlan, choose_num_splits, decode_plan, paged_decode_attention
from .cache_ops import copy_blocks, copy_blocks_ref, write_kv, write_kv_ref
from .prefill import PrefillPlan, paged_prefill_attention, prefill_plan
from .reference import (dense_attention, gather_kv, paged_decode_attention_ref,
                        paged_prefill_attention_ref)

__all__ = ["write_kv", "write_kv_ref", "copy_blocks", "copy_blocks_ref",
           "paged_decode_attention", "decode_plan", "DecodePlan", "paged_decode_attention_ref",
           "gather_kv", "dense_attention", "choose_num_splits", "paged_prefill_attention",
           "prefill_plan", "PrefillPlan", "paged_prefill_attention_ref"]
