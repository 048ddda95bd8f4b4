"""Serving through the OpenAI API: ``python -m pagedkv.bench.http [--quick] [--rate R] ...``.

:mod:`pagedkv.bench.serve`'s workloads sent to ``python -m pagedkv.serve`` over HTTP, each
request a streamed ``POST /v1/completions`` of token ids (greedy, ``max_tokens`` its output
length, ``ignore_eos``). The server is started here (127.0.0.1, a free port, its pool sized
for the workload; flags this command does not know go to it) or given (``--url``).
Requests arrive all at once, at ``--rate`` a second (Poisson) or ``--concurrency`` at a
time, sent by ``--clients`` processes, each an event loop with its share, so that the
client keeps up with a fast server.

Measured from when a request is due (its arrival, or when a ``--concurrency`` slot frees):
output tokens a second (the usage's completion tokens over the wall time), time to first
token (TTFT: to the first chunk with text), the gaps between a request's content chunks
(ITL; a chunk may carry several tokens, their mean is reported) and time per output token
(TPOT). Then, the server stopped, the same requests on the same engine options in this
process (:func:`pagedkv.bench.serve.serve_pagedkv`), side by side. ``--ttft-probe``: lone
requests (a 100-token prompt, 16 tokens) on the idle server. ``--stream-interval 1 8``:
the HTTP run once a server with each ``--stream-interval`` (tokens per streamed event),
side by side; each run's ``tokens_per_chunk`` shows the interval at work, and its TTFT
probe that the first token does not wait for it.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import multiprocessing
import os
import queue
import random
import sys
import time

import httpx

__all__ = ["sse_data", "consume", "post", "drive", "summarize", "pool_blocks",
           "server_flags", "run", "main"]

TIMEOUT = httpx.Timeout(600.0, connect=30.0)   # a queued stream may wait long for a chunk
TINY = "tiny-random-llama"                     # the tiny model's name; its vocabulary is small


def sse_data(line: str) -> str | None:
    """The payload of one server-sent-event line (``data: ...``), or None for anything
    else (blank separators, comments, other fields). Each event here is one data line."""
    if not line.startswith("data:"):
        return None
    return line[5:].lstrip(" ")


def blank() -> dict:
    """A request's record before it is sent; times in seconds from the shared start."""
    return dict(due=0.0, sent=0.0, times=[], texts=[], tokens=None, finish=None, end=0.0,
                error=None)


async def consume(lines, rec: dict, clock) -> dict:
    """Fill ``rec`` from a completion's event lines (an async iterator): each content
    chunk's arrival time and text, the finish reason, the usage's completion tokens, and
    an error object if the server sends one instead of ``[DONE]``."""
    done = False
    async for line in lines:
        t = clock()                            # first: parsing is not the server's time
        data = sse_data(line)
        if data is None:
            continue
        if data == "[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj:
            rec["error"] = f"error in the stream: {obj['error'].get('message')}"
            break
        for choice in obj.get("choices") or ():
            if choice.get("text"):
                rec["times"].append(t)
                rec["texts"].append(choice["text"])
            rec["finish"] = choice.get("finish_reason") or rec["finish"]
        if obj.get("usage"):
            rec["tokens"] = obj["usage"]["completion_tokens"]
    rec["end"] = clock()
    if not done and rec["error"] is None:
        rec["error"] = "the stream ended without [DONE]"
    return rec


async def post(client: httpx.AsyncClient, body: bytes, rec: dict, clock) -> dict:
    """Stream one completion (``body``: its JSON) into ``rec``; a non-200 answer or an
    exception is its error."""
    rec["sent"] = clock()
    try:
        async with client.stream("POST", "/v1/completions", content=body,
                                 headers={"content-type": "application/json"}) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.update(error=f"HTTP {r.status_code}: {text[:300]}", end=clock())
                return rec
            return await consume(r.aiter_lines(), rec, clock)
    except (httpx.HTTPError, OSError, ValueError) as exc:
        rec.update(error=f"{type(exc).__name__}: {exc}", end=clock())
        return rec


def body(model: str, prompt: list, max_tokens: int) -> bytes:
    """A request's JSON, encoded before the clock starts."""
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


# ---------------------------------------------------------------------- client processes

def _client(*args) -> None:
    asyncio.run(_drive(*args))


async def _drive(url, share, slots, go, start, out) -> None:
    """One client process: ``share`` as (index, arrival, request body), at most ``slots``
    in flight (None: no limit); records and progress go back through ``out``."""
    streams = slots or len(share)
    limits = httpx.Limits(max_connections=streams, max_keepalive_connections=streams)
    async with httpx.AsyncClient(base_url=url, http2=False, limits=limits,
                                 timeout=TIMEOUT) as client:
        # open the connections before the clock starts (a first request also pays for
        # the imports httpx defers): ~25 ms that would otherwise land in the first TTFTs
        await asyncio.gather(*(client.get("/v1/models") for _ in range(streams)))
        out.put(("ready", None))
        go.wait()                              # (blocks the loop: nothing runs on it yet)
        t0 = start.value                       # time.monotonic() is system-wide on Linux

        def clock():
            return time.monotonic() - t0
        gate = asyncio.Semaphore(slots) if slots else None
        recs = []

        async def one(i, arrival, payload):
            rec = blank()
            recs.append(rec)
            await asyncio.sleep(arrival - clock())        # at once when already due
            async with gate or contextlib.nullcontext():   # (a slot frees: it is due)
                rec["due"] = max(arrival, clock()) if gate else arrival
                return await post(client, payload, rec, clock)

        async def tick(total=0):                # progress: chunks, a token each mostly
            while True:
                await asyncio.sleep(0.2)
                total, before = sum(len(r["times"]) for r in recs), total
                out.put(("chunks", total - before))
        ticker = asyncio.create_task(tick())
        records = await asyncio.gather(*(one(i, a, p) for i, a, p in share))
        ticker.cancel()
    for (i, *_), rec in zip(share, records):
        rec["index"] = i
    out.put(("done", records))


def drive(url: str, model: str, requests, clients: int, concurrency: int | None = None,
          bar=None) -> list:
    """Send ``requests`` (arrival, prompt, output tokens) from ``clients`` processes, dealt
    out in turn by arrival; every process starts its clock at the same instant. Returns
    one record a request, in the requests' order."""
    ctx = multiprocessing.get_context("spawn")  # (a fork would copy our threads)
    clients = max(1, min(clients, len(requests), concurrency or len(requests)))
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    out, go, start = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
    procs, was = [], os.environ.get("PAGEDKV_BACKEND")
    os.environ["PAGEDKV_BACKEND"] = "numpy"     # a client needs no GPU (nor its memory)
    for k in range(clients):
        share = [(i, requests[i][0], body(model, *requests[i][1:]))
                 for i in order[k::clients]]
        slots = concurrency // clients + (k < concurrency % clients) if concurrency else None
        procs.append(ctx.Process(target=_client, daemon=True,
                                 args=(url, share, slots, go, start, out)))
        procs[-1].start()
    if was is None:
        del os.environ["PAGEDKV_BACKEND"]
    else:
        os.environ["PAGEDKV_BACKEND"] = was
    ready, records = 0, []
    while len(records) < len(requests):
        try:
            kind, value = out.get(timeout=1.0)
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a client process exited with status {dead[0]}")
            continue
        if kind == "ready":
            ready += 1
            if ready == clients:                # all set up: start together, soon
                start.value = time.monotonic() + 0.05
                go.set()
        elif kind == "chunks" and bar is not None:
            bar.update(value)
        elif kind == "done":
            records += value
    for p in procs:
        p.join()
    return sorted(records, key=lambda r: r["index"])


# ---------------------------------------------------------------------- statistics

def summarize(records) -> dict:
    """Throughput and latencies of the records of one run (:func:`drive`)."""
    from .serve import latency
    ok = [r for r in records if r["error"] is None]
    tokens = sum(r["tokens"] or 0 for r in ok)
    chunks = sum(len(r["times"]) for r in ok)
    wall = max(r["end"] for r in records) - min(r["due"] for r in records)
    ttft = [r["times"][0] - r["due"] for r in ok if r["times"]]
    itl = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    tpot = [(r["times"][-1] - r["times"][0]) / (r["tokens"] - 1)
            for r in ok if r["times"] and (r["tokens"] or 0) > 1]
    errors = [r["error"] for r in records if r["error"] is not None]
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms": latency(ttft), "ttft_min_ms": 1e3 * min(ttft, default=float("nan")),
            "itl_ms": latency(itl), "tpot_ms": latency(tpot),
            "tokens_per_chunk": tokens / chunks if chunks else float("nan"),
            "completed": len(ok), "errors": len(errors), "error_examples": errors[:3],
            "send_lag_ms": latency([r["sent"] - r["due"] for r in records]),
            "completion_tokens": [r["tokens"] for r in records],
            "finish_reasons": [r["finish"] for r in records]}


# ---------------------------------------------------------------------- the command

def pool_blocks(args, requests) -> int:
    """``--num-blocks``, else every block the requests could need (as ``bench.serve``)."""
    from ..checks import cdiv
    return args.num_blocks or sum(cdiv(len(p) + o, 16) for _, p, o in requests) + 16


def server_flags(args, requests, interval: int = 1) -> list:
    """``python -m pagedkv.serve``'s flags for this workload: the pool sized for it, no
    request turned away for waiting (``--max-waiting``), the stream interval, then the
    flags given for it."""
    flags = ["--model", args.model, "--runner", args.runner, "--max-seqs", args.max_seqs,
             "--num-blocks", pool_blocks(args, requests), "--max-waiting", len(requests),
             "--stream-interval", interval]
    if args.gguf:
        flags += ["--gguf", args.gguf]
    flags += ["--token-budget", args.token_budget]
    return [str(f) for f in flags + args.server_args]


def _env() -> dict:
    """This checkout first on the server's path, so that it serves the same pagedkv."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


def _probe(url: str, model: str, vocab: int, n: int) -> dict:
    """TTFT of ``n`` lone requests (a fresh 100-token prompt each, 16 tokens), in turn."""
    rnd = random.Random(1)
    lone = [(0.0, [rnd.randrange(3, vocab) for _ in range(100)], 16) for _ in range(n)]
    s = summarize(drive(url, model, lone, clients=1, concurrency=1))
    return {"n": n, "errors": s["errors"], "min": s["ttft_min_ms"], **s["ttft_ms"]}


def _engine_counters(url: str) -> dict:
    """The server's engine steps and the seconds its thread spent in them (/metrics)."""
    import urllib.request
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    got = {}
    for line in text.splitlines():
        for key, name in (("steps", "pagedkv_engine_steps_total "),
                          ("step_seconds", "pagedkv_engine_step_seconds_total ")):
            if line.startswith(name):
                got[key] = float(line.split()[1])
    return {"steps": got.get("steps", float("nan")),
            "step_seconds": got.get("step_seconds", float("nan"))}


def _http(args, requests, r: dict, interval: int) -> tuple:
    """The HTTP half of :func:`run` at one stream interval: start the server (or use
    ``--url``), warm it up, send the requests, probe; the server is stopped whatever
    happens. Fills ``r`` (``http``, ``server_flags``, ...); returns (model, requests:
    their ids fitted to the model's vocabulary)."""
    from ..serve.models import ByteTokenizer
    from ..serve.process import ServerProcess, get_json
    from .serve import _progress, spike
    server = None
    if args.url:
        url, r["server_flags"] = args.url.rstrip("/"), "unknown (a running server, --url)"
        model = get_json(url + "/v1/models")["data"][0]["id"]
    else:
        r["server_flags"] = server_flags(args, requests, interval)
        server = ServerProcess(*r["server_flags"], env=_env(), timeout=300).start()
        url, model = server.url, server.model
    vocab = ByteTokenizer.vocab_size if model == TINY else 10001   # (make_requests' ids)
    requests = [(a, [t % vocab for t in p], o) for a, p, o in requests]
    print(f"{model} at {url}, {args.clients} client process(es), stream interval "
          f"{interval}", flush=True)
    try:                       # warm-up, as bench.serve's: a few short requests first
        drive(url, model, [(0.0, [5 + i] * 20, 4) for i in range(4)], clients=1)
        bar = _progress(r["workload"]["output_tokens"], "http")
        before = _engine_counters(url)
        records = drive(url, model, requests, args.clients, args.concurrency, bar)
        if bar is not None:
            bar.close()
        r["http"] = summarize(records)
        r["http"]["stream_interval"] = interval
        after = _engine_counters(url)
        busy = after["step_seconds"] - before["step_seconds"]
        r["http"]["server"] = {"steps": after["steps"] - before["steps"],
                               "step_seconds": busy,
                               "step_share_of_wall": busy / r["http"]["wall_s"]}
        if args.spike:
            r["http"]["spike"] = spike({"stamps": [x["times"] for x in records],
                                        "due": [x["due"] for x in records]})
        if args.ttft_probe:
            r["ttft_probe"] = _probe(url, model, vocab, args.ttft_probe)
    finally:
        if server is not None:
            r["server_exit"], log = server.stop(), server.log()
            r["server_log_tail"] = log[-2000:] if "Traceback" in log else ""
    return model, requests


def run(args) -> dict:
    from .. import backend
    from . import serve
    requests, n, lo, hi = serve.workload(args)
    asked = sum(o for *_, o in requests)
    r = {"command": "python -m pagedkv.bench.http " + " ".join(args.argv),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "workload": {"requests": n, "lengths": [lo, hi], "seed": args.seed,
                      "rate": args.rate, "spike": args.spike, "output_tokens": asked,
                      "concurrency": args.concurrency, "clients": args.clients}}
    print(f"{n} requests, prompts and outputs of {lo}-{hi} tokens, "
          f"{f'{args.rate} a second' if args.rate else 'all at once'}"
          f"{f', {args.concurrency} at a time' if args.concurrency else ''}; {asked} "
          f"output tokens", flush=True)
    runs = {}
    for interval in args.stream_interval:          # (the first run's numbers on top)
        runs[interval] = {"workload": r["workload"]}
        r["model"], fitted = _http(args, requests, runs[interval], interval)
        runs[interval].pop("workload")
    requests = fitted
    r.update(runs[args.stream_interval[0]])
    if len(runs) > 1:
        r["stream_intervals"] = {str(k): v for k, v in runs.items()}
    if args.no_engine:
        r["engine"] = "not run (--no-engine)"
    else:               # after the server has stopped (unless --url's runs on, idle)
        from ..model.blas import single_thread_blas
        from ..serve.models import load
        single_thread_blas()
        served = load("tiny" if r["model"] == TINY else "smollm2", args.gguf)
        # (the server's engine stops at the end token unless asked not to: ignore_eos)
        opts = serve.options(token_budget=args.token_budget or None, max_seqs=args.max_seqs,
                             blocks=pool_blocks(args, requests), runner=args.runner)
        bar = serve._progress(asked, "engine")
        e = serve.serve_pagedkv(served.model, requests, opts, bar)
        if bar is not None:
            bar.close()
        if args.spike:
            e["spike"] = serve.spike(e)
        tpot = [(s[-1] - s[0]) / (len(s) - 1) for s in e.pop("stamps") if len(s) > 1]
        e.pop("due")
        e.update(errors=0, tpot_ms=serve.latency(tpot), options=vars(opts),
                 run="in this process, " + ("the --url server idle" if args.url else
                                            "after the server stopped")
                 + (", every request at its arrival (no --concurrency limit)"
                    if args.concurrency else ""))
        r["engine"] = e
    r["machine"] = {"cpus": os.cpu_count(), **backend.describe()}
    return r


def table(r: dict) -> str:
    sides = {f"http/{k}": v["http"] for k, v in r.get("stream_intervals", {}).items()} \
        or {"http": r["http"]}
    if isinstance(r.get("engine"), dict):
        sides["engine"] = r["engine"]
    lines = [f"{'':20}" + "".join(f"{k:>12}" for k in sides)]

    def row(label, key, fmt="{:>12.1f}"):
        lines.append(f"{label:20}" + "".join(fmt.format(key(v)) for v in sides.values()))
    row("output tokens/s", lambda e: e["output_tokens_per_s"])
    row("wall s", lambda e: e["wall_s"], "{:>12.2f}")
    row("completed", lambda e: e["completed"], "{:>12d}")
    row("errors", lambda e: e["errors"], "{:>12d}")
    for kind in ("ttft_ms", "itl_ms", "tpot_ms"):
        for q in ("p50", "p90", "p99", "max"):
            row(f"{kind[:-3].upper()} {q} ms", lambda e: e[kind][q], "{:>12.2f}")
    row("tokens per chunk", lambda e: e.get("tokens_per_chunk", 1.0), "{:>12.2f}")
    h, flags = r["http"], r["server_flags"]
    lines += [f"http: ITL between chunks; requests sent up to "
              f"{h['send_lag_ms']['max']:.1f} ms after they were due"]
    lines += [f"http error: {e}" for e in h["error_examples"]]
    if "server" in h:
        v = h["server"]
        lines.append(f"http: {v['steps']:.0f} engine steps; the engine's core spent "
                     f"{v['step_seconds']:.2f} s in them ({100 * v['step_share_of_wall']:.0f} "
                     f"% of the wall time)")
    lines += [f"{k}: while the long prompt is prefilled, the others' worst gap "
              f"{v['spike']['worst_itl_ms']:.1f} ms, "
              f"{v['spike']['worst_over_median']:.1f} x their median"
              for k, v in sides.items() if "spike" in v]
    probes = {f"stream interval {k}": v["ttft_probe"]
              for k, v in r.get("stream_intervals", {}).items() if "ttft_probe" in v} or \
        ({"": r["ttft_probe"]} if "ttft_probe" in r else {})
    for where, p in probes.items():
        lines.append(f"TTFT of a lone 100-token prompt, {p['n']} times{', ' if where else ''}"
                     f"{where}: p50 {p['p50']:.2f} ms, min {p['min']:.2f} ms, "
                     f"{p['errors']} errors")
    lines.append(f"server: {flags if isinstance(flags, str) else ' '.join(flags)}")
    e = r["engine"]
    lines.append(f"engine: {e['run']}, {e['options']}, {e['preemptions']} preemptions"
                 if isinstance(e, dict) else f"engine: {e}")
    return "\n".join(lines)


def main(argv=None) -> int:
    from . import serve
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.http",
                                description=__doc__.split("\n")[0],
                                epilog="Other flags go to python -m pagedkv.serve (and "
                                       "not to the engine run here).")
    serve.workload_arguments(p)
    add = p.add_argument
    add("--concurrency", type=int, help="at most this many requests in flight")
    add("--clients", type=int, help="client processes (default min(8, CPUs); 1 --quick)")
    add("--url", help="a running server's address, instead of starting one")
    add("--model", choices=("smollm2", "tiny"), default="smollm2")
    add("--gguf", metavar="PATH", help="the model file (default: $PAGEDKV_GGUF, else the "
        "installed package's)")
    add("--runner", choices=("plain", "fast"), help="default: fast on a GPU, else plain")
    add("--max-seqs", type=int, default=256)
    add("--num-blocks", type=int, default=0,
        help="pool blocks (default: every block the requests could need)")
    add("--token-budget", type=int, default=2048,
        help="tokens a step computes, in the server and in the engine run (default 2048, "
             "the server's; 0: no budget)")
    add("--ttft-probe", type=int, nargs="?", const=10, default=0, metavar="N",
        help="after the run, N lone requests on the idle server (default 10)")
    add("--stream-interval", type=int, nargs="+", default=[1], metavar="N",
        help="the server's tokens per streamed event; several (1 8): a run at each, side "
             "by side (default 1)")
    add("--no-engine", action="store_true", help="skip the in-process run")
    add("--json", metavar="PATH", help="write every number to PATH")
    args, args.server_args = p.parse_known_args(argv)
    serve.check_workload(p, args)
    for name in ("max_seqs", "concurrency", "clients"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.token_budget < 0:
        p.error("--token-budget must be at least 0 (0: no budget)")
    if args.url and args.server_args:
        p.error(f"unknown with --url: {' '.join(args.server_args)}")
    if min(args.stream_interval) < 1 or len(set(args.stream_interval)) < len(
            args.stream_interval):
        p.error(f"--stream-interval takes different numbers >= 1, got "
                f"{' '.join(map(str, args.stream_interval))}")
    if args.url and args.stream_interval != [1]:
        p.error("--stream-interval is the server's: with --url, start it with it")
    if args.runner is None:
        from .. import backend
        args.runner = "fast" if backend.on_gpu else "plain"
    if args.clients is None:
        args.clients = 1 if args.quick else min(8, os.cpu_count() or 1)
    args.argv = argv
    r = run(args)
    print(table(r))
    serve._save(r, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
