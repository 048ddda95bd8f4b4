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
