"""The block allocator made fast: the API and behaviour of :mod:`pagedkv.allocator`, with the
bookkeeping laid out for speed.

Python has two kinds of fast. One block at a time (``allocate``, ``free``) is fastest on plain
Python lists: reading or writing a list item costs tens of nanoseconds, a NumPy scalar several
times that. Many blocks at once (a decode step that hands a new block to each of 1024 sequences)
is fastest in NumPy: one call moves all the ids, where a Python loop over them costs tens of
microseconds. So the state is split, each part with one job:

    _stack[:_top]  the bottom of the free stack, a NumPy array of ids
    _hot           the top of the free stack, a Python list: ``allocate`` pops it (refilling it
                   from ``_stack`` a chunk at a time), ``free`` pushes onto it; batched calls
                   first move it back onto ``_stack`` and then slice that
    _ref           owner counts, one NumPy array: every count the batched calls make
    _solo          ``_solo[b] == b``: block ``b`` was taken by ``allocate`` and still has its
                   one owner, a count kept in a list for the one-block path (``None``
                   otherwise). The flag is the block's own id so that a negative id, which a
                   list wraps around to another item, never matches it.

Invariants, checked by :meth:`BlockAllocator.audit`:

* the free stack (``_stack[:_top]`` then ``_hot``) holds every block with no owner, once;
* a block's owner count is 1 if ``_solo[b] == b`` (then ``_ref[b] == 0``), else ``_ref[b]``;
* ``_bulk_used`` is the number of blocks whose count is in ``_ref``.

Both parts together keep the order of one stack, so the ids handed out, and the free stack,
are exactly the teaching allocator's after the same calls.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..allocator import BlockAllocator as _Teaching
from ..checks import count, is_int, positive_int
from ..errors import AuditError, DoubleFree, InvalidBlock, OutOfBlocks

__all__ = ["BlockAllocator"]


class BlockAllocator:
    """A pool of ``num_blocks`` blocks of ``block_bytes`` bytes each: the same calls, results
    and errors as :class:`pagedkv.allocator.BlockAllocator`, faster one block at a time and
    with batched calls (``_take``, ``_add_owners``, ``_drop_owners``) for the fast manager."""

    __slots__ = ("num_blocks", "block_bytes", "xp", "pool", "_stack", "_top", "_hot", "_solo",
                 "_ref", "_bulk_used")

    #: How many ids ``allocate`` moves from ``_stack`` to ``_hot`` when ``_hot`` runs dry.
    REFILL = 64

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        self.num_blocks = n = positive_int(num_blocks, "num_blocks")
        self.block_bytes = positive_int(block_bytes, "block_bytes")
        self.xp = backend.xp if xp is None else xp
        self.pool = backend.claim_bytes(n * self.block_bytes, self.xp)
        self._stack = np.arange(n - 1, -1, -1, dtype=np.intp)  # lowest id on top
        self._top = n
        self._hot: list[int] = []
        self._solo: list = [None] * n
        self._ref = np.zeros(n, dtype=np.int64)
        self._bulk_used = 0

    # The memory side (and the id check) is the teaching allocator's own code, unchanged.
    _check_open, _check_id = _Teaching._check_open, _Teaching._check_id
    pool_bytes, closed = _Teaching.pool_bytes, _Teaching.closed
    view, block_view = _Teaching.view, _Teaching.block_view
    block_address, __repr__ = _Teaching.block_address, _Teaching.__repr__
    __enter__, __exit__ = _Teaching.__enter__, _Teaching.__exit__

    # ------------------------------------------------------------------ one block
    def allocate(self) -> int:
        """Pop a free block, give it one owner, return its id (or raise OutOfBlocks)."""
        try:
            b = self._hot.pop()
        except IndexError:
            self._refill()
            b = self._hot.pop()
        self._solo[b] = b
        return b

    def free(self, block: int) -> None:
        """Drop one owner of ``block``; the last one gone, push it on the free stack."""
        solo = self._solo
        try:  # the common case, kept short: a plain int whose one owner lets go
            if solo[block] == block and type(block) is int:
                solo[block] = None
                self._hot.append(block)
                return
        except (IndexError, TypeError):  # an id past the end, or not an index at all
            pass
        self._free_slow(block)

    def _free_slow(self, block) -> None:
        """``free`` for everything else: a shared or batch-taken block, a NumPy integer,
        a bad id, a block that is already free, a closed allocator."""
        b = self._check_id(block)
        if self._solo[b] == b:
            self._solo[b] = None
            self._hot.append(b)
            return
        owners = int(self._ref[b])
        if owners == 0:
            raise DoubleFree(f"block {b} is already free")
        self._ref[b] = owners - 1
        if owners == 1:
            self._bulk_used -= 1
            self._hot.append(b)

    def _refill(self) -> None:
        """Move the top ``REFILL`` ids of ``_stack`` onto the empty ``_hot``, in order."""
        self._check_open()
        top = self._top
        if not top:
            raise OutOfBlocks(1, 0, "allocate")
        k = min(top, self.REFILL)
        self._hot.extend(self._stack[top - k:top].tolist())
        self._top = top - k

    def share(self, block: int) -> None:
        """Add an owner to an allocated block (copy-on-write sharing)."""
        b = self._check_id(block)
        if self._solo[b] == b:           # two owners now: the count moves to _ref
            self._solo[b] = None
            self._ref[b] = 2
            self._bulk_used += 1
        elif self._ref[b] == 0:
            raise InvalidBlock(f"cannot share block {b}: it is free")
        else:
            self._ref[b] += 1

    # ------------------------------------------------------------------ many, all or nothing
    def allocate_n(self, n: int) -> list[int]:
        """``n`` blocks, in the order ``n`` calls of :meth:`allocate` would give them. If fewer
        than ``n`` are free, raises :class:`OutOfBlocks` and takes none."""
        self._check_open()
        n = count(n, "n")
        if n > self.num_free:
            raise OutOfBlocks(n, self.num_free, "allocate_n")
        return self._take(n).tolist() if n else []

    def free_n(self, blocks) -> None:
        """Drop one owner of each block in ``blocks``, in order (an id may appear once per
        owner dropped). Every id is checked first: a bad one, or more drops than owners,
        raises and frees nothing."""
        self._check_open()
        ids = self._ids(blocks)
        if not len(ids):
            return
        uniq, drops = np.unique(ids, return_counts=True)
        have = self._counts(uniq)
        short = np.flatnonzero(have < drops)
        if len(short):
            i = short[0]
            raise DoubleFree(f"block {uniq[i]} has {have[i]} owner(s), cannot drop {drops[i]}")
        self._drop_owners(ids, unique=len(uniq) == len(ids))

    def share_n(self, blocks, times: int = 1) -> None:
        """Add ``times`` owners to each block in ``blocks`` (a fork shares a whole page table).
        All or nothing: if any block is bad or free, raises and shares none."""
        self._check_open()
        times = positive_int(times, "times")
        ids = self._ids(blocks)
        if not len(ids):
            return
        free = np.flatnonzero(self._counts(ids) == 0)
        if len(free):
            raise InvalidBlock(f"cannot share block {ids[free[0]]}: it is free")
        self._promote(ids)
        np.add.at(self._ref, ids, times)

    def _ids(self, blocks) -> np.ndarray:
        """``blocks`` as checked intp ids. The first bad id, in order, raises as
        :meth:`_check_id` would (the teaching allocator checks them one by one)."""
        if isinstance(blocks, np.ndarray) and blocks.ndim == 1 and blocks.dtype.kind in "iu":
            bad = np.flatnonzero((blocks < 0) | (blocks >= self.num_blocks))
            if len(bad):
                self._check_id(blocks[bad[0]])           # raises, naming it
            return blocks.astype(np.intp)
        ids = list(blocks)
        if not all(type(b) is int for b in ids):         # NumPy scalars, or something bad
            ids = [self._check_id(b) for b in ids]
        elif ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            for b in ids:
                self._check_id(b)                        # raises at the first bad one
        return np.array(ids, dtype=np.intp)

    # ------------------------------------------------------------------ the manager's calls
    # Unchecked ids: the manager's invariants guarantee allocated ones (see its audit).
    def _pop(self, n: int) -> np.ndarray:
        """Take the top ``n`` ids off the stack (``0 < n <= num_free``), with one owner
        each in ``_ref``. Returns a view of the stack, bottom first, valid until the next
        push. The stack holds intp ids: NumPy scatters through intp indices fastest."""
        self._check_open()
        if self._hot:
            self._spill()
        top = self._top - n
        ids = self._stack[top:top + n]
        self._ref[ids] = 1
        self._top = top
        self._bulk_used += n
        return ids

    def _take(self, n: int) -> np.ndarray:
        """``n`` new blocks as int32 (the block tables' type), the top of the stack
        first: the order of ``n`` calls of :meth:`allocate`."""
        return self._pop(n)[::-1].astype(np.int32)

    def _take_list(self, n: int) -> list[int]:
        """``_take`` as a list of Python ints, for a caller that loops over a few."""
        out = self._pop(n).tolist()
        out.reverse()
        return out

    def _add_owners(self, ids: np.ndarray, times: int) -> None:
        """``share_n`` without the checks, for distinct allocated ids."""
        if not len(ids):
            return
        self._check_open()
        ids = ids.astype(np.intp, copy=False)
        self._promote(ids)
        self._ref[ids] += times

    def _drop_owners(self, ids: np.ndarray, unique: bool = True) -> None:
        """``free_n`` without the checks (``unique``: no id appears twice). Blocks that
        lose their last owner are pushed in the order of their last mention, as in
        ``free_n``."""
        if not len(ids):
            return
        self._check_open()
        ids = ids.astype(np.intp, copy=False)
        self._promote(ids)
        ref = self._ref
        if unique:
            left = ref[ids] - 1
            ref[ids] = left
            gone = ids[left == 0]
        else:
            np.subtract.at(ref, ids, 1)
            first_from_end = np.unique(ids[::-1], return_index=True)[1]
            last = np.sort(len(ids) - 1 - first_from_end)   # each id's last mention
            gone = ids[last[ref[ids[last]] == 0]]
        if len(gone):
            self._spill()
            top = self._top
            self._stack[top:top + len(gone)] = gone
            self._top = top + len(gone)
            self._bulk_used -= len(gone)

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        """Owner counts of ``ids``, unchecked."""
        counts = self._ref[ids]
        if self._num_solo():
            solo = self._solo
            is_solo = [solo[b] == b for b in ids.tolist()]
            counts = counts + np.array(is_solo, dtype=np.int64)
        return counts

    def _num_solo(self) -> int:
        return self.num_blocks - self._top - len(self._hot) - self._bulk_used

    def _promote(self, ids: np.ndarray) -> None:
        """Move the counts of any solo blocks among ``ids`` into ``_ref``, where batched
        calls work. In O(1) when no block is solo (the fast manager never makes one)."""
        if self._num_solo():
            solo, ref = self._solo, self._ref
            for b in ids.tolist():
                if solo[b] == b:
                    solo[b] = None
                    ref[b] = 1
                    self._bulk_used += 1

    def _spill(self) -> None:
        """Move ``_hot`` onto ``_stack``, in order: the whole free stack in NumPy."""
        hot = self._hot
        if hot:
            top = self._top
            self._stack[top:top + len(hot)] = hot
            self._top = top + len(hot)
            hot.clear()

    # ------------------------------------------------------------------ state
    def refcount(self, block: int) -> int:
        """How many owners ``block`` has (0: free)."""
        b = self._check_id(block)
        return 1 if self._solo[b] == b else int(self._ref[b])

    def refcounts(self) -> np.ndarray:
        """Every block's owner count (a NumPy int64 copy)."""
        ref = self._ref.copy()
        if self._num_solo():
            ref[[b for b in self._solo if b is not None]] = 1
        return ref

    def free_blocks(self) -> list[int]:
        """The free stack, bottom first: the next :meth:`allocate` returns the last one."""
        return self._stack[:self._top].tolist() + self._hot

    @property
    def num_free(self) -> int:
        self._check_open()              # a closed pool has nothing to hand out
        return self._top + len(self._hot)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self._top - len(self._hot)

    @property
    def num_shared(self) -> int:
        """Blocks with more than one owner (a solo block has one): one NumPy pass over
        the counts here, where the teaching allocator keeps a counter."""
        return int(np.count_nonzero(self._ref > 1))

    def audit(self) -> None:
        """Check the invariants; raise :class:`AuditError` naming the first one broken."""
        self._check_open()
        n, ref, solo = self.num_blocks, self._ref, self._solo
        if not 0 <= self._top <= n or self._top + len(self._hot) > n:
            raise AuditError("the free stack holds more ids than the pool has blocks")
        free = self.free_blocks()
        if any(not is_int(b) or not 0 <= b < n for b in free):
            raise AuditError("the free stack holds an id outside the pool")
        if len(set(free)) != len(free):
            raise AuditError("a block is on the free stack twice")
        if len(solo) != n or any(s is not None and s != b for b, s in enumerate(solo)):
            raise AuditError("a solo flag that is neither None nor its block's id")
        is_solo = np.array([s is not None for s in solo], dtype=bool)
        if ref.shape != (n,) or (ref < 0).any() or (is_solo & (ref != 0)).any():
            raise AuditError("owner counts: one per block, >= 0, and not both solo and in _ref")
        owners = ref + is_solo
        if (owners[free] != 0).any() or int((owners == 0).sum()) != len(free):
            raise AuditError("a block is on the free stack if and only if it has no owner")
        if self._bulk_used != int(np.count_nonzero(ref)):
            raise AuditError("_bulk_used differs from the number of counts in _ref")

    def close(self) -> None:
        """Give the pool back. The free stack and counts stay readable; every call that needs
        the pool raises :class:`AllocatorClosed`. Solo counts move to ``_ref`` and ``_hot``
        empties, so the one-block paths fall through to the checking ones."""
        if self.pool is not None:
            self._spill()
            self._promote(np.flatnonzero(np.array([s is not None for s in self._solo])))
            self.pool = None
