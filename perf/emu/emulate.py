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
              threads = hdr[9], smem = hdr[10];
    std::vector<uint16_t> q((size_t)T * q_heads * D), out(q.size(), 0x7e00);
    std::vector<uint4> cache((size_t)num_blocks * 2 * BS * kv_heads * D / 8);
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


def run_prefill(q, cache, tables, query_start, seq_lens, *, scale=None, config=None):
    """paged_prefill_attention's GPU launch, emulated: returns out with q's dtype (rows the
    kernel never writes stay NaN)."""
    kv_dtype = dtype_name(cache)
    assert kv_dtype in ("float16", "bfloat16")
    T, q_heads, d = q.shape
    num_blocks, _, bs, kv_heads, _ = cache.shape
    group = q_heads // kv_heads
    config = config or prefill.prefill_config(d)
    nwarps, mt, kv_tile, stages = config
    name = prefill.prefill_name(DTYPE_CODES[kv_dtype], d, group, bs, config)
    batch = len(seq_lens)
    grid_x = prefill.grid_ctas(T, batch, group, nwarps * mt * 16)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    smem = prefill._smem(d, kv_tile, stages)
    hdr = np.array([T, q_heads, d, num_blocks, bs, kv_heads, batch, tables.shape[1], grid_x,
                    nwarps * 32, smem, 0], np.int32)
    out = _execute(binary(prefill.PREFILL_SOURCE, name, MAIN),
                   [hdr, np.float32(scale * 1.4426950408889634), _bits(q), _bits(cache),
                    np.asarray(tables, np.int32), np.asarray(query_start, np.int32),
                    np.asarray(seq_lens, np.int32)], q.shape)
    return out.view(q.dtype) if q.dtype != np.uint16 else out


DECODE_MAIN = r"""
#include <cstdio>
#include <vector>
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    int hdr[10];
    float scale_log2;
    if (std::fread(hdr, 4, 10, f) != 10 || std::fread(&scale_log2, 4, 1, f) != 1) return 2;
    const int batch = hdr[0], q_heads = hdr[1], D = hdr[2], num_blocks = hdr[3], BS = hdr[4],
              kv_heads = hdr[5], max_blocks = hdr[6], smem = hdr[7], splits = hdr[8],
              split_tokens = hdr[9];
    std::vector<uint16_t> q((size_t)batch * q_heads * D), out(q.size(), 0x7e00);
    std::vector<uint4> cache((size_t)num_blocks * 2 * BS * kv_heads * D / 8);
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
                emu::run_cta(x, y, 128, smem, [&] {
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
    Returns the output."""
    from pagedkv.checks import cdiv
    from pagedkv.kernels import attention
    kv_dtype = dtype_name(cache)
    batch, q_heads, d = q.shape
    num_blocks, _, bs, kv_heads, _ = cache.shape
    nwarps, stages = attention.tensor_core_config(d)
    assert nwarps == 4
    code = DTYPE_CODES[kv_dtype]
    name = attention.tensor_core_name(code, d, q_heads // kv_heads, bs)
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    max_len, tile = tables.shape[1] * bs, nwarps * 16          # as attention._plan cuts
    split_tokens = cdiv(cdiv(max_len, num_splits), tile) * tile
    splits = cdiv(max_len, split_tokens)
    order = list(range(splits)) if order is None else list(order)
    assert sorted(order) == list(range(splits)), (order, splits)
    hdr = np.array([batch, q_heads, d, num_blocks, bs, kv_heads, tables.shape[1],
                    attention._tc_smem(d, nwarps, stages), splits, split_tokens], np.int32)
    raw = _execute(binary("paged_decode_tc.cu", name, f"#define EMU_DT {code}\n" + DECODE_MAIN),
                   [hdr, np.float32(scale * 1.4426950408889634), _bits(q), _bits(cache),
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
              num_blocks = hdr[5], context = hdr[6], grid_x = hdr[7], fused = hdr[8];
    const size_t es = EMU_DT == 0 ? 4 : 2, N = (size_t)(q_heads + 2 * kv_heads) * D;
    const size_t sizes[6] = {EMU_M * K * es, K * es, N * K * es, EMU_M * N * es,
                             EMU_M * q_heads * D * es,
                             (size_t)num_blocks * 2 * BS * kv_heads * D * es};
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
            if (fused)
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
                rope_write_kv<EMU_DT>(qkv, pos.data(), slots.data(), cs.data(), sn.data(), q,
                                      cache, q_heads, kv_heads, D, BS);
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
    start (their poison shows what is never written)."""
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
    hdr = np.array([x.shape[1], q_heads, kv_heads, d, bs, num_blocks, cos.shape[0], grid_x,
                    int(fused), 0], np.int32)
    outs = (qkv, q_out, cache)
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
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
