import re

import numpy as np
import pytest

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import (AuditError, ConfigError, DuplicateSequence, OutOfBlocks,
                            SequenceExists, UnknownSequence)
from pagedkv.manager import KVCacheManager

from _backends import XP_PARAMS, resolve


def make(num_blocks=16, block_size=4, xp=np, **kw):
    return KVCacheManager(BlockAllocator(num_blocks, block_size * 8, xp=xp), block_size, **kw)


def snapshot(m):
    return (m.stats(), m.seq_ids, {s: m.block_table(s).tolist() for s in m.seq_ids},
            m.allocator.free_blocks(), m.allocator.refcounts().tolist())


class Pool:
    """A trivially correct stand-in for the KV pool: one integer per slot, copies done in NumPy."""

    def __init__(self, m):
        self.m = m
        self.data = np.full(m.allocator.num_blocks * m.block_size, -1, dtype=np.int64)

    def apply(self, plan, values):
        bs = self.m.block_size
        for src, dst in plan.copies.tolist():
            self.data[dst * bs:(dst + 1) * bs] = self.data[src * bs:(src + 1) * bs]
        slots = getattr(plan, "slots", None)
        if slots is None:
            slots = plan.slot_mapping
        self.data[slots] = values

    def read(self, seq):
        return self.data[self.m.slots(seq)].tolist()


@pytest.mark.parametrize("xp", XP_PARAMS)
def test_blocks_on_demand(xp):
    m = make(xp=resolve(xp))
    m.add("a")
    used = []
    for t in range(9):
        plan = m.append("a")
        assert plan.slots.shape == (1,) and len(plan.copies) == 0
        used.append(m.allocator.num_used)
    assert used == [1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert m.num_tokens("a") == 9 and len(m.block_table("a")) == 3
    m.audit()


def test_prefill_and_slots():
    m = make()
    plan = m.add("a", 6)
    assert plan.slots.tolist() == m.slots("a").tolist()
    assert m.page_table("a").blocks == [0, 1]
    assert plan.slots.tolist() == [0, 1, 2, 3, 4, 5]
    assert m.slot("a", 5) == 5
    m.audit()


def test_prefill_that_does_not_fit_changes_nothing():
    # 100 tokens with room for 50: nothing allocated, nothing registered, nothing grown
    m = make(num_blocks=20, block_size=4)      # 80 slots
    m.add("a", 30)
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="needs 25 free block"):
        m.append("a", 100)
    with pytest.raises(OutOfBlocks):
        m.add("b", 100)
    assert snapshot(m) == before and "b" not in m
    m.audit()


def test_step_builds_slot_mapping_and_block_tables():
    m = make(num_blocks=32, block_size=4)
    pool = Pool(m)
    for s, n in (("a", 3), ("b", 4), ("c", 9)):
        pool.apply(m.add(s, n), np.arange(n) + 100 * ord(s))
    plan = m.step()
    assert plan.seq_ids == ["a", "b", "c"]
    assert plan.slot_mapping.dtype == np.int32 and plan.block_tables.dtype == np.int32
    assert plan.seq_lens.tolist() == [4, 5, 10]
    assert plan.block_tables.shape == (3, 3)
    assert plan.block_tables[0].tolist()[1:] == [-1, -1]      # padding past the last block
    for i, s in enumerate(plan.seq_ids):
        assert plan.slot_mapping[i] == m.slot(s, m.num_tokens(s) - 1)
        nb = len(m.block_table(s))
        assert plan.block_tables[i, :nb].tolist() == m.block_table(s).tolist()
    pool.apply(plan, [-7, -8, -9])
    assert pool.read("b") == [100 * ord("b") + i for i in range(4)] + [-8]
    sub = m.step(["c", "a"])
    assert sub.seq_ids == ["c", "a"] and sub.seq_lens.tolist() == [11, 5]
    m.audit()


def test_step_misuse_and_out_of_blocks():
    m = make(num_blocks=3, block_size=2)
    m.add("a", 2)
    m.add("b", 2)
    with pytest.raises(UnknownSequence, match="'zz'"):
        m.step(["a", "zz"])
    with pytest.raises(DuplicateSequence, match="more than once"):
        m.step(["a", "a"])
    before = snapshot(m)
    with pytest.raises(OutOfBlocks):          # both need a new block, one is free
        m.step()
    assert snapshot(m) == before
    m.step(["a"])
    m.audit()


def test_fork_shares_and_copy_on_write_copies_once():
    m = make(num_blocks=16, block_size=4)
    pool = Pool(m)
    pool.apply(m.add("p", 6), np.arange(6))          # blocks: one full, one with 2 tokens
    m.fork("p", "b1", "b2")
    st = m.stats()
    assert st.used_blocks == 2 and st.shared_blocks == 2
    assert st.blocks_saved_by_sharing == 4 and st.bytes_saved_by_sharing == 4 * 32
    plan = m.append("b1")
    assert plan.copies.shape == (1, 2) and plan.copies[0, 0] == m.block_table("p")[1]
    pool.apply(plan, [61])
    plan = m.append("p")
    assert len(plan.copies) == 1
    pool.apply(plan, [60])
    plan = m.append("b2")                            # last owner: writes in place
    assert len(plan.copies) == 0
    pool.apply(plan, [62])
    assert pool.read("p") == [0, 1, 2, 3, 4, 5, 60]
    assert pool.read("b1") == [0, 1, 2, 3, 4, 5, 61]
    assert pool.read("b2") == [0, 1, 2, 3, 4, 5, 62]
    assert m.block_table("p")[0] == m.block_table("b1")[0] == m.block_table("b2")[0]
    m.audit()


def test_fork_then_batched_step_copies_for_all_but_one():
    m = make(num_blocks=16, block_size=4)
    pool = Pool(m)
    pool.apply(m.add("p", 5), np.arange(5))
    m.fork("p", "x", "y", "z")
    plan = m.step()
    assert len(plan.copies) == 3                      # 4 writers of one block: 3 copies
    assert len(set(plan.copies[:, 1].tolist())) == 3
    pool.apply(plan, [10, 11, 12, 13])
    for s, v in zip(plan.seq_ids, [10, 11, 12, 13]):
        assert pool.read(s) == [0, 1, 2, 3, 4, v]
    m.audit()


def test_fork_at_a_block_boundary_needs_no_copy():
    m = make()
    m.add("p", 8)
    m.fork("p", "c")
    assert len(m.append("c").copies) == 0 and len(m.append("p").copies) == 0
    m.audit()


def test_copy_on_write_out_of_blocks_changes_nothing():
    m = make(num_blocks=2, block_size=4)
    m.add("p", 6)
    m.fork("p", "c")
    before = snapshot(m)
    with pytest.raises(OutOfBlocks, match="needs 1 free block"):
        m.append("c")
    assert snapshot(m) == before
    assert m.blocks_needed("c") == 1 and not m.can_append("c")
    m.audit()


def test_misuse():
    m = make()
    m.add("a", 3)
    with pytest.raises(SequenceExists):
        m.add("a")
    with pytest.raises(SequenceExists, match="already exists"):
        m.fork("a", "a")
    m.add("b")
    with pytest.raises(SequenceExists):
        m.fork("a", "c", "b")
    assert "c" not in m
    with pytest.raises(DuplicateSequence, match="more than once"):
        m.fork("a", "d", "d")
    assert "d" not in m
    with pytest.raises(UnknownSequence, match="'nope'"):
        m.fork("nope", "e")
    with pytest.raises(ConfigError, match="at least one child"):
        m.fork("a")
    for n in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="positive integer"):
            m.append("a", n)
    with pytest.raises(ConfigError):
        m.add("z", -3)
    with pytest.raises(UnknownSequence):
        m.append("nope")
    with pytest.raises(ConfigError, match="hashable"):
        m.add(["unhashable"])
    with pytest.raises(ConfigError, match="hashable"):
        m.fork("a", "ok", ["unhashable"])
    assert "ok" not in m
    m.free("b")
    with pytest.raises(UnknownSequence):
        m.free("b")
    with pytest.raises(ConfigError, match="block_size"):
        KVCacheManager(BlockAllocator(4, 32, xp=np), 0)
    with pytest.raises(ConfigError, match="whole number of tokens"):
        KVCacheManager(BlockAllocator(4, 30, xp=np), 4)
    m.audit()


def test_free_keeps_rows_dense_and_returns_blocks():
    m = make(num_blocks=16, block_size=4)
    for s, n in (("a", 5), ("b", 3), ("c", 9)):
        m.add(s, n)
    m.free("a")
    assert sorted(m.seq_ids) == ["b", "c"] and len(m) == 2
    assert m.allocator.num_used == 1 + 3
    m.fork("c", "d")
    m.free("c")
    assert m.allocator.num_used == 4                 # d still holds c's blocks
    m.free("d")
    m.free("b")
    assert m.allocator.num_free == 16
    m.audit()


def test_stats_by_hand():
    m = make(num_blocks=10, block_size=4)
    m.add("a", 6)          # blocks 0, 1 (2 of 4 slots used in block 1)
    m.add("b", 3)          # block 2
    st = m.stats()
    assert (st.used_blocks, st.free_blocks, st.tokens, st.stored_tokens) == (3, 7, 9, 9)
    assert st.utilization == pytest.approx(0.3)
    assert st.internal_fragmentation == pytest.approx(3 / 12)
    assert st.largest_free_run == 7 and st.external_fragmentation == 0
    m.free("a")            # free: 0, 1 and 3..9 -> runs of 2 and 7
    st = m.stats()
    assert st.largest_free_run == 7
    assert st.external_fragmentation == pytest.approx(1 - 7 / 9)
    m.fork("b", "b2")
    st = m.stats()
    assert st.tokens == 6 and st.stored_tokens == 3 and st.shared_blocks == 1
    assert st.blocks_saved_by_sharing == 1


def test_step_returns_arrays_of_its_own():
    m = make(num_blocks=40, block_size=3)
    for s in range(6):
        m.add(s, s + 1)
    for batch in (None, [3, 1], [5, 0, 2]):
        plan = m.step(batch)
        assert plan.slot_mapping.dtype == plan.block_tables.dtype == np.int32
        assert plan.seq_lens.dtype == plan.copies.dtype == np.int32
        plan.block_tables[:] = 99                      # the caller's copy, not the manager's
        for i, s in enumerate(plan.seq_ids):
            assert plan.slot_mapping[i] == m.slot(s, m.num_tokens(s) - 1)
            assert 99 not in m.block_table(s)
    assert m.step().seq_ids == m.seq_ids == list(range(6))
    m.audit()


def test_step_copies_only_for_sharers_in_the_batch():
    """A partly filled block shared by four sequences: when two of them step, both copy (two
    owners remain); when the last two step together, only the first copies."""
    m = make(num_blocks=20, block_size=4)
    m.add("p", 6)
    m.fork("p", "a", "b", "c")
    shared = m.block_table("p")[-1]
    first = m.step(["a", "b"])
    assert first.copies[:, 0].tolist() == [shared, shared]
    assert m.allocator.refcount(shared) == 2
    second = m.step(["c", "p"])
    assert second.copies[:, 0].tolist() == [shared]
    assert m.block_table("p")[-1] == shared and m.allocator.refcount(shared) == 1
    m.audit()


def test_blocks_are_handed_out_in_batch_order():
    m = make(num_blocks=20, block_size=2)
    m.add("x", 2)                 # block 0, full
    m.add("y", 1)                 # block 1, one slot left
    m.fork("y", "z")              # z shares block 1
    m.add("w", 4)                 # blocks 2, 3, full
    plan = m.step(["w", "y", "x", "z"])
    # w needs a new block (4), y copies block 1 into 5, x a new block (6), z writes block 1
    assert plan.block_tables.tolist() == [[2, 3, 4], [5, -1, -1], [0, 6, -1], [1, -1, -1]]
    assert plan.copies.tolist() == [[1, 5]]
    assert plan.slot_mapping.tolist() == [8, 11, 12, 3]
    m.audit()


MANAGER_CORRUPTIONS = {
    "has 3 tokens but maps 3 block(s)": lambda m: m._tables["a"].blocks.append(
        m.allocator.allocate()),
    "maps one block twice": lambda m: m._tables["b"].blocks.__setitem__(
        slice(None), [m._tables["b"].blocks[0]] * 2),
    "maps a block outside the pool": lambda m: m._tables["a"].blocks.__setitem__(0, 99),
    "page table(s) map it": lambda m: m.allocator.share(m._tables["a"].blocks[0]),
}


@pytest.mark.parametrize("message", MANAGER_CORRUPTIONS)
def test_audit_names_the_broken_invariant(message):
    m = make(num_blocks=12, block_size=2)
    m.add("a", 3)
    m.add("b", 4)
    m.audit()
    MANAGER_CORRUPTIONS[message](m)
    with pytest.raises(AuditError, match=re.escape(message)):
        m.audit()


@pytest.mark.parametrize("call", ["add", "append", "step"])
def test_a_closed_allocator_refuses_every_growth_and_nothing_changes(call):
    from pagedkv import fast
    from pagedkv.errors import AllocatorClosed
    for m in (make(num_blocks=8, block_size=4),
              fast.KVCacheManager(fast.BlockAllocator(8, 32, xp=np), 4)):
        m.add("a", 4)                                  # its last block is full
        m.allocator.close()
        attempt = {"add": lambda: m.add("b", 3), "append": lambda: m.append("a", 1),
                   "step": lambda: m.step()}[call]
        with pytest.raises(AllocatorClosed):
            attempt()
        assert m.seq_ids == ["a"] and m.num_tokens("a") == 4
