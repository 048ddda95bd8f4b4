"""Backend parametrization shared by the package tests: NumPy always, CuPy when a GPU is usable."""
import numpy as np
import pytest

from pagedkv import backend

XP_PARAMS = [
    pytest.param(np, id="numpy"),
    pytest.param("cupy", id="cupy", marks=pytest.mark.skipif(
        not backend.on_gpu, reason=f"CuPy backend not in use: {backend.reason}")),
]


def resolve(xp):
    return backend.xp if xp == "cupy" else xp


def host(a):
    """A NumPy copy of a NumPy or CuPy array."""
    return backend.to_numpy(a)
