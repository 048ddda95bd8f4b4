"""Tests of pagedkv.plots.fast: the figures draw what they are given and refuse input whose
batches do not match."""
from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from pagedkv.errors import ConfigError
from pagedkv.plots import fast


def _bars(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def test_step_times_one_bar_per_engine_and_batch_present():
    fig = fast.draw_step_times({"plain": {"1": 60.0, "64": 70.0}, "graph": {"1": 1.0,
                                                                         "64": 2.0,
                                                                         "256": 7.0}},
                               [1, 64, 256], title="t")
    bars = _bars(fig)
    assert [b.get_height() for b in bars] == [60.0, 70.0, 1.0, 2.0, 7.0]
    assert fig.axes[0].get_yscale() == "log"
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["plain", "graph"]


def test_graph_parts_stack():
    fig = fast.draw_graph_parts({"gemms": {"1": 0.5, "8": 0.6},
                                 "host": {"1": 0.2, "8": -0.1}}, [1, 8])
    bars = _bars(fig)
    assert [b.get_height() for b in bars] == pytest.approx([0.5, 0.6, 0.2, 0.0])  # -0.1: 0
    assert [b.get_y() for b in bars[2:]] == [0.5, 0.6]


def test_graph_parts_refuses_missing_batches():
    with pytest.raises(ConfigError, match="has batches"):
        fast.draw_graph_parts({"gemms": {"1": 0.5}}, [1, 8])


def test_timeline_boxes_cut_at_the_span():
    fig = fast.draw_timeline({"eager": ([(0, 30), (30, 60), (60, 90)], [(30, 33), (60, 63)]),
                              "graph": ([(0, 10)], [(10, 13), (13, 16)])}, span_us=50)
    boxes = _bars(fig)
    assert len(boxes) == 2 + 1 + 1 + 2           # what starts before 50 µs
    assert max(b.get_x() + b.get_width() for b in boxes) == 50
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "eager: host", "eager: GPU", "graph: host", "graph: GPU"]


def test_step_trace_draws_each_span_in_its_lane_cut_at_the_span():
    """A synthetic timeline (the drawing's test, not a measurement): the eager step's
    spans start before 50 µs except one launch; the graph step has one launch, one wait,
    two kernels and a copy."""
    eager = {"wall_us": 80.0, "host_launch": [[0, 10], [12, 22], [60, 70]],
             "host_wait": [], "gpu_kernel": [[10, 13], [22, 25]], "gpu_copy": []}
    graph = {"wall_us": 40.0, "host_launch": [[0, 6]], "host_wait": [[7, 30]],
             "gpu_kernel": [[6, 9], [9, 12]], "gpu_copy": [[12, 13]]}
    fig = fast.draw_step_trace({"eager": eager, "graph": graph}, span_us=50, title="t")
    boxes = _bars(fig)
    assert len(boxes) == 2 + 2 + 1 + 1 + 2 + 1      # the launch at 60 µs is cut away
    colors = {k: c for _, k, c, _ in fast.TRACE_SPANS}
    lane = {round(b.get_y() - 0.1, 6): b.get_facecolor() for b in boxes}
    assert set(lane) == {0.0, 1.0, 2.6, 3.6}
    from matplotlib.colors import to_rgba
    waits = [b for b in boxes if b.get_facecolor() == to_rgba(colors["host_wait"])]
    assert [(b.get_x(), b.get_width(), round(b.get_y(), 6)) for b in waits] == [(7, 23, 2.7)]
    assert max(b.get_x() + b.get_width() for b in boxes) <= 50
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [
        "eager: host", "eager: GPU", "graph: host", "graph: GPU"]
    assert fast.draw_step_trace({"eager": eager}).axes[0].get_xlim() == (0, 80.0)
