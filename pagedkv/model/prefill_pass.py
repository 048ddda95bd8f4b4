"""The fast runner's prefills: the prefill side of :class:`~pagedkv.model.runner.FastRunner`.

A prefill runs by the cheaper of two ways: one eager pass over every new token with the
paged prefill kernel for the attention (:meth:`PrefillPasses._eager_pass`), or, when it is
short, one replay of the decode graph with a row per token (:func:`_as_rows`). The decode
side (the static buffers, the captured graphs) is :mod:`pagedkv.model.runner`'s; the
passes here run through its layers (``FastRunner._layers``).
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..kernels.fused import rms_norm
from ..kernels.gemm import gemm
from ..kernels.prefill import paged_prefill_attention
from .graphs import Views
from .llama import Batch, prefill_attention

__all__ = ["PrefillPasses", "GRAPH_PREFILL_TOKENS"]

#: A prefill whose rows read at most this many tokens of K/V in all (each row its prefix,
#: the decode way) and fit one graph bucket replays the decode graph instead of running
#: the eager prefill pass: 65,536 tokens of SmolLM2's K/V are 1.5 GB, ~0.4 ms at 4 TB/s,
#: against the eager pass's ~10 ms of launches (a lone 100-token prompt on the H200:
#: 15.9 ms to its first token with the eager pass, 6.2 ms with the graph, 2026-12-03).
GRAPH_PREFILL_TOKENS = 65_536


class PrefillPasses:
    """:class:`~pagedkv.model.runner.FastRunner`'s ``prefill`` (a mixin: it uses the
    runner's ``_decode_pass``, ``_layers``, ``graphs``, ``max_batch``, ``width``)."""

    def prefill(self, batch: Batch):
        """A prefill, by the cheaper of two ways. Usually one eager pass with the paged
        prefill kernel (:meth:`_eager_pass`). But an eager pass launches ~270 kernels,
        and a short prefill (rows that fit one graph bucket, reading little K/V in all)
        costs less as one replay of the decode graph with a row per token
        (:func:`_as_rows`): each row reads its prefix again, which is cheap while the
        prefixes are short. Both return the logits of each sequence's last new token,
        and no greedy tokens."""
        if self._short(batch):                   # (the last rows copied out: the
            logits, _ = self._decode_pass(_as_rows(batch), None)   # buffer is reused)
            return logits[self.model.xp.asarray(_last_rows(batch))], None
        return self._eager_pass(batch), None

    def _short(self, batch: Batch) -> bool:
        """Is ``batch`` a prefill for the decode graph: its rows fit one bucket, and read
        at most GRAPH_PREFILL_TOKENS of K/V in all?"""
        reads = int((batch.positions.astype(np.int64) + 1).sum())   # K/V tokens the rows read
        return self.graphs and len(batch.tokens) <= self.max_batch and \
            reads <= GRAPH_PREFILL_TOKENS

    def _eager_pass(self, batch: Batch):
        """One eager pass: every new token of every sequence a row, through the same fused
        kernels as a decode step, and attention by the paged prefill kernel
        (:func:`~pagedkv.kernels.prefill.paged_prefill_attention`: causal, a chunk starting
        wherever its sequence's cache ends). It runs eagerly (its row count changes from
        step to step), on the current stream (the runner's, in a step), into buffers kept
        for the largest pass so far, after the batch's copy-on-write copies. Returns the
        logits of each sequence's last row."""
        xp, c = self.model.xp, self.model.config
        n, b = len(batch.tokens), len(batch.query_lens)
        if batch.block_tables.shape[1] > self.width:
            raise ConfigError(f"a page table of {batch.block_tables.shape[1]} blocks is "
                              f"wider than max_context allows ({self.width} blocks)")
        starts = np.concatenate([[0], np.cumsum(batch.query_lens)]).astype(np.int32)
        meta = xp.asarray(np.concatenate([batch.tokens, batch.positions, batch.slots,
                                          batch.seq_lens, starts]).astype(np.int32))
        full = self._prefill_buffers(n)
        v = Views(meta[:n], meta[n:2 * n], meta[2 * n:3 * n], meta[3 * n:3 * n + b],
                  xp.asarray(np.ascontiguousarray(batch.block_tables, dtype=np.int32)),
                  plan=None, scratch=None, logits=None, greedy=None,
                  query_start=meta[3 * n + b:], **{k: a[:n] for k, a in full.items()})
        self.kv.copy(batch.copies)
        self._prefill_lengths = (batch.seq_lens, batch.query_lens)
        self._layers(v, self._attend_prefill)
        h = rms_norm(v.x[xp.asarray(starts[1:] - 1)], self.model.norm, c.norm_eps)
        logits = xp.empty((b, c.vocab_size), np.float32)
        gemm(h, self.model.embedding, logits, transpose_b=True, method=self.gemm_method)
        return logits

    def _attend_prefill(self, v: Views, i: int) -> None:
        if self.on_gpu and self.model.dtype == np.float32:   # (the kernel is 16-bit: the
            seq_lens, query_lens = self._prefill_lengths       # plain path's attention)
            v.attn[...] = prefill_attention(v.q, self.kv.layers[i], v.tables, seq_lens,
                                            query_lens, self.model.scale)
            return
        paged_prefill_attention(v.q, self.kv.layers[i], v.tables, v.query_start,
                                v.seq_lens, scale=self.model.scale, out=v.attn)

    def _prefill_buffers(self, n: int) -> dict:
        """The per-row arrays of a prefill pass, at least ``n`` rows (grown by doubling,
        then kept: the next pass of that size allocates nothing)."""
        have = self._prefill_full["x"].shape[0] if self._prefill_full else 0
        if have < n:
            c, xp, dt = self.model.config, self.model.xp, self.model.dtype
            rows = max(n, 2 * have, 256)
            nq, nk = c.heads * c.head_dim, c.kv_heads * c.head_dim
            self._prefill_full = dict(
                x=xp.zeros((rows, c.hidden), dt), h=xp.zeros((rows, c.hidden), dt),
                qkv=xp.zeros((rows, nq + 2 * nk), dt),
                q=xp.zeros((rows, c.heads, c.head_dim), dt),
                attn=xp.zeros((rows, c.heads, c.head_dim), dt),
                gate_up=xp.zeros((rows, 2 * c.ffn), dt), act=xp.zeros((rows, c.ffn), dt))
        return self._prefill_full


def _as_rows(batch: Batch) -> Batch:
    """A prefill as decode rows: every new token a row of its own, at its position, with its
    sequence's page table and a length of position + 1, so that the decode kernel's attention
    over a row's first position + 1 tokens is exactly causal attention."""
    rows = np.repeat(np.arange(len(batch.query_lens)), batch.query_lens)
    return batch._replace(query_lens=np.ones(len(rows), np.int32),
                          seq_lens=(batch.positions + 1).astype(np.int32),
                          block_tables=batch.block_tables[rows])


def _last_rows(batch: Batch) -> np.ndarray:
    """The row of each sequence's last new token."""
    return np.cumsum(batch.query_lens) - 1
