// =======================================================================================
// The model's small operations, one kernel each, for the fast decode path
// (pagedkv/model/runner.py). In the plain forward pass (pagedkv/model/llama.py) each of these
// is several CuPy operations: RMSNorm alone is about nine (cast, square, mean, add, sqrt,
// divide, multiply, cast, multiply), each a kernel launch and a trip through memory. Here
// each is one launch that reads its inputs once and writes its outputs once.
//
// Every kernel takes DT (0 float32, 1 float16, 2 bfloat16: common.cuh's Num<DT>) and does its
// arithmetic in float32, rounding to DT where the plain pass rounds, so the two agree to the
// last bit in most elements (and to rounding everywhere).
// =======================================================================================

// x rounded to DT and widened back: where the plain pass stores an intermediate in DT.
template <int DT>
__device__ float round_to(float x) {
    if constexpr (DT == 0) {
        return x;
    } else {
        unsigned short h;
        Num<DT>::store(&h, 0, x);
        return Num<DT>::load(&h, 0);
    }
}

// Sum of one float over the threads of a CTA (blockDim.x a multiple of 32, at most 1024).
// Each warp adds its 32 values with shuffles (threads read each other's registers), warp 0
// adds the warps' sums, and every thread gets the total.
__device__ float cta_sum(float v) {
    __shared__ float warp_sums[32];
    __shared__ float total;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) total = v;
    }
    __syncthreads();
    return total;
}

// One pair's rotation by the angle whose cosine and sine are c, s. Each product is rounded
// before the sum (NumPy's arithmetic): left to itself the compiler fuses one product of each
// line into the addition (an FMA), and which one depends on the code around it, so two
// kernels that rotate the same numbers could disagree in the last bit.
__device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s, float& y1,
                                            float& y2) {
    y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// rms_norm: out[r] = round(x[r] / sqrt(mean(x[r]^2) + eps)) * w, one CTA per row r.
//   x, out [rows][width];  w [width]
template <int DT>
__global__ void rms_norm(const void* __restrict__ x, const void* __restrict__ w,
                         void* __restrict__ out, int width, float eps) {
    const long long base = (long long)blockIdx.x * width;
    float ss = 0.f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float v = Num<DT>::load(x, base + i);
        ss += v * v;
    }
    const float r = 1.f / sqrtf(cta_sum(ss) / width + eps);
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        // the plain pass rounds x * r to DT, then multiplies by the weight in DT
        float n = Num<DT>::load(x, base + i) * r;
        Num<DT>::store(out, base + i, round_to<DT>(n) * Num<DT>::load(w, i));
    }
}

// rope_write_kv: after the fused q|k|v projection, rotate q and k by their token's position
// (rotary embeddings, rotate-half form) and put k and v in the paged cache.
//   qkv   [tokens][(q_heads + 2 * kv_heads) * D]   the projection's output, q then k then v
//   positions, slots [tokens]                     slot < 0: a padding row, nothing written
//   cos, sin [context][D / 2]                     float32 tables
//   q_out [tokens][q_heads][D]                    rotated q, for attention
//   cache [num_blocks][2][block_size][kv_heads][D]  this layer's K/V
// One CTA per token; thread j of it handles pair (i, i + D/2) of one head: it reads both,
// rotates them, and writes both.
template <int DT>
__global__ void rope_write_kv(const void* __restrict__ qkv, const int* __restrict__ positions,
                              const int* __restrict__ slots, const float* __restrict__ cos_t,
                              const float* __restrict__ sin_t, void* __restrict__ q_out,
                              void* __restrict__ cache, int q_heads, int kv_heads, int D,
                              int block_size) {
    const int t = blockIdx.x, half = D / 2;
    const int row = (q_heads + 2 * kv_heads) * D;
    const long long in = (long long)t * row;
    const int pos = positions[t], slot = slots[t];
    // where token t's K row and V row go (block, offset within it), if anywhere
    const long long kv_row = (long long)kv_heads * D;
    const long long k_at = slot < 0 ? -1
        : ((long long)(slot / block_size) * 2 * block_size + slot % block_size) * kv_row;
    const long long v_at = k_at + (long long)block_size * kv_row;
    for (int j = threadIdx.x; j < (q_heads + kv_heads) * half; j += blockDim.x) {
        const int head = j / half, i = j % half;      // heads 0..q_heads-1 are q, then k
        const float c = cos_t[(long long)pos * half + i], s = sin_t[(long long)pos * half + i];
        const long long a = in + (long long)head * D + i;
        const float x1 = Num<DT>::load(qkv, a), x2 = Num<DT>::load(qkv, a + half);
        float y1, y2;
        rotate_pair(x1, x2, c, s, y1, y2);
        if (head < q_heads) {
            const long long o = ((long long)t * q_heads + head) * D + i;
            Num<DT>::store(q_out, o, y1);
            Num<DT>::store(q_out, o + half, y2);
        } else if (slot >= 0) {
            const long long o = k_at + (long long)(head - q_heads) * D + i;
            Num<DT>::store(cache, o, y1);
            Num<DT>::store(cache, o + half, y2);
        }
    }
    if (slot < 0) return;
    const long long v_in = in + (long long)(q_heads + kv_heads) * D;
    for (int j = threadIdx.x; j < kv_heads * D; j += blockDim.x)   // v: copied as it is
        Num<DT>::store(cache, v_at + j, Num<DT>::load(qkv, v_in + j));
}

// silu_mul: out[t][i] = SiLU(gate) * up, in float32 and rounded once, as the plain pass.
//   gate_up [tokens][2 * ffn] (gate, then up);  out [tokens][ffn]
template <int DT>
__global__ void silu_mul(const void* __restrict__ gate_up, void* __restrict__ out, int ffn,
                         long long total) {
    const long long k = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= total) return;
    const long long t = k / ffn, i = k % ffn;
    const float g = Num<DT>::load(gate_up, t * 2 * ffn + i);
    const float u = Num<DT>::load(gate_up, t * 2 * ffn + ffn + i);
    Num<DT>::store(out, k, g / (1.f + __expf(-g)) * u);
}

// embed: out[t] = table[tokens[t]] (rows of `width` numbers), one CTA per token.
template <int DT>
__global__ void embed(const int* __restrict__ tokens, const void* __restrict__ table,
                      void* __restrict__ out, int width) {
    wait_for_prior_grid();
    let_next_grid_start();
    const long long src = (long long)tokens[blockIdx.x] * width;
    const long long dst = (long long)blockIdx.x * width;
    for (int i = threadIdx.x; i < width; i += blockDim.x)
        Num<DT>::store(out, dst + i, Num<DT>::load(table, src + i));
}

// argmax_rows: out[r] = the index of the largest of logits[r] (float32 [rows][n]); the lowest
// index among equal largest values, as numpy.argmax. One CTA per row: each thread keeps the
// best of its stride, then the CTA's threads compare pairs down to one.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int* __restrict__ out, int n) {
    __shared__ float best_v[1024];
    __shared__ int best_i[1024];
    wait_for_prior_grid();
    let_next_grid_start();
    const float* row = logits + (long long)blockIdx.x * n;
    float v = NEG_INF;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float x = row[i];
        if (x > v) { v = x; idx = i; }       // strictly greater: the first one stays
    }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const int oi = best_i[threadIdx.x + s];
            const float mv = best_v[threadIdx.x];
            if (ov > mv || (ov == mv && oi < best_i[threadIdx.x])) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[blockIdx.x] = best_i[0] == 0x7fffffff ? 0 : best_i[0];
}

// =======================================================================================
// The same writes into an int8 cache (common.cuh's "8-bit cache"): a warp per head row,
// because a row's scales need the largest number of each of its runs of 32 before any
// number can be rounded. D must be a multiple of 64 (the rotation's pairs i, i + D/2 are
// then numbers j and j + D/64 of the same lane).
// =======================================================================================

// write_kv8: k and v [tokens][kv_heads][D] (DT) into the cache at their slots; row r of the
// grid's warps is (token r / (2 kv_heads), K or V, kv head). A slot < 0 is padding, and the
// host has refused slots >= num_slots (they are skipped here too).
template <int DT>
__global__ void write_kv8(const void* __restrict__ k, const void* __restrict__ v,
                          const int* __restrict__ slots, unsigned char* __restrict__ cache,
                          int tokens, int kv_heads, int D, int block_size,
                          long long num_slots) {
    const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (row >= 2 * tokens * kv_heads) return;           // a whole warp leaves together
    const int t = row / (2 * kv_heads), kv = row / kv_heads % 2, h = row % kv_heads;
    const int slot = slots[t];
    if (slot < 0 || slot >= num_slots) return;
    const void* src = kv ? v : k;
    const long long first = ((long long)t * kv_heads + h) * D + threadIdx.x % 32;
    float x[8];
    #pragma unroll
    for (int j = 0; j < 8; ++j)
        if (j < D / KV8_RUN) x[j] = Num<DT>::load(src, first + KV8_RUN * j);
    signed char* vals;
    unsigned short* scales;
    kv8_row(cache, slot, kv, h, kv_heads, D, block_size, vals, scales);
    kv8_store_row(x, D, vals, scales);
}

// rope_write_kv8: rope_write_kv with an int8 cache. One CTA per token: q's pairs as in
// rope_write_kv (every thread), then warp w quantizes head rows w, w + warps, ... of the
// 2 kv_heads (k's rotated, then v's as they are) into the cache at the token's slot.
template <int DT>
__global__ void rope_write_kv8(const void* __restrict__ qkv, const int* __restrict__ positions,
                               const int* __restrict__ slots, const float* __restrict__ cos_t,
                               const float* __restrict__ sin_t, void* __restrict__ q_out,
                               unsigned char* __restrict__ cache, int q_heads, int kv_heads,
                               int D, int block_size) {
    const int t = blockIdx.x, half = D / 2;
    const long long in = (long long)t * (q_heads + 2 * kv_heads) * D;
    const int pos = positions[t], slot = slots[t];
    for (int j = threadIdx.x; j < q_heads * half; j += blockDim.x) {   // q, as rope_write_kv
        const int head = j / half, i = j % half;
        const float c = cos_t[(long long)pos * half + i], s = sin_t[(long long)pos * half + i];
        const long long a = in + (long long)head * D + i;
        float y1, y2;
        rotate_pair(Num<DT>::load(qkv, a), Num<DT>::load(qkv, a + half), c, s, y1, y2);
        const long long o = ((long long)t * q_heads + head) * D + i;
        Num<DT>::store(q_out, o, y1);
        Num<DT>::store(q_out, o + half, y2);
    }
    if (slot < 0) return;                               // a padding row
    const int lane = threadIdx.x % 32, runs = D / KV8_RUN;
    for (int r = threadIdx.x / 32; r < 2 * kv_heads; r += blockDim.x / 32) {
        const int kv = r / kv_heads, h = r % kv_heads;
        const long long a = in + (long long)(q_heads + r) * D + lane;   // k heads, then v's
        float x[8];
        #pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < runs) x[j] = Num<DT>::load(qkv, a + KV8_RUN * j);
        if (kv == 0) {                                  // k: number i pairs with i + D/2
            #pragma unroll
            for (int j = 0; j < 4; ++j) {
                if (j >= runs / 2) break;
                const int i = lane + KV8_RUN * j;
                const long long at = (long long)pos * half + i;
                float y1, y2;
                rotate_pair(x[j], x[j + runs / 2], cos_t[at], sin_t[at], y1, y2);
                x[j] = round_to<DT>(y1);                // what a 16-bit cache would hold
                x[j + runs / 2] = round_to<DT>(y2);
            }
        }
        signed char* vals;
        unsigned short* scales;
        kv8_row(cache, slot, kv, h, kv_heads, D, block_size, vals, scales);
        kv8_store_row(x, D, vals, scales);
    }
}
