"""Tests of pagedkv.sim: accounting on traces worked out by hand, K/V verification that catches
corruption, the reservation policies' first fit, sharing savings, and configuration errors."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv import ConfigError, sim
from pagedkv.__main__ import main

SEED = 20261129
TB = 512  # bytes of K/V per token (128 float32 values)


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"seed={SEED}")


def _wl(reqs, max_len=288):
    return sim.Workload("hand", tuple(sim.Request(i, a, p, o) for i, (a, p, o) in enumerate(reqs)),
                        max_len, SEED)


# ------------------------------------------------------------------ accounting by hand

def test_paged_accounting_by_hand():
    # Block size 4, 8 blocks. A: prompt 3, output 2 (final 5). B: prompt 5, output 1 (final 6).
    # Step 1: A 3->4 tokens in 1 block (4 slots), B 5->6 in 2 blocks (8 slots): 10 tokens in 12
    #   slots; min(cap, final) = 4 + 6 = 10, so 0 reserved and 2 slots that B will never fill.
    #   B is done and leaves.
    # Step 2: A 4->5 takes a new block: 5 tokens in 8 slots, 3 never filled. A leaves.
    policy = sim.PagedPolicy(8 * 4 * TB, 4, write=True)
    run = sim.serve(_wl([(0, 3, 2), (0, 5, 1)]), policy, max_seqs=2, audit_every=1)
    s = run.series
    assert run.steps == 2 and run.completions == 2 and run.preemptions == 0
    assert s["tokens"].tolist() == [10, 5]
    assert s["held"].tolist() == [12, 8]
    assert s["reserved"].tolist() == [0, 0]
    assert s["internal"].tolist() == [2, 3]
    assert s["external"].tolist() == [0, 0]
    assert s["free"].tolist() == [32 - 12, 32 - 8]
    assert run.tokens_generated == 3
    assert run.tokens_written == 3 + 5 + 3
    assert run.block_allocs == 1 + 2 + 1
    assert run.verified_tokens == 11 and run.corrupted_tokens == 0


def test_reserved_counts_future_tokens():
    # Block size 8: prompt 2, output 4 (final 6). After step 1: 3 tokens in 8 slots; 3 more will
    # be written (reserved), 2 never (internal).
    run = sim.serve(_wl([(0, 2, 4)]), sim.PagedPolicy(4 * 8 * TB, 8), max_seqs=1)
    assert run.series["reserved"].tolist() == [3, 2, 1, 0]
    assert run.series["internal"].tolist() == [2, 2, 2, 2]


def test_first_fit_refuses_what_fits_in_total():
    space = sim.FirstFit(10)
    assert [space.alloc(4), space.alloc(2), space.alloc(4)] == [0, 4, 6]
    space.free(0, 4)
    space.free(6, 4)
    assert space.free_total == 8 and space.largest() == 4
    assert space.alloc(6) is None                  # 8 free, but in two holes of 4
    space.free(4, 2)                               # the middle comes back: one hole of 10
    assert space.starts == [0] and space.lengths == [10]
    with pytest.raises(ConfigError):
        space.free(3, 2)                           # already free


def test_exact_first_fit_external_fragmentation_by_hand():
    # Pool of 12 slots. A, B, C take [0,4), [4,8), [8,12); A and C finish after one step, B after
    # three. D (8 slots) waits: at steps 2 and 3 the pool has 8 free, in two holes of 4, so D is
    # refused although it fits in total -- 8 slots of external fragmentation. D starts at step 4
    # and runs 4 steps.
    wl = _wl([(0, 3, 1), (0, 1, 3), (0, 3, 1), (0, 4, 4)], max_len=12)
    exact = sim.make_policy("exact first-fit", 12 * TB, wl.max_len)
    run = sim.serve(wl, exact, max_seqs=8)
    assert run.series["external"].tolist() == [0, 8, 8, 0, 0, 0, 0]
    assert run.series["running"].tolist() == [3, 1, 1, 1, 1, 1, 1]
    assert run.steps == 7 and run.completions == 4
    # Paged (3 blocks of 4) places D at step 2, in the two blocks A and C left.
    paged = sim.serve(wl, sim.make_policy("paged:4", 12 * TB, wl.max_len), max_seqs=8)
    assert paged.series["running"].tolist()[:2] == [3, 2]
    assert paged.series["external"].max() == 0
    assert paged.steps < run.steps


def test_reservation_sizes():
    r = sim.Request(0, 0, 10, 25)
    assert sim.make_policy("max-length", 1 << 20, 288).reserve(r) == 288
    assert sim.make_policy("power-of-two", 1 << 20, 288).reserve(r) == 10 + 32
    assert sim.make_policy("exact first-fit", 1 << 20, 288).reserve(r) == 35


def test_categories_add_up_for_every_policy():
    wl = sim.make_workload("alpaca", n=60, seed=SEED, rate=0.5)
    for run in sim.compare_policies(wl, 1 << 20, block_sizes=(1, 16)):
        s = run.series
        total = s["tokens"] + s["reserved"] + s["internal"] + s["external"] + s["free"]
        assert (total == run.pool_slots).all(), run.policy
        assert (s["reserved"] >= 0).all() and (s["internal"] >= 0).all(), run.policy
        assert run.completions == 60 and run.tokens_generated == sum(r.output for r in wl.requests)
        assert abs(sum(run.breakdown(busy=False).values()) - 1) < 1e-9
    by = {r.policy: r for r in sim.compare_policies(wl, 1 << 20, block_sizes=(16,))}
    # max-length holds 2048 slots per request: a 1 MiB pool (2048 slots) serves one at a time
    assert by["max-length"].peak_running < by["paged, block 16"].peak_running


def test_preemption_recomputes_and_still_verifies():
    # A tiny pool: 6 blocks of 4 tokens; three requests that together outgrow it.
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    policy = sim.PagedPolicy(6 * 4 * TB, 4, write=True)
    run = sim.serve(wl, policy, max_seqs=3, audit_every=1)
    assert run.preemptions > 0
    assert run.completions == 3 and run.corrupted_tokens == 0
    assert run.tokens_generated >= 24


# ------------------------------------------------------------------ K/V data

def test_default_simulation_small_writes_and_verifies():
    run = sim.simulate(n=12, seed=SEED, pool_bytes=1 << 20, max_seqs=4, audit_every=1)
    assert run.completions == 12 and run.preemptions == 0
    assert run.verified_tokens == run.tokens_written > 0
    assert run.corrupted_tokens == 0
    assert "0 corrupted" in sim.dashboard(run)


def test_verification_catches_a_corrupted_token():
    def tamper(kv, step):
        if step == 7:
            sid = kv.manager.seq_ids[0]
            slot = kv.manager.slot(sid, 2)
            kv.cache[slot // kv.block_size, 1, slot % kv.block_size, 0, 5] += 1.0  # one V value
    run = sim.simulate(n=6, seed=SEED, pool_bytes=1 << 20, max_seqs=3, tamper=tamper)
    assert run.corrupted_tokens == 1


def test_token_values_distinguish_writers_and_positions():
    k, v = sim.token_values([1, 1, 2], [0, 1, 0])
    assert k.shape == (3, 1, 64) and k.dtype == np.float32
    assert (v == -k).all()
    assert not (k[0] == k[1]).all() and not (k[0] == k[2]).all()
    assert (k < 2 ** 24).all()   # exact in float32


def test_beam_search_copies_and_verifies_every_beam():
    kv = sim.PagedKV(64 * 4 * TB, 4, write=True)
    record = []
    used, unshared = sim.beam_search(kv, 0, 6, 12, 4, np.random.default_rng(SEED), record=record)
    kv.manager.audit()
    assert kv.allocator.num_used == 0 and len(kv.manager) == 0
    assert kv.copies > 0                     # a shared, partly filled block was written
    assert kv.corrupted == 0 and kv.verified >= 4 * 18
    assert used < unshared                   # sharing saved blocks
    assert len(record) == 12 and record[-1][2].shape == (64,)


def test_verification_catches_a_skipped_copy(monkeypatch):
    # Without the copy-on-write copies, a forked beam's shared prefix in its new block is garbage.
    monkeypatch.setattr(sim.PagedKV, "_copy", lambda self, pairs: None)
    kv = sim.PagedKV(64 * 4 * TB, 4, write=True)
    kv.cache[...] = 0
    sim.parallel_sampling(kv, 0, 6, 3, 2)
    assert kv.corrupted > 0


def test_parallel_sampling_saving_by_hand():
    # Prompt 8 = 2 full blocks of 4, shared by both samples; each then writes 4 tokens into its
    # own third block: 4 blocks in use instead of 6, at each of the 4 steps.
    kv = sim.PagedKV(16 * 4 * TB, 4, write=True)
    used, unshared = sim.parallel_sampling(kv, 0, 8, 4, 2)
    assert (used, unshared) == (16, 24)
    assert kv.copies == 0 and kv.corrupted == 0
    # A prompt of 6 leaves a shared, half-filled block: each sample's first write copies it.
    kv = sim.PagedKV(16 * 4 * TB, 4, write=True)
    assert sim.parallel_sampling(kv, 0, 6, 2, 3) == (2 * 4, 2 * 6)
    assert kv.copies == 2 and kv.corrupted == 0   # two of the three copy; the last owns it


def test_sharing_savings_small():
    out = sim.sharing_savings("beam", widths=(2,), n=5, seed=SEED)
    assert 0 < out[2]["saving"] < 1 and out[2]["corrupted"] == 0 and out[2]["verified"] > 0
    par = sim.sharing_savings("parallel", widths=(1, 3), n=5, seed=SEED)
    assert par[1]["saving"] == 0 and par[3]["saving"] > 0


# ------------------------------------------------------------------ workloads

def test_presets_match_their_documented_means():
    for preset, (pin, pout) in {"chat": (161, 338), "alpaca": (19.3, 58.5)}.items():
        p, o = sim.make_workload(preset, n=20000, seed=SEED).lengths()
        assert abs(p.mean() / pin - 1) < 0.03 and abs(o.mean() / pout - 1) < 0.03, preset
        assert (p + o).max() <= sim.PRESETS[preset]["max_len"]
    p, o = sim.make_workload("default", seed=SEED).lengths()
    assert len(p) == 100 and p.min() >= 4 and p.max() <= 32 and o.min() >= 32 and o.max() <= 256


def test_workloads_are_deterministic_and_poisson():
    a = sim.make_workload("chat", n=500, seed=SEED, rate=0.5)
    assert a == sim.make_workload("chat", n=500, seed=SEED, rate=0.5)
    arr = np.array([r.arrival for r in a.requests])
    assert (np.diff(arr) >= 0).all()
    assert 0.4 < len(arr) / arr[-1] < 0.6          # about 0.5 requests per step
    assert a != sim.make_workload("chat", n=500, seed=SEED + 1, rate=0.5)


# ------------------------------------------------------------------ bad configurations

@pytest.mark.parametrize("call", [
    lambda: sim.PagedKV(100, 16),                                    # pool smaller than a block
    lambda: sim.simulate(pool_bytes=4096),                           # ... via simulate
    lambda: sim.simulate(max_seqs=0),                                # zero sequences
    lambda: sim.simulate(n=0),                                       # zero requests
    lambda: sim.make_workload("sharegpt"),                           # unknown preset
    lambda: sim.make_workload("chat", rate=-1.0),                    # negative arrival rate
    lambda: sim.make_workload("chat", rate=float("nan")),
    lambda: sim.serve(_wl([(0, -3, 5)]), sim.PagedPolicy(1 << 20, 16)),   # negative prompt
    lambda: sim.serve(_wl([(0, 3, 0)]), sim.PagedPolicy(1 << 20, 16)),    # no output
    lambda: sim.serve(_wl([(0, 200, 200)]), sim.PagedPolicy(1 << 20, 16)),  # past max_len
    lambda: sim.serve(_wl([(0, 20, 20)]), sim.PagedPolicy(2 * 16 * TB, 16)),  # outgrows the pool
    lambda: sim.serve(_wl([(0, 8, 8)]), sim.make_policy("max-length", 100 * TB, 288)),
    lambda: sim.make_policy("buddy", 1 << 20, 288),                  # unknown policy
    lambda: sim.make_policy("paged:big", 1 << 20, 288),
    lambda: sim.make_policy("paged:0", 1 << 20, 288),
    lambda: sim.PagedPolicy(1 << 20, -16),                           # negative block size
    lambda: sim.sharing_savings("greedy"),                           # unknown sharing mode
    lambda: sim.sharing_savings("beam", widths=(0,), n=2),           # beam width 0
])
def test_bad_configuration_raises_config_error(call):
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value)        # says what was wrong


# ------------------------------------------------------------------ the command line

def test_main_prints_the_dashboard(capsys):
    assert main(["--requests", "5", "--concurrency", "2", "--seed", str(SEED)]) == 0
    out = capsys.readouterr().out
    assert "5 completions" in out and "0 corrupted" in out
    assert main(["--block-size", "0"]) == 2             # a ConfigError, reported, exit code 2
