"""Bad input on both allocators, corrupted state caught under ``python -O``, and what only the
fast allocator has (its one-block path, its closing)."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from pagedkv import allocator, fast
from pagedkv.errors import AllocatorClosed, ConfigError, DoubleFree, InvalidBlock, OutOfBlocks

IMPLS = [pytest.param(allocator.BlockAllocator, id="teaching"),
         pytest.param(fast.BlockAllocator, id="fast")]
N = 40


def bad_ids(n=N):
    """Every id that names no block of an ``n``-block pool, of every kind."""
    return [*range(-1, -2 * n - 1, -1), n, n + 1, 10**6, 2**63, 2.0, 0.0, True, False, None,
            "1", np.float64(1.0), np.bool_(True), np.int64(-1), np.int32(n), np.uint64(2**64 - 1)]


def state(a):
    return a.free_blocks(), a.refcounts().tolist(), a.num_free


def four_allocated(make, how):
    """A pool of N blocks with blocks 0..3 taken: one at a time (the fast allocator's list
    path), all at once (its NumPy path), or shared (counts of 2)."""
    a = make(N, 64, xp=np)
    if how == "one at a time":
        got = [a.allocate() for _ in range(4)]
    else:
        got = a.allocate_n(4)
    if how == "shared":
        a.share_n(got)
    assert got == [0, 1, 2, 3]
    return a


@pytest.mark.parametrize("how", ["one at a time", "all at once", "shared"])
@pytest.mark.parametrize("op", ["free", "share", "free_n", "share_n", "refcount"])
@pytest.mark.parametrize("make", IMPLS)
def test_every_bad_id_raises_and_changes_nothing(make, op, how):
    a = four_allocated(make, how)
    before = state(a)
    call = getattr(a, op)
    for bad in bad_ids():
        args = [[bad], [0, bad], [bad, 0]] if op.endswith("_n") else [bad]
        for arg in args:
            with pytest.raises(InvalidBlock):
                call(arg)
            assert state(a) == before, f"{op}({arg!r}) changed the allocator"
    a.audit()
    got = [a.allocate() for _ in range(N - 4)]             # every id handed out is real
    assert sorted(got) == list(range(4, N))


@pytest.mark.parametrize("make", IMPLS)
def test_a_negative_id_never_frees_another_block(make):
    """With 4 blocks taken, free(-5) once freed block 3 (a list index wraps around) and put
    -5 on the free stack, for allocate() to hand out."""
    a = make(4, 64, xp=np)
    [a.allocate() for _ in range(4)]
    for bad in (-5, -1, -4, -8):
        with pytest.raises(InvalidBlock):
            a.free(bad)
    assert a.refcounts().tolist() == [1, 1, 1, 1] and a.num_free == 0
    a.free(3)
    assert a.allocate() == 3


@pytest.mark.parametrize("make", IMPLS)
def test_double_frees_and_free_shares(make):
    a = make(8, 64, xp=np)
    b = a.allocate()
    c, d = a.allocate_n(2)
    a.free(b)
    before = state(a)
    for call in (lambda: a.free(b), lambda: a.free_n([c, b]), lambda: a.free_n([c, c]),
                 lambda: a.free_n(np.array([d, d]))):
        with pytest.raises(DoubleFree):
            call()
        assert state(a) == before
    with pytest.raises(InvalidBlock, match="free"):
        a.share(b)
    with pytest.raises(InvalidBlock, match="free"):
        a.share_n([c, b])
    assert state(a) == before
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ConfigError):
            a.share_n([c], times=bad)
        with pytest.raises(ConfigError):
            a.allocate_n(bad if bad != 0 else -1)
    with pytest.raises(OutOfBlocks):
        a.allocate_n(a.num_free + 1)
    assert state(a) == before
    a.audit()


@pytest.mark.parametrize("make", IMPLS)
def test_closed_allocator(make):
    a = make(8, 64, xp=np)
    solo, (bulk,) = a.allocate(), a.allocate_n(1)
    before = state(a)
    a.close()
    assert a.closed and state(a) == before                # still readable
    for call in (a.allocate, lambda: a.allocate_n(1), lambda: a.free(solo),
                 lambda: a.free(bulk), lambda: a.share(solo), lambda: a.free_n([bulk]),
                 lambda: a.share_n([solo]), lambda: a.refcount(0), a.audit,
                 lambda: a.view(np.uint8, (64,)), lambda: a.block_view(0)):
        with pytest.raises(AllocatorClosed):
            call()
    assert state(a) == before


@pytest.mark.parametrize("args", [(0, 64), (8, 0), (-1, 64), (2.0, 64), (True, 64), (8, None)])
def test_bad_sizes(args):
    with pytest.raises(ConfigError):
        fast.BlockAllocator(*args)


def test_one_block_path_and_batches_mix():
    """Blocks taken one at a time (counted in a list) and in batches (in NumPy) share one
    stack and one set of counts: ``free_n``, ``share_n`` and ``refcounts`` see both."""
    a = fast.BlockAllocator(200, 64, xp=np)
    one = [a.allocate() for _ in range(70)]               # past one refill of the hot list
    many = a.allocate_n(5)
    assert one == list(range(70)) and many == list(range(70, 75))
    a.share_n([one[0], many[0]], times=2)
    assert a.refcount(one[0]) == a.refcount(many[0]) == 3 and a.refcount(one[1]) == 1
    a.free_n([one[1], many[1]])
    a.free(one[2])
    assert a.free_blocks()[-3:] == [1, 71, 2]
    assert a.allocate_n(3) == [2, 71, 1]
    assert a.refcounts()[[0, 3, 70, 75]].tolist() == [3, 1, 3, 0]
    a.audit()


CORRUPTIONS = {
    "teaching": [
        "a._refcount[2] = 0",                             # used, but not on the stack
        "a._free.append(2)",                              # on the stack twice
        "a._free[0] = -3",
        "m._tables['s'].blocks[0] = 9",                   # a count that no table explains
        "m._tables['s'].num_tokens = 40",
    ],
    "fast": [
        "a._ref[2] = 0",
        "a._hot.append(2)",
        "a._stack[0] = -3",
        "a._solo[3] = 4",
        "a._bulk_used += 1",
        "m._tables[0, 0] = 9",
        "m._lens[0] = 40",
        "m._cow[1] = False",                              # a shared partial block, unflagged
        "m._longest = 1",
    ],
}


@pytest.mark.parametrize("impl,corrupt", [(impl, c) for impl, cs in CORRUPTIONS.items()
                                          for c in cs])
def test_audit_catches_corruption_under_python_O(impl, corrupt):
    """``audit`` raises AuditError even with assertions compiled out (``python -O``)."""
    pkg = "pagedkv.fast" if impl == "fast" else "pagedkv"
    alloc_mod = "pagedkv.fast" if impl == "fast" else "pagedkv.allocator"
    mgr_mod = "pagedkv.fast" if impl == "fast" else "pagedkv.manager"
    script = textwrap.dedent(f"""
        import numpy as np
        from {alloc_mod} import BlockAllocator
        from {mgr_mod} import KVCacheManager
        from pagedkv.errors import AuditError
        assert False, "assertions must be off"
        m = KVCacheManager(BlockAllocator(16, 64, xp=np), 4)
        a = m.allocator
        m.add("s", 6)
        m.fork("s", "t")
        m.add("u", 9)
        m.audit()
        {corrupt}
        try:
            m.audit()
        except AuditError as exc:
            print("caught:", exc)
        else:
            print("NOT CAUGHT")
    """)
    out = subprocess.run([sys.executable, "-O", "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("caught:"), f"{pkg}: {corrupt!r} was not caught: {out.stdout}"
