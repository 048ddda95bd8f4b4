"""What the server's front costs under load, and whether it holds the engine up.

    python perf/front_load.py [--streams 256] [--tokens 400] [--step-ms 2.7]
                              [--interval 1] [--profile] [--json FILE]

The server's process is the one ``python -m pagedkv.serve`` runs: uvicorn with the
server's HTTP protocol, the application, the :class:`~pagedkv.serve.client.EngineClient`
with SmolLM2's tokenizer, and the process transport with its reader and writer threads.
Only the engine in the child process is a stand-in: the real
:class:`~pagedkv.serve.core.EngineCore` and its loop over an engine whose step sleeps
until ``--step-ms`` after the last (the device's time, the host free meanwhile) and gives
every running request one token. ``--streams`` clients (raw sockets in one asyncio
process beside it) each stream a completion of ``--tokens`` tokens.

Printed: the steps the engine made a second against its pace (fewer: the pipe to the
server was full and the engine waited to send, the time printed too), the server
process's CPU milliseconds a step (all its threads, from /proc), and the tokens a chunk
the clients got (1 at ``--interval 1`` while the front keeps up; more when it falls
behind and joins them). ``--profile`` prints where the server's event loop spent its
time. Two CPU cores share the server, the engine's process and the clients here, so the
numbers are this machine's; no GPU needed.
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pathlib
import pstats
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


# ---------------------------------------------------------------------- the engine's side

class PacingEngine:
    """The parts of an :class:`~pagedkv.model.engine.Engine` the core uses; a step sleeps
    ``step_s`` (the device's time: the host is free meanwhile, as in an overlapped
    step) and gives every running sequence one token."""

    def __init__(self, step_s: float):
        from types import SimpleNamespace as NS
        self.step_s, self.finished, self.running, self.ids = step_s, [], [], 0
        self.scheduler = NS(waiting=[], running=self.running, swapped=[])
        counts = NS(prompt_tokens=0, cached_tokens=0, drafted=0, accepted=0)
        self.memory = NS(counts=counts, manager=None, swapper=None)
        self.next_at = None

    def submit(self, prompt, params):
        from pagedkv.model.requests import Request, Sequence
        seq = Sequence(self.ids, list(prompt), len(prompt))
        req = Request(self.ids, list(prompt), params, 0, live=[seq])
        self.ids += 1
        self.running.append(req)
        return req

    def cancel(self, req):
        if req in self.running:
            self.running.remove(req)

    def has_work(self) -> bool:
        return bool(self.running)

    def step(self):
        now = time.perf_counter()
        if self.next_at is None or self.next_at < now - 0.1:   # (the first step, or idle)
            self.next_at = now
        self.next_at += self.step_s
        for req in list(self.running):
            seq = req.live[0]
            seq.tokens.append(200 + (seq.seq_id * 7 + len(seq.tokens)) % 30_000)
            if seq.num_generated >= req.params.max_new_tokens:
                req.live.remove(seq)
                req.finished.append(seq)
                self.running.remove(req)
                self.finished.append(req)
        wait = self.next_at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def engine_child(conn, step_s, max_waiting, timed_path) -> None:
    """The engine's process, as :func:`pagedkv.serve.transport._child` runs it, with the
    pacing engine; the core's loop timed: its steps, and its time spent sending."""
    from pagedkv.config import EngineConfig
    from pagedkv.serve import core as core_mod
    from pagedkv.serve.messages import Ready
    from pagedkv.serve.transport import pipe_take
    core_mod.pool_counts = lambda manager: {}        # (the stub has no pool)
    core = core_mod.EngineCore(PacingEngine(step_s), max_waiting=max_waiting)
    conn.send(Ready(EngineConfig(num_blocks=8, stop_ids=(2,)), {}, core.stats()))
    timed = dict(send_s=0.0, steps=0, t0=None, t1=None, busy=False)

    take = pipe_take(conn)

    def put(message):
        t = time.perf_counter()
        conn.send(message)
        if core.busy() or timed["busy"]:
            timed["send_s"] += time.perf_counter() - t
    real_step = core.step

    def step():
        if timed["t0"] is None:
            timed["t0"] = time.perf_counter()
        timed["busy"] = True
        out = real_step()
        timed["steps"] += 1
        if not core.busy():                          # the last request ended
            timed["t1"], timed["busy"] = time.perf_counter(), False
        return out
    core.step = step
    try:
        core_mod.run_core(core, take, put)
    except (EOFError, OSError):
        pass
    if timed["t1"] is None:                          # stopped before its work was done
        return
    wall = timed["t1"] - timed["t0"]
    pathlib.Path(timed_path).write_text(json.dumps(dict(
        steps=timed["steps"], wall_s=wall, steps_per_s=timed["steps"] / wall,
        asked_steps_per_s=1 / step_s,
        send_ms_per_step=1e3 * timed["send_s"] / timed["steps"])))


# ---------------------------------------------------------------------- the server's side

def serve(args) -> None:
    """The server's process: the pacing engine's process behind the real transport, the
    client and the application; prints its port, serves until SIGTERM."""
    import logging
    import multiprocessing

    import uvicorn

    from pagedkv.serve.app import create_app
    from pagedkv.serve.client import EngineClient
    from pagedkv.serve.limits import Limits, protocol_class, raise_open_files_limit
    from pagedkv.serve.models import load
    from pagedkv.serve.transport import ProcessTransport

    logging.basicConfig(level=logging.WARNING)
    if args.switch:
        sys.setswitchinterval(args.switch)
    raise_open_files_limit()
    served = load("smollm2", model=False)
    transport = ProcessTransport(None, max_waiting=args.streams + 8)
    transport._proc = multiprocessing.get_context("spawn").Process(
        target=engine_child, daemon=True, name="pacing-engine",
        args=(transport._child_conn, args.step_ms / 1e3, args.streams + 8, args.timed))
    client = EngineClient(transport, served.tokenizer, max_waiting=args.streams + 8,
                          stream_interval=args.interval).start()
    limits = Limits()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4096)                   # (clients may connect before uvicorn runs)
    config = uvicorn.Config(create_app(client, served, limits), log_level="warning",
                            access_log=False, lifespan="off", http=protocol_class(limits),
                            limit_concurrency=args.streams + 64)
    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):   # a stop asked for: not raised again after
            super().handle_exit(sig, frame)
            self._captured_signals.clear()
    server = Server(config)
    print(json.dumps({"port": sock.getsockname()[1]}), flush=True)
    prof = cProfile.Profile() if args.profile else None
    if prof:
        prof.enable()
    server.run(sockets=[sock])
    if prof:
        prof.disable()
        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    client.stop(5.0)


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user and system, all its threads), from /proc."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------- the clients' side

async def stream(port: int, payload: bytes) -> tuple:
    """One streamed completion over a raw socket: (chunks with text, bytes)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                 % len(payload) + payload)
    await writer.drain()
    got = bytearray()
    while b"data: [DONE]" not in got[-64:]:
        data = await reader.read(1 << 16)
        if not data:
            break
        got += data
    writer.close()
    if b" 200 OK" not in got[:40] or b"data: [DONE]" not in got[-64:]:
        raise RuntimeError(f"the server answered: {bytes(got[:300])!r} ... "
                           f"{bytes(got[-200:])!r}")
    return got.count(b'"text":"') - got.count(b'"text":""'), len(got)


async def clients(port: int, streams: int, tokens: int) -> list:
    payload = json.dumps({"model": "SmolLM2-135M-Instruct", "prompt": list(range(200, 300)),
                          "max_tokens": tokens, "ignore_eos": True, "stream": True,
                          "temperature": 0}).encode()
    return await asyncio.gather(*(stream(port, payload) for _ in range(streams)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--tokens", type=int, default=400, help="tokens each stream gets")
    p.add_argument("--step-ms", type=float, default=2.7,
                   help="the core's pace (a step of nano-vllm's workload on the H100: 2.7)")
    p.add_argument("--interval", type=int, default=1, help="the server's --stream-interval")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--switch", type=float, default=0,
                   help="the server process's sys.setswitchinterval (0: Python's 5 ms)")
    p.add_argument("--json", metavar="FILE")
    p.add_argument("--deadline", type=float, default=600,
                   help="seconds the clients may take in all (then the server is killed)")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timed", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        serve(args)
        return 0
    timed = pathlib.Path(tempfile.mkdtemp()) / "timed.json"
    cmd = [sys.executable, __file__, "--serve", "--timed", str(timed),
           *(argv if argv is not None else sys.argv[1:])]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        port = json.loads(proc.stdout.readline())["port"]
        cpu, t = cpu_seconds(proc.pid), time.perf_counter()
        got = asyncio.run(asyncio.wait_for(clients(port, args.streams, args.tokens),
                                           args.deadline))
        wall, cpu = time.perf_counter() - t, cpu_seconds(proc.pid) - cpu
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    r = json.loads(timed.read_text())
    chunks = sum(c for c, _ in got)
    r.update(streams=args.streams, tokens=args.tokens, interval=args.interval,
             step_ms=args.step_ms, client_wall_s=wall,
             front_cpu_ms_per_step=1e3 * cpu / r["steps"],
             tokens_per_chunk=args.streams * args.tokens / chunks,
             bytes=sum(b for _, b in got))
    print(f"{args.streams} streams x {args.tokens} tokens, interval {args.interval}, engine "
          f"pace {args.step_ms} ms: {r['steps_per_s']:.0f} steps/s of "
          f"{r['asked_steps_per_s']:.0f}; the engine's process waited "
          f"{r['send_ms_per_step']:.3f} ms a step to send; the server's process "
          f"{r['front_cpu_ms_per_step']:.2f} CPU ms a step; {r['tokens_per_chunk']:.2f} "
          f"tokens a chunk")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(r, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
