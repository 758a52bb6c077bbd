// Non-finite scans: whether parameters, gradients or optimizer state hold a NaN or an infinity, read
// on the bits (an all-ones exponent). The CPU build scans on the host after every step to name where
// the first one appeared (has_nonfinite); every build runs the device-side check of a list of named
// buffers at each validation, before each save and every --check-finite N steps (first_nonfinite).
#pragma once
#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "../kernels/common.cuh"
#include "../kernels/finite.cuh"
#include "host_comm.h"

// A float buffer the finite check covers, named as in the checkpoint: n elements of fp32 or bf16.
struct StateBuffer {
    std::string name;
    const void* data;
    int64_t n;
    bool fp32;
};

// A whole fp32 or bf16 buffer as floats on the host (failure reports and logs only), read on stream
// s (the stream that wrote it).
std::vector<float> host_values(const void* device, int64_t elems, bool fp32, cudaStream_t s) {
    const size_t n = size_t(elems);
    std::vector<float> v(n);
    if (fp32) {
        CUDA_CHECK(copy_async(v.data(), device, n * 4, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(sync_stream(s, "host_values"));
    } else {
        std::vector<__nv_bfloat16> h(n);
        CUDA_CHECK(copy_async(h.data(), device, n * 2, cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(sync_stream(s, "host_values"));
        for (size_t i = 0; i < n; ++i) v[i] = __bfloat162float(h[i]);
    }
    return v;
}

// Whether an fp32 or bf16 buffer holds a NaN or an infinity: all-ones exponents, read in chunks
// without conversion (the CPU build checks every group after every step).
bool has_nonfinite(const void* device, int64_t elems, bool fp32) {
    const size_t bytes = size_t(elems) * (fp32 ? 4 : 2);
    std::vector<uint32_t> chunk((std::min(bytes, size_t(1) << 22) + 3) / 4);
    for (size_t done = 0; done < bytes; done += chunk.size() * 4) {
        const size_t n = std::min(chunk.size() * 4, bytes - done);
        chunk[(n - 1) / 4] = 0;  // an odd bf16 count leaves half a word: zeros are finite
        CUDA_CHECK(cudaMemcpy(chunk.data(), static_cast<const char*>(device) + done, n, cudaMemcpyDeviceToHost));
        // a branch-free pass over the chunk (it vectorizes), then one test
        bool found = false;
        const size_t words = (n + 3) / 4;
        if (fp32)
            for (size_t i = 0; i < words; ++i) found |= (chunk[i] & 0x7f800000u) == 0x7f800000u;
        else
            for (size_t i = 0; i < words; ++i)
                found |= ((chunk[i] & 0x7f80u) == 0x7f80u) | ((chunk[i] & 0x7f800000u) == 0x7f800000u);
        if (found) return true;
    }
    return false;
}

// The device-side finite check of every rank's `bufs` (kernels/finite.cuh, one launch per buffer into
// `flags`, a device array of at least bufs.size() ints, one copy of the flags back), on stream s:
// where the first non-finite value is, as "exp_avg.scalars on rank 1" (list order, then rank), or ""
// when all are finite. Collective.
std::string first_nonfinite(const std::vector<StateBuffer>& bufs, int* flags, int world, int rank, cudaStream_t s) {
    std::vector<int> host(std::max<size_t>(bufs.size(), 1), 0);
    CUDA_CHECK(memset_async(flags, 0, host.size() * sizeof(int), s));
    for (size_t i = 0; i < bufs.size(); ++i) flag_nonfinite(bufs[i].data, bufs[i].n, bufs[i].fp32, flags + i, s);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(copy_async(host.data(), flags, host.size() * sizeof(int), cudaMemcpyDeviceToHost, s));
    CUDA_CHECK(sync_stream(s, "finite_flags"));
    int mine = INT32_MAX;  // buffer index * world + rank of the first bad buffer
    for (size_t i = 0; i < bufs.size() && mine == INT32_MAX; ++i)
        if (host[i]) mine = int(i) * world + rank;
    const int first = host_min(mine);
    if (first == INT32_MAX) return "";
    return bufs[size_t(first / world)].name + " on rank " + std::to_string(first % world);
}
