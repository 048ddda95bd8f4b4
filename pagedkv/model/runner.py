"""The runner: the part of the engine that executes what the scheduler decided.

The engine's loop decides which sequences run and what each brings (a :class:`Batch`, built
from the manager's plans); a runner turns that into logits and chosen tokens, and is the only
part that touches the model's arrays and the paged K/V. Two runners, one interface:

* :class:`ModelRunner` — the plain forward pass of :mod:`pagedkv.model.llama`, as chapter 10
  shows it: every operation an array expression, new arrays each step. Clear, and on a GPU
  bound by the launch of ~1,900 small kernels a step (1,905 at batch 1, traced).
* :class:`FastRunner` — the same arithmetic for decode steps, rearranged for speed: fused
  kernels (:mod:`pagedkv.kernels.fused`), one q|k|v and one gate|up multiply a layer through
  cuBLAS (:mod:`pagedkv.kernels.gemm`), the residual adds folded into the multiplies, every
  array allocated once at the largest batch, the step's small inputs uploaded in one copy, the
  greedy choice made on the device, and — on a GPU — each batch size (padded up to a *bucket*:
  1, 2, 4, 8, 16, 24, ...) captured once as a CUDA graph and replayed. A prefill runs the same
  layers eagerly, every new token a row, with the paged prefill kernel for the attention
  (:meth:`FastRunner.prefill`); copy-on-write copies stay on the plain path. On NumPy it runs
  the kernels' references, with the same buffers and order, so the CPU tests exercise the
  same code. With ``single_pass``, a step that has both runs them in one pass
  (:meth:`FastRunner.mixed`): the prefill chunks and the decode rows as one flattened batch,
  a decode row being a chunk of one token (vLLM V1's shape), so the weights are read once.
  The prefill side lives in :mod:`pagedkv.model.prefill_pass`.

Both return, for a batch, float32 logits of each sequence's last token (on the device) and,
where they have it, the greedy token of each row as host ints (``None`` otherwise).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..checks import cdiv, positive_int
from ..errors import ConfigError
from ..kernels import decode_plan, paged_decode_attention
from ..kernels.fused import argmax_rows, embed, rms_norm, rope_write_kv, silu_mul
from ..kernels.gemm import GEMV_AUTO_ROWS, GEMV_MAX_ROWS, gemm
from ..kernels.norm_gemv import norm_gemv, norm_gemv_rope
from ..kernels.pdl import programmatic
from ..kernels.q4_gemv import Q4_MAX_ROWS, q4_gemv
from ..swap import copy_to_device, copy_to_host
from .llama import KERNEL_BLOCK_SIZES, Batch, Llama, PagedKV, forward
from .graphs import buckets, graph_node_count, host_int32
from .launch import DecodeLaunches, Launched
from .prefill_pass import GRAPH_PREFILL_TOKENS, PrefillPasses

__all__ = ["ModelRunner", "FastRunner", "make_runner", "buckets", "graph_node_count",
           "GRAPH_PREFILL_TOKENS", "PDL_AUTO_ROWS"]

#: Decode passes of at most this many rows launch programmatically by default (each kernel
#: may start while the one before it ends): faster on the H200 at 1, 2 and 8 rows, no faster
#: at 64 and 256, where cuBLAS's kernels sit between ours (perf/LOG.md, 2026-12-04).
PDL_AUTO_ROWS = 8


class ModelRunner:
    """The plain path: :func:`~pagedkv.model.llama.forward` for every pass."""

    single_pass = False        # a step's prefill and its decode rows: two passes

    def __init__(self, model: Llama, kv: PagedKV):
        self.model, self.kv = model, kv
        self.max_tokens = model.config.context     # the longest sequence it can run

    def prefill(self, batch: Batch):
        """Logits of each sequence's last new token; no greedy tokens."""
        return forward(self.model, self.kv, batch), None

    def decode(self, batch: Batch):
        return forward(self.model, self.kv, batch), None

    def swap(self, host, ins, outs) -> None:
        """A step's swap copies, one call each way, before any pass writes K/V: ``ins``
        (host block, device block) pairs first (a request back this step may leave
        again), then ``outs`` (device block, host block) into ``host``, a
        :class:`~pagedkv.swap.HostPool`."""
        alloc, spec = self.kv.allocator, self.kv.spec
        # the device pool as [layers, blocks, elements]: a block in every layer
        blocks = alloc.pool.view(spec.dtype).reshape(spec.layers, alloc.num_blocks, -1)
        if len(ins):
            copy_to_device(host, blocks, ins)
        if len(outs):
            copy_to_host(blocks, host, outs)

    def capture_all(self) -> int:
        """CUDA graphs captured ahead of use: none on the plain path."""
        return 0


def make_runner(kind: str, model: Llama, kv: PagedKV, *, max_batch: int,
                max_context: int | None = None, single_pass: bool = False) -> ModelRunner:
    """The runner an engine asks for by name: ``"plain"`` (:class:`ModelRunner`),
    ``"fast"`` (:class:`FastRunner`, with graphs on a GPU) or ``"fast-eager"`` (the same,
    without graphs)."""
    if kind == "plain":
        if single_pass:
            raise ConfigError("single_pass needs a fast runner ('fast' or 'fast-eager')")
        return ModelRunner(model, kv)
    if kind in ("fast", "fast-eager"):
        return FastRunner(model, kv, max_batch=max_batch, max_context=max_context,
                          single_pass=single_pass,
                          graphs=False if kind == "fast-eager" else None)
    raise ConfigError(f"runner must be 'plain', 'fast' or 'fast-eager', got {kind!r}")


class _Views(NamedTuple):
    """Every buffer of one bucket: the first ``b`` rows of the full-size arrays."""
    tokens: object
    positions: object
    slots: object
    seq_lens: object
    tables: object
    x: object          # the residual stream [b, hidden]
    h: object          # a normed copy of it
    qkv: object        # [b, (heads + 2 kv_heads) * head_dim]
    q: object          # [b, heads, head_dim], rotated
    attn: object       # [b, heads, head_dim]
    gate_up: object    # [b, 2 ffn]
    act: object        # [b, ffn]
    logits: object     # float32 [b, vocab]
    greedy: object     # int32 [b]
    plan: object       # the attention's launch for this bucket (GPU), or None
    scratch: object    # its split results (GPU), or None
    counters: object = None      # its splits' merge counters (GPU, with splits), or None
    query_start: object = None   # a prefill's: where each sequence's rows begin


class FastRunner(PrefillPasses, DecodeLaunches, ModelRunner):
    """Decode steps through fused kernels, static buffers and (on a GPU) one CUDA graph per
    bucket; prefills through the same layers, eagerly, with the paged prefill kernel.

    ``max_batch`` sequences decode at most at once; a page table holds ``max_context`` tokens
    (default: the model's context). ``graphs`` (default: on a GPU) replays captured graphs;
    ``graphs=False`` runs the same kernels one by one (the eager path, for debugging);
    ``gemm_method`` picks cuBLAS or the few-row kernel (:func:`~pagedkv.kernels.gemm.gemm`);
    a pass of at most ``fold_rows`` rows (default: where ``"auto"`` takes the few-row kernel,
    up to 2 rows) folds each RMSNorm, and SwiGLU, into the projection after it (``norm_gemv``);
    ``single_pass`` offers the engine :meth:`mixed`: a step's prefill and decode rows in one
    pass. ``weights="q4_1"`` reads the four projections of a decode pass of at most 8 rows
    from ``q4_blocks``, the GGUF's Q4_1 blocks (:func:`~pagedkv.model.gguf.load_q4_blocks`),
    through :func:`~pagedkv.kernels.q4_gemv.q4_gemv`; larger passes, eager prefills and the
    output head read fp16 (``fold_rows`` then defaults to 0: a folded pass reads q|k|v and
    gate|up in fp16). ``pdl`` launches a decode pass's own kernels programmatically on a
    Hopper GPU or later, each starting while the one before it ends
    (:mod:`pagedkv.kernels.pdl`; elsewhere it changes nothing): by default for passes of at
    most ``PDL_AUTO_ROWS`` rows, where it measured faster on the H200 (perf/LOG.md).
    ``merge_in_attention`` has a split attention merge its own pieces (the split that ends
    last merges them; :meth:`~pagedkv.kernels.attention.DecodePlan.run`): one node a layer
    fewer, the same bits, but measured slower on the H200 (perf/LOG.md), so off by default.
    """

    def __init__(self, model: Llama, kv: PagedKV, *, max_batch: int = 256,
                 max_context: int | None = None, graphs: bool | None = None,
                 gemm_method: str = "auto", single_pass: bool = False,
                 fold_rows: int | None = None, weights: str = "fp16",
                 q4_blocks: dict | None = None, pdl: bool | None = None,
                 merge_in_attention: bool = False):
        super().__init__(model, kv)
        if weights not in ("fp16", "q4_1") or (weights == "q4_1") != (q4_blocks is not None):
            raise ConfigError(f"weights must be 'fp16' or 'q4_1' (with q4_blocks, and only "
                              f"then), got {weights!r} with"
                              f"{'' if q4_blocks is not None else 'out'} q4_blocks")
        self.single_pass = bool(single_pass)
        c, xp = model.config, model.xp
        self.on_gpu = xp is not np
        if graphs and not self.on_gpu:
            raise ConfigError("CUDA graphs need the CuPy backend (a GPU)")
        self.graphs = self.on_gpu if graphs is None else bool(graphs)
        self.max_batch = positive_int(max_batch, "max_batch")
        self.gemm_method = gemm_method             # see pagedkv.kernels.gemm.gemm
        if fold_rows is None:
            fold_rows = GEMV_AUTO_ROWS if gemm_method == "auto" and weights == "fp16" else 0
        if isinstance(fold_rows, bool) or not 0 <= fold_rows <= GEMV_MAX_ROWS:
            raise ConfigError(f"fold_rows must be 0 to {GEMV_MAX_ROWS}, got {fold_rows!r}")
        self.fold_rows = fold_rows
        self.pdl = None if pdl is None else bool(pdl)
        self.merge_in_attention = bool(merge_in_attention)
        if kv.block_size not in KERNEL_BLOCK_SIZES:
            raise ConfigError(f"the fast runner decodes with block sizes "
                              f"{KERNEL_BLOCK_SIZES}, not {kv.block_size}")
        max_context = positive_int(max_context or c.context, "max_context")
        self.max_tokens = min(max_context, c.context)
        self.width = cdiv(self.max_tokens, kv.block_size)
        self.buckets = buckets(self.max_batch) if self.on_gpu else None
        B, dt = self.max_batch, model.dtype
        # the step's small inputs, side by side in one int32 array so that one copy uploads
        # them: tokens, positions, slots, seq_lens, and for a launch that follows another the
        # row of the last launch whose greedy token each row takes (B each), then the page
        # tables [B, width]. Two host copies: one is staged while the other's upload waits.
        self._meta_hosts = [host_int32(5 * B + B * self.width, pinned=self.on_gpu)
                            for _ in range(2)]
        self._meta_host = self._meta_hosts[0]
        self._meta = xp.zeros(self._meta_host.shape, np.int32)
        nq, nk = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self._full = dict(
            x=xp.zeros((B, c.hidden), dt), h=xp.zeros((B, c.hidden), dt),
            qkv=xp.zeros((B, nq + 2 * nk), dt), q=xp.zeros((B, c.heads, c.head_dim), dt),
            attn=xp.zeros((B, c.heads, c.head_dim), dt),
            gate_up=xp.zeros((B, 2 * c.ffn), dt), act=xp.zeros((B, c.ffn), dt),
            logits=xp.zeros((B, c.vocab_size), np.float32), greedy=xp.zeros(B, np.int32))
        self._greedy_hosts = [host_int32(B, pinned=self.on_gpu) for _ in range(2)]
        # Every weight as [out, in] (each output's numbers in one row: what the few-row
        # multiply reads best); a copy on the GPU, a view of the model's on NumPy.
        t = (lambda w: xp.ascontiguousarray(w.T)) if self.on_gpu else (lambda w: w.T)
        self.weights = [(t(layer.wqkv), t(layer.wo), t(layer.w_gate_up), t(layer.w_down))
                        for layer in model.layers]
        self.q4 = None if q4_blocks is None else _upload_q4(q4_blocks, self.weights, xp)
        self._views: dict[int, _Views] = {}
        self._graphs: dict[int, object] = {}
        self._prefill_full: dict = {}
        self.stream = xp.cuda.Stream(non_blocking=True) if self.on_gpu else None
        self.steps = 0
        self._uploaded = [None, None]   # per host buffer: an event after its last upload
        self._last: Launched | None = None

    # ------------------------------------------------------------------ buffers
    def _bucket(self, n: int) -> int:
        if n > self.max_batch:
            raise ConfigError(f"a decode batch of {n} sequences is more than max_batch = "
                              f"{self.max_batch}")
        if not self.on_gpu:
            return n
        return next(b for b in self.buckets if b >= n)

    def _view(self, b: int) -> _Views:
        v = self._views.get(b)
        if v is not None:
            return v
        B, m = self.max_batch, self._meta
        cut = {name: a[:b] for name, a in self._full.items()}
        tables = m[5 * B:5 * B + b * self.width].reshape(b, self.width)
        plan = scratch = counters = None
        c, xp = self.model.config, self.model.xp
        if self.on_gpu:
            plan = decode_plan(cut["q"], self.kv.layers[0], tables)
            n = plan.scratch_floats(b, c.heads, c.head_dim)
            scratch = xp.zeros(max(n, 1), np.float32)
            if plan.num_splits > 1 and self.merge_in_attention:   # no merge launch
                counters = xp.zeros(b * c.kv_heads, np.uint32)
        v = self._views[b] = _Views(m[:b], m[B:B + b], m[2 * B:2 * B + b],
                                    m[3 * B:3 * B + b], tables, plan=plan, scratch=scratch,
                                    counters=counters, **cut)
        return v

    # ------------------------------------------------------------------ one decode pass
    def _pass(self, v: _Views) -> None:
        """The decode step's arithmetic into bucket ``v``'s buffers: what a graph captures."""
        rows = v.x.shape[0]
        with programmatic(self.pdl if self.pdl is not None else rows <= PDL_AUTO_ROWS):
            self._layers(v, self._attend)
            m, g = self.model, self.gemm_method
            if self._folds(v):                     # the final norm inside the head's launch
                norm_gemv(v.x, m.norm, m.config.norm_eps, m.embedding, v.logits)
            else:
                rms_norm(v.x, m.norm, m.config.norm_eps, out=v.h)
                gemm(v.h, m.embedding, v.logits, transpose_b=True, method=g)    # output head
            argmax_rows(v.logits, out=v.greedy)

    def _layers(self, v: _Views, attend) -> None:
        """Every layer over the rows of ``v``: the residual stream ``v.x`` from the token
        embeddings to the last layer's output; ``attend(v, layer)`` fills ``v.attn``."""
        m, kv, c = self.model, self.kv, self.model.config
        eps, b = c.norm_eps, v.x.shape[0]
        fold = self._folds(v)                      # each norm inside the projection after it
        # weights="q4_1": a decode pass (not an eager prefill) of at most 8 rows reads blocks
        q4_pass = self.q4 is not None and b <= Q4_MAX_ROWS and v.query_start is None
        embed(v.tokens, m.embedding, out=v.x)
        for i, (layer, (wqkv, wo, w_gate_up, w_down)) in enumerate(zip(m.layers,
                                                                       self.weights)):
            q4 = self.q4[i] if q4_pass else (None,) * 4     # Q4_1 blocks, or fp16
            if fold:                               # norm, q|k|v, RoPE, K/V write: one launch
                norm_gemv_rope(v.x, layer.attn_norm, eps, wqkv, v.qkv, v.positions, v.slots,
                               m.cos, m.sin, v.q, kv.layers[i], c.heads, c.kv_heads)
            else:
                rms_norm(v.x, layer.attn_norm, eps, out=v.h)
                self._project(v.h, wqkv, q4[0], v.qkv)
                rope_write_kv(v.qkv, v.positions, v.slots, m.cos, m.sin, v.q, kv.layers[i],
                              c.heads, c.kv_heads)
            attend(v, i)
            self._project(v.attn.reshape(b, -1), wo, q4[1], v.x, accumulate=True)  # x += o
            if fold:                               # norm, gate|up and SwiGLU: one launch
                norm_gemv(v.x, layer.mlp_norm, eps, w_gate_up, v.act, silu=True)
            else:
                rms_norm(v.x, layer.mlp_norm, eps, out=v.h)
                self._project(v.h, w_gate_up, q4[2], v.gate_up)
                silu_mul(v.gate_up, out=v.act)
            self._project(v.act, w_down, q4[3], v.x, accumulate=True)   # x += mlp(x)

    def _project(self, a, w, q4, out, accumulate: bool = False) -> None:
        """``out = a @ w.T`` (``+=`` with ``accumulate``): from the Q4_1 blocks ``q4`` when
        given (:func:`~pagedkv.kernels.q4_gemv.q4_gemv`), else from the fp16 ``w``."""
        if q4 is not None:
            q4_gemv(a, q4, out, accumulate=accumulate)
        else:
            gemm(a, w, out, accumulate=accumulate, transpose_b=True, method=self.gemm_method)

    def _folds(self, v: _Views) -> bool:
        """Does this pass fold each RMSNorm (and SwiGLU) into the projection after it
        (:func:`~pagedkv.kernels.norm_gemv.norm_gemv`)? For at most ``fold_rows`` rows."""
        return v.x.shape[0] <= self.fold_rows

    def _attend(self, v: _Views, i: int) -> None:
        cache = self.kv.layers[i]
        if v.plan is not None:                     # the GPU: the bucket's fixed launch
            v.plan.run(v.q, cache, v.tables, v.seq_lens, out=v.attn, scale=self.model.scale,
                       scratch=v.scratch, counters=v.counters)
        else:
            paged_decode_attention(v.q, cache, v.tables, v.seq_lens, out=v.attn,
                                   scale=self.model.scale)

def _upload_q4(blocks: dict, weights: list, xp) -> list:
    """Each layer's Q4_1 blocks (Q4_PROJECTIONS order, as the fp16 ``weights``) on the
    device, checked against the fp16 weights' shapes."""
    from ..kernels.q4_gemv import BLOCK_BYTES, QK
    from .gguf import Q4_PROJECTIONS
    out = []
    for i, fp16 in enumerate(weights):
        layer = tuple(xp.asarray(blocks[f"{i}.{name}"]) for name in Q4_PROJECTIONS)
        for name, q, w in zip(Q4_PROJECTIONS, layer, fp16):
            if q.dtype != np.uint8 or q.shape != (w.shape[0], w.shape[1] // QK * BLOCK_BYTES):
                raise ConfigError(f"q4_blocks['{i}.{name}'] must be uint8 [{w.shape[0]}, "
                                  f"{w.shape[1] // QK * BLOCK_BYTES}] for the [{w.shape[0]}, "
                                  f"{w.shape[1]}] weight, got {q.dtype} {tuple(q.shape)}")
        out.append(layer)
    return out
