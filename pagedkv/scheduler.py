"""The scheduler: each step, who runs and how many tokens each computes.

One scheduler serves both the simulation (:func:`pagedkv.sim.serve`) and the model engine
(:class:`pagedkv.model.engine.Engine`). It decides and touches no K/V. It keeps three
queues of requests, each in order:

* ``waiting`` — not admitted yet, first come, first served (a request preempted by
  recompute goes back to the head);
* ``running`` — admitted, in admission order (the newest last);
* ``swapped`` — preempted by swapping, the most recent preemption first (it goes back to
  the head, as a recomputed one does to ``waiting``'s: the request that left last comes
  back first).

and asks a *memory* (the :class:`Memory` interface below) whether and where their tokens
fit. :meth:`Scheduler.schedule` makes one step's :class:`Plan`, in two phases (and a third,
where the memory guesses):

1. :meth:`Scheduler.prefill` — swap requests back in, then hand out the step's **token
   budget**: first one token for every sequence of every running request that decodes;
   then prefill chunks, to the running requests whose prompt is only partly in the cache
   (in admission order), then to waiting requests, head first, while admission says they
   fit. A request whose prefill completes also decodes in this step (its first token is
   drawn from the prefill's last row, then decoded), so its chunk is charged that token
   too. With ``chunked_prefill=False`` a waiting request is admitted only when all of its
   prefill fits in what is left (the whole prompt in one step); with ``token_budget=None``
   there is no budget at all.
2. :meth:`Scheduler.decode` — one more token for every sequence of every running request
   whose prompt is in the cache, all or nothing: while the memory runs out, the newest
   running request is preempted (by swap or by recompute, as the memory chooses) and the
   step is tried again. A request preempted in the step that placed its prefill leaves
   the plan: none of its work runs.
3. Guesses (speculative decoding, where the memory makes them: :meth:`Memory.guess`):
   what the budget leaves after the prefill chunks goes to the decode rows as guessed
   tokens to verify in the same pass. A guess is optional: a waiting prompt comes first,
   and no guess preempts anyone.

Tokens found in the prefix cache are not computed, so they are not charged: the memory's
``to_prefill`` counts only what a request still has to compute.

The plan is the scheduler's alone: the memory answers each question with what it placed
(the engine's memory: prefill parts, decode rows, swap copies; the simulation's places
nothing a runner needs), the scheduler collects the answers, and the memory seals them
last (:meth:`Memory.seal`). Nothing of the step is left on either afterwards.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from .checks import positive_int
from .errors import AuditError, ConfigError

__all__ = ["Memory", "Scheduler", "Plan", "Chunk", "newest"]


class Memory:
    """What the scheduler asks of the memory it schedules for (the simulation's policies
    and the engine each implement it). A question that places something answers with what
    it placed (None: it did not fit, and nothing changed). ``promised`` counts
    free blocks already promised to running requests whose prefill is not finished.

    * ``width(req)``: sequences the request runs at once (its decode tokens a step);
      ``sequences(reqs)`` their sum.
    * ``to_prefill(req)``: tokens it must still compute before it decodes (0: it decodes).
    * ``owed(req)``: free blocks its unfinished prefill will still take.
    * ``admit(req, n, promised)``: place a waiting request and its first ``n`` prefill
      tokens if all of it fits now (its whole prefill, a watermark kept): a sequence of
      placements (empty: nothing a runner needs), or None.
    * ``prefill(req, n)``: place the next ``n`` prefill tokens of a running request
      (placements, or None).
    * ``grow(reqs)``: one more token for every sequence of ``reqs``, all or nothing: the
      placement of those tokens (any value but None), or None.
    * ``preempt(req, placed)``: give its memory back; ``(True, what was placed)`` if it
      was swapped out (it waits to be swapped in), ``(False, None)`` if it must be
      prefilled again (it waits to be admitted). Its placements in this step are void;
      ``placed`` says it had some (K/V not computed yet: nothing to swap out).
    * ``swap_in(req, promised)``: bring a swapped-out request back if it fits.
    * ``guess(rows, tokens)``: the step's decode placement with guessed tokens to verify
      (speculative decoding), ``tokens`` rows at most in all (None: no limit); guesses
      are optional: none is made that would preempt anyone. By default: none.
    * ``seal(plan)``: the step is decided; returns the plan the caller runs (the memory
      may add what only the whole step tells, as the engine's draws).
    """

    def width(self, req) -> int:
        return 1

    def sequences(self, reqs) -> int:
        """Sequences ``reqs`` run in all."""
        return sum(map(self.width, reqs))

    def to_prefill(self, req) -> int:
        raise NotImplementedError

    def owed(self, req) -> int:
        return 0

    def admit(self, req, n: int, promised: int):
        raise NotImplementedError

    def prefill(self, req, n: int):
        raise NotImplementedError

    def grow(self, reqs):
        raise NotImplementedError

    def preempt(self, req, placed: bool) -> tuple:
        raise NotImplementedError

    def swap_in(self, req, promised: int):
        raise ConfigError("this memory does not swap")

    def guess(self, rows, tokens):
        return rows

    def seal(self, plan: "Plan") -> "Plan":
        return plan


class Chunk(NamedTuple):
    """Prefill work of one step: ``tokens`` of ``req``'s prefill, and whether they
    finish it (then the request decodes in this step too)."""
    req: object
    tokens: int
    last: bool


@dataclass(frozen=True, eq=False)
class Plan:
    """One step, as decided: who runs (the scheduler's) and where (the memory's answers).

    * ``number``: the step's place in the run (0, 1, ...);
    * ``chunks``: the prefill work (:class:`Chunk`), in order; ``parts``: the memory's
      placements of it, as ``(request, placement)`` pairs;
    * ``decodes``: the requests that decode, in admission order; ``rows``: the memory's
      placement of their sequences' next token (None when nobody decodes);
    * ``swap_ins`` and ``swap_outs``: the memory's block copies, host to device and
      device to host, as ``(request, pairs)``;
    * ``preempted``: requests preempted in this step, in order;
    * ``draws``: what the memory's seal adds (the engine: which tokens the step draws,
      and how), else None.
    """
    number: int
    chunks: tuple = ()
    parts: tuple = ()
    decodes: tuple = ()
    rows: object = None
    swap_ins: tuple = ()
    swap_outs: tuple = ()
    preempted: tuple = ()
    draws: object = None


def newest(running: list):
    """The request preemption takes first: the one admitted last."""
    return running[-1]


class _Step:
    """The plan being written (the scheduler's own, while :meth:`Scheduler.schedule` runs)."""

    def __init__(self):
        self.parts, self.swap_ins, self.swap_outs, self.preempted = [], [], [], []
        self.rows = None

    def drop(self, req) -> None:
        """``req`` was preempted: its prefill placed in this step does not run (a swap-in
        still does: a request swapped out again leaves with what came back)."""
        self.parts = [(r, p) for r, p in self.parts if r is not req]


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
        self.plans = 0              # plans made so far (the next plan's number)
        self._step: _Step | None = None

    def __bool__(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def decoding(self) -> list:
        """The running requests that decode, in admission order."""
        if not self.prefilling:
            return list(self.running)
        return [r for r in self.running if r not in self.prefilling]

    def schedule(self) -> Plan:
        """One step: its prefill work (:meth:`prefill`), then its decodes (:meth:`decode`),
        sealed by the memory into the :class:`Plan` the caller runs."""
        self._step = step = _Step()
        try:
            chunks = self.prefill()
            decodes = self.decode()
            if step.rows is not None:              # guesses: what the budget leaves
                step.rows = self.memory.guess(step.rows, self._left(chunks))
        finally:
            self._step = None
        gone = {id(r) for r in step.preempted}
        plan = Plan(self.plans, chunks=tuple(c for c in chunks if id(c.req) not in gone),
                    parts=tuple(step.parts), decodes=tuple(decodes), rows=step.rows,
                    swap_ins=tuple(step.swap_ins), swap_outs=tuple(step.swap_outs),
                    preempted=tuple(step.preempted))
        self.plans += 1
        return self.memory.seal(plan)

    def _left(self, chunks):
        """Tokens of the budget the step's decode rows may take (None: no budget)."""
        if self.token_budget is None:
            return None
        return self.token_budget - sum(c.tokens for c in chunks)

    # ------------------------------------------------------------------ phase 1
    def prefill(self) -> list:
        """Phase 1 of a step: swap in, then share the token budget out (decodes first,
        then chunks to running and to waiting requests). Returns the step's prefill work,
        :class:`Chunk` s in order, their memory already placed."""
        self.refused, mem = None, self.memory
        if not (self.prefilling or self.waiting or self.swapped):
            return []                              # nothing to share the budget with
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
        return chunks

    def _chunk(self, req, left: int, budget) -> Chunk:
        """As much of ``req``'s prefill as the budget holds; it finishes only if its
        decode tokens fit too."""
        if left + self.memory.width(req) <= budget:
            return Chunk(req, left, True)
        return Chunk(req, int(min(left - 1, budget)), False)

    def _admit(self, budget, chunks: list) -> None:
        """Admit waiting requests, head first, while they fit; append their chunks."""
        if not self.waiting:
            return
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
            placed = mem.admit(req, chunk.tokens, promised)
            if placed is None:
                self.refused = req                 # its memory is not free
                break
            self._placed(req, placed)
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
        while True:
            placed = self.memory.prefill(req, n)
            if placed is not None:
                self._placed(req, placed)
                return True
            victim = self.victim(self.running)
            self._preempt(victim)
            if victim is req:
                return False

    def _placed(self, req, placed) -> None:
        if self._step is not None:
            self._step.parts.extend((req, p) for p in placed)

    def _swap_in(self, budget):
        """Bring swapped requests back, the most recently preempted first, while they fit;
        returns the budget left."""
        if not self.swapped:
            return budget
        mem = self.memory
        promised = sum(mem.owed(r) for r in self.prefilling)
        live = mem.sequences(self.running)
        while self.swapped:
            req = self.swapped[0]
            width = mem.width(req)
            if live + width > self.max_seqs or width > budget:
                break
            pairs = mem.swap_in(req, promised)
            if pairs is None:
                break
            if self._step is not None:
                self._step.swap_ins.append((req, pairs))
            self.swapped.popleft()
            self.running.append(req)
            live += width
            if mem.to_prefill(req):                # swapped out before its prefill ended
                self.prefilling[req] = None
            else:
                budget -= width
        return budget

    # ------------------------------------------------------------------ phase 2
    def decode(self, who=None) -> list:
        """Phase 2: one more token for every sequence of every running request that
        decodes (``who()`` names them; by default :meth:`decoding`), preempting while the
        memory runs out. Returns those requests (in admission order), their memory grown."""
        who = who or self.decoding
        while True:
            reqs = who()
            if not reqs:
                return reqs
            rows = self.memory.grow(reqs)
            if rows is not None:
                if self._step is not None:
                    self._step.rows = rows
                return reqs
            if len(self.running) == 1:             # admission refuses what cannot fit
                raise AuditError("a request alone cannot take its next step")
            self._preempt(self.victim(self.running))

    def _preempt(self, req) -> None:
        self.running.remove(req)
        self.prefilling.pop(req, None)
        step = self._step
        placed = step is not None and any(r is req for r, _ in step.parts)
        swapped, pairs = self.memory.preempt(req, placed)
        if step is not None:
            step.drop(req)
            step.preempted.append(req)
            if swapped:
                step.swap_outs.append((req, pairs))
        if swapped:
            self.swapped.appendleft(req)
        else:
            self.waiting.appendleft(req)

    # ------------------------------------------------------------------ leaving
    def finish(self, req) -> None:
        """A request is done: it leaves whichever queue holds it (its memory is the
        caller's to release; a request may end while preempted, its last token landing
        after it left ``running``)."""
        self.drop(req)

    def drop(self, req) -> None:
        """Take ``req`` out of whichever queue holds it (a cancelled request; its memory
        is the caller's to release)."""
        for queue in (self.waiting, self.running, self.swapped):
            if any(r is req for r in queue):
                queue.remove(req)
        self.prefilling.pop(req, None)
