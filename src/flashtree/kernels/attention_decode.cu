// One token's attention over TQ3_0 (or Q8_0) K and V rows (a decode over a long quantized cache), flash-decoding on
// tensor cores: grid (KV heads, splits of the visible rows), each CTA's warps walking 16-row chunks of their split on
// their own, each warp's raw rows streamed into shared memory a chunk ahead (cp.async), decoded there to float16 and
// read back as MMA fragments (ldmatrix), the CTA's warps merged at the end into the split's partial output and
// log-sum-exp in tree_attention.py's layout, which its combine launch merges (rotating TQ3_0 values back, applying the
// gate).
//
// Why CUDA C: the Triton decode (tree_attention.py, swapped 2-warp programs) spent 1754 warp instructions on a
// 16-row chunk and issued on about a third of the cycles (H100 / H200: 345 us over 262K TQ3_0 rows, 5x the K/V
// bytes' time), its chunk steps joined by barriers for layout changes. Here a warp never waits for another inside
// its loop, and decodes a block's 16 value pairs with 6 instructions each.
//
// The math is tree_attention's with float16 pairs (`_tq3_pairs`): value = norm * level (float16 multiply), the
// query clamped to +-65280 and rounded to float16, scores in float32 (times scale * log2 e), base-2 online softmax
// in float32, P rounded to float16 for the P V products, float32 accumulators.
//
// The TQ3_0 and Q8_0 blocks and their decodes: tq3_tiles.cuh, which attention_decode.py puts before this text.

constexpr int CHUNK = 16;       // K/V rows a warp takes at a time (the QK MMA's M side, the PV MMA's K side)
constexpr int HEADS_MAX = 8;    // query heads of a KV head's group (the MMAs' N side)
// Shared memory of one warp: its ring of raw chunks (K then V rows), the decoded chunk (float16, PITCH halves a
// row: 16 bytes past a multiple of 128, so the 8 rows an ldmatrix reads fall in distinct banks) and P [16][8].
template <int D, int STAGES, int KIND>
struct WarpSmem {
    static constexpr int ROW_BYTES = D / 32 * KIND_BLOCK_BYTES<KIND>;
    static constexpr int RAW = CHUNK * ROW_BYTES;        // one chunk of K (or V) rows
    static constexpr int PITCH = D + 8;
    static constexpr int RING = STAGES * 2 * RAW;
    static constexpr int VALUES = RING;                  // byte offsets
    static constexpr int P = VALUES + CHUNK * PITCH * 2;
    static constexpr int BYTES = P + CHUNK * HEADS_MAX * 2;
};

// A warp's 16 rows of one side (K or V) decoded, two adjacent blocks a lane at a time: the warp's 32 lanes take 8 rows
// x 4 block pairs twice (`decode_block_pair`: conflict-free 4-byte loads; halfword loads of a block a lane, lanes two
// to a row, met 2-way conflicts)
template <int D, int KIND>
__device__ __forceinline__ void decode_chunk(const unsigned char* raw, u16* vals, u32 table_low, u32 table_high) {
    static_assert(D == 256, "8 rows x 4 block pairs cover whole rows of 8 blocks");
    constexpr int ROW_BYTES = D / 32 * KIND_BLOCK_BYTES<KIND>, PITCH = D + 8;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int row = 8 * half + (lane & 7), pair = lane >> 3;
        const auto store = [&](int h, const u32(&out)[16]) {
            uint4* dst = reinterpret_cast<uint4*>(vals + row * PITCH + 32 * (2 * pair + h));
#pragma unroll
            for (int i = 0; i < 4; ++i) dst[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
        };
        decode_pair<KIND>(raw + row * ROW_BYTES + pair * 2 * KIND_BLOCK_BYTES<KIND>, table_low, table_high, store);
    }
}

template <int D, int WARPS, int STAGES, int KIND, typename QT>
__device__ __forceinline__ void quant_decode(const QT* __restrict__ q, const unsigned char* __restrict__ k_cache,
                                           const unsigned char* __restrict__ v_cache,
                                           const long long* __restrict__ start_t, const unsigned char* __restrict__ vis,
                                           float* __restrict__ part, float* __restrict__ lse, int stride_qh,
                                           int stride_kh, int stride_kr, int stride_vh, int stride_vr, int kv_end,
                                           int heads, int group, float scale_log2, u32 table_low, u32 table_high) {
    typedef WarpSmem<D, STAGES, KIND> S;
    constexpr int KSTEPS = D / 16;
    extern __shared__ __align__(16) unsigned char shared[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    unsigned char* mine = shared + warp * S::BYTES;
    u16* vals = reinterpret_cast<u16*>(mine + S::VALUES);
    u16* ps = reinterpret_cast<u16*>(mine + S::P);
    wait_for_predecessors();

    // the query as the QK MMAs' B fragments: head g of the group (zeros past it), values 16 s + 2t, + 1, + 8, + 9
    u32 qb[KSTEPS][2];
    {
        const bool live = g < group;
        const QT* row = q + (long)(kvh * group + (live ? g : 0)) * stride_qh;
#pragma unroll
        for (int s = 0; s < KSTEPS; ++s)
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int d = 16 * s + 2 * t + 8 * half;
                const float lo = fminf(fmaxf(as_float(row[d]), -65280.0f), 65280.0f);
                const float hi = fminf(fmaxf(as_float(row[d + 1]), -65280.0f), 65280.0f);
                qb[s][half] = live ? f16x2_of(lo, hi) : 0u;
            }
    }

    const int start = (int)start_t[0];
    const int end = min(start + 1, kv_end);
    const int per_split = (((end + splits - 1) / splits) + CHUNK - 1) / CHUNK * CHUNK;
    const int lo = split * per_split, hi = min(lo + per_split, end);
    const bool new_row_visible = vis[0] != 0;
    const unsigned char* k_base = k_cache + (long)kvh * stride_kh;
    const unsigned char* v_base = v_cache + (long)kvh * stride_vh;
    const int chunks = hi > lo ? (hi - lo + CHUNK - 1) / CHUNK : 0;
    const int mine_count = chunks > warp ? (chunks - warp + WARPS - 1) / WARPS : 0;  // chunks warp, warp + WARPS, ..

    float m_run[2] = {NEG_INF, NEG_INF}, l_run[2] = {0.0f, 0.0f};  // heads 2t, 2t + 1
    float acc[KSTEPS][4];  // O^T: dims 16 i + g (+ 8) x heads 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

#pragma unroll
    for (int k = 0; k < STAGES - 1; ++k) {
        if (k < mine_count)
            copy_kv_rows<S::ROW_BYTES, CHUNK, 32>(mine + k * 2 * S::RAW, k_base, v_base, stride_kr, stride_vr,
                                                  lo + CHUNK * (warp + k * WARPS), hi, lane);
        commit();
    }
    for (int k = 0; k < mine_count; ++k) {
        const int ahead = k + STAGES - 1;
        if (ahead < mine_count)  // into the stage chunk k - 1 left (decoded before the last iteration's end)
            copy_kv_rows<S::ROW_BYTES, CHUNK, 32>(mine + (ahead % STAGES) * 2 * S::RAW, k_base, v_base, stride_kr,
                                                  stride_vr, lo + CHUNK * (warp + ahead * WARPS), hi, lane);
        commit();
        wait_copies<STAGES - 1>();
        __syncwarp();
        const unsigned char* raw = mine + (k % STAGES) * 2 * S::RAW;
        const int r0 = lo + CHUNK * (warp + k * WARPS);

        decode_chunk<D, KIND>(raw, vals, table_low, table_high);  // K
        __syncwarp();
        // scores: rows g, g + 8 x heads 2t, 2t + 1, in two accumulator chains (a chain waits on each MMA's result)
        float chains[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
        {
            const int mi = lane >> 3;
            const unsigned a_addr = smem(vals + ((lane & 7) + 8 * (mi & 1)) * S::PITCH + 8 * (mi >> 1));
#pragma unroll
            for (int s = 0; s < KSTEPS; ++s) {
                u32 a[4];
                ldsm_x4(a, a_addr + 32 * s);
                mma(chains[s & 1], a, qb[s][0], qb[s][1]);
            }
        }
        __syncwarp();  // every lane's K fragments read: V may take their place while the MMAs run
        decode_chunk<D, KIND>(raw + S::RAW, vals, table_low, table_high);  // V
        float sc[4];
#pragma unroll
        for (int c = 0; c < 4; ++c) sc[c] = chains[0][c] + chains[1][c];
        // mask, online softmax per head (each head's 16 rows: 2 a lane, 8 lanes of one t)
        float p[4], alpha[2];
#pragma unroll
        for (int c = 0; c < 2; ++c) {  // head 2t + c: values c (row g) and c + 2 (row g + 8)
            float s0 = sc[c] * scale_log2, s1 = sc[c + 2] * scale_log2;
            const int ra = r0 + g, rb = r0 + g + 8;
            if (!(ra < hi && (ra < start || new_row_visible))) s0 = NEG_INF;
            if (!(rb < hi && (rb < start || new_row_visible))) s1 = NEG_INF;
            float mx = fmaxf(s0, s1);
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 4));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 8));
            mx = fmaxf(mx, __shfl_xor_sync(0xFFFFFFFFu, mx, 16));
            const float m_new = fmaxf(m_run[c], mx);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;
            p[c] = exp2f(s0 - m_use);
            p[c + 2] = exp2f(s1 - m_use);
            float sum = p[c] + p[c + 2];
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 8);
            sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 16);
            alpha[c] = exp2f(m_run[c] - m_use);
            l_run[c] = l_run[c] * alpha[c] + sum;
            m_run[c] = m_new;
        }
        if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.0f || alpha[1] != 1.0f))  // a max rose (times 1: no change)
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                acc[i][0] *= alpha[0];
                acc[i][2] *= alpha[0];
                acc[i][1] *= alpha[1];
                acc[i][3] *= alpha[1];
            }
        // P [16 rows][8 heads] in float16 through shared memory, read back as P^T's B fragments
        reinterpret_cast<u32*>(ps)[g * 4 + t] = f16x2_of(p[0], p[1]);
        reinterpret_cast<u32*>(ps)[(g + 8) * 4 + t] = f16x2_of(p[2], p[3]);
        __syncwarp();
        u32 pb0, pb1;
        ldsm_x2_trans(pb0, pb1, smem(ps + (lane & 15) * HEADS_MAX));
        {
            const int mi = lane >> 3;
            const unsigned a_addr = smem(vals + ((lane & 7) + 8 * (mi >> 1)) * S::PITCH + 8 * (mi & 1));
#pragma unroll
            for (int i = 0; i < KSTEPS; ++i) {
                u32 a[4];
                ldsm_x4_trans(a, a_addr + 32 * i);
                mma(acc[i], a, pb0, pb1);
            }
        }
        __syncwarp();  // every lane done with this stage, vals and P before they are written again
    }
    wait_copies<0>();

    // the CTA's warps merged: each writes its running max, sum and unnormalized O^T, then every thread takes
    // outputs (head, dim) of the group
    __syncthreads();
    float* red = reinterpret_cast<float*>(shared);  // [WARPS][HEADS_MAX][D] then m, l [WARPS][HEADS_MAX]
    float* red_m = red + WARPS * HEADS_MAX * D;
    float* red_l = red_m + WARPS * HEADS_MAX;
#pragma unroll
    for (int i = 0; i < KSTEPS; ++i)
#pragma unroll
        for (int c = 0; c < 4; ++c)
            red[(warp * HEADS_MAX + 2 * t + (c & 1)) * D + 16 * i + g + 8 * (c >> 1)] = acc[i][c];
    if (g == 0) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
            red_m[warp * HEADS_MAX + 2 * t + c] = m_run[c];
            red_l[warp * HEADS_MAX + 2 * t + c] = l_run[c];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * D; e += WARPS * 32) {
        const int n = e / D, d = e % D;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, red_m[w * HEADS_MAX + n]);
        const float m_use = mx == NEG_INF ? 0.0f : mx;
        float l = 0.0f, o = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) {
            const float f = exp2f(red_m[w * HEADS_MAX + n] - m_use);
            l += red_l[w * HEADS_MAX + n] * f;
            o += red[(w * HEADS_MAX + n) * D + d] * f;
        }
        const long row = (long)split * heads + kvh * group + n;  // part [splits, heads, 1, D], lse [splits, heads, 1]
        part[row * D + d] = l > 0.0f ? o / l : 0.0f;
        if (d == 0) lse[row] = l > 0.0f ? m_use + log2f(l) : NEG_INF;
    }
}
