// The CPU platform: what nvcc and the GPU would provide to our .cu sources, for g++.
// Types and host API declarations come from NVIDIA's own headers; emu supplies the
// definitions (runtime.cpp, cublaslt.cpp, nccl.cpp) and the device-side language below
// (exec.cpp runs each CUDA thread as a fiber). Included only through kernels/platform.cuh.
#pragma once
#ifdef __CUDACC__
#error "emu/cuda_emu.h is for the CPU build; nvcc uses the real CUDA runtime"
#endif

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// The CUDA headers define these as nothing for a host compiler; a block's static shared
// memory must be one object for all its threads, and a worker runs one block at a time.
// Emu finds these objects in the program's symbol table (to poison them at every block start and
// to know shared addresses): a function-local `static thread_local` outside namespace emu is
// static shared memory. Launch bounds are read from the sources at build time (launch_bounds.h).
#undef __shared__
#define __shared__ static thread_local
#define __launch_bounds__(...)
#undef __grid_constant__
#define __grid_constant__

// Rounding to bf16. The CUDA header's host __float2bfloat16 decides round-to-nearest-even with
// compares that mispredict on about half of real data, which made it the largest cost of whole
// kernels (the loss backward: 45 ns per element, 19 without). These give the same bits without
// branches: NaN becomes 0x7fff as there; anything else rounds by adding 0x7fff plus the lowest
// kept bit. Macros, as the header's functions cannot be overloaded.
namespace emu {
inline unsigned short float_to_bf16_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return static_cast<unsigned short>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fffu : rounded);
}
inline __nv_bfloat16 float_to_bf16(float f) {
    __nv_bfloat16_raw r;
    r.x = float_to_bf16_bits(f);
    return r;
}
inline __nv_bfloat162 floats_to_bf162(float lo, float hi) {
    __nv_bfloat162_raw r;
    r.x = float_to_bf16_bits(lo);
    r.y = float_to_bf16_bits(hi);
    return r;
}
}  // namespace emu
#define __float2bfloat16(x) ::emu::float_to_bf16(x)
#define __float2bfloat16_rn(x) ::emu::float_to_bf16(x)
#define __floats2bfloat162_rn(lo, hi) ::emu::floats_to_bf162((lo), (hi))
#define __float22bfloat162_rn(f) ::emu::floats_to_bf162((f).x, (f).y)

namespace emu {

struct ThreadState {        // one per CUDA thread (fiber)
    uint3 thread_idx;
    unsigned lane, warp;
    unsigned char* slot;    // this lane's deposit slot for warp collectives
    // Per-fiber state of the PTX twins (wgmma's in-flight queue, cp.async's), found by a map lookup
    // per instruction without this: the cached entry, valid while `cached_by` is this fiber's address
    // and `owner` the id of the worker thread's map (a fiber moved by its worker's resize misses and
    // looks again; a map of a later thread, even at the same address, has another id).
    struct TwinCache {
        const ThreadState* cached_by = nullptr;
        uint64_t owner = 0;
        void* entry = nullptr;
    } wgmma_cache, cp_async_cache;
};
struct BlockState {         // one per block in flight on a worker
    uint3 block_idx;
    dim3 block_dim, grid_dim;
    unsigned char* dyn_smem;
    size_t dyn_smem_bytes;
    uint64_t serial;        // distinct for every block a worker runs (state kept per block is reset by it)
};
extern __thread ThreadState* t_thread;
extern __thread BlockState* t_block;

// The pointers among a kernel's arguments, for the race detector of deferred streams (streams.h):
// a pointer to const is only read; any other, and any pointer-sized word of a struct argument
// that points into a buffer, may be written. So a struct argument must have no padding: a padding
// word's stale bytes beside an int (a pointer's upper half, say) can point into a live buffer, and
// the detector then reports a race that is not there (the kernels' argument structs static_assert
// std::has_unique_object_representations).
struct PointerArg {
    const void* p;
    bool written;
};
bool tracks_accesses();  // EMU_STREAMS=deferred
template <class T>
void pointer_args(const T& arg, std::vector<PointerArg>& out) {
    if constexpr (std::is_pointer_v<T>) {
        out.push_back({static_cast<const void*>(arg), !std::is_const_v<std::remove_pointer_t<T>>});
    } else if constexpr (std::is_class_v<T> && std::is_trivially_copyable_v<T> && alignof(T) >= alignof(void*)) {
        for (size_t at = 0; at + sizeof(void*) <= sizeof(T); at += sizeof(void*)) {
            const void* p;
            std::memcpy(&p, reinterpret_cast<const unsigned char*>(&arg) + at, sizeof p);
            out.push_back({p, true});
        }
    }
}

// Kernel launch: `thunk(closure)` runs once per CUDA thread of the grid when the stream gets to
// the launch (streams.h). Shape errors are reported at the launch, as CUDA does; errors while
// running become the sticky error.
using Thunk = void (*)(const void* closure);
void launch(const void* kernel, dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream, Thunk thunk,
            std::shared_ptr<const void> closure, std::vector<PointerArg> pointers);

template <class... P, class... A>
void launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, A&&... args) {
    static_assert(sizeof...(P) == sizeof...(A), "launch: wrong number of kernel arguments");
    struct Closure {
        void (*kernel)(P...);
        std::tuple<std::decay_t<P>...> args;
    };
    // A copy: the launch may run after the caller's arguments are gone.
    auto closure = std::make_shared<const Closure>(Closure{kernel, std::tuple<std::decay_t<P>...>(std::forward<A>(args)...)});
    std::vector<PointerArg> pointers;
    if (tracks_accesses()) std::apply([&](const auto&... a) { (pointer_args(a, pointers), ...); }, closure->args);
    launch(reinterpret_cast<const void*>(kernel), grid, block, smem_bytes, stream,
           [](const void* c) {
               const auto* cl = static_cast<const Closure*>(c);
               std::apply(cl->kernel, cl->args);
           },
           std::move(closure), std::move(pointers));
}

// Names the bytes [p, p + bytes) of a buffer for emu's diagnostics; the race detector takes a
// kernel's pointer argument to reach to the end of the innermost named range that holds it.
void name_range(const void* p, size_t bytes, const char* name);

// A warp collective among the lanes of `mask`: each lane deposits `in`; the last lane to
// arrive runs `combine` over all deposits, which writes every lane's result; each lane
// then receives its own `out`. `what` names the operation (lanes must agree on it).
constexpr size_t kSlotBytes = 64;
using Combine = void (*)(const unsigned char* in_slots, unsigned char* out_slots, unsigned mask);
inline unsigned char* collective_slot() { return t_thread->slot; }  // the calling lane's deposit slot
// Arrives at the collective (after depositing), waits for the others; returns this lane's result slot.
const unsigned char* collective_arrive(const char* what, unsigned mask, Combine combine);
// Inline so that the copies have constant sizes: this is the emulator's hottest path.
inline void warp_collective(const char* what, unsigned mask, const void* in, size_t in_bytes, void* out,
                            size_t out_bytes, Combine combine) {
    std::memcpy(collective_slot(), in, in_bytes);
    std::memcpy(out, collective_arrive(what, mask, combine), out_bytes);
}

// Block barrier; returns the number of threads whose `pred` was non-zero.
int block_barrier(const char* what, int pred);
// Parks the calling thread until *word differs from `seen` (other threads of the block run meanwhile);
// a block whose threads all wait, here or at barriers, fails as deadlocked, naming `what`.
void wait_while_equal(const uint64_t* word, uint64_t seen, const char* what);

// Emulation switches and diagnostics (environment: EMU_WORKERS, EMU_RANDOM_ORDER, EMU_STACK_KB;
// EMU_GEMM and EMU_NCCL_SLICE_BYTES for the cuBLASLt and NCCL shims; see README.md).
int worker_count();
uint64_t random_order_seed();  // EMU_RANDOM_ORDER as read at its first use; 0: random order is off
const char* last_kernel_error();  // message of the last failed launch, or ""
size_t peak_device_bytes();       // high-water mark of cudaMalloc'ed bytes

// Fragments of shuffles: the source lane each lane reads, per CUDA's width semantics.
struct ShflIn {
    unsigned long long value;
    int src;
};
void shfl_combine(const unsigned char* in, unsigned char* out, unsigned mask);

template <class T>
T shfl(const char* what, unsigned mask, T var, int src) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>, "shuffle of at most 8 bytes");
    ShflIn in{0, src};
    std::memcpy(&in.value, &var, sizeof(T));
    unsigned long long got;
    warp_collective(what, mask, &in, sizeof in, &got, sizeof got, shfl_combine);
    T r;
    std::memcpy(&r, &got, sizeof(T));
    return r;
}
inline int lane_id() { return static_cast<int>(t_thread->lane); }

// A butterfly of __shfl_xor_sync rounds (offsets first, first/2, ..., 1; each lane v = Op::apply(v,
// v of lane ^ offset)) computed in one warp meeting instead of one per round: the same arithmetic in
// the same order, so the same bits. A source lane that does not exist reads all ones, as shfl does.
template <class Op, int First>
void butterfly_combine(const unsigned char* in, unsigned char* out, unsigned mask) {
    float v[32];
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((mask >> lane) & 1u) std::memcpy(&v[lane], in + lane * kSlotBytes, sizeof(float));
    const unsigned undefined = ~0u;
    for (int offset = First; offset > 0; offset >>= 1) {
        float next[32];
        for (unsigned lane = 0; lane < 32; ++lane) {
            if (!((mask >> lane) & 1u)) continue;
            const unsigned src = lane ^ static_cast<unsigned>(offset);
            float other;
            if ((mask >> src) & 1u)
                other = v[src];
            else
                std::memcpy(&other, &undefined, sizeof other);
            next[lane] = Op::apply(v[lane], other);
        }
        std::memcpy(v, next, sizeof v);
    }
    for (unsigned lane = 0; lane < 32; ++lane)
        if ((mask >> lane) & 1u) std::memcpy(out + lane * kSlotBytes, &v[lane], sizeof(float));
}
// The collective's name tells the offsets, so lanes that disagree on them fail as a divergent warp.
constexpr const char* butterfly_name(int first) {
    switch (first) {
        case 1: return "warp_butterfly(1)";
        case 2: return "warp_butterfly(2)";
        case 4: return "warp_butterfly(4)";
        case 8: return "warp_butterfly(8)";
        default: return "warp_butterfly(16)";
    }
}
template <class Op, int First>
float butterfly(float v) {
    static_assert(First == 1 || First == 2 || First == 4 || First == 8 || First == 16, "offsets are powers of two up to 16");
    float r;
    warp_collective(butterfly_name(First), 0xffffffffu, &v, sizeof v, &r, sizeof r, butterfly_combine<Op, First>);
    return r;
}
unsigned warp_lanes();  // the lanes that exist in the calling thread's warp (a partial last warp has fewer)

// For the PTX twins' checks (ptx_twins.h): where an access lies, and how a thread fails.
bool in_block_shared(const void* p, size_t bytes);       // inside one of the calling block's shared objects
bool in_device_allocation(const void* p, size_t bytes);  // inside one cudaMalloc allocation
// Stops the calling CUDA thread's kernel with a message naming the kernel, block and thread; the
// launch leaves a sticky cudaErrorLaunchFailure, as a faulting kernel does on a GPU.
[[noreturn]] void fail_thread(const char* why);

}  // namespace emu

// cuda_runtime.h offers this typed overload only to nvcc.
template <class T>
cudaError_t cudaFuncSetAttribute(T* entry, cudaFuncAttribute attr, int value) {
    return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(entry), attr, value);
}

#define threadIdx (::emu::t_thread->thread_idx)
#define blockIdx (::emu::t_block->block_idx)
#define blockDim (::emu::t_block->block_dim)
#define gridDim (::emu::t_block->grid_dim)
constexpr int warpSize = 32;

// ---- barriers and warp collectives ----
inline void __syncthreads() { ::emu::block_barrier("__syncthreads", 0); }
inline int __syncthreads_count(int p) { return ::emu::block_barrier("__syncthreads_count", p); }
inline int __syncthreads_and(int p) {
    return ::emu::block_barrier("__syncthreads_and", p) ==
           static_cast<int>(blockDim.x * blockDim.y * blockDim.z);
}
inline int __syncthreads_or(int p) { return ::emu::block_barrier("__syncthreads_or", p) != 0; }

namespace emu {
void ballot_combine(const unsigned char* in, unsigned char* out, unsigned mask);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    unsigned no_vote = 0, r;  // a collective that exchanges nothing: only the meeting matters
    ::emu::warp_collective("__syncwarp", mask, &no_vote, sizeof no_vote, &r, sizeof r, ::emu::ballot_combine);
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    unsigned p = pred != 0, r;
    ::emu::warp_collective("__ballot_sync", mask, &p, sizeof p, &r, sizeof r, ::emu::ballot_combine);
    return r;
}
inline int __all_sync(unsigned mask, int pred) {
    unsigned p = pred != 0, r;
    ::emu::warp_collective("__all_sync", mask, &p, sizeof p, &r, sizeof r, ::emu::ballot_combine);
    return r == (mask & ::emu::warp_lanes());
}
inline int __any_sync(unsigned mask, int pred) {
    unsigned p = pred != 0, r;
    ::emu::warp_collective("__any_sync", mask, &p, sizeof p, &r, sizeof r, ::emu::ballot_combine);
    return r != 0;
}
inline unsigned __activemask() { return 0xffffffffu; }

// Source lanes as the CUDA programming guide defines them for each variant.
template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize) {
    const int lane = ::emu::lane_id();
    return ::emu::shfl("__shfl_sync", mask, var, (src_lane % width) + (lane / width) * width);
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    const int lane = ::emu::lane_id();
    const int src = (lane % width) >= static_cast<int>(delta) ? lane - static_cast<int>(delta) : lane;
    return ::emu::shfl("__shfl_up_sync", mask, var, src);
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
    const int lane = ::emu::lane_id();
    const int src = (lane % width) + static_cast<int>(delta) < width ? lane + static_cast<int>(delta) : lane;
    return ::emu::shfl("__shfl_down_sync", mask, var, src);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
    const int lane = ::emu::lane_id();
    const int src = lane ^ lane_mask;
    // A source in a later group of `width` lanes reads the caller's own value.
    return ::emu::shfl("__shfl_xor_sync", mask, var, src >= (lane / width + 1) * width ? lane : src);
}

// ---- atomics (device-wide: blocks run concurrently on worker threads) ----
namespace emu {
template <class T>
T atomic_add(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <class T, class F>
T atomic_update(T* p, F f) {  // compare-and-swap loop applying f(old)
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (!a.compare_exchange_weak(old, f(old))) {}
    return old;
}
}  // namespace emu
inline int atomicAdd(int* p, int v) { return emu::atomic_add(p, v); }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return emu::atomic_add(p, v); }
inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) { return emu::atomic_add(p, v); }
inline float atomicAdd(float* p, float v) { return emu::atomic_add(p, v); }
inline double atomicAdd(double* p, double v) { return emu::atomic_add(p, v); }
inline __nv_bfloat16 atomicAdd(__nv_bfloat16* p, __nv_bfloat16 v) {
    // the fp32 sum rounded to bf16, as the hardware's bf16 atomic add does
    static_assert(sizeof(__nv_bfloat16) == sizeof(unsigned short));
    const auto as_bf16 = [](unsigned short bits) {
        __nv_bfloat16_raw raw;
        raw.x = bits;
        return __nv_bfloat16(raw);
    };
    const unsigned short old = emu::atomic_update(reinterpret_cast<unsigned short*>(p), [&](unsigned short o) {
        return static_cast<__nv_bfloat16_raw>(__float2bfloat16(__bfloat162float(as_bf16(o)) + __bfloat162float(v))).x;
    });
    return as_bf16(old);
}
inline int atomicSub(int* p, int v) { return std::atomic_ref<int>(*p).fetch_sub(v); }
inline unsigned atomicSub(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_sub(v); }
#define EMU_ATOMIC_MINMAX(T)                                                                    \
    inline T atomicMax(T* p, T v) { return emu::atomic_update(p, [&](T o) { return o > v ? o : v; }); } \
    inline T atomicMin(T* p, T v) { return emu::atomic_update(p, [&](T o) { return o < v ? o : v; }); }
EMU_ATOMIC_MINMAX(int)
EMU_ATOMIC_MINMAX(unsigned)
EMU_ATOMIC_MINMAX(long long)
EMU_ATOMIC_MINMAX(unsigned long long)
#undef EMU_ATOMIC_MINMAX
#define EMU_ATOMIC_CAS_EXCH(T)                                                                  \
    inline T atomicCAS(T* p, T expected, T desired) {                                             \
        std::atomic_ref<T>(*p).compare_exchange_strong(expected, desired);                        \
        return expected;                                                                          \
    }                                                                                             \
    inline T atomicExch(T* p, T v) { return std::atomic_ref<T>(*p).exchange(v); }
EMU_ATOMIC_CAS_EXCH(int)
EMU_ATOMIC_CAS_EXCH(unsigned)
EMU_ATOMIC_CAS_EXCH(unsigned long long)
EMU_ATOMIC_CAS_EXCH(unsigned short)
#undef EMU_ATOMIC_CAS_EXCH
inline float atomicExch(float* p, float v) { return std::atomic_ref<float>(*p).exchange(v); }
inline int atomicAnd(int* p, int v) { return std::atomic_ref<int>(*p).fetch_and(v); }
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
inline int atomicXor(int* p, int v) { return std::atomic_ref<int>(*p).fetch_xor(v); }
inline unsigned atomicAnd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_and(v); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
inline unsigned atomicXor(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_xor(v); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// ---- cache-hinted loads and stores: plain memory accesses on the CPU ----
template <class T> T __ldg(const T* p) { return *p; }
template <class T> T __ldcg(const T* p) { return *p; }
template <class T> T __ldca(const T* p) { return *p; }
template <class T> T __ldcs(const T* p) { return *p; }
template <class T> T __ldlu(const T* p) { return *p; }
template <class T> T __ldcv(const T* p) { return *p; }
template <class T> void __stcg(T* p, T v) { *p = v; }
template <class T> void __stcs(T* p, T v) { *p = v; }
template <class T> void __stwb(T* p, T v) { *p = v; }
template <class T> void __stwt(T* p, T v) { *p = v; }

// ---- math intrinsics: the fast hardware forms become their accurate libm twins ----
inline float __expf(float x) { return std::exp(x); }
inline float __exp10f(float x) { return std::pow(10.0f, x); }
inline float __logf(float x) { return std::log(x); }
inline float __log2f(float x) { return std::log2(x); }
inline float __log10f(float x) { return std::log10(x); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline float __tanf(float x) { return std::tan(x); }
inline float __powf(float x, float y) { return std::pow(x, y); }
inline float __fdividef(float x, float y) { return x / y; }
inline float __frcp_rn(float x) { return 1.0f / x; }
inline float __fsqrt_rn(float x) { return std::sqrt(x); }
inline float __frsqrt_rn(float x) { return 1.0f / std::sqrt(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return x != x ? 0.0f : std::fmin(std::fmax(x, 0.0f), 1.0f); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float x) { return static_cast<int>(std::nearbyint(x)); }
inline int __float2int_rz(float x) { return static_cast<int>(x); }
inline int __float2int_rd(float x) { return static_cast<int>(std::floor(x)); }
inline int __float2int_ru(float x) { return static_cast<int>(std::ceil(x)); }
inline unsigned __float2uint_rn(float x) { return static_cast<unsigned>(std::nearbyint(x)); }
inline float __int2float_rn(int x) { return static_cast<float>(x); }
inline int __float_as_int(float x) { int r; std::memcpy(&r, &x, 4); return r; }
inline unsigned __float_as_uint(float x) { unsigned r; std::memcpy(&r, &x, 4); return r; }
inline float __int_as_float(int x) { float r; std::memcpy(&r, &x, 4); return r; }
inline float __uint_as_float(unsigned x) { float r; std::memcpy(&r, &x, 4); return r; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}
inline unsigned __umulhi(unsigned a, unsigned b) {
    return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline long long clock64() {
    return std::chrono::steady_clock::now().time_since_epoch().count();
}
// CUDA's global min/max overloads, including its mixed signed/unsigned promotions.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline unsigned min(int a, unsigned b) { return min(static_cast<unsigned>(a), b); }
inline unsigned max(int a, unsigned b) { return max(static_cast<unsigned>(a), b); }
inline unsigned min(unsigned a, int b) { return min(a, static_cast<unsigned>(b)); }
inline unsigned max(unsigned a, int b) { return max(a, static_cast<unsigned>(b)); }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }
