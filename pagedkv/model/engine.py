"""Generation with continuous batching on the paged cache.

Requests wait in a queue; each :meth:`Engine.step` is three calls, and what passes between
them is data:

1. ``plan = scheduler.schedule()`` (:class:`~pagedkv.scheduler.Scheduler`, over the pool's
   :class:`~pagedkv.model.memory.EngineMemory`): who runs and where — swaps, prefill
   chunks, one decode row for every sequence that decodes, preemptions — and which tokens
   the step draws. One immutable :class:`~pagedkv.scheduler.Plan`;
2. ``out = runner.launch(plan)``, later ``runner.land(...)``
   (:mod:`pagedkv.model.runner`): the only code that touches the device — copies, forward
   passes and the sampler — gives back the drawn token ids;
3. ``update(plan, out)``: each token joins its sequence; a sequence that ended (an end
   token, or its limit) frees its blocks; a request whose sequences all ended leaves.

On a GPU the device runs ahead of the host (``depth`` 1): a step is planned and launched
before the step before it lands, so the host's planning hides behind the device's work. A
row of step n + 1 then takes its input token, drawn by step n, on the device; a sequence
that step n ends is learned one step late, and its row of step n + 1 is computed and thrown
away. On NumPy there is nothing to hide behind (``depth`` 0): each step lands at once. The
code is the same either way; the tests run both on the CPU and check the same tokens.

A request (:mod:`pagedkv.model.requests`) asks for greedy decoding, sampling, ``n``
parallel samples (the prompt prefilled once, forked ``n`` ways) or beam search (beams fork
and are freed; copy-on-write copies a forked beam's partly filled last block when it is
first written). Beam search ranks each beam's best tokens on the host
(:mod:`pagedkv.model.sampling`), so a step with beam rows lands before the next is planned.

With ``speculate`` (:class:`~pagedkv.config.Speculation`), a decoding sequence may also
guess its next tokens (:mod:`pagedkv.speculate`: prompt lookup), each guess a decode row of
its own in the same pass; the update keeps the guesses the model agreed with
(:func:`~pagedkv.speculate.accept_drawn`), commits their ids and gives back the slots of the
rest (``truncate``). A step that guesses lands before the next is planned, as beam search's
does: which tokens it kept is known only then.
"""
from __future__ import annotations

import secrets
from collections import deque


from ..beams import follow
from ..checks import cdiv, token_ids
from ..config import EngineConfig, SamplingParams
from ..errors import AuditError, ConfigError
from ..prefix_cache import PrefixCachingManager
from ..scheduler import Scheduler
from ..speculate import accept_drawn
from .llama import Llama, PagedKV
from .memory import EngineMemory
from .requests import Request
from .runner import make_runner
from .sampling import beam_select

__all__ = ["Engine"]


class Engine:
    """Requests in, answers out, on one model and one paged cache, built from an
    :class:`~pagedkv.config.EngineConfig` (or its settings as keywords:
    ``Engine(model, num_blocks=64, prefix_caching=True)``).

    ``scheduler`` decides (its queues: ``waiting``, ``running``, ``swapped``), ``memory``
    places (the pool's ``manager``, the ``swapper``, the ``counts``), ``runner`` runs.
    ``history`` holds what the pool held after each of the last ``history_steps`` steps,
    read from counters (O(batch) a step, never a pass over the pool); ``on_step(engine)``
    is called after every step lands.
    """

    history_steps = 10_000

    def __init__(self, model: Llama, config: EngineConfig | None = None, *, on_step=None,
                 **settings):
        self.config = c = EngineConfig.of(config, **settings)
        self.model = model
        if c.bookkeeping == "fast":
            from .. import fast
            from ..fast.prefix import PrefixCachingManager as cache_cls
            classes = dict(allocator_cls=fast.BlockAllocator)
        else:
            classes, cache_cls = {}, PrefixCachingManager
        # the pool's manager is one that knows token ids, whether or not it caches by them
        kv = PagedKV.for_model(model, c.num_blocks, c.block_size, kv_dtype=c.kv_dtype,
                               **classes,
                               manager_cls=lambda *a: cache_cls(*a, caching=c.prefix_caching))
        self.memory = EngineMemory(kv.manager, max_seqs=c.max_seqs, watermark=c.watermark,
                                   preemption=c.preemption, host_blocks=c.host_blocks,
                                   stop_ids=c.stop_ids, speculation=c.speculate)
        self.runner = make_runner(c.runner, model, kv, max_seqs=c.max_seqs,
                                  max_context=c.max_context, prefill_chunk=c.prefill_chunk,
                                  stop_ids=c.stop_ids)
        if self.memory.swapper is not None:
            self.runner.host_pool = self.memory.swapper.host
        self.scheduler = Scheduler(self.memory, max_seqs=c.max_seqs,
                                   token_budget=c.token_budget,
                                   chunked_prefill=c.chunked_prefill)
        self.memory.running = self.scheduler.running
        ahead = c.overlap if c.overlap is not None else \
            c.runner != "plain" and self.runner.on_gpu
        self.depth = int(ahead)          # steps the device may run ahead of the host
        self.flight: deque = deque()     # launched, not landed: (plan, launched)
        self.finished: list = []
        self.history = deque(maxlen=self.history_steps)  # a dict per step: the pool
        self.on_step = on_step

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
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        req = Request(next(self.memory.ids), prompt, params, seed)
        req.hashed = self.memory.manager.prompt(prompt)   # hashed once, used until added
        answer, why = self.memory.admission(req)
        if answer == "never":
            raise ConfigError(f"refused: {why}")
        self.scheduler.waiting.append(req)
        return req

    def has_work(self) -> bool:
        """Are requests queued or running, or steps still on their way?"""
        return bool(self.scheduler or self.flight)

    # ------------------------------------------------------------------ one step
    def step(self) -> list:
        """Plan a step and launch it, then land every step but the last ``depth`` (all of
        them when nothing is left to plan, and a step with beam rows or guesses at once:
        the host ranks them, or keeps what it verified, before the next plan). Returns the
        requests the landed steps finished.

        A step that raises (the device failed, say) leaves no step in flight: what was
        on its way is dropped (:meth:`_abandon`), and the caller cancels the requests it
        holds, as the server does. The engine then serves on from a clean pool."""
        try:
            plan = self.scheduler.schedule()
            self.flight.append((plan, self.runner.launch(plan)))
            keep = 0 if plan.draws.lands_now else self.depth
            done = []
            while self.flight and (len(self.flight) > keep or not self.scheduler):
                plan, launched = self.flight.popleft()
                done += self.update(plan, self.runner.land(launched))
        except BaseException:
            self._abandon()
            raise
        return done

    def _abandon(self) -> None:
        """After a failed step: the steps in flight never land (their tokens are lost),
        every live sequence counts only the tokens that landed, and the memory's and the
        runner's numbering of the steps' draws starts afresh (no row of the next step
        reads a draw of a step that did not land)."""
        self.flight.clear()
        for req in self.scheduler.running:
            for seq in req.live:
                seq.planned = seq.num_generated
        self.memory.forget_draws()
        self.runner.forget_draws()

    def run(self) -> list:
        """Step until every request is done; returns them in the order they finished."""
        while self.has_work():
            self.step()
        return self.finished

    def generate(self, prompts, params: SamplingParams | None = None) -> list:
        """Submit ``prompts`` (lists of token ids), run them all; requests in prompt order."""
        reqs = [self.submit(p, params) for p in prompts]
        self.run()
        return reqs

    # ------------------------------------------------------------------ update
    def update(self, plan, out) -> list:
        """A landed step: each drawn token joins its sequence (a sequence gone since the
        plan was made, ended or cancelled, takes none), the slot reserved for it is named,
        the sequences that ended retire; beam search takes its step; the requests whose
        sequences all ended leave. Returns them."""
        d, m = plan.draws, self.memory.manager
        stops, ids, tokens, ended = self.config.stop_ids, [], [], []
        drawn = out.tokens.tolist()
        keep = accept_drawn(d.guess, drawn) if d.speculative else None
        for i, (req, seq, token) in enumerate(zip(d.reqs, d.seqs, drawn)):
            if seq.ended or (keep is not None and not keep[i]):
                continue
            seq.tokens.append(token)
            ids.append(seq.seq_id)
            tokens.append(token)
            p = req.params
            if seq.num_generated >= p.max_new_tokens or (token in stops and not p.ignore_eos):
                self._retire(req, seq, free=False)
                ended.append((req, seq))
        if keep is not None:
            self._rewind(plan, keep)
        m.commit_landed(ids, tokens)                # a reserved slot's K/V is its token's
        for req, seq in ended:
            self._release(seq)
        for (req, _), (top_lp, top_ids) in zip(d.beams, out.beams):
            if req.live:                            # (not cancelled since)
                self._beam_step(req, top_lp, top_ids)
                ended.append((req, None))
        done = list({id(r): r for r, _ in ended if r.done}.values())
        for req in done:
            self.scheduler.finish(req)
        self.finished.extend(done)
        if self.config.audit:
            m.audit()
            if self.memory.swapper is not None:
                self.memory.swapper.audit()
        self._record(plan)
        if self.on_step is not None:
            self.on_step(self)
        return done

    def _rewind(self, plan, keep) -> None:
        """Speculation's rollback, once a step's draws are kept or not: a sequence that
        guessed keeps the K/V of the guesses it took (every token but its newest has
        them), their ids committed, and gives back the slots of the rest (``truncate``:
        blocks wholly past them are freed). Nothing of it is on its way any more."""
        m, d = self.memory.manager, plan.draws
        self.memory.counts.accepted += int(keep[d.guess >= 0].sum())
        for seq, guesses in plan.rows.guessed().items():
            if seq.seq_id in m:
                had = m.num_tokens(seq.seq_id) - len(guesses)   # K/V before the guesses
                verified = max(len(seq.tokens) - 1 - had, 0)
                m.commit([seq.seq_id] * verified, guesses[:verified])
                m.truncate(seq.seq_id, had + verified)
            seq.planned = seq.num_generated

    def _retire(self, req: Request, seq, free: bool = True) -> None:
        """A sequence is complete: it leaves the live ones with its tokens (its blocks
        freed, unless the caller frees them later)."""
        req.live.remove(seq)
        req.finished.append(seq)
        seq.ended = True
        seq.lookup = None                      # (speculation's index: no more guesses)
        if free:
            self._release(seq)

    def _release(self, seq) -> None:
        """Free a sequence's blocks, wherever they are: the pool, the host pool (swapped
        out) or nowhere (preempted by recompute)."""
        swapper = self.memory.swapper
        if seq.seq_id in self.memory.manager:
            self.memory.manager.free(seq.seq_id)
        elif swapper is not None and seq.seq_id in swapper.swapped:
            swapper.host.free_n(swapper.swapped.pop(seq.seq_id).host_blocks)

    def _beam_step(self, req: Request, top_lp, top_ids) -> None:
        """Beam search: rank every (beam, next token) from the beams' best tokens; fork the
        beams chosen more than once, free the ones not chosen, keep the finished
        hypotheses. A request's first beam step starts from its prompt's one sequence."""
        k, m, new_seq = req.params.beam_width, self.memory.manager, self.memory.new_seq
        beams = req.live
        continuing, ended = beam_select([b.score for b in beams], top_lp, top_ids, k,
                                        self.config.stop_ids)
        for b, t, score in ended:                      # finished: no cache needed
            req.finished.append(new_seq(beams[b].tokens + [t], beams[b].prompt_len, score,
                                        parent=beams[b].seq_id))

        def fork(parent, j):                           # a second child: share the blocks
            _, t, score = continuing[j]
            child = new_seq(parent.tokens + [t], parent.prompt_len, score,
                            parent=parent.seq_id)
            m.fork(parent.seq_id, child.seq_id)
            return child

        def prune(beam):                               # no survivor descends from it
            m.free(beam.seq_id)
            beam.ended = True

        req.live = follow(beams, [b for b, _, _ in continuing], fork, prune)
        for beam, (b, t, score) in zip(req.live, continuing):
            if beam is beams[b]:                       # the first child continues the beam
                beam.tokens.append(t)
                beam.score = score
            beam.planned = beam.num_generated
        req.prefilled = True
        full = bool(req.live) and len(req.live[0].generated) >= req.params.max_new_tokens
        if len(req.finished) >= k or full or not req.live:
            for seq in list(req.live):
                self._retire(req, seq)

    def _record(self, plan) -> None:
        """What the pool holds, from the allocator's counters and one pass over the live
        sequences (a sequence of n tokens maps ceil(n / block_size) blocks, so the blocks
        sharing saves are the mapped ones less the used ones)."""
        m, alloc, s = self.memory.manager, self.memory.manager.allocator, self.scheduler
        lengths = [m.num_tokens(i) for i in m.seq_ids]
        mapped = sum(cdiv(n, self.config.block_size) for n in lengths)
        self.history.append(dict(
            used_blocks=alloc.num_used, shared_blocks=alloc.num_shared,
            blocks_saved=mapped - alloc.num_used, sequences=len(lengths),
            tokens=sum(lengths), copies=self.runner.kv.copies_done,
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            preemptions=self.memory.counts.preemptions,
            decoded=int((plan.rows.guess < 0).sum()) if plan.rows is not None else 0))

    # ------------------------------------------------------------------ cancelling
    def cancel(self, req: Request) -> bool:
        """Take ``req`` out of whichever queue holds it (waiting, running or swapped)
        and free its sequences' blocks (a swapped-out request's host blocks too). Its
        live sequences move to ``req.finished`` with the tokens they have (a token still
        on its way is dropped); it does not join ``finished``. Returns False, changing
        nothing, if it had already finished; raises :class:`ConfigError` for a request this
        engine does not hold. All or nothing: every block is checked to be held before any
        is freed."""
        if any(r is req for r in self.finished) or req.done:
            return False
        s = self.scheduler
        queue = next((q for q in (s.waiting, s.running, s.swapped)
                      if any(r is req for r in q)), None)
        if queue is None:
            raise ConfigError(f"request {req.request_id} is not in this engine's queues")
        m, swapper = self.memory.manager, self.memory.swapper
        if queue is s.running and not all(q.seq_id in m for q in req.live):
            raise ConfigError(f"request {req.request_id} is running without the "
                              f"blocks of all its sequences")
        if queue is s.swapped and not all(q.seq_id in swapper.swapped for q in req.live):
            raise AuditError(f"request {req.request_id} is swapped out without all its "
                             f"sequences")
        for seq in list(req.live):         # (a free that fails leaves the rest held by req)
            self._release(seq)
            self._retire(req, seq, free=False)
        s.drop(req)
        return True

