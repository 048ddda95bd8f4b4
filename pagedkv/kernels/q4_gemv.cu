// =======================================================================================
// q4_gemv: out = x @ w^T for a few rows of x, w stored as GGUF's Q4_1 blocks.
//
// A decode step of a few rows reads every weight once, so its time follows the weights'
// bytes. Q4_1 stores 32 weights in 20 bytes -- an fp16 scale d, an fp16 minimum m, and 16
// bytes of 4-bit integers q -- and weight i of a block is d * q_i + m. Byte j of the 16 holds
// q_j in its low four bits and q_{j+16} in its high four (GGUF's nibble order). That is 5
// bits a weight where fp16 takes 16: this kernel reads the blocks as stored and turns them
// into float32 in registers, so the bytes that cross the memory bus are the quantized ones.
//
// The shape is gemv.cu's: the M rows of x are widened into shared memory once per CTA; a
// warp owns R rows of w (R outputs n); lane l takes the quarter blocks l, l + 32, ... of each
// (8 weights each: one 32-bit word of d and m, one of q), and the lanes' sums are added with
// shuffles. With R > 1 each number of x read from shared memory serves R rows of w.
//
// Shared memory is 32 banks of 4 bytes; a warp's read is one pass only if its 32 lanes hit
// 32 different banks. Quarter s of block b needs x[32b + 4s + j] and x[32b + 16 + 4s + j]
// (j = 0..3); stored in order, the lanes of a warp would hit only 4 banks (8 passes). So x
// is stored by place in the quarter: number t (0..7) of quarter u = 4b + s sits at
// t * K/8 + u, and the 32 lanes, reading quarters u..u+31 at one t, read 32 consecutive
// floats: one pass.
//
//   x [M][K] DT     w [N][K/32] blocks of 20 bytes     out [M][N] DT_OUT
//   accumulate: out += x @ w^T, else out = x @ w^T.    K a multiple of 32.
// Shared memory (dynamic): M * K float32.
// =======================================================================================
#define Q4_BLOCK_WORDS 5            // 32-bit words a block: d|m, then four words of q

template <int DT, int DT_OUT, int M, int R>
__global__ void q4_gemv(const void* __restrict__ x, const unsigned* __restrict__ w,
                        void* __restrict__ out, int K, int N, int accumulate) {
    extern __shared__ __align__(16) unsigned short smem[];
    float* xs = reinterpret_cast<float*>(smem);       // the M rows of x, widened once
    const int quarters = K / 8;                       // 8 weights each
    for (int i = threadIdx.x; i < M * K; i += blockDim.x) {
        const int m = i / K, c = i % K, b = c / 32, r = c % 32;  // row m, block b, number r
        const int u = 4 * b + (r % 16) / 4;           // its quarter block
        const int t = (r / 16) * 4 + r % 4;           // its place in the quarter
        xs[m * K + t * quarters + u] = Num<DT>::load(x, i);
    }
    __syncthreads();
    const int lane = threadIdx.x % 32;
    const int warps = gridDim.x * (blockDim.x / 32);
    const int words = K / 32 * Q4_BLOCK_WORDS;        // 32-bit words in a row of w
    for (int n0 = (blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32) * R; n0 < N;
         n0 += warps * R) {
        float acc[R][M];
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            #pragma unroll
            for (int m = 0; m < M; ++m) acc[r][m] = 0.f;
        }
        for (int u = lane; u < quarters; u += 32) {
            const int b = u / 4, s = u % 4;           // block b, its quarter s
            // quarter s holds weights 4s..4s+3 (low nibbles: t = 0..3) and 16+4s..16+4s+3
            // (high nibbles: t = 4..7)
            float wf[R][8];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const int n = min(n0 + r, N - 1);     // past the end: a real row, unused
                const unsigned* blk = w + (long long)n * words + b * Q4_BLOCK_WORDS;
                const unsigned dm = blk[0], q = blk[1 + s];
                const float d = Num<1>::widen((unsigned short)(dm & 0xffff));
                const float mn = Num<1>::widen((unsigned short)(dm >> 16));
                #pragma unroll
                for (int j = 0; j < 4; ++j) {
                    wf[r][j] = fmaf(d, (float)((q >> (8 * j)) & 15u), mn);
                    wf[r][4 + j] = fmaf(d, (float)((q >> (8 * j + 4)) & 15u), mn);
                }
            }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                float xv[8];
                #pragma unroll
                for (int t = 0; t < 8; ++t) xv[t] = xs[m * K + t * quarters + u];
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    #pragma unroll
                    for (int j = 0; j < 8; ++j) acc[r][m] = fmaf(wf[r][j], xv[j], acc[r][m]);
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
        // lane r * M + m writes output (m, n0 + r): R * M <= 32 lanes write at once
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const int n = n0 + r;
            if (lane / M == r && n < N) {
                float a = acc[r][0];
                #pragma unroll
                for (int m = 1; m < M; ++m) if (lane % M == m) a = acc[r][m];
                const long long o = (long long)(lane % M) * N + n;
                if (accumulate) a += Num<DT_OUT>::load(out, o);
                Num<DT_OUT>::store(out, o, a);
            }
        }
    }
}
