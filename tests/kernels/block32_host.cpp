// kernels/quant_matmul/block32_mma.cu built for the host: each CTA's threads run as host threads, a warp's 32 meeting
// at every MMA (each lane posts its fragments, then computes its own accumulators from all of them, as mma.sync's
// m16n8k16 layout assigns them) and the CTA's at __syncthreads, one CTA after another; the PTX primitives (prmt,
// sub.f16x2, the streaming load) as the PTX manual defines them. So the kernel's indexing, bit work and sums are
// tested on a machine without a GPU (test_block32_mma.py compiles this with g++ and -DHOST_QT, HOST_TG, HOST_RT, HOST_WARPS).
// stdin: int32 M, N, K, then float16 xh [M, K], float32 scale [M], then the weight's
// fields as bytes: q, qh, s, sh, d, dmin, each preceded by its int64 byte count. stdout: float32 out [M, N].
#include <barrier>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cmath>
#include <stdexcept>
#include <thread>
#include <vector>

typedef unsigned int u32;
typedef unsigned short u16;
struct uint2 { u32 x, y; };
struct uint4 { u32 x, y, z, w; };
struct Index { unsigned x = 0, y = 0, z = 0; };
thread_local Index threadIdx;
static Index blockIdx;
static std::barrier<>* cta_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static u32 posted[64][32][6];  // per warp and lane: a[4], b0, b1 of the MMA under way
static inline void __syncthreads() { cta_barrier->arrive_and_wait(); }

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(threads)
#define __restrict__
#define __shared__ static
#define B32_HOST 1

static inline int min(int a, int b) { return a < b ? a : b; }
template <typename T> static inline T __ldg(const T* p) { return *p; }
static inline u32 __float_as_uint(float f) { u32 u; std::memcpy(&u, &f, 4); return u; }
static inline float half_to_float(u16 h) { _Float16 f; std::memcpy(&f, &h, 2); return (float)f; }
static inline u16 float_to_half_bits(float v) { _Float16 f = (_Float16)v; u16 h; std::memcpy(&h, &f, 2); return h; }

static inline uint2 b32_stream(const unsigned char* p) { uint2 v; std::memcpy(&v, p, 8); return v; }
static inline u32 b32_stream4(const unsigned char* p) { u32 v; std::memcpy(&v, p, 4); return v; }

// prmt.b32 (default mode): byte i of the result is byte (selector nibble i & 7) of {b, a}, or that byte's sign
// replicated where the nibble's top bit is set
static inline u32 b32_prmt(u32 a, u32 b, u32 selector) {
    const unsigned long long both = (unsigned long long)a | ((unsigned long long)b << 32);
    u32 r = 0;
    for (int i = 0; i < 4; ++i) {
        const u32 nibble = (selector >> (4 * i)) & 0xF;
        u32 byte = (u32)(both >> (8 * (nibble & 7))) & 0xFF;
        if (nibble & 8) byte = byte & 0x80 ? 0xFF : 0;
        r |= byte << (8 * i);
    }
    return r;
}

static inline u32 b32_sub(u32 a, u32 b) {
    const u16 lo = float_to_half_bits(half_to_float((u16)(a & 0xFFFF)) - half_to_float((u16)(b & 0xFFFF)));
    const u16 hi = float_to_half_bits(half_to_float((u16)(a >> 16)) - half_to_float((u16)(b >> 16)));
    return (u32)lo | ((u32)hi << 16);
}

static inline u32 b32_opaque(u32 v) { return v; }

static inline float lo_half(u32 v) { return half_to_float((u16)(v & 0xFFFF)); }
static inline float hi_half(u32 v) { return half_to_float((u16)(v >> 16)); }

// mma.sync.m16n8k16 f32 += f16 x f16: A [16, 16] (lane (g, t): a0 row g cols 2t, 2t + 1; a1 row g + 8; a2, a3 the
// same at cols + 8), B [16, 8] (b0 rows 2t, 2t + 1 of col g; b1 rows + 8), C [16, 8] (c0, c1 row g cols 2t, 2t + 1;
// c2, c3 row g + 8)
static inline void b32_mma(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32* mine = posted[warp][lane];
    for (int i = 0; i < 4; ++i) mine[i] = a[i];
    mine[4] = b0;
    mine[5] = b1;
    warp_barriers[warp]->arrive_and_wait();
    auto A = [&](int row, int col) {  // the lane holding (row, col) and its register
        const u32* p = posted[warp][4 * (row & 7) + ((col & 7) >> 1)];
        const u32 v = p[(row >> 3) + 2 * (col >> 3)];
        return col & 1 ? hi_half(v) : lo_half(v);
    };
    auto B = [&](int row, int col) {
        const u32 v = posted[warp][4 * col + ((row & 7) >> 1)][4 + (row >> 3)];
        return row & 1 ? hi_half(v) : lo_half(v);
    };
    for (int i = 0; i < 4; ++i) {
        const int row = g + 8 * (i >> 1), col = 2 * t + (i & 1);
        double sum = 0;
        for (int k = 0; k < 16; ++k) sum += (double)A(row, k) * (double)B(k, col);
        c[i] += (float)sum;
    }
    warp_barriers[warp]->arrive_and_wait();
}

#include "kernel.cu"

template <typename T> static std::vector<T> read(size_t n) {
    std::vector<T> values(n);
    if (n && std::fread(values.data(), sizeof(T), n, stdin) != n) throw std::runtime_error("short input");
    return values;
}

static std::vector<unsigned char> field() {
    const long long size = read<long long>(1)[0];
    std::vector<unsigned char> bytes = read<unsigned char>((size_t)size);
    bytes.resize(bytes.size() + 16);  // a field the type lacks: never read, but its pointer must exist
    return bytes;
}

int main() {
    const std::vector<int> dims = read<int>(3);
    const int M = dims[0], N = dims[1], K = dims[2];
    const auto xh = read<u16>((size_t)M * K);
    const auto scale = read<float>(M);
    const auto q = field(), qh = field(), s = field(), sh = field(), d = field(), dmin = field();
    std::vector<float> out((size_t)M * N, NAN);
    const int threads = 32 * HOST_WARPS;
    for (int w = 0; w < HOST_WARPS; ++w) warp_barriers.push_back(new std::barrier<>(32));
    for (unsigned x = 0; x < (unsigned)((N + 16 * HOST_RT - 1) / (16 * HOST_RT)); ++x) {
        blockIdx = {x, 0, 0};
        std::barrier<> barrier(threads);
        cta_barrier = &barrier;
        std::vector<std::thread> pool;
        for (int i = 0; i < threads; ++i) {
            pool.emplace_back([&, i] {
                threadIdx = {(unsigned)i, 0, 0};
                block32_mm<HOST_QT, HOST_TG, HOST_RT, HOST_WARPS>(xh.data(), scale.data(), q.data(), qh.data(), s.data(),
                                              reinterpret_cast<const u16*>(sh.data()),
                                              reinterpret_cast<const u16*>(d.data()),
                                              reinterpret_cast<const u16*>(dmin.data()), out.data(), M, N, K);
            });
        }
        for (auto& thread : pool) thread.join();
    }
    std::fwrite(out.data(), sizeof(float), out.size(), stdout);
    return 0;
}
