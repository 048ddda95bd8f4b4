"""The prefill-tile picture: every (query tile, K/V tile) pair classified as a brute force
over its rows and keys says, and drawn once, with the block table's entries as labels."""
import itertools

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from pagedkv.plots import prefill  # noqa: E402


def _brute(start, n, q_tile, kv_tile, group):
    """Each pair's kind from the (row, key) mask itself: all allowed, none, or some."""
    rows, length = n * group, start + n
    kinds = []
    for r0 in range(0, rows, q_tile):
        pos = start + np.arange(r0, min(r0 + q_tile, rows)) // group
        line = []
        for t0 in range(0, length, kv_tile):
            keys = np.arange(t0, min(t0 + kv_tile, length))
            ok = keys[None, :] <= pos[:, None]
            line.append(prefill.FULL if ok.all() else
                        prefill.SKIPPED if not ok.any() else prefill.CUT)
        kinds.append(line)
    return np.array(kinds)


@pytest.mark.parametrize("start, n, q_tile, kv_tile, group", list(itertools.product(
    (0, 5, 16, 37), (1, 7, 16, 45), (4, 8, 64), (8, 16), (1, 3))))
def test_tile_kinds_match_the_mask(start, n, q_tile, kv_tile, group):
    got = prefill.tile_kinds(start, n, q_tile=q_tile, kv_tile=kv_tile, group=group)
    np.testing.assert_array_equal(got, _brute(start, n, q_tile, kv_tile, group))


def test_a_whole_prompt_skips_the_upper_triangle():
    kinds = prefill.tile_kinds(0, 64, q_tile=16, kv_tile=16)
    assert (np.diag(kinds) == prefill.CUT).all()
    assert (kinds[np.tril_indices(4, -1)] == prefill.FULL).all()
    assert (kinds[np.triu_indices(4, 1)] == prefill.SKIPPED).all()


def test_tile_kinds_refuses_bad_sizes():
    with pytest.raises(Exception, match="new_tokens"):
        prefill.tile_kinds(0, 0, q_tile=8, kv_tile=8)
    with pytest.raises(Exception, match="q_tile"):
        prefill.tile_kinds(0, 4, q_tile=0, kv_tile=8)


def test_the_drawing_has_a_rectangle_per_pair_and_the_table_as_labels():
    table = np.array([7, 2, 9, 4, 11, 0])
    fig = prefill.draw_prefill_tiles(table, 10, 30, 8, q_tile=8, kv_tile=16)
    ax = fig.axes[0]
    kinds = prefill.tile_kinds(10, 30, q_tile=8, kv_tile=16)
    rects = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_width() > 0
             and p.get_edgecolor()[:3] == (1.0, 1.0, 1.0)]
    assert len(rects) == kinds.size
    assert [t.get_text() for t in ax.texts] == [f"block {b}" for b in table[:5]]
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    for kind in (prefill.FULL, prefill.CUT, prefill.SKIPPED):
        assert any(s.endswith(f": {int((kinds == kind).sum())}") for s in legend)


def test_the_drawing_refuses_a_short_table():
    with pytest.raises(ValueError, match="does not hold"):
        prefill.draw_prefill_tiles(np.arange(2), 10, 30, 8, q_tile=8, kv_tile=16)
