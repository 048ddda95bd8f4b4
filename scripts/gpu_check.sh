#!/usr/bin/env bash
# Runs the package tests, every notebook (nbval) and the model benchmark on a CUDA machine
# that has CuPy, NumPy, matplotlib, pytest and PyTorch but no Jupyter stack and no package
# index. The wheels it needs come from scripts/gpu_wheels.sh, carried in WHEELS (default
# .whl). The model file comes from PAGEDKV_GGUF, or is joined from the parts in MODEL_PARTS
# (the file is larger than one transfer to that machine). Logs go to $OUT (default
# artifacts/gpu_check). STEPS picks what runs: any of "tests nbval model" (default: all).
# WORKERS=N runs the tests and notebooks in N processes (pytest-xdist, which that machine
# has), one test file or notebook each; the test that watches the device's free memory then
# runs alone afterwards. The tests that need a browser (Chromium, Playwright) or PyPI (the
# fresh-venv install of pagedkv[serve]) are left out: that machine has neither.
# Usage: bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
wheels=${WHEELS:-.whl}
out=${OUT:-artifacts/gpu_check}
steps=${STEPS:-tests nbval model}
mkdir -p "$out"
if [ ! -e /tmp/site/nbval ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
    "$wheels"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
if [ -z "${PAGEDKV_GGUF:-}" ] && [ -n "${MODEL_PARTS:-}" ]; then
  export PAGEDKV_GGUF=/tmp/smollm2.gguf
  [ -e "$PAGEDKV_GGUF" ] || cat "$MODEL_PARTS"/part* > "$PAGEDKV_GGUF"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
python3 -c "import pagedkv.backend as b; print(b.describe())"
header() {  # "# key: value" lines at the top of a log
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# gpu: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
    | head -1)"
  echo "# backend: $(python3 -c 'import pagedkv.backend as b; print(b.describe())')"
  echo "# commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
}
parallel=()
alone=tests/test_allocator.py::test_close_returns_the_memory
if [ -n "${WORKERS:-}" ]; then parallel=(-n "$WORKERS" --dist loadfile); fi
status=0
case " $steps " in *" tests "*)
  { header; timeout 400 python3 -m pytest -q -rs -p no:cacheprovider "${parallel[@]}" tests \
    --ignore=tests/test_book_browser.py --ignore=tests/test_jupyterlab.py \
    --ignore=tests/test_serve_browser.py --ignore=tests/test_serve_install.py \
    ${WORKERS:+--deselect $alone} --durations=8; } 2>&1 | tee "$out/pytest.log" | tail -25 \
    || status=1
  if [ -n "${WORKERS:-}" ]; then
    timeout 60 python3 -m pytest -q -p no:cacheprovider "$alone" 2>&1 \
      | tee -a "$out/pytest.log" | tail -3 || status=1
  fi ;;
esac
case " $steps " in *" nbval "*)
  # The log starts with the lines pagedkv.provenance reads (when, which GPU, which backend)
  # and lists every cell's outcome (-rfEp), so the status page can say what the run covered.
  { header
    timeout 400 python3 -m pytest -q -rfEp -p no:cacheprovider "${parallel[@]}" --nbval-lax \
      --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg book/ --durations=14
  } 2>&1 | tee "$out/nbval.log" | tail -25 || status=1 ;;
esac
case " $steps " in *" model "*)
  timeout 200 python3 -m pagedkv.bench.model --json "$out/model-h200.json" 2>&1 \
    | tee "$out/model.log" | tail -30 || status=1 ;;
esac
exit $status
