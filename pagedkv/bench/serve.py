"""Serving: ``python -m pagedkv.bench.serve [--quick] [--rate R] [--json PATH] ...``.

Requests arrive (all at once, or as a Poisson process at ``--rate`` requests a second) and
SmolLM2-135M-Instruct serves them through the paged cache, the engine stepping continuously
(:class:`~pagedkv.model.engine.Engine` on the shared scheduler, with a token budget). The
default workload is nano-vllm's ``bench.py``: 256 requests, ``random.seed(0)``, every prompt
drawn first (``randint(100, 1024)`` tokens, each ``randint(0, 10000)``), then every output
length (``randint(100, 1024)``), the end token ignored. ``--quick`` is a CPU-sized run.

Measured, per engine, from the moment a request is due to arrive: **output tokens a second**
(all output tokens over the wall time, prefills included, warm-up excluded), **time to first
token** (TTFT) and **inter-token latency** (ITL: the gaps between a request's tokens as the
engine hands them out), as p50, p90, p99 and max; for pagedkv also the peak of blocks in use
and the preemptions. When ``transformers`` is importable the same requests go through its
continuous-batching manager in the same process (per-request ``max_new_tokens``, end token
disabled, its warm-up excluded, per-token timestamps recorded), and the two are printed side
by side. ``--json PATH`` writes everything with the command, machine and date.

**The floor** (:func:`floor`): the least time the device could take for this workload. Its
decodes read, over the requests, sum(prompt x output + output^2 / 2) tokens of K/V (each decode
step of a request reads its whole past) at the cache's bytes a token; every step reads the
weights once; the prefills compute (:func:`prefill_flop`) 2 FLOP per weight of the layers a
prompt token, attention's products over each token's past, and the output head once a
prompt. The bytes go at the
bandwidth of a large copy measured in the same process (device to device on a GPU; a NumPy
copy in host memory on a CPU: read and written bytes counted), the FLOP at the rate of a large
matrix multiply measured there too (float16 on a GPU, float32 on a CPU). The run's wall time
over the floor says how far from the hardware's pace it is. ``--kv-dtype int8`` serves from
the 8-bit cache (:mod:`pagedkv.kernels.kv8`), whose floor is lower.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import sys
import time
from collections import deque

import numpy as np

from .. import backend
from ..checks import cdiv
from ..errors import ConfigError
from ..model.blas import single_thread_blas
from ..model.engine import Engine
from ..config import SamplingParams
from ..model.timeline import attach, busy_seconds

__all__ = ["make_requests", "spike_requests", "spike", "workload", "workload_arguments",
           "check_workload", "options", "serve_pagedkv", "serve_transformers", "latency",
           "floor", "decode_kv_tokens", "prefill_flop", "copy_bandwidth", "matmul_rate",
           "main"]

PERCENTILES = (50, 90, 99)


def make_requests(n: int = 256, lo: int = 100, hi: int = 1024, seed: int = 0,
                  rate: float | None = None) -> list:
    """``n`` requests as (arrival in seconds, prompt token ids, output tokens): nano-vllm's
    draws in its order (every prompt, then every output length), and, with a ``rate``,
    exponential gaps between arrivals from a NumPy generator seeded the same."""
    rnd = random.Random(seed)
    prompts = [[rnd.randint(0, 10000) for _ in range(rnd.randint(lo, hi))] for _ in range(n)]
    outputs = [rnd.randint(lo, hi) for _ in range(n)]
    if rate:
        arrivals = np.cumsum(np.random.default_rng(seed).exponential(1 / rate, n))
        arrivals -= arrivals[0]
    else:
        arrivals = np.zeros(n)
    return [(float(a), p, o) for a, p, o in zip(arrivals, prompts, outputs)]


def spike_requests(running: int = 64, prompt: int = 4096, *, short: int = 128,
                   output: int = 512, at: float = 0.5, seed: int = 0) -> list:
    """``running`` requests that arrive at once and decode ``output`` tokens each, and, at
    ``at`` seconds, one of ``prompt`` tokens (16 output tokens): how much does its prefill
    stall the others? The last request is the long one."""
    rnd = random.Random(seed)
    reqs = [(0.0, [rnd.randint(0, 10000) for _ in range(short)], output)
            for _ in range(running)]
    return reqs + [(at, [rnd.randint(0, 10000) for _ in range(prompt)], 16)]


def spike(result: dict) -> dict:
    """The running requests' inter-token gaps around the long prompt's arrival: the worst,
    the median, and their ratio (a result of a :func:`spike_requests` run)."""
    stamps, at = result["stamps"][:-1], result["due"][-1]
    end = result["stamps"][-1][0] if result["stamps"][-1] else float("inf")
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if at <= b and a <= end + 0.5]
    every = [b - a for s in stamps for a, b in zip(s, s[1:])]
    worst, median = max(gaps, default=float("nan")), float(np.median(every))
    return {"worst_itl_ms": 1e3 * worst, "median_itl_ms": 1e3 * median,
            "worst_over_median": worst / median, "long_prompt_ttft_ms":
            1e3 * (end - at)}


def latency(values_s) -> dict:
    """Percentiles and the maximum of a list of seconds, in milliseconds."""
    v = np.asarray(values_s, dtype=np.float64) * 1e3
    if not len(v):
        return {f"p{q}": float("nan") for q in PERCENTILES} | {"max": float("nan")}
    return {f"p{q}": float(np.percentile(v, q)) for q in PERCENTILES} | {"max": float(v.max())}


def _summary(due, stamps, wall: float) -> dict:
    """TTFT and ITL from each request's due time and token times; throughput."""
    ttft = [s[0] - d for d, s in zip(due, stamps) if s]
    itl = [b - a for s in stamps for a, b in zip(s, s[1:])]
    tokens = sum(len(s) for s in stamps)
    return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall,
            "ttft_ms": latency(ttft), "itl_ms": latency(itl),
            "completed": sum(1 for s in stamps if s), "due": list(due),
            "stamps": [list(s) for s in stamps]}


# ---------------------------------------------------------------------- pagedkv

def _engine(model, requests, args) -> Engine:
    longest = max(len(p) + o for _, p, o in requests)
    blocks = args.blocks or sum(cdiv(len(p) + o, 16) for _, p, o in requests) + 16
    runner = args.runner or ("fast" if backend.on_gpu else "plain")
    fast = runner != "plain"
    return Engine(model, num_blocks=blocks, block_size=16, max_seqs=args.max_seqs,
                  stop_ids=(), runner=runner, max_context=longest if fast else None,
                  bookkeeping="fast" if fast else "teaching",
                  token_budget=args.token_budget, prefill_chunk=args.token_budget or 2048,
                  overlap=args.overlap, kv_dtype=getattr(args, "kv_dtype", None))


def _warm_up(engine: Engine, vocab: int) -> None:
    """Compile kernels and capture graphs before the clock starts: a few short requests
    served to the end, and every graph bucket captured."""
    engine.runner.capture_all()
    engine.generate([[1 + i % (vocab - 1)] * 20 for i in range(4)],
                    SamplingParams(max_new_tokens=4))
    backend.synchronize()


def options(**given) -> argparse.Namespace:
    """The engine's options as the command line gives them (its defaults, updated by
    ``given``: ``token_budget``, ``max_seqs``, ``blocks``, ``runner``, ``overlap``
    (None: the engine's default, on where the runner is a fast one on a GPU), ``trace``:
    steps of the
    timeline kept for a plot)."""
    o = argparse.Namespace(token_budget=2048, max_seqs=256, blocks=0, runner=None,
                           overlap=None, trace=0, kv_dtype=None)
    for key, value in given.items():
        if not hasattr(o, key):
            raise ConfigError(f"unknown option {key!r}; choose from {sorted(vars(o))}")
        setattr(o, key, value)
    return o


def serve_pagedkv(model, requests, args, progress=None, on_step=None,
                  clock: str = "seconds") -> dict:
    """Serve ``requests`` on our engine with ``args`` (:func:`options`); returns the
    measurements, with every token's time (``stamps``, seconds from the start) and every
    request's due time (``due``). ``on_step(engine)`` is called after every step. With
    ``clock="steps"`` an arrival is a step number instead of seconds (the same run on any
    machine; a request's due time is then when that step began)."""
    if clock not in ("seconds", "steps"):
        raise ConfigError(f"clock must be 'seconds' or 'steps', got {clock!r}")
    engine = _engine(model, requests, args)
    _warm_up(engine, model.config.vocab_size)
    engine.memory.counts.preemptions = 0
    engine.on_step = on_step
    timeline = attach(engine)
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    pending, live = deque(order), {}
    stamps = [[] for _ in requests]
    due = [0.0] * len(requests)
    peak = steps = 0
    t0 = time.perf_counter()
    while pending or live:
        now = time.perf_counter() - t0
        tick = steps if clock == "steps" else now
        while pending and requests[pending[0]][0] <= tick:
            i = pending.popleft()
            arrival, prompt, out = requests[i]
            due[i] = now if clock == "steps" else arrival
            live[i] = engine.submit(prompt, SamplingParams(max_new_tokens=out))
        if not engine.has_work():
            if clock == "steps":
                steps = int(requests[pending[0]][0])
            else:
                time.sleep(max(0.0, requests[pending[0]][0] - now))
            continue
        engine.step()
        steps += 1
        t = time.perf_counter() - t0
        peak = max(peak, engine.memory.manager.allocator.num_used)
        new = 0
        for i, req in list(live.items()):
            seqs = req.live or req.finished
            n = len(seqs[0].generated) if seqs else 0
            new += n - len(stamps[i])
            stamps[i].extend([t] * (n - len(stamps[i])))
            if req.done:
                del live[i]
        if progress is not None:
            progress.update(new)
    wall = max(s[-1] for s in stamps if s)
    out = _summary(due, stamps, wall)
    out["timeline"] = timeline.summary()
    out["device_s"] = {k: round(busy_seconds([x for x in timeline.device() if x[0] == k]), 4)
                       for k in ("prefill", "decode", "draw", "swap")}
    if args.trace:                         # a few steps from the middle of the run
        out["timeline"]["steps"] = timeline.to_json(steps // 2, args.trace)
    out.update(steps=steps, peak_blocks=peak, num_blocks=engine.memory.manager.allocator.num_blocks,
               preemptions=engine.memory.counts.preemptions, runner=type(engine.runner).__name__,
               token_budget=args.token_budget, max_seqs=args.max_seqs,
               overlap=engine.depth > 0, kv_dtype=engine.runner.kv.spec.dtype,
               kv_bytes_per_token=engine.runner.kv.spec.bytes_per_token,
               weight_bytes=model.weight_bytes)
    return out


# ---------------------------------------------------------------------- the floor

def decode_kv_tokens(requests) -> float:
    """Tokens of K/V the decodes of ``requests`` read: each of a request's ``output`` steps
    reads its past, ``prompt + k`` tokens at step k, about ``prompt x output + output^2 / 2``
    in all (the formula, summed over the requests)."""
    return float(sum(len(p) * o + o * o / 2 for _, p, o in requests))


def prefill_flop(requests, config) -> float:
    """The prefills' arithmetic (a model of ``config``, a
    :class:`~pagedkv.model.gguf.LlamaConfig`): every prompt token through the layers' weights
    (2 FLOP each), its attention over its past and itself (q.k and p.v: 4 x heads x head_dim
    FLOP a key), and the output head (2 x vocab x hidden) for a prompt's last token only."""
    c = config
    layer_weights = c.layers * (c.hidden * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
                                + 3 * c.hidden * c.ffn)       # q, k, v, o; gate, up, down
    attention = 4 * c.layers * c.heads * c.head_dim
    flop = 0.0
    for _, p, _ in requests:
        n = len(p)
        flop += 2.0 * layer_weights * n + attention * n * (n + 1) / 2
        flop += 2.0 * c.vocab_size * c.hidden
    return flop


def floor(requests, *, kv_bytes_per_token: int, weight_bytes: int, steps: int,
          prefill_flop: float, copy_bytes_per_s: float, flop_per_s: float) -> dict:
    """The least time the device could serve ``requests`` in: the K/V its decodes read and
    the weights each of ``steps`` reads, at ``copy_bytes_per_s``; the prefills'
    ``prefill_flop`` at ``flop_per_s``. Seconds, bytes and FLOP, and the output tokens a
    second at the floor."""
    kv = decode_kv_tokens(requests) * kv_bytes_per_token
    weights = float(steps) * weight_bytes
    flop = float(prefill_flop)
    bytes_s, flop_s = (kv + weights) / copy_bytes_per_s, flop / flop_per_s
    out = sum(o for *_, o in requests)
    return {"kv_bytes": kv, "weight_bytes": weights, "prefill_flop": flop,
            "bytes_s": bytes_s, "prefill_s": flop_s, "floor_s": bytes_s + flop_s,
            "output_tokens_per_s": out / (bytes_s + flop_s),
            "kv_share": kv / (kv + weights) if kv + weights else 0.0}


def copy_bandwidth(nbytes: int = 1 << 30, repeat: int = 5) -> dict:
    """Bytes a second a large copy moves (read and written bytes counted), the best of
    ``repeat``: device to device on a GPU (``nbytes``), a NumPy copy in host memory on a CPU
    (at most 256 MiB)."""
    xp = backend.xp
    if not backend.on_gpu:
        nbytes = min(nbytes, 1 << 28)
    a = xp.ones(nbytes // 4, np.float32)
    b = xp.empty_like(a)
    best = float("inf")
    for _ in range(repeat + 1):                      # the first one warms up
        backend.synchronize()
        t0 = time.perf_counter()
        b[...] = a
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    what = ("device-to-device copy (CuPy)" if backend.on_gpu
            else "NumPy copy in host memory (a CPU: not a GPU's bandwidth)")
    return {"bytes_per_s": 2 * a.nbytes / best, "bytes": int(a.nbytes), "how": what}


def matmul_rate(n: int | None = None, repeat: int = 3) -> dict:
    """FLOP a second of a large square matrix multiply, the best of ``repeat``: float16
    ``n`` = 8192 on a GPU, float32 ``n`` = 1024 on a CPU."""
    xp = backend.xp
    dtype = np.float16 if backend.on_gpu else np.float32
    n = n or (8192 if backend.on_gpu else 1024)
    a = xp.ones((n, n), dtype)
    b = xp.ones((n, n), dtype)
    best = float("inf")
    for _ in range(repeat + 1):
        backend.synchronize()
        t0 = time.perf_counter()
        a @ b
        backend.synchronize()
        best = min(best, time.perf_counter() - t0)
    what = f"{np.dtype(dtype).name} {n} x {n} matmul ({'CuPy' if backend.on_gpu else 'NumPy'})"
    return {"flop_per_s": 2.0 * n ** 3 / best, "n": n, "how": what}


def run_floor(requests, p: dict, config, copy=None, rate=None) -> dict:
    """:func:`floor` for a pagedkv run ``p`` (its steps, the cache's bytes a token, the
    weights), with the bandwidth and rate measured now unless given; and the run's wall
    time over it."""
    copy = copy or copy_bandwidth()
    rate = rate or matmul_rate()
    f = floor(requests, kv_bytes_per_token=p["kv_bytes_per_token"],
              weight_bytes=p["weight_bytes"], steps=p["steps"],
              prefill_flop=prefill_flop(requests, config),
              copy_bytes_per_s=copy["bytes_per_s"], flop_per_s=rate["flop_per_s"])
    f.update(copy=copy, matmul=rate, run_wall_s=p["wall_s"],
             run_over_floor=p["wall_s"] / f["floor_s"])
    return f


def floor_lines(f: dict) -> list:
    """The floor, said in two lines."""
    tb = 1e12
    return [f"floor: K/V {f['kv_bytes'] / tb:.3g} TB + weights {f['weight_bytes'] / tb:.3g} TB "
            f"at {f['copy']['bytes_per_s'] / tb:.3g} TB/s ({f['copy']['how']}, measured) = "
            f"{f['bytes_s']:.3g} s; prefill {f['prefill_flop'] / tb:.3g} TFLOP at "
            f"{f['matmul']['flop_per_s'] / tb:.3g} TFLOP/s ({f['matmul']['how']}, measured) = "
            f"{f['prefill_s']:.3g} s",
            f"floor {f['floor_s']:.3g} s ({f['output_tokens_per_s']:,.0f} output tokens/s); "
            f"this run {f['run_wall_s']:.3g} s = {f['run_over_floor']:.2f} x the floor"]


# ---------------------------------------------------------------------- transformers

def serve_transformers(path, requests, dtype_name: str, progress=None) -> dict:
    """The same requests through transformers' continuous-batching manager, added at their
    arrival times from this thread while the manager's own thread generates; each token's
    time is the manager's own timestamp (``record_timestamps=True``)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    device = "cuda" if backend.on_gpu else "cpu"
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                              dtype=getattr(torch, dtype_name))
    hf = hf.to(device).eval()
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=16)
    stamps = [[] for _ in requests]
    due, ids = [0.0] * len(requests), {}
    order = sorted(range(len(requests)), key=lambda i: requests[i][0])
    with hf.continuous_batching_context_manager(
            generation_config=config,
            continuous_batching_config=ContinuousBatchingConfig()) as manager:
        t0, done, k = time.perf_counter(), 0, 0
        while done < len(requests):
            now = time.perf_counter() - t0
            while k < len(order) and requests[order[k]][0] <= now:
                i = order[k]
                arrival, prompt, out = requests[i]
                due[i] = arrival
                rid = manager.add_request(prompt, max_new_tokens=out, eos_token_id=-1,
                                          record_timestamps=True)
                ids[rid] = i
                k += 1
            wait = requests[order[k]][0] - now if k < len(order) else 1.0
            result = manager.get_result(timeout=max(0.001, min(wait, 1.0)))
            if result is None:
                if not manager.is_running():
                    break
                continue
            if result.is_finished():
                i = ids[result.request_id]
                stamps[i] = [s - t0 for s in (result.timestamps or [])]
                done += 1
                if progress is not None:
                    progress.update(len(stamps[i]))
    wall = max(s[-1] for s in stamps if s)
    out = _summary(due, stamps, wall)
    out.update(version=transformers.__version__, torch=torch.__version__,
               attention=hf.config._attn_implementation, dtype=dtype_name)
    return out


# ---------------------------------------------------------------------- the command

def _load(args):
    from ..model import Llama, load_gguf
    from ..model.gguf import model_path
    path = model_path(args.gguf)
    ckpt = load_gguf(path)
    model = Llama(ckpt.config, ckpt.weights)      # float16 on a GPU, float32 on NumPy
    return path, model, str(model.dtype)


def _progress(total: int, name: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=name, unit="tok", disable=None, leave=False)


def workload(args):
    """The requests the command line asks for (``--spike``, ``--quick``, ``--requests``,
    ``--lengths``, ``--seed``, ``--rate``), with their count and the lengths' range:
    ``(requests, n, lo, hi)``."""
    if args.spike:
        requests = spike_requests(args.requests or 64, args.spike, seed=args.seed)
        return requests, len(requests), 128, args.spike
    if args.quick:
        n, (lo, hi) = args.requests or 12, args.lengths or (8, 40)
    else:
        n, (lo, hi) = args.requests or 256, args.lengths or (100, 1024)
    return make_requests(n, lo, hi, args.seed, args.rate), n, lo, hi


def workload_arguments(p: argparse.ArgumentParser) -> None:
    """The flags :func:`workload` reads, on parser ``p``."""
    p.add_argument("--quick", action="store_true",
                   help="12 requests of 8-40 tokens: a CPU-sized run")
    p.add_argument("--requests", type=int, help="how many (default 256; 12 with --quick)")
    p.add_argument("--lengths", type=int, nargs=2, metavar=("LO", "HI"),
                   help="prompt and output lengths, uniform in [LO, HI] (default 100 1024)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate", type=float, default=None,
                   help="Poisson arrivals, requests a second (default: all at once)")
    p.add_argument("--spike", type=int, default=0, metavar="TOKENS",
                   help="instead: --requests (default 64) decoding, and one prompt of "
                        "TOKENS arriving after 0.5 s")


def check_workload(p: argparse.ArgumentParser, args) -> None:
    """Refuse (``p.error``) workload flags :func:`workload` cannot serve."""
    if args.requests is not None and args.requests < 1:
        p.error("--requests must be at least 1")
    if args.lengths and not 1 <= args.lengths[0] <= args.lengths[1]:
        p.error("--lengths LO HI needs 1 <= LO <= HI")
    if args.rate is not None and args.rate <= 0:
        p.error("--rate must be positive")


def run(args) -> dict:
    requests, n, lo, hi = workload(args)
    single_thread_blas()
    path, model, dtype = _load(args)
    r = {"command": "python -m pagedkv.bench.serve " + " ".join(args.argv),
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "machine": backend.describe(), "python": platform.python_version(),
         "model": "SmolLM2-135M-Instruct", "dtype": dtype,
         "workload": {"requests": n, "lengths": [lo, hi], "seed": args.seed,
                      "rate": args.rate, "spike": args.spike,
                      "output_tokens": sum(o for *_, o in requests),
                      "prompt_tokens": sum(len(p) for _, p, _ in requests)}}
    print(f"{n} requests, prompts and outputs of {lo}-{hi} tokens, "
          f"{'all at once' if not args.rate else f'{args.rate} a second'}; "
          f"{r['workload']['output_tokens']} output tokens; {backend.name}", flush=True)
    bar = _progress(r["workload"]["output_tokens"], "pagedkv")
    r["pagedkv"] = serve_pagedkv(model, requests, args, bar)
    if bar is not None:
        bar.close()
    r["floor"] = run_floor(requests, r["pagedkv"], model.config)
    _save(r, args)                         # what is measured so far, if the peer fails
    if args.no_peer:
        r["transformers"] = "not run (--no-peer)"
    else:
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            r["transformers"] = f"not importable ({type(exc).__name__}: {exc})"
        else:
            bar = _progress(r["workload"]["output_tokens"], "transformers")
            try:
                r["transformers"] = serve_transformers(path, requests, dtype, bar)
            except Exception as exc:       # recorded, so that our numbers are kept
                r["transformers"] = f"failed ({type(exc).__name__}: {exc})"
            if bar is not None:
                bar.close()
    for key in ("pagedkv", "transformers"):
        if isinstance(r.get(key), dict) and args.spike:
            r[key]["spike"] = spike(r[key])
    if not args.keep_stamps:
        for key in ("pagedkv", "transformers"):
            if isinstance(r.get(key), dict):
                r[key].pop("stamps"), r[key].pop("due")
    return r


def _save(r: dict, args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


def table(r: dict) -> str:
    engines = [k for k in ("pagedkv", "transformers") if isinstance(r.get(k), dict)]
    lines = [f"{'':22}" + "".join(f"{k:>16}" for k in engines)]

    def row(label, get, fmt="{:>16.1f}"):
        lines.append(f"{label:22}" + "".join(fmt.format(get(r[k])) for k in engines))
    row("output tokens/s", lambda e: e["output_tokens_per_s"])
    row("wall s", lambda e: e["wall_s"], "{:>16.2f}")
    for kind in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p90", "p99", "max"):
            row(f"{kind[:-3].upper()} {q} ms", lambda e: e[kind][q], "{:>16.2f}")
    for k in engines:
        if "spike" in r[k]:
            sp = r[k]["spike"]
            lines.append(f"{k}: while the long prompt is prefilled, the running requests' "
                         f"worst gap {sp['worst_itl_ms']:.1f} ms, "
                         f"{sp['worst_over_median']:.1f} x their median")
    p = r["pagedkv"]
    lines.append(f"pagedkv {'GPU' if backend.on_gpu else 'device calls'} seconds in: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in p["device_s"].items()))
    tl = p["timeline"]
    lines.append(f"pagedkv {'GPU' if backend.on_gpu else 'device calls'} idle "
                 f"{100 * tl['device_idle_share']:.1f} % of {tl['wall_s']:.2f} s; host "
                 f"waited {tl['host_wait_s']:.2f} s; overlap {'on' if p['overlap'] else 'off'}")
    lines.append(f"pagedkv: {p['steps']} steps, peak {p['peak_blocks']} of "
                 f"{p['num_blocks']} blocks, {p['preemptions']} preemptions, "
                 f"token budget {p['token_budget']}, {p['runner']}, "
                 f"{p.get('kv_dtype', '?')} K/V")
    if "floor" in r:
        lines += floor_lines(r["floor"])
    for k in ("transformers",):
        if not isinstance(r.get(k), dict):
            lines.append(f"{k}: {r.get(k)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(prog="python -m pagedkv.bench.serve",
                                description=__doc__.split("\n")[0])
    workload_arguments(p)
    p.add_argument("--token-budget", type=int, default=2048,
                   help="tokens a step computes, prefills and decodes (default 2048; "
                        "0: no budget, every admitted prompt prefilled at once)")
    p.add_argument("--max-seqs", type=int, default=256)
    p.add_argument("--blocks", type=int, default=0,
                   help="pool blocks (default: every block the requests could need)")
    p.add_argument("--runner", choices=("plain", "fast", "fast-eager"), default=None,
                   help="default: fast on a GPU, plain on a CPU")
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="plan each step while the device runs the one before (auto: on "
                        "where the runner is a fast one on a GPU)")
    p.add_argument("--kv-dtype", choices=("auto", "int8"), default="auto",
                   help="the K/V cache: the model's dtype (auto) or the 8-bit cache")
    p.add_argument("--trace", type=int, default=0, metavar="STEPS",
                   help="keep this many steps of the host/GPU timeline in the JSON")
    p.add_argument("--keep-stamps", action="store_true",
                   help="keep every token's time in the JSON")
    p.add_argument("--no-peer", action="store_true", help="skip transformers")
    p.add_argument("--json", metavar="PATH", help="write every number to PATH")
    p.add_argument("--gguf", metavar="PATH", help="the model file (default: $PAGEDKV_GGUF, "
                   "else the installed package's)")
    args = p.parse_args(argv)
    check_workload(p, args)
    if args.max_seqs < 1:
        p.error("--max-seqs must be at least 1")
    if args.token_budget < 0:
        p.error("--token-budget must be at least 0")
    args.token_budget = args.token_budget or None
    args.overlap = {"auto": None, "on": True, "off": False}[args.overlap]
    args.kv_dtype = None if args.kv_dtype == "auto" else args.kv_dtype
    args.argv = argv
    r = run(args)
    print(table(r))
    _save(r, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
