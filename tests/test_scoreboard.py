"""The scoreboard reads the newest committed result of each kind, by the time the file
records, and shows every engine a file measured: a newer file of the same schema, or a peer
added to a benchmark, reaches the page without an edit."""
from __future__ import annotations

import json

import pytest
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from pagedkv import provenance
from pagedkv.plots import scoreboard as board


def served(rate, date, spike=0, **peers):
    engine = lambda r: {"output_tokens_per_s": r, "ttft_ms": {"p50": 1.0, "p99": 2.0},  # noqa
                        "itl_ms": {"p50": 0.1, "p99": 0.2}}
    return {"date": date, "workload": {"requests": 4, "spike": spike, "rate": None},
            "pagedkv": engine(rate), **{k: engine(v) for k, v in peers.items()},
            "transformers": "not run (--no-peer)"}


def write(folder, name, data):
    (folder / name).write_text(json.dumps(data))


def test_the_newest_by_the_time_it_records_not_by_its_name(tmp_path):
    write(tmp_path, "serve-h200-2026-12-09.json", served(1, "2026-12-09T01:00:00"))
    write(tmp_path, "serve-h100-2026-12-08-late.json", served(2, "2026-12-09T23:59:00"))
    write(tmp_path, "serve-spike-h100-2026-12-10.json",
          served(3, "2026-12-10T00:00:00", spike=4096))         # another workload
    path, data = provenance.newest("serve-*.json", provenance.is_serve, tmp_path)
    assert path.name == "serve-h100-2026-12-08-late.json" and data["pagedkv"][
        "output_tokens_per_s"] == 2
    write(tmp_path, "serve-h200-2026-12-11.json", served(5, "2026-12-11T08:00"))
    assert provenance.newest("serve-*.json", provenance.is_serve, tmp_path)[0].name == \
        "serve-h200-2026-12-11.json"
    with pytest.raises(FileNotFoundError):
        provenance.newest("serve-*.json", provenance.is_serve_with_peer, tmp_path)


def test_a_peer_in_the_file_is_a_row(tmp_path):
    write(tmp_path, "serve-h200-2026-12-09.json",
          served(40, "2026-12-09", **{"llama.cpp": 20.0}))
    _, data = provenance.newest("serve-*.json", provenance.is_serve_with_peer, tmp_path)
    table = board.rates(data)
    assert list(table) == ["pagedkv", "llama.cpp"]
    assert table["llama.cpp"] == {"tokens_per_s": 20.0, "ttft_p50": 1.0, "ttft_p99": 2.0,
                                  "itl_p50": 0.1, "itl_p99": 0.2}


def test_step_table_takes_the_graph_runner_and_every_peer_then_the_floor():
    step = {b: {"step_ms": 1.0} for b in ("1", "8")}
    data = {"pagedkv_plain": step, "floor": step, "pagedkv_graph": step,
            "transformers": step, "llama.cpp": step, "breakdown_ms": {"1": {"total": 3}},
            "programmatic_launch": {"available": True}}
    assert list(board.step_table(data)) == ["pagedkv_graph", "transformers", "llama.cpp",
                                            "floor"]
    with pytest.raises(ValueError):
        board.step_table({"transformers": step})


def test_the_committed_results_fill_the_scoreboard():
    files = provenance.scoreboard_files()
    assert set(files) == {"step", "serve", "serve_peer", "http"}
    assert "transformers_compiled" in board.step_table(files["step"][1])
    assert len(board.rates(files["serve_peer"][1])) > 1
    assert set(board.rates(files["http"][1])) >= {"http", "engine"}


def test_draw_scoreboard_bars():
    fig = board.draw_scoreboard({"pagedkv": {"1": 0.7, "8": 1.0},
                                 "peer": {"1": 3.0, "8": 3.5}},
                                {"pagedkv, in process": 40_000.0, "peer": 800.0}, title="t")
    assert isinstance(fig, Figure)
    left, right = fig.axes
    assert [b.get_height() for b in left.patches if isinstance(b, Rectangle)] == [
        0.7, 1.0, 3.0, 3.5]
    assert [b.get_width() for b in right.patches] == [40_000.0, 800.0]
    with pytest.raises(ValueError):
        board.draw_scoreboard({}, {"a": 1.0})
