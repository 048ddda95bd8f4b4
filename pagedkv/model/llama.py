"""A Llama forward pass whose keys and values live only in pagedkv's pool.

Three parts:

* :class:`Llama` — the weights on the backend (float32 NumPy on a CPU, float16 CuPy on a GPU)
  and the arithmetic of one layer, cut where the cache comes in: :meth:`Llama.qkv` (norm,
  projections, rotary positions) before, :meth:`Llama.finish_layer` (output projection, residual,
  feed-forward) after. Nothing in it knows about caches.
* :class:`PagedKV` — one :class:`~pagedkv.manager.KVCacheManager` over one pool, seen as one
  ``[num_blocks, 2, block_size, kv_heads, head_dim]`` array per layer (with ``kv_dtype="int8"``
  one :class:`~pagedkv.kernels.kv8.Cache8` per layer: int8 numbers and their scales). A block
  id names the same block in every layer: a page table is kept once, for all layers.
* :func:`forward` — a batch of sequences, each bringing some new tokens: copy-on-write copies
  first, then for every layer write the new K/V at the plan's slots and attend through the page
  tables. Prefill and decode are the same pass; only the attention differs (a decode step, one
  new token per sequence, uses the paged decode kernel).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from .. import backend
from ..allocator import BlockAllocator
from ..checks import cdiv
from ..errors import ConfigError
from ..kernels import copy_blocks, paged_decode_attention, write_kv
from ..kernels.kv8 import Cache8, layer_block_bytes, read_rows
from ..manager import KVCacheManager
from .gguf import LlamaConfig

__all__ = ["Llama", "PagedKV", "Batch", "forward", "prefill_attention", "random_weights",
           "KERNEL_BLOCK_SIZES"]

#: Block sizes :func:`pagedkv.kernels.paged_decode_attention` is compiled for. A decode step at
#: any other block size (1, in the tests) reads the blocks with :func:`prefill_attention`.
KERNEL_BLOCK_SIZES = (8, 16, 32)


class Layer(NamedTuple):
    attn_norm: object
    wqkv: object      # [hidden, (heads + 2 * kv_heads) * head_dim]: q, k, v in one multiply
    wo: object
    mlp_norm: object
    w_gate_up: object  # [hidden, 2 * ffn]: gate and up in one multiply
    w_down: object


class Llama:
    """The model's weights on the backend, and the arithmetic of its layers.

    ``weights`` maps names to float32 NumPy arrays (see :func:`~pagedkv.model.gguf.load_gguf`);
    they are uploaded once, in ``dtype`` (default: float32 on NumPy, float16 on CuPy).
    """

    def __init__(self, config: LlamaConfig, weights: dict, *, xp=None, dtype=None):
        self.config = c = config
        self.xp = xp = backend.xp if xp is None else xp
        self.dtype = np.dtype(dtype or (np.float32 if xp is np else np.float16))
        up = lambda a: xp.asarray(np.asarray(a, dtype=self.dtype))  # noqa: E731
        self.embedding = up(weights["embed"])                 # [vocab, hidden], also the head
        self.norm = up(weights["norm"])
        self.layers = [Layer(
            attn_norm=up(weights[f"{i}.attn_norm"]),
            wqkv=up(np.concatenate([weights[f"{i}.{n}"] for n in ("wq", "wk", "wv")], axis=1)),
            wo=up(weights[f"{i}.wo"]),
            mlp_norm=up(weights[f"{i}.mlp_norm"]),
            w_gate_up=up(np.concatenate([weights[f"{i}.w_gate"], weights[f"{i}.w_up"]], 1)),
            w_down=up(weights[f"{i}.w_down"])) for i in range(c.layers)]
        # RoPE: position p turns pair i of every head by the angle p * base^(-2i / head_dim)
        inv = c.rope_base ** (-np.arange(0, c.head_dim, 2, dtype=np.float64) / c.head_dim)
        angles = np.outer(np.arange(c.context), inv)           # [context, head_dim / 2]
        self.cos = xp.asarray(np.cos(angles).astype(np.float32))
        self.sin = xp.asarray(np.sin(angles).astype(np.float32))
        self.scale = 1.0 / math.sqrt(c.head_dim)

    def kv_spec(self, kv_dtype=None):
        """The cache's shape; ``kv_dtype`` None: the model's dtype, ``"int8"``: the 8-bit
        cache (:mod:`pagedkv.kernels.kv8`)."""
        return self.config.kv_spec(self.dtype if kv_dtype is None else kv_dtype)

    @property
    def weight_bytes(self) -> int:
        arrays = [self.embedding, self.norm] + [a for layer in self.layers for a in layer]
        return sum(int(a.nbytes) for a in arrays)

    # ------------------------------------------------------------------ the pieces
    def linear(self, x, w):
        """Every matrix multiply of the model goes through here (the benchmark times it)."""
        return x @ w

    def rms_norm(self, x, w):
        x32 = x.astype(np.float32)
        r = 1.0 / self.xp.sqrt((x32 * x32).mean(axis=-1, keepdims=True) + self.config.norm_eps)
        return (x32 * r).astype(self.dtype) * w

    def rope(self, x, positions):
        """Rotary positions, rotate-half form: ``x`` [tokens, heads, head_dim]."""
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half].astype(np.float32), x[..., half:].astype(np.float32)
        out = self.xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return out.astype(self.dtype)

    def embed(self, tokens):
        return self.embedding[tokens]

    def qkv(self, i: int, x, positions):
        """Layer ``i`` up to attention: q [T, heads, D], k and v [T, kv_heads, D]."""
        c, layer = self.config, self.layers[i]
        h = self.linear(self.rms_norm(x, layer.attn_norm), layer.wqkv)
        nq, nk = c.heads * c.head_dim, c.kv_heads * c.head_dim
        q = h[:, :nq].reshape(-1, c.heads, c.head_dim)
        k = h[:, nq:nq + nk].reshape(-1, c.kv_heads, c.head_dim)
        v = self.xp.ascontiguousarray(h[:, nq + nk:]).reshape(-1, c.kv_heads, c.head_dim)
        return self.rope(q, positions), self.rope(k, positions), v

    def finish_layer(self, i: int, x, attn):
        """Layer ``i`` after attention: output projection, residual, SwiGLU feed-forward."""
        layer = self.layers[i]
        x = x + self.linear(attn.reshape(attn.shape[0], -1), layer.wo)
        gate_up = self.linear(self.rms_norm(x, layer.mlp_norm), layer.w_gate_up)
        gate, up = gate_up[:, :self.config.ffn], gate_up[:, self.config.ffn:]
        g32 = gate.astype(np.float32)
        act = (g32 / (1.0 + self.xp.exp(-g32)) * up.astype(np.float32)).astype(self.dtype)
        return x + self.linear(act, layer.w_down)

    def logits(self, x):
        """float32 ``[tokens, vocab]``: the final norm, then the embedding as the output head."""
        return self.linear(self.rms_norm(x, self.norm), self.embedding.T).astype(np.float32)


def random_weights(config: LlamaConfig, seed: int = 0) -> dict:
    """Weights for a randomly initialised model of ``config`` (for tests: the code path is the
    real one, the numbers are not). The spread keeps the logits far from ties."""
    rng = np.random.default_rng(seed)
    c = config
    mat = lambda i, o: (rng.standard_normal((i, o)) / math.sqrt(i)).astype(np.float32)  # noqa
    w = {"embed": (0.3 * rng.standard_normal((c.vocab_size, c.hidden))).astype(np.float32),
         "norm": (1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)}
    for i in range(c.layers):
        w[f"{i}.attn_norm"] = (1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)
        w[f"{i}.mlp_norm"] = (1 + 0.1 * rng.standard_normal(c.hidden)).astype(np.float32)
        w[f"{i}.wq"] = 2 * mat(c.hidden, c.heads * c.head_dim)
        w[f"{i}.wk"] = 2 * mat(c.hidden, c.kv_heads * c.head_dim)
        w[f"{i}.wv"] = mat(c.hidden, c.kv_heads * c.head_dim)
        w[f"{i}.wo"] = mat(c.heads * c.head_dim, c.hidden)
        w[f"{i}.w_gate"], w[f"{i}.w_up"] = mat(c.hidden, c.ffn), mat(c.hidden, c.ffn)
        w[f"{i}.w_down"] = mat(c.ffn, c.hidden)
    return w


# ---------------------------------------------------------------------- the paged cache

class PagedKV:
    """The KV cache of a whole model: one pool, one manager, one array view per layer.

    The allocator's block ``b`` is ``block_bytes = spec.block_bytes(block_size)`` bytes of
    bookkeeping, all layers together; its bytes sit in the pool as one slice per layer. The pool
    is laid out layer by layer (``[layers, num_blocks, 2, block_size, kv_heads, head_dim]``) so
    that each layer's cache is one C-contiguous array, as the kernels need. An int8 spec lays
    it out as ``[layers, num_blocks, layer_block_bytes]``: each layer a
    :class:`~pagedkv.kernels.kv8.Cache8` over its bytes (a block's numbers, then its scales),
    the same block id naming the same place in every layer.
    """

    def __init__(self, spec, num_blocks: int, block_size: int, *, xp=None,
                 allocator_cls=BlockAllocator, manager_cls=KVCacheManager):
        self.spec, self.block_size = spec, block_size
        self.allocator = allocator_cls(num_blocks, spec.block_bytes(block_size), xp=xp)
        self.manager = manager_cls(self.allocator, block_size)
        # Fresh memory may hold any bit pattern, NaN included. The slots past a sequence's end
        # are masked out of attention, but a masked weight 0 times NaN is still NaN in the
        # NumPy decode path: start from zeros (afterwards unused slots hold old, finite K/V).
        self.allocator.pool[...] = 0
        if spec.quantized:
            raw = self.allocator.pool.reshape(spec.layers, num_blocks, layer_block_bytes(
                block_size, spec.kv_heads, spec.head_dim))
            self.layers = [Cache8(r, block_size, spec.kv_heads, spec.head_dim) for r in raw]
        else:
            pool = self.allocator.pool.view(np.dtype(spec.dtype))
            shape = (spec.layers, num_blocks, 2, block_size, spec.kv_heads, spec.head_dim)
            self.layers = list(pool.reshape(shape))          # views, no copy
        self.copies_done = 0

    @classmethod
    def for_model(cls, model: Llama, num_blocks: int, block_size: int, *, kv_dtype=None,
                  **classes) -> "PagedKV":
        """The cache for ``model``; ``kv_dtype`` None (the model's dtype) or ``"int8"``;
        ``classes``: ``allocator_cls`` and ``manager_cls`` (the teaching core's by default,
        :mod:`pagedkv.fast`'s for speed)."""
        if kv_dtype is not None and kv_dtype != "int8" and np.dtype(kv_dtype) != model.dtype:
            raise ConfigError(f"kv_dtype must be None (the model's {model.dtype}), "
                              f"{str(model.dtype)!r} or 'int8', got {kv_dtype!r}")
        return cls(model.kv_spec(kv_dtype), num_blocks, block_size, xp=model.xp, **classes)

    def copy(self, pairs) -> None:
        """Execute copy-on-write copies (src, dst) in every layer, before any write."""
        if len(pairs):
            copy_blocks(self.layers, pairs)
            self.copies_done += len(pairs)

    def write(self, i: int, k, v, slots) -> None:
        write_kv(self.layers[i], k, v, slots)


# ---------------------------------------------------------------------- one forward pass

class Batch(NamedTuple):
    """What one forward pass computes: every sequence brings ``query_lens[b]`` new tokens,
    packed one sequence after another. All arrays are small int32 host arrays from the plans."""
    tokens: np.ndarray        # [T] the new tokens
    positions: np.ndarray     # [T] their positions in their sequences
    slots: np.ndarray         # [T] where their K/V go
    query_lens: np.ndarray    # [B] new tokens per sequence
    seq_lens: np.ndarray      # [B] tokens in the cache after this pass
    block_tables: np.ndarray  # [B, W] physical blocks, -1 padded
    copies: np.ndarray        # [n, 2] copy-on-write copies to do first

    @property
    def is_decode(self) -> bool:
        return bool(np.all(self.query_lens == 1))


def prefill_attention(q, cache, block_tables, seq_lens, query_lens, scale):
    """The new tokens of each sequence attend causally over that sequence's whole K/V, read
    through its page table: a prefix already in the cache counts like fresh tokens.

    ``q`` [T, heads, D] packed by sequence; the last ``query_lens[b]`` of the ``seq_lens[b]``
    tokens of sequence ``b`` are new. Host int arrays for the lengths, ``block_tables`` on the
    device. Returns [T, heads, D] in q's dtype.
    """
    xp = backend.xp if not isinstance(q, np.ndarray) else np
    bs, kv_heads, d = cache.shape[2], cache.shape[3], cache.shape[4]
    group = q.shape[1] // kv_heads
    out, start = [], 0
    for b, (n, length) in enumerate(zip(query_lens.tolist(), seq_lens.tolist())):
        blocks = block_tables[b, :cdiv(length, bs)]
        if isinstance(cache, Cache8):                         # dequantized: [blocks, bs, ...]
            rows = (blocks[:, None], xp.arange(bs)[None, :])
            k, v = (read_rows(cache, *rows, i).reshape(-1, kv_heads, d)[:length] for i in (0, 1))
        else:
            kv = cache[blocks].astype(np.float32)             # [blocks, 2, bs, kv_heads, D]
            k = kv[:, 0].reshape(-1, kv_heads, d)[:length]    # [length, kv_heads, D]
            v = kv[:, 1].reshape(-1, kv_heads, d)[:length]
        qb = q[start:start + n].astype(np.float32).reshape(n, kv_heads, group, d)
        s = xp.einsum("nhgd,lhd->hgnl", qb, k) * scale       # [kv_heads, group, n, length]
        past = length - n                                     # new token j sits at past + j
        allowed = xp.arange(length)[None, :] <= (past + xp.arange(n))[:, None]
        s = xp.where(allowed, s, -xp.inf)
        p = xp.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        o = xp.einsum("hgnl,lhd->nhgd", p, v).reshape(n, kv_heads * group, d)
        out.append(o.astype(q.dtype))
        start += n
    return xp.concatenate(out, axis=0)


def attend(model: Llama, kv: PagedKV, q, i: int, batch: Batch, dev: dict):
    """Attention of layer ``i``: the paged decode kernel when every sequence brings one token
    and the block size is one it is compiled for, else :func:`prefill_attention`."""
    if batch.is_decode and kv.block_size in KERNEL_BLOCK_SIZES:
        return paged_decode_attention(q, kv.layers[i], dev["block_tables"], dev["seq_lens"],
                                      scale=model.scale)
    return prefill_attention(q, kv.layers[i], dev["block_tables"], batch.seq_lens,
                             batch.query_lens, model.scale)


def forward(model: Llama, kv: PagedKV, batch: Batch):
    """One pass over ``batch``; returns float32 logits ``[B, vocab]`` of each sequence's last
    new token (on the backend's device)."""
    xp = model.xp
    kv.copy(batch.copies)                                     # copy-on-write, all layers
    dev = {name: xp.asarray(getattr(batch, name))             # one small upload each
           for name in ("tokens", "positions", "slots", "block_tables", "seq_lens")}
    x = model.embed(dev["tokens"])
    for i in range(model.config.layers):
        q, k, v = model.qkv(i, x, dev["positions"])
        kv.write(i, k, v, dev["slots"])                       # K/V into the pool, then ...
        o = attend(model, kv, q, i, batch, dev)               # ... read back through the tables
        x = model.finish_layer(i, x, o)
    last = np.cumsum(batch.query_lens) - 1                    # each sequence's last new token
    return model.logits(x[xp.asarray(last)])

