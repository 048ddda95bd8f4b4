"""Path equivalence for prefix caching: the teaching :mod:`pagedkv.prefix_cache` and the fast
:mod:`pagedkv.fast.prefix`, given the same calls, return the same plans (slots, copies, cached
tokens), block ids and token ids, raise the same error types, and after every call hold the
same free stack, refcounts, idle blocks (in eviction order), cached blocks, hits and
evictions; both audits pass after every call.

The call streams are random with fixed seeds (printed in the test ids); prompts are drawn from
a few shared beginnings, and the pools are small, so that hits on idle and on running blocks,
evictions, forks, copy-on-write and running out of blocks all happen; the tests count them.
"""
import random
from collections import Counter

import numpy as np
import pytest

from pagedkv import allocator, fast
from pagedkv.errors import PagedKVError
from pagedkv.fast.prefix import PrefixCachingManager as FastPrefix
from pagedkv.manager import Plan, StepPlan
from pagedkv.prefix_cache import PrefillPlan, PrefixCachingManager
from pagedkv.swap import HostPool, Swapper

MET = Counter()
BEGINNINGS = [(), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9), (5,) * 11]


def pair(num_blocks, block_size, caching=True):
    t = PrefixCachingManager(allocator.BlockAllocator(num_blocks, block_size * 4, xp=np),
                             block_size, caching=caching)
    f = FastPrefix(fast.BlockAllocator(num_blocks, block_size * 4, xp=np), block_size,
                   caching=caching, max_seqs=2, max_seq_len=4)
    return t, f


def outcome(call):
    try:
        return "ok", call()
    except PagedKVError as exc:
        return "error", type(exc)


def same_result(a, b, where):
    assert type(a) is type(b), f"{where}: {type(a)} {type(b)}"
    if isinstance(a, (Plan, StepPlan, PrefillPlan)):
        for name, x, y in zip(a._fields, a, b):
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and x.shape == y.shape and (x == y).all(), \
                    f"{where}: {name}\n{x}\n{y}"
            else:
                assert x == y, f"{where}: {name}: {x} != {y}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.tolist() == b.tolist(), where
    elif isinstance(a, list):
        assert len(a) == len(b), f"{where}: {len(a)} != {len(b)} results"
        for x, y in zip(a, b):
            same_result(x, y, where)
    else:
        assert a == b, f"{where}: {a} != {b}"


def same_state(t, f, where):
    ct, cf = t.cache, f.cache
    assert ct.allocator.free_blocks() == cf.allocator.free_blocks(), where
    assert ct.refcounts().tolist() == cf.refcounts().tolist(), where
    assert list(ct._idle) == list(cf._idle), where
    assert sorted(ct._block_of.items()) == sorted(cf._block_of.items()), where
    assert (ct.hits, ct.evictions, ct.num_free) == (cf.hits, cf.evictions, cf.num_free), where
    assert sorted(map(str, t.seq_ids)) == sorted(map(str, f.seq_ids)), where
    for s in t.seq_ids:
        assert t.block_table(s).tolist() == f.block_table(s).tolist(), f"{where}: {s}"
        assert t._tail[s] == f._tail[s], f"{where}: {s}"
        assert (t._hashes[s], t._serials[s]) == (f._hashes[s], f._serials[s]), f"{where}: {s}"
    assert t.pending() == f.pending(), where
    assert t.stats() == f.stats(), where
    assert ct.num_shared == cf.num_shared == t.stats().shared_blocks, where
    t.audit()
    f.audit()


def prompt(rng, bs):
    head = list(rng.choice(BEGINNINGS))
    return head + [rng.randrange(4) for _ in range(rng.randrange(0 if head else 1, 3 * bs))]


def speculate(both, rng, t, live, ids):
    """One call of a speculating engine, or a rewind: slots reserved one or several at a
    time, their ids committed oldest first, truncations that drop pending slots or cut
    committed tokens (with the ids when the cut needs them, and now and then without, or
    wrong, or to lengths that are refused)."""
    s, r = rng.choice(live), rng.random()
    pending = t.pending().get(s, 0)
    if r < 0.3:
        both("reserve_slots", s, rng.choice([1, 2, 3, 5, 0]))
    elif r < 0.45:
        both("reserve", rng.sample(live, rng.randint(1, len(live))))
    elif r < 0.7 and pending:
        k = rng.randint(1, pending + (rng.random() < 0.1))      # now and then one too many
        new = [rng.randrange(4) for _ in range(k)]
        if both("commit", [s] * k, new)[0] == "ok":
            ids[s] += new
            MET["commit"] += 1
    else:
        known, length = len(ids[s]), t.num_tokens(s)
        n = rng.choice([known, length, rng.randint(0, length), rng.randint(1, length),
                        length + 1, max(known - 1, 0)])
        give = rng.choice(["ids", "ids", "none", "wrong"])
        tokens = None if give == "none" else ids[s][:n] + [0] * max(n - known, 0)
        if give == "wrong" and tokens:
            tokens[rng.randrange(len(tokens))] += 1
        if both("truncate", s, n, tokens)[0] == "ok":
            del ids[s][n:]
            MET["truncate"] += 1
            MET["truncate of committed tokens"] += n < known
            MET["truncate of pending slots"] += n > known or (n == known < length)


def run_stream(seed, steps=400):
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 4])
    t, f = pair(rng.choice([6, 10, 16]), bs, caching=rng.random() < 0.85)
    live, names = [], iter(range(10**6))
    calls = []

    def both(name, *args):
        calls.append(f"{name}{args!r}")
        where = f"seed {seed}, call {len(calls)}: {calls[-1]}"
        a = outcome(lambda: getattr(t, name)(*args))
        b = outcome(lambda: getattr(f, name)(*args))
        assert a[0] == b[0], f"{where}: teaching {a}, fast {b}"
        if a[0] == "error":
            assert a[1] is b[1], f"{where}: teaching {a[1]}, fast {b[1]}"
            MET[f"error {a[1].__name__}"] += 1
        else:
            same_result(a[1], b[1], where)
        same_state(t, f, where)
        return a

    ids = {}                           # live sequence -> its committed token ids
    for _ in range(steps):
        settled = [s for s in live if not t.pending().get(s)]   # nothing pending
        r = rng.random()
        if live and r < 0.2:
            speculate(both, rng, t, live, ids)
        elif r < 0.3 or not settled:
            s = next(names)
            p = prompt(rng, bs)
            as_array = rng.random() < 0.3
            res = both("add", s, np.array(p, dtype=np.int64) if as_array else p)
            if res[0] == "ok":
                live.append(s)
                ids[s] = list(p)
                MET["hit"] += res[1].cached_tokens > 0
        elif r < 0.45:
            batch = rng.sample(settled, rng.randint(1, len(settled)))
            new = [rng.randrange(4) for _ in batch]
            if both("step", batch, new)[0] == "ok":
                for s, tok in zip(batch, new):
                    ids[s].append(tok)
            MET["step"] += 1
        elif r < 0.55:
            s, new = rng.choice(settled), [rng.randrange(4) for _ in range(rng.randint(1, 5))]
            if both("append", s, new)[0] == "ok":
                ids[s] += new
        elif r < 0.65:
            children = [next(names) for _ in range(rng.randint(1, 2))]
            parent = rng.choice(settled)
            if both("fork", parent, *children)[0] == "ok":
                live += children
                ids.update((c, list(ids[parent])) for c in children)
                MET["fork"] += 1
        elif r < 0.8:
            s = live.pop(rng.randrange(len(live)))
            both("free", s)
            del ids[s]
        elif r < 0.85:                 # several at once: a request's samples coming back
            head = prompt(rng, bs)
            group = [(next(names), head + [rng.randrange(4) for _ in range(rng.randrange(
                2 * bs))]) for _ in range(rng.randint(1, 3))]
            both("blocks_to_add", *(p for _, p in group))
            if both("add_all", group)[0] == "ok":
                live += [s for s, _ in group]
                ids.update((s, list(p)) for s, p in group)
                MET["add_all"] += 1
        else:
            p = prompt(rng, bs)
            both("cached_prefix", p)
            both("blocks_to_add", p)
    for bad in ([1, -2], [1.5], ["a"], [1, None]):
        both("add", "bad", bad)
    MET["evictions"] += t.cache.evictions
    MET["copies"] += t.stats().shared_blocks


@pytest.mark.parametrize("seed", range(40), ids=lambda s: f"seed{s}")
def test_prefix_managers_agree_on_random_calls(seed):
    run_stream(seed)


def test_every_situation_was_met():
    """The streams above met every situation they are there for."""
    for key in ("hit", "step", "fork", "add_all", "evictions", "error OutOfBlocks",
                "error ConfigError", "error TokenIndexError", "commit", "truncate",
                "truncate of committed tokens", "truncate of pending slots"):
        assert MET[key] > 0, (key, dict(MET))


def test_the_cached_hit_of_the_benchmark_is_the_same():
    tokens = np.random.default_rng(0).integers(0, 49152, 2048).tolist()
    t, f = pair(4096, 16)
    for m in (t, f):
        m.add("warm", tokens)
        m.free("warm")
    a, b = t.add("again", tokens), f.add("again", np.array(tokens))
    same_result(a, b, "benchmark trace")
    assert a.cached_tokens == 2032
    same_state(t, f, "benchmark trace")


def test_swapping_through_both_managers_is_the_same():
    t, f = pair(8, 2)
    swappers = [Swapper(m, HostPool(8, 8, pinned=False)) for m in (t, f)]
    for m in (t, f):
        m.add("a", [1, 2, 3, 4, 5])
        m.add("b", [1, 2, 3, 9])
    out = [s.swap_out(["a"]) for s in swappers]
    assert out[0].tolist() == out[1].tolist()
    same_state(t, f, "after swap out")
    back = [s.swap_in(["a"], [[1, 2, 3, 4, 5]]) for s in swappers]
    assert back[0].tolist() == back[1].tolist()
    same_state(t, f, "after swap in")
