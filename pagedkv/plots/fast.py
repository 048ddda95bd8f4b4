"""Pictures of the fast decode step: each engine's step time against the floor, where a
graph's time goes, and a step's timeline with launches one by one and replayed from a graph
(from averages, or as a profiler traced it).
Same conventions as :mod:`pagedkv.plots.memory` (no pyplot, the Okabe-Ito palette, labels of
at least 9 pt)."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..errors import ConfigError
from .memory import EDGE_COLOR, PALETTE

__all__ = ["draw_step_times", "draw_graph_parts", "draw_timeline", "draw_step_trace"]


def draw_step_times(steps: dict, batches, *, title=None) -> Figure:
    """Grouped bars on a log scale: ``steps[engine][batch]`` milliseconds (a missing batch
    leaves a gap), one group per batch size, one colour per engine."""
    batches = [str(b) for b in batches]
    fig = Figure(figsize=(9, 3.8), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / max(1, len(steps))
    for k, (name, per_batch) in enumerate(steps.items()):
        xs = [i + (k - (len(steps) - 1) / 2) * width for i, b in enumerate(batches)
              if b in per_batch]
        ys = [per_batch[b] for b in batches if b in per_batch]
        ax.bar(xs, ys, width, color=PALETTE[k % len(PALETTE)], label=name,
               edgecolor="white", lw=0.5)
    ax.set_yscale("log")
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches], fontsize=9)
    ax.set_ylabel("milliseconds a decode step (log scale)", fontsize=9)
    ax.legend(fontsize=9, ncols=len(steps), frameon=False, loc="upper center",
              bbox_to_anchor=(0.5, -0.1))               # below the axes: no bar hidden
    ax.grid(axis="y", which="both", lw=0.3, alpha=0.5)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def draw_graph_parts(parts: dict, batches, *, title=None) -> Figure:
    """Stacked bars, one per batch size: ``parts[name][batch]`` milliseconds of each part of a
    step (the multiplies, the small kernels, attention, the engine's Python...)."""
    batches = [str(b) for b in batches]
    for name, per_batch in parts.items():
        if set(per_batch) != set(batches):
            raise ConfigError(f"part {name!r} has batches {sorted(per_batch)}, "
                              f"the figure {batches}")
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(batches)
    for k, (name, per_batch) in enumerate(parts.items()):
        ys = [max(0.0, per_batch[b]) for b in batches]
        ax.bar(range(len(batches)), ys, 0.6, bottom=bottom, color=PALETTE[k % len(PALETTE)],
               label=name, edgecolor="white", lw=0.5)
        bottom = [b + y for b, y in zip(bottom, ys)]
    ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches], fontsize=9)
    ax.set_ylabel("milliseconds", fontsize=9)
    ax.legend(fontsize=9, frameon=False, loc="upper left")
    if title:
        ax.set_title(title, fontsize=10)
    return fig


def draw_timeline(rows: dict, *, span_us: float, title=None) -> Figure:
    """Timelines of the first ``span_us`` microseconds of a step, one pair of lanes (host,
    device) per entry of ``rows``: ``rows[name] = (host, device)``, each a list of (start, end)
    microseconds, drawn as boxes."""
    fig = Figure(figsize=(9, 0.9 + 1.1 * len(rows)), layout="constrained")
    ax = fig.add_subplot()
    labels = []
    for r, (name, (host, device)) in enumerate(rows.items()):
        for lane, (spans, color) in enumerate(((host, PALETTE[1]), (device, PALETTE[4]))):
            y = 2.6 * r + lane
            for a, b in spans:
                if a < span_us:
                    ax.add_patch(Rectangle((a, y + 0.1), min(b, span_us) - a, 0.8,
                                           facecolor=color, edgecolor=EDGE_COLOR, lw=0.3))
            labels.append((y + 0.5, f"{name}: {'host' if lane == 0 else 'GPU'}"))
    ax.set_xlim(0, span_us)
    ax.set_ylim(2.6 * len(rows) - 0.6, 0)
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=9)
    ax.set_xlabel("microseconds from the start of the step", fontsize=9)
    ax.tick_params(axis="y", length=0)
    if title:
        ax.set_title(title, fontsize=10)
    return fig


#: what each lane of :func:`draw_step_trace` draws: (lane, timeline key, colour, legend)
TRACE_SPANS = ((0, "host_launch", PALETTE[1], "host: a launch call"),
               (0, "host_wait", PALETTE[5], "host: waiting for the GPU"),
               (1, "gpu_kernel", PALETTE[4], "GPU: a kernel"),
               (1, "gpu_copy", PALETTE[2], "GPU: a copy"))


def draw_step_trace(timelines: dict, *, span_us: float | None = None, title=None) -> Figure:
    """One traced step per entry of ``timelines`` (``name: timeline``, a timeline as
    ``perf/step_trace.py`` writes it: lists of [start, end] µs from the step's start under
    ``host_launch``, ``host_wait``, ``gpu_kernel``, ``gpu_copy``), each a host lane and a GPU
    lane, cut at ``span_us`` (default: the longest step's ``wall_us``)."""
    if span_us is None:
        span_us = max(t["wall_us"] for t in timelines.values())
    fig = Figure(figsize=(9, 1.3 + 1.1 * len(timelines)), layout="constrained")
    ax = fig.add_subplot()
    labels = []
    for r, (name, t) in enumerate(timelines.items()):
        for lane, key, color, _ in TRACE_SPANS:
            y = 2.6 * r + lane
            for a, b in t.get(key, []):
                if a < span_us:
                    ax.add_patch(Rectangle((a, y + 0.1), max(min(b, span_us) - a, 0.0), 0.8,
                                           facecolor=color, edgecolor=EDGE_COLOR, lw=0.2))
        labels += [(2.6 * r + 0.5, f"{name}: host"), (2.6 * r + 1.5, f"{name}: GPU")]
    ax.set_xlim(0, span_us)
    ax.set_ylim(2.6 * len(timelines) - 0.6, 0)
    ax.set_yticks([y for y, _ in labels], [t for _, t in labels], fontsize=9)
    ax.set_xlabel("microseconds from the start of the step", fontsize=9)
    ax.tick_params(axis="y", length=0)
    ax.legend(handles=[Patch(facecolor=c, edgecolor=EDGE_COLOR, label=text)
                       for _, _, c, text in TRACE_SPANS], fontsize=9, ncols=4, frameon=False,
              loc="upper center", bbox_to_anchor=(0.5, -0.25))
    if title:
        ax.set_title(title, fontsize=10)
    return fig
