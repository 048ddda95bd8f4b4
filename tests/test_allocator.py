import random
import re
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import (AllocatorClosed, AuditError, ConfigError, DoubleFree, InvalidBlock,
                            OutOfBlocks, PagedKVError, PoolTooLarge)
from pagedkv.kernels.pattern import verify_pattern, write_pattern

from _backends import XP_PARAMS, host, resolve


@pytest.fixture(params=XP_PARAMS)
def xp(request):
    return resolve(request.param)


def test_pool_is_exactly_blocks_times_block_bytes(xp):
    with BlockAllocator(10, 96, xp=xp) as a:
        assert a.pool.nbytes == a.pool_bytes == 10 * 96
        assert a.pool.dtype == np.uint8 and a.pool.ndim == 1
        assert a.num_free == 10 and a.num_used == 0
        a.audit()


@pytest.mark.parametrize("args", [(0, 8), (-1, 8), (4, 0), (4, -8), (2.5, 8), (True, 8), (4, "8")])
def test_bad_sizes(args):
    with pytest.raises(ConfigError):
        BlockAllocator(*args, xp=np)


def test_a_pool_larger_than_memory_is_a_typed_error():
    with pytest.raises(PoolTooLarge, match=r"cannot claim a pool of 1,125,899,906,842,624 bytes"):
        BlockAllocator(2**30, 2**20, xp=np)                 # a pebibyte of host memory


def test_allocate_and_free_are_lifo():
    a = BlockAllocator(6, 8, xp=np)
    got = [a.allocate() for _ in range(4)]
    assert got == [0, 1, 2, 3]
    a.free(2)
    a.free(0)
    assert a.allocate() == 0 and a.allocate() == 2
    assert a.allocate_n(2) == [4, 5]
    a.audit()


def test_free_list_restored_after_freeing_everything():
    a = BlockAllocator(8, 8, xp=np)
    before = a.free_blocks()
    blocks = a.allocate_n(5)
    for b in reversed(blocks):
        a.free(b)
    assert a.free_blocks() == before
    a.audit()


def test_out_of_blocks_changes_nothing():
    a = BlockAllocator(3, 8, xp=np)
    a.allocate_n(2)
    state = (a.free_blocks(), a.refcounts().tolist())
    with pytest.raises(OutOfBlocks) as info:
        a.allocate_n(2)
    assert info.value.needed == 2 and info.value.free == 1
    assert isinstance(info.value, PagedKVError)
    assert (a.free_blocks(), a.refcounts().tolist()) == state
    a.allocate()
    with pytest.raises(OutOfBlocks, match="needs 1 free block"):
        a.allocate()
    a.audit()


def test_misuse_raises_typed_errors():
    a = BlockAllocator(4, 8, xp=np)
    b = a.allocate()
    a.free(b)
    with pytest.raises(DoubleFree, match="already free"):
        a.free(b)
    for bad in (4, -1, 100, -100):
        with pytest.raises(InvalidBlock, match="outside the pool"):
            a.free(bad)
    for bad in (1.0, "1", None, True):
        with pytest.raises(InvalidBlock, match="integer"):
            a.free(bad)
    with pytest.raises(InvalidBlock, match="it is free"):
        a.share(3)
    with pytest.raises(ConfigError):
        a.allocate_n(-1)
    a.audit()


def test_numpy_integer_ids_are_accepted():
    a = BlockAllocator(4, 8, xp=np)
    b = a.allocate()
    a.free(np.int64(b))
    assert a.num_free == 4 and all(type(x) is int for x in a.free_blocks())
    a.audit()


def test_refcounts_share_and_release():
    a = BlockAllocator(4, 8, xp=np)
    b = a.allocate()
    a.share(b)
    a.share_n([b], times=2)
    assert a.refcount(b) == 4
    for left in (3, 2, 1):
        a.free(b)
        assert a.refcount(b) == left and a.num_free == 3
    a.free(b)
    assert a.refcount(b) == 0 and a.num_free == 4
    a.audit()


def test_free_n_and_share_n_are_all_or_nothing():
    a = BlockAllocator(4, 8, xp=np)
    x, y = a.allocate_n(2)
    with pytest.raises(DoubleFree):
        a.free_n([x, y, y])
    assert a.refcount(x) == 1 and a.refcount(y) == 1
    with pytest.raises(InvalidBlock):
        a.share_n([x, 3])
    assert a.refcount(x) == 1
    with pytest.raises(InvalidBlock):
        a.free_n([x, 99])
    a.free_n([x, y])
    assert a.num_free == 4
    a.audit()


def test_views_and_addresses(xp):
    a = BlockAllocator(5, 64, xp=xp)
    b = a.allocate_n(3)[2]
    view = a.block_view(b)
    view[:] = 7
    pool = host(a.pool)
    assert (pool[b * 64:(b + 1) * 64] == 7).all()
    assert a.block_address(b) - a.block_address(0) == b * 64
    kv = a.view(np.float16, (2, 4, 1, 4))
    assert kv.shape == (5, 2, 4, 1, 4)
    with pytest.raises(ConfigError, match="64 bytes"):
        a.view(np.float32, (2, 4, 1, 4))


def test_pattern_proves_blocks_are_writable(xp):
    with BlockAllocator(16, 256, xp=xp) as a:
        a.pool[:] = 0
        blocks = [a.allocate() for _ in range(5)]
        write_pattern(a, blocks, seed=7)
        assert verify_pattern(a, blocks, seed=7) == 0
        assert verify_pattern(a, blocks, seed=8) > 0          # another seed reads wrong
        untouched = [b for b in range(16) if b not in blocks]
        assert verify_pattern(a, untouched, seed=7) == 64 * len(untouched)
        a.block_view(blocks[3])[10] ^= 0xFF                    # one corrupted byte
        assert verify_pattern(a, blocks, seed=7) == 1


def test_close_returns_the_memory(xp):
    if xp is np:
        a = BlockAllocator(4, 8, xp=np)
        a.close()
        assert a.closed and a.pool is None
    else:
        xp.cuda.Device().synchronize()
        free_before, _ = xp.cuda.runtime.memGetInfo()
        nbytes = 256 << 20
        a = BlockAllocator(256, 1 << 20, xp=xp)
        free_during, _ = xp.cuda.runtime.memGetInfo()
        assert free_before - free_during >= nbytes
        a.close()
        free_after, _ = xp.cuda.runtime.memGetInfo()
        assert abs(free_after - free_before) < (2 << 20), (free_before, free_after)
    for call in (a.allocate, lambda: a.allocate_n(1), lambda: a.block_view(0), a.audit,
                 lambda: a.free(0), lambda: a.share_n([0]), lambda: a.free_n([])):
        with pytest.raises(AllocatorClosed, match="closed"):
            call()


N_BLOCKS = 40
BAD_IDS = ([-k for k in range(1, 2 * N_BLOCKS + 1)] + [N_BLOCKS, N_BLOCKS + 1, 10**6, 2.0, 3.5,
           "3", True, False, None, np.float64(2), np.bool_(True), [1]])


@pytest.mark.parametrize("bad", BAD_IDS, ids=repr)
def test_every_bad_id_is_refused_and_changes_nothing(bad):
    """With 4 blocks allocated, -5 once freed block 3 and was later handed out as a block id
    (a guard array covered only -1 .. -n); no bad id may reach the state."""
    a = BlockAllocator(N_BLOCKS, 8, xp=np)
    held = a.allocate_n(4)
    a.share(held[0])
    before = (a.free_blocks(), a.refcounts().tolist())
    for call in (lambda: a.free(bad), lambda: a.share(bad), lambda: a.free_n([held[1], bad]),
                 lambda: a.share_n([held[2], bad]), lambda: a.free_n([bad])):
        with pytest.raises(InvalidBlock):
            call()
        assert (a.free_blocks(), a.refcounts().tolist()) == before
    a.audit()
    assert [a.allocate() for _ in range(N_BLOCKS - 4)] == list(range(4, N_BLOCKS))


def test_numpy_integers_of_every_width_are_ids():
    a = BlockAllocator(8, 8, xp=np)
    for kind in (np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32, np.uint64):
        b = a.allocate()
        a.share(kind(b))
        a.free_n([kind(b)])
        a.free(kind(b))
    assert a.num_free == 8 and all(type(x) is int for x in a.free_blocks())
    a.audit()


def test_randomized_against_a_model():
    """Random single and batched calls, each checked against a model that knows only owner
    counts and the stack rule (the next block out is the last one put back), with the audit
    after every call. Failing calls must change nothing."""
    seed = 20261130
    print(f"seed={seed}")
    rng = random.Random(seed)
    nb = 24
    a = BlockAllocator(nb, 8, xp=np)
    stack = list(range(nb - 1, -1, -1))        # the model's free stack, top last
    owners: dict[int, int] = {}                # block -> owners; absent = free
    seen = dict.fromkeys(["allocate", "allocate_n", "share", "share_n", "free", "free_n",
                          "out_of_blocks", "double_free", "invalid"], 0)

    def drop(blocks):
        for b in blocks:
            owners[b] -= 1
            if not owners[b]:
                del owners[b]
                stack.append(b)

    def refused(error, call):
        state = (a.free_blocks(), a.refcounts().tolist())
        with pytest.raises(error):
            call()
        assert (a.free_blocks(), a.refcounts().tolist()) == state

    for _ in range(6000):
        op, live = rng.random(), sorted(owners)
        if op < 0.2:
            if stack:
                b = a.allocate()
                assert b == stack.pop()
                owners[b] = 1
                seen["allocate"] += 1
            else:
                refused(OutOfBlocks, a.allocate)
                seen["out_of_blocks"] += 1
        elif op < 0.35:
            n = rng.randrange(0, 7)
            if n <= len(stack):
                got = a.allocate_n(n)
                assert got == [stack.pop() for _ in range(n)]
                owners.update(dict.fromkeys(got, 1))
                seen["allocate_n"] += 1
            else:
                refused(OutOfBlocks, lambda: a.allocate_n(n))
                seen["out_of_blocks"] += 1
        elif op < 0.45 and live:
            blocks = rng.sample(live, k=min(len(live), rng.randrange(1, 4)))
            times = rng.randrange(1, 3)
            if len(blocks) == 1 and times == 1:
                a.share(blocks[0])
                seen["share"] += 1
            else:
                a.share_n(blocks, times=times)
                seen["share_n"] += 1
            for b in blocks:
                owners[b] += times
        elif op < 0.7 and live:
            b = rng.choice(live)
            a.free(b)
            drop([b])
            seen["free"] += 1
        elif op < 0.88 and live:
            blocks = rng.sample(live, k=min(len(live), rng.randrange(1, 5)))
            if rng.random() < 0.3:             # name a block twice: legal if it has 2 owners
                blocks.append(blocks[0])
            if all(blocks.count(b) <= owners[b] for b in blocks):
                a.free_n(blocks)
                drop(blocks)
                seen["free_n"] += 1
            else:
                refused(DoubleFree, lambda: a.free_n(blocks))
                seen["double_free"] += 1
        else:
            b = rng.randrange(-nb, 2 * nb)
            if not 0 <= b < nb:
                refused(InvalidBlock, lambda: a.free(b))
                seen["invalid"] += 1
            elif b not in owners:
                refused(DoubleFree, lambda: a.free(b))
                refused(InvalidBlock, lambda: a.share_n([b]))
                seen["double_free"] += 1
        assert a.free_blocks() == stack
        assert a.num_used == len(owners) and a.num_free == len(stack)
        assert a.refcounts().tolist() == [owners.get(b, 0) for b in range(nb)]
        a.audit()
    print(seen)
    assert min(seen.values()) > 50             # every path ran, many times


CORRUPTIONS = {
    "a block is on the free stack twice": lambda a: a._free.append(a._free[-1]),
    "has 0 owner(s) but is not on the free stack": lambda a: a._free.pop(),
    "has 1 owner(s) but is on the free stack": lambda a: a._refcount.__setitem__(a._free[0], 1),
    "an id outside the pool": lambda a: a._free.append(-5),
    "non-negative integer": lambda a: a._refcount.__setitem__(0, -1),
}


@pytest.mark.parametrize("message", CORRUPTIONS)
def test_audit_names_the_broken_invariant(message):
    a = BlockAllocator(6, 8, xp=np)
    a.allocate_n(2)
    a.audit()
    CORRUPTIONS[message](a)
    with pytest.raises(AuditError, match=re.escape(message)):
        a.audit()


def test_audit_works_under_python_O():
    """audit() raises AuditError, not assert: under python -O it must still catch corruption."""
    code = ("import numpy as np\n"
            "from pagedkv.allocator import BlockAllocator\n"
            "from pagedkv.errors import AuditError\n"
            "assert False, 'asserts are on'\n"
            "a = BlockAllocator(4, 8, xp=np); a.allocate(); a._free.append(0)\n"
            "try:\n    a.audit()\nexcept AuditError as e:\n    print('caught:', e)\n")
    run = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "caught: block 0 has 1 owner(s) but is on the free stack" in run.stdout
