"""Two GPUs: ``python -m pagedkv.bench.disagg [--tiny] [--tp] [--cpu] [--json PATH]``.

Needs two CUDA devices and CuPy with NCCL; with fewer it says so and exits with status 2.
``--cpu`` is a dry run of the same protocol on a CPU (two processes, a pipe where NCCL
would be, the tiny model): it checks the steps and the tokens, and measures nothing.
It starts one process per GPU (rank 0 on GPU 0, rank 1 on GPU 1), with
``NCCL_NVLS_ENABLE=0`` in their environment, and runs greedy generation of one prompt of
``--prompt-len`` random tokens on SmolLM2-135M-Instruct (float16; ``--tiny``: a small
random Llama with 4 KV heads):

* **disaggregated**: rank 0 prefills the prompt, tells rank 1 the prompt's length and first
  token, rank 1 adds the sequence to its own manager (the receiving half of
  :func:`~pagedkv.transfer.plan_transfer`: its fresh blocks) and answers whether it has
  room, rank 0 sends the blocks in one packed NCCL send and frees them, rank 1 decodes.
  Measured: the transfer's GB/s (decimal), the same blocks copied device-to-device on
  GPU 0 for comparison, time to first token (prefill + transfer) and decode tokens/s;
* **one GPU**: rank 0 prefills and decodes the same prompt alone; TTFT and tokens/s;
* with ``--tp``, **tensor parallelism**: both ranks run the model with half the KV heads
  each (:mod:`pagedkv.model.tensor_parallel`; SmolLM2's 3 KV heads do not split, so
  ``--tp`` implies ``--tiny``), one NCCL all-reduce per layer, the same manager calls on
  each rank (so the same page tables); tokens compared with one GPU's.

The link's rated bandwidth is not something CUDA reports: ``nvidia-smi topo -m`` is
recorded beside the numbers to say what joins the two GPUs. Printed as a table;
``--json PATH`` writes every number with the date and the devices.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

from ..transfer import nccl_env

TINY = dict(vocab_size=512, hidden=256, layers=4, heads=8, kv_heads=4, head_dim=64,
            ffn=512, context=4096)


def gpus_or_why() -> tuple[int, str]:
    """(number of usable CUDA devices, why not two)."""
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:                   # no CuPy, no driver, no device
        return 0, f"CuPy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
    try:
        from cupy.cuda import nccl  # noqa: F401
    except Exception as exc:
        return n, f"CuPy has no NCCL ({type(exc).__name__}: {exc})"
    return n, "" if n >= 2 else f"only {n} CUDA device(s)"


def _model(args):
    from ..model import Llama, LlamaConfig, load_gguf, random_weights
    if args.tiny or args.tp:
        config = LlamaConfig(**TINY)
        return Llama(config, random_weights(config, 0)), "tiny random Llama"
    ckpt = load_gguf()
    return Llama(ckpt.config, ckpt.weights), "SmolLM2-135M-Instruct"


def _host(a) -> np.ndarray:
    from .. import backend
    return backend.to_numpy(a)


def _clock() -> float:
    from .. import backend
    backend.synchronize()
    return time.perf_counter()


def _one_gpu(model, prompt, args) -> dict:
    """Prefill and decode on this GPU alone."""
    from ..model.disagg import decode, prefill
    from ..model.llama import PagedKV, forward
    out = {}
    for _ in range(2):                         # the first run compiles the kernels
        kv = PagedKV.for_model(model, args.num_blocks, args.block_size)
        run = lambda batch: forward(model, kv, batch)  # noqa: E731
        t0 = _clock()
        first = prefill(run, kv.manager, [prompt])
        t1 = _clock()
        tokens = decode(run, kv.manager, first, args.new_tokens - 1)
        t2 = _clock()
        out = dict(ttft_s=t1 - t0, decode_tokens_per_s=(args.new_tokens - 1) / (t2 - t1),
                   tokens=tokens[0])
    return out


def _device_copy(kv, blocks) -> float:
    """GB/s of the same blocks copied into a second pool on this GPU (bytes moved once)."""
    from ..model.llama import PagedKV
    from ..transfer import copy_between, pool_blocks
    other = PagedKV(kv.spec, kv.allocator.num_blocks, kv.block_size)
    pairs = np.stack([blocks, blocks], axis=1).astype(np.int32)
    copy_between(pool_blocks(kv), pool_blocks(other), pairs)      # warm-up
    t0 = _clock()
    copy_between(pool_blocks(kv), pool_blocks(other), pairs)
    seconds = _clock() - t0
    return len(blocks) * kv.allocator.block_bytes / seconds / 1e9


def _prefill_rank(link, model, prompt, args) -> dict:
    """Rank 0: prefill, offer the sequence, send its blocks, free them."""
    from ..model.disagg import prefill
    from ..model.llama import PagedKV, forward
    from ..transfer import pool_blocks
    result = dict(one_gpu=_one_gpu(model, prompt, args))
    for rep in range(2):                       # the first round warms both sides up
        kv = PagedKV.for_model(model, args.num_blocks, args.block_size)
        t0 = _clock()
        first = prefill(lambda batch: forward(model, kv, batch), kv.manager, [prompt])[0]
        t1 = _clock()
        link.send_array(np.array([len(prompt), first], dtype=np.int64), peer=1)
        if _host(link.recv_array((1,), np.int64, peer=1)).tolist() != [1]:
            raise SystemExit("rank 1 has no room for the prompt's blocks")
        blocks = kv.manager.block_table(0)
        t2 = _clock()
        link.send_blocks(pool_blocks(kv), blocks, peer=1)
        t3 = _clock()
        nbytes = len(blocks) * kv.allocator.block_bytes
        result.update(prefill_s=t1 - t0, transfer_s=t3 - t2, transfer_bytes=nbytes,
                      transfer_gb_per_s=nbytes / (t3 - t2) / 1e9, blocks=len(blocks),
                      ttft_s=t3 - t0,              # prefill, offer, blocks sent
                      same_gpu_copy_gb_per_s=_device_copy(kv, blocks))
        kv.manager.free(0)
    return result


def _decode_rank(link, model, args) -> dict:
    """Rank 1: take the sequence into fresh blocks of its own pool, receive, decode."""
    from ..errors import OutOfBlocks
    from ..model.disagg import decode
    from ..model.llama import PagedKV, forward
    from ..transfer import pool_blocks
    result = {}
    for rep in range(2):
        kv = PagedKV.for_model(model, args.num_blocks, args.block_size)
        length, first = _host(link.recv_array((2,), np.int64, peer=0)).tolist()
        try:
            kv.manager.add(0, length)          # the plan's receiving half: fresh blocks
            ok = 1
        except OutOfBlocks:
            ok = 0
        link.send_array(np.array([ok], dtype=np.int64), peer=0)
        if not ok:
            return dict(refused=True)
        link.recv_blocks(pool_blocks(kv), kv.manager.block_table(0), peer=0)
        t0 = _clock()
        tokens = decode(lambda batch: forward(model, kv, batch), kv.manager, [first],
                        args.new_tokens - 1)
        t1 = _clock()
        result = dict(decode_tokens_per_s=(args.new_tokens - 1) / (t1 - t0),
                      tokens=tokens[0])
    return result


def _tp_rank(link, model, prompt, args) -> dict:
    """Both ranks: the model with this rank's half of the KV heads; one all-reduce per
    layer."""
    from ..model.disagg import decode, prefill
    from ..model.tensor_parallel import shard, shard_caches, tp_forward
    part = shard(model, link.rank, 2)
    kv = shard_caches(model, 2, args.num_blocks, args.block_size)[link.rank]

    def all_reduce(partials):
        (a,) = partials                        # this rank's partial sum
        a = a if a.flags.c_contiguous else a.copy()
        link.all_reduce(a)
        return a

    run = lambda batch: tp_forward(model, [part], [kv], batch, all_reduce)  # noqa: E731
    t0 = _clock()
    first = prefill(run, kv.manager, [prompt])
    t1 = _clock()
    tokens = decode(run, kv.manager, first, args.new_tokens - 1)
    t2 = _clock()
    return dict(ttft_s=t1 - t0, decode_tokens_per_s=(args.new_tokens - 1) / (t2 - t1),
                tokens=tokens[0])


class PipeLink:
    """:class:`~pagedkv.transfer.NcclLink`'s calls over a pipe between two CPU processes,
    on NumPy arrays: the launcher's protocol with ``--cpu``, where no GPU is needed (and
    nothing it measures is a GPU number). Rank 0 sends first in an all-reduce, so two
    large sends never wait on each other."""

    def __init__(self, rank: int, conn):
        self.rank, self.conn = rank, conn

    def send_array(self, a, peer: int) -> None:
        self.conn.send(np.asarray(a))

    def recv_array(self, shape, dtype, peer: int):
        return self.conn.recv()

    def send_blocks(self, blocks, ids, peer: int) -> None:
        self.conn.send(blocks[:, np.asarray(ids)])

    def recv_blocks(self, blocks, ids, peer: int) -> None:
        blocks[:, np.asarray(ids)] = self.conn.recv()

    def all_reduce(self, a) -> None:
        if self.rank == 0:
            self.conn.send(a)
            a += self.conn.recv()
        else:
            other = self.conn.recv()
            self.conn.send(a)
            a += other

    def close(self) -> None:
        self.conn.close()


def _worker(rank: int, uid, args, queue) -> None:
    try:
        _work(rank, uid, args, queue)
    except BaseException:                      # the parent reports it and stops the other
        import traceback
        queue.put((rank, dict(error=traceback.format_exc())))
        raise


def _work(rank: int, uid, args, queue) -> None:
    if args.cpu:
        from ..model.blas import single_thread_blas
        single_thread_blas()
        link = PipeLink(rank, uid)             # (uid: this rank's end of the pipe)
    else:
        os.environ.update(nccl_env())
        from ..transfer import NcclLink
        link = NcclLink(rank, 2, uid)          # (this process's GPU is device `rank`)
    try:
        model, name = _model(args)
        rng = np.random.default_rng(0)
        prompt = rng.integers(1, model.config.vocab_size, args.prompt_len).tolist()
        out = dict(model=name)
        if args.tp:
            out["tp"] = _tp_rank(link, model, prompt, args)
            if rank == 0:
                out["one_gpu"] = _one_gpu(model, prompt, args)
        elif rank == 0:
            out.update(_prefill_rank(link, model, prompt, args))
        else:
            out.update(_decode_rank(link, model, args))
        queue.put((rank, out))
    finally:
        link.close()


def _topology() -> str:
    try:
        return subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                              env=nccl_env(), timeout=30).stdout
    except Exception as exc:
        return f"nvidia-smi topo -m failed: {exc}"


def run(args) -> dict:
    import multiprocessing as mp

    os.environ.update(nccl_env())              # before NCCL starts, here and in children
    ctx = mp.get_context("spawn")
    if args.cpu:
        os.environ["PAGEDKV_BACKEND"] = "numpy"
        ids = list(ctx.Pipe())
    else:
        from ..transfer import NcclLink
        ids = [NcclLink.unique_id()] * 2
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, ids[r], args, queue))
             for r in range(2)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < len(procs):
            rank, out = queue.get(timeout=args.timeout)
            if "error" in out:
                raise SystemExit(f"rank {rank} failed:\n{out['error']}")
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():                   # (its peer failed: NCCL waits forever)
                p.terminate()
    r0, r1 = results[0], results[1]
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    out = dict(date=now, cpu_dry_run=args.cpu, model=r0["model"],
               prompt_len=args.prompt_len, new_tokens=args.new_tokens,
               block_size=args.block_size,
               topology="(CPU dry run)" if args.cpu else _topology(), ranks=results)
    if args.tp:
        out["tp_tokens_equal_one_gpu"] = r0["tp"]["tokens"] == r0["one_gpu"]["tokens"] \
            == r1["tp"]["tokens"]
    else:
        out["disagg_tokens_equal_one_gpu"] = r1["tokens"] == r0["one_gpu"]["tokens"]
    return out


def _print(out: dict) -> None:
    r0, r1 = out["ranks"][0], out["ranks"][1]
    dry = out["cpu_dry_run"]
    link, alone, both = (("a pipe", "one process", "2 processes") if dry else
                         ("NCCL", "one GPU", "2 GPUs"))
    if dry:
        print("CPU dry run: two processes and a pipe instead of two GPUs and NCCL;")
        print("no timing below is a GPU number")
    print(f"{out['model']}, prompt {out['prompt_len']} tokens, {out['new_tokens']} new, "
          f"{out['date']}")
    one = r0["one_gpu"]
    if "tp" in r0:
        tp = r0["tp"]
        print(f"{'':24}{'TTFT ms':>10}{'decode tok/s':>14}")
        print(f"{alone:24}{one['ttft_s'] * 1e3:10.2f}{one['decode_tokens_per_s']:14.1f}")
        print(f"{'tensor parallel, ' + both:24}{tp['ttft_s'] * 1e3:10.2f}"
              f"{tp['decode_tokens_per_s']:14.1f}")
        print(f"tokens equal {alone}'s:", out["tp_tokens_equal_one_gpu"])
        return
    print(f"transfer: {r0['blocks']} blocks, {r0['transfer_bytes'] / 1e6:.2f} MB, "
          f"{r0['transfer_gb_per_s']:.1f} GB/s over {link}; same-device copy "
          f"{r0['same_gpu_copy_gb_per_s']:.1f} GB/s")
    print(f"{'':24}{'TTFT ms':>10}{'decode tok/s':>14}")
    print(f"{alone:24}{one['ttft_s'] * 1e3:10.2f}{one['decode_tokens_per_s']:14.1f}")
    print(f"{'prefill 0, decode 1':24}{r0['ttft_s'] * 1e3:10.2f}"
          f"{r1['decode_tokens_per_s']:14.1f}")
    print(f"tokens equal {alone}'s:", out["disagg_tokens_equal_one_gpu"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.disagg",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="a small random Llama")
    p.add_argument("--tp", action="store_true", help="tensor parallelism (implies --tiny)")
    p.add_argument("--cpu", action="store_true",
                   help="a dry run of the protocol on the CPU (implies --tiny)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.tiny = args.tiny or args.cpu
    n, why = (2, "") if args.cpu else gpus_or_why()
    if n < 2 or why:
        print(f"pagedkv.bench.disagg needs two CUDA GPUs with NCCL: {why}. Nothing was "
              f"run.", file=sys.stderr)
        return 2
    out = run(args)
    _print(out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
