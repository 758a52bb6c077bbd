// The attention forward on Hopper's wgmma and TMA, in FlashAttention-3's structure: a producer
// warpgroup streams K and V tiles with TMA through an mbarrier pipeline while consumer warpgroups
// compute S = Q K^T with wgmma (both operands in shared memory), the online softmax in registers and
// O += P V with P from registers (wgmma with A in registers). Included by attention.cuh, whose problem
// description (AttnProblem), tile walk (AttnQueryTile) and launcher it shares; the mma.sync kernel there
// is its reference.
//
// A block owns 128 query rows of one head: consumer warpgroup c owns rows q0 + 64c .. q0 + 64c + 63 and
// walks the 64-key tiles from its diagonal down exactly as the mma.sync kernel walks a 64-row tile.
// The producer streams the key tiles of both from keys q0 + 64 down: tile j holds keys
// [q0 + 64 - 64j, q0 + 128 - 64j), so warpgroup 1 takes tiles 0 .. n1 - 1 and warpgroup 0 tiles
// 1 .. n0 (n0 >= n1: first keys do not decrease with the row), and a warpgroup passes over the tiles
// it does not take (it waits for them and releases them, which keeps the barrier phases in step).
//
// Same bits as the mma.sync kernel: a thread of warp w of a consumer warpgroup holds, in wgmma's
// accumulator layout, exactly the scores and outputs that lane of warp w holds there in mma's C layout;
// S adds its D / 16 k-steps and O its 4 key-steps in the same order (ptx.cuh: the wgmma twin adds a
// k-step's products in k order, as the mma twin does), and the softmax is the same code on the same
// values. Under emu the two kernels agree bit for bit (tests/kernels/test_attention.cu checks it).
//
// wgmma takes B K-major only (ptx.cuh), and for O += P V the k dimension is the keys: V's tile
// (keys x D, D contiguous) is not. The producer warpgroup, idle between its TMA issues, transposes each
// V tile into V^T (D rows of 64 keys, 128-byte swizzle) before releasing it to the consumers.
#pragma once

constexpr int kAttnWgRows = 64;          // query rows of a consumer warpgroup (wgmma's M)
constexpr int kAttnWgConsumers = 2;      // consumer warpgroups per block
constexpr int kAttnWgBlockRows = kAttnWgRows * kAttnWgConsumers;
constexpr int kAttnWgThreads = 128 * (1 + kAttnWgConsumers);  // warpgroup 0 produces
constexpr int kAttnWgStages = 2;         // K/V tiles in flight
constexpr int kAttnWgBox = 64;           // TMA boxes: 64 rows of 64 elements (128 bytes, the 128-byte swizzle's row)
constexpr uint32_t kAttnWgBoxBytes = kAttnWgBox * kAttnWgBox * sizeof(__nv_bfloat16);
// Registers per thread after the split (setmaxnreg): the producer gives up what the consumers take.
// 128 x (40 + 2 x 232) = 64512 <= 65536, the register file.
constexpr int kAttnWgProducerRegs = 40, kAttnWgConsumerRegs = 232;

// The shared memory of one block, in bytes from a 1024-byte aligned base (the 128-byte swizzle's repeat):
// Q (2 warpgroups x 64 rows x D), then per stage K (64 keys x D), V as loaded (64 x D) and V^T (D x 64).
// A 64 x D tile is D / 64 boxes of 64 x 64, each 128-byte swizzled.
template <int D>
struct AttnWgSmem {
    static constexpr uint32_t tile = kAttnWgBox * D * sizeof(__nv_bfloat16);  // 64 rows x D
    static constexpr uint32_t q = 0;
    static constexpr uint32_t stage0 = kAttnWgConsumers * tile;
    static constexpr uint32_t stage = 3 * tile;
    static constexpr uint32_t k(int s) { return stage0 + s * stage; }
    static constexpr uint32_t v(int s) { return k(s) + tile; }
    static constexpr uint32_t vt(int s) { return k(s) + 2 * tile; }
    static constexpr uint32_t bytes = stage0 + kAttnWgStages * stage;
};
template <int D>
constexpr size_t attention_forward_wgmma_smem_bytes() {
    return AttnWgSmem<D>::bytes + 1024;  // room to align the base
}
static_assert(attention_forward_wgmma_smem_bytes<128>() <= 227 * 1024, "within Hopper's 227 KB per block");

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

// The block's barriers: Q landed; per stage, K and V landed (TMA), V^T written (the producer's 128
// threads), the stage released (every consumer thread).
struct AttnWgBarriers {
    uint64_t q_full;
    uint64_t kv_full[kAttnWgStages], vt_full[kAttnWgStages], empty[kAttnWgStages];
};

// Byte offset of element (row, col) of a 64 x D tile loaded by TMA: D / 64 boxes of 64 rows of 128 bytes.
__device__ __forceinline__ uint32_t attn_wg_tile_offset(int row, int col) {
    return (col / kAttnWgBox) * kAttnWgBoxBytes + swizzle_address(row * 128 + (col % kAttnWgBox) * 2, Swizzle::b128);
}
// A K-major wgmma operand's descriptor at k-step ks (16 columns) of such a tile: its box, then 32 bytes
// per k-step within the box's 128-byte rows; 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t attn_wg_desc(const unsigned char* tile, int ks) {
    return make_smem_desc(tile + (ks / 4) * kAttnWgBoxBytes + (ks % 4) * 32, 0, 1024, Swizzle::b128);
}

// Loads rows [row0, row0 + 64) of head h of a (T, H, D) tensor's map into a tile (D / 64 boxes);
// rows past T come in as zeros.
template <int D>
__device__ __forceinline__ void attn_wg_load_tile(unsigned char* tile, const CUtensorMap* map, int row0, int h,
                                                  uint64_t* bar) {
#pragma unroll
    for (int b = 0; b < D / kAttnWgBox; ++b) tma_load_3d(tile + b * kAttnWgBoxBytes, map, b * kAttnWgBox, h, row0, bar);
}

// V^T (D rows of the tile's 64 keys, 128-byte swizzled: the K-major B of O += P V) from V's tile as
// loaded; the 128 producer threads each move 2 x 2 blocks (two 32-bit reads, two 32-bit writes).
template <int D>
__device__ __forceinline__ void attn_wg_transpose_v(unsigned char* vt, const unsigned char* v, int tid) {
    constexpr int units = (kAttnWgBox / 2) * (D / 2);
#pragma unroll 4
    for (int u = tid; u < units; u += 128) {
        const int d = 2 * (u % (D / 2)), key = 2 * (u / (D / 2));
        uint32_t r0, r1;  // (key, d..d+1), (key+1, d..d+1)
        memcpy(&r0, v + attn_wg_tile_offset(key, d), 4);
        memcpy(&r1, v + attn_wg_tile_offset(key + 1, d), 4);
        const uint32_t col_d = (r0 & 0xffffu) | (r1 << 16), col_d1 = (r0 >> 16) | (r1 & 0xffff0000u);
        memcpy(vt + swizzle_address(d * 128 + key * 2, Swizzle::b128), &col_d, 4);
        memcpy(vt + swizzle_address((d + 1) * 128 + key * 2, Swizzle::b128), &col_d1, 4);
    }
}

// The producer warpgroup: Q once, then the K/V tiles 0 .. tiles - 1 (keys from kv0 down), each
// transposing V and releasing the tile before loading the next into the stage its predecessor freed.
template <int D>
__device__ __forceinline__ void attn_wg_produce(unsigned char* smem, AttnWgBarriers& bar, const CUtensorMap* map_q,
                                                const CUtensorMap* map_k, const CUtensorMap* map_v, int q0, int kv0,
                                                int tiles, int h) {
    using L = AttnWgSmem<D>;
    const int tid = threadIdx.x;
    auto issue = [&](int j) {
        const int s = j % kAttnWgStages;
        if (j >= kAttnWgStages) mbarrier_wait(&bar.empty[s], (j / kAttnWgStages - 1) & 1);
        mbarrier_arrive_expect_tx(&bar.kv_full[s], 2 * L::tile);
        attn_wg_load_tile<D>(smem + L::k(s), map_k, kv0 - kAttnWgBox * j, h, &bar.kv_full[s]);
        attn_wg_load_tile<D>(smem + L::v(s), map_v, kv0 - kAttnWgBox * j, h, &bar.kv_full[s]);
    };
    if (tid == 0) {
        mbarrier_arrive_expect_tx(&bar.q_full, kAttnWgConsumers * L::tile);
        for (int c = 0; c < kAttnWgConsumers; ++c)
            attn_wg_load_tile<D>(smem + L::q + c * L::tile, map_q, q0 + kAttnWgRows * c, h, &bar.q_full);
        issue(0);
    }
    for (int j = 0; j < tiles; ++j) {
        const int s = j % kAttnWgStages;
        mbarrier_wait(&bar.kv_full[s], (j / kAttnWgStages) & 1);
        attn_wg_transpose_v<D>(smem + L::vt(s), smem + L::v(s), tid);
        fence_proxy_async();  // V^T's generic writes, visible to the consumers' wgmma
        mbarrier_arrive(&bar.vt_full[s]);
        // tile j + 1 goes to the stage tile j - 1 frees; the consumers work on tile j meanwhile
        if (tid == 0 && j + 1 < tiles) issue(j + 1);
    }
}

// A consumer warpgroup: rows q0 .. q0 + 63, taking tiles first .. first + qt.num_tiles - 1 of the
// producer's `tiles` (its tile n is the mma.sync kernel's tile n of the same rows).
template <int D>
__device__ __forceinline__ void attn_wg_consume(__nv_bfloat16* out, float* lse, const unsigned char* smem,
                                                AttnWgBarriers& bar, const AttnQueryTile& qt, int first, int tiles,
                                                int h, const AttnProblem& p, const unsigned char* q_tile) {
    using L = AttnWgSmem<D>;
    constexpr int KT = kAttnTileKeys;
    const int t = threadIdx.x % 4;
    WgmmaAcc<KT> s;
    WgmmaAcc<D> o;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};  // running max (log2 units) and partial sum per row
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = 0.0f;
    mbarrier_wait(&bar.q_full, 0);

    for (int j = 0; j < tiles; ++j) {
        const int st = j % kAttnWgStages, n = j - first;
        mbarrier_wait(&bar.vt_full[st], (j / kAttnWgStages) & 1);
        if (n < 0 || n >= qt.num_tiles) {  // not this warpgroup's tile: release it
            mbarrier_arrive(&bar.empty[st]);
            continue;
        }
        const int k0 = qt.q0 - n * KT;

        // s = q k^T for the warpgroup's 64 rows and the tile's keys
        wgmma_fence(s);
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) wgmma_ss(s, attn_wg_desc(q_tile, ks), attn_wg_desc(smem + L::k(st), ks), ks > 0);
        wgmma_commit();
        wgmma_wait<0>(s);

        // online softmax in log2 units, as the mma.sync kernel: s[4i + e] is its s[i][e]
        const bool masked = qt.masked(n, k0);
        float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < KT / 8; ++i) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float x = s[4 * i + e] * p.scale_log2;
                if (masked) {
                    if (qt.hidden(k0 + 8 * i + 2 * t + (e & 1), e)) x = -INFINITY;
                }
                s[4 * i + e] = x;
                tile_max[e >> 1] = fmaxf(tile_max[e >> 1], x);
            }
        }
        float alpha[2], base[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            tile_max[r] = warp_butterfly<WarpMax, 2>(tile_max[r]);
            const float m_new = fmaxf(m[r], tile_max[r]);
            base[r] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[r] = exp2f(m[r] - base[r]);
            m[r] = m_new;
            l[r] *= alpha[r];
        }
        uint32_t pa[KT / 16][4];  // p rounded to bf16: the A fragments of O += P V's key-steps
#pragma unroll
        for (int i = 0; i < KT / 8; ++i) {
            float pv[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                pv[e] = exp2f(s[4 * i + e] - base[e >> 1]);
                l[e >> 1] += pv[e];
            }
            pa[i / 2][2 * (i % 2)] = attn_pack_bf16(pv[0], pv[1]);
            pa[i / 2][2 * (i % 2) + 1] = attn_pack_bf16(pv[2], pv[3]);
        }
#pragma unroll
        for (int i = 0; i < D / 8; ++i) {
            o[4 * i] *= alpha[0];
            o[4 * i + 1] *= alpha[0];
            o[4 * i + 2] *= alpha[1];
            o[4 * i + 3] *= alpha[1];
        }

        // o += p v, V^T as B
        wgmma_fence(o);
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk)
            wgmma_rs(o, pa[kk], make_smem_desc(smem + L::vt(st) + 32 * kk, 0, 1024, Swizzle::b128), true);
        wgmma_commit();
        wgmma_wait<0>(o);
        mbarrier_arrive(&bar.empty[st]);  // this thread's reads of the stage are done
    }

    float inv[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = warp_butterfly<WarpSum, 2>(l[r]);
        inv[r] = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
        const int row = r == 0 ? qt.row_lo : qt.row_hi;
        if (t == 0 && row < p.T)
            lse[size_t(h) * p.T + row] = l[r] > 0.0f ? (m[r] + log2f(l[r])) * kAttnLn2 : -INFINITY;
    }
    // straight from the registers: two bf16 per store (the mma.sync kernel's values, packed the same way)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = r == 0 ? qt.row_lo : qt.row_hi;
        if (row >= p.T) continue;
        uint32_t* dst = reinterpret_cast<uint32_t*>(out + (size_t(row) * p.H + h) * D + 2 * t);
#pragma unroll
        for (int i = 0; i < D / 8; ++i) dst[4 * i] = attn_pack_bf16(o[4 * i + 2 * r] * inv[r], o[4 * i + 2 * r + 1] * inv[r]);
    }
}

template <int D>
__global__ void __launch_bounds__(kAttnWgThreads, 1)
    attention_forward_wgmma_kernel(__nv_bfloat16* out, float* lse, const __grid_constant__ CUtensorMap map_q,
                                   const __grid_constant__ CUtensorMap map_k, const __grid_constant__ CUtensorMap map_v,
                                   AttnProblem p) {
    static_assert(kAttnWgRows == kAttnTileKeys && kAttnWgBox == kAttnTileKeys, "64-key tiles, 64-row warpgroups");
    __shared__ AttnWgBarriers bar;
    unsigned char* raw = dynamic_smem<unsigned char>();
    unsigned char* smem = raw + (1024 - smem_address(raw) % 1024) % 1024;
    const int h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * kAttnWgBlockRows;  // rows with the most keys start first
    const int wg = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        mbarrier_init(&bar.q_full, 1);
        for (int s = 0; s < kAttnWgStages; ++s) {
            mbarrier_init(&bar.kv_full[s], 1);
            mbarrier_init(&bar.vt_full[s], 128);
            mbarrier_init(&bar.empty[s], 128 * kAttnWgConsumers);
        }
        fence_mbarrier_init();
    }
    __syncthreads();
    // warpgroup 0's tiles, from keys q0 down: the producer's tiles 1 .. n0 (tile 0 is warpgroup 1's diagonal)
    const int tiles = 1 + attn_num_key_tiles(p, q0);
    if (wg == 0) {
        attn_wg_setmaxnreg_dec<kAttnWgProducerRegs>();
        attn_wg_produce<D>(smem, bar, &map_q, &map_k, &map_v, q0, q0 + kAttnWgRows, tiles, h);
        return;
    }
    attn_wg_setmaxnreg_inc<kAttnWgConsumerRegs>();
    const int c = wg - 1, rows0 = q0 + kAttnWgRows * c;
    AttnQueryTile qt = attn_query_tile_at(p, rows0, (threadIdx.x / 32) % 4, threadIdx.x % 32);
    if (rows0 >= p.T) qt.num_tiles = 0;  // the last block's second warpgroup may own no rows
    attn_wg_consume<D>(out, lse, smem, bar, qt, 1 - c, tiles, h, p, smem + AttnWgSmem<D>::q + c * AttnWgSmem<D>::tile);
}

// The tensor map of a (T, H, D) bf16 tensor in the problem's view, loaded in 64 x 64 boxes of one head.
inline CUtensorMap attn_wg_tensor_map(const __nv_bfloat16* x, const AttnProblem& p, int D) {
    return encode_tensor_map<3>(x, {uint64_t(D), uint64_t(p.H), uint64_t(p.T)},
                                {uint64_t(D) * 2, uint64_t(p.H) * D * 2},
                                {uint32_t(kAttnWgBox), 1u, uint32_t(kAttnWgBox)}, Swizzle::b128);
}

template <int D>
void attention_forward_wgmma_d(__nv_bfloat16* out, float* lse, const __nv_bfloat16* q, const __nv_bfloat16* k,
                               const __nv_bfloat16* v, const AttnProblem& p, const Work& work, cudaStream_t stream) {
    constexpr size_t smem = attention_forward_wgmma_smem_bytes<D>();
    static const bool configured = (attn_allow_smem(attention_forward_wgmma_kernel<D>, smem), true);
    (void)configured;
    launch(work, attention_forward_wgmma_kernel<D>, dim3(ceil_div(p.T, kAttnWgBlockRows), p.H), dim3(kAttnWgThreads),
           smem, stream, out, lse, attn_wg_tensor_map(q, p, D), attn_wg_tensor_map(k, p, D), attn_wg_tensor_map(v, p, D),
           p);
}
