"""Prefix caching made fast: :class:`CachedBlocks` and :class:`PrefixCachingManager`
with the API, plans, block ids, hits, evictions and errors of
:mod:`pagedkv.prefix_cache`, over the fast allocator and manager of :mod:`pagedkv.fast`.

Where the time of a cache hit goes in the teaching version (a 2048-token prompt, 127
blocks found): checking the token ids one by one, a tuple and a NumPy array per block
for its hash, and a lookup, a comparison and a refcount check per block. Here:

* the prompt becomes one int64 array, checked at once, and its bytes are hashed block by block
  from one buffer (the same bytes, so the same names as the teaching ``block_hash``);
* a cached block keeps its tokens as those bytes, so the exact check of all the blocks found is
  one join and one comparison (and the parents one pass over the serial numbers); only when it
  fails does a per-block walk find where;
* the blocks found are taken at once: idle ones out of the ``OrderedDict``, the others one more
  owner each in one batched call.

Everything else is the teaching code's logic over the fast manager's rows: the cache's
state is the same three maps, and fresh blocks, idle blocks and evictions come in the
same order.
"""
from __future__ import annotations

import functools
import struct
from collections import Counter
from operator import itemgetter

import numpy as np
import xxhash

from ..checks import bad_token_ids, cdiv
from ..errors import AuditError, ConfigError, DoubleFree, OutOfBlocks
from ..manager import Plan
from .. import prefix_cache
from ..prefix_cache import PrefillPlan, Prompt, not_a_count
from ..reserve import Reserving
from .allocator import BlockAllocator
from .manager import KVCacheManager

__all__ = ["CachedBlocks", "PrefixCachingManager"]

_hash = xxhash.xxh3_64_intdigest
_NO_BLOCKS = np.zeros(0, dtype=np.int32)
_TOKENS, _SERIAL, _PARENT = itemgetter(1), itemgetter(2), itemgetter(3)   # Entry fields


@functools.lru_cache(maxsize=64)
def _int64s(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def _token_array(tokens) -> np.ndarray:
    """Token ids as a 1-D int64 array, by the rule of :func:`pagedkv.checks.token_ids`
    (the teaching path's). A list or tuple is packed by ``struct`` (one compiled format
    per length, about a third of NumPy's time for 2,048 ids), which refuses floats,
    ``None``, strings, NumPy bools and ids outside int64 as the rule does; Python bools,
    which it packs as 0 and 1, are looked for only where an id is 0 or 1."""
    ids = None
    if isinstance(tokens, (list, tuple)):
        try:
            ids = np.frombuffer(_int64s(len(tokens)).pack(*tokens), dtype="<i8")
        except struct.error:
            pass
        else:
            small = np.flatnonzero(ids <= 1).tolist()
            if small and any(type(tokens[i]) is bool for i in small):
                ids = None
    elif isinstance(tokens, np.ndarray) and tokens.ndim == 1 and tokens.dtype.kind in "iu":
        if not (tokens.dtype.kind == "u" and tokens.size and tokens.max() >= 2**63):
            ids = tokens.astype(np.int64)         # (a copy: the caller keeps theirs)
    if ids is None or (ids.size and ids.min() < 0):
        raise bad_token_ids(tokens)
    return ids


class CachedBlocks(prefix_cache.CachedBlocks):
    """The fast allocator's calls (one block, and the manager's batched ones), keeping
    full blocks cached after their last owner leaves, as
    :class:`pagedkv.prefix_cache.CachedBlocks` does (whose state, counts, lookups and
    inserts this keeps; an entry's tokens are its int64 bytes here, what its hash
    hashed). Idle blocks keep their one owner in the allocator."""

    def _counts(self, ids: np.ndarray) -> np.ndarray:
        counts = self.allocator._counts(ids)
        if self._idle:
            counts = counts - np.fromiter((b in self._idle for b in ids.tolist()), bool,
                                          count=len(ids))
        return counts

    def free_blocks(self) -> list[int]:
        """Every block that counts as free: the allocator's free stack, then the idle
        ones."""
        return self.allocator.free_blocks() + list(self._idle)

    # -------------------------------------------------------------- taking and giving back
    def _evict(self) -> int:
        block, _ = self._idle.popitem(last=False)
        del self._block_of[self._entry.pop(block).hash]
        self.evictions += 1
        return block

    def _take(self, n: int) -> np.ndarray:
        """``n`` fresh blocks (int32), in the order ``n`` calls of :meth:`allocate`
        give."""
        k = min(n, self.allocator.num_free)
        fresh = self.allocator._take(k) if k else _NO_BLOCKS
        if k == n:
            return fresh
        evicted = np.array([self._evict() for _ in range(n - k)], dtype=np.int32)
        return np.concatenate([fresh, evicted])

    def _take_list(self, n: int) -> list[int]:
        return self._take(n).tolist()

    def allocate(self) -> int:
        return int(self._take(1)[0]) if self.num_free else self.allocator.allocate()

    def _add_owners(self, ids: np.ndarray, times: int) -> None:
        self.allocator._add_owners(ids, times)     # (blocks a row maps are never idle)

    def _drop_owners(self, ids: np.ndarray, unique: bool = True) -> None:
        """Drop one owner of each block, in order; a cached block whose last owner
        leaves becomes idle (most recently used) instead of free."""
        if not len(ids):
            return
        if not unique:                             # (copy-on-write sources: a few)
            for b in ids.tolist():
                self._drop_owners(np.array([b]))
            return
        entry = self._entry
        blocks = ids.tolist()
        cached = [b in entry for b in blocks]
        if any(cached):
            last = self.allocator._counts(np.asarray(ids, dtype=np.intp)) == 1
            idle = [b for b, c, one in zip(blocks, cached, last.tolist()) if c and one]
            if idle:
                for b in idle:
                    self._idle[b] = None
                keep = set(idle)
                ids = np.array([b for b in blocks if b not in keep], dtype=np.intp)
        self.allocator._drop_owners(ids)

    def free(self, block: int) -> None:
        if self.refcount(block) == 0:                  # (refcount checks the id)
            raise DoubleFree(f"block {block} is already free")
        self._drop_owners(np.array([int(block)]))

    def free_n(self, blocks) -> None:
        ids = self.allocator._ids(blocks)
        for b, drops in Counter(ids.tolist()).items():   # all or nothing
            if drops > self.refcount(b):
                raise DoubleFree(f"block {b} has {self.refcount(b)} owner(s), cannot drop "
                                 f"{drops}")
        for b in ids.tolist():
            self._drop_owners(np.array([b]))

    # -------------------------------------------------------------- the cache
    def take(self, blocks: list) -> None:
        """One more owner for each found block; idle ones leave the idle list."""
        pop = self._idle.pop                   # an idle block's value is None: so this both
        held = [b for b in blocks if pop(b, True)]   # takes it out and keeps the others
        if held:
            self.allocator._add_owners(np.array(held, dtype=np.intp), 1)
        self.hits += len(blocks)

    def audit(self) -> None:
        self.allocator.audit()
        for hash_, block in self._block_of.items():
            entry = self._entry.get(block)
            if entry is None or entry.hash != hash_:
                raise AuditError(f"the index names block {block} for a hash it does not hold")
            if _hash(entry.tokens, seed=entry.parent_hash) != hash_:
                raise AuditError(f"block {block} is indexed under a hash that is not the "
                                 f"hash of its tokens")
        if len(self._entry) != len(self._block_of):
            raise AuditError("a cached block is missing from the index")
        for block in self._idle:
            if block not in self._entry or self.allocator.refcount(block) != 1:
                raise AuditError(f"idle block {block} is not cached with one owner")


class PrefixCachingManager(prefix_cache.PagesLookups, Reserving):
    """The fast :class:`~pagedkv.fast.KVCacheManager` (``pages``) over a pool whose full
    blocks are cached by content: the calls of
    :class:`pagedkv.prefix_cache.PrefixCachingManager` (not a ``KVCacheManager``, for the
    teaching one's reason)."""

    def __init__(self, allocator: BlockAllocator, block_size: int, *, caching: bool = True,
                 max_seqs: int = 64, max_seq_len: int = 64):
        self.pages = KVCacheManager(allocator, block_size, max_seqs=max_seqs,
                                    max_seq_len=max_seq_len)   # (which checks the pool)
        self.allocator = self.cache = self.pages.allocator = CachedBlocks(allocator)
        self.block_size, self.token_bytes = self.pages.block_size, self.pages.token_bytes
        self.caching = bool(caching)
        self._tail: dict = {}         # sequence id -> ids of its partly filled last block
        self._hashes: dict = {}       # sequence id -> hashes of its full blocks, in order
        self._serials: dict = {}      # sequence id -> serials of its chain (the teaching
        #                               manager's: an entry's, or None, per full block)

    # -------------------------------------------------------------- finding a prefix
    def _chain(self, data, full: int) -> list[int]:
        """The chained hashes of the first ``full`` blocks of ``data`` (int64 bytes)."""
        bs8, h, out = 8 * self.block_size, 0, []
        append = out.append
        for start in range(0, full * bs8, bs8):
            h = _hash(data[start:start + bs8], h)
            append(h)
        return out

    def _prompt_ids(self, tokens):
        """(int64 ids, the hashes of their full blocks or None) from token ids or a
        :class:`~pagedkv.prefix_cache.Prompt` (whose hashes are used if they fit)."""
        if isinstance(tokens, Prompt):
            full = len(tokens.hashes) == len(tokens.tokens) // self.block_size
            fits = tokens.block_size == self.block_size and full
            return _token_array(tokens.tokens), tokens.hashes if fits else None
        return _token_array(tokens), None

    def prompt(self, tokens) -> Prompt:
        """``tokens`` checked and hashed, once (the teaching ``prompt``)."""
        ids, hashes = self._prompt_ids(tokens)
        if hashes is None:
            hashes = self._chain(memoryview(ids).cast("B"), len(ids) // self.block_size) \
                if self.caching else []
        return Prompt(ids.tolist(), list(hashes), self.block_size)

    def _find_prefix(self, ids: np.ndarray, hashes=None):
        """(cached blocks of the leading full blocks of ``ids``, the hashes of all its
        full blocks, its bytes), stopping at the first miss, never at the block of the
        last token. Each full block is hashed once, here (unless ``hashes`` came with a
        prompt), for the lookup and for naming it later."""
        if not self.caching:
            return [], [], None
        bs = self.block_size
        data = memoryview(ids).cast("B")
        if hashes is None:
            hashes = self._chain(data, len(ids) // bs)
        blocks = list(map(self.cache._block_of.get, hashes[:(len(ids) - 1) // bs]))
        if None in blocks:
            blocks = blocks[:blocks.index(None)]
        if blocks:                              # the exact check, all blocks at once
            entries = list(map(self.cache._entry.__getitem__, blocks))
            serials = [0, *map(_SERIAL, entries[:-1])]
            found = bytes(data[:len(blocks) * 8 * bs])
            if (b"".join(map(_TOKENS, entries)) != found
                    or list(map(_PARENT, entries)) != serials):
                blocks = blocks[:self._first_refused(entries, serials, data)]
        return blocks, hashes, data

    def _first_refused(self, entries, serials, data) -> int:
        """Where the exact check refuses a block (a hash collision): the blocks before
        it stand."""
        bs8 = 8 * self.block_size
        for j, (e, parent) in enumerate(zip(entries, serials)):
            if e.tokens != data[j * bs8:(j + 1) * bs8] or e.parent != parent:
                return j
        return len(entries)

    def cached_prefix(self, tokens) -> int:
        return len(self._find_prefix(*self._prompt_ids(tokens))[0]) * self.block_size

    def blocks_to_add(self, *prompts) -> int:
        prompts = [self._prompt_ids(p) for p in prompts]
        found = [self._find_prefix(ids, hashes)[0] for ids, hashes in prompts]
        return self._need([len(ids) for ids, _ in prompts], found)

    def _need(self, lens: list, found: list) -> int:
        """Fresh blocks for ``lens`` tokens beyond the hits ``found``, and one for each
        idle block found (once, however many prompts find it)."""
        fresh = sum(cdiv(n, self.block_size) - len(h) for n, h in zip(lens, found))
        idle = self.cache._idle
        return fresh + len({b for h in found for b in h if b in idle})

    # -------------------------------------------------------------- growing
    def add(self, seq_id, tokens) -> PrefillPlan:
        return self.add_all([(seq_id, tokens)])[0]

    def add_all(self, seqs) -> list[PrefillPlan]:
        """The teaching ``add_all``: every sequence's hits are taken before any fresh
        block."""
        checked = []
        for seq_id, tokens in seqs:
            self.pages._check_new(seq_id, "sequence")
            if any(seq_id == other for other, *_ in checked):
                raise ConfigError(f"add_all: sequence {seq_id!r} is given twice")
            ids, hashes = self._prompt_ids(not_a_count(tokens, "add"))
            if not len(ids):
                raise ConfigError("add needs at least one token (the last one's logits "
                                  "choose the next)")
            checked.append((seq_id, ids, *self._find_prefix(ids, hashes)))
        cache = self.cache
        need = self._need([len(c[1]) for c in checked], [c[2] for c in checked])
        if need > cache.num_free:
            names = ", ".join(repr(c[0]) for c in checked)
            raise OutOfBlocks(need, cache.num_free, f"add {names}")
        for c in checked:                       # every hit first: none is evicted
            cache.take(c[2])
        return [self._place(*c) for c in checked]

    def _place(self, seq_id, ids, hits, hashes, data) -> PrefillPlan:
        """A new row: the cached blocks ``hits`` (taken already), then fresh blocks."""
        p, cache, n, bs = self.pages, self.cache, len(hits), self.block_size
        fresh = cdiv(len(ids), bs) - n
        row = len(p._ids)
        p._grow_rows(row + 1)
        p._ids.append(seq_id)
        p._row_of[seq_id] = row
        p._grow_cols(n)
        p._tables[row, :n] = hits
        p._lens[row] = n * bs
        full = len(ids) // bs
        self._tail[seq_id] = ids[full * bs:].tolist()
        self._hashes[seq_id] = list(hashes)
        self._serials[seq_id] = [cache._entry[b].serial for b in hits]
        plan = p._grow(row, len(ids) - n * bs, fresh, -1) if fresh else self._empty_plan()
        if self.caching:                        # name the new full blocks, in order
            self._name(p._tables[row], seq_id, n, data[n * 8 * bs:])
        return PrefillPlan(plan.slots, plan.copies, n * bs)

    def _name(self, table, seq_id, first: int, data) -> None:
        """Insert blocks ``first ..`` of a row into the cache, under their hashes, each
        the child of the entry the sequence holds for the blocks before it (the teaching
        ``_cache_full_blocks``' rule). ``data``: their int64 bytes, from block ``first``.
        """
        bs8, cache = 8 * self.block_size, self.cache
        hashes, serials = self._hashes[seq_id], self._serials[seq_id]
        for j in range(first, len(hashes)):
            at = (j - first) * bs8
            serials.append(cache.insert(int(table[j]), hashes[j], bytes(data[at:at + bs8]),
                                        serials[j - 1] if j else 0,
                                        hashes[j - 1] if j else 0))

    @staticmethod
    def _empty_plan() -> Plan:
        return Plan(_NO_BLOCKS.copy(), np.zeros((0, 2), dtype=np.int32))

    def append(self, seq_id, tokens):
        self.pages._row(seq_id)                    # an unknown id is reported first
        ids = _token_array(not_a_count(tokens, "append"))
        if not len(ids):
            raise ConfigError("append needs at least one token")
        plan = self.pages.append(seq_id, len(ids))
        self._tail[seq_id] += ids.tolist()
        self._cache_full_blocks(seq_id)
        return plan

    def step(self, seq_ids=None, tokens=None):
        ids = self.seq_ids if seq_ids is None else list(seq_ids)
        try:
            new = _token_array(not_a_count(tokens, "step")).tolist()
            if len(new) != len(ids):
                raise ConfigError(f"step: one token per sequence, got {len(new)} "
                                  f"token(s) for {len(ids)} sequence(s)")
        except ConfigError:
            for seq_id in ids:                     # an unknown id is reported first
                self.pages._row(seq_id)
            raise
        plan = self.pages.step(ids)
        bs, tails = self.block_size, self._tail
        for seq_id, token in zip(ids, new):
            tail = tails[seq_id]
            tail.append(token)
            if len(tail) == bs:
                self._cache_full_blocks(seq_id)
        return plan

    def _cache_full_blocks(self, seq_id) -> None:
        """Name (and cache) each block the sequence's tail of ids fills; keep the rest."""
        bs, tail = self.block_size, self._tail[seq_id]
        full = len(tail) // bs * bs
        if self.caching and full:
            hashes = self._hashes[seq_id]
            first = len(hashes)
            data = memoryview(np.array(tail[:full], dtype=np.int64)).cast("B")
            h = hashes[-1] if hashes else 0
            for start in range(0, full * 8, 8 * bs):
                h = _hash(data[start:start + 8 * bs], h)
                hashes.append(h)
            self._name(self.pages._tables[self.pages._row_of[seq_id]], seq_id, first, data)
        del tail[:full]

    # -------------------------------------------------------------- forking and freeing
    def fork(self, parent, *children) -> None:
        self.pages.fork(parent, *children)
        for child in children:
            self._tail[child] = list(self._tail[parent])
            self._hashes[child] = list(self._hashes[parent])
            self._serials[child] = list(self._serials[parent])

    def free(self, seq_id) -> None:
        """Release the sequence's blocks, the last one first (see the teaching manager).
        """
        p = self.pages
        blocks = p._blocks(p._row(seq_id))
        blocks[:] = blocks[::-1].copy()            # the row is dropped next: only the order
        p.free(seq_id)                             # in which its blocks are given back moves
        del self._tail[seq_id], self._hashes[seq_id], self._serials[seq_id]

    def audit(self) -> None:
        self.pages.audit()
        bs = self.block_size
        for seq_id in self.seq_ids:
            n, tail = self._committed(seq_id), self._tail[seq_id]  # (reserve.py)
            if len(tail) != n % bs:
                raise AuditError(f"sequence {seq_id!r} has {n} tokens of K/V but keeps "
                                 f"{len(tail)} ids of its last block")
            serials = self._serials[seq_id]
            if self.caching and len(serials) != n // bs:
                raise AuditError(f"sequence {seq_id!r} has {n // bs} full blocks but a "
                                 f"chain of {len(serials)}")
            for block, serial in zip(self.block_table(seq_id).tolist(), serials):
                entry = self.cache._entry.get(block)
                if entry is not None and entry.serial != serial:
                    raise AuditError(f"block {block} is cached as another entry than the "
                                     f"one sequence {seq_id!r} holds in it")
