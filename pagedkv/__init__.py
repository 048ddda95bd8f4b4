"""pagedkv: a paged KV-cache memory manager, built chapter by chapter.

GPU memory is claimed once as a pool and cut into uniform blocks (:mod:`pagedkv.allocator`);
each sequence's page table maps token positions to scattered blocks (:mod:`pagedkv.page_table`);
a manager grows, forks and frees sequences and plans the copies and slot mappings that kernels
execute (:mod:`pagedkv.manager`).
"""
from .errors import (AllocatorClosed, AuditError, BackendError, ConfigError, DoubleFree,
                     DuplicateSequence, InvalidBlock, OutOfBlocks, PagedKVError, PoolTooLarge,
                     SequenceExists, TokenIndexError, UnknownSequence)

__version__ = "0.1.0"


def __getattr__(name):
    # The backend is chosen when it is first imported, not with the package: so a bad
    # PAGEDKV_BACKEND reaches the command line (python -m pagedkv) as an error it can report.
    if name == "backend":
        import importlib
        return importlib.import_module(f"{__name__}.backend")
    raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
