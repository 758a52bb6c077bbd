// The host side of a run's processes: this process's rank, the world, and the few collectives on
// host values the trainer needs (errors agreed on, loss sums, a checkpoint's id and digests, the
// step profiler's recordings). One interface, two implementations, chosen when the program is
// linked, so that call sites never branch on the build and both link the same compiled trainer:
//   - runtime/host_comm_mpi.cpp: MPI (mpirun starts the ranks), with the MPI build (CMake's TRAIN_GPT_MPI=ON);
//   - runtime/host_comm_world1.cpp: one process and no MPI library, every collective the identity MPI
//     computes on one rank; with the single-rank build (TRAIN_GPT_MPI=OFF, and train_gpt_cpu_nompi),
//     beside runtime/nccl_world1.cpp.
// Every function but host_abort is collective: every rank calls it, in the same order.
#pragma once
#include <cstddef>

struct HostRanks {
    int rank = 0, world = 1;
    int local_rank = 0;  // among the ranks on this node: picks the GPU
};

HostRanks host_start(int* argc, char*** argv);
void host_stop();
// Ends every rank of the run (any one rank may call it); returns where there is no other rank to
// end (world 1, or before host_start), so the caller exits after it.
void host_abort(int code);

double host_sum(double x);
int host_sum(int x);
int host_min(int x);
double host_max(double x);
// Rank 0's `bytes` at p, onto every rank's p.
void host_broadcast(void* p, size_t bytes);
// Every rank's `bytes` at mine, in rank order into rank 0's all (world * bytes; unused elsewhere).
void host_gather(const void* mine, size_t bytes, void* all);
// Rank r's `bytes` at mine into rank 0's all at offsets[r]: counts[r] == rank r's bytes (both read on rank 0).
void host_gatherv(const void* mine, int bytes, void* all, const int* counts, const int* offsets);
// Every rank's `bytes` at mine, in rank order into every rank's all (world * bytes).
void host_allgather(const void* mine, size_t bytes, void* all);
void host_barrier();
