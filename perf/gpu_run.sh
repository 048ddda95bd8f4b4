#!/usr/bin/env bash
# One call on the GPU machine: install the carried FlashInfer wheel, run the kernel tests, then
# the benchmark (extra arguments go to it). Logs and JSON land in $OUT.
# Usage (from the repository root, with .whl/ carried): bash perf/gpu_run.sh [--sweep] ...
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/flashinfer*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 PYTHONUNBUFFERED=1
export CUPY_CACHE_DIR=/tmp/cupy_cache
# FlashInfer and CuPy compile kernels at first use; caches saved by an earlier call skip that.
[ -f .whl/fi_cache.tgz ] && tar -xzf .whl/fi_cache.tgz -C ~ && echo "restored FlashInfer JIT cache"
[ -f .whl/cupy_cache.tgz ] && tar -xzf .whl/cupy_cache.tgz -C /tmp && echo "restored CuPy kernel cache"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
python3 -c "import cupy, torch, numpy; print('cupy', cupy.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__)"
if [ -z "$SKIP_TESTS" ]; then
  timeout 300 python3 -m pytest -q -rs tests/test_kernels.py --durations=5 2>&1 | tee $OUT/tests.log | tail -25
fi
timeout ${BENCH_TIMEOUT:-420} python3 -m pagedkv.bench.kernels --json $OUT/bench.json "$@" 2>&1 | tee $OUT/bench.log
(cd ~ && tar -czf $OUT/fi_cache.tgz .cache/flashinfer 2>/dev/null)
(cd /tmp && tar -czf $OUT/cupy_cache.tgz cupy_cache 2>/dev/null); ls -la $OUT
