"""The physical block allocator: one pool of memory, cut into uniform blocks.

The pool is claimed once, as ``num_blocks * block_bytes`` bytes on the device (host memory
when no GPU is usable); after that, allocating or freeing a block is bookkeeping on two
Python lists on the host. State, and the invariants :meth:`BlockAllocator.audit` checks::

    _free       the ids of the free blocks, a stack: allocate pops the end, free appends
    _refcount   _refcount[b] is the number of owners of block b (0: free)
    num_shared  how many blocks have more than one owner (kept up to date: O(1) to read)

* a block is on the free stack if and only if its refcount is 0, and at most once,
  so ``num_free + num_used == num_blocks`` always.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from . import backend
from .checks import count, is_int, positive_int
from .errors import (AllocatorClosed, AuditError, ConfigError, DoubleFree, InvalidBlock,
                     OutOfBlocks)

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_bytes`` bytes each, with O(1) allocate/free.

    >>> with BlockAllocator(num_blocks=4, block_bytes=64) as alloc:
    ...     a = alloc.allocate(); b = alloc.allocate()
    ...     alloc.free(a); alloc.num_free
    3
    """

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        self.num_blocks = positive_int(num_blocks, "num_blocks")
        self.block_bytes = positive_int(block_bytes, "block_bytes")
        self.xp = backend.xp if xp is None else xp
        self.pool = backend.claim_bytes(self.num_blocks * self.block_bytes, self.xp)
        # lowest id on top, so a fresh pool hands out blocks 0, 1, 2, ... in order
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._refcount = [0] * self.num_blocks
        self.num_shared = 0

    # ------------------------------------------------------------------ one block
    def allocate(self) -> int:
        """Pop a free block, give it one owner, return its id. Raises :class:`OutOfBlocks`."""
        self._check_open()
        if not self._free:
            raise OutOfBlocks(1, 0, "allocate")
        block = self._free.pop()
        self._refcount[block] = 1
        return block

    def free(self, block: int) -> None:
        """Drop one owner of ``block``; when the last one goes, push it onto the free stack."""
        b = self._check_id(block)
        if self._refcount[b] == 0:
            raise DoubleFree(f"block {b} is already free")
        self._refcount[b] -= 1
        if self._refcount[b] == 0:
            self._free.append(b)
        elif self._refcount[b] == 1:
            self.num_shared -= 1

    def share(self, block: int) -> None:
        """Add an owner to an allocated block (copy-on-write sharing, chapter 7)."""
        self.share_n([block])

    # ---------------------------------------------------------- many blocks, all or nothing
    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, in the order ``n`` calls of :meth:`allocate` would give them. If fewer
        than ``n`` are free, raises :class:`OutOfBlocks` and takes none."""
        n = count(n, "n")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, "allocate_n")
        return [self.allocate() for _ in range(n)]

    def free_n(self, blocks) -> None:
        """Drop one owner of each block in ``blocks``, in order (an id may repeat). All or
        nothing: a bad id, or more drops than owners, raises and frees nothing."""
        self._check_open()
        ids = [self._check_id(b) for b in blocks]
        for b, drops in Counter(ids).items():
            if drops > self._refcount[b]:
                raise DoubleFree(f"block {b} has {self._refcount[b]} owner(s), "
                                 f"cannot drop {drops}")
        for b in ids:
            self.free(b)

    def share_n(self, blocks, times: int = 1) -> None:
        """Add ``times`` owners to each block in ``blocks`` (a fork shares a whole page table).
        All or nothing: if any block is bad or free, raises and shares none."""
        self._check_open()
        times = positive_int(times, "times")
        ids = [self._check_id(b) for b in blocks]
        for b in ids:
            if self._refcount[b] == 0:
                raise InvalidBlock(f"cannot share block {b}: it is free")
        for b in ids:
            self.num_shared += self._refcount[b] == 1
            self._refcount[b] += times

    # ------------------------------------------------------------------ state
    def _check_open(self) -> None:
        if self.pool is None:
            raise AllocatorClosed("the allocator is closed; its pool has been given back")

    def _check_id(self, block) -> int:
        """``block`` as an ``int`` if it names a block of this pool, else :class:`InvalidBlock`."""
        self._check_open()
        if not is_int(block):
            raise InvalidBlock(f"a block id must be an integer, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise InvalidBlock(f"block id {block} is outside the pool [0, {self.num_blocks})")
        return int(block)

    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        return self._refcount[self._check_id(block)]

    def refcounts(self) -> np.ndarray:
        """Every block's owner count (a NumPy copy)."""
        return np.array(self._refcount, dtype=np.int64)

    def free_blocks(self) -> list[int]:
        """The free stack, bottom first: the next :meth:`allocate` returns the last one."""
        return list(self._free)

    @property
    def num_free(self) -> int:
        self._check_open()              # a closed pool has nothing to hand out
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def audit(self) -> None:
        """Check the invariants; raise :class:`AuditError` naming the first one broken."""
        self._check_open()
        free, refs, n = self._free, self._refcount, self.num_blocks
        if len(refs) != n or any(not is_int(r) or r < 0 for r in refs):
            raise AuditError("refcounts: one per block, each a non-negative integer")
        if any(not is_int(b) or not 0 <= b < n for b in free):
            raise AuditError("the free stack holds an id outside the pool")
        on_stack = set(free)
        if len(on_stack) != len(free):
            raise AuditError("a block is on the free stack twice")
        for b in range(n):
            if (refs[b] == 0) != (b in on_stack):
                raise AuditError(f"block {b} has {refs[b]} owner(s) but is "
                                 f"{'on' if b in on_stack else 'not on'} the free stack")
        if self.num_shared != sum(r > 1 for r in refs):
            raise AuditError(f"num_shared is {self.num_shared} but "
                             f"{sum(r > 1 for r in refs)} blocks have several owners")

    # ------------------------------------------------------------------ the memory
    pool_bytes = property(lambda self: self.num_blocks * self.block_bytes)

    def block_view(self, block: int):
        """The bytes of one block, a view into the pool (uint8, ``block_bytes`` long)."""
        b = self._check_id(block)
        return self.pool[b * self.block_bytes:(b + 1) * self.block_bytes]

    def view(self, dtype, block_shape):
        """The pool as ``[num_blocks, *block_shape]`` of ``dtype``, no copy. ``block_shape``
        fills a block exactly, e.g. ``(2, block_size, kv_heads, head_dim)`` for K and V."""
        self._check_open()
        dtype, block_shape = np.dtype(dtype), tuple(int(s) for s in block_shape)
        nbytes = int(np.prod(block_shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != self.block_bytes:
            raise ConfigError(f"block shape {block_shape} of {dtype} is {nbytes} bytes; "
                              f"a block is {self.block_bytes} bytes")
        return self.pool.view(dtype).reshape((self.num_blocks,) + block_shape)

    def block_address(self, block: int) -> int:
        """The address of the first byte of ``block`` (on the device, or in host memory)."""
        b = self._check_id(block)
        base = self.pool.ctypes.data if self.xp is np else self.pool.data.ptr
        return base + b * self.block_bytes

    def close(self) -> None:
        """Give the pool back. Views taken earlier keep their bytes alive until dropped."""
        self.pool = None

    closed = property(lambda self: self.pool is None, doc="True once close() has run.")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self.num_free} free"
        return f"BlockAllocator({self.num_blocks} blocks x {self.block_bytes} B, {state})"
