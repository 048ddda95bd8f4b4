"""Tests of pagedkv.plots.kernels: the data behind chapter 9's pictures (which lane loads which
chunk, when a ring's tiles arrive, which lane holds which fragment element) against
independent descriptions, and what each figure draws."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedkv.plots import kernels


def _rects(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


@pytest.mark.parametrize("head_dim, item, shape", [(128, 2, (2, 16)), (64, 2, (4, 8)),
                                                   (256, 2, (1, 32)), (128, 4, (1, 32))])
def test_row_chunk_lanes_cover_the_warp_once(head_dim, item, shape):
    lanes = kernels.row_chunk_lanes(head_dim, item)
    assert lanes.shape == shape
    assert sorted(lanes.ravel().tolist()) == list(range(32))
    # lane i loads bytes 16 (i % chunks) .. of row i // chunks: consecutive lanes,
    # consecutive bytes of one row
    for lane in range(32):
        r, c = divmod(lane, shape[1])
        assert lanes[r, c] == lane


def test_row_chunk_lanes_refuse_rows_that_do_not_split():
    with pytest.raises(ValueError):
        kernels.row_chunk_lanes(100, 2)          # 200 bytes: not whole chunks
    with pytest.raises(ValueError):
        kernels.row_chunk_lanes(24, 2)           # 3 chunks do not divide 32 lanes


def test_draw_row_chunks_one_box_per_chunk_labelled_by_lane():
    fig = kernels.draw_row_chunks(128, 2)
    assert isinstance(fig, Figure)
    ax = fig.axes[0]
    assert len(_rects(ax)) == 32
    assert sorted(int(t.get_text()) for t in ax.texts) == list(range(32))
    assert [t.get_text() for t in ax.get_yticklabels()] == ["token 1", "token 0"]


@pytest.mark.parametrize("group", [1, 4, 8])
def test_draw_group_sharing_counts_reads_and_arrows(group):
    fig = kernels.draw_group_sharing(group)
    per_read, shared = fig.axes
    for ax, reads in ((per_read, group), (shared, 1)):
        arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
        assert len(arrows) == group               # every head gets the row
        texts = [t.get_text() for t in ax.texts]
        assert texts.count("K row") == reads
        assert [t for t in texts if t.startswith("head")] == [f"head {g}"
                                                              for g in range(group)]
    with pytest.raises(ValueError):
        kernels.draw_group_sharing(0)


def test_split_merge_bars_and_the_whole_softmax():
    rng = np.random.default_rng(5)
    print("seed 5")
    a, b = rng.normal(0, 3, 11), rng.normal(1, 3, 7)
    fig = kernels.draw_split_merge(a, b)
    top, bottom = fig.axes
    heights = np.array([r.get_height() for r in _rects(bottom)])
    whole = np.exp(np.r_[a, b] - np.r_[a, b].max())
    whole /= whole.sum()                          # the softmax of everything, directly
    np.testing.assert_allclose(heights, whole, rtol=1e-12)
    line, = [ln for ln in bottom.get_lines() if ln.get_label().startswith("softmax")]
    np.testing.assert_allclose(line.get_ydata(), whole, rtol=1e-12)
    tops = np.array([r.get_height() for r in _rects(top)])
    np.testing.assert_allclose([tops[:11].sum(), tops[11:].sum()], [1, 1])
    labels = [t.get_text() for t in bottom.get_legend().get_texts()]
    assert "softmax of the whole sequence" in labels and len(labels) == 3
    with pytest.raises(ValueError):
        kernels.draw_split_merge([], b)


def test_ring_schedule_without_and_with_a_ring():
    serial = kernels.ring_schedule(5, 1, latency=4, compute=1)
    assert serial[-1][4] == 5 * (4 + 1)           # ask, wait, compute, five times
    ring = kernels.ring_schedule(5, 3, latency=4, compute=1)
    for (i, asked, arrived, start, end), prev in zip(ring, [None] + ring[:-1]):
        assert arrived == asked + 4 and end == start + 1 and start >= arrived
        if prev:
            assert start >= prev[4]               # one tile computed at a time
        in_flight = sum(1 for r in ring if r[1] <= start < r[2] or r[0] == i)
        assert in_flight <= 3                     # never more tiles than ring slots
    assert ring[-1][4] < serial[-1][4]
    deep = kernels.ring_schedule(5, 5, latency=4, compute=1)
    assert deep[-1][4] == 4 + 5 * 1               # every load hidden but the first
    with pytest.raises(ValueError):
        kernels.ring_schedule(0, 2, 1, 1)


def test_draw_ring_timeline_two_bars_per_tile_per_panel():
    fig = kernels.draw_ring_timeline(6, stages=(1, 3), latency=4, compute=1)
    assert len(fig.axes) == 2
    for ax, s in zip(fig.axes, (1, 3)):
        rects = _rects(ax)
        assert len(rects) == 2 * 6
        total = kernels.ring_schedule(6, s, 4, 1)[-1][4]
        assert ax.get_title().endswith(f"{total:g} time units")


def _ptx_registers():
    """The m16n8k16 fragments as the PTX manual lists them, register by register."""
    c_owner, b_owner = {}, {}
    for lane in range(32):
        gid, tig = divmod(lane, 4)
        for tile in (0, 1):                                   # s0: tokens 0-7, s1: 8-15
            for reg, (r, cc) in enumerate([(gid, 2 * tig), (gid, 2 * tig + 1),
                                           (gid + 8, 2 * tig), (gid + 8, 2 * tig + 1)]):
                c_owner[(r, 8 * tile + cc)] = lane
        for k in (2 * tig, 2 * tig + 1, 2 * tig + 8, 2 * tig + 9):   # b0, b1
            b_owner[(k, gid)] = lane
    return c_owner, b_owner


def test_fragment_lanes_match_the_ptx_listing():
    c_owner, b_owner = _ptx_registers()
    c, b = kernels.c_fragment_lanes(), kernels.b_fragment_lanes()
    assert len(c_owner) == c.size and len(b_owner) == b.size
    assert all(c[key] == lane for key, lane in c_owner.items())
    assert all(b[key] == lane for key, lane in b_owner.items())
    # the point of the picture: P[head, token] sits in the lane that needs P^T[token, head]
    assert (c[:8, :].T == b).all()


def test_draw_fragments_labels_and_padding():
    fig = kernels.draw_fragments(group=8)
    left, right = fig.axes[:2]
    assert len(_rects(left)) == 16 * 16 and len(_rects(right)) == 16 * 8
    left_lanes = [t.get_text() for t in left.texts]
    assert len(left_lanes) == 8 * 16              # rows 8-15 are padding: no lane
    assert left_lanes.count("0") == 4             # lane 0: c0, c1 of s0 and of s1
    fig5 = kernels.draw_fragments(group=5)
    assert len(_rects(fig5.axes[1])) == 16 * 5
    with pytest.raises(ValueError):
        kernels.draw_fragments(group=9)


def _tax_run():
    """A made-up run (not measured): two head layouts, three lengths; FlashInfer and one
    SDPA point missing, and main-table rows that the figure must leave out."""
    rows = []
    for qh in (32, 64):
        for L, ours, ident, sdpa in ((256, 20.0, 19.0, 16.0), (1024, 40.0, 39.0, None),
                                     (4096, 100.0, 98.0, 95.0)):
            for impl, us in (("pagedkv", ours + qh), ("pagedkv.identity_table", ident + qh),
                             ("sdpa_contiguous", sdpa and sdpa + qh)):
                if us is not None:
                    rows.append(dict(impl="tax_sweep." + impl, us=us, dtype="float16",
                                     batch=16, seq_len=L, q_heads=qh, kv_heads=8))
    rows.append(dict(impl="pagedkv", us=1.0, dtype="float16", batch=16, seq_len=4096,
                     q_heads=32, kv_heads=8))
    rows.append(dict(impl="tax_sweep.pagedkv", us=1.0, dtype="bfloat16", batch=16,
                     seq_len=4096, q_heads=32, kv_heads=8))
    return {"meta": {}, "rows": rows}


def test_paging_tax_points_from_the_sweep_rows_only():
    pts = kernels.paging_tax_points(_tax_run())
    assert list(pts) == [(32, 8), (64, 8)]
    p = pts[(32, 8)]
    assert p["seq_len"] == [256, 1024, 4096]
    assert p["pagedkv"] == [52.0, 72.0, 132.0]           # not the main table's 1.0
    assert p["pagedkv.identity_table"] == [51.0, 71.0, 130.0]
    assert p["sdpa_contiguous"] == [48.0, None, 127.0]
    assert p["flashinfer"] == [None, None, None]
    assert kernels.paging_tax_points(_tax_run(), "bfloat16")[(32, 8)]["pagedkv"] == [1.0]
    with pytest.raises(ValueError, match="tax_sweep"):
        kernels.paging_tax_points({"rows": [r for r in _tax_run()["rows"]
                                            if not r["impl"].startswith("tax_sweep")]})


def test_draw_paging_tax_plots_times_and_the_tax():
    fig = kernels.draw_paging_tax(_tax_run())
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 4                                 # 2 layouts x (time, tax)
    top, bottom = fig.axes[0], fig.axes[2]
    lines = {ln.get_label(): ln for ln in top.get_lines()}
    assert set(lines) == {"ours, pages scattered", "ours, pages in order (identity table)",
                          "SDPA, contiguous K/V (no page table)"}   # no FlashInfer rows
    assert list(lines["ours, pages scattered"].get_ydata()) == [52.0, 72.0, 132.0]
    assert list(lines["SDPA, contiguous K/V (no page table)"].get_xdata()) == [256, 4096]
    tax = {ln.get_label(): ln for ln in bottom.get_lines()}
    np.testing.assert_allclose(tax["tax: ours / SDPA − 1"].get_ydata(),
                               [100 * (52 / 48 - 1), 100 * (132 / 127 - 1)])
    np.testing.assert_allclose(tax["scatter: ours / identity − 1"].get_ydata(),
                               [100 * (52 / 51 - 1), 100 * (72 / 71 - 1),
                                100 * (132 / 130 - 1)])
    assert list(tax["goal: 3%"].get_ydata()) == [3.0, 3.0]
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["256", "1K", "4K"]
    assert top.get_title() == "32/8 heads (group 4), float16"
