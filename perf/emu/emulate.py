"""Run a CUDA attention kernel's own source on the CPU (perf/emu/cuda_emu.h): a check of its
fragment indexing, masking and page-table reads without a GPU. Slow; for small cases.

    python perf/emu/emulate.py     # the decode tensor-core kernel (a check of the emulator:
                                   # the GPU tests pass it), then the prefill kernel, then
                                   # norm_gemv_rope against the two launches it replaces

Each template instance is compiled once with g++ into a small program (cached in
$PAGEDKV_EMU_DIR, default /tmp/pagedkv_emu) that reads the arrays from a file, runs every CTA
of the grid one after another and writes the output back.
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from pagedkv.kernels import prefill  # noqa: E402
from pagedkv.kernels._common import DTYPE_CODES, dtype_name  # noqa: E402
from pagedkv.kernels.kv8 import Cache8  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
CACHE = pathlib.Path(os.environ.get("PAGEDKV_EMU_DIR", "/tmp/pagedkv_emu"))

MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int hdr[12];
    float scale_log2;
    if (std::fread(hdr, 4, 12, f) != 12 || std::fread(&scale_log2, 4, 1, f) != 1) return 2;
    const int T = hdr[0], q_heads = hdr[1], D = hdr[2], num_blocks = hdr[3], BS = hdr[4],
              kv_heads = hdr[5], batch = hdr[6], max_blocks = hdr[7], grid_x = hdr[8],
              threads = hdr[9], smem = hdr[10], cache_vecs = hdr[11];   // 16-byte units
    std::vector<uint16_t> q((size_t)T * q_heads * D), out(q.size(), 0x7e00);
    std::vector<uint4> cache((size_t)cache_vecs);
    std::vector<int> tables((size_t)batch * max_blocks), qs(batch + 1), lens(batch);
    auto rd = [&](void* p, size_t n) { if (n && std::fread(p, 1, n, f) != n) std::exit(2); };
    rd(q.data(), q.size() * 2); rd(cache.data(), cache.size() * 16);
    rd(tables.data(), tables.size() * 4); rd(qs.data(), qs.size() * 4);
    rd(lens.data(), lens.size() * 4);
    std::fclose(f);
    emu::gbase = (const char*)cache.data();
    emu::gbytes = cache.size() * 16;
    gridDim = {(unsigned)grid_x, (unsigned)kv_heads, 1u};
    for (int y = 0; y < kv_heads; ++y)
        for (int x = 0; x < grid_x; ++x)
            emu::run_cta(x, y, threads, smem, [&] {
                KERNEL((const uint4*)q.data(), cache.data(), tables.data(), qs.data(),
                       lens.data(), out.data(), batch, kv_heads, max_blocks, scale_log2);
            });
    FILE* g = std::fopen(argv[2], "wb");
    std::fwrite(out.data(), 2, out.size(), g);
    std::fclose(g);
    return 0;
}
"""


def _merging() -> str:
    """common.cuh's merging of split results, which the attention kernels call: the same
    source on the emulator as on the GPU."""
    common = (ROOT / "pagedkv/kernels/common.cuh").read_text()
    return common[common.index("// ---- merging partial softmaxes"):] + "\n"


def binary(source: str, name: str, main: str, text: str | None = None) -> pathlib.Path:
    """The emulator program for one template instance of a kernel in ``source`` (a file of
    pagedkv/kernels, or ``text`` where the kernel needs more than one), with ``main`` as its
    driver (built if needed)."""
    src = (ROOT / "pagedkv/kernels" / source).read_text() if text is None else text
    decl = "extern __shared__ __align__(16) unsigned short smem[];"
    assert decl in src or text is not None
    src = src.replace(decl, "unsigned short* smem = (unsigned short*)emu::smem;")
    text = ('#include "cuda_emu.h"\n' + _merging() + src + f"\n#define KERNEL {name}\n"
            + main)
    key = hashlib.sha1((text + (HERE / "cuda_emu.h").read_text()).encode()).hexdigest()[:16]
    exe = CACHE / f"{pathlib.Path(source).stem}_{key}"
    if not exe.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        cpp = exe.with_suffix(".cpp")
        cpp.write_text(text)
        tmp = exe.with_suffix(f".{os.getpid()}")
        subprocess.run(["g++", "-std=c++17", "-O1", "-w", f"-I{HERE}", "-o", str(tmp), str(cpp)],
                       check=True)
        tmp.replace(exe)                  # atomic: parallel test workers may race here
    return exe


def _execute(exe, arrays, out_shape):
    """Run ``exe`` on the arrays (written one after another to a file); read uint16 back."""
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = pathlib.Path(tmp) / "in", pathlib.Path(tmp) / "out"
        with open(inp, "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).tobytes())
        r = subprocess.run([str(exe), str(inp), str(outp)], capture_output=True, text=True)
        if os.environ.get("PAGEDKV_EMU_STDERR"):
            sys.stderr.write(r.stderr)
        if r.returncode:
            raise RuntimeError(f"emulator failed ({r.returncode}): {r.stderr[-2000:]}")
        return np.fromfile(outp, np.uint16).reshape(out_shape)


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16)


def _cache_bytes(cache):
    """A layer cache's bytes (an int8 Cache8's raw bytes), and whether it is int8."""
    kv8 = isinstance(cache, Cache8)
    raw = np.ascontiguousarray(cache.raw if kv8 else cache).view(np.uint8)
    return raw, kv8


def run_prefill(q, cache, tables, query_start, seq_lens, *, scale=None, config=None):
    """paged_prefill_attention's GPU launch, emulated: returns out with q's dtype (rows the
    kernel never writes stay NaN). ``cache`` may be an int8 Cache8."""
    raw, kv8 = _cache_bytes(cache)
    q_dtype = dtype_name(q)
    assert q_dtype in ("float16", "bfloat16") and (kv8 or dtype_name(cache) == q_dtype)
    T, q_heads, d = q.shape
    num_blocks, _, bs, kv_heads, _ = cache.shape
    group = q_heads // kv_heads
    config = config or prefill.prefill_config(d)
    nwarps, mt, kv_tile, stages = config
    name = prefill.prefill_name(DTYPE_CODES[q_dtype], d, group, bs, config, kv8)
    batch = len(seq_lens)
    grid_x = prefill.grid_ctas(T, batch, group, nwarps * mt * 16)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    smem = prefill._smem(d, kv_tile, stages, kv8)
    hdr = np.array([T, q_heads, d, num_blocks, bs, kv_heads, batch, tables.shape[1], grid_x,
                    nwarps * 32, smem, raw.size // 16], np.int32)
    out = _execute(binary(prefill.PREFILL_SOURCE, name, MAIN),
                   [hdr, np.float32(scale * 1.4426950408889634), _bits(q), raw,
                    np.asarray(tables, np.int32), np.asarray(query_start, np.int32),
                    np.asarray(seq_lens, np.int32)], q.shape)
    return out.view(q.dtype) if q.dtype != np.uint16 else out


DECODE_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int hdr[12];
    float scale_log2;
    if (std::fread(hdr, 4, 12, f) != 12 || std::fread(&scale_log2, 4, 1, f) != 1) return 2;
    const int batch = hdr[0], q_heads = hdr[1], D = hdr[2], num_blocks = hdr[3], BS = hdr[4],
              kv_heads = hdr[5], max_blocks = hdr[6], smem = hdr[7], splits = hdr[8],
              split_tokens = hdr[9], cache_vecs = hdr[10], threads = hdr[11];
    std::vector<uint16_t> q((size_t)batch * q_heads * D), out(q.size(), 0x7e00);
    std::vector<uint4> cache((size_t)cache_vecs);                  // 16-byte units
    std::vector<int> tables((size_t)batch * max_blocks), lens(batch), order(splits);
    auto rd = [&](void* p, size_t n) { if (n && std::fread(p, 1, n, f) != n) std::exit(2); };
    rd(q.data(), q.size() * 2); rd(cache.data(), cache.size() * 16);
    rd(tables.data(), tables.size() * 4); rd(lens.data(), lens.size() * 4);
    rd(order.data(), order.size() * 4);            // the order the splits' CTAs run in
    std::fclose(f);
    std::vector<float> part_o((size_t)batch * q_heads * splits * D, NAN),
                       part_lse((size_t)batch * q_heads * splits, NAN);
    emu::gbase = (const char*)cache.data();
    emu::gbytes = cache.size() * 16;
    gridDim = {(unsigned)splits, (unsigned)kv_heads, (unsigned)batch};
    for (int b = 0; b < batch; ++b)
        for (int y = 0; y < kv_heads; ++y)
            for (int x : order)
                emu::run_cta(x, y, threads, smem, [&] {
                    blockIdx.z = b;
                    KERNEL((const uint4*)q.data(), cache.data(), tables.data(), lens.data(),
                           out.data(), part_o.data(), part_lse.data(), kv_heads,
                           max_blocks, split_tokens, scale_log2);
                });
    if (splits > 1) {                              // the merge, a kernel of its own
        gridDim = {(unsigned)(batch * q_heads), 1u, 1u};
        for (int r = 0; r < batch * q_heads; ++r)
            emu::run_cta(r, 0, D < 256 ? D : 256, 0, [&] {
                merge_splits<EMU_DT>(part_o.data(), part_lse.data(), out.data(), splits, D);
            });
    }
    FILE* g = std::fopen(argv[2], "wb");
    std::fwrite(out.data(), 2, out.size(), g);
    std::fclose(g);
    return 0;
}
"""


def run_decode_tc(q, cache, tables, seq_lens, *, scale=None, num_splits=1, order=None):
    """The decode tensor-core kernel (its default launch shape, ``num_splits`` pieces per
    sequence), emulated. With splits, they are merged by the separate ``merge_splits``
    kernel; ``order`` is the order in which the splits' CTAs run (default: 0, 1, ...).
    ``cache`` may be an int8 Cache8. Returns the output."""
    return run_decode(q, cache, tables, seq_lens, tensor_cores=True, scale=scale,
                      num_splits=num_splits, order=order)


def run_decode(q, cache, tables, seq_lens, *, tensor_cores, scale=None, num_splits=1,
               order=None):
    """A decode kernel emulated: the tensor-core one or the CUDA-core one (``paged_decode.cu``,
    its static shared memory a function's statics here), at its default launch shape."""
    from pagedkv.checks import cdiv
    from pagedkv.kernels import attention
    raw_cache, kv8 = _cache_bytes(cache)
    q_dtype = dtype_name(q)
    kv_dtype = "int8" if kv8 else dtype_name(cache)
    batch, q_heads, d = q.shape
    num_blocks, _, bs, kv_heads, _ = cache.shape
    group, code = q_heads // kv_heads, DTYPE_CODES[q_dtype]
    if tensor_cores:
        nwarps, stages = attention.tensor_core_config(d)
        name = attention.tensor_core_name(code, d, group, bs, kv8=kv8)
        smem, tile, source = attention._tc_smem(d, nwarps, stages, kv8), nwarps * 16, \
            "paged_decode_tc.cu"
    else:
        nwarps, unroll, stages, nv = attention.cuda_core_config(group, kv_dtype, d)
        name = attention.cuda_core_name(code, d, group, bs, kv8=kv8)
        tpt = d // attention._per_vec(kv_dtype) // nv
        smem, tile, source = 0, nwarps * (32 // tpt) * unroll, "paged_decode.cu"
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    max_len = tables.shape[1] * bs                             # as attention._plan cuts
    split_tokens = cdiv(cdiv(max_len, num_splits), tile) * tile
    splits = cdiv(max_len, split_tokens)
    order = list(range(splits)) if order is None else list(order)
    assert sorted(order) == list(range(splits)), (order, splits)
    hdr = np.array([batch, q_heads, d, num_blocks, bs, kv_heads, tables.shape[1], smem,
                    splits, split_tokens, raw_cache.size // 16, nwarps * 32], np.int32)
    text = None if tensor_cores else (ROOT / "pagedkv/kernels" / source).read_text()
    raw = _execute(binary(source, name, f"#define EMU_DT {code}\n" + DECODE_MAIN, text=text),
                   [hdr, np.float32(scale * 1.4426950408889634), _bits(q), raw_cache,
                    np.asarray(tables, np.int32), np.asarray(seq_lens, np.int32),
                    np.asarray(order, np.int32)], (-1,))
    out = raw[:q.size].reshape(q.shape)
    return out.view(q.dtype) if q.dtype != np.uint16 else out


NORM_ROPE_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int hdr[10];
    float eps;
    if (std::fread(hdr, 4, 10, f) != 10 || std::fread(&eps, 4, 1, f) != 1) return 2;
    const int K = hdr[0], q_heads = hdr[1], kv_heads = hdr[2], D = hdr[3], BS = hdr[4],
              num_blocks = hdr[5], context = hdr[6], grid_x = hdr[7], fused = hdr[8],
              kv8 = hdr[9];                        // an int8 cache (its bytes)
    const size_t es = EMU_DT == 0 ? 4 : 2, N = (size_t)(q_heads + 2 * kv_heads) * D;
    const size_t sizes[6] = {EMU_M * K * es, K * es, N * K * es, EMU_M * N * es,
                             EMU_M * q_heads * D * es,
                             kv8 ? (size_t)num_blocks * BS * kv_heads * (2 * D + D / 8)
                                 : (size_t)num_blocks * 2 * BS * kv_heads * D * es};
    std::vector<uint4> a[6];                       // x, norm_w, w, qkv, q_out, cache
    std::vector<int> pos(EMU_M), slots(EMU_M);
    std::vector<float> cs((size_t)context * D / 2), sn(cs.size());
    auto rd = [&](void* p, size_t n) { if (n && std::fread(p, 1, n, f) != n) std::exit(2); };
    for (int i = 0; i < 6; ++i) {
        a[i].resize((sizes[i] + 15) / 16);
        rd(a[i].data(), sizes[i]);
    }
    rd(pos.data(), EMU_M * 4); rd(slots.data(), EMU_M * 4);
    rd(cs.data(), cs.size() * 4); rd(sn.data(), sn.size() * 4);
    std::fclose(f);
    void *x = a[0].data(), *nw = a[1].data(), *w = a[2].data(), *qkv = a[3].data(),
         *q = a[4].data(), *cache = a[5].data();
    gridDim = {(unsigned)grid_x, 1u, 1u};
    for (int b = 0; b < grid_x; ++b)
        emu::run_cta(b, 0, 256, 0, [&] {
            if (fused && kv8)
                norm_gemv_rope8_t<EMU_DT, EMU_M>(x, nw, eps, w, qkv, pos.data(), slots.data(),
                                                 cs.data(), sn.data(), q,
                                                 (unsigned char*)cache, K, q_heads, kv_heads,
                                                 D, BS);
            else if (fused)
                norm_gemv_rope_t<EMU_DT, EMU_M>(x, nw, eps, w, qkv, pos.data(), slots.data(),
                                                cs.data(), sn.data(), q, cache, K, q_heads,
                                                kv_heads, D, BS);
            else
                norm_gemv_t<EMU_DT, EMU_DT, EMU_M, 0, EMU_R>(x, nw, eps, w, qkv, K, (int)N);
        });
    if (!fused) {                                  // then rope_write_kv, one CTA a row
        gridDim = {(unsigned)EMU_M, 1u, 1u};
        for (int t = 0; t < EMU_M; ++t)
            emu::run_cta(t, 0, 128, 0, [&] {
                if (kv8)
                    rope_write_kv8<EMU_DT>(qkv, pos.data(), slots.data(), cs.data(),
                                           sn.data(), q, (unsigned char*)cache, q_heads,
                                           kv_heads, D, BS);
                else
                    rope_write_kv<EMU_DT>(qkv, pos.data(), slots.data(), cs.data(),
                                          sn.data(), q, cache, q_heads, kv_heads, D, BS);
            });
    }
    FILE* g = std::fopen(argv[2], "wb");
    for (int i = 3; i < 6; ++i) std::fwrite(a[i].data(), 1, sizes[i], g);
    std::fclose(g);
    return 0;
}
"""


def run_norm_gemv_rope(x, norm_w, eps, w, qkv, positions, slots, cos, sin, q_out, cache,
                       q_heads, kv_heads, *, fused=True, grid_x=3, rows_per_warp=1):
    """norm_gemv_rope's kernel (``fused``) or the two launches it replaces (norm_gemv_t,
    then rope_write_kv; norm_gemv_t's warps making ``rows_per_warp`` outputs each),
    emulated on ``grid_x`` CTAs: returns new (qkv, q_out, cache), the given ones as they
    start (their poison shows what is never written). An int8 Cache8 runs
    norm_gemv_rope8_t (or rope_write_kv8 after norm_gemv_t) and comes back as one; the fused
    kernel then takes 2 kv_heads CTAs more, for the k and v heads."""
    from pagedkv.kernels.norm_gemv import NORM_GEMV_SOURCE
    from pagedkv.kernels.fused import FUSED_SOURCE
    dt, m = DTYPE_CODES[dtype_name(x)], x.shape[0]
    kernels = ROOT / "pagedkv/kernels"
    text = "\n".join((kernels / f).read_text()
                     for f in (FUSED_SOURCE, "gemv.cu", NORM_GEMV_SOURCE))   # as _source()
    main = (f"#define EMU_DT {dt}\n#define EMU_M {m}\n#define EMU_R {rows_per_warp}\n"
            + NORM_ROPE_MAIN)
    exe = binary(NORM_GEMV_SOURCE, f"norm_gemv_rope_t<{dt}, {m}>", main, text=text)
    num_blocks, _, bs, _, d = cache.shape
    kv8 = isinstance(cache, Cache8)
    grid = grid_x + (2 * kv_heads if kv8 and fused else 0)
    hdr = np.array([x.shape[1], q_heads, kv_heads, d, bs, num_blocks, cos.shape[0], grid,
                    int(fused), int(kv8)], np.int32)
    outs = (qkv, q_out, cache.raw if kv8 else cache)
    arrays = [hdr, np.float32(eps), x, norm_w, w, *outs, np.asarray(positions, np.int32),
              np.asarray(slots, np.int32), np.asarray(cos, np.float32),
              np.asarray(sin, np.float32)]
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = pathlib.Path(tmp) / "in", pathlib.Path(tmp) / "out"
        with open(inp, "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).tobytes())
        r = subprocess.run([str(exe), str(inp), str(outp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"emulator failed ({r.returncode}): {r.stderr[-2000:]}")
        raw = np.fromfile(outp, np.uint8)
    got, at = [], 0
    for a in outs:
        got.append(raw[at:at + a.nbytes].view(a.dtype).reshape(a.shape))
        at += a.nbytes
    if kv8:
        got[2] = Cache8(got[2].copy(), bs, kv_heads, d)
    return tuple(got)


def norm_rope_case(rng, dtype, m, block_size, *, hidden=64, q_heads=4, kv_heads=2, d=32,
                   num_blocks=6, context=64):
    """A small norm_gemv_rope call: random x, weights and positions; distinct slots, the
    last row padding (slot -1) when there are two rows or more; NaN in qkv, q_out, cache."""
    n = (q_heads + 2 * kv_heads) * d
    rand = lambda *s: rng.standard_normal(s).astype(dtype)  # noqa: E731
    x, norm_w, w = rand(m, hidden), rand(hidden), rand(n, hidden) * 0.2
    positions = rng.integers(0, context, m).astype(np.int32)
    slots = rng.permutation(num_blocks * block_size)[:m].astype(np.int32)
    if m > 1:
        slots[-1] = -1
    ang = np.outer(np.arange(context), 10000.0 ** (-np.arange(0, d, 2) / d))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    qkv = np.full((m, n), np.nan, dtype)
    q_out = np.full((m, q_heads, d), np.nan, dtype)
    cache = np.full((num_blocks, 2, block_size, kv_heads, d), np.nan, dtype)
    return (x, norm_w, 1e-5, w, qkv, positions, slots, cos, sin, q_out, cache, q_heads,
            kv_heads)


def check_norm_gemv_rope(dtype, m, block_size, seed):
    """The emulated kernel against the emulated pair, whose norm_gemv_t makes one output a
    warp and then four (the same bits in all three, NaN poison included)
    and against the NumPy reference (norm_gemv then rope_write_kv): within rounding, and
    NaN exactly where the reference wrote nothing. Returns (bits equal, max rel err)."""
    from pagedkv.kernels.norm_gemv import norm_gemv_rope
    case = norm_rope_case(np.random.default_rng(seed), dtype, m, block_size)
    fused = run_norm_gemv_rope(*case)
    pair = run_norm_gemv_rope(*case, fused=False)
    four = run_norm_gemv_rope(*case, fused=False, rows_per_warp=4)  # 4 outputs a warp
    same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8)) and
               np.array_equal(a.view(np.uint8), c.view(np.uint8))
               for a, b, c in zip(fused, pair, four))
    ref = [a.copy() for a in (case[4], case[9], case[10])]
    norm_gemv_rope(*case[:4], ref[0], *case[5:9], ref[1], ref[2], *case[11:])
    err = 0.0
    for got, want in zip(fused, ref):
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return same, np.inf
        ok = ~np.isnan(want)
        g, r = got[ok].astype(np.float64), want[ok].astype(np.float64)
        err = max(err, float(np.abs(g - r).max() / np.abs(r).max()))
    return same, err


def check_norm_gemv_rope8(dtype, m, block_size, seed, *, d=64, q_heads=6, kv_heads=2):
    """norm_gemv_rope with an int8 cache: the emulated norm_gemv_rope8_t against the
    emulated pair (norm_gemv_t, then rope_write_kv8): the same bits in qkv, q_out and the
    cache's bytes (junk where nothing is written); and against the NumPy reference
    (norm_gemv, then rope_write_kv into a Cache8), within rounding (the dequantized cache,
    over the rows the reference wrote). Returns (bits equal, max rel err)."""
    from pagedkv.kernels.norm_gemv import norm_gemv_rope
    rng = np.random.default_rng(seed)
    case = list(norm_rope_case(rng, dtype, m, block_size, d=d, q_heads=q_heads,
                               kv_heads=kv_heads))
    nb = case[10].shape[0]
    cache = Cache8.zeros(nb, block_size, kv_heads, d, np)
    cache.raw[...] = rng.integers(0, 256, cache.raw.shape)      # junk, never cleared
    case[10] = cache
    fused = run_norm_gemv_rope(*case)
    pair = run_norm_gemv_rope(*case, fused=False)
    same = all(np.array_equal(a.view(np.uint8), b.view(np.uint8))
               for a, b in zip(fused[:2], pair[:2])) and \
        np.array_equal(fused[2].raw, pair[2].raw)
    ref = [case[4].copy(), case[9].copy(), cache.copy()]
    norm_gemv_rope(*case[:4], ref[0], *case[5:9], ref[1], ref[2], *case[11:])
    err = 0.0
    for got, want in zip(fused[:2], ref[:2]):
        if not np.array_equal(np.isnan(got), np.isnan(want)):
            return same, np.inf
        ok = ~np.isnan(want)
        g, r = got[ok].astype(np.float64), want[ok].astype(np.float64)
        err = max(err, float(np.abs(g - r).max() / np.abs(r).max()))
    written = case[6][case[6] >= 0]
    from pagedkv.kernels.kv8 import read_rows
    for kv in (0, 1):
        b, o = written // block_size, written % block_size
        g, r = (read_rows(c, b, o, kv, np.float64) for c in (fused[2], ref[2]))
        err = max(err, float(np.abs(g - r).max() / np.abs(r).max()))
    return same, err


WRITE8_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    long long hdr[10];
    if (std::fread(hdr, 8, 10, f) != 10) return 2;
    const int tokens = (int)hdr[0], q_heads = (int)hdr[1], kv_heads = (int)hdr[2],
              D = (int)hdr[3], BS = (int)hdr[4], context = (int)hdr[5], rope = (int)hdr[6];
    const long long cache_bytes = hdr[7], num_slots = hdr[8];
    const size_t es = EMU_DT == 0 ? 4 : 2;
    const size_t in_n = rope ? (size_t)tokens * (q_heads + 2 * kv_heads) * D
                             : (size_t)tokens * kv_heads * D;
    std::vector<uint4> a((in_n * es + 15) / 16), b((in_n * es + 15) / 16),
                       q((tokens * q_heads * D * es + 15) / 16), cache((cache_bytes + 15) / 16);
    std::vector<int> pos(tokens), slots(tokens);
    std::vector<float> cs((size_t)context * D / 2), sn(cs.size());
    auto rd = [&](void* p, size_t n) { if (n && std::fread(p, 1, n, f) != n) std::exit(2); };
    rd(a.data(), in_n * es);
    if (!rope) rd(b.data(), in_n * es);
    rd(slots.data(), tokens * 4);
    if (rope) {
        rd(pos.data(), tokens * 4); rd(cs.data(), cs.size() * 4); rd(sn.data(), sn.size() * 4);
        rd(q.data(), tokens * q_heads * D * es);
    }
    rd(cache.data(), cache_bytes);
    std::fclose(f);
    if (rope) {
        gridDim = {(unsigned)tokens, 1u, 1u};
        for (int t = 0; t < tokens; ++t)
            emu::run_cta(t, 0, 128, 0, [&] {
                rope_write_kv8<EMU_DT>(a.data(), pos.data(), slots.data(), cs.data(), sn.data(),
                                       q.data(), (unsigned char*)cache.data(), q_heads,
                                       kv_heads, D, BS);
            });
    } else {
        const int ctas = (2 * tokens * kv_heads + 3) / 4;
        gridDim = {(unsigned)ctas, 1u, 1u};
        for (int c = 0; c < ctas; ++c)
            emu::run_cta(c, 0, 128, 0, [&] {
                write_kv8<EMU_DT>(a.data(), b.data(), slots.data(),
                                  (unsigned char*)cache.data(), tokens, kv_heads, D, BS,
                                  num_slots);
            });
    }
    FILE* g = std::fopen(argv[2], "wb");
    std::fwrite(cache.data(), 1, cache_bytes, g);
    if (rope) std::fwrite(q.data(), 1, tokens * q_heads * D * es, g);
    std::fclose(g);
    return 0;
}
"""


def _write8_exe(dt: int):
    from pagedkv.kernels.fused import FUSED_SOURCE
    text = (ROOT / "pagedkv/kernels" / FUSED_SOURCE).read_text()
    return binary(FUSED_SOURCE, f"write_kv8<{dt}>", f"#define EMU_DT {dt}\n" + WRITE8_MAIN,
                  text=text)


def _run_bytes(exe, arrays):
    with tempfile.TemporaryDirectory() as tmp:
        inp, outp = pathlib.Path(tmp) / "in", pathlib.Path(tmp) / "out"
        with open(inp, "wb") as f:
            for a in arrays:
                f.write(np.ascontiguousarray(a).tobytes())
        r = subprocess.run([str(exe), str(inp), str(outp)], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"emulator failed ({r.returncode}): {r.stderr[-2000:]}")
        return np.fromfile(outp, np.uint8)


def run_write_kv8(cache, k, v, slots):
    """write_kv's int8 kernel (write_kv8, a warp per head row) emulated: returns a new
    Cache8 (``cache`` as it starts; its bytes the kernel leaves alone stay as they were)."""
    dt = DTYPE_CODES[dtype_name(k)]
    nb, _, bs, h, d = cache.shape
    hdr = np.array([k.shape[0], 0, h, d, bs, 0, 0, cache.raw.size, nb * bs, 0], np.int64)
    raw = _run_bytes(_write8_exe(dt), [hdr, _bits(k) if dt else k, _bits(v) if dt else v,
                                       np.asarray(slots, np.int32), cache.raw])
    return Cache8(raw.reshape(cache.raw.shape), bs, h, d)


def run_rope_write_kv8(qkv, positions, slots, cos, sin, q_out, cache, q_heads, kv_heads):
    """rope_write_kv's int8 kernel (rope_write_kv8) emulated: returns (q_out, Cache8), new."""
    dt = DTYPE_CODES[dtype_name(qkv)]
    nb, _, bs, h, d = cache.shape
    hdr = np.array([qkv.shape[0], q_heads, kv_heads, d, bs, cos.shape[0], 1, cache.raw.size,
                    nb * bs, 0], np.int64)
    raw = _run_bytes(_write8_exe(dt), [hdr, qkv, np.asarray(slots, np.int32),
                                       np.asarray(positions, np.int32),
                                       np.asarray(cos, np.float32), np.asarray(sin, np.float32),
                                       q_out, cache.raw])
    c8 = Cache8(raw[:cache.raw.size].reshape(cache.raw.shape).copy(), bs, h, d)
    return raw[cache.raw.size:].view(q_out.dtype).reshape(q_out.shape), c8


def main():
    sys.path.insert(0, str(ROOT / "tests"))
    from _attn_cases import make_case, make_prefill_case, rel_err, rng_for
    from pagedkv.kernels.reference import (paged_decode_attention_ref,
                                           paged_prefill_attention_ref)
    bad = 0
    for i, (dtype, d, g, bs) in enumerate([("float16", 128, 4, 16), ("bfloat16", 64, 3, 8)]):
        rng = rng_for(6900 + i)
        case = make_case(rng, [1, 17, 40], 2 * g, 2, d, bs, dtype, junk=np.nan)
        err = rel_err(run_decode_tc(*case).astype(np.float64), paged_decode_attention_ref(*case))
        bad += not err < 1e-2
        print(f"the emulator on the decode tensor-core kernel ({dtype} d{d} g{g} bs{bs}): "
              f"rel err {err:.2e}")
    cases = [("float16", 64, 3, 16, [7, 100], [0, 30]),
             ("bfloat16", 128, 4, 8, [1, 16, 33], [5, 0, 17])]
    for i, (dtype, d, g, bs, qlens, prefix) in enumerate(cases):
        rng = rng_for(7000 + i)
        q, cache, tables, qs, lens = make_prefill_case(rng, qlens, prefix, 2 * g, 2, d, bs,
                                                       dtype, junk=np.nan)
        ref = paged_prefill_attention_ref(q, cache, tables, qs, lens)
        got = run_prefill(q, cache, tables, qs, lens).astype(np.float64)
        err = rel_err(got, ref)
        ok = np.isfinite(got).all() and err < 1e-2
        bad += not ok
        print(f"{dtype} d{d} g{g} bs{bs} qlens {qlens} prefix {prefix}: rel err {err:.2e}"
              f"{'' if ok else '  FAIL'}")
    for i, (dtype, m, bs) in enumerate([(np.float16, 1, 16), (np.float16, 2, 32),
                                        (np.float32, 8, 16), (np.float16, 8, 32)]):
        same, err = check_norm_gemv_rope(dtype, m, bs, seed=7100 + i)
        ok = same and err < (1e-2 if dtype == np.float16 else 1e-5)
        bad += not ok
        print(f"norm_gemv_rope {np.dtype(dtype).name} rows {m} bs{bs} (seed {7100 + i}): "
              f"{'the same bits as' if same else 'NOT the bits of'} norm_gemv_t + "
              f"rope_write_kv, rel err {err:.2e} to NumPy{'' if ok else '  FAIL'}")
    from pagedkv.kernels import write_kv
    for i, (dtype, d, g, bs, tc) in enumerate([("float16", 64, 3, 16, False),
                                               ("float16", 64, 3, 16, True),
                                               ("bfloat16", 128, 6, 8, True)]):
        rng = rng_for(7200 + i)                     # the int8 cache: decode on both kernels
        q, cache, tables, lens = make_case(rng, [1, 40, 150], 2 * g, 2, d, bs, dtype,
                                           max_blocks=160 // bs)
        c8 = Cache8.zeros(cache.shape[0], bs, 2, d, np)
        c8.raw[...] = rng.integers(0, 256, c8.raw.shape)
        for b, n in enumerate(lens):
            t = np.arange(n)
            sl = (tables[b, t // bs] * bs + t % bs).astype(np.int32)
            write_kv(c8, cache[sl // bs, 0, sl % bs], cache[sl // bs, 1, sl % bs], sl)
        err = rel_err(run_decode(q, c8, tables, lens, tensor_cores=tc, num_splits=2)
                      .astype(np.float64), paged_decode_attention_ref(q, c8, tables, lens))
        bad += not err < 1e-2
        print(f"int8 cache, decode on {'tensor' if tc else 'CUDA'} cores ({dtype} d{d} g{g} "
              f"bs{bs}, 2 splits): rel err {err:.2e}{'' if err < 1e-2 else '  FAIL'}")
    for i, (dtype, m, bs) in enumerate([(np.float16, 1, 16), (np.float16, 2, 32),
                                        (np.float32, 8, 16)]):
        same, err = check_norm_gemv_rope8(dtype, m, bs, seed=7300 + i)
        ok = same and err < (1e-2 if dtype == np.float16 else 1e-5)
        bad += not ok
        print(f"norm_gemv_rope8 {np.dtype(dtype).name} rows {m} bs{bs}: "
              f"{'the same bits as' if same else 'NOT the bits of'} norm_gemv_t + "
              f"rope_write_kv8, rel err {err:.2e} to NumPy{'' if ok else '  FAIL'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
