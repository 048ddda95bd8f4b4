"""The KV-cache manager: sequences that grow token by token, fork, and free their blocks.

The manager plans; kernels move bytes. Every mutation returns what the device must do — the slots
the new tokens' K/V go to, and the (src, dst) block copies that copy-on-write needs — and never
touches KV data itself.

State (one row per live sequence, rows kept dense: ``0 .. len(self) - 1``)::

    _tables[row, j]  physical block of the row's logical block j; -1 past its last block
    _lens[row]       tokens in the sequence
    _cow[row]        the row's partly filled last block may be shared with another row, so
                     the next write into it must check its reference count (copy-on-write)

Invariants, checked by :meth:`KVCacheManager.audit` (with the allocator's own):

* a block's reference count equals the number of page tables that map it;
* a row maps exactly ``ceil(len / block_size)`` blocks, each at most once;
* a row whose partly filled last block is shared has its ``_cow`` flag set.

Only the partly filled last block of a sequence is ever written, so only it can need a copy; the
``_cow`` flag lets the batched :meth:`step` skip reference-count checks for every row that has
not forked since its last write.

The manager takes and returns blocks only through the allocator's batched calls
(``allocate_array``, and ``_add_owners`` / ``_drop_owners`` for whole page tables), so every
count it creates lives in the allocator's NumPy array and a decode step never loops over its
sequences in Python.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .allocator import BlockAllocator
from .errors import ConfigError, OutOfBlocks, SequenceExists, TokenIndexError, UnknownSequence
from .page_table import PageTable, slots_of

__all__ = ["KVCacheManager", "Plan", "StepPlan", "CacheStats"]

_NO_COPIES = np.zeros((0, 2), dtype=np.int32)
_NO_COPIES.flags.writeable = False
_NO_BLOCKS = np.zeros(0, dtype=np.int32)   # int32, as _take returns


class Plan(NamedTuple):
    """What one sequence's append asks of the device."""
    slots: np.ndarray    # int32 [new tokens]: where each new token's K/V goes
    copies: np.ndarray   # int32 [n, 2]: (src, dst) blocks to copy first (copy-on-write)


class StepPlan(NamedTuple):
    """One decode step for a batch: every sequence in ``seq_ids`` gains one token.

    ``block_tables`` is read-only. When the step covered every sequence (``step()`` with no
    argument) it is a view of the manager's own table, as an engine's persistent batch is: it
    is valid until the next call that changes the manager, so upload or copy it before then.
    """
    seq_ids: list            # batch order
    slot_mapping: np.ndarray  # int32 [batch]: slot of each sequence's new token
    block_tables: np.ndarray  # int32 [batch, max blocks]: -1 pads the shorter rows
    seq_lens: np.ndarray      # int32 [batch]: lengths including the new token
    copies: np.ndarray        # int32 [n, 2]: (src, dst) copy-on-write copies, done before writing


@dataclass(frozen=True)
class CacheStats:
    total_blocks: int
    free_blocks: int
    used_blocks: int
    utilization: float              # used / total blocks
    sequences: int
    tokens: int                     # sum of sequence lengths (a shared token counts per owner)
    stored_tokens: int              # token slots that hold data (a shared slot counts once)
    internal_fragmentation: float   # unfilled slots in used blocks / slots in used blocks
    shared_blocks: int              # blocks with more than one owner
    blocks_saved_by_sharing: int    # blocks that copies would have needed: sum(refcount) - used
    bytes_saved_by_sharing: int
    largest_free_run: int           # longest run of adjacent free block ids
    external_fragmentation: float   # 1 - largest_free_run / free blocks (0 when none is free)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def _cdiv(a, b):
    return -(-a // b)


class KVCacheManager:
    """Page tables for many sequences over one :class:`BlockAllocator`.

    ``block_size`` is tokens per block; the allocator's ``block_bytes`` must be a whole number of
    tokens. The manager must be the allocator's only user: its audit checks every reference count.
    ``max_seqs`` and ``max_seq_len`` size the block-table array at the start; both grow (by
    doubling) when exceeded, so they are hints, not limits.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, max_seqs: int = 64,
                 max_seq_len: int = 64):
        if not isinstance(allocator, BlockAllocator):
            raise ConfigError(f"allocator must be a BlockAllocator, got {type(allocator).__name__}")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
                or block_size <= 0:
            raise ConfigError(f"block_size must be a positive integer, got {block_size!r}")
        block_size = int(block_size)
        if allocator.block_bytes % block_size:
            raise ConfigError(f"a block of {allocator.block_bytes} bytes does not hold a whole "
                              f"number of tokens at {block_size} tokens per block")
        if allocator.num_blocks * block_size >= 2**31:
            raise ConfigError("the pool has 2**31 or more token slots; slots are int32")
        if allocator.num_used:
            raise ConfigError("the allocator already has blocks in use; a manager needs it whole")
        self.allocator = allocator
        self.block_size = block_size
        self.token_bytes = allocator.block_bytes // block_size
        rows = max(1, int(max_seqs))
        cols = max(1, _cdiv(int(max_seq_len), block_size))
        self._tables = np.full((rows, cols), -1, dtype=np.int32)
        self._lens = np.zeros(rows, dtype=np.int32)
        self._cow = np.zeros(rows, dtype=bool)
        self._ids: list = []          # row -> sequence id
        self._row_of: dict = {}       # sequence id -> row
        self._rowbase = np.arange(rows, dtype=np.intp) * cols   # flat index of each row's start
        self._longest = 0             # length of the longest live sequence
        # shift and mask for a power-of-two block size: cheaper than divmod
        self._shift = block_size.bit_length() - 1 if block_size & (block_size - 1) == 0 else None

    # ------------------------------------------------------------------ lookups
    def _row(self, seq_id) -> int:
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise UnknownSequence(f"unknown sequence {seq_id!r}") from None
        except TypeError:
            raise UnknownSequence(f"sequence ids must be hashable, got {seq_id!r}") from None

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._row_of
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._ids)

    @property
    def seq_ids(self) -> list:
        """Live sequences, in batch (row) order."""
        return list(self._ids)

    def num_tokens(self, seq_id) -> int:
        return int(self._lens[self._row(seq_id)])

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's physical blocks, logical order (int32 copy)."""
        row = self._row(seq_id)
        return self._tables[row, :_cdiv(int(self._lens[row]), self.block_size)].copy()

    def page_table(self, seq_id) -> PageTable:
        """A snapshot of the sequence's page table."""
        row = self._row(seq_id)
        n = int(self._lens[row])
        return PageTable(self.block_size, self._tables[row, :_cdiv(n, self.block_size)].tolist(), n)

    def slot(self, seq_id, token: int) -> int:
        """Slot of token position ``token`` of ``seq_id``."""
        return self.page_table(seq_id).slot(token)

    def slots(self, seq_id) -> np.ndarray:
        """Slots of all the sequence's tokens, in order (int32)."""
        row = self._row(seq_id)
        n = int(self._lens[row])
        return slots_of(self._tables[row], np.arange(n), self.block_size)

    # ------------------------------------------------------------------ capacity
    def _grow_rows(self, need: int) -> None:
        rows = self._tables.shape[0]
        if need <= rows:
            return
        new = max(need, 2 * rows)
        tables = np.full((new, self._tables.shape[1]), -1, dtype=np.int32)
        tables[:rows] = self._tables
        self._tables = tables
        self._lens = np.concatenate([self._lens, np.zeros(new - rows, np.int32)])
        self._cow = np.concatenate([self._cow, np.zeros(new - rows, bool)])
        self._rowbase = np.arange(new, dtype=np.intp) * tables.shape[1]

    def _grow_cols(self, need: int) -> None:
        cols = self._tables.shape[1]
        if need <= cols:
            return
        new = max(need, 2 * cols)
        tables = np.full((self._tables.shape[0], new), -1, dtype=np.int32)
        tables[:, :cols] = self._tables
        self._tables = tables
        self._rowbase = np.arange(tables.shape[0], dtype=np.intp) * new

    def _copy_needed(self, row: int, length: int) -> int:
        """Block id that must be copied before the row's next write, or -1."""
        if self._cow[row] and length % self.block_size:
            b = int(self._tables[row, length // self.block_size])
            if self.allocator.refcount(b) > 1:
                return b
        return -1

    def blocks_needed(self, seq_id, n: int = 1) -> int:
        """Free blocks an append of ``n`` tokens to ``seq_id`` would take (copies included)."""
        row = self._row(seq_id)
        n = self._check_count(n)
        length = int(self._lens[row])
        grow = _cdiv(length + n, self.block_size) - _cdiv(length, self.block_size)
        return grow + (self._copy_needed(row, length) >= 0)

    def can_append(self, seq_id, n: int = 1) -> bool:
        return self.blocks_needed(seq_id, n) <= self.allocator.num_free

    def _check_new(self, seq_id, what: str) -> None:
        """A new sequence id must be hashable and not already live."""
        try:
            taken = seq_id in self._row_of
        except TypeError:
            raise ConfigError(f"sequence ids must be hashable, got {seq_id!r}") from None
        if taken:
            raise SequenceExists(f"{what} {seq_id!r}: that sequence already exists")

    @staticmethod
    def _check_count(n) -> int:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ConfigError(f"the number of tokens must be a positive integer, got {n!r}")
        return int(n)

    # ------------------------------------------------------------------ mutations
    def add(self, seq_id, num_tokens: int = 0) -> Plan:
        """Register a new sequence, optionally with ``num_tokens`` prompt tokens (prefill)."""
        self._check_new(seq_id, "sequence")
        if num_tokens:
            num_tokens = self._check_count(num_tokens)
            need = _cdiv(num_tokens, self.block_size)
            if need > self.allocator.num_free:
                raise OutOfBlocks(need, self.allocator.num_free, f"add {seq_id!r}")
        row = len(self._ids)
        self._grow_rows(row + 1)
        self._ids.append(seq_id)
        self._row_of[seq_id] = row
        if num_tokens:
            return self.append(seq_id, num_tokens)
        return Plan(np.zeros(0, np.int32), _NO_COPIES)

    def append(self, seq_id, n: int = 1) -> Plan:
        """Append ``n`` tokens (1 for a decode step, the prompt length for a prefill).

        All or nothing: raises :class:`OutOfBlocks` and changes nothing if the blocks (new ones
        plus a copy-on-write copy) are not all free.
        """
        row = self._row(seq_id)
        n = self._check_count(n)
        bs = self.block_size
        length = int(self._lens[row])
        have, want = _cdiv(length, bs), _cdiv(length + n, bs)
        src = self._copy_needed(row, length)
        need = want - have + (src >= 0)
        alloc = self.allocator
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"append {n} to {seq_id!r}")
        self._grow_cols(want)
        table = self._tables[row]
        new = alloc._take(need) if need else _NO_BLOCKS   # the copy's block first, if any
        copies = _NO_COPIES
        if src >= 0:
            dst = new[:1]
            alloc._drop_owners(np.array([src]))   # ours; the other owners keep the block
            table[length // bs] = dst[0]
            copies = np.array([[src, dst[0]]], dtype=np.int32)
            new = new[1:]
        self._cow[row] = False       # the last block is ours alone, or about to be a new one
        table[have:want] = new
        self._lens[row] = length + n
        self._longest = max(self._longest, length + n)
        return Plan(slots_of(table, np.arange(length, length + n), bs), copies)

    def step(self, seq_ids=None) -> StepPlan:
        """One decode step: every sequence in ``seq_ids`` (default: all, in row order) gains a
        token. Builds the batch's slot mapping and block tables in one pass.

        All or nothing: raises :class:`OutOfBlocks` and changes nothing if the new blocks and
        copy-on-write copies the step needs are not all free.
        """
        if seq_ids is None:
            ids = list(self._ids)
            if len(ids) <= self.small_batch:
                return self._step_few(ids, list(range(len(ids))))
            return self._step(ids, None)
        ids = list(seq_ids)
        try:
            row_of = self._row_of
            rows = [row_of[s] for s in ids]
        except (KeyError, TypeError):
            rows = [self._row(s) for s in ids]          # raises, naming the sequence
        if len(set(rows)) != len(rows):
            raise ConfigError("a sequence appears more than once in one step")
        if len(ids) <= self.small_batch:
            return self._step_few(ids, rows)
        return self._step(ids, np.array(rows, dtype=np.intp))

    #: Batches up to this size take :meth:`_step_few`, a plain-Python loop: each NumPy call
    #: costs about a microsecond however small its array, which outweighs its speed per element
    #: below a dozen or so sequences. Both paths return identical plans (a test checks).
    small_batch = 8

    def _step_few(self, ids: list, rows: list) -> StepPlan:
        """The step for a few rows, one Python loop over them."""
        bs, alloc, lens, tables = self.block_size, self.allocator, self._lens, self._tables
        pos = [lens.item(r) for r in rows]
        fresh = [p % bs == 0 for p in pos]
        k = fresh.count(True)
        cow = self._cow
        flagged = [i for i, r in enumerate(rows) if cow.item(r) and not fresh[i]]
        copy_src: dict[int, int] = {}          # batch index -> block it must copy
        if flagged:
            left: dict[int, int] = {}
            for i in flagged:
                b = tables.item(rows[i], pos[i] // bs)
                c = left.get(b) or alloc.refcount(b)
                if c > 1:
                    copy_src[i] = b
                    left[b] = c - 1
        need = k + len(copy_src)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {len(ids)} sequences")
        # --- from here on nothing can fail
        width = max(pos) // bs + 1 if pos else 0
        self._grow_cols(width)
        tables = self._tables
        new = alloc._take_list(need) if need else []
        j, c = 0, k                            # next fresh block in new, next copy block
        slots, seq_lens, pairs = [], [], []
        for i, r in enumerate(rows):
            p = pos[i]
            col, off = divmod(p, bs)
            if fresh[i]:
                b = tables[r, col] = new[j]
                j += 1
            elif i in copy_src:
                b = tables[r, col] = new[c]
                c += 1
                pairs.append((copy_src[i], b))
            else:
                b = tables.item(r, col)
            slots.append(b * bs + off)
            lens[r] = p + 1
            seq_lens.append(p + 1)
        copies = _NO_COPIES
        if pairs:
            copies = np.array(pairs, dtype=np.int32)
            alloc._drop_owners(copies[:, 0], unique=False)   # the other owners keep each src
        if flagged:
            self._cow[rows] = False
        if pos:
            self._longest = max(self._longest, max(pos) + 1)
        block_tables = tables.take(rows, axis=0)[:, :width]
        block_tables.setflags(write=False)
        both = np.array(slots + seq_lens, dtype=np.int32)    # one conversion, two views
        slot_mapping, seq_lens = both[:len(slots)], both[len(slots):]
        return StepPlan(ids, slot_mapping, block_tables, seq_lens, copies)

    def _step(self, ids: list, rows) -> StepPlan:
        """The step for ``rows`` (an index array), or for all rows in order when ``rows`` is
        None: then every array below is a view or a slice, not a gather. No Python loop runs
        over the batch, except over rows that may need a copy-on-write copy."""
        bs, alloc, n = self.block_size, self.allocator, len(ids)
        dense = rows is None
        if dense:
            lens, flagged = self._lens[:n], self._cow[:n]
        else:
            lens, flagged = self._lens[rows], self._cow[rows]
        if self._shift is not None:
            col, off = lens >> self._shift, lens & (bs - 1)
        else:
            col, off = np.divmod(lens, bs)
        fresh = off == 0                       # the token starts a new block
        k = int(np.count_nonzero(fresh))
        # blocks in the longest row, the new token's included
        if dense:
            width = self._longest // bs + 1 if n else 0
        else:
            width = int(col.max()) + 1 if n else 0
        self._grow_cols(width)
        flat = self._tables.reshape(-1)        # a view: flat indexing is the fastest gather
        at = (self._rowbase[:n] if dense else self._rowbase[rows]) + col   # each current block
        # Copy-on-write: only rows flagged since their last write can need a copy. Walk those
        # (they are few) in Python, counting each block's owners down as copies are made.
        pick, srcs = [], []
        any_flagged = n and np.count_nonzero(flagged)
        if any_flagged:
            cand = np.flatnonzero(flagged & ~fresh)
            if len(cand):
                blocks = flat[at[cand]]
                left: dict[int, int] = {}
                for i, b, c in zip(cand.tolist(), blocks.tolist(),
                                   alloc._counts(blocks).tolist()):
                    c = left.get(b, c)
                    if c > 1:
                        pick.append(i)
                        srcs.append(b)
                        left[b] = c - 1
        need = k + len(srcs)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {n} sequences")
        # --- from here on nothing can fail
        copies = _NO_COPIES
        if need:
            # the fresh rows' blocks, then the copies'; int32 like the table, which makes the
            # indexed writes below plain copies rather than casts
            new = alloc._take(need)
            if k == n:
                flat[at] = new
            elif k:
                flat[at[fresh]] = new[:k]
            if srcs:
                src = np.array(srcs, dtype=np.int32)
                alloc._drop_owners(src, unique=False)   # the other owners keep each src
                flat[at[pick]] = new[k:]
                copies = np.stack([src, new[k:]], axis=1)
        if any_flagged:
            if dense:
                flagged[:] = False
            else:
                self._cow[rows] = False
        if dense:
            lens += 1                          # a view: updates the manager's lengths
            seq_lens = lens.copy()
            self._longest += n > 0
        else:
            seq_lens = lens + 1
            self._lens[rows] = seq_lens
            if n:
                self._longest = max(self._longest, int(seq_lens.max()))
        slot_mapping = flat[at]
        slot_mapping *= bs
        slot_mapping += off
        block_tables = self._tables[:n, :width] if dense else self._tables[rows, :width]
        block_tables.setflags(write=False)
        return StepPlan(ids, slot_mapping, block_tables, seq_lens, copies)

    def fork(self, parent, *children) -> None:
        """Each child starts as a copy of ``parent`` that shares all its blocks.

        No bytes move now: the first write into the shared, partly filled last block gives the
        writer its own copy (see the ``copies`` of :meth:`append` and :meth:`step`).
        """
        prow = self._row(parent)
        if not children:
            raise ConfigError("fork needs at least one child id")
        try:
            known = self._row_of
            clash = [c for c in children if c in known]
            twice = len(set(children)) != len(children)
        except TypeError:                      # an unhashable child id: say which
            for c in children:
                self._check_new(c, "cannot fork onto")
            raise
        if clash:
            self._check_new(clash[0], "cannot fork onto")   # raises the precise error
        if twice:
            raise SequenceExists("the same child id is given twice")
        length = int(self._lens[prow])
        nb = _cdiv(length, self.block_size)
        self.allocator._add_owners(self._tables[prow, :nb], len(children))
        first = len(self._ids)
        self._grow_rows(first + len(children))
        rows = slice(first, first + len(children))
        self._tables[rows] = self._tables[prow]
        self._lens[rows] = length
        if length % self.block_size:
            self._cow[prow] = True
            self._cow[rows] = True
        for i, c in enumerate(children):
            self._ids.append(c)
            self._row_of[c] = first + i

    def free(self, seq_id) -> None:
        """Release the sequence's blocks (shared ones lose one owner) and forget it."""
        row = self._row(seq_id)
        length = int(self._lens[row])
        nb = _cdiv(length, self.block_size)
        self.allocator._drop_owners(self._tables[row, :nb])
        last = len(self._ids) - 1
        if row != last:  # keep rows dense: move the last row into the hole
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
        if length == self._longest:                     # the longest may be gone
            self._longest = int(self._lens[:last].max()) if last else 0

    # ------------------------------------------------------------------ accounting
    def _mapped(self):
        """(mask of mapped table entries, number of blocks per row) for the live rows."""
        n = len(self._ids)
        nb = _cdiv(self._lens[:n].astype(np.int64), self.block_size)
        cols = np.arange(self._tables.shape[1])
        return cols[None, :] < nb[:, None], nb

    def stats(self) -> CacheStats:
        alloc, bs = self.allocator, self.block_size
        n = len(self._ids)
        mask, nb = self._mapped()
        tables = self._tables[:n]
        lens = self._lens[:n].astype(np.int64)
        # how many tokens each mapped block holds: full, except each row's last
        cols = np.arange(tables.shape[1])[None, :]
        fill = np.where(cols == (nb - 1)[:, None], (lens - (nb - 1) * bs)[:, None], bs)
        per_block = np.zeros(alloc.num_blocks, dtype=np.int64)
        per_block[tables[mask]] = fill[mask]   # a shared block is written with equal fills
        stored = int(per_block.sum())
        ref = alloc.refcounts()
        used = alloc.num_used
        free_ids = np.sort(np.array(alloc.free_blocks(), dtype=np.int64))
        if len(free_ids):
            breaks = np.flatnonzero(np.diff(free_ids) != 1)
            runs = np.diff(np.concatenate([[-1], breaks, [len(free_ids) - 1]]))
            largest = int(runs.max())
        else:
            largest = 0
        saved = int(ref.sum()) - used
        return CacheStats(
            total_blocks=alloc.num_blocks, free_blocks=alloc.num_free, used_blocks=used,
            utilization=used / alloc.num_blocks, sequences=n, tokens=int(lens.sum()),
            stored_tokens=stored,
            internal_fragmentation=(used * bs - stored) / (used * bs) if used else 0.0,
            shared_blocks=int((ref > 1).sum()), blocks_saved_by_sharing=saved,
            bytes_saved_by_sharing=saved * alloc.block_bytes, largest_free_run=largest,
            external_fragmentation=1 - largest / len(free_ids) if len(free_ids) else 0.0)

    def audit(self) -> None:
        """Check every invariant; raise ``AssertionError`` naming the first one broken."""
        alloc = self.allocator
        alloc.audit()
        n = len(self._ids)
        assert len(self._row_of) == n, "id map and rows disagree in size"
        for row, s in enumerate(self._ids):
            assert self._row_of[s] == row, f"sequence {s!r} maps to the wrong row"
        mask, nb = self._mapped()
        tables = self._tables[:n]
        mapped = tables[mask]
        assert (self._lens[:n] >= 0).all(), "a negative length"
        assert self._longest == (int(self._lens[:n].max()) if n else 0), "_longest is off"
        assert ((mapped >= 0) & (mapped < alloc.num_blocks)).all(), "a mapped id outside the pool"
        assert (tables[~mask] == -1).all(), "an entry past a row's last block is not -1"
        assert (self._tables[n:] == -1).all() and not self._lens[n:].any() \
            and not self._cow[n:].any(), "a dead row is not cleared"
        ref = alloc.refcounts()
        counts = np.bincount(mapped.astype(np.int64), minlength=alloc.num_blocks)
        assert (counts == ref).all(), \
            "a block's reference count differs from the number of page tables mapping it"
        row_of_entry = np.nonzero(mask)[0]
        keys = row_of_entry * alloc.num_blocks + mapped
        assert len(np.unique(keys)) == len(keys), "a page table maps one block twice"
        live = np.flatnonzero(nb > 0)
        last = tables[live, nb[live] - 1]
        partial = self._lens[live] % self.block_size != 0
        at_risk = partial & (ref[last] > 1)
        assert self._cow[live][at_risk].all(), "a shared, partly filled last block is not flagged"

    def __repr__(self) -> str:
        a = self.allocator
        return (f"KVCacheManager({len(self)} sequences, block_size={self.block_size}, "
                f"{a.num_used}/{a.num_blocks} blocks used)")
