"""Pictures of prefix caching and preemption: the hash chain of a few prompts, the pool
with its cached idle blocks, the hit rate against the shared prefix, what the cache
saves a real model, and serving under memory pressure. Same conventions as
:mod:`pagedkv.plots.memory` (no pyplot, the Okabe-Ito palette, text of at least 9 pt).
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from ..checks import cdiv
from ..prefix_cache import block_hash
from .memory import EDGE_COLOR, FREE_COLOR, PALETTE, SHARED_COLOR, _new_axes

__all__ = ["draw_hash_chain", "cache_snapshot", "draw_cache", "plot_hit_rate",
           "plot_prefill", "plot_preemption"]

IDLE_COLOR = "#F0E442"          # cached, held by nobody: free, but still findable


# ------------------------------------------------------------------ the hash chain
def draw_hash_chain(prompts, block_size: int, token_text=str, names=None) -> Figure:
    """Each prompt as a row of blocks: a full block shows its tokens and the first hex
    digits of its chained hash (seeded by the block before it, the arrow); a block whose
    hash an earlier row already has is grey (one block in the cache); a partly filled
    last block has no name yet (dashed)."""
    widest = max(cdiv(len(p), block_size) for p in prompts)
    fig = Figure(figsize=(min(2.0 * widest + 1.2, 11), 1.25 * len(prompts) + 0.5),
                 layout="constrained")
    ax = fig.add_subplot()
    seen = set()
    for r, tokens in enumerate(prompts):
        y, parent = len(prompts) - 1 - r, 0
        for j in range(cdiv(len(tokens), block_size)):
            part = tokens[j * block_size:(j + 1) * block_size]
            text = " ".join(token_text(t) for t in part)
            full = len(part) == block_size
            if full:
                parent = block_hash(parent, tuple(part))
                color = SHARED_COLOR if parent in seen else PALETTE[r % len(PALETTE)]
                seen.add(parent)
                text += f"\nh = {parent:016x}"[:-10] + "…"
            ax.add_patch(Rectangle((2 * j, y + 0.1), 1.6, 0.8, lw=1,
                                   facecolor=color if full else "white",
                                   edgecolor=EDGE_COLOR, ls="-" if full else "--"))
            label = text if full else text + "\n(not full: no name)"
            ax.text(2 * j + 0.8, y + 0.5, label, ha="center", va="center", fontsize=9,
                    color="white" if full and color != SHARED_COLOR else "black")
            if j:
                ax.add_patch(FancyArrowPatch((2 * j - 0.4, y + 0.5), (2 * j, y + 0.5),
                                             arrowstyle="-|>", mutation_scale=10,
                                             color=EDGE_COLOR))
        if names:
            ax.text(-0.15, y + 0.5, names[r], ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6 if names else -0.1, 2 * widest)
    ax.set_ylim(0, len(prompts))
    ax.axis("off")
    ax.set_title("each full block named by a hash of its tokens, seeded by the hash of "
                 "the block before it (grey: the same name as a block above)",
                 fontsize=10)
    return fig


# ---------------------------------------------------------------- the pool, its cache
def cache_snapshot(manager) -> list:
    """Each block of a :class:`~pagedkv.prefix_cache.PrefixCachingManager`'s pool as
    ``(state, label)``: ``("free", "")``, ``("idle", rank)`` (1 is evicted first),
    ``("seq", id)`` for a block one sequence maps, ``("shared", n)`` for one n sequences
    map; a cached block that is in use has its label followed by ``*``."""
    cache, idle = manager.cache, list(manager.cache._idle)
    owners: dict = {}
    for s in manager.seq_ids:
        for b in manager.block_table(s).tolist():
            owners.setdefault(b, []).append(s)
    out = []
    for b in range(cache.num_blocks):
        star = "*" if b in cache._entry else ""
        if b in owners:
            who = owners[b]
            out.append(("seq", f"{who[0]}{star}") if len(who) == 1
                       else ("shared", f"x{len(who)}{star}"))
        elif b in cache._idle:
            out.append(("idle", str(idle.index(b) + 1)))
        else:
            out.append(("free", ""))
    return out


def draw_cache(snapshots, titles, *, ncols: int = 16, seq_colors=None) -> Figure:
    """Pool snapshots (from :func:`cache_snapshot`) one above the other: blocks of a
    sequence in its colour (``seq_colors`` maps an id to a palette index), shared ones
    grey, cached idle ones yellow with their place in the eviction order, free ones
    pale."""
    n = len(snapshots[0])
    rows = cdiv(n, ncols)
    fig = Figure(figsize=(0.55 * ncols + 2.4, (0.55 * rows + 0.45) * len(snapshots)),
                 layout="constrained")
    axes = fig.subplots(len(snapshots), 1, squeeze=False)[:, 0]
    seq_colors = dict(seq_colors or {})
    for ax, snap, title in zip(axes, snapshots, titles):
        for b, (state, label) in enumerate(snap):
            r, c = divmod(b, ncols)
            seq = label.rstrip("*")
            fixed = {"free": FREE_COLOR, "idle": IDLE_COLOR, "shared": SHARED_COLOR}
            own = PALETTE[seq_colors.get(seq, len(seq)) % len(PALETTE)]
            color = fixed.get(state, own)
            ax.add_patch(Rectangle((c + 0.05, rows - 1 - r + 0.05), 0.9, 0.9, lw=0.8,
                                   facecolor=color, edgecolor=EDGE_COLOR))
            ax.text(c + 0.5, rows - 1 - r + 0.5, label, ha="center", va="center",
                    fontsize=9,
                    color="white" if state in ("seq", "shared") else "black")
        ax.set_xlim(0, ncols)
        ax.set_ylim(0, rows)
        ax.set_aspect("equal")
        ax.axis("off")
        ax.set_title(title, fontsize=10, loc="left")
    handles = [Patch(facecolor=PALETTE[0], edgecolor=EDGE_COLOR,
                     label="held by a sequence (its colour)"),
               Patch(facecolor=SHARED_COLOR, edgecolor=EDGE_COLOR,
                     label="held by several"),
               Patch(facecolor=IDLE_COLOR, edgecolor=EDGE_COLOR,
                     label="cached, idle (eviction order)"),
               Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free")]
    axes[0].legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
                   frameon=False, fontsize=9, title="* cached", title_fontsize=9)
    return fig


# ------------------------------------------------------------------ measurements
def plot_hit_rate(rows, prompt_len: int, *, ax=None) -> Figure:
    """Share of each prompt found in the cache against the prefix length it shares with
    the prompts before it: ``rows`` maps a block size to ``(shared lengths, shares)``.
    """
    fig, ax = _new_axes(ax, (8, 3.4))
    for i, (bs, (xs, ys)) in enumerate(sorted(rows.items())):
        ax.step(xs, ys, where="post", color=PALETTE[i], lw=1.6, label=f"blocks of {bs}")
    xs = np.arange(prompt_len + 1)
    ax.plot(xs, xs / prompt_len, color=EDGE_COLOR, lw=1, ls="--",
            label="the shared share itself")
    ax.set_xlabel(f"tokens the prompt shares with earlier ones (of {prompt_len})",
                  fontsize=9)
    ax.set_ylabel("share of the prompt found cached", fontsize=9)
    ax.set_ylim(0, 1.02)
    ax.tick_params(labelsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, frameon=False, loc="upper left")
    return fig


def plot_prefill(rows) -> Figure:
    """Two bar panels for ``(label, prefill tokens computed, seconds)`` rows."""
    fig = Figure(figsize=(9, 3.0), layout="constrained")
    axes = fig.subplots(1, 2)
    labels = [r[0] for r in rows]
    for ax, k, what in ((axes[0], 1, "prompt tokens computed"),
                        (axes[1], 2, "seconds for the whole batch (this machine)")):
        vals = [r[k] for r in rows]
        ax.barh(labels, vals, color=[PALETTE[i] for i in range(len(rows))])
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:,.0f}" if k == 1 else f" {v:.1f}", va="center",
                    fontsize=9)
        ax.set_xlim(0, max(vals) * 1.25)
        ax.set_title(what, fontsize=10)
        ax.tick_params(labelsize=9)
        ax.invert_yaxis()
    return fig


def plot_preemption(runs) -> Figure:
    """Serving one trace three ways
    (:func:`~pagedkv.sim.preemption.compare_preemption`): requests running at each step,
    throughput, and latency (mean and 90th percentile)."""
    fig = Figure(figsize=(10, 3.4), layout="constrained")
    axes = fig.subplots(1, 3, width_ratios=[2.2, 1, 1])
    for i, p in enumerate(runs):
        s = p.run.series
        axes[0].plot(s["step"], s["running"], color=PALETTE[i], lw=1.2, label=p.name,
                     ls=("-", "--", "-")[i % 3])     # (recompute and swap may coincide)
        lat = np.array(list(p.latency.steps.values()))
        axes[1].bar(i, p.throughput, color=PALETTE[i])
        axes[2].bar(i, lat.mean(), color=PALETTE[i])
        axes[2].plot([i - 0.3, i + 0.3], [np.percentile(lat, 90)] * 2, color=EDGE_COLOR)
    axes[0].set_xlabel("decode step", fontsize=9)
    axes[0].set_ylabel("requests running", fontsize=9)
    axes[0].legend(fontsize=9, frameon=False)
    axes[1].set_title("tokens per step", fontsize=10)
    axes[2].set_title("latency, steps\n(bar: mean; line: 90th pct.)", fontsize=10)
    for ax in axes[1:]:
        ax.set_xticks(range(len(runs)), [p.name.split()[0] for p in runs], fontsize=9)
    for ax in axes:
        ax.tick_params(labelsize=9)
        ax.grid(alpha=0.3, axis="y")
    return fig
