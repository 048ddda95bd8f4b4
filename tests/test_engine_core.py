"""The engine's step as schedule -> execute -> update: the state a step leaves on the engine
(none: only what lasts between steps), what one :class:`~pagedkv.scheduler.Schedule` holds,
and the swap copies going through the runner (the engine touches no device array).
"""
import numpy as np
import pytest

from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.model.runner import ModelRunner
from pagedkv.scheduler import Schedule

single_thread_blas()

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
SEED = 4242
BS = 8

#: Everything an engine keeps on itself: its parts, its settings, and what lasts.
ENGINE_FIELDS = {"model", "runner", "memory", "scheduler", "stop_ids", "prefill_chunk",
                 "audit", "on_step", "finished", "history", "ahead"}


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_weights(TINY, SEED), xp=np)


def _prompts(n=5):
    rng = np.random.default_rng(SEED)
    return [rng.integers(1, TINY.vocab_size, int(k)).tolist()
            for k in rng.integers(3, 30, n)]


ENGINES = {
    "plain": dict(),
    "swap": dict(preemption="swap", host_blocks=64, num_blocks=12),
    "cache+budget": dict(prefix_caching=True, token_budget=16),
    "fast single pass": dict(runner="fast-eager", single_pass=True, token_budget=16),
    "fast bookkeeping": dict(bookkeeping="fast", max_seqs=3),
    "overlap": dict(runner="fast-eager", overlap=True, prefix_caching=True),
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
        assert engine.counts.swapped_out > 0    # the run did swap


def test_a_step_is_one_schedule(tiny, monkeypatch):
    """The schedule the scheduler returns is the one the engine executes and updates."""
    engine = Engine(tiny, num_blocks=200, block_size=BS, stop_ids=())
    reqs = [engine.submit(p, SamplingParams(max_new_tokens=3)) for p in _prompts(3)]
    seen = []
    execute = engine.execute
    monkeypatch.setattr(engine, "execute", lambda s: (seen.append(s), execute(s))[1])
    engine.step()                                  # all three prefilled, then decoded
    (first,) = seen
    assert isinstance(first, Schedule) and first is engine.scheduler.schedule
    assert [c.req for c in first.chunks] == reqs and all(c.last for c in first.chunks)
    assert first.parts == []                       # every part computed
    assert first.decodes == reqs and len(first.seqs) == 3 and first.plan is not None
    assert first.preempted == [] and first.finished == []
    assert engine.history[-1]["decoded"] == 3
    engine.step()
    last = seen[-1]
    assert last is not first and last.chunks == [] and last.finished == reqs
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
    c = engine.counts
    assert c.swapped_out > 0 and c.swapped_in > 0
    assert sum(o for _, _, o in calls) == c.swapped_out
    assert sum(i for _, i, _ in calls) == c.swapped_in
