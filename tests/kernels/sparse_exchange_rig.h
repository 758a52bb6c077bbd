// What a test of kernels/comms.cuh's SparseRowExchange sets up around the exchange: a compute and a
// comms stream, the event the gradient's last writer records, and the device and pinned buffers
// sized for the exchange. Released with the rig; the exchange it makes must go first.
#pragma once
#include "../../kernels/comms.cuh"
#include "../device_util.h"

#include <algorithm>
#include <cstdint>

struct SparseExchangeRig {
    size_t device_bytes, host_bytes;
    test::DeviceBuffer<unsigned char> workspace;
    int32_t* pinned = nullptr;
    cudaStream_t compute = nullptr, comms = nullptr;
    cudaEvent_t grad_ready = nullptr;

    SparseExchangeRig(int rows, int cols, int world, int max_touched)
        : device_bytes(sparse_exchange_device_bytes(rows, cols, world, max_touched)),
          host_bytes(sparse_exchange_host_bytes(rows, max_touched)),
          workspace(device_bytes) {
        CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&pinned), std::max<size_t>(host_bytes, 1)));
        CUDA_CHECK(cudaStreamCreate(&compute));
        CUDA_CHECK(cudaStreamCreate(&comms));
        CUDA_CHECK(cudaEventCreateWithFlags(&grad_ready, cudaEventDisableTiming));
    }
    ~SparseExchangeRig() {
        CUDA_CHECK(cudaEventDestroy(grad_ready));
        CUDA_CHECK(cudaStreamDestroy(comms));
        CUDA_CHECK(cudaStreamDestroy(compute));
        CUDA_CHECK(cudaFreeHost(pinned));
    }
    SparseExchangeRig(const SparseExchangeRig&) = delete;
    SparseExchangeRig& operator=(const SparseExchangeRig&) = delete;

    // An exchange of a (rows, cols) gradient on the rig's comms stream and buffers.
    SparseRowExchange exchange(int rows, int cols, int max_touched, ncclComm_t nccl) {
        return SparseRowExchange(rows, cols, max_touched, MPI_COMM_WORLD, nccl, comms, workspace.ptr, device_bytes,
                                 pinned, host_bytes);
    }
};
