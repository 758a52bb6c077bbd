// The CPU build's definitions of kernels/ptx.cuh's primitives: each is a warp collective (or, for
// cp.async, a per-thread queue) that reproduces what the PTX instruction does, and checks what the
// hardware requires of its operands (alignment, address space) so that a violation stops the
// kernel naming the calling thread, as the fault would on the GPU. Included by kernels/ptx.cuh
// after its declarations; the fragment layouts are described there.
#pragma once
#include "cuda_emu.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace emu {
inline float bf16_lo(uint32_t r) { return __uint_as_float(r << 16); }
inline float bf16_hi(uint32_t r) { return __uint_as_float(r & 0xffff0000u); }

struct MmaIn {
    uint32_t a[4], b[2];
    float c[4];
};
static_assert(sizeof(MmaIn) <= kSlotBytes);

// D (+)= A B over 16x8 tiles, k ascending from the accumulator (defined with the tile products below).
template <int M, int N, int K = 16>
void mma_tiles_accumulate(float (&D)[M][N][16][8], const float (&A)[M][16][K], const float (&B)[N][K][8]);

// ---- e4m3 (ptx.cuh): codes from fp32 as cvt.rn.satfinite does it, and their values ----
inline uint8_t e4m3_rn_satfinite(float v) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    const uint32_t mag = bits & 0x7fffffffu, sign = (bits >> 24) & 0x80u;
    if (mag > 0x7f800000u) return 0x7f;  // NaN: the canonical code, sign dropped
    uint32_t code;
    if (mag < 0x3c800000u) {  // below 2^-6, the smallest normal: a count of 2^-9 units, exact, rounded to even
        code = static_cast<uint32_t>(std::nearbyint(__uint_as_float(mag) * 512.0f));  // 8 units: the smallest normal's code
    } else {
        // keep 3 of the 23 mantissa bits, to nearest even; the carry runs into the exponent; rebias 127 -> 7
        const uint32_t kept = (mag + 0x7ffffu + ((mag >> 20) & 1u)) >> 20;
        code = kept - ((127u - 7u) << 3);
    }
    return static_cast<uint8_t>(sign | std::min<uint32_t>(code, 0x7eu));  // past 448 (inf too): satfinite's 448
}
// The value of an e4m3 code, exactly (every one is an fp32).
inline float e4m3_value(uint8_t c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const float mag = e == 15 && m == 7 ? __uint_as_float(0x7fc00000u)
                      : e == 0          ? std::ldexp(float(m), -9)
                                        : std::ldexp(float(8 + m), e - 10);
    return c & 0x80 ? -mag : mag;
}
// The 256 values, for the tile products' decoding.
inline const float* e4m3_values() {
    static const auto table = [] {
        std::array<float, 256> t{};
        for (int c = 0; c < 256; ++c) t[c] = e4m3_value(static_cast<uint8_t>(c));
        return t;
    }();
    return table.data();
}

inline void mma_m16n8k16_bf16_combine(const unsigned char* in, unsigned char* out, unsigned) {
    float A[1][16][16];
    alignas(16) float B[1][16][8], D[1][1][16][8];
    for (int l = 0; l < 32; ++l) {
        MmaIn f;
        std::memcpy(&f, in + l * kSlotBytes, sizeof f);
        const int g = l / 4, t = l % 4;
        const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int i = 0; i < 4; ++i) {
            A[0][rows[i]][cols[i]] = bf16_lo(f.a[i]);
            A[0][rows[i]][cols[i] + 1] = bf16_hi(f.a[i]);
        }
        for (int i = 0; i < 2; ++i) {
            B[0][2 * t + 8 * i][g] = bf16_lo(f.b[i]);
            B[0][2 * t + 8 * i + 1][g] = bf16_hi(f.b[i]);
        }
        D[0][0][g][2 * t] = f.c[0];
        D[0][0][g][2 * t + 1] = f.c[1];
        D[0][0][g + 8][2 * t] = f.c[2];
        D[0][0][g + 8][2 * t + 1] = f.c[3];
    }
    mma_tiles_accumulate<1, 1>(D, A, B);  // products of bf16 are exact in fp32
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const float d[4] = {D[0][0][g][2 * t], D[0][0][g][2 * t + 1], D[0][0][g + 8][2 * t], D[0][0][g + 8][2 * t + 1]};
        std::memcpy(out + l * kSlotBytes, d, sizeof d);
    }
}

// mma.sync m16n8k32 .e4m3: the k32 fragments of ptx.cuh decoded, then 32 products (exact in fp32: two
// 4-bit significands) added in k order from the accumulator, as m16n8k16's twin adds its 16.
inline void mma_m16n8k32_e4m3_combine(const unsigned char* in, unsigned char* out, unsigned) {
    float A[1][16][32];
    alignas(16) float B[1][32][8], D[1][1][16][8];
    const float* value = e4m3_values();
    for (int l = 0; l < 32; ++l) {
        MmaIn f;
        std::memcpy(&f, in + l * kSlotBytes, sizeof f);
        const int g = l / 4, t = l % 4;
        const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {4 * t, 4 * t, 4 * t + 16, 4 * t + 16};
        for (int i = 0; i < 4; ++i)
            for (int e = 0; e < 4; ++e) A[0][rows[i]][cols[i] + e] = value[(f.a[i] >> (8 * e)) & 0xff];
        for (int i = 0; i < 2; ++i)
            for (int e = 0; e < 4; ++e) B[0][4 * t + 16 * i + e][g] = value[(f.b[i] >> (8 * e)) & 0xff];
        D[0][0][g][2 * t] = f.c[0];
        D[0][0][g][2 * t + 1] = f.c[1];
        D[0][0][g + 8][2 * t] = f.c[2];
        D[0][0][g + 8][2 * t + 1] = f.c[3];
    }
    mma_tiles_accumulate<1, 1, 32>(D, A, B);
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const float d[4] = {D[0][0][g][2 * t], D[0][0][g][2 * t + 1], D[0][0][g + 8][2 * t], D[0][0][g + 8][2 * t + 1]};
        std::memcpy(out + l * kSlotBytes, d, sizeof d);
    }
}

// What the hardware requires of a shared-memory operand the twins are handed: 16-byte aligned, and all
// `bytes` of it inside one of the block's shared objects (static __shared__ or the dynamic buffer).
// A violation stops the kernel naming the calling thread, as the fault would on the GPU.
[[noreturn, gnu::noinline, gnu::cold]] inline void fail_access(const char* what, const void* p, const char* why) {
    char msg[200];
    std::snprintf(msg, sizeof msg, "%s: address %p %s", what, p, why);
    fail_thread(msg);
}
inline void check_shared_operand(const char* what, const void* p, size_t bytes) {
    if (reinterpret_cast<uintptr_t>(p) % 16) fail_access(what, p, "is not 16-byte aligned");
    if (!in_block_shared(p, bytes)) fail_access(what, p, "is not inside one of the block's shared memory objects");
}

template <int N, bool Trans>
void ldmatrix_combine(const unsigned char* in, unsigned char* out, unsigned) {
    for (int l = 0; l < 32; ++l) {
        uint32_t r[N];
        for (int i = 0; i < N; ++i) {
            auto row_addr = [&](int row) {
                const unsigned char* p;
                std::memcpy(&p, in + (8 * i + row) * kSlotBytes, sizeof p);
                return reinterpret_cast<const uint16_t*>(p);
            };
            uint16_t lo, hi;
            if (Trans) {
                lo = row_addr(2 * (l % 4))[l / 4];
                hi = row_addr(2 * (l % 4) + 1)[l / 4];
            } else {
                lo = row_addr(l / 4)[2 * (l % 4)];
                hi = row_addr(l / 4)[2 * (l % 4) + 1];
            }
            r[i] = uint32_t(lo) | uint32_t(hi) << 16;
        }
        std::memcpy(out + l * kSlotBytes, r, sizeof r);
    }
}
}  // namespace emu

// The accurate tanh: the hardware's tanh.approx.f32 is within about 2^-11 relative of it.
__device__ __forceinline__ float tanh_approx(float x) { return std::tanh(x); }

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    emu::MmaIn in;
    std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(in.b, b, sizeof in.b);
    std::memcpy(in.c, c, sizeof in.c);
    emu::warp_collective("mma.sync.m16n8k16", 0xffffffffu, &in, sizeof in, d, sizeof d,
                         emu::mma_m16n8k16_bf16_combine);
}

__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
    return static_cast<uint16_t>(emu::e4m3_rn_satfinite(lo) | emu::e4m3_rn_satfinite(hi) << 8);
}

__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    emu::MmaIn in;
    std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(in.b, b, sizeof in.b);
    std::memcpy(in.c, c, sizeof in.c);
    emu::warp_collective("mma.sync.m16n8k32.e4m3", 0xffffffffu, &in, sizeof in, d, sizeof d,
                         emu::mma_m16n8k32_e4m3_combine);
}

template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix_ptx(uint32_t (&r)[N], const void* row) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
    // Lanes past the N matrices' 8 N row addresses give none; their operand is unused.
    if (emu::lane_id() < 8 * N) emu::check_shared_operand("ldmatrix row", row, 16);
    emu::warp_collective(Trans ? "ldmatrix.trans" : "ldmatrix", 0xffffffffu, &row, sizeof row, r, sizeof r,
                         emu::ldmatrix_combine<N, Trans>);
}

namespace emu {
// The latest completion the ISA allows: copies are queued per thread and performed (source
// read, destination written) only when a wait retires their group. A kernel that reads a
// tile before the wait that covers it therefore sees stale shared memory under emu. With
// EMU_RANDOM_ORDER set, each copy instead completes either at once or at its wait, at random:
// the early ones expose a copy issued into a buffer other threads are still reading.
struct CpAsyncCopy {
    void* dst;
    const void* src;
    bool fill;
};
// A worker thread's per-fiber states of one PTX twin; `id` is unique to each map ever made, so that a
// fiber's cache never points into a map of a thread that has ended.
inline uint64_t next_twin_states_id() {
    static std::atomic<uint64_t> next{1};
    return next++;
}
template <class State>
struct TwinStates {
    std::unordered_map<const ThreadState*, State> map;  // its entries stay put as it grows
    uint64_t id = next_twin_states_id();
};
// This fiber's entry, through its cache.
template <class State>
inline State& twin_state(TwinStates<State>& states, ThreadState::TwinCache& cache) {
    if (cache.cached_by != t_thread || cache.owner != states.id) {
        cache.entry = &states.map[t_thread];
        cache.cached_by = t_thread;
        cache.owner = states.id;
    }
    return *static_cast<State*>(cache.entry);
}
struct CpAsyncQueue {
    const BlockState* block = nullptr;  // which block's thread the queue belongs to
    uint3 block_idx{};
    const unsigned char* block_smem = nullptr;
    std::vector<CpAsyncCopy> copies;  // issue order; the committed ones come first
    std::vector<size_t> group_ends;   // per committed group, oldest first: its end in `copies`
};
inline CpAsyncQueue& cp_async_queue() {
    // Fibers of one block share a worker thread, so a per-worker map keyed by fiber is private
    // to each CUDA thread. A queue left by an earlier block whose fiber this one reuses is
    // dropped: those copies targeted a block that no longer exists.
    static thread_local TwinStates<CpAsyncQueue> queues;
    CpAsyncQueue& q = twin_state(queues, t_thread->cp_async_cache);
    const BlockState* b = t_block;
    if (q.block != b || q.block_idx.x != b->block_idx.x || q.block_idx.y != b->block_idx.y ||
        q.block_idx.z != b->block_idx.z || q.block_smem != b->dyn_smem) {
        q.copies.clear();
        q.group_ends.clear();
        q.block = b;
        q.block_idx = b->block_idx;
        q.block_smem = b->dyn_smem;
    }
    return q;
}
// Completes the `groups` oldest committed groups.
inline void cp_async_retire(CpAsyncQueue& q, size_t groups) {
    const size_t end = q.group_ends[groups - 1];
    for (size_t i = 0; i < end; ++i) {
        const CpAsyncCopy& c = q.copies[i];
        if (c.fill) std::memcpy(c.dst, c.src, 16);
        else std::memset(c.dst, 0, 16);
    }
    q.copies.erase(q.copies.begin(), q.copies.begin() + static_cast<std::ptrdiff_t>(end));
    q.group_ends.erase(q.group_ends.begin(), q.group_ends.begin() + static_cast<std::ptrdiff_t>(groups));
    for (size_t& e : q.group_ends) e -= end;
}

// A per-worker coin seeded by EMU_RANDOM_ORDER; false always when the switch is off.
inline bool cp_async_complete_early() {
    static const uint64_t seed = random_order_seed();
    if (!seed) return false;
    static thread_local uint64_t state = seed * 0x9e3779b97f4a7c15ull | 1;
    state ^= state << 13;  // xorshift64
    state ^= state >> 7;
    state ^= state << 17;
    return state >> 63;
}

// cp.async.cg.shared.global: the destination in the block's shared memory, the source (read only when
// filling) 16-byte aligned and inside one device allocation.
inline void check_cp_async(void* smem_dst, const void* gmem_src, bool fill) {
    check_shared_operand("cp.async destination", smem_dst, 16);
    if (!fill || in_device_allocation(gmem_src, 16)) {
        if (fill && reinterpret_cast<uintptr_t>(gmem_src) % 16) fail_access("cp.async source", gmem_src, "is not 16-byte aligned");
        return;
    }
    fail_access("cp.async source", gmem_src,
                in_block_shared(gmem_src, 16) ? "lies in shared memory: cp.async copies global memory to shared"
                                              : "is not inside one device allocation (cudaMalloc) for all 16 bytes");
}
}  // namespace emu

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
    emu::check_cp_async(smem_dst, gmem_src, fill);
    emu::CpAsyncQueue& q = emu::cp_async_queue();
    if (emu::cp_async_complete_early()) {
        if (fill) std::memcpy(smem_dst, gmem_src, 16);
        else std::memset(smem_dst, 0, 16);
        return;
    }
    q.copies.push_back({smem_dst, gmem_src, fill});
}
// Nothing to bring anywhere on a CPU; the address must be global memory, as the PTX ISA's .global requires.
__device__ __forceinline__ void prefetch_l2(const void* p) {
    if (!emu::in_device_allocation(p, 1))
        emu::fail_access("prefetch.global.L2 address", p, "is not inside a device allocation (cudaMalloc)");
}
__device__ __forceinline__ void cp_async_commit() {
    emu::CpAsyncQueue& q = emu::cp_async_queue();
    q.group_ends.push_back(q.copies.size());
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    static_assert(N >= 0, "cp.async.wait_group takes a non-negative group count");
    emu::CpAsyncQueue& q = emu::cp_async_queue();
    if (q.group_ends.size() > static_cast<size_t>(N)) emu::cp_async_retire(q, q.group_ends.size() - N);
}

namespace emu {
inline float bf16_bits_value(uint16_t h) { return __uint_as_float(uint32_t(h) << 16); }

// Each lane deposits pointers to its own arrays; the last lane to arrive reads every lane's
// addresses and accumulators and writes the accumulators back (the other lanes are parked at
// the collective, so their arrays are not in use).
struct MmaFromSmemIn {
    const void* const* a_rows;
    const void* const* b_rows;
    float* acc;
    int s, m, n;
};

// D[m][n] += A[m] @ B[n] for 16x16 A tiles and 16x8 B and D tiles (B, D rows of 8 columns). Each
// output adds its 16 products in k order, as the single mma twin does (products of bf16 are exact in
// fp32), so both versions give the single twin's bits. A row of every n-tile at once: one broadcast
// of A feeds 2N (SSE) or N (AVX2) independent chains.
template <int M, int N, int K>
void mma_tiles_accumulate_sse(float (&D)[M][N][16][8], const float (&A)[M][16][K], const float (&B)[N][K][8]) {
    typedef float Quad __attribute__((vector_size(16)));  // 4 of a tile row's 8 columns
    for (int m = 0; m < M; ++m)
        for (int i = 0; i < 16; ++i) {
            Quad d[N][2];
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) std::memcpy(d[n], D[m][n][i], sizeof d[n]);
#pragma GCC unroll 16
            for (int k = 0; k < K; ++k) {
                const float a = A[m][i][k];
#pragma GCC unroll 8
                for (int n = 0; n < N; ++n) {
                    Quad b[2];
                    std::memcpy(b, B[n][k], sizeof b);
                    d[n][0] += a * b[0];
                    d[n][1] += a * b[1];
                }
            }
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) std::memcpy(D[m][n][i], d[n], sizeof d[n]);
        }
}
template <int M, int N, int K>
__attribute__((target("avx2"))) void mma_tiles_accumulate_avx2(float (&D)[M][N][16][8], const float (&A)[M][16][K],
                                                                const float (&B)[N][K][8]) {
    typedef float Oct __attribute__((vector_size(32)));  // a tile row's 8 columns
    for (int m = 0; m < M; ++m)
        for (int i = 0; i < 16; ++i) {
            Oct d[N];
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) std::memcpy(&d[n], D[m][n][i], sizeof d[n]);
#pragma GCC unroll 16
            for (int k = 0; k < K; ++k) {
                const float a = A[m][i][k];
#pragma GCC unroll 8
                for (int n = 0; n < N; ++n) {
                    Oct b;
                    std::memcpy(&b, B[n][k], sizeof b);
                    d[n] += a * b;
                }
            }
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) std::memcpy(D[m][n][i], &d[n], sizeof d[n]);
        }
}

template <int M, int N, int K>
void mma_tiles_accumulate(float (&D)[M][N][16][8], const float (&A)[M][16][K], const float (&B)[N][K][8]) {
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2) mma_tiles_accumulate_avx2<M, N, K>(D, A, B);
    else mma_tiles_accumulate_sse<M, N, K>(D, A, B);
}

// The tile product of mma_m16n8k16_bf16_from_smem (E4m3 false: 16-byte chunks of 8 bf16, k-steps of
// 16) or mma_m16n8k32_e4m3_from_smem (true: chunks of 16 e4m3, k-steps of 32).
template <int S, int M, int N, bool E4m3 = false>
void mma_m16n8k16_bf16_from_smem_combine(const unsigned char* in, unsigned char*, unsigned) {
    constexpr int KE = E4m3 ? 16 : 8, K = 2 * KE;  // k's per 16-byte chunk, per k-step
    const float* e4m3 = e4m3_values();
    MmaFromSmemIn lane[32];
    alignas(16) float D[M][N][16][8];  // D[m][n] is the 16x8 accumulator tile (m, n)
    for (int l = 0; l < 32; ++l) {
        std::memcpy(&lane[l], in + l * kSlotBytes, sizeof lane[l]);
        if (lane[l].s != S || lane[l].m != M || lane[l].n != N) {
            // fails the kernel (not the process), as a divergent wgmma does
            fail_thread(E4m3 ? "divergent warp: lanes met at mma_m16n8k32_e4m3_from_smem with different shapes"
                             : "divergent warp: lanes met at mma_m16n8k16_bf16_from_smem with different shapes");
        }
        const int g = l / 4, t = l % 4;
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) {
                const float* c = lane[l].acc + 4 * (m * N + n);
                D[m][n][g][2 * t] = c[0];
                D[m][n][g][2 * t + 1] = c[1];
                D[m][n][g + 8][2 * t] = c[2];
                D[m][n][g + 8][2 * t + 1] = c[3];
            }
    }
    for (int s = 0; s < S; ++s) {
        // Matrix i of an x4 load is the 8 rows whose addresses lanes 8i..8i+7 give. In the A fragment
        // it is the 8x8 block (i % 2, i / 2); in the B fragments of pair p it holds columns j of n-tile
        // 2p + i / 2, rows 8 (i % 2) + e of B, kept here as B[n][k][8 columns].
        float A[M][16][K];
        alignas(16) float B[N][K][8];
        // one 16-byte chunk's KE elements
        const auto chunk = [&](float* dst, size_t step, const void* p) {
            if constexpr (E4m3) {
                const auto* row = static_cast<const uint8_t*>(p);
#pragma GCC unroll 16
                for (int e = 0; e < KE; ++e) dst[e * step] = e4m3[row[e]];
            } else {
                const auto* row = static_cast<const uint16_t*>(p);
#pragma GCC unroll 8
                for (int e = 0; e < KE; ++e) dst[e * step] = bf16_bits_value(row[e]);
            }
        };
        for (int i = 0; i < 4; ++i)
            for (int j = 0; j < 8; ++j) {
                const MmaFromSmemIn& src = lane[8 * i + j];
                for (int m = 0; m < M; ++m) chunk(&A[m][8 * (i % 2) + j][KE * (i / 2)], 1, src.a_rows[s * M + m]);
                for (int p = 0; p < N / 2; ++p) chunk(&B[2 * p + i / 2][KE * (i % 2)][j], 8, src.b_rows[s * (N / 2) + p]);
            }
        mma_tiles_accumulate<M, N, K>(D, A, B);
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
            for (int n = 0; n < N; ++n) {
                float* c = lane[l].acc + 4 * (m * N + n);
                c[0] = D[m][n][g][2 * t];
                c[1] = D[m][n][g][2 * t + 1];
                c[2] = D[m][n][g + 8][2 * t];
                c[3] = D[m][n][g + 8][2 * t + 1];
            }
    }
}
}  // namespace emu

template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k16_bf16_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
                                                            const void* const (&b_rows)[S][N / 2]) {
    static_assert(N % 2 == 0, "B fragments come in pairs of n-tiles");
    for (int s = 0; s < S; ++s) {
        for (int m = 0; m < M; ++m) emu::check_shared_operand("ldmatrix row", a_rows[s][m], 16);
        for (int p = 0; p < N / 2; ++p) emu::check_shared_operand("ldmatrix row", b_rows[s][p], 16);
    }
    const emu::MmaFromSmemIn in{&a_rows[0][0], &b_rows[0][0], &acc[0][0][0], S, M, N};
    std::memcpy(emu::collective_slot(), &in, sizeof in);
    emu::collective_arrive("mma_m16n8k16_bf16_from_smem", 0xffffffffu, emu::mma_m16n8k16_bf16_from_smem_combine<S, M, N>);
}

template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k32_e4m3_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
                                                            const void* const (&b_rows)[S][N / 2]) {
    static_assert(N % 2 == 0, "B fragments come in pairs of n-tiles");
    for (int s = 0; s < S; ++s) {
        for (int m = 0; m < M; ++m) emu::check_shared_operand("ldmatrix row", a_rows[s][m], 16);
        for (int p = 0; p < N / 2; ++p) emu::check_shared_operand("ldmatrix row", b_rows[s][p], 16);
    }
    const emu::MmaFromSmemIn in{&a_rows[0][0], &b_rows[0][0], &acc[0][0][0], S, M, N};
    std::memcpy(emu::collective_slot(), &in, sizeof in);
    emu::collective_arrive("mma_m16n8k32_e4m3_from_smem", 0xffffffffu,
                           emu::mma_m16n8k16_bf16_from_smem_combine<S, M, N, true>);
}

#include "hopper_twins.h"
