// =======================================================================================
// Step 6 of the chapter, the production kernel on CUDA cores (common.cuh comes first).
//  * One CTA handles one (sequence b, kv head h, split) triple: blockIdx.z = b,
//    blockIdx.y = h, blockIdx.x = split. All GROUP query heads that share kv head h are
//    handled by the same CTA, which reads each K/V byte from memory once for all.
//  * Inside a CTA, threads form "token groups" of TPT threads. A token group reads one
//    token's K row (head_dim numbers) together: each thread takes 16 consecutive bytes
//    (one uint4), so the group's loads are one contiguous stretch of memory, the fastest
//    access there is.
//  * Each token group walks its own tokens (every NGROUPS-th one) and keeps its own
//    running softmax (max m, sum l, weighted sum acc). At the end the groups, then the
//    warps, are merged.
//  * Loads go through a ring of shared-memory tiles filled by cp.async, so that the next
//    tiles are on their way while the current one is computed.
//  * KV8 = 1: the cache is int8 with float16 scales (common.cuh's "8-bit cache"). A 16-byte
//    load then holds 16 numbers of a row, all of one run of 32, and the thread also copies
//    that run's (K scale, V scale) pair (4 bytes). Scores are the int8 numbers' dot product
//    with q times the K scale; a token's weight p is multiplied by the V scale before it
//    meets the int8 V numbers. The sum l adds p itself.
// =======================================================================================

// ---- the kernel ------------------------------------------------------------------
// q            [batch][q_heads][HEAD_DIM]                          (as uint4 chunks)
// cache        [num_blocks][2][BLOCK_SIZE][kv_heads][HEAD_DIM]     (as uint4 chunks)
// block_tables [batch][max_blocks]   physical block of each sequence's logical block
// seq_lens     [batch]
// out          [batch][q_heads][HEAD_DIM]   written when there is one split
// part_o, part_lse: each split's normalised output and log2-sum-exp, merged by
// merge_splits (common.cuh)
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS, int UNROLL,
          int STAGES, int CHUNKS, int KV8 = 0>
__global__ void __launch_bounds__(NWARPS * 32)
paged_decode(const uint4* __restrict__ q, const uint4* __restrict__ cache,
             const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
             void* __restrict__ out, float* __restrict__ part_o,
             float* __restrict__ part_lse, int kv_heads, int max_blocks, int split_tokens,
             float scale_log2) {
    using N = Num<DT>;
    constexpr int VEC = KV8 ? 16 : N::PER_VEC;          // numbers per 16-byte load
    constexpr int ROW_VECS = HEAD_DIM / VEC;            // 16-byte loads per head row
    constexpr int NV = CHUNKS > 0 ? CHUNKS   // 16-byte loads per thread per row: as few
                     : (ROW_VECS < 32 ? 1 : ROW_VECS / 32);      // as a warp allows
    constexpr int TPT = ROW_VECS / NV;                  // threads per token group
    static_assert(TPT * NV == ROW_VECS && TPT <= 32 && 32 % TPT == 0, "bad CHUNKS");
    constexpr int E = NV * VEC;                         // numbers of a row a thread holds
    constexpr int GPW = 32 / TPT;                       // token groups per warp
    constexpr int NGROUPS = NWARPS * GPW;               // token groups per CTA
    constexpr int TILE = NGROUPS * UNROLL;              // tokens per trip round the loop

    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int num_splits = gridDim.x, q_heads = kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int grp = warp * GPW + lane / TPT;  // my token group
    const int lig = lane % TPT;               // my place in it: chunks lig, lig+TPT, ...

    wait_for_prior_grid();    // q was written by the kernel before (pdl.py)
    let_next_grid_start();
    const int len = seq_lens[b];
    const int t_begin = split * split_tokens;                 // this split's tokens:
    const int t_end = min(len, t_begin + split_tokens);       //   [t_begin, t_end)

    // My slice of each query head, pre-multiplied by scale * log2(e) for exp2.
    float qf[GROUP][E];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        #pragma unroll
        for (int n = 0; n < NV; ++n) {
            const long long qrow = (long long)b * q_heads + h * GROUP + g;
            if constexpr (KV8) {             // q's numbers of my cache chunk, one by one
                #pragma unroll
                for (int j = 0; j < VEC; ++j)
                    qf[g][n * VEC + j] = N::load(q, qrow * HEAD_DIM
                                                 + (n * TPT + lig) * VEC + j) * scale_log2;
            } else {
                float tmp[VEC];
                N::unpack(q[qrow * ROW_VECS + n * TPT + lig], tmp);
                #pragma unroll
                for (int j = 0; j < VEC; ++j) qf[g][n * VEC + j] = tmp[j] * scale_log2;
            }
        }
    }

    // Running softmax of my token group, per query head: max score m, l = sum of
    // exp2(s - m), acc = sum of exp2(s - m) * V over the tokens so far (my E numbers).
    float m[GROUP], l[GROUP], acc[GROUP][E];
    #pragma unroll
    for (int g = 0; g < GROUP; ++g) {
        m[g] = -1e30f; l[g] = 0.f;
        #pragma unroll
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }

    // Token t of the sequence lives in block table[t / BLOCK_SIZE], row t % BLOCK_SIZE.
    const int* table = block_tables + (long long)b * max_blocks;
    const long long row = (long long)kv_heads * ROW_VECS;  // uint4s from token to token
    const uint4* head = cache + h * ROW_VECS + lig;        // my chunk of kv head h, row 0
    // uint4s from one block to the next: K and V rows, and with KV8 the block's scales
    const long long block_vecs = KV8 ? kv8_block_bytes(BLOCK_SIZE, kv_heads, HEAD_DIM) / 16
                                     : 2LL * BLOCK_SIZE * row;
    // KV8: the scale pair of my chunk's run in row 0 of block 0, in bytes; a chunk n*TPT + lig
    // holds numbers of run (n * TPT + lig) * VEC / 32.
    const char* pairs = (const char*)cache
        + (KV8 ? kv8_pair_at(0, h, lig * VEC / KV8_RUN, BLOCK_SIZE, kv_heads, HEAD_DIM) : 0);
    const long long pair_row = (long long)kv_heads * (HEAD_DIM / KV8_RUN) * 4;  // bytes

    // The loop runs over "tiles" of TILE tokens; in a tile, token group grp takes tokens
    // tile_start + u * NGROUPS + grp for u = 0 .. UNROLL-1. Loads go through a ring of
    // STAGES shared-memory slots: while the arithmetic works on tile i, the loads of the
    // next STAGES-1 tiles are already on their way (cp.async copies global -> shared
    // without using registers). Each thread reads back only the 16-byte chunks it asked
    // for itself, so no barrier is needed: "cp.async.wait_group N" waits until at most N
    // of my requested groups are still in flight.
    __shared__ uint4 ring[STAGES][UNROLL][2][NV][NWARPS * 32];
    __shared__ unsigned ring_s[KV8 ? STAGES : 1][UNROLL][NV][NWARPS * 32];  // scale pairs
    const int n_tiles = t_end > t_begin ? (t_end - t_begin + TILE - 1) / TILE : 0;
    int blk[UNROLL];  // the blocks of the tile to request next (looked up one tile ahead)

    // lookup(tile): fetch the block ids of my tokens of that tile from the page table.
    // request(tile): start copying those tokens' K and V rows into the tile's ring slot.
#define LOOKUP(tile_)                                                                    \
    _Pragma("unroll") for (int u = 0; u < UNROLL; ++u) {                                 \
        int t = t_begin + (tile_) * TILE + u * NGROUPS + grp;                            \
        blk[u] = ((tile_) < n_tiles && t < t_end) ? table[t / BLOCK_SIZE] : 0;           \
    }
#define REQUEST(tile_)                                                                   \
    if ((tile_) < n_tiles) {                                                             \
        const int slot_ = (tile_) % STAGES;                                              \
        _Pragma("unroll") for (int u = 0; u < UNROLL; ++u) {                             \
            int t = t_begin + (tile_) * TILE + u * NGROUPS + grp;                        \
            bool ok = t < t_end;  /* a token past the end reads zeros, never garbage */  \
            const uint4* p = head + (long long)blk[u] * block_vecs                       \
                                  + (long long)(t % BLOCK_SIZE) * row;                   \
            _Pragma("unroll") for (int n = 0; n < NV; ++n) {                             \
                cp_async16(&ring[slot_][u][0][n][threadIdx.x],                           \
                           ok ? p + n * TPT : cache, ok);                                \
                cp_async16(&ring[slot_][u][1][n][threadIdx.x],                           \
                           ok ? p + BLOCK_SIZE * row + n * TPT : cache, ok);             \
                if (KV8)                                                                 \
                    cp_async4(&ring_s[KV8 ? slot_ : 0][u][n][threadIdx.x],               \
                              ok ? pairs + (long long)blk[u] * block_vecs * 16           \
                                   + (t % BLOCK_SIZE) * pair_row                         \
                                   + n * TPT * VEC / KV8_RUN * 4 : (const char*)cache, ok); \
            }                                                                            \
        }                                                                                \
    }                                                                                    \
    cp_async_commit();  /* one group per tile, empty past the end: the count is right */

    LOOKUP(0)
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { REQUEST(i) LOOKUP(i + 1) }

    for (int tile = 0; tile < n_tiles; ++tile) {
        // 1. Ask for tile + STAGES - 1, look up the blocks of the one after, and wait
        //    for this tile.
        REQUEST(tile + STAGES - 1)
        LOOKUP(tile + STAGES)
        cp_async_wait<STAGES - 1>();
        const int slot = tile % STAGES;
        const int tb = t_begin + tile * TILE;

        // 2. Scores s = q . k: my partial dot product, then a butterfly sum over the
        //    group's TPT threads (__shfl_xor_sync swaps registers between the threads
        //    of a warp).
        float s[UNROLL][GROUP];
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) s[u][g] = 0.f;
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                float kf[VEC];
                if constexpr (KV8) {             // int8 numbers; the K scale comes after
                    kv8_unpack(ring[slot][u][0][n][threadIdx.x], 1.f, kf);
                } else {
                    N::unpack(ring[slot][u][0][n][threadIdx.x], kf);
                }
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    float part = 0.f;
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) part += qf[g][n * VEC + j] * kf[j];
                    if constexpr (KV8)
                        part *= kv8_half(ring_s[slot][u][n][threadIdx.x] & 0xffffu);
                    s[u][g] += part;
                }
            }
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                #pragma unroll
                for (int o = TPT / 2; o > 0; o /= 2)
                    s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
                if (tb + u * NGROUPS + grp >= t_end) s[u][g] = NEG_INF;  // past the end
            }
        }
        // 3. Online softmax: raise the running max, rescale what was summed so far, add
        //    the new tokens' weights p = exp2(s - m) and p * V.
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            float mx = m[g];
            #pragma unroll
            for (int u = 0; u < UNROLL; ++u) mx = fmaxf(mx, s[u][g]);
            const float corr = exp2f(m[g] - mx);
            m[g] = mx;
            l[g] *= corr;
            #pragma unroll
            for (int e = 0; e < E; ++e) acc[g][e] *= corr;
        }
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                float vf[VEC];
                float vs = 1.f;                  // KV8: the V scale, folded into p
                if constexpr (KV8) {
                    kv8_unpack(ring[slot][u][1][n][threadIdx.x], 1.f, vf);
                    vs = kv8_half(ring_s[slot][u][n][threadIdx.x] >> 16);
                } else {
                    N::unpack(ring[slot][u][1][n][threadIdx.x], vf);
                }
                #pragma unroll
                for (int g = 0; g < GROUP; ++g) {
                    const float p = exp2f(s[u][g] - m[g]);
                    if (n == 0) l[g] += p;
                    const float pv = p * vs;
                    #pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[g][n * VEC + j] += pv * vf[j];
                }
            }
        }
    }

    // 4. Merge the token groups of each warp (threads TPT, 2*TPT, ... apart hold the same
    //    numbers of different groups): two running softmaxes (m1, l1, a1), (m2, l2, a2)
    //    combine to m = max(m1, m2), l = l1 * 2^(m1-m) + l2 * 2^(m2-m), and a likewise.
    #pragma unroll
    for (int o = TPT; o < 32; o *= 2) {
        #pragma unroll
        for (int g = 0; g < GROUP; ++g) {
            const float om = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float ol = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float nm = fmaxf(m[g], om);
            const float c1 = exp2f(m[g] - nm), c2 = exp2f(om - nm);
            l[g] = l[g] * c1 + ol * c2;
            #pragma unroll
            for (int e = 0; e < E; ++e)
                acc[g][e] = acc[g][e] * c1
                            + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * c2;
            m[g] = nm;
        }
    }

    // 5. Merge the warps through shared memory (memory all threads of the CTA can see),
    //    one query head at a time, and write the result: the output itself when there
    //    is one split, else the split's normalised output and log2-sum-exp, for merging.
    __shared__ float sm_acc[NWARPS][HEAD_DIM];
    __shared__ float sm_m[NWARPS], sm_l[NWARPS];
    #pragma unroll  // (unrolled so that acc[g] stays in registers: g must be a constant)
    for (int g = 0; g < GROUP; ++g) {
        if (lane < TPT) {
            #pragma unroll
            for (int n = 0; n < NV; ++n) {
                #pragma unroll
                for (int j = 0; j < VEC; ++j)
                    sm_acc[warp][(n * TPT + lig) * VEC + j] = acc[g][n * VEC + j];
            }
            if (lane == 0) { sm_m[warp] = m[g]; sm_l[warp] = l[g]; }
        }
        __syncthreads();  // wait until every warp has written
        const long long qrow = (long long)b * q_heads + h * GROUP + g;
        for (int d = threadIdx.x; d < HEAD_DIM; d += NWARPS * 32) {
            float mx = -1e30f;
            #pragma unroll
            for (int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, sm_m[w]);
            float lsum = 0.f, o = 0.f;
            #pragma unroll
            for (int w = 0; w < NWARPS; ++w) {
                const float c = exp2f(sm_m[w] - mx);
                lsum += sm_l[w] * c;
                o += sm_acc[w][d] * c;
            }
            const float res = lsum > 0.f ? o / lsum : 0.f;
            if (num_splits == 1) {
                N::store(out, qrow * HEAD_DIM + d, res);
            } else {
                part_o[(qrow * num_splits + split) * HEAD_DIM + d] = res;
                if (d == 0)
                    part_lse[qrow * num_splits + split] = lsum > 0.f ? mx + log2f(lsum)
                                                                     : NEG_INF;
            }
        }
        __syncthreads();  // before the next head overwrites shared memory
    }
}
