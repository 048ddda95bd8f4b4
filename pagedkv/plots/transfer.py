"""A picture of a transfer plan: pool A above, pool B below, an arrow for each block moved.

Blocks are coloured by owner as in :mod:`pagedkv.plots.memory` (a sequence keeps its colour
on both pools, a block two sequences share is grey); each (block on A, block on B) pair of
the plan is an arrow in its sequence's colour. Built without ``pyplot``, like every plot of
the package.
"""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from .memory import (EDGE_COLOR, FREE, FREE_COLOR, SHARED_COLOR, _legend, _new_axes,
                     manager_owners, owner_colors)

__all__ = ["draw_transfer"]

_DARK_TEXT = ("#F0E442", "#E69F00", "#56B4E9")


def _row(ax, owners, colors, y, label):
    for b, o in enumerate(owners):
        color = FREE_COLOR if o is FREE else colors[o]
        ax.add_patch(Rectangle((b + 0.05, y), 0.9, 0.9, facecolor=color,
                               edgecolor=EDGE_COLOR, lw=0.8))
        dark = o is FREE or color in _DARK_TEXT
        ax.text(b + 0.5, y + 0.45, str(b), ha="center", va="center", fontsize=9,
                color="black" if dark else "white")
    ax.text(-0.2, y + 0.45, label, ha="right", va="center", fontsize=9)


def draw_transfer(src, dst, pairs, *, labels=("pool A", "pool B"), title=None,
                  ax=None) -> Figure:
    """The blocks of managers ``src`` and ``dst`` as two rows, coloured by owner, and an
    arrow from block ``a`` of the top row to block ``b`` of the bottom one for each
    ``(a, b)`` of ``pairs``. Patches: one square per block of each pool, one arrow per
    pair. Raises :class:`ValueError` for a pair outside either pool."""
    top, _ = manager_owners(src)
    bottom, _ = manager_owners(dst)
    pairs = [(int(a), int(b)) for a, b in pairs]
    for a, b in pairs:
        if not (0 <= a < len(top) and 0 <= b < len(bottom)):
            raise ValueError(f"pair ({a}, {b}) is outside the pools of {len(top)} and "
                             f"{len(bottom)} blocks")
    colors = owner_colors(top + bottom)
    width = max(len(top), len(bottom))
    scale = min(0.55, 11 / (width + 3))
    fig, ax = _new_axes(ax, (scale * (width + 3) + 1.2, scale * 4.6 + 0.6))
    _row(ax, top, colors, 3.0, labels[0])
    _row(ax, bottom, colors, 0.0, labels[1])
    for a, b in pairs:
        owner = top[a]
        color = SHARED_COLOR if owner is FREE else colors[owner]
        ax.add_patch(FancyArrowPatch((a + 0.5, 3.0), (b + 0.5, 0.92), arrowstyle="-|>",
                                     mutation_scale=10, color=color, lw=1.2, shrinkA=0,
                                     shrinkB=0))
    ax.set_xlim(-1.6, width)
    ax.set_ylim(-0.2, 4.1)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    _legend(ax, colors, free=FREE in top + bottom)
    return fig
