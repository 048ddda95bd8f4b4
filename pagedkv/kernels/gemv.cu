// =======================================================================================
// gemv_t: out = x @ w^T for a few rows of x (a decode step's batch of 1 to 8 tokens).
//
// At these shapes a matrix multiply is a matrix-vector product: each weight is read once and
// used for only M rows, so the time is the weight's bytes plus the launch. The weight is kept
// transposed, [N][K] (row n holds everything output n needs), so output n is a dot product of
// two contiguous rows, and one warp computes it: each lane reads 16-byte chunks of w's row n
// (the 32 lanes together read 512 contiguous bytes), multiplies them by the same chunks of
// each of the M rows of x (kept in shared memory, read by every warp of the CTA), and the
// lanes' partial sums are added with shuffles. Many warps, one output each, keep the memory
// busy: N is 576 to 49152 here.
//
//   x   [M][K]  DT          w [N][K] DT            out [M][N] DT_OUT (float32 for logits)
//   accumulate: out += x @ w^T (a residual add folded in), else out = x @ w^T
// K must be a multiple of 8 (16 bytes of 16-bit numbers) and at most MAX_K.
// =======================================================================================
#define MAX_K 1536

template <int DT, int DT_OUT, int M>
__global__ void gemv_t(const void* __restrict__ x, const void* __restrict__ w,
                       void* __restrict__ out, int K, int N, int accumulate) {
    __shared__ float xs[M * MAX_K];                  // the M rows of x, widened once
    const int first = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (first < N) prefetch_row(w, first, K * (16 / Num<DT>::PER_VEC));  // while waiting
    wait_for_prior_grid();                           // x (and out) come from kernels before
    let_next_grid_start();
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) xs[i] = Num<DT>::load(x, i);
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int vecs = K / Num<DT>::PER_VEC;           // 16-byte chunks in a row of w
    for (int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32; n < N; n += warps) {
        const uint4* row = reinterpret_cast<const uint4*>(w) + (long long)n * vecs;
        float acc[M];
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[m] = 0.f;
        for (int v = lane; v < vecs; v += 32) {
            float wf[Num<DT>::PER_VEC];
            Num<DT>::unpack(row[v], wf);
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const float* xm = xs + m * K + v * Num<DT>::PER_VEC;
                #pragma unroll
                for (int j = 0; j < Num<DT>::PER_VEC; ++j) acc[m] += wf[j] * xm[j];
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        }
        if (lane < M) {                              // lane m writes row m's number
            float a = acc[0];
            #pragma unroll
            for (int m = 1; m < M; ++m) if (lane == m) a = acc[m];
            const long long o = (long long)lane * N + n;
            if (accumulate) a += Num<DT_OUT>::load(out, o);
            Num<DT_OUT>::store(out, o, a);
        }
    }
}
