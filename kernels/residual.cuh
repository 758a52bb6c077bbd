// The residual stream of the GPT: record 71's per-layer mix with x0 and the bigram embedding, the gated skip
// from layer 3 into layer 6, the block-output adds and the final backout, and record 80's per-sublayer
// updates (their own section at the end, with their schedule and rounding), each fused with the RMSNorm
// that the next block reads when one does, and their backward passes. Streams and their gradients are
// (T, C) bf16; scalar parameters are read from device memory; parameter gradients come from per-block
// fp32 partial sums that the last block to finish reduces in a fixed order, so they are bitwise
// reproducible (`scratch`: the partials and their ticket counter, BlockPartials).
//
// Record 71's forward, layer i (x: the stream entering the layer, x = x0 at layer 0; s: the stream):
//   if (i == 6) { gated_skip_add_forward(xs, x, x_layer3, x0, skip_gate, skip_lambda, T, C, s);  x = xs; }
//   residual_mix_forward(xm, ha, rstd_m, x, x0, x0_bigram, {&resid_l[i], &x0_l[i], &bigram_l[i]}, i == 0, T, C, s);
//   if (attention) { attention(ha) -> ao;  residual_add_forward(xa, hm, rstd_a, xm, ao, T, C, s); }
//   else           { xa = xm;  hm = ha; }          (layer 6: the MLP reads the mix's norm)
//   mlp(hm) -> mo;  residual_add_forward(x_next, nullptr, nullptr, xa, mo, T, C, s);
// Before layer 0: rmsnorm_forward(x0, rstd_0, smeared, T, C, s) (norm.cuh).
// After layer 10: backout_forward(xf, hf, rstd_f, x_next, x_layer7, backout_lambda, T, C, s);  lm_head(hf).
// Kept for the backward: each layer's x, xm, rstd_m, xa, rstd_a (and the blocks' inputs ha, hm); xf, rstd_f;
// smeared, rstd_0; x0, x0_bigram, x_layer3, x_layer7.
//
// Backward (dX: gradient of the stream; gx0, gxb: gradients of x0 and x0_bigram, summed over layers;
// acc: the parameter-gradient accumulate flag of the step):
//   backout_backward(dX, dX7, d_backout_lambda, scratch, dhf, xf, rstd_f, x_layer7, backout_lambda, acc, T, C, s);
//   layer i = 10 .. 0 (dX: gradient of the layer's output):
//     mlp backward (d mo = dX) -> dhm
//     if (attention) { residual_add_backward(dX, dhm, xa, rstd_a, T, C, s);  attention backward (d ao = dX) -> dha }
//     else           { dha = dhm }
//     residual_mix_backward(dIn, gx0, gxb, {&d_resid_l[i], &d_x0_l[i], &d_bigram_l[i]}, scratch, dX, dha, xm, rstd_m,
//                           x, x0, x0_bigram, {&resid_l[i], ...}, {.first_layer = i == 0, .accumulate_dx = acc_in,
//                           .accumulate_x0_grads = i != 10, .accumulate_lambda_grads = acc}, T, C, s);
//       dIn receives the gradient of the layer's input: dX itself in place (acc_in = false), the buffer that
//       already holds layer 7's backout share (i = 8) or layer 3's skip share (i = 4) (acc_in = true),
//       or gx0 at layer 0 (acc_in = true).
//     if (i == 6) gated_skip_add_backward(dX3, gx0, d_skip_gate, d_skip_lambda, scratch, dX, x_layer3, x0, skip_gate,
//                                         skip_lambda, {.accumulate_d_skip = false, .accumulate_param_grads = acc},
//                                         T, C, s);   (layer 5's output gradient is dX)
// Before layer 0: rmsnorm_backward(d_smeared, gx0, smeared, rstd_0, T, C, false, s) (norm.cuh).
//
// Rounding: each stored tensor is computed in fp32 from its bf16 inputs and rounded once; a fused norm
// normalizes the rounded stream it stores (the values its backward sees). One call per line of upstream's
// forward: the skip add and each layer's output are stored in bf16 before the next mix reads them (where
// torch.compile may fuse that chain and round once). The skip gate's logit is rounded to bf16 as
// upstream's bf16 F.linear output is; in the backward, its logit gradient and the x0 gradient it sends
// back are rounded to bf16 as the inputs and outputs of upstream's matmuls are.
#pragma once
#include "norm.cuh"

#include <algorithm>

constexpr int kResidualMaxBackwardBlocks = 1024;      // caps the partial sums; rows beyond it loop
constexpr int kResidualMaxPartials = kGateWidth + 1;  // per block: the most values one backward reduces

// Device pointers to one layer's mixing scalars (fp32 parameters).
struct MixLambdas {
    const float* resid;   // resid_lambdas[i]
    const float* x0;      // x0_lambdas[i]
    const float* bigram;  // bigram_lambdas[i]
};
// Where their gradients go (fp32 elements of the parameters' gradients).
struct MixLambdaGrads {
    float* resid;
    float* x0;
    float* bigram;
};
// How residual_mix_backward meets its layer and its outputs (write them with designators:
// {.first_layer = ..., .accumulate_dx = ..., ...}, so no two can trade places).
struct MixBackwardOptions {
    bool first_layer;              // layer 0: x is x0, dx receives x0's gradient, dx0 is unused
    bool accumulate_dx;            // add into dx (it holds another share of the input's gradient)
    bool accumulate_x0_grads;      // add into dx0 and dx0_bigram (every layer but the first the backward meets)
    bool accumulate_lambda_grads;  // add into the lambda gradients
};

// ---- deterministic parameter gradients from per-block partial sums ----
inline int residual_backward_blocks(int T) { return std::min(norm_row_blocks(T), kResidualMaxBackwardBlocks); }
// Scratch bytes any backward launcher in this header needs for T rows.
inline size_t residual_backward_scratch_bytes(int T) {
    return sizeof(float) * kResidualMaxPartials * static_cast<size_t>(residual_backward_blocks(T));
}

// Writes the block's sums of its threads' `acc` values (NV per thread, reduced over each warp, then over
// warps in order) as partials[blockIdx.x * NV + v]; the last block to finish sums them into the targets.
// Every thread of the block must call it.
template <int NV>
__device__ __forceinline__ void sum_warp_reduced_partials(const LastBlockSum& sum, const float (&acc)[NV]) {
    __shared__ float warp_sums[kNormRowsPerBlock][NV];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
#pragma unroll
    for (int v = 0; v < NV; ++v) {
        const float s = warp_reduce_sum(acc[v]);
        if (lane == 0) warp_sums[warp][v] = s;
    }
    store_block_partials(sum.scratch.partials + static_cast<size_t>(blockIdx.x) * NV, warp_sums);
    last_block_sum(sum, NV);
}

// ---- the layer mix ----
// x_out = bf16(r*x + l*x0 + b*xb), at layer 0 bf16((r + l)*x + b*xb) with x = x0; h = norm(x_out).
__global__ void __launch_bounds__(kNormThreads, 4)
    residual_mix_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                const __nv_bfloat16* x0, const __nv_bfloat16* x0_bigram, MixLambdas lambdas,
                                bool first_layer, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const float l = *lambdas.x0, b = *lambdas.bigram;
    // upstream folds x0_lambdas[0] into x's coefficient at layer 0
    const float r = first_layer ? *lambdas.resid + l : *lambdas.resid;
    const size_t off = static_cast<size_t>(row) * C;
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col), bv = load128(x0_bigram + off + col);
        const Pack128<__nv_bfloat16> zv = first_layer ? xv : load128(x0 + off + col);
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) {
            float v = r * __bfloat162float(xv[k]) + b * __bfloat162float(bv[k]);
            if (!first_layer) v += l * __bfloat162float(zv[k]);
            out.pack[i][k] = __float2bfloat16(v);
        }
        store128(x_out + off + col, out.pack[i]);
    }
    norm_row_store_normalized(h + off, h_rstd + row, out, norm_row_rstd(out, C), C, lane);
}
// Reads x, x0 (not at the first layer), x0_bigram and the lambdas; writes x_out, h and rstd; the mix's
// multiply-adds and the norm, 8 operations per element.
inline Work residual_mix_forward_work(int T, int C, bool first_layer) {
    return Work{.name = "residual_mix_forward", .flops = 8.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, first_layer ? 2 : 3) + 3 * sizeof(float),
                .bytes_written = norm_rows_bytes(T, C, 2) + norm_rstd_bytes(T)};
}
// first_layer (layer 0): x is x0 itself, and its coefficient is resid + x0 lambda (x0 is not read).
inline void residual_mix_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                 const __nv_bfloat16* x0, const __nv_bfloat16* x0_bigram, MixLambdas lambdas,
                                 bool first_layer, int T, int C, cudaStream_t stream) {
    require_norm_rows("residual_mix_forward", T, C, {x_out, h, x, x0, x0_bigram});
    launch(residual_mix_forward_work(T, C, first_layer), residual_mix_forward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, x_out, h, h_rstd, x, x0, x0_bigram, lambdas, first_layer, T, C);
    CUDA_CHECK_LAUNCH();
}

// gm = g + rstd*dh - xm * rstd^3 dot(dh, xm)/C (the stream's gradient plus the norm's, kept in fp32);
// dx (+)= r*gm, dx0 (+)= l*gm, dxb (+)= b*gm; partial sums of gm*x, gm*x0, gm*xb for the lambdas.
// (3 blocks per SM, not 4: it streams seven tensors and needs 80 registers.)
__global__ void __launch_bounds__(kNormThreads, 3)
    residual_mix_backward_kernel(__nv_bfloat16* dx, __nv_bfloat16* dx0, __nv_bfloat16* dx0_bigram, LastBlockSum sum,
                                 const __nv_bfloat16* g, const __nv_bfloat16* dh, const __nv_bfloat16* x_mix,
                                 const float* h_rstd, const __nv_bfloat16* x, const __nv_bfloat16* x0,
                                 const __nv_bfloat16* x0_bigram, MixLambdas lambdas, MixBackwardOptions o, int T,
                                 int C) {
    const bool first_layer = o.first_layer, accumulate_dx = o.accumulate_dx;
    const bool accumulate_x0_grads = o.accumulate_x0_grads;
    const int lane = threadIdx.x % 32;
    const float l = *lambdas.x0, b = *lambdas.bigram;
    const float r = first_layer ? *lambdas.resid + l : *lambdas.resid;
    float acc[3] = {0.0f, 0.0f, 0.0f};  // gm*x, gm*x0, gm*xb
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float rstd = h_rstd[row], q = norm_row_grad_coeff(dh + off, x_mix + off, rstd, C, lane);
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) break;
            const size_t at = off + col;
            const Pack128<__nv_bfloat16> dhv = load128(dh + at), xmv = load128(x_mix + at);
            const Pack128<__nv_bfloat16> gv = load128(g + at), xv = load128(x + at), bv = load128(x0_bigram + at);
            const Pack128<__nv_bfloat16> zv = first_layer ? xv : load128(x0 + at);
            Pack128<__nv_bfloat16> dxv = accumulate_dx ? load128(dx + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> dzv =
                accumulate_x0_grads && !first_layer ? load128(dx0 + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> dbv = accumulate_x0_grads ? load128(dx0_bigram + at) : Pack128<__nv_bfloat16>{};
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) {
                const float gm =
                    __bfloat162float(gv[k]) + rstd * __bfloat162float(dhv[k]) - q * __bfloat162float(xmv[k]);
                acc[0] += gm * __bfloat162float(xv[k]);
                acc[1] += gm * __bfloat162float(zv[k]);
                acc[2] += gm * __bfloat162float(bv[k]);
                dxv[k] = __float2bfloat16(accumulate_dx ? __bfloat162float(dxv[k]) + r * gm : r * gm);
                dzv[k] = __float2bfloat16(accumulate_x0_grads ? __bfloat162float(dzv[k]) + l * gm : l * gm);
                dbv[k] = __float2bfloat16(accumulate_x0_grads ? __bfloat162float(dbv[k]) + b * gm : b * gm);
            }
            store128(dx + at, dxv);
            if (!first_layer) store128(dx0 + at, dzv);
            store128(dx0_bigram + at, dbv);
        }
    }
    sum_warp_reduced_partials(sum, acc);
}
// Reads g, dh, x_mix, x, x0 (not at the first layer), x0_bigram, rstd and the lambdas, and the
// gradients it adds into; writes dx, dx0 (not at the first layer), dx0_bigram and the partials; the
// norm's gradient, three products and three scaled outputs, ~16 operations per element.
inline Work residual_mix_backward_work(int T, int C, const MixBackwardOptions& o) {
    const int inputs = o.first_layer ? 5 : 6, outputs = o.first_layer ? 2 : 3;  // x0 and dx0 only past layer 0
    const int added = (o.accumulate_dx ? 1 : 0) + (o.accumulate_x0_grads ? outputs - 1 : 0);
    return Work{.name = "residual_mix_backward", .flops = 16.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, inputs + added) + norm_rstd_bytes(T) + 3 * sizeof(float),
                .bytes_written = norm_rows_bytes(T, C, outputs) + 12.0 * residual_backward_blocks(T)};
}
// From the gradient of the mix output's two uses: g (the stream, added around the next block) and dh (the
// norm that block read). dx: the gradient of the layer's input; it may be g itself (in place) unless
// accumulate_dx. At layer 0 (first_layer) x is x0: dx is x0's gradient (accumulate it) and dx0 is unused.
// The options: MixBackwardOptions. `scratch`: residual_backward_scratch_bytes(T) of partials.
inline void residual_mix_backward(__nv_bfloat16* dx, __nv_bfloat16* dx0, __nv_bfloat16* dx0_bigram,
                                  MixLambdaGrads lambda_grads, BlockPartials scratch, const __nv_bfloat16* g,
                                  const __nv_bfloat16* dh, const __nv_bfloat16* x_mix, const float* h_rstd,
                                  const __nv_bfloat16* x, const __nv_bfloat16* x0, const __nv_bfloat16* x0_bigram,
                                  MixLambdas lambdas, MixBackwardOptions options, int T, int C, cudaStream_t stream) {
    require_norm_rows("residual_mix_backward", T, C, {dx, dx0, dx0_bigram, g, dh, x_mix, x, x0, x0_bigram});
    const int blocks = residual_backward_blocks(T);
    const LastBlockSum sum{SumTargets().add(lambda_grads.resid).add(lambda_grads.x0).add(lambda_grads.bigram), scratch,
                           options.accumulate_lambda_grads};
    launch(with_last_block_sum(residual_mix_backward_work(T, C, options), sum, blocks), residual_mix_backward_kernel,
           dim3(blocks), dim3(kNormThreads), 0, stream, dx, dx0, dx0_bigram, sum, g, dh, x_mix, h_rstd, x, x0,
           x0_bigram, lambdas, options, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- the gated skip from layer 3 into layer 6 ----
struct SkipGateWeights {
    float w[kGateWidth];
};
__device__ __forceinline__ SkipGateWeights load_skip_gate(const __nv_bfloat16* gate_w) {
    SkipGateWeights g;
#pragma unroll
    for (int k = 0; k < kGateWidth; ++k) g.w[k] = __bfloat162float(gate_w[k]);
    return g;
}
// bf16(x0[t, :12] . w): upstream's skip_gate is a bf16 F.linear, whose output is bf16.
__device__ __forceinline__ float skip_gate_logit(const __nv_bfloat16* x0_row, const SkipGateWeights& gate) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kGateWidth; ++k) s += __bfloat162float(x0_row[k]) * gate.w[k];
    return __bfloat162float(__float2bfloat16(s));
}

// One warp's row: x_out = bf16(a + s * b), then h = norm(x_out) and its rstd when h is given.
__device__ __forceinline__ void add_scaled_row(__nv_bfloat16* x_out_row, __nv_bfloat16* h_row, float* h_rstd_slot,
                                               const __nv_bfloat16* a_row, const __nv_bfloat16* b_row, float s, int C,
                                               int lane) {
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> av = load128(a_row + col), bv = load128(b_row + col);
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k)
            out.pack[i][k] = __float2bfloat16(__bfloat162float(av[k]) + s * __bfloat162float(bv[k]));
        store128(x_out_row + col, out.pack[i]);
    }
    if (h_row) norm_row_store_normalized(h_row, h_rstd_slot, out, norm_row_rstd(out, C), C, lane);
}

// x_out = bf16(x + sigmoid(lambda) * 2 * sigmoid(logit) * skip), logit = bf16(x0[t, :12] . w);
// h = norm(x_out) when h is given (record 80, where layer 6's MLP reads it).
__global__ void __launch_bounds__(kNormThreads, 4)
    gated_skip_add_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                  const __nv_bfloat16* skip, const __nv_bfloat16* x0, const __nv_bfloat16* gate_w,
                                  const float* skip_lambda, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const size_t off = static_cast<size_t>(row) * C;
    const float s = sigmoidf(*skip_lambda) * 2.0f * sigmoidf(skip_gate_logit(x0 + off, load_skip_gate(gate_w)));
    add_scaled_row(x_out + off, h ? h + off : nullptr, h ? h_rstd + row : nullptr, x + off, skip + off, s, C, lane);
}
// Reads x, skip, x0's first 12 columns, the gate and lambda; writes x_out; a multiply-add per element.
inline Work gated_skip_add_forward_work(int T, int C) {
    return Work{.name = "gated_skip_add_forward", .flops = 2.0 * T * (C + kGateWidth),
                .bytes_read = norm_rows_bytes(T, C, 2) + 2.0 * kGateWidth * (T + 1) + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C)};
}
// skip: layer 3's output; gate_w: skip_gate (12 bf16); x_out may be x (in place).
inline void gated_skip_add_forward(__nv_bfloat16* x_out, const __nv_bfloat16* x, const __nv_bfloat16* skip,
                                   const __nv_bfloat16* x0, const __nv_bfloat16* gate_w, const float* skip_lambda,
                                   int T, int C, cudaStream_t stream) {
    require_norm_rows("gated_skip_add_forward", T, C, {x_out, x, skip, x0});
    kernel_require(C >= 2 * kNormPackWidth, "gated_skip_add_forward: C=%d is narrower than the skip gate's %d inputs",
                   C, kGateWidth);
    launch(gated_skip_add_forward_work(T, C), gated_skip_add_forward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, x_out, nullptr, nullptr, x, skip, x0, gate_w, skip_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}
// The gated skip add and the norm of its output, 3 more operations per element.
inline Work gated_skip_add_norm_forward_work(int T, int C) {
    Work w = gated_skip_add_forward_work(T, C);
    w.name = "gated_skip_add_norm_forward";
    w.flops += 3.0 * T * C;
    w.bytes_written += norm_rows_bytes(T, C) + norm_rstd_bytes(T);
    return w;
}
// Record 80's layer 6 (no attention, so no sublayer update before its MLP): gated_skip_add_forward and
// h = norm(x_out), the MLP's input. Its backward: residual_add_backward (the norm's share into the
// gradient of x_out), then gated_skip_add_backward.
inline void gated_skip_add_norm_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                        const __nv_bfloat16* skip, const __nv_bfloat16* x0, const __nv_bfloat16* gate_w,
                                        const float* skip_lambda, int T, int C, cudaStream_t stream) {
    require_norm_rows("gated_skip_add_norm_forward", T, C, {x_out, h, x, skip, x0});
    kernel_require(h && h_rstd, "gated_skip_add_norm_forward: h and h_rstd are required");
    kernel_require(C >= 2 * kNormPackWidth,
                   "gated_skip_add_norm_forward: C=%d is narrower than the skip gate's %d inputs", C, kGateWidth);
    launch(gated_skip_add_norm_forward_work(T, C), gated_skip_add_forward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, x_out, h, h_rstd, x, skip, x0, gate_w, skip_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// The skip backwards' row of d_skip: d (+)= bf16(s g), one rounding per element (after the add when accumulating).
__device__ __forceinline__ void add_scaled_grad_row(__nv_bfloat16* d_row, const __nv_bfloat16* g_row, float s,
                                                    bool accumulate, int C, int lane) {
#pragma unroll 1
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) break;
        const Pack128<__nv_bfloat16> gv = load128(g_row + col);
        Pack128<__nv_bfloat16> out = accumulate ? load128(d_row + col) : Pack128<__nv_bfloat16>{};
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) {
            const float d = s * __bfloat162float(gv[k]);
            out[k] = __float2bfloat16(accumulate ? __bfloat162float(out[k]) + d : d);
        }
        store128(d_row + col, out);
    }
}

// With g = d x_out and s = sigmoid(lambda) * 2 * sigmoid(logit): d_skip (+)= s*g; ds = sum_c g*skip;
// dlogit = bf16(ds * sigmoid(lambda) * 2 * sigmoid'(logit)); dx0[t, k] += bf16(dlogit * w[k]) for k < 12;
// partial sums of dlogit * x0[t, k] (skip_gate) and ds * 2 * sigmoid(logit) * sigmoid'(lambda) (skip_lambda).
__global__ void __launch_bounds__(kNormThreads, 4)
    gated_skip_add_backward_kernel(__nv_bfloat16* d_skip, __nv_bfloat16* dx0, LastBlockSum sum, const __nv_bfloat16* g,
                                   const __nv_bfloat16* skip, const __nv_bfloat16* x0, const __nv_bfloat16* gate_w,
                                   const float* skip_lambda, bool accumulate_d_skip, int T, int C) {
    const int lane = threadIdx.x % 32;
    const float sl = sigmoidf(*skip_lambda);
    const SkipGateWeights gate = load_skip_gate(gate_w);
    const float w = lane < kGateWidth ? gate.w[lane] : 0.0f;
    float acc = 0.0f;  // lane k < 12: skip_gate[k]'s gradient; lane 12: skip_lambda's
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float ds = norm_row_dot(norm_row_load(g + off, C, lane), norm_row_load(skip + off, C, lane));
        const float sg = sigmoidf(skip_gate_logit(x0 + off, gate)), s = sl * 2.0f * sg;
        add_scaled_grad_row(d_skip + off, g + off, s, accumulate_d_skip, C, lane);
        const float dlogit = __bfloat162float(__float2bfloat16(ds * sl * 2.0f * sg * (1.0f - sg)));
        if (lane < kGateWidth) {
            const float x0k = __bfloat162float(x0[off + lane]);
            acc += dlogit * x0k;
            const float back = __bfloat162float(__float2bfloat16(dlogit * w));
            dx0[off + lane] = __float2bfloat16(__bfloat162float(dx0[off + lane]) + back);
        } else if (lane == kGateWidth) {
            acc += ds * 2.0f * sg * sl * (1.0f - sl);
        }
    }
    // per-lane values: no warp reduction, the block sums each lane's value over its warps in order
    __shared__ float lane_sums[kNormRowsPerBlock][kResidualMaxPartials];
    if (lane < kResidualMaxPartials) lane_sums[threadIdx.x / 32][lane] = acc;
    store_block_partials(sum.scratch.partials + static_cast<size_t>(blockIdx.x) * kResidualMaxPartials, lane_sums);
    last_block_sum(sum, kResidualMaxPartials);
}
// Which outputs of gated_skip_add_backward already hold a share to add to (write them with designators).
struct SkipBackwardOptions {
    bool accumulate_d_skip;       // d_skip, layer 3's output gradient
    bool accumulate_param_grads;  // d_skip_gate and d_skip_lambda
};
// Reads g, skip (d_skip too when accumulating), x0's and dx0's first 12 columns, the gate and lambda;
// writes d_skip, dx0's first 12 columns and the partials; a dot and a multiply per element.
inline Work gated_skip_add_backward_work(int T, int C, bool accumulate_d_skip) {
    const double gate_columns = 2.0 * kGateWidth * T;  // of x0 and of dx0
    return Work{.name = "gated_skip_add_backward", .flops = 3.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, accumulate_d_skip ? 3 : 2) + 2 * gate_columns +
                              2.0 * kGateWidth + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C) + gate_columns +
                                 4.0 * kResidualMaxPartials * residual_backward_blocks(T)};
}
// g: the gradient of the skip add's output (also the gradient of its input x, unchanged). d_skip: the
// gradient of layer 3's output. dx0 must hold x0's gradient so far: the gate's share is added into its
// first 12 columns.
inline void gated_skip_add_backward(__nv_bfloat16* d_skip, __nv_bfloat16* dx0, __nv_bfloat16* d_skip_gate,
                                    float* d_skip_lambda, BlockPartials scratch, const __nv_bfloat16* g,
                                    const __nv_bfloat16* skip, const __nv_bfloat16* x0, const __nv_bfloat16* gate_w,
                                    const float* skip_lambda, SkipBackwardOptions options, int T, int C,
                                    cudaStream_t stream) {
    require_norm_rows("gated_skip_add_backward", T, C, {d_skip, dx0, g, skip, x0});
    kernel_require(C >= 2 * kNormPackWidth, "gated_skip_add_backward: C=%d is narrower than the skip gate's %d inputs",
                   C, kGateWidth);
    const int blocks = residual_backward_blocks(T);
    const LastBlockSum sum{SumTargets().add(d_skip_gate, kGateWidth).add(d_skip_lambda), scratch,
                           options.accumulate_param_grads};
    launch(with_last_block_sum(gated_skip_add_backward_work(T, C, options.accumulate_d_skip), sum, blocks),
           gated_skip_add_backward_kernel, dim3(blocks), dim3(kNormThreads), 0, stream, d_skip, dx0, sum, g, skip, x0,
           gate_w, skip_lambda, options.accumulate_d_skip, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- record 85: the skip from layer 3 into layer 6 with a per-token gate ----
// Upstream 003ff3e2 (= 75d6867a L1592-1596): skip_gate_out = sigmoid(skip_lambda) * G28, x = x + skip_gate_out * h3,
// G28 the MUDD post gate's column 28 (kernels/mudd.cuh: fp32 copies of bf16 values, `gate_stride` apart),
// skip_lambda an fp32 scalar. Replaces record 71-84's 2 sigmoid(x0[:, :12] . skip_gate) (gated_skip_add_*).
// Rounding as inductor compiles it (torch 2.x's generated code for this expression, read on the CPU backend): the
// fp32 sigmoid times the bf16 column promotes to bf16, so the forward multiplies by bf16(sigmoid(lambda)), the
// rest fused in fp32 and rounded once where x is stored; the backward recomputes sigmoid in fp32 and uses it
// unrounded, with ds = bf16(sum_c g*h3) (a reduction's bf16 output) and skip_lambda's gradient
// sigmoid'(lambda) * bf16(sum_t ds G28) (the scalar reduction stored in bf16, then widened).
// x_out = bf16(x + bf16(sigmoid(lambda)) * G[t] * skip); h = norm(x_out) (layer 6's MLP input).
__global__ void __launch_bounds__(kNormThreads, 4)
    token_skip_add_norm_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                       const __nv_bfloat16* skip, const float* gate, int64_t gate_stride,
                                       const float* skip_lambda, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const size_t off = static_cast<size_t>(row) * C;
    const float s = __bfloat162float(__float2bfloat16(sigmoidf(*skip_lambda))) * gate[row * gate_stride];
    add_scaled_row(x_out + off, h + off, h_rstd + row, x + off, skip + off, s, C, lane);
}
// Reads x, skip, each token's gate and the lambda; writes x_out, h and rstd; a multiply-add and the norm per element.
inline Work token_skip_add_norm_forward_work(int T, int C) {
    return Work{.name = "token_skip_add_norm_forward", .flops = 5.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, 2) + 4.0 * T + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C, 2) + norm_rstd_bytes(T)};
}
// skip: layer 3's output (h3); gate: the post gate's column 28 (token t's at gate[t * gate_stride]); x_out may be x
// (in place). Its backward: residual_add_backward (the norm's share into the gradient of x_out), then
// token_skip_add_backward.
inline void token_skip_add_norm_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                        const __nv_bfloat16* skip, const float* gate, int64_t gate_stride,
                                        const float* skip_lambda, int T, int C, cudaStream_t stream) {
    require_norm_rows("token_skip_add_norm_forward", T, C, {x_out, h, x, skip});
    kernel_require(x_out && h && h_rstd && x && skip && gate && skip_lambda && gate_stride > 0,
                   "token_skip_add_norm_forward: every tensor, the gate column (stride > 0) and the lambda are required");
    launch(token_skip_add_norm_forward_work(T, C), token_skip_add_norm_forward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, x_out, h, h_rstd, x, skip, gate, gate_stride, skip_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// With g = d x_out, sl = sigmoid(lambda) (fp32) and ds = bf16(sum_c g*skip): d_skip (+)= bf16(sl G[t] g);
// dG[t] = bf16(sl ds) (written); d_skip_lambda (+)= sl (1 - sl) bf16(sum_t G[t] ds), the sum from fixed-order
// partials (lane 0 of each row's warp) by the last block.
__global__ void __launch_bounds__(kNormThreads, 4)
    token_skip_add_backward_kernel(__nv_bfloat16* d_skip, float* d_gate, float* d_skip_lambda, BlockPartials scratch,
                                   const __nv_bfloat16* g, const __nv_bfloat16* skip, const float* gate,
                                   int64_t gate_stride, const float* skip_lambda, bool accumulate_d_skip,
                                   bool accumulate_lambda_grad, int T, int C) {
    const int lane = threadIdx.x % 32;
    const float sl = sigmoidf(*skip_lambda), dsl = sl * (1.0f - sl);
    float acc = 0.0f;
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float ds = __bfloat162float(
            __float2bfloat16(norm_row_dot(norm_row_load(g + off, C, lane), norm_row_load(skip + off, C, lane))));
        const float G = gate[row * gate_stride], s = sl * G;
        add_scaled_grad_row(d_skip + off, g + off, s, accumulate_d_skip, C, lane);
        if (lane == 0) {
            d_gate[row * gate_stride] = __bfloat162float(__float2bfloat16(sl * ds));
            acc += G * ds;
        }
    }
    // the block's partial (its warps' lane 0 values in warp order), then the last block's fixed-order sum
    __shared__ float warp_sums[kNormRowsPerBlock][1];
    if (lane == 0) warp_sums[threadIdx.x / 32][0] = acc;
    store_block_partials(scratch.partials + blockIdx.x, warp_sums);
    if (!last_block_done(scratch.done)) return;
    const int blocks = static_cast<int>(gridDim.x);
    const float s = block_sum_as(scratch.partials, blocks, 1, sum_threads(blocks, kSumPartialsThreads));
    if (threadIdx.x == 0) {
        const float d = dsl * __bfloat162float(__float2bfloat16(s));
        *d_skip_lambda = accumulate_lambda_grad ? *d_skip_lambda + d : d;
    }
}
// Which outputs of token_skip_add_backward already hold a share to add to (write them with designators).
struct TokenSkipBackwardOptions {
    bool accumulate_d_skip;         // d_skip, layer 3's output gradient
    bool accumulate_lambda_grad;    // d_skip_lambda (every micro-step but the first)
};
// Reads g, skip (d_skip too when accumulating), each token's gate and the lambda; writes d_skip, each token's gate
// gradient and the partials; a dot and a scaled output per element.
inline Work token_skip_add_backward_work(int T, int C, bool accumulate_d_skip) {
    return Work{.name = "token_skip_add_backward", .flops = 3.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, accumulate_d_skip ? 3 : 2) + 4.0 * T + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C) + 4.0 * T + 4.0 * residual_backward_blocks(T)};
}
// g: the gradient of the skip add's output (also the gradient of its input x, unchanged). d_skip: the gradient of
// layer 3's output; d_gate: the gate column's gradient (token t's at d_gate[t * gate_stride], written);
// d_skip_lambda: skip_lambda's gradient. `scratch`: residual_backward_scratch_bytes(T).
inline void token_skip_add_backward(__nv_bfloat16* d_skip, float* d_gate, float* d_skip_lambda, BlockPartials scratch,
                                    const __nv_bfloat16* g, const __nv_bfloat16* skip, const float* gate,
                                    int64_t gate_stride, const float* skip_lambda, TokenSkipBackwardOptions options,
                                    int T, int C, cudaStream_t stream) {
    require_norm_rows("token_skip_add_backward", T, C, {d_skip, g, skip});
    kernel_require(d_skip && d_gate && d_skip_lambda && g && skip && gate && skip_lambda && gate_stride > 0,
                   "token_skip_add_backward: every tensor, the gate column (stride > 0), the lambda and the gradients "
                   "are required");
    const int blocks = residual_backward_blocks(T);
    const LastBlockSum sum{SumTargets().add(d_skip_lambda), scratch, options.accumulate_lambda_grad};  // its Work
    launch(with_last_block_sum(token_skip_add_backward_work(T, C, options.accumulate_d_skip), sum, blocks),
           token_skip_add_backward_kernel, dim3(blocks), dim3(kNormThreads), 0, stream, d_skip, d_gate, d_skip_lambda,
           scratch, g, skip, gate, gate_stride, skip_lambda, options.accumulate_d_skip, options.accumulate_lambda_grad,
           T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- block outputs ----
// x_out = bf16(x + y); h = norm(x_out) when h is given.
__global__ void __launch_bounds__(kNormThreads, 4)
    residual_add_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                const __nv_bfloat16* y, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const size_t off = static_cast<size_t>(row) * C;
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col), yv = load128(y + off + col);
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k)
            out.pack[i][k] = __float2bfloat16(__bfloat162float(xv[k]) + __bfloat162float(yv[k]));
        store128(x_out + off + col, out.pack[i]);
    }
    if (h) norm_row_store_normalized(h + off, h_rstd + row, out, norm_row_rstd(out, C), C, lane);
}
// Reads x and y; writes x_out, and h and rstd with the norm; an add per element, 3 more with the norm.
inline Work residual_add_forward_work(int T, int C, bool norm) {
    return Work{.name = "residual_add_forward", .flops = (norm ? 4.0 : 1.0) * T * C,
                .bytes_read = norm_rows_bytes(T, C, 2),
                .bytes_written = norm_rows_bytes(T, C, norm ? 2 : 1) + (norm ? norm_rstd_bytes(T) : 0)};
}
// Adds a block's output y into the stream; with h (and h_rstd) also the norm the next block reads.
// x_out may be x (in place) when the backward does not need x.
inline void residual_add_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                 const __nv_bfloat16* y, int T, int C, cudaStream_t stream) {
    require_norm_rows("residual_add_forward", T, C, {x_out, h, x, y});
    launch(residual_add_forward_work(T, C, h != nullptr), residual_add_forward_kernel, dim3(norm_row_blocks(T)),
           dim3(kNormThreads), 0, stream, x_out, h, h_rstd, x, y, T, C);
    CUDA_CHECK_LAUNCH();
}
// The add passes its output's gradient dX to both x and y unchanged; with a norm, that gradient first
// gains the norm's share: dX += norm backward of dh (x_out, h_rstd: the forward's).
inline void residual_add_backward(__nv_bfloat16* dX, const __nv_bfloat16* dh, const __nv_bfloat16* x_out,
                                  const float* h_rstd, int T, int C, cudaStream_t stream) {
    rmsnorm_backward(dX, dh, x_out, h_rstd, T, C, true, stream);
}

// ---- the final backout ----
// x_out = bf16(x - bl * x_backout); h = norm(x_out).
__global__ void __launch_bounds__(kNormThreads, 4)
    backout_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                           const __nv_bfloat16* x_backout, const float* backout_lambda, int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const float bl = *backout_lambda;
    const size_t off = static_cast<size_t>(row) * C;
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col), bv = load128(x_backout + off + col);
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k)
            out.pack[i][k] = __float2bfloat16(__bfloat162float(xv[k]) - bl * __bfloat162float(bv[k]));
        store128(x_out + off + col, out.pack[i]);
    }
    norm_row_store_normalized(h + off, h_rstd + row, out, norm_row_rstd(out, C), C, lane);
}
// Reads x, x_backout and lambda; writes x_out, h and rstd; a multiply-add and the norm per element.
inline Work backout_forward_work(int T, int C) {
    return Work{.name = "backout_forward", .flops = 5.0 * T * C, .bytes_read = norm_rows_bytes(T, C, 2) + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C, 2) + norm_rstd_bytes(T)};
}
// x: the last layer's output; x_backout: layer 7's output; h feeds the lm_head.
inline void backout_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                            const __nv_bfloat16* x_backout, const float* backout_lambda, int T, int C,
                            cudaStream_t stream) {
    require_norm_rows("backout_forward", T, C, {x_out, h, x, x_backout});
    launch(backout_forward_work(T, C), backout_forward_kernel, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0, stream,
           x_out, h, h_rstd, x, x_backout, backout_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// gf = rstd*dh - x_out * rstd^3 dot(dh, x_out)/C (fp32); dx = bf16(gf), dx_backout = bf16(-bl * gf);
// partial sums of -gf * x_backout for backout_lambda.
__global__ void __launch_bounds__(kNormThreads, 4)
    backout_backward_kernel(__nv_bfloat16* dx, __nv_bfloat16* dx_backout, LastBlockSum sum, const __nv_bfloat16* dh,
                            const __nv_bfloat16* x_out, const float* h_rstd, const __nv_bfloat16* x_backout,
                            const float* backout_lambda, int T, int C) {
    const int lane = threadIdx.x % 32;
    const float bl = *backout_lambda;
    float acc[1] = {0.0f};
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float rstd = h_rstd[row], q = norm_row_grad_coeff(dh + off, x_out + off, rstd, C, lane);
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) break;
            const Pack128<__nv_bfloat16> dhv = load128(dh + off + col), xv = load128(x_out + off + col);
            const Pack128<__nv_bfloat16> bv = load128(x_backout + off + col);
            Pack128<__nv_bfloat16> dxv, dbv;
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) {
                const float gf = rstd * __bfloat162float(dhv[k]) - q * __bfloat162float(xv[k]);
                acc[0] -= gf * __bfloat162float(bv[k]);
                dxv[k] = __float2bfloat16(gf);
                dbv[k] = __float2bfloat16(-bl * gf);
            }
            store128(dx + off + col, dxv);
            store128(dx_backout + off + col, dbv);
        }
    }
    sum_warp_reduced_partials(sum, acc);
}
// Reads dh, x_out, x_backout, rstd and lambda; writes dx, dx_backout and the partials; the norm's
// gradient, a product and a scale per element.
inline Work backout_backward_work(int T, int C) {
    return Work{.name = "backout_backward", .flops = 9.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, 3) + norm_rstd_bytes(T) + sizeof(float),
                .bytes_written = norm_rows_bytes(T, C, 2) + 4.0 * residual_backward_blocks(T)};
}
// dh: the lm_head input's gradient. dx: the last layer's output gradient; dx_backout: layer 7's output's
// share (both overwritten: they are the first gradients of those streams). accumulate: add into
// d_backout_lambda. `scratch`: residual_backward_scratch_bytes(T) of partials.
inline void backout_backward(__nv_bfloat16* dx, __nv_bfloat16* dx_backout, float* d_backout_lambda,
                             BlockPartials scratch,
                             const __nv_bfloat16* dh, const __nv_bfloat16* x_out, const float* h_rstd,
                             const __nv_bfloat16* x_backout, const float* backout_lambda, bool accumulate, int T, int C,
                             cudaStream_t stream) {
    require_norm_rows("backout_backward", T, C, {dx, dx_backout, dh, x_out, x_backout});
    const int blocks = residual_backward_blocks(T);
    const LastBlockSum sum{SumTargets().add(d_backout_lambda), scratch, accumulate};
    launch(with_last_block_sum(backout_backward_work(T, C), sum, blocks), backout_backward_kernel, dim3(blocks),
           dim3(kNormThreads), 0, stream, dx, dx_backout, sum, dh, x_out, h_rstd, x_backout, backout_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- record 80: per-sublayer lambdas (upstream 2c702746, GPT.forward, train_gpt.py:L1278-1360) ----
// Layer i's two sublayers, with bf16 lambdas (each an fp32 parameter cast by `.bfloat16()` before use, L1278-83):
//   attention (i != 6): x = bf16(ra[i]*x + pa[i]*attn(norm(i > 7 ? h7 : x)) + inj[i])               (L1350-52)
//                       inj[0] = lx0[0]*x0, inj[i >= 1] = lx0[i]*x0 + lb[i]*xb, xb: the bigram embedding  (L1318)
//   layer 6 instead:    x = bf16(x + skip_gate_out*h3)                                                    (L1348)
//   MLP (every layer):  x = bf16(rm[i]*x + pm[i]*mlp(norm(x)))                                            (L1353)
// Before layer 0: x = bf16(x0 + lb[0]*xb) (L1314); after layer 10: x -= backout_lambda*h7 (L1360, fp32
// lambda from `scalars`: backout_forward as in record 71).
// Each update is one torch.compile expression: computed in fp32 from the bf16 stream, block output, x0,
// xb and lambdas, rounded once where the stream is stored (upstream precomputes the injections as a tuple,
// but each has one reader and inductor inlines it there unrounded: the reference's residual_stream_r80
// computes it the same way). A lambda's gradient is the fp32 sum over tokens rounded to bf16 (the
// gradient of the bf16 copy), then widened into the fp32 gradient (SumTargets::add_bf16_rounded).
// Forward, layer i (x: the stream; ha: its attention's input; lam_attn(i), lam_mlp(i): SublayerLambdas):
//   before layer 0:  stream_start_forward(x, ha, rstd, x0, xb, &bigram_lambdas[0], T, C, s)
//   i == 6:          gated_skip_add_norm_forward(xa, hm, rstd_a, x, h3, x0, skip_gate, skip_lambda, T, C, s)
//   else:            attention(ha) -> ao;  sublayer_residual_forward(xa, hm, rstd_a, x, ao, x0, xb, lam_attn(i),
//                                                                   i ? x0_and_bigram : x0, T, C, s)
//   mlp(hm) -> mo;   sublayer_residual_forward(xn, hn, rstd_n, xa, mo, -, -, lam_mlp(i), none, T, C, s)
// where hn, the next layer's attention input, is fused after layers 0-4, 6 and 7 (norm(h7): layers 8, 9
// and 10 all read it, computed once: the same bits as three times), and not (nullptr) after layer 5 (layer
// 6's skip add fuses it), 8, 9 (their successors read norm(h7)) and 10 (backout_forward).
// Backward: sublayer_residual_backward per sublayer in reverse, dh = the gradient of the norm it fused (at
// layer 7's MLP, NormGrads{dh8, dh9, dh10}: the three attention inputs' gradients); layer 6:
// residual_add_backward (its norm), then gated_skip_add_backward; before layer 0: stream_start_backward.
// Record 85 (upstream 003ff3e2, GPT.forward with the MUDD gate) reads x0's and the
// bigram's coefficients per token from the gate's columns (SublayerLambdas::injection_stride; stream_start_*'s
// token_stride for layer 0's bigram before the layer), and layer 6's skip is token_skip_add_norm_forward /
// token_skip_add_backward; each column's gradient is its row's sum, rounded to bf16 and written (the gate's
// backward, kernels/mudd.cuh, reads them). Resid and post stay shared lambdas.

// Which of x0 and the bigram embedding a sublayer update adds (scaled by their lambdas).
enum class Injection : int {
    none,           // MLP sublayers
    x0,             // layer 0's attention sublayer: lx0[0]*x0 (its bigram share entered before layer 0)
    x0_and_bigram,  // the attention sublayers of layers 1-10 but 6
};
// Device pointers to one sublayer's fp32 lambdas (read as their bf16 roundings); x0 and bigram are read
// only as the injection asks.
struct SublayerLambdas {
    const float* resid;   // resid_lambdas[i, 0 attention | 1 MLP]
    const float* post;    // post_lambdas[i, 0 | 1]
    const float* x0;      // x0_lambdas[i]
    const float* bigram;  // bigram_lambdas[i]
    // 0: one value each for every token. Record 81's MUDD (the last layer): per-token coefficients, token t's at
    // [t * token_stride] (fp32 copies of bf16 values, kernels/mudd.cuh), and the gradients per token too.
    int64_t token_stride = 0;
    // Record 85's MUDD gate (token_stride 0): x0 and bigram per token, token t's at [t * injection_stride] (columns
    // of the gate's coefficients, kernels/mudd.cuh), their gradients per token too; resid and post stay shared.
    int64_t injection_stride = 0;
};
// Which of a sublayer's lambdas are per token (SublayerLambdas): none, all (token_stride), or the injections'
// (injection_stride).
enum class TokenLambdas : int { none, all, injections };
inline TokenLambdas token_lambdas(const SublayerLambdas& l) {
    return l.token_stride > 0 ? TokenLambdas::all : l.injection_stride > 0 ? TokenLambdas::injections : TokenLambdas::none;
}
// Where their gradients go (fp32 elements of the parameters' gradients; per token: at the same stride as the
// lambdas, each the row's sum rounded to bf16, written); x0 and bigram as the injection asks.
struct SublayerLambdaGrads {
    float* resid;
    float* post;
    float* x0;
    float* bigram;
};
// The bf16 value upstream multiplies by: the fp32 parameter rounded (`.bfloat16()`).
__device__ __forceinline__ float bf16_lambda(const float* p) { return __bfloat162float(__float2bfloat16(*p)); }
// Token `row`'s value of a lambda (SublayerLambdas::token_stride).
__device__ __forceinline__ float bf16_lambda(const float* p, int row, int64_t token_stride) {
    return bf16_lambda(p + row * token_stride);
}
inline int injection_terms(Injection inj) { return inj == Injection::none ? 0 : inj == Injection::x0 ? 1 : 2; }
inline void require_token_strides(const char* who, const SublayerLambdas& l, Injection inj) {
    kernel_require(l.token_stride >= 0 && l.injection_stride >= 0 && !(l.token_stride && l.injection_stride) &&
                       (l.injection_stride == 0 || inj != Injection::none),
                   "%s: token_stride and injection_stride must not be negative, nor both set, and per-token injections "
                   "need an injection", who);
}
// Bytes of a sublayer's lambdas, read: shared ones once, per-token ones once a row.
inline double sublayer_lambda_bytes(int T, Injection inj, TokenLambdas tokens) {
    const int injected = injection_terms(inj);
    switch (tokens) {
    case TokenLambdas::all: return 4.0 * (2 + injected) * T;
    case TokenLambdas::injections: return 4.0 * (2 + injected * T);
    default: return 4.0 * (2 + injected);
    }
}
// The bigram injection's width, `bigram_dim`. 0: record 80's form, xb (T, C) added into every channel with
// x0's term, (r*x + p*y) + (lx0*x0 + lb*xb). Record 84's (upstream a333be08 L1390-1409, L1470-1474): xb is
// (T, bigram_dim), bigram_dim = 192, added into the stream's channels [0, bigram_dim) only, by an in-place
// slice add after the update: ((r*x + p*y) + lx0*x0) + lb*xb, which inductor fuses into one rounding.
inline void require_bigram_dim(const char* who, int bigram_dim, int C) {
    kernel_require(bigram_dim == 0 || (bigram_dim > 0 && bigram_dim <= C && bigram_dim % kNormPackWidth == 0),
                   "%s: bigram_dim %d must be 0 (every channel) or a multiple of %d up to C=%d", who, bigram_dim,
                   kNormPackWidth, C);
}
// Bytes of the bigram rows a row kernel reads or writes: (T, C), or (T, bigram_dim) when narrow.
inline double bigram_rows_bytes(int T, int C, int bigram_dim) { return 2.0 * T * (bigram_dim ? bigram_dim : C); }
// Where element `col` of row `row` of xb is, and whether the injection reaches it.
struct BigramSlot {
    size_t at;
    bool here;
};
__device__ __forceinline__ BigramSlot bigram_slot(int row, int col, int C, int bigram_dim) {
    return {static_cast<size_t>(row) * (bigram_dim ? bigram_dim : C) + col, bigram_dim == 0 || col < bigram_dim};
}

// x_out = bf16(r*x + p*y + (lx0*x0 + lb*xb as injected)), lambdas in bf16; h = norm(x_out) when h is given.
// kNarrow: record 84's bigram (bigram_dim > 0), its own instance: the two orders in one kernel spill.
template <bool kNarrow>
__global__ void __launch_bounds__(kNormThreads, 4)
    sublayer_residual_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                     const __nv_bfloat16* y, const __nv_bfloat16* x0, const __nv_bfloat16* x0_bigram,
                                     SublayerLambdas lambdas, Injection injection, int T, int C, int bigram_dim) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const bool with_x0 = injection != Injection::none, with_bigram = injection == Injection::x0_and_bigram;
    const int64_t ts = lambdas.token_stride, is = ts ? ts : lambdas.injection_stride;
    const float r = bf16_lambda(lambdas.resid, row, ts), p = bf16_lambda(lambdas.post, row, ts);
    const float l = with_x0 ? bf16_lambda(lambdas.x0, row, is) : 0.0f;
    const float b = with_bigram ? bf16_lambda(lambdas.bigram, row, is) : 0.0f;
    const size_t off = static_cast<size_t>(row) * C;
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col), yv = load128(y + off + col);
        const Pack128<__nv_bfloat16> zv = with_x0 ? load128(x0 + off + col) : Pack128<__nv_bfloat16>{};
        const BigramSlot slot = bigram_slot(row, col, C, kNarrow ? bigram_dim : 0);
        const bool here = with_bigram && slot.here;
        const Pack128<__nv_bfloat16> bv = here ? load128(x0_bigram + slot.at) : Pack128<__nv_bfloat16>{};
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) {
            const float base = r * __bfloat162float(xv[k]) + p * __bfloat162float(yv[k]);
            float v;
            if constexpr (!kNarrow) {  // record 80's order: (r*x + p*y) + (lx0*x0 + lb*xb)
                v = base + (l * __bfloat162float(zv[k]) + b * __bfloat162float(bv[k]));
            } else {  // record 84's: ((r*x + p*y) + lx0*x0) + lb*xb where the bigram reaches
                v = base + l * __bfloat162float(zv[k]);
                if (here) v += b * __bfloat162float(bv[k]);
            }
            out.pack[i][k] = __float2bfloat16(v);
        }
        store128(x_out + off + col, out.pack[i]);
    }
    if (h) norm_row_store_normalized(h + off, h_rstd + row, out, norm_row_rstd(out, C), C, lane);
}
// Reads x, y, the injected x0 and xb, and the lambdas; writes x_out (and h, rstd with the norm); two
// multiply-adds per term, 3 more per element with the norm.
inline Work sublayer_residual_forward_work(int T, int C, Injection injection, bool norm, int bigram_dim,
                                          TokenLambdas tokens = TokenLambdas::none) {
    const int terms = 2 + injection_terms(injection);
    const double narrow = injection == Injection::x0_and_bigram ? norm_rows_bytes(T, C) - bigram_rows_bytes(T, C, bigram_dim) : 0;
    return Work{.name = "sublayer_residual_forward", .flops = (2.0 * terms + (norm ? 3.0 : 0.0)) * T * C,
                .bytes_read = norm_rows_bytes(T, C, terms) - narrow + sublayer_lambda_bytes(T, injection, tokens),
                .bytes_written = norm_rows_bytes(T, C, norm ? 2 : 1) + (norm ? norm_rstd_bytes(T) : 0)};
}
// One sublayer's update of the stream x by its block's output y (and the injection); with h (and h_rstd)
// also the norm the next block reads. x_out may be x (in place) when the backward does not need x.
// bigram_dim: the bigram injection's width (require_bigram_dim; 0: record 80's).
inline void sublayer_residual_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x,
                                      const __nv_bfloat16* y, const __nv_bfloat16* x0, const __nv_bfloat16* x0_bigram,
                                      SublayerLambdas lambdas, Injection injection, int T, int C,
                                      cudaStream_t stream, int bigram_dim = 0) {
    require_norm_rows("sublayer_residual_forward", T, C, {x_out, h, x, y, x0, x0_bigram});
    require_bigram_dim("sublayer_residual_forward", bigram_dim, C);
    const int terms = injection_terms(injection);
    kernel_require(x_out && x && y && lambdas.resid && lambdas.post && (h != nullptr) == (h_rstd != nullptr),
                   "sublayer_residual_forward: x_out, x, y and the resid and post lambdas are required, h and "
                   "h_rstd both or neither");
    kernel_require((terms < 1 || (x0 && lambdas.x0)) && (terms < 2 || (x0_bigram && lambdas.bigram)),
                   "sublayer_residual_forward: the injection reads x0 (and x0_bigram) and their lambdas, missing");
    require_token_strides("sublayer_residual_forward", lambdas, injection);
    const Work work = sublayer_residual_forward_work(T, C, injection, h != nullptr, bigram_dim, token_lambdas(lambdas));
    if (bigram_dim)
        launch(work, sublayer_residual_forward_kernel<true>, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0, stream,
               x_out, h, h_rstd, x, y, x0, x0_bigram, lambdas, injection, T, C, bigram_dim);
    else
        launch(work, sublayer_residual_forward_kernel<false>, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0, stream,
               x_out, h, h_rstd, x, y, x0, x0_bigram, lambdas, injection, T, C, bigram_dim);
    CUDA_CHECK_LAUNCH();
}

// The gradients of the norms the blocks read from a sublayer's output (nullptr: none): one, or for h7
// (layer 7's output) the three attention inputs of layers 8-10, each norm(h7). Their norm backwards are
// linear in dh, so the kernel sums them in fp32 as one: rstd*sum(dh) - x*rstd^3*dot(sum(dh), x)/C.
struct NormGrads {
    static constexpr int kMax = 3;
    const __nv_bfloat16* dh[kMax];
    int count() const {
        int n = 0;
        for (const __nv_bfloat16* p : dh) n += p != nullptr;
        return n;
    }
};
static_assert(std::has_unique_object_representations_v<NormGrads>, "NormGrads: a kernel argument with padding");
// q = dot(sum_j dh_j, x) * rstd^3 / C over the given dh_j, in fp32 (norm_row_grad_coeff's order when one
// is given). Streamed pack by pack: holding whole rows costs registers the backward does not have.
__device__ __forceinline__ float norm_grads_coeff(const NormGrads& g, size_t off, const __nv_bfloat16* x, float rstd,
                                                  int C, int lane) {
    float s = 0.0f;
#pragma unroll 1
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) break;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col);
#pragma unroll
        for (int j = 0; j < NormGrads::kMax; ++j) {
            if (!g.dh[j]) continue;
            const Pack128<__nv_bfloat16> dv = load128(g.dh[j] + off + col);
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) s += __bfloat162float(dv[k]) * __bfloat162float(xv[k]);
        }
    }
    return warp_reduce_sum(s) * (rstd * rstd * rstd) / static_cast<float>(C);
}
// sum_k gm[k] * v[k] over one pack, in order.
__device__ __forceinline__ float pack_dot(const float (&gm)[kNormPackWidth], const Pack128<__nv_bfloat16>& v) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kNormPackWidth; ++k) s += gm[k] * __bfloat162float(v[k]);
    return s;
}
// out = bf16(c * gm), or bf16(out + c * gm) when accumulating, over one pack.
__device__ __forceinline__ void store_scaled_pack(__nv_bfloat16* out, const float (&gm)[kNormPackWidth], float c,
                                                  bool accumulate) {
    Pack128<__nv_bfloat16> v = accumulate ? load128(out) : Pack128<__nv_bfloat16>{};
#pragma unroll
    for (int k = 0; k < kNormPackWidth; ++k)
        v[k] = __float2bfloat16(accumulate ? __bfloat162float(v[k]) + c * gm[k] : c * gm[k]);
    store128(out, v);
}
// How sublayer_residual_backward meets its sublayer and its outputs (write them with designators).
struct SublayerBackwardOptions {
    Injection injection;           // as in the forward
    bool accumulate_dx;            // add into dx (it holds another share of the stream's gradient)
    bool accumulate_x0_grads;      // add into dx0 and dx0_bigram (every injection but the first the backward meets)
    bool accumulate_lambda_grads;  // add into the lambda gradients (every micro-step but the first)
    int bigram_dim = 0;            // the bigram injection's width (as in the forward; 0: record 80's)
};
// gm = g + rstd*dh - x_out * rstd^3 dot(dh, x_out)/C (fp32, dh the sum of the NormGrads; gm = g without
// any); dx (+)= r*gm, dy = p*gm,
// dx0 (+)= lx0*gm, dxb (+)= lb*gm (lambdas in bf16); partial sums of gm*x, gm*y, gm*x0, gm*xb.
// kTokens (TokenLambdas): per-token lambdas are the row's, and so are their sums, written per row (rounded to
// bf16) into `grads` instead of summed over the rows: all four (record 81, token_stride), or x0's and the
// bigram's (record 85, injection_stride) with resid's and post's summed as shared lambdas. Each its own
// instance: the sums' order of the shared-lambda kernel stays as it was.
template <TokenLambdas kTokens>
__global__ void __launch_bounds__(kNormThreads, 3)
    sublayer_residual_backward_kernel(__nv_bfloat16* dx, __nv_bfloat16* dy, __nv_bfloat16* dx0,
                                      __nv_bfloat16* dx0_bigram, LastBlockSum sum, SublayerLambdaGrads grads,
                                      const __nv_bfloat16* g,
                                      NormGrads dh, const __nv_bfloat16* x_out, const float* h_rstd,
                                      const __nv_bfloat16* x, const __nv_bfloat16* y, const __nv_bfloat16* x0,
                                      const __nv_bfloat16* x0_bigram, SublayerLambdas lambdas, Injection injection,
                                      bool accumulate_dx, bool accumulate_x0_grads, int T, int C, int bigram_dim) {
    const int lane = threadIdx.x % 32;
    const bool with_x0 = injection != Injection::none, with_bigram = injection == Injection::x0_and_bigram;
    constexpr bool kAll = kTokens == TokenLambdas::all, kInjections = kTokens != TokenLambdas::none;
    const int64_t ts = kAll ? lambdas.token_stride : 0, is = kAll ? ts : kInjections ? lambdas.injection_stride : 0;
    float r = bf16_lambda(lambdas.resid), p = bf16_lambda(lambdas.post);
    float l = with_x0 ? bf16_lambda(lambdas.x0) : 0.0f, b = with_bigram ? bf16_lambda(lambdas.bigram) : 0.0f;
    const bool norm = dh.dh[0] || dh.dh[1] || dh.dh[2];
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // gm*x, gm*y, gm*x0, gm*xb
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        if constexpr (kInjections) {
            if constexpr (kAll) r = bf16_lambda(lambdas.resid, row, ts), p = bf16_lambda(lambdas.post, row, ts);
            l = with_x0 ? bf16_lambda(lambdas.x0, row, is) : 0.0f;
            b = with_bigram ? bf16_lambda(lambdas.bigram, row, is) : 0.0f;
#pragma unroll
            for (int v = kAll ? 0 : 2; v < 4; ++v) acc[v] = 0.0f;
        }
        const float rstd = norm ? h_rstd[row] : 0.0f;
        const float q = norm ? norm_grads_coeff(dh, off, x_out, rstd, C, lane) : 0.0f;
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) break;
            const size_t at = off + col;
            // one tensor at a time (gm held in fp32): holding every pack at once spills
            float gm[kNormPackWidth];
            const Pack128<__nv_bfloat16> gv = load128(g + at);
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) gm[k] = __bfloat162float(gv[k]);
            if (norm) {
                const Pack128<__nv_bfloat16> xov = load128(x_out + at);
#pragma unroll
                for (int k = 0; k < kNormPackWidth; ++k) gm[k] -= q * __bfloat162float(xov[k]);
                float dhs[kNormPackWidth] = {};  // the sum of the norms' gradients, in fp32
#pragma unroll
                for (int j = 0; j < NormGrads::kMax; ++j) {
                    if (!dh.dh[j]) continue;
                    const Pack128<__nv_bfloat16> dhv = load128(dh.dh[j] + at);
#pragma unroll
                    for (int k = 0; k < kNormPackWidth; ++k) dhs[k] += __bfloat162float(dhv[k]);
                }
#pragma unroll
                for (int k = 0; k < kNormPackWidth; ++k) gm[k] += rstd * dhs[k];
            }
            acc[0] += pack_dot(gm, load128(x + at));
            acc[1] += pack_dot(gm, load128(y + at));
            if (with_x0) acc[2] += pack_dot(gm, load128(x0 + at));
            const BigramSlot slot = bigram_slot(row, col, C, bigram_dim);
            const bool here = with_bigram && slot.here;
            if (here) acc[3] += pack_dot(gm, load128(x0_bigram + slot.at));
            store_scaled_pack(dx + at, gm, r, accumulate_dx);
            store_scaled_pack(dy + at, gm, p, false);
            if (with_x0) store_scaled_pack(dx0 + at, gm, l, accumulate_x0_grads);
            if (here) store_scaled_pack(dx0_bigram + slot.at, gm, b, accumulate_x0_grads);
        }
        if constexpr (kInjections) {
            float* const out[4] = {grads.resid, grads.post, grads.x0, grads.bigram};
#pragma unroll
            for (int v = kAll ? 0 : 2; v < 4; ++v) {
                const float s = warp_reduce_sum(acc[v]);
                if (lane == 0 && (v < 2 || (v == 2 && with_x0) || (v == 3 && with_bigram)))
                    out[v][row * is] = __bfloat162float(__float2bfloat16(s));
            }
        }
    }
    if constexpr (kTokens == TokenLambdas::none) {
        sum_warp_reduced_partials(sum, acc);
    } else if constexpr (kTokens == TokenLambdas::injections) {
        const float shared[2] = {acc[0], acc[1]};  // resid's and post's
        sum_warp_reduced_partials(sum, shared);
    }
}
// Reads g, x, y, the injected x0 and xb, (dh, x_out and rstd with the norm), the lambdas and the
// gradients it adds into; writes dx, dy, the injected terms' gradients and the partials; the norm's
// gradient, a product and a scaled output per term, ~7 + 4 per term operations per element.
inline Work sublayer_residual_backward_work(int T, int C, const SublayerBackwardOptions& o, int norms,
                                           TokenLambdas tokens = TokenLambdas::none) {
    const int terms = 2 + injection_terms(o.injection), injected = terms - 2;
    const int added = (o.accumulate_dx ? 1 : 0) + (o.accumulate_x0_grads ? injected : 0);
    // a narrow bigram: xb and its gradient (and what it adds to) are (T, bigram_dim)
    const double narrow = injected == 2 ? norm_rows_bytes(T, C) - bigram_rows_bytes(T, C, o.bigram_dim) : 0;
    return Work{.name = "sublayer_residual_backward", .flops = (4.0 * terms + (norms ? 5.0 + 2 * norms : 0.0)) * T * C,
                .bytes_read = norm_rows_bytes(T, C, 1 + terms + (norms ? 1 + norms : 0) + added) -
                              (o.accumulate_x0_grads ? 2 : 1) * narrow + (norms ? norm_rstd_bytes(T) : 0) +
                              sublayer_lambda_bytes(T, o.injection, tokens),
                // per token: each row's lambda gradients; shared: the partials (the last block's sum is added after)
                .bytes_written = norm_rows_bytes(T, C, terms) - narrow +
                                 (tokens == TokenLambdas::all ? 4.0 * terms * T
                                  : tokens == TokenLambdas::injections
                                      ? 4.0 * injected * T + 4.0 * 2 * residual_backward_blocks(T)
                                      : 4.0 * terms * residual_backward_blocks(T))};
}
// From the gradient of the sublayer output's uses: g (the stream, passed on to the next update) and dh
// (the norms that blocks read from it: NormGrads; {} where none did). dx: the gradient of the
// stream entering the sublayer, may be g itself (in place) unless accumulate_dx; dy: the block output's
// gradient (overwritten). dx0 / dx0_bigram: as the injection asks (else unused). lambda_grads: resid and
// post always, x0 and bigram as the injection asks; each receives its fp32 sum over tokens rounded to
// bf16 (a per-token lambda, SublayerLambdas: its row's sum rounded to bf16, written at the lambdas' stride).
// The options: SublayerBackwardOptions. `scratch`: residual_backward_scratch_bytes(T) of partials.
inline void sublayer_residual_backward(__nv_bfloat16* dx, __nv_bfloat16* dy, __nv_bfloat16* dx0,
                                       __nv_bfloat16* dx0_bigram, SublayerLambdaGrads lambda_grads,
                                       BlockPartials scratch, const __nv_bfloat16* g, NormGrads dh,
                                       const __nv_bfloat16* x_out, const float* h_rstd, const __nv_bfloat16* x,
                                       const __nv_bfloat16* y, const __nv_bfloat16* x0,
                                       const __nv_bfloat16* x0_bigram, SublayerLambdas lambdas,
                                       SublayerBackwardOptions options, int T, int C, cudaStream_t stream) {
    require_norm_rows("sublayer_residual_backward", T, C,
                      {dx, dy, dx0, dx0_bigram, g, dh.dh[0], dh.dh[1], dh.dh[2], x_out, x, y, x0, x0_bigram});
    require_bigram_dim("sublayer_residual_backward", options.bigram_dim, C);
    const int terms = injection_terms(options.injection);
    kernel_require(dx && dy && g && x && y && lambdas.resid && lambdas.post && lambda_grads.resid && lambda_grads.post,
                   "sublayer_residual_backward: dx, dy, g, x, y and the resid and post lambdas and gradients are "
                   "required");
    kernel_require(dh.count() == 0 || (x_out && h_rstd),
                   "sublayer_residual_backward: dh needs the forward's x_out and h_rstd");
    kernel_require(terms < 1 || (dx0 && x0 && lambdas.x0 && lambda_grads.x0),
                   "sublayer_residual_backward: the x0 injection needs dx0, x0 and the x0 lambda and its gradient");
    kernel_require(terms < 2 || (dx0_bigram && x0_bigram && lambdas.bigram && lambda_grads.bigram),
                   "sublayer_residual_backward: the bigram injection needs dx0_bigram, x0_bigram and the bigram "
                   "lambda and its gradient");
    kernel_require(dy != g && (!options.accumulate_dx || dx != g),
                   "sublayer_residual_backward: dy may not alias g, nor dx when accumulating into it");
    require_token_strides("sublayer_residual_backward", lambdas, options.injection);
    kernel_require(lambdas.token_stride == 0 || !options.accumulate_lambda_grads,
                   "sublayer_residual_backward: per-token lambdas (token_stride > 0) write their gradients per token, "
                   "never accumulating");
    const int blocks = residual_backward_blocks(T);
    if (lambdas.token_stride > 0) {  // per-token gradients, written by their rows: no partials
        launch(sublayer_residual_backward_work(T, C, options, dh.count(), TokenLambdas::all),
               sublayer_residual_backward_kernel<TokenLambdas::all>,
               dim3(blocks), dim3(kNormThreads), 0, stream, dx, dy, dx0, dx0_bigram, LastBlockSum{}, lambda_grads, g, dh,
               x_out, h_rstd, x, y, x0, x0_bigram, lambdas, options.injection, options.accumulate_dx,
               options.accumulate_x0_grads, T, C, options.bigram_dim);
        CUDA_CHECK_LAUNCH();
        return;
    }
    SumTargets targets = SumTargets().add_bf16_rounded(lambda_grads.resid).add_bf16_rounded(lambda_grads.post);
    if (lambdas.injection_stride > 0) {  // x0's and the bigram's per row (accumulate_lambda_grads: resid's and post's)
        const LastBlockSum sum{targets, scratch, options.accumulate_lambda_grads};
        launch(with_last_block_sum(
                   sublayer_residual_backward_work(T, C, options, dh.count(), TokenLambdas::injections), sum, blocks),
               sublayer_residual_backward_kernel<TokenLambdas::injections>, dim3(blocks), dim3(kNormThreads), 0, stream,
               dx, dy, dx0, dx0_bigram, sum, lambda_grads, g, dh, x_out, h_rstd, x, y, x0, x0_bigram, lambdas,
               options.injection, options.accumulate_dx, options.accumulate_x0_grads, T, C, options.bigram_dim);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (terms >= 1) targets.add_bf16_rounded(lambda_grads.x0);
    if (terms >= 2) targets.add_bf16_rounded(lambda_grads.bigram);
    const LastBlockSum sum{targets, scratch, options.accumulate_lambda_grads};
    launch(with_last_block_sum(sublayer_residual_backward_work(T, C, options, dh.count()), sum, blocks),
           sublayer_residual_backward_kernel<TokenLambdas::none>, dim3(blocks), dim3(kNormThreads), 0, stream, dx, dy, dx0,
           dx0_bigram, sum, lambda_grads, g, dh, x_out, h_rstd, x, y, x0, x0_bigram, lambdas, options.injection,
           options.accumulate_dx, options.accumulate_x0_grads, T, C, options.bigram_dim);
    CUDA_CHECK_LAUNCH();
}

// ---- record 80: the stream before layer 0 ----
// x_out = bf16(x0 + lb*xb), lb = bf16(bigram_lambdas[0]) (or token t's coefficient, token_stride > 0), where
// the bigram reaches (bigram_dim); x0 elsewhere; h = norm(x_out) (layer 0's attention input).
__global__ void __launch_bounds__(kNormThreads, 4)
    stream_start_forward_kernel(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x0,
                                const __nv_bfloat16* x0_bigram, const float* bigram_lambda, int T, int C,
                                int bigram_dim, int64_t token_stride) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const size_t off = static_cast<size_t>(row) * C;
    const float b = bf16_lambda(bigram_lambda, row, token_stride);
    if (bigram_dim == 0) {
        add_scaled_row(x_out + off, h + off, h_rstd + row, x0 + off, x0_bigram + off, b, C, lane);
        return;
    }
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        out.pack[i] = load128(x0 + off + col);
        if (const BigramSlot slot = bigram_slot(row, col, C, bigram_dim); slot.here) {
            const Pack128<__nv_bfloat16> bv = load128(x0_bigram + slot.at);
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k)
                out.pack[i][k] = __float2bfloat16(__bfloat162float(out.pack[i][k]) + b * __bfloat162float(bv[k]));
        }
        store128(x_out + off + col, out.pack[i]);
    }
    norm_row_store_normalized(h + off, h_rstd + row, out, norm_row_rstd(out, C), C, lane);
}
// Reads x0, xb and the lambda (or each token's coefficient); writes x_out, h and rstd; a multiply-add and the norm
// per element.
inline Work stream_start_forward_work(int T, int C, int bigram_dim, bool per_token = false) {
    return Work{.name = "stream_start_forward", .flops = 5.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C) + bigram_rows_bytes(T, C, bigram_dim) + sizeof(float) * (per_token ? T : 1),
                .bytes_written = norm_rows_bytes(T, C, 2) + norm_rstd_bytes(T)};
}
// x0: the normed smeared embedding; x0_bigram: the bigram embedding; bigram_lambda: bigram_lambdas[0];
// bigram_dim: the bigram's width (require_bigram_dim; 0: record 80's, every channel). x_out may be x0 (record
// 84's aliasing, in place: each pack is read by the thread that then writes it). token_stride > 0 (record 85):
// the bigram's coefficient is per token, token t's at bigram_lambda[t * token_stride] (the MUDD pre gate's
// column for layer 0: fp32 copies of bf16 values, kernels/mudd.cuh).
inline void stream_start_forward(__nv_bfloat16* x_out, __nv_bfloat16* h, float* h_rstd, const __nv_bfloat16* x0,
                                 const __nv_bfloat16* x0_bigram, const float* bigram_lambda, int T, int C,
                                 cudaStream_t stream, int bigram_dim = 0, int64_t token_stride = 0) {
    require_norm_rows("stream_start_forward", T, C, {x_out, h, x0, x0_bigram});
    require_bigram_dim("stream_start_forward", bigram_dim, C);
    kernel_require(x_out && h && h_rstd && x0 && x0_bigram && bigram_lambda && token_stride >= 0,
                   "stream_start_forward: every tensor and the lambda are required, token_stride not negative");
    launch(stream_start_forward_work(T, C, bigram_dim, token_stride > 0), stream_start_forward_kernel,
           dim3(norm_row_blocks(T)), dim3(kNormThreads), 0, stream, x_out, h, h_rstd, x0, x0_bigram, bigram_lambda, T,
           C, bigram_dim, token_stride);
    CUDA_CHECK_LAUNCH();
}

// gm = g + rstd*dh - x_out * rstd^3 dot(dh, x_out)/C (fp32); dx0 (+)= gm, dxb (+)= lb*gm; partial sums
// of gm*xb for bigram_lambdas[0]. x0_is_stream (record 84's aliasing): dx0 holds the gradient of x0's
// readers, which read the stream start itself, so the stream's gradient is gs = bf16(dx0 + gm), and dxb and
// the lambda's sums take gs in place of gm. kPerToken (record 85): lb is the row's coefficient, token_stride apart,
// and so is its sum, written per row (rounded to bf16) into d_bigram_lambda at the same stride (its own instance).
template <bool kPerToken>
__global__ void __launch_bounds__(kNormThreads, 4)
    stream_start_backward_kernel(__nv_bfloat16* dx0, __nv_bfloat16* dx0_bigram, LastBlockSum sum,
                                 float* d_bigram_lambda, const __nv_bfloat16* g, const __nv_bfloat16* dh,
                                 const __nv_bfloat16* x_out, const float* h_rstd, const __nv_bfloat16* x0_bigram,
                                 const float* bigram_lambda, int64_t token_stride, bool accumulate_x0_grads,
                                 bool x0_is_stream, int T, int C, int bigram_dim) {
    const int lane = threadIdx.x % 32;
    float b = bf16_lambda(bigram_lambda);
    float acc[1] = {0.0f};
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        if constexpr (kPerToken) b = bf16_lambda(bigram_lambda, row, token_stride), acc[0] = 0.0f;
        const float rstd = h_rstd[row], q = norm_row_grad_coeff(dh + off, x_out + off, rstd, C, lane);
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) break;
            const size_t at = off + col;
            const Pack128<__nv_bfloat16> gv = load128(g + at), dhv = load128(dh + at), xv = load128(x_out + at);
            const BigramSlot slot = bigram_slot(row, col, C, bigram_dim);
            const bool here = slot.here;
            const Pack128<__nv_bfloat16> bv = here ? load128(x0_bigram + slot.at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> dzv = accumulate_x0_grads ? load128(dx0 + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> dbv =
                here && accumulate_x0_grads ? load128(dx0_bigram + slot.at) : Pack128<__nv_bfloat16>{};
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) {
                const float gm =
                    __bfloat162float(gv[k]) + rstd * __bfloat162float(dhv[k]) - q * __bfloat162float(xv[k]);
                dzv[k] = __float2bfloat16(accumulate_x0_grads ? __bfloat162float(dzv[k]) + gm : gm);
                const float gs = x0_is_stream ? __bfloat162float(dzv[k]) : gm;
                acc[0] += gs * __bfloat162float(bv[k]);
                dbv[k] = __float2bfloat16(accumulate_x0_grads ? __bfloat162float(dbv[k]) + b * gs : b * gs);
            }
            store128(dx0 + at, dzv);
            if (here) store128(dx0_bigram + slot.at, dbv);
        }
        if constexpr (kPerToken) {
            const float s = warp_reduce_sum(acc[0]);
            if (lane == 0) d_bigram_lambda[row * token_stride] = __bfloat162float(__float2bfloat16(s));
        }
    }
    if constexpr (!kPerToken) sum_warp_reduced_partials(sum, acc);
}
// Reads g, dh, x_out, xb, rstd and the lambda (and the gradients it adds into); writes dx0, dxb and the
// partials; the norm's gradient, a product and a scale per element.
// (Per token: each row's coefficient read and its gradient written, no partials.)
inline Work stream_start_backward_work(int T, int C, bool accumulate_x0_grads, int bigram_dim, bool per_token = false) {
    const double xb = bigram_rows_bytes(T, C, bigram_dim);  // xb, and dxb where it accumulates
    return Work{.name = "stream_start_backward", .flops = 10.0 * T * C,
                .bytes_read = norm_rows_bytes(T, C, accumulate_x0_grads ? 4 : 3) + (accumulate_x0_grads ? 2 : 1) * xb +
                              norm_rstd_bytes(T) + sizeof(float) * (per_token ? T : 1),
                .bytes_written = norm_rows_bytes(T, C) + xb + 4.0 * (per_token ? T : residual_backward_blocks(T))};
}
// Which outputs of stream_start_backward already hold a share to add to (write them with designators).
struct StreamStartBackwardOptions {
    bool accumulate_x0_grads;      // dx0, dx0_bigram: they hold the injections' and the skip gate's shares
    bool accumulate_lambda_grads;  // d_bigram_lambda (every micro-step but the first)
    int bigram_dim = 0;            // the bigram's width (as in the forward; 0: record 80's, every channel)
    // record 84's aliasing (Structure::x0_is_stream): x0's readers read the stream start, so dx0's share is the
    // stream's too and reaches the bigram and its lambda (needs accumulate_x0_grads: dx0 holds that share)
    bool x0_is_stream = false;
    // record 85 (as in the forward): the bigram's coefficient per token, and its gradient per token (written, at
    // the same stride: accumulate_lambda_grads must be false)
    int64_t token_stride = 0;
};
// g: the gradient of the stream entering layer 0 (from layer 0's attention sublayer); dh: of the norm
// layer 0's attention read. dx0 and dx0_bigram receive their gradients; d_bigram_lambda receives
// bigram_lambdas[0]'s fp32 sum rounded to bf16 (per token: each row's). `scratch`: residual_backward_scratch_bytes(T)
// (unused per token).
inline void stream_start_backward(__nv_bfloat16* dx0, __nv_bfloat16* dx0_bigram, float* d_bigram_lambda,
                                  BlockPartials scratch, const __nv_bfloat16* g, const __nv_bfloat16* dh,
                                  const __nv_bfloat16* x_out, const float* h_rstd, const __nv_bfloat16* x0_bigram,
                                  const float* bigram_lambda, StreamStartBackwardOptions options, int T, int C,
                                  cudaStream_t stream) {
    require_norm_rows("stream_start_backward", T, C, {dx0, dx0_bigram, g, dh, x_out, x0_bigram});
    require_bigram_dim("stream_start_backward", options.bigram_dim, C);
    kernel_require(dx0 && dx0_bigram && d_bigram_lambda && g && dh && x_out && h_rstd && x0_bigram && bigram_lambda,
                   "stream_start_backward: every tensor and the lambda and its gradient are required");
    kernel_require(!options.x0_is_stream || options.accumulate_x0_grads,
                   "stream_start_backward: x0_is_stream needs accumulate_x0_grads (dx0 holds x0's readers' share)");
    kernel_require(options.token_stride >= 0 && (options.token_stride == 0 || !options.accumulate_lambda_grads),
                   "stream_start_backward: a per-token coefficient's gradient is written per token, never accumulated; "
                   "token_stride must not be negative");
    const int blocks = residual_backward_blocks(T);
    if (options.token_stride > 0) {
        launch(stream_start_backward_work(T, C, options.accumulate_x0_grads, options.bigram_dim, true),
               stream_start_backward_kernel<true>, dim3(blocks), dim3(kNormThreads), 0, stream, dx0, dx0_bigram,
               LastBlockSum{}, d_bigram_lambda, g, dh, x_out, h_rstd, x0_bigram, bigram_lambda, options.token_stride,
               options.accumulate_x0_grads, options.x0_is_stream, T, C, options.bigram_dim);
        CUDA_CHECK_LAUNCH();
        return;
    }
    const LastBlockSum sum{SumTargets().add_bf16_rounded(d_bigram_lambda), scratch, options.accumulate_lambda_grads};
    launch(with_last_block_sum(stream_start_backward_work(T, C, options.accumulate_x0_grads, options.bigram_dim), sum,
                               blocks),
           stream_start_backward_kernel<false>, dim3(blocks), dim3(kNormThreads), 0, stream, dx0, dx0_bigram, sum,
           d_bigram_lambda, g, dh, x_out, h_rstd, x0_bigram, bigram_lambda, int64_t{0}, options.accumulate_x0_grads,
           options.x0_is_stream, T, C, options.bigram_dim);
    CUDA_CHECK_LAUNCH();
}
