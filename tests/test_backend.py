import os
import subprocess
import sys

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import BackendError


def test_choice_is_reported():
    info = backend.describe()
    assert info["backend"] == backend.name in ("numpy", "cupy")
    assert info["reason"]
    assert (backend.xp is np) == (backend.name == "numpy")
    if backend.on_gpu:
        assert info["device"] and info["memory_total_bytes"] > 0
        assert info["compute_capability"].count(".") == 1


def test_unknown_request_is_an_error():
    with pytest.raises(BackendError, match="'numpy', 'cupy'"):
        backend._choose("tpu")


def test_numpy_request_is_honoured():
    xp, name, reason = backend._choose("numpy")
    assert xp is np and name == "numpy" and "PAGEDKV_BACKEND" in reason


@pytest.mark.skipif(backend.on_gpu, reason="a GPU is usable here, so cupy can be had")
def test_cupy_request_without_gpu_is_an_error():
    with pytest.raises(BackendError, match="PAGEDKV_BACKEND=cupy"):
        backend._choose("cupy")


def test_environment_variable_overrides_in_a_fresh_process():
    env = dict(os.environ, PAGEDKV_BACKEND="numpy")
    out = subprocess.run([sys.executable, "-c", "import pagedkv.backend as b; print(b.name)"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "numpy"


def test_to_numpy_round_trip():
    a = backend.xp.arange(5)
    assert np.array_equal(backend.to_numpy(a), np.arange(5))
