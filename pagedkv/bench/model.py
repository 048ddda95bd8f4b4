"""The real model's speed: ``python -m pagedkv.bench.model [--quick] [--json PATH] [--gguf PATH]``.

On the backend in use (NumPy float32 on a CPU, CuPy float16 on a GPU) it measures, for
SmolLM2-135M-Instruct generating greedily through the paged cache, ``batch`` copies of one chat
prompt each decoding ``steps`` tokens (prefill excluded), at batch 1 and 8 on a CPU and 1, 8, 64
and 256 on a GPU:

* **the decode step** in milliseconds and tokens/s, per engine: ``pagedkv_plain`` (the plain
  forward pass of chapter 10 on the teaching bookkeeping; on a GPU up to batch 64),
  ``pagedkv_eager`` (the fast runner's fused kernels and static buffers, launched one by one,
  on :mod:`pagedkv.fast`'s bookkeeping) and on a GPU ``pagedkv_graph`` (the same, replayed from
  one CUDA graph per batch bucket; ``graph_replay_ms`` is the graph alone, without the
  engine's Python; ``graph_nodes`` the nodes of that graph, of bucket ``graph_bucket``),
  and ``floor`` (every weight and each sequence's K/V read once at the measured
  device-to-device copy bandwidth);
* **where the plain step's time goes** (``breakdown_ms``): the step run with every matrix
  multiply (``Llama.linear``), every attention call (``write_kv``, copy-on-write copies and the
  paged attention), the bookkeeping (``manager.reserve()``, ``commit()`` and the plan) and the
  choice of the next token timed separately, the device synchronised around each (so each part
  includes its GPU work, and the parts sum to more than an unsynchronised step); "other" is the
  rest;
* when ``transformers`` (with ``torch`` and ``accelerate``, which its GGUF loading needs) is
  importable, in the same process on the same prompt: the model loaded from the same GGUF file,
  ``generate()`` (``transformers``: the time of ``max(steps, 16)`` new tokens minus the time of
  one, medians of 3; one torch thread on a CPU) and on a GPU ``generate(...,
  cache_implementation="static")`` (``transformers_compiled``: torch.compile with CUDA graphs;
  the median gap between tokens read by a synchronising streamer in a warmed call), and greedy
  tokens of each of our engines against transformers' (float32 on both sides, then the GPU's
  float16) as a second oracle.

It prints a table; ``--json PATH`` writes every number. The model file comes from ``--gguf``,
``$PAGEDKV_GGUF``, or the installed package.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from collections import defaultdict

import numpy as np

from .. import backend
from ..checks import cdiv
from ..kernels.pdl import programmatic_available
from ..model import llama as llama_mod
from ..model.blas import single_thread_blas
from ..model.engine import Engine
from ..config import SamplingParams
from ..model.runner import PDL_AUTO_ROWS

QUESTION = "What is the capital of France?"
IDENTITY_PROMPTS = [(QUESTION, True), (QUESTION, False),
                    ("Name three colours of the rainbow.", True),
                    ("Write one sentence about memory.", True)]
PARTS = ("matmul", "attention", "bookkeeping", "sampling", "other")
COLUMNS = ("pagedkv_plain", "pagedkv_eager", "pagedkv_graph", "transformers",
           "transformers_compiled", "floor")


def _now() -> float:
    backend.synchronize()
    return time.perf_counter()


# ---------------------------------------------------------------------- our engine

def _engine(model, prompt, batch: int, steps: int, block_size: int = 16,
            **options) -> Engine:
    blocks = batch * cdiv(len(prompt) + steps + 2, block_size)
    engine = Engine(model, num_blocks=blocks, block_size=block_size, max_seqs=max(64, batch),
                    **options)
    for _ in range(batch):                      # no stop token: every sequence decodes `steps`
        engine.submit(prompt, SamplingParams(max_new_tokens=steps + 1))
    engine.step()                               # admit, prefill, first decode step
    return engine


def tokens_per_second(model, prompt, batch: int, steps: int, repeat: int = 3,
                      **options) -> dict:
    """Decode-only throughput of the engine (the best of ``repeat`` runs, and their median);
    ``options`` go to the :class:`Engine` (``runner="fast"``, ...)."""
    rates = []
    for _ in range(repeat):
        engine = _engine(model, prompt, batch, steps, **options)
        t = _now()
        for _ in range(steps - 1):
            engine.step()
        rates.append(batch * (steps - 1) / (_now() - t))
        engine.run()
    return {"tokens_per_s": max(rates), "tokens_per_s_median": statistics.median(rates),
            "step_ms": 1e3 * batch / max(rates)}


class _Timer:
    """Wraps functions so that their time (device synchronised) adds up under a name."""

    def __init__(self):
        self.seconds = defaultdict(float)
        self.undo = []

    def wrap(self, owner, attr: str, part: str) -> None:
        fn = getattr(owner, attr)

        def timed(*args, **kwargs):
            t = _now()
            out = fn(*args, **kwargs)
            self.seconds[part] += _now() - t
            return out
        self.undo.append((owner, attr, owner.__dict__.get(attr)))
        setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, old in reversed(self.undo):
            if old is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)


def breakdown(model, prompt, batch: int, steps: int) -> dict:
    """Milliseconds per decode step in each part (see the module's docstring)."""
    engine = _engine(model, prompt, batch, steps)
    timer = _Timer()
    timer.wrap(model, "linear", "matmul")
    timer.wrap(engine.runner.kv, "write", "attention")
    timer.wrap(engine.runner.kv, "copy", "attention")
    timer.wrap(llama_mod, "attend", "attention")
    timer.wrap(engine.memory.manager, "reserve", "bookkeeping")
    timer.wrap(engine.memory.manager, "commit", "bookkeeping")
    timer.wrap(engine.runner, "_draw", "sampling")
    try:
        t = _now()
        for _ in range(steps - 1):
            engine.step()
        total = _now() - t
    finally:
        timer.restore()
    engine.run()
    n = steps - 1
    ms = {part: 1e3 * timer.seconds[part] / n for part in PARTS[:-1]}
    ms["other"] = 1e3 * total / n - sum(ms.values())
    ms["total"] = 1e3 * total / n
    return ms


def replay_ms(runner, bucket: int, rounds: int = 5, n: int = 100) -> float:
    """Device time of one replay of ``runner``'s graph for ``bucket``: CUDA events around
    ``n`` back-to-back replays, the median of ``rounds``."""
    cp = backend.xp
    graph, s = runner._graphs[bucket], runner.stream
    graph.launch(s)
    times = []
    for _ in range(rounds):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(s)
        for _ in range(n):
            graph.launch(s)
        end.record(s)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / n)
    return statistics.median(times)


def _decode_bucket(engine, batch: int):
    """The bucket a decode step of ``batch`` sequences replays, if its graph is captured (a
    short prefill replays a larger bucket's graph: not this one)."""
    runner = engine.runner
    if not getattr(runner, "graphs", False):
        return None
    b = runner._bucket(batch)
    return b if b in runner._graphs else None


def graph_replay_ms(engine, batch: int) -> float | None:
    """The replay time of the graph a decode step of ``batch`` sequences runs: the step
    without the engine's Python around it."""
    b = _decode_bucket(engine, batch)
    return None if b is None else replay_ms(engine.runner, b)


def graph_nodes(engine, batch: int) -> tuple:
    """The bucket of a decode step of ``batch`` sequences and its graph's node count (each
    node one kernel or copy the replay runs; None if it cannot be read)."""
    b = _decode_bucket(engine, batch)
    return b, None if b is None else engine.runner.graph_nodes(b)


def fast_tokens_per_second(model, prompt, batch: int, steps: int, repeat: int,
                           graphs: bool, max_context: int) -> dict:
    """:func:`tokens_per_second` on the fast runner, and the graph's own replay time."""
    fast = dict(runner="fast", max_context=max_context, bookkeeping="fast")
    r = tokens_per_second(model, prompt, batch, steps, repeat, **fast)
    if graphs:
        engine = _engine(model, prompt, batch, steps, **fast)
        engine.step()
        r["graph_replay_ms"] = graph_replay_ms(engine, batch)
        r["graph_bucket"], r["graph_nodes"] = graph_nodes(engine, batch)
        engine.run()
    return r


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy, counting bytes read plus written
    (the floor's ceiling; GPU only), the median of 10."""
    cp = backend.xp
    a = cp.ones(1 << 28, cp.float32)
    b = cp.empty_like(a)
    times = []
    for _ in range(11):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        b[...] = a
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3)
    return 2 * a.nbytes / statistics.median(times[1:])


def floor_ms(model, batch: int, context: int, bandwidth: float) -> float:
    """The least a decode step can take: every weight read once, and each sequence's K/V
    (``context`` tokens in every layer), at ``bandwidth`` bytes per second."""
    kv = batch * context * model.kv_spec().bytes_per_token
    return 1e3 * (model.weight_bytes + kv) / bandwidth


# ---------------------------------------------------------------------- transformers

def _hf_model(path, dtype_name: str):
    import torch
    from transformers import AutoModelForCausalLM
    device = "cuda" if backend.on_gpu else "cpu"
    dtype = getattr(torch, dtype_name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=dtype)
    return model.to(device).eval(), device


def hf_tokens_per_second(hf, device, prompt, batch: int, steps: int, eos: int) -> dict:
    import torch
    ids = torch.tensor([prompt] * batch, device=device)
    mask = torch.ones_like(ids)

    def run(n):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=eos)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t
    run(2)                                       # warm-up
    first = statistics.median(run(1) for _ in range(3))      # prefill + one token
    full = statistics.median(run(steps) for _ in range(3))   # prefill + `steps` tokens
    if full <= first:                            # too noisy to separate decode from prefill
        return {"tokens_per_s": float("nan"), "step_ms": float("nan")}
    rate = batch * (steps - 1) / (full - first)
    return {"tokens_per_s": rate, "step_ms": 1e3 * batch / rate}


def hf_compiled_step(hf, device, prompt, batch: int, steps: int, eos: int) -> dict:
    """transformers with its static cache (``cache_implementation="static"``: the generate
    loop compiled with torch.compile, CUDA graphs included): one call to compile, one to warm,
    then a call with a streamer that synchronises and reads the clock at every token; the step
    is the median gap between tokens after the first two (no recompilation lands inside it:
    every call has the same shapes)."""
    import torch
    ids = torch.tensor([prompt] * batch, device=device)
    mask = torch.ones_like(ids)

    class Clock:
        def __init__(self):
            self.times = []

        def put(self, value):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run(streamer=None):
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=steps, min_new_tokens=steps,
                        do_sample=False, pad_token_id=eos, cache_implementation="static",
                        streamer=streamer)
    run()
    run()
    clock = Clock()
    run(clock)
    gaps = np.diff(clock.times[1:])[2:]          # times[0]: the prompt, put before decoding
    step = float(np.median(gaps))
    return {"tokens_per_s": batch / step, "step_ms": 1e3 * step}


def hf_greedy(hf, device, prompt, n: int, eos: int) -> list:
    import torch
    ids = torch.tensor([prompt], device=device)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, eos_token_id=eos, pad_token_id=eos)
    toks = out[0, len(prompt):].tolist()
    return toks[:toks.index(eos) + 1] if eos in toks else toks


def ours_greedy(model, prompt, n: int, eos: int, runner: str = "plain") -> list:
    engine = Engine(model, num_blocks=cdiv(len(prompt) + n, 16), block_size=16,
                    stop_ids=[eos], runner=runner)
    (req,) = engine.generate([prompt], SamplingParams(max_new_tokens=n))
    return req.outputs()[0].generated


def identity(model, hf, device, tok, n: int, runners=("plain",)) -> list:
    """Greedy tokens of each of our ``runners`` against transformers', prompt by prompt."""
    rows = []
    for question, with_system in IDENTITY_PROMPTS:
        prompt = tok.chat(question) if with_system else tok.chat(question, system=None)
        b = hf_greedy(hf, device, prompt, n, tok.eos_id)
        for runner in runners:
            a = ours_greedy(model, prompt, n, tok.eos_id, runner)
            same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
            rows.append({"prompt": question, "system_prompt": with_system, "runner": runner,
                         "identical": a == b, "first_difference": same,
                         "ours": tok.decode(a), "transformers": tok.decode(b)})
    return rows


# ---------------------------------------------------------------------- main

def run(args) -> dict:
    from ..model import Llama, Tokenizer, load_gguf
    from ..model.gguf import model_path
    single_thread_blas()
    path = model_path(args.gguf)
    ckpt = load_gguf(path)
    tok = Tokenizer.from_checkpoint(ckpt)
    model = Llama(ckpt.config, ckpt.weights)
    prompt = tok.chat(QUESTION)
    batches = args.batches or ([1, 8, 64, 256] if backend.on_gpu else [1, 8])
    steps = args.steps or (8 if args.quick else 32)
    repeat = 1 if args.quick else 3
    max_context = args.max_context
    r = {"backend": backend.describe(), "dtype": str(model.dtype), "prompt_tokens": len(prompt),
         "steps": steps, "weight_bytes": model.weight_bytes,
         "kv_bytes_per_token": model.kv_spec().bytes_per_token, "max_context": max_context,
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "python": platform.python_version(), "numpy": np.__version__,
         "command": "python -m pagedkv.bench.model " + " ".join(args.argv),
         "engines": {"pagedkv_plain": "runner='plain', bookkeeping='teaching'",
                     "pagedkv_eager": "runner='fast-eager', bookkeeping='fast'",
                     "pagedkv_graph": "runner='fast', bookkeeping='fast'"},
         "programmatic_launch": {"available": programmatic_available(),
                                 "passes_of_rows_at_most": PDL_AUTO_ROWS},
         "pagedkv_plain": {}, "pagedkv_eager": {}, "pagedkv_graph": {}, "floor": {},
         "breakdown_ms": {}}
    print(f"model: SmolLM2-135M-Instruct, {model.dtype} on {backend.name}; prompt "
          f"{len(prompt)} tokens; {steps} decode steps", flush=True)
    if backend.on_gpu:
        r["copy_bytes_per_s"] = bandwidth = copy_bandwidth()
    for b in batches:
        if b <= 64 or not backend.on_gpu:        # the plain path: ~50 ms a step on a GPU
            r["pagedkv_plain"][b] = tokens_per_second(model, prompt, b, steps, repeat)
            r["breakdown_ms"][b] = breakdown(model, prompt, b, steps)
        r["pagedkv_eager"][b] = tokens_per_second(model, prompt, b, steps, repeat,
                                                  runner="fast-eager", max_context=max_context,
                                                  bookkeeping="fast")
        if backend.on_gpu:
            r["pagedkv_graph"][b] = fast_tokens_per_second(model, prompt, b, steps, repeat,
                                                           True, max_context)
            r["floor"][b] = {"step_ms": floor_ms(model, b, len(prompt) + steps, bandwidth)}
        print(f"  pagedkv batch {b:>3}: " + ", ".join(
            f"{k[8:]} {r[k][b]['step_ms']:.3f} ms" for k in
            ("pagedkv_plain", "pagedkv_eager", "pagedkv_graph") if b in r[k]), flush=True)
        if b in r["pagedkv_graph"]:
            g = r["pagedkv_graph"][b]
            print(f"    graph of bucket {g['graph_bucket']}: {g['graph_nodes']} nodes",
                  flush=True)
    try:
        import torch
        import transformers
    except ImportError as exc:
        r["transformers"] = f"not importable ({exc.__class__.__name__}: {exc})"
        return r
    hf_dtype = "float16" if backend.on_gpu else "float32"
    if not backend.on_gpu:                       # one thread, as for our NumPy path
        torch.set_num_threads(1)
    hf, device = _hf_model(path, hf_dtype)
    r["transformers_version"], r["transformers_dtype"] = transformers.__version__, hf_dtype
    r["transformers"], r["transformers_compiled"] = {}, {}
    for b in batches:
        r["transformers"][b] = hf_tokens_per_second(hf, device, prompt, b, max(steps, 16),
                                                    tok.eos_id)
        if backend.on_gpu and not args.no_compile:
            r["transformers_compiled"][b] = hf_compiled_step(hf, device, prompt, b, steps + 1,
                                                             tok.eos_id)
        print(f"  transformers batch {b:>3}: " + ", ".join(
            f"{k} {r[k][b]['step_ms']:.3f} ms" for k in ("transformers",
                                                         "transformers_compiled")
            if b in r[k]), flush=True)
    n = 12 if args.quick else 32
    runners = ("plain", "fast-eager", "fast") if backend.on_gpu else ("plain", "fast")
    if backend.on_gpu:                           # the GPU's own precision, for the record
        r["identity_float16"] = identity(model, hf, device, tok, n, runners)
        hf32, _ = _hf_model(path, "float32")
        del hf
        ours32 = Llama(ckpt.config, ckpt.weights, dtype=np.float32)
        r["identity_float32"] = identity(ours32, hf32, device, tok, n, runners)
    else:
        r["identity_float32"] = identity(model, hf, device, tok, n, runners)
    return r


def table(r: dict) -> str:
    lines = [f"SmolLM2-135M-Instruct on the paged cache: {r['dtype']} on "
             f"{r['backend']['backend']}" + (f" ({r['backend'].get('device')})"
                                            if "device" in r["backend"] else ""),
             f"decode step, milliseconds by part ({r['steps']} steps, prompt "
             f"{r['prompt_tokens']} tokens):",
             f"{'batch':>6} " + " ".join(f"{p:>12}" for p in PARTS + ("total",))]
    for b, ms in r["breakdown_ms"].items():
        lines.append(f"{b:>6} " + " ".join(f"{ms[p]:>12.2f}" for p in PARTS + ("total",)))
    columns = [k for k in COLUMNS if isinstance(r.get(k), dict) and r[k]]
    lines.append("decode step, milliseconds (tokens/s), prefill excluded:")
    lines.append(f"{'batch':>6} " + " ".join(f"{k:>24}" for k in columns))
    for b in sorted({b for k in columns for b in r[k]}, key=int):
        lines.append(f"{b:>6} " + " ".join(
            f"{r[k][b]['step_ms']:>11.3f} ({r[k][b].get('tokens_per_s', 0):>10.0f})"
            if b in r[k] else f"{'':>24}" for k in columns))
    for key in ("identity_float32", "identity_float16"):
        for row in r.get(key, []):
            what = "identical" if row["identical"] else \
                f"differ from token {row['first_difference']}"
            lines.append(f"greedy vs transformers ({key[9:]}, {row['runner']}, "
                         f"{'with' if row['system_prompt'] else 'no'} system prompt) "
                         f"{row['prompt']!r}: {what}")
    if not isinstance(r.get("transformers"), dict):
        lines.append(f"transformers: {r['transformers']}")
    lines.append(f"(weights {r['weight_bytes'] / 1e6:.0f} MB, KV {r['kv_bytes_per_token']:,} "
                 f"bytes a token; {r['date']}; Python {r['python']}, NumPy {r['numpy']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.model",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="8 steps, one repetition")
    p.add_argument("--steps", type=int, default=None, help="decode steps (default 32)")
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument("--gguf", metavar="PATH", help="the model file (default: $PAGEDKV_GGUF, "
                   "else the installed package's)")
    p.add_argument("--batches", type=int, nargs="+", default=None,
                   help="batch sizes (default 1 8 64 256 on a GPU, 1 8 on a CPU)")
    p.add_argument("--max-context", type=int, default=1024,
                   help="tokens a page table of the fast runner holds (default 1024)")
    p.add_argument("--no-compile", action="store_true",
                   help="skip transformers' compiled static-cache run (tens of seconds)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 2:
        p.error("--steps must be at least 2")
    args.argv = argv
    r = run(args)
    print(table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
