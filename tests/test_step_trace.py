"""perf/step_trace.py without a GPU: its trace parser on a small synthetic trace whose counts
are worked out by hand, and the whole script in its --dry mode (a tiny model on NumPy)."""
from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest

PATH = pathlib.Path(__file__).resolve().parents[1] / "perf" / "step_trace.py"
spec = importlib.util.spec_from_file_location("step_trace", PATH)
st = importlib.util.module_from_spec(spec)
spec.loader.exec_module(st)


def test_api_names_lose_their_suffixes():
    assert [st.api_name(n) for n in ("cudaLaunchKernel_v7000", "cuLaunchKernel_ptsz",
                                     "cuMemcpyDtoH_v2", "cudaGraphLaunch")] == [
        "cudaLaunchKernel", "cuLaunchKernel", "cuMemcpyDtoH", "cudaGraphLaunch"]


def test_busy_is_the_union_of_the_spans():
    assert st.busy_us([(0, 4), (2, 6), (10, 11), (10.5, 10.7)]) == pytest.approx(7.0)
    assert st.busy_us([]) == 0


def test_driver_launch_inside_a_runtime_call_is_not_counted_twice():
    ev = [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5, "tid": 1},
          {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 1, "dur": 2, "tid": 1},
          {"cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 1, "dur": 2, "tid": 2},
          {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 6, "dur": 2, "tid": 1}]
    assert [(e["ts"], e["tid"]) for e in st.host_launches(ev)] == [(0, 1), (1, 2), (6, 1)]


def test_parse_the_synthetic_trace():
    runs = st.parse_trace(st.synthetic_trace())
    eager, graph = runs["eager"]["median"], runs["graph"]["median"]
    assert (eager["host_launches"], eager["graph_launches"], eager["gpu_kernels"]) == (3, 0, 3)
    assert (eager["host_waits"], eager["host_wait_us"]) == (1, 30.0)
    assert eager["gpu_busy_us"] == 16.0 and eager["wall_us"] == 100.0
    assert (graph["host_launches"], graph["graph_launches"], graph["gpu_kernels"],
            graph["gpu_copies"]) == (1, 1, 2, 1)
    assert graph["gpu_busy_us"] == 9.0                  # 212 to 221 µs, kernels and copy
    t = runs["graph"]["timeline"]
    assert t["host_launch"] == [[5.0, 11.0]] and t["gpu_kernel"] == [[12.0, 15.0],
                                                                     [15.0, 20.0]]
    assert runs["eager"]["kernels_by_name"] == {"gemv": 2, "rms_norm<1>": 1}


def test_dry_run_writes_every_section(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert st.main(["--dry", "--json", str(out), "--timing-steps", "3", "--repeat", "1",
                    "--batches", "1", "2"]) == 0
    r = json.loads(out.read_text())
    assert r["dry"] and r["trace"]["synthetic"]
    assert set(r["timing"]["engine_step_ms"]) == {f"{a}/{b}" for a, b in st.CONFIGS}
    assert all(set(v) == {"1", "2"} and all(x["step_ms"] > 0 for x in v.values())
               for v in r["timing"]["engine_step_ms"].values())
    assert set(r["timing"]["runner_ms"]) == {"plain", "fast-eager", "fast"}
    assert {"date", "command", "machine"} <= set(r)
    assert re.search(r"runner +plain batch +2:", capsys.readouterr().out)


def test_a_kernel_without_its_launch_call_is_placed_by_time():
    events = st.synthetic_trace() + [
        {"ph": "X", "cat": "kernel", "name": "orphan", "ts": 50.0, "dur": 4.0, "pid": 1,
         "tid": 9, "args": {"correlation": 999}}]
    m = st.parse_trace(events)["eager"]["median"]
    assert (m["gpu_kernels"], m["gpu_unmatched"], m["gpu_busy_us"]) == (4, 1, 20.0)
    assert st.parse_trace(st.synthetic_trace())["eager"]["median"]["gpu_unmatched"] == 0
