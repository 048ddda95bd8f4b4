#!/usr/bin/env bash
# Speculative decoding on a CUDA machine without a package index, in one call (about 6
# minutes on an H100 or H200): the model file and wheels as perf/device_env.sh sets them up
# (the last model part, .bigfile/sha256 and .whls carried), then the STEPS asked for, logs and
# JSON under $OUT:
#   tests  tests/test_speculate_engine.py with its GPU cases, tests/test_speculate.py,
#          tests/test_truncate.py (about 1 minute)
#   bench  python -m pagedkv.bench.speculate: five workloads at batch 1, 8, 64 and 256, off,
#          on and the default, 128 new tokens, median of 3 (about 5 minutes; the JSON is
#          written after each batch, so a run cut short keeps the batches it finished)
# The JSON is named speculate-<card>-<date>.json (the card read from nvidia-smi: h100, h200),
# or NAME.json when NAME is set (several runs of one day: NAME=speculate-h100-2026-12-08-k7).
# Usage: DATE=2026-12-08 STEPS="tests bench" bash perf/speculate_run.sh [bench flags]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-artifacts/speculate}; date=${DATE:-$(date +%F)}
mkdir -p "$out"
source perf/device_env.sh || exit 1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
card=$(echo "$gpu" | grep -oiE 'h100|h200|a100|l40s?' | head -1 | tr 'A-Z' 'a-z')
echo "$gpu -> ${card:=gpu}"
name=${NAME:-speculate-$card-$date}
status=0
for s in ${STEPS:-tests bench}; do
  case $s in
    tests) echo "=== tests"
           timeout 150 python3 -m pytest -q -rs -p no:cacheprovider \
             tests/test_speculate_engine.py tests/test_speculate.py tests/test_truncate.py \
             > "$out/$card-$date-speculate-pytest.log" 2>&1 || { echo "(tests failed)"; status=1; }
           tail -${TAIL:-8} "$out/$card-$date-speculate-pytest.log" ;;
    bench) echo "=== bench"
           timeout 420 python3 -m pagedkv.bench.speculate \
             --json "$out/$name.json" "$@" > "$out/$name.log" 2>&1 || { echo "(bench failed)"; status=1; }
           tail -${TAIL:-25} "$out/$name.log" ;;
  esac
done
exit $status
