"""Rollback in the cache: ``truncate`` (a rewind to the first ``n`` tokens) on the plain
managers and on the prefix-caching ones, with ``reserve_slots`` / ``commit`` (the slots of a
speculative row, whose ids come after verification) on the latter. Chosen cases, each on
both paths; the state machines (tests/test_manager_stateful.py, tests/test_prefix_stateful.py)
and the equivalence streams (tests/test_equivalence.py, tests/test_prefix_fast.py) run the
random ones.

The plans are executed on an integer "pool" (one value per slot), so that a sequence read back
through its page table shows whether a rewind or a write after it disturbed anyone else.
"""
import numpy as np
import pytest

from pagedkv import allocator, fast, manager
from pagedkv.errors import ConfigError, OutOfBlocks, TokenIndexError, UnknownSequence
from pagedkv.fast.prefix import PrefixCachingManager as FastPrefix
from pagedkv.prefix_cache import PrefixCachingManager
from pagedkv.swap import HostPool, Swapper

BS = 4
PLAIN = {"teaching": (allocator.BlockAllocator, manager.KVCacheManager),
         "fast": (fast.BlockAllocator, fast.KVCacheManager)}
PREFIX = {"teaching": (allocator.BlockAllocator, PrefixCachingManager),
          "fast": (fast.BlockAllocator, FastPrefix)}


class Pool:
    """A manager and an integer pool its plans are executed on."""

    def __init__(self, m, num_blocks):
        self.m, self.values = m, np.full(num_blocks * BS, -1, dtype=np.int64)

    def run(self, plan, values):
        for src, dst in plan.copies.tolist():
            self.values[dst * BS:(dst + 1) * BS] = self.values[src * BS:(src + 1) * BS]
        slots = plan.slots if hasattr(plan, "slots") else plan.slot_mapping
        self.values[slots] = values

    def read(self, seq_id):
        return self.values[self.m.slots(seq_id)].tolist()


def plain(kind, num_blocks=16):
    make_alloc, make_manager = PLAIN[kind]
    return make_manager(make_alloc(num_blocks, BS * 8, xp=np), BS)


def snapshot(m):
    return (sorted(map(repr, m.seq_ids)), {s: m.block_table(s).tolist() for s in m.seq_ids},
            {s: m.num_tokens(s) for s in m.seq_ids}, m.allocator.refcounts().tolist(),
            m.stats())


# ---------------------------------------------------------------------- the plain managers
@pytest.mark.parametrize("kind", list(PLAIN))
def test_blocks_wholly_past_n_go_and_the_partly_filled_one_stays(kind):
    m = plain(kind)
    m.add("a", 10)                                   # blocks 0, 1, 2 (2 tokens in 2)
    m.truncate("a", 5)
    assert m.block_table("a").tolist() == [0, 1] and m.num_tokens("a") == 5
    assert m.allocator.free_blocks()[-1] == 2        # on top of the free stack
    plan = m.append("a", 1)                          # into block 1, in place
    assert plan.slots.tolist() == [1 * BS + 1] and not len(plan.copies)
    m.truncate("a", 4)                               # at a block's end: block 1 goes
    assert m.block_table("a").tolist() == [0]
    m.audit()


@pytest.mark.parametrize("kind", list(PLAIN))
def test_growing_again_takes_the_same_blocks_in_the_same_order(kind):
    m = plain(kind)
    m.add("other", 3)
    m.add("a", 13)                                   # blocks 1, 2, 3, 4
    table = m.block_table("a").tolist()
    m.truncate("a", 1)                               # 4, 3, 2 given back, the last first
    m.append("a", 12)
    assert m.block_table("a").tolist() == table
    m.audit()


@pytest.mark.parametrize("kind", list(PLAIN))
def test_truncate_to_the_length_is_nothing_and_to_zero_keeps_the_sequence(kind):
    m = plain(kind)
    m.add("a", 6)
    before = snapshot(m)
    m.truncate("a", 6)
    assert snapshot(m) == before
    m.truncate("a", 0)
    assert "a" in m and m.num_tokens("a") == 0 and not len(m.block_table("a"))
    assert m.allocator.num_free == 16
    m.append("a", 1)
    m.audit()


@pytest.mark.parametrize("kind", list(PLAIN))
def test_a_truncated_child_disturbs_neither_its_parent_nor_its_siblings(kind):
    """Parent and two children share blocks 0 (full) and 1 (full). One child rewinds into
    block 1: it stays shared (three owners), and the child's next write copies it first;
    the others read what they read before, and the last owner of the copy's source
    writes in place later."""
    m = plain(kind)
    pool = Pool(m, 16)
    pool.run(m.add("p", 8), list(range(100, 108)))
    m.fork("p", "c1", "c2")
    m.truncate("c1", 5)
    assert m.block_table("c1").tolist() == [0, 1]
    assert m.allocator.refcount(1) == 3              # kept shared: nothing copied yet
    plan = m.append("c1", 2)
    assert plan.copies.tolist() == [[1, 2]]          # copy-on-write, then the writes
    pool.run(plan, [7, 8])
    assert pool.read("c1") == [100, 101, 102, 103, 104, 7, 8]
    assert pool.read("p") == pool.read("c2") == list(range(100, 108))
    assert m.allocator.refcount(1) == 2
    m.truncate("c2", 6)                              # block 1 again, with p
    pool.run(m.append("c2", 1), [9])                 # shared: copied
    m.free("p")
    m.truncate("c2", 5)
    plan = m.append("c2", 1)                         # its own copy: written in place
    assert not len(plan.copies)
    pool.run(plan, [10])
    assert pool.read("c2") == [100, 101, 102, 103, 104, 10]
    assert pool.read("c1") == [100, 101, 102, 103, 104, 7, 8]
    m.audit()


@pytest.mark.parametrize("kind", list(PLAIN))
def test_a_step_after_truncations_copies_what_is_shared_and_counts_what_is_full(kind):
    """In one step, a row truncated into a shared block copies it, a row truncated to a
    block's end takes a new block, and the step's block table is the rows' own."""
    m = plain(kind)
    pool = Pool(m, 16)
    pool.run(m.add("p", 8), list(range(8)))
    m.fork("p", "a", "b")
    m.truncate("a", 6)                               # into shared block 1
    m.truncate("b", 4)                               # block 1 is not b's any more
    before = m.allocator.num_free
    plan = m.step(["a", "b", "p"])
    assert plan.copies.tolist() == [[1, int(m.block_table("a")[1])]]
    assert plan.seq_lens.tolist() == [7, 5, 9]
    assert m.allocator.num_free == before - 3        # a's copy, b's new block, p's new one
    pool.run(plan, [60, 40, 80])
    assert pool.read("a") == [0, 1, 2, 3, 4, 5, 60]
    assert pool.read("b") == [0, 1, 2, 3, 40]
    assert pool.read("p") == list(range(8)) + [80]
    m.audit()


@pytest.mark.parametrize("kind", list(PLAIN))
def test_bad_truncations_raise_one_typed_error_and_change_nothing(kind):
    m = plain(kind)
    m.add("a", 6)
    m.fork("a", "b")
    before = snapshot(m)
    for call, error in [(lambda: m.truncate("nobody", 0), UnknownSequence),
                        (lambda: m.truncate(["unhashable"], 0), UnknownSequence),
                        (lambda: m.truncate("a", 7), TokenIndexError),
                        (lambda: m.truncate("a", -1), ConfigError),
                        (lambda: m.truncate("a", 2.0), ConfigError),
                        (lambda: m.truncate("a", True), ConfigError),
                        (lambda: m.truncate("a", None), ConfigError)]:
        with pytest.raises(error) as info:
            call()
        assert snapshot(m) == before
        print(f"{error.__name__}: {info.value}")
    with pytest.raises(TokenIndexError, match="cannot keep 7 tokens: the sequence has 6"):
        m.truncate("a", 7)


@pytest.mark.parametrize("kind", list(PLAIN))
def test_a_truncated_sequence_swaps_out_and_back_at_its_new_length(kind):
    m = plain(kind)
    swapper = Swapper(m, HostPool(8, BS * 8, pinned=False))
    m.add("a", 11)
    m.truncate("a", 6)
    assert len(swapper.swap_out(["a"])) == 2
    with pytest.raises(ConfigError, match="it held 6 tokens"):
        swapper.swap_in(["a"], [11])
    assert len(swapper.swap_in(["a"], [6])) == 2
    assert m.num_tokens("a") == 6
    m.audit()
    swapper.audit()


# ---------------------------------------------------------------------- prefix caching
def prefix(kind, num_blocks=16, caching=True):
    make_alloc, make_manager = PREFIX[kind]
    return make_manager(make_alloc(num_blocks, BS * 8, xp=np), BS, caching=caching)


def prefix_snapshot(m, s):
    c = m.cache
    return (c.num_free, list(c._idle), dict(c._block_of), m.block_table(s).tolist(),
            m.num_tokens(s), m.pending(), list(m._tail[s]), list(m._hashes[s]),
            list(m._serials[s]), c.hits, c.evictions)


PROMPT = [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_speculative_row_commits_what_was_accepted_and_drops_the_rest(kind):
    """Prompt of 6; the last sampled token (7) and four guesses go into five reserved
    slots (tokens 6..10, blocks 1 and 2); the verification accepts two guesses: three
    ids are committed, the two rejected slots dropped. Only full blocks of committed ids
    are ever named."""
    m = prefix(kind)
    m.add("s", PROMPT)                                # block 0 named; 2 ids in block 1
    named = dict(m.cache._block_of)
    plan = m.reserve_slots("s", 5)
    assert plan.slots.tolist() == [6, 7, 8, 9, 10]    # blocks 1 and 2
    assert m.pending() == {"s": 5} and m.cache._block_of == named   # guesses: no names
    m.audit()
    m.commit(["s", "s", "s"], [7, 8, 9])              # block 1 fills: named now
    assert m.pending() == {"s": 2} and len(m.cache._block_of) == 2
    m.truncate("s", 9)                                # the rejected two go
    assert m.pending() == {} and m.num_tokens("s") == 9
    assert m.block_table("s").tolist() == [0, 1, 2] and m._tail["s"] == [9]
    m.audit()
    m.truncate("s", 9)                                # nothing pending: nothing to do
    m.step(["s"], [10])                               # and it decodes on
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_rewind_drops_the_newest_pending_slots_and_frees_their_blocks(kind):
    m = prefix(kind)
    m.add("s", [1, 2, 3])
    m.reserve(["s"])                                  # token 3
    m.reserve_slots("s", 6)                           # tokens 4..9: blocks 1, 2
    assert m.pending() == {"s": 7}
    free = m.cache.num_free
    m.truncate("s", 5)                                # slots of tokens 5..9: block 2 goes
    assert m.pending() == {"s": 2} and m.cache.num_free == free + 1
    m.commit(["s", "s"], [4, 5])                      # the oldest two, in order
    assert m._tail["s"] == [5] and m.cached_prefix([1, 2, 3, 4, 5]) == 4
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_named_block_the_cut_leaves_partly_filled_is_forgotten(kind):
    """Blocks 0 and 1 are named. A rewind to 6 cuts block 1: it may no longer answer to
    the hash of tokens 4..7, since its next write overwrites them; block 0 still does.
    Its new ids name it again once it fills."""
    m = prefix(kind)
    m.add("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    with pytest.raises(ConfigError, match="pass the sequence's first 6 ids"):
        m.truncate("s", 6)                            # block 1's ids are only hashed now
    m.truncate("s", 6, [1, 2, 3, 4, 5, 6])
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4
    assert m._tail["s"] == [5, 6] and m.block_table("s").tolist() == [0, 1]
    m.audit()
    m.append("s", [70, 80])                           # block 1 fills again: named anew
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 70, 80, 0]) == 8
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_cut_at_a_block_boundary_keeps_every_name(kind):
    """Blocks wholly past the cut hold every token they are named by: released, they stay
    cached (idle), and a prompt that starts the same finds them."""
    m = prefix(kind)
    m.add("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.truncate("s", 4)                                # no ids needed: nothing partly kept
    assert m.cache.num_idle == 1 and m._tail["s"] == []
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
    plan = m.add("t", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert plan.cached_tokens == 8 and m.cache.num_idle == 0
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_shared_named_block_cut_by_one_sharer(kind):
    """Parent and child share named blocks 0 and 1; the child rewinds into block 1. The
    block stays shared (the parent still maps it, full), but it is forgotten: the child
    would write into it in place once the parent is gone. The child's next write copies
    it; the parent's K/V is untouched."""
    m = prefix(kind)
    pool = Pool(m, 16)
    pool.run(m.add("p", [1, 2, 3, 4, 5, 6, 7, 8, 9]), list(range(100, 109)))
    m.fork("p", "c")
    m.truncate("c", 6, [1, 2, 3, 4, 5, 6])
    assert m.cache.refcount(1) == 2 and 1 not in m.cache._entry
    assert m.cached_prefix([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 4
    plan = m.append("c", [50])
    assert plan.copies.tolist() == [[1, int(m.block_table("c")[1])]]
    pool.run(plan, [50])
    assert pool.read("p") == list(range(100, 109))
    assert pool.read("c") == [100, 101, 102, 103, 104, 105, 50]
    m.free("p")                                        # block 1 is not cached: freed
    assert 1 in m.cache.allocator.free_blocks()
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_bad_truncations_of_a_prefix_caching_manager_change_nothing(kind):
    m = prefix(kind)
    m.add("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    m.reserve_slots("s", 2)                           # 9 committed, 2 pending
    cases = [(("nobody", 1), UnknownSequence, "unknown sequence"),
             (("s", 12), TokenIndexError, "the sequence has 11"),
             (("s", -1), ConfigError, "non-negative"),
             (("s", 0), ConfigError, "keeps at least one"),
             (("s", 8), ConfigError, "2 pending slot"),      # would cut committed ones
             (("s", 10, [1] * 9), ConfigError, "first 10 ids, got 9"),
             (("s", 10, [1, 2, 3, 4, 5, 6, 7, 8, 0, 0]), ConfigError, "disagree"),
             (("s", 10, [1.5] * 10), ConfigError, "token ids")]
    before = prefix_snapshot(m, "s")
    for args, error, words in cases:
        with pytest.raises(error, match=words):
            m.truncate(*args)
        assert prefix_snapshot(m, "s") == before, args
    m.commit(["s", "s"], [10, 11])
    before = prefix_snapshot(m, "s")
    for args in [("s", 7), ("s", 10, [1, 2, 3, 4, 5, 6, 7, 8, 0, 10])]:  # none; wrong
        with pytest.raises(ConfigError):
            m.truncate(*args)
        assert prefix_snapshot(m, "s") == before, args
    m.truncate("s", 10, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])        # the right ids agree
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_commit_is_all_or_nothing(kind):
    m = prefix(kind)
    m.add("a", [1, 2, 3])
    m.add("b", [1, 2])
    m.reserve_slots("a", 2)
    m.reserve(["b"])
    before = (prefix_snapshot(m, "a"), prefix_snapshot(m, "b"))
    for ids, tokens in [(["a", "b", "a", "a"], [4, 5, 6, 7]),    # a third slot of a's
                        (["a", "b", "b"], [4, 5, 6]),
                        (["a"], [4.0]), (["a", "b"], [4])]:
        with pytest.raises(ConfigError):
            m.commit(ids, tokens)
        assert (prefix_snapshot(m, "a"), prefix_snapshot(m, "b")) == before
    m.commit(["a", "b", "a"], [4, 5, 6])
    assert m._tail["a"] == [6] and m._tail["b"] == [1, 2, 5] and not m.pending()
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_sequence_freed_with_pending_slots_and_added_again_has_none(kind):
    """Pending slots belong to the sequence they were reserved for: freed (preempted by
    recompute mid-speculation), they go with its blocks, and the same id added again
    starts with none, whether or not anything asked about pending slots in between."""
    m = prefix(kind)
    m.add("s", [1, 2, 3])
    m.reserve_slots("s", 3)
    m.free("s")
    m.commit(["s"], [9])                              # the step in flight lands: skipped
    m.add("s", [1, 2, 3])
    assert m.num_tokens("s") == 3 and not m.pending()
    m.audit()
    m.reserve(["s"])
    m.free("s")
    m.add("s", [1, 2, 3, 4, 5])
    m.audit()
    assert not m.pending() and m.cache.num_free == 16 - 2


@pytest.mark.parametrize("kind", list(PREFIX))
def test_reserve_slots_refuses_what_append_refuses(kind):
    m = prefix(kind, num_blocks=2)
    m.add("s", [1, 2, 3])
    before = prefix_snapshot(m, "s")
    for args, error in [(("nobody", 1), UnknownSequence), (("s", 0), ConfigError),
                        (("s", 2.0), ConfigError), (("s", 6), OutOfBlocks)]:
        with pytest.raises(error):
            m.reserve_slots(*args)
        assert prefix_snapshot(m, "s") == before
    m.reserve_slots("s", 5)                           # exactly the pool
    assert m.cache.num_free == 0
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_caching_off_truncates_alike(kind):
    m = prefix(kind, caching=False)
    m.add("s", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    with pytest.raises(ConfigError, match="only in its hash"):
        m.truncate("s", 5)                            # the rule does not depend on caching
    m.truncate("s", 5, [1, 2, 3, 4, 5])
    assert m._tail["s"] == [5] and m.cache.num_free == 14
    m.audit()


@pytest.mark.parametrize("kind", list(PREFIX))
def test_a_truncated_sequence_is_swapped_out_and_finds_its_blocks_again(kind):
    m = prefix(kind)
    swapper = Swapper(m, HostPool(8, BS * 8, pinned=False))
    m.add("s", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    m.truncate("s", 6, [1, 2, 3, 4, 5, 6])
    assert len(swapper.swap_out(["s"])) == 2
    pairs = swapper.swap_in(["s"], [[1, 2, 3, 4, 5, 6]])
    assert len(pairs) == 1                            # block 0 was still cached
    assert m.num_tokens("s") == 6
    m.audit()
    swapper.audit()
