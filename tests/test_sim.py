"""Tests of pagedkv.sim: accounting on traces worked out by hand, the token budget and what
recomputation costs, K/V verification that catches corruption of K or V alone, the reservation
policies, sharing savings, and configuration errors."""
from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from pagedkv import ConfigError, sim
from pagedkv.contiguous import FirstFit
from pagedkv.errors import AuditError

SEED = 20261129
TB = sim.SIM_SPEC.bytes_per_token      # 512 bytes of K/V per token


@pytest.fixture(autouse=True)
def _print_seed():
    print(f"seed={SEED}")


def _wl(reqs, max_len=288):
    return sim.Workload("hand", tuple(sim.Request(i, a, p, o) for i, (a, p, o) in enumerate(reqs)),
                        max_len, SEED)


def _paged(blocks, block_size, **kw):
    return sim.PagedPolicy(blocks * block_size * TB, block_size, **kw)


class Corrupt(sim.Observer):
    """Adds 1.0 to one K or V value of the first running sequence's token 2 at step ``at``."""

    def __init__(self, kv, at, half):
        self.kv, self.at, self.half = kv, at, half

    def stepped(self, step, batch, queue, refused):
        if step == self.at:
            slot = self.kv.manager.slot(batch.ids[0], 2)
            bs = self.kv.block_size
            self.kv.cache[slot // bs, self.half, slot % bs, 0, 5] += 1.0


# ------------------------------------------------------------------ accounting by hand

def test_paged_accounting_by_hand():
    # Block size 4, 8 blocks. A: prompt 3, output 2 (final 5). B: prompt 5, output 1 (final 6).
    # Step 1: A 3->4 tokens in 1 block (4 slots), B 5->6 in 2 blocks (8 slots): 10 tokens in 12
    #   slots; min(held, final) = 4 + 6 = 10, so 0 reserved and 2 slots that B will never fill.
    #   B is done and leaves.
    # Step 2: A 4->5 takes a new block: 5 tokens in 8 slots, 3 never filled. A leaves.
    policy = _paged(8, 4, write=True)
    probe = sim.ManagerProbe(policy.manager, audit_every=1, stats_every=1)
    run = sim.serve(_wl([(0, 3, 2), (0, 5, 1)]), policy, max_seqs=2, observers=[probe])
    s = run.series
    assert run.steps == 2 and run.completions == 2 and run.preemptions == 0
    assert s["tokens"].tolist() == [10, 5]
    assert s["held"].tolist() == [12, 8]
    assert s["reserved"].tolist() == [0, 0]
    assert s["internal"].tolist() == [2, 3]
    assert s["external"].tolist() == [0, 0]
    assert s["free"].tolist() == [32 - 12, 32 - 8]
    assert run.tokens_generated == 3 and run.prefill_tokens == 8
    assert run.tokens_written == 3 + 5 + 3 == run.tokens_computed
    assert run.allocations == 1 + 2 + 1
    assert run.verified_tokens == 11 and run.corrupted_tokens == 0
    assert run.stats_at_peak["used_blocks"] == 3


def test_reserved_counts_future_tokens():
    # Block size 8: prompt 2, output 4 (final 6). After step 1: 3 tokens in 8 slots; 3 more will
    # be written (reserved), 2 never (internal).
    run = sim.serve(_wl([(0, 2, 4)]), _paged(4, 8), max_seqs=1)
    assert run.series["reserved"].tolist() == [3, 2, 1, 0]
    assert run.series["internal"].tolist() == [2, 2, 2, 2]


def test_exact_first_fit_external_fragmentation_by_hand():
    # Pool of 12 slots. A, B, C take [0,4), [4,8), [8,12); A and C finish after one step, B after
    # three. D (8 slots) waits: at steps 2 and 3 the pool has 8 free, in two holes of 4, so D is
    # refused although it fits in total -- 8 slots of external fragmentation. D starts at step 4
    # and runs 4 steps.
    wl = _wl([(0, 3, 1), (0, 1, 3), (0, 3, 1), (0, 4, 4)], max_len=12)
    exact = sim.make_policy("exact first-fit", 12 * TB, wl.max_len)
    assert isinstance(exact.space, FirstFit)          # the one first-fit of the package
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


def test_token_bytes_come_from_the_spec():
    spec = sim.SIM_SPEC.__class__(layers=2, kv_heads=4, head_dim=32, dtype="float16")
    policy = sim.make_policy("max-length", 1 << 20, 288, spec=spec)
    assert policy.token_bytes == spec.bytes_per_token == 2 * 2 * 4 * 32 * 2
    assert policy.pool_slots == (1 << 20) // spec.bytes_per_token
    paged = sim.PagedPolicy(1 << 20, 16, spec=spec)         # bookkeeping only: any spec
    assert paged.manager.allocator.block_bytes == spec.block_bytes(16)
    with pytest.raises(ConfigError, match="float32"):        # the data path writes float32
        sim.PagedPolicy(1 << 20, 16, spec=spec, write=True)


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
    assert by["max-length"].peak_running == 1 < by["paged, block 16"].peak_running


# ------------------------------------------------------------------ budget and preemption

def test_token_budget_delays_a_prefill_by_hand():
    # Budget 10 tokens a step. A (prompt 6) costs 6 + 1 = 7; B (prompt 6) needs 7 more: it waits.
    # Step 2: A's next token takes 1, leaving 9 >= 7: B is admitted.
    wl = _wl([(0, 6, 3), (0, 6, 3)])
    run = sim.serve(wl, _paged(16, 4), max_seqs=8, token_budget=10)
    assert run.series["running"].tolist() == [1, 2, 2, 1]
    assert run.series["waiting"].tolist() == [1, 0, 0, 0]
    unlimited = sim.serve(wl, _paged(16, 4), max_seqs=8, token_budget=100)
    assert unlimited.series["running"].tolist() == [2, 2, 2]


def test_preemption_recomputes_is_charged_and_still_verifies():
    # A tiny pool: 6 blocks of 4 tokens; three requests that together outgrow it.
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    policy = _paged(6, 4, write=True)
    probe = sim.ManagerProbe(policy.manager, audit_every=1)
    run = sim.serve(wl, policy, max_seqs=3, observers=[probe])
    assert run.preemptions > 0 and run.recomputed_tokens > 0
    assert run.completions == 3 and run.corrupted_tokens == 0
    assert run.tokens_generated == 24
    # every recomputed token was prefilled (and written) again, and counted as work
    assert run.prefill_tokens == 3 * 4 + run.recomputed_tokens
    assert run.tokens_written == run.tokens_computed == run.prefill_tokens + 24


def test_recomputation_waits_for_the_token_budget():
    # The same trace with a budget that holds only one prefill (and the decodes) per step:
    # recomputations now take budget, so the run needs more steps.
    wl = _wl([(0, 4, 8), (0, 4, 8), (0, 4, 8)])
    loose = sim.serve(wl, _paged(6, 4), max_seqs=3, token_budget=100)
    tight = sim.serve(wl, _paged(6, 4), max_seqs=3, token_budget=12)
    assert tight.preemptions > 0 and tight.steps > loose.steps


def test_a_request_that_fills_the_pool_exactly_is_served():
    # One block of 16 slots: a request that ends with 16 tokens fits, and is admitted.
    run = sim.serve(_wl([(0, 10, 6)]), _paged(1, 16, write=True), max_seqs=1)
    assert run.completions == 1 and run.series["held"].max() == 16
    assert run.corrupted_tokens == 0
    with pytest.raises(ConfigError, match=r"17 tokens.*at most 16 tokens.*1 blocks of 16") as e:
        sim.serve(_wl([(0, 10, 7)]), _paged(1, 16), max_seqs=1)
    assert "pool" in str(e.value)


def test_the_watermark_counts_in_what_fits():
    # 200 blocks of 1 token, watermark 1 % = 2 blocks: at most 198 tokens for one request.
    assert sim.serve(_wl([(0, 100, 98)]), _paged(200, 1), max_seqs=1).completions == 1
    with pytest.raises(ConfigError, match="1% watermark"):
        sim.serve(_wl([(0, 100, 99)]), _paged(200, 1), max_seqs=1)


def test_serve_refuses_a_budget_too_small_for_a_recomputation():
    with pytest.raises(ConfigError, match="token_budget"):
        sim.serve(_wl([(0, 20, 20)]), _paged(64, 4), token_budget=30)


# ------------------------------------------------------------------ K/V data

def test_default_simulation_small_writes_and_verifies():
    run = sim.simulate(n=12, seed=SEED, pool_bytes=1 << 20, max_seqs=4, audit_every=1)
    assert run.completions == 12 and run.preemptions == 0
    assert run.verified_tokens == run.tokens_written > 0
    assert run.corrupted_tokens == 0
    text = sim.dashboard(run)
    assert "0 corrupted" in text and max(len(line) for line in text.splitlines()) <= 88


@pytest.mark.parametrize("half", [0, 1], ids=["K", "V"])
def test_verification_catches_one_corrupted_value_in_k_or_v_alone(half):
    wl = sim.make_workload("default", n=6, seed=SEED)
    policy = sim.PagedPolicy(1 << 20, 16, write=True)
    run = sim.serve(wl, policy, max_seqs=3, observers=[Corrupt(policy.kv, 7, half)])
    assert run.corrupted_tokens == 1


def test_probe_catches_counts_that_disagree():
    class Leak(sim.Observer):           # a block taken behind the simulation's back
        def __init__(self, alloc):
            self.alloc = alloc

        def stepped(self, step, batch, queue, refused):
            if step == 3:
                self.alloc.allocate()
    policy = _paged(64, 4)
    probe = sim.ManagerProbe(policy.manager, stats_every=1)
    with pytest.raises(AuditError, match="step 3"):
        sim.serve(_wl([(0, 4, 8)]), policy, observers=[Leak(policy.manager.allocator), probe])


def test_token_values_distinguish_writers_and_positions():
    k, v = sim.token_values([1, 1, 2], [0, 1, 0])
    assert k.shape == (3, 1, 64) and k.dtype == np.float32
    assert (v == -k).all()
    assert not (k[0] == k[1]).all() and not (k[0] == k[2]).all()
    assert (k < 2 ** 24).all()   # exact in float32


def test_beam_search_copies_and_verifies_every_beam():
    kv = sim.CheckedKV(64 * 4 * TB, 4, write=True)
    seen = []
    used, unshared = sim.beam_search(kv, 0, 6, 12, 4, np.random.default_rng(SEED),
                                     on_step=lambda kv: seen.append(kv.allocator.num_used))
    kv.manager.audit()
    assert kv.allocator.num_used == 0 and len(kv.manager) == 0
    assert kv.copies > 0                     # a shared, partly filled block was written
    assert kv.corrupted == 0 and kv.verified >= 4 * 18
    assert used < unshared                   # sharing saved blocks
    assert len(seen) == 12 and sum(seen) == used


def test_verification_catches_a_skipped_copy(monkeypatch):
    # Without the copy-on-write copies, a forked beam's shared prefix in its new block is garbage.
    monkeypatch.setattr(sim.CheckedKV, "_copy", lambda self, pairs: None)
    kv = sim.CheckedKV(64 * 4 * TB, 4, write=True)
    kv.cache[...] = 0
    sim.parallel_sampling(kv, 0, 6, 3, 2)
    assert kv.corrupted > 0


def test_parallel_sampling_saving_by_hand():
    # Prompt 8 = 2 full blocks of 4, shared by both samples; each then writes 4 tokens into its
    # own third block: 4 blocks in use instead of 6, at each of the 4 steps.
    kv = sim.CheckedKV(16 * 4 * TB, 4, write=True)
    used, unshared = sim.parallel_sampling(kv, 0, 8, 4, 2)
    assert (used, unshared) == (16, 24)
    assert kv.copies == 0 and kv.corrupted == 0
    # A prompt of 6 leaves a shared, half-filled block: each sample's first write copies it.
    kv = sim.CheckedKV(16 * 4 * TB, 4, write=True)
    assert sim.parallel_sampling(kv, 0, 6, 2, 3) == (2 * 4, 2 * 6)
    assert kv.copies == 2 and kv.corrupted == 0   # two of the three copy; the last owns it


def test_sharing_savings_small():
    out = sim.sharing_savings("beam", widths=(2,), n=5, seed=SEED)
    assert 0 < out[2]["saving"] < 1 and out[2]["corrupted"] == 0 and out[2]["verified"] > 0
    par = sim.sharing_savings("parallel", widths=(1, 3), n=5, seed=SEED)
    assert par[1]["saving"] == 0 and par[3]["saving"] > 0


# ------------------------------------------------------------------ the fast bookkeeping

def _fast_usable() -> bool:
    try:
        sim.check_bookkeeping("fast")
    except ConfigError:
        return False
    return True


@pytest.mark.skipif(not _fast_usable(), reason="pagedkv.fast does not provide its classes yet")
def test_fast_bookkeeping_serves_the_same_run():
    wl = sim.make_workload("chat", n=120, seed=SEED, rate=1.0)
    runs = [sim.serve(wl, sim.PagedPolicy(4 << 20, 16, bookkeeping=b, max_seqs=64,
                                          max_len=wl.max_len), max_seqs=64)
            for b in ("teaching", "fast")]
    for key in sim.SERIES:
        assert np.array_equal(runs[0].series[key], runs[1].series[key]), key
    assert runs[0].preemptions == runs[1].preemptions > 0


def test_unknown_bookkeeping_is_refused():
    with pytest.raises(ConfigError, match="bookkeeping"):
        sim.CheckedKV(1 << 20, 16, bookkeeping="quick")


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


def test_memory_needed_grows_with_the_requests():
    small = sim.memory_needed("default", 100, 8, 0)
    assert sim.memory_needed("default", 200, 8, 0) == pytest.approx(2 * small, rel=0.01)
    assert sim.memory_needed("default", 10**9, 8, 0) > 10**12      # about a kB per request
    assert sim.memory_needed("default", 100, 1, 0) > small         # more steps per request


# ------------------------------------------------------------------ bad configurations

@pytest.mark.parametrize("call", [
    lambda: sim.CheckedKV(100, 16),                                    # pool smaller than a block
    lambda: sim.simulate(pool_bytes=4096),                           # ... via simulate
    lambda: sim.simulate(max_seqs=0),                                # zero sequences
    lambda: sim.simulate(n=0),                                       # zero requests
    lambda: sim.make_workload("sharegpt"),                           # unknown preset
    lambda: sim.make_workload("chat", seed=-1),                      # negative seed
    lambda: sim.make_workload("chat", rate=-1.0),                    # negative arrival rate
    lambda: sim.make_workload("chat", rate=float("nan")),
    lambda: _wl([(0, -3, 5)]),                                       # negative prompt
    lambda: _wl([(0, 3, 0)]),                                        # no output
    lambda: _wl([(0, 200, 200)]),                                    # past max_len
    lambda: sim.serve(_wl([(0, 20, 20)]), _paged(2, 16)),            # outgrows the pool
    lambda: sim.serve(_wl([(0, 8, 8)]), sim.make_policy("max-length", 100 * TB, 288)),
    lambda: sim.serve(_wl([(0, 8, 8)]), _paged(8, 4), token_budget=0),
    lambda: sim.make_policy("buddy", 1 << 20, 288),                  # unknown policy
    lambda: sim.make_policy("paged:big", 1 << 20, 288),
    lambda: sim.make_policy("paged:0", 1 << 20, 288),
    lambda: sim.PagedPolicy(1 << 20, -16),                           # negative block size
    lambda: sim.PagedPolicy(1 << 20, 16, watermark=1.0),
    lambda: sim.sharing_savings("greedy"),                           # unknown sharing mode
    lambda: sim.sharing_savings("beam", widths=(0,), n=2),           # beam width 0
])
def test_bad_configuration_raises_config_error(call):
    with pytest.raises(ConfigError) as info:
        call()
    assert str(info.value)        # says what was wrong


# ------------------------------------------------------------------ readable in one sitting

def test_modules_are_short_and_serve_fits_on_a_screen():
    for path in Path(sim.__file__).parent.glob("*.py"):
        assert len(path.read_text().splitlines()) <= 450, path.name
    body = inspect.getsource(sim.serve).split('"""')[2]       # the code after the docstring
    assert len(body.strip().splitlines()) <= 40
