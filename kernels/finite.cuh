// Whether a buffer holds a NaN or an infinity: the trainer's device-side check of its parameters and
// optimizer state (at each validation, before each save, every --check-finite N steps).
#pragma once
#include "common.cuh"

#include <algorithm>
#include <cstdint>

// *flag = 1 when x (n fp32 or bf16 elements) holds a NaN or an infinity: an all-ones exponent,
// tested on the bits. Threads that find one all store the same 1, so no atomic is needed.
__global__ void flag_nonfinite_kernel(const void* x, int64_t n, bool fp32, int* flag) {
    bool bad = false;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x;
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
        bad |= fp32 ? (static_cast<const uint32_t*>(x)[i] & 0x7f800000u) == 0x7f800000u
                    : (static_cast<const uint16_t*>(x)[i] & 0x7f80u) == 0x7f80u;
    if (bad) *flag = 1;
}

// Reads x, writes the flag (at most); a test per element.
inline Work flag_nonfinite_work(int64_t n, bool fp32) {
    return Work{.name = "flag_nonfinite", .flops = static_cast<double>(n),
                .bytes_read = static_cast<double>(n) * (fp32 ? 4 : 2), .bytes_written = sizeof(int)};
}
// Sets *flag to 1 when x holds a non-finite value; leaves it as it is otherwise (the caller zeroes
// it). A grid-stride loop over at most 4096 blocks: one launch for any n.
inline void flag_nonfinite(const void* x, int64_t n, bool fp32, int* flag, cudaStream_t stream) {
    if (n <= 0) return;
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div<int64_t>(n, 256), 4096));
    launch(flag_nonfinite_work(n, fp32), flag_nonfinite_kernel, dim3(blocks), dim3(256), 0, stream, x, n, fp32, flag);
}
