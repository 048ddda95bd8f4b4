"""The multi-sequence simulation: many completions served from one pool, their K/V really written.

Three parts, each small:

* **Workloads** (:func:`make_workload`): requests with a prompt length, an output length and an
  arrival step, drawn from a named preset with a fixed seed.
* **Serving** (:func:`serve`): a continuous-batching loop. Every decode step it admits waiting
  requests, first come first served, while the memory policy can place them (and fewer than
  ``max_seqs`` run), then every running sequence gains one token. A policy is either paged
  (:class:`PagedPolicy`: a real :class:`~pagedkv.manager.KVCacheManager`) or one of the
  reservation schemes that came before paging (:class:`ReservationPolicy`: contiguous byte ranges,
  first fit, sized by the maximum length, by a power of two, or exactly).
* **Sharing** (:func:`beam_search`, :func:`parallel_sampling`): forked sequences that share
  blocks copy-on-write, and how much memory that saves.

The K/V data path is :class:`PagedKV`: the manager's plans executed by
:func:`~pagedkv.kernels.cache_ops.write_kv` and :func:`~pagedkv.kernels.cache_ops.copy_blocks`
on the pool itself (GPU memory with CuPy, host memory with NumPy). Each token's K/V values are a
fixed function of (who wrote it, its position) (:func:`token_values`), so a sequence can be read
back through its page table and every token checked.
"""
from __future__ import annotations

import bisect
import heapq
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import backend
from .allocator import BlockAllocator
from .errors import ConfigError, OutOfBlocks
from .manager import KVCacheManager

__all__ = ["Request", "Workload", "PRESETS", "make_workload", "token_values", "PagedKV",
           "PagedPolicy", "ReservationPolicy", "FirstFit", "make_policy", "POLICY_NAMES", "Run",
           "serve", "simulate", "dashboard", "compare_policies", "policy_table", "scale_run",
           "beam_search", "parallel_sampling", "sharing_savings"]

MiB = 1 << 20


def _cdiv(a, b):
    return -(-a // b)


def _positive(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return int(value)


# ============================================================================ workloads

@dataclass(frozen=True)
class Request:
    rid: int
    arrival: int   # the decode step at which the request arrives
    prompt: int    # prompt tokens (written at admission, the prefill)
    output: int    # tokens generated, one per decode step

    @property
    def total(self) -> int:
        return self.prompt + self.output


@dataclass(frozen=True)
class Workload:
    name: str
    requests: tuple
    max_len: int   # the longest a sequence may grow: what a max-length reservation holds
    seed: int

    def __len__(self) -> int:
        return len(self.requests)

    def lengths(self):
        """(prompt lengths, output lengths) as NumPy arrays."""
        return (np.array([r.prompt for r in self.requests]),
                np.array([r.output for r in self.requests]))


#: Length distributions. ``uniform`` draws integers in [lo, hi]. ``lognormal`` has mean ``m``
#: before rounding and clipping (mu = ln(m) - sigma^2 / 2) and is clipped to [lo, hi]; ``m`` is
#: set so that the mean *after* clipping is the target: ``chat`` follows the ShareGPT means
#: reported in the vLLM paper (161 input, 338 output tokens; m = 166.0 and 358.1), ``alpaca``
#: its Alpaca means (19.3 and 58.5; m = 19.3 and 58.6). The sigmas are our choice (the paper
#: shows histograms, not parameters): long tails, as conversations and instructions have.
#: Prompt and output are each clipped to 1024 for ``chat``, so no request passes 2048 tokens.
PRESETS = {
    "default": dict(prompt=("uniform", 4, 32), output=("uniform", 32, 256), max_len=288,
                    n=100, rate=None),
    "chat": dict(prompt=("lognormal", 166.0, 1.0, 4, 1024),
                 output=("lognormal", 358.1, 0.8, 4, 1024), max_len=2048, n=1000, rate=None),
    "alpaca": dict(prompt=("lognormal", 19.3, 0.6, 2, 256),
                   output=("lognormal", 58.6, 0.8, 2, 512), max_len=2048, n=1000, rate=None),
}


def _draw(rng, spec, n):
    kind = spec[0]
    if kind == "uniform":
        return rng.integers(spec[1], spec[2] + 1, size=n)
    _, mean, sigma, lo, hi = spec
    x = rng.lognormal(np.log(mean) - sigma ** 2 / 2, sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


def make_workload(preset: str = "default", *, n: int | None = None, seed: int = 0,
                  rate: float | None = None) -> Workload:
    """``n`` requests from ``preset``. ``rate`` (requests per decode step) gives Poisson
    arrivals; ``None`` puts every request in the queue at step 0."""
    if preset not in PRESETS:
        raise ConfigError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    p = PRESETS[preset]
    n = p["n"] if n is None else _positive(n, "the number of requests")
    rate = p["rate"] if rate is None else rate
    if rate is not None and (isinstance(rate, bool) or not rate > 0 or not np.isfinite(rate)):
        raise ConfigError(f"the arrival rate must be a positive number, got {rate!r}")
    rng = np.random.default_rng(seed)
    prompts, outputs = _draw(rng, p["prompt"], n), _draw(rng, p["output"], n)
    if rate is None:
        arrivals = np.zeros(n, dtype=np.int64)
    else:  # a Poisson process: exponential gaps, arrival step = floor of the arrival time
        arrivals = np.floor(np.cumsum(rng.exponential(1.0 / rate, size=n))).astype(np.int64)
    reqs = tuple(Request(i, int(a), int(pl), int(ol))
                 for i, (a, pl, ol) in enumerate(zip(arrivals, prompts, outputs)))
    return Workload(preset, reqs, int(p["max_len"]), int(seed))


def _check_requests(requests, max_len: int):
    for r in requests:
        if r.prompt < 1 or r.output < 1 or r.arrival < 0:
            raise ConfigError(f"request {r.rid}: prompt and output must be at least 1 token and "
                              f"the arrival step non-negative, got {r}")
        if r.total > max_len:
            raise ConfigError(f"request {r.rid} grows to {r.total} tokens, past max_len={max_len}")


# ============================================================================ K/V data

def token_values(writers, positions, kv_heads: int = 1, head_dim: int = 64):
    """The K and V a sequence ``writers[i]`` stores at ``positions[i]``: float32
    ``[tokens, kv_heads, head_dim]`` each, a hash of the pair (below 2**23, so exact in float32)
    plus the element index; V is the negative of K."""
    w = np.asarray(writers, dtype=np.int64).astype(np.uint32)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = (w * np.uint32(40503) + p) * np.uint32(2654435761)
        h ^= h >> np.uint32(15)
    base = (h & np.uint32(0x7FFFFF)).astype(np.float32)
    k = base[:, None, None] + np.arange(kv_heads * head_dim, dtype=np.float32).reshape(
        1, kv_heads, head_dim)
    return k, -k


class PagedKV:
    """A :class:`KVCacheManager` together with the K/V bytes it manages.

    Every slot a plan names is written (``write_kv``), every copy-on-write copy is executed
    (``copy_blocks``, one batched call per step), and :meth:`verify` reads a sequence back
    through its page table. Sequence ids are integers: they are also the writer ids of
    :func:`token_values`. A sequence remembers who wrote each of its positions as segments
    ``(first position, writer)``: a fork inherits its parent's, and its own writes start a new one.

    With ``write=False`` only the bookkeeping runs (no pool bytes are touched).
    """

    def __init__(self, pool_bytes: int, block_size: int, *, kv_heads: int = 1,
                 head_dim: int = 64, write: bool = True, max_seqs: int = 64,
                 max_seq_len: int = 256):
        block_size = _positive(block_size, "block_size")
        self.token_bytes = 2 * _positive(kv_heads, "kv_heads") * _positive(head_dim, "head_dim") * 4
        pool_bytes = _positive(pool_bytes, "pool_bytes")
        if pool_bytes < block_size * self.token_bytes:
            raise ConfigError(f"a pool of {pool_bytes} bytes is smaller than one block "
                              f"({block_size} tokens x {self.token_bytes} B)")
        self.allocator = BlockAllocator.from_pool_bytes(pool_bytes, block_size * self.token_bytes)
        self.manager = KVCacheManager(self.allocator, block_size, max_seqs=max_seqs,
                                      max_seq_len=max_seq_len)
        self.block_size, self.kv_heads, self.head_dim = block_size, kv_heads, head_dim
        self.write = bool(write)
        self.cache = (self.allocator.view(np.float32, (2, block_size, kv_heads, head_dim))
                      if self.write else None)
        self._segments: dict[int, list] = {}
        self.copies = 0           # copy-on-write block copies executed
        self.tokens_written = 0   # token slots written (prefills and decode steps)
        self.verified = 0         # tokens read back and checked
        self.corrupted = 0        # of those, tokens whose K or V differed

    # -------------------------------------------------------------- executing plans
    def _write(self, slots, writers, positions):
        self.tokens_written += len(slots)
        if not self.write or not len(slots):
            return
        from .kernels.cache_ops import write_kv
        k, v = token_values(writers, positions, self.kv_heads, self.head_dim)
        xp = backend.xp if backend.on_gpu else np
        write_kv(self.cache, xp.asarray(k), xp.asarray(v),
                 xp.asarray(np.asarray(slots, dtype=np.int32)))

    def _copy(self, pairs):
        if len(pairs):
            self.copies += len(pairs)
            if self.write:
                from .kernels.cache_ops import copy_blocks
                copy_blocks(self.cache, np.asarray(pairs, dtype=np.int32))

    def add(self, sid: int, n: int):
        """A new sequence with ``n`` prompt tokens, written (raises :class:`OutOfBlocks`)."""
        plan = self.manager.add(sid, n)
        self._segments[sid] = [(0, sid)]
        self._write(plan.slots, np.full(n, sid), np.arange(n))
        return plan

    def fork(self, parent: int, *children: int) -> None:
        self.manager.fork(parent, *children)
        for c in children:
            self._segments[c] = list(self._segments[parent])

    def step(self, ids):
        """Every sequence in ``ids`` gains one token: copies first, then the writes."""
        plan = self.manager.step(ids)
        self._copy(plan.copies)
        positions = plan.seq_lens - 1
        if self.write:
            for sid, pos in zip(plan.seq_ids, positions.tolist()):
                segs = self._segments[sid]
                if segs[-1][1] != sid:
                    segs.append((pos, sid))
        self._write(plan.slot_mapping, plan.seq_ids, positions)
        return plan

    # -------------------------------------------------------------- reading back
    def writers(self, sid: int) -> np.ndarray:
        """Who wrote each of the sequence's positions."""
        n = self.manager.num_tokens(sid)
        starts = [s for s, _ in self._segments[sid]] + [n]
        return np.repeat([w for _, w in self._segments[sid]], np.diff(starts))

    def read(self, sid: int) -> np.ndarray:
        """The sequence's K/V read through its page table: ``[tokens, 2, kv_heads, head_dim]``."""
        slots = self.manager.slots(sid).astype(np.int64)
        bs = self.block_size
        xp = backend.xp if backend.on_gpu else np
        blocks, offsets = xp.asarray(slots // bs), xp.asarray(slots % bs)
        return backend.to_numpy(self.cache[blocks, :, offsets])

    def verify(self, sid: int) -> int:
        """How many of the sequence's tokens read back differently from what was written."""
        if not self.write:
            return 0
        got = self.read(sid)
        k, v = token_values(self.writers(sid), np.arange(len(got)), self.kv_heads,
                            self.head_dim)
        bad = (got[:, 0] != k).reshape(len(got), -1).any(1) | \
              (got[:, 1] != v).reshape(len(got), -1).any(1)
        self.verified += len(got)
        self.corrupted += int(bad.sum())
        return int(bad.sum())

    def free(self, sid: int, verify: bool = True) -> int:
        """Verify (by default), then release the sequence. Returns its corrupted tokens."""
        bad = self.verify(sid) if verify else 0
        self.manager.free(sid)
        del self._segments[sid]
        return bad

    def used_and_unshared(self) -> tuple[int, int]:
        """(blocks in use, blocks the live sequences would use with no sharing)."""
        lens = np.array([self.manager.num_tokens(s) for s in self.manager.seq_ids])
        return self.allocator.num_used, int(_cdiv(lens, self.block_size).sum())

    def ownership(self) -> np.ndarray:
        """Each block's owner: the id of the one sequence mapping it, -2 if shared, -1 free."""
        m = self.manager
        out = np.full(self.allocator.num_blocks, -1, dtype=np.int64)
        ref = self.allocator.refcounts()
        for sid in m.seq_ids:
            out[m.block_table(sid)] = sid
        out[ref > 1] = -2
        return out


# ============================================================================ policies

class PagedPolicy:
    """Paging: blocks of ``block_size`` tokens taken one at a time as sequences grow.

    Admits a request when its tokens so far plus the next one fit in free blocks and leave
    ``watermark`` (a share of the pool's blocks, 1 % as in vLLM) free for the running sequences to
    grow into. A decode step that finds too few free blocks is refused (:meth:`step` returns
    False) and :func:`serve` preempts the newest sequence, which recomputes later.
    """

    paged = True

    def __init__(self, pool_bytes: int, block_size: int, *, write: bool = False,
                 max_seqs: int = 64, max_len: int = 256, kv_heads: int = 1, head_dim: int = 64,
                 watermark: float = 0.01):
        if not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), got {watermark!r}")
        self.kv = PagedKV(pool_bytes, block_size, write=write, max_seqs=max_seqs,
                          max_seq_len=max_len, kv_heads=kv_heads, head_dim=head_dim)
        self.block_size = block_size
        self.name = f"paged, block {block_size}"
        self.token_bytes = self.kv.token_bytes
        self.pool_slots = pool_bytes // self.token_bytes
        self.block_allocs = 0
        self.watermark = int(watermark * self.kv.allocator.num_blocks)

    def need(self, length: int, req: Request | None = None) -> int:
        """Token slots a request of ``length`` tokens needs before it may start."""
        return _cdiv(length + 1, self.block_size) * self.block_size

    def admit(self, rid: int, req: Request, length: int) -> bool:
        alloc = self.kv.allocator
        if _cdiv(length + 1, self.block_size) + self.watermark > alloc.num_free:
            return False
        self.kv.add(rid, length)
        self.block_allocs += _cdiv(length, self.block_size)
        return True

    def step(self, ids) -> bool:
        used = self.kv.allocator.num_used
        try:
            self.kv.step(ids)
        except OutOfBlocks:
            return False
        self.block_allocs += self.kv.allocator.num_used - used
        return True

    def release(self, rid: int, verify: bool = True) -> None:
        self.kv.free(rid, verify)

    def free_slots(self) -> int:
        return self.kv.allocator.num_free * self.block_size

    def capacities(self, lens, fixed) -> np.ndarray:
        return _cdiv(lens, self.block_size) * self.block_size


class FirstFit:
    """A contiguous range of ``size`` slots handed out first fit: sorted free holes
    ``(start, length)``, merged with their neighbours when a range comes back."""

    def __init__(self, size: int):
        self.size = _positive(size, "size")
        self.starts, self.lengths = [0], [self.size]
        self.free_total = self.size

    def alloc(self, n: int):
        """The start of ``n`` contiguous slots, or None when no hole is that long."""
        for i, length in enumerate(self.lengths):
            if length >= n:
                start = self.starts[i]
                if length == n:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i] += n
                    self.lengths[i] -= n
                self.free_total -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.starts, start)
        if i and self.starts[i - 1] + self.lengths[i - 1] > start or \
                i < len(self.starts) and start + n > self.starts[i]:
            raise ConfigError(f"range [{start}, {start + n}) overlaps a free hole")
        self.free_total += n
        if i < len(self.starts) and start + n == self.starts[i]:   # merge with the next hole
            n += self.lengths[i]
            del self.starts[i], self.lengths[i]
        if i and self.starts[i - 1] + self.lengths[i - 1] == start:  # ... and the previous
            self.lengths[i - 1] += n
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, n)

    def largest(self) -> int:
        return max(self.lengths, default=0)


class ReservationPolicy:
    """Before paging: at admission a request gets one contiguous range of the pool, sized by
    ``reserve(request)`` and placed first fit, and keeps it until it finishes. Nothing grows,
    so a step never fails and nothing is preempted; a request that cannot be placed waits."""

    paged = False

    def __init__(self, name: str, pool_slots: int, reserve, token_bytes: int = 512):
        self.name = name
        self.pool_slots = _positive(pool_slots, "pool_slots")
        self.token_bytes = token_bytes
        self.reserve = reserve
        self.space = FirstFit(self.pool_slots)
        self.ranges: dict[int, tuple[int, int]] = {}
        self.block_allocs = 0

    def need(self, length: int, req: Request) -> int:
        return self.reserve(req)

    def admit(self, rid: int, req: Request, length: int) -> bool:
        n = self.reserve(req)
        start = self.space.alloc(n)
        if start is None:
            return False
        self.ranges[rid] = (start, n)
        self.block_allocs += 1
        return True

    def step(self, ids) -> bool:
        return True

    def release(self, rid: int, verify: bool = True) -> None:
        self.space.free(*self.ranges.pop(rid))

    def free_slots(self) -> int:
        return self.space.free_total

    def capacities(self, lens, fixed) -> np.ndarray:
        return fixed


def _pow2(n: int) -> int:
    return 1 << (int(n) - 1).bit_length()


POLICY_NAMES = ("max-length", "power-of-two", "exact first-fit")


def make_policy(name: str, pool_bytes: int, max_len: int, *, token_bytes: int = 512, **paged):
    """A policy by name: ``"paged:16"`` (block size 16), ``"max-length"`` (every request holds
    ``max_len`` slots), ``"power-of-two"`` (prompt plus the output rounded up to a power of two:
    at most twice what the output needs, as Orca (Pow2) in the vLLM paper) or
    ``"exact first-fit"`` (exactly prompt + output, as if the output length were known)."""
    slots = _positive(pool_bytes, "pool_bytes") // token_bytes
    if name.startswith("paged:"):
        try:
            bs = int(name.split(":", 1)[1])
        except ValueError:
            raise ConfigError(f"paged policies are named 'paged:<block size>', got {name!r}") from None
        return PagedPolicy(pool_bytes, _positive(bs, "block_size"), max_len=max_len, **paged)
    reserve = {"max-length": lambda r: max_len,
               "power-of-two": lambda r: r.prompt + _pow2(r.output),
               "exact first-fit": lambda r: r.total}.get(name)
    if reserve is None:
        raise ConfigError(f"unknown policy {name!r}; choose 'paged:<block size>' or one of "
                          f"{list(POLICY_NAMES)}")
    if slots < 1:
        raise ConfigError(f"a pool of {pool_bytes} bytes holds no token of {token_bytes} bytes")
    return ReservationPolicy(name, slots, reserve, token_bytes)


# ============================================================================ serving

@dataclass
class Run:
    """What one :func:`serve` run measured. The per-step arrays are token slots (one slot holds
    one token's K/V) sampled after every decode step, before finished requests leave."""
    policy: str
    workload: str
    seed: int
    pool_slots: int
    token_bytes: int
    max_seqs: int
    completions: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0    # tokens prefilled again after a preemption
    steps: int = 0
    tokens_generated: int = 0
    tokens_written: int = 0
    block_allocs: int = 0
    verified_tokens: int = 0
    corrupted_tokens: int = 0
    seconds: float = 0.0
    series: dict = field(default_factory=dict)
    stats_at_peak: dict | None = None
    block_size: int | None = None
    max_len: int = 0

    def mean_share(self, key: str, busy: bool = True) -> float:
        """Time-averaged share of the pool in category ``key``. With ``busy``, only over the
        steps when a request was waiting (memory, or ``max_seqs``, was the limit): while nobody
        waits, free memory wastes nothing."""
        x = self.series[key]
        if busy:
            x = x[self.series["waiting"] > 0]
        return float(np.mean(x)) / self.pool_slots if len(x) else 0.0

    @property
    def peak_running(self) -> int:
        return int(self.series["running"].max())

    @property
    def peak_used(self) -> int:
        """Most token slots held at once (blocks in use x block size, or reserved ranges)."""
        return int(self.series["held"].max())

    def breakdown(self, busy: bool = True) -> dict:
        """Time-averaged shares of the pool (they sum to 1); see :meth:`mean_share`."""
        keys = ("tokens", "reserved", "internal", "external", "free")
        return {k: self.mean_share(k, busy) for k in keys}


def serve(workload: Workload, policy, *, max_seqs: int = 256, audit_every: int = 0,
          record_stats: int = 0, tamper=None, snapshot_blocks: int = 0) -> Run:
    """Serve every request of ``workload`` with ``policy``; return what was measured.

    Each decode step: (1) requests that have arrived join the queue; (2) the queue's head is
    admitted while the policy can place it and fewer than ``max_seqs`` run (first come, first
    served: a head that does not fit makes everyone behind it wait); (3) every running sequence
    gains a token. If a paged step runs out of blocks, the most recently admitted sequence is
    preempted: its blocks are freed and it goes back to the head of the queue, to be recomputed
    (prompt and the tokens generated so far are prefilled again) when blocks are free. Finished
    requests leave after the step (a paged policy with ``write=True`` first checks their K/V).

    ``audit_every=k`` runs the manager's invariant audit every k steps (and at the end);
    ``record_stats=k`` takes the manager's :class:`~pagedkv.manager.CacheStats` every k steps and
    at every new peak of blocks in use (each call costs time proportional to the pool), and
    checks its counts of used blocks and stored tokens against the simulation's own;
    ``tamper(kv, step)`` is called after every step (to corrupt data on purpose, in tests);
    ``snapshot_blocks=b`` records the owner of blocks ``0 .. b-1`` every step (for a heat map).

    Memory categories, in token slots, per step: ``tokens`` (K/V of tokens so far), ``reserved``
    (held for tokens the request will still generate), ``internal`` (held but never to be used:
    past the request's final length), ``external`` (free, but the waiting request at the head of
    the queue was refused although the pool had that much free in total: free space in holes too
    small), ``free`` (the rest).
    """
    max_seqs = _positive(max_seqs, "max_seqs")
    paged = policy.paged
    if paged:
        _check_requests(workload.requests, min(workload.max_len,
                                               policy.kv.allocator.num_blocks * policy.block_size - 1))
    else:
        _check_requests(workload.requests, workload.max_len)
        biggest = max((policy.need(r.prompt, r) for r in workload.requests), default=0)
        if biggest > policy.pool_slots:
            raise ConfigError(f"a request needs {biggest} slots; the pool has {policy.pool_slots}")
    run = Run(policy.name, workload.name, workload.seed, policy.pool_slots, policy.token_bytes,
              max_seqs, block_size=getattr(policy, "block_size", None), max_len=workload.max_len)
    pending = deque(sorted(workload.requests, key=lambda r: (r.arrival, r.rid)))
    waiting: deque = deque()
    length: dict[int, int] = {}       # tokens a preempted request already has
    ids: list[int] = []               # running, in admission order
    lens = np.zeros(0, np.int64)      # their lengths, aligned with ids
    finals = np.zeros(0, np.int64)    # their final lengths
    fixed = np.zeros(0, np.int64)     # their reservations (reservation policies)
    by_id = {r.rid: r for r in workload.requests}
    rec = {k: [] for k in ("step", "running", "tokens", "reserved", "internal", "external",
                           "free", "held", "waiting")}
    stats_series, snaps = [], []
    peak_held = -1
    step = 0
    t0 = time.perf_counter()
    while pending or waiting or ids:
        while pending and pending[0].arrival <= step:
            waiting.append(pending.popleft())
        blocked = False
        new_ids, new_lens, new_finals, new_fixed = [], [], [], []
        while waiting and len(ids) + len(new_ids) < max_seqs:
            req = waiting[0]
            have = length.get(req.rid, req.prompt)
            if not policy.admit(req.rid, req, have):
                # blocked by fragmentation: the pool had enough free in total, but not usable
                # (never for paging: any free block serves, it waits only for enough of them)
                blocked = not paged and policy.free_slots() >= policy.need(have, req)
                break
            waiting.popleft()
            new_ids.append(req.rid)
            new_lens.append(have)
            new_finals.append(req.total)
            new_fixed.append(policy.need(have, req) if not paged else 0)
        if new_ids:
            ids += new_ids
            lens = np.concatenate([lens, new_lens])
            finals = np.concatenate([finals, new_finals])
            fixed = np.concatenate([fixed, new_fixed])
        if not ids:
            if pending:          # idle until the next arrival
                step = max(step + 1, pending[0].arrival)
                continue
            raise ConfigError("a waiting request can never be admitted")  # pragma: no cover
        while not policy.step(ids):
            victim = ids.pop()
            length[victim] = int(lens[-1])
            lens, finals, fixed = lens[:-1], finals[:-1], fixed[:-1]
            policy.release(victim, verify=True)
            waiting.appendleft(by_id[victim])
            run.preemptions += 1
            run.recomputed_tokens += length[victim]
            if not ids:
                raise ConfigError("one sequence alone cannot grow: the pool is too small")
        lens += 1
        run.tokens_generated += len(ids)
        step += 1
        if tamper is not None:
            tamper(policy.kv if paged else policy, step)
        # ---- measure
        caps = policy.capacities(lens, fixed)
        will_use = np.minimum(caps, finals)
        free = policy.free_slots()
        tokens = int(lens.sum())
        held = int(caps.sum())
        ext = free if blocked else 0
        rec["step"].append(step)
        rec["running"].append(len(ids))
        rec["tokens"].append(tokens)
        rec["reserved"].append(int(will_use.sum()) - tokens)
        rec["internal"].append(held - int(will_use.sum()))
        rec["external"].append(ext)
        rec["free"].append(policy.pool_slots - held - ext)
        rec["held"].append(held)
        rec["waiting"].append(len(waiting))
        if paged and record_stats and (held > peak_held or step % record_stats == 0):
            s = policy.kv.manager.stats()     # O(pool): taken at new peaks and every k steps
            assert s.used_blocks * policy.block_size == held and s.stored_tokens == tokens, \
                "the manager's count of used blocks or stored tokens differs from the simulation's"
            stats_series.append((step, s.internal_fragmentation, s.external_fragmentation))
            if held > peak_held:
                peak_held, run.stats_at_peak = held, s.as_dict()
        if paged and snapshot_blocks:
            snaps.append(_owners(policy.kv, snapshot_blocks, ids))
        if paged and audit_every and step % audit_every == 0:
            policy.kv.manager.audit()
        # ---- finished requests leave
        done = lens >= finals
        if done.any():
            for i in np.flatnonzero(done).tolist():
                policy.release(ids[i], verify=True)
                length.pop(ids[i], None)
                run.completions += 1
            keep = ~done
            ids = [s for s, k in zip(ids, keep.tolist()) if k]
            lens, finals, fixed = lens[keep], finals[keep], fixed[keep]
    run.seconds = time.perf_counter() - t0
    run.steps = step
    run.block_allocs = policy.block_allocs
    run.series = {k: np.asarray(v, dtype=np.int64) for k, v in rec.items()}
    if paged:
        kv = policy.kv
        kv.manager.audit()
        assert kv.allocator.num_used == 0, "blocks still in use after every request finished"
        run.tokens_written = kv.tokens_written
        run.verified_tokens, run.corrupted_tokens = kv.verified, kv.corrupted
        if record_stats:
            arr = np.array(stats_series, dtype=np.float64).reshape(-1, 3)
            run.series["stats_step"] = arr[:, 0].astype(np.int64)
            run.series["internal_fragmentation"] = arr[:, 1]
            run.series["external_fragmentation"] = arr[:, 2]
        if snapshot_blocks:
            run.series["owners"] = np.array(snaps)
    return run


def _owners(kv: PagedKV, nblocks: int, ids) -> np.ndarray:
    """Owner of blocks 0 .. nblocks-1: a request id, -2 when shared, -1 when free."""
    out = np.full(nblocks, -1, dtype=np.int64)
    for sid in ids:
        t = kv.manager.block_table(sid)
        t = t[t < nblocks]
        out[t] = sid
    ref = kv.allocator.refcounts()[:nblocks]
    out[ref > 1] = -2
    return out


def simulate(preset: str = "default", *, seed: int = 0, pool_bytes: int = 256 * MiB,
             block_size: int = 16, max_seqs: int = 8, n: int | None = None,
             rate: float | None = None, write: bool = True, audit_every: int = 50,
             tamper=None, snapshot_blocks: int = 0) -> Run:
    """The chapter's simulation: ``preset``'s requests served ``max_seqs`` at a time from a
    paged pool, every token's K/V written (``write``) and checked when its request finishes."""
    wl = make_workload(preset, n=n, seed=seed, rate=rate)
    policy = PagedPolicy(pool_bytes, block_size, write=write, max_seqs=max_seqs,
                         max_len=wl.max_len)
    return serve(wl, policy, max_seqs=max_seqs, audit_every=audit_every, record_stats=25,
                 tamper=tamper, snapshot_blocks=snapshot_blocks)


def dashboard(run: Run) -> str:
    """The simulation's numbers as a small text report (no timings, no device names)."""
    bs, tb = run.block_size, run.token_bytes
    s = run.series
    util = s["held"] / (run.pool_slots // bs * bs)
    peak = run.peak_used
    # what reserving max_len for every running sequence would hold, at the worst step
    naive = int(s["running"].max()) * run.max_len
    naive_at_peak = int(s["running"][np.argmax(s["held"])]) * run.max_len
    ifrag = (s["held"] - s["tokens"]) / np.maximum(s["held"], 1)   # same as the manager's
    efrag = s.get("external_fragmentation")
    at = run.stats_at_peak or {}
    lines = [
        f"workload {run.workload!r}, seed {run.seed}: {run.completions} completions, "
        f"at most {run.max_seqs} at a time, {run.steps} decode steps, {run.preemptions} preemptions",
        f"pool: {run.pool_slots * tb / MiB:.0f} MiB = {run.pool_slots // bs} blocks x {bs} tokens "
        f"x {tb} B",
        f"token K/V written: {run.tokens_written} ({run.tokens_generated} decode + "
        f"{run.tokens_written - run.tokens_generated} prefill); block allocations: {run.block_allocs}",
        f"utilization (blocks in use / pool): peak {util.max():.3%} ({peak // bs} blocks), "
        f"final {util[-1] if len(util) else 0:.3%} before the last request left, 0 after",
        f"internal fragmentation (unfilled slots of used blocks): at peak "
        f"{at.get('internal_fragmentation', 0):.2%}, mean over steps {np.mean(ifrag):.2%}",
        f"external fragmentation as measured (1 - longest free run / free blocks): "
        f"max {np.max(efrag):.4f} over {len(efrag)} samples; it costs a paged pool nothing"
        if efrag is not None and len(efrag) else "external fragmentation: not recorded",
        f"paged vs naive: peak {peak} token slots in blocks vs {naive_at_peak} that max-length "
        f"reservation ({run.max_len} per sequence) holds at that step "
        f"({naive_at_peak / peak:.2f}x); at its own worst step {naive}",
        f"verification: {run.verified_tokens} tokens read back through page tables, "
        f"{run.corrupted_tokens} corrupted",
    ]
    return "\n".join(lines)


# ============================================================================ comparing policies

def compare_policies(workload: Workload, pool_bytes: int, *, block_sizes=(1, 8, 16, 32, 128),
                     others=POLICY_NAMES, max_seqs: int = 256, token_bytes: int = 512) -> list:
    """The same trace served by each paged block size and each reservation policy."""
    names = [f"paged:{b}" for b in block_sizes] + list(others)
    runs = []
    for name in names:
        policy = make_policy(name, pool_bytes, workload.max_len, token_bytes=token_bytes,
                             **({"max_seqs": max_seqs} if name.startswith("paged") else {}))
        runs.append(serve(workload, policy, max_seqs=max_seqs))
    return runs


def policy_table(runs) -> str:
    """Per policy: time-averaged shares of the pool, peak concurrency, steps to finish."""
    head = (f"{'policy':<17}{'tokens':>8}{'reserved':>10}{'internal':>10}{'external':>10}"
            f"{'free':>7}{'tokens/held':>13}{'peak seqs':>11}{'steps':>7}{'preempt':>9}"
            f"{'recomputed':>12}")
    rows = [head]
    for r in runs:
        b = r.breakdown()
        occupied = 1 - b["free"]
        rows.append(f"{r.policy:<17}{b['tokens']:>8.1%}{b['reserved']:>10.1%}"
                    f"{b['internal']:>10.1%}{b['external']:>10.1%}{b['free']:>7.1%}"
                    f"{b['tokens'] / occupied if occupied else 0:>13.1%}{r.peak_running:>11}"
                    f"{r.steps:>7}{r.preemptions:>9}{r.recomputed_tokens:>12}")
    return "\n".join(rows)


def scale_run(n: int = 10_000, *, preset: str = "chat", seed: int = 0,
              pool_bytes: int = 256 * MiB, block_size: int = 16, max_seqs: int = 256) -> Run:
    """``n`` completions, bookkeeping only (no K/V written): how fast the manager serves."""
    wl = make_workload(preset, n=n, seed=seed)
    policy = PagedPolicy(pool_bytes, block_size, write=False, max_seqs=max_seqs,
                         max_len=wl.max_len)
    return serve(wl, policy, max_seqs=max_seqs)


# ============================================================================ sharing

def _beam_children(rng, scores, width, alpha, vocab):
    """One beam-search step over random next-token distributions: every beam proposes its
    ``width`` likeliest tokens (probabilities from a Dirichlet(alpha) draw over ``vocab``
    tokens), and the ``width`` best candidates by total log-probability survive. Returns the
    surviving candidates' parent indices and scores."""
    probs = rng.dirichlet(np.full(vocab, alpha), size=len(scores))
    top = -np.sort(-probs, axis=1)[:, :width]
    cand = scores[:, None] + np.log(np.maximum(top, 1e-300))
    best = np.argsort(-cand, axis=None, kind="stable")[:width]
    return best // width, cand.ravel()[best]


def _tally(kv: PagedKV, record) -> tuple[int, int]:
    """Blocks in use now and blocks the same sequences would hold unshared; appended to
    ``record`` (with the pool's owners and the copies so far) when one is given."""
    used, unshared = kv.used_and_unshared()
    if record is not None:
        record.append((used, unshared, kv.ownership(), kv.copies))
    return used, unshared


def beam_search(kv: PagedKV, first_id: int, prompt: int, output: int, width: int, rng, *,
                alpha: float = 0.3, vocab: int = 64, record=None) -> tuple[int, int]:
    """One beam-search request as a process on ``kv``: prefill the prompt, then every step fork
    beams that have several surviving children, free (prune) beams that have none, and step all
    beams. Every beam is verified when it is freed. Sequence ids are ``first_id, first_id+1, …``.

    Returns (sum over steps of blocks in use, sum over steps of blocks without sharing).
    ``record`` (a list) receives ``(used, unshared, ownership, copies so far)`` after every step.
    """
    _positive(width, "beam width")
    _positive(prompt, "prompt")
    _positive(output, "output")
    next_id = first_id
    kv.add(next_id, prompt)
    beams, scores = [next_id], np.zeros(1)
    next_id += 1
    used_sum = unshared_sum = 0
    for _ in range(output):
        parents, scores = _beam_children(rng, scores, width, alpha, vocab)
        counts = np.bincount(parents, minlength=len(beams))
        new = []
        for i in parents.tolist():       # the first child of a beam continues it; others fork
            if beams[i] in new:
                kv.fork(beams[i], next_id)
                new.append(next_id)
                next_id += 1
            else:
                new.append(beams[i])
        for i in np.flatnonzero(counts == 0).tolist():
            kv.free(beams[i])            # pruned: verified, then its blocks go back
        beams = new
        kv.step(beams)
        used, unshared = _tally(kv, record)
        used_sum += used
        unshared_sum += unshared
    for b in beams:
        kv.free(b)
    return used_sum, unshared_sum


def parallel_sampling(kv: PagedKV, first_id: int, prompt: int, output: int, n: int, *,
                      record=None) -> tuple[int, int]:
    """``n`` samples of one prompt: prefill once, fork ``n - 1`` times, then every sample
    writes its own ``output`` tokens. Returns sums over steps as :func:`beam_search` does."""
    _positive(n, "n")
    ids = list(range(first_id, first_id + n))
    kv.add(ids[0], prompt)
    if n > 1:
        kv.fork(ids[0], *ids[1:])
    used_sum = unshared_sum = 0
    for _ in range(output):
        kv.step(ids)
        used, unshared = _tally(kv, record)
        used_sum += used
        unshared_sum += unshared
    for s in ids:
        kv.free(s)
    return used_sum, unshared_sum


def sharing_savings(mode: str, widths=(2, 4, 6), *, preset: str = "alpaca", n: int = 200,
                    seed: int = 0, block_size: int = 16, write: bool = True,
                    alpha: float = 0.3) -> dict:
    """Memory saved by sharing, for beam search (``mode="beam"``) or parallel sampling
    (``"parallel"``), over ``n`` requests of ``preset`` served one after another.

    Saving = 1 - (blocks in use) / (blocks the same sequences would hold without sharing),
    both summed over every decode step of every request (a time average, weighted by memory).
    Returns ``{width: {"saving", "copies", "verified", "corrupted"}}``.
    """
    if mode not in ("beam", "parallel"):
        raise ConfigError(f"mode must be 'beam' or 'parallel', got {mode!r}")
    wl = make_workload(preset, n=n, seed=seed)
    out = {}
    for w in widths:
        w = _positive(w, "width")
        biggest = max(r.total for r in wl.requests)
        pool = (2 * w + 2) * _cdiv(biggest, block_size) * block_size * 512
        kv = PagedKV(pool, block_size, write=write, max_seqs=2 * w, max_seq_len=biggest)
        rng = np.random.default_rng([seed, w])
        used = unshared = 0
        next_id = 0
        for r in wl.requests:
            if mode == "beam":
                u, s = beam_search(kv, next_id, r.prompt, r.output, w, rng, alpha=alpha)
                next_id += 1 + w * r.output    # enough fresh ids for every fork
            else:
                u, s = parallel_sampling(kv, next_id, r.prompt, r.output, w)
                next_id += w
            used += u
            unshared += s
        kv.manager.audit()
        assert kv.allocator.num_used == 0
        out[w] = dict(saving=1 - used / unshared, copies=kv.copies, verified=kv.verified,
                      corrupted=kv.corrupted)
    return out
