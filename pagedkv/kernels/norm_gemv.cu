// =======================================================================================
// norm_gemv_t: out = rms_norm(x) @ w^T for a few rows of x, in one launch instead of two.
//
// The decode step at batch 1 is bound by its launches, not its bytes (chapter 12): each
// kernel costs a few microseconds however little it does. RMSNorm is such a kernel: it reads
// one row of 576 numbers and writes it back, and the projection that follows reads it again.
// Here the projection's CTAs normalize the rows themselves while they load them into shared
// memory (each CTA does it again: 576 numbers, far cheaper than a launch), with the very
// arithmetic of `rms_norm` in fused.cu (same reduction, same roundings), so the numbers that
// reach the dot products are bit for bit the ones the two launches would have produced. The
// dot products are gemv.cu's (dots_rows): 16-byte chunks of w's rows per lane.
//
// SILU = 1 folds SwiGLU in as well: w holds gate's rows then up's ([2N][K]), and output n is
// SiLU(gate_n) * up_n, so one warp computes the two dot products n and N + n, rounds each to
// DT (as the unfused pass stores them) and combines them as `silu_mul` does.
//
//   x [M][K] DT   norm_w [K] DT   w [N or 2N][K] DT   out [M][N] DT_OUT (float32: logits)
// K (the model's width) must be a multiple of 8 and at most NORM_MAX_K; launch with 256
// threads (the reduction's). Needs fused.cu before it (round_to, cta_sum, rotate_pair).
//
// norm_gemv_rope_t, further down, is the q|k|v projection with `rope_write_kv` folded in.
// =======================================================================================
#define NORM_MAX_K 1024

// Step 1, in every CTA: the M rows of x, normalized, into shared memory as float32 (xs).
template <int DT, int M>
__device__ __forceinline__ void normalize_rows(const void* __restrict__ x,
                                               const void* __restrict__ norm_w, float eps,
                                               int K, float* xs) {
    for (int m = 0; m < M; ++m) {
        const long long base = (long long)m * K;
        float ss = 0.f;
        for (int i = threadIdx.x; i < K; i += blockDim.x) {
            const float v = Num<DT>::load(x, base + i);
            ss += v * v;
        }
        const float r = 1.f / sqrtf(cta_sum(ss) / K + eps);
        for (int i = threadIdx.x; i < K; i += blockDim.x) {
            const float n = Num<DT>::load(x, base + i) * r;
            xs[base + i] = round_to<DT>(round_to<DT>(n) * Num<DT>::load(norm_w, i));
        }
    }
    __syncthreads();
}

// Step 2, one warp: the dot products of w's rows with the M rows of xs, gemv.cu's
// dots_rows (each lane adds up its 16-byte chunks of a row, then shuffles add the 32 lanes'
// sums: every lane ends with every sum).

// acc[lane] for lane < M: registers cannot be indexed by a variable, so each is compared.
template <int M>
__device__ __forceinline__ float pick(const float* acc, int lane) {
    float a = acc[0];
    #pragma unroll
    for (int m = 1; m < M; ++m) if (lane == m) a = acc[m];
    return a;
}

// R > 1 (without SILU): each warp makes R outputs at once, as gemv.cu's dots_rows does.
template <int DT, int DT_OUT, int M, int SILU, int R = 1>
__global__ void norm_gemv_t(const void* __restrict__ x, const void* __restrict__ norm_w,
                            float eps, const void* __restrict__ w, void* __restrict__ out,
                            int K, int N) {
    static_assert(R == 1 || !SILU, "SwiGLU's warps make one output (two dot products)");
    __shared__ float xs[M * NORM_MAX_K];              // the M normalized rows, widened once
    const int first = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    #pragma unroll
    for (int r = 0; r < R; ++r) {                     // this warp's first rows, into L2
        if (first * R + r < N) prefetch_row(w, first * R + r, K * (16 / Num<DT>::PER_VEC));
    }
    if (SILU && first < N) prefetch_row(w, (long long)N + first, K * (16 / Num<DT>::PER_VEC));
    wait_for_prior_grid();                            // x comes from the kernel before
    let_next_grid_start();
    normalize_rows<DT, M>(x, norm_w, eps, K, xs);
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    if (R > 1) {
        for (long long n0 = (long long)first * R; n0 < N; n0 += (long long)warps * R) {
            float acc[R][M];
            dots_rows<DT, M, R>(w, n0, 1, N, K, xs, acc);
            const long long n = n0 + lane / M;
            if (lane < R * M && n < N)           // lane r*M + m writes row m's output n
                Num<DT_OUT>::store(out, (long long)(lane % M) * N + n,
                                   pick_rows<M, R>(acc, lane));
        }
        return;
    }
    for (int n = first; n < N; n += warps) {
        float acc[1 + SILU][M];                  // row n of w (gate's with SILU), up's row
        dots_rows<DT, M, 1 + SILU>(w, n, N, 2LL * N, K, xs, acc);
        if (lane < M) {                          // lane m writes row m's number
            float a = pick<M>(acc[0], lane);
            if (SILU) {
                const float g = round_to<DT>(a);
                a = g / (1.f + __expf(-g)) * round_to<DT>(pick<M>(acc[SILU], lane));
            }
            Num<DT_OUT>::store(out, (long long)lane * N + n, a);
        }
    }
}

// =======================================================================================
// norm_gemv_rope_t: norm_gemv_t's q|k|v projection (into qkv) and fused.cu's rope_write_kv
// on its output, in one launch. Rotary embeddings turn each head's numbers i and i + D/2 by
// one angle, so a warp here computes those two outputs together (work item p = one pair:
// head p / (D/2), number i = p % (D/2)): it rounds both to DT, exactly what rope_write_kv
// would read back from qkv, turns them in float32 as rope_write_kv does (rotate_pair; q's
// and k's heads: v's pairs pass as they are), and stores them where rope_write_kv would:
// q into q_out, k and v into the cache at the row's slot (a negative slot is padding:
// nothing written). It writes qkv too, so every output of the two launches is made here.
//   x [M][K]  norm_w [K]  w [(q_heads + 2 kv_heads) D][K]  qkv [M][(q_heads + 2 kv_heads) D]
//   positions, slots [M] int32   cos_t, sin_t [context][D / 2] float32
//   q_out [M][q_heads][D]        cache [num_blocks][2][block_size][kv_heads][D]
// Every array but the int32 and float32 ones is DT; 256 threads, as norm_gemv_t.
// =======================================================================================
template <int DT, int M>
__global__ void norm_gemv_rope_t(const void* __restrict__ x, const void* __restrict__ norm_w,
                                 float eps, const void* __restrict__ w,
                                 void* __restrict__ qkv, const int* __restrict__ positions,
                                 const int* __restrict__ slots,
                                 const float* __restrict__ cos_t,
                                 const float* __restrict__ sin_t, void* __restrict__ q_out,
                                 void* __restrict__ cache, int K, int q_heads, int kv_heads,
                                 int D, int block_size) {
    __shared__ float xs[M * NORM_MAX_K];
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int half = D / 2, N = (q_heads + 2 * kv_heads) * D;
    const int first = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (first < N / 2) {                              // this warp's first pair, into L2
        const int n = first / half * D + first % half;
        prefetch_row(w, n, K * (16 / Num<DT>::PER_VEC));
        prefetch_row(w, n + half, K * (16 / Num<DT>::PER_VEC));
    }
    wait_for_prior_grid();            // x from the kernel before; the cache read by others
    let_next_grid_start();
    normalize_rows<DT, M>(x, norm_w, eps, K, xs);
    for (int p = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; p < N / 2; p += warps) {
        const int head = p / half, i = p % half, n = head * D + i;  // q, then k, then v heads
        float acc[2][M];                         // outputs n and n + D/2 of each row
        dots_rows<DT, M, 2>(w, n, half, N, K, xs, acc);
        if (lane >= M) continue;                 // lane m does row m's pair
        const float x1 = round_to<DT>(pick<M>(acc[0], lane));
        const float x2 = round_to<DT>(pick<M>(acc[1], lane));
        Num<DT>::store(qkv, (long long)lane * N + n, x1);
        Num<DT>::store(qkv, (long long)lane * N + n + half, x2);
        float y1 = x1, y2 = x2;                  // what goes on: turned, for q and k
        if (head < q_heads + kv_heads) {
            const long long at = (long long)positions[lane] * half + i;
            rotate_pair(x1, x2, cos_t[at], sin_t[at], y1, y2);
        }
        void* dst = q_out;                       // and where number i of the head goes
        long long o = ((long long)lane * q_heads + head) * D + i;
        if (head >= q_heads) {                   // k or v: the cache, at the row's slot
            const int slot = slots[lane];
            if (slot < 0) continue;              // a padding row
            const int kv = head >= q_heads + kv_heads;          // 0: k, 1: v
            const int h = head - q_heads - kv * kv_heads;      // its kv head
            dst = cache;
            o = ((((long long)(slot / block_size) * 2 + kv) * block_size + slot % block_size)
                 * kv_heads + h) * D + i;
        }
        Num<DT>::store(dst, o, y1);
        Num<DT>::store(dst, o + half, y2);
    }
}

// =======================================================================================
// norm_gemv_rope8_t: norm_gemv_rope_t with an int8 cache (common.cuh's "8-bit cache").
// A k or v head row's numbers must all be known before any is rounded (its runs' scales
// come from their largest numbers), and in norm_gemv_rope_t they come from warps all over
// the grid. So here the first 2 kv_heads CTAs each make one k or v head whole (CTA c: k
// head c, then v head c - kv_heads): its warps compute the head's pairs for the M rows,
// write them to qkv as norm_gemv_rope_t does, turn k's, and leave the numbers (rounded to
// DT, as a 16-bit cache would hold them) in shared memory; then warp m quantizes row m's
// head into the cache (kv8_store_row). The other CTAs make q's pairs as
// norm_gemv_rope_t does. Launch 2 kv_heads + (CTAs for q) CTAs of 256 threads; M <= 8 (a
// warp per row), D a multiple of 64 and at most 256.
// =======================================================================================
template <int DT, int M>
__global__ void norm_gemv_rope8_t(const void* __restrict__ x,
                                  const void* __restrict__ norm_w, float eps,
                                  const void* __restrict__ w, void* __restrict__ qkv,
                                  const int* __restrict__ positions,
                                  const int* __restrict__ slots,
                                  const float* __restrict__ cos_t,
                                  const float* __restrict__ sin_t, void* __restrict__ q_out,
                                  unsigned char* __restrict__ cache, int K, int q_heads,
                                  int kv_heads, int D, int block_size) {
    static_assert(M <= 8, "a warp quantizes each row");
    __shared__ float xs[M * NORM_MAX_K];
    __shared__ float head_rows[M][256];               // a k or v head's rows, before rounding
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nwarps = blockDim.x / 32;
    const int half = D / 2, N = (q_heads + 2 * kv_heads) * D;
    const int kv_ctas = 2 * kv_heads;
    const bool kv_cta = blockIdx.x < kv_ctas;
    // this CTA's work items: pairs of its k or v head, or q's pairs from a first one on
    const int head0 = kv_cta ? q_heads + blockIdx.x : 0;
    const int first = kv_cta ? warp : (blockIdx.x - kv_ctas) * nwarps + warp;
    const int items = kv_cta ? half : q_heads * half;
    const int stride = kv_cta ? nwarps : (gridDim.x - kv_ctas) * nwarps;
    if (first < items) {                              // this warp's first pair, into L2
        const int n = (head0 + first / half) * D + first % half;
        prefetch_row(w, n, K * (16 / Num<DT>::PER_VEC));
        prefetch_row(w, n + half, K * (16 / Num<DT>::PER_VEC));
    }
    wait_for_prior_grid();            // x from the kernel before; the cache read by others
    let_next_grid_start();
    normalize_rows<DT, M>(x, norm_w, eps, K, xs);
    for (int p = first; p < items; p += stride) {
        const int head = head0 + p / half, i = p % half, n = head * D + i;
        float acc[2][M];                               // outputs n and n + D/2 of each row
        dots_rows<DT, M, 2>(w, n, half, N, K, xs, acc);
        if (lane >= M) continue;                       // lane m does row m's pair
        const float x1 = round_to<DT>(pick<M>(acc[0], lane));
        const float x2 = round_to<DT>(pick<M>(acc[1], lane));
        Num<DT>::store(qkv, (long long)lane * N + n, x1);
        Num<DT>::store(qkv, (long long)lane * N + n + half, x2);
        float y1 = x1, y2 = x2;
        if (head < q_heads + kv_heads) {               // q and k turn; v passes
            const long long at = (long long)positions[lane] * half + i;
            rotate_pair(x1, x2, cos_t[at], sin_t[at], y1, y2);
        }
        if (!kv_cta) {
            const long long o = ((long long)lane * q_heads + head) * D + i;
            Num<DT>::store(q_out, o, y1);
            Num<DT>::store(q_out, o + half, y2);
        } else {
            head_rows[lane][i] = round_to<DT>(y1);
            head_rows[lane][i + half] = round_to<DT>(y2);
        }
    }
    if (!kv_cta) return;
    __syncthreads();                                   // the head's rows are complete
    if (warp >= M) return;
    const int slot = slots[warp];                      // warp m: row m
    if (slot < 0) return;                              // a padding row
    const int kv = blockIdx.x / kv_heads, h = blockIdx.x % kv_heads;
    float v[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < D / KV8_RUN) v[j] = head_rows[warp][lane + KV8_RUN * j];
    signed char* vals;
    unsigned short* scales;
    kv8_row(cache, slot, kv, h, kv_heads, D, block_size, vals, scales);
    kv8_store_row(v, D, vals, scales);
}
