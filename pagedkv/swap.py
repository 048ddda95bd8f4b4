"""Swapping: a preempted sequence's K/V parked in host memory, and brought back later.

When a step cannot get its blocks, the scheduler preempts a sequence. Recomputation
drops its K/V and computes them again when it returns; swapping copies its blocks to a
*host pool* first and copies them back when it returns, so nothing is computed twice, at
the price of two trips over the link between host and device (PCIe on most machines).

Three parts, kept apart as everywhere in pagedkv (the manager plans, kernels move
bytes):

* :class:`HostPool` is host memory cut into blocks of the device pool's size: the
  allocator of chapter 3 again, its pool in pinned (page-locked) memory on a GPU machine,
  so that the device can copy to and from it directly, and a NumPy array otherwise.
* :class:`Swapper` keeps the books: which host blocks hold each swapped-out sequence, and
  the (source, destination) block pairs that a swap needs. It moves no bytes.
* :func:`copy_to_host` and :func:`copy_to_device` move the bytes: all the pairs of a step
  in one batched copy per direction.

Invariants, checked by :meth:`Swapper.audit` (with the host allocator's own): a host
block's refcount equals the number of swapped-out sequences that map it; a swapped-out
sequence is not in the manager.

The swapper keeps blocks, not tokens: a sequence's tokens have one owner, its caller
(the engine's sequences), who gives back at swap-in what the manager's ``add`` takes (a
count for :class:`~pagedkv.manager.KVCacheManager`, the ids for a prefix-caching
manager). The swapper never asks which manager it holds: the blocks a prefix cache
found again are the tokens the plan of ``add`` has no slots for.
"""
from __future__ import annotations

from collections import Counter
from typing import NamedTuple

import numpy as np

from . import backend
from .allocator import BlockAllocator
from .checks import is_int, token_ids
from .errors import (AuditError, ConfigError, DuplicateSequence, OutOfBlocks,
                     PoolTooLarge, SequenceExists, UnknownSequence)
from .manager import copies_array

__all__ = ["HostPool", "Swapper", "copy_to_host", "copy_to_device"]


def _pinned_bytes(nbytes: int) -> np.ndarray:
    """``nbytes`` of page-locked host memory as a NumPy uint8 array (CuPy's pinned
    pool)."""
    import cupyx
    try:
        return cupyx.empty_pinned(nbytes, dtype=np.uint8)
    except Exception as exc:  # the CUDA runtime's out-of-memory error, or a MemoryError
        raise PoolTooLarge(f"cannot pin {nbytes:,} bytes of host memory for swapping: "
                           f"{type(exc).__name__}: {exc}") from None


class HostPool(BlockAllocator):
    """``num_blocks`` host blocks of ``block_bytes`` each, for swapped-out K/V. The
    bookkeeping is :class:`~pagedkv.allocator.BlockAllocator`'s; the memory is pinned
    when ``pinned`` (by default: when the backend is CuPy), so that device copies can
    reach it directly."""

    def __init__(self, num_blocks: int, block_bytes: int, *,
                 pinned: bool | None = None):
        super().__init__(num_blocks, block_bytes, xp=np)   # (NumPy's pages: untouched)
        self.pinned = backend.on_gpu if pinned is None else bool(pinned)
        if self.pinned:
            self.pool = _pinned_bytes(self.pool_bytes)


class Swapped(NamedTuple):
    host_blocks: list     # where each of its blocks waits, in page-table order
    num_tokens: int       # how many tokens' K/V they hold


def _length(contents) -> int:
    """How many tokens ``contents`` (a count, or token ids, checked) brings back."""
    return int(contents) if is_int(contents) else len(token_ids(contents))


class Swapper:
    """Swap sequences of ``manager`` out to ``host`` and back. Plans only: execute each
    returned array of pairs (with :func:`copy_to_host` / :func:`copy_to_device`) before
    the next forward pass writes K/V and before the next swap in the other direction,
    since the blocks a swap gives up are free from the moment it is planned."""

    def __init__(self, manager, host: HostPool):
        if host.block_bytes != manager.allocator.block_bytes:
            raise ConfigError(f"host blocks of {host.block_bytes} bytes cannot hold "
                              f"device blocks of {manager.allocator.block_bytes} bytes")
        self.manager, self.host = manager, host
        self.swapped: dict = {}        # sequence id -> Swapped
        self.blocks_out = self.blocks_in = 0

    def _ids(self, seq_ids) -> list:
        ids = list(seq_ids)
        if len(set(ids)) != len(ids):
            raise DuplicateSequence(f"a sequence appears more than once in {ids!r}")
        return ids

    def swap_out(self, seq_ids) -> np.ndarray:
        """Park the sequences on the host; they leave the manager. A block several of
        them share is copied once (and shared again on the host). Returns (device block,
        host block) pairs. All or nothing: :class:`OutOfBlocks` if the host pool is too
        small."""
        ids = self._ids(seq_ids)
        tables = [self.manager.block_table(s).tolist() for s in ids]  # (or unknown)
        owners = Counter(b for table in tables for b in table)
        if len(owners) > self.host.num_free:
            raise OutOfBlocks(len(owners), self.host.num_free, "swap out (host blocks)")
        host_of = dict(zip(owners, self.host.allocate_n(len(owners))))
        for b, n in owners.items():
            if n > 1:
                self.host.share_n([host_of[b]], times=n - 1)
        for s, table in zip(ids, tables):
            parked = [host_of[b] for b in table]
            self.swapped[s] = Swapped(parked, self.manager.num_tokens(s))
            self.manager.free(s)
        self.blocks_out += len(owners)
        return copies_array(list(host_of.items()))

    def blocks_to_swap_in(self, seq_ids) -> int:
        """Free device blocks that bringing the sequences back takes at most (blocks the
        prefix cache still holds make it fewer)."""
        return sum(len(self._swapped(s).host_blocks) for s in seq_ids)

    def swap_in(self, seq_ids, contents) -> np.ndarray:
        """Bring parked sequences back with fresh device blocks; ``contents[i]`` is what
        the manager's ``add`` takes for ``seq_ids[i]``, from the tokens' owner. A
        prefix-caching manager finds the blocks it still caches, and those need no copy.
        Returns (host block, device block) pairs. All or nothing: :class:`OutOfBlocks`
        if the device pool is too small, :class:`ConfigError` for contents that do not
        bring back what was parked."""
        ids, contents = self._ids(seq_ids), list(contents)
        need = self.blocks_to_swap_in(ids)             # (or UnknownSequence)
        if len(contents) != len(ids):
            raise ConfigError(f"swap in: one contents per sequence, got "
                              f"{len(contents)} for {len(ids)} sequence(s)")
        if len({is_int(c) for c in contents}) > 1:     # (the first add checks the kind)
            raise ConfigError("swap in: give every sequence's count or every "
                              "sequence's token ids, not both")
        for s, c in zip(ids, contents):
            if s in self.manager:
                raise SequenceExists(f"cannot swap in {s!r}: a running sequence has "
                                     f"its id")
            held, given = self.swapped[s].num_tokens, _length(c)
            if given != held:
                raise ConfigError(f"cannot swap in {s!r}: it held {held} tokens, "
                                  f"{given} given")
        if need > self.manager.allocator.num_free:
            raise OutOfBlocks(need, self.manager.allocator.num_free, "swap in")
        pairs = []
        for s, c in zip(ids, contents):
            plan = self.manager.add(s, c)
            parked = self.swapped.pop(s)
            found = (parked.num_tokens - len(plan.slots)) // self.manager.block_size
            table = self.manager.block_table(s).tolist()
            pairs += zip(parked.host_blocks[found:], table[found:])
            self.host.free_n(parked.host_blocks)
        self.blocks_in += len(pairs)
        return copies_array(pairs)

    def _swapped(self, seq_id) -> Swapped:
        try:
            return self.swapped[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequence(f"{seq_id!r} is not swapped out") from None

    def audit(self) -> None:
        """Check the host pool and the swapped-out sequences; raise :class:`AuditError`.
        """
        self.host.audit()
        mapped = Counter(b for p in self.swapped.values() for b in p.host_blocks)
        refs = self.host.refcounts()
        for b in np.flatnonzero(refs).tolist() + list(mapped):
            if refs[b] != mapped[b]:
                raise AuditError(f"host block {b} has refcount {refs[b]} but "
                                 f"{mapped[b]} swapped-out sequence(s) map it")
        for s in self.swapped:
            if s in self.manager:
                raise AuditError(f"sequence {s!r} is both swapped out and running")


# ------------------------------------------------------------------ moving the bytes

def _split(pairs) -> tuple[np.ndarray, np.ndarray]:
    pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def _parked(host: HostPool, device) -> np.ndarray:
    """The host pool as ``[host blocks, layers, block elements]`` of the device's dtype.
    """
    layers, _, elems = device.shape
    return host.view(device.dtype, (layers, elems))


def copy_to_host(device, host: HostPool, pairs) -> None:
    """Copy device blocks to host blocks, for every (device block, host block) pair.
    ``device`` is the device pool seen as ``[layers, num_blocks, block elements]`` (a
    layer's part of block ``b`` is ``device[layer, b]``). On a GPU: one gather of the
    blocks on the device, one device-to-host copy into pinned memory, one scatter into
    the host pool."""
    src, dst = _split(pairs)
    if not len(src):
        return
    parked = _parked(host, device)
    if isinstance(device, np.ndarray):
        parked[dst] = device[:, src].swapaxes(0, 1)
        return
    import cupyx
    gathered = device[:, backend.xp.asarray(src)]           # [layers, n, elems]
    staging = cupyx.empty_pinned(gathered.shape, dtype=gathered.dtype)
    gathered.get(out=staging)                               # the one copy (it waits)
    parked[dst] = staging.swapaxes(0, 1)


def copy_to_device(host: HostPool, device, pairs) -> None:
    """Copy host blocks to device blocks, for every (host block, device block) pair; the
    layout is :func:`copy_to_host`'s. On a GPU: one gather into pinned memory, one
    host-to-device copy, one scatter of the blocks on the device."""
    src, dst = _split(pairs)
    if not len(src):
        return
    parked = _parked(host, device)
    if isinstance(device, np.ndarray):
        device[:, dst] = parked[src].swapaxes(0, 1)
        return
    import cupyx
    xp = backend.xp
    staging = cupyx.empty_pinned((device.shape[0], len(src), device.shape[2]),
                                 dtype=device.dtype)
    np.copyto(staging, parked[src].swapaxes(0, 1))
    moved = xp.empty(staging.shape, dtype=device.dtype)
    moved.set(staging)                                      # the one copy
    device[:, xp.asarray(dst)] = moved
    xp.cuda.get_current_stream().synchronize()              # before staging is reused
