// What the test programs share for device data: an owning device buffer with upload and download,
// the exact values of bf16 (and fp8) elements, bf16 rounding and bit patterns, and random bf16
// vectors from the run's seeded generator. Host code on the CUDA runtime API, so it compiles in both
// builds (the CPU build's runtime is emu's).
#pragma once
#include "../kernels/common.cuh"
#include "test_util.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace test {

// Device memory for n elements of T (at least one is allocated, so n may be 0), zero-filled; freed
// with the buffer.
template <class T>
struct DeviceBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit DeviceBuffer(size_t count) : n(count) {
        const size_t bytes = std::max<size_t>(n, 1) * sizeof(T);
        CUDA_CHECK(cudaMalloc(&ptr, bytes));
        CUDA_CHECK(cudaMemset(ptr, 0, bytes));
    }
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    // Copies the host elements to the start of the buffer (at most n of them).
    void upload(const std::vector<T>& host) {
        if (host.size() > n) {
            std::fprintf(stderr, "DeviceBuffer::upload: %zu elements into a buffer of %zu\n", host.size(), n);
            std::exit(EXIT_FAILURE);
        }
        CUDA_CHECK(cudaMemcpy(ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> host(n);
        CUDA_CHECK(cudaMemcpy(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return host;
    }
};

// ---- element values: each element type's exact value as a double ----
inline double value(__nv_bfloat16 x) { return __bfloat162float(x); }
inline double value(float x) { return x; }
inline double value(double x) { return x; }
inline double value(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
inline double value(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
template <class T>
std::vector<double> values(const std::vector<T>& v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); ++i) d[i] = value(v[i]);
    return d;
}

// ---- bf16: rounding (through fp32, as a kernel's fp32 result is rounded) and bit patterns ----
inline __nv_bfloat16 to_bf16(double x) { return __float2bfloat16(static_cast<float>(x)); }
template <class T>
std::vector<__nv_bfloat16> to_bf16(const std::vector<T>& v) {
    std::vector<__nv_bfloat16> b(v.size());
    for (size_t i = 0; i < v.size(); ++i) b[i] = to_bf16(static_cast<double>(v[i]));
    return b;
}
inline double round_bf16(double x) { return value(to_bf16(x)); }
inline uint16_t bits(__nv_bfloat16 x) {
    uint16_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}
inline uint32_t bits(float x) {
    uint32_t b;
    std::memcpy(&b, &x, sizeof b);
    return b;
}

// ---- random bf16 vectors (bf16 of a double draw) ----
inline std::vector<__nv_bfloat16> normal_bf16(size_t n, double mean = 0.0, double std = 1.0) {
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = to_bf16(normal(mean, std));
    return v;
}
inline std::vector<__nv_bfloat16> uniform_bf16(size_t n, double lo, double hi) {
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = to_bf16(uniform(lo, hi));
    return v;
}
// Inputs of the 12-wide gates whose dot products are exact in fp32 and double alike, so that a kernel and
// a double reference round the same logit to bf16: `rows` rows of C uniform in [-1, 1] whose first
// `exact_cols` columns are multiples of 1/16 in [-1, 1], and weights that are multiples of 1/64 in [-1/2, 1/2].
inline std::vector<__nv_bfloat16> gate_exact_rows(int rows, int C, int exact_cols) {
    std::vector<__nv_bfloat16> v = uniform_bf16(static_cast<size_t>(rows) * C, -1, 1);
    for (int r = 0; r < rows; ++r)
        for (int j = 0; j < exact_cols; ++j) v[static_cast<size_t>(r) * C + j] = to_bf16(randint(-16, 16) / 16.0);
    return v;
}
inline std::vector<__nv_bfloat16> gate_exact_weights(int n) {
    std::vector<__nv_bfloat16> w(n);
    for (auto& x : w) x = to_bf16(randint(-32, 32) / 64.0);
    return w;
}

// A fused reduction's scratch (BlockPartials): room for `bytes` of partials and a ticket counter, zeroed.
struct DevicePartials {
    DeviceBuffer<float> partials;
    DeviceBuffer<unsigned int> done{1};
    explicit DevicePartials(size_t bytes) : partials(bytes / sizeof(float)) {}
    BlockPartials view() const { return {partials.ptr, done.ptr}; }
};
// A fused launch's sums against sum_block_partials as a second launch over the partials it left (value
// `first` onwards, `stride` per block, `blocks` blocks): `before` holds the targets before the launch,
// `fused` after it. Also checks that the launch left its counter at zero.
template <class T>
bool same_as_second_launch(const std::string& what, const DevicePartials& p, int first, int blocks, int stride,
                           const std::vector<T>& before, const std::vector<T>& fused, bool accumulate) {
    DeviceBuffer<T> want(before);
    sum_block_partials(SumTargets().add(want.ptr, static_cast<int>(before.size())), p.partials.ptr + first, blocks,
                       stride, accumulate, nullptr);
    const bool same = check(same_bits(fused, want.download()), "%s: the bits of sum_block_partials as a second launch",
                            what.c_str());
    return check(p.done.download()[0] == 0, "%s: the ticket counter is back at zero", what.c_str()) && same;
}

}  // namespace test
