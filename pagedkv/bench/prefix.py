"""The prefix-cache hit: ``python -m pagedkv.bench.prefix [--json] [--repeat N] [--peers]``.

Admit a 2048-token prompt whose 128 blocks of 16 tokens are all cached and idle (no sequence
holds them) in a pool of 65,536 blocks, hashing included: the manager hashes the prompt's
blocks, finds 127 of them (the last block is computed again, for the logits of the last
token), takes them out of the idle list, and gives the prompt one fresh block. Each
repetition frees the prompt again (not timed), which leaves the cache as it was.

* ``prefix_hit_us``: the fast path (:mod:`pagedkv.fast.prefix`), the prompt an int64 NumPy
  array (as a tokenizer's array output, or an engine's buffer of token ids, holds it);
* ``prefix_hit_list_us``: the fast path, the prompt a list of Python ints (its conversion
  to an array and the check of its ids included);
* ``teaching_prefix_hit_us``: the teaching core (:mod:`pagedkv.prefix_cache`), a list.

With ``--peers``, nano-vllm's block manager runs the same trace in the same process (its
source on ``PYTHONPATH``, entered as :mod:`pagedkv.bench.peers` does; it needs ``xxhash``),
the prompt a list, as its ``Sequence`` holds it: ``can_allocate`` and ``allocate`` (each
hashes the blocks it looks up), then ``hash_blocks`` for the block that was computed.
nano-vllm takes an idle cached block out of its free list with ``deque.remove``, which walks
the list.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time

import numpy as np

from .. import fast
from ..allocator import BlockAllocator
from . import cpu_name
from ..fast.prefix import PrefixCachingManager as FastPrefixCachingManager
from ..prefix_cache import PrefixCachingManager

NUM_BLOCKS, BLOCK_SIZE, PROMPT = 65_536, 16, 2048
VOCAB = 49_152


def prompt_tokens(seed: int = 0) -> list:
    """The benchmark's prompt: 2048 token ids (a list of Python ints), fixed by
    ``seed``."""
    return np.random.default_rng(seed).integers(0, VOCAB, PROMPT).tolist()


def prefix_hit(repeat: int, path: str = "teaching", as_array: bool = False) -> list[float]:
    """Microseconds to admit the cached prompt, one number per repetition, on the
    ``"teaching"`` or the ``"fast"`` path, the prompt a list or (``as_array``) an array."""
    prompt = prompt_tokens()
    if path == "fast":
        m = FastPrefixCachingManager(fast.BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, xp=np),
                                     BLOCK_SIZE)
    else:
        m = PrefixCachingManager(BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, xp=np), BLOCK_SIZE)
    m.add("warm", prompt)                     # computes all 128 blocks and caches them
    m.free("warm")                            # ... which stay, idle
    given = np.array(prompt, dtype=np.int64) if as_array else prompt
    out = []
    for r in range(repeat + 1):
        t = time.perf_counter()
        plan = m.add(r, given)
        dt = (time.perf_counter() - t) * 1e6
        assert plan.cached_tokens == PROMPT - BLOCK_SIZE, plan.cached_tokens
        m.free(r)
        if r:                                 # the first one warms up
            out.append(dt)
    return out


def nano_vllm_prefix_hit(repeat: int) -> list[float]:
    """Microseconds for nano-vllm's block manager to admit the cached prompt."""
    from .peers import _nano_vllm_modules
    BlockManager, Sequence, _ = _nano_vllm_modules()
    Sequence.block_size = BLOCK_SIZE
    prompt = prompt_tokens()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    warm = Sequence(prompt)
    bm.allocate(warm, 0)
    warm.num_scheduled_tokens = PROMPT        # as its scheduler says after the prefill
    bm.hash_blocks(warm)
    bm.deallocate(warm)                       # its blocks: idle, at the free list's end
    out = []
    for r in range(repeat + 1):
        seq = Sequence(prompt)
        t = time.perf_counter()
        cached = bm.can_allocate(seq)
        bm.allocate(seq, cached)
        seq.num_scheduled_tokens = PROMPT - seq.num_cached_tokens
        bm.hash_blocks(seq)
        dt = (time.perf_counter() - t) * 1e6
        assert cached * BLOCK_SIZE == PROMPT - BLOCK_SIZE, cached
        bm.deallocate(seq)
        if r:
            out.append(dt)
    return out


def run(repeat: int = 7, peers: bool = False) -> dict:
    """The prefix-hit numbers: medians and minima (microseconds), with what ran them."""
    r: dict = {}

    def put(key, values):
        r[key] = round(statistics.median(values), 1)
        r[key + "_min"] = round(min(values), 1)

    put("prefix_hit_us", prefix_hit(50 * repeat, "fast", as_array=True))
    put("prefix_hit_list_us", prefix_hit(50 * repeat, "fast"))
    put("teaching_prefix_hit_us", prefix_hit(20 * repeat))
    if peers:
        from .peers import _describe, _source_of
        try:
            put("nano_vllm_prefix_hit_us", nano_vllm_prefix_hit(repeat))
            r["nano_vllm"] = _describe(_source_of("nanovllm"))
        except Exception as exc:              # not there, or not the shape we call
            r["nano_vllm"] = f"not importable ({type(exc).__name__}: {exc})"
    r.update(python=platform.python_version(), numpy=np.__version__,
             machine=platform.machine(), cpu=cpu_name(),
             date=datetime.datetime.now(datetime.timezone.utc)
             .strftime("%Y-%m-%d %H:%M UTC"))
    return r


ROWS = [("fast path, the prompt an array", "prefix_hit_us"),
        ("fast path, the prompt a list", "prefix_hit_list_us"),
        ("teaching core, the prompt a list", "teaching_prefix_hit_us"),
        ("nano-vllm, the same trace, same process", "nano_vllm_prefix_hit_us")]


def report(r: dict) -> None:
    """The results as a table."""
    print(f"admit a cached 2048-token prompt (127 of 128 blocks found) in a pool of "
          f"{NUM_BLOCKS:,} blocks, microseconds:")
    for label, key in ROWS:
        if key in r:
            print(f"  {label:<42} {r[key]:>10.1f} median {r[key + '_min']:>10.1f} min")
    if "nano_vllm_prefix_hit_us" not in r and "nano_vllm" in r:
        print(f"  nano-vllm: {r['nano_vllm']}")
    print(f"(Python {r['python']}, NumPy {r['numpy']}, {r['cpu']}, {r['date']})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.prefix",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=7, help="repetitions (default 7)")
    p.add_argument("--peers", action="store_true",
                   help="also run nano-vllm's block manager on the trace, if "
                        "importable")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    r = run(args.repeat, args.peers)
    r["command"] = " ".join(["python -m pagedkv.bench.prefix", *(argv or sys.argv[1:])])
    if args.json:
        print(json.dumps(r))
    else:
        report(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
