#!/usr/bin/env bash
# The 8-bit K/V cache on a CUDA machine without a package index (perf/device_env.sh brings the
# model file and the wheels), phase by phase; results and logs under $OUT (artifacts/kv8),
# named with $TAG (the card and the date: h100-2026-12-08, say):
#   tests     pytest of the kernels on the GPU: tests/test_kv8.py (int8 decode on both
#             kernels, prefill, the write kernels bit for bit, the engine), and the float16
#             suites it touches (test_kernels, test_prefill_attention, test_norm_gemv,
#             test_runner)                                                    (~4 min)
#   kernels   perf/kv8_kernels.py: decode, prefill and K/V write, int8 beside float16 (~1 min)
#   accuracy  perf/kv8_accuracy.py on the float16 model: teacher-forced top-1 and
#             log-likelihood on the fixed text, greedy over 60 prompts       (~1 min)
#   serve     python -m pagedkv.bench.serve on nano-vllm's workload, float16 then int8 K/V:
#             output tokens/s and the run's floor                             (~1 min)
#   trace     perf/serve_trace.py, float16 then int8: device time by kernel class beside
#             each class's floor                                             (~2 min)
# Usage: TAG=h100-DATE PHASES="tests kernels accuracy serve trace" bash perf/kv8_run.sh
# Every phase's exit status is kept; the script fails if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/kv8}; tag=${TAG:-gpu-$(date +%F)}
phases=${PHASES:-tests kernels accuracy serve trace}
mkdir -p "$out"
source perf/device_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
status=0
want() { [[ " $phases " == *" $1 "* ]]; }
step() {   # step NAME CMD...: run with a log, keep its status
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$out/$name.log" 2>&1 || { status=1; echo "   FAILED ($name)"; }
  grep -v "it/s]$" "$out/$name.log" | tail -${TAIL:-12}
}
if want tests; then
  step "tests-$tag" timeout 540 python3 -m pytest -q -x -p no:cacheprovider tests/test_kv8.py \
    tests/test_kernels.py tests/test_prefill_attention.py tests/test_norm_gemv.py \
    tests/test_runner.py
fi
want kernels && step "kv8-kernels-$tag" timeout 300 python3 perf/kv8_kernels.py \
  --json "$out/kv8-kernels-$tag.json"
want accuracy && step "kv8-accuracy-$tag" timeout 300 python3 perf/kv8_accuracy.py \
  --json "$out/kv8-accuracy-$tag.json"
if want serve; then
  step "serve-f16-$tag" timeout 300 python3 -m pagedkv.bench.serve --no-peer \
    --json "$out/serve-f16-$tag.json"
  step "serve-int8-$tag" timeout 300 python3 -m pagedkv.bench.serve --no-peer --kv-dtype int8 \
    --json "$out/serve-int8-$tag.json"
fi
if want trace; then
  step "serve-trace-f16-$tag" timeout 300 python3 perf/serve_trace.py \
    --json "$out/serve-trace-f16-$tag.json"
  step "serve-trace-int8-$tag" timeout 300 python3 perf/serve_trace.py --kv-dtype int8 \
    --json "$out/serve-trace-int8-$tag.json"
fi
exit $status
