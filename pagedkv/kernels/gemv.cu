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

// With M rows every lane reads M * 32 bytes of xs for each 16 bytes of w, so from 4 rows on
// shared memory, not the weight, bounds a warp that makes one output. dots_rows lets a warp
// make R outputs at once, of w's rows n0, n0 + stride, ... (rows from `limit` on count as
// zeros): each number of xs it reads serves R weight rows. Each output's sums are made in
// the same order as with R = 1 (the same bits). norm_gemv.cu's kernels call it too, with
// stride N for SwiGLU's gate and up rows and D / 2 for RoPE's pairs.
template <int DT, int M, int R>
__device__ __forceinline__ void dots_rows(const void* __restrict__ w, long long n0,
                                          long long stride, long long limit, int K,
                                          const float* xs, float (&acc)[R][M]) {
    constexpr int V = Num<DT>::PER_VEC;
    const int lane = threadIdx.x % 32;
    const int vecs = K / V;                          // 16-byte chunks in a row of w
    const uint4* rows = reinterpret_cast<const uint4*>(w);
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
    }
    for (int v = lane; v < vecs; v += 32) {
        float wf[R][V];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            if (n0 + r * stride < limit) {
                Num<DT>::unpack(rows[(n0 + r * stride) * vecs + v], wf[r]);
            } else {
                #pragma unroll
                for (int j = 0; j < V; ++j) wf[r][j] = 0.f;
            }
        }
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            const float* xm = xs + m * K + v * V;
            float xv[V];
            #pragma unroll
            for (int j = 0; j < V; ++j) xv[j] = xm[j];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                #pragma unroll
                for (int j = 0; j < V; ++j) acc[r][m] += wf[r][j] * xv[j];
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            #pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], o);
        }
    }
}

// acc[r][m] for lane == r * M + m (registers cannot be indexed by a variable).
template <int M, int R>
__device__ __forceinline__ float pick_rows(const float (&acc)[R][M], int lane) {
    float a = acc[0][0];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) if (lane == r * M + m) a = acc[r][m];
    }
    return a;
}

template <int DT, int DT_OUT, int M, int R>
__global__ void gemv_t(const void* __restrict__ x, const void* __restrict__ w,
                       void* __restrict__ out, int K, int N, int accumulate) {
    static_assert(R * M <= 32, "a lane writes each output");
    __shared__ float xs[M * MAX_K];                  // the M rows of x, widened once
    const int warp = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    #pragma unroll
    for (int r = 0; r < R; ++r)                      // this warp's first rows, into L2
        if (warp * R + r < N) prefetch_row(w, warp * R + r, K * (16 / Num<DT>::PER_VEC));
    wait_for_prior_grid();                           // x (and out) come from kernels before
    let_next_grid_start();
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) xs[i] = Num<DT>::load(x, i);
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    for (long long n0 = (long long)warp * R; n0 < N; n0 += (long long)warps * R) {
        float acc[R][M];
        dots_rows<DT, M, R>(w, n0, 1, N, K, xs, acc);
        const long long n = n0 + lane / M;
        if (lane < R * M && n < N) {                 // lane r*M + m writes row m's output n
            float a = pick_rows<M, R>(acc, lane);
            const long long o = (long long)(lane % M) * N + n;
            if (accumulate) a += Num<DT_OUT>::load(out, o);
            Num<DT_OUT>::store(out, o, a);
        }
    }
}
