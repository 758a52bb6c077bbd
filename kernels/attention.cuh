// Attention over one packed sequence of documents, causal with a left sliding window: what
// upstream gets from FlashAttention-3's flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens,
// max_len, max_len, causal=True, softmax_scale, window_size=(window, 0)). Row i of a document
// attends to row j of the same document iff i - window <= j <= i (FA's window_size=(w, 0):
// w keys to the left plus the row itself). window <= 0, or one at least as long as the sequence,
// means plain causal (FA spells that -1; upstream never passes 0).
//
// Layouts (row-major, bf16 unless said):
//   q, k, v, out, dout, dq, dk, dv  (T, H, D), D = 64 or 128, T a multiple of 16
//   lse                             (H, T) fp32, natural log of each row's softmax denominator
//   cu_seqlens                      int32 document bounds: 0, end of doc 0, end of doc 1, ...; the
//                                   loader pads the tail with T (empty documents), so any count works
// Paired-head layers (upstream layers 0, 2, 5, 9) attend over the same buffers viewed as
// (2T, H/2, D): row 2t+a, head h' is token t's head a*H/2 + h', so head h' pairs model heads h'
// and h' + H/2 along a sequence of twice the length. Pass paired = true with the model's T and H:
// the kernels take that view and double cu_seqlens on the fly; `window` counts rows of the
// doubled sequence, as upstream passes it, and lse is then (H/2, 2T).
//
// The kernels are flash-attention style: a block owns a tile of rows and streams the tiles of
// the other side through shared memory (cp.async, double-buffered), keeping the softmax
// statistics and fp32 accumulators in registers, so no T x T matrix ever exists. Tiles that no
// row of the block can see are never visited; masks are applied only on tiles that straddle the
// diagonal, the window edge or a document bound. Products run on the tensor cores through
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) with ldmatrix fragments from swizzled tiles.
//
// The tile schedule (AttnProblem and the bound functions attn_first_key / attn_last_query)
// is independent of how a tile's products are computed: a Hopper version (wgmma, TMA, warp
// specialization) can take the same problem description and launch API, and these kernels
// remain the reference it is tested against.
//
// Backward: dS = P * (dP - delta) with delta_i = dout_i . out_i, then dq = scale dS k, dk =
// scale dS^T q, dv = P^T dout. Two modes:
//   deterministic (default): one kernel per key tile makes dk, dv; one per query tile makes dq.
//     No atomics, so results are bit-identical from run to run. It recomputes QK^T and dO V^T
//     once more (7 tile products instead of 5); in exchange there is no fp32 dq buffer to zero
//     and convert and none of the fp32 atomics (T*H*D per 64 keys of window) that the other
//     mode spends, which cost the same order of time, so determinism comes nearly free.
//   atomic_dq: the key-tile kernel also adds dq into an fp32 buffer with atomics (order of the
//     additions varies from run to run), then a pass converts it to bf16.
#pragma once
#include "common.cuh"
#include "ptx.cuh"

#include <cstdint>
#include <cstdio>
#include <cstdlib>

enum class AttentionBackwardMode { deterministic, atomic_dq };
// The kernels: mma.sync (any sm_80+ GPU; the reference) or wgmma + TMA (Hopper, attention_wgmma.cuh;
// the same bits under emu). The wgmma backward is the deterministic mode's; atomic_dq is mma.sync only.
enum class AttentionKernel { mma, wgmma };
inline const char* attention_kernel_name(AttentionKernel k) { return k == AttentionKernel::wgmma ? "wgmma" : "mma"; }
// On a GPU, mma.sync: on an H100 the wgmma kernels ran at half its speed at every record shape (forward
// 70-118 vs 139-229 TFLOP/s, backward 67-95 vs 152-246: docs/gpu-runs/2026-11-28-h100-80gb-hbm3-73ba680),
// with the same bits. The CPU build keeps wgmma, whose twins give mma's bits, so that the trainer's tests
// run the wgmma path and the platform guard; --attention chooses either.
inline AttentionKernel default_attention_kernel() { return kEmulated ? AttentionKernel::wgmma : AttentionKernel::mma; }

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kAttnTileRows = 64;  // rows a block owns: 16 per warp (queries; keys in the dk/dv kernel)
constexpr int kAttnTileKeys = 64;  // keys per streamed tile (forward, dq)
constexpr int kAttnBwdQueries = 32;  // queries per streamed tile of the dk/dv kernel: fewer live scores
                                     // keep dk and dv (2 x 16 x D fp32 per warp) in registers
constexpr float kAttnLog2e = 1.4426950408889634f;
constexpr float kAttnLn2 = 0.6931471805599453f;

// What every kernel needs to know about the sequence, in the view the kernel attends over.
struct AttnProblem {
    int T;                  // rows: tokens, or 2 * tokens for paired heads
    int H;                  // heads in that view
    const int* cu_seqlens;  // document bounds in tokens
    int num_cu;             // entries in cu_seqlens
    int cu_mult;            // rows per token: 1, or 2 for paired heads
    int window;             // left window in rows, T when unlimited
    float scale_log2;       // softmax_scale * log2(e): scores are exponentiated with exp2
};

// ---- host side: the checks and setup the launchers share ----
// The view the kernels attend over, after checking what the kernels rely on (`who`: the launcher).
inline AttnProblem attn_problem(const char* who, const int* cu_seqlens, int num_cu_seqlens, int T, int H, int D,
                                int window, bool paired, float softmax_scale) {
    kernel_require(D == 64 || D == 128, "%s: head dim D must be 64 or 128 (D=%d)", who, D);
    kernel_require(T > 0 && T % 16 == 0, "%s: T must be a positive multiple of 16 (T=%d)", who, T);
    kernel_require(H > 0 && (!paired || H % 2 == 0), "%s: H must be positive, and even for paired heads (H=%d)", who,
                   H);
    kernel_require(cu_seqlens != nullptr && num_cu_seqlens >= 1, "%s: cu_seqlens needs at least one entry", who);
    AttnProblem p;
    p.T = paired ? 2 * T : T;
    p.H = paired ? H / 2 : H;
    p.cu_seqlens = cu_seqlens;
    p.num_cu = num_cu_seqlens;
    p.cu_mult = paired ? 2 : 1;
    p.window = window <= 0 || window > p.T ? p.T : window;
    p.scale_log2 = softmax_scale * kAttnLog2e;
    return p;
}

// Raises a kernel's dynamic shared memory limit past the default 48 KB; call once per kernel.
template <class Kernel>
void attn_allow_smem(Kernel* kernel, size_t bytes) {
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

// ---- the tile schedule: which keys a row sees, which queries see a key ----
// The schedule runs on the host too, over a host copy of cu_seqlens, to count the tiles the kernels
// visit (attn_tile_counts); the device reads the bounds through the read-only cache.
__host__ __device__ __forceinline__ int attn_cu_bound(const AttnProblem& p, int i) {
#ifdef __CUDA_ARCH__
    return __ldg(p.cu_seqlens + i);
#else
    return p.cu_seqlens[i];
#endif
}
// Number of document bounds at or before row i.
__host__ __device__ __forceinline__ int attn_bounds_upto(const AttnProblem& p, int i) {
    int lo = 0, hi = p.num_cu;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (attn_cu_bound(p, mid) * p.cu_mult <= i) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}
// The first key row i sees: its document's start or the window's left edge. Non-decreasing in
// i, so a tile of rows needs keys from attn_first_key(first row) on, and every key from there
// to the tile's last row is seen by some row.
__host__ __device__ __forceinline__ int attn_first_key(const AttnProblem& p, int i) {
    const int n = attn_bounds_upto(p, i);
    const int doc_start = n ? attn_cu_bound(p, n - 1) * p.cu_mult : 0;
    return max(doc_start, i - p.window);
}
// The last query that sees key j (its document's end or the window's right edge); also
// non-decreasing, so a tile of keys is seen by queries from its first key to
// attn_last_query(its last key).
__host__ __device__ __forceinline__ int attn_last_query(const AttnProblem& p, int j) {
    const int n = attn_bounds_upto(p, j);
    const int doc_end = n < p.num_cu ? attn_cu_bound(p, n) * p.cu_mult : p.T;
    return min(min(doc_end, p.T) - 1, j + p.window);
}

// The 64-key tiles a tile of rows from q0 visits, from the diagonal tile (keys from q0) down to the
// tile holding the first key its first row sees.
__host__ __device__ __forceinline__ int attn_num_key_tiles(const AttnProblem& p, int q0) {
    return (q0 + kAttnTileKeys - 1 - attn_first_key(p, q0)) / kAttnTileKeys + 1;
}

// ---- the work of a call, for the step profiler (work.cuh) ----
// The tiles one head's kernels visit, walked as they walk them: over the 64-row query tiles, the
// 64-key tiles from the diagonal down to the first key a row sees (forward and dq kernels,
// attn_query_tile's num_tiles); over the 64-key tiles, the 32-query sub-tiles from the diagonal to
// the last query that sees a key (the mma.sync dk/dv kernel), and the 64-query tiles likewise (the
// wgmma one, attention_wgmma.cuh). Counted over cu_seqlens_host, the host copy of
// the bounds; the walk costs two binary searches per tile, so it runs only while the profiler
// records (the counts are 0 otherwise).
struct AttnTileCounts {
    int64_t key_tiles = 0;       // (query tile, key tile) pairs
    int64_t query_subtiles = 0;  // (key tile, 32-query sub-tile) pairs
    int64_t query_tiles = 0;     // (key tile, 64-query tile) pairs
};
inline AttnTileCounts attn_tile_counts(const char* who, AttnProblem p, const int* cu_seqlens_host) {
    AttnTileCounts c;
    if (!work_recorder().on) return c;
    kernel_require(cu_seqlens_host != nullptr, "%s: recording a step needs the host copy of cu_seqlens", who);
    p.cu_seqlens = cu_seqlens_host;
    for (int q0 = 0; q0 < p.T; q0 += kAttnTileRows)
        c.key_tiles += attn_num_key_tiles(p, q0);
    for (int k0 = 0; k0 < p.T; k0 += kAttnTileRows) {
        const int queries = attn_last_query(p, min(k0 + kAttnTileRows, p.T) - 1) - k0;
        c.query_subtiles += queries / kAttnBwdQueries + 1;
        c.query_tiles += queries / kAttnTileRows + 1;
    }
    return c;
}
// bf16 bytes of one of q, k, v, out (T, H, D), and fp32 bytes of lse or delta (H, T), in the view.
inline double attn_rows_bytes(const AttnProblem& p, int D) { return 2.0 * p.T * p.H * D; }
inline double attn_stats_bytes(const AttnProblem& p) { return 4.0 * p.T * p.H; }

// ---- shared-memory tiles and tensor-core fragments ----
// Offset of element (row, col) in a tile of rows of COLS bf16. The 16-byte chunks of a row are
// XOR-permuted by the row so that the 8 rows an ldmatrix reads at one column fall in 8
// different bank groups (unswizzled, rows 128 or 256 bytes apart would all hit the same banks).
template <int COLS>
__device__ __forceinline__ int attn_swz(int row, int col) {
    constexpr int chunks = COLS / 8;
    static_assert(chunks == 4 || chunks == 8 || chunks == 16, "tiles are 32, 64 or 128 columns wide");
    const int key = chunks == 4 ? (row >> 1) & 3 : row & 7;  // 64-byte rows: two rows share 128 bytes
    return row * COLS + (((col >> 3) ^ key) << 3) + (col & 7);
}

// Issues the copies of rows [row0, row0 + ROWS) of head h of a (T, H, D) tensor into a swizzled
// tile; rows outside [0, T) become zeros.
template <int ROWS, int D>
__device__ __forceinline__ void attn_load_rows(__nv_bfloat16* tile, const __nv_bfloat16* x, int row0, int h,
                                               const AttnProblem& p) {
    constexpr int chunks_per_row = D / 8;
    static_assert(ROWS * chunks_per_row % kAttnThreads == 0, "every thread copies the same number of chunks");
#pragma unroll
    for (int i = 0; i < ROWS * chunks_per_row / kAttnThreads; ++i) {
        const int c = threadIdx.x + i * kAttnThreads;
        const int r = c / chunks_per_row, col = (c % chunks_per_row) * 8;
        const int row = row0 + r;
        const bool inside = row >= 0 && row < p.T;
        const __nv_bfloat16* src = x + (size_t(inside ? row : 0) * p.H + h) * D + col;
        cp_async16(tile + attn_swz<D>(r, col), src, inside);
    }
}
// Issues the copies of entries [row0, row0 + kAttnBwdQueries) of head h of an (H, T) fp32 array;
// entries past T become zeros. T % 16 == 0 keeps every 4-entry chunk aligned and all inside or
// all outside.
__device__ __forceinline__ void attn_load_row_stats(float* dst, const float* x, int row0, int h,
                                                    const AttnProblem& p) {
    constexpr int chunks = kAttnBwdQueries / 4;
    if (static_cast<int>(threadIdx.x) < chunks) {
        const int row = row0 + 4 * static_cast<int>(threadIdx.x);
        const bool inside = row < p.T;
        cp_async16(dst + 4 * threadIdx.x, x + size_t(h) * p.T + (inside ? row : 0), inside);
    }
}

// Fragments of a 16x16 block at (r0, c0) of a swizzled tile. Each lane gives one row address:
// "rows first" hands lanes 0-15 rows r0..r0+15 at column c0 and lanes 16-31 the same rows at c0+8;
// "cols first" hands lanes 0-7 rows r0..r0+7 at c0, 8-15 the same rows at c0+8, 16-23 rows
// r0+8..r0+15 at c0, 24-31 those at c0+8. With or without .trans, these orders put the four
// 8x8 matrices where the mma fragment layouts (ptx.cuh) want them:
//   attn_frag_a:   A = tile[r0.., c0..]             (rows are m, columns k)
//   attn_frag_a_t: A = tile[r0.., c0..]^T           (rows are k, columns m)
//   attn_frag_b:   B = tile[r0.., c0..]             (rows are k, columns n): n-tiles c0 and c0+8
//   attn_frag_b_t: B = tile[r0.., c0..]^T           (rows are n, columns k): n-tiles r0 and r0+8
// A B result holds {b0, b1} of the first n-tile, then {b0, b1} of the second.
template <int COLS>
__device__ __forceinline__ const __nv_bfloat16* attn_rows_first(const __nv_bfloat16* tile, int r0, int c0) {
    const int lane = threadIdx.x % 32;
    return tile + attn_swz<COLS>(r0 + (lane & 15), c0 + ((lane >> 4) << 3));
}
template <int COLS>
__device__ __forceinline__ const __nv_bfloat16* attn_cols_first(const __nv_bfloat16* tile, int r0, int c0) {
    const int lane = threadIdx.x % 32;
    return tile + attn_swz<COLS>(r0 + (lane & 7) + ((lane >> 4) << 3), c0 + (((lane >> 3) & 1) << 3));
}
template <int COLS>
__device__ __forceinline__ void attn_frag_a(uint32_t (&a)[4], const __nv_bfloat16* tile, int r0, int c0) {
    ldmatrix<4>(a, attn_rows_first<COLS>(tile, r0, c0));
}
template <int COLS>
__device__ __forceinline__ void attn_frag_a_t(uint32_t (&a)[4], const __nv_bfloat16* tile, int r0, int c0) {
    ldmatrix_trans<4>(a, attn_cols_first<COLS>(tile, r0, c0));
}
template <int COLS>
__device__ __forceinline__ void attn_frag_b(uint32_t (&b)[4], const __nv_bfloat16* tile, int r0, int c0) {
    ldmatrix_trans<4>(b, attn_rows_first<COLS>(tile, r0, c0));
}
template <int COLS>
__device__ __forceinline__ void attn_frag_b_t(uint32_t (&b)[4], const __nv_bfloat16* tile, int r0, int c0) {
    ldmatrix<4>(b, attn_cols_first<COLS>(tile, r0, c0));
}

// c0 += a @ (first n-tile of b), c1 += a @ (second n-tile of b).
__device__ __forceinline__ void attn_mma2(float (&c0)[4], float (&c1)[4], const uint32_t (&a)[4],
                                          const uint32_t (&b)[4]) {
    const uint32_t b0[2] = {b[0], b[1]}, b1[2] = {b[2], b[3]};
    mma_m16n8k16_bf16(c0, a, b0, c0);
    mma_m16n8k16_bf16(c1, a, b1, c1);
}

// The backward's two score products for the warp's 16 rows: c1 = x1 y1^T and c2 = x2 y2^T (zeroed first),
// x1 and x2 tiles of D columns whose rows 16 warp .. 16 warp + 15 are the warp's, y1 and y2 tiles of N rows.
// The x fragments are re-read from shared memory on every call: holding them in registers next to the
// accumulators would spill.
template <int D, int N>
__device__ __forceinline__ void attn_two_products(float (&c1)[N / 8][4], float (&c2)[N / 8][4], const __nv_bfloat16* x1,
                                                  const __nv_bfloat16* x2, const __nv_bfloat16* y1,
                                                  const __nv_bfloat16* y2) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int nt = 0; nt < N / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) c1[nt][e] = c2[nt][e] = 0.0f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t a1[4], a2[4];
        attn_frag_a<D>(a1, x1, 16 * warp, 16 * ks);
        attn_frag_a<D>(a2, x2, 16 * warp, 16 * ks);
#pragma unroll
        for (int np = 0; np < N / 16; ++np) {
            uint32_t b[4];
            attn_frag_b_t<D>(b, y1, 16 * np, 16 * ks);
            attn_mma2(c1[2 * np], c1[2 * np + 1], a1, b);
            attn_frag_b_t<D>(b, y2, 16 * np, 16 * ks);
            attn_mma2(c2[2 * np], c2[2 * np + 1], a2, b);
        }
    }
}

__device__ __forceinline__ uint32_t attn_pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x (lo) is the lower half
    uint32_t r;
    memcpy(&r, &v, sizeof r);
    return r;
}
// The accumulators of n-tiles 2kk and 2kk+1 of a 16 x N product, in the C layout, are exactly the
// A fragment of k-step kk of a product that takes that 16 x N matrix as its left operand.
__device__ __forceinline__ void attn_c_to_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = attn_pack_bf16(c0[0], c0[1]);
    a[1] = attn_pack_bf16(c0[2], c0[3]);
    a[2] = attn_pack_bf16(c1[0], c1[1]);
    a[3] = attn_pack_bf16(c1[2], c1[3]);
}
// acc (the warp's 16 x D, C layout) += x @ tile, with x the warp's 16 x K scores in the C layout (rounded to
// bf16 as the tensor cores take them) and tile K rows of D columns of a swizzled tile.
template <int D, int K>
__device__ __forceinline__ void attn_mma_scores_tile(float (&acc)[D / 8][4], const float (&x)[K / 8][4],
                                                     const __nv_bfloat16* tile) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t a[4];
        attn_c_to_a(a, x[2 * kk], x[2 * kk + 1]);
#pragma unroll
        for (int np = 0; np < D / 16; ++np) {
            uint32_t b[4];
            attn_frag_b<D>(b, tile, 16 * kk, 16 * np);
            attn_mma2(acc[2 * np], acc[2 * np + 1], a, b);
        }
    }
}

// Writes a warp's 16 x D accumulator rows (C layout; rows g scaled by mult_lo, rows g + 8 by
// mult_hi) as bf16 to rows [row0, row0 + 16) of head h of a (T, H, D) tensor. The rows pass
// through the warp's own 16 rows of a swizzled tile so that global stores are 16 bytes wide.
template <int D>
__device__ __forceinline__ void attn_store_rows(__nv_bfloat16* dst, const float (&acc)[D / 8][4], float mult_lo,
                                                float mult_hi, __nv_bfloat16* tile, int row0, int h,
                                                const AttnProblem& p) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    __syncwarp();  // the warp's last reads of these rows are done
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        *reinterpret_cast<uint32_t*>(tile + attn_swz<D>(g, 8 * nt + 2 * t)) =
            attn_pack_bf16(acc[nt][0] * mult_lo, acc[nt][1] * mult_lo);
        *reinterpret_cast<uint32_t*>(tile + attn_swz<D>(g + 8, 8 * nt + 2 * t)) =
            attn_pack_bf16(acc[nt][2] * mult_hi, acc[nt][3] * mult_hi);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 16 * D / 8 / 32; ++i) {
        const int c = lane + 32 * i;
        const int r = c / (D / 8), col = (c % (D / 8)) * 8;
        if (row0 + r < p.T)
            *reinterpret_cast<uint4*>(dst + (size_t(row0 + r) * p.H + h) * D + col) =
                *reinterpret_cast<const uint4*>(tile + attn_swz<D>(r, col));
    }
}

// ---- a query tile's walk over the key tiles (forward and dq kernels) ----
// Block (query tile of 64 rows, head): key tiles stream from the diagonal down, tile n holding keys
// [q0 - n KT, q0 - n KT + KT), to the tile of the first key any row sees. In the C layout a lane holds
// rows g and g + 8 of its warp's 16: row_lo and row_hi.
struct AttnQueryTile {
    int q0;                                  // the tile's first row
    int num_tiles;                           // key tiles to visit
    int unmasked_from;                       // below the diagonal, tiles from this key on need no mask
    int row_lo, row_hi, first_lo, first_hi;  // the lane's two rows and the first key each sees

    // Whether key tile n (keys from k0) needs the mask.
    __device__ __forceinline__ bool masked(int n, int k0) const { return n == 0 || k0 < unmasked_from; }
    // Whether `key` is hidden from the row of C-layout element e (e < 2: row_lo, else row_hi).
    __device__ __forceinline__ bool hidden(int key, int e) const {
        const int row = e < 2 ? row_lo : row_hi, first = e < 2 ? first_lo : first_hi;
        return key > row || key < first;
    }
};
// The tiles of 64 rows from q0 on (warp `warp`'s 16 of them for the lane's two rows).
__device__ __forceinline__ AttnQueryTile attn_query_tile_at(const AttnProblem& p, int q0, int warp, int lane) {
    AttnQueryTile qt;
    qt.q0 = q0;
    const int q_last = min(qt.q0 + kAttnTileRows, p.T) - 1;
    qt.num_tiles = attn_num_key_tiles(p, qt.q0);
    qt.unmasked_from = attn_first_key(p, q_last);
    qt.row_lo = qt.q0 + 16 * warp + lane / 4;
    qt.row_hi = qt.row_lo + 8;
    qt.first_lo = attn_first_key(p, qt.row_lo);
    qt.first_hi = attn_first_key(p, qt.row_hi);
    return qt;
}
__device__ __forceinline__ AttnQueryTile attn_query_tile(const AttnProblem& p) {
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kAttnTileRows;  // rows with the most keys start first
    return attn_query_tile_at(p, q0, threadIdx.x / 32, threadIdx.x % 32);
}
// Before key tile n (keys from k0, stage n & 1): issues the copies of tile n + 1 into the other stage
// (released by the barrier that ended tile n - 1), then waits until tile n's K and V are in place.
template <int D>
__device__ __forceinline__ void attn_wait_kv_tile(__nv_bfloat16* sK, __nv_bfloat16* sV, const __nv_bfloat16* k,
                                                  const __nv_bfloat16* v, int n, int k0, const AttnQueryTile& qt, int h,
                                                  const AttnProblem& p) {
    constexpr int KT = kAttnTileKeys;
    if (n + 1 < qt.num_tiles) {
        const int other = (n & 1) ^ 1;
        attn_load_rows<KT, D>(sK + other * KT * D, k, k0 - KT, h, p);
        attn_load_rows<KT, D>(sV + other * KT * D, v, k0 - KT, h, p);
        cp_async_commit();
        cp_async_wait<1>();
    } else {
        cp_async_wait<0>();
    }
    __syncthreads();
}

// ---- the element-wise steps of a query tile, shared by the mma.sync and wgmma kernels ----
// `s(i, e)` is the lane's score e (C layout: rows row_lo for e < 2, else row_hi; key 8i + 2t + (e & 1)
// of the tile) for i < 8: the mma kernels' s[i][e], the wgmma kernels' s[4i + e].
//
// Online softmax in log2 units over key tile n (keys from k0): the scores become p = exp2(x - max),
// the running max m and partial sums l move on, and alpha is what the accumulated output must be
// rescaled by, exp2(m_old - m_new).
template <class Scores>
__device__ __forceinline__ void attn_softmax_tile(Scores s, float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                  const AttnQueryTile& qt, int n, int k0, const AttnProblem& p) {
    const int t = threadIdx.x % 4;
    const bool masked = qt.masked(n, k0);
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kAttnTileKeys / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float x = s(i, e) * p.scale_log2;
            if (masked) {
                if (qt.hidden(k0 + 8 * i + 2 * t + (e & 1), e)) x = -INFINITY;
            }
            s(i, e) = x;
            tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
        }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the 4 lanes of a quad hold one row between them
        tile_max[r] = warp_butterfly<WarpMax, 2>(tile_max[r]);
        const float m_new = fmaxf(m[r], tile_max[r]);
        base[r] = m_new == -INFINITY ? 0.0f : m_new;  // a row with nothing visible yet stays at zero, not NaN
        alpha[r] = exp2f(m[r] - base[r]);
        m[r] = m_new;
        l[r] *= alpha[r];
    }
#pragma unroll
    for (int i = 0; i < kAttnTileKeys / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            s(i, e) = exp2f(s(i, e) - base[e >> 1]);
            l[e >> 1] += s(i, e);
        }
    }
}
// After the last tile: each row's lse (natural log) written, and 1 / sum returned in inv.
__device__ __forceinline__ void attn_finish_rows(float (&inv)[2], float* lse, float (&l)[2], const float (&m)[2],
                                                 const AttnQueryTile& qt, int h, const AttnProblem& p) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = warp_butterfly<WarpSum, 2>(l[r]);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int row = r == 0 ? qt.row_lo : qt.row_hi;
        if (t == 0 && row < p.T)
            lse[size_t(h) * p.T + row] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * kAttnLn2 : -INFINITY;
    }
}
// The dq kernels' per-row terms: lse in log2 units and delta, of the lane's rows row_lo and row_hi
// (rows past T are never stored; reading index 0 keeps their loads inside the arrays).
__device__ __forceinline__ void attn_row_stats(float (&lse2)[2], float (&delta_row)[2], const float* lse,
                                               const float* delta, const AttnQueryTile& qt, int h,
                                               const AttnProblem& p) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? qt.row_lo : qt.row_hi;
        lse2[r] = __ldg(lse + size_t(h) * p.T + (row < p.T ? row : 0)) * kAttnLog2e;
        delta_row[r] = __ldg(delta + size_t(h) * p.T + (row < p.T ? row : 0));
    }
}
// The dq kernels' step on key tile n: ds = p * (dp - delta), p from the saved lse (log2 units, per row);
// `s(i, e)` the scores, `dp(i, e)` dout v^T, which becomes ds.
template <class Scores, class Dp>
__device__ __forceinline__ void attn_ds_query_tile(Scores s, Dp dp, const float (&lse2)[2], const float (&delta)[2],
                                                   const AttnQueryTile& qt, int n, int k0, const AttnProblem& p) {
    const int t = threadIdx.x % 4;
    const bool masked = qt.masked(n, k0);
#pragma unroll
    for (int i = 0; i < kAttnTileKeys / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            float pv = exp2f(s(i, e) * p.scale_log2 - lse2[e >> 1]);
            if (masked) {
                if (qt.hidden(k0 + 8 * i + 2 * t + (e & 1), e)) pv = 0.0f;
            }
            dp(i, e) = pv * (dp(i, e) - delta[e >> 1]);
        }
    }
}

// The dk/dv kernels' step on the Q queries from qa: `st(i, e)` (k q^T, C layout: keys by rows, query
// 8i + 2t + (e & 1) of the tile) becomes p^T from the saved lse, `dpt(i, e)` (v dout^T) becomes
// ds^T = p^T * (dp^T - delta); tLse and tDelta hold the tile's Q entries. The lane's keys key_lo
// (e < 2) and key_hi are seen by queries up to last_lo and last_hi; `masked`: whether to apply that.
// The wgmma kernel's; the mma.sync one writes the same out (its registers are at the ceiling).
template <int Q, class St, class Dpt>
__device__ __forceinline__ void attn_ds_key_tile(St st, Dpt dpt, const float* tLse, const float* tDelta, int qa,
                                                 bool masked, int key_lo, int key_hi, int last_lo, int last_hi,
                                                 const AttnProblem& p) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < Q / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int col = 8 * i + 2 * t + (e & 1);
            float pt = exp2f(st(i, e) * p.scale_log2 - tLse[col] * kAttnLog2e);
            if (masked) {
                const int query = qa + col;
                const int key = e < 2 ? key_lo : key_hi, last = e < 2 ? last_lo : last_hi;
                if (query < key || query > last) pt = 0.0f;
            }
            st(i, e) = pt;
            dpt(i, e) = pt * (dpt(i, e) - tDelta[col]);
        }
    }
}

// ---- forward ----
// Block (query tile of 64 rows, head): out rows = softmax(scale q k^T + mask) v, lse rows.
// Key tiles stream from the diagonal down to the tile holding the first key any row sees, so
// the first tile gives every row a finite running max (each row sees itself).
template <int D>
constexpr size_t attention_forward_smem_bytes() {
    return size_t(kAttnTileRows + 4 * kAttnTileKeys) * D * sizeof(__nv_bfloat16);  // Q, 2 stages of K and V
}

template <int D>
__global__ void __launch_bounds__(kAttnThreads)
    attention_forward_kernel(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const __nv_bfloat16* v, AttnProblem p) {
    static_assert(kAttnTileRows == kAttnTileKeys, "key tiles are aligned with query tiles at the diagonal");
    constexpr int KT = kAttnTileKeys;
    __nv_bfloat16* sQ = dynamic_smem<__nv_bfloat16>();
    __nv_bfloat16* sK = sQ + kAttnTileRows * D;  // stage s at sK + s * KT * D
    __nv_bfloat16* sV = sK + 2 * KT * D;
    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const AttnQueryTile qt = attn_query_tile(p);
    const int q0 = qt.q0;

    attn_load_rows<kAttnTileRows, D>(sQ, q, q0, h, p);
    attn_load_rows<KT, D>(sK, k, q0, h, p);
    attn_load_rows<KT, D>(sV, v, q0, h, p);
    cp_async_commit();

    uint32_t qf[D / 16][4];  // the warp's 16 query rows stay in registers for the whole key stream
    float o[D / 8][4];
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units) and partial sum per row
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;

    for (int n = 0; n < qt.num_tiles; ++n) {
        const int stage = n & 1, k0 = q0 - n * KT;
        attn_wait_kv_tile<D>(sK, sV, k, v, n, k0, qt, h, p);
        const __nv_bfloat16* tK = sK + stage * KT * D;
        const __nv_bfloat16* tV = sV + stage * KT * D;
        if (n == 0) {
#pragma unroll
            for (int ks = 0; ks < D / 16; ++ks) attn_frag_a<D>(qf[ks], sQ, 16 * warp, 16 * ks);
        }

        // s = q k^T for the warp's 16 rows and the tile's keys
        float s[KT / 8][4];
#pragma unroll
        for (int nt = 0; nt < KT / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
            for (int np = 0; np < KT / 16; ++np) {
                uint32_t b[4];
                attn_frag_b_t<D>(b, tK, 16 * np, 16 * ks);
                attn_mma2(s[2 * np], s[2 * np + 1], qf[ks], b);
            }
        }

        // online softmax in log2 units: rescale what was accumulated by exp2(m_old - m_new)
        float alpha[2];
        attn_softmax_tile([&](int i, int e) -> float& { return s[i][e]; }, m, l, alpha, qt, n, k0, p);
#pragma unroll
        for (int nt = 0; nt < D / 8; ++nt) {
            o[nt][0] *= alpha[0];
            o[nt][1] *= alpha[0];
            o[nt][2] *= alpha[1];
            o[nt][3] *= alpha[1];
        }

        // o += p v, p rounded to bf16 as the tensor cores take it
        attn_mma_scores_tile<D, KT>(o, s, tV);
        __syncthreads();  // this stage is free for the prefetch of tile n + 2
    }

    float inv[2];
    attn_finish_rows(inv, lse, l, m, qt, h, p);
    // Q's rows are in registers since tile 0, so each warp reuses its own 16 rows of sQ.
    attn_store_rows<D>(out, o, inv[0], inv[1], sQ + 16 * warp * D, q0 + 16 * warp, h, p);
}

// D is a template argument so that every fragment loop unrolls into straight-line mma code.
template <int D>
void attention_forward_d(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                         const __nv_bfloat16* v, const AttnProblem& p, const Work& work, cudaStream_t stream) {
    constexpr size_t smem = attention_forward_smem_bytes<D>();
    static const bool configured = (attn_allow_smem(attention_forward_kernel<D>, smem), true);
    (void)configured;
    launch(work, attention_forward_kernel<D>, dim3(ceil_div(p.T, kAttnTileRows), p.H), dim3(kAttnThreads), smem,
           stream, out, lse, q, k, v, p);
}

#include "attention_wgmma.cuh"  // the Hopper forward: uses the tile walk and helpers above

// Per visited (query tile, key tile) pair and head, the products q k^T and p v and the softmax's 4
// operations per score; reads q, k, v and the bounds, writes out and lse.
inline Work attention_forward_work(const AttnProblem& p, int D, const AttnTileCounts& c) {
    const double scores = static_cast<double>(c.key_tiles) * p.H * kAttnTileRows * kAttnTileKeys;
    return Work{.name = "attention_forward", .tc_flops = 2 * 2 * scores * D, .flops = 4 * scores,
                .bytes_read = 3 * attn_rows_bytes(p, D) + 4.0 * p.num_cu,
                .bytes_written = attn_rows_bytes(p, D) + attn_stats_bytes(p)};
}

// out (T, H, D) bf16 = attention(q, k, v); lse (H, T) fp32 for the backward (for paired heads:
// (H/2, 2T), the same H*T floats). Upstream's softmax_scale is YaRN's attn_scale, not 1/sqrt(D).
// cu_seqlens_host: the host copy of cu_seqlens, which the step profiler needs to count the tiles
// (required while it records, unused otherwise). `kernel` picks the implementation; both visit the
// same tiles, so they share the Work.
inline void attention_forward(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                              const __nv_bfloat16* v, const int* cu_seqlens, int num_cu_seqlens, int T, int H, int D,
                              int window, bool paired, float softmax_scale, cudaStream_t stream,
                              const int* cu_seqlens_host = nullptr, AttentionKernel kernel = AttentionKernel::mma) {
    const AttnProblem p =
        attn_problem("attention_forward", cu_seqlens, num_cu_seqlens, T, H, D, window, paired, softmax_scale);
    kernel_require(all_aligned16({out, lse, q, k, v}), "attention_forward: tensors must be 16-byte aligned");
    const Work work = attention_forward_work(p, D, attn_tile_counts("attention_forward", p, cu_seqlens_host));
    if (kernel == AttentionKernel::wgmma) {
        if (D == 64) attention_forward_wgmma_d<64>(out, lse, q, k, v, p, work, stream);
        else attention_forward_wgmma_d<128>(out, lse, q, k, v, p, work, stream);
    } else {
        if (D == 64) attention_forward_d<64>(out, lse, q, k, v, p, work, stream);
        else attention_forward_d<128>(out, lse, q, k, v, p, work, stream);
    }
}

// ---- backward ----
// delta (H, T) fp32: delta_i = dout_i . out_i, the row term of dS = P * (dP - delta).
// A group of D/8 lanes covers one (row, head) with one 16-byte load of each tensor per lane.
template <int D>
__global__ void attention_backward_delta_kernel(float* delta, const __nv_bfloat16* dout, const __nv_bfloat16* out,
                                                int T, int H) {
    constexpr int G = D / 8;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    const int pair = idx / G, c = idx % G;  // pair = row * H + head, the order of memory
    float s = 0.0f;
    if (pair < T * H) {
        const Pack128<__nv_bfloat16> a = load128(dout + size_t(pair) * D + 8 * c);
        const Pack128<__nv_bfloat16> b = load128(out + size_t(pair) * D + 8 * c);
#pragma unroll
        for (int i = 0; i < 8; ++i) s += __bfloat162float(a[i]) * __bfloat162float(b[i]);
    }
    s = warp_butterfly<WarpSum, G / 2>(s);
    if (c == 0 && pair < T * H) delta[size_t(pair % H) * T + pair / H] = s;
}

// Block (key tile of 64 keys, head): dk, dv of those keys over every query that sees them, in
// query tiles of 32. Each warp owns 16 keys and works on transposed scores (keys x queries),
// so dk and dv accumulate in its registers. With ATOMIC_DQ the block also adds its share of dq
// (dS @ k over its keys) into the fp32 dq_accum with atomics.
template <int D, bool ATOMIC_DQ>
constexpr size_t attention_backward_dkdv_smem_bytes() {
    return size_t(2 * kAttnTileRows + 4 * kAttnBwdQueries) * D * sizeof(__nv_bfloat16)  // K, V, 2 stages of Q, dO
           + 4 * kAttnBwdQueries * sizeof(float)                                        // 2 stages of lse, delta
           + (ATOMIC_DQ ? kAttnTileRows * kAttnBwdQueries * sizeof(__nv_bfloat16) : 0);  // dS^T
}

template <int D, bool ATOMIC_DQ>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dkdv_kernel(__nv_bfloat16* dk, __nv_bfloat16* dv, float* dq_accum, const __nv_bfloat16* q,
                                   const __nv_bfloat16* k, const __nv_bfloat16* v, const __nv_bfloat16* dout,
                                   const float* lse, const float* delta, AttnProblem p) {
    constexpr int QT = kAttnBwdQueries, KR = kAttnTileRows;
    __nv_bfloat16* sK = dynamic_smem<__nv_bfloat16>();
    __nv_bfloat16* sV = sK + KR * D;
    __nv_bfloat16* sQ = sV + KR * D;     // stage s at sQ + s * QT * D
    __nv_bfloat16* sdO = sQ + 2 * QT * D;
    float* sLse = reinterpret_cast<float*>(sdO + 2 * QT * D);  // stage s at sLse + s * QT
    float* sDelta = sLse + 2 * QT;
    __nv_bfloat16* sdS = reinterpret_cast<__nv_bfloat16*>(sDelta + 2 * QT);  // KR x QT, ATOMIC_DQ only
    const int h = blockIdx.y;
    const int k0 = blockIdx.x * KR;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int k_last = min(k0 + KR, p.T) - 1;
    const int q_end = attn_last_query(p, k_last);
    const int unmasked_to = attn_last_query(p, k0);  // queries in [k0 + KR - 1, unmasked_to] see every key
    const int num_tiles = (q_end - k0) / QT + 1;      // tile n holds queries [k0 + n QT, k0 + n QT + QT)
    const int key_lo = k0 + 16 * warp + g, key_hi = key_lo + 8;
    const int last_lo = attn_last_query(p, key_lo), last_hi = attn_last_query(p, key_hi);

    attn_load_rows<KR, D>(sK, k, k0, h, p);
    attn_load_rows<KR, D>(sV, v, k0, h, p);
    attn_load_rows<QT, D>(sQ, q, k0, h, p);
    attn_load_rows<QT, D>(sdO, dout, k0, h, p);
    attn_load_row_stats(sLse, lse, k0, h, p);
    attn_load_row_stats(sDelta, delta, k0, h, p);
    cp_async_commit();

    float dk_acc[D / 8][4], dv_acc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[nt][e] = dv_acc[nt][e] = 0.0f;

    for (int n = 0; n < num_tiles; ++n) {
        const int stage = n & 1, qa = k0 + n * QT;
        if (n + 1 < num_tiles) {
            const int s1 = stage ^ 1;
            attn_load_rows<QT, D>(sQ + s1 * QT * D, q, qa + QT, h, p);
            attn_load_rows<QT, D>(sdO + s1 * QT * D, dout, qa + QT, h, p);
            attn_load_row_stats(sLse + s1 * QT, lse, qa + QT, h, p);
            attn_load_row_stats(sDelta + s1 * QT, delta, qa + QT, h, p);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const __nv_bfloat16* tQ = sQ + stage * QT * D;
        const __nv_bfloat16* tdO = sdO + stage * QT * D;
        const float* tLse = sLse + stage * QT;
        const float* tDelta = sDelta + stage * QT;

        // s^T = k q^T and dp^T = v dout^T for the warp's 16 keys and the tile's queries
        float st[QT / 8][4], dpt[QT / 8][4];
        attn_two_products<D, QT>(st, dpt, sK, sV, tQ, tdO);

        // p^T from the saved lse; ds^T = p^T * (dp^T - delta); st becomes p^T, dpt becomes ds^T
        // (written out, not through attn_ds_key_tile: this kernel sits at the 255-register ceiling, and
        // the shared version's inlining costs it a spill)
        const bool masked = qa < k0 + KR - 1 || qa + QT - 1 > unmasked_to;
#pragma unroll
        for (int nt = 0; nt < QT / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = 8 * nt + 2 * t + (e & 1);
                float pt = exp2f(st[nt][e] * p.scale_log2 - tLse[col] * kAttnLog2e);
                if (masked) {
                    const int query = qa + col;
                    const int key = e < 2 ? key_lo : key_hi, last = e < 2 ? last_lo : last_hi;
                    if (query < key || query > last) pt = 0.0f;
                }
                st[nt][e] = pt;
                dpt[nt][e] = pt * (dpt[nt][e] - tDelta[col]);
            }
        }

        // dv += p^T dout, dk += ds^T q (the scale is applied once at the end)
#pragma unroll
        for (int kk = 0; kk < QT / 16; ++kk) {
            uint32_t ap[4], ads[4];
            attn_c_to_a(ap, st[2 * kk], st[2 * kk + 1]);
            attn_c_to_a(ads, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
            for (int np = 0; np < D / 16; ++np) {
                uint32_t b[4];
                attn_frag_b<D>(b, tdO, 16 * kk, 16 * np);
                attn_mma2(dv_acc[2 * np], dv_acc[2 * np + 1], ap, b);
                attn_frag_b<D>(b, tQ, 16 * kk, 16 * np);
                attn_mma2(dk_acc[2 * np], dk_acc[2 * np + 1], ads, b);
            }
        }

        if constexpr (ATOMIC_DQ) {
            // dq needs a sum over all 64 keys, spread over 4 warps: ds^T goes through shared
            // memory, then warp w makes queries 16 (w % 2).. and half (w / 2) of the dims.
#pragma unroll
            for (int nt = 0; nt < QT / 8; ++nt) {
                *reinterpret_cast<uint32_t*>(sdS + attn_swz<QT>(16 * warp + g, 8 * nt + 2 * t)) =
                    attn_pack_bf16(dpt[nt][0], dpt[nt][1]);
                *reinterpret_cast<uint32_t*>(sdS + attn_swz<QT>(16 * warp + g + 8, 8 * nt + 2 * t)) =
                    attn_pack_bf16(dpt[nt][2], dpt[nt][3]);
            }
            __syncthreads();
            constexpr int DH = D / 2;
            const int qw = 16 * (warp & 1), dw = DH * (warp >> 1);
            float dq_part[DH / 8][4];
#pragma unroll
            for (int nt = 0; nt < DH / 8; ++nt) dq_part[nt][0] = dq_part[nt][1] = dq_part[nt][2] = dq_part[nt][3] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < KR / 16; ++kk) {
                uint32_t a[4];
                attn_frag_a_t<QT>(a, sdS, 16 * kk, qw);
#pragma unroll
                for (int np = 0; np < DH / 16; ++np) {
                    uint32_t b[4];
                    attn_frag_b<D>(b, sK, 16 * kk, dw + 16 * np);
                    attn_mma2(dq_part[2 * np], dq_part[2 * np + 1], a, b);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int query = qa + qw + g + 8 * r;
                if (query < p.T) {
                    float* row = dq_accum + (size_t(query) * p.H + h) * D + dw + 2 * t;
#pragma unroll
                    for (int nt = 0; nt < DH / 8; ++nt) {
                        atomicAdd(row + 8 * nt, dq_part[nt][2 * r]);
                        atomicAdd(row + 8 * nt + 1, dq_part[nt][2 * r + 1]);
                    }
                }
            }
        }
        __syncthreads();  // this stage (and sdS) is free for the next tile
    }

    const float scale = p.scale_log2 / kAttnLog2e;
    attn_store_rows<D>(dk, dk_acc, scale, scale, sK + 16 * warp * D, k0 + 16 * warp, h, p);
    attn_store_rows<D>(dv, dv_acc, 1.0f, 1.0f, sV + 16 * warp * D, k0 + 16 * warp, h, p);
}

// Block (query tile of 64 rows, head): dq = scale * sum over visible keys of ds k, streaming key
// tiles as the forward does. Deterministic: each dq row is summed by one warp in a fixed order.
template <int D>
constexpr size_t attention_backward_dq_smem_bytes() {
    return size_t(2 * kAttnTileRows + 4 * kAttnTileKeys) * D * sizeof(__nv_bfloat16);  // Q, dO, 2 stages of K, V
}

template <int D>
__global__ void __launch_bounds__(kAttnThreads)
    attention_backward_dq_kernel(__nv_bfloat16* dq, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                 const __nv_bfloat16* v, const __nv_bfloat16* dout, const float* lse,
                                 const float* delta, AttnProblem p) {
    constexpr int KT = kAttnTileKeys;
    __nv_bfloat16* sQ = dynamic_smem<__nv_bfloat16>();
    __nv_bfloat16* sdO = sQ + kAttnTileRows * D;
    __nv_bfloat16* sK = sdO + kAttnTileRows * D;  // stage s at sK + s * KT * D
    __nv_bfloat16* sV = sK + 2 * KT * D;
    const int h = blockIdx.y;
    const int warp = threadIdx.x / 32;
    const AttnQueryTile qt = attn_query_tile(p);
    const int q0 = qt.q0;
    float lse2[2], delta_row[2];
    attn_row_stats(lse2, delta_row, lse, delta, qt, h, p);

    attn_load_rows<kAttnTileRows, D>(sQ, q, q0, h, p);
    attn_load_rows<kAttnTileRows, D>(sdO, dout, q0, h, p);
    attn_load_rows<KT, D>(sK, k, q0, h, p);
    attn_load_rows<KT, D>(sV, v, q0, h, p);
    cp_async_commit();

    float dq_acc[D / 8][4];
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) dq_acc[nt][0] = dq_acc[nt][1] = dq_acc[nt][2] = dq_acc[nt][3] = 0.0f;

    for (int n = 0; n < qt.num_tiles; ++n) {
        const int stage = n & 1, k0 = q0 - n * KT;
        attn_wait_kv_tile<D>(sK, sV, k, v, n, k0, qt, h, p);
        const __nv_bfloat16* tK = sK + stage * KT * D;
        const __nv_bfloat16* tV = sV + stage * KT * D;

        // s = q k^T and dp = dout v^T for the warp's 16 rows and the tile's keys
        float s[KT / 8][4], dp[KT / 8][4];
        attn_two_products<D, KT>(s, dp, sQ, sdO, tK, tV);

        // ds = p * (dp - delta) with p from the saved lse; dp becomes ds
        attn_ds_query_tile([&](int i, int e) -> float& { return s[i][e]; },
                           [&](int i, int e) -> float& { return dp[i][e]; }, lse2, delta_row, qt, n, k0, p);

        // dq += ds k
        attn_mma_scores_tile<D, KT>(dq_acc, dp, tK);
        __syncthreads();
    }

    const float scale = p.scale_log2 / kAttnLog2e;
    // a warp reads only its own 16 rows of sQ, so it can stage its dq rows there
    attn_store_rows<D>(dq, dq_acc, scale, scale, sQ + 16 * warp * D, q0 + 16 * warp, h, p);
}

// dq (bf16) = scale * dq_accum (fp32), 8 elements per thread.
__global__ void attention_backward_dq_convert_kernel(__nv_bfloat16* dq, const float* dq_accum, float scale,
                                                     size_t n8) {
    const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (i >= n8) return;
    const Pack128<float> lo = load128(dq_accum + 8 * i), hi = load128(dq_accum + 8 * i + 4);
    Pack128<__nv_bfloat16> r;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        r[j] = __float2bfloat16(lo[j] * scale);
        r[4 + j] = __float2bfloat16(hi[j] * scale);
    }
    store128(dq + 8 * i, r);
}

// Scratch the backward needs, in bytes: delta (H*T fp32), plus for atomic_dq the fp32 dq sum.
// The dq sum follows delta, whose size is rounded up so that the sum starts 256-byte aligned.
inline size_t attn_delta_bytes(int T, int H) { return ceil_div<size_t>(size_t(T) * H * sizeof(float), 256) * 256; }
inline size_t attention_backward_workspace_bytes(int T, int H, int D,
                                                 AttentionBackwardMode mode = AttentionBackwardMode::deterministic) {
    return attn_delta_bytes(T, H) + (mode == AttentionBackwardMode::atomic_dq ? size_t(T) * H * D * sizeof(float) : 0);
}

// The Work of attention_backward's kernels, all named attention_backward. delta: a multiply-add per
// element of dout; reads dout and out, writes delta.
inline Work attention_backward_delta_work(const AttnProblem& p, int D) {
    return Work{.name = "attention_backward", .flops = 2.0 * p.T * p.H * D, .bytes_read = 2 * attn_rows_bytes(p, D),
                .bytes_written = attn_stats_bytes(p)};
}
// dk and dv: per visited (key tile, query sub-tile) pair and head, the products k q^T, v dout^T,
// p^T dout and ds^T q (atomic_dq: also ds k, added into the fp32 dq sum) and 4 operations per score;
// reads q, k, v, dout, lse, delta and the bounds, writes dk and dv (atomic_dq: reads and writes the sum).
// The wgmma kernel's sub-tiles are its 64-query tiles.
inline Work attention_backward_dkdv_work(const AttnProblem& p, int D, const AttnTileCounts& c, bool atomic_dq,
                                         AttentionKernel kernel = AttentionKernel::mma) {
    const bool wg = kernel == AttentionKernel::wgmma;
    const double scores = static_cast<double>(wg ? c.query_tiles : c.query_subtiles) * p.H * kAttnTileRows *
                          (wg ? kAttnTileRows : kAttnBwdQueries);
    const double dq_sum = atomic_dq ? 2 * attn_rows_bytes(p, D) : 0;  // fp32: twice the bf16 bytes
    return Work{.name = "attention_backward", .tc_flops = (atomic_dq ? 5 : 4) * 2 * scores * D, .flops = 4 * scores,
                .bytes_read = 4 * attn_rows_bytes(p, D) + 2 * attn_stats_bytes(p) + 4.0 * p.num_cu + dq_sum,
                .bytes_written = 2 * attn_rows_bytes(p, D) + dq_sum};
}
// dq: per visited (query tile, key tile) pair and head, the products q k^T, dout v^T and ds k and 4
// operations per score; reads q, k, v, dout, lse, delta and the bounds, writes dq.
inline Work attention_backward_dq_work(const AttnProblem& p, int D, const AttnTileCounts& c) {
    const double scores = static_cast<double>(c.key_tiles) * p.H * kAttnTileRows * kAttnTileKeys;
    return Work{.name = "attention_backward", .tc_flops = 3 * 2 * scores * D, .flops = 4 * scores,
                .bytes_read = 4 * attn_rows_bytes(p, D) + 2 * attn_stats_bytes(p) + 4.0 * p.num_cu,
                .bytes_written = attn_rows_bytes(p, D)};
}
// atomic_dq's last pass: reads the fp32 dq sum, writes dq, a multiply per element.
inline Work attention_backward_dq_convert_work(const AttnProblem& p, int D) {
    return Work{.name = "attention_backward", .flops = 1.0 * p.T * p.H * D, .bytes_read = 2 * attn_rows_bytes(p, D),
                .bytes_written = attn_rows_bytes(p, D)};
}

template <int D>
void attention_backward_d(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                          const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q,
                          const __nv_bfloat16* k, const __nv_bfloat16* v, const AttnProblem& p,
                          const AttnTileCounts& counts, void* workspace, cudaStream_t stream,
                          AttentionBackwardMode mode, AttentionKernel kernel) {
    const int tiles = ceil_div(p.T, kAttnTileRows);
    float* delta = static_cast<float*>(workspace);
    const int delta_threads = p.T * p.H * (D / 8);
    launch(attention_backward_delta_work(p, D), attention_backward_delta_kernel<D>, dim3(ceil_div(delta_threads, 256)),
           dim3(256), 0, stream, delta, dout, out, p.T, p.H);
    if (kernel == AttentionKernel::wgmma) {
        attention_backward_wgmma_d<D>(dq, dk, dv, dout, lse, delta, q, k, v, p,
                                      attention_backward_dkdv_work(p, D, counts, false, kernel),
                                      attention_backward_dq_work(p, D, counts), stream);
    } else if (mode == AttentionBackwardMode::deterministic) {
        constexpr size_t smem_kv = attention_backward_dkdv_smem_bytes<D, false>();
        constexpr size_t smem_q = attention_backward_dq_smem_bytes<D>();
        static const bool configured = (attn_allow_smem(attention_backward_dkdv_kernel<D, false>, smem_kv),
                                        attn_allow_smem(attention_backward_dq_kernel<D>, smem_q), true);
        (void)configured;
        launch(attention_backward_dkdv_work(p, D, counts, false), attention_backward_dkdv_kernel<D, false>,
               dim3(tiles, p.H), dim3(kAttnThreads), smem_kv, stream, dk, dv, static_cast<float*>(nullptr), q, k, v,
               dout, lse, static_cast<const float*>(delta), p);
        launch(attention_backward_dq_work(p, D, counts), attention_backward_dq_kernel<D>, dim3(tiles, p.H),
               dim3(kAttnThreads), smem_q, stream, dq, q, k, v, dout, lse, static_cast<const float*>(delta), p);
    } else {
        constexpr size_t smem_kv = attention_backward_dkdv_smem_bytes<D, true>();
        static const bool configured = (attn_allow_smem(attention_backward_dkdv_kernel<D, true>, smem_kv), true);
        (void)configured;
        const size_t n = size_t(p.T) * p.H * D;
        float* dq_accum = reinterpret_cast<float*>(static_cast<char*>(workspace) + attn_delta_bytes(p.T, p.H));
        CUDA_CHECK(memset_async(dq_accum, 0, n * sizeof(float), stream));
        launch(attention_backward_dkdv_work(p, D, counts, true), attention_backward_dkdv_kernel<D, true>,
               dim3(tiles, p.H), dim3(kAttnThreads), smem_kv, stream, dk, dv, dq_accum, q, k, v, dout, lse,
               static_cast<const float*>(delta), p);
        launch(attention_backward_dq_convert_work(p, D), attention_backward_dq_convert_kernel,
               dim3(static_cast<unsigned>(ceil_div<size_t>(n / 8, 256))), dim3(256), 0, stream, dq,
               static_cast<const float*>(dq_accum), p.scale_log2 / kAttnLog2e, n / 8);
    }
}

// dq, dk, dv (T, H, D) bf16 from dout, the forward's out and lse, and its inputs; same shapes,
// flags and scale as the forward call. `workspace` holds attention_backward_workspace_bytes(T,
// H, D, mode) bytes, 16-byte aligned, owned by the caller. cu_seqlens_host: as for the forward.
inline void attention_backward(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                               const __nv_bfloat16* out, const float* lse, const __nv_bfloat16* q,
                               const __nv_bfloat16* k, const __nv_bfloat16* v, const int* cu_seqlens,
                               int num_cu_seqlens, int T, int H, int D, int window, bool paired, float softmax_scale,
                               void* workspace, size_t workspace_bytes, cudaStream_t stream,
                               AttentionBackwardMode mode = AttentionBackwardMode::deterministic,
                               const int* cu_seqlens_host = nullptr, AttentionKernel kernel = AttentionKernel::mma) {
    kernel_require(kernel == AttentionKernel::mma || mode == AttentionBackwardMode::deterministic,
                   "attention_backward: the wgmma backward is deterministic only (atomic_dq runs on mma.sync)");
    const AttnProblem p =
        attn_problem("attention_backward", cu_seqlens, num_cu_seqlens, T, H, D, window, paired, softmax_scale);
    kernel_require(workspace_bytes >= attention_backward_workspace_bytes(T, H, D, mode),
                   "attention_backward: workspace smaller than attention_backward_workspace_bytes()");
    kernel_require(all_aligned16({dq, dk, dv, dout, out, lse, q, k, v, workspace}),
                   "attention_backward: tensors and workspace must be 16-byte aligned");
    const AttnTileCounts counts = attn_tile_counts("attention_backward", p, cu_seqlens_host);
    if (D == 64)
        attention_backward_d<64>(dq, dk, dv, dout, out, lse, q, k, v, p, counts, workspace, stream, mode, kernel);
    else attention_backward_d<128>(dq, dk, dv, dout, out, lse, q, k, v, p, counts, workspace, stream, mode, kernel);
}
