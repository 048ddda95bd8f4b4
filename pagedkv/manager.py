"""The KV-cache manager: sequences that grow token by token, fork, and free their blocks.

The manager plans; kernels move bytes. A call that adds tokens returns the slots the new
tokens' K/V go to and the (src, dst) block copies that copy-on-write needs (only a partly
filled last block is written; a writer that shares it copies it first), and changes nothing
if the blocks it needs are not all free: it raises :class:`~pagedkv.errors.OutOfBlocks`.

State: one :class:`~pagedkv.page_table.PageTable` per live sequence (chapter 4), in a dict from
sequence id to table, over one :class:`~pagedkv.allocator.BlockAllocator`. Invariants, checked
by :meth:`KVCacheManager.audit` (with the allocator's own):

* a sequence of ``n`` tokens maps exactly ``ceil(n / block_size)`` blocks, each at most once;
* a block's refcount equals the number of page tables that map it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

from .allocator import BlockAllocator
from .checks import cdiv, count, positive_int
from .errors import (AuditError, ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists,
                     UnknownSequence)
from .page_table import PageTable

__all__ = ["KVCacheManager", "Plan", "StepPlan", "CacheStats"]


class Plan(NamedTuple):
    """What one sequence's append asks of the device."""
    slots: np.ndarray    # int32 [new tokens]: where each new token's K/V goes
    copies: np.ndarray   # int32 [n, 2]: (src, dst) blocks to copy first (copy-on-write)


class StepPlan(NamedTuple):
    """One decode step for a batch: every sequence in ``seq_ids`` gains one token."""
    seq_ids: list             # batch order
    slot_mapping: np.ndarray  # int32 [batch]: slot of each sequence's new token
    block_tables: np.ndarray  # int32 [batch, max blocks]: -1 pads the shorter rows
    seq_lens: np.ndarray      # int32 [batch]: lengths including the new token
    copies: np.ndarray        # int32 [n, 2]: (src, dst) copies, done before writing


def copies_array(pairs) -> np.ndarray:
    """A list of (src, dst) pairs as the plans' int32 ``[n, 2]`` array."""
    return np.array(pairs, dtype=np.int32).reshape(-1, 2)


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

    as_dict = asdict                # {field name: value}


def need_teaching_allocator(manager, allocator) -> None:
    """Refuse a teaching manager over anything but a teaching allocator."""
    if not isinstance(allocator, BlockAllocator):
        kind = type(allocator)
        raise ConfigError(f"the teaching {type(manager).__name__} needs a "
                          f"pagedkv.allocator.BlockAllocator, got a {kind.__module__}."
                          f"{kind.__qualname__} (the fast allocator goes with the fast "
                          f"managers of pagedkv.fast)")


class KVCacheManager:
    """Page tables for many sequences over one :class:`BlockAllocator`, which it must own alone
    (its audit checks every refcount). ``block_size`` is tokens per block."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        need_teaching_allocator(self, allocator)
        self.block_size = positive_int(block_size, "block_size")
        if allocator.block_bytes % self.block_size:
            raise ConfigError(f"a block of {allocator.block_bytes} bytes does not hold a whole "
                              f"number of tokens at {self.block_size} tokens per block")
        if allocator.num_blocks * self.block_size >= 2**31:
            raise ConfigError("the pool has 2**31 or more token slots; slots are int32")
        if allocator.num_used:
            raise ConfigError("the allocator already has blocks in use; a manager needs it whole")
        self.allocator = allocator
        self.token_bytes = allocator.block_bytes // self.block_size
        self._tables: dict = {}       # sequence id -> PageTable

    # ------------------------------------------------------------------ lookups
    def _table(self, seq_id) -> PageTable:
        try:
            return self._tables[seq_id]
        except (KeyError, TypeError):  # TypeError: an unhashable id
            raise UnknownSequence(f"unknown sequence {seq_id!r}") from None

    def _check_new(self, seq_id, what: str) -> None:
        try:
            taken = seq_id in self._tables
        except TypeError:
            raise ConfigError(f"sequence ids must be hashable, got {seq_id!r}") from None
        if taken:
            raise SequenceExists(f"{what} {seq_id!r}: that sequence already exists")

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id in self._tables
        except TypeError:
            return False

    def __len__(self) -> int:
        return len(self._tables)

    @property
    def seq_ids(self) -> list:
        """Live sequences, in the order they were added (the order of ``step()``)."""
        return list(self._tables)

    def num_tokens(self, seq_id) -> int:
        return self._table(seq_id).num_tokens

    def block_table(self, seq_id) -> np.ndarray:
        """The sequence's physical blocks, in logical order (an int32 copy)."""
        return np.array(self._table(seq_id).blocks, dtype=np.int32)

    def page_table(self, seq_id) -> PageTable:
        """A copy of the sequence's page table."""
        return PageTable(self.block_size, self._table(seq_id).blocks, self.num_tokens(seq_id))

    def slot(self, seq_id, token: int) -> int:
        """Slot of token position ``token`` of ``seq_id``."""
        return self._table(seq_id).slot(token)

    def slots(self, seq_id) -> np.ndarray:
        """Slots of all the sequence's tokens, in order (int32)."""
        return self._table(seq_id).slots()

    # ------------------------------------------------------------------ how many blocks
    def _must_copy(self, table: PageTable) -> bool:
        """The next token goes into a partly filled last block that another sequence shares."""
        return (table.num_tokens % self.block_size != 0
                and self.allocator.refcount(table.blocks[-1]) > 1)

    def blocks_needed(self, seq_id, n: int = 1) -> int:
        """Free blocks ``append(seq_id, n)`` takes: new ones, and a copy if one is due."""
        table = self._table(seq_id)
        tokens = table.num_tokens + positive_int(n, "the number of tokens")
        return cdiv(tokens, self.block_size) - table.num_blocks + self._must_copy(table)

    def can_append(self, seq_id, n: int = 1) -> bool:
        return self.blocks_needed(seq_id, n) <= self.allocator.num_free

    # ------------------------------------------------------------------ growing
    def _grow(self, table: PageTable, n: int) -> Plan:
        """Append ``n`` tokens to ``table``. The caller has checked that the blocks are free."""
        copies = []
        if self._must_copy(table):                 # copy-on-write: a private copy first
            src, dst = table.blocks[-1], self.allocator.allocate()
            self.allocator.free(src)               # one owner fewer; the others keep it
            table.blocks[-1] = dst
            copies.append((src, dst))
        slots = []
        for _ in range(n):
            if table.num_tokens == table.capacity:  # the last block is full: map a new one
                table.append_block(self.allocator.allocate())
            slots.append(table.append_token())
        return Plan(np.array(slots, dtype=np.int32), copies_array(copies))

    def add(self, seq_id, num_tokens: int = 0) -> Plan:
        """Register a new sequence, with ``num_tokens`` prompt tokens (prefill) if given."""
        self._check_new(seq_id, "sequence")
        num_tokens = count(num_tokens, "the number of tokens")
        need = cdiv(num_tokens, self.block_size)
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free, f"add {seq_id!r}")
        table = self._tables[seq_id] = PageTable(self.block_size)
        return self._grow(table, num_tokens)

    def append(self, seq_id, n: int = 1) -> Plan:
        """Append ``n`` tokens: 1 for a decode step, more for a chunk of prompt."""
        need = self.blocks_needed(seq_id, n)
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free, f"append {n} to {seq_id!r}")
        return self._grow(self._table(seq_id), n)

    def step(self, seq_ids=None) -> StepPlan:
        """A decode step: each sequence in ``seq_ids`` (default: all) gains a token."""
        ids = self.seq_ids if seq_ids is None else list(seq_ids)
        tables = [self._table(s) for s in ids]
        if len({id(t) for t in tables}) != len(tables):
            raise DuplicateSequence("a sequence appears more than once in one step")
        need = self._needed_by_step(tables)
        if need > self.allocator.num_free:
            raise OutOfBlocks(need, self.allocator.num_free, f"step of {len(ids)} sequences")
        slots, copies = [], []
        for table in tables:                       # the same growth as append, one token each
            plan = self._grow(table, 1)
            slots.append(plan.slots[0])
            copies.extend(plan.copies.tolist())
        width = max((t.num_blocks for t in tables), default=0)
        block_tables = np.full((len(tables), width), -1, dtype=np.int32)
        for row, table in zip(block_tables, tables):
            row[:table.num_blocks] = table.blocks
        return StepPlan(ids, np.array(slots, dtype=np.int32), block_tables,
                        np.array([t.num_tokens for t in tables], dtype=np.int32),
                        copies_array(copies))

    def _needed_by_step(self, tables) -> int:
        """Free blocks one token for each of ``tables`` takes. A full last block needs a new
        one. A shared partly filled one needs a copy, except for its last writer: of ``k``
        sharers in the batch, the first ``min(k, refcount - 1)`` copy and the rest write."""
        need, owners_left = 0, {}
        for table in tables:
            if table.num_tokens % self.block_size == 0:
                need += 1
                continue
            last = table.blocks[-1]
            owners = owners_left.get(last, self.allocator.refcount(last))
            if owners > 1:
                need += 1
                owners_left[last] = owners - 1
        return need

    # ------------------------------------------------------------------ forking and freeing
    def fork(self, parent, *children) -> None:
        """Each child starts as a copy of ``parent`` that shares all its blocks. No bytes move
        now: the first write into a shared, partly filled block copies it (see ``_grow``)."""
        table = self._table(parent)
        if not children:
            raise ConfigError("fork needs at least one child id")
        for child in children:
            self._check_new(child, "cannot fork onto")
        if len(set(children)) != len(children):
            raise DuplicateSequence(f"a child id appears more than once in {children!r}")
        self.allocator.share_n(table.blocks, times=len(children))
        for child in children:
            self._tables[child] = PageTable(self.block_size, table.blocks, table.num_tokens)

    def free(self, seq_id) -> None:
        """Release the sequence's blocks (a shared one loses one owner) and forget it."""
        self.allocator.free_n(self._table(seq_id).blocks)
        del self._tables[seq_id]

    def truncate(self, seq_id, n: int) -> None:
        """Keep the first ``n`` tokens (a rewind): the blocks wholly past them lose this owner,
        the last first; a kept shared block stays shared, and is copied at its next write."""
        self.allocator.free_n(self._table(seq_id).truncate(n))

    # ------------------------------------------------------------------ accounting
    def stats(self) -> CacheStats:
        alloc, bs, refs = self.allocator, self.block_size, self.allocator.refcounts()
        fill = {}                                  # block -> the most tokens a sharer has in it
        for t in self._tables.values():
            for j, b in enumerate(t.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, t.num_tokens - j * bs))
        used, free, stored = alloc.num_used, alloc.num_free, sum(fill.values())
        saved, largest, run = int(refs.sum()) - used, 0, 0
        for r in refs:                             # the longest run of adjacent free blocks
            run = run + 1 if r == 0 else 0
            largest = max(largest, run)
        return CacheStats(
            total_blocks=alloc.num_blocks, free_blocks=free, used_blocks=used,
            utilization=used / alloc.num_blocks, sequences=len(self),
            tokens=sum(t.num_tokens for t in self._tables.values()), stored_tokens=stored,
            internal_fragmentation=(used * bs - stored) / (used * bs) if used else 0.0,
            shared_blocks=int((refs > 1).sum()), blocks_saved_by_sharing=saved,
            bytes_saved_by_sharing=saved * alloc.block_bytes, largest_free_run=largest,
            external_fragmentation=1 - largest / free if free else 0.0)

    def audit(self) -> None:
        """Check every invariant; raise :class:`AuditError` naming the first one broken."""
        alloc = self.allocator
        alloc.audit()
        mapped = np.zeros(alloc.num_blocks, dtype=np.int64)
        for s, t in self._tables.items():
            if t.num_blocks != cdiv(t.num_tokens, self.block_size):
                raise AuditError(f"sequence {s!r} has {t.num_tokens} tokens but maps "
                                 f"{t.num_blocks} block(s)")
            if any(not 0 <= b < alloc.num_blocks for b in t.blocks):
                raise AuditError(f"sequence {s!r} maps a block outside the pool")
            if len(set(t.blocks)) != len(t.blocks):
                raise AuditError(f"sequence {s!r} maps one block twice")
            mapped[t.blocks] += 1
        bad = np.flatnonzero(mapped != alloc.refcounts())
        if len(bad):
            b = int(bad[0])
            raise AuditError(f"block {b} has refcount {alloc.refcount(b)} but {mapped[b]} "
                             f"page table(s) map it")

    def __repr__(self) -> str:
        return (f"KVCacheManager({len(self)} sequences, block_size={self.block_size}, "
                f"{self.allocator.num_used}/{self.allocator.num_blocks} blocks used)")
