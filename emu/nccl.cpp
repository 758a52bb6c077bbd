// The NCCL calls our programs make, on the CPU, over MPI. A communicator is an MPI
// communicator; a collective is a few rounds of MPI point-to-point messages that runs, blocking,
// when it is issued, as work on its stream after the work it depends on (streams.h): NCCL
// requires every rank to issue a communicator's collectives in the same order, so running them
// in issue order pairs them up whatever each rank's deferred streams do.
//
// Checked as the GPU would punish them: buffers must be device memory (cudaMalloc, not host
// memory) and fit in their allocation; send and receive buffers may overlap only in NCCL's
// in-place forms (all-gather: sendbuff == recvbuff + rank * sendcount; reduce-scatter: recvbuff
// == sendbuff + rank * recvcount); a blocking CUDA call inside a group stops the program.
//
// Reductions are deterministic and identical on every rank: each element is reduced by exactly
// one rank (its owner), which combines the ranks' values in rank order, accumulating 16- and
// 8-bit floats in fp32 and rounding once; the owner then sends the finished bits to the others.
// ncclAvg is the sum divided by the number of ranks (truncating for integers).
//
// Operations issued between ncclGroupStart and ncclGroupEnd are queued; at the outermost
// ncclGroupEnd all sends and receives are posted at once (so any pattern of send/recv pairs
// completes), then the collectives run in issue order, then the sends and receives are waited
// for.
//
// EMU_NCCL_SLICE_BYTES (default 64 MiB, at most 1 GiB) caps each collective's MPI messages and
// the reductions' scratch memory per communicator; ranks agree on the smallest value when a
// communicator is made.
//
// Limits: ncclCommInitRank is collective over MPI_COMM_WORLD (every process calls it, with the
// same or different unique ids); collectives on different communicators inside one group run
// in issue order, so every rank must issue them in the same order.
#include <mpi.h>
#include <nccl.h>

#include "streams.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <vector>

struct ncclComm {
    MPI_Comm coll = MPI_COMM_NULL;  // the collectives' messages
    MPI_Comm p2p = MPI_COMM_NULL;   // ncclSend/ncclRecv's: apart, so a user message never matches a collective's
    int rank = 0, nranks = 0;
    size_t slice_bytes = 0;
    bool finalized = false;
    ncclResult_t async_error = ncclSuccess;
    std::vector<unsigned char> scratch;  // received pieces awaiting reduction
};

namespace {

constexpr char kIdMagic[8] = "emunccl";  // marks ids made by ncclGetUniqueId
constexpr size_t kDefaultSliceBytes = size_t(64) << 20;
constexpr size_t kMaxSliceBytes = size_t(1) << 30;  // MPI counts are ints
constexpr unsigned kConfigMagic = 0xcafebeef;        // what NCCL_CONFIG_INITIALIZER writes

thread_local std::string t_last_error;  // ncclGetLastError's answer (NCCL keeps one per thread, too)

__attribute__((format(printf, 3, 4))) ncclResult_t fail(ncclResult_t r, const char* fn, const char* fmt, ...) {
    char buf[512];
    std::va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    t_last_error = std::string("emu: ") + fn + ": " + buf;
    std::fprintf(stderr, "%s\n", t_last_error.c_str());
    return r;
}

ncclResult_t mpi_fail(ncclComm* comm, const char* fn, const char* what, int rc) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    if (comm) comm->async_error = ncclSystemError;
    return fail(ncclSystemError, fn, "%s failed: %.*s", what, len, msg);
}

// Communicators alive now: a destroyed or made-up handle is reported rather than dereferenced.
std::mutex g_live_mutex;
std::unordered_set<const ncclComm*> g_live;
bool is_live(const ncclComm* c) {
    std::lock_guard<std::mutex> lock(g_live_mutex);
    return g_live.count(c) != 0;
}

bool mpi_finalized() {
    int f = 0;
    MPI_Finalized(&f);
    return f != 0;
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

// ---- element-wise reduction ----

// Integers wrap around, as the GPU's integer adds and multiplies do.
template <class T>
struct IntArith {
    using Acc = T;
    using U = std::make_unsigned_t<T>;
    static Acc load(T x) { return x; }
    static T store(Acc a) { return a; }
    static Acc add(Acc a, Acc b) { return static_cast<T>(static_cast<U>(a) + static_cast<U>(b)); }
    static Acc mul(Acc a, Acc b) { return static_cast<T>(static_cast<U>(a) * static_cast<U>(b)); }
    static Acc max(Acc a, Acc b) { return a < b ? b : a; }
    static Acc min(Acc a, Acc b) { return b < a ? b : a; }
    static Acc div(Acc a, int n) {
        if constexpr (std::is_signed_v<T>) return static_cast<T>(static_cast<int64_t>(a) / n);
        else return static_cast<T>(static_cast<uint64_t>(a) / static_cast<uint64_t>(n));
    }
};

// Floats accumulate in fp32 (fp64 for doubles) and are rounded to T once, at the end.
template <class T, class A, A (*Load)(T), T (*Store)(A)>
struct FloatArith {
    using Acc = A;
    static Acc load(T x) { return Load(x); }
    static T store(Acc a) { return Store(a); }
    static Acc add(Acc a, Acc b) { return a + b; }
    static Acc mul(Acc a, Acc b) { return a * b; }
    static Acc max(Acc a, Acc b) { return std::fmax(a, b); }
    static Acc min(Acc a, Acc b) { return std::fmin(a, b); }
    static Acc div(Acc a, int n) { return a / static_cast<Acc>(n); }
};
template <class T> T same(T x) { return x; }
float bf16_load(__nv_bfloat16 x) { return __bfloat162float(x); }
__nv_bfloat16 bf16_store(float a) { return __float2bfloat16(a); }
float half_load(__half x) { return __half2float(x); }
__half half_store(float a) { return __float2half(a); }
float e4m3_load(__nv_fp8_e4m3 x) { return static_cast<float>(x); }
__nv_fp8_e4m3 e4m3_store(float a) { return __nv_fp8_e4m3(a); }
float e5m2_load(__nv_fp8_e5m2 x) { return static_cast<float>(x); }
__nv_fp8_e5m2 e5m2_store(float a) { return __nv_fp8_e5m2(a); }

// out[i] = finish(in[0][i] (+) in[1][i] (+) ... in[n-1][i]), combined left to right. A block of
// every input is read before that block of out is written, so out may be one of the inputs.
template <class T, class Ar, class Combine, class Finish>
void fold(const void* const* in, int n, void* out, size_t len, Combine combine, Finish finish) {
    using A = typename Ar::Acc;
    constexpr size_t kBlock = 256;
    A acc[kBlock];
    T* o = static_cast<T*>(out);
    for (size_t b = 0; b < len; b += kBlock) {
        const size_t m = std::min(kBlock, len - b);
        const T* x = static_cast<const T*>(in[0]) + b;
        for (size_t k = 0; k < m; ++k) acc[k] = Ar::load(x[k]);
        for (int r = 1; r < n; ++r) {
            x = static_cast<const T*>(in[r]) + b;
            for (size_t k = 0; k < m; ++k) acc[k] = combine(acc[k], Ar::load(x[k]));
        }
        for (size_t k = 0; k < m; ++k) o[b + k] = Ar::store(finish(acc[k]));
    }
}

template <class T, class Ar>
void reduce_as(const void* const* in, int n, void* out, size_t len, ncclRedOp_t op) {
    using A = typename Ar::Acc;
    const auto keep = [](A a) { return a; };
    switch (op) {
        case ncclSum: return fold<T, Ar>(in, n, out, len, [](A a, A b) { return Ar::add(a, b); }, keep);
        case ncclProd: return fold<T, Ar>(in, n, out, len, [](A a, A b) { return Ar::mul(a, b); }, keep);
        case ncclMax: return fold<T, Ar>(in, n, out, len, [](A a, A b) { return Ar::max(a, b); }, keep);
        case ncclMin: return fold<T, Ar>(in, n, out, len, [](A a, A b) { return Ar::min(a, b); }, keep);
        case ncclAvg:
            return fold<T, Ar>(in, n, out, len, [](A a, A b) { return Ar::add(a, b); }, [n](A a) { return Ar::div(a, n); });
        default: return;  // validated before any data moved
    }
}

void reduce(ncclDataType_t type, ncclRedOp_t op, const void* const* in, int n, void* out, size_t len) {
    switch (type) {
        case ncclInt8: return reduce_as<int8_t, IntArith<int8_t>>(in, n, out, len, op);
        case ncclUint8: return reduce_as<uint8_t, IntArith<uint8_t>>(in, n, out, len, op);
        case ncclInt32: return reduce_as<int32_t, IntArith<int32_t>>(in, n, out, len, op);
        case ncclUint32: return reduce_as<uint32_t, IntArith<uint32_t>>(in, n, out, len, op);
        case ncclInt64: return reduce_as<int64_t, IntArith<int64_t>>(in, n, out, len, op);
        case ncclUint64: return reduce_as<uint64_t, IntArith<uint64_t>>(in, n, out, len, op);
        case ncclFloat16: return reduce_as<__half, FloatArith<__half, float, half_load, half_store>>(in, n, out, len, op);
        case ncclFloat32: return reduce_as<float, FloatArith<float, float, same<float>, same<float>>>(in, n, out, len, op);
        case ncclFloat64:
            return reduce_as<double, FloatArith<double, double, same<double>, same<double>>>(in, n, out, len, op);
        case ncclBfloat16:
            return reduce_as<__nv_bfloat16, FloatArith<__nv_bfloat16, float, bf16_load, bf16_store>>(in, n, out, len, op);
        case ncclFloat8e4m3:
            return reduce_as<__nv_fp8_e4m3, FloatArith<__nv_fp8_e4m3, float, e4m3_load, e4m3_store>>(in, n, out, len, op);
        case ncclFloat8e5m2:
            return reduce_as<__nv_fp8_e5m2, FloatArith<__nv_fp8_e5m2, float, e5m2_load, e5m2_store>>(in, n, out, len, op);
        default: return;  // validated before any data moved
    }
}

// ---- message rounds ----

// A set of nonblocking messages completed together. A collective's buffer travels in pieces of
// at most the communicator's slice (both ends split it alike). A user's send or receive is one
// message up to 1 GiB, zero bytes included, so a send/recv pair that disagrees on the count is
// reported by the receiver rather than leaving unmatched pieces waiting forever.
class Round {
public:
    Round(ncclComm* comm, const char* fn) : comm_(comm), fn_(fn) {}
    void user_send(ncclComm* c, int peer, const void* p, size_t bytes, const char* fn) {
        post(c, c->p2p, peer, const_cast<void*>(p), bytes, kMaxSliceBytes, fn, false);
    }
    void user_recv(ncclComm* c, int peer, void* p, size_t bytes, const char* fn) {
        post(c, c->p2p, peer, p, bytes, kMaxSliceBytes, fn, true);
    }
    void send(int peer, const void* p, size_t bytes) {
        post(comm_, comm_->coll, peer, const_cast<void*>(p), bytes, comm_->slice_bytes, fn_, false);
    }
    void recv(int peer, void* p, size_t bytes) { post(comm_, comm_->coll, peer, p, bytes, comm_->slice_bytes, fn_, true); }

    ncclResult_t wait() {
        std::vector<MPI_Status> st(reqs_.size());
        const int rc = reqs_.empty() ? MPI_SUCCESS : MPI_Waitall(static_cast<int>(reqs_.size()), reqs_.data(), st.data());
        ncclResult_t result = error_;
        if (rc != MPI_SUCCESS && rc != MPI_ERR_IN_STATUS) return keep(result, mpi_fail(comm_, fn_, "MPI_Waitall", rc));
        for (size_t i = 0; i < st.size(); ++i) {
            if (rc != MPI_ERR_IN_STATUS) st[i].MPI_ERROR = MPI_SUCCESS;  // only set by MPI when some request failed
            // A failed request makes MPI_Waitall return with others still in flight; they are
            // waited for here, since a send still reads its buffer after this call returns.
            if (st[i].MPI_ERROR == MPI_ERR_PENDING) st[i].MPI_ERROR = MPI_Wait(&reqs_[i], &st[i]);
        }
        reqs_.clear();
        for (size_t i = 0; i < st.size(); ++i) {
            const Msg& m = msgs_[i];
            if (st[i].MPI_ERROR != MPI_SUCCESS) {
                int cls = 0;
                MPI_Error_class(st[i].MPI_ERROR, &cls);
                if (cls == MPI_ERR_TRUNCATE)
                    keep(result, fail(ncclInvalidUsage, m.fn, "rank %d sent more than the %zu bytes rank %d expected: "
                                      "the ranks disagree on the count", m.peer, m.bytes, m.comm->rank));
                else
                    keep(result, mpi_fail(m.comm, m.fn, m.is_recv ? "MPI_Irecv" : "MPI_Isend", st[i].MPI_ERROR));
                continue;
            }
            if (!m.is_recv) continue;
            int got = 0;
            MPI_Get_count(&st[i], MPI_BYTE, &got);
            if (static_cast<size_t>(got) != m.bytes)
                keep(result, fail(ncclInvalidUsage, m.fn, "rank %d received %d bytes from rank %d, expected %zu: "
                                  "the ranks disagree on the count", m.comm->rank, got, m.peer, m.bytes));
        }
        msgs_.clear();
        return result;
    }

private:
    struct Msg {
        ncclComm* comm;
        const char* fn;
        int peer;
        size_t bytes;
        bool is_recv;
    };
    static ncclResult_t keep(ncclResult_t& first, ncclResult_t r) {
        if (first == ncclSuccess) first = r;
        return first;
    }
    void post(ncclComm* c, MPI_Comm mc, int peer, void* p, size_t bytes, size_t piece, const char* fn, bool is_recv) {
        size_t off = 0;
        do {
            const size_t b = std::min(piece, bytes - off);
            MPI_Request req;
            char* at = static_cast<char*>(p) + off;
            const int rc = is_recv ? MPI_Irecv(at, static_cast<int>(b), MPI_BYTE, peer, 0, mc, &req)
                                   : MPI_Isend(at, static_cast<int>(b), MPI_BYTE, peer, 0, mc, &req);
            if (rc != MPI_SUCCESS) {
                keep(error_, mpi_fail(c, fn, is_recv ? "MPI_Irecv" : "MPI_Isend", rc));
                return;
            }
            reqs_.push_back(req);
            msgs_.push_back({c, fn, peer, b, is_recv});
            off += b;
        } while (off < bytes);
    }

    ncclComm* comm_;
    const char* fn_;
    std::vector<MPI_Request> reqs_;
    std::vector<Msg> msgs_;
    ncclResult_t error_ = ncclSuccess;
};

// ---- operations ----

enum class Kind { AllReduce, ReduceScatter, AllGather, Broadcast, Reduce, AlltoAll, Gather, Scatter, Send, Recv };

struct Op {
    Kind kind;
    const char* fn;
    const void* send;
    void* recv;
    size_t count;
    ncclDataType_t type;
    ncclRedOp_t op;
    int root;  // the peer, for Send and Recv
    ncclComm* comm;
    cudaStream_t stream;
};

bool is_p2p(Kind k) { return k == Kind::Send || k == Kind::Recv; }
bool has_root(Kind k) { return k == Kind::Broadcast || k == Kind::Reduce || k == Kind::Gather || k == Kind::Scatter; }
bool reduces(Kind k) { return k == Kind::AllReduce || k == Kind::ReduceScatter || k == Kind::Reduce; }

unsigned char* grow_scratch(ncclComm& c, size_t bytes) {
    if (c.scratch.size() < bytes) c.scratch.resize(bytes);
    return c.scratch.data();
}

// All-reduce and reduce, one slice at a time: every rank sends each owner its part of the slice,
// the owner reduces its part, then sends the result to every rank (all-reduce) or the root.
ncclResult_t run_reduce(const Op& o, bool to_all) {
    ncclComm& c = *o.comm;
    const int n = c.nranks, me = c.rank;
    const size_t es = type_size(o.type);
    const size_t slice = std::max<size_t>(static_cast<size_t>(n), c.slice_bytes / es);
    const auto* send = static_cast<const unsigned char*>(o.send);
    auto* recv = static_cast<unsigned char*>(o.recv);
    std::vector<const void*> in(n);
    for (size_t a = 0; a < o.count; a += slice) {
        const size_t len = std::min(slice, o.count - a);
        const auto lo = [&](int i) { return a + len * static_cast<size_t>(i) / static_cast<size_t>(n); };
        const size_t mine = lo(me), m = lo(me + 1) - mine;
        const bool owns_out = to_all || me == o.root;
        unsigned char* scratch = grow_scratch(c, (static_cast<size_t>(n) + (owns_out ? 0 : 1)) * m * es);
        Round gather(&c, o.fn);
        for (int i = 0; i < n; ++i) {
            if (i == me) {
                in[i] = send + mine * es;
                continue;
            }
            in[i] = scratch + static_cast<size_t>(i) * m * es;
            gather.recv(i, scratch + static_cast<size_t>(i) * m * es, m * es);
            gather.send(i, send + lo(i) * es, (lo(i + 1) - lo(i)) * es);
        }
        if (ncclResult_t r = gather.wait()) return r;
        unsigned char* out = owns_out ? recv + mine * es : scratch + static_cast<size_t>(n) * m * es;
        reduce(o.type, o.op, in.data(), n, out, m);
        Round share(&c, o.fn);
        for (int i = 0; i < n; ++i) {
            if (i == me) continue;
            if (to_all || i == o.root) share.send(i, out, m * es);
            if (to_all || me == o.root) share.recv(i, recv + lo(i) * es, (lo(i + 1) - lo(i)) * es);
        }
        if (ncclResult_t r = share.wait()) return r;
    }
    return ncclSuccess;
}

// Reduce-scatter, one slice of every rank's block at a time: each rank sends block i's slice to
// rank i, which reduces what it received.
ncclResult_t run_reduce_scatter(const Op& o) {
    ncclComm& c = *o.comm;
    const int n = c.nranks, me = c.rank;
    const size_t es = type_size(o.type), R = o.count;
    const size_t slice = std::max<size_t>(1, c.slice_bytes / (static_cast<size_t>(n) * es));
    const auto* send = static_cast<const unsigned char*>(o.send);
    auto* recv = static_cast<unsigned char*>(o.recv);
    std::vector<const void*> in(n);
    for (size_t a = 0; a < R; a += slice) {
        const size_t len = std::min(slice, R - a);
        unsigned char* scratch = grow_scratch(c, static_cast<size_t>(n) * len * es);
        Round round(&c, o.fn);
        for (int i = 0; i < n; ++i) {
            if (i == me) {
                in[i] = send + (static_cast<size_t>(me) * R + a) * es;
                continue;
            }
            in[i] = scratch + static_cast<size_t>(i) * len * es;
            round.recv(i, scratch + static_cast<size_t>(i) * len * es, len * es);
            round.send(i, send + (static_cast<size_t>(i) * R + a) * es, len * es);
        }
        if (ncclResult_t r = round.wait()) return r;
        reduce(o.type, o.op, in.data(), n, recv + a * es, len);
    }
    return ncclSuccess;
}

// The data-moving collectives: one round of messages, plus the rank's own block copied locally
// (skipped when in place). Copies wait for the round, so a send buffer is read before it could
// be overwritten.
ncclResult_t run_move(const Op& o) {
    ncclComm& c = *o.comm;
    const int n = c.nranks, me = c.rank, root = o.root;
    const size_t bytes = o.count * type_size(o.type);
    const auto* send = static_cast<const unsigned char*>(o.send);
    auto* recv = static_cast<unsigned char*>(o.recv);
    const unsigned char* copy_from = nullptr;
    unsigned char* copy_to = nullptr;
    Round round(&c, o.fn);
    const auto block = [&](auto* base, int i) { return base + static_cast<size_t>(i) * bytes; };
    switch (o.kind) {
        case Kind::AllGather:
            for (int i = 0; i < n; ++i)
                if (i != me) {
                    round.send(i, send, bytes);
                    round.recv(i, block(recv, i), bytes);
                }
            copy_from = send, copy_to = block(recv, me);
            break;
        case Kind::Broadcast:
            if (me == root) {
                for (int i = 0; i < n; ++i)
                    if (i != me) round.send(i, send, bytes);
                copy_from = send, copy_to = recv;
            } else {
                round.recv(root, recv, bytes);
            }
            break;
        case Kind::AlltoAll:
            for (int i = 0; i < n; ++i)
                if (i != me) {
                    round.send(i, block(send, i), bytes);
                    round.recv(i, block(recv, i), bytes);
                }
            copy_from = block(send, me), copy_to = block(recv, me);
            break;
        case Kind::Gather:
            if (me == root) {
                for (int i = 0; i < n; ++i)
                    if (i != me) round.recv(i, block(recv, i), bytes);
                copy_from = send, copy_to = block(recv, me);
            } else {
                round.send(root, send, bytes);
            }
            break;
        case Kind::Scatter:
            if (me == root) {
                for (int i = 0; i < n; ++i)
                    if (i != me) round.send(i, block(send, i), bytes);
                copy_from = block(send, me), copy_to = recv;
            } else {
                round.recv(root, recv, bytes);
            }
            break;
        default: break;
    }
    if (ncclResult_t r = round.wait()) return r;
    if (copy_from && copy_from != copy_to) std::memmove(copy_to, copy_from, bytes);
    return ncclSuccess;
}

ncclResult_t run_collective(const Op& o) {
    if (o.count == 0) return ncclSuccess;  // every rank passes the same count, so every rank skips it
    switch (o.kind) {
        case Kind::AllReduce: return run_reduce(o, true);
        case Kind::Reduce: return run_reduce(o, false);
        case Kind::ReduceScatter: return run_reduce_scatter(o);
        default: return run_move(o);
    }
}

// Runs a group: sends and receives are posted first, so they progress while the collectives
// run and no ordering of send/recv pairs across ranks can deadlock.
ncclResult_t run_group(const std::vector<Op>& ops) {
    Round p2p(nullptr, "ncclGroupEnd");
    for (const Op& o : ops) {
        const size_t bytes = o.count * type_size(o.type);
        if (o.kind == Kind::Send) p2p.user_send(o.comm, o.root, o.send, bytes, o.fn);
        if (o.kind == Kind::Recv) p2p.user_recv(o.comm, o.root, o.recv, bytes, o.fn);
    }
    ncclResult_t first = ncclSuccess;
    for (const Op& o : ops) {
        if (is_p2p(o.kind)) continue;
        // Later collectives still run after a failed one: the other ranks are waiting for them.
        const ncclResult_t r = run_collective(o);
        if (first == ncclSuccess) first = r;
    }
    const ncclResult_t r = p2p.wait();
    return first != ncclSuccess ? first : r;
}

struct Group {
    int depth = 0;
    std::vector<Op> ops;
    ncclResult_t error = ncclSuccess;  // the first failed call inside the group
};
thread_local Group t_group;  // NCCL's group state is per host thread, too

ncclResult_t check_comm(const ncclComm* comm, const char* fn) {
    if (!comm) return fail(ncclInvalidArgument, fn, "comm is NULL");
    if (!is_live(comm))
        return fail(ncclInvalidArgument, fn, "comm %p is not a live communicator (destroyed, or never initialized)",
                    static_cast<const void*>(comm));
    if (comm->finalized) return fail(ncclInvalidUsage, fn, "comm was finalized by ncclCommFinalize");
    if (mpi_finalized()) return fail(ncclInvalidUsage, fn, "MPI is already finalized");
    return ncclSuccess;
}

const char* root_word(Kind k) { return is_p2p(k) ? "peer" : "root"; }

// How many times `count` elements each buffer holds, and which buffers this rank uses.
struct Extents {
    size_t send_blocks = 1, recv_blocks = 1;
    bool needs_send = true, needs_recv = true;
};
Extents extents_of(const Op& o) {
    const int n = o.comm->nranks, me = o.comm->rank;
    Extents e;
    switch (o.kind) {
        case Kind::ReduceScatter: e.send_blocks = n; break;
        case Kind::AllGather: e.recv_blocks = n; break;
        case Kind::AlltoAll: e.send_blocks = e.recv_blocks = n; break;
        case Kind::Broadcast: e.needs_send = me == o.root; break;
        case Kind::Reduce: e.needs_recv = me == o.root; break;
        case Kind::Gather: e.recv_blocks = n, e.needs_recv = me == o.root; break;
        case Kind::Scatter: e.send_blocks = n, e.needs_send = me == o.root; break;
        case Kind::Send: e.needs_recv = false; break;
        case Kind::Recv: e.needs_send = false; break;
        default: break;
    }
    return e;
}

// NCCL reads and writes its buffers on the GPU: they must lie in one cudaMalloc allocation each.
ncclResult_t check_device(const Op& o, const char* name, const void* p, size_t bytes) {
    const void* base;
    size_t size;
    emu::Memory kind;
    if (!emu::find_allocation(p, &base, &size, &kind))
        return fail(ncclInvalidArgument, o.fn, "%s %p is not device memory (pageable host memory?): NCCL needs a cudaMalloc'ed buffer",
                    name, p);
    if (kind != emu::Memory::device)
        return fail(ncclInvalidArgument, o.fn, "%s %p is pinned host memory (cudaMallocHost): NCCL needs a cudaMalloc'ed buffer",
                    name, p);
    const size_t offset = static_cast<size_t>(static_cast<const char*>(p) - static_cast<const char*>(base));
    if (bytes > size - offset)
        return fail(ncclInvalidArgument, o.fn, "%s %p: its %zu bytes run %zu bytes past the end of its %zu-byte allocation",
                    name, p, bytes, bytes - (size - offset), size);
    return ncclSuccess;
}

// Send and receive buffers may overlap only in NCCL's in-place forms: the same pointer for the
// element-wise collectives; for all-gather and gather the send buffer is this rank's block of the
// receive buffer, for reduce-scatter and scatter the receive buffer is this rank's block of the send buffer.
ncclResult_t check_overlap(const Op& o, size_t send_bytes, size_t recv_bytes) {
    const auto* sp = static_cast<const char*>(o.send);
    const auto* rp = static_cast<const char*>(o.recv);
    if (!(sp < rp + recv_bytes && rp < sp + send_bytes)) return ncclSuccess;
    const size_t block = o.count * type_size(o.type), me = static_cast<size_t>(o.comm->rank);
    switch (o.kind) {
        case Kind::AllReduce: case Kind::Broadcast: case Kind::Reduce:
            if (sp == rp) return ncclSuccess;
            return fail(ncclInvalidArgument, o.fn, "sendbuff %p and recvbuff %p overlap without being equal (in place needs "
                        "sendbuff == recvbuff)", o.send, o.recv);
        case Kind::AllGather: case Kind::Gather:
            if (sp == rp + me * block) return ncclSuccess;
            return fail(ncclInvalidArgument, o.fn, "sendbuff %p overlaps recvbuff %p but is not this rank's block: in place "
                        "needs sendbuff == recvbuff + rank * sendcount * elemsize = %p (rank %zu)",
                        o.send, o.recv, static_cast<const void*>(rp + me * block), me);
        case Kind::ReduceScatter: case Kind::Scatter:
            if (rp == sp + me * block) return ncclSuccess;
            return fail(ncclInvalidArgument, o.fn, "recvbuff %p overlaps sendbuff %p but is not this rank's block: in place "
                        "needs recvbuff == sendbuff + rank * recvcount * elemsize = %p (rank %zu)",
                        o.recv, o.send, static_cast<const void*>(sp + me * block), me);
        default:
            return fail(ncclInvalidArgument, o.fn, "sendbuff %p and recvbuff %p overlap: NCCL's %s has no in-place form",
                        o.send, o.recv, o.fn);
    }
}

ncclResult_t validate(const Op& o) {
    if (ncclResult_t r = check_comm(o.comm, o.fn)) return r;
    const int n = o.comm->nranks;
    if (o.type < 0 || o.type >= ncclNumTypes)
        return fail(ncclInvalidArgument, o.fn, "datatype %d is not an ncclDataType_t", static_cast<int>(o.type));
    if (reduces(o.kind) && (o.op < 0 || o.op >= ncclNumOps))
        return fail(ncclInvalidArgument, o.fn, "reduction op %d is not a built-in ncclRedOp_t", static_cast<int>(o.op));
    if ((has_root(o.kind) || is_p2p(o.kind)) && (o.root < 0 || o.root >= n))
        return fail(ncclInvalidArgument, o.fn, "%s %d is outside the communicator's ranks [0, %d)", root_word(o.kind), o.root, n);
    const Extents e = extents_of(o);
    const size_t es = type_size(o.type), blocks = std::max(e.send_blocks, e.recv_blocks);
    if (o.count > static_cast<size_t>(PTRDIFF_MAX) / (blocks * es))
        return fail(ncclInvalidArgument, o.fn, "count %zu overflows the address space (%zu block(s) of %zu-byte elements)",
                    o.count, blocks, es);
    if (o.count == 0) return ncclSuccess;
    if (e.needs_send && !o.send) return fail(ncclInvalidArgument, o.fn, "sendbuff is NULL");
    if (e.needs_recv && !o.recv) return fail(ncclInvalidArgument, o.fn, "recvbuff is NULL");
    const size_t send_bytes = e.send_blocks * o.count * es, recv_bytes = e.recv_blocks * o.count * es;
    if (e.needs_send)
        if (ncclResult_t r = check_device(o, "sendbuff", o.send, send_bytes)) return r;
    if (e.needs_recv)
        if (ncclResult_t r = check_device(o, "recvbuff", o.recv, recv_bytes)) return r;
    if (e.needs_send && e.needs_recv) return check_overlap(o, send_bytes, recv_bytes);
    return ncclSuccess;
}

// What an operation reads and writes on this rank, for the race detector.
void declare_accesses(const Op& o, std::vector<emu::Access>& out) {
    const Extents e = extents_of(o);
    const size_t es = type_size(o.type);
    if (e.needs_send) out.push_back({o.send, e.send_blocks * o.count * es, false});
    if (e.needs_recv) out.push_back({o.recv, e.recv_blocks * o.count * es, true});
}

std::string describe(const Op& o) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s(sendbuff %p, recvbuff %p, count %zu)", o.fn, o.send, static_cast<void*>(o.recv), o.count);
    return buf;
}

// Issues a group (or one operation) as work on its stream, run at once after the work it
// depends on. Running NCCL calls at issue keeps every rank's collectives in issue order, as
// NCCL requires, whatever order each rank's deferred streams pick; and no rank's host can block
// in MPI on a collective its peer left queued. Operations on several streams make those streams
// wait for each other around the group, as NCCL's group launch does.
ncclResult_t issue_group(const std::vector<Op>& ops) {
    if (ops.empty()) return ncclSuccess;
    const cudaStream_t first = ops.front().stream;
    std::vector<cudaStream_t> others;
    for (const Op& o : ops)
        if (o.stream != first && std::find(others.begin(), others.end(), o.stream) == others.end()) others.push_back(o.stream);
    cudaEvent_t joined = nullptr;
    if (!others.empty()) cudaEventCreateWithFlags(&joined, cudaEventDisableTiming);
    for (cudaStream_t t : others) {
        cudaEventRecord(joined, t);
        cudaStreamWaitEvent(first, joined, 0);
    }
    ncclResult_t result = ncclSuccess;
    emu::StreamWork w;
    std::string what;
    for (const Op& o : ops) {
        declare_accesses(o, w.accesses);
        what += (what.empty() ? "" : " + ") + describe(o);
    }
    w.what = [what] { return what; };
    w.run = [&ops, &result] { result = run_group(ops); };
    emu::submit(first, std::move(w), emu::RunAt::now);
    if (joined) {
        cudaEventRecord(joined, first);
        for (cudaStream_t t : others) cudaStreamWaitEvent(t, joined, 0);
        cudaEventDestroy(joined);
    }
    return result;
}

ncclResult_t submit(const Op& o) {
    if (ncclResult_t r = validate(o)) {
        if (t_group.depth > 0 && t_group.error == ncclSuccess) t_group.error = r;
        return r;
    }
    if (t_group.depth > 0) {
        t_group.ops.push_back(o);
        return ncclSuccess;
    }
    return issue_group({o});
}

// ---- communicators ----

uint64_t id_hash(const ncclUniqueId& id) {  // FNV-1a over the whole id
    uint64_t h = 1469598103934665603ull;
    for (char ch : id.internal) h = (h ^ static_cast<unsigned char>(ch)) * 1099511628211ull;
    return h ? h : 1;  // 0 means "no communicator" in ncclCommInitRank's exchange
}

ncclResult_t slice_from_env(const char* fn, size_t* out) {
    const char* v = std::getenv("EMU_NCCL_SLICE_BYTES");
    *out = kDefaultSliceBytes;
    if (!v || !*v) return ncclSuccess;
    char* end = nullptr;
    errno = 0;
    const unsigned long long x = std::strtoull(v, &end, 10);
    if (*end != '\0' || errno || x < 1 || x > kMaxSliceBytes || v[0] == '-')
        return fail(ncclInvalidArgument, fn, "EMU_NCCL_SLICE_BYTES=%s is not a byte count in [1, %zu]", v, kMaxSliceBytes);
    *out = static_cast<size_t>(x);
    return ncclSuccess;
}

ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, const ncclConfig_t* config,
                       const char* fn) {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (!initialized)
        return fail(ncclInvalidUsage, fn, "MPI is not initialized: call MPI_Init first (the CPU build runs NCCL over MPI)");
    if (mpi_finalized()) return fail(ncclInvalidUsage, fn, "MPI is already finalized");
    if (out) *out = nullptr;

    // A rank with a bad argument still takes part in the world-wide split, without a color, so
    // the others find their communicator short and fail rather than wait for it forever.
    ncclResult_t local = ncclSuccess;
    size_t slice = kDefaultSliceBytes;
    if (!out) local = fail(ncclInvalidArgument, fn, "comm (the output pointer) is NULL");
    else if (nranks < 1) local = fail(ncclInvalidArgument, fn, "nranks %d is not positive", nranks);
    else if (rank < 0 || rank >= nranks) local = fail(ncclInvalidArgument, fn, "rank %d is outside [0, %d)", rank, nranks);
    else if (std::memcmp(id.internal, kIdMagic, sizeof kIdMagic) != 0)
        local = fail(ncclInvalidArgument, fn, "the unique id was not made by ncclGetUniqueId (was it broadcast to every rank?)");
    else if (config && (config->magic != kConfigMagic || config->size != sizeof(ncclConfig_t)))
        local = fail(ncclInvalidArgument, fn, "config was not initialized with NCCL_CONFIG_INITIALIZER");
    else local = slice_from_env(fn, &slice);

    // Color = the lowest world rank holding the same id: exact, where a hash folded into an
    // int color could merge two communicators.
    int world = 0, color = MPI_UNDEFINED;
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    const uint64_t key = local == ncclSuccess ? id_hash(id) : 0;
    std::vector<uint64_t> keys(world);
    int rc = MPI_Allgather(&key, 1, MPI_UINT64_T, keys.data(), 1, MPI_UINT64_T, MPI_COMM_WORLD);
    if (rc != MPI_SUCCESS) return mpi_fail(nullptr, fn, "MPI_Allgather", rc);
    if (key) color = static_cast<int>(std::find(keys.begin(), keys.end(), key) - keys.begin());
    MPI_Comm c = MPI_COMM_NULL;
    rc = MPI_Comm_split(MPI_COMM_WORLD, color, key ? rank : 0, &c);
    if (rc != MPI_SUCCESS) return mpi_fail(nullptr, fn, "MPI_Comm_split", rc);
    if (local != ncclSuccess) return local;

    // Every member sees the same table, so all of them reach the same verdict.
    int size = 0;
    MPI_Comm_size(c, &size);
    const int mine[2] = {nranks, rank};
    std::vector<int> table(2 * static_cast<size_t>(size));
    rc = MPI_Allgather(mine, 2, MPI_INT, table.data(), 2, MPI_INT, c);
    if (rc != MPI_SUCCESS) {
        MPI_Comm_free(&c);
        return mpi_fail(nullptr, fn, "MPI_Allgather", rc);
    }
    for (int i = 0; i < size; ++i) {  // sorted by rank: the split's key
        const int their_nranks = table[2 * i], their_rank = table[2 * i + 1];
        if (their_nranks != size || their_rank != i) {
            MPI_Comm_free(&c);
            if (their_nranks != size)
                return fail(ncclInvalidUsage, fn, "%d rank(s) joined with this unique id, but one of them passed nranks %d",
                            size, their_nranks);
            return fail(ncclInvalidUsage, fn, "rank %d was passed by more than one process (ranks must be distinct)",
                        their_rank);
        }
    }
    MPI_Comm_set_errhandler(c, MPI_ERRORS_RETURN);
    auto* comm = new ncclComm;
    comm->coll = c;
    comm->rank = rank;
    comm->nranks = nranks;
    rc = MPI_Comm_dup(c, &comm->p2p);
    if (rc == MPI_SUCCESS) {
        // Slices must match on every rank, or the messages would not pair up.
        unsigned long long s = slice;
        rc = MPI_Allreduce(MPI_IN_PLACE, &s, 1, MPI_UNSIGNED_LONG_LONG, MPI_MIN, c);
        comm->slice_bytes = static_cast<size_t>(s);
    }
    if (rc != MPI_SUCCESS) {
        if (comm->p2p != MPI_COMM_NULL) MPI_Comm_free(&comm->p2p);
        MPI_Comm_free(&comm->coll);
        delete comm;
        return mpi_fail(nullptr, fn, "setting up the communicator", rc);
    }
    {
        std::lock_guard<std::mutex> lock(g_live_mutex);
        g_live.insert(comm);
    }
    *out = comm;
    return ncclSuccess;
}

ncclResult_t free_comm(ncclComm_t comm, const char* fn, bool abort) {
    if (!comm) return fail(ncclInvalidArgument, fn, "comm is NULL");
    if (!is_live(comm))
        return fail(ncclInvalidArgument, fn, "comm %p is not a live communicator (destroyed, or never initialized)",
                    static_cast<void*>(comm));
    auto& ops = t_group.ops;
    const auto uses = [comm](const Op& o) { return o.comm == comm; };
    if (abort) {
        ops.erase(std::remove_if(ops.begin(), ops.end(), uses), ops.end());
    } else if (std::any_of(ops.begin(), ops.end(), uses)) {
        return fail(ncclInvalidUsage, fn, "operations on this comm are still queued in an open group (call ncclGroupEnd first)");
    }
    {
        std::lock_guard<std::mutex> lock(g_live_mutex);
        g_live.erase(comm);
    }
    // After MPI_Finalize the MPI communicators are gone already; only local memory remains.
    if (!mpi_finalized()) {
        MPI_Comm_free(&comm->p2p);
        MPI_Comm_free(&comm->coll);
    }
    delete comm;
    return ncclSuccess;
}

}  // namespace

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
    if (!version) return fail(ncclInvalidArgument, "ncclGetVersion", "version is NULL");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return fail(ncclInvalidArgument, "ncclGetUniqueId", "uniqueId is NULL");
    // Distinct across processes and calls: random bits, the process id, the time and a counter.
    static std::atomic<uint64_t> counter{0};
    std::random_device rd;
    const uint64_t parts[5] = {
        (uint64_t(rd()) << 32) | rd(), (uint64_t(rd()) << 32) | rd(), static_cast<uint64_t>(getpid()),
        static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()), counter.fetch_add(1)};
    std::memset(id->internal, 0, sizeof id->internal);
    std::memcpy(id->internal, kIdMagic, sizeof kIdMagic);
    std::memcpy(id->internal + sizeof kIdMagic, parts, sizeof parts);
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
    return init_rank(comm, nranks, commId, rank, nullptr, "ncclCommInitRank");
}

// Every emu communicator is blocking: its calls complete before they return, which a
// non-blocking communicator (config->blocking = 0) may also do, so the config changes nothing.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank, ncclConfig_t* config) {
    return init_rank(comm, nranks, commId, rank, config, "ncclCommInitRankConfig");
}

// Nothing is ever in flight after a call returns, so finalizing only forbids further use.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    if (ncclResult_t r = check_comm(comm, "ncclCommFinalize")) return r;
    comm->finalized = true;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return free_comm(comm, "ncclCommDestroy", false); }
ncclResult_t ncclCommAbort(ncclComm_t comm) { return free_comm(comm, "ncclCommAbort", true); }

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
    if (!comm || !is_live(comm)) return check_comm(comm, "ncclCommGetAsyncError");
    if (!asyncError) return fail(ncclInvalidArgument, "ncclCommGetAsyncError", "asyncError is NULL");
    *asyncError = comm->async_error;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
    if (!comm || !is_live(comm)) return check_comm(comm, "ncclCommCount");
    if (!count) return fail(ncclInvalidArgument, "ncclCommCount", "count is NULL");
    *count = comm->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
    if (!comm || !is_live(comm)) return check_comm(comm, "ncclCommUserRank");
    if (!rank) return fail(ncclInvalidArgument, "ncclCommUserRank", "rank is NULL");
    *rank = comm->rank;
    return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
    if (!comm || !is_live(comm)) return check_comm(comm, "ncclCommCuDevice");
    if (!device) return fail(ncclInvalidArgument, "ncclCommCuDevice", "device is NULL");
    if (cudaGetDevice(device) != cudaSuccess) return fail(ncclUnhandledCudaError, "ncclCommCuDevice", "cudaGetDevice failed");
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error";
        case ncclSystemError: return "unhandled system error (an MPI call failed; emu printed which)";
        case ncclInternalError: return "internal error";
        case ncclInvalidArgument: return "invalid argument (emu printed which)";
        case ncclInvalidUsage: return "invalid usage (emu printed what)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
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

ncclResult_t ncclBcast(void* buff, size_t count, ncclDataType_t datatype, int root, ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Broadcast, "ncclBcast", buff, buff, count, datatype, ncclSum, root, comm, stream});
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Reduce, "ncclReduce", sendbuff, recvbuff, count, datatype, op, root, comm, stream});
}

ncclResult_t ncclAlltoAll(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclComm_t comm,
                          cudaStream_t stream) {
    return submit({Kind::AlltoAll, "ncclAlltoAll", sendbuff, recvbuff, count, datatype, ncclSum, 0, comm, stream});
}

ncclResult_t ncclGather(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                        ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Gather, "ncclGather", sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream});
}

ncclResult_t ncclScatter(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                         ncclComm_t comm, cudaStream_t stream) {
    return submit({Kind::Scatter, "ncclScatter", sendbuff, recvbuff, count, datatype, ncclSum, root, comm, stream});
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

// A call that failed inside the group was not queued; the group's other operations still run
// (the other ranks wait for them), and ncclGroupEnd reports the first failure.
ncclResult_t ncclGroupEnd() {
    if (t_group.depth == 0) return fail(ncclInvalidUsage, "ncclGroupEnd", "no ncclGroupStart is open");
    if (--t_group.depth > 0) return ncclSuccess;
    const std::vector<Op> ops = std::move(t_group.ops);
    const ncclResult_t error = t_group.error;
    t_group.ops.clear();
    t_group.error = ncclSuccess;
    const ncclResult_t r = issue_group(ops);
    return error != ncclSuccess ? error : r;
}

}  // extern "C"

namespace emu {
int nccl_group_depth() { return t_group.depth; }
}  // namespace emu
