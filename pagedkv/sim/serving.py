"""The serving loop: continuous batching over one pool, first come, first served.

:func:`serve` is the whole algorithm. It keeps requests in two places, a :class:`Queue`
(not yet arrived, and waiting) and :class:`Running` (the running requests), and asks a
:class:`~pagedkv.sim.policies.Policy` where their memory goes. It measures nothing
itself: observers (:class:`~pagedkv.sim.measure.Observer`) are told what happens at four
points: a request is admitted, a request is preempted, a step is done, a request leaves.
"""
from __future__ import annotations

from collections import deque

import numpy as np

from ..checks import positive_int
from ..errors import ConfigError
from .measure import Observers, Recorder

__all__ = ["Queue", "Running", "serve", "admit", "recompute", "TOKEN_BUDGET"]

#: Tokens one step may compute, prefills and decodes together: the default of vLLM's
#: ``max_num_batched_tokens`` (``SchedulerConfig`` in ``vllm/config/scheduler.py``).
TOKEN_BUDGET = 2048


class Queue:
    """Requests that do not run: those yet to arrive, in arrival order, and those
    waiting, first come, first served, each with the tokens it starts with. A
    preempted request goes back to the head, with all its tokens so far."""

    def __init__(self, requests):
        self.pending = deque(sorted(requests, key=lambda r: (r.arrival, r.rid)))
        self.waiting = deque()                       # (request, tokens it starts with)

    def __bool__(self) -> bool:
        return bool(self.pending or self.waiting)

    def arrive(self, step: int) -> None:
        while self.pending and self.pending[0].arrival <= step:
            req = self.pending.popleft()
            self.waiting.append((req, req.prompt))

    def next_arrival(self, step: int) -> int:
        if not self.pending:        # Policy.check prevents it
            raise ConfigError("a waiting request can never be admitted")
        return max(step + 1, self.pending[0].arrival)


class Running:
    """The running requests, in admission order, with their lengths and final lengths."""

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

    def pop_newest(self):
        """Take out the most recently admitted request: (request, its tokens)."""
        req, length = self.reqs.pop(), int(self.lens[-1])
        self.lens, self.finals = self.lens[:-1], self.finals[:-1]
        return req, length

    def remove_finished(self) -> list:
        """Take out the requests that reached their final length; return them."""
        done = self.lens >= self.finals
        if not done.any():
            return []
        flags = done.tolist()
        gone = [r for r, d in zip(self.reqs, flags) if d]
        self.reqs = [r for r, d in zip(self.reqs, flags) if not d]
        self.lens, self.finals = self.lens[~done], self.finals[~done]
        return gone


def admit(queue, batch, policy, max_seqs: int, budget: int, watch, step: int):
    """Admit waiting requests, head first, while fewer than ``max_seqs`` run, the step's
    token ``budget`` holds their prefill and next token (after the next token of every
    running request), and the policy places them. Returns the refused head as
    (request, tokens), or None."""
    budget -= len(batch)
    while queue.waiting and len(batch) < max_seqs:
        req, length = queue.waiting[0]
        prefill = policy.prefill(req, length)   # all its tokens, or none after a swap
        if prefill + 1 > budget or not policy.admit(req, length):
            return req, length
        queue.waiting.popleft()
        batch.add(req, length)
        budget -= prefill + 1
        watch.admitted(step, req, prefill)
    return None


def recompute(queue, batch, policy, watch, step: int) -> None:
    """Preemption by recomputation: the newest request gives its memory back and
    returns to the head of the queue; admitted again, it prefills all its tokens so
    far again."""
    req, length = batch.pop_newest()
    policy.release(req.rid)
    queue.waiting.appendleft((req, length))
    watch.preempted(step, req.rid, length)


def serve(workload, policy, *, max_seqs: int = 256, token_budget: int = TOKEN_BUDGET,
          observers=(), preempt=recompute):
    """Serve every request of ``workload`` with ``policy``, at most ``max_seqs`` at once
    and ``token_budget`` tokens computed a step, ``preempt`` making room when a step runs
    out of memory; return the :class:`Run` measured."""
    max_seqs = positive_int(max_seqs, "max_seqs")
    token_budget = positive_int(token_budget, "token_budget")
    if workload.longest > token_budget:     # a late preemption prefills almost all of it
        raise ConfigError(f"token_budget={token_budget} cannot prefill the longest "
                          f"request ({workload.longest} tokens) after a preemption")
    policy.check(workload)                  # a request that can never fit is refused now
    recorder = Recorder(workload, policy, max_seqs)
    watch = Observers([recorder, *observers])
    queue, batch, step = Queue(workload.requests), Running(), 0
    while queue or batch:
        queue.arrive(step)
        refused = admit(queue, batch, policy, max_seqs, token_budget, watch, step)
        if not batch:                       # nothing runs: jump to the next arrival
            step = queue.next_arrival(step)
            continue
        while not policy.step(batch.ids):   # out of memory: preempt, then try again
            preempt(queue, batch, policy, watch, step)
        batch.lens += 1
        step += 1
        watch.stepped(step, batch, queue, refused)
        for req in batch.remove_finished():
            policy.release(req.rid)
            watch.left(step, req.rid)
    watch.finished(recorder.run)
    return recorder.run
