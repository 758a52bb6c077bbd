// train_gpt: the speedrun trainer. Until the model lands (issues 5-7) this program is the
// platform check that `make run` performs: on every rank it runs a kernel, a cuBLASLt matmul and
// an NCCL all-reduce exactly as the trainer will (one GPU per local rank, the NCCL id broadcast
// over MPI), and compares each result with the same computation on the host.
//   mpirun -np 8 ./train_gpt          (GPU build)
//   mpirun -np 2 ./train_gpt_cpu      (CPU build, emu)
#include "kernels/common.cuh"
#include "kernels/matmul.cuh"

#include <mpi.h>
#include <nccl.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define NCCL_CHECK(call)                                                                              \
    do {                                                                                              \
        ncclResult_t r_ = (call);                                                                     \
        if (r_ != ncclSuccess) {                                                                      \
            std::fprintf(stderr, "NCCL error at %s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                         ncclGetErrorString(r_));                                                     \
            std::exit(EXIT_FAILURE);                                                                  \
        }                                                                                             \
    } while (0)

// x[i] = sin(0.01*i + rank): distinct, known data on every rank.
__global__ void fill_rank_pattern(__nv_bfloat16* x, int n, int rank) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __float2bfloat16(sinf(0.01f * i + rank));
}

static float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    int rank, world;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
    int local_rank, devices;
    MPI_Comm_rank(local, &local_rank);
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CUDA_CHECK(cudaSetDevice(local_rank % devices));
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, local_rank % devices));
    if (rank == 0) std::printf("device: %s, %d SMs, %d rank(s)\n", prop.name, prop.multiProcessorCount, world);

    ncclUniqueId id;
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    NCCL_CHECK(ncclCommInitRank(&comm, world, id, rank));
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));

    // a (M x K) @ b^T (N x K) on the tensor cores, then the sum over ranks.
    const int M = 64, N = 48, K = 96;
    __nv_bfloat16 *a, *b;
    float* out;
    CUDA_CHECK(cudaMalloc(&a, M * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&b, N * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&out, M * N * sizeof(float)));
    launch(fill_rank_pattern, dim3(ceil_div(M * K, 256)), dim3(256), 0, stream, a, M * K, rank);
    launch(fill_rank_pattern, dim3(ceil_div(N * K, 256)), dim3(256), 0, stream, b, N * K, 1000 + rank);
    CUDA_CHECK_LAUNCH();
    {
        CublasLt lt;
        matmul_forward(lt, out, a, b, M, N, K, stream);
        NCCL_CHECK(ncclAllReduce(out, out, M * N, ncclFloat32, ncclSum, comm, stream));
        std::vector<float> got(M * N);
        CUDA_CHECK(cudaMemcpyAsync(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
        CUDA_CHECK(cudaStreamSynchronize(stream));

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
        CUDA_CHECK(cudaStreamDestroy(stream));
        NCCL_CHECK(ncclCommDestroy(comm));
        MPI_Comm_free(&local);
        MPI_Finalize();
        return ok ? 0 : 1;
    }
}
