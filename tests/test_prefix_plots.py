"""Tests of pagedkv.plots.prefix: figures built without pyplot, what each block is drawn as,
legends that list what is drawn, readable text."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedkv import sim
from pagedkv.allocator import BlockAllocator
from pagedkv.plots import prefix as pplots
from pagedkv.plots.memory import SHARED_COLOR
from pagedkv.prefix_cache import PrefixCachingManager


def tick_sizes(fig):
    return [t.get_fontsize() for ax in fig.axes
            for t in ax.get_xticklabels() + ax.get_yticklabels()]


def text_sizes(fig):
    return [t.get_fontsize() for ax in fig.axes for t in ax.texts]


def test_hash_chain_greys_the_blocks_an_earlier_prompt_named():
    fig = pplots.draw_hash_chain([[1, 2, 3, 4, 5], [1, 2, 9, 9, 7], [0, 2, 3, 4]], 2,
                                 names=["a", "b", "c"])
    assert isinstance(fig, Figure)
    rects = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    grey = [r for r in rects if np.allclose(r.get_facecolor()[:3],
                                            tuple(int(SHARED_COLOR[i:i + 2], 16) / 255
                                                  for i in (1, 3, 5)))]
    assert len(rects) == 3 + 3 + 2 and len(grey) == 1    # only b's first block: a's name
    assert min(text_sizes(fig)) >= 9


def test_cache_snapshot_and_its_picture():
    m = PrefixCachingManager(BlockAllocator(8, 8, xp=np), 2)
    m.add("a", [1, 2, 3, 4, 5])
    m.fork("a", "b")
    m.free("a")
    m.add("c", [7, 7, 7])
    snap = pplots.cache_snapshot(m)
    assert snap[:3] == [("seq", "b*"), ("seq", "b*"), ("seq", "b")]
    assert snap[3:5] == [("seq", "c*"), ("seq", "c")] and snap[5] == ("free", "")
    m.free("b")
    snap = pplots.cache_snapshot(m)
    assert [s for s, _ in snap[:3]] == ["idle", "idle", "free"]
    assert [lab for _, lab in snap[:2]] == ["2", "1"]    # its tail is evicted first
    fig = pplots.draw_cache([snap, snap], ["one", "two"], ncols=4)
    assert len(fig.axes) == 2
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert "cached, idle (eviction order)" in labels and "free" in labels
    colours = {tuple(p.get_facecolor()[:3]) for p in fig.axes[0].patches}
    assert len(colours) >= 3 and min(text_sizes(fig)) >= 9


def test_hit_rate_prefill_and_preemption_plots():
    rows = {16: (np.arange(5), [0, 0, 0.5, 0.5, 0.5])}
    fig = pplots.plot_hit_rate(rows, 4)
    assert len(fig.axes[0].lines) == 2 and min(tick_sizes(fig)) >= 9
    fig = pplots.plot_prefill([("off", 100, 2.0), ("on", 20, 1.0)])
    assert len(fig.axes) == 2 and len(fig.axes[0].patches) == 2
    wl = sim.make_workload("default", n=20, seed=3, rate=1.0)
    runs = sim.compare_preemption(wl, 1 << 19, host_bytes=4 << 20, max_seqs=16)
    fig = pplots.plot_preemption(runs)
    assert len(fig.axes[0].lines) == 3 and len(fig.axes[1].patches) == 3
    assert min(tick_sizes(fig)) >= 9
