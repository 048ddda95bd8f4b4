"""Memory policies: how a server places the K/V of the requests it runs.

One interface, :class:`Policy`, is all that :func:`~pagedkv.sim.serving.serve` knows.
Two kinds implement it:

* :class:`PagedPolicy` — paging: blocks of ``block_size`` tokens, taken one at a time as
  a sequence grows, from a real :class:`~pagedkv.manager.KVCacheManager` (with the K/V
  bytes written when asked);
* :class:`ReservationPolicy` — the schemes before paging: at admission a request gets
  one contiguous range of the pool, placed by :class:`~pagedkv.contiguous.FirstFit` and
  sized by the maximum length, a power of two, or exactly.

Sizes are in token slots: one slot holds one token's K and V.
"""
from __future__ import annotations

import numpy as np

from ..checks import cdiv, positive_int
from ..contiguous import FirstFit
from ..errors import ConfigError, OutOfBlocks
from ..spec import KVSpec
from .kvdata import SIM_SPEC, CheckedKV
from .workloads import Request

__all__ = ["Policy", "PagedPolicy", "ReservationPolicy", "make_policy", "POLICY_NAMES"]


class Policy:
    """What the serving loop asks of a memory policy.

    * ``admit(req, length)`` places a request that starts with ``length`` tokens (its
      prompt, or all it had when it was preempted); False if it does not fit now.
      ``prefill(req, length)`` says how many of them it must compute (all, by default).
      With chunked prefill, ``admit(..., first=n)`` places only the first ``n`` tokens
      (still checking that all of them fit, beside ``promised`` blocks owed to others),
      and ``extend(rid, n)`` places ``n`` more later; ``owed`` counts the blocks still
      to come.
    * ``step(ids)`` gives every running request one more token, all or nothing; False if
      the memory ran out (then the loop preempts a request and tries again).
    * ``release(rid)`` gives a finished request's memory back; ``preempt(rid)`` a
      preempted one's (released, by default).

    To measure: ``free_slots()``, ``held(ids, lens)`` (the slots each running request
    holds) and ``fragmented(req, length)`` (a refused request would fit in the free
    slots if they were one run). ``check(workload)`` refuses, before serving, a request
    that could never fit.
    """

    name = "policy"
    pool_slots = 0
    token_bytes = 0
    block_size = None    # tokens per block, for a paged policy
    allocations = 0      # blocks or ranges handed out

    def check(self, workload) -> None:
        raise NotImplementedError

    def admit(self, req: Request, length: int, first: int | None = None,
              promised: int = 0) -> bool:
        raise NotImplementedError

    def prefill(self, req: Request, length: int) -> int:
        return length

    def extend(self, rid: int, n: int) -> bool:
        return True

    def owed(self, req: Request, placed: int, length: int) -> int:
        return 0

    def preempt(self, rid: int) -> None:
        self.release(rid)

    def step(self, ids) -> bool:
        raise NotImplementedError

    def release(self, rid: int) -> None:
        raise NotImplementedError

    def free_slots(self) -> int:
        raise NotImplementedError

    def held(self, ids, lens) -> np.ndarray:
        raise NotImplementedError

    def fragmented(self, req: Request, length: int) -> bool:
        return False

    def data_counts(self) -> tuple[int, int, int]:
        """(tokens written, tokens read back and checked, of those corrupted): zeros
        for a policy that keeps no K/V data."""
        return 0, 0, 0


class PagedPolicy(Policy):
    """Paging: blocks of ``block_size`` tokens taken one at a time as requests grow.

    A request is admitted when its tokens so far plus the next one fit in free blocks
    and leave ``watermark`` (a share of the pool's blocks) free for the running requests
    to grow into: 1 %, as vLLM's V0 block manager does. A step that finds too few free
    blocks is refused, and the loop preempts. ``write=True`` writes every token's K/V
    and checks it on release.
    """

    def __init__(self, pool_bytes: int, block_size: int, *, spec: KVSpec = SIM_SPEC,
                 write: bool = False, watermark: float = 0.01,
                 bookkeeping: str = "teaching", max_seqs: int = 256, max_len: int = 2048):
        if isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), "
                              f"got {watermark!r}")
        self.kv = CheckedKV(pool_bytes, block_size, spec=spec, write=write,
                          bookkeeping=bookkeeping, max_seqs=max_seqs, max_len=max_len)
        self.manager, self.block_size = self.kv.manager, self.kv.block_size
        self.name = f"paged, block {self.block_size}"
        self.token_bytes = spec.bytes_per_token
        num_blocks = self.manager.allocator.num_blocks
        self.pool_slots = num_blocks * self.block_size
        self.watermark = watermark
        self.watermark_blocks = int(watermark * num_blocks)

    def check(self, workload) -> None:
        blocks, wm = self.manager.allocator.num_blocks, self.watermark_blocks
        limit = (blocks - wm) * self.block_size
        for r in workload.requests:
            if r.total > limit:
                raise ConfigError(
                    f"request {r.rid} grows to {r.total} tokens, but this pool holds at "
                    f"most {limit} tokens for one request: {blocks} blocks of "
                    f"{self.block_size} tokens (pool bytes // block bytes), {wm} of them "
                    f"kept free by the {self.watermark:.0%} watermark")

    def admit(self, req: Request, length: int, first: int | None = None,
              promised: int = 0) -> bool:
        need = cdiv(length + 1, self.block_size)         # its tokens and the next one
        if need + self.watermark_blocks + promised > self.manager.allocator.num_free:
            return False
        first = length if first is None else first
        self.kv.add(req.rid, first)
        self.allocations += cdiv(first, self.block_size)
        return True

    def extend(self, rid: int, n: int) -> bool:
        used = self.manager.allocator.num_used
        try:
            self.kv.append(rid, n)
        except OutOfBlocks:
            return False
        self.allocations += self.manager.allocator.num_used - used
        return True

    def owed(self, req: Request, placed: int, length: int) -> int:
        return cdiv(length, self.block_size) - cdiv(placed, self.block_size)

    def step(self, ids) -> bool:
        used = self.manager.allocator.num_used
        try:
            self.kv.step(ids)
        except OutOfBlocks:
            return False
        self.allocations += self.manager.allocator.num_used - used
        return True

    def release(self, rid: int) -> None:
        self.kv.free(rid, verify=True)

    def free_slots(self) -> int:
        return self.manager.allocator.num_free * self.block_size

    def held(self, ids, lens) -> np.ndarray:
        return cdiv(np.asarray(lens), self.block_size) * self.block_size

    def data_counts(self) -> tuple[int, int, int]:
        return self.kv.tokens_written, self.kv.verified, self.kv.corrupted


class ReservationPolicy(Policy):
    """Before paging: at admission a request gets one contiguous range of the pool,
    sized by ``reserve(request)`` and placed first fit, and keeps it until it
    finishes. Nothing grows, so a step never fails and nothing is preempted; a
    request that cannot be placed waits."""

    def __init__(self, name: str, pool_bytes: int, reserve, *, spec: KVSpec = SIM_SPEC):
        slots = spec.tokens_that_fit(positive_int(pool_bytes, "pool_bytes"))
        if slots < 1:
            raise ConfigError(f"a pool of {pool_bytes} bytes holds no token of "
                              f"{spec.bytes_per_token} bytes")
        self.name, self.reserve, self.pool_slots = name, reserve, slots
        self.token_bytes = spec.bytes_per_token
        self.space = FirstFit(slots)
        self.ranges: dict[int, tuple[int, int]] = {}     # request -> (start, size)

    def check(self, workload) -> None:
        for r in workload.requests:
            if self.reserve(r) > self.pool_slots:
                raise ConfigError(f"request {r.rid} reserves {self.reserve(r)} token "
                                  f"slots ({self.name}); the pool has {self.pool_slots}")

    def admit(self, req: Request, length: int, first: int | None = None,
              promised: int = 0) -> bool:
        n = self.reserve(req)                 # (its whole range, whatever it prefills)
        start = self.space.alloc(n)
        if start is None:
            return False
        self.ranges[req.rid] = (start, n)
        self.allocations += 1
        return True

    def step(self, ids) -> bool:
        return True

    def release(self, rid: int) -> None:
        self.space.free(*self.ranges.pop(rid))

    def free_slots(self) -> int:
        return self.space.free_total

    def held(self, ids, lens) -> np.ndarray:
        return np.array([self.ranges[r][1] for r in ids], dtype=np.int64)

    def fragmented(self, req: Request, length: int) -> bool:
        n = self.reserve(req)
        return self.space.largest() < n <= self.space.free_total


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


POLICY_NAMES = ("max-length", "power-of-two", "exact first-fit")


def make_policy(name: str, pool_bytes: int, max_len: int, *, spec: KVSpec = SIM_SPEC,
                **paged) -> Policy:
    """A policy by name: ``"paged:16"`` (block size 16; ``paged`` holds its options),
    ``"max-length"`` (every request holds ``max_len`` slots), ``"power-of-two"``
    (prompt plus the output rounded up to a power of two: at most twice what the
    output needs, the vLLM paper's Orca (Pow2)) or ``"exact first-fit"`` (exactly
    prompt + output, as if the output length were known: Orca (Oracle))."""
    if name.startswith("paged:"):
        try:
            bs = int(name.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"paged policies are named 'paged:<block size>', "
                              f"got {name!r}") from None
        return PagedPolicy(pool_bytes, bs, spec=spec, max_len=max_len, **paged)
    reserve = {"max-length": lambda r: max_len,
               "power-of-two": lambda r: r.prompt + _pow2(r.output),
               "exact first-fit": lambda r: r.total}.get(name)
    if reserve is None:
        raise ConfigError(f"unknown policy {name!r}; choose 'paged:<block size>' or one "
                          f"of {list(POLICY_NAMES)}")
    return ReservationPolicy(name, pool_bytes, reserve, spec=spec)
