"""A picture of capacity: one GPU's memory, and the sequences it holds at once.

The conventions of :mod:`pagedkv.plots.memory`: a :class:`matplotlib.figure.Figure` built
without ``pyplot``, the Okabe-Ito colours of the memory categories
(:data:`~pagedkv.plots.sim.CATEGORY_COLORS`), free memory pale, text at least 9 pt.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from ..errors import ConfigError
from ..sim.capacity import GB, Budget
from .memory import EDGE_COLOR, PALETTE, SHARED_COLOR
from .sim import CATEGORY_COLORS, OTHER_COLOR

__all__ = ["SEGMENTS", "plot_capacity"]

#: The parts of a GPU bar, left to right: (key, label, colour, hatch).
SEGMENTS = (("weights", "model weights", SHARED_COLOR, None),
            ("runtime", "activations, runtime", OTHER_COLOR, "//"),
            ("stored", "K/V stored", CATEGORY_COLORS["tokens"], None),
            ("empty", "held, never filled", CATEGORY_COLORS["internal"], None),
            ("free", "free", CATEGORY_COLORS["free"], None))


def _parts(budget: Budget, fit) -> dict:
    """A fit's bar in GB: the budget's weights and runtime, then its K/V pool's tokens."""
    tb = fit.token_bytes
    stored, empty = fit.stored_tokens * tb, fit.empty_tokens * tb
    return {"weights": budget.weight_bytes / GB, "runtime": budget.runtime_bytes / GB,
            "stored": stored / GB, "empty": empty / GB,
            "free": (budget.kv_bytes - stored - empty) / GB}


def plot_capacity(budget: Budget, fits, simulated=(), *, title=None) -> Figure:
    """Left: one bar per fit (:func:`~pagedkv.sim.capacity.fit_sequences`), the GPU's
    memory split into weights, runtime, K/V stored, held but never filled, and free.
    Right: the sequences each fits, and beside them (``simulated``, one number per fit)
    how many ran at once in the simulation.

    Artists: on the left ``len(SEGMENTS)`` bar containers of ``len(fits)`` bars; on the
    right one container of ``len(fits)`` bars, and one more if ``simulated`` is given."""
    fits, simulated = list(fits), list(simulated)
    if not fits:
        raise ConfigError("plot_capacity needs at least one fit, got none")
    if simulated and len(simulated) != len(fits):
        raise ConfigError(f"simulated needs one number per fit ({len(fits)}), "
                          f"got {len(simulated)}")
    fig = Figure(figsize=(10.5, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=[2.3, 1])
    y = np.arange(len(fits))[::-1]
    parts = [_parts(budget, f) for f in fits]
    start = np.zeros(len(fits))
    for key, label, color, hatch in SEGMENTS:
        width = np.array([p[key] for p in parts])
        left.barh(y, width, left=start, color=color, hatch=hatch, edgecolor="white",
                  label=label)
        for yi, x0, w in zip(y, start, width):
            if w >= 6:
                left.text(x0 + w / 2, yi, f"{w:.0f}", ha="center", va="center",
                          fontsize=9, color="white" if key in ("weights", "stored",
                                                               "empty") else "black")
        start += width
    left.set_yticks(y, [f"{f.scheme}\n{f.sequences:,} sequences" for f in fits],
                    fontsize=10)
    left.set_xlim(0, budget.gpu_bytes / GB)
    left.set_xlabel(f"GB of one GPU ({budget.gpu_bytes / GB:.0f} GB)")
    left.legend(handles=[Patch(facecolor=c, hatch=h, edgecolor=EDGE_COLOR, label=lab)
                         for _, lab, c, h in SEGMENTS],
                loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, fontsize=9,
                frameon=False)
    x = np.arange(len(fits))
    pairs = [("full lengths, counted", [f.sequences for f in fits], PALETTE[0])]
    if simulated:
        pairs.append(("ran at once, simulated", simulated, PALETTE[4]))
    w = 0.8 / len(pairs)
    for j, (label, values, color) in enumerate(pairs):
        xs = x + (j - (len(pairs) - 1) / 2) * w
        right.bar(xs, values, w * 0.95, color=color, label=label)
        for xi, v in zip(xs, values):
            right.text(xi, v, f"{v:,.0f}", ha="center", va="bottom", fontsize=9)
    right.set_xticks(x, [f.scheme.replace(", ", "\n") for f in fits], fontsize=10)
    right.set_ylabel("sequences at once")
    right.set_ylim(0, max(max(p[1]) for p in pairs) * 1.12)
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=9, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
