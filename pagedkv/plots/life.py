"""The life of a block in a prefix-caching pool (chapter 11), as a state diagram.

A block is in one of three states: **free** (on the allocator's free stack), **in use**
(mapped by one or more page tables: refcount at least 1) or **idle** (cached, mapped by
nobody: it counts as free, but its name still finds it). :data:`MOVES` lists the moves
between them and the call of :class:`~pagedkv.prefix_cache.CachedBlocks` that makes each;
:func:`block_states` reads the state of every block of a live
:class:`~pagedkv.prefix_cache.PrefixCachingManager`; :func:`draw_block_life` draws the
diagram, with the number of blocks in each state when given.
"""
from __future__ import annotations

from collections import Counter

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

from .memory import EDGE_COLOR, FREE_COLOR, PALETTE
from .prefix import IDLE_COLOR

__all__ = ["STATES", "MOVES", "block_states", "draw_block_life"]

#: The three states, left to right, with what each means.
STATES = {"free": "on the free stack", "in use": "mapped: refcount ≥ 1",
          "idle": "cached, refcount 0"}

#: (from, to, the call that makes the move).
MOVES = [
    ("free", "in use", "allocate(): pop the free stack"),
    ("in use", "free", "free(): the last owner leaves, no name"),
    ("in use", "idle", "free(): the last owner leaves, named"),
    ("idle", "in use", "take(): found again (a hit)"),
    ("idle", "in use", "allocate(), the stack empty: evict the\n"
                       "least recently used (its name forgotten)"),
]


def block_states(manager) -> list:
    """The state of each block of a prefix-caching manager's pool: "free", "in use" or
    "idle"."""
    cache = manager.cache
    refs = cache.refcounts()
    return ["idle" if cache.is_idle(b) else "in use" if refs[b] else "free"
            for b in range(cache.num_blocks)]


def draw_block_life(states=None, *, title=None) -> Figure:
    """The three states and the moves between them, each labelled with its call; with
    ``states`` (from :func:`block_states`), each box says how many blocks are in it."""
    counts = Counter(states or [])
    fig = Figure(figsize=(9.6, 3.5), layout="constrained")
    ax = fig.add_subplot()
    x = {"free": 0.0, "in use": 4.2, "idle": 8.4}
    fill = {"free": FREE_COLOR, "in use": "#CFE3F1", "idle": IDLE_COLOR}
    w, h = 2.6, 1.25
    for name, note in STATES.items():
        ax.add_patch(FancyBboxPatch((x[name], 0), w, h,
                                    boxstyle="round,pad=0.05,rounding_size=0.25",
                                    facecolor=fill[name], edgecolor=EDGE_COLOR, lw=1.2))
        ax.text(x[name] + w / 2, 0.9, name, ha="center", va="center", fontsize=12,
                fontweight="bold")
        ax.text(x[name] + w / 2, 0.55, note, ha="center", va="center", fontsize=9)
        if states is not None:
            n = counts[name]
            ax.text(x[name] + w / 2, 0.22, f"{n} block{'' if n == 1 else 's'}",
                    ha="center", va="center", fontsize=9)

    def arrow(a, b, y0, y1, rad, label, ly, color=EDGE_COLOR):
        start = (x[a] + (w if x[a] < x[b] else 0), y0)
        end = (x[b] + (0 if x[a] < x[b] else w), y1)
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=f"arc3,rad={rad}",
                                     arrowstyle="-|>", mutation_scale=14, color=color, lw=1.4))
        ax.text((start[0] + end[0]) / 2, ly, label, ha="center", va="center", fontsize=9,
                color=color)

    arrow("free", "in use", 1.0, 1.0, -0.45, MOVES[0][2], 1.8)
    arrow("in use", "free", 0.25, 0.25, -0.45, MOVES[1][2], -0.55)
    arrow("in use", "idle", 1.0, 1.0, -0.45, MOVES[2][2], 1.8)
    arrow("idle", "in use", 0.25, 0.25, -0.45, MOVES[3][2], -0.55)
    ax.add_patch(FancyArrowPatch((x["idle"] + w / 2, -0.05), (x["in use"] + w / 2, -0.05),
                                 connectionstyle="arc3,rad=-0.55", arrowstyle="-|>",
                                 mutation_scale=14, color=PALETTE[5], lw=1.4))
    ax.text((x["idle"] + x["in use"]) / 2 + w / 2, -1.75, MOVES[4][2], ha="center",
            va="center", fontsize=9, color=PALETTE[5])
    ax.text(x["in use"] + w / 2, 2.55, "in use, a block that fills is named: insert()",
            ha="center", va="center", fontsize=9, style="italic")
    ax.set_xlim(-0.3, x["idle"] + w + 0.3)
    ax.set_ylim(-2.2, 2.8)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    return fig
