// What the trainer's MPI tests (they include train_gpt.cu) share: the end of a test run.
#pragma once
#include "../test_util.h"

#include <mpi.h>

// A run of config `c` on this process's ranks, built as main() builds it: the model (its parameters
// broadcast unless `dry`: a dry run from before the model, nothing on the device), the optimizer
// (sparse comms where the trainer would use them), the Run with the repository's training files.
struct TrainerRun {
    Config c;
    cudaStream_t s = nullptr;
    Model m;
    Optimizer o;
    Schedule sch;
    RunOptions opt;
    Run r;
    TrainerRun(Distributed& d, const Config& config, const char* repo, bool dry)
        : c(config), sch(c), r(m, o, sch, opt, d, s) {
        CUDA_CHECK(cudaStreamCreate(&s));
        r.s = s;
        if (dry) work_recorder().start(true);
        build_model(m, c, 1337, s, dry || d.rank == 0 ? ParamsFrom::seed : ParamsFrom::rank0);
        if (!dry) broadcast_params(m, d.comm, s);
        build_optimizer(o, m, d.rank, d.world, d.world == 8 && c.grad_accum() == 1, d.comm, s);
        opt.train_files = std::string(repo) + "/" + c.train_files;
        allocate_host_buffers(r);
    }
};

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
