"""Chapter 14 (beyond one GPU): a wire plan that sends each shared block once, and the bytes
per block a rank stores under tensor parallelism."""
from __future__ import annotations

import random

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.manager import KVCacheManager
from pagedkv.spec import KVSpec
from pagedkv.transfer import copy_between, plan_transfer

__all__ = ["wire_plan", "tp_block_bytes"]


def wire_plan(pairs):
    """``(sent, index)`` for a transfer's (block on A, block on B) pairs: the distinct
    blocks of A, in the order they first appear, and for each pair the place of its
    source in ``sent``. The sender packs ``blocks[:, sent]``; the receiver scatters
    ``packed[:, index]`` into its blocks ``pairs[:, 1]``."""
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    place: dict = {}
    index = [place.setdefault(a, len(place)) for a in pairs[:, 0].tolist()]
    return np.array(list(place), dtype=np.int64), np.array(index, dtype=np.int64)


def tp_block_bytes(spec: KVSpec, block_size: int, world: int) -> int:
    """Bytes of one block on one of ``world`` tensor-parallel ranks: the rank's share of
    the KV heads, at least one head (with more ranks than KV heads, heads are stored on
    several ranks, as vLLM does)."""
    heads = max(1, spec.kv_heads // world)
    return block_size * 2 * spec.layers * heads * spec.head_dim * spec.itemsize


def _forked_managers(rng):
    """Pool A with forked sequences (shared blocks), pool B empty; values in A's pool."""
    bs, layers = 4, 2
    pool = BlockAllocator(40, bs * 8 * layers, xp=np)
    taken = pool.allocate_n(40)
    rng.shuffle(taken)
    pool.free_n(taken)                      # the free stack in a random order
    a = KVCacheManager(pool, bs)
    b = KVCacheManager(BlockAllocator(40, bs * 8 * layers, xp=np), bs)
    a.add(0, rng.randrange(1, 20))
    children = list(range(1, rng.randrange(2, 5)))
    a.fork(0, *children)
    for c in children:
        a.step([c])
    return a, b


def check_wire_plan(impl=wire_plan, seed=16, trials=200):
    """Each distinct block is sent once, and scattering the packed blocks by ``index``
    gives what :func:`copy_between` gives."""
    print(f"seed={seed}")
    rng = random.Random(seed)
    saved = 0
    for _ in range(trials):
        a, b = _forked_managers(rng)
        plan = plan_transfer(a, b, a.seq_ids)
        sent, index = impl(plan.pairs)
        distinct = set(plan.pairs[:, 0].tolist())
        assert sorted(np.asarray(sent).tolist()) == sorted(distinct), (plan.pairs, sent)
        index = np.asarray(index)
        assert index.shape == (len(plan.pairs),) and index.min() >= 0 \
            and index.max() < len(sent), (plan.pairs, index)
        src = np.random.default_rng(rng.randrange(2**32)).standard_normal((2, 40, 16))
        want, got = np.zeros_like(src), np.zeros_like(src)
        copy_between(src, want, plan.pairs)
        packed = src[:, np.asarray(sent)]
        got[:, plan.pairs[:, 1]] = packed[:, index]
        assert (got == want).all(), plan.pairs.tolist()
        saved += len(plan.pairs) - len(sent)
    assert impl(np.zeros((0, 2), dtype=np.int32))[0].size == 0
    return {"seed": seed, "trials": trials, "blocks_not_sent_twice": saved}


def check_tp_block_bytes(impl=tp_block_bytes):
    """Hand-worked cases: an even split, one KV head per rank, more ranks than heads."""
    llama70b = KVSpec(layers=80, kv_heads=8, head_dim=128, dtype="float16")
    whole = llama70b.block_bytes(16)
    cases = {1: whole, 2: whole // 2, 8: whole // 8, 16: whole // 8}
    for world, want in cases.items():
        got = impl(llama70b, 16, world)
        assert got == want, (world, got, want)
    tiny = KVSpec(layers=2, kv_heads=2, head_dim=64, dtype="float32")
    assert impl(tiny, 4, 2) == 4 * 2 * 2 * 1 * 64 * 4
    return {world: impl(llama70b, 16, world) for world in cases}


WRONG = {
    "wire_plan": [
        lambda pairs: (np.asarray(pairs)[:, 0], np.arange(len(pairs))),  # sends them all
        lambda pairs: (lambda src: (np.unique(src), np.unique(src, return_index=True)[1]
                                    [np.unique(src, return_inverse=True)[1]]))(
            np.asarray(pairs, dtype=np.int64).reshape(-1, 2)[:, 0]),  # index into pairs
        lambda pairs: (lambda s: (s, np.arange(len(pairs)) % max(1, len(s))))(
            np.array(list(dict.fromkeys(np.asarray(pairs)[:, 0].tolist())))),
    ],
    "tp_block_bytes": [
        lambda spec, bs, world: spec.block_bytes(bs) // world,           # 16 ranks: 1/16
        lambda spec, bs, world: bs * 2 * spec.layers * -(-spec.kv_heads // world)
        * spec.head_dim,                                                 # itemsize left out
    ],
}
