// The ReLU^2 MLP, out = relu(x @ c_fc^T)^2 @ c_proj, as cuBLASLt matmuls around two elementwise
// kernels, and the lambda-scaled weight the attention projections use (w_eff = sa_lambda * w).
//
// Rounding points follow upstream's fused Triton MLP: the matmul rounds pre to bf16, post is
// relu(pre)^2 from that bf16 pre (rounded once); in the backward, g @ c_proj^T is rounded to bf16
// by its matmul, then 2 * that * relu(pre) is rounded once more.
#pragma once
#include "matmul.cuh"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

// ---- elementwise parts of the MLP, on 16-byte packs of 8 bf16 ----
constexpr int kPackThreads = 256;

inline std::string bf16_packs_shape_error(int64_t n, std::initializer_list<const void*> pointers) {
    if (n < 0 || n % 8 != 0) return "element count " + std::to_string(n) + " is not a non-negative multiple of 8";
    if (!all_aligned16(pointers)) return "a buffer is not 16-byte aligned";
    return "";
}
inline dim3 bf16_packs_grid(int64_t n) {
    return dim3(static_cast<unsigned>(std::max<int64_t>(1, ceil_div<int64_t>(n / 8, kPackThreads))));
}

// post = relu(pre)^2 from the bf16 pre (the product of two bf16 is exact in fp32: one rounding)
__global__ void __launch_bounds__(kPackThreads)
    relu_square_forward_kernel(__nv_bfloat16* post, const __nv_bfloat16* pre, int64_t n) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const Pack128<__nv_bfloat16> p = load128(pre + i);
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float x = __bfloat162float(p[k]), r = x > 0.0f ? x : 0.0f;
        out[k] = __float2bfloat16(r * r);
    }
    store128(post + i, out);
}
inline void relu_square_forward(__nv_bfloat16* post, const __nv_bfloat16* pre, int64_t n, cudaStream_t stream) {
    require_shape(bf16_packs_shape_error(n, {post, pre}), "relu_square_forward");
    if (n == 0) return;
    launch(relu_square_forward_kernel, bf16_packs_grid(n), dim3(kPackThreads), 0, stream, post, pre, n);
    CUDA_CHECK_LAUNCH();
}

// dpre = 2 * dpost_pre * relu(pre), dpost_pre = dout @ c_proj^T as its matmul rounded it; dpre may be dpost_pre
__global__ void __launch_bounds__(kPackThreads)
    relu_square_backward_kernel(__nv_bfloat16* dpre, const __nv_bfloat16* dpost_pre, const __nv_bfloat16* pre,
                                int64_t n) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const Pack128<__nv_bfloat16> d = load128(dpost_pre + i), p = load128(pre + i);
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float x = __bfloat162float(p[k]);
        out[k] = __float2bfloat16(2.0f * __bfloat162float(d[k]) * (x > 0.0f ? x : 0.0f));
    }
    store128(dpre + i, out);
}
inline void relu_square_backward(__nv_bfloat16* dpre, const __nv_bfloat16* dpost_pre, const __nv_bfloat16* pre,
                                 int64_t n, cudaStream_t stream) {
    require_shape(bf16_packs_shape_error(n, {dpre, dpost_pre, pre}), "relu_square_backward");
    if (n == 0) return;
    launch(relu_square_backward_kernel, bf16_packs_grid(n), dim3(kPackThreads), 0, stream, dpre, dpost_pre, pre, n);
    CUDA_CHECK_LAUNCH();
}

// ---- the whole MLP: x (T, C); c_fc (H, C); c_proj (H, C); pre, post (T, H); out (T, C) ----
inline std::string mlp_shape_error(int T, int C, int H) {
    if (T <= 0 || C <= 0 || H <= 0)
        return "T (" + std::to_string(T) + "), C (" + std::to_string(C) + ") and H (" + std::to_string(H) +
               ") must be positive";
    if (C % 8 != 0 || H % 8 != 0)
        return "model width C (" + std::to_string(C) + ") and hidden width H (" + std::to_string(H) +
               ") must be multiples of 8";
    return "";
}

// pre = x @ c_fc^T; post = relu(pre)^2; out = post @ c_proj (pre and post are kept for the backward)
inline void mlp_forward(CublasLt& lt, __nv_bfloat16* out, __nv_bfloat16* pre, __nv_bfloat16* post,
                        const __nv_bfloat16* x, const __nv_bfloat16* c_fc, const __nv_bfloat16* c_proj, int T, int C,
                        int H, cudaStream_t stream) {
    require_shape(mlp_shape_error(T, C, H), "mlp_forward");
    matmul_forward(lt, pre, x, c_fc, T, H, C, stream);
    relu_square_forward(post, pre, static_cast<int64_t>(T) * H, stream);
    matmul_bf16(lt, out, post, false, c_proj, false, T, C, H, stream);
}

// Given dout (T, C): dc_proj (+)= post^T @ dout; dpre = 2 (dout @ c_proj^T) relu(pre);
// dc_fc (+)= dpre^T @ x; dx = dpre @ c_fc. Weight gradients come first, so their reductions can
// start early. dpre (T, H) is scratch and may be the post buffer: post is last read by dc_proj.
// post may be null (not kept from the forward): it is then recomputed from pre into dpre, the
// same bits, at the cost of one elementwise pass.
inline void mlp_backward(CublasLt& lt, __nv_bfloat16* dx, __nv_bfloat16* dc_fc, __nv_bfloat16* dc_proj,
                         bool accumulate_weight_grads, __nv_bfloat16* dpre, const __nv_bfloat16* dout,
                         const __nv_bfloat16* x, const __nv_bfloat16* c_fc, const __nv_bfloat16* c_proj,
                         const __nv_bfloat16* pre, const __nv_bfloat16* post, int T, int C, int H,
                         cudaStream_t stream) {
    require_shape(mlp_shape_error(T, C, H), "mlp_backward");
    const int64_t n = static_cast<int64_t>(T) * H;
    if (post == nullptr) {
        relu_square_forward(dpre, pre, n, stream);
        post = dpre;
    }
    const float beta = accumulate_weight_grads ? 1.0f : 0.0f;
    matmul_bf16(lt, dc_proj, post, true, dout, false, H, C, T, stream, 1.0f, beta);
    matmul_bf16(lt, dpre, dout, false, c_proj, true, T, H, C, stream);
    relu_square_backward(dpre, dpre, pre, n, stream);
    matmul_backward_weight(lt, dc_fc, dpre, x, T, H, C, stream, accumulate_weight_grads);
    matmul_backward_input(lt, dx, dpre, c_fc, T, H, C, stream);
}

// ---- lambda-scaled weight: the attention's F.linear(x, sa_lambda * w), with sa_lambda a scalar
// parameter read from device memory ----

// w_eff = lambda * w, computed in fp32 and rounded to bf16 once
__global__ void __launch_bounds__(kPackThreads)
    lambda_scaled_weight_forward_kernel(__nv_bfloat16* w_eff, const __nv_bfloat16* w, const float* lambda, int64_t n) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    const float l = *lambda;
    const Pack128<__nv_bfloat16> p = load128(w + i);
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) out[k] = __float2bfloat16(l * __bfloat162float(p[k]));
    store128(w_eff + i, out);
}
inline void lambda_scaled_weight_forward(__nv_bfloat16* w_eff, const __nv_bfloat16* w, const float* lambda, int64_t n,
                                         cudaStream_t stream) {
    require_shape(bf16_packs_shape_error(n, {w_eff, w}), "lambda_scaled_weight_forward");
    if (n == 0) return;
    launch(lambda_scaled_weight_forward_kernel, bf16_packs_grid(n), dim3(kPackThreads), 0, stream, w_eff, w, lambda, n);
    CUDA_CHECK_LAUNCH();
}

// The backward's block count depends on n only, so the partial sums (and dlambda) are the same bits
// on every run and every GPU.
constexpr int kLambdaGradMaxBlocks = 1024;
inline int lambda_scaled_weight_backward_blocks(int64_t n) {
    const int64_t blocks = ceil_div<int64_t>(n / 8, kPackThreads);
    return static_cast<int>(std::clamp<int64_t>(blocks, 1, kLambdaGradMaxBlocks));
}
inline size_t lambda_scaled_weight_backward_scratch_bytes(int64_t n) {
    return static_cast<size_t>(lambda_scaled_weight_backward_blocks(n)) * sizeof(float);
}

// dw (+)= lambda * dw_eff (fp32, rounded once); partials[block] = this block's part of sum(dw_eff * w)
__global__ void __launch_bounds__(kPackThreads)
    lambda_scaled_weight_backward_kernel(__nv_bfloat16* dw, float* partials, const __nv_bfloat16* dw_eff,
                                         const __nv_bfloat16* w, const float* lambda, int64_t n, bool accumulate) {
    const float l = *lambda;
    float dot = 0.0f;
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * 8) {
        const Pack128<__nv_bfloat16> g = load128(dw_eff + i), p = load128(w + i);
        Pack128<__nv_bfloat16> d =
            accumulate ? load128(dw + i) : Pack128<__nv_bfloat16>::filled(__float2bfloat16(0.0f));
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const float gk = __bfloat162float(g[k]);
            d[k] = __float2bfloat16(__bfloat162float(d[k]) + l * gk);
            dot += gk * __bfloat162float(p[k]);
        }
        store128(dw + i, d);
    }
    dot = block_reduce_sum(dot);
    if (threadIdx.x == 0) partials[blockIdx.x] = dot;
}

// dw (+)= lambda * dw_eff; dlambda (+)= sum(dw_eff * w), summed deterministically through `scratch`
// (lambda_scaled_weight_backward_scratch_bytes(n)). dw_eff is the bf16 gradient of w_eff.
inline void lambda_scaled_weight_backward(__nv_bfloat16* dw, float* dlambda, float* scratch,
                                          const __nv_bfloat16* dw_eff, const __nv_bfloat16* w, const float* lambda,
                                          int64_t n, bool accumulate_dw, bool accumulate_dlambda, cudaStream_t stream) {
    require_shape(bf16_packs_shape_error(n, {dw, dw_eff, w}), "lambda_scaled_weight_backward");
    const int blocks = lambda_scaled_weight_backward_blocks(n);
    launch(lambda_scaled_weight_backward_kernel, dim3(blocks), dim3(kPackThreads), 0, stream, dw, scratch, dw_eff, w,
           lambda, n, accumulate_dw);
    CUDA_CHECK_LAUNCH();
    sum_fixed_order(dlambda, scratch, blocks, 1.0f, accumulate_dlambda, stream);
}
