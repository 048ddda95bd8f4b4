"""Generation on the paged cache (continuous batching, sampling, n samples, beam search) against
the contiguous-cache oracle, which copies every forked cache eagerly; and the CLI."""
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.generate import main
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams, Sequence
from pagedkv.model.sampling import beam_select, best_beams
from _tiny import TINY

single_thread_blas()

SEED = 4321
STOP = (0,)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompts(seed, lengths=(5, 17, 1, 33)):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, n).tolist() for n in lengths]


def _answers(req):
    return [(s.generated, s.score) for s in req.outputs()]


def _same(got, expect):
    assert [g[0] for g in got] == [e[0] for e in expect]
    assert np.allclose([g[1] for g in got], [e[1] for e in expect], atol=1e-4)


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=20),
    "sampled": SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=7),
    "n4": SamplingParams(max_new_tokens=10, temperature=1.0, n=4, seed=11),
    "beam4": SamplingParams(max_new_tokens=12, beam_width=4),
}


@pytest.mark.parametrize("block_size", [16, 1])
@pytest.mark.parametrize("kind", list(PARAMS))
def test_engine_equals_reference(tiny, kind, block_size):
    """Four prompts of different lengths in one batch; audit after every step; every block
    back in the pool at the end."""
    params, prompts = PARAMS[kind], _prompts(SEED)
    engine = Engine(tiny, num_blocks=300, block_size=block_size, stop_ids=STOP, audit=True)
    reqs = engine.generate(prompts, params)
    for req, prompt in zip(reqs, prompts):
        expect = [(s.generated, s.score) for s in reference_generate(tiny, prompt, params, STOP)]
        _same(_answers(req), expect)
    assert engine.memory.manager.allocator.num_free == 300 and len(engine.memory.manager) == 0
    engine.memory.manager.audit()


def test_beam_search_shares_and_copies_on_write(tiny):
    engine = Engine(tiny, num_blocks=100, block_size=16, stop_ids=STOP, audit=True)
    (req,) = engine.generate(_prompts(SEED, (21,)), PARAMS["beam4"])
    assert len(req.outputs()) == 4
    assert len({tuple(s.generated) for s in req.outputs()}) == 4       # four different beams
    assert engine.runner.kv.copies_done > 0                                  # copy-on-write happened
    assert max(h["shared_blocks"] for h in engine.history) > 0        # and blocks were shared
    assert max(h["blocks_saved"] for h in engine.history) > 0


def test_parallel_samples_share_the_prompt(tiny):
    engine = Engine(tiny, num_blocks=100, block_size=16, stop_ids=STOP, audit=True)
    (req,) = engine.generate(_prompts(SEED, (40,)), PARAMS["n4"])
    first = engine.history[0]
    assert first["sequences"] == 4 and first["shared_blocks"] >= 2   # 40 tokens: 2 full blocks
    assert len(req.outputs()) == 4


def test_seeded_sampling_is_reproducible(tiny):
    def run(seed):
        engine = Engine(tiny, num_blocks=100, block_size=16, stop_ids=STOP)
        p = SamplingParams(max_new_tokens=16, temperature=1.2, n=3, seed=seed)
        return [s.generated for s in engine.generate(_prompts(SEED, (9,)), p)[0].outputs()]
    assert run(3) == run(3)
    assert run(3) != run(4)


def test_requests_arriving_while_others_decode(tiny):
    """Continuous batching: a request submitted mid-run joins the running batch and still gets
    exactly the reference's answer."""
    prompts, params = _prompts(SEED + 1, (6, 30)), PARAMS["greedy"]
    engine = Engine(tiny, num_blocks=100, block_size=16, stop_ids=STOP, audit=True)
    first = engine.submit(prompts[0], params)
    for _ in range(5):
        engine.step()
    second = engine.submit(prompts[1], params)
    engine.step()
    assert engine.history[-1]["running"] == 2
    engine.run()
    for req, prompt in zip((first, second), prompts):
        _same(_answers(req), [(s.generated, s.score)
                              for s in reference_generate(tiny, prompt, params, STOP)])


def test_a_small_pool_runs_requests_in_turn(tiny):
    """Admission takes what fits now: all three prompts start in a pool of three blocks, then
    outgrow it; the newest is preempted (recomputed later) until the others finish, and the
    answers do not change."""
    prompts, params = _prompts(SEED + 2, (10, 12, 14)), PARAMS["greedy"]
    engine = Engine(tiny, num_blocks=3, block_size=16, stop_ids=STOP, audit=True)
    reqs = engine.generate(prompts, params)
    assert max(h["running"] for h in engine.history) == 3
    assert engine.memory.counts.preemptions > 0
    for req, prompt in zip(reqs, prompts):
        _same(_answers(req), [(s.generated, s.score)
                              for s in reference_generate(tiny, prompt, params, STOP)])


def test_long_prompt_prefilled_in_chunks(tiny):
    prompt, params = _prompts(SEED + 3, (70,))[0], PARAMS["greedy"]
    engine = Engine(tiny, num_blocks=20, block_size=16, stop_ids=STOP, prefill_chunk=16)
    (req,) = engine.generate([prompt], params)
    _same(_answers(req), [(s.generated, s.score)
                          for s in reference_generate(tiny, prompt, params, STOP)])


@pytest.mark.parametrize("bad, match", [
    (dict(max_new_tokens=0), "max_new_tokens"), (dict(beam_width=0), "beam_width"),
    (dict(n=3), "temperature"), (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(beam_width=2, temperature=0.5), "beam search"),
    (dict(seed=1.5), "seed"), (dict(seed=-1), "seed must be an integer >= 0"),
    (dict(ignore_eos=1), "ignore_eos"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_new_tokens=4), "min_tokens"),
    (dict(beam_width=2, ignore_eos=True), "beam search")])
def test_bad_sampling_params(bad, match):
    with pytest.raises(ConfigError, match=match):
        SamplingParams(**bad)


def test_bad_requests(tiny):
    engine = Engine(tiny, num_blocks=4, block_size=16)
    with pytest.raises(ConfigError, match="empty"):
        engine.submit([])
    with pytest.raises(ConfigError, match="vocabulary|lie in"):
        engine.submit([TINY.vocab_size])
    with pytest.raises(ConfigError, match="context"):
        engine.submit([1] * 500, SamplingParams(max_new_tokens=20))
    with pytest.raises(ConfigError, match="blocks"):
        engine.submit([1] * 60, SamplingParams(max_new_tokens=20))   # 5 blocks, pool of 4
    assert not engine.scheduler.waiting


def test_beam_select_ranks_and_ends():
    scores = [0.0, -1.0]
    lp = np.array([[-0.1, -2.0], [-0.2, -0.3]])
    ids = np.array([[5, 0], [7, 8]])
    cont, ended = beam_select(scores, lp, ids, 2, {0})
    assert cont == [(0, 5, -0.1), (1, 7, -1.2)] and ended == []
    cont, ended = beam_select(scores, np.array([[-0.1, -0.2], [-9, -9]]), np.array([[0, 5], [1, 2]]),
                              2, {0})
    assert ended == [(0, 0, -0.1)] and cont[0] == (0, 5, -0.2)


def test_best_beams_ranks_by_log_probability_per_token():
    """Hand-made hypotheses (prompt of 2 tokens): per generated token, -0.5, -0.4, -0.6,
    -0.45 and -0.4 again (a tie, broken by the generated tokens)."""
    seqs = [Sequence(1, [9, 9, 1, 2], 2, score=-1.0),        # -0.5 a token
            Sequence(2, [9, 9, 3], 2, score=-0.4),           # -0.4
            Sequence(3, [9, 9, 4, 5, 6], 2, score=-1.8),     # -0.6
            Sequence(4, [9, 9, 7, 8], 2, score=-0.9),        # -0.45
            Sequence(5, [9, 9, 2, 2, 2, 2, 2], 2, score=-2.0)]   # -0.4: [2, ...] < [3]
    ranked = best_beams(seqs, 5)
    assert [s.seq_id for s in ranked] == [5, 2, 4, 1, 3]     # best first
    assert [s.seq_id for s in best_beams(seqs, 2)] == [5, 2]  # more finished than k: cut
    assert best_beams(seqs[:1], 3) == seqs[:1]


def _first_new(tokens):
    """(position, id) of the first generated id, after the first, not seen before it."""
    for i, t in enumerate(tokens):
        if i >= 1 and t not in tokens[:i]:
            return i, t
    raise AssertionError(f"no new id in {tokens}")


@pytest.mark.parametrize("kind", ["greedy", "sampled", "beam4"])
def test_stops_on_an_id_the_model_emits(tiny, kind):
    """The tiny random model never emits the tests' stop id 0 in these runs; here the
    stop id is one it really emits (found by a run without one): the answer must end
    right there, on the engine and on the reference alike."""
    params, prompt = PARAMS[kind], _prompts(SEED)[1]
    free = Engine(tiny, num_blocks=300, block_size=4, stop_ids=())
    (req,) = free.generate([prompt], params)
    best = req.outputs()[0].generated
    i, stop = _first_new(best)
    engine = Engine(tiny, num_blocks=300, block_size=4, stop_ids=(stop,), audit=True)
    (req,) = engine.generate([prompt], params)
    got = _answers(req)
    _same(got, [(s.generated, s.score) for s in reference_generate(tiny, prompt, params,
                                                                   (stop,))])
    if kind == "beam4":
        assert any(g[-1] == stop for g, _ in got)
        assert all(stop not in g[:-1] for g, _ in got)        # none goes past a stop
    else:
        assert got[0][0] == best[:i + 1]                     # the same draws, cut at stop
    assert engine.memory.manager.allocator.num_free == 300


@pytest.mark.parametrize("runner", ["plain", "fast"])
@pytest.mark.parametrize("kind", ["greedy", "sampled", "n4"])
def test_ignore_eos_and_min_tokens(tiny, kind, runner):
    """With a stop id the model emits: ``ignore_eos`` gives the answer of an engine with
    no stop id (every token, the stop id included, up to max_new_tokens); ``min_tokens``
    keeps the stop id out of the first tokens (masked: the next best is chosen) and
    lets it end the answer after."""
    params, prompt = PARAMS[kind], _prompts(SEED)[1]
    free = Engine(tiny, num_blocks=300, block_size=16, stop_ids=(), runner=runner)
    (req,) = free.generate([prompt], params)
    best = req.outputs()[0].generated
    i, stop = _first_new(best)
    engine = Engine(tiny, num_blocks=300, block_size=16, stop_ids=(stop,), audit=True,
                    runner=runner)
    (req,) = engine.generate([prompt], SamplingParams(**{**params.__dict__,
                                                         "ignore_eos": True}))
    assert [s.generated for s in req.outputs()] == \
        [s.generated for s in free.generate([prompt], params)[0].outputs()]
    m = i + 2
    (req,) = engine.generate([prompt], SamplingParams(**{**params.__dict__,
                                                         "min_tokens": m}))
    for s in req.outputs():
        g = s.generated
        assert stop not in g[:m] and (len(g) == params.max_new_tokens or g[-1] == stop)
        assert stop not in g[:-1]
    assert req.outputs()[0].generated[:i] == best[:i]     # the same choices before it
    assert engine.memory.manager.allocator.num_free == 300


# ------------------------------------------------------- the batch sampler, in the runner

def _generated(engine, prompts, params):
    return [[s.generated for s in r.outputs()] for r in engine.generate(prompts, params)]


def test_top_k_one_is_greedy(tiny):
    """top_k = 1 keeps the most likely token alone: sampling at any temperature is greedy."""
    prompts = _prompts(SEED)
    greedy = _generated(Engine(tiny, num_blocks=300, stop_ids=STOP), prompts,
                        PARAMS["greedy"])
    p = SamplingParams(max_new_tokens=20, temperature=1.5, top_k=1, seed=5)
    assert _generated(Engine(tiny, num_blocks=300, stop_ids=STOP), prompts, p) == greedy


def test_top_k_limits_the_sampler(tiny):
    """top_k: every token is among the k most likely of its step."""
    prompt, k = _prompts(SEED)[1], 3
    p = SamplingParams(max_new_tokens=12, temperature=2.0, top_k=k, seed=9)
    (req,) = Engine(tiny, num_blocks=300, stop_ids=STOP).generate([prompt], p)
    tokens = list(prompt)
    for t in req.outputs()[0].generated:
        logits = reference_logits(tiny, tokens)
        assert t in np.argsort(-logits)[:k], (tokens, t)
        tokens.append(t)


def reference_logits(model, tokens):
    """The last position's logits for ``tokens``, from the contiguous-cache oracle."""
    from pagedkv.model.reference import ContiguousCache, reference_forward
    c = model.config
    cache = ContiguousCache(c.layers, c.kv_heads, c.head_dim)
    return np.asarray(reference_forward(model, cache, tokens))[-1]


def test_sampling_is_the_same_whatever_the_batch(tiny):
    """A sequence draws from its own stream (seed, counter): alone or beside others, in one
    batch call, a request gets the same tokens; and the same seed gives the same tokens."""
    prompts = _prompts(SEED)
    p = SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, top_k=40, n=2,
                       seed=7)
    together = _generated(Engine(tiny, num_blocks=300, stop_ids=STOP), prompts, p)
    alone = [_generated(Engine(tiny, num_blocks=300, stop_ids=STOP), [q], p)[0]
             for q in prompts]
    assert together == alone
    assert all(a[0] != a[1] for a in together)             # the two samples draw apart
    q = SamplingParams(**{**p.__dict__, "seed": 8})
    assert _generated(Engine(tiny, num_blocks=300, stop_ids=STOP), prompts, q) \
        != together


def test_sampling_follows_the_reference_sampler(tiny):
    """Each token is the batch sampler's choice for its step: replayed with the oracle
    model's logits, the stream's seed and counter, the reference rule (sort-based, in
    NumPy) chooses the same token."""
    from pagedkv.kernels.sampling import derive_seed, reference_rows
    prompt = _prompts(SEED)[2]
    p = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.85, top_k=20, seed=3)
    (req,) = Engine(tiny, num_blocks=300, stop_ids=STOP).generate([prompt], p)
    tokens, seed = list(prompt), derive_seed(3, 0)
    for i, t in enumerate(req.outputs()[0].generated):
        logits = reference_logits(tiny, tokens).astype(np.float32)[None, :]
        assert int(reference_rows(logits, 0.8, 0.85, 20, seed, i)[0]) == t
        tokens.append(t)


@pytest.mark.parametrize("kind", ["greedy", "sampled", "n4"])
def test_min_tokens_and_stops_in_the_sampler(tiny, kind):
    """min_tokens masks the stop id in its rows, and a stop id ends the answer."""
    params, prompt = PARAMS[kind], _prompts(SEED)[1]
    free = Engine(tiny, num_blocks=300, stop_ids=())
    best = free.generate([prompt], params)[0].outputs()[0].generated
    i, stop = _first_new(best)
    engine = Engine(tiny, num_blocks=300, stop_ids=(stop,), audit=True)
    (req,) = engine.generate([prompt], params)
    assert req.outputs()[0].generated == best[:i + 1]       # the same draws, cut at stop
    m = i + 2
    (req,) = engine.generate([prompt], SamplingParams(**{**params.__dict__,
                                                         "min_tokens": m}))
    for s in req.outputs():
        g = s.generated
        assert stop not in g[:m] and (len(g) == params.max_new_tokens or g[-1] == stop)
    assert engine.memory.manager.allocator.num_free == 300


def test_bad_top_k():
    for bad in (-1, 2.5, "3", True):
        with pytest.raises(ConfigError, match="top_k"):
            SamplingParams(top_k=bad)


# ---------------------------------------------------------------------- the CLI

@pytest.mark.parametrize("argv, match", [
    (["  "], "prompt is empty"), (["hi", "--beam", "0"], "--beam"),
    (["hi", "--n", "3"], "--temperature"), (["hi", "--max-new-tokens", "9000"], "context"),
    (["hi", "--max-new-tokens", "x"], "invalid int"), (["hi", "--top-p", "2"], "--top-p"),
    (["hi", "--beam", "2", "--n", "2", "--temperature", "1"], "beam search"), ([], "required")])
def test_cli_bad_input_is_one_line_and_exit_2(argv, match, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and match in err


def test_cli_too_long_for_the_context(capsys):
    assert main(["What is the capital of France?", "--max-new-tokens", "8180"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exceed the model's context of 8192" in err


def test_cli_missing_model_file(capsys, tmp_path):
    assert main(["hi", "--gguf", str(tmp_path / "none.gguf")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no GGUF file" in err


def test_cli_names_paris():
    """The command a reader runs after set-up, as a separate process."""
    out = subprocess.run([sys.executable, "-m", "pagedkv.generate",
                          "What is the capital of France?", "--max-new-tokens", "16"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout.splitlines()[0]
    assert "Traceback" not in out.stderr
