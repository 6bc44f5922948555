// kernels/deltanet_tree.cu built for the host: each CTA's 128 threads run as host threads that meet at
// __syncthreads through a std::barrier, one CTA after another, so the CUDA C kernel's indexing, phases and
// barriers are tested on a machine without a GPU (test_gated_delta_cuda.py compiles this with g++ against a
// copy of the kernel with its entry, kernel.cu, and compares with the torch reference).
// stdin: int32 T, HK, H, DK, DV, then float32 q [T, HK, DK], k [T, HK, DK], v [T, H, DV], g [T, H], beta [T, H],
// state [H, DK, DV], then int64 parents [T]. stdout: float32 o [T, H, DV], u [T, H, DV], gamma [T, H],
// k_out [T, HK, DK].
#include <barrier>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <thread>
#include <vector>

struct float4 { float x, y, z, w; };
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
struct Index { unsigned x = 0, y = 0, z = 0; };
thread_local Index threadIdx;
static Index blockIdx;
static std::barrier<>* cta_barrier;
static std::vector<float> cta_shared;
static inline void __syncthreads() { cta_barrier->arrive_and_wait(); }
static inline float* host_shared() { return cta_shared.data(); }

#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(threads)

#include "kernel.cu"

template <typename T> static std::vector<T> read(size_t n) {
    std::vector<T> values(n);
    if (n && std::fread(values.data(), sizeof(T), n, stdin) != n) throw std::runtime_error("short input");
    return values;
}

int main() {
    const std::vector<int> dims = read<int>(5);
    const int T = dims[0], HK = dims[1], H = dims[2], DK = dims[3], DV = dims[4];
    const auto q = read<float>((size_t)T * HK * DK), k = read<float>((size_t)T * HK * DK);
    const auto v = read<float>((size_t)T * H * DV), g = read<float>((size_t)T * H), beta = read<float>((size_t)T * H);
    const auto state = read<float>((size_t)H * DK * DV);
    const auto parents = read<long long>(T);
    std::vector<float> o((size_t)T * H * DV), u(o.size()), gamma((size_t)T * H), k_out((size_t)T * HK * DK);
    for (unsigned x = 0; x < (unsigned)H; ++x) {
        for (unsigned y = 0; y < (unsigned)(DV / COLS); ++y) {
            blockIdx = {x, y, 0};
            cta_shared.assign(1 << 17, NAN);  // what a kernel reads before it writes shows up as NaN
            std::barrier<> barrier(THREADS);
            cta_barrier = &barrier;
            std::vector<std::thread> threads;
            for (unsigned t = 0; t < (unsigned)THREADS; ++t) {
                threads.emplace_back([&, t] {
                    threadIdx = {t, 0, 0};
                    ENTRY(q.data(), k.data(), v.data(), g.data(), beta.data(), state.data(), parents.data(), o.data(),
                          u.data(), gamma.data(), k_out.data(), T, HK, HK * DK, DK, HK * DK, DK, H * DV, DV, H, 1, H,
                          1, DK * DV, DV, H * DV, DV, H * DV, DV, H, HK * DK, DK, 1, 1);
                });
            }
            for (auto& thread : threads) thread.join();
        }
    }
    for (const auto* out : {&o, &u, &gamma, &k_out}) std::fwrite(out->data(), sizeof(float), out->size(), stdout);
    return 0;
}
