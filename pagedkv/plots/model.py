"""Pictures of the real model on the paged cache: one block across the layers, the pool filling
as an answer is generated, a beam-search tree with its shared and copied blocks, and where the
time of a decode step goes. Same conventions as :mod:`pagedkv.plots.memory` (no pyplot, the
Okabe-Ito palette, labels of at least 9 pt)."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from .memory import EDGE_COLOR, PALETTE, SHARED_COLOR

__all__ = ["draw_block_across_layers", "draw_pool_filling", "draw_beam_tree",
           "draw_step_breakdown"]


def draw_block_across_layers(config, block_size: int, dtype_bytes: int = 2,
                             block_id: int = 7, num_blocks: int = 12) -> Figure:
    """The first ``num_blocks`` blocks of every layer's cache, one row a layer: block
    ``block_id`` is the same column in all ``layers`` rows, so one page-table entry names it in
    every layer at once."""
    c = config
    if not 0 <= block_id < num_blocks:
        raise ValueError(f"block_id must lie in [0, {num_blocks}), got {block_id}")
    slot = 2 * c.kv_heads * c.head_dim * dtype_bytes
    fig = Figure(figsize=(9, 4.6), layout="constrained")
    ax = fig.add_subplot()
    for layer in range(c.layers):
        for b in range(num_blocks):
            ax.add_patch(Rectangle((b, layer), 1, 1, edgecolor="white", lw=0.6,
                                   facecolor=PALETTE[0] if b == block_id else "#D9D9D9"))
    ax.set_xlim(0, num_blocks)
    ax.set_ylim(c.layers, 0)
    ax.set_xticks([b + 0.5 for b in range(num_blocks)], [str(b) for b in range(num_blocks)],
                  fontsize=9)
    ax.set_xlabel("block id (the first blocks of the pool)", fontsize=9)
    ticks = [0, c.layers // 2, c.layers - 1]
    ax.set_yticks([t + 0.5 for t in ticks], [f"layer {t}" for t in ticks], fontsize=9)
    ax.set_title(f"block {block_id} in all {c.layers} layers: {block_size} token slots of "
                 f"{slot:,} bytes (K and V, {c.kv_heads} heads x {c.head_dim}) in each, "
                 f"{c.layers * block_size * slot:,} bytes in all", fontsize=10)
    ax.tick_params(length=0)
    for sp in ax.spines.values():
        sp.set_visible(False)
    return fig


def draw_pool_filling(history, total_blocks: int, *, tokens=None, title=None) -> Figure:
    """Blocks in use (and shared) after each step of an :class:`~pagedkv.model.engine.Engine`;
    with ``tokens`` (text of each generated token) the steps are labelled by them."""
    steps = list(range(1, len(history) + 1))
    used = [h["used_blocks"] for h in history]
    shared = [h["shared_blocks"] for h in history]
    fig = Figure(figsize=(9, 3.4), layout="constrained")
    ax = fig.add_subplot()
    ax.fill_between(steps, used, step="mid", color=PALETTE[0], alpha=0.85, label="blocks in use")
    if any(shared):
        ax.fill_between(steps, shared, step="mid", color=SHARED_COLOR, label="shared blocks")
    ax.axhline(total_blocks, color=EDGE_COLOR, lw=1, ls="--", label=f"pool: {total_blocks}")
    ax.set_ylim(0, total_blocks * 1.15)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))    # blocks come whole
    ax.set_xlim(0.5, len(history) + 0.5)
    ax.set_xlabel("decode step" if tokens is None else "decode step (the token it produced)",
                  fontsize=9)
    ax.set_ylabel("blocks", fontsize=9)
    if tokens is not None:
        ax.set_xticks(steps, [repr(t)[1:-1] for t in tokens[:len(steps)]], rotation=60,
                      fontsize=9, ha="right")
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9, loc="upper left", frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def _layout(paths):
    """Prefix tree of token paths: node -> (depth, y), leaves spread top to bottom."""
    children, order = {}, []
    for path in paths:
        for d in range(1, len(path) + 1):
            node, parent = tuple(path[:d]), tuple(path[:d - 1])
            if node not in children:
                children[node] = []
                children.setdefault(parent, []).append(node)
                order.append(node)
    children.setdefault((), [])
    pos, next_y = {}, [0]

    def place(node, depth):
        kids = children.get(node, [])
        if not kids:
            pos[node] = (depth, next_y[0])
            next_y[0] += 1
            return pos[node][1]
        ys = [place(k, depth + 1) for k in kids]
        pos[node] = (depth, sum(ys) / len(ys))
        return pos[node][1]
    place((), 0)
    return pos, children


def draw_beam_tree(paths, final, token_text, tables=None, refcounts=None) -> Figure:
    """Every beam prefix that was ever live (``paths``: lists of generated token ids) as a tree,
    the ``final`` beams' paths coloured; with ``tables`` (block ids of each live beam at the
    last step) and ``refcounts``, a strip of their page tables below, shared blocks in grey."""
    pos, children = _layout(list(paths) + list(final))
    leaves = max(y for _, y in pos.values()) + 1
    height = 0.34 * leaves + (0.5 + 0.45 * len(tables) if tables else 0) + 1
    fig = Figure(figsize=(11, max(3.5, height)), layout="constrained")
    axes = fig.subplots(2, 1, height_ratios=[leaves, 0.9 * len(tables)]) if tables else \
        [fig.add_subplot()]
    ax = axes[0]
    on_final = {}
    for i, path in enumerate(final):
        for d in range(1, len(path) + 1):
            on_final.setdefault(tuple(path[:d]), i)
    for node, kids in children.items():
        x0, y0 = pos[node]
        for k in kids:
            x1, y1 = pos[k]
            color = PALETTE[on_final[k]] if k in on_final else "#BBBBBB"
            ax.plot([x0, x1], [y0, y1], color=color, lw=2 if k in on_final else 1, zorder=1)
    for node, (x, y) in pos.items():
        if node:
            text = repr(token_text(node[-1]))[1:-1]
            ax.text(x, y, text, fontsize=9, ha="center", va="center", zorder=2,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white",
                              ec=PALETTE[on_final[node]] if node in on_final else "#BBBBBB"))
    ax.text(0, pos[()][1], "prompt", fontsize=9, ha="center", va="center", zorder=2,
            bbox=dict(boxstyle="round,pad=0.2", fc="white", ec=EDGE_COLOR))
    ax.set_ylim(leaves - 0.5, -0.5)
    ax.set_xlim(-0.6, max(x for x, _ in pos.values()) + 0.7)
    ax.axis("off")
    ax.set_title("beam search, width {}: every prefix that was a live beam; the final beams "
                 "in colour".format(len(final)), fontsize=11)
    if tables:
        bx = axes[1]
        for row, blocks in enumerate(tables):
            for j, b in enumerate(blocks):
                shared = refcounts is not None and refcounts[b] > 1
                bx.add_patch(Rectangle((j, row), 0.92, 0.8, facecolor=SHARED_COLOR if shared
                                       else PALETTE[0], edgecolor=EDGE_COLOR, lw=0.6))
                bx.text(j + 0.46, row + 0.4, str(b), ha="center", va="center", fontsize=9,
                        color="white")
        bx.set_xlim(-0.1, max(len(t) for t in tables))
        bx.set_ylim(len(tables), -0.1)
        bx.set_yticks([r + 0.4 for r in range(len(tables))],
                      [f"live beam {r + 1}" for r in range(len(tables))], fontsize=9)
        bx.set_xticks([])
        bx.set_title("the live beams' page tables at the last step (grey: a block shared by "
                     "several beams; blue: the beam's own, often a copy-on-write copy)",
                     fontsize=10)
        for s in bx.spines.values():
            s.set_visible(False)
    return fig


def draw_step_breakdown(rows, parts=("matmul", "attention", "bookkeeping", "sampling",
                                     "other")) -> Figure:
    """A stacked bar per ``(label, {part: milliseconds})`` row: where a decode step's time goes.
    Each bar is scaled to its own total (shares), with the total printed above it."""
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    colors = dict(zip(parts, PALETTE))
    for i, (label, ms) in enumerate(rows):
        total = sum(ms[p] for p in parts)
        bottom = 0.0
        for p in parts:
            share = ms[p] / total
            ax.bar(i, share, bottom=bottom, color=colors[p], width=0.6,
                   label=p if i == 0 else None)
            bottom += share
        ax.text(i, 1.02, f"{total:.1f} ms", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=9)
    ax.set_ylim(0, 1.12)
    ax.set_ylabel("share of one decode step", fontsize=9)
    ax.tick_params(labelsize=9)
    ax.legend(fontsize=9, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
