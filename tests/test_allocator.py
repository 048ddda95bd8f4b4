import random

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.allocator import BlockAllocator
from pagedkv.errors import ConfigError, DoubleFree, InvalidBlock, OutOfBlocks, PagedKVError
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


def test_from_pool_bytes_takes_whole_blocks(xp):
    a = BlockAllocator.from_pool_bytes(1000, 96, xp=xp)
    assert a.num_blocks == 10 and a.pool.nbytes == 960


@pytest.mark.parametrize("args", [(0, 8), (-1, 8), (4, 0), (4, -8), (2.5, 8), (True, 8), (4, "8")])
def test_bad_sizes(args):
    with pytest.raises(ConfigError):
        BlockAllocator(*args, xp=np)


def test_pool_too_small_for_one_block():
    with pytest.raises(ConfigError, match="cannot hold one block"):
        BlockAllocator.from_pool_bytes(100, 128, xp=np)


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
    for call in (a.allocate, lambda: a.allocate_n(1), lambda: a.block_view(0), a.audit):
        with pytest.raises(ConfigError, match="closed"):
            call()


def test_randomized_against_a_list_model():
    """Every call, single and batched, against a model that is one Python list used as the free
    stack plus a dict of owner counts: the allocator must hand out the same ids in the same
    order, though it keeps its stack in two parts and its counts in two places."""
    seed = 20261129
    print(f"seed={seed}")
    rng = random.Random(seed)
    nb = 40
    class SmallRefill(BlockAllocator):
        REFILL = 5                             # small, so refills happen often
    a = SmallRefill(nb, 8, xp=np)
    stack = list(range(nb - 1, -1, -1))        # the model's free stack, top last
    owners: dict[int, int] = {}                # block -> owners; absent = free
    seen = {"refill": 0, "batch_free": 0, "released_by_batch": 0, "dup_free_n": 0}

    def drop(blocks):                          # the model's free_n
        for b in blocks:
            owners[b] -= 1
            if not owners[b]:
                del owners[b]
                stack.append(b)

    for _ in range(30_000):
        op = rng.random()
        if op < 0.25:
            if stack:
                if not a._hot:
                    seen["refill"] += 1
                b = a.allocate()
                assert b == stack.pop()
                owners[b] = 1
            else:
                with pytest.raises(OutOfBlocks):
                    a.allocate()
        elif op < 0.37:
            n = rng.randrange(0, 7)
            as_array = rng.random() < 0.5
            if n <= len(stack):
                got = a.allocate_array(n) if as_array else a.allocate_n(n)
                if as_array:
                    assert got.dtype == np.int32
                    got = got.tolist()
                want = [stack.pop() for _ in range(n)]
                assert got == want
                owners.update(dict.fromkeys(want, 1))
            else:
                with pytest.raises(OutOfBlocks):
                    a.allocate_n(n)
        elif op < 0.45 and owners:
            b = rng.choice(sorted(owners))
            a.share(b)
            owners[b] += 1
        elif op < 0.52 and owners:
            blocks = rng.sample(sorted(owners), k=min(len(owners), rng.randrange(1, 4)))
            times = rng.randrange(1, 3)
            a.share_n(np.array(blocks) if rng.random() < 0.5 else blocks, times=times)
            for b in blocks:
                owners[b] += times
        elif op < 0.80 and owners:
            b = rng.choice(sorted(owners))
            a.free(b if rng.random() < 0.9 else np.int64(b))
            drop([b])
        elif op < 0.92 and owners:
            pool = sorted(owners)
            blocks = rng.sample(pool, k=min(len(pool), rng.randrange(1, 5)))
            if rng.random() < 0.3:             # name a block twice: legal if it has 2 owners
                blocks.append(blocks[0])
            if all(blocks.count(b) <= owners[b] for b in blocks):
                before = len(stack)
                a.free_n(np.array(blocks) if rng.random() < 0.5 else blocks)
                drop(blocks)
                seen["batch_free"] += 1
                seen["released_by_batch"] += len(stack) - before
                seen["dup_free_n"] += len(set(blocks)) < len(blocks)
            else:
                snapshot = (a.free_blocks(), a.refcounts().tolist())
                with pytest.raises(DoubleFree):
                    a.free_n(blocks)
                assert (a.free_blocks(), a.refcounts().tolist()) == snapshot
        else:
            b = rng.randrange(nb)
            if b not in owners:
                with pytest.raises(DoubleFree):
                    a.free(b)
                with pytest.raises(InvalidBlock):
                    a.share_n([b])
        assert a.free_blocks() == stack
        assert a.num_used == len(owners) and a.num_free == len(stack)
        counts = a.refcounts()
        assert all(counts[b] == owners.get(b, 0) for b in range(nb))
        a.audit()
    print(seen)
    assert min(seen.values()) > 50             # every path was exercised, many times


@pytest.mark.parametrize("bad", [-1, -41, 40, 10**6, 2.0, "3", True, None])
def test_free_rejects_bad_ids_without_changing_anything(bad):
    a = BlockAllocator(40, 8, xp=np)
    held = [a.allocate() for _ in range(3)] + a.allocate_n(3)
    before = (a.free_blocks(), a.refcounts().tolist())
    with pytest.raises(InvalidBlock):
        a.free(bad)
    with pytest.raises(InvalidBlock):
        a.free_n([held[0], bad])
    with pytest.raises(InvalidBlock):
        a.share_n([held[-1], bad])
    assert (a.free_blocks(), a.refcounts().tolist()) == before
    a.audit()
