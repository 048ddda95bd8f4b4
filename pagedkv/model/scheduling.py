"""The engine's memory, as the scheduler sees it: admission (now, later or never),
prefill chunks placed in the pool, decode steps, and preemption (recompute or swap).

The decisions themselves — who is admitted, how the step's token budget is shared, whom to
preempt — are :class:`~pagedkv.scheduler.Scheduler`'s, the same scheduler the simulation
runs on. :class:`EngineMemory` answers its questions (the :class:`~pagedkv.scheduler.Memory`
interface) from the engine's manager and, for swapping, a :class:`~pagedkv.swap.Swapper`;
what it places in a step (prefill parts, the decode plan, swap copies) it writes into that
step's :class:`~pagedkv.scheduler.Schedule`, for the engine to execute:

* **Admission** answers for the request at the head of the queue: *now* (the blocks its
  prompt needs, beyond what the prefix cache already holds, are free, with a small
  watermark left for the running requests to grow into), *later* (they are not free yet),
  or *never* (even alone in the pool it could not finish: refused when submitted, with the
  reason).
* **Prefill**: a request's next chunk of tokens is placed (``manager.add`` or
  ``append``), and the parts to compute go into the schedule, for the step's prefill pass.
* **Preemption**: when a step cannot get its blocks, the scheduler takes the most recently
  admitted request. By *recompute*, its K/V is dropped and it waits at the head of the
  queue, to be prefilled again (a prefix-caching manager finds much of it still cached); by
  *swap*, its blocks are copied to the host pool first and it waits in ``swapped`` until
  there is room to copy them back (and falls back to recompute when the host pool is
  full). Either way its sampled tokens, scores and random generator are kept: it continues
  exactly where it stopped.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..checks import cdiv, positive_int
from ..errors import AuditError, ConfigError, OutOfBlocks
from ..scheduler import Memory, Schedule
from ..swap import HostPool, Swapper
from .requests import Sequence

__all__ = ["Counts", "EngineMemory", "prefill_prompt"]


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


class EngineMemory(Memory):
    """The engine's answers to the scheduler, from ``manager`` (the pool's): a watermark
    (a share of the pool admission keeps free), the preemption (``"recompute"``, or
    ``"swap"`` into a host pool of ``host_blocks`` blocks), at most ``max_seqs``
    sequences running. It makes the sequences (their ids and the requests' from one
    counter) and counts what the engine prefilled and preempted (``counts``).
    ``running`` is the scheduler's list of running requests (set by who makes both)."""

    def __init__(self, manager, *, max_seqs: int, watermark: float = 0.01,
                 preemption: str = "recompute", host_blocks: int = 0):
        if isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), "
                              f"got {watermark!r}")
        self.manager, self.block_size = manager, manager.block_size
        self.max_seqs = positive_int(max_seqs, "max_seqs")
        alloc = manager.allocator
        self.watermark_blocks = int(watermark * alloc.num_blocks)
        self.swapper = None
        if preemption == "swap":
            host = HostPool(positive_int(host_blocks, "host_blocks (the swap space)"),
                            alloc.block_bytes)
            self.swapper = Swapper(manager, host)
        elif preemption != "recompute":
            raise ConfigError(f"preemption must be 'recompute' or 'swap', "
                              f"got {preemption!r}")
        self.running: list = []
        self.counts = Counts()
        self.ids = itertools.count()
        self.schedule = Schedule()     # the step being placed (Memory.begin)

    def begin(self, schedule: Schedule) -> None:
        self.schedule = schedule

    def new_seq(self, tokens, prompt_len, score=0.0, parent=None) -> Sequence:
        return Sequence(next(self.ids), list(tokens), prompt_len, score, parent)

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

    # ------------------------------------------------------------------ the Memory interface
    def width(self, req) -> int:
        """Sequences the request decodes a step: all it will fork into, until its first
        tokens are chosen."""
        return len(req.live) if req.prefilled else req.params.width

    def to_prefill(self, req) -> int:
        """Tokens the request must still compute before it decodes (cache hits excluded)."""
        if req.prefilled:
            return 0
        if not req.live:                           # new: its prompt
            return len(req.prompt) - self.manager.cached_prefix(req.hashed)
        m, total = self.manager, 0
        for s in req.live:
            target = _cached_target(s)
            if s.seq_id in m:
                total += target - m.num_tokens(s.seq_id)
            else:
                total += target - m.cached_prefix(prefill_prompt(m, s).head(target))
        return total

    def owed(self, req) -> int:
        """Free blocks the rest of the request's prefill will take."""
        if req.prefilled:
            return 0
        m, bs = self.manager, self.block_size
        return sum(cdiv(_cached_target(s), bs) - cdiv(m.num_tokens(s.seq_id), bs)
                   for s in req.live if s.seq_id in m)

    def admit(self, req, n: int, promised: int) -> bool:
        """Place a waiting request and its first ``n`` prefill tokens, if admission says
        "now"."""
        if self.admission(req, promised)[0] != "now":
            return False
        if not req.live:                           # new (not back from a preemption)
            req.live.append(self.new_seq(req.prompt, len(req.prompt)))
            req.live[0].prefill = req.hashed
        return self.prefill(req, n)

    def prefill(self, req, n: int) -> bool:
        """Place the request's next ``n`` prefill tokens, its sequences in order; False,
        placing nothing, if their blocks are not free. The parts wait in the schedule's
        ``parts`` for the step's prefill pass. Sequences new to the pool (a request back
        from a recompute has several) are added together, every cached block they find
        taken before any fresh one: a fresh block for one must not evict a block another
        finds, or that one would have more to compute than was counted."""
        m, grows, adds, need = self.manager, [], [], 0
        for seq in req.live:
            target = _cached_target(seq)
            if seq.seq_id in m:
                start = m.num_tokens(seq.seq_id)
                k = min(target - start, n)
                if k:
                    grows.append((seq, start, k))
                    need += m.blocks_needed(seq.seq_id, k)
            else:
                prompt = prefill_prompt(m, seq).head(target)
                start = m.cached_prefix(prompt)
                k = min(target - start, n)
                if k:
                    adds.append((seq, start, k, prompt.head(start + k)))
            n -= k
        if adds:
            need += m.blocks_to_add(*(a[3] for a in adds))
        if need > m.allocator.num_free:
            return False
        plans = m.add_all([(seq.seq_id, p) for seq, _, _, p in adds]) if adds else []
        for (seq, start, k, _), plan in zip(adds, plans):
            if plan.cached_tokens != start:
                raise AuditError(f"sequence {seq.seq_id} found {plan.cached_tokens} "
                                 f"cached tokens where {start} were counted")
            seq.prefill = None
            self._count(seq, start, k, found=start)
            self.schedule.parts.append((req, _part(seq, start, k, plan)))
        for seq, start, k in grows:
            plan = m.append(seq.seq_id, seq.tokens[start:start + k])
            self._count(seq, start, k)
            self.schedule.parts.append((req, _part(seq, start, k, plan)))
        if req.live[0].generated and not self.to_prefill(req):
            req.prefilled = True                   # back from a recompute: it decodes
        return True

    def grow(self, reqs) -> bool:
        """One more token for every sequence of ``reqs``: the schedule's plan, or False.
        (A request done at its first token has no sequence; one whose first token the
        step's single pass will choose, none yet.)"""
        seqs = [s for r in reqs if r.prefilled for s in r.live]
        if not seqs:
            return True
        try:
            plan = self.manager.step([s.seq_id for s in seqs], [s.tokens[-1] for s in seqs])
        except OutOfBlocks:
            return False
        self.schedule.plan, self.schedule.seqs = plan, seqs
        return True

    def preempt(self, req) -> bool:
        """``req`` gives its blocks back, by swap when there is a swapper with room, else
        by recompute. True if it was swapped out (its copies wait in the schedule)."""
        if any(r is req for r, _ in self.schedule.parts):
            raise AuditError("a request is preempted after its prefill was planned")
        self.counts.preemptions += 1
        ids = [s.seq_id for s in req.live if s.seq_id in self.manager]
        if self.swapper is not None and len(ids) == len(req.live):
            try:
                pairs = self.swapper.swap_out(ids)
            except OutOfBlocks:                    # the host pool is full: recompute
                pass
            else:
                self.schedule.swap_outs.append(pairs)
                self.counts.swapped_out += len(pairs)
                return True
        for seq_id in ids:
            self.manager.free(seq_id)
        req.prefilled = False
        return False

    def swap_in(self, req, promised: int) -> bool:
        """Bring a swapped-out request back if its blocks (and the watermark) are free."""
        ids = [s.seq_id for s in req.live]
        need = self.swapper.blocks_to_swap_in(ids) + self.watermark_blocks
        if need > self.manager.allocator.num_free - promised:
            return False
        # (the tokens whose K/V were swapped out: all but a decoding sequence's pending one)
        held = [self.swapper.swapped[i].num_tokens for i in ids]
        pairs = self.swapper.swap_in(ids, [s.tokens[:n] for s, n in zip(req.live, held)])
        self.schedule.swap_ins.append(pairs)
        self.counts.swapped_in += len(pairs)
        return True

    # ------------------------------------------------------------------ counting
    def _count(self, seq, start: int, n: int, found: int = 0) -> None:
        """Count ``n`` prefill tokens computed from ``start`` on, after ``found`` found in
        the prefix cache (a sequence that has generated is computed again)."""
        c = self.counts
        c.prompt_tokens += found + n
        c.computed_tokens += n
        if seq.generated:
            c.refound_tokens += found
            c.recomputed_tokens += n


def _part(seq, start: int, n: int, plan):
    """One prefill part, as the pass takes it: (sequence, its tokens to compute, their
    positions, the manager's plan for their slots)."""
    return seq, seq.tokens[start:start + n], range(start, start + n), plan


def _cached_target(seq) -> int:
    """How many of the sequence's tokens must have their K/V in the cache before it decodes:
    all of a new prompt, all but the pending last token of a sequence that has generated."""
    return len(seq.tokens) - (1 if seq.generated else 0)
