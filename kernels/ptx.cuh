// The inline-PTX primitives, each with its emulated twin for the CPU build. The twins are
// warp collectives that reproduce the PTX ISA's per-lane fragment layouts exactly, so a
// kernel that passes under emu hands the tensor cores the same registers.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16" with .bf16), for lane l,
// g = l / 4, t = l % 4; each 32-bit register holds two bf16, the lower column/row first:
//   A (16x16, row-major): a0 = A[g][2t..2t+1]    a1 = A[g+8][2t..2t+1]
//                         a2 = A[g][2t+8..2t+9]  a3 = A[g+8][2t+8..2t+9]
//   B (16x8, "col"):      b0 = B[2t..2t+1][g]    b1 = B[2t+8..2t+9][g]
//   C, D (16x8, fp32):    c0 = C[g][2t]  c1 = C[g][2t+1]  c2 = C[g+8][2t]  c3 = C[g+8][2t+1]
// ldmatrix .m8n8 .b16 (x1/x2/x4): lanes 8i..8i+7 give the row addresses of matrix i;
//   lane l receives r[i] = M_i[l/4][2(l%4)..2(l%4)+1], or with .trans M_i[2(l%4)..2(l%4)+1][l/4].
#pragma once
#include "platform.cuh"

#include <cstdint>

// D = A @ B + C on one 16x16x16 tile: bf16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]);

// Loads N (1, 2 or 4) 8x8 matrices of 16-bit elements from shared memory into fragments;
// `row` is this lane's row address (16-byte aligned).
template <int N>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* row);
template <int N>
__device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[N], const void* row);

#ifdef __CUDACC__

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix_ptx(uint32_t (&r)[N], const void* row) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    if constexpr (N == 1 && !Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
    else if constexpr (N == 1 && Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
    else if constexpr (N == 2 && !Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
    else if constexpr (N == 2 && Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                     : "=r"(r[0]), "=r"(r[1])
                     : "r"(addr));
    else if constexpr (N == 4 && !Trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
}

#else  // emulated twins

namespace emu {
inline float bf16_lo(uint32_t r) { return __uint_as_float(r << 16); }
inline float bf16_hi(uint32_t r) { return __uint_as_float(r & 0xffff0000u); }

struct MmaIn {
    uint32_t a[4], b[2];
    float c[4];
};
static_assert(sizeof(MmaIn) <= kSlotBytes);

inline void mma_m16n8k16_bf16_combine(const unsigned char* in, unsigned char* out, unsigned) {
    float A[16][16], B[16][8], C[16][8];
    for (int l = 0; l < 32; ++l) {
        MmaIn f;
        std::memcpy(&f, in + l * kSlotBytes, sizeof f);
        const int g = l / 4, t = l % 4;
        const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int i = 0; i < 4; ++i) {
            A[rows[i]][cols[i]] = bf16_lo(f.a[i]);
            A[rows[i]][cols[i] + 1] = bf16_hi(f.a[i]);
        }
        for (int i = 0; i < 2; ++i) {
            B[2 * t + 8 * i][g] = bf16_lo(f.b[i]);
            B[2 * t + 8 * i + 1][g] = bf16_hi(f.b[i]);
        }
        C[g][2 * t] = f.c[0];
        C[g][2 * t + 1] = f.c[1];
        C[g + 8][2 * t] = f.c[2];
        C[g + 8][2 * t + 1] = f.c[3];
    }
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, t = l % 4;
        const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
        float d[4];
        for (int i = 0; i < 4; ++i) {
            float acc = C[rows[i]][cols[i]];
            for (int k = 0; k < 16; ++k) acc += A[rows[i]][k] * B[k][cols[i]];  // products of bf16 are exact in fp32
            d[i] = acc;
        }
        std::memcpy(out + l * kSlotBytes, d, sizeof d);
    }
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

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    emu::MmaIn in;
    std::memcpy(in.a, a, sizeof in.a);
    std::memcpy(in.b, b, sizeof in.b);
    std::memcpy(in.c, c, sizeof in.c);
    emu::warp_collective("mma.sync.m16n8k16", 0xffffffffu, &in, sizeof in, d, sizeof d,
                         emu::mma_m16n8k16_bf16_combine);
}

template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix_ptx(uint32_t (&r)[N], const void* row) {
    static_assert(N == 1 || N == 2 || N == 4, "ldmatrix loads 1, 2 or 4 matrices");
    emu::warp_collective(Trans ? "ldmatrix.trans" : "ldmatrix", 0xffffffffu, &row, sizeof row, r, sizeof r,
                         emu::ldmatrix_combine<N, Trans>);
}

#endif

template <int N>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* row) {
    ldmatrix_ptx<N, false>(r, row);
}
template <int N>
__device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[N], const void* row) {
    ldmatrix_ptx<N, true>(r, row);
}

// ---- cp.async: 16-byte global -> shared copies that complete asynchronously ----
// A thread's copies join a group at cp_async_commit(); cp_async_wait<N>() blocks until at most
// the N most recently committed groups of this thread are still in flight. A copy's bytes may
// land any time before that wait and are visible to other threads only after a barrier that
// follows it. With `fill` false nothing is read and the 16 bytes become zeros (src-size 0),
// which is how tiles load rows that lie outside a tensor.
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill);
__device__ __forceinline__ void cp_async_commit();
template <int N>
__device__ __forceinline__ void cp_async_wait();

#ifdef __CUDACC__

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const size_t src = __cvta_generic_to_global(gmem_src);
    // .cg: the tiles are reused from shared memory, not from L1
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#else  // emulated twins

#include <cstdlib>
#include <unordered_map>
#include <vector>

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
    static thread_local std::unordered_map<const ThreadState*, CpAsyncQueue> queues;
    CpAsyncQueue& q = queues[t_thread];
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
}  // namespace emu

namespace emu {
// A per-worker coin seeded by EMU_RANDOM_ORDER; false always when the switch is off.
inline bool cp_async_complete_early() {
    static const uint64_t seed = [] {
        const char* v = std::getenv("EMU_RANDOM_ORDER");
        return v ? std::strtoull(v, nullptr, 10) : 0ull;
    }();
    if (!seed) return false;
    static thread_local uint64_t state = seed * 0x9e3779b97f4a7c15ull | 1;
    state ^= state << 13;  // xorshift64
    state ^= state >> 7;
    state ^= state << 17;
    return state >> 63;
}
}  // namespace emu

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
    emu::CpAsyncQueue& q = emu::cp_async_queue();
    if (emu::cp_async_complete_early()) {
        if (fill) std::memcpy(smem_dst, gmem_src, 16);
        else std::memset(smem_dst, 0, 16);
        return;
    }
    q.copies.push_back({smem_dst, gmem_src, fill});
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

#endif
