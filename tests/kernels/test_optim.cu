// kernels/optim.cuh: Adam (bf16 and fp32 parameters, cautious decay, bias correction), NorMuon's
// momentum, Polar Express, variance reduction and mantissa-precise cautious update, the whole
// NorMuon step, and the host step scalars. References are plain double loops on fresh random data,
// with bf16 rounding emulated where the algorithm rounds; the fp32 formulas that upstream fixes
// exactly (torch's lerp, the precise-parameter update) are checked bit for bit.
#include "../../kernels/optim.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

using test::bits;
using test::DeviceBuffer;
using test::round_bf16;
using test::to_bf16;

// ---- host values ----
float to_float(bf16 x) { return __bfloat162float(x); }
float from_bits(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
std::vector<float> to_floats(const std::vector<bf16>& v) {
    std::vector<float> f(v.size());
    for (size_t i = 0; i < v.size(); ++i) f[i] = to_float(v[i]);
    return f;
}
template <class T>
T* upload_one(const T& value) {  // a single struct in device memory; the caller frees it
    T* p;
    CUDA_CHECK(cudaMalloc(&p, sizeof(T)));
    CUDA_CHECK(cudaMemcpy(p, &value, sizeof(T), cudaMemcpyHostToDevice));
    return p;
}
std::string shape_name(int count, int rows, int cols) {
    return std::to_string(count) + "x" + std::to_string(rows) + "x" + std::to_string(cols);
}

// torch.lerp as documented for fp32 on CUDA: weight < 0.5 gives self + weight * (end - self), else
// end - (end - self) * (1 - weight), each computed with one rounding (nvcc contracts it to an fma).
float torch_lerp_f32(float self, float end, float weight) {
    if (std::fabs(weight) < 0.5f) return std::fma(weight, end - self, self);
    return std::fma(-(end - self), 1.0f - weight, end);
}

// ================================ step scalars ================================
void test_step_scalars() {
    // Adam: bigram/value embed (lr 0.008 * 75, betas 0.75, 0.95, wd 0.005 * 5)
    const AdamStepScalars a1 = adam_step_scalars(0.008, 1.0, 75.0, 0.75, 0.95, 0.005, 5.0, 1);
    const AdamStepScalars a7 = adam_step_scalars(0.008, 1.0, 75.0, 0.75, 0.95, 0.005, 5.0, 7);
    test::check(a1.step_size == static_cast<float>(0.6 * std::sqrt(0.05) / 0.25), "Adam step size at t = 1: %.9g",
                a1.step_size);
    test::check(a7.step_size == static_cast<float>(0.3803079614083112), "Adam step size at t = 7: %.9g", a7.step_size);
    test::check(a1.eff_wd == static_cast<float>(0.009) && a7.eff_wd == a1.eff_wd,
                "Adam effective decay lr^2 wd wd_mul");
    const AdamStepScalars lm = adam_step_scalars(0.008, 0.1, 1.0, 0.5, 0.95, 0.005, 150.0, 1);
    test::check(std::fabs(lm.eff_wd - 0.0008 * 0.0008 * 0.75) < 1e-12 &&
                    std::fabs(lm.step_size - 0.0008 * std::sqrt(0.05) / 0.5) < 1e-9,
                "Adam scalars of lm_head at the end of cooldown");
    const AdamHyper h = adam_hyper(0.9, 0.99, 1e-10);
    test::check(h.one_minus_beta1 == static_cast<float>(1.0 - 0.9) && h.beta2 == 0.99f && h.eps == 1e-10f,
                "Adam hyperparameters in fp32");

    // NorMuon: shape multiplier, c_proj doubling, per-step scalars
    test::check(normuon_shape_lr_mul(3072, 768) == 2.0 && normuon_shape_lr_mul(768, 768) == 1.0 &&
                    normuon_shape_lr_mul(128, 512) == 1.0 && normuon_shape_lr_mul(512, 128) == 2.0,
                "NorMuon shape lr multiplier max(1, rows/cols)^0.5");
    test::check(normuon_matrix_lr_mul(true, 3) == 2.0f && normuon_matrix_lr_mul(true, 4) == 1.0f &&
                    normuon_matrix_lr_mul(true, 5) == 2.0f && normuon_matrix_lr_mul(false, 3) == 1.0f,
                "c_proj (odd matrices of the MLP bank) take 2x lr");
    const NorMuonStepScalars n = normuon_step_scalars(0.023, 1.52, 2.0, 1.2, 1.0, 0.95);
    test::check(n.momentum_weight == static_cast<float>(1.0 - 0.95) && n.update_weight == 0.95f &&
                    n.lr == static_cast<float>(2.0 * (0.023 * 1.52)) &&
                    n.wd == static_cast<float>(1.2 * (0.023 * 1.52)),
                "NorMuon step scalars");
    // record 80: the momentum is a 0-D fp32 tensor, 1 - m formed in fp32 (exact): another float than
    // float(1 - mu) (at 0.95: 0.0500000119 vs 0.0500000007); the other scalars are the same
    for (double mu : {0.95, 0.85, 0.9, 0.85 + 100.0 / 300 * (0.95 - 0.85)}) {
        const NorMuonStepScalars a = normuon_step_scalars(0.023, 1.52, 2.0, 1.2, 1.0, mu);
        const NorMuonStepScalars b = normuon_step_scalars(0.023, 1.52, 2.0, 1.2, 1.0, mu, MomentumComplement::fp32);
        test::check(b.momentum_weight == static_cast<float>(1.0 - double(static_cast<float>(mu))) &&
                        a.momentum_weight == static_cast<float>(1.0 - mu) && a.update_weight == b.update_weight &&
                        a.lr == b.lr && a.wd == b.wd,
                    "NorMuon momentum weight at mu %.6f: 1 - float(mu) = %.10g (fp32), float(1 - mu) = %.10g", mu,
                    b.momentum_weight, a.momentum_weight);
    }
    test::check(normuon_step_scalars(0, 1, 1, 0, 1, 0.95, MomentumComplement::fp32).momentum_weight !=
                    normuon_step_scalars(0, 1, 1, 0, 1, 0.95).momentum_weight,
                "the two momentum complements differ at 0.95");
    // upstream forms lr_mul * matrix_mul * lr in double; the kernel's float(lr_mul * lr) * 2 is the same float
    test::check(n.lr * 2.0f == static_cast<float>(2.0 * 2.0 * (0.023 * 1.52)), "c_proj lr product is exact");

    // shape rules
    test::check(normuon_shape_error(3, 3072, 768).empty() && normuon_shape_error(1, 8, 8).empty(),
                "valid NorMuon shapes");
    test::check(!normuon_shape_error(0, 128, 128).empty() && !normuon_shape_error(1, 100, 128).empty() &&
                    !normuon_shape_error(1, 128, 4).empty() && !normuon_shape_error(1, 0, 128).empty(),
                "bad NorMuon shapes rejected");
    test::check(adam_shape_error(0).empty() && adam_shape_error(11).empty() && !adam_shape_error(-1).empty(),
                "Adam shape rule");
    test::check(normuon_scratch_bytes(3, 3072, 768) >= size_t(2) * 3 * 3072 * 768 * 2 + size_t(2) * 3 * 768 * 768 * 2,
                "scratch holds the Polar Express buffers");
}

// ================================ Adam ================================
// Double-precision Adam with cautious decay on fp32 inputs; returns the new parameter.
double adam_reference(double p, double g, double& m, double& v, double b1, double b2, double eps, double step_size,
                      double eff_wd) {
    m = b1 * m + (1 - b1) * g;
    v = b2 * v + (1 - b2) * g * g;
    double update = m / (std::sqrt(v) + eps) * step_size;
    if (update * p > 0) update += eff_wd * p;
    return p - update;
}

// n elements at an element offset into their buffers (offset 1 makes them unaligned: the scalar path).
// Signs are constructed: the update's sign is the sign of m (and g agrees with it), p agrees with it on
// two elements of three, so the cautious mask takes both values.
template <class T>
void check_adam(const char* what, int64_t n, int offset, int t, double beta1, double beta2, AdamStepScalars sc,
                bool zero_state, float grad_scale = 1.0f) {
    std::vector<T> p(n + offset), g(n + offset);
    std::vector<float> m(n + offset, 0.0f), v(n + offset, 0.0f);
    int agree = 0, disagree = 0;
    for (int64_t i = 0; i < n + offset; ++i) {
        const double s = test::uniform(0, 1) < 0.5 ? -1.0 : 1.0;
        const double ps = (i % 3 == 0) ? -s : s;
        (i % 3 == 0 ? disagree : agree) += i >= offset;
        p[i] = static_cast<T>(static_cast<float>(ps * test::uniform(0.25, 2.0)));
        g[i] = static_cast<T>(static_cast<float>(s * test::uniform(0.05, 1.0)));
        if (!zero_state) {
            m[i] = static_cast<float>(s * test::uniform(0.2, 1.0));
            v[i] = static_cast<float>(test::uniform(0.1, 1.0));
        }
    }
    DeviceBuffer<T> dp(p), dg(g);
    DeviceBuffer<float> dm(m), dv(v);
    AdamStepScalars* dsc = upload_one(sc);
    AdamHyper h = adam_hyper(beta1, beta2, 1e-10);
    h.grad_scale = grad_scale;
    adam_step(dp.ptr + offset, dm.ptr + offset, dv.ptr + offset, dg.ptr + offset, n, h, dsc, nullptr);
    const auto gp = dp.download();
    const auto gm = dm.download(), gv = dv.download();
    // the gradient the update must see: the stored one scaled, rounded to T
    for (auto& x : g) x = static_cast<T>(static_cast<float>(x) * grad_scale);
    if (grad_scale != 1.0f) {  // bit for bit the update of a gradient scaled beforehand, in its own pass
        DeviceBuffer<T> dp2(p), dg2(g);
        DeviceBuffer<float> dm2(m), dv2(v);
        adam_step(dp2.ptr + offset, dm2.ptr + offset, dv2.ptr + offset, dg2.ptr + offset, n,
                  adam_hyper(beta1, beta2, 1e-10), dsc, nullptr);
        const auto p2 = dp2.download();
        const auto m2 = dm2.download(), v2 = dv2.download();
        bool same = m2 == gm && v2 == gv;
        for (size_t i = 0; i < p2.size(); ++i) same = same && bits(static_cast<float>(p2[i])) == bits(static_cast<float>(gp[i]));
        test::check(same, "%s grad_scale %g: the same bits as scaling the gradient first", what, grad_scale);
    }
    std::vector<double> wp(n), wm(n), wv(n), fp(n), fm(n), fv(n);
    for (int64_t i = 0; i < n; ++i) {
        const int64_t j = i + offset;
        double mm = m[j], vv = v[j];
        wp[i] = adam_reference(static_cast<float>(p[j]), static_cast<float>(g[j]), mm, vv, beta1, beta2, 1e-10,
                               sc.step_size, sc.eff_wd);
        wm[i] = mm;
        wv[i] = vv;
        fp[i] = static_cast<float>(gp[j]);
        fm[i] = gm[j];
        fv[i] = gv[j];
    }
    const std::string name =
        std::string(what) + " t=" + std::to_string(t) + " n=" + std::to_string(n) + (offset ? " unaligned" : "");
    test::check(agree > 0 && disagree > 0, "%s: both mask cases present", name.c_str());
    // moments: a few fp32 operations (rtol 1e-6); the parameter: one rounding to T (bf16: 2^-8 relative)
    test::check_close(name + ": exp_avg", fm, wm, 1e-30, 1e-6);
    test::check_close(name + ": exp_avg_sq", fv, wv, 1e-30, 1e-6);
    const double prtol = std::is_same_v<T, bf16> ? 1.0 / 256 : 1e-6;
    test::check_close(name + ": param", fp, wp, 1e-6, prtol);
    // untouched neighbours before the offset
    for (int i = 0; i < offset; ++i)
        test::check(bits(static_cast<float>(gp[i])) == bits(static_cast<float>(p[i])) && gm[i] == m[i],
                    "%s: element before the shard untouched", name.c_str());
    cudaFree(dsc);
}

void test_adam() {
    // a large decay (0.3 of p) so a wrong mask decision is far outside the tolerance
    const AdamStepScalars strong{0.05f, 0.3f};
    check_adam<bf16>("Adam bf16", 4099, 0, 1, 0.75, 0.95, strong, true);
    check_adam<bf16>("Adam bf16", 4099, 1, 1, 0.75, 0.95, strong, true);
    check_adam<bf16>("Adam bf16", 2048 + 5, 0, 7, 0.5, 0.95, strong, false);
    // the record's scalars: bias correction at t = 1 and t = 7 from adam_step_scalars
    for (int t : {1, 7}) {
        const AdamStepScalars sc = adam_step_scalars(0.008, 1.0, 75.0, 0.75, 0.95, 0.005, 5.0, t);
        check_adam<bf16>("Adam bf16 value_embed", 777, 0, t, 0.75, 0.95, sc, t == 1);
    }
    // fp32 parameters: x0_lambdas (11) and a scalars-sized vector
    // the sparse exchange's 1/world rides on the read (a power of two, and 1/3, which rounds)
    check_adam<bf16>("Adam bf16 scaled", 4099, 0, 7, 0.75, 0.95, strong, false, 0.125f);
    check_adam<bf16>("Adam bf16 scaled", 1029, 1, 1, 0.75, 0.95, strong, true, 1.0f / 3.0f);
    check_adam<float>("Adam fp32 scaled", 64, 1, 7, 0.9, 0.99, strong, false, 1.0f / 3.0f);
    check_adam<float>("Adam fp32", 11, 0, 1, 0.65, 0.95, strong, true);
    check_adam<float>("Adam fp32", 64, 1, 7, 0.9, 0.99, strong, false);
    check_adam<float>("Adam fp32 scalars", 72, 0, 3, 0.9, 0.99,
                      adam_step_scalars(0.008, 1.0, 5.0, 0.9, 0.99, 0.005, 0.0, 3), false);
}

// ================================ NorMuon: momentum and normalization ================================
const char* input_name(PolarExpressInput input) {
    return input == PolarExpressInput::round_first ? "round_first" : "normalize_fp32";
}

// The normalized Polar Express input of one matrix's fp32 u, in double, before its bf16 rounding:
// x = u, or bf16(u) for round_first; out = x / (||x|| * 1.02 + 1e-6). Returns sum(x^2).
double normalized_reference(const float* u, int64_t e, PolarExpressInput input, double* out) {
    double ss = 0;
    for (int64_t i = 0; i < e; ++i) {
        const double x = input == PolarExpressInput::round_first ? round_bf16(u[i]) : double(u[i]);
        ss += x * x;
    }
    const double denom = std::sqrt(ss) * 1.02 + 1e-6;
    for (int64_t i = 0; i < e; ++i)
        out[i] = (input == PolarExpressInput::round_first ? round_bf16(u[i]) : double(u[i])) / denom;
    return ss;
}

// biased: mu = 1 (then u = m exactly) and every m sits 0.19-0.48 of a bf16 ulp beyond a bf16 value, so
// bf16(u) is smaller in magnitude than u, and ||bf16(u)|| is ~0.2% below ||u||: a norm of the other
// values is seen in the partial sums (checked to 1e-5).
void test_momentum(int count, int rows, int cols, double mu,
                   PolarExpressInput input = PolarExpressInput::normalize_fp32, bool biased = false) {
    const int64_t n = int64_t(count) * rows * cols;
    if (biased) mu = 1.0;
    const std::string name = "NorMuon momentum " + shape_name(count, rows, cols) + " mu " + std::to_string(mu) + " " +
                             input_name(input) + (biased ? " biased" : "");
    std::vector<bf16> g(n);
    std::vector<float> m(n);
    for (int64_t i = 0; i < n; ++i) {
        g[i] = __float2bfloat16(static_cast<float>(test::normal(0, 0.01)));
        m[i] = static_cast<float>(test::normal(0, 0.01));
        if (biased)
            m[i] = from_bits(uint32_t(bits(__float2bfloat16(m[i]))) << 16 | uint32_t(test::randint(0x3000, 0x7C00)));
    }
    const NorMuonStepScalars sc = normuon_step_scalars(0.023, 1.0, 1.0, 1.2, 1.0, mu);
    NorMuonStepScalars* dsc = upload_one(sc);
    DeviceBuffer<bf16> dg(g), dx(n);
    DeviceBuffer<float> dm(m), dpart(size_t(count) * normuon_elementwise_blocks(rows, cols));
    if (input == kNorMuonNumericsR71.input) {  // record 71's input is the launchers' default
        normuon_momentum(dm.ptr, dpart.ptr, dg.ptr, dsc, count, rows, cols, nullptr);
        polar_express_normalize(dx.ptr, dm.ptr, dg.ptr, dpart.ptr, dsc, count, rows, cols, nullptr);
    } else {
        normuon_momentum(dm.ptr, dpart.ptr, dg.ptr, dsc, count, rows, cols, nullptr, input);
        polar_express_normalize(dx.ptr, dm.ptr, dg.ptr, dpart.ptr, dsc, count, rows, cols, nullptr, input);
    }
    const auto gm = dm.download();
    const auto gx = to_floats(dx.download());
    const auto parts = dpart.download();

    // upstream's two lerps in fp32, exactly: m.lerp_(g, 1 - mu); u = g.lerp_(m, mu)
    const float wm = static_cast<float>(1.0 - mu), wu = static_cast<float>(mu);
    std::vector<float> want_m(n), u(n);
    std::vector<double> want_md(n);
    for (int64_t i = 0; i < n; ++i) {
        const float gi = to_float(g[i]);
        want_m[i] = torch_lerp_f32(m[i], gi, wm);
        u[i] = torch_lerp_f32(gi, want_m[i], wu);
        want_md[i] = m[i] + (1.0 - mu) * (gi - double(m[i]));
    }
    test::check_close(name + ": momentum bits", gm, want_m, 0, 0);
    // inputs ~N(0, 0.01): g - m and the fma round at the operands' scale (fp32 ulp of 0.05 is 3.7e-9)
    test::check_close(name + ": momentum vs double", gm, want_md, 1e-8, 1e-6);

    // X = bf16(x / (||x||_F * 1.02 + 1e-6)) per matrix, x = u or bf16(u) by `input`: one bf16 rounding
    // (2^-8) over an fp32 norm. The fp32 norm and division differ from double by the partial sums' own
    // error (measured below) and a few fp32 roundings, which moves an element's rounding only where the
    // double value lies that close to a tie: every element that differs from the reference of its own
    // input must lie so and be one of the tie's two neighbours, while the other input's reference
    // differs in many (bf16(u) is u moved by up to half an ulp). (With round_first, x takes ~256
    // mantissas per binade, so the elements near a tie come in whole classes: hundreds at once, or none.)
    const PolarExpressInput other_input = input == PolarExpressInput::round_first ? PolarExpressInput::normalize_fp32
                                                                                  : PolarExpressInput::round_first;
    const int blocks = normuon_elementwise_blocks(rows, cols);
    const int64_t e = int64_t(rows) * cols;
    std::vector<double> want_x(n), other_x(n), near_tie(count);
    for (int k = 0; k < count; ++k) {
        const int64_t off = k * e;
        double ps = 0;
        const double ss = normalized_reference(&u[off], e, input, &want_x[off]);
        normalized_reference(&u[off], e, other_input, &other_x[off]);
        for (int b = 0; b < blocks; ++b) ps += parts[size_t(k) * blocks + b];
        // relative: half the sum of squares' error (the square root), then the sqrt, the two scalings
        // and the division in fp32, with room
        near_tie[k] = 0.5 * std::fabs(ps - ss) / ss + 8 * std::ldexp(1.0, -24);
        test::check(std::fabs(ps - ss) <= 1e-5 * ss, "%s: matrix %d sum of squares %.9g, want %.9g", name.c_str(), k,
                    ps, ss);
    }
    test::check_close(name + ": normalized X", gx, want_x, 1e-7, 1.0 / 256);
    int64_t off_same = 0, off_other = 0, off_tie = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double w = want_x[i], t = near_tie[i / e];
        if (gx[i] != round_bf16(w)) {
            ++off_same;
            const double below = round_bf16(w * (1 - t)), above = round_bf16(w * (1 + t));
            off_tie += below == above || (gx[i] != below && gx[i] != above);
        }
        off_other += gx[i] != round_bf16(other_x[i]);
    }
    test::check(off_tie == 0 && off_same * 20 < off_other,
                "%s: %lld of %lld X differ from the reference of this input (%lld of them not within the fp32 "
                "error of a bf16 tie), %lld from the other input's",
                name.c_str(), (long long)off_same, (long long)n, (long long)off_tie, (long long)off_other);
    cudaFree(dsc);
}

// ================================ Polar Express ================================
// Upstream's coefficients, retyped here so that the header's copy is checked.
const double kCoeffs[5][3] = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                              {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                              {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                              {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                              {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};

void test_coefficients() {
    bool same = true;
    for (int i = 0; i < 5; ++i)
        for (int j = 0; j < 3; ++j) same = same && kPolarExpressCoeffs[i][j] == kCoeffs[i][j];
    test::check(same && kPolarExpressIters == 5, "Polar Express coefficients are upstream's");
}

// C (m x n) = A (m x k) @ B (k x n), row-major, in double
void gemm(const std::vector<double>& A, const std::vector<double>& B, std::vector<double>& C, int m, int n, int k) {
    C.assign(size_t(m) * n, 0.0);
    for (int i = 0; i < m; ++i)
        for (int p = 0; p < k; ++p) {
            const double a = A[size_t(i) * k + p];
            const double* b = &B[size_t(p) * n];
            double* c = &C[size_t(i) * n];
            for (int j = 0; j < n; ++j) c[j] += a * b[j];
        }
}
std::vector<double> transpose(const std::vector<double>& x, int rows, int cols) {
    std::vector<double> t(x.size());
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) t[size_t(c) * rows + r] = x[size_t(r) * cols + c];
    return t;
}

// Upstream's algorithm on one (rows, cols) matrix of bf16 values: work on X^T when rows > cols; each
// matmul exact in double, then rounded to bf16 where upstream's kernels round; coefficients in fp32.
std::vector<double> polar_express_reference(const std::vector<double>& in, int rows, int cols, bool split,
                                            int iters = 5) {
    const bool tall = rows > cols;
    const int s = std::min(rows, cols), l = std::max(rows, cols);
    std::vector<double> X = tall ? transpose(in, rows, cols) : in, Xt, A, AA, B, BX;
    auto round_all = [](std::vector<double>& v) {
        for (auto& x : v) x = round_bf16(x);
    };
    for (int it = 0; it < iters; ++it) {
        const double* co = kCoeffs[it];
        const double a = static_cast<float>(co[0]), b = static_cast<float>(co[1]), c = static_cast<float>(co[2]);
        Xt = transpose(X, s, l);
        gemm(X, Xt, A, s, s, l);
        round_all(A);
        gemm(A, A, AA, s, s, s);
        B.resize(A.size());
        for (size_t i = 0; i < A.size(); ++i) B[i] = c * AA[i] + b * A[i];
        round_all(B);
        gemm(B, X, BX, s, l, s);
        if (split) {
            round_all(BX);
            for (size_t i = 0; i < X.size(); ++i) X[i] = round_bf16(BX[i] + a * X[i]);
        } else {
            for (size_t i = 0; i < X.size(); ++i) X[i] = round_bf16(a * X[i] + BX[i]);
        }
    }
    return tall ? transpose(X, s, l) : X;
}

// Largest |eigenvalue| of the symmetric s x s matrix M, by power iteration.
double spectral_radius(const std::vector<double>& M, int s) {
    std::vector<double> x(s), y(s);
    for (auto& e : x) e = test::normal();
    double lambda = 0;
    for (int it = 0; it < 300; ++it) {
        double nrm = 0;
        for (int i = 0; i < s; ++i) {
            double acc = 0;
            for (int j = 0; j < s; ++j) acc += M[size_t(i) * s + j] * x[j];
            y[i] = acc;
            nrm += acc * acc;
        }
        nrm = std::sqrt(nrm);
        if (nrm == 0) return 0;
        lambda = nrm;  // |M x| for unit x converges to the largest |eigenvalue|
        for (int i = 0; i < s; ++i) x[i] = y[i] / nrm;
    }
    return lambda;
}

// Random well-conditioned matrices normalized as upstream does, in bf16: Gaussian for rectangular
// shapes (singular values within a factor ~3), I + 0.25 G / sqrt(n) for square ones.
std::vector<float> polar_express_input(int count, int rows, int cols) {
    const int64_t e = int64_t(rows) * cols;
    std::vector<float> x(count * e);
    for (int k = 0; k < count; ++k) {
        std::vector<double> g(e);
        for (int64_t i = 0; i < e; ++i) g[i] = test::normal();
        if (rows == cols)
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < cols; ++c)
                    g[size_t(r) * cols + c] =
                        (r == c ? 1.0 : 0.0) + 0.25 * g[size_t(r) * cols + c] / std::sqrt(double(rows));
        double ss = 0;
        for (double v : g) ss += v * v;
        const double denom = std::sqrt(ss) * 1.02 + 1e-6;
        for (int64_t i = 0; i < e; ++i) x[k * e + i] = round_bf16(g[i] / denom);
    }
    return x;
}

// Relative Frobenius distance ||a - b|| / ||b|| of two equal-sized arrays.
double frobenius_error(const std::vector<double>& a, const std::vector<double>& b) {
    double d2 = 0, b2 = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        d2 += (a[i] - b[i]) * (a[i] - b[i]);
        b2 += b[i] * b[i];
    }
    return std::sqrt(d2 / b2);
}

// One iteration with the first (most cancelling) coefficients, against the double reference of the
// same form: the matmuls' fp32 accumulation order differs from the reference's exact sums only by
// rare one-ulp flips of a bf16 rounding, so elements agree to a bf16 ulp of the largest term of
// a X + B X (|a X| and |B X| are several times the result). Nearly every element is bit-equal to the
// reference of its own form (measured: 0-11 differ), while the other form's rounding changes
// thousands: the kernel must round where upstream does.
void test_polar_express_iteration(CublasLt& lt, int count, int rows, int cols, bool split) {
    const std::string name = "Polar Express iteration " + shape_name(count, rows, cols) + (split ? " split" : " fused");
    const int s = std::min(rows, cols);
    const int64_t e = int64_t(rows) * cols;
    const auto x = polar_express_input(count, rows, cols);
    DeviceBuffer<bf16> dx(to_bf16(x)), dout(count * e), dgram(size_t(count) * s * s), dpoly(size_t(count) * s * s);
    polar_express_iteration(lt, dout.ptr, dx.ptr, dgram.ptr, dpoly.ptr, count, rows, cols,
                            static_cast<float>(kCoeffs[0][0]), static_cast<float>(kCoeffs[0][1]),
                            static_cast<float>(kCoeffs[0][2]), split, nullptr);
    const auto y = to_floats(dout.download());
    std::vector<double> got(count * e), want(count * e), other(count * e), bound(count * e);
    const double a = static_cast<float>(kCoeffs[0][0]);
    for (int k = 0; k < count; ++k) {
        std::vector<double> in(x.begin() + k * e, x.begin() + (k + 1) * e);
        const auto w = polar_express_reference(in, rows, cols, split, 1);
        const auto o = polar_express_reference(in, rows, cols, !split, 1);
        for (int64_t i = 0; i < e; ++i) {
            got[k * e + i] = y[k * e + i];
            want[k * e + i] = w[i];
            other[k * e + i] = o[i];
            // |B X| = |X' - a X|: one bf16 ulp (2^-7 relative, generous) of the larger term
            bound[k * e + i] = std::max(std::fabs(a * in[i]), std::fabs(w[i] - a * in[i])) / 128;
        }
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < count * e; ++i) bad += !(std::fabs(got[i] - want[i]) <= bound[i] + 1e-6);
    test::check(bad <= count * e / 1000, "%s: %lld of %lld elements beyond a bf16 ulp of their largest term",
                name.c_str(), (long long)bad, (long long)(count * e));
    int64_t off_same = 0, off_other = 0;  // elements not bit-equal to each form's reference
    for (int64_t i = 0; i < count * e; ++i) {
        off_same += got[i] != want[i];
        off_other += got[i] != other[i];
    }
    test::check(off_same * 20 <= off_other && off_same <= count * e / 1000,
                "%s: %lld elements differ from the reference of its form, %lld from the other form's", name.c_str(),
                (long long)off_same, (long long)off_other);
    const double same = frobenius_error(got, want), diff = frobenius_error(got, other);
    std::printf(
        "  %s: relative Frobenius error %.2e (other form %.2e), %lld elements past one ulp, %lld / %lld not "
        "bit-equal\n",
        name.c_str(), same, diff, (long long)bad, (long long)off_same, (long long)off_other);
}

// The five iterations, against the double reference of the same form. The matmuls accumulate in fp32
// in another order than the reference, so a bf16 rounding now and then lands one ulp apart and the
// iterations spread it over the whole matrix: one input element moved by one ulp moves the output by
// 0.3-0.7% (Frobenius), which is the size of the kernel-vs-reference difference (0.2-1.6%, most in the
// split form). Checked: relative Frobenius error within 2.5% (a wrong coefficient or transposition is
// off by tens of percent), every element within 15% of the largest magnitude (measured below 5%), and
// the result near-orthogonal.
void check_polar_express_result(const std::string& name, const std::vector<float>& x, const std::vector<float>& y,
                                int count, int rows, int cols, bool split) {
    const int64_t e = int64_t(rows) * cols;
    const int s = std::min(rows, cols);
    double worst_orth = 0, worst_err = 0, worst_frob = 0, scale = 0;
    for (int k = 0; k < count; ++k) {
        std::vector<double> in(x.begin() + k * e, x.begin() + (k + 1) * e),
            got(y.begin() + k * e, y.begin() + (k + 1) * e);
        const auto want = polar_express_reference(in, rows, cols, split);
        worst_frob = std::max(worst_frob, frobenius_error(got, want));
        for (int64_t i = 0; i < e; ++i) {
            scale = std::max(scale, std::fabs(want[i]));
            worst_err = std::max(worst_err, std::fabs(got[i] - want[i]));
        }
        // near-orthogonal: the short side's Gram matrix Y Y^T (or Y^T Y) within PE's range of I
        std::vector<double> Y = rows > cols ? transpose(got, rows, cols) : got, G;
        gemm(Y, transpose(Y, s, int(e / s)), G, s, s, int(e / s));
        for (int i = 0; i < s; ++i) G[size_t(i) * s + i] -= 1.0;
        worst_orth = std::max(worst_orth, spectral_radius(G, s));
    }
    test::check(worst_frob <= 0.025, "%s: relative Frobenius error %.4f vs the bf16-emulating reference", name.c_str(),
                worst_frob);
    test::check(worst_err <= 0.15 * scale, "%s: an element is off by %.3g (largest magnitude %.3g)", name.c_str(),
                worst_err, scale);
    // 5 iterations map singular values in [1e-3, 1] into [0.8589, 1.1411]: |eig(YY^T) - 1| <= 0.3022,
    // plus bf16 slack
    test::check(worst_orth <= 0.36, "%s: ||Y Y^T - I||_2 = %.4f exceeds 0.36", name.c_str(), worst_orth);
    std::printf("  %s: relative Frobenius error %.2e, max element error %.1f%% of max |want|, ||YY^T - I||_2 %.4f\n",
                name.c_str(), worst_frob, 100 * worst_err / scale, worst_orth);
}

void test_polar_express(CublasLt& lt, int count, int rows, int cols, bool split) {
    const std::string name = "Polar Express " + shape_name(count, rows, cols) + (split ? " split" : " fused");
    const int s = std::min(rows, cols);
    const int64_t e = int64_t(rows) * cols;
    const auto x = polar_express_input(count, rows, cols);
    DeviceBuffer<bf16> dx(to_bf16(x)), dother(count * e), dgram(size_t(count) * s * s), dpoly(size_t(count) * s * s);
    const bf16* out =
        polar_express_iterate(lt, dx.ptr, dother.ptr, dgram.ptr, dpoly.ptr, count, rows, cols, split, nullptr);
    test::check(out == dother.ptr, "%s: five iterations leave the result in the other buffer", name.c_str());
    check_polar_express_result(name, x, to_floats(dother.download()), count, rows, cols, split);
}

// ================================ variance reduction and the update ================================
struct VarianceRef {
    std::vector<double> buf, step, v;  // second moment, rsqrt step, scaled v (before its bf16 rounding)
    // VarianceScale::bf16: the element's factor lies within 1e-5 (relative) of a bf16 rounding tie, where
    // the kernel's fp32 statistics may round it the other way
    std::vector<char> factor_near_tie;
};
// upstream's _apply_normuon_variance_reduction on count matrices, in double; VarianceScale::bf16 rounds
// the factor step * ratio to bf16 before the multiply
VarianceRef variance_reference(const std::vector<float>& v, const std::vector<float>& buf0, int count, int rows,
                               int cols, double w, VarianceScale scale = VarianceScale::fp32) {
    const bool per_row = rows >= cols;
    const int L = per_row ? rows : cols, N = per_row ? cols : rows;
    VarianceRef r;
    r.buf.resize(size_t(count) * L);
    r.step.resize(r.buf.size());
    r.v.resize(v.size());
    r.factor_near_tie.assign(v.size(), 0);
    for (int k = 0; k < count; ++k) {
        const size_t off = size_t(k) * rows * cols;
        std::vector<double> mean(L, 0.0);
        for (int i = 0; i < rows; ++i)
            for (int j = 0; j < cols; ++j) {
                const double x = v[off + size_t(i) * cols + j];
                mean[per_row ? i : j] += x * x / N;
            }
        double sum_mean = 0, sum_scaled = 0;
        for (int j = 0; j < L; ++j) {
            const size_t q = size_t(k) * L + j;
            r.buf[q] = buf0[q] + w * (mean[j] - buf0[q]);
            r.step[q] = 1.0 / std::sqrt(std::max(r.buf[q], 1e-10));
            sum_mean += mean[j];
            sum_scaled += mean[j] * N * r.step[q] * r.step[q];
        }
        const double ratio = std::sqrt(sum_mean * N) / std::max(std::sqrt(sum_scaled), 1e-10);
        for (int i = 0; i < rows; ++i)
            for (int j = 0; j < cols; ++j) {
                const size_t q = off + size_t(i) * cols + j;
                const double f = r.step[size_t(k) * L + (per_row ? i : j)] * ratio;
                r.v[q] = v[q] * (scale == VarianceScale::bf16 ? round_bf16(f) : f);
                r.factor_near_tie[q] =
                    scale == VarianceScale::bf16 && round_bf16(f * (1 - 1e-5)) != round_bf16(f * (1 + 1e-5));
            }
    }
    return r;
}

// v with a per-row and per-column scale (so the normalization has work to do); matrix 0's first
// reduced line is zero, with a zero second moment: the 1e-10 floor.
void variance_inputs(int count, int rows, int cols, std::vector<float>& v, std::vector<float>& buf) {
    const bool per_row = rows >= cols;
    const int L = per_row ? rows : cols;
    std::vector<double> rs(rows), cs(cols);
    for (auto& x : rs) x = test::uniform(0.2, 2.0);
    for (auto& x : cs) x = test::uniform(0.2, 2.0);
    v.resize(size_t(count) * rows * cols);
    for (int k = 0; k < count; ++k)
        for (int i = 0; i < rows; ++i)
            for (int j = 0; j < cols; ++j) {
                const bool zero = k == 0 && (per_row ? i == 0 : j == 0);
                v[size_t(k) * rows * cols + size_t(i) * cols + j] =
                    zero ? 0.0f : round_bf16(test::normal(0, 0.03) * rs[i] * cs[j]);
            }
    buf.resize(size_t(count) * L);
    for (auto& x : buf) x = static_cast<float>(test::uniform(2e-4, 3e-3));
    buf[0] = 0.0f;
}

// Runs the statistics and the scaled update with p = 0, mantissa = 0, lr = 1, wd = 0: the update is
// then exactly p32 = -v', so the parameter reads back the scaled bf16 v'.
std::vector<float> scaled_v_through_update(const DeviceBuffer<bf16>& dv, DeviceBuffer<float>& dbuf,
                                           DeviceBuffer<float>& dstep, DeviceBuffer<float>& dpart, int count, int rows,
                                           int cols, float w, bool* mantissa_zero,
                                           VarianceScale scale = VarianceScale::fp32) {
    const int64_t n = int64_t(count) * rows * cols;
    DeviceBuffer<bf16> dp(std::vector<bf16>(n, __float2bfloat16(0.0f)));
    DeviceBuffer<uint16_t> dlo(std::vector<uint16_t>(n, 0));
    NorMuonStepScalars* unit = upload_one(NorMuonStepScalars{0.0f, 1.0f, 1.0f, 0.0f});
    normuon_variance_stats(dbuf.ptr, dstep.ptr, dpart.ptr, dv.ptr, count, rows, cols, w, nullptr);
    if (scale == kNorMuonNumericsR71.scale)  // record 71's factor is the launcher's default
        normuon_scale_and_update(dp.ptr, dlo.ptr, dv.ptr, dstep.ptr, dpart.ptr, nullptr, unit, count, rows, cols,
                                 nullptr);
    else
        normuon_scale_and_update(dp.ptr, dlo.ptr, dv.ptr, dstep.ptr, dpart.ptr, nullptr, unit, count, rows, cols,
                                 nullptr, scale);
    const auto p = to_floats(dp.download());
    const auto lo = dlo.download();
    *mantissa_zero = std::all_of(lo.begin(), lo.end(), [](uint16_t x) { return x == 0; });
    std::vector<float> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = -p[i];
    cudaFree(unit);
    return v;
}

void test_variance(int count, int rows, int cols, VarianceScale scale = VarianceScale::fp32) {
    const bool bf16_scale = scale == VarianceScale::bf16;
    const std::string name =
        "variance reduction " + shape_name(count, rows, cols) + (bf16_scale ? " bf16 scale" : " fp32 scale");
    std::vector<float> v, buf;
    variance_inputs(count, rows, cols, v, buf);
    const float w = static_cast<float>(1.0 - 0.95);
    DeviceBuffer<bf16> dv(to_bf16(v));
    DeviceBuffer<float> dbuf(buf), dstep(buf.size()), dpart(size_t(2) * count * normuon_variance_blocks(rows, cols));
    bool lo_zero = false;
    const auto got_v = scaled_v_through_update(dv, dbuf, dstep, dpart, count, rows, cols, w, &lo_zero, scale);
    const VarianceRef ref = variance_reference(v, buf, count, rows, cols, w, scale);
    const VarianceRef other =
        variance_reference(v, buf, count, rows, cols, w, bf16_scale ? VarianceScale::fp32 : VarianceScale::bf16);
    test::check(lo_zero, "%s: p32 = -v' leaves the mantissa zero", name.c_str());
    // second moment: an fp32 mean over <= 768 squares and one lerp (rtol 1e-5); step: rsqrt (rtol 1e-5)
    test::check_close(name + ": second moment", dbuf.download(), ref.buf, 1e-12, 1e-5);
    test::check_close(name + ": step", dstep.download(), ref.step, 0.0, 1e-5);
    // v': one bf16 rounding of an fp32 product (2^-8 relative); where a bf16 factor is near a tie, also
    // its other rounding (a bf16 ulp of the factor, 2^-7)
    const int64_t n = int64_t(got_v.size());
    int64_t off = 0, near_tie = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double rtol = ref.factor_near_tie[i] ? 1.0 / 256 + 1.0 / 128 : 1.0 / 256;
        near_tie += ref.factor_near_tie[i];
        off += !(std::fabs(got_v[i] - ref.v[i]) <= 1e-9 + rtol * std::fabs(ref.v[i]));
    }
    // lines near a tie: ~0.5% of them (a window of 2e-5 in a bf16 ulp of 2^-8)
    test::check(off == 0 && near_tie <= n / 20, "%s: scaled v: %lld of %lld off (%lld with a factor near a bf16 tie)",
                name.c_str(), (long long)off, (long long)n, (long long)near_tie);
    // and bit for bit: the fp32 factor is within ~1e-6 of the double one, which moves a rounding (of v',
    // or of a whole line's bf16 factor) only near a tie; the other form's rounding moves many elements
    int64_t off_same = 0, off_other = 0;
    for (int64_t i = 0; i < n; ++i) {
        off_same += got_v[i] != round_bf16(ref.v[i]);
        off_other += got_v[i] != round_bf16(other.v[i]);
    }
    test::check(off_same <= n / 200 && off_same * 20 < off_other,
                "%s: %lld of %lld v' differ from the reference of this factor rounding, %lld from the other's",
                name.c_str(), (long long)off_same, (long long)n, (long long)off_other);
}

// The precise update, bit for bit against the fp32 formula, on the kernel's own scaled v'.
void test_update_bits(int count, int rows, int cols) {
    const std::string name = "cautious update " + shape_name(count, rows, cols);
    const int64_t n = int64_t(count) * rows * cols;
    std::vector<float> v, buf;
    variance_inputs(count, rows, cols, v, buf);
    for (int64_t i = 0; i < n; i += 97) v[i] = 0.0f;  // v' = 0: mask true (0 >= 0)
    const float w = static_cast<float>(1.0 - 0.95);
    DeviceBuffer<bf16> dv(to_bf16(v));
    DeviceBuffer<float> dbuf(buf), dstep(buf.size()), dpart(size_t(2) * count * normuon_variance_blocks(rows, cols));
    bool lo_zero = false;
    const auto g = scaled_v_through_update(dv, dbuf, dstep, dpart, count, rows, cols, w, &lo_zero);

    std::vector<bf16> p(n);
    std::vector<uint16_t> lo(n);
    for (int64_t i = 0; i < n; ++i) {
        p[i] = __float2bfloat16(i % 101 == 0 ? 0.0f : static_cast<float>(test::normal(0, 0.05)));
        lo[i] = static_cast<uint16_t>(test::randint(0, 65535));
    }
    std::vector<float> mul(count);
    for (int k = 0; k < count; ++k) mul[k] = k % 4 == 1 ? 2.0f : k % 4 == 3 ? 0.5f : 1.0f;
    const NorMuonStepScalars sc = normuon_step_scalars(0.023, 1.52, normuon_shape_lr_mul(rows, cols), 1.2, 1.0, 0.95);
    NorMuonStepScalars* dsc = upload_one(sc);
    DeviceBuffer<bf16> dp(p);
    DeviceBuffer<uint16_t> dlo(lo);
    DeviceBuffer<float> dmul(mul);
    dbuf.upload(buf);  // the same statistics again: the same v'
    normuon_variance_stats(dbuf.ptr, dstep.ptr, dpart.ptr, dv.ptr, count, rows, cols, w, nullptr);
    normuon_scale_and_update(dp.ptr, dlo.ptr, dv.ptr, dstep.ptr, dpart.ptr, dmul.ptr, dsc, count, rows, cols, nullptr);
    const auto gp = dp.download();
    const auto glo = dlo.download();
    int64_t bad = 0, same_sign = 0, opposite = 0, zero = 0;
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
        const int k = int(i / (int64_t(rows) * cols));
        const float lr = sc.lr * mul[k], wd = sc.wd;
        const float p32 = from_bits(uint32_t(bits(p[i])) << 16 | lo[i]);
        const float prod = g[i] * p32;
        const float mask = prod >= 0.0f ? 1.0f : 0.0f;
        (prod > 0 ? same_sign : prod < 0 ? opposite : zero) += 1;
        const float decay = p32 * mask * wd * lr;
        const float gl = g[i] * lr;
        const float want = (p32 - decay) - gl;
        const uint32_t wb = bits(want);
        if (bits(gp[i]) != (wb >> 16) || glo[i] != (wb & 0xFFFFu)) ++bad;
        // and the same in double: a few fp32 roundings at the scale of the terms
        const double wd64 = double(p32) - (g[i] * double(p32) >= 0 ? double(p32) * wd * lr : 0.0) - double(g[i]) * lr;
        const double got = from_bits(uint32_t(bits(gp[i])) << 16 | glo[i]);
        worst = std::max(worst, std::fabs(got - wd64) / (std::fabs(p32) + std::fabs(g[i] * lr) + 1e-30));
    }
    test::check(bad == 0, "%s: %lld of %lld precise parameters differ from the fp32 formula in their bits",
                name.c_str(), (long long)bad, (long long)n);
    test::check(worst <= 2.5e-7, "%s: precise parameter vs double, worst error %.3g of |p| + |v' lr|", name.c_str(),
                worst);
    test::check(same_sign > 0 && opposite > 0 && zero > 0, "%s: mask cases v'p > 0 (%lld), < 0 (%lld), = 0 (%lld)",
                name.c_str(), (long long)same_sign, (long long)opposite, (long long)zero);
    cudaFree(dsc);
}

// Updates of 2^-12 on parameters of magnitude 1 (half a bf16 ulp is 2^-8): the precise value moves by
// exactly 2^-12 each step; a bf16 parameter rounded to nearest each step would never move.
void test_mantissa_accumulates() {
    const int count = 1, rows = 64, cols = 64;
    const int64_t n = rows * cols;
    std::vector<float> v(n);
    std::vector<bf16> p(n, __float2bfloat16(1.0f));
    for (int64_t i = 0; i < n; ++i) v[i] = (i % 2 ? -1.0f : 1.0f) / 16;  // |v| = 2^-4: every mean square 2^-8
    std::vector<float> buf(rows, 1.0f / 256);                            // already at the mean: the scale is 1
    DeviceBuffer<bf16> dv(to_bf16(v)), dp(p);
    DeviceBuffer<uint16_t> dlo(std::vector<uint16_t>(n, 0));
    DeviceBuffer<float> dbuf(buf), dstep(buf.size()), dpart(size_t(2) * normuon_variance_blocks(rows, cols));
    NorMuonStepScalars* dsc = upload_one(NorMuonStepScalars{0.05f, 0.95f, 1.0f / 256, 0.0f});
    const float w = static_cast<float>(1.0 - 0.95);
    auto step = [&] {
        normuon_variance_stats(dbuf.ptr, dstep.ptr, dpart.ptr, dv.ptr, count, rows, cols, w, nullptr);
        normuon_scale_and_update(dp.ptr, dlo.ptr, dv.ptr, dstep.ptr, dpart.ptr, nullptr, dsc, count, rows, cols,
                                 nullptr);
    };
    step();
    auto gp = dp.download();
    auto glo = dlo.download();
    // 1 - 2^-12 = 0x3F7FF000: the bf16 half truncates to 0x3F7F, the mantissa keeps 0xF000
    test::check(bits(gp[0]) == 0x3F7F && glo[0] == 0xF000 && bits(gp[1]) == 0x3F80 && glo[1] == 0x0800,
                "one tiny step: p %04x|%04x and %04x|%04x, want 3f7f|f000 and 3f80|0800", bits(gp[0]), glo[0],
                bits(gp[1]), glo[1]);
    for (int s = 1; s < 32; ++s) step();
    gp = dp.download();
    glo = dlo.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        const float want = i % 2 ? 1.0f + 1.0f / 128 : 1.0f - 1.0f / 128;  // 32 steps of 2^-12
        const uint32_t got = uint32_t(bits(gp[i])) << 16 | glo[i];
        bad += got != bits(want);
    }
    test::check(bad == 0, "32 tiny steps: %lld precise parameters are not 1 -+ 2^-7", (long long)bad);
    float plain = 1.0f;
    for (int s = 0; s < 32; ++s) plain = round_bf16(double(plain) - 1.0 / 4096);
    test::check(plain == 1.0f, "a bf16 parameter rounded each step stays at 1 (got %.8g)", plain);
    cudaFree(dsc);
}

// ================================ the whole NorMuon step ================================
// numerics: passed to normuon_step, or nullopt to call it without (its default must be record 71's).
void test_normuon_step(CublasLt& lt, int count, int rows, int cols, int rank,
                       std::optional<NorMuonNumerics> numerics = std::nullopt) {
    const NorMuonNumerics nm = numerics.value_or(kNorMuonNumericsR71);
    const bool r80 = nm.input == PolarExpressInput::round_first;
    const std::string name = "normuon_step " + shape_name(count, rows, cols) + (numerics ? "" : " default") +
                             (r80 ? " r80" : " r71") + " numerics";
    const int64_t e = int64_t(rows) * cols, n = count * e;
    const bool per_row = rows >= cols;
    const int L = per_row ? rows : cols;
    std::vector<bf16> p(n), g(n);
    std::vector<float> m(n), buf(size_t(count) * L), mul(count);
    std::vector<uint16_t> lo(n);
    for (int64_t i = 0; i < n; ++i) {
        p[i] = __float2bfloat16(static_cast<float>(test::uniform(-0.03, 0.03)));
        lo[i] = static_cast<uint16_t>(test::randint(0, 65535));
        g[i] = __float2bfloat16(static_cast<float>(test::normal(0, 1e-3)));
        m[i] = static_cast<float>(test::normal(0, 1e-3));
    }
    for (auto& b : buf) b = static_cast<float>(test::uniform(0.5, 1.5) / std::min(rows, cols));
    for (int k = 0; k < count; ++k) mul[k] = normuon_matrix_lr_mul(true, rank * count + k);
    const double mu = 0.85 + 100.0 / 300 * (0.95 - 0.85);  // the record's momentum at step 100 (warm-up)
    const NorMuonStepScalars sc =
        normuon_step_scalars(0.023, 1.0, normuon_shape_lr_mul(rows, cols), 1.2, 1.0, mu, nm.momentum);
    // the momentum's weight, formed here independently: 1 - mu in double, or in fp32 from float(mu)
    const float wm = nm.momentum == MomentumComplement::fp32 ? static_cast<float>(1.0 - double(static_cast<float>(mu)))
                                                            : static_cast<float>(1.0 - mu);
    test::check(sc.momentum_weight == wm, "%s: momentum weight %.10g, want %.10g", name.c_str(), sc.momentum_weight,
                wm);
    const float w = static_cast<float>(1.0 - 0.95);

    DeviceBuffer<bf16> dp(p), dg(g);
    DeviceBuffer<float> dm(m), dbuf(buf), dmul(mul);
    DeviceBuffer<uint16_t> dlo(lo);
    NorMuonStepScalars* dsc = upload_one(sc);
    const size_t scratch_bytes = normuon_scratch_bytes(count, rows, cols);
    DeviceBuffer<char> scratch(scratch_bytes);
    const NorMuonShard shard{dp.ptr, dg.ptr, dm.ptr, dbuf.ptr, dlo.ptr, dmul.ptr, count, rows, cols};
    if (numerics)
        normuon_step(lt, shard, dsc, w, scratch.ptr, scratch_bytes, nullptr, *numerics);
    else
        normuon_step(lt, shard, dsc, w, scratch.ptr, scratch_bytes, nullptr);
    const auto gp = dp.download();
    const auto glo = dlo.download();
    const auto gm = dm.download(), gbuf = dbuf.download();

    // reference: fp32 lerps, normalized bf16 X (of u or bf16(u), nm.input), Polar Express in double with
    // bf16 roundings (split above 1024 rows, as upstream), variance reduction in double with v' rounded
    // to bf16 (its factor too for VarianceScale::bf16), update in double
    std::vector<float> want_m(n), v(n);
    for (int k = 0; k < count; ++k) {
        std::vector<float> u(e);
        for (int64_t i = 0; i < e; ++i) {
            const int64_t q = k * e + i;
            want_m[q] = torch_lerp_f32(m[q], to_float(g[q]), wm);
            u[i] = torch_lerp_f32(to_float(g[q]), want_m[q], static_cast<float>(mu));
        }
        std::vector<double> in(e);
        normalized_reference(u.data(), e, nm.input, in.data());
        for (auto& x : in) x = round_bf16(x);
        const auto out = polar_express_reference(in, rows, cols, rows > 1024);
        for (int64_t i = 0; i < e; ++i) v[k * e + i] = static_cast<float>(out[i]);
    }
    const VarianceRef vr = variance_reference(v, buf, count, rows, cols, w, nm.scale);
    // the update lr * v' carries Polar Express's deviations (see check_polar_express_result): compare
    // the parameter's change norm-wise (2.5%) and per element (15% of the largest change)
    std::vector<double> want_d(n), got_d(n);
    double dmax = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double lr = double(sc.lr) * mul[i / e], wd = sc.wd;
        const double p32 = from_bits(uint32_t(bits(p[i])) << 16 | lo[i]);
        const double vi = round_bf16(vr.v[i]);
        want_d[i] = -(vi * p32 >= 0 ? p32 * wd * lr : 0.0) - vi * lr;
        got_d[i] = double(from_bits(uint32_t(bits(gp[i])) << 16 | glo[i])) - p32;
        dmax = std::max(dmax, std::fabs(want_d[i]));
    }
    test::check_close(name + ": momentum bits", gm, want_m, 0, 0);
    // the second moment moves 5% of the way to row means of v', which carry PE's deviations
    test::check_close(name + ": second moment", gbuf, vr.buf, 1e-12, 5e-3);
    const double frob = frobenius_error(got_d, want_d);
    test::check(frob <= 0.025, "%s: parameter change off by %.4f (relative Frobenius)", name.c_str(), frob);
    test::check_close(name + ": parameter change per element", got_d, want_d, 0.15 * dmax, 0.0);
    std::printf("  %s: parameter change relative Frobenius error %.2e\n", name.c_str(), frob);

    // the launcher is its stages in order, with upstream's choice of form (split for rows > 1024) and
    // the numerics' options: the stages run by hand give the same bits, and the other form gives
    // different ones
    for (bool split : {rows > kPolarExpressSplitRows, rows <= kPolarExpressSplitRows}) {
        DeviceBuffer<bf16> hp(p);
        DeviceBuffer<float> hm(m), hbuf(buf);
        DeviceBuffer<uint16_t> hlo(lo);
        DeviceBuffer<char> hs(scratch_bytes);
        const NorMuonScratch l = normuon_scratch_layout(hs.ptr, count, rows, cols);
        test::check(l.bytes == scratch_bytes, "%s: scratch layout size", name.c_str());
        normuon_momentum(hm.ptr, l.norm_partials, dg.ptr, dsc, count, rows, cols, nullptr, nm.input);
        polar_express_normalize(l.x, hm.ptr, dg.ptr, l.norm_partials, dsc, count, rows, cols, nullptr, nm.input);
        const bf16* hv = polar_express_iterate(lt, l.x, l.x_other, l.gram, l.poly, count, rows, cols, split, nullptr);
        normuon_variance_stats(hbuf.ptr, l.step, l.variance_partials, hv, count, rows, cols, w, nullptr);
        normuon_scale_and_update(hp.ptr, hlo.ptr, hv, l.step, l.variance_partials, dmul.ptr, dsc, count, rows, cols,
                                 nullptr, nm.scale);
        const auto sp = hp.download();
        const auto slo = hlo.download();
        bool same = hbuf.download() == gbuf && hm.download() == gm;
        for (int64_t i = 0; i < n && same; ++i) same = bits(sp[i]) == bits(gp[i]) && slo[i] == glo[i];
        if (split == (rows > kPolarExpressSplitRows))
            test::check(same, "%s: normuon_step equals its stages run by hand (split %d)", name.c_str(), int(split));
        else
            test::check(!same, "%s: the other Polar Express form (split %d) gives other bits", name.c_str(),
                        int(split));
    }
    // each of the two roundings alone moves the bits: normuon_step reads both fields
    const PolarExpressInput flip_input = r80 ? PolarExpressInput::normalize_fp32 : PolarExpressInput::round_first;
    const VarianceScale flip_scale = nm.scale == VarianceScale::bf16 ? VarianceScale::fp32 : VarianceScale::bf16;
    for (const NorMuonNumerics changed :
         {NorMuonNumerics{flip_input, nm.scale, nm.momentum}, NorMuonNumerics{nm.input, flip_scale, nm.momentum}}) {
        DeviceBuffer<bf16> hp(p);
        DeviceBuffer<float> hm(m), hbuf(buf);
        DeviceBuffer<uint16_t> hlo(lo);
        const NorMuonShard other{hp.ptr, dg.ptr, hm.ptr, hbuf.ptr, hlo.ptr, dmul.ptr, count, rows, cols};
        normuon_step(lt, other, dsc, w, scratch.ptr, scratch_bytes, nullptr, changed);
        const auto sp = hp.download();
        const auto slo = hlo.download();
        int64_t differ = 0;
        for (int64_t i = 0; i < n; ++i) differ += bits(sp[i]) != bits(gp[i]) || slo[i] != glo[i];
        test::check(differ > n / 10, "%s: input %s, %s scale: %lld of %lld parameters differ (want many)",
                    name.c_str(), input_name(changed.input), changed.scale == VarianceScale::bf16 ? "bf16" : "fp32",
                    (long long)differ, (long long)n);
    }
    cudaFree(dsc);
}

// ---- benchmark: one rank's optimizer updates, on its shard of 8 ----
// Adam on the largest bf16 shards; NorMuon on a shard of each bank, whole and stage by stage.
void bench_adam(bench::Bench& b, const char* what, int64_t n) {
    DeviceBuffer<bf16> p(test::uniform_bf16(size_t(n), -0.03, 0.03)), g(test::normal_bf16(size_t(n), 0, 1e-3));
    DeviceBuffer<float> m(test::uniform_vector(size_t(n), -1e-3, 1e-3)), v(test::uniform_vector(size_t(n), 0, 1e-6));
    DeviceBuffer<AdamStepScalars> sc(std::vector<AdamStepScalars>{adam_step_scalars(0.008, 1.0, 75.0, 0.75, 0.95, 0.005,
                                                                                    5.0, 1)});
    const AdamHyper h = adam_hyper(0.75, 0.95, 1e-10);
    b.run("adam_step", bench::fmt("bf16 %s shard n=%lld", what, (long long)n),
          [&](cudaStream_t s) { adam_step(p.ptr, m.ptr, v.ptr, g.ptr, n, h, sc.ptr, s); });
}

void bench_normuon(bench::Bench& b, CublasLt& lt, const char* bank, int matrices, int rows, int cols) {
    const int count = matrices / b.preset().ranks;
    const int64_t n = int64_t(count) * rows * cols;
    const bool per_row = rows >= cols;
    DeviceBuffer<bf16> p(test::uniform_bf16(size_t(n), -0.03, 0.03)), g(test::normal_bf16(size_t(n), 0, 1e-3));
    DeviceBuffer<float> m(test::uniform_vector(size_t(n), -1e-3, 1e-3)), mul(std::vector<float>(count, 1.0f)),
        second(test::uniform_vector(size_t(count) * (per_row ? rows : cols), 1e-3, 2e-3));
    std::vector<uint16_t> lo(static_cast<size_t>(n));
    for (auto& x : lo) x = static_cast<uint16_t>(test::randint(0, 65535));
    DeviceBuffer<uint16_t> mantissa(lo);
    DeviceBuffer<NorMuonStepScalars> sc(std::vector<NorMuonStepScalars>{
        normuon_step_scalars(0.023, 1.0, normuon_shape_lr_mul(rows, cols), 1.2, 1.0, 0.95)});
    const float w = 0.05f;  // 1 - beta2
    const size_t scratch_bytes = normuon_scratch_bytes(count, rows, cols);
    DeviceBuffer<char> scratch(scratch_bytes);
    const NorMuonScratch l = normuon_scratch_layout(scratch.ptr, count, rows, cols);
    const NorMuonShard shard{p.ptr, g.ptr, m.ptr, second.ptr, mantissa.ptr, mul.ptr, count, rows, cols};
    const bool split = rows > kPolarExpressSplitRows;
    const std::string at = bench::fmt("%s: %d of %d x %d%s", bank, count, rows, cols, split ? " (split form)" : "");
    b.run("normuon_step", at,
          [&](cudaStream_t s) { normuon_step(lt, shard, sc.ptr, w, scratch.ptr, scratch_bytes, s); });
    b.run("normuon_momentum", at, [&](cudaStream_t s) {
        normuon_momentum(m.ptr, l.norm_partials, g.ptr, sc.ptr, count, rows, cols, s);
    });
    b.run("polar_express_normalize", at, [&](cudaStream_t s) {
        polar_express_normalize(l.x, m.ptr, g.ptr, l.norm_partials, sc.ptr, count, rows, cols, s);
    });
    // later calls iterate from the last one's output: an orthogonalized matrix, as well-scaled as the first input
    const bf16* v = nullptr;
    b.run("polar_express_iterate", at, [&](cudaStream_t s) {
        v = polar_express_iterate(lt, l.x, l.x_other, l.gram, l.poly, count, rows, cols, split, s);
    });
    b.run("normuon_variance_stats", at, [&](cudaStream_t s) {
        normuon_variance_stats(second.ptr, l.step, l.variance_partials, v, count, rows, cols, w, s);
    });
    b.run("normuon_scale_and_update", at, [&](cudaStream_t s) {
        normuon_scale_and_update(p.ptr, mantissa.ptr, v, l.step, l.variance_partials, mul.ptr, sc.ptr, count, rows,
                                 cols, s);
    });
}

int bench_optim(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int64_t table = int64_t(p.V) * p.C;
    bench_adam(b, "value_embed", 5 * table / p.ranks);
    bench_adam(b, "embed", table / p.ranks);
    CublasLt lt;
    bench_normuon(b, lt, "attn", 40, p.C, p.C);  // the banks: [Wq; Wk; Wv; Wo] of 10 layers, [c_fc, c_proj] of 12
    bench_normuon(b, lt, "mlp", 24, p.M, p.C);
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_optim(*o);
    test::seed();
    const auto t0 = std::chrono::steady_clock::now();
    auto lap = [&, last = t0](const char* what) mutable {
        const auto now = std::chrono::steady_clock::now();
        std::printf("  [%s: %.1f s]\n", what, std::chrono::duration<double>(now - last).count());
        last = now;
    };
    test_step_scalars();
    test_adam();
    for (double mu : {0.85, 0.95}) test_momentum(4, 128, 512, mu);
    test_momentum(4, 512, 128, 0.9);
    test_momentum(4, 128, 128, 0.9);
    test_momentum(1, 768, 768, 0.95);
    // record 80's input rounding (bf16(u) before the norm): wide, tall, square, and the biased values
    // that tell the norm of bf16(u) from the norm of u, under both inputs
    test_momentum(4, 128, 512, 0.95, PolarExpressInput::round_first);
    test_momentum(4, 512, 128, 0.85, PolarExpressInput::round_first);
    test_momentum(1, 256, 768, 0.95, PolarExpressInput::round_first);
    test_momentum(4, 128, 128, 0.9, PolarExpressInput::round_first);
    test_momentum(2, 256, 128, 0, PolarExpressInput::round_first, true);
    test_momentum(2, 256, 128, 0, PolarExpressInput::normalize_fp32, true);

    lap("schedules, Adam, momentum");
    CublasLt lt;
    test_coefficients();
    for (bool split : {false, true}) {
        test_polar_express_iteration(lt, 4, 128, 512, split);
        test_polar_express_iteration(lt, 4, 512, 128, split);
        test_polar_express_iteration(lt, 4, 128, 128, split);
    }
    test_polar_express_iteration(lt, 1, 768, 768, false);  // the record's attention matrices (fused form)
    for (bool split : {false, true}) {
        test_polar_express(lt, 4, 128, 512, split);
        test_polar_express(lt, 4, 512, 128, split);
        test_polar_express(lt, 4, 128, 128, split);
    }
    lap("Polar Express");
    test_variance(4, 128, 512);
    test_variance(4, 512, 128);
    test_variance(4, 128, 128);
    test_variance(1, 768, 768);
    test_variance(4, 128, 512, VarianceScale::bf16);
    test_variance(4, 512, 128, VarianceScale::bf16);
    test_variance(4, 128, 128, VarianceScale::bf16);
    test_variance(1, 256, 768, VarianceScale::bf16);  // a record-80 Q/K block: statistics per column
    test_update_bits(4, 512, 128);
    test_update_bits(4, 128, 512);
    test_mantissa_accumulates();

    lap("variance reduction, update");
    test_normuon_step(lt, 4, 512, 128, 1);   // tall: stored layout is X^T, the reduced dim is the columns
    test_normuon_step(lt, 4, 128, 512, 0);   // wide: statistics per column
    test_normuon_step(lt, 2, 1152, 128, 3);  // rows > 1024: the split form
    test_normuon_step(lt, 2, 128, 128, 0);   // square: statistics per row
    test_normuon_step(lt, 2, 128, 128, 0, kNorMuonNumericsR71);  // the default is record 71's numerics
    for (const auto& [count, rows, cols, rank] : {std::array{4, 512, 128, 1}, std::array{4, 128, 512, 0},
                                                  std::array{2, 1152, 128, 3}, std::array{2, 128, 128, 0},
                                                  std::array{1, 256, 768, 2}})
        test_normuon_step(lt, count, rows, cols, rank, kNorMuonNumericsR80);
    lap("normuon_step");
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("optim tests took %.1f s\n", secs);
    return test::finish();
}
