"""Measuring the serving loop from outside: observers and what they record.

* :class:`Recorder` fills a :class:`Run`: counts (admissions, preemptions, tokens) and,
  after every decode step, where the pool's memory is, in five categories;
* :class:`ManagerProbe` watches a paged run's manager: its invariant audit every k
  steps, and its own statistics (``stats()``) checked against the simulation's counts.

Memory categories, in token slots, per step (they add up to the pool):

* ``tokens``: K/V of the tokens so far;
* ``reserved``: held for tokens the request will still generate;
* ``internal``: held but never to be used (past the request's final length);
* ``external``: free, but the request at the head of the queue was refused although the
  free slots add up to enough (they lie in holes too small);
* ``free``: the rest.
"""
from __future__ import annotations

import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from ..checks import cdiv
from ..errors import AuditError

__all__ = ["Observer", "Run", "Recorder", "ManagerProbe", "Observers", "SERIES"]

#: The per-step series a :class:`Recorder` keeps (one int64 each per decode step).
SERIES = ("step", "running", "tokens", "reserved", "internal", "external", "free", "held",
          "waiting", "finished")


class Observer:
    """Told what the serving loop does, at four points; each method does nothing
    unless overridden. ``batch`` is the :class:`~pagedkv.sim.serving.Running` of
    running requests, ``queue`` the :class:`~pagedkv.sim.serving.Queue`, ``refused``
    the (request, tokens) at the head of the queue that admission refused this step,
    or None."""

    def admitted(self, step, req, length): ...   # length: the tokens it prefills
    def preempted(self, step, rid, length): ...
    def stepped(self, step, batch, queue, refused): ...
    def left(self, step, rid): ...
    def finished(self, run): ...


@dataclass
class Run:
    """What one :func:`~pagedkv.sim.serving.serve` run measured. ``series`` holds the
    per-step arrays of :data:`SERIES`, sampled after every decode step (before
    finished requests leave): memory in token slots, requests running and waiting,
    and requests finished by that step."""
    policy: str
    workload: str
    seed: int
    pool_slots: int
    token_bytes: int
    max_seqs: int
    block_size: int | None = None
    max_len: int = 0
    completions: int = 0
    preemptions: int = 0
    prefill_tokens: int = 0       # tokens prefilled at admission, recomputations included
    recomputed_tokens: int = 0    # of those, tokens prefilled again after a preemption
    steps: int = 0
    tokens_generated: int = 0     # decode tokens, one per running request per step
    allocations: int = 0          # blocks (paged) or ranges (reservations) handed out
    tokens_written: int = 0       # K/V slots written to the pool (0 without a data path)
    verified_tokens: int = 0
    corrupted_tokens: int = 0
    seconds: float = 0.0
    series: dict = field(default_factory=dict)
    stats_at_peak: dict | None = None

    def mean_share(self, key: str, busy: bool = True) -> float:
        """Time-averaged share of the pool in category ``key``. With ``busy``, only
        over the steps when a request was waiting: while nobody waits, free memory
        wastes nothing."""
        x = self.series[key]
        if busy:
            x = x[self.series["waiting"] > 0]
        return float(np.mean(x)) / self.pool_slots if len(x) else 0.0

    def breakdown(self, busy: bool = True) -> dict:
        """Time-averaged shares of the pool (they sum to 1); see :meth:`mean_share`."""
        keys = ("tokens", "reserved", "internal", "external", "free")
        return {k: self.mean_share(k, busy) for k in keys}

    @property
    def peak_running(self) -> int:
        return int(self.series["running"].max())

    @property
    def peak_used(self) -> int:
        """Most token slots held at once (blocks in use x block size, or ranges)."""
        return int(self.series["held"].max())

    @property
    def tokens_computed(self) -> int:
        """Every token computed: prefills (recomputations included) and decodes."""
        return self.prefill_tokens + self.tokens_generated


class Observers(Observer):
    """Several observers told the same things, in order."""

    def __init__(self, observers):
        self.all = list(observers)

    def admitted(self, *args):
        for o in self.all:
            o.admitted(*args)

    def preempted(self, *args):
        for o in self.all:
            o.preempted(*args)

    def stepped(self, *args):
        for o in self.all:
            o.stepped(*args)

    def left(self, *args):
        for o in self.all:
            o.left(*args)

    def finished(self, run):
        for o in self.all:
            o.finished(run)


class Recorder(Observer):
    """Counts what happens, and records the memory categories after every step."""

    def __init__(self, workload, policy, max_seqs: int):
        self.policy = policy
        self.run = Run(policy.name, workload.name, workload.seed, policy.pool_slots,
                       policy.token_bytes, max_seqs, block_size=policy.block_size,
                       max_len=workload.max_len)
        self.columns = {k: array("q") for k in SERIES}
        self.preempted_rids: set = set()
        self.t0 = time.perf_counter()

    def admitted(self, step, req, length):
        self.run.prefill_tokens += length
        if req.rid in self.preempted_rids:       # back from a preemption: computed again
            self.preempted_rids.remove(req.rid)
            self.run.recomputed_tokens += length

    def preempted(self, step, rid, length):
        self.run.preemptions += 1
        self.preempted_rids.add(rid)

    def left(self, step, rid):
        self.run.completions += 1

    def stepped(self, step, batch, queue, refused):
        p = self.policy
        held = p.held(batch.ids, batch.lens)
        will_use = np.minimum(held, batch.finals)
        tokens, held_sum = int(batch.lens.sum()), int(held.sum())
        used_sum = int(will_use.sum())
        external = p.free_slots() if refused is not None and p.fragmented(*refused) else 0
        done = self.run.completions + int((batch.lens >= batch.finals).sum())
        row = (step, len(batch), tokens, used_sum - tokens, held_sum - used_sum, external,
               p.pool_slots - held_sum - external, held_sum, len(queue.waiting), done)
        for key, value in zip(SERIES, row):
            self.columns[key].append(value)
        self.run.tokens_generated += len(batch)
        self.run.steps = step

    def finished(self, run):
        run.seconds = time.perf_counter() - self.t0
        run.allocations = self.policy.allocations
        run.tokens_written, run.verified_tokens, run.corrupted_tokens = \
            self.policy.data_counts()
        run.series.update({k: np.frombuffer(c, dtype=np.int64) if len(c) else
                           np.zeros(0, np.int64) for k, c in self.columns.items()})


class ManagerProbe(Observer):
    """Watches a paged run's manager: ``audit()`` every ``audit_every`` steps and at
    the end; ``stats()`` every ``stats_every`` steps and at every new peak of blocks
    in use (each call costs time proportional to the pool), its counts of used blocks
    and stored tokens checked against the simulation's own. At the end it adds to the
    run ``stats_at_peak`` and the series ``stats_step``, ``internal_fragmentation``
    and ``external_fragmentation``."""

    def __init__(self, manager, *, audit_every: int = 0, stats_every: int = 0):
        self.manager = manager
        self.audit_every, self.stats_every = audit_every, stats_every
        self.samples, self.peak, self.at_peak = [], -1, None

    def stepped(self, step, batch, queue, refused):
        if self.audit_every and step % self.audit_every == 0:
            self.manager.audit()
        if not self.stats_every:
            return
        bs = self.manager.block_size
        held = int(cdiv(batch.lens, bs).sum()) * bs
        if held <= self.peak and step % self.stats_every:
            return
        s = self.manager.stats()
        if s.used_blocks * bs != held or s.stored_tokens != int(batch.lens.sum()):
            raise AuditError(f"step {step}: the manager holds {s.used_blocks} blocks and "
                             f"{s.stored_tokens} tokens; the simulation counts "
                             f"{held // bs} and {int(batch.lens.sum())}")
        self.samples.append((step, s.internal_fragmentation, s.external_fragmentation))
        if held > self.peak:
            self.peak, self.at_peak = held, s.as_dict()

    def finished(self, run):
        self.manager.audit()
        if self.manager.allocator.num_used:
            raise AuditError(f"{self.manager.allocator.num_used} blocks still in use "
                             f"after every request finished")
        run.stats_at_peak = self.at_peak
        a = np.array(self.samples, dtype=np.float64).reshape(-1, 3)
        run.series.update(stats_step=a[:, 0].astype(np.int64),
                          internal_fragmentation=a[:, 1], external_fragmentation=a[:, 2])
