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
// dot products are gemv.cu's: one warp per output, 16-byte chunks of w's row per lane.
//
// SILU = 1 folds SwiGLU in as well: w holds gate's rows then up's ([2N][K]), and output n is
// SiLU(gate_n) * up_n, so one warp computes the two dot products n and N + n, rounds each to
// DT (as the unfused pass stores them) and combines them as `silu_mul` does.
//
//   x [M][K] DT   norm_w [K] DT   w [N or 2N][K] DT   out [M][N] DT_OUT (float32: logits)
// K (the model's width) must be a multiple of 8 and at most NORM_MAX_K; launch with 256
// threads (the reduction's). Needs fused.cu before it (round_to, cta_sum).
// =======================================================================================
#define NORM_MAX_K 1024

template <int DT, int DT_OUT, int M, int SILU>
__global__ void norm_gemv_t(const void* __restrict__ x, const void* __restrict__ norm_w,
                            float eps, const void* __restrict__ w, void* __restrict__ out,
                            int K, int N) {
    __shared__ float xs[M * NORM_MAX_K];              // the M normalized rows, widened once
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
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int vecs = K / Num<DT>::PER_VEC;       // 16-byte chunks in a row of w
    for (int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; n < N; n += warps) {
        const uint4* row = reinterpret_cast<const uint4*>(w) + (long long)n * vecs;
        const uint4* row2 = row + (long long)N * vecs;       // up's row n (SILU only)
        float acc[M], acc2[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = acc2[m] = 0.f;
        for (int v = lane; v < vecs; v += 32) {
            float wf[Num<DT>::PER_VEC], wf2[Num<DT>::PER_VEC];
            Num<DT>::unpack(row[v], wf);
            if (SILU) Num<DT>::unpack(row2[v], wf2);
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const float* xm = xs + m * K + v * Num<DT>::PER_VEC;
                #pragma unroll
                for (int j = 0; j < Num<DT>::PER_VEC; ++j) {
                    acc[m] += wf[j] * xm[j];
                    if (SILU) acc2[m] += wf2[j] * xm[j];
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) {
                acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
                if (SILU) acc2[m] += __shfl_xor_sync(0xffffffffu, acc2[m], o);
            }
        }
        if (lane < M) {                          // lane m writes row m's number
            float a = acc[0], u = acc2[0];
            #pragma unroll
            for (int m = 1; m < M; ++m) if (lane == m) { a = acc[m]; u = acc2[m]; }
            if (SILU) {
                const float g = round_to<DT>(a);
                a = g / (1.f + __expf(-g)) * round_to<DT>(u);
            }
            Num<DT_OUT>::store(out, (long long)lane * N + n, a);
        }
    }
}
