"""Transfers between two pools: the books (fresh blocks on B, all or nothing, typed errors
that change nothing on either side) and the bytes (every token read back through B's page
table), with plain and prefix-caching receivers, forked sequences, and a randomized run
against a dict of token values.

Each side's pool is an integer array ``[layers, num_blocks, block_size]``: one value per
slot and layer, a different value for every (tokens so far, layer), so a block that lands
in the wrong place, or not at all, reads back wrong.
"""
import random

import numpy as np
import pytest

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import (ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists,
                            UnknownSequence)
from pagedkv.manager import KVCacheManager
from pagedkv.prefix_cache import PrefixCachingManager
from pagedkv.transfer import copy_between, plan_transfer

BS, LAYERS = 4, 3
BLOCK_BYTES = LAYERS * BS * 8              # int64 values, all layers of one block


class Side:
    """One pool: a manager, its values, and what each sequence holds (the oracle)."""

    def __init__(self, num_blocks=16, *, prefix=False, block_size=BS):
        alloc = BlockAllocator(num_blocks, BLOCK_BYTES, xp=np)
        self.m = (PrefixCachingManager(alloc, block_size) if prefix
                  else KVCacheManager(alloc, block_size))
        self.prefix = prefix
        self.pool = np.full((LAYERS, num_blocks, BS), -1, dtype=np.int64)
        self.tokens: dict = {}

    @staticmethod
    def value(tokens, t, layer):
        return hash((tuple(tokens[:t + 1]), layer)) & 0xFFFFFFFFFFFF

    def _write(self, seq, slots, first):
        flat = self.pool.reshape(LAYERS, -1)
        for i, slot in enumerate(np.asarray(slots).tolist()):
            for la in range(LAYERS):
                flat[la, slot] = self.value(self.tokens[seq], first + i, la)

    def add(self, seq, tokens):
        plan = self.m.add(seq, list(tokens) if self.prefix else len(tokens))
        self.tokens[seq] = list(tokens)
        self._write(seq, plan.slots, len(tokens) - len(plan.slots))

    def step(self, seqs, new):
        plan = self.m.step(seqs, new) if self.prefix else self.m.step(seqs)
        for src, dst in plan.copies.tolist():
            self.pool[:, dst] = self.pool[:, src]
        for seq, tok, slot in zip(seqs, new, plan.slot_mapping.tolist()):
            self.tokens[seq].append(tok)
            self._write(seq, [slot], len(self.tokens[seq]) - 1)

    def fork(self, parent, child):
        self.m.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    def free(self, seq):
        self.m.free(seq)
        del self.tokens[seq]

    def check(self):
        """Audit the books; read every token of every sequence back through its table."""
        self.m.audit()
        assert sorted(self.m.seq_ids, key=repr) == sorted(self.tokens, key=repr)
        flat = self.pool.reshape(LAYERS, -1)
        for seq, toks in self.tokens.items():
            assert self.m.num_tokens(seq) == len(toks)
            got = flat[:, self.m.slots(seq)]
            want = [[self.value(toks, t, la) for t in range(len(toks))]
                    for la in range(LAYERS)]
            assert got.tolist() == want, f"sequence {seq!r} reads back wrong"

    def snapshot(self):
        a = self.m.allocator
        return (a.free_blocks() if hasattr(a, "free_blocks") else None, a.num_free,
                a.refcounts().tolist(),
                {s: (self.m.block_table(s).tolist(), self.m.num_tokens(s))
                 for s in self.m.seq_ids}, self.pool.copy().tolist())


def transfer(a: Side, b: Side, seqs, *, free=True):
    """Plan, move the bytes, hand the tokens over, free on A."""
    contents = [a.tokens[s] for s in seqs] if b.prefix else None
    plan = plan_transfer(a.m, b.m, seqs, contents)
    copy_between(a.pool, b.pool, plan.pairs)
    for s in seqs:
        b.tokens[s] = list(a.tokens[s])
        if free:
            a.free(s)
    return plan


def tokens(rng, n):
    return [rng.randrange(1000) for _ in range(n)]


def test_every_token_arrives_in_fresh_blocks_of_b():
    rng = random.Random(0)
    a, b = Side(), Side()
    b.add("there", tokens(rng, 9))              # B is busy: its free blocks start at 3
    a.add(0, tokens(rng, 10))
    a.add(1, tokens(rng, 5))
    plan = transfer(a, b, [0, 1], free=False)
    assert plan.pairs.tolist() == [[0, 3], [1, 4], [2, 5], [3, 6], [4, 7]]
    assert plan.found == 0 and plan.nbytes(BLOCK_BYTES) == 5 * BLOCK_BYTES
    a.check()                                   # A keeps them until the caller frees
    b.check()
    a.free(0)
    a.free(1)
    assert a.m.allocator.num_free == 16
    a.check()
    b.check()


def test_full_destination_changes_nothing_on_either_side():
    rng = random.Random(1)
    a, b = Side(), Side(num_blocks=6)
    a.add(0, tokens(rng, 12))                   # 3 blocks
    a.add(1, tokens(rng, 9))                    # 3 blocks
    b.add("there", tokens(rng, 1))              # 5 free on B, 6 needed
    before = a.snapshot(), b.snapshot()
    with pytest.raises(OutOfBlocks) as err:
        plan_transfer(a.m, b.m, [0, 1])
    assert (err.value.needed, err.value.free) == (6, 5)
    assert "transfer" in str(err.value)
    assert (a.snapshot(), b.snapshot()) == before
    a.check()
    b.check()
    transfer(a, b, [1])                         # a smaller move still fits
    b.check()


@pytest.mark.parametrize("bad, error, words", [
    ([0, 0], DuplicateSequence, "more than once"),
    ([0, "nobody"], UnknownSequence, "unknown sequence"),
    ([0, "there"], SequenceExists, "already holds"),
])
def test_bad_ids_change_nothing(bad, error, words):
    rng = random.Random(2)
    a, b = Side(), Side()
    a.add(0, tokens(rng, 6))
    a.add("there", tokens(rng, 3))
    b.add("there", tokens(rng, 3))
    before = a.snapshot(), b.snapshot()
    with pytest.raises(error, match=words):
        plan_transfer(a.m, b.m, bad)
    assert (a.snapshot(), b.snapshot()) == before


def test_contents_that_do_not_match_change_nothing():
    rng = random.Random(3)
    a, b = Side(), Side(prefix=True)
    a.add(0, tokens(rng, 6))
    a.add(1, tokens(rng, 2))
    before = a.snapshot(), b.snapshot()
    with pytest.raises(ConfigError, match="holds 6 tokens on A, 5 given"):
        plan_transfer(a.m, b.m, [0], [a.tokens[0][:5]])
    with pytest.raises(ConfigError, match="one contents per sequence, got 1 for 2"):
        plan_transfer(a.m, b.m, [0, 1], [a.tokens[0]])
    with pytest.raises(ConfigError, match="takes token ids"):
        plan_transfer(a.m, b.m, [0, 1])         # counts, for a prefix-caching receiver
    with pytest.raises(ConfigError, match="not both"):
        plan_transfer(a.m, b.m, [0, 1], [a.tokens[0], 2])
    assert (a.snapshot(), b.snapshot()) == before


def test_pools_cut_differently_are_refused():
    a, b = Side(), Side(block_size=2)
    a.add(0, [1, 2, 3])
    with pytest.raises(ConfigError, match="4 tokens per block on A, 2 on B"):
        plan_transfer(a.m, b.m, [0])
    c = KVCacheManager(BlockAllocator(8, 2 * BLOCK_BYTES, xp=np), BS)
    with pytest.raises(ConfigError, match=f"{BLOCK_BYTES} bytes on A, "
                                          f"{2 * BLOCK_BYTES} on B"):
        plan_transfer(a.m, c, [0])
    assert len(b.m) == len(c) == 0


def test_forked_sequences_arrive_unshared_on_a_plain_receiver():
    rng = random.Random(4)
    a, b = Side(), Side()
    a.add(0, tokens(rng, 10))                   # 2 full blocks and half of one
    a.fork(0, 1)
    a.step([0, 1], [7, 8])                      # copy-on-write of the half block
    a.check()
    shared = set(a.m.block_table(0)[:2].tolist())
    assert shared == set(a.m.block_table(1)[:2].tolist())
    plan = transfer(a, b, [0, 1])
    assert len(plan.pairs) == 6                 # the two shared blocks sent twice
    assert sorted(set(plan.pairs[:, 0].tolist()) & shared) == sorted(shared)
    assert b.m.allocator.num_shared == 0
    b.check()
    b.step([0, 1], [5, 6])                      # and they decode on as before
    b.check()
    assert a.m.allocator.num_free == 16
    a.check()


def test_a_prefix_caching_receiver_finds_shared_blocks_again():
    rng = random.Random(5)
    a, b = Side(), Side(prefix=True)
    a.add(0, tokens(rng, 10))
    a.fork(0, 1)
    a.step([0, 1], [7, 8])
    plan = transfer(a, b, [0, 1])
    assert plan.found == 2                      # sequence 1's full blocks: cached on B
    assert len(plan.pairs) == 4
    assert b.m.allocator.num_shared == 2
    b.check()
    b.step([0, 1], [5, 6])
    b.check()


def test_copy_between_refuses_pools_that_do_not_match():
    a, b = Side(), Side()
    with pytest.raises(ConfigError, match="must agree"):
        copy_between(a.pool, b.pool[:2], [[0, 1]])
    with pytest.raises(ConfigError, match="appear once"):
        copy_between(a.pool, b.pool, [[0, 1], [2, 1]])
    before = b.pool.copy()
    copy_between(a.pool, b.pool, np.zeros((0, 2), dtype=np.int32))
    assert (b.pool == before).all()


def _random_run(seed: int, steps: int = 300):
    """Random adds, steps, forks, frees and transfers both ways between two small pools
    (B prefix-caching on odd seeds), checked against the dict of tokens after each."""
    rng = random.Random(seed)
    sides = [Side(num_blocks=16), Side(num_blocks=16, prefix=seed % 2 == 1)]
    next_id = 0
    outcomes = {"transfers": 0, "refused": 0}
    for _ in range(steps):
        side = rng.choice(sides)
        other = sides[1] if side is sides[0] else sides[0]
        ids = list(side.tokens)
        op = rng.random()
        try:
            if op < 0.2 or not ids:
                side.add(next_id, tokens(rng, rng.randint(1, 10)))
                next_id += 1
            elif op < 0.4:
                pick = rng.sample(ids, rng.randint(1, len(ids)))
                side.step(pick, tokens(rng, len(pick)))
            elif op < 0.5:
                side.fork(rng.choice(ids), next_id)
                next_id += 1
            elif op < 0.7:
                side.free(rng.choice(ids))
            else:
                pick = [s for s in rng.sample(ids, rng.randint(1, len(ids)))
                        if s not in other.tokens]
                before = side.snapshot(), other.snapshot()
                try:
                    transfer(side, other, pick)
                    outcomes["transfers"] += 1
                except OutOfBlocks:
                    assert (side.snapshot(), other.snapshot()) == before
                    outcomes["refused"] += 1
        except OutOfBlocks:
            pass
        for s in sides:
            s.check()
    return outcomes


@pytest.mark.parametrize("seed", [11, 12, 13, 14])
def test_random_runs_agree_with_the_dict_of_tokens(seed):
    print(f"seed {seed}")
    outcomes = _random_run(seed)
    print(outcomes)
    assert outcomes["transfers"] > 10 and outcomes["refused"] > 0
