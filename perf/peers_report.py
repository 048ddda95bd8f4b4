"""One JSON from a peers run (perf/peers_run.sh): llama.cpp's benchmarks and pagedkv's beside them.

    python perf/peers_report.py DIR [--json OUT]

DIR holds what perf/peers_run.sh left there:

* ``card.txt`` — ``nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap
  --format=csv,noheader``;
* ``build.txt`` — ``key=value`` lines: the sdist (``source``), llama.cpp's version, the CMake
  line, the CUDA architectures, the build's seconds;
* ``llama-bench.json`` — ``llama-bench -o json`` (a JSON array, one object per test: ``pp512``
  has ``n_prompt`` 512 and ``n_gen`` 0, ``tg128`` the other way round; ``avg_ts`` tokens a
  second, ``avg_ns`` a test's time);
* ``llama-batched-bench.jsonl`` — ``llama-batched-bench --output-format jsonl`` (one object per
  line for each number of sequences ``pl``: ``pp`` prompt and ``tg`` generated tokens each,
  ``t_tg`` seconds to generate them all, so a decode step of ``pl`` sequences is ``t_tg / tg``);
  log lines around them are skipped;
* ``model.json`` — ``python -m pagedkv.bench.model --json`` (its ``pagedkv_graph``,
  ``transformers_compiled`` and ``floor`` step times per batch), if it ran.

The JSON: the card and the date, each tool's numbers as measured, and ``decode_step_ms``: per
batch, pagedkv's graph step, llama.cpp's batched decode step (and ``llama-bench`` tg's time a
token at batch 1), compiled transformers' step and the floor, side by side.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys


def parse_card(text: str) -> dict:
    """``name, driver, memory, compute capability`` (nvidia-smi's CSV line) as a dict."""
    line = next((x for x in text.splitlines() if x.strip()), "")
    parts = [p.strip() for p in line.split(",")]
    keys = ("name", "driver_version", "memory_total", "compute_capability")
    return dict(zip(keys, parts)) if parts and parts[0] else {"name": "unknown"}


def parse_build(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            out[key.strip()] = value.strip()
    if "build_s" in out:
        out["build_s"] = float(out["build_s"])
    return out


def parse_llama_bench(text: str) -> list:
    """``llama-bench -o json``: each test's name (``pp512``, ``tg128``, or ``pp512+tg128``),
    tokens a second (mean and deviation), milliseconds a token, and what it ran with."""
    rows = []
    for r in json.loads(text):
        n_p, n_g = int(r.get("n_prompt", 0)), int(r.get("n_gen", 0))
        name = "+".join(x for x in (f"pp{n_p}" if n_p else "", f"tg{n_g}" if n_g else "") if x)
        ts = float(r["avg_ts"])
        rows.append({"test": name, "tokens_per_s": ts,
                     "tokens_per_s_stddev": float(r.get("stddev_ts", 0.0)),
                     "ms_per_token": 1e3 / ts if ts else None,
                     "avg_ns": int(r.get("avg_ns", 0)),
                     **{k: r.get(k) for k in ("n_batch", "n_ubatch", "flash_attn", "type_k",
                                              "type_v", "n_gpu_layers", "model_type",
                                              "model_size", "build_commit", "build_number",
                                              "gpu_info", "backends", "test_time")
                        if k in r}})
    return rows


def parse_batched_bench(text: str) -> list:
    """``llama-batched-bench --output-format jsonl``: per number of sequences, the decode
    step (``t_tg / tg``), generation and prefill tokens a second; other lines skipped."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("{") and "speed_tg" in line):
            continue
        r = json.loads(line)
        rows.append({"sequences": int(r["pl"]), "prompt_tokens": int(r["pp"]),
                     "generated_tokens": int(r["tg"]),
                     "decode_step_ms": 1e3 * float(r["t_tg"]) / int(r["tg"]),
                     "decode_tokens_per_s": float(r["speed_tg"]),
                     "prefill_tokens_per_s": float(r["speed_pp"]),
                     "flash_attn": r.get("flash_attn"), "n_kv_max": r.get("n_kv_max"),
                     "n_gpu_layers": r.get("n_gpu_layers")})
    return rows


def side_by_side(bench: list, batched: list, model: dict | None) -> dict:
    """Per batch: pagedkv's graph step, llama.cpp's decode step, compiled transformers', the
    floor (ms); and at batch 1 llama-bench's tg time a token."""
    out = {}
    batches = {r["sequences"] for r in batched}
    if model:
        batches |= {int(b) for b in model.get("pagedkv_graph", {})}
    for b in sorted(batches):
        row = {}
        for r in batched:
            if r["sequences"] == b:
                row["llama_cpp_batched_bench"] = r["decode_step_ms"]
        if model:
            for key, name in (("pagedkv_graph", "pagedkv_graph"),
                              ("transformers_compiled", "transformers_compiled"),
                              ("floor", "floor")):
                got = model.get(key, {})
                if isinstance(got, dict) and str(b) in got:
                    row[name] = got[str(b)].get("step_ms")
        if b == 1:
            tg = [r for r in bench if r["test"].startswith("tg")]
            if tg:
                row["llama_cpp_bench_tg"] = tg[0]["ms_per_token"]
        out[str(b)] = row
    return out


def assemble(d: pathlib.Path, command: str = "") -> dict:
    """The report of the run whose files are in ``d`` (a missing file: that part is absent,
    with the reason)."""
    def read(name):
        p = d / name
        return p.read_text() if p.exists() else None

    r = {"command": command or f"python perf/peers_report.py {d}",
         "date": datetime.datetime.now().isoformat(timespec="seconds"),
         "card": parse_card(read("card.txt") or ""), "build": parse_build(read("build.txt") or "")}
    text = read("llama-bench.json")
    try:
        r["llama_bench"] = parse_llama_bench(text) if text else "not run"
    except (ValueError, KeyError) as exc:
        r["llama_bench"] = f"unreadable ({type(exc).__name__}: {exc})"
    text = read("llama-batched-bench.jsonl")
    r["llama_batched_bench"] = parse_batched_bench(text) if text else "not run"
    text = read("model.json")
    model = json.loads(text) if text else None
    if model:
        r["pagedkv_bench_model"] = {k: model.get(k) for k in (
            "command", "date", "dtype", "prompt_tokens", "steps", "pagedkv_graph",
            "transformers_compiled", "floor", "copy_bytes_per_s", "transformers_version")}
    else:
        r["pagedkv_bench_model"] = "not run"
    bench = r["llama_bench"] if isinstance(r["llama_bench"], list) else []
    batched = r["llama_batched_bench"] if isinstance(r["llama_batched_bench"], list) else []
    r["decode_step_ms"] = side_by_side(bench, batched, model)
    return r


def table(r: dict) -> str:
    cols = ("pagedkv_graph", "llama_cpp_batched_bench", "llama_cpp_bench_tg",
            "transformers_compiled", "floor")
    lines = [f"{r['card'].get('name', '?')}, {r['date']}: a decode step, ms",
             f"{'batch':>6}" + "".join(f"{c:>26}" for c in cols)]
    for b, row in r["decode_step_ms"].items():
        lines.append(f"{b:>6}" + "".join(
            f"{row[c]:>26.3f}" if row.get(c) is not None else f"{'-':>26}" for c in cols))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", type=pathlib.Path)
    p.add_argument("--json", type=pathlib.Path, help="where to write (default DIR/peers.json)")
    args = p.parse_args(argv)
    r = assemble(args.dir, "python perf/peers_report.py " + " ".join(
        sys.argv[1:] if argv is None else argv))
    out = args.json or args.dir / "peers.json"
    out.write_text(json.dumps(r, indent=1) + "\n")
    print(table(r))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
