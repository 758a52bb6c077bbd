// Under EMU_POISON=1 (and in EMU_RANDOM_ORDER's random mode) memory nobody wrote reads as NaN: fresh
// cudaMalloc and cudaMallocHost memory, and a block's static and dynamic shared memory at its start,
// whatever an earlier block or launch left there (a __device__ helper's static object too). Planted: kernels that read such memory, which must see
// the poison (bf16 and fp32 NaN, int -1); correct: what a block writes before reading is what it reads.
// Run without either switch, the program runs itself again under EMU_POISON=1.
#include "../../emu/poison.h"
#include "../../kernels/common.cuh"
#include "../device_util.h"

#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <vector>

using bf16 = __nv_bfloat16;
constexpr int kThreads = 64, kBlocks = 8;

__global__ void copy_out(float* f_out, bf16* h_out, int* i_out, const float* f, const bf16* h, const int* i) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    f_out[t] = f[t];
    h_out[t] = h[t];
    i_out[t] = i[t];
}

// Block `writer` fills its shared memory (static or dynamic) before reading it back; the others only read.
__global__ void shared_probe(float* out, int writer, bool dynamic) {
    __shared__ float tile[kThreads];
    float* s = dynamic ? dynamic_smem<float>() : tile;
    if (static_cast<int>(blockIdx.x) == writer) s[threadIdx.x] = static_cast<float>(threadIdx.x + 1);
    __syncthreads();
    out[blockIdx.x * kThreads + threadIdx.x] = s[(threadIdx.x + 1) % kThreads];
}

// A __device__ helper's static __shared__ object, as block_reduce_sum's: reachable from every kernel that
// calls the helper, so poisoned at each of their block starts (emu leaves alone only the objects local to
// other kernels' bodies).
__device__ float* helper_tile() {
    __shared__ float tile[kThreads];
    return tile;
}
__global__ void helper_fill() {
    helper_tile()[threadIdx.x] = 1.0f;
    __syncthreads();
}
__global__ void helper_read(float* out) { out[blockIdx.x * kThreads + threadIdx.x] = helper_tile()[threadIdx.x]; }

void test_helper_shared() {
    test::DeviceBuffer<float> out(kThreads * kBlocks);
    launch(helper_fill, dim3(256), dim3(kThreads), 0, nullptr);  // blocks on every worker fill their copies
    launch(helper_read, dim3(kBlocks), dim3(kThreads), 0, nullptr, out.ptr);
    CUDA_CHECK_LAUNCH();
    int poisoned = 0;
    for (float v : out.download()) poisoned += std::isnan(v);
    // Planted: helper_read reads the helper's object that helper_fill's blocks wrote, never writing it
    test::check(poisoned == kThreads * kBlocks,
                "a __device__ helper's static shared memory, filled by another kernel: %d of %d reads poisoned",
                poisoned, kThreads * kBlocks);
}

void test_fresh_allocations() {
    const int n = kThreads * kBlocks;
    float* f;
    bf16* h;
    int* ints;
    CUDA_CHECK(cudaMalloc(&f, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&h, n * sizeof(bf16)));
    CUDA_CHECK(cudaMalloc(&ints, n * sizeof(int)));
    test::DeviceBuffer<float> f_out(n);
    test::DeviceBuffer<bf16> h_out(n);
    test::DeviceBuffer<int> i_out(n);
    launch(copy_out, dim3(kBlocks), dim3(kThreads), 0, nullptr, f_out.ptr, h_out.ptr, i_out.ptr,
           static_cast<const float*>(f), static_cast<const bf16*>(h), static_cast<const int*>(ints));
    CUDA_CHECK_LAUNCH();
    int bad = 0;
    for (float x : f_out.download()) bad += !std::isnan(x);
    for (bf16 x : h_out.download()) bad += !std::isnan(__bfloat162float(x)) || test::bits(x) != 0xFFFF;
    for (int x : i_out.download()) bad += x != -1;
    test::check(bad == 0, "a kernel reading fresh cudaMalloc memory: %d of %d reads not poisoned", bad, 3 * n);
    for (void* p : {static_cast<void*>(f), static_cast<void*>(h), static_cast<void*>(ints)}) CUDA_CHECK(cudaFree(p));

    float* pinned;
    CUDA_CHECK(cudaMallocHost(&pinned, n * sizeof(float)));
    bad = 0;
    for (int k = 0; k < n; ++k) bad += !std::isnan(pinned[k]);
    test::check(bad == 0, "fresh cudaMallocHost memory: %d of %d floats not NaN", bad, n);
    CUDA_CHECK(cudaFreeHost(pinned));
}

void test_shared_memory(bool dynamic) {
    const char* kind = dynamic ? "dynamic" : "static";
    test::DeviceBuffer<float> out(kThreads * kBlocks);
    const size_t smem = dynamic ? kThreads * sizeof(float) : 0;
    // Every block writes first: what each reads is its own (the correct program).
    for (int writer = 0; writer < kBlocks; ++writer) {
        launch(shared_probe, dim3(kBlocks), dim3(kThreads), smem, nullptr, out.ptr, writer, dynamic);
        CUDA_CHECK_LAUNCH();
        const auto got = out.download();
        int right = 0, poisoned = 0;
        for (int b = 0; b < kBlocks; ++b)
            for (int t = 0; t < kThreads; ++t) {
                const float v = got[b * kThreads + t];
                if (b == writer) right += v == static_cast<float>((t + 1) % kThreads + 1);
                else poisoned += std::isnan(v);
            }
        // Planted: the other blocks read shared memory nobody in their block wrote, after block `writer`
        // (of this launch, or the previous launch's) filled the same storage.
        test::check(right == kThreads && poisoned == (kBlocks - 1) * kThreads,
                    "%s shared memory, writer block %d: %d of %d own values right, %d of %d unwritten reads poisoned",
                    kind, writer, right, kThreads, poisoned, (kBlocks - 1) * kThreads);
    }
}

int main(int, char** argv) {
    if (!emu::poison_enabled()) {  // the plain CTest run: again, poisoned
        setenv("EMU_POISON", "1", 1);
        execv("/proc/self/exe", argv);
        std::perror("execv /proc/self/exe");
        return 1;
    }
    test::seed();
    test_fresh_allocations();
    test_shared_memory(false);
    test_shared_memory(true);
    test_helper_shared();
    return test::finish();
}
