// Q8_0 weights times 1-32 rows of x on tensor cores (mma.sync m16n8k16, float16 in, float32 sums), read from GGUF's
// own bytes split into their two fields (QuantWeight's field-major copy: qs [N, K] int8, d [N, K / 32] float16), so
// no re-layout at load. Put after x_f16.cuh (its float16 helpers); x comes as mma.cu's `prep_x<Q4_K>` writes it: each
// token scaled by a power of two into [256, 512) and rounded to float16 (exact but for that rounding), with 2^-e.
//
// Exact integer weights: a byte q (int8) becomes float16 1024 + (q ^ 0x80) = q + 1152 by one permute under the
// exponent byte 0x64, less 1152 (one float16 subtraction, exact): no int-to-float conversion. A 32-value block's
// scale d is applied in float32 to the block's partial sums (two MMAs into a fresh accumulator), never to the
// weights, so nothing is rounded below the float32 sums but x's float16.
//
// Lane (g, t) of a warp (g = lane / 4, t = lane % 4) reads 8 bytes of each of its rows g and g + 8 per block: values
// 8t .. 8t + 7, of which 8t + 4h .. + 3 feed MMA step h (h = 0, 1) as its A slots 2t, 2t + 1 (bytes 0, 1) and
// 2t + 8, 2t + 9 (bytes 2, 3). K's order inside a block is thereby permuted, the same way for x: lane (g, t) reads
// x's 8 values 8t .. 8t + 7 of the block in one 16-byte load, step h's B slots from values 8t + 4h .. + 3.
//
// A CTA owns RT row tiles of 16 rows (RT x 16 output rows) and all of K, its WARPS warps taking chunks of 128 values
// (4 blocks) in turn, their sums added in warp order in shared memory: a fixed order for every output, so a row's
// bits depend on neither the row count M nor the other rows. x's rows past M read row M - 1 and are never stored.

#define Q8_CHUNK 128  // values a warp takes at once: 4 blocks of 32

__device__ __forceinline__ void q8_mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Weights are read once: past L1 (the 60 MB L2 keeps nothing of a matrix either)
__device__ __forceinline__ uint2 q8_load_stream(const unsigned char* p) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0,%1}, [%2];\n" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Four int8 values -> two float16 pairs (values 0, 1 and 2, 3), exact. `exponent` holds 0x64646464 and `bias`
// 0x64806480 (1152.0 twice) in registers: the permute and the subtraction take one immediate each.
__device__ __forceinline__ void q8_pairs(u32 word, u32 exponent, u32 bias, u32& lo, u32& hi) {
    const u32 u = word ^ 0x80808080u;
    asm("prmt.b32 %0, %1, %2, 0x4140;\n" : "=r"(lo) : "r"(u), "r"(exponent));
    asm("prmt.b32 %0, %1, %2, 0x4342;\n" : "=r"(hi) : "r"(u), "r"(exponent));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(lo) : "r"(bias));
    asm("sub.f16x2 %0, %0, %1;\n" : "+r"(hi) : "r"(bias));
}

__device__ __forceinline__ u32 q8_opaque(u32 v) {  // a constant the compiler keeps in a register
    u32 r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ void q8_store(u16* out, long i, float v) {
    const u32 bits = __float_as_uint(v);  // bf16, rounded to nearest even (no NaN here: finite sums)
    out[i] = (u16)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}
__device__ __forceinline__ void q8_store(float* out, long i, float v) { out[i] = v; }

template <int TG, int RT, int WARPS, typename OT>
__device__ __forceinline__ void q8_0_mm(const u16* __restrict__ xh, const float* __restrict__ scale,
                                        const unsigned char* __restrict__ qs, const u16* __restrict__ d,
                                        OT* __restrict__ out, int M, int N, int K) {
    // each lane's sums: row tile r, token group tg, C fragment value i at (r TG + tg) 4 + i
    constexpr int VALS = RT * TG * 4;
    // the warps' sums meet in shared memory SLICE values at a time: at most 40 KB of static shared memory
    constexpr int LIMIT = 40 * 1024 / ((WARPS > 1 ? WARPS - 1 : 1) * 32 * 4);
    constexpr int SLICE = VALS <= LIMIT ? VALS : VALS / 2 <= LIMIT ? VALS / 2 : VALS / 4 <= LIMIT ? VALS / 4 : VALS / 8;
    __shared__ float sums[WARPS > 1 ? WARPS - 1 : 1][SLICE][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * 16 * RT;
    const u32 exponent = q8_opaque(0x64646464u), bias = q8_opaque(0x64806480u);

    const unsigned char* qrow[RT][2];
    const u16* drow[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const long row = min(row0 + 16 * r + g + 8 * h, N - 1);  // a partial last CTA: row N - 1 again, unstored
            qrow[r][h] = qs + row * K + 8 * t;
            drow[r][h] = d + row * (K >> 5);
        }
    const u16* xrow[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) xrow[tg] = xh + (long)min(8 * tg + g, M - 1) * K + 8 * t;

    float acc[VALS];
#pragma unroll
    for (int v = 0; v < VALS; ++v) acc[v] = 0.0f;

    const int chunks = K / Q8_CHUNK;
#pragma unroll 2
    for (int c = warp; c < chunks; c += WARPS) {
        const int k0 = c * Q8_CHUNK;
        uint2 w[RT][2][4];  // 8 bytes of rows g, g + 8 per block
        uint2 ds[RT][2];    // the 4 blocks' d of rows g, g + 8
        uint4 xv[TG][4];    // 8 float16 x per token group and block
#pragma unroll
        for (int r = 0; r < RT; ++r)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int j = 0; j < 4; ++j) w[r][h][j] = q8_load_stream(qrow[r][h] + k0 + 32 * j);
                ds[r][h] = __ldg(reinterpret_cast<const uint2*>(drow[r][h] + (k0 >> 5)));
            }
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int j = 0; j < 4; ++j) xv[tg][j] = __ldg(reinterpret_cast<const uint4*>(xrow[tg] + k0 + 32 * j));
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                u32 a[2][4];  // step h: rows g (lo, hi of its 4 bytes) and g + 8
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    q8_pairs(h ? w[r][0][j].y : w[r][0][j].x, exponent, bias, a[h][0], a[h][2]);
                    q8_pairs(h ? w[r][1][j].y : w[r][1][j].x, exponent, bias, a[h][1], a[h][3]);
                }
                const u32 d0 = (j < 2 ? ds[r][0].x : ds[r][0].y) >> (16 * (j & 1));
                const u32 d1 = (j < 2 ? ds[r][1].x : ds[r][1].y) >> (16 * (j & 1));
                const float s0 = half_to_float((u16)(d0 & 0xFFFF)), s1 = half_to_float((u16)(d1 & 0xFFFF));
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) {
                    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                    q8_mma(part, a[0][0], a[0][1], a[0][2], a[0][3], xv[tg][j].x, xv[tg][j].y);
                    q8_mma(part, a[1][0], a[1][1], a[1][2], a[1][3], xv[tg][j].z, xv[tg][j].w);
                    float* at = acc + (r * TG + tg) * 4;
                    at[0] = fmaf(s0, part[0], at[0]);
                    at[1] = fmaf(s0, part[1], at[1]);
                    at[2] = fmaf(s1, part[2], at[2]);
                    at[3] = fmaf(s1, part[3], at[3]);
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
                const int row = row0 + 16 * r + g + 8 * (i >> 1), tok = 8 * tg + 2 * t + (i & 1);
                if (row < N && tok < M) q8_store(out, (long)tok * N + row, acc[(r * TG + tg) * 4 + i] * scale[tok]);
            }
}
