#!/usr/bin/env bash
# Every test: the package's pytest tests, the exercises' solutions and nbval over every
# notebook in book/ (one pytest run), then the serving benchmarks' --quick runs (in process
# and through HTTP), the book build (if a source changed since the last one), the browser
# test of each built page and of its live figures, and every notebook run in JupyterLab in
# the same browser. All steps run even if one fails; the exit code is non-zero if any did.
set -uo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

failed=()
step() {  # step NAME COMMAND...: run, time and record one step
    local name=$1; shift
    echo
    echo "=== $name: $*"
    local start=$(date +%s)
    if "$@"; then
        echo "=== $name: passed ($(( $(date +%s) - start )) s)"
    else
        echo "=== $name: FAILED ($(( $(date +%s) - start )) s)"
        failed+=("$name")
        return 1
    fi
}

step "package tests + nbval" python -m pytest tests/ book/ \
    --ignore=tests/test_book_browser.py --ignore=tests/test_live_figures.py \
    --ignore=tests/test_jupyterlab.py \
    --nbval-lax --nbval-current-env --nbval-sanitize-with tests/nbval_sanitize.cfg
# the serving benchmark at CPU size: its numbers are printed for the log, not asserted
step "serving benchmark (--quick)" python -m pagedkv.bench.serve --quick --no-peer
# the same through the OpenAI API: the tiny model's server, then its engine in process
step "HTTP serving benchmark (--quick)" python -m pagedkv.bench.http --quick --model tiny \
    --ttft-probe 3
if step "book build" bash scripts/build_book.sh --if-stale; then
    step "browser test" python -m pytest tests/test_book_browser.py tests/test_live_figures.py
else
    echo "=== browser test: not run, the book did not build"
    failed+=("browser test")
fi
step "JupyterLab test" python -m pytest tests/test_jupyterlab.py

echo
if [ ${#failed[@]} -gt 0 ]; then
    echo "FAILED: ${failed[*]}"
    exit 1
fi
echo "all test steps passed"
