// train_gpt: the modded-nanogpt speedrun (record of 2026-02-06) as one CUDA program.
// Reads top to bottom: configuration, memory layout, parameter init, forward, backward, the
// schedule, the optimizer and its communication, the training run (validation, logs,
// checkpoints), main.
//   mpirun -np 8 ./build/train_gpt                  (GPU build, the record)
//   ./build/train_gpt_cpu --preset tiny             (CPU build against emu/, Tiny Shakespeare)
#include "data/dump.h"
#include "data/loader.h"
#include "data/prefix_table.h"
#include "kernels/attention.cuh"
#include "kernels/attention_aux.cuh"
#include "kernels/common.cuh"
#include "kernels/comms.cuh"
#include "kernels/dc_mha.cuh"
#include "kernels/embed.cuh"
#include "kernels/finite.cuh"
#include "kernels/head.cuh"
#include "kernels/matmul.cuh"
#include "kernels/mlp.cuh"
#include "kernels/mudd.cuh"
#include "kernels/norm.cuh"
#include "kernels/optim.cuh"
#include "kernels/residual.cuh"
#include "kernels/transpose.cuh"
#include "profiler/plan_step.h"
#include "profiler/profile_steps.h"
#include "runtime/arena.h"
#include "runtime/batch_producer.h"
#include "runtime/checkpoint_format.h"
#include "runtime/checkpoint_io.h"
#include "runtime/data_checks.h"
#include "runtime/device_batch.h"
#include "runtime/distributed.h"
#include "runtime/finite.h"
#include "runtime/flags.h"
#include "runtime/init_random.h"
#include "runtime/log.h"
#include "runtime/memory_plan.h"
#include "runtime/output_checks.h"
#include "runtime/param_table_check.h"
#include "runtime/platform_check.h"
#include "runtime/sharded_comms.h"
#include "runtime/step_losses.h"
#include "runtime/stop_signals.h"
#include "runtime/streams.h"

#include <nccl.h>

#include <csignal>
#include <future>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

// ============================================================================================
// Configuration: every hyperparameter of the record in one place (upstream's Hyperparameters
// and TRAINING_STAGES), and the tiny preset that exercises every feature on a CPU.
// ============================================================================================

struct TrainingStage {
    double duration;             // fraction of the scheduled steps (the extension stage: 0)
    int64_t batch_tokens;        // tokens per step over all ranks and micro-steps
    int max_seq_len;             // documents are cut at this many tokens (the rest is dropped)
    int ws_short, ws_long;       // attention windows in blocks of `block_size` tokens
    double lr_mul;
    std::vector<float> mtp_start, mtp_end;  // multi-token-prediction weights, interpolated over the stage
    // record 88 (upstream 75d6867a prefix_weight_start/_end): the prefix-token loss's weight pw, interpolated over the
    // stage as the MTP weights are (read where Config::prefix_loss)
    float prefix_start = 0.0f, prefix_end = 0.0f;
};

// The layer structure (upstream writes it as literals in its forward; here each preset states it):
// which layers attend, which of those attend in head pairs or over the stage's long window, which
// read a value-embedding table, and where the skip and the backout take their streams.
constexpr int kMaxLayers = 16, kMaxValueTables = 8;
// How the attention weights are banked for NorMuon (each matrix of a bank is orthogonalized on its own).
enum class AttnBanks {
    layer,       // record 71: `attn`, (4 A, C, C): per attention layer Wq, Wk, Wv, Wo
    head_pairs,  // record 80: `qk_bank`, (pad8(A H), 2 D, C): per attention layer Wq's then Wk's rows in head
                 // pairs; `vo_bank`, (pad8(2 A), C, C): per attention layer Wv, Wo. Padding matrices stay zero.
};
struct Structure {
    int layers = 11;
    std::vector<int> without_attention = {6};
    std::vector<int> paired = {0, 2, 5, 9};             // head pairs: twice the window
    std::vector<int> long_window = {3, 10};             // the stage's long window; the others the short one
    std::vector<int> value_layers = {0, 1, 8, 9, 10};   // value table k is read by layer value_layers[k]
    int skip_from = 3, skip_to = 6;                     // layer skip_from's output joins layer skip_to's input
    int backout_layer = 7;                              // its output is subtracted after the last layer
    // record 80: an unpaired layer's value-embedding gate reads cat(x[:6], ve[:6]), not x[:12]
    bool ve_gate_reads_ve = false;
    // record 84 (upstream a333be08 L1448-1453): the paired layers' gates read it too (with ve_gate_reads_ve)
    bool paired_ve_gate_reads_ve = false;
    // record 80's residual stream (records 73-77): x = bf16(x0 + lb[0] xb) before layer 0; each sublayer
    // x = bf16(resid x + post block(norm(x)) + injection), the injection lx0[i] x0 + lb[i] xb after each
    // attention (layer 0: x0 only); the layer without attention (the skip's target) only adds the skip.
    // Off: record 71's per-layer mix before each layer.
    bool sublayer_lambdas = false;
    // record 80: the attention layers after this one read norm(its output) instead of the stream (-1: none)
    int late_attn_source = -1;
    AttnBanks attn_banks = AttnBanks::layer;
    // record 82: XSA in these layers' output gates (non-paired attention layers; record 82: 1, 3, 4, 7, 8, 10),
    // with the per-(layer, head) strengths `xsa_alphas`
    std::vector<int> xsa_layers = {};
    // record 84 (upstream a333be08) only: its `x = x0 = norm(...)` then the in-place bigram add makes x0 the stream
    // start itself, so every later read of x0 (the injections, the skip gate) sees the bigram's channels too. Upstream
    // fixed it with a clone in record 85; its stage-2 logs ran with it, so this preset reproduces it.
    bool x0_is_stream = false;
    // record 81 (upstream a333be08, init_mudd / forward_mudd): MUDD's per-token dense connections at the last layer
    // (its value mix, residual and update coefficients from the streams h0, h7 = the backout layer's output, h9 =
    // its input) and after it (the exit, in place of the backout: h0, h7, h9, value table 0, h3 = the skip's source)
    bool mudd = false;
    // record 85 (upstream 003ff3e2, init_mudd_gate / forward_mudd_gate / unpack_*_mudd_gate): the MUDD gate, two more
    // heads of MUDD's form (pre: from x0, before layer 0; post: from the input of layer mudd_gate_post_layer, at its
    // top) whose per-token columns (mudd_gate_layout) replace records 71-84's x0 and bigram lambdas, output gates,
    // XSA strengths and skip gate; output gates only on gate_layers (raw, no sigmoid), XSA per token on xsa_layers,
    // and DC-MHA (kernels/dc_mha.cuh) after the attention of dc_layer (-1: none)
    bool mudd_gate = false;
    int mudd_gate_post_layer = 4;
    std::vector<int> gate_layers = {};
    int dc_layer = -1;

    static bool holds(const std::vector<int>& v, int l) { return std::find(v.begin(), v.end(), l) != v.end(); }
    bool has_attention(int l) const { return !holds(without_attention, l); }
    int attn_layers() const { return layers - static_cast<int>(without_attention.size()); }
    int attn_index(int l) const {  // row of attn_bank / attn_gate_bank
        int i = 0;
        for (int k = 0; k < l; ++k) i += has_attention(k);
        return i;
    }
    bool is_paired(int l) const { return holds(paired, l); }
    bool is_long_window(int l) const { return holds(long_window, l); }
    bool has_xsa(int l) const { return holds(xsa_layers, l); }
    // records 71-84: every attention layer's sigmoid gate (attn_gate_bank); record 85: gate_layers' per-token one
    bool has_output_gate(int l) const { return has_attention(l) && (!mudd_gate || holds(gate_layers, l)); }
    bool is_mudd_layer(int l) const { return mudd && l == layers - 1; }  // record 81's MUDD: the last layer
    bool reads_late_source(int l) const { return late_attn_source >= 0 && l > late_attn_source; }
    int value_tables() const { return static_cast<int>(value_layers.size()); }
    int value_table(int l) const {  // -1: none
        for (int k = 0; k < value_tables(); ++k)
            if (value_layers[size_t(k)] == l) return k;
        return -1;
    }
};

// Record 85's MUDD gate columns (upstream 003ff3e2 unpack_pre_mudd_gate / unpack_post_mudd_gate): per layer, its gate
// (0: pre, the layers before mudd_gate_post_layer; 1: post, the rest) and the first column of each of its readers
// (-1: none): XSA's strengths and the output gate (a column per head), the x0 and bigram injections (layer 0's bigram
// joins the stream before the layer). Each gate holds, in order, its layers' XSA columns, their output gates, the
// (x0, bigram) pairs of its attention layers but MUDD's, and (post) the skip's column and DC-MHA's w1 then w2 (a
// column per head each). With 6 heads: upstream's pre 26 and post 41 columns.
struct GateColumns {
    int id = -1, xsa = -1, gate = -1, x0 = -1, bigram = -1;
};
struct MuddGateLayout {
    GateColumns layer[kMaxLayers];
    int n[2] = {0, 0};      // columns of each gate
    int skip = -1, dc = -1; // the post gate's skip column and DC-MHA's first (w1; w2 starts `heads` later)
};
inline MuddGateLayout mudd_gate_layout(const Structure& st, int heads) {
    MuddGateLayout g;
    for (int id = 0; id < 2; ++id) {
        auto reads = [&](int l) { return (l < st.mudd_gate_post_layer) == (id == 0); };
        int col = 0;
        for (int l = 0; l < st.layers; ++l)
            if (reads(l)) g.layer[l].id = id;
        for (int l = 0; l < st.layers; ++l)
            if (reads(l) && st.has_xsa(l)) g.layer[l].xsa = col, col += heads;
        for (int l = 0; l < st.layers; ++l)
            if (reads(l) && st.has_output_gate(l)) g.layer[l].gate = col, col += heads;
        for (int l = 0; l < st.layers; ++l)
            if (reads(l) && st.has_attention(l) && !st.is_mudd_layer(l)) g.layer[l].x0 = col, g.layer[l].bigram = col + 1, col += 2;
        if (id == 1) g.skip = col++, g.dc = col, col += 2 * heads;
        g.n[id] = col;
    }
    return g;
}

// Where each scalar lives in the `scalars` vector.
struct ScalarSlots {
    int resid, sa, bigram;      // per layer: resid lambda, sa lambda pair (2 entries), bigram lambda
    int smear, backout, skip;   // one each
    int count;
};
// Record 71's: resid lambdas, sa lambda pairs, bigram lambdas, then the three singles. Upstream pads
// with ones by (-3 * layers - 3) mod 8 on 8 GPUs (its formula predates the bigram lambdas, so the
// length is 51 for 11 layers, not a multiple of 8). The padding is never read.
constexpr ScalarSlots record71_scalar_slots(int layers) {
    return {0, layers, 3 * layers, 4 * layers, 4 * layers + 1, 4 * layers + 2,
            4 * layers + 3 + ((-3 * layers - 3) % 8 + 8) % 8};
}
// Record 80's (the resid and bigram lambdas are parameters of their own): sa lambda pairs, smear, backout,
// skip, then ones to a multiple of 8 (upstream pads by (-2 * layers - 3) mod its world size, 8).
constexpr ScalarSlots record80_scalar_slots(int layers) {
    return {-1, 0, -1, 2 * layers, 2 * layers + 1, 2 * layers + 2, 2 * layers + 3 + ((-2 * layers - 3) % 8 + 8) % 8};
}
// Record 81's (MUDD's exit replaces the backout, whose slot is gone): sa lambda pairs, smear, skip, then ones to a
// multiple of 8 (upstream: (-2 * layers - 2) mod 8, none for 11 layers).
constexpr ScalarSlots record81_scalar_slots(int layers) {
    return {-1, 0, -1, 2 * layers, -1, 2 * layers + 1, 2 * layers + 2 + ((-2 * layers - 2) % 8 + 8) % 8};
}

// The training loss kernel's numerics (evaluation is record 71's in both: upstream's eval path).
enum class SoftcapLoss {
    sigmoid,    // record 71: 23 sigmoid((l + 5) / 7.5) in fp32, dlogits rounded to bf16 then to e5m2, S_w over
                // the weights whose target is in the batch
    tanh_bf16,  // record 80's kernel: 0.5 + 0.5 tanh.approx rounded to bf16 and reused, dlogits straight to e5m2,
                // S_w over every MTP weight
};

// ---- the optimizer table: per parameter, its optimizer, hyperparameters and communication ----
// A sharded group's place (its param_table row's): where the backward finishes its gradient (a
// reduction launched during the backward starts there, reduce_final) and where the next forward
// first reads it (waiting there for its gather, await_gathered). Per layer: attn, mlp; per value
// table: value_table.
enum class At { none = -1, embed, bigram, attn, value_table, mlp, head };
enum class Optim { adam, normuon };
// A group's row: its optimizer and hyperparameters, and its whole communication schedule. `reduce`
// (runtime/sharded_comms.h) says how its gradient is reduced: after the backward (replicated: all-
// reduce; after_backward: reduce-scatter; sparse: the touched rows), or during the backward at its
// place (buckets: a NorMuon bank's whole matrices onto their owners; tables: each table's pieces;
// at_place: a reduce-scatter). A sharded group's `place` is where the backward finishes its gradient
// (the hook reduce_final there launches what reduces during the backward) and where the next forward
// first reads it (await_gathered there waits for its gather); `gather` is its gather's turn after the
// step, lowest first (each after its update). The reductions after the backward launch in the
// table's order.
struct ParamRule {
    const char* label;
    Optim optim;
    Reduce reduce;
    At place;
    int gather;
    double beta1, beta2, lr_mul, wd_mul;  // betas for Adam only
};
// The gathers' turns: about the order the next forward first reads them, embed (while tied: lm_head,
// which makes it) and the bigram table first, the banks (mlp first: its update is done first), the
// value tables (each table's pieces in turn), an untied lm_head last (at the head).
// Record 71's (upstream's param_table then).
std::vector<ParamRule> record71_param_table() {
    return {
        {"attn", Optim::normuon, Reduce::buckets, At::attn, 3, 0, 0, 1.0, 1.0},
        {"mlp", Optim::normuon, Reduce::buckets, At::mlp, 2, 0, 0, 1.0, 1.0},
        {"scalars", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 5.0, 0.0},
        {"smear_gate", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.01, 0.0},
        {"skip_gate", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.05, 0.0},
        {"attn_gate_bank", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 1.0, 1.0},
        {"ve_gate_bank", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 1.0, 1.0},
        {"x0_lambdas", Optim::adam, Reduce::replicated, At::none, 0, 0.65, 0.95, 5.0, 0.0},
        {"bigram_embed", Optim::adam, Reduce::sparse, At::bigram, 1, 0.75, 0.95, 75.0, 5.0},
        {"lm_head", Optim::adam, Reduce::at_place, At::head, 5, 0.5, 0.95, 1.0, 150.0},
        {"value_embed", Optim::adam, Reduce::tables, At::value_table, 4, 0.75, 0.95, 75.0, 5.0},
        {"embed", Optim::adam, Reduce::after_backward, At::embed, 0, 0.5, 0.95, 1.0, 150.0},
    };
}

constexpr int kMaxParamGroups = 20;
// Table t's row `label` (the later presets' tables are edits of record 71's).
std::vector<ParamRule>::iterator table_row(std::vector<ParamRule>& t, const std::string& label) {
    return std::find_if(t.begin(), t.end(), [&](const ParamRule& r) { return label == r.label; });
}
// Record 80's (upstream 2c702746): the residual stream's lambdas are rows of their own at (0.9, 0.95),
// resid_lambdas at 5x the lr, and x0_lambdas moves to them from (0.65, 0.95) x5.
std::vector<ParamRule> record80_param_table(std::vector<ParamRule> t) {
    auto lambdas = [](const char* label, double lr_mul) {
        return ParamRule{label, Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.95, lr_mul, 0.0};
    };
    auto x0 = table_row(t, "x0_lambdas");
    *x0 = lambdas("x0_lambdas", 1.0);
    t.insert(t.insert(x0 + 1, lambdas("bigram_lambdas", 1.0)) + 1, lambdas("resid_lambdas", 5.0));
    x0 = table_row(t, "x0_lambdas");
    t.insert(x0, lambdas("post_lambdas", 1.0));
    return t;
}
// Record 80's head-pair banks (AttnBanks::head_pairs): qk_bank and vo_bank take attn's row, both reduced
// in buckets at each attention layer's point and gathered in attn's turn.
std::vector<ParamRule> record80_bank_rows(std::vector<ParamRule> t) {
    const auto attn = table_row(t, "attn");
    ParamRule qk = *attn, vo = *attn;
    qk.label = "qk_bank", vo.label = "vo_bank";
    *attn = vo;
    t.insert(attn, qk);
    return t;
}
// The updates' order (the step profiler's best): small parameters first while the large reductions
// land; then what the next forward reads first as its reduction lands (lm_head makes the tied embed),
// the NorMuon banks last (mlp's last bucket lands first), their Polar Express covering the gathers.
std::vector<std::string> record71_work_order() {
    return {"scalars",      "smear_gate", "skip_gate",    "attn_gate_bank", "ve_gate_bank", "x0_lambdas",
            "lm_head",      "bigram_embed", "embed",      "value_embed",    "mlp",          "attn"};
}
// Record 80's banks take attn's turn, last: their buckets land with the backward's end.
std::vector<std::string> record80_bank_order(std::vector<std::string> o) {
    const auto attn = std::find(o.begin(), o.end(), "attn");
    *attn = "vo_bank";
    o.insert(attn, "qk_bank");
    return o;
}
// Record 80's new lambdas go with x0_lambdas, among the small parameters.
std::vector<std::string> record80_work_order(std::vector<std::string> o) {
    const auto x0 = std::find(o.begin(), o.end(), "x0_lambdas");
    o.insert(o.insert(o.insert(x0, "post_lambdas") + 2, "bigram_lambdas") + 1, "resid_lambdas");
    return o;
}

struct Config {
    std::string name;
    // model
    Structure structure;
    ScalarSlots scalar_slots = record71_scalar_slots(11);
    int vocab_size = 50257, padded_vocab = 50304;
    int model_dim = 768, num_heads = 6, head_dim = 128, mlp_dim = 3072;
    int bigram_vocab = 50304 * 5;
    // record 84 (upstream a333be08): the bigram table's width and the stream channels it reaches (192; 0: model_dim,
    // every channel, records 71-80), and record 83's sign trick: rows of the fixed +-1 sign table (8192; 0: none)
    int bigram_dim = 0, bigram_sign_rows = 0;
    // record 84: the training forward's MLP up-projection in FP8 e4m3 (upstream's quantize_mlp_fp8 and use_mlp_fp8:
    // per-layer weight scales refreshed after each optimizer step, the input's amax per forward); evaluation bf16
    bool mlp_up_fp8 = false;
    // record 87 (upstream 75d6867a, FusedLinearReLUSquareFunction): the MLP keeps post alone for its backward, which
    // takes relu(pre) as sqrt(post); pre_and_post: records 71-86
    ReluSquareSaves mlp_saves = ReluSquareSaves::pre_and_post;
    // record 88: the training loss also predicts each next token's longest proper prefix token (data/prefix_table.h),
    // weighted by the stages' prefix_start/_end, in record 80's fused cross-entropy; evaluation unchanged
    bool prefix_loss = false;
    // record 89: the training forward's MLP down-projection in FP8 e4m3 with delayed scales (upstream's
    // quantize_mlp_fp8 down half and _scaled_mm; kernels/mlp.cuh's MlpDownScales), on mlp_up_fp8's input path; the
    // weights' scale from their own amax for the quantizations after steps below mlp_down_bootstrap_steps (and at
    // the start and after the warm-up), then from the previous quantization's amax; evaluation bf16
    bool mlp_down_fp8 = false;
    int mlp_down_bootstrap_steps = 16;  // upstream: quantize_mlp_fp8(bootstrap_down=(step < 16))
    int bigram_width() const { return bigram_dim ? bigram_dim : model_dim; }
    SoftcapLoss loss = SoftcapLoss::sigmoid;
    float value_embed_std = 0.0f;   // value tables start at N(0, std^2); 0: zeros (record 71)
    // data
    std::string train_files = "data/fineweb10B/fineweb_train_*.bin", val_files = "data/fineweb10B/fineweb_val_*.bin";
    dataload::MaxDocsRule max_docs;          // cu_seqlens entries per micro-batch size (record 71: the formula)
    int64_t val_batch_tokens = 4 * 64 * 1024 * 8, val_tokens = 10485760;
    // schedule
    int scheduled_iterations = 1515, extension_iterations = 40;
    double cooldown_frac = 0.55;
    double lr_floor = 0.1;                   // the lr multiplier the cooldown ends at
    int block_size = 128;                    // window unit in tokens
    int final_ws_long = 20;                  // long window (blocks) of the final validation
    int split_embed_stage = 2;               // embed unties from lm_head at this stage's first odd step
    std::vector<TrainingStage> stages;
    // optimizer (upstream's adam_defaults, normuon_defaults and get_muon_momentum)
    double adam_lr = 0.008, adam_eps = 1e-10, adam_wd = 0.005;
    double normuon_lr = 0.023, normuon_beta2 = 0.95, normuon_wd = 1.2;
    NorMuonNumerics normuon_numerics = kNorMuonNumericsR71;  // where record 80 rounds differently (kernels/optim.cuh)
    int muon_warmup_steps = 300, muon_cooldown_steps = 50;
    std::vector<ParamRule> param_table = record71_param_table();  // one row per registered parameter
    std::vector<std::string> work_order = record71_work_order();   // the updates' order: every row once
    double muon_momentum_min = 0.85, muon_momentum_max = 0.95;
    double upstream_peak_mib = kUpstreamPeakMiB;  // upstream's logged peak allocation per GPU (--print-memory)
    // distributed: the speedrun is defined for 8 GPUs; fewer ranks accumulate micro-steps
    int world_size = 1;
    int grad_accum() const { return 8 / world_size; }
    // upstream backpropagates loss * grad_scale, grad_scale = grad_scale_sum / grad_accum
    double grad_scale_sum = 2;
    double grad_scale() const { return grad_scale_sum / grad_accum(); }
    // tokens per rank per micro-step
    int micro_tokens(int64_t batch_tokens) const { return static_cast<int>(batch_tokens / 8); }
    int max_train_tokens() const {
        int64_t m = 0;
        for (const TrainingStage& s : stages) m = std::max(m, s.batch_tokens);
        return micro_tokens(m);
    }
    int val_micro_tokens() const { return micro_tokens(val_batch_tokens); }
    TokenSpace tokens() const { return {vocab_size, padded_vocab, bigram_vocab}; }
    int max_window_tokens() const {
        int m = final_ws_long;
        for (const TrainingStage& s : stages) m = std::max(m, s.ws_long);
        return m * block_size;
    }
};

// Upstream's record 71 (2026-02-06, "Sparse bigram gradient comms"): Config's defaults are its values.
Config r71_preset() {
    Config c;
    c.name = "r71";
    c.stages = {
        {1.0 / 3, 8 * 2048 * 8, 2048, 1, 3, 1.0, {1.0f, 0.5f, 0.25f}, {1.0f, 0.5f, 0.0f}},
        {1.0 / 3, 16 * 2048 * 8, 2048, 3, 7, 1.52, {1.0f, 0.5f}, {1.0f, 0.0f}},
        {1.0 / 3, 24 * 2048 * 8, 2048, 5, 11, 1.73, {1.0f}, {1.0f}},
        {0.0, 24 * 2048 * 8, 2048, 6, 13, 1.0, {1.0f}, {1.0f}},  // extension
    };
    return c;
}

// Every feature of the record at a width a CPU trains in a minute or two: 2 heads of 64, windows in
// blocks of 8 tokens so that they bite within 32- to 64-token micro-batches. The batches are small
// enough that emu runs a training step in about 3 s on one core; the whole 34-step schedule fits in
// the committed Tiny Shakespeare shard (the BOS-aligned loader starts every micro-batch at a
// document; the shard has 399).
Config tiny_preset() {
    Config c = r71_preset();
    c.name = "tiny";
    c.train_files = "data/tinyshakespeare/tinyshakespeare_train_*.bin";
    c.val_files = "data/tinyshakespeare/tinyshakespeare_val_*.bin";
    c.model_dim = 128;
    c.num_heads = 2;
    c.head_dim = 64;
    c.mlp_dim = 512;
    c.bigram_vocab = 4096 * 5;
    for (TrainingStage& st : c.stages) st.max_seq_len = 256;
    c.val_batch_tokens = 8 * 256;
    c.val_tokens = 8 * 256;
    c.scheduled_iterations = 30;
    c.extension_iterations = 4;
    c.block_size = 8;
    c.stages[0].batch_tokens = 8 * 32;
    c.stages[1].batch_tokens = 8 * 48;
    c.stages[2].batch_tokens = c.stages[3].batch_tokens = 8 * 64;
    return c;
}

// Record 80's residual stream (records 73-77) on a config: the structure's switches, the scalars'
// layout and the optimizer table's rows for the new lambdas.
// Record 80's head-pair banks on a config: the structure's switch and the optimizer table's rows.
void use_record80_banks(Config& c) {
    c.structure.attn_banks = AttnBanks::head_pairs;
    c.param_table = record80_bank_rows(c.param_table);
    c.work_order = record80_bank_order(c.work_order);
}

// Record 82's XSA (upstream a333be08, L1125-1131) on a config: the layers, and the strengths' row, Adam at
// (0.9, 0.95), lr 1, no weight decay, replicated, updated after the gates (upstream's work order).
void use_record82_xsa(Config& c, std::vector<int> layers) {
    c.structure.xsa_layers = std::move(layers);
    const auto gates = table_row(c.param_table, "ve_gate_bank");
    c.param_table.insert(gates + 1, {"xsa_alphas", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.95, 1.0, 0.0});
    const auto turn = std::find(c.work_order.begin(), c.work_order.end(), "ve_gate_bank");
    c.work_order.insert(turn + 1, "xsa_alphas");
}

// Record 81's MUDD (upstream a333be08, init_mudd / forward_mudd) on a config with record 80's stream: the switch, the
// scalars without the backout's slot, and the three parameters' rows: Adam (0.9, 0.99) at a quarter of the lr,
// replicated, the biases without weight decay; updated with the small parameters.
void use_record81_mudd(Config& c) {
    c.structure.mudd = true;
    c.scalar_slots = record81_scalar_slots(c.structure.layers);
    const auto gates = table_row(c.param_table, "ve_gate_bank");
    c.param_table.insert(gates + 1, {{"mudd_w1", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.25, 1.0},
                                     {"mudd_w2", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.25, 1.0},
                                     {"mudd_b2", Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.25, 0.0}});
    const auto turn = std::find(c.work_order.begin(), c.work_order.end(), "ve_gate_bank");
    c.work_order.insert(turn + 1, {"mudd_b2", "mudd_w2", "mudd_w1"});
}

void use_record80_residual_stream(Config& c) {
    c.structure.sublayer_lambdas = true;
    c.structure.late_attn_source = c.structure.backout_layer;  // upstream: layers 8-10 attend to norm(x_backout)
    c.scalar_slots = record80_scalar_slots(c.structure.layers);
    c.param_table = record80_param_table(c.param_table);
    c.work_order = record80_work_order(c.work_order);
}

// Upstream's record 80 (2c702746, 84.4 s): 1440 + 40 steps, documents cut at 896 tokens in the first stage,
// the max-documents table, the LR's cooldown over the last 60% to 0.15, grad_scale 1/accum; value tables on
// layers 1, 2, 8, 9, 10 (N(0, 0.01^2)), the gate reading the value embedding, the tanh-form loss kernel, the
// residual stream of records 73-77, the head-pair banks with NorMuon's beta2 0.9 and record 80's roundings.
Config r80_preset() {
    Config c = r71_preset();
    c.name = "r80";
    c.scheduled_iterations = 1440;
    c.extension_iterations = 40;
    c.cooldown_frac = 0.60;
    c.lr_floor = 0.15;
    c.stages[0].max_seq_len = 896;
    c.max_docs.table = {{16384, 64}, {32768, 96}, {49152, 128}};  // tokens per rank per micro-step: entries
    c.grad_scale_sum = 1;
    c.structure.value_layers = {1, 2, 8, 9, 10};
    c.value_embed_std = 0.01f;
    c.structure.ve_gate_reads_ve = true;
    c.loss = SoftcapLoss::tanh_bf16;
    use_record80_residual_stream(c);
    use_record80_banks(c);
    c.normuon_beta2 = 0.9;
    c.normuon_numerics = kNorMuonNumericsR80;
    c.upstream_peak_mib = 31344;  // upstream's logs of this code (e.g. 2026-04-22_MuddFormer/baseline-s1480)
    return c;
}

// Record 80 at tiny's sizes (tests/reference/README.md, "tiny-r80"): documents cut at 7/16 of tiny's 256
// tokens in the first stage (896 of 2048), the max-documents table keyed by tiny's micro-batches with the
// record's entries stage for stage; tiny's schedule length, validation and windows.
Config tiny_r80_preset() {
    const Config t = tiny_preset();
    Config c = r80_preset();
    c.name = "tiny-r80";
    c.train_files = t.train_files, c.val_files = t.val_files;
    c.model_dim = t.model_dim, c.num_heads = t.num_heads, c.head_dim = t.head_dim, c.mlp_dim = t.mlp_dim;
    c.bigram_vocab = t.bigram_vocab;
    c.val_batch_tokens = t.val_batch_tokens, c.val_tokens = t.val_tokens;
    c.scheduled_iterations = t.scheduled_iterations, c.extension_iterations = t.extension_iterations;
    c.block_size = t.block_size;
    for (size_t i = 0; i < c.stages.size(); ++i) {
        c.stages[i].batch_tokens = t.stages[i].batch_tokens;
        c.stages[i].max_seq_len = i == 0 ? t.stages[i].max_seq_len * 896 / 2048 : t.stages[i].max_seq_len;
    }
    c.max_docs.table = {{c.micro_tokens(c.stages[0].batch_tokens), 64},
                        {c.micro_tokens(c.stages[1].batch_tokens), 96},
                        {c.micro_tokens(c.stages[2].batch_tokens), 128}};
    return c;
}

// The presets by the name --preset takes (README: "Presets"). `record` is the newest of upstream's
// records this program reproduces.
// Record 84's switches on a record-80 config (upstream a333be08's stage 2 over 2c702746's stage 1): record 81's
// MUDD, 82's XSA on every unpaired attention layer, 83's sign trick and 84's narrow bigram (a quarter of the width,
// three times the rows) with its aliased x0, the paired layers' gates reading the value embedding, the FP8 MLP
// up-projection.
void use_record84(Config& c) {
    use_record81_mudd(c);
    use_record82_xsa(c, {1, 3, 4, 7, 8, 10});
    c.bigram_vocab = c.padded_vocab * 15;
    c.bigram_dim = c.model_dim / 4;
    c.bigram_sign_rows = 8192;
    c.structure.x0_is_stream = true;
    c.structure.paired_ve_gate_reads_ve = true;
    c.mlp_up_fp8 = true;
}
// Upstream's record 84 (a333be08, 79.2 s): record 84's switches, 1380 + 10 steps.
Config r84_preset() {
    Config c = r80_preset();
    c.name = "r84";
    use_record84(c);
    c.scheduled_iterations = 1380;
    c.extension_iterations = 10;
    c.upstream_peak_mib = 30908;  // upstream's logs of this code (e.g. 2026-07-17_FP8DownProjection/baseline)
    return c;
}
// Record 84 at tiny's sizes: tiny-r80's with record 84's switches.
Config tiny_r84_preset() {
    Config c = tiny_r80_preset();
    c.name = "tiny-r84";
    use_record84(c);
    c.bigram_vocab = tiny_preset().bigram_vocab * 3;  // three times tiny's rows, as 15 of 5 vocabularies
    return c;
}

// Record 88's prefix-token loss (upstream 75d6867a; its PR logged it on a333be08 as prefix-1375-8x): pw 0.25 through
// the first stage, 0.25 -> 0 through the second, 0 after (upstream's prefix_weight_start/_end).
void use_record88(Config& c) {
    c.prefix_loss = true;
    const float weights[][2] = {{0.25f, 0.25f}, {0.25f, 0.0f}, {0.0f, 0.0f}, {0.0f, 0.0f}};
    for (size_t i = 0; i < c.stages.size() && i < std::size(weights); ++i)
        c.stages[i].prefix_start = weights[i][0], c.stages[i].prefix_end = weights[i][1];
}
// Record 88's PR on record 84 (a333be08 + the prefix-token loss, 1365 + 10 steps: the PR's prefix-1375-8x logs, the
// feature check of upstream's stage 4 on its stage 2).
Config r84_prefix_preset() {
    Config c = r84_preset();
    c.name = "r84-prefix";
    use_record88(c);
    c.scheduled_iterations = 1365;
    c.upstream_peak_mib = 30617;  // the median of its 10 logs (30373 to 30975 MiB)
    return c;
}
// tiny-r84 with record 88's prefix-token loss (the tiny schedule's lengths).
Config tiny_r84_prefix_preset() {
    Config c = tiny_r84_preset();
    c.name = "tiny-r84-prefix";
    use_record88(c);
    return c;
}

// Record 89's FP8 down-projection (upstream 75d6867a; its PR logged it on a333be08 as FP8DownProjection/this_pr).
void use_record89_fp8_down(Config& c) { c.mlp_down_fp8 = true; }
// Record 89's PR on record 84 (a333be08 + the FP8 down-projection, 1380 + 10 steps: the PR's this_pr logs, the
// feature check of upstream's stage 4 on its stage 2). Its MLP keeps pre and post, as record 84's.
Config r84_fp8down_preset() {
    Config c = r84_preset();
    c.name = "r84-fp8down";
    use_record89_fp8_down(c);
    c.upstream_peak_mib = 30220;  // the PR's logs (2026-07-17_FP8DownProjection/this_pr)
    return c;
}
// tiny-r84 with record 89's FP8 down-projection (the tiny schedule's lengths).
Config tiny_r84_fp8down_preset() {
    Config c = tiny_r84_preset();
    c.name = "tiny-r84-fp8down";
    use_record89_fp8_down(c);
    return c;
}

// Records 85 and 86 (upstream 003ff3e2's stage 3 over a333be08's stage 2): the MUDD gate in place of the x0 and
// bigram lambdas, the sigmoid output gates (now per token on layers 3 and 10 only), xsa_alphas (XSA per token on
// layers 1, 3, 4, 7 in record 86's projection form) and the skip gate; DC-MHA on layer 10; x0 no longer the stream
// start (upstream's x = x0.clone()); the bigram at full width (record 83's sign trick kept). The gate's parameters:
// Adam (0.9, 0.99) at a tenth of the lr, replicated, its biases and scale without weight decay, updated with MUDD's.
void use_record86(Config& c) {
    Structure& st = c.structure;
    st.mudd_gate = true;
    st.xsa_layers = {1, 3, 4, 7};
    st.gate_layers = {3, 10};
    st.dc_layer = 10;
    st.x0_is_stream = false;
    c.bigram_dim = 0;
    for (const char* gone : {"skip_gate", "attn_gate_bank", "xsa_alphas", "x0_lambdas", "bigram_lambdas"}) {
        c.param_table.erase(table_row(c.param_table, gone));
        c.work_order.erase(std::find(c.work_order.begin(), c.work_order.end(), gone));
    }
    auto adam = [](const char* label, double wd) {
        return ParamRule{label, Optim::adam, Reduce::replicated, At::none, 0, 0.9, 0.99, 0.1, wd};
    };
    c.param_table.insert(table_row(c.param_table, "mudd_b2") + 1,
                         {adam("mudd_gate_w1", 1.0), adam("mudd_gate_w2", 1.0), adam("mudd_gate_b2", 0.0),
                          adam("mudd_gate_scale", 0.0)});
    auto after = [&](const char* turn, std::initializer_list<std::string> labels) {
        c.work_order.insert(std::find(c.work_order.begin(), c.work_order.end(), turn) + 1, labels);
    };
    after("mudd_b2", {"mudd_gate_b2", "mudd_gate_scale"});
    after("mudd_w2", {"mudd_gate_w2"});
    after("mudd_w1", {"mudd_gate_w1"});
}
// Upstream's record 86 (003ff3e2, 75.96 s): record 86's switches on record 84, 1285 + 15 steps, the bigram table at
// 377,280 rows (7.5 vocabularies) of full width.
Config r86_preset() {
    Config c = r84_preset();
    c.name = "r86";
    use_record86(c);
    c.bigram_vocab = c.padded_vocab * 15 / 2;
    c.scheduled_iterations = 1285;
    c.extension_iterations = 15;
    c.upstream_peak_mib = 31896;  // the median of its PR's 10 logs (2026-05-27-MuddGatedAndDC/this_pr_v3: 31765-32160)
    return c;
}
// Record 86 at tiny's sizes but 6 heads of 64 (upstream's gate layout needs 6 heads; DC-MHA takes 64 or 128 dims):
// model_dim 384 and its 4x MLP; tiny's vocabulary, batches and schedule, its bigram rows times 1.5 (15/2 of 5).
Config tiny_r86_preset() {
    Config c = tiny_r84_preset();
    c.name = "tiny-r86";
    use_record86(c);
    c.num_heads = 6, c.head_dim = 64, c.model_dim = 384, c.mlp_dim = 4 * 384;
    c.bigram_vocab = tiny_preset().bigram_vocab * 3 / 2;
    return c;
}

// Upstream's record 89 (75d6867a, HEAD, 73.8 s): record 86 with record 87's post-only ReLU^2 MLP, 88's prefix-token
// loss and 89's FP8 down-projection with delayed scaling; 1270 + 15 steps. HEAD was never logged as merged: its PRs
// were logged on record 84 (the r84-prefix and r84-fp8down presets).
void use_record87_post_only(Config& c) { c.mlp_saves = ReluSquareSaves::post_only; }
// Records 87-89's switches, on a record-86 config.
void use_records87_to_89(Config& c) {
    use_record87_post_only(c);
    use_record88(c);
    use_record89_fp8_down(c);
}
Config r89_preset() {
    Config c = r86_preset();
    c.name = "r89";
    use_records87_to_89(c);
    c.scheduled_iterations = 1270;
    c.extension_iterations = 15;
    c.upstream_peak_mib = 31896;  // no log of this code: record 86's PR logs (the FP8 down PR's saved 690 MiB on r84)
    return c;
}
// tiny-r86 with records 87-89's switches (the tiny schedule's lengths).
Config tiny_r89_preset() {
    Config c = tiny_r86_preset();
    c.name = "tiny-r89";
    use_records87_to_89(c);
    return c;
}

struct Preset {
    const char* name;
    Config (*make)();
};
const Preset kPresets[] = {{"r71", r71_preset},         {"record", r89_preset},         {"tiny", tiny_preset},
                           {"r80", r80_preset},         {"tiny-r80", tiny_r80_preset}, {"r84", r84_preset},
                           {"tiny-r84", tiny_r84_preset}, {"r84-prefix", r84_prefix_preset},
                           {"tiny-r84-prefix", tiny_r84_prefix_preset}, {"r84-fp8down", r84_fp8down_preset},
                           {"tiny-r84-fp8down", tiny_r84_fp8down_preset}, {"r86", r86_preset},
                           {"tiny-r86", tiny_r86_preset}, {"r89", r89_preset}, {"tiny-r89", tiny_r89_preset}};

// The preset NAME's config (named NAME), or none.
std::optional<Config> preset_config(const std::string& name) {
    for (const Preset& p : kPresets)
        if (name == p.name) {
            Config c = p.make();
            c.name = name;
            return c;
        }
    return std::nullopt;
}
std::string preset_names() {
    std::string names;
    for (const Preset& p : kPresets) names += (names.empty() ? "" : ", ") + std::string(p.name);
    return names;
}

// Why a layer structure cannot run (empty when it can): the rules the forward and backward rely on.
std::string structure_error(const Structure& st) {
    const int n = st.layers;
    auto layer = [&](int l) { return l >= 0 && l < n; };
    auto all_layers = [&](const std::vector<int>& v) { return std::all_of(v.begin(), v.end(), layer); };
    if (n < 2 || n > kMaxLayers) return "the structure needs 2 to " + std::to_string(kMaxLayers) + " layers";
    if (!all_layers(st.without_attention) || !all_layers(st.paired) || !all_layers(st.long_window) ||
        !all_layers(st.value_layers) || !all_layers(st.xsa_layers))
        return "a layer list of the structure names a layer outside 0.." + std::to_string(n - 1);
    if (st.attn_layers() < 1) return "the structure needs a layer with attention";
    for (int l = 0; l < n; ++l)
        if (!st.has_attention(l) && (st.is_paired(l) || st.is_long_window(l) || st.value_table(l) >= 0))
            return "layer " + std::to_string(l) + " has no attention, so it cannot be paired, long-window or read a value table";
    for (const int l : st.xsa_layers)
        if (!st.has_attention(l) || st.is_paired(l))
            return "XSA layer " + std::to_string(l) + " must have attention and not be paired (upstream: v does not line up "
                   "with y in a paired layer)";
    if (st.value_tables() > kMaxValueTables) return "at most " + std::to_string(kMaxValueTables) + " value tables";
    for (int k = 0; k < st.value_tables(); ++k)
        if (st.value_table(st.value_layers[size_t(k)]) != k) return "two value tables on one layer";
    if (!(0 <= st.skip_from && st.skip_from + 1 < st.skip_to && st.skip_to < n))
        return "the skip must go from a layer's output to a later layer's input, not the next one's";
    if (!layer(st.backout_layer) || st.backout_layer + 1 >= n || st.backout_layer == st.skip_from)
        return "the backout layer must be a layer before the last, other than the skip's";
    if (st.sublayer_lambdas && (st.without_attention != std::vector<int>{st.skip_to} || !st.has_attention(0)))
        return "per-sublayer lambdas need exactly one layer without attention, the skip's target (it only adds the skip), "
               "and attention on layer 0";
    if (st.sublayer_lambdas && st.backout_layer + 1 == st.skip_to)
        return "with per-sublayer lambdas the backout layer's output cannot enter the skip's target";
    if (st.mudd) {
        const int last = n - 1;
        if (!st.sublayer_lambdas || st.late_attn_source != st.backout_layer)
            return "MUDD needs per-sublayer lambdas and the late attention source at the backout layer (h7)";
        if (!st.has_attention(last) || st.value_table(last) < 0 || st.value_tables() < 1 || st.skip_to == last ||
            st.backout_layer + 1 >= last)
            return "MUDD needs attention and a value table on the last layer, which is neither the skip's target nor "
                   "the backout layer's next";
    }
    if (st.mudd_gate) {
        if (!st.mudd || st.x0_is_stream)
            return "the MUDD gate (record 85) builds on MUDD and reads the clean x0 (no x0_is_stream)";
        if (!(0 < st.mudd_gate_post_layer && st.mudd_gate_post_layer <= st.skip_to && st.mudd_gate_post_layer < n - 1))
            return "the MUDD gate's post gate must be made at the top of a layer after 0, no later than the skip's target "
                   "(which reads it) and before the last";
        for (const int l : st.gate_layers)
            if (!layer(l) || !st.has_attention(l)) return "an output-gate layer (gate_layers) must be a layer with attention";
        if (st.dc_layer >= 0 && (st.dc_layer < st.mudd_gate_post_layer || !layer(st.dc_layer) ||
                                 !st.has_attention(st.dc_layer) || st.is_paired(st.dc_layer)))
            return "DC-MHA's layer must be an unpaired attention layer that reads the post gate";
    } else if (!st.gate_layers.empty() || st.dc_layer >= 0) {
        return "per-token output gates (gate_layers) and DC-MHA (dc_layer) read the MUDD gate (mudd_gate)";
    }
    if (st.x0_is_stream && !st.sublayer_lambdas)
        return "x0_is_stream (record 84's x0 aliasing) needs per-sublayer lambdas: record 71's stream starts as x0";
    if (st.late_attn_source >= 0) {
        if (!st.sublayer_lambdas) return "a late attention source needs per-sublayer lambdas";
        if (st.late_attn_source + 1 >= n) return "the late attention source must be a layer before the last";
        for (int l = st.late_attn_source + 1; l < n; ++l)
            if (!st.has_attention(l)) return "every layer after the late attention source must have attention";
        if (n - 1 - st.late_attn_source > NormGrads::kMax)
            return "at most " + std::to_string(NormGrads::kMax) + " layers may read the late attention source";
    }
    return "";
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
    if (c.bigram_dim < 0 || c.bigram_dim > c.model_dim || c.bigram_dim % 8 != 0)
        return bad("bigram_dim must be 0 (model_dim) or a multiple of 8 up to model_dim");
    if (c.bigram_dim > 0 && !c.structure.sublayer_lambdas)
        return bad("a narrow bigram (bigram_dim) needs per-sublayer lambdas (record 71's layer mix has no narrow form)");
    if (c.bigram_sign_rows < 0) return bad("bigram_sign_rows must be 0 (no sign trick) or positive");
    if (c.mlp_up_fp8)
        if (const std::string e = mlp_fp8_shape_error(1, c.model_dim, c.mlp_dim, {}); !e.empty())
            return bad("the FP8 MLP up-projection (mlp_up_fp8): " + e);
    if (c.mlp_down_fp8 && !c.mlp_up_fp8)
        return bad("the FP8 MLP down-projection (mlp_down_fp8, record 89) takes the FP8 up-projection's epilogue: "
                   "it needs mlp_up_fp8");
    if (c.mlp_down_fp8)
        if (const std::string e = mlp_fp8_down_shape_error(16, c.model_dim, c.mlp_dim, {}); !e.empty())
            return bad("the FP8 MLP down-projection (mlp_down_fp8): " + e);
    if (c.mlp_down_bootstrap_steps < 0) return bad("mlp_down_bootstrap_steps must be at least 0");
    if (c.world_size < 1 || 8 % c.world_size != 0) return bad("the world size must divide 8");
    if (c.stages.empty()) return bad("at least one training stage is needed");
    for (const TrainingStage& st : c.stages) {
        if (st.batch_tokens % (8 * 16) != 0 || st.mtp_start.size() != st.mtp_end.size() || st.mtp_start.empty() ||
            st.mtp_start.size() > 8)
            return bad("each stage's batch must split into 8 micro-batches of a multiple of 16 tokens, with 1 to 8 "
                       "MTP weights");
        if (st.max_seq_len < 1) return bad("each stage's max_seq_len must be at least 1 token");
        if (!c.prefix_loss && (st.prefix_start != 0.0f || st.prefix_end != 0.0f))
            return bad("a stage has prefix-loss weights but the config has no prefix_loss");
        if (c.prefix_loss && st.mtp_start.size() + 1 > size_t(kMaxMtpWeights))
            return bad("with prefix_loss a stage holds at most " + std::to_string(kMaxMtpWeights - 1) +
                       " MTP weights (the prefix weight rides after them)");
    }
    if (c.prefix_loss && c.loss != SoftcapLoss::tanh_bf16)
        return bad("the prefix-token loss (record 88) is a term of record 80's cross-entropy (loss tanh_bf16)");
    if (c.prefix_loss && c.padded_vocab > dataload::kPrefixTableRows)
        return bad("the prefix-token loss's table has " + std::to_string(dataload::kPrefixTableRows) +
                   " rows, fewer than padded_vocab " + std::to_string(c.padded_vocab));
    if (const std::string e = c.max_docs.error(); !e.empty()) return bad(e);
    if (c.val_batch_tokens % (8 * 16) != 0) return bad("the validation batch must split into 8 multiples of 16 tokens");
    if (const std::string e = structure_error(c.structure); !e.empty()) return bad(e);
    if (c.structure.mudd_gate) {
        const MuddGateLayout g = mudd_gate_layout(c.structure, c.num_heads);
        if (g.n[0] != kMuddGatePreCoef || g.n[1] != kMuddGatePostCoef)
            return bad("the MUDD gate's columns come to " + std::to_string(g.n[0]) + " (pre) and " +
                       std::to_string(g.n[1]) + " (post); its kernels take upstream's " +
                       std::to_string(kMuddGatePreCoef) + " and " + std::to_string(kMuddGatePostCoef) +
                       " (6 heads, XSA on two layers per gate, one output gate each; then DC-MHA's w1 is at "
                       "column " + std::to_string(kDcW1Col) + ", where its kernels read it)");
    }
    if (c.param_table.size() > size_t(kMaxParamGroups))
        return bad("at most " + std::to_string(kMaxParamGroups) + " optimizer table rows (kMaxParamGroups)");
    if ((c.scalar_slots.resid < 0 || c.scalar_slots.bigram < 0) != c.structure.sublayer_lambdas)
        return bad("the scalars hold resid and bigram lambdas exactly when the structure has no per-sublayer lambdas "
                   "(record80_scalar_slots goes with sublayer_lambdas)");
    return "";
}


// ============================================================================================
// Memory: one arena per kind (parameters, gradients, activations). A layout function takes
// every tensor from an arena by name; run once to measure, once more to place.
// ============================================================================================

// ---- parameters (and, with the same layout, their gradients) ----
using bf16 = __nv_bfloat16;
struct Params {
    bf16* embed = nullptr;           // (V, C), tied to lm_head^T until the split step
    bf16* lm_head = nullptr;         // (C, V): stored transposed, as upstream's CastedLinearT
    bf16* bigram_embed = nullptr;    // (bigram_vocab, Config::bigram_width())
    bf16* value_embeds = nullptr;    // (5 V, C): five tables
    bf16* attn_bank = nullptr;       // (10 * 4, C, C): per attention layer [Wq; Wk; Wv; Wo] (AttnBanks::layer; else null)
    bf16* qk_bank = nullptr;         // (pad8(10 H), 2D, C): per attention layer [Wq; Wk] (AttnBanks::head_pairs; else null)
    bf16* vo_bank = nullptr;         // (pad8(20), C, C): per attention layer [Wv; Wo] (AttnBanks::head_pairs; else null)
    bf16* mlp_bank = nullptr;        // (12, 2, mlp, C): [c_fc, c_proj] per layer, index 11 is padding
    bf16* attn_gate_bank = nullptr;  // (10, H, 12)
    bf16* ve_gate_bank = nullptr;    // (5, H, 12)
    bf16* smear_gate = nullptr;      // (12)
    bf16* skip_gate = nullptr;       // (12)
    float* x0_lambdas = nullptr;     // (11)
    float* scalars = nullptr;        // (scalar_slots.count): see ScalarSlots
    // record 80's residual stream only (Structure::sublayer_lambdas; else null)
    float* resid_lambdas = nullptr;  // (11, 2): [attention, MLP] per layer
    float* post_lambdas = nullptr;   // (11, 2)
    float* bigram_lambdas = nullptr; // (11)
    float* xsa_alphas = nullptr;     // (11, H): XSA's raw strengths (Structure::xsa_layers; else null)
    // record 81's MUDD (Structure::mudd; else null): block 0 the last layer's entry, block 1 the exit
    bf16* mudd_w1 = nullptr;         // (2, 64, C)
    bf16* mudd_w2 = nullptr;         // (2, 14, 64)
    bf16* mudd_b2 = nullptr;         // (2, 14): stored pre-scaled (the coefficients are 0.1 (... + b2))
    // record 85's MUDD gate (Structure::mudd_gate; else null; its records drop attn_gate_bank, skip_gate, x0_lambdas,
    // bigram_lambdas and xsa_alphas): block 0 the pre gate, block 1 the post gate
    bf16* mudd_gate_w1 = nullptr;    // (2, 64, C)
    bf16* mudd_gate_w2 = nullptr;    // (2, 41, 64)
    bf16* mudd_gate_b2 = nullptr;    // (2, 41): stored pre-scaled, as MUDD's
    float* mudd_gate_scale = nullptr;  // (1): the scale s (upstream's _mudd_gate_scale, used as bf16(s))

    // Layer l's [Wq; Wk] (2C, C), Wv and Wo (C, C each): one [Wq; Wk; Wv; Wo] under AttnBanks::layer
    bf16* wqk(const Config& c, int l) const {
        const int64_t i = c.structure.attn_index(l), CC = int64_t(c.model_dim) * c.model_dim;
        return c.structure.attn_banks == AttnBanks::layer ? attn_bank + i * 4 * CC : qk_bank + i * 2 * CC;
    }
    bf16* wv(const Config& c, int l) const {
        const int64_t i = c.structure.attn_index(l), CC = int64_t(c.model_dim) * c.model_dim;
        return c.structure.attn_banks == AttnBanks::layer ? wqk(c, l) + 2 * CC : vo_bank + i * 2 * CC;
    }
    bf16* wo(const Config& c, int l) const { return wv(c, l) + int64_t(c.model_dim) * c.model_dim; }
    bf16* c_fc(const Config& c, int l) const { return mlp_bank + int64_t(l) * 2 * c.mlp_dim * c.model_dim; }
    bf16* c_proj(const Config& c, int l) const { return c_fc(c, l) + int64_t(c.mlp_dim) * c.model_dim; }
    bf16* attn_gate(const Config& c, int l) const {
        return attn_gate_bank + c.structure.attn_index(l) * c.num_heads * kGateWidth;
    }
    bf16* ve_table(const Config& c, int l) const {
        const int k = c.structure.value_table(l);
        return k < 0 ? nullptr : value_embeds + int64_t(k) * c.padded_vocab * c.model_dim;
    }
    bf16* ve_gate(const Config& c, int l) const {
        const int k = c.structure.value_table(l);
        return k < 0 ? nullptr : ve_gate_bank + k * c.num_heads * kGateWidth;
    }
    float* xsa_alpha(const Config& c, int l) const {
        return c.structure.has_xsa(l) ? xsa_alphas + int64_t(l) * c.num_heads : nullptr;
    }
    // MUDD block id's first layer (64, C), and its second's rows and biases
    bf16* mudd_w1_of(const Config& c, int id) const { return mudd_w1 + int64_t(id) * kMuddHidden * c.model_dim; }
    bf16* mudd_w2_of(int id) const { return mudd_w2 + id * kMuddMaxCoef * kMuddHidden; }
    bf16* mudd_b2_of(int id) const { return mudd_b2 + id * kMuddMaxCoef; }
    bf16* mudd_gate_w1_of(const Config& c, int id) const { return mudd_gate_w1 + int64_t(id) * kMuddHidden * c.model_dim; }
    bf16* mudd_gate_w2_of(int id) const { return mudd_gate_w2 + id * kMuddGateMaxCoef * kMuddHidden; }
    bf16* mudd_gate_b2_of(int id) const { return mudd_gate_b2 + id * kMuddGateMaxCoef; }
};

// ---- the parameter registry: every parameter once, with its name (the optimizer table's label,
// the name in logs, checkpoints and --print-memory), shape and initialization. Gradients take the
// same layout in their own arena. The optimizer sees a parameter as shape[0] rows of the product of
// the other dimensions; a NorMuon parameter is shape[0] matrices of shape[1] x shape[2]. ----
enum class Init {
    zeros,
    uniform,             // U(-b, b), b = sqrt(3) / (2 sqrt(model_dim)): upstream's CastedLinear init
    uniform_c_fc,        // the MLP bank: each layer's c_fc uniform (a stream per layer), c_proj zeros
    normal,              // N(0, std^2): upstream's lm_head (0.005) and record 80's value tables (0.01)
    constant,            // every element `value` (fp32 parameters)
    lm_head_transposed,  // embed starts tied to lm_head
    scalars,             // the scalars vector's values (initial_scalars)
    uniform_fan_in,      // U(-b, b), b = 1 / sqrt(shape's last dim): torch's kaiming_uniform_(a = sqrt(5))
    mudd_bias,           // upstream's init_mudd biases (initial_mudd_bias)
    mudd_gate_bias,      // upstream's init_mudd_gate biases (initial_mudd_gate_bias)
};
struct ParamSpec {
    const char* name;
    std::vector<int64_t> shape;
    Init init;
    uint64_t seed_stream = 0;  // random inits draw from the generator stream seed * 16 + seed_stream
    float std = 0.0f;          // Init::normal's standard deviation
    float value = 0.0f;        // Init::constant's value
    int per_layer = 0;         // a NorMuon bank: its matrices per layer at its place (ParamRule::place)
    int64_t padding = 0;       // rows at the end that start zero (a bank's padding matrices; Init::uniform)
};
constexpr int64_t pad_to_8(int64_t n) { return (n + 7) / 8 * 8; }  // upstream pads banks to its 8 GPUs

// Calls visit(spec, field) for every parameter of `p` in arena order (field: a bf16* or float*
// member of Params, which the visitor may set).
template <class Visit>
void visit_params(const Config& c, Params& p, Visit&& visit) {
    const int64_t V = c.padded_vocab, C = c.model_dim, H = c.num_heads, M = c.mlp_dim;
    const Structure& st = c.structure;
    const int64_t layers = st.layers, attn_layers = st.attn_layers(), tables = st.value_tables();
    visit(ParamSpec{"embed", {V, C}, Init::lm_head_transposed}, p.embed);
    visit(ParamSpec{"lm_head", {C, V}, Init::normal, 3, 0.005f}, p.lm_head);
    visit(ParamSpec{"bigram_embed", {c.bigram_vocab, c.bigram_width()}, Init::zeros}, p.bigram_embed);
    visit(ParamSpec{"value_embed", {tables * V, C}, c.value_embed_std > 0 ? Init::normal : Init::zeros, 4, c.value_embed_std},
          p.value_embeds);
    if (st.attn_banks == AttnBanks::layer) {
        visit(ParamSpec{.name = "attn", .shape = {4 * attn_layers, C, C}, .init = Init::uniform, .seed_stream = 1,
                        .per_layer = 4},
              p.attn_bank);
    } else {  // H matrices per layer: H / 2 head pairs of Wq, then of Wk
        const int64_t qk = attn_layers * H, vo = attn_layers * 2;
        visit(ParamSpec{.name = "qk_bank", .shape = {pad_to_8(qk), 2 * c.head_dim, C}, .init = Init::uniform,
                        .seed_stream = 1, .per_layer = int(H), .padding = pad_to_8(qk) - qk},
              p.qk_bank);
        visit(ParamSpec{.name = "vo_bank", .shape = {pad_to_8(vo), C, C}, .init = Init::uniform, .seed_stream = 5,
                        .per_layer = 2, .padding = pad_to_8(vo) - vo},
              p.vo_bank);
    }
    // [c_fc, c_proj] per layer, then a padding layer (its c_fc drawn too, as upstream's)
    visit(ParamSpec{.name = "mlp", .shape = {2 * (layers + 1), M, C}, .init = Init::uniform_c_fc, .seed_stream = 2,
                    .per_layer = 2},
          p.mlp_bank);
    const bool gated = st.mudd_gate;  // record 85: the MUDD gate's columns replace these five
    if (!gated) visit(ParamSpec{"attn_gate_bank", {attn_layers, H, kGateWidth}, Init::zeros}, p.attn_gate_bank);
    visit(ParamSpec{"ve_gate_bank", {tables, H, kGateWidth}, Init::zeros}, p.ve_gate_bank);
    visit(ParamSpec{"smear_gate", {1, kGateWidth}, Init::zeros}, p.smear_gate);
    if (!gated) visit(ParamSpec{"skip_gate", {1, kGateWidth}, Init::zeros}, p.skip_gate);
    if (!st.xsa_layers.empty() && !gated) visit(ParamSpec{"xsa_alphas", {layers, H}, Init::zeros}, p.xsa_alphas);
    if (st.mudd) {
        visit(ParamSpec{"mudd_w1", {2, kMuddHidden, C}, Init::uniform_fan_in, 6}, p.mudd_w1);
        visit(ParamSpec{"mudd_w2", {2, kMuddMaxCoef, kMuddHidden}, Init::zeros}, p.mudd_w2);
        visit(ParamSpec{"mudd_b2", {2, kMuddMaxCoef}, Init::mudd_bias}, p.mudd_b2);
    }
    if (gated) {
        visit(ParamSpec{"mudd_gate_w1", {2, kMuddHidden, C}, Init::uniform_fan_in, 7}, p.mudd_gate_w1);
        visit(ParamSpec{"mudd_gate_w2", {2, kMuddGateMaxCoef, kMuddHidden}, Init::zeros}, p.mudd_gate_w2);
        visit(ParamSpec{"mudd_gate_b2", {2, kMuddGateMaxCoef}, Init::mudd_gate_bias}, p.mudd_gate_b2);
        visit(ParamSpec{"mudd_gate_scale", {1}, Init::constant, 0, 0.0f, 0.1f}, p.mudd_gate_scale);
    }
    if (st.sublayer_lambdas) {  // upstream's order
        visit(ParamSpec{"post_lambdas", {layers, 2}, Init::constant, 0, 0.0f, 1.0f}, p.post_lambdas);
        if (!gated) {
            visit(ParamSpec{"x0_lambdas", {layers}, Init::zeros}, p.x0_lambdas);
            visit(ParamSpec{"bigram_lambdas", {layers}, Init::constant, 0, 0.0f, 0.05f}, p.bigram_lambdas);
        }
        // sqrt(1.1) per sublayer: a layer scales the stream by 1.1, as record 71's one lambda did
        visit(ParamSpec{"resid_lambdas", {layers, 2}, Init::constant, 0, 0.0f, static_cast<float>(std::sqrt(1.1))},
              p.resid_lambdas);
    } else {
        visit(ParamSpec{"x0_lambdas", {layers}, Init::zeros}, p.x0_lambdas);
    }
    visit(ParamSpec{"scalars", {c.scalar_slots.count}, Init::scalars}, p.scalars);
}

// One registered parameter of a placed Params: its spec and where it lives.
struct ParamEntry {
    ParamSpec spec;
    void* data;
    bool fp32;
    int64_t elems() const {
        int64_t n = 1;
        for (int64_t d : spec.shape) n *= d;
        return n;
    }
};
std::vector<ParamEntry> param_entries(const Config& c, Params& p) {
    std::vector<ParamEntry> out;
    visit_params(c, p, [&](ParamSpec spec, auto*& field) {
        out.push_back({std::move(spec), field, std::is_same_v<std::remove_reference_t<decltype(*field)>, float>});
    });
    return out;
}

void layout_params(Arena& a, const Config& c, Params& p) {
    visit_params(c, p, [&](const ParamSpec& spec, auto*& field) {
        field = a.take<std::remove_reference_t<decltype(*field)>>(spec.name, spec.shape);
    });
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
    bf16* attn_out;    // the attention block's output projection (record 71: the shared block_out)
    bf16* xa;          // stream after the attention block
    bf16* h_mlp;       // norm(xa)
    float* rstd_mlp;
    bf16 *pre, *post;  // (T, mlp); pre null when the MLP keeps post only (Config::mlp_saves)
    bf16* mlp_out;     // the MLP's output (record 71: the shared block_out)
};

struct Acts {
    int T = 0;                  // tokens this layout holds
    bool training = true;       // eval layouts share one set of layer buffers
    bf16* smeared;              // token embedding after the smear (T, C)
    bf16* x0;                   // norm(smeared)
    float* rstd_x0;
    bf16* x0_bigram;            // bigram embedding rows
    LayerActs layer[kMaxLayers];
    bf16* x_out;                // the last layer's output
    bf16* x_final;              // after the backout (MUDD: the exit's mix)
    bf16* h_final;              // norm(x_final): the lm_head's input
    float* rstd_final;
    bf16* block_out;            // a block's output before it joins the stream (per-sublayer lambdas in training:
                                // each layer keeps its own, attn_out and mlp_out, for the post lambdas' gradients)
    bf16* logits;               // (rows, V): all of T in training, `logit_rows` per chunk in eval
    int logit_rows;
    float* lse_head;            // (T)
    float* row_losses;          // (T)
    LmHeadFp8Buffers fp8;
    // record 81's MUDD (Structure::mudd; else null): per block (0: the last layer's entry, 1: the exit) its hidden
    // pre-activations z = h w1^T (T, 64) and coefficients (T, kMuddCoefStride); the entry's aux_v and r (T, C)
    bf16* mudd_z[2];
    float* mudd_c[2];
    bf16 *aux_v, *mudd_r;
    // record 85's MUDD gate (Structure::mudd_gate; else null): per gate (0: pre, 1: post) its hidden pre-activations
    // (T, 64) and columns (T, kMuddGateCoefStride); DC-MHA's output (T, C) and (training) its local softmaxes' lse (T, H)
    bf16* gate_z[2];
    float* gate_c[2];
    bf16* dc_y;
    float* dc_lse;
    __nv_fp8_e4m3* mlp_xq;      // record 84's FP8 up-projection (training): the MLP input quantized (T, C)
    __nv_fp8_e4m3* mlp_postq;   // record 89's FP8 down-projection (training): a layer's post quantized (T, H)
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
    s.x0_bigram = a.take<bf16>(m + "x0_bigram", {T, c.bigram_width()});
    const Structure& st = c.structure;
    for (int l = 0; l < st.layers; ++l) {
        LayerActs& L = s.layer[l];
        if (!training && l > 0) {  // eval streams every layer through layer 0's buffers
            L = s.layer[0];
            continue;
        }
        const std::string n = m + "layer" + std::to_string(l) + ".";
        L = LayerActs{};
        L.xm = a.take<bf16>(n + "xm", {T, C});
        if (st.reads_late_source(l) && st.reads_late_source(l - 1)) {  // norm(late source), made once, is layer late+1's
            L.h_attn = s.layer[st.late_attn_source + 1].h_attn;
            L.rstd_attn = s.layer[st.late_attn_source + 1].rstd_attn;
        } else {
            L.h_attn = a.take<bf16>(n + "h_attn", {T, C});
            L.rstd_attn = a.take<float>(n + "rstd_attn", {T});
        }
        if (st.has_attention(l)) {
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
        L.pre = c.mlp_saves == ReluSquareSaves::pre_and_post ? a.take<bf16>(n + "pre", {T, M}) : nullptr;
        L.post = a.take<bf16>(n + "post", {T, M});
        if (training && st.sublayer_lambdas) {
            if (st.has_attention(l)) L.attn_out = a.take<bf16>(n + "attn_out", {T, C});
            L.mlp_out = a.take<bf16>(n + "mlp_out", {T, C});
        }
    }
    // Streams between layers (layer 0 reads x0): every layer's input in training; in eval one
    // buffer passed along, and the streams read again later (the skip's and the backout's; MUDD's h9).
    bf16* passed = training ? nullptr : a.take<bf16>(m + "stream", {T, C});
    for (int l = 1; l < st.layers; ++l) {
        const bool own = training || l == st.skip_from + 1 || l == st.backout_layer + 1 || (st.mudd && l == st.layers - 1);
        s.layer[l].x = own ? a.take<bf16>(m + "layer" + std::to_string(l) + ".x", {T, C}) : passed;
    }
    // record 71's layer 0 mixes x0 itself; record 80's stream starts as x0 + lb[0] x0_bigram (record 84's is written
    // over x0: x0_is_stream)
    s.layer[0].x = !st.sublayer_lambdas || st.x0_is_stream ? s.x0
                   : training || st.mudd                  ? a.take<bf16>(m + "layer0.x", {T, C})  // MUDD's h0
                                                          : passed;
    s.x_out = a.take<bf16>(m + "x_out", {T, C});
    s.x_final = a.take<bf16>(m + "x_final", {T, C});
    s.h_final = a.take<bf16>(m + "h_final", {T, C});
    s.rstd_final = a.take<float>(m + "rstd_final", {T});
    s.block_out = a.take<bf16>(m + "block_out", {T, C});
    for (int l = 0; l < st.layers; ++l) {
        LayerActs& L = s.layer[l];
        if (!L.attn_out) L.attn_out = s.block_out;
        if (!L.mlp_out) L.mlp_out = s.block_out;
    }
    s.logit_rows = training ? T : std::min<int>(T, 8192);
    s.logits = a.take<bf16>(m + "logits", {s.logit_rows, V});
    s.lse_head = a.take<float>(m + "lse_head", {T});
    s.row_losses = a.take<float>(m + "row_losses", {T});
    if (training) {
        s.fp8.x_f8 = a.take<__nv_fp8_e4m3>(m + "x_f8", {T, C});
        s.fp8.x_f8_t = a.take<__nv_fp8_e4m3>(m + "x_f8_t", {C, T});
        s.fp8.g_f8 = a.take<__nv_fp8_e5m2>(m + "g_f8", {T, V});
        s.fp8.g_f8_t = a.take<__nv_fp8_e5m2>(m + "g_f8_t", {V, T});
    } else {
        s.fp8 = {};
    }
    s.mlp_xq = training && c.mlp_up_fp8 ? a.take<__nv_fp8_e4m3>(m + "mlp_xq", {T, C}) : nullptr;
    s.mlp_postq = training && c.mlp_down_fp8 ? a.take<__nv_fp8_e4m3>(m + "mlp_postq", {T, c.mlp_dim}) : nullptr;
    s.mudd_z[0] = s.mudd_z[1] = s.aux_v = s.mudd_r = nullptr;
    s.mudd_c[0] = s.mudd_c[1] = nullptr;
    if (st.mudd) {
        for (int id = 0; id < 2; ++id) {
            s.mudd_z[id] = a.take<bf16>(m + "mudd_z" + std::to_string(id), {T, kMuddHidden});
            s.mudd_c[id] = a.take<float>(m + "mudd_c" + std::to_string(id), {T, kMuddCoefStride});
        }
        s.aux_v = a.take<bf16>(m + "aux_v", {T, C});
        s.mudd_r = a.take<bf16>(m + "mudd_r", {T, C});
    }
    s.gate_z[0] = s.gate_z[1] = s.dc_y = nullptr;
    s.gate_c[0] = s.gate_c[1] = s.dc_lse = nullptr;
    if (st.mudd_gate)
        for (int id = 0; id < 2; ++id) {
            s.gate_z[id] = a.take<bf16>(m + "gate_z" + std::to_string(id), {T, kMuddHidden});
            s.gate_c[id] = a.take<float>(m + "gate_c" + std::to_string(id), {T, kMuddGateCoefStride});
        }
    if (st.dc_layer >= 0) {
        s.dc_y = a.take<bf16>(m + "dc_y", {T, C});
        s.dc_lse = training ? a.take<float>(m + "dc_lse", {T, H}) : nullptr;
    }
}

// ---- the backward's own buffers (training layout only) ----
struct BackwardBufs {
    bf16* dX;                // gradient of the stream at the current layer boundary
    bf16* dX_skip;           // the skip's layer's output: the skip's share, then the rest
    bf16* dX_backout;        // the backout layer's output: the backout's share, then the rest
    bf16* dh;                // gradient of a norm's output (a block's input)
    bf16* gx0;               // gradient of x0, summed over layers
    bf16* gxb;               // gradient of x0_bigram, summed over layers
    bf16* d_smeared;
    bf16* d_embed_rows;      // gradient of the gathered embedding rows
    bf16* dve[kMaxValueTables]; // gradient of each layer's value-embedding rows
    bf16* dqkv;              // (T, 3C)
    bf16 *dq, *dk, *dv, *dy; // (T, H, D)
    bf16* dv_xsa;            // XSA's share of v's gradient (T, H, D): with Structure::xsa_layers only
    float *dz_attn, *dz_ve;  // gate logit gradients (T, H)
    bf16* dw_eff;            // gradients of a layer's lambda-scaled weights: wqkv's (3C, C), then wo's (C, C)
    // per-sublayer lambdas only:
    bf16* dblock;            // gradient of a block's output (the update scales it by its post lambda)
    bf16* dh_late[NormGrads::kMax - 1];  // the attention inputs' gradients of the layers after the late
                                         // source's first reader, kept until the source's own update
    // record 81's MUDD only: the gradients of h0 (the stream start: MUDD's shares, then layer 0's), of h9 (the last
    // layer's input), of r and of the exit's value rows; the heads' dz (T, 64) and the coefficients' (T, 16)
    bf16 *dX_h0, *dX_h9, *dr, *dve_exit, *mudd_dz;
    float* mudd_dc;
    // record 85's MUDD gate only: each gate's column gradients (T, kMuddGateCoefStride), written by their readers; the
    // gates' dz share mudd_dz
    float* gate_dc[2];
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
    w.gxb = a.take<bf16>("bw.gxb", {T, c.bigram_width()});
    w.d_smeared = a.take<bf16>("bw.d_smeared", {T, C});
    w.d_embed_rows = a.take<bf16>("bw.d_embed_rows", {T, C});
    for (int k = 0; k < c.structure.value_tables(); ++k) w.dve[k] = a.take<bf16>("bw.dve" + std::to_string(k), {T, C});
    w.dqkv = a.take<bf16>("bw.dqkv", {T, 3 * C});
    w.dq = a.take<bf16>("bw.dq", {T, C});
    w.dk = a.take<bf16>("bw.dk", {T, C});
    w.dv = a.take<bf16>("bw.dv", {T, C});
    w.dy = a.take<bf16>("bw.dy", {T, C});
    w.dv_xsa = c.structure.xsa_layers.empty() ? nullptr : a.take<bf16>("bw.dv_xsa", {T, C});
    w.dz_attn = a.take<float>("bw.dz_attn", {T, H});
    w.dz_ve = a.take<float>("bw.dz_ve", {T, H});
    w.dw_eff = a.take<bf16>("bw.dw_eff", {4 * C, C});
    const Structure& st = c.structure;
    w.dblock = st.sublayer_lambdas ? a.take<bf16>("bw.dblock", {T, C}) : nullptr;
    for (int j = 0; j < NormGrads::kMax - 1; ++j) {
        const int l = st.late_attn_source + 2 + j;  // a later reader of the late source
        w.dh_late[j] = st.late_attn_source >= 0 && l < st.layers ? a.take<bf16>("bw.dh_late" + std::to_string(j), {T, C}) : nullptr;
    }
    w.dX_h0 = w.dX_h9 = w.dr = w.dve_exit = w.mudd_dz = nullptr;
    w.mudd_dc = nullptr;
    if (st.mudd) {
        w.dX_h0 = a.take<bf16>("bw.dX_h0", {T, C});
        w.dX_h9 = a.take<bf16>("bw.dX_h9", {T, C});
        w.dr = a.take<bf16>("bw.dr", {T, C});
        w.dve_exit = a.take<bf16>("bw.dve_exit", {T, C});
        w.mudd_dz = a.take<bf16>("bw.mudd_dz", {T, kMuddHidden});
        w.mudd_dc = a.take<float>("bw.mudd_dc", {T, kMuddCoefStride});
    }
    for (int id = 0; id < 2; ++id)
        w.gate_dc[id] = st.mudd_gate ? a.take<float>("bw.gate_dc" + std::to_string(id), {T, kMuddGateCoefStride}) : nullptr;
    w.scratch_bytes = std::max({residual_backward_scratch_bytes(T), lambda_scaled_weight_backward_scratch_bytes({3 * C * C, C * C}),
                                st.mudd ? mudd_backward_scratch_bytes(T) : 0,
                                st.mudd_gate ? mudd_gate_backward_scratch_bytes(T) : 0,
                                st.dc_layer >= 0 ? dc_mha_backward_workspace_bytes(T) : 0,
                                lambda_scaled_weight_backward_scratch_bytes({2 * C * C, C * C, C * C}),
                                attn_gates_backward_scratch_bytes(T, c.num_heads), embed_smear_backward_scratch_bytes(T),
                                st.xsa_layers.empty() ? 0 : attn_output_gate_backward_scratch_bytes(T, c.num_heads, c.head_dim),
                                embedding_backward_scratch_bytes(T, c.model_dim, 1 + c.structure.value_tables()),
                                attention_backward_workspace_bytes(T, c.num_heads, c.head_dim)});
    w.scratch = static_cast<float*>(a.take_bytes("bw.scratch", w.scratch_bytes));
}

// The backward's points where per-layer gradients become final, in its order: per layer from the
// last, the MLP's (after mlp_backward), then the attention's (after the lambda-scaled weights' backward).
constexpr int backward_point(At place, int layer, int layers) { return 2 * (layers - 1 - layer) + (place == At::attn ? 1 : 0); }
inline void await_gathered(const GatherEvents& e, At place, cudaStream_t s, int piece = 0) {
    await_gathered(e, static_cast<int>(place), s, piece);
}

// What the schedule decides for one forward.
struct StepSchedule {
    int ws_short = 0, ws_long = 0;   // windows in tokens
    const float* mtp_weights;        // device, n_predict weights
    int n_predict = 1;
    CePrefix prefix;                 // record 88's table and weight (the device float after the MTP weights), or none
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
    float* untie_scratch;         // (C, V) over the dead activations: lm_head's moments gathered at the untie step
    // remade after each change of lm_head (refresh_lm_head_copies): its FP8 copies; embed while tied
    bool lm_head_fp8_stale = true, embed_stale = false;
    // record 84's FP8 up-projection (Config::mlp_up_fp8): every MLP layer's e4m3 c_fc and its scale (the padding
    // layer's too, as upstream), remade before the training forward after c_fc changed (mlp_fp8_stale); the input
    // quantization's scales and scratch (its counters, like sums_done, outside the shared activations)
    Fp8UpWeights mlp_fp8{};
    BlockPartials mlp_fp8_weight_scratch{}, mlp_fp8_input_scratch{};
    Fp8UpScales* mlp_fp8_scales = nullptr;
    bool mlp_fp8_stale = true;
    // record 89's FP8 down-projection (Config::mlp_down_fp8): every MLP layer's e4m3 W2^T (the padding layer's too)
    // and its scales (act: this rank's, from the last training forward's amax; used; next), remade with the up
    // copies (mlp_fp8_stale) by mlp_fp8_down_scaling; the weights' amax scratch and each layer's activation partials
    Fp8DownWeights mlp_fp8_down{};
    BlockPartials mlp_fp8_down_weight_scratch{};
    float* mlp_fp8_down_act_partials = nullptr;
    MlpDownScaling mlp_fp8_down_scaling = MlpDownScaling::bootstrap;
    DeviceBatch batch, eval_batch;
    YarnRope rope;
    LmHeadFp8Scales* fp8_scales;  // device
    float* loss;                  // device: the last forward's loss (training: the sum over rows)
    float* dloss;                 // device: d(objective)/d(loss) = grad_scale
    unsigned int* sums_done;      // device: the backward's reductions' ticket counter (zero between launches)
    GradBuckets buckets;          // the reductions the backward starts (set by build_optimizer)
    GatherEvents gathered;        // what the forward waits for (made by build_optimizer)
    float* mtp_weights;           // device, up to kMaxMtpWeights: the step's MTP weights, then record 88's prefix weight
    int* prefix_table;            // record 88's (kPrefixTableRows) prefix tokens from data/gpt2_prefix_table.bin, or null
    bf16* bigram_signs;           // record 83's (bigram_sign_rows, bigram width) +-1 table, or null; from the seed
    std::unique_ptr<CublasLt> lt; // made by build_model (a memory plan needs no device)
    MlpKernel mlp_kernel = MlpKernel::mma;  // the MLP's c_fc GEMMs: build_model's default, or --mlp-kernel
    AttentionKernel attention = default_attention_kernel();  // the attention kernels, or --attention
};

// Every arena's layout; `m` may be unallocated (measuring) or allocated (placing).
void layout_state(Arena& a, Model& m) {
    const Config& c = m.cfg;
    const int positions = 2 * std::max(c.max_train_tokens(), c.val_micro_tokens());
    m.rope = yarn_rope_view(nullptr, c.head_dim, positions);  // placed below
    void* rope_mem = a.take_bytes("yarn_rope", yarn_rope_bytes(c.head_dim, positions));
    if (rope_mem) m.rope = yarn_rope_view(rope_mem, c.head_dim, positions);
    m.fp8_scales = reinterpret_cast<LmHeadFp8Scales*>(a.take<float>("fp8_scales", {sizeof(LmHeadFp8Scales) / sizeof(float)}));
    m.loss = a.take<float>("loss", {1});
    m.dloss = a.take<float>("dloss", {1});
    m.sums_done = reinterpret_cast<unsigned int*>(a.take<int32_t>("sums_done", {1}));  // zeroed by the arena
    m.mtp_weights = a.take<float>("mtp_weights", {kMaxMtpWeights});
    m.prefix_table = c.prefix_loss ? a.take<int32_t>("prefix_table", {dataload::kPrefixTableRows}) : nullptr;
    m.bigram_signs = c.bigram_sign_rows ? a.take<bf16>("bigram_signs", {c.bigram_sign_rows, c.bigram_width()}) : nullptr;
    m.mlp_fp8 = {};
    m.mlp_fp8_weight_scratch = m.mlp_fp8_input_scratch = {};
    m.mlp_fp8_scales = nullptr;
    if (c.mlp_up_fp8) {
        const int layers = c.structure.layers + 1, C = c.model_dim, M = c.mlp_dim;
        m.mlp_fp8.w = a.take<__nv_fp8_e4m3>("mlp_fp8.w", {layers, M, C});
        m.mlp_fp8.scale = a.take<float>("mlp_fp8.scale", {layers});
        m.mlp_fp8_weight_scratch = {a.take<float>("mlp_fp8.weight_partials", {int64_t(mlp_fp8_weight_scratch_floats(layers, M, C))}),
                                    reinterpret_cast<unsigned int*>(a.take<int32_t>("mlp_fp8.weight_done", {1}))};
        const int T = c.max_train_tokens();
        m.mlp_fp8_input_scratch = {a.take<float>("mlp_fp8.input_partials", {int64_t(mlp_fp8_input_scratch_floats(T, C))}),
                                   reinterpret_cast<unsigned int*>(a.take<int32_t>("mlp_fp8.input_done", {1}))};
        m.mlp_fp8_scales = reinterpret_cast<Fp8UpScales*>(a.take<float>("mlp_fp8.scales", {4}));
    }
    m.mlp_fp8_down = {};
    m.mlp_fp8_down_weight_scratch = {};
    m.mlp_fp8_down_act_partials = nullptr;
    if (c.mlp_down_fp8) {
        const int layers = c.structure.layers + 1, C = c.model_dim, M = c.mlp_dim, T = c.max_train_tokens();
        m.mlp_fp8_down.w = a.take<__nv_fp8_e4m3>("mlp_fp8_down.w", {layers, C, M});
        m.mlp_fp8_down.scales =
            reinterpret_cast<MlpDownScales*>(a.take<float>("mlp_fp8_down.scales", {layers, kMlpDownScaleStride}));
        m.mlp_fp8_down_weight_scratch = {
            a.take<float>("mlp_fp8_down.weight_partials", {int64_t(mlp_fp8_down_weight_scratch_floats(layers, M, C))}),
            reinterpret_cast<unsigned int*>(a.take<int32_t>("mlp_fp8_down.weight_done", {1}))};
        // either kernel's tiles (--mlp-kernel picks one after the layout)
        const int64_t partials = std::max(mlp_fp8_down_act_partials(MlpKernel::mma, T, M),
                                          mlp_fp8_down_act_partials(MlpKernel::wgmma, T, M));
        m.mlp_fp8_down_act_partials = a.take<float>("mlp_fp8_down.act_partials", {c.structure.layers * partials});
    }
}
void layout_activations(Arena& a, Model& m) {
    const Config& c = m.cfg;
    const int T = c.max_train_tokens(), Tv = c.val_micro_tokens();
    layout_batch(a, std::max(T, Tv), c.max_docs, m.batch);
    m.eval_batch = m.batch;
    // the FP8 lm_head weight outlives a step (made once per change of lm_head): not shared
    auto* w_f8 = a.take<__nv_fp8_e4m3>("lm_head.w_f8", {c.model_dim, c.padded_vocab});
    auto* w_f8_t = a.take<__nv_fp8_e4m3>("lm_head.w_f8_t", {c.padded_vocab, c.model_dim});
    // training and evaluation never hold their activations at the same time: they share the rest
    const size_t shared = a.mark();
    layout_acts(a, c, T, true, m.train);
    m.train.fp8.w_f8 = w_f8;
    m.train.fp8.w_f8_t = w_f8_t;
    layout_backward(a, c, T, m.bw);
    const size_t training_end = a.mark();
    a.rewind_to(shared, training_end);
    layout_acts(a, c, Tv, false, m.eval);
    const size_t high = std::max(training_end, a.mark());
    // the untie step gathers there between a backward and the next forward
    a.rewind_to(shared, high);
    m.untie_scratch = a.take<float>("untie_scratch", {c.model_dim, c.padded_vocab});
    a.rewind_to(shared, std::max(high, a.mark()));
}

// ---- initialization, as upstream's GPT.__init__ (values from runtime/init_random.h's counter-based
// generator, so the same seed gives the same parameters on any GPU and in the CPU build) ----
constexpr uint64_t kBigramSignStream = 15;  // the sign table's generator stream (ParamSpec::seed_stream's space)

// The scalars vector as upstream starts it; the tail is padding: ones, as upstream.
std::vector<float> initial_scalars(const Config& c) {
    const ScalarSlots& k = c.scalar_slots;
    std::vector<float> scalars(size_t(k.count), 1.0f);
    for (int l = 0; l < c.structure.layers; ++l) {
        if (k.resid >= 0) scalars[size_t(k.resid + l)] = 1.1f;
        scalars[size_t(k.sa + 2 * l)] = 0.5f;
        scalars[size_t(k.sa + 2 * l + 1)] = 1.0f;
        if (k.bigram >= 0) scalars[size_t(k.bigram + l)] = 0.1f;
    }
    scalars[size_t(k.smear)] = 0.0f;
    if (k.backout >= 0) scalars[size_t(k.backout)] = 0.5f;
    scalars[size_t(k.skip)] = -1.5f;
    return scalars;
}

// MUDD's second-layer biases as upstream's init_mudd stores them (pre-scaled by 1 / 0.1, rounded to bf16): the entry's
// value-embedding gates at 2, its update coefficients at the per-layer lambdas' starts (resid sqrt(1.1), post 1,
// x0 0, bigram 0.05), and the exit's h7 coefficient at -0.5, the backout it replaces.
std::vector<bf16> initial_mudd_bias() {
    std::vector<float> b(2 * kMuddMaxCoef, 0.0f);
    const float unscale = 1.0f / kMuddScale, resid = static_cast<float>(std::sqrt(1.1)) * unscale;
    b[6] = b[7] = 2.0f * unscale;
    b[8] = b[12] = resid;
    b[9] = b[13] = 1.0f * unscale;
    b[11] = 0.05f * unscale;
    b[kMuddMaxCoef + 1] = -0.5f * unscale;
    std::vector<bf16> out(b.size());
    for (size_t i = 0; i < b.size(); ++i) out[i] = __float2bfloat16(b[i]);
    return out;
}

// The MUDD gate's second-layer biases as upstream's init_mudd_gate stores them (pre-scaled by 1 / 0.1, rounded to
// bf16): the output gates' columns at 2.5 (0.25 at the initial scale), the bigram injections' at 0.5, the skip's at 5
// and DC-MHA's w1 at 10 (w1 starts at 1 after its rms normalisation, w2 at 0: DC starts as a no-op); the rest 0.
std::vector<bf16> initial_mudd_gate_bias(const Config& c) {
    const MuddGateLayout g = mudd_gate_layout(c.structure, c.num_heads);
    std::vector<bf16> b(2 * kMuddGateMaxCoef, __float2bfloat16(0.0f));
    auto fill = [&](int id, int col, int count, double effective) {
        for (int j = 0; j < count; ++j) b[size_t(id * kMuddGateMaxCoef + col + j)] = __float2bfloat16(float(effective / 0.1));
    };
    for (int l = 0; l < c.structure.layers; ++l) {
        const GateColumns& k = g.layer[l];
        if (k.gate >= 0) fill(k.id, k.gate, c.num_heads, 0.25);
        if (k.bigram >= 0) fill(k.id, k.bigram, 1, 0.05);
    }
    fill(1, g.skip, 1, 0.5);
    fill(1, g.dc, c.num_heads, 1.0);
    return b;
}

// Every parameter by its registry rule (the arena starts zeroed; zeros are written again so that
// a re-init is complete). embed follows lm_head, so tied copies come last.
void init_params(Model& m, uint64_t seed, cudaStream_t s) {
    const Config& c = m.cfg;
    const float bound = std::sqrt(3.0f) * 0.5f / std::sqrt(static_cast<float>(c.model_dim));
    const std::vector<ParamEntry> params = param_entries(c, m.params);
    for (const ParamEntry& e : params) {
        bf16* p = static_cast<bf16*>(e.data);
        const int64_t n = e.elems();
        const uint64_t key = seed * 16 + e.spec.seed_stream;
        switch (e.spec.init) {
        case Init::zeros: CUDA_CHECK(memset_async(e.data, 0, size_t(n) * (e.fp32 ? 4 : 2), s)); break;
        case Init::uniform: {
            const int64_t drawn = n - e.spec.padding * (n / e.spec.shape[0]);
            init_uniform(p, drawn, key, bound, s);
            if (drawn < n) CUDA_CHECK(memset_async(p + drawn, 0, size_t(n - drawn) * 2, s));
            break;
        }
        case Init::uniform_c_fc: {
            const int64_t half = n / e.spec.shape[0] * 2, fc_n = half / 2;  // one layer's [c_fc, c_proj]
            CUDA_CHECK(memset_async(e.data, 0, size_t(n) * 2, s));
            for (int64_t l = 0; l < e.spec.shape[0] / 2; ++l) init_uniform(p + l * half, fc_n, key + l * 1000003, bound, s);
            break;
        }
        case Init::normal: init_normal(p, n, key, e.spec.std, s); break;
        case Init::constant: {
            if (!e.fp32) {
                std::fprintf(stderr, "init_params: %s: a constant init is for fp32 parameters\n", e.spec.name);
                std::exit(EXIT_FAILURE);
            }
            const std::vector<float> v(size_t(n), e.spec.value);
            CUDA_CHECK(copy_async(e.data, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, s));
            CUDA_CHECK(sync_stream(s, "init_constant"));  // v is a local
            break;
        }
        case Init::scalars: {
            const std::vector<float> v = initial_scalars(c);
            CUDA_CHECK(copy_async(e.data, v.data(), v.size() * sizeof(float), cudaMemcpyHostToDevice, s));
            CUDA_CHECK(sync_stream(s, "init_scalars"));  // v is a local
            break;
        }
        case Init::uniform_fan_in:
            init_uniform(p, n, key, 1.0f / std::sqrt(static_cast<float>(e.spec.shape.back())), s);
            break;
        case Init::mudd_bias: {
            const std::vector<bf16> v = initial_mudd_bias();
            CUDA_CHECK(copy_async(e.data, v.data(), v.size() * sizeof(bf16), cudaMemcpyHostToDevice, s));
            CUDA_CHECK(sync_stream(s, "init_mudd_bias"));  // v is a local
            break;
        }
        case Init::mudd_gate_bias: {
            const std::vector<bf16> v = initial_mudd_gate_bias(c);
            CUDA_CHECK(copy_async(e.data, v.data(), v.size() * sizeof(bf16), cudaMemcpyHostToDevice, s));
            CUDA_CHECK(sync_stream(s, "init_mudd_gate_bias"));  // v is a local
            break;
        }
        case Init::lm_head_transposed: break;
        }
    }
    CUDA_CHECK_LAUNCH();
    for (const ParamEntry& e : params)
        if (e.spec.init == Init::lm_head_transposed)
            transpose(static_cast<bf16*>(e.data), m.params.lm_head, c.model_dim, c.padded_vocab, c.padded_vocab,
                      c.model_dim, /*add=*/false, s);
    CUDA_CHECK(sync_stream(s, "init_params"));
}

// Record 89's FP8 down-projection scales back to upstream's persistent buffers of ones, the next quantization a
// bootstrap (at the start, and after the warm-up's reset).
void reset_mlp_down_scales(Model& m, cudaStream_t s) {
    if (!m.cfg.mlp_down_fp8) return;
    const std::vector<MlpDownScales> ones(size_t(m.cfg.structure.layers + 1));
    CUDA_CHECK(copy_async(m.mlp_fp8_down.scales, ones.data(), ones.size() * sizeof(MlpDownScales),
                          cudaMemcpyHostToDevice, s));
    CUDA_CHECK(sync_stream(s, "reset_mlp_down_scales"));  // ones is a local
    m.mlp_fp8_down_scaling = MlpDownScaling::bootstrap;
}
// The scaling of the down-projection's quantization after step `step`'s update (upstream: bootstrap_down =
// step < 16; before the first step, -1, a bootstrap as at init).
MlpDownScaling mlp_down_scaling_after(const Config& c, int step) {
    return step < c.mlp_down_bootstrap_steps ? MlpDownScaling::bootstrap : MlpDownScaling::delayed;
}

// Whose parameters a rank starts from: its own draw from the seed, or rank 0's, which broadcast_params sends next (the
// draw left out: every byte of the parameter arena and the sign table arrives with the broadcast, as upstream's ranks
// take rank 0's; under emu, 8 ranks drawing record 86's tables cost a quarter of a one-step run).
enum class ParamsFrom { seed, rank0 };

// Builds the model for a config on the current device: arenas placed, parameters initialized (or left for rank 0's),
// the YaRN state reset.
void build_model(Model& m, const Config& c, uint64_t seed, cudaStream_t s, ParamsFrom from = ParamsFrom::seed) {
    if (const std::string e = config_error(c); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    m.cfg = c;
    m.lt = std::make_unique<CublasLt>();
    m.mlp_kernel = default_mlp_kernel();
    place(m.param_arena, [&](Arena& a) { layout_params(a, c, m.params); });
    place(m.grad_arena, [&](Arena& a) { layout_params(a, c, m.grads); });
    place(m.state_arena, [&](Arena& a) { layout_state(a, m); });
    place(m.act_arena, [&](Arena& a) { layout_activations(a, m); });
    if (from == ParamsFrom::seed) init_params(m, seed, s);
    // upstream draws it unseeded on rank 0 and broadcasts it; here rank 0 draws it from the run's seed (a resume
    // checks the seed, so it is the same table) and broadcast_params sends it
    if (m.bigram_signs && from == ParamsFrom::seed)
        init_signs(m.bigram_signs, int64_t(c.bigram_sign_rows) * c.bigram_width(), seed * 16 + kBigramSignStream, s);
    if (m.prefix_table) {  // data, not state: every rank reads the same checked file (upstream builds it at start-up)
        const std::string path = repo_dir() + "/data/gpt2_prefix_table.bin";
        std::vector<int32_t> table;
        try {
            table = dataload::read_prefix_table(path);
        } catch (const std::exception& e) {
            std::fprintf(stderr, "train_gpt: preset %s's prefix-token loss: %s\n", c.name.c_str(), e.what());
            std::exit(EXIT_FAILURE);
        }
        CUDA_CHECK(copy_async(m.prefix_table, table.data(), table.size() * sizeof(int32_t), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(sync_stream(s, "prefix_table"));  // table is a local
    }
    reset_mlp_down_scales(m, s);
    yarn_rope_reset(m.rope, s);
    const LmHeadFp8Scales scales = lm_head_fp8_scales(c.grad_scale());
    CUDA_CHECK(copy_async(m.fp8_scales, &scales, sizeof scales, cudaMemcpyHostToDevice, s));
    const float grad_scale = static_cast<float>(c.grad_scale());
    CUDA_CHECK(copy_async(m.dloss, &grad_scale, sizeof grad_scale, cudaMemcpyHostToDevice, s));
    CUDA_CHECK(sync_stream(s, "build_model"));
}

// Record 83's sign table as the checkpoint holds it (rank 0's file) and the broadcast sends it.
CheckpointTensor sign_table_tensor(const Model& m) {
    const Config& c = m.cfg;
    return {"buffer.bigram_signs", "BF16", {c.bigram_sign_rows, c.bigram_width()}, m.bigram_signs,
            size_t(c.bigram_sign_rows) * c.bigram_width() * sizeof(bf16)};
}

// Record 89's FP8 down-projection scales as a checkpoint holds them: (layers + 1, kMlpDownScaleStride) floats, each
// layer's act, used and next at 0, 4 and 8 (MlpDownScales), in every rank's file.
CheckpointTensor mlp_down_scales_tensor(const Model& m) {
    const int layers = m.cfg.structure.layers + 1;
    return {"buffer.mlp_down_scales", "F32", {layers, kMlpDownScaleStride}, m.mlp_fp8_down.scales,
            size_t(layers) * sizeof(MlpDownScales)};
}

// Every rank starts from rank 0's parameters, as upstream broadcasts them after init (the other ranks' build_model
// leaves them to it; a rank that drew its own from the same seed has the same bits).
void broadcast_params(Model& m, ncclComm_t comm, cudaStream_t s) {
    NCCL_CHECK(broadcast(m.param_arena.base(), m.param_arena.base(), m.param_arena.bytes(), ncclUint8, 0, comm, s));
    if (m.bigram_signs) {
        const CheckpointTensor signs = sign_table_tensor(m);
        NCCL_CHECK(broadcast(m.bigram_signs, m.bigram_signs, signs.bytes, ncclUint8, 0, comm, s));
    }
}
// Record 83's sign trick as the bigram kernels read it (none without a table).
BigramSigns bigram_signs(const Model& m, const DeviceBatch& b) {
    return m.bigram_signs ? BigramSigns{m.bigram_signs, b.inputs, m.cfg.bigram_sign_rows} : BigramSigns{};
}

// ============================================================================================
// Forward: upstream's GPT.forward, one kernel call per step.
// ============================================================================================
MixLambdas mix_lambdas(const Config& c, const Params& p, int l) {
    return {p.scalars + c.scalar_slots.resid + l, p.x0_lambdas + l, p.scalars + c.scalar_slots.bigram + l};
}
// Record 80's: layer l's attention (sublayer 0) or MLP (1) update, and where their gradients go (x0 and bigram only
// where the parameters hold them: record 85's MUDD gate replaces them, attention_update_lambdas).
SublayerLambdas sublayer_lambdas(const Params& p, int l, int sublayer) {
    return {p.resid_lambdas + 2 * l + sublayer, p.post_lambdas + 2 * l + sublayer, p.x0_lambdas ? p.x0_lambdas + l : nullptr,
            p.bigram_lambdas ? p.bigram_lambdas + l : nullptr};
}
SublayerLambdaGrads sublayer_lambda_grads(const Params& g, int l, int sublayer) {
    return {g.resid_lambdas + 2 * l + sublayer, g.post_lambdas + 2 * l + sublayer, g.x0_lambdas ? g.x0_lambdas + l : nullptr,
            g.bigram_lambdas ? g.bigram_lambdas + l : nullptr};
}
// Record 85's MUDD gate: its column layout for this config.
MuddGateLayout gate_layout(const Model& m) { return mudd_gate_layout(m.cfg.structure, m.cfg.num_heads); }
// Layer l's attention update (sublayer 0): record 85's x0 and bigram injections are per token, the gate's columns.
SublayerLambdas attention_update_lambdas(const Model& m, const Acts& a, int l) {
    SublayerLambdas lambdas = sublayer_lambdas(m.params, l, 0);
    if (!m.cfg.structure.mudd_gate) return lambdas;
    const GateColumns k = gate_layout(m).layer[l];
    lambdas.x0 = a.gate_c[k.id] + k.x0, lambdas.bigram = a.gate_c[k.id] + k.bigram;
    lambdas.injection_stride = kMuddGateCoefStride;
    return lambdas;
}
SublayerLambdaGrads attention_update_lambda_grads(const Model& m, int l) {
    SublayerLambdaGrads grads = sublayer_lambda_grads(m.grads, l, 0);
    if (!m.cfg.structure.mudd_gate) return grads;
    const GateColumns k = gate_layout(m).layer[l];
    grads.x0 = m.bw.gate_dc[k.id] + k.x0, grads.bigram = m.bw.gate_dc[k.id] + k.bigram;
    return grads;
}
// The gate's head: block id's rows of w2 and b2, its n columns.
MuddHead mudd_gate_head(const Params& p, int id) {
    return {p.mudd_gate_w2_of(id), p.mudd_gate_b2_of(id), id == 0 ? kMuddGatePreCoef : kMuddGatePostCoef};
}
// Gate id's columns from its input h (pre: x0; post: the post layer's input): z = h Wg1[id]^T, then its head.
void mudd_gate_block_forward(Model& m, Acts& a, int id, const bf16* h, int T, cudaStream_t s) {
    const Params& p = m.params;
    matmul_forward(*m.lt, a.gate_z[id], h, p.mudd_gate_w1_of(m.cfg, id), T, kMuddHidden, m.cfg.model_dim, s, false,
                   id == 0 ? "gemm_mudd_gate_pre" : "gemm_mudd_gate_post");
    mudd_gate_forward(a.gate_c[id], a.gate_z[id], mudd_gate_head(p, id), p.mudd_gate_scale, T, s);
}
// What an attention update adds besides its block: x0 (and, after layer 0, the bigram rows: layer 0's
// entered before it).
Injection attention_injection(int l) { return l == 0 ? Injection::x0 : Injection::x0_and_bigram; }
int layer_window(const Config& c, const StepSchedule& step_sch, int l) {
    return c.structure.is_long_window(l) ? step_sch.ws_long : step_sch.ws_short;
}

// MUDD's per-token lambdas for a sublayer update: coefficients [first, first + 4) of each token's row (the last
// layer's attention update: 8..11, resid of r, post, h0, bigram; its MLP update: 12, 13).
SublayerLambdas mudd_lambdas(const float* c, int first, bool injected) {
    return {c + first, c + first + 1, injected ? c + first + 2 : nullptr, injected ? c + first + 3 : nullptr,
            kMuddCoefStride};
}
SublayerLambdaGrads mudd_lambda_grads(float* dc, int first, bool injected) {
    return {dc + first, dc + first + 1, injected ? dc + first + 2 : nullptr, injected ? dc + first + 3 : nullptr};
}
MuddHead mudd_head(const Params& p, int id) {
    return {p.mudd_w2_of(id), p.mudd_b2_of(id), id == 0 ? kMuddEntryCoef : kMuddExitCoef};
}
// The exit's sources, upstream's order: h0 (the stream start), h7, h9 (the last layer's input), value table 0 at the
// tokens, h3.
MuddExitSources mudd_exit_sources(const Model& m, const Acts& a, const DeviceBatch& b) {
    const Structure& st = m.cfg.structure;
    return {{{a.layer[0].x, nullptr}, {a.layer[st.backout_layer + 1].x, nullptr}, {a.layer[st.layers - 1].x, nullptr},
             {m.params.value_embeds, b.inputs}, {a.layer[st.skip_from + 1].x, nullptr}}};
}

AttnAux attn_aux(const Model& m, int l, const DeviceBatch& b, const StepSchedule& step_sch, const Acts& a) {
    const LayerActs& L = a.layer[l];
    const Config& c = m.cfg;
    AttnAux aux;
    aux.T = b.T;
    aux.H = c.num_heads;
    aux.D = c.head_dim;
    aux.paired = c.structure.is_paired(l);
    // upstream shifts keys on every non-paired layer whose window equals the long one
    aux.key_offset = !aux.paired && layer_window(c, step_sch, l) == step_sch.ws_long;
    aux.rope_table = m.rope.table;
    aux.rope_positions = m.rope.positions;
    aux.xa = L.h_attn;
    aux.ids = b.inputs;
    aux.ve_table = m.params.ve_table(c, l);
    aux.ve_gate = m.params.ve_gate(c, l);
    const bool reads_ve = c.structure.ve_gate_reads_ve && (!aux.paired || c.structure.paired_ve_gate_reads_ve);
    aux.ve_gate_input = reads_ve && aux.ve_table ? VeGateInput::x_and_ve : VeGateInput::x;
    if (c.structure.mudd_gate) {  // record 85: the output gate and XSA's strengths per token, from the gate's columns
        const GateColumns k = gate_layout(m).layer[l];
        if (k.gate >= 0 || k.xsa >= 0)
            aux.token = {.coefs = a.gate_c[k.id], .grads = m.bw.gate_dc[k.id], .stride = kMuddGateCoefStride,
                         .gate = k.gate, .xsa = k.xsa};
        if (k.xsa >= 0) aux.xsa_v = L.v;
    } else {
        aux.attn_gate = m.params.attn_gate(c, l);
        if (c.structure.has_xsa(l)) aux.xsa_v = L.v, aux.xsa_alpha = m.params.xsa_alpha(c, l);
    }
    if (c.structure.is_mudd_layer(l)) {  // the value embedding reaches v through MUDD's aux_v, gated by c6, c7
        aux.ve_table = aux.ve_gate = nullptr;
        aux.ve_gate_input = VeGateInput::x;
        aux.v_add = a.aux_v;
    }
    return aux;
}

// What follows the attention kernel's y in layer l: DC-MHA's output on its layer (record 85; a buffer of its own, the
// attention's backward reads y), then the output gate (and XSA) where the layer has them, y_gated, which the output
// projection reads; without either (record 85's other layers) the projection reads the gate's input itself.
struct AttnOutputs {
    const bf16* gate_in;  // y, or DC-MHA's output
    const bf16* proj_in;  // y_gated, or gate_in
    bool gated;
};
AttnOutputs attn_outputs(const Model& m, const AttnAux& aux, const Acts& a, int l) {
    const bf16* y = l == m.cfg.structure.dc_layer ? a.dc_y : a.layer[l].y;
    const bool gated = aux.attn_gate != nullptr || aux.token.coefs != nullptr;
    return {y, gated ? a.layer[l].y_gated : y, gated};
}

// The attention block of layer l: L.h_attn -> L.attn_out (the lambda-scaled weights, QKV, the value
// embedding, attention, the output gate, the output projection). MUDD's last layer first computes its entry from
// its input h9: the coefficients, aux_v (v's value-embedding and dense terms) and r (its update's stream).
void attention_block_forward(Model& m, const DeviceBatch& b, const StepSchedule& step_sch, int l, Acts& a,
                             cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    LayerActs& L = a.layer[l];
    const int T = b.T, C = c.model_dim, H = c.num_heads, D = c.head_dim;
    if (c.structure.is_mudd_layer(l)) {
        const Structure& st = c.structure;
        await_gathered(m.gathered, At::value_table, s, st.value_table(l));
        matmul_forward(*m.lt, a.mudd_z[0], L.x, p.mudd_w1_of(c, 0), T, kMuddHidden, C, s, false, "gemm_mudd_entry");
        mudd_entry_forward(a.mudd_c[0], a.aux_v, a.mudd_r, a.mudd_z[0], mudd_head(p, 0), a.layer[0].x,
                           a.layer[st.backout_layer + 1].x, L.x, {p.ve_table(c, l), b.inputs}, T, C, H, s);
    }
    const float* sa = p.scalars + c.scalar_slots.sa + 2 * l;
    await_gathered(m.gathered, At::attn, s);
    const int64_t CC = int64_t(C) * C;
    if (c.structure.attn_banks == AttnBanks::layer)  // [Wq; Wk; Wv] is one piece of the layer's matrices
        lambda_scaled_weight_forward({{L.wqkv_eff, p.wqk(c, l), sa, 3 * CC}, {L.wo_eff, p.wo(c, l), sa + 1, CC}}, s);
    else
        lambda_scaled_weight_forward({{L.wqkv_eff, p.wqk(c, l), sa, 2 * CC},
                                      {L.wqkv_eff + 2 * CC, p.wv(c, l), sa, CC},
                                      {L.wo_eff, p.wo(c, l), sa + 1, CC}}, s);
    const AttnAux aux = attn_aux(m, l, b, step_sch, a);
    matmul_forward(*m.lt, L.qkv, L.h_attn, L.wqkv_eff, T, 3 * C, C, s, false, "gemm_attn_qkv");
    if (aux.ve_table) await_gathered(m.gathered, At::value_table, s, c.structure.value_table(l));
    attn_qkv_forward(aux, L.q, L.k, L.v, L.rstd_q, L.rstd_k, L.qkv, s);
    attention_forward(L.y, L.lse, L.q, L.k, L.v, b.cu_seqlens, b.num_cu, T, H, D, layer_window(c, step_sch, l),
                      aux.paired, static_cast<float>(m.rope.attn_scale), s, b.cu_seqlens_host.data(), m.attention);
    const AttnOutputs out = attn_outputs(m, aux, a, l);
    if (l == c.structure.dc_layer)  // record 85: y + w2 (sum_h w1 P_h) v over the 112 keys before t, per token
        dc_mha_forward(a.dc_y, a.dc_lse, L.y, L.q, L.k, L.v, a.gate_c[1], kMuddGateCoefStride, b.cu_seqlens, b.num_cu, T,
                       H, D, static_cast<float>(m.rope.attn_scale), s);
    if (out.gated) attn_output_gate_forward(aux, L.y_gated, out.gate_in, s);
    matmul_forward(*m.lt, L.attn_out, out.proj_in, L.wo_eff, T, C, C, s, false, "gemm_attn_out");
}

// After lm_head changed (an Adam step, a load): its FP8 copies, and embed = lm_head^T while they
// are tied, in one pass; before anything reads them (a training forward, validation, a save).
void refresh_lm_head_copies(Model& m, cudaStream_t s) {
    if (!m.lm_head_fp8_stale) return;
    await_gathered(m.gathered, At::head, s);
    lm_head_fp8_quantize_weight(m.train.fp8, m.params.lm_head, m.fp8_scales, m.cfg.model_dim, m.cfg.padded_vocab, s,
                                m.embed_stale ? m.params.embed : nullptr);
    m.lm_head_fp8_stale = m.embed_stale = false;
}

// Training (a = m.train): the FP8 lm_head and the multi-token-prediction loss summed over rows,
// every tensor the backward needs kept. Eval (a = m.eval): the bf16 lm_head and the mean
// cross-entropy. The loss lands in m.loss.
void gpt_forward(Model& m, const DeviceBatch& b, const StepSchedule& step_sch, Acts& a, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const int T = b.T, C = c.model_dim, V = c.padded_vocab, M = c.mlp_dim;
    if (T > a.T) {
        std::fprintf(stderr, "gpt_forward: batch of %d tokens exceeds the %d the activations were sized for\n", T, a.T);
        std::exit(EXIT_FAILURE);
    }
    const Structure& st = c.structure;
    const ScalarSlots& k = c.scalar_slots;
    const Range range("forward");
    // each gathered parameter is waited for at its place, where it is first read (its param_table row)
    if (a.training && m.embed_stale) refresh_lm_head_copies(m, s);  // tied: embed is made from lm_head
    // x = x0 = norm(smear(embed[ids])); the bigram rows join every layer's mix
    await_gathered(m.gathered, At::embed, s);
    embed_smear_forward(a.smeared, p.embed, b.inputs, p.smear_gate, p.scalars + k.smear, T, C, s);
    rmsnorm_forward(a.x0, a.rstd_x0, a.smeared, T, C, s);
    await_gathered(m.gathered, At::bigram, s);
    embedding_gather(a.x0_bigram, p.bigram_embed, b.bigram, T, c.bigram_width(), s, bigram_signs(m, b));

    const MuddGateLayout gates = st.mudd_gate ? gate_layout(m) : MuddGateLayout{};
    if (st.mudd_gate) mudd_gate_block_forward(m, a, 0, a.x0, T, s);  // record 85: the pre gate's columns, from x0
    if (st.sublayer_lambdas)  // x = bf16(x0 + lb[0] x0_bigram) (x0_is_stream: in place; record 85: lb per token, the pre
                              // gate's layer-0 bigram column); layer 0's attention reads norm(x)
        stream_start_forward(a.layer[0].x, a.layer[0].h_attn, a.layer[0].rstd_attn, a.x0, a.x0_bigram,
                             st.mudd_gate ? a.gate_c[0] + gates.layer[0].bigram : p.bigram_lambdas, T, C, s, c.bigram_dim,
                             st.mudd_gate ? kMuddGateCoefStride : 0);
    for (int l = 0; l < st.layers; ++l) {
        const Range layer_range("layer", l);
        LayerActs& L = a.layer[l];
        if (st.mudd_gate && l == st.mudd_gate_post_layer)  // record 85: the post gate's columns, from this layer's input
            mudd_gate_block_forward(m, a, 1, L.x, T, s);
        const bf16* stream = nullptr;  // the stream the MLP's update adds to, and the MLP's input
        const bf16* mlp_in = nullptr;
        if (!st.sublayer_lambdas) {
            if (l == st.skip_to)  // x += sigmoid(skip_lambda) * 2 * sigmoid(x0[:, :12] . skip_gate) * (layer skip_from's output)
                gated_skip_add_forward(L.x, L.x, a.layer[st.skip_from + 1].x, a.x0, p.skip_gate, p.scalars + k.skip, T, C, s);
            // xm = resid * x + x0_lambda * x0 + bigram_lambda * x0_bigram; h = norm(xm)
            residual_mix_forward(L.xm, L.h_attn, L.rstd_attn, L.x, a.x0, a.x0_bigram, mix_lambdas(c, p, l), l == 0, T, C, s);
            stream = L.xm, mlp_in = L.h_attn;
            if (st.has_attention(l)) {
                attention_block_forward(m, b, step_sch, l, a, s);
                residual_add_forward(L.xa, L.h_mlp, L.rstd_mlp, L.xm, L.attn_out, T, C, s);
                stream = L.xa, mlp_in = L.h_mlp;
            }
        } else if (!st.has_attention(l)) {  // the skip's target: x += gate * (layer skip_from's output); h = norm(x)
            if (st.mudd_gate)  // record 85: the gate sigmoid(skip_lambda) times the post gate's skip column, per token
                token_skip_add_norm_forward(L.xm, L.h_attn, L.rstd_attn, L.x, a.layer[st.skip_from + 1].x,
                                            a.gate_c[1] + gates.skip, kMuddGateCoefStride, p.scalars + k.skip, T, C, s);
            else
                gated_skip_add_norm_forward(L.xm, L.h_attn, L.rstd_attn, L.x, a.layer[st.skip_from + 1].x, a.x0,
                                            p.skip_gate, p.scalars + k.skip, T, C, s);
            stream = L.xm, mlp_in = L.h_attn;
        } else if (st.is_mudd_layer(l)) {  // x = bf16(c8 r + c9 attn(h_attn) + c10 h0 (+ c11 xb)), per token
            attention_block_forward(m, b, step_sch, l, a, s);
            sublayer_residual_forward(L.xa, L.h_mlp, L.rstd_mlp, a.mudd_r, L.attn_out, a.layer[0].x, a.x0_bigram,
                                      mudd_lambdas(a.mudd_c[0], 8, true), Injection::x0_and_bigram, T, C, s, c.bigram_dim);
            stream = L.xa, mlp_in = L.h_mlp;
        } else {  // x = bf16(resid x + post attn(h_attn) + injection); h = norm(x)
            attention_block_forward(m, b, step_sch, l, a, s);
            sublayer_residual_forward(L.xa, L.h_mlp, L.rstd_mlp, L.x, L.attn_out, a.x0, a.x0_bigram,
                                      attention_update_lambdas(m, a, l), attention_injection(l), T, C, s, c.bigram_dim);
            stream = L.xa, mlp_in = L.h_mlp;
        }
        await_gathered(m.gathered, At::mlp, s);
        if (a.training && c.mlp_up_fp8) {  // record 84: x and c_fc in e4m3, c_fc's copies remade after it changed
            if (m.mlp_fp8_stale) {  // upstream's quantize_mlp_fp8 after each optimizer step: c_fc, then c_proj
                mlp_fp8_quantize_weights(m.mlp_fp8, {p.mlp_bank, int64_t(2) * M * C, st.layers + 1}, M, C,
                                         m.mlp_fp8_weight_scratch, s);
                if (c.mlp_down_fp8)
                    mlp_fp8_down_quantize_weights(m.mlp_fp8_down, {p.c_proj(c, 0), int64_t(2) * M * C, st.layers + 1},
                                                  M, C, m.mlp_fp8_down_scaling, m.mlp_fp8_down_weight_scratch, s);
                m.mlp_fp8_stale = false;
            }
            const Fp8Up up{m.mlp_fp8.w + int64_t(l) * M * C, m.mlp_fp8.scale + l, a.mlp_xq, m.mlp_fp8_scales,
                           m.mlp_fp8_input_scratch};
            if (c.mlp_down_fp8) {  // record 89: post also in e4m3 with the delayed act scale, its amax for the next
                const int64_t count = mlp_fp8_down_act_partials(m.mlp_kernel, T, M);
                const Fp8DownAct down{a.mlp_postq, m.mlp_fp8_down_act_partials + l * count,
                                      &m.mlp_fp8_down.scales[l].act, L.pre};  // pre: null post-only
                mlp_fp8_quantize_input(up, mlp_in, T, C, s);
                linear_relu_square_forward_fp8_down(m.mlp_kernel, L.post, down, up, T, C, M, s);
                mlp_fp8_down_proj(*m.lt, L.mlp_out, a.mlp_postq, m.mlp_fp8_down.w + int64_t(l) * C * M,
                                  m.mlp_fp8_down.scales + l, T, C, M, s);
            } else {
                mlp_forward_fp8(*m.lt, m.mlp_kernel, L.mlp_out, L.pre, L.post, mlp_in, up, p.c_proj(c, l), T, C, M, s,
                                c.mlp_saves);
            }
        } else {
            mlp_forward(*m.lt, m.mlp_kernel, L.mlp_out, L.pre, L.post, mlp_in, p.c_fc(c, l), p.c_proj(c, l), T, C, M, s,
                        c.mlp_saves);
        }
        bf16* x_next = l + 1 < st.layers ? a.layer[l + 1].x : a.x_out;
        if (!st.sublayer_lambdas) {
            residual_add_forward(x_next, nullptr, nullptr, stream, L.mlp_out, T, C, s);
        } else {  // x = bf16(resid x + post mlp); with the norm the next layer's attention reads, made once for the
                  // late source's readers (none after the last layer or before the skip's target)
            const bool norm = l + 1 < st.layers && st.has_attention(l + 1) && !st.reads_late_source(l);
            sublayer_residual_forward(x_next, norm ? a.layer[l + 1].h_attn : nullptr, norm ? a.layer[l + 1].rstd_attn : nullptr,
                                      stream, L.mlp_out, nullptr, nullptr,
                                      st.is_mudd_layer(l) ? mudd_lambdas(a.mudd_c[0], 12, false) : sublayer_lambdas(p, l, 1),
                                      Injection::none, T, C, s);
        }
    }
    if (a.training && c.mlp_down_fp8)  // record 89: each layer's act for the next training forward (this rank's)
        mlp_fp8_down_act_scales(m.mlp_fp8_down.scales, m.mlp_fp8_down_act_partials,
                                mlp_fp8_down_act_partials(m.mlp_kernel, T, M), st.layers, s);
    if (st.mudd) {  // MUDD's exit: x += c0 h0 + c1 h7 + c2 h9 + c3 ve0 + c4 h3, per token; h = norm(x)
        matmul_forward(*m.lt, a.mudd_z[1], a.x_out, p.mudd_w1_of(c, 1), T, kMuddHidden, C, s, false, "gemm_mudd_exit");
        mudd_exit_forward(a.mudd_c[1], a.x_final, a.h_final, a.rstd_final, a.mudd_z[1], mudd_head(p, 1), a.x_out,
                          mudd_exit_sources(m, a, b), T, C, s);
    } else {  // x -= backout_lambda * (the backout layer's output); h = norm(x)
        backout_forward(a.x_final, a.h_final, a.rstd_final, a.x_out, a.layer[st.backout_layer + 1].x, p.scalars + k.backout,
                        T, C, s);
    }
    if (a.training) refresh_lm_head_copies(m, s);
    await_gathered(m.gathered, At::head, s);
    if (a.training) {
        lm_head_fp8_forward(*m.lt, a.logits, a.fp8, a.h_final, m.fp8_scales, T, C, V, s);
        if (c.loss == SoftcapLoss::tanh_bf16)
            ce_r80_loss_forward(m.loss, false, a.row_losses, a.lse_head, a.logits, b.targets, step_sch.mtp_weights,
                                step_sch.n_predict, T, V, s, step_sch.prefix);
        else
            softcap_mtp_loss_forward(m.loss, false, a.row_losses, a.lse_head, a.logits, b.targets, step_sch.mtp_weights,
                                     step_sch.n_predict, T, V, s);
    } else {
        for (int r = 0; r < T; r += a.logit_rows) {
            const int rows = std::min(a.logit_rows, T - r);
            lm_head_bf16_forward(*m.lt, a.logits, a.h_final + int64_t(r) * C, p.lm_head, rows, C, V, s);
            softcap_eval_loss(m.loss, r > 0, 1.0f / T, a.row_losses + r, a.logits, b.targets + r, rows, V, s);
        }
    }
}

// ============================================================================================
// Backward: the gradient of loss * grad_scale into m.grads. Gradients add to what is there where
// upstream's .grad accumulates: over micro-steps, and for Adam's parameters also over the even
// step before each Adam step.
// ============================================================================================
struct BackwardOptions {
    bool accumulate_matrices = false;  // add to the NorMuon banks' gradients (attn, mlp)
    bool accumulate_others = false;    // add to every Adam parameter's gradient
    bool last_micro_step = false;      // the step's last: NorMuon's gradients are final as the backward finishes them
    bool adam_final = false;           // ... of an Adam step: so are Adam's
    bool embed_tied = false;           // embed's gradient joins lm_head's after the backward: the head's is final only there
};

// The backward's hook: everything finishing the gradients at `place` (of layer or value table `index`)
// is enqueued on s. The groups whose param_table row reduces them there start on the comms stream once
// final (NorMuon's on the step's last micro-step, Adam's on an Adam step's): a bank's buckets of that
// point, a table's pieces, a group's reduce-scatter.
void reduce_final(GradBuckets& g, const BackwardOptions& o, At place, int index, int layers, cudaStream_t s) {
    if (place == At::head && o.embed_tied) return;
    bool buckets = false;
    for (const GroupComms& q : g.group)
        buckets |= q.place == static_cast<int>(place) && q.reduce == Reduce::buckets && o.last_micro_step;
    if (buckets) reduce_final_buckets(g, backward_point(place, index, layers), s);
    for (const GroupComms& q : g.group) {
        if (q.place != static_cast<int>(place) || !(q.every_step ? o.last_micro_step : o.adam_final)) continue;
        if (q.reduce == Reduce::tables) reduce_final_table(g, q, index, s);
        if (q.reduce == Reduce::at_place) reduce_final_shards(g, q, s);
    }
}

// Record 85's gate id from its columns' gradients (each written by its reader): its head's, its scale's and its
// first layer's gradients (added: gpt_backward zeroes them on a step's first micro-batch), and its input h's share
// added into dh.
void mudd_gate_block_backward(Model& m, int id, const bf16* h, bf16* dh, int T, cudaStream_t s) {
    const Params& p = m.params;
    const Params& g = m.grads;
    BackwardBufs& w = m.bw;
    const int C = m.cfg.model_dim;
    mudd_gate_backward(w.mudd_dz, {g.mudd_gate_w2_of(id), g.mudd_gate_b2_of(id), true},
                       {g.mudd_gate_scale, true}, {w.scratch, m.sums_done}, w.gate_dc[id],
                       m.train.gate_z[id], mudd_gate_head(p, id), p.mudd_gate_scale, T, s);
    matmul_backward_weight(*m.lt, g.mudd_gate_w1_of(m.cfg, id), w.mudd_dz, h, T, kMuddHidden, C, s, true,
                           id == 0 ? "gemm_mudd_gate_pre_dw" : "gemm_mudd_gate_post_dw");
    matmul_backward_input(*m.lt, dh, w.mudd_dz, p.mudd_gate_w1_of(m.cfg, id), T, kMuddHidden, C, s, true,
                          id == 0 ? "gemm_mudd_gate_pre_dx" : "gemm_mudd_gate_post_dx");
}

// The attention block of layer l from the gradient of its output (d_out) to that of its input h_attn
// (dh, overwritten), with its weights' and gates' gradients and the value table's rows (each reduced
// where final).
void attention_block_backward(Model& m, const DeviceBatch& b, const StepSchedule& step_sch, const BackwardOptions& acc,
                              int l, const bf16* d_out, bf16* dh, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const Params& g = m.grads;
    LayerActs& L = m.train.layer[l];
    BackwardBufs& w = m.bw;
    const BlockPartials sums{w.scratch, m.sums_done};
    const int T = b.T, C = c.model_dim, H = c.num_heads, D = c.head_dim;
    const Structure& st = c.structure;
    const AttnAux aux = attn_aux(m, l, b, step_sch, m.train);
    const float* sa = p.scalars + c.scalar_slots.sa + 2 * l;
    float* dsa = g.scalars + c.scalar_slots.sa + 2 * l;
    const AttnOutputs out = attn_outputs(m, aux, m.train, l);
    // output projection: attn_out = y_gated @ wo_eff^T
    bf16* dwo_eff = w.dw_eff + int64_t(3) * C * C;
    matmul_backward_weight(*m.lt, dwo_eff, d_out, out.proj_in, T, C, C, s, false, "gemm_attn_out_dw");
    matmul_backward_input(*m.lt, w.dy, d_out, L.wo_eff, T, C, C, s, false, "gemm_attn_out_dx");
    const bool per_token = aux.token.coefs != nullptr;  // record 85: the gate's and XSA's gradients go to its columns
    const XsaGrads xsa = !aux.xsa_v ? XsaGrads{}
                         : per_token ? XsaGrads{.dv = w.dv_xsa}
                                     : XsaGrads{w.dv_xsa, g.xsa_alpha(c, l), sums, acc.accumulate_others};
    if (out.gated) attn_output_gate_backward(aux, w.dy, per_token ? nullptr : w.dz_attn, w.dy, out.gate_in, s, xsa);
    attention_backward(w.dq, w.dk, w.dv, w.dy, L.y, L.lse, L.q, L.k, L.v, b.cu_seqlens, b.num_cu, T, H, D,
                       layer_window(c, step_sch, l), aux.paired, static_cast<float>(m.rope.attn_scale), w.scratch,
                       w.scratch_bytes, s, AttentionBackwardMode::deterministic, b.cu_seqlens_host.data(), m.attention);
    if (l == st.dc_layer)  // record 85: DC-MHA's y passes dy through; its dq, dk, dv add to the attention's (its own
                           // workspace: the attention's is done with)
        dc_mha_backward(w.dq, w.dk, w.dv, w.gate_dc[1], w.dy, L.q, L.k, L.v, m.train.dc_lse, m.train.gate_c[1],
                        kMuddGateCoefStride, b.cu_seqlens, b.num_cu, T, H, D, static_cast<float>(m.rope.attn_scale),
                        w.scratch, w.scratch_bytes, s);
    const int table = aux.ve_table ? st.value_table(l) : -1;  // MUDD's layer: its value rows are the entry's
    bf16* dve = table >= 0 ? w.dve[table] : nullptr;
    float* dz_ve = table >= 0 ? w.dz_ve : nullptr;
    attn_qkv_backward(aux, w.dqkv, dve, dz_ve, w.dq, w.dk, w.dv, L.qkv, L.rstd_q, L.rstd_k, s, xsa.dv);
    // qkv = h_attn @ wqkv_eff^T
    matmul_backward_weight(*m.lt, w.dw_eff, w.dqkv, L.h_attn, T, 3 * C, C, s, false, "gemm_attn_qkv_dw");
    matmul_backward_input(*m.lt, dh, w.dqkv, L.wqkv_eff, T, 3 * C, C, s, false, "gemm_attn_qkv_dx");
    const LambdaScaledAccumulate into{.dw = acc.accumulate_matrices, .dlambda = acc.accumulate_others};
    const int64_t CC = int64_t(C) * C;
    if (st.attn_banks == AttnBanks::layer)  // record 71's two pieces: its dlambda's order of summation
        lambda_scaled_weight_backward({{g.wqk(c, l), dsa, w.dw_eff, p.wqk(c, l), sa, 3 * CC},
                                       {g.wo(c, l), dsa + 1, dwo_eff, p.wo(c, l), sa + 1, CC}},
                                      sums, into, s);
    else
        lambda_scaled_weight_backward({{g.wqk(c, l), dsa, w.dw_eff, p.wqk(c, l), sa, 2 * CC},
                                       {g.wv(c, l), dsa, w.dw_eff + 2 * CC, p.wv(c, l), sa, CC},
                                       {g.wo(c, l), dsa + 1, dwo_eff, p.wo(c, l), sa + 1, CC}},
                                      sums, into, s);
    reduce_final(m.buckets, acc, At::attn, l, st.layers, s);
    // the gates' share of dve (a gate that reads the value embedding) comes before the table's rows (record 85: the VE
    // gate alone, where the layer has one)
    if (aux.attn_gate || aux.ve_gate)
        attn_gates_backward(aux, dh, aux.ve_gate_input == VeGateInput::x_and_ve ? dve : nullptr,
                            aux.attn_gate ? g.attn_gate(c, l) : nullptr, table >= 0 ? g.ve_gate(c, l) : nullptr,
                            aux.attn_gate ? w.dz_attn : nullptr, dz_ve, sums, acc.accumulate_others, s);
    if (table >= 0) {  // the table's rows, final here: reduced at once on an Adam step
        embedding_backward(g.ve_table(c, l), dve, b.token_segments, b.token_segments_dev, w.scratch, C, true, s);
        reduce_final(m.buckets, acc, At::value_table, table, st.layers, s);
    }
}

void gpt_backward(Model& m, const DeviceBatch& b, const StepSchedule& step_sch, BackwardOptions acc, cudaStream_t s) {
    const Config& c = m.cfg;
    const Params& p = m.params;
    const Params& g = m.grads;
    Acts& a = m.train;
    BackwardBufs& w = m.bw;
    const BlockPartials sums{w.scratch, m.sums_done};
    const int T = b.T, C = c.model_dim, V = c.padded_vocab, M = c.mlp_dim;
    const Structure& st = c.structure;
    const ScalarSlots& k = c.scalar_slots;
    bf16 *dX = w.dX, *dX_skip = w.dX_skip, *dX_backout = w.dX_backout;  // stream gradients change buffers below
    bf16 *dX_h0 = w.dX_h0, *dX_h9 = w.dX_h9;                            // MUDD's h0 and h9
    const bool accumulate = acc.accumulate_others;
    const Range range("backward");
    if (!accumulate) {  // the embedding backward writes only the rows of this batch's ids
        CUDA_CHECK(memset_async(g.embed, 0, size_t(V) * C * sizeof(bf16), s));
        CUDA_CHECK(memset_async(g.value_embeds, 0, size_t(st.value_tables()) * V * C * sizeof(bf16), s));
        CUDA_CHECK(memset_async(g.bigram_embed, 0, size_t(c.bigram_vocab) * c.bigram_width() * sizeof(bf16), s));
        if (g.xsa_alphas)  // the rows of layers without XSA stay zero; the XSA layers' backward writes theirs
            CUDA_CHECK(memset_async(g.xsa_alphas, 0, size_t(st.layers) * c.num_heads * sizeof(float), s));
        if (st.mudd) {  // MUDD's kernels add (the exit's rows 5.. of w2 and b2 get none)
            CUDA_CHECK(memset_async(g.mudd_w1, 0, size_t(2) * kMuddHidden * C * sizeof(bf16), s));
            CUDA_CHECK(memset_async(g.mudd_w2, 0, size_t(2) * kMuddMaxCoef * kMuddHidden * sizeof(bf16), s));
            CUDA_CHECK(memset_async(g.mudd_b2, 0, size_t(2) * kMuddMaxCoef * sizeof(bf16), s));
        }
        if (st.mudd_gate) {  // the gate's kernels add too (rows past each gate's columns get none)
            CUDA_CHECK(memset_async(g.mudd_gate_w1, 0, size_t(2) * kMuddHidden * C * sizeof(bf16), s));
            CUDA_CHECK(memset_async(g.mudd_gate_w2, 0, size_t(2) * kMuddGateMaxCoef * kMuddHidden * sizeof(bf16), s));
            CUDA_CHECK(memset_async(g.mudd_gate_b2, 0, size_t(2) * kMuddGateMaxCoef * sizeof(bf16), s));
            CUDA_CHECK(memset_async(g.mudd_gate_scale, 0, sizeof(float), s));
        }
    }
    const MuddGateLayout gates = st.mudd_gate ? gate_layout(m) : MuddGateLayout{};
    if (st.mudd) {  // MUDD's shares of h0 reach it first (dX_h0): every injection adds to x0's and the bigram's
        CUDA_CHECK(memset_async(w.gx0, 0, size_t(T) * C * sizeof(bf16), s));
        CUDA_CHECK(memset_async(w.gxb, 0, size_t(T) * c.bigram_width() * sizeof(bf16), s));
    }

    // loss -> its e5m2 gradient, both layouts in one pass -> lm_head and its input
    if (c.loss == SoftcapLoss::tanh_bf16)
        ce_r80_loss_backward_fp8(a.fp8.g_f8, a.fp8.g_f8_t, m.dloss, &m.fp8_scales->grad, a.logits, a.lse_head, b.targets,
                                 step_sch.mtp_weights, step_sch.n_predict, T, V, s, step_sch.prefix);
    else
        softcap_mtp_loss_backward_fp8(a.fp8.g_f8, a.fp8.g_f8_t, &m.fp8_scales->grad, a.logits, a.lse_head, b.targets,
                                      step_sch.mtp_weights, step_sch.n_predict, m.dloss, T, V, s);
    lm_head_fp8_backward(*m.lt, w.dh, g.lm_head, accumulate, a.fp8, m.fp8_scales, T, C, V, s);
    reduce_final(m.buckets, acc, At::head, 0, st.layers, s);
    if (st.mudd) {  // the exit: x_out's gradient (dX) and the first shares of h0, h7, h9, value table 0's rows, h3
        const MuddExitGrads eg{dX, {{dX_h0, false}, {dX_backout, false}, {dX_h9, false}, {w.dve_exit, false},
                                    {dX_skip, false}}};
        mudd_exit_backward(w.mudd_dz, w.mudd_dc, eg, {g.mudd_w2_of(1), g.mudd_b2_of(1), true}, sums, w.dh, a.x_final,
                           a.rstd_final, a.mudd_c[1], a.mudd_z[1], mudd_head(p, 1), mudd_exit_sources(m, a, b), T, C, s);
        matmul_backward_weight(*m.lt, g.mudd_w1_of(c, 1), w.mudd_dz, a.x_out, T, kMuddHidden, C, s, true,
                               "gemm_mudd_exit_dw");
        matmul_backward_input(*m.lt, dX, w.mudd_dz, p.mudd_w1_of(c, 1), T, kMuddHidden, C, s, true, "gemm_mudd_exit_dx");
        embedding_backward(g.value_embeds, w.dve_exit, b.token_segments, b.token_segments_dev, w.scratch, C, true, s);
    } else {
        backout_backward(dX, dX_backout, g.scalars + k.backout, sums, w.dh, a.x_final, a.rstd_final,
                         a.layer[st.backout_layer + 1].x, p.scalars + k.backout, accumulate, T, C, s);
    }
    if (st.sublayer_lambdas && !accumulate) {  // the skip's target has no attention update: its lambdas are unused
        std::vector<float*> unused = {g.resid_lambdas + 2 * st.skip_to, g.post_lambdas + 2 * st.skip_to};
        if (!st.mudd_gate) unused.insert(unused.end(), {g.x0_lambdas + st.skip_to, g.bigram_lambdas + st.skip_to});
        if (st.mudd) {  // nor are MUDD's layer's, nor its value table's gate: the per-token coefficients replace them
            const int last = st.layers - 1;
            unused.insert(unused.end(), {g.resid_lambdas + 2 * last, g.resid_lambdas + 2 * last + 1,
                                         g.post_lambdas + 2 * last, g.post_lambdas + 2 * last + 1});
            if (!st.mudd_gate) unused.insert(unused.end(), {g.x0_lambdas + last, g.bigram_lambdas + last});
            CUDA_CHECK(memset_async(g.ve_gate(c, last), 0, size_t(c.num_heads) * kGateWidth * sizeof(bf16), s));
        }
        for (float* e : unused) CUDA_CHECK(memset_async(e, 0, sizeof(float), s));
    }
    int last_attention = 0;  // the first injection the backward meets writes gx0 and gxb; the others add
    for (int l = 0; l < st.layers; ++l)
        if (st.has_attention(l)) last_attention = l;
    // the last layer's output gradient is in dX; layers run backward, each leaving its input's in dX
    for (int l = st.layers - 1; l >= 0; --l) {
        const Range layer_range("layer", l);
        LayerActs& L = a.layer[l];
        const bf16* mlp_in = st.has_attention(l) ? L.h_mlp : L.h_attn;
        const bf16* d_mlp_out = dX;
        if (st.sublayer_lambdas) {  // the MLP's update x_next = bf16(resid x + post mlp_out), and the norms read from x_next
            const bool norm = l + 1 < st.layers && st.has_attention(l + 1) && !st.reads_late_source(l);
            NormGrads dh_next{};
            if (norm) {
                dh_next.dh[0] = w.dh;  // the next layer's attention input gradient
                for (int j = 0; l == st.late_attn_source && j < NormGrads::kMax - 1; ++j) dh_next.dh[j + 1] = w.dh_late[j];
            }
            const LayerActs* next = l + 1 < st.layers ? &a.layer[l + 1] : nullptr;
            const bool mudd = st.is_mudd_layer(l);  // MUDD's layer: per-token c12, c13
            sublayer_residual_backward(dX, w.dblock, nullptr, nullptr,
                                       mudd ? mudd_lambda_grads(w.mudd_dc, 12, false) : sublayer_lambda_grads(g, l, 1),
                                       sums, dX, dh_next, next ? next->x : a.x_out, norm ? next->rstd_attn : nullptr,
                                       st.has_attention(l) ? L.xa : L.xm, L.mlp_out, nullptr, nullptr,
                                       mudd ? mudd_lambdas(a.mudd_c[0], 12, false) : sublayer_lambdas(p, l, 1),
                                       {.injection = Injection::none, .accumulate_dx = false, .accumulate_x0_grads = false,
                                        .accumulate_lambda_grads = accumulate && !mudd},
                                       T, C, s);
            d_mlp_out = w.dblock;
        }
        mlp_backward(*m.lt, m.mlp_kernel, w.dh, g.c_fc(c, l), g.c_proj(c, l), acc.accumulate_matrices, L.post, d_mlp_out,
                     mlp_in, p.c_fc(c, l), p.c_proj(c, l), L.pre, L.post, T, C, M, s, c.mlp_saves);
        reduce_final(m.buckets, acc, At::mlp, l, st.layers, s);
        // the stream's input gradient goes to the buffer that already holds that stream's other share (the
        // backout layer's output: the backout; the skip's: the skip; record 71's layer 0 input: x0)
        bf16* d_in = dX;
        bool add_to_d_in = false;
        if (l == 0 && !st.sublayer_lambdas) d_in = w.gx0, add_to_d_in = true;
        if (l == 0 && st.mudd) d_in = dX_h0, add_to_d_in = true;  // h0 is the stream start
        if (l == st.backout_layer + 1) d_in = dX_backout, add_to_d_in = true;
        if (l == st.skip_from + 1) d_in = dX_skip, add_to_d_in = true;
        if (!st.sublayer_lambdas) {
            if (st.has_attention(l)) {
                residual_add_backward(dX, w.dh, L.xa, L.rstd_mlp, T, C, s);  // dX now: the gradient of xm's stream use
                attention_block_backward(m, b, step_sch, acc, l, dX, w.dh, s);
            }
            residual_mix_backward(d_in, w.gx0, w.gxb, {g.scalars + k.resid + l, g.x0_lambdas + l, g.scalars + k.bigram + l},
                                  sums, dX, w.dh, L.xm, L.rstd_attn, L.x, a.x0, a.x0_bigram, mix_lambdas(c, p, l),
                                  {.first_layer = l == 0, .accumulate_dx = add_to_d_in,
                                   .accumulate_x0_grads = l != st.layers - 1, .accumulate_lambda_grads = accumulate},
                                  T, C, s);
        } else if (!st.has_attention(l)) {  // the skip's target: the norm its MLP read, then the skip add
            residual_add_backward(dX, w.dh, L.xm, L.rstd_attn, T, C, s);
        } else if (st.is_mudd_layer(l)) {  // x_a = bf16(c8 r + c9 attn_out + c10 h0 (+ c11 xb)): r's gradient to dr
            sublayer_residual_backward(w.dr, w.dblock, dX_h0, w.gxb, mudd_lambda_grads(w.mudd_dc, 8, true), sums, dX,
                                       NormGrads{{w.dh}}, L.xa, L.rstd_mlp, a.mudd_r, L.attn_out, a.layer[0].x,
                                       a.x0_bigram, mudd_lambdas(a.mudd_c[0], 8, true),
                                       {.injection = Injection::x0_and_bigram, .accumulate_dx = false,
                                        .accumulate_x0_grads = true, .accumulate_lambda_grads = false,
                                        .bigram_dim = c.bigram_dim},
                                       T, C, s);
            const bool later_reader = st.reads_late_source(l) && st.reads_late_source(l - 1);
            attention_block_backward(m, b, step_sch, acc, l, w.dblock,
                                     later_reader ? w.dh_late[l - st.late_attn_source - 2] : w.dh, s);
            // the entry: from aux_v's gradient (v's, in d(qkv)) and r's, every coefficient's and source's; then its
            // first layer (h9's share, the value table's rows)
            const int table = st.value_table(l), H = c.num_heads;
            const MuddEntryGrads eg{{dX_h0, true}, {dX_backout, true}, {dX_h9, true}, w.dve[table]};
            mudd_entry_backward(w.mudd_dz, w.mudd_dc, eg, {g.mudd_w2_of(0), g.mudd_b2_of(0), true}, sums, w.dqkv + 2 * C,
                                3 * C, w.dr, a.mudd_c[0], a.mudd_z[0], mudd_head(p, 0), a.layer[0].x,
                                a.layer[st.backout_layer + 1].x, L.x, {p.ve_table(c, l), b.inputs}, T, C, H, s);
            matmul_backward_weight(*m.lt, g.mudd_w1_of(c, 0), w.mudd_dz, L.x, T, kMuddHidden, C, s, true,
                                   "gemm_mudd_entry_dw");
            matmul_backward_input(*m.lt, dX_h9, w.mudd_dz, p.mudd_w1_of(c, 0), T, kMuddHidden, C, s, true,
                                  "gemm_mudd_entry_dx");
            embedding_backward(g.ve_table(c, l), w.dve[table], b.token_segments, b.token_segments_dev, w.scratch, C, true, s);
            reduce_final(m.buckets, acc, At::value_table, table, st.layers, s);
            std::swap(dX, dX_h9);  // the layer's input gradient: h9's
        } else {  // x_a = bf16(resid x + post attn_out + injection); then the attention from the gradient of attn_out
            sublayer_residual_backward(d_in, w.dblock, w.gx0, w.gxb, attention_update_lambda_grads(m, l), sums, dX,
                                       NormGrads{{w.dh}}, L.xa, L.rstd_mlp, L.x, L.attn_out, a.x0, a.x0_bigram,
                                       attention_update_lambdas(m, a, l),
                                       {.injection = attention_injection(l), .accumulate_dx = add_to_d_in,
                                        .accumulate_x0_grads = st.mudd || l != last_attention,
                                        .accumulate_lambda_grads = accumulate,
                                        .bigram_dim = c.bigram_dim},
                                       T, C, s);
            // a later reader of the late source keeps its input gradient until the source's update
            const bool later_reader = st.reads_late_source(l) && st.reads_late_source(l - 1);
            attention_block_backward(m, b, step_sch, acc, l, w.dblock,
                                     later_reader ? w.dh_late[l - st.late_attn_source - 2] : w.dh, s);
        }
        if (l == st.backout_layer + 1) std::swap(dX, dX_backout);  // the layer below continues from there
        if (l == st.skip_from + 1) std::swap(dX, dX_skip);
        if (l == 0 && st.mudd) std::swap(dX, dX_h0);  // the stream start's whole gradient
        if (l == st.skip_to && st.mudd_gate)  // record 85: the skip's share of h3, its gate column's and lambda's
            token_skip_add_backward(dX_skip, w.gate_dc[1] + gates.skip, g.scalars + k.skip, sums, dX,
                                    a.layer[st.skip_from + 1].x, a.gate_c[1] + gates.skip, kMuddGateCoefStride,
                                    p.scalars + k.skip,
                                    {.accumulate_d_skip = true,  // MUDD's exit wrote h3's first share
                                     .accumulate_lambda_grad = accumulate},
                                    T, C, s);
        else if (l == st.skip_to)  // the skip add's output gradient (dX) also reaches the skip layer's output and the gate
            gated_skip_add_backward(dX_skip, w.gx0, g.skip_gate, g.scalars + k.skip, sums, dX,
                                    a.layer[st.skip_from + 1].x, a.x0, p.skip_gate, p.scalars + k.skip,
                                    {.accumulate_d_skip = st.mudd,  // MUDD's exit wrote h3's first share
                                     .accumulate_param_grads = accumulate},
                                    T, C, s);
        if (st.mudd_gate && l == st.mudd_gate_post_layer)  // every reader of the post gate is done: its input gets its share
            mudd_gate_block_backward(m, 1, L.x, dX, T, s);
        if (l == 0 && st.sublayer_lambdas)  // the stream's start, x0 + lb[0] x0_bigram, read by layer 0's norm and update
                                            // (record 85: lb per token, its gradient into the pre gate's column)
            stream_start_backward(w.gx0, w.gxb, st.mudd_gate ? w.gate_dc[0] + gates.layer[0].bigram : g.bigram_lambdas,
                                  sums, dX, w.dh, L.x, L.rstd_attn, a.x0_bigram,
                                  st.mudd_gate ? a.gate_c[0] + gates.layer[0].bigram : p.bigram_lambdas,
                                  {.accumulate_x0_grads = true, .accumulate_lambda_grads = accumulate && !st.mudd_gate,
                                   .bigram_dim = c.bigram_dim, .x0_is_stream = st.x0_is_stream,
                                   .token_stride = st.mudd_gate ? kMuddGateCoefStride : 0},
                                  T, C, s);
    }
    if (st.mudd_gate) mudd_gate_block_backward(m, 0, a.x0, w.gx0, T, s);  // the pre gate: x0's last share
    // x0 = norm(smeared); smeared = smear(embed[ids])
    rmsnorm_backward(w.d_smeared, w.gx0, a.smeared, a.rstd_x0, T, C, false, s);
    embed_smear_backward(w.d_embed_rows, g.smear_gate, g.scalars + k.smear, w.d_smeared, p.embed, b.inputs,
                         p.smear_gate, p.scalars + k.smear, sums, T, C, accumulate, s);
    embedding_backward(g.embed, w.d_embed_rows, b.token_segments, b.token_segments_dev, w.scratch, C, true, s);
    embedding_backward(g.bigram_embed, w.gxb, b.bigram_segments, b.bigram_segments_dev, w.scratch, c.bigram_width(), true,
                       s, bigram_signs(m, b));
}

// ============================================================================================
// The schedule: upstream's TrainingSchedule and get_muon_momentum, host functions of the step.
// ============================================================================================
// The lr multiplier of `step` (upstream TrainingSchedule.get_lr): the stage's lr_mul until the
// cooldown, which starts at int(scheduled_iterations * (1 - cooldown_frac)) and blends linearly to the
// floor at scheduled_iterations (and stays there). The caller looks up the step's stage.
inline double lr_schedule(int step, double stage_lr_mul, int scheduled_iterations, double cooldown_frac, double floor) {
    const int cd_start = static_cast<int>(static_cast<double>(scheduled_iterations) * (1.0 - cooldown_frac));
    if (step < cd_start || scheduled_iterations <= cd_start) return stage_lr_mul;
    const double t =
        std::min(1.0, static_cast<double>(step - cd_start) / static_cast<double>(scheduled_iterations - cd_start));
    return stage_lr_mul * (1.0 - t) + floor * t;
}

// NorMuon's momentum at `step` (upstream get_muon_momentum): linear warm-up from lo to hi over the
// first warmup_steps, hi, then linear cool-down back toward lo over the last cooldown_steps of
// total_steps (scheduled plus extension).
inline double muon_momentum(int step, int total_steps, int warmup_steps = 300, int cooldown_steps = 50,
                            double lo = 0.85, double hi = 0.95) {
    const int cd_start = total_steps - cooldown_steps;
    if (step < warmup_steps) return lo + static_cast<double>(step) / warmup_steps * (hi - lo);
    if (step > cd_start) return hi - static_cast<double>(step - cd_start) / cooldown_steps * (hi - lo);
    return hi;
}

struct Schedule {
    const Config& c;
    std::vector<int> starts;  // first step of each stage; the last (extension) stage ends at total_steps
    int total_steps, split_step;

    explicit Schedule(const Config& cfg) : c(cfg), total_steps(cfg.scheduled_iterations + cfg.extension_iterations) {
        // stage ends at round(cumulative duration * scheduled), Python's round (half to even)
        double cumulative = 0;
        starts.push_back(0);
        for (size_t i = 0; i + 1 < c.stages.size(); ++i) {
            cumulative += c.stages[i].duration;
            starts.push_back(static_cast<int>(std::nearbyint(cumulative * c.scheduled_iterations)));
        }
        // the split lands on an odd step, so that it is an Adam step
        split_step = starts[std::min<size_t>(c.split_embed_stage, starts.size() - 1)] | 1;
    }
    int stage_end(size_t i) const { return i + 1 < starts.size() ? starts[i + 1] : total_steps; }
    // The stage of `step` and how far through it the step is, in [0, 1].
    std::pair<const TrainingStage*, double> lookup(int step) const {
        for (size_t i = 0; i < starts.size(); ++i)
            if (step < stage_end(i))
                return {&c.stages[i], double(step - starts[i]) / double(stage_end(i) - starts[i])};
        return {&c.stages.back(), 1.0};
    }
    double lr(int step) const {
        return lr_schedule(step, lookup(step).first->lr_mul, c.scheduled_iterations, c.cooldown_frac, c.lr_floor);
    }
    double momentum(int step) const {
        return muon_momentum(step, total_steps, c.muon_warmup_steps, c.muon_cooldown_steps, c.muon_momentum_min,
                             c.muon_momentum_max);
    }
    // Multi-token-prediction weights, interpolated over the stage (computed in double, used as fp32).
    std::vector<float> mtp_weights(int step) const {
        const auto [stage, t] = lookup(step);
        std::vector<float> w;
        for (size_t k = 0; k < stage->mtp_start.size(); ++k)
            w.push_back(static_cast<float>(stage->mtp_start[k] + (double(stage->mtp_end[k]) - stage->mtp_start[k]) * t));
        return w;
    }
    // Record 88's prefix weight, interpolated as the MTP weights are (upstream: a Python float, then an fp32 tensor).
    float prefix_weight(int step) const {
        const auto [stage, t] = lookup(step);
        return static_cast<float>(stage->prefix_start + (double(stage->prefix_end) - stage->prefix_start) * t);
    }
    // What a step uploads with its batch (runtime/batch_producer.h): the MTP weights, then the prefix weight if any.
    std::vector<float> loss_weights(int step) const {
        std::vector<float> w = mtp_weights(step);
        if (c.prefix_loss) w.push_back(prefix_weight(step));
        return w;
    }
    std::vector<int> transition_steps() const { return {starts.begin() + 1, starts.end()}; }
};

// ============================================================================================
// The optimizer: upstream's NorMuonAndAdam with its param_table. NorMuon for the attention and
// MLP banks, Adam for the rest. Gradients are reduced on the comms stream (all-reduce for the
// replicated parameters, reduce-scatter or reduces for the sharded ones, most during the backward),
// updated in the work order as each lands, and sharded parameters are gathered back behind events.
// ============================================================================================


// This program's table, work order and registry checked against each other; stops naming the difference.
void check_param_table(const Config& c) {
    Params unplaced{};
    std::vector<std::string> registry, table, order;
    for (const ParamEntry& e : param_entries(c, unplaced)) registry.push_back(e.spec.name);
    for (const ParamRule& r : c.param_table) table.push_back(r.label);
    if (const std::string e = param_table_error(registry, table, c.work_order); !e.empty()) {
        std::fprintf(stderr, "train_gpt: config '%s': the parameter registry, param_table and work_order disagree: %s\n",
                     c.name.c_str(), e.c_str());
        std::exit(EXIT_FAILURE);
    }
}

int param_group(const Config& c, const std::string& label) {
    for (size_t i = 0; i < c.param_table.size(); ++i)
        if (label == c.param_table[i].label) return static_cast<int>(i);
    std::fprintf(stderr, "train_gpt: no parameter group '%s'\n", label.c_str());
    std::exit(EXIT_FAILURE);
}

// A parameter as the optimizer sees it: `rows` entries along dim 0 (NorMuon: matrices) of
// `row_elems` elements each; sharded parameters are split along dim 0.
struct ParamTensor {
    void *param, *grad;
    bool fp32;
    int64_t rows, row_elems;
    int mat_rows = 0, mat_cols = 0;  // NorMuon's matrix shape
    int per_layer = 0;               // a bank's matrices per layer (ParamSpec::per_layer)
};
// The registry entry of a table row, in the parameter and the gradient arena.
ParamTensor param_tensor(const Config& c, Params& p, Params& g, const ParamRule& rule) {
    const std::vector<ParamEntry> params = param_entries(c, p), grads = param_entries(c, g);
    for (size_t i = 0; i < params.size(); ++i) {
        const std::vector<int64_t>& shape = params[i].spec.shape;
        if (params[i].spec.name != std::string(rule.label)) continue;
        ParamTensor t{params[i].data, grads[i].data, params[i].fp32, shape[0], params[i].elems() / shape[0]};
        if (rule.optim == Optim::normuon) {
            t.mat_rows = int(shape.at(1));
            t.mat_cols = int(shape.at(2));
        }
        t.per_layer = params[i].spec.per_layer;
        return t;
    }
    std::fprintf(stderr, "train_gpt: param_table's '%s' is no registered parameter\n", rule.label);
    std::exit(EXIT_FAILURE);
}

// Per-step scalars of every group, uploaded in one copy (the kernels read them from the device).
struct OptimScalars {
    AdamStepScalars adam[kMaxParamGroups];
    NorMuonStepScalars normuon[kMaxParamGroups];
};

struct OptimGroup {
    ParamRule rule;
    ParamTensor t;
    Reduce reduce;                // the table's, with sparse falling back to after_backward where inactive
    bool distributed;             // communicates (world > 1)
    int64_t shard_rows;           // rows this rank updates
    void* grad_shard;             // what the reduction leaves for this rank's update
    float *exp_avg, *exp_avg_sq;  // Adam
    int adam_steps = 0;
    float *momentum, *second_moment, *matrix_lr_mul;  // NorMuon
    uint16_t* mantissa;
    std::vector<StateTensor> state;  // every tensor above that an optimizer step reads back
    cudaEvent_t reduced = nullptr, updated = nullptr;
    int64_t shard_elems() const { return shard_rows * t.row_elems; }
    size_t elem_bytes() const { return t.fp32 ? 4 : 2; }
    void* param_shard(int rank) const {
        return static_cast<char*>(t.param) + (shard_rows == t.rows ? 0 : rank * shard_elems() * elem_bytes());
    }
};

struct Optimizer {
    Arena arena{"optimizer"};
    int rank = 0, world = 1;
    std::vector<OptimGroup> group;  // the config's param_table, row by row
    bool split = false;            // embed untied from lm_head
    void* normuon_scratch;
    size_t normuon_scratch_bytes;
    OptimScalars* scalars;         // device
    OptimScalars* host_scalars;    // pinned, two copies: one may still be in flight
    cudaStream_t comms = nullptr;
    cudaEvent_t grads_ready = nullptr, comms_done = nullptr;
    // sparse bigram comms (8 ranks, no accumulation): rows touched since the last Adam step
    bool sparse = false;
    int sparse_max_touched = 0;
    void* sparse_buffer;
    std::unique_ptr<SparseRowExchange> exchange;  // its plans come with the batches (runtime/batch_producer.h)
    OptimGroup& operator[](const std::string& label) {
        for (OptimGroup& q : group)
            if (label == q.rule.label) return q;
        std::fprintf(stderr, "train_gpt: no parameter group '%s'\n", label.c_str());
        std::exit(EXIT_FAILURE);
    }
};

// A state tensor of group q from the optimizer's arena, registered in q.state.
template <class T>
T* take_state(Arena& a, OptimGroup& q, const char* name, std::vector<int64_t> shape) {
    T* p = a.take<T>(std::string("optim.") + q.rule.label + "." + name, shape);
    q.state.push_back({name, dtype_of<T>(), std::move(shape), p});
    return p;
}

// The optimizer's arena: Adam moments of each shard, NorMuon's momentum, second moment and
// mantissa, the reduced gradient shards, Polar Express scratch and the step scalars.
void layout_optimizer(Arena& a, Optimizer& o, const Config& c, Params& p, Params& g, bool sparse_active) {
    size_t scratch = 0;
    o.group.resize(c.param_table.size());
    for (size_t i = 0; i < c.param_table.size(); ++i) {
        OptimGroup& q = o.group[i];
        q.rule = c.param_table[i];
        q.t = param_tensor(c, p, g, q.rule);
        q.reduce = q.rule.reduce == Reduce::sparse && !sparse_active ? Reduce::after_backward : q.rule.reduce;
        q.distributed = o.world > 1;
        const bool sharded = is_sharded(q.reduce);
        q.shard_rows = sharded ? q.t.rows / o.world : q.t.rows;
        const std::string n = std::string("optim.") + q.rule.label + ".";
        q.grad_shard = q.t.grad;  // replicated: reduced in place; one rank: the gradient itself
        if (q.reduce == Reduce::sparse)  // the merge adds into the full gradient: its own slice
            q.grad_shard = static_cast<char*>(q.t.grad) + o.rank * q.shard_elems() * q.elem_bytes();
        else if (sharded && q.distributed)
            q.grad_shard = q.t.fp32 ? static_cast<void*>(a.take<float>(n + "grad_shard", {q.shard_rows, q.t.row_elems}))
                                    : static_cast<void*>(a.take<bf16>(n + "grad_shard", {q.shard_rows, q.t.row_elems}));
        q.state.clear();
        if (q.rule.optim == Optim::adam) {
            q.exp_avg = take_state<float>(a, q, "exp_avg", {q.shard_rows, q.t.row_elems});
            q.exp_avg_sq = take_state<float>(a, q, "exp_avg_sq", {q.shard_rows, q.t.row_elems});
        } else {
            const int count = static_cast<int>(q.shard_rows), r = q.t.mat_rows, cl = q.t.mat_cols;
            q.momentum = take_state<float>(a, q, "momentum", {q.shard_rows, q.t.row_elems});
            q.mantissa = take_state<uint16_t>(a, q, "mantissa", {q.shard_rows, q.t.row_elems});
            q.second_moment = take_state<float>(a, q, "second_moment", {q.shard_rows * normuon_second_moment_len(r, cl)});
            q.matrix_lr_mul = a.take<float>(n + "matrix_lr_mul", {count});
            scratch = std::max(scratch, normuon_scratch_bytes(count, r, cl));
        }
    }
    o.normuon_scratch_bytes = scratch;
    o.normuon_scratch = a.take_bytes("optim.normuon_scratch", scratch);
    if (sparse_active) {  // two steps' tokens per rank bound the rows touched between exchanges
        o.sparse_max_touched = std::min(c.bigram_vocab, 2 * c.max_train_tokens());
        o.sparse_buffer = a.take_bytes("optim.sparse_exchange", sparse_exchange_device_bytes(c.bigram_vocab, c.bigram_width(),
                                                                                             o.world, o.sparse_max_touched));
    }
    o.scalars = reinterpret_cast<OptimScalars*>(a.take_bytes("optim.step_scalars", sizeof(OptimScalars)));
}

// The layer structure as the communication schedule sees it: the tables of a tables group (one per
// value table).
int tables_at(const Structure& st, At place) { return place == At::value_table ? st.value_tables() : 1; }

// Per matrix of a bank at `place` with `per_layer` matrices per layer there (ParamSpec::per_layer: an
// attention bank's layers are the attention layers, mlp's every layer), the backward point that
// finishes its gradient; the padding after them (no kernel writes it) is final from the start and
// reduced with the first bucket.
std::vector<int> bank_ready_points(const Structure& st, At place, int per_layer, int matrices) {
    std::vector<int> ready(size_t(matrices), 0);
    for (int l = 0; l < st.layers; ++l) {
        if (place == At::attn && st.has_attention(l))
            for (int k = 0; k < per_layer; ++k)
                ready.at(size_t(per_layer * st.attn_index(l) + k)) = backward_point(place, l, st.layers);
        if (place == At::mlp)
            for (int k = 0; k < per_layer; ++k) ready.at(size_t(per_layer * l + k)) = backward_point(place, l, st.layers);
    }
    return ready;
}

// The backward's reductions and the forward's gathers on this rank, from the table: each group's
// buffers and events, the bucket plan of the banks (stops naming a world size that cannot own their
// whole matrices), the ranges emu's race detector names apart, and the gathers' events, recorded once:
// nothing gathered yet.
void build_comms(Model& m, Optimizer& o, const BucketComms& c, cudaStream_t s) {
    GradBuckets& g = m.buckets;
    g = {};
    g.c = c;
    m.gathered = {};
    for (size_t i = 0; i < o.group.size(); ++i) {
        const OptimGroup& q = o.group[i];
        const ParamRule& r = q.rule;
        const bool sharded = is_sharded(q.reduce);
        GroupComms gc;
        gc.label = r.label;
        gc.reduce = q.reduce;
        gc.place = sharded ? static_cast<int>(r.place) : -1;
        gc.every_step = r.optim == Optim::normuon;
        gc.reduced = q.reduced;
        if (sharded) {  // bf16, as every sharded group
            gc.grad = static_cast<const bf16*>(q.t.grad);
            gc.grad_shard = static_cast<bf16*>(q.grad_shard);
            gc.param = static_cast<bf16*>(q.t.param);
            gc.rows = q.t.rows, gc.shard_rows = q.shard_rows, gc.row_elems = q.t.row_elems;
            gc.piece_rows = q.t.rows / tables_at(m.cfg.structure, r.place);
        }
        if (q.reduce == Reduce::buckets) {
            gc.bank = static_cast<int>(g.banks.size());
            g.banks.push_back({r.label, bank_ready_points(m.cfg.structure, r.place, q.t.per_layer, static_cast<int>(q.t.rows))});
            g.bank_group.push_back(static_cast<int>(i));
            name_bank_layers(gc, q.t.per_layer);
        }
        if (q.reduce == Reduce::tables) name_tables(gc);
        g.group.push_back(gc);
        m.gathered.place.push_back(gc.place);
        m.gathered.event.emplace_back(size_t(sharded ? tables_at(m.cfg.structure, r.place) : 0));
        for (cudaEvent_t& e : m.gathered.event.back()) {
            CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
            CUDA_CHECK(record_event(e, s));
        }
    }
    build_bucket_plan(g);
}

// Places the optimizer for this rank and zeroes its state (as upstream's fresh optimizer).
void build_optimizer(Optimizer& o, Model& m, int rank, int world, bool sparse_active, ncclComm_t comm, cudaStream_t s) {
    o.rank = rank;
    o.world = world;
    o.sparse = sparse_active;
    check_param_table(m.cfg);
    place(o.arena, [&](Arena& a) { layout_optimizer(a, o, m.cfg, m.params, m.grads, sparse_active); });
    CUDA_CHECK(cudaMallocHost(&o.host_scalars, 2 * sizeof(OptimScalars)));
    CUDA_CHECK(cudaStreamCreateWithFlags(&o.comms, cudaStreamNonBlocking));
    if (sparse_active)
        o.exchange = std::make_unique<SparseRowExchange>(
            m.cfg.bigram_vocab, m.cfg.bigram_width(), o.sparse_max_touched, comm, o.comms, o.sparse_buffer,
            sparse_exchange_device_bytes(m.cfg.bigram_vocab, m.cfg.bigram_width(), world, o.sparse_max_touched));
    for (cudaEvent_t* e : {&o.grads_ready, &o.comms_done})
        CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    for (OptimGroup& q : o.group) {
        CUDA_CHECK(cudaEventCreateWithFlags(&q.reduced, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&q.updated, cudaEventDisableTiming));
        if (q.rule.optim != Optim::normuon) continue;
        std::vector<float> mul(q.shard_rows);  // c_proj matrices (odd global index of the MLP bank) take 2x
        for (int64_t i = 0; i < q.shard_rows; ++i)
            mul[i] = normuon_matrix_lr_mul(std::strcmp(q.rule.label, "mlp") == 0, int(rank * q.shard_rows + i));
        // waited for: `mul` is gone before the stream would get to the copy
        CUDA_CHECK(copy_async(q.matrix_lr_mul, mul.data(), mul.size() * sizeof(float), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(sync_stream(s, "matrix_lr_mul"));
    }
    build_comms(m, o, {rank, world, comm, o.comms, o.grads_ready}, s);
    CUDA_CHECK(sync_stream(s, "build_optimizer"));
}

void destroy_optimizer(Optimizer& o, Model& m) {
    o.exchange.reset();
    for (std::vector<cudaEvent_t>& group : m.gathered.event)
        for (cudaEvent_t& e : group) cudaEventDestroy(e), e = nullptr;
    for (OptimGroup& q : o.group)
        for (cudaEvent_t e : {q.reduced, q.updated}) cudaEventDestroy(e);
    for (cudaEvent_t e : {o.grads_ready, o.comms_done}) cudaEventDestroy(e);
    cudaStreamDestroy(o.comms);
    cudaFreeHost(o.host_scalars);
}

// Zeroes every state (upstream's reset after the warm-up restores the initial optimizer state).
void reset_optimizer(Optimizer& o, cudaStream_t s) {
    for (OptimGroup& q : o.group) {
        for (const StateTensor& t : q.state) CUDA_CHECK(memset_async(t.data, 0, t.bytes(), s));
        q.adam_steps = 0;
    }
    o.split = false;
}

inline ncclDataType_t nccl_type(const OptimGroup& q) { return q.t.fp32 ? ncclFloat32 : ncclBfloat16; }

// Starts the gradient reduction of one sharded group on the comms stream: reduce-scatter
// (average) into this rank's shard, or the sparse exchange of the touched rows (their indexes
// were uploaded with the step's batch). One rank has nothing to reduce.
void launch_reduce(Optimizer& o, OptimGroup& q, ncclComm_t comm) {
    if (q.reduce == Reduce::sparse)
        o.exchange->exchange_values(static_cast<bf16*>(q.t.grad), o.grads_ready);
    else if (q.distributed)
        NCCL_CHECK(reduce_scatter(q.t.grad, q.grad_shard, q.shard_elems(), nccl_type(q), ncclAvg, comm, o.comms));
    CUDA_CHECK(record_event(q.reduced, o.comms));
}

// The update of this rank's shard, on the compute stream once its reduction has landed.
void update_group(Model& m, Optimizer& o, OptimGroup& q, int index, cudaStream_t s) {
    CUDA_CHECK(wait_event(s, q.reduced));
    if (q.reduce == Reduce::sparse) o.exchange->merge(s);  // into q.grad_shard, the own slice
    if (q.rule.optim == Optim::adam) {
        AdamHyper h = adam_hyper(q.rule.beta1, q.rule.beta2, m.cfg.adam_eps);
        if (q.reduce == Reduce::sparse) h.grad_scale = 1.0f / static_cast<float>(o.world);  // merge summed it
        if (q.t.fp32)
            adam_step(static_cast<float*>(q.param_shard(o.rank)), q.exp_avg, q.exp_avg_sq,
                      static_cast<const float*>(q.grad_shard), q.shard_elems(), h, &o.scalars->adam[index], s);
        else
            adam_step(static_cast<bf16*>(q.param_shard(o.rank)), q.exp_avg, q.exp_avg_sq,
                      static_cast<const bf16*>(q.grad_shard), q.shard_elems(), h, &o.scalars->adam[index], s);
    } else {
        const NorMuonShard shard{static_cast<bf16*>(q.param_shard(o.rank)), static_cast<const bf16*>(q.grad_shard),
                                 q.momentum, q.second_moment, q.mantissa, q.matrix_lr_mul,
                                 static_cast<int>(q.shard_rows), q.t.mat_rows, q.t.mat_cols};
        normuon_step(*m.lt, shard, &o.scalars->normuon[index], static_cast<float>(1.0 - m.cfg.normuon_beta2),
                     o.normuon_scratch, o.normuon_scratch_bytes, s, m.cfg.normuon_numerics);
    }
}

// Gathers group i's updated shard (its table `table` where it has tables) to every rank on the comms
// stream, after the update, and records the event the next forward waits for.
void launch_gather(Model& m, Optimizer& o, int i, ncclComm_t comm, int table) {
    OptimGroup& q = o.group[i];
    if (!q.distributed || !is_sharded(q.reduce)) return;
    CUDA_CHECK(wait_event(o.comms, q.updated));
    if (q.reduce == Reduce::tables) broadcast_table(m.buckets, m.buckets.group[size_t(i)], table);
    else NCCL_CHECK(all_gather(q.param_shard(o.rank), q.t.param, q.shard_elems(), nccl_type(q), comm, o.comms));
    CUDA_CHECK(record_event(m.gathered.event[size_t(i)][size_t(table)], o.comms));
}

// At the untie step embed takes lm_head's Adam state: its moments transposed (lm_head is sharded
// along model_dim, embed along the vocabulary, so the moments are gathered first) and its step count.
void copy_lm_head_state_to_embed(Model& m, Optimizer& o, ncclComm_t comm, cudaStream_t s) {
    OptimGroup &lm = o["lm_head"], &em = o["embed"];
    const int64_t C = m.cfg.model_dim, V = m.cfg.padded_vocab;
    em.adam_steps = lm.adam_steps;
    for (auto [from, to] : {std::pair{lm.exp_avg, em.exp_avg}, std::pair{lm.exp_avg_sq, em.exp_avg_sq}}) {
        const float* whole = from;
        if (o.world > 1) {  // after the backward (and the previous transpose) is done with that memory
            CUDA_CHECK(join_stream(o.comms, o.grads_ready, s));
            NCCL_CHECK(all_gather(from, m.untie_scratch, lm.shard_elems(), ncclFloat32, comm, o.comms));
            CUDA_CHECK(join_stream(s, o.comms_done, o.comms));
            whole = m.untie_scratch;
        }
        // embed's rows [rank * shard, +shard) are lm_head's columns of the same range, transposed
        transpose(to, whole + o.rank * em.shard_rows, C, em.shard_rows, V, C, false, s);
    }
    o.split = true;
}

// The host values of this step's scalars (upstream's per-step lr, momentum and the Adam bias
// corrections), for every group that steps.
void fill_step_scalars(const Config& c, const Schedule& sch, Optimizer& o, int step, bool do_adam, OptimScalars& out) {
    const double lr = sch.lr(step), mu = sch.momentum(step);
    for (size_t i = 0; i < o.group.size(); ++i) {
        OptimGroup& q = o.group[i];
        const ParamRule& r = q.rule;
        if (r.optim == Optim::normuon) {
            const double shape_mul = normuon_shape_lr_mul(q.t.mat_rows, q.t.mat_cols);
            out.normuon[i] = normuon_step_scalars(c.normuon_lr, lr, shape_mul * r.lr_mul, c.normuon_wd, r.wd_mul, mu,
                                                  c.normuon_numerics.momentum);
        } else if (do_adam) {
            out.adam[i] = adam_step_scalars(c.adam_lr, lr, r.lr_mul, r.beta1, r.beta2, c.adam_wd, r.wd_mul, q.adam_steps + 1);
        }
    }
}

// Whether the backward launches q's reduction (reduce_final at its place), else optimizer_step does:
// the banks' buckets (one rank: none at all), and where there are ranks the tables and the at_place
// groups, but for the head's while tied (embed's gradient joins it after the backward).
bool reduced_by_backward(const OptimGroup& q, bool tied) {
    if (q.reduce == Reduce::buckets) return true;
    if (q.reduce == Reduce::at_place && tied && q.rule.place == At::head) return false;
    return q.distributed && (q.reduce == Reduce::tables || q.reduce == Reduce::at_place);
}

// The sharded groups by their gathers' turns (the table's order within a turn); while tied, lm_head
// takes embed's turn: the next forward makes embed from it first.
std::vector<int> gather_order(const Config& c, bool tied) {
    const std::vector<ParamRule>& table = c.param_table;
    auto turn = [&](int i) { return tied && i == param_group(c, "lm_head") ? table[param_group(c, "embed")].gather
                                                                            : table[i].gather; };
    std::vector<int> order;
    for (int i = 0; i < static_cast<int>(table.size()); ++i)
        if (is_sharded(table[i].reduce)) order.push_back(i);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return turn(a) < turn(b); });
    return order;
}

// One optimizer step (upstream's NorMuonAndAdam.step and TrainingManager.step_optimizers): NorMuon
// every step, Adam on odd steps (its gradients accumulate over the even step before). While embed
// is tied, its gradient joins lm_head's (transposed), and the next forward copies embed back from
// lm_head as it makes lm_head's FP8 copies (refresh_lm_head_copies).
void optimizer_step(Model& m, Optimizer& o, const Schedule& sch, int step, ncclComm_t comm, cudaStream_t s) {
    const Config& c = m.cfg;
    const bool do_adam = step % 2 == 1, tied = !o.split;
    const int64_t C = c.model_dim, V = c.padded_vocab;
    const Range range("optimizer");
    auto steps = [&](const OptimGroup& q) {  // tied: embed is updated through lm_head
        return (q.rule.optim != Optim::adam || do_adam) && !(tied && std::strcmp(q.rule.label, "embed") == 0);
    };
    OptimScalars& host = o.host_scalars[step & 1];
    fill_step_scalars(c, sch, o, step, do_adam, host);
    CUDA_CHECK(copy_async(o.scalars, &host, sizeof host, cudaMemcpyHostToDevice, s));
    if (do_adam && tied)  // lm_head (C, V) += embed's gradient (V, C) transposed
        transpose(m.grads.lm_head, m.grads.embed, V, C, C, V, true, s);

    // reductions in the table's order, each as soon as the gradients are there; a run of small
    // all-reduces (the replicated groups) goes as one NCCL group
    CUDA_CHECK(join_stream(o.comms, o.grads_ready, s));
    std::vector<OptimGroup*> small_run;
    auto close_small_run = [&] {
        if (small_run.empty()) return;
        NCCL_CHECK(group_end());
        for (OptimGroup* q : small_run) CUDA_CHECK(record_event(q->reduced, o.comms));
        small_run.clear();
    };
    for (OptimGroup& q : o.group) {
        if (!steps(q) || reduced_by_backward(q, tied)) continue;
        if (q.distributed && q.reduce == Reduce::replicated) {
            if (small_run.empty()) NCCL_CHECK(group_start());
            NCCL_CHECK(all_reduce(q.t.grad, q.t.grad, q.shard_elems(), nccl_type(q), ncclAvg, comm, o.comms));
            small_run.push_back(&q);
            continue;
        }
        close_small_run();
        launch_reduce(o, q, comm);
    }
    close_small_run();
    for (const std::string& label : c.work_order) {
        const int i = param_group(c, label);
        OptimGroup& q = o.group[i];
        if (!steps(q)) continue;
        if (q.rule.optim == Optim::adam) ++q.adam_steps;
        update_group(m, o, q, i, s);
        CUDA_CHECK(record_event(q.updated, s));
    }
    if (do_adam) m.lm_head_fp8_stale = true, m.embed_stale = tied;
    m.mlp_fp8_stale = true;  // NorMuon stepped c_fc (and c_proj)
    m.mlp_fp8_down_scaling = mlp_down_scaling_after(c, step);
    // the gathers by their rows' turns (the next forward waits for each at its place)
    for (int i : gather_order(c, tied))
        if (steps(o.group[i]))
            for (size_t k = 0; k < m.gathered.event[size_t(i)].size(); ++k) launch_gather(m, o, i, comm, int(k));
    if (step == sch.split_step) copy_lm_head_state_to_embed(m, o, comm, s);
}

// ---- the memory plan: every arena of a rank for a config, measured without a device ----

MemoryPlan plan_memory(Model& m, Optimizer& o, int world) {
    layout_params(m.param_arena, m.cfg, m.params);
    layout_params(m.grad_arena, m.cfg, m.grads);
    layout_state(m.state_arena, m);
    layout_activations(m.act_arena, m);
    o.world = world;
    layout_optimizer(o.arena, o, m.cfg, m.params, m.grads, world == 8 && m.cfg.grad_accum() == 1);
    return {m.param_arena.bytes(), m.grad_arena.bytes(), m.state_arena.bytes(), m.act_arena.bytes(),
            o.arena.bytes(), CublasLt::kWorkspaceBytes};
}

// The optimizer's state by name, over every group's registered state tensors (q.state).
std::vector<StateTotal> optimizer_state_totals(const Optimizer& o) {
    std::vector<StateTotal> out;
    for (const OptimGroup& q : o.group) add_state_totals(out, q.state);
    return out;
}

// ranks: the world size planned for (8, or 1 for one GPU: its optimizer state unsharded, 8 micro-steps).
void print_memory_plan(const Config& c, FILE* f, int ranks) {
    if (const std::string e = config_error(c); !e.empty()) {
        std::fprintf(stderr, "train_gpt: %s\n", e.c_str());
        std::exit(EXIT_FAILURE);
    }
    Model m;
    m.cfg = c;
    m.cfg.world_size = ranks;
    Optimizer o;
    const MemoryPlan plan = plan_memory(m, o, ranks);
    std::fprintf(f, "memory plan per rank, preset %s (%d rank%s; %d train and %d eval tokens per micro-step):\n",
                 c.name.c_str(), ranks, ranks == 1 ? "" : "s", m.cfg.max_train_tokens(), m.cfg.val_micro_tokens());
    print_memory_breakdown(plan, m.param_arena, m.grad_arena, m.state_arena, m.act_arena, o.arena,
                           optimizer_state_totals(o), c.upstream_peak_mib, f);
}

// What the run allocates on the device: every arena and cuBLASLt's workspace (the log's peak line).
size_t allocated_bytes(const Model& m, const Optimizer& o) {
    return m.param_arena.bytes() + m.grad_arena.bytes() + m.state_arena.bytes() + m.act_arena.bytes() + o.arena.bytes() +
           CublasLt::kWorkspaceBytes;
}

// ============================================================================================
// The training run: upstream's main section. Schedule state, batches, validation, logging,
// checkpoints, the warm-up, the timed loop.
// ============================================================================================

// The schedule's state during a run (upstream's TrainingManager.advance_schedule).
struct ScheduleState {
    int ws_short = 0, ws_long = 0;  // blocks
    int64_t batch_tokens = 0;
};

// Host state of the run. A step never waits for the device: its batches come from the producer
// thread's pinned slots, its losses land in pinned rows read where needed (runtime/step_losses.h).
struct Run {
    Model& m;
    Optimizer& o;
    const Schedule& sch;
    const RunOptions& opt;
    Distributed& d;
    cudaStream_t s;
    Run(Model& model, Optimizer& optimizer, const Schedule& schedule, const RunOptions& options, Distributed& dist,
        cudaStream_t stream)
        : m(model), o(optimizer), sch(schedule), opt(options), d(dist), s(stream) {
        log.rank = dist.rank;
    }
    ScheduleState state;
    int n_predict = 1;              // MTP weights of the current step
    std::unique_ptr<BatchProducer> batches;
    std::unique_ptr<dataload::ValLoader> val;
    std::vector<int32_t> inputs, targets, cu, bigram;  // a validation micro-batch
    BatchUploader uploader;
    StepLosses losses;
    int* finite_flags = nullptr;  // device: one flag per buffer the finite check covers
    std::string first_nonfinite;  // CPU build: where a non-finite value first appeared
    LogSink log;
    // rank 0: the chain of runs this one belongs to (its first run's id), what a resume of its
    // checkpoints must match (runtime/startup_checks.h), and the checkpoint a resumed run continues
    std::string lineage;
    std::vector<std::pair<std::string, std::string>> facts;
    std::string resumes_run_id;
    int resumes_step = -1;
    std::vector<std::string> resume_warnings;
    StepHooks hooks, warmup_hooks;  // around each step of the run and of the warm-up: the step profiler's
    StepSchedule step_schedule() const {
        StepSchedule step_sch;
        step_sch.ws_short = state.ws_short * m.cfg.block_size;
        step_sch.ws_long = state.ws_long * m.cfg.block_size;
        step_sch.mtp_weights = m.mtp_weights;
        step_sch.n_predict = n_predict;
        if (m.prefix_table) step_sch.prefix = {m.prefix_table, m.mtp_weights + n_predict, dataload::kPrefixTableRows};
        return step_sch;
    }
};

// Rank 0 prints to the console and the log (runtime/log.h).
void print0(Run& r, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vprint(r.log, fmt, ap);
    va_end(ap);
}

void log_config(Run& r) {
    const Config& c = r.m.cfg;
    print0(r, "config %s: layers %d, model_dim %d, heads %d x %d, mlp %d, vocab %d (padded %d), bigram_vocab %d\n",
           c.name.c_str(), c.structure.layers, c.model_dim, c.num_heads, c.head_dim, c.mlp_dim, c.vocab_size, c.padded_vocab,
           c.bigram_vocab);
    print0(r, "  steps %d scheduled + %d extension, cooldown %.2f, split at step %d, block %d tokens, final long window %d\n",
           c.scheduled_iterations, c.extension_iterations, c.cooldown_frac, r.sch.split_step, c.block_size, c.final_ws_long);
    for (size_t i = 0; i < c.stages.size(); ++i) {
        const TrainingStage& st = c.stages[i];
        std::string mtp;
        for (size_t k = 0; k < st.mtp_start.size(); ++k)
            mtp += (k ? ", " : "") + std::to_string(st.mtp_start[k]).substr(0, 4) + "->" +
                   std::to_string(st.mtp_end[k]).substr(0, 4);
        if (c.prefix_loss)
            mtp += "], prefix [" + std::to_string(st.prefix_start).substr(0, 4) + "->" +
                   std::to_string(st.prefix_end).substr(0, 4);
        print0(r, "  stage %zu: from step %d, batch %lld tokens, documents cut at %d, windows (%d, %d), lr_mul %.2f, mtp [%s]\n",
               i, r.sch.starts[i], static_cast<long long>(st.batch_tokens), st.max_seq_len, st.ws_short, st.ws_long,
               st.lr_mul, mtp.c_str());
    }
    print0(r, "  adam lr %g eps %g wd %g; normuon lr %g beta2 %g wd %g, momentum %g->%g over %d steps, cool-down %d\n",
           c.adam_lr, c.adam_eps, c.adam_wd, c.normuon_lr, c.normuon_beta2, c.normuon_wd, c.muon_momentum_min,
           c.muon_momentum_max, c.muon_warmup_steps, c.muon_cooldown_steps);
    print0(r, "  world %d, grad_accum %d, val every %d steps on %lld tokens, train %s, val %s, seed %llu\n", r.d.world,
           c.grad_accum(), r.opt.val_every, static_cast<long long>(c.val_tokens), r.opt.train_files.c_str(),
           r.opt.val_files.c_str(), static_cast<unsigned long long>(r.opt.seed));
}

// What follows the source: the environment, the header lines and the config, then a rule.
void log_preamble(Run& r) {
    log_environment(r.log, r.d);
    log_header(r.log, r.d, {r.opt.command, r.m.cfg.name, r.opt.seed, r.opt.run_id, r.resumes_run_id, r.resumes_step});
    log_config(r);
    print0(r, "%s\n", std::string(100, '=').c_str());
}

// ---- non-finite values: where the first one is (runtime/finite.h scans the buffers) ----

// The first parameter group (table order) holding a non-finite parameter or gradient, or "".
std::string nonfinite_group(Run& r) {
    for (const OptimGroup& q : r.o.group)
        for (const auto& [what, ptr] : {std::pair{"parameter", q.t.param}, std::pair{"gradient", q.t.grad}})
            if (has_nonfinite(ptr, q.t.rows * q.t.row_elems, q.t.fp32)) return std::string(what) + " " + q.rule.label;
    return "";
}

// The CPU build scans every step, so a failure names where the first non-finite value appeared
// (a GPU run cannot afford the copies; it only stops).
void watch_nonfinite(Run& r, int step) {
    if (!kEmulated || !r.first_nonfinite.empty()) return;
    await_all_gathered(r.m.gathered, r.s);  // the scan reads every rank's rows
    if (const std::string g = nonfinite_group(r); !g.empty())
        r.first_nonfinite = g + " (non-finite before step " + std::to_string(step) + ")";
}

// This rank's parameters and optimizer state by group, in table order: what a checkpoint holds
// (the Adam gradients only while they are state: after an even step). NorMuon's mantissa is
// integer bits, not a float.
std::vector<StateBuffer> state_buffers(const Run& r, int step) {
    std::vector<StateBuffer> out;
    for (const OptimGroup& q : r.o.group) {
        const std::string label = q.rule.label;
        const int64_t full = q.t.rows * q.t.row_elems;
        out.push_back({"param." + label, q.t.param, full, q.t.fp32});
        for (const StateTensor& t : q.state)
            if (t.dtype == DType::f32) out.push_back({t.name + ("." + label), t.data, t.elems(), true});
        if (q.rule.optim == Optim::adam && step % 2 == 1) out.push_back({"grad." + label, q.t.grad, full, q.t.fp32});
    }
    return out;
}
constexpr int kMaxStateBuffers = 4 * kMaxParamGroups;  // the finite check's device flags (Run::finite_flags)

// Where the first non-finite parameter or optimizer state of any rank is, as "exp_avg.scalars on
// rank 1", or "" when all are finite. Collective.
std::string nonfinite_state(Run& r, int step) {
    await_all_gathered(r.m.gathered, r.s);
    const std::vector<StateBuffer> bufs = state_buffers(r, step);
    if (bufs.size() > size_t(kMaxStateBuffers))  // a group registered more float state than the flags hold
        fail("the finite check covers " + std::to_string(bufs.size()) + " buffers; raise kMaxStateBuffers (" +
             std::to_string(kMaxStateBuffers) + ")");
    return first_nonfinite(bufs, r.finite_flags, r.d.world, r.d.rank, r.s);
}

// Stops the run when a parameter or optimizer state holds a NaN or an infinity (at `step`, `when`).
void check_finite(Run& r, int step, const char* when) {
    if (const std::string where = nonfinite_state(r, step); !where.empty())
        fail("non-finite values in " + where + " at step " + std::to_string(step) + " (" + when + ")");
}

// The training losses of the steps before `step` (runtime/step_losses.h): each checked for a NaN or
// an infinity once it has landed (polled, no wait; `wait`: all of them now, at a validation, a save
// or the end), then the loss of step - 1 printed where --log-train-loss asks (the mean per token
// over every rank: the run's only MPI call between steps, there only). A failure names the step
// whose loss went bad, numbered as the log numbers it.
void check_step_losses(Run& r, int step, bool wait) {
    StepLosses& l = r.losses;
    for (int s = l.checked; s < step; ++s) {
        const bool due = wait || s + StepLosses::kSteps <= step || (r.opt.log_train_loss && s + 1 == step);
        if (!l.landed(s, due)) break;
        if (const double loss = l.sum(s); !std::isfinite(loss)) {
            const std::string where = kEmulated ? r.first_nonfinite : "(the CPU build names the parameter group)";
            fail("the training loss became " + std::string(std::isnan(loss) ? "NaN" : "infinite") + " at step " +
                 std::to_string(s + 1) + "; first non-finite: " + (where.empty() ? "the loss itself" : where));
        }
        l.checked = s + 1;
    }
    if (!r.opt.log_train_loss || step <= l.first || l.checked < step) return;
    const double sum = l.sum(step - 1);
    const double all = host_sum(sum);
    print0(r, "step:%d/%d train_loss:%.4f\n", step, r.sch.total_steps,
           all / double(r.sch.lookup(step - 1).first->batch_tokens));
}

// ---- checkpoints: one file per rank, DIR/stepNNNNNN/rankR.safetensors (runtime/checkpoint_io.h) ----

// Everything the next step depends on: the parameters (rank 0; every rank holds the same), this
// rank's optimizer state, the Adam gradients accumulated over an even step, and the counters.
// The data position and YaRN follow from the step: a resume replays the loader and the schedule.
// Nothing is written when any rank's parameters or optimizer state hold a non-finite value.
// The manifest also names the chain of runs the directory belongs to (`lineage`) and what a resume
// must match to continue the same computation (r.facts: the schedule, the data, the kernels).
// `training_ms`: the run's training time up to this step, in the log's line for scripts/stats.py.
void save_checkpoint(Run& r, int step, double training_ms) {
    refresh_lm_head_copies(r.m, r.s);  // a tied embed follows the last Adam step's lm_head
    await_all_gathered(r.m.gathered, r.s);
    CUDA_CHECK(cudaStreamSynchronize(r.s));
    check_finite(r, step, "before saving a checkpoint");
    const std::string save_id = new_save_id();
    CheckpointMeta meta = {{"format", "train_gpt checkpoint 1"}, {"preset", r.m.cfg.name},
                           {"step", std::to_string(step)},       {"world_size", std::to_string(r.d.world)},
                           {"rank", std::to_string(r.d.rank)},   {"seed", std::to_string(r.opt.seed)},
                           {"run_id", r.opt.run_id},              {"save_id", save_id},
                           {"split_embed", r.o.split ? "1" : "0"}};
    std::vector<CheckpointTensor> tensors;
    const bool pending_adam_grads = step % 2 == 1;  // the even step's gradients wait for this odd step
    for (const OptimGroup& q : r.o.group) {
        const std::string label = q.rule.label;
        const char* dt = q.t.fp32 ? "F32" : "BF16";
        const size_t full = size_t(q.t.rows * q.t.row_elems) * q.elem_bytes();
        if (r.d.rank == 0) tensors.push_back({"param." + label, dt, {q.t.rows, q.t.row_elems}, q.t.param, full});
        for (const StateTensor& t : q.state)
            tensors.push_back({t.name + ("." + label), safetensors_dtype(t.dtype), t.shape, t.data, t.bytes()});
        if (q.rule.optim == Optim::adam) {
            meta.push_back({"adam_steps." + label, std::to_string(q.adam_steps)});
            if (pending_adam_grads) tensors.push_back({"grad." + label, dt, {q.t.rows, q.t.row_elems}, q.t.grad, full});
        }
    }
    // record 83's sign table is a buffer, as in upstream's state dict: a reader of the file (the references, the
    // comparison with upstream's code) takes the very table the run trained with
    if (r.d.rank == 0 && r.m.bigram_signs) tensors.push_back(sign_table_tensor(r.m));
    // record 89's scales, this rank's (its act is its own); the quantization they feed is the next forward's
    if (r.m.cfg.mlp_down_fp8) tensors.push_back(mlp_down_scales_tensor(r.m));
    CheckpointMeta manifest = {{"format", "train_gpt manifest 1"},  {"preset", r.m.cfg.name},
                               {"step", std::to_string(step)},      {"world_size", std::to_string(r.d.world)},
                               {"seed", std::to_string(r.opt.seed)}, {"run_id", r.opt.run_id},
                               {"save_id", save_id},                {"lineage", r.lineage}};
    manifest.insert(manifest.end(), r.facts.begin(), r.facts.end());
    std::string dir;
    try {
        dir = write_checkpoint(r.opt.save_dir, step, r.d.rank, r.d.world, meta, tensors, manifest);
    } catch (const std::exception& e) {
        fail(e.what());
    }
    print0(r, "saved checkpoint %s step:%d train_time:%.0fms\n", dir.c_str(), step, training_ms);
}

// Loads the checkpoint in `dir` (a stepNNNNNN directory a run of the same preset, world size and
// seed saved), verified against its manifest and tensor by tensor against this run's dtypes and
// shapes; returns its step.
int load_checkpoint(Run& r, const std::string& dir) {
    try {
        const OpenCheckpoint f = open_checkpoint(dir, r.d.rank, {r.m.cfg.name, r.d.world, r.opt.seed},
                                                 r.opt.resume_unverified, r.log);
        r.o.split = f.mine.meta("split_embed") == "1";
        r.m.lm_head_fp8_stale = true, r.m.embed_stale = false;  // a saved embed is lm_head's already while tied
        r.m.mlp_fp8_stale = true;
        for (OptimGroup& q : r.o.group) {
            const std::string label = q.rule.label;
            const char* dt = q.t.fp32 ? "F32" : "BF16";
            const std::vector<int64_t> whole = {q.t.rows, q.t.row_elems};
            const size_t full = size_t(q.t.rows * q.t.row_elems) * q.elem_bytes();
            read_tensor(f.first, {"param." + label, dt, whole, q.t.param, full});
            for (const StateTensor& t : q.state)
                read_tensor(f.mine, {t.name + ("." + label), safetensors_dtype(t.dtype), t.shape, t.data, t.bytes()});
            if (q.rule.optim == Optim::adam) {
                q.adam_steps = std::stoi(f.mine.meta("adam_steps." + label));
                if (f.step % 2 == 1) read_tensor(f.mine, {"grad." + label, dt, whole, q.t.grad, full});
            }
        }
        if (r.m.bigram_signs) read_tensor(f.first, sign_table_tensor(r.m));
        if (r.m.cfg.mlp_down_fp8) {  // the quantization after step f.step - 1 is still to come
            read_tensor(f.mine, mlp_down_scales_tensor(r.m));
            r.m.mlp_fp8_down_scaling = mlp_down_scaling_after(r.m.cfg, f.step - 1);
        }
        return f.step;
    } catch (const std::exception& e) {
        fail("cannot resume from " + dir + ": " + e.what());
    }
}

// Applies the schedule of `step`: windows (YaRN follows the long window), batch size, MTP weight count.
void advance_schedule(Run& r, int step) {
    const auto [stage, t] = r.sch.lookup(step);
    (void)t;
    r.state.ws_short = stage->ws_short;
    if (stage->ws_long != r.state.ws_long)
        yarn_rope_apply(r.m.rope, r.state.ws_long * r.m.cfg.block_size, stage->ws_long * r.m.cfg.block_size, r.s);
    r.state.ws_long = stage->ws_long;
    r.state.batch_tokens = stage->batch_tokens;  // the loader follows the schedule in the batch producer
    r.n_predict = static_cast<int>(r.sch.mtp_weights(step).size());  // the weights come with the step's batch
}

// The schedule as at the start of a run: stage 0's windows and batch, YaRN reset.
void reset_schedule(Run& r) {
    const TrainingStage& first = r.m.cfg.stages.front();
    r.state = {first.ws_short, first.ws_long, first.batch_tokens};
    yarn_rope_reset(r.m.rope, r.s);
}

// The host buffers a validation micro-batch is read into and the pinned rows of the steps' losses
// (the training batches are the producer's: runtime/batch_producer.h).
void allocate_host_buffers(Run& r) {
    const Config& c = r.m.cfg;
    const int T = c.val_micro_tokens();
    r.inputs.resize(T);
    r.targets.resize(T);
    r.bigram.resize(T);
    r.cu.resize(size_t(c.max_docs.capacity(T)));
    r.losses.allocate(c.grad_accum());
}

// The next validation micro-batch onto the device.
void load_val_batch(Run& r) {
    dataload::BatchBuffers buf{r.inputs.data(), r.targets.data(), r.cu.data(), r.bigram.data(),
                               static_cast<int64_t>(r.inputs.size()), static_cast<int64_t>(r.cu.size())};
    const dataload::Batch batch = r.val->next(buf);
    if (const std::string e = vocabulary_error(batch, r.inputs.data(), r.targets.data(), r.m.cfg.vocab_size, r.val->files(),
                                               r.d.rank);
        !e.empty())
        fail(e);
    r.uploader.upload(r.m.eval_batch, r.m.cfg.tokens(), r.inputs.data(), r.targets.data(), r.cu.data(),
                      static_cast<int>(batch.cu_entries), r.bigram.data(), static_cast<int>(batch.num_tokens), r.s);
}

// The shapes of the training micro-batches, and the schedule's batch of each step of `steps`, as the
// batch producer follows them.
BatchShape batch_shape(const Config& c) { return {c.max_train_tokens(), c.grad_accum(), c.max_docs, c.tokens()}; }
std::vector<StepBatch> step_batches(const Schedule& sch, const std::vector<int>& steps) {
    std::vector<StepBatch> out;
    for (int step : steps) {
        const TrainingStage& st = *sch.lookup(step).first;
        out.push_back({st.batch_tokens, st.max_seq_len, sch.loss_weights(step)});
    }
    return out;
}

// The training batches of `steps` from a fresh loader (from the data's start), made by the producer
// thread; those of steps before first_made are walked, not made (a resumed run's position). The
// sparse bigram exchange's plans come with them where it is active. Losses are checked from first_made.
void start_batches(Run& r, BatchSchedule plan, int repeat = 1) {
    const Config& c = r.m.cfg;
    r.batches.reset();  // its thread stops before the new loader opens
    dataload::TrainLoader::Options lo;
    lo.bigram_vocab = c.bigram_vocab;
    lo.repeat = repeat;
    lo.max_docs = c.max_docs;
    const TrainingStage& first = *r.sch.lookup(plan.steps.empty() ? 0 : plan.steps.front()).first;
    auto loader = std::make_unique<dataload::TrainLoader>(r.opt.train_files, r.d.rank, r.d.world, first.batch_tokens,
                                                          first.max_seq_len, c.grad_accum(), lo);
    const SparsePlanning sparse = r.o.sparse ? SparsePlanning{r.d.world, r.o.sparse_max_touched, c.bigram_vocab}
                                             : SparsePlanning{};
    r.losses.checked = r.losses.first = plan.first_made;
    r.batches = std::make_unique<BatchProducer>(batch_shape(c), std::move(loader), r.d.rank, sparse, r.m.batch.packed_ints,
                                                plan, step_batches(r.sch, plan.steps));
}

// The next training micro-batch onto the device, with the step's MTP weights and the sparse
// exchange's plan: copies on the stream from the slot's pinned memory, the slot's event after them,
// the slot back to the producer. No host wait.
void upload_next_batch(Run& r, int step, int micro) {
    BatchSlot& s = r.batches->next(step, micro);
    if (s.n_mtp > 0)
        CUDA_CHECK(copy_async(r.m.mtp_weights, s.mtp, s.n_mtp * sizeof(float), cudaMemcpyHostToDevice, r.s));
    if (s.has_plan) r.o.exchange->begin(s.plan, r.s);
    upload_batch(r.m.batch, *s.image, r.s);
    r.batches->issued();
}

// A resumed run reaches the checkpoint's YaRN state by replaying the schedule (host work only) up
// to `step`, and the data position (and the sparse exchange's touched rows) by a producer that
// walks the loader through the steps before it.
void replay_to(Run& r, int step, int last) {
    for (int st = 0; st < step; ++st) advance_schedule(r, st);
    start_batches(r, {step_range(0, last), step});
}

// --dump-batches N: rank 0 prints the first N steps' batches of every rank as the loader makes them
// (what tests/data compares with upstream's loader), through the schedule's batch-size changes.
void dump_batches_mode(const Config& cfg, int64_t batches, const DataFiles& files, Distributed& d) {
    agree_or_exit(d, d.rank == 0 ? shard_error("training data", files.train, files.train_default, files.remedy) : "");
    if (d.rank != 0) return;
    dataload::DumpConfig dc;
    dc.files = files.train;
    dc.world_size = d.world;
    dc.grad_accum = cfg.grad_accum();
    dc.batch_tokens = cfg.stages.front().batch_tokens;
    dc.max_seq_len = cfg.stages.front().max_seq_len;
    dc.bigram_vocab = cfg.bigram_vocab;
    dc.max_docs = cfg.max_docs;
    dc.batches = batches;
    const Schedule sch(cfg);
    for (size_t k = 1; k < cfg.stages.size(); ++k) {
        const TrainingStage &st = cfg.stages[k], &before = cfg.stages[k - 1];
        if ((st.batch_tokens != before.batch_tokens || st.max_seq_len != before.max_seq_len) && sch.starts[k] < batches)
            dc.changes.push_back({sch.starts[k], st.batch_tokens, st.max_seq_len});
    }
    try {
        dataload::dump_batches(stdout, dc);
    } catch (const std::exception& e) {
        fail(e.what());
    }
}

// Rank 0's gradient norms (its own micro-steps, before any reduction or tying), one line. The other
// ranks read nothing: copying every gradient to the host is a stream wait and a host pass per group.
void log_grad_norms(Run& r, int step) {
    if (r.d.rank != 0) return;
    std::string line;
    for (const OptimGroup& q : r.o.group) {
        double sum = 0;
        for (float x : host_values(q.t.grad, q.t.rows * q.t.row_elems, q.t.fp32, r.s)) sum += double(x) * x;
        char item[96];
        std::snprintf(item, sizeof item, " %s:%.6e", q.rule.label, std::sqrt(sum));
        line += item;
    }
    print0(r, "step:%d/%d grad_norms%s\n", step + 1, r.sch.total_steps, line.c_str());
}

// One training step: grad_accum micro-steps of forward and backward, then the optimizer. The
// loss of each micro-step lands in r.losses when the stream gets there; no host wait.
void train_step(Run& r, int step) {
    if (r.hooks.before) r.hooks.before(step);
    const StepSchedule step_sch = r.step_schedule();
    const bool adam_step = step % 2 == 1;
    for (int i = 0; i < r.m.cfg.grad_accum(); ++i) {
        upload_next_batch(r, step, i);  // with the sparse exchange's plan on an Adam step
        gpt_forward(r.m, r.m.batch, step_sch, r.m.train, r.s);
        r.losses.copy(step, i, r.m.loss, r.s);
        // Adam's parameters keep the even step's gradients for the odd step's update
        const bool last = i + 1 == r.m.cfg.grad_accum();
        gpt_backward(r.m, r.m.batch, step_sch,
                     {.accumulate_matrices = i > 0, .accumulate_others = i > 0 || adam_step, .last_micro_step = last,
                      .adam_final = last && adam_step, .embed_tied = !r.o.split},
                     r.s);
    }
    if (r.opt.log_grad_norms) log_grad_norms(r, step);
    optimizer_step(r.m, r.o, r.sch, step, r.d.comm, r.s);
    if (r.hooks.after) r.hooks.after(step);
}

// ---- the run as the step profiler (profiler/) sees it: the schedule as data, the processes, and the
// few things a --plan-step recording asks of the trainer ----

ScheduleFacts schedule_facts(const Config& c) {
    const Schedule sch(c);
    ScheduleFacts f{{}, sch.split_step, c.grad_accum(), c.bigram_vocab};
    for (size_t i = 0; i < sch.starts.size(); ++i)
        f.stages.push_back({sch.starts[i], sch.stage_end(i), c.stages[i].batch_tokens, c.stages[i].max_seq_len});
    return f;
}

ProfilerRanks profiler_ranks(const Distributed& d) { return {d.rank, d.world, host_gather, host_gatherv, fail}; }

PlanTrainer plan_trainer(Run& r) {
    PlanTrainer t;
    t.reset_schedule = [&r] { reset_schedule(r); };
    t.advance_schedule = [&r](int step) { advance_schedule(r, step); };
    t.start_batches = [&r](int first, int end, int repeat) { start_batches(r, {step_range(first, end), first}, repeat); };
    t.as_in_a_run = [&r](int step) {
        r.o.split = step > r.sch.split_step;  // embed is tied until the untie step
        // an even step's forward remakes lm_head's copies (embed too while tied) after the Adam step before it
        r.m.lm_head_fp8_stale = step % 2 == 0;
        r.m.mlp_fp8_stale = true;  // every step's NorMuon update changes c_fc
        r.m.mlp_fp8_down_scaling = mlp_down_scaling_after(r.m.cfg, step - 1);
        r.m.embed_stale = step % 2 == 0 && step > 0 && step - 1 <= r.sch.split_step;
    };
    t.train_step = [&r](int step) { train_step(r, step); };
    t.producer_ms = [&r] { return std::make_pair(r.batches->ms_per_batch(), r.batches->sparse_ms_per_batch()); };
    return t;
}

// --plan-step's start, before the model is built: its data (the preset's, or the committed Tiny
// Shakespeare shard where that is absent), the dry run, and no log or checkpoint.
PlanData start_plan(RunOptions& opt, const Config& c, const DataFiles& f, const Distributed& d) {
    const std::string fallback = repo_dir() + "/" + tiny_preset().train_files;
    const PlanData data =
        start_plan_step(schedule_facts(c),
                        {f.train, f.train_default ? shard_error("training data", f.train, true, "") : "", fallback,
                         shard_error("training data", fallback, true, "python3 data/prepare_tinyshakespeare.py")},
                        profiler_ranks(d));
    opt.train_files = data.files;
    opt.save_dir.clear();
    opt.checkpoint_steps.clear();
    opt.log_grad_norms = false;
    return data;
}

// --profile-steps and --profile-warmup: the step profiler's hooks around the steps they name.
void install_step_profiler(Run& r, const CostModel& model) {
    const ProfiledRun run{r.d.world, model, [&r](const std::string& line) { print0(r, "%s", line.c_str()); }};
    if (r.opt.profile_steps.first >= 0)
        r.hooks = step_profile_hooks(run, [range = r.opt.profile_steps](int step) { return range.contains(step); }, {});
    const auto warmup_label = [&r, facts = schedule_facts(r.m.cfg)](int step) {
        return warmup_step_label(facts, step, {r.state.batch_tokens, r.state.ws_short, r.state.ws_long, !r.o.split});
    };
    if (r.opt.profile_warmup) r.warmup_hooks = step_profile_hooks(run, [](int) { return true; }, warmup_label);
}

// Mean validation loss over val_tokens (upstream: every rank's mean, averaged), with the
// schedule's windows; `final` extends the long window as upstream's last validation does.
double validate(Run& r, bool final) {
    const Config& c = r.m.cfg;
    StepSchedule step_sch = r.step_schedule();
    if (final) step_sch.ws_long = c.final_ws_long * c.block_size;  // YaRN is not re-applied for it
    refresh_lm_head_copies(r.m, r.s);  // a tied embed follows the last Adam step's lm_head
    r.val->rewind();
    const int64_t steps = c.grad_accum() * c.val_tokens / c.val_batch_tokens;
    double sum = 0;
    for (int64_t i = 0; i < steps; ++i) {
        load_val_batch(r);
        gpt_forward(r.m, r.m.eval_batch, step_sch, r.m.eval, r.s);
        float loss;
        CUDA_CHECK(copy_async(&loss, r.m.loss, sizeof loss, cudaMemcpyDeviceToHost, r.s));
        CUDA_CHECK(sync_stream(r.s, "val_loss"));
        sum += loss;
    }
    return host_sum(sum) / double(steps) / r.d.world;
}

// Upstream's warm-up: the steps around every schedule change (and an eval forward at each), so
// that every shape is seen once; then the initial state comes back exactly.
void warm_up(Run& r) {
    std::vector<int> steps = {0, 1};
    for (int t : r.sch.transition_steps())
        for (int k = -2; k <= 1; ++k)
            if (t + k >= 0) steps.push_back(t + k);
    std::sort(steps.begin(), steps.end());
    steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
    std::string list;
    for (int st : steps) list += (list.empty() ? "" : ", ") + std::to_string(st);
    print0(r, "warming up on steps [%s]\n", list.c_str());
    std::vector<unsigned char> initial(r.m.param_arena.bytes());
    CUDA_CHECK(cudaMemcpy(initial.data(), r.m.param_arena.base(), initial.size(), cudaMemcpyDeviceToHost));
    start_batches(r, {steps, 0});
    const StepHooks run_hooks = std::exchange(r.hooks, r.warmup_hooks);
    for (int step : steps) {
        advance_schedule(r, step);
        load_val_batch(r);
        gpt_forward(r.m, r.m.eval_batch, r.step_schedule(), r.m.eval, r.s);
        train_step(r, step);
    }
    r.hooks = run_hooks;
    await_all_gathered(r.m.gathered, r.s);  // before the restore overwrites what they write
    CUDA_CHECK(sync_stream(r.s, "warm_up"));
    CUDA_CHECK(cudaMemcpy(r.m.param_arena.base(), initial.data(), initial.size(), cudaMemcpyHostToDevice));
    r.m.lm_head_fp8_stale = true, r.m.embed_stale = false;  // the restored embed is lm_head's already
    r.m.mlp_fp8_stale = true;
    reset_mlp_down_scales(r.m, r.s);  // upstream restores its persistent ones, then quantizes with bootstrap
    CUDA_CHECK(cudaMemset(r.m.grad_arena.base(), 0, r.m.grad_arena.bytes()));
    reset_optimizer(r.o, r.s);
    reset_schedule(r);
    r.batches.reset();  // the run's producer starts from the data's start again
    CUDA_CHECK(sync_stream(r.s, "warm_up"));
}

// Upstream's main loop: validation every val_every steps and at the end (the clock stopped), the
// training steps, one log line each.
void run_training(Run& r) {
    const Config& c = r.m.cfg;
    const int total = r.sch.total_steps;
    const int last = r.opt.max_steps >= 0 ? std::min(total, r.opt.max_steps) : total;
    r.val = std::make_unique<dataload::ValLoader>(r.opt.val_files, r.d.rank, r.d.world, c.val_batch_tokens,
                                                  c.grad_accum(), c.bigram_vocab, c.max_docs);
    reset_schedule(r);
    if (r.opt.warmup) warm_up(r);
    int start = 0;
    if (!r.opt.resume_dir.empty()) {
        start = load_checkpoint(r, r.opt.resume_dir);  // its step and identity were checked at startup
        if (start > last) fail("cannot resume from " + r.opt.resume_dir + ": its step " + std::to_string(start) +
                               " is beyond this run's last step " + std::to_string(last));
        print0(r, "resumed from %s at step %d\n", r.opt.resume_dir.c_str(), start);
        for (const std::string& w : r.resume_warnings) print0(r, "WARNING: resume: %s\n", w.c_str());
    }
    replay_to(r, start, last);
    auto wants_checkpoint = [&](int step) {
        if (r.opt.save_dir.empty() || step == start) return false;
        if (r.opt.checkpoint_steps.empty()) return step == last;
        return std::find(r.opt.checkpoint_steps.begin(), r.opt.checkpoint_steps.end(), step) !=
               r.opt.checkpoint_steps.end();
    };
    using clock = std::chrono::steady_clock;
    double training_ms = 0;
    CUDA_CHECK(sync_device("train_clock"));
    auto t0 = clock::now();
    auto elapsed_ms = [&] { return std::chrono::duration<double, std::milli>(clock::now() - t0).count(); };
    if (!r.opt.save_dir.empty() && start == 0 && std::find(r.opt.checkpoint_steps.begin(), r.opt.checkpoint_steps.end(),
                                                           0) != r.opt.checkpoint_steps.end())
        save_checkpoint(r, 0, 0);  // the initial state (the reference's starting point)
    for (int step = start; step <= last; ++step) {
        const bool validates = step == last || (r.opt.val_every > 0 && step % r.opt.val_every == 0);
        check_step_losses(r, step, validates || wants_checkpoint(step));  // no wait on other steps
        watch_nonfinite(r, step);
        advance_schedule(r, step);
        const bool final = step == total;
        // a step that validates and saves saves first: a failing validation (bad validation data, a
        // non-finite loss) must not cost the checkpoint of what was trained
        if (validates && wants_checkpoint(step)) {
            training_ms += elapsed_ms();
            save_checkpoint(r, step, training_ms);
            t0 = clock::now();
        }
        if (validates) {
            CUDA_CHECK(sync_device("train_clock"));
            training_ms += elapsed_ms();
            const double val_loss = validate(r, final);
            // step_avg: over the steps this run timed (a resumed run did not time those before it)
            print0(r, "step:%d/%d val_loss:%.4f train_time:%.0fms step_avg:%.2fms\n", step, total, val_loss, training_ms,
                   training_ms / std::max(step - start, 1));
            const std::string where = nonfinite_state(r, step);
            if (!std::isfinite(val_loss))
                fail("the validation loss became " + std::string(std::isnan(val_loss) ? "NaN" : "infinite") + " at step " +
                     std::to_string(step) + (where.empty() ? "" : "; non-finite values in " + where));
            if (!where.empty()) fail("non-finite values in " + where + " at step " + std::to_string(step) + " (at validation)");
            CUDA_CHECK(sync_device("train_clock"));
            t0 = clock::now();
        }
        if (wants_checkpoint(step) && !validates) {
            training_ms += elapsed_ms();
            save_checkpoint(r, step, training_ms);
            t0 = clock::now();
        }
        if (step == last) break;
        if (r.opt.check_finite > 0 && step % r.opt.check_finite == 0) {
            training_ms += elapsed_ms();
            check_finite(r, step, "--check-finite");
            t0 = clock::now();
        }
        train_step(r, step);
        const double approx_ms = training_ms + elapsed_ms();
        print0(r, "step:%d/%d train_time:%.0fms step_avg:%.2fms\n", step + 1, total, approx_ms,
               approx_ms / (step + 1 - start));
    }
    const size_t mib = allocated_bytes(r.m, r.o) / 1048576;
    print0(r, "peak memory allocated: %zu MiB reserved: %zu MiB\n", mib, mib);
    print0(r, "finished: steps %d..%d of %d, train_time:%.0fms\n", start, last, total, training_ms);
}

// ============================================================================================
// main
// ============================================================================================

// The shards of this config and command line (its remedy names the script that makes the preset's).
DataFiles data_files(const Config& c, const RunOptions& opt) {
    DataFiles f{opt.train_files, opt.val_files, opt.train_files.empty(), opt.val_files.empty(),
                c.name == "tiny" ? "python3 data/prepare_tinyshakespeare.py makes it"
                                 : "python3 data/cached_fineweb10B.py 9 downloads it"};
    if (f.train_default) f.train = c.train_files[0] == '/' ? c.train_files : repo_dir() + "/" + c.train_files;
    if (f.val_default) f.val = c.val_files[0] == '/' ? c.val_files : repo_dir() + "/" + c.val_files;
    return f;
}

// The command line's changes to the preset (schedule lengths, data, validation tokens), checked at
// once; opt gets the data files. Returns the run's last step.
int configure_run(Config& cfg, const CommandLine& cl, RunOptions& opt, DataFiles& files) {
    if (cl.scheduled > 0) cfg.scheduled_iterations = cl.scheduled;
    if (cl.extension >= 0) cfg.extension_iterations = cl.extension;
    files = data_files(cfg, opt);
    opt.train_files = files.train;
    opt.val_files = files.val;
    if (opt.val_tokens > 0) cfg.val_tokens = opt.val_tokens;
    if (cfg.val_tokens % cfg.val_batch_tokens != 0)
        usage_error("--val-tokens must be a multiple of the validation batch (" + std::to_string(cfg.val_batch_tokens) +
                    " tokens)");
    const int total_steps = cfg.scheduled_iterations + cfg.extension_iterations;
    const int last = opt.max_steps >= 0 ? std::min(total_steps, opt.max_steps) : total_steps;
    check_run_options(opt, last);
    return last;
}

// What the run's data must hold: the batches of its steps [0, last) and the validation tokens.
DataNeeds data_needs(const Config& c, int last) {
    const Schedule sch(c);
    DataNeeds n{c.vocab_size, c.bigram_vocab, c.grad_accum(), c.max_docs, c.stages.front().batch_tokens,
                c.stages.front().max_seq_len, {}, {}, c.val_batch_tokens, c.val_tokens};
    for (int step = 0; step < last; ++step) {
        const TrainingStage& st = *sch.lookup(step).first;
        n.step_batch_tokens.push_back(st.batch_tokens);
        n.step_max_seq_len.push_back(st.max_seq_len);
    }
    return n;
}


#ifndef TRAIN_GPT_NO_MAIN
int main(int argc, char** argv) {
    CommandLine cl = parse_command_line(argc, argv);
    if (cl.mode == Mode::help) {
        std::printf("%s", kUsage);
        return 0;
    }
    RunOptions& opt = cl.opt;
    const std::optional<Config> preset = preset_config(cl.preset);
    if (!preset) usage_error("unknown preset '" + cl.preset + "' (" + preset_names() + ")");
    Config cfg = *preset;
    if (cl.mode == Mode::print_memory) {
        print_memory_plan(cfg, stdout, cl.memory_ranks);
        return 0;
    }
    DataFiles files;
    const int last = configure_run(cfg, cl, opt, files);

    Distributed d = start_distributed(&argc, &argv);
    cfg.world_size = d.world;
    opt.run_id = rank0_string(opt.run_id);  // a random id is drawn on each rank: the run's is rank 0's
    if (const std::string e = config_error(cfg); !e.empty()) fail(e);
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    if (cl.mode == Mode::check_platform) {
        const HopperKernels selected{opt.attention.value_or(default_attention_kernel()),
                                     opt.mlp_kernel.value_or(default_mlp_kernel())};
        const int rc = platform_check(d.rank, d.world, d.comm, stream, selected);
        CUDA_CHECK(cudaStreamDestroy(stream));
        stop_distributed(d);
        return rc;
    }
    if (cl.mode == Mode::dump_batches) {
        dump_batches_mode(cfg, cl.dump_batches, files, d);
        CUDA_CHECK(cudaStreamDestroy(stream));
        stop_distributed(d);
        return 0;
    }

    // Startup checks, before anything is written: a resume's checkpoint, the data (rank 0 walks the
    // whole run's batches on a thread while the model is built), the output directories, the run id,
    // the checkpoint directory's owner, then every rank's write access to it.
    const bool planning = cl.mode == Mode::plan_step;
    CostModel model;  // the step profiler's, with the run's calibration: a bad file stops the run before any work
    if (planning || opt.profile_warmup || opt.profile_steps.first >= 0)
        if (const std::string e = calibrated_model(model, opt.calibration, repo_dir() + "/docs/gpu-runs/calibration.json",
                                                   d.world, 1);
            !e.empty())
            fail(e);
    const PlanData plan_data = planning ? start_plan(opt, cfg, files, d) : PlanData{};  // a dry run from here
    // rank 0: what the checkpoints record, and the checkpoint a resume continues (reads only its manifest)
    RunFacts facts;
    ResumePoint resume;
    if (d.rank == 0 && !planning)
        facts = run_facts(cfg.scheduled_iterations, cfg.extension_iterations, opt.train_files,
                          opt.attention.value_or(default_attention_kernel()), opt.mlp_kernel.value_or(default_mlp_kernel()));
    agree_or_exit(d, d.rank == 0 && !planning && !opt.resume_dir.empty()
                         ? resume_error(opt, cfg.name, d.world, last, facts, resume)
                         : "");
    std::future<std::string> data_check;
    if (d.rank == 0 && !planning)
        data_check = std::async(std::launch::async, data_error, data_needs(cfg, last), files, d.world);
    Model m;
    Optimizer o;
    const Schedule sch(cfg);
    build_model(m, cfg, opt.seed, stream, d.rank == 0 ? ParamsFrom::seed : ParamsFrom::rank0);
    if (opt.mlp_kernel) m.mlp_kernel = *opt.mlp_kernel;
    if (opt.attention) m.attention = *opt.attention;
    agree_or_exit(d, planning ? "" : wgmma_guard_error({m.attention, m.mlp_kernel}, stream));  // before any write
    broadcast_params(m, d.comm, stream);
    const bool sparse = d.world == 8 && cfg.grad_accum() == 1;
    build_optimizer(o, m, d.rank, d.world, sparse, d.comm, stream);
    const std::string log_path = opt.log_dir + "/" + opt.run_id + ".txt";
    agree_or_exit(d, d.rank == 0 && !planning ? data_check.get() : "");
    // the chain of runs the checkpoints belong to: a resume's (a checkpoint from before run ids: this run's)
    const std::string lineage = resume.lineage.empty() ? opt.run_id : resume.lineage;
    agree_or_exit(d, d.rank == 0 && !planning ? output_dirs_error(opt, log_path) : "");
    int checkpoint_lock = -1;  // held until exit: the checkpoint directory is this run's
    agree_or_exit(d, d.rank == 0 && !planning ? claim_checkpoint_dir(opt.save_dir, lineage, opt.run_id, checkpoint_lock) : "");
    agree_or_exit(d, checkpoint_dir_write_error(opt.save_dir));
    handle_stop_signals();

    Run r(m, o, sch, opt, d, stream);
    r.lineage = lineage;
    r.facts = facts;
    r.resumes_run_id = resume.run_id, r.resumes_step = resume.step;
    r.resume_warnings = resume.warnings;
    allocate_host_buffers(r);
    CUDA_CHECK(cudaMalloc(&r.finite_flags, kMaxStateBuffers * sizeof(int)));
    if (planning) {
        plan_step_mode(plan_trainer(r), schedule_facts(cfg), cfg.name, plan_data,
                       {cl.plan.json_path, cl.plan.trace_path, cl.plan.upstream, cl.plan.nodes,
                        {cfg.loss == SoftcapLoss::sigmoid ? UpstreamLoss::compiled_then_quantized : UpstreamLoss::fused_e5m2}},
                       model, profiler_ranks(d));
        stop_distributed(d);
        return 0;
    }
    install_step_profiler(r, model);
    if (d.rank == 0) open_log(r.log, log_path);
    log_preamble(r);  // collective: the log exists on every rank's return
    open_log_for_failures(d.rank, log_path);
    try {
        run_training(r);
    } catch (const std::exception& e) {  // data errors
        fail(e.what());
    }
    CUDA_CHECK(sync_stream(stream, "end_of_run"));
    close_log_for_failures();
    close_log(r.log);
    r.losses.release();
    CUDA_CHECK(cudaFree(r.finite_flags));
    r.batches.reset();
    destroy_optimizer(o, m);
    CUDA_CHECK(cudaStreamDestroy(stream));
    stop_distributed(d);
    return 0;
}
#endif
