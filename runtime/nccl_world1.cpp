// NCCL for a world of one rank, without the NCCL library: the single-GPU build (CMake's
// TRAIN_GPT_MPI=OFF) links this file instead of libnccl, and its CPU twin links it against emu's
// runtime instead of emu/nccl.cpp (which runs NCCL over MPI).
//
// Why a stand-in rather than a static libnccl: on one rank every collective is a copy or nothing,
// and NCCL's static library is several hundred MiB of device code for every architecture, more than
// the whole single-GPU bundle may weigh (it travels with the tree, 64 MiB in all), and the GPU
// machines have NCCL only inside PyTorch's wheels.
//
// What one rank's NCCL computes, on the stream the call names, in stream order:
//   - all-reduce, reduce, broadcast: recvbuff = sendbuff (a sum, product, min, max or average of one
//     value is that value; bf16 and fp8 values are not re-rounded, as NCCL does not round a
//     one-rank reduction either); in place (sendbuff == recvbuff) nothing moves;
//   - all-gather: recvbuff = sendbuff (this rank's block is the whole output); reduce-scatter:
//     recvbuff = sendbuff's block 0; in place is NCCL's form (sendbuff == recvbuff + rank * count,
//     recvbuff == sendbuff + rank * count: the same pointer at rank 0) and moves nothing;
//   - send and receive to and from rank 0 itself pair up inside a group (k-th send with the k-th
//     receive), as NCCL pairs them; outside a group a send to oneself would wait forever on a GPU,
//     and is refused.
// Operations between ncclGroupStart and the outermost ncclGroupEnd are queued and issued at the
// end; operations on several streams make those streams wait for each other around the group, as
// NCCL's group launch does.
//
// Checked as NCCL checks them: the communicator, datatype, reduction op, root or peer (0), NULL
// buffers, and overlaps that are not NCCL's in-place forms. Where the buffers live is not checked
// here: the CPU build's MPI NCCL (emu/nccl.cpp) checks that in every test.
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

struct ncclComm {
    bool live = true;
};

namespace {

constexpr char kIdMagic[8] = "world1";  // marks ids made by ncclGetUniqueId

thread_local std::string t_last_error;  // ncclGetLastError's answer

__attribute__((format(printf, 3, 4))) ncclResult_t fail(ncclResult_t r, const char* fn, const char* fmt, ...) {
    char buf[512];
    std::va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    t_last_error = std::string("nccl_world1: ") + fn + ": " + buf;
    std::fprintf(stderr, "%s\n", t_last_error.c_str());
    return r;
}

size_t type_size(ncclDataType_t t) {
    switch (t) {
        case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
        case ncclFloat16: case ncclBfloat16: return 2;
        case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
        case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
        default: return 0;
    }
}

enum class Kind { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, Send, Recv };

struct Op {
    Kind kind;
    const char* fn;
    const void* send;
    void* recv;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;  // the peer, for Send and Recv
    ncclComm_t comm;
    cudaStream_t stream;
};

bool reduces(Kind k) { return k == Kind::AllReduce || k == Kind::ReduceScatter || k == Kind::Reduce; }
bool has_root(Kind k) { return k == Kind::Broadcast || k == Kind::Reduce || k == Kind::Send || k == Kind::Recv; }

ncclResult_t check_comm(ncclComm_t comm, const char* fn) {
    if (!comm) return fail(ncclInvalidArgument, fn, "comm is NULL");
    if (!comm->live) return fail(ncclInvalidArgument, fn, "comm %p was destroyed", static_cast<void*>(comm));
    return ncclSuccess;
}

// At one rank every in-place form is the same pointer; any other overlap is not NCCL's.
ncclResult_t check_overlap(const Op& o) {
    const size_t bytes = o.count * type_size(o.type);
    const auto* s = static_cast<const char*>(o.send);
    const auto* r = static_cast<const char*>(o.recv);
    if (s == r || !(s < r + bytes && r < s + bytes)) return ncclSuccess;
    return fail(ncclInvalidArgument, o.fn,
                "sendbuff %p and recvbuff %p overlap without being NCCL's in-place form (at rank 0 of 1: the same pointer)",
                o.send, o.recv);
}

ncclResult_t validate(const Op& o) {
    if (ncclResult_t r = check_comm(o.comm, o.fn)) return r;
    if (type_size(o.type) == 0)
        return fail(ncclInvalidArgument, o.fn, "datatype %d is not an ncclDataType_t", static_cast<int>(o.type));
    if (reduces(o.kind) && (o.op < 0 || o.op >= ncclNumOps))
        return fail(ncclInvalidArgument, o.fn, "reduction op %d is not a built-in ncclRedOp_t", static_cast<int>(o.op));
    if (has_root(o.kind) && o.root != 0)
        return fail(ncclInvalidArgument, o.fn, "%s %d is outside the communicator's ranks [0, 1)",
                    o.kind == Kind::Send || o.kind == Kind::Recv ? "peer" : "root", o.root);
    if (o.count > static_cast<size_t>(PTRDIFF_MAX) / type_size(o.type))
        return fail(ncclInvalidArgument, o.fn, "count %zu overflows the address space", o.count);
    if (o.count == 0) return ncclSuccess;
    if (o.kind != Kind::Recv && !o.send) return fail(ncclInvalidArgument, o.fn, "sendbuff is NULL");
    if (o.kind != Kind::Send && !o.recv) return fail(ncclInvalidArgument, o.fn, "recvbuff is NULL");
    if (o.kind == Kind::Send || o.kind == Kind::Recv) return ncclSuccess;
    return check_overlap(o);
}

ncclResult_t copy(const char* fn, void* to, const void* from, size_t bytes, cudaStream_t s) {
    if (to == from || bytes == 0) return ncclSuccess;
    if (const cudaError_t e = cudaMemcpyAsync(to, from, bytes, cudaMemcpyDeviceToDevice, s); e != cudaSuccess)
        return fail(ncclUnhandledCudaError, fn, "cudaMemcpyAsync of %zu bytes failed: %s", bytes, cudaGetErrorString(e));
    return ncclSuccess;
}

// A group's operations in issue order; sends and receives to oneself paired in order.
ncclResult_t run_ops(const std::vector<Op>& ops) {
    std::vector<const Op*> sends, recvs;
    for (const Op& o : ops) {
        if (o.kind == Kind::Send) sends.push_back(&o);
        if (o.kind == Kind::Recv) recvs.push_back(&o);
    }
    if (sends.size() != recvs.size())
        return fail(ncclInvalidUsage, "ncclGroupEnd", "%zu send(s) to rank 0 but %zu receive(s) from it in one group",
                    sends.size(), recvs.size());
    for (size_t k = 0; k < sends.size(); ++k)
        if (sends[k]->count * type_size(sends[k]->type) != recvs[k]->count * type_size(recvs[k]->type))
            return fail(ncclInvalidUsage, "ncclGroupEnd", "send %zu to rank 0 has %zu bytes, the receive it pairs with %zu", k,
                        sends[k]->count * type_size(sends[k]->type), recvs[k]->count * type_size(recvs[k]->type));
    for (size_t k = 0; k < sends.size(); ++k)
        if (ncclResult_t r = copy("ncclRecv", recvs[k]->recv, sends[k]->send,
                                  recvs[k]->count * type_size(recvs[k]->type), recvs[k]->stream))
            return r;
    for (const Op& o : ops) {
        if (o.kind == Kind::Send || o.kind == Kind::Recv) continue;
        if (ncclResult_t r = copy(o.fn, o.recv, o.send, o.count * type_size(o.type), o.stream)) return r;
    }
    return ncclSuccess;
}

// Issues a group on its first stream after every other stream's work so far, and makes the other
// streams wait for it: NCCL's group launch orders its streams so.
ncclResult_t issue_group(std::vector<Op> ops) {
    if (ops.empty()) return ncclSuccess;
    const cudaStream_t first = ops.front().stream;
    std::vector<cudaStream_t> others;
    for (const Op& o : ops)
        if (o.stream != first && std::find(others.begin(), others.end(), o.stream) == others.end()) others.push_back(o.stream);
    if (others.empty()) return run_ops(ops);
    cudaEvent_t joined;
    if (cudaEventCreateWithFlags(&joined, cudaEventDisableTiming) != cudaSuccess)
        return fail(ncclUnhandledCudaError, "ncclGroupEnd", "cudaEventCreateWithFlags failed");
    bool ok = true;
    for (cudaStream_t t : others)
        ok = ok && cudaEventRecord(joined, t) == cudaSuccess && cudaStreamWaitEvent(first, joined, 0) == cudaSuccess;
    for (Op& o : ops) o.stream = first;
    const ncclResult_t r = ok ? run_ops(ops) : ncclUnhandledCudaError;
    ok = ok && cudaEventRecord(joined, first) == cudaSuccess;
    for (cudaStream_t t : others) ok = ok && cudaStreamWaitEvent(t, joined, 0) == cudaSuccess;
    ok = cudaEventDestroy(joined) == cudaSuccess && ok;
    if (r != ncclSuccess) return r;
    return ok ? ncclSuccess : fail(ncclUnhandledCudaError, "ncclGroupEnd", "joining the group's streams failed");
}

struct Group {
    int depth = 0;
    std::vector<Op> ops;
    ncclResult_t error = ncclSuccess;  // the first failed call inside the group
};
thread_local Group t_group;  // NCCL's group state is per host thread, too

ncclResult_t submit(const Op& o) {
    if (ncclResult_t r = validate(o)) {
        if (t_group.depth > 0 && t_group.error == ncclSuccess) t_group.error = r;
        return r;
    }
    if (t_group.depth > 0) {
        t_group.ops.push_back(o);
        return ncclSuccess;
    }
    if (o.kind == Kind::Send || o.kind == Kind::Recv)
        return fail(ncclInvalidUsage, o.fn, "a send to or receive from rank 0 itself outside ncclGroupStart/End never completes");
    return issue_group({o});
}

}  // namespace

extern "C" {

// 0: no NCCL library runs here. runtime/log.h prints this stand-in's name for it.
ncclResult_t ncclGetVersion(int* version) {
    if (!version) return fail(ncclInvalidArgument, "ncclGetVersion", "version is NULL");
    *version = 0;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return fail(ncclInvalidArgument, "ncclGetUniqueId", "uniqueId is NULL");
    std::memset(id->internal, 0, sizeof id->internal);
    std::memcpy(id->internal, kIdMagic, sizeof kIdMagic);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
    const char* fn = "ncclCommInitRank";
    if (!comm) return fail(ncclInvalidArgument, fn, "comm (the output pointer) is NULL");
    *comm = nullptr;
    if (nranks != 1 || rank != 0)
        return fail(ncclInvalidUsage, fn, "rank %d of %d: this build has no NCCL library, only the one-rank stand-in "
                    "(build with TRAIN_GPT_MPI=ON for more ranks)", rank, nranks);
    if (std::memcmp(commId.internal, kIdMagic, sizeof kIdMagic) != 0)
        return fail(ncclInvalidArgument, fn, "the unique id was not made by ncclGetUniqueId");
    *comm = new ncclComm;
    return ncclSuccess;
}

// The handle stays allocated, marked dead, so a use after destroy is reported rather than undefined.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (ncclResult_t r = check_comm(comm, "ncclCommDestroy")) return r;
    if (std::any_of(t_group.ops.begin(), t_group.ops.end(), [comm](const Op& o) { return o.comm == comm; }))
        return fail(ncclInvalidUsage, "ncclCommDestroy", "operations on this comm are still queued in an open group");
    comm->live = false;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    if (ncclResult_t r = check_comm(comm, "ncclCommCount")) return r;
    if (!count) return fail(ncclInvalidArgument, "ncclCommCount", "count is NULL");
    *count = 1;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    if (ncclResult_t r = check_comm(comm, "ncclCommUserRank")) return r;
    if (!rank) return fail(ncclInvalidArgument, "ncclCommUserRank", "rank is NULL");
    *rank = 0;
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (nccl_world1 printed which)";
        case ncclInvalidArgument: return "invalid argument (nccl_world1 printed which)";
        case ncclInvalidUsage: return "invalid usage (nccl_world1 printed what)";
        default: return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t) { return t_last_error.c_str(); }

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::AllReduce, "ncclAllReduce", sendbuff, recvbuff, count, datatype, op, 0, comm, stream});
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::ReduceScatter, "ncclReduceScatter", sendbuff, recvbuff, recvcount, datatype, op, 0, comm, stream});
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::AllGather, "ncclAllGather", sendbuff, recvbuff, sendcount, datatype, ncclSum, 0, comm, stream});
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Broadcast, "ncclBroadcast", sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream});
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Reduce, "ncclReduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream});
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return submit({Kind::Send, "ncclSend", sendbuff, nullptr, count, datatype, ncclSum, peer, comm, stream});
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Recv, "ncclRecv", nullptr, recvbuff, count, datatype, ncclSum, peer, comm, stream});
}

ncclResult_t ncclGroupStart() {
    ++t_group.depth;
    return ncclSuccess;
}

// A call that failed inside the group was not queued; the group's other operations still run, and
// ncclGroupEnd reports the first failure.
ncclResult_t ncclGroupEnd() {
    if (t_group.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd", "no ncclGroupStart is open");
    if (--t_group.depth > 0) return ncclSuccess;
    std::vector<Op> ops = std::move(t_group.ops);
    const ncclResult_t error = t_group.error;
    t_group.ops.clear();
    t_group.error = ncclSuccess;
    const ncclResult_t r = issue_group(std::move(ops));
    return error != ncclSuccess ? error : r;
}

}  // extern "C"

#ifdef NCCL_WORLD1_ON_EMU
// emu refuses a blocking CUDA call inside an open group (it could wait forever on a GPU): it asks
// the NCCL it is linked with how many groups are open.
namespace emu {
int nccl_group_depth() { return t_group.depth; }
}  // namespace emu
#endif
