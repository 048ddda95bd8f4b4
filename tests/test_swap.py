"""Swapping: the books (host blocks, pairs, all or nothing) and the bytes (a round trip through
the host pool restores every block exactly), with the plain and the prefix-caching manager, on
NumPy and, when a GPU is usable, on CuPy with pinned host memory.

The device pool is an integer array ``[layers, num_blocks, block_size]``: one value per slot and
layer, a different value for every (sequence, position, layer), so a block that comes back to
the wrong place or not at all reads back wrong.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import (AuditError, ConfigError, DuplicateSequence, OutOfBlocks,
                            SequenceExists, UnknownSequence)
from pagedkv.manager import KVCacheManager
from pagedkv.prefix_cache import PrefixCachingManager
from pagedkv.swap import HostPool, Swapper, copy_to_device, copy_to_host

from _backends import XP_PARAMS, host, resolve

BS, LAYERS = 4, 3
BLOCK_BYTES = LAYERS * BS * 8              # int64 values, all layers of one block


class Device:
    """A manager, its pool of values, a host pool and a swapper, executing every plan."""

    def __init__(self, num_blocks=16, host_blocks=16, *, prefix=False, xp=np):
        alloc = BlockAllocator(num_blocks, BLOCK_BYTES, xp=np)
        self.m = (PrefixCachingManager(alloc, BS) if prefix else KVCacheManager(alloc, BS))
        self.prefix, self.xp = prefix, xp
        self.pool = xp.full((LAYERS, num_blocks, BS), -1, dtype=np.int64)
        self.host = HostPool(host_blocks, BLOCK_BYTES, pinned=xp is not np)
        self.swapper = Swapper(self.m, self.host)
        self.tokens: dict = {}

    def value(self, seq, t, layer):
        return hash((tuple(self.tokens[seq][:t + 1]), layer)) & 0xFFFFFFFFFFFF

    def write(self, seq, slots, first):
        slots = np.asarray(slots, dtype=np.int64)
        vals = np.array([[self.value(seq, first + i, la) for i in range(len(slots))]
                         for la in range(LAYERS)], dtype=np.int64)
        flat = self.pool.reshape(LAYERS, -1)
        flat[:, self.xp.asarray(slots)] = self.xp.asarray(vals)

    def add(self, seq, tokens):
        self.tokens[seq] = list(tokens)
        plan = self.m.add(seq, tokens if self.prefix else len(tokens))
        self.write(seq, plan.slots, len(tokens) - len(plan.slots))
        self.check(seq)

    def step(self, seqs, new_tokens):
        plan = (self.m.step(seqs, new_tokens) if self.prefix else self.m.step(seqs))
        for src, dst in plan.copies.tolist():
            self.pool[:, dst] = self.pool[:, src]
        for seq, tok, slot in zip(seqs, new_tokens, plan.slot_mapping.tolist()):
            self.tokens[seq].append(tok)
            self.write(seq, [slot], len(self.tokens[seq]) - 1)
        for seq in seqs:
            self.check(seq)

    def fork(self, parent, child):
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def swap_out(self, seqs):
        pairs = self.swapper.swap_out(seqs)
        copy_to_host(self.pool, self.host, pairs)
        base = self.m.cache.allocator if self.prefix else self.m.allocator
        gone = [b for b in pairs[:, 0].tolist() if base.refcount(b) == 0]
        free_now = self.xp.asarray(np.array(gone, dtype=np.int64))
        self.pool[:, free_now] = -7                   # blocks free for reuse: overwritten
        return pairs

    def swap_in(self, seqs):
        contents = [self.tokens[s] if self.prefix else len(self.tokens[s]) for s in seqs]
        pairs = self.swapper.swap_in(seqs, contents)
        copy_to_device(self.host, self.pool, pairs)
        for s in seqs:
            self.check(s)
        return pairs

    def check(self, seq):
        slots = self.m.slots(seq).astype(np.int64)
        got = host(self.pool.reshape(LAYERS, -1)[:, self.xp.asarray(slots)])
        want = [[self.value(seq, t, la) for t in range(len(slots))] for la in range(LAYERS)]
        assert got.tolist() == want, f"{seq} reads wrong K/V"
        self.m.audit()
        self.swapper.audit()


@pytest.mark.parametrize("xp", XP_PARAMS)
def test_round_trip_restores_every_block(xp):
    d = Device(xp=resolve(xp))
    d.add("a", list(range(1, 11)))                    # 3 blocks
    d.add("b", list(range(20, 26)))                   # 2 blocks
    pairs = d.swap_out(["a"])
    assert len(pairs) == 3 and "a" not in d.m and d.host.num_used == 3
    d.add("c", list(range(40, 50)))                   # takes a's device blocks
    assert set(d.m.block_table("c").tolist()) & set(pairs[:, 0].tolist())
    d.step(["b", "c"], [7, 8])
    pairs = d.swap_in(["a"])
    assert len(pairs) == 3 and d.host.num_used == 0
    d.step(["a", "b", "c"], [1, 2, 3])
    assert d.swapper.blocks_out == d.swapper.blocks_in == 3


@pytest.mark.parametrize("xp", XP_PARAMS)
def test_blocks_shared_by_forks_are_parked_once(xp):
    d = Device(xp=resolve(xp))
    d.add("p", list(range(1, 7)))                     # 2 blocks, the last one partly filled
    d.fork("p", "q")
    d.step(["p"], [9])                                # p copies the shared partial block
    pairs = d.swap_out(["p", "q"])
    assert len(pairs) == 3                            # block 0 (shared), p's copy, q's block
    assert d.host.refcounts().tolist().count(2) == 1  # the shared one, twice on the host
    d.swap_in(["q", "p"])
    d.step(["p", "q"], [10, 11])
    assert d.host.num_used == 0


def test_a_prefix_cache_hit_needs_no_copy():
    d = Device(prefix=True)
    d.add("a", list(range(1, 12)))                    # 2 full blocks cached, 3 tokens more
    d.swap_out(["a"])                                 # the full blocks stay cached (idle)
    pairs = d.swap_in(["a"])
    assert len(pairs) == 1                            # only the partly filled last block
    assert d.m.cache.hits == 2
    d.step(["a"], [5])


def test_after_eviction_everything_is_copied_back():
    d = Device(num_blocks=4, prefix=True)
    d.add("a", list(range(1, 12)))                    # 3 blocks of 4
    d.swap_out(["a"])
    d.add("b", list(range(50, 63)))                   # 4 blocks: evicts a's cached ones
    d.m.free("b")
    assert d.m.cache.evictions == 2
    assert len(d.swap_in(["a"])) == 3


def test_swap_out_all_or_nothing_when_the_host_is_full():
    d = Device(host_blocks=2)
    d.add("a", list(range(1, 11)))
    before = (d.m.block_table("a").tolist(), d.host.num_free)
    with pytest.raises(OutOfBlocks, match="host blocks"):
        d.swap_out(["a"])
    assert (d.m.block_table("a").tolist(), d.host.num_free) == before
    assert not d.swapper.swapped
    d.check("a")


def test_swap_in_all_or_nothing_when_the_device_is_full():
    d = Device(num_blocks=4)
    d.add("a", list(range(1, 10)))                    # 3 blocks
    d.swap_out(["a"])
    d.add("b", list(range(1, 8)))                     # 2 of the 4 blocks
    with pytest.raises(OutOfBlocks, match="swap in"):
        d.swap_in(["a"])
    assert "a" in d.swapper.swapped and "a" not in d.m and d.host.num_used == 3
    d.m.free("b")
    d.swap_in(["a"])


def test_misuse():
    d = Device()
    d.add("a", [1, 2, 3])
    with pytest.raises(UnknownSequence):
        d.swapper.swap_out(["nope"])
    with pytest.raises(DuplicateSequence):
        d.swapper.swap_out(["a", "a"])
    with pytest.raises(UnknownSequence, match="not swapped out"):
        d.swapper.swap_in(["a"], [3])
    d.swap_out(["a"])
    with pytest.raises(ConfigError, match="held 3 tokens, 2 given"):
        d.swapper.swap_in(["a"], [2])                 # the owner's tokens decide, checked
    with pytest.raises(ConfigError, match="one contents per sequence"):
        d.swapper.swap_in(["a"], [])
    with pytest.raises(ConfigError, match="token ids"):
        d.swapper.swap_in(["a"], [[1, 2.5, 3]])
    with pytest.raises(ConfigError, match="takes counts|number of tokens|non-negative"):
        d.swapper.swap_in(["a"], [[1, 2, 3]])         # ids to the plain manager
    d.add("a2", [4])
    d.m.add("a", 2)                                   # a new sequence took the name
    with pytest.raises(SequenceExists, match="running sequence"):
        d.swapper.swap_in(["a"], [3])
    with pytest.raises(ConfigError, match="cannot hold"):
        Swapper(d.m, HostPool(4, BLOCK_BYTES * 2, pinned=False))
    assert d.host.num_used == 1                       # nothing changed by the failures


def test_audit_catches_a_lost_host_block():
    d = Device()
    d.add("a", list(range(1, 10)))
    d.swap_out(["a"])
    d.host.free(d.swapper.swapped["a"].host_blocks[0])
    with pytest.raises(AuditError, match="host block"):
        d.swapper.audit()


def test_host_pool_is_pinned_on_a_gpu():
    pool = HostPool(4, 64)
    assert isinstance(pool.pool, np.ndarray) and pool.pool.nbytes == 256
    assert pool.pinned == backend.on_gpu
    if backend.on_gpu:
        import cupy
        attrs = cupy.cuda.runtime.pointerGetAttributes(pool.pool.ctypes.data)
        assert attrs.type == cupy.cuda.runtime.memoryTypeHost


def test_empty_pairs_move_nothing():
    d = Device()
    before = d.pool.copy()
    copy_to_host(d.pool, d.host, np.zeros((0, 2), np.int32))
    copy_to_device(d.host, d.pool, np.zeros((0, 2), np.int32))
    assert (host(d.pool) == host(before)).all()
