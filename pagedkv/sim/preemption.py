"""Preemption in the simulation: by recompute (any :class:`~pagedkv.sim.policies.PagedPolicy`),
by swap (a :class:`SwapPolicy`), or none at all
(:class:`ReservePolicy` reserves each request's worst case), and the three compared on
one trace under memory pressure.

Time in the simulation is counted in decode steps, and a step computes at most the token
budget's worth of tokens, so recomputation costs time: a preempted request's tokens are
prefilled again, out of the same budget. Swapping computes nothing again; what it costs
is bytes over the host link, counted here in blocks (and bytes).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..checks import cdiv, positive_int
from ..errors import ConfigError, OutOfBlocks
from ..swap import HostPool, Swapper, copy_to_device, copy_to_host
from .measure import Observer
from .policies import PagedPolicy
from .serving import TOKEN_BUDGET, serve

__all__ = ["SwapPolicy", "ReservePolicy", "Latency", "PreemptionRun",
           "compare_preemption", "preemption_table"]


class SwapPolicy(PagedPolicy):
    """Paging that preempts by swapping into a host pool of ``host_bytes``. The copies
    of a step are batched: all its swap-ins in one call, then all its swap-outs in one
    call, made when the step runs (before any K/V of that step is written). A preempted
    request goes back to the head of the queue; admitted again, it is swapped back in
    and prefills nothing."""

    def __init__(self, pool_bytes: int, block_size: int, *, host_bytes: int, **paged):
        super().__init__(pool_bytes, block_size, **paged)
        block_bytes = self.manager.allocator.block_bytes
        host_blocks = positive_int(host_bytes, "host_bytes") // block_bytes
        host = HostPool(host_blocks, block_bytes)
        self.swapper = Swapper(self.manager, host)
        self.name = f"paged {self.block_size}, swap"
        cache = self.kv.cache
        self.device = None if cache is None else cache.reshape(1, cache.shape[0], -1)
        self.pending_in, self.pending_out = [], []

    def preempt(self, rid: int) -> None:
        self.swap_out(rid)

    def swap_out(self, rid: int) -> None:
        """Park the request's blocks on the host; recompute instead if there is no room.
        """
        try:
            self.pending_out.append(self.swapper.swap_out([rid]))
        except OutOfBlocks:
            self.release(rid)

    def prefill(self, req, length: int) -> int:
        return 0 if req.rid in self.swapper.swapped else length

    def admit(self, req, length: int, first: int | None = None,
              promised: int = 0) -> bool:
        if req.rid not in self.swapper.swapped:
            return super().admit(req, length, first, promised)
        need = cdiv(length + 1, self.block_size)      # its tokens and the next one
        if need + self.watermark_blocks + promised > self.manager.allocator.num_free:
            return False
        self.pending_in.append(self.swapper.swap_in([req.rid], [length]))
        self.allocations += cdiv(length, self.block_size)
        return True

    def step(self, ids) -> bool:
        free = self.manager.allocator.num_free       # (requests share no block here)
        if self.pending_out and sum(map(self.manager.blocks_needed, ids)) > free:
            return False                              # preempt more before copying
        self._copy(copy_to_device, self.pending_in)   # swap-ins first: a request back
        self._copy(copy_to_host, self.pending_out)    # this step may leave again
        return super().step(ids)

    def _copy(self, copy, pending) -> None:
        if pending and self.device is not None:
            pairs = np.concatenate(pending)
            if copy is copy_to_host:
                copy(self.device, self.swapper.host, pairs)
            else:
                copy(self.swapper.host, self.device, pairs)
        pending.clear()


class ReservePolicy(PagedPolicy):
    """Paging without preemption: admission reserves the blocks of the longest a request
    may grow (the workload's ``max_len``: a server knows its limit, not the answer's
    length), so a step never runs out of blocks."""

    def __init__(self, pool_bytes: int, block_size: int, *, max_len: int, **paged):
        super().__init__(pool_bytes, block_size, max_len=max_len, watermark=0.0,
                         **paged)
        self.reserve = cdiv(positive_int(max_len, "max_len"), self.block_size)
        self.reserved = 0
        self.name = f"paged {self.block_size}, reserve"

    def check(self, workload) -> None:
        if self.reserve > self.manager.allocator.num_blocks:
            raise ConfigError(f"a request reserves {self.reserve} blocks "
                              f"({self.reserve} x {self.block_size} >= max_len); the "
                              f"pool has {self.manager.allocator.num_blocks}")
        super().check(workload)

    def admit(self, req, length: int, first: int | None = None,
              promised: int = 0) -> bool:
        if (self.reserved + self.reserve > self.manager.allocator.num_blocks
                or not super().admit(req, length, first, promised)):
            return False
        self.reserved += self.reserve
        return True

    def release(self, rid: int) -> None:
        super().release(rid)
        self.reserved -= self.reserve


class Latency(Observer):
    """Each request's latency in steps, from its arrival to its last token."""

    def __init__(self, workload):
        self.arrival = {r.rid: r.arrival for r in workload.requests}
        self.output = {r.rid: r.output for r in workload.requests}
        self.steps: dict = {}

    def left(self, step, rid):
        self.steps[rid] = step - self.arrival[rid]

    def normalized(self) -> np.ndarray:
        """Latency per generated token (the vLLM paper's *normalized latency*), per
        request."""
        return np.array([s / self.output[r] for r, s in sorted(self.steps.items())])


@dataclass
class PreemptionRun:
    name: str
    run: object             # the Run
    latency: Latency
    swapped_blocks: int     # blocks copied to the host (and as many back)
    block_bytes: int

    @property
    def throughput(self) -> float:
        """Tokens generated per decode step."""
        return self.run.tokens_generated / self.run.steps


def compare_preemption(workload, pool_bytes: int, *, block_size: int = 16,
                       host_bytes: int, max_seqs: int = 256,
                       token_budget: int = TOKEN_BUDGET, write: bool = False) -> list:
    """The same trace served three ways: paged with recompute, paged with swap, and
    paged reserving each request's worst case (no preemption)."""
    runs = []
    for name in ("recompute", "swap", "reserve worst case"):
        options = dict(max_seqs=max_seqs, max_len=workload.max_len, write=write)
        if name == "swap":
            policy = SwapPolicy(pool_bytes, block_size, host_bytes=host_bytes, **options)
        elif name == "recompute":
            policy = PagedPolicy(pool_bytes, block_size, **options)
        else:
            policy = ReservePolicy(pool_bytes, block_size, **options)
        latency = Latency(workload)
        run = serve(workload, policy, max_seqs=max_seqs, token_budget=token_budget,
                    observers=[latency])
        moved = policy.swapper.blocks_out if name == "swap" else 0
        runs.append(PreemptionRun(name, run, latency, moved,
                                  policy.manager.allocator.block_bytes))
    return runs


def preemption_table(runs) -> str:
    """Throughput, latency and what preemption cost, one row per way of serving."""
    rows = [f"{'':<19}{'steps':>6}{'tok/step':>9}{'latency':>8}{'p90':>6}{'per tok':>8}"
            f"{'preempt':>8}{'recomp.':>8}{'swap MiB':>9}"]
    for p in runs:
        r, lat = p.run, np.array(list(p.latency.steps.values()))
        rows.append(f"{p.name:<19}{r.steps:>6}{p.throughput:>9.1f}{lat.mean():>8.0f}"
                    f"{np.percentile(lat, 90):>6.0f}"
                    f"{p.latency.normalized().mean():>8.2f}"
                    f"{r.preemptions:>8}{r.recomputed_tokens:>8}"
                    f"{p.swapped_blocks * p.block_bytes / 2**20:>9.1f}")
    return "\n".join(rows)
