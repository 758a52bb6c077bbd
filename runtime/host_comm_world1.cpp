// runtime/host_comm.h for a world of one rank, without MPI: this process is rank 0 of 1, and every
// collective is what MPI computes on one rank.
#include "host_comm.h"

#include <cstring>

HostRanks host_start(int*, char***) { return HostRanks{}; }
void host_stop() {}
void host_abort(int) {}  // no other rank to end: the caller exits
double host_sum(double x) { return x; }
int host_sum(int x) { return x; }
int host_min(int x) { return x; }
double host_max(double x) { return x; }
void host_broadcast(void*, size_t) {}
void host_gather(const void* mine, size_t bytes, void* all) { std::memmove(all, mine, bytes); }
void host_gatherv(const void* mine, int bytes, void* all, const int*, const int* offsets) {
    std::memmove(static_cast<char*>(all) + offsets[0], mine, static_cast<size_t>(bytes));
}
void host_allgather(const void* mine, size_t bytes, void* all) { std::memmove(all, mine, bytes); }
void host_barrier() {}

