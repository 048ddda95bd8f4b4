"""The host one step ahead of the GPU: :class:`~pagedkv.model.engine.Engine` with
``overlap=True``.

In the plain loop the host and the GPU take turns: the host schedules step n, the GPU runs
it, the host waits for its tokens, applies them, and only then schedules step n + 1 while the
GPU waits. A decode step of greedy requests needs nothing from the host that the host does
not already know, except the tokens step n is choosing; so the overlapped loop does, in each
:meth:`~Overlapping.step`:

1. **plan and launch step n + 1 before step n lands.** Every sequence of step n continues,
   except those its limit ends at step n (known ahead). Their slots are *reserved*
   (:meth:`~pagedkv.reserve.Reserving.reserve`: the blocks are taken, the prefix cache names
   none yet), and the runner launches the pass with each row's input token taken on the
   device from step n's greedy tokens (:meth:`~pagedkv.model.runner.FastRunner.launch`
   with ``follow``): no round trip through the host;
2. **land step n**: wait for its tokens (they were downloaded behind its pass), append them,
   retire the sequences that ended, and *commit* step n + 1's slots
   (:meth:`~pagedkv.reserve.Reserving.commit`), now that their tokens are known.

A sequence that stops on an end token at step n was already in step n + 1 (that is learned
one step late). Its row of step n + 1 is computed and thrown away, and freeing it gives back
the reserved slot with its blocks; those blocks can be handed out again only to a step
planned later, whose writes the stream orders after step n + 1's.

Anything else — a prefill, a swap, a preemption, a sampled or beam request, a waiting
request that would be admitted — is the plain step's: the loop lands what is in flight and
runs the step as the plain loop does (:meth:`~Overlapping._start`), leaving its decode in
flight when that can continue ahead. The tokens are those of the plain loop, token for
token; the tests check it on both backends.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError, OutOfBlocks
from ..scheduler import Schedule

__all__ = ["Ahead", "Flying", "Overlapping"]


@dataclass(eq=False)
class Flying:
    """A decode step the GPU may still be running: its schedule, its requests, the
    runner's launch, and each sequence's row (by id)."""
    schedule: Schedule
    reqs: list
    launched: object
    rows: dict = field(default_factory=dict)


@dataclass(eq=False)
class Ahead:
    """The overlapped loop's state: the step in flight (None between runs), and how many
    steps were launched ahead of the one before (``ahead``) or ran as plain steps."""
    flying: Flying | None = None
    ahead: int = 0
    plain: int = 0


class Overlapping:
    """The overlapped step (a mixin of :class:`~pagedkv.model.engine.Engine`: it uses the
    engine's scheduler, memory, runner and its plain step's parts)."""

    def _ahead(self, overlap: bool | None) -> Ahead | None:
        """The state for ``Engine(overlap=...)``: None (off), or on; by default on where
        the runner runs on a GPU (where it measured faster; on NumPy nothing overlaps)."""
        if overlap is None:
            overlap = getattr(self.runner, "on_gpu", False)
        if overlap and not hasattr(self.runner, "launch"):
            raise ConfigError("overlap needs a fast runner ('fast' or 'fast-eager')")
        return Ahead() if overlap else None

    def _step_ahead(self) -> None:
        """One step of the overlapped loop (the module's text)."""
        state = self.ahead
        flying = state.flying
        if flying is None:
            self._start()
            return
        following = self._launch_next(flying)
        self._land(flying)
        if following is not None:
            ids = [s.seq_id for s in following.schedule.seqs]
            self.manager.commit(ids, [s.tokens[-1] for s in following.schedule.seqs])
            state.ahead += 1
            if not any(r.live for r in following.reqs):  # all ended at step n: wait for
                self.runner.land(following.launched)      # the rows thrown away, so that
                following = None                          # nothing runs between runs
        state.flying = following

    def _start(self) -> None:
        """A plain step; its decode, if every request in it can go ahead, is left in
        flight (it lands at the next step) instead of waited for."""
        self.ahead.plain += 1
        schedule = self.scheduler.prefill()
        held = self.run_prefill(schedule, hold_last=self.runner.single_pass)
        if held:
            self.run_mixed(held, schedule)
            self.update(schedule)
            return
        self.scheduler.decode()
        self._swap(schedule)
        reqs = self._decoding(schedule)
        if reqs and all(map(self._goes_ahead, reqs)):
            launched = self.runner.launch(self._decode_batch(schedule))
            self.ahead.flying = Flying(schedule, reqs, launched, _rows(schedule.seqs))
            return
        if reqs:
            logits, greedy = self.runner.decode(self._decode_batch(schedule))
            self._decoded(reqs, logits, greedy)
        self.update(schedule)

    def _goes_ahead(self, req) -> bool:
        """Can the request's next step be launched before its last one lands? One greedy
        sequence, no beam, no ``min_tokens`` left to hold its end tokens back."""
        p = req.params
        return len(req.live) == 1 and p.temperature == 0 and p.beam_width == 1 \
            and not self._early(req)

    def _launch_next(self, flying: Flying) -> Flying | None:
        """Plan and launch the step after ``flying``, its input tokens on the device; None
        (changing nothing) where that step is not a pure decode of the same requests."""
        sched = self.scheduler
        if sched.prefilling or self.swapped or (self.waiting and self._admits_now()):
            return None
        running = [r for r in flying.reqs if r.live]          # cancelled ones have none
        if len(running) != len(sched.decoding()) or not all(map(self._goes_ahead, running)):
            return None
        reqs = [r for r in running                             # not ended by their limit
                if r.live[0].num_generated + 1 < r.params.max_new_tokens]
        if not reqs:
            return None
        schedule = Schedule(decodes=reqs)
        seqs = [r.live[0] for r in reqs]
        try:
            plan = self.manager.reserve([s.seq_id for s in seqs])
        except OutOfBlocks:                       # the plain step preempts: after landing
            return None
        sched.schedule = schedule
        schedule.plan, schedule.seqs = plan, seqs
        follow = [flying.rows[s.seq_id] for s in seqs]
        launched = self.runner.launch(self._decode_batch(schedule), follow=follow)
        return Flying(schedule, reqs, launched, _rows(seqs))

    def _admits_now(self) -> bool:
        """Would the plain step admit the head of the queue now?"""
        head = self.waiting[0]
        live = self.memory.sequences(self.running)
        if live + self.memory.width(head) > self.max_seqs:
            return False
        return self.memory.admission(head)[0] == "now"

    def _land(self, flying: Flying) -> None:
        """Wait for a step in flight; its requests (those not cancelled since) take their
        tokens, those that ended retire; then the plain step's update."""
        _, greedy = self.runner.land(flying.launched)
        for req in flying.reqs:
            if not req.live:
                continue
            seq = req.live[0]
            seq.tokens.append(greedy[flying.rows[seq.seq_id]])
            if self._ends(req.params, seq):
                self._retire(req, seq)
        self.update(flying.schedule)


def _rows(seqs) -> dict:
    return {s.seq_id: i for i, s in enumerate(seqs)}
