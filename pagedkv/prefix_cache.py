"""Prefix caching: full blocks named by their tokens, kept after their last owner
leaves, and found again by the next request that starts with the same tokens.

A full block is named by a *chained hash*: block ``j`` of a sequence hashes its own
tokens with the hash of block ``j - 1`` as the seed (``xxh3_64``), so equal hashes mean
equal prefixes, up to a hash collision. A collision must never hand a request someone
else's K/V, so a hit is confirmed exactly: the cached block's own tokens must equal the
request's, and the block must have been computed after the very block the request
matched just before it. Each cached block remembers its parent's *serial number* (a
counter that is never reused). A hit follows the request's own chain: block ``j`` is
found only as the child of the entry it found at ``j - 1``. And a block is cached only
as the child of the entry its own sequence holds for the blocks before it (its own
block, the block it hit, or an equal twin confirmed the same exact way), never as the
child of whatever block the index holds under its parent's hash, which may be a
collision's.

:class:`CachedBlocks` wraps a :class:`~pagedkv.allocator.BlockAllocator` with the same
calls and adds the cache. Its state, besides the allocator::

    _block_of   hash -> block: the index of cached blocks
    _entry      block -> Entry(hash, tokens, serial, parent serial, parent hash): what a
                cached block holds
    _idle       cached blocks that no sequence maps, least recently used first

An idle block is owned by the cache: the allocator counts it with one owner, so the
allocator's own invariants hold unchanged, while to everyone else it is free
(``num_free`` counts it and ``refcount`` says 0). A fresh block comes from the
allocator's free stack while it has one; after that the least recently used idle block
is evicted (its hash forgotten, so it can never answer to it again). Invariants, checked
by :meth:`CachedBlocks.audit`: every index entry names a block whose entry has that
hash, and that hash is the chained hash of the entry's tokens; every idle block is
cached and has exactly one owner.

:class:`PrefixCachingManager` holds a :class:`~pagedkv.manager.KVCacheManager` over such
a pool and answers its lookups, but it is not one: its ``add``, ``append`` and ``step``
take the token ids whose K/V the new slots will hold, where the plain manager's take
counts. A count cannot keep the contract here (a block is named by its tokens, so the
ids would have to come from somewhere else behind the caller's back), and a subclass
whose calls mean something else makes every caller ask which one it holds. So the
types are apart: code written for the plain manager fails at its first call on this one,
with an error that says so. It keeps no copy of a sequence's tokens either: the caller
owns them (the engine's sequences), and the manager keeps what it needs of them, the
hashes of the full blocks and the ids of the partly filled last one, until that block
fills and is named. A sequence frees its blocks last one first, so that its tail is
evicted before its head (a cached block is only found through the blocks before it).
With ``caching=False`` it caches nothing: the same engine code runs with and without
the cache. Slots whose ids come later (``reserve``, ``reserve_slots``, ``commit``) and
rewinds (``truncate``) are :mod:`pagedkv.reserve`'s: a block is named only once every
token in it is committed, and a rewind forgets a named block it leaves partly filled.
"""
from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from typing import NamedTuple

import numpy as np
import xxhash

from .checks import cdiv, is_int, token_ids
from .errors import AuditError, ConfigError, DoubleFree, OutOfBlocks
from .manager import KVCacheManager, Plan, StepPlan, need_teaching_allocator
from .page_table import PageTable
from .reserve import Reserving

__all__ = ["block_hash", "CachedBlocks", "PrefixCachingManager", "PrefillPlan",
           "Prompt"]


def block_hash(parent: int, tokens: tuple) -> int:
    """The chained hash of a full block: its tokens (as int64 bytes), seeded by its
    parent's hash (0 for a sequence's first block)."""
    data = np.array(tokens, dtype=np.int64).tobytes()
    return xxhash.xxh3_64_intdigest(data, seed=parent)


class Entry(NamedTuple):
    hash: int
    tokens: tuple        # the block's own tokens
    serial: int          # unique to this caching of this block
    parent: int          # the serial of the block before it (0: a sequence's first)
    parent_hash: int     # the hash it was chained from (0: the sequence's first block)


class CachedBlocks:
    """A :class:`~pagedkv.allocator.BlockAllocator` that keeps full blocks after their
    last owner frees them, until their block is needed for something else."""

    def __init__(self, allocator):
        self.allocator = allocator
        self.num_blocks, self.block_bytes = allocator.num_blocks, allocator.block_bytes
        self._block_of: dict[int, int] = {}
        self._entry: dict[int, Entry] = {}
        self._idle: OrderedDict[int, None] = OrderedDict()
        self._serials = itertools.count(1)
        self.hits = self.evictions = 0

    # ---------------------------------------------------------- the allocator's calls
    @property
    def num_free(self) -> int:
        return self.allocator.num_free + len(self._idle)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_idle(self) -> int:
        """Cached blocks nobody maps (counted in ``num_free``)."""
        return len(self._idle)

    @property
    def num_shared(self) -> int:
        return self.allocator.num_shared         # (an idle block has one owner)

    def refcount(self, block: int) -> int:
        return self.allocator.refcount(block) - (block in self._idle)

    def refcounts(self) -> np.ndarray:
        counts = self.allocator.refcounts()
        counts[list(self._idle)] -= 1
        return counts

    def allocate(self) -> int:
        """A fresh block: from the free stack, else the least recently used idle one."""
        if self.allocator.num_free or not self._idle:
            return self.allocator.allocate()       # (OutOfBlocks when both are empty)
        block, _ = self._idle.popitem(last=False)  # evict: its one owner is the caller
        del self._block_of[self._entry.pop(block).hash]
        self.evictions += 1
        return block

    def free(self, block: int) -> None:
        """Drop one owner; a cached block whose last owner leaves stays, idle."""
        owners = self.refcount(block)
        if owners == 0:                            # free, or idle: nobody's to drop
            raise DoubleFree(f"block {block} is already free")
        if owners == 1 and block in self._entry:
            self._idle[block] = None               # most recently used: evicted last
        else:
            self.allocator.free(block)

    def free_n(self, blocks) -> None:
        for b, drops in Counter(blocks).items():   # all or nothing, as the allocator's
            if drops > self.refcount(b):
                raise DoubleFree(f"block {b} has {self.refcount(b)} owner(s), cannot "
                                 f"drop {drops}")
        for b in blocks:
            self.free(b)

    def share_n(self, blocks, times: int = 1) -> None:
        self.allocator.share_n(blocks, times)      # (mapped blocks are never idle)

    # -------------------------------------------------------------- the cache
    def lookup(self, hash_: int, tokens: tuple, parent: int):
        """``(block, serial)`` of the block cached under ``hash_`` if it really holds
        ``tokens``, computed after the block with serial ``parent``; else None."""
        block = self._block_of.get(hash_)
        if block is None:
            return None
        entry = self._entry[block]
        if entry.tokens != tokens or entry.parent != parent:
            return None                            # a hash collision: refuse it
        return block, entry.serial

    def is_idle(self, block: int) -> bool:
        return block in self._idle

    def take(self, block: int) -> None:
        """Add an owner to a cached block found by :meth:`lookup` (an idle one leaves
        the idle list in O(1) and keeps the cache's owner count as its new owner's)."""
        if block in self._idle:
            del self._idle[block]
        else:
            self.allocator.share(block)
        self.hits += 1

    def serial(self, hash_: int):
        """The serial of the block cached under ``hash_``, or None."""
        block = self._block_of.get(hash_)
        return None if block is None else self._entry[block].serial

    def insert(self, block: int, hash_: int, tokens, parent, parent_hash: int):
        """Cache a full block computed after the entry with serial ``parent`` (0: a
        sequence's first block; None: no entry holds the blocks before it). Returns the
        serial of the entry that holds this prefix now, or None. If another block holds
        the hash already (two requests computed the same prefix), the first stays the
        one the index answers with, and its serial is returned if it is a true twin
        (the same tokens after the same parent), None if it is a collision."""
        if parent is None or (parent and self.serial(parent_hash) != parent):
            return None                        # the parent is unknown, or evicted
        if hash_ not in self._block_of and block not in self._entry:
            serial = next(self._serials)
            self._block_of[hash_] = block
            self._entry[block] = Entry(hash_, tokens, serial, parent, parent_hash)
            return serial
        twin = self.lookup(hash_, tokens, parent)
        return None if twin is None else twin[1]

    def forget(self, block: int) -> None:
        """Un-name a block that a sequence still maps (a truncation cut it: it no longer
        holds the tokens its hash names), so that no lookup finds it again."""
        entry = self._entry.pop(block, None)
        if entry is not None:
            del self._block_of[entry.hash]

    def audit(self) -> None:
        self.allocator.audit()
        for hash_, block in self._block_of.items():
            entry = self._entry.get(block)
            if entry is None or entry.hash != hash_:
                raise AuditError(f"the index names block {block} for a hash it does "
                                 f"not hold")
            if block_hash(entry.parent_hash, entry.tokens) != hash_:
                raise AuditError(f"block {block} is indexed under a hash that is not "
                                 f"the hash of its tokens")
        if len(self._entry) != len(self._block_of):
            raise AuditError("a cached block is missing from the index")
        for block in self._idle:
            if block not in self._entry or self.allocator.refcount(block) != 1:
                raise AuditError(f"idle block {block} is not cached with one owner")


class PrefillPlan(NamedTuple):
    """A prompt's admission: the first ``cached_tokens`` tokens' K/V was found in the
    cache; the slots are those of the tokens that remain to be computed."""
    slots: np.ndarray
    copies: np.ndarray
    cached_tokens: int


class Prompt(NamedTuple):
    """Token ids checked once, with the chained hashes of their full blocks computed
    once: :meth:`PrefixCachingManager.prompt` makes it, and ``add``, ``cached_prefix``
    and ``blocks_to_add`` take it in place of the ids, so that an engine hashes a prompt
    once however many times it asks about it."""
    tokens: list
    hashes: list
    block_size: int

    def head(self, n: int) -> "Prompt":
        """The prompt's first ``n`` tokens (a chunk of its prefill), hashes included."""
        return Prompt(self.tokens[:n], self.hashes[:n // self.block_size],
                      self.block_size)


class PagesLookups:
    """The lookups a prefix-caching manager answers as its manager ``pages`` does (shared by
    the teaching and the fast one)."""

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.pages

    def __len__(self) -> int:
        return len(self.pages)

    @property
    def seq_ids(self) -> list:
        return self.pages.seq_ids

    def num_tokens(self, seq_id) -> int:
        return self.pages.num_tokens(seq_id)

    def block_table(self, seq_id) -> np.ndarray:
        return self.pages.block_table(seq_id)

    def page_table(self, seq_id) -> PageTable:
        return self.pages.page_table(seq_id)

    def slot(self, seq_id, token: int) -> int:
        return self.pages.slot(seq_id, token)

    def slots(self, seq_id) -> np.ndarray:
        return self.pages.slots(seq_id)

    def blocks_needed(self, seq_id, n: int = 1) -> int:
        return self.pages.blocks_needed(seq_id, n)

    def can_append(self, seq_id, n: int = 1) -> bool:
        return self.pages.can_append(seq_id, n)

    def stats(self):
        return self.pages.stats()

    def __repr__(self) -> str:
        return repr(self.pages).replace("KVCacheManager", "PrefixCachingManager", 1)


class PrefixCachingManager(PagesLookups, Reserving):
    """Chapter 5's manager (``pages``) over a pool whose full blocks are cached by
    content. ``add``, ``append`` and ``step`` take the token ids whose K/V the new slots
    will hold, so it is not a :class:`~pagedkv.manager.KVCacheManager`; it answers the
    same lookups. With ``caching=False`` nothing is ever cached or found."""

    def __init__(self, allocator, block_size: int, *, caching: bool = True):
        need_teaching_allocator(self, allocator)
        self.pages = KVCacheManager(allocator, block_size)   # (which checks the pool)
        self.allocator = self.cache = self.pages.allocator = CachedBlocks(allocator)
        self.block_size = self.pages.block_size
        self.token_bytes = self.pages.token_bytes
        self.caching = bool(caching)
        self._tail: dict = {}         # sequence id -> ids of its partly filled block
        self._hashes: dict = {}       # sequence id -> hashes of its full blocks
        self._serials: dict = {}      # sequence id -> for each full block, the serial
        #                               of the entry holding its tokens so far, or None

    def _table(self, seq_id) -> PageTable:
        return self.pages._table(seq_id)

    # -------------------------------------------------------------- finding a prefix
    def prompt(self, tokens) -> Prompt:
        """``tokens`` checked and hashed, once, for the calls that take a prompt."""
        bs = self.block_size
        if isinstance(tokens, Prompt):
            full = len(tokens.hashes) == len(tokens.tokens) // bs or not self.caching
            if tokens.block_size == bs and full:
                return tokens
            tokens = tokens.tokens                 # (made for another block size)
        tokens, hashes = token_ids(tokens), []
        for j in range(len(tokens) // bs if self.caching else 0):
            hashes.append(block_hash(hashes[-1] if j else 0,
                                     tuple(tokens[j * bs:(j + 1) * bs])))
        return Prompt(tokens, hashes, bs)

    def _find_prefix(self, tokens) -> tuple[list, list]:
        """Cached blocks holding the leading full blocks of a prompt (ids or a
        :class:`Prompt`), and their serials, stopping at the first miss. At least the
        last token is left to compute: it is the one whose logits are needed, so a
        prompt never hits a block that ends the prompt."""
        prompt = self.prompt(tokens)
        bs, tokens, blocks, serials = self.block_size, prompt.tokens, [], []
        for j in range((len(tokens) - 1) // bs if self.caching else 0):
            own = tuple(tokens[j * bs:(j + 1) * bs])
            hit = self.cache.lookup(prompt.hashes[j], own, serials[-1] if j else 0)
            if hit is None:
                break
            blocks.append(hit[0])
            serials.append(hit[1])
        return blocks, serials

    def _blocks_to_add(self, prompts: list, hits: list) -> int:
        """Free blocks admitting ``prompts`` together takes (``hits[i]``: the cached
        blocks prompt ``i`` finds): fresh blocks for what the cache lacks, and one for
        each idle block found (idle blocks count as free until taken; one found by two
        prompts is taken once)."""
        fresh = sum(cdiv(len(p.tokens), self.block_size) - len(h)
                    for p, h in zip(prompts, hits))
        return fresh + len({b for h in hits for b in h if self.cache.is_idle(b)})

    def cached_prefix(self, tokens) -> int:
        """How many leading tokens of a new sequence ``tokens`` (ids or a
        :class:`Prompt`) the cache holds now (a multiple of the block size, less than
        ``len(tokens)``). Changes nothing."""
        return len(self._find_prefix(self.prompt(tokens))[0]) * self.block_size

    def blocks_to_add(self, *prompts) -> int:
        """Free blocks ``add(seq, tokens)`` would take now, or ``add_all`` for several
        prompts. Changes nothing."""
        prompts = [self.prompt(p) for p in prompts]
        return self._blocks_to_add(prompts, [self._find_prefix(p)[0] for p in prompts])

    def add(self, seq_id, tokens) -> PrefillPlan:
        """Admit a prompt (token ids, or a :class:`Prompt`): its leading full blocks
        from the cache where they are there, fresh blocks for the rest. All or nothing,
        as :meth:`KVCacheManager.add`."""
        return self.add_all([(seq_id, tokens)])[0]

    def add_all(self, seqs) -> list[PrefillPlan]:
        """Admit several sequences at once, ``(seq_id, tokens)`` each (a request's
        samples, back after a preemption): every one's cached blocks are taken before
        any fresh block is, so that a fresh block for one never evicts an idle block
        another one finds. All or nothing."""
        checked = []
        for seq_id, tokens in seqs:
            self.pages._check_new(seq_id, "sequence")
            if any(seq_id == other for other, _ in checked):
                raise ConfigError(f"add_all: sequence {seq_id!r} is given twice")
            prompt = self.prompt(not_a_count(tokens, "add"))
            if not prompt.tokens:
                raise ConfigError("add needs at least one token (the last one's logits "
                                  "choose the next)")
            checked.append((seq_id, prompt))
        seqs, found = checked, [self._find_prefix(prompt) for _, prompt in checked]
        need = self._blocks_to_add([p for _, p in seqs], [hits for hits, _ in found])
        if need > self.cache.num_free:
            names = ", ".join(repr(s) for s, _ in seqs)
            raise OutOfBlocks(need, self.cache.num_free, f"add {names}")
        for hits, _ in found:                      # every hit first: none is evicted
            for b in hits:
                self.cache.take(b)
        return [self._place(seq_id, prompt, hits, serials)
                for (seq_id, prompt), (hits, serials) in zip(seqs, found)]

    def _place(self, seq_id, prompt: Prompt, hits: list, serials: list) -> PrefillPlan:
        """A new page table: the cached blocks ``hits`` (taken already), then fresh
        blocks for the rest of the prompt, named as they fill."""
        found = len(hits) * self.block_size
        table = self.pages._tables[seq_id] = PageTable(self.block_size, hits, found)
        self._tail[seq_id] = prompt.tokens[found:]
        self._hashes[seq_id] = list(prompt.hashes)
        self._serials[seq_id] = serials
        plan = self.pages._grow(table, len(prompt.tokens) - found)
        self._cache_full_blocks(seq_id)
        return PrefillPlan(plan.slots, plan.copies, found)

    def append(self, seq_id, tokens) -> Plan:
        """Append the K/V slots of ``tokens`` (ids), as :meth:`KVCacheManager.append`
        does for a count."""
        self._table(seq_id)                        # an unknown id is reported first
        tokens = token_ids(not_a_count(tokens, "append"))
        if not tokens:
            raise ConfigError("append needs at least one token")
        plan = self.pages.append(seq_id, len(tokens))
        self._tail[seq_id] += tokens
        self._cache_full_blocks(seq_id)
        return plan

    def step(self, seq_ids=None, tokens=None) -> StepPlan:
        """One decode step; ``tokens[i]`` is the token whose K/V goes into sequence
        ``i``'s new slot (the one sampled at the step before)."""
        ids = self.seq_ids if seq_ids is None else list(seq_ids)
        for seq_id in ids:                         # an unknown id is reported first
            self._table(seq_id)
        tokens = token_ids(not_a_count(tokens, "step"))
        if len(tokens) != len(ids):
            raise ConfigError(f"step: one token per sequence, got {len(tokens)} "
                              f"token(s) for {len(ids)} sequence(s)")
        plan = self.pages.step(ids)
        for seq_id, token in zip(ids, tokens):
            tail = self._tail[seq_id]
            tail.append(token)
            if len(tail) == self.block_size:
                self._cache_full_blocks(seq_id)
        return plan

    def _cache_full_blocks(self, seq_id) -> None:
        """Name (and cache) each block the sequence's tail of ids fills, and keep the
        rest: a full block's ids live on in its hash. A block is cached when its slots
        are planned: the caller writes them before anyone reads them."""
        bs, tail = self.block_size, self._tail[seq_id]
        full = len(tail) // bs * bs
        hashes, serials = self._hashes[seq_id], self._serials[seq_id]
        blocks = self._table(seq_id).blocks
        for start in range(0, full if self.caching else 0, bs):
            j, block_tokens = len(serials), tuple(tail[start:start + bs])
            parent_hash = hashes[j - 1] if j else 0
            if j == len(hashes):                   # (a prompt's came hashed already)
                hashes.append(block_hash(parent_hash, block_tokens))
            # its parent: the entry this sequence holds for the blocks before it
            serials.append(self.cache.insert(blocks[j], hashes[j], block_tokens,
                                             serials[-1] if j else 0, parent_hash))
        del tail[:full]

    def fork(self, parent, *children) -> None:
        """As :meth:`KVCacheManager.fork`; each child starts with its parent's chain."""
        self.pages.fork(parent, *children)
        for child in children:
            self._tail[child] = list(self._tail[parent])
            self._hashes[child] = list(self._hashes[parent])
            self._serials[child] = list(self._serials[parent])

    def free(self, seq_id) -> None:
        """Release the sequence's blocks, the last one first: a cached block can only be
        found through the blocks before it, so the tail should be evicted before the
        head."""
        self._table(seq_id).blocks.reverse()   # dropped next: only the order changes
        self.pages.free(seq_id)
        del self._tail[seq_id], self._hashes[seq_id], self._serials[seq_id]

    def audit(self) -> None:
        """The page tables' and the cache's invariants, and: each sequence keeps the ids
        of its partly filled last block alone, and each cached block it maps is the
        entry its chain holds there."""
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
            for block, serial in zip(self._table(seq_id).blocks, serials):
                entry = self.cache._entry.get(block)
                if entry is not None and entry.serial != serial:
                    raise AuditError(f"block {block} is cached as another entry than "
                                     f"the one sequence {seq_id!r} holds in it")


def not_a_count(tokens, call: str):
    """``tokens``, unless it is a count (or, for ``step``, nothing): what code written
    for the plain manager passes, refused first, saying so."""
    if tokens is None or is_int(tokens):
        raise ConfigError(f"PrefixCachingManager.{call} takes token ids, got "
                          f"{tokens!r} (what KVCacheManager.{call} takes)")
    return tokens
