"""``python -m pagedkv.serve``: load the model, start the engine, serve HTTP.

The defaults are the fast engine on a GPU (chapter 12's runner with a CUDA graph per batch
bucket, every graph captured before the first request, the token budget and chunked
prefill of chapter 13) and the plain one on a CPU. The process exits with status 0 after
Ctrl-C or SIGTERM (open requests ended, the engine stopped, within --shutdown-timeout),
and with status 1 if the engine dies, so that a supervisor can start it again.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from ..errors import PagedKVError
from .start import GPU_TOKENS_PER_SEQ

log = logging.getLogger("pagedkv.serve")


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
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "int8"],
                   help="the K/V cache's numbers: auto (default: the model's dtype) or "
                        "int8 (a float16 scale per 32 numbers: about half the bytes a "
                        "token, so the pool holds about twice the tokens; chapter 13)")
    p.add_argument("--speculate", type=int, default=0, metavar="K",
                   help="speculative decoding by prompt lookup: a sequence guesses up to "
                        "K tokens a step and the step's pass verifies them (default 0: "
                        "off; it pays off where answers repeat their prompt, at small "
                        "batches; chapter 17)")
    p.add_argument("--max-seqs", type=int, default=0,
                   help="sequences decoding at once (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--max-waiting", type=int, default=512,
                   help="requests waiting for admission before new ones get 429, and "
                        "for the engine to answer them before new ones get 503")
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
                   help="where the engine's core runs: a process of its own (default) or "
                        "a thread of the server's; either way the HTTP layer never waits "
                        "for it")
    p.add_argument("--audit", action="store_true",
                   help="check the pool's invariants after every engine step and in "
                        "GET /pool")
    p.add_argument("--stall-timeout", type=float, default=30.0, metavar="S",
                   help="seconds the engine may go without a word (a step, or an idle "
                        "beat) before it counts as stalled: /health says 503, requests in "
                        "flight get a 503 error, new ones are refused until it speaks "
                        "again (default 30)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens of a choice per streamed event (its first text and its "
                        "end are sent at once; default 1)")
    p.add_argument("--shutdown-timeout", type=float, default=5.0, metavar="S",
                   help="seconds a stop (Ctrl-C, SIGTERM) may take: open requests end at "
                        "once with a 503; an engine process that has not stopped by then "
                        "is killed (default 5)")
    p.add_argument("--max-body", type=int, default=1 << 20, metavar="BYTES",
                   help="the largest request body accepted (default 1 MiB; 413 beyond)")
    p.add_argument("--read-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a client has to send a request's head (after it connects, "
                        "or after its last answer), and its body")
    p.add_argument("--max-connections", type=int, default=1000,
                   help="open connections at most (a request beyond is answered 503)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="a name clients use for this server in the Host header, besides "
                        "the address it is bound to (repeatable; '*.example.com' for a "
                        "domain; '*' any: then a page on any site can reach it through a "
                        "DNS name rebound to its address)")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin (http://host:port) whose pages may call this server "
                        "(CORS; repeatable; '*' any origin)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDKV_API_KEY"), metavar="KEY",
                   help="requests need 'Authorization: Bearer KEY' (401 otherwise), but for "
                        "the chat page's files, /health and /metrics (default: "
                        "$PAGEDKV_API_KEY, else no key)")
    p.add_argument("--api-key-for-probes", action="store_true",
                   help="with --api-key, /health and /metrics need the key too")
    p.add_argument("--log-level", default="info")
    return p


def _check(args) -> str | None:
    """What is wrong with the command line, or None."""
    for name in ("block_size", "max_waiting", "max_body", "max_connections",
                 "stream_interval"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    for name in ("num_blocks", "max_seqs", "token_budget", "speculate"):
        if getattr(args, name) < 0:
            return (f"--{name.replace('_', '-')} must be at least 1 (or 0 for the default), "
                    f"got {getattr(args, name)}")
    for name in ("read_timeout", "stall_timeout", "shutdown_timeout"):
        if not getattr(args, name) > 0:
            return (f"--{name.replace('_', '-')} must be a positive number of seconds, got "
                    f"{getattr(args, name)}")
    for origin in args.allow_origin:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            return f"--allow-origin takes http://host:port (or '*'), got {origin!r}"
    for name in args.allowed_host:
        if name != "*" and ("*" in name[1:] or name.startswith("*") and
                            not name.startswith("*.")):
            return f"--allowed-host takes a name, '*.example.com' or '*', got {name!r}"
    if args.api_key is not None and not args.api_key.strip():
        return "--api-key is empty"
    return None


def engine_spec(args):
    """The engine the command line asks for (0 and "auto": left to the machine)."""
    from .start import EngineSpec
    return EngineSpec.of(args.model, args.gguf, num_blocks=args.num_blocks,
                         max_seqs=args.max_seqs, runner=args.runner,
                         block_size=args.block_size, prefix_caching=args.prefix_caching,
                         audit=args.audit, token_budget=args.token_budget or None,
                         chunked_prefill=not args.no_chunked_prefill,
                         kv_dtype=None if args.kv_dtype == "auto" else args.kv_dtype,
                         speculate=args.speculate or None)


def limits_of(args):
    from .limits import Limits
    return Limits(max_body=args.max_body, read_timeout=args.read_timeout,
                  max_connections=args.max_connections, host=args.host,
                  allowed_hosts=tuple(args.allowed_host),
                  allow_origins=tuple(args.allow_origin), api_key=args.api_key,
                  key_for_probes=args.api_key_for_probes)


def build(args):
    """The tokenizer's side of the model, the started engine client, the application."""
    from .app import create_app
    from .client import EngineClient
    from .models import load
    from .start import make_engine
    from .transport import ProcessTransport, ThreadTransport

    spec, limits = engine_spec(args), limits_of(args)
    if args.engine == "thread":
        transport = ThreadTransport(*make_engine(spec), max_waiting=args.max_waiting)
    else:
        transport = ProcessTransport(spec, max_waiting=args.max_waiting,
                                     log_level=args.log_level.upper())
    served = load(args.model, args.gguf, model=False)
    client = EngineClient(transport, served.tokenizer, max_waiting=args.max_waiting,
                          stall_timeout=args.stall_timeout,
                          stream_interval=args.stream_interval).start()
    c = client.config
    log.info("%s on %d blocks of %d tokens, %s runner, up to %d sequences, token budget "
             "%s%s; the engine in a %s", served.name, c.num_blocks, c.block_size, c.runner,
             c.max_seqs, c.token_budget or "none",
             ", prefix caching" if c.prefix_caching else "", args.engine)
    _warn_if_exposed(limits)
    return served, client, create_app(client, served, limits, audit=args.audit), limits


def _warn_if_exposed(limits) -> None:
    from .limits import allowed_hosts, is_loopback
    if is_loopback(limits.host):
        return
    words = [f"listening on {limits.host}: other machines can reach this server"]
    if limits.api_key is None:
        words.append("anyone who reaches it may use the model (--api-key gives it a key)")
    if allowed_hosts(limits) == ["*"]:
        words.append("any Host is accepted, so a web page a browser on the network opens "
                     "can use it through a DNS name rebound to its address (--allowed-host "
                     "names the hosts clients use)")
    log.warning("; ".join(words))


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
        served, client, app, limits = build(args)
    except PagedKVError as exc:     # a missing model file names the set-up command; an
        print(f"error: {exc}", file=sys.stderr)    # engine that failed to start says why
        return 1
    files = raise_open_files_limit()
    if files < args.max_connections + 64:
        log.warning("this process may open %d files: fewer than --max-connections %d "
                    "needs", files, args.max_connections)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=args.shutdown_timeout,
                            limit_concurrency=args.max_connections, access_log=False,
                            http=protocol_class(limits), lifespan="off")
    deadline = [None]

    class Server(uvicorn.Server):
        exit_code = 0

        def handle_exit(self, sig, frame):
            # Ctrl-C (SIGINT) or SIGTERM: every open request ends now (503), the engine
            # is asked to stop, uvicorn stops accepting and closes the connections. The
            # signal is not raised again afterwards: a stop asked for is a clean exit.
            if deadline[0] is None:
                deadline[0] = time.monotonic() + args.shutdown_timeout
            client.request_stop()
            super().handle_exit(sig, frame)
            self._captured_signals.clear()

    server = Server(config)

    def dead(reason):                    # on the transport's thread: stop serving, exit 1
        server.exit_code = 1
        server.should_exit = True
    client.on_dead = dead
    try:
        server.run()
    finally:
        left = args.shutdown_timeout if deadline[0] is None else \
            deadline[0] - time.monotonic()
        client.stop(max(0.5, left))
    if server.exit_code:
        log.error("stopped: the engine died (%s)", client.dead)
    else:
        log.info("stopped")
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
