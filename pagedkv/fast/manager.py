"""The KV-cache manager made fast: the API, plans and errors of :mod:`pagedkv.manager`, with the
per-sequence state kept in NumPy rows so that a decode step runs no Python loop over its batch.

State (one row per live sequence, rows kept dense: ``0 .. len(self) - 1``)::

    _tables[row, j]  physical block of the row's logical block j; -1 past its last block
    _lens[row]       tokens in the sequence
    _cow[row]        the row's partly filled last block may be shared with another row, so the
                     next write into it must check its owner count (copy-on-write)

Invariants, checked by :meth:`KVCacheManager.audit` (with the allocator's own):

* a row maps exactly ``ceil(len / block_size)`` blocks, each at most once;
* a block's owner count equals the number of rows that map it;
* a row whose partly filled last block is shared has its ``_cow`` flag set.

Only a sequence's partly filled last block is ever written, so only it can need a copy; the
``_cow`` flag lets a step skip the owner counts of every row that has not forked (or been
truncated into a shared block) since its last write. Freeing a sequence moves the last row
into its hole, so ``seq_ids`` (the order of ``step()``) is row order, not the order of
``add``. Every plan is the one the teaching manager returns for the same calls: the same
slots, block ids, copies and order.
"""
from __future__ import annotations

import numpy as np

from ..checks import cdiv, count, positive_int
from ..errors import (AuditError, ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists,
                      TokenIndexError, UnknownSequence)
from ..manager import CacheStats, Plan
from ..page_table import PageTable, slots_of
from .allocator import BlockAllocator
from .step import StepMixin

__all__ = ["KVCacheManager"]

_NO_COPIES = np.zeros((0, 2), dtype=np.int32)
_NO_COPIES.flags.writeable = False
_NO_BLOCKS = np.zeros(0, dtype=np.int32)


class KVCacheManager(StepMixin):
    """Page tables for many sequences over one fast :class:`BlockAllocator`, which it must own
    alone. ``block_size`` is tokens per block. ``max_seqs`` and ``max_seq_len`` size the
    arrays at the start; both grow (by doubling) when exceeded, so they are hints, not limits.

    A ``StepPlan`` of ``step()`` over every sequence holds a read-only view of the manager's
    own block table (as an engine's persistent batch does): copy or upload it before the next
    call that changes the manager.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, max_seqs: int = 64,
                 max_seq_len: int = 64):
        if not isinstance(allocator, BlockAllocator):
            raise ConfigError(f"the fast {type(self).__name__} needs a "
                              f"pagedkv.fast.BlockAllocator, got a "
                              f"{type(allocator).__module__}.{type(allocator).__qualname__} "
                              f"(the teaching allocator goes with the teaching managers of "
                              f"pagedkv.manager and pagedkv.prefix_cache)")
        self.block_size = bs = positive_int(block_size, "block_size")
        if allocator.block_bytes % bs:
            raise ConfigError(f"a block of {allocator.block_bytes} bytes does not hold a "
                              f"whole number of tokens at {bs} tokens per block")
        if allocator.num_blocks * bs >= 2**31:
            raise ConfigError("the pool has 2**31 or more token slots; slots are int32")
        if allocator.num_used:
            raise ConfigError("the allocator already has blocks in use; a manager needs "
                              "it whole")
        rows = positive_int(max_seqs, "max_seqs")
        cols = cdiv(positive_int(max_seq_len, "max_seq_len"), bs)
        self.allocator = allocator
        self.token_bytes = allocator.block_bytes // bs
        self._tables = np.full((rows, cols), -1, dtype=np.int32)
        self._lens = np.zeros(rows, dtype=np.int32)
        self._cow = np.zeros(rows, dtype=bool)
        self._rowbase = np.arange(rows, dtype=np.intp) * cols   # where each row starts
        self._ids: list = []          # row -> sequence id
        self._row_of: dict = {}       # sequence id -> row
        self._longest = 0             # length of the longest live sequence
        # shift and mask for a power-of-two block size: cheaper than divmod
        self._shift = bs.bit_length() - 1 if bs & (bs - 1) == 0 else None

    # ------------------------------------------------------------------ lookups
    def _row(self, seq_id) -> int:
        try:
            return self._row_of[seq_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id
            raise UnknownSequence(f"unknown sequence {seq_id!r}") from None

    def _check_new(self, seq_id, what: str) -> None:
        try:
            taken = seq_id in self._row_of
        except TypeError:
            raise ConfigError(f"sequence ids must be hashable, got {seq_id!r}") from None
        if taken:
            raise SequenceExists(f"{what} {seq_id!r}: that sequence already exists")

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._row_of
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def seq_ids(self) -> list:
        """Live sequences, in row order (the order of ``step()``)."""
        return list(self._ids)

    def num_tokens(self, seq_id) -> int:
        return int(self._lens[self._row(seq_id)])

    def _blocks(self, row: int) -> np.ndarray:
        """The row's mapped blocks (a view)."""
        return self._tables[row, :cdiv(int(self._lens[row]), self.block_size)]

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's physical blocks, in logical order (an int32 copy)."""
        return self._blocks(self._row(seq_id)).copy()

    def page_table(self, seq_id) -> PageTable:
        """A copy of the sequence's page table."""
        row = self._row(seq_id)
        return PageTable(self.block_size, self._blocks(row).tolist(), int(self._lens[row]))

    def slot(self, seq_id, token: int) -> int:
        """Slot of token position ``token`` of ``seq_id``."""
        return self.page_table(seq_id).slot(token)

    def slots(self, seq_id) -> np.ndarray:
        """Slots of all the sequence's tokens, in order (int32)."""
        row = self._row(seq_id)
        return slots_of(self._tables[row], np.arange(self._lens[row]), self.block_size)

    # ------------------------------------------------------------------ capacity
    def _grow_rows(self, need: int) -> None:
        rows, cols = self._tables.shape
        if need > rows:
            self._resize(max(need, 2 * rows), cols)

    def _grow_cols(self, need: int) -> None:
        rows, cols = self._tables.shape
        if need > cols:
            self._resize(rows, max(need, 2 * cols))

    def _resize(self, rows: int, cols: int) -> None:
        old = self._tables
        self._tables = np.full((rows, cols), -1, dtype=np.int32)
        self._tables[:old.shape[0], :old.shape[1]] = old
        grow = rows - len(self._lens)
        if grow:            # a step holds views of _lens and _cow: replace them only here
            self._lens = np.concatenate([self._lens, np.zeros(grow, np.int32)])
            self._cow = np.concatenate([self._cow, np.zeros(grow, bool)])
        self._rowbase = np.arange(rows, dtype=np.intp) * cols

    # ------------------------------------------------------------------ how many blocks
    def _need(self, row: int, n: int) -> tuple[int, int]:
        """(free blocks appending ``n`` tokens to ``row`` takes, the block it must copy
        first or -1)."""
        bs, length = self.block_size, int(self._lens[row])
        src = -1
        if self._cow[row] and length % bs:
            last = int(self._tables[row, length // bs])
            if self.allocator.refcount(last) > 1:
                src = last
        return cdiv(length + n, bs) - cdiv(length, bs) + (src >= 0), src

    def blocks_needed(self, seq_id, n: int = 1) -> int:
        """Free blocks an append of ``n`` tokens to ``seq_id`` would take (copies included)."""
        row = self._row(seq_id)
        return self._need(row, positive_int(n, "the number of tokens"))[0]

    def can_append(self, seq_id, n: int = 1) -> bool:
        return self.blocks_needed(seq_id, n) <= self.allocator.num_free

    # ------------------------------------------------------------------ growing
    def add(self, seq_id, num_tokens: int = 0) -> Plan:
        """Register a new sequence, with ``num_tokens`` prompt tokens (prefill) if given.
        All or nothing: raises :class:`OutOfBlocks` and registers nothing if they do not fit."""
        self._check_new(seq_id, "sequence")
        num_tokens = count(num_tokens, "the number of tokens")
        need = cdiv(num_tokens, self.block_size)
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free, f"add {seq_id!r}")
        row = len(self._ids)
        self._grow_rows(row + 1)
        self._ids.append(seq_id)
        self._row_of[seq_id] = row
        if not num_tokens:
            return Plan(_NO_BLOCKS.copy(), _NO_COPIES)
        return self._grow(row, num_tokens, need, -1)

    def append(self, seq_id, n: int = 1) -> Plan:
        """Append ``n`` tokens (1 for a decode step, many for a chunk of prompt). All or
        nothing: raises :class:`OutOfBlocks` and changes nothing if the blocks (new ones plus a
        copy-on-write copy) are not all free."""
        row = self._row(seq_id)
        n = positive_int(n, "the number of tokens")
        need, src = self._need(row, n)
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free, f"append {n} to {seq_id!r}")
        return self._grow(row, n, need, src)

    def _grow(self, row: int, n: int, need: int, src: int) -> Plan:
        """Append ``n`` tokens to ``row``, taking ``need`` blocks: first a private copy of
        ``src`` if it is not -1, then the new ones. The caller checked they are free."""
        bs, alloc = self.block_size, self.allocator
        length = int(self._lens[row])
        have, want = cdiv(length, bs), cdiv(length + n, bs)
        self._grow_cols(want)
        table = self._tables[row]
        new = alloc._take(need) if need else _NO_BLOCKS
        copies = _NO_COPIES
        if src >= 0:                         # copy-on-write: our own copy of the last block
            alloc._drop_owners(np.array([src]))   # one owner fewer; the others keep it
            table[have - 1] = new[0]
            copies = np.array([[src, new[0]]], dtype=np.int32)
            new = new[1:]
        self._cow[row] = False               # the last block is now ours alone
        table[have:want] = new
        self._lens[row] = length + n
        self._longest = max(self._longest, length + n)
        return Plan(slots_of(table, np.arange(length, length + n), bs), copies)

    # ------------------------------------------------------------------ forking and freeing
    def fork(self, parent, *children) -> None:
        """Each child starts as a copy of ``parent`` that shares all its blocks. No bytes move
        now: the first write into a shared, partly filled block copies it."""
        prow = self._row(parent)
        if not children:
            raise ConfigError("fork needs at least one child id")
        for child in children:
            self._check_new(child, "cannot fork onto")
        if len(set(children)) != len(children):
            raise DuplicateSequence(f"a child id appears more than once in {children!r}")
        length = int(self._lens[prow])
        self.allocator._add_owners(self._blocks(prow), len(children))
        first = len(self._ids)
        self._grow_rows(first + len(children))
        rows = slice(first, first + len(children))
        self._tables[rows] = self._tables[prow]
        self._lens[rows] = length
        if length % self.block_size:         # a shared, partly filled last block
            self._cow[prow] = True
            self._cow[rows] = True
        for i, child in enumerate(children):
            self._ids.append(child)
            self._row_of[child] = first + i

    def free(self, seq_id) -> None:
        """Release the sequence's blocks (a shared one loses one owner) and forget it."""
        row = self._row(seq_id)
        length = int(self._lens[row])
        self.allocator._drop_owners(self._blocks(row))
        last = len(self._ids) - 1
        if row != last:                      # keep rows dense: the last row fills the hole
            moved = self._ids[last]
            self._tables[row] = self._tables[last]
            self._lens[row] = self._lens[last]
            self._cow[row] = self._cow[last]
            self._ids[row] = moved
            self._row_of[moved] = row
        self._tables[last] = -1
        self._lens[last] = 0
        self._cow[last] = False
        self._ids.pop()
        del self._row_of[seq_id]
        if length == self._longest:          # the longest may be gone
            self._longest = int(self._lens[:last].max()) if last else 0

    def truncate(self, seq_id, n: int) -> None:
        """Keep the first ``n`` tokens (a rewind): the blocks wholly past them lose this owner,
        the last first; a kept shared block stays shared, and is copied at its next write
        (the row is flagged copy-on-write if its new last block is partly filled and
        shared)."""
        row = self._row(seq_id)
        n = count(n, "the number of tokens to keep")
        length, bs = int(self._lens[row]), self.block_size
        if n > length:
            raise TokenIndexError(f"cannot keep {n} tokens: the sequence has {length}")
        keep, table = cdiv(n, bs), self._tables[row]
        cut = table[keep:cdiv(length, bs)][::-1].copy()
        table[keep:keep + len(cut)] = -1
        self._lens[row] = n
        self.allocator._drop_owners(cut)
        if n % bs and self.allocator.refcount(int(table[keep - 1])) > 1:
            self._cow[row] = True
        if length == self._longest:          # the longest may be shorter now
            self._longest = int(self._lens[:len(self._ids)].max())

    # ------------------------------------------------------------------ accounting
    def _mapped(self):
        """(mask of mapped table entries, blocks per row) for the live rows."""
        n = len(self._ids)
        nb = cdiv(self._lens[:n].astype(np.int64), self.block_size)
        return np.arange(self._tables.shape[1])[None, :] < nb[:, None], nb

    def stats(self) -> CacheStats:
        alloc, bs, n = self.allocator, self.block_size, len(self._ids)
        mask, nb = self._mapped()
        tables, lens = self._tables[:n], self._lens[:n].astype(np.int64)
        # tokens each mapped block holds: full, except each row's last
        cols = np.arange(tables.shape[1])[None, :]
        fill = np.where(cols == (nb - 1)[:, None], (lens - (nb - 1) * bs)[:, None], bs)
        per_block = np.zeros(alloc.num_blocks, dtype=np.int64)
        np.maximum.at(per_block, tables[mask], fill[mask])   # the fullest sharer's count
        stored, refs, used = int(per_block.sum()), alloc.refcounts(), alloc.num_used
        free_ids = np.sort(np.array(alloc.free_blocks(), dtype=np.int64))
        largest = 0
        if len(free_ids):                      # the longest run of adjacent free ids
            breaks = np.flatnonzero(np.diff(free_ids) != 1)
            largest = int(np.diff(np.concatenate([[-1], breaks, [len(free_ids) - 1]])).max())
        free, saved = alloc.num_free, int(refs.sum()) - used
        return CacheStats(
            total_blocks=alloc.num_blocks, free_blocks=free, used_blocks=used,
            utilization=used / alloc.num_blocks, sequences=n, tokens=int(lens.sum()),
            stored_tokens=stored,
            internal_fragmentation=(used * bs - stored) / (used * bs) if used else 0.0,
            shared_blocks=int((refs > 1).sum()), blocks_saved_by_sharing=saved,
            bytes_saved_by_sharing=saved * alloc.block_bytes, largest_free_run=largest,
            external_fragmentation=1 - largest / free if free else 0.0)

    def audit(self) -> None:
        """Check every invariant; raise :class:`AuditError` naming the first one broken."""
        alloc = self.allocator
        alloc.audit()
        n = len(self._ids)
        if len(self._row_of) != n or any(self._row_of.get(s) != r
                                         for r, s in enumerate(self._ids)):
            raise AuditError("the id -> row map and the rows disagree")
        mask, nb = self._mapped()
        tables, lens = self._tables[:n], self._lens[:n]
        mapped = tables[mask]
        if (lens < 0).any() or self._longest != (int(lens.max()) if n else 0):
            raise AuditError("a negative length, or _longest is not the longest length")
        if ((mapped < 0) | (mapped >= alloc.num_blocks)).any():
            raise AuditError("a row maps a block outside the pool")
        if (tables[~mask] != -1).any() or (self._tables[n:] != -1).any() \
                or self._lens[n:].any() or self._cow[n:].any():
            raise AuditError("an entry past a row's last block, or a dead row, is not cleared")
        keys = np.nonzero(mask)[0] * alloc.num_blocks + mapped
        if len(np.unique(keys)) != len(keys):
            raise AuditError("a row maps one block twice")
        refs = alloc.refcounts()
        counts = np.bincount(mapped.astype(np.int64), minlength=alloc.num_blocks)
        bad = np.flatnonzero(counts != refs)
        if len(bad):
            b = int(bad[0])
            raise AuditError(f"block {b} has refcount {refs[b]} but {counts[b]} row(s) map it")
        live = np.flatnonzero(nb > 0)
        last = tables[live, nb[live] - 1]
        at_risk = (lens[live] % self.block_size != 0) & (refs[last] > 1)
        if not self._cow[live][at_risk].all():
            raise AuditError("a shared, partly filled last block is not flagged copy-on-write")

    def __repr__(self) -> str:
        a = self.allocator
        return (f"KVCacheManager({len(self)} sequences, block_size={self.block_size}, "
                f"{a.num_used}/{a.num_blocks} blocks used, fast)")
