// The processes of a run: one per GPU, MPI for the host side (rank, world, agreement), NCCL for the
// device collectives. The CPU build runs the same code against emu/'s NCCL over MPI.
#pragma once
#include <mpi.h>
#include <nccl.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>
#include <vector>

#include "../kernels/common.cuh"

// One process per GPU: the rank from MPI, the device from the rank on this node, the NCCL
// communicator from a unique id that rank 0 makes and MPI broadcasts (works across nodes).
struct Distributed {
    int rank = 0, world = 1, device = 0;
    ncclComm_t comm = nullptr;
};
Distributed start_distributed(int* argc, char*** argv) {
    Distributed d;
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &d.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d.world);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &local);
    int local_rank, devices;
    MPI_Comm_rank(local, &local_rank);
    MPI_Comm_free(&local);
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    d.device = local_rank % devices;
    CUDA_CHECK(cudaSetDevice(d.device));
    ncclUniqueId id;
    if (d.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    NCCL_CHECK(ncclCommInitRank(&d.comm, d.world, id, d.rank));
    return d;
}
void stop_distributed(Distributed& d) {
    NCCL_CHECK(ncclCommDestroy(d.comm));
    MPI_Finalize();
}

// Every rank's host name in rank order, a run of equal consecutive names as name(ranks a-b). Collective.
std::string host_list(const Distributed& d) {
    constexpr int kName = 256;
    char mine[kName] = {};
    if (gethostname(mine, kName - 1) != 0) std::snprintf(mine, kName, "unknown");
    std::vector<char> all(size_t(kName) * d.world);
    MPI_Allgather(mine, kName, MPI_CHAR, all.data(), kName, MPI_CHAR, MPI_COMM_WORLD);
    std::string out;
    for (int a = 0; a < d.world;) {
        const std::string name = &all[size_t(a) * kName];
        int b = a;
        while (b + 1 < d.world && name == &all[size_t(b + 1) * kName]) ++b;
        out += (out.empty() ? "" : " ") + name + (b > a ? "(ranks " + std::to_string(a) + "-" + std::to_string(b) + ")" : "");
        a = b + 1;
    }
    return out;
}
// Every rank stops cleanly (no MPI_Abort) when any rank's check failed; the lowest failing rank
// prints its message. Collective.
void agree_or_exit(Distributed& d, const std::string& error) {
    const int mine = error.empty() ? INT32_MAX : d.rank;
    int first = INT32_MAX;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (first == INT32_MAX) return;
    if (d.rank == first) {
        std::fprintf(stderr, "train_gpt: %s\n", error.c_str());
        std::fflush(stderr);
    }
    stop_distributed(d);
    std::exit(EXIT_FAILURE);
}
