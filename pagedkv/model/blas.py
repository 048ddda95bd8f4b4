"""One BLAS thread for the NumPy path.

A decode step multiplies a few rows by each weight matrix. On this project's 2-core machines,
NumPy's bundled OpenBLAS with its default two threads took 23-26 ms for one 1x576 @ 576x3072
product and 1.4 ms with one thread (measured with NumPy 2.4.6); so the model's entry points (the
CLI, the benchmark, the tests, the chapter) ask for one thread. The thread count is set through
OpenBLAS's own function, found in NumPy's bundled library; with any other BLAS nothing changes.
"""
from __future__ import annotations

import ctypes
import glob
import os

import numpy as np

__all__ = ["single_thread_blas"]


def single_thread_blas() -> bool:
    """Set NumPy's bundled OpenBLAS to one thread. Returns whether it was found and set."""
    libs = os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs")
    for path in sorted(glob.glob(os.path.join(libs, "libscipy_openblas*"))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(1))
                return True
    return False
