"""Q4_1 weights read as stored (q4_gemv) against the fp16 few-row multiply, on the H200.

    python perf/q4_check.py --json OUT.json            # on a GPU: kernels, steps, tokens
    python perf/q4_check.py --quick --json OUT.json    # anywhere: fewer tokens, no timings
                                                       # on a CPU (NumPy)
    python perf/q4_check.py --compile                  # nvcc, no GPU needed: every instance

0. ``--compile``: every template instance the launcher can ask for (x and out float32,
   float16 or bfloat16 as q4_gemv allows; 1 to 8 rows; 1, 2 or 4 rows a warp) through
   ``nvcc -cubin -arch=sm_90 -std=c++17 --use_fast_math -Xptxas -v`` (perf/compile_check.py):
   registers and spills.

1. ``kernels``: at 1, 2, 4 and 8 rows, SmolLM2's four projections (q|k|v 576 -> 960, o
   576 -> 576, gate|up 576 -> 3072, down 1536 -> 576), fp16 x and out: ``q4_gemv`` (each
   ``rows_per_warp``), the fp16 ``gemv.cu`` kernel and cuBLAS, CUDA events, medians
   (``pagedkv.bench.kernels.time_fn``). Each call reads the next of 30 copies of the
   weight (a layer each, as a step does), so the bytes come from HBM, not from the 50 MB
   L2 that one matrix fits in. Each result is first checked against the float64 product
   of the dequantized weights.
2. ``steps``: the decode graph's replay time at buckets 1, 2, 4, 8 with weights="fp16"
   (its default folding) and weights="q4_1", SmolLM2's real weights (random ones, rounded
   to Q4_1, without the file), 100 tokens of context a sequence.
3. ``tokens``: given the model file (``$PAGEDKV_GGUF`` or the installed package), greedy
   tokens of the four prompts of ``pagedkv.bench.model`` with the fast runner, fp16 against
   q4_1; where they part, the step and each run's logit margin (top-1 minus top-2) there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import backend  # noqa: E402
from pagedkv.kernels.q4_gemv import (BLOCK_BYTES, QK, dequantize_q4_1, q4_gemv,  # noqa: E402
                                     quantize_q4_1)

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
ROWS = (1, 2, 4, 8)
COPIES = 30


def compile_instances() -> int:
    """nvcc over every instance; prints the worst registers and spills. Returns 0 if clean."""
    sys.path.insert(0, str(ROOT / "perf"))
    import re
    from compile_check import compile_one
    names = [f"q4_gemv<{dt}, {do}, {m}, {r}>" for dt in (0, 1, 2) for do in {dt, 0}
             for m in range(1, 9) for r in (1, 2, 4)]
    rc, log = compile_one("q4_gemv.cu", names)
    regs = [int(x) for x in re.findall(r"Used (\d+) registers", log)]
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill stores", log)]
    print(f"nvcc: exit {rc}, {len(names)} instances, {len(regs)} compiled, registers "
          f"{min(regs, default=0)} to {max(regs, default=0)}, spill stores "
          f"{max(spills, default=0)} bytes at most")
    if rc:
        print(log[-3000:])
    return 1 if rc or any(spills) or len(regs) != len(names) else 0


def kernels(seed: int = 0) -> list:
    from pagedkv.bench.kernels import time_fn
    from pagedkv.kernels.gemm import gemm
    cp, rng, rows = backend.xp, np.random.default_rng(seed), []
    for name, (n, k) in SHAPES.items():
        blocks = [quantize_q4_1(rng.standard_normal((n, k)).astype(np.float32) * 0.05)
                  for _ in range(COPIES)]
        q4 = [cp.asarray(b) for b in blocks]
        fp16 = [cp.asarray(dequantize_q4_1(b).astype(np.float16)) for b in blocks]
        for m in ROWS:
            x = cp.asarray(rng.standard_normal((m, k)).astype(np.float16))
            out = cp.zeros((m, n), np.float16)
            want = cp.asnumpy(x).astype(np.float64) @ dequantize_q4_1(blocks[0]).T
            row = dict(shape=name, n=n, k=k, rows=m, fp16_bytes=2 * n * k,
                       q4_bytes=n * k // QK * BLOCK_BYTES)

            def cycle(call):
                i = [0]

                def fn():
                    call(i[0] % COPIES)
                    i[0] += 1
                return fn
            for r in (1, 2, 4):
                q4_gemv(x, q4[0], out, rows_per_warp=r)
                err = float(np.abs(cp.asnumpy(out) - want).max())
                ms = time_fn(cycle(lambda j: q4_gemv(x, q4[j], out, rows_per_warp=r)))[0]
                row[f"q4_r{r}_us"], row[f"q4_r{r}_max_err"] = 1e3 * ms, err
            for method in ("gemv", "cublas"):
                gemm(x, fp16[0], out, transpose_b=True, method=method)
                err = float(np.abs(cp.asnumpy(out) - want).max())
                ms = time_fn(cycle(lambda j: gemm(x, fp16[j], out, transpose_b=True,
                                                  method=method)))[0]
                row[f"fp16_{method}_us"], row[f"fp16_{method}_max_err"] = 1e3 * ms, err
            best = min(row[f"q4_r{r}_us"] for r in (1, 2, 4))
            row["q4_best_us"] = best
            row["q4_GBps"] = row["q4_bytes"] / best / 1e3
            row["fp16_gemv_GBps"] = row["fp16_bytes"] / row["fp16_gemv_us"] / 1e3
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def _decode_batch(b: int, context: int = 100, block_size: int = 16):
    from pagedkv.model.llama import Batch
    width = -(-(context + 1) // block_size)
    tables = np.arange(b * width, dtype=np.int32).reshape(b, width)
    ones = np.ones(b, np.int32)
    slots = tables[:, context // block_size] * block_size + context % block_size
    return Batch(ones, ones * context, slots.astype(np.int32), ones, ones * (context + 1),
                 tables, np.zeros((0, 2), np.int32))


def steps(model, q4_blocks) -> list:
    from pagedkv.bench.model import replay_ms
    from pagedkv.model import PagedKV
    from pagedkv.model.runner import FastRunner
    rows = []
    for weights in ("fp16", "q4_1", "fp16", "q4_1"):          # twice each, interleaved
        kv = PagedKV.for_model(model, 8 * 8, 16)
        runner = FastRunner(model, kv, max_batch=8, max_context=1024, weights=weights,
                            q4_blocks=q4_blocks if weights == "q4_1" else None)
        for b in ROWS:
            runner.decode(_decode_batch(b))
            rows.append(dict(weights=weights, bucket=b, fold_rows=runner.fold_rows,
                             replay_ms=replay_ms(runner, b), nodes=runner.graph_nodes(b)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _greedy(model, prompt, n: int, eos: int, **options):
    """Greedy tokens and, per token, the margin of the logits it was chosen from."""
    from pagedkv.model.engine import Engine
    from pagedkv.model.requests import SamplingParams
    from pagedkv.model.runner import FastRunner
    engine = Engine(model, num_blocks=-(-(len(prompt) + n) // 16) + 1, block_size=16,
                    max_seqs=8, stop_ids=[eos], runner="fast")
    engine.runner = runner = FastRunner(model, engine.runner.kv, max_batch=8, **options)
    margins, decode, prefill, inside = [], runner.decode, runner.prefill, [False]

    def keep(result):
        top = np.sort(backend.to_numpy(result[0])[-1].astype(np.float64))[-2:]
        margins.append(float(top[1] - top[0]))
        return result

    def prefill_kept(batch):                   # a short prefill calls decode: count it once
        inside[0] = True
        try:
            return keep(prefill(batch))
        finally:
            inside[0] = False
    runner.decode = lambda batch: decode(batch) if inside[0] else keep(decode(batch))
    runner.prefill = prefill_kept
    (req,) = engine.generate([prompt], SamplingParams(max_new_tokens=n))
    return req.outputs()[0].generated, margins


def tokens(ckpt, model, n: int) -> list:
    from pagedkv.bench.model import IDENTITY_PROMPTS
    from pagedkv.model import Tokenizer
    tok, rows = Tokenizer.from_checkpoint(ckpt), []
    for question, with_system in IDENTITY_PROMPTS:
        prompt = tok.chat(question) if with_system else tok.chat(question, system=None)
        a, ma = _greedy(model, prompt, n, tok.eos_id)
        b, mb = _greedy(model, prompt, n, tok.eos_id, weights="q4_1", q4_blocks=ckpt.q4)
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if at is None and len(a) != len(b):
            at = min(len(a), len(b))
        row = dict(prompt=question, system_prompt=with_system, identical=a == b,
                   first_difference=at, tokens=[len(a), len(b)],
                   fp16=tok.decode(a), q4_1=tok.decode(b))
        if at is not None:
            row["margin_fp16_there"] = ma[at] if at < len(ma) else None
            row["margin_q4_1_there"] = mb[at] if at < len(mb) else None
        row["smallest_margin_before"] = min(ma[:at if at is not None else len(ma)],
                                            default=None)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="8 tokens a prompt, no timings")
    ap.add_argument("--tokens", type=int, default=None, help="new tokens a prompt (64)")
    ap.add_argument("--compile", action="store_true", help="only compile with nvcc")
    args = ap.parse_args()
    if args.compile:
        return compile_instances()
    n = args.tokens or (8 if args.quick else 64)
    r = dict(what="q4_gemv (Q4_1 blocks as stored) against fp16, SmolLM2-135M's shapes",
             date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             backend=backend.describe(), python=platform.python_version(),
             numpy=np.__version__, copies_per_timed_weight=COPIES)
    timed = backend.on_gpu and not args.quick
    if timed:
        r["kernels"] = kernels()
    from pagedkv.model import Llama, ModelNotFound, load_gguf
    try:
        ckpt = load_gguf(keep_q4=True)
    except (ModelNotFound, ImportError) as exc:
        r["model"] = f"no model file ({exc}): steps on random weights, no tokens"
        if timed:
            from pagedkv.model import random_weights
            from pagedkv.model.gguf import quantize_weights_q4
            sys.path.insert(0, str(ROOT / "perf"))
            from fold_check import SMOL
            blocks, deq = quantize_weights_q4(random_weights(SMOL, 0), SMOL.layers)
            r["steps"] = steps(Llama(SMOL, deq, dtype=np.float16), blocks)
    else:
        model = Llama(ckpt.config, ckpt.weights)
        r["model_dtype"] = str(model.dtype)
        r["projection_bytes"] = dict(
            fp16=sum(2 * w.size for layer in model.layers
                     for w in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)),
            q4_1=sum(b.nbytes for b in ckpt.q4.values()))
        if timed:
            r["steps"] = steps(model, ckpt.q4)
        r["tokens_per_prompt"] = n
        r["tokens"] = tokens(ckpt, model, n)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    if "tokens" in r:
        print("tokens identical on every prompt:", all(t["identical"] for t in r["tokens"]))
    for w in ("fp16", "q4_1") if "steps" in r else ():
        ms = [statistics.median(s["replay_ms"] for s in r["steps"]
                                if s["weights"] == w and s["bucket"] == b) for b in ROWS]
        print(f"{w}: step ms at buckets {ROWS}: " + ", ".join(f"{x:.3f}" for x in ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
