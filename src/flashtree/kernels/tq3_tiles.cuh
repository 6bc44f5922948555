// TQ3_0 (and Q8_0) rows on tensor cores: the helpers of the CUDA C attention kernels over quantized caches
// (attention_decode.cu, attention_verify.cu), which their loaders put before each kernel's text (NVRTC compiles with no
// headers).
//
// TQ3_0 block (14 bytes, kv_quant.py): float16 norm, qs[8] (value j's 2 index bits at bits 2 (j % 4) of byte j / 4),
// signs[4] (value j's sign at bit j % 8 of byte j / 8); value = norm * (sign ? -1 : 1) * LEVEL[index].
// Q8_0 block (34 bytes): float16 scale d, 32 int8 q; value = q * d, decoded as the float16 product, where
// tree_attention rounds the float32 product to the operands' type: float16 holds it at least as finely as bf16.

typedef unsigned int u32;
typedef unsigned short u16;

constexpr int BLOCK_BYTES = 14;
#define NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ void wait_for_predecessors() {  // programmatic dependent launch (FLASHTREE_PDL=1)
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ unsigned smem(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void copy16(unsigned dst, const void* src, bool valid) {  // zeros where not valid
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void wait_copies() { asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory"); }

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ u32 hmul2(u32 a, u32 b) {
    u32 d;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 f16x2_of(float lo, float hi) {
    u32 d;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ void mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void ldsm_x4(u32 (&a)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 (&a)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x2_trans(u32& b0, u32& b1, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(b0), "=r"(b1) : "r"(addr));
}

__device__ __forceinline__ float as_float(float v) { return v; }
__device__ __forceinline__ float as_float(u16 v) { return __uint_as_float((u32)v << 16); }  // bf16

// A TQ3_0 block's fields (the float16 norm, its two index words and sign word) decoded into 16 float16 pairs (values
// 2i, 2i + 1 in out[i], norm applied). Per index
// word, four copies, one per bit offset r, hold in byte m the selector of value 4 m + r's float16 bytes in the level
// tables (index i -> nibbles i, i + 4: i * 0x11 + 0x40). Per pair of values one permute gathers their two selectors
// from two copies, a second picks their magnitudes' bytes from the tables, a shift and an AND-OR set the signs, a
// two-lane multiply applies the norm (`tree_attention._tq3_pairs`, whose multiply-add a pair moves into the copies
// here).
__device__ __forceinline__ void decode_fields(u32 norm, u32 word0, u32 word1, u32 signs, u32 (&out)[16],
                                              u32 table_low, u32 table_high) {
    const u32 norm2 = norm | (norm << 16);
    const u32 words[2] = {word0, word1};  // values 0-15, 16-31
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const u32 w = words[h];
        u32 c[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) c[r] = ((w >> (2 * r)) & 0x03030303u) * 0x11u + 0x40404040u;
        const u32 s = (signs >> (16 * h)) & 0xFFFFu;
        const u32 spread = (s & 0x5555u) | ((s & 0xAAAAu) << 15);  // odd values' signs 16 places above the even's
#pragma unroll
        for (int q = 0; q < 8; ++q) {  // pair q of the half: values 2q, 2q + 1 = 4m + r, 4m + r + 1
            const int m = q >> 1, r = 2 * (q & 1);
            const u32 selector = prmt(c[r], c[r + 1], (u32)(m | ((m + 4) << 4)));
            const u32 magnitudes = prmt(table_low, table_high, selector);
            const u32 sign = (spread << (15 - 2 * q)) & 0x80008000u;
            out[8 * h + q] = hmul2(magnitudes | sign, norm2);
        }
    }
}

// Two adjacent blocks at `src` (28 bytes, 4-byte aligned): seven 4-byte loads (a warp's lanes taking 8 rows x 4
// block pairs of 112-byte rows hit 32 distinct banks: row stride 28 words, pair stride 7), then each block's value
// pairs (`decode_fields`) handed to store(h, out) for block h = 0, 1.
template <typename Store>
__device__ __forceinline__ void decode_block_pair(const unsigned char* src, u32 table_low, u32 table_high,
                                                  Store store) {
    const u32* words = reinterpret_cast<const u32*>(src);
    u32 w[7];
#pragma unroll
    for (int k = 0; k < 7; ++k) w[k] = words[k];
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // bytes 0-13, 14-27
        u32 out[16];
        if (h == 0)
            decode_fields(w[0] & 0xFFFFu, __funnelshift_r(w[0], w[1], 16), __funnelshift_r(w[1], w[2], 16),
                          __funnelshift_r(w[2], w[3], 16), out, table_low, table_high);
        else
            decode_fields(w[3] >> 16, w[4], w[5], w[6], out, table_low, table_high);
        store(h, out);
    }
}

constexpr int KIND_Q8 = 1;  // a Q8_0 cache's block format as tree_attention.KV_KINDS numbers it (TQ3_0: 3)
template <int KIND>
constexpr int KIND_BLOCK_BYTES = KIND == KIND_Q8 ? 34 : BLOCK_BYTES;

// Two adjacent Q8_0 blocks at `src` (68 bytes, 4-byte aligned): seventeen 4-byte loads (a warp's lanes taking 8 rows
// x 4 block pairs of 272-byte rows hit 32 distinct banks: row stride 68 words, pair stride 17), then each block's 16
// float16 value pairs handed to store(h, out) for block h = 0, 1. Four int8 a word become float16 without a convert:
// biased to unsigned (XOR 0x80) and permuted under the exponent byte 0x64 (1024 + u, exact), less 1152 gives q;
// times d rounds once.
template <typename Store>
__device__ __forceinline__ void decode_q8_block_pair(const unsigned char* src, Store store) {
    const u32* words = reinterpret_cast<const u32*>(src);
    u32 w[17];
#pragma unroll
    for (int k = 0; k < 17; ++k) w[k] = words[k];
    const u32 bias = 0x64806480u;  // 1152, 1152 in float16
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // bytes 0-33 (d, then q at 2-33), 34-67 (d at 34-35, q at 36-67)
        const u32 d = h == 0 ? w[0] & 0xFFFFu : w[8] >> 16;
        const u32 d2 = d | (d << 16);
        u32 out[16];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const u32 q4 = (h == 0 ? __funnelshift_r(w[j], w[j + 1], 16) : w[9 + j]) ^ 0x80808080u;
            out[2 * j] = hmul2(hsub2(prmt(q4, 0x64646464u, 0x4140u), bias), d2);
            out[2 * j + 1] = hmul2(hsub2(prmt(q4, 0x64646464u, 0x4342u), bias), d2);
        }
        store(h, out);
    }
}

// Two adjacent blocks of a KIND_* cache at `src` decoded into float16 pairs, handed to store(h, out) for block h.
template <int KIND, typename Store>
__device__ __forceinline__ void decode_pair(const unsigned char* src, u32 table_low, u32 table_high, Store store) {
    if constexpr (KIND == KIND_Q8)
        decode_q8_block_pair(src, store);
    else
        decode_block_pair(src, table_low, table_high, store);
}

// Copies (cp.async) of rows [r0, r0 + ROWS) of K and V (rows at or past `hi`: zeros) into `stage`: the K rows, then
// the V rows, ROW_BYTES each; this thread's 16-byte pieces are first, first + STEP, ... (a warp's lanes or a CTA's
// threads share them).
template <int ROW_BYTES, int ROWS, int STEP>
__device__ __forceinline__ void copy_kv_rows(unsigned char* stage, const unsigned char* k_base,
                                             const unsigned char* v_base, int stride_kr, int stride_vr, int r0, int hi,
                                             int first) {
    static_assert(ROW_BYTES % 16 == 0, "rows of whole 16-byte pieces");
    constexpr int PER_ROW = ROW_BYTES / 16, PIECES = ROWS * PER_ROW;
    const unsigned base = smem(stage);
#pragma unroll
    for (int i = first; i < 2 * PIECES; i += STEP) {
        const int side = i / PIECES, piece = i % PIECES, row = piece / PER_ROW, part = piece % PER_ROW;
        const int r = r0 + row;
        const bool valid = r < hi;
        const unsigned char* src = (side ? v_base + (long)(valid ? r : 0) * stride_vr
                                         : k_base + (long)(valid ? r : 0) * stride_kr) + 16 * part;
        copy16(base + side * PIECES * 16 + row * ROW_BYTES + 16 * part, src, valid);
    }
}
