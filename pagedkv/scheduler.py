"""The scheduler: each step, who runs and how many tokens each computes.

One scheduler serves both the simulation (:func:`pagedkv.sim.serve`) and the model engine
(:class:`pagedkv.model.engine.Engine`). It decides and touches no K/V. It keeps three
queues of requests, each in order:

* ``waiting`` — not admitted yet, first come, first served (a request preempted by
  recompute goes back to the head);
* ``running`` — admitted, in admission order (the newest last);
* ``swapped`` — preempted by swapping, the oldest preemption first.

and asks a *memory* (the :class:`Memory` interface below) whether and where their tokens
fit. A step has two phases, because the tokens a prefill chooses are needed before the
step's decode:

1. :meth:`Scheduler.prefill` — swap requests back in, then hand out the step's **token
   budget**: first one token for every sequence of every running request that decodes;
   then prefill chunks, to the running requests whose prompt is only partly in the cache
   (in admission order), then to waiting requests, head first, while admission says they
   fit. A request whose prefill completes also decodes in this step, so its chunk is
   charged that token too. With ``chunked_prefill=False`` a waiting request is admitted
   only when all of its prefill fits in what is left (the whole prompt in one step);
   with ``token_budget=None`` there is no budget at all.
2. :meth:`Scheduler.decode` — one more token for every sequence of every running request
   whose prompt is in the cache, all or nothing: while the memory runs out, the newest
   running request is preempted (by swap or by recompute, as the memory chooses) and the
   step is tried again.

Tokens found in the prefix cache are not computed, so they are not charged: the memory's
``to_prefill`` counts only what a request still has to compute.

What a step decided is one :class:`Schedule`: the scheduler writes who runs (the chunks,
the decoding requests, the preempted), and the memory, told of it by
:meth:`Memory.begin`, writes where (its plans, its swap copies). A caller executes the
schedule and applies the result; nothing of the step is left anywhere else.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from .checks import positive_int
from .errors import AuditError, ConfigError

__all__ = ["Memory", "Scheduler", "Schedule", "Chunk", "newest"]


class Memory:
    """What the scheduler asks of the memory it schedules for (the simulation's policies
    and the engine each implement it). ``promised`` counts free blocks already promised
    to running requests whose prefill is not finished.

    * ``width(req)``: sequences the request runs at once (its decode tokens a step);
      ``sequences(reqs)`` their sum.
    * ``to_prefill(req)``: tokens it must still compute before it decodes (0: it decodes).
    * ``owed(req)``: free blocks its unfinished prefill will still take.
    * ``admit(req, n, promised)``: place a waiting request and its first ``n`` prefill
      tokens if all of it fits now (its whole prefill, a watermark kept); True if it did.
    * ``prefill(req, n)``: place the next ``n`` prefill tokens of a running request;
      False, changing nothing, if the blocks are not free.
    * ``grow(reqs)``: one more token for every sequence of ``reqs``, all or nothing;
      False if the blocks are not free.
    * ``preempt(req)``: give its memory back; True if it was swapped out (it waits to be
      swapped in), False if it must be prefilled again (it waits to be admitted).
    * ``swap_in(req, promised)``: bring a swapped-out request back if it fits; True if
      it did.
    * ``begin(schedule)``: a step starts; what the memory places until the next call is
      that :class:`Schedule`'s (a memory that moves no bytes ignores it).
    """

    def begin(self, schedule) -> None:
        pass

    def width(self, req) -> int:
        return 1

    def sequences(self, reqs) -> int:
        """Sequences ``reqs`` run in all."""
        return sum(map(self.width, reqs))

    def to_prefill(self, req) -> int:
        raise NotImplementedError

    def owed(self, req) -> int:
        return 0

    def admit(self, req, n: int, promised: int) -> bool:
        raise NotImplementedError

    def prefill(self, req, n: int) -> bool:
        raise NotImplementedError

    def grow(self, reqs) -> bool:
        raise NotImplementedError

    def preempt(self, req) -> bool:
        raise NotImplementedError

    def swap_in(self, req, promised: int) -> bool:
        raise ConfigError("this memory does not swap")


class Chunk(NamedTuple):
    """Prefill work of one step: ``tokens`` of ``req``'s prefill, and whether they
    finish it (then the request decodes in this step too)."""
    req: object
    tokens: int
    last: bool


@dataclass(eq=False)
class Schedule:
    """One step, as decided: the scheduler's part (who runs) and the memory's (where).

    * ``chunks``: the prefill work (:class:`Chunk`), in order; ``parts``: the memory's
      placement of it (the engine's: ``(request, part)`` pairs, one per sequence);
    * ``decodes``: the requests that decode, in admission order; ``plan`` and ``seqs``:
      the memory's plan for their sequences' next token (None and [] when none);
    * ``swap_ins`` and ``swap_outs``: the memory's block copies, each a list of ``[n, 2]``
      arrays of (from, to) pairs, host to device and device to host;
    * ``preempted``: requests preempted in this step, in order; ``finished``: the
      requests the step completed (the caller's to fill, after it ran).

    The engine takes ``parts`` and the swap copies out as it executes them (a part, or a
    copy, runs once); the rest stays as the record of the step.
    """
    chunks: list = field(default_factory=list)
    parts: list = field(default_factory=list)
    decodes: list = field(default_factory=list)
    plan: object = None
    seqs: list = field(default_factory=list)
    swap_ins: list = field(default_factory=list)
    swap_outs: list = field(default_factory=list)
    preempted: list = field(default_factory=list)
    finished: list = field(default_factory=list)


def newest(running: list):
    """The request preemption takes first: the one admitted last."""
    return running[-1]


class Scheduler:
    """Admission, the token budget and preemption over a :class:`Memory` (see the module's
    text). At most ``max_seqs`` sequences run at once; ``victim(running)`` names the
    request to preempt (:func:`newest` by default).

    Beside the three queues it keeps ``prefilling``: the running requests whose prefill
    is not finished, in admission order (the others decode)."""

    def __init__(self, memory: Memory, *, max_seqs: int = 256,
                 token_budget: int | None = None, chunked_prefill: bool = True,
                 victim=newest):
        self.memory, self.victim = memory, victim
        self.max_seqs = positive_int(max_seqs, "max_seqs")
        if token_budget is not None:
            token_budget = positive_int(token_budget, "token_budget")
        self.token_budget = token_budget
        self.chunked_prefill = bool(chunked_prefill)
        self.waiting: deque = deque()
        self.running: list = []
        self.swapped: deque = deque()
        self.prefilling: dict = {}  # running, prefill unfinished (a dict: ordered, O(1))
        self.refused = None         # the waiting head admission refused this step, or None
        self.schedule = Schedule()  # the step being scheduled (the last one)

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def decoding(self) -> list:
        """The running requests that decode, in admission order."""
        if not self.prefilling:
            return list(self.running)
        return [r for r in self.running if r not in self.prefilling]

    # ------------------------------------------------------------------ phase 1
    def prefill(self) -> Schedule:
        """Phase 1 of a step: swap in, then share the token budget out (decodes first,
        then chunks to running and to waiting requests). Returns the step's
        :class:`Schedule`, its prefill work in ``chunks``, its memory already placed."""
        self.refused, self.schedule = None, Schedule()
        mem = self.memory
        mem.begin(self.schedule)
        budget = float("inf") if self.token_budget is None else self.token_budget
        budget -= mem.sequences(self.decoding())
        budget = self._swap_in(budget)
        chunks = []
        for req in list(self.prefilling):          # prefills already under way
            if budget <= 0 or req not in self.prefilling:
                continue
            chunk = self._chunk(req, mem.to_prefill(req), budget)
            if chunk.tokens and self._place(req, chunk.tokens):
                chunks.append(chunk)
                budget -= chunk.tokens + (mem.width(req) if chunk.last else 0)
                if chunk.last:
                    del self.prefilling[req]
        if not self.swapped:                       # a swapped request comes back first
            self._admit(budget, chunks)
        self.schedule.chunks = chunks
        return self.schedule

    def _chunk(self, req, left: int, budget) -> Chunk:
        """As much of ``req``'s prefill as the budget holds; it finishes only if its
        decode tokens fit too."""
        if left + self.memory.width(req) <= budget:
            return Chunk(req, left, True)
        return Chunk(req, int(min(left - 1, budget)), False)

    def _admit(self, budget, chunks: list) -> None:
        """Admit waiting requests, head first, while they fit; append their chunks."""
        mem = self.memory
        promised = sum(mem.owed(r) for r in self.prefilling)
        live = mem.sequences(self.running)
        while self.waiting:
            req = self.waiting[0]
            width = mem.width(req)
            if live + width > self.max_seqs:
                break
            chunk = self._chunk(req, mem.to_prefill(req), budget)
            if not chunk.last and not (self.chunked_prefill and chunk.tokens):
                self.refused = req                 # its prefill does not fit the budget
                break
            if not mem.admit(req, chunk.tokens, promised):
                self.refused = req                 # its memory is not free
                break
            self.waiting.popleft()
            self.running.append(req)
            if not chunk.last:
                self.prefilling[req] = None
                promised += mem.owed(req)
            chunks.append(chunk)
            live += width
            budget -= chunk.tokens + (width if chunk.last else 0)

    def _place(self, req, n: int) -> bool:
        """Memory for ``n`` more prefill tokens of a running request; preempt while
        there is none (False if ``req`` itself was preempted)."""
        while not self.memory.prefill(req, n):
            victim = self.victim(self.running)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _swap_in(self, budget):
        """Bring swapped requests back, oldest preemption first, while they fit; returns
        the budget left."""
        mem = self.memory
        promised = sum(mem.owed(r) for r in self.prefilling)
        live = mem.sequences(self.running)
        while self.swapped:
            req = self.swapped[0]
            width = mem.width(req)
            if live + width > self.max_seqs or width > budget:
                break
            if not mem.swap_in(req, promised):
                break
            self.swapped.popleft()
            self.running.append(req)
            live += width
            if mem.to_prefill(req):                # swapped out before its prefill ended
                self.prefilling[req] = None
            else:
                budget -= width
        return budget

    # ------------------------------------------------------------------ phase 2
    def decode(self) -> list:
        """Phase 2: one more token for every sequence of every running request that
        decodes, preempting while the memory runs out. Returns those requests (in
        admission order, the schedule's ``decodes`` too), their memory grown."""
        while True:
            reqs = self.decoding()
            if not reqs or self.memory.grow(reqs):
                self.schedule.decodes = reqs
                return reqs
            if len(self.running) == 1:             # admission refuses what cannot fit
                raise AuditError("a request alone cannot take its next step")
            self._preempt(self.victim(self.running))

    def _preempt(self, req) -> None:
        self.running.remove(req)
        self.prefilling.pop(req, None)
        self.schedule.preempted.append(req)
        if self.memory.preempt(req):
            self.swapped.appendleft(req)
        else:
            self.waiting.appendleft(req)

    # ------------------------------------------------------------------ leaving
    def finish(self, req) -> None:
        """A running request is done: it leaves the queues (its memory is the caller's to
        release)."""
        self.running.remove(req)
        self.prefilling.pop(req, None)

    def drop(self, req) -> None:
        """Take ``req`` out of whichever queue holds it (a cancelled request; its memory
        is the caller's to release)."""
        for queue in (self.waiting, self.running, self.swapped):
            if any(r is req for r in queue):
                queue.remove(req)
        self.prefilling.pop(req, None)
