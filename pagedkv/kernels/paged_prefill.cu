// =======================================================================================
// Causal prefill attention through page tables, on tensor cores (common.cuh comes first).
//
// A prefill brings many new tokens of a sequence at once (a whole prompt, or a chunk of
// one); their K and V are already in the cache. The token at position p attends to the
// positions 0..p of its own sequence. Running the decode kernel once per new token would
// read the sequence's K/V once per token; here one K/V tile read into shared memory serves
// every new token of a query tile, so K/V are read once per query tile instead.
//
// The work of one (sequence b, kv head h) is a matrix of ROWS-row query tiles: a "row" is
// one (new token, query head of h's group) pair, numbered token-major: row r is token
// r / GROUP, head h * GROUP + r % GROUP. All rows share the group's K and V, so with
// GROUP = 3 a 16-row tensor-core tile holds 5 1/3 tokens and wastes nothing; only the
// sequence's last tile is padded. One CTA (thread block) takes one tile of ROWS = NWARPS *
// MT * 16 rows; warp w owns MT 16-row pieces of it. The CTA walks the sequence's K/V in
// tiles of KV_TILE tokens, from position 0 up to its last row's position, and per tile:
//   1. all threads copy the tile's K and V rows into shared memory with cp.async (a ring of
//      STAGES tiles, so the next tile's copies fly while this one is used);
//   2. each warp computes S = Q K^T for its rows (mma.sync.m16n8k16: A = 16 rows of Q, held
//      in registers all along; B = K^T, 8 keys per mma, from shared memory by ldmatrix);
//   3. masks the keys past each row's position (only in tiles that cross the diagonal),
//      and updates its rows' online softmax (running max m, sum l; p = 2^(s - m), in log2
//      units: the host passes scale * log2(e));
//   4. O += P V: the C fragments of S are exactly the A fragments P needs (rounded to
//      16 bits), B = V, 8 numbers of head_dim per mma, by ldmatrix.trans.
// A warp skips the tiles that lie wholly above its own rows' diagonal, and the CTA never
// reads a tile above its last row's diagonal. At the end each row is divided by its sum.
//
// Fragments (the PTX manual's figures; gid = lane / 4, tig = lane % 4):
//     A[16x16]: a0 = A[gid][2tig, +1]   a1 = A[gid+8][2tig, +1]
//               a2 = A[gid][2tig+8, +9] a3 = A[gid+8][2tig+8, +9]
//     B[16x8]:  b0 = B[2tig, +1][gid]   b1 = B[2tig+8, +9][gid]
//     C[16x8]:  c0, c1 = C[gid][2tig, +1]   c2, c3 = C[gid+8][2tig, +1]
// So each thread holds two rows of every 16-row piece: gid and gid + 8 ("hr" = 0 and 1).
//
// KV8 = 1 (an int8 cache, common.cuh's "8-bit cache"): the ring holds the K/V tiles' int8
// numbers and their scale pairs (half the bytes); once a tile has landed, all threads turn
// it into DT numbers (number * scale, rounded to DT) in one tile of DT numbers, which
// steps 2-4 read as they read the ring's otherwise.
// =======================================================================================

// Which query tile this CTA takes. Sequence b (new tokens query_start[b] ..
// query_start[b+1] - 1) has n_b = ceil(qlen_b * GROUP / ROWS) tiles; the tiles of all
// sequences are numbered one sequence after another, and CTA `id` takes tile `id`. The
// host does not know the lengths (they live on the GPU), so it launches an upper bound of
// CTAs; the spare ones find nothing and return. The 32 lanes of a warp look at 32
// sequences at once and add up their counts with shuffles (a prefix sum). Within a
// sequence the tiles are handed out last first: the last rows attend to the most keys, so
// the longest CTAs start first and the short ones fill the gaps at the end.
template <int GROUP, int ROWS>
__device__ __forceinline__ bool find_tile(const int* __restrict__ query_start, int batch,
                                          int id, int& b, int& tile) {
    const int lane = threadIdx.x % 32;
    int base = 0;                                   // tiles of the sequences before b0
    for (int b0 = 0; b0 < batch; b0 += 32) {
        const int s = b0 + lane;
        const int n = s < batch
            ? ((query_start[s + 1] - query_start[s]) * GROUP + ROWS - 1) / ROWS : 0;
        int incl = n;                               // tiles of sequences b0 .. s
        #pragma unroll
        for (int o = 1; o < 32; o *= 2) {
            const int y = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += y;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (id < base + total) {
            // the first lane whose sequences end past `id` holds it
            const int first = __ffs(__ballot_sync(0xffffffffu, id < base + incl)) - 1;
            b = b0 + first;
            const int end = base + __shfl_sync(0xffffffffu, incl, first);
            tile = end - 1 - id;                    // last tile first
            return true;
        }
        base += total;
    }
    return false;
}

// q [tokens][q_heads][HEAD_DIM] (the new tokens of every sequence, one after another),
// cache [num_blocks][2][BLOCK_SIZE][kv_heads][HEAD_DIM] (both in uint4 = 16-byte chunks),
// block_tables [batch][max_blocks], query_start [batch + 1], seq_lens [batch] (lengths with
// the new tokens), out like q. Grid: (enough CTAs for every tile, kv_heads). Dynamic
// shared memory: STAGES tiles of KV_TILE K rows and KV_TILE V rows.
template <int DT, int HEAD_DIM, int GROUP, int BLOCK_SIZE, int NWARPS, int MT, int KV_TILE,
          int STAGES, int KV8 = 0>
__global__ void __launch_bounds__(NWARPS * 32)
paged_prefill(const uint4* __restrict__ q, const uint4* __restrict__ cache,
              const int* __restrict__ block_tables, const int* __restrict__ query_start,
              const int* __restrict__ seq_lens, void* __restrict__ out, int batch,
              int kv_heads, int max_blocks, float scale_log2) {
    static_assert(DT == 1 || DT == 2, "tensor cores take float16 or bfloat16");
    static_assert(GROUP >= 1 && GROUP <= 8, "1 to 8 query heads per kv head");
    static_assert(KV_TILE % 16 == 0 && STAGES >= 2, "whole 16-key steps, a ring of 2+");
    constexpr int THREADS = NWARPS * 32;
    constexpr int ROWS = NWARPS * MT * 16;        // query rows (token x head) per CTA
    constexpr int ROW_VECS = HEAD_DIM / 8;        // 16-byte chunks in one head row
    constexpr int ROW = HEAD_DIM + 8;             // a shared-memory row, 16 bytes padded
    constexpr int KSTEPS = HEAD_DIM / 16;         // 16-wide steps along head_dim
    constexpr int NT = KV_TILE / 8;               // 8-key column tiles of S
    constexpr int DN = HEAD_DIM / 8;              // 8-number column tiles of O
    constexpr int CHUNKS = KV_TILE * ROW_VECS / THREADS;   // copies per thread: K (and V)
    constexpr int STAGE_ELEMS = 2 * KV_TILE * ROW;         // K rows then V rows
    static_assert(CHUNKS * THREADS == KV_TILE * ROW_VECS, "whole copies per thread");
    static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "head_dim 64 or 128");
    constexpr int TILE_BLOCKS = KV_TILE >= BLOCK_SIZE ? KV_TILE / BLOCK_SIZE : 1;
    static_assert(KV_TILE % BLOCK_SIZE == 0 || BLOCK_SIZE % KV_TILE == 0, "tiles and blocks "
                  "nest");
    static_assert(TILE_BLOCKS <= 32, "one lane per block of a tile");
    // KV8: a ring slot is the tile's int8 K rows, V rows, then each key's scale pairs
    constexpr int ROW_VECS8 = HEAD_DIM / 16;      // 16-byte chunks in one int8 row
    constexpr int RUNS = HEAD_DIM / 32;           // scale pairs (4 bytes) of a row
    constexpr int CHUNKS8 = KV_TILE * ROW_VECS8 / THREADS;
    constexpr int PAIRS8 = (KV_TILE * RUNS + THREADS - 1) / THREADS;   // pairs a thread copies
    constexpr int SLOT8 = 2 * KV_TILE * HEAD_DIM + KV_TILE * RUNS * 4;   // bytes
    static_assert(!KV8 || CHUNKS8 * THREADS == KV_TILE * ROW_VECS8, "whole copies per thread");
    extern __shared__ __align__(16) unsigned short smem[];
    unsigned short* tile16 = smem + STAGES * SLOT8 / 2;     // KV8: the DT tile

    int b, tile;
    if (!find_tile<GROUP, ROWS>(query_start, batch, blockIdx.x, b, tile)) return;
    const int h = blockIdx.y, q_heads = kv_heads * GROUP;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int gid = lane / 4, tig = lane % 4;
    const int q0 = query_start[b], nrows = (query_start[b + 1] - q0) * GROUP;
    const int start = seq_lens[b] - (query_start[b + 1] - q0);   // first new position
    const int row0 = tile * ROWS;
    // The CTA reads keys 0 .. its last row's position; this warp needs keys 0 .. hi and,
    // below lo (its first row's position), no mask. A warp past the last row has nothing.
    const int kv_end = start + (min(row0 + ROWS, nrows) - 1) / GROUP + 1;
    const int wrow0 = row0 + warp * MT * 16;
    const int lo = start + wrow0 / GROUP;
    const int hi = wrow0 < nrows ? start + (min(wrow0 + MT * 16, nrows) - 1) / GROUP : -1;
    const int n_tiles = (kv_end + KV_TILE - 1) / KV_TILE;

    // This thread's rows: gid and gid + 8 of each 16-row piece. Row r is token r / GROUP of
    // the sequence, query head h * GROUP + r % GROUP. A padding row (past the last) takes
    // the last row's place: it is computed with a zero Q and never stored.
    auto row_at = [&](int mt, int hr, long long& first, int& p) -> bool {
        const int r = wrow0 + mt * 16 + gid + 8 * hr;
        const int rc = min(r, nrows - 1), token = rc / GROUP;
        first = ((long long)(q0 + token) * q_heads + h * GROUP + rc % GROUP) * HEAD_DIM;
        p = start + token;
        return r < nrows;
    };
    int pos[MT][2];
    // Q as A fragments, per 16-wide step of head_dim (two 16-bit numbers per register).
    unsigned qa[MT][KSTEPS][4];
    {
        const unsigned* q32 = reinterpret_cast<const unsigned*>(q);
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                long long first;
                const bool real = row_at(mt, hr, first, pos[mt][hr]);
                const long long w = first / 2;
                #pragma unroll
                for (int ks = 0; ks < KSTEPS; ++ks) {
                    qa[mt][ks][hr] = real ? q32[w + ks * 8 + tig] : 0u;
                    qa[mt][ks][2 + hr] = real ? q32[w + ks * 8 + 4 + tig] : 0u;
                }
            }
        }
    }

    // Running softmax of each row (m in log2 units; l: this thread's share of the sum)
    // and O: o[mt][n] holds O[rows gid, gid + 8][8n + 2tig, +1] as a C fragment.
    float m[MT][2], l[MT][2], o[MT][DN][4];
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        m[mt][0] = m[mt][1] = -1e30f;             // finite: 2^(m - m_new) is never NaN
        l[mt][0] = l[mt][1] = 0.f;
        #pragma unroll
        for (int n = 0; n < DN; ++n)
            o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    }

    const int* table = block_tables + (long long)b * max_blocks;
    const long long row_stride = (long long)kv_heads * (KV8 ? ROW_VECS8 : ROW_VECS);  // uint4s
    const uint4* head = cache + h * (KV8 ? ROW_VECS8 : ROW_VECS);  // kv head h in row 0
    const long long block_vecs = KV8 ? kv8_block_bytes(BLOCK_SIZE, kv_heads, HEAD_DIM) / 16
                                     : 2LL * BLOCK_SIZE * row_stride;   // block to block
    // KV8: the scale pairs of kv head h, row 0 of block 0 (bytes), and from row to row
    const char* pairs = (const char*)cache
                        + kv8_pair_at(0, h, 0, BLOCK_SIZE, kv_heads, HEAD_DIM);
    const long long pair_row = (long long)kv_heads * RUNS * 4;
    // Copy c = threadIdx.x + THREADS * ci of a tile is chunk c % ROW_VECS of key c / ROW_VECS.
    // A tile spans TILE_BLOCKS blocks of the page table; lane j of every warp looks up the
    // j-th of the next tile to request, one tile ahead, so that the table's answer arrives
    // while the tensor cores work; a thread then asks the lane that holds its key's block.
    int blk;
#define PF_LOOKUP(tile_)                                                                 \
    {                                                                                    \
        const int lb = (tile_) * KV_TILE / BLOCK_SIZE + lane;   /* a logical block */    \
        blk = ((tile_) < n_tiles && lane < TILE_BLOCKS && lb * BLOCK_SIZE < kv_end)      \
            ? table[lb] : 0;                                                             \
    }
    // Copy the K and V rows of a tile into ring slot tile % STAGES; keys at or past kv_end
    // become zeros (they are masked, and a NaN in a slot nobody wrote never gets in).
#define PF_REQUEST(tile_)                                                                \
    if (KV8) { PF_REQUEST8(tile_) } else                                                 \
    if ((tile_) < n_tiles) {                                                             \
        unsigned short* dst = smem + ((tile_) % STAGES) * STAGE_ELEMS;                   \
        _Pragma("unroll") for (int ci = 0; ci < CHUNKS; ++ci) {                          \
            const int c = threadIdx.x + THREADS * ci, r = c / ROW_VECS, v = c % ROW_VECS; \
            const int t = (tile_) * KV_TILE + r;                                         \
            const bool ok = t < kv_end;                                                  \
            const int bk = __shfl_sync(0xffffffffu, blk,                                 \
                                       ((tile_) * KV_TILE % BLOCK_SIZE + r) / BLOCK_SIZE); \
            const uint4* src = head + (long long)bk * block_vecs                         \
                               + (t % BLOCK_SIZE) * row_stride + v;                      \
            cp_async16(dst + r * ROW + v * 8, ok ? src : cache, ok);                     \
            cp_async16(dst + (KV_TILE + r) * ROW + v * 8,                                \
                       ok ? src + BLOCK_SIZE * row_stride : cache, ok);                  \
        }                                                                                \
    }                                                                                    \
    cp_async_commit();   /* one group per tile, empty past the end: the count is right */
    // KV8: the same rows as int8 (16 numbers a copy), and their scale pairs (4 bytes a
    // copy: pair c is run c % RUNS of key c / RUNS).
#define PF_REQUEST8(tile_)                                                               \
    if ((tile_) < n_tiles) {                                                             \
        unsigned char* dst = (unsigned char*)smem + ((tile_) % STAGES) * SLOT8;          \
        _Pragma("unroll") for (int ci = 0; ci < CHUNKS8; ++ci) {                         \
            const int c = threadIdx.x + THREADS * ci, r = c / ROW_VECS8, v = c % ROW_VECS8; \
            const int t = (tile_) * KV_TILE + r;                                         \
            const bool ok = t < kv_end;                                                  \
            const int bk = __shfl_sync(0xffffffffu, blk,                                 \
                                       ((tile_) * KV_TILE % BLOCK_SIZE + r) / BLOCK_SIZE); \
            const uint4* src = head + (long long)bk * block_vecs                         \
                               + (t % BLOCK_SIZE) * row_stride + v;                      \
            cp_async16(dst + r * HEAD_DIM + v * 16, ok ? src : cache, ok);               \
            cp_async16(dst + (KV_TILE + r) * HEAD_DIM + v * 16,                          \
                       ok ? src + BLOCK_SIZE * row_stride : cache, ok);                  \
        }                                                                                \
        _Pragma("unroll") for (int ci = 0; ci < PAIRS8; ++ci) {                          \
            const int c = threadIdx.x + THREADS * ci, g = c % RUNS;                      \
            const int r = min(c / RUNS, KV_TILE - 1);   /* (every lane shuffles) */      \
            const int t = (tile_) * KV_TILE + r;                                         \
            const bool ok = t < kv_end;                                                  \
            const int bk = __shfl_sync(0xffffffffu, blk,                                 \
                                       ((tile_) * KV_TILE % BLOCK_SIZE + r) / BLOCK_SIZE); \
            const char* src = pairs + (long long)bk * block_vecs * 16                    \
                              + (t % BLOCK_SIZE) * pair_row + 4 * g;                     \
            if (c < KV_TILE * RUNS)                                                      \
                cp_async4(dst + 2 * KV_TILE * HEAD_DIM + 4 * c,                          \
                          ok ? src : (const char*)cache, ok);                            \
        }                                                                                \
    }

    PF_LOOKUP(0)
    #pragma unroll
    for (int st = 0; st < STAGES - 1; ++st) { PF_REQUEST(st) PF_LOOKUP(st + 1) }

    // ldmatrix addresses: lane points at row lrow, column lcol of a 16x16 piece, so the
    // four 8x8 matrices are (rows 0-7, cols 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15).
    const int lrow = (lane & 7) + ((lane >> 4) << 3), lcol = ((lane >> 3) & 1) * 8;

    for (int kt = 0; kt < n_tiles; ++kt) {
        cp_async_wait<STAGES - 2>();       // my copies of tile kt have landed ...
        __syncthreads();                   // ... everyone's too, and all are done with kt - 1
        PF_REQUEST(kt + STAGES - 1)        // into the slot kt - 1 used
        PF_LOOKUP(kt + STAGES)
        const unsigned short* ks_ = smem + (kt % STAGES) * STAGE_ELEMS;
        if constexpr (KV8) {               // int8 numbers times their scales, into tile16
            const unsigned char* src = (const unsigned char*)smem + (kt % STAGES) * SLOT8;
            const unsigned* sc = (const unsigned*)(src + 2 * KV_TILE * HEAD_DIM);
            #pragma unroll
            for (int ci = 0; ci < 2 * CHUNKS8; ++ci) {   // K's chunks, then V's
                const int c = threadIdx.x + THREADS * ci, kv = c / (KV_TILE * ROW_VECS8);
                const int r = c / ROW_VECS8 % KV_TILE, v = c % ROW_VECS8;
                const unsigned pair = sc[r * RUNS + v * 16 / 32];
                const float sv = kv8_half(kv ? pair >> 16 : pair & 0xffffu);
                kv8_to16<DT>(*(const uint4*)(src + (kv * KV_TILE + r) * HEAD_DIM + v * 16),
                             sv, (uint4*)(tile16 + (kv * KV_TILE + r) * ROW + v * 16));
            }
            __syncthreads();               // the whole tile is DT numbers now
            ks_ = tile16;
        }
        const int t0 = kt * KV_TILE;
        if (t0 > hi) continue;             // wholly above this warp's diagonal
        const unsigned short* vs_ = ks_ + KV_TILE * ROW;

        // 2. S = Q K^T: s[mt][j] holds keys 8j .. 8j + 7 of the tile (C fragments).
        float s[MT][NT][4];
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt)
            #pragma unroll
            for (int j = 0; j < NT; ++j)
                s[mt][j][0] = s[mt][j][1] = s[mt][j][2] = s[mt][j][3] = 0.f;
        #pragma unroll
        for (int ks = 0; ks < KSTEPS; ++ks) {
            #pragma unroll
            for (int j2 = 0; j2 < NT / 2; ++j2) {
                unsigned kb[4];   // K[keys 16j2 + 0-7 | 8-15][16 numbers of head_dim]
                ldmatrix_x4(kb, smem_addr(ks_ + (16 * j2 + lrow) * ROW + ks * 16 + lcol));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<DT>(s[mt][2 * j2], qa[mt][ks], kb[0], kb[1]);
                    mma16816<DT>(s[mt][2 * j2 + 1], qa[mt][ks], kb[2], kb[3]);
                }
            }
        }
        // 3. Causal mask and online softmax, row by row. Key t0 + 8j + 2tig + e sits in
        //    s[mt][j][2hr + e]; the 4 threads of a quad share a row's max by two shuffles.
        //    The max is taken of the raw scores (the scale is positive) and the scale folded
        //    into p = 2^(s * scale_log2 - m), one fused multiply-add per score.
        const bool diagonal = t0 + KV_TILE - 1 > lo;   // some key here is past some row
        #pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            #pragma unroll
            for (int hr = 0; hr < 2; ++hr) {
                float raw = NEG_INF;
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        if (diagonal && t0 + 8 * j + 2 * tig + e > pos[mt][hr])
                            s[mt][j][2 * hr + e] = NEG_INF;
                        raw = fmaxf(raw, s[mt][j][2 * hr + e]);
                    }
                }
                raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 1));
                raw = fmaxf(raw, __shfl_xor_sync(0xffffffffu, raw, 2));
                const float mx = fmaxf(m[mt][hr], raw * scale_log2);   // log2 units
                const float corr = exp2f(m[mt][hr] - mx);
                m[mt][hr] = mx;
                float sum = 0.f;
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(fmaf(s[mt][j][2 * hr + e], scale_log2, -mx));
                        s[mt][j][2 * hr + e] = p;
                        sum += p;
                    }
                }
                l[mt][hr] = l[mt][hr] * corr + sum;
                #pragma unroll
                for (int n = 0; n < DN; ++n) {
                    o[mt][n][2 * hr] *= corr;
                    o[mt][n][2 * hr + 1] *= corr;
                }
            }
        }
        // 4. O += P V, 16 keys at a time: P's A fragment for keys 16kk .. 16kk + 15 is
        //    made of S's C fragments j = 2kk and 2kk + 1, rounded to 16-bit numbers.
        #pragma unroll
        for (int kk = 0; kk < NT / 2; ++kk) {
            unsigned pa[MT][4];
            #pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                pa[mt][0] = Num<DT>::pack2(s[mt][2 * kk][0], s[mt][2 * kk][1]);
                pa[mt][1] = Num<DT>::pack2(s[mt][2 * kk][2], s[mt][2 * kk][3]);
                pa[mt][2] = Num<DT>::pack2(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
                pa[mt][3] = Num<DT>::pack2(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
            }
            #pragma unroll
            for (int dn = 0; dn < KSTEPS; ++dn) {
                // V[keys 16kk + 0-15][numbers 16dn + 0-15], transposed into B fragments:
                // vb[0], vb[2] for numbers 16dn + 0-7, vb[1], vb[3] for 16dn + 8-15.
                unsigned vb[4];
                ldmatrix_x4_trans(vb, smem_addr(vs_ + (16 * kk + lrow) * ROW + dn * 16
                                                + lcol));
                #pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma16816<DT>(o[mt][2 * dn], pa[mt], vb[0], vb[2]);
                    mma16816<DT>(o[mt][2 * dn + 1], pa[mt], vb[1], vb[3]);
                }
            }
        }
    }
#undef PF_LOOKUP
#undef PF_REQUEST
#undef PF_REQUEST8

    // 5. Each row's sum over its quad, then O / l, two 16-bit numbers per store.
    unsigned* out32 = reinterpret_cast<unsigned*>(out);
    #pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        #pragma unroll
        for (int hr = 0; hr < 2; ++hr) {
            float sum = l[mt][hr];
            sum += __shfl_xor_sync(0xffffffffu, sum, 1);
            sum += __shfl_xor_sync(0xffffffffu, sum, 2);
            const float inv = sum > 0.f ? 1.f / sum : 0.f;
            long long first;
            int p;
            if (row_at(mt, hr, first, p)) {
                const long long w = first / 2;
                #pragma unroll
                for (int n = 0; n < DN; ++n)
                    out32[w + 4 * n + tig] = Num<DT>::pack2(o[mt][n][2 * hr] * inv,
                                                            o[mt][n][2 * hr + 1] * inv);
            }
        }
    }
}
