// Record 85's DC-MHA on layer 10 (dynamic cross-head composition; upstream 75d6867a train_gpt.py dc_gate L1072-1080
// and its call L1142-1149, d0f2bc46 dc_triton_kernels.py: forward _dc_postonly_corr_fwd_wsmall_cached_kernel
// L253-440, backward _dc_postonly_corr_bwd_pre_wsmall_kernel L595-779 and _dc_postonly_corr_bwd_qk_wsmall_kernel
// L782-896, wrappers L934-1315). After the layer's attention, each token t mixes its heads' local attention maps:
//   keys s of t's own document with 0 <= t - s < W = 112 (not the layer's attention window; index j = t - s);
//   P_h[t, s] = softmax over those keys of scale q_h[t] . k_h[s] (renormalised over them alone);
//   w1[t, h] = bf16(G[t, 29 + h] / sqrt(mean_h' G[t, 29 + h']^2 + 1e-6)),  w2[t, h] = G[t, 35 + h];
//   A[t, s] = sum_h w1[t, h] P_h[t, s];  out[t, h, :] = y[t, h, :] + w2[t, h] sum_s A[t, s] v_h[s, :].
// G is the MUDD gate's coefficients (kernels/mudd.cuh: fp32 copies of bf16 values, `coef_stride` per token).
// Backward (go = d out; y's gradient is go itself, the caller's): dm_h = go_h[t] . v_h[s];
//   dA = sum_h w2 dm_h;  dw2 = sum_s dm_h A;  dv_h[s] += sum_t bf16(w2 A) go_h[t];  dw1 = sum_s dA P_h;
//   dS_h = P_h (w1 dA - sum_s' w1 dA P_h);  dq_h[t] += scale sum_s dS_h k_h[s];  dk_h[s] += scale sum_t dS_h q_h[t];
//   dG[t, 29 + h] = (dw1 - y1 mean_h'(dw1 y1)) / r  (torch's rms_norm backward; y1 the unrounded w1, r the rms),
//   dG[t, 35 + h] = dw2.
// Layouts: q, k, v, y, out, go, dq, dk, dv (T, 6, 128) bf16 as kernels/attention.cuh; lse (T, 6) fp32 (natural
// log of each local softmax's denominator); cu_seqlens as attention.cuh's (0, end of doc 0, ..., padded with T).
// Warp h owns head h. Forward: one block per 16 queries, QK^T and PV on the tensor cores (mma.sync m16n8k16 over
// the tile's 128 keys). Backward: one block per query (then one per key), each half-warp one key (query) of a pair,
// each lane 8 of the 128 dims (16-byte loads), products on the CUDA cores.
// Upstream's rounding points, kept here: scores and products accumulate in fp32 from bf16 operands (tl.dot); w1 and
// the value weight w2 A are rounded to bf16 before use, as is dS before its two products; dw1, dw2, dq, dk, dv
// are bf16 tensors upstream (dq, dk, dv then added to the attention's in bf16). Where the order differs: the
// backward here gathers dk and dv per key in fp32 and rounds once (upstream adds per-16-query-tile partials with
// bf16 atomics), which makes it deterministic.
#pragma once
#include "common.cuh"
#include "ptx.cuh"

#include <cstdint>

constexpr int kDcHeads = 6;                     // upstream's kernels take H = 6, D = 128 only
constexpr int kDcDim = 128;
constexpr int kDcWindow = 112;                  // keys per query, t itself included
constexpr int kDcW1Col = 29;                    // G[t, 29 .. 34]: w1's raw values
constexpr int kDcW2Col = 35;                    // G[t, 35 .. 40]: w2
constexpr int kDcThreads = 32 * kDcHeads;       // warp h: head h
constexpr int kDcLaneDims = 8;                  // one 16-byte bf16 vector per lane
constexpr float kDcLog2e = 1.4426950408889634f;

__device__ __forceinline__ float dc_round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

// [start, end) of the document holding token t: the last cu_seqlens entry <= t and the first one > t.
struct DcDoc {
    int start, end;
};
__device__ inline DcDoc dc_document(const int* cu_seqlens, int num_cu, int t, int T) {
    int lo = 0, hi = num_cu;  // first index with cu[i] > t
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (__ldg(cu_seqlens + mid) <= t) lo = mid + 1;
        else hi = mid;
    }
    const int start = lo > 0 ? __ldg(cu_seqlens + lo - 1) : 0;
    const int end = lo < num_cu ? __ldg(cu_seqlens + lo) : T;
    return {start < 0 ? 0 : start, end > T ? T : end};
}

// The token's w1 (bf16 values) and the pieces of its rms normalisation the backward needs: torch's
// F.rms_norm(G[t, 29:35].float(), (6,), eps=1e-6), then .type_as(x) (bf16).
struct DcW1 {
    float raw[kDcHeads], rstd, w1[kDcHeads];
};
__device__ inline DcW1 dc_w1(const float* coefs_row) {
    DcW1 r;
    float ms = 0.0f;
#pragma unroll
    for (int h = 0; h < kDcHeads; ++h) {
        r.raw[h] = coefs_row[kDcW1Col + h];
        ms += r.raw[h] * r.raw[h];
    }
    r.rstd = rsqrtf(ms / kDcHeads + 1e-6f);  // fp32 rms over the 6 heads, no learned scale
#pragma unroll
    for (int h = 0; h < kDcHeads; ++h) r.w1[h] = dc_round_bf16(r.raw[h] * r.rstd);  // w1 rounded to bf16 (type_as)
    return r;
}

// a[i] for a thread-dependent i without indexing a register array (which would put it on the stack).
__device__ __forceinline__ float dc_pick(const float (&a)[kDcHeads], int i) {
    float r = a[0];
#pragma unroll
    for (int h = 1; h < kDcHeads; ++h) r = i == h ? a[h] : r;
    return r;
}
template <class B>
__device__ __forceinline__ B* dc_row(B* x, int t, int h, int c) {
    return x + (static_cast<size_t>(t) * kDcHeads + h) * kDcDim + c * kDcLaneDims;
}
// This lane's 8 dims of a . b, summed over the half-warp's 16 lanes (both halves reduce at once).
__device__ __forceinline__ float dc_half_dot(const Pack128<__nv_bfloat16>& a, const Pack128<__nv_bfloat16>& b,
                                             bool valid) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kDcLaneDims; ++i) s += __bfloat162float(a[i]) * __bfloat162float(b[i]);
    return warp_butterfly<WarpSum, 8>(valid ? s : 0.0f);
}
// acc (this lane's 8 dims) plus the other half-warp's: both halves end with the sum over all keys.
__device__ __forceinline__ void dc_join_halves(float (&acc)[kDcLaneDims]) {
#pragma unroll
    for (int i = 0; i < kDcLaneDims; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], 16);
}
// dst[t, h, lane's dims] = bf16(base + bf16(add)) for the half-warp 0 lanes (base may be dst: read first).
// round_add: the value is a bf16 tensor upstream before the addition (the gradients); else base + add in fp32.
__device__ __forceinline__ void dc_store_sum(__nv_bfloat16* dst, const __nv_bfloat16* base, const float (&add)[kDcLaneDims],
                                             float mul, bool round_add) {
    const Pack128<__nv_bfloat16> b = load128(base);
    Pack128<__nv_bfloat16> o;
#pragma unroll
    for (int i = 0; i < kDcLaneDims; ++i) {
        const float a = add[i] * mul;
        o[i] = __float2bfloat16(__bfloat162float(b[i]) + (round_add ? dc_round_bf16(a) : a));
    }
    store128(dst, o);
}

// ---- forward on the tensor cores ----
// One block per 16 queries q0..q0+15, warp h head h. Their keys lie in [k0, k0 + 128), k0 = q0 - 111 (>= 0):
// S_h = Q_h K_h^T and O_h = bf16(w2 A) V_h are m16n8k16 products over that 128-key tile, K_h and V_h staged
// through shared memory 16 keys at a time (padded rows: the 8 rows an ldmatrix reads fall in distinct banks).
constexpr int kDcTileQ = 16;
constexpr int kDcTileK = 128;                   // kDcTileQ + kDcWindow - 1 keys, rounded up
constexpr int kDcChunk = 16;                    // keys per staged chunk
constexpr int kDcRow = kDcDim + 8;              // bf16 per shared row
static_assert(kDcTileQ + kDcWindow - 1 <= kDcTileK, "the query tile's keys must fit the key tile");

__device__ __forceinline__ uint32_t dc_pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) in the low half
    return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t dc_load_pair(const __nv_bfloat16* p) { return *reinterpret_cast<const uint32_t*>(p); }
// The warp copies rows key0 .. key0 + 15 of head h of x into its chunk (zeros past T).
__device__ __forceinline__ void dc_stage_chunk(__nv_bfloat16 (*chunk)[kDcRow], const __nv_bfloat16* x, int key0, int h,
                                               int T, int lane) {
#pragma unroll
    for (int i = 0; i < kDcChunk * kDcDim / kDcLaneDims / 32; ++i) {
        const int e = i * 32 + lane, r = e / (kDcDim / kDcLaneDims), c = e % (kDcDim / kDcLaneDims);
        const int key = key0 + r;
        store128(&chunk[r][c * kDcLaneDims],
                 key < T ? load128(dc_row(x, key, h, c)) : Pack128<__nv_bfloat16>::filled(__float2bfloat16(0.0f)));
    }
}

// Fragment rows of this lane (PTX m16n8k16 layouts, ptx.cuh): g = lane / 4 and g + 8; columns 2 (lane % 4) + {0, 1}.
__global__ void __launch_bounds__(kDcThreads)
    dc_mha_forward_mma_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* y, const __nv_bfloat16* q,
                              const __nv_bfloat16* k, const __nv_bfloat16* v, const float* coefs, int coef_stride,
                              const int* cu_seqlens, int num_cu, int T, float scale) {
    __shared__ __align__(16) __nv_bfloat16 stage[kDcHeads][kDcChunk][kDcRow];
    __shared__ float a[kDcTileQ][kDcTileK + 4];
    const int h = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int q0 = blockIdx.x * kDcTileQ, k0 = max(0, q0 - (kDcWindow - 1));
    int row_t[2], row_start[2];
    float w1r[2], w2r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        row_t[r] = q0 + g + 8 * r;
        const int t = min(row_t[r], T - 1);  // rows past T compute on row T - 1 and store nothing
        row_start[r] = dc_document(cu_seqlens, num_cu, t, T).start;
        const float* gr = coefs + static_cast<size_t>(t) * coef_stride;
        w1r[r] = dc_pick(dc_w1(gr).w1, h);
        w2r[r] = gr[kDcW2Col + h];
    }
    for (int i = threadIdx.x; i < kDcTileQ * (kDcTileK + 4); i += kDcThreads) (&a[0][0])[i] = 0.0f;

    // S_h = Q_h K_h^T: Q's A fragments straight from global memory (each element read once)
    uint32_t qa[kDcDim / 16][4];
#pragma unroll
    for (int ks = 0; ks < kDcDim / 16; ++ks)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int t = min(row_t[i % 2], T - 1), col = ks * 16 + 2 * tq + 8 * (i / 2);
            qa[ks][i] = dc_load_pair(q + (static_cast<size_t>(t) * kDcHeads + h) * kDcDim + col);
        }
    float sacc[kDcTileK / 8][4];
#pragma unroll
    for (int c = 0; c < kDcTileK / kDcChunk; ++c) {
        dc_stage_chunk(stage[h], k, k0 + c * kDcChunk, h, T, lane);
        __syncwarp();
        sacc[2 * c][0] = sacc[2 * c][1] = sacc[2 * c][2] = sacc[2 * c][3] = 0.0f;
        sacc[2 * c + 1][0] = sacc[2 * c + 1][1] = sacc[2 * c + 1][2] = sacc[2 * c + 1][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < kDcDim / 16; ++ks) {
            uint32_t b[4];  // keys 0-7 and 8-15 of the chunk, dims ks*16 .. +15
            const int m = lane / 8;
            ldmatrix<4>(b, &stage[h][(m / 2) * 8 + lane % 8][ks * 16 + (m % 2) * 8]);
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(sacc[2 * c], qa[ks], b0, sacc[2 * c]);
            mma_m16n8k16_bf16(sacc[2 * c + 1], qa[ks], b1, sacc[2 * c + 1]);
        }
        __syncwarp();
    }
    // the local softmax of each row over its valid keys (a row's values sit in the 4 lanes of its quad)
    const float score_mul = scale * kDcLog2e;  // upstream: tl.dot(q, k^T) * (scaling * log2 e), then exp2
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = row_t[r];
        float m = -INFINITY;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + n * 8 + 2 * tq + e;
                const bool ok = t < T && key <= t && t - key < kDcWindow && key >= row_start[r];
                float& s = sacc[n][2 * r + e];
                s = ok ? s * score_mul : -INFINITY;
                m = fmaxf(m, s);
            }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        const float m_safe = m == -INFINITY ? 0.0f : m;  // rows past T: no key
        float denom = 0.0f;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& s = sacc[n][2 * r + e];
                s = exp2f(s - m_safe);
                denom += s;
            }
        denom += __shfl_xor_sync(0xffffffffu, denom, 1);
        denom += __shfl_xor_sync(0xffffffffu, denom, 2);
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) sacc[n][2 * r + e] = denom > 0.0f ? sacc[n][2 * r + e] / denom : 0.0f;
        if (lse && tq == 0 && t < T) lse[static_cast<size_t>(t) * kDcHeads + h] = m_safe * 0.6931471805599453f + logf(denom);
    }
    // A = sum_h w1 P_h in fp32, heads in order (upstream's a_acc): warp h adds its term at turn h
#pragma unroll 1
    for (int turn = 0; turn < kDcHeads; ++turn) {
        __syncthreads();
        if (h == turn)
#pragma unroll
            for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) a[g + 8 * (i / 2)][n * 8 + 2 * tq + i % 2] += w1r[i / 2] * sacc[n][i];
    }
    __syncthreads();
    // O_h = bf16(w2 A) V_h: A's fragments from shared memory, V's by ldmatrix.trans
    float oacc[kDcDim / 8][4] = {};
#pragma unroll 1
    for (int c = 0; c < kDcTileK / kDcChunk; ++c) {
        dc_stage_chunk(stage[h], v, k0 + c * kDcChunk, h, T, lane);
        __syncwarp();
        uint32_t wa[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i % 2, col = c * kDcChunk + 2 * tq + 8 * (i / 2);
            // upstream: (w2 A).to(bf16) before the dot with v
            wa[i] = dc_pack_bf16(w2r[r] * a[g + 8 * r][col], w2r[r] * a[g + 8 * r][col + 1]);
        }
#pragma unroll
        for (int nd = 0; nd < kDcDim / 8; nd += 2) {
            uint32_t b[4];  // dims nd*8 .. +7 and (nd+1)*8 .. +7, keys 0-15 of the chunk
            const int m = lane / 8;
            ldmatrix_trans<4>(b, &stage[h][(m % 2) * 8 + lane % 8][(nd + m / 2) * 8]);
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(oacc[nd], wa, b0, oacc[nd]);
            mma_m16n8k16_bf16(oacc[nd + 1], wa, b1, oacc[nd + 1]);
        }
        __syncwarp();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int t = row_t[r];
        if (t >= T) continue;
#pragma unroll
        for (int nd = 0; nd < kDcDim / 8; ++nd) {
            const size_t i = (static_cast<size_t>(t) * kDcHeads + h) * kDcDim + nd * 8 + 2 * tq;
            const __nv_bfloat162 yy = *reinterpret_cast<const __nv_bfloat162*>(y + i);
            *reinterpret_cast<__nv_bfloat162*>(out + i) =
                __floats2bfloat162_rn(__low2float(yy) + oacc[nd][2 * r], __high2float(yy) + oacc[nd][2 * r + 1]);
        }
    }
}

inline void dc_mha_require(const char* who, int T, int H, int D, int coef_stride, const int* cu_seqlens, int num_cu) {
    kernel_require(H == kDcHeads && D == kDcDim, "%s: DC-MHA supports H = %d heads of D = %d only (got H=%d D=%d)", who,
                   kDcHeads, kDcDim, H, D);
    kernel_require(T > 0, "%s: T must be positive (T=%d)", who, T);
    kernel_require(coef_stride >= kDcW2Col + kDcHeads,
                   "%s: the gate's coefficient rows must hold columns %d..%d (stride %d)", who, kDcW1Col,
                   kDcW2Col + kDcHeads - 1, coef_stride);
    kernel_require(cu_seqlens != nullptr && num_cu >= 1, "%s: cu_seqlens needs at least one entry", who);
}
// Counted as one document (each token sees min(t + 1, 112) keys): an upper bound when documents are shorter.
inline double dc_mha_pairs(int T) {
    const double full = T > kDcWindow ? double(T - kDcWindow) : 0.0, ramp = T < kDcWindow ? T : kDcWindow;
    return full * kDcWindow + ramp * (ramp + 1) / 2;
}
inline double dc_rows_bytes(int T) { return 2.0 * T * kDcHeads * kDcDim; }
inline double dc_coef_bytes(int T) { return 4.0 * T * 2 * kDcHeads; }
// Reads q, k, v, y, the gate's 12 columns and cu_seqlens; writes out and (training) lse. Per key pair and head:
// q.k and the weighted v (2 x 2D FLOPs), exp2 and normalising (~5), A's 2 per head.
inline Work dc_mha_forward_work(int T, int num_cu, bool saves_lse) {
    const double pairs = dc_mha_pairs(T);
    return Work{.name = "dc_mha_forward",
                .flops = pairs * kDcHeads * (4.0 * kDcDim + 7.0),
                .bytes_read = 4 * dc_rows_bytes(T) + dc_coef_bytes(T) + 4.0 * num_cu,
                .bytes_written = dc_rows_bytes(T) + (saves_lse ? 4.0 * T * kDcHeads : 0.0)};
}
// out (may be y) = y + DC's correction. lse: (T, 6) fp32 for the backward, or null (validation). q, k: after
// QK-norm, rotary and the key offset; v: after aux_v; y: the attention's output; coefs: the MUDD gate's
// (T, coef_stride) fp32 coefficients (columns 29..40 read); scale: the attention's softmax scale.
inline void dc_mha_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* y, const __nv_bfloat16* q,
                           const __nv_bfloat16* k, const __nv_bfloat16* v, const float* coefs, int coef_stride,
                           const int* cu_seqlens, int num_cu, int T, int H, int D, float scale, cudaStream_t stream) {
    dc_mha_require("dc_mha_forward", T, H, D, coef_stride, cu_seqlens, num_cu);
    kernel_require(out && y && q && k && v && coefs, "dc_mha_forward: out, y, q, k, v and the coefficients are required");
    kernel_require(all_aligned16({out, y, q, k, v}), "dc_mha_forward: out, y, q, k, v must be 16-byte aligned");
    launch(dc_mha_forward_work(T, num_cu, lse != nullptr), dc_mha_forward_mma_kernel, dim3(ceil_div(T, kDcTileQ)),
           dim3(kDcThreads), 0, stream,
           out, lse, y, q, k, v, coefs, coef_stride, cu_seqlens, num_cu, T, scale);
    CUDA_CHECK_LAUNCH();
}

// ---- backward ----
// The query side's products for the key side: A[t, j] (fp32, T x 112) and dS_h[t, j] (bf16, T x 6 x 112).
inline size_t dc_mha_backward_workspace_bytes(int T) {
    return static_cast<size_t>(T) * kDcWindow * (sizeof(float) + kDcHeads * sizeof(__nv_bfloat16));
}
struct DcScratch {
    float* a;
    __nv_bfloat16* ds;
};
inline DcScratch dc_scratch(void* workspace, int T) {
    float* a = static_cast<float*>(workspace);
    return {a, reinterpret_cast<__nv_bfloat16*>(a + static_cast<size_t>(T) * kDcWindow)};
}

// One block per query t: recomputes P_h from lse, then dA, dw1, dw2 (dG's 12 columns), dS (kept for the key
// side, with A) and dq += scale dS k.
__global__ void __launch_bounds__(kDcThreads)
    dc_mha_backward_query_kernel(__nv_bfloat16* dq, float* dcoefs, float* a_out, __nv_bfloat16* ds_out,
                                 const __nv_bfloat16* go, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                 const __nv_bfloat16* v, const float* lse, const float* coefs, int coef_stride,
                                 const int* cu_seqlens, int num_cu, int T, float scale) {
    __shared__ float p[kDcHeads][kDcWindow], dm[kDcHeads][kDcWindow];
    __shared__ float a[kDcWindow], da[kDcWindow];
    __shared__ float gw1[kDcHeads], gw2[kDcHeads];
    const int t = blockIdx.x, h = threadIdx.x / 32, lane = threadIdx.x % 32, half = lane / 16, c = lane % 16;
    const DcDoc doc = dc_document(cu_seqlens, num_cu, t, T);
    const int n = min(kDcWindow, t - doc.start + 1);
    const float* g = coefs + static_cast<size_t>(t) * coef_stride;
    const DcW1 w = dc_w1(g);
    const float score_mul = scale * kDcLog2e, w1 = dc_pick(w.w1, h);
    const float lse2 = lse[static_cast<size_t>(t) * kDcHeads + h] * kDcLog2e;

    const Pack128<__nv_bfloat16> qv = load128(dc_row(q, t, h, c)), gv = load128(dc_row(go, t, h, c));
    for (int j0 = 0; j0 < n; j0 += 2) {
        const int j = j0 + half;
        const bool ok = j < n;
        const int s = t - (ok ? j : 0);
        const float d = dc_half_dot(qv, load128(dc_row(k, s, h, c)), ok);
        const float m = dc_half_dot(gv, load128(dc_row(v, s, h, c)), ok);
        if (ok && c == 0) {
            p[h][j] = exp2f(d * score_mul - lse2);  // upstream: exp2(score - lse log2 e)
            dm[h][j] = m;
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += kDcThreads) {
        float sa = 0.0f, sd = 0.0f;
#pragma unroll
        for (int hh = 0; hh < kDcHeads; ++hh) {  // fp32, heads in order (upstream's a_hidden and da_acc)
            sa += w.w1[hh] * p[hh][j];
            sd += g[kDcW2Col + hh] * dm[hh][j];
        }
        a[j] = sa;
        da[j] = sd;
        a_out[static_cast<size_t>(t) * kDcWindow + j] = sa;
    }
    __syncthreads();
    float s_w2 = 0.0f, s_soft = 0.0f, s_w1 = 0.0f;
    for (int j = lane; j < n; j += 32) {
        s_w2 += dm[h][j] * a[j];
        s_soft += w1 * da[j] * p[h][j];  // upstream's soft_dot: sum (w1 dA) P
        s_w1 += da[j] * p[h][j];
    }
    s_w2 = warp_reduce_sum(s_w2);
    s_soft = warp_reduce_sum(s_soft);
    s_w1 = warp_reduce_sum(s_w1);
    if (lane == 0) {
        gw1[h] = dc_round_bf16(s_w1);  // upstream's gpost_w1 / gpost_w2 are bf16 tensors
        gw2[h] = dc_round_bf16(s_w2);
    }
    __nv_bfloat16* ds_row = ds_out + (static_cast<size_t>(t) * kDcHeads + h) * kDcWindow;
    for (int j = lane; j < n; j += 32) {
        const float ds = dc_round_bf16(p[h][j] * (w1 * da[j] - s_soft));  // upstream: ds.to(bf16) before the dots
        p[h][j] = ds;
        ds_row[j] = __float2bfloat16(ds);
    }
    __syncthreads();
    float acc[kDcLaneDims] = {};
    for (int j0 = 0; j0 < n; j0 += 2) {
        const int j = j0 + half;
        if (j >= n) break;
        const float ds = p[h][j];
        const Pack128<__nv_bfloat16> kv = load128(dc_row(k, t - j, h, c));
#pragma unroll
        for (int i = 0; i < kDcLaneDims; ++i) acc[i] += ds * __bfloat162float(kv[i]);
    }
    dc_join_halves(acc);
    if (half == 0) dc_store_sum(dc_row(dq, t, h, c), dc_row(dq, t, h, c), acc, scale, true);
    if (threadIdx.x < kDcHeads) {
        const int i = threadIdx.x;
        float dot = 0.0f;  // mean_h(dw1 y1), y1 = raw rstd unrounded (torch's rms_norm backward)
#pragma unroll
        for (int hh = 0; hh < kDcHeads; ++hh) dot += gw1[hh] * (w.raw[hh] * w.rstd);
        float* dg = dcoefs + static_cast<size_t>(t) * coef_stride;
        const float raw = dc_pick(w.raw, i);
        dg[kDcW1Col + i] = dc_round_bf16(w.rstd * (gw1[i] - raw * w.rstd * (dot / kDcHeads)));  // bf16 dc_w1 grad
        dg[kDcW2Col + i] = gw2[i];
    }
}

// One block per key s: dk += scale sum_t dS k-side, dv += sum_t bf16(w2 A) go over the queries t = s .. s + 111 of
// s's document.
__global__ void __launch_bounds__(kDcThreads)
    dc_mha_backward_key_kernel(__nv_bfloat16* dk, __nv_bfloat16* dv, const float* a_in, const __nv_bfloat16* ds_in,
                               const __nv_bfloat16* go, const __nv_bfloat16* q, const float* coefs, int coef_stride,
                               const int* cu_seqlens, int num_cu, int T, float scale) {
    const int s = blockIdx.x, h = threadIdx.x / 32, lane = threadIdx.x % 32, half = lane / 16, c = lane % 16;
    const DcDoc doc = dc_document(cu_seqlens, num_cu, s, T);
    const int n = min(kDcWindow, doc.end - s);  // queries s, s+1, ..., s+n-1
    float acc_k[kDcLaneDims] = {}, acc_v[kDcLaneDims] = {};
    for (int j0 = 0; j0 < n; j0 += 2) {
        const int j = j0 + half;
        if (j >= n) break;
        const int t = s + j;
        const float ds = __bfloat162float(ds_in[(static_cast<size_t>(t) * kDcHeads + h) * kDcWindow + j]);
        const float cw = dc_round_bf16(coefs[static_cast<size_t>(t) * coef_stride + kDcW2Col + h] *
                                       a_in[static_cast<size_t>(t) * kDcWindow + j]);  // upstream: (w2 A).to(bf16)
        const Pack128<__nv_bfloat16> qv = load128(dc_row(q, t, h, c)), gv = load128(dc_row(go, t, h, c));
#pragma unroll
        for (int i = 0; i < kDcLaneDims; ++i) {
            acc_k[i] += ds * __bfloat162float(qv[i]);
            acc_v[i] += cw * __bfloat162float(gv[i]);
        }
    }
    dc_join_halves(acc_k);
    dc_join_halves(acc_v);
    if (half == 0) {
        dc_store_sum(dc_row(dk, s, h, c), dc_row(dk, s, h, c), acc_k, scale, true);
        dc_store_sum(dc_row(dv, s, h, c), dc_row(dv, s, h, c), acc_v, 1.0f, true);
    }
}

// Reads go, q, k, v, lse, the gate's 12 columns; writes dq (read and written: added to), the 12 gradient columns
// and the scratch (A and dS). Per pair and head: two dots (4D), dS and the sums (~12), dq's 2D; A and dA 4 per head.
inline Work dc_mha_backward_query_work(int T, int num_cu) {
    const double pairs = dc_mha_pairs(T);
    return Work{.name = "dc_mha_backward_query",
                .flops = pairs * kDcHeads * (6.0 * kDcDim + 16.0) + 30.0 * T,
                .bytes_read = 5 * dc_rows_bytes(T) + 4.0 * T * kDcHeads + dc_coef_bytes(T) + 4.0 * num_cu,
                .bytes_written = dc_rows_bytes(T) + dc_coef_bytes(T) + pairs * (4.0 + 2.0 * kDcHeads)};
}
// Reads the scratch, go, q, w2 and dk, dv; writes dk and dv. Per pair and head: 2 x 2D, the value weight 2.
inline Work dc_mha_backward_key_work(int T, int num_cu) {
    const double pairs = dc_mha_pairs(T);
    return Work{.name = "dc_mha_backward_key",
                .flops = pairs * kDcHeads * (4.0 * kDcDim + 2.0),
                .bytes_read = 4 * dc_rows_bytes(T) + pairs * (4.0 + 2.0 * kDcHeads) + 4.0 * T * kDcHeads + 4.0 * num_cu,
                .bytes_written = 2 * dc_rows_bytes(T)};
}
// dq, dk, dv: the attention's gradients, to which DC's are added (bf16(d + bf16(dc))); dcoefs: columns 29..40 of
// each row written (the rest untouched); go: d out (y's gradient is go, the caller's); lse from dc_mha_forward;
// workspace: dc_mha_backward_workspace_bytes(T), 16-byte aligned. The rest as dc_mha_forward.
inline void dc_mha_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, float* dcoefs,
                            const __nv_bfloat16* go, const __nv_bfloat16* q, const __nv_bfloat16* k,
                            const __nv_bfloat16* v, const float* lse, const float* coefs, int coef_stride,
                            const int* cu_seqlens, int num_cu, int T, int H, int D, float scale, void* workspace,
                            size_t workspace_bytes, cudaStream_t stream) {
    dc_mha_require("dc_mha_backward", T, H, D, coef_stride, cu_seqlens, num_cu);
    kernel_require(dq && dk && dv && dcoefs && go && q && k && v && lse && coefs && workspace,
                   "dc_mha_backward: dq, dk, dv, dcoefs, go, q, k, v, lse, the coefficients and the workspace are required");
    kernel_require(all_aligned16({dq, dk, dv, go, q, k, v, workspace}),
                   "dc_mha_backward: dq, dk, dv, go, q, k, v and the workspace must be 16-byte aligned");
    kernel_require(workspace_bytes >= dc_mha_backward_workspace_bytes(T),
                   "dc_mha_backward: workspace of %zu bytes, needs %zu", workspace_bytes,
                   dc_mha_backward_workspace_bytes(T));
    const DcScratch sc = dc_scratch(workspace, T);
    launch(dc_mha_backward_query_work(T, num_cu), dc_mha_backward_query_kernel, dim3(T), dim3(kDcThreads), 0, stream,
           dq, dcoefs, sc.a, sc.ds, go, q, k, v, lse, coefs, coef_stride, cu_seqlens, num_cu, T, scale);
    CUDA_CHECK_LAUNCH();
    launch(dc_mha_backward_key_work(T, num_cu), dc_mha_backward_key_kernel, dim3(T), dim3(kDcThreads), 0, stream, dk,
           dv, static_cast<const float*>(sc.a), static_cast<const __nv_bfloat16*>(sc.ds), go, q, coefs, coef_stride,
           cu_seqlens, num_cu, T, scale);
    CUDA_CHECK_LAUNCH();
}
