"""The engine's client and its text half without a server: the watchdog, the order of a
submit and its cancel, the stream interval, the timings; and the client over a thread of
the tiny model's engine, as the HTTP layer uses it."""
from __future__ import annotations

import time

import pytest

from pagedkv.config import SamplingParams
from pagedkv.serve.client import EngineClient
from pagedkv.serve.messages import Answer, Beat, Cancel, Dead, Stepped, Stop, Submit
from pagedkv.serve.models import ByteTokenizer
from pagedkv.serve.texts import (Accepted, Delta, Done, Failed, Job, Rejected, Texts,
                                 timings)

from _serving import Events, Silent

TOK = ByteTokenizer()


def _job(n=4, stream=True, stop=()):
    events = Events()
    return Job(TOK.encode("hi"), SamplingParams(max_new_tokens=n, ignore_eos=True), events,
               stop, stream=stream), events


def test_a_silent_engine_is_stalled_and_everyone_hears_it():
    """No word from the core for stall_timeout: health says why, the unanswered job is
    refused with 503 and its cancel follows its submit; a new submit is refused at once;
    the first word from the core ends the stall."""
    t = Silent()
    client = EngineClient(t, TOK, stall_timeout=0.3).start()
    try:
        job, events = _job()
        assert client.submit(job) is None and client.health() is None
        assert events.got.wait(2), "the watchdog did not answer"
        assert events.events == [Rejected(503, events.events[0].message)]
        assert "no progress for 0.3" in events.events[0].message
        assert [type(m) for m in t.sent] == [Submit, Cancel] and t.sent[1].key == job.key
        assert "no progress" in client.health()
        refused = client.submit(_job()[0])
        assert refused.status == 503 and "no progress" in refused.message
        assert client.stats["stalled"] and client.stats["rejected"] == 1
        t.receive(Beat({"rejected": 0}, time.monotonic()))
        assert client.health() is None and not client.stats["stalled"]
        t.receive(Answer(job.key))          # the late answer of the cancelled job
        assert not client.jobs
    finally:
        client.stop()


def test_a_running_job_gets_a_503_when_the_engine_stalls():
    t = Silent()
    client = EngineClient(t, TOK, stall_timeout=0.3).start()
    try:
        job, events = _job()
        client.submit(job)
        t.receive(Answer(job.key))
        t.receive(Stepped([(job.key, [(0, [5], False)], None, False)], {job.key: 1.0},
                          {}, time.monotonic()))
        events.got.clear()
        assert events.got.wait(2)
        assert isinstance(events.events[-1], Failed) and events.events[-1].status == 503
        assert client.stats["failed"] == 1
    finally:
        client.stop()


def test_a_cancel_before_the_answer_is_not_lost():
    """The client goes away before the engine has answered: the cancel is sent after the
    submit (the core takes them in order), and the answer that comes later is dropped."""
    t = Silent()
    client = EngineClient(t, TOK, stall_timeout=30).start()
    try:
        job, events = _job()
        client.submit(job)
        client.cancel(job)
        assert [type(m) for m in t.sent] == [Submit, Cancel]
        assert t.sent[0].key == t.sent[1].key == job.key
        t.receive(Answer(job.key))
        assert not events.events and not client.jobs and client.unanswered == 0
        client.cancel(job)                  # twice: nothing more is sent
        assert len(t.sent) == 2
    finally:
        client.stop()
    assert isinstance(t.sent[-1], Stop)


def test_too_many_unanswered_are_refused_at_once():
    """Past max_waiting unanswered submits a new one is refused at once (503), and each
    refusal is counted; a submit carries the job's want_pool."""
    t = Silent()
    client = EngineClient(t, TOK, max_waiting=2, stall_timeout=30).start()
    try:
        for _ in range(2):
            assert client.submit(_job()[0]) is None
        refused = client.submit(_job()[0])
        assert refused.status == 503 and "at most 2: --max-waiting" in refused.message
        client.submit(_job()[0])
        assert client.stats["rejected"] == 2
        job, _ = _job()
        job.want_pool = True
        t.receive(Answer(t.sent[0].key))
        client.submit(job)
        assert t.sent[-1] == Submit(job.key, job.prompt, job.params, True)
    finally:
        client.stop()


def test_a_dead_engine_fails_every_job_with_503():
    t = Silent()
    dead = []
    client = EngineClient(t, TOK, on_dead=dead.append).start()
    running, r_events = _job()
    waiting, w_events = _job()
    client.submit(running)
    client.submit(waiting)
    t.receive(Answer(running.key))
    t.receive(Dead("a test killed it"))
    assert r_events.events[-1] == Failed(503, "the engine is not running: a test killed it")
    assert w_events.events[-1].status == 503 and isinstance(w_events.events[-1], Rejected)
    assert dead == ["a test killed it"]
    assert client.submit(_job()[0]).status == 503
    client.stop()


def _deltas(interval, tokens, stream=True, stop=()):
    texts = Texts(TOK, [0], interval)
    job, _ = _job(len(tokens), stream, stop)
    out, sizes = [], []
    for i, t in enumerate(tokens):
        before = len(out)
        texts.advance(job, [(0, [t], i == len(tokens) - 1)], out)
        sizes.append(len(out) - before)
    return out, sizes


@pytest.mark.parametrize("interval", [1, 3, 8])
def test_a_stream_sends_every_interval_tokens_its_first_at_once(interval):
    """The first text goes at once (the time to the first token does not change), then a
    delta every ``interval`` tokens, and the end at once; the text is the same."""
    tokens = TOK.encode_text("abcdefghijklmnopq")
    out, sizes = _deltas(interval, tokens)
    assert "".join(d.text for d in out) == "abcdefghijklmnopq"
    assert sizes[0] == 1 and out[0].text == "a"
    sent_at = [i for i, n in enumerate(sizes) if n]
    assert sent_at == sorted({0, *range(interval, len(tokens), interval), len(tokens) - 1})
    assert out[-1].finish_reason == "length"


def test_a_stream_interval_still_holds_back_a_stop_string():
    tokens = TOK.encode_text("abcdefgh")
    out, _ = _deltas(4, tokens, stop=("efg",))
    assert "".join(d.text for d in out) == "abcd" and out[-1].finish_reason == "stop"


def test_timings_add_up():
    job, _ = _job()
    job.arrived, job.admitted, job.first, job.last = 10.0, 10.5, 11.0, 13.0
    job.choices = {0: type("C", (), {"tokens": 5})()}
    t = timings(job, now=13.25)
    assert (t["queued_ms"], t["prefill_ms"], t["decode_ms"], t["total_ms"]) == \
        (500.0, 500.0, 2000.0, 3250.0)
    assert t["decode_tokens_per_s"] == 2.0 and t["completion_tokens"] == 5


def test_the_client_over_a_thread_of_the_tiny_engine():
    """The tiny model in this process: a job's events come as lists, the last ends with
    Done, whose usage and timings agree; a second job is cancelled mid-answer and its
    blocks come back."""
    from pagedkv.model.blas import single_thread_blas
    from pagedkv.serve.start import EngineSpec, make_engine
    from pagedkv.serve.transport import ThreadTransport
    single_thread_blas()
    spec = EngineSpec.of("tiny", num_blocks=64, audit=True)
    client = EngineClient(ThreadTransport(*make_engine(spec)), TOK).start()
    try:
        job, events = _job(12)
        assert client.submit(job) is None
        end = time.monotonic() + 30
        while not any(isinstance(e, Done) for e in events.events):
            assert time.monotonic() < end, events.events
            time.sleep(0.01)
        assert isinstance(events.events[0], Accepted)
        done = events.events[-1]
        text = "".join(e.text for e in events.events if isinstance(e, Delta))
        assert len(text) == done.usage["completion_tokens"] == 12
        t = done.timings
        assert t["completion_tokens"] == 12 and t["prompt_tokens"] == len(TOK.encode("hi"))
        assert t["queued_ms"] >= 0 and t["prefill_ms"] > 0 and t["decode_ms"] > 0
        long, events = _job(900)
        client.submit(long)
        while not any(isinstance(e, Delta) for e in events.events):
            assert time.monotonic() < end
            time.sleep(0.01)
        client.cancel(long)
        pool = client.pool(audit=True).result(10)
        while pool["used"]:
            assert time.monotonic() < end, pool
            pool = client.pool(audit=True).result(10)
        assert pool["audit"] == "ok" and client.stats["cancelled"] == 1
        assert client.stats["finished"] == 1
    finally:
        client.stop()


def test_the_engine_spec_leaves_the_machines_choices_to_where_the_model_runs():
    """The command line's 0 and "auto" are left open in the spec (a frozen value that
    crosses to the engine's process) and decided by resolve: on a CPU 256 blocks, 32
    sequences, the plain runner; the stop token is the model's; what is given is kept."""
    import pickle

    from pagedkv.errors import ConfigError
    from pagedkv.serve.__main__ import engine_spec, parser
    from pagedkv.serve.models import load
    from pagedkv.serve.start import EngineSpec
    spec = engine_spec(parser().parse_args(["--model", "tiny", "--prefix-caching",
                                            "--token-budget", "512"]))
    assert spec == EngineSpec.of("tiny", num_blocks=0, max_seqs=0, runner="auto",
                                 block_size=16, prefix_caching=True, audit=False,
                                 token_budget=512, chunked_prefill=True)
    assert spec.auto == {"num_blocks", "max_seqs", "runner"}
    assert pickle.loads(pickle.dumps(spec)) == spec
    served = load("tiny", model=False)
    c = spec.resolve(served, gpu=False)
    assert (c.num_blocks, c.max_seqs, c.runner, c.bookkeeping) == (256, 32, "plain",
                                                                    "teaching")
    assert c.stop_ids == (served.tokenizer.eos_id,) and c.prefill_chunk == 512
    assert c.prefix_caching and c.token_budget == 512
    given = EngineSpec.of("tiny", num_blocks=100, max_seqs=4, runner="fast")
    c = given.resolve(served, gpu=False)
    assert (c.num_blocks, c.max_seqs, c.runner, c.bookkeeping) == (100, 4, "fast", "fast")
    with pytest.raises(ConfigError, match="the model must be 'smollm2' or 'tiny'"):
        EngineSpec.of("gpt-4")
    with pytest.raises(ConfigError, match="block_size"):
        EngineSpec.of("tiny", block_size=0)


def test_the_core_s_news_become_each_job_s_events():
    """Over a silent transport the test speaks for the core: a refusal ends its job
    (Rejected, no longer waiting); an accepted job gets its deltas and Done; a stop
    string ends a job before its sequence does, and its cancel is sent; a failed step
    fails the jobs in it (500) and only those; text that cannot be made fails its job
    (500) and cancels it; a word after a stall ends the stall."""
    from pagedkv.serve.messages import StepFailed
    t = Silent()
    client = EngineClient(t, TOK, stall_timeout=30).start()
    try:
        refused, r_events = _job()
        client.submit(refused)
        assert client.unanswered == 1
        t.receive(Answer(refused.key, 429, "too many"))
        assert r_events.events == [Rejected(429, "too many")]
        assert client.unanswered == 0 and refused.key not in client.jobs
        whole, w_events = _job(2)
        stopped, s_events = _job(8, stop=("c",))
        failing, f_events = _job()
        other, o_events = _job()
        for job in (whole, stopped, failing, other):
            client.submit(job)
            t.receive(Answer(job.key))
            assert job.accepted
        assert client.unanswered == 0
        a, b, c = TOK.encode_text("abc")
        t.receive(Stepped([(whole.key, [(0, [a, b], True)], None, True),
                           (stopped.key, [(0, [a, b, c], False)], None, False)],
                          {whole.key: 1.0}, {"steps": 7}, time.monotonic()))
        assert client.core_stats == {"steps": 7} and whole.admitted == 1.0
        assert "".join(e.text for e in w_events.events if isinstance(e, Delta)) == "ab"
        assert isinstance(w_events.events[-1], Done)
        assert "".join(e.text for e in s_events.events if isinstance(e, Delta)) == "ab"
        assert s_events.events[-2].finish_reason == "stop"
        assert isinstance(s_events.events[-1], Done)
        assert Cancel(stopped.key) in t.sent and Cancel(whole.key) not in t.sent
        assert client.stats["finished"] == 2 and set(client.jobs) == {failing.key,
                                                                      other.key}
        t.receive(StepFailed([failing.key], "the engine failed: boom", {"steps": 8}))
        assert f_events.events[-1] == Failed(500, "the engine failed: boom")
        assert client.stats["failed"] == 1 and set(client.jobs) == {other.key}
        assert not any(isinstance(e, Failed) for e in o_events.events)
        client.texts.tokenizer = None               # decoding now fails
        t.receive(Stepped([(other.key, [(0, [a], False)], None, False)], {}, {},
                          time.monotonic()))
        assert o_events.events[-1].status == 500
        assert "the server failed on this request" in o_events.events[-1].message
        assert Cancel(other.key) in t.sent and not client.jobs
        assert client.stats["failed"] == 2 and client.health() is None
    finally:
        client.stop()


def test_dead_and_stopping_are_said_once(caplog):
    """A second Dead changes nothing (on_dead is called once, and a failing on_dead is
    logged); jobs ended by a death count as failed when they were running, refused when
    not; pool reads waiting get the reason; a stop is asked once, and then health says
    the server is shutting down; the watchdog takes neither for a stall."""
    caplog.set_level("ERROR", logger="pagedkv.serve")
    t = Silent()
    calls = []

    def on_dead(reason):
        calls.append(reason)
        raise RuntimeError("the supervisor's hook failed")
    client = EngineClient(t, TOK, on_dead=on_dead).start()
    running, r_events = _job()
    waiting, w_events = _job()
    client.submit(running)
    client.submit(waiting)
    t.receive(Answer(running.key))
    pool = client.pool()
    with caplog.at_level("ERROR", logger="pagedkv.serve"):
        t.receive(Dead("first"))
        t.receive(Dead("second"))
    assert calls == ["first"] and client.dead == "first"
    assert "on_dead failed" in caplog.text
    assert r_events.events[-1] == Failed(503, "the engine is not running: first")
    assert w_events.events[-1] == Rejected(503, "the engine is not running: first")
    assert client.stats["failed"] == 1 and not client.jobs and client.unanswered == 0
    with pytest.raises(RuntimeError, match="the engine is not running: first"):
        pool.result(1)
    assert not any(isinstance(m, Cancel) for m in t.sent)     # (nobody to tell)
    time.sleep(0.3)                                 # the watchdog looks on: says nothing
    assert "in flight fail" not in caplog.text
    client.stop()
    t = Silent()
    client = EngineClient(t, TOK).start()
    job, events = _job()
    client.submit(job)
    t.receive(Answer(job.key))
    client.request_stop()
    client.request_stop()
    assert [type(m) for m in t.sent] == [Submit, Stop]
    time.sleep(0.3)
    assert "in flight fail" not in caplog.text
    assert client.health() == "the server is shutting down"
    assert events.events[-1] == Failed(503, "the server is shutting down")
    assert client.stats["failed"] == 0          # a stop fails nobody's request
    client.stop()


def test_a_stall_is_said_once_and_its_end_too(caplog):
    """The watchdog ends the jobs in flight once when the engine stalls, says so once in
    the log, and the first word from the core ends the stall (logged too)."""
    t = Silent()
    client = EngineClient(t, TOK, stall_timeout=0.2).start()
    try:
        with caplog.at_level("WARNING", logger="pagedkv.serve"):
            job, events = _job()
            client.submit(job)
            assert events.got.wait(2), "the watchdog did not answer"
            time.sleep(0.3)                     # more looks of the watchdog
            assert caplog.text.count("requests in flight fail") == 1
            (said,) = [r.getMessage() for r in caplog.records if "flight" in r.getMessage()]
            assert said.startswith("the engine has made no progress for ")
            assert said.endswith(" s (--stall-timeout 0.2): 1 requests in flight fail")
            assert [type(m) for m in t.sent] == [Submit, Cancel]
            t.receive(Beat({}, time.monotonic()))
            assert "the engine is making progress again" in \
                [r.getMessage() for r in caplog.records]
            assert client.health() is None
            again, events = _job()
            client.submit(again)                # a second stall is said again
            assert events.got.wait(2), "the watchdog did not answer the second stall"
            time.sleep(0.1)
            assert caplog.text.count("requests in flight fail") == 2
    finally:
        client.stop()


def test_pool_maps_and_failures_reach_their_jobs(caplog):
    """A pool map in an answer or a step's report becomes the job's PoolMap event (none
    without one); a failed step's numbers replace the client's, and a failed step
    naming a job that has gone is ignored; failures are logged naming the job or the
    engine's reason."""
    from pagedkv.serve.messages import StepFailed
    from pagedkv.serve.texts import PoolMap
    t = Silent()
    client = EngineClient(t, TOK, on_dead=lambda reason: 1 / 0).start()
    try:
        mapped, m_events = _job()
        plain, p_events = _job()
        for job in (mapped, plain):
            client.submit(job)
        t.receive(Answer(mapped.key, pool="..mm"))
        t.receive(Answer(plain.key))
        assert m_events.events == [Accepted("..mm"), PoolMap("..mm")]
        assert p_events.events == [Accepted(None)]
        a = TOK.encode_text("a")[0]
        t.receive(Stepped([(mapped.key, [(0, [a], False)], ".mmm", False),
                           (plain.key, [(0, [a], False)], None, False)], {}, {},
                          time.monotonic()))
        assert m_events.events[2] == PoolMap(".mmm")
        assert not any(isinstance(e, PoolMap) for e in p_events.events)
        t.receive(StepFailed([99, plain.key], "boom", {"failed_steps": 1}))
        assert client.core_stats == {"failed_steps": 1}
        client.texts.tokenizer = None
        with caplog.at_level("ERROR", logger="pagedkv.serve"):
            t.receive(Stepped([(mapped.key, [(1, [a], False)], None, False)], {}, {},
                              time.monotonic()))
            t.receive(Dead("gone"))
        messages = [r.getMessage() for r in caplog.records]
        assert f"request {mapped.key} failed" in messages
        assert "the engine is dead: gone" in messages and "on_dead failed" in messages
    finally:
        client.stop()


def test_an_idle_engine_that_stalls_is_said_once(caplog):
    """With nothing in flight, a stall is still logged, once."""
    t = Silent()
    with caplog.at_level("ERROR", logger="pagedkv.serve"):
        client = EngineClient(t, TOK, stall_timeout=0.2).start()
        try:
            end = time.monotonic() + 2
            while "in flight fail" not in caplog.text:
                assert time.monotonic() < end, "the stall was not logged"
                time.sleep(0.02)
            time.sleep(0.3)
            assert caplog.text.count("0 requests in flight fail") == 1
        finally:
            client.stop()


def test_a_failure_after_a_job_ended_fails_it_once(monkeypatch):
    """Making a job's timings fails after the job has left the client: it gets one 500
    error, and the client serves on."""
    import pagedkv.serve.client as client_module
    t = Silent()
    client = EngineClient(t, TOK).start()
    try:
        job, events = _job(1)
        client.submit(job)
        t.receive(Answer(job.key))
        monkeypatch.setattr(client_module, "timings", lambda *a: 1 / 0)
        a = TOK.encode_text("a")[0]
        t.receive(Stepped([(job.key, [(0, [a], True)], None, True)], {}, {},
                          time.monotonic()))
        assert events.events[-1] == Failed(500, "the server failed on this request: "
                                                "division by zero")
        assert not client.jobs and client.health() is None
    finally:
        client.stop()
