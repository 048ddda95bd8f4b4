"""CuPy kernels (CUDA C inside RawModules), each with a NumPy reference used when no GPU is present.

* :mod:`pagedkv.kernels.cache_ops` — ``write_kv`` (new tokens into their slots) and
  ``copy_blocks`` (copy-on-write block copies), both one launch each;
* :mod:`pagedkv.kernels.attention` — ``paged_decode_attention`` (PagedAttention with split-K)
  and the naive gather-then-attend version the chapter starts from.
"""
from .attention import (choose_num_splits, dense_attention, gather_kv, paged_decode_attention,
                        paged_decode_attention_ref)
from .cache_ops import copy_blocks, copy_blocks_ref, write_kv, write_kv_ref

__all__ = ["write_kv", "write_kv_ref", "copy_blocks", "copy_blocks_ref",
           "paged_decode_attention", "paged_decode_attention_ref", "gather_kv", "dense_attention",
           "choose_num_splits"]
