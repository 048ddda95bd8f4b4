"""Preemption in the simulation: by swap (every token's K/V written, swapped out and back, and
verified when its request leaves), by recompute when the host pool is full, and none at all
when admission reserves the worst case; the copies of a step batched one call each way."""
from __future__ import annotations

import pytest

from pagedkv import ConfigError, sim
from pagedkv.sim import preemption
from pagedkv.sim.preemption import (ReservePolicy, SwapPolicy, compare_preemption,
                                    preemption_table)

SEED = 20261201
TB = sim.SIM_SPEC.bytes_per_token      # 512 bytes of K/V per token


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"seed={SEED}")


def _wl(reqs, max_len=288):
    return sim.Workload("hand", tuple(sim.Request(i, a, p, o) for i, (a, p, o) in enumerate(reqs)),
                        max_len, SEED)


def _swap(blocks, block_size, host_blocks, **kw):
    return SwapPolicy(blocks * block_size * TB, block_size,
                      host_bytes=host_blocks * block_size * TB, **kw)


def test_swap_preempts_restores_and_recomputes_nothing():
    # The recompute test's trace (6 blocks of 4 tokens, three requests that outgrow them):
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    policy = _swap(6, 4, 8, write=True)
    probe = sim.ManagerProbe(policy.manager, audit_every=1)
    run = sim.serve(wl, policy, max_seqs=3, observers=[probe])
    assert run.preemptions > 0 and run.recomputed_tokens == 0
    assert run.prefill_tokens == 3 * 4                     # every prompt prefilled once
    assert run.completions == 3 and run.tokens_generated == 24
    assert run.corrupted_tokens == 0 and run.verified_tokens == 3 * 12
    assert policy.swapper.blocks_out == policy.swapper.blocks_in > 0
    assert policy.swapper.host.num_used == 0
    policy.swapper.audit()


def test_swap_falls_back_to_recompute_when_the_host_is_full():
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    policy = _swap(6, 4, 1, write=True)                    # one host block: never enough
    run = sim.serve(wl, policy, max_seqs=3)
    assert run.preemptions > 0 and run.recomputed_tokens > 0
    assert policy.swapper.blocks_out == 0
    assert run.prefill_tokens == 3 * 4 + run.recomputed_tokens
    assert run.corrupted_tokens == 0 and run.completions == 3


def test_swap_catches_a_lost_copy(monkeypatch):
    """If the copy back to the device did nothing, verification would see it."""
    monkeypatch.setattr(preemption, "copy_to_device", lambda host, device, pairs: None)
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    policy = _swap(6, 4, 8, write=True)
    run = sim.serve(wl, policy, max_seqs=3)
    assert run.preemptions > 0 and run.corrupted_tokens > 0


def test_one_copy_each_way_per_step(monkeypatch):
    calls = []
    for name in ("copy_to_host", "copy_to_device"):
        real = getattr(preemption, name)

        def counted(*args, _real=real, _name=name):
            calls.append((recorder.steps, _name))
            return _real(*args)
        monkeypatch.setattr(preemption, name, counted)

    class Steps(sim.Observer):
        steps = 0

        def stepped(self, step, batch, queue, refused):
            self.steps = step

    recorder = Steps()
    wl = sim.make_workload("default", n=40, seed=SEED, rate=1.0)
    policy = _swap(64, 16, 512, write=True)
    run = sim.serve(wl, policy, max_seqs=32, observers=[recorder])
    assert run.preemptions > 5 and run.corrupted_tokens == 0
    assert {n for _, n in calls} == {"copy_to_host", "copy_to_device"}
    assert len(calls) == len(set(calls)), "two copies the same way in one step"


def test_reserving_the_worst_case_never_preempts():
    # max_len 12 = 3 blocks of 4 reserved per request: two of them fit 6 blocks at a time.
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)], max_len=12)
    policy = ReservePolicy(6 * 4 * TB, 4, max_len=12, write=True)
    run = sim.serve(wl, policy, max_seqs=3)
    assert run.preemptions == 0 and run.completions == 3 and run.corrupted_tokens == 0
    assert run.peak_running == 2
    with pytest.raises(ConfigError, match="reserves 7 blocks"):      # max_len 25: 7 blocks
        sim.serve(_wl([(0, 4, 8)], max_len=25), ReservePolicy(6 * 4 * TB, 4, max_len=25),
                  max_seqs=1)


def test_compare_preemption_under_pressure():
    wl = sim.make_workload("default", n=60, seed=SEED, rate=1.0)
    runs = compare_preemption(wl, 1 << 20, block_size=16, host_bytes=8 << 20, max_seqs=64,
                              write=True)
    by = {p.name: p for p in runs}
    for p in runs:
        assert p.run.completions == 60 and p.run.corrupted_tokens == 0
        assert len(p.latency.steps) == 60
    assert by["recompute"].run.preemptions > 0 and by["recompute"].run.recomputed_tokens > 0
    assert by["swap"].run.preemptions > 0 and by["swap"].swapped_blocks > 0
    assert by["swap"].run.recomputed_tokens == 0
    assert by["reserve worst case"].run.preemptions == 0
    assert by["reserve worst case"].throughput < by["recompute"].throughput
    text = preemption_table(runs)
    assert max(len(line) for line in text.splitlines()) <= 88 and "reserve" in text
