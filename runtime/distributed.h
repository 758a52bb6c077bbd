// The processes of a run: one per GPU, runtime/host_comm.h for the host side (rank, world, agreement:
// MPI, or world 1 without MPI), NCCL for the device collectives (at world 1 without MPI, the stand-in
// runtime/nccl_world1.cpp). The CPU build runs the same code against emu/'s NCCL over MPI, or the stand-in.
#pragma once
#include <nccl.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <unistd.h>
#include <vector>

#include "../kernels/common.cuh"
#include "../kernels/comms.cuh"  // NCCL_CHECK
#include "host_comm.h"

// One process per GPU: the rank from host_start, the device from the rank on this node, the NCCL
// communicator from a unique id that rank 0 makes and broadcasts (works across nodes).
struct Distributed {
    int rank = 0, world = 1, device = 0;
    ncclComm_t comm = nullptr;
};
Distributed start_distributed(int* argc, char*** argv) {
    Distributed d;
    const HostRanks h = host_start(argc, argv);
    d.rank = h.rank, d.world = h.world;
    int devices;
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    d.device = h.local_rank % devices;
    CUDA_CHECK(cudaSetDevice(d.device));
    ncclUniqueId id;
    if (d.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    host_broadcast(&id, sizeof id);
    NCCL_CHECK(ncclCommInitRank(&d.comm, d.world, id, d.rank));
    return d;
}
void stop_distributed(Distributed& d) {
    NCCL_CHECK(ncclCommDestroy(d.comm));
    host_stop();
}

// Every rank's host name in rank order, a run of equal consecutive names as name(ranks a-b). Collective.
std::string host_list(const Distributed& d) {
    constexpr int kName = 256;
    char mine[kName] = {};
    if (gethostname(mine, kName - 1) != 0) std::snprintf(mine, kName, "unknown");
    std::vector<char> all(size_t(kName) * d.world);
    host_allgather(mine, kName, all.data());
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
// Rank 0's string on every rank. Collective.
std::string rank0_string(const std::string& mine) {
    uint64_t n = mine.size();
    host_broadcast(&n, sizeof n);
    std::string out = mine;
    out.resize(n);
    host_broadcast(out.data(), n);
    return out;
}

// Every rank stops cleanly (no host_abort) when any rank's check failed; the lowest failing rank
// prints its message. Collective.
void agree_or_exit(Distributed& d, const std::string& error) {
    const int mine = error.empty() ? INT32_MAX : d.rank;
    const int first = host_min(mine);
    if (first == INT32_MAX) return;
    if (d.rank == first) {
        std::fprintf(stderr, "train_gpt: %s\n", error.c_str());
        std::fflush(stderr);
    }
    stop_distributed(d);
    std::exit(EXIT_FAILURE);
}
