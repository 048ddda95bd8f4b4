"""Speculative decoding, measured: ``python -m pagedkv.bench.speculate [--quick]``.

SmolLM2-135M-Instruct answers ``batch`` prompts of one workload, greedily, three times over
in the same run on the same engine settings, but for speculation:

* ``off`` — no guesses (``speculate=None``);
* ``on`` — every decoding sequence guesses, whatever the batch
  (``Speculation(max_batch=max_seqs)``): what speculation costs where it loses;
* ``default`` — the engine's default (``Speculation()``): no guesses in a step of more than
  ``max_batch`` sequences.

The workloads: ``random`` (random token ids, no chat template, the end token ignored:
lookup has nothing to find in the prompt), ``repeat`` (asked to repeat a short text word
for word), ``reformat`` (asked to rewrite it as a list), ``quote`` (asked a question
whose answer is a sentence of it) and ``chat`` (questions with no text to copy). Each
batch cycles through eight texts, or questions. Every answer ends at the end token or at
``--new-tokens``.

For each workload, batch and mode: the wall time from submitting the batch until its last
answer (its prefill included, the same in every mode), the output tokens and their rate,
the engine's steps, tokens per sequence-step (a sequence's new tokens per step it decodes
in: 1 without speculation, up to k + 1 with it), guesses made and the share accepted, and
whether every answer equals the ``off`` answer (greedy: it must, but for a near-tie that a
float16 pass of another shape breaks otherwise). Each measurement is the median of
``--repeat`` runs, the three modes taking turns, after ``--warmup`` untimed runs of each. The default's threshold is checked at the
end: the largest batch at which ``on`` is not slower than ``off`` on each workload.

On a GPU the fast runner replays CUDA graphs (all captured before the timing) with the
device running ahead of the host; on a CPU the plain runner, NumPy float32. The JSON has the
date and the card. ``--quick``: batch 1 and 8, 16 new tokens, one run (a few minutes on two
CPU cores).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time

import numpy as np

from .. import backend
from ..checks import cdiv
from ..config import SamplingParams, Speculation
from ..model.blas import single_thread_blas
from ..model.engine import Engine

MODES = ("off", "on", "default")

#: Short texts about the book's subject, for the workloads that copy from their prompt.
TEXTS = [
    "A paged KV cache cuts GPU memory into blocks of sixteen tokens. Each sequence keeps a "
    "page table that maps its token positions to blocks, so it grows one block at a time.",
    "When a sequence ends, every block it held goes back to the free list at once. No "
    "block is ever moved, and no sequence needs its memory to be contiguous.",
    "Beam search forks a sequence into several beams. The beams share their blocks, and a "
    "shared block is copied only when one of them writes into it.",
    "A prefix cache names every full block by a hash of its tokens. A new prompt that "
    "begins the same way finds those blocks and skips their computation.",
    "When the pool runs out, the scheduler preempts the newest request. Its blocks are "
    "either copied to host memory or dropped and computed again later.",
    "The scheduler gives each step a budget of tokens. Decoding sequences come first, and "
    "what is left goes to chunks of the prompts that are waiting.",
    "A CUDA graph records every kernel of a decode step once. Replaying it launches them "
    "all with one call, which is what a small model needs at small batch.",
    "Speculative decoding guesses the next tokens and checks them in one pass. The "
    "guesses the model agrees with are kept, and the rest are rolled back.",
]
QUESTIONS = [
    "What is the capital of France?", "Name three colours of the rainbow.",
    "Write one sentence about memory.", "Why is the sky blue?",
    "Give me a tip for learning to cook.", "What does a librarian do?",
    "Describe a cat in two sentences.", "How many legs does a spider have?",
]


def workloads(tok, rng, vocab: int) -> dict:
    """Each workload's eight prompts (token ids) and whether its answers ignore the end
    token."""
    def chat(template):
        return [tok.chat(template.format(text=t)) for t in TEXTS]
    return {
        "random": ([rng.integers(0, vocab, 96).tolist() for _ in range(8)], True),
        "repeat": (chat("Repeat the following text exactly, word for word.\n\n{text}"),
                   False),
        "reformat": (chat("Rewrite the following text as a bulleted list, one sentence "
                          "per bullet.\n\n{text}"), False),
        "quote": (chat("{text}\n\nQuote the first sentence of the text above."), False),
        "chat": ([tok.chat(q) for q in QUESTIONS], False),
    }


def _now() -> float:
    backend.synchronize()
    return time.perf_counter()


def engines(model, batch: int, longest: int, new: int, stop_ids, runner: str,
            k: int | None = None) -> dict:
    """One engine per mode, for batches of ``batch`` prompts of at most ``longest`` tokens:
    the same pool and settings but for ``speculate`` (``k`` guesses a row in ``on`` and
    ``default``; None: the default's). Up to ``k + 1`` rows a sequence fit (at most 512
    rows), so that ``on`` can guess at a full batch, and at least ``longest``, so that a
    lone prompt's prefill replays a decode graph (a row a token) as it does in a server
    with 256 rows, not the eager pass; on a GPU every graph is captured now, outside the
    timings."""
    k = k or Speculation().k
    max_seqs = min(max(batch * (k + 1), 8, longest), max(512, batch))
    blocks = batch * cdiv(longest + new + k + 2, 16) + 16
    fast = runner != "plain"
    common = dict(num_blocks=blocks, block_size=16, max_seqs=max_seqs, stop_ids=stop_ids,
                  runner=runner, bookkeeping="fast" if fast else "teaching",
                  max_context=longest + new + k + 2 if fast else None)
    specs = {"off": None, "on": Speculation(k, max_batch=max_seqs), "default": Speculation(k)}
    out = {}
    for mode, spec in specs.items():
        engine = Engine(model, speculate=spec, **common)
        engine.runner.capture_all()
        out[mode] = engine
    return out


def one_run(engine, prompts, params) -> dict:
    """Submit the prompts, run them to the end: the numbers of the module's text."""
    c, plans = engine.memory.counts, engine.scheduler.plans
    drafted, accepted = c.drafted, c.accepted
    t = _now()
    reqs = [engine.submit(p, params) for p in prompts]
    engine.step()
    first = _now() - t
    engine.run()
    seconds = _now() - t
    answers = [r.outputs()[0].generated for r in reqs]
    tokens = sum(map(len, answers))
    steps = engine.scheduler.plans - plans
    seq_steps = sum(h["decoded"] for h in list(engine.history)[-steps:])
    made = c.drafted - drafted
    return {"seconds": seconds, "first_step_s": first, "output_tokens": tokens,
            "tokens_per_s": tokens / seconds, "steps": steps,
            "tokens_per_seq_step": tokens / max(seq_steps, 1), "drafted": made,
            "accepted": c.accepted - accepted,
            "acceptance": (c.accepted - accepted) / made if made else None,
            "answers": answers}


def measure(engs: dict, prompts, params, repeat: int, warmup: int = 1) -> dict:
    """Each mode ``warmup`` times untimed (a workload's first run pays for what its shapes
    need the first time: on an H100 a mode run first was up to 1.6 times slower than the
    same work run after it), then ``repeat`` times, the modes taking turns; the median run
    of each (by tokens/s), and whether its answers are the ``off`` answers."""
    for _ in range(warmup):
        for mode in engs:
            one_run(engs[mode], prompts, params)
    runs = {mode: [] for mode in engs}
    for i in range(repeat):
        order = list(engs)[i % len(engs):] + list(engs)[:i % len(engs)]
        for mode in order:
            runs[mode].append(one_run(engs[mode], prompts, params))
    out = {}
    for mode, rs in runs.items():
        rs.sort(key=lambda r: r["tokens_per_s"])
        out[mode] = dict(rs[len(rs) // 2])
        out[mode]["tokens_per_s_all"] = [round(r["tokens_per_s"], 2) for r in rs]
    want = out["off"]["answers"]
    for mode in out:
        got = out[mode].pop("answers")
        out[mode]["identical"] = sum(a == b for a, b in zip(got, want)) / len(want)
    for mode in out:
        out[mode]["speedup"] = out[mode]["tokens_per_s"] / out["off"]["tokens_per_s"]
    return out


def threshold(results: dict) -> dict:
    """Per workload: the largest batch at which ``on`` was not slower than ``off`` (None:
    it was slower at every batch)."""
    out = {}
    for name, by_batch in results.items():
        wins = [int(b) for b, r in by_batch.items() if r["on"]["speedup"] >= 1.0]
        out[name] = max(wins) if wins else None
    return out


def run(args, model=None, tok=None, save=None) -> dict:
    """Every workload at every batch; ``model`` and ``tok`` default to SmolLM2's;
    ``save(results)`` is called after each batch (a run cut short keeps what it did)."""
    single_thread_blas()
    if model is None:
        from ..model import Llama, Tokenizer, load_gguf
        ckpt = load_gguf(args.gguf)
        tok = Tokenizer.from_checkpoint(ckpt)
        model = Llama(ckpt.config, ckpt.weights)
    rng = np.random.default_rng(args.seed)
    loads = workloads(tok, rng, model.config.vocab_size)
    if args.workloads:
        loads = {k: v for k, v in loads.items() if k in args.workloads}
    batches = args.batches or ([1, 8] if args.quick or not backend.on_gpu
                               else [1, 8, 64, 256])
    new = args.new_tokens or (16 if args.quick else 128)
    repeat = args.repeat or (1 if args.quick else 3)
    if args.warmup is None:
        args.warmup = 0 if args.quick else 1
    runner = args.runner or ("fast" if backend.on_gpu else "plain")
    longest = max(len(p) for prompts, _ in loads.values() for p in prompts)
    r = {"backend": backend.describe(), "date": datetime.datetime.now().isoformat(
             timespec="seconds"), "dtype": str(model.dtype), "runner": runner,
         "new_tokens": new, "repeat": repeat, "warmup": args.warmup, "seed": args.seed,
         "default": vars(Speculation(args.k) if args.k else Speculation()),
         "python": platform.python_version(),
         "numpy": np.__version__, "command": "python -m pagedkv.bench.speculate " +
         " ".join(args.argv), "results": {}}
    if not backend.on_gpu:
        from . import cpu_name
        r["cpu"] = cpu_name()
    print(f"{model.dtype} on {backend.name}, runner {runner!r}; {new} new tokens; "
          f"median of {repeat} after {args.warmup} untimed", flush=True)
    for b in batches:
        engs = engines(model, b, longest, new, (tok.eos_id,), runner, args.k)
        for name, (prompts, ignore_eos) in loads.items():
            params = SamplingParams(max_new_tokens=new, ignore_eos=ignore_eos)
            batch = [prompts[i % len(prompts)] for i in range(b)]
            got = measure(engs, batch, params, repeat, args.warmup)
            r["results"].setdefault(name, {})[b] = got
            print(line(name, b, got), flush=True)
        del engs
        r["on_wins_up_to_batch"] = threshold(r["results"])
        if save is not None:
            save(r)
    return r


def line(name: str, batch: int, got: dict) -> str:
    parts = []
    for mode in MODES:
        g = got[mode]
        acc = "" if g["acceptance"] is None else f", {g['acceptance']:.0%} acc"
        parts.append(f"{mode} {g['tokens_per_s']:8.1f} tok/s ({g['speedup']:.2f}x, "
                     f"{g['tokens_per_seq_step']:.2f}/step{acc})")
    same = min(got[m]["identical"] for m in MODES)
    return f"{name:>8} batch {batch:>3}: " + "; ".join(parts) + f"; same answers {same:.0%}"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.speculate",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="batch 1 and 8, 16 tokens, 1 run")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--workloads", type=lambda s: s.split(","))
    p.add_argument("--new-tokens", type=int)
    p.add_argument("--repeat", type=int)
    p.add_argument("--warmup", type=int,
                   help="untimed runs of each mode first (default 1; 0 with --quick)")
    p.add_argument("--runner", choices=("plain", "fast", "fast-eager"))
    p.add_argument("--seed", type=int, default=40)
    p.add_argument("--k", type=int, help="guesses a row in on and default (default: "
                   "Speculation's)")
    p.add_argument("--gguf")
    p.add_argument("--json", help="write every number to this file")
    args = p.parse_args(argv)
    args.argv = list(argv)
    def save(r):
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    r = run(args, save=save if args.json else None)
    print("on wins up to batch:", r["on_wins_up_to_batch"])
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
