// The output head: FP8 quantization, the FP8 lm_head of training (forward and backward through
// cuBLASLt), the bf16 lm_head of evaluation, and the softcapped losses: training's multi-token
// prediction cross-entropy (forward, backward; record 71's, and record 80's at the end) and evaluation's
// mean cross-entropy.
//
// Rounding points:
// - Quantization is fp8(fp32(x) / s), one IEEE fp32 division then one round-to-nearest-even cast:
//   upstream's x.div(s).to(fp8) runs inside torch.compile, which fuses the two without rounding the
//   quotient to bf16.
// - The lm_head's outputs are rounded once by cuBLASLt (logits and dx to bf16). dw goes straight
//   into the bf16 lm_head gradient with beta accumulation (one rounding of stored + new in fp32),
//   rather than upstream's fp32 grad_w that autograd rounds to bf16 and then adds (two roundings):
//   it saves a (C, V) fp32 buffer and a pass over it, and follows this project's accumulate rule.
// - Training's softcap z = 23 sigmoid((l + 5) / 7.5) stays fp32 (upstream's Triton kernels);
//   evaluation rounds z to bf16 before the fp32 cross-entropy (upstream computes it in bf16, then
//   .float()). dlogits are rounded to bf16 once; training's e5m2 gradient quantizes that bf16 value
//   (as upstream quantizes its bf16 grad), in the same pass that computes it.
#pragma once
#include "matmul.cuh"
#include "ptx.cuh"

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <string>

// ---- FP8 quantization ----
// What a value beyond the format's range becomes. Torch eager (c10's Float8 conversions) gives NaN
// (e4m3fn) or inf (e5m2) for magnitudes that round above the largest finite value (448, 57344);
// upstream's casts run in torch.compile's Triton kernels, which convert with Hopper's
// cvt.rn.satfinite and so saturate to +-448 / +-57344 (inf included). NaN stays NaN in both.
enum class Fp8Overflow { nan_or_inf, saturate };
// The lm_head follows what upstream computes (compiled). Training stays far inside the range (x is
// rms-normed: |x / x_s| <= 4.48 sqrt(C) ~ 124; w would need |w| > 1.6, dlogits > 57344 grad_s), so
// this only decides what a divergence looks like.
constexpr Fp8Overflow kLmHeadFp8Overflow = Fp8Overflow::saturate;

template <class F8>
struct Fp8Format;
template <>
struct Fp8Format<__nv_fp8_e4m3> {  // 1.4.3, bias 7, no inf, NaN = S.1111.111, max 448
    static constexpr int mantissa_bits = 3, bias = 7;
    static constexpr unsigned max_code = 0x7E, overflow_code = 0x7F;
};
template <>
struct Fp8Format<__nv_fp8_e5m2> {  // 1.5.2, bias 15, inf = S.11111.00, max 57344
    static constexpr int mantissa_bits = 2, bias = 15;
    static constexpr unsigned max_code = 0x7B, overflow_code = 0x7C;
};

// The fp8 code of v, rounded to nearest even; NaN becomes S.1111111 (sign kept, as torch does).
template <class F8, Fp8Overflow overflow>
__host__ __device__ __forceinline__ unsigned char fp8_code_from_float(float v) {
    constexpr int M = Fp8Format<F8>::mantissa_bits, bias = Fp8Format<F8>::bias;
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    const unsigned sign = (bits >> 24) & 0x80u;
    const uint32_t mag = bits & 0x7FFFFFFFu;
    if (mag > 0x7F800000u) return static_cast<unsigned char>(sign | 0x7Fu);
    unsigned code;
    if (mag < static_cast<uint32_t>(127 + 1 - bias) << 23) {
        // Below the smallest normal: count in units of the smallest subnormal (the scaling by a power
        // of two is exact), and rintf rounds to nearest even. 2^M units is the smallest normal's code.
        code = static_cast<unsigned>(rintf(fabsf(v) * static_cast<float>(1 << (bias - 1 + M))));
    } else {
        // Drop the low 23-M mantissa bits rounding to nearest even; a carry moves into the exponent.
        constexpr int drop = 23 - M;
        const uint32_t rounded = (mag + ((1u << (drop - 1)) - 1u) + ((mag >> drop) & 1u)) >> drop;
        code = rounded - (static_cast<uint32_t>(127 - bias) << M);
    }
    if (code > Fp8Format<F8>::max_code)
        code = overflow == Fp8Overflow::saturate ? Fp8Format<F8>::max_code : Fp8Format<F8>::overflow_code;
    return static_cast<unsigned char>(sign | code);
}

// 128 threads per 64x64 tile: 2 items of 16 elements (4 16-byte loads) each keep enough bytes in flight
// for this memory-bound pass, and the CPU build's cost per thread (a fiber and a barrier each) halves
// against 256.
constexpr int kQuantTile = 64, kQuantThreads = 128;

// The bf16 values a quantization reads: 16 consecutive elements of a row-major matrix.
struct Bf16Matrix {
    const __nv_bfloat16* in;
    int cols;
    __device__ __forceinline__ void load16(Pack128<__nv_bfloat16> (&x)[2], int r, int c) const {
        const __nv_bfloat16* p = in + static_cast<int64_t>(r) * cols + c;
        x[0] = load128cs(p);
        x[1] = load128cs(p + 8);
    }
};

// out = fp8(x / *scale) (rows, cols) and the same codes transposed, out_t (cols, rows), where x
// (rows, cols) is what `src` gives (Bf16Matrix: a stored matrix; the loss backward: its dlogits);
// with kCopyT also copy_t = x^T (cols, rows) in bf16 (the lm_head weight's tied embed).
// A 64x64 tile goes through shared memory so every layout is written with 16-byte stores.
template <class F8, Fp8Overflow overflow, class Source, bool kCopyT = false>
__global__ void __launch_bounds__(kQuantThreads)
    quantize_fp8_two_layouts_kernel(F8* out, F8* out_t, Source src, const float* scale, int rows, int cols,
                                    __nv_bfloat16* copy_t) {
    __shared__ uint32_t tile[kQuantTile][kQuantTile / 4 + 1];  // bytes [r][c]; the extra word spreads banks
    // the bf16 values [r][c] when copied too; rows stay 16-byte aligned, the extra 8 spread banks
    __shared__ __align__(16) __nv_bfloat16 tile16[kCopyT ? kQuantTile : 1][kQuantTile + 8];
    const int r0 = blockIdx.y * kQuantTile, c0 = blockIdx.x * kQuantTile;
    const float s = *scale;
    unsigned char* out_bytes = reinterpret_cast<unsigned char*>(out);
    unsigned char* out_t_bytes = reinterpret_cast<unsigned char*>(out_t);
    for (int i = threadIdx.x; i < kQuantTile * kQuantTile / 16; i += blockDim.x) {
        const int rr = i / (kQuantTile / 16), cc = (i % (kQuantTile / 16)) * 16;
        const int r = r0 + rr, c = c0 + cc;
        if (r >= rows || c >= cols) continue;
        Pack128<__nv_bfloat16> x[2];
        src.load16(x, r, c);
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t word = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float v = __bfloat162float(x[q / 2][4 * (q % 2) + k]);
                word |= static_cast<uint32_t>(fp8_code_from_float<F8, overflow>(v / s)) << (8 * k);
            }
            w[q] = word;
            tile[rr][cc / 4 + q] = word;
        }
        *reinterpret_cast<uint4*>(out_bytes + static_cast<int64_t>(r) * cols + c) = make_uint4(w[0], w[1], w[2], w[3]);
        if constexpr (kCopyT) {
            store128(&tile16[rr][cc], x[0]);
            store128(&tile16[rr][cc + 8], x[1]);
        }
    }
    __syncthreads();
    // out_t row c holds column c of the tile: each thread writes 16 consecutive rows of one column
    for (int i = threadIdx.x; i < kQuantTile * kQuantTile / 16; i += blockDim.x) {
        const int cc = i / (kQuantTile / 16), rr = (i % (kQuantTile / 16)) * 16;
        const int r = r0 + rr, c = c0 + cc;
        if (r >= rows || c >= cols) continue;
        const int shift = 8 * (cc % 4);
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {  // each word built in a register (a compiler that keeps the loops rolled, too)
            uint32_t word = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) word |= ((tile[rr + 4 * q + k][cc / 4] >> shift) & 0xFFu) << (8 * k);
            w[q] = word;
        }
        *reinterpret_cast<uint4*>(out_t_bytes + static_cast<int64_t>(c) * rows + r) =
            make_uint4(w[0], w[1], w[2], w[3]);
        if constexpr (kCopyT) {  // the same 16 rows of column c in bf16: two 16-byte stores
            Pack128<__nv_bfloat16> v[2];
#pragma unroll
            for (int k = 0; k < 16; ++k) v[k / 8][k % 8] = tile16[rr + k][cc];
            store128(copy_t + static_cast<int64_t>(c) * rows + r, v[0]);
            store128(copy_t + static_cast<int64_t>(c) * rows + r + 8, v[1]);
        }
    }
}
// The grid of quantize_fp8_two_layouts_kernel: one block per 64x64 tile.
inline dim3 quantize_fp8_grid(int rows, int cols) {
    return dim3(ceil_div(cols, kQuantTile), ceil_div(rows, kQuantTile));
}

inline std::string quantize_fp8_shape_error(int rows, int cols, std::initializer_list<const void*> pointers) {
    if (rows <= 0 || cols <= 0 || rows % 16 != 0 || cols % 16 != 0)
        return "rows (" + std::to_string(rows) + ") and cols (" + std::to_string(cols) +
               ") must be positive multiples of 16";
    if (!all_aligned16(pointers)) return "a buffer is not 16-byte aligned";
    return "";
}

// Reads in and the scale, writes both fp8 layouts (and the bf16 transposed copy when asked); a
// division per element.
inline Work quantize_fp8_two_layouts_work(int rows, int cols, bool copy_t = false) {
    const double n = static_cast<double>(rows) * cols;
    return Work{.name = "quantize_fp8_two_layouts", .flops = n, .bytes_read = 2 * n + 4,
                .bytes_written = (copy_t ? 4 : 2) * n};
}
// out (rows, cols) = fp8(in / *scale) and out_t (cols, rows) its transpose; scale in device memory.
template <class F8, Fp8Overflow overflow = kLmHeadFp8Overflow>
void quantize_fp8_two_layouts(F8* out, F8* out_t, const __nv_bfloat16* in, const float* scale, int rows, int cols,
                              cudaStream_t stream) {
    require_shape(quantize_fp8_shape_error(rows, cols, {out, out_t, in}), "quantize_fp8_two_layouts");
    launch(quantize_fp8_two_layouts_work(rows, cols), quantize_fp8_two_layouts_kernel<F8, overflow, Bf16Matrix>,
           quantize_fp8_grid(rows, cols), dim3(kQuantThreads), 0, stream, out, out_t, Bf16Matrix{in, cols}, scale, rows,
           cols, nullptr);
    CUDA_CHECK_LAUNCH();
}

// ---- the lm_head ----
// Per-tensor scales of the training lm_head; the device copy (this struct) feeds both the
// quantization kernels and cuBLASLt's scale pointers. Each scale in its own 16-byte slot: on an H100,
// cuBLASLt refused every fp8 matmul whose scale pointer was 4 or 8 bytes past a 16-byte boundary
// (docs/gpu-runs/2026-11-28-h100-80gb-hbm3-73ba680).
struct LmHeadFp8Scales {
    alignas(16) float x;
    alignas(16) float w;
    alignas(16) float grad;
};
// x_s = 100/448, w_s = 1.6/448, grad_s = grad_scale * 0.75/448 with the loss's grad_scale (record 71:
// 2/grad_accum_steps), computed in double, as Python does, then rounded to fp32.
inline LmHeadFp8Scales lm_head_fp8_scales(int) = delete;  // a grad_accum count is not a grad_scale
inline LmHeadFp8Scales lm_head_fp8_scales(double grad_scale) {
    return {static_cast<float>(100.0 / 448), static_cast<float>(1.6 / 448),
            static_cast<float>(grad_scale * 0.75 / 448)};
}

// The fp8 copies the training lm_head makes for x (T, C), the weight w (C, V) and dlogits g (T, V).
// cuBLASLt's fp8 GEMMs take both operands K-contiguous, so each matmul needs its own layout:
// forward uses x_f8 and w_f8_t; backward uses x_f8_t, w_f8 (both kept from the forward), g_f8, g_f8_t.
// x_f8 and w_f8_t are dead after the forward; g_f8 and g_f8_t live only in the backward.
struct LmHeadFp8Buffers {
    __nv_fp8_e4m3* x_f8;    // (T, C)
    __nv_fp8_e4m3* x_f8_t;  // (C, T)
    __nv_fp8_e4m3* w_f8;    // (C, V)
    __nv_fp8_e4m3* w_f8_t;  // (V, C)
    __nv_fp8_e5m2* g_f8;    // (T, V)
    __nv_fp8_e5m2* g_f8_t;  // (V, T)
};

inline std::string lm_head_shape_error(int T, int C, int V) {
    if (T <= 0 || C <= 0 || V <= 0 || T % 16 != 0 || C % 16 != 0 || V % 16 != 0)
        return "T (" + std::to_string(T) + "), C (" + std::to_string(C) + ") and V (" + std::to_string(V) +
               ") must be positive multiples of 16 (Hopper's fp8 GEMMs)";
    return "";
}

// The weight's two e4m3 copies in `buf`, w_f8 = e4m3(w / w_s) (C, V) and w_f8_t (V, C), and, when
// embed is given (while it is tied to lm_head), embed = w^T (V, C) in the same pass. The weight
// only changes at Adam steps, so the copies are made once after each change, not once per step.
inline void lm_head_fp8_quantize_weight(const LmHeadFp8Buffers& buf, const __nv_bfloat16* w,
                                        const LmHeadFp8Scales* scales, int C, int V, cudaStream_t stream,
                                        __nv_bfloat16* embed = nullptr) {
    require_shape(lm_head_shape_error(16, C, V), "lm_head_fp8_quantize_weight");
    if (!embed) return quantize_fp8_two_layouts(buf.w_f8, buf.w_f8_t, w, &scales->w, C, V, stream);
    kernel_require(is_aligned16(embed), "lm_head_fp8_quantize_weight: embed must be 16-byte aligned");
    launch(quantize_fp8_two_layouts_work(C, V, true),
           quantize_fp8_two_layouts_kernel<__nv_fp8_e4m3, kLmHeadFp8Overflow, Bf16Matrix, true>, quantize_fp8_grid(C, V),
           dim3(kQuantThreads), 0, stream, buf.w_f8, buf.w_f8_t, Bf16Matrix{w, V}, &scales->w, C, V, embed);
    CUDA_CHECK_LAUNCH();
}

// logits (T, V) bf16 = (e4m3(x / x_s) @ w_f8) * x_s * w_s, fp32 accumulation (fast accum, as upstream),
// with the weight's copies already in `buf` (lm_head_fp8_quantize_weight); writes x_f8 and x_f8_t.
inline void lm_head_fp8_forward(CublasLt& lt, __nv_bfloat16* logits, const LmHeadFp8Buffers& buf,
                                const __nv_bfloat16* x, const LmHeadFp8Scales* scales, int T, int C, int V,
                                cudaStream_t stream) {
    require_shape(lm_head_shape_error(T, C, V), "lm_head_fp8_forward");
    quantize_fp8_two_layouts(buf.x_f8, buf.x_f8_t, x, &scales->x, T, C, stream);
    matmul_fp8(lt, logits, buf.x_f8, &scales->x, buf.w_f8_t, &scales->w, T, V, C, stream, /*fast_accum=*/true, 0.0f,
               "gemm_lm_head");
}

// With g_f8 = e5m2(dlogits / grad_s) and g_f8_t already in `buf` (softcap_mtp_loss_backward_fp8, or
// quantize_fp8_two_layouts of bf16 dlogits): dw (C, V) (+)= x_f8^T @ g_f8 * x_s * grad_s into the bf16
// lm_head gradient, then dx (T, C) bf16 = g_f8 @ w_f8^T * grad_s * w_s (both exact fp32 accumulation).
// Reads x_f8_t and w_f8 from the forward.
inline void lm_head_fp8_backward(CublasLt& lt, __nv_bfloat16* dx, __nv_bfloat16* dw, bool accumulate_dw,
                                 const LmHeadFp8Buffers& buf, const LmHeadFp8Scales* scales, int T, int C, int V,
                                 cudaStream_t stream) {
    require_shape(lm_head_shape_error(T, C, V), "lm_head_fp8_backward");
    matmul_fp8(lt, dw, buf.x_f8_t, &scales->x, buf.g_f8_t, &scales->grad, C, V, T, stream, /*fast_accum=*/false,
               accumulate_dw ? 1.0f : 0.0f, "gemm_lm_head_dw");
    matmul_fp8(lt, dx, buf.g_f8, &scales->grad, buf.w_f8, &scales->w, T, C, V, stream, /*fast_accum=*/false, 0.0f,
               "gemm_lm_head_dx");
}

// Evaluation: logits (T, V) = x (T, C) @ w (C, V) in bf16.
inline void lm_head_bf16_forward(CublasLt& lt, __nv_bfloat16* logits, const __nv_bfloat16* x, const __nv_bfloat16* w,
                                 int T, int C, int V, cudaStream_t stream) {
    kernel_require(T > 0 && C > 0 && V > 0, "lm_head_bf16_forward: T, C and V must be positive");
    matmul_bf16(lt, logits, x, false, w, false, T, V, C, stream, 1.0f, 0.0f, nullptr, {}, "gemm_lm_head_eval");
}

// ---- softcapped losses: one block per row of V logits, 16-byte loads ----
constexpr float kSoftcapHeight = 23.0f, kSoftcapShift = 5.0f, kSoftcapInvWidth = 1.0f / 7.5f;
constexpr int kMaxMtpWeights = 8;  // upstream uses 1 to 3
constexpr int kLossThreads = 512;

// sigmoid((logit + 5) / 7.5), with the hardware's fast exp and divide (upstream's Triton tl.exp
// and fp32 divide are approximate too); z = 23 * this lies in [0, 23], so exp(z) cannot overflow
// and a row's sum needs no running max.
__device__ __forceinline__ float softcap_sigmoid(float logit) {
    return __fdividef(1.0f, 1.0f + __expf(-(logit + kSoftcapShift) * kSoftcapInvWidth));
}
// z = 23 * softcap_sigmoid(logit) in fp32, in training and in evaluation: upstream's eval computes
// the softcap on bf16 logits and casts it to fp32, and torch.compile fuses that chain into the
// cross-entropy without materializing (so without rounding) the bf16 intermediate.
__device__ __forceinline__ float softcap(float logit) { return kSoftcapHeight * softcap_sigmoid(logit); }
// A loss kernel's row: sum of exp(softcap(logit)) over the row's V logits, by the whole block with
// 16-byte streaming loads; every thread gets it.
__device__ __forceinline__ float softcap_row_exp_sum(const __nv_bfloat16* row, int V) {
    float sum = 0.0f;
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8) {
        const Pack128<__nv_bfloat16> l = load128cs(row + c);
#pragma unroll
        for (int k = 0; k < 8; ++k) sum += __expf(softcap(__bfloat162float(l[k])));
    }
    return block_reduce_sum(sum);
}

inline std::string loss_shape_error(int T, int V, const void* logits) {
    if (T <= 0 || V <= 0 || V % 8 != 0)
        return "T (" + std::to_string(T) + ") must be positive and V (" + std::to_string(V) +
               ") a positive multiple of 8";
    if (!is_aligned16(logits)) return "logits are not 16-byte aligned";
    return "";
}
inline std::string mtp_shape_error(int T, int V, const void* logits, int n_predict) {
    const std::string e = loss_shape_error(T, V, logits);
    if (!e.empty()) return e;
    if (n_predict < 1 || n_predict > kMaxMtpWeights)
        return "n_predict " + std::to_string(n_predict) + " is not in 1.." + std::to_string(kMaxMtpWeights);
    return "";
}

// Row t: lse = log sum_v exp(z_v); loss_t = sum over k < n_predict with t + k < T, w_k > 0 and
// 0 <= target[t+k] < V of w_k (lse - z[target[t+k]]).
__global__ void __launch_bounds__(kLossThreads)
    softcap_mtp_loss_forward_kernel(float* row_losses, float* lse_out, const __nv_bfloat16* logits, const int* targets,
                                    const float* mtp_weights, int n_predict, int T, int V) {
    const int t = blockIdx.x;
    const __nv_bfloat16* row = logits + static_cast<int64_t>(t) * V;
    const float sum = softcap_row_exp_sum(row, V);
    if (threadIdx.x != 0) return;
    const float lse = logf(sum);
    float loss = 0.0f;
    for (int k = 0; k < n_predict && t + k < T; ++k) {
        const float w = mtp_weights[k];
        const int target = targets[t + k];
        if (w > 0.0f && target >= 0 && target < V) loss += w * (lse - softcap(__bfloat162float(row[target])));
    }
    row_losses[t] = loss;
    lse_out[t] = lse;
}

// Reads the logits, targets and weights, writes row_losses and lse; the softcap, an exp and an add per
// logit (7 operations).
inline Work softcap_mtp_loss_forward_work(int T, int V, int n_predict) {
    return Work{.name = "softcap_mtp_loss_forward", .flops = 7.0 * T * V,
                .bytes_read = 2.0 * T * V + 4.0 * T + 4.0 * n_predict, .bytes_written = 8.0 * T};
}
// Training forward: row_losses (T), lse (T, for the backward), and *loss_total (+)= sum of the rows
// (fixed order). targets (T) int32; mtp_weights (n_predict) fp32, both in device memory.
inline void softcap_mtp_loss_forward(float* loss_total, bool accumulate_total, float* row_losses, float* lse,
                                     const __nv_bfloat16* logits, const int* targets, const float* mtp_weights,
                                     int n_predict, int T, int V, cudaStream_t stream) {
    require_shape(mtp_shape_error(T, V, logits, n_predict), "softcap_mtp_loss_forward");
    launch(softcap_mtp_loss_forward_work(T, V, n_predict), softcap_mtp_loss_forward_kernel, dim3(T), dim3(kLossThreads),
           0, stream, row_losses, lse, logits, targets, mtp_weights, n_predict, T, V);
    CUDA_CHECK_LAUNCH();
    sum_fixed_order(loss_total, row_losses, T, 1.0f, accumulate_total, stream);
}

// dlogit = g (S_w p - sum_k w_k [col == target[t+k]]) (1/7.5) z (1 - sigmoid), p = exp(z - lse),
// S_w = sum of w_k over k < n_predict with t + k < T. As upstream, S_w and the target terms do not
// check w_k > 0 or the target's range (a target outside [0, V) matches no column).
// MtpGradRow holds a row's constants; both backward kernels compute through it and
// mtp_dlogits8, so the fused fp8 form rounds exactly as the bf16 form does.
struct MtpGradRow {
    float g, lse, s_w;
    int target[kMaxMtpWeights];
    float weight[kMaxMtpWeights];
};
__device__ __forceinline__ MtpGradRow mtp_grad_row(const float* lse, const int* targets, const float* mtp_weights,
                                                   int n_predict, const float* dloss, int t, int T) {
    MtpGradRow row;
    row.g = *dloss;
    row.lse = lse[t];
    row.s_w = 0.0f;
#pragma unroll
    for (int k = 0; k < kMaxMtpWeights; ++k) {
        const bool used = k < n_predict && t + k < T;
        row.weight[k] = used ? mtp_weights[k] : 0.0f;
        row.target[k] = used ? targets[t + k] : -1;
        row.s_w += row.weight[k];
    }
    return row;
}
// The bf16 dlogits of the row's 8 logits l at columns [c, c + 8).
__device__ __forceinline__ Pack128<__nv_bfloat16> mtp_dlogits8(const MtpGradRow& row, const Pack128<__nv_bfloat16>& l,
                                                              int c) {
    float hit[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < kMaxMtpWeights; ++k) {
        const unsigned offset = static_cast<unsigned>(row.target[k]) - static_cast<unsigned>(c);  // < 8: in this pack
        if (offset < 8u) hit[offset] += row.weight[k];
    }
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float s = softcap_sigmoid(__bfloat162float(l[k]));
        const float z = kSoftcapHeight * s;
        const float p = __expf(z - row.lse);
        out[k] = __float2bfloat16(row.g * (row.s_w * p - hit[k]) * (kSoftcapInvWidth * z * (1.0f - s)));
    }
    return out;
}

__global__ void __launch_bounds__(kLossThreads)
    softcap_mtp_loss_backward_kernel(__nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* lse,
                                     const int* targets, const float* mtp_weights, int n_predict, const float* dloss,
                                     int T, int V) {
    const int t = blockIdx.x;
    const int64_t row_start = static_cast<int64_t>(t) * V;
    const MtpGradRow row = mtp_grad_row(lse, targets, mtp_weights, n_predict, dloss, t, T);
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8)
        store128(dlogits + row_start + c, mtp_dlogits8(row, load128cs(logits + row_start + c), c));
}

// Reads the logits, lse, targets, weights and dloss, writes dlogits; the softcap, its derivative and
// the softmax, 12 operations per logit.
inline Work softcap_mtp_loss_backward_work(int T, int V, int n_predict) {
    return Work{.name = "softcap_mtp_loss_backward", .flops = 12.0 * T * V,
                .bytes_read = 2.0 * T * V + 8.0 * T + 4.0 * n_predict + 4, .bytes_written = 2.0 * T * V};
}
// The bf16 form of the training backward: dlogits (T, V) from logits, the forward's lse and the
// gradient *dloss of the total loss (the same for every row: the loss is their sum). dlogits may be
// logits (in place). Training runs the fused fp8 form below; this one is its reference in the tests.
inline void softcap_mtp_loss_backward(__nv_bfloat16* dlogits, const __nv_bfloat16* logits, const float* lse,
                                      const int* targets, const float* mtp_weights, int n_predict, const float* dloss,
                                      int T, int V, cudaStream_t stream) {
    require_shape(mtp_shape_error(T, V, logits, n_predict), "softcap_mtp_loss_backward");
    kernel_require(is_aligned16(dlogits), "softcap_mtp_loss_backward: dlogits are not 16-byte aligned");
    launch(softcap_mtp_loss_backward_work(T, V, n_predict), softcap_mtp_loss_backward_kernel, dim3(T),
           dim3(kLossThreads), 0, stream, dlogits, logits, lse, targets, mtp_weights, n_predict, dloss, T, V);
    CUDA_CHECK_LAUNCH();
}

// The quantization source of the fused backward: the bf16 dlogits of 16 logits, computed, not loaded.
struct MtpDlogits {
    const __nv_bfloat16* logits;
    const float *lse, *mtp_weights, *dloss;
    const int* targets;
    int n_predict, T, V;
    __device__ __forceinline__ void load16(Pack128<__nv_bfloat16> (&x)[2], int t, int c) const {
        const MtpGradRow row = mtp_grad_row(lse, targets, mtp_weights, n_predict, dloss, t, T);
        const __nv_bfloat16* l = logits + static_cast<int64_t>(t) * V + c;
        x[0] = mtp_dlogits8(row, load128cs(l), c);
        x[1] = mtp_dlogits8(row, load128cs(l + 8), c + 8);
    }
};

// The quantization's rules (T and V multiples of 16, aligned buffers) and the loss's.
inline std::string mtp_fp8_shape_error(int T, int V, int n_predict, const void* logits, const void* g_f8,
                                       const void* g_f8_t) {
    const std::string e = quantize_fp8_shape_error(T, V, {logits, g_f8, g_f8_t});
    return e.empty() ? mtp_shape_error(T, V, logits, n_predict) : e;
}
// Reads what the bf16 backward reads and the scale, writes both e5m2 layouts; a division more per logit.
inline Work softcap_mtp_loss_backward_fp8_work(int T, int V, int n_predict) {
    Work w = softcap_mtp_loss_backward_work(T, V, n_predict);
    w.name = "softcap_mtp_loss_backward_fp8";
    w.flops += 1.0 * T * V;
    w.bytes_read += 4;
    return w;
}
// The training backward, fused with the lm_head's gradient quantization: g_f8 (T, V) =
// e5m2(dlogits / *grad_scale) and g_f8_t (V, T) its transpose, with dlogits the bf16 values of
// softcap_mtp_loss_backward (never stored): the same bytes as that kernel followed by
// quantize_fp8_two_layouts, in one pass over the logits.
inline void softcap_mtp_loss_backward_fp8(__nv_fp8_e5m2* g_f8, __nv_fp8_e5m2* g_f8_t, const float* grad_scale,
                                          const __nv_bfloat16* logits, const float* lse, const int* targets,
                                          const float* mtp_weights, int n_predict, const float* dloss, int T, int V,
                                          cudaStream_t stream) {
    require_shape(mtp_fp8_shape_error(T, V, n_predict, logits, g_f8, g_f8_t), "softcap_mtp_loss_backward_fp8");
    const MtpDlogits src{logits, lse, mtp_weights, dloss, targets, n_predict, T, V};
    launch(softcap_mtp_loss_backward_fp8_work(T, V, n_predict),
           quantize_fp8_two_layouts_kernel<__nv_fp8_e5m2, kLmHeadFp8Overflow, MtpDlogits>, quantize_fp8_grid(T, V),
           dim3(kQuantThreads), 0, stream, g_f8, g_f8_t, src, grad_scale, T, V, nullptr);
    CUDA_CHECK_LAUNCH();
}

// Evaluation, row t: the fp32 cross-entropy lse(z) - z[target] of z = 23 sigmoid((l + 5) / 7.5);
// a target outside [0, V) gives NaN (evaluation data has none).
__global__ void __launch_bounds__(kLossThreads)
    softcap_eval_loss_kernel(float* row_losses, const __nv_bfloat16* logits, const int* targets, int V) {
    const int t = blockIdx.x;
    const __nv_bfloat16* row = logits + static_cast<int64_t>(t) * V;
    const float sum = softcap_row_exp_sum(row, V);
    if (threadIdx.x != 0) return;
    const int target = targets[t];
    const float z_target = target >= 0 && target < V ? softcap(__bfloat162float(row[target])) : NAN;
    row_losses[t] = logf(sum) - z_target;
}

// Reads the logits and targets, writes row_losses; 7 operations per logit, as in training.
inline Work softcap_eval_loss_work(int T, int V) {
    return Work{.name = "softcap_eval_loss", .flops = 7.0 * T * V, .bytes_read = 2.0 * T * V + 4.0 * T,
                .bytes_written = 4.0 * T};
}
// Evaluation: row_losses (T) and *loss (+)= scale * their sum (fixed order); scale = 1/T gives the
// batch's mean, 1/total rows accumulates a mean over several calls.
inline void softcap_eval_loss(float* loss, bool accumulate, float scale, float* row_losses, const __nv_bfloat16* logits,
                              const int* targets, int T, int V, cudaStream_t stream) {
    require_shape(loss_shape_error(T, V, logits), "softcap_eval_loss");
    launch(softcap_eval_loss_work(T, V), softcap_eval_loss_kernel, dim3(T), dim3(kLossThreads), 0, stream, row_losses,
           logits, targets, V);
    CUDA_CHECK_LAUNCH();
    sum_fixed_order(loss, row_losses, T, scale, accumulate, stream);
}

// ---- record 80's cross-entropy (upstream's NVRTC ce_fwd_bwd_kernel, triton_kernels.py @2c702746) ----
// Upstream computes the loss and the e5m2 logit gradient in one kernel in the forward; here they are a
// forward (lse, row losses) and a backward fused with the e5m2 quantization of both layouts, as record
// 71's are. What differs from record 71's kernels above, each point from upstream's kernel source:
// - s = 0.5 + 0.5 tanh(0.5 u), u = fma(l, 1/C, B (1/C)), with the hardware tanh and reciprocal (the kernel
//   is compiled with --use_fast_math; tanh_approx, __fdividef). s is rounded to bf16 and that value gives
//   z = A s for the sum, the target's loss and the gradient; only the row's max uses the unrounded A s.
// - lse = max + __logf(sum of __expf(z - max)).
// - The gradient is scaled by grad_scale / grad_s in the kernel (upstream's backward ignores grad_output)
//   and goes to e5m2 straight from fp32 (cvt.rn.satfinite): no bf16 rounding, no division by grad_s.
// - S_w sums all n_predict weights, also k with t + k >= T (upstream's quirk: the last rows of a batch get
//   a gradient normalizer that does not match their loss); the target terms use k < 3 only (upstream's
//   loop bound), and t + k < T.
// Evaluation keeps softcap_eval_loss: upstream's validation at 2c702746 does not call this kernel (in eval
// mode the model runs the bf16 lm_head, 23 sigmoid((l + 5) / 7.5), .float(), F.cross_entropy per token,
// and the loop takes .mean() per batch), which is record 71's computation.

// z = height sigmoid((l + shift) / width): upstream's A, B, C, runtime kernel arguments there and here, so
// the compiler forms 1/C with the approximate reciprocal at run time as upstream's kernel does.
struct CeSoftcap {
    float height, shift, width;
};
constexpr CeSoftcap kCeSoftcap{23.0f, 5.0f, 7.5f};
constexpr int kCeTargetTerms = 3;  // upstream's term2 loop: `for (int k = 0; k < 3; k++)`

// Record 88's prefix-token prediction (upstream 75d6867a ce_fwd_bwd_kernel): row t also predicts
// P_t = table[targets[t]], the token whose bytes are the longest proper prefix of its next token's (-1: none,
// data/prefix_table.h), with the step's weight *weight: loss_t += pw (lse - z[P_t]) after the MTP terms, S_w
// starts at pw, and term2[P_t] += pw after the MTP weights, where 0 <= P_t < V. No table: records 80-84.
struct CePrefix {
    const int* table = nullptr;     // device, `rows` entries; a target outside [0, V) has no prefix
    const float* weight = nullptr;  // device scalar pw (0 turns the term off without changing a bit)
    int64_t rows = 0;               // 64 bits: a kernel argument without padding
};
__device__ __forceinline__ int ce_prefix_target(const CePrefix& p, const int* targets, int t, int V) {
    if (!p.table) return -1;
    const int target = targets[t];
    const int prefix = target >= 0 && target < V ? p.table[target] : -1;
    return prefix < V ? prefix : -1;  // upstream's prefix_valid: 0 <= P < V
}

struct CeConstants {
    float a, inv_c, b_div_c;
};
__device__ __forceinline__ CeConstants ce_constants(CeSoftcap p) {
    // upstream's fast-math 1 / C is rcp.approx.ftz.f32; div.approx of 1 by C is that reciprocal times 1
    const float inv_c = __fdividef(1.0f, p.width);
    return {p.height, inv_c, p.shift * inv_c};
}
// sigmoid(u) = 0.5 + 0.5 tanh(u / 2), u = fma(l, 1/C, B/C), in fp32 before any rounding.
__device__ __forceinline__ float ce_sigmoid(const CeConstants& k, float l) {
    return fmaf(tanh_approx(0.5f * fmaf(l, k.inv_c, k.b_div_c)), 0.5f, 0.5f);
}
// The bf16 value of ce_sigmoid that the sum, the loss and the gradient use.
__device__ __forceinline__ float ce_sigmoid_bf16(const CeConstants& k, float l) {
    return __bfloat162float(__float2bfloat16(ce_sigmoid(k, l)));
}

// Row t: lse = max + log sum_v exp(A s_v - max), max over the unrounded A s; loss_t = sum over k <
// n_predict with t + k < T and 0 <= target[t+k] < V of w_k (lse - A s[target[t+k]]), FMAs in k order.
__global__ void __launch_bounds__(kLossThreads)
    ce_r80_loss_forward_kernel(float* row_losses, float* lse_out, const __nv_bfloat16* logits, const int* targets,
                               const float* mtp_weights, int n_predict, int T, int V, CeSoftcap softcap,
                               CePrefix prefix) {
    const int t = blockIdx.x;
    const CeConstants k = ce_constants(softcap);
    const __nv_bfloat16* row = logits + static_cast<int64_t>(t) * V;
    // The max of the unrounded A s is A s(max l): each step of the sigmoid (FMA, tanh, FMA) is monotone, so
    // the first pass reads the logits without a tanh (the PTX ISA does not promise tanh.approx monotone; were
    // it not, the max would move by an ulp of s, which only shifts the exps: lse is the same up to rounding).
    // The pass leaves the row in cache for the second (load128, not streaming).
    float max_logit = -INFINITY;
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8) {
        const Pack128<__nv_bfloat16> l = load128(row + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) max_logit = fmaxf(max_logit, __bfloat162float(l[j]));
    }
    const float max = k.a * ce_sigmoid(k, block_reduce_max(max_logit));
    float sum = 0.0f;
    for (int c = threadIdx.x * 8; c < V; c += blockDim.x * 8) {
        const Pack128<__nv_bfloat16> l = load128cs(row + c);
#pragma unroll
        for (int j = 0; j < 8; ++j) sum += __expf(k.a * ce_sigmoid_bf16(k, __bfloat162float(l[j])) - max);
    }
    sum = block_reduce_sum(sum);
    if (threadIdx.x != 0) return;
    const float lse = max + __logf(sum);
    float loss = 0.0f;
    for (int i = 0; i < n_predict && t + i < T; ++i) {
        const int target = targets[t + i];
        if (target >= 0 && target < V)
            loss = fmaf(mtp_weights[i], lse - k.a * ce_sigmoid_bf16(k, __bfloat162float(row[target])), loss);
    }
    if (const int p = ce_prefix_target(prefix, targets, t, V); p >= 0)
        loss = fmaf(*prefix.weight, lse - k.a * ce_sigmoid_bf16(k, __bfloat162float(row[p])), loss);
    row_losses[t] = loss;
    lse_out[t] = lse;
}

// Reads the logits twice (the second pass mostly from cache), the targets and weights, writes row_losses
// and lse; per logit the max, the sigmoid (2 FMAs, 2 multiplies, tanh), the rounding, exp and add. The prefix
// term reads a table entry per row and the weight.
inline Work ce_r80_loss_forward_work(int T, int V, int n_predict, bool prefix = false) {
    return Work{.name = "ce_r80_loss_forward", .flops = 10.0 * T * V,
                .bytes_read = 4.0 * T * V + 4.0 * T + 4.0 * n_predict + (prefix ? 4.0 * T + 4 : 0.0),
                .bytes_written = 8.0 * T};
}
// The prefix term's table must cover every target the loss reads.
inline std::string ce_prefix_error(const CePrefix& p, int V) {
    if (!p.table) return p.weight ? "a prefix weight without a prefix table" : "";
    if (!p.weight) return "a prefix table without its weight";
    if (p.rows < V) return "prefix table of " + std::to_string(p.rows) + " rows for V " + std::to_string(V);
    return "";
}
// Record 80's training forward: row_losses (T), lse (T, for ce_r80_loss_backward_fp8), and *loss_total
// (+)= sum of the rows (fixed order). targets (T) int32; mtp_weights (n_predict) fp32, both in device memory;
// prefix: record 88's term (none by default).
inline void ce_r80_loss_forward(float* loss_total, bool accumulate_total, float* row_losses, float* lse,
                                const __nv_bfloat16* logits, const int* targets, const float* mtp_weights,
                                int n_predict, int T, int V, cudaStream_t stream, const CePrefix& prefix = {}) {
    require_shape(mtp_shape_error(T, V, logits, n_predict), "ce_r80_loss_forward");
    require_shape(ce_prefix_error(prefix, V), "ce_r80_loss_forward");
    launch(ce_r80_loss_forward_work(T, V, n_predict, prefix.table), ce_r80_loss_forward_kernel, dim3(T),
           dim3(kLossThreads), 0, stream, row_losses, lse, logits, targets, mtp_weights, n_predict, T, V, kCeSoftcap,
           prefix);
    CUDA_CHECK_LAUNCH();
    sum_fixed_order(loss_total, row_losses, T, 1.0f, accumulate_total, stream);
}

// out (rows, cols) and out_t (cols, rows): fp8 codes that `src` computes, 16 consecutive codes of a row at
// a time (4 words, the lowest byte first), through quantize_fp8_two_layouts_kernel's 64x64 tile.
template <class Source>
__global__ void __launch_bounds__(kQuantThreads)
    fp8_codes_two_layouts_kernel(unsigned char* out, unsigned char* out_t, Source src, int rows, int cols) {
    __shared__ uint32_t tile[kQuantTile][kQuantTile / 4 + 1];  // bytes [r][c]; the extra word spreads banks
    const int r0 = blockIdx.y * kQuantTile, c0 = blockIdx.x * kQuantTile;
    for (int i = threadIdx.x; i < kQuantTile * kQuantTile / 16; i += blockDim.x) {
        const int rr = i / (kQuantTile / 16), cc = (i % (kQuantTile / 16)) * 16;
        const int r = r0 + rr, c = c0 + cc;
        if (r >= rows || c >= cols) continue;
        uint32_t w[4];
        src.codes16(w, r, c);
#pragma unroll
        for (int q = 0; q < 4; ++q) tile[rr][cc / 4 + q] = w[q];
        *reinterpret_cast<uint4*>(out + static_cast<int64_t>(r) * cols + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();
    // out_t row c holds column c of the tile: each thread writes 16 consecutive rows of one column
    for (int i = threadIdx.x; i < kQuantTile * kQuantTile / 16; i += blockDim.x) {
        const int cc = i / (kQuantTile / 16), rr = (i % (kQuantTile / 16)) * 16;
        const int r = r0 + rr, c = c0 + cc;
        if (r >= rows || c >= cols) continue;
        const int shift = 8 * (cc % 4);
        uint32_t w[4];
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            uint32_t word = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) word |= ((tile[rr + 4 * q + k][cc / 4] >> shift) & 0xFFu) << (8 * k);
            w[q] = word;
        }
        *reinterpret_cast<uint4*>(out_t + static_cast<int64_t>(c) * rows + r) = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// dlogit = e5m2_satfinite(grad_scale (A/C) (1/grad_s) (S_w p - term2) s (1 - s)), multiplied left to right as
// upstream, p = exp(A s - lse); S_w p - term2 as one FMA: ptxas contracts upstream's `term1 = S_w * p` and
// `term1 - term2` (checked: nvcc 13.0 --use_fast_math on that code gives FFMA.FTZ with -term2); with no
// target in the column it is S_w p rounded once. A target outside [0, V) matches no column (upstream's
// backward would index out of bounds with one: its data has none). Upstream's kernel flushes subnormals
// (fast math) and this one does not: they can only arise where the e5m2 code is 0 either way.
constexpr int kCeTerms = kCeTargetTerms + 1;  // the MTP targets', then the prefix target's
struct CeGradRow {
    float lse, s_w, scale;  // scale = grad_scale (A/C) (1/grad_s), the product's first three factors
    int target[kCeTerms];
    float weight[kCeTerms];
};
__device__ __forceinline__ CeGradRow ce_grad_row(const CeConstants& k, const float* lse, const int* targets,
                                                 const float* mtp_weights, int n_predict, const CePrefix& prefix,
                                                 float grad_scale, float grad_s, int t, int T, int V) {
    CeGradRow row;
    row.lse = lse[t];
    const int p = ce_prefix_target(prefix, targets, t, V);
    const float pw = p >= 0 ? *prefix.weight : 0.0f;
    row.s_w = pw;  // upstream: S_w = prefix_valid ? prefix_weight : 0, then the MTP weights
    for (int i = 0; i < n_predict; ++i) row.s_w += mtp_weights[i];  // all k: upstream's quirk
    row.scale = grad_scale * (k.inv_c * k.a) * __fdividef(1.0f, grad_s);
#pragma unroll
    for (int i = 0; i < kCeTargetTerms; ++i) {
        const bool used = i < n_predict && t + i < T;
        row.target[i] = used ? targets[t + i] : -1;
        row.weight[i] = used ? mtp_weights[i] : 0.0f;
    }
    row.target[kCeTargetTerms] = p;
    row.weight[kCeTargetTerms] = pw;
    return row;
}
// The e5m2 codes of the row's 8 logits l at columns [c, c + 8), packed 4 to a word, the lowest byte first.
__device__ __forceinline__ uint2 ce_dlogit_codes8(const CeConstants& k, const CeGradRow& row,
                                                  const Pack128<__nv_bfloat16>& l, int c) {
    float term2[8] = {0, 0, 0, 0, 0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < kCeTerms; ++i) {  // in upstream's order: the MTP weights, then the prefix's
        const unsigned offset = static_cast<unsigned>(row.target[i]) - static_cast<unsigned>(c);  // < 8: in this pack
        if (offset < 8u) term2[offset] += row.weight[i];
    }
    uint32_t w[2] = {0, 0};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const float s = ce_sigmoid_bf16(k, __bfloat162float(l[j]));
        const float p = __expf(k.a * s - row.lse);
        const float g = row.scale * fmaf(row.s_w, p, -term2[j]) * s * (1.0f - s);
        w[j / 4] |= static_cast<uint32_t>(fp8_code_from_float<__nv_fp8_e5m2, Fp8Overflow::saturate>(g)) << (8 * (j % 4));
    }
    return make_uint2(w[0], w[1]);
}

// The source of the fused backward: the e5m2 codes of 16 dlogits, computed from the logits.
struct CeDlogitCodes {
    const __nv_bfloat16* logits;
    const float *lse, *mtp_weights, *grad_scale, *grad_s;
    const int* targets;
    CePrefix prefix;
    CeSoftcap softcap;
    int n_predict, T, V;
    __device__ __forceinline__ void codes16(uint32_t (&w)[4], int t, int c) const {
        const CeConstants k = ce_constants(softcap);
        const CeGradRow row =
            ce_grad_row(k, lse, targets, mtp_weights, n_predict, prefix, *grad_scale, *grad_s, t, T, V);
        const __nv_bfloat16* l = logits + static_cast<int64_t>(t) * V + c;
        const uint2 lo = ce_dlogit_codes8(k, row, load128cs(l), c), hi = ce_dlogit_codes8(k, row, load128cs(l + 8), c + 8);
        w[0] = lo.x;
        w[1] = lo.y;
        w[2] = hi.x;
        w[3] = hi.y;
    }
};
// floats have no unique object representation, so the padding check is by size (emu reads every word)
static_assert(sizeof(CeDlogitCodes) == 6 * sizeof(void*) + sizeof(CePrefix) + sizeof(CeSoftcap) + 3 * sizeof(int),
              "CeDlogitCodes: a kernel argument with padding");

// Reads the logits, lse, targets, weights and both scales, writes both e5m2 layouts; per logit the
// sigmoid, its rounding, exp, the FMA and four multiplies.
inline Work ce_r80_loss_backward_fp8_work(int T, int V, int n_predict, bool prefix = false) {
    return Work{.name = "ce_r80_loss_backward_fp8", .flops = 13.0 * T * V,
                .bytes_read = 2.0 * T * V + 8.0 * T + 4.0 * n_predict + 8 + (prefix ? 4.0 * T + 4 : 0.0),
                .bytes_written = 2.0 * T * V};
}
// Record 80's training backward, fused with the lm_head's gradient quantization: g_f8 (T, V) = the e5m2
// dlogits above and g_f8_t (V, T) its transpose, for lm_head_fp8_backward, which rescales by grad_s.
// grad_scale: the loss's scale in the objective (upstream bakes it in and ignores grad_output);
// grad_s: the dlogits' fp8 scale (lm_head_fp8_scales(grad_scale).grad); both device scalars. prefix: record
// 88's term, as given to the forward.
inline void ce_r80_loss_backward_fp8(__nv_fp8_e5m2* g_f8, __nv_fp8_e5m2* g_f8_t, const float* grad_scale,
                                     const float* grad_s, const __nv_bfloat16* logits, const float* lse,
                                     const int* targets, const float* mtp_weights, int n_predict, int T, int V,
                                     cudaStream_t stream, const CePrefix& prefix = {}) {
    require_shape(mtp_fp8_shape_error(T, V, n_predict, logits, g_f8, g_f8_t), "ce_r80_loss_backward_fp8");
    require_shape(ce_prefix_error(prefix, V), "ce_r80_loss_backward_fp8");
    const CeDlogitCodes src{logits, lse, mtp_weights, grad_scale, grad_s, targets, prefix, kCeSoftcap, n_predict, T, V};
    launch(ce_r80_loss_backward_fp8_work(T, V, n_predict, prefix.table), fp8_codes_two_layouts_kernel<CeDlogitCodes>,
           quantize_fp8_grid(T, V), dim3(kQuantThreads), 0, stream, reinterpret_cast<unsigned char*>(g_f8),
           reinterpret_cast<unsigned char*>(g_f8_t), src, T, V);
    CUDA_CHECK_LAUNCH();
}
