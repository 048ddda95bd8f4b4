"""Pictures of the simulation: utilization over time, where the pool's memory goes, the pool's
blocks over time, sharing savings, and widgets to explore them live.

Every function draws on a matplotlib ``Axes`` (a new figure when none is given) and returns it;
nothing here is random, so the same runs give the same pictures.
"""
from __future__ import annotations

import numpy as np

from .. import sim

__all__ = ["plot_utilization", "plot_breakdown", "plot_pool", "plot_savings",
           "explore_simulation", "explore_beam", "CATEGORY_COLORS"]

#: token states / reserved / internal / external / free, as in Figure 2 of the vLLM paper
CATEGORY_COLORS = {"tokens": "#4c9a2a", "reserved": "#f2b134", "internal": "#d9534f",
                   "external": "#7b4fa0", "free": "#e8e8e8"}


def _axes(ax, size=(8, 3.5)):
    if ax is None:
        import matplotlib.pyplot as plt
        _, ax = plt.subplots(figsize=size, layout="constrained")
    return ax


def plot_utilization(runs, ax=None, what: str = "held"):
    """Share of the pool held (``what="held"``) or holding token K/V (``"tokens"``), per decode
    step, one line per run."""
    ax = _axes(ax)
    for run in runs:
        s = run.series
        ax.plot(s["step"], s[what] / run.pool_slots, lw=1.2, label=run.policy)
    ax.set_xlabel("decode step")
    ax.set_ylabel("share of the pool " + ("held" if what == "held" else "holding K/V"))
    ax.set_ylim(0, 1.02)
    ax.yaxis.set_major_formatter(_percent())
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    ax.grid(alpha=0.3)
    return ax


def _percent():
    from matplotlib.ticker import PercentFormatter
    return PercentFormatter(1.0, decimals=0)


def plot_breakdown(runs, ax=None, busy: bool = True):
    """One horizontal bar per run: the time-averaged shares of the pool holding token K/V,
    reserved for tokens to come, lost inside reservations or blocks (internal), lost between
    them (external), and free. ``busy``: average only over steps when a request waited."""
    ax = _axes(ax, (8, 0.45 * len(runs) + 1.2))
    names = [r.policy for r in runs]
    y = np.arange(len(runs))[::-1]
    left = np.zeros(len(runs))
    for key, color in CATEGORY_COLORS.items():
        share = np.array([r.breakdown(busy)[key] for r in runs])
        ax.barh(y, share, left=left, color=color, edgecolor="white", label=key)
        for yi, l, w in zip(y, left, share):
            if w >= 0.06:
                ax.text(l + w / 2, yi, f"{w:.0%}", ha="center", va="center", fontsize=8)
        left += share
    ax.set_yticks(y, names)
    ax.set_xlim(0, 1)
    ax.xaxis.set_major_formatter(_percent())
    ax.set_xlabel("share of the pool, averaged over the steps when a request waited" if busy
                  else "share of the pool, averaged over all steps")
    ax.legend(ncol=5, fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    return ax


def plot_pool(owners, ax=None, title: str = "", shared_label: str = "shared (refcount > 1)"):
    """A heat map of the pool: one row per block, one column per step, coloured by the owner
    (``owners[step, block]``: an owner id, -2 for a shared block, -1 for a free one)."""
    import matplotlib.colors as mcolors
    ax = _axes(ax, (8, 3.5))
    owners = np.asarray(owners)
    palette = np.array(mcolors.to_rgba_array(
        ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
         "#17becf", "#bcbd22", "#7f7f7f"]))
    img = np.ones(owners.shape + (4,))
    own = owners >= 0
    img[own] = palette[owners[own] % len(palette)]
    img[owners == -2] = mcolors.to_rgba("black")
    ax.imshow(img.transpose(1, 0, 2), aspect="auto", interpolation="nearest", origin="lower",
              extent=(0.5, owners.shape[0] + 0.5, -0.5, owners.shape[1] - 0.5))
    ax.set_xlabel("decode step")
    ax.set_ylabel("physical block")
    if title:
        ax.set_title(title, fontsize=10)
    from matplotlib.patches import Patch
    ax.legend(handles=[Patch(color="black", label=shared_label),
                       Patch(facecolor="white", edgecolor="grey", label="free")],
              fontsize=8, loc="upper left", framealpha=0.9)
    return ax


def plot_savings(ours: dict, paper: dict, ax=None):
    """Grouped bars: memory saved by sharing, ours against the paper's, per (mode, width)."""
    ax = _axes(ax, (8, 3.2))
    keys = list(ours)
    x = np.arange(len(keys))
    ax.bar(x - 0.2, [ours[k] for k in keys], 0.4, label="this simulation", color="#4c9a2a")
    ax.bar(x + 0.2, [paper.get(k, np.nan) for k in keys], 0.4, label="vLLM paper (Alpaca)",
           color="#999999")
    for xi, k in zip(x, keys):
        ax.text(xi - 0.2, ours[k] + 0.01, f"{ours[k]:.1%}", ha="center", fontsize=8)
    ax.set_xticks(x, [f"{m} {w}" for m, w in keys])
    ax.yaxis.set_major_formatter(_percent())
    ax.set_ylabel("memory saved by sharing")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return ax


# ------------------------------------------------------------------ widgets

def explore_simulation(preset: str = "chat", n: int = 150, pool_mib: int = 16,
                       rate: float = 1.0, seed: int = 0):
    """Sliders for block size and concurrency; redraws the paged run's utilization against
    max-length reservation on the same trace (needs a live kernel)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt
    wl = sim.make_workload(preset, n=n, seed=seed, rate=rate)

    def draw(block_size=16, concurrency=64):
        fig, ax = plt.subplots(figsize=(8, 3), layout="constrained")
        runs = [sim.serve(wl, sim.make_policy(name, pool_mib * sim.MiB, wl.max_len,
                                              **({"max_seqs": concurrency}
                                                 if name.startswith("paged") else {})),
                          max_seqs=concurrency)
                for name in (f"paged:{block_size}", "max-length")]
        plot_utilization(runs, ax, what="tokens")
        ax.set_title(f"{preset}, {n} requests: paged finishes in {runs[0].steps} steps, "
                     f"max-length in {runs[1].steps}", fontsize=10)
        plt.show()

    return w.interactive(draw, block_size=w.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128],
                                                            value=16, description="block size"),
                         concurrency=w.IntSlider(value=64, min=1, max=256, step=1,
                                                 description="max seqs"))


def explore_beam(prompt: int = 10, output: int = 30, block_size: int = 4, seed: int = 0):
    """A slider for the beam width; redraws the pool during one beam search (live kernel)."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    def draw(width=4):
        kv = sim.PagedKV(96 * block_size * 512, block_size, write=True)
        record = []
        used, unshared = sim.beam_search(kv, 0, prompt, output, width,
                                         np.random.default_rng(seed), record=record)
        fig, ax = plt.subplots(figsize=(8, 3.2), layout="constrained")
        top = max(int(np.flatnonzero((np.array([r[2] for r in record]) != -1).any(0)).max()) + 1, 1)
        plot_pool(np.array([r[2][:top] for r in record]), ax,
                  title=f"beam width {width}: {1 - used / unshared:.0%} of blocks saved by "
                        f"sharing, {kv.copies} copies, {kv.corrupted} corrupted tokens")
        plt.show()

    return w.interactive(draw, width=w.IntSlider(value=4, min=1, max=8, description="beam width"))
