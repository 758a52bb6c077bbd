// The basics every kernel family shares: error checks, ceil-div, warp and block
// reductions, and 128-bit vector loads and stores.
#pragma once
#include "platform.cuh"

#include <cstdio>
#include <cstdlib>

// ---- error checks: a failed call names itself, its file and line, then exits ----
inline void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "CUDA error at %s:%d: %s: %s (%s)\n", file, line, what, cudaGetErrorString(e),
                     cudaGetErrorName(e));
        std::exit(EXIT_FAILURE);
    }
}
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
// After a launch: a bad configuration shows up here, not at the launch.
#define CUDA_CHECK_LAUNCH() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

template <class T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

// ---- reductions ----
// Sum over the 32 lanes of a warp; every lane gets the result (butterfly).
__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over a 1-D block whose size is a multiple of 32; every thread gets the result.
// The leading barrier lets consecutive calls reuse the same scratch.
__device__ inline float block_reduce_sum(float v) {
    __shared__ float warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    return warp_reduce_sum(lane < warps ? warp_sums[lane] : 0.0f);
}
__device__ inline float block_reduce_max(float v) {
    __shared__ float warp_maxes[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_reduce_max(v);
    __syncthreads();
    if (lane == 0) warp_maxes[warp] = v;
    __syncthreads();
    return warp_reduce_max(lane < warps ? warp_maxes[lane] : -INFINITY);
}

// ---- 128-bit vectors: one 16-byte load or store moves 16/sizeof(T) elements ----
template <class T>
struct alignas(16) Pack128 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
    __device__ __forceinline__ T& operator[](int i) { return v[i]; }
    __device__ __forceinline__ const T& operator[](int i) const { return v[i]; }
    __device__ __forceinline__ static Pack128 filled(T x) {
        Pack128 p;
#pragma unroll
        for (int i = 0; i < size; ++i) p.v[i] = x;
        return p;
    }
};
// `p` must be 16-byte aligned.
template <class T>
__device__ __forceinline__ Pack128<T> load128(const T* p) {
    return *reinterpret_cast<const Pack128<T>*>(p);
}
// Streaming load: data read once, not worth keeping in cache.
template <class T>
__device__ __forceinline__ Pack128<T> load128cs(const T* p) {
    Pack128<T> r;
    *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
    return r;
}
template <class T>
__device__ __forceinline__ void store128(T* p, const Pack128<T>& v) {
    *reinterpret_cast<Pack128<T>*>(p) = v;
}
// Streaming store: written once, read by a later kernel.
template <class T>
__device__ __forceinline__ void store128cs(T* p, const Pack128<T>& v) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}
