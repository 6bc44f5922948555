// Thread-block clusters (sm_90): the CTAs of one cluster read each other's shared memory (distributed shared
// memory). Put before the kernels that use it (kernels/cuda_functions.py `with_cluster_helpers`): NVRTC compiles
// them with no headers, and a cubin's cache key is its whole source.

__device__ __forceinline__ unsigned cluster_rank() {
    unsigned r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}

// every thread of the cluster arrives (its shared-memory writes released) and waits for all the others
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// the same with nothing to publish (before leaving: no CTA may exit while another reads its shared memory)
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

// the float at `local` (this CTA's shared memory) as it stands in CTA `rank` of the cluster
__device__ __forceinline__ float load_from_rank(const float* local, unsigned rank) {
    unsigned address = (unsigned)__cvta_generic_to_shared(local), remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(address), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}
