"""Chapter 9's staircase: every step's NumPy mirror (always) and CUDA kernel (on a GPU) against
the float64 reference, on pools full of NaN outside the written tokens, with lengths that end on
a block boundary and tables that are exactly full."""
from __future__ import annotations

import numpy as np
import pytest

from _attn_cases import TOL, host, make_case, poisoned_like, rel_err, rng_for, to_gpu
from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import paged_decode_attention_ref
from pagedkv.kernels._common import BF16
from pagedkv.kernels.staircase import STEPS, all_names, run_step, step_kernel

gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no usable GPU: {backend.reason}")
pytestmark = pytest.mark.skipif(BF16 is None, reason="bfloat16 cases need ml_dtypes")


@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mirror_matches_reference(step, dtype):
    rng = rng_for(4000 + 10 * step + len(dtype))
    for group, head_dim, bs, lens in [(4, 64, 16, [1, 16, 47, 130]), (1, 128, 8, [8, 24, 3]),
                                      (8, 64, 32, [64, 5, 96]), (3, 256, 16, [33, 2])]:
        case = make_case(rng, lens, 2 * group, 2, head_dim, bs, dtype, junk=np.nan)
        ref = paged_decode_attention_ref(*case)
        out = np.full(case[0].shape, np.nan, np.float32).astype(case[0].dtype)
        run_step(step, *case, out=out)
        got = host(out)
        assert np.isfinite(got).all(), (step, group, head_dim, bs)
        assert rel_err(got, ref) < TOL[dtype], (step, group, head_dim, bs, rel_err(got, ref))


def test_mirrors_of_split_steps_cut_sequences():
    # Steps 5 and 6 with several split counts, including more splits than a sequence fills.
    rng = rng_for(4100)
    case = make_case(rng, [1, 48, 160, 33], 8, 2, 64, 16, "float16", junk=np.inf)
    ref = paged_decode_attention_ref(*case)
    for step in (5, 6):
        for splits in (1, 2, 3, 7):
            got = host(run_step(step, *case, num_splits=splits))
            assert rel_err(got, ref) < TOL["float16"], (step, splits)


def test_bad_step_and_dtype():
    rng = rng_for(4200)
    case = make_case(rng, [3], 2, 2, 64, 16, "float32")
    with pytest.raises(ConfigError):
        run_step(8, *case)
    with pytest.raises(ConfigError):
        run_step(1, *case)                               # the teaching kernels take fp16/bf16
    assert rel_err(host(run_step(6, *case)), paged_decode_attention_ref(*case)) < 1e-5


def test_every_kernel_has_a_name():
    names = all_names()
    for step in range(1, 6):
        assert step_kernel(step, 2, 256, 7, 32) in names


@gpu
@pytest.mark.parametrize("step", list(STEPS))
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("group,head_dim,block_size",
                         [(4, 128, 16), (8, 128, 16), (1, 64, 8), (5, 256, 32)])
def test_gpu_step_matches_reference(step, dtype, group, head_dim, block_size):
    rng = rng_for(4300 + 10 * step + group + head_dim + block_size + len(dtype))
    lens = [1, 17, 3 * block_size, 2 * block_size, 700]
    host_case = make_case(rng, lens, 2 * group, 2, head_dim, block_size, dtype, junk=np.nan)
    dev = to_gpu(host_case)
    ref = paged_decode_attention_ref(*host_case)
    for splits in ((None, 1, 3) if step >= 5 else (None,)):
        out = poisoned_like(dev[0])
        run_step(step, *dev, out=out, num_splits=splits)
        got = host(out)
        assert np.isfinite(got).all(), (step, splits)
        assert rel_err(got, ref) < TOL[dtype], (step, splits, rel_err(got, ref))
