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


def test_randomized_against_a_dict_model():
    seed = 20261129
    print(f"seed={seed}")
    rng = random.Random(seed)
    a = BlockAllocator(32, 8, xp=np)
    model: dict[int, int] = {}                 # block -> owners; absent = free
    for _ in range(20_000):
        op = rng.random()
        if op < 0.35:
            if len(model) < 32:
                b = a.allocate()
                assert b not in model
                model[b] = 1
            else:
                with pytest.raises(OutOfBlocks):
                    a.allocate()
        elif op < 0.5:
            n = rng.randrange(0, 6)
            if n <= 32 - len(model):
                for b in a.allocate_n(n):
                    assert b not in model
                    model[b] = 1
            else:
                with pytest.raises(OutOfBlocks):
                    a.allocate_n(n)
        elif op < 0.6 and model:
            b = rng.choice(sorted(model))
            a.share(b)
            model[b] += 1
        elif op < 0.95 and model:
            b = rng.choice(sorted(model))
            a.free(b)
            model[b] -= 1
            if not model[b]:
                del model[b]
        else:
            b = rng.randrange(32)
            if b not in model:
                with pytest.raises(DoubleFree):
                    a.free(b)
        assert a.num_used == len(model)
        assert all(a.refcount(b) == c for b, c in model.items())
        a.audit()
