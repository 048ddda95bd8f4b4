"""``python -m pagedkv.serve``: load the model, start the engine loop, serve HTTP.

The defaults are the fast engine on a GPU (chapter 12's runner with a CUDA graph per batch
bucket, every graph captured before the first request, the token budget and chunked
prefill of chapter 13) and the plain one on a CPU. The process exits with status 0 after
Ctrl-C or SIGTERM (the loop stopped, open streams ended), and with status 1 if the engine
dies, so that a supervisor can start it again.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import PagedKVError

log = logging.getLogger("pagedkv.serve")

from .start import GPU_TOKENS_PER_SEQ


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pagedkv.serve",
                                description="An OpenAI-compatible server on pagedkv's engine")
    p.add_argument("--host", default="127.0.0.1",
                   help="the address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--num-blocks", type=int, default=0, metavar="N",
                   help="blocks in the KV pool (default: 256 on a CPU; on a GPU, "
                        f"{GPU_TOKENS_PER_SEQ} tokens for each of --max-seqs sequences, at "
                        "most half the free device memory)")
    p.add_argument("--block-size", type=int, default=16, metavar="B")
    p.add_argument("--prefix-caching", action="store_true",
                   help="keep full blocks cached by their tokens after their request ends")
    p.add_argument("--max-seqs", type=int, default=0,
                   help="sequences decoding at once (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests waiting for admission before new ones get 429")
    p.add_argument("--token-budget", type=int, default=2048, metavar="TOKENS",
                   help="tokens one engine step computes at most, decodes first (default "
                        "2048; 0: no budget, every admitted prompt prefilled at once)")
    p.add_argument("--no-chunked-prefill", action="store_true",
                   help="admit a prompt only when all of it fits the step's budget")
    p.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"],
                   help="smollm2 (the GGUF file) or tiny (a random two-layer Llama, for "
                        "tests)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="the model file (default: $PAGEDKV_GGUF, else the installed one)")
    p.add_argument("--runner", default="auto", choices=["auto", "plain", "fast"],
                   help="auto (default): fast on a GPU, plain on a CPU; plain: chapter 10's "
                        "forward pass; fast: fused kernels, static buffers and CUDA graphs "
                        "on a GPU (chapter 12), on pagedkv.fast's bookkeeping")
    p.add_argument("--engine", default="process", choices=["process", "thread"],
                   help="where the engine runs: a process of its own (default: the HTTP "
                        "layer never waits for it) or a thread of the server's (chapter "
                        "13's loop, as it teaches it)")
    p.add_argument("--audit", action="store_true",
                   help="check the pool's invariants after every engine step and in "
                        "GET /pool")
    p.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES",
                   help="the largest request body accepted (default 1 MiB; 413 beyond)")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send a request's head, and its body")
    p.add_argument("--max-connections", type=int, default=1000,
                   help="open connections at most (more are closed at once)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (http://host:port) whose pages may call this server "
                        "(repeatable; '*' allows any origin and any Host header)")
    p.add_argument("--log-level", default="info")
    return p


def _check(args) -> str | None:
    """What is wrong with the command line, or None."""
    for name in ("block_size", "max_waiting", "max_body", "max_connections"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    for name in ("num_blocks", "max_seqs", "token_budget"):
        if getattr(args, name) < 0:
            return (f"--{name.replace('_', '-')} must be at least 1 (or 0 for the default), "
                    f"got {getattr(args, name)}")
    if not args.read_timeout > 0:
        return f"--read-timeout must be a positive number of seconds, got {args.read_timeout}"
    for origin in args.allow_origin:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            return f"--allow-origin takes http://host:port (or '*'), got {origin!r}"
    return None


def build(args):
    """The tokenizer's side of the model, the started engine loop, the application."""
    from .app import create_app
    from .engine_process import EngineProcess
    from .limits import Limits
    from .loop import EngineLoop
    from .models import load
    from .start import engine_options, make_engine

    options = engine_options(args)
    if args.engine == "thread":
        engine, info = make_engine(options)
        served = load(args.model, args.gguf, model=False)
        loop = EngineLoop(engine, served.tokenizer, max_waiting=args.max_waiting).start()
    else:
        served = load(args.model, args.gguf, model=False)
        loop = EngineProcess(make_engine, options, served.tokenizer,
                             max_waiting=args.max_waiting,
                             log_level=args.log_level.upper()).start()
        info = loop.info
    limits = Limits(max_body=args.max_body, read_timeout=args.read_timeout,
                    max_connections=args.max_connections, host=args.host,
                    allow_origins=frozenset(args.allow_origin))
    log.info("%s on %d blocks of %d tokens, %s runner, up to %d sequences, token budget "
             "%s%s; the engine in a %s", served.name, info["blocks"], args.block_size,
             info["runner"], info["max_seqs"], args.token_budget or "none",
             ", prefix caching" if args.prefix_caching else "", args.engine)
    return served, loop, create_app(loop, served, limits, audit=args.audit), limits


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s: %(message)s")
    problem = _check(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    import uvicorn
    from .limits import protocol_class, raise_open_files_limit
    try:
        served, loop, app, limits = build(args)
    except (PagedKVError, RuntimeError) as exc:   # a missing model file names the set-up
        print(f"error: {exc}", file=sys.stderr)    # command; a failed engine says why
        return 1
    files = raise_open_files_limit()
    if files < args.max_connections + 64:
        log.warning("this process may open %d files: fewer than --max-connections %d "
                    "needs", files, args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=3, access_log=False,
                            http=protocol_class(limits), lifespan="off")

    class Server(uvicorn.Server):
        exit_code = 0

        def handle_exit(self, sig, frame):
            # Ctrl-C (SIGINT) or SIGTERM: uvicorn stops accepting and waits for the open
            # responses; the loop ends the running requests now, so that they close. The
            # signal is not raised again afterwards: a stop asked for is a clean exit.
            loop.request_stop()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    server = Server(config)

    def dead(reason):                    # on the engine's thread: stop serving, exit 1
        server.exit_code = 1
        server.should_exit = True
    loop.on_dead = dead
    try:
        server.run()
    finally:
        loop.stop()
    if server.exit_code:
        log.error("stopped: the engine died (%s)", loop.dead)
    else:
        log.info("stopped")
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
