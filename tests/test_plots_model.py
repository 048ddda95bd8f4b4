"""Tests of pagedkv.plots.model's two pictures of the pool: one block id across the layers,
and the pool filling as an answer is generated."""
from __future__ import annotations

import pytest
from matplotlib.patches import Rectangle

from pagedkv.model import LlamaConfig
from pagedkv.plots import model as mplots
from pagedkv.plots.memory import PALETTE
from matplotlib.colors import to_hex

CFG = LlamaConfig(vocab_size=96, hidden=64, layers=6, heads=4, kv_heads=2, head_dim=64,
                  ffn=128, rope_base=10000.0, context=512)


def test_block_across_layers_one_column_in_every_layer():
    fig = mplots.draw_block_across_layers(CFG, block_size=16, block_id=3, num_blocks=5)
    cells = [p for p in fig.axes[0].patches if isinstance(p, Rectangle)]
    assert len(cells) == CFG.layers * 5
    marked = [p for p in cells if to_hex(p.get_facecolor()) == PALETTE[0].lower()]
    assert sorted((int(p.get_x()), int(p.get_y())) for p in marked) == [
        (3, layer) for layer in range(CFG.layers)]
    assert "6 layers" in fig.axes[0].get_title() and "49,152 bytes" in fig.axes[0].get_title()


def test_block_across_layers_refuses_a_block_off_the_picture():
    with pytest.raises(ValueError, match="block_id"):
        mplots.draw_block_across_layers(CFG, block_size=16, block_id=12, num_blocks=12)


def test_pool_filling_has_whole_block_ticks():
    history = [{"used_blocks": u, "shared_blocks": 0} for u in (3, 3, 4, 5)]
    fig = mplots.draw_pool_filling(history, 16)
    ticks = fig.axes[0].get_yticks()
    assert all(float(t).is_integer() for t in ticks)
