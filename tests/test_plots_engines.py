"""Tests of pagedkv.plots.engines: the figures draw what they are given and refuse input whose
lengths do not match."""
from __future__ import annotations

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedkv.plots import engines


def test_draw_reuse_bars_per_series():
    fig = engines.draw_reuse(["a", "b", "c"], [10, 20, 30],
                             {"radix": [0, 15, 29], "blocks": [0, 8, 24]}, title="t")
    assert isinstance(fig, Figure)
    bars = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert len(bars) == 3 * 3                     # prompt bars, then one bar per series
    assert [b.get_height() for b in bars[:3]] == [10, 20, 30]
    assert [b.get_height() for b in bars[6:]] == [0, 8, 24]
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["prompt length", "radix", "blocks"]


def test_draw_chain_lines():
    fig = engines.draw_chain_after_eviction([0, 1, 2], {"x": [8, 0, 0], "y": [8, 4, 0]},
                                            block_size=4)
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[8, 0, 0], [8, 4, 0]]
    assert list(fig.axes[0].get_yticks()) == [0, 4, 8]


@pytest.mark.parametrize("call", [
    lambda: engines.draw_reuse(["a"], [1, 2], {"x": [1]}),
    lambda: engines.draw_reuse(["a", "b"], [1, 2], {"x": [1]}),
    lambda: engines.draw_reuse(["a"], [1], {}),
    lambda: engines.draw_chain_after_eviction([0, 1], {"x": [1]}, block_size=4),
])
def test_mismatched_lengths_refused(call):
    with pytest.raises(ValueError):
        call()
