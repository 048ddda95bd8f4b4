"""Generate text with SmolLM2-135M-Instruct on the paged KV cache.

    python -m pagedkv.generate "What is the capital of France?"
    python -m pagedkv.generate "Name a colour." --n 4 --temperature 0.8 --seed 1
    python -m pagedkv.generate "Write a haiku about memory." --beam 4

Each prompt is wrapped in the model's chat template (``--raw`` feeds it as it is). The answers
are printed, then what the cache did: blocks used, shared and copied. Bad input is one line on
stderr and exit status 2; a missing model file is one line naming the set-up command, status 1.
"""
from __future__ import annotations

import argparse
import sys
import time

from .errors import ConfigError, PagedKVError

MAX_CONTEXT = 8192  # SmolLM2-135M-Instruct's context (checked again against the file's value)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage block
        raise _BadInput(message)


class _BadInput(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m pagedkv.generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="+", help="one or more prompts (several run as one batch)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--beam", type=int, default=1, metavar="K", help="beam search of width K")
    p.add_argument("--n", type=int, default=1, help="N samples per prompt (needs --temperature)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--system", default=None, help="the system prompt (default: the model's)")
    p.add_argument("--no-system", action="store_true", help="leave the system turn out")
    p.add_argument("--raw", action="store_true", help="no chat template: feed the prompt as is")
    p.add_argument("--block-size", type=int, default=16, metavar="B")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="the model file (default: $PAGEDKV_GGUF, else the installed one)")
    return p


def _params(args):
    from .model.requests import SamplingParams
    for prompt in args.prompt:
        if not prompt.strip():
            raise _BadInput("the prompt is empty")
    if args.beam < 1:
        raise _BadInput(f"--beam must be at least 1, got {args.beam}")
    if args.n < 1:
        raise _BadInput(f"--n must be at least 1, got {args.n}")
    if args.block_size < 1:
        raise _BadInput(f"--block-size must be at least 1, got {args.block_size}")
    if args.max_new_tokens >= MAX_CONTEXT:
        raise _BadInput(f"--max-new-tokens {args.max_new_tokens} leaves no room for the prompt "
                        f"in the {MAX_CONTEXT}-token context")
    try:
        return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_p=args.top_p, n=args.n, beam_width=args.beam, seed=args.seed)
    except ConfigError as exc:
        raise _BadInput(str(exc).replace("beam_width", "--beam").replace(
            "max_new_tokens", "--max-new-tokens").replace("top_p", "--top-p").replace(
            "n = ", "--n ").replace("a temperature", "--temperature")) from None


def run(args, out=sys.stdout) -> int:
    from . import backend
    from .checks import cdiv
    from .model import Llama, Tokenizer, load_gguf
    from .model.blas import single_thread_blas
    from .model.engine import Engine
    from .model.tokenizer import DEFAULT_SYSTEM

    params = _params(args)
    single_thread_blas()
    ckpt = load_gguf(args.gguf)
    tok = Tokenizer.from_checkpoint(ckpt)
    system = None if args.no_system else (args.system or DEFAULT_SYSTEM)
    prompts = [tok.encode(p) if args.raw else tok.chat(p, system) for p in args.prompt]
    context = ckpt.config.context
    for p in prompts:
        if len(p) + params.max_new_tokens > context:
            raise _BadInput(f"{len(p)} prompt tokens + {params.max_new_tokens} new ones exceed "
                            f"the model's context of {context} tokens")
    model = Llama(ckpt.config, ckpt.weights)
    del ckpt
    blocks = sum(params.width * cdiv(len(p) + params.max_new_tokens, args.block_size)
                 for p in prompts)
    engine = Engine(model, num_blocks=blocks, block_size=args.block_size,
                    max_seqs=max(64, params.width * len(prompts)), stop_ids=[tok.eos_id])
    t0 = time.perf_counter()
    reqs = [engine.submit(p, params) for p in prompts]
    engine.run()
    seconds = time.perf_counter() - t0
    for i, req in enumerate(reqs):
        if len(reqs) > 1:
            print(f"[{i + 1}] {args.prompt[i]}", file=out)
        for j, seq in enumerate(req.outputs()):
            text = tok.decode(seq.generated).strip()
            label = ""
            if params.beam_width > 1:
                label = f"beam {j + 1} (log-prob {seq.score:.2f}): "
            elif params.n > 1:
                label = f"sample {j + 1}: "
            print(label + text, file=out)
    h = engine.history
    new_tokens = sum(len(s.generated) for r in reqs for s in r.finished)
    info = model.kv_spec()
    print(f"-- cache: {args.block_size} tokens a block, {info.bytes_per_token:,} bytes a token "
          f"({info.dtype}); blocks used at most {max(x['used_blocks'] for x in h)} of "
          f"{blocks}, shared at most {max(x['shared_blocks'] for x in h)}, "
          f"copy-on-write copies {engine.runner.kv.copies_done}; "
          f"{new_tokens} tokens in {seconds:.1f} s on {backend.name}", file=out)
    return 0


def main(argv=None) -> int:
    try:
        return run(_parser().parse_args(argv))
    except _BadInput as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except PagedKVError as exc:  # a missing model file names the set-up command
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
