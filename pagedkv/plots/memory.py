"""Pictures of memory: the pool as a grid of blocks, page tables as arrows, reservation strips.

Every function returns a :class:`matplotlib.figure.Figure` built without ``pyplot``, so nothing is
left open behind the caller's back and a notebook shows the figure exactly once (as the cell's
value, or with ``display``). Drawing is deterministic: the same input gives the same picture.

Colours come from the Okabe-Ito palette, which stays distinguishable with the common forms of
colour blindness; free memory is pale grey, and memory held but holding nothing is hatched. Text
is at least 9 pt. The simulation's plots (:mod:`pagedkv.plots.sim`) use the same palette.

Block ownership has one encoding across the package: a block's owner is :data:`FREE` (``None``)
when no sequence maps it, the sequence's id when one sequence maps it, and :data:`SHARED` when
several do (:func:`manager_owners` reads it from a live manager).

Three kinds of picture:

* :func:`draw_pool` — the pool's blocks in a grid, coloured by owner (:func:`draw_allocator` and
  :func:`draw_manager` read the owners from a live allocator or manager);
* :func:`draw_page_tables` — each sequence's logical blocks above the pool, an arrow from each
  logical block to the physical block it maps to;
* :func:`draw_layouts` — memory as a strip of token slots, one strip per allocation strategy, from
  the :class:`Region` lists built by :func:`contiguous_layout`, :func:`exact_layout` and
  :func:`paged_layout`, with :func:`layout_summary` counting what each strategy wastes.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from ..checks import cdiv, is_int, positive_int

__all__ = ["PALETTE", "FREE_COLOR", "FREE", "SHARED", "owner_colors", "draw_pool", "draw_allocator",
           "manager_owners", "draw_manager", "draw_page_tables", "Region", "contiguous_layout",
           "exact_layout", "paged_layout", "layout_summary", "draw_layouts"]

#: Okabe-Ito colours (without black), for owners in order of first appearance.
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442")
FREE_COLOR = "#EEEEEE"
EDGE_COLOR = "#555555"
#: The owner of a block that no sequence maps.
FREE = None
#: The owner of a block that several sequences map.
SHARED = "shared"
SHARED_COLOR = "#777777"
#: How a partly filled block is drawn: a pale square, and a solid bar as high as its tokens.
PALE = 0.35


def _is_free(owner) -> bool:
    return owner is FREE


def owner_colors(owners) -> dict:
    """A colour for each distinct owner (``None`` is free).

    An integer owner ``i`` always gets ``PALETTE[i % len(PALETTE)]``, so request 3 has the same
    colour in every picture; :data:`SHARED` is grey; any other owner takes the palette in order of
    first appearance.
    """
    colors, k = {}, 0
    for o in owners:
        if _is_free(o) or o in colors:
            continue
        if o == SHARED:
            colors[o] = SHARED_COLOR
        elif is_int(o):
            colors[o] = PALETTE[int(o) % len(PALETTE)]
        else:
            colors[o] = PALETTE[k % len(PALETTE)]
            k += 1
    ints = sorted(o for o in colors if is_int(o))          # legend order: 0, 1, 2, ..., others
    return {o: colors[o] for o in ints + [o for o in colors if not is_int(o)]}


def _new_axes(ax, size):
    if ax is None:
        fig = Figure(figsize=size, layout="constrained")
        return fig, fig.add_subplot()
    return ax.figure, ax


def _owner_label(o) -> str:
    return o if o in (SHARED, "used") else f"seq {o}"


def _legend(ax, colors, free=True, loc="upper left", extra=()):
    handles = [Patch(facecolor=c, edgecolor=EDGE_COLOR, label=_owner_label(o))
               for o, c in colors.items()]
    if free:
        handles.append(Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free"))
    handles += list(extra)
    if handles:
        ax.legend(handles=handles, loc=loc, bbox_to_anchor=(1.01, 1.0), frameon=False,
                  fontsize=9)


def _check_owners(owners) -> list:
    owners = list(owners)
    if not owners:
        raise ValueError("there are no blocks to draw")
    return owners


# ---------------------------------------------------------------------------------- the pool
def draw_pool(owners, *, fills=None, block_size=None, notes=None, ncols=16, title=None,
              ax=None) -> Figure:
    """The pool as a grid of blocks, block 0 at the top left, coloured by owner.

    ``owners[b]`` is block ``b``'s owner (any hashable; ``None`` means free). With ``fills`` (tokens
    held by each block) and ``block_size``, a used block is pale with a solid bar whose height is
    the filled fraction, so a partly filled block shows its unused slots. ``notes`` maps a block
    id to a short text drawn under its id.

    Patches: one square per block, plus one bar per used block when ``fills`` is given.
    """
    owners = _check_owners(owners)
    n = len(owners)
    ncols = positive_int(ncols, "ncols")
    if fills is not None:
        fills = [int(f) for f in fills]
        if len(fills) != n:
            raise ValueError(f"fills has {len(fills)} entries for {n} blocks")
        if block_size is None or block_size < 1:
            raise ValueError("fills needs a positive block_size")
        if any(f < 0 or f > block_size for f in fills):
            raise ValueError(f"every fill must lie in [0, {block_size}]")
    notes = dict(notes or {})
    ncols = min(ncols, n)
    nrows = cdiv(n, ncols)
    colors = owner_colors(owners)
    partly = fills is not None and any(not _is_free(o) for o in owners)
    legend_rows = len(colors) + 1 + 2 * partly
    fig, ax = _new_axes(ax, (min(0.62 * ncols, 11) + 1.6,
                             max(0.62 * nrows + 0.7, 0.22 * legend_rows + 0.6)))
    for b, o in enumerate(owners):
        r, c = divmod(b, ncols)
        x, y = c, nrows - 1 - r
        free = _is_free(o)
        color = FREE_COLOR if free else colors[o]
        partial = fills is not None and not free
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9, facecolor=color,
                               alpha=PALE if partial else 1.0, edgecolor=EDGE_COLOR, lw=0.8))
        if partial:
            h = 0.9 * fills[b] / block_size
            ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, h, facecolor=color,
                                   edgecolor="none"))
        text_color = "black" if free or color in ("#F0E442", "#E69F00", "#56B4E9") else "white"
        if partial and fills[b] <= block_size / 2:
            text_color = "black"
        ax.text(x + 0.5, y + (0.62 if b in notes else 0.5), str(b), ha="center",
                va="center", fontsize=9, color=text_color)
        if b in notes:
            ax.text(x + 0.5, y + 0.28, str(notes[b]), ha="center", va="center", fontsize=8,
                    color=text_color)
    ax.set_xlim(0, ncols)
    ax.set_ylim(0, nrows)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    fill_keys = [Patch(facecolor=SHARED_COLOR, edgecolor=EDGE_COLOR,
                       label="solid: slots holding tokens"),
                 Patch(facecolor=SHARED_COLOR, alpha=PALE, edgecolor=EDGE_COLOR,
                       label="pale: empty slots of a used block")] if partly else []
    _legend(ax, colors, free=any(_is_free(o) for o in owners), extra=fill_keys)
    return fig


def draw_allocator(allocator, *, ncols=16, title=None, ax=None) -> Figure:
    """A :class:`~pagedkv.allocator.BlockAllocator`'s pool: used blocks against free ones.

    Each free block is marked with its place in the free stack: ``#1`` is the block the next
    ``allocate()`` returns.
    """
    ref = allocator.refcounts()
    owners = ["used" if r else None for r in ref.tolist()]
    stack = allocator.free_blocks()
    notes = {b: f"#{i + 1}" for i, b in enumerate(reversed(stack))}
    return draw_pool(owners, notes=notes, ncols=ncols, title=title, ax=ax)


def manager_owners(manager, num_blocks: int | None = None) -> tuple[list, list]:
    """(owner of each block, tokens each block holds) in a
    :class:`~pagedkv.manager.KVCacheManager`'s pool, or in its first ``num_blocks`` blocks.

    A block mapped by one sequence is owned by that sequence's id; one mapped by several is
    :data:`SHARED`; an unmapped block is :data:`FREE`.
    """
    n = manager.allocator.num_blocks if num_blocks is None else min(
        positive_int(num_blocks, "num_blocks"), manager.allocator.num_blocks)
    bs = manager.block_size
    owners: list = [FREE] * n
    fills = [0] * n
    for s in manager.seq_ids:
        length = manager.num_tokens(s)
        for j, b in enumerate(manager.block_table(s).tolist()):
            if b < n:
                owners[b] = s if owners[b] is FREE else SHARED
                fills[b] = min(bs, length - j * bs)
    return owners, fills


def draw_manager(manager, *, ncols=16, title=None, ax=None) -> Figure:
    """The manager's pool coloured by sequence, each used block's bar showing how full it is."""
    owners, fills = manager_owners(manager)
    return draw_pool(owners, fills=fills, block_size=manager.block_size, ncols=ncols,
                     title=title, ax=ax)


# ---------------------------------------------------------------------------- page tables
def draw_page_tables(tables, num_blocks: int, *, in_use=(), title=None, ax=None) -> Figure:
    """Logical blocks above, the physical pool below, an arrow for each mapping.

    ``tables`` is one page table (a list of physical block ids, logical order) or a dict from
    sequence id to such a list. Blocks listed in ``in_use`` that no table maps are drawn hatched,
    as memory held by someone else. Patches: one square per logical block, one per pool block, and
    one arrow per logical block.
    """
    if not isinstance(tables, dict):
        tables = {0: list(tables)}
    num_blocks = positive_int(num_blocks, "num_blocks")
    owners: list = [FREE] * num_blocks
    for s, blocks in tables.items():
        for b in blocks:
            b = int(b)
            if not 0 <= b < num_blocks:
                raise ValueError(f"sequence {s!r} maps block {b}, outside the pool "
                                 f"[0, {num_blocks})")
            owners[b] = s if owners[b] is FREE else SHARED
    elsewhere = set()
    for b in in_use:
        if not 0 <= int(b) < num_blocks:
            raise ValueError(f"in_use lists block {b}, outside the pool [0, {num_blocks})")
        if owners[int(b)] is FREE:
            elsewhere.add(int(b))
    colors = owner_colors(list(tables) + owners)
    width = max(int(num_blocks), max((len(t) for t in tables.values()), default=0))
    rows = len(tables)
    scale = min(0.55, 11 / (width + 1.6))          # inches per block
    fig, ax = _new_axes(ax, (scale * (width + 1.6) + 0.3, scale * (2.2 + 1.25 * rows) + 0.4))
    pool_y = 0.0
    for b, o in enumerate(owners):
        color = FREE_COLOR if o is FREE else colors[o]
        ax.add_patch(Rectangle((b + 0.05, pool_y), 0.9, 0.9, facecolor=color,
                               edgecolor=EDGE_COLOR, lw=0.8, hatch="///" if b in elsewhere
                               else None))
        ax.text(b + 0.5, pool_y + 0.45, str(b), ha="center", va="center", fontsize=9,
                color="black" if o is FREE or color in ("#F0E442", "#E69F00", "#56B4E9")
                else "white")
    ax.text(-0.2, pool_y + 0.45, "physical\nblocks", ha="right", va="center", fontsize=9)
    for k, (s, blocks) in enumerate(tables.items()):
        y = 2.0 + 1.25 * k
        color = colors.get(s, SHARED_COLOR)
        for j, b in enumerate(blocks):
            ax.add_patch(Rectangle((j + 0.05, y), 0.9, 0.9, facecolor="white", edgecolor=color,
                                   lw=2))
            ax.text(j + 0.5, y + 0.45, str(j), ha="center", va="center", fontsize=9)
            ax.add_patch(FancyArrowPatch((j + 0.5, y), (int(b) + 0.5, pool_y + 0.92),
                                         arrowstyle="-|>", mutation_scale=10, color=color,
                                         lw=1.2, shrinkA=0, shrinkB=0))
        label = "logical\nblocks" if len(tables) == 1 else f"seq {s}\nlogical"
        ax.text(-0.2, y + 0.45, label, ha="right", va="center", fontsize=9)
    ax.set_xlim(-1.6, width)
    ax.set_ylim(-0.2, 2.0 + 1.25 * rows)
    ax.set_aspect("equal")
    ax.axis("off")
    if title:
        ax.set_title(title, fontsize=11)
    handles = [Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free")]
    if elsewhere:
        handles.append(Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, hatch="///",
                             label="used elsewhere"))
    ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(1.0, 0.0), frameon=False,
              fontsize=9)
    return fig


# ------------------------------------------------------------------- reservation strategies
class Region(NamedTuple):
    """``size`` token slots from slot ``start``, held by ``owner``; the first ``used`` hold data."""
    start: int
    size: int
    owner: object
    used: int


def _lengths(lengths) -> list[int]:
    out = [int(x) for x in lengths]
    if any(x < 1 for x in out):
        raise ValueError("every request length must be a positive integer")
    return out


def contiguous_layout(lengths, max_len: int, capacity: int) -> list[Region]:
    """Each request reserves ``max_len`` slots back to back, in order, while they fit.

    Owners are the requests' indexes; a request that does not fit gets no region.
    """
    lengths = _lengths(lengths)
    if any(x > max_len for x in lengths):
        raise ValueError(f"a request is longer than max_len={max_len}")
    fit = min(len(lengths), capacity // max_len)
    return [Region(i * max_len, max_len, i, lengths[i]) for i in range(fit)]


def exact_layout(lengths, capacity: int) -> list[Region]:
    """Each request reserves exactly its length, back to back, in order, while they fit."""
    out, start = [], 0
    for i, n in enumerate(_lengths(lengths)):
        if start + n > capacity:
            break
        out.append(Region(start, n, i, n))
        start += n
    return out


def paged_layout(manager) -> list[Region]:
    """One region per mapped block of a :class:`~pagedkv.manager.KVCacheManager`, in slot units."""
    owners, fills = manager_owners(manager)
    bs = manager.block_size
    return [Region(b * bs, bs, o, f) for b, (o, f) in enumerate(zip(owners, fills))
            if o is not None]


def _check_regions(regions, capacity: int) -> list[Region]:
    regions = sorted((Region(*r) for r in regions), key=lambda r: r.start)
    end = 0
    for r in regions:
        if r.start < end or r.size < 1 or not 0 <= r.used <= r.size:
            raise ValueError(f"bad or overlapping region {r}")
        end = r.start + r.size
    if end > capacity:
        raise ValueError(f"a region ends at slot {end}, past the capacity {capacity}")
    return regions


def layout_summary(regions, capacity: int) -> dict:
    """Slots that hold data, slots reserved but empty, free slots, and the largest free hole."""
    regions = _check_regions(regions, capacity)
    ends = [0] + [r.start + r.size for r in regions]           # each hole runs from an end
    starts = [r.start for r in regions] + [capacity]           # to the next region's start
    stored = sum(r.used for r in regions)
    reserved = sum(r.size for r in regions)
    return {"stored": stored, "reserved_empty": reserved - stored, "free": capacity - reserved,
            "largest_hole": max(s - e for e, s in zip(ends, starts))}


def draw_layouts(rows, capacity: int, *, ax=None) -> Figure:
    """One horizontal strip of ``capacity`` token slots per ``(label, regions)`` in ``rows``.

    In a region, the slots holding data are solid in the owner's colour and the reserved but
    empty ones are hatched; free slots are pale grey; white lines separate regions (a paged
    layout has one region per block). Patches: one background strip per row, one solid bar
    per region, and one hatched bar per region with empty slots.
    """
    rows = list(rows)
    if not rows:
        raise ValueError("there are no layouts to draw")
    positive_int(capacity, "capacity")
    checked = [(label, _check_regions(regs, capacity)) for label, regs in rows]
    colors = owner_colors([r.owner for _, regs in checked for r in regs])
    fig, ax = _new_axes(ax, (11, 0.9 * len(rows) + 0.9))
    height = 0.6
    for k, (label, regs) in enumerate(checked):
        y = len(checked) - 1 - k
        ax.add_patch(Rectangle((0, y), capacity, height, facecolor=FREE_COLOR,
                               edgecolor=EDGE_COLOR, lw=0.8))
        for r in regs:
            color = colors[r.owner]
            ax.add_patch(Rectangle((r.start, y), r.used, height, facecolor=color,
                                   edgecolor="white", lw=1.5))
            if r.size > r.used:
                ax.add_patch(Rectangle((r.start + r.used, y), r.size - r.used, height,
                                       facecolor="white", edgecolor=color, hatch="////",
                                       lw=0.8))
        ax.text(-0.01 * capacity, y + height / 2, label, ha="right", va="center", fontsize=10)
    ax.set_xlim(0, capacity)
    ax.set_ylim(-0.5, len(checked))
    ax.set_yticks([])
    ax.set_xlabel("token slots in memory")
    for side in ("left", "right", "top"):
        ax.spines[side].set_visible(False)
    handles = [Patch(facecolor=c, edgecolor="white", label=f"request {o}" if isinstance(o, int)
                     else _owner_label(o)) for o, c in colors.items()]
    handles += [Patch(facecolor="white", edgecolor=EDGE_COLOR, hatch="////",
                      label="reserved, empty"),
                Patch(facecolor=FREE_COLOR, edgecolor=EDGE_COLOR, label="free")]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              fontsize=9)
    return fig


# ------------------------------------------------------------------------ a pool's words
def draw_words(words, verdicts, *, title=None, ax=None) -> Figure:
    """The first words of each block as a row of colours, with a verdict beside each row.

    ``words`` is a 2-D array (one row per block, NumPy), drawn by each word's top byte, so a
    hashed pattern looks like noise and two blocks holding the same bytes show the same row.
    ``verdicts[b]`` is the text written to the right of block ``b``'s row (e.g. "intact").
    """
    words = np.asarray(words)
    if words.ndim != 2 or not words.size:
        raise ValueError(f"words must be a non-empty 2-D array, got shape {words.shape}")
    verdicts = [str(v) for v in verdicts]
    if len(verdicts) != words.shape[0]:
        raise ValueError(f"{len(verdicts)} verdicts for {words.shape[0]} blocks")
    rows, cols = words.shape
    fig, ax = _new_axes(ax, (9, 0.32 * rows + 1.0))
    top = (words.astype(np.uint64) >> np.uint64(8 * words.dtype.itemsize - 8)).astype(float)
    ax.imshow(top, aspect="auto", cmap="viridis", interpolation="nearest",
              extent=(0, cols, rows, 0))
    ax.set_yticks(np.arange(rows) + 0.5, [f"block {b}" for b in range(rows)], fontsize=9)
    ax.set_xlabel(f"the first {cols} words of each block (colour: the word's top byte)")
    for b, text in enumerate(verdicts):
        ax.text(cols * 1.01, b + 0.5, text, va="center", ha="left", fontsize=9)
    ax.set_xlim(0, cols)
    ax.tick_params(axis="x", labelsize=9)
    for side in ("right", "top"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, fontsize=11)
    return fig
