"""Generation with continuous batching on the paged cache.

Requests wait in a queue; each :meth:`Engine.step` is *schedule, execute, update*, and
what passes between them is one :class:`~pagedkv.scheduler.Schedule`:

1. **schedule** (:meth:`Scheduler.prefill <pagedkv.scheduler.Scheduler.prefill>`): swap in
   requests that were preempted by swapping, when their blocks fit again; admit waiting
   requests while the pool can hold them; share the step's token budget, if it has one,
   between the decodes and prefill chunks. The schedule holds the chunks, their plans
   and the swap copies;
2. **execute** (:meth:`Engine.execute`): the runner copies the swapped blocks, and forward
   passes compute the chunks (with the prefix cache, only what it does not hold); a prompt
   whose prefill is complete chooses its first token(s). Then the scheduler's second phase
   (:meth:`Scheduler.decode <pagedkv.scheduler.Scheduler.decode>`) gives every live
   sequence of every prefilled request one more token in the schedule (one
   ``manager.step()``), preempting the most recently admitted request while the step
   cannot get its blocks, and one forward pass through the page tables decodes them;
3. **update** (:meth:`Engine.update`): requests whose sequences all ended (an end token, or
   their limit) leave the scheduler; the pool is recorded.

With a runner that offers the *single pass* (``single_pass=True``), a step that has both
runs its last prefill pass and its decode in one forward pass (:meth:`Engine.run_mixed`):
the decode is planned first, so a prompt that pass completes chooses its first token(s)
and decodes from the next step on.

Who runs is the :class:`~pagedkv.scheduler.Scheduler`'s decision (the simulation's scheduler
too); :class:`~pagedkv.model.scheduling.EngineMemory` answers its questions: where the
blocks are. The runner (:mod:`pagedkv.model.runner`) is the only part that touches device
arrays, the swap copies included.

A request (:mod:`pagedkv.model.requests`) asks for greedy decoding, sampling, ``n``
parallel samples (the prompt prefilled once, forked ``n`` ways) or beam search (beams fork
and are freed; copy-on-write copies a forked beam's partly filled last block when it is
first written); :mod:`pagedkv.model.sampling` chooses the tokens. With ``overlap=True``
the host plans a step while the GPU runs the one before (:mod:`pagedkv.model.overlap`).
"""
from __future__ import annotations

import itertools
from collections import deque
from functools import partial

import numpy as np

from ..checks import cdiv, positive_int, token_ids
from ..errors import AuditError, ConfigError
from ..prefix_cache import PrefixCachingManager
from .llama import Batch, Llama, PagedKV
from .overlap import Overlapping
from ..scheduler import Schedule, Scheduler
from .requests import Request, SamplingParams
from .runner import make_runner
from .sampling import Choosing
from .scheduling import EngineMemory

__all__ = ["Engine"]

NO_PAIRS = np.zeros((0, 2), dtype=np.int32)


class Engine(Overlapping, Choosing):
    """Requests in, answers out, on one model and one paged cache.

    Admission takes a request when the blocks it needs to start are free; when a decode step
    cannot get its blocks, the most recently admitted request is preempted, by ``preemption``
    ``"recompute"`` or ``"swap"`` (into a host pool of ``host_blocks`` blocks). With
    ``prefix_caching``, full blocks stay cached by their tokens after their sequence leaves,
    and a new prompt (or a preempted one coming back) starts from the blocks it finds.

    ``runner`` executes the passes (:mod:`pagedkv.model.runner`): ``"plain"`` the forward pass
    chapter 10 shows, ``"fast"`` the fused kernels, static buffers and (on a GPU) CUDA graphs
    of :class:`~pagedkv.model.runner.FastRunner` for decode steps, whose page tables hold
    ``max_context`` tokens (default: the model's context); ``"fast-eager"`` the same kernels
    without graphs; ``single_pass`` runs a step's last prefill pass and its decode as one
    pass, ``overlap`` plans a step while the GPU runs the last (both: fast runners only;
    ``overlap`` is on by default where the runner is on a GPU).
    ``bookkeeping``: ``"teaching"`` (the chapters' core) or ``"fast"`` (:mod:`pagedkv.fast`).

    Who runs is the :class:`~pagedkv.scheduler.Scheduler`'s (``self.scheduler``), over
    the pool's :class:`~pagedkv.model.scheduling.EngineMemory` (``self.memory``). With
    ``token_budget`` a step computes at most that many tokens, decodes first; with
    ``chunked_prefill`` (the default) a prompt that does not fit what is left is prefilled a
    chunk a step. Without a budget every admitted prompt is prefilled in the step that admits
    it, in passes that pack whole prompts up to about ``prefill_chunk`` tokens.

    ``history`` holds what the pool held after each of the last ``history_steps`` steps,
    read from counters (O(batch) a step, never a pass over the pool); ``on_step`` sees
    every step.
    """

    history_steps = 10_000

    def __init__(self, model: Llama, *, num_blocks: int, block_size: int = 16,
                 max_seqs: int = 64, stop_ids=(), prefill_chunk: int = 512,
                 audit: bool = False, on_step=None, prefix_caching: bool = False,
                 preemption: str = "recompute", host_blocks: int = 0,
                 watermark: float = 0.01, runner: str = "plain",
                 max_context: int | None = None, bookkeeping: str = "teaching",
                 token_budget: int | None = None, chunked_prefill: bool = True,
                 single_pass: bool = False, overlap: bool | None = None):
        self.model = model
        if bookkeeping == "teaching":
            classes, cache_cls = {}, PrefixCachingManager
        elif bookkeeping == "fast":
            from .. import fast
            from ..fast.prefix import PrefixCachingManager as cache_cls
            classes = dict(allocator_cls=fast.BlockAllocator)
        else:
            raise ConfigError(f"bookkeeping must be 'teaching' or 'fast', got {bookkeeping!r}")
        # the pool's manager is one that knows token ids, whether or not it caches by them
        kv = PagedKV.for_model(model, num_blocks, block_size, **classes,
                               manager_cls=partial(cache_cls, caching=prefix_caching))
        max_seqs = positive_int(max_seqs, "max_seqs")
        self.memory = EngineMemory(kv.manager, max_seqs=max_seqs, watermark=watermark,
                                   preemption=preemption, host_blocks=host_blocks)
        self.prefill_chunk = positive_int(prefill_chunk, "prefill_chunk")
        self.stop_ids = frozenset(int(t) for t in stop_ids)
        self.audit = audit
        self.on_step = on_step           # called as on_step(engine) after every step
        self.runner = make_runner(runner, model, kv, max_batch=max_seqs,
                                  max_context=max_context, single_pass=single_pass)
        self.scheduler = Scheduler(self.memory, max_seqs=max_seqs, token_budget=token_budget,
                                   chunked_prefill=chunked_prefill)
        self.memory.running = self.scheduler.running
        self.finished: list = []
        self.history = deque(maxlen=self.history_steps)  # a dict per step: the pool
        self.ahead = self._ahead(overlap)            # the overlapped loop's state, or None

    # the scheduler's queues: waiting (first come, first served), running (in admission
    # order: the last is preempted first), swapped (the oldest preemption first)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    swapped = property(lambda self: self.scheduler.swapped)
    # the pool and its bookkeeping, the memory's; the cache's arrays, the runner's
    manager = property(lambda self: self.memory.manager)
    swapper = property(lambda self: self.memory.swapper)
    counts = property(lambda self: self.memory.counts)
    block_size = property(lambda self: self.memory.block_size)
    max_seqs = property(lambda self: self.scheduler.max_seqs)
    kv = property(lambda self: self.runner.kv)

    # ------------------------------------------------------------------ requests
    def submit(self, prompt, params: SamplingParams | None = None) -> Request:
        """Queue a request (a list of token ids). Raises :class:`ConfigError` for a prompt
        that is empty, holds ids outside the vocabulary, is longer than the model's context
        with its new tokens, or could never run (admission answers "never": the reason)."""
        params = params or SamplingParams()
        prompt = token_ids(prompt)
        vocab, context = self.model.config.vocab_size, self.runner.max_tokens
        whose = "model's" if context == self.model.config.context else "runner's max"
        if not prompt:
            raise ConfigError("the prompt is empty: give at least one token")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ConfigError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt) + params.max_new_tokens > context:
            raise ConfigError(f"{len(prompt)} prompt tokens + {params.max_new_tokens} new ones "
                              f"exceed the {whose} context of {context} tokens")
        req = Request(next(self.memory.ids), prompt, params,
                      np.random.default_rng(params.seed))
        req.hashed = self.manager.prompt(prompt)     # hashed once, used until it is added
        answer, why = self.memory.admission(req)
        if answer == "never":
            raise ConfigError(f"refused: {why}")
        self.waiting.append(req)
        return req

    _new_seq = property(lambda self: self.memory.new_seq)   # (for Choosing)

    # ------------------------------------------------------------------ one step
    def step(self) -> None:
        """Schedule, execute, update (the module's text); overlapped, ahead of the GPU."""
        if self.ahead is not None:
            return self._step_ahead()
        schedule = self.scheduler.prefill()
        self.execute(schedule)
        self.update(schedule)

    def run(self) -> list:
        """Step until every request is done; returns them in the order they finished."""
        while self.waiting or self.running or self.swapped:
            self.step()
        return self.finished

    def generate(self, prompts, params: SamplingParams | None = None) -> list:
        """Submit ``prompts`` (lists of token ids), run them all; requests in prompt order."""
        reqs = [self.submit(p, params) for p in prompts]
        self.run()
        return reqs

    def execute(self, schedule: Schedule) -> None:
        """Run the schedule's prefill, then decode one token for every live sequence of
        every prefilled request (the scheduler's second phase plans it). With the single
        pass, the last prefill pack waits to run beside the decode rows."""
        held = self.run_prefill(schedule, hold_last=self.runner.single_pass)
        if held:
            self.run_mixed(held, schedule)
        else:
            self.scheduler.decode()
            self.run_decode(schedule)

    # ------------------------------------------------------------------ prefill
    def run_prefill(self, schedule: Schedule, hold_last: bool = False):
        """Compute the schedule's prefill parts (placed by the memory as the scheduler
        asked), whole parts packed into passes of about ``prefill_chunk`` tokens; a new
        prompt whose K/V are all in the cache chooses its first token(s). The parts leave
        the schedule as they run. With ``hold_last``, the last pack is returned instead, if
        the decode can run beside it (:meth:`_decode_fits`); it stays in the schedule's
        ``parts`` until it runs."""
        self._swap(schedule)
        packs = self._packs([p for p in schedule.parts if len(p[1][1])])
        schedule.parts = []
        for i, rows in enumerate(packs):
            if hold_last and i == len(packs) - 1 and self._decode_fits():
                schedule.parts = rows
                return rows
            logits, _ = self.runner.prefill(self._batch([part for _, part in rows]))
            self._prompts_done(rows, logits)
        self._check_first_tokens(schedule.chunks)
        return None

    def _swap(self, schedule: Schedule) -> None:
        """The schedule's swap copies so far, by the runner, in one call each way (they
        leave the schedule: a later preemption in the step adds its own)."""
        if self.swapper is None:
            return
        ins, outs = (np.concatenate(p) if p else NO_PAIRS
                     for p in (schedule.swap_ins, schedule.swap_outs))
        schedule.swap_ins, schedule.swap_outs = [], []
        if len(ins) or len(outs):
            self.runner.swap(self.swapper.host, ins, outs)

    def _packs(self, parts) -> list:
        """Whole parts, in order, packed into passes of about ``prefill_chunk`` tokens."""
        packs, size = [], 0
        for part in parts:
            n = len(part[1][1])
            if packs and size + n <= self.prefill_chunk:
                packs[-1].append(part)
                size += n
            else:
                packs.append([part])
                size = n
        return packs

    def _prompts_done(self, rows, logits) -> None:
        """After a pass over ``rows`` (``logits``: each row's last): a new prompt now all in
        the cache chooses its first token(s)."""
        for row, (req, (seq, *_)) in enumerate(rows):
            if not seq.generated and not req.prefilled and \
                    self.manager.num_tokens(seq.seq_id) == len(seq.tokens):
                req.prefilled = True
                self._first_tokens(req, logits[row:row + 1])

    def _check_first_tokens(self, chunks) -> None:
        """Every prompt whose prefill the step finished (a prompt found whole in the cache
        too) has its first token(s)."""
        for chunk in chunks:
            req = chunk.req
            if chunk.last and not req.prefilled and req in self.running:
                raise AuditError(f"request {req.request_id}'s prefill ended without "
                                 f"logits to choose its first token")

    def _batch(self, parts) -> Batch:
        """A :class:`Batch` from (sequence, new tokens, their positions, plan) for each row."""
        seqs = [p[0] for p in parts]
        tables = [self.manager.block_table(s.seq_id) for s in seqs]
        width = max(len(t) for t in tables)
        block_tables = np.full((len(seqs), width), -1, dtype=np.int32)
        for row, t in zip(block_tables, tables):
            row[:len(t)] = t
        i32 = lambda a: np.asarray(list(a), dtype=np.int32)  # noqa: E731
        copies = [p[3].copies for p in parts]
        return Batch(
            tokens=i32(itertools.chain.from_iterable(p[1] for p in parts)),
            positions=i32(itertools.chain.from_iterable(p[2] for p in parts)),
            slots=np.concatenate([p[3].slots for p in parts]).astype(np.int32),
            query_lens=i32(len(p[1]) for p in parts),
            seq_lens=i32(self.manager.num_tokens(s.seq_id) for s in seqs),
            block_tables=block_tables,
            copies=np.concatenate(copies).astype(np.int32).reshape(-1, 2))

    # ------------------------------------------------------------------ decode
    def run_decode(self, schedule: Schedule) -> None:
        """One token for every live sequence of the schedule's ``decodes``: their
        ``manager.step()`` plan (made by the memory's :meth:`grow
        <pagedkv.model.scheduling.EngineMemory.grow>`), one forward pass."""
        self._swap(schedule)
        reqs = self._decoding(schedule)
        if reqs:
            logits, greedy = self.runner.decode(self._decode_batch(schedule))
            self._decoded(reqs, logits, greedy)

    def run_mixed(self, rows, schedule: Schedule) -> None:
        """The last prefill pack (``rows``) and the decode in one pass. The decode is
        planned first (:meth:`_decode_fits` checked that it preempts nobody), so its rows
        are the requests decoding before this pass: a prompt the pass completes chooses
        its first token(s) from it, and decodes from the next step on. A request back from
        a recompute is in both parts: its decode row reads the K/V its chunk writes, and
        every row's K/V are written before any row attends."""
        prefill = self._batch([part for _, part in rows])    # before the sequences grow
        self.scheduler.decode()
        reqs = self._decoding(schedule)
        schedule.parts = []
        self._swap(schedule)
        batch = self._decode_batch(schedule)
        if np.isin(batch.copies[:, 0], prefill.slots // self.block_size).any():
            raise AuditError("a decode copy-on-write copies a block the same pass writes")
        first, logits, greedy = self.runner.mixed(prefill, batch)
        self._prompts_done(rows, first)
        self._check_first_tokens(schedule.chunks)
        self._decoded(reqs, logits, greedy)

    def _decode_fits(self) -> bool:
        """Can the decode be planned before the step's last prefill pack runs? Only if it
        preempts nobody: a request preempted then would give up blocks its pending chunk
        has yet to write. So every block its sequences may take (one each at most, a new
        block or a copy) must be free."""
        seqs = [s for r in self.scheduler.decoding() if r.prefilled for s in r.live]
        need = sum(self.manager.blocks_needed(s.seq_id) for s in seqs)
        return bool(seqs) and need <= self.manager.allocator.num_free

    @staticmethod
    def _decoding(schedule: Schedule) -> list:
        """The schedule's requests that decode now: live, with their first token chosen."""
        return [r for r in schedule.decodes if r.live and r.prefilled]

    @staticmethod
    def _decode_batch(schedule: Schedule) -> Batch:
        """The decode rows of the schedule's plan (made by the memory's ``grow``)."""
        plan, seqs = schedule.plan, schedule.seqs
        return Batch(
            tokens=np.array([s.tokens[-1] for s in seqs], dtype=np.int32),
            positions=plan.seq_lens - 1, slots=plan.slot_mapping,
            query_lens=np.ones(len(seqs), dtype=np.int32), seq_lens=plan.seq_lens,
            block_tables=plan.block_tables, copies=plan.copies)

    # ------------------------------------------------------------------ update
    def update(self, schedule: Schedule) -> None:
        """After the passes: finished requests leave the scheduler (into the schedule's
        ``finished`` and the engine's), the audit runs if asked, the pool is recorded."""
        for req in [r for r in self.running if r.done]:
            self.scheduler.finish(req)
            schedule.finished.append(req)
        self.finished.extend(schedule.finished)
        if self.audit:
            self.manager.audit()
            if self.swapper is not None:
                self.swapper.audit()
        self._record(schedule)
        if self.on_step is not None:
            self.on_step(self)

    def _record(self, schedule: Schedule) -> None:
        """What the pool holds, from the allocator's counters and one pass over the live
        sequences (a sequence of n tokens maps ceil(n / block_size) blocks, so the blocks
        sharing saves are the mapped ones less the used ones)."""
        m, alloc = self.manager, self.manager.allocator
        lengths = [m.num_tokens(s) for s in m.seq_ids]
        mapped = sum(cdiv(n, self.block_size) for n in lengths)
        self.history.append(dict(
            used_blocks=alloc.num_used, shared_blocks=alloc.num_shared,
            blocks_saved=mapped - alloc.num_used, sequences=len(lengths),
            tokens=sum(lengths), copies=self.kv.copies_done, running=len(self.running),
            waiting=len(self.waiting), swapped=len(self.swapped),
            preemptions=self.counts.preemptions, decoded=len(schedule.seqs)))

    # ------------------------------------------------------------------ cancelling
    def cancel(self, req: Request) -> bool:
        """Take ``req`` out of whichever queue holds it (waiting, running or swapped)
        and free its sequences' blocks (a swapped-out request's host blocks too). Its
        live sequences move to ``req.finished`` with the tokens they have; it does not
        join ``finished``. Returns False, changing nothing, if it had already finished;
        raises :class:`ConfigError` for a request this engine does not hold. All or
        nothing: every block is checked to be held before any is freed."""
        if any(r is req for r in self.finished):
            return False
        queue = next((q for q in (self.waiting, self.running, self.swapped)
                      if any(r is req for r in q)), None)
        if queue is None:
            raise ConfigError(f"request {req.request_id} is not in this engine's queues")
        ids = [s.seq_id for s in req.live]
        if queue is self.swapped:
            parked = [self.swapper.swapped[i].host_blocks for i in ids]
        else:
            held = [i for i in ids if i in self.manager]
            if queue is self.running and len(held) != len(ids):
                raise ConfigError(f"request {req.request_id} is running without the "
                                  f"blocks of all its sequences")
        self.scheduler.drop(req)
        if queue is self.swapped:
            for i, blocks in zip(ids, parked):
                del self.swapper.swapped[i]
                self.swapper.host.free_n(blocks)
        else:
            for i in held:
                self.manager.free(i)
        req.finished.extend(req.live)
        req.live = []
        return True
