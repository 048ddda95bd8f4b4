"""perf/climb.py, the run chapter 12's climb table is read from: its quick run (a tiny
model, on whatever backend is here) writes every rung in order with one set of goals, and
fails when a rung's greedy tokens are not the plain pass's."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedkv.kernels.fused import argmax_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def climb(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "perf"))      # its own `from decode_timing ...`
    spec = importlib.util.spec_from_file_location("climb", ROOT / "perf" / "climb.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_quick_run_writes_every_rung_with_one_set_of_goals(climb, tmp_path, capsys):
    out = tmp_path / "climb.json"
    assert climb.main(["--quick", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["name"] for r in result["rungs"]] == [name for name, _, _ in climb.RUNGS] == [
        "plain", "eager", "graphs", "folds", "pdl"]
    assert result["goals"] == climb.GOALS and result["batches"] == [1, 2]
    assert result["command"] == "python perf/climb.py --quick --json " + str(out)
    assert result["date"][:4].isdigit()
    assert result["backend"]["backend"] in ("numpy", "cupy")
    for rung in result["rungs"]:
        assert rung["tokens"]["identical"], rung["name"]
        assert len(rung["tokens"]["prompts"]) == 3
        for b, r in rung["batches"].items():
            assert r["step_ms"] > 0 and r["pass_ms"] > 0, (rung["name"], b)
            assert (r["nodes"] is None) == (r["replay_ms"] is None)
    folds = result["rungs"][3]["batches"]
    assert folds["1"]["applies"] and folds["2"]["applies"]      # up to GEMV_AUTO_ROWS rows
    printed = capsys.readouterr().out
    assert "goals: at most 150 nodes at batch 1" in printed


def test_a_rung_whose_tokens_differ_fails_the_run(climb, tmp_path, monkeypatch, capsys):
    class Biased(climb.FastRunner):                   # a pass whose logits favour token 7
        def _pass(self, v):
            super()._pass(v)
            v.logits[:, 7] += 1e4
            argmax_rows(v.logits, out=v.greedy)

    monkeypatch.setattr(climb, "FastRunner", Biased)
    out = tmp_path / "climb.json"
    assert climb.main(["--quick", "--json", str(out)]) == 1
    result = json.loads(out.read_text())                  # written before the verdict
    same = {r["name"]: r["tokens"]["identical"] for r in result["rungs"]}
    assert same == {"plain": True, "eager": False, "graphs": False, "folds": False,
                    "pdl": False}
    first = result["rungs"][1]["tokens"]["prompts"][0]
    assert first["first_difference"] is not None and first["plain_margin"] >= 0
    err = capsys.readouterr().err
    assert "differ from the plain pass's: eager, graphs, folds, pdl" in err


def test_compare_keeps_the_plain_margin_at_the_first_difference(climb):
    plain = [([5, 6, 7], [2.0, 0.01, 3.0]), ([1, 2], [1.0, 1.0])]
    got = climb.compare([[5, 9, 7], [1, 2]], plain)
    assert got == {"identical": False, "prompts": [
        {"first_difference": 1, "plain_margin": 0.01},
        {"first_difference": None, "plain_margin": None}]}


def test_the_script_runs_as_a_command(tmp_path):
    out = tmp_path / "c.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, str(ROOT / "perf" / "climb.py"), "--quick",
                           "--batches", "1", "--json", str(out)],
                          capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert "rung batch  nodes  replay ms" in done.stdout
    assert json.loads(out.read_text())["batches"] == [1]
