"""Path equivalence: the teaching core (pagedkv.allocator, pagedkv.manager) and the fast path
(pagedkv.fast) given the same calls return the same results, block ids included, and raise the
same error types; after every call both hold equal state and pass their audits.

The operation streams are random with fixed seeds, printed on failure (rerun one with
``pytest tests/test_equivalence.py -k 'seed7'``). The pools are small, so that running out of
blocks at the edge, forks of partly filled blocks and copy-on-write in batched steps are all
frequent; the tests count them and require each to happen.
"""
import random
from collections import Counter

import numpy as np
import pytest

from pagedkv import allocator, fast, manager
from pagedkv.errors import AllocatorClosed, AuditError, OutOfBlocks, PagedKVError

# What the streams must have met, summed over every test of this module.
MET = Counter()


def outcome(call):
    """("ok", result) or ("error", the error's type); only pagedkv's own errors are expected."""
    try:
        return "ok", call()
    except PagedKVError as exc:
        return "error", type(exc)


def same_result(a, b, where):
    """Equal plans (every array equal, int32), id lists, numbers, or None."""
    assert type(a) is type(b), where
    if isinstance(a, (manager.Plan, manager.StepPlan)):
        for name, x, y in zip(a._fields, a, b):
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype == np.int32, f"{where}: {name} dtype"
                assert x.shape == y.shape and (x == y).all(), f"{where}: {name}\n{x}\n{y}"
            else:
                assert x == y, f"{where}: {name}"
    else:
        assert a == b, where


class Twins:
    """The same calls on a teaching and a fast object; every result compared."""

    def __init__(self, teaching, fast_one, seed):
        self.t, self.f, self.seed = teaching, fast_one, seed
        self.calls = []

    def __call__(self, name, *args):
        self.calls.append(f"{name}{args!r}")
        where = f"seed {self.seed}, call {len(self.calls)}: {self.calls[-1]}"
        a = outcome(lambda: getattr(self.t, name)(*args))
        b = outcome(lambda: getattr(self.f, name)(*args))
        assert a[0] == b[0], f"{where}: teaching {a}, fast {b}"
        if a[0] == "error":
            assert a[1] is b[1], f"{where}: teaching raised {a[1]}, fast {b[1]}"
            MET[f"error {a[1].__name__}"] += 1
        else:
            same_result(a[1], b[1], where)
        return a


# ---------------------------------------------------------------------- the allocators
def same_allocators(t, f, where):
    assert f.free_blocks() == t.free_blocks(), where
    assert f.refcounts().tolist() == t.refcounts().tolist(), where
    assert f.num_shared == t.num_shared == int((t.refcounts() > 1).sum()), where
    assert f.num_used == t.num_used, where
    if t.closed:                               # a closed pool has no free blocks to count
        for a in (t, f):
            with pytest.raises(AllocatorClosed):
                a.num_free
    else:
        assert f.num_free == t.num_free, where
    for a in (t, f) if not t.closed else ():
        try:
            a.audit()
        except AuditError as exc:
            raise AssertionError(f"{where}: {type(a).__module__} audit: {exc}") from None


ALLOCATOR_SEEDS = range(12)


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in ALLOCATOR_SEEDS])
def test_allocators_agree_on_random_calls(seed):
    print(f"seed {seed}")
    allocator_stream(seed)


def allocator_stream(seed):
    rng = random.Random(seed)
    n = rng.choice([1, 5, 16, 70])             # 70: more than one refill of the hot list
    twins = Twins(allocator.BlockAllocator(n, 64), fast.BlockAllocator(n, 64), seed)
    for i in range(400):
        used = [b for b in range(n) if twins.t.refcount(b)]
        some = lambda: rng.choice(used) if used and rng.random() < 0.9 else rng.randrange(n)
        op = rng.randrange(10)
        if op == 0:
            twins("allocate")
        elif op == 1:
            twins("allocate_n", rng.randrange(n + 2))
        elif op == 2:
            twins("free", some())
        elif op == 3:                          # repeated ids, and numpy arrays
            blocks = [some() for _ in range(rng.randrange(6))]
            MET["free_n with a repeated id"] += len(set(blocks)) < len(blocks)
            twins("free_n", np.array(blocks, dtype=np.int32) if rng.random() < 0.3 else blocks)
        elif op == 4:
            twins("share", some())
        elif op == 5:
            twins("share_n", [some() for _ in range(rng.randrange(4))], rng.randrange(1, 4))
        elif op == 6:
            twins("refcount", some())
        elif op == 7:                          # numpy integer ids take the checking paths
            twins("free", np.int64(some()))
        elif op == 8:                          # a fast free of a batch-taken block, and back
            got = twins("allocate_n", rng.randrange(3))
            if got[0] == "ok" and got[1]:
                twins("free_n", got[1][::-1])
        else:
            twins("free", rng.choice([-1, -n - 1, n, 2 * n, 1.0, True, None]))
        same_allocators(twins.t, twins.f, f"seed {seed}, call {i}: {twins.calls[-1]}")
    twins("close")
    for call in (("allocate",), ("allocate_n", 1), ("free", 0), ("free_n", [0]),
                 ("share", 0), ("share_n", [0]), ("refcount", 0), ("audit",)):
        twins(*call)
    same_allocators(twins.t, twins.f, f"seed {seed}, after close")


# ---------------------------------------------------------------------- the managers
def same_managers(t, f, where):
    """Equal sequences, tables, lengths, stats, free stacks and counts; both audits pass."""
    for m in (t, f):
        try:
            m.audit()
        except AuditError as exc:
            raise AssertionError(f"{where}: {type(m).__module__} audit: {exc}") from None
    assert sorted(map(repr, f.seq_ids)) == sorted(map(repr, t.seq_ids)), where
    for s in t.seq_ids:
        assert f.block_table(s).tolist() == t.block_table(s).tolist(), f"{where}: {s!r}"
        assert f.num_tokens(s) == t.num_tokens(s), f"{where}: {s!r}"
        assert f.slots(s).tolist() == t.slots(s).tolist(), f"{where}: {s!r}"
    assert f.stats() == t.stats(), where
    assert f.allocator.free_blocks() == t.allocator.free_blocks(), where
    assert f.allocator.refcounts().tolist() == t.allocator.refcounts().tolist(), where
    assert f.allocator.num_shared == t.allocator.num_shared == f.stats().shared_blocks, where


def make_twins(seed, num_blocks, block_size, small_batch):
    t = manager.KVCacheManager(allocator.BlockAllocator(num_blocks, block_size * 4), block_size)
    f = fast.KVCacheManager(fast.BlockAllocator(num_blocks, block_size * 4), block_size,
                            max_seqs=2, max_seq_len=block_size)   # small: the arrays must grow
    f.small_batch = small_batch
    return Twins(t, f, seed)


def random_manager_call(twins, rng, names, last_fork):
    """One random call on both managers; returns the children of a fork, if it made one."""
    t, bs = twins.t, twins.t.block_size
    live = t.seq_ids
    pick = lambda: rng.choice(live) if live and rng.random() < 0.95 else "nobody"
    op = rng.randrange(15)
    if op <= 1 or not live:
        twins("add", next(names), rng.choice([0, 1, bs - 1, bs, bs + 1, 3 * bs, 9 * bs]))
    elif op == 2:
        twins("append", pick(), rng.choice([1, 1, 2, bs, 2 * bs + 1]))
    elif op <= 5:                              # a batch in random order, often with forks
        batch = rng.sample(live, rng.randint(1, len(live)))
        if last_fork and rng.random() < 0.7:   # the parent and its children in one batch
            batch = [s for s in batch if s not in last_fork] + \
                [s for s in last_fork if s in live]
            rng.shuffle(batch)
        got = twins("step", batch)
        if got[0] == "ok":
            MET["step"] += 1
            MET["step with copy-on-write copies"] += len(got[1].copies) > 0
            MET["one block copied by several rows of a step"] += \
                len(got[1].copies) > len(set(got[1].copies[:, 0].tolist()))
    elif op == 6:                              # everyone, in the teaching manager's order
        twins("step", t.seq_ids)
    elif op == 7:
        parent = pick()
        children = [next(names) for _ in range(rng.randint(1, 3))]
        got = twins("fork", parent, *children)
        if got[0] == "ok":
            MET["fork of a partly filled block"] += t.num_tokens(parent) % bs != 0
            return [parent, *children]
    elif op == 8:
        twins("free", pick())
    elif op == 9:
        twins(rng.choice(["blocks_needed", "can_append"]), pick(), rng.randint(1, 2 * bs))
    elif op >= 13:                             # a rewind, often of a fork, to any length
        s = rng.choice(last_fork) if last_fork and rng.random() < 0.5 else pick()
        length = t.num_tokens(s) if s in t else 0
        n = rng.choice([0, length, max(length - 1, 0), rng.randint(0, length),
                        rng.randint(0, length), length + 1, -1])
        shared = s in t and 0 <= n <= length and n % bs and \
            t.allocator.refcount(t.block_table(s)[-(-n // bs) - 1]) > 1
        if twins("truncate", s, n)[0] == "ok":
            MET["truncate"] += 1
            MET["truncate into a shared block"] += bool(shared)
    else:                                      # misuse: each call must raise the same error
        s = pick()
        call = rng.choice([("add", s), ("step", [s, s]), ("step", [s, "nobody"]),
                           ("fork", s, s), ("fork", s, "x", "x"), ("fork", s),
                           ("append", s, 0), ("add", [1], 1), ("free", "nobody"),
                           ("truncate", "nobody", 0), ("truncate", s, 1.5)])
        twins(*call)
    return None


MANAGER_SEEDS, SMALL_BATCHES = range(10), (fast.KVCacheManager.small_batch, 0, 10**9)


@pytest.mark.parametrize("small_batch", SMALL_BATCHES,
                         ids=["default", "numpy-steps", "python-steps"])
@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed{s}") for s in MANAGER_SEEDS])
def test_managers_agree_on_random_calls(seed, small_batch):
    print(f"seed {seed}, small_batch {small_batch}")
    manager_stream(seed, small_batch)


def manager_stream(seed, small_batch):
    rng = random.Random(seed)
    bs = rng.choice([1, 3, 4, 16])
    twins = make_twins(seed, rng.choice([6, 12, 24, 48]), bs, small_batch)
    names = (f"s{i}" for i in range(10**6))
    last_fork = None
    for i in range(300):
        last_fork = random_manager_call(twins, rng, names, last_fork) or last_fork
        same_managers(twins.t, twins.f, f"seed {seed}, call {i}: {twins.calls[-1]}")


def test_every_situation_was_met():
    """The random streams above must have produced what they are meant to test (run alone,
    this test runs them first)."""
    if not MET:
        for seed in ALLOCATOR_SEEDS:
            allocator_stream(seed)
        for seed in MANAGER_SEEDS:
            for small_batch in SMALL_BATCHES:
                manager_stream(seed, small_batch)
    for what in ("free_n with a repeated id", "step with copy-on-write copies",
                 "one block copied by several rows of a step", "fork of a partly filled block",
                 "error OutOfBlocks", "error InvalidBlock", "error DoubleFree",
                 "error DuplicateSequence", "error SequenceExists", "error UnknownSequence",
                 "error AllocatorClosed", "error ConfigError", "error TokenIndexError",
                 "truncate", "truncate into a shared block"):
        assert MET[what] > 0, f"never met: {what} ({dict(MET)})"


# ---------------------------------------------------------------------- chosen cases
def test_children_of_a_partly_filled_block_step_together():
    """Three children and their parent share a 2-token block; all four step in one batch:
    the first three sharers copy (in batch order), the last writes in place. Then the same
    on the NumPy path, with a second generation of forks."""
    for small_batch in (fast.KVCacheManager.small_batch, 0):
        twins = make_twins("chosen", 12, 4, small_batch)
        twins("add", "p", 6)                       # blocks 0 (full) and 1 (2 tokens)
        twins("fork", "p", "c1", "c2", "c3")
        got = twins("step", ["c2", "p", "c3", "c1"])
        assert got[0] == "ok" and got[1].copies.tolist() == [[1, 2], [1, 3], [1, 4]]
        assert got[1].block_tables[:, 1].tolist() == [2, 3, 4, 1]
        same_managers(twins.t, twins.f, "after the first step")
        twins("fork", "c1", "d1", "d2")
        got = twins("step", ["d2", "c2", "d1"])    # d1, d2 and c1 share a block: 2 copies
        assert got[0] == "ok" and len(got[1].copies) == 2
        same_managers(twins.t, twins.f, "after the second step")


def test_out_of_blocks_at_the_edge_changes_nothing():
    """A step that needs one block more than is free fails on both and changes nothing; the
    same step less one row fits exactly."""
    for small_batch in (fast.KVCacheManager.small_batch, 0):
        twins = make_twins("edge", 6, 4, small_batch)
        twins("add", "a", 4)                       # 1 block, full
        twins("add", "b", 6)                       # 2 blocks, the last partly filled
        twins("fork", "b", "c")                    # b and c share it
        twins("add", "d", 5)                       # 2 blocks: 1 free
        got = twins("step", ["a", "b", "c"])       # a new block for a, a copy for b: 2
        assert got == ("error", OutOfBlocks)
        same_managers(twins.t, twins.f, "after the failed step")
        assert twins("step", ["b", "c"])[0] == "ok"   # one copy: fits exactly
        same_managers(twins.t, twins.f, "after the step that fits")
        assert twins.t.allocator.num_free == 0


@pytest.mark.parametrize("impl", ["teaching", "fast"])
def test_step_without_ids_is_step_over_seq_ids(impl):
    """``step()`` is ``step(m.seq_ids)``: two managers built alike, one stepped each way."""
    def build():
        if impl == "teaching":
            m = manager.KVCacheManager(allocator.BlockAllocator(400, 64), 4)
        else:
            m = fast.KVCacheManager(fast.BlockAllocator(400, 64), 4)
        for s in range(30):
            m.add(s, s % 9)
        m.fork(3, "x", "y")
        m.fork(8, "z")
        for s in (0, 5, 17):                   # holes in the rows
            m.free(s)
        return m

    for before in range(6):                    # through block boundaries and copies
        a, b = build(), build()
        for _ in range(before):
            a.step()
            b.step(b.seq_ids)
        pa, pb = a.step(), b.step(b.seq_ids)
        same_result(pa, pb, f"{impl}, after {before} steps")
        assert a.allocator.free_blocks() == b.allocator.free_blocks()
        a.audit()
        b.audit()
