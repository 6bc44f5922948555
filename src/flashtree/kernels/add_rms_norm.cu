// The residual add and the RMSNorm after it for a few float32 rows (decode, verify), one row per cluster of
// CLUSTER CTAs (Hopper thread-block clusters, sm_90):
//     total = h + delta;   normed = total * rsqrt(mean(total^2) + eps) * w
// Why: one CTA per row (the Triton kernel) reads h, delta and w and writes total and normed, 100 KB at the 27B
// shape's 5120 columns, through one SM, and took 2.8 us a launch, 128 launches a decode step (2026-12-02). Here each
// of a cluster's CTAs owns one CLUSTER-th of the columns; the row's sum of squares is put together through
// distributed shared memory: each CTA sums its columns in a fixed order, and after a cluster barrier every CTA adds
// the CLUSTER partial sums in rank order, so a row's bits depend neither on the rows beside it nor on timing.
// The _q4_k / _q6_k instances also write normed as the float16 x of the quantized matmul that reads it (mma.cu
// `prep_x`'s outputs, bit for bit: the row's largest |normed| meets through a second cluster barrier), which saves
// that matmul its conversion launch (2.6 us each, 176 of them in the 27B verify: thirtieth session's profile).
// No headers: NVRTC compiles this with the CUDA built-ins alone (kernels/cluster.cuh and quant_matmul/x_f16.cuh
// are put before it).

constexpr int CLUSTER = 8;   // CTAs per row (the portable cluster size)
constexpr int MAX_VECS = 4;  // float4s a thread holds in registers between the add and the scaling

// cluster_rank, cluster_sync, cluster_sync_relaxed, load_from_rank: kernels/cluster.cuh, put before this file

__device__ __forceinline__ float squares(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// The float16 x of the normed row (values t, this CTA's float4 columns): the row's largest |value| from every CTA's
// through distributed shared memory, then `prep_x`'s scaled values, sums and scale. (Its stores come after that
// barrier: a global store before a barrier's release makes the release wait for it, MEMBAR.GPU.)
template <int QT>
__device__ __forceinline__ void store_x_f16(const float4 (&t)[MAX_VECS], int vecs, unsigned rank, long row, int D,
                                            u16* __restrict__ xh, u16* __restrict__ xsum, float* __restrict__ scale) {
    __shared__ float warp_max[32];
    __shared__ float cta_max;
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i)
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(t[i].x), fabsf(t[i].y)), fmaxf(fabsf(t[i].z), fabsf(t[i].w))));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    if (threadIdx.x == 0) {
        float a = 0.0f;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) a = fmaxf(a, warp_max[i]);
        cta_max = a;
    }
    cluster_sync();
    float row_max = 0.0f;
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) row_max = fmaxf(row_max, load_from_rank(&cta_max, r));
    const int e = scale_exponent(row_max);
    const float up = __uint_as_float((u32)(127 + e) << 23);
    if (rank == 0 && threadIdx.x == 0) scale[row] = __uint_as_float((u32)(127 - e) << 23);
    u16* hrow = xh + row * D;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (i * (int)blockDim.x < vecs)  // the whole CTA alike: every lane of a warp shuffles
            store_scaled4<QT>(t[i], up, 4 * ((int)rank * vecs + c), (int)row, D, hrow, xsum, c < vecs);
    }
}

// grid (rows * CLUSTER), blockDim a multiple of 32 with D / (4 * CLUSTER) <= MAX_VECS * blockDim; D % (4 * CLUSTER) == 0
// (QT: D % 256 == 0, whole sub-blocks in each CTA). QT 0: no float16 x; Q4_K, Q6_K: xh [rows, D] in that type's
// order, Q4_K's xsum [rows, D / 256, 16], scale [rows] (`prep_x`'s).
template <int QT>
__device__ __forceinline__ void add_rms_norm(const float* __restrict__ h, const float* __restrict__ delta,
                                             const float* __restrict__ w, float* __restrict__ total,
                                             float* __restrict__ normed, u16* __restrict__ xh, u16* __restrict__ xsum,
                                             float* __restrict__ scale, int D, float eps) {
    __shared__ float warp_sums[32];
    __shared__ float cta_sum;
    const unsigned rank = cluster_rank();
    const long row = blockIdx.x / CLUSTER;
    const int vecs = D / (4 * CLUSTER);  // this CTA's float4 columns
    const long base = row * D / 4 + (long)rank * vecs;
    const float4* h4 = reinterpret_cast<const float4*>(h) + base;
    const float4* d4 = reinterpret_cast<const float4*>(delta) + base;
    float4* t4 = reinterpret_cast<float4*>(total) + base;

    const float4* w4 = reinterpret_cast<const float4*>(w) + (long)rank * vecs;
    float4 t[MAX_VECS], m[MAX_VECS];
    // programmatic dependent launch (kernels/cuda_functions.py; quant_matmul/mma.cu says how): the next kernel may
    // be placed now; the norm weight (constant) is read while the kernel before finishes, h and delta after it
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < vecs) m[i] = w4[c];
    }
    asm volatile("griddepcontrol.wait;" ::: "memory");
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < vecs) {
            const float4 a = h4[c], b = d4[c];
            t[i] = make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
            sum += squares(t[i]);
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int i = 0; i < (int)(blockDim.x >> 5); ++i) s += warp_sums[i];
        cta_sum = s;
    }
    // every CTA's partial sum is written (total is stored after this barrier: a global store before it would make
    // the barrier's release wait for it, MEMBAR.GPU in the machine code)
    cluster_sync();
    float all = 0.0f;
#pragma unroll
    for (unsigned r = 0; r < CLUSTER; ++r) all += load_from_rank(&cta_sum, r);
    const float inv = rsqrtf(all / (float)D + eps);
    float4* n4 = reinterpret_cast<float4*>(normed) + base;
    float4 n[MAX_VECS];
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < vecs)
            n[i] = make_float4(t[i].x * inv * m[i].x, t[i].y * inv * m[i].y, t[i].z * inv * m[i].z, t[i].w * inv * m[i].w);
        else if constexpr (QT != 0)  // past the CTA's columns: zeros for the row's largest |value|
            n[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    // before any global store of the row: its barrier's release would wait for them
    if constexpr (QT != 0) store_x_f16<QT>(n, vecs, rank, row, D, xh, xsum, scale);
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < vecs) {
            t4[c] = t[i];
            n4[c] = n[i];
        }
    }
    cluster_sync_relaxed();
}

#define NORM_ARGS const float* __restrict__ h, const float* __restrict__ delta, const float* __restrict__ w, \
    float* __restrict__ total, float* __restrict__ normed
#define NORM_KERNEL extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)

NORM_KERNEL add_rms_norm_f32(NORM_ARGS, int D, float eps) {
    add_rms_norm<0>(h, delta, w, total, normed, nullptr, nullptr, nullptr, D, eps);
}
NORM_KERNEL add_rms_norm_f32_q4_k(NORM_ARGS, u16* __restrict__ xh, u16* __restrict__ xsum, float* __restrict__ scale,
                                  int D, float eps) {
    add_rms_norm<Q4_K>(h, delta, w, total, normed, xh, xsum, scale, D, eps);
}
NORM_KERNEL add_rms_norm_f32_q6_k(NORM_ARGS, u16* __restrict__ xh, float* __restrict__ scale, int D, float eps) {
    add_rms_norm<Q6_K>(h, delta, w, total, normed, xh, nullptr, scale, D, eps);
}
