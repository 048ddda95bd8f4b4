"""Chapter 12's climb in one run: every rung of the decode step on one model, in one
process, measured the same way and against one set of goals.

    python perf/climb.py [--json FILE] [--batches 1,8,64,256] [--steps 32] [--repeat 3]
    python perf/climb.py --quick [--json FILE]   # tiny sizes: runs anywhere, times nothing

The model is SmolLM2-135M's shapes with random float16 weights (no model file, as
``perf/decode_timing.py``'s ``smol_and_pool``), or the real model when ``$PAGEDKV_GGUF``
names its file. The rungs, each a runner on the same model, in chapter 12's order:

* ``plain``: chapter 10's forward pass (``ModelRunner``), each operation an array
  expression;
* ``eager``: the fused kernels and static buffers, launched one by one
  (``FastRunner(graphs=False, fold_rows=0, pdl=False)``);
* ``graphs``: the same pass captured once per bucket as a CUDA graph and replayed;
* ``folds``: + each RMSNorm, SwiGLU, and RoPE with the K/V write, done inside the multiply
  beside it, in passes of up to ``GEMV_AUTO_ROWS`` rows (``fold_rows``' default);
* ``pdl``: + programmatic dependent launch in passes of up to ``PDL_AUTO_ROWS`` rows: the
  fast runner as it is by default.

For each rung and batch size: the nodes of the bucket's graph (``runner.graph_nodes``); the
replay's device time (CUDA events around back-to-back replays, as ``pagedkv.bench.model``
times it); one pass on its own (``runner.decode``, host work and the wait included, as
``perf/fold_check.py`` and its siblings time it); and the engine's whole step
(``Engine.step`` with the rung's runner on ``pagedkv.fast``'s bookkeeping, ``batch`` copies
of one prompt, each step landed before the next is planned: overlapping them is chapter
13's). At batch 1, every rung decodes a few prompts greedily, one at a time, and its tokens
are compared with the plain pass's; at a first difference the plain pass's margin between
its two best logits there is kept (a rounding can flip only a near tie).

``--json`` writes the date, the card (``pagedkv.backend.describe()``), the command, the
goals (``GOALS``: the one set chapter 12 measures against) and every number; a table is
printed.
The exit status is 1 when a rung's greedy tokens differ from the plain pass's (after the
JSON is written). Without a GPU there are no graphs: the graph rungs run their pass eagerly
(the kernels' NumPy references, the same buffers), which is what lets the CPU check their
tokens, and nothing is timed that means anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import numpy as np

from decode_timing import SMOL, host
from pagedkv import backend
from pagedkv.checks import cdiv
from pagedkv.config import SamplingParams
from pagedkv.kernels.gemm import GEMV_AUTO_ROWS
from pagedkv.kernels.pdl import programmatic_available
from pagedkv.model import Llama, LlamaConfig, random_weights
from pagedkv.model.blas import single_thread_blas
from pagedkv.model.engine import Engine
from pagedkv.model.llama import Batch, PagedKV
from pagedkv.model.runner import PDL_AUTO_ROWS, FastRunner, ModelRunner

#: The rungs: name, what changes, and the FastRunner settings (None: the plain runner).
RUNGS = [
    ("plain", "chapter 10's forward pass", None),
    ("eager", "fused kernels, static buffers", dict(graphs=False, fold_rows=0, pdl=False)),
    ("graphs", "+ a CUDA graph per bucket", dict(graphs=True, fold_rows=0, pdl=False)),
    ("folds", "+ norms, SwiGLU, RoPE inside the multiplies",
     dict(graphs=True, fold_rows=None, pdl=False)),
    ("pdl", "+ programmatic dependent launch (the default)",
     dict(graphs=True, fold_rows=None, pdl=None)),
]
#: The one set of goals: a batch-1 graph of at most 150 nodes, and a replay of at most
#: these milliseconds at each batch size (perf/LOG.md, 2026-12-04; the device's part of a
#: step: the engine's Python around it is what chapter 13's overlap hides).
GOALS = {"nodes": {"1": 150}, "replay_ms": {"1": 0.4, "8": 0.5, "64": 0.6, "256": 1.0}}
TINY = LlamaConfig(vocab_size=96, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=64,
                   ffn=128, rope_base=10000.0, context=512)
QUESTIONS = ["What is the capital of France?", "Name three colours of the rainbow.",
             "Write one sentence about memory.", "Count from one to ten."]
BLOCK = 16


def settings_here(settings: dict | None) -> dict | None:
    """A rung's runner settings on this machine: no graphs without a GPU."""
    if settings is None:
        return None
    return dict(settings, graphs=settings["graphs"] and backend.on_gpu)


def model_and_prompts(quick: bool, seed: int = 0):
    """The model, the prompts whose greedy tokens are compared (the first is the one the
    timed batches repeat), and a line saying which model it is."""
    rng = np.random.default_rng(seed)
    if quick:
        lengths = (5, 17, 33)
        model = Llama(TINY, random_weights(TINY, seed), dtype=np.float32)
        what = "a tiny model (test sizes), random float32 weights"
    elif os.environ.get("PAGEDKV_GGUF"):
        from pagedkv.model import Tokenizer, load_gguf
        ckpt = load_gguf()
        tok = Tokenizer.from_checkpoint(ckpt)
        model = Llama(ckpt.config, ckpt.weights)
        prompts = [tok.chat(q) for q in QUESTIONS]
        return model, prompts, "SmolLM2-135M-Instruct ($PAGEDKV_GGUF)"
    else:
        lengths = (64, 5, 17, 33)
        model = Llama(SMOL, random_weights(SMOL, seed), dtype=np.float16)
        what = "SmolLM2-135M's shapes, random float16 weights"
    vocab = model.config.vocab_size
    return model, [rng.integers(1, vocab, n).tolist() for n in lengths], what


def engine_for(model, settings, blocks: int, max_seqs: int, max_context: int) -> Engine:
    """An engine whose runner is the rung's: the plain one, or a FastRunner with
    ``settings`` over the engine's own pool (the engine's settings have no place for a
    runner's, so it is made plain and given this runner). Every step lands before the
    next is planned."""
    engine = Engine(model, num_blocks=blocks, block_size=BLOCK, max_seqs=max_seqs,
                    runner="plain", bookkeeping="fast", max_context=max_context,
                    overlap=False)
    if settings is not None:
        c = engine.config
        engine.runner = FastRunner(model, engine.runner.kv, max_batch=max_seqs,
                                   max_context=max_context, prefill_chunk=c.prefill_chunk,
                                   stop_ids=c.stop_ids, **settings)
    return engine


def step_ms(engine, prompt, batch: int, steps: int, repeat: int) -> float:
    """The engine's decode step in ms: ``batch`` copies of ``prompt``, each ``steps`` new
    tokens; the first step (admission, prefill) untimed; the best of ``repeat`` runs."""
    best = float("inf")
    for _ in range(repeat):
        for _ in range(batch):
            engine.submit(prompt, SamplingParams(max_new_tokens=steps + 1, ignore_eos=True))
        engine.step()
        backend.synchronize()
        t = time.perf_counter()
        for _ in range(steps - 1):
            engine.step()
        backend.synchronize()
        best = min(best, (time.perf_counter() - t) / (steps - 1))
        engine.run()
    return 1e3 * best


def decode_rows(b: int, vocab: int, position: int = 100) -> Batch:
    """``b`` decode rows at ``position``, row i in blocks i*8 .. i*8+7."""
    tables = np.arange(b * 8, dtype=np.int32).reshape(b, 8)
    slots = tables[:, position // BLOCK] * BLOCK + position % BLOCK
    one = np.ones(b, np.int32)
    tokens = (np.arange(b, dtype=np.int32) * 37 + 11) % vocab
    return Batch(tokens, one * position, slots.astype(np.int32), one, one * (position + 1),
                 tables, np.zeros((0, 2), np.int32))


def pass_ms(runner, batch: Batch, n: int) -> float:
    """One decode pass on its own (``runner.decode``, waited for): the median of ``n``."""
    for _ in range(3):
        runner.decode(batch)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        runner.decode(batch)
        backend.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def graph_numbers(runner, b: int) -> dict:
    """The bucket of ``b`` rows, its graph's nodes and replay ms (None without a graph)."""
    if not getattr(runner, "graphs", False):
        return dict(bucket=None, nodes=None, replay_ms=None)
    from pagedkv.bench.model import replay_ms
    bucket = runner._bucket(b)
    return dict(bucket=bucket, nodes=runner.graph_nodes(bucket),
                replay_ms=replay_ms(runner, bucket))


def applies(name: str, b: int) -> bool:
    """Does rung ``name``'s own change act at ``b`` rows here (a graph only on a GPU; a
    fold up to ``GEMV_AUTO_ROWS`` rows; PDL up to ``PDL_AUTO_ROWS``, on a GPU with it)?"""
    if name == "graphs":
        return backend.on_gpu
    if name == "folds":
        return b <= GEMV_AUTO_ROWS
    if name == "pdl":
        return b <= PDL_AUTO_ROWS and programmatic_available()
    return True


def measure(model, prompt, name: str, settings, b: int, args, max_seqs: int) -> dict:
    """Every number of rung ``name`` at ``b`` rows."""
    blocks = b * max(8, cdiv(len(prompt) + args.steps + 2, BLOCK)) + 8
    engine = engine_for(model, settings, blocks, max_seqs, args.max_context)
    out = dict(step_ms=step_ms(engine, prompt, b, args.steps, args.repeat))
    runner = engine.runner
    out["pass_ms"] = pass_ms(runner, decode_rows(b, model.config.vocab_size), args.passes)
    return out | graph_numbers(runner, b) | dict(applies=applies(name, b))


def greedy(engine, prompts, n: int) -> list:
    """``n`` greedy tokens after each prompt, one prompt at a time (a batch of 1)."""
    params = SamplingParams(max_new_tokens=n, ignore_eos=True)
    return [engine.generate([p], params)[0].outputs()[0].generated for p in prompts]


def plain_margins(model, prompts, n: int) -> list:
    """The plain pass's greedy tokens and, at each, the gap between its two best logits:
    prefill, then one decode pass a token, one sequence in blocks 0, 1, ..."""
    out = []
    for prompt in prompts:
        p, width = len(prompt), cdiv(len(prompt) + n, BLOCK)
        runner = ModelRunner(model, PagedKV.for_model(model, width, BLOCK), max_seqs=1)
        table, none = np.arange(width, dtype=np.int32)[None], np.zeros((0, 2), np.int32)
        at, one = np.arange(p, dtype=np.int32), np.ones(1, np.int32)
        logits, _ = runner.prefill(Batch(np.array(prompt, np.int32), at, at, np.array(
            [p], np.int32), np.array([p], np.int32), table, none))
        tokens, margins = [], []
        for i in range(n):
            row = host(logits)[-1].astype(np.float64)
            two = np.sort(row)[-2:]
            tokens.append(int(np.argmax(row)))
            margins.append(float(two[1] - two[0]))
            at = np.array([p + i], np.int32)
            logits, _ = runner.decode(Batch(np.array(tokens[-1:], np.int32), at, at, one,
                                            at + 1, table, none))
        out.append((tokens, margins))
    return out


def compare(tokens: list, plain: list) -> dict:
    """A rung's greedy tokens against the plain pass's, prompt by prompt (and the plain
    pass's margin at a first difference)."""
    rows = []
    for mine, (theirs, margins) in zip(tokens, plain):
        first = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), None)
        rows.append(dict(first_difference=first,
                         plain_margin=None if first is None else margins[first]))
    return dict(identical=all(r["first_difference"] is None for r in rows), prompts=rows)


def run(args) -> dict:
    """The whole climb: every rung at every batch size, then the tokens at batch 1."""
    single_thread_blas()
    model, prompts, what = model_and_prompts(args.quick)
    max_seqs = max(args.batches)
    plain = plain_margins(model, prompts, args.tokens)
    result = dict(what="chapter 12's climb: " + what, model=what,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                      timespec="seconds"),
                  command="python perf/climb.py " + " ".join(args.argv),
                  backend=backend.describe(), dtype=str(model.dtype), goals=GOALS,
                  batches=args.batches, steps=args.steps, repeat=args.repeat,
                  prompt_tokens=len(prompts[0]), max_context=args.max_context,
                  programmatic_available=programmatic_available(),
                  weight_bytes=model.weight_bytes, rungs=[])
    result |= floor(model, args, len(prompts[0]))
    for name, change, settings in RUNGS:
        here = settings_here(settings)
        rung = dict(name=name, change=change, settings=here, batches={})
        for b in args.batches:
            r = rung["batches"][str(b)] = measure(model, prompts[0], name, here, b, args,
                                                  max_seqs)
            print(f"{name} at {b}: {json.dumps(r)}", flush=True)
        blocks = len(prompts) * cdiv(max(map(len, prompts)) + args.tokens + 2, BLOCK) + 8
        engine = engine_for(model, here, blocks, max_seqs, args.max_context)
        rung["tokens"] = compare(greedy(engine, prompts, args.tokens), plain)
        result["rungs"].append(rung)
    return result


def floor(model, args, prompt_tokens: int) -> dict:
    """On a GPU, the copy bandwidth and each batch's floor: every weight and each
    sequence's K/V read once at that bandwidth (``pagedkv.bench.model``'s)."""
    if not backend.on_gpu:
        return dict(copy_bytes_per_s=None, floor_ms=None)
    from pagedkv.bench.model import copy_bandwidth, floor_ms
    bw = copy_bandwidth()
    return dict(copy_bytes_per_s=bw, floor_ms={
        str(b): floor_ms(model, b, prompt_tokens + args.steps, bw) for b in args.batches})


def _ms(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def table(result: dict) -> str:
    """The climb as text: a row per rung and batch size, then the goals."""
    lines = [f"{result['what']} on {result['backend'].get('device', 'the CPU')}, "
             f"{result['date'][:10]}",
             f"{'rung':>7}{'batch':>6}{'nodes':>7}{'replay ms':>11}{'pass ms':>9}"
             f"{'step ms':>9}  tokens"]
    for rung in result["rungs"]:
        same = "same" if rung["tokens"]["identical"] else "DIFFER"
        for b, r in rung["batches"].items():
            nodes = "-" if r["nodes"] is None else str(r["nodes"])
            mark = "" if r["applies"] else "  (its change does nothing here)"
            lines.append(f"{rung['name']:>7}{b:>6}{nodes:>7}{_ms(r['replay_ms']):>11}"
                         f"{_ms(r['pass_ms']):>9}{_ms(r['step_ms']):>9}  "
                         f"{same if b == '1' else ''}{mark}")
    g = result["goals"]
    lines.append(f"goals: at most {g['nodes']['1']} nodes at batch 1; replay at most "
                 + ", ".join(f"{ms} ms at {b}" for b, ms in g["replay_ms"].items()))
    return "\n".join(lines)


def arguments(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write every number here")
    ap.add_argument("--quick", action="store_true",
                    help="a tiny model and few steps: for a test, not a measurement")
    ap.add_argument("--batches", help="batch sizes (default 1,8,64,256; quick: 1,2)")
    ap.add_argument("--steps", type=int, help="decode steps timed per run (default 32)")
    ap.add_argument("--repeat", type=int, help="engine runs per rung and batch (default 3)")
    ap.add_argument("--passes", type=int, help="lone passes timed (default 50)")
    ap.add_argument("--tokens", type=int, help="greedy tokens compared (default 32)")
    ap.add_argument("--max-context", type=int, default=1024)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    q = args.quick
    batches = args.batches or ("1,2" if q else "1,8,64,256")
    args.batches = [int(b) for b in batches.split(",")]
    args.steps = args.steps or (3 if q else 32)
    args.repeat = args.repeat or (1 if q else 3)
    args.passes = args.passes or (2 if q else 50)
    args.tokens = args.tokens or (6 if q else 32)
    args.max_context = min(args.max_context, 128) if q else args.max_context
    return args


def main(argv=None) -> int:
    args = arguments(argv)
    result = run(args)
    print(table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    differ = [r["name"] for r in result["rungs"] if not r["tokens"]["identical"]]
    if differ:
        print(f"greedy tokens differ from the plain pass's: {', '.join(differ)}",
              file=sys.stderr)
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
