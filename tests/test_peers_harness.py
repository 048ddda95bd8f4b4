"""The GPU scripts' CPU-checkable parts: perf/peers_run.sh's command lines (its DRY mode), the
report perf/peers_report.py assembles from canned outputs of llama-bench, llama-batched-bench
and pagedkv.bench.model (tests/data/peers: outputs of the tools' own printers), and
perf/serve_trace.py's kernel classes."""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests/data/peers"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "perf" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("cap,arch", [("9.0", "90"), ("8.9", "89")])
def test_peers_run_commands(tmp_path, cap, arch):
    """DRY=1 prints every command and runs none; the command lines it records are the ones
    llama.cpp's own tools take (flags checked against the packed sources' help: -fa
    on|off|auto, -o json, --output-format jsonl)."""
    env = dict(os.environ, DRY="1", GGUF="/models/smol.gguf", OUT=str(tmp_path),
               CARD=f"NVIDIA H100 80GB HBM3, 570.133.20, 81559 MiB, {cap}",
               PHASES="build bench model report", LCPP="/tmp/lcpp-test")
    r = subprocess.run(["bash", str(ROOT / "perf/peers_run.sh"), str(tmp_path / "x.tgz")],
                       env=env, capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.returncode == 0, r.stderr
    build = dict(line.split("=", 1) for line in (tmp_path / "build.txt").read_text()
                 .splitlines())
    assert f"-DCMAKE_CUDA_ARCHITECTURES={arch}" in build["cmake"]
    assert "-DGGML_CUDA=ON" in build["cmake"] and "-G Ninja" in build["cmake"]
    assert build["build"].endswith("--target llama-bench llama-batched-bench")
    assert build["llama_bench"].split()[1:] == [
        "-m", "/models/smol.gguf", "-ngl", "99", "-fa", "on", "-p", "512", "-n", "128",
        "-r", "5", "-o", "json"]
    batched = build["llama_batched_bench"].split()
    assert batched[batched.index("-c") + 1] == str(256 * 256)        # every sequence fits
    assert batched[batched.index("-npl") + 1] == "1,8,64,256"
    assert batched[-2:] == ["--output-format", "jsonl"]
    assert build["pagedkv_bench_model"].split()[1:5] == ["-m", "pagedkv.bench.model",
                                                         "--batches", "1"]
    assert "+ python3 perf/peers_report.py" in r.stderr
    assert (tmp_path / "card.txt").read_text().startswith("NVIDIA H100")


def test_peers_report_from_canned_outputs(tmp_path):
    rep = _load("peers_report")
    for f in DATA.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "build.txt").write_text("source=llama.cpp.tgz\nbuild_s=231\n"
                                        "cuda_architectures=90\n")
    r = rep.assemble(tmp_path)
    assert r["card"] == {"name": "NVIDIA H200", "driver_version": "570.133.20",
                         "memory_total": "143771 MiB", "compute_capability": "9.0"}
    assert r["build"]["build_s"] == 231.0
    tests = {row["test"]: row for row in r["llama_bench"]}
    assert set(tests) == {"pp16", "tg8"}
    assert tests["tg8"]["ms_per_token"] == pytest.approx(1e3 / tests["tg8"]["tokens_per_s"])
    batched = {row["sequences"]: row for row in r["llama_batched_bench"]}
    assert set(batched) == {1, 2}
    line = next(json.loads(x) for x in (DATA / "llama-batched-bench.jsonl").read_text()
                .splitlines() if x.startswith("{") and '"pl": 2' in x)
    assert batched[2]["decode_step_ms"] == pytest.approx(1e3 * line["t_tg"] / line["tg"])
    steps = r["decode_step_ms"]
    assert set(steps) == {"1", "2", "8", "64", "256"}
    assert steps["1"]["llama_cpp_bench_tg"] == tests["tg8"]["ms_per_token"]
    assert steps["8"]["pagedkv_graph"] == pytest.approx(1.0937875161293078)
    assert steps["256"]["transformers_compiled"] > steps["1"]["transformers_compiled"]
    text = rep.table(r)
    assert text.splitlines()[0].startswith("NVIDIA H200") and len(text.splitlines()) == 7
    assert rep.main([str(tmp_path)]) == 0 and (tmp_path / "peers.json").exists()


def test_peers_report_says_what_did_not_run(tmp_path):
    rep = _load("peers_report")
    (tmp_path / "card.txt").write_text("NVIDIA H100 80GB HBM3, 570, 81559 MiB, 9.0\n")
    (tmp_path / "llama-bench.json").write_text("not json")
    r = rep.assemble(tmp_path)
    assert r["llama_bench"].startswith("unreadable")
    assert r["llama_batched_bench"] == "not run" and r["pagedkv_bench_model"] == "not run"
    assert r["decode_step_ms"] == {}


def test_serve_trace_classes():
    st = _load("serve_trace")
    names = {"paged_decode<1, 64, 3, 16, 4, 2, 2, 1, 1>": "decode attention",
             "paged_decode_tc<1, 64, 8, 16, 4, 3>": "decode attention",
             "merge_splits<1>": "decode attention",
             "paged_prefill<1, 64, 3, 16, 4, 1, 64, 2, 1>": "prefill attention",
             "sm90_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x64": "GEMM",
             "nvjet_hsh_128x64_64x4_2x1_v_bz_coopA_NNT": "GEMM",
             "norm_gemv_rope8_t<1, 1>": "GEMM", "gemv_t<1, 1, 2, 4>": "GEMM",
             "rope_write_kv8<1>": "norm, RoPE, K/V write", "write_kv8<1>":
             "norm, RoPE, K/V write", "rms_norm<1>": "norm, RoPE, K/V write",
             "argmax_rows": "sampling", "Memcpy DtoH (Device -> Pinned)": "copies",
             "copy_blocks<uint4, 2>": "copies", "cupy_multiply__float16": "other"}
    assert {n: st.classify(n) for n in names} == names
    r = st.dry()
    assert r["synthetic"] and r["classes"]["GEMM"]["kernels"] == 3
    total = sum(row["device_s"] for row in r["classes"].values())
    assert total == pytest.approx(0.0926)
    assert r["classes"]["copies"]["floor_s"] is None
    assert all(row["over_floor"] > 1 for row in r["classes"].values() if row["floor_s"])
