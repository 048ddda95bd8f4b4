// A tiny CPU stand-in for the CUDA features the tensor-core attention kernels use, so that
// their source runs unchanged (one CTA at a time) on a machine without a GPU: every thread
// of a CTA is a fiber (ucontext), switched only where CUDA threads meet -- __syncthreads and
// the warp-wide operations (shuffles, ballots, ldmatrix, mma.sync). A warp-wide operation
// collects the 32 lanes' inputs; the last lane to arrive computes every lane's result from
// the PTX manual's fragment layouts. cp.async copies at once (zeros when told to). Shared
// memory, ldmatrix and cp.async addresses are bounds- and alignment-checked; a deadlock (a
// barrier some thread never reaches) aborts. Slow (microseconds per warp operation), exact
// enough (products in float, as the tensor cores accumulate in fp32).
#pragma once
#include <ucontext.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static     // one CTA at a time: a function's statics are shared memory

struct alignas(16) uint4 { unsigned x, y, z, w; };   // 16-byte aligned, as CUDA's
struct emu_dim3 { unsigned x, y, z; };

namespace emu {
struct Fiber {
    ucontext_t ctx;
    int tid = 0;
    bool done = false;
    std::vector<char> stack;
};
inline ucontext_t sched_ctx;
inline Fiber* cur = nullptr;
inline std::vector<Fiber*> fibers;
inline std::function<void()> body;
inline long long progress = 0;
inline int nthreads = 0;
inline int cta_count = 0, cta_gen = 0;
constexpr int MAXW = 32;
inline int wcount[MAXW], wgen[MAXW];
inline uint32_t win[MAXW][32][8];     // lanes' inputs to a warp-wide operation
inline uint32_t wout[MAXW][32][4];    // their results
inline char* smem = nullptr;
inline size_t smem_bytes = 0;
inline const char* gbase = nullptr;   // the one global array cp.async may read
inline size_t gbytes = 0;

[[noreturn]] inline void die(const char* what) {
    std::fprintf(stderr, "emu: %s (thread %d)\n", what, cur ? cur->tid : -1);
    std::exit(3);
}
inline void yield() { swapcontext(&cur->ctx, &sched_ctx); }
inline int lane() { return cur->tid % 32; }
inline int warp() { return cur->tid / 32; }

// All 32 lanes deposit inputs in win; the last one runs `compute` (filling wout for every
// lane); then everyone continues.
template <class F> inline void warp_op(F compute) {
    const int w = warp();
    const int g = wgen[w];
    if (++wcount[w] == 32) {
        compute(w);
        wcount[w] = 0;
        ++wgen[w];
        ++progress;
    } else {
        while (wgen[w] == g) yield();
    }
}
}  // namespace emu

#define threadIdx (emu_dim3{(unsigned)emu::cur->tid, 0u, 0u})
inline emu_dim3 blockIdx, gridDim, blockDim;

inline void __syncthreads() {
    const int g = emu::cta_gen;
    if (++emu::cta_count == emu::nthreads) {
        emu::cta_count = 0;
        ++emu::cta_gen;
        ++emu::progress;
    } else {
        while (emu::cta_gen == g) emu::yield();
    }
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_op([](int) {}); }

template <class T> inline T emu_shfl(T v, int src) {
    static_assert(sizeof(T) == 4, "32-bit shuffles");
    const int w = emu::warp(), l = emu::lane();
    std::memcpy(&emu::win[w][l][0], &v, 4);
    emu::win[w][l][1] = (uint32_t)src;
    emu::warp_op([](int w) {
        for (int i = 0; i < 32; ++i) emu::wout[w][i][0] = emu::win[w][emu::win[w][i][1] & 31][0];
    });
    T r;
    std::memcpy(&r, &emu::wout[w][l][0], 4);
    return r;
}
template <class T> inline T __shfl_sync(unsigned, T v, int src) { return emu_shfl(v, src); }
template <class T> inline T __shfl_xor_sync(unsigned, T v, int m) {
    return emu_shfl(v, emu::lane() ^ m);
}
template <class T> inline T __shfl_up_sync(unsigned, T v, unsigned d) {
    const int l = emu::lane();
    return emu_shfl(v, l >= (int)d ? l - (int)d : l);
}
inline unsigned __ballot_sync(unsigned, int pred) {
    const int w = emu::warp(), l = emu::lane();
    emu::win[w][l][0] = pred ? 1u : 0u;
    emu::warp_op([](int w) {
        unsigned bits = 0;
        for (int i = 0; i < 32; ++i) bits |= emu::win[w][i][0] << i;
        for (int i = 0; i < 32; ++i) emu::wout[w][i][0] = bits;
    });
    return emu::wout[w][l][0];
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
using std::exp2f;
using std::fmaxf;
using std::fmaf;
inline float __expf(float x) { return std::exp(x); }
// Each a single rounded operation: x86-64's SSE arithmetic, which g++ does not fuse here.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float x) {             // nearest, ties to even; saturating
    if (std::isnan(x)) return 0;
    if (x >= 2147483647.f) return 2147483647;
    if (x <= -2147483648.f) return (-2147483647 - 1);
    return (int)std::nearbyint(x);               // the default rounding mode: to even
}


#define NEG_INF __uint_as_float(0xff800000u)

// Programmatic dependent launch (common.cuh): the emulator runs one grid at a time, CTA
// after CTA, so the grid before has always ended and there is no L2 to ask.
inline void wait_for_prior_grid() {}
inline void let_next_grid_start() {}
inline void prefetch_row(const void*, long long, int) {}

// Memory shared between CTAs (the attention kernels' merge by their last split, common.cuh):
// one CTA runs at a time, so a fence has nothing to order and an atomic nothing to race.
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) { const unsigned o = *p; *p += v; return o; }
inline unsigned atomicExch(unsigned* p, unsigned v) { const unsigned o = *p; *p = v; return o; }
template <class T> inline T __ldcg(const T* p) { return *p; }

// ---- 16-bit numbers ------------------------------------------------------------------
inline float half_to_float(uint16_t h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
inline uint16_t float_to_half(float f) { _Float16 x = (_Float16)f; uint16_t h; std::memcpy(&h, &x, 2); return h; }
inline float bf16_to_float(uint16_t h) { return __uint_as_float((unsigned)h << 16); }
inline uint16_t float_to_bf16(float f) {          // round to nearest even, NaN kept NaN
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <int DT> struct Num;
template <> struct Num<0> {
    static constexpr int PER_VEC = 4;
    static float load(const void* p, long long i) { return ((const float*)p)[i]; }
    static void unpack(const uint4& r, float* f) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    static void store(void* p, long long i, float x) { ((float*)p)[i] = x; }
};
// load and unpack (common.cuh's) for the 16-bit types, from widen
template <class N16> struct Num16 {
    static constexpr int PER_VEC = 8;
    static float load(const void* p, long long i) { return N16::widen(((const uint16_t*)p)[i]); }
    static void unpack(const uint4& r, float* f) {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = N16::widen((uint16_t)(w[i] & 0xffff));
            f[2 * i + 1] = N16::widen((uint16_t)(w[i] >> 16));
        }
    }
};
template <> struct Num<1> : Num16<Num<1>> {
    static float widen(uint16_t h) { return half_to_float(h); }
    static float load(const void* p, long long i) { return widen(((const uint16_t*)p)[i]); }
    static void store(void* p, long long i, float x) { ((uint16_t*)p)[i] = float_to_half(x); }
    static unsigned pack2(float lo, float hi) {
        return (unsigned)float_to_half(lo) | ((unsigned)float_to_half(hi) << 16);
    }
};
template <> struct Num<2> : Num16<Num<2>> {
    static float widen(uint16_t h) { return bf16_to_float(h); }
    static float load(const void* p, long long i) { return widen(((const uint16_t*)p)[i]); }
    static void store(void* p, long long i, float x) { ((uint16_t*)p)[i] = float_to_bf16(x); }
    static unsigned pack2(float lo, float hi) {
        return (unsigned)float_to_bf16(lo) | ((unsigned)float_to_bf16(hi) << 16);
    }
};

// ---- shared memory, cp.async ------------------------------------------------------------
inline unsigned smem_addr(const void* p) {
    const char* c = (const char*)p;
    if (c < emu::smem || c >= emu::smem + emu::smem_bytes) emu::die("smem_addr outside shared memory");
    return (unsigned)(c - emu::smem);
}
// A destination outside the dynamic shared memory is a static __shared__ array (a
// function's static here): aligned, not bounds-checked. N is 16, or 4 (the 8-bit cache's
// scale pairs).
template <int N> inline void cp_async_n(void* dst, const void* src, bool ok) {
    const char* d = (const char*)dst;
    if (d >= emu::smem && d < emu::smem + emu::smem_bytes) {
        const unsigned a = smem_addr(dst);
        if (a % N || a + N > emu::smem_bytes) emu::die("cp.async destination misaligned or out of bounds");
    } else if ((uintptr_t)d % N) {
        emu::die("cp.async destination misaligned");
    }
    if (ok) {
        const char* s = (const char*)src;
        if (s < emu::gbase || s + N > emu::gbase + emu::gbytes || (s - emu::gbase) % N)
            emu::die("cp.async source outside the cache");
        std::memcpy(dst, src, N);
    } else {
        std::memset(dst, 0, N);
    }
}
inline void cp_async16(void* dst, const void* src, bool ok) { cp_async_n<16>(dst, src, ok); }
inline void cp_async4(void* dst, const void* src, bool ok) { cp_async_n<4>(dst, src, ok); }
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}

// ---- ldmatrix and mma.sync --------------------------------------------------------------
inline uint16_t smem16(unsigned byte) {
    if (byte + 2 > emu::smem_bytes) emu::die("ldmatrix read past shared memory");
    uint16_t v; std::memcpy(&v, emu::smem + byte, 2); return v;
}
template <bool TRANS> inline void emu_ldmatrix(unsigned* r, unsigned addr) {
    const int w = emu::warp(), l = emu::lane();
    if (addr % 16) emu::die("ldmatrix row address not 16-byte aligned");
    emu::win[w][l][0] = addr;
    emu::warp_op([](int w) {
        for (int t = 0; t < 32; ++t) {
            for (int j = 0; j < 4; ++j) {
                unsigned lo, hi;
                if (!TRANS) {       // row t/4 of matrix j, numbers 2(t%4), 2(t%4)+1
                    const unsigned row = emu::win[w][8 * j + t / 4][0];
                    lo = smem16(row + 4 * (t % 4));
                    hi = smem16(row + 4 * (t % 4) + 2);
                } else {            // column t/4 of matrix j, rows 2(t%4), 2(t%4)+1
                    lo = smem16(emu::win[w][8 * j + 2 * (t % 4)][0] + 2 * (t / 4));
                    hi = smem16(emu::win[w][8 * j + 2 * (t % 4) + 1][0] + 2 * (t / 4));
                }
                emu::wout[w][t][j] = lo | (hi << 16);
            }
        }
    });
    for (int j = 0; j < 4; ++j) r[j] = emu::wout[w][l][j];
}
inline void ldmatrix_x4(unsigned* r, unsigned addr) { emu_ldmatrix<false>(r, addr); }
inline void ldmatrix_x4_trans(unsigned* r, unsigned addr) { emu_ldmatrix<true>(r, addr); }

// D[16x8] += A[16x16] B[16x8]; fragments as in the PTX manual (m16n8k16, row.col).
template <int DT> inline void mma16816(float* d, const unsigned* a, unsigned b0, unsigned b1) {
    const int w = emu::warp(), l = emu::lane();
    for (int i = 0; i < 4; ++i) emu::win[w][l][i] = a[i];
    emu::win[w][l][4] = b0;
    emu::win[w][l][5] = b1;
    static thread_local float A[16][16], B[16][8];
    emu::warp_op([](int w) {
        auto lo = [](unsigned x) { return Num<DT>::widen((uint16_t)(x & 0xffff)); };
        auto hi = [](unsigned x) { return Num<DT>::widen((uint16_t)(x >> 16)); };
        for (int t = 0; t < 32; ++t) {
            const int g = t / 4, c = 2 * (t % 4);
            const uint32_t* f = emu::win[w][t];
            A[g][c] = lo(f[0]);     A[g][c + 1] = hi(f[0]);
            A[g + 8][c] = lo(f[1]); A[g + 8][c + 1] = hi(f[1]);
            A[g][c + 8] = lo(f[2]); A[g][c + 9] = hi(f[2]);
            A[g + 8][c + 8] = lo(f[3]); A[g + 8][c + 9] = hi(f[3]);
            B[c][g] = lo(f[4]);     B[c + 1][g] = hi(f[4]);
            B[c + 8][g] = lo(f[5]); B[c + 9][g] = hi(f[5]);
        }
        for (int t = 0; t < 32; ++t) {
            const int g = t / 4, c = 2 * (t % 4);
            for (int i = 0; i < 4; ++i) {
                const int row = g + 8 * (i >> 1), col = c + (i & 1);
                float acc = 0.f;
                for (int k = 0; k < 16; ++k) acc += A[row][k] * B[k][col];
                float v; std::memcpy(&v, &acc, 4);
                std::memcpy(&emu::wout[w][t][i], &v, 4);
            }
        }
    });
    for (int i = 0; i < 4; ++i) { float v; std::memcpy(&v, &emu::wout[w][l][i], 4); d[i] += v; }
}

// ---- running one CTA ----------------------------------------------------------------------
namespace emu {
inline void trampoline() { body(); cur->done = true; ++progress; swapcontext(&cur->ctx, &sched_ctx); }

// Run `kernel_call` (which reads threadIdx) as `threads` threads of CTA (bx, by).
inline void run_cta(int bx, int by, int threads, size_t shared_bytes,
                    std::function<void()> kernel_call) {
    static std::vector<char> shared_buf;
    shared_buf.assign(shared_bytes + 16, (char)0x7f);   // garbage, not zeros
    smem = (char*)(((uintptr_t)shared_buf.data() + 15) & ~(uintptr_t)15);
    smem_bytes = shared_bytes;
    blockIdx = {(unsigned)bx, (unsigned)by, 0u};
    blockDim = {(unsigned)threads, 1u, 1u};
    nthreads = threads;
    cta_count = 0;
    for (int w = 0; w < MAXW; ++w) wcount[w] = 0;
    body = kernel_call;
    static std::vector<Fiber> pool;
    pool.resize(threads);
    fibers.clear();
    for (int t = 0; t < threads; ++t) {
        Fiber& f = pool[t];
        f.tid = t;
        f.done = false;
        f.stack.resize(256 * 1024);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, (void (*)())trampoline, 0);
        fibers.push_back(&f);
    }
    for (;;) {
        const long long before = progress;
        bool any = false;
        for (Fiber* f : fibers) {
            if (f->done) continue;
            any = true;
            cur = f;
            swapcontext(&sched_ctx, &f->ctx);
        }
        cur = nullptr;
        if (!any) break;
        if (progress == before) die("deadlock: every live thread waits at a barrier");
    }
}
}  // namespace emu
