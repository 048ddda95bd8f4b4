"""Chapter 2 (Setup): the test pattern for many blocks at once, and blocks that do not overlap."""
from __future__ import annotations

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.kernels.pattern import pattern_words

from ._seeds import names_its_seed

__all__ = ["pattern_matrix", "blocks_are_disjoint"]


def pattern_matrix(blocks, words_per_block: int, seed: int = 0) -> np.ndarray:
    """The pattern of every block in ``blocks`` at once: row ``k`` holds the
    words of block ``blocks[k]``, the arithmetic of ``pattern_words`` with no
    loop over blocks (a column of block ids against a row of word indexes)."""
    b = np.asarray(blocks, dtype=np.uint32).reshape(-1, 1)
    i = np.arange(words_per_block, dtype=np.uint32).reshape(1, -1)
    with np.errstate(over="ignore"):
        x = b * np.uint32(2654435761) ^ (i + np.uint32(seed)
                                         * np.uint32(40503))
        x ^= x >> np.uint32(15)
        x *= np.uint32(2246822519)
        x ^= x >> np.uint32(13)
    return x


def blocks_are_disjoint(allocator) -> bool:
    """True if no two blocks share a byte: fill every block with its own id
    first, then read every block back. (Checking each block right after
    writing it would miss an overlap: the block that overwrites it comes
    later.)"""
    for b in range(allocator.num_blocks):
        allocator.block_view(b).view(np.uint32).fill(b)
    return all(bool((allocator.block_view(b).view(np.uint32) == b).all())
               for b in range(allocator.num_blocks))


# ------------------------------------------------------------------------------------ checks
@names_its_seed
def check_pattern_matrix(impl=pattern_matrix, seed=7):
    """Row by row against pattern_words, for scattered, repeated and high block ids."""
    blocks = [0, 5, 3, 3, 1000, 2**31 - 1]
    got = impl(blocks, 64, seed)
    assert got.dtype == np.uint32 and got.shape == (len(blocks), 64)
    for k, b in enumerate(blocks):
        assert (got[k] == pattern_words(b, 64, seed)).all(), f"row {k} (block {b}) differs"
    assert impl([], 8, seed).shape == (0, 8)
    return {"blocks": len(blocks)}


class _Overlapping:
    """A broken allocator: block b starts half a block after block b - 1, so neighbours share
    half their bytes."""

    def __init__(self, num_blocks, block_bytes):
        self.num_blocks, self.block_bytes = num_blocks, block_bytes
        self.pool = np.zeros((num_blocks + 1) * block_bytes // 2, dtype=np.uint8)

    def block_view(self, b):
        start = b * self.block_bytes // 2
        return self.pool[start:start + self.block_bytes]


def check_blocks_are_disjoint(impl=blocks_are_disjoint):
    """A real pool passes; a pool whose blocks overlap fails."""
    with BlockAllocator(num_blocks=16, block_bytes=256) as alloc:
        assert impl(alloc) is True, "a real pool's blocks do not overlap"
    assert impl(_Overlapping(16, 256)) is False, "overlapping blocks must be caught"
    return {"real pool": True, "overlapping pool": False}


# ---------------------------------------------------- wrong answers the checks must reject
def _one_block_row(blocks, words_per_block, seed=0):
    return np.tile(pattern_words(int(np.asarray(blocks).ravel()[0]) if len(blocks) else 0,
                                 words_per_block, seed), (len(blocks), 1))


def _check_each_right_away(allocator):
    ok = True
    for b in range(allocator.num_blocks):
        view = allocator.block_view(b).view(np.uint32)
        view.fill(b)
        ok &= bool((view == b).all())
    return ok


WRONG = {
    "pattern_matrix": [_one_block_row,
                       lambda blocks, wpb, seed=0: pattern_matrix(blocks, wpb, seed + 1)],
    "blocks_are_disjoint": [_check_each_right_away, lambda allocator: True],
}
