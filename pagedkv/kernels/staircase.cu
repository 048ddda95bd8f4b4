// =======================================================================================
// Chapter 9's staircase: five teaching kernels for paged decode attention, each one idea
// faster than the last (common.cuh comes first). Steps 6 and 7 are the package's own
// kernels, paged_decode.cu and paged_decode_tc.cu. All of them compute, for every
// sequence b and query head qh (which reads kv head h = qh / GROUP):
//     out[b][qh] = sum_t softmax_t(q . k_t * scale) v_t over the tokens t < seq_lens[b]
// These take float16 or bfloat16 (DT 1 or 2); the arithmetic is float32.
// =======================================================================================

// ---- Step 1: one thread per (sequence, query head), a plain loop over the tokens ----
// Thread i of the grid handles sequence b = i / q_heads and query head qh = i % q_heads.
// It walks the sequence twice: once for the largest score m (so that exp never
// overflows), once for the weights p = exp(s - m), their sum l, and the weighted sum acc
// of the V rows.
template <int DT, int HEAD_DIM, int BLOCK_SIZE>
__global__ void step1_thread(const void* q, const void* cache, const int* block_tables,
                             const int* seq_lens, void* out, int batch, int q_heads,
                             int kv_heads, int max_blocks, float scale) {
    using N = Num<DT>;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * q_heads) return;
    const int b = i / q_heads, h = (i % q_heads) / (q_heads / kv_heads);
    const int len = seq_lens[b];
    const int* table = block_tables + (long long)b * max_blocks;
    float qf[HEAD_DIM], acc[HEAD_DIM];
    for (int d = 0; d < HEAD_DIM; ++d) {
        qf[d] = N::load(q, (long long)i * HEAD_DIM + d) * scale;
        acc[d] = 0.f;
    }
    float m = -1e30f;                                // pass 1: the largest score
    for (int t = 0; t < len; ++t) {
        const long long k = kv_row<HEAD_DIM, BLOCK_SIZE>(table, t, 0, h, kv_heads);
        float s = 0.f;
        for (int d = 0; d < HEAD_DIM; ++d) s += qf[d] * N::load(cache, k + d);
        m = fmaxf(m, s);
    }
    float l = 0.f;                                   // pass 2: weights and the V sum
    for (int t = 0; t < len; ++t) {
        const long long k = kv_row<HEAD_DIM, BLOCK_SIZE>(table, t, 0, h, kv_heads);
        const long long v = kv_row<HEAD_DIM, BLOCK_SIZE>(table, t, 1, h, kv_heads);
        float s = 0.f;
        for (int d = 0; d < HEAD_DIM; ++d) s += qf[d] * N::load(cache, k + d);
        const float p = expf(s - m);
        l += p;
        for (int d = 0; d < HEAD_DIM; ++d) acc[d] += p * N::load(cache, v + d);
    }
    for (int d = 0; d < HEAD_DIM; ++d)
        N::store(out, (long long)i * HEAD_DIM + d, len > 0 ? acc[d] / l : 0.f);
}

// ---- helpers for steps 2-5: a row read by ROW_VECS threads, 16 bytes each --------
// Chunk c (16 bytes: 8 numbers) of token t's K (kv = 0) or V (kv = 1) row of kv head h.
template <int HEAD_DIM, int BLOCK_SIZE>
__device__ __forceinline__ uint4 chunk(const uint4* cache, const int* table, int t,
                                       int kv, int h, int kv_heads, int c) {
    return cache[kv_row<HEAD_DIM, BLOCK_SIZE>(table, t, kv, h, kv_heads) / 8 + c];
}
// My 8 numbers of q times my 8 numbers of a K row.
template <int DT>
__device__ __forceinline__ float dot8(const float* qf, const uint4& raw) {
    float kf[8];
    Num<DT>::unpack(raw, kf);
    float s = 0.f;
    #pragma unroll
    for (int j = 0; j < 8; ++j) s += qf[j] * kf[j];
    return s;
}
// Sum (or max) over the WIDTH threads that share a row: a butterfly of shuffles. After
// log2(WIDTH) rounds every one of them holds the total. (WIDTH = 32: the whole warp.)
template <int WIDTH> __device__ __forceinline__ float row_sum(float x) {
    #pragma unroll
    for (int o = WIDTH / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
// Sum (or max) over the threads that hold the same chunk of different rows: lanes
// ROW_VECS, 2 ROW_VECS, ... apart.
template <int ROW_VECS> __device__ __forceinline__ float across_rows_sum(float x) {
    #pragma unroll
    for (int o = ROW_VECS; o < 32; o *= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;
}
template <int ROW_VECS> __device__ __forceinline__ float across_rows_max(float x) {
    #pragma unroll
    for (int o = ROW_VECS; o < 32; o *= 2)
        x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
    return x;
}

// ---- Step 2: a warp per (sequence, query head); a row read by ROW_VECS threads -----
// Thread `lane` takes chunk c = lane % ROW_VECS of the row of token t0 + lane / ROW_VECS:
// the warp reads TOK = 32 / ROW_VECS whole rows at once, in contiguous 16-byte loads.
// Still two passes.
template <int DT, int HEAD_DIM, int BLOCK_SIZE>
__global__ void step2_warp(const uint4* q, const uint4* cache, const int* block_tables,
                           const int* seq_lens, void* out, int batch, int q_heads,
                           int kv_heads, int max_blocks, float scale) {
    constexpr int ROW_VECS = HEAD_DIM / 8, TOK = 32 / ROW_VECS;
    const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;  // my warp's (b, qh)
    if (i >= batch * q_heads) return;                                 // whole warps leave
    const int lane = threadIdx.x % 32, c = lane % ROW_VECS, sub = lane / ROW_VECS;
    const int b = i / q_heads, h = (i % q_heads) / (q_heads / kv_heads);
    const int len = seq_lens[b];
    const int* table = block_tables + (long long)b * max_blocks;
    auto row = [&](int t, int kv) {   // my chunk of token t's K (kv 0) or V (kv 1) row
        return chunk<HEAD_DIM, BLOCK_SIZE>(cache, table, t, kv, h, kv_heads, c);
    };
    float qf[8];
    Num<DT>::unpack(q[(long long)i * ROW_VECS + c], qf);
    for (int j = 0; j < 8; ++j) qf[j] *= scale;

    float m = -1e30f;                                      // pass 1: the largest score
    for (int t0 = 0; t0 < len; t0 += TOK) {
        const int t = t0 + sub;
        float s = 0.f;
        if (t < len) s = dot8<DT>(qf, row(t, 0));
        s = row_sum<ROW_VECS>(s);                     // every thread of the row: q . k
        if (t < len) m = fmaxf(m, s);
    }
    m = across_rows_max<ROW_VECS>(m);
    float l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int t0 = 0; t0 < len; t0 += TOK) {               // pass 2: weights and the V sum
        const int t = t0 + sub;
        float s = 0.f;
        if (t < len) s = dot8<DT>(qf, row(t, 0));
        s = row_sum<ROW_VECS>(s);
        if (t < len) {
            const float p = expf(s - m);
            float vf[8];
            Num<DT>::unpack(row(t, 1), vf);
            l += p;
            for (int j = 0; j < 8; ++j) acc[j] += p * vf[j];
        }
    }
    l = across_rows_sum<ROW_VECS>(l);                      // add up the TOK rows' shares
    for (int j = 0; j < 8; ++j) acc[j] = across_rows_sum<ROW_VECS>(acc[j]);
    if (sub == 0)
        for (int j = 0; j < 8; ++j)
            Num<DT>::store(out, (long long)i * HEAD_DIM + c * 8 + j,
                           l > 0.f ? acc[j] / l : 0.f);
}

// ---- Step 3: the same warp, one pass: online softmax ------------------------------
// Keep a running max m; when a larger score arrives, what was summed so far is rescaled
// by corr = exp(m_old - m_new). All threads of the warp share one m (the max over the
// TOK tokens of each trip), so at the end the shares of the TOK rows add up as they are.
template <int DT, int HEAD_DIM, int BLOCK_SIZE>
__global__ void step3_online(const uint4* q, const uint4* cache, const int* block_tables,
                             const int* seq_lens, void* out, int batch, int q_heads,
                             int kv_heads, int max_blocks, float scale) {
    constexpr int ROW_VECS = HEAD_DIM / 8, TOK = 32 / ROW_VECS;
    const int i = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (i >= batch * q_heads) return;
    const int lane = threadIdx.x % 32, c = lane % ROW_VECS, sub = lane / ROW_VECS;
    const int b = i / q_heads, h = (i % q_heads) / (q_heads / kv_heads);
    const int len = seq_lens[b];
    const int* table = block_tables + (long long)b * max_blocks;
    auto row = [&](int t, int kv) {   // my chunk of token t's K (kv 0) or V (kv 1) row
        return chunk<HEAD_DIM, BLOCK_SIZE>(cache, table, t, kv, h, kv_heads, c);
    };
    float qf[8];
    Num<DT>::unpack(q[(long long)i * ROW_VECS + c], qf);
    for (int j = 0; j < 8; ++j) qf[j] *= scale;

    float m = -1e30f, l = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int t0 = 0; t0 < len; t0 += TOK) {
        const int t = t0 + sub;
        float s = 0.f;
        if (t < len) s = dot8<DT>(qf, row(t, 0));
        s = row_sum<ROW_VECS>(s);                          // all threads take part, then
        if (t >= len) s = NEG_INF;                         // tokens past the end weigh 0
        const float m_new = fmaxf(m, across_rows_max<ROW_VECS>(s));
        const float corr = expf(m - m_new), p = expf(s - m_new);   // p = 0 past the end
        float vf[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
        if (t < len) Num<DT>::unpack(row(t, 1), vf);
        l = l * corr + p;
        for (int j = 0; j < 8; ++j) acc[j] = acc[j] * corr + p * vf[j];
        m = m_new;
    }
    l = across_rows_sum<ROW_VECS>(l);
    for (int j = 0; j < 8; ++j) acc[j] = across_rows_sum<ROW_VECS>(acc[j]);
    if (sub == 0)
        for (int j = 0; j < 8; ++j)
            Num<DT>::store(out, (long long)i * HEAD_DIM + c * 8 + j,
                           l > 0.f ? acc[j] / l : 0.f);
}

// ---- Step 4: one CTA per (sequence, kv head): its GROUP query heads read K/V once ----
// The CTA's NWARPS warps share the tokens (warp w takes trips w, w + NWARPS, ...), each
// with its own online softmax per query head. At the end two softmaxes (m1, l1, a1), (m2,
// l2, a2) combine exactly: m = max(m1, m2), l = l1 e^(m1-m) + l2 e^(m2-m), a likewise;
// the warps are combined that way through shared memory. The result, normalised, lands in
// res[GROUP][HEAD_DIM] with lse[g] = log2 of the sum of the weights (for step 5). Tokens
// [t_begin, t_end) only.
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS>
__device__ void attend_range(const uint4* q, const uint4* cache, const int* table, int b,
                             int h, int kv_heads, int t_begin, int t_end, float scale,
                             float* res, float* lse) {
    constexpr int ROW_VECS = HEAD_DIM / 8, TOK = 32 / ROW_VECS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int c = lane % ROW_VECS, sub = lane / ROW_VECS;
    float qf[GROUP][8], m[GROUP], l[GROUP], acc[GROUP][8];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        const long long qrow = (long long)b * kv_heads * GROUP + h * GROUP + g;
        Num<DT>::unpack(q[qrow * ROW_VECS + c], qf[g]);
        m[g] = -1e30f; l[g] = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; ++j) { qf[g][j] *= scale; acc[g][j] = 0.f; }
    }
    for (int t0 = t_begin + warp * TOK; t0 < t_end; t0 += NWARPS * TOK) {
        const int t = t0 + sub;
        uint4 kr = {0u, 0u, 0u, 0u}, vr = {0u, 0u, 0u, 0u};
        if (t < t_end) {                          // one load of K and V for GROUP heads
            kr = chunk<HEAD_DIM, BLOCK_SIZE>(cache, table, t, 0, h, kv_heads, c);
            vr = chunk<HEAD_DIM, BLOCK_SIZE>(cache, table, t, 1, h, kv_heads, c);
        }
        float vf[8];
        Num<DT>::unpack(vr, vf);
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float s = row_sum<ROW_VECS>(dot8<DT>(qf[g], kr));
            s = t < t_end ? s : NEG_INF;
            const float m_new = fmaxf(m[g], across_rows_max<ROW_VECS>(s));
            const float corr = expf(m[g] - m_new), p = expf(s - m_new);
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int j = 0; j < 8; ++j) acc[g][j] = acc[g][j] * corr + p * vf[j];
            m[g] = m_new;
        }
    }
    // The warp's rows share m: add their shares. Then merge the warps (shared memory).
    __shared__ float sm_acc[NWARPS][GROUP][HEAD_DIM];
    __shared__ float sm_m[NWARPS][GROUP], sm_l[NWARPS][GROUP];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        l[g] = across_rows_sum<ROW_VECS>(l[g]);
        #pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[g][j] = across_rows_sum<ROW_VECS>(acc[g][j]);
            if (sub == 0) sm_acc[warp][g][c * 8 + j] = acc[g][j];
        }
        if (lane == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NWARPS * 32) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = -1e30f, lsum = 0.f, o = 0.f;
        for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, sm_m[w][g]);
        for (int w = 0; w < NWARPS; ++w) {
            const float e = expf(sm_m[w][g] - mx);
            lsum += sm_l[w][g] * e;
            o += sm_acc[w][g][d] * e;
        }
        res[i] = lsum > 0.f ? o / lsum : 0.f;
        if (d == 0)                                      // log2 of the weights' sum
            lse[g] = lsum > 0.f ? (mx + logf(lsum)) * 1.4426950408889634f : NEG_INF;
    }
}

template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
step4_group(const uint4* q, const uint4* cache, const int* block_tables,
            const int* seq_lens, void* out, int kv_heads, int max_blocks, float scale) {
    const int h = blockIdx.x, b = blockIdx.y;             // grid: (kv_heads, batch)
    __shared__ float res[GROUP * HEAD_DIM], lse[GROUP];
    attend_range<DT, HEAD_DIM, GROUP, BLOCK_SIZE, NWARPS>(
        q, cache, block_tables + (long long)b * max_blocks, b, h, kv_heads,
        0, seq_lens[b], scale, res, lse);
    __syncthreads();
    const long long first = ((long long)b * kv_heads * GROUP + h * GROUP) * HEAD_DIM;
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NWARPS * 32)
        Num<DT>::store(out, first + i, res[i]);
}

// ---- Step 5: split-K ("flash-decoding"): a few long sequences fill the GPU too ----
// With batch x kv_heads CTAs smaller than the GPU (132 multiprocessors on an H200), most
// of it would idle. Cut each sequence into gridDim.x pieces of split_tokens tokens; CTA
// (split, h, b) attends over its piece and writes its normalised result and lse;
// merge_splits (common.cuh) then weighs the pieces by 2^lse.
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS>
__global__ void __launch_bounds__(NWARPS * 32)
step5_split(const uint4* q, const uint4* cache, const int* block_tables,
            const int* seq_lens, float* part_o, float* part_lse, int kv_heads,
            int max_blocks, int split_tokens, float scale) {
    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, num_splits = gridDim.x;
    const int t_begin = split * split_tokens;
    const int t_end = min(seq_lens[b], t_begin + split_tokens);
    __shared__ float res[GROUP * HEAD_DIM], lse[GROUP];
    attend_range<DT, HEAD_DIM, GROUP, BLOCK_SIZE, NWARPS>(
        q, cache, block_tables + (long long)b * max_blocks, b, h, kv_heads,
        t_begin, t_end, scale, res, lse);
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NWARPS * 32) {
        const long long qrow = (long long)b * kv_heads * GROUP + h * GROUP + i / HEAD_DIM;
        part_o[(qrow * num_splits + split) * HEAD_DIM + i % HEAD_DIM] = res[i];
        if (i % HEAD_DIM == 0) part_lse[qrow * num_splits + split] = lse[i / HEAD_DIM];
    }
}
