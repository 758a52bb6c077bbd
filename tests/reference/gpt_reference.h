// An independent reference of the record's whole GPT (the modded-nanogpt record of 2026-02-06,
// "Sparse bigram gradient comms"): forward, training loss (FP8 lm_head, softcapped multi-token prediction) or
// evaluation loss, and a hand-written reverse-mode backward to every parameter. Plain C++ in
// double precision with loops; it shares nothing with kernels/, so that a model built from the
// kernels can be checked against it. Host code only (it also compiles under nvcc).
// Record 80's changes (upstream 2c702746) are Config switches whose defaults are record 71's:
// value_layers, ve_gate_reads_ve, sw_over_all_weights, and its residual stream (sublayer_lambdas,
// late_attn_source, lambdas_bf16). As for record 71, activations are not rounded to bf16: only the
// quantizations the model multiplies by (FP8 lm_head, FP8 MLP up-projection, bf16 stream lambdas) are
// reproduced.
// Record 82's XSA (upstream a333be08 L1125-1131) is the per-layer switch xsa (default off), with xsa_alpha_bf16.
// Records 83/84's bigram changes (upstream a333be08 L1390-1409, L1472-1476), defaults record 80's:
// - bigram_dim: the bigram embedding's width (0: C); every bigram injection adds into channels [0, bigram_dim).
// - bigram_sign_rows, bigram_sign_table: record 83's sign trick, a fixed +-1 table multiplying each bigram row.
// - x0_includes_bigram: record 84's aliasing, x0 (every later read of it) includes the pre-layer-0 bigram add.
// Record 81's MUDD (upstream a333be08 init_mudd/forward_mudd L1281-1330, its use L1438-1499) is the switch mudd:
// data-dependent coefficients (Params::mudd_w1, mudd_w2, mudd_b2) replace layer 10's lambdas and ve gate and
// the backout. Record 84's FP8 MLP up-projection (quantize_mlp_fp8 L1332-1343, L1479-1487) is mlp_up_fp8.
// Records 85-86 (upstream 003ff3e2 init_mudd_gate / forward_mudd_gate / unpack_*_mudd_gate L1365-1413, GPT.forward
// L1415-1602, dc_gate L1071-1079 and the attention's tail L1138-1158) are the switches mudd_gate and dc_mha: two more
// MUDD-form heads (Params::mudd_gate_*) whose per-token columns replace the output gates, XSA strengths, x0 and
// bigram lambdas and skip gate, and DC-MHA's cross-head mix on layer 10 (Config::dc_mha has its formulas).
// Record 88's prefix-token loss (upstream 75d6867a) is Config::prefix_weight with Batch::prefix_targets. Records 87
// (post-only ReLU^2: the same function) and 89 (FP8 down-projection with a delayed activation scale) are not here.
//
// Shapes (row-major): T tokens of one packed sequence, V padded vocab, C = H*D model width,
// F = 4C MLP hidden width, 11 layers. Parameters are held in upstream's shapes (Params).
//
// Layout facts that are easy to get wrong (each one reproduced as upstream's code does it):
// - Rotary positions are the index t in the packed sequence, not the position in the document.
// - Paired-head layers (0, 2, 5, 9) rotate head h of token t at position 2t + (h & 1) (upstream
//   rotates q viewed as (T, H/2, 2D)), then attend over the same memory read as (2T, H/2, D):
//   head h of token t becomes row 2t + h / (H/2), slot h % (H/2) of a doubled sequence with
//   doubled document bounds and the same window (in rows). With H = 6, slot s pairs heads s and
//   s+3, while the rotary parity follows h & 1.
// - The key offset (layers whose window equals the long window, non-paired only) and the smear
//   read the previous token across document boundaries.
#pragma once

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <utility>
#include <vector>

namespace ref {

constexpr int kLayers = 11;
constexpr int kAttnLayers = 10;     // layer 6 has no attention
constexpr int kValueTables = 5;     // value embeddings of layers 0, 1, 8, 9, 10
constexpr int kMlpBankLayers = 12;  // 11 layers + 1 padding entry
constexpr int kGateDim = 12;        // the leading channels that drive every gate
constexpr int kSkipFrom = 3, kSkipTo = 6, kBackoutLayer = 7;
constexpr double kRmsEps = FLT_EPSILON;  // F.rms_norm without eps on bf16 input (torch 2.10)
constexpr double kPi = 3.14159265358979323846;
constexpr double kSoftcapA = 23.0, kSoftcapB = 5.0, kSoftcapC = 7.5;  // z = A*sigmoid((l+B)/C)
constexpr double kXsaEps = 1e-4;  // XSA's F.normalize(v, eps=1e-4): v / max(|v|, eps)
// Record 81's MUDD (Config::mudd): two blocks, each h -> (gelu(h W1^T) W2^T + b2) * 0.1 with a 64-wide hidden
// layer; block 0 gives layer 10's 14 coefficients, block 1 the post-loop's 5. The stream snapshots it mixes
// are upstream's cache: h0 = layer 0's input, h3 = layer kSkipFrom's output, h7 = layer kBackoutLayer's
// output, h9 = layer 10's input.
constexpr int kMuddBlocks = 2, kMuddDim = 64;
constexpr double kMuddScale = 0.1;
// Block 0's coefficients, upstream's mu[j] at layer 10: v_mudd's three sources, the residual base r's three, the
// value embedding's gate for heads [0, H/2) and [H/2, H), then what replaces the layer's resid/post (attention),
// x0, bigram and resid/post (MLP) lambdas.
enum MuddLayerCoef {
    kMuV0, kMuV7, kMuV9, kMuR0, kMuR7, kMuR9, kMuGateLo, kMuGateHi,
    kMuResidAttn, kMuPostAttn, kMuX0, kMuBigram, kMuResidMlp, kMuPostMlp
};
// Block 1's, after layer 10: the weights of h0, h7, h9, value table 0's rows and h3 added to the stream.
enum MuddPostCoef { kMuPost0, kMuPost7, kMuPost9, kMuPostVe, kMuPost3 };
constexpr int kMuddCoefs = kMuPostMlp + 1, kMuddPostCoefs = kMuPost3 + 1;  // 14, 5
// Records 85-86's MUDD gate (Config::mudd_gate): gate 0 ("pre") from x0 with 26 columns, gate 1 ("post") from layer
// 4's input (h3) with 41, each (gelu(h Wg1^T) Wg2[:n]^T + bg2[:n]) * s with s = Params::mudd_gate_scale (0.1 at init).
// Upstream's layout (init_mudd_gate's comment, unpack_pre_mudd_gate / unpack_post_mudd_gate), for 6 heads:
//   pre:  [0, 6) XSA of layer 1, [6, 12) XSA of layer 3, [12, 18) layer 3's output gate, then (x0, bigram) pairs of
//         layers 0, 1, 2, 3 at 18, 20, 22, 24 (layer 0's bigram column: the add before layer 0)
//   post: [0, 6) XSA of layer 4, [6, 12) XSA of layer 7, [12, 18) layer 10's output gate, (x0, bigram) pairs of
//         layers 4, 5, 7, 8, 9 at 18, 20, 22, 24, 26, the skip's column 28, DC-MHA's w1 [29, 35) and w2 [35, 41)
constexpr int kGateHeads = 6;
constexpr int kGateCoefs[2] = {26, 41};
constexpr int kGateMaxCoefs = 41;
constexpr int kGatePostLayer = 4;  // the post gate is made at the top of this layer, from its input
constexpr int kGateSkipCol = 28, kGateDcW1Col = 29, kGateDcW2Col = 35;
constexpr double kXsaR86Eps = 1e-8;  // record 86's XSA: (y . v) / max(|v|^2, 1e-8)
constexpr int kDcLayer = 10;
constexpr double kDcRmsEps = 1e-6;   // dc_gate's F.rms_norm(eps=1e-6) over the heads
// Where a layer reads the MUDD gate (-1: no such reader): which gate, its XSA and output-gate columns (a column per
// head from there), its x0 and bigram columns. Written from upstream's literals, not computed from lists.
struct GateCols {
    int gate = -1, xsa = -1, out = -1, x0 = -1, bigram = -1;
};
inline GateCols gate_cols(int layer) {
    GateCols k;
    k.gate = layer < kGatePostLayer ? 0 : 1;
    if (layer < kGatePostLayer) {
        k.x0 = 18 + 2 * layer, k.bigram = k.x0 + 1;
        if (layer == 1) k.xsa = 0;
        if (layer == 3) k.xsa = 6, k.out = 12;
    } else {
        const int pair[kLayers] = {-1, -1, -1, -1, 18, 20, -1, 22, 24, 26, -1};
        k.x0 = pair[layer], k.bigram = pair[layer] < 0 ? -1 : pair[layer] + 1;
        if (layer == 4) k.xsa = 0;
        if (layer == 7) k.xsa = 6;
        if (layer == 10) k.out = 12;
    }
    return k;
}

// Record 71's fp32 `scalars` vector: resid lambdas (11), sa lambdas as (11, 2), bigram lambdas (11),
// smear, backout and skip lambdas, then padding. Config::scalar_slots() gives the layout in use
// (record 80's differs).
inline int scalar_resid(int layer) { return layer; }
inline int scalar_sa(int layer, int j) { return kLayers + 2 * layer + j; }
inline int scalar_bigram(int layer) { return 3 * kLayers + layer; }
constexpr int kScalarSmear = 4 * kLayers, kScalarBackout = 4 * kLayers + 1, kScalarSkip = 4 * kLayers + 2;
constexpr int kScalarsUsed = 4 * kLayers + 3;
// Record 80's (Config::sublayer_lambdas): sa lambdas as (11, 2), smear, backout, skip, then padding;
// its resid and bigram lambdas are tensors of their own (Params::resid_lambdas, bigram_lambdas).
constexpr int kScalarsUsedR80 = 2 * kLayers + 3;

// Offsets into `scalars` of one layout (-1: not in it).
struct ScalarSlots {
    int resid, sa, bigram;     // first entry of each per-layer group
    int smear, backout, skip;  // one each
    int used;                  // entries the model reads; the rest is padding
    int sa_of(int layer, int j) const { return sa + 2 * layer + j; }
};
constexpr ScalarSlots kSlotsR71{0, kLayers, 3 * kLayers, kScalarSmear, kScalarBackout, kScalarSkip, kScalarsUsed};
constexpr ScalarSlots kSlotsR80{-1, 0, -1, 2 * kLayers, 2 * kLayers + 1, 2 * kLayers + 2, kScalarsUsedR80};
// Record 81's (Config::mudd): record 80's without the backout (MUDD's post-loop coefficients replace it), 24
// entries, and upstream's padding (-2L - 2) mod 8 = 0. Readers of the backout slot check backout >= 0.
constexpr int kScalarsUsedMudd = 2 * kLayers + 2;
constexpr ScalarSlots kSlotsMudd{-1, 0, -1, 2 * kLayers, -1, 2 * kLayers + 1, kScalarsUsedMudd};

// Clear message and a non-zero exit for inputs the model cannot take.
inline void require(bool ok, const char* fmt, ...) {
    if (ok) return;
    std::va_list ap;
    va_start(ap, fmt);
    std::fprintf(stderr, "gpt_reference: ");
    std::vfprintf(stderr, fmt, ap);
    std::fprintf(stderr, "\n");
    va_end(ap);
    std::exit(EXIT_FAILURE);
}

// Bank entry of a layer's attention weights and output gate (layer 6 has none: -1).
inline int attn_bank_index(int layer) { return layer < 6 ? layer : layer == 6 ? -1 : layer - 1; }
// Value-embedding table (and ve gate) of a layer in record 71, -1 where it has none (record 80:
// Config::value_layers).
inline int value_table(int layer) {
    switch (layer) {
        case 0: return 0;
        case 1: return 1;
        case 8: return 2;
        case 9: return 3;
        case 10: return 4;
        default: return -1;
    }
}
inline bool upstream_paired(int layer) { return layer == 0 || layer == 2 || layer == 5 || layer == 9; }

// ---- FP8 rounding, from the format definitions ----
// Nearest value of a binary format with `mantissa_bits` stored mantissa bits and smallest normal
// exponent `min_exp` (subnormals below it), ties to even; magnitudes that round above
// `max_finite` give `overflow`.
inline double round_to_format(double v, int mantissa_bits, int min_exp, double max_finite, double overflow) {
    if (std::isnan(v) || v == 0.0) return v;
    const double a = std::fabs(v);
    int e = 0;
    std::frexp(a, &e);  // a = m * 2^e with m in [0.5, 1): leading bit at 2^(e-1)
    const int lead = std::max(e - 1, min_exp);
    const double quantum = std::ldexp(1.0, lead - mantissa_bits);
    const double r = std::nearbyint(a / quantum) * quantum;  // a / quantum is exact; nearbyint ties to even
    if (r > max_finite) return std::copysign(overflow, v);
    return std::copysign(r, v);
}
// float8_e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, max 448; beyond it NaN
// (torch eager's cast: 464 is a tie that rounds to even, 448; above it NaN).
inline double round_e4m3(double v) { return round_to_format(v, 3, -6, 448.0, std::nan("")); }
// The same rounding with saturation: magnitudes that round above 448 give +-448 (NaN stays NaN). Hopper's
// cvt.rn.satfinite, which Triton's .to(float8e4nv) and so upstream's compiled casts use.
inline double round_e4m3_satfinite(double v) { return round_to_format(v, 3, -6, 448.0, 448.0); }
// float8_e5m2: 5 exponent bits (bias 15), 2 mantissa bits, max 57344, infinities.
inline double round_e5m2(double v) { return round_to_format(v, 2, -14, 57344.0, INFINITY); }
// bfloat16: fp32's exponent range, 7 mantissa bits, infinities; on fp32 values the same as torch's
// fp32 -> bf16 cast (round to nearest even).
inline double round_bf16(double v) { return round_to_format(v, 7, -126, 0x1.fep127, INFINITY); }
// fp32, round to nearest even (the C++ conversion in the default rounding mode).
inline double round_fp32(double v) { return double(float(v)); }

// ---- YaRN state: one per Yarn instance (upstream has a plain and a paired one) ----
struct Yarn {
    std::vector<double> freq;  // D/4 angular frequencies; dims 2j, 2j+1 rotate by freq[j], dims >= D/2 not at all
    double attn_scale = 0.1;   // softmax scale

    void reset(int head_dim) {
        const int n = head_dim / 4;
        freq.assign(n, 1.0);
        for (int j = 0; j < n; ++j) freq[j] = std::pow(1.0 / 1024.0, n > 1 ? double(j) / (n - 1) : 0.0);
        attn_scale = 0.1;
    }
    // Window growth old -> new (tokens): frequencies that turn fewer than alpha times over the old
    // window are scaled by old/new, those above beta kept, a linear blend between; scale grows.
    void apply(int old_window, int new_window, double alpha = 1.0, double beta = 32.0) {
        require(old_window > 0 && new_window > 0, "yarn apply needs positive windows (got %d -> %d)", old_window,
                new_window);
        const double ratio = double(old_window) / new_window;
        for (double& f : freq) {
            const double turns = old_window * f / (2.0 * kPi);
            const double blend = std::clamp((turns - alpha) / (beta - alpha), 0.0, 1.0);
            f *= ratio + blend * (1.0 - ratio);
        }
        attn_scale *= 0.2 * std::log(double(new_window) / old_window) + 1.0;
    }
};

// Rotary position of head h of token t: paired layers rotate the (T, H/2, 2D) view whose row t
// holds positions [2t | 2t+1], so even heads get 2t and odd heads 2t+1.
inline double rotary_position(bool paired, int t, int h) { return paired ? 2.0 * t + (h & 1) : double(t); }

// Rotates one head vector x (D) in place by position pos: pairs (2j, 2j+1) for j < D/4 turn by
// pos*freq[j] as upstream's factor1*x + factor2*flip(x) (x0' = c x0 + s x1, x1' = c x1 - s x0);
// inverse applies the transpose (the backward).
inline void rotary_apply(const Yarn& yarn, double pos, double* x, int D, bool inverse = false) {
    for (int j = 0; j < D / 4; ++j) {
        const double th = pos * yarn.freq[j], c = std::cos(th), s = std::sin(th);
        const double x0 = x[2 * j], x1 = x[2 * j + 1];
        if (!inverse) {
            x[2 * j] = c * x0 + s * x1;
            x[2 * j + 1] = c * x1 - s * x0;
        } else {
            x[2 * j] = c * x0 - s * x1;
            x[2 * j + 1] = s * x0 + c * x1;
        }
    }
}

// ---- configuration ----
struct Config {
    int T = 0, V = 0, C = 0, H = 0, D = 0;
    int bigram_vocab = 0;
    int window_short = 0, window_long = 0;  // tokens (upstream: ws blocks * 128); key j visible iff i-w <= j <= i
    Yarn yarn, yarn_paired;                 // rotary frequencies and softmax scale of both instances
    std::vector<double> mtp_weights{1.0};   // multi-token prediction weights (1 to 3)
    bool training = true;                   // true: FP8 lm_head (if fp8) + MTP loss summed over rows; false: mean CE
    bool fp8 = true;                        // training only: false replaces the quantized lm_head by the exact one
    bool key_offset = true;                 // false disables the key offset (a test switch; upstream always has it)
    std::array<bool, kLayers> paired{};     // paired-head layers (upstream: 0, 2, 5, 9)
    // Value table k is read by layer value_layers[k] (record 71: 0, 1, 8, 9, 10; record 80: 1, 2, 8, 9, 10).
    std::array<int, kValueTables> value_layers{0, 1, 8, 9, 10};
    // Record 80: an unpaired layer's ve gate reads cat(xa[:6], ve[:6]) instead of xa[:12].
    bool ve_gate_reads_ve = false;
    // Record 84 (upstream a333be08 L1448-1453): with ve_gate_reads_ve, the paired layers' gates read it too.
    bool paired_ve_gate_reads_ve = false;
    // Record 80's CE kernel: the gradient's normalizer S_w sums every MTP weight, also those whose
    // target t+k lies past the batch (record 71: only the weights with a target, w_k > 0).
    bool sw_over_all_weights = false;
    // Record 88's prefix-token loss (upstream 75d6867a triton_kernels.py ce_fwd_bwd L1066-1160), training only: a row t
    // whose Batch::prefix_targets P_t lies in [0, V) adds prefix_weight (lse_t - z[t, P_t]) to its loss, and so
    // prefix_weight to its gradient's normalizer S_w and to the target term at column P_t. 0: none.
    double prefix_weight = 0.0;
    // Record 80's residual stream (upstream 2c702746 GPT.forward): per-sublayer resid and post lambdas,
    // x0 and bigram injected at each attention sublayer, no per-layer mix (forward() spells it out);
    // `scalars` takes record 80's layout (kSlotsR80).
    bool sublayer_lambdas = false;
    // The attention of every layer after this one reads norm(its output) instead of norm(x): -1 none
    // (record 71), record 80: 7 (h7, which the backout also subtracts). Needs sublayer_lambdas.
    int late_attn_source = -1;
    // sublayer_lambdas: the lambdas of the stream updates (resid, post, x0, bigram) are the parameters
    // rounded to bf16 (upstream's .bfloat16() before use; their gradient passes straight through).
    // false: the exact parameters (the smooth function that finite differences can check).
    bool lambdas_bf16 = true;
    // Record 82's XSA (exclusive self attention, upstream a333be08 L1125-1131) on the layers marked here
    // (record 82: 1, 3, 4, 7, 8, 10; attention, non-paired): before the output gate, each head's
    // attention output y loses alpha times its component along its own value v (after the value
    // embedding's mix): y' = y - alpha (y . v^) v^, v^ = v / max(|v|, 1e-4), alpha = tanh(a[layer, h])
    // with a = Params::xsa_alphas.
    std::array<bool, kLayers> xsa{};
    // alpha is tanh(a) rounded to bf16 (upstream's .type_as(y); the gradient passes straight through,
    // as with lambdas_bf16). false: the exact tanh(a), the smooth function finite differences check.
    bool xsa_alpha_bf16 = true;
    // Record 84's narrow bigram (upstream a333be08: nn.Embedding(bigram_vocab, bigram_dim), 192 of 768):
    // the bigram embedding is (bigram_vocab, bigram_dim) and each of its injections (before layer 0, at
    // the attention of layers 1-10) adds into the stream's channels [0, bigram_dim) only, upstream's
    // x[..., :bigram_dim] += ...; 0: C (records 71/80). Narrower than C needs sublayer_lambdas: record
    // 71's per-layer mix has no narrow form upstream.
    int bigram_dim = 0;
    // Record 83's sign trick (upstream PR 299): the bigram row of token t is multiplied elementwise by
    // row (inputs[t-1] ^ inputs[t]) % bigram_sign_rows of a fixed +-1 table (row 0 at t = 0; the packed
    // batch's ids, across document boundaries: bigram_sign_index), so that bigrams sharing a hashed row
    // mostly differ in sign. The table is a buffer, not a parameter: no gradient, never trained.
    // 0 rows: no signs (record 80); record 83/84: 8192.
    int bigram_sign_rows = 0;
    std::vector<double> bigram_sign_table;  // (bigram_sign_rows, bigram_width()), entries +-1
    // Record 84 (a333be08 only): upstream writes x = x0 = norm(...) and then adds the pre-layer-0 bigram
    // in place (x[..., :bigram_dim] = ... + x0_bigram * bigram_lambdas[0]), which changes x0 too, the
    // same tensor: every later read of x0 (the x0 injections, the skip gate's x0[..., :12]) sees the
    // stream after that add, not the norm's output. A later upstream commit fixed it with x0.clone();
    // this switch reproduces the aliased form. Needs sublayer_lambdas.
    bool x0_includes_bigram = false;
    // Record 81's MUDD (upstream a333be08 L1281-1330, L1438-1499; needs sublayer_lambdas, an even head count
    // and a value table on layer 10). Coefficients c = coefficients of block 0 from h9 (MuddLayerCoef):
    //   layer 10: v += g ve(table of layer 10) + (c0 h0 + c1 h7 + c2 h9), g = c6 on heads [0, H/2), c7 on
    //             [H/2, H) (no learned ve gate); r = (1 + c5) h9 + c3 h0 + c4 h7; the attention still reads
    //             norm(x_mix) (the late source's output with late_attn_source); x_attn = c8 r + c9 attn + c10 h0,
    //             x_attn[:, :bigram width] += c11 xb; x_out = c12 x_attn + c13 mlp(norm(x_attn))
    //   post-loop: c' = coefficients of block 1 from x_out[10] (MuddPostCoef); x_final = x_out[10] + c'0 h0 +
    //             c'1 h7 + c'2 h9 + c'3 ve0 + c'4 h3 (ve0: value table 0's rows at the input tokens), no backout
    // h0 is layer 0's input (after the pre-layer-0 bigram add, with or without x0_includes_bigram), h3, h7
    // the outputs of layers 3 and 7, h9 layer 10's input. Layer 10's resid/post, x0 and bigram lambdas and its
    // table's ve gate are never read (zero gradient); `scalars` takes kSlotsMudd (no backout). The
    // coefficients are activations: not rounded to bf16 here (upstream's are bf16 tensors).
    bool mudd = false;
    // Record 84's FP8 MLP up-projection in the training forward (detail::mlp_up_fp8_forward has the rounding
    // points): pre = (e4m3(normed * 448/a) . e4m3(W1 / w_s)^T) * w_s a / 448, a = max|normed| over the layer's
    // whole input. The backward is unchanged (the unquantized normed input and W1, with pre from the FP8
    // forward); evaluation (training false) is unquantized.
    bool mlp_up_fp8 = false;
    // Records 85-86's MUDD gate (needs mudd, 6 heads, XSA on exactly layers 1, 3, 4, 7, no x0_includes_bigram:
    // upstream's x = x0.clone() keeps x0 clean). G0 = gate 0 of x0, G1 = gate 1 of h3 (layer 4's input), columns as
    // gate_cols; with k = gate_cols(i):
    //   before layer 0:  x_in[0] = x0 + G0[t, 19] xb (MUDD's h0)
    //   attention i not 10: x_attn = ra x_in + pa attn + G[t, k.x0] x0 + (i > 0 ? G[t, k.bigram] xb : 0)
    //   layer 6:         x_attn = x_in + sigmoid(skip_lambda) G1[t, 28] h3
    //   attention block: no learned output gates; layers 3 and 10 multiply head h by G[t, k.out + h] (raw, no
    //                    sigmoid); XSA (layers 1, 3, 4, 7) is record 86's: y' = y - tanh(G[t, k.xsa + h]) (y . v) /
    //                    max(|v|^2, 1e-8) v, on the DC output where DC runs (not on layer 10 upstream)
    // Layer 10 and the exit are MUDD's. attn_gate_bank, skip_gate, x0_lambdas, bigram_lambdas and xsa_alphas are
    // gone (empty); the gate scale multiplies as bf16 with lambdas_bf16 (upstream's .type_as(x)), its gradient
    // straight through; the columns themselves are not rounded here (upstream's are bf16).
    bool mudd_gate = false;
    // Record 85's DC-MHA on layer 10 (needs mudd_gate): after the attention, per token t,
    //   keys s of t's document with 0 <= t - s < dc_window (upstream: 112, not the layer's window);
    //   P_h[t, s] = softmax_s(scale q_h[t] . k_h[s]) over those keys (q, k as attended: rotary, key offset);
    //   w1 = rms_norm(G1[t, 29:35]) over the heads (eps 1e-6, no weight), w2 = G1[t, 35:41];
    //   y_h[t] += w2[h] sum_s (sum_h' w1[h'] P_h'[t, s]) v_h[s]
    bool dc_mha = false;
    int dc_window = 112;
    double grad_scale = 2.0;                // upstream's grad_scale (2 / grad_accum_steps; 2 on 8 ranks)
    double x_s = 100.0 / 448.0, w_s = 1.6 / 448.0;
    // Padding ones after the used scalars; -1: upstream's on 8 ranks (record 71: 4, its formula
    // (-3L - 3) mod 8 predates the bigram lambdas; record 80: (-2L - 3) mod 8 = 7, 32 entries).
    int scalars_pad = -1;

    int hidden() const { return 4 * C; }
    int bigram_width() const { return bigram_dim > 0 ? bigram_dim : C; }
    bool bigram_signs() const { return bigram_sign_rows > 0; }
    // A random +-1 table of bigram_sign_rows x bigram_width() (upstream: randn(...).sign(); here fair
    // coin flips from our own stream), for tests: c.bigram_sign_table = c.random_sign_table(seed).
    std::vector<double> random_sign_table(uint64_t seed) const {
        std::mt19937_64 g(seed);
        std::vector<double> table(size_t(bigram_sign_rows) * size_t(bigram_width()));
        for (double& e : table) e = (g() >> 63) ? 1.0 : -1.0;
        return table;
    }
    double grad_s() const { return grad_scale * 0.75 / 448.0; }
    const ScalarSlots& scalar_slots() const { return mudd ? kSlotsMudd : sublayer_lambdas ? kSlotsR80 : kSlotsR71; }
    int num_scalars() const {
        const int upstream = mudd               ? ((-2 * kLayers - 2) % 8 + 8) % 8
                             : sublayer_lambdas ? ((-2 * kLayers - 3) % 8 + 8) % 8
                                                : ((-3 * kLayers - 3) % 8 + 8) % 8;
        return scalar_slots().used + (scalars_pad >= 0 ? scalars_pad : upstream);
    }
    // The lambda a stream update multiplies by (see lambdas_bf16).
    double stream_lambda(double parameter) const { return lambdas_bf16 ? round_bf16(parameter) : parameter; }
    bool any_xsa() const { return std::find(xsa.begin(), xsa.end(), true) != xsa.end(); }
    // Whether the parameters hold xsa_alphas (record 82's), the learned gates and lambdas (not under the MUDD gate).
    bool xsa_params() const { return any_xsa() && !mudd_gate; }
    bool learned_gates() const { return !mudd_gate; }
    bool dc_layer(int layer) const { return dc_mha && layer == kDcLayer; }
    // The layer whose lambdas and ve gate MUDD's block 0 replaces (the last), with mudd.
    bool mudd_layer(int layer) const { return mudd && layer == kLayers - 1; }
    // XSA's strength from its parameter a (see xsa_alpha_bf16).
    double xsa_alpha(double a) const { return xsa_alpha_bf16 ? round_bf16(std::tanh(a)) : std::tanh(a); }
    // The layer whose output layer i's attention normalizes instead of the stream (-1: the stream).
    int attn_source(int layer) const { return late_attn_source >= 0 && layer > late_attn_source ? late_attn_source : -1; }
    // Window of a layer in tokens (paired layers use it in rows of the doubled sequence); -1: no attention.
    int window(int layer) const {
        if (layer == 6) return -1;
        return (layer == 3 || layer == 10) ? window_long : window_short;
    }
    // Upstream marks key-offset layers by window == ws_long (all attention layers if short == long);
    // paired layers never apply it.
    bool has_key_offset(int layer) const {
        return key_offset && layer != 6 && !paired[layer] && window(layer) == window_long;
    }
    const Yarn& yarn_of(int layer) const { return paired[layer] ? yarn_paired : yarn; }
    int table_of(int layer) const {
        for (int k = 0; k < kValueTables; ++k)
            if (value_layers[size_t(k)] == layer) return k;
        return -1;
    }
    bool gate_reads_ve(int layer) const {
        return ve_gate_reads_ve && (!paired[layer] || paired_ve_gate_reads_ve) && table_of(layer) >= 0;
    }
    void yarn_apply(int old_window, int new_window) {
        yarn.apply(old_window, new_window);
        yarn_paired.apply(old_window, new_window);
    }

    // A configuration with upstream's layer structure and fresh YaRN state.
    static Config make(int T, int V, int C, int H, int D, int bigram_vocab, int window_short, int window_long) {
        Config c;
        c.T = T;
        c.V = V;
        c.C = C;
        c.H = H;
        c.D = D;
        c.bigram_vocab = bigram_vocab;
        c.window_short = window_short;
        c.window_long = window_long;
        for (int i = 0; i < kLayers; ++i) c.paired[i] = upstream_paired(i);
        c.yarn.reset(D);
        c.yarn_paired.reset(D);
        return c;
    }

    void validate() const {
        require(T >= 1 && V >= 1 && H >= 1 && D >= 4, "bad shape T=%d V=%d H=%d D=%d", T, V, H, D);
        require(C == H * D, "model width C=%d must equal H*D = %d*%d", C, H, D);
        require(D % 4 == 0, "head_dim D=%d must be a multiple of 4 (half-truncated rotary on pairs)", D);
        require(C >= kGateDim, "model width C=%d is below the %d gate channels", C, kGateDim);
        require(bigram_vocab >= 2, "bigram vocab %d must be at least 2", bigram_vocab);
        require(window_short >= 0 && window_long >= 0, "windows must be >= 0 (got %d, %d)", window_short, window_long);
        require(!mtp_weights.empty(), "need at least one MTP weight");
        require(scalars_pad >= -1, "scalars padding %d < -1 (-1: upstream's)", scalars_pad);
        require(late_attn_source >= -1 && late_attn_source < kLayers - 1,
                "late_attn_source %d outside [-1, %d] (-1: none; a later layer must read it)", late_attn_source,
                kLayers - 2);
        require(late_attn_source < 0 || sublayer_lambdas,
                "late_attn_source %d needs sublayer_lambdas (record 80's stream; record 71's has no such read)",
                late_attn_source);
        for (int i = 0; i < kLayers; ++i)
            require(!paired[i] || (H % 2 == 0 && i != 6), "paired layer %d needs an even head count and attention (H=%d)",
                    i, H);
        // upstream applies XSA only where the attention reads v as (T, H, D): paired layers read (2T, H/2, D)
        for (int i = 0; i < kLayers; ++i)
            require(!xsa[i] || (i != 6 && !paired[i]), "XSA layer %d must have attention and not be paired", i);
        require(bigram_dim >= 0 && bigram_dim <= C, "bigram_dim %d outside [0, C=%d] (0: C)", bigram_dim, C);
        require(bigram_width() == C || sublayer_lambdas,
                "bigram_dim %d < C=%d needs sublayer_lambdas (record 71's per-layer mix has no narrow form)",
                bigram_dim, C);
        require(bigram_sign_rows >= 0, "bigram_sign_rows %d < 0 (0: no signs)", bigram_sign_rows);
        require(bigram_sign_table.size() == size_t(bigram_sign_rows) * size_t(bigram_width()),
                "bigram sign table has %zu entries, want bigram_sign_rows x bigram width = %d x %d",
                bigram_sign_table.size(), bigram_sign_rows, bigram_width());
        for (size_t e = 0; e < bigram_sign_table.size(); ++e)
            require(bigram_sign_table[e] == 1.0 || bigram_sign_table[e] == -1.0,
                    "bigram sign table entry %zu is %g, want +-1", e, bigram_sign_table[e]);
        require(!x0_includes_bigram || sublayer_lambdas,
                "x0_includes_bigram needs sublayer_lambdas (record 84's pre-layer-0 bigram add is record 80's)");
        require(!mudd || sublayer_lambdas,
                "mudd needs sublayer_lambdas (record 81's coefficients replace record 80's per-sublayer lambdas)");
        require(!mudd || H % 2 == 0, "mudd needs an even head count (its two ve gate lanes cover H/2 heads each; H=%d)",
                H);
        require(!mudd || table_of(kLayers - 1) >= 0,
                "mudd needs a value table on layer %d (its coefficients gate that layer's value embedding)", kLayers - 1);
        require(!mudd_gate || mudd, "mudd_gate needs mudd (record 85's gate builds on record 81's MUDD)");
        require(!mudd_gate || H == kGateHeads, "mudd_gate's column layout is upstream's for %d heads (H=%d)", kGateHeads, H);
        require(!mudd_gate || !x0_includes_bigram, "mudd_gate reads the clean x0 (upstream's x0.clone()): no x0_includes_bigram");
        for (int i = 0; i < kLayers; ++i)
            require(!mudd_gate || xsa[i] == (i == 1 || i == 3 || i == 4 || i == 7),
                    "mudd_gate's layout has XSA on exactly layers 1, 3, 4, 7 (layer %d differs)", i);
        for (int i = 0; i < kLayers; ++i)
            require(!mudd_gate || paired[i] == upstream_paired(i), "mudd_gate implements upstream's paired layers only");
        require(!dc_mha || mudd_gate, "dc_mha needs mudd_gate (its weights are the post gate's columns)");
        require(!dc_mha || dc_window >= 1, "dc_window %d must be at least 1", dc_window);
        require(int(yarn.freq.size()) == D / 4 && int(yarn_paired.freq.size()) == D / 4,
                "YaRN state has %zu/%zu frequencies, want D/4 = %d (call Config::make or Yarn::reset)",
                yarn.freq.size(), yarn_paired.freq.size(), D / 4);
    }
};

// ---- parameters, in upstream's shapes ----
struct Params {
    std::vector<double> embed;           // (V, C)
    std::vector<double> lm_head;         // (C, V), stored transposed as upstream
    std::vector<double> bigram_embed;    // (bigram_vocab, Config::bigram_width())
    std::vector<double> value_embeds;    // (5V, C): table k row v at k*V + v
    std::vector<double> attn_bank;       // (10, 4C, C): rows Wq; Wk; Wv; Wo
    std::vector<double> mlp_bank;        // (12, 2, 4C, C): [:,0] c_fc, [:,1] c_proj; entry 11 padding
    std::vector<double> attn_gate_bank;  // (10, H, 12)
    std::vector<double> ve_gate_bank;    // (5, H, 12)
    std::vector<double> smear_gate;      // (12)
    std::vector<double> skip_gate;       // (12)
    std::vector<double> x0_lambdas;      // (11)
    std::vector<double> scalars;         // (Config::num_scalars()), see Config::scalar_slots()
    // Record 80's stream (Config::sublayer_lambdas; empty otherwise), row-major [layer][0 attention | 1 MLP]:
    std::vector<double> resid_lambdas;   // (11, 2) the stream's factor at each sublayer update
    std::vector<double> post_lambdas;    // (11, 2) the block output's factor
    std::vector<double> bigram_lambdas;  // (11) the bigram embedding's: [0] before layer 0, [i] at layer i's attention
    // Record 82's XSA strengths (fp32 upstream, zeros at init): alpha = tanh(a). Rows of layers without
    // XSA are never read (zero gradient).
    std::vector<double> xsa_alphas;      // (11, H) fp32, row = layer; empty unless Config::any_xsa()
    // Record 81's MUDD blocks (Config::mudd; empty otherwise), [block][...]: block 0 layer 10's, 1 the post-loop's
    // (which reads rows [0, 5) of w2 and b2: the rest has zero gradient).
    std::vector<double> mudd_w1;         // (2, 64, C) the hidden layer, as nn.Linear (out, in)
    std::vector<double> mudd_w2;         // (2, 14, 64) the coefficients' layer
    std::vector<double> mudd_b2;         // (2, 14) its bias (before the 0.1 scale)
    // Records 85-86's MUDD gate (Config::mudd_gate; empty otherwise), [gate][...]: gate 0 reads rows [0, 26) of w2
    // and b2 (the rest has zero gradient), gate 1 all 41.
    std::vector<double> mudd_gate_w1;    // (2, 64, C)
    std::vector<double> mudd_gate_w2;    // (2, 41, 64)
    std::vector<double> mudd_gate_b2;    // (2, 41), before the scale
    std::vector<double> mudd_gate_scale; // (1) fp32, 0.1 at init

    // Element counts in tensors() order.
    static std::vector<size_t> sizes(const Config& c) {
        const size_t C = c.C, V = c.V, F = c.hidden(), H = c.H;
        const size_t gates = c.learned_gates() ? 1 : 0, gated = c.mudd_gate ? 1 : 0;
        return {V * C,
                C * V,
                size_t(c.bigram_vocab) * size_t(c.bigram_width()),
                kValueTables * V * C,
                kAttnLayers * 4 * C * C,
                kMlpBankLayers * 2 * F * C,
                gates * kAttnLayers * H * kGateDim,
                kValueTables * H * kGateDim,
                kGateDim,
                gates * kGateDim,
                gates * kLayers,
                size_t(c.num_scalars()),
                c.sublayer_lambdas ? size_t(2 * kLayers) : 0,
                c.sublayer_lambdas ? size_t(2 * kLayers) : 0,
                c.sublayer_lambdas ? gates * kLayers : 0,
                c.xsa_params() ? size_t(kLayers) * H : 0,
                c.mudd ? size_t(kMuddBlocks) * kMuddDim * C : 0,
                c.mudd ? size_t(kMuddBlocks) * kMuddCoefs * kMuddDim : 0,
                c.mudd ? size_t(kMuddBlocks) * kMuddCoefs : 0,
                gated * 2 * kMuddDim * C,
                gated * 2 * kGateMaxCoefs * kMuddDim,
                gated * 2 * kGateMaxCoefs,
                gated};
    }

    static Params zeros(const Config& c) {
        Params p;
        const std::vector<size_t> n = sizes(c);
        size_t i = 0;
        for (auto& [name, t] : p.tensors()) t->assign(n[i++], 0.0);
        return p;
    }

    // Upstream's initialization (its distributions, our own random stream).
    static Params init(const Config& c, uint64_t seed) {
        c.validate();
        Params p = zeros(c);
        std::mt19937_64 g(seed);
        const double bound = std::sqrt(3.0) * 0.5 / std::sqrt(double(c.C));
        std::uniform_real_distribution<double> u(-bound, bound);
        for (double& w : p.attn_bank) w = u(g);
        const size_t mat = size_t(c.hidden()) * c.C;
        for (int l = 0; l < kMlpBankLayers; ++l)
            for (size_t e = 0; e < mat; ++e) p.mlp_bank[(2 * size_t(l)) * mat + e] = u(g);  // c_fc; c_proj stays 0
        std::normal_distribution<double> n(0.0, 0.005);
        for (double& w : p.lm_head) w = n(g);
        for (int v = 0; v < c.V; ++v)
            for (int k = 0; k < c.C; ++k) p.embed[size_t(v) * c.C + k] = p.lm_head[size_t(k) * c.V + v];
        const ScalarSlots& k = c.scalar_slots();
        for (int i = 0; i < kLayers; ++i) {
            p.scalars[k.sa_of(i, 0)] = 0.5;
            p.scalars[k.sa_of(i, 1)] = 1.0;
            if (!c.sublayer_lambdas) {
                p.scalars[k.resid + i] = 1.1;
                p.scalars[k.bigram + i] = 0.1;
            }
        }
        p.scalars[k.smear] = 0.0;
        if (k.backout >= 0) p.scalars[k.backout] = 0.5;
        p.scalars[k.skip] = -1.5;
        for (int i = k.used; i < c.num_scalars(); ++i) p.scalars[i] = 1.0;
        if (c.sublayer_lambdas) {  // x0_lambdas stay 0
            p.resid_lambdas.assign(2 * kLayers, std::sqrt(1.1));  // per sublayer: a layer scales the stream by 1.1
            p.post_lambdas.assign(2 * kLayers, 1.0);
            if (c.learned_gates()) p.bigram_lambdas.assign(kLayers, 0.05);
        }
        if (c.mudd) {  // w1: kaiming_uniform(a = sqrt(5)) = uniform(+-1/sqrt(C)); w2 zeros; b2 upstream's, in bf16
            std::uniform_real_distribution<double> w1(-1.0 / std::sqrt(double(c.C)), 1.0 / std::sqrt(double(c.C)));
            for (double& w : p.mudd_w1) w = w1(g);
            double* b0 = p.mudd_b2.data();
            double* b1 = b0 + kMuddCoefs;
            b0[kMuGateLo] = b0[kMuGateHi] = round_bf16(2.0 / kMuddScale);  // the other layers' 2 sigmoid's maximum
            b0[kMuResidAttn] = b0[kMuResidMlp] = round_bf16(std::sqrt(1.1) / kMuddScale);  // 10.488 -> 10.5
            b0[kMuPostAttn] = b0[kMuPostMlp] = round_bf16(1.0 / kMuddScale);
            b0[kMuX0] = 0.0;
            b0[kMuBigram] = round_bf16(0.05 / kMuddScale);
            b1[kMuPost7] = round_bf16(-0.5 / kMuddScale);  // the backout's -0.5 h7
        }
        if (c.mudd_gate) {  // init_mudd_gate: w1 as MUDD's, w2 zeros, b2 the starting columns over 0.1, scale 0.1
            std::uniform_real_distribution<double> w1(-1.0 / std::sqrt(double(c.C)), 1.0 / std::sqrt(double(c.C)));
            for (double& w : p.mudd_gate_w1) w = w1(g);
            for (int id = 0; id < 2; ++id) {
                double* b = p.mudd_gate_b2.data() + id * kGateMaxCoefs;
                for (int j = 12; j < 18; ++j) b[j] = 0.25 / 0.1;                    // output gates 0.25
                for (int j = 19; j < (id ? 28 : 26); j += 2) b[j] = 0.05 / 0.1;     // bigram gates 0.05
                if (id == 1) {
                    b[kGateSkipCol] = 0.5 / 0.1;                                      // skip 0.5
                    for (int j = kGateDcW1Col; j < kGateDcW2Col; ++j) b[j] = 1.0 / 0.1;  // DC's w1 1 (normed)
                }
                for (int j = 0; j < kGateMaxCoefs; ++j) b[j] = round_bf16(b[j]);
            }
            p.mudd_gate_scale.assign(1, 0.1);
        }
        return p;
    }

    std::vector<std::pair<const char*, std::vector<double>*>> tensors() {
        return {{"embed", &embed},
                {"lm_head", &lm_head},
                {"bigram_embed", &bigram_embed},
                {"value_embeds", &value_embeds},
                {"attn_bank", &attn_bank},
                {"mlp_bank", &mlp_bank},
                {"attn_gate_bank", &attn_gate_bank},
                {"ve_gate_bank", &ve_gate_bank},
                {"smear_gate", &smear_gate},
                {"skip_gate", &skip_gate},
                {"x0_lambdas", &x0_lambdas},
                {"scalars", &scalars},
                {"resid_lambdas", &resid_lambdas},
                {"post_lambdas", &post_lambdas},
                {"bigram_lambdas", &bigram_lambdas},
                {"xsa_alphas", &xsa_alphas},
                {"mudd_w1", &mudd_w1},
                {"mudd_w2", &mudd_w2},
                {"mudd_b2", &mudd_b2},
                {"mudd_gate_w1", &mudd_gate_w1},
                {"mudd_gate_w2", &mudd_gate_w2},
                {"mudd_gate_b2", &mudd_gate_b2},
                {"mudd_gate_scale", &mudd_gate_scale}};
    }
    std::vector<std::pair<const char*, const std::vector<double>*>> tensors() const {
        std::vector<std::pair<const char*, const std::vector<double>*>> out;
        for (auto& [name, t] : const_cast<Params*>(this)->tensors()) out.push_back({name, t});
        return out;
    }

    void validate(const Config& c) const {
        const std::vector<size_t> want = sizes(c);
        const auto got = tensors();
        for (size_t i = 0; i < got.size(); ++i)
            require(got[i].second->size() == want[i], "parameter %s has %zu elements, want %zu", got[i].first,
                    got[i].second->size(), want[i]);
    }
};

// Adds normal(0, scale) noise to every element of every parameter (padding included): random
// non-trivial parameters on top of init(), where zeros would make gradients vanish.
inline void perturb(Params& p, uint64_t seed, double scale) {
    std::mt19937_64 g(seed);
    std::normal_distribution<double> n(0.0, scale);
    for (auto& [name, t] : p.tensors())
        for (double& w : *t) w += n(g);
}

// ---- one packed sequence ----
struct Batch {
    std::vector<int> inputs;      // (T) token ids
    std::vector<int> targets;     // (T) next-token ids (MTP row t also uses targets t+1, t+2)
    std::vector<int> cu_seqlens;  // document starts, then T; padding entries repeat T
    std::vector<int> bigram;      // (T) bigram hash ids
    // record 88 (Config::prefix_weight): (T) each row's prefix target, the longest proper prefix token of its next token
    // (upstream's prefix_table[targets]); outside [0, V): none. Empty: none at all.
    std::vector<int> prefix_targets;
    bool prefix_valid(const Config& c, size_t t) const {
        return !prefix_targets.empty() && prefix_targets[t] >= 0 && prefix_targets[t] < c.V;
    }

    void validate(const Config& c) const {
        require(int(inputs.size()) == c.T && int(targets.size()) == c.T && int(bigram.size()) == c.T,
                "batch has %zu inputs, %zu targets, %zu bigram ids; want T = %d each", inputs.size(), targets.size(),
                bigram.size(), c.T);
        for (int t = 0; t < c.T; ++t) {
            require(inputs[t] >= 0 && inputs[t] < c.V, "input %d at %d outside [0, V=%d)", inputs[t], t, c.V);
            require(targets[t] >= 0 && targets[t] < c.V, "target %d at %d outside [0, V=%d)", targets[t], t, c.V);
            require(bigram[t] >= 0 && bigram[t] < c.bigram_vocab, "bigram id %d at %d outside [0, %d)", bigram[t], t,
                    c.bigram_vocab);
        }
        require(prefix_targets.empty() || int(prefix_targets.size()) == c.T, "batch has %zu prefix targets, want 0 or T = %d",
                prefix_targets.size(), c.T);
        require(cu_seqlens.size() >= 2 && cu_seqlens.front() == 0 && cu_seqlens.back() == c.T,
                "cu_seqlens must start at 0 and end at T = %d", c.T);
        for (size_t i = 1; i < cu_seqlens.size(); ++i)
            require(cu_seqlens[i] >= cu_seqlens[i - 1], "cu_seqlens decreases at entry %zu", i);
    }
};

// Upstream's bigram hash: position 0 -> bv-1, else (36313*cur XOR 27191*prev) mod (bv-1).
inline std::vector<int> bigram_hash(const std::vector<int>& inputs, int bigram_vocab) {
    std::vector<int> out(inputs.size());
    const int64_t mod = bigram_vocab - 1;
    for (size_t t = 0; t < inputs.size(); ++t)
        out[t] = t == 0 ? int(mod) : int(((36313LL * inputs[t]) ^ (27191LL * inputs[t - 1])) % mod);
    return out;
}

// Record 83's sign rows (Config::bigram_sign_rows): row 0 at position 0, else (prev XOR cur) mod rows,
// over the packed batch's input ids (across document boundaries, as the bigram hash).
inline std::vector<int> bigram_sign_index(const std::vector<int>& inputs, int rows) {
    require(rows >= 1, "bigram sign index needs at least one row (got %d)", rows);
    std::vector<int> out(inputs.size(), 0);
    for (size_t t = 1; t < inputs.size(); ++t) out[t] = (inputs[t - 1] ^ inputs[t]) % rows;
    return out;
}

// ---- everything the forward keeps (the backward reads it; tests and model checks may too) ----
struct LayerTape {
    // (T,C) stream entering the layer: record 71 after the skip add on layer 6; record 80 before it
    // (layer 0: x0 + lb[0] xb, xb added into channels [0, bigram width))
    std::vector<double> x_in;
    // (T,C) what the attention normalizes: record 71 the stream after resid/x0/bigram mixing (also the
    // attention's residual base); record 80 x_in, or the late source's output (empty on layer 6)
    std::vector<double> x_mix;
    std::vector<double> xa, rstd_a;      // attention input norm(x_mix) and its 1/rms (empty on layer 6)
    std::vector<double> qkv_raw;         // (T,3C) xa @ W_qkv^T, before sa_lambda0
    std::vector<double> qn, kn;          // (T,H,D) per-head normed q, k (before rotary)
    std::vector<double> rstd_q, rstd_k;  // (T,H)
    std::vector<double> q, k, v;         // (T,H,D) as attended: rotated q, k (k shifted), v with value embedding
    std::vector<double> lse;             // (rows*slots) attention log-sum-exp (paired: 2T rows x H/2 slots)
    std::vector<double> ve_sig;          // (T,H) sigmoid of the value-embedding gate (gate = 2*ve_sig; empty on MUDD's layer)
    // MUDD's layer (Config::mudd_layer; else empty), from block 0's coefficients, set before the attention:
    std::vector<double> mudd_ve_gate;    // (T,H) the value embedding's gate: c6 on heads [0, H/2), c7 on [H/2, H)
    std::vector<double> v_mudd;          // (T,C) c0 h0 + c1 h7 + c2 h9, added to v with the value embedding
    std::vector<double> mudd_r;          // (T,C) (1 + c5) h9 + c3 h0 + c4 h7, the attention update's residual base
    std::vector<double> attn_sig;        // (T,H) sigmoid of the output gate (mudd_gate: the raw gate column; empty
                                         // on layers without an output gate)
    // mudd_gate: the layer's per-token readers of the gate, (T,H) each, copied from the gate's columns before the
    // attention (empty where the layer has none): XSA's raw strengths (alpha = tanh), the output gate, DC's w1
    // columns (before the rms norm) and w2
    std::vector<double> tok_xsa, tok_out, tok_dc_w1, tok_dc_w2;
    // dc_mha's layer (else empty): its output y + w2 sum_s A v, and what the backward needs
    std::vector<double> y_dc;            // (T,C)
    std::vector<double> dc_p;            // (T,H,dc_window) P_h[t, s] at index t - s (0 outside the keys)
    std::vector<double> dc_a;            // (T,dc_window) A[t, s] = sum_h w1[h] P_h[t, s]
    std::vector<double> dc_w1, dc_rstd;  // (T,H) the normed w1, (T) its 1/rms
    std::vector<double> xsa_c, xsa_n2;   // mudd_gate's XSA layers: (T,H) (y . v) / n2 and n2 = max(|v|^2, 1e-8)
    std::vector<double> y;               // (T,C) attention output, model head order, before XSA and the gate
    std::vector<double> y_xsa;           // (T,C) XSA layers: y' = y - alpha p v^, what the gate multiplies (else empty)
    std::vector<double> xsa_p, xsa_n;    // (T,H) XSA layers: p = y . v^ and max(|v|, 1e-4) (else empty)
    std::vector<double> yg;              // (T,C) after the output gate (of y_xsa on XSA layers, else of y)
    std::vector<double> o_raw;           // (T,C) yg @ W_o^T, before sa_lambda1
    std::vector<double> x_attn;          // (T,C) after the attention sublayer (layer 6: after the skip add)
    std::vector<double> xm, rstd_m;      // MLP input norm(x_attn)
    std::vector<double> pre;             // (T,F) xm @ c_fc^T (Config::mlp_up_fp8: from the quantized operands)
    double mlp_fp8_a = 0.0, mlp_fp8_dequant = 0.0;  // mlp_up_fp8: the input's amax a and w_s a / 448 (else 0)
    std::vector<double> mlp_out;         // (T,C) relu(pre)^2 @ c_proj^T
    std::vector<double> x_out;           // (T,C) layer output
};

struct Tape {
    std::vector<double> emb;                 // (T,C) token embeddings
    std::vector<double> x_bigram;            // (T, bigram width) bigram embeddings (times their sign rows)
    std::vector<int> bigram_sign_idx;        // (T) sign rows (Config::bigram_signs(); else empty)
    std::vector<double> smear_sig;           // (T) sigmoid(emb[t,:12] . smear_gate), t >= 1
    std::vector<double> x_smear;             // (T,C) after the smear
    std::vector<double> x0, rstd0;           // norm(x_smear)
    // x0_includes_bigram: x0 after the pre-layer-0 bigram add (upstream's aliased x0), what every later
    // read of x0 sees (x0_read); else empty
    std::vector<double> x0_with_bigram;
    std::vector<double> skip_sig;            // (T) sigmoid(x0[t,:12] . skip_gate)
    std::array<LayerTape, kLayers> layers;
    // Config::mudd: block 0 (layer 10, from h9) and block 1 (post-loop, from x_out[10]); else empty
    struct Mudd {
        std::vector<double> z;     // (T,64) h W1[block]^T, before the gelu
        std::vector<double> coef;  // (T,n) (gelu(z) W2[block, :n]^T + b2[block, :n]) * 0.1, n = 14 or 5
    };
    std::array<Mudd, kMuddBlocks> mudd;
    // Config::mudd_gate: gate 0 (from x0) and gate 1 (from layer 4's input); else empty
    struct Gate {
        std::vector<double> z;     // (T,64) h Wg1^T
        std::vector<double> pre;   // (T,n) gelu(z) Wg2[:n]^T + bg2[:n], before the scale
        std::vector<double> coef;  // (T,n) pre * s, the columns
    };
    std::array<Gate, 2> gate;
    std::vector<double> x_final;             // (T,C) after the backout (mudd: after the post-loop mix)
    std::vector<double> xn, rstd_f;          // norm(x_final), the lm_head input
    std::vector<double> xq, wq;              // FP8 path: dequantized lm_head operands (T,C), (C,V)
    std::vector<double> logits;              // (T,V) before the softcap
    std::vector<double> lse;                 // (T) log-sum-exp of the softcapped logits
    std::vector<double> row_loss;            // (T) training: MTP row losses; eval: per-row cross-entropy
    double loss = 0.0;
    // Backward: each lambda's gradient is a sum of products d_i x_i of a stream gradient and a
    // stream; these are the root-sum-squares of those products, the scale of the rounding error an
    // independent error of relative size e in each d_i leaves in the sum (about e times it), however
    // much the products cancel.
    std::vector<double> scalar_scales, x0_lambda_scales;
    std::vector<double> resid_lambda_scales, post_lambda_scales, bigram_lambda_scales;  // record 80, as Params
    // The skip gate's gradient is sum_t k_t <dx_t, skip_t> x0[t, j]: the inner dot products cancel
    // too, so its error scale is the root-sum-square of k_t x0[t, j] times each dot's own scale.
    std::vector<double> skip_gate_scales;  // (12)
    // MUDD's b2 gradient (Config::mudd) is 0.1 sum_t dc[t, j], each dc a sum over channels of gradient x
    // source: the root-sum-square of 0.1 times all those products, as Params::mudd_b2 (rows [5, 14) of
    // block 1: 0). Else empty.
    std::vector<double> mudd_b2_scales;
    // mudd_gate: the gate columns' gradients dG (T, n) per gate, and for each (t, j) the sum of squares of the
    // products it sums (sums over channels or head dims, as above); from them the error scales of bg2's gradient
    // (s times the root-sum-square over t, as Params::mudd_gate_b2) and of the scale's (the root-sum-square of
    // pre times each). Else empty.
    std::array<std::vector<double>, 2> gate_dcoef, gate_sq;
    std::vector<double> mudd_gate_b2_scales, mudd_gate_scale_scales;
};

// The x0 that the x0 injections and the skip gate read: the norm's output, or (x0_includes_bigram)
// upstream's aliased x0 after the pre-layer-0 bigram add.
inline const std::vector<double>& x0_read(const Config& c, const Tape& tp) {
    return c.x0_includes_bigram ? tp.x0_with_bigram : tp.x0;
}

// The lambdas, laid end to end: the used scalars (47 in record 71's layout, 25 in record 80's, 24 in
// record 81's), then x0_lambdas, then (record 80) resid_lambdas (22), post_lambdas (22) and bigram_lambdas
// (11). Their gradients from `g`, and from a tape the scale of each one's error, for checks element by
// element. The layout is read off the tensors: record 80's are empty in record 71's, MUDD's outside mudd.
inline std::vector<double> lambda_gradients(const Params& g) {
    const bool r80 = !g.resid_lambdas.empty();
    const int used = !g.mudd_b2.empty() ? kScalarsUsedMudd : r80 ? kScalarsUsedR80 : kScalarsUsed;
    std::vector<double> v(g.scalars.begin(), g.scalars.begin() + used);
    for (const std::vector<double>* t : {&g.x0_lambdas, &g.resid_lambdas, &g.post_lambdas, &g.bigram_lambdas})
        v.insert(v.end(), t->begin(), t->end());
    return v;
}
inline std::vector<double> lambda_error_scales(const Tape& t) {
    const bool r80 = !t.resid_lambda_scales.empty();
    const int used = !t.mudd[1].coef.empty() ? kScalarsUsedMudd : r80 ? kScalarsUsedR80 : kScalarsUsed;
    std::vector<double> v(t.scalar_scales.begin(), t.scalar_scales.begin() + used);
    for (const std::vector<double>* s :
         {&t.x0_lambda_scales, &t.resid_lambda_scales, &t.post_lambda_scales, &t.bigram_lambda_scales})
        v.insert(v.end(), s->begin(), s->end());
    return v;
}

namespace detail {

inline double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

inline double dot(const double* a, const double* b, size_t n) {
    double s = 0.0;
    for (size_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

// <a, b>, adding the sum of squares of its products to `sq` (see Tape::scalar_scales).
inline double scaled_dot(const double* a, const double* b, size_t n, double& sq) {
    double s = 0.0;
    for (size_t i = 0; i < n; ++i) s += a[i] * b[i], sq += (a[i] * b[i]) * (a[i] * b[i]);
    return s;
}

inline void axpy(double a, const double* x, double* y, size_t n) {
    for (size_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The narrow bigram's forms (Config::bigram_dim): rows of (rows, lda) and (rows, ldb) arrays, their
// first n columns. scaled_dot over them, in the order of scaled_dot on rows laid end to end (the
// same bits when n = lda = ldb, the full width).
inline double scaled_dot_rows(const double* a, size_t lda, const double* b, size_t ldb, size_t rows, size_t n,
                              double& sq) {
    double s = 0.0;
    for (size_t r = 0; r < rows; ++r)
        for (size_t i = 0; i < n; ++i) {
            const double e = a[r * lda + i] * b[r * ldb + i];
            s += e, sq += e * e;
        }
    return s;
}
// y[r, :n] += a x[r, :n], row strides ldx, ldy.
inline void axpy_rows(double a, const double* x, size_t ldx, double* y, size_t ldy, size_t rows, size_t n) {
    for (size_t r = 0; r < rows; ++r) axpy(a, x + r * ldx, y + r * ldy, n);
}

// out (M,N) += alpha * sum_k A(m,k) B[k*N + n] with A(m,k) = A[m*am + k*ak]. Tiles of 6 rows x 4
// columns accumulate in registers over a block of k; partial tiles at the edges take plain loops.
inline void gemm_acc(const double* A, size_t am, size_t ak, const double* B, double* out, size_t M, size_t N, size_t K,
                     double alpha) {
    constexpr size_t MR = 6, NR = 4, KB = 256, NB = 256;
    for (size_t n0 = 0; n0 < N; n0 += NB) {
        const size_t n_end = std::min(N, n0 + NB);
        for (size_t k0 = 0; k0 < K; k0 += KB) {
            const size_t k_end = std::min(K, k0 + KB);
            for (size_t m0 = 0; m0 < M; m0 += MR) {
                const size_t mr = std::min(MR, M - m0);
                size_t n1 = n0;
                for (; mr == MR && n1 + NR <= n_end; n1 += NR) {
                    double acc[MR][NR] = {};
                    for (size_t k = k0; k < k_end; ++k) {
                        const double* b = B + k * N + n1;
                        for (size_t r = 0; r < MR; ++r) {
                            const double a = A[(m0 + r) * am + k * ak];
                            for (size_t j = 0; j < NR; ++j) acc[r][j] += a * b[j];
                        }
                    }
                    for (size_t r = 0; r < MR; ++r)
                        for (size_t j = 0; j < NR; ++j) out[(m0 + r) * N + n1 + j] += alpha * acc[r][j];
                }
                for (size_t r = 0; r < mr; ++r)  // edge: leftover columns, or a short row tile
                    for (size_t n = n1; n < n_end; ++n) {
                        double acc = 0.0;
                        for (size_t k = k0; k < k_end; ++k) acc += A[(m0 + r) * am + k * ak] * B[k * N + n];
                        out[(m0 + r) * N + n] += alpha * acc;
                    }
            }
        }
    }
}

// out (M,N) = A (M,K) . B (N,K)^T, through a transposed copy of B
inline void matmul_nt(const double* A, const double* B, double* out, size_t M, size_t N, size_t K) {
    std::vector<double> bt(K * N);
    for (size_t n = 0; n < N; ++n)
        for (size_t k = 0; k < K; ++k) bt[k * N + n] = B[n * K + k];
    std::fill(out, out + M * N, 0.0);
    gemm_acc(A, K, 1, bt.data(), out, M, N, K, 1.0);
}

// out (M,N) = A (M,K) . B (K,N)
inline void matmul_nn(const double* A, const double* B, double* out, size_t M, size_t K, size_t N) {
    std::fill(out, out + M * N, 0.0);
    gemm_acc(A, K, 1, B, out, M, N, K, 1.0);
}

// out (M,N) += alpha * A (K,M)^T . B (K,N)   (weight gradients: a sum over the T rows)
inline void matmul_tn_acc(const double* A, const double* B, double* out, size_t K, size_t M, size_t N, double alpha) {
    gemm_acc(A, 1, M, B, out, M, N, K, alpha);
}

// y = x / sqrt(mean(x^2) + eps) per row of n.
inline void rms_norm(const double* x, double* y, double* rstd, size_t rows, size_t n) {
    for (size_t r = 0; r < rows; ++r) {
        const double s = 1.0 / std::sqrt(dot(x + r * n, x + r * n, n) / double(n) + kRmsEps);
        rstd[r] = s;
        for (size_t i = 0; i < n; ++i) y[r * n + i] = x[r * n + i] * s;
    }
}

// dx += rstd * (dy - y * (dy . y) / n), written in terms of the output y = x * rstd.
inline void rms_norm_backward_acc(const double* y, const double* rstd, const double* dy, double* dx, size_t rows,
                                  size_t n) {
    for (size_t r = 0; r < rows; ++r) {
        const double m = dot(dy + r * n, y + r * n, n) / double(n);
        for (size_t i = 0; i < n; ++i) dx[r * n + i] += rstd[r] * (dy[r * n + i] - y[r * n + i] * m);
    }
}

// XSA on one head's row of D (record 82): y' = y - alpha p v^, v^ = v / n, n = max(|v|, kXsaEps),
// p = y . v^. Writes y' into y_out (not aliasing y) and n into *n_out; returns p.
inline double xsa_forward_row(const double* y, const double* v, double alpha, size_t D, double* y_out,
                              double* n_out) {
    const double n = std::max(std::sqrt(dot(v, v, D)), kXsaEps);
    const double p = dot(y, v, D) / n;
    for (size_t d = 0; d < D; ++d) y_out[d] = y[d] - alpha * p * (v[d] / n);
    *n_out = n;
    return p;
}

// Its backward from g = dL/dy' (y, v, alpha and the forward's p, n): writes dy (which may alias g:
// every read of g comes first), adds dL/dv into dv and returns dL/dalpha = -p q, with q = g . v^.
// dy = g - alpha q v^ and dL/dv^ = -alpha (p g + q y). Through the normalize: where |v| > eps,
// dv = (I - v^ v^T) dL/dv^ / |v| = -alpha (p g + q y - 2 p q v^) / |v| (dL/dv^ . v^ = -2 alpha p q; moving
// v along v^ leaves v^ unchanged); where the clamp holds, v^ = v / eps is linear: dv = dL/dv^ / eps.
inline double xsa_backward_row(const double* y, const double* v, double alpha, double p, double n, const double* g,
                               size_t D, double* dy, double* dv) {
    const double q = dot(g, v, D) / n;
    const double along = n > kXsaEps ? 2.0 * p * q : 0.0;  // coefficient of v^ that the projection removes
    for (size_t d = 0; d < D; ++d) dv[d] += -alpha * (p * g[d] + q * y[d] - along * (v[d] / n)) / n;
    for (size_t d = 0; d < D; ++d) dy[d] = g[d] - alpha * q * (v[d] / n);
    return -p * q;
}

// ---- record 81's MUDD blocks ----
// F.gelu (exact erf form) and its derivative Phi(z) + z phi(z).
inline double gelu_erf(double z) { return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0))); }
inline double gelu_erf_grad(double z) {
    return 0.5 * (1.0 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-0.5 * z * z) / std::sqrt(2.0 * kPi);
}

// Upstream's forward_mudd(h, block, n): m.coef (T, n) = (gelu(h W1[block]^T) W2[block, :n]^T + b2[block, :n])
// * 0.1, per token; m.z keeps the hidden layer before the gelu.
inline void mudd_forward(const Config& c, const Params& p, int block, int n, const double* h, Tape::Mudd& m) {
    const size_t T = c.T, C = c.C, M = kMuddDim, N = n;
    const double* w1 = p.mudd_w1.data() + size_t(block) * M * C;
    const double* w2 = p.mudd_w2.data() + size_t(block) * kMuddCoefs * M;  // its first n rows
    const double* b2 = p.mudd_b2.data() + size_t(block) * kMuddCoefs;
    m.z.resize(T * M);
    matmul_nt(h, w1, m.z.data(), T, M, C);
    std::vector<double> gz(T * M);
    for (size_t e = 0; e < T * M; ++e) gz[e] = gelu_erf(m.z[e]);
    m.coef.resize(T * N);
    matmul_nt(gz.data(), w2, m.coef.data(), T, N, M);
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < N; ++j) m.coef[t * N + j] = (m.coef[t * N + j] + b2[j]) * kMuddScale;
}

// The backward of a two-layer gelu head (MUDD's blocks, the MUDD gate) from d pre (T, N), its output before any
// scale: d b2 = sum_t d pre; d W2 = d pre^T gelu(z); dz = (d pre W2) gelu'(z); d W1 = dz^T h; dh += dz W1.
inline void gelu_head_backward(size_t T, size_t C, size_t N, const std::vector<double>& dpre, const std::vector<double>& z,
                               const double* h, const double* w1, const double* w2, double* g_w1, double* g_w2,
                               double* g_b2, double* dh) {
    const size_t M = kMuddDim;
    std::vector<double> gz(T * M), dz(T * M), dh_head(T * C);
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < N; ++j) g_b2[j] += dpre[t * N + j];
    for (size_t e = 0; e < T * M; ++e) gz[e] = gelu_erf(z[e]);
    matmul_tn_acc(dpre.data(), gz.data(), g_w2, T, N, M, 1.0);
    matmul_nn(dpre.data(), w2, dz.data(), T, N, M);
    for (size_t e = 0; e < T * M; ++e) dz[e] *= gelu_erf_grad(z[e]);
    matmul_tn_acc(dz.data(), h, g_w1, T, M, C, 1.0);
    matmul_nn(dz.data(), w1, dh_head.data(), T, M, C);
    axpy(1.0, dh_head.data(), dh, T * C);
}

// Its backward from dcoef (T, n), the coefficients' gradient: d pre = 0.1 dcoef, then the head's.
inline void mudd_backward(const Config& c, const Params& p, int block, int n, const double* h, const Tape::Mudd& m,
                          const std::vector<double>& dcoef, double* dh, Params& g) {
    const size_t T = c.T, C = c.C, M = kMuddDim, N = n;
    const size_t w1_at = size_t(block) * M * C, w2_at = size_t(block) * kMuddCoefs * M, b2_at = size_t(block) * kMuddCoefs;
    std::vector<double> dpre(T * N);
    for (size_t e = 0; e < T * N; ++e) dpre[e] = kMuddScale * dcoef[e];
    gelu_head_backward(T, C, N, dpre, m.z, h, p.mudd_w1.data() + w1_at, p.mudd_w2.data() + w2_at,
                       g.mudd_w1.data() + w1_at, g.mudd_w2.data() + w2_at, g.mudd_b2.data() + b2_at, dh);
}

// ---- records 85-86's MUDD gate, XSA and DC-MHA ----
// The gate's scale as the model multiplies by it (upstream's bf16 cast, Config::stream_lambda).
inline double gate_scale(const Config& c, const Params& p) { return c.stream_lambda(p.mudd_gate_scale[0]); }

// Upstream's forward_mudd_gate(h, id, n): m.coef (T, n) = (gelu(h Wg1[id]^T) Wg2[id, :n]^T + bg2[id, :n]) * s.
inline void gate_forward(const Config& c, const Params& p, int id, const double* h, Tape::Gate& m) {
    const size_t T = c.T, C = c.C, M = kMuddDim, N = kGateCoefs[id];
    const double* w1 = p.mudd_gate_w1.data() + size_t(id) * M * C;
    const double* w2 = p.mudd_gate_w2.data() + size_t(id) * kGateMaxCoefs * M;
    const double* b2 = p.mudd_gate_b2.data() + size_t(id) * kGateMaxCoefs;
    m.z.resize(T * M);
    matmul_nt(h, w1, m.z.data(), T, M, C);
    std::vector<double> gz(T * M);
    for (size_t e = 0; e < T * M; ++e) gz[e] = gelu_erf(m.z[e]);
    m.pre.resize(T * N);
    matmul_nt(gz.data(), w2, m.pre.data(), T, N, M);
    m.coef.resize(T * N);
    const double sc = gate_scale(c, p);
    for (size_t t = 0; t < T; ++t)
        for (size_t j = 0; j < N; ++j) {
            m.pre[t * N + j] += b2[j];
            m.coef[t * N + j] = m.pre[t * N + j] * sc;
        }
}

// Its backward from dcoef (T, n): d s = sum dcoef pre; d pre = s dcoef, then the head's.
inline void gate_backward(const Config& c, const Params& p, int id, const double* h, const Tape::Gate& m,
                          const std::vector<double>& dcoef, double* dh, Params& g) {
    const size_t T = c.T, C = c.C, M = kMuddDim, N = kGateCoefs[id];
    const size_t w1_at = size_t(id) * M * C, w2_at = size_t(id) * kGateMaxCoefs * M, b2_at = size_t(id) * kGateMaxCoefs;
    const double sc = gate_scale(c, p);
    std::vector<double> dpre(T * N);
    for (size_t e = 0; e < T * N; ++e) {
        g.mudd_gate_scale[0] += dcoef[e] * m.pre[e];
        dpre[e] = sc * dcoef[e];
    }
    gelu_head_backward(T, C, N, dpre, m.z, h, p.mudd_gate_w1.data() + w1_at, p.mudd_gate_w2.data() + w2_at,
                       g.mudd_gate_w1.data() + w1_at, g.mudd_gate_w2.data() + w2_at, g.mudd_gate_b2.data() + b2_at, dh);
}

// Record 86's XSA on one head's row of D (upstream 003ff3e2 L1152-1156): y' = y - alpha c v, c = (y . v) / n2,
// n2 = max(|v|^2, 1e-8). Writes y' into y_out (not aliasing y) and n2 into *n2_out; returns c.
inline double xsa_r86_forward_row(const double* y, const double* v, double alpha, size_t D, double* y_out,
                                  double* n2_out) {
    const double n2 = std::max(dot(v, v, D), kXsaR86Eps);
    const double cc = dot(y, v, D) / n2;
    for (size_t d = 0; d < D; ++d) y_out[d] = y[d] - alpha * cc * v[d];
    *n2_out = n2;
    return cc;
}
// Its backward from g = dL/dy' (dy may alias g): with q = g . v, dy = g - alpha (q / n2) v,
// dv += -alpha (c g + (q / n2) y - 2 c (q / n2) v) (the last term only where the clamp does not hold: there n2 is
// the constant 1e-8), and returns dL/dalpha = -c q.
inline double xsa_r86_backward_row(const double* y, const double* v, double alpha, double cc, double n2,
                                   const double* g, size_t D, double* dy, double* dv) {
    const double q = dot(g, v, D), qn = q / n2;
    const double along = n2 > kXsaR86Eps ? 2.0 * cc * qn : 0.0;
    for (size_t d = 0; d < D; ++d) dv[d] += -alpha * (cc * g[d] + qn * y[d] - along * v[d]);
    for (size_t d = 0; d < D; ++d) dy[d] = g[d] - alpha * qn * v[d];
    return -cc * q;
}

// The start of token t's document (the last cu_seqlens entry <= t).
inline int document_start(const Batch& b, int t) {
    int start = 0;
    for (size_t i = 0; i + 1 < b.cu_seqlens.size(); ++i)
        if (b.cu_seqlens[i] <= t && t < b.cu_seqlens[i + 1]) start = b.cu_seqlens[i];
    return start;
}

// Record 85's DC-MHA (Config::dc_mha) on layer L: L.y_dc from L.y, L.q, L.k, L.v and the token's w1/w2 columns
// (the formulas at Config::dc_mha), keeping P, A, the normed w1 and its 1/rms.
inline void dc_forward(const Config& c, const Batch& b, double scale, LayerTape& L) {
    const size_t T = c.T, C = c.C, H = c.H, D = c.D, W = size_t(c.dc_window);
    L.y_dc = L.y;
    L.dc_p.assign(T * H * W, 0.0);
    L.dc_a.assign(T * W, 0.0);
    L.dc_w1.resize(T * H);
    L.dc_rstd.resize(T);
    std::vector<double> sv(W);
    for (size_t t = 0; t < T; ++t) {
        const int s0 = std::max(document_start(b, int(t)), int(t) - int(W) + 1);
        const size_t n = t + 1 - size_t(s0);  // keys s = t - j, j < n
        double ms = 0.0;
        for (size_t h = 0; h < H; ++h) ms += L.tok_dc_w1[t * H + h] * L.tok_dc_w1[t * H + h];
        const double r = 1.0 / std::sqrt(ms / double(H) + kDcRmsEps);
        L.dc_rstd[t] = r;
        for (size_t h = 0; h < H; ++h) L.dc_w1[t * H + h] = L.tok_dc_w1[t * H + h] * r;
        for (size_t h = 0; h < H; ++h) {
            double* P = L.dc_p.data() + (t * H + h) * W;
            double mx = -INFINITY, sum = 0.0;
            for (size_t j = 0; j < n; ++j) {
                sv[j] = scale * dot(L.q.data() + (t * H + h) * D, L.k.data() + ((t - j) * H + h) * D, D);
                mx = std::max(mx, sv[j]);
            }
            for (size_t j = 0; j < n; ++j) sum += (P[j] = std::exp(sv[j] - mx));
            for (size_t j = 0; j < n; ++j) P[j] /= sum;
            for (size_t j = 0; j < n; ++j) L.dc_a[t * W + j] += L.dc_w1[t * H + h] * P[j];
        }
        for (size_t h = 0; h < H; ++h) {
            const double w2 = L.tok_dc_w2[t * H + h];
            double* out = L.y_dc.data() + t * C + h * D;
            for (size_t j = 0; j < n; ++j) axpy(w2 * L.dc_a[t * W + j], L.v.data() + ((t - j) * H + h) * D, out, D);
        }
    }
}

// Its backward from go = dL/d y_dc: y's gradient is go itself (the caller's); adds into dq, dk, dv (as attended)
// and writes the w1 columns' (through the rms norm) and w2's gradients into dw1, dw2 (T,H), the sums of squares of
// their products into sq1, sq2 (T,H):
//   dm_h[j] = go_h[t] . v_h[t-j]; dv_h[t-j] += w2[h] A[j] go_h[t]; dw2[h] = sum_j A[j] dm_h[j];
//   dA[j] = sum_h w2[h] dm_h[j]; dw1n[h] = sum_j dA[j] P_h[j]; dS_h[j] = P_h[j] w1[h] (dA[j] - sum_j' P_h[j'] dA[j']);
//   dq_h[t] += scale sum_j dS_h[j] k_h[t-j]; dk_h[t-j] += scale dS_h[j] q_h[t];
//   dw1[h] = r (dw1n[h] - w1[h] mean_h'(dw1n[h'] w1[h'])) (rms_norm's backward, w1 the normed values, r the 1/rms).
inline void dc_backward(const Config& c, const Batch& b, double scale, const LayerTape& L, const std::vector<double>& go,
                        double* dq, double* dk, double* dv, double* dw1, double* dw2, double* sq1, double* sq2) {
    const size_t T = c.T, H = c.H, D = c.D, W = size_t(c.dc_window);
    std::vector<double> dm(H * W), da(W), gv(H * W), dw1n(H);
    for (size_t t = 0; t < T; ++t) {
        const int s0 = std::max(document_start(b, int(t)), int(t) - int(W) + 1);
        const size_t n = t + 1 - size_t(s0);
        const double* A = L.dc_a.data() + t * W;
        std::fill(da.begin(), da.end(), 0.0);
        for (size_t h = 0; h < H; ++h) {
            const double w2 = L.tok_dc_w2[t * H + h];
            const double* g = go.data() + (t * H + h) * D;
            double s2 = 0.0;
            dw2[t * H + h] = 0.0;
            for (size_t j = 0; j < n; ++j) {
                const size_t o = ((t - j) * H + h) * D;
                double m = 0.0, m2 = 0.0;
                for (size_t d = 0; d < D; ++d) m += g[d] * L.v[o + d], m2 += (g[d] * L.v[o + d]) * (g[d] * L.v[o + d]);
                dm[h * W + j] = m;
                gv[h * W + j] = m2;
                axpy(w2 * A[j], g, dv + o, D);
                dw2[t * H + h] += A[j] * m;
                s2 += A[j] * A[j] * m2;
                da[j] += w2 * m;
            }
            sq2[t * H + h] = s2;
        }
        double mean = 0.0;
        for (size_t h = 0; h < H; ++h) {
            const double* P = L.dc_p.data() + (t * H + h) * W;
            const double w1 = L.dc_w1[t * H + h];
            double pda = 0.0, s1 = 0.0;
            for (size_t j = 0; j < n; ++j) {
                pda += P[j] * da[j];
                double g2 = 0.0;  // the products w2[h'] go . v of dA[j]
                for (size_t h2 = 0; h2 < H; ++h2)
                    g2 += L.tok_dc_w2[t * H + h2] * L.tok_dc_w2[t * H + h2] * gv[h2 * W + j];
                s1 += P[j] * P[j] * g2;
            }
            dw1n[h] = pda;
            sq1[t * H + h] = s1;
            mean += pda * w1;
            const double* qt = L.q.data() + (t * H + h) * D;
            for (size_t j = 0; j < n; ++j) {
                const double ds = P[j] * w1 * (da[j] - pda);
                const size_t o = ((t - j) * H + h) * D;
                axpy(scale * ds, L.k.data() + o, dq + (t * H + h) * D, D);
                axpy(scale * ds, qt, dk + o, D);
            }
        }
        mean /= double(H);
        const double r = L.dc_rstd[t];
        for (size_t h = 0; h < H; ++h) {
            dw1[t * H + h] = r * (dw1n[h] - L.dc_w1[t * H + h] * mean);
            sq1[t * H + h] *= r * r;
        }
    }
}

// ---- record 84's FP8 MLP up-projection (Config::mlp_up_fp8) ----
// Upstream quantizes W1 eagerly after each optimizer step (quantize_mlp_fp8, bf16 tensor ops) and the
// normed input inside the compiled forward. Rounding points, each as upstream's code rounds:
//   w_s  = bf16(fp32(bf16(max|W1|) / 448)), amax clamped >= 1e-12  (eager bf16: fp32 division, then bf16)
//   W1q  = e4m3(bf16(fp32(W1 / w_s)))                              (eager cast; |W1 / w_s| <= 448 (1 + 2^-8)
//                                                                    stays below 464, so it never saturates)
//   a    = max(bf16(max|normed|), 1e-12)                            (the amax of upstream's bf16 normed, which
//                                                                    rounding commutes with)
//   xq   = e4m3_satfinite(fp32(normed * fp32(448 / a)))            (compiled: inductor computes the chain in fp32
//                                                                    and casts with cvt.rn.satfinite; no bf16
//                                                                    rounding of 448 / a or of the product.
//                                                                    Upstream writes 448.0 / amax, which torch
//                                                                    traces as reciprocal(a) * 448: at most one
//                                                                    fp32 ulp from fp32(448 / a))
//   dq   = fp32(fp32(w_s * a) / 448)                                (the fp32 buffer's copy_, mul_, div_)
//   pre  = (xq . W1q^T) * dq, accumulated in double (upstream: fp32 with Hopper's fast FP8 accumulation,
//          then bf16)
// Only the forward's values change: the backward reads the unquantized normed input and W1.
inline double mlp_fp8_weight_scale(const double* w, size_t n) {
    double amax = 0.0;
    for (size_t e = 0; e < n; ++e) amax = std::max(amax, std::fabs(w[e]));
    return round_bf16(round_fp32(std::max(round_bf16(amax), round_bf16(1e-12)) / 448.0));
}
inline double mlp_fp8_input_amax(const double* x, size_t n) {
    double amax = 0.0;
    for (size_t e = 0; e < n; ++e) amax = std::max(amax, std::fabs(x[e]));
    return std::max(round_bf16(amax), 1e-12);
}
inline void mlp_up_fp8_forward(const double* xm, const double* fc, size_t T, size_t F, size_t C, double* pre,
                               double* a_out, double* dequant_out) {
    const double w_s = mlp_fp8_weight_scale(fc, F * C), a = mlp_fp8_input_amax(xm, T * C);
    const double x_scale = round_fp32(448.0 / a), dequant = round_fp32(round_fp32(w_s * a) / 448.0);
    std::vector<double> wq(F * C), xq(T * C);
    for (size_t e = 0; e < F * C; ++e) wq[e] = round_e4m3(round_bf16(round_fp32(fc[e] / w_s)));
    for (size_t e = 0; e < T * C; ++e) xq[e] = round_e4m3_satfinite(round_fp32(xm[e] * x_scale));
    matmul_nt(xq.data(), wq.data(), pre, T, F, C);
    for (size_t e = 0; e < T * F; ++e) pre[e] *= dequant;
    *a_out = a;
    *dequant_out = dequant;
}

}  // namespace detail

// ---- attention core: varlen causal sliding-window softmax attention ----
// q, k, v, y are (T, H, D) in model head order. Non-paired: a sequence of T rows, H slots,
// documents [cu[d], cu[d+1]). Paired: 2T rows, H/2 slots, documents doubled; row r, slot s reads
// head (r % 2) * H/2 + s of token r / 2 (upstream's memory reinterpretation). Query row i sees
// key rows j of its document with i - window <= j <= i. lse: (rows * slots), row-major.
struct AttnShape {
    int T = 0, H = 0, D = 0, window = 0;
    bool paired = false;
    double scale = 0.1;
    const std::vector<int>* cu_seqlens = nullptr;

    int rows() const { return paired ? 2 * T : T; }
    int slots() const { return paired ? H / 2 : H; }
    size_t offset(int row, int slot) const {  // element offset of (row, slot) in the (T, H, D) arrays
        const int t = paired ? row / 2 : row;
        const int h = paired ? (row % 2) * (H / 2) + slot : slot;
        return (size_t(t) * H + h) * D;
    }
    int stride() const { return paired ? 2 : 1; }
    void validate() const {
        require(T >= 1 && H >= 1 && D >= 1 && window >= 0 && cu_seqlens && !cu_seqlens->empty(),
                "attention shape T=%d H=%d D=%d window=%d needs positive sizes, a window >= 0 and cu_seqlens", T, H, D,
                window);
        require(!paired || H % 2 == 0, "paired attention needs an even head count (H=%d)", H);
        require(cu_seqlens->front() == 0 && cu_seqlens->back() == T, "attention cu_seqlens must run from 0 to T=%d", T);
    }
};

inline void attention_forward(const AttnShape& s, const double* q, const double* k, const double* v, double* y,
                              double* lse) {
    s.validate();
    const std::vector<int>& cu = *s.cu_seqlens;
    std::vector<double> p;
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
        const int lo = cu[d] * s.stride(), hi = cu[d + 1] * s.stride();
        for (int i = lo; i < hi; ++i) {
            const int j0 = std::max(lo, i - s.window);
            for (int sl = 0; sl < s.slots(); ++sl) {
                const double* qi = q + s.offset(i, sl);
                p.assign(i - j0 + 1, 0.0);
                double mx = -INFINITY;
                for (int j = j0; j <= i; ++j) {
                    p[j - j0] = s.scale * detail::dot(qi, k + s.offset(j, sl), s.D);
                    mx = std::max(mx, p[j - j0]);
                }
                double sum = 0.0;
                for (double& e : p) sum += (e = std::exp(e - mx));
                double* yi = y + s.offset(i, sl);
                std::fill(yi, yi + s.D, 0.0);
                for (int j = j0; j <= i; ++j) detail::axpy(p[j - j0] / sum, v + s.offset(j, sl), yi, s.D);
                lse[size_t(i) * s.slots() + sl] = mx + std::log(sum);
            }
        }
    }
}

// dq, dk, dv (T, H, D) are overwritten. dS = P (dP - dy.y), dq = scale dS k, dk = scale dS^T q, dv = P^T dy.
inline void attention_backward(const AttnShape& s, const double* q, const double* k, const double* v, const double* y,
                               const double* lse, const double* dy, double* dq, double* dk, double* dv) {
    s.validate();
    const size_t n = size_t(s.T) * s.H * s.D;
    std::fill(dq, dq + n, 0.0);
    std::fill(dk, dk + n, 0.0);
    std::fill(dv, dv + n, 0.0);
    const std::vector<int>& cu = *s.cu_seqlens;
    for (size_t d = 0; d + 1 < cu.size(); ++d) {
        const int lo = cu[d] * s.stride(), hi = cu[d + 1] * s.stride();
        for (int i = lo; i < hi; ++i) {
            const int j0 = std::max(lo, i - s.window);
            for (int sl = 0; sl < s.slots(); ++sl) {
                const size_t oi = s.offset(i, sl);
                const double L = lse[size_t(i) * s.slots() + sl];
                const double di = detail::dot(dy + oi, y + oi, s.D);
                for (int j = j0; j <= i; ++j) {
                    const size_t oj = s.offset(j, sl);
                    const double pij = std::exp(s.scale * detail::dot(q + oi, k + oj, s.D) - L);
                    const double ds = pij * (detail::dot(dy + oi, v + oj, s.D) - di);
                    detail::axpy(pij, dy + oi, dv + oj, s.D);
                    detail::axpy(s.scale * ds, k + oj, dq + oi, s.D);
                    detail::axpy(s.scale * ds, q + oi, dk + oj, s.D);
                }
            }
        }
    }
}

namespace detail {

inline AttnShape attn_shape(const Config& c, const Batch& b, int layer) {
    AttnShape s;
    s.T = c.T;
    s.H = c.H;
    s.D = c.D;
    s.window = c.window(layer);
    s.paired = c.paired[layer];
    s.scale = c.yarn_of(layer).attn_scale;
    s.cu_seqlens = &b.cu_seqlens;
    return s;
}

inline const double* value_row(const Config& c, const Params& p, int table, int token) {
    return p.value_embeds.data() + (size_t(table) * c.V + token) * c.C;
}
// What the ve gate reads of a token: xa[:12], or (record 80, unpaired layers) cat(xa[:6], ve[:6]).
inline std::vector<double> gate_input(const Config& c, int layer, const double* xa, const double* ve) {
    std::vector<double> in(xa, xa + kGateDim);
    if (c.gate_reads_ve(layer)) std::copy(ve, ve + kGateDim / 2, in.begin() + kGateDim / 2);
    return in;
}

// One attention block: norm(L.x_mix) -> L.o_raw (its output is sa1 * o_raw), keeping what the
// backward needs.
inline void attention_block_forward(const Config& c, const Params& p, const Batch& b, int layer, LayerTape& L) {
    const size_t T = c.T, C = c.C, H = c.H, D = c.D;
    const int bank = attn_bank_index(layer), table = c.table_of(layer);
    const double* W = p.attn_bank.data() + size_t(bank) * 4 * C * C;
    const double sa0 = p.scalars[c.scalar_slots().sa_of(layer, 0)];
    const Yarn& yarn = c.yarn_of(layer);
    const bool paired = c.paired[layer];

    L.xa.resize(T * C);
    L.rstd_a.resize(T);
    rms_norm(L.x_mix.data(), L.xa.data(), L.rstd_a.data(), T, C);
    L.qkv_raw.resize(T * 3 * C);
    matmul_nt(L.xa.data(), W, L.qkv_raw.data(), T, 3 * C, C);

    L.qn.resize(T * C);
    L.kn.resize(T * C);
    L.rstd_q.resize(T * H);
    L.rstd_k.resize(T * H);
    L.q.resize(T * C);
    L.k.resize(T * C);
    L.v.resize(T * C);
    std::vector<double> tmp(D);
    for (size_t t = 0; t < T; ++t)
        for (size_t h = 0; h < H; ++h) {
            const double* raw = L.qkv_raw.data() + t * 3 * C + h * D;
            for (int which = 0; which < 2; ++which) {  // q, then k
                for (size_t d = 0; d < D; ++d) tmp[d] = sa0 * raw[which * C + d];
                double* n = (which ? L.kn : L.qn).data() + (t * H + h) * D;
                rms_norm(tmp.data(), n, (which ? L.rstd_k : L.rstd_q).data() + t * H + h, 1, D);
                double* r = (which ? L.k : L.q).data() + (t * H + h) * D;
                std::copy(n, n + D, r);
                rotary_apply(yarn, rotary_position(paired, int(t), int(h)), r, int(D));
            }
            for (size_t d = 0; d < D; ++d) L.v[(t * H + h) * D + d] = sa0 * raw[2 * C + d];
        }
    if (c.has_key_offset(layer))  // keys' unrotated half comes from the previous token (any document)
        for (size_t t = T - 1; t >= 1; --t)
            for (size_t h = 0; h < H; ++h)
                for (size_t d = D / 2; d < D; ++d) L.k[(t * H + h) * D + d] = L.k[((t - 1) * H + h) * D + d];
    if (table >= 0 && !L.mudd_ve_gate.empty()) {  // MUDD's layer: v += g ve + v_mudd (upstream's aux_v)
        L.ve_sig.clear();
        for (size_t t = 0; t < T; ++t) {
            const double* ve = value_row(c, p, table, b.inputs[t]);
            for (size_t h = 0; h < H; ++h) {
                const size_t o = (t * H + h) * D;
                const double g = L.mudd_ve_gate[t * H + h];
                for (size_t d = 0; d < D; ++d) L.v[o + d] += g * ve[h * D + d] + L.v_mudd[o + d];
            }
        }
    } else if (table >= 0) {
        L.ve_sig.resize(T * H);
        const double* gate = p.ve_gate_bank.data() + size_t(table) * H * kGateDim;
        for (size_t t = 0; t < T; ++t) {
            const double* ve = value_row(c, p, table, b.inputs[t]);
            const std::vector<double> in = gate_input(c, layer, L.xa.data() + t * C, ve);
            for (size_t h = 0; h < H; ++h) {
                const double sg = sigmoid(dot(in.data(), gate + h * kGateDim, kGateDim));
                L.ve_sig[t * H + h] = sg;
                axpy(2.0 * sg, ve + h * D, L.v.data() + (t * H + h) * D, D);
            }
        }
    }

    const AttnShape s = attn_shape(c, b, layer);
    L.y.resize(T * C);
    L.lse.resize(size_t(s.rows()) * s.slots());
    attention_forward(s, L.q.data(), L.k.data(), L.v.data(), L.y.data(), L.lse.data());

    // record 85's DC-MHA: the heads' local maps mixed into y (what XSA and the gate then read)
    L.y_dc.clear();
    if (c.dc_layer(layer)) dc_forward(c, b, s.scale, L);
    const std::vector<double>& y_att = c.dc_layer(layer) ? L.y_dc : L.y;

    // XSA: each head's output loses alpha of its component along the v it read at its own token (record 86: per
    // token strengths and the projection form)
    L.y_xsa.clear();
    L.xsa_p.clear();
    L.xsa_n.clear();
    L.xsa_c.clear();
    L.xsa_n2.clear();
    if (c.xsa[layer] && c.mudd_gate) {
        L.y_xsa.resize(T * C);
        L.xsa_c.resize(T * H);
        L.xsa_n2.resize(T * H);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) {
                const size_t o = (t * H + h) * D;
                const double alpha = std::tanh(L.tok_xsa[t * H + h]);
                L.xsa_c[t * H + h] = xsa_r86_forward_row(y_att.data() + o, L.v.data() + o, alpha, D,
                                                         L.y_xsa.data() + o, L.xsa_n2.data() + t * H + h);
            }
    } else if (c.xsa[layer]) {
        L.y_xsa.resize(T * C);
        L.xsa_p.resize(T * H);
        L.xsa_n.resize(T * H);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) {
                const size_t o = (t * H + h) * D;
                const double alpha = c.xsa_alpha(p.xsa_alphas[size_t(layer) * H + h]);
                L.xsa_p[t * H + h] = xsa_forward_row(y_att.data() + o, L.v.data() + o, alpha, D, L.y_xsa.data() + o,
                                                     L.xsa_n.data() + t * H + h);
            }
    }
    const std::vector<double>& y_gate_in = c.xsa[layer] ? L.y_xsa : y_att;

    L.yg.resize(T * C);
    if (c.mudd_gate) {  // record 85: the raw per-token column on the gated layers, none elsewhere
        L.attn_sig = L.tok_out;
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) {
                const double sg = L.attn_sig.empty() ? 1.0 : L.attn_sig[t * H + h];
                for (size_t d = 0; d < D; ++d) L.yg[(t * H + h) * D + d] = sg * y_gate_in[(t * H + h) * D + d];
            }
    } else {
        L.attn_sig.resize(T * H);
        const double* agate = p.attn_gate_bank.data() + size_t(bank) * H * kGateDim;
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) {
                const double sg = sigmoid(dot(L.xa.data() + t * C, agate + h * kGateDim, kGateDim));
                L.attn_sig[t * H + h] = sg;
                for (size_t d = 0; d < D; ++d) L.yg[(t * H + h) * D + d] = sg * y_gate_in[(t * H + h) * D + d];
            }
    }
    L.o_raw.resize(T * C);
    matmul_nt(L.yg.data(), W + 3 * C * C, L.o_raw.data(), T, C, C);
}

// One MLP block: norm(L.x_attn) -> L.mlp_out, keeping what the backward needs.
inline void mlp_block_forward(const Config& c, const Params& p, int layer, LayerTape& L) {
    const size_t T = c.T, C = c.C, F = c.hidden();
    const double* fc = p.mlp_bank.data() + size_t(2 * layer) * F * C;
    const double* proj = fc + F * C;
    L.xm.resize(T * C);
    L.rstd_m.resize(T);
    rms_norm(L.x_attn.data(), L.xm.data(), L.rstd_m.data(), T, C);
    L.pre.resize(T * F);
    L.mlp_fp8_a = L.mlp_fp8_dequant = 0.0;
    if (c.training && c.mlp_up_fp8)
        mlp_up_fp8_forward(L.xm.data(), fc, T, F, C, L.pre.data(), &L.mlp_fp8_a, &L.mlp_fp8_dequant);
    else matmul_nt(L.xm.data(), fc, L.pre.data(), T, F, C);
    std::vector<double> post(T * F);
    for (size_t e = 0; e < T * F; ++e) post[e] = L.pre[e] > 0.0 ? L.pre[e] * L.pre[e] : 0.0;
    L.mlp_out.resize(T * C);
    matmul_nn(post.data(), proj, L.mlp_out.data(), T, F, C);
}

inline double softcap(double l) { return kSoftcapA * sigmoid((l + kSoftcapB) / kSoftcapC); }

// Layer 6's skip add: out = in + sigmoid(skip_lambda) * 2 sigmoid(x0[:12] . skip_gate) * x_out[3] (x0:
// x0_read; the forward keeps the gate's sigmoid in tp.skip_sig).
inline void skip_add_forward(const Config& c, const Params& p, const Tape& tp, const std::vector<double>& in,
                             std::vector<double>& out) {
    const size_t T = c.T, C = c.C;
    const double sl = sigmoid(p.scalars[c.scalar_slots().skip]);
    const std::vector<double>& skip = tp.layers[kSkipFrom].x_out;
    out = in;
    if (c.mudd_gate) {  // record 85: sigmoid(skip_lambda) G1[t, 28], no learned gate
        for (size_t t = 0; t < T; ++t)
            axpy(sl * tp.gate[1].coef[t * kGateCoefs[1] + kGateSkipCol], skip.data() + t * C, out.data() + t * C, C);
        return;
    }
    for (size_t t = 0; t < T; ++t) axpy(sl * 2.0 * tp.skip_sig[t], skip.data() + t * C, out.data() + t * C, C);
}

// Record 71's layers: x_mix = resid[i] x_in + x0_lambda[i] x0 + bigram[i] xb (layer 6: x_in after the
// skip add), x_attn = x_mix + attn(norm(x_mix)), x_out = x_attn + mlp(norm(x_attn)); scalars hold
// resid and bigram lambdas.
inline void stream_r71_forward(const Config& c, const Params& p, const Batch& b, Tape& tp) {
    const size_t T = c.T, C = c.C;
    const double* S = p.scalars.data();
    const std::vector<double>* x = &tp.x0;
    for (int i = 0; i < kLayers; ++i) {
        LayerTape& L = tp.layers[i];
        if (i == kSkipTo) skip_add_forward(c, p, tp, *x, L.x_in);
        else L.x_in = *x;
        // layer 0: x is x0, so (resid + x0_lambda) * x0 is the same as the general form
        const double r = S[scalar_resid(i)], a0 = p.x0_lambdas[i], bl = S[scalar_bigram(i)];
        L.x_mix.resize(T * C);
        for (size_t e = 0; e < T * C; ++e) L.x_mix[e] = r * L.x_in[e] + a0 * tp.x0[e] + bl * tp.x_bigram[e];
        if (attn_bank_index(i) >= 0) {
            attention_block_forward(c, p, b, i, L);
            const double sa1 = S[scalar_sa(i, 1)];
            L.x_attn.resize(T * C);
            for (size_t e = 0; e < T * C; ++e) L.x_attn[e] = L.x_mix[e] + sa1 * L.o_raw[e];
        } else {
            L.x_attn = L.x_mix;
        }
        mlp_block_forward(c, p, i, L);
        L.x_out.resize(T * C);
        for (size_t e = 0; e < T * C; ++e) L.x_out[e] = L.mlp_out[e] + L.x_attn[e];
        x = &L.x_out;
    }
}

// Record 80's stream before layer 0: x0 + lb[0] xb, xb (T, bigram width) added into channels [0, bigram
// width) of the norm's output x0.
inline std::vector<double> stream_start(const Config& c, const Params& p, const Tape& tp) {
    const size_t T = c.T, C = c.C, W = c.bigram_width();
    std::vector<double> x(tp.x0);
    if (c.mudd_gate) {  // record 85: per token, the pre gate's layer-0 bigram column
        const int col = gate_cols(0).bigram;
        for (size_t t = 0; t < T; ++t)
            axpy(tp.gate[0].coef[t * kGateCoefs[0] + col], tp.x_bigram.data() + t * W, x.data() + t * C, W);
        return x;
    }
    axpy_rows(c.stream_lambda(p.bigram_lambdas[0]), tp.x_bigram.data(), W, x.data(), C, T, W);
    return x;
}

// MUDD's layer 10 (Config::mudd), given its x_in (h9) and x_mix: block 0's coefficients c from h9, then
//   v += g ve + v_mudd (in the attention block), v_mudd = c0 h0 + c1 h7 + c2 h9, g = c6 | c7 per head half
//   r = (1 + c5) h9 + c3 h0 + c4 h7
//   x_attn = c8 r + c9 (sa1 o_raw) + c10 h0, x_attn[:, :bigram width] += c11 xb
//   x_out = c12 x_attn + c13 mlp(norm(x_attn))
// each sum in upstream's order (its lines L1438-1491).
inline void mudd_layer_forward(const Config& c, const Params& p, const Batch& b, Tape& tp) {
    const int i = kLayers - 1;
    const size_t T = c.T, C = c.C, H = c.H, W = c.bigram_width(), N = kMuddCoefs;
    LayerTape& L = tp.layers[i];
    const std::vector<double>&h0 = tp.layers[0].x_in, &h7 = tp.layers[kBackoutLayer].x_out, &h9 = L.x_in;
    mudd_forward(c, p, 0, kMuddCoefs, h9.data(), tp.mudd[0]);
    const std::vector<double>& cf = tp.mudd[0].coef;
    L.v_mudd.resize(T * C);
    L.mudd_r.resize(T * C);
    L.mudd_ve_gate.resize(T * H);
    for (size_t t = 0; t < T; ++t) {
        const double* k = cf.data() + t * N;
        for (size_t j = 0; j < C; ++j) {
            const size_t e = t * C + j;
            L.v_mudd[e] = k[kMuV0] * h0[e] + k[kMuV7] * h7[e] + k[kMuV9] * h9[e];
            L.mudd_r[e] = (1.0 + k[kMuR9]) * h9[e] + k[kMuR0] * h0[e] + k[kMuR7] * h7[e];
        }
        for (size_t h = 0; h < H; ++h) L.mudd_ve_gate[t * H + h] = k[h < H / 2 ? kMuGateLo : kMuGateHi];
    }
    attention_block_forward(c, p, b, i, L);
    const double sa1 = p.scalars[c.scalar_slots().sa_of(i, 1)];
    L.x_attn.resize(T * C);
    for (size_t t = 0; t < T; ++t) {
        const double* k = cf.data() + t * N;
        for (size_t j = 0; j < C; ++j) {
            const size_t e = t * C + j;
            L.x_attn[e] = k[kMuResidAttn] * L.mudd_r[e] + k[kMuPostAttn] * (sa1 * L.o_raw[e]) + k[kMuX0] * h0[e];
            if (j < W) L.x_attn[e] += k[kMuBigram] * tp.x_bigram[t * W + j];
        }
    }
    mlp_block_forward(c, p, i, L);
    L.x_out.resize(T * C);
    for (size_t t = 0; t < T; ++t) {
        const double* k = cf.data() + t * N;
        for (size_t j = 0; j < C; ++j) {
            const size_t e = t * C + j;
            L.x_out[e] = k[kMuResidMlp] * L.x_attn[e] + k[kMuPostMlp] * L.mlp_out[e];
        }
    }
}

// Record 85: layer i's per-token readers of the gate (LayerTape::tok_*), copied from its columns (empty if none).
inline void fill_token_readers(const Config& c, const Tape& tp, int i, LayerTape& L) {
    const size_t T = c.T, H = c.H;
    const GateCols k = gate_cols(i);
    const int n = kGateCoefs[k.gate];
    const std::vector<double>& G = tp.gate[size_t(k.gate)].coef;
    auto copy = [&](int col, std::vector<double>& out) {
        out.clear();
        if (col < 0) return;
        out.resize(T * H);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) out[t * H + h] = G[t * n + col + h];
    };
    copy(k.xsa, L.tok_xsa);
    copy(k.out, L.tok_out);
    copy(c.dc_layer(i) ? kGateDcW1Col : -1, L.tok_dc_w1);
    copy(c.dc_layer(i) ? kGateDcW2Col : -1, L.tok_dc_w2);
}

// Record 80's layers (upstream 2c702746 GPT.forward; torch_reference.py residual_stream_r80), lambdas
// as Config::stream_lambda gives them, the stream in double (upstream rounds each update to bf16):
//   before layer 0:  x_in[0] = x0 + lb[0] xb
//   attention (i != 6): x_attn = ra[i] x_in + pa[i] attn(norm(x_mix)) + lx0[i] x0 + (i > 0 ? lb[i] xb : 0),
//                    x_mix = x_out[late] for i > late (Config::late_attn_source), else x_in
//   layer 6:         x_attn = x_in + skip gate * x_out[3] (record 71's skip add)
//   MLP:             x_out = rm[i] x_attn + pm[i] mlp(norm(x_attn))
// with ra, rm = resid_lambdas[i][0, 1], pa, pm = post_lambdas[i][0, 1], lx0 = x0_lambdas, lb = bigram_lambdas.
// xb (T, bigram width) adds into channels [0, bigram width) only (record 84's narrow bigram); x0 is
// x0_read: with x0_includes_bigram, x_in[0] itself (upstream's aliasing). With Config::mudd layer 10 takes
// block 0's coefficients instead of its lambdas (mudd_layer_inputs, and the updates below).
inline void stream_r80_forward(const Config& c, const Params& p, const Batch& b, Tape& tp) {
    const size_t T = c.T, C = c.C, W = c.bigram_width();
    const ScalarSlots& k = c.scalar_slots();
    const std::vector<double>& x0 = x0_read(c, tp);
    tp.layers[0].x_in = c.x0_includes_bigram ? tp.x0_with_bigram : stream_start(c, p, tp);
    for (int i = 0; i < kLayers; ++i) {
        LayerTape& L = tp.layers[i];
        if (i > 0) L.x_in = tp.layers[i - 1].x_out;
        if (c.mudd_gate && i == kGatePostLayer) gate_forward(c, p, 1, L.x_in.data(), tp.gate[1]);  // from h3
        if (c.mudd_gate) fill_token_readers(c, tp, i, L);
        if (i == kSkipTo) {  // layer 6, the one without attention
            L.x_mix.clear();
            skip_add_forward(c, p, tp, L.x_in, L.x_attn);
        } else {
            const int src = c.attn_source(i);
            L.x_mix = src >= 0 ? tp.layers[src].x_out : L.x_in;
            if (c.mudd_layer(i)) {
                mudd_layer_forward(c, p, b, tp);
                continue;
            }
            attention_block_forward(c, p, b, i, L);
            const double ra = c.stream_lambda(p.resid_lambdas[2 * i]), pa = c.stream_lambda(p.post_lambdas[2 * i]);
            const double sa1 = p.scalars[k.sa_of(i, 1)];
            const GateCols gk = gate_cols(i);
            L.x_attn.resize(T * C);
            for (size_t t = 0; t < T; ++t) {
                double lx0, lb;  // record 85: the token's gate columns; else the layer's lambdas
                if (c.mudd_gate) {
                    const double* G = tp.gate[size_t(gk.gate)].coef.data() + t * kGateCoefs[gk.gate];
                    lx0 = G[gk.x0], lb = i > 0 ? G[gk.bigram] : 0.0;
                } else {
                    lx0 = c.stream_lambda(p.x0_lambdas[i]), lb = i > 0 ? c.stream_lambda(p.bigram_lambdas[i]) : 0.0;
                }
                for (size_t j = 0; j < C; ++j) {
                    const size_t e = t * C + j;
                    const double bg = j < W ? lb * tp.x_bigram[t * W + j] : 0.0;
                    L.x_attn[e] = ra * L.x_in[e] + pa * (sa1 * L.o_raw[e]) + (lx0 * x0[e] + bg);
                }
            }
        }
        mlp_block_forward(c, p, i, L);
        const double rm = c.stream_lambda(p.resid_lambdas[2 * i + 1]), pm = c.stream_lambda(p.post_lambdas[2 * i + 1]);
        L.x_out.resize(T * C);
        for (size_t e = 0; e < T * C; ++e) L.x_out[e] = rm * L.x_attn[e] + pm * L.mlp_out[e];
    }
}

}  // namespace detail

// ---- forward ----
// Returns the loss: training = sum over rows t of sum_k w_k (lse_t - z[t, target[t+k]]) (t+k < T,
// w_k > 0) on the FP8 lm_head when cfg.fp8; eval = mean over rows of lse_t - z[t, target[t]] on the
// exact lm_head. Fills *tape when given.
inline double forward(const Config& c, const Params& p, const Batch& b, Tape* tape = nullptr) {
    using namespace detail;
    c.validate();
    p.validate(c);
    b.validate(c);
    Tape local;
    Tape& tp = tape ? *tape : local;
    const size_t T = c.T, C = c.C, V = c.V;
    const double* S = p.scalars.data();
    const ScalarSlots& k = c.scalar_slots();

    const size_t W = c.bigram_width();
    tp.emb.resize(T * C);
    tp.x_bigram.resize(T * W);
    if (c.bigram_signs()) tp.bigram_sign_idx = bigram_sign_index(b.inputs, c.bigram_sign_rows);
    else tp.bigram_sign_idx.clear();
    for (size_t t = 0; t < T; ++t) {
        std::copy_n(p.embed.data() + size_t(b.inputs[t]) * C, C, tp.emb.data() + t * C);
        const double* row = p.bigram_embed.data() + size_t(b.bigram[t]) * W;
        double* xb = tp.x_bigram.data() + t * W;
        if (c.bigram_signs()) {  // record 83: times the token's sign row, elementwise (exact)
            const double* sign = c.bigram_sign_table.data() + size_t(tp.bigram_sign_idx[t]) * W;
            for (size_t j = 0; j < W; ++j) xb[j] = row[j] * sign[j];
        } else {
            std::copy_n(row, W, xb);
        }
    }
    // smear: token t takes smear_lambda * sigmoid(emb[t,:12] . smear_gate) of token t-1 (any document)
    tp.x_smear = tp.emb;
    tp.smear_sig.assign(T, 0.0);
    for (size_t t = 1; t < T; ++t) {
        tp.smear_sig[t] = sigmoid(dot(tp.emb.data() + t * C, p.smear_gate.data(), kGateDim));
        axpy(S[k.smear] * tp.smear_sig[t], tp.emb.data() + (t - 1) * C, tp.x_smear.data() + t * C, C);
    }
    tp.x0.resize(T * C);
    tp.rstd0.resize(T);
    rms_norm(tp.x_smear.data(), tp.x0.data(), tp.rstd0.data(), T, C);
    // record 84's aliasing: x0 is the stream after the pre-layer-0 bigram add, from here on
    if (c.x0_includes_bigram) tp.x0_with_bigram = stream_start(c, p, tp);
    else tp.x0_with_bigram.clear();
    const std::vector<double>& x0 = x0_read(c, tp);
    tp.skip_sig.assign(c.learned_gates() ? T : 0, 0.0);
    for (size_t t = 0; t < T && c.learned_gates(); ++t)
        tp.skip_sig[t] = sigmoid(dot(x0.data() + t * C, p.skip_gate.data(), kGateDim));

    for (LayerTape& L : tp.layers) {
        L.mudd_ve_gate.clear(), L.v_mudd.clear(), L.mudd_r.clear();
        L.tok_xsa.clear(), L.tok_out.clear(), L.tok_dc_w1.clear(), L.tok_dc_w2.clear();
    }
    for (Tape::Mudd& m : tp.mudd) m.z.clear(), m.coef.clear();
    for (Tape::Gate& m : tp.gate) m.z.clear(), m.pre.clear(), m.coef.clear();
    if (c.mudd_gate) gate_forward(c, p, 0, tp.x0.data(), tp.gate[0]);  // record 85: the pre gate, from the clean x0
    if (c.sublayer_lambdas) stream_r80_forward(c, p, b, tp);
    else stream_r71_forward(c, p, b, tp);

    tp.x_final.resize(T * C);
    const std::vector<double>& x = tp.layers[kLayers - 1].x_out;
    if (c.mudd) {  // x + c'0 h0 + c'1 h7 + c'2 h9 + c'3 ve0 + c'4 h3, in upstream's order
        mudd_forward(c, p, 1, kMuddPostCoefs, x.data(), tp.mudd[1]);
        const std::vector<double>&h0 = tp.layers[0].x_in, &h3 = tp.layers[kSkipFrom].x_out;
        const std::vector<double>&h7 = tp.layers[kBackoutLayer].x_out, &h9 = tp.layers[kLayers - 1].x_in;
        for (size_t t = 0; t < T; ++t) {
            const double* k = tp.mudd[1].coef.data() + t * kMuddPostCoefs;
            const double* ve0 = value_row(c, p, 0, b.inputs[t]);
            for (size_t j = 0; j < C; ++j) {
                const size_t e = t * C + j;
                tp.x_final[e] = x[e] + k[kMuPost0] * h0[e] + k[kMuPost7] * h7[e] + k[kMuPost9] * h9[e] +
                                k[kMuPostVe] * ve0[j] + k[kMuPost3] * h3[e];
            }
        }
    } else {
        const double bo = S[k.backout];
        for (size_t e = 0; e < T * C; ++e) tp.x_final[e] = x[e] - bo * tp.layers[kBackoutLayer].x_out[e];
    }
    tp.xn.resize(T * C);
    tp.rstd_f.resize(T);
    rms_norm(tp.x_final.data(), tp.xn.data(), tp.rstd_f.data(), T, C);

    const bool quantized = c.training && c.fp8;
    tp.logits.resize(T * V);
    if (quantized) {
        tp.xq.resize(T * C);
        tp.wq.resize(C * V);
        for (size_t e = 0; e < T * C; ++e) tp.xq[e] = round_e4m3(tp.xn[e] / c.x_s) * c.x_s;
        for (size_t e = 0; e < C * V; ++e) tp.wq[e] = round_e4m3(p.lm_head[e] / c.w_s) * c.w_s;
        matmul_nn(tp.xq.data(), tp.wq.data(), tp.logits.data(), T, C, V);
    } else {
        tp.xq.clear();
        tp.wq.clear();
        matmul_nn(tp.xn.data(), p.lm_head.data(), tp.logits.data(), T, C, V);
    }

    tp.lse.resize(T);
    tp.row_loss.assign(T, 0.0);
    std::vector<double> z(V);
    tp.loss = 0.0;
    for (size_t t = 0; t < T; ++t) {
        const double* l = tp.logits.data() + t * V;
        double mx = -INFINITY, sum = 0.0;
        for (size_t v = 0; v < V; ++v) mx = std::max(mx, z[v] = softcap(l[v]));
        for (size_t v = 0; v < V; ++v) sum += std::exp(z[v] - mx);
        tp.lse[t] = mx + std::log(sum);
        if (c.training) {
            for (size_t k = 0; k < c.mtp_weights.size() && t + k < T; ++k)
                if (c.mtp_weights[k] > 0.0) tp.row_loss[t] += c.mtp_weights[k] * (tp.lse[t] - z[b.targets[t + k]]);
            if (b.prefix_valid(c, t)) tp.row_loss[t] += c.prefix_weight * (tp.lse[t] - z[b.prefix_targets[t]]);
        } else {
            tp.row_loss[t] = tp.lse[t] - z[b.targets[t]];
        }
        tp.loss += tp.row_loss[t];
    }
    if (!c.training) tp.loss /= double(T);
    return tp.loss;
}

namespace detail {

// The gradients of a layer's per-token gate readers (LayerTape::tok_*; mudd_gate), (T,H) each and empty where the
// layer has no such reader, with the sums of squares of the products each sums (Tape::gate_sq).
struct TokenGrads {
    std::vector<double> xsa, out, dc_w1, dc_w2;
    std::vector<double> sq_xsa, sq_out, sq_dc_w1, sq_dc_w2;
};

// Attention block backward: dout is the gradient of the block's output sa1 * o_raw; adds the gradient
// of x_mix (through norm(x_mix)) into dx_mix and parameter gradients into g. On MUDD's layer the caller
// owns the value embedding's term (its gate and v_mudd are coefficients): v's gradient goes to *dv_out.
// With mudd_gate the per-token readers' gradients go to *tok (needed then).
inline void attention_block_backward(const Config& c, const Params& p, const Batch& b, int layer, const LayerTape& L,
                                     const std::vector<double>& dout, std::vector<double>& dx_mix, Params& g,
                                     std::vector<double>& scalar_sq, std::vector<double>* dv_out = nullptr,
                                     TokenGrads* tok = nullptr) {
    const size_t T = c.T, C = c.C, H = c.H, D = c.D;
    const int bank = attn_bank_index(layer), table = c.table_of(layer);
    const size_t wofs = size_t(bank) * 4 * C * C;
    const double* W = p.attn_bank.data() + wofs;
    double* dW = g.attn_bank.data() + wofs;
    const int sa_at = c.scalar_slots().sa_of(layer, 0);
    const double sa0 = p.scalars[sa_at], sa1 = p.scalars[sa_at + 1];
    const Yarn& yarn = c.yarn_of(layer);
    const bool paired = c.paired[layer];

    // projection: the output is sa1 * yg @ Wo^T
    g.scalars[sa_at + 1] += scaled_dot(dout.data(), L.o_raw.data(), T * C, scalar_sq[sa_at + 1]);
    matmul_tn_acc(dout.data(), L.yg.data(), dW + 3 * C * C, T, C, C, sa1);
    std::vector<double> dyg(T * C);
    matmul_nn(dout.data(), W + 3 * C * C, dyg.data(), T, C, C);
    for (double& e : dyg) e *= sa1;

    // output gate: yg = y_in * sigmoid(xa[:12] . attn_gate[h]), y_in = XSA's y' on its layers, else y;
    // then XSA's backward (xsa_backward_row) turns d y' into d y and its share of d v and d alpha
    const bool xsa = c.xsa[layer];
    const std::vector<double>& y_att = c.dc_layer(layer) ? L.y_dc : L.y;
    const std::vector<double>& y_gate_in = xsa ? L.y_xsa : y_att;
    std::vector<double> dxa(T * C, 0.0), dy(T * C), dv_xsa(xsa ? T * C : 0, 0.0);
    if (c.mudd_gate) {
        require(tok != nullptr, "attention_block_backward: mudd_gate needs the token gradients' output");
        *tok = TokenGrads{};
        const bool gated = !L.attn_sig.empty();
        if (gated) tok->out.assign(T * H, 0.0), tok->sq_out.assign(T * H, 0.0);
        if (xsa) tok->xsa.assign(T * H, 0.0), tok->sq_xsa.assign(T * H, 0.0);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) {
                const size_t o = (t * H + h) * D, th = t * H + h;
                const double sg = gated ? L.attn_sig[th] : 1.0;
                if (gated) tok->out[th] = scaled_dot(dyg.data() + o, y_gate_in.data() + o, D, tok->sq_out[th]);
                for (size_t d = 0; d < D; ++d) dy[o + d] = sg * dyg[o + d];
                if (xsa) {  // alpha = tanh(G): d G = d alpha (1 - alpha^2)
                    const double alpha = std::tanh(L.tok_xsa[th]), cc = L.xsa_c[th];
                    const double dalpha = xsa_r86_backward_row(y_att.data() + o, L.v.data() + o, alpha, cc,
                                                               L.xsa_n2[th], dy.data() + o, D, dy.data() + o,
                                                               dv_xsa.data() + o);
                    const double k = 1.0 - alpha * alpha;
                    tok->xsa[th] = dalpha * k;
                    for (size_t d = 0; d < D; ++d) {  // -c q = sum_d of -c g_d v_d
                        const double e = cc * (dyg[o + d] * sg) * L.v[o + d] * k;
                        tok->sq_xsa[th] += e * e;
                    }
                }
            }
    }
    const double* agate = c.mudd_gate ? nullptr : p.attn_gate_bank.data() + size_t(bank) * H * kGateDim;
    double* dagate = c.mudd_gate ? nullptr : g.attn_gate_bank.data() + size_t(bank) * H * kGateDim;
    for (size_t t = 0; t < T && !c.mudd_gate; ++t)
        for (size_t h = 0; h < H; ++h) {
            const size_t o = (t * H + h) * D;
            const double sg = L.attn_sig[t * H + h];
            const double dz = sg * (1.0 - sg) * dot(dyg.data() + o, y_gate_in.data() + o, D);
            for (size_t d = 0; d < D; ++d) dy[o + d] = sg * dyg[o + d];
            axpy(dz, L.xa.data() + t * C, dagate + h * kGateDim, kGateDim);
            axpy(dz, agate + h * kGateDim, dxa.data() + t * C, kGateDim);
            if (xsa) {  // alpha = tanh(a) (bf16 or not): d a = d alpha (1 - tanh(a)^2), straight through the rounding
                const size_t at = size_t(layer) * H + h;
                const double th = std::tanh(p.xsa_alphas[at]);
                const double dalpha = xsa_backward_row(y_att.data() + o, L.v.data() + o, c.xsa_alpha(p.xsa_alphas[at]),
                                                       L.xsa_p[t * H + h], L.xsa_n[t * H + h], dy.data() + o, D,
                                                       dy.data() + o, dv_xsa.data() + o);
                g.xsa_alphas[at] += dalpha * (1.0 - th * th);
            }
        }

    std::vector<double> dq(T * C), dk(T * C), dv(T * C);
    attention_backward(attn_shape(c, b, layer), L.q.data(), L.k.data(), L.v.data(), L.y.data(), L.lse.data(),
                       dy.data(), dq.data(), dk.data(), dv.data());
    if (c.dc_layer(layer)) {  // y_dc = y + correction: y's gradient is dy itself (above); the correction's q, k, v, w1, w2
        tok->dc_w1.assign(T * H, 0.0), tok->dc_w2.assign(T * H, 0.0);
        tok->sq_dc_w1.assign(T * H, 0.0), tok->sq_dc_w2.assign(T * H, 0.0);
        dc_backward(c, b, attn_shape(c, b, layer).scale, L, dy, dq.data(), dk.data(), dv.data(), tok->dc_w1.data(),
                    tok->dc_w2.data(), tok->sq_dc_w1.data(), tok->sq_dc_w2.data());
    }
    // v is read by the attention and by XSA: its gradient is the sum, and flows on into its sources
    // (the QKV projection, the value embedding and its gate)
    if (xsa) axpy(1.0, dv_xsa.data(), dv.data(), T * C);
    if (dv_out) *dv_out = dv;

    // value embedding: v = v_raw + 2 sigmoid(in . ve_gate[h]) * ve, in = the gate's input (gate_input)
    if (table >= 0 && L.mudd_ve_gate.empty()) {
        const double* vgate = p.ve_gate_bank.data() + size_t(table) * H * kGateDim;
        double* dvgate = g.ve_gate_bank.data() + size_t(table) * H * kGateDim;
        const bool reads_ve = c.gate_reads_ve(layer);
        const size_t from_x = reads_ve ? kGateDim / 2 : kGateDim;  // gate inputs that are xa's
        for (size_t t = 0; t < T; ++t) {
            const double* ve = value_row(c, p, table, b.inputs[t]);
            double* dve = g.value_embeds.data() + (size_t(table) * c.V + b.inputs[t]) * C;
            const std::vector<double> in = gate_input(c, layer, L.xa.data() + t * C, ve);
            for (size_t h = 0; h < H; ++h) {
                const size_t o = (t * H + h) * D;
                const double sg = L.ve_sig[t * H + h];
                const double dz = 2.0 * sg * (1.0 - sg) * dot(dv.data() + o, ve + h * D, D);
                axpy(2.0 * sg, dv.data() + o, dve + h * D, D);
                axpy(dz, in.data(), dvgate + h * kGateDim, kGateDim);
                axpy(dz, vgate + h * kGateDim, dxa.data() + t * C, from_x);
                if (reads_ve) axpy(dz, vgate + h * kGateDim + from_x, dve, kGateDim - from_x);
            }
        }
    }
    // key offset: the upper half of key t came from key t-1 (key 0 keeps its own)
    if (c.has_key_offset(layer)) {
        std::vector<double> dk_rot(dk);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h)
                for (size_t d = D / 2; d < D; ++d)
                    dk_rot[(t * H + h) * D + d] = (t + 1 < T ? dk[((t + 1) * H + h) * D + d] : 0.0) +
                                                  (t == 0 ? dk[(t * H + h) * D + d] : 0.0);
        dk.swap(dk_rot);
    }
    // rotary (transpose), per-head norm, then the QKV projection
    std::vector<double> dqkv(T * 3 * C, 0.0);
    for (size_t t = 0; t < T; ++t)
        for (size_t h = 0; h < H; ++h) {
            const size_t o = (t * H + h) * D;
            const double pos = rotary_position(paired, int(t), int(h));
            rotary_apply(yarn, pos, dq.data() + o, int(D), true);
            rotary_apply(yarn, pos, dk.data() + o, int(D), true);
            double* row = dqkv.data() + t * 3 * C + h * D;
            rms_norm_backward_acc(L.qn.data() + o, L.rstd_q.data() + t * H + h, dq.data() + o, row, 1, D);
            rms_norm_backward_acc(L.kn.data() + o, L.rstd_k.data() + t * H + h, dk.data() + o, row + C, 1, D);
            std::copy_n(dv.data() + o, D, row + 2 * C);
        }
    // qkv = sa0 * qkv_raw, qkv_raw = xa @ Wqkv^T
    g.scalars[sa_at] += scaled_dot(dqkv.data(), L.qkv_raw.data(), T * 3 * C, scalar_sq[sa_at]);
    matmul_tn_acc(dqkv.data(), L.xa.data(), dW, T, 3 * C, C, sa0);
    std::vector<double> dxa_raw(T * C);
    matmul_nn(dqkv.data(), W, dxa_raw.data(), T, 3 * C, C);
    for (size_t e = 0; e < T * C; ++e) dxa[e] += sa0 * dxa_raw[e];
    rms_norm_backward_acc(L.xa.data(), L.rstd_a.data(), dxa.data(), dx_mix.data(), T, C);
}

// MLP block backward: dout is the gradient of its output (L.mlp_out); adds the gradient of x_attn
// through norm(x_attn) into dx_attn (which may be dout itself: every read of dout comes first).
inline void mlp_block_backward(const Config& c, const Params& p, int layer, const LayerTape& L,
                               const std::vector<double>& dout, std::vector<double>& dx_attn, Params& g) {
    const size_t T = c.T, C = c.C, F = c.hidden();
    const size_t fofs = size_t(2 * layer) * F * C;
    const double* fc = p.mlp_bank.data() + fofs;
    const double* proj = fc + F * C;
    double* dfc = g.mlp_bank.data() + fofs;
    double* dproj = dfc + F * C;
    std::vector<double> post(T * F), dpre(T * F), dxm(T * C);
    for (size_t e = 0; e < T * F; ++e) post[e] = L.pre[e] > 0.0 ? L.pre[e] * L.pre[e] : 0.0;
    matmul_tn_acc(post.data(), dout.data(), dproj, T, F, C, 1.0);
    matmul_nt(dout.data(), proj, dpre.data(), T, F, C);  // d post
    for (size_t e = 0; e < T * F; ++e) dpre[e] *= L.pre[e] > 0.0 ? 2.0 * L.pre[e] : 0.0;
    matmul_tn_acc(dpre.data(), L.xm.data(), dfc, T, F, C, 1.0);
    matmul_nn(dpre.data(), fc, dxm.data(), T, F, C);
    rms_norm_backward_acc(L.xm.data(), L.rstd_m.data(), dxm.data(), dx_attn.data(), T, C);
}

// Layer 6's skip add backward (skip_add_forward): dx is the gradient of its output (and of its input
// x_in, unchanged); adds x_out[3]'s share into d_skip, x0's (x0_read, through the gate) into dx0, and the
// skip lambda's and gate's gradients and error scales.
inline void skip_add_backward(const Config& c, const Params& p, Tape& tp, const std::vector<double>& dx,
                              std::vector<double>& d_skip, std::vector<double>& dx0, Params& g) {
    const size_t T = c.T, C = c.C;
    const int slot = c.scalar_slots().skip;
    std::vector<double>& sq = tp.scalar_scales;
    const double sl = sigmoid(p.scalars[slot]);
    const std::vector<double>& skip = tp.layers[kSkipFrom].x_out;
    const std::vector<double>& x0 = x0_read(c, tp);
    if (c.mudd_gate) {  // out = in + sl G1[t, 28] h3: h3's share, the column's gradient and the lambda's
        const size_t n = kGateCoefs[1];
        for (size_t t = 0; t < T; ++t) {
            const double G = tp.gate[1].coef[t * n + kGateSkipCol];
            axpy(sl * G, dx.data() + t * C, d_skip.data() + t * C, C);
            double dsq = 0.0;
            const double dd = scaled_dot(dx.data() + t * C, skip.data() + t * C, C, dsq);
            tp.gate_dcoef[1][t * n + kGateSkipCol] += sl * dd;
            tp.gate_sq[1][t * n + kGateSkipCol] += sl * sl * dsq;
            const double ds = sl * (1.0 - sl) * G;
            g.scalars[slot] += ds * dd;
            sq[slot] += ds * ds * dsq;
        }
        return;
    }
    for (size_t t = 0; t < T; ++t) {
        const double sg = tp.skip_sig[t];
        axpy(sl * 2.0 * sg, dx.data() + t * C, d_skip.data() + t * C, C);
        double dgate_sq = 0.0;
        const double dgate = scaled_dot(dx.data() + t * C, skip.data() + t * C, C, dgate_sq);
        const double ds = 2.0 * sg * sl * (1.0 - sl);
        g.scalars[slot] += dgate * ds;
        sq[slot] += dgate_sq * ds * ds;
        const double dzs = dgate * sl * 2.0 * sg * (1.0 - sg);
        axpy(dzs, x0.data() + t * C, g.skip_gate.data(), kGateDim);
        const double k = sl * 2.0 * sg * (1.0 - sg);
        for (size_t j = 0; j < kGateDim; ++j) {
            const double x = x0[t * C + j];
            tp.skip_gate_scales[j] += k * k * dgate_sq * x * x + dzs * dzs * x * x;
        }
        axpy(dzs, p.skip_gate.data(), dx0.data() + t * C, kGateDim);
    }
}

// Record 85: adds layer i's per-token readers' gradients (attention_block_backward's) into its gate's dG and sums of
// squares.
inline void scatter_token_grads(const Config& c, Tape& tp, int i, const TokenGrads& tok) {
    const size_t T = c.T, H = c.H;
    const GateCols k = gate_cols(i);
    const size_t n = kGateCoefs[k.gate];
    std::vector<double>&dG = tp.gate_dcoef[size_t(k.gate)], &sq = tp.gate_sq[size_t(k.gate)];
    auto add = [&](int col, const std::vector<double>& d, const std::vector<double>& s2) {
        if (d.empty()) return;
        require(col >= 0, "layer %d has a gate reader without a column", i);
        for (size_t t = 0; t < T; ++t)
            for (size_t h = 0; h < H; ++h) dG[t * n + col + h] += d[t * H + h], sq[t * n + col + h] += s2[t * H + h];
    };
    add(k.xsa, tok.xsa, tok.sq_xsa);
    add(k.out, tok.out, tok.sq_out);
    add(kGateDcW1Col, tok.dc_w1, tok.sq_dc_w1);
    add(kGateDcW2Col, tok.dc_w2, tok.sq_dc_w2);
}

// Gradients that reach the stream from outside its layers' own chain: the backout's and MUDD's reads of
// layer outputs (x_out[i]) and MUDD's of layer 0's input. An empty vector is none.
struct StreamTaps {
    std::array<std::vector<double>, kLayers> x_out;
    std::vector<double> x_in0;
    static std::vector<double>& zeroed(std::vector<double>& v, size_t n) {
        if (v.empty()) v.assign(n, 0.0);
        return v;
    }
};

// MUDD's layer 10 backward (mudd_layer_forward). dx: the gradient of x_out[10] on entry, of its x_in (h9) on
// return. Adds h0's and h7's shares into taps, the attention input's into d_late when it reads the late
// source, the bigram's into dxb; every coefficient's gradient (sum over channels of gradient x source) goes
// through block 0's backward into h9 and MUDD's weights.
inline void mudd_layer_backward(const Config& c, const Params& p, const Batch& b, Tape& tp, std::vector<double>& dx,
                                std::vector<double>& d_late, StreamTaps& taps, std::vector<double>& dxb, Params& g) {
    const int i = kLayers - 1;
    const size_t T = c.T, C = c.C, H = c.H, D = c.D, W = c.bigram_width(), N = kMuddCoefs;
    const LayerTape& L = tp.layers[i];
    const std::vector<double>&h0 = tp.layers[0].x_in, &h7 = tp.layers[kBackoutLayer].x_out, &h9 = L.x_in;
    const std::vector<double>& cf = tp.mudd[0].coef;
    std::vector<double>& d_h0 = StreamTaps::zeroed(taps.x_in0, T * C);
    std::vector<double>& d_h7 = StreamTaps::zeroed(taps.x_out[kBackoutLayer], T * C);
    std::vector<double> dcf(T * N, 0.0), d_branch(T * C), d_attn(T * C), dr(T * C), dh9(T * C, 0.0), dv;
    double* sq = tp.mudd_b2_scales.data();  // block 0's sums of squares (of dcf's products; 0.01 x at the end)
    // MLP: x_out = c12 x_attn + c13 mlp_out
    for (size_t t = 0; t < T; ++t) {
        const double *k = cf.data() + t * N, *dxt = dx.data() + t * C;
        dcf[t * N + kMuResidMlp] = scaled_dot(dxt, L.x_attn.data() + t * C, C, sq[kMuResidMlp]);
        dcf[t * N + kMuPostMlp] = scaled_dot(dxt, L.mlp_out.data() + t * C, C, sq[kMuPostMlp]);
        for (size_t j = 0; j < C; ++j) d_branch[t * C + j] = k[kMuPostMlp] * dxt[j], d_attn[t * C + j] = k[kMuResidMlp] * dxt[j];
    }
    mlp_block_backward(c, p, i, L, d_branch, d_attn, g);  // d_attn: now d x_attn
    // attention: x_attn = c8 r + c9 (sa1 o_raw) + c10 h0 + c11 xb (channels [0, W))
    const double sa1 = p.scalars[c.scalar_slots().sa_of(i, 1)];
    for (size_t t = 0; t < T; ++t) {
        const double *k = cf.data() + t * N, *da = d_attn.data() + t * C;
        double post_sq = 0.0;
        dcf[t * N + kMuResidAttn] = scaled_dot(da, L.mudd_r.data() + t * C, C, sq[kMuResidAttn]);
        dcf[t * N + kMuPostAttn] = sa1 * scaled_dot(da, L.o_raw.data() + t * C, C, post_sq);
        sq[kMuPostAttn] += sa1 * sa1 * post_sq;
        dcf[t * N + kMuX0] = scaled_dot(da, h0.data() + t * C, C, sq[kMuX0]);
        dcf[t * N + kMuBigram] = scaled_dot(da, tp.x_bigram.data() + t * W, W, sq[kMuBigram]);
        for (size_t j = 0; j < C; ++j) {
            const size_t e = t * C + j;
            d_branch[e] = k[kMuPostAttn] * da[j];
            dr[e] = k[kMuResidAttn] * da[j];
            d_h0[e] += k[kMuX0] * da[j];
            if (j < W) dxb[t * W + j] += k[kMuBigram] * da[j];
        }
    }
    TokenGrads tok;
    attention_block_backward(c, p, b, i, L, d_branch, c.attn_source(i) >= 0 ? d_late : dh9, g, tp.scalar_scales, &dv,
                             c.mudd_gate ? &tok : nullptr);
    if (c.mudd_gate) scatter_token_grads(c, tp, i, tok);
    // r = (1 + c5) h9 + c3 h0 + c4 h7; v = ... + g ve + (c0 h0 + c1 h7 + c2 h9), g = c6 | c7 per head half
    const int table = c.table_of(i);
    for (size_t t = 0; t < T; ++t) {
        const double *k = cf.data() + t * N, *drt = dr.data() + t * C, *dvt = dv.data() + t * C;
        double* dk = dcf.data() + t * N;
        const size_t o = t * C;
        dk[kMuR9] = scaled_dot(drt, h9.data() + o, C, sq[kMuR9]);
        dk[kMuR0] = scaled_dot(drt, h0.data() + o, C, sq[kMuR0]);
        dk[kMuR7] = scaled_dot(drt, h7.data() + o, C, sq[kMuR7]);
        dk[kMuV0] = scaled_dot(dvt, h0.data() + o, C, sq[kMuV0]);
        dk[kMuV7] = scaled_dot(dvt, h7.data() + o, C, sq[kMuV7]);
        dk[kMuV9] = scaled_dot(dvt, h9.data() + o, C, sq[kMuV9]);
        for (size_t j = 0; j < C; ++j) {
            dh9[o + j] += (1.0 + k[kMuR9]) * drt[j] + k[kMuV9] * dvt[j];
            d_h0[o + j] += k[kMuR0] * drt[j] + k[kMuV0] * dvt[j];
            d_h7[o + j] += k[kMuR7] * drt[j] + k[kMuV7] * dvt[j];
        }
        const double* ve = value_row(c, p, table, b.inputs[t]);
        double* dve = g.value_embeds.data() + (size_t(table) * c.V + b.inputs[t]) * C;
        for (size_t h = 0; h < H; ++h) {
            const int lane = h < H / 2 ? kMuGateLo : kMuGateHi;
            dk[lane] += scaled_dot(dvt + h * D, ve + h * D, D, sq[lane]);
            axpy(L.mudd_ve_gate[t * H + h], dvt + h * D, dve + h * D, D);
        }
    }
    mudd_backward(c, p, 0, int(N), h9.data(), tp.mudd[0], dcf, dh9.data(), g);
    dx.swap(dh9);
}

// MUDD's post-loop backward (forward's x_final): dx, the gradient of x_final on entry, becomes that of
// x_out[10] (its own term plus block 1's input); h0's, h3's, h7's and h9's shares go into taps, ve0's into
// value table 0's rows.
inline void mudd_post_backward(const Config& c, const Params& p, const Batch& b, Tape& tp, std::vector<double>& dx,
                               StreamTaps& taps, Params& g) {
    const size_t T = c.T, C = c.C, N = kMuddPostCoefs;
    const std::vector<double>&h0 = tp.layers[0].x_in, &h3 = tp.layers[kSkipFrom].x_out;
    const std::vector<double>&h7 = tp.layers[kBackoutLayer].x_out, &h9 = tp.layers[kLayers - 1].x_in;
    std::vector<double>& d_h0 = StreamTaps::zeroed(taps.x_in0, T * C);
    std::vector<double>& d_h3 = StreamTaps::zeroed(taps.x_out[kSkipFrom], T * C);
    std::vector<double>& d_h7 = StreamTaps::zeroed(taps.x_out[kBackoutLayer], T * C);
    std::vector<double>& d_h9 = StreamTaps::zeroed(taps.x_out[kLayers - 2], T * C);
    std::vector<double> dcf(T * N);
    double* sq = tp.mudd_b2_scales.data() + kMuddCoefs;  // block 1's
    for (size_t t = 0; t < T; ++t) {
        const double *k = tp.mudd[1].coef.data() + t * N, *dxt = dx.data() + t * C;
        const double* ve0 = value_row(c, p, 0, b.inputs[t]);
        const size_t o = t * C;
        dcf[t * N + kMuPost0] = scaled_dot(dxt, h0.data() + o, C, sq[kMuPost0]);
        dcf[t * N + kMuPost7] = scaled_dot(dxt, h7.data() + o, C, sq[kMuPost7]);
        dcf[t * N + kMuPost9] = scaled_dot(dxt, h9.data() + o, C, sq[kMuPost9]);
        dcf[t * N + kMuPostVe] = scaled_dot(dxt, ve0, C, sq[kMuPostVe]);
        dcf[t * N + kMuPost3] = scaled_dot(dxt, h3.data() + o, C, sq[kMuPost3]);
        axpy(k[kMuPost0], dxt, d_h0.data() + o, C);
        axpy(k[kMuPost7], dxt, d_h7.data() + o, C);
        axpy(k[kMuPost9], dxt, d_h9.data() + o, C);
        axpy(k[kMuPostVe], dxt, g.value_embeds.data() + size_t(b.inputs[t]) * C, C);  // table 0
        axpy(k[kMuPost3], dxt, d_h3.data() + o, C);
    }
    mudd_backward(c, p, 1, int(N), tp.layers[kLayers - 1].x_out.data(), tp.mudd[1], dcf, dx.data(), g);
}

// Record 71's layers backward (stream_r71_forward). dx: the gradient of x_out[10] on entry (consumed);
// d_backout: x_out[7]'s share from the backout. Adds into dx0 and dxb (x0's and the bigram
// embedding's gradients) and the parameters' gradients.
inline void stream_r71_backward(const Config& c, const Params& p, const Batch& b, Tape& tp, std::vector<double>& dx,
                                const std::vector<double>& d_backout, std::vector<double>& dx0,
                                std::vector<double>& dxb, Params& g) {
    const size_t T = c.T, C = c.C;
    const double* S = p.scalars.data();
    std::vector<double>& sq = tp.scalar_scales;
    std::vector<double> d_skip(T * C, 0.0);
    for (int i = kLayers - 1; i >= 0; --i) {
        const LayerTape& L = tp.layers[i];
        if (i == kBackoutLayer)
            for (size_t e = 0; e < T * C; ++e) dx[e] += d_backout[e];
        if (i == kSkipFrom)
            for (size_t e = 0; e < T * C; ++e) dx[e] += d_skip[e];
        mlp_block_backward(c, p, i, L, dx, dx, g);  // dx: now d x_attn
        if (attn_bank_index(i) >= 0) {
            std::vector<double> dx_mix(dx);
            attention_block_backward(c, p, b, i, L, dx, dx_mix, g, sq);
            dx.swap(dx_mix);
        }
        // mix: x_mix = resid * x_in + x0_lambda * x0 + bigram_lambda * x_bigram
        const double r = S[scalar_resid(i)], a0 = p.x0_lambdas[i], bl = S[scalar_bigram(i)];
        g.scalars[scalar_resid(i)] += scaled_dot(dx.data(), L.x_in.data(), T * C, sq[scalar_resid(i)]);
        g.x0_lambdas[i] += scaled_dot(dx.data(), tp.x0.data(), T * C, tp.x0_lambda_scales[i]);
        g.scalars[scalar_bigram(i)] += scaled_dot(dx.data(), tp.x_bigram.data(), T * C, sq[scalar_bigram(i)]);
        axpy(a0, dx.data(), dx0.data(), T * C);
        axpy(bl, dx.data(), dxb.data(), T * C);
        for (double& e : dx) e *= r;  // now d x_in
        if (i == kSkipTo) skip_add_backward(c, p, tp, dx, d_skip, dx0, g);  // x_in = x_out[5] + skip
        if (i == 0) axpy(1.0, dx.data(), dx0.data(), T * C);  // layer 0's input is x0
    }
}

// Record 80's layers backward (stream_r80_forward), arguments as stream_r71_backward (dxb: (T, bigram
// width)); dx0 leaves as the gradient of the norm's output x0. The lambdas' gradients are those of the
// values used (straight through the bf16 rounding, as upstream's cast).
inline void stream_r80_backward(const Config& c, const Params& p, const Batch& b, Tape& tp, std::vector<double>& dx,
                                StreamTaps& taps, std::vector<double>& dx0, std::vector<double>& dxb, Params& g) {
    const size_t T = c.T, C = c.C, W = c.bigram_width();
    const std::vector<double>& x0 = x0_read(c, tp);
    const ScalarSlots& k = c.scalar_slots();
    std::vector<double>& sq = tp.scalar_scales;
    std::vector<double> d_skip(T * C, 0.0), d_late(T * C, 0.0), d_branch(T * C), d_attn(T * C), y(T * C);
    for (int i = kLayers - 1; i >= 0; --i) {
        const LayerTape& L = tp.layers[i];
        if (!taps.x_out[i].empty()) axpy(1.0, taps.x_out[i].data(), dx.data(), T * C);  // the backout's, MUDD's
        if (i == c.late_attn_source) axpy(1.0, d_late.data(), dx.data(), T * C);  // layers after it read norm(x_out)
        if (i == kSkipFrom) axpy(1.0, d_skip.data(), dx.data(), T * C);
        if (c.mudd_layer(i)) {
            mudd_layer_backward(c, p, b, tp, dx, d_late, taps, dxb, g);  // dx: now d x_in
            continue;
        }
        // MLP: x_out = rm x_attn + pm mlp_out
        const int m = 2 * i + 1;
        const double rm = c.stream_lambda(p.resid_lambdas[m]), pm = c.stream_lambda(p.post_lambdas[m]);
        g.resid_lambdas[m] += scaled_dot(dx.data(), L.x_attn.data(), T * C, tp.resid_lambda_scales[m]);
        g.post_lambdas[m] += scaled_dot(dx.data(), L.mlp_out.data(), T * C, tp.post_lambda_scales[m]);
        for (size_t e = 0; e < T * C; ++e) d_branch[e] = pm * dx[e], d_attn[e] = rm * dx[e];
        mlp_block_backward(c, p, i, L, d_branch, d_attn, g);
        dx.swap(d_attn);  // now d x_attn
        if (i == kSkipTo) {  // x_attn = x_in + skip: d x_in = d x_attn
            skip_add_backward(c, p, tp, dx, d_skip, dx0, g);
            continue;
        }
        // attention: x_attn = ra x_in + pa (sa1 o_raw) + lx0 x0 + lb xb (lb: layers 1-10)
        const int a = 2 * i;
        const double ra = c.stream_lambda(p.resid_lambdas[a]), pa = c.stream_lambda(p.post_lambdas[a]);
        const double sa1 = p.scalars[k.sa_of(i, 1)];
        for (size_t e = 0; e < T * C; ++e) y[e] = sa1 * L.o_raw[e];
        g.resid_lambdas[a] += scaled_dot(dx.data(), L.x_in.data(), T * C, tp.resid_lambda_scales[a]);
        g.post_lambdas[a] += scaled_dot(dx.data(), y.data(), T * C, tp.post_lambda_scales[a]);
        if (c.mudd_gate) {  // record 85: x0 and (after layer 0) xb times the token's gate columns
            const GateCols gk = gate_cols(i);
            const size_t n = kGateCoefs[gk.gate];
            double *dG = tp.gate_dcoef[size_t(gk.gate)].data(), *gsq = tp.gate_sq[size_t(gk.gate)].data();
            const double* G = tp.gate[size_t(gk.gate)].coef.data();
            for (size_t t = 0; t < T; ++t) {
                const double* dxt = dx.data() + t * C;
                dG[t * n + gk.x0] += scaled_dot(dxt, x0.data() + t * C, C, gsq[t * n + gk.x0]);
                axpy(G[t * n + gk.x0], dxt, dx0.data() + t * C, C);
                if (i > 0) {
                    dG[t * n + gk.bigram] += scaled_dot(dxt, tp.x_bigram.data() + t * W, W, gsq[t * n + gk.bigram]);
                    axpy(G[t * n + gk.bigram], dxt, dxb.data() + t * W, W);
                }
            }
        } else {
            const double lx0 = c.stream_lambda(p.x0_lambdas[i]);
            g.x0_lambdas[i] += scaled_dot(dx.data(), x0.data(), T * C, tp.x0_lambda_scales[i]);
            axpy(lx0, dx.data(), dx0.data(), T * C);
        }
        if (i > 0 && !c.mudd_gate) {  // xb reaches channels [0, W) only
            const double lb = c.stream_lambda(p.bigram_lambdas[i]);
            g.bigram_lambdas[i] +=
                scaled_dot_rows(dx.data(), C, tp.x_bigram.data(), W, T, W, tp.bigram_lambda_scales[i]);
            axpy_rows(lb, dx.data(), C, dxb.data(), W, T, W);
        }
        for (size_t e = 0; e < T * C; ++e) d_branch[e] = pa * dx[e], d_attn[e] = ra * dx[e];
        // the attention's input gradient goes to what it normalized: x_in, or the late source's output
        TokenGrads tok;
        attention_block_backward(c, p, b, i, L, d_branch, c.attn_source(i) >= 0 ? d_late : d_attn, g, sq, nullptr,
                                 c.mudd_gate ? &tok : nullptr);
        if (c.mudd_gate) scatter_token_grads(c, tp, i, tok);
        dx.swap(d_attn);  // now d x_in
        // record 85: every reader of the post gate is done (layers 4-10): its input, this layer's, gets its share
        if (c.mudd_gate && i == kGatePostLayer)
            gate_backward(c, p, 1, L.x_in.data(), tp.gate[1], tp.gate_dcoef[1], dx.data(), g);
    }
    // x_in[0] = x0 + lb[0] xb (channels [0, W)). With x0_includes_bigram every read of x0 above read
    // x_in[0] itself (upstream's aliased tensor): their gradient dx0 joins the stream's before the add's
    // backward, so it also reaches lb[0], the bigram rows and (as dx0 again) the norm. MUDD's reads of h0
    // (x_in[0] itself) join there too.
    if (!taps.x_in0.empty()) axpy(1.0, taps.x_in0.data(), dx.data(), T * C);
    if (c.mudd_gate) {  // x_in[0] = x0 + G0[t, 19] xb; then the pre gate (all its readers done), from x0
        const size_t n = kGateCoefs[0];
        const int col = gate_cols(0).bigram;
        for (size_t t = 0; t < T; ++t) {
            const double* dxt = dx.data() + t * C;
            tp.gate_dcoef[0][t * n + col] +=
                scaled_dot(dxt, tp.x_bigram.data() + t * W, W, tp.gate_sq[0][t * n + col]);
            axpy(tp.gate[0].coef[t * n + col], dxt, dxb.data() + t * W, W);
        }
        axpy(1.0, dx.data(), dx0.data(), T * C);
        gate_backward(c, p, 0, tp.x0.data(), tp.gate[0], tp.gate_dcoef[0], dx0.data(), g);
        return;
    }
    if (c.x0_includes_bigram) axpy(1.0, dx0.data(), dx.data(), T * C);
    const double lb0 = c.stream_lambda(p.bigram_lambdas[0]);
    g.bigram_lambdas[0] += scaled_dot_rows(dx.data(), C, tp.x_bigram.data(), W, T, W, tp.bigram_lambda_scales[0]);
    axpy_rows(lb0, dx.data(), C, dxb.data(), W, T, W);
    if (c.x0_includes_bigram) dx0.swap(dx);
    else axpy(1.0, dx.data(), dx0.data(), T * C);
}

}  // namespace detail

// ---- forward + backward ----
// Writes d(loss_scale * loss)/d(parameter) into grads (reshaped and overwritten) and returns the
// (unscaled) loss. Upstream backpropagates loss * grad_scale, so pass loss_scale = cfg.grad_scale
// to match its gradients, FP8 quantization of the logits' gradient included: on the FP8 path
// the logits' gradient g is quantized as e5m2(g / grad_s) * grad_s, then
// d xn = g8 @ deq(w)^T, d lm_head = deq(x)^T @ g8 (upstream's mm_t backward).
inline double forward_backward(const Config& c, const Params& p, const Batch& b, double loss_scale, Params& grads,
                               Tape* tape = nullptr) {
    using namespace detail;
    Tape local;
    Tape& tp = tape ? *tape : local;
    const double loss = forward(c, p, b, &tp);
    const size_t T = c.T, C = c.C, V = c.V;
    const double* S = p.scalars.data();
    const ScalarSlots& k = c.scalar_slots();
    Params& g = grads;
    g = Params::zeros(c);
    std::vector<double>& sq = tp.scalar_scales;  // sums of squares until the end
    sq.assign(c.num_scalars(), 0.0);
    const size_t learned = c.learned_gates() ? 1 : 0;
    tp.x0_lambda_scales.assign(learned * kLayers, 0.0);
    tp.skip_gate_scales.assign(learned * kGateDim, 0.0);
    const size_t r80 = c.sublayer_lambdas ? 1 : 0;
    tp.resid_lambda_scales.assign(r80 * 2 * kLayers, 0.0);
    tp.post_lambda_scales.assign(r80 * 2 * kLayers, 0.0);
    tp.bigram_lambda_scales.assign(r80 * learned * kLayers, 0.0);
    for (int id = 0; id < 2; ++id) {
        tp.gate_dcoef[size_t(id)].assign(c.mudd_gate ? T * kGateCoefs[id] : 0, 0.0);
        tp.gate_sq[size_t(id)].assign(c.mudd_gate ? T * kGateCoefs[id] : 0, 0.0);
    }
    tp.mudd_b2_scales.assign(c.mudd ? size_t(kMuddBlocks) * kMuddCoefs : 0, 0.0);

    // logits' gradient, row by row: dz = s * (S_w p - sum_k w_k onehot(target[t+k])), dl = dz * z (1 - sig) / C
    std::vector<double> dl(T * V);
    std::vector<double> dz(V);
    for (size_t t = 0; t < T; ++t) {
        const double* l = tp.logits.data() + t * V;
        double sw = 0.0;
        std::fill(dz.begin(), dz.end(), 0.0);
        if (c.training) {
            for (size_t k = 0; k < c.mtp_weights.size() && t + k < T; ++k)
                if (c.mtp_weights[k] > 0.0) {
                    sw += c.mtp_weights[k];
                    dz[b.targets[t + k]] -= c.mtp_weights[k];
                }
            if (c.sw_over_all_weights) {
                sw = 0.0;
                for (double w : c.mtp_weights) sw += w;
            }
            if (b.prefix_valid(c, t)) sw += c.prefix_weight, dz[b.prefix_targets[t]] -= c.prefix_weight;
        } else {
            sw = 1.0;
            dz[b.targets[t]] -= 1.0;
        }
        const double s = c.training ? loss_scale : loss_scale / double(T);
        for (size_t v = 0; v < V; ++v) {
            const double sg = sigmoid((l[v] + kSoftcapB) / kSoftcapC), z = kSoftcapA * sg;
            dl[t * V + v] = s * (sw * std::exp(z - tp.lse[t]) + dz[v]) * z * (1.0 - sg) / kSoftcapC;
        }
    }
    const bool quantized = c.training && c.fp8;
    if (quantized)
        for (double& e : dl) e = round_e5m2(e / c.grad_s()) * c.grad_s();
    const double* x_used = quantized ? tp.xq.data() : tp.xn.data();
    const double* w_used = quantized ? tp.wq.data() : p.lm_head.data();
    matmul_tn_acc(x_used, dl.data(), g.lm_head.data(), T, C, V, 1.0);
    std::vector<double> dxn(T * C);
    matmul_nt(dl.data(), w_used, dxn.data(), T, C, V);
    std::vector<double>().swap(dl);

    // final norm and backout: x_final = x_out[10] - backout * x_out[7] (mudd: MUDD's post-loop mix)
    std::vector<double> dx(T * C, 0.0);
    rms_norm_backward_acc(tp.xn.data(), tp.rstd_f.data(), dxn.data(), dx.data(), T, C);
    StreamTaps taps;
    if (c.mudd) {
        mudd_post_backward(c, p, b, tp, dx, taps, g);
    } else {
        const double bo = S[k.backout];
        g.scalars[k.backout] -= scaled_dot(dx.data(), tp.layers[kBackoutLayer].x_out.data(), T * C, sq[k.backout]);
        std::vector<double>& d_backout = taps.x_out[kBackoutLayer];
        d_backout.resize(T * C);
        for (size_t e = 0; e < T * C; ++e) d_backout[e] = -bo * dx[e];
    }
    const size_t W = c.bigram_width();
    std::vector<double> dx0(T * C, 0.0), dxb(T * W, 0.0);

    if (c.sublayer_lambdas) stream_r80_backward(c, p, b, tp, dx, taps, dx0, dxb, g);
    else stream_r71_backward(c, p, b, tp, dx, taps.x_out[kBackoutLayer], dx0, dxb, g);

    // x0 = norm(x_smear); x_smear[t] = emb[t] + smear_lambda * sigmoid(emb[t,:12] . smear_gate) * emb[t-1]
    std::vector<double> dsm(T * C, 0.0);
    rms_norm_backward_acc(tp.x0.data(), tp.rstd0.data(), dx0.data(), dsm.data(), T, C);
    std::vector<double> demb(dsm);
    const double lam = S[k.smear];
    for (size_t t = 1; t < T; ++t) {
        const double sg = tp.smear_sig[t];
        axpy(lam * sg, dsm.data() + t * C, demb.data() + (t - 1) * C, C);
        double dgate_sq = 0.0;
        const double dgate = scaled_dot(dsm.data() + t * C, tp.emb.data() + (t - 1) * C, C, dgate_sq);
        g.scalars[k.smear] += dgate * sg;
        sq[k.smear] += dgate_sq * sg * sg;
        const double dzs = dgate * lam * sg * (1.0 - sg);
        axpy(dzs, tp.emb.data() + t * C, g.smear_gate.data(), kGateDim);
        axpy(dzs, p.smear_gate.data(), demb.data() + t * C, kGateDim);
    }
    for (size_t t = 0; t < T; ++t) {
        axpy(1.0, demb.data() + t * C, g.embed.data() + size_t(b.inputs[t]) * C, C);
        double* dbg = g.bigram_embed.data() + size_t(b.bigram[t]) * W;
        if (c.bigram_signs()) {  // x_bigram[t] = row * sign row: the row's gradient is dxb[t] * sign row
            const double* sign = c.bigram_sign_table.data() + size_t(tp.bigram_sign_idx[t]) * W;
            for (size_t j = 0; j < W; ++j) dbg[j] += dxb[t * W + j] * sign[j];
        } else {
            axpy(1.0, dxb.data() + t * W, dbg, W);
        }
    }
    for (double& e : sq) e = std::sqrt(e);
    for (double& e : tp.x0_lambda_scales) e = std::sqrt(e);
    for (std::vector<double>* v : {&tp.skip_gate_scales, &tp.resid_lambda_scales, &tp.post_lambda_scales,
                                   &tp.bigram_lambda_scales})
        for (double& e : *v) e = std::sqrt(e);
    for (double& e : tp.mudd_b2_scales) e = kMuddScale * std::sqrt(e);
    tp.mudd_gate_b2_scales.assign(c.mudd_gate ? 2 * kGateMaxCoefs : 0, 0.0);
    tp.mudd_gate_scale_scales.assign(c.mudd_gate ? 1 : 0, 0.0);
    if (c.mudd_gate) {
        const double sc = gate_scale(c, p);
        for (int id = 0; id < 2; ++id) {
            const size_t n = kGateCoefs[id];
            for (size_t t = 0; t < T; ++t)
                for (size_t j = 0; j < n; ++j) {
                    const double q = tp.gate_sq[size_t(id)][t * n + j], pre = tp.gate[size_t(id)].pre[t * n + j];
                    tp.mudd_gate_b2_scales[size_t(id) * kGateMaxCoefs + j] += q;
                    tp.mudd_gate_scale_scales[0] += q * pre * pre;
                }
        }
        for (double& e : tp.mudd_gate_b2_scales) e = sc * std::sqrt(e);
        tp.mudd_gate_scale_scales[0] = std::sqrt(tp.mudd_gate_scale_scales[0]);
    }
    return loss;
}

}  // namespace ref
