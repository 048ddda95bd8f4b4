"""Pictures of the attention kernels (chapter 9): who reads what, when, and where it goes.

* :func:`draw_row_chunks` — the lanes of a warp and the 16-byte chunks of K rows each one
  loads (step 2);
* :func:`draw_group_sharing` — the query heads of a group, each reading a K row for itself
  (steps 1–3) or sharing one read (step 4);
* :func:`draw_split_merge` — two pieces of a sequence with their own softmaxes, and the
  merge by ``exp(lse)`` that gives the softmax of the whole (step 5);
* :func:`draw_ring_timeline` — a ring of asynchronous copies: loads of the next tiles in
  flight while a tile is computed (step 6), from :func:`ring_schedule`;
* :func:`draw_fragments` — the ``mma.sync`` C fragment of the scores, which is the B
  fragment of the next product, lane for lane (step 7);
* :func:`draw_paging_tax` — time against sequence length, paged against contiguous K/V, from
  a benchmark run's ``tax_sweep.*`` rows (:func:`paging_tax_points`).

The data behind each picture comes from a function of its own (:func:`row_chunk_lanes`,
:func:`ring_schedule`, :func:`c_fragment_lanes`, :func:`b_fragment_lanes`,
:func:`paging_tax_points`), so tests check
the numbers as well as what is drawn. Every function returns a
:class:`matplotlib.figure.Figure` built without ``pyplot``, in the palette of
:mod:`pagedkv.plots.memory`.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.ticker import FuncFormatter

from .memory import EDGE_COLOR, FREE_COLOR, PALETTE

__all__ = ["row_chunk_lanes", "draw_row_chunks", "draw_group_sharing", "draw_split_merge",
           "ring_schedule", "draw_ring_timeline", "c_fragment_lanes", "b_fragment_lanes",
           "draw_fragments", "paging_tax_points", "draw_paging_tax", "TAX_SERIES"]

CHUNK_BYTES = 16
WARP = 32


def _lane_color(lane: int, lanes_per_row: int):
    return PALETTE[(lane // lanes_per_row) % len(PALETTE)]


def row_chunk_lanes(head_dim: int, item_bytes: int = 2, lanes: int = WARP) -> np.ndarray:
    """``[rows, chunks]``: the lane that loads each 16-byte chunk of the K rows a warp reads
    at once (step 2: lane ``i`` takes chunk ``i % chunks`` of row ``i // chunks``)."""
    row_bytes = head_dim * item_bytes
    if row_bytes % CHUNK_BYTES or lanes % (row_bytes // CHUNK_BYTES):
        raise ValueError(f"a row of {row_bytes} bytes is not a whole number of 16-byte "
                         f"chunks that divides {lanes} lanes")
    chunks = row_bytes // CHUNK_BYTES
    return np.arange(lanes).reshape(lanes // chunks, chunks)


def draw_row_chunks(head_dim: int = 128, item_bytes: int = 2, *, title=None) -> Figure:
    """The K rows one warp reads in one trip, cut into 16-byte chunks, each labelled with
    the lane that loads it; lanes of the same row share a colour."""
    lanes = row_chunk_lanes(head_dim, item_bytes)
    rows, chunks = lanes.shape
    fig = Figure(figsize=(10, 0.7 + 0.55 * rows), layout="constrained")
    ax = fig.add_subplot()
    for r in range(rows):
        for c in range(chunks):
            ax.add_patch(Rectangle((c, rows - 1 - r), 0.94, 0.86, edgecolor=EDGE_COLOR,
                                   facecolor=_lane_color(lanes[r, c], chunks), alpha=0.8))
            ax.text(c + 0.47, rows - 0.57 - r, f"{lanes[r, c]}", ha="center", va="center",
                    fontsize=9, color="white")
    per = CHUNK_BYTES // item_bytes
    ax.set_xlim(0, chunks)
    ax.set_ylim(-0.1, rows)
    ax.set_xticks(np.arange(chunks) + 0.47,
                  [f"{c * per}" if c % 2 == 0 else "" for c in range(chunks)], fontsize=9)
    ax.set_yticks(np.arange(rows) + 0.43, [f"token {rows - 1 - r}" for r in range(rows)],
                  fontsize=9)
    ax.set_xlabel(f"numbers of the row ({per} per 16-byte chunk; the label is the lane "
                  "that loads it)", fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or f"one warp, one trip: {rows} K rows of head_dim {head_dim}, "
                 f"{item_bytes}-byte numbers", fontsize=10)
    return fig


def draw_group_sharing(group: int = 8, *, title=None) -> Figure:
    """Left: steps 1–3, each of the ``group`` query heads reads the K row for itself.
    Right: step 4, the row is read once into the CTA and used by every head."""
    if group < 1:
        raise ValueError(f"group must be at least 1, got {group}")
    fig = Figure(figsize=(9, 0.9 + 0.42 * group), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, reads, name in ((axes[0], group, f"steps 1–3: {group} reads of the row"),
                            (axes[1], 1, "step 4: one read, used by every head")):
        for k in range(reads):                     # the row, as it comes from memory
            y = group - 1 - k if reads > 1 else (group - 1) / 2
            ax.add_patch(Rectangle((0, y), 2.2, 0.7, facecolor=PALETTE[0], alpha=0.8,
                                   edgecolor=EDGE_COLOR))
            ax.text(1.1, y + 0.35, "K row", ha="center", va="center", fontsize=9,
                    color="white")
        for g in range(group):                     # the query heads that use it
            y = group - 1 - g
            ax.add_patch(Rectangle((4.2, y), 1.8, 0.7, facecolor=PALETTE[1], alpha=0.8,
                                   edgecolor=EDGE_COLOR))
            ax.text(5.1, y + 0.35, f"head {g}", ha="center", va="center", fontsize=9)
            y0 = y if reads > 1 else (group - 1) / 2
            ax.add_patch(FancyArrowPatch((2.25, y0 + 0.35), (4.15, y + 0.35),
                                         arrowstyle="-|>", mutation_scale=10, lw=1,
                                         color=EDGE_COLOR))
        ax.set_xlim(-0.1, 6.1)
        ax.set_ylim(-0.2, group)
        ax.axis("off")
        ax.set_title(name, fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _softmax(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def _lse(s):
    return s.max() + np.log(np.exp(s - s.max()).sum())


def draw_split_merge(scores_a, scores_b, *, title=None) -> Figure:
    """Top: the softmax weights of two pieces of one head's scores, each normalised over
    its own tokens. Bottom: each piece weighed by its share ``exp(lse_i - lse)``; the
    line is the softmax of all the scores together, computed directly."""
    a, b = np.asarray(scores_a, float), np.asarray(scores_b, float)
    if not (a.size and b.size):
        raise ValueError(f"both pieces need scores, got {a.size} and {b.size}")
    lse = np.logaddexp(_lse(a), _lse(b))
    share = np.exp([_lse(a) - lse, _lse(b) - lse])
    xa, xb = np.arange(a.size), a.size + np.arange(b.size)
    fig = Figure(figsize=(9, 4.6), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.bar(xa, _softmax(a), 1.0, color=PALETTE[0], label="piece 1, its own softmax")
    top.bar(xb, _softmax(b), 1.0, color=PALETTE[1], label="piece 2, its own softmax")
    bottom.bar(xa, share[0] * _softmax(a), 1.0, color=PALETTE[0],
               label=f"piece 1 × {share[0]:.2f}")
    bottom.bar(xb, share[1] * _softmax(b), 1.0, color=PALETTE[1],
               label=f"piece 2 × {share[1]:.2f}")
    whole = _softmax(np.concatenate([a, b]))
    bottom.plot(np.concatenate([xa, xb]), whole, color="black", lw=1,
                label="softmax of the whole sequence")
    for ax, what in ((top, "weight in its piece"), (bottom, "weight in the whole")):
        ax.axvline(a.size - 0.5, color=EDGE_COLOR, ls="--", lw=1)
        ax.set_ylabel(what, fontsize=10)
        ax.tick_params(labelsize=9)
        ax.legend(fontsize=9, frameon=False, loc="upper right")
    bottom.set_xlabel("token of the sequence", fontsize=10)
    top.set_title(title or "split-K: two partial softmaxes, and their merge", fontsize=10)
    return fig


def ring_schedule(n_tiles: int, stages: int, latency: float, compute: float) -> list:
    """When each tile is asked for, arrives and is computed, for a loop that asks for tile
    ``i + stages - 1`` and then waits for tile ``i`` (the kernel's ``cp.async`` ring; one
    stage is load-then-compute). Rows (tile, asked, arrived, start, end)."""
    if n_tiles < 1 or stages < 1 or latency < 0 or compute <= 0:
        raise ValueError(f"need n_tiles, stages >= 1, latency >= 0, compute > 0; got "
                         f"{n_tiles}, {stages}, {latency}, {compute}")
    asked = [0.0] * min(stages - 1, n_tiles)     # the prologue asks for the first ones
    rows, free_at = [], 0.0                      # free_at: when the last compute ended
    for i in range(n_tiles):
        if i + stages - 1 < n_tiles:
            asked.append(free_at)                # asked at the top of iteration i
        start = max(free_at, asked[i] + latency)
        rows.append((i, asked[i], asked[i] + latency, start, start + compute))
        free_at = start + compute
    return rows


def draw_ring_timeline(n_tiles: int = 6, stages=(1, 3), latency: float = 4.0,
                       compute: float = 1.0, *, title=None) -> Figure:
    """One panel per ring size: per tile, its load in flight (pale) and its compute (solid),
    on a common time axis; the panel's title gives the loop's total time."""
    stages = list(stages)
    fig = Figure(figsize=(10, 0.8 + 0.45 * n_tiles * len(stages)), layout="constrained")
    axes = fig.subplots(len(stages), 1, sharex=True, squeeze=False)[:, 0]
    for ax, s in zip(axes, stages):
        rows = ring_schedule(n_tiles, s, latency, compute)
        for i, asked, arrived, start, end in rows:
            y = n_tiles - 1 - i
            ax.add_patch(Rectangle((asked, y + 0.15), arrived - asked, 0.7,
                                   facecolor=PALETTE[4], alpha=0.45, edgecolor=EDGE_COLOR))
            ax.add_patch(Rectangle((start, y + 0.15), end - start, 0.7,
                                   facecolor=PALETTE[5], edgecolor=EDGE_COLOR))
        total = rows[-1][4]
        ax.set_ylim(0, n_tiles)
        ax.set_yticks(np.arange(n_tiles) + 0.5,
                      [f"tile {n_tiles - 1 - y}" for y in range(n_tiles)], fontsize=9)
        ax.tick_params(axis="x", labelsize=9)
        ring = "no ring: ask, wait, compute" if s == 1 else f"a ring of {s} tiles"
        ax.set_title(f"{ring}: {total:g} time units", fontsize=10)
    axes[-1].set_xlim(0, max(r[4] for r in ring_schedule(n_tiles, min(stages), latency,
                                                          compute)) + 0.5)
    axes[-1].set_xlabel(f"time (a load takes {latency:g}, computing a tile {compute:g}); "
                        "pale: load in flight, dark: compute", fontsize=10)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def c_fragment_lanes() -> np.ndarray:
    """``[16, 16]``: the lane holding element (row, column) of the scores S = Q·Kᵀ of a
    16-token tile, as two ``m16n8k16`` C fragments (columns 0–7 in ``s0``, 8–15 in
    ``s1``): C[gid][2tig, 2tig+1] and C[gid+8][...] are lane ``4 gid + tig``'s."""
    row, col = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    return 4 * (row % 8) + (col % 8) // 2


def b_fragment_lanes() -> np.ndarray:
    """``[16, 8]``: the lane holding element (k, n) of an ``m16n8k16`` B fragment:
    B[2tig, 2tig+1][gid] (b0) and B[2tig+8, 2tig+9][gid] (b1) are lane ``4 gid + tig``'s."""
    k, n = np.meshgrid(np.arange(16), np.arange(8), indexing="ij")
    return 4 * n + (k % 8) // 2


def _lane_grid(ax, lanes, rows_used, xlabel, ylabel, title):
    nr, nc = lanes.shape
    for r in range(nr):
        for c in range(nc):
            used = r < rows_used
            ax.add_patch(Rectangle((c, nr - 1 - r), 0.95, 0.9, edgecolor=EDGE_COLOR,
                                   facecolor=PALETTE[lanes[r, c] % 4] if used
                                   else FREE_COLOR))
            if used:                               # padding rows: zeros, no lane label
                ax.text(c + 0.47, nr - 0.55 - r, f"{lanes[r, c]}", ha="center",
                        va="center", fontsize=8, color="white")
    ax.set_xlim(0, nc)
    ax.set_ylim(0, nr)
    ax.set_xticks(np.arange(0, nc, 2) + 0.47, [f"{c}" for c in range(0, nc, 2)],
                  fontsize=9)
    ax.set_yticks([nr - 1 - r + 0.45 for r in range(0, nr, 2)],
                  [f"{r}" for r in range(0, nr, 2)], fontsize=9)
    ax.set_xlabel(xlabel, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=10)
    ax.set_title(title, fontsize=10)


def draw_fragments(group: int = 8, *, title=None) -> Figure:
    """Left: the scores of a 16-token tile as C fragments, heads by tokens, each element
    labelled with its lane (rows past ``group`` are zero padding, grey). Right: Pᵀ, tokens by
    heads, as the next product's B fragment. Each lane finds its weights where its
    scores were."""
    if not 1 <= group <= 8:
        raise ValueError(f"one 8-column tile holds 1 to 8 query heads, got {group}")
    fig = Figure(figsize=(10, 5), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[16, 8])
    _lane_grid(left, c_fragment_lanes(), group, "token of the tile",
               "query head (row of A = Q)", "S = Q·Kᵀ, the C fragments s0 | s1")
    left.axvline(8 - 0.02, color="black", lw=1.5)
    _lane_grid(right, b_fragment_lanes()[:, :group], 16, "query head",
               "token of the tile (k)", "Pᵀ, the B fragment of Oᵀ += Vᵀ·Pᵀ")
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


#: The sweep's series: (row impl after ``tax_sweep.``, label), paged first.
TAX_SERIES = (("pagedkv", "ours, pages scattered"),
              ("pagedkv.identity_table", "ours, pages in order (identity table)"),
              ("sdpa_contiguous", "SDPA, contiguous K/V (no page table)"),
              ("flashinfer", "FlashInfer, pages scattered"))


def paging_tax_points(run: dict, dtype: str = "float16") -> dict:
    """From a benchmark run (the JSON of ``python -m pagedkv.bench.kernels``): per head
    layout ``(q_heads, kv_heads)``, the sweep's lengths and each series' times in µs,
    ``{"seq_len": [...], impl: [µs or None, ...]}``, lengths ascending."""
    pts = {}
    for r in run["rows"]:
        impl = r["impl"]
        if not impl.startswith("tax_sweep.") or r["dtype"] != dtype:
            continue
        key = (r["q_heads"], r["kv_heads"])
        pts.setdefault(key, {}).setdefault(int(r["seq_len"]), {})[impl[10:]] = r["us"]
    if not pts:
        raise ValueError(f"the run has no tax_sweep rows in {dtype} (run the benchmark "
                         "with the tax_sweep of bench/decode_shapes.json)")
    out = {}
    for key in sorted(pts):
        lens = sorted(pts[key])
        out[key] = {"seq_len": lens}
        for impl, _ in TAX_SERIES:
            out[key][impl] = [pts[key][n].get(impl) for n in lens]
    return out


def draw_paging_tax(run: dict, dtype: str = "float16", *, goal: float = 0.03,
                    title=None) -> Figure:
    """One column per head layout of the sweep. Top: time per decode call against sequence
    length (log-log), ours on scattered pages, ours on pages in order, SDPA on contiguous
    K/V, FlashInfer. Bottom: the tax, ours / SDPA − 1, and its scatter part, ours / ours
    on the identity table − 1, in %, with the goal as a dashed line."""
    pts = paging_tax_points(run, dtype)
    fig = Figure(figsize=(5 * len(pts) + 1, 6.5), layout="constrained")
    axes = fig.subplots(2, len(pts), sharex=True, squeeze=False,
                        height_ratios=[2, 1])
    for col, ((qh, kh), p) in enumerate(pts.items()):
        top, bottom = axes[0, col], axes[1, col]
        x = p["seq_len"]
        for i, (impl, label) in enumerate(TAX_SERIES):
            xs = [n for n, y in zip(x, p[impl]) if y is not None]
            ys = [y for y in p[impl] if y is not None]
            if ys:
                top.plot(xs, ys, "o-" if i < 3 else "s--", color=PALETTE[i], label=label,
                         lw=1.5, ms=4)
        ours, ident, sdpa = p["pagedkv"], p["pagedkv.identity_table"], p["sdpa_contiguous"]
        for name, num, den, color in (("tax: ours / SDPA − 1", ours, sdpa, PALETTE[2]),
                                      ("scatter: ours / identity − 1", ours, ident,
                                       PALETTE[1])):
            xs = [n for n, a, b in zip(x, num, den) if a and b]
            ys = [100 * (a / b - 1) for a, b in zip(num, den) if a and b]
            if ys:
                bottom.plot(xs, ys, "o-", color=color, label=name, lw=1.5, ms=4)
        bottom.axhline(100 * goal, color="k", ls="--", lw=1, label=f"goal: {goal:.0%}")
        bottom.axhline(0, color=EDGE_COLOR, lw=0.8)
        top.set_xscale("log", base=2)
        top.set_yscale("log")
        for which in (top.yaxis.set_major_formatter, top.yaxis.set_minor_formatter):
            which(FuncFormatter(lambda v, _: f"{v:g}"))       # 60, not 6 x 10^1
        top.set_title(f"{qh}/{kh} heads (group {qh // kh}), {dtype}", fontsize=10)
        top.set_ylabel("µs per call", fontsize=10)
        bottom.set_ylabel("% over", fontsize=10)
        bottom.set_xlabel("sequence length (tokens)", fontsize=10)
        bottom.set_xticks(x, [f"{n // 1024}K" if n >= 1024 else f"{n}" for n in x],
                          fontsize=9)
        bottom.set_xticks([], minor=True)
        for ax in (top, bottom):
            ax.tick_params(labelsize=9)
    axes[0, 0].legend(fontsize=8, frameon=False)
    axes[1, 0].legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
