"""The bookkeeping made fast: :class:`BlockAllocator` and :class:`KVCacheManager` with the API,
plans, block ids and errors of :mod:`pagedkv.allocator` and :mod:`pagedkv.manager`, built for
speed (batched NumPy steps, a two-part free stack). The chapter "Making the bookkeeping fast"
measures each idea; the tests check that both implementations agree on every operation.
"""
from .allocator import BlockAllocator
from .manager import KVCacheManager

__all__ = ["BlockAllocator", "KVCacheManager"]
