// kernels/mudd.cuh: record 81's MUDD coefficients, the last layer's entry mix and the exit mix with its norm, and
// their backward passes, against double-precision loops on fresh random data; the reference's head backward (the
// coefficients' MLP, GELU's derivative) against central differences of its forward. Bits: the gate's coefficients
// against the warp form the trajectories were pinned on, the heads' gradients against the block-order sums of the
// partials. `--bench` times the gate head (bench_util.h).
//
// Tolerances: a bf16 output rounded once is within 2^-9 of its value, so outputs get rtol 2^-8; where the kernel
// rounds an intermediate as upstream does (u, the coefficients' dot, dc, dpre, du: each a bf16 tensor upstream),
// the check allows 2^-8 of each rounded quantity's magnitude as it reaches the output. The mixes are checked
// with the kernel's own coefficients (downloaded), so each stage is checked on its own.
#include "../../kernels/mudd.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <cmath>
#include <string>
#include <vector>

namespace {

using test::DeviceBuffer;
using test::DevicePartials;
using test::normal_bf16;
using test::round_bf16;
using test::same_bits;
using test::value;
using test::values;
using V = std::vector<double>;
using bf16 = __nv_bfloat16;
constexpr double kR = 1.0 / 256;  // one bf16 rounding, relative

struct Shape {
    int T, C, H;
    std::string name() const {
        return "T=" + std::to_string(T) + " C=" + std::to_string(C) + " H=" + std::to_string(H);
    }
    size_t n() const { return size_t(T) * C; }
};

double gelu(double z) { return 0.5 * z * (1.0 + std::erf(z / std::sqrt(2.0))); }
double gelu_grad(double z) { return 0.5 * (1.0 + std::erf(z / std::sqrt(2.0))) + z * std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI); }

// A head's parameters (w2 rows and b2 of one block) and a batch of z rows.
struct Head {
    int n;
    std::vector<bf16> w2, b2;
};
Head random_head(int n) {
    // w2 and b2 as a trained model might hold them: b2 around upstream's init (tens), w2 small
    return {n, normal_bf16(size_t(n) * kMuddHidden, 0.0, 0.3), normal_bf16(size_t(n), 0.0, 8.0)};
}
// The coefficients in double from z (unrounded u and dot) and the tolerance the kernel's roundings allow; `scale`:
// MUDD's 0.1 or the gate's bf16 scale, `stride` values a row.
void ref_coefficients(const std::vector<bf16>& z, const Head& h, int T, V& c, V& tol, double scale = kMuddScale,
                      int stride = kMuddCoefStride) {
    c.assign(size_t(T) * stride, 0.0);
    tol.assign(c.size(), 0.0);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < h.n; ++j) {
            double dot = 0, mag = 0;
            for (int k = 0; k < kMuddHidden; ++k) {
                const double p = gelu(value(z[size_t(t) * kMuddHidden + k])) * value(h.w2[size_t(j) * kMuddHidden + k]);
                dot += p, mag += std::fabs(p);
            }
            const double b = value(h.b2[j]), v = (dot + b) * scale;
            c[size_t(t) * stride + j] = v;
            // u's roundings (2^-8 of each term), the dot's, the sum's and the result's
            tol[size_t(t) * stride + j] = std::fabs(scale) * (mag * kR + std::fabs(dot) * kR + (std::fabs(dot) + std::fabs(b)) * kR) + std::fabs(v) * kR + 1e-30;
        }
}
// The head's backward in double from the coefficient gradients dc (T x stride): dz, dw2, db2 (and for the gate
// dscale = sum dc P, P = u . w2 + b2), with the tolerances the kernel's roundings of dpre, du (and P) allow (dc is
// given as the kernel's bf16 values). `scale`: MUDD's 0.1 or the gate's bf16 scale.
struct HeadGrads {
    V dz, dz_tol, dw2, dw2_tol, db2, db2_tol;
    double dscale = 0, dscale_tol = 0;
};
HeadGrads ref_head_backward(const V& dc, const std::vector<bf16>& z, const Head& h, int T, double scale = kMuddScale,
                            int stride = kMuddCoefStride) {
    HeadGrads o;
    o.dz.assign(size_t(T) * kMuddHidden, 0.0);
    o.dz_tol.assign(o.dz.size(), 0.0);
    o.dw2.assign(size_t(h.n) * kMuddHidden, 0.0);
    o.dw2_tol.assign(o.dw2.size(), 0.0);
    o.db2.assign(size_t(h.n), 0.0);
    o.db2_tol.assign(o.db2.size(), 0.0);
    double ds_mag = 0;
    for (int t = 0; t < T; ++t) {
        for (int k = 0; k < kMuddHidden; ++k) {
            const double zk = value(z[size_t(t) * kMuddHidden + k]), u = gelu(zk);
            double du = 0, mag = 0;
            for (int j = 0; j < h.n; ++j) {
                const double dpre = scale * dc[size_t(t) * stride + j];
                const double p = dpre * value(h.w2[size_t(j) * kMuddHidden + k]);
                du += p, mag += std::fabs(p);
                o.dw2[size_t(j) * kMuddHidden + k] += dpre * u;
                o.dw2_tol[size_t(j) * kMuddHidden + k] += std::fabs(dpre * u) * 3 * kR;  // dpre's and u's roundings
            }
            const double dz = du * gelu_grad(zk);
            o.dz[size_t(t) * kMuddHidden + k] = dz;
            // gelu'(z) in fp32 is off by up to ~1.4e-7 absolute (erff's 1 + erf cancels for z < 0, and near its root
            // at z = -0.75 that is all of it): |du| * 4e-7 bounds it.
            o.dz_tol[size_t(t) * kMuddHidden + k] = std::fabs(gelu_grad(zk)) * (mag * kR + std::fabs(du) * kR) +
                                                    (std::fabs(du) + mag * kR) * 4e-7 + std::fabs(dz) * kR + 1e-30;
        }
        for (int j = 0; j < h.n; ++j) {
            const double g = dc[size_t(t) * stride + j], dpre = scale * g;
            o.db2[size_t(j)] += dpre;
            o.db2_tol[size_t(j)] += std::fabs(dpre) * kR;
            double dot = 0, mag = 0;
            for (int k = 0; k < kMuddHidden; ++k) {
                const double p = gelu(value(z[size_t(t) * kMuddHidden + k])) * value(h.w2[size_t(j) * kMuddHidden + k]);
                dot += p, mag += std::fabs(p);
            }
            const double P = dot + value(h.b2[j]);
            o.dscale += g * P;
            ds_mag += std::fabs(g * P);
            o.dscale_tol += std::fabs(g) * (mag * kR + std::fabs(dot) * kR);  // u's roundings and the dot's
        }
    }
    for (size_t i = 0; i < o.dw2.size(); ++i) o.dw2_tol[i] += std::fabs(o.dw2[i]) * kR + 1e-30;
    for (size_t i = 0; i < o.db2.size(); ++i) o.db2_tol[i] += std::fabs(o.db2[i]) * kR + 1e-30;
    o.dscale_tol += 1e-5 * ds_mag + std::fabs(o.dscale) * kR + 1e-30;  // fp32 sums, the result's bf16 rounding
    return o;
}

// The reference's head backward against central differences of L = sum_t,j dc[t, j] c[t, j] (double, unrounded):
// MUDD's head (scale 0.1), and the gate's (its learnable scale: d/ds as well).
void check_head_finite_differences(bool gate) {
    const int T = 3, n = gate ? kMuddGatePostCoef : kMuddEntryCoef, stride = gate ? kMuddGateCoefStride : kMuddCoefStride;
    const Head h = random_head(n);
    const auto z = normal_bf16(size_t(T) * kMuddHidden);
    V dc(size_t(T) * stride, 0.0);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < n; ++j) dc[size_t(t) * stride + j] = test::normal();
    double scale = gate ? test::normal(0.1, 0.05) : kMuddScale;
    const HeadGrads g = ref_head_backward(dc, z, h, T, scale, stride);
    auto loss = [&](const V& zd, const V& w2, const V& b2) {
        double L = 0;
        for (int t = 0; t < T; ++t)
            for (int j = 0; j < n; ++j) {
                double dot = 0;
                for (int k = 0; k < kMuddHidden; ++k) dot += gelu(zd[size_t(t) * kMuddHidden + k]) * w2[size_t(j) * kMuddHidden + k];
                L += dc[size_t(t) * stride + j] * (dot + b2[size_t(j)]) * scale;
            }
        return L;
    };
    V zd = values(z), w2 = values(h.w2), b2 = values(h.b2);
    const double e = 1e-5;
    double worst = 0;
    auto fd_of = [&](double& x, double analytic) {
        const double keep = x;
        x = keep + e;
        const double lp = loss(zd, w2, b2);
        x = keep - e;
        const double lm = loss(zd, w2, b2);
        x = keep;
        worst = std::max(worst, std::fabs((lp - lm) / (2 * e) - analytic) / (std::fabs(analytic) + 1e-3));
    };
    for (int i = 0; i < 12; ++i) {
        const size_t a = size_t(test::randint(0, T * kMuddHidden - 1)), b = size_t(test::randint(0, n * kMuddHidden - 1));
        const size_t j = size_t(test::randint(0, n - 1));
        fd_of(zd[a], g.dz[a]);
        fd_of(w2[b], g.dw2[b]);
        fd_of(b2[j], g.db2[j]);
    }
    if (gate) fd_of(scale, g.dscale);
    test::check(worst < 1e-6, "%s head backward (reference) against central differences: worst relative error %.3g",
                gate ? "MUDD gate" : "MUDD", worst);
}

V download_values(const DeviceBuffer<bf16>& d) { return values(d.download()); }
V download_floats(const DeviceBuffer<float>& d) {
    const std::vector<float> f = d.download();
    return V(f.begin(), f.end());
}
// Only the first n of each row of a (T, 16) coefficient buffer.
V coefficient_rows(const V& c, int T, int n, int from = 0) {
    V o;
    for (int t = 0; t < T; ++t)
        for (int j = from; j < n; ++j) o.push_back(c[size_t(t) * kMuddCoefStride + j]);
    return o;
}
std::vector<int32_t> random_ids(int T, int rows) {
    std::vector<int32_t> ids(T);
    for (auto& i : ids) i = test::randint(0, rows - 1);
    return ids;
}
void check_head_grads(const std::string& what, const HeadGrads& want, const DeviceBuffer<bf16>& dz,
                      const DeviceBuffer<bf16>& dw2, const DeviceBuffer<bf16>& db2, const std::vector<bf16>& old_w2,
                      const std::vector<bf16>& old_b2, bool acc) {
    test::check_within(what + " dz", download_values(dz), want.dz, want.dz_tol);
    V w2 = want.dw2, b2 = want.db2, t2 = want.dw2_tol, tb = want.db2_tol;
    for (size_t i = 0; i < w2.size() && acc; ++i) w2[i] += value(old_w2[i]), t2[i] += std::fabs(value(old_w2[i])) * kR;
    for (size_t i = 0; i < b2.size() && acc; ++i) b2[i] += value(old_b2[i]), tb[i] += std::fabs(value(old_b2[i])) * kR;
    test::check_within(what + " dw2", download_values(dw2), w2, t2);
    test::check_within(what + " db2", download_values(db2), b2, tb);
}

// mudd_gate_forward's coefficients as the warp computed them before each lane took whole coefficients
// (mudd_head_pre: a warp-wide dot product a coefficient); the kernel must keep these bits (the trajectories).
__global__ void gate_forward_warp_form(float* coeffs, const bf16* z, MuddHead head, const float* scale, int T) {
    const int lane = threadIdx.x % 32, row = blockIdx.x * kNormRowsPerBlock + threadIdx.x / 32;
    if (row >= T) return;
    const float s = bf16_round(*scale);
    float u[2], zz[2];
    mudd_row_hidden(u, zz, z + static_cast<size_t>(row) * kMuddHidden, lane);
    float* out = coeffs + static_cast<size_t>(row) * kMuddGateCoefStride;
    for (int j = 0; j < kMuddGateCoefStride; ++j) {
        const float c = j < head.n ? bf16_round(mudd_head_pre(u, head, j, lane) * s) : 0.0f;
        if (lane == j % 32) out[j] = c;
    }
}
// mudd_gate_forward's coefficients (in d_c) against the warp form's from the same inputs: the same bits.
void check_gate_forward_bits(const std::string& at, const DeviceBuffer<float>& d_c, const DeviceBuffer<bf16>& d_z,
                             const MuddHead& mh, const DeviceBuffer<float>& d_scale, int T) {
    DeviceBuffer<float> d_c_warp(std::vector<float>(size_t(T) * kMuddGateCoefStride, 1e30f));
    launch(gate_forward_warp_form, dim3(norm_row_blocks(T)), dim3(kNormThreads), 0, nullptr, d_c_warp.ptr,
           static_cast<const bf16*>(d_z.ptr), mh, static_cast<const float*>(d_scale.ptr), T);
    CUDA_CHECK_LAUNCH();
    test::check(same_bits(d_c.download(), d_c_warp.download()), "mudd_gate_forward %s: the warp form's bits", at.c_str());
}
// The same bits over many rows, the coefficients alone: a dot's last fp32 bit shows in its bf16 coefficient rarely
// (near a rounding tie), so an order that differs from the warp's needs some 10^5 coefficients to show (a sequential
// sum of the lanes' partials, planted, failed here in each of 5 runs, at 2200 rows in some).
void check_gate_forward_many_rows(int T) {
    const Head head = random_head(kMuddGateMaxCoef);
    const auto z = normal_bf16(size_t(T) * kMuddHidden);
    DeviceBuffer<bf16> d_z(z), d_w2(head.w2), d_b2(head.b2);
    DeviceBuffer<float> d_scale(std::vector<float>{float(test::normal(0.1, 0.03))});
    DeviceBuffer<float> d_c(std::vector<float>(size_t(T) * kMuddGateCoefStride, 1e30f));
    const MuddHead mh{d_w2.ptr, d_b2.ptr, kMuddGatePostCoef};
    mudd_gate_forward(d_c.ptr, d_z.ptr, mh, d_scale.ptr, T, nullptr);
    check_gate_forward_bits("T=" + std::to_string(T) + " post", d_c, d_z, mh, d_scale, T);
}
// The head's gradients of a backward that wrote them (not accumulating) against the block-order sums of the
// partials its blocks left in the scratch (block b's value v at b * P + v), added in fp32 on the host: the order
// of the last block's sums, to the bit.
void check_head_sums_in_block_order(const std::string& what, const DevicePartials& scratch, int P, int blocks, int n,
                                    const std::vector<bf16>& dw2, const std::vector<bf16>& db2, const float* dscale) {
    const std::vector<float> partials = scratch.partials.download();
    const int values = n * (kMuddHidden + 1) + (dscale ? 1 : 0);
    bool same = true;
    for (int v = 0; v < values; ++v) {
        float sum = 0.0f;
        for (int b = 0; b < blocks; ++b) sum += partials[size_t(b) * P + v];
        if (v == n * (kMuddHidden + 1)) same = same && test::bits(*dscale) == test::bits(float(round_bf16(sum)));
        else same = same && test::bits(v < n * kMuddHidden ? dw2[size_t(v)] : db2[size_t(v - n * kMuddHidden)]) ==
                                test::bits(__float2bfloat16(sum));
    }
    test::check(same, "%s: the head's gradients are the block-order sums of the partials, to the bit", what.c_str());
}

// The last layer's entry: coefficients, aux_v and r; then the backward with the update kernels' coefficient
// gradients (8..13) given.
void check_entry(const Shape& s, bool acc) {
    const std::string at = s.name() + (acc ? " accumulate" : "");
    const int T = s.T, C = s.C, H = s.H, D = C / H, rows = 97;
    const Head head = random_head(kMuddEntryCoef);
    const auto z = normal_bf16(size_t(T) * kMuddHidden), h0 = normal_bf16(s.n()), h7 = normal_bf16(s.n()),
               h9 = normal_bf16(s.n()), table = normal_bf16(size_t(rows) * C, 0.0, 0.1);
    const auto ids = random_ids(T, rows);
    DeviceBuffer<bf16> d_z(z), d_w2(head.w2), d_b2(head.b2), d_h0(h0), d_h7(h7), d_h9(h9), d_table(table);
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_c(size_t(T) * kMuddCoefStride);
    DeviceBuffer<bf16> d_aux(s.n()), d_r(s.n());
    const MuddHead mh{d_w2.ptr, d_b2.ptr, kMuddEntryCoef};
    mudd_entry_forward(d_c.ptr, d_aux.ptr, d_r.ptr, d_z.ptr, mh, d_h0.ptr, d_h7.ptr, d_h9.ptr, {d_table.ptr, d_ids.ptr},
                       T, C, H, nullptr);
    V cref, ctol;
    ref_coefficients(z, head, T, cref, ctol);
    const V c = download_floats(d_c);
    test::check_within("mudd_entry_forward coefficients " + at, coefficient_rows(c, T, kMuddCoefStride), cref, ctol);
    V aux(s.n()), r(s.n()), aux_tol(s.n()), r_tol(s.n());
    for (int t = 0; t < T; ++t)
        for (int k = 0; k < C; ++k) {
            const size_t i = size_t(t) * C + k;
            const double* ct = &c[size_t(t) * kMuddCoefStride];
            const double g = k / D < H / 2 ? ct[6] : ct[7], e = value(table[size_t(ids[t]) * C + k]);
            const double a = value(h0[i]), b = value(h7[i]), x = value(h9[i]);
            aux[i] = g * e + ct[0] * a + ct[1] * b + ct[2] * x;
            r[i] = (1 + ct[5]) * x + ct[3] * a + ct[4] * b;
            aux_tol[i] = std::fabs(aux[i]) * kR + 1e-6 * (std::fabs(g * e) + std::fabs(ct[0] * a) + std::fabs(ct[1] * b) + std::fabs(ct[2] * x));
            r_tol[i] = std::fabs(r[i]) * kR + 1e-6 * (std::fabs((1 + ct[5]) * x) + std::fabs(ct[3] * a) + std::fabs(ct[4] * b));
        }
    test::check_within("mudd_entry_forward aux_v " + at, download_values(d_aux), aux, aux_tol);
    test::check_within("mudd_entry_forward r " + at, download_values(d_r), r, r_tol);

    // backward
    const auto daux = normal_bf16(s.n()), dr = normal_bf16(s.n());
    const auto old0 = normal_bf16(s.n()), old7 = normal_bf16(s.n()), old9 = normal_bf16(s.n());
    const auto old_w2 = normal_bf16(head.w2.size()), old_b2 = normal_bf16(head.b2.size());
    std::vector<float> dc_in(size_t(T) * kMuddCoefStride, 1e30f);  // 0..7 must be written
    for (int t = 0; t < T; ++t)
        for (int j = 8; j < kMuddEntryCoef; ++j) dc_in[size_t(t) * kMuddCoefStride + j] = float(round_bf16(test::normal(0, 3)));
    DeviceBuffer<bf16> d_daux(daux), d_dr(dr), d_d0(old0), d_d7(old7), d_d9(old9), d_dve(s.n()),
        d_dz(size_t(T) * kMuddHidden), d_dw2(old_w2), d_db2(old_b2);
    DeviceBuffer<float> d_dc(dc_in);
    DevicePartials scratch(mudd_backward_scratch_bytes(T));
    const MuddEntryGrads eg{{d_d0.ptr, true}, {d_d7.ptr, true}, {d_d9.ptr, acc}, d_dve.ptr};
    mudd_entry_backward(d_dz.ptr, d_dc.ptr, eg, {d_dw2.ptr, d_db2.ptr, acc}, scratch.view(), d_daux.ptr, C, d_dr.ptr, d_c.ptr,
                        d_z.ptr, mh, d_h0.ptr, d_h7.ptr, d_h9.ptr, {d_table.ptr, d_ids.ptr}, T, C, H, nullptr);
    V dc_want(size_t(T) * 8), dc_tol(size_t(T) * 8), d0(s.n()), d7(s.n()), d9(s.n()), dve(s.n());
    V d0t(s.n()), d7t(s.n()), d9t(s.n()), dvet(s.n());
    for (int t = 0; t < T; ++t) {
        const double* ct = &c[size_t(t) * kMuddCoefStride];
        double sum[6] = {}, mag[6] = {}, heads[kMuddMaxHeads] = {}, hmag[kMuddMaxHeads] = {};
        for (int k = 0; k < C; ++k) {
            const size_t i = size_t(t) * C + k;
            const double ga = value(daux[i]), gr = value(dr[i]);
            const double src[3] = {value(h0[i]), value(h7[i]), value(h9[i])};
            for (int q = 0; q < 3; ++q) {
                sum[q] += ga * src[q], mag[q] += std::fabs(ga * src[q]);
                sum[3 + q] += gr * src[q], mag[3 + q] += std::fabs(gr * src[q]);
            }
            const double e = value(table[size_t(ids[t]) * C + k]);
            heads[k / D] += ga * e, hmag[k / D] += std::fabs(ga * e);
            const double g = k / D < H / 2 ? ct[6] : ct[7];
            d0[i] = value(old0[i]) + ct[0] * ga + ct[3] * gr;
            d7[i] = value(old7[i]) + ct[1] * ga + ct[4] * gr;
            d9[i] = (acc ? value(old9[i]) : 0.0) + ct[2] * ga + (1 + ct[5]) * gr;
            dve[i] = g * ga;
            d0t[i] = std::fabs(d0[i]) * kR + 1e-6 * (std::fabs(value(old0[i])) + std::fabs(ct[0] * ga) + std::fabs(ct[3] * gr));
            d7t[i] = std::fabs(d7[i]) * kR + 1e-6 * (std::fabs(value(old7[i])) + std::fabs(ct[1] * ga) + std::fabs(ct[4] * gr));
            d9t[i] = std::fabs(d9[i]) * kR + 1e-6 * (std::fabs(value(old9[i])) + std::fabs(ct[2] * ga) + std::fabs((1 + ct[5]) * gr));
            dvet[i] = std::fabs(dve[i]) * kR + 1e-30;
        }
        for (int j = 0; j < 6; ++j)
            dc_want[size_t(t) * 8 + j] = sum[j], dc_tol[size_t(t) * 8 + j] = std::fabs(sum[j]) * kR + 1e-5 * mag[j];
        for (int half = 0; half < 2; ++half) {  // per-head sums rounded, then the halves' sums rounded
            double w = 0, tol = 0;
            for (int q = half * H / 2; q < (half + 1) * H / 2; ++q) w += heads[q], tol += std::fabs(heads[q]) * kR + 1e-5 * hmag[q];
            dc_want[size_t(t) * 8 + 6 + half] = w, dc_tol[size_t(t) * 8 + 6 + half] = tol + std::fabs(w) * kR;
        }
    }
    const V dc = download_floats(d_dc);
    test::check_within("mudd_entry_backward dc0..7 " + at, coefficient_rows(dc, T, 8), dc_want, dc_tol);
    test::check(coefficient_rows(dc, T, kMuddEntryCoef, 8) == coefficient_rows(V(dc_in.begin(), dc_in.end()), T, kMuddEntryCoef, 8),
                "mudd_entry_backward %s: the update kernels' dc8..13 are read, not written", at.c_str());
    test::check_within("mudd_entry_backward dh0 " + at, download_values(d_d0), d0, d0t);
    test::check_within("mudd_entry_backward dh7 " + at, download_values(d_d7), d7, d7t);
    test::check_within("mudd_entry_backward dh9 " + at, download_values(d_d9), d9, d9t);
    test::check_within("mudd_entry_backward dve " + at, download_values(d_dve), dve, dvet);
    check_head_grads("mudd_entry_backward " + at, ref_head_backward(dc, z, head, T), d_dz, d_dw2, d_db2, old_w2, old_b2,
                     acc);
    if (!acc)
        check_head_sums_in_block_order("mudd_entry_backward " + at, scratch, kMuddPartials, mudd_backward_blocks(T),
                                       kMuddEntryCoef, d_dw2.download(), d_db2.download(), nullptr);
    test::check(scratch.done.download()[0] == 0, "mudd_entry_backward %s: the ticket counter is back at zero", at.c_str());
}

// The exit: coefficients, xf and its norm; the backward into x and the five sources.
void check_exit(const Shape& s, bool acc) {
    const std::string at = s.name() + (acc ? " accumulate" : "");
    const int T = s.T, C = s.C, rows = 89;
    const Head head = random_head(kMuddExitCoef);
    const auto z = normal_bf16(size_t(T) * kMuddHidden), x = normal_bf16(s.n()), table = normal_bf16(size_t(rows) * C, 0, 0.1);
    std::vector<std::vector<bf16>> src = {normal_bf16(s.n()), normal_bf16(s.n()), normal_bf16(s.n()), {}, normal_bf16(s.n())};
    const auto ids = random_ids(T, rows);
    DeviceBuffer<bf16> d_z(z), d_w2(head.w2), d_b2(head.b2), d_x(x), d_table(table), d_xf(s.n()), d_hf(s.n());
    DeviceBuffer<bf16> d_src[kMuddExitSources] = {DeviceBuffer<bf16>(src[0]), DeviceBuffer<bf16>(src[1]),
                                                  DeviceBuffer<bf16>(src[2]), DeviceBuffer<bf16>(s.n()),
                                                  DeviceBuffer<bf16>(src[4])};
    DeviceBuffer<int32_t> d_ids(ids);
    DeviceBuffer<float> d_c(size_t(T) * kMuddCoefStride), d_rstd(T);
    MuddExitSources sources;
    for (int j = 0; j < kMuddExitSources; ++j) sources.src[j] = {d_src[j].ptr, nullptr};
    sources.src[3] = {d_table.ptr, d_ids.ptr};
    const MuddHead mh{d_w2.ptr, d_b2.ptr, kMuddExitCoef};
    mudd_exit_forward(d_c.ptr, d_xf.ptr, d_hf.ptr, d_rstd.ptr, d_z.ptr, mh, d_x.ptr, sources, T, C, nullptr);
    V cref, ctol;
    ref_coefficients(z, head, T, cref, ctol);
    const V c = download_floats(d_c);
    test::check_within("mudd_exit_forward coefficients " + at, coefficient_rows(c, T, kMuddCoefStride), cref, ctol);
    auto source = [&](int j, int t, int k) {
        return j == 3 ? value(table[size_t(ids[t]) * C + k]) : value(src[size_t(j)][size_t(t) * C + k]);
    };
    V xf(s.n()), xf_tol(s.n());
    for (int t = 0; t < T; ++t)
        for (int k = 0; k < C; ++k) {
            const size_t i = size_t(t) * C + k;
            double v = value(x[i]), mag = std::fabs(v);
            for (int j = 0; j < kMuddExitSources; ++j) {
                const double p = c[size_t(t) * kMuddCoefStride + j] * source(j, t, k);
                v += p, mag += std::fabs(p);
            }
            xf[i] = v, xf_tol[i] = std::fabs(v) * kR + 1e-6 * mag;
        }
    const V xfd = download_values(d_xf);
    test::check_within("mudd_exit_forward xf " + at, xfd, xf, xf_tol);
    V hf(s.n()), rstd(T);
    for (int t = 0; t < T; ++t) {  // the norm of the stored xf
        double ss = 0;
        for (int k = 0; k < C; ++k) ss += xfd[size_t(t) * C + k] * xfd[size_t(t) * C + k];
        rstd[size_t(t)] = 1.0 / std::sqrt(ss / C + kRmsNormEps);
        for (int k = 0; k < C; ++k) hf[size_t(t) * C + k] = xfd[size_t(t) * C + k] * rstd[size_t(t)];
    }
    V hf_tol(s.n()), rstd_tol(T);
    for (size_t i = 0; i < hf.size(); ++i) hf_tol[i] = std::fabs(hf[i]) * kR + 1e-30;
    for (int t = 0; t < T; ++t) rstd_tol[size_t(t)] = rstd[size_t(t)] * 1e-5;
    test::check_within("mudd_exit_forward hf " + at, download_values(d_hf), hf, hf_tol);
    test::check_within("mudd_exit_forward rstd " + at, download_floats(d_rstd), rstd, rstd_tol);

    // backward
    const auto dhf = normal_bf16(s.n());
    std::vector<std::vector<bf16>> old(kMuddExitSources);
    for (auto& o : old) o = normal_bf16(s.n());
    const auto old_w2 = normal_bf16(head.w2.size()), old_b2 = normal_bf16(head.b2.size());
    DeviceBuffer<bf16> d_dhf(dhf), d_dx(s.n()), d_dz(size_t(T) * kMuddHidden), d_dw2(old_w2), d_db2(old_b2);
    DeviceBuffer<bf16> d_old[kMuddExitSources] = {DeviceBuffer<bf16>(old[0]), DeviceBuffer<bf16>(old[1]),
                                                  DeviceBuffer<bf16>(old[2]), DeviceBuffer<bf16>(old[3]),
                                                  DeviceBuffer<bf16>(old[4])};
    DeviceBuffer<float> d_dc(size_t(T) * kMuddCoefStride);
    DevicePartials scratch(mudd_backward_scratch_bytes(T));
    const bool adds[kMuddExitSources] = {true, acc, false, false, !acc};  // h0 and h3 hold shares; the others vary
    MuddExitGrads eg{d_dx.ptr, {}};
    for (int j = 0; j < kMuddExitSources; ++j) eg.src[j] = {d_old[j].ptr, adds[j]};
    mudd_exit_backward(d_dz.ptr, d_dc.ptr, eg, {d_dw2.ptr, d_db2.ptr, acc}, scratch.view(), d_dhf.ptr, d_xf.ptr,
                       d_rstd.ptr, d_c.ptr, d_z.ptr, mh, sources, T, C, nullptr);
    V g(s.n()), gmag(s.n());
    for (int t = 0; t < T; ++t) {  // g = rstd dhf - x rstd^3 (dhf . x) / C
        double dot = 0, dot_mag = 0;
        const double rs = rstd[size_t(t)];
        for (int k = 0; k < C; ++k) {
            const double p = value(dhf[size_t(t) * C + k]) * xfd[size_t(t) * C + k];
            dot += p, dot_mag += std::fabs(p);
        }
        for (int k = 0; k < C; ++k) {
            const size_t i = size_t(t) * C + k;
            g[i] = rs * value(dhf[i]) - xfd[i] * rs * rs * rs * dot / C;
            // the two terms cancel: fp32's error is relative to their magnitudes (and the dot's terms')
            gmag[i] = std::fabs(rs * value(dhf[i])) + std::fabs(xfd[i]) * rs * rs * rs * dot_mag / C;
        }
    }
    V g_tol(s.n());
    for (size_t i = 0; i < g.size(); ++i) g_tol[i] = std::fabs(g[i]) * kR + 1e-5 * gmag[i];
    test::check_within("mudd_exit_backward dx " + at, download_values(d_dx), g, g_tol);
    V dc_want, dc_tol;
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < kMuddExitSources; ++j) {
            double sum = 0, mag = 0;
            for (int k = 0; k < C; ++k) {
                const double p = g[size_t(t) * C + k] * source(j, t, k);
                sum += p, mag += std::fabs(p);
            }
            dc_want.push_back(sum), dc_tol.push_back(std::fabs(sum) * kR + mag * kR);  // g is rounded first
        }
    const V dc = download_floats(d_dc);
    test::check_within("mudd_exit_backward dc " + at, coefficient_rows(dc, T, kMuddExitCoef), dc_want, dc_tol);
    const char* names[kMuddExitSources] = {"dh0", "dh7", "dh9", "dve0", "dh3"};
    for (int j = 0; j < kMuddExitSources; ++j) {
        V w(s.n()), tol(s.n());
        for (int t = 0; t < T; ++t)
            for (int k = 0; k < C; ++k) {
                const size_t i = size_t(t) * C + k;
                const double cj = c[size_t(t) * kMuddCoefStride + j], o = adds[j] ? value(old[size_t(j)][i]) : 0.0;
                w[i] = o + cj * g[i];
                tol[i] = std::fabs(w[i]) * kR + std::fabs(cj) * g_tol[i] + 1e-30;
            }
        test::check_within(std::string("mudd_exit_backward ") + names[j] + " " + at, download_values(d_old[j]), w, tol);
    }
    check_head_grads("mudd_exit_backward " + at, ref_head_backward(dc, z, head, T), d_dz, d_dw2, d_db2, old_w2, old_b2,
                     acc);
    if (!acc)
        check_head_sums_in_block_order("mudd_exit_backward " + at, scratch, kMuddPartials, mudd_backward_blocks(T),
                                       kMuddExitCoef, d_dw2.download(), d_db2.download(), nullptr);
    test::check(scratch.done.download()[0] == 0, "mudd_exit_backward %s: the ticket counter is back at zero", at.c_str());
}

// Record 85's gate head: its coefficients from z with the learnable scale, then dz, dw2, db2 and dscale from the
// readers' column gradients. The head has upstream's 41 rows with the pre gate using 26: rows and columns from n on
// must be neither read (their gradients are poisoned) nor written.
void check_gate(int T, int n, bool acc) {
    const std::string at = "T=" + std::to_string(T) + (n == kMuddGatePreCoef ? " pre" : " post") + (acc ? " accumulate" : "");
    constexpr int S = kMuddGateCoefStride;
    Head head = random_head(kMuddGateMaxCoef);
    // the scale off the bf16 grid: the kernels multiply by its bf16 rounding
    const float scale = float(test::normal(0.1, 0.03)) * (1.0f + 1.0f / 1024);
    const double s = round_bf16(scale);
    const auto z = normal_bf16(size_t(T) * kMuddHidden);
    DeviceBuffer<bf16> d_z(z), d_w2(head.w2), d_b2(head.b2);
    DeviceBuffer<float> d_scale(std::vector<float>{scale}), d_c(std::vector<float>(size_t(T) * S, 1e30f));
    const MuddHead mh{d_w2.ptr, d_b2.ptr, n};
    mudd_gate_forward(d_c.ptr, d_z.ptr, mh, d_scale.ptr, T, nullptr);
    head.n = n;
    V cref, ctol;
    ref_coefficients(z, head, T, cref, ctol, s, S);
    const V c = download_floats(d_c);
    test::check_within("mudd_gate_forward coefficients " + at, c, cref, ctol);
    bool bf16_values = true;
    for (double v : c) bf16_values = bf16_values && v == round_bf16(v);
    test::check(bf16_values, "mudd_gate_forward %s: the coefficients are bf16 values", at.c_str());
    check_gate_forward_bits(at, d_c, d_z, mh, d_scale, T);

    // backward: the readers' gradients (bf16 values) in columns < n, the rest poisoned
    std::vector<float> dg(size_t(T) * S);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < S; ++j) dg[size_t(t) * S + j] = j < n ? float(round_bf16(test::normal())) : float(test::normal(0, 100));
    const auto old_w2 = normal_bf16(head.w2.size()), old_b2 = normal_bf16(head.b2.size());
    const float old_ds = float(test::normal());
    DeviceBuffer<float> d_dg(dg), d_ds(std::vector<float>{old_ds});
    DeviceBuffer<bf16> d_dz(size_t(T) * kMuddHidden), d_dw2(old_w2), d_db2(old_b2);
    DevicePartials scratch(mudd_gate_backward_scratch_bytes(T));
    const auto run = [&] {
        mudd_gate_backward(d_dz.ptr, {d_dw2.ptr, d_db2.ptr, acc}, {d_ds.ptr, acc}, scratch.view(), d_dg.ptr, d_z.ptr, mh,
                           d_scale.ptr, T, nullptr);
    };
    run();
    V dgv(dg.begin(), dg.end());
    const HeadGrads want = ref_head_backward(dgv, z, head, T, s, S);
    test::check_within("mudd_gate_backward dz " + at, download_values(d_dz), want.dz, want.dz_tol);
    const size_t nw = size_t(n) * kMuddHidden;
    const V got_w2 = download_values(d_dw2), got_b2 = download_values(d_db2);
    V w2 = want.dw2, t2 = want.dw2_tol, b2 = want.db2, tb = want.db2_tol;
    for (size_t i = 0; i < nw && acc; ++i) w2[i] += value(old_w2[i]), t2[i] += std::fabs(value(old_w2[i])) * kR;
    for (int j = 0; j < n && acc; ++j) b2[size_t(j)] += value(old_b2[size_t(j)]), tb[size_t(j)] += std::fabs(value(old_b2[size_t(j)])) * kR;
    test::check_within("mudd_gate_backward dw2 " + at, V(got_w2.begin(), got_w2.begin() + nw), w2, t2);
    test::check_within("mudd_gate_backward db2 " + at, V(got_b2.begin(), got_b2.begin() + n), b2, tb);
    const V ow2 = values(old_w2), ob2 = values(old_b2);
    test::check(V(got_w2.begin() + nw, got_w2.end()) == V(ow2.begin() + nw, ow2.end()) &&
                    V(got_b2.begin() + n, got_b2.end()) == V(ob2.begin() + n, ob2.end()),
                "mudd_gate_backward %s: the rows from n on keep their gradients", at.c_str());
    const float got_ds = d_ds.download()[0];
    if (!acc)
        check_head_sums_in_block_order("mudd_gate_backward " + at, scratch, kMuddGatePartials,
                                       mudd_gate_backward_blocks(T), n, d_dw2.download(), d_db2.download(), &got_ds);
    test::check_within("mudd_gate_backward dscale " + at, V{got_ds}, V{(acc ? old_ds : 0.0) + want.dscale},
                       V{want.dscale_tol + (acc ? std::fabs(old_ds) * 1e-7 : 0.0)});
    test::check(acc || double(got_ds) == round_bf16(got_ds), "mudd_gate_backward %s: dscale is a bf16 value", at.c_str());
    test::check(scratch.done.download()[0] == 0, "mudd_gate_backward %s: the ticket counter is back at zero", at.c_str());
    if (!acc) {  // the same call again gives the same bits
        const auto dz1 = d_dz.download(), dw1 = d_dw2.download(), db1 = d_db2.download();
        run();
        test::check(same_bits(dz1, d_dz.download()) && same_bits(dw1, d_dw2.download()) &&
                        same_bits(db1, d_db2.download()) && d_ds.download()[0] == got_ds,
                    "mudd_gate_backward %s: reproducible", at.c_str());
    }
}

}  // namespace

// ---- benchmark: record 85's gate head at the preset's tokens, forward and backward, pre (26) and post (41) ----
int bench_mudd(const bench::Options& o) {
    bench::Bench b(o);
    const int T = b.preset().T();
    const Head head = random_head(kMuddGateMaxCoef);
    DeviceBuffer<bf16> z(normal_bf16(size_t(T) * kMuddHidden)), w2(head.w2), b2(head.b2), dz(size_t(T) * kMuddHidden),
        dw2(head.w2.size()), db2(head.b2.size());
    DeviceBuffer<float> scale(std::vector<float>{0.1f}), dscale(1), c(size_t(T) * kMuddGateCoefStride),
        dc(test::uniform_vector(size_t(T) * kMuddGateCoefStride, -1, 1));
    DevicePartials scratch(mudd_gate_backward_scratch_bytes(T));
    for (int n : {kMuddGatePreCoef, kMuddGatePostCoef}) {
        const MuddHead mh{w2.ptr, b2.ptr, n};
        const std::string at = bench::fmt("T=%d n=%d", T, n);
        b.run("mudd_gate_forward", at, [&](cudaStream_t s) { mudd_gate_forward(c.ptr, z.ptr, mh, scale.ptr, T, s); });
        b.run("mudd_gate_backward", at, [&](cudaStream_t s) {
            mudd_gate_backward(dz.ptr, {dw2.ptr, db2.ptr, true}, {dscale.ptr, true}, scratch.view(), dc.ptr, z.ptr, mh,
                               scale.ptr, T, s);
        });
    }
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_mudd(*o);
    test::seed();
    test::check_fails_with("odd heads", "MUDD needs an even head count", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        mudd_entry_forward(reinterpret_cast<float*>(16), p, p, p, {p, p, kMuddEntryCoef}, p, p, p,
                           {p, reinterpret_cast<const int32_t*>(16)}, 4, 96, 3, nullptr);
    });
    test::check_fails_with("a head of the wrong size", "14 coefficients (got 5)", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        mudd_entry_forward(reinterpret_cast<float*>(16), p, p, p, {p, p, kMuddExitCoef}, p, p, p,
                           {p, reinterpret_cast<const int32_t*>(16)}, 4, 128, 2, nullptr);
    });
    test::check_fails_with("an exit source missing", "every one of the exit's five sources is required", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        MuddExitSources srcs;
        for (MuddSource& m : srcs.src) m = {p, nullptr};
        srcs.src[4] = {};
        mudd_exit_forward(reinterpret_cast<float*>(16), p, p, reinterpret_cast<float*>(16), p, {p, p, kMuddExitCoef}, p,
                          srcs, 4, 128, nullptr);
    });
    test::check_fails_with("a gate head's w2 off 16 bytes", "mudd_gate_forward: w2 must be 16-byte aligned", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        float* f = reinterpret_cast<float*>(16);
        mudd_gate_forward(f, p, {reinterpret_cast<bf16*>(18), p, kMuddGatePreCoef}, f, 4, nullptr);
    });
    check_head_finite_differences(false);
    check_head_finite_differences(true);
    // the record's width and heads (ragged rows), tiny's, four heads, and rows past the partials' block cap
    const Shape shapes[] = {{37, 768, 6}, {300, 128, 2}, {64, 256, 4}, {2200, 128, 2}};
    for (const Shape& s : shapes)
        for (bool acc : {false, true}) {
            check_entry(s, acc);
            check_exit(s, acc);
        }
    // the gates: ragged rows, tiny's rows, and rows past the partials' block cap
    for (int T : {37, 300, 2200})
        for (int n : {kMuddGatePreCoef, kMuddGatePostCoef}) check_gate(T, n, T == 300 ? n == kMuddGatePostCoef : n == kMuddGatePreCoef);
    check_gate_forward_many_rows(20000);
    return test::finish();
}
