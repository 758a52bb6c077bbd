// Embedding lookups, their deterministic backward, and the smear of the token embedding.
//
// Shapes: T tokens of one packed sequence, C channels (a multiple of 8: rows move as 16-byte
// packs), ids int32 in [0, rows of the table). Tables and activations are bf16, row-major.
// Every kernel computes in fp32 and rounds to bf16 once per output; gate logits (12-wide dot
// products) are rounded to bf16 before their sigmoid because upstream computes them with a bf16
// F.linear.
//
// Forward (upstream GPT.forward):
//   x       = embed[ids]                                    embed_smear_forward fuses this gather
//   x[t]   += smear_lambda * sigmoid(x[t,:12] . smear_gate) * x[t-1]   (t >= 1, across documents)
//   x0_bigram = bigram_embed[bigram_ids]                    embedding_gather
//             (record 83: times the sign row S[(tok[t-1] ^ tok[t]) mod rows], BigramSigns)
//   value-embedding rows are gathered by the attention auxiliaries (attention_aux.cuh), never stored.
// Backward:
//   embed_smear_backward: d(smeared x) -> d(x rows), d(smear_gate), d(smear_lambda)
//   embedding_backward:   per-position row gradients -> table gradient rows, summed per id in a
//                         fixed order over host-built id segments (IdSegmentBuilder), no atomics.
//   One set of segments serves every table indexed by the same ids (embed and the 5 value-
//   embedding tables share the token ids; bigram_embed has its own).
#pragma once
#include "common.cuh"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

using bf16 = __nv_bfloat16;

// ---- small gates shared with attention_aux.cuh ----
// bf16(x[0:12] . w[0:12]): what a bf16 F.linear with one output gives (fp32 accumulation).
__device__ __forceinline__ float gate_logit(const bf16* x, const bf16* w) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kGateWidth; ++j) acc = fmaf(__bfloat162float(x[j]), __bfloat162float(w[j]), acc);
    return __bfloat162float(__float2bfloat16(acc));
}

// ---- forward lookups ----

// Record 83's sign trick (upstream a333be08 L1390-1395, PR #299): the bigram row of position t is
// multiplied by row sign_index(t) of a fixed (rows, C) table of +-1, sign_index(0) = 0 and
// sign_index(t) = (tok[t-1] ^ tok[t]) mod rows over the rank's token ids (across documents); its
// gradient gets the same signs. Both products are exact in bf16. Null table: no signs.
struct BigramSigns {
    const bf16* table = nullptr;     // (rows, C) of +-1, not trained
    const int32_t* tokens = nullptr; // the micro-batch's input token ids (T)
    int rows = 0;
    int unused = 0;  // no padding: emu reads every word of a kernel's struct argument (PointerArg)
};
static_assert(std::has_unique_object_representations_v<BigramSigns>, "BigramSigns: padding");
__device__ __forceinline__ const bf16* bigram_sign_row(const BigramSigns& s, int t, int C) {
    const int index = t == 0 ? 0 : (s.tokens[t - 1] ^ s.tokens[t]) % s.rows;
    return s.table + static_cast<size_t>(index) * C;
}
__device__ __forceinline__ Pack128<bf16> times_signs(Pack128<bf16> x, const bf16* sign) {
    const Pack128<bf16> m = load128(sign);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __float2bfloat16(__bfloat162float(x[i]) * __bfloat162float(m[i]));
    return x;
}
inline void bigram_signs_check(const BigramSigns& s, const char* who) {
    kernel_require(s.table == nullptr || (s.tokens != nullptr && s.rows > 0),
                   "%s: a sign table needs the token ids and its row count (rows=%d)", who, s.rows);
}

// out[t] = table[ids[t]] (times its sign row)
__global__ void embedding_gather_kernel(bf16* out, const bf16* table, const int32_t* ids, int T, int C,
                                        BigramSigns signs) {
    const int packs = C / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(T) * packs) return;
    const int t = static_cast<int>(idx / packs), c = static_cast<int>(idx % packs) * 8;
    Pack128<bf16> row = load128(table + static_cast<size_t>(ids[t]) * C + c);
    if (signs.table) row = times_signs(row, bigram_sign_row(signs, t, C) + c);
    store128(out + static_cast<size_t>(t) * C + c, row);
}
// Reads the ids and the T rows they pick (with signs: the tokens and the T sign rows), writes out.
inline Work embedding_gather_work(int T, int C, bool signs) {
    return Work{.name = "embedding_gather", .flops = signs ? 1.0 * T * C : 0.0,
                .bytes_read = 4.0 * T + 2.0 * T * C + (signs ? 4.0 * T + 2.0 * T * C : 0.0),
                .bytes_written = 2.0 * T * C};
}
inline void embedding_gather(bf16* out, const bf16* table, const int32_t* ids, int T, int C, cudaStream_t stream,
                             const BigramSigns& signs = {}) {
    kernel_require(T > 0 && C > 0 && C % 8 == 0,
                   "embedding_gather: need T > 0 and C a positive multiple of 8 (T=%d C=%d)", T, C);
    bigram_signs_check(signs, "embedding_gather");
    const int64_t threads = static_cast<int64_t>(T) * (C / 8);
    launch(embedding_gather_work(T, C, signs.table != nullptr), embedding_gather_kernel,
           dim3(static_cast<unsigned>(ceil_div<int64_t>(threads, 256))), dim3(256), 0, stream, out, table, ids, T, C,
           signs);
    CUDA_CHECK_LAUNCH();
}

// out[0] = x[0]; out[t] = x[t] + lambda * sigmoid(bf16(x[t,:12] . w)) * x[t-1], with x[t] = embed[ids[t]]
__global__ void embed_smear_forward_kernel(bf16* out, const bf16* embed, const int32_t* ids, const bf16* smear_gate,
                                           const float* smear_lambda, int T, int C) {
    const int packs = C / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(T) * packs) return;
    const int t = static_cast<int>(idx / packs), c = static_cast<int>(idx % packs) * 8;
    const bf16* x_row = embed + static_cast<size_t>(ids[t]) * C;
    const Pack128<bf16> x = load128(x_row + c);
    Pack128<bf16> y = x;
    if (t > 0) {
        const float g = *smear_lambda * sigmoidf(gate_logit(x_row, smear_gate));
        const Pack128<bf16> prev = load128(embed + static_cast<size_t>(ids[t - 1]) * C + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) y[i] = __float2bfloat16(__bfloat162float(x[i]) + g * __bfloat162float(prev[i]));
    }
    store128(out + static_cast<size_t>(t) * C + c, y);
}
// Reads the ids, their T rows (x[t-1] is a row already read), the gate and lambda; writes out; a
// 12-wide gate per row and a multiply-add per element.
inline Work embed_smear_forward_work(int T, int C) {
    return Work{.name = "embed_smear_forward", .flops = 2.0 * T * (C + kGateWidth),
                .bytes_read = 4.0 * T + 2.0 * T * C + 2.0 * kGateWidth + 4, .bytes_written = 2.0 * T * C};
}
inline void embed_smear_forward(bf16* out, const bf16* embed, const int32_t* ids, const bf16* smear_gate,
                                const float* smear_lambda, int T, int C, cudaStream_t stream) {
    kernel_require(T > 0 && C >= kGateWidth && C % 8 == 0,
                   "embed_smear_forward: need T > 0 and C a multiple of 8, at least 12 (T=%d C=%d)", T, C);
    const int64_t threads = static_cast<int64_t>(T) * (C / 8);
    launch(embed_smear_forward_work(T, C), embed_smear_forward_kernel,
           dim3(static_cast<unsigned>(ceil_div<int64_t>(threads, 256))), dim3(256), 0, stream, out, embed, ids,
           smear_gate, smear_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- smear backward ----
// With g[t] = lambda * sigmoid(z[t]), z[t] = bf16(x[t,:12] . w), S[t] = dout[t] . x[t-1]:
//   dx[t]    = dout[t] + g[t+1] * dout[t+1] + [c < 12] dz[t] * w[c],  dz[t] = lambda * s'(z[t]) * S[t]
//   dlambda  = sum_{t>=1} sigmoid(z[t]) * S[t],   dw[j] = sum_{t>=1} dz[t] * x[t, j]
constexpr int kSmearRowsPerBlock = 64;
constexpr int kSmearWarps = 8;
constexpr int kSmearPartials = 1 + kGateWidth;  // per block: [dlambda, dw_0 .. dw_11]

// One warp per row; each block also leaves its rows' [dlambda, dw] sums in the partials, and the last
// block to finish sums them into the gradients.
__global__ void __launch_bounds__(kSmearWarps * 32)
    embed_smear_backward_kernel(bf16* dx, LastBlockSum sum, const bf16* dout, const bf16* embed, const int32_t* ids,
                                const bf16* smear_gate, const float* smear_lambda, int T, int C) {
    __shared__ float warp_sums[kSmearWarps][kSmearPartials];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, packs = C / 8;
    const float lambda = *smear_lambda;
    float sum_lambda = 0.0f, sum_w = 0.0f;  // lane j < 12 owns dw_j
    for (int r = warp; r < kSmearRowsPerBlock; r += kSmearWarps) {
        const int t = blockIdx.x * kSmearRowsPerBlock + r;
        if (t >= T) break;
        const bf16* x_row = embed + static_cast<size_t>(ids[t]) * C;
        const bf16* dout_row = dout + static_cast<size_t>(t) * C;
        float dz = 0.0f;
        if (t > 0) {
            const bf16* prev_row = embed + static_cast<size_t>(ids[t - 1]) * C;
            float s = 0.0f;
            for (int p = lane; p < packs; p += 32) {
                const Pack128<bf16> d = load128(dout_row + 8 * p), xp = load128(prev_row + 8 * p);
#pragma unroll
                for (int i = 0; i < 8; ++i) s = fmaf(__bfloat162float(d[i]), __bfloat162float(xp[i]), s);
            }
            s = warp_reduce_sum(s);
            const float sg = sigmoidf(gate_logit(x_row, smear_gate));
            dz = lambda * sg * (1.0f - sg) * s;
            sum_lambda += sg * s;
            if (lane < kGateWidth) sum_w = fmaf(dz, __bfloat162float(x_row[lane]), sum_w);
        }
        float g_next = 0.0f;
        const bf16* dnext_row = dout_row + C;
        if (t + 1 < T) g_next = lambda * sigmoidf(gate_logit(embed + static_cast<size_t>(ids[t + 1]) * C, smear_gate));
        for (int p = lane; p < packs; p += 32) {
            const Pack128<bf16> d = load128(dout_row + 8 * p);
            const Pack128<bf16> dn = t + 1 < T ? load128(dnext_row + 8 * p) : Pack128<bf16>::filled(__float2bfloat16(0.0f));
            Pack128<bf16> out;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int c = 8 * p + i;
                float v = fmaf(g_next, __bfloat162float(dn[i]), __bfloat162float(d[i]));
                if (c < kGateWidth) v = fmaf(dz, __bfloat162float(smear_gate[c]), v);
                out[i] = __float2bfloat16(v);
            }
            store128(dx + static_cast<size_t>(t) * C + 8 * p, out);
        }
    }
    if (lane == 0) warp_sums[warp][0] = sum_lambda;
    if (lane < kGateWidth) warp_sums[warp][1 + lane] = sum_w;
    store_block_partials(sum.scratch.partials + static_cast<size_t>(blockIdx.x) * kSmearPartials, warp_sums);
    last_block_sum(sum, kSmearPartials);
}

inline int embed_smear_backward_blocks(int T) { return ceil_div(T, kSmearRowsPerBlock); }
inline size_t embed_smear_backward_scratch_bytes(int T) {
    return static_cast<size_t>(embed_smear_backward_blocks(T)) * kSmearPartials * sizeof(float);
}
// Reads dout, the ids and their T rows, the gate and lambda; writes dx and the blocks' partials; a
// dot and a multiply-add per element.
inline Work embed_smear_backward_work(int T, int C) {
    return Work{.name = "embed_smear_backward", .flops = 4.0 * T * C,
                .bytes_read = 4.0 * T * C + 4.0 * T + 2.0 * kGateWidth + 4,
                .bytes_written = 2.0 * T * C + 4.0 * embed_smear_backward_blocks(T) * kSmearPartials};
}
// dx: (T, C) gradient of the gathered embedding rows (feed it to embedding_backward with the
// token ids); d_smear_gate: (12) bf16; d_smear_lambda: one fp32 element of the scalars' gradient.
// `accumulate` applies to the two parameter gradients; dx is always overwritten.
inline void embed_smear_backward(bf16* dx, bf16* d_smear_gate, float* d_smear_lambda, const bf16* dout,
                                 const bf16* embed, const int32_t* ids, const bf16* smear_gate,
                                 const float* smear_lambda, BlockPartials scratch, int T, int C, bool accumulate,
                                 cudaStream_t stream) {
    kernel_require(T > 0 && C >= kGateWidth && C % 8 == 0,
                   "embed_smear_backward: need T > 0 and C a multiple of 8, at least 12 (T=%d C=%d)", T, C);
    const int blocks = embed_smear_backward_blocks(T);
    const LastBlockSum sum{SumTargets().add(d_smear_lambda).add(d_smear_gate, kGateWidth), scratch, accumulate};
    launch(with_last_block_sum(embed_smear_backward_work(T, C), sum, blocks), embed_smear_backward_kernel, dim3(blocks),
           dim3(kSmearWarps * 32), 0, stream, dx, sum, dout, embed, ids, smear_gate, smear_lambda, T, C);
    CUDA_CHECK_LAUNCH();
}

// ---- embedding backward over id segments ----
// The host sorts the batch's positions by id (stable, so each id's positions stay in position
// order) and cuts each id's run of positions into chunks of at most kEmbedGradChunk. A chunk
// ("item") is summed by one row of threads; an id with one chunk writes its gradient row
// directly, an id with several writes fp32 chunk sums to scratch slots that a second kernel
// adds in chunk order. The result is the same bits on every run, and a frequent id (a common
// token can fill several percent of a batch) is spread over many blocks.
constexpr int kEmbedGradChunk = 32;
constexpr int kMaxEmbedGradTables = 8;

// Where a packed segment buffer keeps its arrays (int32 offsets), as built by IdSegmentBuilder:
//   order[T]          positions sorted by id, stable
//   unique[U]         the distinct ids, increasing (the touched table rows)
//   seg[U+1]          seg[u]..seg[u+1] is unique[u]'s range in order
//   items[I][4]       {row, begin, end, slot}: sum order[begin..end); slot -1 writes the row
//   merges[M][3]      {row, first slot, slot count}: rows summed over several slots
struct IdSegments {
    int T = 0, num_unique = 0, num_items = 0, num_merges = 0, num_slots = 0;
    size_t order_at() const { return 0; }
    size_t unique_at() const { return static_cast<size_t>(T); }
    size_t seg_at() const { return unique_at() + num_unique; }
    size_t items_at() const { return seg_at() + num_unique + 1; }
    size_t merges_at() const { return items_at() + 4 * static_cast<size_t>(num_items); }
    size_t ints() const { return merges_at() + 3 * static_cast<size_t>(num_merges); }  // used length
};
// Slots any batch of T positions can need: an id with n > K positions takes ceil(n/K) < 2n/K.
inline int embedding_grad_max_slots(int T) { return 2 * T / kEmbedGradChunk + 1; }
// int32s a packed segment buffer of T positions can need (host and device copies).
inline size_t id_segments_capacity_ints(int T) {
    const size_t t = static_cast<size_t>(T);
    return t + t + (t + 1) + 4 * t + 3 * static_cast<size_t>(T / (kEmbedGradChunk + 1) + 1);
}

// Builds the packed segments of a batch of ids on the host (the data loader has the ids there).
// LSD radix sort of 64-bit (id, position) records in at most 11-bit digits (two passes for the
// record's vocabularies; one read of the ids histograms every digit), then one sequential scan
// cuts the sorted records into segments and chunks. Linear in T; reuses its scratch.
class IdSegmentBuilder {
public:
    // Writes the packed arrays to `packed` (id_segments_capacity_ints(T) int32s, pinned memory
    // lets the caller copy them to the device asynchronously) and returns where they are.
    IdSegments build(const int32_t* ids, int T, int vocab, int32_t* packed) {
        kernel_require(T > 0 && vocab > 0, "IdSegmentBuilder::build: need T > 0 and vocab > 0 (T=%d vocab=%d)", T,
                       vocab);
        int bits = 1;
        while (bits < 31 && (int64_t(1) << bits) < vocab) ++bits;
        const int passes = (bits + 10) / 11, digit_bits = (bits + passes - 1) / passes;
        const uint32_t buckets = 1u << digit_bits, mask = buckets - 1;
        a_.resize(T);
        b_.resize(T);
        count_.assign(static_cast<size_t>(passes) * buckets, 0);
        for (int k = 0; k < T; ++k) {
            const uint32_t id = static_cast<uint32_t>(ids[k]);
            if (id >= static_cast<uint32_t>(vocab)) bad_id(ids[k], k, vocab);
            for (int p = 0; p < passes; ++p) ++count_[p * buckets + ((id >> (p * digit_bits)) & mask)];
        }
        for (int p = 0; p < passes; ++p) {  // bucket starts
            uint32_t run = 0;
            for (uint32_t b = 0; b < buckets; ++b) {
                const uint32_t c = count_[p * buckets + b];
                count_[p * buckets + b] = run;
                run += c;
            }
        }
        // pass 0 reads the ids in position order; records are (id << 32 | position)
        uint32_t* start = count_.data();
        for (int k = 0; k < T; ++k) {
            const uint32_t id = static_cast<uint32_t>(ids[k]);
            a_[start[id & mask]++] = (static_cast<uint64_t>(id) << 32) | static_cast<uint32_t>(k);
        }
        for (int p = 1; p < passes; ++p) {
            start = count_.data() + p * buckets;
            const int shift = 32 + p * digit_bits;
            for (int k = 0; k < T; ++k) b_[start[(a_[k] >> shift) & mask]++] = a_[k];
            a_.swap(b_);
        }
        // one scan: segments (runs of one id) and their chunks; order goes straight to packed
        int32_t* order = packed;
        unique_.resize(T);
        seg_.resize(static_cast<size_t>(T) + 1);
        items_.resize(4 * static_cast<size_t>(T));
        merges_.resize(3 * static_cast<size_t>(T / (kEmbedGradChunk + 1) + 1));
        int32_t *unique = unique_.data(), *seg = seg_.data(), *item = items_.data(), *merge = merges_.data();
        int slot = 0;
        for (int k = 0; k < T;) {
            const int32_t row = static_cast<int32_t>(a_[k] >> 32);
            int e = k;
            for (; e < T && static_cast<int32_t>(a_[e] >> 32) == row; ++e) order[e] = static_cast<int32_t>(a_[e]);
            *unique++ = row;
            *seg++ = k;
            if (e - k <= kEmbedGradChunk) {  // one chunk: written straight to the gradient row
                item[0] = row;
                item[1] = k;
                item[2] = e;
                item[3] = -1;
                item += 4;
            } else {
                merge[0] = row;
                merge[1] = slot;
                merge[2] = ceil_div(e - k, kEmbedGradChunk);
                merge += 3;
                for (int b = k; b < e; b += kEmbedGradChunk) {
                    item[0] = row;
                    item[1] = b;
                    item[2] = std::min(b + kEmbedGradChunk, e);
                    item[3] = slot++;
                    item += 4;
                }
            }
            k = e;
        }
        *seg++ = T;
        IdSegments s;
        s.T = T;
        s.num_unique = static_cast<int>(unique - unique_.data());
        s.num_items = static_cast<int>((item - items_.data()) / 4);
        s.num_merges = static_cast<int>((merge - merges_.data()) / 3);
        s.num_slots = slot;
        std::copy(unique_.data(), unique, packed + s.unique_at());
        std::copy(seg_.data(), seg, packed + s.seg_at());
        std::copy(items_.data(), item, packed + s.items_at());
        std::copy(merges_.data(), merge, packed + s.merges_at());
        return s;
    }

private:
    [[noreturn]] static void bad_id(int32_t id, int position, int vocab) {
        kernel_require(false, "IdSegmentBuilder::build: embedding id %d at position %d is outside [0, %d)", id,
                       position, vocab);
        std::abort();
    }
    std::vector<uint64_t> a_, b_;
    std::vector<uint32_t> count_;
    std::vector<int32_t> unique_, seg_, items_, merges_;
};

// Up to 8 tables whose gradients come from the same ids (e.g. embed and the value embeddings).
struct EmbeddingGradBatch {
    int count = 0;
    int unused = 0;  // no padding: emu reads every word of a kernel's struct argument (PointerArg)
    bf16* grad[kMaxEmbedGradTables] = {};         // table gradients (rows, C)
    const bf16* dout[kMaxEmbedGradTables] = {};   // per-position row gradients (T, C)
};

static_assert(std::has_unique_object_representations_v<EmbeddingGradBatch>, "EmbeddingGradBatch: padding");

__device__ __forceinline__ void embedding_grad_store_row(bf16* grad_row, const float* acc, bool accumulate) {
    Pack128<bf16> out;
    if (accumulate) {
        const Pack128<bf16> old = load128(grad_row);
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __float2bfloat16(__bfloat162float(old[i]) + acc[i]);
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = __float2bfloat16(acc[i]);
    }
    store128(grad_row, out);
}

// One item per threadIdx.y row, one table per blockIdx.y: sum the item's position rows in order.
__global__ void embedding_grad_items_kernel(EmbeddingGradBatch batch, const int32_t* order, const int32_t* items,
                                            int num_items, float* slots, int max_slots, int C, bool accumulate,
                                            BigramSigns signs) {
    const int item = blockIdx.x * blockDim.y + threadIdx.y;
    if (item >= num_items) return;
    const int table = blockIdx.y, c = threadIdx.x * 8;
    const int32_t row = items[4 * item], begin = items[4 * item + 1], end = items[4 * item + 2],
                  slot = items[4 * item + 3];
    const bf16* dout = batch.dout[table];
    float acc[8] = {};
    for (int k = begin; k < end; ++k) {
        const int t = order[k];
        Pack128<bf16> g = load128(dout + static_cast<size_t>(t) * C + c);
        if (signs.table) g = times_signs(g, bigram_sign_row(signs, t, C) + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += __bfloat162float(g[i]);
    }
    if (slot < 0) {
        embedding_grad_store_row(batch.grad[table] + static_cast<size_t>(row) * C + c, acc, accumulate);
    } else {
        float* dst = slots + (static_cast<size_t>(table) * max_slots + slot) * C + c;
        store128(dst, Pack128<float>{{acc[0], acc[1], acc[2], acc[3]}});
        store128(dst + 4, Pack128<float>{{acc[4], acc[5], acc[6], acc[7]}});
    }
}

// One multi-chunk row per threadIdx.y row: add its chunk sums in chunk order.
__global__ void embedding_grad_merge_kernel(EmbeddingGradBatch batch, const int32_t* merges, int num_merges,
                                            const float* slots, int max_slots, int C, bool accumulate) {
    const int m = blockIdx.x * blockDim.y + threadIdx.y;
    if (m >= num_merges) return;
    const int table = blockIdx.y, c = threadIdx.x * 8;
    const int32_t row = merges[3 * m], first = merges[3 * m + 1], count = merges[3 * m + 2];
    float acc[8] = {};
    for (int s = first; s < first + count; ++s) {
        const float* src = slots + (static_cast<size_t>(table) * max_slots + s) * C + c;
        const Pack128<float> a = load128(src), b = load128(src + 4);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            acc[i] += a[i];
            acc[4 + i] += b[i];
        }
    }
    embedding_grad_store_row(batch.grad[table] + static_cast<size_t>(row) * C + c, acc, accumulate);
}

// The two passes of embedding_backward over `tables` tables. Items: read the order and the items, every
// position's row of dout (an add per element), and the rows they overwrite only when accumulating;
// write the single-chunk ids' rows (bf16) and the chunk sums (fp32 slots). Merges: read the merges
// and the slots (an add per element), write the multi-chunk ids' rows.
// With signs, also the tokens and each position's sign row (a multiply per element).
inline Work embedding_grad_items_work(const IdSegments& s, int C, int tables, bool accumulate, bool signs) {
    const double single_rows = 2.0 * (s.num_unique - s.num_merges) * C, slots = 4.0 * s.num_slots * C;
    const double per_table_read = 2.0 * s.T * C + (accumulate ? single_rows : 0);
    return Work{.name = "embedding_backward", .flops = (signs ? 2.0 : 1.0) * tables * s.T * C,
                .bytes_read = 4.0 * s.T + 16.0 * s.num_items + tables * per_table_read +
                              (signs ? 4.0 * s.T + 2.0 * s.T * C : 0.0),
                .bytes_written = tables * (single_rows + slots)};
}
inline Work embedding_grad_merge_work(const IdSegments& s, int C, int tables, bool accumulate) {
    const double merged_rows = 2.0 * s.num_merges * C;
    return Work{.name = "embedding_backward", .flops = 1.0 * tables * s.num_slots * C,
                .bytes_read = 12.0 * s.num_merges + tables * (4.0 * s.num_slots * C + (accumulate ? merged_rows : 0)),
                .bytes_written = tables * merged_rows};
}

// Scratch for embedding_backward: fp32 chunk sums, per table.
inline size_t embedding_backward_scratch_bytes(int T, int C, int tables = 1) {
    return static_cast<size_t>(tables) * embedding_grad_max_slots(T) * C * sizeof(float);
}
// grad[ids[t]] (+)= sum of dout[t] over the positions t of each id, for every table of the batch (each
// dout[t] times its sign row where `signs` has a table: the bigram table of record 83).
// `segments`/`device_packed`: a buffer built by IdSegmentBuilder::build and copied to the device
// (its first segments.ints() int32s). Rows of the tables whose id is not in the batch are not
// touched: zero the gradient (cudaMemsetAsync) when a fresh accumulation starts.
inline void embedding_backward(const EmbeddingGradBatch& batch, const IdSegments& segments,
                               const int32_t* device_packed, float* scratch, int C, bool accumulate,
                               cudaStream_t stream, const BigramSigns& signs = {}) {
    bigram_signs_check(signs, "embedding_backward");
    kernel_require(batch.count >= 1 && batch.count <= kMaxEmbedGradTables,
                   "embedding_backward: 1 to %d tables per call, got %d", kMaxEmbedGradTables, batch.count);
    kernel_require(C % 8 == 0 && C > 0 && C / 8 <= 1024,
                   "embedding_backward: C must be a multiple of 8 up to 8192 (C=%d)", C);
    kernel_require(segments.num_slots <= embedding_grad_max_slots(segments.T),
                   "embedding_backward: segments need %d scratch slots, more than the bound %d", segments.num_slots,
                   embedding_grad_max_slots(segments.T));
    const int threads_x = C / 8, rows = std::max(1, 256 / threads_x);
    const int max_slots = embedding_grad_max_slots(segments.T);
    const dim3 block(threads_x, rows);
    launch(embedding_grad_items_work(segments, C, batch.count, accumulate, signs.table != nullptr),
           embedding_grad_items_kernel, dim3(ceil_div(segments.num_items, rows), batch.count), block, 0, stream, batch,
           device_packed + segments.order_at(), device_packed + segments.items_at(), segments.num_items, scratch,
           max_slots, C, accumulate, signs);
    CUDA_CHECK_LAUNCH();
    if (segments.num_merges > 0) {
        launch(embedding_grad_merge_work(segments, C, batch.count, accumulate), embedding_grad_merge_kernel,
               dim3(ceil_div(segments.num_merges, rows), batch.count), block, 0, stream, batch,
               device_packed + segments.merges_at(), segments.num_merges, static_cast<const float*>(scratch),
               max_slots, C, accumulate);
        CUDA_CHECK_LAUNCH();
    }
}
// One table.
inline void embedding_backward(bf16* grad_table, const bf16* dout, const IdSegments& segments,
                               const int32_t* device_packed, float* scratch, int C, bool accumulate,
                               cudaStream_t stream, const BigramSigns& signs = {}) {
    EmbeddingGradBatch batch;
    batch.count = 1;
    batch.grad[0] = grad_table;
    batch.dout[0] = dout;
    embedding_backward(batch, segments, device_packed, scratch, C, accumulate, stream, signs);
}
