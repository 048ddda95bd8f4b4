"""A roofline: what a kernel can reach. Its FLOPs a second against its arithmetic intensity
(FLOPs per byte it moves), on log scales, under two roofs: the memory's bandwidth (a
slope: intensity times bytes a second) and the matrix units' peak (flat). Left of where
they meet (the ridge) a kernel is bound by its bytes; right of it, by its arithmetic.
Same conventions as :mod:`pagedkv.plots.memory` (no pyplot, the Okabe-Ito palette, labels
of at least 9 pt)."""
from __future__ import annotations

import math

from matplotlib.figure import Figure

from ..errors import ConfigError
from .memory import PALETTE

__all__ = ["RATED", "attainable", "ridge", "of_roof", "draw_roofline"]

#: Rated peaks from NVIDIA's datasheets (SXM cards): HBM bandwidth in bytes a second, and
#: dense float16/bfloat16 tensor-core FLOPs a second (the sheets' larger numbers assume
#: 2:4 sparsity, which a decode step does not have).
RATED = {"H200": dict(bandwidth=4.8e12, matrix=989e12),
         "H100": dict(bandwidth=3.35e12, matrix=989e12)}
MARKERS = "osD^v<>"


def attainable(intensity: float, bandwidth: float, peak: float) -> float:
    """The most FLOPs a second a kernel of ``intensity`` FLOPs per byte can reach: the lower
    roof, ``min(intensity * bandwidth, peak)``."""
    return min(intensity * bandwidth, peak)


def ridge(bandwidth: float, peak: float) -> float:
    """The intensity where the roofs meet: below it the bytes bound a kernel."""
    return peak / bandwidth


def of_roof(intensity: float, flops: float, bandwidth: float, peak: float) -> float:
    """How much of the roof above it a point reaches (1.0: on the roof)."""
    return flops / attainable(intensity, bandwidth, peak)


def draw_roofline(groups: dict, *, bandwidth: float, peak: float, title=None,
                  roof_names=("memory", "matrix units")) -> Figure:
    """``groups[name]`` is a list of points ``(intensity, flops)`` or ``(intensity, flops,
    label)``, drawn in one colour and marker each, under the two roofs (log-log)."""
    points = [p for ps in groups.values() for p in ps]
    if bandwidth <= 0 or peak <= 0 or any(p[0] <= 0 or p[1] <= 0 for p in points):
        raise ConfigError("a roofline needs positive roofs, intensities and FLOPs a second")
    knee = ridge(bandwidth, peak)
    xs = [p[0] for p in points] or [1.0]
    lo, hi = min(min(xs) / 2, 0.5), max(max(xs) * 2, knee * 4)
    fig = Figure(figsize=(9, 4.6), layout="constrained")
    ax = fig.add_subplot()
    ax.plot([lo, knee, hi], [lo * bandwidth, peak, peak], color="#333333", lw=1.6)
    ax.text(knee * 1.15, peak * 1.12, f"{roof_names[1]}: {peak / 1e12:,.0f} TFLOP/s",
            fontsize=9, color="#333333")
    ax.axvline(knee, color="#999999", lw=0.8, ls=":")
    ax.text(knee, lo * bandwidth, f" ridge {knee:,.0f} FLOP/B", fontsize=9, color="#555555",
            va="bottom")
    for k, (name, ps) in enumerate(groups.items()):
        colour, marker = PALETTE[k % len(PALETTE)], MARKERS[k % len(MARKERS)]
        ax.scatter([p[0] for p in ps], [p[1] for p in ps], color=colour, marker=marker,
                   s=36, label=name, zorder=3, edgecolor="white", lw=0.5)
        for p in ps:
            if len(p) > 2 and p[2]:
                ax.annotate(p[2], (p[0], p[1]), textcoords="offset points", xytext=(5, -11),
                            fontsize=9, color=colour)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min([lo * bandwidth] + [p[1] / 3 for p in points]), peak * 3)
    # the memory roof's name along it, turned to its slope as drawn
    x0 = lo * 1.4
    (px, py), (qx, qy) = ax.transData.transform([(x0, x0 * bandwidth),
                                                 (x0 * 10, x0 * 10 * bandwidth)])
    ax.text(x0, x0 * bandwidth * 1.6, f"{roof_names[0]}: {bandwidth / 1e12:.2f} TB/s",
            rotation=math.degrees(math.atan2(qy - py, qx - px)), rotation_mode="anchor",
            fontsize=9, color="#333333")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte moved, log scale)", fontsize=9)
    ax.set_ylabel("FLOPs a second (log scale)", fontsize=9)
    ax.grid(which="major", lw=0.3, alpha=0.5)
    ax.legend(fontsize=9, frameon=False, loc="lower right")
    if title:
        ax.set_title(title, fontsize=10)
    return fig
