#!/usr/bin/env bash
# Build the HTML book into _build/html, executing every chapter (forced, or inline for
# chapters that quote numbers with {eval}),
# with Sphinx warnings as errors.
#   scripts/build_book.sh             always rebuild from scratch
#   scripts/build_book.sh --if-stale  rebuild only if a source changed since the last
#                                     successful build (used by scripts/test.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

STAMP=_build/.book-built
SOURCES=(_config.yml _toc.yml _static references.bib book pagedkv solutions requirements.txt
         pyproject.toml perf/results)

if [ "${1:-}" = "--if-stale" ] && [ -e "$STAMP" ] && [ -e _build/html/index.html ]; then
    changed=$(find "${SOURCES[@]}" -newer "$STAMP" -type f \
        -not -path '*/__pycache__/*' -not -path '*/.ipynb_checkpoints/*' -print -quit)
    if [ -z "$changed" ]; then
        echo "build: _build/html is up to date"
        exit 0
    fi
    echo "build: $changed changed since the last build"
fi

# A clean build: forced execution re-runs only the documents Sphinx re-reads, and a
# chapter whose own file did not change still has to run against the current package.
rm -rf _build/html _build/.doctrees _build/jupyter_execute "$STAMP"
# the intro's list of committed results, written from perf/results/ and the chapters
python scripts/provenance.py
start=$(date +%s)
jupyter-book build . -W -n --keep-going
echo "build: done in $(( $(date +%s) - start )) s"
touch "$STAMP"
