"""The fast manager's decode step: every sequence of a batch gains one token.

Two paths give the same plan. A batch of a few sequences takes :meth:`StepMixin._step_few`,
one plain Python loop: each NumPy call costs about a microsecond however small its array,
which outweighs its speed per element below a dozen or so sequences. A larger batch takes
:meth:`StepMixin._step`, which runs no Python loop over the batch (only over the few rows
that may need a copy-on-write copy); when the batch is every live sequence in row order
(``step()``), its arrays are views of the manager's rows rather than gathers.

Both hand out new blocks in batch order (each row needs at most one: a new block when its
last one is full, or a private copy of a shared, partly filled one) and list copies in batch
order, exactly as the teaching manager's one-row-at-a-time loop does.
"""
from __future__ import annotations

import numpy as np

from ..errors import DuplicateSequence, OutOfBlocks
from ..manager import StepPlan

_NO_COPIES = np.zeros((0, 2), dtype=np.int32)
_NO_COPIES.flags.writeable = False


class StepMixin:
    """``step`` for :class:`pagedkv.fast.KVCacheManager`, which holds the state."""

    #: Batches up to this size take the Python loop. Both paths give identical plans (the
    #: state machine test runs each alone).
    small_batch = 8

    def step(self, seq_ids=None) -> StepPlan:
        """One decode step: every sequence in ``seq_ids`` (default: all live ones, in row
        order) gains a token. All or nothing: raises :class:`OutOfBlocks` and changes
        nothing if the new blocks and copies the whole batch needs are not all free."""
        if seq_ids is None:
            ids = list(self._ids)
            if len(ids) <= self.small_batch:
                return self._step_few(ids, list(range(len(ids))))
            return self._step(ids, None)
        ids = list(seq_ids)
        try:
            rows = list(map(self._row_of.__getitem__, ids))
        except (KeyError, TypeError):
            rows = [self._row(s) for s in ids]           # raises, naming the sequence
        if len(ids) <= self.small_batch:
            if len(set(rows)) != len(rows):
                raise DuplicateSequence("a sequence appears more than once in one step")
            return self._step_few(ids, rows)
        rows = np.fromiter(rows, dtype=np.intp, count=len(rows))
        if len(rows) and np.bincount(rows).max() > 1:
            raise DuplicateSequence("a sequence appears more than once in one step")
        return self._step(ids, rows)

    def _copy_sources(self, blocks: list, counts: list) -> list:
        """For rows whose partly filled last blocks are ``blocks`` with owner counts
        ``counts``, in batch order: the block each must copy, or -1. Of ``k`` sharers of
        a block with ``c`` owners, the first ``min(k, c - 1)`` copy, the rest write in
        place."""
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
        flags = [cow.item(r) for r in rows]
        src = self._few_copy_sources(rows, pos, flags)
        takes = [p % bs == 0 or s >= 0 for p, s in zip(pos, src)]
        need = takes.count(True)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {len(ids)} sequences")
        # --- from here on nothing can fail
        width = max(pos) // bs + 1 if rows else 0
        self._grow_cols(width)
        tables, new = self._tables, iter(alloc._take_list(need))   # batch order
        slots, pairs = [], []
        for r, p, take, s in zip(rows, pos, takes, src):
            col, off = divmod(p, bs)
            if take:                           # a new block, or a private copy
                b = tables[r, col] = next(new)
                if s >= 0:
                    pairs.append((s, b))
            else:
                b = tables.item(r, col)
            slots.append(b * bs + off)
            lens[r] = p + 1
        copies = _NO_COPIES
        if pairs:
            copies = np.array(pairs, dtype=np.int32)
            alloc._drop_owners(copies[:, 0], unique=False)  # others keep each src
        if any(flags):
            cow[rows] = False                  # each row now writes a block of its own
        seq_lens = [p + 1 for p in pos]
        self._longest = max([self._longest, *seq_lens])
        both = np.array(slots + seq_lens, dtype=np.int32)   # one conversion, two views
        n = len(rows)
        return StepPlan(ids, both[:n], tables.take(rows, axis=0)[:, :width], both[n:],
                        copies)

    def _few_copy_sources(self, rows: list, pos: list, flags: list) -> list:
        """For each row, the block it must copy before writing, or -1."""
        bs, src = self.block_size, [-1] * len(rows)
        cand = [i for i, f in enumerate(flags) if f and pos[i] % bs]
        if cand:
            blocks = [self._tables.item(rows[i], pos[i] // bs) for i in cand]
            counts = [self.allocator.refcount(b) for b in blocks]
            for i, s in zip(cand, self._copy_sources(blocks, counts)):
                src[i] = s
        return src

    def _step(self, ids: list, rows) -> StepPlan:
        """The step for ``rows`` (an index array), or for all rows in order when ``rows``
        is None: then every array below is a view or a slice, not a gather."""
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
        flat = self._tables.reshape(-1)        # a view: flat indexing gathers fastest
        at = (self._rowbase[:n] if dense else self._rowbase[rows]) + col   # last blocks
        pick, srcs = self._step_copies(flat, at, flagged, fresh)
        need = k + len(pick)
        if need > alloc.num_free:
            raise OutOfBlocks(need, alloc.num_free, f"step of {n} sequences")
        # --- from here on nothing can fail
        copies, last = self._step_write(flat, at, fresh, k, pick, srcs)
        return self._step_finish(ids, rows, lens, flagged, last, off, width, copies)

    def _step_copies(self, flat, at, flagged, fresh) -> tuple[list, list]:
        """(batch indices, source blocks) of the rows that must copy their last block.
        Only rows flagged since their last write can; walk those (few) in Python."""
        if not np.count_nonzero(flagged):
            return [], []
        cand = np.flatnonzero(flagged & ~fresh)
        if not len(cand):
            return [], []
        blocks = flat[at[cand]]
        counts = self.allocator._counts(blocks)
        srcs = self._copy_sources(blocks.tolist(), counts.tolist())
        pick = [i for i, s in zip(cand.tolist(), srcs) if s >= 0]
        return pick, [s for s in srcs if s >= 0]

    def _step_write(self, flat, at, fresh, k, pick, srcs):
        """Take the new blocks (``k`` fresh rows' and ``pick``'s copies) and write them
        into the table, in batch order. Returns the copies and each row's last block."""
        n, need = len(at), k + len(pick)
        if not need:
            return _NO_COPIES, flat[at]
        new = self.allocator._take(need)       # int32 like the table: a copy, not a cast
        if k == n:                             # every row starts a block: no gather
            flat[at] = new
            return _NO_COPIES, new
        if not pick:
            flat[at[fresh]] = new
            return _NO_COPIES, flat[at]
        takes = fresh.copy()                   # rows that take a block, in batch order
        takes[pick] = True
        flat[at[takes]] = new
        src = np.array(srcs, dtype=np.int32)
        self.allocator._drop_owners(src, unique=False)   # the other owners keep each src
        return np.stack([src, flat[at[pick]]], axis=1), flat[at]

    def _step_finish(self, ids, rows, lens, flagged, last, off, width, copies):
        """Count the new tokens and build the plan (``last``: each row's last block, a new
        array of ours)."""
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
        last *= bs                             # the slots: block * block_size + offset
        last += off
        return StepPlan(ids, last, block_tables, seq_lens, copies)
