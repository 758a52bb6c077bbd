// The attention's auxiliary math: everything between the QKV matmul and the attention kernel
// (per-head QK RMS norm, half-truncated YaRN rotary, key offset, gated value embeddings), the
// output gate between the attention kernel and the output projection, their backward, and the
// YaRN frequency/cos-sin state.
//
// Shapes: T tokens (one packed sequence), H heads of D = head_dim (D/8 a power of two from 2 to
// 32: 64 tiny, 128 record), C = H*D. qkv (T, 3C) bf16 is the QKV matmul output, columns
// [q | k | v], head h at h*D inside each third. q, k, v, y are (T, H, D) contiguous bf16.
// xa (T, C) bf16 is the attention input (the normed residual): its first 12 channels drive the
// output gate and the value-embedding gate (record 80's non-paired layers: xa's first 6 channels
// and the value-embedding row's first 6, VeGateInput::x_and_ve). Statistics fp32.
//
// One attention layer, forward (words in brackets are other families' calls):
//   [xa = rms_norm(x)]
//   [qkv = xa @ (sa_lambda0 * W_qkv)^T]
//   attn_qkv_forward(aux, q, k, v, rstd_q, rstd_k, qkv)          norm + rotary + key offset + ve
//   [y = attention(q, k, v, cu_seqlens, window, softmax scale = yarn.attn_scale); keeps lse]
//       paired layers: the attention reads q, k, v as (2T, H/2, D) with doubled cu_seqlens
//   attn_output_gate_forward(aux, y_gated, y)                    y' * sigmoid(xa[:, :12] . attn_gate[h]),
//                                                                y' = y, or y minus XSA's part along v
//                                                                (record 85: y' * coefs[t, gate + h], or y')
//   [x += y_gated @ (sa_lambda1 * W_o)^T]
// Backward (keep xa, qkv, rstd_q, rstd_k, q, k, v, y from the forward):
//   [d_y_gated = dx @ (sa_lambda1 * W_o); dW_o]
//   attn_output_gate_backward(aux, dy, dz_attn, d_y_gated, y[, xsa])  dy may alias d_y_gated;
//                                                                XSA layers: also XSA's dv and d alpha
//                                                                (record 85: the coefficients' gradients)
//   [dq, dk, dv = attention_backward(...)]
//   attn_qkv_backward(aux, dqkv, dve, dz_ve, dq, dk, dv, qkv, rstd_q, rstd_k[, dv_xsa])
//   [dxa = dqkv @ (sa_lambda0 * W_qkv); dW_qkv]
//   attn_gates_backward(aux, dxa, d_attn_gate, d_ve_gate, dz_attn, dz_ve, scratch, accumulate)
//       adds both gates' input gradient into dxa[:, :12] in place (one bf16 rounding, as
//       upstream's autograd sums its bf16 gradients of xa) and writes both gates' weight
//       gradients; it must run after the dxa matmul and before the rms_norm backward of xa.
//       Record 85's layers without attn_gate (d_attn_gate = dz_attn = null) run it for the VE gate alone.
//       With VeGateInput::x_and_ve the overload with dve also adds the VE gate's gradient of
//       ve[:, :6] into dve[:, :6] (one bf16 rounding), so it must also run before the
//       embedding_backward below reads dve.
//   [dx += rms_norm_backward(dxa)]
//   embedding_backward(value_embeds grad of this layer's table, dve, token-id segments)  (embed.cuh)
// Layers without value embeddings pass ve_table = ve_gate = null (then dve, dz_ve, d_ve_gate are
// null too). Nothing here allocates; attn_gates_backward_scratch_bytes sizes its scratch.
//
// Rotary positions are the token index t in the packed rank-local sequence (not the position
// inside its document), as upstream indexes its tables. Paired-head layers rotate head h of token
// t at position 2t + (h & 1): upstream views q as (T, H/2, 2D) against a (T, 2D) table whose row
// t is [positions 2t | 2t+1]. (The attention then reads the same memory as (2T, H/2, D), where
// row 2t holds heads 0..H/2-1; for H = 2 both parities agree, for H = 6 they differ, as upstream.)
#pragma once
#include "embed.cuh"

#include <cfloat>
#include <cmath>

// ---- YaRN: angular frequencies and the cos/sin table ----
// Upstream keeps two Yarn modules (plain and paired) whose frequencies are always equal, with
// (2*max_seq_len, D) bf16 cos and sin tables (paired: (2*max_seq_len, 2D), rows [2t | 2t+1]).
// Their entries repeat: the D/4 frequencies are repeat_interleave(2)'d, the upper D/2 dims have
// frequency 0 (cos 1, sin 0), the sin table's odd entries are negated copies, and the paired
// table's row t is the plain table's rows 2t and 2t+1 (theta = fl(2t * f) either way). So one
// table of the D/4 distinct {cos, sin} pairs per position holds every value the rotary reads:
// D bytes per position instead of 12*D (64 MiB for the record's 2*262144 positions, not 768).
// The kernels apply the unrotated half as the identity, which is what 1*x + 0*x_flip gives.
//
// The state lives on the device and is computed by small kernels that repeat torch's own CUDA
// arithmetic step by step in fp32 (eager, not compiled): linspace, powf, the interpolation, and
// cosf/sinf of fl(p * f) rounded to bf16. With the same CUDA math library as torch the tables are
// the same bits; the CPU build uses the host's libm for powf/cosf/sinf (correctly rounded or
// within an ulp, which changes a bf16 entry only next to a rounding boundary).
struct YarnRope {
    int head_dim = 0, positions = 0;
    float* freq = nullptr;    // device, head_dim/4 distinct angular frequencies
    bf16* table = nullptr;    // device, positions x head_dim/4 pairs {cos, sin}
    double attn_scale = 0.1;  // softmax scale, kept on the host in double as upstream
};
inline size_t yarn_freq_bytes(int head_dim) { return ceil_div<size_t>(static_cast<size_t>(head_dim / 4) * 4, 256) * 256; }
inline size_t yarn_table_bytes(int head_dim, int positions) { return static_cast<size_t>(positions) * head_dim * sizeof(bf16) / 2; }
// Device bytes of a YarnRope (frequencies, then the table). positions: 2 * the largest T of any
// forward (paired layers read position 2T-1); upstream's 2*max_seq_len is the same number.
inline size_t yarn_rope_bytes(int head_dim, int positions) {
    return yarn_freq_bytes(head_dim) + yarn_table_bytes(head_dim, positions);
}
// A YarnRope over caller memory (yarn_rope_bytes, 16-byte aligned, e.g. from the trainer's
// arena); call yarn_rope_reset before use.
inline YarnRope yarn_rope_view(void* device_memory, int head_dim, int positions) {
    kernel_require(head_dim >= 16 && head_dim % 16 == 0, "yarn_rope_view: head_dim must be a multiple of 16 (got %d)",
                   head_dim);
    kernel_require(positions > 0 && positions < (1 << 24),
                   "yarn_rope_view: positions must be in [1, 2^24) so that they are exact in fp32 (got %d)", positions);
    kernel_require(is_aligned16(device_memory), "yarn_rope_view: memory must be 16-byte aligned");
    YarnRope r;
    r.head_dim = head_dim;
    r.positions = positions;
    r.freq = static_cast<float*>(device_memory);
    r.table = reinterpret_cast<bf16*>(static_cast<unsigned char*>(device_memory) + yarn_freq_bytes(head_dim));
    return r;
}

// freq[i] = (1/1024) ** linspace(0, 1, n)[i] as torch computes it on the GPU: the first half
// start + i*step, the second end - (n-1-i)*step, each one fused multiply-add (nvcc contracts
// them), then powf with the fp32 base 2^-10.
__global__ void yarn_reset_frequencies_kernel(float* freq, int n, float step) {
    const int i = threadIdx.x;
    if (i >= n) return;
    const float lin = i < n / 2 ? __fmaf_rn(step, static_cast<float>(i), 0.0f)
                                : __fmaf_rn(-step, static_cast<float>(n - 1 - i), 1.0f);
    freq[i] = powf(0x1p-10f, lin);
}

// Upstream's YaRN update, one eager torch op (one fp32 rounding) per line:
//   rotations = old_window * freq / (2 pi)     (division by a scalar = multiplication by fp32 1/x)
//   w = clamp((rotations - alpha) / (beta - alpha), 0, 1)
//   freq *= scaling + w * (1 - scaling)         (scaling = old/new in double, each scalar rounded to fp32)
__global__ void yarn_interpolate_frequencies_kernel(float* freq, int n, float old_window, float inv_two_pi,
                                                    float alpha, float inv_span, float scaling,
                                                    float one_minus_scaling) {
    const int i = threadIdx.x;
    if (i >= n) return;
    const float f = freq[i];
    const float rotations = __fmul_rn(__fmul_rn(old_window, f), inv_two_pi);
    const float w = fminf(fmaxf(__fmul_rn(__fsub_rn(rotations, alpha), inv_span), 0.0f), 1.0f);
    freq[i] = __fmul_rn(f, __fadd_rn(__fmul_rn(w, one_minus_scaling), scaling));
}

// table[p][i] = {bf16(cos(fl(p * freq[i]))), bf16(sin(fl(p * freq[i])))}
__global__ void yarn_fill_table_kernel(bf16* table, const float* freq, int n, int positions) {
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (idx >= static_cast<int64_t>(positions) * n) return;
    const int p = static_cast<int>(idx / n), i = static_cast<int>(idx % n);
    const float theta = __fmul_rn(static_cast<float>(p), freq[i]);
    table[2 * idx] = __float2bfloat16(cosf(theta));
    table[2 * idx + 1] = __float2bfloat16(sinf(theta));
}
// Reads the frequencies, writes the table; a multiply, a cos and a sin per entry.
inline Work yarn_fill_table_work(const YarnRope& r) {
    return Work{.name = "yarn_fill_table", .flops = 3.0 * r.positions * (r.head_dim / 4),
                .bytes_read = 4.0 * (r.head_dim / 4),
                .bytes_written = static_cast<double>(yarn_table_bytes(r.head_dim, r.positions))};
}
inline void yarn_fill_table(const YarnRope& r, cudaStream_t stream) {
    const int64_t threads = static_cast<int64_t>(r.positions) * (r.head_dim / 4);
    launch(yarn_fill_table_work(r), yarn_fill_table_kernel, dim3(static_cast<unsigned>(ceil_div<int64_t>(threads, 256))),
           dim3(256), 0, stream, r.table, static_cast<const float*>(r.freq), r.head_dim / 4, r.positions);
    CUDA_CHECK_LAUNCH();
}

// Upstream Yarn.reset: initial frequencies, their table, softmax scale 0.1.
inline void yarn_rope_reset(YarnRope& r, cudaStream_t stream) {
    const int n = r.head_dim / 4;
    const float step = 1.0f / static_cast<float>(n - 1);  // torch: (end - start) / (steps - 1) in fp32 on the host
    // writes the n frequencies, a multiply-add and a power each
    const Work work{.name = "yarn_rope_reset", .flops = 2.0 * n, .bytes_written = 4.0 * n};
    launch(work, yarn_reset_frequencies_kernel, dim3(1), dim3(n), 0, stream, r.freq, n, step);
    CUDA_CHECK_LAUNCH();
    yarn_fill_table(r, stream);
    r.attn_scale = 0.1;
}

// Upstream Yarn.apply(old_window, new_window) (windows in tokens): interpolated frequencies,
// their table, and attn_scale *= 0.2 * ln(new/old) + 1.
inline void yarn_rope_apply(YarnRope& r, int old_window, int new_window, cudaStream_t stream, int alpha = 1,
                            int beta = 32) {
    kernel_require(old_window > 0 && new_window > 0 && beta > alpha,
                   "yarn_rope_apply: need positive windows and beta > alpha");
    const int n = r.head_dim / 4;
    const double scaling = static_cast<double>(old_window) / new_window;
    const float inv_two_pi = 1.0f / static_cast<float>(6.283185307179586);  // Python's 2 * math.pi
    const float inv_span = 1.0f / static_cast<float>(beta - alpha);
    // reads and writes the n frequencies, 8 operations each
    const Work work{.name = "yarn_rope_apply", .flops = 8.0 * n, .bytes_read = 4.0 * n, .bytes_written = 4.0 * n};
    launch(work, yarn_interpolate_frequencies_kernel, dim3(1), dim3(n), 0, stream, r.freq, n,
           static_cast<float>(old_window), inv_two_pi, static_cast<float>(alpha), inv_span, static_cast<float>(scaling),
           static_cast<float>(1.0 - scaling));
    CUDA_CHECK_LAUNCH();
    yarn_fill_table(r, stream);
    r.attn_scale *= 0.2 * std::log(static_cast<double>(new_window) / old_window) + 1.0;
}

// ---- the layer's auxiliary inputs ----
// The value-embedding gate's 12 inputs: 2 sigmoid(bf16(in . ve_gate[h])) scales head h's ve row.
// Upstream 2c702746 train_gpt.py L1102 (non-paired layers, #70) and L1120 (paired layers).
enum class VeGateInput : uint8_t {
    x,         // xa[t, :12]: record 71's every layer, record 80's paired layers
    x_and_ve,  // cat(xa[t, :6], ve_table[ids[t], :6]): record 80's non-paired layers, record 84's every layer
               // (upstream a333be08 L1448-1453: computed outside the attention, aux_v.view_as(v) on paired ones)
};
constexpr int kVeGateHalf = kGateWidth / 2;  // x_and_ve: columns 0-5 of xa, then 0-5 of the ve row
// Record 85 (upstream 003ff3e2, CausalSelfAttention.forward and unpack_*_mudd_gate): the output gate and XSA take
// their strengths per token from columns of the MUDD gate's coefficients (kernels/mudd.cuh: fp32 copies of bf16
// values, `stride` per token) in place of record 71-84's sigmoid gate and per-layer xsa_alphas: head h of token t
// reads column gate + h (the raw gate value) and xsa + h (alpha = tanh of it). The backward writes the gradients
// of those columns into `grads` (same layout; other columns untouched).
struct TokenCoefs {
    const float* coefs = nullptr;  // null: record 71-84's gates (AttnAux::attn_gate, xsa_alpha)
    float* grads = nullptr;        // backward only
    int stride = 0;
    int gate = -1;                 // y *= coefs[t, gate + h]; -1: this layer has no output gate (records 85+: 3, 10)
    int xsa = -1;                  // XSA's alpha; -1: no XSA (with AttnAux::xsa_v exactly)
    int unused = 0;
};
// No padding (a static_assert below): emu's race detector reads every word of a kernel's struct
// argument as a possible pointer (PointerArg), and a padding word's stale bytes around an int can
// make one that points into a live buffer, a race that is not there.
struct AttnAux {
    int T = 0, H = 0, D = 0;
    int rope_positions = 0;            // YarnRope::positions
    bool paired = false;               // paired-head layer (0, 2, 5, 9)
    bool key_offset = false;           // long-window layer: keys' upper D/2 dims from token t-1
    VeGateInput ve_gate_input = VeGateInput::x;  // with ve_table
    bool unused[5] = {};
    const bf16* rope_table = nullptr;  // YarnRope::table
    const bf16* xa = nullptr;          // attention input (T, C)
    const int32_t* ids = nullptr;      // token ids (T), for value-embedding rows
    const bf16* ve_table = nullptr;    // this layer's value-embedding table (V, C): value_embeds + k*V*C,
                                       // k = 0, 1 on layers 0, 1 and 2, 3, 4 on layers 8, 9, 10; else null
    const bf16* ve_gate = nullptr;     // (H, 12), with ve_table
    const bf16* attn_gate = nullptr;   // (H, 12)
    // XSA (record 82, upstream a333be08 L1125-1131), non-paired layers only: the output gate first
    // removes tanh(a[h]) of y's component along v (xsa_output). Both null on layers without it.
    const bf16* xsa_v = nullptr;       // the attention's v (T, H, D), value embeddings mixed in
    const float* xsa_alpha = nullptr;  // this layer's (H) raw strengths a (xsa_alphas row, fp32)
    // record 81's MUDD at the last layer: aux_v (T, C) from kernels/mudd.cuh, added to v (v = bf16(v_in + aux_v),
    // upstream's `v = v + aux_v`); its gradient is v's, which attn_qkv_backward leaves in dqkv's v columns
    const bf16* v_add = nullptr;
    TokenCoefs token{};  // record 85's per-token gate and XSA strengths
};
static_assert(std::has_unique_object_representations_v<AttnAux>, "AttnAux: a kernel argument with padding");
inline void attn_aux_check(const AttnAux& a, const char* who, bool rotary) {
    kernel_require(a.T > 0 && a.H > 0, "%s: need T > 0 and H > 0 (T=%d H=%d)", who, a.T, a.H);
    const int g = a.D / 8;
    kernel_require(a.D % 16 == 0 && g >= 2 && g <= 32 && (g & (g - 1)) == 0,
                   "%s: head_dim must be 16, 32, 64, 128 or 256 (D/8 lanes share a head row), got %d", who, a.D);
    kernel_require(a.H * a.D >= kGateWidth, "%s: model dim %d is below the gates' 12 channels", who, a.H * a.D);
    kernel_require(a.xa != nullptr, "%s: the attention input xa is required (gates read xa[:, :12])", who);
    kernel_require((a.ve_table == nullptr) == (a.ve_gate == nullptr), "%s: ve_table and ve_gate go together", who);
    kernel_require(a.ve_table == nullptr || a.ids != nullptr, "%s: value embeddings need the token ids", who);
    if (a.ve_gate_input == VeGateInput::x_and_ve) {  // record 84 also on paired layers: the gate is per (t, h) either way
        kernel_require(a.ve_table != nullptr, "%s: VeGateInput::x_and_ve on a layer without value embeddings", who);
    } else {
        kernel_require(a.ve_gate_input == VeGateInput::x, "%s: unknown VeGateInput %d", who,
                       static_cast<int>(a.ve_gate_input));
    }
    if (a.token.coefs == nullptr) {
        kernel_require((a.xsa_v == nullptr) == (a.xsa_alpha == nullptr), "%s: xsa_v and xsa_alpha go together", who);
    } else {
        const TokenCoefs& c = a.token;
        kernel_require(a.xsa_alpha == nullptr && a.attn_gate == nullptr,
                       "%s: per-token strengths (AttnAux::token) replace attn_gate and xsa_alpha: set one or the other", who);
        kernel_require((a.xsa_v == nullptr) == (c.xsa < 0), "%s: xsa_v and a per-token XSA column go together", who);
        kernel_require(c.gate >= 0 || c.xsa >= 0, "%s: per-token strengths with neither a gate nor an XSA column", who);
        kernel_require(c.gate + a.H <= c.stride && c.xsa + a.H <= c.stride && c.gate >= -1 && c.xsa >= -1,
                       "%s: per-token columns gate %d, xsa %d (+%d heads) outside the coefficients' %d per token", who,
                       c.gate, c.xsa, a.H, c.stride);
    }
    kernel_require(a.xsa_v == nullptr || !a.paired,
                   "%s: XSA on a paired layer (upstream applies it to non-paired layers only: v is (2T, H/2, D) there)",
                   who);
    if (rotary) {
        kernel_require(!(a.paired && a.key_offset), "%s: the key offset exists only on non-paired layers", who);
        kernel_require(a.paired ? a.H % 2 == 0 : true, "%s: paired heads need an even head count (H=%d)", who, a.H);
        kernel_require(a.rope_table != nullptr, "%s: no rotary table", who);
        const int64_t needed = static_cast<int64_t>(a.T) * (a.paired ? 2 : 1);
        kernel_require(needed <= a.rope_positions, "%s: rotary table has %d positions, this layer needs %lld", who,
                       a.rope_positions, static_cast<long long>(needed));
    }
}

// Bytes the attention auxiliaries move, the units of their Work: a (T, C) bf16 tensor; a (T, H) fp32
// statistic; the rotary table rows the layer's positions read (T, or 2T for paired heads, D bytes each);
// the gates' first 12 columns of xa (and of dxa) and one (H, 12) gate; the value-embedding extras (the
// ids, the gathered rows, the VE gate's columns of xa and the gate: x_and_ve reads 6 columns of xa, and
// its 6 of ve are in the gathered rows, counted there).
inline double attn_aux_rows_bytes(const AttnAux& a) { return 2.0 * a.T * a.H * a.D; }
inline double attn_aux_stats_bytes(const AttnAux& a) { return 4.0 * a.T * a.H; }
inline double attn_aux_rope_bytes(const AttnAux& a) { return (a.paired ? 2.0 : 1.0) * a.T * a.D; }
inline double attn_aux_gate_bytes(const AttnAux& a) { return 2.0 * kGateWidth * (a.T + a.H); }
inline double attn_aux_ve_gate_bytes(const AttnAux& a) {
    return a.ve_gate_input == VeGateInput::x_and_ve ? 2.0 * (kVeGateHalf * a.T + kGateWidth * a.H)
                                                     : attn_aux_gate_bytes(a);
}
inline double attn_aux_ve_bytes(const AttnAux& a) {
    return a.ve_table ? 4.0 * a.T + attn_aux_rows_bytes(a) + attn_aux_ve_gate_bytes(a) : 0;
}

// One thread per 8 dims of one head row: D/8 adjacent lanes share a row (rows never straddle a
// warp), and every lane of a launched warp takes part in the row sums (threads past the end work
// on the last row and store nothing).
struct AttnHeadLane {
    int row, t, h, d0;  // row = t*H + h, dims d0..d0+7
    bool valid;
};
__device__ __forceinline__ AttnHeadLane attn_head_lane(int T, int H, int D) {
    const int lanes = D / 8;
    const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const int64_t raw = idx / lanes;
    AttnHeadLane l;
    l.valid = raw < static_cast<int64_t>(T) * H;
    l.row = l.valid ? static_cast<int>(raw) : T * H - 1;
    l.t = l.row / H;
    l.h = l.row % H;
    l.d0 = static_cast<int>(idx % lanes) * 8;
    return l;
}
inline dim3 attn_head_lane_grid(int T, int H, int D) {
    const int64_t threads = static_cast<int64_t>(T) * H * (D / 8);
    return dim3(static_cast<unsigned>(ceil_div<int64_t>(threads, 256)));
}
// Sum over the `lanes` adjacent lanes of a head row (a power of two up to 32, aligned).
__device__ __forceinline__ float attn_head_row_sum(float v, int lanes) {
    switch (lanes) {
        case 32: return warp_butterfly<WarpSum, 16>(v);
        case 16: return warp_butterfly<WarpSum, 8>(v);
        case 8: return warp_butterfly<WarpSum, 4>(v);
        case 4: return warp_butterfly<WarpSum, 2>(v);
        case 2: return warp_butterfly<WarpSum, 1>(v);
        default: return v;
    }
}
__device__ __forceinline__ void rope_load8(float* dst, const bf16* src) {
    const Pack128<bf16> p = load128(src);
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = __bfloat162float(p[i]);
}
__device__ __forceinline__ void rope_store8(bf16* dst, const float* src) {
    Pack128<bf16> p;
#pragma unroll
    for (int i = 0; i < 8; ++i) p[i] = __float2bfloat16(src[i]);
    store128(dst, p);
}
__device__ __forceinline__ float rope_sum_squares8(const float* x) {
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) s = fmaf(x[i], x[i], s);
    return s;
}
constexpr float kQKNormEps = FLT_EPSILON;  // F.rms_norm without eps on bf16 input (torch 2.10)

// The VE gate's logit of token t, head h: bf16(in . ve_gate[h]) with fp32 fused multiply-adds in
// the input's column order (upstream's bf16 F.linear of the 12-wide input, L1102/L1120). x_and_ve's
// input is cat(xa[t, :6], ve[:6]) with ve the token's row of this layer's table as stored (bf16, no
// scaling before the gate: upstream's `ve` is value_embeds[ids] itself, L1303).
__device__ __forceinline__ float ve_gate_logit(const AttnAux& a, int t, int h) {
    const size_t C = static_cast<size_t>(a.H) * a.D;
    const bf16* x = a.xa + t * C;
    const bf16* w = a.ve_gate + h * kGateWidth;
    if (a.ve_gate_input == VeGateInput::x) return gate_logit(x, w);
    const bf16* ve = a.ve_table + static_cast<size_t>(a.ids[t]) * C;
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < kVeGateHalf; ++j) acc = fmaf(__bfloat162float(x[j]), __bfloat162float(w[j]), acc);
#pragma unroll
    for (int j = 0; j < kVeGateHalf; ++j)
        acc = fmaf(__bfloat162float(ve[j]), __bfloat162float(w[kVeGateHalf + j]), acc);
    return __bfloat162float(__float2bfloat16(acc));
}

// ---- forward: q, k, v from qkv ----
// q = rot_p(rmsnorm(q_in)), k likewise, then on key-offset layers k[t, :, D/2:] = k[t-1, :, D/2:]
// (t >= 1, across documents); rot_p: (x0, x1) -> (c x0 + s x1, c x1 - s x0) on the lower D/2 dims
// with {c, s} of position p, identity above. v = v_in + 2 sigmoid(bf16(in . ve_gate[h])) *
// ve_table[ids[t]] (head h's slice) when the layer has value embeddings, else v_in; in = xa[t, :12]
// or cat(xa[t, :6], ve_table[ids[t], :6]) (ve_gate_logit). The sigmoid and the mix in fp32, v rounded
// once: upstream's compiled graph fuses them after the bf16 matmul output.
__global__ void attn_qkv_forward_kernel(bf16* q_out, bf16* k_out, bf16* v_out, float* rstd_q, float* rstd_k,
                                        const bf16* qkv, AttnAux a) {
    const AttnHeadLane l = attn_head_lane(a.T, a.H, a.D);
    const int lanes = a.D / 8, C = a.H * a.D;
    const bf16* q_in = qkv + static_cast<size_t>(l.t) * 3 * C + l.h * a.D + l.d0;
    const bf16* k_in = q_in + C;
    float xq[8], xk[8], xkp[8] = {};
    rope_load8(xq, q_in);
    rope_load8(xk, k_in);
    const float inv_d = 1.0f / static_cast<float>(a.D);
    const float rq = rsqrtf(attn_head_row_sum(rope_sum_squares8(xq), lanes) * inv_d + kQKNormEps);
    const float rk = rsqrtf(attn_head_row_sum(rope_sum_squares8(xk), lanes) * inv_d + kQKNormEps);
    float rkp = rk;
    if (a.key_offset) {  // the previous token's key row (its own at t = 0), normalized by its own rstd
        rope_load8(xkp, k_in - (l.t > 0 ? 3 * C : 0));
        rkp = rsqrtf(attn_head_row_sum(rope_sum_squares8(xkp), lanes) * inv_d + kQKNormEps);
    }
    float yq[8], yk[8];
    if (l.d0 < a.D / 2) {
        const int p = a.paired ? 2 * l.t + (l.h & 1) : l.t;
        const Pack128<bf16> cs = load128(a.rope_table + static_cast<size_t>(p) * (a.D / 2) + l.d0);
#pragma unroll
        for (int m = 0; m < 4; ++m) {
            const float c = __bfloat162float(cs[2 * m]), s = __bfloat162float(cs[2 * m + 1]);
            const float q0 = xq[2 * m] * rq, q1 = xq[2 * m + 1] * rq;
            const float k0 = xk[2 * m] * rk, k1 = xk[2 * m + 1] * rk;
            yq[2 * m] = c * q0 + s * q1;
            yq[2 * m + 1] = c * q1 - s * q0;
            yk[2 * m] = c * k0 + s * k1;
            yk[2 * m + 1] = c * k1 - s * k0;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            yq[i] = xq[i] * rq;
            yk[i] = a.key_offset ? xkp[i] * rkp : xk[i] * rk;
        }
    }
    if (!l.valid) return;
    const size_t out_at = static_cast<size_t>(l.row) * a.D + l.d0;
    rope_store8(q_out + out_at, yq);
    rope_store8(k_out + out_at, yk);
    if (l.d0 == 0) {
        rstd_q[l.row] = rq;
        rstd_k[l.row] = rk;
    }
    if (v_out != nullptr) {
        float v[8];
        rope_load8(v, q_in + 2 * C);
        if (a.ve_table != nullptr) {
            const float g = 2.0f * sigmoidf(ve_gate_logit(a, l.t, l.h));
            float ve[8];
            rope_load8(ve, a.ve_table + static_cast<size_t>(a.ids[l.t]) * C + l.h * a.D + l.d0);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] = fmaf(g, ve[i], v[i]);
        }
        if (a.v_add != nullptr) {
            float add[8];
            rope_load8(add, a.v_add + static_cast<size_t>(l.t) * C + l.h * a.D + l.d0);
#pragma unroll
            for (int i = 0; i < 8; ++i) v[i] += add[i];
        }
        rope_store8(v_out + out_at, v);
    }
}
// Reads qkv's q and k (and v when written), the rotary rows and the value-embedding extras; writes q, k,
// v and both rstd; the norm and rotary, 6 operations per q and k element, 2 per v element with ve.
inline Work attn_qkv_forward_work(const AttnAux& a, bool writes_v) {
    const double rows = attn_aux_rows_bytes(a), elems = rows / 2;
    return Work{.name = "attn_qkv_forward", .flops = 12 * elems + (a.ve_table ? 2 * elems : 0) + (a.v_add ? elems : 0),
                .bytes_read = (writes_v ? 3 : 2) * rows + attn_aux_rope_bytes(a) + attn_aux_ve_bytes(a) +
                              (a.v_add ? rows : 0),
                .bytes_written = (writes_v ? 3 : 2) * rows + 2 * attn_aux_stats_bytes(a)};
}
// q, k, v: (T, H, D); rstd_q, rstd_k: (T, H) fp32 for the backward. v may be null on a layer
// without value embeddings when the attention reads v from qkv (row stride 3C) instead.
inline void attn_qkv_forward(const AttnAux& a, bf16* q, bf16* k, bf16* v, float* rstd_q, float* rstd_k,
                             const bf16* qkv, cudaStream_t stream) {
    attn_aux_check(a, "attn_qkv_forward", true);
    kernel_require(a.ve_table == nullptr || v != nullptr, "attn_qkv_forward: a layer with value embeddings needs v");
    kernel_require(a.v_add == nullptr || v != nullptr, "attn_qkv_forward: a layer adding aux_v to v needs v");
    launch(attn_qkv_forward_work(a, v != nullptr), attn_qkv_forward_kernel, attn_head_lane_grid(a.T, a.H, a.D),
           dim3(256), 0, stream, q, k, v, rstd_q, rstd_k, qkv, a);
    CUDA_CHECK_LAUNCH();
}

// ---- backward: d(qkv), d(ve rows), d(ve gate logits) ----
// Through the rotary: dn = rot_p^T dy, i.e. (c dy0 - s dy1, s dy0 + c dy1); through the key
// offset: key t's upper dims get dk[t+1]'s (and key 0 also its own, which it kept); through the
// norm: dx = r (dn - n mean(dn . n)). v: d(v_in) = dv, d(ve row) = g dv, dz = 2 s'(z) (dv . ve), where on
// XSA layers dv = bf16(dv + dv_xsa): v's two bf16 gradients (attention, XSA) summed as autograd sums them.
// (With x_and_ve the gate's own share of d(ve[:, :6]) comes from dz: attn_gates_backward adds it.)
__global__ void attn_qkv_backward_kernel(bf16* dqkv, bf16* dve, float* dz_ve, const bf16* dq, const bf16* dk,
                                         const bf16* dv, const bf16* dv_xsa, const bf16* qkv, const float* rstd_q,
                                         const float* rstd_k, AttnAux a) {
    const AttnHeadLane l = attn_head_lane(a.T, a.H, a.D);
    const int lanes = a.D / 8, C = a.H * a.D;
    const size_t at = static_cast<size_t>(l.row) * a.D + l.d0;
    const size_t in_at = static_cast<size_t>(l.t) * 3 * C + l.h * a.D + l.d0;
    const bool rotated = l.d0 < a.D / 2;
    float cs[8] = {};
    if (rotated) rope_load8(cs, a.rope_table + static_cast<size_t>(a.paired ? 2 * l.t + (l.h & 1) : l.t) * (a.D / 2) + l.d0);
    const float inv_d = 1.0f / static_cast<float>(a.D);
    // q and k: the same chain, k's incoming gradient shifted on key-offset layers
    float dx[2][8];
    for (int which = 0; which < 2; ++which) {
        float x[8], dy[8], dn[8];
        rope_load8(x, qkv + in_at + which * C);
        const float r = (which == 0 ? rstd_q : rstd_k)[l.row];
        const bf16* grad = which == 0 ? dq : dk;
        if (which == 1 && a.key_offset && !rotated) {
            float next[8];
            for (int i = 0; i < 8; ++i) dy[i] = 0.0f;
            if (l.t + 1 < a.T) {
                rope_load8(next, grad + at + a.D * a.H);
                for (int i = 0; i < 8; ++i) dy[i] += next[i];
            }
            if (l.t == 0) {
                rope_load8(next, grad + at);
                for (int i = 0; i < 8; ++i) dy[i] += next[i];
            }
        } else {
            rope_load8(dy, grad + at);
        }
        if (rotated) {
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                const float c = cs[2 * m], s = cs[2 * m + 1];
                dn[2 * m] = c * dy[2 * m] - s * dy[2 * m + 1];
                dn[2 * m + 1] = s * dy[2 * m] + c * dy[2 * m + 1];
            }
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) dn[i] = dy[i];
        }
        float dot = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) dot = fmaf(dn[i], x[i] * r, dot);
        dot = attn_head_row_sum(dot, lanes) * inv_d;
#pragma unroll
        for (int i = 0; i < 8; ++i) dx[which][i] = r * (dn[i] - x[i] * r * dot);
    }
    // v
    float dvv[8];
    rope_load8(dvv, dv + at);
    if (dv_xsa != nullptr) {
        float dx_xsa[8];
        rope_load8(dx_xsa, dv_xsa + at);
#pragma unroll
        for (int i = 0; i < 8; ++i) dvv[i] = __bfloat162float(__float2bfloat16(dvv[i] + dx_xsa[i]));
    }
    float dz = 0.0f, g = 0.0f, dve_row[8] = {};
    if (a.ve_table != nullptr) {
        const float sg = sigmoidf(ve_gate_logit(a, l.t, l.h));
        g = 2.0f * sg;
        float ve[8];
        rope_load8(ve, a.ve_table + static_cast<size_t>(a.ids[l.t]) * C + l.h * a.D + l.d0);
        float part = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            part = fmaf(dvv[i], ve[i], part);
            dve_row[i] = g * dvv[i];
        }
        dz = attn_head_row_sum(part, lanes) * 2.0f * sg * (1.0f - sg);
    }
    if (!l.valid) return;
    rope_store8(dqkv + in_at, dx[0]);
    rope_store8(dqkv + in_at + C, dx[1]);
    rope_store8(dqkv + in_at + 2 * C, dvv);
    if (a.ve_table != nullptr) {
        rope_store8(dve + static_cast<size_t>(l.t) * C + l.h * a.D + l.d0, dve_row);
        if (l.d0 == 0) dz_ve[l.row] = dz;
    }
}
// Reads dq, dk, dv, qkv's q and k, both rstd, the rotary rows and the value-embedding extras; writes
// dqkv (and dve, dz_ve); the rotary and norm backward, 10 operations per q and k element, 4 per v
// element with ve (and XSA's dv read and added).
inline Work attn_qkv_backward_work(const AttnAux& a, bool xsa) {
    const double rows = attn_aux_rows_bytes(a), elems = rows / 2;
    return Work{.name = "attn_qkv_backward", .flops = 20 * elems + (a.ve_table ? 4 * elems : 0) + (xsa ? elems : 0),
                .bytes_read = (xsa ? 6 : 5) * rows + 2 * attn_aux_stats_bytes(a) + attn_aux_rope_bytes(a) +
                              attn_aux_ve_bytes(a),
                .bytes_written = 3 * rows + (a.ve_table ? rows + attn_aux_stats_bytes(a) : 0)};
}
// dqkv: (T, 3C); dve: (T, C) gradient of the gathered value-embedding rows through the value mix (to
// embedding_backward with the token ids; with x_and_ve, after attn_gates_backward added the gate's
// share); dz_ve: (T, H) fp32 gradient of the ve gate logits (to attn_gates_backward).
// dve and dz_ve only on layers with value embeddings. dv_xsa: XsaGrads::dv, exactly on XSA layers.
inline void attn_qkv_backward(const AttnAux& a, bf16* dqkv, bf16* dve, float* dz_ve, const bf16* dq, const bf16* dk,
                              const bf16* dv, const bf16* qkv, const float* rstd_q, const float* rstd_k,
                              cudaStream_t stream, const bf16* dv_xsa = nullptr) {
    attn_aux_check(a, "attn_qkv_backward", true);
    kernel_require((a.ve_table != nullptr) == (dve != nullptr && dz_ve != nullptr),
                   "attn_qkv_backward: dve and dz_ve are needed exactly on layers with value embeddings");
    kernel_require((a.xsa_v != nullptr) == (dv_xsa != nullptr),
                   "attn_qkv_backward: XSA's dv is needed exactly on layers with XSA (AttnAux::xsa_v)");
    launch(attn_qkv_backward_work(a, dv_xsa != nullptr), attn_qkv_backward_kernel, attn_head_lane_grid(a.T, a.H, a.D),
           dim3(256), 0, stream, dqkv, dve, dz_ve, dq, dk, dv, dv_xsa, qkv, rstd_q, rstd_k, a);
    CUDA_CHECK_LAUNCH();
}

// ---- output gate, with XSA where the layer has it ----
// XSA (exclusive self attention) removes alpha of y's component along v, in one of two roundings of the same math:
//   record 82 (XsaForm::unit): w = v^ = v / max(|v|, 1e-4), p = y . v^, y' = y - alpha p v^, alpha = bf16(tanh(a[h]))
//     (upstream a333be08: F.normalize(v, eps=1e-4), tanh(a).type_as(y));
//   record 86 (XsaForm::projection): w = v, n = max(|v|^2, 1e-8), p = (y . v) / n, y' = y - alpha p v, alpha =
//     tanh(coefs[t, xsa + h]) (upstream 003ff3e2: (y * v).sum / v.square().sum.clamp_min(1e-8); tanh of a bf16
//     column, which the compiled graph keeps in fp32).
// Without XSA y' = y. Upstream's compiled graph fuses it with the gate: y' stays fp32 until y_gated.
enum class XsaForm { unit, projection };
struct XsaRow {
    float w[8];       // this lane's dims of the direction y' moves along: v^ (unit) or v (projection)
    float p;          // y's coefficient along w
    float scale;      // unit: 1 / max(|v|, 1e-4); projection: 1 / max(|v|^2, 1e-8)
    bool clamped;     // unit: |v| <= 1e-4, so v^ = v / 1e-4 is not a unit vector; projection: |v|^2 < 1e-8
};
constexpr float kXsaNormEps = 1e-4f, kXsaSquareEps = 1e-8f;
__device__ __forceinline__ XsaForm xsa_form(const AttnAux& a) {
    return a.token.coefs != nullptr ? XsaForm::projection : XsaForm::unit;
}
__device__ __forceinline__ float xsa_alpha(const AttnAux& a, int t, int h) {
    if (a.token.coefs != nullptr) return tanhf(a.token.coefs[static_cast<size_t>(t) * a.token.stride + a.token.xsa + h]);
    return __bfloat162float(__float2bfloat16(tanhf(a.xsa_alpha[h])));
}
// Every lane of the warp takes part (row sums); y[8], v[8] are this lane's dims.
__device__ __forceinline__ XsaRow xsa_row(XsaForm form, const float* y, const float* v, int lanes) {
    XsaRow x;
    float p = 0.0f;
    if (form == XsaForm::projection) {
        const float n = attn_head_row_sum(rope_sum_squares8(v), lanes);
        x.clamped = n < kXsaSquareEps;  // clamp_min: n = 1e-8 passes no gradient to v below it
        x.scale = 1.0f / (x.clamped ? kXsaSquareEps : n);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            x.w[i] = v[i];
            p = fmaf(y[i], v[i], p);
        }
        x.p = attn_head_row_sum(p, lanes) / (x.clamped ? kXsaSquareEps : n);
        return x;
    }
    const float norm = sqrtf(attn_head_row_sum(rope_sum_squares8(v), lanes));
    x.clamped = !(norm > kXsaNormEps);
    const float m = x.clamped ? kXsaNormEps : norm;
    x.scale = 1.0f / m;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        x.w[i] = v[i] / m;
        p = fmaf(y[i], x.w[i], p);
    }
    x.p = attn_head_row_sum(p, lanes);
    return x;
}
// The output gate's value for head h of token t: sigmoid(bf16(xa[t,:12] . attn_gate[h])) (records 71-84), the raw
// per-token column (record 85's gated layers), or 1 (record 85's layers with XSA and no gate).
__device__ __forceinline__ float output_gate(const AttnAux& a, const AttnHeadLane& l) {
    if (a.token.coefs == nullptr)
        return sigmoidf(gate_logit(a.xa + static_cast<size_t>(l.t) * a.H * a.D, a.attn_gate + l.h * kGateWidth));
    return a.token.gate < 0 ? 1.0f : a.token.coefs[static_cast<size_t>(l.t) * a.token.stride + a.token.gate + l.h];
}
// y_gated = y' * s, y' and s as above
__global__ void attn_output_gate_forward_kernel(bf16* y_gated, const bf16* y, AttnAux a) {
    const AttnHeadLane l = attn_head_lane(a.T, a.H, a.D);
    const float s = output_gate(a, l);
    const size_t at = static_cast<size_t>(l.row) * a.D + l.d0;
    float yv[8];
    rope_load8(yv, y + at);
    if (a.xsa_v != nullptr) {  // every lane of the warp reaches the row sums: rows past the end return below
        float v[8];
        rope_load8(v, a.xsa_v + at);
        const XsaRow x = xsa_row(xsa_form(a), yv, v, a.D / 8);
        const float ap = xsa_alpha(a, l.t, l.h) * x.p;
#pragma unroll
        for (int i = 0; i < 8; ++i) yv[i] -= ap * x.w[i];
    }
    if (!l.valid) return;
#pragma unroll
    for (int i = 0; i < 8; ++i) yv[i] *= s;
    rope_store8(y_gated + at, yv);
}
// Reads y (and v), the gate's inputs (the columns of xa and the gate, or a per-token column) and XSA's strengths;
// writes y_gated; a multiply per element (XSA: 7 more operations per element, a square root and a tanh per row).
inline double attn_output_gate_input_bytes(const AttnAux& a) {
    if (a.token.coefs == nullptr) return attn_aux_gate_bytes(a) + (a.xsa_v != nullptr ? 4.0 * a.H : 0);
    return 4.0 * a.T * a.H * ((a.token.gate >= 0) + (a.token.xsa >= 0));
}
inline Work attn_output_gate_forward_work(const AttnAux& a) {
    const bool xsa = a.xsa_v != nullptr;
    return Work{.name = "attn_output_gate_forward", .flops = (xsa ? 8.0 : 1.0) * attn_aux_rows_bytes(a) / 2,
                .bytes_read = (xsa ? 2 : 1) * attn_aux_rows_bytes(a) + attn_output_gate_input_bytes(a),
                .bytes_written = attn_aux_rows_bytes(a)};
}
inline void attn_output_gate_forward(const AttnAux& a, bf16* y_gated, const bf16* y, cudaStream_t stream) {
    attn_aux_check(a, "attn_output_gate_forward", false);
    kernel_require(a.attn_gate != nullptr || a.token.coefs != nullptr,
                   "attn_output_gate_forward: no attn_gate (nor per-token strengths)");
    launch(attn_output_gate_forward_work(a), attn_output_gate_forward_kernel, attn_head_lane_grid(a.T, a.H, a.D),
           dim3(256), 0, stream, y_gated, y, a);
    CUDA_CHECK_LAUNCH();
}

// XSA's outputs of the gate's backward (layers with AttnAux::xsa_v).
struct XsaGrads {
    bf16* dv = nullptr;         // (T, H, D): XSA's share of v's gradient; attn_qkv_backward adds the attention's
    float* d_alpha = nullptr;   // (H): gradient of the raw strengths a
    BlockPartials scratch{};    // attn_output_gate_backward_scratch_bytes; its ticket zero before the first launch
    bool accumulate = false;    // d_alpha += (every micro-batch after the first), as for every parameter gradient
};
constexpr int kOutputGateThreads = 256;
inline int attn_output_gate_blocks(int T, int H, int D) { return static_cast<int>(attn_head_lane_grid(T, H, D).x); }
// XsaGrads::scratch's partials: a value per head per block
inline size_t attn_output_gate_backward_scratch_bytes(int T, int H, int D) {
    return static_cast<size_t>(attn_output_gate_blocks(T, H, D)) * H * sizeof(float);
}
// g = d_y_gated * s and dy = g. The gate's gradient per head row: records 71-84 dz_attn = s (1 - s) (d_y_gated . y')
// (the logit's; attn_gates_backward takes it on), record 85 grads[t, gate + h] = bf16(d_y_gated . y').
// With XSA, q = (g . w) (unit) or (g . v) / n (projection):
//   dy = g - alpha q w,  dvhat = -alpha (p g + q y),
//   unit:       dv = (dvhat + 2 alpha p q w) / max(|v|, 1e-4)   (clamped: dvhat / 1e-4)
//   projection: dv = dvhat + 2 alpha p q v                      (clamped: dvhat)
//   d alpha = -p q (unit), -p q n (projection) per row; d a = d alpha (1 - tanh(a)^2)
// Record 82: d alpha summed over tokens, rounded to bf16 (alpha's dtype): each block sums its rows' -p q per head
// (in row order) into the scratch and the last block sums the blocks' partials in a fixed order (block_sums_as).
// Record 85: per row, grads[t, xsa + h] = bf16(d alpha (1 - alpha^2)), as the compiled graph fuses tanh's backward.
__global__ void __launch_bounds__(kOutputGateThreads)
    attn_output_gate_backward_kernel(bf16* dy, float* dz_attn, const bf16* dy_gated, const bf16* y, bf16* dv_xsa,
                                     float* d_alpha, BlockPartials scratch, int accumulate, AttnAux a) {
    const AttnHeadLane l = attn_head_lane(a.T, a.H, a.D);
    const int lanes = a.D / 8;
    const float s = output_gate(a, l);
    const size_t at = static_cast<size_t>(l.row) * a.D + l.d0;
    float g[8], yv[8], v[8];
    rope_load8(g, dy_gated + at);
    rope_load8(yv, y + at);
    const bool xsa = a.xsa_v != nullptr;
    const XsaForm form = xsa_form(a);
    XsaRow x{};
    float alpha = 0.0f;
    if (xsa) {
        rope_load8(v, a.xsa_v + at);
        x = xsa_row(form, yv, v, lanes);
        alpha = xsa_alpha(a, l.t, l.h);
    }
    float part = 0.0f, q = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float y_out = xsa ? yv[i] - alpha * x.p * x.w[i] : yv[i];
        part = fmaf(g[i], y_out, part);
        g[i] *= s;
        q = fmaf(g[i], x.w[i], q);
    }
    part = attn_head_row_sum(part, lanes);
    float contribution = 0.0f;  // d alpha of this row
    if (xsa) {
        q = attn_head_row_sum(q, lanes);
        if (form == XsaForm::projection) q *= x.scale;
        contribution = form == XsaForm::projection ? -x.p * q / x.scale : -x.p * q;
        const float aq = alpha * q;
        float dvv[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float dvhat = -alpha * (x.p * g[i] + q * yv[i]);
            if (form == XsaForm::unit)
                dvv[i] = x.clamped ? dvhat * x.scale : (dvhat + 2.0f * alpha * x.p * q * x.w[i]) * x.scale;
            else
                dvv[i] = x.clamped ? dvhat : dvhat + 2.0f * alpha * x.p * q * x.w[i];
            g[i] -= aq * x.w[i];
        }
        if (l.valid) rope_store8(dv_xsa + at, dvv);
    }
    if (l.valid) {
        rope_store8(dy + at, g);
        const TokenCoefs& c = a.token;
        if (c.coefs == nullptr) {
            if (l.d0 == 0) dz_attn[l.row] = part * s * (1.0f - s);
        } else if (l.d0 == 0) {
            float* row = c.grads + static_cast<size_t>(l.t) * c.stride + l.h;
            if (c.gate >= 0) row[c.gate] = __bfloat162float(__float2bfloat16(part));
            if (xsa) row[c.xsa] = __bfloat162float(__float2bfloat16(contribution * (1.0f - alpha * alpha)));
        }
    }
    if (!xsa || a.token.coefs != nullptr) return;  // uniform over the grid: the block-wide steps below see every thread or none

    // record 82's d alpha: this block's rows per head, in row order, then the last block over the blocks
    __shared__ float row_part[kOutputGateThreads];
    const int rows = blockDim.x / lanes, r = threadIdx.x / lanes;
    const int64_t row0 = static_cast<int64_t>(blockIdx.x) * rows;
    if (threadIdx.x % lanes == 0) row_part[r] = l.valid ? contribution : 0.0f;
    __syncthreads();
    if (const int h = static_cast<int>(threadIdx.x); h < a.H) {
        float sum = 0.0f;
        for (int k = 0; k < rows; ++k)
            if ((row0 + k) % a.H == h) sum += row_part[k];
        scratch.partials[static_cast<size_t>(blockIdx.x) * a.H + h] = sum;
    }
    if (!last_block_done(scratch.done)) return;
    const int blocks = static_cast<int>(gridDim.x);
    block_sums_as<kSumPartialsThreads>(scratch.partials, a.H, blocks, a.H, sum_threads(blocks, kSumPartialsThreads),
                                       [&](int h, float sum) {  // the heads side by side
                                           const float t = tanhf(a.xsa_alpha[h]);
                                           const float da = __bfloat162float(__float2bfloat16(sum)) * (1.0f - t * t);
                                           d_alpha[h] = accumulate ? d_alpha[h] + da : da;
                                       });
}
// Reads dy_gated, y and the gate's inputs; writes dy and the gate's gradient (dz_attn, or a per-token column); a
// multiply-add and a multiply per element. XSA: also reads v and the strengths, writes dv (16 more operations per
// element) and d alpha: record 82's partials (and reads them back, with the ticket, in the last block) and d_alpha,
// or record 85's per-token column.
inline Work attn_output_gate_backward_work(const AttnAux& a, const XsaGrads& xsa) {
    const double rows = attn_aux_rows_bytes(a);
    const bool token = a.token.coefs != nullptr;
    Work w{.name = "attn_output_gate_backward", .flops = 1.5 * rows,
           .bytes_read = 2 * rows + attn_output_gate_input_bytes(a),
           .bytes_written = rows + (token ? attn_output_gate_input_bytes(a) : attn_aux_stats_bytes(a))};
    if (a.xsa_v == nullptr) return w;
    w.flops += 8.0 * rows;
    w.bytes_read += rows;
    w.bytes_written += rows;
    if (token) return w;
    const double partials = 4.0 * attn_output_gate_blocks(a.T, a.H, a.D) * a.H, ticket = sizeof(unsigned int);
    w.bytes_read += partials + ticket + (xsa.accumulate ? 4.0 * a.H : 0);
    w.bytes_written += partials + ticket + 4.0 * a.H;
    return w;
}
// dy: gradient of the attention output before XSA and the gate (may alias dy_gated); dz_attn: (T, H) fp32, records
// 71-84 (null with per-token strengths, whose gradients go to AttnAux::token.grads). Layers with XSA pass its
// outputs in `xsa` (record 85: dv only).
inline void attn_output_gate_backward(const AttnAux& a, bf16* dy, float* dz_attn, const bf16* dy_gated, const bf16* y,
                                      cudaStream_t stream, const XsaGrads& xsa = {}) {
    attn_aux_check(a, "attn_output_gate_backward", false);
    const bool on = a.xsa_v != nullptr, token = a.token.coefs != nullptr;
    if (token) {
        kernel_require(a.token.grads != nullptr && dz_attn == nullptr,
                       "attn_output_gate_backward: per-token strengths take their gradients in AttnAux::token.grads, "
                       "not dz_attn");
        kernel_require(on == (xsa.dv != nullptr) && xsa.d_alpha == nullptr && xsa.scratch.partials == nullptr,
                       "attn_output_gate_backward: per-token XSA needs XsaGrads::dv exactly with AttnAux::xsa_v, and no "
                       "d_alpha or scratch");
    } else {
        kernel_require(on == (xsa.dv != nullptr && xsa.d_alpha != nullptr && xsa.scratch.partials != nullptr &&
                              xsa.scratch.done != nullptr),
                       "attn_output_gate_backward: XsaGrads (dv, d_alpha, scratch) are needed exactly with AttnAux::xsa_v");
        kernel_require(a.attn_gate != nullptr && dz_attn != nullptr, "attn_output_gate_backward: no attn_gate or dz_attn");
    }
    kernel_require(!on || (xsa.dv != dy && xsa.dv != dy_gated && xsa.dv != a.xsa_v),
                   "attn_output_gate_backward: XSA's dv may not alias dy, dy_gated or v");
    launch(attn_output_gate_backward_work(a, xsa), attn_output_gate_backward_kernel,
           dim3(attn_output_gate_blocks(a.T, a.H, a.D)), dim3(kOutputGateThreads), 0, stream, dy, dz_attn, dy_gated, y, xsa.dv, xsa.d_alpha, xsa.scratch,
           static_cast<int>(xsa.accumulate), a);
    CUDA_CHECK_LAUNCH();
}

// ---- both gates' weight gradients and their input gradient ----
// d_attn_gate[h, j] = sum_t dz_attn[t, h] xa[t, j] (d_ve_gate likewise from dz_ve and the VE gate's
// input), and dxa[t, j] += sum_h dz_attn[t, h] attn_gate[h, j] + dz_ve[t, h] ve_gate[h, j], for j < 12.
// VeGateInput::x_and_ve: the VE gate's input is cat(xa[t, :6], ve[t, :6]), so its terms of dxa stop at
// j < 6 and dve[t, j] += sum_h dz_ve[t, h] ve_gate[h, 6 + j] for j < 6 (upstream's cat backward).
// Either gate may be absent (no attn_gate: record 85's layers, upstream 003ff3e2 GPT.forward; no VE
// gate: layers without value embeddings); the block's gates are then just the other one.
// A block takes 128 rows: it stages their xa[:, :12] (and ve[:, :6]) and dz rows in shared memory with
// 16-byte loads (dz's rows are contiguous), then one thread per (gate, h, j) sums over the rows in
// order, and one thread per row updates dxa[t, :12] with a 16-byte and an 8-byte access (and dve[t, :6]
// with a 16-byte one). The VE gate alone reading cat(xa[:, :6], ve[:, :6]) touches xa's and dxa's
// columns 0-5 only: one 16-byte access per row each.
constexpr int kGateRowsPerBlock = 128;
constexpr int kGateMaxHeads = 32;  // bounds the staged dz rows: 32 KB of shared memory for both gates
// Shared memory: xa's 12 columns of the block's rows, then per gate present its dz rows and its (H, 12)
// weights, then (x_and_ve) the ve rows' 6 columns, fp32.
inline size_t attn_gates_backward_smem_bytes(int H, int gates, VeGateInput ve_input = VeGateInput::x) {
    const int ve_columns = ve_input == VeGateInput::x_and_ve ? kGateRowsPerBlock * kVeGateHalf : 0;
    return sizeof(float) * (kGateRowsPerBlock * kGateWidth + gates * (kGateRowsPerBlock * H + H * kGateWidth) + ve_columns);
}
// dst[0:n] = src[0:n] (fp32, both 16-byte aligned), 16 bytes per load where it can.
__device__ __forceinline__ void stage_f32(float* dst, const float* src, int n) {
    for (int i = threadIdx.x; i < n / 4; i += blockDim.x) store128(dst + 4 * i, load128(src + 4 * i));
    for (int i = n / 4 * 4 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
}
struct alignas(8) Bf16x4 {  // an 8-byte access: dxa's columns 8-11
    bf16 v[4];
};
__global__ void __launch_bounds__(kGateRowsPerBlock)
    attn_gates_backward_kernel(bf16* dxa, bf16* dve, LastBlockSum sum, const float* dz_attn, const float* dz_ve,
                               AttnAux a) {
    // the block's gate g is the attention gate (kind 0) or the VE gate (kind 1): kind g + first
    const int first = dz_attn != nullptr ? 0 : 1, gates = (dz_attn != nullptr) + (dz_ve != nullptr);
    const int H = a.H, C = H * a.D, per_gate = H * kGateWidth;
    const int n_w = gates * per_gate, t0 = blockIdx.x * kGateRowsPerBlock, rows = min(a.T - t0, kGateRowsPerBlock);
    const bool reads_ve = a.ve_gate_input == VeGateInput::x_and_ve;
    const bool narrow = first == 1 && reads_ve;  // the VE gate alone reads xa's columns 0-5: stage and update 0-7
    const int loads = narrow ? 1 : 2;
    float* xs = dynamic_smem<float>();                    // [row][j]
    float* dzs = xs + kGateRowsPerBlock * kGateWidth;     // [gate][row][h]
    float* ws = dzs + gates * kGateRowsPerBlock * H;      // [gate][h][j]
    float* vs = ws + n_w;                                 // [row][j < 6], x_and_ve only
    for (int i = threadIdx.x; i < loads * rows; i += blockDim.x) {  // columns 0-7 (and 8-15) of each row
        const int r = i / loads, c0 = 8 * (i % loads);
        const Pack128<bf16> p = load128(a.xa + static_cast<size_t>(t0 + r) * C + c0);
#pragma unroll
        for (int k = 0; k < 8; ++k)
            if (c0 + k < kGateWidth) xs[r * kGateWidth + c0 + k] = __bfloat162float(p[k]);
    }
    if (reads_ve)
        for (int r = threadIdx.x; r < rows; r += blockDim.x) {  // columns 0-7 of the token's ve row
            const Pack128<bf16> p = load128(a.ve_table + static_cast<size_t>(a.ids[t0 + r]) * C);
#pragma unroll
            for (int k = 0; k < kVeGateHalf; ++k) vs[r * kVeGateHalf + k] = __bfloat162float(p[k]);
        }
    for (int g = 0; g < gates; ++g)
        stage_f32(dzs + g * kGateRowsPerBlock * H, (g + first ? dz_ve : dz_attn) + static_cast<size_t>(t0) * H, rows * H);
    for (int i = threadIdx.x; i < n_w; i += blockDim.x) {
        const int k = i + first * per_gate;  // index into cat(attn_gate, ve_gate)
        ws[i] = __bfloat162float(k < per_gate ? a.attn_gate[k] : a.ve_gate[k - per_gate]);
    }
    __syncthreads();

    for (int k = threadIdx.x; k < n_w; k += blockDim.x) {  // this block's rows, in order
        const int g = k / per_gate, h = k % per_gate / kGateWidth, j = k % kGateWidth;
        const float* dz = dzs + g * kGateRowsPerBlock * H + h;
        const bool from_ve = reads_ve && g + first == 1 && j >= kVeGateHalf;  // the VE gate's input column j is ve's j - 6
        const float* in = from_ve ? vs + (j - kVeGateHalf) : xs + j;
        const int stride = from_ve ? kVeGateHalf : kGateWidth;
        float s = 0.0f;
        for (int r = 0; r < rows; ++r) s = fmaf(dz[r * H], in[r * stride], s);
        sum.scratch.partials[static_cast<size_t>(blockIdx.x) * n_w + k] = s;
    }
    if (const int r = threadIdx.x; r < rows) {  // sums over h in order, attn_gate's heads before ve_gate's
        float s[kGateWidth] = {}, sv[kVeGateHalf] = {};
        for (int g = 0; g < gates; ++g)
            for (int h = 0; h < H; ++h) {
                const float dz = dzs[(g * kGateRowsPerBlock + r) * H + h];
                const float* w = ws + (g * H + h) * kGateWidth;
#pragma unroll
                for (int j = 0; j < kVeGateHalf; ++j) s[j] = fmaf(dz, w[j], s[j]);
                if (reads_ve && g + first == 1) {
#pragma unroll
                    for (int j = 0; j < kVeGateHalf; ++j) sv[j] = fmaf(dz, w[kVeGateHalf + j], sv[j]);
                } else {
#pragma unroll
                    for (int j = kVeGateHalf; j < kGateWidth; ++j) s[j] = fmaf(dz, w[j], s[j]);
                }
            }
        bf16* d = dxa + static_cast<size_t>(t0 + r) * C;
        Pack128<bf16> lo = load128(d);
        const int lo_columns = narrow ? kVeGateHalf : 8;  // narrow: columns 6 and 7 are rewritten unchanged
#pragma unroll
        for (int j = 0; j < 8; ++j)
            if (j < lo_columns) lo[j] = __float2bfloat16(__bfloat162float(lo[j]) + s[j]);
        store128(d, lo);
        if (!narrow) {
            Bf16x4 hi = *reinterpret_cast<const Bf16x4*>(d + 8);
#pragma unroll
            for (int j = 0; j < 4; ++j) hi.v[j] = __float2bfloat16(__bfloat162float(hi.v[j]) + s[8 + j]);
            *reinterpret_cast<Bf16x4*>(d + 8) = hi;
        }
        if (reads_ve) {  // columns 6 and 7 are rewritten unchanged
            bf16* e = dve + static_cast<size_t>(t0 + r) * C;
            Pack128<bf16> p = load128(e);
#pragma unroll
            for (int j = 0; j < kVeGateHalf; ++j) p[j] = __float2bfloat16(__bfloat162float(p[j]) + sv[j]);
            store128(e, p);
        }
    }
    last_block_sum(sum, n_w);
}
inline size_t attn_gates_backward_scratch_bytes(int T, int H) {
    return static_cast<size_t>(ceil_div(T, kGateRowsPerBlock)) * 2 * H * kGateWidth * sizeof(float);
}
// Reads each present gate's dz and weights, the first 12 columns of xa and of dxa (6 for the VE gate
// alone reading x_and_ve), and (x_and_ve) the ids and the first 6 columns of the ve rows and of dve;
// writes dxa's columns (and dve's) and the partials; two multiply-adds per (row, head, column) and gate.
inline Work attn_gates_backward_work(const AttnAux& a, bool attn, bool ve, int blocks, int n_w) {
    const int gates = attn + ve;
    const bool narrow = !attn && a.ve_gate_input == VeGateInput::x_and_ve;
    const double columns = 2.0 * (narrow ? kVeGateHalf : kGateWidth) * a.T, gate = 2.0 * kGateWidth * a.H;
    const double ve_columns = a.ve_gate_input == VeGateInput::x_and_ve ? 2.0 * kVeGateHalf * a.T : 0;
    return Work{.name = "attn_gates_backward", .flops = 4.0 * gates * a.T * a.H * kGateWidth,
                .bytes_read = gates * (attn_aux_stats_bytes(a) + gate) + 2 * columns +
                              (ve_columns > 0 ? 4.0 * a.T + 2 * ve_columns : 0),
                .bytes_written = columns + ve_columns + 4.0 * blocks * n_w};
}
// dxa: (T, C) gradient of the attention input, updated in place in its first 12 channels.
// dve: with VeGateInput::x_and_ve, the (T, C) gradient of the gathered value-embedding rows that
// attn_qkv_backward wrote, updated in place in its first 6 channels (before embedding_backward reads
// it); null otherwise. d_attn_gate, d_ve_gate: (H, 12) bf16 (d_ve_gate and dz_ve only with value
// embeddings); d_attn_gate and dz_attn exactly with AttnAux::attn_gate (record 85's layers have none: then
// the VE gate alone); `accumulate` as for every parameter gradient.
inline void attn_gates_backward(const AttnAux& a, bf16* dxa, bf16* dve, bf16* d_attn_gate, bf16* d_ve_gate,
                                const float* dz_attn, const float* dz_ve, BlockPartials scratch, bool accumulate,
                                cudaStream_t stream) {
    attn_aux_check(a, "attn_gates_backward", false);
    const bool attn = a.attn_gate != nullptr, ve = a.ve_gate != nullptr;
    kernel_require(attn || ve, "attn_gates_backward: neither attn_gate nor ve_gate: no gate to differentiate");
    kernel_require(attn == (d_attn_gate != nullptr) && attn == (dz_attn != nullptr),
                   "attn_gates_backward: d_attn_gate and dz_attn are needed exactly with AttnAux::attn_gate");
    kernel_require(ve == (d_ve_gate != nullptr) && ve == (dz_ve != nullptr),
                   "attn_gates_backward: d_ve_gate and dz_ve are needed exactly on layers with value embeddings");
    const bool reads_ve = a.ve_gate_input == VeGateInput::x_and_ve;
    kernel_require(reads_ve == (dve != nullptr),
                   "attn_gates_backward: dve is needed exactly when the VE gate reads ve (VeGateInput::x_and_ve)");
    kernel_require(a.H <= kGateMaxHeads, "attn_gates_backward: %d heads, at most %d", a.H, kGateMaxHeads);
    kernel_require(all_aligned16({dxa, a.xa, dz_attn, dz_ve}),
                   "attn_gates_backward: dxa, xa, dz_attn and dz_ve must be 16-byte aligned");
    kernel_require(!reads_ve || all_aligned16({dve, a.ve_table}),
                   "attn_gates_backward: dve and ve_table must be 16-byte aligned");
    const int blocks = ceil_div(a.T, kGateRowsPerBlock), per_gate = a.H * kGateWidth, gates = attn + ve;
    const int n_w = gates * per_gate;
    LastBlockSum sum{SumTargets(), scratch, accumulate};  // the partials' order: attn_gate's, then ve_gate's
    if (attn) sum.targets.add(d_attn_gate, per_gate);
    if (ve) sum.targets.add(d_ve_gate, per_gate);
    launch(with_last_block_sum(attn_gates_backward_work(a, attn, ve, blocks, n_w), sum, blocks),
           attn_gates_backward_kernel, dim3(blocks), dim3(kGateRowsPerBlock),
           attn_gates_backward_smem_bytes(a.H, gates, a.ve_gate_input), stream, dxa, dve, sum, dz_attn, dz_ve, a);
    CUDA_CHECK_LAUNCH();
}
