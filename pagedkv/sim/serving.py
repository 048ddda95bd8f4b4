"""The serving loop: continuous batching over one pool, first come, first served.

:func:`serve` is the whole loop. The decisions are the :class:`~pagedkv.scheduler.Scheduler`'s,
the one the model engine uses too: who is admitted, how the step's token budget is shared,
who is preempted. The simulation is that scheduler with a *runner that moves no bytes*:
a step only adds tokens to the running requests' lengths (:class:`Running`), and the memory
the scheduler asks about is a :class:`~pagedkv.sim.policies.Policy`, seen through
:class:`PolicyMemory`. Nothing is measured here: observers
(:class:`~pagedkv.sim.measure.Observer`) are told what happens at four points: a request is
admitted, a request is preempted, a step is done, a request leaves.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..checks import positive_int
from ..errors import ConfigError
from ..scheduler import Memory, Scheduler
from .measure import Observers, Recorder

__all__ = ["Queue", "Running", "PolicyMemory", "serve", "newest", "TOKEN_BUDGET"]

#: Tokens one step may compute, prefills and decodes together: the default of vLLM's
#: ``max_num_batched_tokens`` (``SchedulerConfig`` in ``vllm/config/scheduler.py``).
TOKEN_BUDGET = 2048


class Queue:
    """Requests that have not arrived yet, in arrival order; when their step comes they
    join the scheduler's ``waiting`` (whose length the observers read as ``waiting``)."""

    def __init__(self, requests, waiting=None):
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
        self.waiting = deque() if waiting is None else waiting

    def __bool__(self) -> bool:
        return bool(self.pending or self.waiting)

    def arrive(self, step: int) -> list:
        """Requests whose arrival step has come, moved to ``waiting``; returns them."""
        came = []
        while self.pending and self.pending[0].arrival <= step:
            came.append(self.pending.popleft())
            self.waiting.append(came[-1])
        return came

    def next_arrival(self, step: int) -> int:
        if not self.pending:        # Policy.check prevents it
            raise ConfigError("a waiting request can never be admitted")
        return max(step + 1, self.pending[0].arrival)


class Running:
    """The running requests, in admission order, with their lengths (tokens placed) and
    final lengths."""

    def __init__(self):
        self.reqs: list = []
        self.lens = np.zeros(0, dtype=np.int64)
        self.finals = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def ids(self) -> list:
        return [r.rid for r in self.reqs]

    def add(self, req, length: int) -> None:
        self.reqs.append(req)
        self.lens = np.append(self.lens, length)
        self.finals = np.append(self.finals, req.total)

    def index(self, req) -> int:
        return next(i for i in range(len(self.reqs) - 1, -1, -1) if self.reqs[i] is req)

    def remove(self, req) -> int:
        """Take ``req`` out; return the tokens it had."""
        i = self.index(req)
        length = int(self.lens[i])
        del self.reqs[i]
        self.lens, self.finals = np.delete(self.lens, i), np.delete(self.finals, i)
        return length

    def finished(self) -> list:
        """The requests that reached their final length."""
        done = self.lens >= self.finals
        return [r for r, d in zip(self.reqs, done.tolist()) if d] if done.any() else []


def newest(batch: Running) -> int:
    """Whom preemption takes first: the request admitted last (its index in ``batch``)."""
    return len(batch) - 1


class PolicyMemory(Memory):
    """The scheduler's questions answered by a memory policy, the runner's lengths kept
    in a :class:`Running`. A request waits with the tokens it starts with (its prompt, or
    all it had when it was preempted); it must prefill what the policy says (all of them,
    none after a swap). ``target`` holds, for a request whose prefill is not finished,
    the length it decodes from."""

    def __init__(self, policy, watch, batch: Running):
        self.policy, self.watch, self.batch = policy, watch, batch
        self.starts: dict = {}        # waiting request -> the tokens it starts with
        self.target: dict = {}        # running, prefill unfinished -> its full length
        self.step = 0

    def sequences(self, reqs) -> int:
        return len(reqs)

    def to_prefill(self, req) -> int:
        if req.rid in self.starts:
            return self.policy.prefill(req, self.starts[req.rid])
        if req.rid in self.target:
            return self.target[req.rid] - int(self.batch.lens[self.batch.index(req)])
        return 0

    def owed(self, req) -> int:
        if req.rid not in self.target:
            return 0
        return self.policy.owed(req, int(self.batch.lens[self.batch.index(req)]),
                                self.target[req.rid])

    def admit(self, req, n: int, promised: int):
        length = self.starts[req.rid]
        prefill = self.policy.prefill(req, length)
        first = length - prefill + n          # tokens placed now (a swap places them all)
        if not self.policy.admit(req, length, first=first, promised=promised):
            return None
        del self.starts[req.rid]
        self.batch.add(req, first)
        if first < length:
            self.target[req.rid] = length
        self.watch.admitted(self.step, req, prefill)
        return ()                     # placed: nothing a runner needs

    def prefill(self, req, n: int):
        if not self.policy.extend(req.rid, n):
            return None
        i = self.batch.index(req)
        self.batch.lens[i] += n
        if self.batch.lens[i] == self.target[req.rid]:
            del self.target[req.rid]
        return ()

    def grow(self, reqs):
        if not self.policy.step([r.rid for r in reqs]):
            return None
        if len(reqs) == len(self.batch):
            self.batch.lens += 1
        else:
            for r in reqs:
                self.batch.lens[self.batch.index(r)] += 1
        return True

    def preempt(self, req, placed: bool) -> tuple:
        length = self.batch.remove(req)
        self.target.pop(req.rid, None)
        self.policy.preempt(req.rid)
        self.starts[req.rid] = length
        self.watch.preempted(self.step, req.rid, length)
        return False, None            # it waits to be admitted again (a swap included)


def serve(workload, policy, *, max_seqs: int = 256, token_budget: int = TOKEN_BUDGET,
          chunked_prefill: bool = False, observers=(), preempt=newest,
          scheduler=Scheduler):
    """Serve every request of ``workload`` with ``policy``, at most ``max_seqs`` at once
    and ``token_budget`` tokens computed a step (``chunked_prefill``: a prompt may be
    prefilled over several steps); ``preempt(batch)`` names the running request that
    gives its memory back when a step runs out of it. ``scheduler`` is the class that
    decides (:class:`~pagedkv.scheduler.Scheduler` or a subclass of it, built with the
    same arguments). Returns the :class:`Run` measured."""
    max_seqs = positive_int(max_seqs, "max_seqs")
    token_budget = positive_int(token_budget, "token_budget")
    if workload.longest > token_budget and not chunked_prefill:
        raise ConfigError(f"token_budget={token_budget} cannot prefill the longest "
                          f"request ({workload.longest} tokens) after a preemption")
    policy.check(workload)                  # a request that can never fit is refused now
    recorder = Recorder(workload, policy, max_seqs)
    watch = Observers([recorder, *observers])
    batch = Running()
    memory = PolicyMemory(policy, watch, batch)
    if not (isinstance(scheduler, type) and issubclass(scheduler, Scheduler)):
        raise ConfigError(f"scheduler must be Scheduler or a subclass of it, got "
                          f"{scheduler!r}")
    sched = scheduler(memory, max_seqs=max_seqs, token_budget=token_budget,
                      chunked_prefill=chunked_prefill,
                      victim=lambda running: batch.reqs[preempt(batch)])
    queue = Queue(workload.requests, sched.waiting)
    step = 0
    while queue or sched:
        for req in queue.arrive(step):
            memory.starts[req.rid] = req.prompt
        memory.step = step
        sched.schedule()
        if not sched.running:               # nothing ran: jump to the next arrival
            step = queue.next_arrival(step)
            continue
        step += 1
        refused = None if sched.refused is None else (
            sched.refused, memory.starts[sched.refused.rid])
        watch.stepped(step, batch, queue, refused)
        for req in batch.finished():
            sched.finish(req)
            batch.remove(req)
            policy.release(req.rid)
            watch.left(step, req.rid)
    watch.finished(recorder.run)
    return recorder.run
