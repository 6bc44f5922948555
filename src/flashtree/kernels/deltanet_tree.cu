// The gated delta rule over a draft tree (the verify of a DeltaNet layer), float32 FMA throughout: the same math as
// gated_delta_triton.py's `_tree_kernel` (the `ancestor_chunk` form; module docstring there), one CTA per value head
// and 32 value columns.
// Why CUDA C: the Triton kernel took 36.6 us a layer on the 27B verify's 23-node trees (H200, 2026-12-05), where
// the layer reads 3 MB. Its substitution runs a tree level a round, each round a tensor-core product whose result
// goes through shared memory and a barrier to become the next round's operand (309 instructions a warp, ~0.84 us a
// level), and its four K-long products split every operand for tf32x3. Here one warp keeps its column of U in
// registers and substitutes node by node, so a node waits for one FMA of its parent's row (the other terms are
// summed while the rows before it finish); the products are plain float32 FMAs over operands in shared memory.
// No headers: NVRTC compiles this with the CUDA built-ins alone. Outside a device compile (no __CUDA_ARCH__) the file
// builds on the host for tests/kernels/deltanet_tree_host.cpp, which runs a CTA's threads as host threads: the
// asynchronous copies become plain ones and the dynamic shared memory a buffer of the host's.

#ifdef __CUDA_ARCH__
#define SHARED_FLOATS(name) extern __shared__ __align__(16) float name[]
#else
#define SHARED_FLOATS(name) float* name = host_shared()
#endif

#ifndef TREE_WARPS
#define TREE_WARPS 4  // gated_delta_cuda.py `source` defines it for an instance of another warp count
#endif
constexpr int COLS = 32;                  // value columns a CTA owns (a lane's column in the substitution)
constexpr int WARPS = TREE_WARPS;         // warp w takes nodes w, w + WARPS, ... in the column-wise phases
constexpr int THREADS = 32 * WARPS;
constexpr int WARP_BITS = WARPS == 8 ? 3 : 2;  // tid >> WARP_BITS is tid / WARPS (shifts, as the 4-warp kernel was)
static_assert(WARPS == 4 || WARPS == 8, "the tree kernel runs on 4 or 8 warps");

// Shared memory (dynamic, floats): K and Q rows [NODES][DK + 4] (the pad keeps the LDS.128 of 4 rows apart in
// banks), S0's columns [DK][COLS], A and the decayed Q K^T [NODES][NODES + 1], U [NODES][COLS], then per node
// Gamma, beta, g, the inclusive ancestor bits and the parent.
template <int DK, int NODES> struct TreeSmem {
    static constexpr int PITCH = DK + 4;
    static constexpr int TRI = NODES + 1;
    static constexpr int K = 0;
    static constexpr int Q = K + NODES * PITCH;
    static constexpr int S = Q + NODES * PITCH;
    static constexpr int A = S + DK * COLS;
    static constexpr int QK = A + NODES * TRI;
    static constexpr int U = QK + NODES * TRI;
    static constexpr int GAMMA = U + NODES * COLS;
    static constexpr int BETA = GAMMA + NODES;
    static constexpr int G = BETA + NODES;
    static constexpr int ANC = G + NODES;     // as unsigned
    static constexpr int PARENT = ANC + NODES; // as int
    static constexpr int FLOATS = PARENT + NODES;
};

struct TreeArgs {
    const float *q, *k, *v, *g, *beta, *state;
    const long long* parents;
    float *o, *u, *gamma, *k_out;
    int T, HK;
    int sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, sg_t, sg_h, sb_t, sb_h, ss_h, ss_k, so_t, so_h, su_t, su_h, sgm_t,
        sko_t, sko_h;
    int store_fold, store_k;
#ifdef TREE_PHASE_CLOCKS
    long long* clocks;
#endif
};

#ifdef TREE_PHASE_CLOCKS
// The phase-clock instance (gated_delta_cuda.source(..., clocks=True), `sweep_deltanet_tree.py --phases`): thread 0
// of each CTA writes PHASE_WORDS words, the SM clock at each phase boundary (stamps 0-6), its SM, and the global
// timer (ns) at the start and the end, which also convert the cycles to time.
constexpr int PHASE_STAMPS = 7;
constexpr int PHASE_WORDS = PHASE_STAMPS + 3;
__device__ __forceinline__ long long* phase_words(const TreeArgs& a) {
    return a.clocks + ((long)blockIdx.y * gridDim.x + blockIdx.x) * PHASE_WORDS;
}
__device__ __forceinline__ long long global_ns() {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ void stamp(const TreeArgs& a, int k) {
    if (threadIdx.x != 0) return;
    long long* w = phase_words(a);
    if (k == 0) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        w[PHASE_STAMPS] = sm;
        w[PHASE_STAMPS + 1] = global_ns();
    }
    w[k] = clock64();
    if (k == PHASE_STAMPS - 1) w[PHASE_STAMPS + 2] = global_ns();
}
#define PHASE(a, k) stamp(a, k)
#else
#define PHASE(a, k)
#endif

__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
    acc = fmaf(a.x, b.x, acc);
    acc = fmaf(a.y, b.y, acc);
    acc = fmaf(a.z, b.z, acc);
    return fmaf(a.w, b.w, acc);
}

// 16 bytes global -> shared without registers (cp.async); `live` false writes zeros (no byte is read)
__device__ __forceinline__ void copy16(float* smem, const float* gmem, bool live) {
#ifdef __CUDA_ARCH__
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(live ? 16 : 0)
                 : "memory");
#else
    for (int i = 0; i < 4; ++i) smem[i] = live ? gmem[i] : 0.f;
#endif
}

// the copies above have landed (this thread's); a __syncthreads after it publishes them to the CTA
__device__ __forceinline__ void copies_landed() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_all;\n" ::: "memory");
#endif
}

// programmatic dependent launch (cuda_functions.dependent_launches): the next kernel may start, and this one waits
// for the one before it; without the launch attribute both return at once
__device__ __forceinline__ void start_after_predecessors() {
#ifdef __CUDA_ARCH__
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// 1. K and Q rows of the node's key head, S0's columns, parents, g and beta into shared memory (zeros past T). The
// rows go by cp.async, all in flight at once (loads staged through registers went out a few at a time: ptxas kept
// the registers low and waited a memory latency per group)
template <int DK, int NODES>
__device__ __forceinline__ void load_inputs(const TreeArgs& a, float* sm, int h, int hq, int c0) {
    typedef TreeSmem<DK, NODES> L;
    constexpr int ROW_VECS = DK / 4;
    const int tid = threadIdx.x;
    for (int e = tid; e < NODES * ROW_VECS; e += THREADS) {
        const int i = e / ROW_VECS, d = 4 * (e % ROW_VECS);
        const bool live = i < a.T;
        const long row = live ? i : 0;  // a dead row's address stays inside the tensor
        copy16(sm + L::K + i * L::PITCH + d, a.k + row * a.sk_t + (long)hq * a.sk_h + d, live);
        copy16(sm + L::Q + i * L::PITCH + d, a.q + row * a.sq_t + (long)hq * a.sq_h + d, live);
    }
    for (int e = tid; e < DK * COLS / 4; e += THREADS) {
        const int d = e / (COLS / 4), c = 4 * (e % (COLS / 4));
        copy16(sm + L::S + 4 * e, a.state + (long)h * a.ss_h + (long)d * a.ss_k + c0 + c, true);
    }
    if (tid < NODES) {
        const bool live = tid < a.T;
        const int p = live ? (int)a.parents[tid] : -1;
        reinterpret_cast<int*>(sm + L::PARENT)[tid] = (p >= 0 && p < tid) ? p : -1;  // a parent >= i counts as -1
        sm[L::G + tid] = live ? a.g[(long)tid * a.sg_t + (long)h * a.sg_h] : 0.f;
        sm[L::BETA + tid] = live ? a.beta[(long)tid * a.sb_t + (long)h * a.sb_h] : 0.f;
    }
    copies_landed();
}

// 2a. Gamma_i (g summed from node i up to its root, nearest first) and the inclusive ancestor bits, a lane a node
template <int DK, int NODES>
__device__ __forceinline__ void chase_parents(const TreeArgs& a, float* sm) {
    typedef TreeSmem<DK, NODES> L;
    const int i = threadIdx.x;
    if (i >= NODES) return;
    const int* parent = reinterpret_cast<const int*>(sm + L::PARENT);
    unsigned bits = 0;
    float gamma = 0.f;
    if (i < a.T) {
        bits = 1u << i;
        gamma = sm[L::G + i];
        for (int p = parent[i]; p >= 0; p = parent[p]) {
            bits |= 1u << p;
            gamma += sm[L::G + p];
        }
    }
    reinterpret_cast<unsigned*>(sm + L::ANC)[i] = bits;
    sm[L::GAMMA + i] = gamma;
}

template <int DK, int NODES>
__device__ __forceinline__ void tree_verify(const TreeArgs& a) {
    typedef TreeSmem<DK, NODES> L;
    static_assert(NODES % WARPS == 0 && NODES <= 32, "the warps take whole rounds of nodes; a lane's bit a node");
    constexpr int PER_WARP = NODES / WARPS;  // nodes a thread takes in the column-wise phases
    SHARED_FLOATS(sm);
    PHASE(a, 0);
    start_after_predecessors();
    PHASE(a, 1);
    const int h = blockIdx.x, hq = h % a.HK, c0 = blockIdx.y * COLS;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    load_inputs<DK, NODES>(a, sm, h, hq, c0);
    float v[PER_WARP];  // this thread's values of V, first needed after the products: loaded under them
#pragma unroll
    for (int n = 0; n < PER_WARP; ++n) {
        const int i = warp + WARPS * n;
        v[n] = i < a.T ? a.v[(long)i * a.sv_t + (long)h * a.sv_h + c0 + lane] : 0.f;
    }
    __syncthreads();
    PHASE(a, 2);
    chase_parents<DK, NODES>(a, sm);

    // 2b. K S0 and Q S0 for (node warp + WARPS n, column lane); K K^T and Q K^T for (node tid / WARPS, node
    // tid % WARPS + WARPS m): 32 rows of NODES pairs over the CTA's threads either way
    float ks[PER_WARP], qs[PER_WARP], kk[PER_WARP], qk[PER_WARP];
#pragma unroll
    for (int n = 0; n < PER_WARP; ++n) ks[n] = qs[n] = kk[n] = qk[n] = 0.f;
    const int row = tid >> WARP_BITS, jb = tid & (WARPS - 1);
    const bool pairs = row < NODES;
    const float* krow = sm + L::K + (pairs ? row : 0) * L::PITCH;
    const float* qrow = sm + L::Q + (pairs ? row : 0) * L::PITCH;
#pragma unroll 2
    for (int d = 0; d < DK; d += 4) {
        const float s0 = sm[L::S + d * COLS + lane], s1 = sm[L::S + (d + 1) * COLS + lane];
        const float s2 = sm[L::S + (d + 2) * COLS + lane], s3 = sm[L::S + (d + 3) * COLS + lane];
        const float4 ki = *reinterpret_cast<const float4*>(krow + d);
        const float4 qi = *reinterpret_cast<const float4*>(qrow + d);
#pragma unroll
        for (int n = 0; n < PER_WARP; ++n) {
            const int i = warp + WARPS * n;
            const float4 kv = *reinterpret_cast<const float4*>(sm + L::K + i * L::PITCH + d);
            const float4 qv = *reinterpret_cast<const float4*>(sm + L::Q + i * L::PITCH + d);
            ks[n] = dot4(kv, make_float4(s0, s1, s2, s3), ks[n]);
            qs[n] = dot4(qv, make_float4(s0, s1, s2, s3), qs[n]);
            const float4 kj = *reinterpret_cast<const float4*>(sm + L::K + (jb + WARPS * n) * L::PITCH + d);
            kk[n] = dot4(ki, kj, kk[n]);
            qk[n] = dot4(qi, kj, qk[n]);
        }
    }
    __syncthreads();  // Gamma and the ancestor bits
    PHASE(a, 3);

    // 3. A = beta_i exp(Gamma_i - Gamma_j) k_i.k_j over strict ancestors j, the decayed q_i.k_j over
    // ancestors-or-self, the right-hand side beta (V - exp(Gamma) K S0) into U, and exp(Gamma) Q S0 kept
    const unsigned* anc = reinterpret_cast<const unsigned*>(sm + L::ANC);
    if (pairs) {
        const unsigned bits = anc[row];
        const float gamma_i = sm[L::GAMMA + row], beta_i = sm[L::BETA + row];
#pragma unroll
        for (int m = 0; m < PER_WARP; ++m) {
            const int j = jb + WARPS * m;
            const float decay = (bits >> j) & 1u ? expf(gamma_i - sm[L::GAMMA + j]) : 0.f;
            sm[L::A + row * L::TRI + j] = j == row ? 0.f : beta_i * decay * kk[m];
            sm[L::QK + row * L::TRI + j] = decay * qk[m];
        }
    }
    float out[PER_WARP];
#pragma unroll
    for (int n = 0; n < PER_WARP; ++n) {
        const int i = warp + WARPS * n;
        const float e = expf(sm[L::GAMMA + i]);
        sm[L::U + i * COLS + lane] = sm[L::BETA + i] * (v[n] - e * ks[n]);
        out[n] = e * qs[n];
    }
    __syncthreads();
    PHASE(a, 4);

    // 4. (I + A) U = rhs, node by node (parents precede children): warp 0, a column a lane, U in registers; node i's
    // sum runs over j in order, so it waits only on the last rows' FMAs
    if (warp == 0) {
        float u[NODES];
#pragma unroll
        for (int i = 0; i < NODES; ++i) {
            float acc = sm[L::U + i * COLS + lane];
#pragma unroll
            for (int j = 0; j < i; ++j) acc = fmaf(-sm[L::A + i * L::TRI + j], u[j], acc);
            u[i] = acc;
            sm[L::U + i * COLS + lane] = acc;
        }
    }
    __syncthreads();
    PHASE(a, 5);

    // 5. O = exp(Gamma) Q S0 + (decayed Q K^T) U; the stores
#pragma unroll
    for (int n = 0; n < PER_WARP; ++n) {
        const int i = warp + WARPS * n;
        float acc = out[n];
#pragma unroll 4
        for (int j = 0; j < NODES; ++j)  // QK is 0 past node i
            acc = fmaf(sm[L::QK + i * L::TRI + j], sm[L::U + j * COLS + lane], acc);
        if (i < a.T) {
            a.o[(long)i * a.so_t + (long)h * a.so_h + c0 + lane] = acc;
            if (a.store_fold) a.u[(long)i * a.su_t + (long)h * a.su_h + c0 + lane] = sm[L::U + i * COLS + lane];
        }
    }
    if (a.store_fold && blockIdx.y == 0 && tid < a.T) a.gamma[(long)tid * a.sgm_t + h] = sm[L::GAMMA + tid];
    if (a.store_k && blockIdx.y == 0 && h < a.HK) {  // the keys the commit folds with, one CTA per key head
        for (int e = tid; e < a.T * DK; e += THREADS) {
            const int i = e / DK, d = e % DK;
            a.k_out[(long)i * a.sko_t + (long)h * a.sko_h + d] = sm[L::K + i * L::PITCH + d];
        }
    }
    PHASE(a, 6);
}
