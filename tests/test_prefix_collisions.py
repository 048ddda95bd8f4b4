"""Hash collisions, forced, on both prefix caches: a hit must follow the sequence's own chain
of blocks, whatever the hash says.

The hash is replaced by one that collides on purpose: at a sequence's first block, in the
middle of a prompt, and at the parent of a later block (the case where the index's answer
for the parent's hash is another sequence's block). Every plan is executed on a pool of
values in which position t of a sequence holds a function of its first t + 1 tokens, as a
real K/V would: reading a sequence back through its page table must give exactly its own
values. Then random call streams run under a hash with only five values, checked the same
way after every call.
"""
import random

import numpy as np
import pytest

import pagedkv.fast.prefix as fast_prefix
import pagedkv.prefix_cache as prefix_cache
from pagedkv import allocator, fast
from pagedkv.errors import OutOfBlocks

REAL = prefix_cache.block_hash
REAL_FAST = fast_prefix._hash


def kv_value(tokens, t) -> int:
    """What position t's K/V holds: it depends on every token up to and including t."""
    return hash(tuple(tokens[:t + 1])) & 0x7FFFFFFFFFFF


def force(monkeypatch, rule):
    """Both paths hash with ``rule(parent_hash, tokens)`` (a tuple of ints)."""
    monkeypatch.setattr(prefix_cache, "block_hash", rule)

    def on_bytes(data, seed=0):
        return rule(seed, tuple(np.frombuffer(bytes(data), dtype=np.int64).tolist()))
    monkeypatch.setattr(fast_prefix, "_hash", on_bytes)


def colliding(pairs, value=12345):
    """A hash under which every (parent hash, tokens) of ``pairs`` gives ``value``."""
    pairs = {(p, tuple(t)) for p, t in pairs}
    return lambda p, t: value if (p, tuple(t)) in pairs else REAL(p, t)


class Executor:
    """A prefix-caching manager (``path``: "teaching" or "fast") and a pool of values,
    executing every plan as a model would."""

    def __init__(self, path, num_blocks=32, block_size=2):
        self.bs = block_size
        if path == "teaching":
            alloc = allocator.BlockAllocator(num_blocks, block_size * 8, xp=np)
            self.m = prefix_cache.PrefixCachingManager(alloc, block_size)
        else:
            alloc = fast.BlockAllocator(num_blocks, block_size * 8, xp=np)
            self.m = fast_prefix.PrefixCachingManager(alloc, block_size)
        self.pool = np.full(num_blocks * block_size, -1, dtype=np.int64)
        self.tokens: dict = {}                        # the tokens' owner, as an engine's

    def add(self, seq, tokens):
        plan = self.m.add(seq, tokens)
        self.tokens[seq] = list(tokens)
        for i, slot in enumerate(plan.slots.tolist()):
            self.pool[slot] = kv_value(tokens, plan.cached_tokens + i)
        self.check(seq)
        return plan.cached_tokens

    def step(self, seqs, tokens):
        plan = self.m.step(seqs, tokens)
        bs = self.bs
        for src, dst in plan.copies.tolist():
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        for seq, token, slot in zip(seqs, tokens, plan.slot_mapping.tolist()):
            toks = self.tokens[seq]
            toks.append(token)
            self.pool[slot] = kv_value(toks, len(toks) - 1)
        for seq in seqs:
            self.check(seq)

    def append(self, seq, tokens):
        plan = self.m.append(seq, tokens)
        bs, toks = self.bs, self.tokens[seq]
        toks.extend(tokens)
        for src, dst in plan.copies.tolist():
            self.pool[dst * bs:(dst + 1) * bs] = self.pool[src * bs:(src + 1) * bs]
        for i, slot in enumerate(plan.slots.tolist()):
            self.pool[slot] = kv_value(toks, len(toks) - len(tokens) + i)
        self.check(seq)

    def fork(self, parent, child):
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def check(self, seq):
        toks = self.tokens[seq]
        got = self.pool[self.m.slots(seq)].tolist()
        assert got == [kv_value(toks, t) for t in range(len(toks))], f"{seq} reads wrong K/V"
        self.m.audit()


PATHS = ["teaching", "fast"]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("free_first", [False, True], ids=["running", "idle"])
def test_a_collision_at_the_first_block(monkeypatch, path, free_first):
    force(monkeypatch, colliding([(0, (1, 2)), (0, (3, 4))]))
    e = Executor(path)
    e.add("a", [1, 2, 9])
    if free_first:
        e.m.free("a")
    assert e.add("b", [3, 4, 9]) == 0                  # a's block answers to b's hash
    assert e.add("c", [1, 2, 9]) == 2                  # and is still a's own


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("free_first", [False, True], ids=["running", "idle"])
def test_a_collision_in_the_middle(monkeypatch, path, free_first):
    h12 = REAL(0, (1, 2))
    force(monkeypatch, colliding([(h12, (5, 6)), (h12, (7, 8))]))
    e = Executor(path)
    e.add("a", [1, 2, 5, 6, 9])
    if free_first:
        e.m.free("a")
    assert e.add("b", [1, 2, 7, 8, 9]) == 2            # its first block, not a's second
    assert e.add("c", [1, 2, 5, 6, 9]) == 4


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("free_first", [False, True], ids=["running", "idle"])
def test_a_collision_at_the_parent_of_a_later_block(monkeypatch, path, free_first):
    """[1, 2] and [3, 4] collide, so s's [5, 6] block was chained from the hash that the
    index gives to x's [1, 2]. A request r = [1, 2, 5, 6, ...] hits x's [1, 2] truly, and
    must then not take s's [5, 6]: it was computed after [3, 4]."""
    force(monkeypatch, colliding([(0, (1, 2)), (0, (3, 4))]))
    e = Executor(path, num_blocks=16)
    e.add("x", [1, 2, 9])
    e.add("s", [3, 4, 5, 6, 7])
    if free_first:
        e.m.free("x")
        e.m.free("s")
    assert e.add("r", [1, 2, 5, 6, 8]) == 2            # its second block is its own
    assert e.add("t", [1, 2, 5, 6, 8]) == 4            # which is now cached, after r's first


@pytest.mark.parametrize("path", PATHS)
def test_a_collision_two_blocks_before(monkeypatch, path):
    """The chain breaks at block 1 and the blocks after it stay out of reach."""
    h12 = REAL(0, (1, 2))
    force(monkeypatch, colliding([(h12, (5, 6)), (h12, (3, 4))]))
    e = Executor(path)
    e.add("a", [1, 2, 5, 6, 7, 8, 0])
    e.add("b", [1, 2, 3, 4, 7, 8, 0])
    assert e.add("c", [1, 2, 3, 4, 7, 8, 1]) == 2
    e.step(["a", "b", "c"], [3, 3, 3])


def weak(p, t):
    """A hash with five values: almost every lookup is a collision."""
    return (p * 7 + sum((i + 1) * x for i, x in enumerate(t))) % 5


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", range(12), ids=lambda s: f"seed{s}")
def test_random_calls_under_a_weak_hash_read_their_own_kv(monkeypatch, path, seed):
    force(monkeypatch, weak)
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3])
    e, live, names = Executor(path, num_blocks=rng.choice([8, 16]), block_size=bs), [], 0
    heads = [(1, 2, 3, 4, 5, 6), (2, 1, 3, 4, 6, 5), (1, 2, 4, 3, 5, 6)]
    hits = 0
    for _ in range(150):
        r = rng.random()
        try:
            if r < 0.35 or not live:
                names += 1
                head = list(rng.choice(heads))[:rng.randrange(7)]
                hits += e.add(names, head + [rng.randrange(3) for _ in range(
                    rng.randint(1, 2 * bs))]) > 0
                live.append(names)
            elif r < 0.6:
                batch = rng.sample(live, rng.randint(1, len(live)))
                e.step(batch, [rng.randrange(3) for _ in batch])
            elif r < 0.7:
                e.append(rng.choice(live), [rng.randrange(3) for _ in range(rng.randint(1, 4))])
            elif r < 0.8:
                names += 1
                e.fork(rng.choice(live), names)
                live.append(names)
            else:
                e.m.free(live.pop(rng.randrange(len(live))))
        except OutOfBlocks:
            pass
    for seq in live:
        e.check(seq)
    assert hits, f"seed {seed}: no hit at all"
