// The generator of parameter initialization: counter-based (splitmix64 of the seed and the element
// index), so the same seed gives the same parameters on any GPU, any launch shape and in the CPU build.
#pragma once
#include <algorithm>
#include <cstdint>

#include "../kernels/common.cuh"

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
// A uniform in (0, 1) from the 24 high bits of the hash of (seed, i).
__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
    return (static_cast<float>(splitmix64(seed ^ splitmix64(i)) >> 40) + 0.5f) * 0x1p-24f;
}
// p[i] = uniform(-bound, bound)
__global__ void init_uniform_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float bound) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16((2.0f * hash_uniform(seed, i) - 1.0f) * bound);
}
// p[i] = normal(0, std) by Box-Muller on two hashed uniforms
__global__ void init_normal_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed, float std) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float u1 = hash_uniform(seed, 2 * i), u2 = hash_uniform(seed, 2 * i + 1);
        p[i] = __float2bfloat16(std * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
    }
}
inline dim3 grid_for(int64_t n) { return dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div<int64_t>(n, 256), 4096))); }

// The launchers. Their work is the n bf16 writes (the integer hashing is not counted: these run once,
// before training).
inline void init_uniform(__nv_bfloat16* p, int64_t n, uint64_t seed, float bound, cudaStream_t s) {
    launch(Work{.name = "init_uniform", .bytes_written = 2.0 * n}, init_uniform_kernel, grid_for(n), dim3(256), 0, s, p,
           n, seed, bound);
}
inline void init_normal(__nv_bfloat16* p, int64_t n, uint64_t seed, float std, cudaStream_t s) {
    launch(Work{.name = "init_normal", .bytes_written = 2.0 * n}, init_normal_kernel, grid_for(n), dim3(256), 0, s, p, n,
           seed, std);
}
// p[i] = +1 or -1, each with probability 1/2 (the top bit of the hash): upstream's randn(...).sign()
// for record 83's bigram sign table (a fixed random table; upstream draws it unseeded on rank 0).
__global__ void init_signs_kernel(__nv_bfloat16* p, int64_t n, uint64_t seed) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16(splitmix64(seed ^ splitmix64(i)) >> 63 ? -1.0f : 1.0f);
}
inline void init_signs(__nv_bfloat16* p, int64_t n, uint64_t seed, cudaStream_t s) {
    launch(Work{.name = "init_signs", .bytes_written = 2.0 * n}, init_signs_kernel, grid_for(n), dim3(256), 0, s, p, n,
           seed);
}
