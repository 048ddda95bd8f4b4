"""Pictures of the HTTP server (chapter 15): where a request goes on its way to the engine
and back, and the block maps a streamed answer carries.

Both return a :class:`matplotlib.figure.Figure` built without ``pyplot``.
"""
from __future__ import annotations

from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Patch

from .memory import FREE_COLOR, PALETTE

__all__ = ["draw_server", "draw_pool_maps", "POOL_STATES"]

#: The characters of a pool map (:func:`pagedkv.serve.pool.pool_map`) seen from one
#: request, their names and colours.
POOL_STATES = {".": ("free", FREE_COLOR), "c": ("cached, idle", "#9CCC65"),
               "m": ("this request's", PALETTE[0]), "s": ("shared with another", PALETTE[3]),
               "o": ("other requests'", PALETTE[1])}

# (x, y, width, label) of each box, in axes units; the engine's side is on the right
_BOXES = {
    "client": (0.00, 0.62, 0.13, "clients\n(openai, curl,\nthe chat page)"),
    "door": (0.19, 0.62, 0.16, "event loop:\nlimits, handlers\n(uvicorn)"),
    "parse": (0.19, 0.12, 0.16, "worker thread:\nJSON, checks,\ntokenizer"),
    "texts": (0.42, 0.12, 0.15, "Texts:\ntoken ids → text,\nstop strings"),
    "core": (0.72, 0.37, 0.16, "EngineCore:\nsubmit, cancel,\nstep"),
    "engine": (0.72, 0.85, 0.16, "Engine\n(scheduler, runner,\npaged K/V)"),
}
_ARROWS = [  # (from (x, y), to (x, y), label, label at (x, y), alignment)
    ((0.13, 0.79), (0.19, 0.79), "POST", (0.16, 0.81), "center"),
    ((0.19, 0.69), (0.13, 0.69), "chunks", (0.16, 0.655), "center"),
    ((0.24, 0.62), (0.24, 0.36), "body", (0.235, 0.48), "right"),
    ((0.30, 0.36), (0.30, 0.62), "checked,\ntokenized", (0.305, 0.47), "left"),
    ((0.35, 0.80), (0.72, 0.55), "submit, cancel", (0.55, 0.71), "center"),
    ((0.80, 0.61), (0.80, 0.85), "step()", (0.81, 0.72), "left"),
    ((0.72, 0.42), (0.57, 0.28), "new token ids,\nevery step", (0.65, 0.24), "center"),
    ((0.45, 0.36), (0.34, 0.62), "events: one\nwake-up a step", (0.42, 0.49), "left"),
]


def draw_server(*, process: bool = True) -> Figure:
    """Boxes and arrows: a request from the client through the event loop (and a worker
    thread that parses it) to the engine's core, and its tokens back as text. The dashed
    line is where the engine's own process begins (``process``: commands and token ids
    cross it through a pipe) or its thread (commands through a queue)."""
    fig = Figure(figsize=(8.5, 3.6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xlim(-0.01, 0.9)
    ax.set_ylim(0, 1.1)
    ax.axis("off")
    for name, (x, y, w, label) in _BOXES.items():
        h = 0.24
        engine_side = name in ("core", "engine")
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.01",
                                    facecolor=PALETTE[4] if engine_side else "#F4F4F4",
                                    edgecolor="#555555", lw=0.8))
        ax.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=8)
    for start, end, label, (x, y), align in _ARROWS:
        ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=10,
                                     lw=0.8, color="#333333"))
        ax.text(x, y, label, fontsize=7, color="#333333", ha=align, va="center")
    where = "the engine's process (a pipe between)" if process else \
        "a thread of the server's process"
    ax.axvline(0.66, color=PALETTE[5], ls="--", lw=1.2)
    ax.text(0.67, 0.02, where, fontsize=8, color=PALETTE[5])
    ax.text(0.65, 0.02, "the server's process", fontsize=8, color=PALETTE[5], ha="right")
    return fig


def draw_pool_maps(maps, *, title: str | None = None) -> Figure:
    """One row a pool map (oldest at the top), one cell a block, coloured by
    :data:`POOL_STATES`, with a legend."""
    states = list(POOL_STATES)
    bad = {ch for m in maps for ch in m} - set(states)
    if not maps or bad:
        raise ValueError("draw_pool_maps: nothing to draw" if not maps else
                         f"draw_pool_maps: unknown characters {sorted(bad)}")
    grid = [[states.index(ch) for ch in m] for m in maps]
    fig = Figure(figsize=(8.5, 2.8), layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(grid, cmap=ListedColormap([POOL_STATES[s][1] for s in states]), vmin=0,
              vmax=len(states) - 1, aspect="auto", interpolation="nearest")
    ax.set_xlabel("block")
    ax.set_ylabel("pool map sent")
    ax.set_title(title or "the pool as one streamed answer saw it", fontsize=10)
    ax.legend(handles=[Patch(facecolor=c, edgecolor="#999999", label=n)
                       for n, c in POOL_STATES.values()], loc="upper left",
              bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig
