"""The engine's core (:mod:`pagedkv.serve.core`) and its client (:mod:`pagedkv.serve.client`)
over the tiny model's engine, in both transports (a thread of this process, and a process
of its own, as ``--engine thread`` and ``--engine process`` run them), without HTTP: a
request cancelled before the engine has answered it, failed steps apart and in a row, and
a stop. Faults are injected as the server tests inject them (``PAGEDKV_SERVE_FAIL_STEPS``,
``PAGEDKV_SERVE_STALL``); every wait is bounded and says what it waited for."""
from __future__ import annotations

import threading
import time

import pytest

from pagedkv.config import SamplingParams
from pagedkv.serve.client import EngineClient
from pagedkv.serve.core import EngineCore
from pagedkv.serve.messages import Answer, Cancel, Dead, PoolRead, ReadPool, StepFailed, \
    Stepped, Submit
from pagedkv.serve.models import ByteTokenizer
from pagedkv.serve.start import EngineSpec, make_engine
from pagedkv.serve.texts import Accepted, Delta, Done, Failed, Job, Rejected
from pagedkv.serve.transport import ProcessTransport, ThreadTransport

TOK = ByteTokenizer()
SPEC = EngineSpec.of("tiny", num_blocks=256, audit=True)
KINDS = ["thread", "process"]


class Events:
    def __init__(self):
        self.events, self.lock = [], threading.Lock()

    def __call__(self, events):
        with self.lock:
            self.events += events

    def wait(self, kind, what: str, deadline: float = 10.0):
        """The first event of ``kind``, within ``deadline`` seconds (else the test fails,
        naming ``what`` it waited for and the events that came)."""
        end = time.monotonic() + deadline
        while True:
            with self.lock:
                found = [e for e in self.events if isinstance(e, kind)]
            if found:
                return found[0]
            assert time.monotonic() < end, f"no {what} within {deadline} s: {self.events}"
            time.sleep(0.01)


def _job(n: int):
    events = Events()
    return Job(TOK.encode("hi"), SamplingParams(max_new_tokens=n, ignore_eos=True,
                                                temperature=0), events), events


def _client(kind: str, monkeypatch, on_dead=None, **env) -> EngineClient:
    """A started client over the tiny engine, in a thread or a process, the faults in
    ``env`` injected into its engine."""
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    transport = ThreadTransport(*make_engine(SPEC)) if kind == "thread" else \
        ProcessTransport(SPEC, log_level="WARNING")
    return EngineClient(transport, TOK, on_dead=on_dead).start(**(
        {} if kind == "thread" else {"timeout": 60}))


def _until(check, what: str, deadline: float):
    end = time.monotonic() + deadline
    while not (got := check()):
        assert time.monotonic() < end, f"not {what} within {deadline:g} s"
        time.sleep(0.01)
    return got


def _idle_pool(client, deadline: float) -> dict:
    """The pool (audited), once it holds nothing, within ``deadline`` seconds."""
    end, pool = time.monotonic() + deadline, None
    while time.monotonic() < end:
        pool = client.pool(audit=True).result(deadline)
        if pool["used"] == 0 and pool["running"] == pool["waiting"] == \
                pool["sequences"] == 0:
            assert pool["audit"] == "ok", pool
            return pool
        time.sleep(0.01)
    raise AssertionError(f"the pool did not empty within {deadline:g} s: {pool}")


@pytest.mark.parametrize("kind", KINDS)
def test_a_request_cancelled_before_its_answer_leaves_the_engine(kind, monkeypatch):
    """The engine is busy in a step (its third waits 1.5 s) when a request comes and its
    client goes away: the submit and its cancel reach the core together, before any
    answer. The engine drops it: the pool is idle within a second of the step's end, the
    request never ran (none of its 2,000 tokens was made), and its late answer is
    dropped."""
    client = _client(kind, monkeypatch, PAGEDKV_SERVE_STALL="3:1.5")
    try:
        running, _ = _job(2000)
        assert client.submit(running) is None
        _until(lambda: client.core_stats.get("steps", 0) >= 2, "two steps made", 10)
        time.sleep(0.2)                         # (the third step waits meanwhile)
        gone, events = _job(2000)
        assert client.submit(gone) is None and not gone.accepted
        client.cancel(gone)
        assert client.unanswered == 0 and gone.key not in client.jobs
        client.cancel(running)
        _idle_pool(client, 1.5 + 1.0)
        assert events.events == []              # (its answer came after it had gone)
        _until(lambda: client.core_stats["requests"] == 2, "the engine's beat", 3)
        assert client.core_stats["generated_tokens"] < 100, client.core_stats
        assert client.stats["cancelled"] == 2 and not client.jobs
    finally:
        client.stop()


def _fails_at(client, step: int) -> Failed:
    """Submit a request that runs into the failure injected at ``step``; its Failed
    event, which names that step."""
    job, events = _job(20)
    assert client.submit(job) is None
    failed = events.wait(Failed, f"the failure of step {step}")
    assert f"a failure injected at step {step}" in failed.message
    return failed


@pytest.mark.parametrize("kind", KINDS)
def test_failed_steps_with_good_steps_between_leave_the_engine_serving(kind, monkeypatch):
    """Steps 3 and 6 fail, with good steps between: each fails its request (500, naming
    the failure), and the engine serves on; only failures in a row kill it."""
    dead = []
    client = _client(kind, monkeypatch, on_dead=dead.append,
                     PAGEDKV_SERVE_FAIL_STEPS="3,6")
    try:
        for step in (3, 6):
            assert _fails_at(client, step).status == 500
            assert client.health() is None and client.dead is None
        job, events = _job(4)
        assert client.submit(job) is None
        done = events.wait(Done, "the answer after two failed steps")
        assert done.usage["completion_tokens"] == 4
        assert client.core_stats["failed_steps"] == 2 and client.stats["failed"] == 2
        assert not dead and client.health() is None
        _idle_pool(client, 5)
    finally:
        client.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_two_failed_steps_in_a_row_kill_the_engine(kind, monkeypatch):
    """Steps 2 and 3 fail: the engine is dead, ``on_dead`` hears why, health says so, a
    new request is refused at once (503), and a child process exits."""
    dead = []
    client = _client(kind, monkeypatch, on_dead=dead.append,
                     PAGEDKV_SERVE_FAIL_STEPS="2,3")
    try:
        for step in (2, 3):
            _fails_at(client, step)
        _until(lambda: dead, "dead", 5)
        assert dead == [client.dead] and "two engine steps failed in a row" in dead[0]
        assert client.health().startswith("the engine is not running: two engine steps")
        refused = client.submit(_job(2)[0])
        assert refused.status == 503 and "two engine steps failed" in refused.message
        _until(lambda: not client.transport.alive, "the engine's loop ended", 5)
    finally:
        client.stop()


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_ends_every_request_and_the_engine(kind, monkeypatch):
    """A stop: a running request gets 503 (shutting down), a new one is refused, and the
    engine's loop ends within the stop's time."""
    client = _client(kind, monkeypatch)
    job, events = _job(2000)
    assert client.submit(job) is None
    events.wait(Delta, "the first token")
    t = time.monotonic()
    client.stop(5)
    assert time.monotonic() - t < 5
    failed = events.wait(Failed, "the stop's error", 1)
    assert failed == Failed(503, "the server is shutting down")
    assert client.submit(_job(2)[0]).status == 503
    _until(lambda: not client.transport.alive, "the engine's loop ended", 5)
    assert client.stats["failed"] == 0          # (a stop fails nobody's request)


# ---------------------------------------------------------------------- the core alone

@pytest.fixture(scope="module")
def engine():
    engine, _ = make_engine(SPEC)
    return engine


def _logged(caplog, message: str) -> bool:
    return message in [r.getMessage() for r in caplog.records]


def _run_out(core, deadline: float = 10.0) -> list:
    end, out = time.monotonic() + deadline, []
    while core.busy():
        assert time.monotonic() < end, "the engine did not finish"
        out += core.step()
    return out


def test_the_core_answers_refuses_and_cancels(engine, caplog):
    """A submit is answered (200) or refused: 400 with the engine's reason, 429 past
    ``max_waiting``; a cancel takes the request out and frees its blocks, a cancel of an
    unknown key changes nothing; every message about a request names its key."""
    core = EngineCore(engine, max_waiting=2, pool_interval=0.0)
    params = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0)
    assert core.handle(Submit(1, [5, 6], params)) == Answer(1)
    too_long = SamplingParams(max_new_tokens=2048, ignore_eos=True)
    refused = core.handle(Submit(2, [5, 6], too_long))
    assert refused.key == 2 and refused.status == 400 and "exceed" in refused.message
    assert core.handle(Submit(5, [5, 6], too_long)).status == 400
    assert core.handle(Submit(3, [7], params)) == Answer(3)
    full = core.handle(Submit(4, [8], params))
    assert full.key == 4 and full.status == 429 and "at most 2" in full.message
    assert core.totals["rejected"] == 3 and core.totals["requests"] == 2
    assert core.handle(Cancel(3)) is None and 3 not in core.requests
    with caplog.at_level("ERROR", logger="pagedkv.serve"):
        assert core.handle(Cancel(99)) is None
    assert not caplog.records                       # (an unknown key is no failure)
    out = _run_out(core)
    assert all(isinstance(m, Stepped) for m in out)
    assert list(out[0].admitted) == [1]
    tokens = [t for m in out for key, updates, _, _ in m.reports for _, ts, _ in updates
              for t in ts if key == 1]
    assert len(tokens) == 5 and [k for k, *_ in out[-1].reports] == [1]
    assert out[-1].reports[0][3] is True                # its end is reported
    assert all(ts or ended for m in out for _, updates, _, _ in m.reports
               for _, ts, ended in updates)                # (nothing empty is sent)
    assert not core.requests and not engine.finished   # a server's list never grows
    pool = core.handle(ReadPool(7, audit=True))
    assert pool.token == 7 and pool.report["used"] == 0 and pool.report["audit"] == "ok"
    s = core.stats()
    assert s["generated_tokens"] == 5 and s["prompt_tokens"] == 3 and s["steps"] == len(out)


def test_a_failed_step_cancels_its_requests_and_a_good_step_resets_the_count(engine):
    """A failed step: StepFailed with every request's key, the requests gone, their
    blocks free and no Dead; a good step between two failures keeps the engine alive;
    two failures in a row add Dead, naming why."""
    core = EngineCore(engine)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=0)
    step, fails = engine.step, []

    def faulty():
        if fails and fails.pop(0):
            raise RuntimeError("broken by the test")
        return step()
    engine.step = faulty
    try:
        for good_between in (True, False):
            core.handle(Submit(1, [5, 6], params))
            core.handle(Submit(2, [7], params))
            fails[:] = [False, True]
            assert isinstance(core.step()[0], Stepped)
            out = core.step()
            assert isinstance(out[0], StepFailed) and sorted(out[0].keys) == [1, 2]
            assert "RuntimeError: broken by the test" in out[0].error
            assert not core.requests and engine.memory.manager.allocator.num_used == 0
            if good_between:
                assert len(out) == 1 and core.problem() is None
                core.handle(Submit(3, [5], params))
                fails[:] = [False, True]
                assert isinstance(core.step()[0], Stepped)      # a good step between
                assert len(core.step()) == 1                    # failed, not dead
            else:
                core.handle(Submit(4, [5], params))
                fails[:] = [True]
                out = core.step()
                assert isinstance(out[-1], Dead), out
                assert "two engine steps failed in a row" in out[-1].reason
                assert core.problem() == "two engine steps failed in a row"
        assert core.totals["failed_steps"] == 4
    finally:
        engine.step = step


def test_a_cancel_that_fails_after_a_failed_step_kills_the_engine(engine, caplog):
    """A failed step whose cancels fail too: the requests are dropped from the core all
    the same, the failure is logged, StepFailed carries the engine's numbers, and the
    engine is dead (its queues are not empty)."""
    core = EngineCore(engine)
    step, cancel = engine.step, engine.cancel
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("step broken"))
    engine.cancel = lambda req: (_ for _ in ()).throw(RuntimeError("cancel broken"))
    try:
        core.handle(Submit(1, [5, 6], SamplingParams(max_new_tokens=5)))
        with caplog.at_level("ERROR", logger="pagedkv.serve"):
            failed, dead = core.step()
        assert failed.keys == [1] and failed.stats["failed_steps"] == 1
        assert not core.requests
        assert _logged(caplog, "cancel after a failed step failed")
        assert dead.reason.startswith("requests are left in the engine's queues (after: "
                                      "the engine failed: RuntimeError: step broken)")
    finally:
        engine.step, engine.cancel = step, cancel
        for r in list(engine.scheduler.waiting):
            engine.cancel(r)
    assert not engine.has_work()


def test_a_pool_that_fails_its_audit_is_a_problem(engine, monkeypatch):
    """After a failed step, a pool whose audit fails is a reason the engine is dead,
    and the reason names the audit's error."""
    core = EngineCore(engine)
    assert core.problem() is None

    def audit():
        raise AssertionError("refcounts disagree")
    monkeypatch.setattr(engine.memory.manager, "audit", audit)
    assert core.problem() == "the pool's audit failed: AssertionError: refcounts disagree"


def test_a_stop_cancels_every_request(engine):
    """A stop takes every request out of the engine and frees its blocks."""
    core = EngineCore(engine)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True, temperature=0)
    core.handle(Submit(1, [5, 6], params))
    core.handle(Submit(2, [7], params))
    core.step()
    assert engine.memory.manager.allocator.num_used > 0
    core.stop()
    assert not core.requests and not engine.has_work()
    assert engine.memory.manager.allocator.num_used == 0


def test_the_loop_beats_while_idle_steps_while_busy_and_ends(engine):
    """run_core: idle, it waits up to ``beat`` seconds for a command and sends a Beat;
    busy, it takes what waits without waiting and steps; a Stop ends it (True), a dead
    engine ends it (False)."""
    from pagedkv.serve.core import run_core
    from pagedkv.serve.messages import Beat, Stop, Stopped
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0)
    script = [[], [Submit(1, [5], params)]]
    waits, sent = [], []

    def take(wait):
        waits.append(wait)
        return script.pop(0) if script else ([Stop()] if not engine.has_work() else [])
    assert run_core(EngineCore(engine), take, sent.append, beat=0.5) is True
    kinds = [type(m) for m in sent]
    assert kinds[:3] == [Beat, Answer, Stepped] and kinds[-1] is Stopped
    assert waits[:2] == [0.5, 0.5] and waits[2] is None
    assert kinds.count(Stepped) == 1 + waits.count(None) and waits.count(None) >= 1
    step = engine.step
    engine.step = lambda: (_ for _ in ()).throw(RuntimeError("broken"))
    script[:] = [[Submit(2, [5], params)], [Submit(3, [5], params)]]
    sent.clear()
    try:
        assert run_core(EngineCore(engine), take, sent.append, beat=0.5) is False
    finally:
        engine.step = step
    assert isinstance(sent[-1], Dead) and not engine.has_work()


def test_the_core_s_own_failures_fail_one_request_and_are_logged(engine, monkeypatch,
                                                                  caplog):
    """A submit that fails for a reason other than the request's is answered 500; a cancel
    that fails drops the request all the same; a pool read that fails answers its reader
    with the error; a step that fails is logged; each is logged by name; an unknown
    command is a TypeError naming it."""
    import pagedkv.serve.core as core_module
    core = EngineCore(engine)
    submit, cancel = engine.submit, engine.cancel
    with caplog.at_level("ERROR", logger="pagedkv.serve"):
        monkeypatch.setattr(engine, "submit", lambda *a: 1 / 0)
        answer = core.handle(Submit(1, [5], SamplingParams(max_new_tokens=2)))
        assert answer == Answer(1, 500, "the engine failed to take the request: division "
                                        "by zero")
        assert core.totals["rejected"] == 1 and _logged(caplog, "submit failed")
        core.handle(Submit(9, [5], SamplingParams(max_new_tokens=2)))
        assert core.totals["rejected"] == 2
        monkeypatch.setattr(engine, "submit", submit)
        core.handle(Submit(2, [5], SamplingParams(max_new_tokens=2)))
        monkeypatch.setattr(engine, "cancel", lambda req: 1 / 0)
        assert core.handle(Cancel(2)) is None and not core.requests
        assert _logged(caplog, "cancel failed")
        monkeypatch.setattr(engine, "cancel", cancel)
        engine.cancel(engine.scheduler.waiting[0])
        monkeypatch.setattr(core_module, "pool_report", lambda *a: 1 / 0)
        assert core.handle(ReadPool(5)) == PoolRead(5, error="ZeroDivisionError: division "
                                                             "by zero")
        assert _logged(caplog, "reading the pool failed")
        monkeypatch.setattr(engine, "step", lambda: 1 / 0)
        core.handle(Submit(3, [5], SamplingParams(max_new_tokens=2)))
        core.step()
        assert _logged(caplog, "engine step failed")
    with pytest.raises(TypeError, match="got int"):
        core.handle(7)


def test_a_request_that_asks_for_pool_maps_gets_them(engine):
    """``want_pool``: the answer carries the pool before the request runs (every block
    free), a step's report the pool seen from it (its own blocks 'm'), at most every
    ``pool_interval`` seconds; a request that does not ask gets none. The steps' time is
    counted."""
    core = EngineCore(engine, pool_interval=0.0)
    params = SamplingParams(max_new_tokens=4, ignore_eos=True, temperature=0)
    t = time.monotonic()
    answer = core.handle(Submit(1, [5, 6], params, want_pool=True))
    assert answer.pool == "." * engine.config.num_blocks
    assert core.handle(Submit(2, [7], params)).pool is None
    out = core.step()[0]
    newcomer = core.handle(Submit(4, [8], params, want_pool=True)).pool
    assert "o" in newcomer and set(newcomer) <= {".", "o"}    # the others' blocks
    pools = {key: pool for key, _, pool, _ in out.reports}
    assert pools[2] is None and "m" in pools[1] and set(pools[1]) <= {".", "m", "o"}
    assert pools[1].count("m") == len(engine.memory.manager.block_table(
        core.requests[1].req.live[0].seq_id))
    lazy = EngineCore(engine, pool_interval=3600.0)
    lazy.handle(Submit(3, [5], params, want_pool=True))
    lazy._pool_sent = time.monotonic()
    assert all(pool is None for _, _, pool, _ in lazy.step()[0].reports)
    lazy.stop()
    _run_out(core)
    assert 0 < core.totals["step_seconds"] < time.monotonic() - t


def test_the_steps_time_adds_up_over_steps(engine, monkeypatch):
    """``step_seconds`` is the sum of every step's time: on a clock that moves one second a
    reading (two readings a step), three steps count three seconds."""
    import pagedkv.serve.core as core_module
    ticks = iter(range(10**6))
    monkeypatch.setattr(core_module.time, "monotonic", lambda: float(next(ticks)))
    core = EngineCore(engine)
    core.handle(Submit(1, [5, 6], SamplingParams(max_new_tokens=8, ignore_eos=True)))
    for _ in range(3):
        core.step()
    assert core.totals["steps"] == 3 and core.totals["step_seconds"] == 3.0
    core.stop()


def test_forget_takes_the_request_out_of_finished_wherever_it_stands():
    """A finished request the server has answered leaves the engine's ``finished`` list
    (which would otherwise only grow), at any place in it; the others stay."""
    from types import SimpleNamespace as NS
    a, b, c = object(), object(), object()
    for before, after in (([a, b], [b]), ([b, a], [b]), ([a, c, b], [c, b]), ([c], [c])):
        engine = NS(finished=list(before))
        EngineCore(engine)._forget(a)
        assert engine.finished == after, before


def test_a_request_is_admitted_in_the_step_that_takes_it_from_the_queue():
    """With one sequence at a time, the second request waits: the first step's report
    admits the first request alone, and the second is admitted in the step that starts
    it, after the first has ended."""
    engine, _ = make_engine(EngineSpec.of("tiny", num_blocks=64, max_seqs=1))
    core = EngineCore(engine, pool_interval=0.0)
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0)
    core.handle(Submit(1, [5], params))
    core.handle(Submit(2, [6], params, want_pool=True))
    steps = _run_out(core)
    admitted = [m.admitted for m in steps]
    assert admitted[0] == {1: admitted[0][1]}
    (later,) = [i for i, a in enumerate(admitted) if 2 in a]
    assert later > 0 and list(admitted[later]) == [2]
    assert all(not a for i, a in enumerate(admitted) if i not in (0, later))
    for m in steps[:later]:         # 2 waits: reported for its maps alone
        (news,) = [(updates, pool) for key, updates, pool, _ in m.reports if key == 2]
        assert news[0] == [] and news[1] is not None
    core.handle(Submit(3, [5], params))
    core.handle(Submit(4, [6], params))
    steps = _run_out(core)
    assert all(4 not in [key for key, *_ in m.reports] for m in steps[:2])
    assert any(4 in [key for key, *_ in m.reports] for m in steps)


def test_news_are_each_sequence_s_new_tokens_and_its_end_once():
    """What a step reports of a request: for each sequence, by id, the tokens not sent
    yet and whether it ended; an ended sequence once, nothing for one with nothing new."""
    from types import SimpleNamespace as NS

    from pagedkv.model.requests import Sequence
    from pagedkv.serve.core import _Running
    core = EngineCore(NS(finished=[]))
    s0, s1, s2 = (Sequence(i, [5, 6], prompt_len=2) for i in range(3))   # a 2-token prompt
    req = NS(live=[s2, s1], finished=[s0])
    r = _Running(req, False)
    s0.tokens += [7, 8]
    s1.tokens += [9]
    assert core._news(r) == [(0, [7, 8], True), (1, [9], False)]
    s1.tokens += [10]
    req.live, req.finished = [s2], [s0, s1]
    assert core._news(r) == [(1, [10], True)]
    s2.tokens += [11]
    assert core._news(r) == [(2, [11], False)]     # (a lone live sequence: the short way)
    assert core._news(r) == []
    s2.tokens += [12, 13]
    assert core._news(r) == [(2, [12, 13], False)]
    assert core.totals["generated_tokens"] == 7
