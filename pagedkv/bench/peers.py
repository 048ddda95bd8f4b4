"""The same bookkeeping traces through nano-vllm's block manager, when it is importable.

``python -m pagedkv.bench --peers`` adds these rows. nano-vllm is not a dependency: put its
source on ``PYTHONPATH`` (it needs ``xxhash``) to include it. The traces match
:mod:`pagedkv.bench`: one block allocated and freed; 1024 sequences of 512 tokens each taking
one more token, which needs a new block in every sequence. nano-vllm's decode path
(``can_append`` then ``may_append`` per sequence) builds no slot mapping or block-table arrays;
ours does.
"""
from __future__ import annotations

import statistics
import time


def nano_vllm(repeat: int) -> dict:
    try:
        from nanovllm.engine.block_manager import BlockManager
        from nanovllm.engine.sequence import Sequence
    except Exception as exc:  # not installed, or its own imports fail
        return {"nano_vllm": f"not importable ({type(exc).__name__}: {exc})"}

    def alloc_free(bm, n):
        allocate, blocks, deallocate = bm._allocate_block, bm.blocks, bm._deallocate_block
        t = time.perf_counter()
        for _ in range(n):
            b = allocate()
            blocks[b].ref_count -= 1
            deallocate(b)
        return (time.perf_counter() - t) / n * 1e9

    bm = BlockManager(4096, 16)
    alloc_free(bm, 100_000)
    af = [alloc_free(bm, 200_000) for _ in range(repeat)]

    Sequence.block_size = 16
    cold, warm = [], []
    for _ in range(repeat * 3):
        bm = BlockManager(1024 * 40, 16)
        seqs = [Sequence(list(range(511))) for _ in range(1024)]
        for s in seqs:
            bm.allocate(s, 0)
        for step in range(1 + 3 * 16 + 1):
            for s in seqs:                 # nano-vllm appends the token, then asks for room
                s.append_token(1)
            t = time.perf_counter()
            for s in seqs:
                if bm.can_append(s):
                    bm.may_append(s)
            dt = (time.perf_counter() - t) * 1e6
            if len(seqs[0]) % 16 == 1:     # this step's token opened a new block
                (cold if step == 1 else warm).append(dt)
        del bm, seqs                       # as in our harness: not right before a timed step
    med = statistics.median
    return {"nano_vllm_alloc_free_ns": round(med(af), 1),
            "nano_vllm_decode_step_us": round(med(cold), 1),
            "nano_vllm_decode_step_in_loop_us": round(med(warm), 1)}
