// EMU_STREAMS=deferred: work waits in its stream until something needs it, and the race detector
// stops a program whose streams touch the same memory without an order between them. Each planted
// bug runs in a forked child that must stop with a message naming both operations and the buffer;
// the same program with the ordering in place must run and give the exact result. Run on 2 and 8
// ranks: the correct program's NCCL calls are real collectives, while a child's use a
// communicator of its rank alone (a forked child must not exchange MPI messages). The mode is set
// here unless the environment chose a seed.
#include "emu/streams.h"
#include "kernels/common.cuh"
#include "tests/device_util.h"

#include <mpi.h>
#include <nccl.h>

#include <functional>
#include <string>
#include <vector>

// The gradient of "rank r, element i" is r + i: a reduce-scatter's sum is known exactly.
__global__ void backward(float* grad, int n, int rank) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) grad[i] = static_cast<float>(rank + i);
}
__global__ void update(float* param, const float* shard, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) param[i] -= shard[i];
}
__global__ void fill(float* x, int n, float v) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = v;
}

namespace {

int g_rank = 0, g_n = 1;
ncclComm_t g_comm = nullptr, g_self = nullptr;  // all ranks; this rank alone

unsigned blocks(int n) { return static_cast<unsigned>((n + 127) / 128); }

// Runs fn in a child per phrase; checks each stops with a message containing its phrase.
void expect_stop(const char* what, const std::vector<std::string>& phrases, const std::function<void()>& fn) {
    for (const std::string& p : phrases) test::check_emu_stops_with(what, p.c_str(), fn);
}

struct Streams {
    cudaStream_t compute, comms;
    cudaEvent_t grads_ready, reduced;
    Streams() {
        CUDA_CHECK(cudaStreamCreate(&compute));
        CUDA_CHECK(cudaStreamCreateWithFlags(&comms, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&grads_ready, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&reduced, cudaEventDisableTiming));
    }
    ~Streams() {
        cudaEventDestroy(grads_ready);
        cudaEventDestroy(reduced);
        cudaStreamDestroy(compute);
        cudaStreamDestroy(comms);
    }
};

// Work is queued, not run, until the host synchronizes (or queries an event after it).
void test_deferral() {
    Streams st;
    test::DeviceBuffer<float> x(256);
    launch(fill, dim3(blocks(256)), dim3(128), 0, st.compute, x.ptr, 256, 7.0f);
    test::check(x.ptr[0] == 0.0f, "deferred: a kernel ran before anything needed it (rank %d)", g_rank);
    CUDA_CHECK(cudaEventRecord(st.reduced, st.compute));
    CUDA_CHECK(cudaEventQuery(st.reduced));
    test::check(x.ptr[0] == 7.0f && x.ptr[255] == 7.0f, "deferred: cudaEventQuery did not run the work before its event");
    launch(fill, dim3(blocks(256)), dim3(128), 0, st.compute, x.ptr, 256, 8.0f);
    CUDA_CHECK(cudaStreamSynchronize(st.compute));
    test::check(x.ptr[17] == 8.0f, "deferred: cudaStreamSynchronize did not run the stream's work (rank %d)", g_rank);
}

// Backward on the compute stream, reduce-scatter of the gradient on the comms stream, update of
// this rank's shard back on the compute stream: the trainer's overlap, in miniature. `wait_grads`
// and `wait_reduced` are the two cudaStreamWaitEvent calls that order it.
void overlap_step(ncclComm_t comm, bool wait_grads, bool wait_reduced, std::vector<float>* param_out) {
    Streams st;
    int ranks = 1;
    ncclCommCount(comm, &ranks);
    const int shard = 1000, n = shard * ranks;
    test::DeviceBuffer<float> grad(static_cast<size_t>(n)), reduced(shard), param(shard);
    name_device_range(grad.ptr, grad.n * sizeof(float), "grad");
    name_device_range(reduced.ptr, reduced.n * sizeof(float), "grad_shard");
    launch(backward, dim3(blocks(n)), dim3(128), 0, st.compute, grad.ptr, n, g_rank);
    CUDA_CHECK(cudaEventRecord(st.grads_ready, st.compute));
    if (wait_grads) CUDA_CHECK(cudaStreamWaitEvent(st.comms, st.grads_ready, 0));
    if (ncclReduceScatter(grad.ptr, reduced.ptr, shard, ncclFloat32, ncclSum, comm, st.comms) != ncclSuccess)
        std::exit(3);
    CUDA_CHECK(cudaEventRecord(st.reduced, st.comms));
    if (wait_reduced) CUDA_CHECK(cudaStreamWaitEvent(st.compute, st.reduced, 0));
    launch(update, dim3(blocks(shard)), dim3(128), 0, st.compute, param.ptr, static_cast<const float*>(reduced.ptr), shard);
    CUDA_CHECK(cudaDeviceSynchronize());
    if (param_out) *param_out = param.download();
}

void test_overlap() {
    std::vector<float> param;
    overlap_step(g_comm, true, true, &param);
    // element i of rank r's shard sums (q + r * shard + i) over ranks q
    const int shard = 1000;
    size_t bad = 0;
    for (int i = 0; i < shard; ++i) {
        double want = 0;
        for (int q = 0; q < g_n; ++q) want += q + g_rank * shard + i;
        bad += param[static_cast<size_t>(i)] != static_cast<float>(-want);
    }
    test::check(bad == 0, "overlapped backward, reduce-scatter and update: %zu values wrong (rank %d)", bad, g_rank);
    expect_stop("reduce-scatter without waiting for the backward",
                {"race on 'grad'", "ncclReduceScatter(", "reads it while kernel 'backward(float*, int, int)'", "writes it"},
                [] { overlap_step(g_self, false, true, nullptr); });
    expect_stop("update without waiting for the reduce-scatter",
                {"race on 'grad_shard'", "kernel 'update(float*, float const*, int)'", "reads it while ncclReduceScatter("},
                [] { overlap_step(g_self, true, false, nullptr); });
}

// Two streams writing one buffer: ordered by an event, by a host synchronize, or by the legacy
// stream's implicit order with a blocking stream; not ordered with a non-blocking one.
void test_orders() {
    Streams st;
    test::DeviceBuffer<float> x(512);
    launch(fill, dim3(4), dim3(128), 0, st.compute, x.ptr, 512, 1.0f);
    CUDA_CHECK(cudaStreamSynchronize(st.compute));
    launch(fill, dim3(4), dim3(128), 0, st.comms, x.ptr, 512, 2.0f);
    CUDA_CHECK(cudaEventRecord(st.reduced, st.comms));
    CUDA_CHECK(cudaStreamWaitEvent(st.compute, st.reduced, 0));
    launch(fill, dim3(4), dim3(128), 0, st.compute, x.ptr, 512, 3.0f);
    CUDA_CHECK(cudaMemset(x.ptr, 0, 512 * sizeof(float)));  // legacy stream: after the blocking stream's fill
    launch(fill, dim3(4), dim3(128), 0, st.compute, x.ptr, 256, 4.0f);
    CUDA_CHECK(cudaDeviceSynchronize());
    test::check(x.ptr[0] == 4.0f && x.ptr[255] == 4.0f && x.ptr[256] == 0.0f,
                "ordered writes from two streams and the legacy stream: got %g %g %g (rank %d)", x.ptr[0], x.ptr[255],
                x.ptr[256], g_rank);
    expect_stop("two streams writing one buffer unordered",
                {"race on bytes [0, 2048) of the 2048-byte cudaMalloc buffer", "kernel 'fill(float*, int, float)' on stream"},
                [&] {
                    launch(fill, dim3(4), dim3(128), 0, st.compute, x.ptr, 512, 1.0f);
                    launch(fill, dim3(4), dim3(128), 0, st.comms, x.ptr, 512, 2.0f);
                });
    expect_stop("cudaMemset on the legacy stream, then a non-blocking stream's kernel",
                {"kernel 'fill(float*, int, float)' on stream", "writes it while cudaMemset of 2048 bytes",
                 "the legacy default stream"},
                [&] {
                    CUDA_CHECK(cudaMemset(x.ptr, 0, 512 * sizeof(float)));
                    launch(fill, dim3(4), dim3(128), 0, st.comms, x.ptr, 512, 2.0f);
                });
    expect_stop("a copy reading what another stream's kernel writes",
                {"cudaMemcpyAsync of 2048 bytes", "reads it while kernel 'fill(float*, int, float)'"}, [&] {
                    float* pinned = nullptr;
                    CUDA_CHECK(cudaMallocHost(&pinned, 512 * sizeof(float)));
                    launch(fill, dim3(4), dim3(128), 0, st.compute, x.ptr, 512, 1.0f);
                    CUDA_CHECK(cudaMemcpyAsync(pinned, x.ptr, 512 * sizeof(float), cudaMemcpyDeviceToHost, st.comms));
                });
}

// Copies with host memory run when their stream gets there: the host buffer must be unchanged then.
void test_host_copies() {
    Streams st;
    test::DeviceBuffer<float> x(64);
    {
        std::vector<float> v(64, 5.0f);  // kept until the stream is synchronized
        CUDA_CHECK(cudaMemcpyAsync(x.ptr, v.data(), 64 * sizeof(float), cudaMemcpyHostToDevice, st.compute));
        CUDA_CHECK(cudaStreamSynchronize(st.compute));
    }
    test::check(x.ptr[63] == 5.0f, "pageable copy kept alive: got %g (rank %d)", x.ptr[63], g_rank);
    expect_stop("a pageable source freed before the stream ran the copy",
                {"cudaMemcpyAsync of 256 bytes from pageable host memory", "before its stream ran the copy"}, [&] {
                    {
                        std::vector<float> v(64, 6.0f);
                        CUDA_CHECK(cudaMemcpyAsync(x.ptr, v.data(), 64 * sizeof(float), cudaMemcpyHostToDevice, st.compute));
                    }
                    std::vector<float> reuse(64, -1.0f);  // likely the same memory
                    CUDA_CHECK(cudaStreamSynchronize(st.compute));
                });
    expect_stop("a pinned source refilled before the stream ran the copy",
                {"cudaMemcpyAsync of 256 bytes from pinned host memory", "the host changed that buffer"}, [&] {
                    float* pinned = nullptr;
                    CUDA_CHECK(cudaMallocHost(&pinned, 64 * sizeof(float)));
                    pinned[0] = 1.0f;
                    CUDA_CHECK(cudaMemcpyAsync(x.ptr, pinned, 64 * sizeof(float), cudaMemcpyHostToDevice, st.compute));
                    pinned[0] = 2.0f;
                    CUDA_CHECK(cudaStreamSynchronize(st.compute));
                });
    expect_stop("a pageable destination freed before the stream ran the copy",
                {"cudaMemcpyAsync of 256 bytes to pageable host memory", "before its stream ran the copy"}, [&] {
                    auto* v = new std::vector<float>(64, 0.0f);
                    CUDA_CHECK(cudaMemcpyAsync(v->data(), x.ptr, 64 * sizeof(float), cudaMemcpyDeviceToHost, st.compute));
                    delete v;
                    std::vector<float> reuse(64, -1.0f);
                    CUDA_CHECK(cudaStreamSynchronize(st.compute));
                });
}

// NCCL's group: nothing is issued until ncclGroupEnd, so a blocking call inside it is refused.
void test_group_rules() {
    Streams st;
    expect_stop("cudaStreamSynchronize inside an NCCL group",
                {"cudaStreamSynchronize inside ncclGroupStart/ncclGroupEnd"}, [&] {
                    ncclGroupStart();
                    CUDA_CHECK(cudaStreamSynchronize(st.compute));
                });
    expect_stop("a blocking cudaMemcpy inside an NCCL group", {"cudaMemcpy inside ncclGroupStart/ncclGroupEnd"}, [&] {
        float h = 0;
        test::DeviceBuffer<float> x(1);
        ncclGroupStart();
        CUDA_CHECK(cudaMemcpy(&h, x.ptr, sizeof h, cudaMemcpyDeviceToHost));
    });
}

}  // namespace

int main(int argc, char** argv) {
    setenv("EMU_STREAMS", "deferred:12345", 0);  // before any CUDA call reads it
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_n);
    test::check(emu::stream_mode() == emu::StreamMode::deferred, "EMU_STREAMS=%s is not deferred", std::getenv("EMU_STREAMS"));
    ncclUniqueId id;
    if (g_rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    if (ncclCommInitRank(&g_comm, g_n, id, g_rank) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 1);
    ncclUniqueId own;
    ncclGetUniqueId(&own);
    if (ncclCommInitRank(&g_self, 1, own, 0) != ncclSuccess) MPI_Abort(MPI_COMM_WORLD, 1);

    test_deferral();
    test_overlap();
    test_orders();
    test_host_copies();
    test_group_rules();

    ncclCommDestroy(g_comm);
    ncclCommDestroy(g_self);
    int local[2] = {test::passed(), test::failed()}, total[2] = {0, 0};
    MPI_Allreduce(local, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    test::passed() = total[0];
    test::failed() = total[1];
    const int rc = g_rank == 0 ? test::finish() : (total[1] ? 1 : 0);
    std::fflush(stdout);
    MPI_Finalize();
    return rc;
}
