"""Chapter 14 (beyond one GPU): a wire plan that sends each shared block once, the bytes
per block a rank stores under tensor parallelism, and a transfer plan that frees its
source blocks at plan time (and what the destination then receives)."""
from __future__ import annotations

import random

import numpy as np

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import OutOfBlocks
from pagedkv.manager import KVCacheManager
from pagedkv.spec import KVSpec
from pagedkv.transfer import copy_between, plan_transfer

from ._seeds import names_its_seed

__all__ = ["wire_plan", "tp_block_bytes", "plan_transfer_freeing",
           "send_after_next_prefill"]


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


@names_its_seed
def check_wire_plan(impl=wire_plan, seed=16, trials=200):
    """Each distinct block is sent once, and scattering the packed blocks by ``index``
    gives what :func:`copy_between` gives."""
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
    return {"trials": trials, "blocks_not_sent_twice": saved}


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



# ------------------------------------------------------------------ freeing at plan time
def plan_transfer_freeing(src, dst, seq_ids, contents=None):
    """:func:`plan_transfer`, and A lets go of the sequences at once, as a swap-out
    does. Still all or nothing: a refused plan frees nothing."""
    plan = plan_transfer(src, dst, seq_ids, contents)       # (raises: nothing freed)
    for s in plan.seq_ids:
        src.free(s)
    return plan


def send_after_next_prefill(planner, bs: int = 4, layers: int = 2) -> int:
    """Prefill prompt 0 on A, plan its transfer to B with ``planner``, prefill prompt 1
    on A, and only then send (as a send that waits for its receiver runs after the
    sender has gone on): how many of prompt 0's K/V values (one per token and layer)
    arrive on B other than prompt 0's prefill wrote them."""
    a = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    b = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    pool_a = a.allocator.pool.view(np.int64).reshape(layers, -1, bs)
    pool_b = b.allocator.pool.view(np.int64).reshape(layers, -1, bs)
    value = lambda seq, t: 1000 * seq + 10 * t + np.arange(layers) + 1   # noqa: E731

    def prefill(seq, n):                       # a prompt's K/V, written into A's pool
        a.add(seq, n)
        for t, slot in enumerate(a.slots(seq).tolist()):
            pool_a[:, slot // bs, slot % bs] = value(seq, t)

    prefill(0, 10)
    plan = planner(a, b, [0])
    prefill(1, 10)                             # the next prompt, while the send waits
    copy_between(pool_a, pool_b, plan.pairs)   # the send reads A's blocks only now
    wrong = sum(int((pool_b[:, slot // bs, slot % bs] != value(0, t)).sum())
                for t, slot in enumerate(b.slots(0).tolist()))
    if 0 in a:
        a.free(0)                              # the bytes have gone: A lets go
    a.audit()
    b.audit()
    return wrong


def _twins(seed):
    """Two identical (A, B) pairs of managers, from one seed."""
    return _forked_managers(random.Random(seed)), _forked_managers(random.Random(seed))


@names_its_seed
def check_plan_transfer_freeing(impl=plan_transfer_freeing, seed=14, trials=100):
    """Against :func:`plan_transfer` followed by ``free`` on identical managers (random
    forked sequences): the same plan, A left as freeing would leave it; a plan B
    refuses frees nothing; and sent after the next prefill, it delivers wrong K/V."""
    rng = random.Random(seed)
    for _ in range(trials):
        s = rng.randrange(2**32)
        (a, b), (a2, b2) = _twins(s)
        ids = random.Random(s).sample(a.seq_ids, rng.randrange(1, len(a.seq_ids) + 1))
        want = plan_transfer(a2, b2, ids)
        for x in ids:
            a2.free(x)
        got = impl(a, b, ids)
        assert got.pairs.tolist() == want.pairs.tolist() and got.found == want.found
        assert a.seq_ids == a2.seq_ids and a.allocator.num_free == a2.allocator.num_free
        assert a.allocator.free_blocks() == a2.allocator.free_blocks(), ids
        a.audit()
        b.audit()
    (a, _), _ = _twins(seed)                  # B too small: refused, A unchanged
    small = KVCacheManager(BlockAllocator(1, a.allocator.block_bytes, xp=np),
                           a.block_size)
    before = (a.seq_ids, a.allocator.free_blocks())
    try:
        impl(a, small, a.seq_ids)
        raise AssertionError("a plan B has no room for was not refused")
    except OutOfBlocks:
        pass
    assert (a.seq_ids, a.allocator.free_blocks()) == before, "a refused plan freed"
    wrong = send_after_next_prefill(impl)
    assert wrong > 0, "freed at plan time, the next prefill should overwrite the blocks"
    return {"trials": trials, "values wrong after the next prefill": wrong}


def check_send_after_next_prefill(impl=send_after_next_prefill):
    """With the real plan every value arrives as written; with the blocks freed at plan
    time some do not; and a planner that moved nothing is caught too."""
    right = impl(plan_transfer)
    assert right == 0, f"plan_transfer: {right} values arrived wrong"
    wrong = impl(plan_transfer_freeing)
    assert wrong > 0, "freed at plan time, every value arrived right: nothing was shown"
    empty = impl(lambda a, b, ids: plan_transfer(a, b, ids)._replace(
        pairs=np.zeros((0, 2), dtype=np.int32)))
    assert empty > 0, "a plan that sends nothing delivered every value"
    return {"values wrong: plan_transfer": right, "freed at plan time": wrong}


def _free_even_if_refused(src, dst, seq_ids, contents=None):
    """Frees the sequences whatever happens, refused plan included."""
    try:
        return plan_transfer(src, dst, seq_ids, contents)
    finally:
        for s in list(seq_ids):
            if s in src:
                src.free(s)


def _free_the_first_only(src, dst, seq_ids, contents=None):
    plan = plan_transfer(src, dst, seq_ids, contents)
    src.free(plan.seq_ids[0])
    return plan


def _send_before_the_next_prefill(planner, bs=4, layers=2):
    """Sends before A prefills again: nothing can go wrong, so nothing is shown."""
    a = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    b = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    pool_a = a.allocator.pool.view(np.int64).reshape(layers, -1, bs)
    pool_b = b.allocator.pool.view(np.int64).reshape(layers, -1, bs)
    a.add(0, 10)
    for t, slot in enumerate(a.slots(0).tolist()):
        pool_a[:, slot // bs, slot % bs] = t + 1
    plan = planner(a, b, [0])
    copy_between(pool_a, pool_b, plan.pairs)
    a.add(1, 10)
    return sum(int((pool_b[:, s // bs, s % bs] != t + 1).sum())
               for t, s in enumerate(b.slots(0).tolist()))


def _compare_on_a(planner, bs=4, layers=2):
    """Reads the values back from A's pool, not B's: the copy is never looked at."""
    a = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    b = KVCacheManager(BlockAllocator(8, bs * layers * 8, xp=np), bs)
    pool_a = a.allocator.pool.view(np.int64).reshape(layers, -1, bs)
    a.add(0, 10)
    slots = a.slots(0).tolist()
    for t, slot in enumerate(slots):
        pool_a[:, slot // bs, slot % bs] = t + 1
    planner(a, b, [0])
    return sum(int((pool_a[:, s // bs, s % bs] != t + 1).sum())
               for t, s in enumerate(slots))


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
    "plan_transfer_freeing": [plan_transfer, _free_even_if_refused, _free_the_first_only],
    "send_after_next_prefill": [_send_before_the_next_prefill, _compare_on_a],
}
