// EMU_RANDOM_ORDER shuffles the order in which a block's threads run between barriers,
// so a missing barrier shows up as wrong results. The program first checks the default
// order (where the planted bug happens to be invisible), then re-runs itself in random mode.
#include "../../kernels/common.cuh"
#include "../device_util.h"

#include <unistd.h>

#include <string>
#include <vector>

__global__ void broadcast_without_barrier(int* out) {  // the planted bug
    __shared__ int value;
    if (threadIdx.x == 0) value = 1000 + blockIdx.x;
    out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}
__global__ void broadcast_with_barrier(int* out) {
    __shared__ int value;
    if (threadIdx.x == 0) value = 1000 + blockIdx.x;
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = value;
}
// Warps that move in lockstep (here: several __syncwarp between the read and the overwrite) hide a
// missing barrier unless one warp runs ahead of the others, as random mode lets a warp do.
template <bool Barrier>
__global__ void read_neighbour_warp_then_overwrite(int* out) {
    __shared__ int buf[128];
    const int t = threadIdx.x;
    buf[t] = 1000 * blockIdx.x + t;
    __syncthreads();
    const int got = t < 96 ? buf[t + 32] : buf[t];  // each warp reads the next warp's values
    for (int i = 0; i < 4; ++i) __syncwarp();
    if (Barrier) __syncthreads();
    buf[t] = -1;
    __syncthreads();
    out[blockIdx.x * 128 + t] = got;
}
int wrong_neighbour_reads(void (*kernel)(int*)) {
    const int blocks = 32;
    test::DeviceBuffer<int> d(blocks * 128);
    launch(kernel, dim3(blocks), dim3(128), 0, nullptr, d.ptr);
    CUDA_CHECK_LAUNCH();
    const std::vector<int> h = d.download();
    int wrong = 0;
    for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < 128; ++t) wrong += h[b * 128 + t] != 1000 * b + (t < 96 ? t + 32 : t);
    return wrong;
}

__global__ void read_uninitialized_dynamic_smem(float* out) {
    out[threadIdx.x] = dynamic_smem<float>()[threadIdx.x];
}

int wrong_broadcasts(void (*kernel)(int*)) {
    const int blocks = 64, threads = 256;
    test::DeviceBuffer<int> d(blocks * threads);
    launch(kernel, dim3(blocks), dim3(threads), 0, nullptr, d.ptr);
    CUDA_CHECK_LAUNCH();
    const std::vector<int> h = d.download();
    int wrong = 0;
    for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < threads; ++t) wrong += h[b * threads + t] != 1000 + b;
    return wrong;
}

int main(int, char** argv) {
    const char* mode = std::getenv("EMU_RANDOM_ORDER");
    if (!mode || !*mode || std::string(mode) == "0") {
        test::check(wrong_broadcasts(broadcast_without_barrier) == 0,
                    "in index order thread 0 runs first, so the missing barrier goes unseen");
        test::check(wrong_neighbour_reads(read_neighbour_warp_then_overwrite<false>) == 0,
                    "in index order lockstep warps hide the missing barrier");
        const int before = test::finish();
        if (before) return before;
        const std::string seed = std::to_string(test::seed() % 1000000007 + 1);
        setenv("EMU_RANDOM_ORDER", seed.c_str(), 1);
        std::fflush(stdout);
        execv("/proc/self/exe", argv);
        std::perror("execv");
        return 1;
    }
    std::printf("random order, seed %s\n", mode);
    const int wrong = wrong_broadcasts(broadcast_without_barrier);
    test::check(wrong > 0, "random order must expose the missing barrier (%d wrong reads)", wrong);
    test::check(wrong_broadcasts(broadcast_with_barrier) == 0, "with the barrier, random order changes nothing");
    const int wrong_lockstep = wrong_neighbour_reads(read_neighbour_warp_then_overwrite<false>);
    test::check(wrong_lockstep > 0, "a warp running ahead must expose the missing barrier (%d wrong reads)", wrong_lockstep);
    test::check(wrong_neighbour_reads(read_neighbour_warp_then_overwrite<true>) == 0,
                "with the barrier, a warp running ahead changes nothing");
    test::DeviceBuffer<float> d(64);
    launch(read_uninitialized_dynamic_smem, dim3(1), dim3(64), 64 * sizeof(float), nullptr, d.ptr);
    const std::vector<float> h = d.download();
    int nans = 0;
    for (float v : h) nans += v != v;
    test::check(nans == 64, "uninitialized dynamic shared memory reads as NaN in random mode (%d of 64)", nans);
    return test::finish();
}
