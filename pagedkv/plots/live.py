"""Live figures: the pictures a reader of the rendered book can play with in the browser.

Each function returns a :class:`LiveFigure`, whose HTML is a ``<div class="pkv-live">``
naming the figure and holding its data as JSON. In the built book the scripts of
``_static/`` (``pagedkv-live-core.js``, the teaching core's rules ported to JavaScript, and
the figures of ``pagedkv-live.js`` and ``pagedkv-live-traces.js``) turn it into the figure;
anywhere else (JupyterLab, a terminal) it shows its text, which says what the figure is.
What the figure needs that only Python draws (NumPy's random lengths, a workload, the
survivors of a beam search) is computed here, by the package's own functions, and shipped
with it; the rules that act on it run in the page. ``tests/test_live_figures.py`` drives
every figure in Chromium and compares what it shows with what the package gives.
"""
from __future__ import annotations

import html
import json

import numpy as np

from .. import sim
from ..checks import positive_int

__all__ = ["LiveFigure", "fragmentation", "allocator", "page_table", "manager", "fill_pool",
           "admission", "simulation", "beam", "prefix_cache", "beam_schedules"]


class LiveFigure:
    """A figure for the page: ``kind`` names its builder in the scripts, ``params`` its
    data (JSON), ``text`` what it is (shown where no script runs)."""

    def __init__(self, kind: str, text: str, **params):
        self.kind, self.text, self.params = kind, text, params

    def _repr_html_(self) -> str:
        data = html.escape(json.dumps(self.params, separators=(",", ":")), quote=True)
        return (f'<div class="pkv-live" data-figure="{self.kind}" data-params="{data}">'
                f'<p class="pkv-fallback">{html.escape(self.text)}</p></div>')

    def __repr__(self) -> str:
        return self.text


def _say(what: str) -> str:
    return (f"A live figure: {what} It runs in the rendered book's page, in the browser; "
            "in JupyterLab the cells around it do the same with the kernel.")


def fragmentation(capacity: int, max_len: int, finished, *, seeds=range(41), seed: int = 11,
                  block_size: int = 4) -> LiveFigure:
    """Chapter 1's three strategies over ``capacity`` slots, for the request lengths each
    seed draws as the chapter does (six requests of 3 to ``max_len`` tokens, then a
    seventh), requests ``finished`` ending before the seventh comes."""
    lengths = {}
    for s in seeds:
        rng = np.random.default_rng(s)
        lens = rng.integers(3, max_len + 1, size=6).tolist()
        lengths[str(s)] = lens + [int(rng.integers(3, max_len + 1))]
    return LiveFigure("fragmentation", _say(
        f"the {capacity} slots under the three strategies, for other random lengths (the "
        "seed), other block sizes, and one event at a time."),
        capacity=capacity, max_len=max_len, finished=[int(i) for i in finished],
        lengths=lengths, seed=seed, block_size=block_size)


def allocator(blocks: int = 16) -> LiveFigure:
    """Chapter 3's allocator over a pool of ``blocks`` blocks."""
    return LiveFigure("allocator", _say(
        f"a pool of {blocks} blocks to allocate, free and share, with its free stack, its "
        "reference counts and the package's errors."), blocks=positive_int(blocks, "blocks"))


def page_table(blocks: int, block_size: int, others_allocate: int, others_free) -> LiveFigure:
    """Chapter 4's two page tables over a pool where someone else first took
    ``others_allocate`` blocks and gave back ``others_free``."""
    return LiveFigure("page_table", _say(
        "two page tables growing token by token over a scattered pool, with arrows from "
        "each logical block to its physical block."),
        blocks=blocks, block_size=block_size, others_allocate=others_allocate,
        others_free=[int(b) for b in others_free])


def manager(blocks: int, block_size: int, *, fork: bool = False, script=None) -> LiveFigure:
    """Chapter 5's manager (with ``fork``, chapter 7's copy-on-write too). ``script`` is a
    list of operations, ``[op, seq, n]`` or ``["fork", parent, child]``, that a button
    replays one at a time."""
    what = ("a manager whose sequences fork and copy on write" if fork else
            "a manager's sequences added, grown, stepped and freed")
    return LiveFigure("manager", _say(f"{what}, over a pool of {blocks} blocks of "
                                      f"{block_size} tokens."),
                      blocks=blocks, block_size=block_size, fork=bool(fork),
                      script=list(script) if script else None)


def fill_pool(pool_slots: int, *, max_sequences: int = 12, seed: int = 0, sequences: int = 6,
              block_size: int = 4) -> LiveFigure:
    """Chapter 5's pool of ``pool_slots`` token slots filled with the chapter's random
    sequences (1 to 16 tokens, drawn with ``seed``) at each block size."""
    lengths = {str(k): np.random.default_rng(seed).integers(1, 17, size=k).tolist()
               for k in range(1, max_sequences + 1)}
    return LiveFigure("fill_pool", _say(
        f"the pool of {pool_slots} slots at another block size or number of sequences."),
        pool_slots=pool_slots, lengths=lengths, sequences=sequences, block_size=block_size)


def _requests(workload) -> list:
    return [[r.rid, r.arrival, r.prompt, r.output] for r in workload.requests]


def admission(workload, pool_bytes: int, block_size: int, max_seqs: int, *,
              watermark: float = 0.01) -> LiveFigure:
    """Chapter 6's admission rule replayed step by step on ``workload``."""
    return LiveFigure("admission", _say(
        f"the {len(workload.requests)} requests served step by step, each decision of the "
        "admission rule written out."),
        requests=_requests(workload), pool_bytes=pool_bytes, block_size=block_size,
        max_seqs=max_seqs, watermark=watermark)


def simulation(*, preset: str = "chat", n: int = 150, seed: int = 0, rate: float = 1.0,
               pool_mib: int = 4, block_size: int = 16, concurrency: int = 32,
               max_concurrency: int = 128, watermark: float = 0.01) -> LiveFigure:
    """Chapter 6's run of ``n`` requests of ``preset`` through a ``pool_mib`` MiB pool, at
    any block size and concurrency (what :func:`pagedkv.plots.sim.simulation_figure`
    draws)."""
    wl = sim.make_workload(preset, n=n, seed=seed, rate=rate)
    return LiveFigure("simulation", _say(
        f"the run of {n} {preset} requests through a {pool_mib} MiB pool at another block "
        "size or concurrency."),
        requests=_requests(wl), preset=preset, pool_mib=pool_mib,
        pool_bytes=pool_mib * sim.MiB, max_len=wl.max_len,
        block_sizes=[1, 2, 4, 8, 16, 32, 64, 128, 256], block_size=block_size,
        concurrency=concurrency, max_concurrency=max_concurrency, watermark=watermark)


def beam_schedules(widths, steps: int, *, seed: int = 0, alpha: float = 0.3,
                   vocab: int = 64) -> dict:
    """For each beam width, the parent of every surviving beam at each of ``steps``
    steps, drawn as :func:`pagedkv.sim.beam_search` draws them with
    ``numpy.random.default_rng(seed)``."""
    out = {}
    for w in widths:
        rng, scores, rows = np.random.default_rng(seed), np.zeros(1), []
        for _ in range(steps):
            parents, scores = sim.beam_children(rng, scores, w, alpha, vocab)
            rows.append([int(i) for i in parents])
        out[str(w)] = rows
    return out


def beam(*, widths=range(1, 9), output: int = 30, block_size: int = 4,
         pool_blocks: int = 128, width: int = 6, prompt: int = 10,
         max_prompt: int = 40) -> LiveFigure:
    """Chapter 7's beam search over the pool, at any width and prompt length (what
    :func:`pagedkv.plots.sim.beam_pool_figure` draws)."""
    return LiveFigure("beam", _say(
        "the beam search over the pool at another width or prompt length."),
        schedules=beam_schedules(widths, output), output=output, block_size=block_size,
        pool_blocks=pool_blocks, width=width, prompt=prompt, max_prompt=max_prompt)


def prefix_cache(blocks: int, block_size: int, *, script=None, words: str = "") -> LiveFigure:
    """Chapter 11's prefix cache over ``blocks`` blocks, words for tokens, with the
    diagram of a block's life. ``script``: ``[op, seq, words]`` operations that a button
    replays one at a time."""
    return LiveFigure("prefix_cache", _say(
        f"a prefix cache over {blocks} blocks of {block_size} tokens: requests added, grown "
        "and freed, their full blocks kept, found again and evicted."),
        blocks=blocks, block_size=block_size, script=list(script) if script else None,
        words=words)
