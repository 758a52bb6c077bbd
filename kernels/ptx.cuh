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

#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

// tanh(x) by the hardware's approximation, tanh.approx.f32 (sm_75+; what nvcc's --use_fast_math makes
// of tanhf, so what record 80's NVRTC cross-entropy kernel computes): maximum relative error about
// 2^-11 (PTX ISA). emu's twin is the accurate std::tanh, so CPU and GPU builds differ by up to that.
__device__ __forceinline__ float tanh_approx(float x);

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
// prefetch.global.L2: a hint that brings the line holding p (global memory, which emu checks) into L2; it
// returns nothing and nothing waits for it.
__device__ __forceinline__ void prefetch_l2(const void* p);
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

// ---- FP8: e4m3 ("e4m3fn": 1.4.3, bias 7, no infinities, NaN = S.1111.111, largest finite 448) ----
// cvt.rn.satfinite.e4m3x2.f32 (sm_89+): two fp32 to e4m3 codes, `lo`'s in the low byte; rounded to
// nearest even (subnormals, multiples of 2^-9, included); magnitudes past 448, infinities included, give
// +-448; NaN gives 0x7F (the canonical NaN, its sign dropped, as cuda_fp8.hpp's host path models the
// instruction).
__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi);
// Four values to four codes, v0's in the low byte (two cvt_e4m3x2).
__device__ __forceinline__ uint32_t cvt_e4m3x4(float v0, float v1, float v2, float v3) {
    return uint32_t(cvt_e4m3x2(v0, v1)) | uint32_t(cvt_e4m3x2(v2, v3)) << 16;
}

// D = A @ B + C on one 16x8x32 tile: e4m3 inputs, fp32 accumulation (mma.sync m16n8k32 .e4m3, sm_89+).
// Four e4m3 per 32-bit register, the lowest k in the low byte (PTX ISA, "Matrix fragments for
// mma.m16n8k32" with 8-bit types), g = lane / 4, t = lane % 4:
//   A (16x32, row-major): a0 = A[g][4t..4t+3]     a1 = A[g+8][4t..4t+3]
//                         a2 = A[g][4t+16..4t+19] a3 = A[g+8][4t+16..4t+19]
//   B (32x8, "col"):      b0 = B[4t..4t+3][g]     b1 = B[4t+16..4t+19][g]
//   C, D (16x8, fp32):    as m16n8k16's.
// These are m16n8k16's bf16 layouts with 16-bit pairs read as byte quads: an ldmatrix of rows of 16
// e4m3 (one 16-byte chunk) gives lane l row l/4's bytes 4(l%4)..4(l%4)+3, so a tile's fragments load by
// ldmatrix exactly as bf16 ones do, with a 16-byte chunk holding 16 k's instead of 8.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]);
// mma_m16n8k16_bf16_from_smem's product on e4m3 tiles: for s < S, ldmatrix x4 loads of the A rows and
// B rows (each row address now 16 k's of e4m3) feed acc[m][n] = a[m] @ b[n] + acc[m][n] with
// mma_m16n8k32_e4m3, every m < M, n < N. On the GPU exactly that loop; under emu one meeting of the warp.
template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k32_e4m3_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
                                                            const void* const (&b_rows)[S][N / 2]);

// ---- Hopper (sm_90a): wgmma, shared-memory matrix descriptors, mbarrier, TMA ----
// wgmma.mma_async m64nNk16, bf16 x bf16 -> fp32: a warpgroup (4 aligned warps, 128 threads) computes
// D[64][N] = A[64][16] B[16][N] (+ D when scale_d). Warp w of the group (w = warp index % 4) owns rows
// 16w..16w+15; lane l, g = l / 4, t = l % 4, n-chunk i < N/8:
//   D (fp32, N/2 registers): d[4i]   = D[16w+g][8i+2t]    d[4i+1] = D[16w+g][8i+2t+1]
//                            d[4i+2] = D[16w+g+8][8i+2t]  d[4i+3] = D[16w+g+8][8i+2t+1]
//   A from registers (4 x 32 bits, two bf16 each, lower column first), mma.m16n8k16's A on the warp's rows:
//     a0 = A[16w+g][2t..2t+1]  a1 = A[16w+g+8][2t..2t+1]  a2 = A[16w+g][2t+8..2t+9]  a3 = A[16w+g+8][2t+8..2t+9]
// A (64 x 16) and B (N x 16, i.e. B^T: both "K-major", k contiguous) from shared memory through a
// 64-bit matrix descriptor: bits 0-13 start address >> 4, 16-29 leading byte offset (LBO) >> 4,
// 32-45 stride byte offset (SBO) >> 4, 49-51 base offset (0 here), 62-63 swizzle (0 none, 1 128B,
// 2 64B, 3 32B). Element (r, k) of a K-major operand, r its row (m or n), lies at byte
//   none:        start + (r/8) SBO + (r%8) 16 + (k/8) LBO + (k%8) 2   (8x8 core matrices of 16-byte rows)
//   swizzle S:   swizzled(start + (r/8) SBO + (r%8) S + 2k)           (S = 32, 64, 128; LBO unused)
// where swizzled(a) XORs the 16-byte chunk bits of the address (4.., log2(S/16) of them) with the bits
// from 7 up (swizzle_address below; with 128-byte rows, chunk c of row r lands at c ^ (r % 8)); the
// pattern repeats every 8 S bytes. TMA writes the same pattern for the tensor map's swizzle, so a tile
// loaded by TMA with S-byte swizzle (box rows of S bytes) is read with SBO = 8 S, and k-steps within
// the row advance the start address by 32 bytes. A swizzled operand's start must lie in the first 128
// bytes of a pattern repeat (the descriptor's base offset stays 0).
// Asynchrony: wgmma_fence() before the first wgmma of a batch (and after touching its registers);
// wgmma_commit() closes a group of issued wgmmas; wgmma_wait<N>() blocks until at most N groups are in
// flight. An accumulator's registers are undefined until the wait that retires its last wgmma: under
// emu WgmmaAcc's element access fails on such a read, and the registers hold a NaN pattern meanwhile.
enum class Swizzle { none, b32, b64, b128 };
// Bytes in one swizzled row (the pattern repeats every 8 rows); 16 without swizzle.
__host__ __device__ constexpr uint32_t swizzle_bytes(Swizzle s) {
    return s == Swizzle::b128 ? 128u : s == Swizzle::b64 ? 64u : s == Swizzle::b32 ? 32u : 16u;
}
// The shared-memory byte address where the 16-byte chunk addressed by `addr` is stored under swizzle s.
__host__ __device__ constexpr uint32_t swizzle_address(uint32_t addr, Swizzle s) {
    return addr ^ (((addr >> 7) & (swizzle_bytes(s) / 16 - 1)) << 4);
}
// The shared-memory address of p, as descriptors and the hardware's swizzle see it. Under emu: its
// offset in the block's dynamic shared memory (operands addressed this way must lie there).
__device__ __forceinline__ uint32_t smem_address(const void* p);
__device__ __forceinline__ uint64_t make_smem_desc(const void* start, uint32_t leading_bytes, uint32_t stride_bytes,
                                                   Swizzle s) {
    const uint64_t field = (uint64_t(s == Swizzle::b128 ? 1 : s == Swizzle::b64 ? 2 : s == Swizzle::b32 ? 3 : 0)) << 62;
    return field | uint64_t((smem_address(start) & 0x3ffff) >> 4) | uint64_t((leading_bytes >> 4) & 0x3fff) << 16 |
           uint64_t((stride_bytes >> 4) & 0x3fff) << 32;
}

// The accumulator registers of one m64nNk16 wgmma chain, N/2 fp32 per thread in the D layout above.
template <int N>
struct WgmmaAcc;
constexpr bool wgmma_n_supported(int n) { return n == 64 || n == 128 || n == 256; }
// D = A B + (scale_d ? D : 0), A and B from shared memory (descriptors).
template <int N>
__device__ __forceinline__ void wgmma_ss(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d);
// The same with A from registers (the A layout above).
template <int N>
__device__ __forceinline__ void wgmma_rs(WgmmaAcc<N>& d, const uint32_t (&a)[4], uint64_t desc_b, bool scale_d);
// m64nNk32 with e4m3 operands, both from shared memory and K-major (FP8 wgmma has no transposed
// operands): element (r, k) lies at byte start + (r/8) SBO + (r%8) S + k under swizzle S (none: start
// + (r/8) SBO + (r%8) 16 + (k/16) LBO + k%16). A 128-byte swizzled row holds 128 k's, and each k-step of
// 32 advances the start by 32 bytes, as a bf16 k-step of 16 does. D as the bf16 wgmma's.
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d);
// Each names the accumulators it orders (the GPU build keeps the compiler from moving their accesses
// across it).
template <class... Acc>
__device__ __forceinline__ void wgmma_fence(Acc&... acc);
__device__ __forceinline__ void wgmma_commit();
template <int Groups, class... Acc>
__device__ __forceinline__ void wgmma_wait(Acc&... acc);
// Writes by threads to shared memory become visible to wgmma and TMA (the async proxy) after this.
__device__ __forceinline__ void fence_proxy_async();
// setmaxnreg: every warp of a warpgroup sets its threads' register ceiling to Regs (24..256, a multiple
// of 8), lowering it (dec) or raising it (inc, which waits until the block's pool has the registers):
// a producer warpgroup hands its registers to the consumers. The kernel's launch bound fixes the pool.
// Under emu registers are not counted: a no-op.
constexpr bool setmaxnreg_supported(int regs) { return regs >= 24 && regs <= 256 && regs % 8 == 0; }
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec();
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc();

// mbarrier: a 64-bit shared-memory object with an expected arrival count, pending arrivals and a
// transaction (byte) count. A phase completes when all arrivals are in and the tx-count is back at
// zero; the phase parity then flips. mbarrier_wait(bar, p) returns once the phase of parity p has
// completed (start with p = 0 and flip it each round).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals);
__device__ __forceinline__ void fence_mbarrier_init();  // before the __syncthreads that publishes the init
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar);
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes);
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity);
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
    while (!mbarrier_try_wait(bar, parity)) {}
}

// TMA: one box of a tensor map (encode_tensor_map) from global to shared memory (128-byte aligned),
// completing `box bytes` of transactions on `bar`. Coordinates are element indices, innermost first,
// and may lie outside the tensor: those elements are filled with zeros.
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar);
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar);

// The tensor map of a bf16 tensor of rank R (dims innermost first, strides in bytes of dims 1..R-1),
// loaded in boxes of `box` elements with swizzle s, through cuTensorMapEncodeTiled (the driver's,
// found through the runtime's entry point; emu's own in the CPU build). Stops with a message on error.
// `type`: the elements' (CU_TENSOR_MAP_DATA_TYPE_UINT8 for e4m3 bytes).
template <int R>
CUtensorMap encode_tensor_map(const void* base, const uint64_t (&dims)[R], const uint64_t (&strides)[R - 1],
                              const uint32_t (&box)[R], Swizzle s,
                              CUtensorMapDataType type = CU_TENSOR_MAP_DATA_TYPE_BFLOAT16) {
    static_assert(R >= 1 && R <= 5, "tensor maps have rank 1 to 5");
    using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
    static const Encode encode = [] {
        void* fn = nullptr;
        cudaDriverEntryPointQueryResult found{};
#if CUDART_VERSION >= 12050
        const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found);
#else
        const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &found);
#endif
        if (e != cudaSuccess || found != cudaDriverEntryPointSuccess || !fn) {
            std::fprintf(stderr, "encode_tensor_map: the driver has no cuTensorMapEncodeTiled (%s)\n", cudaGetErrorString(e));
            std::exit(EXIT_FAILURE);
        }
        return reinterpret_cast<Encode>(fn);
    }();
    const CUtensorMapSwizzle swizzle = s == Swizzle::b128  ? CU_TENSOR_MAP_SWIZZLE_128B
                                       : s == Swizzle::b64 ? CU_TENSOR_MAP_SWIZZLE_64B
                                       : s == Swizzle::b32 ? CU_TENSOR_MAP_SWIZZLE_32B
                                                           : CU_TENSOR_MAP_SWIZZLE_NONE;
    cuuint32_t element_strides[R];
    for (int i = 0; i < R; ++i) element_strides[i] = 1;
    CUtensorMap map;
    const CUresult r = encode(&map, type, R, const_cast<void*>(base), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                              CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        std::fprintf(stderr, "encode_tensor_map: cuTensorMapEncodeTiled failed (CUresult %d) for a rank-%d %s tensor at %p, box", int(r), R,
                     type == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ? "bf16" : "non-bf16", base);
        for (int i = 0; i < R; ++i) std::fprintf(stderr, " %u", box[i]);
        std::fprintf(stderr, ", swizzle %u bytes\n", s == Swizzle::none ? 0u : swizzle_bytes(s));
        std::exit(EXIT_FAILURE);
    }
    return map;
}

#ifdef __CUDACC__

__device__ __forceinline__ float tanh_approx(float x) {
    float y;
    asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
}

__device__ __forceinline__ uint16_t cvt_e4m3x2(float lo, float hi) {
    uint16_t r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));  // the first source: the high byte
    return r;
}

__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                                                  const float (&c)[4]) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
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
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(__cvta_generic_to_global(p)));
}
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

template <int S, int M, int N>
__device__ __forceinline__ void mma_m16n8k32_e4m3_from_smem(float (&acc)[M][N][4], const void* const (&a_rows)[S][M],
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
                mma_m16n8k32_e4m3(acc[m][n], a[m], b, acc[m][n]);
            }
    }
}

// ---- Hopper ----
__device__ __forceinline__ uint32_t smem_address(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

template <int N>
struct WgmmaAcc {
    static_assert(wgmma_n_supported(N), "wgmma shapes here: m64n64k16, m64n128k16, m64n256k16");
    float r[N / 2];
    __device__ __forceinline__ float& operator[](int i) { return r[i]; }
    __device__ __forceinline__ const float& operator[](int i) const { return r[i]; }
};

// The accumulator operand lists: "+f" for every register, 8 at a time.
#define WGMMA_D8(i) "+f"(d.r[i]), "+f"(d.r[i + 1]), "+f"(d.r[i + 2]), "+f"(d.r[i + 3]), "+f"(d.r[i + 4]), \
                    "+f"(d.r[i + 5]), "+f"(d.r[i + 6]), "+f"(d.r[i + 7])
#define WGMMA_D32(i) WGMMA_D8(i), WGMMA_D8(i + 8), WGMMA_D8(i + 16), WGMMA_D8(i + 24)
#define WGMMA_REGS_32 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_REGS_64 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_REGS_128 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, " \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
    "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
// scale-d is a predicate; scale-a/b are +1 and neither operand is transposed (both K-major).
#define WGMMA_SS(n, regs, da, db, sd) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #sd ", 0;\nwgmma.mma_async.sync.aligned.m64n" #n "k16.f32.bf16.bf16 {" regs \
    "}, %" #da ", %" #db ", p, 1, 1, 0, 0;\n}\n"
#define WGMMA_RS(n, regs, a0, a1, a2, a3, db, sd)                                                                  \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #sd ", 0;\nwgmma.mma_async.sync.aligned.m64n" #n "k16.f32.bf16.bf16 {" regs \
    "}, {%" #a0 ", %" #a1 ", %" #a2 ", %" #a3 "}, %" #db ", p, 1, 1, 0;\n}\n"

template <int N>
__device__ __forceinline__ void wgmma_ss(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d) {
    const int sd = scale_d;
    if constexpr (N == 64)
        asm volatile(WGMMA_SS(64, WGMMA_REGS_32, 32, 33, 34) : WGMMA_D32(0) : "l"(desc_a), "l"(desc_b), "r"(sd));
    else if constexpr (N == 128)
        asm volatile(WGMMA_SS(128, WGMMA_REGS_64, 64, 65, 66) : WGMMA_D32(0), WGMMA_D32(32) : "l"(desc_a), "l"(desc_b), "r"(sd));
    else
        asm volatile(WGMMA_SS(256, WGMMA_REGS_128, 128, 129, 130)
                     : WGMMA_D32(0), WGMMA_D32(32), WGMMA_D32(64), WGMMA_D32(96)
                     : "l"(desc_a), "l"(desc_b), "r"(sd));
}
template <int N>
__device__ __forceinline__ void wgmma_rs(WgmmaAcc<N>& d, const uint32_t (&a)[4], uint64_t desc_b, bool scale_d) {
    const int sd = scale_d;
    if constexpr (N == 64)
        asm volatile(WGMMA_RS(64, WGMMA_REGS_32, 32, 33, 34, 35, 36, 37)
                     : WGMMA_D32(0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(sd));
    else if constexpr (N == 128)
        asm volatile(WGMMA_RS(128, WGMMA_REGS_64, 64, 65, 66, 67, 68, 69)
                     : WGMMA_D32(0), WGMMA_D32(32) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(sd));
    else
        asm volatile(WGMMA_RS(256, WGMMA_REGS_128, 128, 129, 130, 131, 132, 133)
                     : WGMMA_D32(0), WGMMA_D32(32), WGMMA_D32(64), WGMMA_D32(96)
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(sd));
}
#define WGMMA_SS_E4M3(n, regs, da, db, sd) \
    "{\n.reg .pred p;\nsetp.ne.b32 p, %" #sd ", 0;\nwgmma.mma_async.sync.aligned.m64n" #n "k32.f32.e4m3.e4m3 {" regs \
    "}, %" #da ", %" #db ", p, 1, 1;\n}\n"
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(WgmmaAcc<N>& d, uint64_t desc_a, uint64_t desc_b, bool scale_d) {
    const int sd = scale_d;
    if constexpr (N == 64)
        asm volatile(WGMMA_SS_E4M3(64, WGMMA_REGS_32, 32, 33, 34) : WGMMA_D32(0) : "l"(desc_a), "l"(desc_b), "r"(sd));
    else if constexpr (N == 128)
        asm volatile(WGMMA_SS_E4M3(128, WGMMA_REGS_64, 64, 65, 66)
                     : WGMMA_D32(0), WGMMA_D32(32) : "l"(desc_a), "l"(desc_b), "r"(sd));
    else
        asm volatile(WGMMA_SS_E4M3(256, WGMMA_REGS_128, 128, 129, 130)
                     : WGMMA_D32(0), WGMMA_D32(32), WGMMA_D32(64), WGMMA_D32(96)
                     : "l"(desc_a), "l"(desc_b), "r"(sd));
}
#undef WGMMA_SS_E4M3
#undef WGMMA_D8
#undef WGMMA_D32
#undef WGMMA_REGS_32
#undef WGMMA_REGS_64
#undef WGMMA_REGS_128
#undef WGMMA_SS
#undef WGMMA_RS

// Ties every accumulator register to this point: the compiler may not move their reads or writes across it.
template <int N>
__device__ __forceinline__ void wgmma_order_registers(WgmmaAcc<N>& d) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) asm volatile("" : "+f"(d.r[i])::"memory");
}
template <class... Acc>
__device__ __forceinline__ void wgmma_fence(Acc&... acc) {
    (wgmma_order_registers(acc), ...);
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int Groups, class... Acc>
__device__ __forceinline__ void wgmma_wait(Acc&... acc) {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(Groups) : "memory");
    (wgmma_order_registers(acc), ...);
}
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
template <int Regs>
__device__ __forceinline__ void setmaxnreg_dec() {
    static_assert(setmaxnreg_supported(Regs), "setmaxnreg takes 24..256 registers, a multiple of 8");
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
}
template <int Regs>
__device__ __forceinline__ void setmaxnreg_inc() {
    static_assert(setmaxnreg_supported(Regs), "setmaxnreg takes 24..256 registers, a multiple of 8");
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
}

__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_address(bar)), "r"(arrivals) : "memory");
}
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_address(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_address(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ bool mbarrier_try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(smem_address(bar)), "r"(parity)
        : "memory");
    return done != 0;
}

__device__ __forceinline__ void tma_load_2d(void* smem_dst, const CUtensorMap* map, int c0, int c1, uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::"r"(
            smem_address(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_address(bar))
        : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const CUtensorMap* map, int c0, int c1, int c2,
                                            uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
            smem_address(smem_dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_address(bar))
        : "memory");
}

#else
#include "../emu/ptx_twins.h"
#endif
