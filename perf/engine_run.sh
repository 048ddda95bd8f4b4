#!/usr/bin/env bash
# The engine's GPU checks and measurements on a CUDA machine without a package index: the
# model file joined from its parts (each earlier call copies the part it carried to /tmp;
# this one brings the last part, .bigfile/sha256 and the wheels in .whls: perf/device_env.sh),
# then the STEPS asked for, each under its own time limit, logs and JSON under $OUT:
#   tests    the runner's, the engine's and the prefill kernel's tests (GPU cases run)
#   trace    perf/step_trace.py: decode steps traced (launches, kernels, graph nodes)
#   prefill  perf/model_prefill.py: the whole model's prefill of 4,096 tokens beside transformers
#   serve    perf/serve_run.sh: the workload and the spike (BUDGETS)
# Usage: DATE=2026-12-03 STEPS="tests trace" bash perf/engine_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/engine}; date=${DATE:-$(date +%F)}
mkdir -p "$out"
source perf/device_env.sh || exit 1
status=0
step() {   # step NAME LIMIT COMMAND...: one step, its output in $out/NAME.log
  local name=$1 limit=$2; shift 2
  echo "=== $name"
  timeout "$limit" "$@" > "$out/$name.log" 2>&1 || { echo "($name: exit $?)"; status=1; }
  grep -v "it/s]$" "$out/$name.log" | tail -${TAIL:-25}
}
for s in ${STEPS:-tests trace prefill serve}; do
  case $s in
    tests) step "h200-$date-engine-pytest" 300 python3 -m pytest -q -rs \
             -p no:cacheprovider tests/test_runner.py tests/test_overlap.py \
             tests/test_chunked_prefill.py tests/test_prefill_attention.py ;;
    trace) step "step-trace-h200-$date" 240 python3 perf/step_trace.py \
             --json "$out/step-trace-h200-$date.json" ;;
    prefill) step "model-prefill-h200-$date" 240 python3 perf/model_prefill.py \
             --tokens 4096 --json "$out/model-prefill-h200-$date.json" ;;
    serve) OUT=$out NAME="serve-h200-$date" BUDGETS="${BUDGETS:-256 512 2048}" \
             bash perf/serve_run.sh || status=1 ;;
  esac
done
exit $status
