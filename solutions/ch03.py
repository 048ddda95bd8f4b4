"""Chapter 3 (the allocator): a free queue instead of a stack, and a batch taken in one slice."""
from __future__ import annotations

import random
from collections import deque

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.checks import count
from pagedkv.errors import OutOfBlocks

from ._seeds import names_its_seed

__all__ = ["QueueAllocator", "take_n"]


class QueueAllocator(BlockAllocator):
    """A free *queue*: ``allocate`` takes the block that has been free the longest, ``free``
    puts a block at the back. A fresh pool still hands out 0, 1, 2, ..."""

    def __init__(self, num_blocks: int, block_bytes: int, *, xp=None):
        super().__init__(num_blocks, block_bytes, xp=xp)
        self._free.reverse()                   # the front (index 0) is block 0

    def allocate(self) -> int:
        self._check_open()
        if not self._free:
            raise OutOfBlocks(1, 0, "allocate")
        block = self._free.pop(0)              # O(n) on a list: a deque would make it O(1)
        self._refcount[block] = 1
        return block


def take_n(alloc: BlockAllocator, n: int) -> list[int]:
    """``alloc.allocate_n(n)`` without a call per block: one slice off the top of the free
    stack, reversed into the order ``n`` calls of ``allocate`` would give."""
    n = count(n, "n")
    if n > alloc.num_free:
        raise OutOfBlocks(n, alloc.num_free, "take_n")
    if n == 0:
        return []
    taken = alloc._free[-n:][::-1]             # the top of the stack first
    del alloc._free[-n:]
    for b in taken:
        alloc._refcount[b] = 1
    return taken


# ------------------------------------------------------------------------------------ checks
@names_its_seed
def check_QueueAllocator(impl=QueueAllocator, seed=3, ops=3000):
    """Against a deque model: the block out is always the one freed longest ago."""
    rng = random.Random(seed)
    a = impl(12, 8, xp=np)
    model, held = deque(range(12)), []
    assert [a.allocate() for _ in range(3)] == [0, 1, 2], "a fresh pool hands out 0, 1, 2"
    for _ in range(3):
        held.append(model.popleft())
    for _ in range(ops):
        if held and (not model or rng.random() < 0.5):
            b = held.pop(rng.randrange(len(held)))
            a.free(b)
            model.append(b)
        else:
            got = a.allocate()
            assert got == model.popleft(), "allocate must take the block free the longest"
            held.append(got)
        assert a.num_free == len(model)
        a.audit()
    return {"operations": ops, "agreed with the queue model": True}


@names_its_seed
def check_take_n(impl=take_n, seed=5, trials=300):
    """Same blocks, order and counts as ``allocate_n`` on a twin allocator, from scattered free
    stacks; all or nothing when too few are free."""
    rng = random.Random(seed)
    for _ in range(trials):
        twins = [BlockAllocator(16, 8, xp=np) for _ in range(2)]
        held = twins[0].allocate_n(rng.randrange(0, 17))
        twins[1].allocate_n(len(held))
        for b in rng.sample(held, k=rng.randrange(0, len(held) + 1)):
            for t in twins:
                t.free(b)
        n = rng.randrange(0, 9)
        if n > twins[0].num_free:
            state = twins[0].free_blocks()
            try:
                impl(twins[0], n)
            except OutOfBlocks:
                assert twins[0].free_blocks() == state, "a refused take changed the stack"
                continue
            raise AssertionError("taking more blocks than are free must raise OutOfBlocks")
        assert impl(twins[0], n) == twins[1].allocate_n(n), "not allocate_n's blocks or order"
        assert twins[0].refcounts().tolist() == twins[1].refcounts().tolist()
        assert twins[0].free_blocks() == twins[1].free_blocks()
        twins[0].audit()
    return {"trials": trials}


# ---------------------------------------------------- wrong answers the checks must reject
class _StackAfterAll(QueueAllocator):
    def allocate(self):                         # forgot to override: pops the end
        return BlockAllocator.allocate(self)


class _QueueFromTheTop(BlockAllocator):
    def allocate(self):                         # a queue, but the fresh pool hands out 15, 14...
        block = self._free.pop(0)
        self._refcount[block] = 1
        return block


def _take_unreversed(alloc, n):
    taken = alloc._free[-n:] if n else []
    del alloc._free[len(alloc._free) - n:]
    for b in taken:
        alloc._refcount[b] = 1
    return taken


def _take_no_counts(alloc, n):
    if n > alloc.num_free:
        raise OutOfBlocks(n, alloc.num_free)
    taken = alloc._free[len(alloc._free) - n:][::-1]
    del alloc._free[len(alloc._free) - n:]
    return taken


def _take_partial(alloc, n):
    n = min(n, alloc.num_free)                  # takes what there is instead of refusing
    return take_n(alloc, n)


WRONG = {
    "QueueAllocator": [_StackAfterAll, _QueueFromTheTop],
    "take_n": [_take_unreversed, _take_no_counts, _take_partial],
}
