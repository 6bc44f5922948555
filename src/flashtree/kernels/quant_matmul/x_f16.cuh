// qmh's float16 x (the form mma.cu's `prep_x` writes and its float16 kernels read): each token scaled by a power of
// two 2^e so that its largest |x| is in [256, 512), Q4_K's sub-block sums beside it, Q6_K's values in its MMA steps'
// order. Put before mma.cu and add_rms_norm.cu (kernels/quant_matmul/mma.py `X_F16_SOURCE`), so that a norm that
// writes qmh's x as well writes prep_x's bits. No headers: NVRTC compiles this with the CUDA built-ins alone.

typedef unsigned int u32;
typedef unsigned short u16;

#define Q4_K 12
#define Q6_K 14

__device__ __forceinline__ float half_to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;\n" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 float_to_half(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

// e with max |x 2^e| in [256, 512): amax = m 2^p, m in [0.5, 1), 2^(9 - p) (0 for a row of zeros or of infinities)
__device__ __forceinline__ int scale_exponent(float amax) {
    int e = 0;
    if (amax > 0.0f && amax <= 3.0e38f) e = min(125, max(-125, 9 - (((int)(__float_as_uint(amax) >> 23) & 0xFF) - 126)));
    return e;
}

// Q4_K's x sums: xsum [M, K / 256, 16] f16, per super-block and lane t the sums of sub-blocks 2t, 2t + 1 as hi
// (2) then lo (2). h: values i .. i + 7 of row tok; 4 threads per 32-value sub-block.
__device__ __forceinline__ void store_sub_block_sum(const u32 (&h)[4], int i, int tok, int K, u16* __restrict__ xsum) {
    float sum = 0.0f;
#pragma unroll
    for (int q = 0; q < 4; ++q) sum += half_to_float((u16)(h[q] & 0xFFFF)) + half_to_float((u16)(h[q] >> 16));
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 1);
    sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
    if ((threadIdx.x & 3) == 0) {
        const int sub = i >> 5, sb = sub >> 3, j = sub & 7;  // sub-block j of super-block sb
        const u16 hi = float_to_half(sum);
        const u16 lo = float_to_half(sum - half_to_float(hi));
        u16* rec = xsum + ((long)tok * (K >> 8) + sb) * 16 + 4 * (j >> 1) + (j & 1);
        rec[0] = hi;
        rec[2] = lo;
    }
}

// Q6_K's qmh reads lane t's x of MMA steps 2j, 2j + 1 (values 16 (2j + o) + 4t .. + 3 of each 32) in one
// 16-byte load, so they are stored side by side, at 32j + 8t + 4o. h: values i .. i + 7 (i = 32j + 8c), those
// of lanes 2 (c & 1) and 2 (c & 1) + 1 in step 2j + (c >> 1).
__device__ __forceinline__ void store_in_step_pairs(const u32 (&h)[4], int i, u16* __restrict__ hrow) {
    const int c = (i >> 3) & 3;
    u16* at = hrow + (i & ~31) + 16 * (c & 1) + 4 * (c >> 1);
    *reinterpret_cast<uint2*>(at) = make_uint2(h[0], h[1]);
    *reinterpret_cast<uint2*>(at + 8) = make_uint2(h[2], h[3]);
}

// 8 values of row tok from i (f) times `up` into xh in QT's order, and Q4_K's sub-block sums
template <int QT>
__device__ __forceinline__ void store_scaled(const float (&f)[8], float up, int i, int tok, int K, u16* __restrict__ hrow,
                                             u16* __restrict__ xsum) {
    u32 h[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) h[q] = (u32)float_to_half(f[2 * q] * up) | ((u32)float_to_half(f[2 * q + 1] * up) << 16);
    if constexpr (QT == Q4_K) {
        *reinterpret_cast<uint4*>(hrow + i) = make_uint4(h[0], h[1], h[2], h[3]);
        store_sub_block_sum(h, i, tok, K, xsum);
    } else {
        store_in_step_pairs(h, i, hrow);
    }
}

// `store_scaled`'s outputs where each thread holds 4 values, a float4 at column col (4-aligned), consecutive float4s
// in consecutive lanes (8 lanes a 32-value sub-block, every lane of the warp here): the same bits, Q4_K's sums
// added in `store_sub_block_sum`'s order (an even lane takes its odd neighbour's pairs, then the four 8-value sums
// meet as there). `valid`: whether the lane's values belong to the row (stores only; every lane shuffles).
template <int QT>
__device__ __forceinline__ void store_scaled4(float4 v, float up, int col, int tok, int K, u16* __restrict__ hrow,
                                              u16* __restrict__ xsum, bool valid) {
    const u32 h0 = (u32)float_to_half(v.x * up) | ((u32)float_to_half(v.y * up) << 16);
    const u32 h1 = (u32)float_to_half(v.z * up) | ((u32)float_to_half(v.w * up) << 16);
    if constexpr (QT == Q4_K) {
        if (valid) *reinterpret_cast<uint2*>(hrow + col) = make_uint2(h0, h1);
        const float p0 = half_to_float((u16)(h0 & 0xFFFF)) + half_to_float((u16)(h0 >> 16));
        const float p1 = half_to_float((u16)(h1 & 0xFFFF)) + half_to_float((u16)(h1 >> 16));
        const float p2 = __shfl_down_sync(0xFFFFFFFFu, p0, 1), p3 = __shfl_down_sync(0xFFFFFFFFu, p1, 1);
        float sum = 0.0f;
        sum += p0;
        sum += p1;
        sum += p2;
        sum += p3;
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 2);
        sum += __shfl_xor_sync(0xFFFFFFFFu, sum, 4);
        if (valid && (threadIdx.x & 7) == 0) {
            const int sub = col >> 5, sb = sub >> 3, j = sub & 7;
            const u16 hi = float_to_half(sum);
            const u16 lo = float_to_half(sum - half_to_float(hi));
            u16* rec = xsum + ((long)tok * (K >> 8) + sb) * 16 + 4 * (j >> 1) + (j & 1);
            rec[0] = hi;
            rec[2] = lo;
        }
    } else if (valid) {  // `store_in_step_pairs`' place of values col .. col + 3
        const int i = col & ~7, c = (i >> 3) & 3;
        u16* at = hrow + (i & ~31) + 16 * (c & 1) + 4 * (c >> 1) + (col & 4 ? 8 : 0);
        *reinterpret_cast<uint2*>(at) = make_uint2(h0, h1);
    }
}
