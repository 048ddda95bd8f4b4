#!/usr/bin/env bash
# Downloads, on a machine with PyPI access, the wheels that scripts/gpu_check.sh installs on a
# CUDA machine without one (CPython 3.12, x86-64 Linux): the notebook-testing stack and the
# GGUF reader for the model chapter. Packages that machine already has (NumPy, PyTorch,
# transformers, tokenizers, pytest, hypothesis, ml_dtypes, xxhash, ...) are left out: a second
# copy on PYTHONPATH would shadow its own. Usage: bash scripts/gpu_wheels.sh [DIR]
# (default .whl, ignored by git; about 24 MB).
set -euo pipefail
out=${1:-.whl}
mkdir -p "$out"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" nbval ipykernel ipywidgets nbclient gguf==0.19.0
# The server (pagedkv.serve), its tests and chapter 15: Starlette, uvicorn, the openai client.
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out" starlette==1.10.0 uvicorn==0.54.0 openai==3.57.0
# Chapters quote numbers with MyST's eval role; nbval needs only myst-nb and docutils for it.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${platforms[@]}" -d "$out" myst-nb==1.4.0 docutils==0.21.2
# What the CUDA machine's image already holds (its package list, 2026-11-17).
for name in numpy pytest pluggy iniconfig packaging attrs typing_extensions pygments \
    psutil python_dateutil pyyaml requests urllib3 idna certifi charset_normalizer tqdm \
    filelock fsspec click anyio h11 sortedcontainers coverage hypothesis ml_dtypes xxhash \
    tokenizers huggingface_hub hf_xet httpx httpcore six anyio click h11 idna \
    typing_extensions; do
  rm -f "$out"/${name}-*.whl
done
du -sh "$out"
