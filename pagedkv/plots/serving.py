"""Pictures of serving under load: when each request got its tokens, with and without a token
budget (chapter 13)."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

__all__ = ["draw_token_times", "draw_gaps", "draw_timeline"]


def draw_token_times(runs: dict, *, title: str | None = None):
    """One panel per run (``{name: result}``, results of
    :func:`pagedkv.bench.serve.serve_pagedkv`, whose last request is the long prompt): a
    tick at every token each request received, the long prompt's arrival as a line."""
    fig, axes = plt.subplots(len(runs), 1, figsize=(8.5, 1.2 + 1.5 * len(runs)),
                             sharex=True, squeeze=False)
    for ax, (name, r) in zip(axes[:, 0], runs.items()):
        stamps, due = r["stamps"], r["due"]
        for i, s in enumerate(stamps):
            last = i == len(stamps) - 1
            ax.plot(s, np.full(len(s), i), "|", ms=7,
                    color="tab:red" if last else "tab:blue")
        ax.axvline(due[-1], color="tab:red", lw=0.8, ls="--")
        ax.set_yticks(range(len(stamps)),
                      [f"req {i}" for i in range(len(stamps) - 1)] + ["long"])
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_ylim(-0.7, len(stamps) - 0.3)
    axes[-1, 0].set_xlabel("seconds since the first request arrived")
    fig.suptitle(title or "every tick a token; the dashed line: the long prompt arrives",
                 fontsize=10)
    fig.tight_layout()
    return fig


def draw_gaps(runs: dict):
    """The running requests' inter-token gaps in each run, sorted: the tail is the stall."""
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for name, r in runs.items():
        gaps = np.sort([b - a for s in r["stamps"][:-1] for a, b in zip(s, s[1:])]) * 1e3
        ax.plot(np.linspace(0, 100, len(gaps)), gaps, label=name)
    ax.set_xlabel("percentile of the running requests' gaps")
    ax.set_ylabel("gap between tokens (ms)")
    ax.set_yscale("log")
    ax.legend(fontsize=9)
    fig.tight_layout()
    return fig


TIMELINE_COLORS = {"decode": "tab:blue", "prefill": "tab:orange", "mixed": "tab:purple",
                   "swap": "tab:gray"}


def draw_timeline(traces: dict, *, title: str | None = None):
    """One panel per run (``{name: trace}``, each a
    :meth:`pagedkv.model.timeline.Timeline.to_json` of a few steps, in ms): the host's lane
    (each step; hatched, the part of it spent waiting for the GPU) above the GPU's (its
    spans, coloured by kind)."""
    fig, axes = plt.subplots(len(traces), 1, figsize=(8.5, 1.0 + 1.3 * len(traces)),
                             sharex=True, squeeze=False)
    end = 0.0
    for ax, (name, t) in zip(axes[:, 0], traces.items()):
        for n, s, e in t["host"]:
            if n == "step":
                ax.broken_barh([(s, e - s)], (1.1, 0.8), color="tab:green", alpha=0.75)
            elif n == "wait":
                ax.broken_barh([(s, e - s)], (1.1, 0.8), facecolor="white",
                               edgecolor="tab:green", hatch="////", lw=0.5)
        for n, s, e in t["device"]:
            ax.broken_barh([(s, e - s)], (0.1, 0.8), color=TIMELINE_COLORS.get(n, "k"),
                           edgecolor="white", lw=0.5)
        end = max([end] + [e for n, _, e in t["host"] if n == "step"])
        ax.set_yticks([0.5, 1.5], ["GPU", "host"])
        ax.set_ylim(0, 2)
        ax.set_title(name, fontsize=10, loc="left")
    axes[-1, 0].set_xlim(0, end)
    axes[-1, 0].set_xlabel("ms from the first step's start")
    fig.suptitle(title or "green: the host in a step (hatched: waiting for the GPU); "
                 "blue: the GPU decoding", fontsize=10)
    fig.tight_layout()
    return fig
