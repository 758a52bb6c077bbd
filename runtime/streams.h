// How the trainer's work crosses streams and ranks, as the step profiler sees it (profiler/work.h):
// a join of one stream onto another's work so far, and the NCCL collectives of a step. Each wrapper
// replaces one NCCL call and returns what that call returns (ncclSuccess when skipped), as the CUDA
// helpers of kernels/platform.cuh do: while a recording is on the collective is recorded with its
// kind and bytes, and in a dry run it is not issued (nor is the group around it).
#pragma once
#include <nccl.h>

#include <cstddef>

#include "../kernels/comms.cuh"
#include "../kernels/platform.cuh"

// Later work on `waiter` starts after the work enqueued on `s` so far (e is recorded on s).
inline cudaError_t join_stream(cudaStream_t waiter, cudaEvent_t e, cudaStream_t s) {
    const cudaError_t r = record_event(e, s);
    return r != cudaSuccess ? r : wait_event(waiter, e);
}

// Records a collective enqueued on `stream`; returns whether to issue it (false in a dry run).
inline bool record_collective(const Work& w, cudaStream_t stream) { return record_op(OpKind::collective, w, stream); }

inline double nccl_type_bytes(ncclDataType_t t) {
    switch (t) {
        case ncclInt8: case ncclUint8: return 1;
        case ncclFloat16: case ncclBfloat16: return 2;
        case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
        default: return 8;  // the 64-bit types
    }
}
// A collective's Work: bytes of the per-rank buffer as NCCL counts them (the contract's comm_bytes).
inline Work collective_work(const char* name, Comm kind, double elems, ncclDataType_t t) {
    return Work{.name = name, .comm = kind, .comm_bytes = elems * nccl_type_bytes(t)};
}
inline int nccl_ranks(ncclComm_t comm) {
    int n = 1;
    NCCL_CHECK(ncclCommCount(comm, &n));
    return n;
}

// Issues a collective (issue() makes the NCCL call) unless a dry run skips it; its timing ends after it.
template <class Issue>
inline ncclResult_t collective(const Work& w, cudaStream_t s, Issue&& issue) {
    if (!record_collective(w, s)) return ncclSuccess;
    const ncclResult_t r = issue();
    end_op();
    return r;
}

inline ncclResult_t all_reduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s) {
    return collective(collective_work("nccl_all_reduce", Comm::all_reduce, double(count), t), s,
                      [&] { return ncclAllReduce(send, recv, count, t, op, comm, s); });
}
// A reduce-scatter moves its input buffer: every rank's shard of recv_count.
inline ncclResult_t reduce_scatter(const void* send, void* recv, size_t recv_count, ncclDataType_t t, ncclRedOp_t op,
                                   ncclComm_t comm, cudaStream_t s) {
    const double input = double(recv_count) * nccl_ranks(comm);
    return collective(collective_work("nccl_reduce_scatter", Comm::reduce_scatter, input, t), s,
                      [&] { return ncclReduceScatter(send, recv, recv_count, t, op, comm, s); });
}
// An all-gather moves its gathered output: every rank's send_count.
inline ncclResult_t all_gather(const void* send, void* recv, size_t send_count, ncclDataType_t t, ncclComm_t comm,
                               cudaStream_t s) {
    const double output = double(send_count) * nccl_ranks(comm);
    return collective(collective_work("nccl_all_gather", Comm::all_gather, output, t), s,
                      [&] { return ncclAllGather(send, recv, send_count, t, comm, s); });
}
// A reduce moves its buffer (count elements) onto `root`; recv is read on the root only.
inline ncclResult_t reduce(const void* send, void* recv, size_t count, ncclDataType_t t, ncclRedOp_t op, int root,
                           ncclComm_t comm, cudaStream_t s) {
    return collective(collective_work("nccl_reduce", Comm::reduce, double(count), t), s,
                      [&] { return ncclReduce(send, recv, count, t, op, root, comm, s); });
}
inline ncclResult_t broadcast(const void* send, void* recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                              cudaStream_t s) {
    return collective(collective_work("nccl_broadcast", Comm::broadcast, double(count), t), s,
                      [&] { return ncclBroadcast(send, recv, count, t, root, comm, s); });
}
// ncclGroupStart / ncclGroupEnd: nothing to group in a dry run; timed, the group's collectives share its time.
inline ncclResult_t group_start() {
    if (dry_running()) return ncclSuccess;
    if (op_timer().on) op_timer().begin_group();
    return ncclGroupStart();
}
inline ncclResult_t group_end() {
    if (dry_running()) return ncclSuccess;
    const ncclResult_t r = ncclGroupEnd();
    if (op_timer().on) op_timer().end_group();
    return r;
}
