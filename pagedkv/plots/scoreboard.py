"""The scoreboard: the final engine beside the peers measured in the same run.

The tables read the results that :func:`pagedkv.provenance.scoreboard_files` picks (the
newest decode step, in-process serving run and HTTP run), and take every engine a file
measured, so that a peer added to a benchmark appears here without a change. The figure is
built without ``pyplot``, in the palette of :mod:`pagedkv.plots.memory`.
"""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure

from .memory import PALETTE

__all__ = ["step_table", "rates", "draw_scoreboard"]


def step_table(data: dict) -> dict[str, dict[str, float]]:
    """Engine -> batch size -> step in ms, from ``python -m pagedkv.bench.model``'s JSON:
    pagedkv's graph runner first, then every other engine the run timed (pagedkv's slower
    runners left out), then the floor the bytes set."""
    rows = {}
    for key, value in data.items():
        if key.startswith("pagedkv") and key != "pagedkv_graph":
            continue
        if isinstance(value, dict) and value and all(
                isinstance(v, dict) and "step_ms" in v for v in value.values()):
            rows[key] = {b: v["step_ms"] for b, v in value.items()}
    if "pagedkv_graph" not in rows:
        raise ValueError("no pagedkv_graph step in this result")
    order = ["pagedkv_graph"] + [k for k in rows if k not in ("pagedkv_graph", "floor")]
    return {k: rows[k] for k in order + (["floor"] if "floor" in rows else [])}


def rates(data: dict) -> dict[str, dict[str, float]]:
    """Engine -> output tokens/s and the p50 and p99 of TTFT and ITL in ms, for every engine
    a serving result measured (``bench.serve``: pagedkv and its peers; ``bench.http``:
    through HTTP and the same engine in process)."""
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and "ttft_ms" in value:   # an engine, not the floor
            out[key] = {"tokens_per_s": value["output_tokens_per_s"]}
            for what in ("ttft", "itl"):
                for q in ("p50", "p99"):
                    out[key][f"{what}_{q}"] = value[f"{what}_ms"][q]
    return out


def draw_scoreboard(step: dict, served: dict, *, title: str | None = None) -> Figure:
    """Left: each engine's decode step at each batch size (``step``: name -> batch -> ms).
    Right: output tokens a second (``served``: name -> tokens/s), one bar each, pagedkv's
    (a name starting with "pagedkv") in its colour and the peers' in the next."""
    if not step or not served:
        raise ValueError("draw_scoreboard: nothing to draw")
    batches = list(next(iter(step.values())))
    fig = Figure(figsize=(10, 3.6), layout="constrained")
    left, right = fig.subplots(1, 2, width_ratios=(3, 2))
    x, width = np.arange(len(batches)), 0.8 / len(step)
    for k, (name, ms) in enumerate(step.items()):
        left.bar(x - 0.4 + (k + 0.5) * width, [ms[b] for b in batches], width,
                 color=PALETTE[k % len(PALETTE)], label=name)
    left.set_yscale("log")
    top = max(max(ms.values()) for ms in step.values())
    left.set_ylim(top=top * 30)                        # room for the legend above the bars
    left.set_xticks(x, batches)
    left.set_xlabel("sequences in the batch")
    left.set_ylabel("decode step (ms, log scale)")
    left.legend(fontsize=8, ncol=2, loc="upper left")
    names = list(served)                               # pagedkv's bars in its colour
    right.barh(np.arange(len(names)), list(served.values()),
               color=[PALETTE[0] if n.startswith("pagedkv") else PALETTE[1] for n in names])
    right.xaxis.set_major_formatter("{x:,.0f}")
    right.set_yticks(np.arange(len(names)), names, fontsize=9)
    right.invert_yaxis()
    right.set_xlabel("output tokens a second")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig
