"""Moving a sequence's K/V blocks from one pool to another: prefill here, decode there.

Disaggregated serving computes a prompt's K/V on one GPU and decodes it on another. The
books are two managers, one per pool, and the move is chapter 11's swap-in with a second
device pool where the host pool was: the receiving manager adds the sequence (fresh
blocks, its page table, its token count) and the plan lists the (source block,
destination block) pairs whose bytes must follow. Three parts, kept apart as everywhere
in pagedkv:

* :func:`plan_transfer` keeps the books. It moves no bytes and leaves the source
  sequence where it is: the caller frees it once the bytes have arrived.
* :func:`copy_between` moves the bytes of every layer between two pools in one process
  (two NumPy pools, or two pools on one GPU): one gather, one scatter.
* :class:`NcclLink` moves them between two processes, one per GPU, over NCCL (CuPy's
  ``cupy.cuda.nccl``): the sender packs its blocks with one gather, one ``send`` carries
  them all, the receiver scatters them with one scatter. Importing this module does not
  need CuPy (NCCL is imported when a link is made); NCCL's NVLink multicast is switched
  off (``NCCL_NVLS_ENABLE=0``) before NCCL starts, in this process and in the
  environment of every process started for it (:func:`nccl_env`). Not yet run on two
  GPUs.

Sharing. A block that two transferred sequences share on the source (a fork) is sent
once per sequence: a plain manager on the receiving side cannot map one block into two
page tables except by forking, so each sequence there gets its own. A prefix-caching
receiver finds the first sequence's full blocks again by their tokens, and those need no
copy (the plan's ``found``), as in swap-in.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from .checks import is_int
from .errors import ConfigError, DuplicateSequence, OutOfBlocks, SequenceExists
from .manager import copies_array
from .swap import _length, _split

__all__ = ["TransferPlan", "plan_transfer", "pool_blocks", "copy_between", "nccl_env",
           "NcclLink"]


class TransferPlan(NamedTuple):
    """What moving ``seq_ids`` from pool A to pool B asks of the devices."""
    seq_ids: list
    pairs: np.ndarray      # int32 [n, 2]: (block on A, block on B), every layer of each
    found: int             # blocks B's prefix cache already held (no bytes to move)

    def nbytes(self, block_bytes: int) -> int:
        """Bytes the plan moves, all layers together."""
        return len(self.pairs) * int(block_bytes)


def _check_pair(src, dst) -> None:
    """Both managers cut their pools the same way (one block is one block on both)."""
    if src.block_size != dst.block_size:
        raise ConfigError(f"a transfer needs one block size on both sides, got "
                          f"{src.block_size} tokens per block on A, "
                          f"{dst.block_size} on B")
    a, b = src.allocator.block_bytes, dst.allocator.block_bytes
    if a != b:
        raise ConfigError(f"a transfer needs blocks of one size on both sides, got "
                          f"{a} bytes on A, {b} on B")


def _contents(src, ids, contents) -> list:
    """What ``dst.add`` takes for each sequence: its token count from A by default."""
    if contents is None:
        return [src.num_tokens(s) for s in ids]
    contents = list(contents)
    if len(contents) != len(ids):
        raise ConfigError(f"transfer: one contents per sequence, got {len(contents)} "
                          f"for {len(ids)} sequence(s)")
    for s, c in zip(ids, contents):
        held, given = src.num_tokens(s), _length(c)
        if given != held:
            raise ConfigError(f"cannot transfer {s!r}: it holds {held} tokens on A, "
                              f"{given} given")
    return contents


def plan_transfer(src, dst, seq_ids, contents=None) -> TransferPlan:
    """Give each sequence of ``seq_ids`` on manager ``src`` (pool A) fresh blocks on
    manager ``dst`` (pool B), where it is added under the same id and the same length;
    returns the (block on A, block on B) pairs to copy. ``contents[i]`` is what
    ``dst.add`` takes for ``seq_ids[i]`` (default: its token count on A; a
    prefix-caching ``dst`` takes its token ids). Execute the plan before B runs a
    forward pass and before A frees or writes the sequences.

    All or nothing: :class:`OutOfBlocks` if B has too few free blocks for all of them,
    and the typed error of the first bad argument otherwise; either way neither manager
    has changed."""
    _check_pair(src, dst)
    ids = list(seq_ids)
    if len(set(ids)) != len(ids):
        raise DuplicateSequence(f"a sequence appears more than once in {ids!r}")
    tables = [src.block_table(s).tolist() for s in ids]          # (or UnknownSequence)
    contents = _contents(src, ids, contents)
    if len({is_int(c) for c in contents}) > 1:
        raise ConfigError("transfer: give every sequence's count or every sequence's "
                          "token ids, not both")
    for s in ids:
        if s in dst:
            raise SequenceExists(f"cannot transfer {s!r}: B already holds a sequence "
                                 f"with that id")
    need = sum(len(t) for t in tables)
    if need > dst.allocator.num_free:
        raise OutOfBlocks(need, dst.allocator.num_free, "transfer (blocks on B)")
    pairs, found = [], 0
    for s, c, table in zip(ids, contents, tables):
        plan = dst.add(s, c)                     # (the first add checks the kind)
        hit = (src.num_tokens(s) - len(plan.slots)) // dst.block_size
        pairs += zip(table[hit:], dst.block_table(s).tolist()[hit:])
        found += hit
    return TransferPlan(ids, copies_array(pairs), found)


# ------------------------------------------------------------------ moving the bytes

def pool_blocks(kv):
    """A :class:`~pagedkv.model.llama.PagedKV`'s pool as ``[layers, num_blocks, block
    elements]`` (a view): block ``b`` of every layer is ``pool_blocks(kv)[:, b]``."""
    spec, alloc = kv.spec, kv.allocator
    pool = alloc.pool.view(np.dtype(spec.dtype))
    return pool.reshape(spec.layers, alloc.num_blocks, -1)


def copy_between(src_blocks, dst_blocks, pairs) -> None:
    """Copy block ``a`` of ``src_blocks`` onto block ``b`` of ``dst_blocks`` in every
    layer, for each (a, b) of ``pairs``; both pools seen as :func:`pool_blocks` shows
    them, in one process (NumPy, or CuPy on one device). One gather, one scatter."""
    if src_blocks.shape[::2] != dst_blocks.shape[::2] or \
            src_blocks.dtype != dst_blocks.dtype:
        raise ConfigError(f"pools of [layers, blocks, elements] "
                          f"{tuple(src_blocks.shape)} {src_blocks.dtype} and "
                          f"{tuple(dst_blocks.shape)} "
                          f"{dst_blocks.dtype}: layers, elements and dtype must agree")
    src, dst = _split(pairs)
    if not len(src):
        return
    if len(np.unique(dst)) != len(dst):
        raise ConfigError("each destination block must appear once in a transfer")
    xp = np if isinstance(dst_blocks, np.ndarray) else _cupy()
    dst_blocks[:, xp.asarray(dst)] = src_blocks[:, xp.asarray(src)]


# ------------------------------------------------------------------ two GPUs: NCCL

def nccl_env(env=None) -> dict:
    """A copy of ``env`` (default: this process's environment) with NCCL's NVLink
    multicast switched off, for every process that may start NCCL."""
    out = dict(os.environ if env is None else env)
    out["NCCL_NVLS_ENABLE"] = "0"
    return out


def _cupy():
    import cupy
    return cupy


def _nccl():
    """``cupy.cuda.nccl``, imported after ``NCCL_NVLS_ENABLE=0`` is in the environment
    (NCCL reads it when a communicator is made)."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    from cupy.cuda import nccl
    return nccl


class NcclLink:
    """This process's end of a NCCL communicator of ``world`` processes, one GPU each
    (device ``rank`` unless ``device`` is given). Every rank makes one with the same
    ``unique_id`` (made once by :meth:`unique_id`, passed to every process).

    Blocks travel as bytes: :meth:`send_blocks` gathers a pool's blocks into one packed
    buffer and sends it, :meth:`recv_blocks` receives one and scatters it into the
    receiver's blocks, each in one NCCL group (one batched transfer per step)."""

    def __init__(self, rank: int, world: int, unique_id, device: int | None = None):
        nccl, cp = _nccl(), _cupy()
        self.rank, self.world = int(rank), int(world)
        self.device = cp.cuda.Device(self.rank if device is None else device)
        self.device.use()
        self.stream = cp.cuda.Stream()   # (ordered after the default stream's work)
        self.comm = nccl.NcclCommunicator(self.world, unique_id, self.rank)
        self.bytes_sent = self.bytes_received = 0

    @staticmethod
    def unique_id():
        """The id every rank's communicator is made with (make it once, in one process).
        """
        return _nccl().get_unique_id()

    def send_blocks(self, blocks, ids, peer: int) -> None:
        """Send blocks ``ids`` of ``blocks`` ([layers, num_blocks, elements] on this
        GPU), every layer, to rank ``peer``, packed in plan order."""
        self.exchange(peer, send=(blocks, ids))

    def recv_blocks(self, blocks, ids, peer: int) -> None:
        """Receive from rank ``peer`` what its :meth:`send_blocks` sent, into blocks
        ``ids`` of ``blocks`` (as many blocks, in plan order)."""
        self.exchange(peer, recv=(blocks, ids))

    def exchange(self, peer: int, *, send=None, recv=None) -> None:
        """One NCCL group: send ``send = (blocks, ids)`` to ``peer`` and receive
        ``recv = (blocks, ids)`` from it, either or both. One gather packs what goes,
        one scatter unpacks what came; the call returns when both are done."""
        nccl, cp = _nccl(), _cupy()
        with self.stream:
            out = inbox = None
            if send is not None:
                blocks, ids = send
                out = cp.ascontiguousarray(blocks[:, cp.asarray(np.asarray(ids))])
            if recv is not None:
                blocks, ids = recv
                inbox = cp.empty((blocks.shape[0], len(ids), blocks.shape[2]),
                                 dtype=blocks.dtype)
            nccl.groupStart()
            if out is not None:
                self.comm.send(out.data.ptr, out.nbytes, nccl.NCCL_UINT8, int(peer),
                               self.stream.ptr)
            if inbox is not None:
                self.comm.recv(inbox.data.ptr, inbox.nbytes, nccl.NCCL_UINT8, int(peer),
                               self.stream.ptr)
            nccl.groupEnd()
            if inbox is not None:
                blocks, ids = recv
                blocks[:, cp.asarray(np.asarray(ids))] = inbox
        self.stream.synchronize()        # the packed buffers live until they are gone
        self.bytes_sent += 0 if out is None else out.nbytes
        self.bytes_received += 0 if inbox is None else inbox.nbytes

    def send_array(self, a, peer: int) -> None:
        """A small array (a plan's block ids, a token; host or device), sent as its
        bytes."""
        self._p2p(_cupy().ascontiguousarray(_cupy().asarray(a)), peer, send=True)

    def recv_array(self, shape, dtype, peer: int):
        """What :meth:`send_array` sent: an array of ``shape`` and ``dtype``."""
        out = _cupy().empty(shape, dtype=dtype)
        self._p2p(out, peer, send=False)
        return out

    def _p2p(self, a, peer: int, *, send: bool) -> None:
        nccl = _nccl()
        with self.stream:
            nccl.groupStart()
            op = self.comm.send if send else self.comm.recv
            op(a.data.ptr, a.nbytes, nccl.NCCL_UINT8, int(peer), self.stream.ptr)
            nccl.groupEnd()
        self.stream.synchronize()

    def all_reduce(self, a) -> None:
        """Sum ``a`` (float16 or float32, on this GPU) over every rank, in place: tensor
        parallelism's one collective per layer."""
        nccl = _nccl()
        kinds = {np.dtype(np.float16): nccl.NCCL_FLOAT16,
                 np.dtype(np.float32): nccl.NCCL_FLOAT32}
        if a.dtype not in kinds:
            raise ConfigError(f"all_reduce takes float16 or float32, got {a.dtype}")
        with self.stream:
            self.comm.allReduce(a.data.ptr, a.data.ptr, a.size, kinds[a.dtype],
                                nccl.NCCL_SUM, self.stream.ptr)
        self.stream.synchronize()

    def close(self) -> None:
        self.comm.destroy()
