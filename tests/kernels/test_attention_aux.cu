// kernels/attention_aux.cuh: the YaRN state against an independent computation that follows torch's fp32
// steps (and a few entries worked out by hand), and the attention auxiliaries forward and
// backward against plain double-precision references written in upstream's own layout (full-
// width cos/sin tables, the paired (T, H/2, 2D) view, the key offset as a slice copy), plus
// finite differences of the whole chain and bitwise determinism.
//
// Tolerances: bf16 outputs rounded once from fp32 lie within 2^-9 relative of the exact value
// plus fp32 noise, so rtol 2^-8 with an absolute 1e-5 on O(1) values (rotations and sums can
// cancel); fp32 statistics rtol 1e-5. Gate inputs (xa[:, :12] and gate weights) are short
// binary fractions, so the 12-term gate logit is exact in fp32 and double and its bf16
// rounding agrees (the value-embedding rows' first 6 columns too, for the VE gate that reads them). Transcendentals: CUDA's powf/cosf/sinf are within 2 ulp, the host libm's
// within 1: a table entry may differ from bf16(correctly rounded value) only where the fp32
// value lies within 2 ulp of a bf16 rounding boundary, and the check accepts exactly that.
#include "../../kernels/attention_aux.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace {

constexpr double kRtol = 1.0 / 256;
constexpr double kAtol = 1e-5;

using test::bits;
using test::DeviceBuffer;
using test::same_bits;
using test::sigmoid;
using test::to_bf16;
using test::uniform_bf16;
using test::value;
using test::values;

// ---- YaRN: the independent computation ----
// torch.linspace(0, 1, n) on CUDA: step = 1/(n-1) in fp32; first half fma(step, i, 0), second
// half fma(-step, n-1-i, 1) (nvcc fuses "end - step * k"); then (1/1024) ** lin, here
// correctly rounded from double.
std::vector<float> ref_linspace(int n) {
    const float step = 1.0f / static_cast<float>(n - 1);
    std::vector<float> lin(n);
    for (int i = 0; i < n; ++i)
        lin[i] = i < n / 2 ? std::fma(step, static_cast<float>(i), 0.0f) : std::fma(-step, static_cast<float>(n - 1 - i), 1.0f);
    return lin;
}
// One fp32 rounding per torch op of Yarn.apply (alpha 1, beta 32).
std::vector<float> ref_apply(const std::vector<float>& freq, int old_window, int new_window) {
    const double scaling = static_cast<double>(old_window) / new_window;
    const float two_pi = static_cast<float>(2 * 3.14159265358979323846);
    const float inv_two_pi = 1.0f / two_pi, inv_span = 1.0f / 31.0f;
    std::vector<float> out(freq.size());
    for (size_t i = 0; i < freq.size(); ++i) {
        volatile float rotations = static_cast<float>(old_window) * freq[i];  // volatile: one rounding per op
        rotations = rotations * inv_two_pi;
        volatile float w = rotations - 1.0f;
        w = w * inv_span;
        const float wc = std::min(std::max(static_cast<float>(w), 0.0f), 1.0f);
        volatile float blend = wc * static_cast<float>(1.0 - scaling);
        blend = blend + static_cast<float>(scaling);
        out[i] = freq[i] * blend;
    }
    return out;
}
// bf16 of a transcendental computed in fp32 within 2 ulp of `exact`: the correctly rounded
// float's bf16, or (only next to a bf16 rounding boundary) the bf16 of a float 2 ulp away.
bool bf16_of_fp32_within_2ulp(bf16 got, double exact, bool* boundary) {
    const float f = static_cast<float>(exact);
    const uint16_t want = bits(__float2bfloat16(f));
    *boundary = false;
    if (bits(got) == want) return true;
    const float lo = std::nextafter(std::nextafter(f, -1e30f), -1e30f), hi = std::nextafter(std::nextafter(f, 1e30f), 1e30f);
    *boundary = bits(got) == bits(__float2bfloat16(lo)) || bits(got) == bits(__float2bfloat16(hi));
    return *boundary;
}

struct Rope {
    std::unique_ptr<DeviceBuffer<unsigned char>> mem;
    YarnRope r;
    Rope(int D, int positions) {
        mem = std::make_unique<DeviceBuffer<unsigned char>>(yarn_rope_bytes(D, positions));
        r = yarn_rope_view(mem->ptr, D, positions);
    }
    std::vector<float> freq() const {
        std::vector<float> f(r.head_dim / 4);
        CUDA_CHECK(cudaMemcpy(f.data(), r.freq, f.size() * 4, cudaMemcpyDeviceToHost));
        return f;
    }
    std::vector<bf16> table() const {
        std::vector<bf16> t(static_cast<size_t>(r.positions) * r.head_dim / 2);
        CUDA_CHECK(cudaMemcpy(t.data(), r.table, t.size() * 2, cudaMemcpyDeviceToHost));
        return t;
    }
};

// The table against cos/sin of fl(p * f) in double, every `stride`-th position (and the last).
void check_table(const Rope& rope, const std::string& what, int stride) {
    const auto f = rope.freq();
    const auto tab = rope.table();
    const int n = rope.r.head_dim / 4;
    size_t bad = 0, boundary_count = 0, checked = 0;
    int first_p = -1, first_i = -1;
    std::vector<int> positions;
    for (int p = 0; p < rope.r.positions; p += stride) positions.push_back(p);
    if (positions.back() != rope.r.positions - 1) positions.push_back(rope.r.positions - 1);
    for (const int p : positions)
        for (int i = 0; i < n; ++i) {
            const float theta = static_cast<float>(p) * f[i];
            const size_t at = (static_cast<size_t>(p) * n + i) * 2;
            bool b1 = false, b2 = false;
            const bool ok = bf16_of_fp32_within_2ulp(tab[at], std::cos(static_cast<double>(theta)), &b1) &&
                            bf16_of_fp32_within_2ulp(tab[at + 1], std::sin(static_cast<double>(theta)), &b2);
            boundary_count += b1 + b2;
            checked += 2;
            if (!ok && !bad++) {
                first_p = p;
                first_i = i;
            }
        }
    std::printf("%s: %zu entries checked, %zu at a bf16 rounding boundary took the neighbour\n", what.c_str(), checked,
                boundary_count);
    test::check(bad == 0, "%s: %zu table entries off, first at position %d frequency %d", what.c_str(), bad, first_p, first_i);
}

void check_freq_exact(const std::vector<float>& got, const std::vector<float>& want, const std::string& what) {
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i) bad += bits(got[i]) != bits(want[i]);
    test::check(bad == 0, "%s: %zu of %zu frequencies differ in bits", what.c_str(), bad, want.size());
}

void test_yarn(int D, int positions, int table_stride) {
    const std::string name = "YaRN D=" + std::to_string(D) + " positions=" + std::to_string(positions);
    Rope rope(D, positions);
    yarn_rope_reset(rope.r, nullptr);
    const int n = D / 4;
    const auto lin = ref_linspace(n);
    const auto f = rope.freq();
    // powf: the host libm gives the correctly rounded value here; CUDA's powf is within 2 ulp
    size_t bad = 0;
    for (int i = 0; i < n; ++i) {
        const float want = static_cast<float>(std::pow(0x1p-10, static_cast<double>(lin[i])));
        const int64_t ulps = std::abs(static_cast<int64_t>(bits(f[i])) - static_cast<int64_t>(bits(want)));
        if constexpr (kEmulated) bad += ulps != 0;
        else bad += ulps > 2;
    }
    test::check(bad == 0, "%s reset: %zu frequencies off (1/1024 ** linspace)", name.c_str(), bad);
    // by hand: linspace ends exactly at 0 and 1, so the first frequency is 1 and the last 2^-10
    test::check(f[0] == 1.0f && f[n - 1] == 0x1p-10f, "%s reset: end frequencies %a %a", name.c_str(), f[0], f[n - 1]);
    test::check(rope.r.attn_scale == 0.1, "%s reset: attn_scale %g", name.c_str(), rope.r.attn_scale);
    const auto tab = rope.table();
    // by hand: position 0 is {1, 0}; position 1 at frequency 1: cos(1) = 0.5403 -> bf16 0.5390625
    // (0x3F0A), sin(1) = 0.8415 -> 0.83984375 (0x3F57); position 2: cos(2) = -0.4161 -> 0xBED5,
    // sin(2) = 0.9093 -> 0x3F69
    bool origin = true;
    for (int i = 0; i < n; ++i) origin = origin && value(tab[2 * i]) == 1.0 && value(tab[2 * i + 1]) == 0.0;
    test::check(origin, "%s: position 0 is not {1, 0}", name.c_str());
    test::check(bits(tab[2 * n]) == 0x3F0A && bits(tab[2 * n + 1]) == 0x3F57 && bits(tab[4 * n]) == 0xBED5 &&
                    bits(tab[4 * n + 1]) == 0x3F69,
                "%s: hand-checked entries at positions 1 and 2: %04x %04x %04x %04x", name.c_str(), bits(tab[2 * n]),
                bits(tab[2 * n + 1]), bits(tab[4 * n]), bits(tab[4 * n + 1]));
    check_table(rope, name + " reset table", table_stride);

    // the record's window schedule (long windows 3 -> 7 -> 11 -> 13 blocks of 128 tokens)
    const int windows[] = {3 * 128, 7 * 128, 11 * 128, 13 * 128};
    double scale = 0.1;
    for (int k = 0; k + 1 < 4; ++k) {
        const auto before = rope.freq();
        yarn_rope_apply(rope.r, windows[k], windows[k + 1], nullptr);
        const auto after = rope.freq();
        check_freq_exact(after, ref_apply(before, windows[k], windows[k + 1]),
                         name + " apply(" + std::to_string(windows[k]) + ", " + std::to_string(windows[k + 1]) + ")");
        scale *= 0.2 * std::log(static_cast<double>(windows[k + 1]) / windows[k]) + 1;
        if (k == 0) {
            // by hand: frequency 1 turns 61 times in 384 tokens (weight clamps to 1): unchanged;
            // 2^-10 turns 0.06 times (weight 0): scaled by fp32(3/7) exactly
            test::check(after[0] == 1.0f && after[n - 1] == 0x1.b6db6ep-12f, "%s apply(384, 896) ends: %a %a",
                        name.c_str(), after[0], after[n - 1]);
            test::check(std::fabs(rope.r.attn_scale - 0.11694595720774409) < 1e-15, "%s apply(384, 896): attn_scale %.17g",
                        name.c_str(), rope.r.attn_scale);
        }
    }
    test::check(rope.r.attn_scale == scale, "%s: attn_scale after the schedule %.17g, want %.17g", name.c_str(),
                rope.r.attn_scale, scale);
    check_table(rope, name + " table after the schedule", table_stride);
    // reset restores the initial state
    yarn_rope_reset(rope.r, nullptr);
    check_freq_exact(rope.freq(), f, name + " reset after apply");
}

// ---- upstream-layout rotary factors ----
// Yarn.reset/apply's (positions, D) factor1/factor2 rebuilt from the compressed table entries:
// repeat_interleave(2) of the D/4 frequencies, cos 1 / sin 0 on the upper half, odd sin negated.
struct Factors {
    int D = 0;
    std::vector<double> f1, f2;  // (positions, D)
    explicit Factors(const Rope& rope) : D(rope.r.head_dim) {
        const auto tab = rope.table();
        const int P = rope.r.positions, n = D / 4;
        f1.assign(static_cast<size_t>(P) * D, 0);
        f2.assign(f1.size(), 0);
        for (int p = 0; p < P; ++p)
            for (int d = 0; d < D; ++d) {
                const bool rotated = d < D / 2;
                const double c = rotated ? value(tab[(static_cast<size_t>(p) * n + d / 2) * 2]) : 1.0;
                const double s = rotated ? value(tab[(static_cast<size_t>(p) * n + d / 2) * 2 + 1]) : 0.0;
                f1[static_cast<size_t>(p) * D + d] = c;
                f2[static_cast<size_t>(p) * D + d] = d % 2 ? -s : s;
            }
    }
    // the paired table (positions/2, 2D): row t = [row 2t | row 2t+1]
    double paired1(int t, int e) const { return e < D ? f1[static_cast<size_t>(2 * t) * D + e] : f1[static_cast<size_t>(2 * t + 1) * D + e - D]; }
    double paired2(int t, int e) const { return e < D ? f2[static_cast<size_t>(2 * t) * D + e] : f2[static_cast<size_t>(2 * t + 1) * D + e - D]; }
};

// ---- the layer's data ----
struct Case {
    int T, H, D, C, V;
    bool paired, key_offset, ve;
    std::vector<bf16> qkv, xa, ve_table, ve_gate, attn_gate;
    std::vector<int32_t> ids;
    VeGateInput gate_input = VeGateInput::x;
    bool reads_ve() const { return ve && gate_input == VeGateInput::x_and_ve; }
};
Case make_case(int T, int H, int D, bool paired, bool key_offset, bool ve, bool gate_exact,
               VeGateInput gate_input = VeGateInput::x) {
    Case c{T, H, D, H * D, 37, paired, key_offset, ve, {}, {}, {}, {}, {}, {}, gate_input};
    c.qkv = uniform_bf16(static_cast<size_t>(T) * 3 * c.C, -2, 2);
    c.xa = gate_exact ? test::gate_exact_rows(T, c.C, kGateWidth) : uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1);
    c.ve_table = gate_exact ? test::gate_exact_rows(c.V, c.C, kVeGateHalf)
                            : uniform_bf16(static_cast<size_t>(c.V) * c.C, -1, 1);
    c.ve_gate = gate_exact ? test::gate_exact_weights(H * kGateWidth) : uniform_bf16(H * kGateWidth, -1, 1);
    c.attn_gate = gate_exact ? test::gate_exact_weights(H * kGateWidth) : uniform_bf16(H * kGateWidth, -1, 1);
    c.ids.resize(T);
    for (auto& i : c.ids) i = test::randint(0, c.V - 1);
    return c;
}

// Column j of the VE gate's input at token t: xa[t, j], or with x_and_ve cat(xa[t, :6], ve_rows[t, :6])
// (upstream 2c702746 train_gpt.py L1102: torch.cat([x[..., :6], ve[None, ..., :6]], dim=-1)).
double ve_gate_in(const Case& c, const std::vector<double>& xa, const std::vector<double>& ve_rows, int t, int j) {
    const size_t row = static_cast<size_t>(t) * c.C;
    return c.reads_ve() && j >= kVeGateHalf ? ve_rows[row + j - kVeGateHalf] : xa[row + j];
}

// The smooth function of the layer's auxiliaries in double, upstream's way. ve rows are per
// position (ve_rows (T, C)) so that their gradient is the per-position one the kernel writes.
struct Forward {
    std::vector<double> q, k, v, rstd_q, rstd_k, y_gated, z_ve, z_attn;
};
Forward reference_forward(const Case& c, const Factors& F, const std::vector<double>& qkv, const std::vector<double>& xa,
                          const std::vector<double>& ve_rows, const std::vector<double>& ve_gate,
                          const std::vector<double>& attn_gate, const std::vector<double>& y, bool round_z) {
    const int T = c.T, H = c.H, D = c.D, C = c.C;
    Forward f;
    auto logit = [&](int t, const std::vector<double>& w, int h, bool ve_gate) {
        double z = 0;
        for (int j = 0; j < kGateWidth; ++j)
            z += (ve_gate ? ve_gate_in(c, xa, ve_rows, t, j) : xa[static_cast<size_t>(t) * C + j]) * w[h * kGateWidth + j];
        return round_z ? value(to_bf16(z)) : z;
    };
    // per-head rms norm of q and k: (T, H, D)
    std::vector<double> nq(static_cast<size_t>(T) * C), nk(nq.size());
    f.rstd_q.resize(static_cast<size_t>(T) * H);
    f.rstd_k.resize(f.rstd_q.size());
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int which = 0; which < 2; ++which) {
                double ss = 0;
                for (int d = 0; d < D; ++d) ss += std::pow(qkv[static_cast<size_t>(t) * 3 * C + which * C + h * D + d], 2);
                const double r = 1.0 / std::sqrt(ss / D + static_cast<double>(FLT_EPSILON));
                (which ? f.rstd_k : f.rstd_q)[static_cast<size_t>(t) * H + h] = r;
                for (int d = 0; d < D; ++d)
                    (which ? nk : nq)[(static_cast<size_t>(t) * H + h) * D + d] = qkv[static_cast<size_t>(t) * 3 * C + which * C + h * D + d] * r;
            }
    // rotary: factor1 * x + factor2 * x_flip, x_flip swapping adjacent pairs
    auto rotary = [&](const std::vector<double>& n) {
        std::vector<double> out(n.size());
        if (!c.paired) {
            for (int t = 0; t < T; ++t)
                for (int h = 0; h < H; ++h)
                    for (int d = 0; d < D; ++d) {
                        const size_t i = (static_cast<size_t>(t) * H + h) * D + d;
                        out[i] = F.f1[static_cast<size_t>(t) * D + d] * n[i] + F.f2[static_cast<size_t>(t) * D + d] * n[i ^ 1];
                    }
        } else {  // view (T, H/2, 2D) against the (T, 2D) paired table
            for (int t = 0; t < T; ++t)
                for (int j = 0; j < H / 2; ++j)
                    for (int e = 0; e < 2 * D; ++e) {
                        const size_t i = (static_cast<size_t>(t) * (H / 2) + j) * 2 * D + e;
                        out[i] = F.paired1(t, e) * n[i] + F.paired2(t, e) * n[i ^ 1];
                    }
        }
        return out;
    };
    f.q = rotary(nq);
    f.k = rotary(nk);
    if (c.key_offset) {  // k[:, 1:, :, D/2:] = k[:, :-1, :, D/2:]
        const auto k = f.k;
        for (int t = 1; t < T; ++t)
            for (int h = 0; h < H; ++h)
                for (int d = D / 2; d < D; ++d) f.k[(static_cast<size_t>(t) * H + h) * D + d] = k[(static_cast<size_t>(t - 1) * H + h) * D + d];
    }
    f.v.resize(static_cast<size_t>(T) * C);
    f.z_ve.assign(static_cast<size_t>(T) * H, 0);
    f.z_attn.assign(static_cast<size_t>(T) * H, 0);
    f.y_gated.resize(static_cast<size_t>(T) * C);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            const double gv = c.ve ? 2 * sigmoid(f.z_ve[static_cast<size_t>(t) * H + h] = logit(t, ve_gate, h, true)) : 0.0;
            const double ga = sigmoid(f.z_attn[static_cast<size_t>(t) * H + h] = logit(t, attn_gate, h, false));
            for (int d = 0; d < D; ++d) {
                const size_t i = static_cast<size_t>(t) * C + h * D + d;
                f.v[i] = qkv[static_cast<size_t>(t) * 3 * C + 2 * C + h * D + d] + (c.ve ? gv * ve_rows[i] : 0.0);
                f.y_gated[i] = y[i] * ga;
            }
        }
    return f;
}

// Plain chain rule of the same function, in double.
struct Backward {
    std::vector<double> dqkv, dve, dz_ve, dy, dz_attn;
};
Backward reference_backward(const Case& c, const Factors& F, const std::vector<double>& qkv, const Forward& f,
                            const std::vector<double>& ve_rows, const std::vector<double>& y, const std::vector<double>& dq,
                            const std::vector<double>& dk, const std::vector<double>& dv, const std::vector<double>& dyg) {
    const int T = c.T, H = c.H, D = c.D, C = c.C;
    Backward b;
    b.dqkv.assign(static_cast<size_t>(T) * 3 * C, 0);
    // key offset: the slice copy sends dk[t, upper] to key t-1 (key 0 keeps its own)
    std::vector<double> dk_rot(dk.size(), 0);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
                const size_t i = (static_cast<size_t>(t) * H + h) * D + d;
                if (c.key_offset && d >= D / 2 && t >= 1) dk_rot[i - static_cast<size_t>(H) * D] += dk[i];
                else dk_rot[i] += dk[i];
            }
    // rotary transpose: dn[e] = f1[e] dy[e] + f2[e^1] dy[e^1]
    auto unrotate = [&](const std::vector<double>& dyv) {
        std::vector<double> dn(dyv.size());
        for (int t = 0; t < T; ++t) {
            const int width = c.paired ? 2 * D : D, groups = c.paired ? H / 2 : H;
            for (int j = 0; j < groups; ++j)
                for (int e = 0; e < width; ++e) {
                    const size_t i = (static_cast<size_t>(t) * groups + j) * width + e;
                    const double f1 = c.paired ? F.paired1(t, e) : F.f1[static_cast<size_t>(t) * D + e];
                    const double f2x = c.paired ? F.paired2(t, e ^ 1) : F.f2[static_cast<size_t>(t) * D + (e ^ 1)];
                    dn[i] = f1 * dyv[i] + f2x * dyv[i ^ 1];
                }
        }
        return dn;
    };
    for (int which = 0; which < 2; ++which) {
        const auto dn = unrotate(which ? dk_rot : dq);
        const auto& rstd = which ? f.rstd_k : f.rstd_q;
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < H; ++h) {
                const double r = rstd[static_cast<size_t>(t) * H + h];
                double dot = 0;
                for (int d = 0; d < D; ++d)
                    dot += dn[(static_cast<size_t>(t) * H + h) * D + d] * qkv[static_cast<size_t>(t) * 3 * C + which * C + h * D + d] * r;
                for (int d = 0; d < D; ++d) {
                    const double x = qkv[static_cast<size_t>(t) * 3 * C + which * C + h * D + d];
                    b.dqkv[static_cast<size_t>(t) * 3 * C + which * C + h * D + d] =
                        r * (dn[(static_cast<size_t>(t) * H + h) * D + d] - x * r * dot / D);
                }
            }
    }
    b.dve.assign(static_cast<size_t>(T) * C, 0);
    b.dz_ve.assign(static_cast<size_t>(T) * H, 0);
    b.dy.assign(static_cast<size_t>(T) * C, 0);
    b.dz_attn.assign(static_cast<size_t>(T) * H, 0);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            const double sv = sigmoid(f.z_ve[static_cast<size_t>(t) * H + h]), sa = sigmoid(f.z_attn[static_cast<size_t>(t) * H + h]);
            double pv = 0, pa = 0;
            for (int d = 0; d < D; ++d) {
                const size_t i = static_cast<size_t>(t) * C + h * D + d;
                b.dqkv[static_cast<size_t>(t) * 3 * C + 2 * C + h * D + d] = dv[i];
                if (c.ve) {
                    b.dve[i] = 2 * sv * dv[i];
                    pv += dv[i] * ve_rows[i];
                }
                b.dy[i] = dyg[i] * sa;
                pa += dyg[i] * y[i];
            }
            if (c.ve) b.dz_ve[static_cast<size_t>(t) * H + h] = 2 * sv * (1 - sv) * pv;
            b.dz_attn[static_cast<size_t>(t) * H + h] = sa * (1 - sa) * pa;
        }
    return b;
}

// The gates' weight gradients and input gradients from the logit gradients: dxa12 (T, 12) of
// xa[:, :12], dve6 (T, 6) of ve_rows[:, :6] (zero unless the VE gate reads ve).
void reference_gates(const Case& c, const std::vector<double>& xa, const std::vector<double>& ve_rows,
                     const std::vector<double>& dz_attn, const std::vector<double>& dz_ve,
                     const std::vector<double>& attn_gate, const std::vector<double>& ve_gate,
                     std::vector<double>& d_attn_gate, std::vector<double>& d_ve_gate, std::vector<double>& dxa12,
                     std::vector<double>& dve6) {
    const int T = c.T, H = c.H, C = c.C;
    d_attn_gate.assign(H * kGateWidth, 0);
    d_ve_gate.assign(H * kGateWidth, 0);
    dxa12.assign(static_cast<size_t>(T) * kGateWidth, 0);
    dve6.assign(static_cast<size_t>(T) * kVeGateHalf, 0);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
            for (int j = 0; j < kGateWidth; ++j) {
                const double x = xa[static_cast<size_t>(t) * C + j];
                d_attn_gate[h * kGateWidth + j] += dz_attn[static_cast<size_t>(t) * H + h] * x;
                dxa12[static_cast<size_t>(t) * kGateWidth + j] += dz_attn[static_cast<size_t>(t) * H + h] * attn_gate[h * kGateWidth + j];
                if (c.ve) {
                    const double dz = dz_ve[static_cast<size_t>(t) * H + h], w = ve_gate[h * kGateWidth + j];
                    d_ve_gate[h * kGateWidth + j] += dz * ve_gate_in(c, xa, ve_rows, t, j);
                    if (c.reads_ve() && j >= kVeGateHalf) dve6[static_cast<size_t>(t) * kVeGateHalf + j - kVeGateHalf] += dz * w;
                    else dxa12[static_cast<size_t>(t) * kGateWidth + j] += dz * w;
                }
            }
}

std::vector<double> gather_ve_rows(const Case& c) {
    std::vector<double> rows(static_cast<size_t>(c.T) * c.C);
    for (int t = 0; t < c.T; ++t)
        for (int i = 0; i < c.C; ++i)
            rows[static_cast<size_t>(t) * c.C + i] = value(c.ve_table[static_cast<size_t>(c.ids[t]) * c.C + i]);
    return rows;
}

// Device state for one case: inputs uploaded, outputs allocated.
struct Run {
    const Case& c;
    DeviceBuffer<bf16> qkv, xa, ve_table, ve_gate, attn_gate, q, k, v, y, y_gated, dq, dk, dv, dy_gated, dy, dqkv, dve,
        dxa, d_attn_gate, d_ve_gate;
    DeviceBuffer<int32_t> ids;
    DeviceBuffer<float> rstd_q, rstd_k, dz_ve, dz_attn;
    test::DevicePartials scratch;
    AttnAux aux;
    Run(const Case& cs, const Rope& rope)
        : c(cs), qkv(cs.qkv), xa(cs.xa), ve_table(cs.ve_table), ve_gate(cs.ve_gate), attn_gate(cs.attn_gate),
          q(size_t(cs.T) * cs.C), k(size_t(cs.T) * cs.C), v(size_t(cs.T) * cs.C), y(size_t(cs.T) * cs.C),
          y_gated(size_t(cs.T) * cs.C), dq(size_t(cs.T) * cs.C), dk(size_t(cs.T) * cs.C), dv(size_t(cs.T) * cs.C),
          dy_gated(size_t(cs.T) * cs.C), dy(size_t(cs.T) * cs.C), dqkv(size_t(cs.T) * 3 * cs.C), dve(size_t(cs.T) * cs.C),
          dxa(size_t(cs.T) * cs.C), d_attn_gate(cs.H * kGateWidth), d_ve_gate(cs.H * kGateWidth), ids(cs.ids),
          rstd_q(size_t(cs.T) * cs.H), rstd_k(size_t(cs.T) * cs.H), dz_ve(size_t(cs.T) * cs.H), dz_attn(size_t(cs.T) * cs.H),
          scratch(attn_gates_backward_scratch_bytes(cs.T, cs.H)) {
        aux.T = cs.T;
        aux.H = cs.H;
        aux.D = cs.D;
        aux.paired = cs.paired;
        aux.key_offset = cs.key_offset;
        aux.ve_gate_input = cs.gate_input;
        aux.rope_table = rope.r.table;
        aux.rope_positions = rope.r.positions;
        aux.xa = xa.ptr;
        aux.ids = ids.ptr;
        aux.ve_table = cs.ve ? ve_table.ptr : nullptr;
        aux.ve_gate = cs.ve ? ve_gate.ptr : nullptr;
        aux.attn_gate = attn_gate.ptr;
    }
    void forward() {
        attn_qkv_forward(aux, q.ptr, k.ptr, v.ptr, rstd_q.ptr, rstd_k.ptr, qkv.ptr, nullptr);
        attn_output_gate_forward(aux, y_gated.ptr, y.ptr, nullptr);
    }
    // dve_mix: where given, dve as attn_qkv_backward left it (the value mix's share only)
    void backward(bool accumulate, std::vector<bf16>* dve_mix = nullptr) {
        attn_output_gate_backward(aux, dy.ptr, dz_attn.ptr, dy_gated.ptr, y.ptr, nullptr);
        attn_qkv_backward(aux, dqkv.ptr, c.ve ? dve.ptr : nullptr, c.ve ? dz_ve.ptr : nullptr, dq.ptr, dk.ptr, dv.ptr,
                          qkv.ptr, rstd_q.ptr, rstd_k.ptr, nullptr);
        if (dve_mix) *dve_mix = dve.download();
        if (c.reads_ve())
            attn_gates_backward(aux, dxa.ptr, dve.ptr, d_attn_gate.ptr, d_ve_gate.ptr, dz_attn.ptr, dz_ve.ptr,
                                scratch.view(), accumulate, nullptr);
        else  // record 71's gates: no dve
            attn_gates_backward(aux, dxa.ptr, nullptr, d_attn_gate.ptr, c.ve ? d_ve_gate.ptr : nullptr, dz_attn.ptr,
                                c.ve ? dz_ve.ptr : nullptr, scratch.view(), accumulate, nullptr);
    }
};

std::string case_name(const Case& c) {
    return "T=" + std::to_string(c.T) + " H=" + std::to_string(c.H) + " D=" + std::to_string(c.D) +
           (c.paired ? " paired" : "") + (c.key_offset ? " key-offset" : "") + (c.ve ? " ve" : "") +
           (c.reads_ve() ? " gate-reads-ve" : "");
}

// Forward and backward of every kernel against the references, gate-exact data.
void test_layer(int T, int H, int D, bool paired, bool key_offset, bool ve, const Rope& rope, const Factors& F,
                bool accumulate, VeGateInput gate_input = VeGateInput::x) {
    const Case c = make_case(T, H, D, paired, key_offset, ve, true, gate_input);
    const std::string name = case_name(c) + (accumulate ? " accumulate" : "");
    Run run(c, rope);
    const auto y = uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1);
    run.y.upload(y);
    run.forward();

    const auto qkv = values(c.qkv), xa = values(c.xa), ve_rows = gather_ve_rows(c);
    const auto ref = reference_forward(c, F, qkv, xa, ve_rows, values(c.ve_gate), values(c.attn_gate), values(y), true);
    test::check_close("attn_qkv_forward q " + name, values(run.q.download()), ref.q, kAtol, kRtol);
    test::check_close("attn_qkv_forward k " + name, values(run.k.download()), ref.k, kAtol, kRtol);
    test::check_close("attn_qkv_forward v " + name, values(run.v.download()), ref.v, kAtol, kRtol);
    const auto rq = run.rstd_q.download(), rk = run.rstd_k.download();
    test::check_close("attn_qkv_forward rstd_q " + name, values(rq), ref.rstd_q, 0, 1e-5);
    test::check_close("attn_qkv_forward rstd_k " + name, values(rk), ref.rstd_k, 0, 1e-5);
    test::check_close("attn_output_gate_forward " + name, values(run.y_gated.download()), ref.y_gated, kAtol, kRtol);
    if (!ve) {  // v may be skipped (the attention then reads it from qkv): q and k are unchanged
        const auto q1 = run.q.download(), k1 = run.k.download();
        DeviceBuffer<bf16> q2(q1.size()), k2(k1.size());
        attn_qkv_forward(run.aux, q2.ptr, k2.ptr, nullptr, run.rstd_q.ptr, run.rstd_k.ptr, run.qkv.ptr, nullptr);
        test::check(same_bits(q2.download(), q1) && same_bits(k2.download(), k1),
                    "attn_qkv_forward %s without v: q or k differ", name.c_str());
    }
    {  // record 81's MUDD aux_v added to v (with or without the value embedding): v = bf16(v_in (+ ve mix) + aux_v)
        const auto add = uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1);
        DeviceBuffer<bf16> d_add(add), q2(add.size()), k2(add.size()), v2(add.size());
        AttnAux with_add = run.aux;
        with_add.v_add = d_add.ptr;
        attn_qkv_forward(with_add, q2.ptr, k2.ptr, v2.ptr, run.rstd_q.ptr, run.rstd_k.ptr, run.qkv.ptr, nullptr);
        std::vector<double> want(ref.v.size());
        for (size_t i = 0; i < want.size(); ++i) want[i] = ref.v[i] + __bfloat162float(add[i]);
        test::check_close("attn_qkv_forward v + aux_v " + name, values(v2.download()), want, kAtol, kRtol);
        test::check(same_bits(q2.download(), run.q.download()) && same_bits(k2.download(), run.k.download()),
                    "attn_qkv_forward %s with aux_v: q and k as without", name.c_str());
    }

    // backward
    const auto dq = uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1), dk = uniform_bf16(dq.size(), -1, 1),
               dv = uniform_bf16(dq.size(), -1, 1), dyg = uniform_bf16(dq.size(), -1, 1),
               dxa0 = uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1), dag0 = uniform_bf16(H * kGateWidth, -1, 1),
               dvg0 = uniform_bf16(H * kGateWidth, -1, 1);
    run.dq.upload(dq);
    run.dk.upload(dk);
    run.dv.upload(dv);
    run.dy_gated.upload(dyg);
    run.dxa.upload(dxa0);
    run.d_attn_gate.upload(dag0);
    run.d_ve_gate.upload(dvg0);
    std::vector<bf16> dve_mix;
    run.backward(accumulate, &dve_mix);
    const auto b =
        reference_backward(c, F, qkv, ref, ve_rows, values(y), values(dq), values(dk), values(dv), values(dyg));
    test::check_close("attn_qkv_backward dqkv " + name, values(run.dqkv.download()), b.dqkv, kAtol, kRtol);
    test::check_close("attn_output_gate_backward dy " + name, values(run.dy.download()), b.dy, kAtol, kRtol);
    const auto dza = run.dz_attn.download();
    test::check_close("attn_output_gate_backward dz_attn " + name, values(dza), b.dz_attn, 1e-6, 1e-5);
    if (ve) {
        test::check_close("attn_qkv_backward dve " + name, values(dve_mix), b.dve, kAtol, kRtol);
        const auto dzv = run.dz_ve.download();
        test::check_close("attn_qkv_backward dz_ve " + name, values(dzv), b.dz_ve, 1e-6, 1e-5);
    }
    // the gates, from the kernel's own logit gradients (fp32, checked above)
    std::vector<double> dag, dvg, dxa12, dve6;
    const auto dzv = run.dz_ve.download();
    reference_gates(c, xa, ve_rows, values(dza), values(dzv), values(c.attn_gate), values(c.ve_gate), dag, dvg, dxa12,
                    dve6);
    if (ve) {  // dve after the gates: the value mix's share plus (x_and_ve) the gate's in columns 0-5
        std::vector<double> want_dve = values(dve_mix);
        for (int t = 0; t < T; ++t)
            for (int j = 0; j < kVeGateHalf; ++j)
                want_dve[static_cast<size_t>(t) * c.C + j] += dve6[static_cast<size_t>(t) * kVeGateHalf + j];
        test::check_close("attn_gates_backward dve " + name, values(run.dve.download()), want_dve, kAtol, kRtol);
    }
    std::vector<double> want_dxa = values(dxa0);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < kGateWidth; ++j) want_dxa[static_cast<size_t>(t) * c.C + j] += dxa12[static_cast<size_t>(t) * kGateWidth + j];
    const double gate_atol = 1e-5 * T;  // fp32 sums over T rows
    test::check_close("attn_gates_backward dxa " + name, values(run.dxa.download()), want_dxa, kAtol, kRtol);
    if (accumulate)
        for (int i = 0; i < H * kGateWidth; ++i) {
            dag[i] += value(dag0[i]);
            dvg[i] += value(dvg0[i]);
        }
    test::check_close("attn_gates_backward d_attn_gate " + name, values(run.d_attn_gate.download()), dag, gate_atol,
                      kRtol);
    if (ve)
        test::check_close("attn_gates_backward d_ve_gate " + name, values(run.d_ve_gate.download()), dvg, gate_atol,
                          kRtol);
    else
        test::check(same_bits(run.d_ve_gate.download(), dvg0),
                    "attn_gates_backward %s: d_ve_gate written on a layer without value embeddings", name.c_str());
    const int gate_blocks = ceil_div(T, kGateRowsPerBlock), n_w = (ve ? 2 : 1) * H * kGateWidth;
    {  // the kernel's fp32 order (fmaf over rows, over heads): dxa's columns (and dve's), the partials, bit for bit
        auto want_bits = dxa0, want_dve_bits = dve_mix;
        const auto partials = run.scratch.partials.download();
        const std::vector<float>* dz[2] = {&dza, &dzv};
        const std::vector<bf16>* gate[2] = {&c.attn_gate, &c.ve_gate};
        // the VE gate's weight column j reaches dve[:, j - 6] instead of dxa[:, j] where it reads ve
        auto to_dve = [&](int g, int j) { return g == 1 && c.reads_ve() && j >= kVeGateHalf; };
        bool same_partials = true;
        for (int t = 0; t < T; ++t)
            for (int j = 0; j < kGateWidth; ++j) {
                float s = 0.0f, sv = 0.0f;
                for (int g = 0; g < (ve ? 2 : 1); ++g)
                    for (int h = 0; h < H; ++h) {
                        float& acc = to_dve(g, j) ? sv : s;
                        acc = std::fmaf((*dz[g])[size_t(t) * H + h], float(value((*gate[g])[h * kGateWidth + j])), acc);
                    }
                bf16& d = want_bits[size_t(t) * c.C + j];
                d = to_bf16(float(value(d)) + s);
                if (c.reads_ve() && j >= kVeGateHalf) {
                    bf16& e = want_dve_bits[size_t(t) * c.C + j - kVeGateHalf];
                    e = to_bf16(float(value(e)) + sv);
                }
            }
        for (int b = 0; b < gate_blocks; ++b)
            for (int k = 0; k < n_w; ++k) {
                const int g = k / (H * kGateWidth), h = k % (H * kGateWidth) / kGateWidth, j = k % kGateWidth;
                float s = 0.0f;
                for (int t = b * kGateRowsPerBlock; t < std::min(T, (b + 1) * kGateRowsPerBlock); ++t) {
                    const bf16 in = to_dve(g, j) ? c.ve_table[size_t(c.ids[t]) * c.C + j - kVeGateHalf] : c.xa[size_t(t) * c.C + j];
                    s = std::fmaf((*dz[g])[size_t(t) * H + h], float(value(in)), s);
                }
                same_partials &= test::bits(s) == test::bits(partials[size_t(b) * n_w + k]);
            }
        test::check(same_bits(run.dxa.download(), want_bits) && same_partials,
                    "attn_gates_backward %s: dxa and the partials in the scalar loops' fp32 order", name.c_str());
        if (ve)
            test::check(same_bits(run.dve.download(), want_dve_bits),
                        "attn_gates_backward %s: dve in the scalar loops' fp32 order", name.c_str());
    }
    test::same_as_second_launch("attn_gates_backward d_attn_gate " + name, run.scratch, 0, gate_blocks, n_w, dag0,
                                run.d_attn_gate.download(), accumulate);
    if (ve)
        test::same_as_second_launch("attn_gates_backward d_ve_gate " + name, run.scratch, H * kGateWidth, gate_blocks,
                                    n_w, dvg0, run.d_ve_gate.download(), accumulate);

    // determinism: the whole backward again gives the same bits
    const auto dqkv1 = run.dqkv.download(), dxa1 = run.dxa.download(), dag1 = run.d_attn_gate.download(),
               dvg1 = run.d_ve_gate.download(), dve1 = run.dve.download();
    run.dxa.upload(dxa0);
    run.d_attn_gate.upload(dag0);
    run.d_ve_gate.upload(dvg0);
    run.backward(accumulate);
    test::check(same_bits(run.dqkv.download(), dqkv1) && same_bits(run.dxa.download(), dxa1) &&
                    same_bits(run.d_attn_gate.download(), dag1) && same_bits(run.d_ve_gate.download(), dvg1) &&
                    same_bits(run.dve.download(), dve1),
                "backward %s: two runs differ in bits", name.c_str());
}

// Record 85's value-table layers have no attn_gate (upstream 003ff3e2 GPT.forward: the output gate is MUDD's
// per-token column on layers 3 and 10, none elsewhere): attn_gates_backward for the VE gate alone, from fresh
// logit gradients dz_ve, against the double reference; the columns no gate reads keep their bits; and the
// same bits as the two-gate mode with a zero dz_attn (whose VE sums run in the same fixed order).
void test_ve_gate_only(int T, int H, int D, VeGateInput gate_input, bool accumulate) {
    const Case c = make_case(T, H, D, false, false, true, true, gate_input);
    const std::string name = "VE gate alone " + case_name(c) + (accumulate ? " accumulate" : "");
    const size_t TC = static_cast<size_t>(T) * c.C;
    const auto dz = test::uniform_vector(static_cast<size_t>(T) * H, -1, 1);
    const auto dxa0 = uniform_bf16(TC, -1, 1), dve0 = uniform_bf16(TC, -1, 1), dvg0 = uniform_bf16(H * kGateWidth, -1, 1);
    DeviceBuffer<bf16> xa(c.xa), ve_table(c.ve_table), ve_gate(c.ve_gate), dxa(dxa0), dve(dve0), dvg(dvg0);
    DeviceBuffer<int32_t> ids(c.ids);
    DeviceBuffer<float> dz_ve(dz);
    test::DevicePartials scratch(attn_gates_backward_scratch_bytes(T, H));
    AttnAux a;
    a.T = T;
    a.H = H;
    a.D = D;
    a.ve_gate_input = gate_input;
    a.xa = xa.ptr;
    a.ids = ids.ptr;
    a.ve_table = ve_table.ptr;
    a.ve_gate = ve_gate.ptr;
    const bool reads_ve = c.reads_ve();
    attn_gates_backward(a, dxa.ptr, reads_ve ? dve.ptr : nullptr, nullptr, dvg.ptr, nullptr, dz_ve.ptr, scratch.view(),
                        accumulate, nullptr);
    const auto got_dxa = dxa.download(), got_dve = dve.download(), got_dvg = dvg.download();

    std::vector<double> dag, want_dvg, dxa12, dve6;
    const std::vector<double> zero_dz(dz.size(), 0.0), zero_gate(H * kGateWidth, 0.0);
    reference_gates(c, values(c.xa), gather_ve_rows(c), zero_dz, values(dz), zero_gate, values(c.ve_gate), dag,
                    want_dvg, dxa12, dve6);
    const int xa_columns = reads_ve ? kVeGateHalf : kGateWidth;  // the gate's columns of xa
    std::vector<double> want_dxa = values(dxa0), want_dve = values(dve0);
    bool others_kept = true;  // every other column of dxa (and of dve) keeps its bits
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < c.C; ++j) {
            const size_t i = static_cast<size_t>(t) * c.C + j;
            if (j < xa_columns) want_dxa[i] += dxa12[static_cast<size_t>(t) * kGateWidth + j];
            else others_kept &= bits(got_dxa[i]) == bits(dxa0[i]);
            if (reads_ve && j < kVeGateHalf) want_dve[i] += dve6[static_cast<size_t>(t) * kVeGateHalf + j];
            else others_kept &= bits(got_dve[i]) == bits(dve0[i]);
        }
    test::check(others_kept, "attn_gates_backward %s: a column outside the gate's changed", name.c_str());
    test::check_close("attn_gates_backward dxa " + name, values(got_dxa), want_dxa, kAtol, kRtol);
    if (reads_ve) test::check_close("attn_gates_backward dve " + name, values(got_dve), want_dve, kAtol, kRtol);
    if (accumulate)
        for (int i = 0; i < H * kGateWidth; ++i) want_dvg[i] += value(dvg0[i]);
    test::check_close("attn_gates_backward d_ve_gate " + name, values(got_dvg), want_dvg, 1e-5 * T, kRtol);
    const int blocks = ceil_div(T, kGateRowsPerBlock);
    test::same_as_second_launch("attn_gates_backward d_ve_gate " + name, scratch, 0, blocks, H * kGateWidth, dvg0,
                                got_dvg, accumulate);

    // the two-gate mode with dz_attn = 0: its VE sums start from fmaf(0, w, +0) = +0, so the same bits
    AttnAux both = a;
    DeviceBuffer<bf16> attn_gate(c.attn_gate), dag2(uniform_bf16(H * kGateWidth, -1, 1)), dxa2(dxa0), dve2(dve0),
        dvg2(dvg0);
    DeviceBuffer<float> dz_attn(zero_dz.size());
    CUDA_CHECK(cudaMemset(dz_attn.ptr, 0, zero_dz.size() * sizeof(float)));
    both.attn_gate = attn_gate.ptr;
    attn_gates_backward(both, dxa2.ptr, reads_ve ? dve2.ptr : nullptr, dag2.ptr, dvg2.ptr, dz_attn.ptr, dz_ve.ptr,
                        scratch.view(), accumulate, nullptr);
    const auto two_dxa = dxa2.download();
    bool same = same_bits(dvg2.download(), got_dvg) && same_bits(dve2.download(), got_dve);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < xa_columns; ++j)
            same &= bits(two_dxa[static_cast<size_t>(t) * c.C + j]) == bits(got_dxa[static_cast<size_t>(t) * c.C + j]);
    test::check(same, "attn_gates_backward %s: not the bits of both gates with a zero dz_attn", name.c_str());
}

// Finite differences of L = sum(Rq q + Rk k + Rv v + Ry y_gated) (the smooth function, double)
// against the kernels' gradients through the whole chain, on a small case with general data.
void test_finite_differences(bool paired, bool key_offset, bool ve, VeGateInput gate_input = VeGateInput::x) {
    const int T = 5, H = 2, D = 16;
    Rope rope(D, 2 * T);
    yarn_rope_reset(rope.r, nullptr);
    yarn_rope_apply(rope.r, 384, 896, nullptr);
    const Factors F(rope);
    Case c = make_case(T, H, D, paired, key_offset, ve, false, gate_input);
    const std::string name = "finite differences " + case_name(c);
    Run run(c, rope);
    const auto yb = uniform_bf16(static_cast<size_t>(T) * c.C, -1, 1);
    const auto rq = uniform_bf16(yb.size(), -1, 1), rk = uniform_bf16(yb.size(), -1, 1),
               rv = uniform_bf16(yb.size(), -1, 1), ry = uniform_bf16(yb.size(), -1, 1);
    run.y.upload(yb);
    run.forward();
    run.dq.upload(rq);
    run.dk.upload(rk);
    run.dv.upload(rv);
    run.dy_gated.upload(ry);
    run.backward(false);

    auto qkv = values(c.qkv), xa = values(c.xa), ve_rows = gather_ve_rows(c), vg = values(c.ve_gate),
         ag = values(c.attn_gate), y = values(yb);
    const auto Rq = values(rq), Rk = values(rk), Rv = values(rv), Ry = values(ry);
    auto loss = [&]() {
        const auto f = reference_forward(c, F, qkv, xa, ve_rows, vg, ag, y, false);
        double s = 0;
        for (size_t i = 0; i < f.q.size(); ++i) s += Rq[i] * f.q[i] + Rk[i] * f.k[i] + Rv[i] * f.v[i] + Ry[i] * f.y_gated[i];
        return s;
    };
    // central differences of the loss in the elements `at` of x
    auto fd = [&](std::vector<double>& x, const std::vector<size_t>& at) {
        std::vector<double> g;
        for (const size_t i : at) g.push_back(test::central_difference(x[i], 1e-5, loss));
        return g;
    };
    auto all = [](const std::vector<double>& x) {
        std::vector<size_t> at(x.size());
        for (size_t i = 0; i < at.size(); ++i) at[i] = i;
        return at;
    };
    // the kernels evaluate the gates at bf16-rounded logits: relative differences ~2^-8
    const double rtol = 2e-2, atol = 2e-3;
    test::check_close(name + " d(qkv)", values(run.dqkv.download()), fd(qkv, all(qkv)), atol, rtol);
    test::check_close(name + " d(y)", values(run.dy.download()), fd(y, all(y)), atol, rtol);
    // A gate weight's gradient sums dz[t,h] * xa[t,j] over rows and can cancel: each term carries
    // the ~2^-8 relative difference of its bf16 logit, so the tolerance scales with sum |dz * xa|,
    // computed by the same reference on absolute values.
    const auto exact = reference_forward(c, F, qkv, xa, ve_rows, vg, ag, y, false);
    const auto eb = reference_backward(c, F, qkv, exact, ve_rows, y, Rq, Rk, Rv, Ry);
    auto absolute = [](std::vector<double> v) {
        for (double& e : v) e = std::fabs(e);
        return v;
    };
    std::vector<double> mag_ag, mag_vg, mag_xa, mag_ve;
    reference_gates(c, absolute(xa), absolute(ve_rows), absolute(eb.dz_attn), absolute(eb.dz_ve), absolute(ag),
                    absolute(vg), mag_ag, mag_vg, mag_xa, mag_ve);
    auto gate_tol = [&](const std::vector<double>& mag) {
        std::vector<double> tol(mag.size());
        for (size_t i = 0; i < mag.size(); ++i) tol[i] = 1e-4 + rtol * mag[i];
        return tol;
    };
    test::check_within(name + " d(attn_gate)", values(run.d_attn_gate.download()), fd(ag, all(ag)), gate_tol(mag_ag));
    // xa enters only through its first 12 channels: row t's are xa[t*C .. t*C+12)
    std::vector<double> dxa12_got;
    std::vector<size_t> xa12;
    const auto dxa = values(run.dxa.download());
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < kGateWidth; ++j) {
            xa12.push_back(static_cast<size_t>(t) * c.C + j);
            dxa12_got.push_back(dxa[xa12.back()]);
        }
    // each column a sum over heads of dz * w, which can cancel as the gate weights' sums do: the tolerance
    // also scales with sum |dz * w| (TEST_SEED=10614463182684925117 missed a plain 2% by 0.0002 at such a column)
    const auto want_dxa12 = fd(xa, xa12);
    std::vector<double> dxa12_tol(want_dxa12.size());
    for (size_t i = 0; i < dxa12_tol.size(); ++i) dxa12_tol[i] = atol + rtol * (std::fabs(want_dxa12[i]) + mag_xa[i]);
    test::check_within(name + " d(xa[:, :12])", dxa12_got, want_dxa12, dxa12_tol);
    if (ve) {  // with x_and_ve, columns 0-5 of each row also through the gate, whose terms can cancel as
        // the gate weights' do: there the tolerance also scales with sum |dz * w| (TEST_SEED=14891482332208150819
        // missed a plain 2% by 0.0006 at such a column)
        const auto want_dve = fd(ve_rows, all(ve_rows));
        std::vector<double> dve_tol(want_dve.size());
        for (size_t i = 0; i < dve_tol.size(); ++i) {
            const size_t t = i / c.C, j = i % c.C;
            const double gate_mag = c.reads_ve() && j < kVeGateHalf ? mag_ve[t * kVeGateHalf + j] : 0.0;
            dve_tol[i] = atol + rtol * (std::fabs(want_dve[i]) + gate_mag);
        }
        test::check_within(name + " d(ve rows)", values(run.dve.download()), want_dve, dve_tol);
        test::check_within(name + " d(ve_gate)", values(run.d_ve_gate.download()), fd(vg, all(vg)), gate_tol(mag_vg));
    }
}

// ---- XSA (record 82) in the output gate ----
// The double reference of one layer's XSA and gate, upstream's formula (a333be08 L1125-1131):
// v^ = v / max(|v|, 1e-4), y' = y - alpha (y . v^) v^ with alpha = bf16(tanh(a[h])), y_gated = y' s.
struct Xsa {
    int T, H, D;
    Xsa(int t, int h, int d) : T(t), H(h), D(d) {}
    std::vector<double> y, v, g_out, s, alpha_b, tanh_a, a;  // g_out = d y_gated; s (T, H) the gate
    // the loss sum(g_out * y_gated) and its gradients (w.r.t. y, v, the gate logit z, and a)
    std::vector<double> y_gated, dy, dv, dz, da;
    std::vector<double> y_gated_mag, dy_mag, dv_mag, dz_mag, da_mag;  // sums of |terms|: fp32's error scale
    std::vector<double> dalpha_b;  // the sum of -p q over tokens (bf16-rounded, as upstream keeps it, by request)
    void run(bool round_dalpha) {
        const size_t n = size_t(T) * H * D;
        y_gated.assign(n, 0), dy.assign(n, 0), dv.assign(n, 0), dz.assign(size_t(T) * H, 0);
        y_gated_mag.assign(n, 0), dy_mag.assign(n, 0), dv_mag.assign(n, 0), dz_mag.assign(size_t(T) * H, 0);
        std::vector<double> sum_pq(H, 0), sum_pq_mag(H, 0);
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < H; ++h) {
                const size_t r = size_t(t) * H + h, o = r * D;
                double nv = 0;
                for (int d = 0; d < D; ++d) nv += v[o + d] * v[o + d];
                nv = std::sqrt(nv);
                const bool clamped = !(nv > 1e-4);
                const double m = clamped ? 1e-4 : nv, al = alpha_b[h], sg = s[r];
                std::vector<double> vh(D);
                double p = 0, p_abs = 0, q = 0, q_abs = 0, dz_sum = 0, dz_abs = 0;
                for (int d = 0; d < D; ++d) {
                    vh[d] = v[o + d] / m;
                    p += y[o + d] * vh[d];
                    p_abs += std::fabs(y[o + d] * vh[d]);
                }
                for (int d = 0; d < D; ++d) {
                    const double yo = y[o + d] - al * p * vh[d], g = g_out[o + d] * sg;
                    y_gated[o + d] = yo * sg;
                    y_gated_mag[o + d] = (std::fabs(y[o + d]) + std::fabs(al) * p_abs * std::fabs(vh[d])) * sg;
                    dz_sum += g_out[o + d] * yo;
                    dz_abs += std::fabs(g_out[o + d]) * (std::fabs(y[o + d]) + std::fabs(al) * p_abs * std::fabs(vh[d]));
                    q += g * vh[d];
                    q_abs += std::fabs(g * vh[d]);
                }
                dz[r] = dz_sum * sg * (1 - sg);
                dz_mag[r] = dz_abs * sg * (1 - sg);
                for (int d = 0; d < D; ++d) {
                    const double g = g_out[o + d] * sg;
                    dy[o + d] = g - al * q * vh[d];
                    dy_mag[o + d] = std::fabs(g) + std::fabs(al) * q_abs * std::fabs(vh[d]);
                    // d(v^) = -alpha (p g + q y); v^ = v / |v| projects it, the clamped v^ = v / 1e-4 does not
                    const double dvh = -al * (p * g + q * y[o + d]);
                    dv[o + d] = clamped ? dvh / m : (dvh + 2 * al * p * q * vh[d]) / m;
                    dv_mag[o + d] = std::fabs(al) / m *
                                    (p_abs * std::fabs(g) + q_abs * std::fabs(y[o + d]) + 2 * p_abs * q_abs * std::fabs(vh[d]));
                }
                sum_pq[h] -= p * q;
                sum_pq_mag[h] += p_abs * q_abs;
            }
        da.assign(H, 0), da_mag.assign(H, 0), dalpha_b.assign(H, 0);
        for (int h = 0; h < H; ++h) {
            dalpha_b[h] = round_dalpha ? value(to_bf16(sum_pq[h])) : sum_pq[h];
            da[h] = dalpha_b[h] * (1 - tanh_a[h] * tanh_a[h]);
            da_mag[h] = sum_pq_mag[h] * (1 - tanh_a[h] * tanh_a[h]);
        }
    }
};

// |central difference - want| in units of the bound 1e-6 + 1e-5 |want|: loss(z) with z's field[i] moved by +-h.
template <class Z, class Loss>
double central_difference_error(const Z& base, Loss loss, std::vector<double> Z::*field, size_t i, double want,
                                double h) {
    Z up = base, down = base;
    (up.*field)[i] += h;
    (down.*field)[i] -= h;
    const double got = (loss(up) - loss(down)) / (2 * h);
    return std::fabs(got - want) / (1e-6 + 1e-5 * std::fabs(want));
}

// The reference's gradients against central differences of its own loss in double (alpha unrounded, so
// that a is a smooth input): a check of the formulas the kernel and the reference share.
void check_xsa_reference_gradients() {
    Xsa x(2, 2, 16);
    const size_t n = size_t(x.T) * x.H * x.D;
    for (auto* vec : {&x.y, &x.v, &x.g_out}) {
        vec->resize(n);
        for (auto& e : *vec) e = test::uniform(-1, 1);
    }
    for (int d = 0; d < x.D; ++d) x.v[size_t(1) * x.D + d] *= 1e-6;  // row 1: |v| below 1e-4, the clamp
    x.s = {0.3, 0.6, 0.45, 0.7};
    x.a = {0.4, -0.9};
    x.tanh_a = {std::tanh(x.a[0]), std::tanh(x.a[1])};
    x.alpha_b = x.tanh_a;
    x.run(false);
    const Xsa base = x;
    auto loss = [&](Xsa& z) {
        for (int h = 0; h < z.H; ++h) z.alpha_b[h] = z.tanh_a[h] = std::tanh(z.a[h]);
        z.run(false);
        double l = 0;
        for (size_t i = 0; i < n; ++i) l += z.g_out[i] * z.y_gated[i];
        return l;
    };
    double worst = 0;
    auto fd = [&](std::vector<double> Xsa::*field, size_t i, double want, double h) {
        worst = std::max(worst, central_difference_error(base, loss, field, i, want, h));
    };
    for (size_t i = 0; i < n; ++i) {
        fd(&Xsa::y, i, base.dy[i], 1e-6);
        fd(&Xsa::v, i, base.dv[i], i / x.D == 1 ? 1e-8 : 1e-6);  // the clamped row: quadratic in v, below 1e-4
    }
    for (int h = 0; h < x.H; ++h) fd(&Xsa::a, h, base.da[h], 1e-6);
    // dz: the loss's derivative by the gate logit z, s = sigmoid(z)
    for (int r = 0; r < x.T * x.H; ++r) {
        const double z = std::log(base.s[r] / (1 - base.s[r]));
        Xsa up = base, down = base;
        up.s[r] = 1 / (1 + std::exp(-(z + 1e-6)));
        down.s[r] = 1 / (1 + std::exp(-(z - 1e-6)));
        const double got = (loss(up) - loss(down)) / 2e-6;
        worst = std::max(worst, std::fabs(got - base.dz[r]) / (1e-6 + 1e-5 * std::fabs(base.dz[r])));
    }
    test::check(worst <= 1, "XSA reference: gradients against central differences, worst at %.3g of the bound", worst);
}

// The kernels against the reference: attn_output_gate_forward and _backward with XSA on record-80-style
// layer data (gate-exact xa and gates), v random with some rows of norm below 1e-4 (the clamp), then
// attn_qkv_backward adding XSA's dv to the attention's, against the same kernel given bf16(dv + dv_xsa).
void test_xsa(int T, int H, int D, bool accumulate, const Rope& rope) {
    const Case c = make_case(T, H, D, false, false, true, true, VeGateInput::x_and_ve);
    const std::string name = "XSA T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D) +
                             (accumulate ? " accumulate" : "");
    Run run(c, rope);
    const size_t n = size_t(T) * c.C;
    Xsa x(T, H, D);
    std::vector<bf16> v = uniform_bf16(n, -1, 1), y = uniform_bf16(n, -1, 1), g_out = uniform_bf16(n, -1, 1);
    for (int row = 0; row < T * H; row += 7)  // every 7th row: norm about 1e-6 to 3e-5, clamped
        for (int d = 0; d < D; ++d) v[size_t(row) * D + d] = to_bf16(value(v[size_t(row) * D + d]) * 3e-6);
    std::vector<float> a(H);
    for (int h = 0; h < H; ++h) {
        double t;
        do {  // tanh(a) away from a bf16 rounding boundary: alpha's bf16 is the same from tanhf and from double
            a[h] = static_cast<float>(test::uniform(-2, 2));
            t = std::tanh(static_cast<double>(a[h]));
        } while (std::fabs(value(to_bf16(t)) - t) > 0.45 * std::ldexp(1.0, std::ilogb(t) - 7));
        x.a.push_back(a[h]);
        x.tanh_a.push_back(t);
        x.alpha_b.push_back(value(to_bf16(t)));
    }
    x.y = values(y), x.v = values(v), x.g_out = values(g_out);
    const auto xa = values(c.xa), gate = values(c.attn_gate);
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {  // gate-exact: the 12-term logit is exact, so is its bf16
            double z = 0;
            for (int j = 0; j < kGateWidth; ++j) z += xa[size_t(t) * c.C + j] * gate[h * kGateWidth + j];
            x.s.push_back(sigmoid(value(to_bf16(z))));
        }
    x.run(true);

    DeviceBuffer<float> d_a(a), d_alpha(H);
    const auto d_alpha_before = test::uniform_vector(H, -1, 1);
    d_alpha.upload(d_alpha_before);
    DeviceBuffer<bf16> dv_xsa(n);
    test::DevicePartials scratch(attn_output_gate_backward_scratch_bytes(T, H, D));
    run.v.upload(v), run.y.upload(y), run.dy_gated.upload(g_out);
    AttnAux aux = run.aux;
    aux.xsa_v = run.v.ptr, aux.xsa_alpha = d_a.ptr;
    attn_output_gate_forward(aux, run.y_gated.ptr, run.y.ptr, nullptr);
    const XsaGrads grads{dv_xsa.ptr, d_alpha.ptr, scratch.view(), accumulate};
    attn_output_gate_backward(aux, run.dy.ptr, run.dz_attn.ptr, run.dy_gated.ptr, run.y.ptr, nullptr, grads);

    // bf16 outputs: one rounding (2^-9 relative, checked at 2^-8) plus fp32's error, 2^-18 of the terms' sum
    auto tol = [](const std::vector<double>& want, const std::vector<double>& mag, double rtol) {
        std::vector<double> t(want.size());
        for (size_t i = 0; i < t.size(); ++i) t[i] = rtol * std::fabs(want[i]) + std::ldexp(mag[i], -18) + 1e-30;
        return t;
    };
    test::check_within("attn_output_gate_forward y_gated " + name, values(run.y_gated.download()), x.y_gated,
                       tol(x.y_gated, x.y_gated_mag, kRtol));
    test::check_within("attn_output_gate_backward dy " + name, values(run.dy.download()), x.dy, tol(x.dy, x.dy_mag, kRtol));
    test::check_within("attn_output_gate_backward XSA dv " + name, values(dv_xsa.download()), x.dv,
                       tol(x.dv, x.dv_mag, kRtol));
    const auto dz = run.dz_attn.download();
    test::check_within("attn_output_gate_backward dz_attn " + name, std::vector<double>(dz.begin(), dz.end()), x.dz,
                       tol(x.dz, x.dz_mag, 1e-6));
    // d a: the bf16 of an fp32 sum near the double one is the double sum's bf16 or a neighbour (2^-7)
    std::vector<double> want_da(H), da_tol(H);
    for (int h = 0; h < H; ++h) {
        want_da[h] = (accumulate ? d_alpha_before[h] : 0.0) + x.da[h];
        da_tol[h] = std::ldexp(std::fabs(x.da[h]), -7) + std::ldexp(x.da_mag[h], -16) + 1e-30;
    }
    const auto got_da = d_alpha.download();
    test::check_within("attn_output_gate_backward d alpha " + name, std::vector<double>(got_da.begin(), got_da.end()),
                       want_da, da_tol);
    // d alpha is a bf16 value (upstream's alpha is bf16) times fp32's 1 - tanh(a)^2, whose relative error
    // is (2^-21 t^2 + 2^-22) / (1 - t^2) + 2^-23 with tanhf within 2 ulp (t = tanh(a))
    if (!accumulate)
        for (int h = 0; h < H; ++h) {
            const double t2 = x.tanh_a[h] * x.tanh_a[h], r = got_da[h] / (1 - t2);
            const double rel = (std::ldexp(t2, -21) + std::ldexp(1.0, -22)) / (1 - t2) + std::ldexp(1.0, -23);
            test::check(std::fabs(r - value(to_bf16(r))) <= rel * std::fabs(r),
                        "%s: d alpha of head %d / (1 - tanh(a)^2) = %.9g is not a bf16 value", name.c_str(), h, r);
        }
    test::check(scratch.done.download()[0] == 0, "%s: the ticket counter is back at zero", name.c_str());

    // the same launch again: the same bits (the d alpha sum's order is fixed)
    const auto dv_first = dv_xsa.download();
    const auto da_first = d_alpha.download();
    d_alpha.upload(d_alpha_before);
    attn_output_gate_backward(aux, run.dy.ptr, run.dz_attn.ptr, run.dy_gated.ptr, run.y.ptr, nullptr, grads);
    test::check(same_bits(dv_xsa.download(), dv_first) && same_bits(d_alpha.download(), da_first),
                "%s: a second launch gives the same bits", name.c_str());

    // attn_qkv_backward on an XSA layer: v's gradient is bf16(dv + dv_xsa), then as on any layer
    const auto dq = uniform_bf16(n, -1, 1), dk = uniform_bf16(n, -1, 1), dv = uniform_bf16(n, -1, 1);
    run.dq.upload(dq), run.dk.upload(dk), run.dv.upload(dv);
    run.forward();  // q, k, v and rstd for the backward (v overwritten: XSA's inputs are done with)
    attn_qkv_backward(aux, run.dqkv.ptr, run.dve.ptr, run.dz_ve.ptr, run.dq.ptr, run.dk.ptr, run.dv.ptr, run.qkv.ptr,
                      run.rstd_q.ptr, run.rstd_k.ptr, nullptr, dv_xsa.ptr);
    const auto dqkv = run.dqkv.download(), dve = run.dve.download();
    const auto dz_ve = run.dz_ve.download();
    std::vector<bf16> dv_sum(n);
    for (size_t i = 0; i < n; ++i) dv_sum[i] = to_bf16(value(dv[i]) + value(dv_first[i]));
    run.dv.upload(dv_sum);
    attn_qkv_backward(run.aux, run.dqkv.ptr, run.dve.ptr, run.dz_ve.ptr, run.dq.ptr, run.dk.ptr, run.dv.ptr,
                      run.qkv.ptr, run.rstd_q.ptr, run.rstd_k.ptr, nullptr);
    test::check(same_bits(dqkv, run.dqkv.download()) && same_bits(dve, run.dve.download()) &&
                    same_bits(dz_ve, run.dz_ve.download()),
                "%s: attn_qkv_backward with XSA's dv equals it given bf16(dv + dv_xsa)", name.c_str());
}

// ---- record 85: per-token output gate and XSA strengths ----
// The double reference of one layer's output stage in upstream 003ff3e2's form (CausalSelfAttention.forward): n =
// max(|v|^2, 1e-8), p = (y . v) / n, y' = y - alpha p v with alpha = tanh(gx[t, h]) (gx: the XSA column, a bf16 value),
// y_out = y' gg[t, h] (gg: the gate column, raw; 1 without a gate). The loss is sum(g_out * y_out).
struct TokenXsa {
    int T, H, D;
    bool gate, xsa;
    TokenXsa(int t, int h, int d, bool with_gate, bool with_xsa) : T(t), H(h), D(d), gate(with_gate), xsa(with_xsa) {}
    std::vector<double> y, v, g_out, gg, gx;                 // gg, gx (T, H)
    std::vector<double> y_out, dy, dv, dgg, dgx;             // dgg, dgx unrounded
    std::vector<double> y_out_mag, dy_mag, dv_mag, dgg_mag, dgx_mag;
    void run() {
        const size_t n = size_t(T) * H * D, rows = size_t(T) * H;
        y_out.assign(n, 0), dy.assign(n, 0), dv.assign(n, 0), dgg.assign(rows, 0), dgx.assign(rows, 0);
        y_out_mag.assign(n, 0), dy_mag.assign(n, 0), dv_mag.assign(n, 0), dgg_mag.assign(rows, 0), dgx_mag.assign(rows, 0);
        for (size_t r = 0; r < rows; ++r) {
            const size_t o = r * D;
            double n2 = 0;
            for (int d = 0; d < D; ++d) n2 += v[o + d] * v[o + d];
            const bool clamped = n2 < 1e-8;
            const double nn = clamped ? 1e-8 : n2, al = xsa ? std::tanh(gx[r]) : 0.0, sg = gate ? gg[r] : 1.0;
            double p = 0, p_abs = 0, q = 0, q_abs = 0;
            for (int d = 0; d < D; ++d) p += y[o + d] * v[o + d], p_abs += std::fabs(y[o + d] * v[o + d]);
            p /= nn, p_abs /= nn;
            for (int d = 0; d < D; ++d) {
                const double yo = y[o + d] - al * p * v[o + d], mag = std::fabs(y[o + d]) + std::fabs(al) * p_abs * std::fabs(v[o + d]);
                y_out[o + d] = yo * sg, y_out_mag[o + d] = mag * std::fabs(sg);
                dgg[r] += g_out[o + d] * yo, dgg_mag[r] += std::fabs(g_out[o + d]) * mag;
                q += g_out[o + d] * sg * v[o + d], q_abs += std::fabs(g_out[o + d] * sg * v[o + d]);
            }
            q /= nn, q_abs /= nn;
            for (int d = 0; d < D; ++d) {
                const double g = g_out[o + d] * sg;
                dy[o + d] = g - al * q * v[o + d];
                dy_mag[o + d] = std::fabs(g) + std::fabs(al) * q_abs * std::fabs(v[o + d]);
                dv[o + d] = -al * (p * g + q * y[o + d]) + (clamped ? 0.0 : 2 * al * p * q * v[o + d]);
                dv_mag[o + d] = std::fabs(al) * (p_abs * std::fabs(g) + q_abs * std::fabs(y[o + d]) +
                                                 (clamped ? 0.0 : 2 * p_abs * q_abs * std::fabs(v[o + d])));
            }
            dgx[r] = -p * q * nn * (1 - al * al);
            dgx_mag[r] = p_abs * q_abs * nn * (1 - al * al);
        }
    }
};

// The reference's gradients against central differences of its loss (rows with |v|^2 below 1e-8, clamped, and
// between 1e-8 and 1e-4).
void check_token_xsa_reference_gradients() {
    TokenXsa x(3, 2, 16, true, true);
    const size_t n = size_t(x.T) * x.H * x.D;
    for (auto* vec : {&x.y, &x.v, &x.g_out}) {
        vec->resize(n);
        for (auto& e : *vec) e = test::uniform(-1, 1);
    }
    for (int d = 0; d < x.D; ++d) x.v[size_t(1) * x.D + d] *= 1e-6, x.v[size_t(4) * x.D + d] *= 1e-3;
    x.gg = {0.3, -0.6, 1.45, 0.7, 0.2, -1.1};
    x.gx = {0.4, -0.9, 1.3, -0.2, 0.8, 0.05};
    x.run();
    const TokenXsa base = x;
    auto loss = [&](TokenXsa& z) {
        z.run();
        double l = 0;
        for (size_t i = 0; i < n; ++i) l += z.g_out[i] * z.y_out[i];
        return l;
    };
    double worst = 0;
    auto fd = [&](std::vector<double> TokenXsa::*field, size_t i, double want, double h) {
        worst = std::max(worst, central_difference_error(base, loss, field, i, want, h));
    };
    for (size_t i = 0; i < n; ++i) {
        fd(&TokenXsa::y, i, base.dy[i], 1e-6);
        fd(&TokenXsa::v, i, base.dv[i], i / x.D == 1 || i / x.D == 4 ? 1e-8 : 1e-6);  // small rows stay in their regime
    }
    for (size_t r = 0; r < base.gg.size(); ++r) {
        fd(&TokenXsa::gg, r, base.dgg[r], 1e-6);
        fd(&TokenXsa::gx, r, base.dgx[r], 1e-6);
    }
    test::check(worst <= 1, "per-token XSA reference: gradients against central differences, worst at %.3g of the bound",
                worst);
}

// The kernels against the reference with per-token strengths (AttnAux::token): columns of a (T, 40) coefficient
// buffer; v random with rows of |v|^2 below 1e-8 (clamped) and near 1e-5 (not clamped: the unit form's 1e-4 on
// |v| would be the same threshold on |v|^2 = 1e-8, but a squared threshold of 1e-4 is not); the gradients' buffer
// keeps every other column's bits.
void test_token_xsa(int T, int H, int D, bool gate, bool xsa, const Rope& rope) {
    const Case c = make_case(T, H, D, false, false, false, false);
    const std::string name = std::string("per-token") + (gate ? " gate" : "") + (xsa ? " XSA" : "") +
                             " T=" + std::to_string(T) + " H=" + std::to_string(H) + " D=" + std::to_string(D);
    Run run(c, rope);
    const size_t n = size_t(T) * c.C;
    constexpr int kStride = 40;
    TokenXsa x(T, H, D, gate, xsa);
    std::vector<bf16> v = uniform_bf16(n, -1, 1), y = uniform_bf16(n, -1, 1), g_out = uniform_bf16(n, -1, 1);
    for (int row = 0; row < T * H; ++row)
        for (int d = 0; d < D && (row % 7 == 0 || row % 5 == 1); ++d)
            v[size_t(row) * D + d] = to_bf16(value(v[size_t(row) * D + d]) * (row % 7 == 0 ? 3e-6 : 1e-3));
    const auto coefs_bf = uniform_bf16(size_t(T) * kStride, -2, 2);  // bf16 values, as the MUDD gate keeps them
    std::vector<float> coefs(coefs_bf.size());
    for (size_t i = 0; i < coefs.size(); ++i) coefs[i] = static_cast<float>(value(coefs_bf[i]));
    const int gate_col = gate ? 12 : -1, xsa_col = xsa ? 29 : -1;
    for (int t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h) {
            x.gg.push_back(gate ? coefs[size_t(t) * kStride + gate_col + h] : 1.0);
            x.gx.push_back(xsa ? coefs[size_t(t) * kStride + xsa_col + h] : 0.0);
        }
    x.y = values(y), x.v = values(v), x.g_out = values(g_out);
    x.run();

    const auto grads_before = test::uniform_vector(coefs.size(), -1, 1);
    DeviceBuffer<float> d_coefs(coefs), d_grads(grads_before);
    DeviceBuffer<bf16> dv_xsa(n);
    run.v.upload(v), run.y.upload(y), run.dy_gated.upload(g_out);
    AttnAux aux = run.aux;
    aux.attn_gate = nullptr;
    aux.token = TokenCoefs{d_coefs.ptr, d_grads.ptr, kStride, gate_col, xsa_col};
    if (xsa) aux.xsa_v = run.v.ptr;
    attn_output_gate_forward(aux, run.y_gated.ptr, run.y.ptr, nullptr);
    attn_output_gate_backward(aux, run.dy.ptr, nullptr, run.dy_gated.ptr, run.y.ptr, nullptr,
                              XsaGrads{xsa ? dv_xsa.ptr : nullptr, nullptr, {}, false});

    // bf16 outputs: one rounding (2^-9 relative, checked at 2^-8) plus fp32's error, 2^-18 of the terms' sum
    auto tol = [](const std::vector<double>& want, const std::vector<double>& mag) {
        std::vector<double> t(want.size());
        for (size_t i = 0; i < t.size(); ++i) t[i] = kRtol * std::fabs(want[i]) + std::ldexp(mag[i], -18) + 1e-30;
        return t;
    };
    test::check_within("attn_output_gate_forward y_gated " + name, values(run.y_gated.download()), x.y_out,
                       tol(x.y_out, x.y_out_mag));
    test::check_within("attn_output_gate_backward dy " + name, values(run.dy.download()), x.dy, tol(x.dy, x.dy_mag));
    if (xsa)
        test::check_within("attn_output_gate_backward XSA dv " + name, values(dv_xsa.download()), x.dv, tol(x.dv, x.dv_mag));
    const auto got = d_grads.download();
    std::vector<double> got_gg, got_gx;
    size_t kept = 0;
    for (int t = 0; t < T; ++t)
        for (int k = 0; k < kStride; ++k) {
            const size_t i = size_t(t) * kStride + k;
            if (gate && k >= gate_col && k < gate_col + H) got_gg.push_back(got[i]);
            else if (xsa && k >= xsa_col && k < xsa_col + H) got_gx.push_back(got[i]);
            else kept += bits(got[i]) == bits(grads_before[i]);
        }
    test::check(kept == size_t(T) * (kStride - H * (gate + xsa)), "%s: the other columns' gradients keep their bits",
                name.c_str());
    if (gate)
        test::check_within("attn_output_gate_backward d gate column " + name, got_gg, x.dgg, tol(x.dgg, x.dgg_mag));
    if (xsa)
        test::check_within("attn_output_gate_backward d XSA column " + name, got_gx, x.dgx, tol(x.dgx, x.dgx_mag));
    for (const double g : got_gg) test::check(g == value(to_bf16(g)), "%s: d gate column %.9g is not a bf16 value", name.c_str(), g);
    for (const double g : got_gx) test::check(g == value(to_bf16(g)), "%s: d XSA column %.9g is not a bf16 value", name.c_str(), g);
}

AttnAux bad_aux() {
    AttnAux a;
    a.T = 8;
    a.H = 2;
    a.D = 64;
    a.rope_table = reinterpret_cast<const bf16*>(16);
    a.rope_positions = 16;
    a.xa = reinterpret_cast<const bf16*>(16);
    a.attn_gate = reinterpret_cast<const bf16*>(16);
    return a;
}

}  // namespace

// ---- benchmark: the launchers around the attention of each kind of layer, and the YaRN update ----
int bench_rope(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int T = p.T(), H = p.H, D = p.D;
    Rope rope(D, 2 * p.stage[2].T);
    yarn_rope_reset(rope.r, b.stream());
    struct Kind {
        const char* name;
        bool paired, key_offset, ve;
        VeGateInput gate_input = VeGateInput::x;
    };
    const Kind kinds[] = {{"paired, ve (layers 0, 9)", true, false, true},
                          {"key offset, ve (layer 10)", false, true, true},
                          {"plain (layers 4, 7)", false, false, false},
                          {"ve gate reads ve (record 80's layer 1)", false, false, true, VeGateInput::x_and_ve}};
    for (const Kind& k : kinds) {
        Case c = make_case(T, H, D, k.paired, k.key_offset, k.ve, false, k.gate_input);
        c.V = p.V;  // the value-embedding rows the ids pick from: a real table's
        c.ve_table = uniform_bf16(static_cast<size_t>(c.V) * c.C, -1, 1);
        for (auto& i : c.ids) i = test::randint(0, c.V - 1);
        Run r(c, rope);
        const std::string at = bench::fmt("T=%d H=%d D=%d %s", T, H, D, k.name);
        b.run("attn_qkv_forward", at, [&](cudaStream_t s) {
            attn_qkv_forward(r.aux, r.q.ptr, r.k.ptr, r.v.ptr, r.rstd_q.ptr, r.rstd_k.ptr, r.qkv.ptr, s);
        });
        b.run("attn_qkv_backward", at, [&](cudaStream_t s) {
            attn_qkv_backward(r.aux, r.dqkv.ptr, k.ve ? r.dve.ptr : nullptr, k.ve ? r.dz_ve.ptr : nullptr, r.dq.ptr,
                              r.dk.ptr, r.dv.ptr, r.qkv.ptr, r.rstd_q.ptr, r.rstd_k.ptr, s);
        });
        if (k.key_offset) continue;  // the gates do not depend on the key offset: with and without ve suffice
        b.run("attn_output_gate_forward", at,
              [&](cudaStream_t s) { attn_output_gate_forward(r.aux, r.y_gated.ptr, r.y.ptr, s); });
        b.run("attn_output_gate_backward", at, [&](cudaStream_t s) {
            attn_output_gate_backward(r.aux, r.dy.ptr, r.dz_attn.ptr, r.dy_gated.ptr, r.y.ptr, s);
        });
        b.run("attn_gates_backward", at, [&](cudaStream_t s) {
            attn_gates_backward(r.aux, r.dxa.ptr, c.reads_ve() ? r.dve.ptr : nullptr, r.d_attn_gate.ptr,
                                k.ve ? r.d_ve_gate.ptr : nullptr, r.dz_attn.ptr, k.ve ? r.dz_ve.ptr : nullptr,
                                r.scratch.view(), true, s);
        });
        if (k.gate_input != VeGateInput::x_and_ve) continue;
        // record 82's XSA in the output gate (its non-paired layers), with v from this layer's forward
        DeviceBuffer<float> alpha(test::uniform_vector(H, -1, 1)), d_alpha(H);
        DeviceBuffer<bf16> dv_xsa(static_cast<size_t>(T) * c.C);
        test::DevicePartials xsa_scratch(attn_output_gate_backward_scratch_bytes(T, H, D));
        AttnAux xsa = r.aux;
        xsa.xsa_v = r.v.ptr, xsa.xsa_alpha = alpha.ptr;
        b.run("attn_output_gate_forward", at + ", XSA",
              [&](cudaStream_t s) { attn_output_gate_forward(xsa, r.y_gated.ptr, r.y.ptr, s); });
        b.run("attn_output_gate_backward", at + ", XSA", [&](cudaStream_t s) {
            attn_output_gate_backward(xsa, r.dy.ptr, r.dz_attn.ptr, r.dy_gated.ptr, r.y.ptr, s,
                                      XsaGrads{dv_xsa.ptr, d_alpha.ptr, xsa_scratch.view(), true});
        });
        b.run("attn_qkv_backward", at + ", XSA", [&](cudaStream_t s) {
            attn_qkv_backward(xsa, r.dqkv.ptr, r.dve.ptr, r.dz_ve.ptr, r.dq.ptr, r.dk.ptr, r.dv.ptr, r.qkv.ptr,
                              r.rstd_q.ptr, r.rstd_k.ptr, s, dv_xsa.ptr);
        });
    }
    // at a stage change: stage 1's long window to stage 2's, over the table of stage 3's paired positions
    b.run("yarn_rope_apply", bench::fmt("D=%d positions=%d", D, rope.r.positions), [&](cudaStream_t s) {
        yarn_rope_apply(rope.r, p.stage[0].ws_long, p.stage[1].ws_long, s);
    });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_rope(*o);
    test::seed();
    // bad input: a child process must exit non-zero (forked before emu starts its threads)
    test::check_fails_with("head_dim 48", "head_dim must be 16, 32, 64, 128 or 256", [] {
        AttnAux a = bad_aux();
        a.D = 48;
        attn_qkv_forward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("paired with key offset", "the key offset exists only on non-paired layers", [] {
        AttnAux a = bad_aux();
        a.paired = a.key_offset = true;
        attn_qkv_forward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("rotary table too short for a paired layer", "rotary table has 15 positions", [] {
        AttnAux a = bad_aux();
        a.paired = true;
        a.rope_positions = 15;
        attn_qkv_forward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("value embeddings without ids", "value embeddings need the token ids", [] {
        AttnAux a = bad_aux();
        a.ve_table = a.ve_gate = reinterpret_cast<const bf16*>(16);
        attn_qkv_forward(a, nullptr, nullptr, reinterpret_cast<bf16*>(16), nullptr, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("attn_gates_backward with 33 heads", "33 heads, at most 32", [] {
        AttnAux a = bad_aux();
        a.H = 33;
        attn_gates_backward(a, reinterpret_cast<bf16*>(16), nullptr, reinterpret_cast<bf16*>(16), nullptr,
                            reinterpret_cast<const float*>(16), nullptr, {}, false, nullptr);
    });
    test::check_fails_with("attn_gates_backward with dz_attn misaligned", "must be 16-byte aligned", [] {
        attn_gates_backward(bad_aux(), reinterpret_cast<bf16*>(16), nullptr, reinterpret_cast<bf16*>(16), nullptr,
                            reinterpret_cast<const float*>(20), nullptr, {}, false, nullptr);
    });
    test::check_fails_with("VE gate reading ve without value embeddings",
                           "VeGateInput::x_and_ve on a layer without value embeddings", [] {
                               AttnAux a = bad_aux();
                               a.ve_gate_input = VeGateInput::x_and_ve;
                               attn_qkv_forward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
                           });
    test::check_fails_with("attn_gates_backward reading ve without dve", "dve is needed exactly when the VE gate reads ve",
                           [] {
                               AttnAux a = bad_aux();
                               a.ve_table = a.ve_gate = reinterpret_cast<const bf16*>(16);
                               a.ids = reinterpret_cast<const int32_t*>(16);
                               a.ve_gate_input = VeGateInput::x_and_ve;
                               attn_gates_backward(a, reinterpret_cast<bf16*>(16), nullptr, reinterpret_cast<bf16*>(16),
                                                   reinterpret_cast<bf16*>(16), reinterpret_cast<const float*>(16),
                                                   reinterpret_cast<const float*>(16), {}, false, nullptr);
                           });
    test::check_fails_with("attn_gates_backward given dve where the VE gate reads xa",
                           "dve is needed exactly when the VE gate reads ve", [] {
                               AttnAux a = bad_aux();
                               a.ve_table = a.ve_gate = reinterpret_cast<const bf16*>(16);
                               a.ids = reinterpret_cast<const int32_t*>(16);
                               attn_gates_backward(a, reinterpret_cast<bf16*>(16), reinterpret_cast<bf16*>(16),
                                                   reinterpret_cast<bf16*>(16), reinterpret_cast<bf16*>(16),
                                                   reinterpret_cast<const float*>(16),
                                                   reinterpret_cast<const float*>(16), {}, false, nullptr);
                           });
    // record 85: a layer without attn_gate differentiates its VE gate alone, or nothing
    auto ve_only_aux = [] {
        AttnAux a = bad_aux();
        a.attn_gate = nullptr;
        a.ve_table = a.ve_gate = reinterpret_cast<const bf16*>(16);
        a.ids = reinterpret_cast<const int32_t*>(16);
        return a;
    };
    const auto f16 = reinterpret_cast<const float*>(16);
    const auto b16 = reinterpret_cast<bf16*>(16);
    test::check_fails_with("attn_gates_backward with no gate", "neither attn_gate nor ve_gate", [] {
        AttnAux a = bad_aux();
        a.attn_gate = nullptr;
        attn_gates_backward(a, reinterpret_cast<bf16*>(16), nullptr, nullptr, nullptr, nullptr, nullptr, {}, false,
                            nullptr);
    });
    test::check_fails_with("attn_gates_backward given dz_attn without attn_gate",
                           "d_attn_gate and dz_attn are needed exactly with AttnAux::attn_gate", [&] {
                               attn_gates_backward(ve_only_aux(), b16, nullptr, nullptr, b16, f16, f16, {}, false, nullptr);
                           });
    test::check_fails_with("attn_gates_backward given d_attn_gate without attn_gate",
                           "d_attn_gate and dz_attn are needed exactly with AttnAux::attn_gate", [&] {
                               attn_gates_backward(ve_only_aux(), b16, nullptr, b16, b16, nullptr, f16, {}, false, nullptr);
                           });
    test::check_fails_with("attn_gates_backward with attn_gate but no dz_attn",
                           "d_attn_gate and dz_attn are needed exactly with AttnAux::attn_gate", [&] {
                               attn_gates_backward(bad_aux(), b16, nullptr, b16, nullptr, nullptr, nullptr, {}, false,
                                                   nullptr);
                           });
    test::check_fails_with("attn_gates_backward with the VE gate alone but no dz_ve",
                           "d_ve_gate and dz_ve are needed exactly on layers with value embeddings", [&] {
                               attn_gates_backward(ve_only_aux(), b16, nullptr, nullptr, b16, nullptr, nullptr, {},
                                                   false, nullptr);
                           });
    test::check_fails_with("attn_gates_backward given dz_ve without value embeddings",
                           "d_ve_gate and dz_ve are needed exactly on layers with value embeddings", [&] {
                               attn_gates_backward(bad_aux(), b16, nullptr, b16, nullptr, f16, f16, {}, false, nullptr);
                           });
    test::check_fails_with("attn_gates_backward with the VE gate alone reading ve, without dve",
                           "dve is needed exactly when the VE gate reads ve", [&] {
                               AttnAux a = ve_only_aux();
                               a.ve_gate_input = VeGateInput::x_and_ve;
                               attn_gates_backward(a, b16, nullptr, nullptr, b16, nullptr, f16, {}, false, nullptr);
                           });
    test::check_fails_with("XSA on a paired layer", "XSA on a paired layer", [] {
        AttnAux a = bad_aux();
        a.paired = true;
        a.xsa_v = reinterpret_cast<const bf16*>(16);
        a.xsa_alpha = reinterpret_cast<const float*>(16);
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("XSA without its strengths", "xsa_v and xsa_alpha go together", [] {
        AttnAux a = bad_aux();
        a.xsa_v = reinterpret_cast<const bf16*>(16);
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("XSA's backward without its outputs", "XsaGrads (dv, d_alpha, scratch) are needed exactly",
                           [] {
                               AttnAux a = bad_aux();
                               a.xsa_v = reinterpret_cast<const bf16*>(16);
                               a.xsa_alpha = reinterpret_cast<const float*>(16);
                               attn_output_gate_backward(a, nullptr, nullptr, nullptr, nullptr, nullptr);
                           });
    test::check_fails_with("attn_qkv_backward on an XSA layer without XSA's dv", "XSA's dv is needed exactly", [] {
        AttnAux a = bad_aux();
        a.xsa_v = reinterpret_cast<const bf16*>(16);
        a.xsa_alpha = reinterpret_cast<const float*>(16);
        attn_qkv_backward(a, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr);
    });
    // record 85's per-token strengths (AttnAux::token)
    auto token_aux = [] {
        AttnAux a = bad_aux();
        a.attn_gate = nullptr;
        a.token = TokenCoefs{reinterpret_cast<const float*>(16), reinterpret_cast<float*>(16), 40, 12, -1};
        return a;
    };
    test::check_fails_with("per-token strengths beside attn_gate", "replace attn_gate and xsa_alpha", [&] {
        AttnAux a = token_aux();
        a.attn_gate = reinterpret_cast<const bf16*>(16);
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("a per-token XSA column without v", "xsa_v and a per-token XSA column go together", [&] {
        AttnAux a = token_aux();
        a.token.xsa = 20;
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("per-token strengths with no column", "neither a gate nor an XSA column", [&] {
        AttnAux a = token_aux();
        a.token.gate = -1;
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("a per-token column past the row", "outside the coefficients' 40 per token", [&] {
        AttnAux a = token_aux();
        a.token.gate = 39;
        attn_output_gate_forward(a, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("per-token strengths' backward given dz_attn", "take their gradients in AttnAux::token.grads",
                           [&] {
                               attn_output_gate_backward(token_aux(), nullptr, reinterpret_cast<float*>(16), nullptr,
                                                         nullptr, nullptr);
                           });
    test::check_fails_with("per-token XSA's backward without dv", "per-token XSA needs XsaGrads::dv exactly", [&] {
        AttnAux a = token_aux();
        a.token.xsa = 20;
        a.xsa_v = reinterpret_cast<const bf16*>(16);
        attn_output_gate_backward(a, nullptr, nullptr, nullptr, nullptr, nullptr);
    });
    test::check_fails_with("YaRN head_dim 40", "head_dim must be a multiple of 16",
                           [] { yarn_rope_view(reinterpret_cast<void*>(16), 40, 100); });

    // YaRN: the record's full table (2 * 262144 positions, D = 128; every 7th position and the
    // last checked against the independent computation, positions 0-2 by hand) and the tiny
    // preset's (every position), through the record's window schedule
    test_yarn(128, 2 * 262144, 7);
    test_yarn(64, 2 * 1024, 1);

    // every kernel forward and backward: tiny preset and a record-like width
    struct Shape {
        int T, H, D;
    };
    for (const Shape s : {Shape{512, 2, 64}, Shape{48, 6, 128}}) {
        Rope rope(s.D, 2 * s.T);
        yarn_rope_reset(rope.r, nullptr);
        yarn_rope_apply(rope.r, 384, 896, nullptr);  // interpolated frequencies, as in later stages
        const Factors F(rope);
        test_layer(s.T, s.H, s.D, false, false, true, rope, F, false);  // layers 0, 1 (non-paired form)
        test_layer(s.T, s.H, s.D, false, true, true, rope, F, true);    // layer 10: long window, ve
        test_layer(s.T, s.H, s.D, false, true, false, rope, F, false);  // layer 3: long window
        test_layer(s.T, s.H, s.D, false, false, false, rope, F, true);  // short-window layers
        test_layer(s.T, s.H, s.D, true, false, false, rope, F, false);  // paired layers 2, 5
        test_layer(s.T, s.H, s.D, true, false, true, rope, F, true);    // paired layers 0, 9
        // record 80 (#70): the VE gate of non-paired layers reads cat(xa[:, :6], ve[:, :6]); its paired
        // layers 2 and 9 keep xa[:, :12], the cases above
        test_layer(s.T, s.H, s.D, false, false, true, rope, F, false, VeGateInput::x_and_ve);  // layer 1
        test_layer(s.T, s.H, s.D, false, true, true, rope, F, true, VeGateInput::x_and_ve);    // layers 8, 10
        test_layer(s.T, s.H, s.D, true, false, true, rope, F, false, VeGateInput::x_and_ve);   // record 84: 2, 9
    }
    {  // ragged T (not a multiple of the rows a block covers)
        Rope rope(64, 2 * 37);
        yarn_rope_reset(rope.r, nullptr);
        const Factors F(rope);
        test_layer(37, 2, 64, false, true, true, rope, F, false);
        test_layer(37, 2, 64, true, false, true, rope, F, true);
        test_layer(37, 2, 64, false, true, true, rope, F, true, VeGateInput::x_and_ve);
    }

    // record 85's value-table layers: the VE gate alone (T = 300: the last block has 44 rows)
    for (const VeGateInput in : {VeGateInput::x_and_ve, VeGateInput::x})
        for (const bool accumulate : {false, true}) test_ve_gate_only(300, 6, 128, in, accumulate);
    test_ve_gate_only(37, 2, 64, VeGateInput::x_and_ve, true);
    test_ve_gate_only(37, 2, 64, VeGateInput::x, false);

    // XSA (record 82): the reference's formulas, then the kernels on the tiny and the record's head shape
    check_xsa_reference_gradients();
    for (const auto& [T, H, D] : {std::tuple{512, 2, 64}, std::tuple{48, 6, 128}, std::tuple{37, 6, 128}}) {
        Rope rope(D, 2 * T);
        yarn_rope_reset(rope.r, nullptr);
        test_xsa(T, H, D, false, rope);
        test_xsa(T, H, D, true, rope);
    }

    // record 85: per-token gate and XSA strengths (both on layer 3, XSA alone on 1, 4, 7, the gate alone on 10)
    check_token_xsa_reference_gradients();
    for (const auto& [T, H, D] : {std::tuple{512, 2, 64}, std::tuple{48, 6, 128}, std::tuple{37, 6, 128}}) {
        Rope rope(D, 2 * T);
        yarn_rope_reset(rope.r, nullptr);
        test_token_xsa(T, H, D, true, true, rope);
        test_token_xsa(T, H, D, false, true, rope);
        test_token_xsa(T, H, D, true, false, rope);
    }

    test_finite_differences(false, true, true);
    test_finite_differences(true, false, true);
    test_finite_differences(false, false, false);
    test_finite_differences(false, true, true, VeGateInput::x_and_ve);
    test_finite_differences(false, false, true, VeGateInput::x_and_ve);
    test_finite_differences(true, false, true, VeGateInput::x_and_ve);  // record 84's paired layers
    return test::finish();
}
