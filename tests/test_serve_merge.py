"""Steps read together: a reader that fell behind the engine's process hands several steps
on as one (:func:`pagedkv.serve.messages.merged`), and every job's text is what it would
have been a step at a time."""
from __future__ import annotations

import random

from pagedkv.config import SamplingParams
from pagedkv.serve import transport as transport_mod
from pagedkv.serve.client import EngineClient
from pagedkv.serve.messages import Answer, Beat, Stepped, Stopped, merged
from pagedkv.serve.models import ByteTokenizer
from pagedkv.serve.texts import Delta, Done, Job

from _serving import Events, Silent

SEED = 20261208
TOK = ByteTokenizer()


def _step(reports, admitted=None, stats=None, at=0.0):
    return Stepped(reports, admitted or {}, stats or {}, at)


def test_only_consecutive_steps_are_joined():
    s1, s2, s3 = (_step([(1, [(0, [10 + i], False)], None, False)]) for i in range(3))
    a, b = Answer(7), Beat({}, 0.0)
    out = merged([a, s1, s2, b, s3])
    assert out[0] is a and out[2] is b and out[3] is s3      # a lone step is left as it is
    assert out[1].reports == [(1, [(0, [10, 11], False)], None, False)]
    assert merged([]) == [] and merged([s1]) == [s1]


def test_a_request_s_news_from_several_steps_as_one():
    """Tokens joined a sequence, ended as the last step says; a sequence or a request
    first heard of later comes after the others; the newest pool map; done if it ended
    in any step; each admission at its first time; the last step's numbers."""
    s1 = _step([(1, [(0, [1], False)], "map1", False), (2, [(0, [5], False)], None, False)],
               admitted={1: 1.0}, stats={"steps": 1}, at=1.0)
    s2 = _step([(1, [(0, [2, 3], True), (1, [9], False)], None, False),
                (2, [(0, [6], True)], None, True), (3, [(0, [7], False)], "map3", False)],
               admitted={1: 2.0, 3: 2.0}, stats={"steps": 2}, at=2.0)
    s3 = _step([(1, [(1, [], True)], "map1b", True),
                (2, [], None, False)],            # (news the core never sends after done)
               stats={"steps": 3}, at=3.0)
    (one,) = merged([s1, s2, s3])
    assert one.reports == [(1, [(0, [1, 2, 3], True), (1, [9], True)], "map1b", True),
                           (2, [(0, [5, 6], True)], None, True),
                           (3, [(0, [7], False)], "map3", False)]
    assert one.admitted == {1: 1.0, 3: 2.0}
    assert one.stats == {"steps": 3} and one.at == 3.0
    assert s1.reports[0][1] == [(0, [1], False)]           # the steps themselves unchanged


def _script(rng, jobs):
    """Steps for ``jobs`` requests: each of one or two sequences, 0-3 tokens a step (a
    step that guessed gives several), its end a step with ``ended``; token ids of
    letters, and now and then the end token (0) last."""
    left = {k: {sid: rng.randint(1, 12) for sid in range(rng.choice((1, 2)))}
            for k in range(jobs)}
    steps = []
    while any(left.values()):
        reports = []
        for key, seqs in left.items():
            ups = []
            for sid in sorted(seqs):
                if rng.random() < 0.3:
                    continue
                n = min(seqs[sid], rng.randint(0, 3))
                seqs[sid] -= n
                toks = [rng.randint(97, 122) for _ in range(n)]
                ended = seqs[sid] == 0
                if ended and toks and rng.random() < 0.3:
                    toks[-1] = 0                    # the end token
                if ended:
                    del seqs[sid]
                ups.append((sid, toks, ended))
            if ups:
                reports.append((key, ups, None, not seqs))
        left = {k: s for k, s in left.items() if s}
        steps.append(_step(reports))
    return steps


def _texts(steps, jobs, widths, groups, stops, interval):
    """Each job's text and end, per choice, through a client given ``groups`` of steps."""
    client = EngineClient(Silent(), TOK, stream_interval=interval).start()
    sinks = []
    for key in range(jobs):
        sink = Events()
        job = Job(TOK.encode("hi"), SamplingParams(max_new_tokens=64, n=widths[key],
                                                     temperature=0.7),
                  sink, stops[key])
        client.submit(job)
        client.receive(Answer(job.key))
        sinks.append(sink)
    i = 0
    for size in groups:
        for message in merged(steps[i:i + size]):
            client.receive(message)
        i += size
    out = []
    for sink in sinks:
        texts, reasons = {}, {}
        for ev in sink.events:
            if isinstance(ev, Delta):
                texts[ev.index] = texts.get(ev.index, "") + ev.text
                reasons[ev.index] = ev.finish_reason or reasons.get(ev.index)
        done = [ev for ev in sink.events if isinstance(ev, Done)]
        out.append((texts, reasons, len(done),
                    done[0].usage if done and not stops[len(out)] else None))
    return out


def test_joined_steps_give_every_job_the_same_text():
    """Random steps (seed printed) read a step at a time and in random groups: the same
    text, finish reasons and one end for every job; the same usage where no stop string
    cuts the answer (where one does, the tokens after it in a joined step count too)."""
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    for trial in range(40):
        jobs = rng.randint(1, 6)
        steps = _script(rng, jobs)
        widths = [max([sid for s in steps for k, ups, _, _ in s.reports if k == key
                       for sid, _, _ in ups], default=0) + 1 for key in range(jobs)]
        stops = [rng.choice(((), ("q",), ("ab", "z"))) for _ in range(jobs)]
        interval = rng.choice((1, 3))
        one_by_one = _texts(steps, jobs, widths, [1] * len(steps), stops, interval)
        groups, left = [], len(steps)
        while left:
            groups.append(min(left, rng.randint(1, 5)))
            left -= groups[-1]
        assert _texts(steps, jobs, widths, groups, stops, interval) == one_by_one, \
            (trial, groups)
        assert all(ends == 1 for _, _, ends, _ in one_by_one)


class Pipe:
    """The reader's end of a pipe with ``messages`` in it."""

    def __init__(self, messages):
        self.messages = list(messages)

    def recv(self):
        return self.messages.pop(0)

    def poll(self, timeout=0.0):
        return bool(self.messages)


def test_the_reader_hands_on_what_waits_in_the_pipe_joined(monkeypatch):
    """The process transport's reader takes what waits (at most READ_AT_ONCE messages)
    and hands consecutive steps on as one; it stops after Stopped."""
    steps = [_step([(1, [(0, [100 + i], False)], None, False)]) for i in range(3)]
    for at_once, want in ((64, [[100, 101, 102]]), (2, [[100, 101], [102]])):
        monkeypatch.setattr(transport_mod, "READ_AT_ONCE", at_once)
        t = transport_mod.ProcessTransport(None)
        t._conn = Pipe([*steps, Stopped()])
        got = []
        t._read(got.append)
        assert [m.reports[0][1][0][1] for m in got[:-1]] == want
        assert isinstance(got[-1], Stopped) and not t._conn.messages
