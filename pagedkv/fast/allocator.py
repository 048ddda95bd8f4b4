"""The physical block allocator: one pool of device memory, cut into uniform blocks.

The pool is claimed once, at construction, as ``num_blocks * block_bytes`` bytes on the device
(NumPy memory when no GPU is usable). After that, allocating or freeing a block never touches the
device: it is bookkeeping on the host.

The bookkeeping has two speeds, because Python has two kinds of fast:

* **One block at a time** (``allocate``, ``free``) is fastest on plain Python lists: reading or
  writing a list item costs about 17 ns, a NumPy scalar about 80.
* **Many blocks at once** (``allocate_array``, ``free_n``, ``share_n``: a decode step that
  gives a new block to each of 1024 sequences) is fastest in NumPy: one call moves the 1024 ids,
  where a Python loop over them costs some 20 µs.

So the state is split, and each part has one job:

* The free stack is ``_stack[:_top]`` (a NumPy array) with the Python list ``_hot`` on top
  of it. ``allocate`` pops ``_hot`` (refilling it from ``_stack`` a chunk at a time); ``free``
  pushes onto ``_hot``. Batched calls first move ``_hot`` back onto ``_stack``, then slice it.
  Either way the order is one stack's: the next block out is the last one put back.
* A block's owner count lives in exactly one of two places. ``_solo[b] == 1`` marks a block
  taken by ``allocate`` that still has its one owner (a list, for the fast path); every other
  count is ``_ref[b]`` (a NumPy int32 array). A block is free when both are 0. Sharing a solo
  block moves its count into ``_ref``.

Invariants, checked by :meth:`BlockAllocator.audit`:

* the free stack holds every block with no owner, each once, and nothing else;
* no block counts in both ``_solo`` and ``_ref``; ``_solo`` holds only 0 and 1;
* ``_bulk_used`` is the number of blocks whose count is in ``_ref``.
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

    __slots__ = ("num_blocks", "block_bytes", "xp", "pool", "_stack", "_top", "_hot", "_solo",
                 "_ref", "_bulk_used", "_closed")

    #: How many ids ``allocate`` moves from ``_stack`` to ``_hot`` when ``_hot`` runs dry.
    REFILL = 64

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        self.num_blocks = n = _positive_int(num_blocks, "num_blocks")
        self.block_bytes = _positive_int(block_bytes, "block_bytes")
        self.xp = backend.xp if xp is None else xp
        self.pool = _device_pool(n * self.block_bytes, self.xp)
        # The free stack, lowest id on top, so a fresh pool hands out 0, 1, 2, ...
        self._stack = np.arange(n - 1, -1, -1, dtype=np.intp)
        self._top = n                   # _stack[:_top] is free; _hot sits on top of it
        self._hot: list[int] = []
        # _solo[b] == 1: taken by allocate(), one owner. The second half holds -1 guards, so
        # a negative id (which a list would wrap around) lands on a guard and takes the slow,
        # checking path instead of the fast one.
        self._solo: list[int] = [0] * n + [-1] * n
        self._ref = np.zeros(n, dtype=np.int32)    # every other owner count
        self._bulk_used = 0             # blocks whose count is in _ref
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

    # ------------------------------------------------------------------ one block at a time
    def allocate(self) -> int:
        """Pop a free block, give it one owner and return its id. Raises :class:`OutOfBlocks`."""
        try:
            b = self._hot.pop()
        except IndexError:
            self._refill()
            b = self._hot.pop()
        self._solo[b] = 1
        return b

    def free(self, block: int) -> None:
        """Drop one owner of ``block``; the last owner's free puts it back on the free stack."""
        solo = self._solo
        try:  # the common case, kept short: a plain int id whose one owner lets go
            if solo[block] == 1 and type(block) is int:
                solo[block] = 0
                self._hot.append(block)
                return
        except (IndexError, TypeError):
            pass
        self._release_slow(block)

    def _release_slow(self, block) -> None:
        """``free`` for everything else: a shared block, a NumPy integer id, a bad id, a block
        that is already free, a closed allocator."""
        self._check_open()
        b = self._check_id(block)
        if self._solo[b] == 1:
            self._solo[b] = 0
            self._hot.append(b)
            return
        count = int(self._ref[b])
        if count == 0:
            raise DoubleFree(f"block {b} is already free")
        self._ref[b] = count - 1
        if count == 1:
            self._bulk_used -= 1
            self._hot.append(b)

    def _refill(self) -> None:
        """Move the top ``REFILL`` ids of ``_stack`` onto the empty ``_hot`` (same order)."""
        self._check_open()
        top = self._top
        if not top:
            raise OutOfBlocks(1, 0, "allocate")
        k = min(top, self.REFILL)
        self._hot.extend(self._stack[top - k:top].tolist())
        self._top = top - k

    def share(self, block: int) -> None:
        """Add an owner to an allocated block (copy-on-write sharing)."""
        self._check_open()
        b = self._check_id(block)
        if self._solo[b] == 1:           # two owners now: the count moves to _ref
            self._solo[b] = 0
            self._ref[b] = 2
            self._bulk_used += 1
        elif self._ref[b] == 0:
            raise InvalidBlock(f"cannot share block {b}: it is free")
        else:
            self._ref[b] += 1

    # ------------------------------------------------------------------ many blocks at once
    def allocate_array(self, n: int, _caller: str = "allocate_array") -> np.ndarray:
        """``n`` blocks as an int32 array, all or none: raises :class:`OutOfBlocks` and takes
        nothing if fewer than ``n`` are free. The order is the one ``n`` calls of
        :meth:`allocate` would give."""
        self._check_open()
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ConfigError(f"n must be a non-negative integer, got {n!r}")
        free = self._top + len(self._hot)
        if n > free:
            raise OutOfBlocks(int(n), free, _caller)
        if n == 0:
            return np.zeros(0, dtype=np.int32)
        return self._take(int(n))

    def _pop(self, n: int) -> np.ndarray:
        """Take the top ``n`` ids off the stack (``0 < n <= num_free``, unchecked) and give each
        one owner in ``_ref``. Returns them as a view of the stack, bottom first, valid until
        the next push. The stack holds intp ids because NumPy scatters through intp indices
        about three times faster than through int32 ones."""
        if self._hot:
            self._spill()
        top = self._top - n
        ids = self._stack[top:top + n]
        self._ref[ids] = 1
        self._top = top
        self._bulk_used += n
        return ids

    def _take(self, n: int) -> np.ndarray:
        """``allocate_array`` without the checks: int32 ids (the block tables' type), the top
        of the stack first."""
        return self._pop(n)[::-1].astype(np.int32)

    def _take_list(self, n: int) -> list[int]:
        """``_take`` as a list of Python ints, for a caller about to loop over a few ids."""
        out = self._pop(n).tolist()
        out.reverse()
        return out

    def allocate_n(self, n: int) -> list[int]:
        """:meth:`allocate_array` as a list of Python ints."""
        return self.allocate_array(n, "allocate_n").tolist()

    def free_n(self, blocks) -> None:
        """Drop one owner of each block in ``blocks`` (a block may appear more than once, once
        per owner dropped). All or nothing: a bad id or an over-free raises first."""
        self._check_open()
        ids = self._ids(blocks)
        if not len(ids):
            return
        self._promote(ids)
        uniq, counts = np.unique(ids, return_counts=True)
        have = self._ref[uniq]
        short = np.flatnonzero(have < counts)
        if len(short):
            i = short[0]
            raise DoubleFree(f"block {uniq[i]} has {have[i]} owner(s), cannot drop {counts[i]}")
        self._release(ids, unique=len(uniq) == len(ids))

    def share_n(self, blocks, times: int = 1) -> None:
        """Add ``times`` owners to each block in ``blocks`` (a fork shares a whole page table).
        All or nothing: every block must be allocated."""
        self._check_open()
        times = _positive_int(times, "times")
        ids = self._ids(blocks)
        if not len(ids):
            return
        self._promote(ids)
        free = np.flatnonzero(self._ref[ids] == 0)
        if len(free):
            raise InvalidBlock(f"cannot share block {ids[free[0]]}: it is free")
        np.add.at(self._ref, ids, times)

    # The manager's calls. Its own invariants (see KVCacheManager.audit) guarantee that the ids
    # are allocated blocks and that one call never names a block twice, so these skip checks.
    def _add_owners(self, ids: np.ndarray, times: int) -> None:
        """``share_n`` without the checks, for distinct allocated ids."""
        ids = ids.astype(np.intp, copy=False)
        self._promote(ids)
        self._ref[ids] += times

    def _drop_owners(self, ids: np.ndarray, unique: bool = True) -> None:
        """``free_n`` without the checks (``unique``: no id appears twice)."""
        ids = ids.astype(np.intp, copy=False)
        self._promote(ids)
        self._release(ids, unique)

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        """Owner counts of ``ids`` (int32), without checks."""
        counts = self._ref[ids]
        if self._num_solo():
            counts = counts + np.array([self._solo[b] for b in ids.tolist()], dtype=np.int32)
        return counts

    def _num_solo(self) -> int:
        return self.num_blocks - self._top - len(self._hot) - self._bulk_used

    def _promote(self, ids: np.ndarray) -> None:
        """Move the counts of any solo blocks among ``ids`` into ``_ref`` (batched calls work
        on ``_ref`` alone). Nothing to do, in O(1), when no block is solo."""
        if self._num_solo():
            solo, ref = self._solo, self._ref
            for b in ids.tolist():
                if solo[b] == 1:
                    solo[b] = 0
                    ref[b] = 1
                    self._bulk_used += 1

    def _release(self, ids: np.ndarray, unique: bool) -> None:
        """Drop one owner per entry of ``ids`` (counts in ``_ref``, checked by the caller) and
        push the blocks that lost their last owner, in the order of their last mention."""
        ref = self._ref
        if unique:
            left = ref[ids] - 1
            ref[ids] = left
            gone = ids[left == 0]
        else:
            np.subtract.at(ref, ids, 1)
            rev_first = np.unique(ids[::-1], return_index=True)[1]
            last = np.sort(len(ids) - 1 - rev_first)    # position of each id's last mention
            gone = ids[last[ref[ids[last]] == 0]]
        if len(gone):
            self._spill()
            top = self._top
            self._stack[top:top + len(gone)] = gone
            self._top = top + len(gone)
            self._bulk_used -= len(gone)

    def _spill(self) -> None:
        """Move ``_hot`` onto ``_stack`` (same order), so the whole free stack is in NumPy."""
        hot = self._hot
        if hot:
            top = self._top
            self._stack[top:top + len(hot)] = hot
            self._top = top + len(hot)
            hot.clear()

    def _ids(self, blocks) -> np.ndarray:
        """``blocks`` (a sequence of integers or a 1-D integer array) as checked intp ids."""
        if isinstance(blocks, np.ndarray):
            if blocks.ndim != 1 or blocks.dtype.kind not in "iu":
                raise InvalidBlock(f"block ids must be a 1-D integer array, got "
                                   f"{blocks.dtype} of shape {blocks.shape}")
            ids = blocks.astype(np.intp)
        else:
            blocks = list(blocks)
            for b in blocks:
                if type(b) is not int:
                    self._check_id(b)              # raises for anything but an integer
            ids = np.array(blocks, dtype=np.intp) if blocks else np.zeros(0, np.intp)
        if len(ids):
            bad = np.flatnonzero((ids < 0) | (ids >= self.num_blocks))
            if len(bad):
                self._check_id(int(ids[bad[0]]))   # raises with the message
        return ids

    # ------------------------------------------------------------------ state
    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        b = self._check_id(block)
        return self._solo[b] or int(self._ref[b])

    def can_allocate(self, n: int = 1) -> bool:
        return n <= self._top + len(self._hot)

    @property
    def num_free(self) -> int:
        return self._top + len(self._hot)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._top - len(self._hot)

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def free_blocks(self) -> list[int]:
        """The free stack, bottom first (the next ``allocate`` returns the last element)."""
        return self._stack[:self._top].tolist() + self._hot

    def refcounts(self) -> np.ndarray:
        """Every block's reference count, as a NumPy array (a copy)."""
        ref = self._ref.astype(np.int64)
        if self._num_solo():
            ref += np.array(self._solo[:self.num_blocks], dtype=np.int64)
        return ref

    def audit(self) -> None:
        """Check the invariants; raise ``AssertionError`` naming the first one broken."""
        self._check_open()
        n = self.num_blocks
        assert 0 <= self._top <= n and self._top + len(self._hot) <= n, "the free stack overflows"
        free = np.array(self.free_blocks(), dtype=np.int64)
        assert ((free >= 0) & (free < n)).all(), "a free id outside the pool"
        assert len(np.unique(free)) == len(free), "a block is on the free stack twice"
        solo = np.array(self._solo, dtype=np.int64)
        assert len(solo) == 2 * n and (solo[n:] == -1).all(), "the guards after _solo changed"
        solo = solo[:n]
        ref = self._ref.astype(np.int64)
        assert np.isin(solo, (0, 1)).all(), "a solo flag other than 0 or 1"
        assert (ref >= 0).all(), "a negative reference count"
        assert not ((solo == 1) & (ref > 0)).any(), "a block counted in both _solo and _ref"
        owners = solo + ref
        assert (owners[free] == 0).all(), "a block on the free stack has owners"
        assert int((owners == 0).sum()) == len(free), "a block with no owner is not on the stack"
        assert self._bulk_used == int(np.count_nonzero(ref)), "_bulk_used is off"

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
            self._top = 0
            self._hot.clear()
            self._solo = [0] * self.num_blocks + [-1] * self.num_blocks
            self._ref[:] = 0
            self._bulk_used = 0

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
