// kernels/residual.cuh: the layer mix (and its layer-0 form), the gated skip, the block-output add and
// the backout, forward and backward, against double-precision loops on fresh random data: tiny and
// record widths, ragged row counts and a row count past the cap on partial-sum blocks. Every lambda and
// skip_gate gradient is also checked against central finite differences of the double reference on a
// small case (which also checks the reference's backward), and every backward is run twice and must
// give the same bits.
//
// Tolerances: a bf16 output is within 2^-8 of its exact value after rounding, so bf16 outputs get
// rtol 2^-7, plus 1e-5 times the magnitude of the terms summed in fp32 before the rounding; fp32
// parameter gradients get 1e-5 times the sum of their terms' magnitudes.
#include "../../kernels/residual.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;
using V = std::vector<double>;

using test::check_within;
using test::DeviceBuffer;
using test::DevicePartials;
using test::normal_bf16;
using test::round_bf16;
using test::same_bits;
using test::sigmoid;
using test::values;

bool check_scalar(const std::string& what, double got, double want, double tol) {
    return check_within(what, V{got}, V{want}, V{tol});
}
// The tolerance of a bf16 output: rtol 2^-7 on the value plus 1e-5 of the terms' magnitude.
V bf16_tol(const V& want, const V& magnitude) {
    V tol(want.size());
    for (size_t i = 0; i < want.size(); ++i) tol[i] = std::fabs(want[i]) / 128 + 1e-5 * magnitude[i] + 1e-30;
    return tol;
}

// ---- the double-precision reference ----
double dot(const V& a, const V& b) {
    double s = 0.0;
    for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
    return s;
}

// The layer mix: xm = r*x + l*x0 + b*xb, or at layer 0 (x being x0) xm = (r + l)*x + b*xb.
struct Mix {
    double r, l, b;
    bool first;
};
V ref_mix(const V& x, const V& x0, const V& xb, const Mix& m) {
    V xm(x.size());
    for (size_t i = 0; i < x.size(); ++i)
        xm[i] = (m.first ? (m.r + m.l) * x[i] : m.r * x[i] + m.l * x0[i]) + m.b * xb[i];
    return xm;
}
V mix_magnitude(const V& x, const V& x0, const V& xb, const Mix& m) {
    V a(x.size());
    for (size_t i = 0; i < x.size(); ++i)
        a[i] = (m.first ? std::fabs((m.r + m.l) * x[i]) : std::fabs(m.r * x[i]) + std::fabs(m.l * x0[i])) +
               std::fabs(m.b * xb[i]);
    return a;
}
struct MixGrads {
    V dx, dx0, dxb, magnitude;  // magnitude: of each element of the mix output's total gradient
    double dr = 0, dl = 0, db = 0, mag_r = 0, mag_l = 0, mag_b = 0;
};
// g: the gradient of the mix output around the next block; dh: of the norm of it; xm: the stream the
// norm read (the kernel's stored one, or the exact mix for finite differences).
MixGrads ref_mix_backward(const V& g, const V& dh, const V& xm, const V& x, const V& x0, const V& xb, const Mix& m,
                          int T, int C) {
    V gn, gmag;
    test::ref_rmsnorm_backward(dh, xm, T, C, gn, gmag);
    MixGrads o;
    o.dx.resize(x.size());
    o.dx0.resize(x.size());
    o.dxb.resize(x.size());
    o.magnitude.resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        const double gm = g[i] + gn[i], mag = std::fabs(g[i]) + gmag[i];
        const double x0v = m.first ? x[i] : x0[i];
        o.dx[i] = (m.first ? m.r + m.l : m.r) * gm;
        o.dx0[i] = m.first ? 0.0 : m.l * gm;
        o.dxb[i] = m.b * gm;
        o.magnitude[i] = mag;
        o.dr += gm * x[i];
        o.dl += gm * x0v;
        o.db += gm * xb[i];
        o.mag_r += mag * std::fabs(x[i]);
        o.mag_l += mag * std::fabs(x0v);
        o.mag_b += mag * std::fabs(xb[i]);
    }
    return o;
}
double mix_loss(const V& g, const V& dh, const V& x, const V& x0, const V& xb, const Mix& m, int T, int C) {
    const V xm = ref_mix(x, x0, xb, m);
    return dot(g, xm) + test::ref_rmsnorm_dot(dh, xm, T, C);
}

// The gated skip: x_out = x + sigmoid(lambda) * 2 * sigmoid(x0[t, :12] . w) * skip. bf16_linear rounds the
// logit, its gradient and the x0 gradient it sends back to bf16, as upstream's bf16 F.linear does;
// without it the math is exact (for finite differences).
struct Skip {
    double lambda;
    V w;
    bool bf16_linear;
};
double ref_skip_logit(const V& x0, size_t row_off, const Skip& s) {
    double z = 0.0;
    for (int k = 0; k < kGateWidth; ++k) z += x0[row_off + k] * s.w[k];
    return s.bf16_linear ? round_bf16(z) : z;
}
V ref_skip_forward(const V& x, const V& skip, const V& x0, const Skip& s, int T, int C, V* magnitude) {
    V out(x.size());
    if (magnitude) magnitude->resize(x.size());
    for (int t = 0; t < T; ++t) {
        const size_t o = size_t(t) * C;
        const double gate = sigmoid(s.lambda) * 2.0 * sigmoid(ref_skip_logit(x0, o, s));
        for (int c = 0; c < C; ++c) {
            out[o + c] = x[o + c] + gate * skip[o + c];
            if (magnitude) (*magnitude)[o + c] = std::fabs(x[o + c]) + std::fabs(gate * skip[o + c]);
        }
    }
    return out;
}
struct SkipGrads {
    V d_skip, d_skip_mag, dx0;  // dx0: the gate's share, (T, C) with only the first 12 columns non-zero
    V dw = V(kGateWidth), dw_mag = V(kGateWidth);
    // With bf16_linear: how far the kernel's bf16 logit gradient may be from the reference's on each row
    // (0 where fp32 error cannot change its rounding), and what that allows on skip_gate's gradient.
    V dlogit_slack, dw_slack = V(kGateWidth);
    double dlambda = 0, dlambda_mag = 0;
};
// g: the gradient of the skip add's output.
SkipGrads ref_skip_backward(const V& g, const V& skip, const V& x0, const Skip& s, int T, int C) {
    SkipGrads o;
    o.d_skip.resize(g.size());
    o.d_skip_mag.resize(g.size());
    o.dx0.assign(g.size(), 0.0);
    const double sl = sigmoid(s.lambda);
    for (int t = 0; t < T; ++t) {
        const size_t off = size_t(t) * C;
        const double sg = sigmoid(ref_skip_logit(x0, off, s)), gate = sl * 2.0 * sg;
        double ds = 0.0, ds_mag = 0.0;
        for (int c = 0; c < C; ++c) {
            ds += g[off + c] * skip[off + c];
            ds_mag += std::fabs(g[off + c] * skip[off + c]);
            o.d_skip[off + c] = gate * g[off + c];
            o.d_skip_mag[off + c] = std::fabs(gate * g[off + c]);
        }
        const double dsig_logit = sl * 2.0 * sg * (1.0 - sg);
        double dlogit = ds * dsig_logit;
        // The kernel's fp32 row sum ds is within 1e-5 of its terms' magnitude; where that interval holds a
        // bf16 rounding boundary, the kernel's bf16 logit gradient may round elsewhere: by at most twice
        // the interval plus one bf16 step (2^-7).
        const double err = 1e-5 * (ds_mag * dsig_logit + std::fabs(dlogit));
        const bool may_differ = s.bf16_linear && round_bf16(dlogit - err) != round_bf16(dlogit + err);
        o.dlogit_slack.push_back(may_differ ? 2 * err + std::fabs(dlogit) / 64 : 0.0);
        if (s.bf16_linear) dlogit = round_bf16(dlogit);
        for (int k = 0; k < kGateWidth; ++k) {
            const double back = dlogit * s.w[k];
            o.dx0[off + k] = s.bf16_linear ? round_bf16(back) : back;
            const double term = dlogit * x0[off + k];
            o.dw[k] += term;
            o.dw_mag[k] += std::fabs(term);
            o.dw_slack[k] += o.dlogit_slack.back() * std::fabs(x0[off + k]);
        }
        const double dsig_lambda = 2.0 * sg * sl * (1.0 - sl);
        o.dlambda += ds * dsig_lambda;
        o.dlambda_mag += ds_mag * dsig_lambda;
    }
    return o;
}
double skip_loss(const V& g, const V& x, const V& skip, const V& x0, const Skip& s, int T, int C) {
    return dot(g, ref_skip_forward(x, skip, x0, s, T, C, nullptr));
}

// The backout: xf = x - bl * xbk, h = norm(xf).
V ref_backout(const V& x, const V& xbk, double bl) {
    V xf(x.size());
    for (size_t i = 0; i < x.size(); ++i) xf[i] = x[i] - bl * xbk[i];
    return xf;
}
struct BackoutGrads {
    V dx, dxb, magnitude;
    double dbl = 0, mag = 0;
};
BackoutGrads ref_backout_backward(const V& dh, const V& xf, const V& xbk, double bl, int T, int C) {
    BackoutGrads o;
    test::ref_rmsnorm_backward(dh, xf, T, C, o.dx, o.magnitude);
    o.dxb.resize(xf.size());
    for (size_t i = 0; i < xf.size(); ++i) {
        o.dxb[i] = -bl * o.dx[i];
        o.dbl -= o.dx[i] * xbk[i];
        o.mag += o.magnitude[i] * std::fabs(xbk[i]);
    }
    return o;
}

// ---- test data ----
struct Shape {
    int T, C;
    std::string name() const { return " T=" + std::to_string(T) + " C=" + std::to_string(C); }
    size_t n() const { return size_t(T) * C; }
};
// x0-like rows whose first 12 columns lie on a coarse dyadic grid (i/64, |i| <= 128): with skip_gate
// weights on j/128 (|j| <= 64), every partial sum of the logit is exact in fp32, so the kernel and the
// reference round the same exact logit to bf16 (no rounding-boundary flips).
std::vector<bf16> x0_rows(const Shape& s) {
    auto x0 = normal_bf16(s.n());
    for (int t = 0; t < s.T; ++t)
        for (int k = 0; k < kGateWidth && k < s.C; ++k)
            x0[size_t(t) * s.C + k] = __float2bfloat16(test::randint(-128, 128) / 64.0f);
    return x0;
}
std::vector<bf16> skip_gate_weights() {
    std::vector<bf16> w(kGateWidth);
    for (auto& v : w) v = __float2bfloat16(test::randint(-64, 64) / 128.0f);
    return w;
}
float random_float(double lo, double hi) { return static_cast<float>(test::uniform(lo, hi)); }

// The norm a fused forward stored, h (bf16) and rstd (fp32), against the double norm of the stream x it
// stored: h within its bf16 rounding, rstd within 1e-5.
void check_fused_norm(const std::string& kernel, const std::string& at, const V& x, const DeviceBuffer<bf16>& d_h,
                      const DeviceBuffer<float>& d_rstd, const Shape& s) {
    V h_ref, rstd_ref;
    test::ref_rmsnorm(x, s.T, s.C, h_ref, rstd_ref);
    check_within(kernel + " h" + at, values(d_h.download()), h_ref, bf16_tol(h_ref, V(h_ref.size(), 0.0)));
    V rstd_tol(s.T);
    for (int t = 0; t < s.T; ++t) rstd_tol[t] = 1e-5 * rstd_ref[t];
    check_within(kernel + " rstd" + at, values(d_rstd.download()), rstd_ref, rstd_tol);
}

// ---- the layer mix ----
void check_mix(const Shape& s, bool first) {
    const std::string at = s.name() + (first ? " (layer 0)" : "");
    const auto x = normal_bf16(s.n()), x0 = x0_rows(s), xb = normal_bf16(s.n(), 0.0, 0.5);
    const auto g = normal_bf16(s.n()), dh = normal_bf16(s.n());
    const auto old_dx = normal_bf16(s.n()), old_dx0 = normal_bf16(s.n()), old_dxb = normal_bf16(s.n());
    const std::vector<float> lam = {random_float(0.5, 1.5), random_float(-0.5, 0.5), random_float(-0.3, 0.3)};
    const std::vector<float> old_grads = {random_float(-1, 1), random_float(-1, 1), random_float(-1, 1)};
    const Mix m{lam[0], lam[1], lam[2], first};
    const V xd = first ? values(x0) : values(x), x0d = values(x0), xbd = values(xb);

    DeviceBuffer<bf16> d_x(x), d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xm(s.n()), d_h(s.n());
    DeviceBuffer<bf16> d_dx(s.n()), d_dx0(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(3);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const bf16* x_in = first ? d_x0.ptr : d_x.ptr;  // at layer 0 the stream is x0 itself
    const MixLambdas lambdas{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2};
    const MixLambdaGrads grads{d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2};

    // forward: the stream against the exact mix; the norm against the norm of the stored (rounded) stream
    residual_mix_forward(d_xm.ptr, d_h.ptr, d_rstd.ptr, x_in, d_x0.ptr, d_xb.ptr, lambdas, first, s.T, s.C, nullptr);
    const V xm_ref = ref_mix(xd, x0d, xbd, m);
    const auto xm = d_xm.download();
    const V xmd = values(xm);
    check_within("residual_mix_forward x" + at, xmd, xm_ref, bf16_tol(xm_ref, mix_magnitude(xd, x0d, xbd, m)));
    check_fused_norm("residual_mix_forward", at, xmd, d_h, d_rstd, s);

    const MixGrads want = ref_mix_backward(values(g), values(dh), xmd, xd, x0d, xbd, m, s.T, s.C);
    V mag_dx(s.n()), mag_dx0(s.n()), mag_dxb(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        mag_dx[i] = std::fabs(first ? m.r + m.l : m.r) * want.magnitude[i];
        mag_dx0[i] = std::fabs(m.l) * want.magnitude[i];
        mag_dxb[i] = std::fabs(m.b) * want.magnitude[i];
    }
    for (bool acc : {false, true}) {
        // accumulate: every output adds to what is there (at layer 0, dx is x0's gradient and dx0 unused)
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx.upload(old_dx);
        d_dx0.upload(old_dx0);
        d_dxb.upload(old_dxb);
        d_grads.upload(old_grads);
        residual_mix_backward(d_dx.ptr, first ? nullptr : d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_g.ptr, d_dh.ptr,
                              d_xm.ptr, d_rstd.ptr, x_in, d_x0.ptr, d_xb.ptr, lambdas,
                              {.first_layer = first, .accumulate_dx = acc, .accumulate_x0_grads = acc,
                               .accumulate_lambda_grads = acc},
                              s.T, s.C, nullptr);
        const auto dx = d_dx.download(), dx0 = d_dx0.download(), dxb = d_dxb.download();
        const auto pg = d_grads.download();
        test::same_as_second_launch("residual_mix_backward lambda gradients" + how, d_scratch, 0,
                                    residual_backward_blocks(s.T), 3, old_grads, pg, acc);
        V w_dx = want.dx, w_dx0 = want.dx0, w_dxb = want.dxb, m_dx = mag_dx, m_dx0 = mag_dx0, m_dxb = mag_dxb;
        if (acc) {
            for (size_t i = 0; i < s.n(); ++i) {
                w_dx[i] += __bfloat162float(old_dx[i]);
                w_dx0[i] += __bfloat162float(old_dx0[i]);
                w_dxb[i] += __bfloat162float(old_dxb[i]);
                m_dx[i] += std::fabs(__bfloat162float(old_dx[i]));
                m_dx0[i] += std::fabs(__bfloat162float(old_dx0[i]));
                m_dxb[i] += std::fabs(__bfloat162float(old_dxb[i]));
            }
        }
        check_within("residual_mix_backward dx" + how, values(dx), w_dx, bf16_tol(w_dx, m_dx));
        if (first)
            test::check(same_bits(dx0, old_dx0), "residual_mix_backward leaves dx0 alone at layer 0%s", how.c_str());
        else
            check_within("residual_mix_backward dx0" + how, values(dx0), w_dx0, bf16_tol(w_dx0, m_dx0));
        check_within("residual_mix_backward dx0_bigram" + how, values(dxb), w_dxb, bf16_tol(w_dxb, m_dxb));
        const double base[3] = {acc ? old_grads[0] : 0.0, acc ? old_grads[1] : 0.0, acc ? old_grads[2] : 0.0};
        check_scalar("d resid_lambda" + how, pg[0], base[0] + want.dr,
                     1e-5 * (want.mag_r + std::fabs(base[0])) + 1e-30);
        check_scalar("d x0_lambda" + how, pg[1], base[1] + want.dl, 1e-5 * (want.mag_l + std::fabs(base[1])) + 1e-30);
        check_scalar("d bigram_lambda" + how, pg[2], base[2] + want.db,
                     1e-5 * (want.mag_b + std::fabs(base[2])) + 1e-30);
        if (first && !acc)
            test::check(pg[0] == pg[1], "layer 0: resid and x0 lambdas get the same gradient%s", how.c_str());

        if (!acc) {  // the same call again gives the same bits
            d_dx.upload(old_dx);
            d_dx0.upload(old_dx0);
            d_dxb.upload(old_dxb);
            residual_mix_backward(d_dx.ptr, first ? nullptr : d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_g.ptr,
                                  d_dh.ptr, d_xm.ptr, d_rstd.ptr, x_in, d_x0.ptr, d_xb.ptr, lambdas,
                                  {.first_layer = first, .accumulate_dx = false, .accumulate_x0_grads = false,
                                   .accumulate_lambda_grads = false},
                                  s.T, s.C, nullptr);
            test::check(same_bits(d_dx.download(), dx) && same_bits(d_dx0.download(), dx0) &&
                            same_bits(d_dxb.download(), dxb) && same_bits(d_grads.download(), pg),
                        "residual_mix_backward reproducible%s", how.c_str());
        }
    }
    if (!first) {  // in place: the layer input's gradient overwrites the stream gradient it came from
        DeviceBuffer<bf16> d_gdx(g);
        residual_mix_backward(d_gdx.ptr, d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_gdx.ptr, d_dh.ptr, d_xm.ptr,
                              d_rstd.ptr, x_in, d_x0.ptr, d_xb.ptr, lambdas,
                              {.first_layer = false, .accumulate_dx = false, .accumulate_x0_grads = false,
                               .accumulate_lambda_grads = false},
                              s.T, s.C, nullptr);
        check_within("residual_mix_backward dx in place" + at, values(d_gdx.download()), want.dx,
                     bf16_tol(want.dx, mag_dx));
    }
}

// ---- the gated skip ----
void check_skip(const Shape& s) {
    const std::string at = s.name();
    const auto x = normal_bf16(s.n()), skip = normal_bf16(s.n()), x0 = x0_rows(s), w = skip_gate_weights();
    const auto g = normal_bf16(s.n()), old_dskip = normal_bf16(s.n()), old_dx0 = normal_bf16(s.n());
    const auto old_dw = normal_bf16(kGateWidth, 0.0, 0.5);
    const std::vector<float> lam = {random_float(-2.5, 1.0)}, old_dlam = {random_float(-1, 1)};
    const Skip sp{lam[0], values(w), true};
    const V xd = values(x), skd = values(skip), x0d = values(x0);

    DeviceBuffer<bf16> d_x(x), d_skip(skip), d_x0(x0), d_w(w), d_g(g), d_out(s.n()), d_dskip(s.n()), d_dx0(s.n()),
        d_dw(kGateWidth);
    DeviceBuffer<float> d_lam(lam), d_dlam(1);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));

    gated_skip_add_forward(d_out.ptr, d_x.ptr, d_skip.ptr, d_x0.ptr, d_w.ptr, d_lam.ptr, s.T, s.C, nullptr);
    V mag;
    const V out_ref = ref_skip_forward(xd, skd, x0d, sp, s.T, s.C, &mag);
    check_within("gated_skip_add_forward" + at, values(d_out.download()), out_ref, bf16_tol(out_ref, mag));
    {  // in place
        DeviceBuffer<bf16> d_io(x);
        gated_skip_add_forward(d_io.ptr, d_io.ptr, d_skip.ptr, d_x0.ptr, d_w.ptr, d_lam.ptr, s.T, s.C, nullptr);
        test::check(same_bits(d_io.download(), d_out.download()), "gated_skip_add_forward in place%s", at.c_str());
    }

    const SkipGrads want = ref_skip_backward(values(g), skd, x0d, sp, s.T, s.C);
    const std::vector<bf16> zeros(s.n(), __float2bfloat16(0.0f));
    for (bool acc : {false, true}) {
        // x0's gradient always gains the gate's share: from zeros it must be the share itself
        const std::string how = at + (acc ? " accumulate" : "");
        const std::vector<bf16>& dx0_before = acc ? old_dx0 : zeros;
        d_dskip.upload(old_dskip);
        d_dx0.upload(dx0_before);
        d_dw.upload(old_dw);
        d_dlam.upload(old_dlam);
        gated_skip_add_backward(d_dskip.ptr, d_dx0.ptr, d_dw.ptr, d_dlam.ptr, d_scratch.view(), d_g.ptr, d_skip.ptr,
                                d_x0.ptr, d_w.ptr, d_lam.ptr,
                                {.accumulate_d_skip = acc, .accumulate_param_grads = acc}, s.T, s.C, nullptr);
        const auto dskip = d_dskip.download(), dx0 = d_dx0.download(), dw = d_dw.download();
        const auto dlam = d_dlam.download();
        const int blocks = residual_backward_blocks(s.T);
        test::same_as_second_launch("gated_skip_add_backward d_skip_gate" + how, d_scratch, 0, blocks,
                                    kResidualMaxPartials, old_dw, dw, acc);
        test::same_as_second_launch("gated_skip_add_backward d_skip_lambda" + how, d_scratch, kGateWidth, blocks,
                                    kResidualMaxPartials, old_dlam, dlam, acc);

        V w_dskip = want.d_skip, m_dskip = want.d_skip_mag;
        if (acc)
            for (size_t i = 0; i < s.n(); ++i) {
                w_dskip[i] += __bfloat162float(old_dskip[i]);
                m_dskip[i] += std::fabs(__bfloat162float(old_dskip[i]));
            }
        check_within("gated_skip_add_backward d_skip" + how, values(dskip), w_dskip, bf16_tol(w_dskip, m_dskip));

        // x0's gradient gains the gate's share in its first 12 columns; the rest is untouched. The share is
        // a product of bf16 values rounded to bf16, the same bits as the reference's, except on rows where
        // the logit gradient may round elsewhere (its slack, and one more rounding of the share).
        V got0, want0, tol0;
        bool rest_untouched = true;
        for (int t = 0; t < s.T; ++t)
            for (int c = 0; c < s.C; ++c) {
                const size_t i = size_t(t) * s.C + c;
                if (c >= kGateWidth) {
                    rest_untouched &= std::memcmp(&dx0[i], &dx0_before[i], sizeof(bf16)) == 0;
                    continue;
                }
                const double old = __bfloat162float(dx0_before[i]), share = want.dx0[i];
                got0.push_back(__bfloat162float(dx0[i]));
                want0.push_back(old + share);
                const double slack = want.dlogit_slack[t];
                tol0.push_back(std::fabs(old + share) / 128 * acc +
                               (slack > 0 ? slack * std::fabs(sp.w[c]) + std::fabs(share) / 128 : 0.0) +
                               1e-5 * std::fabs(old) + 1e-30);
            }
        check_within("gated_skip_add_backward dx0[:, :12]" + how, got0, want0, tol0);
        test::check(rest_untouched, "gated_skip_add_backward leaves dx0[:, 12:] alone%s", how.c_str());

        // skip_gate (bf16): rtol 2^-7, fp32 sums (1e-5 of the magnitude), and the rows whose logit gradient
        // may round elsewhere
        V w_dw(kGateWidth), t_dw(kGateWidth);
        for (int k = 0; k < kGateWidth; ++k) {
            const double base = acc ? __bfloat162float(old_dw[k]) : 0.0;
            w_dw[k] = base + want.dw[k];
            t_dw[k] = std::fabs(w_dw[k]) / 128 + 1e-5 * (want.dw_mag[k] + std::fabs(base)) + want.dw_slack[k] + 1e-30;
        }
        check_within("d skip_gate" + how, values(dw), w_dw, t_dw);
        const double base = acc ? old_dlam[0] : 0.0;
        check_scalar("d skip_lambda" + how, dlam[0], base + want.dlambda,
                     1e-5 * (want.dlambda_mag + std::fabs(base)) + 1e-30);

        if (!acc) {
            d_dskip.upload(old_dskip);
            d_dx0.upload(dx0_before);
            gated_skip_add_backward(d_dskip.ptr, d_dx0.ptr, d_dw.ptr, d_dlam.ptr, d_scratch.view(), d_g.ptr, d_skip.ptr,
                                    d_x0.ptr, d_w.ptr, d_lam.ptr, SkipBackwardOptions{}, s.T, s.C, nullptr);
            test::check(same_bits(d_dskip.download(), dskip) && same_bits(d_dx0.download(), dx0) &&
                            same_bits(d_dw.download(), dw) && same_bits(d_dlam.download(), dlam),
                        "gated_skip_add_backward reproducible%s", how.c_str());
        }
    }
}

// ---- the block-output add ----
void check_add(const Shape& s) {
    const std::string at = s.name();
    const auto x = normal_bf16(s.n()), y = normal_bf16(s.n()), dh = normal_bf16(s.n());
    const auto dX = normal_bf16(s.n());
    const V xd = values(x), yd = values(y);
    DeviceBuffer<bf16> d_x(x), d_y(y), d_out(s.n()), d_h(s.n()), d_dh(dh), d_dX(dX);
    DeviceBuffer<float> d_rstd(s.T);

    residual_add_forward(d_out.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, s.T, s.C, nullptr);
    const auto out = d_out.download();
    V sum(s.n()), mag(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        sum[i] = xd[i] + yd[i];
        mag[i] = std::fabs(xd[i]) + std::fabs(yd[i]);
    }
    check_within("residual_add_forward x" + at, values(out), sum, bf16_tol(sum, mag));
    check_fused_norm("residual_add_forward", at, values(out), d_h, d_rstd, s);
    {  // without the norm, in place
        DeviceBuffer<bf16> d_io(x);
        residual_add_forward(d_io.ptr, nullptr, nullptr, d_io.ptr, d_y.ptr, s.T, s.C, nullptr);
        test::check(same_bits(d_io.download(), out), "residual_add_forward without norm, in place%s", at.c_str());
    }

    // backward: the stream gradient gains the norm's share
    residual_add_backward(d_dX.ptr, d_dh.ptr, d_out.ptr, d_rstd.ptr, s.T, s.C, nullptr);
    V gn, gmag;
    test::ref_rmsnorm_backward(values(dh), values(out), s.T, s.C, gn, gmag);
    for (size_t i = 0; i < s.n(); ++i) {
        gn[i] += __bfloat162float(dX[i]);
        gmag[i] += std::fabs(__bfloat162float(dX[i]));
    }
    check_within("residual_add_backward" + at, values(d_dX.download()), gn, bf16_tol(gn, gmag));
}

// ---- the backout ----
void check_backout(const Shape& s) {
    const std::string at = s.name();
    const auto x = normal_bf16(s.n()), xbk = normal_bf16(s.n()), dh = normal_bf16(s.n());
    const std::vector<float> bl = {random_float(0.2, 0.8)}, old_dbl = {random_float(-1, 1)};
    const V xd = values(x), xbd = values(xbk);
    DeviceBuffer<bf16> d_x(x), d_xbk(xbk), d_dh(dh), d_xf(s.n()), d_h(s.n()), d_dx(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_bl(bl), d_dbl(1);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));

    backout_forward(d_xf.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_xbk.ptr, d_bl.ptr, s.T, s.C, nullptr);
    const V xf_ref = ref_backout(xd, xbd, bl[0]);
    V mag(s.n());
    for (size_t i = 0; i < s.n(); ++i) mag[i] = std::fabs(xd[i]) + std::fabs(bl[0] * xbd[i]);
    const V xf = values(d_xf.download());
    check_within("backout_forward x" + at, xf, xf_ref, bf16_tol(xf_ref, mag));
    check_fused_norm("backout_forward", at, xf, d_h, d_rstd, s);

    const BackoutGrads want = ref_backout_backward(values(dh), xf, xbd, bl[0], s.T, s.C);
    V mag_b(s.n());
    for (size_t i = 0; i < s.n(); ++i) mag_b[i] = bl[0] * want.magnitude[i];
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dbl.upload(old_dbl);
        backout_backward(d_dx.ptr, d_dxb.ptr, d_dbl.ptr, d_scratch.view(), d_dh.ptr, d_xf.ptr, d_rstd.ptr, d_xbk.ptr,
                         d_bl.ptr, acc, s.T, s.C, nullptr);
        const auto dx = d_dx.download(), dxb = d_dxb.download();
        const auto dbl = d_dbl.download();
        test::same_as_second_launch("backout_backward d_backout_lambda" + how, d_scratch, 0,
                                    residual_backward_blocks(s.T), 1, old_dbl, dbl, acc);
        check_within("backout_backward dx" + how, values(dx), want.dx, bf16_tol(want.dx, want.magnitude));
        check_within("backout_backward dx_backout" + how, values(dxb), want.dxb, bf16_tol(want.dxb, mag_b));
        const double base = acc ? old_dbl[0] : 0.0;
        check_scalar("d backout_lambda" + how, dbl[0], base + want.dbl, 1e-5 * (want.mag + std::fabs(base)) + 1e-30);
        if (!acc) {
            backout_backward(d_dx.ptr, d_dxb.ptr, d_dbl.ptr, d_scratch.view(), d_dh.ptr, d_xf.ptr, d_rstd.ptr, d_xbk.ptr,
                             d_bl.ptr, false, s.T, s.C, nullptr);
            test::check(
                same_bits(d_dx.download(), dx) && same_bits(d_dxb.download(), dxb) && same_bits(d_dbl.download(), dbl),
                "backout_backward reproducible%s", how.c_str());
        }
    }
}

// ---- finite differences on a small case ----
// d loss / d v by central differences: `v` (a coordinate the loss reads) is moved and restored.
template <class F>
double central_difference(double& v, F&& loss) {
    return test::central_difference(v, 1e-5 * std::max(1.0, std::fabs(v)), loss);
}
// The reference backward within 1e-6 of the differences (relative to the terms' magnitude).
constexpr double kFdRtol = 1e-6;

void check_mix_finite_differences(bool first) {
    const Shape s{5, 16};
    const std::string at = first ? " (layer 0)" : "";
    const auto x0b = x0_rows(s), xbb = normal_bf16(s.n(), 0.0, 0.5), gb = normal_bf16(s.n());
    const auto dhb = normal_bf16(s.n()), xb16 = first ? x0b : normal_bf16(s.n());
    const std::vector<float> lam = {random_float(0.5, 1.5), random_float(-0.5, 0.5), random_float(-0.3, 0.3)};
    const V g = values(gb), dh = values(dhb);
    V x = values(xb16), x0 = values(x0b), xb = values(xbb);
    Mix m{lam[0], lam[1], lam[2], first};
    const MixGrads want = ref_mix_backward(g, dh, ref_mix(x, x0, xb, m), x, x0, xb, m, s.T, s.C);
    // at layer 0 the stream is x0: x and x0 are one input, moved together
    const auto loss = [&] { return mix_loss(g, dh, x, first ? x : x0, xb, m, s.T, s.C); };

    const double fd_r = central_difference(m.r, loss), fd_l = central_difference(m.l, loss);
    const double fd_b = central_difference(m.b, loss);
    check_scalar("mix reference d resid_lambda vs differences" + at, want.dr, fd_r, kFdRtol * want.mag_r + 1e-9);
    check_scalar("mix reference d x0_lambda vs differences" + at, want.dl, fd_l, kFdRtol * want.mag_l + 1e-9);
    check_scalar("mix reference d bigram_lambda vs differences" + at, want.db, fd_b, kFdRtol * want.mag_b + 1e-9);
    V fd_x(s.n()), fd_x0(s.n()), fd_xb(s.n()), tol(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        fd_x[i] = central_difference(x[i], loss);
        if (!first) fd_x0[i] = central_difference(x0[i], loss);
        fd_xb[i] = central_difference(xb[i], loss);
        tol[i] = kFdRtol * want.magnitude[i] + 1e-9;
    }
    check_within("mix reference dx vs differences" + at, want.dx, fd_x, tol);
    if (!first) check_within("mix reference dx0 vs differences" + at, want.dx0, fd_x0, tol);
    check_within("mix reference dx0_bigram vs differences" + at, want.dxb, fd_xb, tol);

    // the kernels' lambda gradients against the same differences: the backward reads the stored bf16
    // stream (within 2^-8 of the exact one) and its rstd, so allow 2^-6 of the terms' magnitude
    DeviceBuffer<bf16> d_x(xb16), d_x0(x0b), d_xb(xbb), d_g(gb), d_dh(dhb), d_xm(s.n()), d_h(s.n()), d_dx(s.n()),
        d_dx0(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(3);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const MixLambdas lambdas{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2};
    residual_mix_forward(d_xm.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_x0.ptr, d_xb.ptr, lambdas, first, s.T, s.C, nullptr);
    residual_mix_backward(d_dx.ptr, d_dx0.ptr, d_dxb.ptr, MixLambdaGrads{d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2},
                          d_scratch.view(), d_g.ptr, d_dh.ptr, d_xm.ptr, d_rstd.ptr, d_x.ptr, d_x0.ptr, d_xb.ptr, lambdas,
                          {.first_layer = first, .accumulate_dx = false, .accumulate_x0_grads = false,
                           .accumulate_lambda_grads = false},
                          s.T, s.C, nullptr);
    const auto pg = d_grads.download();
    check_scalar("residual_mix_backward d resid_lambda vs differences" + at, pg[0], fd_r, want.mag_r / 64);
    check_scalar("residual_mix_backward d x0_lambda vs differences" + at, pg[1], fd_l, want.mag_l / 64);
    check_scalar("residual_mix_backward d bigram_lambda vs differences" + at, pg[2], fd_b, want.mag_b / 64);
}

void check_skip_finite_differences() {
    const Shape s{5, 16};
    const auto xb16 = normal_bf16(s.n()), skipb = normal_bf16(s.n()), x0b = x0_rows(s);
    const auto wb = skip_gate_weights(), gb = normal_bf16(s.n());
    const std::vector<float> lam = {random_float(-2.5, 1.0)};
    const V g = values(gb);
    V x = values(xb16), skip = values(skipb), x0 = values(x0b);
    Skip exact{lam[0], values(wb), false};
    const SkipGrads want = ref_skip_backward(g, skip, x0, exact, s.T, s.C);
    const auto loss = [&] { return skip_loss(g, x, skip, x0, exact, s.T, s.C); };

    const double fd_lam = central_difference(exact.lambda, loss);
    check_scalar("skip reference d skip_lambda vs differences", want.dlambda, fd_lam,
                 kFdRtol * want.dlambda_mag + 1e-9);
    V fd_w(kGateWidth), tol_w(kGateWidth);
    for (int k = 0; k < kGateWidth; ++k) {
        fd_w[k] = central_difference(exact.w[k], loss);
        tol_w[k] = kFdRtol * want.dw_mag[k] + 1e-9;
    }
    check_within("skip reference d skip_gate vs differences", want.dw, fd_w, tol_w);
    V fd_skip(s.n()), fd_x0(s.n()), fd_x(s.n()), tol(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        fd_skip[i] = central_difference(skip[i], loss);
        fd_x0[i] = central_difference(x0[i], loss);
        fd_x[i] = central_difference(x[i], loss);
        tol[i] = kFdRtol * (want.d_skip_mag[i] + std::fabs(want.dx0[i]) + std::fabs(g[i])) + 1e-9;
    }
    check_within("skip reference d_skip vs differences", want.d_skip, fd_skip, tol);
    check_within("skip reference dx0 vs differences", want.dx0, fd_x0, tol);
    check_within("skip: x's gradient is the output's (g) vs differences", g, fd_x, tol);

    // the kernel (bf16 logit, logit gradient and x0 share) against the exact differences: the logit's
    // rounding moves sigmoid terms by up to 2^-8 |logit| relative, so allow 2^-4 of the terms' magnitude
    DeviceBuffer<bf16> d_skip(skipb), d_x0(x0b), d_w(wb), d_g(gb), d_dskip(s.n()),
        d_dx0(std::vector<bf16>(s.n(), __float2bfloat16(0.0f))), d_dw(kGateWidth);
    DeviceBuffer<float> d_lam(lam), d_dlam(1);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    gated_skip_add_backward(d_dskip.ptr, d_dx0.ptr, d_dw.ptr, d_dlam.ptr, d_scratch.view(), d_g.ptr, d_skip.ptr, d_x0.ptr,
                            d_w.ptr, d_lam.ptr, SkipBackwardOptions{}, s.T, s.C, nullptr);
    V tw(kGateWidth);
    for (int k = 0; k < kGateWidth; ++k) tw[k] = want.dw_mag[k] / 16 + 1e-9;
    check_within("gated_skip_add_backward d skip_gate vs differences", values(d_dw.download()), fd_w, tw);
    check_scalar("gated_skip_add_backward d skip_lambda vs differences", d_dlam.download()[0], fd_lam,
                 want.dlambda_mag / 16 + 1e-9);
    V tx0(s.n());
    for (size_t i = 0; i < s.n(); ++i) tx0[i] = std::fabs(fd_x0[i]) / 16 + 1e-9;
    check_within("gated_skip_add_backward dx0 vs differences", values(d_dx0.download()), fd_x0, tx0);
}

void check_backout_finite_differences() {
    const Shape s{5, 16};
    const auto xb16 = normal_bf16(s.n()), xbkb = normal_bf16(s.n()), dhb = normal_bf16(s.n());
    const std::vector<float> blf = {random_float(0.2, 0.8)};
    const V dh = values(dhb);
    V x = values(xb16), xbk = values(xbkb);
    double bl = blf[0];
    const BackoutGrads want = ref_backout_backward(dh, ref_backout(x, xbk, bl), xbk, bl, s.T, s.C);
    const auto loss = [&] { return test::ref_rmsnorm_dot(dh, ref_backout(x, xbk, bl), s.T, s.C); };

    const double fd_bl = central_difference(bl, loss);
    check_scalar("backout reference d backout_lambda vs differences", want.dbl, fd_bl, kFdRtol * want.mag + 1e-9);
    V fd_x(s.n()), fd_xb(s.n()), tol(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        fd_x[i] = central_difference(x[i], loss);
        fd_xb[i] = central_difference(xbk[i], loss);
        tol[i] = kFdRtol * want.magnitude[i] + 1e-9;
    }
    check_within("backout reference dx vs differences", want.dx, fd_x, tol);
    check_within("backout reference dx_backout vs differences", want.dxb, fd_xb, tol);

    DeviceBuffer<bf16> d_x(xb16), d_xbk(xbkb), d_dh(dhb), d_xf(s.n()), d_h(s.n()), d_dx(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_bl(blf), d_dbl(1);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    backout_forward(d_xf.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_xbk.ptr, d_bl.ptr, s.T, s.C, nullptr);
    backout_backward(d_dx.ptr, d_dxb.ptr, d_dbl.ptr, d_scratch.view(), d_dh.ptr, d_xf.ptr, d_rstd.ptr, d_xbk.ptr, d_bl.ptr,
                     false, s.T, s.C, nullptr);
    check_scalar("backout_backward d backout_lambda vs differences", d_dbl.download()[0], fd_bl, want.mag / 64);
}

void check_add_finite_differences() {
    const Shape s{5, 16};
    const auto xb16 = normal_bf16(s.n()), yb = normal_bf16(s.n()), gb = normal_bf16(s.n());
    const auto dhb = normal_bf16(s.n());
    const V g = values(gb), dh = values(dhb);
    V x = values(xb16), y = values(yb);
    const auto sum_of = [&] {
        V sum(x.size());
        for (size_t i = 0; i < sum.size(); ++i) sum[i] = x[i] + y[i];
        return sum;
    };
    const auto loss = [&] {
        const V sum = sum_of();
        return dot(g, sum) + test::ref_rmsnorm_dot(dh, sum, s.T, s.C);
    };
    V gn, gmag;
    test::ref_rmsnorm_backward(dh, sum_of(), s.T, s.C, gn, gmag);
    V want(s.n()), fd_x(s.n()), fd_y(s.n()), tol(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        want[i] = g[i] + gn[i];
        fd_x[i] = central_difference(x[i], loss);
        fd_y[i] = central_difference(y[i], loss);
        tol[i] = kFdRtol * (std::fabs(g[i]) + gmag[i]) + 1e-9;
    }
    check_within("add reference dx vs differences", want, fd_x, tol);
    check_within("add reference dy vs differences", want, fd_y, tol);

    DeviceBuffer<bf16> d_x(xb16), d_y(yb), d_out(s.n()), d_h(s.n()), d_dh(dhb), d_dX(gb);
    DeviceBuffer<float> d_rstd(s.T);
    residual_add_forward(d_out.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, s.T, s.C, nullptr);
    residual_add_backward(d_dX.ptr, d_dh.ptr, d_out.ptr, d_rstd.ptr, s.T, s.C, nullptr);
    for (size_t i = 0; i < s.n(); ++i) tol[i] = std::fabs(fd_x[i]) / 64 + (std::fabs(g[i]) + gmag[i]) / 128 + 1e-9;
    check_within("residual_add_backward vs differences", values(d_dX.download()), fd_x, tol);
}

// ---- record 80: the sublayer update, the stream's start, layer 6's skip add with its norm ----
// fp32 lambdas off the bf16 grid (their bf16 rounding moves them by up to 2^-9 relative): the kernels
// must multiply by the rounded value and round each gradient's fp32 sum to bf16.
float lambda_off_grid(double lo, double hi) {
    for (;;) {
        const float v = random_float(lo, hi);
        if (std::fabs(v - round_bf16(v)) > std::fabs(v) / 2048) return v;
    }
}
struct Sublayer {
    double r, p, l, b;  // the bf16 values of resid, post, x0 and bigram lambdas (l, b: 0 where not injected)
    Injection inj;
};
Sublayer sublayer_of(const std::vector<float>& lam, Injection inj) {
    const int n = injection_terms(inj);
    return {round_bf16(lam[0]), round_bf16(lam[1]), n >= 1 ? round_bf16(lam[2]) : 0.0,
            n >= 2 ? round_bf16(lam[3]) : 0.0, inj};
}
V ref_sublayer(const V& x, const V& y, const V& x0, const V& xb, const Sublayer& m, V* magnitude) {
    V out(x.size());
    if (magnitude) magnitude->resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) {
        out[i] = m.r * x[i] + m.p * y[i] + m.l * x0[i] + m.b * xb[i];
        if (magnitude)
            (*magnitude)[i] = std::fabs(m.r * x[i]) + std::fabs(m.p * y[i]) + std::fabs(m.l * x0[i]) +
                              std::fabs(m.b * xb[i]);
    }
    return out;
}
struct SublayerGrads {
    V dx, dy, dx0, dxb, magnitude;  // magnitude: of each element's total gradient gm
    double d[4] = {0, 0, 0, 0}, mag[4] = {0, 0, 0, 0};  // resid, post, x0, bigram: exact sums, their magnitudes
};
// g: the gradient of the sublayer output as the stream; dh: of its norm (empty: no norm); xo: the stream
// the norm read (the kernel's stored one).
SublayerGrads ref_sublayer_backward(const V& g, const V& dh, const V& xo, const V& x, const V& y, const V& x0,
                                    const V& xb, const Sublayer& m, int T, int C) {
    V gn(g.size(), 0.0), gmag(g.size(), 0.0);
    if (!dh.empty()) test::ref_rmsnorm_backward(dh, xo, T, C, gn, gmag);
    SublayerGrads o;
    for (V* v : {&o.dx, &o.dy, &o.dx0, &o.dxb, &o.magnitude}) v->resize(g.size());
    for (size_t i = 0; i < g.size(); ++i) {
        const double gm = g[i] + gn[i], mag = std::fabs(g[i]) + gmag[i];
        o.dx[i] = m.r * gm;
        o.dy[i] = m.p * gm;
        o.dx0[i] = m.l * gm;
        o.dxb[i] = m.b * gm;
        o.magnitude[i] = mag;
        const double* in[4] = {&x[i], &y[i], &x0[i], &xb[i]};
        for (int v = 0; v < 4; ++v) {
            o.d[v] += gm * *in[v];
            o.mag[v] += mag * std::fabs(*in[v]);
        }
    }
    return o;
}
// A lambda's gradient: the exact sum rounded to bf16 (added to `base` in fp32). The kernel's fp32 sum is
// within 1e-5 of its terms' magnitude; where that interval straddles a bf16 rounding boundary either
// neighbour is right, so the check allows the bf16 step there; elsewhere the bits must match.
bool check_lambda_grad(const std::string& what, float got, double base, double sum, double magnitude) {
    const double err = 1e-5 * magnitude + 1e-30;
    const double lo = round_bf16(sum - err), hi = round_bf16(sum + err);
    const bool ok = (got == static_cast<float>(base + lo) || got == static_cast<float>(base + hi) ||
                     (lo != hi && got >= static_cast<float>(base + std::min(lo, hi)) &&
                      got <= static_cast<float>(base + std::max(lo, hi))));
    return test::check(ok, "%s: got %.9g, want %.9g + bf16(%.9g) (bf16 neighbours %.9g, %.9g)", what.c_str(), got,
                       base, sum, lo, hi);
}
const char* injection_name(Injection inj) {
    return inj == Injection::none ? " (MLP)" : inj == Injection::x0 ? " (layer 0 attention)" : " (attention)";
}

// norms: how many blocks read the norm of the output (0: none, not fused; 3: h7 and layers 8-10).
void check_sublayer(const Shape& s, Injection inj, int norms) {
    const std::string at = s.name() + injection_name(inj) + " with " + std::to_string(norms) + " norm readers";
    const bool norm = norms > 0;
    const int terms = injection_terms(inj);
    const auto x = normal_bf16(s.n()), y = normal_bf16(s.n(), 0.0, 2.0), x0 = normal_bf16(s.n());
    const auto xb = normal_bf16(s.n(), 0.0, 0.5), g = normal_bf16(s.n());
    std::vector<std::vector<bf16>> dhs;
    V dh_sum(norm ? s.n() : 0, 0.0);
    for (int j = 0; j < norms; ++j) {
        dhs.push_back(normal_bf16(s.n()));
        for (size_t i = 0; i < s.n(); ++i) dh_sum[i] += __bfloat162float(dhs.back()[i]);
    }
    const auto old_dx = normal_bf16(s.n()), old_dx0 = normal_bf16(s.n()), old_dxb = normal_bf16(s.n());
    const std::vector<float> lam = {lambda_off_grid(0.8, 1.3), lambda_off_grid(0.5, 1.5), lambda_off_grid(-0.5, 0.5),
                                    lambda_off_grid(-0.3, 0.3)};
    const std::vector<float> old_grads = {random_float(-1, 1), random_float(-1, 1), random_float(-1, 1),
                                          random_float(-1, 1)};
    const Sublayer m = sublayer_of(lam, inj);
    const V xd = values(x), yd = values(y), x0d = values(x0), xbd = values(xb);

    DeviceBuffer<bf16> d_x(x), d_y(y), d_x0(x0), d_xb(xb), d_g(g), d_xo(s.n()), d_h(s.n());
    DeviceBuffer<bf16> d_dx(s.n()), d_dy(s.n()), d_dx0(s.n()), d_dxb(s.n());
    std::vector<bf16> dh_all;  // the readers' gradients one after another, each 16-byte aligned (C % 8 == 0)
    for (const auto& d : dhs) dh_all.insert(dh_all.end(), d.begin(), d.end());
    DeviceBuffer<bf16> d_dhs(norm ? dh_all : std::vector<bf16>(8));
    NormGrads dh{};
    for (int j = 0; j < norms; ++j) dh.dh[j] = d_dhs.ptr + j * s.n();
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(4);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const SublayerLambdas lambdas{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2, d_lam.ptr + 3};
    const SublayerLambdaGrads grads{d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2, d_grads.ptr + 3};
    // the terms not injected get no pointers: the kernels must not read them
    const bf16* x0_in = terms >= 1 ? d_x0.ptr : nullptr;
    const bf16* xb_in = terms >= 2 ? d_xb.ptr : nullptr;

    sublayer_residual_forward(d_xo.ptr, norm ? d_h.ptr : nullptr, norm ? d_rstd.ptr : nullptr, d_x.ptr, d_y.ptr, x0_in,
                              xb_in, lambdas, inj, s.T, s.C, nullptr);
    V mag;
    const V xo_ref = ref_sublayer(xd, yd, x0d, xbd, m, &mag);
    const V xod = values(d_xo.download());
    check_within("sublayer_residual_forward x" + at, xod, xo_ref, bf16_tol(xo_ref, mag));
    if (norm) check_fused_norm("sublayer_residual_forward", at, xod, d_h, d_rstd, s);

    const SublayerGrads want = ref_sublayer_backward(values(g), dh_sum, xod, xd, yd, x0d, xbd, m, s.T, s.C);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx.upload(old_dx);
        d_dy.upload(old_dx);  // overwritten either way
        d_dx0.upload(old_dx0);
        d_dxb.upload(old_dxb);
        d_grads.upload(old_grads);
        const SublayerBackwardOptions o{.injection = inj, .accumulate_dx = acc, .accumulate_x0_grads = acc,
                                        .accumulate_lambda_grads = acc};
        sublayer_residual_backward(d_dx.ptr, d_dy.ptr, terms >= 1 ? d_dx0.ptr : nullptr,
                                   terms >= 2 ? d_dxb.ptr : nullptr, grads, d_scratch.view(), d_g.ptr,
                                   dh, d_xo.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, x0_in, xb_in,
                                   lambdas, o, s.T, s.C, nullptr);
        const auto dx = d_dx.download(), dy = d_dy.download(), dx0 = d_dx0.download(), dxb = d_dxb.download();
        const auto pg = d_grads.download();
        const double coeff[4] = {m.r, m.p, m.l, m.b};
        const V* want_d[4] = {&want.dx, &want.dy, &want.dx0, &want.dxb};
        const std::vector<bf16>* got_d[4] = {&dx, &dy, &dx0, &dxb};
        const std::vector<bf16>* old_d[4] = {&old_dx, nullptr, &old_dx0, &old_dxb};
        const char* names[4] = {"dx", "dy", "dx0", "dx0_bigram"};
        for (int v = 0; v < 4; ++v) {
            if (v >= 2 + terms) {  // not injected: left alone
                test::check(same_bits(*got_d[v], *old_d[v]), "sublayer_residual_backward leaves %s alone%s", names[v],
                            how.c_str());
                continue;
            }
            const bool added = acc && v != 1;  // dy is always overwritten
            V w = *want_d[v], mg(s.n());
            for (size_t i = 0; i < s.n(); ++i) {
                mg[i] = std::fabs(coeff[v]) * want.magnitude[i];
                if (added) {
                    w[i] += __bfloat162float((*old_d[v])[i]);
                    mg[i] += std::fabs(__bfloat162float((*old_d[v])[i]));
                }
            }
            check_within(std::string("sublayer_residual_backward ") + names[v] + how, values(*got_d[v]), w,
                         bf16_tol(w, mg));
        }
        const char* lambda_names[4] = {"resid", "post", "x0", "bigram"};
        for (int v = 0; v < 4; ++v) {
            if (v >= 2 + terms) {
                test::check(pg[v] == old_grads[v], "sublayer_residual_backward leaves d %s_lambda alone%s",
                            lambda_names[v], how.c_str());
                continue;
            }
            check_lambda_grad(std::string("d ") + lambda_names[v] + "_lambda" + how, pg[v], acc ? old_grads[v] : 0.0,
                              want.d[v], want.mag[v]);
        }
        test::check(d_scratch.done.download()[0] == 0, "sublayer_residual_backward: ticket counter back at zero%s",
                    how.c_str());
        if (!acc) {  // the same call again gives the same bits
            d_dx.upload(old_dx);
            sublayer_residual_backward(d_dx.ptr, d_dy.ptr, terms >= 1 ? d_dx0.ptr : nullptr,
                                       terms >= 2 ? d_dxb.ptr : nullptr, grads, d_scratch.view(), d_g.ptr,
                                       dh, d_xo.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, x0_in, xb_in,
                                       lambdas, o, s.T, s.C, nullptr);
            test::check(same_bits(d_dx.download(), dx) && same_bits(d_dy.download(), dy) &&
                            same_bits(d_dx0.download(), dx0) && same_bits(d_dxb.download(), dxb) &&
                            same_bits(d_grads.download(), pg),
                        "sublayer_residual_backward reproducible%s", how.c_str());
        }
    }
    {  // in place: the stream's input gradient overwrites the gradient it came from
        DeviceBuffer<bf16> d_gdx(g);
        sublayer_residual_backward(d_gdx.ptr, d_dy.ptr, terms >= 1 ? d_dx0.ptr : nullptr,
                                   terms >= 2 ? d_dxb.ptr : nullptr, grads, d_scratch.view(), d_gdx.ptr,
                                   dh, d_xo.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, x0_in, xb_in,
                                   lambdas,
                                   {.injection = inj, .accumulate_dx = false, .accumulate_x0_grads = false,
                                    .accumulate_lambda_grads = false},
                                   s.T, s.C, nullptr);
        V mg(s.n());
        for (size_t i = 0; i < s.n(); ++i) mg[i] = std::fabs(m.r) * want.magnitude[i];
        check_within("sublayer_residual_backward dx in place" + at, values(d_gdx.download()), want.dx,
                     bf16_tol(want.dx, mg));
    }
}

// Exact data: every value k/8 (|k| <= 8) and lambdas whose bf16 roundings are m/64, so every product
// and sum is exact in fp32 (the gradients' sums over at most 2^18 elements too: each partial sum is a
// multiple of 1/64 below 2^18 in magnitude): the outputs must be the bf16 roundings of the exact values,
// bit for bit. The fp32 lambdas sit 0.45 bf16 steps off their roundings,
// so multiplying by the unrounded fp32 value, or storing a gradient's sum unrounded, changes bits.
std::vector<bf16> dyadic_bf16(size_t n, int most) {
    std::vector<bf16> v(n);
    for (auto& e : v) e = __float2bfloat16(test::randint(-most, most) / 8.0f);
    return v;
}
float lambda_near_grid(int sixty_fourths) {  // in [1, 2) the bf16 step is 1/128: 0.45 of it off m/64
    return static_cast<float>(sixty_fourths / 64.0 + (test::randint(0, 1) ? 1 : -1) * 0.45 / 128);
}
void check_sublayer_exact(const Shape& s, Injection inj) {
    const std::string at = s.name() + injection_name(inj) + " exact";
    const int terms = injection_terms(inj);
    const auto x = dyadic_bf16(s.n(), 8), y = dyadic_bf16(s.n(), 8), x0 = dyadic_bf16(s.n(), 8);
    const auto xb = dyadic_bf16(s.n(), 8), g = dyadic_bf16(s.n(), 8), old_dx = dyadic_bf16(s.n(), 8);
    const auto near = [] { return lambda_near_grid(test::randint(65, 127)); };
    const std::vector<float> lam = {near(), near(), -near(), near()};
    const std::vector<float> old_grads = {1.5f, -0.25f, 3.0f, 0.125f};
    const Sublayer m = sublayer_of(lam, inj);
    const V xd = values(x), yd = values(y), x0d = values(x0), xbd = values(xb);
    DeviceBuffer<bf16> d_x(x), d_y(y), d_x0(x0), d_xb(xb), d_g(g), d_xo(s.n()), d_h(s.n());
    DeviceBuffer<bf16> d_dx(s.n()), d_dy(s.n()), d_dx0(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(old_grads);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const SublayerLambdas lambdas{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2, d_lam.ptr + 3};
    const SublayerLambdaGrads grads{d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2, d_grads.ptr + 3};

    sublayer_residual_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, d_x0.ptr, d_xb.ptr, lambdas, inj, s.T,
                              s.C, nullptr);
    const V xo_ref = ref_sublayer(xd, yd, x0d, xbd, m, nullptr);
    V xo_bf(s.n());
    for (size_t i = 0; i < s.n(); ++i) xo_bf[i] = round_bf16(xo_ref[i]);
    check_within("sublayer_residual_forward x" + at, values(d_xo.download()), xo_bf, V(s.n(), 0.0));

    // no norm: gm = g exactly; the injected gradients accumulate onto old_dx (also dyadic: exact sums)
    const SublayerGrads want = ref_sublayer_backward(values(g), V{}, V{}, xd, yd, x0d, xbd, m, s.T, s.C);
    test::check(*std::max_element(want.mag, want.mag + 4) < (1 << 18), "exact data: sums below 2^18%s", at.c_str());
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx.upload(old_dx);
        d_dx0.upload(old_dx);
        d_dxb.upload(old_dx);
        d_grads.upload(old_grads);
        sublayer_residual_backward(d_dx.ptr, d_dy.ptr, d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_g.ptr,
                                   NormGrads{}, nullptr, nullptr, d_x.ptr, d_y.ptr, d_x0.ptr, d_xb.ptr, lambdas,
                                   {.injection = inj, .accumulate_dx = acc, .accumulate_x0_grads = acc,
                                    .accumulate_lambda_grads = acc},
                                   s.T, s.C, nullptr);
        const V* want_d[4] = {&want.dx, &want.dy, &want.dx0, &want.dxb};
        const DeviceBuffer<bf16>* got_d[4] = {&d_dx, &d_dy, &d_dx0, &d_dxb};
        const char* names[4] = {"dx", "dy", "dx0", "dx0_bigram"};
        for (int v = 0; v < 2 + terms; ++v) {
            V w(s.n());
            for (size_t i = 0; i < s.n(); ++i)
                w[i] = round_bf16((*want_d[v])[i] + (acc && v != 1 ? __bfloat162float(old_dx[i]) : 0.0));
            check_within(std::string("sublayer_residual_backward ") + names[v] + how, values(got_d[v]->download()), w,
                         V(s.n(), 0.0));
        }
        const auto pg = d_grads.download();
        const char* lambda_names[4] = {"resid", "post", "x0", "bigram"};
        for (int v = 0; v < 4; ++v) {
            const double w = v < 2 + terms ? (acc ? old_grads[v] : 0.0) + round_bf16(want.d[v]) : old_grads[v];
            test::check(pg[v] == static_cast<float>(w), "d %s_lambda%s: got %.9g, want %.9g (exact sum %.9g)",
                        lambda_names[v], how.c_str(), pg[v], w, want.d[v]);
        }
    }
}

// The stream before layer 0: x = x0 + lb*xb and its norm; backward into x0 and xb.
void check_stream_start(const Shape& s) {
    const std::string at = s.name();
    const auto x0 = normal_bf16(s.n()), xb = normal_bf16(s.n(), 0.0, 0.5), g = normal_bf16(s.n());
    const auto dh = normal_bf16(s.n()), old_dx0 = normal_bf16(s.n()), old_dxb = normal_bf16(s.n());
    const std::vector<float> lam = {lambda_off_grid(-0.5, 0.5)};
    const float old_grad = random_float(-1, 1);
    const Sublayer m{1.0, 0.0, 0.0, round_bf16(lam[0]), Injection::none};  // x0 as the stream, coefficient 1
    const V x0d = values(x0), xbd = values(xb), zero(s.n(), 0.0);
    DeviceBuffer<bf16> d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xo(s.n()), d_h(s.n()), d_dx0(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grad(1);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));

    stream_start_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x0.ptr, d_xb.ptr, d_lam.ptr, s.T, s.C, nullptr);
    V mag;
    const V xo_ref = ref_sublayer(x0d, zero, zero, xbd, m, &mag);
    const V xod = values(d_xo.download());
    check_within("stream_start_forward x" + at, xod, xo_ref, bf16_tol(xo_ref, mag));
    check_fused_norm("stream_start_forward", at, xod, d_h, d_rstd, s);

    const SublayerGrads want = ref_sublayer_backward(values(g), values(dh), xod, x0d, zero, zero, xbd, m, s.T, s.C);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx0.upload(old_dx0);
        d_dxb.upload(old_dxb);
        d_grad.upload(std::vector<float>{old_grad});
        stream_start_backward(d_dx0.ptr, d_dxb.ptr, d_grad.ptr, d_scratch.view(), d_g.ptr, d_dh.ptr, d_xo.ptr,
                              d_rstd.ptr, d_xb.ptr, d_lam.ptr,
                              {.accumulate_x0_grads = acc, .accumulate_lambda_grads = acc}, s.T, s.C, nullptr);
        V w0 = want.dx, wb = want.dxb, m0 = want.magnitude, mb(s.n());
        for (size_t i = 0; i < s.n(); ++i) {
            mb[i] = std::fabs(m.b) * want.magnitude[i];
            if (acc) {
                w0[i] += __bfloat162float(old_dx0[i]);
                wb[i] += __bfloat162float(old_dxb[i]);
                m0[i] += std::fabs(__bfloat162float(old_dx0[i]));
                mb[i] += std::fabs(__bfloat162float(old_dxb[i]));
            }
        }
        check_within("stream_start_backward dx0" + how, values(d_dx0.download()), w0, bf16_tol(w0, m0));
        check_within("stream_start_backward dx0_bigram" + how, values(d_dxb.download()), wb, bf16_tol(wb, mb));
        check_lambda_grad("stream_start_backward d bigram_lambda" + how, d_grad.download()[0], acc ? old_grad : 0.0,
                          want.d[3], want.mag[3]);
    }
}
// Record 81's MUDD at the last layer: per-token lambdas (SublayerLambdas::token_stride), each row its own, and the
// gradients per row (rounded to bf16, written at the same stride) instead of summed over rows. Against the double
// references row by row; lambdas at columns 8..11 of a 16-wide row (the MUDD coefficients' layout), the other
// columns of the gradient rows left as they were. bd: the bigram's width (0: every channel).
// gate (record 85, SublayerLambdas::injection_stride): only x0's and the bigram's coefficients per token, at columns
// 20 and 21 of a 48-wide row (the MUDD post gate's layer-5 pair, kMuddGateCoefStride), resid and post shared (fp32
// off the bf16 grid, their gradients summed over the rows and added to what they hold).
void check_sublayer_per_token(const Shape& s, Injection inj, int bd, bool norm, bool gate = false) {
    const std::string at = s.name() + injection_name(inj) + (gate ? " gate columns" : " per token") +
                           (norm ? " with its norm" : "") + (bd ? ", bigram_dim " + std::to_string(bd) : "");
    const int terms = injection_terms(inj), W = bd ? bd : s.C, stride = gate ? 48 : 16;
    // where lambda v (resid, post, x0, bigram) of a row is in the per-token rows; -1: shared
    const auto col_of = [&](int v) { return gate ? (v >= 2 ? 20 + v - 2 : -1) : 8 + v; };
    const size_t nb = size_t(s.T) * W;
    const auto x = normal_bf16(s.n()), y = normal_bf16(s.n(), 0.0, 2.0), x0 = normal_bf16(s.n());
    const auto xb = normal_bf16(nb, 0.0, 0.5), g = normal_bf16(s.n()), dh = normal_bf16(s.n());
    std::vector<float> lam(size_t(s.T) * stride), old_grads(lam.size());
    for (size_t i = 0; i < lam.size(); ++i) lam[i] = float(round_bf16(test::uniform(-1.5, 1.5))), old_grads[i] = random_float(-1, 1);
    DeviceBuffer<bf16> d_x(x), d_y(y), d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xo(s.n()), d_h(s.n());
    DeviceBuffer<bf16> d_dx(s.n()), d_dy(s.n()), d_dx0(s.n()), d_dxb(nb);
    const std::vector<float> shared = {lambda_off_grid(0.8, 1.3), lambda_off_grid(0.5, 1.5)};
    const std::vector<float> old_shared = {random_float(-1, 1), random_float(-1, 1)};
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(old_grads), d_shared(shared), d_shared_grads(old_shared);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const SublayerLambdas lambdas =
        gate ? SublayerLambdas{d_shared.ptr, d_shared.ptr + 1, d_lam.ptr + 20, d_lam.ptr + 21, 0, stride}
             : SublayerLambdas{d_lam.ptr + 8, d_lam.ptr + 9, d_lam.ptr + 10, d_lam.ptr + 11, stride};
    const SublayerLambdaGrads grads =
        gate ? SublayerLambdaGrads{d_shared_grads.ptr, d_shared_grads.ptr + 1, d_grads.ptr + 20, d_grads.ptr + 21}
             : SublayerLambdaGrads{d_grads.ptr + 8, d_grads.ptr + 9, d_grads.ptr + 10, d_grads.ptr + 11};
    const bf16* x0_in = terms >= 1 ? d_x0.ptr : nullptr;
    const bf16* xb_in = terms >= 2 ? d_xb.ptr : nullptr;
    sublayer_residual_forward(d_xo.ptr, norm ? d_h.ptr : nullptr, norm ? d_rstd.ptr : nullptr, d_x.ptr, d_y.ptr, x0_in,
                              xb_in, lambdas, inj, s.T, s.C, nullptr, bd);
    sublayer_residual_backward(d_dx.ptr, d_dy.ptr, d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_g.ptr,
                               norm ? NormGrads{{d_dh.ptr}} : NormGrads{}, d_xo.ptr, norm ? d_rstd.ptr : nullptr, d_x.ptr,
                               d_y.ptr, x0_in, xb_in, lambdas,
                               {.injection = inj, .accumulate_dx = false, .accumulate_x0_grads = false,
                                .accumulate_lambda_grads = gate, .bigram_dim = bd},
                               s.T, s.C, nullptr);
    const V xo = values(d_xo.download()), dxd = values(d_dx.download()), dyd = values(d_dy.download());
    const V dx0d = values(d_dx0.download()), dxbd = values(d_dxb.download());
    const std::vector<float> gd = d_grads.download();
    V want_xo, tol_xo, want_dx, tol_dx, want_dy, tol_dy, want_dx0, tol_dx0, want_dxb, tol_dxb;
    bool lambdas_ok = true, others_kept = true;
    double shared_d[2] = {0, 0}, shared_mag[2] = {0, 0};
    for (int t = 0; t < s.T; ++t) {
        const float* lt = &lam[size_t(t) * stride];
        const std::vector<float> row_lam = gate ? std::vector<float>{shared[0], shared[1], lt[20], lt[21]}
                                                : std::vector<float>{lt[8], lt[9], lt[10], lt[11]};
        const Sublayer m = sublayer_of(row_lam, inj);
        auto row = [&](const std::vector<bf16>& v) {
            V r(size_t(s.C));
            for (int c = 0; c < s.C; ++c) r[size_t(c)] = __bfloat162float(v[size_t(t) * s.C + c]);
            return r;
        };
        V xbw(s.C, 0.0);
        for (int c = 0; c < W && terms >= 2; ++c) xbw[c] = __bfloat162float(xb[size_t(t) * W + c]);
        V mag;
        const V xo_ref = ref_sublayer(row(x), row(y), terms >= 1 ? row(x0) : V(s.C, 0.0), xbw, m, &mag);
        const V xo_row(xo.begin() + long(t) * s.C, xo.begin() + long(t + 1) * s.C);
        const SublayerGrads w = ref_sublayer_backward(row(g), norm ? row(dh) : V{}, xo_row, row(x), row(y),
                                                      terms >= 1 ? row(x0) : V(s.C, 0.0), xbw, m, 1, s.C);
        for (int c = 0; c < s.C; ++c) {
            want_xo.push_back(xo_ref[c]), tol_xo.push_back(std::fabs(xo_ref[c]) / 128 + 1e-5 * mag[c]);
            want_dx.push_back(w.dx[c]), tol_dx.push_back(std::fabs(w.dx[c]) / 128 + 1e-5 * std::fabs(m.r) * w.magnitude[c]);
            want_dy.push_back(w.dy[c]), tol_dy.push_back(std::fabs(w.dy[c]) / 128 + 1e-5 * std::fabs(m.p) * w.magnitude[c]);
            if (terms >= 1)
                want_dx0.push_back(w.dx0[c]), tol_dx0.push_back(std::fabs(w.dx0[c]) / 128 + 1e-5 * std::fabs(m.l) * w.magnitude[c]);
            if (terms >= 2 && c < W)
                want_dxb.push_back(w.dxb[c]), tol_dxb.push_back(std::fabs(w.dxb[c]) / 128 + 1e-5 * std::fabs(m.b) * w.magnitude[c]);
        }
        for (int v = 0; v < 4; ++v) {
            if (col_of(v) < 0) {  // shared: summed over the rows
                shared_d[v] += w.d[v], shared_mag[v] += w.mag[v];
                continue;
            }
            const float got = gd[size_t(t) * stride + col_of(v)];
            if (v >= 2 + terms) {
                others_kept = others_kept && got == old_grads[size_t(t) * stride + col_of(v)];
                continue;
            }
            const double err = 1e-5 * w.mag[v] + 1e-30, lo = round_bf16(w.d[v] - err), hi = round_bf16(w.d[v] + err);
            lambdas_ok = lambdas_ok && got >= std::min(lo, hi) && got <= std::max(lo, hi);
        }
        for (int c = 0; c < stride; ++c) {
            bool written = false;
            for (int v = 0; v < 2 + terms; ++v) written = written || c == col_of(v);
            if (!written) others_kept = others_kept && gd[size_t(t) * stride + c] == old_grads[size_t(t) * stride + c];
        }
    }
    if (gate) {
        const auto sg = d_shared_grads.download();
        check_lambda_grad("sublayer_residual_backward d resid_lambda" + at, sg[0], old_shared[0], shared_d[0], shared_mag[0]);
        check_lambda_grad("sublayer_residual_backward d post_lambda" + at, sg[1], old_shared[1], shared_d[1], shared_mag[1]);
    }
    check_within("sublayer_residual_forward x" + at, xo, want_xo, tol_xo);
    check_within("sublayer_residual_backward dx" + at, dxd, want_dx, tol_dx);
    check_within("sublayer_residual_backward dy" + at, dyd, want_dy, tol_dy);
    if (terms >= 1) check_within("sublayer_residual_backward dx0" + at, dx0d, want_dx0, tol_dx0);
    if (terms >= 2) check_within("sublayer_residual_backward dxb" + at, dxbd, want_dxb, tol_dxb);
    test::check(lambdas_ok, "sublayer_residual_backward%s: each row's lambda gradients, its sums rounded to bf16", at.c_str());
    test::check(others_kept, "sublayer_residual_backward%s: the gradient rows' other columns untouched", at.c_str());
    if (norm) check_fused_norm("sublayer_residual_forward", at, xo, d_h, d_rstd, s);
}

// Record 84's aliasing: the stream start written over x0 in place (the same bits as out of place), and its
// backward with x0_is_stream: dx0 arrives holding the gradient of x0's readers, which is the stream start's
// too, so it reaches the bigram rows and the lambda: the reference is the plain backward of g + old dx0.
void check_stream_start_aliased(const Shape& s, int bd) {
    const std::string at = s.name() + " aliased, bigram_dim " + std::to_string(bd);
    const int W = bd ? bd : s.C;
    const size_t nb = size_t(s.T) * W;
    const auto x0 = normal_bf16(s.n()), xb = normal_bf16(nb, 0.0, 0.5), g = normal_bf16(s.n());
    const auto dh = normal_bf16(s.n()), old_dx0 = normal_bf16(s.n()), old_dxb = normal_bf16(nb);
    const std::vector<float> lam = {lambda_off_grid(-0.5, 0.5)};
    const float old_grad = random_float(-1, 1);
    DeviceBuffer<bf16> d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xo(s.n()), d_h(s.n()), d_h2(s.n()), d_dx0(old_dx0),
        d_dxb(old_dxb);
    DeviceBuffer<float> d_rstd(s.T), d_rstd2(s.T), d_lam(lam), d_grad(std::vector<float>{old_grad});
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    stream_start_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x0.ptr, d_xb.ptr, d_lam.ptr, s.T, s.C, nullptr, bd);
    stream_start_forward(d_x0.ptr, d_h2.ptr, d_rstd2.ptr, d_x0.ptr, d_xb.ptr, d_lam.ptr, s.T, s.C, nullptr, bd);
    const auto xo = d_xo.download();
    test::check(std::memcmp(xo.data(), d_x0.download().data(), s.n() * sizeof(bf16)) == 0 &&
                    std::memcmp(d_h.download().data(), d_h2.download().data(), s.n() * sizeof(bf16)) == 0,
                "stream_start_forward in place%s: the same bits as out of place", at.c_str());

    V wide_xb(s.n(), 0.0), gsum(s.n());
    for (int t = 0; t < s.T; ++t)
        for (int c = 0; c < W; ++c) wide_xb[size_t(t) * s.C + c] = __bfloat162float(xb[size_t(t) * W + c]);
    for (size_t i = 0; i < s.n(); ++i) gsum[i] = double(__bfloat162float(g[i])) + __bfloat162float(old_dx0[i]);
    const Sublayer m{1.0, 0.0, 0.0, round_bf16(lam[0]), Injection::none};
    const V zero(s.n(), 0.0);
    const SublayerGrads want = ref_sublayer_backward(gsum, values(dh), values(xo), values(x0), zero, zero, wide_xb, m,
                                                     s.T, s.C);
    stream_start_backward(d_dx0.ptr, d_dxb.ptr, d_grad.ptr, d_scratch.view(), d_g.ptr, d_dh.ptr, d_x0.ptr, d_rstd.ptr,
                          d_xb.ptr, d_lam.ptr,
                          {.accumulate_x0_grads = true, .accumulate_lambda_grads = true, .bigram_dim = bd,
                           .x0_is_stream = true},
                          s.T, s.C, nullptr);
    // dxb and the lambda's sum read the stream gradient rounded to bf16 (as autograd's sum of x's gradients
    // is): up to 2^-8 of it, beyond the usual tolerances
    V m0 = want.magnitude, wb(nb), mb(nb);
    for (size_t i = 0; i < s.n(); ++i) m0[i] += std::fabs(__bfloat162float(old_dx0[i]));
    double mag3 = want.mag[3];
    for (int t = 0; t < s.T; ++t)
        for (int c = 0; c < W; ++c) {
            const size_t i = size_t(t) * W + c, j = size_t(t) * s.C + c;
            wb[i] = want.dxb[j] + __bfloat162float(old_dxb[i]);
            mb[i] = std::fabs(m.b) * m0[j] + std::fabs(__bfloat162float(old_dxb[i]));
            mag3 += std::fabs(want.dx[j] * wide_xb[j]) / 256 / 1e-5;  // check_lambda_grad allows 1e-5 of it
        }
    V tb = bf16_tol(wb, mb);
    for (int t = 0; t < s.T; ++t)
        for (int c = 0; c < W; ++c) tb[size_t(t) * W + c] += std::fabs(m.b * want.dx[size_t(t) * s.C + c]) / 256;
    check_within("stream_start_backward dx0" + at, values(d_dx0.download()), want.dx, bf16_tol(want.dx, m0));
    check_within("stream_start_backward dx0_bigram" + at, values(d_dxb.download()), wb, tb);
    check_lambda_grad("stream_start_backward d bigram_lambda" + at, d_grad.download()[0], old_grad, want.d[3], mag3);
}
// Exact data as check_sublayer_exact, with dh = 0 (the norm's share is then exactly zero).
void check_stream_start_exact(const Shape& s) {
    const std::string at = s.name() + " exact";
    const auto x0 = dyadic_bf16(s.n(), 8), xb = dyadic_bf16(s.n(), 8), g = dyadic_bf16(s.n(), 8);
    const std::vector<float> lam = {-lambda_near_grid(test::randint(65, 127))};
    const Sublayer m{1.0, 0.0, 0.0, round_bf16(lam[0]), Injection::none};
    const V x0d = values(x0), xbd = values(xb), zero(s.n(), 0.0);
    DeviceBuffer<bf16> d_x0(x0), d_xb(xb), d_g(g), d_dh(std::vector<bf16>(s.n(), __float2bfloat16(0.0f)));
    DeviceBuffer<bf16> d_xo(s.n()), d_h(s.n()), d_dx0(s.n()), d_dxb(s.n());
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grad(std::vector<float>{0.75f});
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    stream_start_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x0.ptr, d_xb.ptr, d_lam.ptr, s.T, s.C, nullptr);
    const V xo_ref = ref_sublayer(x0d, zero, zero, xbd, m, nullptr);
    V xo_bf(s.n());
    for (size_t i = 0; i < s.n(); ++i) xo_bf[i] = round_bf16(xo_ref[i]);
    check_within("stream_start_forward x" + at, values(d_xo.download()), xo_bf, V(s.n(), 0.0));
    const SublayerGrads want = ref_sublayer_backward(values(g), V{}, V{}, x0d, zero, zero, xbd, m, s.T, s.C);
    stream_start_backward(d_dx0.ptr, d_dxb.ptr, d_grad.ptr, d_scratch.view(), d_g.ptr, d_dh.ptr, d_xo.ptr, d_rstd.ptr,
                          d_xb.ptr, d_lam.ptr, {.accumulate_x0_grads = false, .accumulate_lambda_grads = true}, s.T,
                          s.C, nullptr);
    V wb(s.n());
    for (size_t i = 0; i < s.n(); ++i) wb[i] = round_bf16(want.dxb[i]);
    check_within("stream_start_backward dx0" + at, values(d_dx0.download()), values(g), V(s.n(), 0.0));
    check_within("stream_start_backward dx0_bigram" + at, values(d_dxb.download()), wb, V(s.n(), 0.0));
    const float got = d_grad.download()[0], w = static_cast<float>(0.75 + round_bf16(want.d[3]));
    test::check(got == w, "stream_start_backward d bigram_lambda%s: got %.9g, want %.9g (exact sum %.9g)", at.c_str(),
                got, w, want.d[3]);
}

// Layer 6 of record 80: the gated skip add's bits, and the norm of what it stored.
// Record 84's narrow bigram (bigram_dim < C): xb and its gradient are (T, bigram_dim) and reach the stream's
// first bigram_dim channels only. Against the double references with xb widened by zeros; the narrow
// buffers are followed by a guard the kernels must not touch. `exact`: dyadic data and lambdas on m/64
// (check_sublayer_exact's), so every output must be the bf16 of the exact value, bit for bit.
void check_narrow_bigram(const Shape& s, int bd, bool exact) {
    const std::string at = s.name() + " bigram_dim=" + std::to_string(bd) + (exact ? " exact" : "");
    const size_t nb = size_t(s.T) * bd, guard = 64;
    auto data = [&](size_t n, double sd) { return exact ? dyadic_bf16(n, 8) : normal_bf16(n, 0.0, sd); };
    const auto x = data(s.n(), 1), y = data(s.n(), 2), x0 = data(s.n(), 1), g = data(s.n(), 1), dh = data(s.n(), 1);
    const auto xb = data(nb + guard, 0.5), old_dxb = data(nb + guard, 1), old = data(s.n(), 1);
    V xb_wide(s.n(), 0.0);  // xb widened by zeros: the reference's
    for (int t = 0; t < s.T; ++t)
        for (int c = 0; c < bd; ++c) xb_wide[size_t(t) * s.C + c] = __bfloat162float(xb[size_t(t) * bd + c]);
    auto lambda = [&](double lo, double hi) {
        return exact ? lambda_near_grid(test::randint(65, 127)) * (lo < 0 ? -1 : 1) : lambda_off_grid(lo, hi);
    };
    const std::vector<float> lam = {lambda(0.8, 1.3), lambda(0.5, 1.5), lambda(-0.5, 0.5), lambda(-0.3, 0.3)};
    const Sublayer m = sublayer_of(lam, Injection::x0_and_bigram);
    const V xd = values(x), yd = values(y), x0d = values(x0), zero(s.n(), 0.0);
    DeviceBuffer<bf16> d_x(x), d_y(y), d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xo(s.n()), d_h(s.n());
    DeviceBuffer<bf16> d_dx(s.n()), d_dy(s.n()), d_dx0(s.n()), d_dxb(nb + guard);
    DeviceBuffer<float> d_rstd(s.T), d_lam(lam), d_grads(4);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const SublayerLambdas lambdas{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2, d_lam.ptr + 3};
    const SublayerLambdaGrads grads{d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2, d_grads.ptr + 3};
    // out: the narrow (T, bd) part of a widened (T, C) tensor
    auto narrow = [&](const V& wide) {
        V out(nb);
        for (int t = 0; t < s.T; ++t)
            for (int c = 0; c < bd; ++c) out[size_t(t) * bd + c] = wide[size_t(t) * s.C + c];
        return out;
    };
    auto check_out = [&](const std::string& what, const V& got, const V& want, const V& mag) {
        if (!exact) return check_within(what, got, want, bf16_tol(want, mag));
        V w(want.size());
        for (size_t i = 0; i < w.size(); ++i) w[i] = round_bf16(want[i]);
        return check_within(what, got, w, V(w.size(), 0.0));
    };
    auto guard_intact = [&](const std::string& what) {
        const auto got = d_dxb.download();
        test::check(std::equal(got.begin() + nb, got.end(), old_dxb.begin() + nb,
                               [](bf16 a, bf16 b) { return __bfloat16_as_ushort(a) == __bfloat16_as_ushort(b); }),
                    "%s: the bigram gradient's guard past (T, bigram_dim) is untouched%s", what.c_str(), at.c_str());
    };

    // the attention sublayer's update and its norm
    sublayer_residual_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, d_x0.ptr, d_xb.ptr, lambdas,
                              Injection::x0_and_bigram, s.T, s.C, nullptr, bd);
    V mag;
    const V xo_ref = ref_sublayer(xd, yd, x0d, xb_wide, m, &mag);
    const V xod = values(d_xo.download());
    check_out("sublayer_residual_forward x narrow bigram" + at, xod, xo_ref, mag);
    const bool norm = !exact;  // the exact case has no norm (gm = g exactly)
    const SublayerGrads want = ref_sublayer_backward(values(g), norm ? values(dh) : V{}, xod, xd, yd, x0d, xb_wide, m,
                                                     s.T, s.C);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        const std::vector<float> old_grads = {1.5f, -0.25f, 3.0f, 0.125f};
        d_dx.upload(old), d_dx0.upload(old), d_dxb.upload(old_dxb), d_grads.upload(old_grads);
        sublayer_residual_backward(d_dx.ptr, d_dy.ptr, d_dx0.ptr, d_dxb.ptr, grads, d_scratch.view(), d_g.ptr,
                                   norm ? NormGrads{{d_dh.ptr}} : NormGrads{}, d_xo.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr,
                                   d_x0.ptr, d_xb.ptr, lambdas,
                                   {.injection = Injection::x0_and_bigram, .accumulate_dx = acc,
                                    .accumulate_x0_grads = acc, .accumulate_lambda_grads = acc, .bigram_dim = bd},
                                   s.T, s.C, nullptr);
        V wb = narrow(want.dxb), mb = narrow(want.magnitude);
        for (size_t i = 0; i < nb; ++i) {
            mb[i] *= std::fabs(m.b);
            if (acc) wb[i] += __bfloat162float(old_dxb[i]), mb[i] += std::fabs(__bfloat162float(old_dxb[i]));
        }
        const auto got_dxb = values(d_dxb.download());
        check_out("sublayer_residual_backward dx0_bigram narrow" + how, V(got_dxb.begin(), got_dxb.begin() + nb), wb, mb);
        guard_intact("sublayer_residual_backward");
        V w0 = want.dx0, m0(s.n());
        for (size_t i = 0; i < s.n(); ++i) {
            m0[i] = std::fabs(m.l) * want.magnitude[i];
            if (acc) w0[i] += __bfloat162float(old[i]), m0[i] += std::fabs(__bfloat162float(old[i]));
        }
        check_out("sublayer_residual_backward dx0 narrow bigram" + how, values(d_dx0.download()), w0, m0);
        const auto pg = d_grads.download();
        if (exact)
            test::check(pg[3] == static_cast<float>((acc ? old_grads[3] : 0.0) + round_bf16(want.d[3])),
                        "d bigram_lambda narrow%s: got %.9g, want %.9g", how.c_str(), pg[3], want.d[3]);
        else
            check_lambda_grad("d bigram_lambda narrow" + how, pg[3], acc ? old_grads[3] : 0.0, want.d[3], want.mag[3]);
    }

    // the stream before layer 0: x0 plus the bigram on the first bd channels, and its norm
    const Sublayer start{1.0, 0.0, 0.0, m.b, Injection::none};
    const float lb = lam[3];
    DeviceBuffer<float> d_lb(std::vector<float>{lb}), d_glb(1);
    stream_start_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x0.ptr, d_xb.ptr, d_lb.ptr, s.T, s.C, nullptr, bd);
    V smag;
    const V so_ref = ref_sublayer(x0d, zero, zero, xb_wide, start, &smag);
    const V sod = values(d_xo.download());
    check_out("stream_start_forward x narrow bigram" + at, sod, so_ref, smag);
    if (!exact) check_fused_norm("stream_start_forward narrow bigram", at, sod, d_h, d_rstd, s);
    const SublayerGrads sw = ref_sublayer_backward(values(g), values(dh), sod, x0d, zero, zero, xb_wide, start, s.T, s.C);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx0.upload(old), d_dxb.upload(old_dxb), d_glb.upload(std::vector<float>{0.5f});
        stream_start_backward(d_dx0.ptr, d_dxb.ptr, d_glb.ptr, d_scratch.view(), d_g.ptr, d_dh.ptr, d_xo.ptr,
                              d_rstd.ptr, d_xb.ptr, d_lb.ptr,
                              {.accumulate_x0_grads = acc, .accumulate_lambda_grads = acc, .bigram_dim = bd}, s.T, s.C,
                              nullptr);
        V wb = narrow(sw.dxb), mb = narrow(sw.magnitude);
        for (size_t i = 0; i < nb; ++i) {
            mb[i] *= std::fabs(start.b);
            if (acc) wb[i] += __bfloat162float(old_dxb[i]), mb[i] += std::fabs(__bfloat162float(old_dxb[i]));
        }
        const auto got_dxb = values(d_dxb.download());
        // the norm's backward is not exact on dyadic data: within bf16 either way
        check_within("stream_start_backward dx0_bigram narrow" + how, V(got_dxb.begin(), got_dxb.begin() + nb), wb,
                     bf16_tol(wb, mb));
        guard_intact("stream_start_backward");
        check_lambda_grad("stream_start_backward d bigram_lambda narrow" + how, d_glb.download()[0], acc ? 0.5 : 0.0,
                          sw.d[3], sw.mag[3]);
    }
}

void check_skip_norm(const Shape& s) {
    const std::string at = s.name();
    const auto x = normal_bf16(s.n()), skip = normal_bf16(s.n()), x0 = x0_rows(s), w = skip_gate_weights();
    const std::vector<float> lam = {random_float(-2, 0)};
    DeviceBuffer<bf16> d_x(x), d_skip(skip), d_x0(x0), d_w(w), d_plain(s.n()), d_out(s.n()), d_h(s.n());
    DeviceBuffer<float> d_lam(lam), d_rstd(s.T);
    gated_skip_add_forward(d_plain.ptr, d_x.ptr, d_skip.ptr, d_x0.ptr, d_w.ptr, d_lam.ptr, s.T, s.C, nullptr);
    gated_skip_add_norm_forward(d_out.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_skip.ptr, d_x0.ptr, d_w.ptr, d_lam.ptr, s.T,
                                s.C, nullptr);
    const auto out = d_out.download();
    test::check(same_bits(out, d_plain.download()),
                "gated_skip_add_norm_forward x: the bits of gated_skip_add_forward%s", at.c_str());
    check_fused_norm("gated_skip_add_norm_forward", at, values(out), d_h, d_rstd, s);
}

// The double reference's sublayer backward (both injections, three norm readers as h7 has) against
// central differences of its forward: loss = g . xo + sum_j dh_j . norm(xo).
void check_sublayer_finite_differences() {
    const Shape s{5, 16};
    const V g = values(normal_bf16(s.n())), dh1 = values(normal_bf16(s.n())), dh2 = values(normal_bf16(s.n()));
    const V dh3 = values(normal_bf16(s.n()));
    V x = values(normal_bf16(s.n())), y = values(normal_bf16(s.n())), x0 = values(normal_bf16(s.n()));
    V xb = values(normal_bf16(s.n(), 0.0, 0.5)), dh_sum(s.n());
    for (size_t i = 0; i < s.n(); ++i) dh_sum[i] = dh1[i] + dh2[i] + dh3[i];
    Sublayer m{random_float(0.8, 1.3), random_float(0.5, 1.5), random_float(-0.5, 0.5), random_float(-0.3, 0.3),
               Injection::x0_and_bigram};
    const SublayerGrads want =
        ref_sublayer_backward(g, dh_sum, ref_sublayer(x, y, x0, xb, m, nullptr), x, y, x0, xb, m, s.T, s.C);
    const auto loss = [&] {
        const V xo = ref_sublayer(x, y, x0, xb, m, nullptr);
        return dot(g, xo) + test::ref_rmsnorm_dot(dh1, xo, s.T, s.C) + test::ref_rmsnorm_dot(dh2, xo, s.T, s.C) +
               test::ref_rmsnorm_dot(dh3, xo, s.T, s.C);
    };
    double* lambda[4] = {&m.r, &m.p, &m.l, &m.b};
    const char* names[4] = {"resid", "post", "x0", "bigram"};
    for (int v = 0; v < 4; ++v)
        check_scalar(std::string("sublayer reference d ") + names[v] + "_lambda vs differences", want.d[v],
                     central_difference(*lambda[v], loss), kFdRtol * want.mag[v] + 1e-9);
    V* inputs[4] = {&x, &y, &x0, &xb};
    const V* grads[4] = {&want.dx, &want.dy, &want.dx0, &want.dxb};
    const char* input_names[4] = {"dx", "dy", "dx0", "dx0_bigram"};
    for (int v = 0; v < 4; ++v) {
        V fd(s.n()), tol(s.n());
        for (size_t i = 0; i < s.n(); ++i) {
            fd[i] = central_difference((*inputs[v])[i], loss);
            tol[i] = kFdRtol * want.magnitude[i] + 1e-9;
        }
        check_within(std::string("sublayer reference ") + input_names[v] + " vs differences", *grads[v], fd, tol);
    }
}

// ---- record 85: coefficients per token from the MUDD gate's columns (fp32 copies of bf16 values, 48 a row) ----
constexpr int kGateStride = 48;  // kernels/mudd.cuh's kMuddGateCoefStride
// A (T, 48) gate buffer: column `col` holds bf16 values in [lo, hi), the other columns values no kernel may read.
std::vector<float> gate_rows(int T, int col, double lo, double hi) {
    std::vector<float> v(size_t(T) * kGateStride);
    for (size_t i = 0; i < v.size(); ++i) v[i] = float(test::uniform(-1e4, 1e4));
    for (int t = 0; t < T; ++t) v[size_t(t) * kGateStride + col] = float(round_bf16(test::uniform(lo, hi)));
    return v;
}
bool others_untouched(const std::vector<float>& got, const std::vector<float>& old, int col) {
    for (size_t i = 0; i < got.size(); ++i)
        if (int(i % kGateStride) != col && std::memcmp(&got[i], &old[i], sizeof(float)) != 0) return false;
    return true;
}

// Per-token x0 and bigram coefficients that every row holds alike: the stream, its norm and every stream gradient
// have the bits of the shared-lambda kernels given those values (the option changes where a coefficient is read,
// nothing else).
void check_sublayer_gate_matches_shared(const Shape& s, Injection inj, int bd) {
    const std::string at = s.name() + injection_name(inj) + " gate columns alike, bigram_dim " + std::to_string(bd);
    const int W = bd ? bd : s.C;
    const auto x = normal_bf16(s.n()), y = normal_bf16(s.n()), x0 = normal_bf16(s.n()), xb = normal_bf16(size_t(s.T) * W);
    const auto g = normal_bf16(s.n()), dh = normal_bf16(s.n()), old = normal_bf16(s.n());
    const float l = float(round_bf16(test::uniform(-1, 1))), b = float(round_bf16(test::uniform(-1, 1)));
    const std::vector<float> lam = {lambda_off_grid(0.8, 1.3), lambda_off_grid(0.5, 1.5), l, b};
    std::vector<float> cols(size_t(s.T) * kGateStride, 0.0f);
    for (int t = 0; t < s.T; ++t) cols[size_t(t) * kGateStride + 18] = l, cols[size_t(t) * kGateStride + 19] = b;
    DeviceBuffer<float> d_lam(lam), d_cols(cols), d_grads(4), d_col_grads(cols.size()), d_rstd(s.T);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    const SublayerLambdas shared{d_lam.ptr, d_lam.ptr + 1, d_lam.ptr + 2, d_lam.ptr + 3};
    const SublayerLambdas token{d_lam.ptr, d_lam.ptr + 1, d_cols.ptr + 18, d_cols.ptr + 19, 0, kGateStride};
    DeviceBuffer<bf16> d_x(x), d_y(y), d_x0(x0), d_xb(xb), d_g(g), d_dh(dh);
    struct Out {
        std::vector<bf16> xo, h, dx, dy, dx0, dxb;
        std::vector<float> rstd;
    };
    const auto run = [&](const SublayerLambdas& lambdas, const SublayerLambdaGrads& grads) {
        DeviceBuffer<bf16> xo(s.n()), h(s.n()), dx(s.n()), dy(s.n()), dx0(old),
            dxb(std::vector<bf16>(old.begin(), old.begin() + long(s.T) * W));
        sublayer_residual_forward(xo.ptr, h.ptr, d_rstd.ptr, d_x.ptr, d_y.ptr, d_x0.ptr, d_xb.ptr, lambdas, inj, s.T, s.C,
                                  nullptr, bd);
        sublayer_residual_backward(dx.ptr, dy.ptr, dx0.ptr, dxb.ptr, grads, d_scratch.view(), d_g.ptr, {{d_dh.ptr}}, xo.ptr,
                                   d_rstd.ptr, d_x.ptr, d_y.ptr, d_x0.ptr, d_xb.ptr, lambdas,
                                   {.injection = inj, .accumulate_dx = false, .accumulate_x0_grads = true,
                                    .accumulate_lambda_grads = false, .bigram_dim = bd},
                                   s.T, s.C, nullptr);
        return Out{xo.download(), h.download(), dx.download(), dy.download(), dx0.download(), dxb.download(),
                   d_rstd.download()};
    };
    const Out a = run(shared, {d_grads.ptr, d_grads.ptr + 1, d_grads.ptr + 2, d_grads.ptr + 3});
    const auto shared_grads = d_grads.download();
    const Out c = run(token, {d_grads.ptr, d_grads.ptr + 1, d_col_grads.ptr + 18, d_col_grads.ptr + 19});
    test::check(same_bits(a.xo, c.xo) && same_bits(a.h, c.h) && same_bits(a.rstd, c.rstd) && same_bits(a.dx, c.dx) &&
                    same_bits(a.dy, c.dy) && same_bits(a.dx0, c.dx0) && same_bits(a.dxb, c.dxb),
                "sublayer_residual%s: the shared-lambda kernels' bits", at.c_str());
    const auto token_grads = d_grads.download();
    test::check(shared_grads[0] == token_grads[0] && shared_grads[1] == token_grads[1],
                "sublayer_residual_backward%s: resid's and post's gradients as with shared lambdas", at.c_str());
}

// Record 85's stream before layer 0: x = x0 + Gb0[t]*xb (the pre gate's column 19) and its norm; backward into x0,
// xb and each row's coefficient.
void check_stream_start_per_token(const Shape& s, int bd) {
    const std::string at = s.name() + " gate column, bigram_dim " + std::to_string(bd);
    const int W = bd ? bd : s.C, col = 19;
    const size_t nb = size_t(s.T) * W;
    const auto x0 = normal_bf16(s.n()), xb = normal_bf16(nb, 0.0, 0.5), g = normal_bf16(s.n()), dh = normal_bf16(s.n());
    const auto old_dx0 = normal_bf16(s.n()), old_dxb = normal_bf16(nb);
    const std::vector<float> cols = gate_rows(s.T, col, -1.5, 1.5), old_cols = gate_rows(s.T, col, -1, 1);
    DeviceBuffer<bf16> d_x0(x0), d_xb(xb), d_g(g), d_dh(dh), d_xo(s.n()), d_h(s.n()), d_dx0(s.n()), d_dxb(nb);
    DeviceBuffer<float> d_rstd(s.T), d_cols(cols), d_dcols(old_cols);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    stream_start_forward(d_xo.ptr, d_h.ptr, d_rstd.ptr, d_x0.ptr, d_xb.ptr, d_cols.ptr + col, s.T, s.C, nullptr, bd,
                         kGateStride);
    const V xo = values(d_xo.download());
    check_fused_norm("stream_start_forward", at, xo, d_h, d_rstd, s);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dx0.upload(old_dx0), d_dxb.upload(old_dxb), d_dcols.upload(old_cols);
        stream_start_backward(d_dx0.ptr, d_dxb.ptr, d_dcols.ptr + col, d_scratch.view(), d_g.ptr, d_dh.ptr, d_xo.ptr,
                              d_rstd.ptr, d_xb.ptr, d_cols.ptr + col,
                              {.accumulate_x0_grads = acc, .accumulate_lambda_grads = false, .bigram_dim = bd,
                               .token_stride = kGateStride},
                              s.T, s.C, nullptr);
        const V dx0 = values(d_dx0.download()), dxb = values(d_dxb.download());
        const std::vector<float> dcols = d_dcols.download();
        V w_xo, t_xo, w0, t0, wb, tb;
        bool coef_ok = true;
        for (int t = 0; t < s.T; ++t) {
            const double b = cols[size_t(t) * kGateStride + col];
            const Sublayer start{1.0, 0.0, 0.0, b, Injection::none};
            V r0(s.C), rb(s.C, 0.0), rg(s.C), rdh(s.C), zero(s.C, 0.0);
            for (int c = 0; c < s.C; ++c) {
                const size_t i = size_t(t) * s.C + c;
                r0[c] = __bfloat162float(x0[i]), rg[c] = __bfloat162float(g[i]), rdh[c] = __bfloat162float(dh[i]);
                if (c < W) rb[c] = __bfloat162float(xb[size_t(t) * W + c]);
            }
            V mag;
            const V ref = ref_sublayer(r0, zero, zero, rb, start, &mag);
            const V xo_row(xo.begin() + long(t) * s.C, xo.begin() + long(t + 1) * s.C);
            const SublayerGrads w = ref_sublayer_backward(rg, rdh, xo_row, r0, zero, zero, rb, start, 1, s.C);
            for (int c = 0; c < s.C; ++c) {
                const size_t i = size_t(t) * s.C + c;
                w_xo.push_back(ref[c]), t_xo.push_back(std::fabs(ref[c]) / 128 + 1e-5 * mag[c]);
                const double o0 = acc ? __bfloat162float(old_dx0[i]) : 0.0;
                w0.push_back(w.dx[c] + o0), t0.push_back(std::fabs(w.dx[c] + o0) / 128 + 1e-5 * (w.magnitude[c] + std::fabs(o0)));
                if (c < W) {
                    const double ob = acc ? __bfloat162float(old_dxb[size_t(t) * W + c]) : 0.0;
                    wb.push_back(w.dxb[c] + ob);
                    tb.push_back(std::fabs(w.dxb[c] + ob) / 128 + 1e-5 * (std::fabs(b) * w.magnitude[c] + std::fabs(ob)));
                }
            }
            const double err = 1e-5 * w.mag[3] + 1e-30, lo = round_bf16(w.d[3] - err), hi = round_bf16(w.d[3] + err);
            const float got = dcols[size_t(t) * kGateStride + col];
            coef_ok = coef_ok && got >= std::min(lo, hi) && got <= std::max(lo, hi);
        }
        if (!acc) check_within("stream_start_forward x" + at, xo, w_xo, t_xo);
        check_within("stream_start_backward dx0" + how, dx0, w0, t0);
        check_within("stream_start_backward dx0_bigram" + how, dxb, wb, tb);
        test::check(coef_ok, "stream_start_backward%s: each row's coefficient gradient, its sum rounded to bf16", how.c_str());
        test::check(others_untouched(dcols, old_cols, col), "stream_start_backward%s: the other columns untouched", how.c_str());
    }
}

// Record 85's skip into layer 6: out = x + sigmoid(lambda) G[t] skip; with the output's gradient g:
// d_skip = sigmoid(lambda) G[t] g, dG[t] = sigmoid(lambda) sum_c g skip, d lambda = sigmoid'(lambda) sum_t G[t] sum_c g skip.
// The forward multiplies by bf16(sigmoid(lambda)) (the kernel's rounding, as upstream's type promotion has it):
// `rounded` takes that value, the derivatives' checks the exact one.
struct TokenSkipGrads {
    V d_skip, d_skip_mag, dG, dG_mag;
    double dlambda = 0, dlambda_mag = 0, dlambda_rounding = 0;  // the last: what rounding each row's ds moves it by
};
V ref_token_skip(const V& x, const V& skip, const V& G, double lambda, int T, int C, V* magnitude, bool rounded = false) {
    V out(x.size());
    if (magnitude) magnitude->resize(x.size());
    const double sl = rounded ? round_bf16(sigmoid(lambda)) : sigmoid(lambda);
    for (int t = 0; t < T; ++t)
        for (int c = 0; c < C; ++c) {
            const size_t i = size_t(t) * C + c;
            const double a = sl * G[size_t(t)] * skip[i];
            out[i] = x[i] + a;
            if (magnitude) (*magnitude)[i] = std::fabs(x[i]) + std::fabs(a);
        }
    return out;
}
TokenSkipGrads ref_token_skip_backward(const V& g, const V& skip, const V& G, double lambda, int T, int C) {
    TokenSkipGrads o;
    const double sl = sigmoid(lambda), dsl = sl * (1 - sl);
    o.d_skip.resize(g.size()), o.d_skip_mag.resize(g.size()), o.dG.resize(size_t(T)), o.dG_mag.resize(size_t(T));
    for (int t = 0; t < T; ++t) {
        double ds = 0, mag = 0;
        for (int c = 0; c < C; ++c) {
            const size_t i = size_t(t) * C + c;
            o.d_skip[i] = sl * G[size_t(t)] * g[i], o.d_skip_mag[i] = std::fabs(o.d_skip[i]);
            ds += g[i] * skip[i], mag += std::fabs(g[i] * skip[i]);
        }
        o.dG[size_t(t)] = sl * ds, o.dG_mag[size_t(t)] = sl * mag;
        o.dlambda += dsl * G[size_t(t)] * ds, o.dlambda_mag += dsl * std::fabs(G[size_t(t)]) * mag;
        o.dlambda_rounding += dsl * std::fabs(G[size_t(t)] * ds) / 256;
    }
    return o;
}
void check_token_skip(const Shape& s) {
    const std::string at = s.name() + " gate column";
    const int col = 28;
    const auto x = normal_bf16(s.n()), skip = normal_bf16(s.n()), g = normal_bf16(s.n()), old = normal_bf16(s.n());
    const std::vector<float> cols = gate_rows(s.T, col, -1.0, 6.0), old_cols = gate_rows(s.T, col, -1, 1);
    float lambda = random_float(-2.5, 1.0);
    // sigmoid(lambda) well inside a bf16 rounding interval: fp32's sigmoidf and the double one round alike
    const auto near_midpoint = [](double v) {
        int e;
        std::frexp(v, &e);  // v in [2^(e-1), 2^e): bf16's step there is 2^(e-8)
        return std::fabs(std::fabs(v - round_bf16(v)) / std::ldexp(1.0, e - 8) - 0.5) < 0.01;
    };
    while (near_midpoint(sigmoid(lambda))) lambda = random_float(-2.5, 1.0);
    const float old_dl = random_float(-1, 1);
    V G(s.T);
    for (int t = 0; t < s.T; ++t) G[size_t(t)] = cols[size_t(t) * kGateStride + col];
    DeviceBuffer<bf16> d_x(x), d_skip(skip), d_g(g), d_out(s.n()), d_h(s.n()), d_dskip(s.n());
    DeviceBuffer<float> d_cols(cols), d_dcols(old_cols), d_lam(std::vector<float>{lambda}), d_dl(1), d_rstd(s.T);
    DevicePartials d_scratch(residual_backward_scratch_bytes(s.T));
    token_skip_add_norm_forward(d_out.ptr, d_h.ptr, d_rstd.ptr, d_x.ptr, d_skip.ptr, d_cols.ptr + col, kGateStride,
                                d_lam.ptr, s.T, s.C, nullptr);
    V mag;
    const V ref = ref_token_skip(values(x), values(skip), G, lambda, s.T, s.C, &mag, true);
    const V out = values(d_out.download());
    check_within("token_skip_add_norm_forward x" + at, out, ref, bf16_tol(ref, mag));
    check_fused_norm("token_skip_add_norm_forward", at, out, d_h, d_rstd, s);
    const TokenSkipGrads want = ref_token_skip_backward(values(g), values(skip), G, lambda, s.T, s.C);
    for (bool acc : {false, true}) {
        const std::string how = at + (acc ? " accumulate" : "");
        d_dskip.upload(old), d_dcols.upload(old_cols), d_dl.upload(std::vector<float>{old_dl});
        const auto run = [&] {
            token_skip_add_backward(d_dskip.ptr, d_dcols.ptr + col, d_dl.ptr, d_scratch.view(), d_g.ptr, d_skip.ptr,
                                    d_cols.ptr + col, kGateStride, d_lam.ptr,
                                    {.accumulate_d_skip = acc, .accumulate_lambda_grad = acc}, s.T, s.C, nullptr);
        };
        run();
        V w = want.d_skip, m = want.d_skip_mag;
        for (size_t i = 0; i < s.n() && acc; ++i) w[i] += __bfloat162float(old[i]), m[i] += std::fabs(__bfloat162float(old[i]));
        const auto dskip = d_dskip.download();
        check_within("token_skip_add_backward d_skip" + how, values(dskip), w, bf16_tol(w, m));
        const std::vector<float> dcols = d_dcols.download();
        V dG(s.T), dG_tol(s.T);
        for (int t = 0; t < s.T; ++t) {
            dG[size_t(t)] = dcols[size_t(t) * kGateStride + col];
            dG_tol[size_t(t)] = std::fabs(want.dG[size_t(t)]) / 128 + 1e-5 * want.dG_mag[size_t(t)] + 1e-30;
        }
        check_within("token_skip_add_backward dG" + how, dG, want.dG, dG_tol);
        test::check(others_untouched(dcols, old_cols, col), "token_skip_add_backward%s: the other columns untouched", how.c_str());
        const float dl = d_dl.download()[0];
        // each row's ds rounded to bf16, and the sum over rows (before sigmoid') rounded to bf16
        check_scalar("token_skip_add_backward d skip_lambda" + how, dl, (acc ? old_dl : 0.0) + want.dlambda,
                     want.dlambda_rounding + std::fabs(want.dlambda) / 256 + 1e-5 * (want.dlambda_mag + std::fabs(old_dl)) + 1e-30);
        test::check(d_scratch.done.download()[0] == 0, "token_skip_add_backward%s: ticket counter back at zero", how.c_str());
        if (!acc) {
            run();
            test::check(same_bits(d_dskip.download(), dskip) && same_bits(d_dcols.download(), dcols) &&
                            d_dl.download()[0] == dl,
                        "token_skip_add_backward reproducible%s", how.c_str());
        }
    }
}
// The token skip's reference backward against central differences of loss = g . out.
void check_token_skip_finite_differences() {
    const Shape s{5, 16};
    const V g = values(normal_bf16(s.n()));
    V x = values(normal_bf16(s.n())), skip = values(normal_bf16(s.n())), G(s.T);
    for (double& v : G) v = test::uniform(-1, 6);
    double lambda = test::uniform(-2.5, 1.0);
    const TokenSkipGrads want = ref_token_skip_backward(g, skip, G, lambda, s.T, s.C);
    const auto loss = [&] { return dot(g, ref_token_skip(x, skip, G, lambda, s.T, s.C, nullptr)); };
    check_scalar("token skip reference d skip_lambda vs differences", want.dlambda, central_difference(lambda, loss),
                 kFdRtol * want.dlambda_mag + 1e-9);
    V fd_G(s.T), tol_G(s.T);
    for (int t = 0; t < s.T; ++t)
        fd_G[size_t(t)] = central_difference(G[size_t(t)], loss), tol_G[size_t(t)] = kFdRtol * want.dG_mag[size_t(t)] + 1e-9;
    check_within("token skip reference dG vs differences", want.dG, fd_G, tol_G);
    V fd_skip(s.n()), fd_x(s.n()), tol(s.n());
    for (size_t i = 0; i < s.n(); ++i) {
        fd_skip[i] = central_difference(skip[i], loss), fd_x[i] = central_difference(x[i], loss);
        tol[i] = kFdRtol * (want.d_skip_mag[i] + std::fabs(g[i])) + 1e-9;
    }
    check_within("token skip reference d_skip vs differences", want.d_skip, fd_skip, tol);
    check_within("token skip: x's gradient is the output's (g) vs differences", g, fd_x, tol);
}

// ---- benchmark: every residual-stream launcher as a middle layer calls it ----
int bench_residual(const bench::Options& o) {
    bench::Bench b(o);
    const Shape s{b.preset().T(), b.preset().C};
    const std::string at = bench::fmt("T=%d C=%d", s.T, s.C);
    DeviceBuffer<bf16> x(normal_bf16(s.n())), x0(x0_rows(s)), xb(normal_bf16(s.n(), 0.0, 0.5)), y(normal_bf16(s.n())),
        g(normal_bf16(s.n())), dh(normal_bf16(s.n())), w(skip_gate_weights()), out(s.n()), h(s.n()), dx(s.n()),
        dx0(s.n()), dxb(s.n()), dw(kGateWidth);
    DeviceBuffer<float> rstd(s.T), lam(std::vector<float>{1.1f, 0.5f, 0.1f}), grads(3);
    DevicePartials scratch(residual_backward_scratch_bytes(s.T));
    const MixLambdas lambdas{lam.ptr, lam.ptr + 1, lam.ptr + 2};
    b.run("residual_mix_forward", at, [&](cudaStream_t st) {
        residual_mix_forward(out.ptr, h.ptr, rstd.ptr, x.ptr, x0.ptr, xb.ptr, lambdas, false, s.T, s.C, st);
    });
    b.run("residual_mix_backward", at, [&](cudaStream_t st) {
        residual_mix_backward(dx.ptr, dx0.ptr, dxb.ptr, {grads.ptr, grads.ptr + 1, grads.ptr + 2}, scratch.view(), g.ptr,
                              dh.ptr, out.ptr, rstd.ptr, x.ptr, x0.ptr, xb.ptr, lambdas,
                              {.first_layer = false, .accumulate_dx = false, .accumulate_x0_grads = true,
                               .accumulate_lambda_grads = true},
                              s.T, s.C, st);
    });
    b.run("gated_skip_add_forward", at, [&](cudaStream_t st) {
        gated_skip_add_forward(out.ptr, x.ptr, y.ptr, x0.ptr, w.ptr, lam.ptr, s.T, s.C, st);
    });
    b.run("gated_skip_add_backward", at, [&](cudaStream_t st) {
        gated_skip_add_backward(dx.ptr, dx0.ptr, dw.ptr, grads.ptr, scratch.view(), g.ptr, y.ptr, x0.ptr, w.ptr, lam.ptr,
                                {.accumulate_d_skip = false, .accumulate_param_grads = true}, s.T, s.C, st);
    });
    b.run("residual_add_forward", at + " with norm", [&](cudaStream_t st) {
        residual_add_forward(out.ptr, h.ptr, rstd.ptr, x.ptr, y.ptr, s.T, s.C, st);
    });
    b.run("residual_add_forward", at + " without norm",
          [&](cudaStream_t st) { residual_add_forward(out.ptr, nullptr, nullptr, x.ptr, y.ptr, s.T, s.C, st); });
    b.run("residual_add_backward", at,
          [&](cudaStream_t st) { residual_add_backward(dx.ptr, dh.ptr, out.ptr, rstd.ptr, s.T, s.C, st); });
    b.run("backout_forward", at, [&](cudaStream_t st) {
        backout_forward(out.ptr, h.ptr, rstd.ptr, x.ptr, y.ptr, lam.ptr, s.T, s.C, st);
    });
    b.run("backout_backward", at, [&](cudaStream_t st) {
        backout_backward(dx.ptr, dxb.ptr, grads.ptr, scratch.view(), dh.ptr, out.ptr, rstd.ptr, y.ptr, lam.ptr, true, s.T,
                         s.C, st);
    });
    // record 80: an attention sublayer (both injections) with its norm, and layer 7's MLP with h7's three readers
    DeviceBuffer<float> lam4(std::vector<float>{1.05f, 1.0f, 0.1f, 0.05f}), grads4(4);
    const SublayerLambdas sub{lam4.ptr, lam4.ptr + 1, lam4.ptr + 2, lam4.ptr + 3};
    const SublayerLambdaGrads sub_grads{grads4.ptr, grads4.ptr + 1, grads4.ptr + 2, grads4.ptr + 3};
    b.run("sublayer_residual_forward", at + " attention", [&](cudaStream_t st) {
        sublayer_residual_forward(out.ptr, h.ptr, rstd.ptr, x.ptr, y.ptr, x0.ptr, xb.ptr, sub, Injection::x0_and_bigram,
                                  s.T, s.C, st);
    });
    b.run("sublayer_residual_backward", at + " attention", [&](cudaStream_t st) {
        sublayer_residual_backward(dx.ptr, dxb.ptr, dx0.ptr, out.ptr, sub_grads, scratch.view(), g.ptr, {dh.ptr},
                                   h.ptr, rstd.ptr, x.ptr, y.ptr, x0.ptr, xb.ptr, sub,
                                   {.injection = Injection::x0_and_bigram, .accumulate_dx = false,
                                    .accumulate_x0_grads = true, .accumulate_lambda_grads = true},
                                   s.T, s.C, st);
    });
    b.run("sublayer_residual_backward", at + " MLP, 3 norm readers", [&](cudaStream_t st) {
        sublayer_residual_backward(dx.ptr, dxb.ptr, nullptr, nullptr, sub_grads, scratch.view(), g.ptr,
                                   {dh.ptr, y.ptr, x0.ptr}, h.ptr, rstd.ptr, x.ptr, y.ptr, nullptr, nullptr, sub,
                                   {.injection = Injection::none, .accumulate_dx = true, .accumulate_x0_grads = false,
                                    .accumulate_lambda_grads = true},
                                   s.T, s.C, st);
    });
    b.run("stream_start_forward", at, [&](cudaStream_t st) {
        stream_start_forward(out.ptr, h.ptr, rstd.ptr, x0.ptr, xb.ptr, lam4.ptr + 3, s.T, s.C, st);
    });
    b.run("stream_start_backward", at, [&](cudaStream_t st) {
        stream_start_backward(dx0.ptr, dxb.ptr, grads4.ptr + 3, scratch.view(), g.ptr, dh.ptr, out.ptr, rstd.ptr,
                              xb.ptr, lam4.ptr + 3, {.accumulate_x0_grads = true, .accumulate_lambda_grads = true},
                              s.T, s.C, st);
    });
    b.run("gated_skip_add_norm_forward", at, [&](cudaStream_t st) {
        gated_skip_add_norm_forward(out.ptr, h.ptr, rstd.ptr, x.ptr, y.ptr, x0.ptr, w.ptr, lam.ptr, s.T, s.C, st);
    });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_residual(*o);
    test::seed();
    // bad input: a child process must exit non-zero (forked before emu starts its threads)
    test::check_fails_with("a bigram width that is no multiple of 8", "bigram_dim 12 must be 0 (every channel) or a multiple of 8", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        const float* l = reinterpret_cast<const float*>(16);
        stream_start_forward(p, p, reinterpret_cast<float*>(16), p, p, l, 4, 64, nullptr, 12);
    });
    test::check_fails_with("a bigram wider than the stream", "bigram_dim 72 must be 0 (every channel)", [] {
        bf16* p = reinterpret_cast<bf16*>(16);
        const float* l = reinterpret_cast<const float*>(16);
        sublayer_residual_forward(p, nullptr, nullptr, p, p, p, p, {l, l, l, l}, Injection::x0_and_bigram, 4, 64, nullptr,
                                  72);
    });
    test::check(residual_backward_scratch_bytes(1) == 13 * sizeof(float) &&
                    residual_backward_scratch_bytes(1 << 20) == 13 * sizeof(float) * kResidualMaxBackwardBlocks,
                "scratch sized for 13 partial sums per block, blocks capped");
    // tiny preset rows (256 and 1024), record width with full and ragged row counts, a narrow width, and a
    // row count past the partial-sum block cap (warps loop over several rows)
    const Shape shapes[] = {{256, 128}, {1024, 128}, {48, 768}, {37, 768}, {9, 16}, {8300, 128}};
    for (const Shape& s : shapes) {
        check_mix(s, false);
        check_mix(s, true);
        check_skip(s);
        check_add(s);
        check_backout(s);
        // record 80; the exact checks need every gradient's sum below 2^18 (at most 2^18 elements)
        const bool exact = s.n() <= (size_t(1) << 18);
        for (Injection inj : {Injection::none, Injection::x0, Injection::x0_and_bigram}) {
            if (exact || inj == Injection::x0_and_bigram) check_sublayer(s, inj, 1);  // past the block cap: one
            if (exact) check_sublayer(s, inj, 0);
            if (exact) check_sublayer_exact(s, inj);
        }
        if (exact) check_sublayer(s, Injection::none, 3);  // layer 7's MLP: h7's norm read by layers 8-10
        check_stream_start(s);
        for (const int bd : {8, s.C / 2 + 8, s.C}) {  // record 84's narrow bigram (192 of 768), and the full width
            if (bd > s.C || bd % 8) continue;
            check_narrow_bigram(s, bd, false);
            if (exact) check_narrow_bigram(s, bd, true);
        }
        if (exact) check_stream_start_exact(s);
        for (const int bd : {0, 8}) check_stream_start_aliased(s, bd);
        // record 81's last layer: the attention update (narrow bigram) and the MLP's, with its norm (past the block
        // cap, where a warp takes several rows, the MLP's only)
        if (s.T <= 1024) {
            check_sublayer_per_token(s, Injection::x0_and_bigram, s.C >= 16 ? 8 : 0, false);
            check_sublayer_per_token(s, Injection::x0_and_bigram, 0, true);
        }
        check_sublayer_per_token(s, Injection::none, 0, true);
        check_skip_norm(s);
        // record 85: x0's and the bigram's coefficients from the MUDD gate's columns (the full-width bigram and a
        // narrow one), the stream start's bigram coefficient, the per-token skip
        if (s.T <= 1024) {
            check_sublayer_per_token(s, Injection::x0_and_bigram, s.C, true, true);
            check_stream_start_per_token(s, s.C);
            check_token_skip(s);
            check_sublayer_per_token(s, Injection::x0, 0, false, true);
            if (s.C >= 16 && s.T <= 64) check_sublayer_per_token(s, Injection::x0_and_bigram, 8, false, true);
            check_sublayer_gate_matches_shared(s, Injection::x0_and_bigram, s.C);
        }
    }
    {  // record 85's per-row sums past the block cap, where a warp takes several rows: each row's starts from zero
        const Shape narrow_past_cap{8200, 16};
        check_sublayer_per_token(narrow_past_cap, Injection::x0_and_bigram, 16, true, true);
        check_stream_start_per_token(narrow_past_cap, 16);
    }
    check_mix_finite_differences(false);
    check_mix_finite_differences(true);
    check_skip_finite_differences();
    check_backout_finite_differences();
    check_add_finite_differences();
    check_sublayer_finite_differences();
    check_token_skip_finite_differences();
    return test::finish();
}
