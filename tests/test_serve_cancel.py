"""``Engine.cancel``: a request leaves whichever queue holds it and its blocks go back,
all or nothing, the audit passing after; the requests left run as if it had never been.
"""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams

single_thread_blas()

TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
SEED = 97


@pytest.fixture(scope="module")
def tiny():
    return Llama(TINY, random_weights(TINY, SEED), xp=np)


def _prompts(n, length=20, seed=SEED):
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    return [rng.integers(1, TINY.vocab_size, length).tolist() for _ in range(n)]


def _greedy(n=24):
    return SamplingParams(max_new_tokens=n)


def _held(engine):
    a = engine.memory.manager.allocator
    return a.num_blocks - a.num_free


def _answers(reqs):
    return [[s.generated for s in r.outputs()] for r in reqs]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_cancel_running_and_waiting(tiny, prefix_caching):
    """Cancel a running request of n samples and a waiting one: blocks back, audit
    passes, the others finish with the answers they give without them."""
    prompts = _prompts(4)
    alone = Engine(tiny, num_blocks=200, max_seqs=4, stop_ids=(0,))
    expect = _answers(alone.generate([prompts[0], prompts[2]], _greedy()))
    # (admission counts b as the two sequences its prompt forks into: with max_seqs 3, a
    # and b are admitted in the first step, and c and d wait)
    e = Engine(tiny, num_blocks=200, max_seqs=3, stop_ids=(0,), audit=True,
               prefix_caching=prefix_caching)
    a = e.submit(prompts[0], _greedy())
    b = e.submit(prompts[1], SamplingParams(max_new_tokens=24, temperature=1.0, n=2, seed=3))
    c = e.submit(prompts[2], _greedy())
    d = e.submit(prompts[3], _greedy())
    for _ in range(3):
        e.step()
    assert any(r is b for r in e.scheduler.running) and list(e.scheduler.waiting) == [c, d]
    assert len(b.live) == 2
    held = _held(e)
    b_blocks = {blk for s in b.live for blk in e.memory.manager.block_table(s.seq_id).tolist()}
    had = [list(s.tokens) for s in b.live]
    assert e.cancel(b) is True
    assert not any(r is b for r in e.scheduler.running) and not b.live
    assert [s.tokens for s in b.finished] == had             # what it had, kept
    e.memory.manager.audit()
    assert _held(e) == held - len(b_blocks)
    assert e.cancel(d) is True and d not in e.scheduler.waiting and not d.finished
    e.memory.manager.audit()
    e.run()
    assert _answers([a, c]) == expect
    assert b not in e.finished and d not in e.finished
    assert _held(e) == 0 and len(e.memory.manager) == 0
    assert e.cancel(a) is False                   # already finished: nothing changes


def test_cancel_swapped(tiny):
    """A request preempted by swap holds host blocks: cancel frees those."""
    prompts = _prompts(3, length=30)
    e = Engine(tiny, num_blocks=20, block_size=4, max_seqs=8, stop_ids=(0,), audit=True,
               preemption="swap", host_blocks=40, watermark=0.0)
    reqs = [e.submit(p, _greedy(16)) for p in prompts]
    for _ in range(60):
        e.step()
        if e.scheduler.swapped:
            break
    assert e.scheduler.swapped, "no request was swapped out: the pool is too large for this test"
    victim = e.scheduler.swapped[0]
    host = e.memory.swapper.host
    used = host.num_blocks - host.num_free
    assert used > 0
    assert e.cancel(victim) is True
    assert victim not in e.scheduler.swapped and host.num_free == host.num_blocks
    e.memory.swapper.audit()
    e.memory.manager.audit()
    e.run()
    assert all(r.done for r in reqs)
    assert _held(e) == 0


def test_cancel_refuses_a_stranger_and_changes_nothing(tiny):
    e = Engine(tiny, num_blocks=100, stop_ids=(0,))
    other = Engine(tiny, num_blocks=100, stop_ids=(0,))
    mine = e.submit(_prompts(1)[0], _greedy())
    e.step()
    stranger = other.submit(_prompts(1, seed=5)[0], _greedy())
    stranger.request_id = 10_000          # not one of e's
    held = _held(e)
    with pytest.raises(ConfigError, match="not in this engine's queues"):
        e.cancel(stranger)
    assert _held(e) == held and e.scheduler.running == [mine]
    e.memory.manager.audit()


def test_cancel_with_a_missing_block_changes_nothing(tiny):
    """All or nothing: a running request whose sequence the manager does not hold is
    refused before any block is freed."""
    e = Engine(tiny, num_blocks=100, stop_ids=(0,))
    req = e.submit(_prompts(1)[0], SamplingParams(max_new_tokens=10, temperature=1.0,
                                                  n=2, seed=1))
    e.step()
    e.memory.manager.free(req.live[1].seq_id)    # break it by hand
    held = _held(e)
    with pytest.raises(ConfigError, match="without the blocks"):
        e.cancel(req)
    assert _held(e) == held and req in e.scheduler.running and len(req.live) == 2
