// Sampling a batch of rows without a sort: one block of 1024 threads per row of logits.
//
// The rule (pagedkv/kernels/sampling.py says it in full, and its NumPy reference is the
// oracle): p = exp(z - max z) with z = logits / T, float32 (the exp taken in double and
// rounded; below the smallest normal float, 0); top-k keeps {p >= t_k}, t_k the largest value with at least k tokens at or above
// it; top-p then keeps {p >= t}, t the largest value whose mass (of the top-k set) is at least
// top_p of it; the token is the first kept one, in token order, where the running kept mass
// passes u * (kept mass). A token whose p is 0 is never kept. T = 0: the first argmax.
//
// No sort: a threshold is found by bisection on the bits of a float. For p >= 0 the bit
// pattern, read as an unsigned integer, orders like the value, so at most ~30 halvings of the
// range [smallest positive float, 1.0] give the exact threshold, fewer when a single token is
// left in the range. Each halving is one pass over the row's p (kept in shared memory) and
// one sum over the block. Sums are float64; every thread
// sees the same sum (a butterfly reduction), so the whole block takes the same branch.

#define THREADS 1024
#define WARPS (THREADS / 32)
#define FULL 0xffffffffu

__device__ __forceinline__ unsigned long long mix64(unsigned long long x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;       // splitmix64's finaliser
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// The block's sum of (mass, count): every thread returns the same two numbers.
__device__ __forceinline__ void block_sum(double& m, int& c, double* sm, int* sc) {
    for (int o = 16; o > 0; o >>= 1) {                 // within the warp (butterfly)
        m += __shfl_xor_sync(FULL, m, o);
        c += __shfl_xor_sync(FULL, c, o);
    }
    const int w = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();                                   // the last call's reads are done
    if (lane == 0) { sm[w] = m; sc[w] = c; }
    __syncthreads();
    m = sm[lane]; c = sc[lane];                        // WARPS == 32: one value per lane
    for (int o = 16; o > 0; o >>= 1) {
        m += __shfl_xor_sync(FULL, m, o);
        c += __shfl_xor_sync(FULL, c, o);
    }
}

// Mass and count of {p >= t} over the row (each thread adds its tokens j = tid + 1024 i).
__device__ __forceinline__ void mass_at(const float* p, int vocab, float t, double& m, int& c,
                                        double* sm, int* sc) {
    m = 0.0; c = 0;
    for (int j = threadIdx.x; j < vocab; j += THREADS) {
        const float v = p[j];
        if (v >= t) { m += v; c += 1; }
    }
    block_sum(m, c, sm, sc);
}

// The largest float t (its bits in lo) with count{p >= t} >= goal (by_mass false) or
// mass{p >= t} >= goal (by_mass true), given that lo satisfies it with (mass, count) =
// (m_lo, c_lo), and that t is at most 1.0. Halve [lo, hi) until one value is left, or until
// a single token lies in it: then that token's value is t (the largest p below hi).
__device__ void bisect(const float* p, int vocab, unsigned& lo, double& m_lo, int& c_lo,
                       double goal, bool by_mass, double* sm, int* sc) {
    unsigned hi = 0x3F800000u + 1u;                    // just above 1.0: nothing is there
    int c_hi = 0;
    while (hi - lo > 1u && c_lo - c_hi > 1) {
        const unsigned mid = lo + (hi - lo) / 2u;
        double m; int c;
        mass_at(p, vocab, __uint_as_float(mid), m, c, sm, sc);
        if (by_mass ? m >= goal : c >= goal) { lo = mid; m_lo = m; c_lo = c; }
        else { hi = mid; c_hi = c; }
    }
    if (hi - lo > 1u) {                                // one token in [lo, hi): its value
        unsigned best = 0u;
        for (int j = threadIdx.x; j < vocab; j += THREADS) {
            const unsigned b = __float_as_uint(p[j]);
            if (b < hi && b > best) best = b;          // p >= 0: bits order like values
        }
        for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(FULL, best, o));
        __syncthreads();
        if (threadIdx.x % 32 == 0) sc[threadIdx.x / 32] = (int)best;
        __syncthreads();
        best = (unsigned)sc[threadIdx.x % 32];
        for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(FULL, best, o));
        lo = best;                                     // the same set: m_lo, c_lo stand
    }
}

// params: 5 rows of `rows` uint64 values: T and top_p (float64 bits), top_k, seed, counter.
// p: the row's probabilities go to dynamic shared memory (use_smem) or to scratch.
// thr_out, mass_out (may be null): each row's threshold and kept mass, for the tests.
extern "C" __global__ void __launch_bounds__(THREADS)
sample_rows_kernel(const float* __restrict__ logits, const int vocab,
                   const unsigned long long* __restrict__ params, const int rows,
                   float* __restrict__ scratch, const int use_smem,
                   int* __restrict__ out, float* __restrict__ thr_out,
                   double* __restrict__ mass_out) {
    extern __shared__ float smem[];
    __shared__ double sm[WARPS];
    __shared__ int sc[WARPS];
    __shared__ double seg[WARPS];
    const int row = blockIdx.x, tid = threadIdx.x, lane = tid % 32, w = tid / 32;
    const float* x = logits + (long long)row * vocab;
    float* p = use_smem ? smem : scratch + (long long)row * vocab;
    const double T = __longlong_as_double((long long)params[row]);
    const double top_p = __longlong_as_double((long long)params[rows + row]);
    const long long top_k = (long long)params[2 * rows + row];
    const unsigned long long seed = params[3 * rows + row], counter = params[4 * rows + row];

    // 1. The largest logit and the first token that holds it.
    float best = __int_as_float(0xff800000);           // -inf (NVRTC has no math.h)
    int at = vocab;
    for (int j = tid; j < vocab; j += THREADS)
        if (x[j] > best) { best = x[j]; at = j; }
    for (int o = 16; o > 0; o >>= 1) {
        const float b = __shfl_xor_sync(FULL, best, o);
        const int a = __shfl_xor_sync(FULL, at, o);
        if (b > best || (b == best && a < at)) { best = b; at = a; }
    }
    __shared__ float sbest[WARPS];
    __shared__ int sat[WARPS];
    if (lane == 0) { sbest[w] = best; sat[w] = at; }
    __syncthreads();
    best = sbest[lane]; at = sat[lane];
    for (int o = 16; o > 0; o >>= 1) {
        const float b = __shfl_xor_sync(FULL, best, o);
        const int a = __shfl_xor_sync(FULL, at, o);
        if (b > best || (b == best && a < at)) { best = b; at = a; }
    }
    if (at >= vocab) at = 0;                           // every logit -inf: token 0
    if (!(T > 0.0)) {                                  // greedy: the first argmax
        if (tid == 0) {
            out[row] = at;
            if (thr_out) thr_out[row] = 1.0f;
            if (mass_out) mass_out[row] = 1.0;
        }
        return;
    }

    // 2. p = exp(z - max z), z = x / T in float32; the exp in double, rounded to float.
    const float tf = (float)T, zmax = best / tf;
    double total = 0.0;
    int positive = 0;
    for (int j = tid; j < vocab; j += THREADS) {
        float v = (float)exp((double)(x[j] / tf - zmax));
        if (v < 1.17549435e-38f) v = 0.0f;             // below float's normal range: 0
        p[j] = v;
        if (v > 0.0f) { total += v; positive += 1; }   // the same sum as mass_at(p, 1 bit)
    }
    __syncthreads();                                   // p is written
    block_sum(total, positive, sm, sc);

    // 3. top-k: the largest t with count{p >= t} >= k (t = 1 bit: all positive tokens).
    // The bisection keeps count{p >= lo} >= k > count{p >= hi}; once one token alone lies
    // in [lo, hi), its value is the answer, found by one max: ~17 halvings, not ~30.
    unsigned lo = 1u;                                  // the smallest positive float
    double kept = total;
    int c_lo = positive;
    if (top_k > 0 && top_k < positive)
        bisect(p, vocab, lo, kept, c_lo, (double)top_k, false, sm, sc);
    // 4. top-p: the largest t >= t_k with mass{p >= t} >= top_p * mass{p >= t_k}.
    if (top_p < 1.0)
        bisect(p, vocab, lo, kept, c_lo, top_p * kept, true, sm, sc);
    const float thr = __uint_as_float(lo);

    // 5. u: the counter-th number of the seed's splitmix64 stream, 24 bits.
    const unsigned long long state = mix64(seed) + counter * 0x9E3779B97F4A7C15ull;
    const float u = (float)(mix64(state) >> 40) * 5.9604644775390625e-08f;   // 2**-24

    // 6. The walk in token order. Warp w owns tokens [w * S, (w + 1) * S), read 32 at a
    // time (a tile); first each warp's kept mass, then the warp where u * mass falls walks
    // its tiles, and in the crossing tile the lanes' running sums say which token.
    const int tiles = (vocab + THREADS - 1) / THREADS, S = tiles * 32;
    double mine = 0.0;
    for (int i = 0; i < tiles; ++i) {
        const int j = w * S + i * 32 + lane;
        double v = (j < vocab && p[j] >= thr) ? (double)p[j] : 0.0;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
        mine += v;
    }
    if (lane == 0) seg[w] = mine;
    __syncthreads();
    double whole = 0.0;
    for (int k = 0; k < WARPS; ++k) whole += seg[k];
    const double target = (double)u * whole;
    double before = 0.0;
    int W = -1, last = -1;
    for (int k = 0; k < WARPS; ++k) {                  // the warp where the target falls
        if (seg[k] > 0.0) last = k;
        if (W < 0 && before + seg[k] > target) W = k;
        else if (W < 0) before += seg[k];
    }
    if (W < 0) { W = last; before = 0.0; }             // rounding: the last kept mass
    if (W < 0) {                                       // no mass at all (NaN logits)
        if (tid == 0) out[row] = at;
        return;
    }
    if (w != W) return;
    const double goal = target - before;               // within warp W's own tokens
    double run = 0.0;
    int pick = -1, last_kept = -1;
    for (int i = 0; i < tiles && pick < 0; ++i) {
        const int j = w * S + i * 32 + lane;
        const double v = (j < vocab && p[j] >= thr) ? (double)p[j] : 0.0;
        double s = v;                                  // inclusive scan over the lanes
        for (int o = 1; o < 32; o <<= 1) {
            const double n = __shfl_up_sync(FULL, s, o);
            if (lane >= o) s += n;
        }
        const unsigned cross = __ballot_sync(FULL, run + s > goal && v > 0.0);
        const unsigned any = __ballot_sync(FULL, v > 0.0);
        if (cross) pick = w * S + i * 32 + __ffs(cross) - 1;
        else if (any) last_kept = w * S + i * 32 + 31 - __clz(any);   // the last kept so far
        run += __shfl_sync(FULL, s, 31);
    }
    if (pick < 0) pick = last_kept;                       // rounding: the last kept token
    if (lane == 0) {
        out[row] = pick;
        if (thr_out) thr_out[row] = thr;
        if (mass_out) mass_out[row] = kept;
    }
}
