"""The prefix-cache hit: ``python -m pagedkv.bench.prefix [--json] [--repeat N] [--peers]``.

``prefix_hit_us``: admit a 2048-token prompt whose 128 blocks of 16 tokens are all cached and
idle (no sequence holds them) in a pool of 65,536 blocks, hashing included: the manager hashes
the prompt's blocks, finds 127 of them (the last block is computed again, for the logits of the
last token), takes them out of the idle list, and gives the prompt one fresh block. The prompt
arrives as a list of Python ints, as a tokenizer returns it. Each repetition frees the prompt
again (not timed), which leaves the cache as it was.

With ``--peers``, nano-vllm's block manager runs the same trace in the same process (its source
on ``PYTHONPATH``; it needs ``xxhash``): ``can_allocate`` and ``allocate`` (each hashes the
blocks it looks up), then ``hash_blocks`` for the block that was computed. nano-vllm takes an
idle cached block out of its free list with ``deque.remove``, which walks the list.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import types

import numpy as np

from ..allocator import BlockAllocator
from ..prefix_cache import PrefixCachingManager

NUM_BLOCKS, BLOCK_SIZE, PROMPT = 65_536, 16, 2048
VOCAB = 49_152


def prompt_tokens(seed: int = 0) -> list:
    """The benchmark's prompt: 2048 token ids (a list of Python ints), fixed by ``seed``."""
    return np.random.default_rng(seed).integers(0, VOCAB, PROMPT).tolist()


def teaching_prefix_hit(repeat: int, manager_class=PrefixCachingManager,
                        allocator_class=BlockAllocator) -> list[float]:
    """Microseconds to admit the cached prompt, one number per repetition."""
    prompt = prompt_tokens()
    m = manager_class(allocator_class(NUM_BLOCKS, BLOCK_SIZE, xp=np), BLOCK_SIZE)
    m.add("warm", prompt)                     # computes all 128 blocks and caches them
    m.free("warm")                            # ... which stay, idle
    out = []
    for r in range(repeat + 1):
        t = time.perf_counter()
        plan = m.add(r, prompt)
        dt = (time.perf_counter() - t) * 1e6
        assert plan.cached_tokens == PROMPT - BLOCK_SIZE, plan.cached_tokens
        m.free(r)
        if r:                                 # the first one warms up
            out.append(dt)
    return out


def _nano_vllm():
    """nano-vllm's BlockManager and Sequence, entered without its package ``__init__`` (which
    imports the whole engine: PyTorch, transformers)."""
    for entry in sys.path:
        path = os.path.join(entry or ".", "nanovllm")
        if os.path.isfile(os.path.join(path, "__init__.py")):
            break
    else:
        raise ImportError("nanovllm is not on PYTHONPATH")
    if "nanovllm" not in sys.modules:
        pkg = types.ModuleType("nanovllm")
        pkg.__path__ = [os.path.abspath(path)]
        sys.modules["nanovllm"] = pkg
    from nanovllm.engine.block_manager import BlockManager
    from nanovllm.engine.sequence import Sequence
    return BlockManager, Sequence


def nano_vllm_prefix_hit(repeat: int) -> list[float]:
    BlockManager, Sequence = _nano_vllm()
    Sequence.block_size = BLOCK_SIZE
    prompt = prompt_tokens()
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    warm = Sequence(prompt)
    bm.allocate(warm, 0)
    warm.num_scheduled_tokens = PROMPT        # as its scheduler says after the prefill
    bm.hash_blocks(warm)
    bm.deallocate(warm)                       # its blocks: idle at the end of the free list
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
    med = statistics.median
    t = teaching_prefix_hit(repeat * 20)
    r = {"teaching_prefix_hit_us": round(med(t), 1), "teaching_prefix_hit_us_min":
         round(min(t), 1), "python": platform.python_version(), "numpy": np.__version__,
         "machine": platform.machine()}
    if peers:
        try:
            n = nano_vllm_prefix_hit(repeat)
        except Exception as exc:              # not there, or its own imports fail
            r["nano_vllm"] = f"not importable ({type(exc).__name__}: {exc})"
        else:
            r["nano_vllm_prefix_hit_us"] = round(med(n), 1)
            r["nano_vllm_prefix_hit_us_min"] = round(min(n), 1)
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.prefix",
                                description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repeat", type=int, default=7, help="repetitions (default 7)")
    p.add_argument("--peers", action="store_true",
                   help="also run nano-vllm's block manager on the trace, if importable")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    r = run(args.repeat, args.peers)
    if args.json:
        print(json.dumps(r))
        return 0
    print(f"admit a cached 2048-token prompt (127 of 128 blocks hit), pool of {NUM_BLOCKS:,}")
    print(f"  teaching core:  {r['teaching_prefix_hit_us']:>10.1f} us median, "
          f"{r['teaching_prefix_hit_us_min']:.1f} min")
    if "nano_vllm_prefix_hit_us" in r:
        print(f"  nano-vllm:      {r['nano_vllm_prefix_hit_us']:>10.1f} us median, "
              f"{r['nano_vllm_prefix_hit_us_min']:.1f} min (same process)")
    elif "nano_vllm" in r:
        print(f"  nano-vllm: {r['nano_vllm']}")
    print(f"(Python {r['python']}, NumPy {r['numpy']}, {r['machine']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
