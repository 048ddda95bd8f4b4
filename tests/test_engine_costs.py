"""The engine's per-step costs: its history comes from counters (never a pass over the pool),
stays bounded, and agrees with the manager's full ``stats()``; a prompt is hashed once per
admission; prompts follow the token-id rule before anything is queued."""
import numpy as np
import pytest

import pagedkv.prefix_cache as prefix_cache
from pagedkv.errors import ConfigError
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams

SEED = 4321
single_thread_blas()


def test_history_is_read_from_counters_and_equals_stats(tiny, monkeypatch):
    """Beams and n samples share and copy blocks; after every step the history's numbers
    are the ones ``stats()`` computes by walking every block, while ``_record`` itself
    never calls it."""
    seen = []

    def check(engine):
        s = engine.memory.manager.stats()
        h = engine.history[-1]
        seen.append(h["shared_blocks"])
        assert (h["used_blocks"], h["shared_blocks"], h["blocks_saved"], h["sequences"],
                h["tokens"]) == (s.used_blocks, s.shared_blocks, s.blocks_saved_by_sharing,
                                 s.sequences, s.tokens)
        assert engine.memory.manager.allocator.num_shared == s.shared_blocks

    engine = Engine(tiny, num_blocks=60, block_size=4, stop_ids=(0,), audit=True,
                    on_step=check, prefix_caching=True)
    stats = engine.memory.manager.stats
    calls = []
    monkeypatch.setattr(engine.memory.manager, "stats", lambda: calls.append(1) or stats())
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, 96, n).tolist() for n in (9, 14, 5)]
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=8, beam_width=3))
    engine.generate(prompts[1:], SamplingParams(max_new_tokens=8, temperature=1.0, n=3,
                                                seed=5))
    assert max(seen) > 0                          # blocks were shared
    assert len(calls) == len(engine.history)      # stats(): only the check's own calls


def test_history_is_bounded(tiny, monkeypatch):
    monkeypatch.setattr(Engine, "history_steps", 5)
    engine = Engine(tiny, num_blocks=20, block_size=4, stop_ids=())
    steps = []
    engine.on_step = lambda e: steps.append(1)
    engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=12))
    assert len(steps) == 11 and len(engine.history) == 5   # (the prefill step chose one)


def test_a_prompt_is_hashed_once_per_admission(tiny, monkeypatch):
    """A 253-token prompt at 4 tokens a block has 63 full blocks. Its second admission
    finds all 63 cached and hashes each once (submit, admission, the prefill's lookup and
    the add all use the one hashed prompt)."""
    calls = []
    real = prefix_cache.block_hash
    monkeypatch.setattr(prefix_cache, "block_hash",
                        lambda p, t: calls.append(1) or real(p, t))
    engine = Engine(tiny, num_blocks=140, block_size=4, stop_ids=(), prefix_caching=True)
    prompt = np.random.default_rng(1).integers(1, 96, 253).tolist()
    engine.generate([prompt], SamplingParams(max_new_tokens=1))
    calls.clear()
    (req,) = engine.generate([prompt], SamplingParams(max_new_tokens=1))
    assert engine.memory.counts.cached_tokens == 252
    assert len(calls) == 63


def test_a_recomputed_sequence_is_hashed_once_per_admission(tiny, monkeypatch):
    """A sequence preempted by recompute comes back through admission (asked once a step
    while it waits) and prefill: its tokens are hashed once for all of that."""
    engine = Engine(tiny, num_blocks=12, block_size=4, stop_ids=(), prefix_caching=True)
    calls = []
    real = engine.memory.manager.prompt
    def counted(tokens):                          # (a Prompt passes through unhashed)
        if not isinstance(tokens, prefix_cache.Prompt):
            calls.append(len(tokens))
        return real(tokens)
    monkeypatch.setattr(engine.memory.manager, "prompt", counted)
    rng = np.random.default_rng(2)
    reqs = engine.generate([rng.integers(1, 96, 10).tolist() for _ in range(3)],
                           SamplingParams(max_new_tokens=16))
    assert engine.memory.counts.preemptions > 0
    assert len(calls) == 3 + engine.memory.counts.preemptions   # submit, and once per return
    assert all(len(r.outputs()[0].generated) == 16 for r in reqs)


@pytest.mark.parametrize("bad", [[True, 2], [1.0, 2], [1, None], None, "12",
                                 np.array([1.0, 2.0])])
def test_a_prompt_breaking_the_token_rule_is_refused(tiny, bad):
    engine = Engine(tiny, num_blocks=20, block_size=4)
    with pytest.raises(ConfigError, match="token ids"):
        engine.submit(bad)
    assert not engine.scheduler.waiting
