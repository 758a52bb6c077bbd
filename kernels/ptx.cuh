// The inline-PTX primitives: their declarations, then the PTX of the GPU build. The CPU build
// defines them instead by their emulated twins (emu/ptx_twins.h), warp collectives that reproduce
// the PTX ISA's per-lane fragment layouts exactly, so a kernel that passes under emu hands the
// tensor cores the same registers.
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
#include <cstdio>

// D = A @ B + C on one 16x16x16 tile: bf16 inputs, fp32 accumulation.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]);

// Loads N (1, 2 or 4) 8x8 matrices of 16-bit elements from shared memory into fragments;
// `row` is this lane's row address (16-byte aligned).
template <int N>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[N], const void* row);
template <int N>
__device__ __forceinline__ void ldmatrix_trans(uint32_t (&r)[N], const void* row);
// Both, by one primitive: ldmatrix .x N, .trans when Trans.
template <int N, bool Trans>
__device__ __forceinline__ void ldmatrix_ptx(uint32_t (&r)[N], const void* row);

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

// ---- a warp's tile product straight from shared memory: ldmatrix x4 loads feeding mma.sync ----
// For s < S, in order: a[m] = ldmatrix<4>(a_rows[s][m]) for m < M (A fragments of 16x16 blocks),
// r[p] = ldmatrix<4>(b_rows[s][p]) for p < N/2, with b[2p] = {r[p][0], r[p][1]} and
// b[2p+1] = {r[p][2], r[p][3]} (B fragments of two 16x8 blocks: the rows read are B's columns, so
// B^T lies row-major in shared memory, as in a "TN" GEMM), then acc[m][n] = a[m] @ b[n] + acc[m][n]
// for every m < M, n < N. a_rows[s][m] and b_rows[s][p] are this lane's row addresses for each load.
// On the GPU this is exactly that loop. Under emu it is one meeting of the warp instead of
// S (M + N/2 + M N) collectives (each costs a fiber switch per lane), and the products run on
// tiles unpacked straight from shared memory, which the CPU can vectorize.
template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k16_bf16_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
                                                            const void* const (&b_rows)[S][N / 2]);

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

template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k16_bf16_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
                                                            const void* const (&b_rows)[S][N / 2]) {
    static_assert(N % 2 == 0, "B fragments come in pairs of n-tiles");
#pragma unroll
    for (int s = 0; s < S; ++s) {
        uint32_t a[M][4], r[N / 2][4];
#pragma unroll
        for (int m = 0; m < M; ++m) ldmatrix<4>(a[m], a_rows[s][m]);
#pragma unroll
        for (int p = 0; p < N / 2; ++p) ldmatrix<4>(r[p], b_rows[s][p]);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
            for (int n = 0; n < N; ++n) {
                const uint32_t b[2] = {r[n / 2][2 * (n % 2)], r[n / 2][2 * (n % 2) + 1]};
                mma_m16n8k16_bf16(acc[m][n], a[m], b, acc[m][n]);
            }
    }
}

#else
#include "../emu/ptx_twins.h"
#endif
