"""Speculative decoding in the engine (``Engine(speculate=k)``), on the CPU against the
contiguous-cache oracle: every request kind gets the oracle's answer token for token with
guesses made, verified, kept and rolled back — greedy and sampled alike, since every row
draws with its sequence's stream at that token's place in the answer — with the device
ahead and not, on both runners and both bookkeepings, with prefix caching, preemption by
recompute and by swap, token budgets, stops and limits inside an accepted run, and
cancellation; the prefix cache names only verified blocks; the pool is audited after every
step and whole at the end. Then a distribution test of sampled tokens, the settings and
their thresholds, and GPU versions (skipped without a GPU). Seeds are fixed and printed.
"""
import math
from collections import Counter

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.config import EngineConfig, Speculation
from pagedkv.errors import ConfigError
from pagedkv.model import Llama, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate, reference_forward, ContiguousCache
from pagedkv.model.requests import SamplingParams
from pagedkv.speculate import accept_drawn, accept_greedy
from _engine_cases import CASES, GREEDY, MIXED
from _tiny import TINY

single_thread_blas()

SEED = 4040
STOPS = (0, 7, 9)
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")


def _prompts(seed, n=7, repeats=3):
    """Prompts that repeat themselves (a random stretch said ``repeats`` times and begun
    again), so that prompt lookup has something to find."""
    rng = np.random.default_rng(seed)
    out = []
    for k in rng.integers(5, 16, n):
        base = rng.integers(1, TINY.vocab_size, int(k)).tolist()
        out.append(base * repeats + base[:int(rng.integers(1, k + 1))])
    return out


class Recorder:
    """Every landed step's plan and drawn tokens, read from ``engine.update``."""

    def __init__(self, engine):
        self.steps = []
        update = engine.update

        def recorded(plan, out):
            self.steps.append((plan, out.tokens.tolist()))
            return update(plan, out)
        engine.update = recorded

    def guessing(self):
        """(plan, drawn) of the steps that verified guesses."""
        return [(p, t) for p, t in self.steps if p.rows is not None and (p.rows.guess >= 0).any()]


def _run(model, prompts, params, *, arrivals=None, cancel=None, check=None, **options):
    """Every request's outputs, the engine and its recorder; ``arrivals[i]``: the step count
    before request ``i`` is submitted; ``cancel``: {request index: step count};
    ``check(engine)`` runs after every step."""
    kw = dict(num_blocks=300, block_size=16, stop_ids=STOPS, audit=True,
              runner="fast-eager", speculate=4) | options
    engine = Engine(model, **kw)
    rec = Recorder(engine)
    arrivals = arrivals or [0] * len(prompts)
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs, steps = [None] * len(prompts), 0
    while steps <= max(arrivals) or engine.has_work():
        for i, at in enumerate(arrivals):
            if at == steps:
                reqs[i] = engine.submit(prompts[i], params[i])
        for i, at in (cancel or {}).items():
            if at == steps and reqs[i] is not None:
                engine.cancel(reqs[i])
        engine.step()
        if check is not None:
            check(engine)
        steps += 1
    m = engine.memory.manager
    assert m.allocator.num_free == kw["num_blocks"] or kw.get("prefix_caching")
    assert len(m) == 0 and not m.pending()
    m.audit()
    return engine, rec, [[s.generated for s in _in_oracle_order(r)] for r in reqs]


def _in_oracle_order(req):
    """A request's answers in the order the oracle, stepping its samples together, finishes
    them: the shorter first, then by sample (a guessing sample may finish in fewer steps
    than another of the same length; the engine lists them as they finished)."""
    if req.params.beam_width > 1:
        return req.outputs()
    return sorted(req.outputs(), key=lambda s: (s.num_generated, s.seq_id))


def _oracle(model, prompts, params, stops=STOPS):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return [[s.generated for s in reference_generate(model, p, q, stops)]
            for p, q in zip(prompts, params)]


def _guessed_and_rejected(engine):
    c = engine.memory.counts
    assert c.drafted > c.accepted > 0              # guesses kept, and guesses rolled back


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
@pytest.mark.parametrize("name", list(CASES))
def test_every_request_gets_the_oracles_answer_with_guesses(tiny, name, overlap):
    """Greedy, sampled, n samples, beam search (which does not guess, in the same passes),
    min_tokens, ignore_eos: the oracle's tokens, with guesses kept and rolled back."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]
    engine, rec, got = _run(tiny, prompts, MIXED, arrivals=arrivals, overlap=overlap,
                            **CASES[name])
    assert got == _oracle(tiny, prompts, MIXED)
    _guessed_and_rejected(engine)
    mixed = [p for p, _ in rec.guessing() if (p.rows.guess < 0).sum() > len(p.rows.guessed())]
    assert mixed                                   # rows that guess beside rows that don't
    if "num_blocks" in CASES[name]:
        assert engine.memory.counts.preemptions > 0
    if name == "budget":                           # guesses take only what the budget leaves
        for plan, _ in rec.steps:
            rows = 0 if plan.rows is None else len(plan.rows.seqs)
            assert sum(c.tokens for c in plan.chunks) + rows <= 24


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8, 16])
def test_greedy_is_the_oracles_over_seeds_and_k(tiny, k):
    """Greedy requests only, a dozen prompt sets for each k (k = 16 is more than the
    answers have left): the oracle's tokens, and never a guess past max_new_tokens."""
    for seed in range(SEED, SEED + 4):
        print(f"seed={seed} k={k}")
        prompts = _prompts(seed, n=4)
        params = [SamplingParams(max_new_tokens=int(n)) for n in (3, 7, 12, 20)]
        engine, rec, got = _run(tiny, prompts, params, speculate=k, stop_ids=(0,))
        assert got == _oracle(tiny, prompts, params, stops=(0,))
        for plan, _ in rec.guessing():
            for seq, guesses in plan.rows.guessed().items():
                req = next(r for s, r in zip(plan.rows.seqs, plan.rows.reqs) if s is seq)
                assert len(guesses) <= k
                # the guesses' draws end at the answer's last token at most
                assert seq.num_generated <= req.params.max_new_tokens


def test_a_guess_never_passes_the_context(tiny):
    """A prompt that fills the model's context but for its answer: its guesses stop where
    the answer must (positions past the context would be an error)."""
    prompt = _prompts(SEED + 1, n=1, repeats=60)[0][:TINY.context - 12]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    engine, rec, got = _run(tiny, [prompt], params, speculate=16, num_blocks=64)
    assert engine.memory.counts.drafted > 0
    assert got == _oracle(tiny, [prompt], params)


def _stops_inside_accepted_runs(rec, stops):
    """How many sequences ended on an end token that a kept guess row drew, with the draw
    after it (of the same sequence) kept too: a stop inside an accepted run."""
    found = 0
    for plan, drawn in rec.guessing():
        d = plan.draws
        keep = accept_drawn(d.guess, drawn)
        for i in range(len(drawn) - 1):
            same = d.seqs[i] is d.seqs[i + 1] and d.guess[i + 1] >= 0
            if same and keep[i] and keep[i + 1] and drawn[i] in stops:
                found += 1
    return found


def _first_inside_a_run(rec):
    """Tokens whose first place in some answer is inside an accepted run (drawn by a kept
    row whose next row, a guess of the same sequence, was kept too)."""
    seen, inside = set(), Counter()
    for plan, drawn in rec.steps:
        d = plan.draws
        keep = accept_drawn(d.guess, drawn) if d.speculative else [True] * len(drawn)
        for i, (seq, t) in enumerate(zip(d.seqs, drawn)):
            if not keep[i] or (id(seq), t) in seen:
                continue
            seen.add((id(seq), t))
            nxt = i + 1 < len(drawn) and d.seqs[i + 1] is seq and d.guess[i + 1] >= 0
            if nxt and keep[i + 1]:
                inside[t] += 1
    return inside


def test_stops_and_min_tokens_inside_an_accepted_run(tiny):
    """The end token is one an answer first draws inside a guessed run: the answers stop
    at the oracle's place although the verification accepted tokens past it; with
    min_tokens the end token is banned there (each row's ban follows its place in the
    answer) and the answer runs on."""
    # prompts that end with the model's own 30-token answer to them: it goes on as it went,
    # and lookup finds that in the prompt (a random model repeats itself, but copies
    # nothing: otherwise every token of a guessed run has been drawn before in the answer)
    prompts = [p + reference_generate(tiny, p, SamplingParams(max_new_tokens=30,
                                                              ignore_eos=True))[0].generated
               for p in _prompts(SEED + 2, n=6)]
    free = SamplingParams(max_new_tokens=24, ignore_eos=True)
    engine, rec, got = _run(tiny, prompts, free)
    stop = _first_inside_a_run(rec).most_common(1)[0][0]
    print(f"seed={SEED + 2} stop token {stop}")
    for params in (SamplingParams(max_new_tokens=24),
                   SamplingParams(max_new_tokens=24, min_tokens=10),
                   SamplingParams(max_new_tokens=24, temperature=0.9, seed=11)):
        engine, rec, got = _run(tiny, prompts, params, stop_ids=(stop,))
        assert got == _oracle(tiny, prompts, params, stops=(stop,))
        if params.min_tokens == 0 and params.temperature == 0:
            assert _stops_inside_accepted_runs(rec, {stop}) > 0


@pytest.mark.parametrize("name", ["recompute", "swap"])
def test_a_request_that_guessed_is_preempted_and_continues_exactly(tiny, name):
    """Three long answers in a pool of 8 blocks: requests that had guessed are preempted
    (by recompute, or swapped out) and come back to give the oracle's answers."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED + 3, n=3)
    params = [SamplingParams(max_new_tokens=60, ignore_eos=True),
              SamplingParams(max_new_tokens=60, temperature=0.8, seed=4, ignore_eos=True),
              SamplingParams(max_new_tokens=60, min_tokens=40)]
    engine, rec, got = _run(tiny, prompts, params, **(CASES[name] | dict(num_blocks=8)))
    assert got == _oracle(tiny, prompts, params)
    guessed, hit = set(), 0
    for plan, _ in rec.steps:
        hit += sum(id(r) in guessed for r in plan.preempted)
        if plan.rows is not None:
            guessed |= {id(r) for s, r, g in zip(plan.rows.seqs, plan.rows.reqs,
                                                 plan.rows.guess) if g >= 0}
    assert hit > 0                                 # preempted after it had guessed
    if name == "swap":
        assert engine.memory.counts.swapped_out > 0


@pytest.mark.parametrize("overlap", [False, True], ids=["depth 0", "depth 1"])
def test_cancel_a_request_that_is_guessing(tiny, overlap):
    """A request cancelled between steps it guessed in keeps a prefix of its answer; the
    others are unchanged; every block comes back."""
    print(f"seed={SEED}")
    prompts = _prompts(SEED + 4, n=5)
    params = [GREEDY, MIXED[1], GREEDY, MIXED[4], MIXED[6]]
    _, rec, plain = _run(tiny, prompts, params)
    when = {}
    for n, (plan, _) in enumerate(rec.steps):
        for s, r in zip(plan.rows.seqs, plan.rows.reqs) if plan.rows else ():
            when.setdefault(r.request_id, n)
    cancel = {0: 4, 2: 6}
    engine, rec, got = _run(tiny, prompts, params, cancel=cancel, overlap=overlap)
    for i, (a, p) in enumerate(zip(got, plain)):
        if i in cancel:
            assert p[0][:len(a[0])] == a[0] and len(a[0]) < len(p[0])
        else:
            assert a == p
    assert engine.memory.manager.allocator.num_free == 300


def _names_only_verified_blocks(engine):
    """Every full block a live sequence maps is named by the hash of its true tokens."""
    m = engine.memory.manager
    for req in engine.scheduler.running:
        for seq in req.live:
            if seq.seq_id in m and not seq.on_its_way:
                full = m.num_tokens(seq.seq_id) // m.block_size * m.block_size
                assert m._hashes[seq.seq_id] == m.prompt(seq.tokens[:full]).hashes


@pytest.mark.parametrize("bookkeeping", ["teaching", "fast"])
def test_the_prefix_cache_names_only_verified_blocks(tiny, bookkeeping):
    """After every step, every named block holds the tokens its name says (no rejected
    guess); and an answer submitted again finds as many cached tokens as without
    speculation."""
    prompts = _prompts(SEED + 5, n=5)
    found = []
    for k in (None, 4):
        engine, rec, out = _run(tiny, prompts, GREEDY, prefix_caching=True, speculate=k,
                                bookkeeping=bookkeeping, check=_names_only_verified_blocks)
        before = engine.memory.counts.cached_tokens
        engine.generate([p + o[0] for p, o in zip(prompts, out)],
                        SamplingParams(max_new_tokens=1))
        found.append((out, engine.memory.counts.cached_tokens - before))
    assert found[0] == found[1]
    _guessed_and_rejected(engine)


def test_sampled_tokens_follow_the_target_distribution(tiny):
    """Sampled with top-k 3: the joint distribution of the four tokens of 1,500 answers
    (a seed each) passes a chi-square test against the target's, computed exactly with the
    oracle's forward pass. The first two are drawn in the prefill's step; the third
    comes with a guess 69% of the time (right for 34% of those), and then the fourth is
    drawn by the guess's row."""
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    prompt = _prompts(SEED + 6, n=1)[0]
    p = SamplingParams(max_new_tokens=4, temperature=1.0, top_k=3)
    exact = _joint(tiny, prompt, 4, p)
    engine = Engine(tiny, num_blocks=1200, block_size=16, max_seqs=256, runner="fast-eager",
                    speculate=Speculation(max_batch=256, min_ngram=1))
    rec = Recorder(engine)
    seeds = rng.integers(0, 2**62, 1500).tolist()
    reqs = []
    for wave in range(0, 1500, 100):                # 100 at once: room to guess beside them
        reqs += [engine.submit(prompt, SamplingParams(**(vars(p) | dict(seed=s))))
                 for s in seeds[wave:wave + 100]]
        engine.run()
    got = Counter(tuple(r.outputs()[0].generated) for r in reqs)
    assert set(got) <= set(exact)
    rare = [x for x, q in exact.items() if 1500 * q < 5]     # pooled: one cell
    cells = [([x], q) for x, q in exact.items() if x not in rare]
    cells.append((rare, sum(exact[x] for x in rare)))
    stat = sum((sum(got[x] for x in xs) - 1500 * q) ** 2 / (1500 * q) for xs, q in cells)
    dof = len(cells) - 1
    print(f"chi-square {stat:.1f} on {dof} degrees of freedom")
    assert stat < dof + 4 * math.sqrt(2 * dof), (stat, dof)   # far inside the tail
    kept = [accept_drawn(pl.draws.guess, t)[pl.draws.guess >= 0] for pl, t in rec.guessing()]
    kept = np.concatenate(kept)
    assert 0 < kept.sum() < len(kept)              # guesses taken, and guesses rejected


def _top_k_probs(logits, k):
    z = logits.astype(np.float64)
    top = np.argsort(-z)[:k]
    w = np.exp(z[top] - z[top].max())
    return dict(zip(top.tolist(), (w / w.sum()).tolist()))


def _joint(model, prompt, n, params):
    """The exact probability of every answer of ``n`` tokens, by the oracle's forward pass
    (top-k renormalised softmax at the request's temperature)."""
    out = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for answer, q in out.items():
            c = model.config
            cache = ContiguousCache(c.layers, c.kv_heads, c.head_dim, model.dtype)
            logits = reference_forward(model, cache, list(prompt) + list(answer))[-1]
            for t, pt in _top_k_probs(logits / params.temperature, params.top_k).items():
                nxt[answer + (t,)] = q * pt
        out = nxt
    return out


# ---------------------------------------------------------------------- the settings
def test_no_guess_in_a_step_of_more_than_max_batch_sequences(tiny):
    prompts = _prompts(SEED + 7, n=6)
    params = [SamplingParams(max_new_tokens=int(n)) for n in (4, 6, 9, 14, 20, 28)]
    engine, rec, got = _run(tiny, prompts, params, speculate=Speculation(k=3, max_batch=2),
                            stop_ids=())
    assert got == _oracle(tiny, prompts, params, stops=())
    assert rec.guessing()
    for plan, _ in rec.guessing():
        assert (plan.rows.guess < 0).sum() <= 2


def test_a_sequence_whose_lookup_misses_stops_guessing(tiny):
    """min_rate 0 guesses whatever the lookup finds; min_rate 1 never (a lookup starts at
    a rate of one half); one half, until the first misses. The same answers each time."""
    prompts = _prompts(SEED + 9, n=4)
    made, answers = [], []
    for rate in (0.0, 0.5, 1.0):
        engine, _, got = _run(tiny, prompts, GREEDY,
                              speculate=Speculation(min_rate=rate, min_ngram=1))
        made.append(engine.memory.counts.drafted)
        answers.append(got)
    assert made[0] > made[1] > made[2] == 0
    assert answers[0] == answers[1] == answers[2] == _oracle(tiny, prompts, GREEDY)


def test_a_step_that_guesses_lands_at_once_and_others_run_ahead(tiny):
    """At depth 1 a step that guesses lands before the next plan (its tokens are needed to
    know what it kept); so does one whose sequences could guess next (their newest tokens
    must be on the host to guess from); a step of more than max_batch sequences runs
    ahead as without speculation."""
    prompts = _prompts(SEED + 8, n=3)
    for max_batch in (8, 2):
        engine = Engine(tiny, num_blocks=100, stop_ids=(), runner="fast-eager",
                        overlap=True, speculate=Speculation(max_batch=max_batch))
        for p, n in zip(prompts, (8, 16, 24)):
            engine.submit(p, SamplingParams(max_new_tokens=n))
        launched, launch = [], engine.runner.launch
        engine.runner.launch = lambda plan: (launched.append(plan), launch(plan))[1]
        while engine.has_work():
            engine.step()
            d, rows = launched[-1].draws, launched[-1].rows
            if d.speculative:
                assert not engine.flight
            sequences = 0 if rows is None else int((rows.guess < 0).sum())
            assert d.speculative <= (sequences <= max_batch)
            if sequences > max_batch and engine.scheduler:
                assert len(engine.flight) == 1        # ahead
        assert engine.memory.counts.drafted > 0


def test_speculation_settings_are_checked(tiny):
    assert EngineConfig(num_blocks=8, speculate=3).speculate == Speculation(k=3)
    assert EngineConfig(num_blocks=8).speculate is None
    for bad, match in [(0, "speculate"), (True, "speculate must be"), ("4", "speculate must"),
                       (Speculation, "speculate must")]:
        with pytest.raises(ConfigError, match=match):
            Engine(tiny, num_blocks=8, speculate=bad)
    for kw, match in [(dict(k=0), "speculate.k"), (dict(min_ngram=4), "min_ngram"),
                      (dict(max_batch=0), "max_batch"), (dict(max_ngram=1.5), "max_ngram"),
                      (dict(min_rate=1.5), "min_rate"), (dict(min_rate=True), "min_rate")]:
        with pytest.raises(ConfigError, match=match):
            Speculation(**kw)


def test_accept_drawn_is_accept_greedy_streamed():
    """Rows of several sequences, each with its guesses: the kept draws of each are the
    tokens accept_greedy keeps."""
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    for _ in range(300):
        guess, drawn, want = [], [], []
        for _ in range(int(rng.integers(1, 5))):
            k = int(rng.integers(0, 5))
            g = rng.integers(0, 3, k).tolist()
            t = rng.integers(0, 3, k + 1).tolist()
            guess += [-1] + g
            drawn += t
            n = len(accept_greedy(g, t))
            want += [True] * n + [False] * (k + 1 - n)
        assert accept_drawn(guess, drawn).tolist() == want
    with pytest.raises(ConfigError, match="one guess"):
        accept_drawn([-1, 2], [1])
    with pytest.raises(ConfigError, match="first row"):
        accept_drawn([2], [1])


# ---------------------------------------------------------------------- the GPU
@gpu
@pytest.mark.parametrize("name", ["late stops", "prefix caching", "swap", "budget"])
def test_guesses_on_the_gpu_give_the_oracles_answers(name):
    """float32, CUDA graphs (a guess row is a row of the decode graph), the device ahead
    where no step guesses: every request of every kind gets the contiguous oracle's
    answer (computed on the CPU)."""
    cpu = Llama(TINY, random_weights(TINY, SEED), xp=np)
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    prompts = _prompts(SEED)
    arrivals = [0, 0, 3, 3, 9, 17, 30]
    engine, _, got = _run(m32, prompts, MIXED, arrivals=arrivals,
                          **(CASES[name] | dict(runner="fast")))
    assert engine.depth == 1 and engine.runner._graphs
    assert got == _oracle(cpu, prompts, MIXED)
    _guessed_and_rejected(engine)


@gpu
@pytest.mark.parametrize("k", [1, 4, 16])
def test_greedy_on_the_gpu_is_the_oracles_over_seeds_and_k(k):
    cpu = Llama(TINY, random_weights(TINY, SEED), xp=np)
    m32 = Llama(TINY, random_weights(TINY, SEED), dtype=np.float32)
    for seed in range(SEED, SEED + 4):
        prompts = _prompts(seed, n=4)
        params = [SamplingParams(max_new_tokens=int(n)) for n in (3, 7, 12, 20)]
        _, _, got = _run(m32, prompts, params, speculate=k, stop_ids=(0,), runner="fast")
        assert got == _oracle(cpu, prompts, params, stops=(0,))
