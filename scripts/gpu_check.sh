#!/usr/bin/env bash
# Runs every package test and every notebook (nbval) on a CUDA machine that has CuPy, NumPy,
# matplotlib and pytest but no Jupyter stack and no package index. The wheels it needs
# (nbval, ipykernel, ipywidgets, myst-nb, docutils, hypothesis, ml_dtypes and their
# dependencies, for that machine's Python) are carried in WHEELS (default artifacts/gpu_wheels).
# Logs go to $OUT (or ./artifacts/gpu_check). Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${WHEELS:-artifacts/gpu_wheels}
out=${OUT:-artifacts/gpu_check}
mkdir -p "$out"
# The machine's own NumPy stays: a second one would shadow it.
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
  $(ls "$wheels"/*.whl | grep -v '/numpy-') || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import pagedkv.backend as b; print(b.describe())"
status=0
timeout 420 python3 -m pytest -q -rs -p no:cacheprovider tests --ignore=tests/test_book_browser.py --ignore=tests/test_jupyterlab.py \
  --durations=5 2>&1 | tee "$out/pytest.log" | tail -30 || status=1
timeout 240 python3 -m pytest -q -p no:cacheprovider --nbval-lax --nbval-current-env \
  --nbval-sanitize-with tests/nbval_sanitize.cfg book/ --durations=10 2>&1 \
  | tee "$out/nbval.log" | tail -30 || status=1
exit $status
