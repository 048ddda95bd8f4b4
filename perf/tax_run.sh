#!/usr/bin/env bash
# The kernel benchmark beside one FlashInfer release on the lent H200 (issue 23: the paging
# tax and the current release), one call per release, from the repository root:
#   FI_WHEELS=.fi      NAME=kernels-h200-2026-12-02        bash perf/tax_run.sh  # 0.7.2.post1
#   FI_WHEELS=.fi-0214 NAME=kernels-h200-2026-12-02-fi0214 bash perf/tax_run.sh  # 0.2.14.post1
# FI_WHEELS: the wheels of scripts/flashinfer_wheels.sh (0.7.2.post1 and what its import
# needs) or of /work/shared/tools/flashinfer-wheel.sh (0.2.14.post1), carried in with the
# call; they go into a target of their own (/tmp/site-$NAME), so two releases never mix.
# Runs the staircase too (--staircase), so chapter 9 can read everything from one file.
# Writes $OUT/$NAME.json (the rows and the run's meta: flashinfer_version,
# flashinfer_prebuilt, the paging tax) and $OUT/$NAME.log. BENCH_ARGS adds arguments (say
# "--only 0 2" for a short check); BENCH_S caps the benchmark's seconds (default 540).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
NAME=${NAME:?set NAME, the file name of the results (without .json)}
FI_WHEELS=${FI_WHEELS:?set FI_WHEELS to the folder of the FlashInfer wheels}
site=/tmp/site-$NAME
rm -rf "$site"
python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
    "$FI_WHEELS"/*.whl || exit 1
export PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
export CUPY_CACHE_DIR=/tmp/cupy_cache
LOG=$OUT/$NAME.log
{ date -u
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw \
    --format=csv
  python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', \
numpy.__version__, 'torch', torch.__version__)"
  python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, \
flashinfer.__file__)"; } > "$LOG" 2>&1 || { cat "$LOG"; echo "FlashInfer does not import"; exit 1; }
timeout "${BENCH_S:-540}" python3 -m pagedkv.bench.kernels --json "$OUT/$NAME.json" \
    --reps 20 --staircase ${BENCH_ARGS:-} >> "$LOG" 2>&1
rc=$?
echo "bench exit $rc" >> "$LOG"
tail -70 "$LOG"
exit $rc
