"""Bad input on both managers (one typed error each, nothing changed), and what only the fast
manager has: its size hints, dense rows, growing arrays and read-only step views."""
import numpy as np
import pytest

from pagedkv import allocator, fast, manager
from pagedkv.errors import (ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists,
                            TokenIndexError, UnknownSequence)

IMPLS = [pytest.param((allocator.BlockAllocator, manager.KVCacheManager), id="teaching"),
         pytest.param((fast.BlockAllocator, fast.KVCacheManager), id="fast")]


def snapshot(m):
    return (m.stats(), sorted(map(repr, m.seq_ids)),
            {s: m.block_table(s).tolist() for s in m.seq_ids},
            m.allocator.free_blocks(), m.allocator.refcounts().tolist())


@pytest.mark.parametrize("impl", IMPLS)
def test_misuse_raises_one_typed_error_and_changes_nothing(impl):
    make_alloc, make_manager = impl
    m = make_manager(make_alloc(12, 64), 4)
    m.add("a", 6)
    m.add("b", 1)
    m.fork("a", "c")
    before = snapshot(m)
    for call, error in [
            (lambda: m.add("a"), SequenceExists),
            (lambda: m.add(["unhashable"]), ConfigError),
            (lambda: m.add("x", -1), ConfigError),
            (lambda: m.add("x", 2.0), ConfigError),
            (lambda: m.add("x", 1000), OutOfBlocks),
            (lambda: m.append("nobody"), UnknownSequence),
            (lambda: m.append(["unhashable"]), UnknownSequence),
            (lambda: m.append("a", 0), ConfigError),
            (lambda: m.append("a", True), ConfigError),
            (lambda: m.append("a", 1000), OutOfBlocks),
            (lambda: m.step(["a", "b", "a"]), DuplicateSequence),
            (lambda: m.step(["a", "nobody", "a"]), UnknownSequence),
            (lambda: m.fork("nobody", "x"), UnknownSequence),
            (lambda: m.fork("a"), ConfigError),
            (lambda: m.fork("a", "b"), SequenceExists),
            (lambda: m.fork("a", "x", "x"), DuplicateSequence),
            (lambda: m.fork("a", "x", ["unhashable"]), ConfigError),
            (lambda: m.free("nobody"), UnknownSequence),
            (lambda: m.truncate("nobody", 0), UnknownSequence),
            (lambda: m.truncate("a", 7), TokenIndexError),
            (lambda: m.truncate("a", -1), ConfigError),
            (lambda: m.truncate("a", True), ConfigError),
            (lambda: m.truncate("a", 2.0), ConfigError),
            (lambda: m.blocks_needed("a", 0), ConfigError),
            (lambda: m.slot("a", 6), TokenIndexError),
            (lambda: m.slot("a", -1), TokenIndexError)]:
        with pytest.raises(error):
            call()
        assert snapshot(m) == before
    m.audit()


@pytest.mark.parametrize("impl", IMPLS)
def test_managers_refuse_what_cannot_work(impl):
    make_alloc, make_manager = impl
    for bs in (0, -4, 2.5, True):
        with pytest.raises(ConfigError):
            make_manager(make_alloc(8, 64), bs)
    with pytest.raises(ConfigError, match="whole number of tokens"):
        make_manager(make_alloc(8, 64), 3)
    used = make_alloc(8, 64)
    used.allocate()
    with pytest.raises(ConfigError, match="in use"):
        make_manager(used, 4)


def test_fast_manager_needs_the_fast_allocator_and_sane_hints():
    with pytest.raises(ConfigError, match="pagedkv.fast.BlockAllocator"):
        fast.KVCacheManager(allocator.BlockAllocator(8, 64), 4)
    for hint in ({"max_seqs": 0}, {"max_seq_len": -1}, {"max_seqs": 1.5}):
        with pytest.raises(ConfigError):
            fast.KVCacheManager(fast.BlockAllocator(8, 64), 4, **hint)


def test_rows_stay_dense_and_arrays_grow():
    m = fast.KVCacheManager(fast.BlockAllocator(64, 64), 4, max_seqs=1, max_seq_len=1)
    for s in "abcde":
        m.add(s, 3)
    m.append("e", 20)                          # wider than the first table
    assert m._tables.shape[0] >= 5 and m._tables.shape[1] >= 6
    m.free("b")                                # the last row moves into the hole
    assert m.seq_ids == ["a", "e", "c", "d"]
    plan = m.step()
    assert plan.seq_ids == ["a", "e", "c", "d"] and plan.seq_lens.tolist() == [4, 24, 4, 4]
    assert plan.block_tables.shape == (4, 6)
    m.audit()


@pytest.mark.parametrize("block_size", [4, 3])
def test_a_full_step_returns_a_read_only_view(block_size):
    m = fast.KVCacheManager(fast.BlockAllocator(200, block_size * 8), block_size)
    for s in range(20):                        # more than small_batch: the NumPy path
        m.add(s, s)
    plan = m.step()
    assert not plan.block_tables.flags.writeable
    with pytest.raises(ValueError):
        plan.block_tables[0, 0] = 7
    assert np.shares_memory(plan.block_tables, m._tables)
    picked = m.step(list(range(19, -1, -1)))   # a batch of its own: a gather, not a view
    assert not np.shares_memory(picked.block_tables, m._tables)
    m.audit()
