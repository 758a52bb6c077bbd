// runtime/host_comm.h over MPI: the ranks are mpirun's, MPI_COMM_WORLD's.
#include "host_comm.h"

#include <mpi.h>

HostRanks host_start(int* argc, char*** argv) {
    HostRanks h;
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &h.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &h.world);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, h.rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &h.local_rank);
    MPI_Comm_free(&local);
    return h;
}
void host_stop() { MPI_Finalize(); }
// MPI_Abort only while MPI runs: before MPI_Init or after MPI_Finalize it is an error itself.
void host_abort(int code) {
    int running = 0, finalized = 0;
    MPI_Initialized(&running);
    MPI_Finalized(&finalized);
    if (running && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
}

double host_sum(double x) {
    double all = 0;
    MPI_Allreduce(&x, &all, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    return all;
}
int host_sum(int x) {
    int all = 0;
    MPI_Allreduce(&x, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    return all;
}
int host_min(int x) {
    int all = 0;
    MPI_Allreduce(&x, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    return all;
}
double host_max(double x) {
    double all = 0;
    MPI_Allreduce(&x, &all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return all;
}
void host_broadcast(void* p, size_t bytes) {
    MPI_Bcast(p, static_cast<int>(bytes), MPI_BYTE, 0, MPI_COMM_WORLD);
}
void host_gather(const void* mine, size_t bytes, void* all) {
    MPI_Gather(mine, static_cast<int>(bytes), MPI_BYTE, all, static_cast<int>(bytes), MPI_BYTE, 0, MPI_COMM_WORLD);
}
void host_gatherv(const void* mine, int bytes, void* all, const int* counts, const int* offsets) {
    MPI_Gatherv(mine, bytes, MPI_BYTE, all, counts, offsets, MPI_BYTE, 0, MPI_COMM_WORLD);
}
void host_allgather(const void* mine, size_t bytes, void* all) {
    MPI_Allgather(mine, static_cast<int>(bytes), MPI_BYTE, all, static_cast<int>(bytes), MPI_BYTE, MPI_COMM_WORLD);
}
void host_barrier() { MPI_Barrier(MPI_COMM_WORLD); }

