// NCCL over MPI in the CPU build: every NCCL call emu provides, run on all ranks. Collectives
// on fp32, bf16 and int32 with ragged counts, in and out of place, alone and grouped, on a
// communicator with default slices and on one with tiny slices (every transfer split into
// pieces, every reduction done slice by slice); a pass over every data type; send/recv patterns;
// communicator set-up; and each misuse's error code. Inputs come from a seed every rank knows,
// so each rank computes every expected result locally, in double precision.
#include "kernels/common.cuh"
#include "tests/device_util.h"

#include <mpi.h>
#include <nccl.h>

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

namespace {

int g_rank = 0, g_n = 1;
uint64_t g_seed = 0;
uint64_t g_case = 0;  // advanced identically on every rank, so each test has its own inputs
cudaStream_t g_stream = nullptr;

uint64_t mix(uint64_t x) {  // splitmix64's finalizer
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}
// The same random bits on every rank for (case, source, index): any rank can compute any
// other rank's input.
uint64_t bits(uint64_t c, uint64_t src, uint64_t i) { return mix(mix(mix(g_seed ^ c) ^ src) ^ i); }

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char buf[512];
    std::va_list ap;
    va_start(ap, f);
    std::vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

bool expect(ncclResult_t got, ncclResult_t want, const std::string& what) {
    return test::check(got == want, "%s (rank %d): returned %d (%s), want %d (%s)", what.c_str(), g_rank, got,
                       ncclGetErrorString(got), want, ncclGetErrorString(want));
}
bool ok(ncclResult_t got, const std::string& what) { return expect(got, ncclSuccess, what); }

uint64_t fnv(const void* p, size_t bytes) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(p)[i]) * 1099511628211ull;
    return h;
}
// Collective over the world: every rank must reach it with a result of the same size.
void check_same_on_all_ranks(const std::string& what, const void* p, size_t bytes) {
    const uint64_t h = fnv(p, bytes);
    uint64_t lo = 0, hi = 0;
    MPI_Allreduce(&h, &lo, 1, MPI_UINT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&h, &hi, 1, MPI_UINT64_T, MPI_MAX, MPI_COMM_WORLD);
    test::check(lo == hi, "%s: the ranks' results differ (rank %d)", what.c_str(), g_rank);
}

ncclUniqueId shared_id(int maker) {  // made by one rank, broadcast to all, as the trainer does
    ncclUniqueId id;
    std::memset(&id, 0, sizeof id);
    if (g_rank == maker) ok(ncclGetUniqueId(&id), "ncclGetUniqueId");
    MPI_Bcast(&id, sizeof id, MPI_BYTE, maker, MPI_COMM_WORLD);
    return id;
}

// ---- the three data types of the main suite ----
template <class T>
struct Type;
template <>
struct Type<float> {
    static constexpr ncclDataType_t id = ncclFloat32;
    static constexpr const char* name = "fp32";
    static float make(uint64_t b) { return static_cast<float>(static_cast<double>(b >> 40) * 0x1p-23 - 1.0); }  // [-1, 1)
    static double value(float x) { return x; }
};
template <>
struct Type<__nv_bfloat16> {
    static constexpr ncclDataType_t id = ncclBfloat16;
    static constexpr const char* name = "bf16";
    // ±(1 + k/128)·2^e, e in [-4, 1]: exact in bf16, and a sum of up to 2^11 of them is exact in
    // fp32, so a correct result is the bf16 rounding of the exact sum, bit for bit.
    static __nv_bfloat16 make(uint64_t b) {
        const double v = std::ldexp(1.0 + static_cast<double>(b & 127) / 128.0, static_cast<int>((b >> 7) % 6) - 4);
        return __float2bfloat16(static_cast<float>((b >> 20) & 1 ? -v : v));
    }
    static double value(__nv_bfloat16 x) { return __bfloat162float(x); }
};
template <>
struct Type<int32_t> {
    static constexpr ncclDataType_t id = ncclInt32;
    static constexpr const char* name = "int32";
    static int32_t make(uint64_t b) { return static_cast<int32_t>(b % (2u << 20)) - (1 << 20); }  // [-2^20, 2^20)
    static double value(int32_t x) { return x; }
};

constexpr int kCopy = -1;  // "op" of results that are copies of inputs
const char* op_name(int op) {
    switch (op) {
        case ncclSum: return "sum";
        case ncclProd: return "prod";
        case ncclMax: return "max";
        case ncclMin: return "min";
        case ncclAvg: return "avg";
        default: return "copy";
    }
}

// The exact result of `op` over the ranks' inputs input(0..n-1); integers as the GPU computes
// them (products wrap around, averages truncate).
template <class T>
double exact(int op, const std::function<T(int)>& input) {
    if constexpr (std::is_integral_v<T>) {
        int64_t sum = 0, mx = input(0), mn = input(0);
        uint32_t prod = 1;
        for (int r = 0; r < g_n; ++r) {
            const int64_t x = input(r);
            sum += x, mx = std::max(mx, x), mn = std::min(mn, x);
            prod *= static_cast<uint32_t>(x);
        }
        switch (op) {
            case ncclSum: return static_cast<double>(sum);
            case ncclAvg: return static_cast<double>(sum / g_n);
            case ncclProd: return static_cast<int32_t>(prod);
            case ncclMax: return static_cast<double>(mx);
            default: return static_cast<double>(mn);
        }
    } else {
        double sum = 0, prod = 1, mx = Type<T>::value(input(0)), mn = mx;
        for (int r = 0; r < g_n; ++r) {
            const double x = Type<T>::value(input(r));
            sum += x, prod *= x, mx = std::max(mx, x), mn = std::min(mn, x);
        }
        switch (op) {
            case ncclSum: return sum;
            case ncclAvg: return sum / g_n;
            case ncclProd: return prod;
            case ncclMax: return mx;
            default: return mn;
        }
    }
}

// got against the exact results: integers, copies, max and min exactly; fp32 sums within the
// rounding of an fp32 sum over the ranks (inputs in [-1, 1)); bf16 as the one bf16 rounding of
// the exact value (exact in fp32 for these inputs; an average over a rank count that is not a
// power of two rounds twice, so within one bf16 ulp there).
template <class T>
void check_values(const std::string& what, const T* got, const std::vector<double>& want, int op) {
    const size_t n = want.size();
    std::vector<double> g(n), w = want;
    for (size_t i = 0; i < n; ++i) g[i] = Type<T>::value(got[i]);
    double atol = 0, rtol = 0;
    const bool pow2 = (g_n & (g_n - 1)) == 0;
    if constexpr (std::is_same_v<T, float>) {
        if (op == ncclSum || op == ncclAvg) atol = g_n * g_n * 0x1p-24;
        if (op == ncclProd) rtol = g_n * 0x1p-23;
    } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (op == ncclAvg && !pow2) rtol = 0x1p-7;
        else
            for (auto& x : w) x = __bfloat162float(__float2bfloat16(static_cast<float>(x)));
    }
    test::check_close(what, g.data(), w.data(), n, atol, rtol);
}

// NCCL's buffers are device memory: vectors whose storage is cudaMalloc'ed (host code reads and
// writes them directly, as emu's device memory is host memory).
template <class T>
struct DeviceAllocator {
    using value_type = T;
    DeviceAllocator() = default;
    template <class U>
    DeviceAllocator(const DeviceAllocator<U>&) {}
    T* allocate(size_t n) {
        void* p = nullptr;
        CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
        return static_cast<T*>(p);
    }
    void deallocate(T* p, size_t) { cudaFree(p); }
    bool operator==(const DeviceAllocator&) const { return true; }
};
template <class T>
using dvec = std::vector<T, DeviceAllocator<T>>;

// ---- the main suite: every collective on one data type and count ----
template <class T>
dvec<T> inputs(uint64_t c, uint64_t src, size_t count) {
    dvec<T> v(count);
    for (size_t i = 0; i < count; ++i) v[i] = Type<T>::make(bits(c, src, i));
    return v;
}

template <class T>
void test_all_reduce(ncclComm_t comm, const char* label, size_t count, ncclRedOp_t op, bool in_place) {
    const uint64_t c = ++g_case;
    const std::string what = fmt("%s all-reduce %s %s count %zu%s", label, Type<T>::name, op_name(op), count,
                                 in_place ? " in place" : "");
    dvec<T> send = inputs<T>(c, g_rank, count), recv(count);
    std::vector<double> want(count);
    for (size_t i = 0; i < count; ++i) want[i] = exact<T>(op, [&](int r) { return Type<T>::make(bits(c, r, i)); });
    T* out = in_place ? send.data() : recv.data();
    ok(ncclAllReduce(send.data(), out, count, Type<T>::id, op, comm, g_stream), what);
    check_values(what + fmt(" rank %d", g_rank), out, want, op);
    check_same_on_all_ranks(what, out, count * sizeof(T));
}

template <class T>
void test_reduce_scatter(ncclComm_t comm, const char* label, size_t count, ncclRedOp_t op, bool in_place) {
    const uint64_t c = ++g_case;
    const std::string what = fmt("%s reduce-scatter %s %s count %zu%s rank %d", label, Type<T>::name, op_name(op), count,
                                 in_place ? " in place" : "", g_rank);
    dvec<T> send = inputs<T>(c, g_rank, count * g_n), recv(count);
    std::vector<double> want(count);
    for (size_t i = 0; i < count; ++i)
        want[i] = exact<T>(op, [&](int r) { return Type<T>::make(bits(c, r, g_rank * count + i)); });
    T* out = in_place ? send.data() + g_rank * count : recv.data();
    ok(ncclReduceScatter(send.data(), out, count, Type<T>::id, op, comm, g_stream), what);
    check_values(what, out, want, op);
}

template <class T>
void test_all_gather(ncclComm_t comm, const char* label, size_t count, bool in_place) {
    const uint64_t c = ++g_case;
    const std::string what = fmt("%s all-gather %s count %zu%s", label, Type<T>::name, count, in_place ? " in place" : "");
    dvec<T> send = inputs<T>(c, g_rank, count);
    dvec<T> recv = inputs<T>(c, 1000 + g_rank, count * g_n);  // garbage the gather must overwrite
    std::vector<double> want(count * g_n);
    for (int r = 0; r < g_n; ++r)
        for (size_t i = 0; i < count; ++i) want[r * count + i] = Type<T>::value(Type<T>::make(bits(c, r, i)));
    const T* from = send.data();
    if (in_place) {
        std::copy(send.begin(), send.end(), recv.begin() + g_rank * count);
        from = recv.data() + g_rank * count;
    }
    ok(ncclAllGather(from, recv.data(), count, Type<T>::id, comm, g_stream), what);
    check_values(what + fmt(" rank %d", g_rank), recv.data(), want, kCopy);
    check_same_on_all_ranks(what, recv.data(), recv.size() * sizeof(T));
}

template <class T>
void test_broadcast(ncclComm_t comm, const char* label, size_t count, bool in_place) {
    const uint64_t c = ++g_case;
    const int root = g_n - 1;
    const std::string what = fmt("%s broadcast %s count %zu root %d%s", label, Type<T>::name, count, root,
                                 in_place ? " in place" : "");
    dvec<T> send = inputs<T>(c, g_rank, count), recv = inputs<T>(c, 1000 + g_rank, count);
    std::vector<double> want(count);
    for (size_t i = 0; i < count; ++i) want[i] = Type<T>::value(Type<T>::make(bits(c, root, i)));
    T* out = in_place ? send.data() : recv.data();
    ok(ncclBroadcast(send.data(), out, count, Type<T>::id, root, comm, g_stream), what);
    check_values(what + fmt(" rank %d", g_rank), out, want, kCopy);
    check_same_on_all_ranks(what, out, count * sizeof(T));
}

template <class T>
void test_reduce(ncclComm_t comm, const char* label, size_t count, ncclRedOp_t op, bool in_place) {
    const uint64_t c = ++g_case;
    const int root = g_n / 2;
    const std::string what = fmt("%s reduce %s %s count %zu root %d%s rank %d", label, Type<T>::name, op_name(op), count,
                                 root, in_place ? " in place" : "", g_rank);
    dvec<T> send = inputs<T>(c, g_rank, count), recv(count);
    std::vector<double> want(count);
    for (size_t i = 0; i < count; ++i) want[i] = exact<T>(op, [&](int r) { return Type<T>::make(bits(c, r, i)); });
    T* out = in_place ? send.data() : recv.data();
    ok(ncclReduce(send.data(), out, count, Type<T>::id, op, root, comm, g_stream), what);
    if (g_rank == root) check_values(what, out, want, op);
}

template <class T>
void suite_for_type(ncclComm_t comm, const char* label) {
    for (size_t count : {size_t(1), size_t(7), size_t(1000), size_t(12345)}) {
        for (ncclRedOp_t op : {ncclSum, ncclAvg})
            for (bool in_place : {false, true}) {
                test_all_reduce<T>(comm, label, count, op, in_place);
                test_reduce_scatter<T>(comm, label, count, op, in_place);
            }
        for (bool in_place : {false, true}) {
            test_all_gather<T>(comm, label, count, in_place);
            test_broadcast<T>(comm, label, count, in_place);
            test_reduce<T>(comm, label, count, in_place ? ncclAvg : ncclSum, in_place);
        }
    }
    for (ncclRedOp_t op : {ncclMax, ncclMin}) {
        test_all_reduce<T>(comm, label, 1000, op, false);
        test_reduce_scatter<T>(comm, label, 1000, op, true);
    }
    if constexpr (!std::is_same_v<T, __nv_bfloat16>) {  // a bf16 product of bf16 inputs is not exact in fp32
        test_all_reduce<T>(comm, label, 1000, ncclProd, false);
        test_reduce<T>(comm, label, 1000, ncclProd, true);
    }
}

// ---- send/recv and groups ----

// Every rank sends every rank (itself included) a different number of elements, zero
// included, inside one group; each rank issues its calls in its own order.
template <class T>
void test_send_recv_all_to_all(ncclComm_t comm, const char* label, size_t scale) {
    const uint64_t c = ++g_case;
    const auto count = [&](int from, int to) -> size_t {
        return (bits(c, 7777, from * g_n + to) % 9) * scale + static_cast<size_t>(from + to) % 3;
    };
    const auto src = [](int from, int to) { return static_cast<uint64_t>(from * g_n + to); };
    std::vector<dvec<T>> out(g_n), in(g_n);
    for (int p = 0; p < g_n; ++p) {
        out[p] = inputs<T>(c, src(g_rank, p), count(g_rank, p));
        in[p] = inputs<T>(c, 1000000 + p, count(p, g_rank));  // garbage to be overwritten
    }
    const std::string what = fmt("%s send/recv all-to-all %s scale %zu", label, Type<T>::name, scale);
    ok(ncclGroupStart(), what + " ncclGroupStart");
    for (int k = 0; k < g_n; ++k) {
        const int to = (g_rank + g_n - k) % g_n, from = (g_rank + k) % g_n;
        ok(ncclRecv(in[from].data(), in[from].size(), Type<T>::id, from, comm, g_stream), what + " ncclRecv");
        ok(ncclSend(out[to].data(), out[to].size(), Type<T>::id, to, comm, g_stream), what + " ncclSend");
    }
    ok(ncclGroupEnd(), what + " ncclGroupEnd");
    for (int p = 0; p < g_n; ++p) {
        std::vector<double> want(count(p, g_rank));
        for (size_t i = 0; i < want.size(); ++i) want[i] = Type<T>::value(Type<T>::make(bits(c, src(p, g_rank), i)));
        check_values(what + fmt(" from %d to %d", p, g_rank), in[p].data(), want, kCopy);
    }
}

// Blocking send/recv outside a group, around a ring: even ranks send first, odd ranks receive
// first, so each send meets a posted receive.
void test_ring_ungrouped(ncclComm_t comm, const char* label) {
    if (g_n < 2) return;  // a lone rank would send to itself without a group
    const uint64_t c = ++g_case;
    const int next = (g_rank + 1) % g_n, prev = (g_rank + g_n - 1) % g_n;
    dvec<float> out = inputs<float>(c, g_rank, 3000), in(3000, -7.0f);
    const std::string what = fmt("%s ungrouped ring send/recv", label);
    if (g_rank % 2 == 0) ok(ncclSend(out.data(), out.size(), ncclFloat32, next, comm, g_stream), what + " ncclSend");
    ok(ncclRecv(in.data(), in.size(), ncclFloat32, prev, comm, g_stream), what + " ncclRecv");
    if (g_rank % 2 == 1) ok(ncclSend(out.data(), out.size(), ncclFloat32, next, comm, g_stream), what + " ncclSend");
    std::vector<double> want(in.size());
    for (size_t i = 0; i < want.size(); ++i) want[i] = Type<float>::make(bits(c, prev, i));
    check_values(what + fmt(" rank %d", g_rank), in.data(), want, kCopy);
}

// A collective and a ring exchange in one group, issued in a different order on odd ranks.
void test_mixed_group(ncclComm_t comm, const char* label) {
    const uint64_t c = ++g_case;
    const int next = (g_rank + 1) % g_n, prev = (g_rank + g_n - 1) % g_n;
    dvec<int32_t> out = inputs<int32_t>(c, 100 + g_rank, 500), in(500, -1);
    dvec<int32_t> a = inputs<int32_t>(c, g_rank, 777), sum(777);
    const std::string what = fmt("%s mixed group", label);
    const auto collective = [&] {
        ok(ncclAllReduce(a.data(), sum.data(), a.size(), ncclInt32, ncclSum, comm, g_stream), what + " ncclAllReduce");
    };
    ok(ncclGroupStart(), what + " ncclGroupStart");
    if (g_rank % 2) collective();
    ok(ncclSend(out.data(), out.size(), ncclInt32, next, comm, g_stream), what + " ncclSend");
    ok(ncclRecv(in.data(), in.size(), ncclInt32, prev, comm, g_stream), what + " ncclRecv");
    if (g_rank % 2 == 0) collective();
    ok(ncclGroupEnd(), what + " ncclGroupEnd");
    std::vector<double> want_in(in.size()), want_sum(sum.size());
    for (size_t i = 0; i < in.size(); ++i) want_in[i] = Type<int32_t>::make(bits(c, 100 + prev, i));
    for (size_t i = 0; i < sum.size(); ++i)
        want_sum[i] = exact<int32_t>(ncclSum, [&](int r) { return Type<int32_t>::make(bits(c, r, i)); });
    check_values(what + fmt(" ring rank %d", g_rank), in.data(), want_in, kCopy);
    check_values(what + fmt(" all-reduce rank %d", g_rank), sum.data(), want_sum, ncclSum);
}

// Several all-reduces and a broadcast in nested groups, on device buffers: nothing runs before
// the outermost ncclGroupEnd, then everything has.
void test_grouped_collectives(ncclComm_t comm, const char* label) {
    const uint64_t c = ++g_case;
    const std::string what = fmt("%s grouped collectives", label);
    const size_t na = 1000, nb = 7, nc = 12345, nd = 1, ne = 100;
    const int root = g_n - 1;
    dvec<float> a = inputs<float>(c, g_rank, na), d = inputs<float>(c + 1, g_rank, nd);
    dvec<__nv_bfloat16> b = inputs<__nv_bfloat16>(c, g_rank, nb);
    dvec<int32_t> cc = inputs<int32_t>(c, g_rank, nc), e = inputs<int32_t>(c + 2, g_rank, ne);
    ++g_case, ++g_case;
    test::DeviceBuffer<float> a_send(std::vector<float>(a.begin(), a.end())), a_recv(na);  // a_recv starts zeroed
    dvec<__nv_bfloat16> b_out(nb, __float2bfloat16(-3.0f));
    dvec<int32_t> c_out(nc, -5);
    dvec<float> d_before = d;
    dvec<int32_t> e_before = e;

    CUDA_CHECK(cudaDeviceSynchronize());  // a_recv's zeroing has landed: it is read directly below
    ok(ncclGroupStart(), what + " outer ncclGroupStart");
    ok(ncclGroupStart(), what + " inner ncclGroupStart");
    ok(ncclAllReduce(a_send.ptr, a_recv.ptr, na, ncclFloat32, ncclSum, comm, g_stream), what + " fp32 sum");
    ok(ncclAllReduce(b.data(), b_out.data(), nb, ncclBfloat16, ncclAvg, comm, g_stream), what + " bf16 avg");
    ok(ncclAllReduce(cc.data(), c_out.data(), nc, ncclInt32, ncclMax, comm, g_stream), what + " int32 max");
    ok(ncclAllReduce(d.data(), d.data(), nd, ncclFloat32, ncclSum, comm, g_stream), what + " fp32 in place");
    ok(ncclBroadcast(e.data(), e.data(), ne, ncclInt32, root, comm, g_stream), what + " broadcast");
    ok(ncclGroupEnd(), what + " inner ncclGroupEnd");
    const float a0 = a_recv.ptr[0];  // read directly: a blocking cudaMemcpy inside a group is refused
    test::check(a0 == 0.0f && c_out[0] == -5 && d == d_before && (g_rank == root || e == e_before),
                "%s: an operation ran before the outermost ncclGroupEnd (rank %d)", what.c_str(), g_rank);
    ok(ncclGroupEnd(), what + " outer ncclGroupEnd");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));

    const std::vector<float> a_out = a_recv.download();
    const auto want = [&](auto tag, uint64_t cs, size_t count, int op) {
        using T = decltype(tag);
        std::vector<double> w(count);
        for (size_t i = 0; i < count; ++i) w[i] = exact<T>(op, [&](int r) { return Type<T>::make(bits(cs, r, i)); });
        return w;
    };
    const std::string who = fmt(" rank %d", g_rank);
    check_values(what + " fp32 sum" + who, a_out.data(), want(float{}, c, na, ncclSum), ncclSum);
    check_values(what + " bf16 avg" + who, b_out.data(), want(__nv_bfloat16{}, c, nb, ncclAvg), ncclAvg);
    check_values(what + " int32 max" + who, c_out.data(), want(int32_t{}, c, nc, ncclMax), ncclMax);
    check_values(what + " fp32 in place" + who, d.data(), want(float{}, c + 1, nd, ncclSum), ncclSum);
    std::vector<double> want_e(ne);
    for (size_t i = 0; i < ne; ++i) want_e[i] = Type<int32_t>::make(bits(c + 2, root, i));
    check_values(what + " broadcast" + who, e.data(), want_e, kCopy);
    check_same_on_all_ranks(what + " fp32 sum", a_out.data(), na * sizeof(float));
    check_same_on_all_ranks(what + " bf16 avg", b_out.data(), nb * sizeof(__nv_bfloat16));
}

// ncclBcast, ncclAlltoAll, ncclGather and ncclScatter (in place where NCCL defines it).
void test_other_collectives(ncclComm_t comm, const char* label) {
    using T = int32_t;
    for (size_t count : {size_t(1), size_t(7), size_t(1000)}) {
        const uint64_t c = ++g_case;
        const int root = g_n - 1;
        const std::string who = fmt(" count %zu rank %d", count, g_rank);
        const auto value = [&](uint64_t src, size_t i) { return static_cast<double>(Type<T>::make(bits(c, src, i))); };

        dvec<T> buf = inputs<T>(c, g_rank, count);
        ok(ncclBcast(buf.data(), count, ncclInt32, 1 % g_n, comm, g_stream), fmt("%s ncclBcast", label));
        std::vector<double> want(count);
        for (size_t i = 0; i < count; ++i) want[i] = value(1 % g_n, i);
        check_values(fmt("%s ncclBcast root %d", label, 1 % g_n) + who, buf.data(), want, kCopy);

        // all-to-all: block p of rank r's send goes to block r of rank p's receive
        dvec<T> send(count * g_n), recv(count * g_n, -9);
        for (int p = 0; p < g_n; ++p)
            for (size_t i = 0; i < count; ++i) send[p * count + i] = Type<T>::make(bits(c, 100 + g_rank * g_n + p, i));
        ok(ncclAlltoAll(send.data(), recv.data(), count, ncclInt32, comm, g_stream), fmt("%s ncclAlltoAll", label));
        want.assign(count * g_n, 0);
        for (int p = 0; p < g_n; ++p)
            for (size_t i = 0; i < count; ++i) want[p * count + i] = value(100 + p * g_n + g_rank, i);
        check_values(fmt("%s ncclAlltoAll", label) + who, recv.data(), want, kCopy);

        for (bool in_place : {false, true}) {
            const std::string ip = in_place ? " in place" : "";
            // gather to the root; in place, the root's own block already sits in recvbuff
            dvec<T> mine = inputs<T>(c, 200 + g_rank, count), all(count * g_n, -9);
            const T* from = mine.data();
            if (in_place && g_rank == root) {
                std::copy(mine.begin(), mine.end(), all.begin() + root * count);
                from = all.data() + root * count;
            }
            ok(ncclGather(from, all.data(), count, ncclInt32, root, comm, g_stream), fmt("%s ncclGather", label) + ip);
            if (g_rank == root) {
                for (int p = 0; p < g_n; ++p)
                    for (size_t i = 0; i < count; ++i) want[p * count + i] = value(200 + p, i);
                check_values(fmt("%s ncclGather root %d", label, root) + ip + who, all.data(), want, kCopy);
            }
            // scatter from the root; in place, the root's block stays where it is in sendbuff
            dvec<T> blocks = inputs<T>(c, 300 + g_rank, count * g_n), part(count, -9);
            T* to = in_place && g_rank == root ? blocks.data() + root * count : part.data();
            ok(ncclScatter(blocks.data(), to, count, ncclInt32, root, comm, g_stream), fmt("%s ncclScatter", label) + ip);
            std::vector<double> want_part(count);
            for (size_t i = 0; i < count; ++i) want_part[i] = value(300 + root, g_rank * count + i);
            check_values(fmt("%s ncclScatter root %d", label, root) + ip + who, to, want_part, kCopy);
        }
    }
}

// Every data type through sum, avg and max, on inputs 0 and 1 (exact in every type): the
// result must be the type's value of the exact result, bit for bit (an average that is not
// exact: rounded once from fp32, or from fp64 for doubles).
template <class T>
void all_types_case(ncclComm_t comm, ncclDataType_t id, const char* name, T (*from_float)(float)) {
    const uint64_t c = ++g_case;
    const size_t count = 33;
    dvec<T> send(count), got(count);
    std::vector<int> ones(count, 0);
    for (size_t i = 0; i < count; ++i) {
        send[i] = from_float(static_cast<float>(bits(c, g_rank, i) & 1));
        for (int r = 0; r < g_n; ++r) ones[i] += static_cast<int>(bits(c, r, i) & 1);
    }
    for (ncclRedOp_t op : {ncclSum, ncclAvg, ncclMax}) {
        const std::string what = fmt("all types: %s %s rank %d", name, op_name(op), g_rank);
        ok(ncclAllReduce(send.data(), got.data(), count, id, op, comm, g_stream), what);
        size_t bad = 0;
        for (size_t i = 0; i < count; ++i) {
            T want;
            if (op == ncclSum) want = from_float(static_cast<float>(ones[i]));
            else if (op == ncclMax) want = from_float(ones[i] > 0 ? 1.0f : 0.0f);
            else if constexpr (std::is_integral_v<T>) want = from_float(static_cast<float>(ones[i] / g_n));
            else if constexpr (std::is_same_v<T, double>) want = static_cast<double>(ones[i]) / g_n;
            else want = from_float(static_cast<float>(ones[i]) / static_cast<float>(g_n));  // fp32, rounded once
            bad += std::memcmp(&want, &got[i], sizeof(T)) != 0;
        }
        test::check(bad == 0, "%s: %zu of %zu values differ from the exact result", what.c_str(), bad, count);
    }
}
template <class T>
T cast_from_float(float x) {
    return static_cast<T>(x);
}
__half half_from_float(float x) { return __float2half(x); }
__nv_bfloat16 bf16_from_float(float x) { return __float2bfloat16(x); }
__nv_fp8_e4m3 e4m3_from_float(float x) { return __nv_fp8_e4m3(x); }
__nv_fp8_e5m2 e5m2_from_float(float x) { return __nv_fp8_e5m2(x); }

void test_all_types(ncclComm_t comm) {
    all_types_case<int8_t>(comm, ncclInt8, "int8", cast_from_float<int8_t>);
    all_types_case<uint8_t>(comm, ncclUint8, "uint8", cast_from_float<uint8_t>);
    all_types_case<int32_t>(comm, ncclInt32, "int32", cast_from_float<int32_t>);
    all_types_case<uint32_t>(comm, ncclUint32, "uint32", cast_from_float<uint32_t>);
    all_types_case<int64_t>(comm, ncclInt64, "int64", cast_from_float<int64_t>);
    all_types_case<uint64_t>(comm, ncclUint64, "uint64", cast_from_float<uint64_t>);
    all_types_case<__half>(comm, ncclFloat16, "fp16", half_from_float);
    all_types_case<float>(comm, ncclFloat32, "fp32", cast_from_float<float>);
    all_types_case<double>(comm, ncclFloat64, "fp64", cast_from_float<double>);
    all_types_case<__nv_bfloat16>(comm, ncclBfloat16, "bf16", bf16_from_float);
    all_types_case<__nv_fp8_e4m3>(comm, ncclFloat8e4m3, "fp8e4m3", e4m3_from_float);
    all_types_case<__nv_fp8_e5m2>(comm, ncclFloat8e5m2, "fp8e5m2", e5m2_from_float);
}

void suite(ncclComm_t comm, const char* label) {
    suite_for_type<float>(comm, label);
    suite_for_type<__nv_bfloat16>(comm, label);
    suite_for_type<int32_t>(comm, label);
    test_send_recv_all_to_all<int32_t>(comm, label, 1);
    test_send_recv_all_to_all<float>(comm, label, 700);
    test_send_recv_all_to_all<__nv_bfloat16>(comm, label, 300);
    test_ring_ungrouped(comm, label);
    test_mixed_group(comm, label);
    test_grouped_collectives(comm, label);
    test_other_collectives(comm, label);
}

// ---- communicators ----

void test_comm_queries(ncclComm_t comm) {
    int v = 0, count = 0, rank = -1, device = -1;
    ok(ncclGetVersion(&v), "ncclGetVersion");
    test::check(v == NCCL_VERSION_CODE, "ncclGetVersion: %d, want %d", v, NCCL_VERSION_CODE);
    ok(ncclCommCount(comm, &count), "ncclCommCount");
    ok(ncclCommUserRank(comm, &rank), "ncclCommUserRank");
    ok(ncclCommCuDevice(comm, &device), "ncclCommCuDevice");
    test::check(count == g_n && rank == g_rank && device == 0, "communicator: count %d rank %d device %d, want %d %d 0",
                count, rank, device, g_n, g_rank);
    ncclResult_t async = ncclInternalError;
    ok(ncclCommGetAsyncError(comm, &async), "ncclCommGetAsyncError");
    test::check(async == ncclSuccess, "ncclCommGetAsyncError reports %d on a healthy communicator", async);
    std::vector<std::string> seen;
    for (int r = ncclSuccess; r < ncclNumResults; ++r) {
        const char* s = ncclGetErrorString(static_cast<ncclResult_t>(r));
        test::check(s && *s && std::find(seen.begin(), seen.end(), s) == seen.end(), "ncclGetErrorString(%d) is empty or repeated", r);
        seen.emplace_back(s ? s : "");
    }
}

// ncclCommInitRank's failure modes; each is collective, and every rank must learn it failed.
void test_init_errors() {
    const ncclUniqueId id = shared_id(0);
    ncclComm_t c = reinterpret_cast<ncclComm_t>(&g_case);  // must come back NULL on failure
    expect(ncclCommInitRank(&c, g_n, id, g_n), ncclInvalidArgument, "ncclCommInitRank with rank == nranks");
    test::check(c == nullptr, "a failed ncclCommInitRank left *comm set (rank %d)", g_rank);
    expect(ncclCommInitRank(&c, g_n + 1, id, g_rank), ncclInvalidUsage, "ncclCommInitRank with more nranks than ranks");
    if (g_n >= 2)
        expect(ncclCommInitRank(&c, g_n, id, g_rank / 2), ncclInvalidUsage, "ncclCommInitRank with duplicate ranks");
    // One bad rank: it reports its argument, the others a communicator short of a member.
    expect(ncclCommInitRank(&c, g_n, id, g_rank == 0 ? -1 : g_rank), g_rank == 0 ? ncclInvalidArgument : ncclInvalidUsage,
           "ncclCommInitRank with rank 0 passing rank -1");
    ncclUniqueId zero;
    std::memset(&zero, 0, sizeof zero);
    expect(ncclCommInitRank(&c, g_n, zero, g_rank), ncclInvalidArgument, "ncclCommInitRank with an id not from ncclGetUniqueId");
    expect(ncclCommInitRank(nullptr, g_n, id, g_rank), ncclInvalidArgument, "ncclCommInitRank with a NULL comm pointer");
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.magic = 0;
    expect(ncclCommInitRankConfig(&c, g_n, id, g_rank, &config), ncclInvalidArgument,
           "ncclCommInitRankConfig with an uninitialized config");
    for (const char* bad : {"abc", "0", "4294967296"}) {
        setenv("EMU_NCCL_SLICE_BYTES", bad, 1);
        expect(ncclCommInitRank(&c, g_n, id, g_rank), ncclInvalidArgument, fmt("EMU_NCCL_SLICE_BYTES=%s", bad));
    }
    unsetenv("EMU_NCCL_SLICE_BYTES");
}

// Two communicators made by one call on every rank: even ranks and odd ranks, each with its own id.
void test_split_communicators() {
    const ncclUniqueId even = shared_id(0), odd = shared_id(g_n > 1 ? 1 : 0);
    const int parity = g_rank % 2, size = (g_n + 1 - parity) / 2;
    ncclComm_t c = nullptr;
    if (!ok(ncclCommInitRank(&c, size, parity ? odd : even, g_rank / 2), "ncclCommInitRank of even/odd communicators")) return;
    int count = 0, rank = -1;
    ncclCommCount(c, &count);
    ncclCommUserRank(c, &rank);
    test::check(count == size && rank == g_rank / 2, "even/odd communicator: count %d rank %d, want %d %d", count, rank,
                size, g_rank / 2);
    const uint64_t cs = ++g_case;
    dvec<int32_t> x = inputs<int32_t>(cs, g_rank, 100), sum(100);
    ok(ncclAllReduce(x.data(), sum.data(), x.size(), ncclInt32, ncclSum, c, g_stream), "even/odd all-reduce");
    size_t bad = 0;
    for (size_t i = 0; i < x.size(); ++i) {
        int64_t want = 0;
        for (int r = parity; r < g_n; r += 2) want += Type<int32_t>::make(bits(cs, r, i));
        bad += sum[i] != want;
    }
    test::check(bad == 0, "even/odd all-reduce: %zu of %zu sums wrong (rank %d)", bad, x.size(), g_rank);
    ok(ncclCommDestroy(c), "ncclCommDestroy of an even/odd communicator");
}

// The lifecycle calls: config, finalize, abort, and destroy with work still queued.
void test_lifecycle() {
    dvec<float> xs = {1, 2, 3, 4}, ys(4, 0.0f);
    float *x = xs.data(), *y = ys.data();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t c = nullptr;
    ok(ncclCommInitRankConfig(&c, g_n, shared_id(0), g_rank, &config), "ncclCommInitRankConfig");
    ok(ncclCommFinalize(c), "ncclCommFinalize");
    expect(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, c, g_stream), ncclInvalidUsage, "all-reduce on a finalized comm");
    ok(ncclCommDestroy(c), "ncclCommDestroy after ncclCommFinalize");
    expect(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, c, g_stream), ncclInvalidArgument, "all-reduce on a destroyed comm");
    expect(ncclCommDestroy(c), ncclInvalidArgument, "ncclCommDestroy twice");

    ok(ncclCommInitRank(&c, g_n, shared_id(0), g_rank), "ncclCommInitRank");
    ok(ncclGroupStart(), "ncclGroupStart");
    ok(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, c, g_stream), "queued all-reduce");
    expect(ncclCommDestroy(c), ncclInvalidUsage, "ncclCommDestroy with an all-reduce queued in an open group");
    ok(ncclGroupEnd(), "ncclGroupEnd");
    test::check(y[0] == g_n && y[3] == 4.0f * g_n, "queued all-reduce: y = {%g .. %g} (rank %d)", y[0], y[3], g_rank);
    ok(ncclCommDestroy(c), "ncclCommDestroy");

    ok(ncclCommInitRank(&c, g_n, shared_id(0), g_rank), "ncclCommInitRank");
    y[0] = -1;
    ok(ncclGroupStart(), "ncclGroupStart");
    ok(ncclAllReduce(x, y, 4, ncclFloat32, ncclSum, c, g_stream), "all-reduce queued before an abort");
    ok(ncclCommAbort(c), "ncclCommAbort with an all-reduce queued");
    ok(ncclGroupEnd(), "ncclGroupEnd after the abort");
    test::check(y[0] == -1, "ncclCommAbort: the queued all-reduce ran anyway (rank %d)", g_rank);
}

// Misuse on a working communicator: each call must return NCCL's code and leave the
// communicator usable.
void test_errors(ncclComm_t comm) {
    dvec<float> xs(16, 0.0f), ys(16 * 8, 0.0f);
    float *x = xs.data(), *y = ys.data();
    for (int i = 0; i < 16; ++i) x[i] = static_cast<float>(i + g_rank);
    const auto bad_type = static_cast<ncclDataType_t>(ncclNumTypes);
    const auto bad_op = static_cast<ncclRedOp_t>(ncclNumOps);
    expect(ncclAllReduce(x, y, 1, ncclFloat32, ncclSum, nullptr, g_stream), ncclInvalidArgument, "all-reduce on a NULL comm");
    test::check(std::strstr(ncclGetLastError(comm), "emu: ncclAllReduce: comm is NULL") != nullptr,
                "ncclGetLastError after a NULL comm: \"%s\"", ncclGetLastError(comm));
    expect(ncclAllReduce(x, y, 1, bad_type, ncclSum, comm, g_stream), ncclInvalidArgument, "all-reduce with a bad datatype");
    expect(ncclAllReduce(x, y, 1, ncclFloat32, bad_op, comm, g_stream), ncclInvalidArgument, "all-reduce with a bad op");
    expect(ncclReduceScatter(x, y, 1, ncclFloat32, bad_op, comm, g_stream), ncclInvalidArgument,
           "reduce-scatter with a bad op");
    expect(ncclAllGather(x, y, 1, bad_type, comm, g_stream), ncclInvalidArgument, "all-gather with a bad datatype");
    expect(ncclBroadcast(x, y, 1, ncclFloat32, g_n, comm, g_stream), ncclInvalidArgument, "broadcast from root nranks");
    expect(ncclReduce(x, y, 1, ncclFloat32, ncclSum, -1, comm, g_stream), ncclInvalidArgument, "reduce to root -1");
    expect(ncclSend(x, 1, ncclFloat32, g_n, comm, g_stream), ncclInvalidArgument, "send to peer nranks");
    expect(ncclRecv(y, 1, ncclFloat32, -1, comm, g_stream), ncclInvalidArgument, "recv from peer -1");
    expect(ncclAllReduce(x, y, SIZE_MAX / 2, ncclFloat32, ncclSum, comm, g_stream), ncclInvalidArgument,
           "all-reduce of SIZE_MAX/2 floats");
    expect(ncclAllGather(x, y, static_cast<size_t>(PTRDIFF_MAX) / 4 / g_n + 1, ncclFloat32, comm, g_stream),
           ncclInvalidArgument, "all-gather whose receive size overflows");
    expect(ncclAllReduce(nullptr, y, 1, ncclFloat32, ncclSum, comm, g_stream), ncclInvalidArgument, "all-reduce from NULL");
    expect(ncclAllGather(x, nullptr, 1, ncclFloat32, comm, g_stream), ncclInvalidArgument, "all-gather into NULL");
    ok(ncclAllReduce(nullptr, nullptr, 0, ncclFloat32, ncclSum, comm, g_stream), "all-reduce of zero elements");
    expect(ncclAlltoAll(y, y, 1, ncclFloat32, comm, g_stream), ncclInvalidArgument, "in-place all-to-all");
    expect(ncclGroupEnd(), ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");

    // A bad call inside a group fails, and so does ncclGroupEnd; the group's good calls still run.
    ok(ncclGroupStart(), "ncclGroupStart");
    ok(ncclAllReduce(x, y, 16, ncclFloat32, ncclSum, comm, g_stream), "good all-reduce in a group");
    expect(ncclAllReduce(x, y, 16, bad_type, ncclSum, comm, g_stream), ncclInvalidArgument, "bad all-reduce in a group");
    expect(ncclGroupEnd(), ncclInvalidArgument, "ncclGroupEnd of a group with a bad call");
    size_t bad = 0;
    for (int i = 0; i < 16; ++i) bad += y[i] != static_cast<float>(g_n * i + g_n * (g_n - 1) / 2);
    test::check(bad == 0, "the good all-reduce of a group with a bad call: %zu wrong (rank %d)", bad, g_rank);

    // Still usable after all that.
    std::fill(y, y + 16, 0.0f);
    ok(ncclAllReduce(x, y, 16, ncclFloat32, ncclMax, comm, g_stream), "all-reduce after the errors");
    test::check(y[15] == static_cast<float>(15 + g_n - 1), "all-reduce max after the errors: %g (rank %d)", y[15], g_rank);
}

// The rules a GPU enforces by failing (or by silently wrong results), each broken once and kept
// once: buffers in device memory, inside their allocation, and overlapping only in NCCL's
// in-place forms (all-gather: sendbuff == recvbuff + rank * sendcount; reduce-scatter: recvbuff ==
// sendbuff + rank * recvcount). A refused call moves no data, so every rank returns alike.
void test_buffer_rules(ncclComm_t comm) {
    const size_t count = 6, n = static_cast<size_t>(g_n), me = static_cast<size_t>(g_rank);
    dvec<float> all(count * n, 0.0f), one(count, 1.0f);
    std::vector<float> pageable(count * n, 1.0f);
    float* pinned = nullptr;
    CUDA_CHECK(cudaMallocHost(&pinned, count * n * sizeof(float)));
    expect(ncclAllReduce(pageable.data(), one.data(), count, ncclFloat32, ncclSum, comm, g_stream), ncclInvalidArgument,
           "all-reduce from pageable host memory");
    expect(ncclAllGather(one.data(), pinned, count, ncclFloat32, comm, g_stream), ncclInvalidArgument,
           "all-gather into pinned host memory");
    expect(ncclAllReduce(one.data(), all.data() + all.size() - count + 1, count, ncclFloat32, ncclSum, comm, g_stream),
           ncclInvalidArgument, "all-reduce into a buffer that runs past its allocation");
    expect(ncclAllReduce(all.data(), all.data() + 1, count, ncclFloat32, ncclSum, comm, g_stream), ncclInvalidArgument,
           "all-reduce with partly overlapping buffers");
    // in place at the wrong block (the next rank's), then at the right one
    const size_t wrong = (me + 1) % n;
    for (size_t i = 0; i < count; ++i) all[me * count + i] = static_cast<float>(100 * g_rank + i);
    if (g_n > 1)
        expect(ncclAllGather(all.data() + wrong * count, all.data(), count, ncclFloat32, comm, g_stream), ncclInvalidArgument,
               "in-place all-gather at another rank's block");
    ok(ncclAllGather(all.data() + me * count, all.data(), count, ncclFloat32, comm, g_stream), "in-place all-gather");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    size_t bad = 0;
    for (size_t r = 0; r < n; ++r)
        for (size_t i = 0; i < count; ++i) bad += all[r * count + i] != static_cast<float>(100 * r + i);
    test::check(bad == 0, "in-place all-gather: %zu values wrong (rank %d)", bad, g_rank);
    if (g_n > 1)
        expect(ncclReduceScatter(all.data(), all.data() + wrong * count, count, ncclFloat32, ncclSum, comm, g_stream),
               ncclInvalidArgument, "in-place reduce-scatter into another rank's block");
    ok(ncclReduceScatter(all.data(), all.data() + me * count, count, ncclFloat32, ncclSum, comm, g_stream),
       "in-place reduce-scatter");
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
    bad = 0;
    for (size_t i = 0; i < count; ++i) bad += all[me * count + i] != static_cast<float>(n * (100 * me + i));
    test::check(bad == 0, "in-place reduce-scatter: %zu values wrong (rank %d)", bad, g_rank);
    CUDA_CHECK(cudaFreeHost(pinned));
}

// Ranks 0 and 1 disagree on send/recv counts (rank 0 sends `scale`*5 elements, rank 1 sends
// `scale`*9, each expects `scale`*7): each receiver is told, and neither hangs.
void test_count_mismatch(ncclComm_t comm, const char* label, size_t scale) {
    if (g_n < 2 || g_rank >= 2) return;
    const int peer = 1 - g_rank;
    dvec<int32_t> out(9 * scale), in(9 * scale);
    const std::string what = fmt("%s recv of %zu elements from a send of %zu", label, 7 * scale, (g_rank == 0 ? 9 : 5) * scale);
    ok(ncclGroupStart(), what + " ncclGroupStart");
    ok(ncclSend(out.data(), (g_rank == 0 ? 5 : 9) * scale, ncclInt32, peer, comm, g_stream), what + " ncclSend");
    ok(ncclRecv(in.data(), 7 * scale, ncclInt32, peer, comm, g_stream), what + " ncclRecv");
    expect(ncclGroupEnd(), ncclInvalidUsage, what);
}

}  // namespace

int main(int argc, char** argv) {
    // Before MPI exists, the CPU build's NCCL must say so rather than crash.
    ncclUniqueId early;
    ok(ncclGetUniqueId(&early), "ncclGetUniqueId before MPI_Init");
    ncclComm_t early_comm = nullptr;
    expect(ncclCommInitRank(&early_comm, 1, early, 0), ncclInvalidUsage, "ncclCommInitRank before MPI_Init");

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_n);
    unsigned long long seed = g_rank == 0 ? test::seed() : 0;
    MPI_Bcast(&seed, 1, MPI_UNSIGNED_LONG_LONG, 0, MPI_COMM_WORLD);
    g_seed = seed;
    CUDA_CHECK(cudaStreamCreate(&g_stream));

    ncclComm_t comm = nullptr, sliced = nullptr;
    ok(ncclCommInitRank(&comm, g_n, shared_id(0), g_rank), "ncclCommInitRank");
    // Tiny slices: every message is split and every reduction runs over many slices.
    setenv("EMU_NCCL_SLICE_BYTES", "1000", 1);
    ok(ncclCommInitRank(&sliced, g_n, shared_id(0), g_rank), "ncclCommInitRank with 1000-byte slices");
    unsetenv("EMU_NCCL_SLICE_BYTES");
    if (!comm || !sliced) {
        std::printf("rank %d: no communicator; giving up\n", g_rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }

    test_comm_queries(comm);
    suite(comm, "default slices:");
    suite(sliced, "1000-byte slices:");
    test_all_types(comm);
    test_init_errors();
    test_split_communicators();
    test_lifecycle();
    test_errors(comm);
    test_buffer_rules(comm);
    test_count_mismatch(comm, "default slices:", 1);
    test_count_mismatch(sliced, "1000-byte slices:", 100);  // several slices' worth: still one message
    ok(ncclCommDestroy(sliced), "ncclCommDestroy");

    // The closing line comes before MPI_Finalize: once any rank exits non-zero, mpirun kills the
    // rest, so a line printed later by rank 0 could be lost exactly when it matters.
    int local[2] = {test::passed(), test::failed()}, total[2] = {0, 0};
    MPI_Allreduce(local, total, 2, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    test::passed() = total[0];
    test::failed() = total[1];
    if (g_rank == 0) test::finish();
    std::fflush(stdout);
    MPI_Finalize();

    // After MPI_Finalize (no totals any more: a failure prints its line and fails this rank):
    // collectives are refused, and a communicator can still be destroyed.
    float x = 1, y = 0;
    expect(ncclAllReduce(&x, &y, 1, ncclFloat32, ncclSum, comm, g_stream), ncclInvalidUsage, "all-reduce after MPI_Finalize");
    expect(ncclCommInitRank(&early_comm, 1, early, 0), ncclInvalidUsage, "ncclCommInitRank after MPI_Finalize");
    ok(ncclCommDestroy(comm), "ncclCommDestroy after MPI_Finalize");
    CUDA_CHECK(cudaStreamDestroy(g_stream));
    return test::failed() ? 1 : 0;
}
