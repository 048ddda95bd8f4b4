"""The engine's memory, as the scheduler sees it: admission (now, later or never), prefill
chunks placed in the pool, decode steps, preemption (recompute or swap), and the seal that
says which tokens a step draws.

The decisions themselves — who is admitted, how the step's token budget is shared, whom to
preempt — are :class:`~pagedkv.scheduler.Scheduler`'s, the same scheduler the simulation
runs on. :class:`EngineMemory` answers its questions (the :class:`~pagedkv.scheduler.Memory`
interface) from the engine's manager and, for swapping, a :class:`~pagedkv.swap.Swapper`,
and each answer is what it placed, for the scheduler to put in the step's
:class:`~pagedkv.scheduler.Plan`:

* **Admission** answers for the request at the head of the queue: *now* (the blocks its
  prompt needs, beyond what the prefix cache already holds, are free, with a small
  watermark left for the running requests to grow into), *later* (they are not free yet),
  or *never* (even alone in the pool it could not finish: refused when submitted, with the
  reason).
* **Prefill**: a request's next chunk of tokens is placed (``manager.add`` or ``append``):
  a :class:`Part` for each sequence, with its slots and page table. The part that completes
  a new prompt is marked ``first``: the request's first token is drawn from its last row
  (``n`` parallel samples fork the prompt there, each drawing its own).
* **Decode**: one more slot for every sequence (:class:`Rows`), *reserved*
  (:mod:`pagedkv.reserve`): the token whose K/V it holds may still be on its way from the
  step before, and the prefix cache names the block only when its ids are known.
* **Preemption**: when a step cannot get its blocks, the scheduler takes the most recently
  admitted request. By *recompute*, its K/V is dropped and it waits at the head of the
  queue, to be prefilled again (a prefix-caching manager finds much of it still cached); by
  *swap*, its blocks are copied to the host pool first and it waits in ``swapped`` until
  there is room to copy them back (and falls back to recompute when the host pool is
  full). Either way its tokens and its sampler's streams are kept: it continues exactly
  where it stopped.
* **Guesses** (:meth:`EngineMemory.guess`, speculative decoding): what the token budget
  leaves goes to guessed tokens for the decode rows, a row each, their slots reserved
  (``reserve_slots``) and their ids committed only once verified.
* **The seal** (:meth:`EngineMemory.seal`): once the step is decided, which tokens it draws
  (:class:`Draws`: from which row of the step's logits, with which temperature, top-p,
  top-k, seed and counter), and where each decode row's input token comes from: the
  host, or a token drawn by the step before or by this step's prefill, still on the device.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..checks import cdiv, positive_int
from ..errors import AuditError, ConfigError, OutOfBlocks
from ..kernels.sampling import derive_seed
from ..scheduler import Memory, Plan
from ..speculate import Lookup
from ..swap import HostPool, Swapper
from .requests import Sequence

__all__ = ["Counts", "EngineMemory", "Part", "Rows", "Draws", "prefill_prompt"]

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
    drafted: int = 0           # tokens guessed and verified (speculative decoding)
    accepted: int = 0          # of those, the ones the model agreed with

    @property
    def cached_tokens(self) -> int:
        return self.prompt_tokens - self.computed_tokens


class Part(NamedTuple):
    """One sequence's prefill work in a step: ``tokens`` (ids) from position ``start`` on,
    their ``slots``, the copy-on-write ``copies`` to make first, the sequence's page table
    after them (``table``), the tokens found in the prefix cache before them (``found``),
    and whether they complete a new prompt (``first``: its first token is drawn from the
    last row)."""
    seq: Sequence
    tokens: list
    start: int
    slots: np.ndarray
    copies: np.ndarray
    table: np.ndarray
    found: int
    first: bool


class Rows(NamedTuple):
    """A step's decode rows, one per sequence, each computing one token: the manager's
    plan for their slots (``slot_mapping``, ``block_tables``, ``seq_lens``, ``copies``).
    A sequence that guesses (speculative decoding) has a row after its own for each
    guess: ``guess[i]`` is the guessed token row ``i`` takes as input, at the next
    position, its slot reserved (-1: the sequence's own row, its newest token)."""
    seqs: tuple
    reqs: tuple
    slots: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    copies: np.ndarray
    guess: np.ndarray

    def guessed(self) -> dict:
        """Each sequence that guessed, and its guesses in order."""
        out: dict = {}
        for seq, g in zip(self.seqs, self.guess.tolist()):
            if g >= 0:
                out.setdefault(seq, []).append(g)
        return out


class Draws(NamedTuple):
    """The tokens a step draws, in order: first those of the prompts its prefill completes
    (from their parts' last rows), then one per decode row. ``rows[i]`` is draw ``i``'s row
    of the step's logits (the parts' last rows first, then the decode rows); its sequence,
    its request and its sampling settings follow, with ``counters[i]``, the tokens that sequence
    had drawn before (its random stream's position), and ``ban[i]``: no end token yet
    (``min_tokens``). ``beams``: (request, its logits rows) for beam search, whose host
    step ranks the rows' best tokens instead. ``inputs`` and ``follow``: each decode row's input
    token, from the host (``follow`` -1) or the draw ``follow[i]`` of the step before,
    then of this step (numbered on after the last step's draws). ``guess[i]``: the guess
    draw ``i``'s row took as input (-1: none; it is kept only if the draw before it, of
    the same sequence, was kept and drew that very token). ``speculative``: the step
    guessed, or its sequences may guess at the next one: it lands before the next plan,
    since a guess needs the newest token on the host."""
    rows: np.ndarray
    seqs: tuple
    reqs: tuple
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    seeds: np.ndarray
    counters: np.ndarray
    ban: np.ndarray
    beams: tuple
    inputs: np.ndarray
    follow: np.ndarray
    guess: np.ndarray
    speculative: bool

    @property
    def lands_now(self) -> bool:
        """Must the step land before the next is planned? When the host decides the next
        rows: beam search ranks, speculation guesses."""
        return bool(self.beams) or self.speculative

    @property
    def greedy(self) -> bool:
        """Is every draw the row's most likely token, with nothing banned?"""
        return not (self.temperature.any() or self.ban.any())


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
    sequences running, ``stop_ids`` the end tokens (``min_tokens`` bans them). It makes
    the sequences (their ids and the requests' from one counter) and counts what the
    engine prefilled, preempted and guessed (``counts``). ``running`` is the scheduler's
    list of running requests (set by who makes both). ``speculation`` (a
    :class:`~pagedkv.config.Speculation`, or None) lets decode rows guess
    (:meth:`guess`)."""

    def __init__(self, manager, *, max_seqs: int, watermark: float = 0.01,
                 preemption: str = "recompute", host_blocks: int = 0, stop_ids=(),
                 speculation=None):
        if isinstance(watermark, bool) or not 0 <= watermark < 1:
            raise ConfigError(f"watermark must be a share of the pool in [0, 1), "
                              f"got {watermark!r}")
        self.manager, self.block_size = manager, manager.block_size
        self.max_seqs = positive_int(max_seqs, "max_seqs")
        self.stop_ids = tuple(sorted(stop_ids))
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
        self.speculation = speculation     # a config.Speculation, or None: no guesses
        self.running: list = []
        self.counts = Counts()
        self.ids = itertools.count()
        self._drawn: dict = {}         # the last step's draws: sequence id -> its number
        self._ndrawn = 0               # how many the last step drew

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
        if self.sequences(self.running) + width > self.max_seqs:
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
        tokens are chosen; then those whose answers have not reached their length (a
        sequence whose last token is on its way may be at its limit already)."""
        if not req.prefilled:
            return req.params.width
        limit, live = req.params.max_new_tokens, req.live
        if len(live) == 1:
            return int(live[0].planned < limit)
        return sum(s.planned < limit for s in live)

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

    def admit(self, req, n: int, promised: int):
        """Place a waiting request and its first ``n`` prefill tokens, if admission says
        "now": its parts, or None."""
        if self.admission(req, promised)[0] != "now":
            return None
        if not req.live:                           # new (not back from a preemption)
            req.live.append(self.new_seq(req.prompt, len(req.prompt)))
            req.live[0].prefill = req.hashed
        return self.prefill(req, n)

    def prefill(self, req, n: int):
        """Place the request's next ``n`` prefill tokens, its sequences in order: their
        parts, or None, placing nothing, if their blocks are not free. Sequences new to
        the pool (a request back from a recompute has several) are added together, every
        cached block they find taken before any fresh one: a fresh block for one must not
        evict a block another finds, or that one would have more to compute than was
        counted."""
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
            return None
        plans = m.add_all([(seq.seq_id, p) for seq, _, _, p in adds]) if adds else []
        placed = []
        for (seq, start, k, _), plan in zip(adds, plans):
            if plan.cached_tokens != start:
                raise AuditError(f"sequence {seq.seq_id} found {plan.cached_tokens} "
                                 f"cached tokens where {start} were counted")
            seq.prefill = None
            placed.append((seq, start, k, plan, start))
        for seq, start, k in grows:
            placed.append((seq, start, k, m.append(seq.seq_id, seq.tokens[start:start + k]),
                           0))
        return self._parts(req, placed)

    def _parts(self, req, placed) -> list:
        """The :class:`Part` s of what :meth:`prefill` placed; a request whose K/V are now
        all placed decodes, and a new prompt so completed forks for its ``n`` samples."""
        m = self.manager
        first = not req.live[0].planned and \
            m.num_tokens(req.live[0].seq_id) == len(req.live[0].tokens)
        if first:                                  # (a beam's first step is the host's)
            req.prefilled = req.params.beam_width == 1
        elif req.live[0].generated and not self.to_prefill(req):
            req.prefilled = True                   # back from a recompute: it decodes
        parts = [Part(seq, seq.tokens[start:start + k], start, plan.slots, plan.copies,
                      np.array(m.block_table(seq.seq_id), dtype=np.int32), found,
                      first) for seq, start, k, plan, found in placed]
        if first and req.params.n > 1:                # parallel samples: fork the prompt
            parent = req.live[0]
            children = [self.new_seq(parent.tokens, parent.prompt_len, parent=parent.seq_id)
                        for _ in range(req.params.n - 1)]
            m.fork(parent.seq_id, *(c.seq_id for c in children))
            req.live.extend(children)
        return parts

    def grow(self, reqs):
        """One more slot for every sequence of ``reqs`` that decodes now (its prompt in the
        cache, its answer not at its length yet, counting a first token this step draws):
        the :class:`Rows`, or None if the blocks are not free. A slot's token id is
        committed at once where the host has it, else when it lands."""
        seqs, owners = [], []
        for r in reqs:
            if not r.prefilled:
                continue
            for s in r.live:
                if s.planned + (s.planned == 0) < r.params.max_new_tokens:
                    seqs.append(s)
                    owners.append(r)
        ids = [s.seq_id for s in seqs]
        try:
            plan = self.manager.reserve(ids) if ids else None
        except OutOfBlocks:
            return None
        known = [s for s in seqs if s.planned and not s.on_its_way]
        if known:
            self.manager.commit([s.seq_id for s in known], [s.tokens[-1] for s in known])
        if plan is None:
            return Rows((), (), *(np.zeros(0, np.int32),) * 3, NO_PAIRS,
                        np.zeros(0, np.int32))
        return Rows(tuple(seqs), tuple(owners), plan.slot_mapping, plan.block_tables,
                    plan.seq_lens, plan.copies, np.full(len(seqs), -1, np.int32))

    def guess(self, rows: Rows, tokens=None) -> Rows:
        """Speculative decoding (:mod:`pagedkv.speculate`): the decode rows with guesses,
        found by prompt lookup, for the sequences that may guess (not beam search; the
        newest token on the host), at most ``k`` a sequence, none past its
        ``max_new_tokens``, at most ``tokens`` rows in all (what the token budget leaves;
        None: no limit) and ``max_seqs`` (a pass's most rows), none in a step of more than
        ``max_batch`` rows, and none for a sequence whose lookup guessed right less than
        ``min_rate`` of the time lately. A guess's slot is reserved: its id is committed
        once it is verified. Never preempts: a guess whose blocks are not free is not
        made."""
        spec, n = self.speculation, len(rows.seqs)
        if spec is None or not n or n > spec.max_batch:
            return rows
        room = self.max_seqs - n if tokens is None else min(tokens, self.max_seqs) - n
        drafts = {}
        for seq, req in zip(rows.seqs, rows.reqs):
            left = min(room, spec.k, req.params.max_new_tokens - seq.planned - 1)
            if left <= 0 or not _may_guess(seq, req):
                continue
            guesses = self._propose(seq, left)
            if not guesses or seq.lookup.rate < spec.min_rate:
                continue
            try:
                plan = self.manager.reserve_slots(seq.seq_id, len(guesses))
            except OutOfBlocks:
                break
            drafts[seq] = (guesses, plan)
            room -= len(guesses)
            self.counts.drafted += len(guesses)
        return _with_guesses(rows, drafts, self.manager) if drafts else rows

    def preempt(self, req, placed: bool = False) -> tuple:
        """``req`` gives its blocks back, by swap when there is a swapper with room (and
        its K/V are all computed: not ``placed`` in this step), else by recompute:
        ``(True, the swap copies)`` or ``(False, None)``. A request that has drawn nothing
        yet starts again from its prompt."""
        self.counts.preemptions += 1
        ids = [s.seq_id for s in req.live if s.seq_id in self.manager]
        fresh = not any(s.planned for s in req.live)
        if self.swapper is not None and not (fresh or placed) and len(ids) == len(req.live):
            try:
                pairs = self.swapper.swap_out(ids)
            except OutOfBlocks:                    # the host pool is full: recompute
                pass
            else:
                self.counts.swapped_out += len(pairs)
                return True, pairs
        for seq_id in ids:
            self.manager.free(seq_id)
        req.prefilled = False
        if fresh:                                  # (its sequences drew nothing: no tokens
            for seq in req.live:                   # of theirs can be on their way)
                seq.ended = True
            req.live.clear()
        return False, None

    def swap_in(self, req, promised: int):
        """Bring a swapped-out request back if its blocks (and the watermark) are free:
        the swap copies, or None."""
        ids = [s.seq_id for s in req.live]
        need = self.swapper.blocks_to_swap_in(ids) + self.watermark_blocks
        if need > self.manager.allocator.num_free - promised:
            return None
        if any(s.on_its_way for s in req.live):
            raise AuditError(f"request {req.request_id} is swapped in before its tokens "
                             f"landed")
        # (the tokens whose K/V were swapped out: all but a decoding sequence's pending one)
        held = [self.swapper.swapped[i].num_tokens for i in ids]
        pairs = self.swapper.swap_in(ids, [s.tokens[:n] for s, n in zip(req.live, held)])
        self.counts.swapped_in += len(pairs)
        return pairs

    # ------------------------------------------------------------------ the seal
    def seal(self, plan: Plan) -> Plan:
        """The plan with its :class:`Draws`: a first token for every sequence of every
        prompt its prefill completes, then one per decode row (beam search's rows go to
        the host instead); each sequence's stream (its seed, fixed at its first draw, and
        its counter) and its ``min_tokens`` ban; each decode row's input. Counts what the
        step prefills."""
        draws, beams = [], {}
        for row, (req, part) in enumerate(plan.parts):
            self._count(part)
            if part.first and req.params.beam_width > 1:
                beams[req] = [row]
            elif part.first:
                draws += [(row, req, s) for s in req.live]
        here = {s.seq_id: self._ndrawn + i for i, (_, _, s) in enumerate(draws)}
        rows = plan.rows
        inputs, follow = _inputs(rows, self._drawn, here)
        guessed, guess = rows.guessed() if rows else {}, [-1] * len(draws)
        if guessed:                       # a guess row's input is its guess (the host's)
            at = rows.guess >= 0
            inputs, follow = np.where(at, rows.guess, inputs), np.where(at, -1, follow)
        speculative = bool(guessed) or self._could_guess(rows)
        for j, (req, seq) in enumerate(zip(rows.reqs, rows.seqs) if rows else ()):
            if req.params.beam_width > 1:
                beams.setdefault(req, []).append(len(plan.parts) + j)
            else:
                draws.append((len(plan.parts) + j, req, seq))
                guess.append(int(rows.guess[j]))
        # (a sequence that guessed takes its next input from the host: which of its draws
        # it keeps is known only when the step lands)
        self._drawn = {s.seq_id: i for i, (_, _, s) in enumerate(draws) if s not in guessed}
        self._ndrawn = len(draws)
        beams = tuple((req, tuple(r)) for req, r in beams.items())
        return dataclasses.replace(plan, draws=self._draws(draws, beams, inputs, follow,
                                                           guess, speculative))

    def forget_draws(self) -> None:
        """A step failed: no draw of the steps before it is on the device for the next
        step's rows to read; they all take their input from the host."""
        self._drawn, self._ndrawn = {}, 0

    def _could_guess(self, rows) -> bool:
        """In a step small enough to guess, could a sequence that cannot guess now (its
        newest token is not on the host yet) find a guess in its text so far? Then the
        step lands at once, so that it can guess at the next step; else the device may
        run ahead."""
        spec = self.speculation
        if spec is None or not rows or len(rows.seqs) > spec.max_batch:
            return False
        return any(r.params.beam_width == 1 and not _may_guess(s, r) and self._propose(s, 1)
                   and s.lookup.rate >= spec.min_rate for s, r in zip(rows.seqs, rows.reqs))

    def _propose(self, seq, k: int) -> list:
        """Up to ``k`` guesses after the sequence's tokens (:func:`~pagedkv.speculate.propose`,
        by the sequence's own incremental :class:`~pagedkv.speculate.Lookup`)."""
        if seq.lookup is None:
            spec = self.speculation
            seq.lookup = Lookup(max_ngram=spec.max_ngram, min_ngram=spec.min_ngram)
        return seq.lookup.propose(seq.tokens, k)

    def _draws(self, draws, beams, inputs, follow, guess, speculative) -> Draws:
        """:class:`Draws` of ``(logits row, request, sequence)`` triples, in order (and the
        guess each row took as input); each sequence's ``planned`` count moves on by its
        draws."""
        reqs, seqs = tuple(r for _, r, _ in draws), tuple(s for _, _, s in draws)
        for req, seq in zip(reqs, seqs):
            if seq.stream_seed is None:            # its stream, fixed at its first draw
                seq.stream_seed = derive_seed(req.seed, req.live.index(seq))
        params, counters = [r.params for r in reqs], []
        for seq in seqs:                   # (a sequence may draw twice: its first token,
            counters.append(seq.planned)   # then the next)
            seq.planned += 1
        ban = np.array([c < p.min_tokens for c, p in zip(counters, params)], bool) \
            if self.stop_ids else np.zeros(len(seqs), bool)
        return _frozen(Draws)(
            np.array([r for r, _, _ in draws], np.int32), seqs, reqs,
            np.array([p.temperature for p in params], np.float64),
            np.array([p.top_p for p in params], np.float64),
            np.array([p.top_k for p in params], np.int32),
            np.array([s.stream_seed for s in seqs], np.uint64),
            np.array(counters, np.int64), ban,
            tuple(beams), inputs, follow, np.array(guess, np.int32), speculative)

    def _count(self, part: Part) -> None:
        """Count a part's tokens: computed from ``start`` on, after ``found`` found in the
        prefix cache (a sequence that has generated is computed again)."""
        c, n = self.counts, len(part.tokens)
        c.prompt_tokens += part.found + n
        c.computed_tokens += n
        if part.seq.generated:
            c.refound_tokens += part.found
            c.recomputed_tokens += n


def _frozen(kind):
    """``kind(*fields)`` with every NumPy array among them made read-only: a plan is one
    value, and whoever runs it cannot change it by accident."""
    def make(*fields):
        for f in fields:
            if isinstance(f, np.ndarray):
                f.flags.writeable = False
        return kind(*fields)
    return make


def _inputs(rows, before: dict, here: dict):
    """Each decode row's input token: its sequence's newest one. If this step draws it (a
    first token: ``here``, sequence id -> draw number) or the step before did
    (``before``), it is taken on the device (``follow``: that number, the step before's
    draws numbered first; ``inputs``: -1); else the host gives it."""
    n = len(rows.seqs) if rows else 0
    inputs, follow = np.full(n, -1, np.int32), np.full(n, -1, np.int32)
    for i, s in enumerate(rows.seqs if rows else ()):
        drawn = here.get(s.seq_id, before.get(s.seq_id))
        if drawn is not None:
            follow[i] = drawn
        elif s.on_its_way:
            raise AuditError(f"sequence {s.seq_id} decodes before its last token landed")
        else:
            inputs[i] = s.tokens[-1]
    return inputs, follow


def _may_guess(seq, req) -> bool:
    """May the sequence guess its next tokens? Not for beam search (its host step ranks
    rows instead), and only when its newest token is known on the host (not its first,
    drawn in this very step, nor one on its way from a step not landed)."""
    return req.params.beam_width == 1 and seq.planned > 0 and not seq.on_its_way


def _with_guesses(rows: Rows, drafts: dict, manager) -> Rows:
    """``rows`` with each guessing sequence's guesses (``drafts``: sequence -> (guesses,
    the plan of their reserved slots)) as rows of their own after its row, each one
    position further on, every one of the sequence's rows reading its page table as the
    reservation left it."""
    seqs, reqs, slots, tables, lens, guess = [], [], [], [], [], []
    for i, (seq, req) in enumerate(zip(rows.seqs, rows.reqs)):
        guesses, plan = drafts.get(seq, ((), None))
        table = rows.block_tables[i] if plan is None else \
            np.asarray(manager.block_table(seq.seq_id), np.int32)
        start = int(rows.seq_lens[i])
        seqs += [seq] * (1 + len(guesses))
        reqs += [req] * (1 + len(guesses))
        slots += [int(rows.slots[i])] + ([] if plan is None else plan.slots.tolist())
        tables += [table] * (1 + len(guesses))
        lens += range(start, start + 1 + len(guesses))
        guess += [-1] + list(guesses)
    width = max(len(t) for t in tables)
    padded = np.full((len(tables), width), -1, np.int32)
    for row, t in zip(padded, tables):
        row[:len(t)] = t
    copies = [rows.copies] + [p.copies.reshape(-1, 2) for _, p in drafts.values()]
    return Rows(tuple(seqs), tuple(reqs), np.array(slots, np.int32), padded,
                np.array(lens, np.int32), np.concatenate(copies).astype(np.int32),
                np.array(guess, np.int32))


def _cached_target(seq) -> int:
    """How many of the sequence's tokens must have their K/V in the cache before it decodes:
    all of a new prompt, all but the pending last token of a sequence that has generated."""
    return len(seq.tokens) - (1 if seq.generated else 0)
