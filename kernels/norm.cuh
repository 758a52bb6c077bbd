// RMSNorm over the rows of a (T, C) bf16 activation, as upstream's norm(): y = x / sqrt(mean(x^2) + eps),
// no weight, computed in fp32 and rounded to bf16 once; each row's rstd = 1/sqrt(mean(x^2) + eps) is
// kept in fp32 for the backward. One warp owns a row and holds it in registers, so a kernel that first
// computes the row (residual.cuh fuses the residual-stream updates with the norm that follows them)
// normalizes it without reading it back. The row helpers below are shared with residual.cuh.
#pragma once
#include "common.cuh"

#include <initializer_list>

// F.rms_norm without eps on a bf16 input computes in fp32 and uses torch.finfo(float32).eps.
constexpr float kRmsNormEps = 1.1920929e-07f;

constexpr int kNormRowsPerBlock = 8;  // one warp per row
constexpr int kNormThreads = 32 * kNormRowsPerBlock;
constexpr int kNormPacksPerLane = 4;  // lane l holds the row's 16-byte packs l, l + 32, l + 64, l + 96
constexpr int kNormPackWidth = Pack128<__nv_bfloat16>::size;
constexpr int kNormMaxWidth = 32 * kNormPacksPerLane * kNormPackWidth;  // 1024: both presets (128, 768) fit

// ---- shape rules (host) ----
// Why (T, C) rows cannot go through the norm and residual kernels, or nullptr when they can.
inline const char* norm_rows_shape_error(int T, int C) {
    if (T < 1) return "T must be at least 1";
    if (C < kNormPackWidth || C % kNormPackWidth != 0)
        return "C must be a positive multiple of 8 (rows move in 16-byte packs)";
    if (C > kNormMaxWidth) return "C must be at most 1024 (one warp holds a row in registers)";
    return nullptr;
}
// Exits with a message naming `who` when the shape is unsupported or a tensor is not 16-byte aligned.
inline void require_norm_rows(const char* who, int T, int C, std::initializer_list<const void*> tensors) {
    if (const char* why = norm_rows_shape_error(T, C))
        kernel_require(false, "%s: unsupported shape T=%d C=%d: %s", who, T, C, why);
    for (const void* p : tensors)
        kernel_require(is_aligned16(p), "%s: every tensor must start on a 16-byte boundary (got %p)", who, p);
}
inline int norm_row_blocks(int T) { return ceil_div(T, kNormRowsPerBlock); }
// Bytes of n (T, C) bf16 tensors and of a (T) fp32 statistic: what the row kernels' Work counts.
inline double norm_rows_bytes(int T, int C, int n = 1) { return 2.0 * n * T * C; }
inline double norm_rstd_bytes(int T) { return 4.0 * T; }

// ---- a row held by a warp (device) ----
// The lane's share of one bf16 row; packs past the row's end are zeros, so sums may include them.
struct NormRow {
    Pack128<__nv_bfloat16> pack[kNormPacksPerLane];
};
// First column of the lane's i-th pack.
__device__ __forceinline__ int norm_row_col(int i, int lane) { return (lane + 32 * i) * kNormPackWidth; }

__device__ __forceinline__ NormRow norm_row_load(const __nv_bfloat16* row, int C, int lane) {
    NormRow r;
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        r.pack[i] = col < C ? load128(row + col) : Pack128<__nv_bfloat16>::filled(__float2bfloat16(0.0f));
    }
    return r;
}

// sum_c a[c] * b[c] over the whole row, in fp32; every lane gets the same value.
__device__ __forceinline__ float norm_row_dot(const NormRow& a, const NormRow& b) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i)
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) s += __bfloat162float(a.pack[i][k]) * __bfloat162float(b.pack[i][k]);
    return warp_reduce_sum(s);
}

// 1/sqrt(mean(x^2) + eps) of the row.
__device__ __forceinline__ float norm_row_rstd(const NormRow& x, int C) {
    return rsqrtf(norm_row_dot(x, x) / static_cast<float>(C) + kRmsNormEps);
}

// y = bf16(x * rstd) for the lane's packs; lane 0 records rstd.
__device__ __forceinline__ void norm_row_store_normalized(__nv_bfloat16* y_row, float* rstd_slot, const NormRow& x,
                                                          float rstd, int C, int lane) {
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        Pack128<__nv_bfloat16> y;
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) y[k] = __float2bfloat16(__bfloat162float(x.pack[i][k]) * rstd);
        store128(y_row + col, y);
    }
    if (lane == 0) *rstd_slot = rstd;
}

// The norm's input gradient is dx = rstd * dy - q * x with q = rstd^3 * dot(dy, x) / C (y = x * rstd, and
// rstd depends on every x of the row); this returns q.
__device__ __forceinline__ float norm_row_grad_coeff(const NormRow& dy, const NormRow& x, float rstd, int C) {
    return norm_row_dot(dy, x) * (rstd * rstd * rstd) / static_cast<float>(C);
}

// The same q from the rows in memory. Backward kernels take q this way, then stream the row pack by
// pack, reading dy and x again (from L1): holding them across the other tensors they stream would
// cost registers, and with them occupancy.
__device__ __forceinline__ float norm_row_grad_coeff(const __nv_bfloat16* dy_row, const __nv_bfloat16* x_row,
                                                     float rstd, int C, int lane) {
    return norm_row_grad_coeff(norm_row_load(dy_row, C, lane), norm_row_load(x_row, C, lane), rstd, C);
}

// ---- kernels and launchers ----
// These kernels are memory-bound: __launch_bounds__(kNormThreads, 4) keeps them at 4 blocks (32 warps)
// per SM, within 64 registers.
// y = x * rstd per row, rstd = 1/sqrt(mean(x^2) + eps) kept in fp32.
__global__ void __launch_bounds__(kNormThreads, 4)
    rmsnorm_forward_kernel(__nv_bfloat16* y, float* rstd, const __nv_bfloat16* x, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;  // whole warps leave together
    const size_t off = static_cast<size_t>(row) * C;
    const NormRow v = norm_row_load(x + off, C, lane);
    norm_row_store_normalized(y + off, rstd + row, v, norm_row_rstd(v, C), C, lane);
}
// Reads x; writes y and rstd; a square-add and a multiply per element.
inline Work rmsnorm_forward_work(int T, int C) {
    return Work{.name = "rmsnorm_forward", .flops = 3.0 * T * C, .bytes_read = norm_rows_bytes(T, C),
                .bytes_written = norm_rows_bytes(T, C) + norm_rstd_bytes(T)};
}
inline void rmsnorm_forward(__nv_bfloat16* y, float* rstd, const __nv_bfloat16* x, int T, int C, cudaStream_t stream) {
    require_norm_rows("rmsnorm_forward", T, C, {y, x});
    launch(rmsnorm_forward_work(T, C), rmsnorm_forward_kernel, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0,
           stream, y, rstd, x, T, C);
    CUDA_CHECK_LAUNCH();
}

// dx (+)= rstd * dy - x * rstd^3 * dot(dy, x) / C, rounded once (with the stored dx when accumulating).
__global__ void __launch_bounds__(kNormThreads, 4)
    rmsnorm_backward_kernel(__nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* x, const float* rstd,
                            int T, int C, bool accumulate) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const size_t off = static_cast<size_t>(row) * C;
    const float r = rstd[row], q = norm_row_grad_coeff(dy + off, x + off, r, C, lane);
#pragma unroll 1
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) break;
        const Pack128<__nv_bfloat16> d = load128(dy + off + col), v = load128(x + off + col);
        Pack128<__nv_bfloat16> out = accumulate ? load128(dx + off + col) : Pack128<__nv_bfloat16>{};
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) {
            const float grad = r * __bfloat162float(d[k]) - q * __bfloat162float(v[k]);
            out[k] = __float2bfloat16(accumulate ? __bfloat162float(out[k]) + grad : grad);
        }
        store128(dx + off + col, out);
    }
}
// Reads dy, x, rstd (dx too when accumulating); writes dx; the dot and the gradient, 5 or 6 per element.
inline Work rmsnorm_backward_work(int T, int C, bool accumulate) {
    return Work{.name = "rmsnorm_backward", .flops = (accumulate ? 6.0 : 5.0) * T * C,
                .bytes_read = norm_rows_bytes(T, C, accumulate ? 3 : 2) + norm_rstd_bytes(T),
                .bytes_written = norm_rows_bytes(T, C)};
}
// accumulate: add into dx (a residual-stream gradient that already holds the other paths' share).
inline void rmsnorm_backward(__nv_bfloat16* dx, const __nv_bfloat16* dy, const __nv_bfloat16* x, const float* rstd,
                             int T, int C, bool accumulate, cudaStream_t stream) {
    require_norm_rows("rmsnorm_backward", T, C, {dx, dy, x});
    launch(rmsnorm_backward_work(T, C, accumulate), rmsnorm_backward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, dx, dy, x, rstd, T, C, accumulate);
    CUDA_CHECK_LAUNCH();
}
