"""A decode step of sampled requests beside one of greedy requests, at one batch size.

    python perf/sampled_step.py [--batch 64] [--steps 100] [--json OUT.json]

SmolLM2-135M's shapes with random float16 weights (no model file), ``batch`` requests of a
128-token prompt decoding together (the runner draws every sampled row of a step in one
call of the batch sampler). Each variant: greedy (temperature 0) and sampled (temperature
0.7, top-p 0.9), with the device running a step ahead of the host and not; after every
request is prefilled, ``steps`` engine steps are timed by wall clock (device synchronised
at both ends), twice, interleaved, the best kept. Prints ms a step and the
sampled-over-greedy ratios.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

from pagedkv import backend
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.engine import Engine
from pagedkv.config import SamplingParams

SMOL = LlamaConfig(vocab_size=49152, hidden=576, layers=30, heads=9, kv_heads=3,
                   head_dim=64, ffn=1536, rope_base=100000.0, context=2048)


def step_ms(model, batch: int, steps: int, params: SamplingParams, overlap: bool) -> float:
    engine = Engine(model, num_blocks=batch * 24, max_seqs=batch, runner="fast",
                    bookkeeping="fast", overlap=overlap)
    engine.runner.capture_all()
    rng = np.random.default_rng(0)
    for _ in range(batch):
        engine.submit(rng.integers(1, SMOL.vocab_size, 128).tolist(), params)
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    for _ in range(3):
        engine.step()
    backend.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    backend.synchronize()
    return 1e3 * (time.perf_counter() - t) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = np.float16 if backend.on_gpu else np.float32
    model = Llama(SMOL, random_weights(SMOL, 0), dtype=dtype)
    n = args.steps + 40
    variants = {"greedy": SamplingParams(max_new_tokens=n),
                "sampled": SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9,
                                          seed=1)}
    out = {"machine": backend.describe(), "batch": args.batch, "steps": args.steps,
           "date": time.strftime("%Y-%m-%d"), "ms": {}}
    for rep in range(2):
        for overlap in (False, True):
            for name, params in variants.items():
                key = f"{name}, overlap {'on' if overlap else 'off'}"
                ms = step_ms(model, args.batch, args.steps, params, overlap)
                out["ms"][key] = min(ms, out["ms"].get(key, ms))
                print(f"run {rep}: {key:24} {ms:7.3f} ms a step", flush=True)
    ms = out["ms"]
    for overlap in ("off", "on"):
        out[f"sampled_over_greedy_overlap_{overlap}"] = \
            ms[f"sampled, overlap {overlap}"] / ms[f"greedy, overlap {overlap}"]
    out["sampled_over_plain_greedy"] = ms["sampled, overlap off"] / ms["greedy, overlap off"]
    print({k: round(v, 3) for k, v in out.items() if k.startswith("sampled_")})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
