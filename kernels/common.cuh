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
