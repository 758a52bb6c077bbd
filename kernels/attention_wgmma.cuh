// Attention on Hopper's wgmma and TMA, in FlashAttention-3's structure: a producer warpgroup streams
// tiles with TMA through an mbarrier pipeline while consumer warpgroups multiply them with wgmma (both
// operands in shared memory for the score products, the scores from registers for the products that
// take them as A), keeping the softmax and the accumulators in registers. Included by attention.cuh,
// whose problem description (AttnProblem), tile walks (AttnQueryTile, attn_last_query) and launchers
// it shares; the mma.sync kernels there are the reference these are tested against.
//
//   forward:   block = 128 query rows of a head; fixed Q; streams K, V (V transposed)
//   dq:        block = 128 query rows of a head; fixed Q, dO; streams K, V (K transposed)
//   dk, dv:    block = 64 keys of a head; fixed K, V; streams Q, dO (both transposed) with lse and delta
//
// A consumer warpgroup owns 64 rows (wgmma's M; its warp w the rows 16w..16w+15) and walks the tiles of
// the other side exactly as the mma.sync kernel's 4 warps walk them for the same 64 rows. In the
// forward and dq kernels the two warpgroups of a block own rows q0 .. q0+63 and q0+64 .. q0+127; the
// producer streams key tiles from keys q0 + 64 down (tile j: keys [q0 + 64 - 64j, q0 + 128 - 64j)), so
// warpgroup 1 takes tiles 0 .. n1 - 1 and warpgroup 0 tiles 1 .. n0 (n0 >= n1: first keys do not
// decrease with the row), and a warpgroup passes over the tiles it does not take (it waits for them
// and releases them, which keeps the barrier phases in step). The dk/dv kernel has one consumer
// warpgroup: its two 64-column score blocks and the dk, dv accumulators fill the register budget.
//
// Same bits as the mma.sync kernels under emu: a thread of warp w of a consumer warpgroup holds, in
// wgmma's accumulator layout, exactly the values that lane of warp w holds in mma's C layout; every
// product chain adds its k-steps in the same order (ptx.cuh: the wgmma twin adds a k-step's products in
// k order, as the mma twin does), and the element-wise code is the same on the same values. The dk/dv
// kernel streams 64 queries per tile where the mma.sync kernel streams 32: the queries it adds beyond
// the mma kernel's last tile are hidden from every key, so they add exact zeros onto accumulators that
// start at +0 and so are never -0 (x + 0 == x). tests/kernels/test_attention.cu checks the bits.
//
// wgmma takes B K-major only (ptx.cuh): a product whose k dimension is the streamed tile's rows (P V,
// dS K, P^T dO, dS^T Q) needs that tile transposed. The producer warpgroup, idle between its TMA
// issues, writes the transposes (D rows of 64, 128-byte swizzle) before releasing the tile.
#pragma once

constexpr int kAttnWgRows = 64;   // rows of a consumer warpgroup (wgmma's M), and of every tile
constexpr int kAttnWgStages = 2;  // streamed tiles in flight
constexpr int kAttnWgBox = 64;    // TMA boxes: 64 rows of 64 elements (128 bytes, the 128-byte swizzle's row)
constexpr uint32_t kAttnWgBoxBytes = kAttnWgBox * kAttnWgBox * sizeof(__nv_bfloat16);
// Block sizes (launch bounds): a producer warpgroup and two consumers (forward, dq) or one (dk, dv).
constexpr int kAttnWgQueryThreads = 128 * 3;
constexpr int kAttnWgKeyThreads = 128 * 2;
static_assert(kAttnWgRows == kAttnTileKeys && kAttnWgBox == kAttnTileKeys, "64-key tiles, 64-row warpgroups");

// setmaxnreg: a warpgroup's register allotment. The CPU build has no register file: nothing to do.
template <int Regs>
__device__ __forceinline__ void attn_wg_setmaxnreg_dec() {
#ifdef __CUDACC__
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}
template <int Regs>
__device__ __forceinline__ void attn_wg_setmaxnreg_inc() {
#ifdef __CUDACC__
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Regs));
#endif
}

// A kernel's pipeline: `Fixed` tensors loaded once (64 rows for each of `Consumers` warpgroups), then
// tiles of two streamed tensors, of which `TCount` from index `TFirst` on are also transposed, and with
// `Stats` 64 entries each of lse and delta per tile. Shared memory, in bytes from a 1024-byte aligned
// base (the 128-byte swizzle's repeat): the fixed tiles, then per stage the streamed tiles and the
// transposes, then per stage the stats. A 64 x D tile is D / 64 boxes of 64 x 64, each 128-byte swizzled.
template <int D, int Consumers, int Fixed, int TFirst, int TCount, bool Stats>
struct AttnWgPipe {
    static constexpr int consumers = Consumers, fixed_count = Fixed, t_first = TFirst, t_count = TCount;
    static constexpr bool stats_rows = Stats;
    static constexpr int threads = 128 * (1 + Consumers);  // warpgroup 0 produces
    // With two consumers the launch gives every thread 168 registers (64K / 384, rounded down to 8);
    // setmaxnreg then moves the producer's to the consumers: 128 x (40 + 2 x 232) <= 64K. With one,
    // every thread may have 255 at launch (64K / 256) and there is nothing to move.
    static constexpr bool split_registers = Consumers > 1;
    static constexpr int producer_regs = 40, consumer_regs = 232;
    static_assert(!split_registers || 128 * (producer_regs + Consumers * consumer_regs) <= 65536, "the register file");

    static constexpr uint32_t tile = kAttnWgRows * D * sizeof(__nv_bfloat16);
    static constexpr uint32_t fixed(int f, int c) { return (f * Consumers + c) * tile; }
    static constexpr uint32_t stage0 = Fixed * Consumers * tile;
    static constexpr uint32_t stage_bytes = (2 + TCount) * tile;  // whole swizzle repeats: tiles stay aligned
    static constexpr uint32_t streamed(int s, int i) { return stage0 + s * stage_bytes + i * tile; }
    static constexpr uint32_t transposed(int s, int i) { return streamed(s, 2 + i); }  // of streamed TFirst + i
    static constexpr uint32_t stats_bytes = Stats ? 2 * kAttnWgRows * sizeof(float) : 0;  // lse[64], then delta[64]
    static constexpr uint32_t stats(int s) { return stage0 + kAttnWgStages * stage_bytes + s * stats_bytes; }
    static constexpr uint32_t bytes = stage0 + kAttnWgStages * (stage_bytes + stats_bytes);
    static constexpr size_t smem_bytes = bytes + 1024;  // room to align the base
    static_assert(smem_bytes <= 227 * 1024, "within Hopper's 227 KB per block");
};

// The block's barriers: the fixed tiles landed; per stage, the streamed tiles landed (TMA), the
// transposes and stats written (the producer's 128 threads), the stage released (every consumer thread).
struct AttnWgBarriers {
    uint64_t fixed_full;
    uint64_t full[kAttnWgStages], ready[kAttnWgStages], empty[kAttnWgStages];
};
template <int Consumers>
__device__ __forceinline__ void attn_wg_init_barriers(AttnWgBarriers& bar) {
    if (threadIdx.x == 0) {
        mbarrier_init(&bar.fixed_full, 1);
        for (int s = 0; s < kAttnWgStages; ++s) {
            mbarrier_init(&bar.full[s], 1);
            mbarrier_init(&bar.ready[s], 128);
            mbarrier_init(&bar.empty[s], 128 * Consumers);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
}
// The dynamic shared memory's first 1024-byte aligned byte.
__device__ __forceinline__ unsigned char* attn_wg_smem() {
    unsigned char* raw = dynamic_smem<unsigned char>();
    return raw + (1024 - smem_address(raw) % 1024) % 1024;
}

// Byte offset of element (row, col) of a 64 x D tile loaded by TMA: D / 64 boxes of 64 rows of 128 bytes.
__device__ __forceinline__ uint32_t attn_wg_tile_offset(int row, int col) {
    return (col / kAttnWgBox) * kAttnWgBoxBytes + swizzle_address(row * 128 + (col % kAttnWgBox) * 2, Swizzle::b128);
}
// A K-major wgmma operand's descriptor at k-step ks (16 columns) of such a tile: its box, then 32 bytes
// per k-step within the box's 128-byte rows; 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t attn_wg_desc(const unsigned char* tile, int ks) {
    return make_smem_desc(tile + (ks / 4) * kAttnWgBoxBytes + (ks % 4) * 32, 0, 1024, Swizzle::b128);
}
// The same for a transpose (D rows of 64 columns, one 128-byte row each) at k-step kk.
__device__ __forceinline__ uint64_t attn_wg_desc_t(const unsigned char* tile_t, int kk) {
    return make_smem_desc(tile_t + 32 * kk, 0, 1024, Swizzle::b128);
}

// Loads rows [row0, row0 + 64) of head h of a (T, H, D) tensor's map into a tile (D / 64 boxes);
// rows past T come in as zeros.
template <int D>
__device__ __forceinline__ void attn_wg_load_tile(unsigned char* tile, const CUtensorMap* map, int row0, int h,
                                                  uint64_t* bar) {
#pragma unroll
    for (int b = 0; b < D / kAttnWgBox; ++b) tma_load_3d(tile + b * kAttnWgBoxBytes, map, b * kAttnWgBox, h, row0, bar);
}

// The transpose of a tile as loaded (D rows of its 64 rows, 128-byte swizzled: a K-major B whose k is the
// tile's rows); the 128 producer threads each move 2 x 2 blocks (two 32-bit reads, two 32-bit writes).
template <int D>
__device__ __forceinline__ void attn_wg_transpose(unsigned char* dst, const unsigned char* src, int tid) {
    constexpr int units = (kAttnWgRows / 2) * (D / 2);
#pragma unroll 4
    for (int u = tid; u < units; u += 128) {
        const int d = 2 * (u % (D / 2)), r = 2 * (u / (D / 2));
        uint32_t r0, r1;  // (r, d..d+1), (r+1, d..d+1)
        memcpy(&r0, src + attn_wg_tile_offset(r, d), 4);
        memcpy(&r1, src + attn_wg_tile_offset(r + 1, d), 4);
        const uint32_t col_d = (r0 & 0xffffu) | (r1 << 16), col_d1 = (r0 >> 16) | (r1 & 0xffff0000u);
        memcpy(dst + swizzle_address(d * 128 + r * 2, Swizzle::b128), &col_d, 4);
        memcpy(dst + swizzle_address((d + 1) * 128 + r * 2, Swizzle::b128), &col_d1, 4);
    }
}

// Where the producer's tiles come from: fixed tensor f's tile for warpgroup c at rows fixed0 + 64c;
// streamed tile j at rows stream0 + step j (step = +-64), `tiles` of them.
struct AttnWgWalk {
    int fixed0, stream0, step, tiles;
};
struct AttnWgMaps {
    const CUtensorMap* fixed[2];
    const CUtensorMap* streamed[2];
    const float* lse;    // (H, T), with Stats
    const float* delta;  // (H, T), with Stats
};

// The producer warpgroup: the fixed tiles once, then the streamed tiles, each transposed (and its stats
// written) and released before the next is loaded into the stage its predecessor freed.
template <class Pipe, int D>
__device__ __forceinline__ void attn_wg_produce(unsigned char* smem, AttnWgBarriers& bar, const AttnWgMaps& maps,
                                                const AttnWgWalk& w, int h, const AttnProblem& p) {
    constexpr int Consumers = Pipe::consumers, Fixed = Pipe::fixed_count;
    const int tid = threadIdx.x;
    if constexpr (Pipe::split_registers) attn_wg_setmaxnreg_dec<Pipe::producer_regs>();
    auto issue = [&](int j) {
        const int s = j % kAttnWgStages;
        if (j >= kAttnWgStages) mbarrier_wait(&bar.empty[s], (j / kAttnWgStages - 1) & 1);
        mbarrier_arrive_expect_tx(&bar.full[s], 2 * Pipe::tile);
        for (int i = 0; i < 2; ++i)
            attn_wg_load_tile<D>(smem + Pipe::streamed(s, i), maps.streamed[i], w.stream0 + w.step * j, h, &bar.full[s]);
    };
    if (tid == 0) {
        mbarrier_arrive_expect_tx(&bar.fixed_full, Fixed * Consumers * Pipe::tile);
        for (int f = 0; f < Fixed; ++f)
            for (int c = 0; c < Consumers; ++c)
                attn_wg_load_tile<D>(smem + Pipe::fixed(f, c), maps.fixed[f], w.fixed0 + kAttnWgRows * c, h,
                                     &bar.fixed_full);
        if (w.tiles > 0) issue(0);
    }
    for (int j = 0; j < w.tiles; ++j) {
        const int s = j % kAttnWgStages;
        // the stage is free once its loads land: thread 0 issued them after the consumers released it
        mbarrier_wait(&bar.full[s], (j / kAttnWgStages) & 1);
#pragma unroll
        for (int i = 0; i < Pipe::t_count; ++i)
            attn_wg_transpose<D>(smem + Pipe::transposed(s, i), smem + Pipe::streamed(s, Pipe::t_first + i), tid);
        if constexpr (Pipe::stats_rows) {  // plain loads, visible to the consumers through the ready barrier
            if (tid < kAttnWgRows) {
                const int row = w.stream0 + w.step * j + tid;
                float* st = reinterpret_cast<float*>(smem + Pipe::stats(s));
                st[tid] = row < p.T ? __ldg(maps.lse + size_t(h) * p.T + row) : 0.0f;
                st[kAttnWgRows + tid] = row < p.T ? __ldg(maps.delta + size_t(h) * p.T + row) : 0.0f;
            }
        }
        fence_proxy_async();  // the transposes' generic writes, visible to the consumers' wgmma
        mbarrier_arrive(&bar.ready[s]);
        // tile j + 1 goes to the stage tile j - 1 frees; the consumers work on tile j meanwhile
        if (tid == 0 && j + 1 < w.tiles) issue(j + 1);
    }
}

// The pack of four accumulator entries (two rows' pairs) of n-chunks 2kk, 2kk + 1 into the A fragment of
// key-step kk (attn_c_to_a on wgmma's layout).
template <int N>
__device__ __forceinline__ void attn_wg_to_a(uint32_t (&a)[4], const WgmmaAcc<N>& c, int kk) {
    a[0] = attn_pack_bf16(c[8 * kk], c[8 * kk + 1]);
    a[1] = attn_pack_bf16(c[8 * kk + 2], c[8 * kk + 3]);
    a[2] = attn_pack_bf16(c[8 * kk + 4], c[8 * kk + 5]);
    a[3] = attn_pack_bf16(c[8 * kk + 6], c[8 * kk + 7]);
}

// Writes a warpgroup's 64 x D accumulator rows (rows g scaled by mult_lo, rows g + 8 by mult_hi) as bf16
// to head h of a (T, H, D) tensor, the thread's rows row_lo and row_hi; rows past T are not written.
// Straight from the registers, two bf16 per store, packed as attn_store_rows packs them.
template <int D>
__device__ __forceinline__ void attn_wg_store_rows(__nv_bfloat16* dst, const WgmmaAcc<D>& acc, float mult_lo,
                                                   float mult_hi, int row_lo, int row_hi, int h,
                                                   const AttnProblem& p) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? row_lo : row_hi;
        const float mult = r == 0 ? mult_lo : mult_hi;
        if (row >= p.T) continue;
        uint32_t* out = reinterpret_cast<uint32_t*>(dst + (size_t(row) * p.H + h) * D + 2 * t);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) out[4 * i] = attn_pack_bf16(acc[4 * i + 2 * r] * mult, acc[4 * i + 2 * r + 1] * mult);
    }
}

// s = x y^T over D (ks ascending) for a warpgroup: x's 64 rows and y's 64 rows both K-major tiles.
template <int D>
__device__ __forceinline__ void attn_wg_scores(WgmmaAcc<kAttnTileKeys>& s, const unsigned char* x,
                                               const unsigned char* y) {
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) wgmma_ss(s, attn_wg_desc(x, ks), attn_wg_desc(y, ks), ks > 0);
}
// acc += a y over the tile's 64 rows (key-steps ascending), a in A fragments, y transposed.
template <int D>
__device__ __forceinline__ void attn_wg_accumulate(WgmmaAcc<D>& acc, const uint32_t (&a)[kAttnTileKeys / 16][4],
                                                   const unsigned char* y_t) {
#pragma unroll
    for (int kk = 0; kk < kAttnTileKeys / 16; ++kk) wgmma_rs(acc, a[kk], attn_wg_desc_t(y_t, kk), true);
}

// A query warpgroup's position in its block: its rows, the tile walk of the mma.sync kernel for them,
// and the first of the producer's tiles it takes.
struct AttnWgQueryRole {
    AttnQueryTile qt;
    int first;  // the producer's tile that is the warpgroup's tile 0
    int c;      // consumer index
};
__device__ __forceinline__ AttnWgQueryRole attn_wg_query_role(const AttnProblem& p, int q0) {
    AttnWgQueryRole r;
    r.c = threadIdx.x / 128 - 1;
    const int rows0 = q0 + kAttnWgRows * r.c;
    r.qt = attn_query_tile_at(p, rows0, (threadIdx.x / 32) % 4, threadIdx.x % 32);
    if (rows0 >= p.T) r.qt.num_tiles = 0;  // the last block's second warpgroup may own no rows
    r.first = 1 - r.c;
    return r;
}
// The forward and dq blocks: 128 query rows of head h from q0, the heaviest first, and the producer's
// key tiles; their barriers initialized.
struct AttnWgQueryBlock {
    unsigned char* smem;
    int h, q0;
    AttnWgWalk walk;
};
__device__ __forceinline__ AttnWgQueryBlock attn_wg_query_block(AttnWgBarriers& bar, const AttnProblem& p) {
    AttnWgQueryBlock b;
    b.smem = attn_wg_smem();
    b.h = blockIdx.y;
    b.q0 = (gridDim.x - 1 - blockIdx.x) * 2 * kAttnWgRows;
    b.walk = {b.q0, b.q0 + kAttnWgRows, -kAttnWgRows, 1 + attn_num_key_tiles(p, b.q0)};
    attn_wg_init_barriers<2>(bar);
    return b;
}

// ---- forward ----
template <int D>
using AttnWgFwdPipe = AttnWgPipe<D, 2, 1, 1, 1, false>;  // fixed Q; streams K, V; V transposed
static_assert(AttnWgFwdPipe<64>::threads == kAttnWgQueryThreads);

template <int D>
__device__ __forceinline__ void attn_wg_forward_consume(__nv_bfloat16* out, float* lse, const unsigned char* smem,
                                                        AttnWgBarriers& bar, const AttnWgQueryRole& role, int tiles,
                                                        int h, const AttnProblem& p) {
    using Pipe = AttnWgFwdPipe<D>;
    constexpr int KT = kAttnTileKeys;
    const AttnQueryTile& qt = role.qt;
    const unsigned char* q_tile = smem + Pipe::fixed(0, role.c);
    WgmmaAcc<KT> s;
    WgmmaAcc<D> o;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units) and partial sum per row
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    mbarrier_wait(&bar.fixed_full, 0);

    for (int j = 0; j < tiles; ++j) {
        const int st = j % kAttnWgStages, n = j - role.first;
        mbarrier_wait(&bar.ready[st], (j / kAttnWgStages) & 1);
        if (n < 0 || n >= qt.num_tiles) {  // not this warpgroup's tile: release it
            mbarrier_arrive(&bar.empty[st]);
            continue;
        }
        const int k0 = qt.q0 - n * KT;

        // s = q k^T for the warpgroup's 64 rows and the tile's keys
        wgmma_fence(s);
        attn_wg_scores<D>(s, q_tile, smem + Pipe::streamed(st, 0));
        wgmma_commit();
        wgmma_wait<0>(s);

        // online softmax in log2 units, as the mma.sync kernel: s[4i + e] is its s[i][e]
        float alpha[2];
        attn_softmax_tile([&](int i, int e) -> float& { return s[4 * i + e]; }, m, l, alpha, qt, n, k0, p);
        uint32_t pa[KT / 16][4];  // p rounded to bf16: the A fragments of O += P V's key-steps
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) attn_wg_to_a(pa[kk], s, kk);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            o[4 * i] *= alpha[0];
            o[4 * i + 1] *= alpha[0];
            o[4 * i + 2] *= alpha[1];
            o[4 * i + 3] *= alpha[1];
        }

        // o += p v, V^T as B
        wgmma_fence(o);
        attn_wg_accumulate<D>(o, pa, smem + Pipe::transposed(st, 0));
        wgmma_commit();
        wgmma_wait<0>(o);
        mbarrier_arrive(&bar.empty[st]);  // this thread's reads of the stage are done
    }

    float inv[2];
    attn_finish_rows(inv, lse, l, m, qt, h, p);
    attn_wg_store_rows<D>(out, o, inv[0], inv[1], qt.row_lo, qt.row_hi, h, p);
}

template <int D>
__global__ void __launch_bounds__(kAttnWgQueryThreads, 1)
    attention_forward_wgmma_kernel(__nv_bfloat16* out, float* lse, const __grid_constant__ CUtensorMap map_q,
                                   const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                                   AttnProblem p) {
    using Pipe = AttnWgFwdPipe<D>;
    __shared__ AttnWgBarriers bar;
    const AttnWgQueryBlock b = attn_wg_query_block(bar, p);
    if (threadIdx.x < 128) {
        attn_wg_produce<Pipe, D>(b.smem, bar, {{&map_q, nullptr}, {&map_k, &map_v}, nullptr, nullptr}, b.walk, b.h, p);
        return;
    }
    attn_wg_setmaxnreg_inc<Pipe::consumer_regs>();
    attn_wg_forward_consume<D>(out, lse, b.smem, bar, attn_wg_query_role(p, b.q0), b.walk.tiles, b.h, p);
}

// ---- backward: dq ----
template <int D>
using AttnWgDqPipe = AttnWgPipe<D, 2, 2, 0, 1, false>;  // fixed Q, dO; streams K, V; K transposed
static_assert(AttnWgDqPipe<64>::threads == kAttnWgQueryThreads);

template <int D>
__device__ __forceinline__ void attn_wg_dq_consume(__nv_bfloat16* dq, const float* lse, const float* delta,
                                                   const unsigned char* smem, AttnWgBarriers& bar,
                                                   const AttnWgQueryRole& role, int tiles, int h,
                                                   const AttnProblem& p) {
    using Pipe = AttnWgDqPipe<D>;
    constexpr int KT = kAttnTileKeys;
    const AttnQueryTile& qt = role.qt;
    float lse2[2], delta_row[2];
    attn_row_stats(lse2, delta_row, lse, delta, qt, h, p);
    WgmmaAcc<KT> s, dp;
    WgmmaAcc<D> acc;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) acc[i] = 0.0f;
    mbarrier_wait(&bar.fixed_full, 0);

    for (int j = 0; j < tiles; ++j) {
        const int st = j % kAttnWgStages, n = j - role.first;
        mbarrier_wait(&bar.ready[st], (j / kAttnWgStages) & 1);
        if (n < 0 || n >= qt.num_tiles) {
            mbarrier_arrive(&bar.empty[st]);
            continue;
        }
        const int k0 = qt.q0 - n * KT;

        // s = q k^T and dp = dout v^T
        wgmma_fence(s, dp);
        attn_wg_scores<D>(s, smem + Pipe::fixed(0, role.c), smem + Pipe::streamed(st, 0));
        attn_wg_scores<D>(dp, smem + Pipe::fixed(1, role.c), smem + Pipe::streamed(st, 1));
        wgmma_commit();
        wgmma_wait<0>(s, dp);

        // ds = p * (dp - delta) with p from the saved lse, as the mma.sync kernel
        attn_ds_query_tile([&](int i, int e) -> float& { return s[4 * i + e]; },
                           [&](int i, int e) -> float& { return dp[4 * i + e]; }, lse2, delta_row, qt, n, k0, p);
        uint32_t da[KT / 16][4];
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) attn_wg_to_a(da[kk], dp, kk);

        // dq += ds k, K^T as B
        wgmma_fence(acc);
        attn_wg_accumulate<D>(acc, da, smem + Pipe::transposed(st, 0));
        wgmma_commit();
        wgmma_wait<0>(acc);
        mbarrier_arrive(&bar.empty[st]);
    }
    const float scale = p.scale_log2 / kAttnLog2e;
    attn_wg_store_rows<D>(dq, acc, scale, scale, qt.row_lo, qt.row_hi, h, p);
}

template <int D>
__global__ void __launch_bounds__(kAttnWgQueryThreads, 1)
    attention_backward_dq_wgmma_kernel(__nv_bfloat16* dq, const __grid_constant__ CUtensorMap map_q,
                                       const __grid_constant__ CUtensorMap map_dout,
                                       const __grid_constant__ CUtensorMap map_k,
                                       const __grid_constant__ CUtensorMap map_v, const float* lse, const float* delta,
                                       AttnProblem p) {
    using Pipe = AttnWgDqPipe<D>;
    __shared__ AttnWgBarriers bar;
    const AttnWgQueryBlock b = attn_wg_query_block(bar, p);
    if (threadIdx.x < 128) {
        attn_wg_produce<Pipe, D>(b.smem, bar, {{&map_q, &map_dout}, {&map_k, &map_v}, nullptr, nullptr}, b.walk, b.h,
                                 p);
        return;
    }
    attn_wg_setmaxnreg_inc<Pipe::consumer_regs>();
    attn_wg_dq_consume<D>(dq, lse, delta, b.smem, bar, attn_wg_query_role(p, b.q0), b.walk.tiles, b.h, p);
}

// ---- backward: dk, dv ----
template <int D>
using AttnWgDkdvPipe = AttnWgPipe<D, 1, 2, 0, 2, true>;  // fixed K, V; streams Q, dO, both transposed; stats
static_assert(AttnWgDkdvPipe<64>::threads == kAttnWgKeyThreads);

template <int D>
__device__ __forceinline__ void attn_wg_dkdv_consume(__nv_bfloat16* dk, __nv_bfloat16* dv, const unsigned char* smem,
                                                     AttnWgBarriers& bar, int k0, int tiles, int h,
                                                     const AttnProblem& p) {
    using Pipe = AttnWgDkdvPipe<D>;
    constexpr int QT = kAttnWgRows;
    const int unmasked_to = attn_last_query(p, k0);  // queries in [k0 + 63, unmasked_to] see every key
    const int key_lo = k0 + 16 * ((threadIdx.x / 32) % 4) + (threadIdx.x % 32) / 4, key_hi = key_lo + 8;
    const int last_lo = attn_last_query(p, key_lo), last_hi = attn_last_query(p, key_hi);
    WgmmaAcc<QT> st, dpt;
    WgmmaAcc<D> dk_acc, dv_acc;
#pragma unroll
    for (int i = 0; i < D / 2; ++i) dk_acc[i] = dv_acc[i] = 0.0f;
    mbarrier_wait(&bar.fixed_full, 0);

    for (int j = 0; j < tiles; ++j) {
        const int s = j % kAttnWgStages, qa = k0 + j * QT;
        mbarrier_wait(&bar.ready[s], (j / kAttnWgStages) & 1);
        const float* tLse = reinterpret_cast<const float*>(smem + Pipe::stats(s));
        const float* tDelta = tLse + kAttnWgRows;

        // s^T = k q^T and dp^T = v dout^T for the warpgroup's 64 keys and the tile's queries
        wgmma_fence(st, dpt);
        attn_wg_scores<D>(st, smem + Pipe::fixed(0, 0), smem + Pipe::streamed(s, 0));
        attn_wg_scores<D>(dpt, smem + Pipe::fixed(1, 0), smem + Pipe::streamed(s, 1));
        wgmma_commit();
        wgmma_wait<0>(st, dpt);

        // p^T from the saved lse; ds^T = p^T * (dp^T - delta), as the mma.sync kernel
        const bool masked = qa < k0 + kAttnWgRows - 1 || qa + QT - 1 > unmasked_to;
        attn_ds_key_tile<QT>([&](int i, int e) -> float& { return st[4 * i + e]; },
                             [&](int i, int e) -> float& { return dpt[4 * i + e]; }, tLse, tDelta, qa, masked, key_lo,
                             key_hi, last_lo, last_hi, p);
        uint32_t pa[QT / 16][4], da[QT / 16][4];
#pragma unroll
        for (int kk = 0; kk < QT / 16; ++kk) {
            attn_wg_to_a(pa[kk], st, kk);
            attn_wg_to_a(da[kk], dpt, kk);
        }

        // dv += p^T dout and dk += ds^T q (the scale applied at the end), dout^T and q^T as B
        wgmma_fence(dv_acc, dk_acc);
        attn_wg_accumulate<D>(dv_acc, pa, smem + Pipe::transposed(s, 1));
        attn_wg_accumulate<D>(dk_acc, da, smem + Pipe::transposed(s, 0));
        wgmma_commit();
        wgmma_wait<0>(dv_acc, dk_acc);
        mbarrier_arrive(&bar.empty[s]);
    }
    const float scale = p.scale_log2 / kAttnLog2e;
    attn_wg_store_rows<D>(dk, dk_acc, scale, scale, key_lo, key_hi, h, p);
    attn_wg_store_rows<D>(dv, dv_acc, 1.0f, 1.0f, key_lo, key_hi, h, p);
}

template <int D>
__global__ void __launch_bounds__(kAttnWgKeyThreads, 1)
    attention_backward_dkdv_wgmma_kernel(__nv_bfloat16* dk, __nv_bfloat16* dv, const __grid_constant__ CUtensorMap map_q,
                                         const __grid_constant__ CUtensorMap map_dout,
                                         const __grid_constant__ CUtensorMap map_k,
                                         const __grid_constant__ CUtensorMap map_v, const float* lse,
                                         const float* delta, AttnProblem p) {
    using Pipe = AttnWgDkdvPipe<D>;
    __shared__ AttnWgBarriers bar;
    unsigned char* smem = attn_wg_smem();
    const int h = blockIdx.y, k0 = blockIdx.x * kAttnWgRows;
    attn_wg_init_barriers<1>(bar);
    // query tiles of 64 from k0 up to the last query that sees a key of the tile
    const int tiles = (attn_last_query(p, min(k0 + kAttnWgRows, p.T) - 1) - k0) / kAttnWgRows + 1;
    if (threadIdx.x < 128) {
        attn_wg_produce<Pipe, D>(smem, bar, {{&map_k, &map_v}, {&map_q, &map_dout}, lse, delta},
                                 {k0, k0, kAttnWgRows, tiles}, h, p);
        return;
    }
    static_assert(!Pipe::split_registers, "one consumer warpgroup keeps the registers it launched with");
    attn_wg_dkdv_consume<D>(dk, dv, smem, bar, k0, tiles, h, p);
}

// ---- launchers ----
// The tensor map of a (T, H, D) bf16 tensor in the problem's view, loaded in 64 x 64 boxes of one head.
inline CUtensorMap attn_wg_tensor_map(const __nv_bfloat16* x, const AttnProblem& p, int D) {
    return encode_tensor_map<3>(x, {uint64_t(D), uint64_t(p.H), uint64_t(p.T)},
                                {uint64_t(D) * 2, uint64_t(p.H) * D * 2},
                                {uint32_t(kAttnWgBox), 1u, uint32_t(kAttnWgBox)}, Swizzle::b128);
}
inline dim3 attn_wg_query_grid(const AttnProblem& p) { return dim3(ceil_div(p.T, 2 * kAttnWgRows), p.H); }

template <int D>
void attention_forward_wgmma_d(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const AttnProblem& p, const Work& work, cudaStream_t stream) {
    using Pipe = AttnWgFwdPipe<D>;
    static const bool configured = (attn_allow_smem(attention_forward_wgmma_kernel<D>, Pipe::smem_bytes), true);
    (void)configured;
    launch(work, attention_forward_wgmma_kernel<D>, attn_wg_query_grid(p), dim3(Pipe::threads), Pipe::smem_bytes,
           stream, out, lse, attn_wg_tensor_map(q, p, D), attn_wg_tensor_map(k, p, D), attn_wg_tensor_map(v, p, D), p);
}

// dk, dv, then dq, from delta (made by the caller); the same Work as the mma.sync kernels.
template <int D>
void attention_backward_wgmma_d(__nv_bfloat16* dq, __nv_bfloat16* dk, __nv_bfloat16* dv, const __nv_bfloat16* dout,
                                const float* lse, const float* delta, const __nv_bfloat16* q, const __nv_bfloat16* k,
                                const __nv_bfloat16* v, const AttnProblem& p, const Work& dkdv_work,
                                const Work& dq_work, cudaStream_t stream) {
    using KvPipe = AttnWgDkdvPipe<D>;
    using QPipe = AttnWgDqPipe<D>;
    static const bool configured = (attn_allow_smem(attention_backward_dkdv_wgmma_kernel<D>, KvPipe::smem_bytes),
                                    attn_allow_smem(attention_backward_dq_wgmma_kernel<D>, QPipe::smem_bytes), true);
    (void)configured;
    const CUtensorMap mq = attn_wg_tensor_map(q, p, D), mdo = attn_wg_tensor_map(dout, p, D),
                      mk = attn_wg_tensor_map(k, p, D), mv = attn_wg_tensor_map(v, p, D);
    launch(dkdv_work, attention_backward_dkdv_wgmma_kernel<D>, dim3(ceil_div(p.T, kAttnWgRows), p.H),
           dim3(KvPipe::threads), KvPipe::smem_bytes, stream, dk, dv, mq, mdo, mk, mv, lse, delta, p);
    launch(dq_work, attention_backward_dq_wgmma_kernel<D>, attn_wg_query_grid(p), dim3(QPipe::threads),
           QPipe::smem_bytes, stream, dq, mq, mdo, mk, mv, lse, delta, p);
}
