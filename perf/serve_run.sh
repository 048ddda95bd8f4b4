#!/usr/bin/env bash
# In-process serving benchmarks on a CUDA machine without a package index, in one call: the
# model file joined from its parts (each earlier call copies the part it carried to /tmp; this
# one brings the last part, .bigfile/sha256 and the wheels in .whls: perf/device_env.sh), then
# python -m pagedkv.bench.serve on
# nano-vllm's workload and on the spike (one 4,096-token prompt into 64 decodes) at each token
# budget of BUDGETS. JSON and logs under $OUT, named $NAME-*.
# Usage: NAME=serve-h200-DATE-TAG BUDGETS="256 512 2048" bash perf/serve_run.sh [bench flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/serve}; name=${NAME:-serve-h200}
mkdir -p "$out"
source perf/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
run() {   # run NAME ARGS...: one benchmark, its JSON and log
  local tag=$1; shift
  timeout 300 python3 -m pagedkv.bench.serve --no-peer --json "$out/$tag.json" "$@" 2>&1 \
    | tee "$out/$tag.log" | grep -v "it/s]$" | tail -${TAIL:-14} || status=1
}
[ -z "${NO_WORKLOAD:-}" ] && run "$name" "$@"
for budget in ${BUDGETS:-}; do
  run "$(echo "$name" | sed 's/^serve-/serve-spike-b'"$budget"'-/')" --spike 4096 \
    --token-budget "$budget" "$@"
done
exit $status
