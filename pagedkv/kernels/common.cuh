// =======================================================================================
// What every attention kernel in this folder shares. The Python launchers put this text
// in front of each kernel file before CuPy compiles it (NVRTC, CUDA's run-time compiler),
// so no header file has to be found at compile time.
//
// A few words for a first-time CUDA reader:
//  * A kernel is one function that many threads run at once. Threads come in warps of 32
//    that execute one instruction together, and warps in thread blocks ("CTAs") that
//    share a small, fast on-chip memory, `__shared__` memory. The grid of CTAs covers the
//    whole problem; each thread finds its piece from threadIdx (its place in the CTA) and
//    blockIdx (the CTA's place in the grid).
//  * Global memory (the GPU's HBM) is large and slow to answer: a few hundred nanoseconds
//    between asking and getting. It is fast only when the 32 threads of a warp ask for
//    one contiguous stretch together, ideally 16 bytes per thread (a `uint4`).
//  * K and V are stored as DT = 0 float32, 1 float16 or 2 bfloat16;
//    all arithmetic is float32.
// =======================================================================================

// Minus infinity, spelled as its bit pattern (no headers needed).
#define NEG_INF __uint_as_float(0xff800000u)

// ---- programmatic dependent launch (pagedkv/kernels/pdl.py) -------------------------
// Launched with programmatic stream serialization, a kernel may start while the kernel
// before it in the stream still runs. It must call wait_for_prior_grid() before it reads
// anything that kernel writes, or writes anything it reads; before the wait it may only do
// work on inputs nobody writes, such as asking L2 for its weights (prefetch_row). Launched
// the ordinary way, the wait returns at once. let_next_grid_start() lets the kernel after
// this one begin to launch (that one still waits for this one to end).
__device__ __forceinline__ void wait_for_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void let_next_grid_start() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}
// One warp asks L2 for the 128-byte lines of row n of a [rows][row_bytes] array.
__device__ __forceinline__ void prefetch_row(const void* a, long long n, int row_bytes) {
    const char* row = (const char*)a + n * row_bytes;
    for (int b = (threadIdx.x % 32) * 128; b < row_bytes; b += 32 * 128)
        asm volatile("prefetch.global.L2 [%0];" :: "l"(row + b));
}

// ---- stored numbers <-> float32 ---------------------------------------------------
// Num<DT>::load(p, i) reads number i of an array as float32; unpack widens the numbers of
// one 16-byte load; store writes one number back in the stored type.
template <int DT> struct Num;
template <> struct Num<0> {  // float32: a 16-byte load holds 4 numbers, nothing to do
    static constexpr int PER_VEC = 4;
    __device__ static float load(const void* p, long long i) {
        return ((const float*)p)[i];
    }
    __device__ static void unpack(const uint4& r, float* f) {
        f[0] = __uint_as_float(r.x); f[1] = __uint_as_float(r.y);
        f[2] = __uint_as_float(r.z); f[3] = __uint_as_float(r.w);
    }
    __device__ static void store(void* p, long long i, float x) { ((float*)p)[i] = x; }
};
template <> struct Num<1> {  // float16: 8 per 16 bytes; the cvt instruction widens each
    static constexpr int PER_VEC = 8;
    __device__ static float widen(unsigned short h) {
        float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
    }
    __device__ static float load(const void* p, long long i) {
        return widen(((const unsigned short*)p)[i]);
    }
    __device__ static void unpack(const uint4& r, float* f) {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = widen((unsigned short)(w[i] & 0xffff));
            f[2 * i + 1] = widen((unsigned short)(w[i] >> 16));
        }
    }
    __device__ static void store(void* p, long long i, float x) {
        unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        ((unsigned short*)p)[i] = h;
    }
    // Two float32 numbers rounded into one 32-bit register (lo in the low half), the form
    // the tensor cores take.
    __device__ static unsigned pack2(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <> struct Num<2> {  // bfloat16: the top half of a float32: widening is a shift
    static constexpr int PER_VEC = 8;
    __device__ static float load(const void* p, long long i) {
        return __uint_as_float((unsigned)((const unsigned short*)p)[i] << 16);
    }
    __device__ static void unpack(const uint4& r, float* f) {
        const unsigned w[4] = {r.x, r.y, r.z, r.w};
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = __uint_as_float(w[i] << 16);
            f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    }
    __device__ static void store(void* p, long long i, float x) {
        unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
        ((unsigned short*)p)[i] = h;
    }
    __device__ static unsigned pack2(float lo, float hi) {
        unsigned r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// ---- where a token's K or V row lives ---------------------------------------------
// The cache is [num_blocks][2][BLOCK_SIZE][kv_heads][HEAD_DIM]. Token t of a sequence
// sits in physical block table[t / BLOCK_SIZE], row t % BLOCK_SIZE; kv = 0 is its K half,
// 1 its V half. Returns the index of the row's first number, in elements, not bytes.
template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ long long kv_row(const int* table, int t, int kv, int h,
                                            int kv_heads) {
    const long long block = table[t / BLOCK_SIZE];
    return (((block * 2 + kv) * BLOCK_SIZE + t % BLOCK_SIZE) * kv_heads + h) * HEAD_DIM;
}

// ---- asynchronous copies global -> shared (Ampere and later) ----------------------
// cp.async.cg copies 16 bytes without passing through registers; with ok == false it
// copies 0 bytes and fills the 16 with zeros. commit closes a group of copies; wait<N>
// blocks until at most N groups of this thread are still in flight.
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned s;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
                 : "=r"(s) : "l"(p));
    return s;
}
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(ok ? 16 : 0) : "memory");
}
// The same for 4 bytes (cp.async.ca: through L1; .cg takes 16 bytes only): the 8-bit
// cache's scale pairs.
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;"
                 :: "r"(smem_addr(smem)), "l"(gmem), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}

// ---- tensor cores (the decode kernel's step 7 and the prefill kernel) -----------
// mma.sync.m16n8k16 and its fragments are described at the top of paged_decode_tc.cu.
// A and B fragments from shared memory: four 8x8 matrices of 16-bit numbers; threads
// 8j..8j+7 give the addresses of the 8 rows of matrix j, and thread t receives row t/4,
// numbers 2(t%4) and 2(t%4)+1 of each (of each transposed matrix with .trans).
__device__ __forceinline__ void ldmatrix_x4(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned* r, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}

// D = A * B + D on the tensor cores, float32 accumulators.
template <int DT> __device__ __forceinline__ void mma16816(float* d, const unsigned* a,
                                                           unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma16816<1>(float* d, const unsigned* a,
                                                        unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<2>(float* d, const unsigned* a,
                                                        unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// ---- merging partial softmaxes ----------------------------------------------------
// Split i of a query head saw weights summing to 2^lse_i and produced o_i, normalised.
// The softmax over all splits is out = sum_i 2^(lse_i - M) o_i / sum_i 2^(lse_i - M), M =
// max lse_i. merge_split_row makes query row qrow's outputs d = first, first + stride, ...
// It reads the splits' results through L2 (__ldcg): other CTAs, on other SMs, wrote them.
template <int DT>
__device__ __forceinline__ void merge_split_row(const float* part_o, const float* part_lse,
                                                void* out, long long qrow, int num_splits,
                                                int head_dim, int first, int stride) {
    const float* lse = part_lse + qrow * num_splits;
    float mx = NEG_INF;
    #pragma unroll 8
    for (int i = 0; i < num_splits; ++i) mx = fmaxf(mx, __ldcg(lse + i));
    for (int d = first; d < head_dim; d += stride) {
        float lsum = 0.f, o = 0.f;
        if (mx > NEG_INF) {
            #pragma unroll 8
            for (int i = 0; i < num_splits; ++i) {
                const float w = exp2f(__ldcg(lse + i) - mx);
                lsum += w;
                o += w * __ldcg(part_o + (qrow * num_splits + i) * head_dim + d);
            }
        }
        Num<DT>::store(out, qrow * head_dim + d, lsum > 0.f ? o / lsum : 0.f);
    }
}

// The merge as a kernel of its own, launched after the splits: one CTA per query head
// (blockIdx.x), thread d makes output number d.
template <int DT>
__global__ void merge_splits(const float* __restrict__ part_o,
                             const float* __restrict__ part_lse, void* __restrict__ out,
                             int num_splits, int head_dim) {
    wait_for_prior_grid();
    let_next_grid_start();
    merge_split_row<DT>(part_o, part_lse, out, blockIdx.x, num_splits, head_dim, threadIdx.x,
                        blockDim.x);
}

// ---- the 8-bit cache (pagedkv/kernels/kv8.py) ------------------------------------------
// An int8 layer cache is bytes: block b starts at b * kv8_block_bytes(...) and holds
//     values [2][BLOCK_SIZE][kv_heads][HEAD_DIM]          int8, K then V (as DT numbers sit)
//     scales [BLOCK_SIZE][kv_heads][HEAD_DIM / 32][2]     float16: K's scale, then V's
// Number i of a K or V row means value_i * (the scale of its run of 32: i / 32). A thread
// that reads 16 numbers of a row (one 16-byte load) needs one scale of each: the pair of
// its run is one 4-byte load. Writing, a warp takes a whole row (lane l its numbers l,
// l + 32, ...): the largest |x| of a run is a warp-wide maximum, scale = float16(amax /
// 127), and each number is rint(x / scale) clamped to [-127, 127] (0 where scale is 0):
// IEEE division and ties to even, the NumPy reference's rounding bit for bit.
#define KV8_RUN 32    // numbers that share a scale

__device__ __forceinline__ long long kv8_block_bytes(int block_size, int kv_heads,
                                                     int head_dim) {
    return (long long)block_size * kv_heads * (2 * head_dim + head_dim / KV8_RUN * 4);
}
// Where a block's scales start, in bytes from the block's start.
__device__ __forceinline__ long long kv8_scales_at(int block_size, int kv_heads,
                                                   int head_dim) {
    return 2LL * block_size * kv_heads * head_dim;
}
// The byte offset of the (K, V) scale pair of run g of token row `off` of kv head h,
// from the block's start.
__device__ __forceinline__ long long kv8_pair_at(int off, int h, int g, int block_size,
                                                 int kv_heads, int head_dim) {
    return kv8_scales_at(block_size, kv_heads, head_dim)
           + (((long long)off * kv_heads + h) * (head_dim / KV8_RUN) + g) * 4;
}

// A float16's bits as float32 (the scales are float16 whatever DT is).
__device__ __forceinline__ float kv8_half(unsigned short bits) {
    return Num<1>::load(&bits, 0);
}

// 16 int8 numbers (one 16-byte load) as float32, times s.
__device__ __forceinline__ void kv8_unpack(const uint4& r, float s, float* f) {
    const unsigned w[4] = {r.x, r.y, r.z, r.w};
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        #pragma unroll
        for (int j = 0; j < 4; ++j)
            f[4 * i + j] = (float)(signed char)((w[i] >> (8 * j)) & 0xffu) * s;
    }
}

// 16 int8 numbers times s as 16 DT numbers (DT 1 or 2), two 16-byte stores at `out`: what
// the tensor-core kernels put in shared memory for ldmatrix. (value * s is exact in float32:
// 8 bits times 11; the one rounding is to DT.)
template <int DT>
__device__ __forceinline__ void kv8_to16(const uint4& r, float s, uint4* out) {
    float f[16];
    kv8_unpack(r, s, f);
    unsigned o[8];
    #pragma unroll
    for (int k = 0; k < 8; ++k) o[k] = Num<DT>::pack2(f[2 * k], f[2 * k + 1]);
    out[0] = uint4{o[0], o[1], o[2], o[3]};
    out[1] = uint4{o[4], o[5], o[6], o[7]};
}

// One warp stores one K or V head row of D numbers (lane l holds numbers l + 32 j in
// x[j], j < D / 32 <= 8, each already rounded to the model's dtype): `vals` receives the D
// int8 numbers, scales[2 j] run j's scale (the pair layout: K's and V's interleave).
__device__ __forceinline__ void kv8_store_row(const float* x, int D, signed char* vals,
                                              unsigned short* scales) {
    const int lane = threadIdx.x % 32;
    #pragma unroll
    for (int j = 0; j < 8; ++j) {
        if (j >= D / KV8_RUN) break;
        float a = fabsf(x[j]);
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, o));
        unsigned short bits;
        Num<1>::store(&bits, 0, __fdiv_rn(a, 127.f));
        const float s = kv8_half(bits);
        int q = 0;
        if (s > 0.f) q = max(-127, min(127, __float2int_rn(__fdiv_rn(x[j], s))));
        vals[lane + KV8_RUN * j] = (signed char)q;
        if (lane == 0) scales[2 * j] = bits;
    }
}

// Where token `slot`'s row of kv head h goes in an int8 cache: its numbers (K: kv 0, V: 1)
// and its run 0's scale.
__device__ __forceinline__ void kv8_row(unsigned char* cache, long long slot, int kv, int h,
                                        int kv_heads, int D, int block_size,
                                        signed char*& vals, unsigned short*& scales) {
    const long long block = slot / block_size;
    const int off = (int)(slot % block_size);
    unsigned char* base = cache + block * kv8_block_bytes(block_size, kv_heads, D);
    vals = (signed char*)(base + (((long long)kv * block_size + off) * kv_heads + h) * D);
    scales = (unsigned short*)(base + kv8_pair_at(off, h, 0, block_size, kv_heads, D)) + kv;
}
