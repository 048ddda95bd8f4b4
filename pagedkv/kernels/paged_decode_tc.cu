// =======================================================================================
// Step 7 of the chapter: paged decode attention on tensor cores (common.cuh comes first).
//
// Why: with GROUP query heads per kv head, every K/V number feeds GROUP multiply-adds for
// the scores and GROUP for the output. At GROUP = 8 the CUDA-core kernel spends more time
// on that arithmetic (and on widening fp16 to fp32) than memory needs to deliver the
// bytes. A tensor core multiplies small matrices in one instruction per warp:
//     mma.sync.m16n8k16:  D[16x8] (float32) = A[16x16] (fp16/bf16) * B[16x8] + C[16x8]
// Each of the 32 threads of the warp holds a fixed piece of A, B, C and D in its
// registers (the "fragments"; the PTX manual draws them). With gid = lane / 4 and tig =
// lane % 4:
//     A: a0 = A[gid][2tig, 2tig+1]     a1 = A[gid+8][2tig, 2tig+1]
//        a2 = A[gid][2tig+8, +9]       a3 = A[gid+8][2tig+8, +9]
//     B: b0 = B[2tig, 2tig+1][gid]     b1 = B[2tig+8, 2tig+9][gid]
//     C: c0, c1 = C[gid][2tig, 2tig+1] c2, c3 = C[gid+8][2tig, 2tig+1]
// (two 16-bit numbers per 32-bit register, the lower column in the low half).
//
// One CTA handles (sequence b, kv head h, split), as in step 6. Each warp takes tiles of
// 16 tokens (warp w: tiles w, w + NWARPS, ...) and, per tile,
//   1. S = Q K^T   : A = Q, the GROUP query heads as rows (rows GROUP..15 are zero),
//                    B = K^T, 16 tokens as two 8-column tiles; k runs over head_dim.
//   2. online softmax over the 16 scores of each head, as in step 3 (p = 2^(s - m)).
//   3. O^T += V^T P^T: A = V^T (16 numbers of head_dim x 16 tokens), B = P^T (16 tokens x
//      8 heads). The C fragment of step 1 holds P[head gid][tokens 2tig, 2tig+1] and
//      [8+2tig, 9+2tig], which is exactly the B fragment step 3 needs: no number moves
//      from one thread to another.
// K and V tiles come from global memory into a per-warp ring of shared-memory tiles with
// cp.async (16 bytes per thread per copy); `ldmatrix` then loads the fragments from
// shared memory (with .trans for V^T, which is V read column-wise).
//
// KV8 = 1 (an int8 cache, common.cuh's "8-bit cache"): the ring holds the tiles' int8
// numbers and their scale pairs, half the bytes; once a tile has landed, the warp turns it
// into DT numbers (number * scale, rounded to DT) in a tile of its own, and steps 1-3 read
// that tile as they read the ring's otherwise.
// =======================================================================================

// ldmatrix_x4, ldmatrix_x4_trans and mma16816 are in common.cuh (the prefill kernel
// uses them too).

// q [batch][q_heads][HEAD_DIM], cache [num_blocks][2][BLOCK_SIZE][kv_heads][HEAD_DIM]
// (uint4 chunks), block_tables [batch][max_blocks], seq_lens [batch]; out, part_o,
// part_lse as in step 6. Dynamic shared memory: NWARPS * STAGES tiles of 16 K rows and 16 V
// rows.
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS, int STAGES,
          int KV8 = 0>
__global__ void __launch_bounds__(NWARPS * 32)
paged_decode_tc(const uint4* __restrict__ q, const uint4* __restrict__ cache,
                const int* __restrict__ block_tables, const int* __restrict__ seq_lens,
                void* __restrict__ out, float* __restrict__ part_o,
                float* __restrict__ part_lse, int kv_heads, int max_blocks,
                int split_tokens, float scale_log2) {
    static_assert(DT == 1 || DT == 2, "tensor cores take float16 or bfloat16");
    static_assert(GROUP >= 1 && GROUP <= 8, "one 8-column tile of query heads");
    constexpr int TILE = 16;                     // tokens per warp tile
    constexpr int ROW_VECS = HEAD_DIM / 8;       // 16-byte chunks in one head row
    constexpr int ROW = HEAD_DIM + 8;            // a shared-memory row, 16 bytes padded
    constexpr int KSTEPS = HEAD_DIM / 16;        // 16-wide steps along head_dim
    constexpr int CHUNKS = TILE * ROW_VECS / 32; // chunks of K (and V) per thread, tile
    constexpr int BS_T = BLOCK_SIZE < TILE ? BLOCK_SIZE : TILE;
    constexpr int NB = TILE / BS_T;              // blocks a tile spans (starts at 16k)
    constexpr int TILE_ELEMS = 2 * TILE * ROW;   // K rows then V rows, in 16-bit numbers
    static_assert(CHUNKS * 32 == TILE * ROW_VECS, "head_dim must be 64, 128 or 256");
    static_assert(NB <= 2, "block_size 8, 16 or 32");
    // KV8: a ring slot is the tile's int8 K rows, V rows, then each token's scale pairs
    constexpr int ROW_VECS8 = HEAD_DIM / 16;     // 16-byte chunks in one int8 row
    constexpr int RUNS = HEAD_DIM / 32;          // scale pairs (4 bytes) of a row
    constexpr int CHUNKS8 = TILE * ROW_VECS8 / 32;
    constexpr int SLOT8 = 2 * TILE * HEAD_DIM + TILE * RUNS * 4;   // bytes
    extern __shared__ __align__(16) unsigned short smem[];

    const int split = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int num_splits = gridDim.x, q_heads = kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    wait_for_prior_grid();    // q was written by the kernel before (pdl.py)
    let_next_grid_start();
    const int len = seq_lens[b];
    const int t_begin = split * split_tokens;
    const int t_end = min(len, t_begin + split_tokens);
    // this warp's ring (and with KV8 its DT tile, after the int8 ring)
    unsigned short* ring = smem + warp * (KV8 ? (STAGES * SLOT8 + 2 * TILE_ELEMS) / 2
                                              : STAGES * TILE_ELEMS);
    unsigned short* tile16 = ring + STAGES * SLOT8 / 2;        // KV8 only

    // Q as the A fragment, per 16-wide step of head_dim: row gid is query head h*GROUP +
    // gid. Rows 8..15 (a1, a3) and rows >= GROUP are zero.
    unsigned qa[KSTEPS][4];
    {
        const unsigned* q32 = reinterpret_cast<const unsigned*>(q);
        const long long row = ((long long)b * q_heads + h * GROUP + gid) * (HEAD_DIM / 2);
        #pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            qa[ks][0] = qa[ks][1] = qa[ks][2] = qa[ks][3] = 0u;
            if (gid < GROUP) {
                qa[ks][0] = q32[row + ks * 8 + tig];
                qa[ks][2] = q32[row + ks * 8 + 4 + tig];
            }
        }
    }

    // Running softmax of query head gid (the same in the 4 threads of a quad): max m
    // (log2 units), this thread's share of the sum l; and O^T, 16 numbers of head_dim
    // per step: acc[mt][0..1] = O[heads 2tig, 2tig+1][16mt + gid], acc[mt][2..3] the
    // same at 16mt + gid + 8.
    float m = -1e30f, l = 0.f;
    float acc[KSTEPS][4];
    #pragma unroll
    for (int mt = 0; mt < KSTEPS; ++mt)
        acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;

    const int* table = block_tables + (long long)b * max_blocks;
    const long long row_stride = (long long)kv_heads * (KV8 ? ROW_VECS8 : ROW_VECS);  // uint4s
    const uint4* head = cache + h * (KV8 ? ROW_VECS8 : ROW_VECS);  // kv head h in row 0
    const long long block_vecs = KV8 ? kv8_block_bytes(BLOCK_SIZE, kv_heads, HEAD_DIM) / 16
                                     : 2LL * BLOCK_SIZE * row_stride;   // block to block
    // KV8: the scale pairs of kv head h, row 0 of block 0 (bytes), and from row to row
    const char* pairs = (const char*)cache
                        + kv8_pair_at(0, h, 0, BLOCK_SIZE, kv_heads, HEAD_DIM);
    const long long pair_row = (long long)kv_heads * RUNS * 4;
    const int stride = NWARPS * TILE;                              // tokens between tiles
    const int first = t_begin + warp * TILE;
    const int n_tiles = t_end > first ? (t_end - first + stride - 1) / stride : 0;
    int blk[NB];   // physical blocks of the next tile to request

#define TC_LOOKUP(tile_)                                                                 \
    _Pragma("unroll") for (int n = 0; n < NB; ++n) {                                     \
        const int t = first + (tile_) * stride + n * BS_T;                               \
        blk[n] = ((tile_) < n_tiles && t < t_end) ? table[t / BLOCK_SIZE] : 0;           \
    }
    // Copy the K and V rows of a tile into ring slot tile % STAGES; rows past the end
    // become zeros (so a NaN in an unwritten slot never reaches the tensor cores).
#define TC_REQUEST(tile_)                                                                \
    if (KV8) { TC_REQUEST8(tile_) } else                                                 \
    if ((tile_) < n_tiles) {                                                             \
        unsigned short* dst = ring + ((tile_) % STAGES) * TILE_ELEMS;                    \
        const int t0 = first + (tile_) * stride;                                         \
        _Pragma("unroll") for (int i = 0; i < CHUNKS; ++i) {                             \
            const int c = lane + 32 * i, r = c / ROW_VECS, v = c % ROW_VECS;             \
            const int t = t0 + r;                                                        \
            const bool ok = t < t_end;                                                   \
            const int bk = (NB == 1 || r < BS_T) ? blk[0] : blk[NB - 1];                 \
            const uint4* src = head + (long long)bk * block_vecs                         \
                               + (t % BLOCK_SIZE) * row_stride + v;                      \
            cp_async16(dst + r * ROW + v * 8, ok ? src : cache, ok);                     \
            cp_async16(dst + (TILE + r) * ROW + v * 8,                                   \
                       ok ? src + BLOCK_SIZE * row_stride : cache, ok);                  \
        }                                                                                \
    }                                                                                    \
    cp_async_commit();   /* one group per tile, empty past the end: the count is right */
    // KV8: the same rows as int8 (16 numbers a copy), and lane r < 16 copies token r's
    // scale pairs, one 4-byte copy each.
#define TC_REQUEST8(tile_)                                                               \
    if ((tile_) < n_tiles) {                                                             \
        unsigned char* dst = (unsigned char*)ring + ((tile_) % STAGES) * SLOT8;          \
        const int t0 = first + (tile_) * stride;                                         \
        _Pragma("unroll") for (int i = 0; i < CHUNKS8; ++i) {                            \
            const int c = lane + 32 * i, r = c / ROW_VECS8, v = c % ROW_VECS8;           \
            const int t = t0 + r;                                                        \
            const bool ok = t < t_end;                                                   \
            const int bk = (NB == 1 || r < BS_T) ? blk[0] : blk[NB - 1];                 \
            const uint4* src = head + (long long)bk * block_vecs                         \
                               + (t % BLOCK_SIZE) * row_stride + v;                      \
            cp_async16(dst + r * HEAD_DIM + v * 16, ok ? src : cache, ok);               \
            cp_async16(dst + (TILE + r) * HEAD_DIM + v * 16,                             \
                       ok ? src + BLOCK_SIZE * row_stride : cache, ok);                  \
        }                                                                                \
        if (lane < TILE) {                                                               \
            const int t = t0 + lane;                                                     \
            const bool ok = t < t_end;                                                   \
            const int bk = (NB == 1 || lane < BS_T) ? blk[0] : blk[NB - 1];              \
            const char* src = pairs + (long long)bk * block_vecs * 16                    \
                              + (t % BLOCK_SIZE) * pair_row;                             \
            _Pragma("unroll") for (int g = 0; g < RUNS; ++g)                             \
                cp_async4(dst + 2 * TILE * HEAD_DIM + (lane * RUNS + g) * 4,             \
                          ok ? src + 4 * g : (const char*)cache, ok);                    \
        }                                                                                \
    }

    TC_LOOKUP(0)
    #pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) { TC_REQUEST(i) TC_LOOKUP(i + 1) }

    // ldmatrix addresses: thread `lane` points at row lrow, column lcol of a 16x16
    // piece, so that the four matrices are (rows 0-7, cols 0-7), (0-7, 8-15),
    // (8-15, 0-7) and (8-15, 8-15).
    const int lrow = (lane & 7) + ((lane >> 4) << 3), lcol = ((lane >> 3) & 1) * 8;

    for (int tile = 0; tile < n_tiles; ++tile) {
        __syncwarp();                      // all are done with the slot refilled next
        TC_REQUEST(tile + STAGES - 1)
        TC_LOOKUP(tile + STAGES)
        cp_async_wait<STAGES - 1>();       // my copies of this tile have landed ...
        __syncwarp();                      // ... and everyone else's too
        const unsigned short* ks_ = ring + (tile % STAGES) * TILE_ELEMS;
        if constexpr (KV8) {               // int8 numbers times their scales, into tile16
            const unsigned char* src = (const unsigned char*)ring + (tile % STAGES) * SLOT8;
            const unsigned* sc = (const unsigned*)(src + 2 * TILE * HEAD_DIM);
            #pragma unroll
            for (int i = 0; i < 2 * CHUNKS8; ++i) {      // K's chunks, then V's
                const int c = lane + 32 * i, kv = c / (TILE * ROW_VECS8);
                const int r = c / ROW_VECS8 % TILE, v = c % ROW_VECS8;
                const unsigned pair = sc[r * RUNS + v * 16 / 32];
                const float s = kv8_half(kv ? pair >> 16 : pair & 0xffffu);
                kv8_to16<DT>(*(const uint4*)(src + (kv * TILE + r) * HEAD_DIM + v * 16), s,
                             (uint4*)(tile16 + (kv * TILE + r) * ROW + v * 16));
            }
            __syncwarp();
            ks_ = tile16;
        }
        const unsigned short* vs_ = ks_ + TILE * ROW;
        const int t0 = first + tile * stride;

        // 1. S = Q K^T: s0 for tokens 0-7 of the tile, s1 for tokens 8-15 (C fragments).
        float s0[4] = {0.f, 0.f, 0.f, 0.f}, s1[4] = {0.f, 0.f, 0.f, 0.f};
        #pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            unsigned kb[4];   // K[tokens 0-7 | 8-15][16 numbers of head_dim]: B fragments
            ldmatrix_x4(kb, smem_addr(ks_ + lrow * ROW + ks * 16 + lcol));
            mma16816<DT>(s0, qa[ks], kb[0], kb[1]);
            mma16816<DT>(s1, qa[ks], kb[2], kb[3]);
        }
        // 2. Online softmax of head gid over its 4 scores here (tokens 2tig, 2tig+1,
        //    8+2tig, 9+2tig); the quad's 4 threads share the max through two shuffles.
        float s[4] = {s0[0], s0[1], s1[0], s1[1]};
        float mx = m;
        #pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int t = t0 + 2 * tig + (i & 1) + (i >> 1) * 8;
            s[i] = t < t_end ? s[i] * scale_log2 : NEG_INF;
            mx = fmaxf(mx, s[i]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float corr = exp2f(m - mx);
        m = mx;
        float p[4];
        #pragma unroll
        for (int i = 0; i < 4; ++i) p[i] = exp2f(s[i] - mx);
        l = l * corr + (p[0] + p[1]) + (p[2] + p[3]);
        const unsigned pb0 = Num<DT>::pack2(p[0], p[1]), pb1 = Num<DT>::pack2(p[2], p[3]);
        // acc holds heads 2tig and 2tig+1: their corrections come from their quads.
        const float c_lo = __shfl_sync(0xffffffffu, corr, 8 * tig);
        const float c_hi = __shfl_sync(0xffffffffu, corr, 8 * tig + 4);
        // 3. O^T += V^T P^T, 16 numbers of head_dim at a time.
        #pragma unroll
        for (int mt = 0; mt < KSTEPS; ++mt) {
            acc[mt][0] *= c_lo; acc[mt][1] *= c_hi;
            acc[mt][2] *= c_lo; acc[mt][3] *= c_hi;
            unsigned va[4];   // V^T[16 numbers of head_dim][tokens 0-15] as an A fragment
            ldmatrix_x4_trans(va, smem_addr(vs_ + lrow * ROW + mt * 16 + lcol));
            mma16816<DT>(acc[mt], va, pb0, pb1);
        }
    }
#undef TC_LOOKUP
#undef TC_REQUEST
#undef TC_REQUEST8

    // 4. Merge the warps through shared memory (the ring is free once every copy has
    //    landed, so the merge reuses it).
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    cp_async_wait<0>();
    __syncthreads();
    float* sm_o = reinterpret_cast<float*>(smem);   // [NWARPS][8][HEAD_DIM]
    float* sm_m = sm_o + NWARPS * 8 * HEAD_DIM;     // [NWARPS][8]
    float* sm_l = sm_m + NWARPS * 8;                // [NWARPS][8]
    #pragma unroll
    for (int mt = 0; mt < KSTEPS; ++mt) {
        float* o = sm_o + (warp * 8 + 2 * tig) * HEAD_DIM + mt * 16 + gid;
        o[0] = acc[mt][0]; o[HEAD_DIM] = acc[mt][1];
        o[8] = acc[mt][2]; o[HEAD_DIM + 8] = acc[mt][3];
    }
    if (tig == 0) { sm_m[warp * 8 + gid] = m; sm_l[warp * 8 + gid] = l; }
    __syncthreads();
    for (int i = threadIdx.x; i < GROUP * HEAD_DIM; i += NWARPS * 32) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mw = -1e30f;
        #pragma unroll
        for (int w = 0; w < NWARPS; ++w) mw = fmaxf(mw, sm_m[w * 8 + g]);
        float lsum = 0.f, o = 0.f;
        #pragma unroll
        for (int w = 0; w < NWARPS; ++w) {
            const float c = exp2f(sm_m[w * 8 + g] - mw);
            lsum += sm_l[w * 8 + g] * c;
            o += sm_o[(w * 8 + g) * HEAD_DIM + d] * c;
        }
        const float res = lsum > 0.f ? o / lsum : 0.f;
        const long long qrow = (long long)b * q_heads + h * GROUP + g;
        if (num_splits == 1) {
            Num<DT>::store(out, qrow * HEAD_DIM + d, res);
        } else {
            part_o[(qrow * num_splits + split) * HEAD_DIM + d] = res;
            if (d == 0)
                part_lse[qrow * num_splits + split] = lsum > 0.f ? mw + log2f(lsum)
                                                                 : NEG_INF;
        }
    }
}
