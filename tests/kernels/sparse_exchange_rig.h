// What a test of kernels/comms.cuh's SparseRowExchange sets up around the exchange: each rank's
// device and the NCCL communicator of all ranks, and the rig: a compute and a comms stream, the event
// the gradient's last writer records, and the device buffer and the pinned one for the plans' row indexes, sized for the exchange.
#pragma once
#include "../../kernels/comms.cuh"
#include "../device_util.h"

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>

// On every rank (after MPI_Init): device rank % devices, and a communicator of MPI_COMM_WORLD's ranks
// in their order, its id from rank 0.
inline ncclComm_t nccl_world(int rank, int world) {
    int devices = 0;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    CUDA_CHECK(cudaSetDevice(rank % devices));
    ncclUniqueId id;
    if (rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    NCCL_CHECK(ncclCommInitRank(&comm, world, id, rank));
    return comm;
}

// The streams, event and buffers of one exchange; released with the rig, after the exchange it makes.

struct SparseExchangeRig {
    size_t device_bytes, host_bytes;
    test::DeviceBuffer<unsigned char> workspace;
    int32_t* pinned = nullptr;
    cudaStream_t compute = nullptr, comms = nullptr;
    cudaEvent_t grad_ready = nullptr;

    SparseExchangeRig(int rows, int cols, int world, int max_touched)
        : device_bytes(sparse_exchange_device_bytes(rows, cols, world, max_touched)),
          host_bytes(sparse_exchange_host_bytes(rows, world, max_touched)),
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
        return SparseRowExchange(rows, cols, max_touched, nccl, comms, workspace.ptr, device_bytes);
    }
};
