"""Getting a decode pass onto the device: the fast runner's staging, graphs and launches.

:class:`DecodeLaunches` is the part of :class:`~pagedkv.model.runner.FastRunner` that
moves a step's inputs and outputs and starts its pass: the small inputs staged in one of two
pinned host arrays and uploaded in one copy, the pass replayed from its bucket's CUDA graph
(captured at first use, or all at once by :meth:`~DecodeLaunches.capture_all`), the greedy
tokens downloaded behind it. :meth:`~DecodeLaunches.launch` returns as soon as that is
queued and :meth:`~DecodeLaunches.land` waits for it, so the engine can plan the next step
meanwhile (:mod:`pagedkv.model.overlap`); a launch that *follows* another takes its input
tokens from the other's greedy tokens on the device. :meth:`~DecodeLaunches.decode` is the
two in a row. On NumPy the same code runs the pass at once.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import ConfigError
from .llama import Batch
from .graphs import gather_kernel, graph_node_count

__all__ = ["DecodeLaunches", "Launched"]


class Launched(NamedTuple):
    """A decode step started by :meth:`FastRunner.launch`: its rows, the event after its
    download (None on NumPy: already done), the host array its greedy tokens arrive in,
    and the device logits of its bucket."""
    rows: int
    done: object
    greedy: np.ndarray
    logits: object


class DecodeLaunches:
    """Staging, graphs and launches of decode passes (a mixin of
    :class:`~pagedkv.model.runner.FastRunner`: it uses the runner's buffers, views,
    buckets and ``_pass``)."""

    def _stage(self, batch: Batch, b: int, follow=None) -> int:
        """Fill the host copy of the inputs for bucket ``b`` (padding rows: slot -1, length
        0; ``follow``: the rows of the last launch whose tokens are the inputs) and return
        how many of its int32 numbers the device needs."""
        n, B, W, h = len(batch.tokens), self.max_batch, self.width, self._meta_host
        tables = batch.block_tables
        if tables.shape[1] > W:
            raise ConfigError(f"a page table of {tables.shape[1]} blocks is wider than "
                              f"max_context allows ({W} blocks)")
        src = np.zeros(n, np.int32) if follow is None else follow
        for i, a in enumerate((batch.tokens, batch.positions, batch.slots, batch.seq_lens,
                               src)):
            h[i * B:i * B + n] = a
            h[i * B + n:i * B + b] = -1 if i == 2 else 0
        t = h[5 * B:5 * B + b * W].reshape(b, W)
        t[:n, :tables.shape[1]] = tables
        t[:n, tables.shape[1]:] = 0
        t[n:] = 0
        return 5 * B + b * W

    # ------------------------------------------------------------------ the interface
    def decode(self, batch: Batch):
        """One decode step: copy-on-write copies, then the pass (replayed from its graph on a
        GPU); one upload of the inputs, one download of the greedy tokens."""
        return self.land(self.launch(batch))

    def launch(self, batch: Batch, follow=None) -> Launched:
        """Start a decode step and return without waiting for it (:meth:`land` waits).
        With ``follow`` (int32, one per row), row ``i``'s input token is the greedy token of
        row ``follow[i]`` of the launch before, taken on the device: ``batch.tokens`` is
        not read, and the host need not know those tokens yet."""
        n = len(batch.tokens)
        if not batch.is_decode:
            raise ConfigError("FastRunner.decode takes one new token per sequence")
        if follow is not None and (len(follow) != n or self._last is None
                                   or not 0 <= min(follow, default=0) <= max(
                                       follow, default=0) < self._last.rows):
            raise ConfigError("follow: one row of the launch before for each row")
        b = self._bucket(n)
        v = self._view(b)
        slot = self.steps % 2                      # this launch's host buffers
        self._meta_host = self._meta_hosts[slot]
        if self._uploaded[slot] is not None:       # the upload that read them is done
            self._uploaded[slot].synchronize()
        count = self._stage(batch, b, follow)      # checks first: a refused step changes nothing
        self.steps += 1
        greedy_host = self._greedy_hosts[slot]
        if not self.on_gpu:
            self.kv.copy(batch.copies)
            self._meta[:count] = self._meta_host[:count]
            if follow is not None:
                self._follow(v, n)
            self._pass(v)
            greedy_host[:n] = v.greedy[:n]
            self._last = Launched(n, None, greedy_host, v.logits)
            return self._last
        xp, s = self.model.xp, self.stream
        s.wait_event(xp.cuda.Stream.null.record())  # after the prefill and copies before it
        self._meta.data.copy_from_host_async(self._meta_host.ctypes.data, 4 * count, s)
        self._uploaded[slot] = s.record()
        with s:                                    # in stream order: after the step before
            self.kv.copy(batch.copies)             # copy-on-write copies (plain path)
            if follow is not None:
                self._follow(v, n)
            if self.graphs:
                graph = self._graphs.get(b) or self._capture(b, v)
                graph.launch(s)
            else:
                self._pass(v)
        v.greedy.data.copy_to_host_async(greedy_host.ctypes.data, 4 * b, s)
        self._last = Launched(n, s.record(), greedy_host, v.logits)
        return self._last

    def land(self, launched: Launched):
        """Wait for a launch; its logits (valid until the next launch) and greedy tokens."""
        if launched.done is not None:
            launched.done.synchronize()
        return launched.logits[:launched.rows], launched.greedy[:launched.rows].tolist()

    def _follow(self, v, n: int) -> None:
        """The inputs of a following launch: each row's token, the greedy token of the
        row of the launch before that ``src`` names (on the device, before the pass)."""
        src = self._meta[4 * self.max_batch:4 * self.max_batch + n]
        greedy = self._full["greedy"]
        if not self.on_gpu:
            v.tokens[:n] = greedy[src]
        else:
            gather_kernel()(greedy, src, v.tokens[:n])

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
