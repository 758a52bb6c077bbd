// Whether a buffer holds a NaN or an infinity: the trainer's device-side check of its parameters and
// optimizer state (at each validation, before each save, every --check-finite N steps).
#pragma once
#include "common.cuh"

#include <algorithm>
#include <cstdint>
#include <type_traits>

// Whether a 32-bit word holds a non-finite value: one fp32, or two bf16 (an all-ones exponent).
template <bool Fp32>
__device__ __forceinline__ bool word_nonfinite(uint32_t w) {
    if constexpr (Fp32) return (w & 0x7f800000u) == 0x7f800000u;
    else return ((w & 0x7f80u) == 0x7f80u) | ((w & 0x7f800000u) == 0x7f800000u);
}
// *flag = 1 when x (n fp32 or bf16 elements) holds a NaN or an infinity, tested on the bits: 16-byte
// loads over the whole 16-byte chunks (x 16-byte aligned), then the last few elements one by one (all
// of them where x is not aligned). Threads that find one all store the same 1, so no atomic is needed.
template <bool Fp32>
__global__ void flag_nonfinite_kernel(const void* x, int64_t n, int* flag) {
    using Elem = std::conditional_t<Fp32, uint32_t, uint16_t>;
    constexpr int64_t kPerChunk = 16 / sizeof(Elem);
    const int64_t chunks = reinterpret_cast<uintptr_t>(x) % 16 == 0 ? n / kPerChunk : 0;
    const int64_t stride = int64_t(gridDim.x) * blockDim.x, first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    bool bad = false;
    for (int64_t i = first; i < chunks; i += stride) {
        const uint4 v = static_cast<const uint4*>(x)[i];
        bad |= word_nonfinite<Fp32>(v.x) | word_nonfinite<Fp32>(v.y) | word_nonfinite<Fp32>(v.z) |
               word_nonfinite<Fp32>(v.w);
    }
    for (int64_t i = chunks * kPerChunk + first; i < n; i += stride)
        bad |= word_nonfinite<Fp32>(static_cast<const Elem*>(x)[i]);  // a bf16 widened: its high half is zero
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
    const int64_t chunks = ceil_div<int64_t>(n, fp32 ? 4 : 8);  // a thread per 16 bytes, up to 4096 x 256 threads
    const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(ceil_div<int64_t>(chunks, 256), 4096));
    const Work work = flag_nonfinite_work(n, fp32);
    if (fp32) launch(work, flag_nonfinite_kernel<true>, dim3(blocks), dim3(256), 0, stream, x, n, flag);
    else launch(work, flag_nonfinite_kernel<false>, dim3(blocks), dim3(256), 0, stream, x, n, flag);
}
