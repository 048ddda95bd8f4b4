"""Pictures of the simulation: where the pool's memory goes, the pool's blocks over
time, sharing savings, and widgets to explore them live.

The same convention as :mod:`pagedkv.plots.memory`: every function returns a
:class:`matplotlib.figure.Figure` built without ``pyplot`` (drawn on ``ax`` when one is
given), colours come from its Okabe-Ito palette, free memory is pale grey, and text is
at least 9 pt. Nothing here is random: the same runs give the same pictures.
"""
from __future__ import annotations

import numpy as np
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator, PercentFormatter

from .. import sim
from ..sim.measure import Observer
from .memory import (EDGE_COLOR, FREE, FREE_COLOR, PALETTE, SHARED, SHARED_COLOR, _new_axes,
                     manager_owners)

__all__ = ["CATEGORY_COLORS", "plot_utilization", "plot_shares", "plot_breakdown",
           "PoolRecorder", "plot_pool", "plot_sharing", "beam_pool_figure", "plot_savings",
           "simulation_figure", "explore_simulation", "explore_beam"]

#: The memory categories of :mod:`pagedkv.sim.measure`, as in Figure 2 of the vLLM
#: paper; ``unsplit`` is waste a source reports without saying which kind it is.
CATEGORY_COLORS = {"tokens": PALETTE[2], "reserved": PALETTE[1], "internal": PALETTE[5],
                   "external": PALETTE[3], "free": FREE_COLOR, "unsplit": SHARED_COLOR}
#: Blocks of requests that a pool picture does not single out.
OTHER_COLOR = "#B4B4B4"


def _percent_axis(axis):
    axis.set_major_formatter(PercentFormatter(1.0, decimals=0))


def _legend(ax, handles, **kw):
    ax.legend(handles=handles, fontsize=9, frameon=False, **kw)


# ------------------------------------------------------------------ memory over time
def plot_utilization(runs, what: str = "tokens", *, title=None, ax=None):
    """Share of the pool holding K/V (``what="tokens"``) or held (``"held"``), per
    decode step, one line per run."""
    fig, ax = _new_axes(ax, (8, 3.4))
    for i, run in enumerate(runs):
        s = run.series
        ax.plot(s["step"], s[what] / run.pool_slots, lw=1.3, color=PALETTE[i % len(PALETTE)],
                label=f"{run.policy} ({run.steps} steps)")
    ax.set_xlabel("decode step")
    ax.set_ylabel("share of the pool " + ("held" if what == "held" else "holding K/V"))
    ax.set_ylim(0, 1.02)
    _percent_axis(ax.yaxis)
    ax.grid(alpha=0.3)
    _legend(ax, None, loc="upper right", ncol=1 if len(runs) < 4 else 2)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def plot_shares(rows, *, xlabel="share of the pool", title=None, ax=None):
    """One horizontal bar per ``(label, shares)`` in ``rows``, split into the
    categories of :data:`CATEGORY_COLORS`; shares of 6 % or more are printed on the
    bar. The legend lists only the categories drawn."""
    rows = list(rows)
    fig, ax = _new_axes(ax, (8.5, 0.42 * len(rows) + 1.3))
    y = np.arange(len(rows))[::-1]
    left = np.zeros(len(rows))
    drawn = []
    for key, color in CATEGORY_COLORS.items():
        share = np.array([shares.get(key, 0.0) for _, shares in rows])
        if not share.any():
            continue
        ax.barh(y, share, left=left, color=color, edgecolor="white",
                hatch="//" if key == "unsplit" else None)
        for yi, lft, w in zip(y, left, share):
            if w >= 0.06:
                ax.text(lft + w / 2, yi, f"{w:.0%}", ha="center", va="center", fontsize=9,
                        color="white" if key in ("tokens", "internal") else "black")
        drawn.append(Patch(facecolor=color, edgecolor=EDGE_COLOR,
                           hatch="//" if key == "unsplit" else None,
                           label="waste not split" if key == "unsplit" else key))
        left += share
    ax.set_yticks(y, [label for label, _ in rows], fontsize=10)
    ax.set_xlim(0, 1)
    _percent_axis(ax.xaxis)
    ax.set_xlabel(xlabel)
    _legend(ax, drawn, ncol=len(drawn), loc="lower center", bbox_to_anchor=(0.5, 1.0))
    if title:
        ax.set_title(title, fontsize=11, pad=28)
    return fig


def plot_breakdown(runs, busy: bool = True, *, title=None, ax=None):
    """:func:`plot_shares` of each run's time-averaged breakdown (see ``Run.breakdown``)."""
    return plot_shares([(r.policy, r.breakdown(busy)) for r in runs], title=title, ax=ax,
                       xlabel="share of the pool, averaged over the steps when a request waited"
                       if busy else "share of the pool, averaged over all steps")


# ------------------------------------------------------------------ the pool over time
class PoolRecorder(Observer):
    """An observer of :func:`~pagedkv.sim.serving.serve`: after every step, the owner
    of each of the pool's first ``blocks`` blocks
    (:func:`~pagedkv.plots.memory.manager_owners`)."""

    def __init__(self, manager, blocks: int):
        self.manager, self.blocks, self.frames = manager, blocks, []

    def stepped(self, step, batch, queue, refused):
        self.frames.append(manager_owners(self.manager, self.blocks)[0])


def _heat(ax, codes, colors, labels):
    """Draw ``codes[step, block]`` (indexes into ``colors``) as an image; legend for
    the codes that occur."""
    rgb = np.array([[int(c[i:i + 2], 16) / 255 for i in (1, 3, 5)] for c in colors])
    ax.imshow(rgb[codes].transpose(1, 0, 2), aspect="auto", interpolation="nearest",
              origin="lower", extent=(0.5, codes.shape[0] + 0.5, -0.5, codes.shape[1] - 0.5))
    ax.set_xlabel("decode step")
    ax.set_ylabel("physical block")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    present = np.unique(codes)
    _legend(ax, [Patch(facecolor=colors[k], edgecolor=EDGE_COLOR, label=labels[k])
                 for k in present], loc="upper left", bbox_to_anchor=(1.01, 1.0))


def plot_pool(frames, highlight=(), *, title=None, ax=None):
    """A heat map of the pool: one column per step, one row per block. The requests
    in ``highlight`` get a colour each; other requests' blocks are grey, shared
    blocks dark grey, free blocks pale. ``frames[step][block]`` is a block's owner
    (one encoding: :data:`~pagedkv.plots.memory.FREE`, a request id, or
    :data:`~pagedkv.plots.memory.SHARED`)."""
    highlight = list(highlight)
    colors = [FREE_COLOR, OTHER_COLOR, SHARED_COLOR] + [PALETTE[i % len(PALETTE)]
                                                        for i in range(len(highlight))]
    labels = ["free", "other requests", "shared"] + [f"request {r}" for r in highlight]
    index = {r: 3 + i for i, r in enumerate(highlight)}
    codes = np.array([[0 if o is FREE else 2 if o == SHARED else index.get(o, 1) for o in f]
                      for f in frames], dtype=np.int64)
    fig, ax = _new_axes(ax, (9, 3.6))
    _heat(ax, codes, colors, labels)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def plot_sharing(refcounts, *, title=None, ax=None):
    """A heat map of the pool coloured by how many sequences map each block:
    ``refcounts[step][block]`` (0: free; 1: one sequence; 2 and more: shared)."""
    import matplotlib
    codes = np.asarray(refcounts, dtype=np.int64)
    top = max(int(codes.max()), 2)
    shades = matplotlib.colormaps["OrRd"](np.linspace(0.35, 0.95, top - 1))
    colors = [FREE_COLOR, PALETTE[4]] + ["#%02x%02x%02x" % tuple(int(255 * c) for c in s[:3])
                                         for s in shades]
    labels = ["free", "1 sequence"] + [f"{k} sequences" for k in range(2, top + 1)]
    fig, ax = _new_axes(ax, (9, 3.4))
    _heat(ax, codes, colors, labels)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


def beam_pool_figure(width: int = 4, *, prompt: int = 10, output: int = 30, block_size: int = 4,
                     seed: int = 0, ax=None):
    """One beam search of ``width`` beams on a fresh pool of 128 blocks, drawn with
    :func:`plot_sharing`. Returns (figure, the :class:`~pagedkv.sim.CheckedKV`,
    saving)."""
    kv = sim.CheckedKV(128 * sim.SIM_SPEC.block_bytes(block_size), block_size, write=True)
    frames = []
    used, unshared = sim.beam_search(kv, 0, prompt, output, width, np.random.default_rng(seed),
                                     on_step=lambda kv: frames.append(kv.allocator.refcounts()))
    frames = np.array(frames)
    rows = int(np.flatnonzero(frames.any(axis=0)).max()) + 1
    saving = 1 - used / unshared
    fig = plot_sharing(frames[:, :rows], ax=ax, title=(
        f"beam width {width}: {saving:.0%} of the block-steps saved, {kv.copies} copies, "
        f"{kv.corrupted} corrupted tokens"))
    return fig, kv, saving


# ------------------------------------------------------------------ sharing savings
def plot_savings(ours: dict, paper: dict, *, paper_label="vLLM paper", title=None, ax=None):
    """Grouped bars per ``(mode, width)`` key: our saving beside the paper's (when it
    has that key), each labelled with its value."""
    fig, ax = _new_axes(ax, (8.5, 3.4))
    for x, key in enumerate(ours):
        pair = [(ours[key], PALETTE[2])] + ([(paper[key], SHARED_COLOR)] if key in paper else [])
        for j, (value, color) in enumerate(pair):
            xi = x + (j - (len(pair) - 1) / 2) * 0.38
            ax.bar(xi, value, 0.36, color=color, edgecolor="white")
            ax.text(xi, value + 0.01, f"{value:.1%}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(ours)), [f"{m}\nwidth {w}" for m, w in ours], fontsize=10)
    ax.set_ylim(0, max(max(ours.values()), max(paper.values(), default=0)) * 1.18)
    _percent_axis(ax.yaxis)
    ax.set_ylabel("memory saved by sharing")
    ax.grid(axis="y", alpha=0.3)
    _legend(ax, [Patch(facecolor=PALETTE[2], label="this simulation"),
                 Patch(facecolor=SHARED_COLOR, label=paper_label)], loc="upper left")
    if title:
        ax.set_title(title, fontsize=11)
    return fig


# ------------------------------------------------------------------ exploring
def simulation_figure(block_size: int = 16, concurrency: int = 32, *, preset: str = "chat",
                      n: int = 150, pool_mib: int = 4, rate: float = 1.0, seed: int = 0):
    """The paged run at ``block_size`` and ``concurrency`` on a small pool: the share
    of the pool its blocks hold and the share holding K/V (the gap is the blocks'
    unfilled slots), and the requests running, per step; max-length reservation on
    the same trace for reference."""
    from matplotlib.figure import Figure
    wl = sim.make_workload(preset, n=n, seed=seed, rate=rate)
    pool = pool_mib * sim.MiB
    paged = sim.serve(wl, sim.make_policy(f"paged:{block_size}", pool, wl.max_len,
                                          max_seqs=concurrency), max_seqs=concurrency)
    naive = sim.serve(wl, sim.make_policy("max-length", pool, wl.max_len),
                      max_seqs=concurrency)
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2)
    s = paged.series
    left.plot(s["step"], s["held"] / paged.pool_slots, lw=1.2, color=PALETTE[0],
              label="held in blocks")
    left.plot(s["step"], s["tokens"] / paged.pool_slots, lw=1.2, color=PALETTE[2],
              label="holding K/V")
    left.set_ylim(0, 1.05)
    _percent_axis(left.yaxis)
    left.set_ylabel("share of the pool")
    right.plot(s["step"], s["running"], lw=1.2, color=PALETTE[0], label="running")
    right.axhline(concurrency, color=SHARED_COLOR, lw=1, ls="--", label="max seqs")
    right.set_ylabel("requests running")
    right.set_ylim(0, max(concurrency, paged.peak_running) * 1.15)
    for ax in (left, right):
        ax.set_xlabel("decode step")
        ax.set_xlim(0, max(paged.steps, 1))
        ax.grid(alpha=0.3)
        _legend(ax, None, loc="lower center")
    fig.suptitle(f"{n} {preset} requests, {pool_mib} MiB pool, block size {block_size}, at most "
                 f"{concurrency} at once: {paged.steps} steps, {paged.preemptions} preemptions "
                 f"(max-length reservation: {naive.steps} steps)", fontsize=10.5)
    return fig


def explore_simulation(**fixed):
    """Sliders for block size and concurrency over :func:`simulation_figure` (live kernel)."""
    import ipywidgets as w
    return w.interactive(
        lambda block_size, concurrency: simulation_figure(block_size, concurrency, **fixed),
        {"auto_display": True},           # show the returned figure, as interact does
        block_size=w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128, 256], value=16,
                                     description="block size"),
        concurrency=w.IntSlider(value=32, min=1, max=128, step=1, description="max seqs"))


def explore_beam(**fixed):
    """Sliders for the beam width and the prompt length over :func:`beam_pool_figure` (live
    kernel)."""
    import ipywidgets as w
    return w.interactive(
        lambda width, prompt: beam_pool_figure(width, prompt=prompt, **fixed)[0],
        {"auto_display": True},
        width=w.IntSlider(value=6, min=1, max=8, description="beam width"),
        prompt=w.IntSlider(value=10, min=1, max=40, description="prompt"))
