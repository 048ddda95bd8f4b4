"""The transfer picture: a square per block of each pool, an arrow per pair, owners'
colours kept across the pools, bad pairs refused."""
import numpy as np
import pytest
from matplotlib.patches import FancyArrowPatch, Rectangle

from pagedkv.allocator import BlockAllocator
from pagedkv.manager import KVCacheManager
from pagedkv.plots.memory import PALETTE
from pagedkv.plots.transfer import draw_transfer
from pagedkv.transfer import plan_transfer


def _managers():
    a = KVCacheManager(BlockAllocator(10, 64, xp=np), 4)
    b = KVCacheManager(BlockAllocator(12, 64, xp=np), 4)
    b.add(9, 6)
    a.add(0, 9)
    a.add(1, 4)
    return a, b


def test_one_square_per_block_and_one_arrow_per_pair():
    a, b = _managers()
    plan = plan_transfer(a, b, [0, 1])
    fig = draw_transfer(a, b, plan.pairs, title="t")
    ax = fig.axes[0]
    squares = [p for p in ax.patches if isinstance(p, Rectangle)]
    arrows = [p for p in ax.patches if isinstance(p, FancyArrowPatch)]
    assert len(squares) == 10 + 12 and len(arrows) == len(plan.pairs) == 4
    seq0 = [s for s in squares if s.get_facecolor()[:3] == _rgb(PALETTE[0])]
    assert len(seq0) == 3 + 3                   # sequence 0's blocks, on A and on B
    assert _rgb(PALETTE[0]) == arrows[0].get_edgecolor()[:3]


def _rgb(hex_color):
    from matplotlib.colors import to_rgb
    return tuple(to_rgb(hex_color))


def test_a_pair_outside_the_pools_is_refused():
    a, b = _managers()
    with pytest.raises(ValueError, match=r"pair \(0, 12\) is outside"):
        draw_transfer(a, b, [(0, 12)])
