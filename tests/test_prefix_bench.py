"""The prefix-hit benchmark runs and reports what it promises (timings are not checked)."""
import json
import sys

import pytest

from pagedkv.bench import prefix


def test_prefix_bench_json(capsys):
    assert prefix.main(["--json", "--repeat", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert isinstance(out["teaching_prefix_hit_us"], float) and out["teaching_prefix_hit_us"] > 0


def test_prefix_bench_table_and_missing_peer(capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "nano" not in p])
    monkeypatch.delitem(sys.modules, "nanovllm", raising=False)
    assert prefix.main(["--repeat", "1", "--peers"]) == 0
    text = capsys.readouterr().out
    assert "teaching core" in text and "nano-vllm: not importable" in text


def test_prefix_bench_rejects_zero_repeats():
    with pytest.raises(SystemExit):
        prefix.main(["--repeat", "0"])


def test_the_trace_hits_127_blocks():
    assert len(prefix.prefix_hit(2)) == len(prefix.prefix_hit(2, "fast", True)) == 2


def test_the_bookkeeping_benchmark_reports_the_prefix_hit(capsys):
    from pagedkv.bench.__main__ import main
    assert main(["--json", "--repeat", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("prefix_hit_us", "prefix_hit_list_us", "teaching_prefix_hit_us"):
        assert isinstance(out[key], float) and 0 < out[key + "_min"] <= out[key], key
