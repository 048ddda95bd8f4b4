"""Programmatic dependent launch (pagedkv/kernels/pdl.py): the driver's structures as
cuda.h lays them out, the ordinary launch wherever it cannot apply, every kernel launched
this way waiting for the one before it, and on a GPU the same logits and tokens with it as
without."""
from __future__ import annotations

import ctypes
import pathlib
import re

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.errors import ConfigError
from pagedkv.kernels import pdl
from pagedkv.model import Llama, random_weights
from pagedkv.model.engine import Engine
from pagedkv.model.requests import SamplingParams
from _tiny import TINY

KERNELS = pathlib.Path(pdl.__file__).parent
SEED = 2468
gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no GPU: {backend.reason}")

# The kernels the decode pass launches through pdl.launch, and the files that call it.
LAUNCHED = ("embed", "argmax_rows", "gemv_t", "norm_gemv_t", "norm_gemv_rope_t",
            "paged_decode", "paged_decode_tc", "merge_splits")
CALLERS = {"fused.py": 2, "gemm.py": 1, "norm_gemv.py": 2, "attention.py": 2}


def test_structures_are_laid_out_as_in_cuda_h():
    """CUlaunchAttribute: id, 4 bytes of padding, a 64-byte union; CUlaunchConfig: six
    dimensions, shared memory, then the stream and the attributes on 8-byte boundaries."""
    assert ctypes.sizeof(pdl._Attribute) == 72
    assert pdl._Attribute.value.offset == 8
    assert ctypes.sizeof(pdl._Config) == 56
    assert (pdl._Config.shared_mem.offset, pdl._Config.stream.offset,
            pdl._Config.attrs.offset, pdl._Config.num_attrs.offset) == (24, 32, 40, 48)


def test_a_launch_configuration_is_built_once_per_shape_and_stream():
    """The eager pass launches the same shapes again and again: one configuration each,
    asking for programmatic serialization (attribute 6, value 1)."""
    a = pdl._config((4, 1, 1), (128, 1, 1), 16, 1234)
    assert pdl._config((4, 1, 1), (128, 1, 1), 16, 1234) is a
    assert pdl._config((4, 1, 1), (128, 1, 1), 16, 5678) is not a      # another stream
    assert (tuple(a.grid), tuple(a.block), a.shared_mem, a.stream, a.num_attrs) == (
        (4, 1, 1), (128, 1, 1), 16, 1234, 1)
    assert (a.attrs[0].id, a.attrs[0].value[0]) == (6, 1)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, shared_mem=0):
        self.calls.append((grid, block, args, shared_mem))


@pytest.mark.skipif(backend.on_gpu, reason="the CPU's case: no programmatic launch")
def test_without_a_hopper_gpu_launch_is_the_ordinary_call():
    fn = _Recorder()
    args = (np.int32(3), np.float32(0.5))
    pdl.launch(fn, (4,), (128,), args, shared_mem=16)
    with pdl.programmatic(True):
        assert not pdl._ON.get()             # asked for, not available: off
        pdl.launch(fn, (4,), (128,), args)
    assert fn.calls == [((4,), (128,), args, 16), ((4,), (128,), args, 0)]
    assert not pdl.programmatic_available()


def test_arguments_keep_their_c_types():
    assert isinstance(pdl._holder(np.int32(-7)), ctypes.c_int)
    assert pdl._holder(np.int32(-7)).value == -7
    assert isinstance(pdl._holder(np.float32(0.25)), ctypes.c_float)
    assert isinstance(pdl._holder(np.int64(2**40)), (ctypes.c_long, ctypes.c_longlong))
    with pytest.raises(ConfigError, match="NumPy scalars"):
        pdl._holder(3)                        # a Python int: which C type? refused


def _body(source: str, name: str) -> str:
    """The text of kernel ``name``'s body in ``source`` (from its signature's brace)."""
    m = re.search(r"__global__ void(?: __launch_bounds__\([^)]*\))?\s+" + name + r"\(", source)
    assert m, name
    start = source.index("{", m.end())
    depth, i = 0, start
    while True:
        depth += {"{": 1, "}": -1}.get(source[i], 0)
        if depth == 0:
            return source[start:i]
        i += 1


def test_every_kernel_launched_programmatically_waits_first():
    """Each kernel the decode pass launches through pdl.launch calls wait_for_prior_grid()
    before its first read of an input (a load through an argument other than the weights);
    and launch is called from the files (and as often) that launch those kernels only."""
    sources = "\n".join(p.read_text() for p in KERNELS.glob("*.cu")) + (
        KERNELS / "common.cuh").read_text()
    for name in LAUNCHED:
        body = _body(sources, name)
        assert "wait_for_prior_grid();" in body, name
        before = "\n".join(line for line in body[:body.index("wait_for_prior_grid();")]
                           .splitlines() if "__shared__" not in line)
        assert not re.search(r"(load|unpack)\s*\(|\w\s*\[", before), (name, before)
    calls = {p.name: len(re.findall(r"(?<![\w.])launch\(", p.read_text()))
             for p in KERNELS.glob("*.py") if p.name != "pdl.py"}
    assert {k: v for k, v in calls.items() if v} == CALLERS


def _tokens(model, prompts, pdl_on: bool, graphs: bool = True):
    engine = Engine(model, num_blocks=200, block_size=16, stop_ids=(0,), audit=True,
                    runner="fast" if graphs else "fast-eager")
    engine.runner.pdl = pdl_on           # read by every pass: set before the first
    reqs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    return engine, [r.outputs()[0].generated for r in reqs]


@gpu
@pytest.mark.parametrize("graphs", [True, False])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_programmatic_passes_give_the_same_tokens(dtype, graphs):
    """One prompt (folded single-row passes), three and twelve (the few-row kernel's and
    cuBLAS's buckets): the same tokens with pdl as without, the same graph nodes; on a
    Hopper GPU the launches really are programmatic."""
    cp = backend.xp
    if int(cp.cuda.Device().compute_capability) >= 90:
        assert pdl.programmatic_available()
    model = Llama(TINY, random_weights(TINY, SEED), dtype=dtype)
    rng = np.random.default_rng(SEED)
    for n in (1, 3, 12):
        prompts = [rng.integers(1, TINY.vocab_size, int(k)).tolist()
                   for k in rng.integers(1, 40, n)]
        off, plain = _tokens(model, prompts, False, graphs)
        on, fast = _tokens(model, prompts, True, graphs)
        assert fast == plain, (n, dtype)
        if graphs:
            assert off.runner._graphs.keys() == on.runner._graphs.keys()
            for b in off.runner._graphs:
                assert off.runner.graph_nodes(b) == on.runner.graph_nodes(b), b


@gpu
def test_programmatic_decode_logits_bit_for_bit():
    """The runner's decode logits, bucket by bucket, with and without pdl: the same bits."""
    from pagedkv.model import PagedKV
    from pagedkv.model.llama import Batch
    from pagedkv.model.runner import FastRunner
    model = Llama(TINY, random_weights(TINY, SEED), dtype=np.float16)
    for b in (1, 2, 5, 16):
        tables = np.arange(b * 2, dtype=np.int32).reshape(b, 2)
        one = np.ones(b, np.int32)
        batch = Batch((np.arange(b, dtype=np.int32) * 7 + 3) % TINY.vocab_size, one * 20,
                      tables[:, 1] * 16 + 4, one, one * 21, tables, np.zeros((0, 2), np.int32))
        out = []
        for on in (False, True):
            kv = PagedKV.for_model(model, 2 * b + 2, 16)
            runner = FastRunner(model, kv, max_batch=16, max_context=64, pdl=on)
            runner.decode(batch)                     # capture, then replay
            logits, greedy = runner.decode(batch)
            out.append((backend.xp.asnumpy(logits), greedy))
        assert np.array_equal(out[0][0], out[1][0]), b
        assert out[0][1] == out[1][1], b
