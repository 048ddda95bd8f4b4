"""The prefill kernel's work, drawn: query tiles x K/V tiles of one sequence's chunk, read
through its block table, and what the causal mask does to each pair (chapter 13)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ..checks import cdiv, count, positive_int

__all__ = ["SKIPPED", "CUT", "FULL", "tile_kinds", "draw_prefill_tiles"]

#: The kinds of a (query tile, K/V tile) pair in :func:`tile_kinds`.
SKIPPED, CUT, FULL = 0, 1, 2

_COLOURS = {FULL: "#0072B2", CUT: "#E69F00", SKIPPED: "#eeeeee"}
_NAMES = {FULL: "read, no mask (below the diagonal)", CUT: "read, masked (cut by it)",
          SKIPPED: "never read (above it)"}


def tile_kinds(start: int, new_tokens: int, *, q_tile: int, kv_tile: int,
               group: int = 1) -> np.ndarray:
    """The kind of every (query tile, K/V tile) pair of one sequence's chunk, whose
    ``new_tokens`` tokens sit at positions ``start .. start + new_tokens - 1``: ``[query
    tiles, K/V tiles]`` of :data:`FULL` (every key of the K/V tile is at or before every
    row's position: read, no mask), :data:`CUT` (the diagonal crosses it: read, masked) or
    :data:`SKIPPED` (every key is past every row's position: never read). A row is one
    (new token, query head of a group), token-major, ``q_tile`` rows a tile, as in
    ``paged_prefill.cu``; the K/V tiles cover positions 0 to the chunk's last."""
    start, new_tokens = count(start, "start"), positive_int(new_tokens, "new_tokens")
    q_tile, kv_tile = positive_int(q_tile, "q_tile"), positive_int(kv_tile, "kv_tile")
    group = positive_int(group, "group")
    rows = new_tokens * group
    r0 = np.arange(0, rows, q_tile)
    first = start + r0 // group                       # each tile's first row's position
    last = start + (np.minimum(r0 + q_tile, rows) - 1) // group         # and last row's
    t0 = np.arange(0, start + new_tokens, kv_tile)    # each K/V tile's first key
    t1 = np.minimum(t0 + kv_tile, start + new_tokens) - 1
    kinds = np.full((len(r0), len(t0)), CUT, np.int8)
    kinds[t1[None, :] <= first[:, None]] = FULL
    kinds[t0[None, :] > last[:, None]] = SKIPPED
    return kinds


def draw_prefill_tiles(block_table, start: int, new_tokens: int, block_size: int, *,
                       q_tile: int, kv_tile: int, title: str | None = None):
    """One sequence's chunk as the prefill kernel sees it: a column per key position (the
    block table's physical block of each block of positions written above), a row per new
    token, a rectangle per (query tile, K/V tile) pair coloured by :func:`tile_kinds`, and
    the causal diagonal (a token attends to the keys at or left of it). One query head per
    kv head here, so a row is a token. Returns the Figure."""
    table = np.asarray(block_table)
    block_size = positive_int(block_size, "block_size")
    length = start + new_tokens
    if len(table) < cdiv(length, block_size):
        raise ValueError(f"a block table of {len(table)} blocks does not hold {length} "
                         f"tokens of {block_size}")
    kinds = tile_kinds(start, new_tokens, q_tile=q_tile, kv_tile=kv_tile)
    fig, ax = plt.subplots(figsize=(8.5, 1.6 + 4.2 * new_tokens / length))
    for i, j in np.ndindex(kinds.shape):
        y0, x0 = start + i * q_tile, j * kv_tile
        h, w = min(q_tile, length - y0), min(kv_tile, length - x0)
        ax.add_patch(Rectangle((x0, y0), w, h, facecolor=_COLOURS[int(kinds[i, j])],
                               edgecolor="white", lw=2))
    ax.plot([start, length], [start, length], color="black", lw=1.2)  # key = position
    blocks = cdiv(length, block_size)
    for b in range(blocks):
        ax.axvline(b * block_size, color="grey", lw=0.6, ls=":")
        ax.text((b + 0.5) * block_size, start - 0.6, f"block {table[b]}", ha="center",
                va="bottom", fontsize=8)
    if start:
        ax.axvspan(0, start, color="grey", alpha=0.08, lw=0)
    if blocks * block_size > length:                  # the last block's unwritten slots
        ax.axvspan(length, blocks * block_size, color="none", hatch="//", ec="#bbbbbb")
    ax.set_xlim(0, blocks * block_size)
    ax.set_ylim(length, start - 0.5 - max(1.5, 0.06 * new_tokens))
    notes = [f"keys left of {start}: cached by earlier steps"] if start else []
    if blocks * block_size > length:
        notes.append("hatched: not written yet")
    ax.set_xlabel(f"key position: K/V tiles of {kv_tile}, blocks of {block_size}"
                  + (f" ({'; '.join(notes)})" if notes else ""))
    ax.set_ylabel(f"new token's position\n(query tiles of {q_tile})")
    shown = [k for k in (FULL, CUT, SKIPPED) if (kinds == k).any()]
    ax.legend([Patch(facecolor=_COLOURS[k], edgecolor="grey") for k in shown],
              [f"{_NAMES[k]}: {int((kinds == k).sum())}" for k in shown],
              loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=len(shown),
              fontsize=8, frameon=False)
    ax.set_title(title or "query tiles x K/V tiles, through the block table", fontsize=10,
                 loc="left")
    fig.tight_layout()
    return fig
