"""Swapped-in requests are charged to the token budget (issue 44).

The scheduler (pagedkv.scheduler) brings swapped requests back before it shares the
budget out: a request swapped in that decodes takes a token of the step's budget, and one
swapped out before its prefill ended takes its chunks as a prefilling request does. The
oracle is a memory that counts blocks by hand (``tests/test_scheduler.py``'s), extended
with a host pool: a request whose K/V are all computed (none placed in this step) is
swapped out while the host has room, else recomputed. Random requests, a fixed printed
seed; after every step: the budget is never exceeded, at most ``max_seqs`` requests run,
every block is in exactly one place, and every request finishes with exactly its tokens.
Then the same on the engine (the tiny model), against the contiguous-cache oracle.
"""
from __future__ import annotations

import random

import pytest

from pagedkv.checks import cdiv
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from pagedkv.scheduler import Chunk, Scheduler
from test_scheduler import Counted, Req

single_thread_blas()

SEED = 20261208
BLOCKS, HOST = 14, 40


class Swapping(Counted):
    """:class:`Counted` with a host pool of ``host`` blocks. A preempted request whose
    prefill placed nothing in this step is swapped out, its placed tokens kept, if the
    host has room for its blocks; else it is recomputed. Placements are named (a request
    that placed something this step shows in the plan's ``parts``)."""

    def __init__(self, blocks, host, block=4):
        super().__init__(blocks, block)
        self.host_free, self.parked = host, {}        # rid -> its blocks on the host
        self.outs = self.ins = 0

    def _take(self, r, n):
        return None if super()._take(r, n) is None else [(r.rid, n)]

    def grow(self, reqs):
        return super().grow(reqs) and [(r.rid, 1) for r in reqs]

    def preempt(self, r, placed):
        n = self.held.get(r.rid, 0)
        if not placed and 0 < n <= self.host_free:
            del self.held[r.rid]
            self.free += n
            self.host_free -= n
            self.parked[r.rid] = n
            self.outs += 1
            return True, [("out", r.rid, n)]
        self.release(r)
        return False, None

    def swap_in(self, r, promised):
        n = self.parked[r.rid]
        if n + promised > self.free:
            return None
        del self.parked[r.rid]
        self.free -= n
        self.host_free += n
        self.held[r.rid] = n
        self.ins += 1
        return [("in", r.rid, n)]


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("budget", [5, 9, 16])
def test_swapped_in_requests_are_charged_to_the_budget(budget, chunked):
    seed = SEED + budget + chunked
    print(f"seed={seed}")
    rng = random.Random(seed)
    mem = Swapping(BLOCKS, HOST)
    max_seqs = 8
    s = Scheduler(mem, max_seqs=max_seqs, token_budget=budget, chunked_prefill=chunked)
    top = budget - 1 if not chunked else 30        # a whole prompt must fit the budget
    reqs = [Req(i, rng.randint(1, top), rng.randint(1, 24)) for i in range(50)]
    pending, done, steps, together = list(reqs), [], 0, 0
    while pending or s:
        while pending and rng.random() < 0.4:
            s.waiting.append(pending.pop(0))
        plan = s.schedule()
        used = sum(c.tokens for c in plan.chunks) + len(plan.decodes)
        assert used <= budget, (steps, used, plan)
        assert len({id(c.req) for c in plan.chunks}) == len(plan.chunks)
        assert len(s.running) <= max_seqs
        back = {rid for _, pairs in plan.swap_ins for _, rid, _ in pairs}
        assert back <= {r.rid for r in s.running} | {r.rid for r in s.swapped}
        together += bool(back and plan.chunks)
        for r in plan.decodes:
            r.generated += 1
            if r.generated == r.output:
                s.finish(r)
                mem.release(r)
                done.append(r)
        assert sum(mem.held.values()) + mem.free == BLOCKS
        assert sum(mem.parked.values()) + mem.host_free == HOST
        assert set(mem.parked) == {r.rid for r in s.swapped}
        for r in s.running:
            assert mem.held[r.rid] == cdiv(r.placed, 4)
        steps += 1
        assert steps < 5_000, "the scheduler stopped making progress"
    assert sorted(r.rid for r in done) == list(range(50))
    assert all(r.generated == r.output for r in done)
    assert mem.free == BLOCKS and mem.host_free == HOST
    assert mem.outs > 0 and mem.ins == mem.outs       # it swapped, and all came back
    assert together > 0     # some steps swapped in and prefilled: the budget was shared


def test_a_swapped_in_request_takes_its_token_before_any_chunk():
    """One step by hand: a budget of 4, a swapped request that decodes and a waiting one
    with a prompt of 8: the swapped request comes back and decodes (1 token), the prompt
    gets the other 3; a budget of 1 leaves nothing for the prompt."""
    for budget, chunk in ((4, 3), (1, None)):
        mem = Swapping(20, 20)
        s = Scheduler(mem, token_budget=budget)
        a, b = Req(0, 4, 9), Req(1, 8, 3)
        a.placed, a.generated = 5, 1                  # prompt + one token: decodes
        mem.parked[a.rid], mem.host_free = 2, 18
        s.swapped.append(a)
        s.waiting.append(b)
        plan = s.schedule()
        assert plan.decodes == (a,) and [r for r, _ in plan.swap_ins] == [a]
        assert [c.tokens for c in plan.chunks] == ([chunk] if chunk else [])
        assert s.running == ([a, b] if chunk else [a])


def test_a_swapped_request_that_does_not_fit_the_budget_stays_out():
    """A request of width 1 swapped out: a step whose budget the decoders already take
    leaves it swapped (it is not brought back to run over the budget)."""
    mem = Swapping(20, 20)
    s = Scheduler(mem, token_budget=2)
    runners = [Req(i, 4, 9) for i in range(2)]
    for r in runners:                                  # two decoders: the whole budget
        r.placed, r.generated = 5, 1
        mem.held[r.rid] = 2
        mem.free -= 2
        s.running.append(r)
    a = Req(2, 4, 9)
    a.placed, a.generated = 5, 1
    mem.parked[a.rid], mem.host_free = 2, 18
    s.swapped.append(a)
    plan = s.schedule()
    assert plan.swap_ins == () and list(s.swapped) == [a]
    assert plan.decodes == tuple(runners)


def test_the_plan_holds_what_the_memory_placed():
    """A request placed in a step and preempted in it leaves the plan with its
    placements and is recomputed (its K/V were never computed: nothing to swap); the
    plan holds the others' placements, their decode rows and the preemption."""
    mem = Swapping(2, 20)                       # 8 tokens
    s = Scheduler(mem, token_budget=None)
    a, b, c = Req(0, 4, 3), Req(1, 3, 3), Req(2, 1, 1)
    s.waiting.extend([a, b, c])
    plan = s.schedule()
    assert plan.parts == ((a, (0, 4)),) and plan.rows == [(0, 1)]
    assert plan.decodes == (a,) and plan.preempted == (b,)
    assert plan.swap_outs == () and mem.outs == 0 and list(s.waiting) == [b, c]


def test_a_request_preempted_without_placements_is_swapped_out():
    """The victim (here the oldest running request) placed nothing this step while a
    newer one did: it is swapped out, not recomputed, and the plan says so."""
    mem = Swapping(3, 20)
    s = Scheduler(mem, token_budget=None, victim=lambda running: running[0])
    a, b = Req(0, 4, 5), Req(1, 4, 5)
    s.waiting.append(a)
    s.schedule()
    a.generated += 1
    s.waiting.append(b)
    plan = s.schedule()                          # b placed; a's growth preempts a
    assert plan.parts == ((b, (1, 4)),) and plan.preempted == (a,)
    assert plan.swap_outs == ((a, [("out", 0, 2)]),) and list(s.swapped) == [a]
    assert plan.decodes == (b,) and not s.waiting


def test_a_refused_swap_in_leaves_the_budget_to_the_prefills():
    """A swapped request that does not fit (memory, then max_seqs) stays out, and the
    prefill under way still gets its chunk of the budget."""
    for blocks, max_seqs in ((3, 4), (9, 1)):
        mem = Swapping(blocks, 20)
        s = Scheduler(mem, token_budget=8, max_seqs=max_seqs)
        p, q = Req(0, 12, 3), Req(1, 4, 3)
        assert mem._take(p, 4) is not None       # p: 4 of its 12 tokens placed
        s.running.append(p)
        s.prefilling[p] = None
        q.placed, q.generated = 9, 5
        mem.parked[q.rid], mem.host_free = 3, 17
        s.swapped.append(q)
        plan = s.schedule()
        assert plan.swap_ins == () and list(s.swapped) == [q]
        assert plan.chunks == (Chunk(p, 7, False),)


def test_swap_ins_stop_at_max_seqs():
    """Three swapped requests that all fit the memory; two may run at once: two come back,
    the most recently preempted first."""
    mem = Swapping(20, 20)
    s = Scheduler(mem, token_budget=None, max_seqs=2)
    reqs = [Req(i, 4, 9) for i in range(3)]
    for r in reqs:
        r.placed, r.generated = 5, 1
        mem.parked[r.rid] = 2
        mem.host_free -= 2
        s.swapped.append(r)
    plan = s.schedule()
    assert [r for r, _ in plan.swap_ins] == reqs[:2] and s.running == reqs[:2]
    assert list(s.swapped) == reqs[2:] and plan.decodes == tuple(reqs[:2])


# ------------------------------------------------------------------ the engine

STOP = (0,)


def _plans(engine):
    """Every plan the engine's scheduler makes, recorded as it is made."""
    made, schedule = [], engine.scheduler.schedule

    def record():
        made.append(schedule())
        return made[-1]
    engine.scheduler.schedule = record
    return made


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_the_engine_charges_swapped_in_requests(tiny, overlap):
    """Swap preemption under a token budget on the engine: no plan computes more tokens
    than the budget (its prefill parts' tokens plus its decode rows), some plans swap in,
    and every answer is the oracle's."""
    import numpy as np
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    prompts = [rng.integers(1, 96, int(n)).tolist() for n in rng.integers(4, 30, 6)]
    params = [SamplingParams(max_new_tokens=int(m), temperature=0.8, seed=i)
              if i % 2 else SamplingParams(max_new_tokens=int(m))
              for i, m in enumerate(rng.integers(10, 24, 6))]
    budget = 10
    engine = Engine(tiny, num_blocks=10, block_size=8, stop_ids=STOP, audit=True,
                    preemption="swap", host_blocks=64, token_budget=budget, max_seqs=6,
                    overlap=overlap, runner="fast-eager")
    plans = _plans(engine)
    reqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    for _ in range(2_000):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work(), "the engine still has work after 2,000 steps"
    for plan in plans:
        rows = len(plan.rows.seqs) if plan.rows is not None else 0
        assert sum(len(part.tokens) for _, part in plan.parts) + rows <= budget
    assert any(plan.swap_ins and plan.parts for plan in plans)
    for req, p, q in zip(reqs, prompts, params):
        assert [s.generated for s in req.outputs()] == \
            [s.generated for s in reference_generate(tiny, p, q, STOP)]
    assert engine.memory.manager.allocator.num_free == 10
    assert engine.memory.swapper.host.num_used == 0
