"""Prefix caching: hits, eviction, and the cases other engines got wrong.

Every test executes the manager's plans on an integer "pool" (one value per slot) whose value at
position t of a sequence is a function of the sequence's first t + 1 tokens, as a real K/V would
be. Reading a sequence back through its page table must give exactly the values of its own
tokens: a wrong hit (a block computed after another prefix) reads back wrong.
"""
import numpy as np
import pytest

import pagedkv.prefix_cache as prefix_cache
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import AuditError, ConfigError, OutOfBlocks
from pagedkv.prefix_cache import PrefixCachingManager


def kv_value(tokens, t) -> int:
    """What position t's K/V holds: it depends on every token up to and including t."""
    return hash(tuple(tokens[:t + 1])) & 0x7FFFFFFFFFFF


class Engine:
    """The manager plus a pool of values, executing every plan as a model would."""

    def __init__(self, num_blocks=32, block_size=4):
        self.bs = block_size
        self.m = PrefixCachingManager(BlockAllocator(num_blocks, block_size * 8, xp=np),
                                      block_size)
        self.pool = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.tokens: dict = {}                        # the tokens' owner, as an engine's

    def add(self, seq, tokens):
        plan = self.m.add(seq, tokens)
        self.tokens[seq] = list(tokens)
        assert len(plan.slots) == len(tokens) - plan.cached_tokens >= 1
        for i, slot in enumerate(plan.slots.tolist()):
            self.pool[slot] = kv_value(tokens, plan.cached_tokens + i)
        self.check(seq)
        return plan

    def step(self, seqs, tokens):
        plan = self.m.step(seqs, tokens)
        for src, dst in plan.copies.tolist():
            bs = self.bs
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        for seq, token, slot in zip(seqs, tokens, plan.slot_mapping.tolist()):
            toks = self.tokens[seq]
            toks.append(token)
            self.pool[slot] = kv_value(toks, len(toks) - 1)
        for seq in seqs:
            self.check(seq)
        return plan

    def fork(self, parent, *children):
        self.m.fork(parent, *children)
        for child in children:
            self.tokens[child] = list(self.tokens[parent])

    def decode(self, seq, tokens):
        for t in tokens:
            self.step([seq], [t])

    def check(self, seq):
        toks = self.tokens[seq]
        got = self.pool[self.m.slots(seq)].tolist()
        assert got == [kv_value(toks, t) for t in range(len(toks))], f"{seq} reads wrong K/V"
        self.m.audit()


def test_a_shared_prefix_is_found_again():
    e = Engine()
    prompt = list(range(10))
    e.add("a", prompt)                                # blocks 0, 1 full; 2 holds 2 tokens
    e.m.free("a")
    assert e.m.cache.num_free == 32 and e.m.allocator.num_used == 0
    plan = e.add("b", prompt[:8] + [99, 98, 97])
    assert plan.cached_tokens == 8 and e.m.block_table("b")[:2].tolist() == [0, 1]
    assert e.m.cache.hits == 2
    plan = e.add("c", prompt[:5] + [7])               # only the first block matches
    assert plan.cached_tokens == 4 and e.m.allocator.refcount(0) == 2


def test_a_fully_cached_prompt_still_computes_its_last_token():
    """A prompt that is a whole number of blocks, all cached, must still compute at least its
    last token: the model needs its logits to produce the first output token."""
    e = Engine()
    prompt = list(range(8))
    e.add("a", prompt)
    e.m.free("a")
    plan = e.add("b", prompt)
    assert plan.cached_tokens == 4 and len(plan.slots) == 4
    e.add("c", prompt)                                 # with "b" still running: the same
    assert e.m.page_table("c").blocks[0] == e.m.page_table("b").blocks[0]


def test_same_prefix_admitted_together_leaves_one_entry_per_hash():
    """Two requests with the same new prompt admitted back to back (one step): the second hits
    the first's blocks. When both decode the same tokens, they fill equal blocks: the index
    keeps the first and the duplicate is never cached, so after both leave and every block is
    reused, no hash resolves to a block that holds something else."""
    e = Engine(num_blocks=10)
    prompt = [5, 6, 7, 8, 9, 10]
    e.add("a", prompt)
    plan = e.add("b", prompt)
    assert plan.cached_tokens == 4
    e.step(["a", "b"], [11, 11])
    e.step(["a", "b"], [12, 12])                       # both fill block 1 with equal tokens
    a_block, b_block = e.m.block_table("a")[1], e.m.block_table("b")[1]
    assert a_block != b_block
    assert e.m.cache.lookup(e.m._hashes["a"][1], (9, 10, 11, 12), e.m.cache.serial(
        e.m._hashes["a"][0]))[0] == a_block
    e.m.free("a")
    e.m.free("b")
    assert e.m.cache.is_idle(a_block) and not e.m.cache.is_idle(b_block)
    e.add("x", list(range(100, 140)))                  # another prompt takes every block
    assert e.m.cache.evictions == 2
    e.m.free("x")
    plan = e.add("c", prompt + [11, 12, 13])
    assert plan.cached_tokens == 0                     # evicted, so no stale hit


def test_a_reused_block_no_longer_answers_to_its_old_hash():
    e = Engine(num_blocks=6)
    e.add("a", list(range(12)))                        # 3 full blocks, cached
    e.m.free("a")
    e.add("b", list(range(50, 73)))                    # needs all 6 blocks: evicts a's three
    assert e.m.cache.evictions == 3
    e.m.free("b")
    plan = e.add("c", list(range(12)) + [1])
    assert plan.cached_tokens == 0


def test_a_preempted_sequence_returns_to_its_own_blocks():
    """Recompute preemption frees a sequence and admits it again later with its prompt and
    the tokens it had generated: the full blocks it had computed are hits."""
    e = Engine()
    e.add("a", [1, 2, 3, 4, 5])
    e.decode("a", [6, 7, 8, 9, 10, 11, 12])            # 12 tokens, 3 full blocks
    blocks, tokens = e.m.block_table("a").tolist(), e.tokens["a"]
    e.m.free("a")                                      # preempted
    plan = e.add("a", tokens)                          # back: all but the last block hit
    assert plan.cached_tokens == 8
    assert e.m.block_table("a")[:2].tolist() == blocks[:2]
    e.decode("a", [13, 14])


def test_a_hash_collision_is_refused_by_the_token_check(monkeypatch):
    """With a hash that says every block is the same, nothing but the exact check stands
    between a request and another's K/V."""
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 42)
    e = Engine()
    e.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    e.add("b", [9, 9, 9, 9, 5, 6, 7, 8, 9])            # block 1's tokens equal, block 0's not
    assert e.m.page_table("b").blocks[1] != e.m.page_table("a").blocks[1]
    e.m.free("a")
    plan = e.add("c", [9, 9, 9, 9, 5, 6, 7, 8, 1])     # the one cached entry is a's block 0
    assert plan.cached_tokens == 0


def test_a_chain_collision_is_refused_by_the_parent_check(monkeypatch):
    """A hash that forgets the parent makes the block (0, 0, 0, 0) after (3, 4, 5, 6) and the
    one after (1, 2, 3, 3) look the same. The cached one was computed after (3, 4, 5, 6); a
    request that found (1, 2, 3, 3) must not take it, although its own tokens are equal: the
    entry remembers its parent's serial number."""
    real = prefix_cache.block_hash
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: real(0, tokens))
    e = Engine()
    e.add("b", [3, 4, 5, 6, 0, 0, 0, 0, 1])          # caches both of its full blocks
    e.add("a", [1, 2, 3, 3, 0, 0, 0, 0, 1])          # its second one is b's twin: not cached
    plan = e.add("c", [1, 2, 3, 3, 0, 0, 0, 0, 2])   # hits a's first block; b's second ...
    assert plan.cached_tokens == 4                    # ... is refused, its tokens equal or not
    assert e.m.page_table("c").blocks[1] != e.m.page_table("b").blocks[1]


def test_least_recently_used_idle_block_is_evicted_first():
    e = Engine(num_blocks=4)
    e.add("a", [1, 2, 3, 4, 0])
    e.add("b", [5, 6, 7, 8, 0])
    e.m.free("b")                                      # b's block 2 idle first, then a's 0
    e.m.free("a")
    e.add("c", [9, 9])                                 # free stack: blocks 1, 3 (partial)
    e.add("d", [8, 8, 8, 8, 8])                        # needs 2: stack's last, then evicts
    assert e.m.cache.evictions == 1
    e.m.free("c")
    assert e.add("e", [1, 2, 3, 4, 0]).cached_tokens == 4      # a's block survived
    assert e.m.cache.evictions == 1


def test_admission_that_does_not_fit_changes_nothing():
    e = Engine(num_blocks=4)
    e.add("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    e.m.free("a")
    state = (e.m.cache.num_free, e.m.allocator.refcounts().tolist(), e.m.cache.hits)
    with pytest.raises(OutOfBlocks):
        e.m.add("b", [1, 2, 3, 4, 5, 6, 7, 8] + list(range(20, 30)))
    assert (e.m.cache.num_free, e.m.allocator.refcounts().tolist(), e.m.cache.hits) == state
    assert "b" not in e.m
    e.m.audit()


def test_forks_share_and_cache_their_blocks():
    e = Engine()
    e.add("p", [1, 2, 3, 4, 5, 6])
    e.fork("p", "q")
    e.step(["p", "q"], [7, 70])                        # q copies the shared partial block
    e.step(["p", "q"], [8, 80])                        # both blocks full now, both cached
    assert e.tokens["q"] == [1, 2, 3, 4, 5, 6, 70, 80]
    assert e.m._tail["q"] == [] and len(e.m._hashes["q"]) == 2   # named, ids let go
    e.m.free("p")
    e.m.free("q")
    assert e.add("r", [1, 2, 3, 4, 5, 6, 70, 80, 1]).cached_tokens == 8


def test_bad_tokens_and_counts():
    e = Engine()
    for bad in ([1, -2], [1.5], [None], ["a"]):
        with pytest.raises(ConfigError, match="token ids"):
            e.m.add("a", bad)
    assert "a" not in e.m
    e.add("a", [1, 2])
    with pytest.raises(ConfigError, match="got 2 token.s. for 1 sequence"):
        e.m.step(["a"], [1, 2])
    with pytest.raises(ConfigError, match="at least one token"):
        e.m.append("a", [])
    e.m.audit()


def test_audit_catches_a_wrong_cache_entry():
    e = Engine()
    e.add("a", [1, 2, 3, 4, 5])
    block = e.m.block_table("a")[0]
    entry = e.m.cache._entry[block]
    e.m.cache._entry[block] = entry._replace(tokens=(1, 2, 3, 5))
    with pytest.raises(AuditError, match="not the hash of its tokens"):
        e.m.audit()
    e.m.cache._entry[block] = entry
    e.m.audit()
    e.m._serials["a"][0] += 1                          # its chain now names another entry
    with pytest.raises(AuditError, match="cached as another entry"):
        e.m.audit()
    e.m._serials["a"][0] -= 1
    e.m._tail["a"].append(9)                           # an id without K/V
    with pytest.raises(AuditError, match="keeps 2 ids of its last block"):
        e.m.audit()


def test_a_freed_sequence_is_evicted_tail_first():
    """Blocks are found only through the blocks before them, so freeing a sequence puts its
    last block first in line for eviction: the head of the prefix stays findable."""
    e = Engine(num_blocks=4)
    e.add("a", list(range(13)))                        # 3 full blocks and one of 1 token
    e.m.free("a")                                      # the partial block goes to the free stack
    e.add("b", [50, 51, 52, 53, 54])                   # 2 blocks: the free one, then evicts one
    assert e.m.cache.evictions == 1
    e.m.free("b")
    assert e.add("c", list(range(9))).cached_tokens == 8       # blocks 0 and 1 are still there


def test_caching_off_finds_and_keeps_nothing():
    m = PrefixCachingManager(BlockAllocator(8, 32, xp=np), 4, caching=False)
    m.add("a", list(range(9)))
    m.free("a")
    assert m.cached_prefix(list(range(9))) == 0 and m.cache.evictions == 0
    assert m.add("b", list(range(9))).cached_tokens == 0
    assert m.allocator.num_used == 3 and not m.cache._entry
    m.audit()


def test_queries_change_nothing():
    e = Engine(num_blocks=8)
    e.add("a", list(range(10)))
    e.m.free("a")
    before = (e.m.cache.num_free, list(e.m.cache._idle), e.m.cache.hits)
    assert e.m.cached_prefix(list(range(10))) == 8
    assert e.m.cached_prefix(list(range(8))) == 4       # the last token is always computed
    assert e.m.blocks_to_add(list(range(10))) == 3      # two idle hits and one fresh block
    assert (e.m.cache.num_free, list(e.m.cache._idle), e.m.cache.hits) == before


def _idle_pool(fast: bool):
    """A pool of 8 blocks of 2 tokens whose free stack holds 4 blocks and whose idle
    blocks are, least recently used first: y's [7, 8], two of nobody's, x's [1, 2]."""
    from pagedkv import fast as f
    from pagedkv.fast import prefix as fp
    if fast:
        m = fp.PrefixCachingManager(f.BlockAllocator(8, 16, xp=np), 2)
    else:
        m = PrefixCachingManager(BlockAllocator(8, 16, xp=np), 2)
    for seq, prompt in (("y0", [7, 8, 9]), ("z0", [5, 5, 6]), ("z1", [4, 4, 6]),
                        ("x0", [1, 2, 3])):
        m.add(seq, prompt)
    for seq in ("y0", "z0", "z1", "x0"):
        m.free(seq)
    return m


X, Y = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9]


@pytest.mark.parametrize("fast", [False, True], ids=["teaching", "fast"])
def test_add_all_takes_every_hit_before_any_fresh_block(fast):
    """Two sequences of one request come back together. Added one by one, x's fifth
    fresh block evicts the least recently used idle block, which is the one y would
    have found; ``add_all`` takes y's hit first, and x evicts a block nobody finds."""
    m = _idle_pool(fast)
    assert m.blocks_to_add(X) + m.blocks_to_add(Y) == 8 == m.blocks_to_add(X, Y)
    m.add("x", X)
    assert m.add("y", Y).cached_tokens == 0            # y's block went to x
    m = _idle_pool(fast)
    x, y = m.add_all([("x", X), ("y", Y)])
    assert (x.cached_tokens, y.cached_tokens) == (2, 2)
    assert m.allocator.num_free == 0
    m.audit()


@pytest.mark.parametrize("fast", [False, True], ids=["teaching", "fast"])
def test_add_all_is_all_or_nothing(fast):
    m = _idle_pool(fast)
    before = (m.allocator.refcounts().tolist(), m.allocator.num_free, sorted(m.seq_ids))
    with pytest.raises(OutOfBlocks, match="'x', 'y'"):
        m.add_all([("x", X), ("y", Y + [1, 1])])       # one block more than is free
    with pytest.raises(ConfigError, match="given twice"):
        m.add_all([("x", X), ("x", Y)])
    with pytest.raises(ConfigError, match="at least one token"):
        m.add_all([("x", X), ("y", [])])
    assert (m.allocator.refcounts().tolist(), m.allocator.num_free,
            sorted(m.seq_ids)) == before
    m.audit()
