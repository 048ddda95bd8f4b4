"""The fast manager's decode step: every sequence of a batch gains one token.

Two paths give the same plan. A batch of a few sequences takes :meth:`StepMixin._step_few`, one
plain Python loop: each NumPy call costs about a microsecond however small its array, which
outweighs its speed per element below a dozen or so sequences. A larger batch takes
:meth:`StepMixin._step`, which runs no Python loop over the batch (only over the few rows that
may need a copy-on-write copy); when the batch is every live sequence in row order
(``step()``), its arrays are views of the manager's rows rather than gathers.

Both hand out new blocks in batch order (each row needs at most one: a new block when its last
one is full, or a private copy of a shared, partly filled one) and list copies in batch order,
exactly as the teaching manager's one-row-at-a-time loop does.
"""
from __future__ import annotations

import numpy as np

from ..errors import DuplicateSequence, OutOfBlocks
from ..manager import StepPlan

_NO_COPIES = np.zeros((0, 2), dtype=np.int32)
_NO_COPIES.flags.writeable = False


class StepMixin:
    """``step`` for :class:`pagedkv.fast.KVCacheManager` (which holds the state it uses)."""

    #: Batches up to this size take the Python loop. Both paths give identical plans (the
    #: state machine test runs each alone).
    small_batch = 8

    def step(self, seq_ids=None) -> StepPlan:
        """One decode step: every sequence in ``seq_ids`` (default: all live ones, in row
        order) gains a token. All or nothing: raises :class:`OutOfBlocks` and changes nothing
        if the new blocks and copies the whole batch needs are not all free."""
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
            rows = [self._row(s) for s in ids]           # raises, naming the sequence
        if len(set(rows)) != len(rows):
            raise DuplicateSequence("a sequence appears more than once in one step")
        if len(ids) <= self.small_batch:
            return self._step_few(ids, rows)
        return self._step(ids, np.array(rows, dtype=np.intp))

    def _copy_sources(self, blocks: list, counts: list) -> list:
        """For rows whose partly filled last blocks are ``blocks`` with owner counts
        ``counts``, in batch order: the block each must copy, or -1. Of ``k`` sharers of a
        block with ``c`` owners, the first ``min(k, c - 1)`` copy and the rest write in place."""
        left: dict = {}
        out = []
        for b, c in zip(blocks, counts):
            c = left.get(b, c)
            if c > 1:
                out.append(b)
                left[b] = c - 1
            else:
                out.append(-1)
        return out

    def _step_few(self, ids: list, rows: list) -> StepPlan:
        """The step for a few rows, one Python loop over them."""
        bs, alloc, lens, cow = self.block_size, self.allocator, self._lens, self._cow
        pos = [lens.item(r) for r in rows]
        cols = [p // bs for p in pos]
        src = [-1] * len(rows)
        flags = [cow.item(r) for r in rows]
        cand = [i for i, f in enumerate(flags) if f and pos[i] % bs]
        if cand:
            blocks = [self._tables.item(rows[i], cols[i]) for i in cand]
            counts = [alloc.refcount(b) for b in blocks]
            for i, s in zip(cand, self._copy_sources(blocks, counts)):
                src[i] = s
        takes = [p % bs == 0 or s >= 0 for p, s in zip(pos, src)]
        need = takes.count(True)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {len(ids)} sequences")
        # --- from here on nothing can fail
        width = max(cols) + 1 if rows else 0
        self._grow_cols(width)
        tables = self._tables
        new = iter(alloc._take_list(need))     # one per taking row, in batch order
        slots, seq_lens, pairs = [], [], []
        for i, r in enumerate(rows):
            if takes[i]:
                b = tables[r, cols[i]] = next(new)
                if src[i] >= 0:
                    pairs.append((src[i], b))
            else:
                b = tables.item(r, cols[i])
            slots.append(b * bs + pos[i] % bs)
            seq_lens.append(pos[i] + 1)
            lens[r] = pos[i] + 1
        copies = _NO_COPIES
        if pairs:
            copies = np.array(pairs, dtype=np.int32)
            alloc._drop_owners(copies[:, 0], unique=False)   # the other owners keep each src
        if any(flags):
            cow[rows] = False                  # each row now writes a block of its own
        if rows:
            self._longest = max(self._longest, max(seq_lens))
        both = np.array(slots + seq_lens, dtype=np.int32)    # one conversion, two views
        return StepPlan(ids, both[:len(rows)], tables.take(rows, axis=0)[:, :width],
                        both[len(rows):], copies)

    def _step(self, ids: list, rows) -> StepPlan:
        """The step for ``rows`` (an index array), or for all rows in order when ``rows`` is
        None: then every array below is a view or a slice, not a gather."""
        bs, alloc, n = self.block_size, self.allocator, len(ids)
        dense = rows is None
        lens = self._lens[:n] if dense else self._lens[rows]
        flagged = self._cow[:n] if dense else self._cow[rows]
        if self._shift is not None:
            col, off = lens >> self._shift, lens & (bs - 1)
        else:
            col, off = np.divmod(lens, bs)
        fresh = off == 0                       # the token starts a new block
        k = int(np.count_nonzero(fresh))
        if not n:
            width = 0
        else:
            width = self._longest // bs + 1 if dense else int(col.max()) + 1
        self._grow_cols(width)
        flat = self._tables.reshape(-1)        # a view: flat indexing is the fastest gather
        at = (self._rowbase[:n] if dense else self._rowbase[rows]) + col   # each last block
        pick, srcs = self._step_copies(flat, at, flagged, fresh)
        need = k + len(pick)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {n} sequences")
        # --- from here on nothing can fail
        copies, last = _NO_COPIES, None        # last: each row's last block, if known
        if need:
            # int32 like the table, so that the indexed write is a copy rather than a cast
            new = alloc._take(need)
            if pick:                           # new blocks in batch order: fresh and copies
                takes = fresh.copy()
                takes[pick] = True
                flat[at[takes]] = new
                src = np.array(srcs, dtype=np.int32)
                alloc._drop_owners(src, unique=False)   # the other owners keep each src
                copies = np.stack([src, flat[at[pick]]], axis=1)
            elif k == n:                       # every row starts a block: no gather needed
                flat[at] = last = new
            else:
                flat[at[fresh]] = new
        if last is None:
            last = flat[at]
        return self._step_finish(ids, rows, lens, flagged, last, off, width, copies)

    def _step_copies(self, flat, at, flagged, fresh) -> tuple[list, list]:
        """(batch indices, source blocks) of the rows that must copy their last block. Only
        rows flagged since their last write can; walk those (they are few) in Python."""
        if not np.count_nonzero(flagged):
            return [], []
        cand = np.flatnonzero(flagged & ~fresh)
        if not len(cand):
            return [], []
        blocks = flat[at[cand]]
        srcs = self._copy_sources(blocks.tolist(), self.allocator._counts(blocks).tolist())
        pick = [i for i, s in zip(cand.tolist(), srcs) if s >= 0]
        return pick, [s for s in srcs if s >= 0]

    def _step_finish(self, ids, rows, lens, flagged, blocks, off, width, copies) -> StepPlan:
        """Count the new tokens and build the plan (``blocks``: each row's last block)."""
        n, bs = len(ids), self.block_size
        dense = rows is None
        if n and np.count_nonzero(flagged):
            if dense:
                flagged[:] = False             # a view: clears the manager's flags
            else:
                self._cow[rows] = False
        if dense:
            lens += 1                          # a view: counts the manager's lengths
            seq_lens = lens.copy()
            self._longest += n > 0
            block_tables = self._tables[:n, :width]
            block_tables.flags.writeable = False
        else:
            seq_lens = lens + 1
            self._lens[rows] = seq_lens
            if n:
                self._longest = max(self._longest, int(seq_lens.max()))
            block_tables = self._tables[rows, :width]
        slot_mapping = blocks                  # a new array, ours to scale in place
        slot_mapping *= bs
        slot_mapping += off
        return StepPlan(ids, slot_mapping, block_tables, seq_lens, copies)
