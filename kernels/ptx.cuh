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
