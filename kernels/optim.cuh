// The optimizer's math on one rank's shard: Adam with cautious weight decay (bf16 or fp32
// parameters), NorMuon (momentum, Polar Express through cuBLASLt, low-rank variance normalization,
// cautious weight decay on a bf16 parameter kept precise by a 16-bit mantissa buffer), and the host
// functions that turn a step's learning rate and momentum (the trainer's schedules) into the kernels'
// step scalars, effective weight decay included.
// Communication is not here: the kernels take a rank's shard (gradients already reduced and averaged).
//
// Per-step scalars (Adam's step size and decay; NorMuon's lerp weights, lr and decay) are read by the
// kernels from device memory (AdamStepScalars, NorMuonStepScalars), never passed by value: a captured
// CUDA graph replays unchanged while the trainer uploads the new values each step (one small
// cudaMemcpyAsync from a pinned buffer; keep two host copies so the host never overwrites one that is
// still in flight). Values constant over a run (betas, eps, shapes) are kernel arguments.
//
// Rounding points (upstream runs its updates under torch.compile, which fuses each chain and elides
// bf16 round trips inside a fused region; record 71 runs the two momentum lerps eagerly, record 80
// inside the compiled polar_express):
// - Adam: every state and the update in fp32; the bf16 parameter is rounded once, p = bf16(p - update).
// - NorMuon momentum: torch's lerp, m = fma(w, g - m, m) for w < 0.5, else fma(w - 1, g - m, g)
//   (its CUDA kernel's form, contracted to one fma by nvcc; inductor's lerp forms the same fma), each
//   fp32 value rounded once. The momentum's weight 1 - mu (MomentumComplement): record
//   71 passes a Python float, float(1 - mu) from the double; record 80 fills a 0-D fp32 tensor with mu
//   and forms 1 - float(mu) in fp32 inside the compiled polar_express (exact, but not the same float).
// - Polar Express input (PolarExpressInput, NorMuonNumerics below): upstream writes X = G.bfloat16(), then
//   X / (X.norm() * 1.02 + 1e-6), in the same words in records 71 and 80. normalize_fp32 (the default,
//   record 71's pinned behaviour): X = bf16(u / (||u||_F * 1.02 + 1e-6)) from the fp32 u, one rounding:
//   inside the compiled polar_express, G.bfloat16() feeds the norm and the division directly, so the
//   fused kernels never materialize bf16(u). round_first (the PyTorch reference's record 80, which reads
//   the cast as kept): X = bf16(bf16(u) / (||bf16(u)||_F * 1.02 + 1e-6)), the norm an fp32 sum of the bf16
//   values' squares and the division in fp32. Either way the norm is a deterministic fp32 sum of
//   per-block partials. Which one upstream runs rests on inductor, not on the record: with its default
//   config an explicit bf16 cast inside a fused kernel becomes a conversion to its fp32 compute type
//   (no rounding; only stores to bf16 buffers round), which is record 71's reading of both casts here.
// - Polar Express iterations: A = bf16(X X^T), B = bf16(c A A + b A) (one cuBLASLt call, fp32
//   epilogue, as upstream's ba_plus_cAA), X' = bf16(a X + B X) fused by cuBLASLt's beta (upstream's
//   baddbmm) when rows <= 1024; for rows > 1024 upstream splits it (bmm, then add_): C = bf16(B X),
//   X' = bf16(fma(a, X, C)), two roundings, reproduced here. Tall matrices (rows > cols) are not
//   transposed: the same products are formed as A = X^T X and X' = a X + X B^T on the stored layout.
// - Variance reduction: all statistics in fp32 from the bf16 v. VarianceScale::fp32 (the default, record
//   71's): v is rounded once, v' = bf16(v * final_scale) with final_scale in fp32 (the compiled graph
//   computes final_scale inside the kernel that scales v, so its .type_as(bf16) is elided).
//   VarianceScale::bf16 (the reference's record 80, the cast kept): v' = bf16(v * bf16(final_scale)).
// - NorMuon update: p32 = (p << 16 | mantissa) as fp32, mask = v' * p32 >= 0, then
//   p32 = (p32 - ((p32 * mask) * wd) * lr) - v' * lr with every operation rounded (no fma), and the
//   new bits are split by truncation: the top half is the bf16 parameter, the bottom half the mantissa.
#pragma once
#include "matmul.cuh"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

constexpr int kOptimThreads = 256;
constexpr int kOptimVec = 8;  // elements per thread per step: 16 bytes of bf16, 32 of fp32

// ---- 8 consecutive elements as floats, through 16-byte loads and stores (p 16-byte aligned) ----
__device__ __forceinline__ void optim_load8(const __nv_bfloat16* p, float (&out)[kOptimVec]) {
    const Pack128<__nv_bfloat16> v = load128(p);
#pragma unroll
    for (int k = 0; k < kOptimVec; ++k) out[k] = __bfloat162float(v[k]);
}
__device__ __forceinline__ void optim_load8(const float* p, float (&out)[kOptimVec]) {
    const Pack128<float> lo = load128(p), hi = load128(p + 4);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        out[k] = lo[k];
        out[k + 4] = hi[k];
    }
}
__device__ __forceinline__ void optim_store8(__nv_bfloat16* p, const float (&in)[kOptimVec]) {
    Pack128<__nv_bfloat16> v;
#pragma unroll
    for (int k = 0; k < kOptimVec; ++k) v[k] = __float2bfloat16(in[k]);
    store128(p, v);
}
__device__ __forceinline__ void optim_store8(float* p, const float (&in)[kOptimVec]) {
    Pack128<float> lo, hi;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        lo[k] = in[k];
        hi[k] = in[k + 4];
    }
    store128(p, lo);
    store128(p + 4, hi);
}

__device__ __forceinline__ float optim_round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// torch's lerp(self, end, w): the form it picks by |w| keeps the result exact at w = 0 and w = 1.
__device__ __forceinline__ float optim_lerp(float self, float end, float w) {
    const float d = end - self;
    return fabsf(w) < 0.5f ? __fmaf_rn(w, d, self) : __fmaf_rn(w - 1.0f, d, end);
}

// =====================================================================================
// Adam
// =====================================================================================

// Constant over a run: the betas as fp32, with 1 - beta computed in double first (as upstream's
// Python does before the value reaches the fp32 kernel), and eps.
struct AdamHyper {
    float beta1, one_minus_beta1, beta2, one_minus_beta2, eps;
    // The gradient the update uses is T(stored * grad_scale): the sparse bigram exchange leaves its
    // slice summed over the ranks, and the average's scaling rides on Adam's read of it (bit for bit
    // what a separate pass x = bf16(x * scale) gave, without that pass over the slice).
    float grad_scale = 1.0f;
};
inline AdamHyper adam_hyper(double beta1, double beta2, double eps) {
    return {static_cast<float>(beta1), static_cast<float>(1.0 - beta1), static_cast<float>(beta2),
            static_cast<float>(1.0 - beta2), static_cast<float>(eps)};
}

// One step's scalars for one Adam parameter, in device memory.
struct AdamStepScalars {
    float step_size;  // lr * sqrt(1 - beta2^t) / (1 - beta1^t)
    float eff_wd;     // lr * lr * weight_decay * wd_mul
};
// lr = base_lr * lr_schedule * lr_mul (upstream: p_cfg.lr = initial_lr * get_lr(step), times lr_mul);
// t counts this parameter's Adam steps from 1. Double arithmetic in upstream's order, rounded once.
inline AdamStepScalars adam_step_scalars(double base_lr, double lr_schedule, double lr_mul, double beta1, double beta2,
                                         double weight_decay, double wd_mul, int t) {
    const double lr = base_lr * lr_schedule * lr_mul;
    const double bias1 = 1.0 - std::pow(beta1, t), bias2 = 1.0 - std::pow(beta2, t);
    return {static_cast<float>(lr * (std::pow(bias2, 0.5) / bias1)),
            static_cast<float>(lr * lr * weight_decay * wd_mul)};
}

inline std::string adam_shape_error(int64_t n) {
    if (n < 0) return "element count " + std::to_string(n) + " is negative";
    return "";
}

// m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; u = m / (sqrt(v) + eps) * step; u += eff_wd p where
// u p > 0 (cautious decay); returns p - u. All fp32.
__device__ __forceinline__ float adam_update_element(float p, float g, float& m, float& v, const AdamHyper& h,
                                                     float step_size, float eff_wd) {
    m = m * h.beta1 + g * h.one_minus_beta1;
    v = v * h.beta2 + h.one_minus_beta2 * g * g;
    float update = m / (sqrtf(v) + h.eps) * step_size;
    if (update * p > 0.0f) update += eff_wd * p;
    return p - update;
}

// One Adam step on n elements; T is the parameter's and its gradient's type (bf16, or fp32 for the
// scalars and x0_lambdas). Each thread takes 8 consecutive elements: 16-byte accesses when every
// buffer is 16-byte aligned (`vectorized`), element by element in the ragged tail.
template <class T>
__global__ void __launch_bounds__(kOptimThreads)
    adam_step_kernel(T* param, float* exp_avg, float* exp_avg_sq, const T* grad, int64_t n, AdamHyper h,
                     const AdamStepScalars* scalars, bool vectorized) {
    const int64_t i0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kOptimVec;
    if (i0 >= n) return;
    const float step_size = scalars->step_size, eff_wd = scalars->eff_wd;
    if (vectorized && i0 + kOptimVec <= n) {
        float p[kOptimVec], g[kOptimVec], m[kOptimVec], v[kOptimVec];
        optim_load8(param + i0, p);
        optim_load8(grad + i0, g);
        if (h.grad_scale != 1.0f)
#pragma unroll
            for (int k = 0; k < kOptimVec; ++k) g[k] = static_cast<float>(static_cast<T>(g[k] * h.grad_scale));
        optim_load8(exp_avg + i0, m);
        optim_load8(exp_avg_sq + i0, v);
#pragma unroll
        for (int k = 0; k < kOptimVec; ++k) p[k] = adam_update_element(p[k], g[k], m[k], v[k], h, step_size, eff_wd);
        optim_store8(exp_avg + i0, m);
        optim_store8(exp_avg_sq + i0, v);
        optim_store8(param + i0, p);
        return;
    }
    for (int64_t i = i0; i < n && i < i0 + kOptimVec; ++i) {
        float m = exp_avg[i], v = exp_avg_sq[i];
        float g = static_cast<float>(grad[i]);
        if (h.grad_scale != 1.0f) g = static_cast<float>(static_cast<T>(g * h.grad_scale));
        const float p = adam_update_element(static_cast<float>(param[i]), g, m, v, h, step_size, eff_wd);
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = static_cast<T>(p);
    }
}
// Reads param, grad, both moments and the scalars, writes param and the moments; ~12 operations per element.
template <class T>
inline Work adam_step_work(int64_t n) {
    const double e = static_cast<double>(n);
    return Work{.name = "adam_step", .flops = 12 * e, .bytes_read = e * (2 * sizeof(T) + 8) + sizeof(AdamStepScalars),
                .bytes_written = e * (sizeof(T) + 8)};
}
// Adam on a shard of n elements: param and grad of type T (bf16 or float), fp32 moments, this step's
// scalars in device memory.
template <class T>
inline void adam_step(T* param, float* exp_avg, float* exp_avg_sq, const T* grad, int64_t n, const AdamHyper& h,
                      const AdamStepScalars* scalars, cudaStream_t stream) {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float>, "Adam parameters are bf16 or fp32");
    require_shape(adam_shape_error(n), "adam_step");
    if (n == 0) return;
    const bool vectorized = all_aligned16({param, exp_avg, exp_avg_sq, grad});
    const int64_t blocks = ceil_div<int64_t>(ceil_div<int64_t>(n, kOptimVec), kOptimThreads);
    launch(adam_step_work<T>(n), adam_step_kernel<T>, dim3(static_cast<unsigned>(blocks)), dim3(kOptimThreads), 0,
           stream, param, exp_avg, exp_avg_sq, grad, n, h, scalars, vectorized);
    CUDA_CHECK_LAUNCH();
}

// =====================================================================================
// NorMuon
// =====================================================================================

// How the momentum lerp's weight 1 - mu is formed (header comment, "NorMuon momentum").
enum class MomentumComplement : int32_t {
    double_then_fp32,  // float(1 - mu)
    fp32,              // 1 - float(mu), in fp32
};

// One step's scalars for one NorMuon bank, in device memory.
struct NorMuonStepScalars {
    float momentum_weight;  // 1 - mu: weight of the gradient in the momentum lerp
    float update_weight;    // mu: weight of the momentum in the update lerp
    float lr;               // lr_mul * lr (the shape multiplier included; per-matrix multipliers apply on top)
    float wd;               // wd_mul * weight_decay * lr
};
// lr = base_lr * lr_schedule; lr_mul carries the shape multiplier (normuon_shape_lr_mul) times the
// table's lr_mul. Per matrix the kernel uses float(lr_mul * lr) * matrix_lr_mul[i], which equals
// upstream's float(lr_mul * matrix_lr_mul[i] * lr) exactly for power-of-two multipliers (1 and 2).
inline NorMuonStepScalars normuon_step_scalars(double base_lr, double lr_schedule, double lr_mul, double weight_decay,
                                               double wd_mul, double momentum,
                                               MomentumComplement complement = MomentumComplement::double_then_fp32) {
    const double lr = base_lr * lr_schedule;
    const float momentum_weight = complement == MomentumComplement::fp32 ? 1.0f - static_cast<float>(momentum)
                                                                        : static_cast<float>(1.0 - momentum);
    return {momentum_weight, static_cast<float>(momentum), static_cast<float>(lr_mul * lr),
            static_cast<float>(wd_mul * weight_decay * lr)};
}
// max(1, rows/cols)^0.5: tall matrices take a larger step.
inline double normuon_shape_lr_mul(int rows, int cols) {
    return std::pow(std::max(1.0, static_cast<double>(rows) / static_cast<double>(cols)), 0.5);
}
// The per-matrix multiplier of matrix `global_index` of a bank: in the MLP bank (layer-major pairs
// c_fc, c_proj) odd matrices are c_proj and take twice the lr.
inline float normuon_matrix_lr_mul(bool mlp_bank, int global_index) {
    return mlp_bank && global_index % 2 == 1 ? 2.0f : 1.0f;
}

// Polar Express (5 iterations, safety factor 2e-2, cushion 2): X <- a X + (b A + c A^2) X, A = X X^T.
constexpr int kPolarExpressIters = 5;
constexpr double kPolarExpressCoeffs[kPolarExpressIters][3] = {
    {8.156554524902461, -22.48329292557795, 15.878769915207462},
    {4.042929935166739, -2.808917465908714, 0.5000178451051316},
    {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
    {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
    {2.3465413258596377, -1.7097828382687081, 0.42323551169305323},
};
constexpr float kPolarExpressNormScale = 1.02f;  // (1 + 2e-2): spectral norm below 1 with margin
constexpr float kPolarExpressNormEps = 1e-6f;
constexpr int kPolarExpressSplitRows = 1024;  // upstream splits a X + B X into two kernels above this
constexpr float kNorMuonClamp = 1e-10f;       // floor of the second moment and of the rescaled norm

// The two bf16 casts of upstream's NorMuon that a compiled graph may elide (header comment, "Rounding
// points"); the defaults are record 71's kernels, bit for bit.
enum class PolarExpressInput : int32_t {
    normalize_fp32,  // X = bf16(u / (||u|| * 1.02 + 1e-6))
    round_first,     // X = bf16(bf16(u) / (||bf16(u)|| * 1.02 + 1e-6))
};
enum class VarianceScale : int32_t {
    fp32,  // v' = bf16(v * final_scale)
    bf16,  // v' = bf16(v * bf16(final_scale))
};
// normuon_step reads input and scale; momentum is for normuon_step_scalars, which forms the weights
// normuon_step reads from device memory.
struct NorMuonNumerics {
    PolarExpressInput input = PolarExpressInput::normalize_fp32;
    VarianceScale scale = VarianceScale::fp32;
    MomentumComplement momentum = MomentumComplement::double_then_fp32;
};
// Record 71's pinned kernels, and record 80 as the PyTorch reference models it (r80_config: both casts
// kept; the momentum's complement in fp32).
constexpr NorMuonNumerics kNorMuonNumericsR71{PolarExpressInput::normalize_fp32, VarianceScale::fp32,
                                              MomentumComplement::double_then_fp32};
constexpr NorMuonNumerics kNorMuonNumericsR80{PolarExpressInput::round_first, VarianceScale::bf16,
                                              MomentumComplement::fp32};

constexpr int kNorMuonElemsPerBlock = kOptimThreads * kOptimVec * 4;  // momentum, normalize, update kernels
constexpr int kNorMuonVarianceRows = 32;                              // row statistics: 8 warps x 4 rows
constexpr int kNorMuonVarianceCols = 64;                              // column statistics: 8 packs x 32 slices

// Shape of one rank's shard of a bank: `count` row-major (rows, cols) matrices, back to back.
inline std::string normuon_shape_error(int count, int rows, int cols) {
    if (count < 1) return "matrix count " + std::to_string(count) + " must be at least 1";
    if (rows < 8 || cols < 8 || rows % 8 != 0 || cols % 8 != 0)
        return "matrix shape " + std::to_string(rows) + "x" + std::to_string(cols) +
               ": rows and cols must be positive multiples of 8 (rows move in 16-byte packs)";
    if (count > 65535) return "matrix count " + std::to_string(count) + " exceeds the grid's y dimension";
    return "";
}
__host__ __device__ inline int64_t normuon_matrix_elems(int rows, int cols) {
    return static_cast<int64_t>(rows) * cols;
}
// The second moment of a matrix has one value per row when rows >= cols (reduced over columns),
// else one per column.
__host__ __device__ inline bool normuon_reduces_rows(int rows, int cols) { return rows >= cols; }
__host__ __device__ inline int normuon_second_moment_len(int rows, int cols) {
    return normuon_reduces_rows(rows, cols) ? rows : cols;
}
// Blocks per matrix of the elementwise kernels: the norm's partial sums come one per block.
inline int normuon_elementwise_blocks(int rows, int cols) {
    return static_cast<int>(ceil_div<int64_t>(normuon_matrix_elems(rows, cols), kNorMuonElemsPerBlock));
}
// Elements of a shard of `count` (rows, cols) matrices, and bytes of its per-block partial sums (one
// per elementwise block) and of one fp32 per reduced row or column: the units of NorMuon's Work.
inline double normuon_shard_elems(int count, int rows, int cols) {
    return static_cast<double>(count) * normuon_matrix_elems(rows, cols);
}
inline double normuon_norm_partials_bytes(int count, int rows, int cols) {
    return 4.0 * count * normuon_elementwise_blocks(rows, cols);
}
inline double normuon_second_moment_bytes(int count, int rows, int cols) {
    return 4.0 * count * normuon_second_moment_len(rows, cols);
}
// Blocks per matrix of the variance statistics: two partial sums each.
inline int normuon_variance_blocks(int rows, int cols) {
    return normuon_reduces_rows(rows, cols) ? ceil_div(rows, kNorMuonVarianceRows)
                                            : ceil_div(cols, kNorMuonVarianceCols);
}

// ---- momentum ----
// m = lerp(m, g, 1 - mu); partial sums of x^2, x = u = lerp(g, m, mu) (round_first: x = bf16(u)), one
// per block, for Polar Express's Frobenius norm.
__global__ void __launch_bounds__(kOptimThreads)
    normuon_momentum_kernel(float* momentum, float* norm_partials, const __nv_bfloat16* grad,
                            const NorMuonStepScalars* scalars, int64_t matrix_elems, PolarExpressInput input) {
    const int64_t base = static_cast<int64_t>(blockIdx.y) * matrix_elems;
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kNorMuonElemsPerBlock;
    const float wm = scalars->momentum_weight, wu = scalars->update_weight;
    float sumsq = 0.0f;
    for (int64_t i = begin + threadIdx.x * kOptimVec; i < matrix_elems && i < begin + kNorMuonElemsPerBlock;
         i += kOptimThreads * kOptimVec) {
        float g[kOptimVec], m[kOptimVec];
        optim_load8(grad + base + i, g);
        optim_load8(momentum + base + i, m);
#pragma unroll
        for (int k = 0; k < kOptimVec; ++k) {
            m[k] = optim_lerp(m[k], g[k], wm);
            const float u = optim_lerp(g[k], m[k], wu);
            const float x = input == PolarExpressInput::round_first ? optim_round_bf16(u) : u;
            sumsq += x * x;
        }
        optim_store8(momentum + base + i, m);
    }
    sumsq = block_reduce_sum(sumsq);
    if (threadIdx.x == 0) norm_partials[static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x] = sumsq;
}
// Reads grad, momentum and the scalars, writes momentum and the norm's partials; two lerps and a
// square-add per element.
inline Work normuon_momentum_work(int count, int rows, int cols) {
    const double n = normuon_shard_elems(count, rows, cols);
    return Work{.name = "normuon_momentum", .flops = 6 * n, .bytes_read = 6 * n + sizeof(NorMuonStepScalars),
                .bytes_written = 4 * n + normuon_norm_partials_bytes(count, rows, cols)};
}
// Updates the fp32 momentum of `count` (rows, cols) matrices from the bf16 gradient and leaves
// normuon_elementwise_blocks(rows, cols) partial sums of u^2 (round_first: bf16(u)^2) per matrix in
// norm_partials.
inline void normuon_momentum(float* momentum, float* norm_partials, const __nv_bfloat16* grad,
                             const NorMuonStepScalars* scalars, int count, int rows, int cols, cudaStream_t stream,
                             PolarExpressInput input = PolarExpressInput::normalize_fp32) {
    require_shape(normuon_shape_error(count, rows, cols), "normuon_momentum");
    kernel_require(all_aligned16({momentum, grad}), "normuon_momentum: momentum and grad must be 16-byte aligned");
    launch(normuon_momentum_work(count, rows, cols), normuon_momentum_kernel,
           dim3(normuon_elementwise_blocks(rows, cols), count), dim3(kOptimThreads), 0, stream, momentum, norm_partials,
           grad, scalars, normuon_matrix_elems(rows, cols), input);
    CUDA_CHECK_LAUNCH();
}

// ---- Polar Express ----
// x = bf16(u / (||u||_F * 1.02 + 1e-6)) (round_first: u replaced by bf16(u), in the norm too), u =
// lerp(g, m, mu) recomputed from the updated momentum (the same fp32 operations as
// normuon_momentum_kernel, so the same u). Every block of a matrix sums the matrix's partials in the
// same fixed order.
__global__ void __launch_bounds__(kOptimThreads)
    polar_express_normalize_kernel(__nv_bfloat16* x, const float* momentum, const __nv_bfloat16* grad,
                                   const float* norm_partials, const NorMuonStepScalars* scalars,
                                   int64_t matrix_elems, PolarExpressInput input) {
    const int blocks = static_cast<int>(gridDim.x);
    const float s = block_sum_fixed_order(norm_partials + static_cast<int64_t>(blockIdx.y) * blocks, blocks);
    const float denom = __fmaf_rn(sqrtf(s), kPolarExpressNormScale, kPolarExpressNormEps);
    const float wu = scalars->update_weight;
    const int64_t base = static_cast<int64_t>(blockIdx.y) * matrix_elems;
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kNorMuonElemsPerBlock;
    for (int64_t i = begin + threadIdx.x * kOptimVec; i < matrix_elems && i < begin + kNorMuonElemsPerBlock;
         i += kOptimThreads * kOptimVec) {
        float g[kOptimVec], m[kOptimVec], out[kOptimVec];
        optim_load8(grad + base + i, g);
        optim_load8(momentum + base + i, m);
#pragma unroll
        for (int k = 0; k < kOptimVec; ++k) {
            const float u = optim_lerp(g[k], m[k], wu);
            out[k] = (input == PolarExpressInput::round_first ? optim_round_bf16(u) : u) / denom;
        }
        optim_store8(x + base + i, out);
    }
}
// Reads grad, momentum, the norm's partials and the scalars, writes x; a lerp and a division per element.
inline Work polar_express_normalize_work(int count, int rows, int cols) {
    const double n = normuon_shard_elems(count, rows, cols);
    return Work{.name = "polar_express_normalize", .flops = 3 * n,
                .bytes_read = 6 * n + normuon_norm_partials_bytes(count, rows, cols) + sizeof(NorMuonStepScalars),
                .bytes_written = 2 * n};
}
// Writes the normalized bf16 input of Polar Express for `count` matrices; norm_partials as left by
// normuon_momentum for the same shape and the same `input`.
inline void polar_express_normalize(__nv_bfloat16* x, const float* momentum, const __nv_bfloat16* grad,
                                    const float* norm_partials, const NorMuonStepScalars* scalars, int count, int rows,
                                    int cols, cudaStream_t stream,
                                    PolarExpressInput input = PolarExpressInput::normalize_fp32) {
    require_shape(normuon_shape_error(count, rows, cols), "polar_express_normalize");
    kernel_require(all_aligned16({x, momentum, grad}),
                   "polar_express_normalize: x, momentum and grad must be 16-byte aligned");
    launch(polar_express_normalize_work(count, rows, cols), polar_express_normalize_kernel,
           dim3(normuon_elementwise_blocks(rows, cols), count), dim3(kOptimThreads), 0, stream, x, momentum, grad,
           norm_partials, scalars, normuon_matrix_elems(rows, cols), input);
    CUDA_CHECK_LAUNCH();
}

// out = bf16(fma(a, x, out)): the second half of upstream's split a X + B X (out holds bf16(B X)).
__global__ void __launch_bounds__(kOptimThreads)
    polar_express_add_scaled_kernel(__nv_bfloat16* out, const __nv_bfloat16* x, float a, int64_t n) {
    for (int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kOptimVec; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x * kOptimVec) {
        float o[kOptimVec], v[kOptimVec];
        optim_load8(out + i, o);
        optim_load8(x + i, v);
#pragma unroll
        for (int k = 0; k < kOptimVec; ++k) o[k] = __fmaf_rn(a, v[k], o[k]);
        optim_store8(out + i, o);
    }
}
// Reads out and x, writes out; a multiply-add per element.
inline Work polar_express_add_scaled_work(int64_t n) {
    return Work{.name = "polar_express_add_scaled", .flops = 2.0 * n, .bytes_read = 4.0 * n, .bytes_written = 2.0 * n};
}
inline void polar_express_add_scaled(__nv_bfloat16* out, const __nv_bfloat16* x, float a, int64_t n,
                                     cudaStream_t stream) {
    const int64_t blocks = std::min<int64_t>(ceil_div<int64_t>(n / kOptimVec, kOptimThreads), 4096);
    launch(polar_express_add_scaled_work(n), polar_express_add_scaled_kernel,
           dim3(static_cast<unsigned>(std::max<int64_t>(blocks, 1))), dim3(kOptimThreads), 0, stream, out, x, a, n);
    CUDA_CHECK_LAUNCH();
}

// One Polar Express iteration on `count` (rows, cols) bf16 matrices: x_out = a x + (b A + c A A) x with
// A = x x^T (s x s, s = min(rows, cols)), in the (rows, cols) layout of x. gram and poly hold count
// (s, s) matrices; x_out must not overlap x. `split` picks upstream's two-kernel form of a X + B X.
inline void polar_express_iteration(CublasLt& lt, __nv_bfloat16* x_out, const __nv_bfloat16* x, __nv_bfloat16* gram,
                                    __nv_bfloat16* poly, int count, int rows, int cols, float a, float b, float c,
                                    bool split, cudaStream_t stream) {
    require_shape(normuon_shape_error(count, rows, cols), "polar_express_iteration");
    const bool tall = rows > cols;  // upstream works on X^T; here the same products on the stored layout
    const int s = std::min(rows, cols), l = std::max(rows, cols);
    const int64_t xs = normuon_matrix_elems(rows, cols), ss = static_cast<int64_t>(s) * s;
    const __nv_bfloat16* none = nullptr;
    // A = X X^T (s x s): for a tall stored matrix X^T, that is stored^T @ stored
    if (tall)
        matmul_bf16(lt, gram, x, true, x, false, s, s, l, stream, 1.0f, 0.0f, none, {count, xs, xs, ss},
                    "gemm_polar_gram");
    else
        matmul_bf16(lt, gram, x, false, x, true, s, s, l, stream, 1.0f, 0.0f, none, {count, xs, xs, ss},
                    "gemm_polar_gram");
    // B = c A A + b A, one rounding
    matmul_bf16(lt, poly, gram, false, gram, false, s, s, s, stream, c, b, gram, {count, ss, ss, ss},
                "gemm_polar_poly");
    // X' = a X + B X; stored tall: X'^T = a X^T + X^T B^T
    const float beta = split ? 0.0f : a;
    const __nv_bfloat16* add = split ? none : x;
    if (tall)
        matmul_bf16(lt, x_out, x, false, poly, true, l, s, s, stream, 1.0f, beta, add, {count, xs, ss, xs},
                    "gemm_polar_update");
    else
        matmul_bf16(lt, x_out, poly, false, x, false, s, l, s, stream, 1.0f, beta, add, {count, ss, xs, xs},
                    "gemm_polar_update");
    if (split) polar_express_add_scaled(x_out, x, a, xs * count, stream);
}

// The five Polar Express iterations on `count` (rows, cols) bf16 matrices held in x, normalized;
// x_other has x's size. Returns the buffer (x or x_other) that holds the result.
inline __nv_bfloat16* polar_express_iterate(CublasLt& lt, __nv_bfloat16* x, __nv_bfloat16* x_other, __nv_bfloat16* gram,
                                            __nv_bfloat16* poly, int count, int rows, int cols, bool split,
                                            cudaStream_t stream) {
    for (const auto& coeff : kPolarExpressCoeffs) {
        polar_express_iteration(lt, x_other, x, gram, poly, count, rows, cols, static_cast<float>(coeff[0]),
                                static_cast<float>(coeff[1]), static_cast<float>(coeff[2]), split, stream);
        std::swap(x, x_other);
    }
    return x;
}

// ---- variance reduction ----
// The statistics of one reduced row or column j of v: mean = mean(v^2) over it; the second moment
// lerps toward it; step = rsqrt(max(buf, 1e-10)). Returns the two terms of the block's partial sums:
// mean (for ||v||^2 = n * sum(mean)) and n * mean * step^2 (for ||v * step||^2).
__device__ __forceinline__ void normuon_reduced_stats(float sumsq, int n, float* second_moment, float* step, float w,
                                                      float& mean_term, float& scaled_term) {
    const float mean = sumsq / static_cast<float>(n);
    const float buf = optim_lerp(*second_moment, mean, w);
    *second_moment = buf;
    const float st = rsqrtf(fmaxf(buf, kNorMuonClamp));
    *step = st;
    mean_term = mean;
    scaled_term = (mean * static_cast<float>(n)) * (st * st);
}

// Row statistics (rows >= cols): a warp per row, 4 rows per warp; partials[2 * (matrix, block) + {0, 1}].
__global__ void __launch_bounds__(kOptimThreads)
    normuon_row_variance_kernel(float* second_moment, float* step, float* partials, const __nv_bfloat16* v, int rows,
                                int cols, float second_moment_weight) {
    __shared__ float warp_terms[kOptimThreads / 32][2];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, mat = blockIdx.y;
    const __nv_bfloat16* vm = v + static_cast<int64_t>(mat) * normuon_matrix_elems(rows, cols);
    float mean_sum = 0.0f, scaled_sum = 0.0f;  // lane 0's, over the warp's rows in order
    for (int k = 0; k < kNorMuonVarianceRows / (kOptimThreads / 32); ++k) {
        const int r = blockIdx.x * kNorMuonVarianceRows + k * (kOptimThreads / 32) + warp;
        if (r >= rows) break;  // the whole warp leaves together
        float s = 0.0f;
        for (int c = lane * kOptimVec; c < cols; c += 32 * kOptimVec) {
            float x[kOptimVec];
            optim_load8(vm + static_cast<int64_t>(r) * cols + c, x);
#pragma unroll
            for (int q = 0; q < kOptimVec; ++q) s += x[q] * x[q];
        }
        s = warp_reduce_sum(s);
        if (lane == 0) {
            const int64_t j = static_cast<int64_t>(mat) * rows + r;
            float mt, st;
            normuon_reduced_stats(s, cols, second_moment + j, step + j, second_moment_weight, mt, st);
            mean_sum += mt;
            scaled_sum += st;
        }
    }
    if (lane == 0) {
        warp_terms[warp][0] = mean_sum;
        warp_terms[warp][1] = scaled_sum;
    }
    store_block_partials(partials + 2 * (static_cast<int64_t>(mat) * gridDim.x + blockIdx.x), warp_terms);
}

// Column statistics (rows < cols): a block takes 64 columns; thread (slice, pack) sums rows
// slice, slice + 32, ... of its 8 columns, then the slices are added in order.
__global__ void __launch_bounds__(kOptimThreads)
    normuon_col_variance_kernel(float* second_moment, float* step, float* partials, const __nv_bfloat16* v, int rows,
                                int cols, float second_moment_weight) {
    constexpr int packs = kNorMuonVarianceCols / kOptimVec, slices = kOptimThreads / packs;
    __shared__ float slice_sums[slices][kNorMuonVarianceCols];
    __shared__ float warp_terms[2][2];
    const int mat = blockIdx.y, pack = threadIdx.x % packs, slice = threadIdx.x / packs;
    const int c0 = blockIdx.x * kNorMuonVarianceCols;
    const __nv_bfloat16* vm = v + static_cast<int64_t>(mat) * normuon_matrix_elems(rows, cols);
    float acc[kOptimVec] = {};
    const int c = c0 + pack * kOptimVec;
    if (c < cols) {
        for (int r = slice; r < rows; r += slices) {
            float x[kOptimVec];
            optim_load8(vm + static_cast<int64_t>(r) * cols + c, x);
#pragma unroll
            for (int q = 0; q < kOptimVec; ++q) acc[q] += x[q] * x[q];
        }
    }
#pragma unroll
    for (int q = 0; q < kOptimVec; ++q) slice_sums[slice][pack * kOptimVec + q] = acc[q];
    __syncthreads();
    if (threadIdx.x < kNorMuonVarianceCols) {  // two whole warps
        float mt = 0.0f, st = 0.0f;
        const int col = c0 + threadIdx.x;
        if (col < cols) {
            float s = 0.0f;
            for (int sl = 0; sl < slices; ++sl) s += slice_sums[sl][threadIdx.x];
            const int64_t j = static_cast<int64_t>(mat) * cols + col;
            normuon_reduced_stats(s, rows, second_moment + j, step + j, second_moment_weight, mt, st);
        }
        mt = warp_reduce_sum(mt);
        st = warp_reduce_sum(st);
        if (threadIdx.x % 32 == 0) {
            warp_terms[threadIdx.x / 32][0] = mt;
            warp_terms[threadIdx.x / 32][1] = st;
        }
    }
    __syncthreads();
    if (threadIdx.x < 2)
        partials[2 * (static_cast<int64_t>(mat) * gridDim.x + blockIdx.x) + threadIdx.x] =
            warp_terms[0][threadIdx.x] + warp_terms[1][threadIdx.x];
}

// Reads v and the second moment, writes the second moment, step and the partials; a square-add per element.
inline Work normuon_variance_stats_work(int count, int rows, int cols) {
    const double n = normuon_shard_elems(count, rows, cols), moments = normuon_second_moment_bytes(count, rows, cols);
    return Work{.name = "normuon_variance_stats", .flops = 2 * n, .bytes_read = 2 * n + moments,
                .bytes_written = 2 * moments + 8.0 * count * normuon_variance_blocks(rows, cols)};
}
// Updates the second moment (fp32, count x normuon_second_moment_len) toward the mean square of v
// along its reduced dimension with weight second_moment_weight = 1 - beta2, writes step = rsqrt of it
// (same shape) and normuon_variance_blocks(rows, cols) pairs of partial sums per matrix.
inline void normuon_variance_stats(float* second_moment, float* step, float* partials, const __nv_bfloat16* v,
                                   int count, int rows, int cols, float second_moment_weight, cudaStream_t stream) {
    require_shape(normuon_shape_error(count, rows, cols), "normuon_variance_stats");
    kernel_require(is_aligned16(v), "normuon_variance_stats: v must be 16-byte aligned");
    const dim3 grid(normuon_variance_blocks(rows, cols), count);
    const Work work = normuon_variance_stats_work(count, rows, cols);
    if (normuon_reduces_rows(rows, cols))
        launch(work, normuon_row_variance_kernel, grid, dim3(kOptimThreads), 0, stream, second_moment, step, partials,
               v, rows, cols, second_moment_weight);
    else
        launch(work, normuon_col_variance_kernel, grid, dim3(kOptimThreads), 0, stream, second_moment, step, partials,
               v, rows, cols, second_moment_weight);
    CUDA_CHECK_LAUNCH();
}

// ---- the update ----
// p32 - ((p32 * mask) * wd) * lr - g * lr, each operation rounded once, with mask = g * p32 >= 0.
__device__ __forceinline__ float normuon_cautious_update(float p, float g, float wd, float lr) {
    const float mask = __fmul_rn(g, p) >= 0.0f ? 1.0f : 0.0f;
    const float decay = __fmul_rn(__fmul_rn(__fmul_rn(p, mask), wd), lr);
    return __fsub_rn(__fsub_rn(p, decay), __fmul_rn(g, lr));
}

// v' = bf16(v * s), s = step[j] * ||v|| / max(||v * step||, 1e-10) (j: the element's row or column;
// VarianceScale::bf16: s rounded to bf16 first), then the cautious update of the precise parameter
// (bf16 bits << 16 | mantissa) by v', split back by truncation.
__global__ void __launch_bounds__(kOptimThreads)
    normuon_scale_and_update_kernel(__nv_bfloat16* param, uint16_t* mantissa, const __nv_bfloat16* v, const float* step,
                                    const float* variance_partials, int variance_blocks, const float* matrix_lr_mul,
                                    const NorMuonStepScalars* scalars, int rows, int cols,
                                    VarianceScale scale_rounding) {
    const int mat = blockIdx.y;
    const bool per_row = normuon_reduces_rows(rows, cols);
    const float* part = variance_partials + 2 * static_cast<int64_t>(mat) * variance_blocks;
    const float s1 = block_sum_fixed_order(part, variance_blocks, 2);
    const float s2 = block_sum_fixed_order(part + 1, variance_blocks, 2);
    const float v_norm = sqrtf(s1 * static_cast<float>(per_row ? cols : rows));
    const float ratio = v_norm / fmaxf(sqrtf(s2), kNorMuonClamp);
    const float lr = scalars->lr * (matrix_lr_mul ? matrix_lr_mul[mat] : 1.0f), wd = scalars->wd;
    const int64_t elems = normuon_matrix_elems(rows, cols), base = static_cast<int64_t>(mat) * elems;
    const float* step_m = step + static_cast<int64_t>(mat) * normuon_second_moment_len(rows, cols);
    const int64_t begin = static_cast<int64_t>(blockIdx.x) * kNorMuonElemsPerBlock;
    for (int64_t i = begin + threadIdx.x * kOptimVec; i < elems && i < begin + kNorMuonElemsPerBlock;
         i += kOptimThreads * kOptimVec) {
        const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);  // 8 elements of one row
        float g[kOptimVec];
        optim_load8(v + base + i, g);
        const Pack128<__nv_bfloat16> p = load128(param + base + i);
        const Pack128<uint16_t> lo = load128(mantissa + base + i);
        Pack128<__nv_bfloat16> p_out;
        Pack128<uint16_t> lo_out;
#pragma unroll
        for (int k = 0; k < kOptimVec; ++k) {
            const float s = (per_row ? step_m[r] : step_m[c + k]) * ratio;
            const float scale = scale_rounding == VarianceScale::bf16 ? optim_round_bf16(s) : s;
            const float gk = optim_round_bf16(g[k] * scale);
            const uint32_t bits = static_cast<uint32_t>(__bfloat16_as_ushort(p[k])) << 16 | lo[k];
            const uint32_t out = __float_as_uint(normuon_cautious_update(__uint_as_float(bits), gk, wd, lr));
            p_out[k] = __ushort_as_bfloat16(static_cast<unsigned short>(out >> 16));
            lo_out[k] = static_cast<uint16_t>(out & 0xFFFFu);
        }
        store128(param + base + i, p_out);
        store128(mantissa + base + i, lo_out);
    }
}
// Reads v, param, mantissa, step, the variance partials, the multipliers and the scalars; writes param
// and mantissa; the scale, its rounding and the cautious update, ~9 operations per element.
inline Work normuon_scale_and_update_work(int count, int rows, int cols, bool per_matrix_lr) {
    const double n = normuon_shard_elems(count, rows, cols);
    return Work{.name = "normuon_scale_and_update", .flops = 9 * n,
                .bytes_read = 6 * n + normuon_second_moment_bytes(count, rows, cols) +
                              8.0 * count * normuon_variance_blocks(rows, cols) + (per_matrix_lr ? 4.0 * count : 0) +
                              sizeof(NorMuonStepScalars),
                .bytes_written = 4 * n};
}
// Scales v by the variance statistics (normuon_variance_stats on the same v) and applies the cautious
// update to `count` bf16 matrices with their mantissas. matrix_lr_mul: count device floats, or nullptr
// for all 1.
inline void normuon_scale_and_update(__nv_bfloat16* param, uint16_t* mantissa, const __nv_bfloat16* v,
                                     const float* step, const float* variance_partials, const float* matrix_lr_mul,
                                     const NorMuonStepScalars* scalars, int count, int rows, int cols,
                                     cudaStream_t stream, VarianceScale scale_rounding = VarianceScale::fp32) {
    require_shape(normuon_shape_error(count, rows, cols), "normuon_scale_and_update");
    kernel_require(all_aligned16({param, mantissa, v}),
                   "normuon_scale_and_update: param, mantissa and v must be 16-byte aligned");
    const Work work = normuon_scale_and_update_work(count, rows, cols, matrix_lr_mul != nullptr);
    launch(work, normuon_scale_and_update_kernel, dim3(normuon_elementwise_blocks(rows, cols), count),
           dim3(kOptimThreads), 0, stream, param, mantissa, v, step, variance_partials,
           normuon_variance_blocks(rows, cols), matrix_lr_mul, scalars, rows, cols, scale_rounding);
    CUDA_CHECK_LAUNCH();
}

// ---- the whole step ----
// One rank's shard of a NorMuon bank and its state, all on the device.
struct NorMuonShard {
    __nv_bfloat16* param;        // (count, rows, cols)
    const __nv_bfloat16* grad;   // (count, rows, cols): reduce-scattered, averaged
    float* momentum;             // (count, rows, cols)
    float* second_moment;        // (count, normuon_second_moment_len(rows, cols))
    uint16_t* mantissa;          // (count, rows, cols): low halves of the precise fp32 parameter
    const float* matrix_lr_mul;  // (count), or nullptr for all 1
    int count, rows, cols;
};

// Where normuon_step's scratch goes: two Polar Express buffers, its two (s, s) products, the norm's
// partials, the per-row or per-column step and the variance partials, each 256-byte aligned.
struct NorMuonScratch {
    __nv_bfloat16 *x, *x_other, *gram, *poly;
    float *norm_partials, *step, *variance_partials;
    size_t bytes;
};
inline NorMuonScratch normuon_scratch_layout(void* base, int count, int rows, int cols) {
    const int s = std::min(rows, cols);
    const size_t xs = static_cast<size_t>(count) * normuon_matrix_elems(rows, cols),
                 ss = static_cast<size_t>(count) * s * s;
    size_t off = 0;
    auto take = [&](size_t bytes) {  // address arithmetic in integers: base may be null when sizing
        const size_t at = off;
        off += (bytes + 255) / 256 * 256;
        return reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(base) + at);
    };
    NorMuonScratch l{};
    l.x = reinterpret_cast<__nv_bfloat16*>(take(xs * sizeof(__nv_bfloat16)));
    l.x_other = reinterpret_cast<__nv_bfloat16*>(take(xs * sizeof(__nv_bfloat16)));
    l.gram = reinterpret_cast<__nv_bfloat16*>(take(ss * sizeof(__nv_bfloat16)));
    l.poly = reinterpret_cast<__nv_bfloat16*>(take(ss * sizeof(__nv_bfloat16)));
    l.norm_partials = reinterpret_cast<float*>(take(sizeof(float) * count * normuon_elementwise_blocks(rows, cols)));
    l.step = reinterpret_cast<float*>(take(sizeof(float) * count * normuon_second_moment_len(rows, cols)));
    l.variance_partials =
        reinterpret_cast<float*>(take(sizeof(float) * 2 * count * normuon_variance_blocks(rows, cols)));
    l.bytes = off;
    return l;
}
inline size_t normuon_scratch_bytes(int count, int rows, int cols) {
    require_shape(normuon_shape_error(count, rows, cols), "normuon_scratch_bytes");
    return normuon_scratch_layout(nullptr, count, rows, cols).bytes;
}

// One NorMuon step on a shard: momentum, Polar Express (split form for rows > 1024, as upstream),
// variance reduction, cautious update. second_moment_weight = 1 - beta2; scratch (256-byte aligned)
// holds normuon_scratch_bytes(count, rows, cols); numerics picks the two roundings (record 71's by default).
inline void normuon_step(CublasLt& lt, const NorMuonShard& shard, const NorMuonStepScalars* scalars,
                         float second_moment_weight, void* scratch, size_t scratch_bytes, cudaStream_t stream,
                         NorMuonNumerics numerics = {}) {
    const int count = shard.count, rows = shard.rows, cols = shard.cols;
    require_shape(normuon_shape_error(count, rows, cols), "normuon_step");
    const NorMuonScratch w = normuon_scratch_layout(scratch, count, rows, cols);
    kernel_require(scratch_bytes >= w.bytes, "normuon_step: scratch holds %zu bytes, needs %zu (normuon_scratch_bytes)",
                   scratch_bytes, w.bytes);
    kernel_require(reinterpret_cast<uintptr_t>(scratch) % 256 == 0, "normuon_step: scratch must be 256-byte aligned");
    normuon_momentum(shard.momentum, w.norm_partials, shard.grad, scalars, count, rows, cols, stream, numerics.input);
    polar_express_normalize(w.x, shard.momentum, shard.grad, w.norm_partials, scalars, count, rows, cols, stream,
                            numerics.input);
    const __nv_bfloat16* v = polar_express_iterate(lt, w.x, w.x_other, w.gram, w.poly, count, rows, cols,
                                                   rows > kPolarExpressSplitRows, stream);
    normuon_variance_stats(shard.second_moment, w.step, w.variance_partials, v, count, rows, cols, second_moment_weight,
                           stream);
    normuon_scale_and_update(shard.param, shard.mantissa, v, w.step, w.variance_partials, shard.matrix_lr_mul, scalars,
                             count, rows, cols, stream, numerics.scale);
}
