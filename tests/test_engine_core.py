"""The engine's step as plan -> run -> update: the state a step leaves on the engine (none:
only what lasts between steps), what one :class:`~pagedkv.scheduler.Plan` holds and that it
cannot be changed, the swap copies going through the runner (the engine touches no device
array), and the engine's shape (no mixins, no forwarding properties).
"""
import dataclasses
import inspect

import numpy as np
import pytest

from pagedkv.config import EngineConfig
from pagedkv.errors import ConfigError
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import ModelRunner
from pagedkv.scheduler import Plan
from _tiny import TINY

single_thread_blas()

SEED = 4242
BS = 8

#: Everything an engine keeps on itself: its parts, its settings, and what lasts.
ENGINE_FIELDS = {"config", "model", "memory", "runner", "scheduler", "depth", "flight",
                 "finished", "history", "on_step"}


def _prompts(n=5):
    rng = np.random.default_rng(SEED)
    return [rng.integers(1, TINY.vocab_size, int(k)).tolist()
            for k in rng.integers(3, 30, n)]


ENGINES = {
    "plain": dict(),
    "swap": dict(preemption="swap", host_blocks=64, num_blocks=12),
    "cache+budget": dict(prefix_caching=True, token_budget=16),
    "fast bookkeeping": dict(bookkeeping="fast", max_seqs=3),
    "ahead": dict(runner="fast-eager", overlap=True, prefix_caching=True),
}


@pytest.mark.parametrize("name", list(ENGINES))
def test_the_engine_keeps_at_most_twelve_fields(tiny, name):
    """Counted after a few steps (a step's work would have left its fields by then) and at
    the end: nothing of a step lives on the engine."""
    print(f"seed={SEED}")
    kw = dict(num_blocks=200, block_size=BS, stop_ids=(0,), audit=True) | ENGINES[name]
    engine = Engine(tiny, **kw)
    for p in _prompts():
        engine.submit(p, SamplingParams(max_new_tokens=12))
    for _ in range(4):
        engine.step()
    assert set(vars(engine)) == ENGINE_FIELDS
    engine.run()
    assert set(vars(engine)) == ENGINE_FIELDS and len(ENGINE_FIELDS) <= 12
    if name == "swap":
        assert engine.memory.counts.swapped_out > 0    # the run did swap


def test_the_engine_is_one_class_without_forwarding_properties():
    assert Engine.__bases__ == (object,)
    assert not [n for n, v in vars(Engine).items() if isinstance(v, property)]


def test_a_step_is_one_plan(tiny, monkeypatch):
    """The plan the scheduler makes is the one the runner runs and the update applies; it
    cannot be changed."""
    engine = Engine(tiny, num_blocks=200, block_size=BS, stop_ids=())
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=3)) for p in _prompts(3)]
    launched, updated = [], []
    launch, update = engine.runner.launch, engine.update
    monkeypatch.setattr(engine.runner, "launch", lambda p: (launched.append(p), launch(p))[1])
    monkeypatch.setattr(engine, "update", lambda p, o: (updated.append(p), update(p, o))[1])
    engine.step()                                  # all three prefilled, then decoded
    (first,) = launched
    assert isinstance(first, Plan) and updated == [first] and first.number == 0
    assert [c.req for c in first.chunks] == reqs and all(c.last for c in first.chunks)
    assert [r for r, _ in first.parts] == reqs and all(p.first for _, p in first.parts)
    assert first.decodes == tuple(reqs) and len(first.rows.seqs) == 3
    # each request draws twice: its first token (its prefill's last row), then the next
    d = first.draws
    assert d.rows.tolist() == [0, 1, 2, 3, 4, 5] and d.counters.tolist() == [0] * 3 + [1] * 3
    assert d.follow.tolist() == [0, 1, 2] and d.inputs.tolist() == [-1] * 3
    assert first.preempted == ()
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.rows = None
    assert engine.history[-1]["decoded"] == 3
    assert engine.step() == reqs                   # the third token: every one done
    last = launched[-1]
    assert last is not first and last.chunks == () and last.draws.follow.tolist() == [3, 4, 5]
    assert engine.finished == reqs


def test_swap_copies_go_through_the_runner(tiny, monkeypatch):
    """Every swap copy is a call of the runner's, and the calls copy every block the
    memory swapped, each once."""
    calls = []
    real = ModelRunner.swap

    def swap(self, host, ins, outs):
        calls.append((len(engine.history), len(ins), len(outs)))
        return real(self, host, ins, outs)
    monkeypatch.setattr(ModelRunner, "swap", swap)
    engine = Engine(tiny, num_blocks=12, block_size=BS, stop_ids=(0,), audit=True,
                    preemption="swap", host_blocks=64)
    engine.generate(_prompts(), SamplingParams(max_new_tokens=12))
    c = engine.memory.counts
    assert c.swapped_out > 0 and c.swapped_in > 0
    assert sum(o for _, _, o in calls) == c.swapped_out
    assert sum(i for _, i, _ in calls) == c.swapped_in


def test_settings_are_one_frozen_config(tiny):
    """Keywords and an EngineConfig build the same engine; the config is checked once, with
    errors that name the setting."""
    config = EngineConfig(num_blocks=32, block_size=BS, max_seqs=4, stop_ids=(3, 1))
    assert Engine(tiny, config).config == Engine(tiny, num_blocks=32, block_size=BS,
                                                 max_seqs=4, stop_ids=[1, 3]).config
    assert Engine(tiny, config, max_seqs=2).config == config.replace(max_seqs=2)
    assert config.stop_ids == (1, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_seqs = 8
    for bad, match in [(dict(num_blocks=0), "num_blocks"), (dict(runner="gpu"), "runner"),
                       (dict(preemption="swap"), "host_blocks"),
                       (dict(watermark=1.5), "watermark"), (dict(blocks=4), "no setting"),
                       (dict(token_budget=0), "token_budget"), (dict(stop_ids=[-1]), "stop_ids"),
                       (dict(bookkeeping="slow"), "bookkeeping")]:
        with pytest.raises(ConfigError, match=match):
            Engine(tiny, **(dict(num_blocks=8) | bad))
    with pytest.raises(ConfigError, match="num_blocks"):
        Engine(tiny)


def test_the_engine_module_reads_as_three_calls():
    """``step`` is the loop: schedule, launch, land and update, nothing else."""
    body = inspect.getsource(Engine.step)
    for call in ("self.scheduler.schedule()", "self.runner.launch(plan)",
                 "self.runner.land(launched)", "self.update(plan"):
        assert call in body
