"""Tests of pagedkv.plots.memory: the drawings return Figures with the patches they promise,
lay out reservations correctly, and reject bad input."""
from __future__ import annotations

import io

import numpy as np
import pytest
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedkv.allocator import BlockAllocator
from pagedkv.errors import OutOfBlocks
from pagedkv.manager import KVCacheManager
from pagedkv.plots import memory as mem


def rectangles(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]


def arrows(fig):
    return [p for p in fig.axes[0].patches if isinstance(p, FancyArrowPatch)]


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=40, metadata={"Software": None})
    return buf.getvalue()


@pytest.fixture
def manager():
    alloc = BlockAllocator(num_blocks=12, block_bytes=4 * 8)
    m = KVCacheManager(alloc, block_size=4)
    m.add("a", 5)        # 2 blocks, the second holds 1 token
    m.add("b", 4)        # 1 full block
    m.add("c", 2)        # 1 block, half full
    yield m
    alloc.close()


# ------------------------------------------------------------------------------- colours
def test_owner_colors_are_stable_and_skip_free():
    colors = mem.owner_colors([None, 3, "x", 0, 3, mem.SHARED, None])
    assert None not in colors
    assert list(colors) == [0, 3, "x", mem.SHARED]           # integers first, in order
    assert colors[3] == mem.PALETTE[3] and colors[0] == mem.PALETTE[0]
    assert colors[mem.SHARED] == mem.SHARED_COLOR
    assert mem.owner_colors([3])[3] == colors[3]              # same id, same colour, any picture


# ----------------------------------------------------------------------------- draw_pool
def test_draw_pool_one_square_per_block():
    fig = mem.draw_pool([0, None, 1, 1, None], ncols=3)
    assert isinstance(fig, Figure)
    assert len(rectangles(fig)) == 5


def test_draw_pool_fills_add_a_bar_per_used_block():
    fig = mem.draw_pool([0, None, 1], fills=[2, 0, 4], block_size=4)
    assert len(rectangles(fig)) == 3 + 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(owners=[]), "no blocks"),
    (dict(owners=[0, 1], ncols=0), "ncols"),
    (dict(owners=[0, 1], fills=[1]), "fills has 1"),
    (dict(owners=[0, 1], fills=[1, 1]), "block_size"),
    (dict(owners=[0, 1], fills=[1, 5], block_size=4), r"\[0, 4\]"),
])
def test_draw_pool_rejects_bad_input(kwargs, message):
    owners = kwargs.pop("owners")
    with pytest.raises(ValueError, match=message):
        mem.draw_pool(owners, **kwargs)


def test_draw_pool_is_deterministic():
    owners = [0, None, 2, 2, 1, None, 0]
    assert png(mem.draw_pool(owners)) == png(mem.draw_pool(owners))


def test_draw_allocator_marks_the_free_stack():
    with BlockAllocator(num_blocks=6, block_bytes=16) as alloc:
        alloc.allocate_n(4)
        alloc.free(1)
        fig = mem.draw_allocator(alloc)
        texts = [t.get_text() for t in fig.axes[0].texts]
        assert len(rectangles(fig)) == 6
        # free stack, top last: [5, 4, 1]; the next allocate() returns 1, marked #1
        assert "#1" in texts and "#2" in texts and "#3" in texts and "#4" not in texts
        assert alloc.allocate() == 1


# ------------------------------------------------------------------------------- manager
def test_manager_owners_and_fills(manager):
    owners, fills = mem.manager_owners(manager)
    assert owners[:4] == ["a", "a", "b", "c"] and owners[4:] == [None] * 8
    assert fills[:4] == [4, 1, 4, 2]


def test_manager_owners_marks_shared_blocks(manager):
    manager.fork("a", "a2")
    owners, _ = mem.manager_owners(manager)
    assert owners[0] == owners[1] == mem.SHARED


def test_draw_manager_patches(manager):
    fig = mem.draw_manager(manager)
    assert len(rectangles(fig)) == 12 + 4       # a square per block, a bar per used block


def legend_labels(fig):
    return [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


def test_draw_manager_legend_explains_the_partial_fill(manager):
    labels = legend_labels(mem.draw_manager(manager))
    assert labels[:3] == ["seq a", "seq b", "seq c"] and "free" in labels
    assert any(lab.startswith("solid") for lab in labels)
    assert any(lab.startswith("pale") for lab in labels)
    # without fills there is no bar, so the legend does not mention one
    plain = legend_labels(mem.draw_pool(["a", "a", None]))
    assert plain == ["seq a", "free"]
    assert legend_labels(mem.draw_pool(["a", "b"])) == ["seq a", "seq b"]   # nothing free


def test_manager_owners_of_the_first_blocks(manager):
    owners, fills = mem.manager_owners(manager, num_blocks=3)
    assert owners == ["a", "a", "b"] and fills == [4, 1, 4]
    assert mem.FREE is None and mem.manager_owners(manager)[0][5] is mem.FREE


def test_text_is_readable(manager):
    for fig in (mem.draw_manager(manager), mem.draw_page_tables([1, 0], 4),
                mem.draw_allocator(manager.allocator)):
        ax = fig.axes[0]
        sizes = [t.get_fontsize() for t in ax.texts]
        sizes += [t.get_fontsize() for t in ax.get_legend().get_texts()]
        assert min(sizes) >= 8 and sorted(sizes)[len(sizes) // 2] >= 9


# --------------------------------------------------------------------------- page tables
def test_draw_page_tables_counts():
    fig = mem.draw_page_tables([7, 5, 3], 12, in_use=[0, 2])
    assert len(rectangles(fig)) == 3 + 12
    assert len(arrows(fig)) == 3


def test_draw_page_tables_many_sequences():
    fig = mem.draw_page_tables({"A": [1, 2], "B": [2, 0, 4]}, 6)
    assert len(rectangles(fig)) == 5 + 6
    assert len(arrows(fig)) == 5


@pytest.mark.parametrize("tables, num_blocks, in_use", [
    ([0, 12], 12, ()),
    ([-1], 12, ()),
    ([0], 0, ()),
    ([0], 4, (4,)),
])
def test_draw_page_tables_rejects_bad_input(tables, num_blocks, in_use):
    with pytest.raises(ValueError):
        mem.draw_page_tables(tables, num_blocks, in_use=in_use)


# --------------------------------------------------------------------------- reservations
def test_contiguous_layout_reserves_max_len_while_it_fits():
    regions = mem.contiguous_layout([3, 10, 5, 7], max_len=10, capacity=25)
    assert regions == [mem.Region(0, 10, 0, 3), mem.Region(10, 10, 1, 10)]
    s = mem.layout_summary(regions, 25)
    assert s == {"stored": 13, "reserved_empty": 7, "free": 5, "largest_hole": 5}


def test_exact_layout_and_external_fragmentation():
    regions = mem.exact_layout([4, 6, 4, 6], capacity=20)
    assert [r.start for r in regions] == [0, 4, 10, 14]
    after = [r for r in regions if r.owner in (0, 2)]        # 1 and 3 finish
    s = mem.layout_summary(after, 20)
    assert s["free"] == 12 and s["largest_hole"] == 6        # holes (4, 6) and (14, 6)
    assert mem.layout_summary(regions[1:3], 20)["largest_hole"] == 6   # a hole at each end


def test_exact_layout_stops_at_capacity():
    assert len(mem.exact_layout([5, 5, 5], capacity=12)) == 2


def test_paged_layout_agrees_with_manager_stats(manager):
    regions = mem.paged_layout(manager)
    s = mem.layout_summary(regions, 12 * 4)
    stats = manager.stats()
    assert s["stored"] == stats.stored_tokens
    assert s["stored"] + s["reserved_empty"] == stats.used_blocks * 4


def test_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        mem.contiguous_layout([3, 11], max_len=10, capacity=40)
    with pytest.raises(ValueError):
        mem.exact_layout([3, 0], capacity=40)
    with pytest.raises(ValueError, match="overlapping"):
        mem.layout_summary([mem.Region(0, 5, 0, 5), mem.Region(4, 2, 1, 1)], 10)
    with pytest.raises(ValueError, match="capacity"):
        mem.layout_summary([mem.Region(8, 5, 0, 5)], 10)
    with pytest.raises(ValueError):
        mem.layout_summary([mem.Region(0, 4, 0, 5)], 10)     # more used than reserved


def test_draw_layouts_patches():
    a = mem.contiguous_layout([3, 10], max_len=10, capacity=30)    # one region has empties
    b = mem.exact_layout([3, 10], capacity=30)                     # none has
    fig = mem.draw_layouts([("max", a), ("exact", b)], 30)
    assert isinstance(fig, Figure)
    assert len(rectangles(fig)) == 2 + (2 + 1) + 2


@pytest.mark.parametrize("rows, capacity", [([], 10), ([("x", [])], 0),
                                            ([("x", [mem.Region(0, 20, 0, 1)])], 10)])
def test_draw_layouts_rejects_bad_input(rows, capacity):
    with pytest.raises(ValueError):
        mem.draw_layouts(rows, capacity)


def test_chapter_one_story_holds():
    # The fixed example of chapter 1: exact reservation refuses request 6, blocks admit it.
    rng = np.random.default_rng(11)
    first = rng.integers(3, 17, size=6).tolist()
    new = int(rng.integers(3, 17))
    after = [r for r in mem.exact_layout(first, 64) if r.owner not in (1, 3)]
    s = mem.layout_summary(after, 64)
    assert s["free"] >= new > s["largest_hole"]
    with BlockAllocator(16, 16) as alloc:
        m = KVCacheManager(alloc, 4)
        for i, n in enumerate(first):
            m.add(i, n)
        m.free(3)
        m.free(1)
        m.add(6, new)
        m.audit()
        with pytest.raises(OutOfBlocks):
            m.add(7, 64)


# ------------------------------------------------------------------------ a pool's words
def test_draw_words_one_row_per_block_and_a_verdict_each():
    words = np.arange(4 * 16, dtype=np.uint32).reshape(4, 16) * np.uint32(2**26)
    fig = mem.draw_words(words, ["intact", "wrong", "intact", "not written"])
    ax = fig.axes[0]
    assert len(ax.images) == 1 and ax.images[0].get_array().shape == (4, 16)
    assert [t.get_text() for t in ax.texts] == ["intact", "wrong", "intact", "not written"]
    assert ax.images[0].get_array()[1, 1] == (17 * 2**26) >> 24     # the top byte: 68


@pytest.mark.parametrize("words, verdicts", [(np.zeros((2, 4), np.uint32), ["a"]),
                                             (np.zeros(4, np.uint32), ["a"] * 4),
                                             (np.zeros((0, 4), np.uint32), [])])
def test_draw_words_rejects_bad_input(words, verdicts):
    with pytest.raises(ValueError):
        mem.draw_words(words, verdicts)
