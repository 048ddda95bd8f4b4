"""A rule-based (stateful) Hypothesis test of the KV-cache manager against a trivially correct
model, with the invariant audit after every step.

The model knows nothing of block ids. Each sequence is a list of token values plus a list of
*abstract* blocks (fresh Python objects): a fork copies the child's list, so the two share the
objects; a write into a partly filled block that another sequence also holds replaces it with a
fresh object (copy-on-write); a truncation keeps the first tokens and the blocks that hold
them, so a kept shared block stays shared in the model too. From that alone the model predicts
how many blocks are in use and how many each operation needs, and so exactly when the manager
must run out of blocks. The manager's plans are executed on an integer "pool" (one value per
slot), and every sequence read back through its page table must equal the model's tokens.

The same machine runs against both implementations, the teaching core (pagedkv.manager) and
the fast path (pagedkv.fast), so each is checked against the model on its own. Hypothesis runs
derandomized (a fixed seed derived from the test), so every run replays the same kind of
sequences; on failure it prints the shortest sequence of rules that breaks and the blob that
reproduces it (``@reproduce_failure``). The number of checked states still moves by a few
percent with what else the process has run before (285 runs gave 49,295 and 50,836 states for
the fast manager in two pytest sessions), so the runs are sized for 50,000 each with margin.
"""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

from pagedkv import allocator, fast, manager
from pagedkv.errors import (ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists,
                            TokenIndexError, UnknownSequence)

NUM_BLOCKS, BLOCK_SIZE = 24, 4
STEPS_PER_RUN, RUNS = 200, 305      # per implementation: about 54,000 checked states each


class Block:
    """An abstract block of the model: identity is all it has."""
    __slots__ = ()


COUNTS = {impl: {"steps": 0, "out_of_blocks": 0, "copies": 0, "truncates": 0,
                 "into a shared block": 0} for impl in ("teaching", "fast")}
# The fast manager's runs take turns: its default, every step on the NumPy path, every step on
# the Python loop, so that both its step paths meet every situation the rules produce.
SMALL_BATCH = itertools.cycle([fast.KVCacheManager.small_batch, 0, 10**9])


def teaching_manager():
    return manager.KVCacheManager(allocator.BlockAllocator(NUM_BLOCKS, BLOCK_SIZE * 4, xp=np),
                                  BLOCK_SIZE)


def fast_manager():
    m = fast.KVCacheManager(fast.BlockAllocator(NUM_BLOCKS, BLOCK_SIZE * 4, xp=np), BLOCK_SIZE,
                            max_seqs=2, max_seq_len=4)     # small: the arrays must grow
    m.small_batch = next(SMALL_BATCH)
    return m


class ManagerMachine(RuleBasedStateMachine):
    """The rules and the model; a subclass names the implementation (``impl``, ``make``)."""
    seqs = Bundle("seqs")
    impl, make = None, None

    def __init__(self):
        super().__init__()
        self.m = type(self).make()
        self.counts = COUNTS[self.impl]
        self.pool = np.full(NUM_BLOCKS * BLOCK_SIZE, -1, dtype=np.int64)
        self.tokens: dict[int, list[int]] = {}
        self.blocks: dict[int, list[Block]] = {}
        self.ids = itertools.count()
        self.values = itertools.count(1)

    # ---------------------------------------------------------------- the model
    def used(self):
        return len({id(b) for bl in self.blocks.values() for b in bl})

    def holders(self, block):
        return sum(b is block for bl in self.blocks.values() for b in bl)

    def need(self, s, n):
        """Blocks an append of n tokens to s takes, and whether its last block is copied."""
        length, bl = len(self.tokens[s]), self.blocks[s]
        grow = -(-(length + n) // BLOCK_SIZE) - len(bl)
        copy = length % BLOCK_SIZE != 0 and self.holders(bl[-1]) > 1
        return grow + copy, copy

    def model_append(self, s, n, values):
        _, copy = self.need(s, n)
        if copy:
            self.blocks[s][-1] = Block()
        self.tokens[s].extend(values)
        while len(self.blocks[s]) * BLOCK_SIZE < len(self.tokens[s]):
            self.blocks[s].append(Block())

    def execute(self, copies, slots, values):
        self.counts["copies"] += len(copies)
        for src, dst in copies.tolist():
            self.pool[dst * BLOCK_SIZE:(dst + 1) * BLOCK_SIZE] = \
                self.pool[src * BLOCK_SIZE:(src + 1) * BLOCK_SIZE]
        self.pool[slots] = values

    def free_now(self):
        return NUM_BLOCKS - self.used()

    def unchanged_after(self, call):
        """call() must raise OutOfBlocks and leave the manager exactly as it was."""
        before = (self.m.stats(), self.m.seq_ids, self.m.allocator.free_blocks(),
                  {s: self.m.block_table(s).tolist() for s in self.m.seq_ids})
        try:
            call()
        except OutOfBlocks:
            self.counts["out_of_blocks"] += 1
        else:
            raise AssertionError("expected OutOfBlocks")
        after = (self.m.stats(), self.m.seq_ids, self.m.allocator.free_blocks(),
                 {s: self.m.block_table(s).tolist() for s in self.m.seq_ids})
        assert before == after, "a failed operation changed the manager"

    # ---------------------------------------------------------------- rules
    @rule(target=seqs, n=st.integers(0, 30))
    def add(self, n):
        s = next(self.ids)
        need = -(-n // BLOCK_SIZE)
        if need > self.free_now():
            self.unchanged_after(lambda: self.m.add(s, n))
            return multiple()
        values = [next(self.values) for _ in range(n)]
        plan = self.m.add(s, n)
        self.tokens[s], self.blocks[s] = [], []
        if n:
            self.model_append(s, n, values)
        self.execute(plan.copies, plan.slots, values)
        return s

    @precondition(lambda self: self.tokens)
    @rule(s=seqs, n=st.integers(1, 12))
    def append(self, s, n):
        if s not in self.tokens:
            return
        need, _ = self.need(s, n)
        if need > self.free_now():
            self.unchanged_after(lambda: self.m.append(s, n))
            return
        values = [next(self.values) for _ in range(n)]
        plan = self.m.append(s, n)
        assert len(plan.copies) == self.need(s, n)[1]
        self.model_append(s, n, values)
        self.execute(plan.copies, plan.slots, values)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), everyone=st.booleans())
    def step(self, data, everyone):
        live = sorted(self.tokens)
        batch = live if everyone else data.draw(
            st.lists(st.sampled_from(live), min_size=1, unique=True))
        # the model's need for the whole batch, copies counted against holders as they go
        grow = sum(len(self.tokens[s]) % BLOCK_SIZE == 0 for s in batch)
        left: dict[int, int] = {}
        copies = 0
        for s in batch:
            if len(self.tokens[s]) % BLOCK_SIZE:
                b = self.blocks[s][-1]
                h = left.get(id(b), self.holders(b))
                if h > 1:
                    copies += 1
                    left[id(b)] = h - 1
        if grow + copies > self.free_now():
            self.unchanged_after(lambda: self.m.step(None if everyone else batch))
            return
        plan = self.m.step(None if everyone else batch)
        assert sorted(plan.seq_ids) == sorted(batch)
        assert len(plan.copies) == copies
        values = [next(self.values) for _ in plan.seq_ids]
        for s, v in zip(plan.seq_ids, values):
            self.model_append(s, 1, [v])
        self.execute(plan.copies, plan.slot_mapping, values)
        for i, s in enumerate(plan.seq_ids):
            nb = len(self.blocks[s])
            assert plan.seq_lens[i] == len(self.tokens[s])
            assert plan.block_tables[i, :nb].tolist() == self.m.block_table(s).tolist()
            assert (plan.block_tables[i, nb:] == -1).all()

    @precondition(lambda self: self.tokens)
    @rule(target=seqs, s=seqs, k=st.integers(1, 3))
    def fork(self, s, k):
        if s not in self.tokens:
            return multiple()
        children = [next(self.ids) for _ in range(k)]
        self.m.fork(s, *children)
        for c in children:
            self.tokens[c] = list(self.tokens[s])
            self.blocks[c] = list(self.blocks[s])
        return multiple(*children)

    @precondition(lambda self: self.tokens)
    @rule(s=consumes(seqs))
    def free(self, s):
        if s not in self.tokens:
            return
        self.m.free(s)
        del self.tokens[s], self.blocks[s]

    @precondition(lambda self: self.tokens)
    @rule(s=seqs, data=st.data())
    def truncate(self, s, data):
        """A rewind to any length from 0 to the whole sequence; the blocks past it go, a
        kept shared block stays shared (its next write copies it, as ``need`` predicts)."""
        if s not in self.tokens:
            return
        n = data.draw(st.integers(0, len(self.tokens[s])))
        self.m.truncate(s, n)
        keep = -(-n // BLOCK_SIZE)
        self.tokens[s], self.blocks[s] = self.tokens[s][:n], self.blocks[s][:keep]
        self.counts["truncates"] += 1
        if n % BLOCK_SIZE and self.holders(self.blocks[s][-1]) > 1:
            self.counts["into a shared block"] += 1

    @rule(s=seqs)
    def misuse(self, s):
        if s in self.tokens:
            for call, err in ((lambda: self.m.add(s), SequenceExists),
                              (lambda: self.m.fork(s, s), SequenceExists),
                              (lambda: self.m.fork(s, "c", "c"), DuplicateSequence),
                              (lambda: self.m.step([s, s]), DuplicateSequence),
                              (lambda: self.m.append(s, 0), ConfigError),
                              (lambda: self.m.truncate(s, -1), ConfigError),
                              (lambda: self.m.truncate(s, len(self.tokens[s]) + 1),
                               TokenIndexError)):
                try:
                    call()
                except err:
                    pass
                else:
                    raise AssertionError(f"expected {err.__name__}")
        else:
            for call in (lambda: self.m.append(s), lambda: self.m.free(s),
                         lambda: self.m.fork(s, -1), lambda: self.m.truncate(s, 0)):
                try:
                    call()
                except UnknownSequence:
                    pass
                else:
                    raise AssertionError("expected UnknownSequence")

    # ---------------------------------------------------------------- after every step
    @invariant()
    def agrees_with_the_model(self):
        self.counts["steps"] += 1
        self.m.audit()
        assert self.m.allocator.num_used == self.used()
        assert sorted(self.m.seq_ids) == sorted(self.tokens)
        for s, toks in self.tokens.items():
            assert self.m.num_tokens(s) == len(toks)
            assert self.pool[self.m.slots(s)].tolist() == toks


class TeachingMachine(ManagerMachine):
    impl, make = "teaching", staticmethod(teaching_manager)


class FastMachine(ManagerMachine):
    impl, make = "fast", staticmethod(fast_manager)


@pytest.mark.parametrize("machine", [TeachingMachine, FastMachine], ids=["teaching", "fast"])
def test_manager_against_model(machine):
    counts = COUNTS[machine.impl]
    print(f"hypothesis: derandomized, {RUNS} runs x {STEPS_PER_RUN} steps on the {machine.impl} "
          f"manager; {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens")
    run_state_machine_as_test(machine, settings=settings(
        max_examples=RUNS, stateful_step_count=STEPS_PER_RUN, derandomize=True, database=None,
        deadline=None, print_blob=True, suppress_health_check=list(HealthCheck)))
    print(f"checked {counts['steps']} states; {counts['out_of_blocks']} out-of-blocks "
          f"outcomes, {counts['copies']} copy-on-write copies, {counts['truncates']} "
          f"truncations ({counts['into a shared block']} into a shared block)")
    assert counts["steps"] >= 50_000              # 100,000 or more for the two together
    for key in ("out_of_blocks", "copies", "truncates", "into a shared block"):
        assert counts[key] > 0, key
