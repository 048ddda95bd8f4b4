"""The physical block allocator: one pool of device memory, cut into uniform blocks.

The pool is claimed once, at construction, as ``num_blocks * block_bytes`` bytes on the device
(NumPy memory when no GPU is usable). After that, allocating or freeing a block never touches the
device: it is bookkeeping on two Python lists.

* ``_free`` is a stack of free block ids. ``allocate`` pops, ``free`` pushes: O(1) each.
* ``_ref[b]`` is block ``b``'s reference count: 0 while it is free, the number of owners while
  it is in use. ``share`` adds an owner (copy-on-write sharing); ``free`` removes one and returns
  the block to the stack when the last owner lets go.

Invariants, checked by :meth:`BlockAllocator.audit`:

* ``len(_free) + num_used == num_blocks`` and no block is on the stack twice;
* ``_ref[b] == 0`` exactly for the blocks on the stack, ``_ref[b] >= 1`` for every other block.

Plain lists rather than NumPy arrays: a Python list is the fastest container for one item at a
time (an allocate-and-free round trip is a few hundred nanoseconds; a NumPy scalar access alone
costs about a hundred). Batched work converts once, in :meth:`allocate_n`.
"""
from __future__ import annotations

import numpy as np

from . import backend
from .errors import ConfigError, DoubleFree, InvalidBlock, OutOfBlocks

__all__ = ["BlockAllocator"]


def _positive_int(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    if value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value}")
    return int(value)


def _device_pool(nbytes: int, xp):
    """A 1-D uint8 array of ``nbytes`` backed by its own allocation.

    On CuPy the bytes come from ``cudaMalloc`` directly, not from CuPy's caching memory pool, so
    that :meth:`BlockAllocator.close` really returns them to the device.
    """
    if xp is np:
        return np.empty(nbytes, dtype=np.uint8)
    mem = xp.cuda.Memory(nbytes)
    return xp.ndarray((nbytes,), dtype=xp.uint8, memptr=xp.cuda.MemoryPointer(mem, 0))


class BlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_bytes`` bytes each, with O(1) allocate/free.

    >>> with BlockAllocator(num_blocks=4, block_bytes=64) as alloc:
    ...     a = alloc.allocate(); b = alloc.allocate()
    ...     alloc.free(a); alloc.num_free
    3
    """

    __slots__ = ("num_blocks", "block_bytes", "xp", "pool", "_free", "_ref", "_closed")

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        self.num_blocks = _positive_int(num_blocks, "num_blocks")
        self.block_bytes = _positive_int(block_bytes, "block_bytes")
        self.xp = backend.xp if xp is None else xp
        self.pool = _device_pool(self.num_blocks * self.block_bytes, self.xp)
        # Stack of free ids, lowest id on top, so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(self.num_blocks - 1, -1, -1))
        self._ref: list[int] = [0] * self.num_blocks
        self._closed = False

    @classmethod
    def from_pool_bytes(cls, pool_bytes: int, block_bytes: int, *, xp=None) -> "BlockAllocator":
        """As many whole blocks as fit in ``pool_bytes``; the remainder is not claimed."""
        pool_bytes = _positive_int(pool_bytes, "pool_bytes")
        block_bytes = _positive_int(block_bytes, "block_bytes")
        if pool_bytes < block_bytes:
            raise ConfigError(f"a pool of {pool_bytes} bytes cannot hold one block of "
                              f"{block_bytes} bytes")
        return cls(pool_bytes // block_bytes, block_bytes, xp=xp)

    # ------------------------------------------------------------------ the hot path
    def allocate(self) -> int:
        """Pop a free block, give it one owner and return its id. Raises :class:`OutOfBlocks`."""
        free = self._free
        if free:
            b = free.pop()
            self._ref[b] = 1
            return b
        self._check_open()
        raise OutOfBlocks(1, 0, "allocate")

    def free(self, block: int) -> None:
        """Drop one owner of ``block``; the last owner's free puts it back on the free stack."""
        ref = self._ref
        try:  # the common case, kept short: a plain int id whose sole owner lets go
            if type(block) is int and ref[block] == 1 and block >= 0:
                ref[block] = 0
                self._free.append(block)
                return
        except IndexError:
            pass
        self._release_slow(block)

    def _release_slow(self, block) -> None:
        self._check_open()
        b = self._check_id(block)
        count = self._ref[b]
        if count == 0:
            raise DoubleFree(f"block {b} is already free")
        self._ref[b] = count - 1
        if count == 1:
            self._free.append(b)

    # ------------------------------------------------------------------ batches and sharing
    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, all or none: raises :class:`OutOfBlocks` and allocates nothing if fewer
        than ``n`` are free."""
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"n must be a non-negative integer, got {n!r}")
        free = self._free
        if n > len(free):
            raise OutOfBlocks(n, len(free), "allocate_n")
        if n == 0:
            return []
        blocks = free[:-n - 1:-1]  # the order n calls of allocate() would give
        del free[-n:]
        ref = self._ref
        for b in blocks:
            ref[b] = 1
        return blocks

    def free_n(self, blocks) -> None:
        """Drop one owner of each block in ``blocks`` (a block may appear more than once, once
        per owner dropped). All or nothing: a bad id or an over-free raises first."""
        self._check_open()
        blocks = [self._check_id(b) for b in blocks]
        need: dict[int, int] = {}
        for b in blocks:
            need[b] = need.get(b, 0) + 1
        ref = self._ref
        for b, k in need.items():
            if ref[b] < k:
                raise DoubleFree(f"block {b} has {ref[b]} owner(s), cannot drop {k}")
        for b in blocks:
            self.free(b)

    def share(self, block: int) -> None:
        """Add an owner to an allocated block (copy-on-write sharing)."""
        self._check_open()
        b = self._check_id(block)
        if self._ref[b] == 0:
            raise InvalidBlock(f"cannot share block {b}: it is free")
        self._ref[b] += 1

    def share_n(self, blocks, times: int = 1) -> None:
        """Add ``times`` owners to each block in ``blocks`` (a fork shares a whole page table).
        All or nothing: every block must be allocated."""
        self._check_open()
        ref, n = self._ref, self.num_blocks
        done = 0
        try:
            for b in blocks:
                if type(b) is not int or not 0 <= b < n or ref[b] == 0:
                    self._check_id(b)
                    raise InvalidBlock(f"cannot share block {b}: it is free")
                ref[b] += times
                done += 1
        except InvalidBlock:
            for b in blocks[:done]:            # undo: all or nothing
                ref[b] -= times
            raise

    def _add_owners(self, blocks: list, times: int) -> None:
        """``share_n`` without the checks, for a caller whose own invariants guarantee every id
        is an allocated block (the manager's page tables: see its ``audit``)."""
        ref = self._ref
        for b in blocks:
            ref[b] += times

    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        return self._ref[self._check_id(block)]

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    # ------------------------------------------------------------------ state
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def free_blocks(self) -> list[int]:
        """The free stack, bottom first (the next ``allocate`` returns the last element)."""
        return list(self._free)

    def refcounts(self) -> np.ndarray:
        """Every block's reference count, as a NumPy array (a copy)."""
        return np.array(self._ref, dtype=np.int64)

    def audit(self) -> None:
        """Check the invariants; raise ``AssertionError`` naming the first one broken."""
        self._check_open()
        ref = self.refcounts()
        free = np.array(self._free, dtype=np.int64)
        assert len(free) + self.num_used == self.num_blocks, "free + used != total"
        assert len(np.unique(free)) == len(free), "a block is on the free stack twice"
        assert ((free >= 0) & (free < self.num_blocks)).all(), "a free id outside the pool"
        assert (ref[free] == 0).all(), "a block on the free stack has owners"
        assert (ref >= 0).all(), "a negative reference count"
        assert int((ref == 0).sum()) == len(free), "a block with no owner is not on the stack"

    # ------------------------------------------------------------------ memory
    def _check_id(self, block) -> int:
        if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
            raise InvalidBlock(f"a block id must be an integer, got {block!r}")
        if not 0 <= block < self.num_blocks:
            raise InvalidBlock(f"block id {block} is outside the pool [0, {self.num_blocks})")
        return int(block)

    def block_view(self, block: int):
        """The bytes of one block, a view into the pool (uint8, ``block_bytes`` long)."""
        self._check_open()
        b = self._check_id(block)
        return self.pool[b * self.block_bytes:(b + 1) * self.block_bytes]

    def view(self, dtype, block_shape) -> object:
        """The whole pool seen as ``[num_blocks, *block_shape]`` of ``dtype`` (no copy).

        ``block_shape`` must fill a block exactly, e.g. ``(2, block_size, kv_heads, head_dim)``
        for a layer's K and V.
        """
        self._check_open()
        dtype = np.dtype(dtype)
        block_shape = tuple(int(s) for s in block_shape)
        nbytes = int(np.prod(block_shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != self.block_bytes:
            raise ConfigError(f"block shape {block_shape} of {dtype} is {nbytes} bytes; "
                              f"a block is {self.block_bytes} bytes")
        return self.pool.view(dtype).reshape((self.num_blocks,) + block_shape)

    def block_address(self, block: int) -> int:
        """The device (or host, on NumPy) address of the first byte of ``block``."""
        self._check_open()
        b = self._check_id(block)
        base = self.pool.ctypes.data if self.xp is np else self.pool.data.ptr
        return base + b * self.block_bytes

    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("the allocator is closed; its pool has been returned")

    def close(self) -> None:
        """Return the pool's memory. Views taken earlier keep their bytes alive until dropped."""
        if not self._closed:
            self._closed = True
            self.pool = None
            self._free = []
            self._ref = [0] * self.num_blocks

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "BlockAllocator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self.num_free} free"
        return (f"BlockAllocator({self.num_blocks} blocks x {self.block_bytes} B, {state}, "
                f"{backend.name})")
