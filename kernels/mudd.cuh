// Record 81's MUDD, multiway dynamic dense connections (upstream a333be08: init_mudd, forward_mudd and their
// use at the last layer and after it): per-token coefficients from a small MLP of a stream row, which mix the
// streams saved earlier (h0: the stream entering layer 0, h3 and h7: layers 3's and 7's outputs, h9: the last
// layer's input) into the last layer and into the stream the head reads.
//
// Per token t, block id (0: the last layer's entry, n = 14 coefficients from h9; 1: the exit, n = 5 from the
// last layer's output x):
//   z = h @ w1[id]^T                                    (T, 64): a cuBLASLt matmul, before these kernels
//   u = bf16(gelu(z)), c = bf16((bf16(u . w2[id, :n]^T) + b2[id, :n]) * 0.1)   (exact-erf GELU)
//   entry: aux_v = bf16(g_h ve + c0 h0 + c1 h7 + c2 h9), g_h = c6 for heads < H/2, c7 for the others
//          (ve: the layer's value table at the tokens; aux_v joins v as the value embedding does)
//          r = bf16((1 + c5) h9 + c3 h0 + c4 h7)         (the stream the layer's attention update scales by c8)
//          c8..c13 are the layer's per-token update coefficients, for the residual kernels
//   exit:  xf = bf16(x + c0 h0 + c1 h7 + c2 h9 + c3 ve0 + c4 h3); hf = norm(xf)   (ve0: value table 0 at the
//          tokens, ungated; this replaces record 80's backout)
// The coefficients are kept as fp32 copies of their bf16 values, kMuddCoefStride per token.
//
// Backward: dc_j = bf16(sum over the row of g . source_j) per token (the entry's gate: per head, then the
// heads of each half); dpre = bf16(0.1 dc); du = bf16(dpre . w2[id]); dz = bf16(du gelu'(z)), gelu'(z) =
// Phi(z) + z phi(z); db2 = sum_t dpre and dw2 = sum_t dpre u from fixed-order block partials summed by the
// last block (bitwise reproducible); dw1 = dz^T h and dh += dz w1 are matmuls after these kernels. Every
// source receives c_j g, added to what its gradient already holds where the caller says so.
#pragma once
#include "common.cuh"
#include "norm.cuh"

#include <cmath>
#include <type_traits>

constexpr int kMuddHidden = 64;      // the MLP's hidden width: two values per lane
constexpr int kMuddMaxCoef = 14;     // the entry's coefficients (upstream's max_num_coef)
constexpr int kMuddEntryCoef = 14, kMuddExitCoef = 5;
constexpr int kMuddCoefStride = 16;  // fp32 per token in the coefficient buffers
constexpr int kMuddExitSources = 5;  // h0, h7, h9, ve0, h3
constexpr int kMuddMaxHeads = 16;
constexpr int kMuddMaxBackwardBlocks = 264;  // two per SM of an H100: the partials' second pass stays short
constexpr float kMuddScale = 0.1f;           // upstream's _mudd_scale
constexpr int kMuddPartials = kMuddMaxCoef * (kMuddHidden + 1);  // per block: dw2 then db2
// Record 85's MUDD gate (its own section at the end).
constexpr int kMuddGatePreCoef = 26, kMuddGatePostCoef = 41;
constexpr int kMuddGateMaxCoef = 41;      // upstream's max_num_coef: w2 is (2, 41, 64), b2 (2, 41)
constexpr int kMuddGateCoefStride = 48;   // fp32 per token in the gate's coefficient buffers (16-byte rows)
constexpr int kMuddGatePartials = kMuddGateMaxCoef * (kMuddHidden + 1) + 1;  // per block: dw2, db2, dscale

// One MUDD block's second layer: rows [0, n) of w2[id] (n x 64) and b2[id] (bf16 parameters).
// Kernel arguments without padding (static_asserts below): emu's race detector reads every word of a struct argument
// as a possible pointer, and a padding word's stale bytes beside a small field can make one that points into a live
// buffer, a race that is not there (tiny-r86's 8 strict ranks met one through a bool's padding).
struct MuddHead {
    const __nv_bfloat16* w2;
    const __nv_bfloat16* b2;
    int n;
    int unused = 0;
};
// Where that block's gradients go (bf16 parameter gradients, n x 64 and n), and whether they add to them.
struct MuddHeadGrads {
    __nv_bfloat16* dw2;
    __nv_bfloat16* db2;
    int64_t accumulate;  // a bool, as wide as a word
};
// A mixed stream: rows of a (T, C) tensor, or (ids set) rows of a table at the tokens.
struct MuddSource {
    const __nv_bfloat16* rows;
    const int32_t* ids;
};
// A source's gradient, (T, C): written, or added to what it holds.
struct MuddSourceGrad {
    __nv_bfloat16* d;
    int64_t accumulate;  // a bool, as wide as a word
};
static_assert(std::has_unique_object_representations_v<MuddHead> &&
                  std::has_unique_object_representations_v<MuddHeadGrads> &&
                  std::has_unique_object_representations_v<MuddSourceGrad>,
              "the MUDD heads' kernel arguments: padding");

__device__ __forceinline__ float bf16_round(float v) { return __bfloat162float(__float2bfloat16(v)); }
__device__ __forceinline__ float gelu_erf(float z) { return 0.5f * z * (1.0f + erff(z * 0.70710678118654752f)); }
__device__ __forceinline__ float gelu_erf_grad(float z) {
    return 0.5f * (1.0f + erff(z * 0.70710678118654752f)) + z * 0.39894228040143268f * expf(-0.5f * z * z);
}
__device__ __forceinline__ const __nv_bfloat16* mudd_source_row(const MuddSource& s, int row, int C) {
    return s.rows + static_cast<size_t>(s.ids ? s.ids[row] : row) * C;
}
// dst[j] = v[j] for j < n, lane j % 32 writing (a register array read at constant indices only: no local memory).
template <int N>
__device__ __forceinline__ void mudd_store_row(float* dst, const float (&v)[N], int n, int lane) {
#pragma unroll
    for (int j = 0; j < N; ++j)
        if (j < n && lane == j % 32) dst[j] = v[j];
}

// The lane's two hidden pre-activations z and values u = bf16(gelu(z)) (columns 2 lane, 2 lane + 1).
__device__ __forceinline__ void mudd_row_hidden(float (&u)[2], float (&z)[2], const __nv_bfloat16* z_row, int lane) {
    const __nv_bfloat162 zz = reinterpret_cast<const __nv_bfloat162*>(z_row)[lane];
    z[0] = __low2float(zz), z[1] = __high2float(zz);
    u[0] = bf16_round(gelu_erf(z[0])), u[1] = bf16_round(gelu_erf(z[1]));
}
// Coefficient j before its scale, in every lane: bf16(u . w2[j]) + b2[j] in fp32 (the matmul's bf16 output plus
// the bias, which inductor fuses with the scale multiply: unrounded).
__device__ __forceinline__ float mudd_head_pre(const float (&u)[2], const MuddHead& head, int j, int lane) {
    const __nv_bfloat162 w = reinterpret_cast<const __nv_bfloat162*>(head.w2 + j * kMuddHidden)[lane];
    return bf16_round(warp_reduce_sum(u[0] * __low2float(w) + u[1] * __high2float(w))) + __bfloat162float(head.b2[j]);
}
// The row's coefficients bf16(pre_j * scale), every lane holding all of them (zeros past n).
template <int N>
__device__ __forceinline__ void mudd_row_coefficients(float (&c)[N], const __nv_bfloat16* z_row, const MuddHead& head,
                                                      float scale, int lane) {
    float u[2], z[2];
    mudd_row_hidden(u, z, z_row, lane);
#pragma unroll
    for (int j = 0; j < N; ++j) c[j] = j < head.n ? bf16_round(mudd_head_pre(u, head, j, lane) * scale) : 0.0f;
}

// Row `row`'s coefficients from its z, every lane holding them, and kept in coeffs for the backward.
__device__ __forceinline__ void mudd_row_coefficients_kept(float (&c)[kMuddCoefStride], float* coeffs,
                                                           const __nv_bfloat16* z, const MuddHead& head, int row,
                                                           int lane) {
    mudd_row_coefficients(c, z + static_cast<size_t>(row) * kMuddHidden, head, kMuddScale, lane);
    mudd_store_row(coeffs + static_cast<size_t>(row) * kMuddCoefStride, c, kMuddCoefStride, lane);
}
// A head's per-thread shares of its parameter gradients over the rows a warp takes: dw2 (the lane's two hidden
// columns of each coefficient), db2 (coefficient j in lane j % 32) and, for the gate, dscale (lane 0).
template <int N>
struct MuddHeadAcc {
    float w[N][2] = {};
    float b[(N + 31) / 32] = {};
    float scale = 0.0f;
};
// How a head's coefficient gradients dc reach its MLP. MUDD (scale 0.1, a Python constant): dpre = bf16(0.1 dc)
// feeds du, dw2 and db2. The gate (scale s = bf16(_mudd_gate_scale)): dP = bf16(s dG) feeds du and dw2 (matmul
// inputs), while db2 sums s dG and dscale sums dG P unrounded (inductor fuses both reductions with the multiply;
// P = pre, recomputed from z in fp32 as its backward kernel recomputes it from the saved matmul output).
enum class MuddHeadKind { mudd, gate };
// From the row's coefficient gradients (dc(j): bf16 values, j < head.n) and its z: the lane's two dz (written) and
// its shares of the head's gradients (added to acc).
template <MuddHeadKind kKind, int N, typename Dc>
__device__ __forceinline__ void mudd_row_head_backward(__nv_bfloat16* dz_row, MuddHeadAcc<N>& acc, Dc dc,
                                                       const __nv_bfloat16* z_row, const MuddHead& head, float scale,
                                                       int lane) {
    float u[2], z[2];
    mudd_row_hidden(u, z, z_row, lane);
    float du[2] = {0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < N; ++j) {
        if (j >= head.n) continue;
        const float dcj = dc(j), scaled = scale * dcj, dpre = bf16_round(scaled);
        const __nv_bfloat162 w = reinterpret_cast<const __nv_bfloat162*>(head.w2 + j * kMuddHidden)[lane];
        du[0] += dpre * __low2float(w);
        du[1] += dpre * __high2float(w);
        acc.w[j][0] += dpre * u[0];
        acc.w[j][1] += dpre * u[1];
        if (lane == j % 32) acc.b[j / 32] += kKind == MuddHeadKind::gate ? scaled : dpre;
        if constexpr (kKind == MuddHeadKind::gate) acc.scale += dcj * mudd_head_pre(u, head, j, lane);
    }
    reinterpret_cast<__nv_bfloat162*>(dz_row)[lane] =
        __floats2bfloat162_rn(bf16_round(du[0]) * gelu_erf_grad(z[0]), bf16_round(du[1]) * gelu_erf_grad(z[1]));
}

// The gate's scale gradient (fp32 gradient of an fp32 parameter), and whether it adds to it (both gates add to the
// one scale: the second backward to run adds).
struct MuddGateScaleGrad {
    float* d;
    int64_t accumulate;  // a bool, as wide as a word: no padding (see SumTargets::Run)
};
// The block's dw2, db2 (and dscale) partials, its warps' shares summed in warp order, to scratch (P values a
// block); the last block sums every block's in block order, each thread its values side by side, into the gradients. dscale (the
// gate's, d set) receives its sum rounded to bf16: the gradient of the bf16 copy the forward multiplies by.
template <int N, int P>
__device__ __forceinline__ void mudd_head_partials(const MuddHeadAcc<N>& acc, const MuddHead& head,
                                                   const MuddHeadGrads& grads, MuddGateScaleGrad dscale,
                                                   BlockPartials scratch) {
    __shared__ float block_vals[P];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n = head.n;
    const int values = n * (kMuddHidden + 1) + (dscale.d ? 1 : 0);
    for (int v = threadIdx.x; v < values; v += blockDim.x) block_vals[v] = 0.0f;
    for (int w = 0; w < kNormRowsPerBlock; ++w) {
        __syncthreads();
        if (warp != w) continue;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            if (j >= n) continue;
            block_vals[j * kMuddHidden + 2 * lane] += acc.w[j][0];
            block_vals[j * kMuddHidden + 2 * lane + 1] += acc.w[j][1];
            if (lane == j % 32) block_vals[n * kMuddHidden + j] += acc.b[j / 32];
        }
        if (dscale.d && lane == 0) block_vals[n * (kMuddHidden + 1)] += acc.scale;
    }
    __syncthreads();
    float* mine = scratch.partials + static_cast<size_t>(blockIdx.x) * P;
    for (int v = threadIdx.x; v < values; v += blockDim.x) mine[v] = block_vals[v];
    if (!last_block_done(scratch.done)) return;
    // Each value's sum in block order, the thread's K values side by side: one pass over the blocks whose loads
    // issue together (K a block, 8 blocks an iteration: the gate's 11 values put 38 loads ahead of the first add in
    // sm_90a SASS, at 123 registers of its 128), where the values one at a time had 16 ahead (the compiler's unroll).
    constexpr int K = ceil_div(P, kNormThreads);  // the kernels run kNormThreads threads a block
    float s[K] = {};
    const int blocks = static_cast<int>(gridDim.x);
#pragma unroll 8
    for (int b = 0; b < blocks; ++b) {
        const float* block_partials = scratch.partials + static_cast<size_t>(b) * P;
#pragma unroll
        for (int k = 0; k < K; ++k)
            if (const int v = threadIdx.x + k * kNormThreads; v < values) s[k] += __ldcg(block_partials + v);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
        const int v = threadIdx.x + k * kNormThreads;
        if (v >= values) break;
        if (v == n * (kMuddHidden + 1)) {
            *dscale.d = (dscale.accumulate ? *dscale.d : 0.0f) + bf16_round(s[k]);
            continue;
        }
        __nv_bfloat16* g = v < n * kMuddHidden ? grads.dw2 + v : grads.db2 + (v - n * kMuddHidden);
        *g = __float2bfloat16(grads.accumulate ? __bfloat162float(*g) + s[k] : s[k]);
    }
}

// ---- shapes ----
inline std::string mudd_shape_error(int T, int C, int H) {
    if (const char* e = norm_rows_shape_error(T, C)) return e;
    if (H < 2 || H > kMuddMaxHeads || H % 2 != 0 || C % H != 0 || (C / H) % kNormPackWidth != 0)
        return "MUDD needs an even head count of at most " + std::to_string(kMuddMaxHeads) +
               " whose heads are whole 16-byte packs (C " + std::to_string(C) + ", H " + std::to_string(H) + ")";
    return "";
}
inline int mudd_backward_blocks(int T) { return std::min(norm_row_blocks(T), kMuddMaxBackwardBlocks); }
// Scratch bytes of a MUDD backward launcher for T rows (its BlockPartials' partials).
inline size_t mudd_backward_scratch_bytes(int T) {
    return sizeof(float) * kMuddPartials * static_cast<size_t>(mudd_backward_blocks(T));
}
// Bytes a launch moves for: a source's rows (and its ids), the head (w2 rows and b2), a head's reduction (the
// partials written and read back by the last block, the gradients read where added to and written, the ticket).
inline double mudd_source_bytes(int T, int C, const MuddSource& s) { return 2.0 * T * C + (s.ids ? 4.0 * T : 0.0); }
inline double mudd_head_bytes(int n) { return 2.0 * n * (kMuddHidden + 1); }
inline Work mudd_head_reduction(Work w, int T, int n, bool accumulate) {
    const double partials = 4.0 * mudd_backward_blocks(T) * n * (kMuddHidden + 1);
    w.flops += static_cast<double>(mudd_backward_blocks(T)) * n * (kMuddHidden + 1);
    w.bytes_read += partials + (accumulate ? mudd_head_bytes(n) : 0.0) + sizeof(unsigned int);
    w.bytes_written += partials + mudd_head_bytes(n) + sizeof(unsigned int);
    return w;
}
inline void require_mudd_head(const char* who, const MuddHead& head, int n) {
    kernel_require(head.w2 && head.b2 && head.n == n, "%s: the MUDD head needs w2 and b2 rows, %d coefficients (got %d)",
                   who, n, head.n);
}

// ---- the last layer's entry ----
// coeffs = the 14 coefficients; aux_v = bf16(g_h ve + c0 h0 + c1 h7 + c2 h9); r = bf16((1 + c5) h9 + c3 h0 + c4 h7).
__global__ void __launch_bounds__(kNormThreads, 4)
    mudd_entry_forward_kernel(float* coeffs, __nv_bfloat16* aux_v, __nv_bfloat16* r, const __nv_bfloat16* z,
                              MuddHead head, const __nv_bfloat16* h0, const __nv_bfloat16* h7,
                              const __nv_bfloat16* h9, MuddSource ve, int T, int C, int H) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    float c[kMuddCoefStride];
    mudd_row_coefficients_kept(c, coeffs, z, head, row, lane);
    const size_t off = static_cast<size_t>(row) * C;
    const __nv_bfloat16* ve_row = mudd_source_row(ve, row, C);
    const int half = (C / H) * (H / 2);  // the first half of the heads' columns take c6
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> a = load128(h0 + off + col), b = load128(h7 + off + col),
                                     x = load128(h9 + off + col), e = load128(ve_row + col);
        const float g = col < half ? c[6] : c[7];
        Pack128<__nv_bfloat16> av, rv;
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) {
            const float fa = __bfloat162float(a[k]), fb = __bfloat162float(b[k]), fx = __bfloat162float(x[k]);
            av[k] = __float2bfloat16(g * __bfloat162float(e[k]) + c[0] * fa + c[1] * fb + c[2] * fx);
            rv[k] = __float2bfloat16((1.0f + c[5]) * fx + c[3] * fa + c[4] * fb);
        }
        store128(aux_v + off + col, av);
        store128(r + off + col, rv);
    }
}
// Reads z, the head, h0, h7, h9 and the value rows; writes the coefficients, aux_v and r.
inline Work mudd_entry_forward_work(int T, int C, const MuddSource& ve) {
    return Work{.name = "mudd_entry_forward",
                .flops = double(T) * (3.0 * kMuddEntryCoef * kMuddHidden + 20.0 * kMuddHidden + 12.0 * C),
                .bytes_read = 2.0 * T * kMuddHidden + mudd_head_bytes(kMuddEntryCoef) + norm_rows_bytes(T, C, 3) +
                              mudd_source_bytes(T, C, ve),
                .bytes_written = 4.0 * T * kMuddCoefStride + norm_rows_bytes(T, C, 2)};
}
// z: h9 @ w1[0]^T (T, 64); ve: the layer's value table at the tokens (MuddSource{table, ids}).
inline void mudd_entry_forward(float* coeffs, __nv_bfloat16* aux_v, __nv_bfloat16* r, const __nv_bfloat16* z,
                               MuddHead head, const __nv_bfloat16* h0, const __nv_bfloat16* h7, const __nv_bfloat16* h9,
                               MuddSource ve, int T, int C, int H, cudaStream_t stream) {
    require_shape(mudd_shape_error(T, C, H), "mudd_entry_forward");
    require_norm_rows("mudd_entry_forward", T, C, {aux_v, r, h0, h7, h9, ve.rows});
    require_mudd_head("mudd_entry_forward", head, kMuddEntryCoef);
    kernel_require(coeffs && z && ve.ids, "mudd_entry_forward: the coefficients, z and the value rows' ids are required");
    launch(mudd_entry_forward_work(T, C, ve), mudd_entry_forward_kernel, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0,
           stream, coeffs, aux_v, r, z, head, h0, h7, h9, ve, T, C, H);
    CUDA_CHECK_LAUNCH();
}

// The entry's gradients. daux: of aux_v (v's gradient); dr: of r; dcoeffs: the row's coefficient gradients at
// 8..13 (from the layer's update kernels; read, and 0..7 written). The sources' gradients: dh0, dh7 added to
// or written (MuddSourceGrad), dh9 = c2 daux + (1 + c5) dr (or added), dve = g_h daux (written).
struct MuddEntryGrads {
    MuddSourceGrad dh0, dh7, dh9;
    __nv_bfloat16* dve;
};
__global__ void __launch_bounds__(kNormThreads, 2)
    mudd_entry_backward_kernel(__nv_bfloat16* dz, float* dcoeffs, MuddEntryGrads d, MuddHeadGrads dhead,
                               BlockPartials scratch, const __nv_bfloat16* daux, int64_t daux_ld,
                               const __nv_bfloat16* dr, const float* coeffs, const __nv_bfloat16* z, MuddHead head,
                               const __nv_bfloat16* h0, const __nv_bfloat16* h7, const __nv_bfloat16* h9, MuddSource ve,
                               int T, int C, int H) {
    const int lane = threadIdx.x % 32;
    MuddHeadAcc<kMuddMaxCoef> acc;
    const int D = C / H, half = D * (H / 2);
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float* c = coeffs + static_cast<size_t>(row) * kMuddCoefStride;
        const __nv_bfloat16* ve_row = mudd_source_row(ve, row, C);
        // the coefficients' sums: daux . (h0, h7, h9), dr . (h0, h7, h9), and daux . ve per head
        float s[6] = {}, heads[kMuddMaxHeads] = {};
#pragma unroll
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) continue;
            const Pack128<__nv_bfloat16> ga = load128(daux + row * daux_ld + col), gr = load128(dr + off + col),
                                         a = load128(h0 + off + col), b = load128(h7 + off + col),
                                         x = load128(h9 + off + col), e = load128(ve_row + col);
            float he = 0.0f;
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) {
                const float fga = __bfloat162float(ga[k]), fgr = __bfloat162float(gr[k]);
                const float fa = __bfloat162float(a[k]), fb = __bfloat162float(b[k]), fx = __bfloat162float(x[k]);
                s[0] += fga * fa, s[1] += fga * fb, s[2] += fga * fx;
                s[3] += fgr * fa, s[4] += fgr * fb, s[5] += fgr * fx;
                he += fga * __bfloat162float(e[k]);
            }
            const int h = col / D;  // a pack lies in one head (D is a multiple of the pack)
#pragma unroll
            for (int q = 0; q < kMuddMaxHeads; ++q)
                if (q == h) heads[q] += he;
        }
        float dc[kMuddCoefStride] = {};
#pragma unroll
        for (int j = 0; j < 6; ++j) dc[j] = bf16_round(warp_reduce_sum(s[j]));
        float g0 = 0.0f, g1 = 0.0f;  // upstream: the gate's per-head gradients (bf16), summed over each half
#pragma unroll
        for (int q = 0; q < kMuddMaxHeads; ++q) {
            if (q >= H) continue;
            const float hq = bf16_round(warp_reduce_sum(heads[q]));
            if (q < H / 2) g0 += hq;
            else g1 += hq;
        }
        dc[6] = bf16_round(g0), dc[7] = bf16_round(g1);
#pragma unroll
        for (int j = 8; j < kMuddEntryCoef; ++j) dc[j] = dcoeffs[static_cast<size_t>(row) * kMuddCoefStride + j];
        mudd_store_row(dcoeffs + static_cast<size_t>(row) * kMuddCoefStride, dc, 8, lane);
        // the sources' gradients
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) continue;
            const size_t at = off + col;
            const Pack128<__nv_bfloat16> ga = load128(daux + row * daux_ld + col), gr = load128(dr + at);
            Pack128<__nv_bfloat16> v0 = d.dh0.accumulate ? load128(d.dh0.d + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> v7 = d.dh7.accumulate ? load128(d.dh7.d + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> v9 = d.dh9.accumulate ? load128(d.dh9.d + at) : Pack128<__nv_bfloat16>{};
            Pack128<__nv_bfloat16> ve_g;
            const float g = col < half ? c[6] : c[7];
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) {
                const float fga = __bfloat162float(ga[k]), fgr = __bfloat162float(gr[k]);
                v0[k] = __float2bfloat16(__bfloat162float(v0[k]) + c[0] * fga + c[3] * fgr);
                v7[k] = __float2bfloat16(__bfloat162float(v7[k]) + c[1] * fga + c[4] * fgr);
                v9[k] = __float2bfloat16(__bfloat162float(v9[k]) + c[2] * fga + (1.0f + c[5]) * fgr);
                ve_g[k] = __float2bfloat16(g * fga);
            }
            store128(d.dh0.d + at, v0);
            store128(d.dh7.d + at, v7);
            store128(d.dh9.d + at, v9);
            store128(d.dve + at, ve_g);
        }
        const size_t zrow = static_cast<size_t>(row) * kMuddHidden;
        mudd_row_head_backward<MuddHeadKind::mudd>(dz + zrow, acc, [&](int j) { return dc[j]; }, z + zrow, head,
                                                   kMuddScale, lane);
    }
    mudd_head_partials<kMuddMaxCoef, kMuddPartials>(acc, head, dhead, {}, scratch);
}
// Reads daux, dr, h0, h7, h9, the value rows, the coefficients 0..7 and gradients 8..13, z and the head, and the
// gradients it adds to (each once: the second reads of a row come from L1); writes the sources' gradients, dve, dz,
// the coefficient gradients 0..7, and the head's reduction.
inline Work mudd_entry_backward_work(int T, int C, const MuddEntryGrads& d, const MuddHeadGrads& dhead,
                                     const MuddSource& ve) {
    const int added = int(d.dh0.accumulate) + int(d.dh7.accumulate) + int(d.dh9.accumulate);
    const Work w{.name = "mudd_entry_backward",
                 .flops = double(T) * (16.0 * C + 4.0 * kMuddEntryCoef * kMuddHidden + 30.0 * kMuddHidden),
                 .bytes_read = norm_rows_bytes(T, C, 5 + added) + mudd_source_bytes(T, C, ve) + 4.0 * T * 8 +
                               4.0 * T * (kMuddEntryCoef - 8) + 2.0 * T * kMuddHidden + mudd_head_bytes(kMuddEntryCoef),
                 .bytes_written = norm_rows_bytes(T, C, 4) + 2.0 * T * kMuddHidden + 4.0 * T * 8};
    return mudd_head_reduction(w, T, kMuddEntryCoef, dhead.accumulate);
}
// dz: (T, 64), for dw1[0] = dz^T h9 and dh9 += dz w1[0] (matmuls after this); scratch: mudd_backward_scratch_bytes.
// daux's rows are daux_ld apart (C; the trainer passes v's columns of d(qkv), 3C).
inline void mudd_entry_backward(__nv_bfloat16* dz, float* dcoeffs, MuddEntryGrads d, MuddHeadGrads dhead,
                                BlockPartials scratch, const __nv_bfloat16* daux, int64_t daux_ld, const __nv_bfloat16* dr,
                                const float* coeffs, const __nv_bfloat16* z, MuddHead head, const __nv_bfloat16* h0,
                                const __nv_bfloat16* h7, const __nv_bfloat16* h9, MuddSource ve, int T, int C, int H,
                                cudaStream_t stream) {
    require_shape(mudd_shape_error(T, C, H), "mudd_entry_backward");
    require_norm_rows("mudd_entry_backward", T, C, {d.dh0.d, d.dh7.d, d.dh9.d, d.dve, daux, dr, h0, h7, h9, ve.rows});
    require_mudd_head("mudd_entry_backward", head, kMuddEntryCoef);
    kernel_require(daux_ld >= C && daux_ld % kNormPackWidth == 0,
                   "mudd_entry_backward: daux's row stride %lld must be at least C and whole 16-byte packs",
                   static_cast<long long>(daux_ld));
    kernel_require(dz && dcoeffs && dhead.dw2 && dhead.db2 && scratch.partials && scratch.done && coeffs && z && ve.ids,
                   "mudd_entry_backward: dz, the coefficients and their gradients, the head's gradients, the scratch, z "
                   "and the value rows' ids are required");
    const int blocks = mudd_backward_blocks(T);
    launch(mudd_entry_backward_work(T, C, d, dhead, ve), mudd_entry_backward_kernel, dim3(blocks), dim3(kNormThreads), 0,
           stream, dz, dcoeffs, d, dhead, scratch, daux, daux_ld, dr, coeffs, z, head, h0, h7, h9, ve, T, C, H);
    CUDA_CHECK_LAUNCH();
}

// ---- the exit, after the last layer ----
// The exit's five sources in upstream's order: h0, h7, h9, ve0 (value table 0 at the tokens), h3.
struct MuddExitSources {
    MuddSource src[kMuddExitSources];
};
// coeffs = the 5 coefficients; xf = bf16(x + sum_j c_j source_j); hf = norm(xf).
__global__ void __launch_bounds__(kNormThreads, 4)
    mudd_exit_forward_kernel(float* coeffs, __nv_bfloat16* xf, __nv_bfloat16* hf, float* rstd_f,
                             const __nv_bfloat16* z, MuddHead head, const __nv_bfloat16* x, MuddExitSources sources,
                             int T, int C) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    float c[kMuddCoefStride];
    mudd_row_coefficients_kept(c, coeffs, z, head, row, lane);
    const size_t off = static_cast<size_t>(row) * C;
    NormRow out = {};
#pragma unroll
    for (int i = 0; i < kNormPacksPerLane; ++i) {
        const int col = norm_row_col(i, lane);
        if (col >= C) continue;
        const Pack128<__nv_bfloat16> xv = load128(x + off + col);
        float v[kNormPackWidth];
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) v[k] = __bfloat162float(xv[k]);
#pragma unroll
        for (int j = 0; j < kMuddExitSources; ++j) {
            const Pack128<__nv_bfloat16> sv = load128(mudd_source_row(sources.src[j], row, C) + col);
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k) v[k] += c[j] * __bfloat162float(sv[k]);
        }
#pragma unroll
        for (int k = 0; k < kNormPackWidth; ++k) out.pack[i][k] = __float2bfloat16(v[k]);
        store128(xf + off + col, out.pack[i]);
    }
    norm_row_store_normalized(hf + off, rstd_f + row, out, norm_row_rstd(out, C), C, lane);
}
inline double mudd_exit_sources_bytes(int T, int C, const MuddExitSources& sources) {
    double b = 0;
    for (const MuddSource& src : sources.src) b += mudd_source_bytes(T, C, src);
    return b;
}
// Reads z, the head, x and the five sources; writes the coefficients, xf, hf and rstd.
inline Work mudd_exit_forward_work(int T, int C, const MuddExitSources& sources) {
    return Work{.name = "mudd_exit_forward",
                .flops = double(T) * (3.0 * kMuddExitCoef * kMuddHidden + 20.0 * kMuddHidden + 14.0 * C),
                .bytes_read = 2.0 * T * kMuddHidden + mudd_head_bytes(kMuddExitCoef) + norm_rows_bytes(T, C) +
                              mudd_exit_sources_bytes(T, C, sources),
                .bytes_written = 4.0 * T * kMuddCoefStride + norm_rows_bytes(T, C, 2) + norm_rstd_bytes(T)};
}
inline void require_exit_sources(const char* who, const MuddExitSources& s) {
    for (const MuddSource& src : s.src) kernel_require(src.rows, "%s: every one of the exit's five sources is required", who);
}
// z: x @ w1[1]^T (T, 64).
inline void mudd_exit_forward(float* coeffs, __nv_bfloat16* xf, __nv_bfloat16* hf, float* rstd_f,
                              const __nv_bfloat16* z, MuddHead head, const __nv_bfloat16* x, MuddExitSources sources,
                              int T, int C, cudaStream_t stream) {
    require_norm_rows("mudd_exit_forward", T, C, {xf, hf, x});
    require_exit_sources("mudd_exit_forward", sources);
    require_mudd_head("mudd_exit_forward", head, kMuddExitCoef);
    kernel_require(coeffs && z && rstd_f, "mudd_exit_forward: the coefficients, z and rstd are required");
    launch(mudd_exit_forward_work(T, C, sources), mudd_exit_forward_kernel, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0,
           stream, coeffs, xf, hf, rstd_f, z, head, x, sources, T, C);
    CUDA_CHECK_LAUNCH();
}

// The exit's gradients: dx (x's, written: the identity term), and each source's (MuddSourceGrad; ve0's is a
// (T, C) tensor for the table's backward).
struct MuddExitGrads {
    __nv_bfloat16* dx;
    MuddSourceGrad src[kMuddExitSources];
};
// g = bf16(norm backward of dhf); dx = g; d source_j (+)= c_j g; dc_j = bf16(sum g . source_j) (written to
// dcoeffs' first five of each row); the head's backward.
__global__ void __launch_bounds__(kNormThreads, 2)
    mudd_exit_backward_kernel(__nv_bfloat16* dz, float* dcoeffs, MuddExitGrads d, MuddHeadGrads dhead,
                              BlockPartials scratch,
                              const __nv_bfloat16* dhf, const __nv_bfloat16* xf, const float* rstd_f,
                              const float* coeffs, const __nv_bfloat16* z, MuddHead head, MuddExitSources sources,
                              int T, int C) {
    const int lane = threadIdx.x % 32;
    MuddHeadAcc<kMuddMaxCoef> acc;
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const size_t off = static_cast<size_t>(row) * C;
        const float* c = coeffs + static_cast<size_t>(row) * kMuddCoefStride;
        const float rstd = rstd_f[row], q = norm_row_grad_coeff(dhf + off, xf + off, rstd, C, lane);
        float s[kMuddExitSources] = {};
#pragma unroll 1
        for (int i = 0; i < kNormPacksPerLane; ++i) {
            const int col = norm_row_col(i, lane);
            if (col >= C) continue;
            const Pack128<__nv_bfloat16> dv = load128(dhf + off + col), xv = load128(xf + off + col);
            Pack128<__nv_bfloat16> gv;
#pragma unroll
            for (int k = 0; k < kNormPackWidth; ++k)
                gv[k] = __float2bfloat16(rstd * __bfloat162float(dv[k]) - q * __bfloat162float(xv[k]));
            store128(d.dx + off + col, gv);
#pragma unroll
            for (int j = 0; j < kMuddExitSources; ++j) {
                const Pack128<__nv_bfloat16> sv = load128(mudd_source_row(sources.src[j], row, C) + col);
                __nv_bfloat16* gp = d.src[j].d + off + col;
                Pack128<__nv_bfloat16> out = d.src[j].accumulate ? load128(gp) : Pack128<__nv_bfloat16>{};
#pragma unroll
                for (int k = 0; k < kNormPackWidth; ++k) {
                    const float g = __bfloat162float(gv[k]);
                    s[j] += g * __bfloat162float(sv[k]);
                    out[k] = __float2bfloat16(__bfloat162float(out[k]) + c[j] * g);
                }
                store128(gp, out);
            }
        }
        float dc[kMuddCoefStride] = {};
#pragma unroll
        for (int j = 0; j < kMuddExitSources; ++j) dc[j] = bf16_round(warp_reduce_sum(s[j]));
        mudd_store_row(dcoeffs + static_cast<size_t>(row) * kMuddCoefStride, dc, kMuddExitCoef, lane);
        const size_t zrow = static_cast<size_t>(row) * kMuddHidden;
        mudd_row_head_backward<MuddHeadKind::mudd>(dz + zrow, acc, [&](int j) { return dc[j]; }, z + zrow, head,
                                                   kMuddScale, lane);
    }
    mudd_head_partials<kMuddMaxCoef, kMuddPartials>(acc, head, dhead, {}, scratch);
}
// Reads dhf, xf, rstd, the coefficients 0..4, the sources, z and the head, and the gradients it adds to (each
// once); writes dx, the sources' gradients, the coefficient gradients 0..4, dz and the head's reduction.
inline Work mudd_exit_backward_work(int T, int C, const MuddExitGrads& d, const MuddHeadGrads& dhead,
                                    const MuddExitSources& sources) {
    int added = 0;
    for (const MuddSourceGrad& g : d.src) added += g.accumulate;
    const Work w{.name = "mudd_exit_backward",
                 .flops = double(T) * (20.0 * C + 4.0 * kMuddExitCoef * kMuddHidden + 30.0 * kMuddHidden),
                 .bytes_read = norm_rows_bytes(T, C, 2 + added) + norm_rstd_bytes(T) + 4.0 * T * kMuddExitCoef +
                               mudd_exit_sources_bytes(T, C, sources) + 2.0 * T * kMuddHidden +
                               mudd_head_bytes(kMuddExitCoef),
                 .bytes_written = norm_rows_bytes(T, C, 1 + kMuddExitSources) + 4.0 * T * kMuddExitCoef +
                                  2.0 * T * kMuddHidden};
    return mudd_head_reduction(w, T, kMuddExitCoef, dhead.accumulate);
}
// dz: (T, 64), for dw1[1] = dz^T x and dx += dz w1[1] (matmuls after this); scratch: mudd_backward_scratch_bytes.
inline void mudd_exit_backward(__nv_bfloat16* dz, float* dcoeffs, MuddExitGrads d, MuddHeadGrads dhead,
                               BlockPartials scratch,
                               const __nv_bfloat16* dhf, const __nv_bfloat16* xf, const float* rstd_f,
                               const float* coeffs, const __nv_bfloat16* z, MuddHead head, MuddExitSources sources,
                               int T, int C, cudaStream_t stream) {
    require_norm_rows("mudd_exit_backward", T, C, {d.dx, dhf, xf});
    require_exit_sources("mudd_exit_backward", sources);
    for (const MuddSourceGrad& g : d.src)
        kernel_require(g.d && reinterpret_cast<uintptr_t>(g.d) % 16 == 0,
                       "mudd_exit_backward: every source's gradient is required, 16-byte aligned");
    require_mudd_head("mudd_exit_backward", head, kMuddExitCoef);
    kernel_require(dz && dcoeffs && dhead.dw2 && dhead.db2 && scratch.partials && scratch.done && rstd_f && coeffs && z,
                   "mudd_exit_backward: dz, the coefficients and their gradients, the head's gradients, the scratch and "
                   "rstd and z are required");
    const int blocks = mudd_backward_blocks(T);
    launch(mudd_exit_backward_work(T, C, d, dhead, sources), mudd_exit_backward_kernel, dim3(blocks), dim3(kNormThreads), 0,
           stream, dz, dcoeffs, d, dhead, scratch, dhf, xf, rstd_f, coeffs, z, head, sources, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- record 85's MUDD gate (upstream 003ff3e2 = 75d6867a: init_mudd_gate, forward_mudd_gate) ----
// A second head of the same form whose coefficients the layers read per token in place of records 71-84's lambdas
// and gates: id 0 (pre, n = 26, h = x0) and id 1 (post, n = 41, h = layer 4's input), w2 rows [id, :n], b2 [id, :n]:
//   z = h @ Wg1[id]^T (T, 64, a matmul before these kernels);  u = bf16(gelu(z));
//   G = bf16((bf16(u . w2^T) + b2) * s),  s = bf16(_mudd_gate_scale)  (fp32 parameter, `type_as` the bf16 u)
// kept as fp32 copies of the bf16 values, kMuddGateCoefStride per token (zeros past n). Which layer reads which
// column: upstream 003ff3e2's unpack_pre_mudd_gate / unpack_post_mudd_gate; the readers write the gradients of the columns they read into a buffer of the
// same layout (every column < n is read by one of them).
// Backward: dP = bf16(s dG) into du = bf16(dP . w2), dz = bf16(du gelu'(z)) and dw2 = sum_t dP u; db2 = sum_t s dG;
// dscale = bf16(sum_{t, j < n} dG P) with P = bf16(u . w2^T) + b2 (fp32); fixed-order block partials summed by the
// last block (bitwise reproducible); dWg1 = dz^T h and dh += dz Wg1 are matmuls after these kernels.

// mudd_head_pre's value for coefficient j computed by one thread from the row's u (all 64 columns, bf16 values
// kept as bf16: exactly): lane l's two-term partial of the warp form (the same expression, so the same
// contraction), added as warp_reduce_sum's butterfly adds them (butterfly_in_lane): the warp form's bits. The
// first round (lanes l and l + 16) as the partials come: 16 running values, not 32 (the kernel has 64 registers).
__device__ __forceinline__ float mudd_head_pre_in_lane(const __nv_bfloat16* u, const MuddHead& head, int j) {
    const __nv_bfloat16* w2 = head.w2 + j * kMuddHidden;
    float p[16];
#pragma unroll
    for (int q = 0; q < 4; ++q) {  // 16-byte loads: the columns of lanes 4q .. 4q + 3 and of the 4 lanes 16 on
        const Pack128<__nv_bfloat16> lo = load128(w2 + 8 * q), hi = load128(w2 + 8 * (q + 4));
        const Pack128<__nv_bfloat16> ulo = load128(u + 8 * q), uhi = load128(u + 8 * (q + 4));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float pa = __bfloat162float(ulo[2 * k]) * __bfloat162float(lo[2 * k]) +
                             __bfloat162float(ulo[2 * k + 1]) * __bfloat162float(lo[2 * k + 1]);
            const float pb = __bfloat162float(uhi[2 * k]) * __bfloat162float(hi[2 * k]) +
                             __bfloat162float(uhi[2 * k + 1]) * __bfloat162float(hi[2 * k + 1]);
            p[4 * q + k] = pa + pb;
        }
    }
    butterfly_in_lane(p);  // the rounds with offsets 8, 4, 2, 1
    return bf16_round(p[0]) + __bfloat162float(head.b2[j]);
}
// coeffs[t, j] = G[t, j] for j < n, 0 for the rest of the row's kMuddGateCoefStride. A warp per row: each lane
// computes its coefficients (j = lane, lane + 32) whole from the row's u, shared through shared memory. In sm_90a
// SASS a pass of the lanes is 328 instructions, a row 2 passes for n = 41 (1 for 26), where the warp form spent
// 45 a coefficient (a warp-wide dot product, five shuffle rounds) and 17 a zero column: 1964 (1544).
__global__ void __launch_bounds__(kNormThreads, 4)
    mudd_gate_forward_kernel(float* coeffs, const __nv_bfloat16* z, MuddHead head, const float* scale, int T) {
    __shared__ __align__(16) __nv_bfloat16 u_rows[kNormRowsPerBlock][kMuddHidden];  // bf16 values: exact
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, row = blockIdx.x * kNormRowsPerBlock + warp;
    if (row >= T) return;  // the whole warp
    const float s = bf16_round(*scale);
    float u[2], zz[2];
    mudd_row_hidden(u, zz, z + static_cast<size_t>(row) * kMuddHidden, lane);
    reinterpret_cast<__nv_bfloat162*>(u_rows[warp])[lane] = __floats2bfloat162_rn(u[0], u[1]);
    __syncwarp();
    float* out = coeffs + static_cast<size_t>(row) * kMuddGateCoefStride;
#pragma unroll 1  // one coefficient's loads in flight at a time: 64 registers
    for (int j = lane; j < kMuddGateCoefStride; j += 32)
        out[j] = j < head.n ? bf16_round(mudd_head_pre_in_lane(u_rows[warp], head, j) * s) : 0.0f;
}
// Reads z, the head and the scale; writes the coefficients.
inline Work mudd_gate_forward_work(int T, int n) {
    return Work{.name = "mudd_gate_forward",
                .flops = double(T) * (3.0 * n * kMuddHidden + 20.0 * kMuddHidden),
                .bytes_read = 2.0 * T * kMuddHidden + mudd_head_bytes(n) + sizeof(float),
                .bytes_written = 4.0 * T * kMuddGateCoefStride};
}
inline void require_mudd_gate_head(const char* who, const MuddHead& head, const float* scale) {
    kernel_require(head.w2 && head.b2 && (head.n == kMuddGatePreCoef || head.n == kMuddGatePostCoef) && scale,
                   "%s: the MUDD gate needs w2 and b2 rows, %d (pre) or %d (post) coefficients (got %d), and the scale",
                   who, kMuddGatePreCoef, kMuddGatePostCoef, head.n);
}
// z: h @ Wg1[id]^T (T, 64); head: w2[id] and b2[id] with n = 26 (pre) or 41 (post); scale: _mudd_gate_scale (fp32).
inline void mudd_gate_forward(float* coeffs, const __nv_bfloat16* z, MuddHead head, const float* scale, int T,
                              cudaStream_t stream) {
    require_mudd_gate_head("mudd_gate_forward", head, scale);
    kernel_require(coeffs && z && T > 0, "mudd_gate_forward: the coefficients and z are required, T > 0 (T=%d)", T);
    kernel_require(is_aligned16(head.w2), "mudd_gate_forward: w2 must be 16-byte aligned (read 16 bytes at a time)");
    launch(mudd_gate_forward_work(T, head.n), mudd_gate_forward_kernel, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0,
           stream, coeffs, z, head, scale, T);
    CUDA_CHECK_LAUNCH();
}

// dz and the head's gradients from the coefficients' gradients dcoeffs (columns < n read).
__global__ void __launch_bounds__(kNormThreads, 2)
    mudd_gate_backward_kernel(__nv_bfloat16* dz, MuddHeadGrads dhead, MuddGateScaleGrad dscale, BlockPartials scratch,
                              const float* dcoeffs, const __nv_bfloat16* z, MuddHead head, const float* scale, int T) {
    const int lane = threadIdx.x % 32;
    const float s = bf16_round(*scale);
    MuddHeadAcc<kMuddGateMaxCoef> acc;
    for (int row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32; row < T; row += gridDim.x * kNormRowsPerBlock) {
        const float* dg = dcoeffs + static_cast<size_t>(row) * kMuddGateCoefStride;
        const size_t zrow = static_cast<size_t>(row) * kMuddHidden;
        mudd_row_head_backward<MuddHeadKind::gate>(dz + zrow, acc, [&](int j) { return dg[j]; }, z + zrow, head, s,
                                                   lane);
    }
    mudd_head_partials<kMuddGateMaxCoef, kMuddGatePartials>(acc, head, dhead, dscale, scratch);
}
inline int mudd_gate_backward_blocks(int T) { return mudd_backward_blocks(T); }
// Scratch bytes of mudd_gate_backward for T rows (its BlockPartials' partials).
inline size_t mudd_gate_backward_scratch_bytes(int T) {
    return sizeof(float) * kMuddGatePartials * static_cast<size_t>(mudd_gate_backward_blocks(T));
}
// Reads the n coefficient gradients of each row, z, the head and the scale; writes dz and the head's reduction
// (dw2, db2 and dscale: one more value); recomputes P (the forward's dot) for dscale.
inline Work mudd_gate_backward_work(int T, int n, const MuddHeadGrads& dhead, const MuddGateScaleGrad& dscale) {
    Work w{.name = "mudd_gate_backward",
           .flops = double(T) * (7.0 * n * kMuddHidden + 30.0 * kMuddHidden),
           .bytes_read = 4.0 * T * n + 2.0 * T * kMuddHidden + mudd_head_bytes(n) + sizeof(float),
           .bytes_written = 2.0 * T * kMuddHidden};
    w = mudd_head_reduction(w, T, n, dhead.accumulate);
    const double partials = 4.0 * mudd_gate_backward_blocks(T);  // dscale's
    w.flops += mudd_gate_backward_blocks(T);
    w.bytes_read += partials + (dscale.accumulate ? sizeof(float) : 0);
    w.bytes_written += partials + sizeof(float);
    return w;
}
// dz: (T, 64), for dWg1[id] = dz^T h and dh += dz Wg1[id] (matmuls after this); dhead: w2[id]'s rows [0, n) and
// b2[id]'s (the rest of the row, never read, keeps a zero gradient: the caller's); dscale: _mudd_gate_scale's;
// scratch: mudd_gate_backward_scratch_bytes(T). dcoeffs: (T, kMuddGateCoefStride), each column < n holding the
// gradient its reader wrote (columns from n on are not read).
inline void mudd_gate_backward(__nv_bfloat16* dz, MuddHeadGrads dhead, MuddGateScaleGrad dscale, BlockPartials scratch,
                               const float* dcoeffs, const __nv_bfloat16* z, MuddHead head, const float* scale, int T,
                               cudaStream_t stream) {
    require_mudd_gate_head("mudd_gate_backward", head, scale);
    kernel_require(dz && dcoeffs && z && dhead.dw2 && dhead.db2 && dscale.d && scratch.partials && scratch.done && T > 0,
                   "mudd_gate_backward: dz, the coefficients' gradients, z, the head's and the scale's gradients and the "
                   "scratch are required, T > 0 (T=%d)", T);
    const int blocks = mudd_gate_backward_blocks(T);
    launch(mudd_gate_backward_work(T, head.n, dhead, dscale), mudd_gate_backward_kernel, dim3(blocks),
           dim3(kNormThreads), 0, stream, dz, dhead, dscale, scratch, dcoeffs, z, head, scale, T);
    CUDA_CHECK_LAUNCH();
}
