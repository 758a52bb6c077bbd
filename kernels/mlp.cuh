// The ReLU^2 MLP, out = relu(x @ c_fc^T)^2 @ c_proj: one tensor-core GEMM that writes both the
// pre-activation and relu(pre)^2, then a cuBLASLt matmul; the backward is cuBLASLt matmuls around the
// same tensor-core GEMM, whose epilogue applies ReLU^2's derivative. Record 84's FP8 up-projection
// (training forward only) runs the same GEMM kernels on e4m3 operands, quantized by its own passes
// (mlp_fp8_quantize_weights, mlp_fp8_quantize_input; rounding points at mlp_forward_fp8's section), and
// record 89's FP8 down-projection with delayed scales (MlpDownScales; its section states the rounding
// points): the up-projection's epilogue also writes post in e4m3 and its amax. Also the
// lambda-scaled weight the attention projections use (w_eff = sa_lambda * w).
//
// Rounding points follow upstream's fused Triton MLP: pre is the fp32 sum rounded to bf16, post is
// relu(pre)^2 from that bf16 pre (rounded once); in the backward, g @ c_proj^T is rounded to bf16,
// then 2 * that * relu(pre) is rounded once more. Record 87 (upstream 75d6867a triton_kernels.py
// L455-491) keeps post only: the forward writes no pre, and the backward takes relu(pre) as
// sqrt(post) (ReluSquareSaves::post_only; it differs from relu(pre) by post's bf16 rounding).
#pragma once
#include "matmul.cuh"
#include "ptx.cuh"

#include <algorithm>
#include <cstddef>
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

// relu(p)^2 of 8 bf16, each rounded once (the square of a bf16 is exact in fp32). fmaxf rather than
// a comparison so that the CPU build has no branch on the sign (half of them would mispredict);
// either way -0 and NaN give +0.
__device__ __forceinline__ Pack128<__nv_bfloat16> relu_square(const Pack128<__nv_bfloat16>& p) {
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float r = fmaxf(__bfloat162float(p[k]), 0.0f);
        out[k] = __float2bfloat16(r * r);
    }
    return out;
}

// post = relu(pre)^2 from the bf16 pre
__global__ void __launch_bounds__(kPackThreads)
    relu_square_forward_kernel(__nv_bfloat16* post, const __nv_bfloat16* pre, int64_t n) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    store128(post + i, relu_square(load128(pre + i)));
}
// Reads pre, writes post; a max and a square per element.
inline Work relu_square_forward_work(int64_t n) {
    return Work{.name = "relu_square_forward", .flops = 2.0 * n, .bytes_read = 2.0 * n, .bytes_written = 2.0 * n};
}
inline void relu_square_forward(__nv_bfloat16* post, const __nv_bfloat16* pre, int64_t n, cudaStream_t stream) {
    require_shape(bf16_packs_shape_error(n, {post, pre}), "relu_square_forward");
    if (n == 0) return;
    launch(relu_square_forward_work(n), relu_square_forward_kernel, bf16_packs_grid(n), dim3(kPackThreads), 0, stream,
           post, pre, n);
    CUDA_CHECK_LAUNCH();
}

// 2 * d * relu(p) of 8 bf16 pairs, rounded once (2 d relu(p) of two bf16 is exact in fp32). The
// comparison, not fmaxf: -0 and NaN in p must give +0, whatever fmaxf returns for -0.
__device__ __forceinline__ Pack128<__nv_bfloat16> relu_square_backward(const Pack128<__nv_bfloat16>& d,
                                                                       const Pack128<__nv_bfloat16>& p) {
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        const float x = __bfloat162float(p[k]);
        out[k] = __float2bfloat16(2.0f * __bfloat162float(d[k]) * (x > 0.0f ? x : 0.0f));
    }
    return out;
}

// What the forward keeps for the backward: pre and post (records 84-86; the backward reads pre), or
// post only (record 87; the backward takes relu(pre) as sqrt(post)).
enum class ReluSquareSaves { pre_and_post, post_only };
inline const char* relu_square_saves_name(ReluSquareSaves s) {
    return s == ReluSquareSaves::post_only ? "post only" : "pre and post";
}

// 2 * d * sqrt(post) of 8 bf16 pairs: fp32 sqrt of the bf16 post, the product rounded once to bf16
// (upstream: 2 * bf16 g exactly, times tl.sqrt(post.to(fp32)), .to(bf16)). post >= 0 as the forward
// writes it. sqrtf is the correctly rounded square root; upstream's tl.sqrt is sqrt.approx.f32, which
// may differ from it by an ulp of fp32: the bf16 result can differ only where 2 d sqrt(post) lies
// within that ulp of a bf16 rounding boundary.
__device__ __forceinline__ Pack128<__nv_bfloat16> relu_square_backward_from_post(const Pack128<__nv_bfloat16>& d,
                                                                                 const Pack128<__nv_bfloat16>& post) {
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
        // post's zeros (relu's, about half) kept off sqrtf's slow path, a subroutine a GPU calls for 0 (ncu on the
        // H200: 1.57M of its warp instructions in one call at T = 16384): sqrt(+-0) is +-0, the same bits
        const float x = __bfloat162float(post[k]), root = sqrtf(x == 0.0f ? 1.0f : x);
        out[k] = __float2bfloat16(2.0f * __bfloat162float(d[k]) * (x == 0.0f ? x : root));
    }
    return out;
}
// ReLU^2's derivative from what the forward saved (pre, or post).
template <ReluSquareSaves S>
__device__ __forceinline__ Pack128<__nv_bfloat16> relu_square_derivative(const Pack128<__nv_bfloat16>& d,
                                                                         const Pack128<__nv_bfloat16>& saved) {
    if constexpr (S == ReluSquareSaves::post_only) return relu_square_backward_from_post(d, saved);
    else return relu_square_backward(d, saved);
}

// dpre = 2 * dpost_pre * relu(pre), dpost_pre = dout @ c_proj^T as its matmul rounded it, relu(pre)
// from the saved pre or as sqrt(post); dpre may be dpost_pre
template <ReluSquareSaves S>
__global__ void __launch_bounds__(kPackThreads)
    relu_square_backward_kernel(__nv_bfloat16* dpre, const __nv_bfloat16* dpost_pre, const __nv_bfloat16* saved,
                                int64_t n) {
    const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * 8;
    if (i >= n) return;
    store128(dpre + i, relu_square_derivative<S>(load128(dpost_pre + i), load128(saved + i)));
}
// Reads dpost_pre and pre (or post), writes dpre; a compare (or a square root) and two multiplies per element.
inline Work relu_square_backward_work(int64_t n) {
    return Work{.name = "relu_square_backward", .flops = 3.0 * n, .bytes_read = 4.0 * n, .bytes_written = 2.0 * n};
}
// `saved` is pre, or post with ReluSquareSaves::post_only.
inline void relu_square_backward(__nv_bfloat16* dpre, const __nv_bfloat16* dpost_pre, const __nv_bfloat16* saved,
                                 int64_t n, cudaStream_t stream, ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_shape(bf16_packs_shape_error(n, {dpre, dpost_pre, saved}), "relu_square_backward");
    if (n == 0) return;
    if (saves == ReluSquareSaves::post_only)
        launch(relu_square_backward_work(n), relu_square_backward_kernel<ReluSquareSaves::post_only>, bf16_packs_grid(n),
               dim3(kPackThreads), 0, stream, dpre, dpost_pre, saved, n);
    else
        launch(relu_square_backward_work(n), relu_square_backward_kernel<ReluSquareSaves::pre_and_post>,
               bf16_packs_grid(n), dim3(kPackThreads), 0, stream, dpre, dpost_pre, saved, n);
    CUDA_CHECK_LAUNCH();
}

// ---- g = x @ w^T on tensor cores, with ReLU^2 (forward) or its derivative (backward) in the epilogue ----
// x (T, C) and w (H, C) are both K-major (the "TN" GEMM). Two kernels compute it, each output adding
// its fp32 products in 16-wide (bf16) or 32-wide (e4m3) k-steps in ascending k from zero (so under emu,
// whose mma.sync and wgmma twins add a k-step's products in k order, the two give the same bits):
//   mma:   a block computes a 128 x 128 tile of g over C in steps of 64 (e4m3: 128), through a 3-stage cp.async
//          pipeline; its 8 warps each own 64 x 32 of the tile and issue mma.sync from ldmatrix loads.
//   wgmma: Hopper's; a block computes a 128 x 256 tile: a producer warpgroup's TMA loads feed a
//          4-stage mbarrier ring read by two consumer warpgroups' wgmmas (linear_relu_square_wgmma_kernel).
// On Hopper (sm_90a) the e4m3 mma.sync compiles to conversions and HMMA.16816 (it has FP8 only in wgmma,
// QGMMA): the mma kernel is the other GPUs' and the CPU build's. Both epilogues round the fp32 sums (e4m3:
// times the dequant) to bf16 once (g), stage them in shared memory, and write with
// 16-byte accesses, by FcEpilogue: the forward's pre = g and post = relu(pre)^2 (or post alone), or the
// backward's dpre = 2 g relu(pre) (g = dout @ c_proj^T; relu(pre) from pre, or as sqrt(post)).
enum class MlpKernel { mma, wgmma };
inline const char* mlp_kernel_name(MlpKernel k) { return k == MlpKernel::wgmma ? "wgmma" : "mma"; }
// wgmma on Hopper GPUs (compute capability 9), mma elsewhere and in the CPU build.
inline MlpKernel default_mlp_kernel() {
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    // Under emu the two agree bit for bit (test_mlp, and schedule_bits trains with --mlp-kernel wgmma),
    // and the Hopper twins cost twice the mma.sync twins' time: the CPU build runs mma unless asked.
    return major == 9 && !kEmulated ? MlpKernel::wgmma : MlpKernel::mma;
}

constexpr int kFcTileRows = 128;  // tokens per block (both kernels)
constexpr int kFcTileCols = 128;  // hidden units per block (mma)
constexpr int kFcTileK = 64;      // model dims per pipeline stage (both kernels)
constexpr int kFcStages = 3;
constexpr int kFcThreads = 256;
constexpr int kFcWarpRows = 64, kFcWarpCols = 32;  // warps: 2 down the rows, 4 across the columns
constexpr size_t kFcStageElems = size_t(kFcTileRows + kFcTileCols) * kFcTileK;
constexpr size_t kFcSmemBytes = kFcStages * kFcStageElems * sizeof(__nv_bfloat16);
static_assert(kFcTileRows * kFcTileCols <= kFcStages * kFcStageElems, "the epilogue's tile fits in the pipeline's");
static_assert((kFcTileRows / kFcWarpRows) * (kFcTileCols / kFcWarpCols) * 32 == kFcThreads, "one warp per sub-tile");

// Offset of (row, col) in a swizzled tile of rows of 64 (pipeline stages) or 128 (epilogue) bf16:
// the row's 16-byte chunks are XOR-permuted by row % 8, so the 8 rows an ldmatrix reads at one
// column, or the 8 rows the accumulators write at one column, fall in 8 distinct bank groups.
template <int COLS>
__device__ __forceinline__ int fc_swizzle(int row, int col) {
    static_assert(COLS == 64 || COLS == 128, "rows of 8 or 16 chunks");
    return row * COLS + (((col >> 3) ^ (row & 7)) << 3) + (col & 7);
}

// The operands' element type In: bf16, or e4m3 (the FP8 up-projection). A pipeline stage's row is
// 128 bytes either way (64 bf16 or 128 e4m3: upstream's BLOCK_SIZE_K of 64, and 128 for FP8), a
// 16-byte chunk 8 or 16 k's, and the products go in 4 steps of 32 bytes (k16 bf16 or k32 e4m3 MMAs).
template <class In>
constexpr int fc_tile_k() {
    static_assert(sizeof(In) == 1 || sizeof(In) == 2, "bf16 or e4m3 operands");
    return 128 / static_cast<int>(sizeof(In));
}
constexpr int kFcRowBytes = 128, kFcChunksPerRow = kFcRowBytes / 16;
static_assert(kFcTileK == fc_tile_k<__nv_bfloat16>(), "a bf16 stage row is 128 bytes");
// Byte offset of 16-byte chunk `chunk` of `row` in a stage's swizzled tile of 128-byte rows
// (fc_swizzle<64>'s layout, counted in bytes).
__device__ __forceinline__ int fc_chunk_offset(int row, int chunk) {
    return row * kFcRowBytes + ((chunk ^ (row & 7)) << 4);
}

// Issues the copies of k-step [k0, k0 + fc_tile_k<In>()) of the block's x rows and w rows into a
// stage; chunks outside the tensors (rows past T or H, columns past C) become zeros, which add nothing.
template <class In>
__device__ __forceinline__ void fc_load_stage(unsigned char* stage, const In* x, const In* w, int m0, int n0, int k0,
                                              int T, int C, int H) {
    constexpr int per_chunk = 16 / static_cast<int>(sizeof(In));
    static_assert(kFcTileRows == kFcTileCols, "x and w tiles are copied by the same threads");
    unsigned char* sx = stage;
    unsigned char* sw = stage + kFcTileRows * kFcRowBytes;
#pragma unroll
    for (int i = 0; i < kFcTileRows * kFcChunksPerRow / kFcThreads; ++i) {
        const int c = threadIdx.x + i * kFcThreads;
        const int r = c / kFcChunksPerRow, chunk = c % kFcChunksPerRow, k = k0 + chunk * per_chunk;
        const bool in_x = k < C && m0 + r < T, in_w = k < C && n0 + r < H;
        cp_async16(sx + fc_chunk_offset(r, chunk), in_x ? x + size_t(m0 + r) * C + k : x, in_x);
        cp_async16(sw + fc_chunk_offset(r, chunk), in_w ? w + size_t(n0 + r) * C + k : w, in_w);
    }
}
// The scale the epilogue multiplies the fp32 sums by before rounding: the FP8 path's dequant (read
// from device memory), none for bf16.
template <class In>
__device__ __forceinline__ float fc_dequant(const float* dequant) {
    if constexpr (sizeof(In) == 1) return *dequant;
    else return 1.0f;
}

// What the epilogue makes of g, the bf16 rounding of a tile's fp32 sums.
// (The values name the kernels' instances in tests/kernels/tests.cmake's SASS checks: new ones go last.)
enum class FcEpilogue {
    relu_square_forward,        // out = pre = g; post = relu(pre)^2, as relu_square_forward makes it
    relu_square_backward,       // reads pre; out = dpre = 2 g relu(pre), as relu_square_backward makes it
    relu_square_post,           // out = post = relu(g)^2 only (record 87)
    relu_square_backward_post,  // reads post (as `pre`); out = dpre = 2 g sqrt(post) (record 87)
    relu_square_post_fp8,       // relu_square_post, and post's e4m3 copy and amax (record 89: Fp8DownAct)
    relu_square_forward_fp8,    // relu_square_forward, and post's e4m3 copy and amax (record 89 on record 84)
};
// The epilogues that also write Fp8DownAct's postq and amax partials.
constexpr bool fc_emits_fp8(FcEpilogue e) {
    return e == FcEpilogue::relu_square_post_fp8 || e == FcEpilogue::relu_square_forward_fp8;
}
// The forward's and the backward's epilogue for what the forward keeps.
constexpr FcEpilogue fc_forward_epilogue(ReluSquareSaves s) {
    return s == ReluSquareSaves::post_only ? FcEpilogue::relu_square_post : FcEpilogue::relu_square_forward;
}
constexpr FcEpilogue fc_backward_epilogue(ReluSquareSaves s) {
    return s == ReluSquareSaves::post_only ? FcEpilogue::relu_square_backward_post : FcEpilogue::relu_square_backward;
}

// 8 bf16 to 8 e4m3 codes, each e4m3(f(value)) (cvt.rn.satfinite).
template <class F>
__device__ __forceinline__ uint2 e4m3_pack8(const Pack128<__nv_bfloat16>& p, F f) {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = f(__bfloat162float(p[k]));
    return make_uint2(cvt_e4m3x4(v[0], v[1], v[2], v[3]), cvt_e4m3x4(v[4], v[5], v[6], v[7]));
}

// Record 89: the post-only forward's epilogue (with pre, the pre-and-post one's) also writes post's
// e4m3 copy for the FP8 down-projection, postq = e4m3(min(post * (1 / act), 448)) (upstream 75d6867a
// triton_kernels.py L463-489: 1 / act one fp32 division, the product in fp32, cvt.rn.satfinite), and
// the max of the bf16 post it wrote, one partial per warp: kFcAmaxSlotsPerTile per tile at slot
// tile * 8 + warp (upstream keeps one per persistent CTA; only the max of them all is used, so any
// split that covers every tile is the same).
struct Fp8DownAct {
    __nv_fp8_e4m3* postq;  // (T, H)
    float* partials;       // this layer's mlp_fp8_down_act_partials(k, T, H) amax partials
    const float* act;      // this layer's activation scale, MlpDownScales::act
    __nv_bfloat16* pre = nullptr;  // also write pre: record 89's PR on record 84, whose MLP saves pre and post
};
constexpr int kFcAmaxSlotsPerTile = 8;  // the warps that store a tile: all 8 (mma), the 8 consumers' (wgmma)
static_assert(kFcThreads / 32 == kFcAmaxSlotsPerTile, "one amax slot per mma warp");
// The max of the bits of the warp's 32 values (the lanes all get it).
__device__ __forceinline__ uint32_t warp_max_bits(uint32_t v) {
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// |v| of a bf16 as fp32 bits: unsigned, they order as the magnitudes do, with NaN above inf.
__device__ __forceinline__ uint32_t abs_bits(__nv_bfloat16 v) {
    return (uint32_t(__bfloat16_as_ushort(v)) << 16) & 0x7fffffffu;
}

// The epilogue's first half: a 16 x 8 accumulator fragment (c0, c1 at (row, col), (row, col + 1);
// c2, c3 eight rows down: mma.sync's and wgmma's D layout) rounded to bf16 into a staged tile of
// COLS-wide rows.
template <int COLS>
__device__ __forceinline__ void fc_stage_fragment(__nv_bfloat16* tile, int row, int col, float c0, float c1, float c2,
                                                  float c3) {
    *reinterpret_cast<__nv_bfloat162*>(tile + fc_swizzle<COLS>(row, col)) = __floats2bfloat162_rn(c0, c1);
    *reinterpret_cast<__nv_bfloat162*>(tile + fc_swizzle<COLS>(row + 8, col)) = __floats2bfloat162_rn(c2, c3);
}
// The backwards' epilogues read what the forward saved (pre, or post).
constexpr bool fc_reads_saved(FcEpilogue e) {
    return e == FcEpilogue::relu_square_backward || e == FcEpilogue::relu_square_backward_post;
}
// The second half: a staged ROWS x 128 tile of g, whose (0, 0) is g's (m0, n0), out to global memory
// by E in 16-byte accesses by THREADS threads (this one `tid`); nothing past row T or column H.
// relu_square_post_fp8 and relu_square_forward_fp8 also write postq (8-byte stores: 8 e4m3 a chunk)
// with inv_act = 1 / act and return the max of this thread's post bits (0 for the other epilogues).
// The backwards read what the forward saved (`pre`: pre, or post) in batches of BATCH chunks, every load
// of a batch issued before its first store: a load cannot move above an earlier chunk's store by itself
// (out may be pre), so chunk by chunk each would wait a whole round trip to memory. Each chunk is read
// and then written by this one thread, so reading ahead is safe when out is pre. BATCH = 4: 8 spilled
// in both kernels (ptxas, sm_90a: the wgmma consumers hold their 128 accumulators meanwhile).
template <FcEpilogue E, int ROWS, int THREADS>
__device__ __forceinline__ uint32_t fc_store_tile(const __nv_bfloat16* tile, int tid, __nv_bfloat16* out,
                                                  __nv_bfloat16* post, const __nv_bfloat16* pre, int m0, int n0,
                                                  int T, int H, __nv_fp8_e4m3* postq = nullptr, float inv_act = 0.0f) {
    constexpr int COLS = 128, chunks_per_row = COLS / 8, chunks = ROWS * chunks_per_row / THREADS, BATCH = 4;
    constexpr bool reads_saved = fc_reads_saved(E);
    uint32_t amax = 0;
    static_assert(ROWS * chunks_per_row % THREADS == 0, "every thread stores the same number of chunks");
    static_assert(chunks % BATCH == 0, "whole batches");
    const auto in_tile = [&](int i, int& r, int& col) {  // chunk i's row and column in the tile, false past T or H
        const int c = tid + i * THREADS;
        r = c / chunks_per_row, col = (c % chunks_per_row) * 8;
        return m0 + r < T && n0 + col < H;
    };
#pragma unroll
    for (int b = 0; b < chunks; b += BATCH) {
        Pack128<__nv_bfloat16> saved[reads_saved ? BATCH : 1];
        if constexpr (reads_saved) {
#pragma unroll
            for (int j = 0; j < BATCH; ++j) {
                int r, col;
                if (in_tile(b + j, r, col)) saved[j] = load128(pre + size_t(m0 + r) * H + n0 + col);
            }
        }
#pragma unroll
        for (int j = 0; j < BATCH; ++j) {
            int r, col;
            if (!in_tile(b + j, r, col)) continue;
            const Pack128<__nv_bfloat16> g = load128(tile + fc_swizzle<COLS>(r, col));
            const size_t at = size_t(m0 + r) * H + n0 + col;
            if constexpr (E == FcEpilogue::relu_square_forward) {
                store128(out + at, g);
                store128(post + at, relu_square(g));
            } else if constexpr (E == FcEpilogue::relu_square_post) {
                store128(out + at, relu_square(g));
            } else if constexpr (fc_emits_fp8(E)) {
                const Pack128<__nv_bfloat16> p = relu_square(g);
                if constexpr (E == FcEpilogue::relu_square_forward_fp8) {
                    store128(out + at, g);
                    store128(post + at, p);
                } else {
                    store128(out + at, p);
                }
                *reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(postq) + at) =
                    e4m3_pack8(p, [inv_act](float v) { return fminf(v * inv_act, 448.0f); });
#pragma unroll
                for (int k = 0; k < 8; ++k) amax = max(amax, abs_bits(p[k]));
            } else if constexpr (E == FcEpilogue::relu_square_backward) {
                store128(out + at, relu_square_backward(g, saved[j]));
            } else {
                store128(out + at, relu_square_backward_from_post(g, saved[j]));
            }
        }
    }
    return amax;
}
// 1 / act for the e4m3-post epilogues (an IEEE division, as upstream's 1.0 / tl.load), else unused.
template <FcEpilogue E>
__device__ __forceinline__ float fc_inverse_act(const Fp8DownAct& down) {
    if constexpr (fc_emits_fp8(E)) return 1.0f / *down.act;
    else return 0.0f;
}

// g = bf16(x @ w^T) with fp32 sums, then the epilogue E; `post` is written by the pre-and-post forwards
// only and `pre` read by the backwards only (pre, or post for relu_square_backward_post; else null). The backward's pre may be its out: each
// element is read by the thread that then writes it. Two blocks per SM: at most 128 registers a
// thread (ptxas: no spills) and 2 x 96 KB. The e4m3 instance one block: sm_90 has no e4m3 mma.sync, so
// its MMAs convert their operands first, which at 128 registers spilled 16 bytes (Hopper runs the
// wgmma kernel; this one serves other GPUs and the CPU build).
// In: the operands' type (bf16, or e4m3 with the sums multiplied by *dequant before the rounding;
// dequant is read by the e4m3 kernel only).
template <class In>
constexpr int kFcMinBlocks = sizeof(In) == 1 ? 1 : 2;
template <FcEpilogue E, class In = __nv_bfloat16>
__global__ void __launch_bounds__(kFcThreads, kFcMinBlocks<In>)
    linear_relu_square_kernel(__nv_bfloat16* out, __nv_bfloat16* post, const __nv_bfloat16* pre, const In* x,
                              const In* w, const float* dequant, int T, int C, int H, Fp8DownAct down) {
    constexpr int tile_k = fc_tile_k<In>();
    unsigned char* smem = dynamic_smem<unsigned char>();
    const int m0 = blockIdx.y * kFcTileRows, n0 = blockIdx.x * kFcTileCols;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = (warp % (kFcTileRows / kFcWarpRows)) * kFcWarpRows;
    const int wn = (warp / (kFcTileRows / kFcWarpRows)) * kFcWarpCols;
    const int ksteps = ceil_div(C, tile_k);
    constexpr size_t stage_bytes = kFcStageElems * sizeof(__nv_bfloat16);

#pragma unroll
    for (int s = 0; s < kFcStages - 1; ++s) {
        if (s < ksteps) fc_load_stage(smem + s * stage_bytes, x, w, m0, n0, s * tile_k, T, C, H);
        cp_async_commit();  // empty groups keep the count the waits rely on
    }

    constexpr int MT = kFcWarpRows / 16, NT = kFcWarpCols / 8, KS = kFcRowBytes / 32;
    float acc[MT][NT][4] = {};
    for (int ks = 0; ks < ksteps; ++ks) {
        cp_async_wait<kFcStages - 2>();  // k-step ks has landed (this thread's copies)...
        __syncthreads();                 // ...everyone's, and the stage read at ks - 1 is free again
        const int next = ks + kFcStages - 1;
        if (next < ksteps) fc_load_stage(smem + (next % kFcStages) * stage_bytes, x, w, m0, n0, next * tile_k, T, C, H);
        cp_async_commit();

        // x rows "rows first" (lanes 0-15 rows at chunk 2s, 16-31 the same rows at chunk 2s + 1) give A
        // fragments; w rows "cols first" (lanes 0-7 rows at chunk 2s, 8-15 at 2s + 1, 16-23 the next 8
        // rows at 2s, 24-31 at 2s + 1) give the B fragments of B = w^T for two n-tiles (layouts: ptx.cuh;
        // a 32-byte step is a k16 bf16 or a k32 e4m3 MMA)
        const unsigned char* sx = smem + (ks % kFcStages) * stage_bytes;
        const unsigned char* sw = sx + kFcTileRows * kFcRowBytes;
        const void* x_rows[KS][MT];
        const void* w_rows[KS][NT / 2];
#pragma unroll
        for (int s = 0; s < KS; ++s) {
#pragma unroll
            for (int m = 0; m < MT; ++m) x_rows[s][m] = sx + fc_chunk_offset(wm + 16 * m + (lane & 15), 2 * s + (lane >> 4));
#pragma unroll
            for (int p = 0; p < NT / 2; ++p)
                w_rows[s][p] = sw + fc_chunk_offset(wn + 16 * p + (lane & 7) + ((lane >> 4) << 3), 2 * s + ((lane >> 3) & 1));
        }
        if constexpr (sizeof(In) == 1) mma_m16n8k32_e4m3_from_smem<KS, MT, NT>(acc, x_rows, w_rows);
        else mma_m16n8k16_bf16_from_smem<KS, MT, NT>(acc, x_rows, w_rows);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the stages: the epilogue reuses their memory

    const float dq = fc_dequant<In>(dequant);
    __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(smem);
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int n = 0; n < NT; ++n) {
            float c[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) c[i] = sizeof(In) == 1 ? acc[m][n][i] * dq : acc[m][n][i];
            fc_stage_fragment<kFcTileCols>(tile, wm + 16 * m + g, wn + 8 * n + 2 * t, c[0], c[1], c[2], c[3]);
        }
    __syncthreads();
    const uint32_t amax = fc_store_tile<E, kFcTileRows, kFcThreads>(tile, threadIdx.x, out, post, pre, m0, n0, T, H,
                                                                    down.postq, fc_inverse_act<E>(down));
    if constexpr (fc_emits_fp8(E)) {
        const uint32_t m = warp_max_bits(amax);
        if (lane == 0)
            down.partials[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kFcAmaxSlotsPerTile + warp] = __uint_as_float(m);
    }
}

// ---- the Hopper kernel: TMA -> mbarrier ring -> wgmma, warp-specialized ----
// Warpgroup 0 produces: after setmaxnreg lowers its registers to 40, one thread loops over the
// k-steps, waiting for a stage's `empty` barrier, then arming its `full` barrier with the stage's
// bytes and issuing two TMA loads (x's 128 rows, w's 256 rows, 64 wide: one 128-byte swizzle span).
// Warpgroups 1 and 2 consume, with 232 registers each: consumer c owns rows 64c..64c+63 and issues
// four m64n256k16 wgmmas per k-step (k ascending, scale-d off for the first: sums from zero), then
// waits until one group is in flight, which retires the previous k-step's wgmmas, whose stage its
// threads then release. TMA fills rows past T or H and columns past C with zeros.
// Tile: 128 x 256 is the largest the registers allow: m64n256's accumulators are 128 fp32 a thread,
// which fit under 232 (256 x 232 + 128 x 40 = 64512 of the SM's 65536); a third consumer (192 x 256)
// would leave at most (65536 - 128 x 24) / 384 = 162 a consumer thread for 128 accumulators, its
// addressing and the epilogue. Against 128 x 128 it loads 48 KB per k-step for 4.2 MFLOP instead of 32 KB for 2.1 (85
// instead of 64 FLOP a byte of L2 traffic), and each wgmma reads its A rows once for 256 columns.
// Shared memory: the 4-stage ring (4 x 48 KB) and a 4 KB staging tile per consumer warp (32 KB; the
// ring cannot serve: the other warpgroup's wgmmas may still read it) = 225 KB with the alignment slack,
// so one block per SM, 384 threads.
// Epilogue, per warp, no block barrier: its 16 x 256 sums in two 16 x 128 halves, each staged as bf16
// in its own tile, then stored by fc_store_tile.
constexpr int kFcwCols = 256;     // hidden units per block
constexpr int kFcwStages = 4;
constexpr int kFcwConsumers = 2;  // warpgroups, 64 rows each
constexpr int kFcwThreads = 384;  // the producer warpgroup and the consumers
constexpr int kFcwProducerRegs = 40, kFcwConsumerRegs = 232;
constexpr uint32_t kFcwXBytes = kFcTileRows * kFcTileK * 2, kFcwWBytes = kFcwCols * kFcTileK * 2;
constexpr uint32_t kFcwStageBytes = kFcwXBytes + kFcwWBytes;
constexpr uint32_t kFcwStagingBytes = 16 * 128 * 2;  // a consumer warp's 16 x 128 half tile
constexpr size_t kFcwSmemBytes = 1024 + size_t(kFcwStages) * kFcwStageBytes + 4 * kFcwConsumers * kFcwStagingBytes;
static_assert(kFcwThreads == 128 * (kFcwConsumers + 1) && kFcTileRows == 64 * kFcwConsumers, "warpgroups");
static_assert(kFcTileK * 2 == 128, "a k-step's row is one 128-byte swizzle span");
static_assert(128 * kFcwProducerRegs + 128 * kFcwConsumers * kFcwConsumerRegs <= 65536, "registers of one SM");
static_assert(kFcwSmemBytes <= 227 * 1024, "shared memory of one block");

// A backward's saved tile (the rows x kFcwCols that its epilogue reads) into L2 by the producer warpgroup's idle
// threads (`i0` of `stride`) while the k-steps run: the forward wrote it long before, so it is in HBM, and the
// epilogue's loads, four round trips a tile with nothing else to hide them, then come from L2.
template <FcEpilogue E>
__device__ __forceinline__ void fc_prefetch_saved(const __nv_bfloat16* pre, int i0, int stride, int m0, int n0, int T,
                                                  int H) {
    if constexpr (fc_reads_saved(E)) {
        constexpr int kLines = kFcwCols * 2 / 128;  // the 128-byte lines of a row's columns
        for (int i = i0; i < kFcTileRows * kLines; i += stride) {
            const int r = i / kLines, col = (i % kLines) * 64;
            if (m0 + r < T && n0 + col < H) prefetch_l2(pre + size_t(m0 + r) * H + n0 + col);
        }
    }
}
// The producer's loop (one thread); a k-step is tile_k elements (128 bytes of a row).
__device__ __forceinline__ void fc_wgmma_produce(unsigned char* ring, uint64_t* full, uint64_t* empty,
                                                 const CUtensorMap* map_x, const CUtensorMap* map_w, int m0, int n0,
                                                 int ksteps, int tile_k) {
    for (int ks = 0; ks < ksteps; ++ks) {
        const int s = ks % kFcwStages;
        if (ks >= kFcwStages) mbarrier_wait(&empty[s], (ks / kFcwStages - 1) % 2);  // k-step ks - 4 is consumed
        unsigned char* stage = ring + s * kFcwStageBytes;
        mbarrier_arrive_expect_tx(&full[s], kFcwStageBytes);
        tma_load_2d(stage, map_x, ks * tile_k, m0, &full[s]);
        tma_load_2d(stage + kFcwXBytes, map_w, ks * tile_k, n0, &full[s]);
    }
}
// A consumer warpgroup's loop: acc = its 64 rows of x @ w^T over every k-step, retired. Each k-step
// is four wgmmas of 32 bytes of k: m64n256k16 on bf16, m64n256k32 on e4m3.
template <class In = __nv_bfloat16>
__device__ __forceinline__ void fc_wgmma_consume(WgmmaAcc<kFcwCols>& acc, const unsigned char* ring, uint64_t* full,
                                                 uint64_t* empty, int consumer, int ksteps) {
    for (int ks = 0; ks < ksteps; ++ks) {
        const int s = ks % kFcwStages;
        mbarrier_wait(&full[s], (ks / kFcwStages) % 2);
        const unsigned char* x = ring + s * kFcwStageBytes + consumer * 64 * 128;  // rows of 128 bytes
        const unsigned char* w = ring + s * kFcwStageBytes + kFcwXBytes;
        wgmma_fence(acc);
#pragma unroll
        for (int kk = 0; kk < kFcRowBytes / 32; ++kk) {
            const uint64_t da = make_smem_desc(x + 32 * kk, 0, 1024, Swizzle::b128),
                           db = make_smem_desc(w + 32 * kk, 0, 1024, Swizzle::b128);
            if constexpr (sizeof(In) == 1) wgmma_ss_e4m3(acc, da, db, ks > 0 || kk > 0);
            else wgmma_ss(acc, da, db, ks > 0 || kk > 0);
        }
        wgmma_commit();
        wgmma_wait<1>(acc);  // k-step ks - 1's wgmmas are retired: their stage may be refilled
        if (ks > 0) mbarrier_arrive(&empty[(ks - 1) % kFcwStages]);
    }
    wgmma_wait<0>(acc);
}

// linear_relu_square_kernel's g and epilogue on Hopper; x and w come as tensor maps (boxes of 128
// bytes x 128 and x 256 rows, 128-byte swizzle: 64 bf16 or 128 e4m3 wide). In as there (e4m3: the
// sums times *dequant before the rounding).
template <FcEpilogue E, class In = __nv_bfloat16>
__global__ void __launch_bounds__(kFcwThreads, 1)
    linear_relu_square_wgmma_kernel(__nv_bfloat16* out, __nv_bfloat16* post, const __nv_bfloat16* pre,
                                    const __grid_constant__ CUtensorMap map_x, const __grid_constant__ CUtensorMap map_w,
                                    const float* dequant, int T, int C, int H, Fp8DownAct down) {
    constexpr int tile_k = fc_tile_k<In>();
    __shared__ uint64_t full[kFcwStages], empty[kFcwStages];
    unsigned char* raw = dynamic_smem<unsigned char>();
    unsigned char* ring = raw + (1024 - smem_address(raw) % 1024) % 1024;  // the swizzle repeats every 1024 bytes
    const int m0 = blockIdx.y * kFcTileRows, n0 = blockIdx.x * kFcwCols, ksteps = ceil_div(C, tile_k);
    const int warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (int s = 0; s < kFcwStages; ++s) {
            mbarrier_init(&full[s], 1);
            mbarrier_init(&empty[s], 128 * kFcwConsumers);  // every consumer thread, after its own wait
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    if (warpgroup == 0) {
        setmaxnreg_dec<kFcwProducerRegs>();
        if (threadIdx.x == 0) fc_wgmma_produce(ring, full, empty, &map_x, &map_w, m0, n0, ksteps, tile_k);
        else fc_prefetch_saved<E>(pre, threadIdx.x - 1, 127, m0, n0, T, H);
        return;
    }
    setmaxnreg_inc<kFcwConsumerRegs>();
    const int consumer = warpgroup - 1, warp = threadIdx.x / 32 - 4, lane = threadIdx.x % 32;
    WgmmaAcc<kFcwCols> acc;
    fc_wgmma_consume<In>(acc, ring, full, empty, consumer, ksteps);
    const float dq = fc_dequant<In>(dequant);

    __nv_bfloat16* tile = reinterpret_cast<__nv_bfloat16*>(ring + kFcwStages * kFcwStageBytes + warp * kFcwStagingBytes);
    const int g = lane / 4, t = lane % 4, row0 = m0 + 64 * consumer + 16 * (warp % 4);
    const float inv_act = fc_inverse_act<E>(down);
    uint32_t amax = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int i = 0; i < 16; ++i) {
            const int f = 4 * (16 * half + i);  // the fragment of columns 128 half + 8 i..
            if constexpr (sizeof(In) == 1)
                fc_stage_fragment<128>(tile, g, 8 * i + 2 * t, acc[f] * dq, acc[f + 1] * dq, acc[f + 2] * dq,
                                       acc[f + 3] * dq);
            else
                fc_stage_fragment<128>(tile, g, 8 * i + 2 * t, acc[f], acc[f + 1], acc[f + 2], acc[f + 3]);
        }
        __syncwarp();
        amax = max(amax, fc_store_tile<E, 16, 32>(tile, lane, out, post, pre, row0, n0 + 128 * half, T, H, down.postq,
                                                  inv_act));
        __syncwarp();  // the warp's stores have read the tile before the next half overwrites it
    }
    if constexpr (fc_emits_fp8(E)) {
        static_assert(4 * kFcwConsumers == kFcAmaxSlotsPerTile, "one amax slot per consumer warp");
        const uint32_t m = warp_max_bits(amax);
        if (lane == 0)
            down.partials[(size_t(blockIdx.y) * gridDim.x + blockIdx.x) * kFcAmaxSlotsPerTile + warp] = __uint_as_float(m);
    }
}

inline std::string linear_relu_square_shape_error(int T, int C, int H,
                                                  std::initializer_list<const void*> pointers) {
    if (T <= 0 || C <= 0 || H <= 0)
        return "T (" + std::to_string(T) + "), C (" + std::to_string(C) + ") and H (" + std::to_string(H) +
               ") must be positive";
    if (C % 8 != 0 || H % 8 != 0)
        return "C (" + std::to_string(C) + ") and H (" + std::to_string(H) + ") must be multiples of 8";
    if (ceil_div(T, kFcTileRows) > 65535) return "T (" + std::to_string(T) + ") needs more than 65535 row tiles";
    if (!all_aligned16(pointers)) return "a buffer is not 16-byte aligned";
    return "";
}

// The MMAs the grid executes, every 128 x 128 (mma) or 128 x 256 (wgmma) tile over C in whole 64-wide
// k-steps (the padding past T, H and C included).
inline double linear_relu_square_tc_flops(MlpKernel k, int T, int C, int H) {
    const int tile_cols = k == MlpKernel::wgmma ? kFcwCols : kFcTileCols;
    const double rows = ceil_div(T, kFcTileRows) * kFcTileRows, cols = ceil_div(H, tile_cols) * tile_cols;
    const double depth = ceil_div(C, kFcTileK) * kFcTileK;
    return 2 * rows * cols * depth;
}
// Reads x and w, writes pre and post (or post alone); a max and a square per output.
inline Work linear_relu_square_forward_work(MlpKernel k, int T, int C, int H,
                                            ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    const double written = (saves == ReluSquareSaves::post_only ? 2.0 : 4.0) * T * H;
    return Work{.name = "linear_relu_square_forward", .tc_flops = linear_relu_square_tc_flops(k, T, C, H),
                .flops = 2.0 * T * H, .bytes_read = 2.0 * (T + H) * C, .bytes_written = written, .m = H, .n = T, .k = C};
}
// Reads g's operands and pre (or post), writes dpre; a compare (or a square root) and two multiplies per output.
inline Work linear_relu_square_backward_work(MlpKernel k, int T, int C, int H) {
    return Work{.name = "linear_relu_square_backward", .tc_flops = linear_relu_square_tc_flops(k, T, C, H),
                .flops = 3.0 * T * H, .bytes_read = 2.0 * (T + H) * C + 2.0 * T * H, .bytes_written = 2.0 * T * H,
                .m = H, .n = T, .k = C};
}

template <FcEpilogue E, class In>
void launch_linear_relu_square_mma(const Work& work, __nv_bfloat16* out, __nv_bfloat16* post, const __nv_bfloat16* pre,
                                   const In* x, const In* w, const float* dequant, int T, int C, int H,
                                   cudaStream_t stream, const Fp8DownAct& down) {
    static const bool smem_allowed = (CUDA_CHECK(cudaFuncSetAttribute(linear_relu_square_kernel<E, In>,
                                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                                      static_cast<int>(kFcSmemBytes))),
                                      true);
    (void)smem_allowed;
    const dim3 grid(static_cast<unsigned>(ceil_div(H, kFcTileCols)), static_cast<unsigned>(ceil_div(T, kFcTileRows)));
    launch(work, linear_relu_square_kernel<E, In>, grid, dim3(kFcThreads), kFcSmemBytes, stream, out, post, pre, x, w,
           dequant, T, C, H, down);
    CUDA_CHECK_LAUNCH();
}
template <FcEpilogue E, class In>
void launch_linear_relu_square_wgmma(const Work& work, __nv_bfloat16* out, __nv_bfloat16* post,
                                     const __nv_bfloat16* pre, const In* x, const In* w, const float* dequant, int T,
                                     int C, int H, cudaStream_t stream, const Fp8DownAct& down) {
    static const bool smem_allowed = (CUDA_CHECK(cudaFuncSetAttribute(linear_relu_square_wgmma_kernel<E, In>,
                                                                      cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                                      static_cast<int>(kFcwSmemBytes))),
                                      true);
    (void)smem_allowed;
    const uint64_t row_bytes = uint64_t(C) * sizeof(In);
    const uint32_t tile_k = fc_tile_k<In>();
    const CUtensorMapDataType type = sizeof(In) == 1 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    const CUtensorMap map_x = encode_tensor_map<2>(x, {uint64_t(C), uint64_t(T)}, {row_bytes},
                                                   {tile_k, uint32_t(kFcTileRows)}, Swizzle::b128, type);
    const CUtensorMap map_w = encode_tensor_map<2>(w, {uint64_t(C), uint64_t(H)}, {row_bytes},
                                                   {tile_k, uint32_t(kFcwCols)}, Swizzle::b128, type);
    const dim3 grid(static_cast<unsigned>(ceil_div(H, kFcwCols)), static_cast<unsigned>(ceil_div(T, kFcTileRows)));
    launch(work, linear_relu_square_wgmma_kernel<E, In>, grid, dim3(kFcwThreads), kFcwSmemBytes, stream, out, post,
           pre, map_x, map_w, dequant, T, C, H, down);
    CUDA_CHECK_LAUNCH();
}
template <FcEpilogue E, class In = __nv_bfloat16>
void launch_linear_relu_square(MlpKernel k, const Work& work, __nv_bfloat16* out, __nv_bfloat16* post,
                               const __nv_bfloat16* pre, const In* x, const In* w, int T, int C, int H,
                               cudaStream_t stream, const float* dequant = nullptr, const Fp8DownAct& down = {}) {
    if (k == MlpKernel::wgmma)
        launch_linear_relu_square_wgmma<E, In>(work, out, post, pre, x, w, dequant, T, C, H, stream, down);
    else
        launch_linear_relu_square_mma<E, In>(work, out, post, pre, x, w, dequant, T, C, H, stream, down);
}

// With ReluSquareSaves::post_only the forward writes no pre: pre must be null (a pre buffer given
// would be left stale, which a caller reading it would not notice).
inline void require_saves(ReluSquareSaves saves, const void* pre, const char* launcher) {
    kernel_require((saves == ReluSquareSaves::post_only) == (pre == nullptr),
                   "%s: pre must be null exactly when the forward keeps post only (%s; pre %s)", launcher,
                   relu_square_saves_name(saves), pre ? "given" : "null");
}

// pre (T, H) = x (T, C) @ w (H, C)^T, post (T, H) = relu(pre)^2, both bf16; one kernel, k's. With
// saves post_only (record 87), post alone (pre null).
inline void linear_relu_square_forward(MlpKernel k, __nv_bfloat16* pre, __nv_bfloat16* post, const __nv_bfloat16* x,
                                       const __nv_bfloat16* w, int T, int C, int H, cudaStream_t stream,
                                       ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_saves(saves, pre, "linear_relu_square_forward");
    require_shape(linear_relu_square_shape_error(T, C, H, {pre, post, x, w}), "linear_relu_square_forward");
    const Work work = linear_relu_square_forward_work(k, T, C, H, saves);
    if (saves == ReluSquareSaves::post_only)
        launch_linear_relu_square<FcEpilogue::relu_square_post>(k, work, post, nullptr, nullptr, x, w, T, C, H, stream);
    else
        launch_linear_relu_square<FcEpilogue::relu_square_forward>(k, work, pre, post, nullptr, x, w, T, C, H, stream);
}

// dpre (T, H) = 2 bf16(g (T, C) @ w (H, C)^T) relu(pre), all bf16; one kernel, k's. The product is
// rounded to bf16 first, as upstream's fused kernel rounds its accumulator before the derivative:
// the same bits as a matmul with the same fp32 sums then relu_square_backward. `saved` is pre, or
// with saves post_only post (relu(pre) taken as sqrt(post)); dpre may be `saved`.
inline void linear_relu_square_backward(MlpKernel k, __nv_bfloat16* dpre, const __nv_bfloat16* g,
                                        const __nv_bfloat16* w, const __nv_bfloat16* saved, int T, int C, int H,
                                        cudaStream_t stream, ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_shape(linear_relu_square_shape_error(T, C, H, {dpre, g, w, saved}), "linear_relu_square_backward");
    const Work work = linear_relu_square_backward_work(k, T, C, H);
    if (saves == ReluSquareSaves::post_only)
        launch_linear_relu_square<FcEpilogue::relu_square_backward_post>(k, work, dpre, nullptr, saved, g, w, T, C, H,
                                                                         stream);
    else
        launch_linear_relu_square<FcEpilogue::relu_square_backward>(k, work, dpre, nullptr, saved, g, w, T, C, H, stream);
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

// pre = x @ c_fc^T; post = relu(pre)^2; out = post @ c_proj (pre and post are kept for the backward;
// with saves post_only post alone, pre null); the first two by k's kernel
inline void mlp_forward(CublasLt& lt, MlpKernel k, __nv_bfloat16* out, __nv_bfloat16* pre, __nv_bfloat16* post,
                        const __nv_bfloat16* x, const __nv_bfloat16* c_fc, const __nv_bfloat16* c_proj, int T, int C,
                        int H, cudaStream_t stream, ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_shape(mlp_shape_error(T, C, H), "mlp_forward");
    linear_relu_square_forward(k, pre, post, x, c_fc, T, C, H, stream, saves);
    matmul_bf16(lt, out, post, false, c_proj, false, T, C, H, stream, 1.0f, 0.0f, nullptr, {}, "gemm_mlp_proj");
}

// Given dout (T, C): dc_proj (+)= post^T @ dout; dpre = 2 (dout @ c_proj^T) relu(pre);
// dc_fc (+)= dpre^T @ x; dx = dpre @ c_fc. dc_proj comes first: dpre (T, H) is scratch and may be
// the post buffer, and post is last read by dc_proj (post only: by the fused dpre kernel, in place). (The gradients' reductions across ranks start
// after the whole backward, in the optimizer step.)
// post may be null (not kept from the forward): it is then recomputed from pre into dpre, the
// same bits, at the cost of one elementwise pass. With saves post_only (record 87) pre is null and
// relu(pre) is taken as sqrt(post).
// dpre is one tensor-core kernel (linear_relu_square_backward, k's) wherever its shape rules hold; past
// them (T beyond 65535 row tiles, or a buffer not 16-byte aligned) it is a cuBLASLt matmul and
// relu_square_backward, the same bits where the two accumulate in the same order (emu).
inline void mlp_backward(CublasLt& lt, MlpKernel k, __nv_bfloat16* dx, __nv_bfloat16* dc_fc, __nv_bfloat16* dc_proj,
                         bool accumulate_weight_grads, __nv_bfloat16* dpre, const __nv_bfloat16* dout,
                         const __nv_bfloat16* x, const __nv_bfloat16* c_fc, const __nv_bfloat16* c_proj,
                         const __nv_bfloat16* pre, const __nv_bfloat16* post, int T, int C, int H,
                         cudaStream_t stream, ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_shape(mlp_shape_error(T, C, H), "mlp_backward");
    require_saves(saves, pre, "mlp_backward");
    kernel_require(saves == ReluSquareSaves::pre_and_post || post != nullptr, "mlp_backward: post only, but post is null");
    const int64_t n = static_cast<int64_t>(T) * H;
    const __nv_bfloat16* saved = saves == ReluSquareSaves::post_only ? post : pre;
    if (post == nullptr) {
        relu_square_forward(dpre, pre, n, stream);
        post = dpre;
    }
    const float beta = accumulate_weight_grads ? 1.0f : 0.0f;
    matmul_bf16(lt, dc_proj, post, true, dout, false, H, C, T, stream, 1.0f, beta, nullptr, {}, "gemm_mlp_proj_dw");
    if (linear_relu_square_shape_error(T, C, H, {dpre, dout, c_proj, saved}).empty()) {
        linear_relu_square_backward(k, dpre, dout, c_proj, saved, T, C, H, stream, saves);
    } else {
        // the matmul writes dpre before the derivative reads post: here they must be apart
        kernel_require(saves == ReluSquareSaves::pre_and_post || dpre != post,
                       "mlp_backward: post only, on the fallback path (T %d), dpre must not be the post buffer", T);
        matmul_bf16(lt, dpre, dout, false, c_proj, true, T, H, C, stream, 1.0f, 0.0f, nullptr, {}, "gemm_mlp_proj_dx");
        relu_square_backward(dpre, dpre, saved, n, stream, saves);
    }
    matmul_backward_weight(lt, dc_fc, dpre, x, T, H, C, stream, accumulate_weight_grads, "gemm_mlp_fc_dw");
    matmul_backward_input(lt, dx, dpre, c_fc, T, H, C, stream, false, "gemm_mlp_fc_dx");
}

// ---- the FP8 up-projection (record 84; the training forward only) ----
// Upstream a333be08: quantize_mlp_fp8 (train_gpt.py L1332-1343) after every optimizer step and at init,
// the forward's use_mlp_fp8 branch (L1479-1487), linear_relu_square's USE_FP8 path (triton_kernels.py
// L403-541). The backward is mlp_backward unchanged: bf16, from the unquantized x and c_fc and the pre
// and post this forward saved. Rounding points:
// - Weights (eager PyTorch, outside the compiled graph, so every tensor op rounds to bf16):
//   w_s[l] = bf16(max(max|W1_l|, bf16(1e-12)) / 448), kept as fp32 (the amax of bf16 values is one of
//   them; eager CUDA divides a tensor by a Python scalar as a multiply by fp32(1/448), which gives the
//   division's bf16 for every bf16: test_mlp checks them all); W1q_l = e4m3(bf16(fp32(W1_l) / w_s[l]))
//   with cvt.rn.satfinite: torch's eager e4m3 cast does not saturate, but |W1 / w_s| <= 448 (1 + 2^-8)
//   rounds to at most 450 in bf16, which both casts take to 448, so they agree on every reachable value.
// - Activations (inside torch.compile, which fuses the chain and rounds nothing to bf16 in between, as
//   the lm_head's x.div(s).to(fp8) in kernels/head.cuh): a = max|x| over the layer's whole (T, C) input,
//   clamped to >= bf16(1e-12); xq = e4m3(fp32(x) * (448 / a)), 448 / a one IEEE fp32 division, the
//   cast cvt.rn.satfinite; dequant = fp32(w_s[l] * a) / 448 (upstream's fp32 buffer's
//   copy_(w_s).mul_(a).div_(448)). The amaxes are integer maxima of the magnitudes' bits: exact, in any
//   order (so deterministic), and NaN wins as in torch's amax.
// - pre = bf16(fp32(sum_k xq wq) * dequant) and post = bf16(relu(pre)^2), written by the fused c_fc
//   kernels' epilogue (FcEpilogue::relu_square_forward) with the sums multiplied by the dequant before
//   the one rounding (upstream: accumulator *= dequant, then .to(bf16)). The sums are fp32 of exact
//   e4m3 products: under emu in k order; on Hopper by the tensor cores' fast FP8 accumulation, never
//   promoted, as upstream's tl.dot (max_num_imprecise_acc 2^30).
// Passes per layer (T tokens, width C, hidden H; global-memory bytes): the amax pass reads x (2TC),
// the quantize pass reads x and writes xq (2TC + TC), the GEMM reads xq and W1q (TC + HC) and writes
// pre and post (4TH); bf16's GEMM alone reads 2TC + 2HC. Why xq goes through memory rather than the
// GEMM quantizing its x tiles as they arrive: the amax needs a whole pass over x before any element can
// be quantized, so that pass exists either way; quantizing in the GEMM would save xq's write and read
// (2TC, ~75 MB at T = 49152, C = 768) but brings x in as bf16, twice the bytes per k-step of the
// 128-wide FP8 stages (the wgmma kernel's 4-stage ring would no longer fit), adds a conversion through
// shared memory between TMA and wgmma in every consumer, and repeats it for each of the H / 256 column
// tiles that read the same x tile. Upstream does the same three passes (inductor's amax and cast
// kernels, then the Triton GEMM). The amax pass could be fused into the norm that produces x.
struct Fp8UpWeights {
    __nv_fp8_e4m3* w;  // (layers, H, C) e4m3: layer l's W1q at w + l H C
    float* scale;      // (layers): w_s
};
// An MLP bank's c_fc: layer l's (H, C) bf16 at c_fc + l * layer_stride (elements).
struct MlpFcBank {
    const __nv_bfloat16* c_fc;
    int64_t layer_stride;
    int layers;
};
// What mlp_fp8_quantize_input leaves in device memory for the GEMM.
struct Fp8UpScales {
    float amax;     // a
    float x_scale;  // 448 / a
    float dequant;  // w_s a / 448
    float unused;
};
// One layer's FP8 up-projection: its quantized weight and the scratch of its input's quantization.
// Launches that may run at the same time (other streams) need their own xq, scales and amax.
struct Fp8Up {
    const __nv_fp8_e4m3* w;  // (H, C): Fp8UpWeights::w + l H C
    const float* w_scale;    // &Fp8UpWeights::scale[l]
    __nv_fp8_e4m3* xq;       // scratch (T, C), 16-byte aligned
    Fp8UpScales* scales;     // scratch
    BlockPartials amax;      // scratch: mlp_fp8_input_scratch_floats(T, C) partials, a counter zeroed once
};

constexpr int kFp8Threads = 256, kFp8AmaxMaxBlocks = 256;
constexpr float kE4m3Max = 448.0f;
// The amax pass's blocks over n elements: fixed by n.
inline int fp8_amax_blocks(int64_t n) {
    return static_cast<int>(std::clamp<int64_t>(ceil_div<int64_t>(n / 8, kFp8Threads), 1, kFp8AmaxMaxBlocks));
}
__device__ inline uint32_t block_reduce_max_bits(uint32_t v) {
    __shared__ uint32_t warp_max[32];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    v = lane < warps ? warp_max[lane] : 0u;
#pragma unroll
    for (int o = 16; o > 0; o /= 2) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// The max of |x[i]| bits over packs [first, n / 8) with a stride of `step` packs.
__device__ __forceinline__ uint32_t abs_max_bits(const __nv_bfloat16* x, int64_t n, int64_t first, int64_t step) {
    uint32_t m = 0;
    for (int64_t i = first; i < n / 8; i += step) {
        const Pack128<__nv_bfloat16> p = load128(x + 8 * i);
#pragma unroll
        for (int k = 0; k < 8; ++k) m = max(m, abs_bits(p[k]));
    }
    return m;
}
// max(a, bf16(1e-12)), NaN kept (torch's clamp).
__device__ __forceinline__ float clamp_amax(float a) {
    const float lo = __bfloat162float(__float2bfloat16(1e-12f));
    return a < lo ? lo : a;
}

// ---- weights: all layers of the bank in two launches ----
// Block b works on layer b / blocks_per_layer; the last block turns each layer's partials into w_s
// (layer l's at scale[l * scale_stride]).
__global__ void __launch_bounds__(kFp8Threads)
    mlp_fp8_weight_scale_kernel(float* scale, int scale_stride, MlpFcBank bank, int64_t n, int blocks_per_layer,
                                BlockPartials scratch) {
    const int layer = blockIdx.x / blocks_per_layer, part = blockIdx.x % blocks_per_layer;
    const uint32_t m = block_reduce_max_bits(abs_max_bits(bank.c_fc + layer * bank.layer_stride, n,
                                                          int64_t(part) * blockDim.x + threadIdx.x,
                                                          int64_t(blocks_per_layer) * blockDim.x));
    if (threadIdx.x == 0) scratch.partials[blockIdx.x] = __uint_as_float(m);
    if (!last_block_done(scratch.done)) return;
    for (int l = 0; l < bank.layers; ++l) {
        uint32_t lm = 0;
        for (int i = threadIdx.x; i < blocks_per_layer; i += blockDim.x)
            lm = max(lm, __float_as_uint(scratch.partials[l * blocks_per_layer + i]));
        lm = block_reduce_max_bits(lm);
        if (threadIdx.x == 0)
            scale[size_t(l) * scale_stride] = __bfloat162float(__float2bfloat16(clamp_amax(__uint_as_float(lm)) / kE4m3Max));
    }
}
// W1q = e4m3(bf16(W1 / w_s)), 8 elements a thread; layer l's output at w + l n.
__global__ void __launch_bounds__(kFp8Threads)
    mlp_fp8_quantize_weights_kernel(__nv_fp8_e4m3* w, const float* scale, MlpFcBank bank, int64_t n) {
    const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x, per_layer = n / 8;
    if (p >= per_layer * bank.layers) return;
    const int layer = static_cast<int>(p / per_layer);
    const float s = scale[layer];
    const Pack128<__nv_bfloat16> v = load128(bank.c_fc + layer * bank.layer_stride + 8 * (p % per_layer));
    *reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(w) + 8 * p) =
        e4m3_pack8(v, [s](float x) { return __bfloat162float(__float2bfloat16(x / s)); });
}
inline int mlp_fp8_weight_blocks_per_layer(int H, int C) { return fp8_amax_blocks(int64_t(H) * C); }
// The weight scales' partials: one float per block of mlp_fp8_quantize_weights' amax launch.
inline size_t mlp_fp8_weight_scratch_floats(int layers, int H, int C) {
    return size_t(layers) * mlp_fp8_weight_blocks_per_layer(H, C);
}
inline std::string mlp_fp8_shape_error(int T, int C, int H, std::initializer_list<const void*> pointers) {
    if (T <= 0 || C <= 0 || H <= 0)
        return "T (" + std::to_string(T) + "), C (" + std::to_string(C) + ") and H (" + std::to_string(H) +
               ") must be positive";
    if (C % 16 != 0 || H % 8 != 0)
        return "C (" + std::to_string(C) + ") must be a multiple of 16 (rows of 16-byte e4m3 chunks) and H (" +
               std::to_string(H) + ") of 8";
    if (ceil_div(T, kFcTileRows) > 65535) return "T (" + std::to_string(T) + ") needs more than 65535 row tiles";
    if (!all_aligned16(pointers)) return "a buffer is not 16-byte aligned";
    return "";
}
// Reads the bank's weights, the partials and the counter; writes the partials, the scales and the counter.
inline Work mlp_fp8_weight_scale_work(int layers, int H, int C) {
    const double n = double(layers) * H * C, partials = 4.0 * mlp_fp8_weight_scratch_floats(layers, H, C);
    return Work{.name = "mlp_fp8_weight_scale", .flops = n, .bytes_read = 2 * n + partials + 4,
                .bytes_written = partials + 4.0 * layers + 4};
}
// Reads the weights and scales, writes W1q; a division and a conversion per element.
inline Work mlp_fp8_quantize_weights_work(int layers, int H, int C) {
    const double n = double(layers) * H * C;
    return Work{.name = "mlp_fp8_quantize_weights", .flops = 2 * n, .bytes_read = 2 * n + 4.0 * layers,
                .bytes_written = n};
}
// out.w (layers, H, C) = W1q and out.scale (layers) = w_s of every layer of the bank, in two launches
// (the scales, then the weights); `scratch`: mlp_fp8_weight_scratch_floats partials and a counter
// zeroed once. After every optimizer step that changes c_fc, and at init.
inline void mlp_fp8_quantize_weights(const Fp8UpWeights& out, const MlpFcBank& bank, int H, int C,
                                     BlockPartials scratch, cudaStream_t stream) {
    require_shape(mlp_fp8_shape_error(1, C, H, {out.w, bank.c_fc}), "mlp_fp8_quantize_weights");
    kernel_require(bank.layers >= 1 && bank.layer_stride % 8 == 0 && bank.layer_stride >= int64_t(H) * C,
                   "mlp_fp8_quantize_weights: %d layers %lld elements apart: need at least one layer, a stride of at "
                   "least H C = %lld and a multiple of 8",
                   bank.layers, (long long)bank.layer_stride, (long long)(int64_t(H) * C));
    const int64_t n = int64_t(H) * C;
    const int per_layer = mlp_fp8_weight_blocks_per_layer(H, C);
    launch(mlp_fp8_weight_scale_work(bank.layers, H, C), mlp_fp8_weight_scale_kernel, dim3(per_layer * bank.layers),
           dim3(kFp8Threads), 0, stream, out.scale, 1, bank, n, per_layer, scratch);
    CUDA_CHECK_LAUNCH();
    const int64_t packs = n / 8 * bank.layers;
    launch(mlp_fp8_quantize_weights_work(bank.layers, H, C), mlp_fp8_quantize_weights_kernel,
           dim3(static_cast<unsigned>(ceil_div<int64_t>(packs, kFp8Threads))), dim3(kFp8Threads), 0, stream, out.w,
           out.scale, bank, n);
    CUDA_CHECK_LAUNCH();
}

// ---- activations: the amax pass, then the quantize pass ----
// Partials of x's amax; the last block writes a, 448 / a and the dequant.
__global__ void __launch_bounds__(kFp8Threads)
    mlp_fp8_input_amax_kernel(Fp8UpScales* scales, const __nv_bfloat16* x, int64_t n, const float* w_scale,
                              BlockPartials scratch) {
    const uint32_t m = block_reduce_max_bits(abs_max_bits(x, n, int64_t(blockIdx.x) * blockDim.x + threadIdx.x,
                                                          int64_t(gridDim.x) * blockDim.x));
    if (threadIdx.x == 0) scratch.partials[blockIdx.x] = __uint_as_float(m);
    if (!last_block_done(scratch.done)) return;
    uint32_t all = 0;
    for (int i = threadIdx.x; i < static_cast<int>(gridDim.x); i += blockDim.x)
        all = max(all, __float_as_uint(scratch.partials[i]));
    all = block_reduce_max_bits(all);
    if (threadIdx.x == 0) {
        const float a = clamp_amax(__uint_as_float(all));
        *scales = Fp8UpScales{.amax = a, .x_scale = kE4m3Max / a, .dequant = *w_scale * a / kE4m3Max, .unused = 0.0f};
    }
}
// xq = e4m3(x * 448 / a), 8 elements a thread.
__global__ void __launch_bounds__(kFp8Threads)
    mlp_fp8_quantize_input_kernel(__nv_fp8_e4m3* xq, const __nv_bfloat16* x, int64_t n, const Fp8UpScales* scales) {
    const int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
    if (p >= n / 8) return;
    const float q = scales->x_scale;
    *reinterpret_cast<uint2*>(reinterpret_cast<unsigned char*>(xq) + 8 * p) =
        e4m3_pack8(load128(x + 8 * p), [q](float v) { return v * q; });
}
// The input amax's partials: one float per block.
inline size_t mlp_fp8_input_scratch_floats(int T, int C) { return size_t(fp8_amax_blocks(int64_t(T) * C)); }
// Reads x, w_s, the partials and the counter; writes the partials, the scales and the counter.
inline Work mlp_fp8_input_amax_work(int T, int C) {
    const double n = double(T) * C, partials = 4.0 * mlp_fp8_input_scratch_floats(T, C);
    return Work{.name = "mlp_fp8_input_amax", .flops = n, .bytes_read = 2 * n + partials + 8,
                .bytes_written = partials + sizeof(Fp8UpScales) + 4};
}
// Reads x and the scale, writes xq; a multiply and a conversion per element.
inline Work mlp_fp8_quantize_input_work(int T, int C) {
    const double n = double(T) * C;
    return Work{.name = "mlp_fp8_quantize_input", .flops = 2 * n, .bytes_read = 2 * n + 4, .bytes_written = n};
}
// up.scales and up.xq (T, C) from x (T, C): the amax pass and the quantize pass, no host sync.
inline void mlp_fp8_quantize_input(const Fp8Up& up, const __nv_bfloat16* x, int T, int C, cudaStream_t stream) {
    require_shape(mlp_fp8_shape_error(T, C, 8, {up.xq, x}), "mlp_fp8_quantize_input");
    const int64_t n = int64_t(T) * C;
    launch(mlp_fp8_input_amax_work(T, C), mlp_fp8_input_amax_kernel, dim3(fp8_amax_blocks(n)), dim3(kFp8Threads), 0,
           stream, up.scales, x, n, up.w_scale, up.amax);
    CUDA_CHECK_LAUNCH();
    launch(mlp_fp8_quantize_input_work(T, C), mlp_fp8_quantize_input_kernel,
           dim3(static_cast<unsigned>(ceil_div<int64_t>(n / 8, kFp8Threads))), dim3(kFp8Threads), 0, stream, up.xq, x,
           n, up.scales);
    CUDA_CHECK_LAUNCH();
}

// ---- the GEMM ----
// The MMAs the grid executes: linear_relu_square_tc_flops' tiles over C in whole 128-wide k-steps.
inline double linear_relu_square_fp8_tc_flops(MlpKernel k, int T, int C, int H) {
    const int tile_cols = k == MlpKernel::wgmma ? kFcwCols : kFcTileCols;
    const double rows = ceil_div(T, kFcTileRows) * kFcTileRows, cols = ceil_div(H, tile_cols) * tile_cols;
    return 2 * rows * cols * (ceil_div(C, fc_tile_k<__nv_fp8_e4m3>()) * fc_tile_k<__nv_fp8_e4m3>());
}
// Reads xq, W1q and the dequant, writes pre and post (or post alone); a multiply, a max and a square per output.
inline Work linear_relu_square_forward_fp8_work(MlpKernel k, int T, int C, int H,
                                                ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    const double written = (saves == ReluSquareSaves::post_only ? 2.0 : 4.0) * T * H;
    return Work{.name = "linear_relu_square_forward_fp8", .tc_flops = linear_relu_square_fp8_tc_flops(k, T, C, H),
                .flops = 3.0 * T * H, .bytes_read = 1.0 * (T + H) * C + 4, .bytes_written = written,
                .m = H, .n = T, .k = C};
}
// pre (T, H) = bf16(fp32(up.xq (T, C) @ up.w (H, C)^T) * up.scales->dequant), post = relu(pre)^2 (with
// saves post_only post alone, pre null); one kernel, k's (mlp_fp8_quantize_input has written xq and
// the scales).
inline void linear_relu_square_forward_fp8(MlpKernel k, __nv_bfloat16* pre, __nv_bfloat16* post, const Fp8Up& up,
                                           int T, int C, int H, cudaStream_t stream,
                                           ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_saves(saves, pre, "linear_relu_square_forward_fp8");
    require_shape(mlp_fp8_shape_error(T, C, H, {pre, post, up.xq, up.w}), "linear_relu_square_forward_fp8");
    const Work work = linear_relu_square_forward_fp8_work(k, T, C, H, saves);
    if (saves == ReluSquareSaves::post_only)
        launch_linear_relu_square<FcEpilogue::relu_square_post, __nv_fp8_e4m3>(k, work, post, nullptr, nullptr, up.xq,
                                                                              up.w, T, C, H, stream, &up.scales->dequant);
    else
        launch_linear_relu_square<FcEpilogue::relu_square_forward, __nv_fp8_e4m3>(k, work, pre, post, nullptr, up.xq,
                                                                                 up.w, T, C, H, stream,
                                                                                 &up.scales->dequant);
}

// mlp_forward with the FP8 up-projection (training, record 84): xq and the scales from x, then pre and
// post (post only: post) from the e4m3 GEMM, out = post @ c_proj in bf16. The backward is mlp_backward's,
// from x and the bf16 c_fc, with the same saves.
inline void mlp_forward_fp8(CublasLt& lt, MlpKernel k, __nv_bfloat16* out, __nv_bfloat16* pre, __nv_bfloat16* post,
                            const __nv_bfloat16* x, const Fp8Up& up, const __nv_bfloat16* c_proj, int T, int C, int H,
                            cudaStream_t stream, ReluSquareSaves saves = ReluSquareSaves::pre_and_post) {
    require_saves(saves, pre, "mlp_forward_fp8");
    require_shape(mlp_fp8_shape_error(T, C, H, {out, pre, post, x, up.xq, up.w, c_proj}), "mlp_forward_fp8");
    mlp_fp8_quantize_input(up, x, T, C, stream);
    linear_relu_square_forward_fp8(k, pre, post, up, T, C, H, stream, saves);
    matmul_bf16(lt, out, post, false, c_proj, false, T, C, H, stream, 1.0f, 0.0f, nullptr, {}, "gemm_mlp_proj");
}

// ---- the FP8 down-projection with delayed scaling (record 89; the training forward only) ----
// Upstream 75d6867a: quantize_mlp_fp8 (train_gpt.py L1403-1434) after every optimizer step
// (bootstrap_down = step < 16) and at init and after the warm-up's reset (bootstrap); the forward's
// use_mlp_fp8 branch (L1643-1675); triton_kernels.py's linear_relu_square EMIT_FP8 epilogue (L463-491),
// reduce_mlp_activation_scales and quantize_transpose_mlp_down_weights (L494-565, L743-785). Per layer l:
// - Weights, W2 = c_proj (H, C) bf16: with bootstrap, next = bf16(max(max|W2|, bf16(1e-12)) / 448) (eager
//   torch, as the up-projection's w_s); then used = next, W2q = e4m3(clamp(fp32(W2) / used, +-448))
//   (an IEEE fp32 division, cvt.rn.satfinite) stored transposed (C, H), and next = max(max|W2|, 1e-12) *
//   fp32(1.12 / 448) (the headroom over 448 divided in double, as Triton folds the constexpr, rounded
//   once to fp32 when it multiplies). So from step 16 on the weights of step s are quantized with
//   step s - 1's amax times 1.12; a larger |W2 / used| clamps to 448.
// - Activations: the post-only up-projection's epilogue writes postq = e4m3(min(post / act, 448)) and
//   amax partials of the bf16 post (Fp8DownAct); after the layers one launch sets
//   act = max(max partials, 1e-12) * fp32(1.80 / 448) for the next training forward (one step late,
//   per rank and per micro-step, never all-reduced; validation runs bf16 and leaves it).
// - out (T, C) = bf16(fp32(postq @ W2q^T) * act * used) by cuBLASLt's FP8 matmul with fast
//   accumulation (upstream's _scaled_mm(use_fast_accum=True)); emu accumulates exactly in fp32.
// The backward is unchanged: bf16 from post and W2 (mlp_backward with ReluSquareSaves::post_only).
// All scales start at 1 (upstream's persistent buffers of ones, restored to 1 after the warm-up).

// One layer's scales, each at the start of its own 16-byte slot: cuBLASLt's FP8 scale pointers must
// be 16-byte aligned (an H100 refused them 4 bytes off), and act and used are its two.
struct alignas(16) MlpDownScales {
    float act = 1.0f, act_pad[3] = {};    // the activations' scale (of the next training forward)
    float used = 1.0f, used_pad[3] = {};  // the scale W2q was quantized with
    float next = 1.0f, next_pad[3] = {};  // the scale of the next quantization
};
static_assert(sizeof(MlpDownScales) == 48 && offsetof(MlpDownScales, used) == 16 && offsetof(MlpDownScales, next) == 32,
              "16-byte slots");
constexpr int kMlpDownScaleStride = sizeof(MlpDownScales) / sizeof(float);
// Quantization's headrooms over the amax (upstream's HEADROOM / 448.0 folded in double), and its floor.
constexpr float kMlpDownWeightHeadroom = static_cast<float>(1.12 / 448.0);
constexpr float kMlpDownActHeadroom = static_cast<float>(1.80 / 448.0);
constexpr float kMlpDownAmaxFloor = 1e-12f;
// Whether quantize_mlp_fp8 bootstraps the weights' scale from their own amax (steps < 16, init and
// after the warm-up) or uses the one the previous quantization left (delayed).
enum class MlpDownScaling { delayed, bootstrap };

// The weights of every layer: W2q (layers, C, H) e4m3, layer l's (C, H) at w + l C H, and the scales.
struct Fp8DownWeights {
    __nv_fp8_e4m3* w;
    MlpDownScales* scales;  // (layers)
};
// An MLP bank's c_proj: layer l's (H, C) bf16 at c_proj + l * layer_stride (elements).
struct MlpProjBank {
    const __nv_bfloat16* c_proj;
    int64_t layer_stride;
    int layers;
};

constexpr int kDownQuantTile = 64, kDownQuantThreads = 128;
inline int mlp_fp8_down_weight_tiles(int H, int C) { return ceil_div(H, kDownQuantTile) * ceil_div(C, kDownQuantTile); }
// W2q of one 64 x 64 tile (rows h, columns c) of layer blockIdx.y: e4m3(clamp(W2 / used, +-448)) through
// shared memory, written transposed with 16-byte stores; partials[layer * tiles + tile] = the tile's
// max |W2| (fp32 bits). Reads used from `next`, as upstream's kernel reads next_scale (the launch
// before has not moved it), and block 0 records it as used.
__global__ void __launch_bounds__(kDownQuantThreads)
    mlp_fp8_down_quantize_kernel(__nv_fp8_e4m3* w, MlpDownScales* scales, MlpProjBank bank, int H, int C,
                                 float* partials) {
    __shared__ __align__(16) unsigned char tile[kDownQuantTile][kDownQuantTile + 16];  // codes [h][c]
    const int layer = blockIdx.y, tiles_c = ceil_div(C, kDownQuantTile);
    const int h0 = (blockIdx.x / tiles_c) * kDownQuantTile, c0 = (blockIdx.x % tiles_c) * kDownQuantTile;
    const float s = scales[layer].next;
    const __nv_bfloat16* src = bank.c_proj + layer * bank.layer_stride;
    uint32_t amax = 0;
    for (int i = threadIdx.x; i < kDownQuantTile * kDownQuantTile / 16; i += blockDim.x) {
        const int hh = i / (kDownQuantTile / 16), cc = (i % (kDownQuantTile / 16)) * 16;
        if (h0 + hh >= H || c0 + cc >= C) continue;
        const Pack128<__nv_bfloat16> v[2] = {load128(src + size_t(h0 + hh) * C + c0 + cc),
                                             load128(src + size_t(h0 + hh) * C + c0 + cc + 8)};
        const auto q = [s](float x) { return fmaxf(fminf(x / s, 448.0f), -448.0f); };  // upstream's order (NaN: 448)
        const uint2 lo = e4m3_pack8(v[0], q), hi = e4m3_pack8(v[1], q);
        *reinterpret_cast<uint4*>(&tile[hh][cc]) = make_uint4(lo.x, lo.y, hi.x, hi.y);
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = max(amax, max(abs_bits(v[0][k]), abs_bits(v[1][k])));
    }
    __syncthreads();
    // W2q row c holds column c of the tile: each thread writes 16 consecutive h of one column
    unsigned char* out = reinterpret_cast<unsigned char*>(w) + size_t(layer) * C * H;
    for (int i = threadIdx.x; i < kDownQuantTile * kDownQuantTile / 16; i += blockDim.x) {
        const int cc = i / (kDownQuantTile / 16), hh = (i % (kDownQuantTile / 16)) * 16;
        if (h0 + hh >= H || c0 + cc >= C) continue;
        uint32_t word[4];
#pragma unroll
        for (int q = 0; q < 4; ++q)
            word[q] = uint32_t(tile[hh + 4 * q][cc]) | uint32_t(tile[hh + 4 * q + 1][cc]) << 8 |
                      uint32_t(tile[hh + 4 * q + 2][cc]) << 16 | uint32_t(tile[hh + 4 * q + 3][cc]) << 24;
        *reinterpret_cast<uint4*>(out + size_t(c0 + cc) * H + h0 + hh) = make_uint4(word[0], word[1], word[2], word[3]);
    }
    amax = block_reduce_max_bits(amax);
    if (threadIdx.x == 0) {
        partials[size_t(layer) * gridDim.x + blockIdx.x] = __uint_as_float(amax);
        if (blockIdx.x == 0) scales[layer].used = s;
    }
}

// A delayed scale per layer (block): *scale = max(max of the layer's `count` partials, 1e-12) * headroom,
// layer l's partials at partials + l * count and its scale at scale + l * kMlpDownScaleStride.
// fmaxf, as Triton's tl.maximum, takes a NaN amax to the floor.
__global__ void __launch_bounds__(kFp8Threads)
    mlp_fp8_down_delayed_scale_kernel(float* scale, const float* partials, int64_t count, float headroom) {
    uint32_t m = 0;
    const float* p = partials + blockIdx.x * count;
    for (int64_t i = threadIdx.x; i < count; i += blockDim.x) m = max(m, __float_as_uint(p[i]));
    m = block_reduce_max_bits(m);
    if (threadIdx.x == 0)
        scale[size_t(blockIdx.x) * kMlpDownScaleStride] = fmaxf(__uint_as_float(m), kMlpDownAmaxFloor) * headroom;
}
// Reads the layers' partials, writes their scales; a compare per partial.
inline Work mlp_fp8_down_delayed_scale_work(const char* name, int layers, int64_t count) {
    const double partials = double(layers) * count;
    return Work{.name = name, .flops = partials, .bytes_read = 4 * partials, .bytes_written = 4.0 * layers};
}

inline std::string mlp_fp8_down_shape_error(int T, int C, int H, std::initializer_list<const void*> pointers) {
    if (T <= 0 || C <= 0 || H <= 0 || T % 16 != 0 || C % 16 != 0 || H % 16 != 0)
        return "T (" + std::to_string(T) + "), C (" + std::to_string(C) + ") and H (" + std::to_string(H) +
               ") must be positive multiples of 16 (cuBLASLt's FP8 matmul; 16-byte e4m3 rows)";
    if (ceil_div(T, kFcTileRows) > 65535) return "T (" + std::to_string(T) + ") needs more than 65535 row tiles";
    if (!all_aligned16(pointers)) return "a buffer is not 16-byte aligned";
    return "";
}
// The weight quantization's scratch: the bootstrap's amax partials (mlp_fp8_weight_scratch_floats) and,
// after them in stream order, one partial per layer and 64 x 64 tile; one BlockPartials serves both.
inline size_t mlp_fp8_down_weight_scratch_floats(int layers, int H, int C) {
    return std::max(mlp_fp8_weight_scratch_floats(layers, H, C), size_t(layers) * mlp_fp8_down_weight_tiles(H, C));
}
// Reads the bank's weights and the scales, writes W2q, used and the tiles' partials; a division, two
// clamps and a conversion per element.
inline Work mlp_fp8_down_quantize_work(int layers, int H, int C) {
    const double n = double(layers) * H * C, partials = 4.0 * layers * mlp_fp8_down_weight_tiles(H, C);
    return Work{.name = "mlp_fp8_down_quantize", .flops = 4 * n, .bytes_read = 2 * n + 4.0 * layers,
                .bytes_written = n + partials + 4.0 * layers};
}
// quantize_mlp_fp8's down half for every layer of the bank: with bootstrap, next from W2's amax; then
// W2q (out.w) from next, used = next, and next = the amax times 1.12 over 448 (three launches, two
// without bootstrap). scratch: mlp_fp8_down_weight_scratch_floats partials and a counter zeroed once.
inline void mlp_fp8_down_quantize_weights(const Fp8DownWeights& out, const MlpProjBank& bank, int H, int C,
                                          MlpDownScaling scaling, BlockPartials scratch, cudaStream_t stream) {
    require_shape(mlp_fp8_down_shape_error(16, C, H, {out.w, out.scales, bank.c_proj}), "mlp_fp8_down_quantize_weights");
    kernel_require(bank.layers >= 1 && bank.layer_stride % 8 == 0 && bank.layer_stride >= int64_t(H) * C,
                   "mlp_fp8_down_quantize_weights: %d layers %lld elements apart: need at least one layer, a stride of "
                   "at least H C = %lld and a multiple of 8",
                   bank.layers, (long long)bank.layer_stride, (long long)(int64_t(H) * C));
    const int64_t n = int64_t(H) * C;
    if (scaling == MlpDownScaling::bootstrap) {
        const int per_layer = mlp_fp8_weight_blocks_per_layer(H, C);
        launch(mlp_fp8_weight_scale_work(bank.layers, H, C), mlp_fp8_weight_scale_kernel, dim3(per_layer * bank.layers),
               dim3(kFp8Threads), 0, stream, &out.scales->next, kMlpDownScaleStride,
               MlpFcBank{bank.c_proj, bank.layer_stride, bank.layers}, n, per_layer, scratch);
        CUDA_CHECK_LAUNCH();
    }
    const int tiles = mlp_fp8_down_weight_tiles(H, C);
    launch(mlp_fp8_down_quantize_work(bank.layers, H, C), mlp_fp8_down_quantize_kernel,
           dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(bank.layers)), dim3(kDownQuantThreads), 0, stream,
           out.w, out.scales, bank, H, C, scratch.partials);
    CUDA_CHECK_LAUNCH();
    launch(mlp_fp8_down_delayed_scale_work("mlp_fp8_down_weight_scales", bank.layers, tiles),
           mlp_fp8_down_delayed_scale_kernel, dim3(static_cast<unsigned>(bank.layers)), dim3(kFp8Threads), 0, stream,
           &out.scales->next, scratch.partials, int64_t(tiles), kMlpDownWeightHeadroom);
    CUDA_CHECK_LAUNCH();
}

// The activations' amax partials of one layer's forward on kernel k: kFcAmaxSlotsPerTile per tile.
inline int64_t mlp_fp8_down_act_partials(MlpKernel k, int T, int H) {
    const int tile_cols = k == MlpKernel::wgmma ? kFcwCols : kFcTileCols;
    return int64_t(ceil_div(T, kFcTileRows)) * ceil_div(H, tile_cols) * kFcAmaxSlotsPerTile;
}
// Reads xq, W1q, the dequant and act; writes post (with pre_and_post pre too), postq and the partials
// (its own family: the profiler would otherwise count it as the plain FP8 forward).
inline Work linear_relu_square_forward_fp8_down_work(MlpKernel k, int T, int C, int H,
                                                     ReluSquareSaves saves = ReluSquareSaves::post_only) {
    Work w = linear_relu_square_forward_fp8_work(k, T, C, H, saves);
    w.name = "linear_relu_square_forward_fp8_down";
    w.flops += 2.0 * T * H;
    w.bytes_read += 4;
    w.bytes_written += 1.0 * T * H + 4.0 * mlp_fp8_down_act_partials(k, T, H);
    return w;
}
// Records 84 + 87 + 89: post (T, H) = relu(bf16(fp32(up.xq @ up.w^T) * dequant))^2 as
// linear_relu_square_forward_fp8 with post only, and down.postq and down.partials (Fp8DownAct). With
// down.pre (record 89's PR on record 84) also pre = bf16(...), as linear_relu_square_forward_fp8 with
// pre_and_post.
inline void linear_relu_square_forward_fp8_down(MlpKernel k, __nv_bfloat16* post, const Fp8DownAct& down,
                                                const Fp8Up& up, int T, int C, int H, cudaStream_t stream) {
    require_shape(mlp_fp8_shape_error(T, C, H, {post, up.xq, up.w, down.postq, down.partials, down.pre}),
                  "linear_relu_square_forward_fp8_down");
    kernel_require(down.act != nullptr, "linear_relu_square_forward_fp8_down: no activation scale");
    if (down.pre == nullptr) {
        launch_linear_relu_square<FcEpilogue::relu_square_post_fp8, __nv_fp8_e4m3>(
            k, linear_relu_square_forward_fp8_down_work(k, T, C, H), post, nullptr, nullptr, up.xq, up.w, T, C, H,
            stream, &up.scales->dequant, down);
        return;
    }
    kernel_require(down.pre != post, "linear_relu_square_forward_fp8_down: pre and post are one buffer");
    launch_linear_relu_square<FcEpilogue::relu_square_forward_fp8, __nv_fp8_e4m3>(
        k, linear_relu_square_forward_fp8_down_work(k, T, C, H, ReluSquareSaves::pre_and_post), down.pre, post, nullptr,
        up.xq, up.w, T, C, H, stream, &up.scales->dequant, down);
}
// After the layers' forwards: scales[l].act = max(max of layer l's partials, 1e-12) * 1.80 / 448 for
// l < layers, layer l's mlp_fp8_down_act_partials(k, T, H) = count partials at partials + l * count.
inline void mlp_fp8_down_act_scales(MlpDownScales* scales, const float* partials, int64_t count, int layers,
                                    cudaStream_t stream) {
    kernel_require(layers >= 1 && count >= 1, "mlp_fp8_down_act_scales: %d layers of %lld partials", layers,
                   (long long)count);
    launch(mlp_fp8_down_delayed_scale_work("mlp_fp8_down_act_scales", layers, count), mlp_fp8_down_delayed_scale_kernel,
           dim3(static_cast<unsigned>(layers)), dim3(kFp8Threads), 0, stream, &scales->act, partials, count,
           kMlpDownActHeadroom);
    CUDA_CHECK_LAUNCH();
}
// out (T, C) = bf16(fp32(postq (T, H) @ w2q (C, H)^T) * scale.act * scale.used): one layer's FP8
// down-projection, w2q that layer's Fp8DownWeights::w + l C H, scale its MlpDownScales.
inline void mlp_fp8_down_proj(CublasLt& lt, __nv_bfloat16* out, const __nv_fp8_e4m3* postq,
                              const __nv_fp8_e4m3* w2q, const MlpDownScales* scale, int T, int C, int H,
                              cudaStream_t stream) {
    require_shape(mlp_fp8_down_shape_error(T, C, H, {out, postq, w2q, scale}), "mlp_fp8_down_proj");
    matmul_fp8(lt, out, postq, &scale->act, w2q, &scale->used, T, C, H, stream, /*fast_accum=*/true, 0.0f,
               "gemm_mlp_proj_fp8");
}

// mlp_forward for records 84 + 87 + 89 (training): xq and its scales from x, post (post only) with postq and
// this layer's amax partials (mlp_fp8_down_act_partials(k, T, H) floats) from the e4m3 up-projection,
// then out = the FP8 down-projection with the layer's scale (act, used) and W2q (C, H). The backward
// is mlp_backward's with ReluSquareSaves::post_only; after the layers, mlp_fp8_down_act_scales.
inline void mlp_forward_fp8_down(CublasLt& lt, MlpKernel k, __nv_bfloat16* out, __nv_bfloat16* post,
                                 __nv_fp8_e4m3* postq, float* partials, const __nv_bfloat16* x, const Fp8Up& up,
                                 const __nv_fp8_e4m3* w2q, const MlpDownScales* scale, int T, int C, int H,
                                 cudaStream_t stream) {
    require_shape(mlp_fp8_down_shape_error(T, C, H, {out, post, postq, partials, x, up.xq, up.w, w2q, scale}),
                  "mlp_forward_fp8_down");
    mlp_fp8_quantize_input(up, x, T, C, stream);
    linear_relu_square_forward_fp8_down(k, post, {postq, partials, &scale->act}, up, T, C, H, stream);
    mlp_fp8_down_proj(lt, out, postq, w2q, scale, T, C, H, stream);
}

// ---- lambda-scaled weight: the attention's F.linear(x, sa_lambda * w), with sa_lambda a scalar
// parameter read from device memory; an attention layer's wqkv and wo go in one launch each way, as
// three pieces where the banks hold [Wq; Wk] apart from Wv (record 80: one lambda over two pieces) ----
constexpr int kLambdaScaledMaxWeights = 3;
// w_eff = lambda * w, n bf16 elements.
struct LambdaScaledForward {
    __nv_bfloat16* w_eff;
    const __nv_bfloat16* w;
    const float* lambda;
    int64_t n;
};
// The weights of one launch; weight i takes blocks [first_block[i], first_block[i + 1]). Adjacent weights
// with one lambda form a run: its first weight's sum_end is where the run's blocks end (the backward sums
// all their partials into the one dlambda), the others' -1.
template <class Weight>
struct LambdaScaledBatch {
    Weight weight[kLambdaScaledMaxWeights] = {};
    int first_block[kLambdaScaledMaxWeights + 1] = {};
    int sum_end[kLambdaScaledMaxWeights] = {};
    int count = 0;
};
// Which of the batch's weights this block works on. The kernels pick each field with ternaries on it
// (lambda_scaled_pick): a dynamic index into the parameter struct would copy it to the stack.
template <class Weight>
__device__ __forceinline__ int lambda_scaled_index(const LambdaScaledBatch<Weight>& b) {
    const int x = static_cast<int>(blockIdx.x);
    return b.count > 2 && x >= b.first_block[2] ? 2 : b.count > 1 && x >= b.first_block[1] ? 1 : 0;
}
template <class T>
__device__ __forceinline__ T lambda_scaled_pick(int k, T w0, T w1, T w2) {
    return k == 2 ? w2 : k == 1 ? w1 : w0;
}
// Lays out a batch: `blocks(n)` blocks per weight, in list order; every weight's shape is checked, and
// weights that share a lambda must be adjacent.
template <class Weight, class Blocks, class Check>
LambdaScaledBatch<Weight> lambda_scaled_batch(std::initializer_list<Weight> weights, Blocks blocks, Check check,
                                              const char* launcher) {
    kernel_require(weights.size() >= 1 && weights.size() <= kLambdaScaledMaxWeights,
                   "%s: %zu weights, need 1 to %d", launcher, weights.size(), kLambdaScaledMaxWeights);
    LambdaScaledBatch<Weight> b;
    int run = 0;  // the first weight of the current run
    for (const Weight& w : weights) {
        require_shape(check(w), launcher);
        const int i = b.count;
        b.weight[i] = w;
        b.first_block[i + 1] = b.first_block[i] + blocks(w.n);
        for (int j = 0; j < run; ++j)
            kernel_require(b.weight[j].lambda != w.lambda, "%s: weights %d and %d share a lambda but are not adjacent",
                           launcher, j, i);
        if (i > 0 && b.weight[run].lambda == w.lambda) {
            b.sum_end[i] = -1;
        } else {
            run = i;
        }
        b.sum_end[run] = b.first_block[i + 1];
        ++b.count;
    }
    return b;
}

// w_eff = lambda * w, computed in fp32 and rounded to bf16 once
__global__ void __launch_bounds__(kPackThreads)
    lambda_scaled_weight_forward_kernel(LambdaScaledBatch<LambdaScaledForward> batch) {
    const int k = lambda_scaled_index(batch);
    const LambdaScaledForward &f0 = batch.weight[0], &f1 = batch.weight[1], &f2 = batch.weight[2];
    const int first = lambda_scaled_pick(k, 0, batch.first_block[1], batch.first_block[2]);
    const int64_t i = (static_cast<int64_t>(blockIdx.x - first) * blockDim.x + threadIdx.x) * 8;
    if (i >= lambda_scaled_pick(k, f0.n, f1.n, f2.n)) return;
    const float l = *lambda_scaled_pick(k, f0.lambda, f1.lambda, f2.lambda);
    const Pack128<__nv_bfloat16> p = load128(lambda_scaled_pick(k, f0.w, f1.w, f2.w) + i);
    Pack128<__nv_bfloat16> out;
#pragma unroll
    for (int j = 0; j < 8; ++j) out[j] = __float2bfloat16(l * __bfloat162float(p[j]));
    store128(lambda_scaled_pick(k, f0.w_eff, f1.w_eff, f2.w_eff) + i, out);
}
// Reads each w and lambda, writes each w_eff; a multiply per element.
inline Work lambda_scaled_weight_forward_work(const LambdaScaledBatch<LambdaScaledForward>& b) {
    Work work{.name = "lambda_scaled_weight_forward"};
    for (int i = 0; i < b.count; ++i) {
        const double n = static_cast<double>(b.weight[i].n);
        work.flops += n;
        work.bytes_read += 2 * n + sizeof(float);
        work.bytes_written += 2 * n;
    }
    return work;
}
// Each weight's w_eff = lambda * w: an attention layer's {wqkv, sa_lambdas[0]} and {wo, sa_lambdas[1]}
// (with the banks: {wqk, sa_lambdas[0]}, {wv, sa_lambdas[0]}, {wo, sa_lambdas[1]}).
inline void lambda_scaled_weight_forward(std::initializer_list<LambdaScaledForward> weights, cudaStream_t stream) {
    const auto batch = lambda_scaled_batch(
        weights, [](int64_t n) { return static_cast<int>(bf16_packs_grid(n).x); },
        [](const LambdaScaledForward& f) { return bf16_packs_shape_error(f.n, {f.w_eff, f.w}); },
        "lambda_scaled_weight_forward");
    launch(lambda_scaled_weight_forward_work(batch), lambda_scaled_weight_forward_kernel,
           dim3(batch.first_block[batch.count]), dim3(kPackThreads), 0, stream, batch);
    CUDA_CHECK_LAUNCH();
}

// The backward's block count per weight depends on n only, so the partial sums (and dlambda) are the
// same bits on every run and every GPU.
constexpr int kLambdaGradMaxBlocks = 1024;
inline int lambda_scaled_weight_backward_blocks(int64_t n) {
    const int64_t blocks = ceil_div<int64_t>(n / 8, kPackThreads);
    return static_cast<int>(std::clamp<int64_t>(blocks, 1, kLambdaGradMaxBlocks));
}
// The partials of one launch over weights of these sizes.
inline size_t lambda_scaled_weight_backward_scratch_bytes(std::initializer_list<int64_t> sizes) {
    size_t blocks = 0;
    for (int64_t n : sizes) blocks += lambda_scaled_weight_backward_blocks(n);
    return blocks * sizeof(float);
}
// dw (+)= lambda * dw_eff and dlambda (+)= sum(dw_eff * w); dw_eff is the bf16 gradient of w_eff.
struct LambdaScaledBackward {
    __nv_bfloat16* dw;
    float* dlambda;
    const __nv_bfloat16* dw_eff;
    const __nv_bfloat16* w;
    const float* lambda;
    int64_t n;
};
// Which gradients lambda_scaled_weight_backward adds into (write them with designators).
struct LambdaScaledAccumulate {
    bool dw;
    bool dlambda;
};

// dw (+)= lambda * dw_eff (fp32, rounded once); partials[block] = this block's part of sum(dw_eff * w).
// The last block to finish sums each weight's partials into its dlambda, in sum_fixed_order's order.
__global__ void __launch_bounds__(kPackThreads)
    lambda_scaled_weight_backward_kernel(LambdaScaledBatch<LambdaScaledBackward> batch, BlockPartials scratch,
                                         LambdaScaledAccumulate accumulate) {
    const int k = lambda_scaled_index(batch);
    const LambdaScaledBackward &b0 = batch.weight[0], &b1 = batch.weight[1], &b2 = batch.weight[2];
    const int first = lambda_scaled_pick(k, 0, batch.first_block[1], batch.first_block[2]);
    const int blocks = lambda_scaled_pick(k, batch.first_block[1], batch.first_block[2], batch.first_block[3]) - first;
    __nv_bfloat16* dw = lambda_scaled_pick(k, b0.dw, b1.dw, b2.dw);
    const __nv_bfloat16* dw_eff = lambda_scaled_pick(k, b0.dw_eff, b1.dw_eff, b2.dw_eff);
    const __nv_bfloat16* w = lambda_scaled_pick(k, b0.w, b1.w, b2.w);
    const int64_t n = lambda_scaled_pick(k, b0.n, b1.n, b2.n);
    const float l = *lambda_scaled_pick(k, b0.lambda, b1.lambda, b2.lambda);
    float dot = 0.0f;
    for (int64_t i = (static_cast<int64_t>(blockIdx.x - first) * blockDim.x + threadIdx.x) * 8; i < n;
         i += static_cast<int64_t>(blocks) * blockDim.x * 8) {
        const Pack128<__nv_bfloat16> g = load128(dw_eff + i), p = load128(w + i);
        Pack128<__nv_bfloat16> d =
            accumulate.dw ? load128(dw + i) : Pack128<__nv_bfloat16>::filled(__float2bfloat16(0.0f));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float gj = __bfloat162float(g[j]);
            d[j] = __float2bfloat16(__bfloat162float(d[j]) + l * gj);
            dot += gj * __bfloat162float(p[j]);
        }
        store128(dw + i, d);
    }
    dot = block_reduce_sum(dot);
    if (threadIdx.x == 0) scratch.partials[blockIdx.x] = dot;
    if (!last_block_done(scratch.done)) return;
#pragma unroll
    for (int k = 0; k < kLambdaScaledMaxWeights; ++k) {  // unrolled: the weights stay in parameter space
        if (k >= batch.count) break;
        if (batch.sum_end[k] < 0) continue;  // summed with its run's first weight
        const int from = batch.first_block[k], count = batch.sum_end[k] - from;
        const float s = block_sum_as(scratch.partials + from, count, 1, sum_threads(count, kSumFixedOrderThreads));
        if (threadIdx.x == 0) {
            float* dl = batch.weight[k].dlambda;
            *dl = accumulate.dlambda ? *dl + s : s;
        }
    }
}
// Reads each dw_eff, w, lambda (dw and dlambda too when accumulating); writes each dw and dlambda, a
// partial per block that the last block reads back, and the ticket counter; two multiply-adds per element.
inline Work lambda_scaled_weight_backward_work(const LambdaScaledBatch<LambdaScaledBackward>& b,
                                               LambdaScaledAccumulate accumulate) {
    const double partials = 4.0 * b.first_block[b.count], counter = sizeof(unsigned int);
    Work work{.name = "lambda_scaled_weight_backward", .flops = 1.0 * b.first_block[b.count],
              .bytes_read = partials + counter, .bytes_written = partials + counter};
    for (int i = 0; i < b.count; ++i) {
        const double n = static_cast<double>(b.weight[i].n), dlambda = b.sum_end[i] >= 0 ? sizeof(float) : 0.0;
        work.flops += 4 * n;
        work.bytes_read += (accumulate.dw ? 6 : 4) * n + sizeof(float) + (accumulate.dlambda ? dlambda : 0);
        work.bytes_written += 2 * n + dlambda;
    }
    return work;
}
// For each weight, dw (+)= lambda * dw_eff and dlambda (+)= sum(dw_eff * w), summed deterministically
// through `scratch` (lambda_scaled_weight_backward_scratch_bytes of the weights' sizes); adjacent weights
// with one lambda (and so one dlambda) add their sums into it together.
inline void lambda_scaled_weight_backward(std::initializer_list<LambdaScaledBackward> weights, BlockPartials scratch,
                                          LambdaScaledAccumulate accumulate, cudaStream_t stream) {
    const auto batch = lambda_scaled_batch(
        weights, lambda_scaled_weight_backward_blocks,
        [](const LambdaScaledBackward& b) { return bf16_packs_shape_error(b.n, {b.dw, b.dw_eff, b.w}); },
        "lambda_scaled_weight_backward");
    for (int i = 0; i < batch.count; ++i)
        for (int j = 0; j < i; ++j)
            kernel_require((batch.weight[i].lambda == batch.weight[j].lambda) ==
                               (batch.weight[i].dlambda == batch.weight[j].dlambda),
                           "lambda_scaled_weight_backward: weights %d and %d must share a dlambda exactly when they "
                           "share a lambda",
                           j, i);
    launch(lambda_scaled_weight_backward_work(batch, accumulate), lambda_scaled_weight_backward_kernel,
           dim3(batch.first_block[batch.count]), dim3(kPackThreads), 0, stream, batch, scratch, accumulate);
    CUDA_CHECK_LAUNCH();
}
