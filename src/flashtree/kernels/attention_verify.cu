// A tree verify's attention over TQ3_0 K and V rows (up to 192 query rows a KV head: 23 tokens x 6 heads is 138),
// flash attention on Hopper's warpgroup MMA (wgmma, sm_90a), warp-specialized: grid (KV heads x slices of query rows,
// splits of the visible rows), one CTA an SM of three warpgroups. Warpgroup 0, the producer (64 registers a thread
// after setmaxnreg), streams the split's raw rows into shared memory 64 at a time (cp.async, two chunks ahead) and
// decodes each chunk's K and V sides to float16 into a ring of three decoded sides, each once for all the slice's
// query rows. Warpgroups 1 and 2, the consumers (216 registers), own 64 query rows each (head-major: row m of the
// group is head m / T, token m % T) and, where the group has more than 128, share a 16-row tail on mma.sync (a slice
// of 144 rows: 23 tokens in one CTA). Named barriers hand each side over (full: the producer arrives, the consumers
// wait) and back (empty: the other way), so that the decode runs while the tensor cores work. The tensor cores read
// the query rows, K and V from shared memory themselves (one read a warpgroup, not one a warp as ldmatrix feeds
// mma.sync), S = Q K^T lands in registers, P goes back in as the A side of O += P V. The tail's warps each take 8 K
// rows of its scores and 32 values of its outputs; its row maxima meet in shared memory and its P goes through it.
// Each consumer writes its rows' partial output and log-sum-exp in tree_attention.py's layout, which its combine
// launch merges (rotating TQ3_0 values back, applying the gate).
//
// Why: Triton's verify over long TQ3_0 caches took a 128-row tile and a 10-row tail tile, each decoding every K/V
// row in registers (967 us over 262K rows a layer on an H100, 16 attention layers in the 27B: verify-22 2.08x the 1K
// step against issue #20's 1.3x); a first CUDA C form on mma.sync, a warp a 16 query rows, took 803 us, bound by its
// ldmatrix reads (each warp read every decoded K and V row for its 16 rows). Without the producer (every warp
// decoding between its MMAs, the thirty-fourth session's first form) the same loop took 498.5 us where this takes
// 439.8 (23 tokens over 262K rows, H100): there the decode and the MMAs took turns in the same warps.
//
// The math is attention_decode.cu's: values as float16 pairs (norm * level), the query clamped to +-65280 and
// rounded to float16, scores in float32 (times scale * log2 e), base-2 online softmax in float32, P rounded to
// float16 for the P V products, float32 accumulators. The mask is the tree's (`graphed_mask`): row r < start is
// committed, row start + j is new token j, seen by query token i iff visible[i][j]; no window.
//
// The float16 tiles in shared memory are in wgmma's no-swizzle core matrices (8 rows x 16 bytes, 128 contiguous
// bytes): value (row, d) of a tile of R rows at byte (d / 8) * 16 R + 16 row + 2 (d % 8), so that a warp's 16-byte
// stores of 32 consecutive rows are contiguous.

constexpr int VCHUNK = 64;       // K/V rows decoded and attended at a time
constexpr int WG_ROWS = 128;     // query rows of a CTA's two consumer warpgroups (64 each)
constexpr int TAIL_ROWS = 16;    // query rows past them in a CTA with a tail: one mma.sync tile the 8 warps share
constexpr int STAGES = 2;        // raw chunks in shared memory: the next one's copies land while one is decoded
constexpr int MAX_SLOTS = 3;     // decoded sides (K or V chunks) in a ring: the producer decodes one or two ahead
constexpr int PRODUCERS = 128;   // warpgroup 0: copies and decodes
constexpr int CONSUMERS = 256;   // warpgroups 1, 2: the MMAs and the softmax
constexpr int THREADS = PRODUCERS + CONSUMERS;
constexpr int CONSUMER_WARPS = CONSUMERS / 32;
constexpr int PRODUCER_REGS = 64, CONSUMER_REGS = 216;  // setmaxnreg: 128 x 64 + 256 x 216 <= 384 x 168
constexpr int P_PITCH = VCHUNK * 2 + 16;  // bytes a tail row of P: 16 past a multiple of 128, ldmatrix's 8 rows in
                                          // distinct banks
// named barriers (0: __syncthreads): the producers' own, the consumers' own, then a slot's full and empty ones
constexpr int BAR_PRODUCERS = 1, BAR_CONSUMERS = 2, BAR_FULL = 3, BAR_EMPTY = BAR_FULL + MAX_SLOTS;

// Shared memory: raw K and V chunks (STAGES), the ring of decoded sides, the query rows; with a tail, its P and the
// warps' row maxima (then sums). Q8_0's raw chunks (2.4x TQ3_0's) leave room for two decoded sides, not three: the
// producer decodes one side ahead.
template <int D, bool TAIL, int KIND>
struct VerifySmem {
    static constexpr int SLICE = WG_ROWS + (TAIL ? TAIL_ROWS : 0);  // query rows a CTA
    static constexpr int SLOTS = KIND == KIND_Q8 ? 2 : MAX_SLOTS;
    static constexpr int ROW_BYTES = D / 32 * KIND_BLOCK_BYTES<KIND>;
    static constexpr int RAW = VCHUNK * ROW_BYTES;          // one side's raw chunk
    static constexpr int SIDE = VCHUNK * D * 2;             // bytes of one side's decoded chunk
    static constexpr int RING = STAGES * 2 * RAW;           // byte offsets
    static constexpr int QUERIES = RING + SLOTS * SIDE;
    static constexpr int TAIL_P = QUERIES + SLICE * D * 2;
    static constexpr int RED = TAIL_P + (TAIL ? TAIL_ROWS * P_PITCH : 0);
    static constexpr int BYTES = RED + (TAIL ? CONSUMER_WARPS * TAIL_ROWS * 4 : 0);
};

__device__ __forceinline__ void bar_sync(int id, int count) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
template <int REGS>
__device__ __forceinline__ void registers_down() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS)); }
template <int REGS>
__device__ __forceinline__ void registers_up() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS)); }

__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// generic-proxy writes of shared memory (st.shared) made visible to the tensor cores' reads (the async proxy)
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// the compiler may not move reads or writes of these registers across a wgmma issue or wait
template <int COUNT>
__device__ __forceinline__ void keep_floats(float (&r)[COUNT]) {
#pragma unroll
    for (int i = 0; i < COUNT; ++i) asm volatile("" : "+f"(r[i])::"memory");
}

// 2^x on the special function unit, results under 2^-126 flushed to zero (exp2f adds a range check and two
// multiplies a value for them; a softmax weight that small is zero in the float16 P anyway)
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

// A shared-memory matrix descriptor without swizzle: start, the byte distance between core matrices adjacent along
// K (LBO) and along M or N (SBO)
__device__ __forceinline__ unsigned long long descriptor(unsigned address, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((address & 0x3FFFF) >> 4) | ((unsigned long long)(lbo >> 4) << 16)
           | ((unsigned long long)(sbo >> 4) << 32);
}

// S (+)= Q K^T for 64 query rows x 64 K rows x 16 values, both sides from shared memory (K-major)
__device__ __forceinline__ void wgmma_scores(float (&d)[32], unsigned long long a, unsigned long long b,
                                             int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b), "r"(accumulate));
}

// O += P V for 64 query rows x 64 values x 16 K/V rows: P from registers (mma.sync's A fragments, a warp's 16 rows),
// V from shared memory stored row-major (MN-major: transposed by the tensor cores)
__device__ __forceinline__ void wgmma_values(float (&d)[32], const u32 (&a)[4], unsigned long long b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, "
                 "%21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
                   "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),
                   "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),
                   "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),
                   "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}

// Eight consecutive query values as float32: 16-byte loads where `wide` (the row 16-byte aligned), else one at a time
__device__ __forceinline__ void load8(const float* row, float (&v)[8], bool wide) {
    if (wide) {
        const float4 a = reinterpret_cast<const float4*>(row)[0], b = reinterpret_cast<const float4*>(row)[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = row[j];
    }
}
__device__ __forceinline__ void load8(const u16* row, float (&v)[8], bool wide) {  // bf16
    u32 w[4];
    if (wide) {
        const uint4 a = *reinterpret_cast<const uint4*>(row);
        w[0] = a.x, w[1] = a.y, w[2] = a.z, w[3] = a.w;
    } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = (u32)row[2 * j] | ((u32)row[2 * j + 1] << 16);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        v[2 * j] = __uint_as_float(w[j] << 16);
        v[2 * j + 1] = __uint_as_float(w[j] & 0xFFFF0000u);
    }
}

// One side's raw chunk (K or V rows) decoded by threads first, first + step, .. into core matrices, two adjacent
// blocks a thread at a time: a warp takes 8 rows x 4 block pairs (`decode_block_pair`: conflict-free loads), whose
// 16-byte stores fill four whole 128-byte rows of banks.
template <int D, int KIND>
__device__ __forceinline__ void decode_side(const unsigned char* raw, unsigned char* dst_side, u32 table_low,
                                            u32 table_high, int first, int step) {
    static_assert(D == 256, "a warp's 8 rows x 4 block pairs cover whole rows of 8 blocks");
    constexpr int ROW_BYTES = D / 32 * KIND_BLOCK_BYTES<KIND>, ITEMS = VCHUNK * D / 64;
    for (int j = first; j < ITEMS; j += step) {
        const int row = 8 * (j >> 5) + (j & 7), pair = (j & 31) >> 3;
        unsigned char* dst = dst_side + 16 * row;
        const unsigned char* src = raw + row * ROW_BYTES + pair * 2 * KIND_BLOCK_BYTES<KIND>;
        decode_pair<KIND>(src, table_low, table_high, [&](int h, const u32(&out)[16]) {
            const int b = 2 * pair + h;
#pragma unroll
            for (int g = 0; g < 4; ++g)
                *reinterpret_cast<uint4*>(dst + (4 * b + g) * 16 * VCHUNK) =
                    make_uint4(out[4 * g], out[4 * g + 1], out[4 * g + 2], out[4 * g + 3]);
        });
    }
}

// S = Q K^T of a warpgroup's 64 query rows (`q_addr`, in a tile of SLICE rows) over a decoded chunk's K rows
// (`keys`), issued to the tensor cores; the caller waits (wg_wait_all) before it reads `s`: rows a, b of the lane
// (values 0, 1 and 2, 3 of each 4) x K rows 8 j + 2 t (+ 1).
template <int D, int SLICE>
__device__ __forceinline__ void issue_scores(float (&s)[32], unsigned q_addr, unsigned keys) {
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] = 0.0f;
    const unsigned long long q_desc = descriptor(q_addr, 16 * SLICE, 128);
    const unsigned long long k_desc = descriptor(keys, 16 * VCHUNK, 128);
    wg_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk)  // a k step: two core matrices along K (the address field counts 16 bytes)
        wgmma_scores(s, q_desc + 2 * kk * SLICE, k_desc + 2 * kk * VCHUNK, kk > 0);
    wg_commit();
}

// Whether query token `row_vis / T` sees K/V row r: committed rows (< start), the tree's new rows by `vis`, nothing
// at or past the split's end `hi`.
__device__ __forceinline__ bool visible(int r, int hi, int start, int T, const unsigned char* vis, int row_vis) {
    return r < hi && (r < start || vis[row_vis + min(max(r - start, 0), T - 1)] != 0);
}

// The scores of a chunk of rows r0 .. r0 + 63 masked, the online softmax, then O += P V (V at `values`) with P's
// float16 A fragments from the scores' registers, issued to the tensor cores: the caller waits (wg_wait_all, then
// keep_floats on `acc`).
template <int D>
__device__ __forceinline__ void issue_values(float (&s)[32], unsigned values, int r0, int hi, int start, int T,
                                             const unsigned char* vis, int vis_a, int vis_b, float scale_log2,
                                             int v_lbo, int v_sbo, float (&m_run)[2], float (&l_run)[2],
                                             float (&acc)[D / 64][32]) {
    const int t = threadIdx.x & 3;
#pragma unroll
    for (int i = 0; i < 32; ++i) s[i] *= scale_log2;
    if (r0 + VCHUNK > min(start, hi)) {  // new rows or the split's end (uniform over the CTA)
        u32 seen = 0;  // bit 2 j + e: K row 8 j + 2 t + e seen by row a; bit 16 + 2 j + e: by row b (a loop, not 32
                       // inlined tests: the masked path stays small in the instruction cache)
#pragma unroll 1
        for (int bit = 0; bit < 16; ++bit) {
            const int r = r0 + 8 * (bit >> 1) + 2 * t + (bit & 1);
            seen |= (u32)visible(r, hi, start, T, vis, vis_a) << bit | (u32)visible(r, hi, start, T, vis, vis_b)
                                                                           << (16 + bit);
        }
#pragma unroll
        for (int i = 0; i < 32; ++i)  // s[4 j + c]: row c < 2 ? a : b, K row 8 j + 2 t + (c & 1)
            if (!(seen >> ((i & 2 ? 16 : 0) + 2 * (i >> 2) + (i & 1)) & 1)) s[i] = NEG_INF;
    }
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int i = 0; i < 32; ++i) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], s[i]);
    float alpha[2], m_use[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // the row's max over the quad's lanes (t), then the running max
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 2));
        const float m_new = fmaxf(m_run[h], mx[h]);
        m_use[h] = m_new == NEG_INF ? 0.0f : m_new;
        alpha[h] = fast_exp2(m_run[h] - m_use[h]);
        m_run[h] = m_new;
    }
    float sum[2] = {0.0f, 0.0f};
    u32 p[VCHUNK / 16][4];  // A fragments of P, K rows 16 kb .. 16 kb + 15
#pragma unroll
    for (int j = 0; j < VCHUNK / 8; ++j) {
        const float p0 = fast_exp2(s[4 * j] - m_use[0]), p1 = fast_exp2(s[4 * j + 1] - m_use[0]);
        const float p2 = fast_exp2(s[4 * j + 2] - m_use[1]), p3 = fast_exp2(s[4 * j + 3] - m_use[1]);
        sum[0] += p0 + p1;
        sum[1] += p2 + p3;
        p[j >> 1][2 * (j & 1)] = f16x2_of(p0, p1);      // row a, K rows 8 j + 2t, + 1
        p[j >> 1][2 * (j & 1) + 1] = f16x2_of(p2, p3);  // row b
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) l_run[h] = l_run[h] * alpha[h] + sum[h];  // the lane's share; the quad's at the end
    if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f))  // a max rose (times 1: no change)
#pragma unroll
        for (int n = 0; n < D / 64; ++n)
#pragma unroll
            for (int i = 0; i < 32; ++i) acc[n][i] *= alpha[(i >> 1) & 1];
#pragma unroll
    for (int n = 0; n < D / 64; ++n) keep_floats(acc[n]);
    const unsigned long long v_desc = descriptor(values, v_lbo, v_sbo);
    wg_fence();
#pragma unroll
    for (int kb = 0; kb < VCHUNK / 16; ++kb)
#pragma unroll
        for (int n = 0; n < D / 64; ++n)  // K rows 16 kb (256 bytes), values 64 n (8 core matrices of VCHUNK rows)
            wgmma_values(acc[n], p[kb], v_desc + (kb * 256 + n * 8 * 16 * VCHUNK) / 16);
    wg_commit();
}

// The tail: query rows 128 .. 143 of the CTA's slice on mma.sync, shared by the 8 warps. Warp w takes the scores of
// K rows 8 w .. 8 w + 7 (S rows g, g + 8 x K rows 8 w + 2 t, + 1 in `st`) and the outputs of values 32 w .. 32 w + 31
// (rows g, g + 8 x values 32 w + 8 j + 2 t, + 1 in `o`); the row maxima meet in shared memory, P goes through it.
template <int D, int SLICE>
__device__ __forceinline__ void tail_scores(float (&st)[4], unsigned queries, unsigned keys, int warp, int lane) {
    const int mi = lane >> 3;
    // A (ldmatrix x4): the tail's rows (lane & 7) + 8 (mi & 1), values 16 kk + 8 (mi >> 1) ..; B: K rows
    // 8 warp + (lane & 7), values 8 (4 i + mi) .. (k steps 2 i, 2 i + 1)
    const unsigned a_addr = queries + (mi >> 1) * 16 * SLICE + 16 * (WG_ROWS + (lane & 7) + 8 * (mi & 1));
    const unsigned b_addr = keys + mi * 16 * VCHUNK + 16 * (8 * warp + (lane & 7));
    float chains[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    u32 b[2][4], a[2][2][4];  // fragments of k steps 2 i, 2 i + 1, loaded a step ahead of their MMAs
    ldsm_x4(b[0], b_addr);
    ldsm_x4(a[0][0], a_addr);
    ldsm_x4(a[0][1], a_addr + 2 * 16 * SLICE);
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const int now = i & 1, next = now ^ 1;
        if (i + 1 < D / 32) {
            ldsm_x4(b[next], b_addr + 4 * (i + 1) * 16 * VCHUNK);
#pragma unroll
            for (int h = 0; h < 2; ++h) ldsm_x4(a[next][h], a_addr + 2 * (2 * i + 2 + h) * 16 * SLICE);
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) mma(chains[h], a[now][h], b[now][2 * h], b[now][2 * h + 1]);
    }
#pragma unroll
    for (int c = 0; c < 4; ++c) st[c] = chains[0][c] + chains[1][c];
}

// The tail's scores masked, each row's max over the warp's 8 K rows into `red` [warp][16]
__device__ __forceinline__ void tail_maxima(float (&st)[4], int r0, int hi, int start, int T, const unsigned char* vis,
                                            const int (&vis_tail)[2], float scale_log2, int warp, float* red) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
    for (int c = 0; c < 4; ++c) {
        float v = st[c] * scale_log2;
        if (!visible(r0 + 8 * warp + 2 * t + (c & 1), hi, start, T, vis, vis_tail[c >> 1])) v = NEG_INF;
        st[c] = v;
        mx[c >> 1] = fmaxf(mx[c >> 1], v);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 1));
        mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xFFFFFFFFu, mx[h], 2));
        if (t == 0) red[warp * TAIL_ROWS + g + 8 * h] = mx[h];
    }
}

// After the maxima met: the tail's running max, P into `p_rows` (float16, P_PITCH bytes a row), the lane's share of
// the row sums, the outputs rescaled
template <int D>
__device__ __forceinline__ void tail_probabilities(const float (&st)[4], const float* red, unsigned char* p_rows,
                                                   int warp, float (&m_tail)[2], float (&l_tail)[2],
                                                   float (&o)[D / 64][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    float p[4], alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < CONSUMER_WARPS; ++w) mx = fmaxf(mx, red[w * TAIL_ROWS + g + 8 * h]);
        const float m_new = fmaxf(m_tail[h], mx);
        const float m_use = m_new == NEG_INF ? 0.0f : m_new;
        alpha[h] = fast_exp2(m_tail[h] - m_use);
        p[2 * h] = fast_exp2(st[2 * h] - m_use);
        p[2 * h + 1] = fast_exp2(st[2 * h + 1] - m_use);
        l_tail[h] = l_tail[h] * alpha[h] + p[2 * h] + p[2 * h + 1];
        m_tail[h] = m_new;
        *reinterpret_cast<u32*>(p_rows + (g + 8 * h) * P_PITCH + 2 * (8 * warp + 2 * t)) =
            f16x2_of(p[2 * h], p[2 * h + 1]);
    }
#pragma unroll
    for (int j = 0; j < D / 64; ++j) {
        o[j][0] *= alpha[0];
        o[j][1] *= alpha[0];
        o[j][2] *= alpha[1];
        o[j][3] *= alpha[1];
    }
}

// O_tail += P V for the warp's 32 values: A from the tail's P rows, B from V's row-major core matrices (transposed by
// ldmatrix)
template <int D>
__device__ __forceinline__ void tail_values(float (&o)[D / 64][4], unsigned p_rows, unsigned values, int warp,
                                            int lane) {
    const int mi = lane >> 3;
    const unsigned a_addr = p_rows + ((lane & 7) + 8 * (mi & 1)) * P_PITCH + 16 * (mi >> 1);
    // B: K/V rows 16 kb + (lane & 7) + 8 (mi & 1), values 8 (4 warp + 2 jj + (mi >> 1)) ..
    const unsigned b_addr = values + (4 * warp + (mi >> 1)) * 16 * VCHUNK + 16 * ((lane & 7) + 8 * (mi & 1));
    u32 a[2][4], b[2][D / 128][4];  // fragments of K rows 16 kb, loaded a step ahead of their MMAs
    ldsm_x4(a[0], a_addr);
#pragma unroll
    for (int jj = 0; jj < D / 128; ++jj) ldsm_x4_trans(b[0][jj], b_addr + 2 * jj * 16 * VCHUNK);
#pragma unroll
    for (int kb = 0; kb < VCHUNK / 16; ++kb) {
        const int now = kb & 1, next = now ^ 1;
        if (kb + 1 < VCHUNK / 16) {
            ldsm_x4(a[next], a_addr + 32 * (kb + 1));
#pragma unroll
            for (int jj = 0; jj < D / 128; ++jj)
                ldsm_x4_trans(b[next][jj], b_addr + 2 * jj * 16 * VCHUNK + 16 * 16 * (kb + 1));
        }
#pragma unroll
        for (int jj = 0; jj < D / 128; ++jj) {
            mma(o[2 * jj], a[now], b[now][jj][0], b[now][jj][1]);
            mma(o[2 * jj + 1], a[now], b[now][jj][2], b[now][jj][3]);
        }
    }
}

// The consumer warpgroups: chunk k's scores once its K side is in, its P V once its V side is; each side released
// to the producer when every consumer is done with it
template <int D, bool TAIL, int KIND>
__device__ __forceinline__ void consume(unsigned char* shared, const unsigned char* __restrict__ vis,
                                        float* __restrict__ part, float* __restrict__ lse, int T, int heads, int group,
                                        int kvh, int split, int rows, int m0, int start, int lo, int hi, int chunks,
                                        float scale_log2, int v_lbo, int v_sbo) {
    typedef VerifySmem<D, TAIL, KIND> S;
    constexpr int SLICE = S::SLICE, SLOTS = S::SLOTS;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x - PRODUCERS) >> 5, g = lane >> 2, t = lane & 3;
    const unsigned queries = smem(shared + S::QUERIES), ring = smem(shared + S::RING);
    unsigned char* p_rows = shared + S::TAIL_P;
    float* red = reinterpret_cast<float*>(shared + S::RED);

    // this lane's rows of its warpgroup's MMA tiles: a = m0 + 64 wg + 16 (warp % 4) + g, b = a + 8 (their heads and
    // tokens worked out again where needed); a warpgroup whose 64 rows are all past the group's multiplies zeros (a
    // wgmma's issue and wait in paths a branch divides: ptxas serializes every wgmma)
    const int m_a = m0 + 16 * warp + g;
    const int vis_a = m_a < rows ? m_a % T * T : 0, vis_b = m_a + 8 < rows ? (m_a + 8) % T * T : 0;
    const bool tail_live = TAIL && m0 + WG_ROWS < rows;  // uniform over the CTA
    const int m_tail = m0 + WG_ROWS + g;  // the lane's tail rows: m_tail, m_tail + 8
    const int vis_tail[2] = {m_tail < rows ? m_tail % T * T : 0, m_tail + 8 < rows ? (m_tail + 8) % T * T : 0};
    const unsigned q_addr = queries + 64 * 16 * (warp >> 2);  // this warpgroup's 64 rows

    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};
    float acc[D / 64][32];  // O: rows a (values 0, 1 of each 4), b (2, 3) x dims 64 n + 8 j + 2 t (+ 1)
#pragma unroll
    for (int n = 0; n < D / 64; ++n)
#pragma unroll
        for (int i = 0; i < 32; ++i) acc[n][i] = 0.0f;
    float m_tl[2] = {NEG_INF, NEG_INF}, l_tl[2] = {0.0f, 0.0f};
    float o_tail[D / 64][4];  // the tail's outputs: rows g, g + 8 x values 32 warp + 8 j + 2 t (+ 1)
#pragma unroll
    for (int j = 0; j < D / 64; ++j) o_tail[j][0] = o_tail[j][1] = o_tail[j][2] = o_tail[j][3] = 0.0f;

    for (int k = 0; k < chunks; ++k) {
        const int key_slot = 2 * k % SLOTS, value_slot = (2 * k + 1) % SLOTS;
        const unsigned keys = ring + key_slot * S::SIDE, values = ring + value_slot * S::SIDE;
        bar_sync(BAR_FULL + key_slot, THREADS);
        float s[32];
        issue_scores<D, SLICE>(s, q_addr, keys);
        float st[4];
        if constexpr (TAIL) {
            if (tail_live) {
                tail_scores<D, SLICE>(st, queries, keys, warp, lane);
                tail_maxima(st, lo + k * VCHUNK, hi, start, T, vis, vis_tail, scale_log2, warp, red);
            }
        }
        wg_wait_all();
        keep_floats(s);
        if (2 * k + SLOTS < 2 * chunks) bar_arrive(BAR_EMPTY + key_slot, THREADS);
        if constexpr (TAIL) {
            if (tail_live) {
                bar_sync(BAR_CONSUMERS, CONSUMERS);  // the maxima met
                tail_probabilities<D>(st, red, p_rows, warp, m_tl, l_tl, o_tail);
            }
        }
        bar_sync(BAR_FULL + value_slot, THREADS);
        issue_values<D>(s, values, lo + k * VCHUNK, hi, start, T, vis, vis_a, vis_b, scale_log2, v_lbo, v_sbo,
                        m_run, l_run, acc);
        if constexpr (TAIL) {
            if (tail_live) {
                bar_sync(BAR_CONSUMERS, CONSUMERS);  // the tail's P written
                tail_values<D>(o_tail, smem(p_rows), values, warp, lane);
            }
        }
        wg_wait_all();
#pragma unroll
        for (int n = 0; n < D / 64; ++n) keep_floats(acc[n]);
        if (2 * k + 1 + SLOTS < 2 * chunks) bar_arrive(BAR_EMPTY + value_slot, THREADS);
    }

    // the quad's sums, then rows a and b normalized into part [splits, heads, T, D] and lse [splits, heads, T]
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 1);
        l_run[h] += __shfl_xor_sync(0xFFFFFFFFu, l_run[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int m = m_a + 8 * h;
        if (m >= rows) continue;
        const long row = ((long)split * heads + kvh * group + m / T) * T + m % T;
        const float inv = l_run[h] > 0.0f ? 1.0f / l_run[h] : 0.0f;
        float2* out = reinterpret_cast<float2*>(part + row * D + 2 * t);
#pragma unroll
        for (int n = 0; n < D / 64; ++n)
#pragma unroll
            for (int j = 0; j < 8; ++j)
                out[32 * n + 4 * j] = make_float2(acc[n][4 * j + 2 * h] * inv, acc[n][4 * j + 2 * h + 1] * inv);
        if (t == 0) lse[row] = l_run[h] > 0.0f ? m_run[h] + log2f(l_run[h]) : NEG_INF;
    }
    if constexpr (TAIL) {
        if (tail_live) {  // the rows' sums over the quads and the warps
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                l_tl[h] += __shfl_xor_sync(0xFFFFFFFFu, l_tl[h], 1);
                l_tl[h] += __shfl_xor_sync(0xFFFFFFFFu, l_tl[h], 2);
            }
            bar_sync(BAR_CONSUMERS, CONSUMERS);  // every warp done reading the maxima
#pragma unroll
            for (int h = 0; h < 2; ++h)
                if (t == 0) red[warp * TAIL_ROWS + g + 8 * h] = l_tl[h];
            bar_sync(BAR_CONSUMERS, CONSUMERS);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int m = m_tail + 8 * h;
                if (m >= rows) continue;
                float l = 0.0f;
#pragma unroll
                for (int w = 0; w < CONSUMER_WARPS; ++w) l += red[w * TAIL_ROWS + g + 8 * h];
                const long row = ((long)split * heads + kvh * group + m / T) * T + m % T;
                const float inv = l > 0.0f ? 1.0f / l : 0.0f;
                float2* out = reinterpret_cast<float2*>(part + row * D + 32 * warp + 2 * t);
#pragma unroll
                for (int j = 0; j < D / 64; ++j)
                    out[4 * j] = make_float2(o_tail[j][2 * h] * inv, o_tail[j][2 * h + 1] * inv);
                if (warp == 0 && t == 0) lse[row] = l > 0.0f ? m_tl[h] + log2f(l) : NEG_INF;
            }
        }
    }
}

// The producer warpgroup: the split's raw chunks into shared memory (cp.async, two ahead), each decoded side (K_k,
// V_k: side 2 k, 2 k + 1) into ring slot side % SLOTS once the consumers released the side it held
template <int D, bool TAIL, int KIND>
__device__ __forceinline__ void produce(unsigned char* shared, const unsigned char* k_base,
                                        const unsigned char* v_base, int stride_kr, int stride_vr, int lo, int hi,
                                        int chunks, u32 table_low, u32 table_high) {
    typedef VerifySmem<D, TAIL, KIND> S;
    constexpr int SLOTS = S::SLOTS;
    const int tid = threadIdx.x;  // 0 .. PRODUCERS - 1
    for (int k = 0; k < STAGES; ++k) {
        if (k < chunks)
            copy_kv_rows<S::ROW_BYTES, VCHUNK, PRODUCERS>(shared + k * 2 * S::RAW, k_base, v_base, stride_kr,
                                                          stride_vr, lo + k * VCHUNK, hi, tid);
        commit();
    }
    for (int k = 0; k < chunks; ++k) {
        wait_copies<STAGES - 1>();  // chunk k's rows (this thread's copies), then everyone's
        bar_sync(BAR_PRODUCERS, PRODUCERS);
        const unsigned char* raw = shared + k % STAGES * 2 * S::RAW;
#pragma unroll
        for (int side = 0; side < 2; ++side) {
            const int j = 2 * k + side, slot = j % SLOTS;
            if (j >= SLOTS) bar_sync(BAR_EMPTY + slot, THREADS);  // side j - SLOTS taken by every consumer
            decode_side<D, KIND>(raw + side * S::RAW, shared + S::RING + slot * S::SIDE, table_low, table_high, tid,
                           PRODUCERS);
            fence_proxy_async();  // the decoded side, for the tensor cores
            bar_arrive(BAR_FULL + slot, THREADS);
        }
        bar_sync(BAR_PRODUCERS, PRODUCERS);  // every producer done with chunk k's stage
        if (k + STAGES < chunks)
            copy_kv_rows<S::ROW_BYTES, VCHUNK, PRODUCERS>(shared + k % STAGES * 2 * S::RAW, k_base, v_base,
                                                          stride_kr, stride_vr, lo + (k + STAGES) * VCHUNK, hi, tid);
        commit();
    }
    wait_copies<0>();
}

template <int D, bool TAIL, int KIND, typename QT>
__device__ __forceinline__ void quant_verify(const QT* __restrict__ q, const unsigned char* __restrict__ k_cache,
                                           const unsigned char* __restrict__ v_cache,
                                           const long long* __restrict__ start_t, const unsigned char* __restrict__ vis,
                                           float* __restrict__ part, float* __restrict__ lse, int stride_qh,
                                           int stride_qt, int stride_kh, int stride_kr, int stride_vh, int stride_vr,
                                           int T, int kv_end, int heads, int group, float scale_log2, u32 table_low,
                                           u32 table_high, int v_lbo, int v_sbo) {
    typedef VerifySmem<D, TAIL, KIND> S;
    constexpr int SLICE = S::SLICE;
    extern __shared__ __align__(128) unsigned char shared[];
    const int kv_heads = heads / group, kvh = blockIdx.x % kv_heads, slice = blockIdx.x / kv_heads;
    const int split = blockIdx.y, splits = gridDim.y;
    unsigned char* queries = shared + S::QUERIES;
    wait_for_predecessors();

    const int rows = group * T, m0 = SLICE * slice;  // the slice's rows [m0, m0 + SLICE) of the group's
    {   // the slice's query rows into core matrices as float16, lanes along rows (zeros past the group's rows); 16-byte
        // loads where the rows allow (the loads' latency is most of this prologue)
        const bool wide = (reinterpret_cast<unsigned long long>(q) | (unsigned long long)stride_qh * sizeof(QT)
                           | (unsigned long long)stride_qt * sizeof(QT)) % 16 == 0;
#pragma unroll 4
        for (int i = threadIdx.x; i < SLICE * D / 8; i += blockDim.x) {
            const int r = i % SLICE, dg = i / SLICE, m = m0 + r;
            float v[8];
            if (m < rows)
                load8(q + (long)(kvh * group + m / T) * stride_qh + (long)(m % T) * stride_qt + 8 * dg, v, wide);
            u32 pairs[4];
#pragma unroll
            for (int j = 0; j < 4; ++j)
                pairs[j] = m < rows ? f16x2_of(fminf(fmaxf(v[2 * j], -65280.0f), 65280.0f),
                                               fminf(fmaxf(v[2 * j + 1], -65280.0f), 65280.0f))
                                    : 0u;
            *reinterpret_cast<uint4*>(queries + dg * 16 * SLICE + 16 * r) =
                make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
        }
    }
    fence_proxy_async();
    __syncthreads();

    const int start = (int)start_t[0];
    const int end = min(start + T, kv_end);
    const int per_split = (((end + splits - 1) / splits) + VCHUNK - 1) / VCHUNK * VCHUNK;
    const int lo = split * per_split, hi = min(lo + per_split, end);
    const int chunks = hi > lo ? (hi - lo + VCHUNK - 1) / VCHUNK : 0;
    if (threadIdx.x < PRODUCERS) {
        registers_down<PRODUCER_REGS>();
        produce<D, TAIL, KIND>(shared, k_cache + (long)kvh * stride_kh, v_cache + (long)kvh * stride_vh, stride_kr,
                         stride_vr, lo, hi, chunks, table_low, table_high);
        return;
    }
    registers_up<CONSUMER_REGS>();
    consume<D, TAIL, KIND>(shared, vis, part, lse, T, heads, group, kvh, split, rows, m0, start, lo, hi, chunks, scale_log2,
                     v_lbo, v_sbo);
}
