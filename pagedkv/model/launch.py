"""Getting a decode pass onto the device: the fast runner's staging, graphs and launches.

:class:`DecodeLaunches` is the part of :class:`~pagedkv.model.runner.FastRunner` that
moves a pass's inputs and starts it: the small inputs staged in one of a few pinned host
arrays and uploaded in one copy, the rows whose input token the device already holds (drawn
by the step before, or by this step's prefill) given it by one small gather, and the pass
replayed from its bucket's CUDA graph (captured at first use, or all at once by
:meth:`~DecodeLaunches.capture_all`). :meth:`~DecodeLaunches._decode_pass` returns as soon
as that is queued; :meth:`~DecodeLaunches.decode` waits for it (one pass on its own, as
the benchmarks and chapter 12 time it). On NumPy the same code runs the pass at once.
"""
from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .graphs import gather_kernel, graph_node_count
from .llama import Batch

__all__ = ["DecodeLaunches"]


class DecodeLaunches:
    """Staging, graphs and launches of decode passes (a mixin of
    :class:`~pagedkv.model.runner.FastRunner`: it uses the runner's buffers, views,
    buckets, ``_drawn`` and ``_pass``)."""

    def _stage(self, batch: Batch, b: int, follow=None) -> int:
        """Fill the host copy of the inputs for bucket ``b`` (padding rows: slot -1, length
        0; ``follow``: where each row's input token is in ``_drawn``, or -1) and return how
        many of its int32 numbers the device needs."""
        n, B, W, h = len(batch.tokens), self.max_batch, self.width, self._meta_host
        tables = batch.block_tables
        if tables.shape[1] > W:
            raise ConfigError(f"a page table of {tables.shape[1]} blocks is wider than "
                              f"max_context allows ({W} blocks)")
        src = np.full(n, -1, np.int32) if follow is None else follow
        for i, a in enumerate((batch.tokens, batch.positions, batch.slots, batch.seq_lens,
                               src)):
            h[i * B:i * B + n] = a
            h[i * B + n:i * B + b] = -1 if i in (2, 4) else 0
        t = h[5 * B:5 * B + b * W].reshape(b, W)
        t[:n, :tables.shape[1]] = tables
        t[:n, tables.shape[1]:] = 0
        t[n:] = 0
        return 5 * B + b * W

    # ------------------------------------------------------------------ the interface
    def decode(self, batch: Batch):
        """One decode pass on its own: copy-on-write copies, then the pass (replayed from its
        graph on a GPU), waited for; its logits (valid until the next pass) and greedy
        tokens (host ints)."""
        logits, greedy = self._decode_pass(batch, None)
        if self.on_gpu:
            self.stream.synchronize()
        return logits, greedy.tolist()

    def _decode_pass(self, batch: Batch, follow):
        """Queue a decode pass and return its device logits and greedy tokens, without
        waiting. Row ``i`` with ``follow[i]`` >= 0 takes its input token from that index of
        the runner's flat ``_drawn`` (on the device: ``batch.tokens[i]`` is not read)."""
        n = len(batch.tokens)
        if not batch.is_decode:
            raise ConfigError("FastRunner.decode takes one new token per sequence")
        b = self._bucket(n)
        v = self._view(b)
        slot = self.steps % len(self._meta_hosts)      # this pass's host buffer
        self._meta_host = self._meta_hosts[slot]
        if self._uploaded[slot] is not None:       # the upload that read it is done
            self._uploaded[slot].synchronize()
        count = self._stage(batch, b, follow)      # checks first: a refused pass changes nothing
        self.steps += 1
        if not self.on_gpu:
            self.kv.copy(batch.copies)
            self._meta[:count] = self._meta_host[:count]
            if follow is not None and (follow >= 0).any():
                self._follow(v, n)
            self._pass(v)
            return v.logits[:n], v.greedy[:n]
        s = self.stream
        s.wait_event(self.model.xp.cuda.Stream.null.record())   # after work queued there
        self._meta.data.copy_from_host_async(self._meta_host.ctypes.data, 4 * count, s)
        self._uploaded[slot] = s.record()
        with s:                                    # in stream order: after the step before
            self.kv.copy(batch.copies)             # copy-on-write copies (plain path)
            if follow is not None and (follow >= 0).any():
                self._follow(v, n)
            if self.graphs:
                graph = self._graphs.get(b) or self._capture(b, v)
                graph.launch(s)
            else:
                self._pass(v)
        return v.logits[:n], v.greedy[:n]

    def _follow(self, v, n: int) -> None:
        """The rows whose input token the device holds: each such row's token, read from
        the flat ``_drawn`` at the index staged for it (before the pass)."""
        src = self._meta[4 * self.max_batch:4 * self.max_batch + n]
        drawn = self._drawn.reshape(-1)
        if not self.on_gpu:
            taken = src >= 0
            v.tokens[:n][taken] = drawn[src[taken]]
        else:
            gather_kernel()(drawn, src, v.tokens[:n])

    def _capture(self, b: int, v):
        """Run the pass once (compiles kernels, lets cuBLAS choose), then capture it."""
        s = self.stream
        self._pass(v)                              # the warm-up, on this very stream
        s.synchronize()
        s.begin_capture()
        try:
            self._pass(v)
        finally:
            graph = s.end_capture()
        graph.upload(s)
        self._graphs[b] = graph
        return graph

    def capture_all(self) -> int:
        """Capture every bucket's graph now (otherwise each is captured at its first use).
        The pass writes K/V only at slot -1 rows here: nothing in the pool changes."""
        if not self.graphs:
            return 0
        for b in self.buckets:
            if b not in self._graphs:
                v = self._view(b)
                h = self._meta_host
                h[:] = 0
                h[2 * self.max_batch:3 * self.max_batch] = -1      # every slot: padding
                self._meta.data.copy_from_host_async(h.ctypes.data, h.nbytes, self.stream)
                with self.stream:
                    self._capture(b, v)
        self.stream.synchronize()
        return len(self._graphs)

    def graph_nodes(self, b: int) -> int | None:
        """Nodes (kernels and copies) of bucket ``b``'s captured graph, or None when it has
        none or the count cannot be read (:func:`graph_node_count`)."""
        graph = self._graphs.get(b)
        return None if graph is None else graph_node_count(graph)
