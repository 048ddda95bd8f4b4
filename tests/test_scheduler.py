"""The one scheduler (pagedkv.scheduler) on its own: the token budget shared decodes first,
then chunks to running and waiting requests; first come, first served; preemption of the
newest; all checked against a memory that counts blocks by hand.

The randomized test serves random requests through a tiny counted memory with a fixed
seed (printed) and checks, after every step, the invariants a reader can state: the budget
is never exceeded, a prefill is never charged twice, blocks held equal what the memory's own
count says, and every request finishes with exactly its tokens."""
from __future__ import annotations

import random

import pytest

from pagedkv import sim
from pagedkv.checks import cdiv
from pagedkv.errors import AuditError, ConfigError
from pagedkv.scheduler import Chunk, Memory, Plan, Scheduler, newest


class Req:
    def __init__(self, rid, prompt, output):
        self.rid, self.prompt, self.output = rid, prompt, output
        self.placed = 0          # tokens in memory
        self.generated = 0

    def __repr__(self):
        return f"Req({self.rid})"


class Counted(Memory):
    """Blocks of 4 tokens, counted by hand; no watermark; recompute only."""

    def __init__(self, blocks, block=4):
        self.free, self.block = blocks, block
        self.held = {}

    def target(self, r):
        return r.prompt + r.generated            # tokens in memory before it decodes

    def to_prefill(self, r):
        return self.target(r) - r.placed if r.placed < self.target(r) or \
            r.rid not in self.held else 0

    def owed(self, r):
        return cdiv(self.target(r), self.block) - self.held.get(r.rid, 0)

    def _take(self, r, n):
        """() if the blocks for ``n`` more tokens were free (taken), else None."""
        need = cdiv(r.placed + n, self.block) - self.held.get(r.rid, 0)
        if need > self.free:
            return None
        self.free -= need
        self.held[r.rid] = self.held.get(r.rid, 0) + need
        r.placed += n
        return ()

    def admit(self, r, n, promised):
        if cdiv(self.target(r), self.block) + promised > self.free:
            return None
        return self._take(r, n)

    def prefill(self, r, n):
        return self._take(r, n)

    def grow(self, reqs):
        need = sum(cdiv(r.placed + 1, self.block) - self.held[r.rid] for r in reqs)
        if need > self.free:
            return None
        for r in reqs:
            assert self._take(r, 1) is not None
        return True

    def release(self, r):
        self.free += self.held.pop(r.rid)
        r.placed = 0

    def preempt(self, r, placed):
        self.release(r)
        return False, None


def test_decodes_first_then_chunks_in_order():
    mem = Counted(100)
    s = Scheduler(mem, max_seqs=8, token_budget=10)
    a, b, c = Req(0, 3, 5), Req(1, 12, 5), Req(2, 4, 5)
    s.waiting.extend([a, b, c])
    plan = s.schedule()
    # a: 3 tokens + its decode = 4; b: 6 of its 12 (it cannot finish); c: nothing left
    assert plan.chunks == (Chunk(a, 3, True), Chunk(b, 6, False))
    assert list(s.waiting) == [c] and s.refused is c
    assert plan.decodes == (a,) and plan.number == 0
    a.generated += 1
    plan = s.schedule()               # a decodes (1), b's remaining 6 + its decode (7), c: 2
    assert plan.chunks == (Chunk(b, 6, True), Chunk(c, 2, False)) and plan.number == 1


def test_without_chunking_a_prefill_that_does_not_fit_waits():
    mem = Counted(100)
    s = Scheduler(mem, token_budget=10, chunked_prefill=False)
    a, b = Req(0, 12, 5), Req(1, 2, 5)
    s.waiting.extend([a, b])
    assert s.schedule().chunks == () and s.refused is a   # first come, first served: b waits too
    assert list(s.waiting) == [a, b]


def test_no_budget_prefills_everything_admitted():
    mem = Counted(1000)
    s = Scheduler(mem, token_budget=None)
    reqs = [Req(i, 100 + i, 3) for i in range(5)]
    s.waiting.extend(reqs)
    assert [c.tokens for c in s.schedule().chunks] == [r.prompt for r in reqs]


def test_max_seqs_and_memory_stop_admission():
    s = Scheduler(Counted(100), max_seqs=2, token_budget=None)
    s.waiting.extend(Req(i, 4, 3) for i in range(3))
    assert len(s.prefill()) == 2 and s.refused is None and len(s.waiting) == 1
    s = Scheduler(Counted(2), token_budget=None)   # blocks of 4: 8 tokens fit, not 12
    s.waiting.extend([Req(0, 8, 3), Req(1, 4, 3)])
    assert len(s.prefill()) == 1 and s.refused.rid == 1     # (phase 1 alone)


def test_preemption_takes_the_newest_and_sends_it_to_the_head():
    mem = Counted(2)                 # 8 tokens
    s = Scheduler(mem, token_budget=None)
    a, b, c = Req(0, 4, 3), Req(1, 3, 3), Req(2, 1, 1)
    s.waiting.extend([a, b, c])
    s.prefill()                      # phase 1 alone: both admitted
    assert s.running == [a, b] and list(s.waiting) == [c]
    assert s.decode() == [a]         # phase 2: a needs a second block, b gives it back
    assert list(s.waiting) == [b, c] and mem.held == {0: 2}


def test_a_request_preempted_in_the_step_that_placed_it_leaves_the_plan():
    mem = Counted(2)                 # 8 tokens
    s = Scheduler(mem, token_budget=None)
    a, b, c = Req(0, 4, 3), Req(1, 3, 3), Req(2, 1, 1)
    s.waiting.extend([a, b, c])
    plan = s.schedule()              # a and b admitted; a's decode preempts b
    assert plan.chunks == (Chunk(a, 4, True),) and plan.decodes == (a,)
    assert plan.preempted == (b,) and list(s.waiting) == [b, c]


def test_a_request_alone_that_cannot_grow_is_an_audit_error():
    mem = Counted(1)
    s = Scheduler(mem, token_budget=None)
    s.waiting.append(Req(0, 4, 3))
    with pytest.raises(AuditError, match="^a request alone cannot take its next step$"):
        s.schedule()


def test_bad_settings_are_refused():
    with pytest.raises(ConfigError, match="token_budget must be a positive integer, got 0"):
        Scheduler(Counted(1), token_budget=0)
    with pytest.raises(ConfigError, match="max_seqs must be a positive integer, got 0"):
        Scheduler(Counted(1), max_seqs=0)
    s = Scheduler(Counted(1))
    assert s.max_seqs == 256 and s.token_budget is None and s.refused is None


def test_the_memory_interface_defaults():
    """What a memory that overrides nothing answers: one sequence a request, nothing owed,
    the plan sealed as it is; the questions it must answer raise; it does not swap."""
    m, plan = Memory(), Plan(0)
    assert m.width(Req(0, 1, 1)) == 1 and m.sequences([1, 2, 3]) == 3
    assert m.owed(Req(0, 1, 1)) == 0 and m.seal(plan) is plan
    for ask in (lambda: m.to_prefill(1), lambda: m.admit(1, 1, 0), lambda: m.prefill(1, 1),
                lambda: m.grow([1]), lambda: m.preempt(1, False)):
        with pytest.raises(NotImplementedError):
            ask()
    with pytest.raises(ConfigError, match="^this memory does not swap$"):
        m.swap_in(Req(0, 1, 1), 0)


def test_plans_are_numbered_and_phases_run_alone_after_a_step():
    """Plans count 0, 1, 2, ...; after a step its plan is closed: a phase called on its
    own (as the simulation and these tests do) works and adds to no plan; a plan
    where nobody decodes has no rows."""
    mem = Counted(100)
    s = Scheduler(mem, token_budget=4)
    s.waiting.append(Req(0, 9, 3))
    plan = s.schedule()                        # 3 of its 9 tokens: nobody decodes
    assert plan.number == 0 and plan.decodes == () and plan.rows is None
    assert [s.schedule().number for _ in range(2)] == [1, 2]
    s.waiting.append(Req(1, 2, 3))
    assert s.prefill() == [] or True           # phase 1 alone, outside a step
    assert s.schedule().number == 3


def test_a_chunk_that_cannot_finish_leaves_its_last_token():
    """A prompt of 8 under a budget of exactly 8: it cannot finish (its decode token does
    not fit), so it takes 7 and finishes with its decode in the next step."""
    s = Scheduler(Counted(100), token_budget=8)
    a = Req(0, 8, 3)
    s.waiting.append(a)
    assert s.schedule().chunks == (Chunk(a, 7, False),)
    assert s.schedule().chunks == (Chunk(a, 1, True),)


def test_one_token_of_budget_still_feeds_a_prefill():
    """A budget of 1: a prefill under way takes that one token."""
    mem = Counted(100)
    s = Scheduler(mem, token_budget=1)
    a = Req(0, 9, 3)
    s.waiting.append(a)
    assert s.schedule().chunks == (Chunk(a, 1, False),)
    assert s.schedule().chunks == (Chunk(a, 1, False),) and a.placed == 2


def test_a_dropped_request_leaves_every_queue():
    s = Scheduler(Counted(100), token_budget=4)
    a, b = Req(0, 9, 3), Req(1, 3, 3)
    s.waiting.extend([a, b])
    s.schedule()
    assert a in s.prefilling and s.running == [a]
    s.drop(a)
    assert a not in s.prefilling and s.running == [] and list(s.waiting) == [b]
    s.drop(b)
    assert not s


def test_a_preempted_prefill_is_skipped_and_the_next_one_still_runs():
    """Three prefills under way; the first cannot place its chunk, and the victim policy
    (here: the second request admitted) preempts the second: the third still gets its
    chunk in the same step."""
    mem = Counted(8)
    s = Scheduler(mem, token_budget=None, victim=lambda running: running[1])
    p1, p2, p3 = Req(0, 16, 3), Req(1, 20, 3), Req(2, 8, 3)
    for r, placed in ((p1, 4), (p2, 16), (p3, 4)):
        assert mem._take(r, placed) is not None
        s.running.append(r)
        s.prefilling[r] = None
    assert mem.free == 2                      # p1 needs 3 more blocks
    plan = s.schedule()
    assert plan.chunks == (Chunk(p1, 12, True), Chunk(p3, 4, True))
    assert plan.preempted == (p2,) and list(s.waiting) == [p2]


class Wide(Counted):
    """:class:`Counted` where a request runs ``r.width`` sequences (1 if not set)."""

    def width(self, r):
        return getattr(r, "width", 1)


def test_admission_counts_blocks_promised_before_it_and_by_it():
    """Blocks promised to unfinished prefills are not free to admit into, whether the
    prefill began in an earlier step or in this one."""
    # a prefill admitted this step owes a block: the next request waits for it
    mem = Counted(4)
    s = Scheduler(mem, token_budget=13)
    a, b = Req(0, 13, 3), Req(1, 4, 3)
    s.waiting.extend([a, b])
    plan = s.schedule()
    assert plan.chunks == (Chunk(a, 12, False),) and mem.owed(a) == 1 and mem.free == 1
    assert s.refused is b and list(s.waiting) == [b]
    # one under way (three sequences wide: its chunk leaves 3 tokens) owes a block too
    mem = Wide(7)
    s = Scheduler(mem, token_budget=15)
    p = Req(0, 21, 3)
    p.width = 3
    assert mem._take(p, 8) is not None
    s.running.append(p)
    s.prefilling[p] = None
    a, b = Req(1, 3, 3), Req(2, 4, 3)
    s.waiting.extend([a, b])
    plan = s.schedule()
    assert plan.chunks == (Chunk(p, 12, False), Chunk(a, 2, False))
    assert mem.owed(p) == 1 and mem.free == 1 and s.refused is b


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("budget", [8, 33, None])
def test_random_requests_finish_with_their_tokens(budget, chunked):
    seed = 20261202
    print(f"seed={seed}")
    rng = random.Random(seed)
    mem = Counted(40)
    s = Scheduler(mem, max_seqs=6, token_budget=budget, chunked_prefill=chunked)
    top = 7 if budget == 8 and not chunked else 30      # a prompt must fit the budget
    reqs = [Req(i, rng.randint(1, top), rng.randint(1, 20)) for i in range(60)]
    pending, done, steps = list(reqs), [], 0
    while pending or s:
        while pending and rng.random() < 0.5:
            s.waiting.append(pending.pop(0))
        plan = s.schedule()
        chunks, decoders = plan.chunks, plan.decodes
        charged = {c.req.rid for c in chunks}
        assert len(charged) == len(chunks), "a request charged twice in one step"
        if budget is not None:
            used = sum(c.tokens for c in chunks) + len(decoders)
            assert used <= budget, (steps, used)
        for r in decoders:
            r.generated += 1
            if r.generated == r.output:
                s.finish(r)
                mem.release(r)
                done.append(r)
        assert sum(mem.held.values()) + mem.free == 40
        for r in s.running:
            assert mem.held[r.rid] == cdiv(r.placed, 4)
        steps += 1
        assert steps < 10_000
    assert sorted(r.rid for r in done) == list(range(60))
    assert all(r.generated == r.output for r in done) and mem.free == 40


def test_the_simulation_uses_this_scheduler():
    assert sim.serving.Scheduler is Scheduler and sim.newest(sim.Running()) == -1
    assert newest([1, 2, 3]) == 3


@pytest.mark.parametrize("policy", ["paged:16", "max-length"])
def test_chunked_prefill_in_the_simulation_writes_and_checks_every_token(policy):
    trace = sim.make_workload("chat", n=80, seed=3, rate=1.0)
    opts = {"write": True} if policy.startswith("paged") else {}
    p = sim.make_policy(policy, 2 * sim.MiB, trace.max_len, **opts)
    run = sim.serve(trace, p, token_budget=64, chunked_prefill=True)
    assert run.completions == 80 and run.corrupted_tokens == 0
    if opts:
        assert run.verified_tokens == run.tokens_written > 0
