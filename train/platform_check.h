// `--check-platform`: a kernel, a cuBLASLt matmul and an NCCL all-reduce on every rank, compared with
// the host, so a broken driver, library or interconnect shows before a long run.
#pragma once
#include <cmath>
#include <cstdio>
#include <vector>

#include "../kernels/common.cuh"
#include "../kernels/matmul.cuh"

// x[i] = sin(0.01*i + offset): distinct, known data on every rank.
__global__ void fill_sine_pattern(__nv_bfloat16* x, int n, float offset) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __float2bfloat16(sinf(0.01f * i + offset));
}

// On every rank: a kernel, a cuBLASLt matmul and an NCCL all-reduce, compared with the host.
int platform_check(int rank, int world, ncclComm_t comm, cudaStream_t stream) {
    const int M = 64, N = 48, K = 96;
    __nv_bfloat16 *a, *b;
    float* out;
    CUDA_CHECK(cudaMalloc(&a, M * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&b, N * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&out, M * N * sizeof(float)));
    launch(fill_sine_pattern, dim3(ceil_div(M * K, 256)), dim3(256), 0, stream, a, M * K, float(rank));
    launch(fill_sine_pattern, dim3(ceil_div(N * K, 256)), dim3(256), 0, stream, b, N * K, float(1000 + rank));
    CUDA_CHECK_LAUNCH();
    CublasLt lt;
    matmul_forward(lt, out, a, b, M, N, K, stream);
    NCCL_CHECK(ncclAllReduce(out, out, M * N, ncclFloat32, ncclSum, comm, stream));
    std::vector<float> got(M * N);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto bf16_round = [](float v) { return __bfloat162float(__float2bfloat16(v)); };
    double worst = 0;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r)
                for (int k = 0; k < K; ++k)
                    want += double(bf16_round(std::sin(0.01f * (i * K + k) + float(r)))) *
                            bf16_round(std::sin(0.01f * (j * K + k) + float(1000 + r)));
            worst = std::max(worst, std::fabs(got[i * N + j] - want) / (1.0 + std::fabs(want)));
        }
    double worst_all;
    MPI_Allreduce(&worst, &worst_all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const bool ok = worst_all < 1e-4;  // fp32 accumulation of K products, summed over ranks
    if (rank == 0)
        std::printf("platform check %s: kernel, cuBLASLt matmul and NCCL all-reduce on %d rank(s) "
                    "(max relative error %.2e)\n", ok ? "passed" : "FAILED", world, worst_all);
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaFree(out));
    return ok ? 0 : 1;
}
