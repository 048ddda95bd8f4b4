"""Where a fast decode step's device time goes, without the model file: SmolLM2-135M's shapes
with random weights, the graph of each batch size replayed with one part of the step taken out
at a time. Usage (GPU): python perf/step_sweep.py [--json PATH]

Variants: ``full``; ``no_attention`` (the paged attention and its split merge skipped);
``no_gemm`` (every cuBLAS multiply skipped); ``gemm_only`` (only the multiplies); ``cublas``
(full, every multiply through cuBLAS instead of the few-row kernel). The part's
cost is full minus the variant without it. Times are CUDA-event medians of 5 rounds of 100
replays of one captured graph.
"""
import argparse
import json
import sys

import numpy as np

from pagedkv import backend
from pagedkv.bench.model import replay_ms
from pagedkv.checks import cdiv
from pagedkv.model import Llama, random_weights
from pagedkv.model import runner as runner_mod
from pagedkv.model.gguf import LlamaConfig
from pagedkv.model.llama import Batch, PagedKV

SMOL = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3, head_dim=64,
                   ffn=1536, rope_base=100000.0, context=8192)


def batch_of(b, length, block_size, width):
    """b sequences of ``length`` tokens in blocks 0.., the new token at position length-1."""
    per = cdiv(length, block_size)
    tables = np.arange(b * per, dtype=np.int32).reshape(b, per)
    seq = np.arange(b, dtype=np.int32)
    slots = tables[:, -1] * block_size + (length - 1) % block_size
    return Batch(tokens=(seq * 7 + 1).astype(np.int32),
                 positions=np.full(b, length - 1, np.int32), slots=slots.astype(np.int32),
                 query_lens=np.ones(b, np.int32), seq_lens=np.full(b, length, np.int32),
                 block_tables=tables, copies=np.zeros((0, 2), np.int32))


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--length", type=int, default=64, help="tokens in each sequence")
    p.add_argument("--max-context", type=int, default=1024)
    args = p.parse_args(argv)
    model = Llama(SMOL, random_weights(SMOL, 0))
    real_gemm, real_attend = runner_mod.gemm, runner_mod.FastRunner._attend
    variants = {
        "full": (real_gemm, real_attend, True),
        "no_attention": (real_gemm, lambda self, v, i: None, True),
        "no_gemm": (lambda a, b, out, **kw: out, real_attend, True),
        "gemm_only": (real_gemm, lambda self, v, i: None, False),
        "cublas": (real_gemm, real_attend, True),          # every multiply through cuBLAS
    }
    fused = ("rms_norm", "rope_write_kv", "silu_mul", "embed", "argmax_rows")
    real_fused = {n: getattr(runner_mod, n) for n in fused}
    rows = {}
    for b in args.batches:
        blocks = b * cdiv(args.length, 16) + 16
        rows[b] = {}
        for name, (gemm, attend, small) in variants.items():
            runner_mod.gemm, runner_mod.FastRunner._attend = gemm, attend
            for n in fused:
                setattr(runner_mod, n, real_fused[n] if small else (lambda *a, **k: None))
            kv = PagedKV.for_model(model, blocks, 16)
            r = runner_mod.FastRunner(model, kv, max_batch=b, max_context=args.max_context,
                                      gemm_method="cublas" if name == "cublas" else "auto")
            r.decode(batch_of(b, args.length, 16, r.width))     # captures bucket b
            rows[b][name] = replay_ms(r, b)
        runner_mod.gemm, runner_mod.FastRunner._attend = real_gemm, real_attend
        for n in fused:
            setattr(runner_mod, n, real_fused[n])
        full = rows[b]["full"]
        print(f"batch {b:>3}: full {full:.3f} ms; attention {full - rows[b]['no_attention']:.3f}"
              f", gemms {full - rows[b]['no_gemm']:.3f}, gemms alone {rows[b]['gemm_only']:.3f}"
              f", the small kernels {rows[b]['no_attention'] - rows[b]['gemm_only']:.3f}"
              f"; all multiplies on cuBLAS {rows[b]['cublas']:.3f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"length": args.length, "max_context": args.max_context, "ms": rows,
                       "backend": backend.describe()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
