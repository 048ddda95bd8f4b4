"""Contiguous allocation, the way before paging: each request gets one unbroken range of slots.

:class:`FirstFit` hands out ranges of a memory of ``size`` slots from the first free hole long
enough, and merges a range that comes back with the free holes beside it. Chapter 1 draws what it
does to memory; the simulation (:mod:`pagedkv.sim.policies`) serves whole workloads with it.

State: the free holes, sorted by start, as two lists ``starts`` and ``lengths``. Invariants: holes
do not overlap or touch (touching holes are merged), and ``free_total`` is the sum of their
lengths.
"""
from __future__ import annotations

import bisect

from .checks import count, positive_int
from .errors import DoubleFree, InvalidBlock

__all__ = ["FirstFit"]


class FirstFit:
    """Ranges of a memory of ``size`` slots, placed first fit."""

    def __init__(self, size: int):
        self.size = positive_int(size, "size")
        self.starts, self.lengths = [0], [self.size]   # the free holes, in address order
        self.free_total = self.size

    def alloc(self, n: int):
        """The start of ``n`` contiguous slots taken from the first hole that holds them, or
        ``None`` when no hole is that long (even if the holes add up to more)."""
        n = positive_int(n, "n")
        for i, length in enumerate(self.lengths):
            if length >= n:
                start = self.starts[i]
                if length == n:                          # the hole is used up
                    del self.starts[i], self.lengths[i]
                else:                                    # the hole shrinks from the left
                    self.starts[i] += n
                    self.lengths[i] -= n
                self.free_total -= n
                return start
        return None

    def free(self, start: int, n: int) -> None:
        """Give back the ``n`` slots from ``start``, merging them with neighbouring holes."""
        start, n = count(start, "start"), positive_int(n, "n")
        if start + n > self.size:
            raise InvalidBlock(f"range [{start}, {start + n}) ends past the memory's "
                               f"{self.size} slots")
        i = bisect.bisect(self.starts, start)           # the holes before i start at or before
        if (i and self.starts[i - 1] + self.lengths[i - 1] > start) or \
                (i < len(self.starts) and start + n > self.starts[i]):
            raise DoubleFree(f"range [{start}, {start + n}) overlaps a free hole")
        self.free_total += n
        if i < len(self.starts) and start + n == self.starts[i]:       # merge with the next
            n += self.lengths[i]
            del self.starts[i], self.lengths[i]
        if i and self.starts[i - 1] + self.lengths[i - 1] == start:    # ... and the previous
            self.lengths[i - 1] += n
        else:
            self.starts.insert(i, start)
            self.lengths.insert(i, n)

    def holes(self) -> list[tuple[int, int]]:
        """The free holes ``(start, length)``, in address order."""
        return list(zip(self.starts, self.lengths))

    def largest(self) -> int:
        """The longest free hole: the largest request that can be placed now."""
        return max(self.lengths, default=0)

    def __repr__(self) -> str:
        return f"FirstFit({self.size} slots, {self.free_total} free in {len(self.starts)} holes)"
