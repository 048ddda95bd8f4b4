"""The host/GPU timeline (pagedkv/model/timeline.py): the union of spans against a
brute-force count on a grid, what attaching to an engine records (a step span per step,
a device span per pass, waits inside steps), the bound on what it keeps, and on a GPU the
spans read from CUDA events. Seeds are fixed and printed.
"""
import numpy as np
import pytest

from pagedkv import backend
from pagedkv.model import Llama, random_weights
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from pagedkv.model.timeline import Timeline, attach, busy_seconds
from _tiny import TINY

SEED = 1357


def test_busy_seconds_is_the_union():
    rng = np.random.default_rng(SEED)
    print(f"seed={SEED}")
    for _ in range(50):
        starts = rng.integers(0, 90, 6)
        spans = [("x", int(s), int(s + rng.integers(0, 15))) for s in starts]
        grid = np.zeros(200, bool)                       # unit cells [i, i + 1)
        for _, s, e in spans:
            grid[s:e] = True
        assert busy_seconds(spans) == grid.sum()


@pytest.mark.parametrize("overlap", [False, True])
def test_attached_engine_records_its_steps(overlap):
    model = Llama(TINY, random_weights(TINY, SEED), xp=backend.xp)
    engine = Engine(model, num_blocks=64, runner="fast" if backend.on_gpu else "fast-eager",
                    overlap=overlap)
    tl = attach(engine)
    rng = np.random.default_rng(SEED)
    for n in (5, 9, 20):
        engine.submit(rng.integers(1, 96, n).tolist(), SamplingParams(max_new_tokens=6))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    s = tl.summary()
    names = [n for n, *_ in tl.device()]
    assert s["steps"] == steps and {"prefill", "decode", "draw"} <= set(names)
    assert 0 <= s["device_idle_share"] <= 1 and s["device_busy_s"] <= s["wall_s"]
    for name, a, b in tl.device() + tl.host:
        assert 0 <= a <= b <= s["wall_s"] + 1e-9, name
    host_steps = [(a, b) for n, a, b in tl.host if n == "step"]
    for _, a, b in (h for h in tl.host if h[0] == "wait"):
        assert any(x <= a and b <= y for x, y in host_steps)   # a wait is inside a step
    trace = tl.to_json(1, 2)
    assert sum(1 for n, *_ in trace["host"] if n == "step") == 2


def test_timeline_keeps_at_most_its_limit():
    tl = Timeline(np, limit=3)
    tl.start()
    for i in range(5):
        tl.host_span("step", i, i + 1)
        tl.device_call("decode", None, lambda: None)
    assert len(tl.host) == 3 and len(tl.device()) == 3 and tl.dropped == 4
