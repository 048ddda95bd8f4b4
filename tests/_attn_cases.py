"""Decode-attention test cases shared by the kernel tests: random data from a printed seed,
pages scattered by a random permutation, and optionally a pool full of junk (NaN or Inf) in
every slot no token was written to."""
from __future__ import annotations

import numpy as np
import pytest

from pagedkv import backend
from pagedkv.kernels import write_kv
from pagedkv.kernels._common import BF16, to_device

DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": BF16}
TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}


@pytest.fixture(autouse=True)
def _bfloat16_needs_ml_dtypes(request):
    """NumPy has no bfloat16; ml_dtypes (in requirements.txt) gives it one. (A module that
    imports this fixture skips its bfloat16 cases without it.)"""
    spec = getattr(request.node, "callspec", None)
    if BF16 is None and spec and "bfloat16" in map(str, spec.params.values()):
        pytest.skip("bfloat16 cases need ml_dtypes, which is not installed")


gpu = pytest.mark.skipif(not backend.on_gpu, reason=f"no usable GPU: {backend.reason}")


def rng_for(seed):
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def make_case(rng, lens, q_heads, kv_heads, head_dim, block_size, dtype, spare_blocks=5,
              junk=None, max_blocks=None):
    """q, cache, block_tables, seq_lens (NumPy) with each sequence's pages at random places.

    ``junk`` (e.g. ``np.nan``): the pool starts filled with it and only the sequences' tokens
    are written (through ``write_kv``), as in a pool nobody cleared. Table entries past a
    sequence's pages are random junk too (ids far outside the pool). ``max_blocks`` widens the
    tables (default: exactly the longest sequence's pages).
    """
    dt = DTYPES[dtype]
    lens = np.asarray(lens, np.int32)
    per_seq = -(-lens // block_size)
    max_blocks = max_blocks or max(1, int(per_seq.max()))
    num_blocks = int(per_seq.sum()) + spare_blocks
    shape = (num_blocks, 2, block_size, kv_heads, head_dim)
    perm = rng.permutation(num_blocks).astype(np.int32)
    tables = rng.integers(-7, 10**6, (len(lens), max_blocks)).astype(np.int32)  # padding: junk
    start = 0
    for b, n in enumerate(per_seq):
        tables[b, :n] = perm[start:start + n]
        start += n
    if junk is None:
        cache = rng.standard_normal(shape).astype(dt)
    else:
        cache = np.full(shape, junk, np.float32).astype(dt)
        for b, n in enumerate(lens):
            t = np.arange(n)
            slots = (tables[b, t // block_size] * block_size + t % block_size).astype(np.int32)
            k, v = (rng.standard_normal((n, kv_heads, head_dim)).astype(dt) for _ in range(2))
            write_kv(cache, k, v, slots)
    q = rng.standard_normal((len(lens), q_heads, head_dim)).astype(dt)
    return q, cache, tables, lens


def rel_err(out, ref):
    out = np.asarray(out, np.float64)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def to_gpu(case):
    return tuple(to_device(a) for a in case)


def poisoned_like(dq):
    """An output array full of NaN: an element the kernel forgets to write cannot pass."""
    cp = backend.xp
    out = cp.empty_like(dq)
    if out.dtype == np.uint16:
        out.fill(0x7FC0)                                 # a bf16 NaN's bits
    else:
        out.fill(np.nan)
    return out


def host(a):
    """A float64 NumPy copy (bf16 bits in uint16 viewed as bf16 first)."""
    a = backend.to_numpy(a)
    return (a.view(BF16) if a.dtype == np.uint16 else a).astype(np.float64)


def make_prefill_case(rng, qlens, prefix_lens, q_heads, kv_heads, head_dim, block_size, dtype,
                      **kw):
    """q, cache, block_tables, query_start, seq_lens (NumPy) for a prefill step.

    Sequence ``b`` has ``prefix_lens[b]`` tokens already in the cache (a prefix-cache hit or
    earlier chunks) and ``qlens[b]`` new ones, whose K/V are in the cache too (written before
    attention runs); so ``seq_lens = prefix_lens + qlens``. The pool, tables and junk are as
    in :func:`make_case` (``kw`` goes there).
    """
    qlens = np.asarray(qlens, np.int32)
    lens = qlens + np.asarray(prefix_lens, np.int32)
    _, cache, tables, lens = make_case(rng, lens, q_heads, kv_heads, head_dim, block_size,
                                       dtype, **kw)
    q = rng.standard_normal((int(qlens.sum()), q_heads, head_dim)).astype(DTYPES[dtype])
    query_start = np.concatenate([[0], np.cumsum(qlens)]).astype(np.int32)
    return q, cache, tables, query_start, lens
