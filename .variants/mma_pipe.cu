// Quantized matmul on tensor cores: out[M, N] = x[M, K] @ W[N, K]^T for 1 <= M <= 32 bf16 rows of x,
// W kept as Q4_K or Q6_K blocks re-laid at load in mma.sync fragment order (see mma.py for the layout).
//
// One m16n8k16 MMA multiplies 16 weight rows (the MMA's M) by 8 tokens (its N) over 16 values of K.
// The quantized integers go into the A fragment exactly: a nibble q is OR-ed into the mantissa of
// bf16 128.0 (0x4300 | q = 128 + q; one LOP3 per two values, no conversion instructions). Each
// sub-block's MMA partial is then scaled in float32 by the sub-block's scale, and the constant part
// (128 and Q4_K's min) is removed with the sub-block's sum of x, itself an MMA against ones. So the
// weights are never rounded; only x (already bf16) and the float32 accumulation round.
//
// A warp owns RT tiles of 16 rows and walks a share of the 256-value super-blocks (K); the CTA's
// warps split K and are summed in a fixed order through shared memory; with SPLITS > 1 CTAs of one
// row group split K further and the last CTA to finish sums their float32 partials in split order
// (an atomic ticket, reset for the next call): results are deterministic and there is one launch.
// (Giving each warp rows of its own, so that the CTA's warps share x through L1, measured no faster
// on the H200: with more than 8 tokens the loop's instructions limit, not x's L2 traffic.)
// No headers: NVRTC compiles this with nothing but the CUDA built-ins.

typedef unsigned int u32;
typedef unsigned short u16;

#define Q4_K 12
#define Q6_K 14

__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// x's sums: the same MMA with every A value 1.0 (one register passed four times)
__device__ __forceinline__ void mma_ones(float (&c)[4], u32 b0, u32 b1) {
    const u32 one = 0x3F803F80u;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%4,%4,%4}, {%5,%6}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(one), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 bf16x2_sub(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.bf16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

// Constants the hot loop ORs and permutes with, made once into registers the compiler cannot see
// through: otherwise it rematerializes them (a MOV per use) because LOP3/PRMT take one immediate.
struct Consts {
    u32 bf16_128;  // 0x43004300: bf16 128.0 in both halves
    u32 f32_2p23;  // 0x4B000000: float 2^23
};

__device__ __forceinline__ u32 opaque(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ Consts make_consts() { return Consts{opaque(0x43004300u), opaque(0x4B000000u)}; }

// (a & MASK) | c in one LOP3
template <u32 MASK>
__device__ __forceinline__ u32 and_or(u32 a, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(d) : "r"(a), "n"(MASK), "r"(c));
    return d;
}

// byte `k` of w as a float, exactly: the bits 0x4B0000bb are 2^23 + bb
__device__ __forceinline__ float byte_to_float(u32 w, int byte, const Consts& k) {
    return __int_as_float(__byte_perm(w, k.f32_2p23, 0x7540 | byte)) - 8388608.0f;
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
    uint4 v;  // read once: keep it out of L1 so x and the scales stay there
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// ---------------------------------------------------------------------------------------------
// Per-type pieces. A "tile super-block" is 16 rows x 256 values. Each lane holds, per MMA step
// s (16 per super-block), one 32-bit word of low nibbles (nibble 4p + r: A register r, half p).

template <int QT> struct Type;

template <> struct Type<Q4_K> {
    static constexpr int QUANT_BYTES = 2048;  // 16 x 256 nibbles
    static constexpr int HIGH_BYTES = 0;
    static constexpr int SUB = 2;  // MMA steps per scaled sub-block (32 values)
    static constexpr bool NEEDS_XSUM = true;
    struct Scales {
        uint4 row[2];  // rows g, g+8: 12 packed 6-bit scale/min bytes, fp16 d, fp16 dmin
    };
    // scale a and constant b of sub-block J for row half h: value = a * (128 + q) - b
    static __device__ __forceinline__ void sub_scale(const Scales& s, int h, int j, const Consts& k, float& a, float& b) {
        const uint4 r = s.row[h];
        u32 sc, mn;
        if (j < 4) {
            sc = r.x & 0x3F3F3F3Fu;
            mn = r.y & 0x3F3F3F3Fu;
        } else {
            sc = (r.z & 0x0F0F0F0Fu) | ((r.x >> 2) & 0x30303030u);
            mn = ((r.z >> 4) & 0x0F0F0F0Fu) | ((r.y >> 2) & 0x30303030u);
        }
        const float d = half_to_float((u16)(r.w & 0xFFFF)), dmin = half_to_float((u16)(r.w >> 16));
        a = d * byte_to_float(sc, j & 3, k);
        b = fmaf(a, 128.0f, dmin * byte_to_float(mn, j & 3, k));
    }
};

template <> struct Type<Q6_K> {
    static constexpr int QUANT_BYTES = 2048;  // low nibbles
    static constexpr int HIGH_BYTES = 1024;   // 2-bit high parts
    static constexpr int SUB = 1;             // 16-value sub-blocks
    static constexpr bool NEEDS_XSUM = false;
    struct Scales {
        uint4 row[2];  // 16 int8 scales of rows g, g+8
        float d[2];
    };
    static __device__ __forceinline__ void sub_scale(const Scales& s, int h, int j, const Consts& k, float& a, float& b) {
        const u32 w = word_of(s.row[h], j >> 2) ^ 0x80808080u;  // int8 + 128 as a byte
        a = s.d[h] * (byte_to_float(w, j & 3, k) - 128.0f);
        b = 0.0f;
    }
};

// A fragment of step s: low nibbles from `lo`, (Q6_K) two high bits from `hi`; Q6_K's are exact
// q - 32 (bf16 128 + q minus 160), Q4_K's stay 128 + q (the 128 leaves with the sum of x).
template <int QT>
__device__ __forceinline__ void decode(u32 lo, u32 hi, int s, const Consts& k, u32 (&a)[4]) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        u32 v = and_or<0x000F000Fu>(lo >> (4 * r), k.bf16_128);
        if (QT == Q6_K) {
            v |= ((hi >> (8 * (s & 1) + 2 * r)) & 0x00030003u) << 4;
            v = bf16x2_sub(v, 0x43204320u);  // - 160
        }
        a[r] = v;
    }
}

template <int QT>
__device__ __forceinline__ void load_scales(const unsigned char* scales, const u16* dvals, long tsb, int g,
                                            typename Type<QT>::Scales& s) {
    const uint4* rec = reinterpret_cast<const uint4*>(scales) + tsb * 16;
    s.row[0] = __ldg(rec + g);
    s.row[1] = __ldg(rec + g + 8);
    if constexpr (QT == Q6_K) {
        s.d[0] = half_to_float(__ldg(dvals + tsb * 16 + g));
        s.d[1] = half_to_float(__ldg(dvals + tsb * 16 + g + 8));
    }
}

// ---------------------------------------------------------------------------------------------

template <int QT, int RT>
struct Weights {
    uint4 q[RT][4];
    uint4 qh[RT][Type<QT>::HIGH_BYTES > 0 ? 2 : 1];
    typename Type<QT>::Scales sc[RT];
};

// Bytes of one tile super-block in a warp's shared-memory stage: quants, (Q6_K) high bits, the 16
// rows' scale records, (Q6_K) the 16 rows' fp16 d.
template <int QT> struct Stage {
    static constexpr int HIGH = Type<QT>::QUANT_BYTES;
    static constexpr int SCALES = HIGH + Type<QT>::HIGH_BYTES;
    static constexpr int D = SCALES + 256;
    static constexpr int BYTES = D + (QT == Q6_K ? 32 : 0);
};

__device__ __forceinline__ void copy16(unsigned char* dst, const void* src) {
    // cp.async: global -> shared without registers, around L1 (the weights are read once)
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Start copying tile super-block (tiles tile0 .. tile0 + RT - 1, super-block sb) into a stage; each lane
// copies the 16-byte quant chunks it will read itself, and a share of the records.
template <int QT, int RT>
__device__ __forceinline__ void fetch_stage(const unsigned char* quants, const unsigned char* high,
                                            const unsigned char* scales, const u16* dvals, int tile0, int SB, int sb,
                                            int lane, unsigned char* stage) {
    typedef Type<QT> T;
    typedef Stage<QT> S;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        const long tsb = (long)(tile0 + rt) * SB + sb;
        unsigned char* dst = stage + rt * S::BYTES;
        const unsigned char* qp = quants + tsb * T::QUANT_BYTES + lane * 16;
#pragma unroll
        for (int j = 0; j < 4; ++j) copy16(dst + 512 * j + lane * 16, qp + 512 * j);
        if constexpr (T::HIGH_BYTES > 0) {
            const unsigned char* hp = high + tsb * T::HIGH_BYTES + lane * 16;
            copy16(dst + S::HIGH + lane * 16, hp);
            copy16(dst + S::HIGH + 512 + lane * 16, hp + 512);
        }
        if (lane < 16) copy16(dst + S::SCALES + lane * 16, scales + tsb * 256 + lane * 16);
        if constexpr (QT == Q6_K) {
            if (lane >= 16 && lane < 18) copy16(dst + S::D + (lane - 16) * 16, dvals + tsb * 16 + (lane - 16) * 8);
        }
    }
}

// A landed stage into registers: lane (g, t) reads its own quant chunks and rows g, g + 8's records.
template <int QT, int RT>
__device__ __forceinline__ void read_stage(const unsigned char* stage, int lane, int g, Weights<QT, RT>& w) {
    typedef Type<QT> T;
    typedef Stage<QT> S;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        const unsigned char* src = stage + rt * S::BYTES;
#pragma unroll
        for (int j = 0; j < 4; ++j) w.q[rt][j] = *reinterpret_cast<const uint4*>(src + 512 * j + lane * 16);
        if constexpr (T::HIGH_BYTES > 0) {
            w.qh[rt][0] = *reinterpret_cast<const uint4*>(src + S::HIGH + lane * 16);
            w.qh[rt][1] = *reinterpret_cast<const uint4*>(src + S::HIGH + 512 + lane * 16);
        }
        w.sc[rt].row[0] = *reinterpret_cast<const uint4*>(src + S::SCALES + g * 16);
        w.sc[rt].row[1] = *reinterpret_cast<const uint4*>(src + S::SCALES + (g + 8) * 16);
        if constexpr (QT == Q6_K) {
            const u16* d = reinterpret_cast<const u16*>(src + S::D);
            w.sc[rt].d[0] = half_to_float(d[g]);
            w.sc[rt].d[1] = half_to_float(d[g + 8]);
        }
    }
}

// B fragments of scaled sub-block j for one token group: lane t's values are contiguous (mma.py's
// `_lane_columns`): Q4_K one 16-byte load for both steps, Q6_K one 8-byte load.
template <int QT>
__device__ __forceinline__ void load_x(const u16* row, int sb, int j, u32 (&bx)[Type<QT>::SUB][2]) {
    if constexpr (QT == Q4_K) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(row + (sb << 8) + 32 * j));
        bx[0][0] = v.x; bx[0][1] = v.y; bx[1][0] = v.z; bx[1][1] = v.w;
    } else {
        const uint2 v = __ldg(reinterpret_cast<const uint2*>(row + (sb << 8) + 16 * j));
        bx[0][0] = v.x; bx[0][1] = v.y;
    }
}

template <int QT, int RT, int TG>
__device__ __forceinline__ void multiply(const Weights<QT, RT>& w, const u16* const (&xrow)[TG], int sb,
                                         const Consts& k, float (&acc)[RT][TG][4]) {
    typedef Type<QT> T;
#pragma unroll
    for (int j = 0; j < 16 / T::SUB; ++j) {  // scaled sub-blocks
        u32 bx[TG][T::SUB][2];
        float xs[TG][2];
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            load_x<QT>(xrow[tg], sb, j, bx[tg]);
            if constexpr (T::NEEDS_XSUM) {
                float xsum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int u = 0; u < T::SUB; ++u) mma_ones(xsum, bx[tg][u][0], bx[tg][u][1]);
                xs[tg][0] = xsum[0];
                xs[tg][1] = xsum[1];
            }
        }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            float a0, b0, a1, b1;
            T::sub_scale(w.sc[rt], 0, j, k, a0, b0);
            T::sub_scale(w.sc[rt], 1, j, k, a1, b1);
            u32 frag[T::SUB][4];
#pragma unroll
            for (int u = 0; u < T::SUB; ++u) {
                const int s = j * T::SUB + u;
                const u32 lo = word_of(w.q[rt][s >> 2], s & 3);
                const u32 hi = T::HIGH_BYTES > 0 ? word_of(w.qh[rt][s >> 3], (s >> 1) & 3) : 0u;
                decode<QT>(lo, hi, s, k, frag[u]);
            }
#pragma unroll
            for (int tg = 0; tg < TG; ++tg) {
                float p[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
                for (int u = 0; u < T::SUB; ++u) mma_bf16(p, frag[u], bx[tg][u][0], bx[tg][u][1]);
                if constexpr (T::NEEDS_XSUM) {
                    acc[rt][tg][0] = fmaf(-b0, xs[tg][0], fmaf(a0, p[0], acc[rt][tg][0]));
                    acc[rt][tg][1] = fmaf(-b0, xs[tg][1], fmaf(a0, p[1], acc[rt][tg][1]));
                    acc[rt][tg][2] = fmaf(-b1, xs[tg][0], fmaf(a1, p[2], acc[rt][tg][2]));
                    acc[rt][tg][3] = fmaf(-b1, xs[tg][1], fmaf(a1, p[3], acc[rt][tg][3]));
                } else {
                    acc[rt][tg][0] = fmaf(a0, p[0], acc[rt][tg][0]);
                    acc[rt][tg][1] = fmaf(a0, p[1], acc[rt][tg][1]);
                    acc[rt][tg][2] = fmaf(a1, p[2], acc[rt][tg][2]);
                    acc[rt][tg][3] = fmaf(a1, p[3], acc[rt][tg][3]);
                }
            }
        }
    }
}

// A finished sum of (token, row) over this CTA's K range: the output itself with one split, else this
// split's float32 partial.
template <int SPLITS>
__device__ __forceinline__ void store_sum(float v, int tok, int row, u16* __restrict__ out,
                                          float* __restrict__ partial, int M, int N) {
    if (SPLITS == 1) out[(long)tok * N + row] = float_to_bf16(v);
    else partial[(long)blockIdx.y * M * N + (long)tok * N + row] = v;
}

// With several splits, the last CTA of a row group to arrive (an atomic ticket, reset for the next
// call) adds the splits' partials of rows [row0, row0 + rows) in split order, so the result does not
// depend on timing.
template <int SPLITS, int THREADS>
__device__ __forceinline__ void finish_splits(u16* __restrict__ out, const float* __restrict__ partial,
                                              int* __restrict__ tickets, int row0, int rows, int M, int N) {
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1) == SPLITS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long stride = (long)M * N;
    for (int e = threadIdx.x; e < rows * M; e += THREADS) {
        const int tok = e / rows, row = row0 + e % rows;
        const volatile float* src = partial + (long)tok * N + row;
        float total = 0.0f;
        for (int s = 0; s < SPLITS; ++s) total += src[s * stride];
        out[(long)tok * N + row] = float_to_bf16(total);
    }
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}

// The end of a CTA: its warps' partial sums of the CTA's RT tiles meet in shared memory, added in warp order.
template <int RT, int TG, int WARPS, int SPLITS>
__device__ __forceinline__ void epilogue(const float (&acc)[RT][TG][4], int tile0, u16* __restrict__ out,
                                                 float* __restrict__ partial, int* __restrict__ tickets, int M, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int VALS = RT * TG * 4;
    __shared__ float red[WARPS][VALS][32];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[warp][(rt * TG + tg) * 4 + c][lane] = acc[rt][tg][c];
    __syncthreads();
    for (int e = threadIdx.x; e < VALS * 32; e += WARPS * 32) {  // element e = (value index, lane)
        const int v = e >> 5, l = e & 31;
        const int rt = v / (TG * 4), tg = (v / 4) % TG, c = v & 3;
        const int tok = 8 * tg + 2 * (l & 3) + (c & 1);
        if (tok >= M) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += red[w][v][l];
        store_sum<SPLITS>(total, tok, 16 * (tile0 + rt) + (l >> 2) + 8 * (c >> 1), out, partial, M, N);
    }
    if constexpr (SPLITS > 1) finish_splits<SPLITS, WARPS * 32>(out, partial, tickets, 16 * tile0, 16 * RT, M, N);
}

template <int QT, int RT, int TG, int WARPS, int SPLITS, int STAGES>
__device__ __forceinline__ void qmm(const u16* __restrict__ x, const unsigned char* __restrict__ quants,
                                    const unsigned char* __restrict__ high, const unsigned char* __restrict__ scales,
                                    const u16* __restrict__ dvals, u16* __restrict__ out, float* __restrict__ partial,
                                    int* __restrict__ tickets, int M, int N, int K) {
    typedef Type<QT> T;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int SB = K >> 8;  // super-blocks per row
    const int tile0 = blockIdx.x * RT;
    // this CTA's super-blocks: split blockIdx.y of SPLITS
    const int per = (SB + SPLITS - 1) / SPLITS;
    const int sb_begin = blockIdx.y * per;
    const int sb_end = min(SB, sb_begin + per);

    float acc[RT][TG][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[rt][tg][c] = 0.0f;

    // x rows of this lane's B fragments: token 8 tg + g; past M, token 0 again (those output columns
    // are computed and never stored: cheaper than zeroing)
    const u16* xrow[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
        const int tok = 8 * tg + g;
        xrow[tg] = x + (long)(tok < M ? tok : 0) * K + (QT == Q4_K ? 8 : 4) * t;
    }

    // STAGES-deep pipeline per warp: cp.async keeps STAGES - 1 of the warp's super-blocks in flight in
    // shared memory (no registers held) while it multiplies the oldest one.
    extern __shared__ __align__(16) unsigned char smem[];
    unsigned char* stages = smem + warp * STAGES * RT * Stage<QT>::BYTES;
    const int count = sb_begin + warp < sb_end ? (sb_end - sb_begin - warp + WARPS - 1) / WARPS : 0;
    const Consts k = make_consts();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < count)
            fetch_stage<QT, RT>(quants, high, scales, dvals, tile0, SB, sb_begin + warp + s * WARPS, lane,
                                stages + s * RT * Stage<QT>::BYTES);
        copy_commit();
    }
    int slot = 0;
    for (int i = 0; i < count; ++i) {
        copy_wait<STAGES - 2>();
        __syncwarp();  // every lane's copies of stage i landed, and every lane is done reading stage i - 1
        const int ahead = i + STAGES - 1;
        if (ahead < count) {
            const int ahead_slot = slot == 0 ? STAGES - 1 : slot - 1;
            fetch_stage<QT, RT>(quants, high, scales, dvals, tile0, SB, sb_begin + warp + ahead * WARPS, lane,
                                stages + ahead_slot * RT * Stage<QT>::BYTES);
        }
        copy_commit();
        Weights<QT, RT> w;
        read_stage<QT, RT>(stages + slot * RT * Stage<QT>::BYTES, lane, g, w);
        multiply<QT, RT, TG>(w, xrow, sb_begin + warp + i * WARPS, k, acc);
        slot = slot == STAGES - 1 ? 0 : slot + 1;
    }
    epilogue<RT, TG, WARPS, SPLITS>(acc, tile0, out, partial, tickets, M, N);
}

// Dense dequantization (prefill chunks that go to cuBLAS, and float32/float16 x): one warp per tile
// super-block decodes its 16 x 256 values into shared memory in the output's type (OUT 0: bf16, 1: f16,
// 2: f32), then writes them row by row, each row one coalesced store per lane group.
template <int OUT> struct DequantOut {
    static constexpr int VALUE_BYTES = OUT == 2 ? 4 : 2;
    static constexpr int ROW_BYTES = 256 * VALUE_BYTES;
    static constexpr int WARPS = OUT == 2 ? 2 : 4;  // 32 KB of shared memory per CTA either way
};

template <int QT, int OUT>
__device__ __forceinline__ void dequant(const unsigned char* __restrict__ quants, const unsigned char* __restrict__ high,
                                        const unsigned char* __restrict__ scales, const u16* __restrict__ dvals,
                                        void* __restrict__ dense, int N, int K) {
    typedef Type<QT> T;
    typedef DequantOut<OUT> O;
    __shared__ __align__(16) unsigned char tiles[O::WARPS][16 * O::ROW_BYTES];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long warp_id = (long)blockIdx.x * O::WARPS + warp;
    const int SB = K >> 8;
    if (warp_id >= (long)(N >> 4) * SB) return;
    const int tile = (int)(warp_id / SB), sb = (int)(warp_id % SB);
    const int g = lane >> 2, t = lane & 3;
    const uint4* qp = reinterpret_cast<const uint4*>(quants + warp_id * T::QUANT_BYTES) + lane;
    uint4 q[4], qh[2];
#pragma unroll
    for (int j = 0; j < 4; ++j) q[j] = qp[32 * j];
    if constexpr (T::HIGH_BYTES > 0) {
        const uint4* hp = reinterpret_cast<const uint4*>(high + warp_id * T::HIGH_BYTES) + lane;
        qh[0] = hp[0];
        qh[1] = hp[32];
    }
    typename T::Scales sc;
    load_scales<QT>(scales, dvals, warp_id, g, sc);
    const Consts k = make_consts();
    unsigned char* mine = tiles[warp];
#pragma unroll
    for (int s = 0; s < 16; ++s) {
        u32 frag[4];
        decode<QT>(word_of(q[s >> 2], s & 3), T::HIGH_BYTES > 0 ? word_of(qh[s >> 3], (s >> 1) & 3) : 0u, s, k, frag);
        float a[2], b[2];
        T::sub_scale(sc, 0, s / T::SUB, k, a[0], b[0]);
        T::sub_scale(sc, 1, s / T::SUB, k, a[1], b[1]);
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int h = r & 1, half = r >> 1;  // A register r: row g + 8h, columns + 8 * half
            // the value this fragment column holds (mma.py `_lane_columns`)
            const int within = QT == Q4_K ? 32 * (s >> 1) + 8 * t + 4 * (s & 1) + 2 * half : 16 * s + 4 * t + 2 * half;
            const float v0 = a[h] * __uint_as_float(frag[r] << 16) - b[h];
            const float v1 = a[h] * __uint_as_float(frag[r] & 0xFFFF0000u) - b[h];
            unsigned char* at = mine + (g + 8 * h) * O::ROW_BYTES + within * O::VALUE_BYTES;
            if (OUT == 2) {
                *reinterpret_cast<float2*>(at) = make_float2(v0, v1);
            } else {
                const u32 lo = OUT == 0 ? float_to_bf16(v0) : float_to_half(v0);
                const u32 hi = OUT == 0 ? float_to_bf16(v1) : float_to_half(v1);
                *reinterpret_cast<u32*>(at) = lo | (hi << 16);
            }
        }
    }
    __syncwarp();
    unsigned char* base = reinterpret_cast<unsigned char*>(dense) + ((long)16 * tile * K + ((long)sb << 8)) * O::VALUE_BYTES;
#pragma unroll
    for (int row = 0; row < 16; ++row)
#pragma unroll
        for (int c = lane * 16; c < O::ROW_BYTES; c += 512)
            *reinterpret_cast<uint4*>(base + (long)row * K * O::VALUE_BYTES + c) =
                *reinterpret_cast<const uint4*>(mine + row * O::ROW_BYTES + c);
}
