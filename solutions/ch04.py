"""Chapter 4 (the page table): from a slot back to a token, and addresses in another layout."""
from __future__ import annotations

import random

import numpy as np

from pagedkv.page_table import PageTable

from ._seeds import names_its_seed

__all__ = ["position_of", "interleaved_kv_addresses"]


def position_of(table: PageTable, slot: int):
    """The token position of ``table``'s sequence stored at ``slot``, or None if the sequence
    has no token there (another sequence's block, or past its last token)."""
    block, offset = divmod(slot, table.block_size)
    if block not in table.blocks:
        return None
    position = table.blocks.index(block) * table.block_size + offset
    return position if position < table.num_tokens else None


def interleaved_kv_addresses(table: PageTable, token: int, pool_base: int, row_bytes: int):
    """Addresses of token ``token``'s key and value rows when one layer's cache is laid out
    ``[num_blocks, block_size, 2, kv_heads, head_dim]``: each token's key row is followed at
    once by its value row, so a block is ``block_size`` pairs of rows."""
    block, offset = table.locate(token)
    key = pool_base + (block * table.block_size + offset) * 2 * row_bytes
    return key, key + row_bytes


# ------------------------------------------------------------------------------------ checks
def _random_table(rng: random.Random) -> PageTable:
    bs = rng.randrange(1, 9)
    blocks = rng.sample(range(40), k=rng.randrange(0, 8))
    tokens = 0 if not blocks else rng.randrange((len(blocks) - 1) * bs + 1, len(blocks) * bs + 1)
    return PageTable(bs, blocks, tokens)


@names_its_seed
def check_position_of(impl=position_of, seed=7, tables=300):
    """Against a brute-force scan: every slot of a 40-block pool, for random page tables."""
    rng = random.Random(seed)
    for _ in range(tables):
        table = _random_table(rng)
        where = {table.slot(t): t for t in range(table.num_tokens)}
        for slot in range(40 * table.block_size):
            assert impl(table, slot) == where.get(slot), (table, slot)
    return {"page tables": tables}


@names_its_seed
def check_interleaved_kv_addresses(impl=interleaved_kv_addresses, seed=2, tables=100):
    """Against the byte offsets NumPy itself computes for an array of that layout."""
    rng = random.Random(seed)
    for _ in range(tables):
        table = _random_table(rng)
        heads, dim = rng.randrange(1, 4), rng.choice([2, 4, 8])
        cache = np.zeros((40, table.block_size, 2, heads, dim), dtype=np.float16)
        base, row_bytes = cache.ctypes.data, heads * dim * cache.itemsize
        for t in range(table.num_tokens):
            block, offset = table.locate(t)
            want = (cache[block, offset, 0].ctypes.data, cache[block, offset, 1].ctypes.data)
            assert impl(table, t, base, row_bytes) == want, (table, t)
    return {"page tables": tables}


# ---------------------------------------------------- wrong answers the checks must reject
def _position_past_the_end(table, slot):
    block, offset = divmod(slot, table.block_size)
    if block not in table.blocks:
        return None
    return table.blocks.index(block) * table.block_size + offset


def _position_by_block_id(table, slot):
    return slot if slot < table.num_tokens else None


WRONG = {
    "position_of": [_position_past_the_end, _position_by_block_id],
    "interleaved_kv_addresses": [PageTable.kv_addresses,
                                 lambda table, t, base, rb: (base + table.slot(t) * rb,
                                                             base + table.slot(t) * rb + rb)],
}
