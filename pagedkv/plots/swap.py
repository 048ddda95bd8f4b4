"""Swapping, drawn (chapter 11): the device's pool above the host's, moment by moment.

:func:`snapshot` reads one moment from a live prefix-caching manager and its
:class:`~pagedkv.swap.Swapper`: who holds each device block (or that it is cached and idle,
or free), who has parked each host block, and the copies just planned. :func:`draw_swap`
draws a row of such moments, the copies as arrows between the two pools.
"""
from __future__ import annotations

from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from .memory import EDGE_COLOR, FREE_COLOR, owner_colors
from .prefix import IDLE_COLOR

__all__ = ["Moment", "snapshot", "draw_swap"]


class Moment(NamedTuple):
    title: str
    device: list     # per device block: its owners' names (a tuple), "idle" or None (free)
    host: list       # per host block: the names of the sequences parked in it, or None
    copies: list     # (from "device" or "host", block, to block) for the copies planned


def snapshot(title: str, manager, swapper, *, out=(), back=()) -> Moment:
    """One moment: ``out`` the (device, host) pairs a ``swap_out`` just returned, ``back``
    the (host, device) pairs of a ``swap_in``."""
    device: list = [None] * manager.allocator.num_blocks
    for s in manager.seq_ids:
        for b in manager.block_table(s).tolist():
            device[b] = (device[b] or ()) + (s,)
    for b in range(len(device)):
        if device[b] is None and manager.cache.is_idle(b):
            device[b] = "idle"
    host: list = [None] * swapper.host.num_blocks
    for s, parked in swapper.swapped.items():
        for b in parked.host_blocks:
            host[b] = (host[b] or ()) + (s,)
    copies = [("device", int(d), int(h)) for d, h in out] + \
        [("host", int(h), int(d)) for h, d in back]
    return Moment(title, device, host, copies)


def draw_swap(moments, *, title=None) -> Figure:
    """Each moment a panel: the device's blocks in the top row, the host's below, a block
    coloured by the sequence that holds it (hatched: idle in the cache), and each copy an
    arrow from where the bytes are to where they go."""
    names = sorted({s for m in moments for row in (m.device, m.host) for o in row
                    if isinstance(o, tuple) for s in o}, key=str)
    colors = owner_colors(names)
    fig = Figure(figsize=(3.4 * len(moments), 2.4), layout="constrained")
    axes = fig.subplots(1, len(moments), squeeze=False)[0]
    for ax, m in zip(axes, moments):
        rows = {"device": (m.device, 1.6), "host": (m.host, 0.0)}
        for row, (blocks, y) in rows.items():
            ax.text(-0.3, y + 0.4, row, ha="right", va="center", fontsize=9)
            for b, owner in enumerate(blocks):
                idle = owner == "idle"
                face = IDLE_COLOR if idle else FREE_COLOR if owner is None else \
                    colors[owner[0]]
                ax.add_patch(Rectangle((b, y), 0.9, 0.8, facecolor=face, lw=1,
                                       edgecolor=EDGE_COLOR, hatch="//" if idle else None))
                label = "" if owner is None or idle else "+".join(map(str, owner))
                ax.text(b + 0.45, y + 0.4, label, ha="center", va="center", fontsize=8)
                ax.text(b + 0.45, y - 0.12 if row == "host" else y + 0.92, str(b),
                        ha="center", va="center", fontsize=7, color=EDGE_COLOR)
        for where, a, b in m.copies:
            start = (a + 0.45, 1.6) if where == "device" else (a + 0.45, 0.8)
            end = (b + 0.45, 0.8) if where == "device" else (b + 0.45, 1.6)
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10,
                                         color=EDGE_COLOR, lw=1.1))
        width = max(len(m.device), len(m.host))
        ax.set_xlim(-1.4, width + 0.1)
        ax.set_ylim(-0.4, 2.7)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(m.title, fontsize=9)
    fig.legend(handles=[Patch(facecolor=IDLE_COLOR, edgecolor=EDGE_COLOR, hatch="//",
                              label="cached and idle: no owner, still found by its name"),
                        Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free")],
               loc="lower center", ncols=2, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
