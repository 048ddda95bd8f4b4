"""The runner: the part of the engine that executes a step's plan, and the only part that
touches the model's arrays, the paged K/V and the sampler.

A plan (:class:`~pagedkv.scheduler.Plan`, sealed by :class:`~pagedkv.model.memory.EngineMemory`)
comes in; the step's drawn token ids go out (:class:`StepOutput`, host ints, and for beam
search each beam row's best tokens and their log-probabilities). In between, in order:

1. the swap copies (host to device, then device to host);
2. the prefill parts, packed into passes of about ``prefill_chunk`` tokens: the logits of
   each part's last row;
3. the first tokens of the prompts the prefill completes, drawn from those rows;
4. one decode pass over the decode rows, each row's input token from the host or, on the
   device, from a token drawn by the step before or by step 3 (``follow``);
5. one token drawn from each decode row; every draw of the step downloaded at once.

:meth:`ModelRunner.launch` queues all that and returns; :meth:`ModelRunner.land` waits for
the download. An engine on a GPU plans step n + 1 between the two (chapter 13); on NumPy
the work is done by the time ``launch`` returns. Drawing is the sampler's of
:mod:`pagedkv.kernels.sampling`: greedy, or temperature, top-p and top-k with each
sequence's own counter-based random stream, the same tokens on NumPy and CuPy for the same
logits; a step whose draws are all greedy takes each row's argmax instead.

Two runners, one interface:

* :class:`ModelRunner` — the plain forward pass of :mod:`pagedkv.model.llama`, as chapter 10
  shows it: every operation an array expression, new arrays each step. Clear, and on a GPU
  bound by the launch of ~1,900 small kernels a step (1,905 at batch 1, traced).
* :class:`FastRunner` — the same arithmetic for decode steps, rearranged for speed: fused
  kernels (:mod:`pagedkv.kernels.fused`, :mod:`pagedkv.kernels.norm_gemv`), one q|k|v and
  one gate|up multiply a layer (:mod:`pagedkv.kernels.gemm`), the residual adds folded into
  the multiplies, every array allocated once at the largest batch, the step's small inputs
  uploaded in one copy, the greedy choice made on the device, and — on a GPU — each batch
  size (padded up to a *bucket*: 1, 2, 4, 8, 16, 24, ...) captured once as a CUDA graph and
  replayed, every kernel launched programmatically (:mod:`pagedkv.kernels.pdl`) where that
  measured faster. Its prefills are in :mod:`pagedkv.model.prefill_pass`, its launches in
  :mod:`pagedkv.model.launch`. On NumPy it runs the kernels' references, with the same
  buffers and order, so the CPU tests exercise the same code.
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
from ..kernels.sampling import pack_rows, sample_packed
from ..swap import copy_to_device, copy_to_host
from .graphs import Views, buckets, graph_node_count, host_int32
from .launch import DecodeLaunches
from .llama import KERNEL_BLOCK_SIZES, Batch, Llama, PagedKV, forward
from .prefill_pass import GRAPH_PREFILL_TOKENS, PrefillPasses
from .sampling import log_softmax_topk

__all__ = ["ModelRunner", "FastRunner", "StepOutput", "Launched", "make_runner",
           "buckets", "graph_node_count", "GRAPH_PREFILL_TOKENS", "PDL_AUTO_ROWS"]

#: Decode passes of at most this many rows launch programmatically by default (each kernel
#: may start while the one before it ends): faster on the H200 at 1, 2 and 8 rows, no faster
#: at 64 and 256, where cuBLAS's kernels sit between ours (perf/LOG.md, 2026-12-04).
PDL_AUTO_ROWS = 8


class StepOutput(NamedTuple):
    """What a step gives back: its draws' token ids (host ints, in the plan's order) and,
    for each beam-search request of the plan, its rows' best tokens' log-probabilities and
    ids."""
    tokens: np.ndarray
    beams: list


class Launched(NamedTuple):
    """A step started by :meth:`ModelRunner.launch`: its plan, the event after its
    download (None: already done), the host array its draws land in, and the logits of
    its parts' last rows and of its decode rows (for beam rows, read at landing)."""
    plan: object
    done: object
    tokens: np.ndarray
    logits: tuple


class ModelRunner:
    """The plain path: :func:`~pagedkv.model.llama.forward` for every pass. At most
    ``max_seqs`` sequences run at once (a step draws at most two tokens each: a prompt's
    first and the one after it); ``stop_ids`` are the tokens a ``min_tokens`` ban takes
    out; prefill parts are packed into passes of about ``prefill_chunk`` tokens."""

    def __init__(self, model: Llama, kv: PagedKV, *, max_seqs: int = 256,
                 prefill_chunk: int = 512, stop_ids=()):
        self.model, self.kv = model, kv
        self.max_tokens = model.config.context     # the longest sequence it can run
        self.prefill_chunk = positive_int(prefill_chunk, "prefill_chunk")
        self.stop_ids = np.array(sorted(stop_ids), np.int64)
        self.on_gpu = model.xp is not np
        self.host_pool = None                      # the swap space, set by the engine
        width = 2 * positive_int(max_seqs, "max_seqs")
        self._drawn = model.xp.zeros((2, width), np.int32)   # the draws of the last two steps
        self._drawn_hosts = [host_int32(width, pinned=self.on_gpu) for _ in range(2)]
        self._launches = 0
        self._last_draws = 0                       # how many the step before drew

    # ------------------------------------------------------------------ a plan
    def execute(self, plan) -> StepOutput:
        """The plan's step, from its swap copies to its drawn tokens (:meth:`launch`, then
        :meth:`land`)."""
        return self.land(self.launch(plan))

    def launch(self, plan) -> Launched:
        """Queue the plan's step on the device (the module's text) and return."""
        d = plan.draws
        now = self._launches % 2                   # this step's row of _drawn
        self._swap(plan)
        first = self._prefill_parts([part for _, part in plan.parts])
        k = int(np.searchsorted(d.rows, len(plan.parts)))    # draws from the parts' rows
        if k:
            self._drawn[now, :k] = self._draw(first, d, 0, k)
        logits = None
        if plan.rows is not None and len(plan.rows.seqs):
            logits, greedy = self._decode_pass(_rows_batch(plan.rows, d.inputs),
                                               self._follow_index(d.follow, now))
            if len(d.rows) > k:
                self._drawn[now, k:len(d.rows)] = self._draw(logits, d, k, len(d.rows),
                                                             greedy, len(plan.parts))
        self._launches += 1
        self._last_draws = len(d.rows)
        host = self._drawn_hosts[now]
        done = self._download(self._drawn[now, :len(d.rows)], host)
        return Launched(plan, done, host, (first, logits))

    def forget_draws(self) -> None:
        """A step failed (:meth:`Engine._abandon <pagedkv.model.engine.Engine._abandon>`):
        no row of the next step reads a draw of the steps before it."""
        self._last_draws = 0

    def land(self, launched: Launched) -> StepOutput:
        """Wait for a launched step; its draws, and its beam rows' best tokens."""
        if launched.done is not None:
            launched.done.synchronize()
        plan = launched.plan
        d, (first, logits) = plan.draws, launched.logits
        beams, p, xp = [], len(plan.parts), self.model.xp
        for req, rows in d.beams:                  # a request's rows: all parts' or all decode's
            picked = first if rows[0] < p else logits
            at = xp.asarray(np.array(rows) - (0 if rows[0] < p else p))
            beams.append(log_softmax_topk(picked[at], 2 * req.params.beam_width))
        return StepOutput(launched.tokens[:len(d.rows)].copy(), beams)

    # ------------------------------------------------------------------ its pieces
    def _swap(self, plan) -> None:
        ins, outs = (np.concatenate([p for _, p in pairs]).reshape(-1, 2) if pairs
                     else np.zeros((0, 2), np.int32)
                     for pairs in (plan.swap_ins, plan.swap_outs))
        if len(ins) or len(outs):
            self.swap(self.host_pool, ins, outs)

    def _prefill_parts(self, parts):
        """The logits of each part's last row, ``[parts, vocab]``: whole parts, in order,
        packed into passes of about ``prefill_chunk`` tokens (None without parts)."""
        packs, size = [], 0
        for part in parts:
            n = len(part.tokens)
            if packs and size + n <= self.prefill_chunk:
                packs[-1].append(part)
                size += n
            else:
                packs.append([part])
                size = n
        out = [self.prefill(_parts_batch(pack))[0] for pack in packs]
        if len(out) > 1:
            return self.model.xp.concatenate(out)
        return out[0] if out else None

    def _follow_index(self, follow: np.ndarray, now: int) -> np.ndarray:
        """Draw numbers (the step before's first, then this step's) as indices into the
        flat ``_drawn`` (-1 stays -1)."""
        width, before = self._drawn.shape[1], 1 - now
        out = np.where(follow < self._last_draws, before * width + follow,
                       now * width + follow - self._last_draws).astype(np.int32)
        return np.where(follow < 0, -1, out).astype(np.int32)

    def _draw(self, logits, d, lo: int, hi: int, greedy=None, base: int = 0):
        """Draws ``lo`` to ``hi`` from their rows of ``logits`` (numbered from ``base``):
        each row's argmax when all of them are greedy and nothing is banned (``greedy``,
        the pass's own, when the rows are the pass's in order), else the sampler."""
        xp = self.model.xp
        rows = d.rows[lo:hi] - base
        ban = d.ban[lo:hi]
        if not (d.temperature[lo:hi].any() or ban.any()):
            if greedy is not None and np.array_equal(rows, np.arange(len(greedy))):
                return greedy
            return argmax_rows(logits[xp.asarray(rows)])
        if not ban.any() and np.array_equal(rows, np.arange(len(rows))):
            picked = logits[:len(rows)]                # the pass's own rows: no copy
        else:
            picked = logits[xp.asarray(rows)]          # a copy: banning is safe
        if ban.any():
            banned = xp.asarray(np.flatnonzero(ban))
            picked[banned[:, None], xp.asarray(self.stop_ids)[None, :]] = -np.inf
        packed = pack_rows(d.temperature[lo:hi].tolist(), d.top_p[lo:hi].tolist(),
                           d.top_k[lo:hi].tolist(), d.seeds[lo:hi].tolist(),
                           d.counters[lo:hi].tolist())
        return sample_packed(picked, packed)

    def _download(self, drawn, host: np.ndarray):
        """The step's draws into ``host``; an event to wait for on a GPU (None on NumPy)."""
        if not self.on_gpu:
            host[:len(drawn)] = drawn
            return None
        xp = self.model.xp
        stream = xp.cuda.get_current_stream()
        drawn.data.copy_to_host_async(host.ctypes.data, 4 * len(drawn), stream)
        return stream.record()

    # ------------------------------------------------------------------ passes
    def prefill(self, batch: Batch):
        """Logits of each sequence's last new token; no greedy tokens."""
        return forward(self.model, self.kv, batch), None

    def decode(self, batch: Batch):
        """One decode pass: logits of every row; no greedy tokens."""
        return forward(self.model, self.kv, batch), None

    def _decode_pass(self, batch: Batch, follow: np.ndarray):
        """A decode pass whose rows with ``follow`` >= 0 take their input token from that
        index of the flat ``_drawn`` (on the device)."""
        taken = follow >= 0
        if taken.any():
            xp = self.model.xp
            tokens = xp.array(batch.tokens)        # a copy: the plan's stays as it is
            at = xp.asarray(np.flatnonzero(taken))
            tokens[at] = self._drawn.reshape(-1)[xp.asarray(follow[taken])]
            batch = batch._replace(tokens=tokens)
        return self.decode(batch)

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


def _parts_batch(parts) -> Batch:
    """One prefill pass over ``parts`` (:class:`~pagedkv.model.memory.Part`), packed one
    sequence after another, page tables -1 padded to the widest."""
    width = max(len(p.table) for p in parts)
    tables = np.full((len(parts), width), -1, dtype=np.int32)
    for row, p in zip(tables, parts):
        row[:len(p.table)] = p.table
    cat = lambda arrays: np.concatenate(arrays).astype(np.int32)   # noqa: E731
    return Batch(tokens=cat([np.asarray(p.tokens, np.int64) for p in parts]),
                 positions=cat([np.arange(p.start, p.start + len(p.tokens)) for p in parts]),
                 slots=cat([p.slots for p in parts]),
                 query_lens=np.array([len(p.tokens) for p in parts], np.int32),
                 seq_lens=np.array([p.start + len(p.tokens) for p in parts], np.int32),
                 block_tables=tables, copies=cat([p.copies for p in parts]).reshape(-1, 2))


def _rows_batch(rows, inputs: np.ndarray) -> Batch:
    """The decode pass over ``rows`` (:class:`~pagedkv.model.memory.Rows`); ``inputs``:
    each row's token where the host has it (-1 where the device gives it)."""
    return Batch(tokens=inputs, positions=(rows.seq_lens - 1).astype(np.int32),
                 slots=rows.slots, query_lens=np.ones(len(inputs), np.int32),
                 seq_lens=rows.seq_lens, block_tables=rows.block_tables,
                 copies=rows.copies)


def make_runner(kind: str, model: Llama, kv: PagedKV, *, max_seqs: int,
                max_context: int | None = None, **settings) -> ModelRunner:
    """The runner an engine asks for by name: ``"plain"`` (:class:`ModelRunner`),
    ``"fast"`` (:class:`FastRunner`, with graphs on a GPU) or ``"fast-eager"`` (the same,
    without graphs); ``settings``: ``prefill_chunk`` and ``stop_ids``."""
    if kind == "plain":
        return ModelRunner(model, kv, max_seqs=max_seqs, **settings)
    if kind in ("fast", "fast-eager"):
        return FastRunner(model, kv, max_batch=max_seqs, max_context=max_context,
                          graphs=False if kind == "fast-eager" else None, **settings)
    raise ConfigError(f"runner must be 'plain', 'fast' or 'fast-eager', got {kind!r}")


class FastRunner(PrefillPasses, DecodeLaunches, ModelRunner):
    """Decode passes through fused kernels, static buffers and (on a GPU) one CUDA graph
    per bucket; prefills through the same layers, eagerly, with the paged prefill kernel.

    ``max_batch`` sequences decode at most at once; a page table holds ``max_context`` tokens
    (default: the model's context). ``graphs`` (default: on a GPU) replays captured graphs;
    ``graphs=False`` runs the same kernels one by one (the eager path, for debugging);
    ``gemm_method`` picks cuBLAS or the few-row kernel (:func:`~pagedkv.kernels.gemm.gemm`;
    ``"auto"``: the measured choice); a pass of at most ``fold_rows`` rows (default: where
    ``"auto"`` takes the few-row kernel, up to 2 rows) folds each RMSNorm, and SwiGLU, into
    the projection after it (``norm_gemv``). ``pdl`` launches a decode pass's own kernels
    programmatically on a Hopper GPU or later, each starting while the one before it ends
    (:mod:`pagedkv.kernels.pdl`; elsewhere it changes nothing): by default for passes of at
    most ``PDL_AUTO_ROWS`` rows, where it measured faster on the H200 (perf/LOG.md).
    """

    def __init__(self, model: Llama, kv: PagedKV, *, max_batch: int = 256,
                 max_context: int | None = None, graphs: bool | None = None,
                 gemm_method: str = "auto", fold_rows: int | None = None,
                 pdl: bool | None = None, prefill_chunk: int = 512, stop_ids=()):
        super().__init__(model, kv, max_seqs=max_batch, prefill_chunk=prefill_chunk,
                         stop_ids=stop_ids)
        c, xp = model.config, model.xp
        if graphs and not self.on_gpu:
            raise ConfigError("CUDA graphs need the CuPy backend (a GPU)")
        self.graphs = self.on_gpu if graphs is None else bool(graphs)
        self.max_batch = positive_int(max_batch, "max_batch")
        if gemm_method not in ("auto", "gemv", "cublas"):
            raise ConfigError(f"gemm_method must be 'auto', 'gemv' or 'cublas', "
                              f"got {gemm_method!r}")
        self.gemm_method = gemm_method             # see pagedkv.kernels.gemm.gemm
        if fold_rows is None:
            fold_rows = GEMV_AUTO_ROWS if gemm_method == "auto" else 0
        if isinstance(fold_rows, bool) or not 0 <= fold_rows <= GEMV_MAX_ROWS:
            raise ConfigError(f"fold_rows must be 0 to {GEMV_MAX_ROWS}, got {fold_rows!r}")
        self.fold_rows = fold_rows
        self.pdl = None if pdl is None else bool(pdl)
        if kv.block_size not in KERNEL_BLOCK_SIZES:
            raise ConfigError(f"the fast runner decodes with block sizes "
                              f"{KERNEL_BLOCK_SIZES}, not {kv.block_size}")
        max_context = positive_int(max_context or c.context, "max_context")
        self.max_tokens = min(max_context, c.context)
        self.width = cdiv(self.max_tokens, kv.block_size)
        self.buckets = buckets(self.max_batch) if self.on_gpu else None
        B, dt = self.max_batch, model.dtype
        # the step's small inputs, side by side in one int32 array so that one copy uploads
        # them: tokens, positions, slots, seq_lens, and for each row the index of a drawn
        # token to take as its input instead (-1: none; B each), then the page tables
        # [B, width]. Four host copies: one is staged while the others' uploads wait.
        self._meta_hosts = [host_int32(5 * B + B * self.width, pinned=self.on_gpu)
                            for _ in range(4)]
        self._meta_host = self._meta_hosts[0]
        self._meta = xp.zeros(self._meta_host.shape, np.int32)
        nq, nk = c.heads * c.head_dim, c.kv_heads * c.head_dim
        self._full = dict(
            x=xp.zeros((B, c.hidden), dt), h=xp.zeros((B, c.hidden), dt),
            qkv=xp.zeros((B, nq + 2 * nk), dt), q=xp.zeros((B, c.heads, c.head_dim), dt),
            attn=xp.zeros((B, c.heads, c.head_dim), dt),
            gate_up=xp.zeros((B, 2 * c.ffn), dt), act=xp.zeros((B, c.ffn), dt),
            logits=xp.zeros((B, c.vocab_size), np.float32), greedy=xp.zeros(B, np.int32))
        # Every weight as [out, in] (each output's numbers in one row: what the few-row
        # multiply reads best); a copy on the GPU, a view of the model's on NumPy.
        t = (lambda w: xp.ascontiguousarray(w.T)) if self.on_gpu else (lambda w: w.T)
        self.weights = [(t(layer.wqkv), t(layer.wo), t(layer.w_gate_up), t(layer.w_down))
                        for layer in model.layers]
        self._views: dict[int, Views] = {}
        self._graphs: dict[int, object] = {}
        self._prefill_full: dict = {}
        self.stream = xp.cuda.Stream(non_blocking=True) if self.on_gpu else None
        self.steps = 0                  # decode passes launched
        self._uploaded = [None] * len(self._meta_hosts)   # per host buffer: its last upload

    def launch(self, plan) -> Launched:
        """:meth:`ModelRunner.launch`, every pass and copy on this runner's stream (after
        whatever the default stream has queued)."""
        if not self.on_gpu:
            return super().launch(plan)
        self.stream.wait_event(self.model.xp.cuda.Stream.null.record())
        with self.stream:
            return super().launch(plan)

    # ------------------------------------------------------------------ buffers
    def _bucket(self, n: int) -> int:
        if n > self.max_batch:
            raise ConfigError(f"a decode batch of {n} sequences is more than max_batch = "
                              f"{self.max_batch}")
        if not self.on_gpu:
            return n
        return next(b for b in self.buckets if b >= n)

    def _view(self, b: int) -> Views:
        v = self._views.get(b)
        if v is not None:
            return v
        B, m = self.max_batch, self._meta
        cut = {name: a[:b] for name, a in self._full.items()}
        tables = m[5 * B:5 * B + b * self.width].reshape(b, self.width)
        plan = scratch = None
        c, xp = self.model.config, self.model.xp
        if self.on_gpu:
            plan = decode_plan(cut["q"], self.kv.layers[0], tables)
            n = plan.scratch_floats(b, c.heads, c.head_dim)
            scratch = xp.zeros(max(n, 1), np.float32)
        v = self._views[b] = Views(m[:b], m[B:B + b], m[2 * B:2 * B + b],
                                   m[3 * B:3 * B + b], tables, plan=plan, scratch=scratch,
                                   **cut)
        return v

    # ------------------------------------------------------------------ one decode pass
    def _pass(self, v: Views) -> None:
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

    def _layers(self, v: Views, attend) -> None:
        """Every layer over the rows of ``v``: the residual stream ``v.x`` from the token
        embeddings to the last layer's output; ``attend(v, layer)`` fills ``v.attn``."""
        m, kv, c = self.model, self.kv, self.model.config
        eps, b, g = c.norm_eps, v.x.shape[0], self.gemm_method
        fold = self._folds(v)                      # each norm inside the projection after it
        embed(v.tokens, m.embedding, out=v.x)
        for i, (layer, (wqkv, wo, w_gate_up, w_down)) in enumerate(zip(m.layers,
                                                                       self.weights)):
            if fold:                               # norm, q|k|v, RoPE, K/V write: one launch
                norm_gemv_rope(v.x, layer.attn_norm, eps, wqkv, v.qkv, v.positions, v.slots,
                               m.cos, m.sin, v.q, kv.layers[i], c.heads, c.kv_heads)
            else:
                rms_norm(v.x, layer.attn_norm, eps, out=v.h)
                gemm(v.h, wqkv, v.qkv, transpose_b=True, method=g)
                rope_write_kv(v.qkv, v.positions, v.slots, m.cos, m.sin, v.q, kv.layers[i],
                              c.heads, c.kv_heads)
            attend(v, i)
            gemm(v.attn.reshape(b, -1), wo, v.x, accumulate=True, transpose_b=True,
                 method=g)                         # x += o
            if fold:                               # norm, gate|up and SwiGLU: one launch
                norm_gemv(v.x, layer.mlp_norm, eps, w_gate_up, v.act, silu=True)
            else:
                rms_norm(v.x, layer.mlp_norm, eps, out=v.h)
                gemm(v.h, w_gate_up, v.gate_up, transpose_b=True, method=g)
                silu_mul(v.gate_up, out=v.act)
            gemm(v.act, w_down, v.x, accumulate=True, transpose_b=True,
                 method=g)                         # x += mlp(x)

    def _folds(self, v: Views) -> bool:
        """Does this pass fold each RMSNorm (and SwiGLU) into the projection after it
        (:func:`~pagedkv.kernels.norm_gemv.norm_gemv`)? For at most ``fold_rows`` rows."""
        return v.x.shape[0] <= self.fold_rows

    def _attend(self, v: Views, i: int) -> None:
        cache = self.kv.layers[i]
        if v.plan is not None:                     # the GPU: the bucket's fixed launch
            v.plan.run(v.q, cache, v.tables, v.seq_lens, out=v.attn, scale=self.model.scale,
                       scratch=v.scratch)
        else:
            paged_decode_attention(v.q, cache, v.tables, v.seq_lens, out=v.attn,
                                   scale=self.model.scale)
