// Quantized matmul on tensor cores: out[M, N] = x[M, K] @ W[N, K]^T for 1 <= M <= 32 rows of x (bf16 or float32;
// out in bf16 or float32), W kept as Q4_K or Q6_K blocks re-laid at load in mma.sync fragment order (see mma.py
// for the layout).
//
// One m16n8k16 MMA multiplies 16 weight rows (the MMA's M) by 8 tokens (its N) over 16 values of K.
// The quantized integers go into the A fragment exactly: a nibble q is OR-ed into the mantissa of
// bf16 128.0 (0x4300 | q = 128 + q; one LOP3 per two values, no conversion instructions). Each
// sub-block's MMA partial is then scaled in float32 by the sub-block's scale, and the constant part
// (128 and Q4_K's min) is removed with the sub-block's sum of x, itself an MMA against ones. So the
// weights are never rounded; only x (to bf16) and the float32 accumulation round.
//
// A warp owns RT tiles of 16 rows and walks a share of the 256-value super-blocks (K); the CTA's
// warps split K and are summed in a fixed order through shared memory; with SPLITS > 1 CTAs of one
// row group split K further and the last CTA to finish sums their float32 partials in split order
// (an atomic ticket, reset for the next call): results are deterministic and there is one launch.
// (Giving each warp rows of its own, so that the CTA's warps share x through L1, measured no faster
// on the H200: with more than 8 tokens the loop's instructions limit, not x's L2 traffic. Nor did a
// cp.async pipeline through shared memory: it keeps more bytes in flight, but these loops are bound
// by the instructions they issue, not by memory latency.) `qmv` is the one-row (decode) form; `qmh` is
// the 2-32 row form in float16 (Q4_K and Q6_K), with the sub-block scales inside the (exact) weights.
// No headers: NVRTC compiles this with nothing but the CUDA built-ins (x_f16.cuh, the float16 x's helpers shared
// with add_rms_norm.cu, is put before it: mma.py `source`).

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

__device__ __forceinline__ u16 float_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;\n" : "=h"(h) : "f"(f));
    return h;
}

// x comes as bf16 (u16) or float32 rows, and the output goes out as either: a bf16 model's activations are
// float32 between kernels (docs/FIDELITY.md, design D), so these kernels read and write them without a cast
// launch. The bf16 MMAs take float32 x rounded to nearest bf16 at the load.
__device__ __forceinline__ u32 bf16x2_of(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ uint4 x8_bf16(const u16* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }
__device__ __forceinline__ uint4 x8_bf16(const float* p) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    return make_uint4(bf16x2_of(a.x, a.y), bf16x2_of(a.z, a.w), bf16x2_of(b.x, b.y), bf16x2_of(b.z, b.w));
}
__device__ __forceinline__ uint2 x4_bf16(const u16* p) { return __ldg(reinterpret_cast<const uint2*>(p)); }
__device__ __forceinline__ uint2 x4_bf16(const float* p) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p));
    return make_uint2(bf16x2_of(a.x, a.y), bf16x2_of(a.z, a.w));
}
// eight consecutive values as float32
__device__ __forceinline__ void x8_f32(const u16* p, float (&f)[8]) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
    const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int q = 0; q < 4; ++q) f[2 * q] = __uint_as_float(words[q] << 16), f[2 * q + 1] = __uint_as_float(words[q] & 0xFFFF0000u);
}
__device__ __forceinline__ void x8_f32(const float* p, float (&f)[8]) {
    const float4 a = __ldg(reinterpret_cast<const float4*>(p)), b = __ldg(reinterpret_cast<const float4*>(p) + 1);
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w; f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}
__device__ __forceinline__ void store_out(u16* out, long i, float v) { out[i] = float_to_bf16(v); }
__device__ __forceinline__ void store_out(float* out, long i, float v) { out[i] = v; }

// A value as the output type holds it (bf16 rounded to nearest; float32 as it is)
__device__ __forceinline__ float as_out(const u16*, float v) { return __uint_as_float((u32)float_to_bf16(v) << 16); }
__device__ __forceinline__ float as_out(const float*, float v) { return v; }

// GLU (the MLP's SiLU(gate) * up) of one output from its gate and up sums, rounded where the unfused path rounds
// (activations.silu_mul after a matmul writing gate and up in the output type): each sum, SiLU, the product
template <typename OT>
__device__ __forceinline__ void store_glu(OT* out, long i, float gate, float up) {
    const float g = as_out(out, gate), u = as_out(out, up);
    store_out(out, i, as_out(out, g / (1.0f + __expf(-g))) * u);
}

// Constants the hot loop ORs and permutes with, made once into registers the compiler cannot see
// through: otherwise it rematerializes them (a MOV per use) because LOP3/PRMT take one immediate.
struct Consts {
    u32 bf16_128;  // 0x43004300: bf16 128.0 in both halves
    u32 f32_2p23;  // 0x4B000000: float 2^23
    u32 f16_1024;  // 0x64006400: float16 1024.0 in both halves
    u32 f16_256;   // 0x5C005C00: float16 256.0 (Q6_K's qmh)
    u32 f16_64;    // 0x54005400: float16 64.0 (Q6_K's qmh)
};

__device__ __forceinline__ u32 opaque(u32 v) {
    u32 r;
    asm volatile("mov.b32 %0, %1;\n" : "=r"(r) : "r"(v));
    return r;
}

__device__ __forceinline__ Consts make_consts() {
    return Consts{opaque(0x43004300u), opaque(0x4B000000u), opaque(0x64006400u), opaque(0x5C005C00u), opaque(0x54005400u)};
}

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

template <int QT, int RT>
__device__ __forceinline__ void load_weights(const unsigned char* quants, const unsigned char* high,
                                             const unsigned char* scales, const u16* dvals, int tile0, int SB,
                                             int sb, int lane, int g, Weights<QT, RT>& w) {
    typedef Type<QT> T;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        const long tsb = (long)(tile0 + rt) * SB + sb;
        const uint4* qp = reinterpret_cast<const uint4*>(quants + tsb * T::QUANT_BYTES) + lane;
#pragma unroll
        for (int j = 0; j < 4; ++j) w.q[rt][j] = load_stream(qp + 32 * j);
        if constexpr (T::HIGH_BYTES > 0) {
            const uint4* hp = reinterpret_cast<const uint4*>(high + tsb * T::HIGH_BYTES) + lane;
            w.qh[rt][0] = load_stream(hp);
            w.qh[rt][1] = load_stream(hp + 32);
        }
        load_scales<QT>(scales, dvals, tsb, g, w.sc[rt]);
    }
}

// This CTA's super-blocks: split blockIdx.y of SPLITS.
struct KRange {
    int begin, end;
};

template <int SPLITS>
__device__ __forceinline__ KRange split_k(int SB) {
    const int per = (SB + SPLITS - 1) / SPLITS;
    const int begin = blockIdx.y * per;
    return KRange{begin, min(SB, begin + per)};
}

// Programmatic dependent launch (sm_90, with FLASHTREE_PDL=1: kernels/cuda_functions.py): a kernel may start while
// the kernel before it on the stream is still finishing. Each kernel first lets its own dependents start (they are
// placed once all of its CTAs have run this), then waits for the kernels before it to finish and their writes to
// show: nothing before `griddepcontrol.wait` reads x or writes anything. Launched without the attribute (the
// default) both instructions return at once. (Requesting the CTA's weights into L2 before
// the wait, cp.async.bulk.prefetch.L2 of its whole share, cost the 27B AR step 6.63 -> 7.68 ms, 2026-12-04.)
__device__ __forceinline__ void start_after_predecessors() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <int RT, int TG>
__device__ __forceinline__ void zero(float (&acc)[RT][TG][4]) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[rt][tg][c] = 0.0f;
}

// cp.async: global -> shared memory without registers (16 bytes, around L1), in commit groups
__device__ __forceinline__ unsigned shared_address(const void* p) {
    return (unsigned)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void copy_async16(unsigned shared, const void* global) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(shared), "l"(global) : "memory");
}
__device__ __forceinline__ void copy_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void copy_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

// The K loop of every kernel: this warp's super-blocks sb, sb + STRIDE, ... below `end`, each handed to
// `multiply(weights, sb, next)` (next: the warp's following super-block, or sb again at the end).
// RING 0: double-buffered in registers: the next super-block's weights are requested before this one is
// multiplied, so each warp keeps one super-block of loads in flight while it computes. Two named buffers (unrolled
// by two): an indexed pair would go to local memory. (Three or four register buffers were no faster in qmh at
// 16-32 rows, 2026-12-02: their registers cost CTAs per SM, see benchmarks/probe_waves.py.)
// RING > 1: through a ring of RING super-blocks in shared memory (`WeightRing`), RING - 1 of them in flight while
// one is multiplied, without the registers. SHARED_X 1: `multiply` also commits one cp.async group per super-block
// (qmh's SharedX, after this loop's), which the waits count.
template <int QT, int RT, int STRIDE, int RING = 0, int SHARED_X = 0, typename Multiply>
__device__ __forceinline__ void walk_k(const unsigned char* quants, const unsigned char* high, const unsigned char* scales,
                                       const u16* dvals, int tile0, int SB, int sb, int end, int lane, int g,
                                       Multiply&& multiply);

// A warp's weights of one super-block in shared memory, each 16-byte chunk where the lane that copies it (with
// cp.async) reads it back: chunk c of every lane at 512 c + 16 lane (RT x 4 of low nibbles, then Q6_K's RT x 2 of
// top bits), then the RT x 16 scale records (copied by lanes 0-15, read by rows g and g + 8 after a __syncwarp),
// then Q6_K's RT x 16 float16 d (lanes 16, 17).
template <int QT, int RT>
struct RingStage {
    typedef Type<QT> T;
    static constexpr int Q_CHUNKS = 4 * RT, H_CHUNKS = T::HIGH_BYTES > 0 ? 2 * RT : 0;
    static constexpr int SCALES_AT = 512 * (Q_CHUNKS + H_CHUNKS), D_AT = SCALES_AT + 256 * RT;
    static constexpr int BYTES = D_AT + (QT == Q6_K ? 32 * RT : 0);
};

template <int QT, int RT, int STAGES>
struct WeightRing {
    static_assert(STAGES >= 2, "a ring holds the super-block multiplied and at least one in flight");
    typedef RingStage<QT, RT> L;
    typedef Type<QT> T;
    unsigned base;  // this warp's ring (shared address)
    const unsigned char* ring;
    int lane, g;
    __device__ __forceinline__ WeightRing(unsigned char* warp_ring, int lane_, int g_)
        : base(shared_address(warp_ring)), ring(warp_ring), lane(lane_), g(g_) {}
    // super-block sb of tiles tile0.. into stage s (nothing past the end), as one commit group: the waits count groups
    __device__ __forceinline__ void copy(const unsigned char* quants, const unsigned char* high, const unsigned char* scales,
                                         const u16* dvals, int tile0, int SB, int sb, int end, int s) const {
        if (sb < end) {
            const unsigned at = base + s * L::BYTES;
#pragma unroll
            for (int rt = 0; rt < RT; ++rt) {
                const long tsb = (long)(tile0 + rt) * SB + sb;
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    copy_async16(at + 512 * (4 * rt + j) + 16 * lane, quants + tsb * T::QUANT_BYTES + 512 * j + 16 * lane);
                if constexpr (T::HIGH_BYTES > 0) {
#pragma unroll
                    for (int j = 0; j < 2; ++j)
                        copy_async16(at + 512 * (L::Q_CHUNKS + 2 * rt + j) + 16 * lane,
                                     high + tsb * T::HIGH_BYTES + 512 * j + 16 * lane);
                }
                if (lane < 16) copy_async16(at + L::SCALES_AT + 256 * rt + 16 * lane, scales + tsb * 256 + 16 * lane);
                if constexpr (QT == Q6_K) {
                    if (lane >= 16 && lane < 18)
                        copy_async16(at + L::D_AT + 32 * rt + 16 * (lane - 16),
                                     reinterpret_cast<const unsigned char*>(dvals + tsb * 16) + 16 * (lane - 16));
                }
            }
        }
        copy_commit();
    }
    __device__ __forceinline__ void read(int s, Weights<QT, RT>& w) const {
        const unsigned char* at = ring + s * L::BYTES;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
            for (int j = 0; j < 4; ++j) w.q[rt][j] = *reinterpret_cast<const uint4*>(at + 512 * (4 * rt + j) + 16 * lane);
            if constexpr (T::HIGH_BYTES > 0) {
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    w.qh[rt][j] = *reinterpret_cast<const uint4*>(at + 512 * (L::Q_CHUNKS + 2 * rt + j) + 16 * lane);
            }
            const uint4* rec = reinterpret_cast<const uint4*>(at + L::SCALES_AT + 256 * rt);
            w.sc[rt].row[0] = rec[g];
            w.sc[rt].row[1] = rec[g + 8];
            if constexpr (QT == Q6_K) {
                const u16* d = reinterpret_cast<const u16*>(at + L::D_AT + 32 * rt);
                w.sc[rt].d[0] = half_to_float(d[g]);
                w.sc[rt].d[1] = half_to_float(d[g + 8]);
            }
        }
    }
};

// the dynamic shared memory of kernels with a weight ring (mma.py `ring_bytes` sizes the launch)
extern __shared__ __align__(16) unsigned char dynamic_shared[];

template <int QT, int RT, int STRIDE, int RING, int SHARED_X, typename Multiply>
__device__ __forceinline__ void walk_k(const unsigned char* quants, const unsigned char* high, const unsigned char* scales,
                                       const u16* dvals, int tile0, int SB, int sb, int end, int lane, int g,
                                       Multiply&& multiply) {
    if constexpr (RING == 0) {
        Weights<QT, RT> w0, w1;
        if (sb < end) load_weights<QT, RT>(quants, high, scales, dvals, tile0, SB, sb, lane, g, w0);
        while (sb < end) {
            if (sb + STRIDE < end) load_weights<QT, RT>(quants, high, scales, dvals, tile0, SB, sb + STRIDE, lane, g, w1);
            multiply(w0, sb, sb + STRIDE < end ? sb + STRIDE : sb);
            sb += STRIDE;
            if (sb >= end) break;
            if (sb + STRIDE < end) load_weights<QT, RT>(quants, high, scales, dvals, tile0, SB, sb + STRIDE, lane, g, w0);
            multiply(w1, sb, sb + STRIDE < end ? sb + STRIDE : sb);
            sb += STRIDE;
        }
    } else {
        const WeightRing<QT, RT, RING> ring(dynamic_shared + (threadIdx.x >> 5) * RING * RingStage<QT, RT>::BYTES, lane, g);
#pragma unroll
        for (int s = 0; s < RING - 1; ++s) ring.copy(quants, high, scales, dvals, tile0, SB, sb + s * STRIDE, end, s);
        for (int i = 0, stage = 0; sb < end; ++i, sb += STRIDE, stage = stage == RING - 1 ? 0 : stage + 1) {
            // this super-block's group is done: RING - 2 later ones may still fly, and with SHARED_X as many of x's
            // plus the one x committed after it (in the first RING - 1 super-blocks fewer: wait as without)
            if (SHARED_X == 0 || i < RING - 1) copy_wait<RING - 2>();
            else copy_wait<2 * RING - 3>();
            __syncwarp();  // and the scale records other lanes copied are visible
            // the stage multiplied last (every lane has read it: it went into MMAs) takes the super-block RING - 1 on
            ring.copy(quants, high, scales, dvals, tile0, SB, sb + (RING - 1) * STRIDE, end,
                      stage == 0 ? RING - 1 : stage - 1);
            Weights<QT, RT> w;
            ring.read(stage, w);
            multiply(w, sb, sb + STRIDE < end ? sb + STRIDE : sb);
        }
    }
}

// B fragments of scaled sub-block j for one token group: lane t's values are contiguous (mma.py's
// `_lane_columns`): Q4_K one 16-byte load for both steps, Q6_K one 8-byte load.
template <int QT, typename XT>
__device__ __forceinline__ void load_x(const XT* row, int sb, int j, u32 (&bx)[Type<QT>::SUB][2]) {
    if constexpr (QT == Q4_K) {
        const uint4 v = x8_bf16(row + (sb << 8) + 32 * j);
        bx[0][0] = v.x; bx[0][1] = v.y; bx[1][0] = v.z; bx[1][1] = v.w;
    } else {
        const uint2 v = x4_bf16(row + (sb << 8) + 16 * j);
        bx[0][0] = v.x; bx[0][1] = v.y;
    }
}

template <int QT, int RT, int TG, typename XT>
__device__ __forceinline__ void multiply(const Weights<QT, RT>& w, const XT* const (&xrow)[TG], int sb,
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
template <int SPLITS, typename OT>
__device__ __forceinline__ void store_sum(float v, int tok, int row, OT* __restrict__ out,
                                          float* __restrict__ partial, int M, int N) {
    if (SPLITS == 1) store_out(out, (long)tok * N + row, v);
    else partial[(long)blockIdx.y * M * N + (long)tok * N + row] = v;
}

// With several splits, the last CTA of a row group to arrive (an atomic ticket, reset for the next
// call) adds the splits' partials of rows [row0, row0 + rows) in split order, so the result does not
// depend on timing. A thread issues the loads of BATCH outputs (SPLITS each) before adding any: one CTA
// reads every split's partials here, and with one output's loads at a time it waited an L2 round trip
// per output (16 warps owning tiles, 6 splits, 23 rows: 12 round trips a thread).
template <int SPLITS, int THREADS, typename OT>
__device__ __forceinline__ void finish_splits(OT* __restrict__ out, const float* __restrict__ partial,
                                              int* __restrict__ tickets, int row0, int rows, int M, int N) {
    constexpr int BATCH = SPLITS <= 8 ? 4 : 1;
    __threadfence();
    __syncthreads();
    __shared__ int last;
    if (threadIdx.x == 0) last = atomicAdd(tickets + blockIdx.x, 1) == SPLITS - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    const long stride = (long)M * N;
    const int count = rows * M;
    for (int first = threadIdx.x; first < count; first += BATCH * THREADS) {
        float part[BATCH][SPLITS];
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int e = min(first + b * THREADS, count - 1);
            const float* src = partial + (long)(e / rows) * N + row0 + e % rows;
#pragma unroll
            for (int s = 0; s < SPLITS; ++s) part[b][s] = __ldcg(src + s * stride);  // L2: the other CTAs' writes
        }
#pragma unroll
        for (int b = 0; b < BATCH; ++b) {
            const int e = first + b * THREADS;
            if (e < count) {
                float total = 0.0f;
#pragma unroll
                for (int s = 0; s < SPLITS; ++s) total += part[b][s];
                store_out(out, (long)(e / rows) * N + row0 + e % rows, total);
            }
        }
    }
    if (threadIdx.x == 0) tickets[blockIdx.x] = 0;
}

// The end of a CTA: its warps' partial sums of the CTA's RT tiles meet in shared memory, added in warp order
// (and multiplied by the token's `scale`, when x was scaled: qmh). GLU 1: the weight's rows are a gate row and its
// up row 8 apart in each tile (`quant_matmul.glu_weight`), and the CTA writes SiLU(gate) * up, N / 2 outputs a token.
template <int RT, int TG, int WARPS, int SPLITS, int GLU = 0, typename OT>
__device__ __forceinline__ void epilogue(const float (&acc)[RT][TG][4], int tile0, OT* __restrict__ out,
                                         float* __restrict__ partial, int* __restrict__ tickets, int M, int N,
                                         const float* __restrict__ scale = nullptr) {
    static_assert(!GLU || SPLITS == 1, "the GLU epilogue needs finished sums: one split");
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
    if constexpr (GLU) {
        for (int e = threadIdx.x; e < VALS * 16; e += WARPS * 32) {  // e = (value index of rows g, lane)
            const int half = e >> 5, l = e & 31;
            const int rt = half / (TG * 2), tg = (half >> 1) % TG, c = half & 1;
            const int v = (rt * TG + tg) * 4 + c;  // row g: the gate; v + 2, row g + 8: its up
            const int tok = 8 * tg + 2 * (l & 3) + c;
            if (tok >= M) continue;
            float gate = 0.0f, up = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                gate += red[w][v][l];
                up += red[w][v + 2][l];
            }
            if (scale != nullptr) {
                gate *= __ldg(scale + tok);
                up *= __ldg(scale + tok);
            }
            store_glu(out, (long)tok * (N >> 1) + 8 * (tile0 + rt) + (l >> 2), gate, up);
        }
        return;
    }
    for (int e = threadIdx.x; e < VALS * 32; e += WARPS * 32) {  // element e = (value index, lane)
        const int v = e >> 5, l = e & 31;
        const int rt = v / (TG * 4), tg = (v / 4) % TG, c = v & 3;
        const int tok = 8 * tg + 2 * (l & 3) + (c & 1);
        if (tok >= M) continue;
        float total = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) total += red[w][v][l];
        if (scale != nullptr) total *= __ldg(scale + tok);
        store_sum<SPLITS>(total, tok, 16 * (tile0 + rt) + (l >> 2) + 8 * (c >> 1), out, partial, M, N);
    }
    if constexpr (SPLITS > 1) finish_splits<SPLITS, WARPS * 32>(out, partial, tickets, 16 * tile0, 16 * RT, M, N);
}

template <int QT, int RT, int TG, int WARPS, int SPLITS, typename XT, typename OT>
__device__ __forceinline__ void qmm(const XT* __restrict__ x, const unsigned char* __restrict__ quants,
                                    const unsigned char* __restrict__ high, const unsigned char* __restrict__ scales,
                                    const u16* __restrict__ dvals, OT* __restrict__ out, float* __restrict__ partial,
                                    int* __restrict__ tickets, int M, int N, int K) {
    typedef Type<QT> T;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int SB = K >> 8;  // super-blocks per row
    const int tile0 = blockIdx.x * RT;
    const KRange ks = split_k<SPLITS>(SB);
    start_after_predecessors();
    float acc[RT][TG][4];
    zero(acc);

    // x rows of this lane's B fragments: token 8 tg + g; past M, token 0 again (those output columns
    // are computed and never stored: cheaper than zeroing)
    const XT* xrow[TG];
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
        const int tok = 8 * tg + g;
        xrow[tg] = x + (long)(tok < M ? tok : 0) * K + (QT == Q4_K ? 8 : 4) * t;
    }

    const Consts k = make_consts();
    walk_k<QT, RT, WARPS>(quants, high, scales, dvals, tile0, SB, ks.begin + warp, ks.end, lane, g,
                          [&](const Weights<QT, RT>& w, int sb, int) { multiply<QT, RT, TG>(w, xrow, sb, k, acc); });
    epilogue<RT, TG, WARPS, SPLITS>(acc, tile0, out, partial, tickets, M, N);
}

// ---------------------------------------------------------------------------------------------
// One row of x (decode): the MMA's 8 columns hold 8 scaled sub-blocks of that row instead of 8 tokens.
// Lane (g, t)'s B fragment carries x only in the steps of sub-block g (of each group of 8) and zeros
// elsewhere, so column j of the accumulator collects sub-block j's partial dot product over the whole
// super-block without any float work in between; each lane then scales the 2 (Q6_K: 4) sub-blocks of
// its columns, and the 4 lanes of a row add theirs at the end. A quarter of the scale decoding and
// an eighth of the scaling FMAs of the token-column kernel, for the same MMA count.

// x values of lane (g, t) for super-block sb: Q4_K sub-block g (8 values, both its steps); Q6_K
// sub-blocks g and g + 8 (4 values each).
template <int QT> struct VectorX;
template <> struct VectorX<Q4_K> {
    uint4 v;
    template <typename XT>
    __device__ __forceinline__ void load(const XT* row, int sb, int g, int t) {
        v = x8_bf16(row + (sb << 8) + 32 * g + 8 * t);
    }
    // B registers of step s, zero unless the step belongs to this lane's sub-block
    __device__ __forceinline__ void fragment(int s, int g, u32& b0, u32& b1) const {
        const bool mine = (s >> 1) == g;
        b0 = mine ? ((s & 1) ? v.z : v.x) : 0u;
        b1 = mine ? ((s & 1) ? v.w : v.y) : 0u;
    }
};
template <> struct VectorX<Q6_K> {
    uint2 v[2];
    template <typename XT>
    __device__ __forceinline__ void load(const XT* row, int sb, int g, int t) {
        v[0] = x4_bf16(row + (sb << 8) + 16 * g + 4 * t);
        v[1] = x4_bf16(row + (sb << 8) + 16 * (g + 8) + 4 * t);
    }
    __device__ __forceinline__ void fragment(int s, int g, u32& b0, u32& b1) const {
        const bool mine = (s & 7) == g;
        b0 = mine ? v[s >> 3].x : 0u;
        b1 = mine ? v[s >> 3].y : 0u;
    }
};

// Column sets: Q4_K's 8 sub-blocks fill the 8 columns once; Q6_K's 16 fill them twice (steps 0-7, 8-15).
template <int QT> __device__ constexpr int column_sets() { return QT == Q4_K ? 1 : 2; }

// CH: accumulator chains (MMA step s adds to chain s % CH; each column's sub-block has its steps in different
// chains, summed at the end), so that the 16 MMAs of a super-block are not one chain of dependent latencies
template <int QT, int RT, int CH, typename XT>
__device__ __forceinline__ void multiply_vector(const Weights<QT, RT>& w, const XT* row, int sb, int g, int t,
                                                const Consts& k, float (&acc)[RT][2]) {
    typedef Type<QT> T;
    constexpr int SETS = column_sets<QT>();
    VectorX<QT> x;
    x.load(row, sb, g, t);
    float xs[CH][4];  // Q4_K: column j's sum of x (sub-block j), per chain
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) xs[ch][0] = xs[ch][1] = xs[ch][2] = xs[ch][3] = 0.0f;
    if constexpr (T::NEEDS_XSUM) {
#pragma unroll
        for (int s = 0; s < 16; ++s) {
            u32 b0, b1;
            x.fragment(s, g, b0, b1);
            mma_ones(xs[s % CH], b0, b1);
        }
#pragma unroll
        for (int ch = 1; ch < CH; ++ch)
#pragma unroll
            for (int c = 0; c < 4; ++c) xs[0][c] += xs[ch][c];
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        float p[SETS][CH][4];
#pragma unroll
        for (int c = 0; c < SETS; ++c)
#pragma unroll
            for (int ch = 0; ch < CH; ++ch) p[c][ch][0] = p[c][ch][1] = p[c][ch][2] = p[c][ch][3] = 0.0f;
#pragma unroll
        for (int s = 0; s < 16; ++s) {
            u32 frag[4], b0, b1;
            const u32 lo = word_of(w.q[rt][s >> 2], s & 3);
            const u32 hi = T::HIGH_BYTES > 0 ? word_of(w.qh[rt][s >> 3], (s >> 1) & 3) : 0u;
            decode<QT>(lo, hi, s, k, frag);
            x.fragment(s, g, b0, b1);
            mma_bf16(p[(s >> 3) & (SETS - 1)][s % CH], frag, b0, b1);
        }
        // p[set][0][c]: row g (c < 2) or g + 8, column 2t + (c & 1), i.e. sub-block 8 set + 2t + (c & 1)
#pragma unroll
        for (int set = 0; set < SETS; ++set)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#pragma unroll
                for (int ch = 1; ch < CH; ++ch) p[set][0][c] += p[set][ch][c];
                float a, b;
                T::sub_scale(w.sc[rt], c >> 1, 8 * set + 2 * t + (c & 1), k, a, b);
                acc[rt][c >> 1] = fmaf(a, p[set][0][c], acc[rt][c >> 1]);
                if constexpr (T::NEEDS_XSUM) acc[rt][c >> 1] = fmaf(-b, xs[0][c & 1], acc[rt][c >> 1]);
            }
    }
}

template <int QT, int RT, int WARPS, int SPLITS, int CH, int RING, int GLU, typename XT, typename OT>
__device__ __forceinline__ void qmv(const XT* __restrict__ x, const unsigned char* __restrict__ quants,
                                    const unsigned char* __restrict__ high, const unsigned char* __restrict__ scales,
                                    const u16* __restrict__ dvals, OT* __restrict__ out, float* __restrict__ partial,
                                    int* __restrict__ tickets, int M, int N, int K) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int SB = K >> 8;
    const int tile0 = blockIdx.x * RT;
    const KRange ks = split_k<SPLITS>(SB);
    start_after_predecessors();
    float acc[RT][2];  // rows g and g + 8 of each tile: this lane's columns' share
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) acc[rt][0] = acc[rt][1] = 0.0f;

    const Consts k = make_consts();
    walk_k<QT, RT, WARPS, RING>(quants, high, scales, dvals, tile0, SB, ks.begin + warp, ks.end, lane, g,
                                [&](const Weights<QT, RT>& w, int sb, int) { multiply_vector<QT, RT, CH>(w, x, sb, g, t, k, acc); });
    // the 4 lanes of a row hold its columns' shares: add them (every lane ends with the row's sum), then
    // hand them to qmm's epilogue as token 0 (column 0: lane t = 0, accumulators 0 and 2)
    float sums[RT][1][4];
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float v = acc[rt][h];
            v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
            v += __shfl_xor_sync(0xFFFFFFFFu, v, 2);
            sums[rt][0][2 * h] = sums[rt][0][2 * h + 1] = v;
        }
    epilogue<RT, 1, WARPS, SPLITS, GLU>(sums, tile0, out, partial, tickets, M, N);
}

// ---------------------------------------------------------------------------------------------
// Q4_K, 2-32 rows of x, in float16: `qmh`. The token-column kernel above scales every sub-block's MMA
// partial in float32, per token group: 8 FFMAs and 2 MMAs against ones (x's sums) per 32 values and
// 8 tokens, which at 16-32 rows cost more than the decoding itself. In float16 a sub-block's scale can go
// into the weights instead, exactly: q * sc <= 15 * 63 = 945 < 2^11 (and 16 q sc, below, is that times a
// power of two). So the A fragment holds q * sc (one HFMA2 per register: (1024 + q) * sc - 1024 sc, the
// 1024 coming from OR-ing q into the mantissa of float16 1024.0), a whole super-block collects in one
// accumulator, and d is applied once per super-block. The min term is one more MMA per super-block: A the
// rows' 8 mins (exact), B x's 8 sub-block sums as float16 hi + lo (22 bits). x itself is converted once by
// `prep_x`: each token scaled by a power of two 2^e so that its largest |x| is in [256, 512) (float16
// then holds every bf16 value exactly, down to 2^-23 of that largest one, and the sums stay below 2^14),
// the output multiplied back by 2^-e. A token's result does not depend on the other rows of x.
// Row g + 8's nibbles sit at bits 4-7 of each half: OR-ed into 1024.0 they read 1024 + 16 q, so those
// rows hold 16 q sc and take d / 16 (exact), which saves a shift per register. Q6_K's form (no min term, its
// scaled weights split over two MMAs) follows Q4_K's below.

__device__ __forceinline__ void mma_f16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}

#define F16X2_1024 0x64006400u
#define F16X2_MINUS_1024 0xE400E400u

// bytes b0, b1 of w OR-ed under 0x64: float16 1024 + w[b0], 1024 + w[b1]
__device__ __forceinline__ u32 under_1024(u32 w, u32 b0, u32 b1) {
    return __byte_perm(w, 0x64u, (4u << 12) | (b1 << 8) | (4u << 4) | b0);
}

// bytes b0, b1 of w as float16 (w[b0], w[b1]): 1024 taken off again, exactly
__device__ __forceinline__ u32 bytes_to_f16x2(u32 w, u32 b0, u32 b1) { return hsub2(under_1024(w, b0, b1), F16X2_1024); }

template <int CH, int RT, int TG>
__device__ __forceinline__ void zero(float (&p)[CH][RT][TG][4]) {
#pragma unroll
    for (int ch = 0; ch < CH; ++ch) zero(p[ch]);
}

// Where qmh's B fragments (x) and Q4_K's sub-block sums of x come from. A source is told each super-block
// (`start(sb, next)`, next: the warp's following one, or sb again at the end) and then hands out sub-block j's
// fragments (`sub_block(j, next)`, in prep_x's order: one 16-byte load per token group for MMA steps 2j and
// 2j + 1) and token group tg's sums (`sums`).
//
// GlobalX: every lane loads its own from global memory (L1, L2). XA 0: just before its MMAs. XA 1: a sub-block
// ahead (sub-block j's registers receive j + 1's load; past the last, sub-block 0 of `next`), so that a load has
// a whole sub-block of work to arrive in (at 17-32 rows these loads, often L1 misses, were where qmh's warps
// waited: Nsight Compute, 2026-12-01).
template <int TG, int XA>
struct GlobalX {
    const u16* xrow[TG];  // the lane's row of each token group, from value 8t
    const u16* srow[TG];  // Q4_K: its sub-block sums, from 4t
    const uint4* xb[TG];  // this super-block's
    u32 ahead[TG][2][2];
    int sb;
    __device__ __forceinline__ GlobalX(const u16* xh, const u16* xsum, int M, int K, int first) {
        const int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, SB = K >> 8;
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            const int tok = 8 * tg + g < M ? 8 * tg + g : 0;  // past M: token 0 again, never stored
            xrow[tg] = xh + (long)tok * K + 8 * t;
            srow[tg] = xsum != nullptr ? xsum + (long)tok * (SB << 4) + 4 * t : nullptr;
        }
        if constexpr (XA == 1) {  // the first sub-block (any valid address when the warp has no super-block)
            point(min(first, SB - 1), xb);
            load(xb, 0, ahead);
        }
    }
    __device__ __forceinline__ void point(int at, const uint4* (&p)[TG]) const {
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) p[tg] = reinterpret_cast<const uint4*>(xrow[tg] + (at << 8));
    }
    static __device__ __forceinline__ void load(const uint4* const (&p)[TG], int j, u32 (&bx)[TG][2][2]) {
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            const uint4 v = __ldg(p[tg] + 4 * j);
            bx[tg][0][0] = v.x; bx[tg][0][1] = v.y; bx[tg][1][0] = v.z; bx[tg][1][1] = v.w;
        }
    }
    __device__ __forceinline__ void start(int at, int) {
        sb = at;
        point(at, xb);
    }
    __device__ __forceinline__ void sub_block(int j, int next, u32 (&bx)[TG][2][2]) {
        if constexpr (XA == 0) {
            load(xb, j, bx);
        } else {
#pragma unroll
            for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                for (int u = 0; u < 2; ++u) bx[tg][u][0] = ahead[tg][u][0], bx[tg][u][1] = ahead[tg][u][1];
            if (j < 7) {
                load(xb, j + 1, ahead);
            } else {
                const uint4* xn[TG];
                point(next, xn);
                load(xn, 0, ahead);
            }
        }
    }
    __device__ __forceinline__ uint2 sums(int tg) const {
        return __ldg(reinterpret_cast<const uint2*>(srow[tg] + (sb << 4)));
    }
};

// The B fragments of sub-block j for each token group, from a lane's x in shared memory (`here`: its row g, byte 16t;
// token groups `pitch` * 8 bytes apart): one 16-byte read each (SharedX's stages, ResidentX's rows)
template <int TG>
__device__ __forceinline__ void shared_fragments(const unsigned char* here, int pitch, int j, u32 (&bx)[TG][2][2]) {
#pragma unroll
    for (int tg = 0; tg < TG; ++tg) {
        const uint4 v = *reinterpret_cast<const uint4*>(here + tg * 8 * pitch + 64 * j);
        bx[tg][0][0] = v.x; bx[tg][0][1] = v.y; bx[tg][1][0] = v.z; bx[tg][1][1] = v.w;
    }
}

// SharedX: the CTA's threads copy each super-block's x (8 TG rows) and sums into a ring of STAGES stages in
// shared memory (cp.async, STAGES - 1 super-blocks ahead), so that x is read from L2 once per CTA and super-block,
// and each warp reads its fragments from there. For qmh's OWN kernels, whose warps walk the same super-blocks:
// `start` waits at a CTA barrier for the super-block's stage (and for every warp to be done with the stage the
// next copy overwrites).
constexpr int X_PITCH = 576;  // bytes per row of x in a stage: 512 of values + 64, so that rows alternate bank halves

// WEIGHT_RING 1: walk_k's WeightRing commits one group per super-block too (before this one's), so the wait lets as
// many more fly.
template <int TG, int THREADS, int WEIGHT_RING = 0>
struct SharedX {
    static constexpr int ROWS = 8 * TG;
    static constexpr int STAGES = TG <= 3 ? 3 : 2;  // within 48 KB of static shared memory
    static constexpr int X_BYTES = ROWS * X_PITCH, STAGE_BYTES = X_BYTES + ROWS * 32;
    static constexpr int CHUNKS = ROWS * 32;  // 16-byte pieces of one super-block's x
    static constexpr int PER_THREAD = (CHUNKS + THREADS - 1) / THREADS;
    unsigned char* ring;
    const u16* src[PER_THREAD];  // this thread's pieces at super-block 0, and where they go in a stage
    unsigned dst[PER_THREAD];
    const u16* sum_src;  // the first 2 ROWS threads: one 16-byte piece of the sums
    unsigned sum_dst;
    const unsigned char* here;  // this super-block's stage at the lane's x (row g, byte 16t) and sums (row g, byte 8t)
    const unsigned char* sums_here;
    int end, stage;
    __device__ __forceinline__ SharedX(unsigned char* ring_, const u16* xh, const u16* xsum, int M, int K, int first,
                                       int end_)
        : ring(ring_), end(end_), stage(0) {
        const int SB = K >> 8;
#pragma unroll
        for (int i = 0; i < PER_THREAD; ++i) {
            const int c = min((int)threadIdx.x + THREADS * i, CHUNKS - 1), row = c >> 5;
            src[i] = xh + (long)(row < M ? row : 0) * K + 8 * (c & 31);
            dst[i] = row * X_PITCH + 16 * (c & 31);
        }
        const int row = min((int)threadIdx.x >> 1, ROWS - 1);
        sum_src = xsum != nullptr ? xsum + (long)(row < M ? row : 0) * (SB << 4) + 8 * (threadIdx.x & 1) : nullptr;
        sum_dst = X_BYTES + row * 32 + 16 * (threadIdx.x & 1);
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) copy(first + s, s);
    }
    // super-block at (if below end) into stage s, as one commit group (empty past the end: the waits count groups)
    __device__ __forceinline__ void copy(int at, int s) {
        if (at < end) {
            const unsigned base = shared_address(ring + s * STAGE_BYTES);
#pragma unroll
            for (int i = 0; i < PER_THREAD; ++i)
                if (i < PER_THREAD - 1 || (int)threadIdx.x + THREADS * i < CHUNKS) copy_async16(base + dst[i], src[i] + (at << 8));
            if (sum_src != nullptr && (int)threadIdx.x < 2 * ROWS) copy_async16(base + sum_dst, sum_src + (at << 4));
        }
        copy_commit();
    }
    __device__ __forceinline__ void start(int at, int) {
        copy_wait<(STAGES - 2) * (1 + WEIGHT_RING) + WEIGHT_RING>();
        __syncthreads();
        copy(at + STAGES - 1, stage == 0 ? STAGES - 1 : stage - 1);
        const int lane = threadIdx.x & 31;
        here = ring + stage * STAGE_BYTES + (lane >> 2) * X_PITCH + 16 * (lane & 3);
        sums_here = ring + stage * STAGE_BYTES + X_BYTES + (lane >> 2) * 32 + 8 * (lane & 3);
        stage = stage == STAGES - 1 ? 0 : stage + 1;
    }
    __device__ __forceinline__ void sub_block(int j, int, u32 (&bx)[TG][2][2]) const {
        shared_fragments<TG>(here, X_PITCH, j, bx);
    }
    __device__ __forceinline__ uint2 sums(int tg) const {
        return *reinterpret_cast<const uint2*>(sums_here + tg * 8 * 32);
    }
};

// mbarriers (sm_90): a stage's arrival count and expected bytes in shared memory, waited on by phase parity
__device__ __forceinline__ void barrier_init(unsigned bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void barrier_arrive(unsigned bar) {
    asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void barrier_wait(unsigned bar, unsigned parity) {
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
}
// the barrier's arrival once this thread's cp.async copies so far have landed (counted in its expected arrivals)
__device__ __forceinline__ void barrier_arrive_on_copies(unsigned bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// ProducedX: SharedX's stages filled by a warp of their own (qmh's OWN 4: one warp past the CTA's WARPS) with cp.async,
// each stage's arrival and release on mbarriers instead of a CTA barrier a super-block. Nsight Compute on the 23-row
// gate + up (OWN 2, 17 warps, thirty-first session) counted 1.47 cycles a warp instruction stalled at SharedX's
// barrier and 1.95 on a busy math pipe: at the barrier every warp waits for the slowest, then all of them decode
// (and then multiply) at once. Here a warp waits only for its stage's bytes, and the producer refills a stage once
// every warp released it: warps drift up to STAGES - 1 super-blocks apart. The same values in the same places as
// SharedX: the arithmetic and its bits are OWN 2's. (The first form, one bulk copy a row, lost: a bulk copy takes
// uniform operands, so the 48 of a super-block ran one after another, and the 23-row qkvz took 48.3 us against 29.5.)
template <int TG, int WARPS>
struct ProducedX {
    static constexpr int ROWS = 8 * TG;
    static constexpr int STAGES = TG <= 3 ? 3 : 2;  // SharedX's
    static constexpr int X_BYTES = ROWS * X_PITCH, STAGE_BYTES = X_BYTES + ROWS * 32;
    unsigned char* ring;
    unsigned full, empty;  // the stages' barriers: the copies landed (the producer's 32 lanes); every warp done with
                           // it (WARPS arrivals). 8 bytes each, STAGES in a row.
    const unsigned char* here;  // this super-block's stage at the lane's x (row g, byte 16t) and sums (row g, byte 8t)
    const unsigned char* sums_here;
    int stage, parity, started;
    __device__ __forceinline__ ProducedX(unsigned char* ring_, unsigned long long* barriers)
        : ring(ring_), full(shared_address(barriers)), empty(shared_address(barriers + STAGES)), stage(0), parity(0),
          started(0) {
        if (threadIdx.x == 0) {
#pragma unroll
            for (int s = 0; s < STAGES; ++s) {
                barrier_init(full + 8 * s, 32);
                barrier_init(empty + 8 * s, WARPS);
            }
        }
        __syncthreads();
    }
    // the producer warp: super-blocks [first, end) in turn, each once the warps released its stage's last one. Lane l
    // copies 16 bytes of every row's values (rows past M: token 0's, never stored), and Q4_K's sums, 16 bytes a
    // piece, pieces l and l + 32 (2 ROWS of them: 48 at 3 token groups, more than the warp's lanes).
    __device__ __forceinline__ void produce(const u16* xh, const u16* xsum, int M, int K, int first, int end) const {
        constexpr int SUM_PIECES = 2 * ROWS;
        const int lane = threadIdx.x & 31, SB = K >> 8;
        for (int at = first, s = 0, use = 0; at < end; ++at) {
            if (use > 0) barrier_wait(empty + 8 * s, (use - 1) & 1);
            const unsigned base = shared_address(ring + s * STAGE_BYTES);
#pragma unroll 8
            for (int row = 0; row < ROWS; ++row)
                copy_async16(base + row * X_PITCH + 16 * lane, xh + (long)(row < M ? row : 0) * K + (at << 8) + 8 * lane);
            if (xsum != nullptr)
#pragma unroll
                for (int piece = lane; piece < SUM_PIECES; piece += 32) {
                    const int row = piece >> 1;
                    copy_async16(base + X_BYTES + row * 32 + 16 * (piece & 1),
                                 xsum + (long)(row < M ? row : 0) * (SB << 4) + (at << 4) + 8 * (piece & 1));
                }
            barrier_arrive_on_copies(full + 8 * s);
            if (++s == STAGES) s = 0, ++use;
        }
        copy_wait<0>();  // nothing of this warp's still in flight as it leaves
    }
    // a computing warp: release the stage of the super-block before (its fragments are in registers), then wait for
    // this one's bytes
    __device__ __forceinline__ void start(int, int) {
        const int lane = threadIdx.x & 31;
        if (started++) {
            __syncwarp();
            if (lane == 0) barrier_arrive(empty + 8 * (stage == 0 ? STAGES - 1 : stage - 1));
        }
        barrier_wait(full + 8 * stage, parity);
        here = ring + stage * STAGE_BYTES + (lane >> 2) * X_PITCH + 16 * (lane & 3);
        sums_here = ring + stage * STAGE_BYTES + X_BYTES + (lane >> 2) * 32 + 8 * (lane & 3);
        if (++stage == STAGES) stage = 0, parity ^= 1;
    }
    __device__ __forceinline__ void sub_block(int j, int, u32 (&bx)[TG][2][2]) const {
        shared_fragments<TG>(here, X_PITCH, j, bx);
    }
    __device__ __forceinline__ uint2 sums(int tg) const {
        return *reinterpret_cast<const uint2*>(sums_here + tg * 8 * 32);
    }
};

// ResidentX: all of x's rows (8 TG of them, K values each) and Q4_K's sums copied once into dynamic shared memory
// (cp.async) before any warp starts, for qmh's OWN 3 kernels (the LM head at 9-16 rows), whose warps then walk whole
// row tiles each, on their own, with no CTA barrier: x crosses L2 once a CTA instead of once a 16-row tile (the LM
// head's 15520 tiles at 16 rows read 2.5 GB of x against 1.04 GB of weights). Rows are `pitch` bytes apart, 64 more
// than a multiple of 128, so that a warp's 16-byte reads of 8 rows take 4 wavefronts (as SharedX's X_PITCH).
template <int TG, int THREADS>
struct ResidentX {
    static constexpr int ROWS = 8 * TG;
    const unsigned char* x_base;     // the lane's row g, byte 16t
    const unsigned char* sums_base;  // the lane's row g's records, byte 8t
    const unsigned char* here;
    const unsigned char* sums_here;
    int pitch, SB;
    __device__ __forceinline__ ResidentX(unsigned char* shared, const u16* xh, const u16* xsum, int M, int K)
        : pitch(2 * K + 64), SB(K >> 8) {  // 2K: a multiple of 512 (K % 256 == 0)
        const int per_row = K >> 3;  // 16-byte pieces of a row
        const unsigned base = shared_address(shared);
        for (int c = threadIdx.x; c < ROWS * per_row; c += THREADS) {
            const int row = c / per_row, piece = c - row * per_row;
            copy_async16(base + row * pitch + 16 * piece, xh + (long)(row < M ? row : 0) * K + 8 * piece);
        }
        unsigned char* sums = shared + ROWS * pitch;
        if (xsum != nullptr) {
            const int per_row_sums = 2 * SB;  // 32 bytes a super-block
            for (int c = threadIdx.x; c < ROWS * per_row_sums; c += THREADS) {
                const int row = c / per_row_sums, piece = c - row * per_row_sums;
                copy_async16(shared_address(sums) + row * 32 * SB + 16 * piece,
                             xsum + (long)(row < M ? row : 0) * (SB << 4) + 8 * piece);
            }
        }
        copy_commit();
        copy_wait<0>();
        __syncthreads();
        const int lane = threadIdx.x & 31;
        x_base = shared + (lane >> 2) * pitch + 16 * (lane & 3);
        sums_base = sums + (lane >> 2) * 32 * SB + 8 * (lane & 3);
    }
    __device__ __forceinline__ void start(int at, int) {
        here = x_base + 512 * at;
        sums_here = sums_base + 32 * at;
    }
    __device__ __forceinline__ void sub_block(int j, int, u32 (&bx)[TG][2][2]) const {
        shared_fragments<TG>(here, pitch, j, bx);
    }
    __device__ __forceinline__ uint2 sums(int tg) const {
        return *reinterpret_cast<const uint2*>(sums_here + tg * 8 * 32 * SB);
    }
};

// the chains of tile rt, token group tg added into chain 0
template <int CH, int RT, int TG>
__device__ __forceinline__ void add_chains(float (&p)[CH][RT][TG][4], int rt, int tg) {
#pragma unroll
    for (int ch = 1; ch < CH; ++ch)
#pragma unroll
        for (int c = 0; c < 4; ++c) p[0][rt][tg][c] += p[ch][rt][tg][c];
}

// CH: independent accumulator chains per tile and token group (Q4_K: MMA step s adds to chain s % CH), so
// that a super-block's MMAs are not one chain of dependent tensor-core latencies
template <int RT, int TG, int CH, typename XSource>
__device__ __forceinline__ void multiply_half(const Weights<Q4_K, RT>& w, XSource& x, int sb, int next, int t,
                                              const Consts& k, float (&acc)[RT][TG][4]) {
    float p[CH][RT][TG][4];
    zero(p);
    x.start(sb, next);
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // 32-value sub-blocks: MMA steps 2j, 2j + 1
        u32 bx[TG][2][2];
        x.sub_block(j, next, bx);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const uint4 r0 = w.sc[rt].row[0], r1 = w.sc[rt].row[1];
            const u32 w0 = j < 4 ? r0.x & 0x3F3F3F3Fu : (r0.z & 0x0F0F0F0Fu) | ((r0.x >> 2) & 0x30303030u);
            const u32 w1 = j < 4 ? r1.x & 0x3F3F3F3Fu : (r1.z & 0x0F0F0F0Fu) | ((r1.x >> 2) & 0x30303030u);
            const u32 sc0 = bytes_to_f16x2(w0, j & 3, j & 3), sc1 = bytes_to_f16x2(w1, j & 3, j & 3);
            const u32 c0 = hmul2(sc0, F16X2_MINUS_1024), c1 = hmul2(sc1, F16X2_MINUS_1024);
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int s = 2 * j + u;
                const u32 lo = word_of(w.q[rt][s >> 2], s & 3), lo8 = lo >> 8;
                u32 a[4];
                a[0] = hfma2(and_or<0x000F000Fu>(lo, k.f16_1024), sc0, c0);   // row g: q sc
                a[1] = hfma2(and_or<0x00F000F0u>(lo, k.f16_1024), sc1, c1);   // row g + 8: 16 q sc
                a[2] = hfma2(and_or<0x000F000Fu>(lo8, k.f16_1024), sc0, c0);
                a[3] = hfma2(and_or<0x00F000F0u>(lo8, k.f16_1024), sc1, c1);
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) mma_f16(p[s % CH][rt][tg], a, bx[tg][u][0], bx[tg][u][1]);
            }
        }
    }
    // d once per super-block; the min term: A = the 8 mins of rows g and g + 8 (columns 2t, 2t + 1, again at
    // + 8), B = x's sub-block sums, hi at k 2t.., lo at k 2t + 8..
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        const uint4 r0 = w.sc[rt].row[0], r1 = w.sc[rt].row[1];
        const u32 b0 = (2 * t) & 3;
        const u32 m0 = t < 2 ? r0.y & 0x3F3F3F3Fu : ((r0.z >> 4) & 0x0F0F0F0Fu) | ((r0.y >> 2) & 0x30303030u);
        const u32 m1 = t < 2 ? r1.y & 0x3F3F3F3Fu : ((r1.z >> 4) & 0x0F0F0F0Fu) | ((r1.y >> 2) & 0x30303030u);
        u32 am[4];
        am[0] = am[2] = bytes_to_f16x2(m0, b0, b0 + 1);
        am[1] = am[3] = bytes_to_f16x2(m1, b0, b0 + 1);
        const float d0 = half_to_float((u16)(r0.w & 0xFFFF)), d1 = half_to_float((u16)(r1.w & 0xFFFF)) * 0.0625f;
        const float n0 = -half_to_float((u16)(r0.w >> 16)), n1 = -half_to_float((u16)(r1.w >> 16));
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            const uint2 xs = x.sums(tg);
            float pm[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mma_f16(pm, am, xs.x, xs.y);
            add_chains(p, rt, tg);
            acc[rt][tg][0] = fmaf(n0, pm[0], fmaf(d0, p[0][rt][tg][0], acc[rt][tg][0]));
            acc[rt][tg][1] = fmaf(n0, pm[1], fmaf(d0, p[0][rt][tg][1], acc[rt][tg][1]));
            acc[rt][tg][2] = fmaf(n1, pm[2], fmaf(d1, p[0][rt][tg][2], acc[rt][tg][2]));
            acc[rt][tg][3] = fmaf(n1, pm[3], fmaf(d1, p[0][rt][tg][3], acc[rt][tg][3]));
        }
    }
}

// Q6_K in float16. A scaled weight (q - 32) sc can need 12 significant bits (31 x 127 = 3937), one more than
// float16 holds, so each goes into the A fragments of two MMAs on the same accumulator, both exact: with ql the
// low nibble and qt the top 2 bits, q - 32 = ql + 16 (qt - 2), and ql sc (at most 15 x 128) and (qt - 2) sc (at
// most 2 x 128, times a power of two) fit. Each register is one LOP3 (the bits OR-ed into the mantissa of a
// float16 power of two M) and one HFMA2, (M + bits) sc - (M + offset) sc, whose constant is exact (M + offset
// has at most 4 significant bits, sc 7) and below 65504:
//   row g:      ql at bits 0-3 of 256 (ulp 1/4): ql sc / 4     qt at bits 6-7 of 64 (ulp 1/16): 4 (qt - 2) sc
//   row g + 8:  ql at bits 4-7 of 256:           4 ql sc       qt at bits 8-9 of 256:           64 (qt - 2) sc
// Row g collects (q - 32) sc / 4 and takes 4 d, row g + 8 collects 4 (q - 32) sc and takes d / 4 (exact).
// Per 16 values and 8 tokens: 2 MMAs where qmm issues 1 MMA and 4 FFMAs; d once per super-block. The
// low-nibble MMAs add to chain 0, the top-bit ones to chain CH - 1.

#define F16X2_1152 0x64806480u
#define F16X2_MINUS_256 0xDC00DC00u
#define F16X2_MINUS_72 0xD480D480u
#define F16X2_MINUS_384 0xDE00DE00u

// int8 byte b of w as float16 in both halves: its sign bit flipped, it reads sc + 128 (1152 + sc under 0x64)
__device__ __forceinline__ u32 int8_to_f16x2(u32 w, u32 b) { return hsub2(under_1024(w ^ 0x80808080u, b, b), F16X2_1152); }

template <int RT, int TG, int CH, typename XSource>
__device__ __forceinline__ void multiply_half(const Weights<Q6_K, RT>& w, XSource& x, int sb, int next,
                                              const Consts& k, float (&acc)[RT][TG][4]) {
    float p[CH][RT][TG][4];
    zero(p);
    x.start(sb, next);
#pragma unroll
    for (int j = 0; j < 8; ++j) {  // MMA steps 2j, 2j + 1 (one 16-value sub-block each): their top bits share a word
        u32 bx[TG][2][2];
        x.sub_block(j, next, bx);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
            const u32 hi = word_of(w.qh[rt][j >> 2], j & 3);
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int s = 2 * j + u;
                const u32 sc0 = int8_to_f16x2(word_of(w.sc[rt].row[0], s >> 2), s & 3);
                const u32 sc1 = int8_to_f16x2(word_of(w.sc[rt].row[1], s >> 2), s & 3);
                const u32 c0 = hmul2(sc0, F16X2_MINUS_256), c1 = hmul2(sc1, F16X2_MINUS_256);
                const u32 e0 = hmul2(sc0, F16X2_MINUS_72), e1 = hmul2(sc1, F16X2_MINUS_384);
                const u32 lo = word_of(w.q[rt][s >> 2], s & 3), lo8 = lo >> 8;
                // register r's top bits (bits 8u + 2r of each half) moved to bits 6-7 (r = 0, 2) and 8-9 (r = 1, 3)
                const u32 hi01 = u ? hi >> 2 : hi << 6, hi23 = u ? hi >> 6 : hi << 2;
                u32 a[4], b[4];
                a[0] = hfma2(and_or<0x000F000Fu>(lo, k.f16_256), sc0, c0);     // row g: ql sc / 4
                a[1] = hfma2(and_or<0x00F000F0u>(lo, k.f16_256), sc1, c1);     // row g + 8: 4 ql sc
                a[2] = hfma2(and_or<0x000F000Fu>(lo8, k.f16_256), sc0, c0);
                a[3] = hfma2(and_or<0x00F000F0u>(lo8, k.f16_256), sc1, c1);
                b[0] = hfma2(and_or<0x00C000C0u>(hi01, k.f16_64), sc0, e0);    // row g: 4 (qt - 2) sc
                b[1] = hfma2(and_or<0x03000300u>(hi01, k.f16_256), sc1, e1);   // row g + 8: 64 (qt - 2) sc
                b[2] = hfma2(and_or<0x00C000C0u>(hi23, k.f16_64), sc0, e0);
                b[3] = hfma2(and_or<0x03000300u>(hi23, k.f16_256), sc1, e1);
#pragma unroll
                for (int tg = 0; tg < TG; ++tg) {
                    mma_f16(p[0][rt][tg], a, bx[tg][u][0], bx[tg][u][1]);
                    mma_f16(p[CH - 1][rt][tg], b, bx[tg][u][0], bx[tg][u][1]);
                }
            }
        }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
        const float d0 = 4.0f * w.sc[rt].d[0], d1 = 0.25f * w.sc[rt].d[1];
#pragma unroll
        for (int tg = 0; tg < TG; ++tg) {
            add_chains(p, rt, tg);
            acc[rt][tg][0] = fmaf(d0, p[0][rt][tg][0], acc[rt][tg][0]);
            acc[rt][tg][1] = fmaf(d0, p[0][rt][tg][1], acc[rt][tg][1]);
            acc[rt][tg][2] = fmaf(d1, p[0][rt][tg][2], acc[rt][tg][2]);
            acc[rt][tg][3] = fmaf(d1, p[0][rt][tg][3], acc[rt][tg][3]);
        }
    }
}

// qmh's end when its warps own tiles (OWN): each warp stores its own rows, no sum across warps. `stores` false: a
// warp past the matrix's last tile (one CTA an SM, `own_tiles_one_cta_an_sm` in mma.py), which walked the last tile
// again to keep the CTA's barriers and stores nothing.
template <int RT, int TG, int WARPS, int SPLITS, int GLU, typename OT>
__device__ __forceinline__ void epilogue_own(const float (&acc)[RT][TG][4], int tile0, bool stores, OT* __restrict__ out,
                                             float* __restrict__ partial, int* __restrict__ tickets, int M, int N,
                                             const float* __restrict__ scale) {
    static_assert(!GLU || SPLITS == 1, "the GLU epilogue needs finished sums: one split");
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    if (!stores) return;  // only with one split (mma.py refuses a partial CTA otherwise): no ticket to take
    if constexpr (GLU) {  // accumulators 0, 1: the gate (row g); 2, 3: its up (row g + 8)
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
            for (int tg = 0; tg < TG; ++tg)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const int tok = 8 * tg + 2 * t + c;
                    if (tok < M) {
                        const float s = __ldg(scale + tok);
                        store_glu(out, (long)tok * (N >> 1) + 8 * (tile0 + rt) + g, acc[rt][tg][c] * s,
                                  acc[rt][tg][c + 2] * s);
                    }
                }
        return;
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int tok = 8 * tg + 2 * t + (c & 1);
                if (tok < M)
                    store_sum<SPLITS>(acc[rt][tg][c] * __ldg(scale + tok), tok, 16 * (tile0 + rt) + g + 8 * (c >> 1), out,
                                      partial, M, N);
            }
    if constexpr (SPLITS > 1) finish_splits<SPLITS, WARPS * 32>(out, partial, tickets, 16 * RT * WARPS * blockIdx.x, 16 * RT * WARPS, M, N);
}

// qmh's end when its warps own tiles and the SPLITS CTAs of a row group, one thread-block cluster (`__cluster_dims__`
// (1, SPLITS, 1), mma.py `_wrapper`), split K: each CTA puts its warps' sums in its own shared memory (`red`, x's
// stages, free once the K loop is done), and after a cluster barrier CTA r adds the SPLITS sums of its SPLITS-th of
// the outputs in split order, reading the other CTAs' shared memory (distributed shared memory: no global partials,
// no ticket, no dependent L2 round trips; the order is fixed, so the bits do not depend on timing). The loads of a
// thread are issued together, then added.
template <int RT, int TG, int WARPS, int SPLITS, typename OT>
__device__ __forceinline__ void epilogue_cluster(const float (&acc)[RT][TG][4], float* red, OT* __restrict__ out,
                                                 int M, int N, const float* __restrict__ scale) {
    constexpr int VALS = RT * TG * 4, ALL = WARPS * VALS * 32, THREADS = WARPS * 32;
    constexpr int SHARE = (ALL + SPLITS - 1) / SPLITS, ITERS = (SHARE + THREADS - 1) / THREADS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    copy_wait<0>();   // no copy of x or of the weights still lands in the stages
    __syncthreads();  // and every warp is done reading them
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int tg = 0; tg < TG; ++tg)
#pragma unroll
            for (int c = 0; c < 4; ++c) red[(warp * VALS + (rt * TG + tg) * 4 + c) * 32 + lane] = acc[rt][tg][c];
    cluster_sync();
    const int begin = (int)cluster_rank() * SHARE;
    float part[ITERS][SPLITS];
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int e = min(begin + i * THREADS + (int)threadIdx.x, ALL - 1);
#pragma unroll
        for (int s = 0; s < SPLITS; ++s) part[i][s] = load_from_rank(red + e, s);
    }
#pragma unroll
    for (int i = 0; i < ITERS; ++i) {
        const int e = begin + i * THREADS + (int)threadIdx.x;  // (warp w, value v, lane l)
        if (e >= min(ALL, begin + SHARE)) continue;
        const int w = e / (VALS * 32), v = (e >> 5) % VALS, l = e & 31;
        const int rt = v / (TG * 4), tg = (v >> 2) % TG, c = v & 3;
        const int tok = 8 * tg + 2 * (l & 3) + (c & 1);
        if (tok >= M) continue;
        float total = 0.0f;
#pragma unroll
        for (int s = 0; s < SPLITS; ++s) total += part[i][s];
        const int tile = (blockIdx.x * WARPS + w) * RT + rt;
        store_out(out, (long)tok * N + 16 * tile + (l >> 2) + 8 * (c >> 1), total * __ldg(scale + tok));
    }
    cluster_sync_relaxed();
}

// qmh's K loop with x from `x` (GlobalX or SharedX: SHARED_X 1), the weights through a ring of RING stages (0: none)
template <int QT, int RT, int TG, int STRIDE, int CH, int RING, int SHARED_X, typename XSource>
__device__ __forceinline__ void walk_half(XSource& x, const unsigned char* quants, const unsigned char* high,
                                          const unsigned char* scales, const u16* dvals, int tile0, int SB, int first,
                                          int end, float (&acc)[RT][TG][4]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const Consts k = make_consts();
    walk_k<QT, RT, STRIDE, RING, SHARED_X>(quants, high, scales, dvals, tile0, SB, first, end, lane, g,
                                           [&](const Weights<QT, RT>& w, int sb, int next) {
                               if constexpr (QT == Q4_K) multiply_half<RT, TG, CH>(w, x, sb, next, t, k, acc);
                               else multiply_half<RT, TG, CH>(w, x, sb, next, k, acc);
                           });
}

// xh, xsum (Q4_K), scale: prep_x's outputs for these M rows. OWN 0: the CTA's warps split K as in qmm. OWN 1:
// each warp owns RT tiles of its own and walks all of the CTA's super-blocks, the CTA's warps in step, so that x
// comes from L2 once per CTA and super-block and from L1 for its other warps (with OWN 0 every 16-row tile reads
// all of x: at 23 rows 5.3 bytes of x per byte of weights); splits fill the GPU instead. OWN 2: the same with x
// staged in shared memory (SharedX), the choice on wide matrices at 17-32 rows (2026-12-01, eighth session:
// gate/up 23 rows 41.6 -> 36.1 us; OWN 1 and the second session's per-CTA double-buffered copy were slower).
// OWN 2 with SPLITS > 1: the row group's splits add their float32 sums through global partials and a ticket
// (`finish_splits`), or with CLUSTER as one thread-block cluster through distributed shared memory
// (`epilogue_cluster`).
// OWN 3: x resident in shared memory (`ResidentX`, copied once), a grid of about one CTA an SM whose warps each walk
// whole row tiles (all of K, the order of OWN 2 with one split) grid-wide, with no barrier between warps.
// OWN 4: OWN 2 with one split and x's stages filled by one more warp (`ProducedX`, launched with WARPS + 1 warps),
// the warps synchronised by the stages' mbarriers only.
template <int QT, int RT, int TG, int WARPS, int SPLITS, int CH, int XA, int OWN, int RING, int GLU, int CLUSTER,
          typename OT>
__device__ __forceinline__ void qmh(const u16* __restrict__ xh, const u16* __restrict__ xsum,
                                    const float* __restrict__ scale, const unsigned char* __restrict__ quants,
                                    const unsigned char* __restrict__ high, const unsigned char* __restrict__ scales,
                                    const u16* __restrict__ dvals, OT* __restrict__ out, float* __restrict__ partial,
                                    int* __restrict__ tickets, int M, int N, int K) {
    const int warp = threadIdx.x >> 5;
    const int SB = K >> 8;
    int tile0 = OWN ? (blockIdx.x * WARPS + warp) * RT : blockIdx.x * RT;
    // OWN: the last CTA of a launch whose CTAs do not divide the tiles has warps past the end; they walk the last
    // tiles again (their loads hit L2) so that the CTA's barriers stay whole, and store nothing
    const bool stores = tile0 + RT <= (N >> 4);
    if (OWN && !stores) tile0 = (N >> 4) - RT;
    constexpr int STRIDE = OWN ? 1 : WARPS;  // between a warp's super-blocks
    const KRange ks = split_k<SPLITS>(SB);
    start_after_predecessors();
    if constexpr (OWN == 3) {  // x resident in shared memory after the weight rings; each warp walks whole tiles
        static_assert(SPLITS == 1, "warps walking whole tiles with x resident sum all of K");
        ResidentX<TG, WARPS * 32> x(dynamic_shared + WARPS * RING * RingStage<QT, RT>::BYTES, xh, xsum, M, K);
        for (int tile = (blockIdx.x * WARPS + warp) * RT; tile + RT <= (N >> 4); tile += gridDim.x * WARPS * RT) {
            float acc[RT][TG][4];
            zero(acc);
            walk_half<QT, RT, TG, 1, CH, RING, 0>(x, quants, high, scales, dvals, tile, SB, 0, SB, acc);
            epilogue_own<RT, TG, WARPS, 1, GLU>(acc, tile, true, out, partial, tickets, M, N, scale);
        }
        return;
    }
    const int first = OWN ? ks.begin : ks.begin + warp;
    float acc[RT][TG][4];
    zero(acc);
    if constexpr (OWN == 4) {  // x through shared memory, staged by the last warp
        static_assert(SPLITS == 1, "a producer warp stages x for one split");
        typedef ProducedX<TG, WARPS> Source;
        __shared__ __align__(16) unsigned char ring[Source::STAGES * Source::STAGE_BYTES];
        __shared__ __align__(8) unsigned long long barriers[2 * Source::STAGES];
        Source x(ring, barriers);
        if (warp == WARPS) {
            x.produce(xh, xsum, M, K, first, ks.end);
            return;
        }
        walk_half<QT, RT, TG, STRIDE, CH, RING, 0>(x, quants, high, scales, dvals, tile0, SB, first, ks.end, acc);
    } else if constexpr (OWN == 2) {  // x through shared memory
        typedef SharedX<TG, WARPS * 32, RING ? 1 : 0> Source;
        __shared__ __align__(16) unsigned char ring[Source::STAGES * Source::STAGE_BYTES];
        Source x(ring, xh, xsum, M, K, first, ks.end);
        walk_half<QT, RT, TG, STRIDE, CH, RING, 1>(x, quants, high, scales, dvals, tile0, SB, first, ks.end, acc);
        if constexpr (CLUSTER) {  // the row group's splits are one cluster: their sums meet in shared memory
            static_assert(SPLITS <= 8, "a portable cluster holds at most 8 CTAs");
            static_assert(WARPS * RT * TG * 4 * 32 * 4 <= (int)sizeof(ring), "the warps' sums must fit x's stages");
            epilogue_cluster<RT, TG, WARPS, SPLITS>(acc, reinterpret_cast<float*>(ring), out, M, N, scale);
            return;
        }
    } else {
        GlobalX<TG, XA> x(xh, xsum, M, K, first);
        walk_half<QT, RT, TG, STRIDE, CH, RING, 0>(x, quants, high, scales, dvals, tile0, SB, first, ks.end, acc);
    }
    if constexpr (OWN) epilogue_own<RT, TG, WARPS, SPLITS, GLU>(acc, tile0, stores, out, partial, tickets, M, N, scale);
    else epilogue<RT, TG, WARPS, SPLITS, GLU>(acc, tile0, out, partial, tickets, M, N, scale);
}

// The largest |x| of this thread's values of a row: 8 from first + 8 tid, then every 8 * threads, below end
template <typename XT>
__device__ __forceinline__ float thread_max(const XT* row, int first, int end, int threads) {
    float amax = 0.0f;
    for (int i = first + threadIdx.x * 8; i < end; i += threads * 8) {
        float f[8];
        x8_f32(row + i, f);
#pragma unroll
        for (int q = 0; q < 8; ++q) amax = fmaxf(amax, fabsf(f[q]));
    }
    return amax;
}

// The CTA's largest of every thread's `amax` (warps a CTA: `warps`), in every thread
__device__ __forceinline__ float cta_max(float amax, int warps) {
    __shared__ float warp_max[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = warp_max[0];
    for (int w = 1; w < warps; ++w) amax = fmaxf(amax, warp_max[w]);
    return amax;
}

// x [M, K] bf16 or float32 -> xh [M, K] f16 = x 2^e (per row, max |x 2^e| in [256, 512)) in the order QT's qmh reads it
// (Q4_K: as it is; Q6_K: store_in_step_pairs), scale [M] = 2^-e, and Q4_K's xsum. One CTA of 256 threads per row
// (K % 256 == 0, so that each step's threads are whole warps).
template <int QT, typename XT>
__device__ __forceinline__ void prep_x(const XT* __restrict__ x, u16* __restrict__ xh, u16* __restrict__ xsum,
                                       float* __restrict__ scale, int K) {
    start_after_predecessors();
    const int tok = blockIdx.x;
    const XT* row = x + (long)tok * K;
    const int e = scale_exponent(cta_max(thread_max(row, 0, K, 256), 8));
    const float up = __uint_as_float((u32)(127 + e) << 23);
    if (threadIdx.x == 0) scale[tok] = __uint_as_float((u32)(127 - e) << 23);
    u16* hrow = xh + (long)tok * K;
    for (int i = threadIdx.x * 8; i < K; i += 256 * 8) {
        float f[8];
        x8_f32(row + i, f);
        store_scaled<QT>(f, up, i, tok, K, hrow, xsum);
    }
}

// ---------------------------------------------------------------------------------------------
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
    start_after_predecessors();  // the dense buffer may still be read by the kernel before
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
