import numpy as np
import pytest

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import (ConfigError, OutOfBlocks, SequenceExists, UnknownSequence)
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
    with pytest.raises(ConfigError, match="more than once"):
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
    with pytest.raises(SequenceExists, match="twice"):
        m.fork("a", "d", "d")
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


def test_tables_grow_past_their_first_size():
    m = make(num_blocks=64, block_size=2, max_seqs=1, max_seq_len=2)
    for i in range(5):
        m.add(i, 2 * i + 1)
    for _ in range(10):
        m.step()
    assert [m.num_tokens(i) for i in range(5)] == [2 * i + 11 for i in range(5)]
    m.audit()


@pytest.mark.parametrize("block_size", [4, 5])
def test_small_and_vector_step_paths_agree(block_size):
    """The plain-Python path (small batches) and the NumPy path must plan identically, for
    whole-batch steps and for subsets, with copy-on-write copies among them."""
    seed = 7
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    small = make(num_blocks=600, block_size=block_size)
    vector = make(num_blocks=600, block_size=block_size)
    small.small_batch = 10**9                              # always the Python loop
    vector.small_batch = 0                                 # always NumPy
    for s in range(40):
        n = int(rng.integers(0, 9))
        for m in (small, vector):
            m.add(s, n)
    forks = copies = subsets = 0
    for step in range(60):
        if step % 4 == 0:
            parent = int(rng.choice(small.seq_ids))
            kids = [1000 + forks + i for i in range(int(rng.integers(1, 4)))]
            for m in (small, vector):
                m.fork(parent, *kids)
            forks += len(kids)
        if step % 7 == 6:                                  # a sequence finishes
            gone = int(rng.choice(small.seq_ids))
            for m in (small, vector):
                m.free(gone)
        batch = None if step % 3 == 0 else [int(x) for x in rng.choice(
            small.seq_ids, size=int(rng.integers(1, 30)), replace=False)]
        subsets += batch is not None
        a, b = small.step(batch), vector.step(batch)
        assert a.seq_ids == b.seq_ids
        for field in ("slot_mapping", "block_tables", "seq_lens", "copies"):
            x, y = getattr(a, field), getattr(b, field)
            assert x.dtype == y.dtype and np.array_equal(x, y), field
        copies += len(a.copies)
        small.audit()
        vector.audit()
    print(f"{forks} children forked, {copies} copies, {subsets} subset steps")
    assert copies >= 10 and subsets >= 30


@pytest.mark.parametrize("block_size", [3, 4])
def test_step_block_tables_are_read_only(block_size):
    m = make(num_blocks=200, block_size=block_size)
    for s in range(20):
        m.add(s, s + 1)
    for batch in (None, [3, 1], list(range(18))):
        plan = m.step(batch)
        kept = np.array(plan.block_tables)
        with pytest.raises(ValueError):
            plan.block_tables[0, 0] = 99
        assert np.array_equal(kept, plan.block_tables)
        for i, s in enumerate(plan.seq_ids):
            assert plan.slot_mapping[i] == m.slot(s, m.num_tokens(s) - 1)
    m.audit()
