"""A rule-based (stateful) Hypothesis test of prefix caching, eviction and both kinds of
preemption (recompute and swap) against a trivially correct model, with both audits (the
manager's, which checks the cache index, and the swapper's) after every step.

The model knows nothing of hashes, serial numbers or block ids. Its cache is a dict from a
*whole prefix* (every token from the start of the sequence to the end of a block) to an entry
that remembers the entry before it; each sequence keeps its *chain*, the entry that holds its
tokens up to each of its full blocks (the one it hit, cached, or found cached as an equal
twin), and a block is cached only as the child of its sequence's chain entry, if that entry
is still cached; its blocks are plain Python objects with an owner count;
its idle blocks are a list in least-recently-freed order; its free stack is a count. From that
it predicts how many tokens every admission finds cached, when an operation must run out of
blocks (device or host), how many blocks are free, hit and evicted, and which blocks are idle.

The manager's plans are executed on an integer "pool" (one value per slot), the swaps with
:func:`~pagedkv.swap.copy_to_host` / :func:`~pagedkv.swap.copy_to_device` through a real host
pool. A slot's value is a function of every token up to and including it, as K/V is, so a
sequence read back through its page table, and every cached block read back against its
prefix, show any wrong hit, lost swap or stale block. Blocks that become truly free are
overwritten, so that nothing can read them by accident.

The same machine runs against both implementations, the teaching
:mod:`pagedkv.prefix_cache` and the fast :mod:`pagedkv.fast.prefix`. Hypothesis runs
derandomized (a fixed seed derived from the test), so CI runs the same steps every time; on
failure it prints the shortest sequence of rules that breaks.
"""
import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, invariant,
                                 multiple, precondition, rule, run_state_machine_as_test)

from pagedkv import fast
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import ConfigError, OutOfBlocks
from pagedkv.fast.prefix import PrefixCachingManager as FastPrefixCachingManager
from pagedkv.prefix_cache import PrefixCachingManager
from pagedkv.swap import HostPool, Swapper, copy_to_device, copy_to_host

NUM_BLOCKS, BLOCK_SIZE, HOST_BLOCKS = 14, 2, 8
STEPS_PER_RUN, RUNS = 60, 300      # per implementation: about 13,000 checked states each
FAMILIES = [(), (1, 2, 3, 4, 5), (1, 2, 3, 9), (7, 7)]   # shared beginnings of prompts
KEYS = ("steps", "hits", "evictions", "out_of_blocks", "swaps", "recomputes", "reserved",
        "committed", "truncates", "truncates refused", "named blocks cut",
        "pending slots dropped")
COUNTS = dict.fromkeys(KEYS, 0)


def kv_value(tokens, t) -> int:
    return hash(tuple(tokens[:t + 1])) & 0x7FFFFFFFFFFF


class Block:
    """A model block: who holds it, and the cache entry it is (None: not cached)."""
    __slots__ = ("owners", "entry", "real")

    def __init__(self):
        self.owners, self.entry, self.real = 1, None, None


class Entry:
    __slots__ = ("key", "parent", "block")

    def __init__(self, key, parent, block):
        self.key, self.parent, self.block = key, parent, block


class PrefixMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    def make_manager(self):
        return PrefixCachingManager(BlockAllocator(NUM_BLOCKS, BLOCK_SIZE * 8, xp=np),
                                    BLOCK_SIZE)

    def __init__(self):
        super().__init__()
        self.m = self.make_manager()
        self.host = HostPool(HOST_BLOCKS, BLOCK_SIZE * 8, pinned=False)
        self.swapper = Swapper(self.m, self.host)
        self.pool = np.full((1, NUM_BLOCKS, BLOCK_SIZE), -1, dtype=np.int64)
        self.ids = itertools.count()
        # the model
        self.tokens: dict = {}           # live sequence -> its tokens
        self.blocks: dict = {}           # live sequence -> its model blocks
        self.chain: dict = {}            # live sequence -> its chain of entries (or None)
        self.index: dict = {}            # whole prefix -> Entry
        self.idle: list = []             # cached blocks nobody holds, least recent first
        self.stack = NUM_BLOCKS          # blocks on the allocator's free stack
        self.hits = self.evictions = 0
        self.pending: dict = {}          # live sequence -> its reserved slots without ids
        self.preempted: dict = {}        # recompute: sequence -> its tokens
        self.parked: dict = {}           # swap: sequence -> (tokens, host block objects)
        self.host_free = HOST_BLOCKS

    # ---------------------------------------------------------------- the model
    def free_now(self):
        return self.stack + len(self.idle)

    def fresh(self):
        """A fresh model block: from the free stack, else the least recently idle one."""
        if self.stack:
            self.stack -= 1
        else:
            old = self.idle.pop(0)
            del self.index[old.entry.key]
            self.evictions += 1
        return Block()

    def release(self, block):
        block.owners -= 1
        if block.owners == 0:
            if block.entry is not None:
                self.idle.append(block)
            else:
                self.stack += 1

    def find(self, tokens):
        """The model's hits for a new sequence: cached leading blocks, at least one token
        left to compute."""
        hits, parent = [], None
        for j in range((len(tokens) - 1) // BLOCK_SIZE):
            e = self.index.get(tuple(tokens[:(j + 1) * BLOCK_SIZE]))
            if e is None or e.parent is not parent:
                break
            hits.append(e.block)
            parent = e
        return hits

    def cache_full(self, s):
        """Cache the sequence's full blocks not named yet, as the manager would."""
        toks, bl, chain = self.tokens[s], self.blocks[s], self.chain[s]
        for j in range(len(chain), len(toks) // BLOCK_SIZE):
            key = tuple(toks[:(j + 1) * BLOCK_SIZE])
            parent = chain[-1] if j else None
            if j and (parent is None or self.index.get(parent.key) is not parent):
                chain.append(None)              # unknown, or evicted since
            elif key not in self.index and bl[j].entry is None:
                bl[j].entry = self.index[key] = Entry(key, parent, bl[j])
                chain.append(bl[j].entry)
            else:                               # an equal twin holds it already
                twin = self.index.get(key)
                chain.append(twin if twin is not None and twin.parent is parent else None)

    def model_add(self, s, tokens):
        """Returns the model's cached token count, or None if it must run out of blocks."""
        hits = self.find(tokens)
        need = -(-len(tokens) // BLOCK_SIZE) - len(hits) + sum(h.owners == 0 for h in hits)
        if need > self.free_now():
            return None
        for h in hits:
            if h.owners == 0:                  # an idle block leaves the idle list
                self.idle.remove(h)
            h.owners += 1
        self.hits += len(hits)
        self.tokens[s] = list(tokens)
        self.blocks[s] = hits + [self.fresh() for _ in range(-(-len(tokens) // BLOCK_SIZE)
                                                             - len(hits))]
        self.chain[s] = [h.entry for h in hits]
        self.cache_full(s)
        return len(hits) * BLOCK_SIZE

    def model_free(self, s):
        for b in reversed(self.blocks.pop(s)):
            self.release(b)
        del self.chain[s]
        self.pending.pop(s, None)               # pending slots go with their blocks
        return self.tokens.pop(s)

    def length(self, s):
        """Tokens of K/V the sequence has: its ids, then its pending slots."""
        return len(self.tokens[s]) + self.pending.get(s, 0)

    def step_need(self, batch):
        """(new blocks, copy-on-write copies) one more slot for each of ``batch`` takes: of
        the sharers of a partly filled block in the batch, all but the last owner copy."""
        grow, left, copies = 0, {}, 0
        for s in batch:
            if self.length(s) % BLOCK_SIZE == 0:
                grow += 1
                continue
            last = self.blocks[s][-1]
            h = left.get(id(last), last.owners)
            if h > 1:
                copies += 1
                left[id(last)] = h - 1
        return grow, copies

    def step_blocks(self, batch):
        """One more slot for each of ``batch``, in batch order (copies first)."""
        for s in batch:
            bl = self.blocks[s]
            if self.length(s) % BLOCK_SIZE and bl[-1].owners > 1:
                old, bl[-1] = bl[-1], self.fresh()
                old.owners -= 1
            if self.length(s) % BLOCK_SIZE == 0:
                bl.append(self.fresh())

    def settled(self):
        """Live sequences without pending slots (the ones step, fork and swap take)."""
        return sorted(s for s in self.tokens if not self.pending.get(s))

    def snapshot(self, s):
        m = self.m
        return (m.cache.num_free, list(m.cache._idle), dict(m.cache._block_of),
                m.block_table(s).tolist(), m.pending(), list(m._tail[s]),
                list(m._hashes[s]), list(m._serials[s]))

    # ---------------------------------------------------------------- executing plans
    def learn(self, s):
        """Pair the model's blocks with the manager's ids (the model never predicts ids)."""
        real = self.m.block_table(s).tolist()
        assert len(real) == len(self.blocks[s])
        for b, r in zip(self.blocks[s], real):
            b.real = r

    def write(self, s, slots, first):
        toks = self.tokens[s]
        flat = self.pool.reshape(-1)
        for i, slot in enumerate(np.asarray(slots).tolist()):
            flat[slot] = kv_value(toks, first + i)

    def clobber(self):
        """Overwrite every block that is truly free (not held, not cached)."""
        base = self.m.cache.allocator
        for b in range(NUM_BLOCKS):
            if base.refcount(b) == 0:
                self.pool[0, b] = -9

    def admit(self, s, tokens):
        expect = self.model_add(s, tokens)
        if expect is None:
            before = (self.m.cache.num_free, list(self.m.cache._idle), self.m.cache.hits)
            try:
                self.m.add(s, tokens)
            except OutOfBlocks:
                COUNTS["out_of_blocks"] += 1
            else:
                raise AssertionError("expected OutOfBlocks")
            assert (self.m.cache.num_free, list(self.m.cache._idle),
                    self.m.cache.hits) == before
            return False
        plan = self.m.add(s, tokens)
        assert plan.cached_tokens == expect
        self.learn(s)
        self.write(s, plan.slots, plan.cached_tokens)
        return True

    # ---------------------------------------------------------------- rules
    @rule(target=seqs, family=st.sampled_from(FAMILIES),
          tail=st.lists(st.integers(0, 3), min_size=1, max_size=9))
    def add(self, family, tail):
        s = next(self.ids)
        return s if self.admit(s, list(family) + tail) else multiple()

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def step(self, data):
        batch = data.draw(st.lists(st.sampled_from(self.settled()), min_size=1, unique=True))
        new = [data.draw(st.integers(0, 3)) for _ in batch]
        grow, copies = self.step_need(batch)
        if grow + copies > self.free_now():
            try:
                self.m.step(batch, new)
            except OutOfBlocks:
                COUNTS["out_of_blocks"] += 1
                return
            raise AssertionError("expected OutOfBlocks")
        plan = self.m.step(batch, new)
        assert len(plan.copies) == copies
        self.step_blocks(batch)
        for s, t in zip(batch, new):          # then each row caches what it filled
            self.tokens[s].append(t)
            if len(self.tokens[s]) % BLOCK_SIZE == 0:
                self.cache_full(s)
        for src, dst in plan.copies.tolist():
            self.pool[0, dst] = self.pool[0, src]
        for s, slot in zip(plan.seq_ids, plan.slot_mapping.tolist()):
            self.learn(s)
            self.write(s, [slot], len(self.tokens[s]) - 1)

    @precondition(lambda self: self.tokens)
    @rule(target=seqs, s=seqs)
    def fork(self, s):
        if s not in self.tokens or self.pending.get(s):
            return multiple()
        c = next(self.ids)
        self.m.fork(s, c)
        self.tokens[c], self.blocks[c] = list(self.tokens[s]), list(self.blocks[s])
        self.chain[c] = list(self.chain[s])
        for b in self.blocks[c]:
            b.owners += 1
        return c

    @precondition(lambda self: self.tokens)
    @rule(s=consumes(seqs))
    def free(self, s):
        if s in self.tokens:
            self.m.free(s)
            self.model_free(s)
            self.clobber()

    @precondition(lambda self: self.tokens)
    @rule(s=seqs)
    def preempt_by_recompute(self, s):
        if s in self.tokens:
            self.m.free(s)
            self.preempted[s] = self.model_free(s)
            self.clobber()
            COUNTS["recomputes"] += 1

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume_by_recompute(self, data):
        s = data.draw(st.sampled_from(sorted(self.preempted)))
        if self.admit(s, self.preempted[s]):
            del self.preempted[s]

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def swap_out(self, data):
        group = data.draw(st.lists(st.sampled_from(self.settled()), min_size=1,
                                   max_size=3, unique=True))
        distinct = {id(b): b for s in group for b in self.blocks[s]}
        if len(distinct) > self.host_free:
            try:
                self.swapper.swap_out(group)
            except OutOfBlocks:
                COUNTS["out_of_blocks"] += 1
                return
            raise AssertionError("expected OutOfBlocks (host)")
        pairs = self.swapper.swap_out(group)
        assert len(pairs) == len(distinct)
        copy_to_host(self.pool, self.host, pairs)
        parked = {k: [0] for k in distinct}      # a host block: its owner count, in a list
        self.host_free -= len(distinct)
        for s in group:
            hb = [parked[id(b)] for b in self.blocks[s]]
            for h in hb:
                h[0] += 1
            self.parked[s] = (self.model_free(s), hb)
        self.clobber()
        COUNTS["swaps"] += 1

    @precondition(lambda self: self.parked)
    @rule(data=st.data())
    def swap_in(self, data):
        group = data.draw(st.lists(st.sampled_from(sorted(self.parked)), min_size=1,
                                   max_size=3, unique=True))
        need = sum(len(self.parked[s][1]) for s in group)
        contents = [self.parked[s][0] for s in group]    # the model owns the tokens
        if need > self.free_now():
            try:
                self.swapper.swap_in(group, contents)
            except OutOfBlocks:
                COUNTS["out_of_blocks"] += 1
                return
            raise AssertionError("expected OutOfBlocks")
        found = {}
        for s in group:
            tokens, hb = self.parked.pop(s)
            found[s] = self.model_add(s, tokens)
            for h in hb:
                h[0] -= 1
                self.host_free += h[0] == 0
        pairs = self.swapper.swap_in(group, contents)
        assert len(pairs) == sum(len(self.blocks[s]) - found[s] // BLOCK_SIZE for s in group)
        copy_to_device(self.host, self.pool, pairs)
        for s in group:
            self.learn(s)

    # ---------------------------------------------------- reserve, commit and truncate
    def execute_reserved(self, copies, slots):
        """A reservation's copies, then its slots written with K/V of ids not known yet
        (a guess's: -7 here); commit writes the true K/V of the ids it gives."""
        for src, dst in copies.tolist():
            self.pool[0, dst] = self.pool[0, src]
        self.pool.reshape(-1)[np.asarray(slots)] = -7

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def reserve(self, data):
        """One slot each, ids to come (the overlapped loop's step ahead)."""
        batch = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1,
                                   unique=True))
        grow, copies = self.step_need(batch)
        if grow + copies > self.free_now():
            with pytest.raises(OutOfBlocks):
                self.m.reserve(batch)
            COUNTS["out_of_blocks"] += 1
            return
        plan = self.m.reserve(batch)
        assert len(plan.copies) == copies
        self.step_blocks(batch)
        for s in batch:
            self.pending[s] = self.pending.get(s, 0) + 1
        self.execute_reserved(plan.copies, plan.slot_mapping)
        for s in batch:
            self.learn(s)
        COUNTS["reserved"] += len(batch)

    @precondition(lambda self: self.tokens)
    @rule(s=seqs, k=st.integers(1, 5))
    def reserve_slots(self, s, k):
        """k slots for one sequence at once (a speculative row), ids to come."""
        if s not in self.tokens:
            return
        length, bl = self.length(s), self.blocks[s]
        copy = length % BLOCK_SIZE != 0 and bl[-1].owners > 1
        need = -(-(length + k) // BLOCK_SIZE) - len(bl) + copy
        if need > self.free_now():
            with pytest.raises(OutOfBlocks):
                self.m.reserve_slots(s, k)
            COUNTS["out_of_blocks"] += 1
            return
        plan = self.m.reserve_slots(s, k)
        assert len(plan.copies) == copy
        if copy:
            old, bl[-1] = bl[-1], self.fresh()
            old.owners -= 1
        while len(bl) * BLOCK_SIZE < length + k:
            bl.append(self.fresh())
        self.pending[s] = self.pending.get(s, 0) + k
        self.execute_reserved(plan.copies, plan.slots)
        self.learn(s)
        COUNTS["reserved"] += k

    @precondition(lambda self: any(self.pending.values()))
    @rule(data=st.data())
    def commit(self, data):
        """The ids of some sequences' oldest pending slots (a sequence may come several
        times: its slots in order); a block they fill is named now."""
        waiting = sorted(s for s, p in self.pending.items() if p)
        group = data.draw(st.lists(st.sampled_from(waiting), min_size=1, unique=True))
        ids = [s for s in group for _ in range(data.draw(st.integers(1, self.pending[s])))]
        new = [data.draw(st.integers(0, 3)) for _ in ids]
        self.m.commit(ids, new)
        for s, t in zip(ids, new):
            self.pending[s] -= 1
            if not self.pending[s]:
                del self.pending[s]
            self.tokens[s].append(t)
            pos = len(self.tokens[s]) - 1
            self.pool.reshape(-1)[self.m.slot(s, pos)] = kv_value(self.tokens[s], pos)
            if len(self.tokens[s]) % BLOCK_SIZE == 0:
                self.cache_full(s)
        COUNTS["committed"] += len(ids)

    @precondition(lambda self: self.tokens)
    @rule(s=seqs, data=st.data())
    def truncate(self, s, data):
        """A rewind: pending slots only (the newest first), or, with none pending, any
        committed tokens; refused, changing nothing, where it must be."""
        if s not in self.tokens:
            return
        known, pending = len(self.tokens[s]), self.pending.get(s, 0)
        low = known if pending and data.draw(st.integers(0, 9)) else 1
        n = data.draw(st.integers(low - (low == 1 and data.draw(st.integers(0, 19)) == 0),
                                  known + pending))   # now and then 0: refused here
        start, held = n // BLOCK_SIZE * BLOCK_SIZE, known // BLOCK_SIZE * BLOCK_SIZE
        deep = start < held and start < n         # into a block whose ids are only hashed
        give = data.draw(st.sampled_from(["ids", "none", "wrong"]))
        tokens = None if give == "none" else self.tokens[s][:n] + [0] * max(n - known, 0)
        wrong = give == "wrong" and held < min(n, known)
        if wrong:
            tokens[held] += 1                     # disagrees with an id the manager holds
        if n == 0 or (pending and n < known) or (deep and tokens is None) or wrong:
            before = self.snapshot(s)
            with pytest.raises(ConfigError):
                self.m.truncate(s, n, tokens)
            assert self.snapshot(s) == before
            COUNTS["truncates refused"] += 1
            return
        self.m.truncate(s, n, tokens)
        keep, bl = -(-n // BLOCK_SIZE), self.blocks[s]
        if deep and bl[n // BLOCK_SIZE].entry is not None:   # cut: it names no more
            del self.index[bl[n // BLOCK_SIZE].entry.key]
            bl[n // BLOCK_SIZE].entry = None
            COUNTS["named blocks cut"] += 1
        self.blocks[s], cut = bl[:keep], bl[keep:]
        if n < known:
            self.tokens[s], self.chain[s] = self.tokens[s][:n], self.chain[s][:n // BLOCK_SIZE]
        elif pending:
            self.pending[s] = n - known
            if not self.pending[s]:
                del self.pending[s]
            COUNTS["pending slots dropped"] += known + pending - n
        for b in reversed(cut):
            self.release(b)
        self.learn(s)
        self.clobber()
        COUNTS["truncates"] += 1

    # ---------------------------------------------------------------- after every step
    @invariant()
    def agrees_with_the_model(self):
        COUNTS["steps"] += 1
        m, cache = self.m, self.m.cache
        m.audit()
        self.swapper.audit()
        assert cache.num_free == self.free_now()
        assert cache.allocator.num_free == self.stack
        assert (cache.hits, cache.evictions) == (self.hits, self.evictions)
        assert list(cache._idle) == [b.real for b in self.idle]
        assert sorted(cache._block_of.values()) == sorted(e.block.real
                                                          for e in self.index.values())
        assert self.host.num_free == self.host_free
        assert sorted(self.swapper.swapped) == sorted(self.parked)
        assert m.pending() == self.pending
        for s, toks in self.tokens.items():     # every live sequence reads its own K/V
            assert m.num_tokens(s) == self.length(s)
            got = self.pool.reshape(-1)[m.slots(s)[:len(toks)]].tolist()
            assert got == [kv_value(toks, t) for t in range(len(toks))], f"{s} reads wrong"
        for key, e in self.index.items():       # and every cached block holds its prefix
            want = [kv_value(key, t) for t in range(len(key) - BLOCK_SIZE, len(key))]
            assert self.pool[0, e.block.real].tolist() == want, f"cached {key} is stale"

    def teardown(self):
        COUNTS["hits"] += self.hits
        COUNTS["evictions"] += self.evictions


class FastPrefixMachine(PrefixMachine):
    def make_manager(self):
        return FastPrefixCachingManager(fast.BlockAllocator(NUM_BLOCKS, BLOCK_SIZE * 8, xp=np),
                                        BLOCK_SIZE, max_seqs=2, max_seq_len=2)


@pytest.mark.parametrize("machine", [PrefixMachine, FastPrefixMachine],
                         ids=["teaching", "fast"])
def test_prefix_cache_against_model(machine):
    COUNTS.update(dict.fromkeys(KEYS, 0))
    print(f"hypothesis: derandomized, {RUNS} runs x {STEPS_PER_RUN} steps; {NUM_BLOCKS} "
          f"blocks of {BLOCK_SIZE} tokens, {HOST_BLOCKS} host blocks")
    run_state_machine_as_test(machine, settings=settings(
        max_examples=RUNS, stateful_step_count=STEPS_PER_RUN, derandomize=True,
        database=None, deadline=None, suppress_health_check=list(HealthCheck)))
    print(f"checked {COUNTS['steps']} states: {COUNTS['hits']} hits, {COUNTS['evictions']} "
          f"evictions, {COUNTS['swaps']} swap-outs, {COUNTS['recomputes']} recompute "
          f"preemptions, {COUNTS['out_of_blocks']} out-of-blocks outcomes; "
          f"{COUNTS['reserved']} slots reserved, {COUNTS['committed']} committed, "
          f"{COUNTS['truncates']} truncations ({COUNTS['truncates refused']} refused, "
          f"{COUNTS['named blocks cut']} named blocks cut, {COUNTS['pending slots dropped']} "
          f"pending slots dropped)")
    assert COUNTS["steps"] >= 10_000
    for key in KEYS:
        assert COUNTS[key] > 0, key
