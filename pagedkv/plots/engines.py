"""Pictures for the chapter that sets pagedkv beside vLLM and SGLang: how many prompt tokens a
prefix cache finds, request by request, and how many a cached chain keeps after evictions.

Both functions return a :class:`matplotlib.figure.Figure` built without ``pyplot``, in the
palette of :mod:`pagedkv.plots.memory`; nothing is random, so the same numbers give the same
picture.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .memory import FREE_COLOR, PALETTE

__all__ = ["draw_reuse", "draw_chain_after_eviction"]


def _check_series(series: dict, n: int, what: str) -> dict:
    if not series:
        raise ValueError(f"{what}: nothing to draw")
    for name, values in series.items():
        if len(values) != n:
            raise ValueError(f"{what}: {name!r} has {len(values)} values, expected {n}")
    return series


def draw_reuse(labels, prompt_lens, found: dict, *, title=None) -> Figure:
    """One group of bars per request: its prompt length (pale, behind) and, for each prefix
    cache in ``found`` (name -> tokens found per request), the prompt tokens it found."""
    labels, prompt_lens = list(labels), list(prompt_lens)
    if len(labels) != len(prompt_lens):
        raise ValueError(f"{len(labels)} labels for {len(prompt_lens)} prompt lengths")
    _check_series(found, len(labels), "draw_reuse")
    fig = Figure(figsize=(8, 3.2), layout="constrained")
    ax = fig.add_subplot()
    x = np.arange(len(labels))
    width = 0.8 / len(found)
    ax.bar(x, prompt_lens, 0.9, color=FREE_COLOR, edgecolor="#999999", label="prompt length")
    for k, (name, values) in enumerate(found.items()):
        ax.bar(x - 0.4 + (k + 0.5) * width, values, width, color=PALETTE[k % len(PALETTE)],
               label=name)
    ax.set_xticks(x, labels, fontsize=9)
    ax.tick_params(axis="y", labelsize=9)
    ax.set_xlabel("request, in arrival order", fontsize=10)
    ax.set_ylabel("prompt tokens", fontsize=10)
    ax.set_ylim(0, 1.3 * max(prompt_lens + [1]))      # room for the legend above the bars
    ax.legend(fontsize=9, loc="upper left", ncol=len(found) + 1, frameon=False)
    ax.grid(axis="y", alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def draw_chain_after_eviction(evicted, found: dict, *, block_size: int, title=None) -> Figure:
    """Tokens of a cached prompt found again (y) after ``evicted`` of its blocks were taken for
    other work (x), one line per policy in ``found`` (name -> tokens found per x)."""
    evicted = list(evicted)
    _check_series(found, len(evicted), "draw_chain_after_eviction")
    fig = Figure(figsize=(6.5, 3.0), layout="constrained")
    ax = fig.add_subplot()
    for k, (name, values) in enumerate(found.items()):
        ax.plot(evicted, values, marker="o", lw=1.5, color=PALETTE[k % len(PALETTE)],
                label=name)
    ax.set_xticks(evicted)
    top = max(max(v) for v in found.values())
    ax.set_yticks(np.arange(0, top + block_size, block_size))
    ax.tick_params(labelsize=9)
    ax.set_xlabel("blocks of the cached prompt taken by another request", fontsize=10)
    ax.set_ylabel("prompt tokens found again", fontsize=10)
    ax.legend(fontsize=9, frameon=False)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title, fontsize=10)
    return fig
