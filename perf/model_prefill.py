"""The whole model's prefill of one long prompt, ours beside transformers, in one process.

    python perf/model_prefill.py --tokens 4096 --json OUT.json     # on a GPU (PAGEDKV_GGUF)
    python perf/model_prefill.py --tokens 64 --reps 2 --no-hf      # a CPU check of the script

Ours: ``Engine(runner="fast", bookkeeping="fast")`` with ``prefill_chunk`` = the prompt, so
the prompt is one eager pass with the paged prefill kernel; one ``step()`` submits nothing
new, prefills the prompt and chooses its first token (``max_new_tokens=1``). Timed from
``submit`` to the end of that step, the device synchronised: what a user waits for, the
engine's bookkeeping included. transformers: the GGUF loaded as ``bench.model`` loads it
(float16, sdpa attention), one forward over the prompt with ``logits_to_keep=1``, eager, and
compiled with ``torch.compile`` when that holds. Medians over ``--reps``, after a warm-up.
The prompt: ``--tokens`` token ids drawn with a fixed seed. Both first tokens are printed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from pagedkv import backend  # noqa: E402
from pagedkv.checks import cdiv  # noqa: E402
from pagedkv.model import Llama, load_gguf  # noqa: E402
from pagedkv.model.engine import Engine  # noqa: E402
from pagedkv.model.gguf import model_path  # noqa: E402
from pagedkv.model.requests import SamplingParams  # noqa: E402


def now() -> float:
    backend.synchronize()
    return time.perf_counter()


def ours(model, prompt, reps: int) -> tuple[list, int]:
    engine = Engine(model, num_blocks=cdiv(len(prompt) + 2, 16) + 8, runner="fast",
                    bookkeeping="fast", max_seqs=8, prefill_chunk=len(prompt),
                    token_budget=len(prompt) + 8)
    times, first = [], None
    for _ in range(reps + 1):                  # the first is the warm-up
        t = now()
        req = engine.submit(prompt, SamplingParams(max_new_tokens=1))
        while not req.done:
            engine.step()
        times.append(now() - t)
        first = req.outputs()[0].generated[0]
    return times[1:], first


def hf_times(hf, ids, reps: int) -> tuple[list, int]:
    import torch
    times, first = [], None
    with torch.no_grad():
        for _ in range(reps + 1):
            t = now()
            out = hf(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize() if ids.is_cuda else None
            times.append(now() - t)
            first = int(out.logits[0, -1].argmax())
    return times[1:], first


def summary(name, times, n, first):
    ms = 1e3 * statistics.median(times)
    print(f"{name:24s} {ms:9.2f} ms  {n / ms * 1e3:12,.0f} tokens/s  first token {first}",
          flush=True)
    return {"ms_median": ms, "ms_all": [1e3 * t for t in times],
            "tokens_per_s": n / ms * 1e3, "first_token": first}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gguf")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    path = model_path(args.gguf)
    ckpt = load_gguf(path)
    model = Llama(ckpt.config, ckpt.weights)
    rng = np.random.default_rng(args.seed)
    prompt = rng.integers(0, ckpt.config.vocab_size, args.tokens).tolist()
    print(f"seed={args.seed}; a prompt of {args.tokens} token ids; {model.dtype} on "
          f"{backend.name}", flush=True)
    r = {"command": "python perf/model_prefill.py " + " ".join(sys.argv[1:]),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "backend": backend.describe(), "python": platform.python_version(),
         "dtype": str(model.dtype), "tokens": args.tokens, "seed": args.seed}
    times, first = ours(model, prompt, args.reps)
    r["pagedkv"] = summary("pagedkv (fast engine)", times, args.tokens, first)
    if not args.no_hf:
        import torch
        from pagedkv.bench.model import _hf_model
        hf, device = _hf_model(path, str(model.dtype))
        ids = torch.tensor([prompt], device=device)
        r["transformers_version"] = __import__("transformers").__version__
        times, first = hf_times(hf, ids, args.reps)
        r["transformers_eager"] = summary("transformers eager sdpa", times, args.tokens, first)
        if not args.no_compile and backend.on_gpu:
            try:
                t = time.perf_counter()
                compiled = torch.compile(hf)
                times, first = hf_times(compiled, ids, args.reps)
                r["transformers_compiled"] = summary("transformers compiled", times,
                                                     args.tokens, first)
                r["transformers_compiled"]["compile_and_run_s"] = time.perf_counter() - t
            except Exception as exc:                     # "compiled if it holds"
                r["transformers_compiled"] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
                print("transformers compiled: failed:", r["transformers_compiled"]["error"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
