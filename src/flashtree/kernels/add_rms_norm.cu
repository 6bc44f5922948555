// The residual add and the RMSNorm after it for a few float32 rows (decode, verify), one row per cluster of
// CLUSTER CTAs (Hopper thread-block clusters, sm_90):
//     total = h + delta;   normed = total * rsqrt(mean(total^2) + eps) * w
// Why: one CTA per row (the Triton kernel) reads h, delta and w and writes total and normed, 100 KB at the 27B
// shape's 5120 columns, through one SM, and took 2.8 us a launch, 128 launches a decode step (2026-12-02). Here each
// of a cluster's CTAs owns one CLUSTER-th of the columns; the row's sum of squares is put together through
// distributed shared memory: each CTA sums its columns in a fixed order, and after a cluster barrier every CTA adds
// the CLUSTER partial sums in rank order, so a row's bits depend neither on the rows beside it nor on timing.
// No headers: NVRTC compiles this with the CUDA built-ins alone.

constexpr int CLUSTER = 8;   // CTAs per row (the portable cluster size)
constexpr int MAX_VECS = 4;  // float4s a thread holds in registers between the add and the scaling

// cluster_rank, cluster_sync, cluster_sync_relaxed, load_from_rank: kernels/cluster.cuh, put before this file

__device__ __forceinline__ float squares(float4 v) { return v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w; }

// grid (rows * CLUSTER), blockDim a multiple of 32 with D / (4 * CLUSTER) <= MAX_VECS * blockDim; D % (4 * CLUSTER) == 0
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) __launch_bounds__(1024)
add_rms_norm_f32(const float* __restrict__ h, const float* __restrict__ delta, const float* __restrict__ w,
                 float* __restrict__ total, float* __restrict__ normed, int D, float eps) {
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
#pragma unroll
    for (int i = 0; i < MAX_VECS; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < vecs) {
            t4[c] = t[i];
            n4[c] = make_float4(t[i].x * inv * m[i].x, t[i].y * inv * m[i].y, t[i].z * inv * m[i].z,
                                t[i].w * inv * m[i].w);
        }
    }
    cluster_sync_relaxed();
}
