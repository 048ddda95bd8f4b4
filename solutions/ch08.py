"""Chapter 8 (making the bookkeeping fast): a step's slot mapping and its copies, each in a few
NumPy calls instead of a loop over the batch."""
from __future__ import annotations

import random

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.manager import KVCacheManager

from ._seeds import names_its_seed

__all__ = ["slot_mapping", "copies_in_step"]


def slot_mapping(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int):
    """The slot of each row's newest token (position ``seq_lens - 1``), from a step's padded
    block tables, with no Python loop over the rows."""
    last = np.asarray(seq_lens, dtype=np.int64) - 1
    rows = np.arange(len(last))
    return (block_tables[rows, last // block_size].astype(np.int64) * block_size
            + last % block_size).astype(np.int32)


def copies_in_step(last_blocks, refcounts, partial) -> int:
    """How many copy-on-write copies a step makes. ``last_blocks[i]`` is row ``i``'s last
    block, ``partial[i]`` whether it is partly filled (so the new token goes into it), and
    ``refcounts[b]`` block ``b``'s owners. A partly filled block with ``r`` owners, ``k`` of
    them in the batch, is copied ``min(k, r - 1)`` times: all but the last writer copy."""
    blocks = np.asarray(last_blocks)[np.asarray(partial, dtype=bool)]
    shared, k = np.unique(blocks, return_counts=True)
    owners = np.asarray(refcounts)[shared]
    return int(np.minimum(k, owners - 1).sum())


# ------------------------------------------------------------------------------------ checks
def _random_batch(rng: random.Random):
    """A manager with forks (so partly filled blocks are shared) and a batch to step."""
    bs = rng.randrange(1, 6)
    m = KVCacheManager(BlockAllocator(600, bs * 4, xp=np), bs)
    for s in range(rng.randrange(1, 8)):
        m.add(s, rng.randrange(0, 20))
        for c in range(rng.randrange(0, 4)):
            m.fork(s, f"{s}.{c}")
    batch = rng.sample(m.seq_ids, k=rng.randrange(1, len(m) + 1))
    return m, batch


@names_its_seed
def check_slot_mapping(impl=slot_mapping, seed=17, trials=300):
    """Against the slot mapping the manager's own step returns."""
    rng = random.Random(seed)
    for _ in range(trials):
        m, batch = _random_batch(rng)
        plan = m.step(batch)
        got = impl(plan.block_tables, plan.seq_lens, m.block_size)
        assert np.array_equal(got, plan.slot_mapping), (got, plan.slot_mapping)
    return {"trials": trials}


@names_its_seed
def check_copies_in_step(impl=copies_in_step, seed=19, trials=300):
    """Against the copies a real step makes, from the state just before it."""
    rng = random.Random(seed)
    copies = 0
    for _ in range(trials):
        m, batch = _random_batch(rng)
        tables = [m.page_table(s) for s in batch]
        last = [t.blocks[-1] if t.blocks else -1 for t in tables]
        partial = [t.num_tokens % m.block_size != 0 for t in tables]
        predicted = impl(last, m.allocator.refcounts(), partial)
        made = len(m.step(batch).copies)
        assert predicted == made, (predicted, made)
        copies += made
    assert copies > 100, "the trials must make copies to test anything"
    return {"trials": trials, "copies": copies}


def _slots_of_new_length(tables, lens, bs):
    lens = np.asarray(lens, dtype=np.int64)
    rows = np.arange(len(lens))
    return (tables[rows, lens // bs] * bs + lens % bs).astype(np.int32)


WRONG = {
    "slot_mapping": [_slots_of_new_length,
                     lambda tables, lens, bs: (tables[:, 0] * bs + (lens - 1) % bs)
                     .astype(np.int32)],
    "copies_in_step": [
        lambda last, refs, partial: int(sum(p and refs[b] > 1 for b, p in zip(last, partial))),
        lambda last, refs, partial: int(np.unique(np.asarray(last)[np.asarray(partial, bool)])
                                        .size)],
}
