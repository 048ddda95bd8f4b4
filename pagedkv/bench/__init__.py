"""Benchmarks: `python -m pagedkv.bench` (bookkeeping) and `python -m pagedkv.bench.kernels` (GPU kernels)."""
