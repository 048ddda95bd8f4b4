#!/usr/bin/env bash
# One call on the lent H200, everything the kernels need checked and timed, logs in $OUT:
#   1. FlashInfer's JIT modules start compiling in the background (CPU work);
#   2. every kernel test (tests/test_kernels.py, tests/test_staircase.py) on the GPU;
#   3. compute-sanitizer memcheck over a subset of those tests;
#   4. the benchmark with its peers and the staircase (python -m pagedkv.bench.kernels);
#   5. chapter 9 under nbval, reading the benchmark's JSON just written;
#   6. compute-sanitizer racecheck over the shared-memory kernels' tests.
# Run from the repository root with FlashInfer's wheel in $FI_WHEELS (default ../../.whl-fi)
# and the notebook wheels in $NB_WHEELS (default ../../.whl), both installed into /tmp/site.
# RESULT names the JSON the chapter reads (perf/results/$RESULT.json).
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
RESULT=${RESULT:?set RESULT to the results file name the chapter reads}
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    ${FI_WHEELS:-../../.whl-fi}/*.whl $(ls ${NB_WHEELS:-../../.whl}/*.whl | grep -v numpy-) || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=8 CUPY_CACHE_DIR=/tmp/cupy_cache
LOG=$OUT/run.log
t0=$(date +%s)
DEADLINE=${DEADLINE:-300}   # seconds for the whole script; each step gets at most its cap
stamp() { echo "=== $(( $(date +%s) - t0 )) s: $*" | tee -a $LOG; }
# cap SECONDS RESERVE: SECONDS, or less if RESERVE seconds must stay for the later steps
cap() { local r=$(( DEADLINE - ($(date +%s) - t0) - $2 )); echo $(( $1 < r ? $1 : (r > 5 ? r : 5) )); }
{ date -u; nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
  command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer; } >> $LOG 2>&1
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer | head -1)

stamp "FlashInfer JIT build (background)"
python3 -c "
import time, torch; t = time.time()
from pagedkv.bench.kernel_peers import prebuild_flashinfer
print(prebuild_flashinfer(torch, ['float16', 'bfloat16'], 128), 'in', round(time.time() - t, 1), 's')
" > $OUT/fi_build.log 2>&1 &
FI=$!

stamp "kernel tests"
timeout $(cap 90 160) python3 -m pytest -q -rs -n 6 -p no:cacheprovider tests/test_kernels.py \
    tests/test_staircase.py --durations=8 > $OUT/tests.log 2>&1; echo "tests exit $?" | tee -a $LOG; tail -3 $OUT/tests.log >> $LOG

stamp "memcheck"
timeout $(cap 60 140) $SAN --tool memcheck --print-limit 20 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_kernels.py tests/test_staircase.py \
    -k "every_group or junk or fill_their or launch_configs or write_kv or copy_blocks or automatic or (gpu_step and 128-16)" \
    > $OUT/sanitizer.log 2>&1; echo "memcheck exit $?" | tee -a $LOG $OUT/sanitizer.log

stamp "waiting for FlashInfer"
for i in $(seq 1 $(cap 150 100)); do kill -0 $FI 2>/dev/null || break; sleep 1; done
NOFI=""; kill -0 $FI 2>/dev/null && NOFI="--no-flashinfer" && echo "FlashInfer not built in time" >> $LOG
tail -2 $OUT/fi_build.log >> $LOG
stamp "benchmark $NOFI"
timeout $(cap 150 40) python3 -m pagedkv.bench.kernels --json $OUT/bench.json --staircase --reps 20 $NOFI \
    > $OUT/bench.log 2>&1; echo "bench exit $?" | tee -a $LOG

stamp "chapter 9 under nbval"
cp $OUT/bench.json perf/results/$RESULT.json
timeout $(cap 60 15) python3 -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
    --nbval-sanitize-with tests/nbval_sanitize.cfg book/09_attention_kernels.ipynb \
    > $OUT/nbval.log 2>&1; echo "nbval exit $?" | tee -a $LOG; tail -3 $OUT/nbval.log >> $LOG

stamp "racecheck"
timeout $(cap 60 0) $SAN --tool racecheck --racecheck-report all --print-limit 20 python3 -m pytest -q -x \
    -p no:cacheprovider tests/test_kernels.py tests/test_staircase.py \
    -k "launch_configs or (gpu_step and 8-128-16 and float16)" \
    >> $OUT/sanitizer.log 2>&1; echo "racecheck exit $?" | tee -a $LOG $OUT/sanitizer.log
stamp "done"
tail -40 $OUT/bench.log
