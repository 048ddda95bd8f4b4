"""Tests of pagedkv.plots.sim: figures built without pyplot, legends that list only what is
drawn, integer block axes, one bar pair per width, readable text."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from pagedkv import sim
from pagedkv.plots import memory as mem
from pagedkv.plots import sim as simplots

SEED = 20261130


def legend(fig, i=0):
    return [t.get_text() for t in fig.axes[i].get_legend().get_texts()]


def tick_sizes(fig):
    return [t.get_fontsize() for ax in fig.axes
            for t in ax.get_xticklabels() + ax.get_yticklabels()]


@pytest.fixture(scope="module")
def small_run():
    wl = sim.make_workload("default", n=12, seed=SEED)
    policy = sim.PagedPolicy(1 << 20, 16, max_seqs=4, max_len=wl.max_len)
    pool = simplots.PoolRecorder(policy.manager, blocks=40)
    run = sim.serve(wl, policy, max_seqs=4, observers=[pool])
    return wl, run, pool.frames


def test_pool_recorder_uses_the_one_ownership_encoding(small_run):
    wl, run, frames = small_run
    assert len(frames) == run.steps and all(len(f) == 40 for f in frames)
    owners = {o for f in frames for o in f}
    assert mem.FREE in owners and mem.SHARED not in owners
    assert owners - {mem.FREE} <= {r.rid for r in wl.requests}


def test_plot_pool_legend_lists_only_what_is_drawn(small_run):
    wl, run, frames = small_run
    fig = simplots.plot_pool(frames, highlight=[3, 5])
    assert isinstance(fig, Figure)
    assert legend(fig) == ["free", "other requests", "request 3", "request 5"]   # no "shared"
    assert min(tick_sizes(fig)) >= 9
    full = simplots.plot_pool([[mem.SHARED, 7], [mem.SHARED, 7]], highlight=[7])
    assert legend(full) == ["shared", "request 7"]                 # nothing free, no others


def test_plot_sharing_has_integer_block_ticks_and_a_key_per_count():
    refs = np.array([[3, 1, 0], [2, 1, 1], [2, 0, 1]])
    fig = simplots.plot_sharing(refs)
    assert legend(fig) == ["free", "1 sequence", "2 sequences", "3 sequences"]
    ticks = fig.axes[0].get_yticks()
    assert np.allclose(ticks, np.round(ticks))
    assert min(tick_sizes(fig)) >= 9


def test_plot_savings_draws_a_pair_at_every_width():
    ours = {("beam", w): 0.1 * w for w in (2, 4, 6)}
    paper = {("beam", 2): 0.15, ("beam", 4): 0.35, ("beam", 6): 0.5}
    fig = simplots.plot_savings(ours, paper)
    bars = fig.axes[0].patches
    assert len(bars) == 6
    centres = sorted(b.get_x() + b.get_width() / 2 for b in bars)
    # two bars around each of the three positions, none left empty
    assert np.allclose(np.round(centres), [0, 0, 1, 1, 2, 2])
    lone = simplots.plot_savings(ours, {("beam", 2): 0.15})
    xs = sorted(b.get_x() + b.get_width() / 2 for b in lone.axes[0].patches)
    assert np.allclose(xs[2:], [1, 2])                 # a lone bar sits on its tick


def test_plot_shares_legend_follows_the_categories_present():
    fig = simplots.plot_shares([("a", {"tokens": 0.9, "free": 0.1}),
                                ("b", {"tokens": 0.96, "unsplit": 0.04})])
    assert legend(fig) == ["tokens", "free", "waste not split"]


def test_plot_utilization_and_breakdown(small_run):
    _, run, _ = small_run
    fig = simplots.plot_utilization([run], title="t")
    assert len(fig.axes[0].lines) == 1 and min(tick_sizes(fig)) >= 9
    assert legend(simplots.plot_breakdown([run], busy=False))[0] == "tokens"


def test_beam_pool_figure_and_the_widget_figure():
    fig, kv, saving = simplots.beam_pool_figure(3, prompt=6, output=8)
    assert kv.corrupted == 0 and 0 < saving < 1 and kv.allocator.num_used == 0
    fig = simplots.simulation_figure(block_size=16, concurrency=8, n=20, pool_mib=1)
    assert len(fig.axes) == 2 and min(tick_sizes(fig)) >= 9


def test_widgets_show_the_figure_of_their_setting():
    pytest.importorskip("ipywidgets")
    explore = simplots.explore_beam()
    assert explore.auto_display and isinstance(explore.result, Figure)
    title = explore.result.axes[0].get_title()
    explore.children[0].value = 2                       # the width slider
    assert explore.result.axes[0].get_title() != title and "width 2" in \
        explore.result.axes[0].get_title()
