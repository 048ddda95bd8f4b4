"""Tests of pagedkv.plots.server: the pictures of chapter 15."""
from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from pagedkv.plots import server


def _texts(fig) -> str:
    return " ".join(t.get_text() for t in fig.axes[0].texts)


def test_draw_server_names_every_part_and_the_boundary():
    a, b = server.draw_server(process=True), server.draw_server(process=False)
    assert isinstance(a, Figure)
    for part in ("clients", "event loop", "worker thread", "Texts", "EngineCore", "Engine"):
        assert part in _texts(a)
    assert "the engine's process" in _texts(a) and "a thread of" in _texts(b)


def test_draw_pool_maps_colours_each_state_and_has_a_legend():
    fig = server.draw_pool_maps(["..cc", "mmco", "msso"])
    image = fig.axes[0].get_images()[0].get_array()
    assert image.shape == (3, 4)
    assert image[1].tolist() == [2, 2, 1, 4]          # states in POOL_STATES' order
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == [name for name, _ in server.POOL_STATES.values()]


def test_draw_pool_maps_refuses_what_it_cannot_draw():
    with pytest.raises(ValueError, match="nothing to draw"):
        server.draw_pool_maps([])
    with pytest.raises(ValueError, match="unknown characters"):
        server.draw_pool_maps(["..x"])
