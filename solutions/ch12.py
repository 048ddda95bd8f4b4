"""Chapter 12 (a decode step in a millisecond): counting the operations of a fast decode pass,
and padding a batch up to its bucket.
"""
from __future__ import annotations

import numpy as np

from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model import runner as runner_mod
from pagedkv.model.llama import Batch, PagedKV

__all__ = ["count_operations", "pad_to_bucket"]

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=3, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=256)
KINDS = ("embed", "rms_norm", "gemm", "rope_write_kv", "attention", "silu_mul", "argmax_rows")


def count_operations(layers: int) -> dict:
    """The launches of one decode pass of :class:`~pagedkv.model.runner.FastRunner` on a
    model of ``layers`` layers, by kind, read from ``FastRunner._pass``: an embedding first;
    per layer two norms, four multiplies (q|k|v, the output projection, gate|up, down), the
    rotary positions with the K/V write, the attention and the SwiGLU product; then the final
    norm, the output head's multiply and the greedy choice."""
    per_layer = {"rms_norm": 2, "gemm": 4, "rope_write_kv": 1, "attention": 1, "silu_mul": 1}
    counts = {kind: layers * per_layer.get(kind, 0) for kind in KINDS}
    counts["embed"] += 1
    counts["rms_norm"] += 1
    counts["gemm"] += 1
    counts["argmax_rows"] += 1
    return counts


def pad_to_bucket(tokens, positions, slots, seq_lens, bucket: int):
    """The four per-sequence inputs of a decode step, padded to ``bucket`` rows: the padding
    rows read nothing (length 0) and write nothing (slot -1: slot 0 is a real place in block
    0); token and position 0 are as good as any."""
    n = len(tokens)
    if bucket < n:
        raise ValueError(f"a bucket of {bucket} cannot hold {n} sequences")
    pad = bucket - n
    out = [np.concatenate([np.asarray(a, np.int32), np.full(pad, fill, np.int32)])
           for a, fill in ((tokens, 0), (positions, 0), (slots, -1), (seq_lens, 0))]
    return tuple(out)


# ------------------------------------------------------------------------------ checks

def _counted_pass(layers: int) -> dict:
    """Run one decode pass of the fast runner on a random tiny model with every operation
    wrapped in a counter (the oracle: what the code really launches)."""
    config = LlamaConfig(**{**TINY.__dict__, "layers": layers})
    model = Llama(config, random_weights(config, 3), xp=np)
    kv = PagedKV.for_model(model, 8, 16)
    runner = runner_mod.FastRunner(model, kv, max_batch=2)
    counts = dict.fromkeys(KINDS, 0)
    saved = {}

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapper
    for kind in KINDS:
        if kind == "attention":
            saved[kind] = runner_mod.FastRunner._attend
            runner_mod.FastRunner._attend = counted(kind, saved[kind])
        else:
            saved[kind] = getattr(runner_mod, kind)
            setattr(runner_mod, kind, counted(kind, saved[kind]))
    try:
        one = np.ones(1, np.int32)
        runner.decode(Batch(one, np.zeros(1, np.int32), np.zeros(1, np.int32), one, one,
                            np.zeros((1, 1), np.int32), np.zeros((0, 2), np.int32)))
    finally:
        for kind, fn in saved.items():
            if kind == "attention":
                runner_mod.FastRunner._attend = fn
            else:
                setattr(runner_mod, kind, fn)
    return counts


def check_count_operations(impl=count_operations):
    """Against the operations a real pass launches, counted, for 1, 3 and 30 layers."""
    for layers in (1, 3, 30):
        got, expect = impl(layers), _counted_pass(layers)
        assert got == expect, f"{layers} layers: counted {expect}, got {got}"
    return {"operations for 30 layers": sum(expect.values())}


def check_pad_to_bucket(impl=pad_to_bucket, seed=14):
    """Against the fast runner's own staging (``FastRunner._stage``) for random batches."""
    rng = np.random.default_rng(seed)
    print(f"seed {seed}")
    model = Llama(TINY, random_weights(TINY, 3), xp=np)
    runner = runner_mod.FastRunner(model, PagedKV.for_model(model, 64, 16), max_batch=8)
    B = runner.max_batch
    for _ in range(50):
        n = int(rng.integers(1, 9))
        bucket = int(rng.integers(n, 9))
        lens = rng.integers(1, 200, n).astype(np.int32)
        batch = Batch(rng.integers(0, 96, n).astype(np.int32), lens - 1,
                      rng.integers(0, 64 * 16, n).astype(np.int32), np.ones(n, np.int32),
                      lens, np.zeros((n, 1), np.int32), np.zeros((0, 2), np.int32))
        runner._stage(batch, bucket)
        staged = [runner._meta_host[i * B:i * B + bucket] for i in range(4)]
        got = impl(batch.tokens, batch.positions, batch.slots, batch.seq_lens, bucket)
        for name, g, s in zip(("tokens", "positions", "slots", "seq_lens"), got, staged):
            assert np.array_equal(g, s), f"{name}: {g.tolist()} != {s.tolist()}"
    return {"batches": 50}


def _pad_slots_with_zero(tokens, positions, slots, seq_lens, bucket):
    t, p, s, n = pad_to_bucket(tokens, positions, slots, seq_lens, bucket)
    s[len(tokens):] = 0                       # slot 0 is block 0's first token: overwritten
    return t, p, s, n


def _pad_lengths_with_one(tokens, positions, slots, seq_lens, bucket):
    t, p, s, n = pad_to_bucket(tokens, positions, slots, seq_lens, bucket)
    n[len(tokens):] = 1                       # reads block 0's first token for nothing
    return t, p, s, n


def _no_output_head(layers):
    counts = count_operations(layers)
    counts["gemm"] -= 1
    return counts


def _one_norm_a_layer(layers):
    counts = count_operations(layers)
    counts["rms_norm"] -= layers
    return counts


WRONG = {
    "count_operations": [_no_output_head, _one_norm_a_layer],
    "pad_to_bucket": [_pad_slots_with_zero, _pad_lengths_with_one],
}
