// Distributed model setup: every rank builds the model with its own seed; after the broadcast
// every rank holds rank 0's parameters, bit for bit.
#include "../trainer_under_test.h"
#include "../test_util.h"

#include <mpi.h>

uint64_t checksum(const void* device, size_t bytes) {
    std::vector<unsigned char> h(bytes);
    CUDA_CHECK(cudaMemcpy(h.data(), device, bytes, cudaMemcpyDeviceToHost));
    uint64_t x = 1469598103934665603ull;  // FNV-1a
    for (unsigned char b : h) x = (x ^ b) * 1099511628211ull;
    return x;
}

int main(int argc, char** argv) {
    Distributed d = start_distributed(&argc, &argv);
    const int rank = d.rank, world = d.world;
    cudaStream_t s;
    CUDA_CHECK(cudaStreamCreate(&s));

    Config c = tiny_preset();
    c.world_size = world;
    Model m;
    build_model(m, c, 1000 + rank, s);  // different seeds: different parameters before the broadcast
    uint64_t mine = checksum(m.param_arena.base(), m.param_arena.bytes()), root = mine;
    MPI_Bcast(&root, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (rank != 0) test::check(mine != root, "rank %d: different seeds must give different parameters", rank);
    broadcast_params(m, d.comm, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    mine = checksum(m.param_arena.base(), m.param_arena.bytes());
    test::check(mine == root, "rank %d: parameters differ from rank 0's after the broadcast", rank);
    // as the trainer builds it: the other ranks leave the draw to rank 0's broadcast, which fills every byte
    Model left;
    build_model(left, c, 1000, s, rank == 0 ? ParamsFrom::seed : ParamsFrom::rank0);
    broadcast_params(left, d.comm, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    test::check(checksum(left.param_arena.base(), left.param_arena.bytes()) == root,
                "rank %d: parameters left to rank 0's broadcast differ from rank 0's", rank);

    int failed = test::failed(), passed = test::passed(), total_failed, total_passed;
    MPI_Reduce(&failed, &total_failed, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&passed, &total_passed, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank == 0) std::printf("%d passed, %d failed\n", total_passed, total_failed);
    CUDA_CHECK(cudaStreamDestroy(s));
    stop_distributed(d);
    return failed ? 1 : 0;
}
