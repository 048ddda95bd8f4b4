"""The page table: where each of a sequence's tokens lives in the pool.

A sequence's tokens are numbered 0, 1, 2, ... (logical positions). With ``block_size`` tokens per
block, token ``t`` sits in logical block ``t // block_size`` at offset ``t % block_size``. The
page table maps each logical block to a physical block id, wherever the allocator found one, so a
sequence's blocks may lie anywhere in the pool, in any order.

A token's *slot* is its index among all token positions of the pool::

    slot = physical_block * block_size + offset

which is what a kernel that writes K/V needs. One layer's cache is laid out
``[num_blocks, 2, block_size, kv_heads, head_dim]``: in each block the ``block_size`` key rows
come first, then the ``block_size`` value rows, a row being one token's keys (or values) for
every head. So token ``t``'s key row starts at byte
``pool_base + (2 * physical_block * block_size + offset) * row_bytes``, and its value row
``block_size * row_bytes`` later (:meth:`PageTable.kv_addresses`).
"""
from __future__ import annotations

import numpy as np

from .checks import count, is_int, positive_int
from .errors import ConfigError, TokenIndexError

__all__ = ["PageTable", "slots_of"]


def slots_of(blocks: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Vectorized slot lookup: ``blocks[positions // block_size] * block_size + offset``.

    ``blocks`` is one page table (logical block -> physical block); ``positions`` are token
    positions already known to be in range. Returns int32 slots.
    """
    positions = np.asarray(positions, dtype=np.int64)
    phys = np.asarray(blocks, dtype=np.int64)[positions // block_size]
    return (phys * block_size + positions % block_size).astype(np.int32)


class PageTable:
    """Logical block index -> physical block id, for one sequence of ``num_tokens`` tokens."""

    __slots__ = ("block_size", "blocks", "num_tokens")

    def __init__(self, block_size: int, blocks=(), num_tokens: int = 0):
        self.block_size = positive_int(block_size, "block_size")
        self.blocks: list[int] = [int(b) for b in blocks]
        num_tokens = count(num_tokens, "num_tokens")
        if not 0 <= num_tokens <= len(self.blocks) * self.block_size:
            raise ConfigError(f"{num_tokens} tokens do not fit in {len(self.blocks)} block(s) "
                              f"of {self.block_size}")
        self.num_tokens = int(num_tokens)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def capacity(self) -> int:
        """Tokens the mapped blocks can hold."""
        return len(self.blocks) * self.block_size

    def append_block(self, block: int) -> None:
        """Map the next logical block to physical ``block``."""
        self.blocks.append(int(block))

    def append_token(self) -> int:
        """Count one more token; return its slot. The caller maps a block first when full."""
        if self.num_tokens >= self.capacity:
            raise TokenIndexError(f"no room for token {self.num_tokens}: the page table maps "
                                  f"{self.num_blocks} block(s) = {self.capacity} tokens")
        self.num_tokens += 1
        return self.slot(self.num_tokens - 1)

    def truncate(self, n: int) -> list[int]:
        """Keep the first ``n`` tokens: unmap the blocks wholly past them and return those,
        the last one first (the order to give them back in: a growth undone, as a stack
        unwinds). A partly filled last block stays mapped, whatever it holds past ``n``:
        the next token written there overwrites it."""
        n = count(n, "the number of tokens to keep")
        if n > self.num_tokens:
            raise TokenIndexError(f"cannot keep {n} tokens: the sequence has "
                                  f"{self.num_tokens}")
        keep = -(-n // self.block_size)
        cut = self.blocks[keep:][::-1]
        del self.blocks[keep:]
        self.num_tokens = n
        return cut

    def locate(self, token: int) -> tuple[int, int]:
        """(physical block, offset in block) of token position ``token``."""
        if not is_int(token) or not 0 <= token < self.num_tokens:
            raise TokenIndexError(f"token index {token!r} is outside the sequence "
                                  f"[0, {self.num_tokens})")
        logical, offset = divmod(int(token), self.block_size)
        return self.blocks[logical], offset

    def slot(self, token: int) -> int:
        block, offset = self.locate(token)
        return block * self.block_size + offset

    def slots(self) -> np.ndarray:
        """The slots of every token, in order (int32)."""
        return slots_of(np.asarray(self.blocks, dtype=np.int64), np.arange(self.num_tokens),
                        self.block_size)

    def kv_addresses(self, token: int, pool_base: int, row_bytes: int) -> tuple[int, int]:
        """Addresses of token ``token``'s key row and value row in one layer's cache, laid out
        ``[num_blocks, 2, block_size, kv_heads, head_dim]`` from ``pool_base``, where a row (one
        token's keys, or values, for every head) is ``row_bytes`` long."""
        block, offset = self.locate(token)
        key = pool_base + (2 * block * self.block_size + offset) * int(row_bytes)
        return key, key + self.block_size * int(row_bytes)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return f"PageTable({self.num_tokens} tokens, blocks={self.blocks})"
