"""Tests of the pictures chapters 7 and 11 draw (pagedkv.plots.cow, pagedkv.plots.life) and of
the live figures' HTML and data (pagedkv.plots.live). How the figures behave in the page is
tests/test_live_figures.py's."""
from __future__ import annotations

import html
import json
import re

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch

from pagedkv import sim
from pagedkv.allocator import BlockAllocator
from pagedkv.plots import cow, life, live
from pagedkv.prefix_cache import PrefixCachingManager


# ------------------------------------------------------------------ one fork, one write
def test_a_write_into_a_shared_partly_filled_block_copies_it():
    added, forked, b_wrote, a_wrote = cow.fork_write_copy(prompt=6, block_size=4)
    assert added.tables == {"a": [0, 1]} and added.slots == list(range(6))
    assert forked.tables == {"a": [0, 1], "b": [0, 1]} and forked.refcounts[:2] == [2, 2]
    assert b_wrote.copies == [(1, 2)] and b_wrote.tables["b"] == [0, 2]
    assert b_wrote.slots == [10] and b_wrote.refcounts[:3] == [2, 1, 1]
    # the copy carried a's two tokens of block 1, then b wrote its own after them
    assert b_wrote.contents[8:12] == ["a", "a", "b", None]
    assert a_wrote.copies == [] and a_wrote.slots == [6]          # the last owner, in place
    assert a_wrote.contents[4:8] == ["a", "a", "a", None]


def test_a_full_last_block_needs_no_copy():
    _, _, b_wrote, a_wrote = cow.fork_write_copy(prompt=8, block_size=4, num_blocks=6)
    assert b_wrote.copies == [] == a_wrote.copies
    assert b_wrote.tables["b"] == [0, 1, 2] and a_wrote.tables["a"] == [0, 1, 3]


def test_the_picture_draws_each_mapping_and_the_copy():
    moments = cow.fork_write_copy()
    fig = cow.draw_fork_write_copy(moments, num_blocks=6, block_size=4)
    assert isinstance(fig, Figure) and len(fig.axes) == 4
    arrows = [[p for p in ax.patches if isinstance(p, FancyArrowPatch)] for ax in fig.axes]
    mappings = [sum(len(t) for t in mo.tables.values()) for mo in moments]
    copies = [len(mo.copies) for mo in moments]
    assert [len(a) for a in arrows] == [m + c for m, c in zip(mappings, copies)]
    texts = [t.get_text() for t in fig.axes[2].texts]
    assert "copy block 1 -> 2" in texts


# ------------------------------------------------------------------ the life of a block
def test_block_states_follow_the_cache():
    m = PrefixCachingManager(BlockAllocator(8, 32, xp=np), 4)
    assert life.block_states(m) == ["free"] * 8
    m.add("a", list(range(10)))                  # two full blocks named, one partly filled
    assert life.block_states(m) == ["in use"] * 3 + ["free"] * 5
    m.free("a")                                  # named blocks stay, idle; the third goes back
    assert life.block_states(m) == ["idle", "idle"] + ["free"] * 6
    m.add("b", list(range(8)) + [99])            # finds both: idle -> in use
    assert life.block_states(m)[:2] == ["in use", "in use"]
    assert set(life.STATES) == {s for a, b, _ in life.MOVES for s in (a, b)}


def test_the_diagram_counts_the_states():
    fig = life.draw_block_life(["free"] * 5 + ["in use"] + ["idle"] * 2)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert {"5 blocks", "1 block", "2 blocks"} <= set(texts)
    assert all(call in texts for _, _, call in life.MOVES)
    assert not any(re.fullmatch(r"\d+ blocks?", t) for t in
                   (t.get_text() for t in life.draw_block_life().axes[0].texts))


# ------------------------------------------------------------------ the live figures' data
def test_a_live_figure_is_a_div_with_its_data():
    fig = live.LiveFigure("allocator", 'a pool <of> "16" blocks', blocks=16, name="it's")
    page = fig._repr_html_()
    match = re.fullmatch(r'<div class="pkv-live" data-figure="allocator" '
                         r'data-params="([^"]*)"><p class="pkv-fallback">(.*)</p></div>', page)
    assert match, page
    assert json.loads(html.unescape(match.group(1))) == {"blocks": 16, "name": "it's"}
    assert html.unescape(match.group(2)) == 'a pool <of> "16" blocks'
    assert repr(fig) == fig.text


def test_the_lengths_are_the_chapters_draws():
    data = live.fragmentation(64, 16, (3, 1), seeds=[11, 0]).params
    rng = np.random.default_rng(11)
    assert data["lengths"]["11"] == rng.integers(3, 17, size=6).tolist() + [
        int(rng.integers(3, 17))]
    assert data["lengths"]["11"][:6] == [4, 4, 14, 9, 11, 11]       # chapter 1's table
    pool = live.fill_pool(96, max_sequences=3).params["lengths"]
    assert pool == {str(k): np.random.default_rng(0).integers(1, 17, size=k).tolist()
                    for k in (1, 2, 3)}


def test_the_beam_schedules_are_beam_searchs_draws():
    schedules = live.beam_schedules([1, 3], 12)
    for width, rows in ((1, schedules["1"]), (3, schedules["3"])):
        assert len(rows) == 12 and all(len(r) == width for r in rows)
        alive = 1
        for parents in rows:                       # each survivor descends from a live beam
            assert all(0 <= i < alive for i in parents)
            alive = len(parents)
        rng, scores = np.random.default_rng(0), np.zeros(1)
        for parents in rows:                       # the same draws, again
            got, scores = sim.beam_children(rng, scores, width, 0.3, 64)
            assert got.tolist() == parents


def test_a_simulation_figure_carries_its_workload():
    data = live.simulation(n=20, pool_mib=1).params
    wl = sim.make_workload("chat", n=20, seed=0, rate=1.0)
    assert data["requests"] == [[r.rid, r.arrival, r.prompt, r.output] for r in wl.requests]
    assert data["pool_bytes"] == sim.MiB and data["max_len"] == wl.max_len


@pytest.mark.parametrize("make", [
    lambda: live.allocator(0), lambda: live.allocator(2.0)])
def test_a_pool_of_no_blocks_is_refused(make):
    with pytest.raises(ValueError):
        make()
