"""The engine's admission (now / later / never) and preemption (recompute and swap), with and
without the prefix cache: the answers are token-identical to the contiguous-cache oracle in
every configuration (float32 NumPy), the pool and the host pool are whole again at the end, and
the audit passes after every step.

Most tests run a randomly initialised tiny Llama (the real code path, fast); two run
SmolLM2-135M-Instruct itself on chat prompts that share the chat template's system prompt.
"""
import numpy as np
import pytest

import pagedkv.model.runner as runner_module
from pagedkv.errors import AuditError, ConfigError
from pagedkv.model import Llama
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.reference import reference_generate
from pagedkv.model.requests import SamplingParams
from _engine_cases import drain as _drain, generate as _generate
from _tiny import TINY

single_thread_blas()

SEED = 8080
STOP = (0,)
BS = 8

PARAMS = {
    "greedy": SamplingParams(max_new_tokens=16),
    "sampled": SamplingParams(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=5),
    "n3": SamplingParams(max_new_tokens=10, temperature=1.0, n=3, seed=6),
    "beam3": SamplingParams(max_new_tokens=10, beam_width=3),
}
# (prefix caching, preemption, host blocks, pool: "roomy" or "tight")
CONFIGS = {
    "plain": (False, "recompute", 0, "roomy"),
    "cache": (True, "recompute", 0, "roomy"),
    "recompute": (False, "recompute", 0, "tight"),
    "cache+recompute": (True, "recompute", 0, "tight"),
    "swap": (False, "swap", 64, "tight"),
    "cache+swap": (True, "swap", 64, "tight"),
    "swap, host full": (False, "swap", 2, "tight"),
}


def _prompts(seed=SEED, shared=27, tails=(3, 9, 14, 20, 6)):
    """Prompts that share their first ``shared`` tokens, as chat prompts share a system one."""
    rng = np.random.default_rng(seed)
    head = rng.integers(1, TINY.vocab_size, shared).tolist()
    return [head + rng.integers(1, TINY.vocab_size, n).tolist() for n in tails]


def _expected(model, prompts, params):
    return [[(s.generated, s.score) for s in reference_generate(model, p, params, STOP)]
            for p in prompts]


def _run(model, prompts, params, config):
    caching, preemption, host_blocks, pool = CONFIGS[config]
    width = params.width
    worst = max(width * -(-(len(p) + params.max_new_tokens) // BS) for p in prompts)
    blocks = worst + 2 if pool == "tight" else 400
    engine = Engine(model, num_blocks=blocks, block_size=BS, stop_ids=STOP, audit=True,
                    prefix_caching=caching, preemption=preemption, host_blocks=host_blocks)
    reqs = _generate(engine, prompts, params)
    assert engine.memory.manager.allocator.num_free == blocks and len(engine.memory.manager) == 0
    if engine.memory.swapper is not None:
        assert engine.memory.swapper.host.num_used == 0 and not engine.memory.swapper.swapped
    return engine, [[(s.generated, s.score) for s in r.outputs()] for r in reqs]


def _same(got, expect):
    for g, e in zip(got, expect):
        assert [x[0] for x in g] == [x[0] for x in e]
        assert np.allclose([x[1] for x in g], [x[1] for x in e], atol=1e-4)


@pytest.fixture(scope="module")
def expected(tiny):
    return {kind: _expected(tiny, _prompts(), p) for kind, p in PARAMS.items()}


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("kind", list(PARAMS))
def test_answers_do_not_change(tiny, expected, kind, config):
    engine, got = _run(tiny, _prompts(), PARAMS[kind], config)
    _same(got, expected[kind])
    caching, preemption, host_blocks, pool = CONFIGS[config]
    c = engine.memory.counts
    if pool == "tight":
        assert c.preemptions > 0, "the tight pool must preempt"
    else:
        assert c.preemptions == 0
    if caching:
        assert c.cached_tokens >= 3 * 24             # the shared 27 tokens: 3 blocks of 8
    else:
        assert c.cached_tokens == 0
    if preemption == "swap" and host_blocks >= 64:
        assert c.swapped_out > 0 and c.swapped_in > 0 and c.recomputed_tokens == 0
        if caching:                                  # the cache may still hold some blocks
            assert c.swapped_in <= c.swapped_out or PARAMS[kind].width > 1
        elif PARAMS[kind].width == 1:                # no sharing: every block goes both ways
            assert c.swapped_out == c.swapped_in
    if pool == "tight" and (preemption == "recompute" or host_blocks < 64):
        assert c.recomputed_tokens > 0


def test_recompute_hits_the_cache_on_return(tiny):
    """A sequence preempted by recompute finds its own full blocks still cached."""
    prompts, params = _prompts(tails=(1, 2, 3)), SamplingParams(max_new_tokens=40)
    off, _ = _run(tiny, prompts, params, "recompute")
    on, _ = _run(tiny, prompts, params, "cache+recompute")
    assert off.memory.counts.preemptions > 0 and on.memory.counts.preemptions > 0
    assert off.memory.counts.refound_tokens == 0 and on.memory.counts.refound_tokens > 0
    assert on.memory.counts.recomputed_tokens < off.memory.counts.recomputed_tokens


def test_one_copy_per_direction_per_step(tiny, monkeypatch):
    calls = []
    for module, name in ((runner_module, "copy_to_host"), (runner_module, "copy_to_device")):
        real = getattr(module, name)

        def counted(*args, _real=real, _name=name):
            calls.append((len(engine.history), _name))
            return _real(*args)
        monkeypatch.setattr(module, name, counted)
    params = SamplingParams(max_new_tokens=16)
    engine = Engine(tiny, num_blocks=9, block_size=BS, stop_ids=STOP, audit=True,
                    preemption="swap", host_blocks=64)
    _generate(engine, _prompts(), params)
    assert any(n == "copy_to_host" for _, n in calls)
    assert any(n == "copy_to_device" for _, n in calls)
    assert len(calls) == len(set(calls)), "two copies in one direction in one step"


def test_admission_now_later_never(tiny):
    engine = Engine(tiny, num_blocks=10, block_size=BS, stop_ids=STOP)
    prompt = list(range(1, 30))                       # 4 blocks, then 1 for the first token
    with pytest.raises(ConfigError, match="refused: the request may need 12 blocks; the "
                                          "pool has 10"):
        engine.submit(prompt, SamplingParams(max_new_tokens=60))
    with pytest.raises(ConfigError, match="runs 3 sequences; at most 2"):
        Engine(tiny, num_blocks=64, block_size=BS, max_seqs=2).submit(
            prompt, SamplingParams(max_new_tokens=4, beam_width=3))
    assert not engine.scheduler.waiting                          # refused requests are never queued
    a = engine.submit(prompt, SamplingParams(max_new_tokens=40))     # 9 blocks at most
    b = engine.submit(prompt[:20], SamplingParams(max_new_tokens=40))
    assert engine.memory.admission(a) == ("now", "")          # 4 blocks for its prompt
    assert engine.memory.admission(b, promised=8) == ("later", "needs 3 free blocks (watermark "
                                                        "included), 2 are free")
    engine.step()
    assert engine.scheduler.running == [a, b]                    # 4 + 3 blocks: both fit now
    _drain(engine)
    assert a.done and b.done and engine.memory.counts.preemptions > 0   # but not as they grow
    for req, p in ((a, prompt), (b, prompt[:20])):
        expect = reference_generate(tiny, p, req.params, STOP)[0].generated
        assert req.outputs()[0].generated == expect


def test_bad_engine_options(tiny):
    for kw, match in ((dict(preemption="drop"), "preemption"),
                      (dict(preemption="swap"), "host_blocks"),
                      (dict(watermark=1.0), "watermark"), (dict(watermark=True), "watermark")):
        with pytest.raises(ConfigError, match=match):
            Engine(tiny, num_blocks=8, **kw)


# ---------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def smollm2():
    from pagedkv.model import Tokenizer, load_gguf
    ckpt = load_gguf()
    return Tokenizer.from_checkpoint(ckpt), Llama(ckpt.config, ckpt.weights, xp=np,
                                                  dtype=np.float32)


QUESTIONS = ["Explain how a rainbow forms.", "Describe the water cycle.",
             "Why do cats purr?", "What is photosynthesis?"]


def test_real_model_same_answers_with_cache_and_preemption(smollm2):
    """Four chat prompts (the chat template's system prompt in common), 20 greedy tokens each;
    a pool of 6 blocks of 16 holds two of them at the start but not as they grow."""
    tok, model = smollm2
    prompts = [tok.chat(q) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=20)
    expect = [reference_generate(model, p, params, [tok.eos_id])[0].generated for p in prompts]
    assert max(-(-(len(p) + 20) // 16) for p in prompts) <= 6
    for name, kw in {"plain": dict(num_blocks=64),
                     "cache": dict(num_blocks=64, prefix_caching=True),
                     "cache+swap": dict(num_blocks=6, prefix_caching=True,
                                        preemption="swap", host_blocks=32),
                     "recompute": dict(num_blocks=6)}.items():
        engine = Engine(model, block_size=16, stop_ids=[tok.eos_id], audit=True, **kw)
        reqs = engine.generate(prompts, params)
        assert [r.outputs()[0].generated for r in reqs] == expect, name
        c = engine.memory.counts
        assert (c.cached_tokens >= 3 * 16) == name.startswith("cache"), name
        assert (c.preemptions > 0) == (kw["num_blocks"] == 6), name


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
@pytest.mark.parametrize("budget", [None, 40])
def test_many_samples_come_back_with_the_prefix_cache(tiny, preemption, budget):
    """A soak of what a server sees from ``n``-sample requests with the prefix cache: the
    pool fits one of them at a time, so they preempt one another, and a request that
    comes back brings eight sequences whose full blocks are partly cached and partly
    evicted. Every answer is the oracle's, the audit passes after every step, and the
    pool is whole at the end. (Before each sequence's hits were taken before any fresh
    block, one sample's fresh blocks evicted another's cached ones and the step stopped:
    "prefill ended without logits".)"""
    seed = 271828
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    prompts = _prompts(seed, tails=tuple(rng.integers(2, 12, 4).tolist()))
    params = [SamplingParams(max_new_tokens=30, temperature=1.0, n=8, seed=seed + i)
              for i in range(len(prompts))]
    worst = max(8 * -(-(len(p) + 30) // BS) for p in prompts)
    engine = Engine(tiny, num_blocks=worst + 4, block_size=BS, stop_ids=STOP, audit=True,
                    prefix_caching=True, preemption=preemption, token_budget=budget,
                    host_blocks=64 if preemption == "swap" else 0, max_seqs=32)
    reqs = [engine.submit(p, q) for p, q in zip(prompts, params)]
    _drain(engine)
    assert engine.memory.counts.preemptions > 0 and engine.memory.manager.cache.evictions > 0
    if preemption == "recompute":
        assert engine.memory.counts.refound_tokens > 0       # some of them found their blocks
    for req, p, q in zip(reqs, prompts, params):
        expect = [s.generated for s in reference_generate(tiny, p, q, STOP)]
        assert sorted(s.generated for s in req.outputs()) == sorted(expect)
    assert engine.memory.manager.allocator.num_free == engine.memory.manager.allocator.num_blocks
    assert len(engine.memory.manager) == 0


# ---------------------------------------------------------------------- the memory's answers

def _memory(model, num_blocks=20, **kw):
    """An EngineMemory of its own on a fresh engine's pool of blocks of 8."""
    from pagedkv.model.memory import EngineMemory
    manager = Engine(model, num_blocks=num_blocks, block_size=BS).memory.manager
    return EngineMemory(manager, **({"max_seqs": 4} | kw))


def _request(engine_like, prompt, params):
    from pagedkv.model.requests import Request
    req = Request(next(engine_like.ids), list(prompt), params, 1)
    req.hashed = engine_like.manager.prompt(list(prompt))
    return req


def test_the_memorys_settings_are_checked_and_defaulted(tiny):
    from pagedkv.model.memory import EngineMemory
    mem = _memory(tiny, num_blocks=200)
    assert mem.watermark_blocks == 2 and mem.swapper is None and mem.running == []
    assert mem.admission(_request(mem, [1, 2, 3], SamplingParams())) == ("now", "")
    m = mem.manager
    for bad in (1.0, True, -0.1, 1.5):
        with pytest.raises(ConfigError, match=fr"^watermark must be a share of the pool in "
                                              fr"\[0, 1\), got {bad!r}$"):
            EngineMemory(m, max_seqs=4, watermark=bad)
    assert EngineMemory(m, max_seqs=4, watermark=0.999).watermark_blocks == 199
    with pytest.raises(ConfigError, match="^max_seqs must be a positive integer, got 0$"):
        EngineMemory(m, max_seqs=0)
    with pytest.raises(ConfigError, match=r"^host_blocks \(the swap space\) must be a "
                                          r"positive integer, got 0$"):
        EngineMemory(m, max_seqs=4, preemption="swap")
    with pytest.raises(ConfigError, match="^preemption must be 'recompute' or 'swap', "
                                          "got 'drop'$"):
        EngineMemory(m, max_seqs=4, preemption="drop")


def test_admission_counts_a_requests_blocks_at_its_edges(tiny):
    """Blocks to start: the prompt's, then one per sequence at the first step, less one
    when the prompt's last block is partly filled (the first sequence writes into it).
    The worst case may fill the pool less the watermark exactly; a request as wide as
    max_seqs may run; a full house says "later" with the reason."""
    mem = _memory(tiny, num_blocks=20, watermark=0.2)          # 4 blocks kept free
    cases = [([1] * 16, 1, 3), ([1] * 15, 1, 2), ([1] * 16, 3, 5), ([1] * 15, 3, 4)]
    for prompt, n, need in cases:
        params = SamplingParams(max_new_tokens=4, n=n, temperature=1.0 if n > 1 else 0.0)
        req = _request(mem, prompt, params)
        free = 20 - 4 - need                                   # promise the rest away
        assert mem.admission(req, promised=free) == ("now", "")
        assert mem.admission(req, promised=free + 1) == (
            "later", f"needs {need + 4} free blocks (watermark included), "
                     f"{need + 3} are free"), (prompt, n)
    edge = _request(mem, [1] * 8, SamplingParams(max_new_tokens=8 * 16 - 8))   # 16 blocks
    assert mem.admission(edge)[0] == "now"
    over = _request(mem, [1] * 8, SamplingParams(max_new_tokens=8 * 16 - 7))
    assert mem.admission(over)[0] == "never"
    wide = _request(mem, [1] * 3, SamplingParams(max_new_tokens=4, n=4, temperature=1.0))
    assert mem.admission(wide) == ("now", "")
    mem.running = [_request(mem, [1], SamplingParams(max_new_tokens=2, n=2,
                                                     temperature=1.0))]
    assert mem.admission(wide) == ("later", "4 sequences are running")
    narrow = _request(mem, [1] * 3, SamplingParams(max_new_tokens=4, n=2, temperature=1.0))
    assert mem.admission(narrow) == ("now", "")
    assert mem.admit(narrow, 3, promised=20) is None and not narrow.live


def test_width_prefill_and_owed_follow_a_requests_sequences(tiny):
    """What the scheduler asks of a request: its width (all it forks into before its
    first tokens; then its sequences below their length, counting tokens on their way),
    the tokens it must still compute (the cache's hits excluded) and the blocks it owes."""
    engine = Engine(tiny, num_blocks=40, block_size=BS, stop_ids=(), token_budget=10,
                    prefix_caching=True)
    mem = engine.memory
    params = SamplingParams(max_new_tokens=5, temperature=1.0, n=2, seed=1)
    prompt = list(range(1, 30))
    req = engine.submit(prompt, params)
    assert mem.width(req) == 2 and mem.to_prefill(req) == 29 and mem.owed(req) == 0
    engine.step()                                   # a chunk of 10: 2 blocks of the 4
    assert not req.prefilled and mem.to_prefill(req) == 19 and mem.owed(req) == 4 - 2
    for _ in range(3):
        engine.step()
    assert req.prefilled and mem.to_prefill(req) == 0 and mem.owed(req) == 0
    a, b = req.live
    assert [s.parent for s in req.live[1:]] == [a.seq_id]
    assert mem.width(req) == 2
    b.planned = params.max_new_tokens                # at its length (a token on its way)
    assert mem.width(req) == 1
    a.planned = params.max_new_tokens - 1
    assert mem.width(req) == 1
    a.planned = params.max_new_tokens
    assert mem.width(req) == 0
    b.planned = params.max_new_tokens - 1
    assert mem.width(req) == 1
    b.planned = params.max_new_tokens
    req.live.pop()
    assert mem.width(req) == 0
    a.planned = params.max_new_tokens - 1
    assert mem.width(req) == 1
    engine = Engine(tiny, num_blocks=40, block_size=BS, stop_ids=(), prefix_caching=True)
    _generate(engine, [prompt], SamplingParams(max_new_tokens=2))
    again = engine.submit(prompt + [5], SamplingParams(max_new_tokens=2))
    assert engine.memory.to_prefill(again) == 30 - 24   # three blocks of 8 found cached


def test_preemption_is_counted_and_swaps_by_default(tiny):
    """Each preemption counts once; by default (nothing placed this step) a request
    whose K/V are computed is swapped out; every sequence the engine made has ended by
    the end (a fresh request preempted in the step that placed it leaves its sequences
    ended)."""
    engine = Engine(tiny, num_blocks=12, block_size=BS, stop_ids=(), audit=True,
                    preemption="swap", host_blocks=64)
    made, plans = [], []
    new_seq, schedule = engine.memory.new_seq, engine.scheduler.schedule
    engine.memory.new_seq = lambda *a, **k: made.append(new_seq(*a, **k)) or made[-1]
    engine.scheduler.schedule = lambda: plans.append(schedule()) or plans[-1]
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=16)) for p in _prompts()]
    _drain(engine)
    assert engine.memory.counts.preemptions == sum(len(p.preempted) for p in plans) > 1
    assert all(s.ended for s in made) and all(r.done for r in reqs)
    engine = Engine(tiny, num_blocks=40, block_size=BS, stop_ids=(), preemption="swap",
                    host_blocks=64)
    req = engine.submit([1, 2, 3], SamplingParams(max_new_tokens=9))
    engine.step()
    engine.scheduler.running.remove(req)
    assert engine.memory.preempt(req)[0] is True and engine.memory.counts.preemptions == 1


def test_swap_in_keeps_the_watermark_and_the_promised_blocks(tiny):
    """A swapped request comes back only if its blocks and the watermark are free beyond
    the blocks promised; one whose token is still on its way is an audit error."""
    engine = Engine(tiny, num_blocks=20, block_size=BS, stop_ids=(), preemption="swap",
                    host_blocks=64, watermark=0.1)                # 2 blocks kept
    mem = engine.memory
    req = engine.submit(list(range(1, 20)), SamplingParams(max_new_tokens=9))
    engine.step()
    engine.scheduler.running.remove(req)
    swapped, _ = mem.preempt(req)
    assert swapped and mem.swapper.blocks_to_swap_in([req.live[0].seq_id]) == 3
    free = mem.manager.allocator.num_free
    assert mem.swap_in(req, promised=free - 4) is None               # 4 free: 3 + 2 needed
    req.live[0].planned += 1
    with pytest.raises(AuditError, match=f"^request {req.request_id} is swapped in before "
                                         f"its tokens landed$"):
        mem.swap_in(req, promised=free - 5)
    req.live[0].planned -= 1
    assert len(mem.swap_in(req, promised=free - 5)) == 3             # 5 free: it fits


def test_admission_answers_for_a_request_back_from_a_recompute(tiny):
    """Asked right after the step that preempted it (its sequences hashed again for the
    question), admission answers for every sequence the request brings back."""
    engine = Engine(tiny, num_blocks=12, block_size=BS, stop_ids=())
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=16)) for p in _prompts()]
    for _ in range(100):
        engine.step()
        back = [r for r in engine.scheduler.waiting if r.live and r.live[0].generated]
        if back:
            break
    need = sum(-(-len(s.tokens) // BS) for s in back[0].live)
    free = engine.memory.manager.allocator.num_free
    answer = engine.memory.admission(back[0])
    assert answer[0] in ("now", "later") and (answer[0] == "now") == (need <= free)
    _drain(engine)
    assert all(r.done for r in reqs)
