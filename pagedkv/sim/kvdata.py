"""The K/V data path: a manager and the bytes it manages, every token written and
checked.

:class:`CheckedKV` executes the manager's plans with
:func:`~pagedkv.kernels.cache_ops.write_kv` and
:func:`~pagedkv.kernels.cache_ops.copy_blocks` on the pool itself (GPU memory with CuPy,
host memory with NumPy). Each token's K and V are a fixed function of (who wrote it, its
position) (:func:`token_values`), so a sequence can be read back through its page table
and every token checked.

The bookkeeping (allocator and manager) is the teaching core by default;
``bookkeeping="fast"`` runs the same simulation on :mod:`pagedkv.fast`, which has the
same API.
"""
from __future__ import annotations

import numpy as np

from .. import backend
from ..allocator import BlockAllocator
from ..checks import cdiv, positive_int
from ..errors import ConfigError
from ..manager import KVCacheManager
from ..spec import KVSpec

__all__ = ["SIM_SPEC", "BOOKKEEPING", "check_bookkeeping", "token_values", "CheckedKV"]

#: The simulation's model shape: one layer, one KV head of 64 float32 numbers, 512 bytes
#: of K and V per token. Small, so that many tokens fit in a pool that any laptop can
#: hold.
SIM_SPEC = KVSpec(layers=1, kv_heads=1, head_dim=64, dtype="float32")


def _teaching(num_blocks, block_bytes, block_size, *, max_seqs, max_len):
    return KVCacheManager(BlockAllocator(num_blocks, block_bytes), block_size)


def _fast_classes():
    try:
        from .. import fast
        return fast.BlockAllocator, fast.KVCacheManager
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"the fast bookkeeping (pagedkv.fast) cannot be used here: "
                          f"{type(exc).__name__}: {exc}") from None


def _fast(num_blocks, block_bytes, block_size, *, max_seqs, max_len):
    allocator, manager = _fast_classes()
    return manager(allocator(num_blocks, block_bytes), block_size, max_seqs=max_seqs,
                   max_seq_len=max_len)


#: Builders of a manager over a fresh allocator, by name: ``(num_blocks, block_bytes,
#: block_size, *, max_seqs, max_len) -> manager``. The fast one needs both limits up
#: front.
BOOKKEEPING = {"teaching": _teaching, "fast": _fast}


def check_bookkeeping(name: str) -> None:
    """Raise :class:`ConfigError` unless the bookkeeping ``name`` can be used here."""
    if name not in BOOKKEEPING:
        raise ConfigError(f"bookkeeping must be one of {sorted(BOOKKEEPING)}, "
                          f"got {name!r}")
    if name == "fast":
        _fast_classes()


def token_values(writers, positions, kv_heads: int = 1, head_dim: int = 64):
    """The K and V a sequence ``writers[i]`` stores at ``positions[i]``: float32
    ``[tokens, kv_heads, head_dim]`` each, a hash of the pair (below 2**23, so exact in
    float32) plus the element index; V is the negative of K."""
    w = np.asarray(writers, dtype=np.int64).astype(np.uint32)
    p = np.asarray(positions, dtype=np.int64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h = (w * np.uint32(40503) + p) * np.uint32(2654435761)
        h ^= h >> np.uint32(15)
    base = (h & np.uint32(0x7FFFFF)).astype(np.float32)
    k = base[:, None, None] + np.arange(kv_heads * head_dim, dtype=np.float32).reshape(
        1, kv_heads, head_dim)
    return k, -k


class CheckedKV:
    """A :class:`~pagedkv.manager.KVCacheManager` over a pool of ``pool_bytes``, and its
    bytes.

    Every slot a plan names is written (``write_kv``), every copy-on-write copy is
    executed (``copy_blocks``, one batched call per step), and :meth:`verify` reads a
    sequence back through its page table. Sequence ids are integers: they are also the
    writer ids of :func:`token_values`. A sequence remembers who wrote each of its
    positions as segments ``(first position, writer)``: a fork inherits its parent's,
    and its own writes start a new one. With ``write=False`` only the bookkeeping runs
    (no pool bytes are touched).

    ``spec`` gives the bytes per token (:class:`~pagedkv.spec.KVSpec`); the data path
    writes one layer of float32, so with ``write=True`` the spec must be that.
    ``max_seqs`` and ``max_len`` are passed on to bookkeeping that needs them (the fast
    one).
    """

    def __init__(self, pool_bytes: int, block_size: int, *, spec: KVSpec = SIM_SPEC,
                 write: bool = True, bookkeeping: str = "teaching", max_seqs: int = 256,
                 max_len: int = 2048):
        block_size = positive_int(block_size, "block_size")
        pool_bytes = positive_int(pool_bytes, "pool_bytes")
        if write and (spec.layers != 1 or np.dtype(spec.dtype) != np.float32):
            raise ConfigError(f"the K/V data path writes one layer of float32, "
                              f"got {spec}")
        check_bookkeeping(bookkeeping)
        block_bytes = spec.block_bytes(block_size)
        if pool_bytes < block_bytes:
            raise ConfigError(f"a pool of {pool_bytes} bytes is smaller than one block "
                              f"({block_size} tokens x {spec.bytes_per_token} B)")
        self.manager = BOOKKEEPING[bookkeeping](pool_bytes // block_bytes, block_bytes,
                                                block_size, max_seqs=max_seqs,
                                                max_len=max_len)
        self.allocator = self.manager.allocator
        self.spec, self.block_size, self.write = spec, block_size, bool(write)
        shape = (2, block_size, spec.kv_heads, spec.head_dim)   # K and V of a block
        self.cache = self.allocator.view(np.float32, shape) if self.write else None
        self._segments: dict[int, list] = {}
        self.copies = 0           # copy-on-write block copies executed
        self.tokens_written = 0   # token slots written (prefills and decode steps)
        self.verified = 0         # tokens read back and checked
        self.corrupted = 0        # of those, tokens whose K or V differed

    # -------------------------------------------------------------- executing plans
    def _write(self, slots, writers, positions):
        self.tokens_written += len(slots)
        if not self.write or not len(slots):
            return
        from ..kernels.cache_ops import write_kv
        k, v = token_values(writers, positions, self.spec.kv_heads, self.spec.head_dim)
        xp = backend.xp if backend.on_gpu else np
        write_kv(self.cache, xp.asarray(k), xp.asarray(v),
                 xp.asarray(np.asarray(slots, dtype=np.int32)))

    def _copy(self, pairs):
        if len(pairs):
            self.copies += len(pairs)
            if self.write:
                from ..kernels.cache_ops import copy_blocks
                copy_blocks(self.cache, np.asarray(pairs, dtype=np.int32))

    def add(self, sid: int, n: int):
        """A new sequence with ``n`` prompt tokens, written (or :class:`OutOfBlocks`)."""
        plan = self.manager.add(sid, n)
        self._segments[sid] = [(0, sid)]
        self._write(plan.slots, np.full(n, sid), np.arange(n))
        return plan

    def append(self, sid: int, n: int):
        """``n`` more tokens of a sequence's prefill, written (or :class:`OutOfBlocks`)."""
        start = self.manager.num_tokens(sid)
        plan = self.manager.append(sid, n)
        self._copy(plan.copies)
        segs = self._segments[sid]
        if segs[-1][1] != sid:
            segs.append((start, sid))
        self._write(plan.slots, np.full(n, sid), np.arange(start, start + n))
        return plan

    def fork(self, parent: int, *children: int) -> None:
        self.manager.fork(parent, *children)
        for c in children:
            self._segments[c] = list(self._segments[parent])

    def step(self, ids):
        """Every sequence in ``ids`` gains one token: copies first, then the writes."""
        plan = self.manager.step(ids)
        self._copy(plan.copies)
        positions = plan.seq_lens - 1
        if self.write:
            for sid, pos in zip(plan.seq_ids, positions.tolist()):
                segs = self._segments[sid]
                if segs[-1][1] != sid:
                    segs.append((pos, sid))
        self._write(plan.slot_mapping, plan.seq_ids, positions)
        return plan

    # -------------------------------------------------------------- reading back
    def writers(self, sid: int) -> np.ndarray:
        """Who wrote each of the sequence's positions."""
        n = self.manager.num_tokens(sid)
        starts = [s for s, _ in self._segments[sid]] + [n]
        return np.repeat([w for _, w in self._segments[sid]], np.diff(starts))

    def read(self, sid: int) -> np.ndarray:
        """The sequence's K/V read through its page table:
        ``[tokens, 2, kv_heads, head_dim]``."""
        slots = self.manager.slots(sid).astype(np.int64)
        xp = backend.xp if backend.on_gpu else np
        blocks = xp.asarray(slots // self.block_size)
        offsets = xp.asarray(slots % self.block_size)
        return backend.to_numpy(self.cache[blocks, :, offsets])

    def verify(self, sid: int) -> int:
        """How many of the sequence's tokens read back differently from what was
        written: a token counts once if its K, its V, or both differ."""
        if not self.write:
            return 0
        got = self.read(sid)
        k, v = token_values(self.writers(sid), np.arange(len(got)), self.spec.kv_heads,
                            self.spec.head_dim)
        bad_k = (got[:, 0] != k).reshape(len(got), -1).any(axis=1)
        bad_v = (got[:, 1] != v).reshape(len(got), -1).any(axis=1)
        bad = int((bad_k | bad_v).sum())
        self.verified += len(got)
        self.corrupted += bad
        return bad

    def free(self, sid: int, verify: bool = True) -> int:
        """Verify (by default), then release the sequence. Returns its bad tokens."""
        bad = self.verify(sid) if verify else 0
        self.manager.free(sid)
        del self._segments[sid]
        return bad

    def used_and_unshared(self) -> tuple[int, int]:
        """(blocks in use, blocks the live sequences would use with no sharing)."""
        lens = np.array([self.manager.num_tokens(s) for s in self.manager.seq_ids])
        return self.allocator.num_used, int(cdiv(lens, self.block_size).sum())
