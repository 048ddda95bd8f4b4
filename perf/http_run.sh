#!/usr/bin/env bash
# Serving through the OpenAI API on a CUDA machine without a package index, in one call:
# the model file joined from its parts (.bigfile/part*, checked against .bigfile/sha256),
# the server's wheels (WHEELS, default .whls: starlette, uvicorn, gguf, openai and what
# openai needs that the machine lacks), then python -m pagedkv.bench.http on nano-vllm's
# workload (the server and the engine in process, same requests), and the server's tests.
# Logs and JSON under $OUT. Usage: NAME=http-h200-DATE bash perf/http_run.sh [bench flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/http}; name=${NAME:-http-h200}
mkdir -p "$out"
source perf/device_env.sh || exit 1   # the model file and the wheels
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
for budget in ${BUDGETS:-2048}; do      # one run a token budget (server and engine alike)
  timeout 300 python3 -m pagedkv.bench.http --ttft-probe 10 --token-budget "$budget" \
    --json "$out/$name-b$budget.json" "$@" 2>&1 | tee "$out/$name-b$budget.log" \
    | grep -v "it/s]$" | tail -32 || status=1
done
if [ -n "${TESTS:-}" ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider -x $TESTS 2>&1 \
    | tee "$out/$name-pytest.log" | tail -15 || status=1
fi
exit $status
