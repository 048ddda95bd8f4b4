"""perf/front_load.py end to end, small: every stream is answered to its end, and the
numbers it prints are written (their values are this machine's, not checked)."""
from __future__ import annotations

import concurrent.futures
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "perf"))

import front_load  # noqa: E402


def test_a_small_run_answers_every_stream(tmp_path, capsys):
    out = tmp_path / "load.json"
    argv = ["--streams", "8", "--tokens", "20", "--step-ms", "2", "--json", str(out),
            "--deadline", "60"]
    # on a thread of its own: it runs an event loop, and one may be running on this thread
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(front_load.main, argv).result(timeout=150) == 0
    r = json.loads(out.read_text())
    assert r["steps"] >= 20                 # 20 tokens a stream, one a step
    assert r["tokens_per_chunk"] >= 1 and r["front_cpu_ms_per_step"] > 0
    assert r["send_ms_per_step"] >= 0 and r["streams"] == 8
    assert "steps/s of 500" in capsys.readouterr().out
