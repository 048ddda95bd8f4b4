"""The serving pictures draw what they are given: a tick per token, the arrival line, one
curve of sorted gaps per run."""
import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402

from pagedkv.plots import serving  # noqa: E402


def _run(stall):
    tokens = list(np.arange(0, 1, 0.1)) + [1 + stall + 0.1 * i for i in range(5)]
    return {"stamps": [tokens, tokens, [1.5, 1.6]], "due": [0.0, 0.0, 1.0]}


def test_token_times_has_a_panel_per_run_and_every_tick():
    fig = serving.draw_token_times({"a": _run(0.5), "b": _run(0.1)})
    axes = fig.axes
    assert len(axes) == 2
    ticks = sum(len(line.get_xdata()) for line in axes[0].lines
                if line.get_linestyle() == "None")
    assert ticks == 15 + 15 + 2
    assert any(line.get_xdata()[0] == 1.0 for line in axes[0].lines)   # the arrival


def test_gaps_draws_one_sorted_curve_per_run():
    fig = serving.draw_gaps({"a": _run(0.5), "b": _run(0.1)})
    lines = fig.axes[0].lines
    assert len(lines) == 2
    for line in lines:
        y = line.get_ydata()
        assert (np.diff(y) >= 0).all() and len(y) == 2 * 14
    assert lines[0].get_ydata().max() > lines[1].get_ydata().max()


def test_timeline_draws_a_bar_per_span_in_its_lane():
    trace = {"host": [("step", 0, 2), ("wait", 0.5, 1.5), ("step", 2.2, 4)],
             "device": [("decode", -0.3, 1.5), ("decode", 1.6, 3.9), ("prefill", 3.9, 4.5)]}
    fig = serving.draw_timeline({"a": trace, "b": {"host": trace["host"], "device": []}})
    assert len(fig.axes) == 2
    bars = fig.axes[0].collections
    assert len(bars) == 6 and len(fig.axes[1].collections) == 3
    lanes = [b.get_paths()[0].get_extents().y0 for b in bars]
    assert lanes[:3] == [1.1] * 3 and lanes[3:] == [0.1] * 3   # the host above the GPU
    assert fig.axes[1].get_xlim() == (0, 4)
