"""Write and verify a test pattern in pool blocks: proof that each block is real, writable memory.

Every 32-bit word ``i`` of block ``b`` gets the value ``pattern_word(b, i, seed)``, a cheap hash
of the three, so a word written into the wrong block, or at the wrong place, or never written,
reads back wrong. On a GPU one kernel launch writes all the requested blocks and one more counts
the mismatches; on a NumPy pool the same arithmetic runs vectorized. The path follows the pool's
array type, so a NumPy allocator works on a GPU machine too.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..errors import ConfigError

__all__ = ["write_pattern", "verify_pattern", "pattern_words"]

_SOURCE = r"""
// One hash per 32-bit word: mixes the block id, the word's index and a seed.
// (The same arithmetic, in NumPy, is pattern_words() in pattern.py.)
__device__ __forceinline__ unsigned int pattern_word(unsigned int block, unsigned int i,
                                                     unsigned int seed) {
    unsigned int x = block * 2654435761u ^ (i + seed * 40503u);
    x ^= x >> 15;  x *= 2246822519u;  x ^= x >> 13;
    return x;
}

// Grid: one thread block (of threads) per pool block in `blocks`; its threads stride over
// the block's words. `pool` is the whole pool seen as 32-bit words.
extern "C" __global__ void write_pattern(unsigned int* pool, const int* blocks,
                                         int words_per_block, unsigned int seed) {
    const int b = blocks[blockIdx.x];                        // which pool block we fill
    unsigned int* base = pool + (long long)b * words_per_block;
    for (int i = threadIdx.x; i < words_per_block; i += blockDim.x)
        base[i] = pattern_word(b, i, seed);
}

// Same walk, but compare instead of write; count the words that differ.
extern "C" __global__ void verify_pattern(const unsigned int* pool, const int* blocks,
                                          int words_per_block, unsigned int seed,
                                          unsigned long long* mismatches) {
    const int b = blocks[blockIdx.x];
    const unsigned int* base = pool + (long long)b * words_per_block;
    unsigned int bad = 0;
    for (int i = threadIdx.x; i < words_per_block; i += blockDim.x)
        bad += base[i] != pattern_word(b, i, seed);
    if (bad) atomicAdd(mismatches, (unsigned long long)bad);
}
"""

_module = None


def _kernels():
    global _module
    if _module is None:
        _module = backend.xp.RawModule(code=_SOURCE, options=("-std=c++17",))
    return _module


def pattern_words(block: int, words_per_block: int, seed: int = 0) -> np.ndarray:
    """The pattern for one block, computed with NumPy (uint32)."""
    i = np.arange(words_per_block, dtype=np.uint32)
    with np.errstate(over="ignore"):
        x = np.uint32(block) * np.uint32(2654435761) ^ (i + np.uint32(seed) * np.uint32(40503))
        x ^= x >> np.uint32(15)
        x *= np.uint32(2246822519)
        x ^= x >> np.uint32(13)
    return x


def _prepare(allocator, blocks):
    if allocator.block_bytes % 4:
        raise ConfigError(f"pattern words are 4 bytes; a block of {allocator.block_bytes} "
                          "bytes is not a whole number of words")
    blocks = np.asarray(blocks, dtype=np.int64).ravel()
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= allocator.num_blocks):
        raise ConfigError(f"block ids must lie in [0, {allocator.num_blocks})")
    words = allocator.pool.view(np.uint32).reshape(allocator.num_blocks, -1)
    return words, blocks.astype(np.int32), allocator.block_bytes // 4


def write_pattern(allocator, blocks, seed: int = 0) -> None:
    """Fill each block in ``blocks`` with its pattern."""
    words, blocks, wpb = _prepare(allocator, blocks)
    if not len(blocks):
        return
    if not isinstance(words, np.ndarray):  # a CuPy pool: one launch
        xp = backend.xp
        _kernels().get_function("write_pattern")(
            (len(blocks),), (256,),
            (words, xp.asarray(blocks), np.int32(wpb), np.uint32(seed)))
    else:
        for b in blocks.tolist():
            words[b] = pattern_words(b, wpb, seed)


def verify_pattern(allocator, blocks, seed: int = 0) -> int:
    """How many 32-bit words in ``blocks`` differ from their pattern (0: all intact)."""
    words, blocks, wpb = _prepare(allocator, blocks)
    if not len(blocks):
        return 0
    if not isinstance(words, np.ndarray):
        xp = backend.xp
        bad = xp.zeros(1, dtype=xp.uint64)
        _kernels().get_function("verify_pattern")(
            (len(blocks),), (256,),
            (words, xp.asarray(blocks), np.int32(wpb), np.uint32(seed), bad))
        return int(bad.get()[0])
    return int(sum(int((words[b] != pattern_words(b, wpb, seed)).sum())
                   for b in blocks.tolist()))
