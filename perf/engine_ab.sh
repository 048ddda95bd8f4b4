#!/usr/bin/env bash
# The engine before and after a change, in one lease on one card: nano-vllm's workload in
# process (python -m pagedkv.bench.serve --no-peer), the older code (a copy of its package in
# .base/, carried) and this checkout's, ROUNDS times interleaved; then the sampled and greedy
# decode steps at one batch (perf/sampled_step.py, both codes). The model file comes from
# perf/device_env.sh (joined from the parts carried in earlier calls). JSON and logs under
# $OUT, named $NAME-{base,new}-N.json.
# Usage: NAME=serve-h100-2026-12-07 ROUNDS=2 bash perf/engine_ab.sh
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/ab}; name=${NAME:-serve-ab}; rounds=${ROUNDS:-2}
mkdir -p "$out"
source perf/device_env.sh || exit 1
here=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
serve() {   # serve CODE TAG: one run of the workload with the package in CODE
  local code=$1 tag=$2
  (cd "$code" && PYTHONPATH=/tmp/site:$code timeout 240 python3 -m pagedkv.bench.serve --no-peer \
     --json "$out/$name-$tag.json" > "$out/$name-$tag.log" 2>&1) || status=1
  grep -E "output tokens/s|TTFT p50|ITL p50|idle|steps" "$out/$name-$tag.log" | head -6
}
for i in $(seq 1 "$rounds"); do
  echo "=== round $i: base"; serve "$here/.base" "base-$i"
  echo "=== round $i: new";  serve "$here" "new-$i"
done
echo "=== sampled and greedy steps at batch ${BATCH:-64}"
for code in base new; do
  dir=$here; [ $code = base ] && dir=$here/.base
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 200 python3 perf/sampled_step.py \
     --batch "${BATCH:-64}" --steps 100 --json "$out/sampled-$name-$code.json" \
     > "$out/sampled-$name-$code.log" 2>&1) || status=1
  echo "$code: $(tail -1 "$out/sampled-$name-$code.log")"
done
exit $status
