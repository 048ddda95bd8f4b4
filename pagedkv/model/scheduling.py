"""Who runs: the engine's admission (now, later or never) and preemption (recompute or
swap).

:class:`Scheduling` is the half of :class:`~pagedkv.model.generate.Engine` that decides;
the engine's other half computes. It reads the engine's manager, its three queues
(``waiting``, ``running``, ``swapped``, each in order) and, for swapping, its
:class:`~pagedkv.swap.Swapper`.

* **Admission** answers for the request at the head of the queue: *now* (the blocks its
  prompt needs, beyond what the prefix cache already holds, are free, with a small
  watermark left for the running requests to grow into), *later* (they are not free yet),
  or *never* (even alone in the pool it could not finish: refused when submitted, with the
  reason).
* **Preemption**: when a decode step cannot get its blocks, the most recently admitted
  request gives its blocks back and the step is tried again. By *recompute*, its K/V is
  dropped and it waits at the head of the queue, to be prefilled again (a prefix-caching
  manager finds much of it still cached); by *swap*, its blocks are copied to the host
  pool first and it waits in ``swapped`` until there is room to copy them back (and falls
  back to recompute when the host pool is full). Either way its sampled tokens, scores
  and random generator are kept: it continues exactly where it stopped.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import cdiv, positive_int
from ..errors import AuditError, ConfigError, OutOfBlocks
from ..swap import HostPool, Swapper, copy_to_device, copy_to_host

__all__ = ["Counts", "Scheduling", "prefill_prompt"]

NO_PAIRS = np.zeros((0, 2), dtype=np.int32)


@dataclass
class Counts:
    """What an engine did, counted since it was made."""
    prompt_tokens: int = 0     # tokens prefilled: prompts, and preempted sequences again
    computed_tokens: int = 0   # of those, computed (the rest were found in the cache)
    recomputed_tokens: int = 0  # computed again after a preemption by recompute
    refound_tokens: int = 0    # found again in the prefix cache after such a preemption
    preemptions: int = 0
    swapped_out: int = 0       # blocks copied to the host pool
    swapped_in: int = 0        # blocks copied back

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens


def prefill_prompt(manager, seq):
    """A sequence's tokens checked and hashed once per admission (a
    :class:`~pagedkv.prefix_cache.Prompt`), kept on the sequence from the first question
    admission asks about them until it is added; its prefill takes the head it needs."""
    if seq.prefill is None or len(seq.prefill.tokens) != len(seq.tokens):
        seq.prefill = manager.prompt(seq.tokens)
    return seq.prefill


class Scheduling:
    """Admission and preemption for :class:`~pagedkv.model.generate.Engine` (a mixin).
    """

    def _schedule(self, watermark: float, preemption: str, host_blocks: int) -> None:
        """Set the watermark (a share of the pool admission keeps free) and the
        preemption: ``"recompute"``, or ``"swap"`` into a host pool of ``host_blocks``
        blocks."""
        if isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), "
                              f"got {watermark!r}")
        alloc = self.kv.allocator
        self.watermark_blocks = int(watermark * alloc.num_blocks)
        self.swapper = None
        if preemption == "swap":
            host = HostPool(positive_int(host_blocks, "host_blocks (the swap space)"),
                            alloc.block_bytes)
            self.swapper = Swapper(self.manager, host)
            # the device pool as [layers, blocks, elements]: a block in every layer
            spec = self.kv.spec
            pool = alloc.pool.view(spec.dtype)
            self.device_blocks = pool.reshape(spec.layers, alloc.num_blocks, -1)
        elif preemption != "recompute":
            raise ConfigError(f"preemption must be 'recompute' or 'swap', "
                              f"got {preemption!r}")

    def _worst_case(self, req) -> int:
        """Blocks the request may hold at its largest: every sequence with its own
        blocks."""
        return req.params.width * cdiv(len(req.prompt) + req.params.max_new_tokens,
                                       self.block_size)

    def _blocks_to_start(self, req) -> int:
        """Free blocks the request takes from admission through its first decode step.
        """
        if req.live:            # preempted by recompute: every sequence comes back
            return sum(self.manager.blocks_to_add(prefill_prompt(self.manager, s))
                       for s in req.live)
        # the prompt, then a block per sequence at the first step (a new block, or a
        # copy of the shared, partly filled last block of the prompt)
        first_step = req.params.width - (len(req.prompt) % self.block_size != 0)
        return self.manager.blocks_to_add(req.hashed) + first_step

    def admission(self, req, promised: int = 0) -> tuple[str, str]:
        """``("now", "")``, ``("later", why)`` or ``("never", why)`` for ``req``, when
        ``promised`` free blocks are already promised to requests admitted this step."""
        blocks, width = self.manager.allocator.num_blocks, req.params.width
        if self._worst_case(req) > blocks - self.watermark_blocks:
            return "never", (f"the request may need {self._worst_case(req)} blocks; "
                             f"the pool has {blocks}, {self.watermark_blocks} of them "
                             f"kept free")
        if width > self.max_seqs:
            return "never", (f"the request runs {width} sequences; at most "
                             f"{self.max_seqs} run at once")
        if sum(len(r.live) for r in self.running) + width > self.max_seqs:
            return "later", f"{self.max_seqs} sequences are running"
        need = self._blocks_to_start(req) + self.watermark_blocks
        free = self.manager.allocator.num_free - promised
        if need > free:
            return "later", (f"needs {need} free blocks (watermark included), "
                             f"{free} are free")
        return "now", ""

    def step_or_preempt(self):
        """The decode step's plan: ``manager.step()`` for every live sequence; while it
        cannot get its blocks, the most recently admitted request is preempted (the
        blocks swapped out copied in one call). Returns (requests, their sequences, the
        plan), the plan None when nothing runs."""
        swap_out = []
        while True:
            reqs = [r for r in self.running if r.live]
            seqs = [s for r in reqs for s in r.live]
            if not seqs:
                return reqs, seqs, None
            try:
                plan = self.manager.step([s.seq_id for s in seqs],
                                         [s.tokens[-1] for s in seqs])
                break
            except OutOfBlocks:
                if len(reqs) == 1:                 # admission refuses what cannot fit
                    raise AuditError("a request alone cannot take its next step") \
                        from None
                swap_out.append(self.preempt(reqs[-1]))
        pairs = np.concatenate(swap_out) if swap_out else NO_PAIRS
        if len(pairs):
            copy_to_host(self.device_blocks, self.swapper.host, pairs)
        return reqs, seqs, plan

    def preempt(self, req) -> np.ndarray:
        """``req`` gives its blocks back, by swap when there is a swapper with room,
        else by recompute. Returns the (device block, host block) pairs still to copy.
        """
        self.running.remove(req)
        self.counts.preemptions += 1
        ids = [s.seq_id for s in req.live]
        if self.swapper is not None:
            try:
                pairs = self.swapper.swap_out(ids)
            except OutOfBlocks:                    # the host pool is full: recompute
                pass
            else:
                self.swapped.appendleft(req)
                self.counts.swapped_out += len(pairs)
                return pairs
        for seq_id in ids:
            self.manager.free(seq_id)
        self.waiting.appendleft(req)
        return NO_PAIRS

    def swap_in(self) -> None:
        """Bring swapped-out requests back, oldest preemption first, while their blocks
        (and the watermark) are free; all of the step's blocks in one copy."""
        pairs = []
        while self.swapped:
            req = self.swapped[0]
            ids = [s.seq_id for s in req.live]
            need = self.swapper.blocks_to_swap_in(ids) + self.watermark_blocks
            live = sum(len(r.live) for r in self.running)
            free = self.manager.allocator.num_free
            if need > free or live + len(ids) > self.max_seqs:
                break
            # (all but each sequence's pending token: their K/V were swapped out)
            pairs.append(self.swapper.swap_in(ids, [s.tokens[:-1] for s in req.live]))
            self.swapped.popleft()
            self.running.append(req)
        if pairs:
            pairs = np.concatenate(pairs)
            copy_to_device(self.swapper.host, self.device_blocks, pairs)
            self.counts.swapped_in += len(pairs)
