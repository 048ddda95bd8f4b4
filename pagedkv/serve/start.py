"""Making the engine the server runs, where it runs: in the engine's own process (the
default) or the server's. A module of its own so that a child process can import it."""
from __future__ import annotations

import logging
import os
import time

from ..checks import cdiv

__all__ = ["engine_options", "make_engine", "GPU_TOKENS_PER_SEQ"]

log = logging.getLogger("pagedkv.serve")

#: Blocks of the default pool on a GPU: this many tokens for each of ``--max-seqs``
#: sequences, at most half of the device's free memory.
GPU_TOKENS_PER_SEQ = 2048


def engine_options(args) -> dict:
    """What the engine is made from (0 and "auto": decided where the model runs)."""
    return dict(model=args.model, gguf=args.gguf, num_blocks=args.num_blocks,
                block_size=args.block_size, max_seqs=args.max_seqs, runner=args.runner,
                prefix_caching=args.prefix_caching, audit=args.audit,
                token_budget=args.token_budget or None,
                chunked_prefill=not args.no_chunked_prefill)


def make_engine(options: dict):
    """The model and its engine, sized for this machine where ``options`` leave it open,
    every CUDA graph captured: ``(engine, what was chosen)``. Runs where the engine runs
    (the engine's process, or the server's with ``--engine thread``)."""
    from .. import backend
    from ..model.blas import single_thread_blas
    from ..model.engine import Engine
    from .models import load

    single_thread_blas()
    o = dict(options)
    served = load(o.pop("model"), o.pop("gguf"))
    gpu = backend.on_gpu
    runner = o.pop("runner")
    runner = runner if runner != "auto" else ("fast" if gpu else "plain")
    max_seqs = o.pop("max_seqs") or (256 if gpu else 32)
    blocks = o.pop("num_blocks")
    if not blocks:
        blocks = 256
        if gpu:
            block_bytes = served.model.kv_spec().block_bytes(o["block_size"])
            free = backend.xp.cuda.Device().mem_info[0]
            want = max_seqs * cdiv(GPU_TOKENS_PER_SEQ, o["block_size"])
            blocks = max(256, min(want, free // 2 // block_bytes))
    engine = Engine(served.model, num_blocks=blocks, max_seqs=max_seqs, runner=runner,
                    stop_ids=[served.tokenizer.eos_id],
                    prefill_chunk=o["token_budget"] or 2048,   # one pass a step's prefill
                    bookkeeping="fast" if runner == "fast" else "teaching", **o)
    info = dict(blocks=blocks, max_seqs=max_seqs, runner=runner, graphs=0)
    t = time.perf_counter()
    info["graphs"] = engine.runner.capture_all()
    info["capture_s"] = time.perf_counter() - t
    if info["graphs"]:
        log.info("captured %d CUDA graphs (batch buckets up to %d) in %.1f s",
                 info["graphs"], max_seqs, info["capture_s"])
    _inject_failures(engine)
    return engine, info


def _inject_failures(engine) -> None:
    """For the tests of a failing engine: ``PAGEDKV_SERVE_FAIL_STEPS="5,6"`` makes the
    engine's 5th and 6th steps raise."""
    wanted = os.environ.get("PAGEDKV_SERVE_FAIL_STEPS")
    if not wanted:
        return
    fail, step, count = {int(s) for s in wanted.split(",")}, engine.step, [0]

    def failing():
        count[0] += 1
        if count[0] in fail:
            raise RuntimeError(f"a failure injected at step {count[0]}")
        step()
    engine.step = failing
