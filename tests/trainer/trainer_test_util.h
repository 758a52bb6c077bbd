// What the trainer's MPI tests (they include train_gpt.cu) share: the end of a test run.
#pragma once
#include "../test_util.h"

// Every rank's checks counted on rank 0 (printed), the run's buffers, optimizer and stream freed, MPI
// stopped; the exit code: 1 where this rank failed a check.
inline int finish_trainer_test(Run& r, Optimizer& o) {
    int failed = test::failed(), passed = test::passed(), total_failed, total_passed;
    MPI_Reduce(&failed, &total_failed, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&passed, &total_passed, 1, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    if (r.d.rank == 0) std::printf("%d passed, %d failed\n", total_passed, total_failed);
    r.batches.reset();
    r.losses.release();
    destroy_optimizer(o, r.m);
    CUDA_CHECK(cudaStreamDestroy(r.s));
    stop_distributed(r.d);
    return failed ? 1 : 0;
}
