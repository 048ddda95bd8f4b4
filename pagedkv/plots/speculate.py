"""Speculative decoding's pictures: a sequence's slots through a guess and its rollback."""
from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from ..checks import positive_int

__all__ = ["KINDS", "draw_rewind", "draw_speedups"]

#: What a slot holds, and its colour (Okabe-Ito, as the other pictures).
KINDS = {
    "verified": ("#0072B2", "K/V of a verified token"),
    "guess": ("#E69F00", "K/V of a guess, not yet verified (slot reserved)"),
    "kept": ("#009E73", "a guess the model agreed with: verified now"),
    "rejected": ("#D55E00", "a rejected guess: its slot given back"),
    "empty": ("#FFFFFF", "an empty slot"),
}


def draw_rewind(panels, block_size: int, *, title=None) -> Figure:
    """One row per panel: a sequence's slots, block by block, coloured by what they hold
    (:data:`KINDS`), each block with its physical id under it (and ``named`` if the prefix
    cache names it); the blocks the step gave back drawn after the table, crossed out.

    ``panels``: a list of dicts with ``title``, ``cells`` (one ``(text, kind)`` per slot, in
    order), ``table`` (the page table: a physical block id per logical block),
    ``named`` (the logical blocks the prefix cache names) and ``freed`` (physical ids given
    back). Patches: one per slot drawn, the freed blocks' slots included."""
    block_size = positive_int(block_size, "block_size")
    if not panels:
        raise ValueError("there is nothing to draw: no panels")
    for p in panels:
        if len(p["cells"]) > len(p["table"]) * block_size:
            raise ValueError(f"panel {p['title']!r}: {len(p['cells'])} slots do not fit "
                             f"{len(p['table'])} blocks of {block_size}")
        bad = {kind for _, kind in p["cells"]} - set(KINDS)
        if bad:
            raise ValueError(f"unknown slot kinds {sorted(bad)}; they are {list(KINDS)}")
    width = max((len(p["table"]) + len(p.get("freed", ()))) * (block_size + 1)
                for p in panels)
    step = 2.8                                   # a panel's height, in slots
    fig = Figure(figsize=(0.4 * width + 0.4, 0.4 * step * len(panels) + 0.9),
                 layout="constrained")
    ax = fig.add_subplot()
    for row, p in enumerate(panels):
        y = step * (len(panels) - 1 - row)
        cells = list(p["cells"]) + [("", "empty")] * (len(p["table"]) * block_size
                                                      - len(p["cells"]))
        for j, block in enumerate(p["table"]):
            x0 = j * (block_size + 1)
            for i in range(block_size):
                text, kind = cells[j * block_size + i]
                _slot(ax, x0 + i, y, text, kind)
            label = f"block {block}" + (", named" if j in p.get("named", ()) else "")
            ax.text(x0 + block_size / 2, y - 0.4, label, ha="center", va="center",
                    fontsize=8.5)
        for j, block in enumerate(p.get("freed", ())):
            x0 = (len(p["table"]) + j) * (block_size + 1)
            for i in range(block_size):
                _slot(ax, x0 + i, y, "", "empty", faded=True)
            ax.plot([x0, x0 + block_size], [y, y + 1], color="#999999", lw=1)
            ax.text(x0 + block_size / 2, y - 0.4, f"block {block}: freed", ha="center",
                    va="center", fontsize=8.5, color="#666666")
        ax.text(0, y + 1.25, p["title"], ha="left", va="bottom", fontsize=9.5)
    ax.set_xlim(-0.2, width)
    ax.set_ylim(-0.8, step * len(panels) - 0.9)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    used = {kind for p in panels for _, kind in p["cells"]} - {"empty"}
    handles = [Patch(facecolor=KINDS[k][0], edgecolor="#444444", label=KINDS[k][1])
               for k in KINDS if k in used]
    fig.legend(handles=handles, loc="outside lower center", ncol=2, frameon=False,
               fontsize=8.5)
    return fig


def draw_speedups(runs: dict, *, mode: str = "default", title=None) -> Figure:
    """Output tokens/s with speculation over without, one panel per run (``runs``: a label
    -> the ``results`` of a ``python -m pagedkv.bench.speculate`` JSON: workload -> batch
    -> mode -> numbers), a group of bars per workload, a bar per batch; ``mode``: "on" or
    "default". A dashed line at 1: above it, guessing paid. Patches: one per bar."""
    if not runs:
        raise ValueError("there is nothing to draw: no runs")
    fig = Figure(figsize=(5.2 * len(runs) + 0.6, 3.4))
    axes = fig.subplots(1, len(runs), squeeze=False)[0]
    for ax, (label, results) in zip(axes, runs.items()):
        loads = list(results)
        batches = sorted({int(b) for r in results.values() for b in r})
        width = 0.8 / len(batches)
        for j, b in enumerate(batches):
            heights = [results[w].get(str(b), results[w].get(b, {})).get(mode, {})
                       .get("speedup", 0) for w in loads]
            xs = [i - 0.4 + (j + 0.5) * width for i in range(len(loads))]
            ax.bar(xs, heights, width * 0.92, label=f"batch {b}",
                   color=_BATCH_COLORS[j % len(_BATCH_COLORS)])
        ax.axhline(1.0, color="#444444", lw=1, ls="--")
        ax.set_xticks(range(len(loads)), loads, fontsize=9)
        ax.set_ylabel(f"tokens/s, {mode} / off", fontsize=9)
        ax.set_title(label, fontsize=10)
        ax.legend(fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig


_BATCH_COLORS = ("#56B4E9", "#0072B2", "#E69F00", "#D55E00")


def _slot(ax, x, y, text, kind, faded=False) -> None:
    color = KINDS[kind][0]
    ax.add_patch(Rectangle((x + 0.04, y), 0.92, 1, facecolor=color, edgecolor="#444444",
                           lw=0.7, alpha=0.35 if faded else 1.0))
    if text:
        dark = kind in ("verified", "kept", "rejected")
        ax.text(x + 0.5, y + 0.5, text, ha="center", va="center", fontsize=7,
                color="white" if dark else "black", rotation=90 if len(text) > 4 else 0)
