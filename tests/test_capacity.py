"""Tests of pagedkv.sim.capacity and pagedkv.plots.capacity: the arithmetic against counts
made by hand, the simulation against the arithmetic, the budget's sources, bad input, and
the figure's artists."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from pagedkv import sim
from pagedkv.errors import ConfigError
from pagedkv.plots.capacity import SEGMENTS, plot_capacity
from pagedkv.sim import capacity as cap
from pagedkv.spec import KVSpec

SEED = 20261202
#: 8 bytes a token (2 x 1 layer x 1 head x 2 numbers x 2 bytes).
TINY = KVSpec(layers=1, kv_heads=1, head_dim=2, dtype="float16")
#: Counted by hand below: blocks of 4 -> 2, 1, 3, 1, 3, 1, 2, 4 blocks.
TINY_LENGTHS = [5, 3, 9, 4, 12, 1, 7, 16]


def test_the_numbers_and_their_sources():
    assert cap.LLAMA3_8B.bytes_per_token == 131_072 == 2 * 32 * 8 * 128 * 2
    assert cap.llama3_8b_params() == cap.LLAMA3_8B_PARAMS == 8_030_261_248
    b = cap.kv_budget()
    assert b.gpu_bytes == 141_000_000_000
    assert b.weight_bytes == 16_060_522_496
    assert b.engine_bytes == 126_900_000_000            # 0.9 x 141 GB
    assert b.runtime_bytes == 14_100_000_000
    assert b.kv_bytes == 110_839_477_504
    assert b.weight_bytes + b.runtime_bytes + b.kv_bytes == b.gpu_bytes


def test_fit_sequences_by_hand():
    kv_bytes = 64 * 8 + 5              # 64 tokens and 5 stray bytes; 16 blocks of 4
    contig, paged = cap.fit_sequences(TINY_LENGTHS, kv_bytes, spec=TINY, context=16,
                                      block_size=4)
    # contiguous: 64 // 16 = 4 reservations, holding the first four requests
    assert (contig.sequences, contig.pool_tokens, contig.held_tokens) == (4, 64, 64)
    assert contig.stored_tokens == 5 + 3 + 9 + 4
    assert (contig.empty_tokens, contig.free_tokens) == (64 - 21, 0)
    # paged: blocks 2+1+3+1+3+1+2 = 13 fit in 16; the eighth's 4 would make 17
    assert (paged.sequences, paged.pool_tokens, paged.held_tokens) == (7, 64, 52)
    assert paged.stored_tokens == 5 + 3 + 9 + 4 + 12 + 1 + 7
    assert (paged.empty_tokens, paged.free_tokens) == (52 - 41, 12)
    assert contig.token_bytes == paged.token_bytes == 8
    assert contig.scheme == "contiguous, 16" and paged.scheme == "paged, block 4"


def test_a_block_of_one_stores_every_slot_it_holds():
    _, paged = cap.fit_sequences(TINY_LENGTHS + [16], 64 * 8, spec=TINY, context=16,
                                 block_size=1)
    assert (paged.sequences, paged.held_tokens) == (8, 57)      # 57 slots; +16 > 64
    assert paged.empty_tokens == 0


@pytest.mark.parametrize("lengths, kv_bytes, match", [
    ([], 512, "non-empty 1-D array of positive integers"),
    ([3, 0, 4], 512, "positive integers"),
    ([2.5, 3.0], 512, "positive integers, got float64"),
    ([3, 17], 512, "17 tokens is longer than the context of 16"),
    ([3] * 40, 100, "hold 12 tokens of 8 bytes, less than one context of 16"),
    ([3, 4], 512, "all 2 lengths fit in 16 blocks of 4 tokens"),
    ([3] * 40, 0, "kv_bytes must be a positive integer, got 0"),
])
def test_fit_sequences_refuses_what_cannot_be_counted(lengths, kv_bytes, match):
    with pytest.raises(ConfigError, match=match):
        cap.fit_sequences(lengths, kv_bytes, spec=TINY, context=16, block_size=4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(utilization=0.0), r"share of the GPU in \(0, 1\], got 0.0"),
    (dict(utilization=1.5), r"got 1.5"),
    (dict(utilization=True), r"got True"),
    (dict(gpu_bytes=10 * cap.GB), "leave no room for K/V in 90% of 10,000,000,000 bytes"),
    (dict(weight_bytes=-1), "weight_bytes must be a positive integer, got -1"),
])
def test_kv_budget_refuses_impossible_splits(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        cap.kv_budget(**kwargs)


def _admission_bound(workload, pool_tokens, block_size):
    """At most this many run at once: each running request holds at least the blocks
    of its prompt and one more token; pack the smallest first (an oracle written here,
    sharing nothing with the module)."""
    need = sorted(-(-(r.prompt + 1) // block_size) for r in workload.requests)
    total, n = 0, 0
    for b in need:
        if total + b > pool_tokens // block_size:
            break
        total, n = total + b, n + 1
    return n


@pytest.fixture(scope="module")
def tenth_of_an_h200():
    """A tenth of the chapter's K/V budget (84,563 token slots), 600 chat requests
    arriving at one a step: faster than they finish, so memory limits the batch."""
    print(f"seed={SEED}")
    kv_bytes = cap.kv_budget().kv_bytes // 10
    wl = sim.make_workload("chat", n=600, seed=SEED, rate=1.0)
    fits = cap.fit_sequences([r.total for r in wl.requests], kv_bytes)
    runs = cap.simulate_capacity(wl, kv_bytes)
    return kv_bytes, wl, fits, runs


def test_max_length_runs_exactly_what_the_arithmetic_counts(tenth_of_an_h200):
    kv_bytes, wl, (contig, _), runs = tenth_of_an_h200
    run = runs["max-length"]
    assert contig.sequences == (kv_bytes // 131_072) // 8192 == 10
    # ranges of one size leave no holes: a finished range is refilled at the next step
    assert run.peak_running == contig.sequences
    assert cap.concurrency(run) == contig.sequences
    assert run.completions == len(wl) and run.preemptions == 0


def test_paged_runs_between_full_lengths_and_prompts_only(tenth_of_an_h200):
    """The arithmetic counts every sequence at its full length; in the simulation the
    running sequences are part-way through their outputs and hold less, so more run at
    once than it counts. None can hold less than its prompt and the next token, which
    bounds the count from above."""
    kv_bytes, wl, (_, paged), runs = tenth_of_an_h200
    run = runs["paged:16"]
    upper = _admission_bound(wl, run.pool_slots, 16)
    mean = cap.concurrency(run)
    assert paged.sequences < mean < upper, (paged.sequences, mean, upper)
    assert run.peak_running <= upper
    busy = run.series["waiting"] > 0
    assert busy.sum() > 100                               # memory was the limit a while
    held = run.series["held"][busy] / run.pool_slots
    assert held.mean() > 0.95                             # ... and the pool was full
    assert run.completions == len(wl)


def test_the_simulation_pool_has_the_arithmetic_slots(tenth_of_an_h200):
    kv_bytes, _, (contig, paged), runs = tenth_of_an_h200
    assert runs["max-length"].pool_slots == contig.pool_tokens
    assert runs["paged:16"].pool_slots == paged.pool_tokens


def test_capacity_table(tenth_of_an_h200):
    kv_bytes, _, fits, runs = tenth_of_an_h200
    budget = cap.kv_budget()
    simulated = [cap.concurrency(r) for r in runs.values()]
    text = cap.capacity_table(budget, fits, simulated)
    lines = text.splitlines()
    assert len(lines) == 2 + len(fits) and max(map(len, lines)) <= 88
    assert lines[0] == ("GPU 141.0 GB, 90% to the engine: weights 16.06 GB, "
                        "runtime 14.10 GB, K/V 110.84 GB")
    assert lines[2].split()[:3] == ["contiguous,", "8192", "10"]
    assert lines[3].split()[-1] == f"{simulated[1]:,.0f}"
    assert cap.capacity_table(budget, fits).splitlines()[2].endswith("-")
    with pytest.raises(ConfigError, match="one number per fit"):
        cap.capacity_table(budget, fits, [1.0])


def test_plot_capacity_artists(tenth_of_an_h200):
    kv_bytes, _, fits, runs = tenth_of_an_h200
    budget = cap.kv_budget()
    simulated = [cap.concurrency(r) for r in runs.values()]
    fig = plot_capacity(budget, fits, simulated, title="t")
    assert isinstance(fig, Figure) and len(fig.axes) == 2
    left, right = fig.axes
    assert len(left.containers) == len(SEGMENTS)
    assert all(len(c) == len(fits) for c in left.containers)
    # each bar spans the whole GPU: weights, runtime and the K/V pool add up
    ends = [sum(c[i].get_width() for c in left.containers) for i in range(len(fits))]
    assert np.allclose(ends, budget.gpu_bytes / cap.GB)
    assert [t.get_text() for t in left.get_legend().get_texts()] == [
        s[1] for s in SEGMENTS]
    assert len(right.containers) == 2
    heights = [[p.get_height() for p in c] for c in right.containers]
    assert heights == [[f.sequences for f in fits], simulated]
    labels = [t.get_text() for t in left.get_yticklabels()]
    assert labels[0].endswith(f"{fits[0].sequences} sequences")
    sizes = [t.get_fontsize() for ax in fig.axes for t in ax.texts]
    assert sizes and min(sizes) >= 9
    assert len(plot_capacity(budget, fits).axes[1].containers) == 1
    with pytest.raises(ConfigError, match="one number per fit"):
        plot_capacity(budget, fits, [3.0])
    with pytest.raises(ConfigError, match="at least one fit"):
        plot_capacity(budget, [])


def test_both_bookkeepings_simulate_the_same_run():
    """The chapter simulates with the fast bookkeeping (chapter 8); the teaching one
    gives the same run, step for step."""
    print(f"seed={SEED}")
    kv_bytes = cap.kv_budget().kv_bytes // 50
    wl = sim.make_workload("chat", n=120, seed=SEED, rate=0.3)
    fast, teaching = (cap.simulate_capacity(wl, kv_bytes, policies=("paged:16",),
                                            bookkeeping=b)["paged:16"]
                      for b in ("fast", "teaching"))
    assert (fast.series["waiting"] > 0).any()             # memory limited it
    assert fast.series.keys() == teaching.series.keys()
    for key in fast.series:
        assert np.array_equal(fast.series[key], teaching.series[key]), key
    assert cap.concurrency(fast) == cap.concurrency(teaching) > 0
