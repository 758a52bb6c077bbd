// NCCL's one-rank stand-in (runtime/nccl_world1.cpp) against what NCCL computes on one rank, in the
// CPU build (linked with emu_nompi, not the test programs' emu): every collective the trainer calls,
// on random fp32, bf16 and int32 data of ragged counts, out of place (the output equals the input bit
// for bit, and nothing past it is written) and in place (nothing moves); sends and receives to
// oneself paired inside a group, on two streams; and each misuse refused with NCCL's error code.
#include "kernels/common.cuh"
#include "tests/device_util.h"

#include <nccl.h>

#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

namespace {

ncclComm_t g_comm = nullptr;
cudaStream_t g_stream = nullptr;

bool expect(ncclResult_t got, ncclResult_t want, const std::string& what) {
    return test::check(got == want, "%s: returned %d (%s), want %d (%s)", what.c_str(), got, ncclGetErrorString(got), want,
                       ncclGetErrorString(want));
}

std::vector<uint32_t> random_words(size_t n) {
    std::vector<uint32_t> v(n);
    for (uint32_t& x : v) x = static_cast<uint32_t>(test::rng()());
    return v;
}

// Bit for bit (random bits make NaNs, which no == holds equal).
template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
std::vector<T> random_values(size_t n) {
    std::vector<T> v(n);
    const std::vector<uint32_t> w = random_words((n * sizeof(T) + 3) / 4);
    std::memcpy(static_cast<void*>(v.data()), w.data(), n * sizeof(T));
    return v;
}

// A collective that should copy `count` elements from its send to its receive buffer: the receive
// buffer holds a guard of random bits past the count, which must survive.
using Call = std::function<ncclResult_t(const void*, void*, size_t, ncclDataType_t)>;

template <class T>
void check_copy(const std::string& name, const Call& call, ncclDataType_t type, size_t count) {
    const size_t guard = 5;
    const std::vector<T> in = random_values<T>(count), before = random_values<T>(count + guard);
    test::DeviceBuffer<T> send(in), recv(before);
    expect(call(send.ptr, recv.ptr, count, type), ncclSuccess, name + " out of place");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    std::vector<T> want = before;
    std::memcpy(want.data(), in.data(), count * sizeof(T));
    const std::vector<T> got = recv.download();
    test::check(same_bytes(got, want),
                "%s out of place, %zu elements of %zu bytes: the output is not the input (or the guard was written)",
                name.c_str(), count, sizeof(T));
    // In place: the same pointer, nothing changes.
    expect(call(send.ptr, send.ptr, count, type), ncclSuccess, name + " in place");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    test::check(same_bytes(send.download(), in), "%s in place changed its buffer", name.c_str());
}

template <class T>
void check_collectives(ncclDataType_t type, size_t count) {
    for (ncclRedOp_t op : {ncclSum, ncclProd, ncclMax, ncclMin, ncclAvg})
        check_copy<T>("ncclAllReduce op " + std::to_string(op),
                      [op](const void* s, void* r, size_t n, ncclDataType_t t) { return ncclAllReduce(s, r, n, t, op, g_comm, g_stream); },
                      type, count);
    check_copy<T>("ncclReduceScatter",
                  [](const void* s, void* r, size_t n, ncclDataType_t t) { return ncclReduceScatter(s, r, n, t, ncclSum, g_comm, g_stream); },
                  type, count);
    check_copy<T>("ncclAllGather",
                  [](const void* s, void* r, size_t n, ncclDataType_t t) { return ncclAllGather(s, r, n, t, g_comm, g_stream); },
                  type, count);
    check_copy<T>("ncclBroadcast",
                  [](const void* s, void* r, size_t n, ncclDataType_t t) { return ncclBroadcast(s, r, n, t, 0, g_comm, g_stream); },
                  type, count);
    check_copy<T>("ncclReduce",
                  [](const void* s, void* r, size_t n, ncclDataType_t t) { return ncclReduce(s, r, n, t, ncclAvg, 0, g_comm, g_stream); },
                  type, count);
}

// Two sends to rank 0 and two receives from it in one group, the second pair on another stream:
// the k-th send lands in the k-th receive.
void check_send_recv() {
    cudaStream_t other;
    CUDA_CHECK(cudaStreamCreate(&other));
    const size_t n0 = size_t(test::randint(1, 300)), n1 = size_t(test::randint(1, 300));
    const std::vector<float> a = random_values<float>(n0), b = random_values<float>(n1);
    test::DeviceBuffer<float> sa(a), sb(b), ra(n0), rb(n1);
    expect(ncclGroupStart(), ncclSuccess, "ncclGroupStart");
    expect(ncclSend(sa.ptr, n0, ncclFloat32, 0, g_comm, g_stream), ncclSuccess, "ncclSend 0");
    expect(ncclRecv(ra.ptr, n0, ncclFloat32, 0, g_comm, g_stream), ncclSuccess, "ncclRecv 0");
    expect(ncclSend(sb.ptr, n1, ncclFloat32, 0, g_comm, other), ncclSuccess, "ncclSend 1");
    expect(ncclRecv(rb.ptr, n1, ncclFloat32, 0, g_comm, other), ncclSuccess, "ncclRecv 1");
    expect(ncclGroupEnd(), ncclSuccess, "ncclGroupEnd of two send/recv pairs");
    CUDA_CHECK(cudaStreamSynchronize(other));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    test::check(same_bytes(ra.download(), a) && same_bytes(rb.download(), b), "the k-th send to rank 0 lands in the k-th receive");
    CUDA_CHECK(cudaStreamDestroy(other));
}

// Each misuse NCCL refuses, refused with its code (and nothing queued runs).
void check_misuse() {
    test::DeviceBuffer<float> x(64), y(64);
    ncclUniqueId id;
    ncclComm_t c = nullptr;
    expect(ncclGetUniqueId(&id), ncclSuccess, "ncclGetUniqueId");
    expect(ncclCommInitRank(&c, 2, id, 0), ncclInvalidUsage, "two ranks in the one-rank stand-in");
    test::check(c == nullptr, "a refused ncclCommInitRank leaves no communicator");
    ncclUniqueId made_up;
    std::memset(&made_up, 7, sizeof made_up);
    expect(ncclCommInitRank(&c, 1, made_up, 0), ncclInvalidArgument, "an id not from ncclGetUniqueId");
    expect(ncclBroadcast(x.ptr, y.ptr, 64, ncclFloat32, 1, g_comm, g_stream), ncclInvalidArgument, "root 1 of 1");
    expect(ncclAllReduce(x.ptr, y.ptr, 64, static_cast<ncclDataType_t>(99), ncclSum, g_comm, g_stream), ncclInvalidArgument,
           "a datatype that is none");
    expect(ncclAllReduce(x.ptr, y.ptr, 64, ncclFloat32, static_cast<ncclRedOp_t>(ncclNumOps), g_comm, g_stream),
           ncclInvalidArgument, "a reduction op that is none");
    expect(ncclAllReduce(x.ptr, x.ptr + 1, 8, ncclFloat32, ncclSum, g_comm, g_stream), ncclInvalidArgument,
           "overlapping buffers that are not in place");
    expect(ncclAllGather(nullptr, y.ptr, 8, ncclFloat32, g_comm, g_stream), ncclInvalidArgument, "a NULL sendbuff");
    expect(ncclSend(x.ptr, 8, ncclFloat32, 0, g_comm, g_stream), ncclInvalidUsage, "a send to oneself outside a group");
    expect(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    ncclGroupStart();
    ncclSend(x.ptr, 8, ncclFloat32, 0, g_comm, g_stream);
    expect(ncclGroupEnd(), ncclInvalidUsage, "a send to oneself with no receive");
    ncclGroupStart();
    ncclSend(x.ptr, 8, ncclFloat32, 0, g_comm, g_stream);
    ncclRecv(y.ptr, 4, ncclFloat32, 0, g_comm, g_stream);
    expect(ncclGroupEnd(), ncclInvalidUsage, "a send and receive of different sizes");
    // A failed call inside a group is reported at ncclGroupEnd too; the group's valid work still runs.
    const std::vector<float> v = random_values<float>(64);
    x.upload(v);
    ncclGroupStart();
    expect(ncclReduce(x.ptr, y.ptr, 64, ncclFloat32, ncclSum, 3, g_comm, g_stream), ncclInvalidArgument, "root 3 in a group");
    ncclAllGather(x.ptr, y.ptr, 64, ncclFloat32, g_comm, g_stream);
    expect(ncclGroupEnd(), ncclInvalidArgument, "ncclGroupEnd after a failed call");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    test::check(same_bytes(y.download(), v), "a group's valid work runs beside a failed call");
    expect(ncclGetUniqueId(&id), ncclSuccess, "ncclGetUniqueId");
    expect(ncclCommInitRank(&c, 1, id, 0), ncclSuccess, "a second communicator");
    expect(ncclCommDestroy(c), ncclSuccess, "ncclCommDestroy");
    int n = 0;
    expect(ncclCommCount(c, &n), ncclInvalidArgument, "a destroyed communicator");
}

}  // namespace

int main() {
    test::seed();
    CUDA_CHECK(cudaStreamCreate(&g_stream));
    int version = -1;
    expect(ncclGetVersion(&version), ncclSuccess, "ncclGetVersion");
    test::check(version == 0, "ncclGetVersion says 0 (no NCCL library), got %d", version);
    ncclUniqueId id;
    expect(ncclGetUniqueId(&id), ncclSuccess, "ncclGetUniqueId");
    expect(ncclCommInitRank(&g_comm, 1, id, 0), ncclSuccess, "ncclCommInitRank for rank 0 of 1");
    int count = 0, rank = -1;
    expect(ncclCommCount(g_comm, &count), ncclSuccess, "ncclCommCount");
    expect(ncclCommUserRank(g_comm, &rank), ncclSuccess, "ncclCommUserRank");
    test::check(count == 1 && rank == 0, "rank %d of %d, want 0 of 1", rank, count);
    for (int k = 0; k < 3; ++k) {
        const size_t n = size_t(test::randint(1, 1000));
        check_collectives<float>(ncclFloat32, n);
        check_collectives<__nv_bfloat16>(ncclBfloat16, n);
        check_collectives<int32_t>(ncclInt32, n);
    }
    check_send_recv();
    check_misuse();
    expect(ncclCommDestroy(g_comm), ncclSuccess, "ncclCommDestroy");
    CUDA_CHECK(cudaStreamDestroy(g_stream));
    return test::finish();
}
