// The types whose values come in 32-value blocks with one scale (and min) each - Q8_0, Q5_K, IQ4_XS - times 1-32 rows
// of x on tensor cores (mma.sync m16n8k16, float16 in, float32 sums), read from GGUF's own bytes split into their
// fields (QuantWeight's field-major copy), so no re-layout at load. Put after x_f16.cuh (its float16 helpers); x comes
// as mma.cu's `prep_x<Q4_K>` writes it: each token scaled by a power of two into [256, 512) and rounded to float16,
// with 2^-e (its block sums are not read).
//
// Exact integer weights: a block's integers become float16 by one permute under the exponent byte 0x64 (1024 + u for a
// byte u), with no int-to-float conversion: Q8_0's q ^ 0x80 = q + 128, IQ4_XS's table value + 128 (the table looked up
// by permutes), both then less 1152 (one exact float16 subtraction); Q5_K's 5-bit q less 1024. A block's scale
// multiplies its float32 partial sums (two MMAs into a fresh accumulator), never the weights; Q5_K's min leaves with
// the block's sum of x, two more MMAs of x against ones: acc += d sc part - dmin m sum(x). Nothing is rounded below the float32 sums but x's float16.
//
// Lane (g, t) of a warp (g = lane / 4, t = lane % 4) takes values 8t .. 8t + 7 of each block of its rows g and g + 8,
// of which 8t + 4h .. + 3 feed MMA step h (h = 0, 1) as its A slots 2t, 2t + 1 (values 0, 1) and 2t + 8, 2t + 9
// (values 2, 3). K's order inside a block is thereby permuted, the same way for x: lane (g, t) reads x's values
// 8t .. 8t + 7 of the block in one 16-byte load, step h's B slots from values 8t + 4h .. + 3 (IQ4_XS: another
// permutation, its nibbles' own, `B32Chunk<IQ4_XS>`).
//
// A CTA owns RT row tiles of 16 rows and all of K, its WARPS warps taking chunks of 128 values (4 blocks, half a
// 256-value super-block) in turn, their sums added in warp order in shared memory: a fixed order for every output, so
// a row's bits depend on neither the row count M nor the other rows. x's rows past M read row M - 1, never stored.

#define Q8_0 8
#define Q5_K 13
#define IQ4_XS 23
#define B32_CHUNK 128  // values a warp takes at once: 4 blocks of 32

// The PTX primitives (tests/kernels/block32_host.cpp defines B32_HOST and host versions of these, to run the kernel's
// indexing and bit work on a machine without a GPU)
#ifndef B32_HOST
__device__ __forceinline__ void b32_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Weights are read once: past L1 (the 60 MB L2 keeps nothing of a matrix either)
__device__ __forceinline__ uint2 b32_stream(const unsigned char* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 b32_stream4(const unsigned char* p) {
    u32 v;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];\n" : "=r"(v) : "l"(p));
    return v;
}

__device__ __forceinline__ u32 b32_prmt(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

__device__ __forceinline__ u32 b32_sub(u32 a, u32 b) {  // float16 pairs, exact for these integers
    u32 r;
    asm("sub.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 b32_opaque(u32 v) {  // a constant the compiler keeps in a register
    u32 r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

#endif

// Four bytes u (0 .. 255) -> float16 pairs 1024 + u of bytes 0, 1 (lo) and 2, 3 (hi); `exponent` holds 0x64646464
__device__ __forceinline__ void b32_pairs(u32 u, u32 exponent, u32& lo, u32& hi) {
    lo = b32_prmt(u, exponent, 0x4140);
    hi = b32_prmt(u, exponent, 0x4342);
}

__device__ __forceinline__ void b32_store(u16* out, long i, float v) {
    const u32 bits = __float_as_uint(v);  // bf16, rounded to nearest even (finite sums)
    out[i] = (u16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ void b32_store(float* out, long i, float v) { out[i] = v; }

// Registers a loop holds once (set up by `Consts`): the permutes' and subtraction's operands
struct B32Consts {
    u32 exponent;  // 0x64646464
    u32 bias;      // 0x64806480: 1152.0 twice
    u32 k1024;     // 0x64006400: 1024.0 twice
    u32 one;       // 0x3C003C00: 1.0 twice (Q5_K's sums of x on the MMA)
    u32 lo_table, lo_table_hi, hi_table, hi_table_hi;  // IQ4_XS's table values + 128, entries 0-3, 4-7, 8-11, 12-15
    __device__ __forceinline__ void init() {
        exponent = b32_opaque(0x64646464u);
        bias = b32_opaque(0x64806480u);
        k1024 = b32_opaque(0x64006400u);
        one = b32_opaque(0x3C003C00u);
        // kvalues (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113) + 128
        lo_table = b32_opaque(0x3F2D1801u);
        lo_table_hi = b32_opaque(0x766A5D4Fu);
        hi_table = b32_opaque(0xA6998D81u);
        hi_table_hi = b32_opaque(0xF1D9C5B5u);
    }
};

// A row's fields: p0 the quants (Q8_0 qs [K], Q5_K and IQ4_XS qs [K / 2]), p1 Q5_K's qh [K / 8], p2 the scales
// (Q5_K's 12 bytes a super-block, IQ4_XS's scales_l 4 bytes), p3 IQ4_XS's scales_h (u16 a super-block), d and dmin
// (float16: Q8_0 a block, the others a super-block)
struct B32Row {
    const unsigned char* q;
    const unsigned char* qh;
    const unsigned char* s;
    const u16* sh;
    const u16* d;
    const u16* dmin;
};

// One row's raw bytes of one 128-value chunk (4 blocks), loaded together
template <int QT> struct B32Chunk;

template <> struct B32Chunk<Q8_0> {
    static constexpr bool SUMS = false;  // no sum-of-x term
    uint2 w[4];  // block j: values 8t .. 8t + 7
    uint2 d;     // the 4 blocks' d
    __device__ __forceinline__ void load(const B32Row& row, int k0, int t) {
#pragma unroll
        for (int j = 0; j < 4; ++j) w[j] = b32_stream(row.q + k0 + 32 * j + 8 * t);
        d = __ldg(reinterpret_cast<const uint2*>(row.d + (k0 >> 5)));
    }
    // MMA step h of block j: A values (q, exact) of this row, as float16 pairs (lo: values 0, 1; hi: 2, 3)
    __device__ __forceinline__ void values(int j, int h, const B32Consts& c, u32& lo, u32& hi) const {
        b32_pairs((h ? w[j].y : w[j].x) ^ 0x80808080u, c.exponent, lo, hi);
        lo = b32_sub(lo, c.bias);
        hi = b32_sub(hi, c.bias);
    }
    __device__ __forceinline__ float scale(int j) const {
        return half_to_float((u16)(((j < 2 ? d.x : d.y) >> (16 * (j & 1))) & 0xFFFF));
    }
    __device__ __forceinline__ float offset(int) const { return 0.0f; }
};

template <> struct B32Chunk<Q5_K> {
    static constexpr bool SUMS = true;
    uint2 q[2];    // block pairs (2p, 2p + 1) of this half super-block: low nibbles of both at bytes 8t .. 8t + 7
    uint2 h;       // the super-block's fifth bits of values 8t .. 8t + 7 (bit j: block j)
    u32 s[3];      // the super-block's 12 scale and min bytes
    u32 d2;        // its d and dmin (float16)
    int half;      // which half of the super-block (blocks 4 half .. 4 half + 3)
    __device__ __forceinline__ void load(const B32Row& row, int k0, int t) {
        const int sb = k0 >> 8;
        half = (k0 >> 7) & 1;
#pragma unroll
        for (int p = 0; p < 2; ++p) q[p] = b32_stream(row.q + sb * 128 + 64 * half + 32 * p + 8 * t);
        h = b32_stream(row.qh + sb * 32 + 8 * t);
#pragma unroll
        for (int i = 0; i < 3; ++i) s[i] = __ldg(reinterpret_cast<const u32*>(row.s + sb * 12) + i);
        d2 = (u32)__ldg(row.d + sb) | ((u32)__ldg(row.dmin + sb) << 16);
    }
    __device__ __forceinline__ void values(int j, int hs, const B32Consts& c, u32& lo, u32& hi) const {
        const u32 nib = ((hs ? q[j >> 1].y : q[j >> 1].x) >> (4 * (j & 1))) & 0x0F0F0F0Fu;
        const u32 top = (((hs ? h.y : h.x) >> (4 * half + j)) & 0x01010101u) << 4;
        b32_pairs(nib | top, c.exponent, lo, hi);
        lo = b32_sub(lo, c.k1024);
        hi = b32_sub(hi, c.k1024);
    }
    // the 6-bit scales (min: mins) of blocks 4 half .. 4 half + 3, one a byte (Q4_K's packing of the 12 bytes)
    __device__ __forceinline__ u32 six_bits(bool min) const {
        if (!half) return (min ? s[1] : s[0]) & 0x3F3F3F3Fu;
        return min ? ((s[2] >> 4) & 0x0F0F0F0Fu) | ((s[1] >> 2) & 0x30303030u)
                   : (s[2] & 0x0F0F0F0Fu) | ((s[0] >> 2) & 0x30303030u);
    }
    __device__ __forceinline__ float scale(int j) const {
        return half_to_float((u16)(d2 & 0xFFFF)) * (float)((six_bits(false) >> (8 * j)) & 0xFF);
    }
    // what the block's sum of x is multiplied by and taken away: its min dmin m
    __device__ __forceinline__ float offset(int j) const {
        return half_to_float((u16)(d2 >> 16)) * (float)((six_bits(true) >> (8 * j)) & 0xFF);
    }
};

// IQ4_XS packs value i of a block in the low nibble of byte i and value i + 16 in its high nibble, so lane t takes
// bytes 4t .. 4t + 3 whole: step h's A slots 2t, 2t + 1 are values 4t + 2h and 4t + 2h + 16 (byte 4t + 2h), slots
// 2t + 8, 2t + 9 values 4t + 2h + 1 and 4t + 2h + 17, and its x fragments follow (`B32X<IQ4_XS>`). The byte's two
// nibbles are then the table permute's selectors as they lie.
template <> struct B32Chunk<IQ4_XS> {
    static constexpr bool SUMS = false;
    u32 q[4];  // block j: its bytes 4t .. 4t + 3
    u32 sl;    // the super-block's scales_l (4 bits a block)
    u32 sh;    // scales_h (2 bits a block)
    float d;
    int half;
    __device__ __forceinline__ void load(const B32Row& row, int k0, int t) {
        const int sb = k0 >> 8;
        half = (k0 >> 7) & 1;
#pragma unroll
        for (int j = 0; j < 4; ++j) q[j] = b32_stream4(row.q + sb * 128 + 64 * half + 16 * j + 4 * t);
        sl = __ldg(reinterpret_cast<const u32*>(row.s) + sb);
        sh = __ldg(row.sh + sb);
        d = half_to_float(__ldg(row.d + sb));
    }
    // step h of block j: the table's values + 128 for the four nibbles of bytes 2h, 2h + 1 (permutes into the low and
    // the high half-table; each nibble's top bit, as a sign, picks between them), then float16 less 1152
    __device__ __forceinline__ void values(int j, int h, const B32Consts& c, u32& lo, u32& hi) const {
        const u32 w = q[j], selectors = (w & 0x77777777u) >> (16 * h);
        const u32 low = b32_prmt(c.lo_table, c.lo_table_hi, selectors);
        const u32 high = b32_prmt(c.hi_table, c.hi_table_hi, selectors);
        const u32 top = b32_prmt(w, w << 4, h ? 0xBFAE : 0x9D8C);  // 0xFF where the nibble is 8 or more
        b32_pairs((low & ~top) | (high & top), c.exponent, lo, hi);
        lo = b32_sub(lo, c.bias);
        hi = b32_sub(hi, c.bias);
    }
    __device__ __forceinline__ float scale(int j) const {
        const int b = 4 * half + j;
        const int ls = (int)(((sl >> (4 * b)) & 0xF) | (((sh >> (2 * b)) & 3) << 4));
        return d * (float)(ls - 32);
    }
    __device__ __forceinline__ float offset(int) const { return 0.0f; }
};

// x's B fragments of one block for lane t, steps 0 (x, y) and 1 (z, w), in the order its type's A slots hold K:
// values 8t + 4h .. + 3 (one 16-byte load), or IQ4_XS's 4t + 2h, 4t + 2h + 16 | 4t + 2h + 1, 4t + 2h + 17. `lane`:
// where lane t's values start in a block (added to its row pointer once)
template <int QT> struct B32X {
    __device__ __forceinline__ static int lane(int t) { return 8 * t; }
    __device__ __forceinline__ static uint4 load(const u16* at) { return __ldg(reinterpret_cast<const uint4*>(at)); }
};
template <> struct B32X<IQ4_XS> {
    __device__ __forceinline__ static int lane(int t) { return 4 * t; }
    __device__ __forceinline__ static uint4 load(const u16* at) {
        const uint2 a = __ldg(reinterpret_cast<const uint2*>(at)), b = __ldg(reinterpret_cast<const uint2*>(at + 16));
        return {b32_prmt(a.x, b.x, 0x5410), b32_prmt(a.x, b.x, 0x7632), b32_prmt(a.y, b.y, 0x5410),
                b32_prmt(a.y, b.y, 0x7632)};
    }
};

template <int QT, int TG, int RT, int WARPS, typename OT>
__device__ __forceinline__ void block32_mm(const u16* __restrict__ xh, const float* __restrict__ scale, const unsigned char* __restrict__ q,
                                           const unsigned char* __restrict__ qh, const unsigned char* __restrict__ s,
                                           const u16* __restrict__ sh, const u16* __restrict__ d,
                                           const u16* __restrict__ dmin, OT* __restrict__ out, int M, int N, int K) {
    using Chunk = B32Chunk<QT>;
    // each lane's sums: row tile r, token group tg, C fragment value i at (r TG + tg) 4 + i
    constexpr int VALS = RT * TG * 4;
    // the warps' sums meet in shared memory SLICE values at a time: at most 40 KB of static shared memory
    constexpr int LIMIT = 40 * 1024 / ((WARPS > 1 ? WARPS - 1 : 1) * 32 * 4);
    constexpr int SLICE = VALS <= LIMIT ? VALS : VALS / 2 <= LIMIT ? VALS / 2 : VALS / 4 <= LIMIT ? VALS / 4 : VALS / 8;
    __shared__ float sums[WARPS > 1 ? WARPS - 1 : 1][SLICE][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16 * RT;
    B32Consts c;
    c.init();

    B32Row rows[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long row = min(row0 + 16 * r + g + 8 * h, N - 1);  // a partial last CTA: row N - 1 again, unstored
            const long bytes = QT == Q8_0 ? K : K / 2, supers = K >> 8;
            rows[r][h] = {q + row * bytes, qh + row * (K >> 3), s + row * supers * (QT == Q5_K ? 12 : 4),
                          sh + row * supers, d + row * (QT == Q8_0 ? K >> 5 : supers), dmin + row * supers};
        }
    int tok[TG];
    const u16* xrow[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
        tok[tg] = 8 * tg + 2 * t;  // this lane's output tokens: tok, tok + 1 (C fragment columns)
        xrow[tg] = xh + (long)min(8 * tg + g, M - 1) * K + B32X<QT>::lane(t);
    }

    float acc[VALS];
#pragma unroll
    for (int v = 0; v < VALS; ++v) acc[v] = 0.0f;

    const int chunks = K / B32_CHUNK;
#pragma unroll 2
    for (int ch = warp; ch < chunks; ch += WARPS) {
        const int k0 = ch * B32_CHUNK;
        Chunk w[RT][2];
        uint4 xv[TG][4];  // 8 float16 x per token group and block
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) w[r][h].load(rows[r][h], k0, t);
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int j = 0; j < 4; ++j) xv[tg][j] = B32X<QT>::load(xrow[tg] + k0 + 32 * j);
        float xs[TG][4][4];  // Q5_K: each block's sum of x of tokens tok, tok + 1 (0, 1): x against ones on the MMA
        if constexpr (Chunk::SUMS) {
            const u32 ones[4] = {c.one, c.one, c.one, c.one};
#pragma unroll
            for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) xs[tg][j][i] = 0.0f;
                    b32_mma(xs[tg][j], ones, xv[tg][j].x, xv[tg][j].y);
                    b32_mma(xs[tg][j], ones, xv[tg][j].z, xv[tg][j].w);
                }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                u32 a[2][4];  // step h: rows g (values 0, 1 and 2, 3) and g + 8
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    w[r][0].values(j, h, c, a[h][0], a[h][2]);
                    w[r][1].values(j, h, c, a[h][1], a[h][3]);
                }
                const float s0 = w[r][0].scale(j), s1 = w[r][1].scale(j);
                float o0 = 0.0f, o1 = 0.0f;
                if constexpr (Chunk::SUMS) {
                    o0 = w[r][0].offset(j);
                    o1 = w[r][1].offset(j);
                }
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) {
                    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    b32_mma(part, a[0], xv[tg][j].x, xv[tg][j].y);
                    b32_mma(part, a[1], xv[tg][j].z, xv[tg][j].w);
                    float* at = acc + (r * TG + tg) * 4;
                    at[0] = fmaf(s0, part[0], at[0]);
                    at[1] = fmaf(s0, part[1], at[1]);
                    at[2] = fmaf(s1, part[2], at[2]);
                    at[3] = fmaf(s1, part[3], at[3]);
                    if constexpr (Chunk::SUMS) {
                        at[0] = fmaf(-o0, xs[tg][j][0], at[0]);
                        at[1] = fmaf(-o0, xs[tg][j][1], at[1]);
                        at[2] = fmaf(-o1, xs[tg][j][0], at[2]);
                        at[3] = fmaf(-o1, xs[tg][j][1], at[3]);
                    }
                }
            }
    }

    if (WARPS > 1) {  // warps 1 .. WARPS - 1 hand their sums to warp 0, which adds them in warp order
#pragma unroll
        for (int first = 0; first < VALS; first += SLICE) {
            if (warp > 0)
#pragma unroll
                for (int v = 0; v < SLICE; ++v) sums[warp - 1][v][lane] = acc[first + v];
            __syncthreads();
            if (warp == 0)
#pragma unroll
                for (int other = 0; other < WARPS - 1; ++other)
#pragma unroll
                    for (int v = 0; v < SLICE; ++v) acc[first + v] += sums[other][v][lane];
            if (first + SLICE < VALS) __syncthreads();
        }
        if (warp > 0) return;
    }
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = row0 + 16 * r + g + 8 * (i >> 1), token = tok[tg] + (i & 1);
                if (row < N && token < M) b32_store(out, (long)token * N + row, acc[(r * TG + tg) * 4 + i] * scale[token]);
            }
}
