#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, what FlashInfer 0.7.2.post1 needs on the GPU
# machine (CPython 3.12, x86-64 Linux, no package index) for the kernel benchmark, into DIR
# (default .fi, ignored by git), small enough to travel with the repository in one transfer:
#   * flashinfer-python 0.7.2.post1, slimmed by scripts/slim_flashinfer_wheel.py (the full
#     wheel is 59 MiB, over the transfer with the repository; the slim one keeps every Python
#     file and the sources of the decode and prefill kernels the benchmark compiles);
#   * apache-tvm-ffi (its compiled modules bind to Python through tvm_ffi) and nvidia-ml-py
#     (pynvml): the two that `import flashinfer` needs and that machine lacks;
#   * einops and tabulate: declared by FlashInfer, not imported on the decode path, tiny.
# Left out on purpose: torch, numpy, ninja, jinja2, filelock, packaging, requests, tqdm (that
# machine has them; a second copy on PYTHONPATH would shadow its own), and nvidia-cutlass-dsl,
# nvidia-cudnn-frontend, cuda-python, cuda-tile, nccl4py, nccl-extensions, which `import
# flashinfer` does not import (checked by importing it with stand-ins for torch) and the
# paged decode wrapper's fa2 paths do not use.
# On the GPU machine: python3 -m pip install -q --no-index --no-deps --no-compile
#   --target /tmp/site .fi/*.whl; then PYTHONPATH=/tmp/site:$PWD.
# Usage: bash scripts/flashinfer_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.fi}
full=$(mktemp -d)
trap 'rm -rf "$full"' EXIT
mkdir -p "$out"
rm -f "$out"/*.whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
          --implementation cp "${platforms[@]}" -d "$1" "${@:2}"; }
get "$full" flashinfer-python==0.7.2.post1
python3 scripts/slim_flashinfer_wheel.py "$full"/flashinfer_python-0.7.2.post1-*.whl "$out"
get "$out" "apache-tvm-ffi>=0.1.11,<0.2" nvidia-ml-py einops tabulate
ls -l "$out"
du -b "$out"/*.whl | awk '{s += $1} END {printf "total %.1f MiB\n", s / 1048576}'
