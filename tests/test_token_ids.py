"""One rule for token ids, one error for unknown sequences, and one answer to pairing a
manager with the other path's allocator: on the teaching and the fast prefix cache alike.

The rule (:func:`pagedkv.checks.token_ids`): a list, a tuple or a 1-D integer array of Python
or NumPy integers in [0, 2**63). Every bad value below is refused with ``ConfigError`` by every
call that takes token ids, and the refused call changes nothing.
"""
import numpy as np
import pytest

import pagedkv.fast.prefix as fast_prefix
import pagedkv.prefix_cache as prefix_cache
from pagedkv import allocator, fast, manager
from pagedkv.checks import token_ids
from pagedkv.errors import ConfigError, UnknownSequence

BAD = {
    "bools": [True, False],
    "a bool among ints": [3, True],
    "a numpy bool": [np.bool_(True)],
    "a float": [1.5],
    "an integral float": [2.0],
    "None in a list": [1, None],
    "None": None,
    "a string": "12",
    "a bare int": 5,
    "2**63": [2**63],
    "negative": [4, -1],
    "uint64 >= 2**63": np.array([1, 2**63], dtype=np.uint64),
    "int8 negative": np.array([-1], dtype=np.int8),
    "float array": np.array([1.0, 2.0]),
    "bool array": np.array([True]),
    "2-D array": np.array([[1, 2]]),
    "a set": {1, 2},
}
GOOD = {
    "list": [1, 2, 3],
    "tuple": (1, 2, 3),
    "numpy ints in a list": [np.int64(1), np.uint8(2), np.int32(3)],
    "int64 array": np.array([1, 2, 3]),
    "uint16 array": np.array([1, 2, 3], dtype=np.uint16),
    "largest": [0, 2**63 - 1, 2],
}
PATHS = ["teaching", "fast"]


def make(path, num_blocks=16, block_size=2):
    if path == "teaching":
        return prefix_cache.PrefixCachingManager(
            allocator.BlockAllocator(num_blocks, block_size * 8, xp=np), block_size)
    return fast_prefix.PrefixCachingManager(
        fast.BlockAllocator(num_blocks, block_size * 8, xp=np), block_size)


def state(m):
    c = m.cache
    return (sorted(m.seq_ids),
            {s: (m._tail[s], m._hashes[s], m._serials[s]) for s in m.seq_ids},
            {s: m.block_table(s).tolist() for s in m.seq_ids}, c.num_free, c.hits,
            list(c._idle), sorted(c._block_of.items()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_token_ids_are_refused_by_every_call_and_change_nothing(path, bad):
    m = make(path)
    m.add("a", [1, 2, 3])
    m.add("b", [1, 2, 4, 5])
    before = state(m)
    calls = {"add": lambda t: m.add("c", t), "append": lambda t: m.append("a", t),
             "cached_prefix": m.cached_prefix, "blocks_to_add": m.blocks_to_add}
    for name, call in calls.items():
        with pytest.raises(ConfigError, match="token ids"):
            call(BAD[bad])
        assert state(m) == before, name
    if isinstance(BAD[bad], (list, np.ndarray)) and len(BAD[bad]) == 2:
        with pytest.raises(ConfigError, match="token ids"):
            m.step(["a", "b"], BAD[bad])
        assert state(m) == before
    m.audit()


@pytest.mark.parametrize("path", PATHS)
def test_a_step_with_an_id_of_2_63_changes_nothing(path):
    m = make(path)
    m.add("a", [1])                                  # no full block: nothing hashed yet
    before = state(m)
    with pytest.raises(ConfigError, match="token ids"):
        m.step(["a"], [2**63])
    with pytest.raises(ConfigError, match="token ids"):
        m.step(["a"], np.array([2**63], dtype=np.uint64))
    assert state(m) == before and m.num_tokens("a") == 1


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("good", list(GOOD))
def test_good_token_ids_are_kept_as_python_ints(path, good):
    m = make(path)
    m.add("a", GOOD[good])
    m.append("a", GOOD[good])
    m.step(["a"], GOOD[good][:1])
    want = [int(t) for t in GOOD[good]] * 2 + [int(GOOD[good][0])]
    got = m._tail["a"]                               # the ids of its partly filled block
    assert got == want[len(want) // m.block_size * m.block_size:]
    assert all(type(t) is int for t in got)
    m.fork("a", "b")
    assert all(type(t) is int for t in m._tail["b"])
    m.audit()


def test_the_rule_itself():
    for bad in BAD.values():
        with pytest.raises(ConfigError, match=r"integers in \[0, 2\*\*63\)"):
            token_ids(bad)
    assert token_ids(np.array([7, 8], dtype=np.uint64)) == [7, 8]
    assert token_ids(()) == []


@pytest.mark.parametrize("path", PATHS)
def test_an_empty_prompt_is_refused(path):
    m = make(path)
    for empty in ([], (), np.array([], dtype=np.int64)):
        with pytest.raises(ConfigError, match="at least one token"):
            m.add("a", empty)
    with pytest.raises(ConfigError, match="token ids"):
        m.add("a", None)
    assert "a" not in m and m.cache.num_free == 16


@pytest.mark.parametrize("path", PATHS)
def test_unknown_sequences_are_unknown_for_every_call(path):
    m = make(path)
    m.add("a", [1, 2, 3])
    before = state(m)
    calls = [("append", ("zz", [])), ("append", ("zz", [1])), ("append", ("zz", [1.5])),
             ("step", (["zz"], [1])), ("step", (["a", "zz"], [1, 2])),
             ("step", (["zz"], [True])), ("step", (["zz"], [1, 2])),
             ("append", ("zz", 3)), ("step", (["zz"],)),
             ("slot", ("zz", 0)), ("free", ("zz",)), ("fork", ("zz", "c")),
             ("num_tokens", ("zz",)), ("block_table", ("zz",)), ("slots", ("zz",)),
             ("page_table", ("zz",)), ("blocks_needed", ("zz",)), ("can_append", ("zz",)),
             ("num_tokens", ([],)), ("free", ([],))]
    for name, args in calls:
        with pytest.raises(UnknownSequence):
            getattr(m, name)(*args)
        assert state(m) == before, (name, args)


TEACHING = [manager.KVCacheManager, prefix_cache.PrefixCachingManager]
FAST = [fast.KVCacheManager, fast_prefix.PrefixCachingManager]


@pytest.mark.parametrize("cls", TEACHING, ids=lambda c: c.__name__)
def test_a_teaching_manager_refuses_the_fast_allocator(cls):
    with pytest.raises(ConfigError, match="needs a pagedkv.allocator.BlockAllocator, got a "
                                          "pagedkv.fast.allocator.BlockAllocator"):
        cls(fast.BlockAllocator(8, 64, xp=np), 4)


@pytest.mark.parametrize("cls", FAST, ids=lambda c: c.__name__)
def test_a_fast_manager_refuses_the_teaching_allocator(cls):
    with pytest.raises(ConfigError, match="needs a pagedkv.fast.BlockAllocator, got a "
                                          "pagedkv.allocator.BlockAllocator"):
        cls(allocator.BlockAllocator(8, 64, xp=np), 4)


@pytest.mark.parametrize("path", PATHS)
def test_a_hashed_prompt_stands_for_its_ids(path):
    """``prompt()`` checks and hashes once; ``add``, ``cached_prefix`` and ``blocks_to_add``
    take the result as they take the ids, on either path, from either path; a prompt
    hashed for another block size is hashed again."""
    ids = [1, 2, 3, 4, 5, 6, 7]
    m, other = make(path), make("fast" if path == "teaching" else "teaching")
    m.add("a", ids)
    for p in (m.prompt(ids), other.prompt(ids), make(path, block_size=4).prompt(ids)):
        assert type(p) is prefix_cache.Prompt and p.tokens == ids
        assert m.cached_prefix(p) == m.cached_prefix(ids) == 6
        assert m.blocks_to_add(p) == m.blocks_to_add(ids)
    plan = m.add("b", m.prompt(ids).head(5))
    assert plan.cached_tokens == 4 and m.num_tokens("b") == 5
    with pytest.raises(ConfigError, match="token ids"):
        m.step(["a"], m.prompt([1]))                 # a prompt is not a step's tokens
    m.audit()
