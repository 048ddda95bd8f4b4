"""Tests of pagedkv.plots.swap: a moment read from a live manager and swapper (who holds
each device and host block, the idle cached ones, the copies planned), and its picture."""
from __future__ import annotations

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedkv import swap
from pagedkv.allocator import BlockAllocator
from pagedkv.plots import swap as swapplots
from pagedkv.plots.prefix import IDLE_COLOR
from pagedkv.prefix_cache import PrefixCachingManager


def story():
    """A (10 tokens: two full blocks of 4 and a partial one) and B run; A is swapped out,
    C takes free blocks, A comes back: its two full blocks were still cached."""
    m = PrefixCachingManager(BlockAllocator(8, 64, xp=np), 4)
    sw = swap.Swapper(m, swap.HostPool(4, m.allocator.block_bytes))
    a = list(range(100, 110))
    m.add("A", a)
    m.add("B", list(range(200, 208)))
    moments = [swapplots.snapshot("run", m, sw)]
    out = sw.swap_out(["A"])
    moments.append(swapplots.snapshot("out", m, sw, out=out))
    m.add("C", list(range(300, 307)))
    back = sw.swap_in(["A"], [a])
    moments.append(swapplots.snapshot("back", m, sw, back=back))
    return moments


def test_a_moment_is_what_the_pools_hold():
    run, out, back = story()
    assert run.device == [("A",), ("A",), ("A",), ("B",), ("B",), None, None, None]
    assert run.host == [None] * 4 and run.copies == []
    # swapped out: A's full blocks stay cached (idle), its partial block is free; three
    # copies, one a block, to the host
    assert out.device[:3] == ["idle", "idle", None]
    assert out.host == [("A",), ("A",), ("A",), None]
    assert out.copies == [("device", 0, 0), ("device", 1, 1), ("device", 2, 2)]
    # back: the cache found the two full blocks, so only the partial one is copied
    assert back.device[:2] == [("A",), ("A",)] and back.host == [None] * 4
    assert back.copies == [("host", 2, 6)] and back.device[6] == ("A",)


def test_the_picture_draws_every_block_each_copy_and_the_idle_ones():
    fig = swapplots.draw_swap(story(), title="swap")
    assert isinstance(fig, Figure) and len(fig.axes) == 3
    for ax, n_copies, n_idle in zip(fig.axes, (0, 3, 1), (0, 2, 0)):
        rects = [p for p in ax.patches if isinstance(p, Rectangle)]
        arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
        idle = [r for r in rects if r.get_hatch() == "//"
                and np.allclose(r.get_facecolor()[:3], mcolors.to_rgb(IDLE_COLOR))]
        assert len(rects) == 8 + 4 and len(arrows) == n_copies and len(idle) == n_idle
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("idle" in t for t in labels) and "free" in labels
