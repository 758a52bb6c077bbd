// kernels/dc_mha.cuh (record 85's DC-MHA on layer 10): forward and backward against a plain double-precision
// reference written from the math (upstream 75d6867a dc_gate, d0f2bc46 dc_triton_kernels.py), at both head dims
// (D = 128: the record; D = 64: its CPU-sized twin), each on fresh random data over several document layouts
// (documents shorter than the 112-key window, a document start inside a window, a one-token document, T not a
// multiple of any tile), the reference's backward against central differences of its forward, bitwise determinism,
// the untouched coefficient columns, and bad inputs (other H or D).
//
// Tolerances, from the kernels' rounding points (each bounded by its magnitude sum, built beside the reference):
//   bf16's unit roundoff is 2^-8, and each bf16 rounding is allowed twice that (kU = 2^-7):
//   bf16 results rounded once: kU relative; dq, dk, dv: bf16(d + bf16(dc)), two such roundings;
//   w2 A and dS rounded to bf16 before their products: kU of sum |w2 A v| (resp. |dS k|, |dS q|, |w2 A go|);
//   dw1 rounded to bf16 before the rms backward: kU |dw1_i| carried through (e_i + |y_i| mean(e |y|)) / r;
//   fp32 sums and the fp32 scores (128 bf16 products, |score| up to ~15): 1e-4 of each sum's absolute terms.
// w1 = bf16(rms-normalised G) is a discrete rounding: the rows of G are drawn again until no w1 lies within 1e-5
// (relative) of a bf16 rounding boundary, so the kernel's fp32 rms and the reference's double one round alike.
#include "../../kernels/dc_mha.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

using bf16 = __nv_bfloat16;
using test::DeviceBuffer;
using test::round_bf16;
using test::same_bits;
using test::to_bf16;
using test::values;

constexpr int H = kDcHeads, W = 112, kStride = 48;  // kMuddGateCoefStride
constexpr int kW1 = 29, kW2 = 35;
constexpr double kU = 1.0 / 128;  // 2^-7: twice bf16's unit roundoff 2^-8 (round to nearest, 8 significant bits)

struct Problem {
    int T = 0, D = 128;  // D: the head dim, 128 (the record) or 64 (its CPU-sized twin)
    std::vector<int> cu;
    double scale = 0.125;
    std::vector<double> q, k, v, y, go, G, dq0, dk0, dv0;  // bf16 values (G: fp32 copies of bf16 values)
    size_t at(int t, int h, int d) const { return (static_cast<size_t>(t) * H + h) * D + d; }
    int doc_start(int t) const {
        int s = 0;
        for (int c : cu)
            if (c <= t) s = c;
        return s;
    }
};

std::vector<double> bf16_normal(size_t n, double std) {
    std::vector<double> x(n);
    for (auto& e : x) e = round_bf16(test::normal(0.0, std));
    return x;
}
// w1 within 1e-5 (relative) of a bf16 rounding boundary: the fp32 and double rms may round differently.
bool w1_ambiguous(const double* g) {
    double ms = 0;
    for (int h = 0; h < H; ++h) ms += g[kW1 + h] * g[kW1 + h];
    const double r = std::sqrt(ms / H + 1e-6);
    for (int h = 0; h < H; ++h) {
        const double y = g[kW1 + h] / r;
        if (round_bf16(y * (1 + 1e-5)) != round_bf16(y * (1 - 1e-5))) return true;
    }
    return false;
}
Problem make_problem(int T, std::vector<int> cu, int D) {
    Problem p;
    p.T = T;
    p.D = D;
    p.cu = std::move(cu);
    p.scale = static_cast<float>(test::uniform(0.1, 0.2));
    const size_t n = static_cast<size_t>(T) * H * D;
    p.q = bf16_normal(n, 1.0);
    p.k = bf16_normal(n, 1.0);
    p.v = bf16_normal(n, 1.0);
    p.y = bf16_normal(n, 1.0);
    p.go = bf16_normal(n, 1.0);
    p.dq0 = bf16_normal(n, 0.05);
    p.dk0 = bf16_normal(n, 0.05);
    p.dv0 = bf16_normal(n, 0.05);
    p.G = bf16_normal(static_cast<size_t>(T) * kStride, 1.0);
    for (int t = 0; t < T; ++t)
        while (w1_ambiguous(&p.G[static_cast<size_t>(t) * kStride]))
            for (int h = 0; h < H; ++h) p.G[static_cast<size_t>(t) * kStride + kW1 + h] = round_bf16(test::normal(0, 1));
    return p;
}

// ---- the double reference, with each result's tolerance (see the top) ----
struct Ref {
    std::vector<double> out, lse, dq, dk, dv, dG;  // dG: (T, kStride), columns 29..40 only
    std::vector<double> tol_out, tol_lse, tol_dq, tol_dk, tol_dv, tol_dG;
};
// round_w1: w1 rounded to bf16 as the model does (off for central differences, which need a smooth forward).
Ref reference(const Problem& p, bool round_w1, bool backward) {
    const int T = p.T, D = p.D;
    const size_t n = static_cast<size_t>(T) * H * D;
    Ref r;
    r.out = p.y;
    r.lse.assign(static_cast<size_t>(T) * H, 0);
    r.tol_out.assign(n, 0);
    r.tol_lse.assign(r.lse.size(), 0);
    r.dq.assign(n, 0);
    r.dk.assign(n, 0);
    r.dv.assign(n, 0);
    r.dG.assign(static_cast<size_t>(T) * kStride, 0);
    r.tol_dq.assign(n, 0);
    r.tol_dk.assign(n, 0);
    r.tol_dv.assign(n, 0);
    r.tol_dG.assign(r.dG.size(), 0);
    std::vector<double> mag_dq(n, 0), mag_dk(n, 0), mag_dv(n, 0), rnd_dq(n, 0), rnd_dk(n, 0), rnd_dv(n, 0);
    for (int t = 0; t < T; ++t) {
        const int nk = std::min(W, t - p.doc_start(t) + 1);
        const double* g = &p.G[static_cast<size_t>(t) * kStride];
        double ms = 0, w1[H], y1[H], w2[H];
        for (int h = 0; h < H; ++h) ms += g[kW1 + h] * g[kW1 + h];
        const double rms = std::sqrt(ms / H + 1e-6);
        for (int h = 0; h < H; ++h) {
            y1[h] = g[kW1 + h] / rms;
            w1[h] = round_w1 ? round_bf16(y1[h]) : y1[h];
            w2[h] = g[kW2 + h];
        }
        // magS: sum |q.k| per key (the scores' sizes); Am: sum_h |w1| P (A's, for its fp32 error: A may cancel)
        std::vector<double> P(H * nk), A(nk, 0), Am(nk, 0), magS(nk, 0);
        for (int h = 0; h < H; ++h) {
            double mx = -1e300;
            std::vector<double> sc(nk);
            for (int j = 0; j < nk; ++j) {
                double s = 0, m = 0;
                for (int d = 0; d < D; ++d) {
                    s += p.q[p.at(t, h, d)] * p.k[p.at(t - j, h, d)];
                    m += std::fabs(p.q[p.at(t, h, d)] * p.k[p.at(t - j, h, d)]);
                }
                sc[j] = p.scale * s;
                magS[j] = std::max(magS[j], p.scale * m);
                mx = std::max(mx, sc[j]);
            }
            double den = 0;
            for (int j = 0; j < nk; ++j) den += std::exp(sc[j] - mx);
            r.lse[static_cast<size_t>(t) * H + h] = mx + std::log(den);
            double worst = 0;
            for (int j = 0; j < nk; ++j) {
                P[h * nk + j] = std::exp(sc[j] - mx) / den;
                A[j] += w1[h] * P[h * nk + j];
                Am[j] += std::fabs(w1[h]) * P[h * nk + j];
                worst = std::max(worst, magS[j]);
            }
            r.tol_lse[static_cast<size_t>(t) * H + h] = 1e-5 * (1 + worst + std::fabs(r.lse[static_cast<size_t>(t) * H + h]));
        }
        for (int h = 0; h < H; ++h)
            for (int d = 0; d < D; ++d) {
                double s = 0, m = 0, ma = 0;
                for (int j = 0; j < nk; ++j) {
                    s += A[j] * p.v[p.at(t - j, h, d)];
                    m += std::fabs(A[j] * p.v[p.at(t - j, h, d)]);
                    ma += Am[j] * std::fabs(p.v[p.at(t - j, h, d)]);
                }
                const size_t i = p.at(t, h, d);
                r.out[i] += w2[h] * s;
                r.tol_out[i] = kU * std::fabs(r.out[i]) + std::fabs(w2[h]) * (kU * m + 1e-4 * ma) + 1e-7;
            }
        if (!backward) continue;
        // backward, query side
        std::vector<double> dm(H * nk), mdm(H * nk), dA(nk, 0), mdA(nk, 0);
        for (int h = 0; h < H; ++h)
            for (int j = 0; j < nk; ++j) {
                double s = 0, m = 0;
                for (int d = 0; d < D; ++d) {
                    s += p.go[p.at(t, h, d)] * p.v[p.at(t - j, h, d)];
                    m += std::fabs(p.go[p.at(t, h, d)] * p.v[p.at(t - j, h, d)]);
                }
                dm[h * nk + j] = s;
                mdm[h * nk + j] = m;
                dA[j] += w2[h] * s;
                mdA[j] += std::fabs(w2[h]) * m;
            }
        double gw1[H], e1[H];
        for (int h = 0; h < H; ++h) {
            double s1 = 0, s2 = 0, soft = 0, m1 = 0, m2 = 0, msoft = 0;
            for (int j = 0; j < nk; ++j) {
                const double pj = P[h * nk + j];
                s1 += dA[j] * pj;
                m1 += mdA[j] * pj;
                s2 += dm[h * nk + j] * A[j];
                m2 += mdm[h * nk + j] * Am[j];
                soft += w1[h] * dA[j] * pj;
                msoft += std::fabs(w1[h]) * mdA[j] * pj;
            }
            gw1[h] = s1;
            e1[h] = kU * std::fabs(s1) + 1e-4 * m1;
            r.dG[static_cast<size_t>(t) * kStride + kW2 + h] = s2;
            r.tol_dG[static_cast<size_t>(t) * kStride + kW2 + h] = kU * std::fabs(s2) + 1e-4 * m2 + 1e-7;
            for (int j = 0; j < nk; ++j) {
                const double pj = P[h * nk + j], ds = pj * (w1[h] * dA[j] - soft);
                // dS's fp32 error: its terms' sizes, and P's own relative error from the fp32 score
                const double mds = pj * (std::fabs(w1[h]) * mdA[j] + msoft) * (1 + magS[j]);
                for (int d = 0; d < D; ++d) {
                    const size_t iq = p.at(t, h, d), ik = p.at(t - j, h, d);
                    r.dq[iq] += p.scale * ds * p.k[ik];
                    r.dk[ik] += p.scale * ds * p.q[iq];
                    r.dv[ik] += w2[h] * A[j] * p.go[iq];
                    rnd_dq[iq] += p.scale * std::fabs(ds * p.k[ik]);
                    rnd_dk[ik] += p.scale * std::fabs(ds * p.q[iq]);
                    rnd_dv[ik] += std::fabs(w2[h] * A[j] * p.go[iq]);
                    mag_dv[ik] += std::fabs(w2[h] * p.go[iq]) * Am[j];
                    mag_dq[iq] += p.scale * mds * std::fabs(p.k[ik]);
                    mag_dk[ik] += p.scale * mds * std::fabs(p.q[iq]);
                }
            }
        }
        // through the rms normalisation: dG = (g - y1 mean(g y1)) / r
        double dot = 0, edot = 0;
        for (int h = 0; h < H; ++h) {
            dot += gw1[h] * y1[h];
            edot += e1[h] * std::fabs(y1[h]);
        }
        for (int h = 0; h < H; ++h) {
            const size_t i = static_cast<size_t>(t) * kStride + kW1 + h;
            r.dG[i] = (gw1[h] - y1[h] * dot / H) / rms;
            r.tol_dG[i] = kU * std::fabs(r.dG[i]) + (e1[h] + std::fabs(y1[h]) * edot / H) / rms + 1e-7;
        }
    }
    if (backward)
        for (size_t i = 0; i < n; ++i) {
            // the attention's gradients plus DC's (bf16(d + bf16(dc)): two roundings)
            const double q = r.dq[i], k = r.dk[i], v = r.dv[i];
            r.dq[i] = p.dq0[i] + q;
            r.dk[i] = p.dk0[i] + k;
            r.dv[i] = p.dv0[i] + v;
            r.tol_dq[i] = kU * (std::fabs(r.dq[i]) + std::fabs(q) + rnd_dq[i]) + 1e-4 * mag_dq[i] + 1e-7;
            r.tol_dk[i] = kU * (std::fabs(r.dk[i]) + std::fabs(k) + rnd_dk[i]) + 1e-4 * mag_dk[i] + 1e-7;
            r.tol_dv[i] = kU * (std::fabs(r.dv[i]) + std::fabs(v) + rnd_dv[i]) + 1e-4 * mag_dv[i] + 1e-7;
        }
    return r;
}

// ---- the kernels on a problem ----
struct Got {
    std::vector<bf16> out, out_val, dq, dk, dv;
    std::vector<float> lse, dG;
};
constexpr float kDGFill = 5.0f;  // what dcoefs holds before the backward: the unread columns keep it
Got run(const Problem& p, bool in_place) {
    const int T = p.T, D = p.D;
    std::vector<float> G(p.G.begin(), p.G.end());
    DeviceBuffer<bf16> q(to_bf16(p.q)), k(to_bf16(p.k)), v(to_bf16(p.v)), y(to_bf16(p.y)), go(to_bf16(p.go));
    DeviceBuffer<bf16> out(p.y.size()), out_val(p.y.size()), dq(to_bf16(p.dq0)), dk(to_bf16(p.dk0)), dv(to_bf16(p.dv0));
    DeviceBuffer<float> coefs(G), lse(static_cast<size_t>(T) * H);
    DeviceBuffer<float> dG(std::vector<float>(static_cast<size_t>(T) * kStride, kDGFill));
    DeviceBuffer<int> cu(p.cu);
    const size_t ws_bytes = dc_mha_backward_workspace_bytes(T);
    DeviceBuffer<unsigned char> ws(ws_bytes);
    CUDA_CHECK(cudaMemset(ws.ptr, 0xff, ws_bytes));  // NaNs: the key side must read only what the query side wrote
    const int ncu = static_cast<int>(p.cu.size());
    const float scale = static_cast<float>(p.scale);
    dc_mha_forward(out_val.ptr, nullptr, y.ptr, q.ptr, k.ptr, v.ptr, coefs.ptr, kStride, cu.ptr, ncu, T, H, D, scale,
                   nullptr);
    bf16* o = in_place ? y.ptr : out.ptr;
    dc_mha_forward(o, lse.ptr, y.ptr, q.ptr, k.ptr, v.ptr, coefs.ptr, kStride, cu.ptr, ncu, T, H, D, scale, nullptr);
    dc_mha_backward(dq.ptr, dk.ptr, dv.ptr, dG.ptr, go.ptr, q.ptr, k.ptr, v.ptr, lse.ptr, coefs.ptr, kStride, cu.ptr,
                    ncu, T, H, D, scale, ws.ptr, ws_bytes, nullptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    return Got{(in_place ? y : out).download(), out_val.download(), dq.download(), dk.download(), dv.download(),
               lse.download(), dG.download()};
}

std::vector<double> columns(const std::vector<double>& x, int T, int first, int count) {
    std::vector<double> c;
    for (int t = 0; t < T; ++t)
        for (int j = first; j < first + count; ++j) c.push_back(x[static_cast<size_t>(t) * kStride + j]);
    return c;
}

void check_layout(const char* name, int T, std::vector<int> cu, bool in_place, int D) {
    const Problem p = make_problem(T, std::move(cu), D);
    const Ref r = reference(p, true, true);
    const Got g = run(p, in_place);
    const std::string n = std::string(name) + " (T=" + std::to_string(T) + " D=" + std::to_string(D) + ")";
    const double e_out = test::check_within_scale(n + " out", values(g.out), r.out, r.tol_out, 1.0);
    test::check(same_bits(g.out, g.out_val), "%s: validation's out (no lse) has training's bits", n.c_str());
    test::check_within(n + " lse", values(g.lse), r.lse, r.tol_lse);
    const double e_dq = test::check_within_scale(n + " dq", values(g.dq), r.dq, r.tol_dq, 1.0);
    const double e_dk = test::check_within_scale(n + " dk", values(g.dk), r.dk, r.tol_dk, 1.0);
    const double e_dv = test::check_within_scale(n + " dv", values(g.dv), r.dv, r.tol_dv, 1.0);
    const std::vector<double> gd = values(g.dG);
    const double e_w1 = test::check_within_scale(n + " dG[29..34] (dw1 through the rms)", columns(gd, T, kW1, H),
                                                 columns(r.dG, T, kW1, H), columns(r.tol_dG, T, kW1, H), 1.0);
    const double e_w2 = test::check_within_scale(n + " dG[35..40] (dw2)", columns(gd, T, kW2, H),
                                                 columns(r.dG, T, kW2, H), columns(r.tol_dG, T, kW2, H), 1.0);
    bool untouched = true;
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < kStride; ++j)
            if ((j < kW1 || j >= kW2 + H) && g.dG[static_cast<size_t>(t) * kStride + j] != kDGFill) untouched = false;
    test::check(untouched, "%s: dcoefs' columns outside 29..40 untouched", n.c_str());
    // deterministic: the same bits again
    const Got again = run(p, in_place);
    test::check(same_bits(g.dq, again.dq) && same_bits(g.dk, again.dk) && same_bits(g.dv, again.dv) &&
                    same_bits(g.dG, again.dG) && same_bits(g.out, again.out),
                "%s: a second run gives the same bits", n.c_str());
    std::printf("%s: err/tol out %.3f dq %.3f dk %.3f dv %.3f dw1 %.3f dw2 %.3f\n", n.c_str(), e_out, e_dq, e_dk, e_dv,
                e_w1, e_w2);
}

// The reference's backward against central differences of its forward (w1 unrounded): L = sum go . out.
void check_central_differences(int D) {
    Problem p = make_problem(40, {0, 17, 40}, D);
    std::fill(p.dq0.begin(), p.dq0.end(), 0.0);
    std::fill(p.dk0.begin(), p.dk0.end(), 0.0);
    std::fill(p.dv0.begin(), p.dv0.end(), 0.0);
    const Ref r = reference(p, false, true);
    auto loss = [&] {
        const Ref f = reference(p, false, false);
        double s = 0;
        for (size_t i = 0; i < f.out.size(); ++i) s += p.go[i] * f.out[i];
        return s;
    };
    int bad = 0, n = 0;
    auto probe = [&](const char* what, double& x, double want) {
        const double got = test::central_difference(x, 1e-5, loss);
        ++n;
        if (!(std::fabs(got - want) <= 1e-6 * (1 + std::fabs(want)))) {
            if (bad++ < 4) std::printf("  %s: central difference %.9g, backward %.9g\n", what, got, want);
        }
    };
    for (int i = 0; i < 10; ++i) {
        const int t = test::randint(0, p.T - 1), h = test::randint(0, H - 1), d = test::randint(0, D - 1);
        probe("q", p.q[p.at(t, h, d)], r.dq[p.at(t, h, d)]);
        probe("k", p.k[p.at(t, h, d)], r.dk[p.at(t, h, d)]);
        probe("v", p.v[p.at(t, h, d)], r.dv[p.at(t, h, d)]);
        const size_t gi = static_cast<size_t>(t) * kStride + kW1 + test::randint(0, 2 * H - 1);
        probe("G", p.G[gi], r.dG[gi]);
    }
    test::check(bad == 0, "reference backward vs central differences (D=%d): %d of %d off", D, bad, n);
}

// ---- pinned bits: the kernels' outputs on fixed data (not TEST_SEED's) hashed, against the hash the kernels
// gave before their occupancy and staging rework (commit 241cdd9's kernels): every change since is meant to keep
// each rounding point and each fp32 sum's order, so any bit that moves fails here (the tolerances above would not
// see it). Emu's and sm_90's bits need not agree (emu's model of the tensor cores' fp32 accumulation is not known to
// be bitwise the hardware's; nvcc contracts multiply-adds), so each platform has its own hash; a platform with none
// recorded (0) prints its hash only. sm_90's is the reworked kernels' (d3b8e33), from an H200 (2026-11-29,
// docs/gpu-runs/2026-11-29-h200-d3b8e33): there 241cdd9's kernels gave 0x7730de68eb6c784c and 0xc451a5b921118e54,
// so on sm_90 the rework moved bits that emu keeps (within this test's tolerances and the twins' on that GPU).
// Emu's equality shows the sums' order kept; it cannot show what nvcc fuses into FMAs (the likeliest cause).
uint64_t fnv1a(uint64_t h, const void* data, size_t bytes) {
    for (size_t i = 0; i < bytes; ++i) h = (h ^ static_cast<const unsigned char*>(data)[i]) * 0x100000001b3ull;
    return h;
}
template <class X>
uint64_t fnv1a(uint64_t h, const std::vector<X>& v) {
    return fnv1a(h, v.data(), v.size() * sizeof(X));
}
// Fixed data from splitmix64: bf16 values uniform in [-amp, amp).
std::vector<double> fixed_values(uint64_t& state, size_t n, double amp) {
    std::vector<double> x(n);
    for (auto& e : x) {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        z ^= z >> 31;
        e = round_bf16(amp * (2.0 * static_cast<double>(z >> 11) / 9007199254740992.0 - 1.0));
    }
    return x;
}
uint64_t pinned_hash(int T, std::vector<int> cu, int D) {
    uint64_t state = 0x5eed0000u + D;
    Problem p;
    p.T = T;
    p.D = D;
    p.cu = std::move(cu);
    p.scale = 0.125;
    const size_t n = static_cast<size_t>(T) * H * D;
    p.q = fixed_values(state, n, 2.0);
    p.k = fixed_values(state, n, 2.0);
    p.v = fixed_values(state, n, 2.0);
    p.y = fixed_values(state, n, 2.0);
    p.go = fixed_values(state, n, 2.0);
    p.dq0 = fixed_values(state, n, 0.1);
    p.dk0 = fixed_values(state, n, 0.1);
    p.dv0 = fixed_values(state, n, 0.1);
    p.G = fixed_values(state, static_cast<size_t>(T) * kStride, 2.0);
    const Got g = run(p, false);
    uint64_t h = 0xcbf29ce484222325ull;
    for (const auto* b : {&g.out, &g.dq, &g.dk, &g.dv}) h = fnv1a(h, *b);
    for (const auto* f : {&g.lse, &g.dG}) h = fnv1a(h, *f);
    return h;
}
void check_pinned_bits() {
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    const bool emu = std::string(prop.name).find("emulated") != std::string::npos, sm90 = prop.major == 9 && prop.minor == 0;
    struct Pin {
        int T, D;
        std::vector<int> cu;
        uint64_t emu, sm90;
    };
    const Pin pins[] = {
        {257, 128, {0, 40, 45, 200, 257}, 0x880fa7dab640f43eull, 0x034798ebfff390b7ull},
        {257, 64, {0, 40, 45, 200, 257}, 0xdfeb48e5773d888dull, 0x96d30736a5fb3ac6ull},
    };
    for (const Pin& pin : pins) {
        const uint64_t got = pinned_hash(pin.T, pin.cu, pin.D);
        std::printf("pinned bits (T=%d D=%d) on %s: %#018llx\n", pin.T, pin.D, prop.name, static_cast<unsigned long long>(got));
        const uint64_t want = emu ? pin.emu : sm90 ? pin.sm90 : 0;  // 0: none recorded on this platform
        if (want != 0)
            test::check(got == want, "pinned bits (T=%d D=%d): hash %#llx, recorded %#llx", pin.T, pin.D,
                        static_cast<unsigned long long>(got), static_cast<unsigned long long>(want));
    }
}

// --bench: the three launches at the preset's stage-1 T (layer 10's shapes, H = 6 and D = 128 whatever the preset's
// widths: the record's), documents cut at the preset's max_seq_len.
int bench_dc_mha(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& pr = b.preset();
    const int T = pr.T(), D = 128;
    std::vector<int> cu;
    for (int t = 0; t < T; t += pr.max_seq_len) cu.push_back(t);
    cu.push_back(T);
    const size_t n = static_cast<size_t>(T) * H * D;
    DeviceBuffer<bf16> q(test::normal_bf16(n)), k(test::normal_bf16(n)), v(test::normal_bf16(n)), y(test::normal_bf16(n));
    DeviceBuffer<bf16> go(test::normal_bf16(n)), out(n), dq(n), dk(n), dv(n);
    DeviceBuffer<float> coefs(test::uniform_vector(static_cast<size_t>(T) * kStride, -1, 1)), lse(static_cast<size_t>(T) * H);
    DeviceBuffer<float> dG(static_cast<size_t>(T) * kStride);
    DeviceBuffer<int> dcu(cu);
    const size_t ws_bytes = dc_mha_backward_workspace_bytes(T);
    DeviceBuffer<unsigned char> ws(ws_bytes);
    const int ncu = static_cast<int>(cu.size());
    const std::string at = bench::fmt("T=%d H=%d D=%d documents of %d", T, H, D, pr.max_seq_len);
    b.run("dc_mha_forward", at, [&](cudaStream_t st) {
        dc_mha_forward(out.ptr, lse.ptr, y.ptr, q.ptr, k.ptr, v.ptr, coefs.ptr, kStride, dcu.ptr, ncu, T, H, D, 0.12f, st);
    });
    b.run("dc_mha_backward", at, [&](cudaStream_t st) {
        dc_mha_backward(dq.ptr, dk.ptr, dv.ptr, dG.ptr, go.ptr, q.ptr, k.ptr, v.ptr, lse.ptr, coefs.ptr, kStride, dcu.ptr,
                        ncu, T, H, D, 0.12f, ws.ptr, ws_bytes, st);
    });
    return b.finish();
}

}  // namespace

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_dc_mha(*o);
    test::seed();
    // bad input: a child process must exit non-zero with the message (forked before emu starts its threads)
    auto fwd = [](int T, int Hh, int Dd, int stride, const void* q) {
        dc_mha_forward(reinterpret_cast<bf16*>(16), nullptr, reinterpret_cast<const bf16*>(16),
                       static_cast<const bf16*>(q), reinterpret_cast<const bf16*>(16), reinterpret_cast<const bf16*>(16),
                       reinterpret_cast<const float*>(16), stride, reinterpret_cast<const int*>(16), 2, T, Hh, Dd, 0.1f,
                       nullptr);
    };
    const void* ok = reinterpret_cast<const void*>(16);
    test::check_fails_with("8 heads", "dc_mha_forward: DC-MHA supports H = 6 heads of D = 64 or 128 only (got H=8 D=128)",
                           [&] { fwd(64, 8, 128, kStride, ok); });
    test::check_fails_with("4 heads of 64", "dc_mha_forward: DC-MHA supports H = 6 heads of D = 64 or 128 only (got H=4 D=64)",
                           [&] { fwd(64, 4, 64, kStride, ok); });
    test::check_fails_with("D = 96", "dc_mha_forward: DC-MHA supports H = 6 heads of D = 64 or 128 only (got H=6 D=96)",
                           [&] { fwd(64, 6, 96, kStride, ok); });
    test::check_fails_with("T = 0", "T must be positive", [&] { fwd(0, 6, 128, kStride, ok); });
    test::check_fails_with("coefficient stride 40", "must hold columns 29..40 (stride 40)",
                           [&] { fwd(64, 6, 128, 40, ok); });
    test::check_fails_with("q misaligned", "dc_mha_forward: out, y, q, k, v must be 16-byte aligned",
                           [&] { fwd(64, 6, 128, kStride, reinterpret_cast<const void*>(18)); });
    auto bwd = [](const float* lse, size_t ws, int Dd = 128) {
        bf16* b = reinterpret_cast<bf16*>(16);
        dc_mha_backward(b, b, b, reinterpret_cast<float*>(16), b, b, b, b, lse, reinterpret_cast<const float*>(16),
                        kStride, reinterpret_cast<const int*>(16), 2, 64, 6, Dd, 0.1f, b, ws, nullptr);
    };
    test::check_fails_with("backward D = 32", "dc_mha_backward: DC-MHA supports H = 6 heads of D = 64 or 128 only (got H=6 D=32)",
                           [&] { bwd(reinterpret_cast<const float*>(16), dc_mha_backward_workspace_bytes(64), 32); });
    test::check_fails_with("backward without lse", "dc_mha_backward: dq, dk, dv, dcoefs, go, q, k, v, lse",
                           [&] { bwd(nullptr, dc_mha_backward_workspace_bytes(64)); });
    test::check_fails_with("backward workspace short", "dc_mha_backward: workspace of 100 bytes, needs",
                           [&] { bwd(reinterpret_cast<const float*>(16), 100); });

    check_pinned_bits();
    // each head dim on its own fresh data: 128 (the record), 64 (its CPU-sized twin)
    for (const int D : {128, 64}) {
        check_central_differences(D);
        check_layout("a sequence shorter than one 16-row tile", 7, {0, 3, 7}, false, D);
        check_layout("one document longer than the window", 300, {0, 300}, false, D);
        check_layout("short documents, one starting mid-window", 257, {0, 40, 45, 200, 257}, false, D);
        check_layout("a one-token document, padded bounds, out in place of y", 130, {0, 1, 130, 130}, true, D);
        const int T = test::randint(113, 280);
        std::vector<int> cu{0};
        for (int i = 0, docs = test::randint(0, 4); i < docs; ++i) cu.push_back(test::randint(1, T - 1));
        cu.push_back(T);
        std::sort(cu.begin(), cu.end());
        check_layout("random document bounds", T, cu, false, D);
    }
    return test::finish();
}
