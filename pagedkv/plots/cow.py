"""One fork, one write, one copy: chapter 7's worked picture, from a real manager.

:func:`fork_write_copy` runs the example on a :class:`~pagedkv.manager.KVCacheManager`,
executing each plan on a pool of token slots (a slot holds the name of the sequence that
wrote it, a copy copies a block's slots), and keeps a :class:`Moment` after each operation.
:func:`draw_fork_write_copy` draws the moments: the pool in the middle, its blocks cut into
their token slots; the first sequence's page table above it and the second's below, an
arrow from each logical block to the physical block it maps; each block's reference count;
and the copy a write planned.
"""
from __future__ import annotations

from typing import NamedTuple

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from ..allocator import BlockAllocator
from ..manager import KVCacheManager
from .memory import EDGE_COLOR, FREE_COLOR, PALETTE, SHARED_COLOR

__all__ = ["Moment", "fork_write_copy", "draw_fork_write_copy"]


class Moment(NamedTuple):
    """The manager after one operation: what was done, each sequence's blocks and tokens,
    every block's reference count, the (src, dst) copies the operation planned, the slots
    it wrote, and what every slot of the pool holds (the writer's name, or None)."""
    what: str
    tables: dict
    tokens: dict
    refcounts: list
    copies: list
    slots: list
    contents: list


def fork_write_copy(prompt: int = 6, block_size: int = 4, num_blocks: int = 6):
    """Sequence ``a`` with ``prompt`` tokens; ``fork("a", "b")``; ``b`` appends a token
    (a copy first, when ``a``'s last block is partly filled); then ``a`` appends one (in
    place: it is the last owner of its block). Returns the four :class:`Moment`."""
    contents = [None] * (num_blocks * block_size)
    moments = []
    with BlockAllocator(num_blocks, block_size * 8) as pool:
        m = KVCacheManager(pool, block_size)

        def note(what, plan=None, writer=None):
            slots, copies = [], []
            if plan is not None:
                copies = [tuple(c) for c in plan.copies.tolist()]
                for src, dst in copies:               # the copies first, then the writes
                    contents[dst * block_size:(dst + 1) * block_size] = \
                        contents[src * block_size:(src + 1) * block_size]
                slots = plan.slots.tolist()
                for s in slots:
                    contents[s] = writer
            moments.append(Moment(what, {s: m.block_table(s).tolist() for s in m.seq_ids},
                                  {s: m.num_tokens(s) for s in m.seq_ids},
                                  m.allocator.refcounts().tolist(), copies, slots,
                                  list(contents)))

        note(f'add("a", {prompt})', m.add("a", prompt), "a")
        m.fork("a", "b")
        note('fork("a", "b")')
        note('append("b")', m.append("b"), "b")
        note('append("a")', m.append("a"), "a")
        m.audit()
    return moments


def _panel(ax, mo: Moment, num_blocks: int, block_size: int, colors: dict):
    seqs = list(mo.tables)
    rows = {seqs[0]: 2.35, seqs[1]: -1.25} if len(seqs) > 1 else {seqs[0]: 2.35}
    pool_y, cell = 0.0, 1.0 / block_size
    for b in range(num_blocks):
        refs = mo.refcounts[b]
        edge = PALETTE[5] if refs > 1 else EDGE_COLOR
        ax.add_patch(Rectangle((b + 0.05, pool_y), 0.9, 1.0, facecolor="white",
                               edgecolor=edge, lw=2.2 if refs > 1 else 0.9))
        ax.text(b + 0.5, pool_y + 0.78, str(b), ha="center", va="center", fontsize=10,
                fontweight="bold")
        if refs:
            ax.text(b + 0.5, pool_y + 0.52, f"refs {refs}", ha="center", va="center",
                    fontsize=8, color=PALETTE[5] if refs > 1 else EDGE_COLOR)
        for k in range(block_size):
            who = mo.contents[b * block_size + k]
            written = b * block_size + k in mo.slots
            ax.add_patch(Rectangle((b + 0.05 + 0.9 * k * cell, pool_y + 0.05), 0.9 * cell,
                                   0.3, facecolor=colors.get(who, FREE_COLOR),
                                   edgecolor="black" if written else "white",
                                   lw=1.6 if written else 0.6))
    ax.text(-0.15, pool_y + 0.5, "pool", ha="right", va="center", fontsize=9)
    for s, y in rows.items():
        blocks = mo.tables.get(s, [])
        ax.text(-0.15, y + 0.4, f"{s}", ha="right", va="center", fontsize=10,
                color=colors[s], fontweight="bold")
        for j, b in enumerate(blocks):
            ax.add_patch(Rectangle((j + 0.1, y), 0.8, 0.8, facecolor="white",
                                   edgecolor=colors[s], lw=2))
            ax.text(j + 0.5, y + 0.4, str(j), ha="center", va="center", fontsize=9)
            start, end = ((j + 0.5, y), (b + 0.5, pool_y + 1.02)) if y > pool_y else \
                ((j + 0.5, y + 0.8), (b + 0.5, pool_y - 0.02))
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10,
                                         color=colors[s], lw=1.3, shrinkA=0, shrinkB=0))
    for src, dst in mo.copies:
        ax.add_patch(FancyArrowPatch((src + 0.5, pool_y - 0.05), (dst + 0.5, pool_y - 0.05),
                                     connectionstyle="arc3,rad=0.75", arrowstyle="-|>",
                                     mutation_scale=13, color=PALETTE[5], lw=2))
        ax.text(max(src, dst) + 1.05, pool_y - 0.45, f"copy block {src} -> {dst}",
                ha="left", va="center", fontsize=9, color=PALETTE[5])
    tokens = ", ".join(f"{s}: {n} tokens" for s, n in mo.tokens.items())
    ax.set_title(f"{mo.what}   ({tokens})", fontsize=10)
    ax.set_xlim(-0.9, num_blocks + 0.1)
    ax.set_ylim(-1.4, 3.25)
    ax.set_aspect("equal")
    ax.axis("off")


def draw_fork_write_copy(moments, num_blocks: int, block_size: int) -> Figure:
    """The moments of :func:`fork_write_copy`, two to a row."""
    cols = 2
    rows = -(-len(moments) // cols)
    fig = Figure(figsize=(9.4, 3.0 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    colors = {"a": PALETTE[0], "b": PALETTE[1], None: FREE_COLOR}
    for ax, mo in zip(axes, moments):
        _panel(ax, mo, num_blocks, block_size, colors)
    for ax in axes[len(moments):]:
        ax.axis("off")
    fig.suptitle("a slot holds the K/V its writer computed (colour); outlined: written by "
                 "this operation; a red frame: a block with several owners", fontsize=9,
                 color=SHARED_COLOR)
    return fig
