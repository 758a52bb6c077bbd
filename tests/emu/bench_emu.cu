// Emulated kernel throughput: CUDA threads per second for an elementwise kernel and for a
// block-reduction kernel (warp shuffles + barriers), on the configured emu workers.
#include "../../kernels/common.cuh"

#include <chrono>
#include <vector>

__global__ void scale_add(float* y, const float* x, float a, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + y[i];
}
__global__ void row_sum(float* out, const float* x, int cols) {
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += x[blockIdx.x * cols + c];
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

template <class F>
double threads_per_second(long threads, F run) {
    run();  // warm: stacks mapped, pool started
    const auto t0 = std::chrono::steady_clock::now();
    int reps = 0;
    do {
        run();
        ++reps;
    } while (std::chrono::steady_clock::now() - t0 < std::chrono::milliseconds(500));
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return threads * reps / s;
}

int main() {
    const int n = 1 << 20, rows = 1024, cols = 768, block = 256;  // rows * cols <= n
    float *x, *y, *out;
    CUDA_CHECK(cudaMalloc(&x, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&y, n * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&out, rows * sizeof(float)));
    CUDA_CHECK(cudaMemset(x, 0, n * sizeof(float)));
    CUDA_CHECK(cudaMemset(y, 0, n * sizeof(float)));
    const double ew = threads_per_second(n, [&] { launch(scale_add, dim3(n / block), dim3(block), 0, nullptr, y, x, 2.0f, n); });
    const double red = threads_per_second(long(rows) * block, [&] { launch(row_sum, dim3(rows), dim3(block), 0, nullptr, out, x, cols); });
    std::printf("emu workers: %d\n", emu::worker_count());
    std::printf("elementwise (1 thread per element):      %.1f M threads/s\n", ew / 1e6);
    std::printf("block reduction (%d threads, %d cols):  %.1f M threads/s (%.0f rows/s)\n", block, cols, red / 1e6, red / block);
    return 0;
}
