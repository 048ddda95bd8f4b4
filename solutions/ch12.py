"""Chapter 12 (a decode step in a millisecond): counting the operations of a fast decode pass,
padding a batch up to its bucket, and a residual addition fused with the RMSNorm after it.
"""
from __future__ import annotations

import numpy as np

from pagedkv.kernels import fused
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model import runner as runner_mod
from pagedkv.model.llama import Batch, PagedKV

from ._seeds import names_its_seed

__all__ = ["count_operations", "pad_to_bucket", "add_rms_norm"]

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


def add_rms_norm(x, y, w, eps: float, out=None):
    """``x += y``, then ``out = rms_norm(x) * w``, as one pass over each row would do it: the
    sum rounded once to x's dtype and stored back into ``x`` (the residual stream), and the
    norm computed from that rounded sum, as the two separate calls compute it."""
    out = np.empty_like(x) if out is None else out
    s = (x.astype(np.float32) + y.astype(np.float32)).astype(x.dtype)   # rounded, as x += y
    x[...] = s
    s32 = s.astype(np.float32)
    r = 1.0 / np.sqrt((s32 * s32).mean(axis=-1, keepdims=True) + np.float32(eps))
    out[...] = (s32 * r).astype(x.dtype) * w
    return out


class FusedNormRunner(runner_mod.FastRunner):
    """The fast runner with the attention's output projection written to ``h`` (not added
    into ``x``) and the residual addition fused with the MLP's norm: ``add_rms_norm``."""

    fused = staticmethod(add_rms_norm)

    def _layers(self, v, attend) -> None:
        m, kv, c = self.model, self.kv, self.model.config
        eps, b, g = c.norm_eps, v.x.shape[0], self.gemm_method
        runner_mod.embed(v.tokens, m.embedding, out=v.x)
        for i, (layer, (wqkv, wo, w_gate_up, w_down)) in enumerate(zip(m.layers,
                                                                       self.weights)):
            runner_mod.rms_norm(v.x, layer.attn_norm, eps, out=v.h)
            runner_mod.gemm(v.h, wqkv, v.qkv, transpose_b=True, method=g)
            runner_mod.rope_write_kv(v.qkv, v.positions, v.slots, m.cos, m.sin, v.q,
                                     kv.layers[i], c.heads, c.kv_heads)
            attend(v, i)
            runner_mod.gemm(v.attn.reshape(b, -1), wo, v.h, transpose_b=True, method=g)
            self.fused(v.x, v.h, layer.mlp_norm, eps, out=v.h)      # x += o; h = norm(x)
            runner_mod.gemm(v.h, w_gate_up, v.gate_up, transpose_b=True, method=g)
            runner_mod.silu_mul(v.gate_up, out=v.act)
            runner_mod.gemm(v.act, w_down, v.x, accumulate=True, transpose_b=True, method=g)


# ------------------------------------------------------------------------------ checks

COUNTED = KINDS + ("norm_gemv", "norm_gemv_rope")     # the last two: a folded pass only


def _rope_unfolded(x, norm_w, eps, w, qkv, positions, slots, cos, sin, q_out, cache,
                   q_heads, kv_heads):
    """What ``norm_gemv_rope`` replaces, as the runner's own two (counted) calls."""
    runner_mod.norm_gemv(x, norm_w, eps, w, qkv)
    return runner_mod.rope_write_kv(qkv, positions, slots, cos, sin, q_out, cache, q_heads,
                                    kv_heads)


def counted_pass(layers: int, fold_rows: int = 0, rope_fold: bool = True):
    """Run one decode pass of the fast runner on a random tiny model of ``layers`` layers
    with every operation wrapped in a counter (the oracle: what the code really launches).
    ``fold_rows=0`` is the unfolded pass the chapter reads first; with 1, the pass of one
    row folds each norm (and SwiGLU) into the projection after it, and RoPE with the K/V
    write into the q|k|v one (``rope_fold=False``: not those two, the pass before
    ``norm_gemv_rope``). Returns the counts by kind and the pass's logits."""
    config = LlamaConfig(**{**TINY.__dict__, "layers": layers})
    model = Llama(config, random_weights(config, 3), xp=np)
    kv = PagedKV.for_model(model, 8, 16)
    runner = runner_mod.FastRunner(model, kv, max_batch=2, fold_rows=fold_rows)
    counts = dict.fromkeys(COUNTED, 0)
    saved = {}
    if not rope_fold:
        saved["norm_gemv_rope"] = runner_mod.norm_gemv_rope
        runner_mod.norm_gemv_rope = _rope_unfolded

    def counted(kind, fn):
        def wrapper(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return wrapper
    for kind in COUNTED:
        if kind == "norm_gemv_rope" and not rope_fold:
            continue                               # never called: _rope_unfolded instead
        if kind == "attention":
            saved[kind] = runner_mod.FastRunner._attend
            runner_mod.FastRunner._attend = counted(kind, saved[kind])
        else:
            saved[kind] = getattr(runner_mod, kind)
            setattr(runner_mod, kind, counted(kind, saved[kind]))
    try:
        one = np.ones(1, np.int32)
        logits, _ = runner.decode(Batch(one, np.zeros(1, np.int32), np.zeros(1, np.int32),
                                        one, one, np.zeros((1, 1), np.int32),
                                        np.zeros((0, 2), np.int32)))
    finally:
        for kind, fn in saved.items():
            if kind == "attention":
                runner_mod.FastRunner._attend = fn
            else:
                setattr(runner_mod, kind, fn)
    return counts, np.array(logits)


def check_count_operations(impl=count_operations):
    """Against the operations a real (unfolded) pass launches, counted, for 1, 3 and 30
    layers."""
    for layers in (1, 3, 30):
        expect, _ = counted_pass(layers)
        folded = expect.pop("norm_gemv") + expect.pop("norm_gemv_rope")
        assert folded == 0, "the unfolded pass called norm_gemv"
        got = impl(layers)
        assert got == expect, f"{layers} layers: counted {expect}, got {got}"
    return {"operations for 30 layers": sum(expect.values())}


@names_its_seed
def check_pad_to_bucket(impl=pad_to_bucket, seed=14):
    """Against the fast runner's own staging (``FastRunner._stage``) for random batches."""
    rng = np.random.default_rng(seed)
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


@names_its_seed
def check_add_rms_norm(impl=add_rms_norm, seed=12):
    """Bit for bit against the two calls (``x += y``, then ``fused.rms_norm``) on random rows
    in float16 and float32, ``x`` updated in place; then the greedy tokens and logits of a
    runner that uses ``impl`` inside its layers against the fast runner's (NumPy)."""
    rng = np.random.default_rng(seed)
    rows = 0
    for dtype in (np.float16, np.float32):
        for shape in ((1, 64), (5, 576), (64, 576)):
            x = (rng.standard_normal(shape) * 3).astype(dtype)
            y = rng.standard_normal(shape).astype(dtype)
            w = (1 + 0.1 * rng.standard_normal(shape[1])).astype(dtype)
            ref_x = x.copy()
            ref_x += y
            ref_h = fused.rms_norm(ref_x, w, 1e-5)
            got_x, got_h = x.copy(), np.full_like(x, np.nan)
            impl(got_x, y, w, 1e-5, out=got_h)
            assert np.array_equal(got_x, ref_x), f"{dtype.__name__} {shape}: x is not x + y"
            assert np.array_equal(got_h, ref_h), \
                f"{dtype.__name__} {shape}: h differs from rms_norm(x + y) in " \
                f"{int((got_h != ref_h).sum())} of {got_h.size} numbers"
            rows += shape[0]
    model = Llama(TINY, random_weights(TINY, seed), xp=np)
    lens = np.array([3, 9], np.int32)
    batch = Batch(np.array([5, 7], np.int32), lens - 1, np.array([2, 24], np.int32),
                  np.ones(2, np.int32), lens, np.array([[0], [1]], np.int32),
                  np.zeros((0, 2), np.int32))
    answers = []
    for cls in (runner_mod.FastRunner, FusedNormRunner):
        runner = cls(model, PagedKV.for_model(model, 8, 16), max_batch=2)
        runner.fused = impl
        logits, greedy = runner.decode(batch)
        answers.append((logits.copy(), greedy))
    assert np.array_equal(answers[0][0], answers[1][0]), "the runner's logits changed"
    assert answers[0][1] == answers[1][1]
    return {"rows": rows, "runner's logits": "bit for bit"}


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


def _norm_of_unrounded_sum(x, y, w, eps, out=None):
    s32 = x.astype(np.float32) + y.astype(np.float32)      # never rounded to x's dtype
    x[...] = s32.astype(x.dtype)
    r = 1.0 / np.sqrt((s32 * s32).mean(axis=-1, keepdims=True) + np.float32(eps))
    out[...] = (s32 * r).astype(x.dtype) * w
    return out


def _x_not_updated(x, y, w, eps, out=None):
    return fused.rms_norm(x + y, w, eps, out=out)           # the residual stream keeps x


def _norm_before_the_add(x, y, w, eps, out=None):
    fused.rms_norm(x, w, eps, out=out)
    x += y
    return out


WRONG = {
    "count_operations": [_no_output_head, _one_norm_a_layer],
    "pad_to_bucket": [_pad_slots_with_zero, _pad_lengths_with_one],
    "add_rms_norm": [_norm_of_unrounded_sum, _x_not_updated, _norm_before_the_add],
}
