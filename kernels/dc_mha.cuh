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
// Layouts: q, k, v, y, out, go, dq, dk, dv (T, 6, D) bf16 as kernels/attention.cuh, D = 128 (the record) or 64
// (its CPU-sized twin; upstream's kernels take 128 only, the math is the same); lse (T, 6) fp32 (natural
// log of each local softmax's denominator); cu_seqlens as attention.cuh's (0, end of doc 0, ..., padded with T).
// One block per 16 queries (the forward, the backward's query side) or 16 keys (the backward's key side), warp h
// head h; every product runs on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate) over the tile's
// 128 keys (queries), the other operand staged 16 rows at a time through shared memory by cp.async into two buffers
// per warp (the next chunk's copies in flight during this chunk's products); QK^T and go V^T stage the block's own 16
// rows too, once. Two blocks share an SM (the key side: three): __launch_bounds__ holds the registers to that, the
// carveout sizes shared memory for it. The head dim D is a template parameter of every kernel and tile helper (the
// launchers dispatch on the runtime D): it sets the products' depth (QK^T, go V^T) or width (PV, dS K, dS^T Q,
// (w2 A)^T go) and nothing else.
// Upstream's rounding points, kept here: scores and products accumulate in fp32 from bf16 operands (tl.dot); w1 and
// the value weight w2 A are rounded to bf16 before use, as is dS before its two products; dw1, dw2, dq, dk, dv
// are bf16 tensors upstream (dq, dk, dv then added to the attention's in bf16). Where the order differs: the
// backward here gathers dk and dv per key in fp32 and rounds once (upstream adds per-16-query-tile partials with
// bf16 atomics), which makes it deterministic.
#pragma once
#include "common.cuh"
#include "ptx.cuh"

#include <cstdint>
#include <type_traits>

constexpr int kDcHeads = 6;                     // upstream's kernels take H = 6, D = 128 only; here D = 64 too
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
template <int D, class B>
__device__ __forceinline__ B* dc_row(B* x, int t, int h, int c) {
    return x + (static_cast<size_t>(t) * kDcHeads + h) * D + c * kDcLaneDims;
}
// ---- tensor-core tiles ----
// A block's 16 rows r0..r0+15 (queries; keys on the backward's key side) meet 128 columns c0..c0+127 (keys, or
// queries) over D dims: c0 = r0 - 111 for queries, r0 for keys. Accumulator element i of n8 tile n sits at row
// g + 8 (i / 2), column 8 n + 2 tq + i % 2 (g = lane / 4, tq = lane % 4: PTX's m16n8k16 layouts, ptx.cuh).
constexpr int kDcTileQ = 16;
constexpr int kDcTileK = 128;                   // kDcTileQ + kDcWindow - 1 columns, rounded up
constexpr int kDcChunk = 16;                    // rows per staged chunk
constexpr int kDcChunks = kDcTileK / kDcChunk;
static_assert(kDcTileQ + kDcWindow - 1 <= kDcTileK, "the 16 rows' window must fit the 128 columns");
template <int D>
constexpr bool dc_dim_ok = D == 64 || D == 128;
// A shared row holds D + 8 bf16 (D / 2 + 4 words, D a multiple of 64): rows 4 banks apart, so the 8 16-byte rows an
// ldmatrix reads hit distinct banks.
template <int D>
using DcStage = __nv_bfloat16[kDcChunk][D + 8];
template <int D>
using DcStages = DcStage<D>[2];                 // a warp's two buffers: chunk c in buffer c % 2
using DcScores = float[kDcTileK / 8][4];       // 16 x 128 fp32 (n8 tiles of columns)
template <int D>
using DcOut = float[D / 8][4];                  // 16 x D fp32 (n8 tiles of dims)

// p, opaque to the compiler: addresses from it are formed again where used, not kept in registers from an earlier
// product on the same tensors (the query side's repeated go V^T spilled them).
template <class T>
__device__ __forceinline__ T* dc_fresh(T* p) {
#ifdef __CUDA_ARCH__
    asm volatile("" : "+l"(p));
#endif
    return p;
}
__device__ __forceinline__ uint32_t dc_pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // lo in the low half
    return *reinterpret_cast<const uint32_t*>(&v);
}
// The warp starts copying rows row0 .. row0 + 15 of head h of x into chunk (zeros past T), one cp.async group per
// lane: no registers held, the bytes land while the warp computes on its other buffer. Lanes 2r and 2r + 1 take
// row r's 16-byte vectors in turn (every copy a whole 32-byte sector with its neighbour's), so a lane's copies are
// one row at fixed offsets from one address.
template <int D>
__device__ __forceinline__ void dc_stage_chunk(DcStage<D>& chunk, const __nv_bfloat16* x, int row0, int h, int T,
                                               int lane) {
    static_assert(2 * kDcChunk == 32, "two lanes a row");
    const int r = lane / 2, row = row0 + r;
    const bool inside = row < T;
    const __nv_bfloat16* src = dc_row<D>(x, inside ? row : 0, h, lane % 2);
#pragma unroll
    for (int i = 0; i < D / kDcLaneDims / 2; ++i)
        cp_async16(&chunk[r][(lane % 2 + 2 * i) * kDcLaneDims], src + 2 * i * kDcLaneDims, inside);
    cp_async_commit();
}
// The oldest chunk in flight is staged and seen by the whole warp: a lane's groups complete in order, so with the
// next chunk's group committed after it, all but that one.
__device__ __forceinline__ void dc_stage_ready(bool next_in_flight) {
    if (next_in_flight) cp_async_wait<1>();
    else cp_async_wait<0>();
    __syncwarp();
}
// acc[r, col] = x_h[r0 + r] . y_h[c0 + col] over the D dims (rows past T: zeros, results no one stores): x's 16
// rows staged once into xs and read by ldmatrix at each use (held in registers they would cost D / 4 of them
// through the whole product), y staged a chunk at a time.
template <int D>
__device__ inline void dc_tile_dots(DcScores& acc, const __nv_bfloat16* x, int r0, const __nv_bfloat16* y, int c0, int h,
                                    int T, DcStages<D>& stage, DcStage<D>& xs, int lane) {
    const int m = lane / 8;
    dc_stage_chunk<D>(xs, x, r0, h, T, lane);  // complete with chunk 0 (the groups retire in order)
    dc_stage_chunk<D>(stage[0], y, c0, h, T, lane);
#pragma unroll
    for (int c = 0; c < kDcChunks; ++c) {
        // into the buffer chunk c - 1 was read from (every lane past it: the __syncwarp ending c - 1)
        if (c + 1 < kDcChunks) dc_stage_chunk<D>(stage[(c + 1) % 2], y, c0 + (c + 1) * kDcChunk, h, T, lane);
        dc_stage_ready(c + 1 < kDcChunks);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[2 * c][i] = acc[2 * c + 1][i] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            uint32_t xa[4], b[4];  // x's rows 0-15, dims ks*16 .. +15; columns 0-7 and 8-15 of the chunk, the same dims
            ldmatrix<4>(xa, &xs[lane % 16][ks * 16 + (lane / 16) * 8]);
            ldmatrix<4>(b, &stage[c % 2][(m / 2) * 8 + lane % 8][ks * 16 + (m % 2) * 8]);
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(acc[2 * c], xa, b0, acc[2 * c]);
            mma_m16n8k16_bf16(acc[2 * c + 1], xa, b1, acc[2 * c + 1]);
        }
        __syncwarp();
    }
}
// out = w (16 x 128 columns, bf16) @ y_h[c0 .. c0 + 127] (D dims): w's A fragment of columns 16c .. 16c + 15 from
// frag(c, wa), y staged and read by ldmatrix.trans. Chunk c + 1's fragment is read during chunk c's products (frag
// reads memory: its loads then wait behind the tensor cores, not before them).
template <int D, class Frag>
__device__ inline void dc_tile_mix(DcOut<D>& out, Frag frag, const __nv_bfloat16* y, int c0, int h, int T,
                                   DcStages<D>& stage, int lane) {
    const int m = lane / 8;
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd)
#pragma unroll
        for (int i = 0; i < 4; ++i) out[nd][i] = 0.0f;
    dc_stage_chunk<D>(stage[0], y, c0, h, T, lane);
    uint32_t wa[4];
    frag(0, wa);
#pragma unroll 1
    for (int c = 0; c < kDcChunks; ++c) {
        const bool more = c + 1 < kDcChunks;
        if (more) dc_stage_chunk<D>(stage[(c + 1) % 2], y, c0 + (c + 1) * kDcChunk, h, T, lane);  // as dc_tile_dots
        uint32_t next[4];
        frag(more ? c + 1 : c, next);  // the last chunk's again at the end: harmless
        dc_stage_ready(more);
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
            uint32_t b[4];  // dims nd*8 .. +7 and (nd+1)*8 .. +7, rows 0-15 of the chunk
            ldmatrix_trans<4>(b, &stage[c % 2][(m % 2) * 8 + lane % 8][(nd + m / 2) * 8]);
            const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
            mma_m16n8k16_bf16(out[nd], wa, b0, out[nd]);
            mma_m16n8k16_bf16(out[nd + 1], wa, b1, out[nd + 1]);
        }
        __syncwarp();
#pragma unroll
        for (int i = 0; i < 4; ++i) wa[i] = next[i];
    }
}
// dst[row, h, :] = bf16(base + add * mul) for the lane's rows < T (base may be dst: each element read, then written);
// round_add: add * mul is a bf16 tensor upstream before the addition (the gradients), else the sum is fp32.
template <int D>
__device__ inline void dc_store_tile(__nv_bfloat16* dst, const __nv_bfloat16* base, const DcOut<D>& add,
                                     const int (&row_t)[2], int h, int T, float mul, bool round_add, int lane) {
    const int tq = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (row_t[r] >= T) continue;
#pragma unroll
        for (int nd = 0; nd < D / 8; ++nd) {
            const size_t i = (static_cast<size_t>(row_t[r]) * kDcHeads + h) * D + nd * 8 + 2 * tq;
            const __nv_bfloat162 b = *reinterpret_cast<const __nv_bfloat162*>(base + i);
            float a0 = add[nd][2 * r] * mul, a1 = add[nd][2 * r + 1] * mul;
            if (round_add) a0 = dc_round_bf16(a0), a1 = dc_round_bf16(a1);
            *reinterpret_cast<__nv_bfloat162*>(dst + i) = __floats2bfloat162_rn(__low2float(b) + a0, __high2float(b) + a1);
        }
    }
}
// Key c0 + col is one of query t's: t - 111 <= key <= t, key >= t's document start.
__device__ __forceinline__ bool dc_key_ok(int t, int key, int doc_start, int T) {
    return t < T && key <= t && t - key < kDcWindow && key >= doc_start;
}
// The query rows' coefficients, for this warp's head.
struct DcRows {
    int t[2], start[2];
    float w1[2], w2[2];
};
__device__ inline DcRows dc_query_rows(const float* coefs, int coef_stride, const int* cu_seqlens, int num_cu, int q0,
                                       int h, int T, int lane) {
    DcRows rows;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        rows.t[r] = q0 + lane / 4 + 8 * r;
        const int t = min(rows.t[r], T - 1);  // rows past T compute on row T - 1 and store nothing
        rows.start[r] = dc_document(cu_seqlens, num_cu, t, T).start;
        const float* g = coefs + static_cast<size_t>(t) * coef_stride;
        rows.w1[r] = dc_pick(dc_w1(g).w1, h);
        rows.w2[r] = g[kDcW2Col + h];
    }
    return rows;
}
// sum[r] += w[r] * acc over the 16 x 128 tile in shared memory, warp h at turn h (fp32, heads in upstream's order).
__device__ inline void dc_add_heads(float (*sum)[kDcTileK + 4], const DcScores& acc, const float (&w)[2], int h, int lane) {
    const int g = lane / 4, tq = lane % 4;
#pragma unroll 1
    for (int turn = 0; turn < kDcHeads; ++turn) {
        __syncthreads();
        if (h == turn)
#pragma unroll
            for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) sum[g + 8 * (i / 2)][n * 8 + 2 * tq + i % 2] += w[i / 2] * acc[n][i];
    }
    __syncthreads();
}
// Sum over the 4 lanes of a quad (one accumulator row).
__device__ __forceinline__ float dc_quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// ---- shared memory and occupancy ----
// Blocks per SM each kernel is built for: __launch_bounds__ has ptxas fit its registers to that many blocks of 192
// threads (168 a thread for two; for three it gives the key side 96), and their shared memory fits beside (below).
constexpr int kDcForwardBlocks = 2, kDcQueryBlocks = 2, kDcKeyBlocks = 3;
// Each kernel's shared memory, all dynamic (the staging alone passes the 48 KB a block's static memory may hold).
template <int D>
struct DcForwardSmem {
    DcStages<D> stage[kDcHeads];
    DcStage<D> xrows[kDcHeads];  // dc_tile_dots' x rows
    float a[kDcTileQ][kDcTileK + 4];
};
template <int D>
struct DcQuerySmem {
    DcStages<D> stage[kDcHeads];
    DcStage<D> xrows[kDcHeads];
    float a[kDcTileQ][kDcTileK + 4], da[kDcTileQ][kDcTileK + 4];
    float gw[2][kDcTileQ][kDcHeads];  // bf16 values of dw1, dw2
    DcRows rows[kDcHeads][32];        // each lane's rows' coefficients (dc_query_rows) and lse (log2 units)
    float lse2[kDcHeads][32][2];
};
template <int D>
struct DcKeySmem {
    DcStages<D> stage[kDcHeads];
};
// Each kernel's blocks per SM fit an H100's or H200's 228 KB of shared memory a SM, 1 KB reserved a block.
constexpr size_t kDcSmShared = 228 * 1024, kDcBlockReserved = 1024;
template <class Smem>
constexpr bool dc_smem_fits(int blocks) {
    return blocks * (sizeof(Smem) + kDcBlockReserved) <= kDcSmShared;
}
static_assert(dc_smem_fits<DcForwardSmem<128>>(kDcForwardBlocks) && dc_smem_fits<DcQuerySmem<128>>(kDcQueryBlocks) &&
                  dc_smem_fits<DcKeySmem<128>>(kDcKeyBlocks) && dc_smem_fits<DcForwardSmem<64>>(kDcForwardBlocks) &&
                  dc_smem_fits<DcQuerySmem<64>>(kDcQueryBlocks) && dc_smem_fits<DcKeySmem<64>>(kDcKeyBlocks),
              "the blocks the registers allow must fit the SM's shared memory");
// Once per kernel: its dynamic shared memory (past the 48 KB default) and the largest carveout, so that the blocks its
// registers allow sit side by side (left to itself the driver gave the forward 64 KB when its registers allowed one
// block; a percentage sized to the blocks would hang on how the driver rounds it to the sizes an SM offers). The
// staging bypasses L1 (cp.async.cg), so the smaller L1 costs little.
template <class Kernel>
inline bool dc_allow_smem(Kernel* kernel, size_t bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                    static_cast<int>(cudaSharedmemCarveoutMaxShared)));
    return true;
}

// ---- forward ----
// P_h over each row's keys (lse saved when lse != null), A = sum_h w1 P_h, out = y + w2 A V.
template <int D>
__global__ void __launch_bounds__(kDcThreads, kDcForwardBlocks)
    dc_mha_forward_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* y, const __nv_bfloat16* q,
                          const __nv_bfloat16* k, const __nv_bfloat16* v, const float* coefs, int coef_stride,
                          const int* cu_seqlens, int num_cu, int T, float scale) {
    static_assert(dc_dim_ok<D>, "D = 64 or 128");
    DcForwardSmem<D>& sm = *dynamic_smem<DcForwardSmem<D>>();
    auto& stage = sm.stage;
    auto& a = sm.a;
    const int h = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int q0 = blockIdx.x * kDcTileQ, k0 = max(0, q0 - (kDcWindow - 1));
    const DcRows rows = dc_query_rows(coefs, coef_stride, cu_seqlens, num_cu, q0, h, T, lane);
    for (int i = threadIdx.x; i < kDcTileQ * (kDcTileK + 4); i += kDcThreads) (&a[0][0])[i] = 0.0f;

    DcScores p;
    dc_tile_dots<D>(p, q, q0, k, k0, h, T, stage[h], sm.xrows[h], lane);
    const float score_mul = scale * kDcLog2e;  // upstream: tl.dot(q, k^T) * (scaling * log2 e), then exp2
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the local softmax of row g + 8r over its valid keys
        float m = -INFINITY;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float& s = p[n][2 * r + e];
                s = dc_key_ok(rows.t[r], k0 + n * 8 + 2 * tq + e, rows.start[r], T) ? s * score_mul : -INFINITY;
                m = fmaxf(m, s);
            }
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
        m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
        if (m == -INFINITY) m = 0.0f;  // rows past T: no key
        float denom = 0.0f;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) denom += p[n][2 * r + e] = exp2f(p[n][2 * r + e] - m);
        denom = dc_quad_sum(denom);
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) p[n][2 * r + e] = denom > 0.0f ? p[n][2 * r + e] / denom : 0.0f;  // renormalised
        if (lse && tq == 0 && rows.t[r] < T)
            lse[static_cast<size_t>(rows.t[r]) * kDcHeads + h] = m * 0.6931471805599453f + logf(denom);
    }
    dc_add_heads(a, p, rows.w1, h, lane);
    DcOut<D> o;
    dc_tile_mix<D>(
        o,
        [&](int c, uint32_t (&wa)[4]) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i % 2, col = c * kDcChunk + 2 * tq + 8 * (i / 2);
                // upstream: (w2 A).to(bf16) before the dot with v
                wa[i] = dc_pack_bf16(rows.w2[r] * a[g + 8 * r][col], rows.w2[r] * a[g + 8 * r][col + 1]);
            }
        },
        v, k0, h, T, stage[h], lane);
    dc_store_tile<D>(out, y, o, rows.t, h, T, 1.0f, false, lane);
}

inline void dc_mha_require(const char* who, int T, int H, int D, int coef_stride, const int* cu_seqlens, int num_cu) {
    kernel_require(H == kDcHeads && (D == 64 || D == 128),
                   "%s: DC-MHA supports H = %d heads of D = 64 or 128 only (got H=%d D=%d)", who, kDcHeads, H, D);
    kernel_require(T > 0, "%s: T must be positive (T=%d)", who, T);
    kernel_require(coef_stride >= kDcW2Col + kDcHeads,
                   "%s: the gate's coefficient rows must hold columns %d..%d (stride %d)", who, kDcW1Col,
                   kDcW2Col + kDcHeads - 1, coef_stride);
    kernel_require(cu_seqlens != nullptr && num_cu >= 1, "%s: cu_seqlens needs at least one entry", who);
}
// f(std::integral_constant<int, D>) for the runtime D (dc_mha_require has checked it).
template <class F>
inline void dc_with_dim(int D, F f) {
    if (D == 64) f(std::integral_constant<int, 64>{});
    else f(std::integral_constant<int, 128>{});
}
// Valid (query, key) pairs counted as one document (each token sees min(t + 1, 112) keys): an upper bound.
inline double dc_mha_pairs(int T) {
    const double full = T > kDcWindow ? double(T - kDcWindow) : 0.0, ramp = T < kDcWindow ? T : kDcWindow;
    return full * kDcWindow + ramp * (ramp + 1) / 2;
}
// One 16 x 128 x D (or 16 x D x 128) tile product per block and head (masked columns included: the tensor cores
// compute them).
inline double dc_tile_products_flops(int T, int D) {
    return ceil_div(T, kDcTileQ) * kDcHeads * 2.0 * kDcTileQ * kDcTileK * D;
}
inline double dc_rows_bytes(int T, int D) { return 2.0 * T * kDcHeads * D; }
inline double dc_coef_bytes(int T) { return 4.0 * T * 2 * kDcHeads; }
// Reads q, k, v, y, the gate's 12 columns and cu_seqlens; writes out and (training) lse. Two tile products (QK^T,
// PV) per block and head; per tile element exp2, the mask and normalising (~6), A's 2 per head.
inline Work dc_mha_forward_work(int T, int D, int num_cu, bool saves_lse) {
    const double elems = double(ceil_div(T, kDcTileQ)) * kDcHeads * kDcTileQ * kDcTileK;
    return Work{.name = "dc_mha_forward",
                .tc_flops = 2 * dc_tile_products_flops(T, D),
                .flops = 8.0 * elems,
                .bytes_read = 4 * dc_rows_bytes(T, D) + dc_coef_bytes(T) + 4.0 * num_cu,
                .bytes_written = dc_rows_bytes(T, D) + (saves_lse ? 4.0 * T * kDcHeads : 0.0)};
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
    dc_with_dim(D, [&](auto d) {
        constexpr int Dd = decltype(d)::value;
        static const bool allowed = dc_allow_smem(dc_mha_forward_kernel<Dd>, sizeof(DcForwardSmem<Dd>));
        (void)allowed;
        launch(dc_mha_forward_work(T, D, num_cu, lse != nullptr), dc_mha_forward_kernel<Dd>, dim3(ceil_div(T, kDcTileQ)),
               dim3(kDcThreads), sizeof(DcForwardSmem<Dd>), stream, out, lse, y, q, k, v, coefs, coef_stride,
               cu_seqlens, num_cu, T, scale);
    });
    CUDA_CHECK_LAUNCH();
}

// ---- backward ----
// The query side's products for the key side: A[t, j] (fp32, T x 112) and dS_h[t, j] (bf16, T x 6 x 112), j = t - s.
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

// P_h = exp(scale q.k - lse) on the row's valid keys, 0 elsewhere (upstream: exp2(score - lse log2 e)).
__device__ inline void dc_probs(DcScores& p, const DcRows& rows, const float (&lse2)[2], int k0, float score_mul, int T,
                                int lane) {
    const int tq = lane % 4;
#pragma unroll
    for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int r = i / 2;
            p[n][i] = dc_key_ok(rows.t[r], k0 + n * 8 + 2 * tq + i % 2, rows.start[r], T) ? exp2f(p[n][i] * score_mul - lse2[r])
                                                                                         : 0.0f;
        }
}

// One block per 16 queries: dm_h = go_h . v_h, dA = sum_h w2 dm_h; P_h (from lse), A = sum_h w1 P_h, dw1 = sum dA P,
// dS = bf16(P (w1 dA - sum w1 dA P)) into the scratch (with A, for the key side); dm_h again (recomputed rather
// than kept: registers), dw2 = sum dm A; dq += scale dS K (dS read back by the warp that wrote it); dG's 12
// columns through the rms backward.
template <int D>
__global__ void __launch_bounds__(kDcThreads, kDcQueryBlocks)
    dc_mha_backward_query_kernel(__nv_bfloat16* dq, float* dcoefs, float* a_out, __nv_bfloat16* ds_out,
                                 const __nv_bfloat16* go, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                 const __nv_bfloat16* v, const float* lse, const float* coefs, int coef_stride,
                                 const int* cu_seqlens, int num_cu, int T, float scale) {
    static_assert(dc_dim_ok<D>, "D = 64 or 128");
    DcQuerySmem<D>& sm = *dynamic_smem<DcQuerySmem<D>>();
    auto& stage = sm.stage;
    auto &a = sm.a, &da = sm.da;
    auto& gw = sm.gw;
    const int h = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int q0 = blockIdx.x * kDcTileQ, k0 = max(0, q0 - (kDcWindow - 1));
    // The lane's row coefficients live in shared memory, read at each use: held in registers through the products
    // they made the kernel spill at 168 registers.
    DcRows& rows = sm.rows[h][lane];
    rows = dc_query_rows(coefs, coef_stride, cu_seqlens, num_cu, q0, h, T, lane);
    const float score_mul = scale * kDcLog2e;
    float(&lse2)[2] = sm.lse2[h][lane];
#pragma unroll
    for (int r = 0; r < 2; ++r) lse2[r] = lse[static_cast<size_t>(min(rows.t[r], T - 1)) * kDcHeads + h] * kDcLog2e;
    for (int i = threadIdx.x; i < kDcTileQ * (kDcTileK + 4); i += kDcThreads) (&a[0][0])[i] = (&da[0][0])[i] = 0.0f;

    DcScores acc;
    dc_tile_dots<D>(acc, go, q0, v, k0, h, T, stage[h], sm.xrows[h], lane);  // dm_h (fp32, as upstream's tl.dot)
    dc_add_heads(da, acc, rows.w2, h, lane);  // dA (upstream's da_acc)
    dc_tile_dots<D>(acc, q, q0, k, k0, h, T, stage[h], sm.xrows[h], lane);
    dc_probs(acc, rows, lse2, k0, score_mul, T, lane);
    dc_add_heads(a, acc, rows.w1, h, lane);   // A (upstream's a_hidden)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float soft = 0.0f, s1 = 0.0f;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const float d = da[g + 8 * r][n * 8 + 2 * tq + e], pp = acc[n][2 * r + e];
                soft += rows.w1[r] * d * pp;  // upstream's soft_dot: sum (w1 dA) P
                s1 += d * pp;
            }
        soft = dc_quad_sum(soft);
        s1 = dc_quad_sum(s1);
        if (tq == 0) gw[0][g + 8 * r][h] = dc_round_bf16(s1);  // upstream's gpost_w1 is a bf16 tensor
        const int t = rows.t[r];
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = k0 + n * 8 + 2 * tq + e;
                if (!dc_key_ok(t, key, rows.start[r], T)) continue;
                // upstream: ds.to(bf16) before its dots with k and q
                const float ds = acc[n][2 * r + e] * (rows.w1[r] * da[g + 8 * r][n * 8 + 2 * tq + e] - soft);
                ds_out[(static_cast<size_t>(t) * kDcHeads + h) * kDcWindow + (t - key)] = __float2bfloat16(ds);
                if (h == 0) a_out[static_cast<size_t>(t) * kDcWindow + (t - key)] = a[g + 8 * r][n * 8 + 2 * tq + e];
            }
    }
    // dm_h again (recomputed rather than kept: registers)
    dc_tile_dots<D>(acc, dc_fresh(go), q0, dc_fresh(v), k0, h, T, stage[h], sm.xrows[h], lane);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float s = 0.0f;
#pragma unroll
        for (int n = 0; n < kDcTileK / 8; ++n)
#pragma unroll
            for (int e = 0; e < 2; ++e) s += acc[n][2 * r + e] * a[g + 8 * r][n * 8 + 2 * tq + e];
        s = dc_quad_sum(s);
        if (tq == 0) gw[1][g + 8 * r][h] = dc_round_bf16(s);  // upstream's gpost_w2 is a bf16 tensor
    }
    DcOut<D> o;
    dc_tile_mix<D>(
        o,
        [&](int c, uint32_t (&wa)[4]) {  // dS read back from the scratch (kept in registers, the kernel would spill)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int r = i % 2, t = rows.t[r];
                float x[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int key = k0 + c * kDcChunk + 2 * tq + 8 * (i / 2) + e;
                    x[e] = dc_key_ok(t, key, rows.start[r], T)
                               ? __bfloat162float(ds_out[(static_cast<size_t>(t) * kDcHeads + h) * kDcWindow + (t - key)])
                               : 0.0f;
                }
                wa[i] = dc_pack_bf16(x[0], x[1]);
            }
        },
        k, k0, h, T, stage[h], lane);
    dc_store_tile<D>(dq, dq, o, rows.t, h, T, scale, true, lane);
    __syncthreads();
    if (threadIdx.x < kDcTileQ * kDcHeads) {  // dG[t, 29 + i] = bf16((dw1_i - y_i mean(dw1 y)) rstd), torch's rms_norm backward
        const int r = threadIdx.x / kDcHeads, i = threadIdx.x % kDcHeads, t = q0 + r;
        if (t < T) {
            const DcW1 w = dc_w1(coefs + static_cast<size_t>(t) * coef_stride);
            float dot = 0.0f;  // y = raw rstd, unrounded
#pragma unroll
            for (int hh = 0; hh < kDcHeads; ++hh) dot += gw[0][r][hh] * (w.raw[hh] * w.rstd);
            float* dg = dcoefs + static_cast<size_t>(t) * coef_stride;
            dg[kDcW1Col + i] = dc_round_bf16(w.rstd * (gw[0][r][i] - dc_pick(w.raw, i) * w.rstd * (dot / kDcHeads)));
            dg[kDcW2Col + i] = gw[1][r][i];
        }
    }
}

// One block per 16 keys s0..s0+15 and their queries s0 .. s0 + 127: dk += scale dS^T Q, dv += bf16(w2 A)^T go, the
// A fragments gathered from the scratch (query t's column j = t - s) where (t, s) is a valid pair, zeros elsewhere.
template <int D>
__global__ void __launch_bounds__(kDcThreads, kDcKeyBlocks)
    dc_mha_backward_key_kernel(__nv_bfloat16* dk, __nv_bfloat16* dv, const float* a_in, const __nv_bfloat16* ds_in,
                               const __nv_bfloat16* go, const __nv_bfloat16* q, const float* coefs, int coef_stride,
                               const int* cu_seqlens, int num_cu, int T, float scale) {
    static_assert(dc_dim_ok<D>, "D = 64 or 128");
    auto& stage = dynamic_smem<DcKeySmem<D>>()->stage;
    const int h = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int s0 = blockIdx.x * kDcTileQ;
    int key[2], end[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        key[r] = s0 + g + 8 * r;
        end[r] = key[r] < T ? dc_document(cu_seqlens, num_cu, key[r], T).end : 0;  // no query for keys past T
    }
    // pair (query t, key s) of the lane's fragment element: valid, and t and its scratch column j = t - s
    auto pair = [&](int c, int i, int e, int& t, int& j) {
        const int r = i % 2;
        t = s0 + c * kDcChunk + 2 * tq + 8 * (i / 2) + e;
        j = t - key[r];
        return t < end[r] && j >= 0 && j < kDcWindow;
    };
    // the mix's A fragment: value(t, j) of each valid pair (0 elsewhere), packed to bf16
    auto pair_values = [&](auto value) {
        return [&, value](int c, uint32_t (&wa)[4]) {
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float x[2];
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    int t, j;
                    x[e] = pair(c, i, e, t, j) ? value(static_cast<size_t>(t), j) : 0.0f;
                }
                wa[i] = dc_pack_bf16(x[0], x[1]);
            }
        };
    };
    DcOut<D> o;
    const auto ds_of = [&](size_t t, int j) {  // already bf16 values
        return __bfloat162float(ds_in[(t * kDcHeads + h) * kDcWindow + j]);
    };
    dc_tile_mix<D>(o, pair_values(ds_of), q, s0, h, T, stage[h], lane);
    dc_store_tile<D>(dk, dk, o, key, h, T, scale, true, lane);
    // upstream: (w2 A).to(bf16) before its dot with go
    const auto w2a_of = [&](size_t t, int j) { return coefs[t * coef_stride + kDcW2Col + h] * a_in[t * kDcWindow + j]; };
    dc_tile_mix<D>(o, pair_values(w2a_of), go, s0, h, T, stage[h], lane);
    dc_store_tile<D>(dv, dv, o, key, h, T, 1.0f, true, lane);
}

// Reads go, q, k (twice), v, lse, the gate's 12 columns; writes dq (read and written: added to), the 12 gradient
// columns and the scratch (A and dS). Tile products: QK^T twice, go V^T, dS K; per tile element ~16.
inline Work dc_mha_backward_query_work(int T, int D, int num_cu) {
    const double elems = double(ceil_div(T, kDcTileQ)) * kDcHeads * kDcTileQ * kDcTileK;
    return Work{.name = "dc_mha_backward_query",
                .tc_flops = 4 * dc_tile_products_flops(T, D),
                .flops = 16.0 * elems + 30.0 * T,
                .bytes_read = 6 * dc_rows_bytes(T, D) + 4.0 * T * kDcHeads + dc_coef_bytes(T) + 4.0 * num_cu,
                .bytes_written = dc_rows_bytes(T, D) + dc_coef_bytes(T) + dc_mha_pairs(T) * (4.0 + 2.0 * kDcHeads)};
}
// Reads the scratch, go, q, w2 and dk, dv; writes dk and dv. Tile products: dS^T Q and (w2 A)^T go.
inline Work dc_mha_backward_key_work(int T, int D, int num_cu) {
    const double pairs = dc_mha_pairs(T);
    return Work{.name = "dc_mha_backward_key",
                .tc_flops = 2 * dc_tile_products_flops(T, D),
                .flops = pairs * kDcHeads * 2.0,
                .bytes_read = 4 * dc_rows_bytes(T, D) + pairs * (4.0 + 2.0 * kDcHeads) + 4.0 * T * kDcHeads + 4.0 * num_cu,
                .bytes_written = 2 * dc_rows_bytes(T, D)};
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
    const dim3 grid(ceil_div(T, kDcTileQ));
    dc_with_dim(D, [&](auto d) {
        constexpr int Dd = decltype(d)::value;
        static const bool allowed =
            dc_allow_smem(dc_mha_backward_query_kernel<Dd>, sizeof(DcQuerySmem<Dd>)) &&
            dc_allow_smem(dc_mha_backward_key_kernel<Dd>, sizeof(DcKeySmem<Dd>));
        (void)allowed;
        launch(dc_mha_backward_query_work(T, D, num_cu), dc_mha_backward_query_kernel<Dd>, grid, dim3(kDcThreads),
               sizeof(DcQuerySmem<Dd>), stream, dq, dcoefs, sc.a, sc.ds, go, q, k, v, lse, coefs, coef_stride,
               cu_seqlens, num_cu, T, scale);
        CUDA_CHECK_LAUNCH();
        launch(dc_mha_backward_key_work(T, D, num_cu), dc_mha_backward_key_kernel<Dd>, grid, dim3(kDcThreads),
               sizeof(DcKeySmem<Dd>), stream, dk, dv, static_cast<const float*>(sc.a),
               static_cast<const __nv_bfloat16*>(sc.ds), go, q, coefs, coef_stride, cu_seqlens, num_cu, T, scale);
    });
    CUDA_CHECK_LAUNCH();
}
