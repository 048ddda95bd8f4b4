"""Disaggregated prefill and decode: prompts prefilled on one pool, decoded on another.

A prefill pass is long and compute-bound, a decode step short and bound by memory, and
when both share a GPU each slows the other. DistServe and Mooncake give them separate
GPUs: the prefill GPU computes a prompt's K/V and its first token, sends the blocks into
blocks the decode GPU's manager allocated, and frees its own. Here both pools are in one
process (two NumPy pools on a CPU); :mod:`pagedkv.bench.disagg` runs the same steps as
two processes on two GPUs, with the blocks crossing over NCCL.

The passes are greedy and plain (:func:`~pagedkv.model.llama.forward`, a manager of
counts), small enough to read beside the transfer; the engine of chapter 10 is what the
result is checked against.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..transfer import copy_between, plan_transfer, pool_blocks
from .llama import Batch, PagedKV, forward

__all__ = ["prefill_batch", "decode_batch", "greedy", "prefill", "decode",
           "disaggregated"]


def prefill_batch(manager, seq_id, prompt) -> Batch:
    """Add ``seq_id`` with its prompt to ``manager``: the batch that prefills it."""
    n = len(prompt)
    plan = manager.add(seq_id, n)
    return Batch(tokens=np.asarray(prompt, dtype=np.int32),
                 positions=np.arange(n, dtype=np.int32), slots=plan.slots,
                 query_lens=np.array([n], dtype=np.int32),
                 seq_lens=np.array([n], dtype=np.int32),
                 block_tables=manager.block_table(seq_id)[None], copies=plan.copies)


def decode_batch(manager, seq_ids, tokens) -> Batch:
    """One decode step: each sequence of ``seq_ids`` brings its pending token."""
    step = manager.step(seq_ids)
    return Batch(tokens=np.asarray(tokens, dtype=np.int32), positions=step.seq_lens - 1,
                 slots=step.slot_mapping,
                 query_lens=np.ones(len(tokens), dtype=np.int32),
                 seq_lens=step.seq_lens, block_tables=step.block_tables,
                 copies=step.copies)


def greedy(logits) -> list:
    """The most likely token of each row (host ints)."""
    return backend.to_numpy(logits.argmax(axis=1)).astype(np.int64).tolist()


def prefill(run, manager, prompts) -> list:
    """Prefill each prompt (sequence ids 0, 1, ...); returns each one's first token.
    ``run(batch)`` is the forward pass (on one pool, or sharded)."""
    return [greedy(run(prefill_batch(manager, i, p)))[0] for i, p in enumerate(prompts)]


def decode(run, manager, first, steps: int) -> list:
    """``steps`` greedy steps for sequences 0, 1, ... from their first tokens; returns
    each one's generated tokens (its first one included)."""
    out = [[t] for t in first]
    ids = list(range(len(first)))
    for _ in range(steps):
        nxt = greedy(run(decode_batch(manager, ids, [o[-1] for o in out])))
        for o, t in zip(out, nxt):
            o.append(t)
    return out


def disaggregated(model, prompts, new_tokens: int, a: PagedKV, b: PagedKV) -> dict:
    """Prefill ``prompts`` on cache ``a`` (sequence ids 0, 1, ...), move their blocks
    to cache ``b`` in one transfer, free them on ``a``, decode until each has
    ``new_tokens`` tokens on ``b``. Returns the tokens and the plan."""
    first = prefill(lambda batch: forward(model, a, batch), a.manager, prompts)
    plan = plan_transfer(a.manager, b.manager, range(len(prompts)))
    copy_between(pool_blocks(a), pool_blocks(b), plan.pairs)
    for s in plan.seq_ids:
        a.manager.free(s)                        # the bytes are on B now
    tokens = decode(lambda batch: forward(model, b, batch), b.manager, first,
                    new_tokens - 1)
    return dict(tokens=tokens, plan=plan)
