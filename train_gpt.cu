// train_gpt: the modded-nanogpt speedrun (record of 2026-02-06) as one CUDA program.
// Reads top to bottom: configuration, memory layout, parameter init, forward, backward, main.
// The optimizer, the training loop and logging are being added (issues 6 and 7); until then
// `main` prints the memory plan (--print-memory) or runs the platform check (kernel, cuBLASLt
// and NCCL on every rank, compared with the host).
//   mpirun -np 8 ./train_gpt          (GPU build)
//   mpirun -np 2 ./train_gpt_cpu      (CPU build, emu)
#include "data/loader.h"
#include "kernels/attention.cuh"
#include "kernels/common.cuh"
#include "kernels/embed.cuh"
#include "kernels/head.cuh"
#include "kernels/matmul.cuh"
#include "kernels/mlp.cuh"
#include "kernels/norm.cuh"
#include "kernels/residual.cuh"
#include "kernels/rope.cuh"

#include <mpi.h>
#include <nccl.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#define NCCL_CHECK(call)                                                                              \
    do {                                                                                              \
        ncclResult_t r_ = (call);                                                                     \
        if (r_ != ncclSuccess) {                                                                      \
            std::fprintf(stderr, "NCCL error at %s:%d: %s: %s\n", __FILE__, __LINE__, #call,          \
                         ncclGetErrorString(r_));                                                     \
            std::exit(EXIT_FAILURE);                                                                  \
        }                                                                                             \
    } while (0)

// ============================================================================================
// Configuration: every hyperparameter of the record in one place (upstream's Hyperparameters
// and TRAINING_STAGES), and the tiny preset that exercises every feature on a CPU.
// ============================================================================================

struct TrainingStage {
    double duration;             // fraction of the scheduled steps (the extension stage: 0)
    int64_t batch_tokens;        // tokens per step over all ranks and micro-steps
    int ws_short, ws_long;       // attention windows in blocks of `block_size` tokens
    double lr_mul;
    std::vector<float> mtp_start, mtp_end;  // multi-token-prediction weights, interpolated over the stage
};

struct Config {
    std::string name;
    // model (11 layers; the layer structure is below)
    int vocab_size = 50257, padded_vocab = 50304;
    int model_dim = 768, num_heads = 6, head_dim = 128, mlp_dim = 3072;
    int bigram_vocab = 50304 * 5;
    // data
    int max_seq_len = 2048;                  // documents are cut at this many tokens
    int64_t val_batch_tokens = 4 * 64 * 1024 * 8, val_tokens = 10485760;
    // schedule
    int scheduled_iterations = 1515, extension_iterations = 40;
    double cooldown_frac = 0.55;
    int block_size = 128;                    // window unit in tokens
    int final_ws_long = 20;                  // long window (blocks) of the final validation
    std::vector<TrainingStage> stages;
    // distributed: the speedrun is defined for 8 GPUs; fewer ranks accumulate micro-steps
    int world_size = 1;
    int grad_accum() const { return 8 / world_size; }
    // tokens per rank per micro-step
    int micro_tokens(int64_t batch_tokens) const { return static_cast<int>(batch_tokens / 8); }
    int max_train_tokens() const {
        int64_t m = 0;
        for (const TrainingStage& s : stages) m = std::max(m, s.batch_tokens);
        return micro_tokens(m);
    }
    int val_micro_tokens() const { return micro_tokens(val_batch_tokens); }
    int max_window_tokens() const {
        int m = final_ws_long;
        for (const TrainingStage& s : stages) m = std::max(m, s.ws_long);
        return m * block_size;
    }
};

Config record_preset() {
    Config c;
    c.name = "record";
    c.stages = {
        {1.0 / 3, 8 * 2048 * 8, 1, 3, 1.0, {1.0f, 0.5f, 0.25f}, {1.0f, 0.5f, 0.0f}},
        {1.0 / 3, 16 * 2048 * 8, 3, 7, 1.52, {1.0f, 0.5f}, {1.0f, 0.0f}},
        {1.0 / 3, 24 * 2048 * 8, 5, 11, 1.73, {1.0f}, {1.0f}},
        {0.0, 24 * 2048 * 8, 6, 13, 1.0, {1.0f}, {1.0f}},  // extension
    };
    return c;
}

// Every feature of the record at a width a CPU trains in minutes: 2 heads of 64, windows in
// blocks of 32 tokens so that they bite within 256-token documents.
Config tiny_preset() {
    Config c = record_preset();
    c.name = "tiny";
    c.model_dim = 128;
    c.num_heads = 2;
    c.head_dim = 64;
    c.mlp_dim = 512;
    c.bigram_vocab = 4096 * 5;
    c.max_seq_len = 256;
    c.val_batch_tokens = 8 * 512;
    c.val_tokens = 8 * 512 * 4;
    c.scheduled_iterations = 30;
    c.extension_iterations = 4;
    c.block_size = 32;
    c.stages[0].batch_tokens = 8 * 256;
    c.stages[1].batch_tokens = 8 * 384;
    c.stages[2].batch_tokens = c.stages[3].batch_tokens = 8 * 512;
    return c;
}

// Why a config cannot run (empty when it can): the shape rules the kernels rely on.
std::string config_error(const Config& c) {
    auto bad = [&](const std::string& what) { return "config '" + c.name + "': " + what; };
    if (c.num_heads * c.head_dim != c.model_dim) return bad("num_heads * head_dim must equal model_dim");
    if (c.num_heads % 2 != 0) return bad("paired-head layers need an even number of heads");
    if (c.head_dim != 64 && c.head_dim != 128) return bad("head_dim must be 64 or 128 (the attention kernels' tiles)");
    if (c.model_dim % 64 != 0 || c.model_dim > 1024) return bad("model_dim must be a multiple of 64, at most 1024");
    if (c.mlp_dim % 64 != 0) return bad("mlp_dim must be a multiple of 64");
    if (c.padded_vocab % 128 != 0 || c.padded_vocab < c.vocab_size) return bad("padded_vocab must be a multiple of 128 >= vocab_size");
    if (c.bigram_vocab < 2) return bad("bigram_vocab must be at least 2");
    if (c.world_size < 1 || 8 % c.world_size != 0) return bad("the world size must divide 8");
    if (c.stages.empty()) return bad("at least one training stage is needed");
    for (const TrainingStage& st : c.stages)
        if (st.batch_tokens % (8 * 16) != 0 || st.mtp_start.size() != st.mtp_end.size() || st.mtp_start.empty() ||
            st.mtp_start.size() > 8)
            return bad("each stage's batch must split into 8 micro-batches of a multiple of 16 tokens, with 1 to 8 "
                       "MTP weights");
    if (c.val_batch_tokens % (8 * 16) != 0) return bad("the validation batch must split into 8 multiples of 16 tokens");
    return "";
}

// The layer structure of the record (fixed: the code below follows it).
constexpr int kLayers = 11;
constexpr int kAttnLayers = 10;      // layer 6 has no attention
constexpr int kValueTables = 5;      // value embeddings on layers 0, 1 and 8, 9, 10
constexpr int kSkipFrom = 3, kSkipTo = 6, kBackoutLayer = 7;
constexpr int kGate = 12;            // gates read the first 12 channels
constexpr bool has_attention(int l) { return l != 6; }
constexpr int attn_index(int l) { return l < 6 ? l : l - 1; }  // row of attn_bank / attn_gate_bank
constexpr bool is_paired(int l) { return l == 0 || l == 2 || l == 5 || l == 9; }
constexpr bool is_long_window(int l) { return l == 3 || l == 10; }
constexpr int value_table(int l) { return l < 2 ? l : (l >= 8 ? l - 6 : -1); }  // -1: none
// The scalars vector: resid lambdas, sa lambdas (pairs), bigram lambdas, then three singles.
constexpr int kResidLambdas = 0, kSaLambdas = kLayers, kBigramLambdas = 3 * kLayers;
constexpr int kSmearLambda = 4 * kLayers, kBackoutLambda = 4 * kLayers + 1, kSkipLambda = 4 * kLayers + 2;
// Upstream pads with ones by (-3 * layers - 3) mod world_size: 4 on 8 GPUs (its formula predates
// the bigram lambdas, so the length is 51, not a multiple of 8). The padding is never read.
constexpr int kScalars = 4 * kLayers + 3 + 4;

// ============================================================================================
// Memory: one arena per kind (parameters, gradients, activations). A layout function takes
// every tensor from an arena by name; run once to measure, once more to place.
// ============================================================================================

enum class DType { bf16, f32, i32, f8, bytes };
inline const char* dtype_name(DType t) {
    return t == DType::bf16 ? "bf16" : t == DType::f32 ? "fp32" : t == DType::i32 ? "int32" : t == DType::f8 ? "fp8" : "bytes";
}
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<__nv_fp8_e4m3>() { return DType::f8; }
template <> constexpr DType dtype_of<__nv_fp8_e5m2>() { return DType::f8; }
template <> constexpr DType dtype_of<unsigned char>() { return DType::bytes; }

class Arena {
public:
    struct Entry {
        std::string name;
        DType dtype;
        std::vector<int64_t> shape;
        size_t offset, bytes;
    };
    explicit Arena(const char* kind) : kind_(kind) {}
    ~Arena() {
        if (base_) cudaFree(base_);
    }
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    // The next tensor: 256-byte aligned; null while measuring.
    template <class T>
    T* take(const std::string& name, std::vector<int64_t> shape) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        const size_t bytes = static_cast<size_t>(n) * sizeof(T), at = used_;
        used_ += (bytes + 255) / 256 * 256;
        if (!base_) entries_.push_back({name, dtype_of<T>(), std::move(shape), at, bytes});
        return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
    }
    // Raw bytes (workspaces).
    void* take_bytes(const std::string& name, size_t bytes) {
        return take<unsigned char>(name, {static_cast<int64_t>(bytes)});
    }
    // A region two layouts share (used only one at a time): both measure from the same start.
    size_t mark() const { return used_; }
    void rewind_to(size_t at, size_t high_water) {
        peak_ = std::max(peak_, high_water);
        used_ = at;
    }
    size_t bytes() const { return std::max(used_, peak_); }
    void* base() const { return base_; }

    // Allocate what the measuring pass counted; the caller then runs its layout again.
    void allocate() {
        const size_t total = bytes();
        CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base_), total));
        CUDA_CHECK(cudaMemset(base_, 0, total));
        used_ = peak_ = 0;
    }
    void print(FILE* f, bool tensors) const {
        std::fprintf(f, "%-12s %10.1f MiB\n", kind_, bytes() / 1048576.0);
        if (!tensors) return;
        for (const Entry& e : entries_) {
            std::string shape;
            for (int64_t d : e.shape) shape += (shape.empty() ? "" : " x ") + std::to_string(d);
            std::fprintf(f, "    %-28s %-5s %-24s %10.2f MiB\n", e.name.c_str(), dtype_name(e.dtype), shape.c_str(),
                         e.bytes / 1048576.0);
        }
    }

private:
    const char* kind_;
    unsigned char* base_ = nullptr;
    size_t used_ = 0, peak_ = 0;
    std::vector<Entry> entries_;
};

// Places a layout: measure, allocate, place (the layout function fills its struct's pointers).
template <class Layout>
void place(Arena& arena, Layout layout) {
    layout(arena);
    arena.allocate();
    layout(arena);
}

// ---- parameters (and, with the same layout, their gradients) ----
using bf16 = __nv_bfloat16;
struct Params {
    bf16* embed;           // (V, C), tied to lm_head^T until the split step
    bf16* lm_head;         // (C, V): stored transposed, as upstream's CastedLinearT
    bf16* bigram_embed;    // (bigram_vocab, C)
    bf16* value_embeds;    // (5 V, C): five tables
    bf16* attn_bank;       // (10, 4C, C): per attention layer [Wq; Wk; Wv; Wo]
    bf16* mlp_bank;        // (12, 2, mlp, C): [c_fc, c_proj] per layer, index 11 is padding
    bf16* attn_gate_bank;  // (10, H, 12)
    bf16* ve_gate_bank;    // (5, H, 12)
    bf16* smear_gate;      // (12)
    bf16* skip_gate;       // (12)
    float* x0_lambdas;     // (11)
    float* scalars;        // (kScalars): see the offsets above

    bf16* wqkv(const Config& c, int l) const { return attn_bank + int64_t(attn_index(l)) * 4 * c.model_dim * c.model_dim; }
    bf16* wo(const Config& c, int l) const { return wqkv(c, l) + int64_t(3) * c.model_dim * c.model_dim; }
    bf16* c_fc(const Config& c, int l) const { return mlp_bank + int64_t(l) * 2 * c.mlp_dim * c.model_dim; }
    bf16* c_proj(const Config& c, int l) const { return c_fc(c, l) + int64_t(c.mlp_dim) * c.model_dim; }
    bf16* attn_gate(const Config& c, int l) const { return attn_gate_bank + attn_index(l) * c.num_heads * kGate; }
    bf16* ve_table(const Config& c, int l) const {
        return value_table(l) < 0 ? nullptr : value_embeds + int64_t(value_table(l)) * c.padded_vocab * c.model_dim;
    }
    bf16* ve_gate(const Config& c, int l) const {
        return value_table(l) < 0 ? nullptr : ve_gate_bank + value_table(l) * c.num_heads * kGate;
    }
};

void layout_params(Arena& a, const Config& c, Params& p) {
    const int64_t V = c.padded_vocab, C = c.model_dim, H = c.num_heads;
    p.embed = a.take<bf16>("embed", {V, C});
    p.lm_head = a.take<bf16>("lm_head", {C, V});
    p.bigram_embed = a.take<bf16>("bigram_embed", {c.bigram_vocab, C});
    p.value_embeds = a.take<bf16>("value_embeds", {kValueTables * V, C});
    p.attn_bank = a.take<bf16>("attn_bank", {kAttnLayers, 4 * C, C});
    p.mlp_bank = a.take<bf16>("mlp_bank", {kLayers + 1, 2, c.mlp_dim, C});
    p.attn_gate_bank = a.take<bf16>("attn_gate_bank", {kAttnLayers, H, kGate});
    p.ve_gate_bank = a.take<bf16>("ve_gate_bank", {kValueTables, H, kGate});
    p.smear_gate = a.take<bf16>("smear_gate", {1, kGate});
    p.skip_gate = a.take<bf16>("skip_gate", {1, kGate});
    p.x0_lambdas = a.take<float>("x0_lambdas", {kLayers});
    p.scalars = a.take<float>("scalars", {kScalars});
}

// ---- activations: what the backward reads, per layer, plus the step's other buffers ----
struct LayerActs {
    bf16* x;           // stream entering the layer
    bf16* xm;          // after the skip add (layer 6) and the residual mix
    bf16* h_attn;      // norm(xm): the attention's input (the MLP's on layer 6)
    float* rstd_attn;
    bf16* wqkv_eff;    // sa_lambda0 * [Wq; Wk; Wv]  (3C, C)
    bf16* wo_eff;      // sa_lambda1 * Wo             (C, C)
    bf16* qkv;         // (T, 3C)
    bf16 *q, *k, *v;   // (T, H, D): normed, rotated, offset keys; v with value embeddings
    float *rstd_q, *rstd_k;
    bf16* y;           // attention output (T, H, D)
    float* lse;        // (H, T)
    bf16* y_gated;
    bf16* xa;          // stream after the attention block
    bf16* h_mlp;       // norm(xa)
    float* rstd_mlp;
    bf16 *pre, *post;  // (T, mlp)
};

struct Acts {
    int T = 0;                  // tokens this layout holds
    bool training = true;       // eval layouts share one set of layer buffers
    bf16* smeared;              // token embedding after the smear (T, C)
    bf16* x0;                   // norm(smeared)
    float* rstd_x0;
    bf16* x0_bigram;            // bigram embedding rows
    LayerActs layer[kLayers];
    bf16* x_out;                // the last layer's output
    bf16* x_final;              // after the backout
    bf16* h_final;              // norm(x_final): the lm_head's input
    float* rstd_final;
    bf16* block_out;            // a block's projection output before it joins the stream
    bf16* logits;               // (rows, V): all of T in training, `logit_rows` per chunk in eval
    int logit_rows;
    float* lse_head;            // (T)
    float* row_losses;          // (T)
    LmHeadFp8Buffers fp8;
};

// Training keeps every layer's tensors for the backward; eval streams layers through one set and
// computes the lm_head in chunks of rows (upstream's 262144-token validation would need 26 GB of
// logits at once).
void layout_acts(Arena& a, const Config& c, int T, bool training, Acts& s) {
    const int64_t C = c.model_dim, H = c.num_heads, V = c.padded_vocab, M = c.mlp_dim;
    s.T = T;
    s.training = training;
    const std::string m = training ? "train." : "eval.";
    s.smeared = a.take<bf16>(m + "smeared", {T, C});
    s.x0 = a.take<bf16>(m + "x0", {T, C});
    s.rstd_x0 = a.take<float>(m + "rstd_x0", {T});
    s.x0_bigram = a.take<bf16>(m + "x0_bigram", {T, C});
    for (int l = 0; l < kLayers; ++l) {
        LayerActs& L = s.layer[l];
        if (!training && l > 0) {  // eval streams every layer through layer 0's buffers
            L = s.layer[0];
            continue;
        }
        const std::string n = m + "layer" + std::to_string(l) + ".";
        L = LayerActs{};
        L.xm = a.take<bf16>(n + "xm", {T, C});
        L.h_attn = a.take<bf16>(n + "h_attn", {T, C});
        L.rstd_attn = a.take<float>(n + "rstd_attn", {T});
        if (has_attention(l)) {
            L.wqkv_eff = a.take<bf16>(n + "wqkv_eff", {3 * C, C});
            L.wo_eff = a.take<bf16>(n + "wo_eff", {C, C});
            L.qkv = a.take<bf16>(n + "qkv", {T, 3 * C});
            L.q = a.take<bf16>(n + "q", {T, C});
            L.k = a.take<bf16>(n + "k", {T, C});
            L.v = a.take<bf16>(n + "v", {T, C});
            L.rstd_q = a.take<float>(n + "rstd_q", {T, H});
            L.rstd_k = a.take<float>(n + "rstd_k", {T, H});
            L.y = a.take<bf16>(n + "y", {T, C});
            L.lse = a.take<float>(n + "lse", {H, T});
            L.y_gated = a.take<bf16>(n + "y_gated", {T, C});
            L.xa = a.take<bf16>(n + "xa", {T, C});
            L.h_mlp = a.take<bf16>(n + "h_mlp", {T, C});
            L.rstd_mlp = a.take<float>(n + "rstd_mlp", {T});
        }
        L.pre = a.take<bf16>(n + "pre", {T, M});
        L.post = a.take<bf16>(n + "post", {T, M});
    }
    // Streams between layers (layer 0 reads x0): every layer's input in training; in eval one
    // buffer passed along, and the two streams read again later (the skip's and the backout's).
    bf16* passed = training ? nullptr : a.take<bf16>(m + "stream", {T, C});
    for (int l = 1; l < kLayers; ++l) {
        const bool own = training || l == kSkipFrom + 1 || l == kBackoutLayer + 1;
        s.layer[l].x = own ? a.take<bf16>(m + "layer" + std::to_string(l) + ".x", {T, C}) : passed;
    }
    s.layer[0].x = s.x0;
    s.x_out = a.take<bf16>(m + "x_out", {T, C});
    s.x_final = a.take<bf16>(m + "x_final", {T, C});
    s.h_final = a.take<bf16>(m + "h_final", {T, C});
    s.rstd_final = a.take<float>(m + "rstd_final", {T});
    s.block_out = a.take<bf16>(m + "block_out", {T, C});
    s.logit_rows = training ? T : std::min<int>(T, 8192);
    s.logits = a.take<bf16>(m + "logits", {s.logit_rows, V});
    s.lse_head = a.take<float>(m + "lse_head", {T});
    s.row_losses = a.take<float>(m + "row_losses", {T});
    if (training) {
        s.fp8.x_f8 = a.take<__nv_fp8_e4m3>(m + "x_f8", {T, C});
        s.fp8.x_f8_t = a.take<__nv_fp8_e4m3>(m + "x_f8_t", {C, T});
        s.fp8.w_f8 = a.take<__nv_fp8_e4m3>(m + "w_f8", {C, V});
        s.fp8.w_f8_t = a.take<__nv_fp8_e4m3>(m + "w_f8_t", {V, C});
        s.fp8.g_f8 = a.take<__nv_fp8_e5m2>(m + "g_f8", {T, V});
        s.fp8.g_f8_t = a.take<__nv_fp8_e5m2>(m + "g_f8_t", {V, T});
    } else {
        s.fp8 = {};
    }
}

// ---- the backward's own buffers (training layout only) ----
struct BackwardBufs {
    bf16* dX;                // gradient of the stream at the current layer boundary
    bf16* dX_skip;           // layer 3's output: the skip's share, then the rest
    bf16* dX_backout;        // layer 7's output: the backout's share, then the rest
    bf16* dh;                // gradient of a norm's output (a block's input)
    bf16* gx0;               // gradient of x0, summed over layers
    bf16* gxb;               // gradient of x0_bigram, summed over layers
    bf16* d_smeared;
    bf16* d_embed_rows;      // gradient of the gathered embedding rows
    bf16* dve[kValueTables]; // gradient of each layer's value-embedding rows
    bf16* dqkv;              // (T, 3C)
    bf16 *dq, *dk, *dv, *dy; // (T, H, D)
    float *dz_attn, *dz_ve;  // gate logit gradients (T, H)
    bf16* dw_eff;            // gradient of a lambda-scaled weight (3C, C)
    float* scratch;          // partial sums, attention workspace, embedding chunk sums
    size_t scratch_bytes;
};

void layout_backward(Arena& a, const Config& c, int T, BackwardBufs& w) {
    const int64_t C = c.model_dim, H = c.num_heads;
    w.dX = a.take<bf16>("bw.dX", {T, C});
    w.dX_skip = a.take<bf16>("bw.dX_skip", {T, C});
    w.dX_backout = a.take<bf16>("bw.dX_backout", {T, C});
    w.dh = a.take<bf16>("bw.dh", {T, C});
    w.gx0 = a.take<bf16>("bw.gx0", {T, C});
    w.gxb = a.take<bf16>("bw.gxb", {T, C});
    w.d_smeared = a.take<bf16>("bw.d_smeared", {T, C});
    w.d_embed_rows = a.take<bf16>("bw.d_embed_rows", {T, C});
    for (int k = 0; k < kValueTables; ++k) w.dve[k] = a.take<bf16>("bw.dve" + std::to_string(k), {T, C});
    w.dqkv = a.take<bf16>("bw.dqkv", {T, 3 * C});
    w.dq = a.take<bf16>("bw.dq", {T, C});
    w.dk = a.take<bf16>("bw.dk", {T, C});
    w.dv = a.take<bf16>("bw.dv", {T, C});
    w.dy = a.take<bf16>("bw.dy", {T, C});
    w.dz_attn = a.take<float>("bw.dz_attn", {T, H});
    w.dz_ve = a.take<float>("bw.dz_ve", {T, H});
    w.dw_eff = a.take<bf16>("bw.dw_eff", {3 * C, C});
    w.scratch_bytes = std::max({residual_backward_scratch_bytes(T), lambda_scaled_weight_backward_scratch_bytes(3 * C * C),
                                attn_gates_backward_scratch_bytes(T, c.num_heads), embed_smear_backward_scratch_bytes(T),
                                embedding_backward_scratch_bytes(T, c.model_dim, 1 + kValueTables),
                                attention_backward_workspace_bytes(T, c.num_heads, c.head_dim)});
    w.scratch = static_cast<float*>(a.take_bytes("bw.scratch", w.scratch_bytes));
}

// ---- a micro-batch on the device, and what the host built for the embedding backward ----
struct DeviceBatch {
    int T = 0, num_cu = 0;
    int capacity = 0, cu_capacity = 0;  // what the arena holds
    int32_t *inputs, *targets, *cu_seqlens, *bigram;
    IdSegments token_segments, bigram_segments;  // host descriptions of the packed buffers
    int32_t *token_segments_dev, *bigram_segments_dev;
};
void layout_batch(Arena& a, int T, DeviceBatch& b) {
    const int64_t cu = dataload::max_num_docs_for(T);
    b.capacity = T;
    b.cu_capacity = static_cast<int>(cu);
    b.inputs = a.take<int32_t>("batch.inputs", {T});
    b.targets = a.take<int32_t>("batch.targets", {T});
    b.cu_seqlens = a.take<int32_t>("batch.cu_seqlens", {cu});
    b.bigram = a.take<int32_t>("batch.bigram", {T});
    b.token_segments_dev = a.take<int32_t>("batch.token_segments", {static_cast<int64_t>(id_segments_capacity_ints(T))});
    b.bigram_segments_dev = a.take<int32_t>("batch.bigram_segments", {static_cast<int64_t>(id_segments_capacity_ints(T))});
}

// Copies one rank's micro-batch to the device and builds, on the host, the id segments the
// embedding backward needs (positions grouped by token id and by bigram id).
struct BatchUploader {
    IdSegmentBuilder builder;
    std::vector<int32_t> token_packed, bigram_packed;
    void upload(DeviceBatch& b, const Config& c, const int32_t* inputs, const int32_t* targets, const int32_t* cu_seqlens,
                int num_cu, const int32_t* bigram, int T, cudaStream_t s) {
        auto fail = [](const std::string& why) {
            std::fprintf(stderr, "train_gpt: bad batch: %s\n", why.c_str());
            std::exit(EXIT_FAILURE);
        };
        if (T <= 0 || T % 16 != 0) fail(std::to_string(T) + " tokens is not a positive multiple of 16");
        if (T > b.capacity) fail(std::to_string(T) + " tokens exceed the " + std::to_string(b.capacity) + " the arena holds");
        if (num_cu < 2 || num_cu > b.cu_capacity || cu_seqlens[0] != 0 || cu_seqlens[num_cu - 1] != T)
            fail("cu_seqlens must have 2.." + std::to_string(b.cu_capacity) + " entries from 0 to T");
        for (int t = 0; t < T; ++t)
            if (inputs[t] < 0 || inputs[t] >= c.vocab_size || targets[t] < 0 || targets[t] >= c.vocab_size)
                fail("token id " + std::to_string(inputs[t] < 0 || inputs[t] >= c.vocab_size ? inputs[t] : targets[t]) +
                     " at position " + std::to_string(t) + " is outside the vocabulary [0, " +
                     std::to_string(c.vocab_size) + ")");
        b.T = T;
        b.num_cu = num_cu;
        token_packed.resize(id_segments_capacity_ints(T));
        bigram_packed.resize(id_segments_capacity_ints(T));
        b.token_segments = builder.build(inputs, T, c.padded_vocab, token_packed.data());
        b.bigram_segments = builder.build(bigram, T, c.bigram_vocab, bigram_packed.data());
        const size_t n = size_t(T) * sizeof(int32_t);
        CUDA_CHECK(cudaMemcpyAsync(b.inputs, inputs, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(b.targets, targets, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(b.bigram, bigram, n, cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(b.cu_seqlens, cu_seqlens, num_cu * sizeof(int32_t), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(b.token_segments_dev, token_packed.data(), b.token_segments.ints() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(b.bigram_segments_dev, bigram_packed.data(), b.bigram_segments.ints() * sizeof(int32_t),
                                   cudaMemcpyHostToDevice, s));
        // the packed buffers are reused by the next upload: they must have reached the device
        CUDA_CHECK(cudaStreamSynchronize(s));
    }
};

// What the schedule decides for one forward.
struct StepSchedule {
    int ws_short = 0, ws_long = 0;   // windows in tokens
    const float* mtp_weights;        // device, n_predict weights
    int n_predict = 1;
};

// ============================================================================================
// The model: parameters, gradients, activations, and the per-run state the forward reads.
// ============================================================================================
struct Model {
    Config cfg;
    Arena param_arena{"parameters"}, grad_arena{"gradients"}, act_arena{"activations"}, state_arena{"state"};
    Params params, grads;
    Acts train, eval;
    BackwardBufs bw;
    DeviceBatch batch, eval_batch;
    YarnRope rope;
    LmHeadFp8Scales* fp8_scales;  // device
    float* loss;                  // device: the last forward's loss (training: the sum over rows)
    float* dloss;                 // device: d(objective)/d(loss) = grad_scale
    float* mtp_weights;           // device, up to kMaxMtpWeights
    std::unique_ptr<CublasLt> lt; // made by build_model (a memory plan needs no device)
};

// Every arena's layout; `m` may be unallocated (measuring) or allocated (placing).
void layout_state(Arena& a, Model& m) {
    const Config& c = m.cfg;
    const int positions = 2 * std::max(c.max_train_tokens(), c.val_micro_tokens());
    m.rope = yarn_rope_view(nullptr, c.head_dim, positions);  // placed below
    void* rope_mem = a.take_bytes("yarn_rope", yarn_rope_bytes(c.head_dim, positions));
    if (rope_mem) m.rope = yarn_rope_view(rope_mem, c.head_dim, positions);
    m.fp8_scales = reinterpret_cast<LmHeadFp8Scales*>(a.take<float>("fp8_scales", {3}));
    m.loss = a.take<float>("loss", {1});
    m.dloss = a.take<float>("dloss", {1});
    m.mtp_weights = a.take<float>("mtp_weights", {kMaxMtpWeights});
}
void layout_activations(Arena& a, Model& m) {
    const Config& c = m.cfg;
    const int T = c.max_train_tokens(), Tv = c.val_micro_tokens();
    layout_batch(a, std::max(T, Tv), m.batch);
    m.eval_batch = m.batch;
    // training and evaluation never hold their activations at the same time: they share the rest
    const size_t shared = a.mark();
    layout_acts(a, c, T, true, m.train);
    layout_backward(a, c, T, m.bw);
    const size_t training_end = a.mark();
    a.rewind_to(shared, training_end);
    layout_acts(a, c, Tv, false, m.eval);
    a.rewind_to(shared, std::max(training_end, a.mark()));
}

// ---- initialization, as upstream's GPT.__init__ (values from a counter-based generator, so the
// same seed gives the same parameters on any GPU and in the CPU build) ----
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
// A uniform in (0, 1) from the 24 high bits of the hash of (seed, i).
__device__ __forceinline__ float hash_uniform(uint64_t seed, uint64_t i) {
    return (static_cast<float>(splitmix64(seed ^ splitmix64(i)) >> 40) + 0.5f) * 0x1p-24f;
}
// p[i] = uniform(-bound, bound)
__global__ void init_uniform_kernel(bf16* p, int64_t n, uint64_t seed, float bound) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        p[i] = __float2bfloat16((2.0f * hash_uniform(seed, i) - 1.0f) * bound);
}
// p[i] = normal(0, std) by Box-Muller on two hashed uniforms
__global__ void init_normal_kernel(bf16* p, int64_t n, uint64_t seed, float std) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const float u1 = hash_uniform(seed, 2 * i), u2 = hash_uniform(seed, 2 * i + 1);
        p[i] = __float2bfloat16(std * sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2));
    }
}
// out (cols, rows) = in (rows, cols)^T
__global__ void transpose_bf16_kernel(bf16* out, const bf16* in, int rows, int cols) {
    const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (i >= int64_t(rows) * cols) return;
    const int r = static_cast<int>(i / cols), c = static_cast<int>(i % cols);
    out[int64_t(c) * rows + r] = in[i];
}
inline dim3 grid_for(int64_t n) { return dim3(static_cast<unsigned>(std::min<int64_t>(ceil_div<int64_t>(n, 256), 4096))); }

void init_params(Model& m, uint64_t seed, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const int64_t V = c.padded_vocab, C = c.model_dim;
    const float bound = std::sqrt(3.0f) * 0.5f / std::sqrt(static_cast<float>(C));
    // zeros: bigram_embed, value_embeds, c_proj, gates, x0_lambdas (the arena starts zeroed; reset it)
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{p.bigram_embed, size_t(c.bigram_vocab) * C * 2},
                              {p.value_embeds, size_t(kValueTables) * V * C * 2},
                              {p.mlp_bank, size_t(kLayers + 1) * 2 * c.mlp_dim * C * 2},
                              {p.attn_gate_bank, size_t(kAttnLayers) * c.num_heads * kGate * 2},
                              {p.ve_gate_bank, size_t(kValueTables) * c.num_heads * kGate * 2},
                              {p.smear_gate, kGate * 2}, {p.skip_gate, kGate * 2}, {p.x0_lambdas, kLayers * 4}})
        CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, s));
    const int64_t attn_n = int64_t(kAttnLayers) * 4 * C * C, fc_n = int64_t(c.mlp_dim) * C;
    launch(init_uniform_kernel, grid_for(attn_n), dim3(256), 0, s, p.attn_bank, attn_n, seed * 16 + 1, bound);
    for (int l = 0; l <= kLayers; ++l)
        launch(init_uniform_kernel, grid_for(fc_n), dim3(256), 0, s, p.c_fc(c, l), fc_n, seed * 16 + 2 + l * 1000003, bound);
    launch(init_normal_kernel, grid_for(C * V), dim3(256), 0, s, p.lm_head, C * V, seed * 16 + 3, 0.005f);
    launch(transpose_bf16_kernel, dim3(static_cast<unsigned>(ceil_div<int64_t>(C * V, 256))), dim3(256), 0, s, p.embed,
           p.lm_head, static_cast<int>(C), static_cast<int>(V));
    CUDA_CHECK_LAUNCH();
    std::vector<float> scalars(kScalars, 1.0f);  // the tail is padding: ones, as upstream
    for (int l = 0; l < kLayers; ++l) {
        scalars[kResidLambdas + l] = 1.1f;
        scalars[kSaLambdas + 2 * l] = 0.5f;
        scalars[kSaLambdas + 2 * l + 1] = 1.0f;
        scalars[kBigramLambdas + l] = 0.1f;
    }
    scalars[kSmearLambda] = 0.0f;
    scalars[kBackoutLambda] = 0.5f;
    scalars[kSkipLambda] = -1.5f;
    CUDA_CHECK(cudaMemcpyAsync(p.scalars, scalars.data(), kScalars * sizeof(float), cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
}

// Builds the model for a config on the current device: arenas placed, parameters initialized,
// the YaRN state reset.
void build_model(Model& m, const Config& c, uint64_t seed, cudaStream_t s) {
    if (const std::string e = config_error(c); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    m.cfg = c;
    m.lt = std::make_unique<CublasLt>();
    place(m.param_arena, [&](Arena& a) { layout_params(a, c, m.params); });
    place(m.grad_arena, [&](Arena& a) { layout_params(a, c, m.grads); });
    place(m.state_arena, [&](Arena& a) { layout_state(a, m); });
    place(m.act_arena, [&](Arena& a) { layout_activations(a, m); });
    init_params(m, seed, s);
    yarn_rope_reset(m.rope, s);
    const LmHeadFp8Scales scales = lm_head_fp8_scales(c.grad_accum());
    CUDA_CHECK(cudaMemcpyAsync(m.fp8_scales, &scales, sizeof scales, cudaMemcpyHostToDevice, s));
    const float grad_scale = 2.0f / c.grad_accum();  // upstream backpropagates loss * grad_scale
    CUDA_CHECK(cudaMemcpyAsync(m.dloss, &grad_scale, sizeof grad_scale, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(cudaStreamSynchronize(s));
}

// Every rank starts from rank 0's parameters, as upstream broadcasts them after init (the
// counter-based init already agrees; the broadcast makes it a fact whatever the seeds).
void broadcast_params(Model& m, ncclComm_t comm, cudaStream_t s) {
    NCCL_CHECK(ncclBroadcast(m.param_arena.base(), m.param_arena.base(), m.param_arena.bytes(), ncclUint8, 0, comm, s));
}

// ============================================================================================
// Forward: upstream's GPT.forward, one kernel call per step.
// ============================================================================================
MixLambdas mix_lambdas(const Params& p, int l) {
    return {p.scalars + kResidLambdas + l, p.x0_lambdas + l, p.scalars + kBigramLambdas + l};
}
int layer_window(const StepSchedule& sch, int l) { return is_long_window(l) ? sch.ws_long : sch.ws_short; }

AttnAux attn_aux(const Model& m, int l, const DeviceBatch& b, const StepSchedule& sch, const bf16* xa) {
    const Config& c = m.cfg;
    AttnAux aux;
    aux.T = b.T;
    aux.H = c.num_heads;
    aux.D = c.head_dim;
    aux.paired = is_paired(l);
    // upstream shifts keys on every non-paired layer whose window equals the long one
    aux.key_offset = !is_paired(l) && layer_window(sch, l) == sch.ws_long;
    aux.rope_table = m.rope.table;
    aux.rope_positions = m.rope.positions;
    aux.xa = xa;
    aux.ids = b.inputs;
    aux.ve_table = m.params.ve_table(c, l);
    aux.ve_gate = m.params.ve_gate(c, l);
    aux.attn_gate = m.params.attn_gate(c, l);
    return aux;
}

// Training (a = m.train): the FP8 lm_head and the multi-token-prediction loss summed over rows,
// every tensor the backward needs kept. Eval (a = m.eval): the bf16 lm_head and the mean
// cross-entropy. The loss lands in m.loss.
void gpt_forward(Model& m, const DeviceBatch& b, const StepSchedule& sch, Acts& a, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const int T = b.T, C = c.model_dim, H = c.num_heads, D = c.head_dim, V = c.padded_vocab, M = c.mlp_dim;
    if (T > a.T) {
        std::fprintf(stderr, "gpt_forward: batch of %d tokens exceeds the %d the activations were sized for\n", T, a.T);
        std::exit(EXIT_FAILURE);
    }
    const float scale = static_cast<float>(m.rope.attn_scale);

    // x = x0 = norm(smear(embed[ids])); the bigram rows join every layer's mix
    embed_smear_forward(a.smeared, p.embed, b.inputs, p.smear_gate, p.scalars + kSmearLambda, T, C, s);
    rmsnorm_forward(a.x0, a.rstd_x0, a.smeared, T, C, s);
    embedding_gather(a.x0_bigram, p.bigram_embed, b.bigram, T, C, s);

    for (int l = 0; l < kLayers; ++l) {
        LayerActs& L = a.layer[l];
        if (l == kSkipTo)  // x += sigmoid(skip_lambda) * 2 * sigmoid(x0[:, :12] . skip_gate) * (layer 3's output)
            gated_skip_add_forward(L.x, L.x, a.layer[kSkipFrom + 1].x, a.x0, p.skip_gate, p.scalars + kSkipLambda, T,
                                   C, s);
        // xm = resid * x + x0_lambda * x0 + bigram_lambda * x0_bigram; h = norm(xm)
        residual_mix_forward(L.xm, L.h_attn, L.rstd_attn, L.x, a.x0, a.x0_bigram, mix_lambdas(p, l), l == 0, T, C, s);
        const bf16* stream = L.xm;
        const bf16* mlp_in = L.h_attn;
        if (has_attention(l)) {
            const float* sa = p.scalars + kSaLambdas + 2 * l;
            lambda_scaled_weight_forward(L.wqkv_eff, p.wqkv(c, l), sa, int64_t(3) * C * C, s);
            lambda_scaled_weight_forward(L.wo_eff, p.wo(c, l), sa + 1, int64_t(C) * C, s);
            const AttnAux aux = attn_aux(m, l, b, sch, L.h_attn);
            matmul_forward(*m.lt, L.qkv, L.h_attn, L.wqkv_eff, T, 3 * C, C, s);
            attn_qkv_forward(aux, L.q, L.k, L.v, L.rstd_q, L.rstd_k, L.qkv, s);
            attention_forward(L.y, L.lse, L.q, L.k, L.v, b.cu_seqlens, b.num_cu, T, H, D, layer_window(sch, l),
                              is_paired(l), scale, s);
            attn_output_gate_forward(aux, L.y_gated, L.y, s);
            matmul_forward(*m.lt, a.block_out, L.y_gated, L.wo_eff, T, C, C, s);
            residual_add_forward(L.xa, L.h_mlp, L.rstd_mlp, L.xm, a.block_out, T, C, s);
            stream = L.xa;
            mlp_in = L.h_mlp;
        }
        mlp_forward(*m.lt, a.block_out, L.pre, L.post, mlp_in, p.c_fc(c, l), p.c_proj(c, l), T, C, M, s);
        residual_add_forward(l + 1 < kLayers ? a.layer[l + 1].x : a.x_out, nullptr, nullptr, stream, a.block_out, T, C, s);
    }
    // x -= backout_lambda * (layer 7's output); h = norm(x)
    backout_forward(a.x_final, a.h_final, a.rstd_final, a.x_out, a.layer[kBackoutLayer + 1].x, p.scalars + kBackoutLambda,
                    T, C, s);
    if (a.training) {
        lm_head_fp8_forward(*m.lt, a.logits, a.fp8, a.h_final, p.lm_head, m.fp8_scales, T, C, V, s);
        softcap_mtp_loss_forward(m.loss, false, a.row_losses, a.lse_head, a.logits, b.targets, sch.mtp_weights,
                                 sch.n_predict, T, V, s);
    } else {
        for (int r = 0; r < T; r += a.logit_rows) {
            const int rows = std::min(a.logit_rows, T - r);
            lm_head_bf16_forward(*m.lt, a.logits, a.h_final + int64_t(r) * C, p.lm_head, rows, C, V, s);
            softcap_eval_loss(m.loss, r > 0, 1.0f / T, a.row_losses + r, a.logits, b.targets + r, rows, V, s);
        }
    }
}

// ============================================================================================
// Backward: the gradient of loss * grad_scale into m.grads (accumulate: add to what is there,
// as upstream's .grad accumulates over micro-steps and over Adam's two steps).
// ============================================================================================
void gpt_backward(Model& m, const DeviceBatch& b, const StepSchedule& sch, bool accumulate, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const Params& g = m.grads;
    Acts& a = m.train;
    BackwardBufs& w = m.bw;
    const int T = b.T, C = c.model_dim, H = c.num_heads, D = c.head_dim, V = c.padded_vocab, M = c.mlp_dim;
    const float scale = static_cast<float>(m.rope.attn_scale);
    bf16 *dX = w.dX, *dX_skip = w.dX_skip, *dX_backout = w.dX_backout;  // stream gradients change buffers below
    if (!accumulate) {  // the embedding backward writes only the rows of this batch's ids
        CUDA_CHECK(cudaMemsetAsync(g.embed, 0, size_t(V) * C * sizeof(bf16), s));
        CUDA_CHECK(cudaMemsetAsync(g.value_embeds, 0, size_t(kValueTables) * V * C * sizeof(bf16), s));
        CUDA_CHECK(cudaMemsetAsync(g.bigram_embed, 0, size_t(c.bigram_vocab) * C * sizeof(bf16), s));
    }

    // loss -> logits (in place) -> lm_head and its input
    softcap_mtp_loss_backward(a.logits, a.logits, a.lse_head, b.targets, sch.mtp_weights, sch.n_predict, m.dloss, T, V, s);
    lm_head_fp8_backward(*m.lt, w.dh, g.lm_head, accumulate, a.fp8, a.logits, m.fp8_scales, T, C, V, s);
    backout_backward(dX, dX_backout, g.scalars + kBackoutLambda, w.scratch, w.dh, a.x_final, a.rstd_final,
                     a.layer[kBackoutLayer + 1].x, p.scalars + kBackoutLambda, accumulate, T, C, s);
    // the last layer's output gradient is in dX; layers run backward, each leaving its input's in dX
    for (int l = kLayers - 1; l >= 0; --l) {
        LayerActs& L = a.layer[l];
        const bf16* mlp_in = has_attention(l) ? L.h_mlp : L.h_attn;
        mlp_backward(*m.lt, w.dh, g.c_fc(c, l), g.c_proj(c, l), accumulate, L.post, dX, mlp_in, p.c_fc(c, l),
                     p.c_proj(c, l), L.pre, L.post, T, C, M, s);
        if (has_attention(l)) {
            residual_add_backward(dX, w.dh, L.xa, L.rstd_mlp, T, C, s);  // dX now: the gradient of xm's stream use
            const AttnAux aux = attn_aux(m, l, b, sch, L.h_attn);
            const float* sa = p.scalars + kSaLambdas + 2 * l;
            float* dsa = g.scalars + kSaLambdas + 2 * l;
            // output projection: block_out = y_gated @ wo_eff^T
            matmul_backward_weight(*m.lt, w.dw_eff, dX, L.y_gated, T, C, C, s);
            matmul_backward_input(*m.lt, w.dy, dX, L.wo_eff, T, C, C, s);
            lambda_scaled_weight_backward(g.wo(c, l), dsa + 1, w.scratch, w.dw_eff, p.wo(c, l), sa + 1, int64_t(C) * C,
                                          accumulate, accumulate, s);
            attn_output_gate_backward(aux, w.dy, w.dz_attn, w.dy, L.y, s);
            attention_backward(w.dq, w.dk, w.dv, w.dy, L.y, L.lse, L.q, L.k, L.v, b.cu_seqlens, b.num_cu, T, H, D,
                               layer_window(sch, l), is_paired(l), scale, w.scratch, w.scratch_bytes, s);
            const int table = value_table(l);
            bf16* dve = table >= 0 ? w.dve[table] : nullptr;
            float* dz_ve = table >= 0 ? w.dz_ve : nullptr;
            attn_qkv_backward(aux, w.dqkv, dve, dz_ve, w.dq, w.dk, w.dv, L.qkv, L.rstd_q, L.rstd_k, s);
            // qkv = h_attn @ wqkv_eff^T
            matmul_backward_weight(*m.lt, w.dw_eff, w.dqkv, L.h_attn, T, 3 * C, C, s);
            matmul_backward_input(*m.lt, w.dh, w.dqkv, L.wqkv_eff, T, 3 * C, C, s);
            lambda_scaled_weight_backward(g.wqkv(c, l), dsa, w.scratch, w.dw_eff, p.wqkv(c, l), sa, int64_t(3) * C * C,
                                          accumulate, accumulate, s);
            attn_gates_backward(aux, w.dh, g.attn_gate(c, l), table >= 0 ? g.ve_gate(c, l) : nullptr, w.dz_attn, dz_ve,
                                w.scratch, accumulate, s);
        }
        // the mix: its input's gradient goes to the buffer that already holds that stream's other
        // share (layer 7's output: the backout; layer 3's: the skip; layer 0's input: x0)
        bf16* d_in = dX;
        bool add_to_d_in = false;
        if (l == 0) d_in = w.gx0, add_to_d_in = true;
        if (l == kBackoutLayer + 1) d_in = dX_backout, add_to_d_in = true;
        if (l == kSkipFrom + 1) d_in = dX_skip, add_to_d_in = true;
        residual_mix_backward(d_in, w.gx0, w.gxb, {g.scalars + kResidLambdas + l, g.x0_lambdas + l, g.scalars + kBigramLambdas + l},
                              w.scratch, dX, w.dh, L.xm, L.rstd_attn, L.x, a.x0, a.x0_bigram, mix_lambdas(p, l), l == 0,
                              add_to_d_in, l != kLayers - 1, accumulate, T, C, s);
        if (l == kBackoutLayer + 1) std::swap(dX, dX_backout);  // the layer below continues from there
        if (l == kSkipFrom + 1) std::swap(dX, dX_skip);
        if (l == kSkipTo)  // the skip add's output gradient (dX) also reaches layer 3's output and the gate
            gated_skip_add_backward(dX_skip, w.gx0, g.skip_gate, g.scalars + kSkipLambda, w.scratch, dX,
                                    a.layer[kSkipFrom + 1].x, a.x0, p.skip_gate, p.scalars + kSkipLambda, false,
                                    accumulate, T, C, s);
    }
    // x0 = norm(smeared); smeared = smear(embed[ids])
    rmsnorm_backward(w.d_smeared, w.gx0, a.smeared, a.rstd_x0, T, C, false, s);
    embed_smear_backward(w.d_embed_rows, g.smear_gate, g.scalars + kSmearLambda, w.d_smeared, p.embed, b.inputs,
                         p.smear_gate, p.scalars + kSmearLambda, w.scratch, T, C, accumulate, s);
    EmbeddingGradBatch by_token;  // embed and the value tables: rows picked by the token ids
    by_token.count = 1 + kValueTables;
    by_token.grad[0] = g.embed;
    by_token.dout[0] = w.d_embed_rows;
    for (int k = 0; k < kValueTables; ++k) {
        by_token.grad[1 + k] = g.value_embeds + int64_t(k) * V * C;
        by_token.dout[1 + k] = w.dve[k];
    }
    embedding_backward(by_token, b.token_segments, b.token_segments_dev, w.scratch, C, true, s);
    embedding_backward(g.bigram_embed, w.gxb, b.bigram_segments, b.bigram_segments_dev, w.scratch, C, true, s);
}

// ============================================================================================
// The memory plan: every arena of a rank for a config, measured without a device.
// ============================================================================================

// Optimizer state per rank (the optimizer's arena, issue 6): Adam keeps two fp32 moments of its
// shard of each parameter; NorMuon an fp32 momentum and a 16-bit mantissa per element of its
// matrices, and an fp32 second moment per row (or column) of each.
size_t optimizer_state_bytes(const Config& c, int world) {
    const int64_t V = c.padded_vocab, C = c.model_dim;
    const int64_t adam_sharded = (V * C * 2 + int64_t(c.bigram_vocab) * C + kValueTables * V * C) / world;
    const int64_t adam_replicated = kAttnLayers * c.num_heads * kGate + kValueTables * c.num_heads * kGate + 2 * kGate +
                                    kLayers + kScalars;
    const int64_t attn = int64_t(kAttnLayers) * 4 * C * C / world, mlp = int64_t(kLayers + 1) * 2 * c.mlp_dim * C / world;
    const int64_t attn_rows = int64_t(kAttnLayers) * 4 * C / world, mlp_rows = int64_t(kLayers + 1) * 2 * c.mlp_dim / world;
    return size_t(8 * (adam_sharded + adam_replicated) + 6 * (attn + mlp) + 4 * (attn_rows + mlp_rows));
}

struct MemoryPlan {
    size_t params, grads, state, activations, optimizer, workspace;
    size_t total() const { return params + grads + state + activations + optimizer + workspace; }
};
MemoryPlan plan_memory(Model& m, int world) {
    layout_params(m.param_arena, m.cfg, m.params);
    layout_params(m.grad_arena, m.cfg, m.grads);
    layout_state(m.state_arena, m);
    layout_activations(m.act_arena, m);
    return {m.param_arena.bytes(), m.grad_arena.bytes(), m.state_arena.bytes(), m.act_arena.bytes(),
            optimizer_state_bytes(m.cfg, world), CublasLt::kWorkspaceBytes};
}

// Upstream's record run peaks at 31253 MiB allocated per GPU; ours must not need more.
constexpr double kUpstreamPeakMiB = 31253;

void print_memory_plan(const Config& c, FILE* f) {
    if (const std::string e = config_error(c); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    Model m;
    m.cfg = c;
    const MemoryPlan plan = plan_memory(m, 8);
    std::fprintf(f, "memory plan per rank, preset %s (8 ranks; %d train and %d eval tokens per micro-step):\n",
                 c.name.c_str(), c.max_train_tokens(), c.val_micro_tokens());
    m.param_arena.print(f, true);
    m.grad_arena.print(f, false);
    m.state_arena.print(f, true);
    m.act_arena.print(f, true);
    std::fprintf(f, "%-12s %10.1f MiB\n", "optimizer", plan.optimizer / 1048576.0);
    std::fprintf(f, "%-12s %10.1f MiB\n", "workspace", plan.workspace / 1048576.0);
    std::fprintf(f, "%-12s %10.1f MiB (upstream's record peaks at %.0f MiB)\n", "total", plan.total() / 1048576.0,
                 kUpstreamPeakMiB);
}

// ============================================================================================
// main
// ============================================================================================

// x[i] = sin(0.01*i + offset): distinct, known data on every rank.
__global__ void fill_sine_pattern(__nv_bfloat16* x, int n, float offset) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __float2bfloat16(sinf(0.01f * i + offset));
}

// One process per GPU: the rank from MPI, the device from the rank on this node, the NCCL
// communicator from a unique id that rank 0 makes and MPI broadcasts (works across nodes).
struct Distributed {
    int rank = 0, world = 1, device = 0;
    ncclComm_t comm = nullptr;
};
Distributed start_distributed(int* argc, char*** argv) {
    Distributed d;
    MPI_Init(argc, argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &d.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &d.world);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, d.rank, MPI_INFO_NULL, &local);
    int local_rank, devices;
    MPI_Comm_rank(local, &local_rank);
    MPI_Comm_free(&local);
    CUDA_CHECK(cudaGetDeviceCount(&devices));
    d.device = local_rank % devices;
    CUDA_CHECK(cudaSetDevice(d.device));
    ncclUniqueId id;
    if (d.rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    NCCL_CHECK(ncclCommInitRank(&d.comm, d.world, id, d.rank));
    return d;
}
void stop_distributed(Distributed& d) {
    NCCL_CHECK(ncclCommDestroy(d.comm));
    MPI_Finalize();
}

// On every rank: a kernel, a cuBLASLt matmul and an NCCL all-reduce, compared with the host.
int platform_check(int rank, int world, ncclComm_t comm, cudaStream_t stream) {
    const int M = 64, N = 48, K = 96;
    __nv_bfloat16 *a, *b;
    float* out;
    CUDA_CHECK(cudaMalloc(&a, M * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&b, N * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&out, M * N * sizeof(float)));
    launch(fill_sine_pattern, dim3(ceil_div(M * K, 256)), dim3(256), 0, stream, a, M * K, float(rank));
    launch(fill_sine_pattern, dim3(ceil_div(N * K, 256)), dim3(256), 0, stream, b, N * K, float(1000 + rank));
    CUDA_CHECK_LAUNCH();
    CublasLt lt;
    matmul_forward(lt, out, a, b, M, N, K, stream);
    NCCL_CHECK(ncclAllReduce(out, out, M * N, ncclFloat32, ncclSum, comm, stream));
    std::vector<float> got(M * N);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto bf16_round = [](float v) { return __bfloat162float(__float2bfloat16(v)); };
    double worst = 0;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r)
                for (int k = 0; k < K; ++k)
                    want += double(bf16_round(std::sin(0.01f * (i * K + k) + float(r)))) *
                            bf16_round(std::sin(0.01f * (j * K + k) + float(1000 + r)));
            worst = std::max(worst, std::fabs(got[i * N + j] - want) / (1.0 + std::fabs(want)));
        }
    double worst_all;
    MPI_Allreduce(&worst, &worst_all, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    const bool ok = worst_all < 1e-4;  // fp32 accumulation of K products, summed over ranks
    if (rank == 0)
        std::printf("platform check %s: kernel, cuBLASLt matmul and NCCL all-reduce on %d rank(s) "
                    "(max relative error %.2e)\n", ok ? "passed" : "FAILED", world, worst_all);
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaFree(out));
    return ok ? 0 : 1;
}

const char* kUsage =
    "usage: train_gpt [--preset record|tiny] [--print-memory] [--help]\n"
    "  --preset NAME     configuration (default: record)\n"
    "  --print-memory    print the per-rank memory plan of the preset and exit (no GPU needed)\n";

#ifndef TRAIN_GPT_NO_MAIN
int main(int argc, char** argv) {
    Config cfg = record_preset();
    bool print_memory = false;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "--help" || arg == "-h") {
            std::printf("%s", kUsage);
            return 0;
        } else if (arg == "--print-memory") {
            print_memory = true;
        } else if (arg == "--preset" && i + 1 < argc) {
            const std::string name = argv[++i];
            if (name == "record") cfg = record_preset();
            else if (name == "tiny") cfg = tiny_preset();
            else {
                std::fprintf(stderr, "train_gpt: unknown preset '%s' (record or tiny)\n%s", name.c_str(), kUsage);
                return 2;
            }
        } else {
            std::fprintf(stderr, "train_gpt: unknown or incomplete argument '%s'\n%s", arg.c_str(), kUsage);
            return 2;
        }
    }
    if (print_memory) {
        print_memory_plan(cfg, stdout);
        return 0;
    }

    Distributed d = start_distributed(&argc, &argv);
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, d.device));
    if (d.rank == 0) std::printf("device: %s, %d SMs, %d rank(s)\n", prop.name, prop.multiProcessorCount, d.world);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));

    const int rc = platform_check(d.rank, d.world, d.comm, stream);

    CUDA_CHECK(cudaStreamDestroy(stream));
    stop_distributed(d);
    return rc;
}
#endif
