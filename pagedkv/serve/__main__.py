"""``python -m pagedkv.serve``: load the model, start the engine loop, serve HTTP."""
from __future__ import annotations

import argparse
import logging
import sys

from ..errors import PagedKVError

log = logging.getLogger("pagedkv.serve")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedkv.serve",
                                description="An OpenAI-compatible server on pagedkv's engine")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, default=256, metavar="N",
                   help="blocks in the KV pool (default 256)")
    p.add_argument("--block-size", type=int, default=16, metavar="B")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep full blocks cached by their tokens after their request ends")
    p.add_argument("--max-seqs", type=int, default=32, help="sequences decoding at once")
    p.add_argument("--max-waiting", type=int, default=64,
                   help="requests waiting for admission before new ones get 429")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="smollm2 (the GGUF file) or tiny (a random two-layer Llama, for "
                        "tests)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="the model file (default: $PAGEDKV_GGUF, else the installed one)")
    p.add_argument("--runner", default="plain", choices=["plain", "fast"],
                   help="plain: chapter 10's forward pass; fast: fused kernels, static "
                        "buffers and CUDA graphs on a GPU (chapter 14), on pagedkv.fast's "
                        "bookkeeping")
    p.add_argument("--audit", action="store_true",
                   help="check the pool's invariants after every engine step")
    p.add_argument("--log-level", default="info")
    return p


def build(args):
    """The model, the engine and its started loop, the application."""
    from ..model.blas import single_thread_blas
    from ..model.generate import Engine
    from .app import create_app
    from .loop import EngineLoop
    from .models import load

    single_thread_blas()
    served = load(args.model, args.gguf)
    engine = Engine(served.model, num_blocks=args.num_blocks, block_size=args.block_size,
                    max_seqs=args.max_seqs, stop_ids=[served.tokenizer.eos_id],
                    prefix_caching=args.prefix_caching, audit=args.audit,
                    runner=args.runner,
                    bookkeeping="fast" if args.runner == "fast" else "teaching")
    loop = EngineLoop(engine, served.tokenizer, max_waiting=args.max_waiting).start()
    return served, loop, create_app(loop, served)


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    for name in ("num_blocks", "block_size", "max_seqs"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be at least 1, got "
                  f"{getattr(args, name)}", file=sys.stderr)
            return 2
    if args.max_waiting < 1:
        print(f"error: --max-waiting must be at least 1, got {args.max_waiting}",
              file=sys.stderr)
        return 2
    import uvicorn
    try:
        served, loop, app = build(args)
    except PagedKVError as exc:      # a missing model file names the set-up command
        print(f"error: {exc}", file=sys.stderr)
        return 1
    log.info("%s on %s blocks of %s tokens%s", served.name, args.num_blocks, args.block_size,
             ", prefix caching" if args.prefix_caching else "")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=3, access_log=False)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            # Ctrl-C (SIGINT) or SIGTERM: uvicorn stops accepting and waits for the open
            # responses; the loop ends the running requests now, so that they close
            loop.request_stop()
            super().handle_exit(sig, frame)

    try:
        Server(config).run()
    except KeyboardInterrupt:            # uvicorn raises the signal again once it has
        pass                             # shut down: that is the clean end here
    finally:
        loop.stop()
    log.info("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
