#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the wheels that scripts/gpu_check.sh installs on a
# CUDA machine without one: the notebook-testing stack for CPython 3.12 on x86-64 Linux.
# Usage: bash scripts/gpu_wheels.sh [DIR]   (default artifacts/gpu_wheels, ignored by git)
set -euo pipefail
out=${1:-artifacts/gpu_wheels}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" nbval ipykernel ipywidgets nbclient
# Chapter 1 uses myst_nb.glue (numbers in the prose); glue needs only myst-nb and docutils.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$out" myst-nb==1.4.0 docutils==0.21.2
du -sh "$out"
