"""Engine behaviours issue 44 asks the suite to pin down, each on the tiny model, on the
CPU, in about a second, against the contiguous-cache oracle where tokens are compared:

* ``min_tokens`` holds with the device running a step ahead (``overlap=True``) for a request
  whose end token would come early (found, as the engine's other tests find it, as the
  first new token of a run without end tokens), greedy and sampled;
* ``min_tokens == max_new_tokens`` is accepted and runs: every token, none of them an end;
* a completion that fills the context exactly is admitted and runs to its end; one more
  token is refused when submitted;
* admission keeps the watermark free in a pool small enough for it to matter;
* a step that fails with swap preemption in flight, and a cancel that fails, leave the pool
  audited clean (see those tests for what "clean" means).
"""
from dataclasses import replace

import numpy as np
import pytest

from pagedkv.errors import AuditError, ConfigError
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from _engine_cases import drain as _drain, generate as _generate
from _tiny import TINY

single_thread_blas()

SEED = 4444
STOP = (0,)
GREEDY = SamplingParams(max_new_tokens=16)
SAMPLED = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.9, seed=7)
KINDS = {"greedy": GREEDY, "sampled": SAMPLED}


def _prompts(seed=SEED, lengths=(17, 5, 29, 11)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]


def _first_new(tokens):
    """(position, id) of the first generated id, after the first, not seen before it."""
    for i, t in enumerate(tokens):
        if i >= 1 and t not in tokens[:i]:
            return i, t
    raise AssertionError(f"no new id in {tokens}")


def _oracle(model, prompt, params, stops):
    return [s.generated for s in reference_generate(model, prompt, params, stops)]


def _answers(req):
    return [s.generated for s in req.outputs()]


def _engine(model, **kw):
    return Engine(model, **({"num_blocks": 200, "block_size": 8, "audit": True,
                             "runner": "fast-eager"} | kw))


def _early_stop(model, prompt, params):
    """An end token the request would draw early: the first new token of its answer in
    an engine without end tokens, and where it comes."""
    free = _engine(model, stop_ids=())
    best = _generate(free, [prompt], params)[0].outputs()[0].generated
    i, stop = _first_new(best)
    assert i < params.max_new_tokens // 2
    return i, stop, best


# ------------------------------------------------------------------ min_tokens, ahead

@pytest.mark.parametrize("kind", list(KINDS))
def test_min_tokens_holds_with_the_device_a_step_ahead(tiny, kind):
    """With depth 1 a step is planned before the one before it lands: the ban must count
    the tokens on their way. The request beside another one, both ahead: without
    min_tokens it ends at the early end token; with it, no end token among its first
    min_tokens and the end token at the first place it is allowed (this model draws it
    again there: a ban one token too long or too short changes the answer), and every
    answer is the oracle's."""
    params, prompts = KINDS[kind], _prompts()[:2]
    i, stop, best = _early_stop(tiny, prompts[0], params)
    engine = _engine(tiny, stop_ids=(stop,), overlap=True)
    assert engine.depth == 1
    (early,) = _generate(engine, prompts[:1], params)
    assert _answers(early) == [best[:i + 1]]               # it would end early
    m = i + 1                  # the model draws the end token again right after the ban
    held = replace(params, min_tokens=m)
    reqs = [engine.submit(prompts[0], held), engine.submit(prompts[1], params)]
    _drain(engine)
    got = _answers(reqs[0])[0]
    assert stop not in got[:m] and got[m] == stop and len(got) == m + 1
    assert _answers(reqs[0]) == _oracle(tiny, prompts[0], held, (stop,))
    assert _answers(reqs[1]) == _oracle(tiny, prompts[1], params, (stop,))
    assert engine.memory.manager.allocator.num_free == 200


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_min_tokens_equal_to_max_new_tokens_runs(tiny, kind, overlap):
    """``min_tokens == max_new_tokens`` is a valid request: every token is drawn with the
    end token banned, so the answer has all of them and none is the end token."""
    params, prompt = KINDS[kind], _prompts()[0]
    i, stop, _ = _early_stop(tiny, prompt, params)
    full = replace(params, min_tokens=params.max_new_tokens)
    assert full.min_tokens == full.max_new_tokens == 16
    engine = _engine(tiny, stop_ids=(stop,), overlap=overlap)
    (req,) = _generate(engine, [prompt], full)
    (got,) = _answers(req)
    assert len(got) == 16 and stop not in got
    assert [got] == _oracle(tiny, prompt, full, (stop,))


# ------------------------------------------------------------------ the context

@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
@pytest.mark.parametrize("runner, context", [("plain", TINY.context), ("fast-eager", 64)])
def test_a_completion_that_fills_the_context_exactly(tiny, runner, context, overlap):
    """A prompt and its new tokens that fill the context exactly are admitted and run to
    the last token (the fast runner's page tables hold ``max_context`` tokens, no more);
    one token more is refused when submitted, with the reason, and never queued."""
    new = 12
    prompt = np.random.default_rng(SEED).integers(1, TINY.vocab_size,
                                                  context - new).tolist()
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    engine = _engine(tiny, runner=runner, max_context=context, stop_ids=STOP,
                     overlap=overlap, num_blocks=context // 8 + 4)
    (req,) = _generate(engine, [prompt], params)
    (got,) = _answers(req)
    assert len(prompt) + len(got) == context
    assert [got] == _oracle(tiny, prompt, params, STOP)
    whose = "model's" if context == TINY.context else "runner's max"
    for over in (prompt + [1], prompt):
        n = new + 1 if over is prompt else new
        with pytest.raises(ConfigError, match=f"{len(over)} prompt tokens \\+ {n} new ones "
                                              f"exceed the {whose} context of {context}"):
            engine.submit(over, SamplingParams(max_new_tokens=n))
    assert not engine.has_work()


# ------------------------------------------------------------------ the watermark

def test_admission_keeps_the_watermark_free(tiny):
    """A pool of 20 blocks of 8 with a watermark of 0.2 keeps 4 blocks free at admission:
    with one request running, a prompt that leaves exactly 4 free is admitted; one block
    more waits (with the reason) until the first is done; with no watermark it is
    admitted at once. A request whose worst case needs more than the 16 blocks left is
    refused for ever, with no watermark it is not."""
    prompt = _prompts(SEED, (40,))[0]
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)

    def started(watermark):
        engine = _engine(tiny, num_blocks=20, watermark=watermark, stop_ids=())
        a = engine.submit(prompt, params)
        engine.step()
        assert engine.scheduler.running == [a]
        return engine, a

    engine, _ = started(0.2)
    assert engine.memory.watermark_blocks == 4
    free = engine.memory.manager.allocator.num_free
    fits = _prompts(SEED + 1, (8 * (free - 4) - 3,))[0]          # free - 4 blocks
    over = _prompts(SEED + 1, (8 * (free - 3) - 3,))[0]          # one block more
    small = SamplingParams(max_new_tokens=4, ignore_eos=True)
    b = engine.submit(fits, small)
    engine.step()
    assert b in engine.scheduler.running

    engine, a = started(0.2)
    c = engine.submit(over, small)
    assert engine.memory.admission(c) == (
        "later", f"needs {free - 3 + 4} free blocks (watermark included), {free} are free")
    for _ in range(200):
        if a.done:
            break
        assert c in engine.scheduler.waiting, "admitted into the watermark"
        engine.step()
    assert a.done
    _drain(engine)
    assert _answers(c) == [_oracle(tiny, over, small, ())[0]]

    engine, _ = started(0.0)
    c = engine.submit(over, small)
    engine.step()
    assert c in engine.scheduler.running                      # the watermark held it back

    worst = SamplingParams(max_new_tokens=8 * 17 - 10, ignore_eos=True)   # 17 blocks
    engine, _ = started(0.2)
    with pytest.raises(ConfigError, match="may need 17 blocks; the pool has 20, 4 of them "
                                          "kept free"):
        engine.submit([1] * 10, worst)
    engine, _ = started(0.0)
    engine.submit([1] * 10, worst)


# ------------------------------------------------------------------ failures

def _fail_at(engine, when, message):
    """Make the runner's launch fail, once, at the first plan ``when(plan)`` names, after
    its swap copies ran (the device failed in the step's passes); returns the plans that
    failed (one, once it has)."""
    real, failed = engine.runner.launch, []

    def launch(plan):
        if not failed and when(plan):
            failed.append(plan)
            engine.runner._swap(plan)
            raise RuntimeError(message)
        return real(plan)
    engine.runner.launch = launch
    return failed, real


def _assert_clean(engine, blocks):
    """Clean, after every request the engine held was cancelled: no request queued, the
    pool and the host pool pass their audits and hold nothing, no slot is reserved."""
    m, swapper = engine.memory.manager, engine.memory.swapper
    s = engine.scheduler
    assert not (s.waiting or s.running or s.swapped or s.prefilling)
    m.audit()
    if swapper is not None:
        swapper.audit()
        assert swapper.host.num_used == 0 and not swapper.swapped
    assert len(m) == 0 and not m.pending() and m.allocator.num_free == blocks


AT = ["the swapping step", "the step after it"]
SWAP_PROMPTS = _prompts(SEED + 2, (21, 9, 30, 14, 26))
SWAP_PARAMS = SamplingParams(max_new_tokens=20, ignore_eos=True)


def _failed_step(model, overlap, at):
    """A tight pool with swap preemption; the runner fails at the step whose plan swaps a
    request out (its copies made, its passes not), or at the step after it (with depth 1
    the swapping step is then still in flight). The failure must reach the caller as the
    runner's error. Then, as the engine's contract asks of the caller after a failed
    step (the server's engine core does it), every request it holds is cancelled.
    Returns the engine and the runner's own launch."""
    engine = _engine(model, num_blocks=12, stop_ids=STOP, preemption="swap",
                     host_blocks=64, overlap=overlap)
    swapping = []

    def when(plan):
        swapping.extend([plan] if plan.swap_outs else [])
        return bool(swapping) and (at == AT[0] or plan is not swapping[0])
    failed, real = _fail_at(engine, when, "injected: the device failed")
    reqs = [engine.submit(p, SWAP_PARAMS) for p in SWAP_PROMPTS]
    with pytest.raises(RuntimeError, match="injected: the device failed"):
        for _ in range(200):
            engine.step()
    assert failed and swapping
    assert engine.scheduler.swapped or engine.memory.swapper.swapped
    for req in reqs:
        engine.cancel(req)
    return engine, real


@pytest.mark.parametrize("at", AT)
@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_a_failed_step_with_swaps_in_flight_leaves_the_pool_clean(tiny, overlap, at):
    """After the failed step and the cancels, the engine is clean (:func:`_assert_clean`):
    the swap-out the failed plan made is undone with its request."""
    engine, _ = _failed_step(tiny, overlap, at)
    _assert_clean(engine, 12)


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_a_failed_step_leaves_no_step_in_flight(tiny, overlap):
    """After the failed step and the cancels, the engine has no work: the server's health
    check after a failed step asks exactly this (``EngineCore.problem``). With depth 1 the
    step before the failed one was once left in ``Engine.flight``, so the server's engine
    core died on any failed step when the device ran ahead."""
    engine, _ = _failed_step(tiny, overlap, AT[1])
    assert not engine.has_work(), "a failed step is left in flight"


@pytest.mark.parametrize("at", AT)
@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_the_engine_serves_on_after_a_failed_step(tiny, overlap, at):
    """After the failed step and the cancels, the engine serves on: a new request gets
    the oracle's answer, and the pool is whole after it. (The draws were once numbered
    by the failed plan while the runner kept the last launched one's, so a request
    submitted after the failure got wrong tokens.)"""
    engine, real = _failed_step(tiny, overlap, at)
    engine.runner.launch = real
    (req,) = _generate(engine, SWAP_PROMPTS[:1], SWAP_PARAMS)
    assert _answers(req) == [_oracle(tiny, SWAP_PROMPTS[0], SWAP_PARAMS, STOP)[0]]
    _assert_clean(engine, 12)
    assert not engine.has_work()


def _sampled_pair(model, overlap):
    """An engine running two requests of three samples each, three steps in."""
    prompts = _prompts(SEED + 3, (12, 20))
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=5)
    engine = _engine(model, stop_ids=STOP, overlap=overlap)
    reqs = [engine.submit(p, params) for p in prompts]
    for _ in range(3):
        engine.step()
    assert all(len(r.live) == 3 and not r.done for r in reqs)
    return engine, reqs, prompts, params


def _held(engine):
    s = engine.scheduler
    return [*s.waiting, *s.running, *s.swapped]


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_a_cancel_the_engine_refuses_changes_nothing(tiny, overlap):
    """A cancel fails when the engine finds a request it cannot cancel whole: a running
    request one of whose samples lost its blocks behind its back (injected), or a
    request of another engine. The error is typed and says why; nothing changed: the
    pool passes its audit, every other block is still held, the request is where it
    was."""
    engine, (victim, other), prompts, params = _sampled_pair(tiny, overlap)
    m = engine.memory.manager
    m.free(victim.live[1].seq_id)                       # lost behind the engine's back
    before = (m.allocator.num_free, sorted(m.seq_ids), list(engine.scheduler.running))
    with pytest.raises(ConfigError, match=f"request {victim.request_id} is running without "
                                          f"the blocks of all its sequences"):
        engine.cancel(victim)
    stranger = _engine(tiny, stop_ids=STOP).submit(prompts[0], params)
    with pytest.raises(ConfigError, match="is not in this engine's queues"):
        engine.cancel(stranger)
    m.audit()
    assert (m.allocator.num_free, sorted(m.seq_ids), list(engine.scheduler.running)) == before
    assert len(victim.live) == 3 and not victim.finished


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_a_cancel_that_fails_leaves_the_pool_clean(tiny, overlap):
    """A cancel fails half way: the pool fails to free the second of a request's three
    samples (injected). "Clean" here: the error reaches the caller; the pool passes its
    audit; and no block is orphaned: every sequence the pool holds is a live sequence of
    a request the engine still holds, so cancelling it again once the fault is gone (or
    letting it finish) gives every block back, and the other request gets the oracle's
    answers."""
    engine, (victim, other), prompts, params = _sampled_pair(tiny, overlap)
    m = engine.memory.manager
    real_free, calls = m.free, []

    def free(seq_id):
        calls.append(seq_id)
        if len(calls) == 2:
            raise RuntimeError("injected: the pool failed to free a sequence")
        return real_free(seq_id)
    m.free = free
    with pytest.raises(RuntimeError, match="injected: the pool failed"):
        engine.cancel(victim)
    m.free = real_free
    m.audit()
    held = {seq.seq_id for r in _held(engine) for seq in r.live}
    assert set(m.seq_ids) <= held, "blocks of a cancelled request are orphaned"
    if any(r is victim for r in _held(engine)):
        assert engine.cancel(victim) is True
    _drain(engine)
    assert sorted(_answers(other)) == sorted(_oracle(tiny, prompts[1], params, STOP))
    assert m.allocator.num_free == 200 and len(m) == 0


# ------------------------------------------------------------------ what a step records

def test_history_records_the_pool_after_every_step(tiny, monkeypatch):
    """After each step ``history`` holds the pool as the manager and the scheduler tell
    it (read here straight from them): blocks used and shared, the blocks sharing
    saves, sequences and their tokens, copies made, the three queues, preemptions and
    the rows the step decoded; it keeps the last ``history_steps`` steps; ``on_step``
    sees each step."""
    monkeypatch.setattr(Engine, "history_steps", 4)
    seen, plans = [], []
    engine = _engine(tiny, num_blocks=14, stop_ids=(), on_step=seen.append,
                     runner="plain", token_budget=12)
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    assert engine.history.maxlen == 4
    params = SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=2)
    reqs = [engine.submit(p, params) for p in _prompts(SEED, (12, 20, 7))]
    m, s = engine.memory.manager, engine.scheduler
    records = []
    while engine.has_work():
        engine.step()
        assert len(plans) < 500, "the engine still has work after 500 steps"
        lengths = [m.num_tokens(i) for i in m.seq_ids]
        mapped = sum(-(-n // 8) for n in lengths)
        rows = plans[-1].rows
        assert engine.history[-1] == dict(
            used_blocks=m.allocator.num_used, shared_blocks=m.allocator.num_shared,
            blocks_saved=mapped - m.allocator.num_used, sequences=len(lengths),
            tokens=sum(lengths), copies=engine.runner.kv.copies_done,
            running=len(s.running), waiting=len(s.waiting), swapped=len(s.swapped),
            preemptions=engine.memory.counts.preemptions,
            decoded=len(rows.seqs) if rows is not None else 0)
        assert seen[-1] is engine and len(seen) == len(plans)
        records.append(engine.history[-1])
    assert len(engine.history) == 4 and list(engine.history) == records[-4:]
    assert all(r.done for r in reqs)
    for key in ("shared_blocks", "blocks_saved", "copies", "waiting", "preemptions",
                "decoded"):
        assert max(r[key] for r in records) > 0, key     # each one moved in this run
    assert plans[0].rows is None and records[0]["decoded"] == 0   # a prefill alone


# ------------------------------------------------------------------ what the engine is built of

def test_the_config_reaches_every_part(tiny):
    """Each setting reaches the part that uses it: the bookkeeping's classes, prefix
    caching on or off, the runner's prefill packing, the scheduler's budget, max_seqs and
    chunking; the device runs ahead by default only on a GPU (never here)."""
    from pagedkv.prefix_cache import PrefixCachingManager
    e = Engine(tiny, num_blocks=16, bookkeeping="fast", prefix_caching=True,
               prefill_chunk=24, token_budget=40, max_seqs=3, chunked_prefill=False)
    m = e.memory.manager
    assert type(m).__module__ == "pagedkv.fast.prefix" and m.caching
    assert e.runner.prefill_chunk == 24
    s = e.scheduler
    assert (s.token_budget, s.max_seqs, s.chunked_prefill) == (40, 3, False)
    e = Engine(tiny, num_blocks=16)
    m = e.memory.manager
    assert type(m) is PrefixCachingManager and not m.caching
    assert e.runner.prefill_chunk == 512
    assert (e.scheduler.token_budget, e.scheduler.max_seqs, e.scheduler.chunked_prefill) \
        == (None, 64, True)
    for runner in ("plain", "fast-eager", "fast"):
        assert Engine(tiny, num_blocks=16, runner=runner).depth == 0      # no GPU here


def test_requests_are_numbered_and_bad_prompts_refused_by_name(tiny):
    engine = Engine(tiny, num_blocks=16)
    ids = [engine.submit([1, 2, 3]).request_id for _ in range(3)]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == 3 and ids == sorted(ids)
    with pytest.raises(ConfigError, match="^the prompt is empty: give at least one token$"):
        engine.submit([])
    v = TINY.vocab_size
    for bad in ([1, v], [v], [v + 5, 3]):
        with pytest.raises(ConfigError, match=fr"^prompt token ids must lie in \[0, {v}\)$"):
            engine.submit(bad)
    with pytest.raises(ConfigError, match="token ids must be integers"):
        engine.submit([-1, 2])
    engine.submit([0, v - 1])                                 # both ends of the vocabulary
    assert len(engine.scheduler.waiting) == 4


# ------------------------------------------------------------------ beam search

@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_beam_search_ends_with_its_width_finished_and_keeps_its_family(tiny, overlap):
    """A stop id this model emits (86, after prompt 0): both hypotheses of a width-2
    search end on it before max_new_tokens, and the search ends then (not when a third
    ends); answers and scores are the oracle's. Every sequence the search made but the
    first names the one it was forked from (whose tokens it shares but its last), and
    every one has ended."""
    prompt, stop = _prompts()[0], 86
    params = SamplingParams(max_new_tokens=12, beam_width=2)
    engine = _engine(tiny, stop_ids=(stop,), overlap=overlap)
    made, born = [], {}                       # the sequences made, their tokens then
    new_seq = engine.memory.new_seq

    def record(*a, **k):
        made.append(new_seq(*a, **k))
        born[made[-1].seq_id] = list(made[-1].tokens)
        return made[-1]
    engine.memory.new_seq = record
    (req,) = _generate(engine, [prompt], params)
    got = [(s.generated, s.score) for s in req.outputs()]
    want = [(s.generated, s.score) for s in reference_generate(tiny, prompt, params, (stop,))]
    assert [g for g, _ in got] == [w for w, _ in want]
    assert np.allclose([s for _, s in got], [s for _, s in want], atol=1e-4)
    assert all(g[-1] == stop and len(g) < 12 for g, _ in got)
    by_id = {s.seq_id: s for s in made}
    assert made[0].parent is None and len(made) > 3
    for s in made[1:]:
        tokens, parent = born[s.seq_id], by_id[s.parent]
        assert parent.tokens[:len(tokens) - 1] == tokens[:-1], (s, parent)
    assert all(s.ended for s in made if s not in req.finished)
    assert engine.memory.manager.allocator.num_free == 200


# ------------------------------------------------------------------ cancelling

def test_cancel_answers_what_it_did(tiny):
    """True when it cancelled; False, changing nothing, for a request that is done, even
    one the caller has taken out of ``finished`` (as the server does); a request
    preempted by recompute (its blocks gone, no swap space) is cancelled too."""
    prompts = _prompts(SEED + 4, (30, 28, 26))
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = _engine(tiny, num_blocks=13, stop_ids=())
    short = engine.submit([5, 6], SamplingParams(max_new_tokens=1))
    reqs = [engine.submit(p, params) for p in prompts]
    for _ in range(200):
        engine.step()
        back = [r for r in engine.scheduler.waiting if r.live and r.live[0].generated]
        if back:
            break
    assert short.done and engine.finished == [short] and back
    assert engine.cancel(short) is False
    (preempted,) = back
    assert engine.memory.swapper is None and preempted.live[0].seq_id not in \
        engine.memory.manager
    assert engine.cancel(preempted) is True and preempted not in engine.scheduler.waiting
    running = engine.scheduler.running[0]
    assert engine.cancel(running) is True and engine.cancel(running) is False
    engine.finished.clear()                          # the server forgets what it sent
    assert engine.cancel(short) is False
    _drain(engine)
    assert engine.memory.manager.allocator.num_free == 13
    (last,) = [r for r in reqs if r is not preempted and r is not running]
    assert engine.finished == [last] and len(last.outputs()[0].generated) == 40


def test_a_swapped_request_missing_a_sequence_is_not_cancelled(tiny):
    """A request swapped out one of whose sequences the host pool no longer holds
    (injected) is refused with an audit error that names it, and nothing changes."""
    params = SamplingParams(max_new_tokens=20, temperature=1.0, n=2, seed=4)
    engine = _engine(tiny, num_blocks=12, stop_ids=(), preemption="swap", host_blocks=64)
    reqs = [engine.submit(p, params) for p in _prompts(SEED + 5, (20, 18))]
    for _ in range(200):
        engine.step()
        if engine.scheduler.swapped:
            break
    (gone,) = engine.scheduler.swapped
    swapper = engine.memory.swapper
    lost = swapper.swapped.pop(gone.live[1].seq_id)
    with pytest.raises(AuditError, match=f"^request {gone.request_id} is swapped out without "
                                         f"all its sequences$"):
        engine.cancel(gone)
    assert list(engine.scheduler.swapped) == [gone] and gone.live[0].seq_id in swapper.swapped
    swapper.swapped[gone.live[1].seq_id] = lost
    assert engine.cancel(gone) is True and swapper.host.num_used < 64
    assert reqs


# ------------------------------------------------------------------ blocks named as tokens land

@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_an_answers_full_blocks_are_all_found_again(tiny, overlap):
    """With the prefix cache, every full block of K/V an answer computed is named by its
    tokens as they land (its last token's K/V are never computed): the prompt + answer
    submitted again finds exactly those blocks, ``(length - 1) // 16`` of them, the
    blocks the last tokens filled included."""
    prompts = _prompts(SEED + 6, (9, 25, 4))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine = _engine(tiny, block_size=16, stop_ids=(), prefix_caching=True, overlap=overlap)
    reqs = _generate(engine, prompts, params)
    again = [p + r.outputs()[0].generated for p, r in zip(prompts, reqs)]
    m = engine.memory.manager
    assert [m.cached_prefix(m.prompt(a)) for a in again] == \
        [(len(a) - 1) // 16 * 16 for a in again]


@pytest.mark.parametrize("overlap, found", [(False, 8), (True, 16)], ids=["depth 0", "depth 1"])
def test_an_end_token_computed_ahead_names_its_block(tiny, overlap, found):
    """With depth 1 the row of a sequence that ended on an end token is computed before
    the end is known (and thrown away): that row wrote the end token's K/V, so the block
    it filled is named when the token lands, before the sequence's blocks are freed.
    A 14-token prompt whose answer ends on its 2nd token fills two blocks of 8: its
    prompt + answer + one token finds both ahead, one at depth 0 (where the end
    token's K/V is never computed)."""
    free = _engine(tiny, stop_ids=())
    for seed in range(SEED, SEED + 50):
        prompt = _prompts(seed, (14,))[0]
        best = _generate(free, [prompt], SamplingParams(max_new_tokens=8))[0]
        i, stop = _first_new(best.outputs()[0].generated)
        if i == 1:
            break
    engine = _engine(tiny, stop_ids=(stop,), prefix_caching=True, overlap=overlap)
    (req,) = _generate(engine, [prompt], SamplingParams(max_new_tokens=8))
    answer = req.outputs()[0].generated
    assert answer[-1] == stop and len(prompt + answer) == 16
    m = engine.memory.manager
    assert m.cached_prefix(m.prompt(prompt + answer + [5])) == found
