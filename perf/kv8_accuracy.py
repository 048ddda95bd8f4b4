"""How much the 8-bit K/V cache changes SmolLM2-135M-Instruct's answers, measured.

    python perf/kv8_accuracy.py                 # the built cache: CPU (float32 model) or GPU
    python perf/kv8_accuracy.py --formats       # the candidates, before building (CPU)

**The built cache** (default): the same model with K/V stored three ways — float32 (the CPU's
reference; skipped on a GPU, whose model is float16), float16, and int8 with a float16 scale
per 32 numbers (``kv_dtype="int8"``, :mod:`pagedkv.kernels.kv8`, written and read by the
package's own kernels: ``write_kv`` and ``paged_prefill_attention``, which on a GPU are the
CUDA kernels and on a CPU their NumPy references). Two measurements:

* *teacher-forced*: the fixed text ``perf/data/kv8-text.md`` (the prose of chapter 1, 3,232
  tokens; the first ``--tokens`` + 1 are used, 2,049 by default) fed in chunks of 512 tokens,
  each position's logits kept: top-1 agreement of each cache with the float16 cache (and with
  float32 where there is one), and the change of the text's log-likelihood (the sum of the
  log-probabilities of its tokens) against the float16 cache's, in per cent;
* *greedy*: ``--prompts`` chat prompts (60 questions below), ``--new`` tokens each (32), the
  end token ending an answer, through the engine (the plain runner on a CPU, the fast one on
  a GPU): how many answers are token for token the float16 cache's, and where the others part.

On a CPU the model computes in float32, and its "float16 cache" is a float32 pool holding K/V
rounded to float16 as they are written (the numbers a float16 pool would hold; attention
computes in float32 either way). On a GPU the model is float16 and so is its cache.

**The candidates** (``--formats``, CPU): the teacher-forced measurement for K/V rounded, as
they are written, to each candidate 8-bit format (a float32 pool holding the rounded numbers):
int8 with one float16 scale per head row (66 bytes a row of 64) or per 32 numbers (68 bytes),
e4m3 (``ml_dtypes.float8_e4m3fn``) with the same scales, and e4m3 unscaled (64 bytes).

Writes ``perf/results/kv8-accuracy-{cpu,gpu}-DATE.json`` (``kv8-formats-cpu-DATE.json``) with
the command, date, machine and commit, or ``--json PATH``. Takes about 15 minutes on two CPU
cores (each teacher-forced pass about 3), under a minute on a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pagedkv import backend  # noqa: E402
from pagedkv.config import SamplingParams  # noqa: E402
from pagedkv.kernels import paged_prefill_attention  # noqa: E402
from pagedkv.kernels.kv8 import quantize, dequantize  # noqa: E402
from pagedkv.model import Llama, load_gguf  # noqa: E402
from pagedkv.model.engine import Engine  # noqa: E402
from pagedkv.model.llama import PagedKV  # noqa: E402
from pagedkv.model.tokenizer import Tokenizer  # noqa: E402

TEXT = ROOT / "perf/data/kv8-text.md"
BLOCK = 16

#: The greedy prompts: short questions of many kinds, fixed here so every run asks the same.
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in one paragraph.",
    "Write a haiku about the sea.", "How do vaccines work?",
    "What is the difference between a list and a tuple in Python?",
    "Give three tips for a good night's sleep.", "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.", "What is 17 times 23?",
    "Translate 'good morning' into Spanish.", "What causes the seasons on Earth?",
    "Describe a cat to someone who has never seen one.", "What is machine learning?",
    "List the planets of the solar system.", "How do I boil an egg?",
    "What is the Pythagorean theorem?", "Write a short poem about autumn.",
    "Why do we need sleep?", "What is an API?", "How does a bicycle stay upright?",
    "Name three famous painters and one work by each.", "What is inflation?",
    "Explain recursion to a child.", "What are the benefits of exercise?",
    "Write a limerick about a programmer.", "How do airplanes fly?",
    "What is the water cycle?", "Give me a recipe for pancakes.",
    "What is the difference between weather and climate?", "Who was Ada Lovelace?",
    "What does a CPU do?", "How can I learn a new language quickly?",
    "What is a black hole?", "Write two sentences about friendship.",
    "What is the largest ocean on Earth?", "Explain what DNA is.",
    "How do I write a good email?", "What is the speed of light?",
    "Suggest a name for a coffee shop.", "What is a prime number?",
    "Why do leaves change color in the fall?", "How does the internet work?",
    "What is democracy?", "Tell me a fun fact about octopuses.",
    "How do I make my code easier to read?", "What is gravity?",
    "Describe the taste of a lemon.", "What are renewable energy sources?",
    "How many continents are there?", "What is a good way to start a story?",
    "Explain supply and demand.", "What is the boiling point of water?",
    "How do magnets work?", "Write a thank-you note to a teacher.",
    "What is a computer virus?", "Why is reading important?",
    "What is the difference between a virus and a bacterium?",
    "How do I plant a tree?", "What is a noun?", "Give me a motivational quote.",
]


def load_model():
    ckpt = load_gguf()
    model = Llama(ckpt.config, ckpt.weights)     # float32 on NumPy, float16 on CuPy
    return ckpt, model


# ---------------------------------------------------------------------- roundings

def as_float16(x):
    return x.astype(np.float16).astype(x.dtype)


def int8_runs(run: int):
    """int8 with a float16 scale per ``run`` numbers (64: per head row), as stored."""
    def rnd(x):
        if run == 32:                              # the package's own rounding
            return dequantize(*quantize(x)).astype(x.dtype)
        t = x.astype(np.float32).reshape(*x.shape[:-1], -1, run)
        s = (np.abs(t).max(-1, keepdims=True) / np.float32(127)).astype(np.float16)
        s = s.astype(np.float32)
        q = np.clip(np.rint(np.divide(t, s, out=np.zeros_like(t), where=s > 0)), -127, 127)
        return (q * s).reshape(x.shape).astype(x.dtype)
    return rnd


def e4m3_runs(run: int | None):
    """e4m3 with a float16 scale per ``run`` numbers (amax maps to 448), or unscaled."""
    import ml_dtypes
    e4m3 = ml_dtypes.float8_e4m3fn

    def rnd(x):
        t = x.astype(np.float32)
        if run is None:
            return np.clip(t, -448, 448).astype(e4m3).astype(x.dtype)
        t = t.reshape(*x.shape[:-1], -1, run)
        s = (np.abs(t).max(-1, keepdims=True) / np.float32(448)).astype(np.float16)
        s = s.astype(np.float32)
        y = np.clip(np.divide(t, s, out=np.zeros_like(t), where=s > 0), -448, 448)
        return (y.astype(e4m3).astype(np.float32) * s).reshape(x.shape).astype(x.dtype)
    return rnd


FORMATS = {  # name: (rounding as written, bytes of a head row of 64 numbers)
    "float32": (None, 256), "float16": (as_float16, 128),
    "int8, scale per row": (int8_runs(64), 66), "int8, scale per 32": (int8_runs(32), 68),
    "e4m3, scale per row": (e4m3_runs(64), 66), "e4m3, scale per 32": (e4m3_runs(32), 68),
    "e4m3, no scale": (e4m3_runs(None), 64),
}


# ---------------------------------------------------------------------- teacher-forced

def text_ids(tok, n: int) -> list:
    ids = tok.encode_text(TEXT.read_text())
    if len(ids) < n + 1:
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, fewer than {n + 1}")
    return ids[:n + 1]


def teacher_forced(model, ids, kv_dtype=None, rounding=None, chunk: int = 512):
    """Feed ``ids[:-1]`` through a paged cache (``kv_dtype``; K/V passed through
    ``rounding`` before they are written), ``chunk`` tokens a pass, each pass's attention by
    ``paged_prefill_attention`` over everything written so far. Returns each position's
    top-1 token and the log-probability of the next token of the text."""
    xp, n = model.xp, len(ids) - 1
    blocks = -(-n // BLOCK)
    kv = PagedKV.for_model(model, blocks, BLOCK, kv_dtype=kv_dtype)
    tables = xp.asarray(np.arange(blocks, dtype=np.int32)[None])      # blocks in order
    top, ll = [], []
    for start in range(0, n, chunk):
        tokens = np.asarray(ids[start:min(start + chunk, n)], np.int32)
        m = len(tokens)
        positions = xp.asarray(np.arange(start, start + m, dtype=np.int32))
        qs, lens = (xp.asarray(np.array(a, np.int32)) for a in ([0, m], [start + m]))
        x = model.embed(xp.asarray(tokens))
        for i in range(model.config.layers):
            q, k, v = model.qkv(i, x, positions)
            if rounding is not None:
                k, v = rounding(k), rounding(v)
            kv.write(i, k, v, positions)                  # slot = position
            o = paged_prefill_attention(q, kv.layers[i], tables, qs, lens, scale=model.scale)
            x = model.finish_layer(i, x, o)
        logits = backend.to_numpy(model.logits(x)).astype(np.float64)
        z = logits - logits.max(-1, keepdims=True)
        lp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        top.append(logits.argmax(-1))
        ll.append(lp[np.arange(m), ids[start + 1:start + m + 1]])
    return np.concatenate(top), np.concatenate(ll)


def compare(runs: dict, base: str, ref: str | None) -> dict:
    """Top-1 agreement (per cent) and log-likelihood change against ``base``."""
    btop, bll = runs[base]
    out = {}
    for name, (top, ll) in runs.items():
        row = {"top1_agree_with_float16_pct": 100 * float(np.mean(top == btop)),
               "log_likelihood": float(ll.sum()),
               "log_likelihood_change_pct": 100 * float((ll.sum() - bll.sum()) / abs(bll.sum())),
               "nll_per_token": float(-ll.mean())}
        if ref is not None:
            row["top1_agree_with_float32_pct"] = 100 * float(np.mean(top == runs[ref][0]))
        out[name] = row
    return out


# ---------------------------------------------------------------------- greedy

def greedy(model, prompts, new: int, eos: int, kv_dtype=None, rounding=None) -> list:
    runner = "fast" if backend.on_gpu else "plain"
    blocks = sum(-(-(len(p) + new) // BLOCK) for p in prompts) + 8
    engine = Engine(model, num_blocks=blocks, block_size=BLOCK, max_seqs=len(prompts),
                    runner=runner, stop_ids=(eos,), kv_dtype=kv_dtype)
    if rounding is not None:                              # the plain runner writes here
        kv = engine.runner.kv
        write = kv.write
        kv.write = lambda i, k, v, slots: write(i, rounding(k), rounding(v), slots)
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=new))
    return [list(r.finished[0].generated) for r in reqs]


def agreement(answers: list, base: list) -> dict:
    same = [a == b for a, b in zip(answers, base)]
    parted = [next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
              for a, b in zip(answers, base) if a != b]
    return {"identical": int(sum(same)), "of": len(base),
            "identical_pct": 100 * float(np.mean(same)),
            "first_difference_at": parted,
            "tokens_before_first_difference_mean": float(np.mean(parted)) if parted else None}


# ---------------------------------------------------------------------- the command

def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--formats", action="store_true",
                   help="the candidate formats' teacher-forced accuracy (CPU)")
    p.add_argument("--tokens", type=int, default=2048, help="teacher-forced positions")
    p.add_argument("--prompts", type=int, default=len(QUESTIONS))
    p.add_argument("--new", type=int, default=32, help="greedy tokens a prompt")
    p.add_argument("--json", help="where to write (default: perf/results/...)")
    args = p.parse_args(argv)
    if args.formats and backend.on_gpu:
        p.error("--formats rounds on the host: run it with PAGEDKV_BACKEND=numpy")
    if not 1 <= args.prompts <= len(QUESTIONS):
        p.error(f"--prompts must be 1 to {len(QUESTIONS)}")
    ckpt, model = load_model()
    tok = Tokenizer.from_checkpoint(ckpt)
    ids = text_ids(tok, args.tokens)
    where = "gpu" if backend.on_gpu else "cpu"
    date = datetime.date.today().isoformat()
    r = {"command": "python perf/kv8_accuracy.py " + " ".join(sys.argv[1:] if argv is None
                                                               else argv),
         "date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _commit(),
         "machine": backend.describe(), "python": platform.python_version(),
         "model": "SmolLM2-135M-Instruct", "model_dtype": str(model.dtype),
         "text": {"file": str(TEXT.relative_to(ROOT)), "tokens": len(ids) - 1,
                  "sha256": hashlib.sha256(TEXT.read_bytes()).hexdigest()}}
    runs, seconds = {}, {}
    if args.formats:
        for name, (rounding, row_bytes) in FORMATS.items():
            t0 = time.perf_counter()
            runs[name] = teacher_forced(model, ids, rounding=rounding)
            seconds[name] = round(time.perf_counter() - t0, 1)
            print(f"{name}: {seconds[name]} s", flush=True)
        r["teacher_forced"] = compare(runs, "float16", "float32")
        for name, (_, row_bytes) in FORMATS.items():
            r["teacher_forced"][name]["bytes_per_head_row_of_64"] = row_bytes
        out = args.json or ROOT / f"perf/results/kv8-formats-cpu-{date}.json"
    else:
        caches = {"float16": (None, None if backend.on_gpu else as_float16),
                  "int8": ("int8", None)}
        if not backend.on_gpu:
            caches = {"float32": (None, None)} | caches
        for name, (kv_dtype, rounding) in caches.items():
            t0 = time.perf_counter()
            runs[name] = teacher_forced(model, ids, kv_dtype, rounding)
            seconds[name] = round(time.perf_counter() - t0, 1)
            print(f"teacher-forced, {name}: {seconds[name]} s", flush=True)
        r["teacher_forced"] = compare(runs, "float16", None if backend.on_gpu else "float32")
        prompts = [tok.chat(q) for q in QUESTIONS[:args.prompts]]
        answers = {}
        for name, (kv_dtype, rounding) in caches.items():
            t0 = time.perf_counter()
            answers[name] = greedy(model, prompts, args.new, ckpt.eos_id, kv_dtype, rounding)
            seconds[f"greedy {name}"] = round(time.perf_counter() - t0, 1)
            print(f"greedy, {name}: {seconds[f'greedy {name}']} s", flush=True)
        r["greedy"] = {"prompts": len(prompts), "new_tokens": args.new,
                       "runner": "fast" if backend.on_gpu else "plain",
                       "vs_float16": {k: agreement(a, answers["float16"])
                                      for k, a in answers.items()}}
        int8 = r["teacher_forced"]["int8"]
        r["goal"] = {"top1_agree_with_float16_pct": ">= 97.5",
                     "log_likelihood_change_pct": "<= 0.5 (in size)",
                     "met": bool(int8["top1_agree_with_float16_pct"] >= 97.5
                                 and abs(int8["log_likelihood_change_pct"]) <= 0.5)}
        out = args.json or ROOT / f"perf/results/kv8-accuracy-{where}-{date}.json"
    r["seconds"] = seconds
    for name, row in r["teacher_forced"].items():
        extra = (f", vs float32 {row['top1_agree_with_float32_pct']:.2f} %"
                 if "top1_agree_with_float32_pct" in row else "")
        print(f"{name:22} top-1 vs float16 {row['top1_agree_with_float16_pct']:6.2f} %{extra}, "
              f"log-likelihood {row['log_likelihood']:.1f} "
              f"({row['log_likelihood_change_pct']:+.3f} %)")
    if "greedy" in r:
        for name, g in r["greedy"]["vs_float16"].items():
            print(f"greedy {name}: {g['identical']} of {g['of']} answers identical to float16's")
    pathlib.Path(out).write_text(json.dumps(r, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
