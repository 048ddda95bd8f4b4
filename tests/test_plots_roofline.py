"""Tests of pagedkv.plots.roofline: the roofs are min(intensity x bandwidth, peak), they
meet at the ridge, every point is drawn where it is given, and bad input is refused."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import ConfigError
from pagedkv.plots import roofline

BW, PEAK = 4.8e12, 989e12


def test_the_roofs_and_the_ridge():
    assert roofline.ridge(BW, PEAK) == pytest.approx(206.04, abs=0.01)
    assert roofline.attainable(1, BW, PEAK) == BW      # a GEMV's: two FLOPs a 2-byte weight
    assert roofline.attainable(8, BW, PEAK) == 8 * BW
    assert roofline.attainable(1000, BW, PEAK) == PEAK
    assert roofline.of_roof(2, BW, BW, PEAK) == 0.5
    assert roofline.RATED["H200"] == dict(bandwidth=BW, matrix=PEAK)


def test_the_figure_draws_the_roof_and_every_point():
    groups = {"attention": [(4.0, 12e12, "group 4"), (8.0, 24e12)],
              "multiplies": [(1.0, 0.6e12, "batch 1"), (256.0, 119e12, "batch 256")]}
    fig = roofline.draw_roofline(groups, bandwidth=BW, peak=PEAK, title="t")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    (roof,) = [ln for ln in ax.get_lines() if len(ln.get_xdata()) == 3]
    x, y = roof.get_xdata(), roof.get_ydata()
    assert x[1] == pytest.approx(roofline.ridge(BW, PEAK))
    assert list(y) == pytest.approx([x[0] * BW, PEAK, PEAK])
    drawn = [c.get_offsets() for c in ax.collections]
    assert [len(d) for d in drawn] == [2, 2]
    assert np.allclose(drawn[1], [(1.0, 0.6e12), (256.0, 119e12)])
    texts = {t.get_text() for t in ax.texts}
    assert {"group 4", "batch 1", "batch 256"} <= texts
    assert any("4.80 TB/s" in t for t in texts) and any("989 TFLOP/s" in t for t in texts)
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["attention", "multiplies"]
    lo, hi = ax.get_xlim()
    assert lo <= 0.5 and hi >= 4 * roofline.ridge(BW, PEAK)


@pytest.mark.parametrize("groups, bw", [({"a": [(0.0, 1e12)]}, BW),
                                        ({"a": [(1.0, -1)]}, BW),
                                        ({"a": [(1.0, 1e12)]}, 0.0)])
def test_refuses_what_has_no_place_on_log_axes(groups, bw):
    with pytest.raises(ConfigError, match="positive"):
        roofline.draw_roofline(groups, bandwidth=bw, peak=PEAK)
