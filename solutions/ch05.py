"""Chapter 5 (the manager): predict a step's new blocks, and internal fragmentation in closed
form."""
from __future__ import annotations

import random

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.checks import cdiv
from pagedkv.manager import KVCacheManager

from ._seeds import names_its_seed

__all__ = ["new_blocks_for_step", "internal_fragmentation"]


def new_blocks_for_step(lengths, block_size: int) -> int:
    """Blocks a decode step takes when no block is shared: one for every sequence whose last
    block is full, that is whose length is a multiple of the block size (0 included)."""
    return sum(n % block_size == 0 for n in lengths)


def internal_fragmentation(lengths, block_size: int) -> float:
    """The share of slots in used blocks that hold no token, for unshared sequences of
    ``lengths`` tokens: what ``KVCacheManager.stats().internal_fragmentation`` reports."""
    lengths = np.asarray(lengths, dtype=np.int64)
    slots = int(cdiv(lengths, block_size).sum()) * block_size
    return (slots - int(lengths.sum())) / slots if slots else 0.0


# ------------------------------------------------------------------------------------ checks
def _random_manager(rng: random.Random):
    bs = rng.randrange(1, 9)
    m = KVCacheManager(BlockAllocator(400, bs * 4, xp=np), bs)
    for s in range(rng.randrange(1, 20)):
        m.add(s, rng.randrange(0, 30))
    return m


@names_its_seed
def check_new_blocks_for_step(impl=new_blocks_for_step, seed=11, trials=300):
    """Against the manager itself: the blocks a real step takes from the allocator."""
    rng = random.Random(seed)
    for _ in range(trials):
        m = _random_manager(rng)
        for _ in range(rng.randrange(1, 6)):
            lengths = [m.num_tokens(s) for s in m.seq_ids]
            used = m.allocator.num_used
            m.step()
            assert impl(lengths, m.block_size) == m.allocator.num_used - used, lengths
    return {"trials": trials}


@names_its_seed
def check_internal_fragmentation(impl=internal_fragmentation, seed=13, trials=300):
    """Against ``stats()`` on managers filled with random lengths."""
    rng = random.Random(seed)
    for _ in range(trials):
        m = _random_manager(rng)
        lengths = [m.num_tokens(s) for s in m.seq_ids]
        got, want = impl(lengths, m.block_size), m.stats().internal_fragmentation
        assert abs(got - want) < 1e-12, (lengths, m.block_size, got, want)
    assert impl([], 4) == 0.0 and impl([4, 8], 4) == 0.0 and impl([1], 4) == 0.75
    return {"trials": trials}


WRONG = {
    "new_blocks_for_step": [lambda lengths, bs: sum((n + 1) % bs == 0 for n in lengths),
                            lambda lengths, bs: sum(n % bs == 0 for n in lengths if n)],
    "internal_fragmentation": [
        lambda lengths, bs: 1 - sum(lengths) / (len(lengths) * bs) if lengths else 0.0,
        lambda lengths, bs: (sum(-n % bs for n in lengths) / sum(lengths)) if lengths else 0.0],
}
