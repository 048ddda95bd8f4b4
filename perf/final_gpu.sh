#!/usr/bin/env bash
# One session's GPU checks and measurements, in as few device calls as the transfers allow
# (the model file travels in parts: each call copies the part it carried to /tmp, which the
# machine keeps while it stays warm, and perf/device_env.sh joins them). STEPS picks, in
# order, from:
#   part     copy the carried .bigfile parts to /tmp (nothing else)
#   tests    the package's tests on the GPU (pytest -n 8), with the model file and the
#            server's wheels (WHEELS; see the step)
#   ab       perf/engine_ab.sh: nano-vllm's workload in process, the code of .base/ and this
#            checkout's, and the sampled and greedy steps at batch 64
#   http     python -m pagedkv.bench.http at stream intervals 1 and 8, this checkout's code
#   nbval    the notebooks of book/ under nbval (the wheels of scripts/gpu_wheels.sh; NOTEBOOKS
#            names some, by default every one)
#   extra    EXTRA's commands, one a line (the perf scripts of the other issues)
# Logs and JSON under $OUT; DATE and CARD name them.
# Usage: STEPS="part tests" bash perf/final_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/final}; date=${DATE:-$(date +%F)}
card=${CARD:-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
header() {  # the "# key: value" lines pagedkv.provenance reads at the top of a log
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | head -1)"
  echo "# backend: $(python3 -c 'import pagedkv.backend as b; print(b.describe())')"
  echo "# commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
}
status=0
for s in ${STEPS:-part tests}; do
  echo "=== $s ($(date +%T))"
  case $s in
    part) for p in .bigfile/part*; do cp "$p" "/tmp/model.$(basename "$p")"; done ;;
    tests)
      # The model file and the server's wheels (WHEELS: .whls, or a smaller set of the same
      # without the notebook stack when the last model part leaves no room in the carry);
      # without them the model's and the server's tests fail for want of them, not of the code.
      source perf/device_env.sh || {
        echo "no model file or wheels: tests not run"; status=1; continue; }
      { header; PYTHONPATH=/tmp/site:$PWD timeout "${LIMIT:-300}" python3 -m pytest -q -rfE -n 8 \
        -p no:cacheprovider tests --ignore=tests/test_book_browser.py \
        --ignore=tests/test_jupyterlab.py --ignore=tests/test_live_figures.py \
        --ignore=tests/test_serve_browser.py --ignore=tests/test_serve_install.py \
        --deselect tests/test_allocator.py::test_close_returns_the_memory; } \
        > "$out/$card-$date-pytest.log" 2>&1 || status=1
      grep -E "^(FAILED|ERROR)|passed|failed" "$out/$card-$date-pytest.log" | tail -25 ;;
    ab) OUT=$out NAME=serve-$card-$date ROUNDS=${ROUNDS:-1} WHEELS=${WHEELS:-.whlb} \
          bash perf/engine_ab.sh || status=1 ;;
    http) python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/site .whls/*.whl
      source perf/device_env.sh || { status=1; continue; }
      timeout 400 python3 -m pagedkv.bench.http --stream-interval 1 8 --ttft-probe 10 \
        --token-budget 2048 --json "$out/http-$card-$date.json" > "$out/http-$card-$date.log" \
        2>&1 || status=1
      tail -25 "$out/http-$card-$date.log" ;;
    nbval) python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/site .whls/*.whl
      source perf/device_env.sh || { status=1; continue; }
      { header; timeout "${LIMIT:-500}" python3 -m pytest -q -rfE -n "${WORKERS:-12}" \
        --dist loadfile -p no:cacheprovider --nbval-lax --nbval-current-env \
        --nbval-sanitize-with tests/nbval_sanitize.cfg ${NOTEBOOKS:-book/}; } \
        > "$out/$card-$date-nbval.log" 2>&1 || status=1
      grep -E "^(FAILED|ERROR)|passed|failed" "$out/$card-$date-nbval.log" | tail -25 ;;
    extra) while IFS= read -r cmd; do
        [ -n "$cmd" ] || continue
        echo "--- $cmd"; bash -c "$cmd" || status=1
      done <<< "${EXTRA:-}" ;;
  esac
done
exit $status
