"""The prefix-caching managers are not KVCacheManagers: their ``add``, ``append`` and ``step``
take token ids where the plain manager's take counts. Code written for the plain manager fails
at its first call on a prefix manager, with an error that names the mix-up and changes nothing;
everything the two share (the lookups, fork, free, stats, the swapper) answers the same."""
import numpy as np
import pytest

from pagedkv import allocator, fast, manager, prefix_cache
from pagedkv.errors import ConfigError
from pagedkv.fast import prefix as fast_prefix
from pagedkv.swap import HostPool, Swapper

BS = 4


def managers(path, caching=True):
    """(the plain manager, the prefix-caching one) of a path, over pools alike."""
    if path == "teaching":
        alloc = lambda: allocator.BlockAllocator(16, BS * 8, xp=np)  # noqa: E731
        return (manager.KVCacheManager(alloc(), BS),
                prefix_cache.PrefixCachingManager(alloc(), BS, caching=caching))
    alloc = lambda: fast.BlockAllocator(16, BS * 8, xp=np)           # noqa: E731
    return (fast.KVCacheManager(alloc(), BS),
            fast_prefix.PrefixCachingManager(alloc(), BS, caching=caching))


def written_for_the_plain_manager(m):
    """What a caller of chapter 5's manager does: counts."""
    m.add("a", 6)
    m.append("a", 2)
    return m.step(["a"])


def state(m):
    return (m.seq_ids, {s: m.block_table(s).tolist() for s in m.seq_ids},
            m.allocator.num_free)


@pytest.mark.parametrize("path", ["teaching", "fast"])
def test_a_prefix_manager_is_not_a_plain_one(path):
    plain, prefix = managers(path)
    assert not isinstance(prefix, type(plain))
    assert not isinstance(prefix, (manager.KVCacheManager, fast.KVCacheManager))
    assert isinstance(prefix.pages, type(plain))            # it holds one
    written_for_the_plain_manager(plain)                    # (runs where it belongs)


@pytest.mark.parametrize("path", ["teaching", "fast"])
def test_code_for_the_plain_manager_fails_at_once_and_says_why(path):
    _, m = managers(path)
    with pytest.raises(ConfigError, match=r"PrefixCachingManager\.add takes token ids, "
                                          r"got 6 \(what KVCacheManager\.add takes\)"):
        written_for_the_plain_manager(m)
    assert len(m) == 0 and m.allocator.num_free == 16
    m.add("a", [1, 2, 3, 4, 5, 6])
    before = state(m)
    with pytest.raises(ConfigError, match=r"append takes token ids, got 2"):
        m.append("a", 2)
    with pytest.raises(ConfigError, match=r"step takes token ids, got None"):
        m.step(["a"])
    assert state(m) == before
    m.audit()


@pytest.mark.parametrize("path", ["teaching", "fast"])
@pytest.mark.parametrize("caching", [True, False])
def test_the_shared_calls_answer_the_same(path, caching):
    """The same history, in counts and in ids (no two prompts share a block, so nothing
    is found): the same plans, lookups and stats, and the swapper runs on both unchanged."""
    plain, prefix = managers(path, caching)
    p_a, q_a = plain.add("a", 6), prefix.add("a", [1, 2, 3, 4, 5, 6])
    assert p_a.slots.tolist() == q_a.slots.tolist() and q_a.cached_tokens == 0
    plain.add("b", 3), prefix.add("b", [7, 8, 9])
    plain.fork("a", "c"), prefix.fork("a", "c")
    p, q = plain.step(["a", "c", "b"]), prefix.step(["a", "c", "b"], [1, 2, 3])
    for field in ("slot_mapping", "block_tables", "seq_lens", "copies"):
        assert getattr(p, field).tolist() == getattr(q, field).tolist(), field
    assert plain.append("b", 5).slots.tolist() == prefix.append("b", [1] * 5).slots.tolist()
    for s in plain.seq_ids:
        assert plain.slots(s).tolist() == prefix.slots(s).tolist()
        assert plain.page_table(s).blocks == prefix.page_table(s).blocks
        assert plain.num_tokens(s) == prefix.num_tokens(s)
        assert plain.blocks_needed(s, 3) == prefix.blocks_needed(s, 3)
    assert plain.stats() == prefix.stats() and len(plain) == len(prefix)
    pairs = []
    for m, contents in ((plain, [7]), (prefix, [[1, 2, 3, 4, 5, 6, 1]])):
        swapper = Swapper(m, HostPool(8, BS * 8, pinned=False))
        out = swapper.swap_out(["a"])
        pairs.append((out.tolist(), swapper.swap_in(["a"], contents).tolist()))
        m.free("c")
        m.audit()
    assert pairs[0][0] == pairs[1][0]
    if not caching:                                        # (a cache would find a's block)
        assert pairs[0][1] == pairs[1][1]


@pytest.mark.parametrize("path", ["teaching", "fast"])
def test_the_caller_owns_the_tokens(path):
    """The manager keeps the hashes of full blocks and the ids of the partly filled last
    one; the swapper keeps blocks and a length."""
    _, m = managers(path)
    m.add("a", list(range(10)))                            # 2 full blocks, 2 ids more
    assert m._tail["a"] == [8, 9] and len(m._hashes["a"]) == 2
    m.step(["a"], [10])
    m.append("a", [11, 12])
    assert m._tail["a"] == [12] and len(m._hashes["a"]) == 3
    assert not hasattr(m, "tokens")
    swapper = Swapper(m, HostPool(8, BS * 8, pinned=False))
    swapper.swap_out(["a"])
    assert swapper.swapped["a"]._fields == ("host_blocks", "num_tokens")
    assert swapper.swapped["a"].num_tokens == 13
