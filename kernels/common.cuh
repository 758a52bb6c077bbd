// The basics every kernel family shares: error checks and shape rules, ceil-div, warp and block
// reductions, deterministic sums of per-block partials, sigmoid, and 128-bit vector loads and stores.
#pragma once
#include "platform.cuh"

#include <algorithm>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <type_traits>

// ---- error checks: a failed call names itself, its file and line, then exits ----
inline void cuda_check(cudaError_t e, const char* what, const char* file, int line) {
    if (e != cudaSuccess) {
        std::fprintf(stderr, "CUDA error at %s:%d: %s: %s (%s)\n", file, line, what, cudaGetErrorString(e),
                     cudaGetErrorName(e));
        std::exit(EXIT_FAILURE);
    }
}
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
// After a launch: a bad configuration shows up here, not at the launch.
#define CUDA_CHECK_LAUNCH() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ---- shape rules: a launcher given a shape or pointer its kernels cannot handle stops here ----
// Unless ok: prints the printf-style message (which names the launcher) and exits non-zero.
__attribute__((format(printf, 2, 3))) inline void kernel_require(bool ok, const char* fmt, ...) {
    if (ok) return;
    std::va_list ap;
    va_start(ap, fmt);
    std::vfprintf(stderr, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "\n");
    std::exit(EXIT_FAILURE);
}
// For the shape rules written as functions that return what is wrong ("" when nothing is).
inline void require_shape(const std::string& error, const char* launcher) {
    kernel_require(error.empty(), "%s: %s", launcher, error.c_str());
}
inline bool is_aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
inline bool all_aligned16(std::initializer_list<const void*> pointers) {
    for (const void* p : pointers)
        if (!is_aligned16(p)) return false;
    return true;
}

template <class T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

// Every gate of the model (smear, skip, attention output, value embedding) is a dot product of the
// first 12 channels of its input row with its weights: upstream's x[..., :12].
constexpr int kGateWidth = 12;

// ---- reductions ----
// Sum over the 32 lanes of a warp; every lane gets the result (butterfly).
__device__ __forceinline__ float warp_reduce_sum(float v) { return warp_butterfly<WarpSum, 16>(v); }
__device__ __forceinline__ float warp_reduce_max(float v) { return warp_butterfly<WarpMax, 16>(v); }

// Sum over a 1-D block whose size is a multiple of 32; every thread gets the result.
// The leading barrier lets consecutive calls reuse the same scratch.
__device__ inline float block_reduce_sum(float v) {
    __shared__ float warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    return warp_reduce_sum(lane < warps ? warp_sums[lane] : 0.0f);
}
__device__ inline float block_reduce_max(float v) {
    __shared__ float warp_maxes[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_reduce_max(v);
    __syncthreads();
    if (lane == 0) warp_maxes[warp] = v;
    __syncthreads();
    return warp_reduce_max(lane < warps ? warp_maxes[lane] : -INFINITY);
}

// warp_reduce_sum's butterfly rounds over values one thread holds: a round with offset h adds p[m + h] into p[m]
// (m < h), for h = M/2, ..., 1 (M a power of two up to 32), the sum left in p[0]. Since fp addition is commutative
// the two partners of a round get the same sum, so the thread reproduces the warp's rounds over lanes whose values
// it holds: with p[m] lane m of 32, the warp's sum to the bit (every lane holds the same); with p[m] lane m d + c
// (d = 32 / M), the rounds with offsets 16 .. d, the rest of them shuffles (warp_butterfly<WarpSum, d / 2>).
template <int M, int H = M / 2>
__device__ __forceinline__ void butterfly_in_lane(float (&p)[M]) {
    static_assert(M >= 1 && M <= 32 && (M & (M - 1)) == 0, "a power of two up to 32 values");
    if constexpr (H >= 1) {  // a round per instance: every index a constant (registers, never the stack)
#pragma unroll
        for (int m = 0; m < H; ++m) p[m] += p[m + H];
        butterfly_in_lane<M, H / 2>(p);
    }
}

// ---- deterministic sums: fixed summation orders, no atomics, the same bits on every run ----
// sum_{i < n} x[i * stride] over a 1-D block: thread j adds i = j, j + blockDim.x, ... in turn, then
// block_reduce_sum's fixed tree; every thread gets the result.
__device__ inline float block_sum_fixed_order(const float* x, int n, int stride = 1) {
    float s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[static_cast<size_t>(i) * stride];
    return block_reduce_sum(s);
}

// A block's partial sums from its warps' values: dst[v] = sum over w = 0, 1, ... of warp_values[w][v], added
// in warp order by thread v (v < NV). Every thread of the block calls it once its warp's values are written.
template <int WARPS, int NV>
__device__ __forceinline__ void store_block_partials(float* dst, const float (&warp_values)[WARPS][NV]) {
    __syncthreads();
    if (threadIdx.x < NV) {
        float s = 0.0f;
        for (int w = 0; w < WARPS; ++w) s += warp_values[w][threadIdx.x];
        dst[threadIdx.x] = s;
    }
}

// Where a reduction's values land: up to 4 runs of consecutive fp32 or bf16 elements; value v is the v-th
// element counting through the runs in order.
struct SumTargets {
    static constexpr int kMaxRuns = 4;
    struct Run {
        float* f32;  // one of f32 and bf16 is set
        __nv_bfloat16* bf16;
        int len;
        // fp32 runs only: the sum is rounded to bf16 before it is stored or added, as the gradient of an fp32
        // parameter that the forward casts to bf16 (`.bfloat16()`) is. Also keeps the struct without
        // padding: emu reads every word of a kernel's struct argument (PointerArg).
        int bf16_rounded = 0;
    };
    Run run[kMaxRuns] = {};
    int runs = 0, count = 0;
    SumTargets& add(float* p, int n = 1) { return add_run({p, nullptr, n}); }
    SumTargets& add(__nv_bfloat16* p, int n = 1) { return add_run({nullptr, p, n}); }
    // fp32 targets that receive the sum rounded to bf16, then widened (see Run::bf16_rounded).
    SumTargets& add_bf16_rounded(float* p, int n = 1) { return add_run({p, nullptr, n, 1}); }
    double bytes() const {
        double b = 0;
        for (int r = 0; r < runs; ++r) b += static_cast<double>(run[r].len) * (run[r].f32 ? 4 : 2);
        return b;
    }

private:
    SumTargets& add_run(const Run& r) {
        kernel_require(runs < kMaxRuns && r.len >= 0, "SumTargets: at most %d runs of non-negative length", kMaxRuns);
        run[runs++] = r;
        count += r.len;
        return *this;
    }
};

static_assert(std::has_unique_object_representations_v<SumTargets>, "SumTargets: a kernel argument with padding");

// Writes value v of a reduction: target[v] = (accumulate ? target[v] : 0) + s (s rounded to bf16 first
// where the run says so).
__device__ __forceinline__ void store_sum_target(const SumTargets& targets, int v, float s, bool accumulate) {
#pragma unroll
    for (int r = 0; r < SumTargets::kMaxRuns; ++r) {  // unrolled: the runs stay in parameter space
        const SumTargets::Run& run = targets.run[r];
        if (v >= 0 && v < run.len) {
            if (float* g = run.f32) {
                const float t = run.bf16_rounded ? __bfloat162float(__float2bfloat16(s)) : s;
                g[v] = accumulate ? g[v] + t : t;
            } else {
                run.bf16[v] = __float2bfloat16(accumulate ? __bfloat162float(run.bf16[v]) + s : s);
            }
        }
        v -= run.len;
    }
}
// Second pass of a reduction over blocks, one block per value v:
// target[v] = (accumulate ? target[v] : 0) + scale * sum over b < blocks of partials[b * stride + v].
__global__ void sum_block_partials_kernel(SumTargets targets, const float* partials, int blocks, int stride,
                                          float scale, bool accumulate) {
    const float s = scale * block_sum_fixed_order(partials + blockIdx.x, blocks, stride);
    if (threadIdx.x == 0) store_sum_target(targets, blockIdx.x, s, accumulate);
}
constexpr int kSumPartialsThreads = 128;     // per value: the partials of up to ~1000 blocks
constexpr int kSumFixedOrderThreads = 1024;  // one long array (e.g. a loss per row)
// Threads for summing n values: whole warps, no more than there are values (a few dozen partials
// need one warp, not a thousand idle threads), at most `most`. The order depends on n only.
__host__ __device__ constexpr int sum_threads(int n, int most) {
    const int threads = (n + 31) / 32 * 32;
    return threads < 32 ? 32 : threads > most ? most : threads;
}

// ---- reductions fused into their producer: the last block to finish sums every block's partials ----
// block_sum_fixed_order(x, n, stride) as a block of `threads` threads (a multiple of 32, at most 1024)
// computes it, run by a 1-D block of any whole number of warps: each warp plays the summing block's
// warps w, w + warps, ... in turn, so the bits are those of a separate summing launch.
__device__ inline float block_sum_as(const float* x, int n, int stride, int threads) {
    __shared__ float warp_sums[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32, sum_warps = threads / 32;
    __syncthreads();  // consecutive calls reuse warp_sums
    for (int w = warp; w < sum_warps; w += warps) {
        float s = 0.0f;
        // __ldcg: other blocks wrote these; read them from L2, never from a stale L1 line
        for (int i = w * 32 + lane; i < n; i += threads) s += __ldcg(x + static_cast<size_t>(i) * stride);
        s = warp_reduce_sum(s);
        if (lane == 0) warp_sums[w] = s;
    }
    __syncthreads();
    return warp_reduce_sum(lane < sum_warps ? warp_sums[lane] : 0.0f);
}
// Where a fused reduction's blocks leave their partials, and the ticket counter that finds the last
// block. The counter must be zero before the first launch (its owner zeroes it once, when allocating
// it); each launch's last block sets it back to zero. Launches that may run at the same time (on other
// streams) must not share it, and nothing else may write it.
struct BlockPartials {
    float* partials;
    unsigned int* done;
};
// What a producer's last block writes: target[v] = (accumulate ? target[v] : 0) + the sum over blocks of
// the partials of value v, summed through `scratch`.
struct LastBlockSum {
    SumTargets targets;
    BlockPartials scratch;
    int64_t accumulate;  // a bool, as wide as a word: no padding (see SumTargets::Run)
};
static_assert(std::has_unique_object_representations_v<LastBlockSum>, "LastBlockSum: a kernel argument with padding");
// Called by every thread of every block once the block's partials are stored; true (in every thread) in
// the one block that draws the last ticket, which may then read every block's partials. That block sets
// the counter back to zero at once: every block has drawn its ticket by then.
__device__ inline bool last_block_done(unsigned int* done) {
    __shared__ bool is_last;
    __threadfence();  // this block's partials reach every block before its ticket is drawn
    __syncthreads();
    if (threadIdx.x == 0) {
        is_last = atomicAdd(done, 1u) == gridDim.x - 1;
        if (is_last) *done = 0;  // the next launch finds zero
    }
    __syncthreads();
    if (is_last) __threadfence();  // the partials of every earlier ticket are visible from here
    return is_last;
}
// The last block's sums of `count` values, each over n partials (value v's i-th at partials[i * stride + v]), in
// the order of a `threads`-thread summing block (block_sum_fixed_order: lane-strided running sums, each warp's
// butterfly, then a butterfly of the warp sums) with the values side by side, S lanes (a team) per value: team
// lane t plays the summing lanes t, t + S, ... of every summing warp, their running sums in registers. A
// butterfly round with offset >= S adds two summing lanes that one lane holds (fp addition is commutative: both
// partners of a round hold the same sum), the later rounds shuffle within the team; so every value gets the
// summing block's bits, and its loads issue together instead of one block-wide sum (two barriers) per value.
// Runs over the whole calling block (whole warps); store(v, s) is called by one lane per value.
template <int S, int kMaxThreads, class Store>
__device__ __forceinline__ void team_sums_as(const float* partials, int count, int n, int stride, int threads,
                                             Store store) {
    static_assert(S >= 1 && S <= 32 && (S & (S - 1)) == 0, "a team is a power-of-two part of a warp");
    constexpr int M = 32 / S;                                        // the summing lanes a lane plays
    constexpr int kWarps = kMaxThreads / 32;                         // the most summing warps
    // summing warps played at once: at most 16 running sums a lane (more, with their loads in flight, pass 64
    // registers), the lanes' 32 where a lane plays a whole warp
    constexpr int G = M >= 16 ? 1 : (16 / M < kWarps ? 16 / M : kWarps);
    const int sum_warps = threads / 32, t = static_cast<int>(threadIdx.x) % S, teams = blockDim.x / S;
    // one summing warp's butterfly from the lane's M running sums: the rounds within the lane, then the team's
    const auto butterfly = [](float(&p)[M]) {
        butterfly_in_lane(p);
        if constexpr (S > 1) return warp_butterfly<WarpSum, S / 2>(p[0]);
        else return p[0];
    };
    for (int v0 = 0; v0 < count; v0 += teams) {  // uniform over the block: every lane joins every shuffle
        const int v = v0 + static_cast<int>(threadIdx.x) / S;
        const bool on = v < count;
        const float* x = partials + (on ? v : 0);
        float warp_sums[kWarps] = {};
#pragma unroll
        for (int w0 = 0; w0 < kWarps; w0 += G) {  // unrolled: warp_sums' indices are constants (registers)
            float p[G][M] = {};  // stays zero past sum_warps: those warps' sums are the +0 they would be
            for (int i0 = 0; i0 < n; i0 += threads)  // the summing lanes' running sums, their loads side by side
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int m = 0; m < M; ++m) {
                        const int i = i0 + (w0 + g) * 32 + t + S * m;
                        // __ldcg: other blocks wrote these; read them from L2, never from a stale L1 line
                        if (on && w0 + g < sum_warps && i < n) p[g][m] += __ldcg(x + static_cast<size_t>(i) * stride);
                    }
#pragma unroll
            for (int g = 0; g < G; ++g) warp_sums[w0 + g] = butterfly(p[g]);
        }
        // the last butterfly, over the warp sums and zeros past them (a summing warp past sum_warps summed
        // nothing: +0), in every lane of the team, which holds every warp sum
        float f[32] = {};
#pragma unroll
        for (int k = 0; k < kWarps; ++k) f[k] = warp_sums[k];
        butterfly_in_lane(f);
        if (on && t == 0) store(v, f[0]);
    }
}
// team_sums_as with the widest team that leaves a team for every value (the values in one round, each summed by
// as many lanes as there are), 4 lanes at the least: narrower teams hold their warp sums across loops of 16 to
// 32 loads a lane, where ptxas spills them (seen in attn_gates_backward at 56 registers), and gain little (a
// 4-lane team plays two summing warps at once). threads <= kMaxThreads.
template <int kMaxThreads, class Store>
__device__ inline void block_sums_as(const float* partials, int count, int n, int stride, int threads, Store store) {
    int S = 32;
    while (S > 4 && static_cast<int>(blockDim.x) / S < count) S /= 2;
    switch (S) {
        case 32: team_sums_as<32, kMaxThreads>(partials, count, n, stride, threads, store); break;
        case 16: team_sums_as<16, kMaxThreads>(partials, count, n, stride, threads, store); break;
        case 8: team_sums_as<8, kMaxThreads>(partials, count, n, stride, threads, store); break;
        default: team_sums_as<4, kMaxThreads>(partials, count, n, stride, threads, store); break;
    }
}
// Called by every thread of every block of a producer once its block's partials are stored (block b's
// value v at scratch.partials[b * stride + v]). The block that draws the last ticket sums them in the
// order of a sum_threads(gridDim.x, kSumPartialsThreads)-thread summing block: the bits of
// sum_block_partials as a second launch (block_sums_as: the values side by side, no barrier).
__device__ inline void last_block_sum(const LastBlockSum& sum, int stride) {
    if (!last_block_done(sum.scratch.done)) return;
    const int blocks = static_cast<int>(gridDim.x);
    block_sums_as<kSumPartialsThreads>(sum.scratch.partials, sum.targets.count, blocks, stride,
                                       sum_threads(blocks, kSumPartialsThreads),
                                       [=](int v, float s) { store_sum_target(sum.targets, v, s, sum.accumulate); });
}

// What the second pass moves: `blocks` partials per value read, the targets written (and read when
// accumulating); an add per partial.
inline Work sum_block_partials_work(const char* name, const SumTargets& targets, int blocks, bool accumulate) {
    const double partials = static_cast<double>(targets.count) * blocks;
    return Work{.name = name, .flops = partials,
                .bytes_read = partials * sizeof(float) + (accumulate ? targets.bytes() : 0),
                .bytes_written = targets.bytes()};
}
// A producer's Work with its last_block_sum added: the second pass's reads, writes and adds, and the
// ticket counter's read-modify-write.
inline Work with_last_block_sum(Work producer, const LastBlockSum& last, int blocks) {
    const Work sum = sum_block_partials_work(producer.name, last.targets, blocks, last.accumulate);
    producer.flops += sum.flops;
    producer.bytes_read += sum.bytes_read + sizeof(unsigned int);
    producer.bytes_written += sum.bytes_written + sizeof(unsigned int);
    return producer;
}
// targets (+)= the per-value sums of `blocks` blocks' partials, block b's values at partials[b * stride + v].
inline void sum_block_partials(const SumTargets& targets, const float* partials, int blocks, int stride,
                               bool accumulate, cudaStream_t stream) {
    if (targets.count == 0) return;
    launch(sum_block_partials_work("sum_block_partials", targets, blocks, accumulate), sum_block_partials_kernel,
           dim3(targets.count), dim3(sum_threads(blocks, kSumPartialsThreads)), 0, stream, targets, partials, blocks,
           stride, 1.0f, accumulate);
    CUDA_CHECK_LAUNCH();
}
// out = (accumulate ? out : 0) + scale * sum(in[0:n]), one block in a fixed order.
inline void sum_fixed_order(float* out, const float* in, int n, float scale, bool accumulate, cudaStream_t stream) {
    kernel_require(n >= 0, "sum_fixed_order: n %d is negative", n);
    const SumTargets target = SumTargets().add(out);
    launch(sum_block_partials_work("sum_fixed_order", target, n, accumulate), sum_block_partials_kernel, dim3(1),
           dim3(sum_threads(n, kSumFixedOrderThreads)), 0, stream, target, in, n, 1, scale, accumulate);
    CUDA_CHECK_LAUNCH();
}

// ---- activations ----
// 1 / (1 + e^-z) with the accurate expf (the gates upstream computes with torch.sigmoid).
__device__ __forceinline__ float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }

// ---- 128-bit vectors: one 16-byte load or store moves 16/sizeof(T) elements ----
template <class T>
struct alignas(16) Pack128 {
    static constexpr int size = 16 / sizeof(T);
    T v[size];
    __device__ __forceinline__ T& operator[](int i) { return v[i]; }
    __device__ __forceinline__ const T& operator[](int i) const { return v[i]; }
    __device__ __forceinline__ static Pack128 filled(T x) {
        Pack128 p;
#pragma unroll
        for (int i = 0; i < size; ++i) p.v[i] = x;
        return p;
    }
};
// `p` must be 16-byte aligned.
template <class T>
__device__ __forceinline__ Pack128<T> load128(const T* p) {
    return *reinterpret_cast<const Pack128<T>*>(p);
}
// Streaming load: data read once, not worth keeping in cache.
template <class T>
__device__ __forceinline__ Pack128<T> load128cs(const T* p) {
    Pack128<T> r;
    *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
    return r;
}
template <class T>
__device__ __forceinline__ void store128(T* p, const Pack128<T>& v) {
    *reinterpret_cast<Pack128<T>*>(p) = v;
}
// Streaming store: written once, read by a later kernel.
template <class T>
__device__ __forceinline__ void store128cs(T* p, const Pack128<T>& v) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}
