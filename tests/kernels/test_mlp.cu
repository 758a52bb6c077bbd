// kernels/mlp.cuh: the ReLU^2 elementwise kernels bit for bit, the fused c_fc GEMM + ReLU^2 and the
// fused dpre GEMM + ReLU^2's derivative, each on both kernels (mma.sync and Hopper's TMA + wgmma),
// against double-precision loops (and, on the CPU build, bit for bit against cuBLASLt + the
// elementwise kernels and against each other), the MLP forward/backward on both kernels stage by stage
// and end to end against double-precision loops, a finite-difference check of its backward, the lambda-scaled weight pair (with its deterministic
// dlambda), the fixed-order sum, and the shape rules. Record 87's post-only forward and sqrt(post)
// backward; record 89's FP8 down-projection: the weights' bootstrap and delayed scales over simulated
// steps, the epilogue's e4m3 post and amax partials, the activation scale, and the e4m3 GEMM.
#include "../../kernels/mlp.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

using test::check_within;
using test::DeviceBuffer;
using test::normal_bf16;
using test::same_bits;
using test::to_bf16;
using test::value;
using test::values;

// A double GEMM out(M, N) = sum_k a[i, k] b[k, j] (row-major, with strides so transposes are views)
// and the magnitude sum_k |a b| each element's fp32 accumulation error scales with.
struct Gemm {
    std::vector<double> out, mag;
};
Gemm gemm(int M, int N, int K, const std::vector<double>& a, size_t a_row, size_t a_col, const std::vector<double>& b,
          size_t b_row, size_t b_col) {
    Gemm g{std::vector<double>(size_t(M) * N, 0.0), std::vector<double>(size_t(M) * N, 0.0)};
    for (int i = 0; i < M; ++i)
        for (int k = 0; k < K; ++k) {
            const double aik = a[i * a_row + k * a_col];
            if (aik == 0.0) continue;
            double* o = &g.out[size_t(i) * N];
            double* m = &g.mag[size_t(i) * N];
            for (int j = 0; j < N; ++j) {
                const double p = aik * b[k * b_row + j * b_col];
                o[j] += p;
                m[j] += std::fabs(p);
            }
        }
    return g;
}
// bf16 output of an fp32-accumulated GEMM: 1e-5 sqrt(K) of the magnitude, plus the output's
// rounding (at most 2^-9 relative, 2^-8 allowed) and of any accumulated old value. Accumulating,
// cuBLASLt on an H100 may also round the product to bf16 before adding the old value (off by an ulp
// in 2-9% of outputs: docs/gpu-runs/2026-11-28-h100-80gb-hbm3-73ba680), so that rounding is allowed too.
std::vector<double> gemm_tolerance(const Gemm& g, int K, const std::vector<double>* old = nullptr) {
    std::vector<double> tol(g.out.size());
    for (size_t i = 0; i < tol.size(); ++i) {
        const double o = old ? (*old)[i] : 0.0, product_rounding = old ? std::fabs(g.out[i]) / 256 : 0.0;
        tol[i] = 1e-5 * std::sqrt(K + 1.0) * (g.mag[i] + std::fabs(o)) + std::fabs(g.out[i] + o) / 256 +
                 product_rounding + 1e-30;
    }
    return tol;
}
std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
    std::vector<double> r(a.size());
    for (size_t i = 0; i < a.size(); ++i) r[i] = a[i] + b[i];
    return r;
}

// ---- elementwise kernels: exact (each product of two bf16 is exact in fp32; one rounding) ----
void test_relu_square_kernels(int64_t n) {
    auto pre = normal_bf16(size_t(n), 0.0, 3.0), dh = normal_bf16(size_t(n));
    for (size_t i = 0; i < pre.size(); i += 13) pre[i] = to_bf16(i % 2 ? 0.0 : -0.0);
    DeviceBuffer<bf16> d_pre(pre), d_dh(dh), d_post(static_cast<size_t>(n)), d_dpre(static_cast<size_t>(n));
    relu_square_forward(d_post.ptr, d_pre.ptr, n, nullptr);
    relu_square_backward(d_dpre.ptr, d_dh.ptr, d_pre.ptr, n, nullptr);
    std::vector<bf16> want_post(static_cast<size_t>(n)), want_dpre(static_cast<size_t>(n));
    for (size_t i = 0; i < size_t(n); ++i) {
        const double r = value(pre[i]) > 0 ? value(pre[i]) : 0.0;  // upstream's where(pre > 0, pre, 0)
        want_post[i] = to_bf16(r * r);
        want_dpre[i] = to_bf16(2.0 * value(dh[i]) * r);
    }
    test::check(same_bits(d_post.download(), want_post), "relu_square_forward n %lld: bit-exact", (long long)n);
    test::check(same_bits(d_dpre.download(), want_dpre), "relu_square_backward n %lld: bit-exact", (long long)n);
    relu_square_backward(d_dh.ptr, d_dh.ptr, d_pre.ptr, n, nullptr);
    test::check(same_bits(d_dh.download(), want_dpre), "relu_square_backward in place n %lld", (long long)n);
}

// ---- the fused c_fc GEMM: pre = x @ w^T and post = relu(pre)^2 from one kernel ----
// relu(v)^2 of each bf16 v, rounded once, as upstream's where(pre > 0, pre, 0)^2 from the bf16 pre.
std::vector<bf16> relu_square_reference(const std::vector<bf16>& pre) {
    std::vector<bf16> post(pre.size());
    for (size_t i = 0; i < pre.size(); ++i) {
        const double r = std::max(value(pre[i]), 0.0);
        post[i] = to_bf16(r * r);
    }
    return post;
}

std::string shape_text(MlpKernel k, int T, int C, int H) {
    return std::string(" (") + mlp_kernel_name(k) + ") T " + std::to_string(T) + " C " + std::to_string(C) + " H " +
           std::to_string(H);
}

void test_linear_relu_square(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H);
    const size_t n = size_t(T) * H, guard = 8 * size_t(H);  // rows past T must stay untouched
    const auto x = normal_bf16(size_t(T) * C), w = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    const std::vector<bf16> sentinel(n + guard, to_bf16(-7.0));
    DeviceBuffer<bf16> d_x(x), d_w(w), d_pre(sentinel), d_post(sentinel);
    linear_relu_square_forward(k, d_pre.ptr, d_post.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr);
    auto pre = d_pre.download(), post = d_post.download();
    const bool guard_kept = std::all_of(pre.begin() + n, pre.end(), [](bf16 v) { return value(v) == -7.0; }) &&
                            std::all_of(post.begin() + n, post.end(), [](bf16 v) { return value(v) == -7.0; });
    test::check(guard_kept, "linear_relu_square_forward writes nothing past row T%s", what.c_str());
    pre.resize(n);
    post.resize(n);

    // pre: fp32 accumulation (1e-5 sqrt(K) of sum |x w|) then one bf16 rounding (2^-9, 2^-8 allowed)
    const Gemm ref = gemm(T, H, C, values(x), C, 1, values(w), 1, C);  // x @ w^T
    check_within("linear_relu_square_forward pre" + what, values(pre), ref.out, gemm_tolerance(ref, C));
    // post: exactly relu(pre)^2 from the kernel's own bf16 pre, rounded once
    test::check(same_bits(post, relu_square_reference(pre)), "linear_relu_square_forward post = relu(pre)^2%s",
                what.c_str());

    // Emulated, the mma adds each element's products in k order from zero, as emu's cuBLASLt does: the
    // same bits as the unfused path. (On the GPU the accumulation orders differ; both paths are held to
    // the reference above.)
    if constexpr (kEmulated) {
        DeviceBuffer<bf16> u_pre(n), u_post(n);
        CublasLt lt;
        matmul_forward(lt, u_pre.ptr, d_x.ptr, d_w.ptr, T, H, C, nullptr);
        relu_square_forward(u_post.ptr, u_pre.ptr, static_cast<int64_t>(n), nullptr);
        test::check(same_bits(pre, u_pre.download()) && same_bits(post, u_post.download()),
                    "linear_relu_square_forward: the same bits as cuBLASLt + relu_square_forward on emu%s", what.c_str());
    }
}

// dpre = 2 bf16(g @ w^T) relu(pre), the dpre GEMM of the MLP backward with ReLU^2's derivative fused.
void test_linear_relu_square_backward(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H);
    const size_t n = size_t(T) * H, guard = 8 * size_t(H);  // rows past T must stay untouched
    const auto g = normal_bf16(size_t(T) * C, 0.0, 0.1), w = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    auto pre = normal_bf16(n);
    for (size_t i = 0; i < n; i += 11) pre[i] = to_bf16(i % 2 ? 0.0 : -0.0);  // relu's corner: +0 out
    const std::vector<bf16> sentinel(n + guard, to_bf16(-7.0));
    DeviceBuffer<bf16> d_g(g), d_w(w), d_pre(pre), d_dpre(sentinel);
    linear_relu_square_backward(k, d_dpre.ptr, d_g.ptr, d_w.ptr, d_pre.ptr, T, C, H, nullptr);
    auto dpre = d_dpre.download();
    test::check(std::all_of(dpre.begin() + n, dpre.end(), [](bf16 v) { return value(v) == -7.0; }),
                "linear_relu_square_backward writes nothing past row T%s", what.c_str());
    dpre.resize(n);

    // against the double GEMM: g's fp32 accumulation and rounding, then dpre's rounding (2^-7 in all)
    const Gemm ref = gemm(T, H, C, values(g), C, 1, values(w), 1, C);  // g @ w^T
    std::vector<double> want(n), tol(n);
    for (size_t i = 0; i < n; ++i) {
        const double r = std::max(value(pre[i]), 0.0);
        want[i] = 2.0 * ref.out[i] * r;
        tol[i] = 2.0 * r * 1e-5 * std::sqrt(C + 1.0) * ref.mag[i] + std::fabs(want[i]) / 128 + 1e-30;
    }
    check_within("linear_relu_square_backward" + what, values(dpre), want, tol);

    // The epilogue exactly: the forward's kernel shares the main loop, so its pre is the backward's
    // bf16 g bit for bit (on the GPU too); dpre must be 2 g relu(pre) from it, rounded once.
    DeviceBuffer<bf16> d_gw(n), d_post(n);
    linear_relu_square_forward(k, d_gw.ptr, d_post.ptr, d_g.ptr, d_w.ptr, T, C, H, nullptr);
    const auto gw = d_gw.download();
    std::vector<bf16> want_bits(n);
    for (size_t i = 0; i < n; ++i)
        want_bits[i] = to_bf16(2.0 * value(gw[i]) * (value(pre[i]) > 0 ? value(pre[i]) : 0.0));
    test::check(same_bits(dpre, want_bits), "linear_relu_square_backward = 2 bf16(g) relu(pre), rounded once%s",
                what.c_str());

    // in place (dpre is pre): the same bits
    DeviceBuffer<bf16> d_inplace(pre);
    linear_relu_square_backward(k, d_inplace.ptr, d_g.ptr, d_w.ptr, d_inplace.ptr, T, C, H, nullptr);
    test::check(same_bits(d_inplace.download(), dpre), "linear_relu_square_backward in place (dpre is pre)%s",
                what.c_str());

    // Emulated, the mma adds in k order from zero as emu's cuBLASLt does: today's two-step path's bits
    if constexpr (kEmulated) {
        DeviceBuffer<bf16> u_dpre(n);
        CublasLt lt;
        matmul_bf16(lt, u_dpre.ptr, d_g.ptr, false, d_w.ptr, true, T, H, C, nullptr);
        relu_square_backward(u_dpre.ptr, u_dpre.ptr, d_pre.ptr, static_cast<int64_t>(n), nullptr);
        test::check(same_bits(dpre, u_dpre.download()),
                    "linear_relu_square_backward: the same bits as cuBLASLt + relu_square_backward on emu%s",
                    what.c_str());
    }
}

// The two kernels on the same operands, forward and backward. Both add each output's products in
// k-steps of 16 in ascending k from zero; emu's mma.sync and wgmma twins add a k-step's products in k
// order, so under emu they give the same bits. (On the GPU the tensor cores' order within a k-step
// is the hardware's: each kernel is held to the double reference by the tests above instead.)
void test_fc_kernels_agree(int T, int C, int H) {
    const std::string what = " T " + std::to_string(T) + " C " + std::to_string(C) + " H " + std::to_string(H);
    const size_t n = size_t(T) * H;
    const auto x = normal_bf16(size_t(T) * C), w = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    const auto pre = normal_bf16(n);
    DeviceBuffer<bf16> d_x(x), d_w(w), d_pre(pre);
    std::vector<bf16> out[2][3];  // [kernel][pre, post, dpre]
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        DeviceBuffer<bf16> f_pre(n), f_post(n), b_dpre(n);
        linear_relu_square_forward(k, f_pre.ptr, f_post.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr);
        linear_relu_square_backward(k, b_dpre.ptr, d_x.ptr, d_w.ptr, d_pre.ptr, T, C, H, nullptr);
        const int i = k == MlpKernel::wgmma;
        out[i][0] = f_pre.download();
        out[i][1] = f_post.download();
        out[i][2] = b_dpre.download();
    }
    const char* names[3] = {"forward pre", "forward post", "backward dpre"};
    for (int j = 0; j < 3; ++j) {
        size_t differ = 0;
        for (size_t i = 0; i < n; ++i) differ += test::bits(out[0][j][i]) != test::bits(out[1][j][i]);
        if constexpr (kEmulated)
            test::check(differ == 0, "linear_relu_square %s: wgmma and mma kernels differ in %zu of %zu bits%s", names[j],
                        differ, n, what.c_str());
        else
            std::printf("linear_relu_square %s%s: wgmma and mma differ in %zu of %zu outputs' bits\n", names[j],
                        what.c_str(), differ, n);
    }
}

// ---- record 87: the forward keeps post only, the backward takes relu(pre) as sqrt(post) ----
// The post-only forward: post bit for bit the pre-and-post forward's (the same main loop), within the
// double reference's tolerance, nothing past row T; a pre buffer with post_only is refused.
void test_linear_relu_square_post_only(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H) + " (post only)";
    const size_t n = size_t(T) * H, guard = 8 * size_t(H);
    const auto x = normal_bf16(size_t(T) * C), w = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    const std::vector<bf16> sentinel(n + guard, to_bf16(-7.0));
    DeviceBuffer<bf16> d_x(x), d_w(w), d_post(sentinel), d_pre2(n), d_post2(n);
    linear_relu_square_forward(k, nullptr, d_post.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr, ReluSquareSaves::post_only);
    auto post = d_post.download();
    test::check(std::all_of(post.begin() + n, post.end(), [](bf16 v) { return value(v) == -7.0; }),
                "linear_relu_square_forward writes nothing past row T%s", what.c_str());
    post.resize(n);
    // against the double GEMM: pre within e of it (fp32 sums, bf16 rounding), so relu(pre)^2 within 2 r e + e^2 of
    // r^2 (r = relu of the double), and post's own rounding
    const Gemm ref = gemm(T, H, C, values(x), C, 1, values(w), 1, C);
    std::vector<double> want(n), tol(n);
    for (size_t i = 0; i < n; ++i) {
        const double r = std::max(ref.out[i], 0.0), e = 1e-5 * std::sqrt(C + 1.0) * ref.mag[i] + std::fabs(ref.out[i]) / 256;
        want[i] = r * r;
        tol[i] = 2 * r * e + e * e + (r + e) * (r + e) / 256 + 1e-30;  // |pre - ref| <= e, then post's rounding
    }
    check_within("linear_relu_square_forward post" + what, values(post), want, tol);
    linear_relu_square_forward(k, d_pre2.ptr, d_post2.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr);
    test::check(same_bits(post, d_post2.download()), "linear_relu_square_forward post only: the pre-and-post forward's post%s",
                what.c_str());
    test::check_fails_with("linear_relu_square_forward post only with a pre buffer", "pre must be null", [&] {
        linear_relu_square_forward(k, d_pre2.ptr, d_post.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr, ReluSquareSaves::post_only);
    });
}

// dpre = bf16(2 bf16(g) sqrt(post)) in fp32 (the kernel's roundings: bf16 g times the fp32 sqrt of
// the bf16 post, the product rounded to fp32 and then to bf16, as upstream's tl.dot accumulator
// .to(bf16), 2 *, * tl.sqrt(post.to(fp32)), .to(bf16)).
std::vector<bf16> dpre_from_post_reference(const std::vector<bf16>& gw, const std::vector<bf16>& post) {
    std::vector<bf16> out(gw.size());
    for (size_t i = 0; i < gw.size(); ++i) {
        const double r = std::sqrt(double(value(post[i])));  // sqrtf is correctly rounded: float(r) is its result
        out[i] = to_bf16(double(float(2.0 * value(gw[i]) * double(float(r)))));
    }
    return out;
}

// The post-only backward: dpre from post, against the double GEMM times sqrt(post); bit for bit
// against the rounding points above from the forward kernel's own bf16 g; and unlike the relu(pre)
// derivative on the pre that post was made from (which it must not equal: post's rounding shows);
// in place; under emu the cuBLASLt + relu_square_backward(post only) bits.
void test_linear_relu_square_backward_post_only(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H) + " (post only)";
    const size_t n = size_t(T) * H, guard = 8 * size_t(H);
    const auto g = normal_bf16(size_t(T) * C, 0.0, 0.1), w = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    auto pre = normal_bf16(n);
    for (size_t i = 0; i < n; i += 11) pre[i] = to_bf16(i % 2 ? 0.0 : -0.0);
    const auto post = relu_square_reference(pre);
    const std::vector<bf16> sentinel(n + guard, to_bf16(-7.0));
    DeviceBuffer<bf16> d_g(g), d_w(w), d_post(post), d_dpre(sentinel);
    linear_relu_square_backward(k, d_dpre.ptr, d_g.ptr, d_w.ptr, d_post.ptr, T, C, H, nullptr, ReluSquareSaves::post_only);
    auto dpre = d_dpre.download();
    test::check(std::all_of(dpre.begin() + n, dpre.end(), [](bf16 v) { return value(v) == -7.0; }),
                "linear_relu_square_backward writes nothing past row T%s", what.c_str());
    dpre.resize(n);

    const Gemm ref = gemm(T, H, C, values(g), C, 1, values(w), 1, C);  // g @ w^T
    std::vector<double> want(n), tol(n);
    for (size_t i = 0; i < n; ++i) {
        const double r = std::sqrt(value(post[i]));
        want[i] = 2.0 * ref.out[i] * r;
        tol[i] = 2.0 * r * 1e-5 * std::sqrt(C + 1.0) * ref.mag[i] + std::fabs(want[i]) / 128 + 1e-30;
    }
    check_within("linear_relu_square_backward" + what, values(dpre), want, tol);

    DeviceBuffer<bf16> d_gw(n), d_gpost(n);
    linear_relu_square_forward(k, d_gw.ptr, d_gpost.ptr, d_g.ptr, d_w.ptr, T, C, H, nullptr);
    const auto gw = d_gw.download();
    const auto want_bits = dpre_from_post_reference(gw, post);
    test::check(same_bits(dpre, want_bits), "linear_relu_square_backward = bf16(2 bf16(g) sqrt(post))%s", what.c_str());
    // the derivative from pre differs where post's rounding shows (in ~1 of 8 positive entries: asked of
    // the larger shapes only, where missing it is impossible in practice): reading relu(pre) would fail above
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i)
        differ += test::bits(want_bits[i]) != test::bits(to_bf16(2.0 * value(gw[i]) * std::max(value(pre[i]), 0.0)));
    test::check(differ > 0 || n < 4096, "sqrt(post) and relu(pre) give different dpre in %zu of %zu%s", differ, n,
                what.c_str());

    DeviceBuffer<bf16> d_inplace(post);
    linear_relu_square_backward(k, d_inplace.ptr, d_g.ptr, d_w.ptr, d_inplace.ptr, T, C, H, nullptr,
                                ReluSquareSaves::post_only);
    test::check(same_bits(d_inplace.download(), dpre), "linear_relu_square_backward in place (dpre is post)%s", what.c_str());
    if constexpr (kEmulated) {
        DeviceBuffer<bf16> u_dpre(n);
        CublasLt lt;
        matmul_bf16(lt, u_dpre.ptr, d_g.ptr, false, d_w.ptr, true, T, H, C, nullptr);
        relu_square_backward(u_dpre.ptr, u_dpre.ptr, d_post.ptr, static_cast<int64_t>(n), nullptr, ReluSquareSaves::post_only);
        test::check(same_bits(dpre, u_dpre.download()),
                    "linear_relu_square_backward: the same bits as cuBLASLt + relu_square_backward (post only) on emu%s",
                    what.c_str());
    }
}

// The elementwise derivative from post, bit for bit, on every bf16 post >= 0 paired with a few g.
void test_relu_square_backward_from_post_all() {
    std::vector<bf16> post, g;
    const double gs[4] = {1.0, -0.7109375, 3.140625, 1e-3};
    for (uint32_t b = 0; b < 0x7f80; ++b) {
        post.push_back(__ushort_as_bfloat16(static_cast<unsigned short>(b)));
        g.push_back(to_bf16(gs[b % 4]));
    }
    const int64_t n = static_cast<int64_t>(post.size() / 8 * 8);
    DeviceBuffer<bf16> d_post(post), d_g(g), d_dpre(post.size());
    relu_square_backward(d_dpre.ptr, d_g.ptr, d_post.ptr, n, nullptr, ReluSquareSaves::post_only);
    auto got = d_dpre.download();
    got.resize(size_t(n));
    auto want = dpre_from_post_reference(g, post);
    want.resize(size_t(n));
    test::check(same_bits(got, want), "relu_square_backward (post only) = bf16(2 g sqrt(post)) on every bf16 post");
}

// mlp_forward / mlp_backward with post only: out and dc_proj the pre-and-post path's bits (post is
// the same), dpre the post-only kernel's, dc_fc and dx from it within the double reference; refusals.
void test_mlp_post_only(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H) + " (post only)";
    const double w_std = 0.5 / std::sqrt(double(C));
    const auto x = normal_bf16(size_t(T) * C), c_fc = normal_bf16(size_t(H) * C, 0.0, w_std),
               c_proj = normal_bf16(size_t(H) * C, 0.0, w_std), dout = normal_bf16(size_t(T) * C, 0.0, 0.1);
    DeviceBuffer<bf16> d_x(x), d_fc(c_fc), d_proj(c_proj), d_dout(dout), out1(size_t(T) * C), out2(size_t(T) * C),
        pre(size_t(T) * H), post1(size_t(T) * H), post2(size_t(T) * H), dpre(size_t(T) * H), dx(size_t(T) * C),
        dfc(size_t(H) * C), dproj1(size_t(H) * C), dproj2(size_t(H) * C), dx2(size_t(T) * C), dfc2(size_t(H) * C);
    CublasLt lt;
    mlp_forward(lt, k, out1.ptr, pre.ptr, post1.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr, T, C, H, nullptr);
    mlp_forward(lt, k, out2.ptr, nullptr, post2.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr, T, C, H, nullptr,
                ReluSquareSaves::post_only);
    test::check(same_bits(out1.download(), out2.download()) && same_bits(post1.download(), post2.download()),
                "mlp_forward post only: out and post the pre-and-post forward's bits%s", what.c_str());
    const auto postv = post2.download();
    mlp_backward(lt, k, dx.ptr, dfc.ptr, dproj1.ptr, false, dpre.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr, pre.ptr,
                 post1.ptr, T, C, H, nullptr);
    // dpre in the post buffer (the fused kernel reads post in place)
    mlp_backward(lt, k, dx2.ptr, dfc2.ptr, dproj2.ptr, false, post2.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr,
                 nullptr, post2.ptr, T, C, H, nullptr, ReluSquareSaves::post_only);
    test::check(same_bits(dproj1.download(), dproj2.download()), "mlp_backward post only: dc_proj the same bits%s",
                what.c_str());
    const auto dprev = post2.download();  // now dpre
    DeviceBuffer<bf16> d_postv(postv), want_dpre(size_t(T) * H);
    linear_relu_square_backward(k, want_dpre.ptr, d_dout.ptr, d_proj.ptr, d_postv.ptr, T, C, H, nullptr,
                                ReluSquareSaves::post_only);
    test::check(same_bits(dprev, want_dpre.download()), "mlp_backward post only: dpre from sqrt(post)%s", what.c_str());
    const auto dpv = values(dprev);
    const Gemm dfc_ref = gemm(H, C, T, dpv, 1, H, values(x), C, 1);  // dpre^T @ x
    check_within("mlp_backward post only dc_fc" + what, values(dfc2.download()), dfc_ref.out, gemm_tolerance(dfc_ref, T));
    const Gemm dx_ref = gemm(T, C, H, dpv, H, 1, values(c_fc), C, 1);  // dpre @ c_fc
    check_within("mlp_backward post only dx" + what, values(dx2.download()), dx_ref.out, gemm_tolerance(dx_ref, H));
    test::check_fails_with("mlp_backward post only with post null", "post only, but post is null", [&] {
        mlp_backward(lt, k, dx2.ptr, dfc2.ptr, dproj2.ptr, false, dpre.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr,
                     nullptr, nullptr, T, C, H, nullptr, ReluSquareSaves::post_only);
    });
}

// Wall time of the fused kernel against the unfused pair at one shape (printed, not checked).
void report_linear_relu_square_time(MlpKernel k, int T, int C, int H) {
    const auto x = normal_bf16(size_t(T) * C), w = normal_bf16(size_t(H) * C, 0.0, 0.05);
    DeviceBuffer<bf16> d_x(x), d_w(w), d_pre(size_t(T) * H), d_post(size_t(T) * H);
    CublasLt lt;
    const auto time_ms = [](int reps, auto&& fn) {
        fn();  // warm-up: plans, first-touch
        CUDA_CHECK(cudaDeviceSynchronize());
        const auto t0 = std::chrono::steady_clock::now();
        for (int i = 0; i < reps; ++i) fn();
        CUDA_CHECK(cudaDeviceSynchronize());
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / reps;
    };
    const double fused = time_ms(5, [&] {
        linear_relu_square_forward(k, d_pre.ptr, d_post.ptr, d_x.ptr, d_w.ptr, T, C, H, nullptr);
    });
    const double unfused = time_ms(5, [&] {
        matmul_forward(lt, d_pre.ptr, d_x.ptr, d_w.ptr, T, H, C, nullptr);
        relu_square_forward(d_post.ptr, d_pre.ptr, int64_t(T) * H, nullptr);
    });
    std::printf("time T %d C %d H %d: linear_relu_square_forward (%s) %.3f ms, matmul_forward + relu_square_forward %.3f ms\n",
                T, C, H, mlp_kernel_name(k), fused, unfused);
}

// ---- the FP8 up-projection (record 84): quantization and the e4m3 c_fc GEMM ----
// e4m3's rounding of v, by value: the nearest multiple of its binade's quantum (2^-9 below 2^-6),
// ties to even, past 448 saturated (cvt.rn.satfinite); v finite.
double e4m3_round(double v) {
    const double a = std::fabs(v);
    if (a == 0) return v;
    int e;
    std::frexp(a, &e);  // a in [2^(e-1), 2^e)
    const double quantum = std::ldexp(1.0, std::max(e - 1, -6) - 3);
    return std::copysign(std::min(std::nearbyint(a / quantum) * quantum, 448.0), v);
}
// Codes compared by value and sign (no NaN here).
size_t e4m3_mismatches(const std::vector<__nv_fp8_e4m3>& got, const std::vector<double>& want) {
    size_t bad = 0;
    for (size_t i = 0; i < want.size(); ++i)
        bad += value(got[i]) != want[i] || std::signbit(value(got[i])) != std::signbit(want[i]);
    return bad;
}
float bf16_of(float v) { return __bfloat162float(__float2bfloat16(v)); }
float float_of_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}
const float kAmaxFloor = bf16_of(1e-12f);

// Eager CUDA's bf16 tensor / 448 is a multiply by fp32(1/448); the kernel divides: the same bf16 for
// every positive finite bf16 amax.
void test_fp8_scale_division() {
    int differ = 0;
    for (uint32_t b = 1; b < 0x7f80; ++b) {
        const float a = float_of_bits(b << 16);
        differ += test::bits(__float2bfloat16(a / 448.0f)) != test::bits(__float2bfloat16(a * (1.0f / 448.0f)));
    }
    test::check(differ == 0, "bf16(a / 448) = bf16(a * fp32(1/448)) for every positive bf16 a: %d differ", differ);
}

// A bank of `layers` c_fc weights `stride` elements apart (train_gpt's mlp bank interleaves c_proj);
// layer l's scale grows with l, and layer `zero` (if any) is all zeros (the 1e-12 floor).
struct Fp8Bank {
    int layers, H, C;
    int64_t stride;
    std::vector<bf16> host;
    DeviceBuffer<bf16> dev;
    Fp8Bank(int layers_, int H_, int C_, int64_t stride_, int zero)
        : layers(layers_), H(H_), C(C_), stride(stride_), host(make(layers_, H_, C_, stride_, zero)), dev(host) {}
    static std::vector<bf16> make(int layers, int H, int C, int64_t stride, int zero) {
        std::vector<bf16> h = normal_bf16(size_t(stride) * layers, 0.0, 1.0);
        for (int l = 0; l < layers; ++l)
            for (int64_t i = 0; i < int64_t(H) * C; ++i) {
                double v = value(h[l * stride + i]) * (l == zero ? 0.0 : 0.01 * (l + 1) / std::sqrt(double(C)));
                h[l * stride + i] = to_bf16(v);
            }
        return h;
    }
    // Plants in each non-zero layer (at a non-maximal element, so w_s stays) a weight whose W / w_s
    // rounds differently to e4m3 with and without the bf16 intermediate, where w_s has one; true if
    // layer l got one.
    std::vector<bool> witness;
    void plant_double_rounding() {
        witness.assign(size_t(layers), false);
        for (int l = 0; l < layers; ++l) {
            const float s = scale(l);
            double amax = 0;
            for (int64_t i = 0; i < int64_t(H) * C; ++i) amax = std::max(amax, std::fabs(value(layer(l)[i])));
            const size_t at = std::fabs(value(layer(l)[0])) == amax ? 1 : 0;
            for (uint32_t b = 0x0080; b < 0x7f80 && !witness[l]; ++b) {
                const float w = float_of_bits(b << 16);
                if (w >= amax) break;
                if (e4m3_round(bf16_of(w / s)) != e4m3_round(w / s)) {
                    host[size_t(l) * stride + at] = __float2bfloat16(w);
                    witness[l] = true;
                }
            }
        }
        dev.upload(host);
    }
    const bf16* layer(int l) const { return &host[size_t(l) * stride]; }
    // w_s and W1q of layer l by the rounding points mlp.cuh states
    float scale(int l) const {
        double a = 0;
        for (int64_t i = 0; i < int64_t(H) * C; ++i) a = std::max(a, std::fabs(value(layer(l)[i])));
        return bf16_of(std::max(float(a), kAmaxFloor) / 448.0f);
    }
    std::vector<double> quantized(int l, bool bf16_intermediate = true) const {
        const float s = scale(l);
        std::vector<double> q(size_t(H) * C);
        for (size_t i = 0; i < q.size(); ++i) {
            const float v = float(value(layer(l)[i])) / s;
            q[i] = e4m3_round(bf16_intermediate ? bf16_of(v) : v);
        }
        return q;
    }
};
struct Fp8Weights {
    DeviceBuffer<__nv_fp8_e4m3> w;
    DeviceBuffer<float> scale;
    test::DevicePartials scratch;
    Fp8Weights(const Fp8Bank& b)
        : w(size_t(b.layers) * b.H * b.C), scale(size_t(b.layers)),
          scratch(mlp_fp8_weight_scratch_floats(b.layers, b.H, b.C) * sizeof(float)) {
        mlp_fp8_quantize_weights({w.ptr, scale.ptr}, {b.dev.ptr, b.stride, b.layers}, b.H, b.C, scratch.view(), nullptr);
    }
};

void test_mlp_fp8_quantize_weights(int layers, int H, int C, int64_t stride, int zero) {
    const std::string what = " layers " + std::to_string(layers) + " H " + std::to_string(H) + " C " + std::to_string(C);
    Fp8Bank bank(layers, H, C, stride, zero);
    bank.plant_double_rounding();
    const Fp8Weights q(bank);
    const auto scales = q.scale.download();
    const auto w = q.w.download();
    for (int l = 0; l < layers; ++l) {
        test::check(test::bits(scales[l]) == test::bits(bank.scale(l)), "mlp_fp8_quantize_weights w_s[%d] %.9g, want %.9g%s",
                    l, scales[l], bank.scale(l), what.c_str());
        const std::vector<__nv_fp8_e4m3> got(w.begin() + size_t(l) * H * C, w.begin() + size_t(l + 1) * H * C);
        const size_t bad = e4m3_mismatches(got, bank.quantized(l));
        test::check(bad == 0, "mlp_fp8_quantize_weights W1q of layer %d: %zu of %zu codes wrong%s", l, bad, got.size(),
                    what.c_str());
        // planted: quantized without the bf16 intermediate, the witness's code differs
        if (bank.witness[l])
            test::check(e4m3_mismatches(got, bank.quantized(l, false)) > 0,
                        "planted: W1q of layer %d quantized without the bf16 intermediate must differ somewhere%s", l,
                        what.c_str());
    }
    test::check(q.scratch.done.download()[0] == 0, "mlp_fp8_quantize_weights: the ticket counter is back at zero%s",
                what.c_str());
}

// Layer `layer` of a bank through mlp_fp8_quantize_input and the e4m3 GEMM on kernel k.
struct Fp8Run {
    std::vector<bf16> pre, post;
    std::vector<__nv_fp8_e4m3> xq;
    Fp8UpScales scales;
};
Fp8Run run_fp8_forward(MlpKernel k, const Fp8Weights& q, const DeviceBuffer<bf16>& x, int layer, int T, int C, int H,
                       int scale_layer) {
    DeviceBuffer<__nv_fp8_e4m3> xq(size_t(T) * C);
    DeviceBuffer<Fp8UpScales> scales(1);
    test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    const size_t n = size_t(T) * H, guard = 8 * size_t(H);  // rows past T stay untouched
    const std::vector<bf16> sentinel(n + guard, to_bf16(-7.0));
    DeviceBuffer<bf16> d_pre(sentinel), d_post(sentinel);
    const Fp8Up up{q.w.ptr + size_t(layer) * H * C, q.scale.ptr + scale_layer, xq.ptr, scales.ptr, amax.view()};
    mlp_fp8_quantize_input(up, x.ptr, T, C, nullptr);
    linear_relu_square_forward_fp8(k, d_pre.ptr, d_post.ptr, up, T, C, H, nullptr);
    Fp8Run r{d_pre.download(), d_post.download(), xq.download(), scales.download()[0]};
    const bool kept = std::all_of(r.pre.begin() + n, r.pre.end(), [](bf16 v) { return value(v) == -7.0; }) &&
                      std::all_of(r.post.begin() + n, r.post.end(), [](bf16 v) { return value(v) == -7.0; });
    test::check(kept, "linear_relu_square_forward_fp8 (%s) writes nothing past row T", mlp_kernel_name(k));
    test::check(amax.done.download()[0] == 0, "mlp_fp8_quantize_input: the ticket counter is back at zero");
    r.pre.resize(n);
    r.post.resize(n);
    return r;
}

// The forward of layer 1 of a two-layer bank on both kernels against host references that quantize
// identically: the scales and xq exactly; pre within fp32 accumulation and one bf16 rounding of the
// double sum, and under emu bit for bit against an fp32 k-ordered sum; post = relu(pre)^2 exactly;
// the two kernels' bits equal under emu. x has an outlier row so that a's scale is not a power of two.
void test_mlp_fp8_forward(int T, int C, int H) {
    const std::string what = " T " + std::to_string(T) + " C " + std::to_string(C) + " H " + std::to_string(H);
    const Fp8Bank bank(2, H, C, 2 * int64_t(H) * C, -1);
    const Fp8Weights q(bank);
    auto x = normal_bf16(size_t(T) * C);
    x[size_t(T / 2) * C + 3] = to_bf16(-7.3);
    const DeviceBuffer<bf16> d_x(x);

    // the host's quantization
    double amax = 0;
    for (bf16 v : x) amax = std::max(amax, std::fabs(value(v)));
    const float a = std::max(float(amax), kAmaxFloor), x_scale = 448.0f / a, w_s = bank.scale(1);
    const float dequant = w_s * a / 448.0f;
    std::vector<double> xq(x.size());
    for (size_t i = 0; i < x.size(); ++i) xq[i] = e4m3_round(float(value(x[i])) * x_scale);
    const std::vector<double> wq = bank.quantized(1);
    const Gemm ref = gemm(T, H, C, xq, C, 1, wq, 1, C);  // xq @ wq^T, exact products
    std::vector<double> want(ref.out.size()), tol(ref.out.size());
    const double acc = kEmulated ? 1e-5 * std::sqrt(C + 1.0) : 2e-3;  // Hopper's fast FP8 accumulation: looser
    for (size_t i = 0; i < want.size(); ++i) {
        want[i] = ref.out[i] * dequant;
        tol[i] = acc * ref.mag[i] * dequant + std::fabs(want[i]) / 256 + 1e-30;
    }

    std::vector<bf16> pres[2];
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        const std::string kw = what + " (" + mlp_kernel_name(k) + ")";
        const Fp8Run r = run_fp8_forward(k, q, d_x, 1, T, C, H, 1);
        test::check(test::bits(r.scales.amax) == test::bits(a) && test::bits(r.scales.x_scale) == test::bits(x_scale) &&
                        test::bits(r.scales.dequant) == test::bits(dequant),
                    "mlp_fp8_quantize_input scales: a %.9g (want %.9g), 448/a %.9g (%.9g), dequant %.9g (%.9g)%s",
                    r.scales.amax, a, r.scales.x_scale, x_scale, r.scales.dequant, dequant, kw.c_str());
        const size_t bad = e4m3_mismatches(r.xq, xq);
        test::check(bad == 0, "mlp_fp8_quantize_input xq: %zu of %zu codes wrong%s", bad, xq.size(), kw.c_str());
        check_within("linear_relu_square_forward_fp8 pre" + kw, values(r.pre), want, tol);
        test::check(same_bits(r.post, relu_square_reference(r.pre)), "linear_relu_square_forward_fp8 post = relu(pre)^2%s",
                    kw.c_str());
        if constexpr (kEmulated) {  // fp32 sums in k order from zero, times the dequant, rounded once
            std::vector<bf16> exact(size_t(T) * H);
            for (int i = 0; i < T; ++i)
                for (int j = 0; j < H; ++j) {
                    float sum = 0.0f;
                    for (int kk = 0; kk < C; ++kk) sum += float(xq[size_t(i) * C + kk]) * float(wq[size_t(j) * C + kk]);
                    exact[size_t(i) * H + j] = __float2bfloat16(sum * dequant);
                }
            test::check(same_bits(r.pre, exact), "linear_relu_square_forward_fp8 pre = bf16(fp32 k-order sum x dequant) under emu%s",
                        kw.c_str());
        }
        pres[k == MlpKernel::wgmma] = r.pre;
    }
    size_t differ = 0;
    for (size_t i = 0; i < pres[0].size(); ++i) differ += test::bits(pres[0][i]) != test::bits(pres[1][i]);
    if constexpr (kEmulated)
        test::check(differ == 0, "linear_relu_square_forward_fp8: wgmma and mma differ in %zu of %zu bits%s", differ,
                    pres[0].size(), what.c_str());
    else
        std::printf("linear_relu_square_forward_fp8%s: wgmma and mma differ in %zu of %zu outputs' bits\n", what.c_str(),
                    differ, pres[0].size());

    // planted: the other layer's weight scale (w_s[0] for layer 1's weights) must fail the pre check
    const Fp8Run wrong = run_fp8_forward(MlpKernel::mma, q, d_x, 1, T, C, H, 0);
    size_t off = 0;
    for (size_t i = 0; i < want.size(); ++i) off += std::fabs(value(wrong.pre[i]) - want[i]) > tol[i];
    test::check(off > 0, "planted: the scale of the wrong layer must fail the pre check%s (%zu outputs off)", what.c_str(),
                off);
}

// mlp_forward_fp8: the quantization, the e4m3 c_fc and out = post @ c_proj from its own post.
void test_mlp_forward_fp8(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H);
    const Fp8Bank bank(1, H, C, int64_t(H) * C, -1);
    const Fp8Weights q(bank);
    const auto x = normal_bf16(size_t(T) * C), c_proj = normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)));
    DeviceBuffer<bf16> d_x(x), d_proj(c_proj), out(size_t(T) * C), pre(size_t(T) * H), post(size_t(T) * H);
    DeviceBuffer<__nv_fp8_e4m3> xq(size_t(T) * C);
    DeviceBuffer<Fp8UpScales> scales(1);
    test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    CublasLt lt;
    mlp_forward_fp8(lt, k, out.ptr, pre.ptr, post.ptr, d_x.ptr,
                    {q.w.ptr, q.scale.ptr, xq.ptr, scales.ptr, amax.view()}, d_proj.ptr, T, C, H, nullptr);
    const Fp8Run r = run_fp8_forward(k, q, d_x, 0, T, C, H, 0);
    test::check(same_bits(pre.download(), r.pre) && same_bits(post.download(), r.post),
                "mlp_forward_fp8 pre and post: linear_relu_square_forward_fp8's bits%s", what.c_str());
    const auto postv = values(r.post);
    const Gemm ref = gemm(T, C, H, postv, H, 1, values(c_proj), C, 1);  // post @ c_proj
    check_within("mlp_forward_fp8 out" + what, values(out.download()), ref.out, gemm_tolerance(ref, H));
}

// linear_relu_square_forward_fp8 post only (records 84 + 87): post the pre-and-post run's bits.
void test_mlp_fp8_forward_post_only(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H) + " (post only)";
    const Fp8Bank bank(1, H, C, int64_t(H) * C, -1);
    const Fp8Weights q(bank);
    const DeviceBuffer<bf16> d_x(normal_bf16(size_t(T) * C));
    const Fp8Run r = run_fp8_forward(k, q, d_x, 0, T, C, H, 0);
    DeviceBuffer<__nv_fp8_e4m3> xq(size_t(T) * C);
    DeviceBuffer<Fp8UpScales> scales(1);
    test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    const size_t n = size_t(T) * H;
    DeviceBuffer<bf16> post(std::vector<bf16>(n + 8 * size_t(H), to_bf16(-7.0)));
    const Fp8Up up{q.w.ptr, q.scale.ptr, xq.ptr, scales.ptr, amax.view()};
    mlp_fp8_quantize_input(up, d_x.ptr, T, C, nullptr);
    linear_relu_square_forward_fp8(k, nullptr, post.ptr, up, T, C, H, nullptr, ReluSquareSaves::post_only);
    auto got = post.download();
    test::check(std::all_of(got.begin() + n, got.end(), [](bf16 v) { return value(v) == -7.0; }),
                "linear_relu_square_forward_fp8 writes nothing past row T%s", what.c_str());
    got.resize(n);
    test::check(same_bits(got, r.post), "linear_relu_square_forward_fp8 post only: the pre-and-post run's post%s",
                what.c_str());
}

// ---- record 89: the FP8 down-projection with delayed scaling ----
const float kDownWeightHeadroom = float(1.12 / 448.0), kDownActHeadroom = float(1.80 / 448.0);
// e4m3(clamp(v, +-448)) of an fp32 value, by value
double e4m3_clamped(float v) { return e4m3_round(std::max(std::min(double(v), 448.0), -448.0)); }

// quantize_mlp_fp8's down half over `steps` simulated optimizer steps of a bank of c_proj weights
// (H, C): bootstrap at step 0 (and at step 1 when `bootstrap_two`), delayed after. The host keeps its
// own next/used and checks each step's scales bit for bit, W2q code for code (transposed), that the
// activation scale is untouched, and that the delayed step s quantizes with step s - 1's amax * 1.12 / 448.
// At step 2 the weights grow by 1.5 and one gets an outlier past 448 used: its code must clamp to 448.
// Layer `zero` (if any) is all zeros: the floors.
void test_mlp_fp8_down_weights(int layers, int H, int C, int64_t stride, int zero, int steps) {
    const std::string what = " layers " + std::to_string(layers) + " H " + std::to_string(H) + " C " + std::to_string(C);
    DeviceBuffer<__nv_fp8_e4m3> w2q(size_t(layers) * C * H + 64);
    DeviceBuffer<MlpDownScales> scales{std::vector<MlpDownScales>(size_t(layers))};
    test::DevicePartials scratch(mlp_fp8_down_weight_scratch_floats(layers, H, C) * sizeof(float));
    std::vector<float> next(size_t(layers), 1.0f), prev_amax(size_t(layers), 0.0f);
    for (int step = 0; step < steps; ++step) {
        const bool bootstrap = step == 0 || (step == 1 && steps > 4);
        const std::string ws = what + " step " + std::to_string(step) + (bootstrap ? " (bootstrap)" : " (delayed)");
        std::vector<bf16> bank = normal_bf16(size_t(stride) * layers);
        std::vector<size_t> outlier(size_t(layers), SIZE_MAX);
        for (int l = 0; l < layers; ++l) {
            const double sd = l == zero ? 0.0 : 0.02 * (l + 1) * (step == 2 ? 1.5 : 1.0) / std::sqrt(double(C));
            for (int64_t i = 0; i < int64_t(H) * C; ++i) bank[l * stride + i] = to_bf16(value(bank[l * stride + i]) * sd);
            if (step == 2 && l != zero) {  // past 448 used: 2.5 times the previous amax
                outlier[l] = size_t(l * 7919) % (size_t(H) * C);
                bank[l * stride + outlier[l]] = to_bf16(-2.5 * prev_amax[l]);
            } else if (l != zero) {  // the amax in the last tile: a reduction that misses a tile fails
                bank[l * stride + int64_t(H) * C - 1] = to_bf16(5.0 * sd);
            }
        }
        DeviceBuffer<bf16> d_bank(bank);
        mlp_fp8_down_quantize_weights({w2q.ptr, scales.ptr}, {d_bank.ptr, stride, layers}, H, C,
                                      bootstrap ? MlpDownScaling::bootstrap : MlpDownScaling::delayed, scratch.view(),
                                      nullptr);
        const auto got_scales = scales.download();
        const auto got_w = w2q.download();
        for (int l = 0; l < layers; ++l) {
            double amax = 0;
            for (int64_t i = 0; i < int64_t(H) * C; ++i) amax = std::max(amax, std::fabs(value(bank[l * stride + i])));
            if (bootstrap) next[l] = bf16_of(std::max(float(amax), kAmaxFloor) / 448.0f);
            const float used = next[l];
            next[l] = std::max(float(amax), 1e-12f) * kDownWeightHeadroom;
            const MlpDownScales& g = got_scales[size_t(l)];
            test::check(test::bits(g.used) == test::bits(used) && test::bits(g.next) == test::bits(next[l]) && g.act == 1.0f,
                        "mlp_fp8_down_quantize_weights layer %d: used %.9g (want %.9g), next %.9g (want %.9g), act %g (1)%s",
                        l, g.used, used, g.next, next[l], g.act, ws.c_str());
            if (!bootstrap && l != zero)
                test::check(test::bits(g.used) == test::bits(prev_amax[l] * kDownWeightHeadroom),
                            "delayed: layer %d quantized with the previous step's amax %.9g * 1.12 / 448%s", l,
                            prev_amax[l], ws.c_str());
            size_t bad = 0, clamped = 0;
            for (int c = 0; c < C; ++c)
                for (int h = 0; h < H; ++h) {
                    const float v = float(value(bank[l * stride + size_t(h) * C + c])) / used;
                    const double want = e4m3_clamped(v);
                    const __nv_fp8_e4m3 q = got_w[size_t(l) * C * H + size_t(c) * H + h];
                    bad += value(q) != want || std::signbit(value(q)) != std::signbit(want);
                    clamped += std::fabs(v) > 464.0f && value(q) == std::copysign(448.0, v);
                }
            test::check(bad == 0, "mlp_fp8_down_quantize_weights W2q (transposed) of layer %d: %zu of %zu codes wrong%s", l,
                        bad, size_t(H) * C, ws.c_str());
            if (outlier[l] != SIZE_MAX)
                test::check(clamped >= 1, "layer %d's outlier (%.3g used) clamps to -448%s", l,
                            value(bank[l * stride + outlier[l]]) / used, ws.c_str());
            prev_amax[l] = float(amax);
        }
        const auto tail = w2q.download();
        test::check(std::all_of(tail.end() - 64, tail.end(), [](__nv_fp8_e4m3 v) { return v.__x == 0; }),
                    "mlp_fp8_down_quantize_weights writes nothing past the last layer%s", ws.c_str());
        test::check(scratch.done.download()[0] == 0, "mlp_fp8_down_quantize_weights: the ticket counter is back at zero%s",
                    ws.c_str());
    }
}

// One layer's FP8 forward with emission on kernel k: post, postq and the amax partials, from the up
// weights q (layer 0) and x, with the activation scale *act_dev; with saves pre_and_post (record 89's
// PR on record 84: Fp8DownAct::pre) pre too, its buffer first filled with a NaN that no g rounds to.
struct Fp8DownRun {
    std::vector<bf16> post;
    std::vector<__nv_fp8_e4m3> postq;
    std::vector<float> partials;
    std::vector<bf16> pre;  // pre_and_post only
};
Fp8DownRun run_fp8_down_forward(MlpKernel k, const Fp8Weights& q, const DeviceBuffer<bf16>& x,
                                const DeviceBuffer<MlpDownScales>& scales, DeviceBuffer<float>& partials, int T, int C,
                                int H, ReluSquareSaves saves = ReluSquareSaves::post_only) {
    DeviceBuffer<__nv_fp8_e4m3> xq(size_t(T) * C), postq(size_t(T) * H);
    DeviceBuffer<Fp8UpScales> up_scales(1);
    test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    DeviceBuffer<bf16> post(size_t(T) * H);
    const Fp8Up up{q.w.ptr, q.scale.ptr, xq.ptr, up_scales.ptr, amax.view()};
    mlp_fp8_quantize_input(up, x.ptr, T, C, nullptr);
    if (saves == ReluSquareSaves::post_only) {
        linear_relu_square_forward_fp8_down(k, post.ptr, {postq.ptr, partials.ptr, &scales.ptr->act}, up, T, C, H,
                                            nullptr);
        return {post.download(), postq.download(), partials.download(), {}};
    }
    DeviceBuffer<bf16> pre(std::vector<bf16>(size_t(T) * H, __ushort_as_bfloat16(0x7fd5)));
    linear_relu_square_forward_fp8_down(k, post.ptr, {postq.ptr, partials.ptr, &scales.ptr->act, pre.ptr}, up, T, C,
                                        H, nullptr);
    return {post.download(), postq.download(), partials.download(), pre.download()};
}

// The activation side over 3 simulated steps on kernel k: act starts at 1; each step's forward must give
// post bit for bit linear_relu_square_forward_fp8's (post only), postq = e4m3(min(post * (1 / act), 448))
// code for code, partials whose max is the max of post (every slot written: a sentinel of 1e30 must be
// gone, and the slot after the scratch untouched), and then mlp_fp8_down_act_scales sets
// act = max(amax, 1e-12) * 1.80 / 448, which the next step uses. x grows by 1.6 a step: post by 2.56 >
// 1.80, so from step 1 on the largest posts clamp at 448. The pre-keeping form (Fp8DownAct::pre) must
// give the same post, postq and partials bits, and pre the pre-and-post FP8 forward's bits.
void test_mlp_fp8_down_act(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H);
    const Fp8Bank bank(1, H, C, int64_t(H) * C, -1);
    const Fp8Weights q(bank);
    const int64_t count = mlp_fp8_down_act_partials(k, T, H);
    DeviceBuffer<MlpDownScales> scales(std::vector<MlpDownScales>(2));
    DeviceBuffer<float> partials(std::vector<float>(size_t(count) + 1, 1e30f));
    const auto x0 = normal_bf16(size_t(T) * C);
    float act = 1.0f;
    for (int step = 0; step < 3; ++step) {
        const std::string ws = what + " step " + std::to_string(step);
        std::vector<bf16> x(x0.size());
        for (size_t i = 0; i < x.size(); ++i)  // the last row larger: post's max in the last row of tiles
            x[i] = to_bf16(value(x0[i]) * std::pow(1.6, step) * (i >= x.size() - size_t(C) ? 2.0 : 1.0));
        const DeviceBuffer<bf16> d_x(x);
        partials.upload(std::vector<float>(size_t(count) + 1, 1e30f));
        const Fp8DownRun r = run_fp8_down_forward(k, q, d_x, scales, partials, T, C, H);

        // post: the post-only FP8 forward's bits
        DeviceBuffer<__nv_fp8_e4m3> xq(size_t(T) * C);
        DeviceBuffer<Fp8UpScales> up_scales(1);
        test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
        DeviceBuffer<bf16> post(size_t(T) * H);
        const Fp8Up up{q.w.ptr, q.scale.ptr, xq.ptr, up_scales.ptr, amax.view()};
        mlp_fp8_quantize_input(up, d_x.ptr, T, C, nullptr);
        linear_relu_square_forward_fp8(k, nullptr, post.ptr, up, T, C, H, nullptr, ReluSquareSaves::post_only);
        test::check(same_bits(r.post, post.download()), "linear_relu_square_forward_fp8_down post: the post-only bits%s",
                    ws.c_str());
        {
            DeviceBuffer<float> partials_pre(std::vector<float>(size_t(count) + 1, 1e30f));
            const Fp8DownRun rp = run_fp8_down_forward(k, q, d_x, scales, partials_pre, T, C, H,
                                                       ReluSquareSaves::pre_and_post);
            DeviceBuffer<bf16> pre2(size_t(T) * H), post2(size_t(T) * H);
            linear_relu_square_forward_fp8(k, pre2.ptr, post2.ptr, up, T, C, H, nullptr);
            test::check(same_bits(rp.pre, pre2.download()) && same_bits(rp.post, post2.download()),
                        "linear_relu_square_forward_fp8_down keeping pre: pre and post the pre-and-post FP8 forward's "
                        "bits%s",
                        ws.c_str());
            test::check(same_bits(rp.post, r.post) && same_bits(rp.postq, r.postq) && same_bits(rp.partials, r.partials),
                        "linear_relu_square_forward_fp8_down keeping pre: post, postq and the partials (and the slot "
                        "past them) the post-only form's bits%s",
                        ws.c_str());
        }

        const float inv = 1.0f / act;
        double post_max = 0;
        size_t bad = 0, clamped = 0;
        for (size_t i = 0; i < r.post.size(); ++i) {
            const double p = value(r.post[i]);
            post_max = std::max(post_max, p);
            const double want = e4m3_round(std::min(double(float(p) * inv), 448.0));
            bad += value(r.postq[i]) != want;
            clamped += float(p) * inv > 464.0f;
        }
        test::check(bad == 0, "postq = e4m3(min(post / act, 448)): %zu of %zu codes wrong (act %.9g)%s", bad,
                    r.post.size(), act, ws.c_str());
        test::check(step == 0 || clamped > 0, "step %d: %zu posts beyond 448 act clamp%s", step, clamped, ws.c_str());
        const float got_max = *std::max_element(r.partials.begin(), r.partials.begin() + count);
        test::check(got_max == float(post_max) && r.partials[size_t(count)] == 1e30f,
                    "amax partials: max %.9g, want the max of post %.9g; the slot past the scratch kept%s", got_max,
                    post_max, ws.c_str());
        mlp_fp8_down_act_scales(scales.ptr, partials.ptr, count, 1, nullptr);
        const auto sc = scales.download();
        const float want_act = std::max(float(post_max), 1e-12f) * kDownActHeadroom;
        test::check(test::bits(sc[0].act) == test::bits(want_act) && sc[0].used == 1.0f && sc[0].next == 1.0f &&
                        sc[1].act == 1.0f,
                    "mlp_fp8_down_act_scales: act %.9g, want %.9g (used, next and layer 1 untouched)%s", sc[0].act,
                    want_act, ws.c_str());
        act = want_act;
    }
}

// The down GEMM on random codes: out = bf16(fp32(postq @ w2q^T) * act * used) against the double
// product, with fp32 accumulation's tolerance (fast FP8 accumulation on the GPU: looser); dropping
// `used` must fail it.
void test_mlp_fp8_down_proj(int T, int C, int H) {
    const std::string what = " T " + std::to_string(T) + " C " + std::to_string(C) + " H " + std::to_string(H);
    std::vector<__nv_fp8_e4m3> pq(size_t(T) * H), wq(size_t(C) * H);
    std::vector<double> pv(pq.size()), wv(wq.size());
    const auto pn = normal_bf16(pq.size(), 0.0, 60.0), wn = normal_bf16(wq.size(), 0.0, 100.0);
    for (size_t i = 0; i < pq.size(); ++i) {
        pv[i] = e4m3_round(std::fabs(value(pn[i])));  // post >= 0
        pq[i] = __nv_fp8_e4m3(float(pv[i]));
    }
    for (size_t i = 0; i < wq.size(); ++i) {
        wv[i] = e4m3_clamped(float(value(wn[i])));
        wq[i] = __nv_fp8_e4m3(float(wv[i]));
    }
    std::vector<MlpDownScales> sc(3);
    sc[1].act = 0.0123f;
    sc[1].used = 3.7e-5f;
    DeviceBuffer<__nv_fp8_e4m3> d_pq(pq), d_wq(wq);
    DeviceBuffer<MlpDownScales> d_sc(sc);
    DeviceBuffer<bf16> out(size_t(T) * C);
    CublasLt lt;
    mlp_fp8_down_proj(lt, out.ptr, d_pq.ptr, d_wq.ptr, d_sc.ptr + 1, T, C, H, nullptr);
    const Gemm ref = gemm(T, C, H, pv, H, 1, wv, 1, H);  // postq @ w2q^T
    const double s = double(sc[1].act) * sc[1].used, acc = kEmulated ? 1e-5 * std::sqrt(H + 1.0) : 2e-3;
    std::vector<double> want(ref.out.size()), tol(ref.out.size());
    for (size_t i = 0; i < want.size(); ++i) {
        want[i] = ref.out[i] * s;
        tol[i] = acc * ref.mag[i] * s + std::fabs(want[i]) / 256 + 1e-30;
    }
    const auto got = values(out.download());
    check_within("mlp_fp8_down_proj out" + what, got, want, tol);
    size_t off = 0;
    for (size_t i = 0; i < want.size(); ++i) off += std::fabs(got[i] - want[i] / sc[1].used) > tol[i] / sc[1].used;
    test::check(off > 0, "planted: without used the output must be off (%zu)%s", off, what.c_str());
}

// mlp_forward_fp8_down: post, postq, the partials and out the bits of its parts run one by one, with a
// bootstrapped W2q and an act from a previous forward.
void test_mlp_forward_fp8_down(MlpKernel k, int T, int C, int H) {
    const std::string what = shape_text(k, T, C, H);
    const Fp8Bank bank(1, H, C, int64_t(H) * C, -1);
    const Fp8Weights q(bank);
    const DeviceBuffer<bf16> c_proj(normal_bf16(size_t(H) * C, 0.0, 0.5 / std::sqrt(double(C)))),
        x(normal_bf16(size_t(T) * C));
    DeviceBuffer<__nv_fp8_e4m3> w2q(size_t(C) * H), xq(size_t(T) * C), postq(size_t(T) * H);
    DeviceBuffer<MlpDownScales> scales{std::vector<MlpDownScales>(1)};
    test::DevicePartials wscratch(mlp_fp8_down_weight_scratch_floats(1, H, C) * sizeof(float));
    mlp_fp8_down_quantize_weights({w2q.ptr, scales.ptr}, {c_proj.ptr, int64_t(H) * C, 1}, H, C, MlpDownScaling::bootstrap,
                                  wscratch.view(), nullptr);
    const int64_t count = mlp_fp8_down_act_partials(k, T, H);
    DeviceBuffer<float> partials(static_cast<size_t>(count));
    DeviceBuffer<Fp8UpScales> up_scales(1);
    test::DevicePartials amax(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
    const Fp8Up up{q.w.ptr, q.scale.ptr, xq.ptr, up_scales.ptr, amax.view()};
    DeviceBuffer<bf16> out(size_t(T) * C), post(size_t(T) * H);
    CublasLt lt;
    mlp_forward_fp8_down(lt, k, out.ptr, post.ptr, postq.ptr, partials.ptr, x.ptr, up, w2q.ptr, scales.ptr, T, C, H, nullptr);
    mlp_fp8_down_act_scales(scales.ptr, partials.ptr, count, 1, nullptr);  // act for the second forward
    mlp_forward_fp8_down(lt, k, out.ptr, post.ptr, postq.ptr, partials.ptr, x.ptr, up, w2q.ptr, scales.ptr, T, C, H, nullptr);
    const Fp8DownRun r = run_fp8_down_forward(k, q, x, scales, partials, T, C, H);
    DeviceBuffer<__nv_fp8_e4m3> d_pq(r.postq);
    DeviceBuffer<bf16> out2(size_t(T) * C);
    mlp_fp8_down_proj(lt, out2.ptr, d_pq.ptr, w2q.ptr, scales.ptr, T, C, H, nullptr);
    const auto pq = postq.download();
    test::check(same_bits(post.download(), r.post) && std::memcmp(pq.data(), r.postq.data(), pq.size()) == 0 &&
                    same_bits(out.download(), out2.download()) && scales.download()[0].act != 1.0f,
                "mlp_forward_fp8_down: post, postq and out its parts' bits, with a delayed act%s", what.c_str());
}

void test_mlp_fp8_shape_rules() {
    test::check(mlp_fp8_shape_error(3, 16, 8, {nullptr}).empty() && !mlp_fp8_shape_error(256, 136, 512, {nullptr}).empty() &&
                    !mlp_fp8_shape_error(256, 128, 500, {nullptr}).empty() && !mlp_fp8_shape_error(0, 128, 512, {nullptr}).empty(),
                "mlp_fp8 shape rules (C a multiple of 16, H of 8, T positive)");
    auto* fake = reinterpret_cast<bf16*>(256);
    auto* fake8 = reinterpret_cast<__nv_fp8_e4m3*>(256);
    test::check_fails_with("mlp_fp8_quantize_weights with C 136", "mlp_fp8_quantize_weights: C (136)", [=] {
        mlp_fp8_quantize_weights({fake8, nullptr}, {fake, 512 * 136, 2}, 512, 136, {}, nullptr);
    });
    test::check_fails_with("mlp_fp8_quantize_weights with layers overlapping", "a stride of at least H C", [=] {
        mlp_fp8_quantize_weights({fake8, nullptr}, {fake, 512 * 128 - 8, 2}, 512, 128, {}, nullptr);
    });
    CublasLt parents_lt;  // made here: the child must stop before any CUDA call (cuBLASLt's create is one)
    test::check_fails_with("mlp_fp8_down_proj with T 24", "mlp_fp8_down_proj: T (24), C (128) and H (512) must be", [&] {
        mlp_fp8_down_proj(parents_lt, fake, fake8, fake8, reinterpret_cast<const MlpDownScales*>(256), 24, 128, 512,
                          nullptr);
    });
    test::check_fails_with("mlp_fp8_down_quantize_weights with layers overlapping", "a stride of at least H C", [=] {
        mlp_fp8_down_quantize_weights({fake8, reinterpret_cast<MlpDownScales*>(256)}, {fake, 512 * 128 - 8, 2}, 512, 128,
                                      MlpDownScaling::bootstrap, {}, nullptr);
    });
    test::check_fails_with("linear_relu_square_forward_fp8_down without act", "no activation scale", [=] {
        const Fp8Up up{fake8, nullptr, fake8, nullptr, {}};
        linear_relu_square_forward_fp8_down(MlpKernel::wgmma, fake, {fake8, reinterpret_cast<float*>(256), nullptr}, up,
                                            256, 128, 512, nullptr);
    });
    test::check_fails_with("linear_relu_square_forward_fp8_down keeping pre in post", "pre and post are one buffer", [=] {
        const Fp8Up up{fake8, nullptr, fake8, nullptr, {}};
        linear_relu_square_forward_fp8_down(MlpKernel::mma, fake, {fake8, reinterpret_cast<float*>(256),
                                                                   reinterpret_cast<float*>(256), fake},
                                            up, 256, 128, 512, nullptr);
    });
    test::check_fails_with("linear_relu_square_forward_fp8_down with pre misaligned", "not 16-byte aligned", [=] {
        const Fp8Up up{fake8, nullptr, fake8, nullptr, {}};
        linear_relu_square_forward_fp8_down(MlpKernel::wgmma, fake, {fake8, reinterpret_cast<float*>(256),
                                                                     reinterpret_cast<float*>(256), fake + 1},
                                            up, 256, 128, 512, nullptr);
    });
    test::check_fails_with("linear_relu_square_forward_fp8 post only with a pre buffer", "pre must be null", [=] {
        const Fp8Up up{fake8, nullptr, fake8, nullptr, {}};
        linear_relu_square_forward_fp8(MlpKernel::mma, fake, fake, up, 256, 128, 512, nullptr, ReluSquareSaves::post_only);
    });
    test::check_fails_with("linear_relu_square_forward_fp8 with a misaligned xq", "not 16-byte aligned", [=] {
        const Fp8Up up{fake8, nullptr, fake8 + 8, nullptr, {}};
        linear_relu_square_forward_fp8(MlpKernel::wgmma, fake, fake, up, 256, 128, 512, nullptr);
    });
}

// ---- the MLP ----
struct MlpCase {
    int T, C, H;
};

void test_mlp(MlpKernel k, const MlpCase& s) {
    const int T = s.T, C = s.C, H = s.H;
    const std::string what = shape_text(k, T, C, H);
    const double w_std = 0.5 / std::sqrt(double(C));  // upstream's init scale; c_proj random here (zero at init)
    const auto x = normal_bf16(size_t(T) * C), c_fc = normal_bf16(size_t(H) * C, 0.0, w_std),
               c_proj = normal_bf16(size_t(H) * C, 0.0, w_std), dout = normal_bf16(size_t(T) * C, 0.0, 0.1);
    const auto dfc_old = normal_bf16(size_t(H) * C, 0.0, 0.01), dproj_old = normal_bf16(size_t(H) * C, 0.0, 0.01);
    DeviceBuffer<bf16> d_x(x), d_fc(c_fc), d_proj(c_proj), d_dout(dout), d_out(size_t(T) * C), d_pre(size_t(T) * H),
        d_post(size_t(T) * H), d_dpre(size_t(T) * H), d_dx(size_t(T) * C), d_dfc(dfc_old), d_dproj(dproj_old);
    CublasLt lt;
    mlp_forward(lt, k, d_out.ptr, d_pre.ptr, d_post.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr, T, C, H, nullptr);
    const auto pre = d_pre.download(), post = d_post.download(), out = d_out.download();
    const auto xv = values(x), fcv = values(c_fc), projv = values(c_proj), doutv = values(dout);
    const auto prev = values(pre), postv = values(post);

    // stage by stage, each from the kernel's own previous stage
    const Gemm pre_ref = gemm(T, H, C, xv, C, 1, fcv, 1, C);  // x @ c_fc^T
    check_within("mlp forward pre" + what, prev, pre_ref.out, gemm_tolerance(pre_ref, C));
    std::vector<bf16> want_post(post.size());
    for (size_t i = 0; i < post.size(); ++i) {
        const double r = std::max(prev[i], 0.0);
        want_post[i] = to_bf16(r * r);
    }
    test::check(same_bits(post, want_post), "mlp forward post = relu(pre)^2 from the bf16 pre%s", what.c_str());
    const Gemm out_ref = gemm(T, C, H, postv, H, 1, projv, C, 1);  // post @ c_proj
    check_within("mlp forward out" + what, values(out), out_ref.out, gemm_tolerance(out_ref, H));

    // end to end against the unrounded double MLP: pre's rounding (2^-9) doubles in post, so allow
    // 2^-7 of sum |post c_proj| on top of the output's own rounding
    {
        std::vector<double> post_exact(pre_ref.out.size());
        for (size_t i = 0; i < post_exact.size(); ++i) post_exact[i] = std::pow(std::max(pre_ref.out[i], 0.0), 2);
        const Gemm e2e = gemm(T, C, H, post_exact, H, 1, projv, C, 1);
        std::vector<double> tol(e2e.out.size());
        for (size_t i = 0; i < tol.size(); ++i) tol[i] = e2e.mag[i] / 128 + std::fabs(e2e.out[i]) / 256 + 1e-30;
        check_within("mlp forward out vs exact double MLP" + what, values(out), e2e.out, tol);
    }

    for (bool accumulate : {false, true}) {
        const std::string w = what + (accumulate ? " (accumulate)" : "");
        d_dfc.upload(dfc_old);
        d_dproj.upload(dproj_old);
        mlp_backward(lt, k, d_dx.ptr, d_dfc.ptr, d_dproj.ptr, accumulate, d_dpre.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr,
                     d_proj.ptr, d_pre.ptr, d_post.ptr, T, C, H, nullptr);
        const auto dpre = d_dpre.download();
        const auto dprev = values(dpre);
        const std::vector<double> zero(size_t(H) * C, 0.0);
        const auto dfc_oldv = accumulate ? values(dfc_old) : zero, dproj_oldv = accumulate ? values(dproj_old) : zero;

        const Gemm dproj_ref = gemm(H, C, T, postv, 1, H, doutv, C, 1);  // post^T @ dout
        check_within("mlp backward dc_proj" + w, values(d_dproj.download()), plus(dproj_ref.out, dproj_oldv),
                     gemm_tolerance(dproj_ref, T, &dproj_oldv));
        // dpre = 2 * bf16(dout @ c_proj^T) * relu(pre): two roundings, 2^-7 relative
        const Gemm h_ref = gemm(T, H, C, doutv, C, 1, projv, 1, C);
        std::vector<double> dpre_want(dprev.size()), dpre_tol(dprev.size());
        for (size_t i = 0; i < dprev.size(); ++i) {
            const double r = std::max(prev[i], 0.0);
            dpre_want[i] = 2.0 * h_ref.out[i] * r;
            dpre_tol[i] = 2.0 * r * 1e-5 * std::sqrt(C + 1.0) * h_ref.mag[i] + std::fabs(dpre_want[i]) / 128 + 1e-30;
        }
        check_within("mlp backward dpre" + w, dprev, dpre_want, dpre_tol);
        const Gemm dfc_ref = gemm(H, C, T, dprev, 1, H, xv, C, 1);  // dpre^T @ x
        check_within("mlp backward dc_fc" + w, values(d_dfc.download()), plus(dfc_ref.out, dfc_oldv),
                     gemm_tolerance(dfc_ref, T, &dfc_oldv));
        const Gemm dx_ref = gemm(T, C, H, dprev, H, 1, fcv, C, 1);  // dpre @ c_fc
        check_within("mlp backward dx" + w, values(d_dx.download()), dx_ref.out, gemm_tolerance(dx_ref, H));
    }

    // dpre may reuse the post buffer: the same gradients, bit for bit
    const auto dx_sep = d_dx.download(), dfc_sep = d_dfc.download(), dproj_sep = d_dproj.download();
    d_dfc.upload(dfc_old);
    d_dproj.upload(dproj_old);
    mlp_backward(lt, k, d_dx.ptr, d_dfc.ptr, d_dproj.ptr, true, d_post.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr,
                 d_pre.ptr, d_post.ptr, T, C, H, nullptr);
    test::check(same_bits(d_dx.download(), dx_sep) && same_bits(d_dfc.download(), dfc_sep) &&
                    same_bits(d_dproj.download(), dproj_sep),
                "mlp backward with dpre in the post buffer gives the same bits%s", what.c_str());
    // post not kept: recomputed from pre inside the backward, the same bits again
    d_dfc.upload(dfc_old);
    d_dproj.upload(dproj_old);
    mlp_backward(lt, k, d_dx.ptr, d_dfc.ptr, d_dproj.ptr, true, d_dpre.ptr, d_dout.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr,
                 d_pre.ptr, nullptr, T, C, H, nullptr);
    test::check(same_bits(d_dx.download(), dx_sep) && same_bits(d_dfc.download(), dfc_sep) &&
                    same_bits(d_dproj.download(), dproj_sep),
                "mlp backward recomputing post (post null) gives the same bits%s", what.c_str());
}

// The backward against central differences of f = sum(G * mlp(x)) computed in double, at sampled
// entries of x, c_fc and c_proj (relu^2 is C^1, so differences converge everywhere).
void test_mlp_finite_differences(MlpKernel k, int T, int C, int H) {
    const auto x = normal_bf16(size_t(T) * C), c_fc = normal_bf16(size_t(H) * C, 0.0, 0.3),
               c_proj = normal_bf16(size_t(H) * C, 0.0, 0.3), G = normal_bf16(size_t(T) * C);
    DeviceBuffer<bf16> d_x(x), d_fc(c_fc), d_proj(c_proj), d_G(G), d_out(size_t(T) * C), d_pre(size_t(T) * H),
        d_post(size_t(T) * H), d_dpre(size_t(T) * H), d_dx(size_t(T) * C), d_dfc(size_t(H) * C), d_dproj(size_t(H) * C);
    CublasLt lt;
    mlp_forward(lt, k, d_out.ptr, d_pre.ptr, d_post.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr, T, C, H, nullptr);
    mlp_backward(lt, k, d_dx.ptr, d_dfc.ptr, d_dproj.ptr, false, d_dpre.ptr, d_G.ptr, d_x.ptr, d_fc.ptr, d_proj.ptr,
                 d_pre.ptr, d_post.ptr, T, C, H, nullptr);
    auto xv = values(x), fcv = values(c_fc), projv = values(c_proj);
    const auto Gv = values(G);
    const auto f = [&] {
        double sum = 0.0;
        for (int t = 0; t < T; ++t)
            for (int h = 0; h < H; ++h) {
                double pre = 0.0;
                for (int c = 0; c < C; ++c) pre += xv[size_t(t) * C + c] * fcv[size_t(h) * C + c];
                const double post = pre > 0 ? pre * pre : 0.0;
                for (int c = 0; c < C; ++c) sum += Gv[size_t(t) * C + c] * post * projv[size_t(h) * C + c];
            }
        return sum;
    };
    struct Param {
        const char* name;
        std::vector<double>* v;
        std::vector<double> grad;
    };
    Param params[] = {{"dx", &xv, values(d_dx.download())},
                      {"dc_fc", &fcv, values(d_dfc.download())},
                      {"dc_proj", &projv, values(d_dproj.download())}};
    for (Param& p : params) {
        std::vector<double> got, fd, tol;
        double scale = 0.0;
        for (double g : p.grad) scale = std::max(scale, std::fabs(g));
        for (int sample = 0; sample < 24; ++sample) {
            const size_t i = size_t(test::randint(0, int(p.v->size()) - 1));
            got.push_back(p.grad[i]);
            fd.push_back(test::central_difference((*p.v)[i], 1e-3, f));
            // bf16 intermediates (pre, post, the backward's h and dpre) each add ~2^-9 relative
            tol.push_back(std::fabs(fd.back()) / 32 + scale / 128);
        }
        check_within(std::string("mlp backward vs finite differences: ") + p.name + shape_text(k, T, C, H), got, fd, tol);
    }
}

// ---- the lambda-scaled weights ----
// One weight's data: w, the gradient of w_eff, an old dw to add to; its lambda and old dlambda (its
// own, or those of the weight `lambda_of` when they share one).
struct ScaledWeight {
    int64_t n;
    std::vector<bf16> w, dw_eff, dw_old;
    float lambda, dlambda_old;
    DeviceBuffer<bf16> d_w, d_weff, d_dweff, d_dw;
    DeviceBuffer<float> d_lambda, d_dlambda;
    ScaledWeight* lambda_of = this;
    explicit ScaledWeight(int64_t count)
        : n(count), w(normal_bf16(size_t(n), 0.0, 0.03)), dw_eff(normal_bf16(size_t(n), 0.0, 0.01)),
          dw_old(normal_bf16(size_t(n), 0.0, 0.01)), lambda(static_cast<float>(test::uniform(0.3, 1.5))),
          dlambda_old(static_cast<float>(test::uniform(-1, 1))), d_w(w), d_weff(size_t(n)), d_dweff(dw_eff),
          d_dw(dw_old), d_lambda(std::vector<float>{lambda}), d_dlambda(std::vector<float>{dlambda_old}) {}
    LambdaScaledForward forward() { return {d_weff.ptr, d_w.ptr, lambda_of->d_lambda.ptr, n}; }
    LambdaScaledBackward backward() {
        return {d_dw.ptr, lambda_of->d_dlambda.ptr, d_dweff.ptr, d_w.ptr, lambda_of->d_lambda.ptr, n};
    }
    void reset() {
        d_dw.upload(dw_old);
        d_dlambda.upload(std::vector<float>{dlambda_old});
    }
};
// Which weights of a launch share a lambda.
enum class Lambdas { own, first_two_shared };  // first_two_shared: the banks' [Wq; Wk] and Wv

void forward_all(std::vector<std::unique_ptr<ScaledWeight>>& ws) {
    if (ws.size() == 1) lambda_scaled_weight_forward({ws[0]->forward()}, nullptr);
    if (ws.size() == 2) lambda_scaled_weight_forward({ws[0]->forward(), ws[1]->forward()}, nullptr);
    if (ws.size() == 3) lambda_scaled_weight_forward({ws[0]->forward(), ws[1]->forward(), ws[2]->forward()}, nullptr);
}
void backward_all(std::vector<std::unique_ptr<ScaledWeight>>& ws, BlockPartials scratch, LambdaScaledAccumulate acc) {
    if (ws.size() == 1) lambda_scaled_weight_backward({ws[0]->backward()}, scratch, acc, nullptr);
    if (ws.size() == 2) lambda_scaled_weight_backward({ws[0]->backward(), ws[1]->backward()}, scratch, acc, nullptr);
    if (ws.size() == 3)
        lambda_scaled_weight_backward({ws[0]->backward(), ws[1]->backward(), ws[2]->backward()}, scratch, acc, nullptr);
}

// Against the exact products and dot (a shared lambda's dlambda: the sum of its weights' dots); the bits
// of each weight's launch alone and, for dlambda, of sum_fixed_order as a second launch over the
// partials of its weights. `sizes`: one launch's weights (1 to 3).
void test_lambda_scaled_weight(std::vector<int64_t> sizes, Lambdas lambdas = Lambdas::own) {
    std::string what = " n";
    for (int64_t n : sizes) what += " " + std::to_string(n);
    if (lambdas == Lambdas::first_two_shared) what += " (first two share a lambda)";
    std::vector<std::unique_ptr<ScaledWeight>> ws;
    for (int64_t n : sizes) ws.push_back(std::make_unique<ScaledWeight>(n));
    if (lambdas == Lambdas::first_two_shared) ws[1]->lambda_of = ws[0].get();
    const bool several = ws.size() > 1;
    size_t scratch_bytes = 0;
    for (const auto& p : ws) scratch_bytes += lambda_scaled_weight_backward_scratch_bytes({p->n});
    test::DevicePartials d_scratch(scratch_bytes);
    forward_all(ws);
    for (const auto& p : ws) {
        std::vector<double> want(size_t(p->n)), tol(size_t(p->n));
        for (size_t i = 0; i < want.size(); ++i) {
            want[i] = double(p->lambda_of->lambda) * value(p->w[i]);
            tol[i] = std::fabs(want[i]) / 256;  // one bf16 rounding (via fp32: 2^-9 + 2^-24)
        }
        check_within("lambda_scaled_weight_forward" + what, values(p->d_weff.download()), want, tol);
        if (several) {  // a launch of its own: the same bits
            DeviceBuffer<bf16> alone(size_t(p->n));
            lambda_scaled_weight_forward({{alone.ptr, p->d_w.ptr, p->lambda_of->d_lambda.ptr, p->n}}, nullptr);
            test::check(same_bits(alone.download(), p->d_weff.download()),
                        "lambda_scaled_weight_forward%s: weight of n %lld alone, the same bits", what.c_str(),
                        (long long)p->n);
        }
    }
    for (bool accumulate : {false, true}) {
        const std::string w_what = what + (accumulate ? " (accumulate)" : "");
        const LambdaScaledAccumulate acc{.dw = accumulate, .dlambda = accumulate};
        for (const auto& p : ws) p->reset();
        backward_all(ws, d_scratch.view(), acc);
        test::check(d_scratch.done.download()[0] == 0, "lambda_scaled_weight_backward%s: the counter is back at zero",
                    w_what.c_str());
        std::vector<std::vector<bf16>> dws;
        for (const auto& p : ws) {
            std::vector<double> want(size_t(p->n)), tol(size_t(p->n));
            for (size_t i = 0; i < want.size(); ++i) {
                const double o = accumulate ? value(p->dw_old[i]) : 0.0, d = double(p->lambda_of->lambda) * value(p->dw_eff[i]);
                want[i] = o + d;
                // the fp32 product and sum (2^-24 each, against the terms), then one bf16 rounding
                tol[i] = std::fabs(want[i]) / 256 + (std::fabs(o) + std::fabs(d)) * 0x1p-22 + 1e-30;
            }
            dws.push_back(p->d_dw.download());
            check_within("lambda_scaled_weight_backward dw" + w_what, values(dws.back()), want, tol);
        }
        int first_block = 0;
        for (size_t k = 0; k < ws.size(); ++k) {  // each lambda: its weights' dots
            ScaledWeight& p = *ws[k];
            if (p.lambda_of != &p) continue;
            double dot = 0.0, dot_mag = 0.0;
            int blocks = 0;
            for (const auto& q : ws) {
                if (q->lambda_of != &p) continue;
                for (size_t i = 0; i < q->w.size(); ++i) {
                    dot += value(q->dw_eff[i]) * value(q->w[i]);
                    dot_mag += std::fabs(value(q->dw_eff[i]) * value(q->w[i]));
                }
                blocks += lambda_scaled_weight_backward_blocks(q->n);
            }
            const auto dl = p.d_dlambda.download();
            const double got = dl[0], want_dl = dot + (accumulate ? p.dlambda_old : 0.0);
            test::check(std::fabs(got - want_dl) <= 1e-5 * (dot_mag + std::fabs(p.dlambda_old)) + 1e-12,
                        "lambda_scaled_weight_backward dlambda%s: got %.9g want %.9g", w_what.c_str(), got, want_dl);
            // dlambda: the bits of sum_fixed_order as a second launch over its weights' partials
            DeviceBuffer<float> second(std::vector<float>{p.dlambda_old});
            sum_fixed_order(second.ptr, d_scratch.partials.ptr + first_block, blocks, 1.0f, accumulate, nullptr);
            test::check(same_bits(second.download(), dl),
                        "lambda_scaled_weight_backward dlambda%s: sum_fixed_order's bits", w_what.c_str());
            first_block += blocks;
        }
        for (size_t k = 0; several && k < ws.size(); ++k) {  // a launch of its own: the same dw bits, and
            ScaledWeight& p = *ws[k];                        // the same dlambda bits for a lambda of its own
            const auto dl = p.lambda_of->d_dlambda.download();
            const bool own = p.lambda_of == &p && (k + 1 >= ws.size() || ws[k + 1]->lambda_of != &p);
            p.reset();
            p.lambda_of->reset();
            test::DevicePartials alone(lambda_scaled_weight_backward_scratch_bytes({p.n}));
            lambda_scaled_weight_backward({p.backward()}, alone.view(), acc, nullptr);
            test::check(same_bits(p.d_dw.download(), dws[k]) &&
                            (!own || same_bits(p.d_dlambda.download(), dl)),
                        "lambda_scaled_weight_backward%s: weight of n %lld alone, the same bits", w_what.c_str(),
                        (long long)p.n);
        }
    }
}

// Bad batches: weights sharing a lambda apart, or sharing a lambda but not its gradient.
void test_lambda_scaled_weight_refusals() {
    std::vector<std::unique_ptr<ScaledWeight>> ws;
    for (int i = 0; i < 3; ++i) ws.push_back(std::make_unique<ScaledWeight>(8 * 16));
    ws[2]->lambda_of = ws[0].get();
    test::check_fails_with("weights 0 and 2 sharing a lambda around weight 1", "share a lambda but are not adjacent",
                           [&] { forward_all(ws); });
    ws[2]->lambda_of = ws[2].get();
    ws[1]->lambda_of = ws[0].get();
    LambdaScaledBackward b1 = ws[1]->backward();
    b1.dlambda = ws[1]->d_dlambda.ptr;  // its own gradient slot under a shared lambda
    test::DevicePartials d_scratch(lambda_scaled_weight_backward_scratch_bytes({8 * 16, 8 * 16}));
    test::check_fails_with("a shared lambda with two gradient slots", "must share a dlambda exactly when they share a lambda",
                           [&] {
                               lambda_scaled_weight_backward({ws[0]->backward(), b1}, d_scratch.view(),
                                                             {.dw = false, .dlambda = false}, nullptr);
                           });
}

// f(lambda, w) = sum(G * lambda * w) in double: its differences against the backward given dw_eff = G.
void test_lambda_scaled_weight_finite_differences(int64_t n) {
    const auto w = normal_bf16(size_t(n), 0.0, 0.5), G = normal_bf16(size_t(n));
    const float lambda = 0.8f;
    DeviceBuffer<bf16> d_w(w), d_G(G), d_dw(static_cast<size_t>(n));
    DeviceBuffer<float> d_lambda(std::vector<float>{lambda}), d_dlambda(1);
    test::DevicePartials d_scratch(lambda_scaled_weight_backward_scratch_bytes({n}));
    lambda_scaled_weight_backward({{d_dw.ptr, d_dlambda.ptr, d_G.ptr, d_w.ptr, d_lambda.ptr, n}}, d_scratch.view(),
                                  {.dw = false, .dlambda = false}, nullptr);
    auto wv = values(w);
    const auto Gv = values(G);
    double lam = lambda;
    const auto f = [&] {
        double s = 0.0;
        for (size_t i = 0; i < wv.size(); ++i) s += Gv[i] * lam * wv[i];
        return s;
    };
    const double h = 1e-3;
    const double fd_lambda = test::central_difference(lam, h, f), got_lambda = d_dlambda.download()[0];
    double mag = 0.0;
    for (size_t i = 0; i < wv.size(); ++i) mag += std::fabs(Gv[i] * wv[i]);
    test::check(std::fabs(got_lambda - fd_lambda) <= 1e-5 * mag + 1e-9,
                "lambda_scaled_weight dlambda vs finite differences n %lld: got %.9g want %.9g", (long long)n,
                got_lambda, fd_lambda);
    const auto dw = values(d_dw.download());
    std::vector<double> got, fd, tol;
    for (int s = 0; s < 16; ++s) {
        const size_t i = size_t(test::randint(0, int(n) - 1));
        got.push_back(dw[i]);
        fd.push_back(test::central_difference(wv[i], h, f));
        tol.push_back(std::fabs(fd.back()) / 256 + 1e-9);
    }
    check_within("lambda_scaled_weight dw vs finite differences n " + std::to_string(n), got, fd, tol);
}

void test_sum_fixed_order(int n, float scale) {
    const auto x = test::uniform_vector(size_t(n), -2.0, 3.0);
    DeviceBuffer<float> d_x(x), d_out(std::vector<float>{4.0f});
    double want = 0.0, mag = 0.0;
    for (float v : x) {
        want += v;
        mag += std::fabs(v);
    }
    for (bool accumulate : {true, false}) {
        sum_fixed_order(d_out.ptr, d_x.ptr, n, scale, accumulate, nullptr);
        const double got = d_out.download()[0], w = (accumulate ? 4.0 : 0.0) + scale * want;
        test::check(std::fabs(got - w) <= 1e-6 * (std::fabs(scale) * mag + 4.0) + 1e-30,
                    "sum_fixed_order n %d scale %g%s: got %.9g want %.9g", n, scale, accumulate ? " (accumulate)" : "",
                    got, w);
    }
}

void test_shape_rules() {
    float* p = nullptr;
    test::check(bf16_packs_shape_error(64, {p}).empty() && !bf16_packs_shape_error(60, {p}).empty() &&
                    !bf16_packs_shape_error(64, {reinterpret_cast<char*>(p) + 4}).empty(),
                "elementwise shape rules (multiples of 8, 16-byte alignment)");
    test::check(mlp_shape_error(256, 128, 512).empty() && !mlp_shape_error(256, 100, 400).empty() &&
                    !mlp_shape_error(256, 128, 500).empty() && !mlp_shape_error(0, 128, 512).empty(),
                "mlp shape rules (C and H multiples of 8, T positive)");
    test::check(linear_relu_square_shape_error(3, 8, 32, {p}).empty() &&
                    linear_relu_square_shape_error(272, 768, 3072, {p}).empty() &&
                    !linear_relu_square_shape_error(256, 100, 512, {p}).empty() &&
                    !linear_relu_square_shape_error(256, 128, 500, {p}).empty() &&
                    !linear_relu_square_shape_error(0, 128, 512, {p}).empty() &&
                    !linear_relu_square_shape_error(256, 128, 512, {reinterpret_cast<char*>(p) + 8}).empty(),
                "linear_relu_square shape rules (C and H multiples of 8, T positive, 16-byte alignment)");
    // a bad call stops with the launcher's name and the reason, before touching memory
    bf16* fake = reinterpret_cast<bf16*>(256);
    test::check_fails_with("linear_relu_square_forward with C 100", "linear_relu_square_forward: C (100)", [=] {
        linear_relu_square_forward(MlpKernel::mma, fake, fake, fake, fake, 256, 100, 512, nullptr);
    });
    test::check_fails_with("linear_relu_square_forward with a misaligned buffer", "not 16-byte aligned", [=] {
        linear_relu_square_forward(MlpKernel::wgmma, fake, fake + 1, fake, fake, 256, 128, 512, nullptr);
    });
    test::check(!linear_relu_square_shape_error(65535 * kFcTileRows + 1, 128, 512, {p}).empty() &&
                    linear_relu_square_shape_error(65535 * kFcTileRows, 128, 512, {p}).empty(),
                "linear_relu_square shape rules (at most 65535 row tiles)");
    test::check_fails_with("linear_relu_square_backward with H 500", "linear_relu_square_backward: C (128) and H (500)",
                           [=] { linear_relu_square_backward(MlpKernel::wgmma, fake, fake, fake, fake, 256, 128, 500, nullptr); });
    test::check_fails_with("linear_relu_square_backward with a misaligned pre", "not 16-byte aligned", [=] {
        linear_relu_square_backward(MlpKernel::mma, fake, fake, fake, fake + 4, 256, 128, 512, nullptr);
    });
    const float* lambda = reinterpret_cast<const float*>(256);
    test::check_fails_with("lambda_scaled_weight_forward with 4 weights", "lambda_scaled_weight_forward: 4 weights",
                           [=] {
                               lambda_scaled_weight_forward({{fake, fake, lambda, 8},
                                                             {fake, fake, lambda, 8},
                                                             {fake, fake, lambda, 8},
                                                             {fake, fake, lambda, 8}},
                                                            nullptr);
                           });
    test::check_fails_with("lambda_scaled_weight_backward with n 12", "lambda_scaled_weight_backward: element count 12",
                           [=] {
                               lambda_scaled_weight_backward({{fake, nullptr, fake, fake, lambda, 8},
                                                              {fake, nullptr, fake, fake, lambda, 12}},
                                                             {}, {.dw = false, .dlambda = false}, nullptr);
                           });
}

// ---- benchmark: the MLP of one layer, its parts, and the attention's lambda-scaled weights ----
int bench_mlp(const bench::Options& o) {
    bench::Bench b(o);
    const int T = b.preset().T(), C = b.preset().C, H = b.preset().M;
    const std::string at = bench::fmt("T=%d C=%d H=%d", T, C, H);
    const double w_std = 0.5 / std::sqrt(double(C));
    DeviceBuffer<bf16> x(normal_bf16(size_t(T) * C)), c_fc(normal_bf16(size_t(H) * C, 0.0, w_std)),
        c_proj(normal_bf16(size_t(H) * C, 0.0, w_std)), dout(normal_bf16(size_t(T) * C, 0.0, 0.1)), out(size_t(T) * C),
        pre(size_t(T) * H), post(size_t(T) * H), dpre(size_t(T) * H), dx(size_t(T) * C), dfc(size_t(H) * C),
        dproj(size_t(H) * C);
    CublasLt lt;
    const MlpKernel k = default_mlp_kernel();
    b.run("mlp_forward", at + " " + mlp_kernel_name(k), [&](cudaStream_t s) {
        mlp_forward(lt, k, out.ptr, pre.ptr, post.ptr, x.ptr, c_fc.ptr, c_proj.ptr, T, C, H, s);
    });
    b.run("mlp_backward", at + " " + mlp_kernel_name(k), [&](cudaStream_t s) {
        mlp_backward(lt, k, dx.ptr, dfc.ptr, dproj.ptr, false, dpre.ptr, dout.ptr, x.ptr, c_fc.ptr, c_proj.ptr, pre.ptr,
                     post.ptr, T, C, H, s);
    });
    for (MlpKernel fc : {MlpKernel::mma, MlpKernel::wgmma}) {
        b.run("linear_relu_square_forward", at + " " + mlp_kernel_name(fc), [&](cudaStream_t s) {
            linear_relu_square_forward(fc, pre.ptr, post.ptr, x.ptr, c_fc.ptr, T, C, H, s);
        });
        b.run("linear_relu_square_backward", at + " " + mlp_kernel_name(fc), [&](cudaStream_t s) {
            linear_relu_square_backward(fc, dpre.ptr, dout.ptr, c_proj.ptr, pre.ptr, T, C, H, s);
        });
    }
    // the FP8 up-projection (record 84): the weights of a 12-layer bank, the input's quantization, the
    // e4m3 GEMM on both kernels and the whole forward
    {
        const int layers = 12;
        DeviceBuffer<bf16> bank(normal_bf16(size_t(layers) * H * C, 0.0, w_std));
        DeviceBuffer<__nv_fp8_e4m3> w8(size_t(layers) * H * C), xq(size_t(T) * C);
        DeviceBuffer<float> w_s(layers);
        DeviceBuffer<Fp8UpScales> scales(1);
        test::DevicePartials wp(mlp_fp8_weight_scratch_floats(layers, H, C) * sizeof(float)),
            xp(mlp_fp8_input_scratch_floats(T, C) * sizeof(float));
        b.run("mlp_fp8_quantize_weights", bench::fmt("%d layers of H=%d C=%d", layers, H, C), [&](cudaStream_t s) {
            mlp_fp8_quantize_weights({w8.ptr, w_s.ptr}, {bank.ptr, int64_t(H) * C, layers}, H, C, wp.view(), s);
        });
        const Fp8Up up{w8.ptr, w_s.ptr, xq.ptr, scales.ptr, xp.view()};
        b.run("mlp_fp8_quantize_input", bench::fmt("T=%d C=%d", T, C),
              [&](cudaStream_t s) { mlp_fp8_quantize_input(up, x.ptr, T, C, s); });
        for (MlpKernel fc : {MlpKernel::mma, MlpKernel::wgmma})
            b.run("linear_relu_square_forward_fp8", at + " " + mlp_kernel_name(fc), [&](cudaStream_t s) {
                linear_relu_square_forward_fp8(fc, pre.ptr, post.ptr, up, T, C, H, s);
            });
        b.run("mlp_forward_fp8", at + " " + mlp_kernel_name(k), [&](cudaStream_t s) {
            mlp_forward_fp8(lt, k, out.ptr, pre.ptr, post.ptr, x.ptr, up, c_proj.ptr, T, C, H, s);
        });
    }
    const int64_t n = int64_t(T) * H;
    b.run("relu_square_forward", bench::fmt("n=%lld (T x H)", (long long)n),
          [&](cudaStream_t s) { relu_square_forward(dpre.ptr, pre.ptr, n, s); });
    b.run("relu_square_backward", bench::fmt("n=%lld (T x H)", (long long)n),
          [&](cudaStream_t s) { relu_square_backward(dpre.ptr, post.ptr, pre.ptr, n, s); });

    // the attention's projections: w_eff = sa_lambda * w for [Wq; Wk; Wv] (3 C x C) and Wo (C x C)
    const int64_t n_qkv = int64_t(3) * C * C;
    const int64_t n_o = int64_t(C) * C, n_all = n_qkv + n_o;
    DeviceBuffer<bf16> w(normal_bf16(size_t(n_all), 0.0, 0.03)), w_eff(static_cast<size_t>(n_all)),
        dw_eff(normal_bf16(size_t(n_all), 0.0, 0.01)), dw(static_cast<size_t>(n_all));
    DeviceBuffer<float> lambda(std::vector<float>{0.5f, 0.7f}), dlambda(2);
    test::DevicePartials scratch(lambda_scaled_weight_backward_scratch_bytes({n_qkv, n_o}));
    const std::string shape = bench::fmt("qkv and o: n=%lld + %lld", (long long)n_qkv, (long long)n_o);
    b.run("lambda_scaled_weight_forward", shape, [&](cudaStream_t s) {
        lambda_scaled_weight_forward(
            {{w_eff.ptr, w.ptr, lambda.ptr, n_qkv}, {w_eff.ptr + n_qkv, w.ptr + n_qkv, lambda.ptr + 1, n_o}}, s);
    });
    b.run("lambda_scaled_weight_backward", shape, [&](cudaStream_t s) {
        lambda_scaled_weight_backward({{dw.ptr, dlambda.ptr, dw_eff.ptr, w.ptr, lambda.ptr, n_qkv},
                                       {dw.ptr + n_qkv, dlambda.ptr + 1, dw_eff.ptr + n_qkv, w.ptr + n_qkv,
                                        lambda.ptr + 1, n_o}},
                                      scratch.view(), {.dw = false, .dlambda = true}, s);
    });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_mlp(*o);
    test::seed();
    test_shape_rules();
    test_sum_fixed_order(5000, 1.0f);
    test_sum_fixed_order(37, -0.25f);
    test_sum_fixed_order(24, 0.5f);    // one warp
    test_sum_fixed_order(1100, 2.0f);  // more values than the largest block
    test_sum_fixed_order(0, 1.0f);

    test_relu_square_kernels(8 * 1000);
    test_relu_square_kernels(64 * 3072);

    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        test_linear_relu_square(k, 256, 128, 512);  // tiny preset
        test_linear_relu_square(k, 272, 128, 512);  // ragged: T not a multiple of the 128-row tile
        test_linear_relu_square(k, 512, 128, 512);
        test_linear_relu_square(k, 144, 768, 3072);  // record width, ragged T
        test_linear_relu_square(k, 200, 200, 136);   // C not a multiple of the 64-wide k-step, H of the tile, T of 16
        test_linear_relu_square(k, 3, 8, 32);        // less than one of everything
        test_linear_relu_square(k, 136, 64, 264);    // wgmma: a second 256-column tile of 8 columns, one k-step
        report_linear_relu_square_time(k, 512, 128, 512);

        test_linear_relu_square_backward(k, 256, 128, 512);  // tiny preset
        test_linear_relu_square_backward(k, 144, 768, 3072);  // record width, ragged T
        test_linear_relu_square_backward(k, 200, 200, 136);   // ragged C, H and T
        test_linear_relu_square_backward(k, 3, 8, 32);        // less than one of everything
        test_linear_relu_square_backward(k, 136, 64, 264);    // wgmma: ragged second column tile

        test_mlp(k, {256, 128, 512});  // tiny preset
        test_mlp(k, {24, 64, 256});
        test_mlp(k, {32, 768, 3072});  // record width
        test_mlp_finite_differences(k, 4, 16, 64);
        test_mlp_finite_differences(k, 3, 8, 32);
    }
    test_relu_square_backward_from_post_all();
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {  // record 87: post only
        test_linear_relu_square_post_only(k, 256, 128, 512);
        test_linear_relu_square_post_only(k, 136, 64, 264);  // ragged T, H past one wgmma tile
        test_linear_relu_square_post_only(k, 3, 8, 32);
        test_linear_relu_square_backward_post_only(k, 256, 128, 512);
        test_linear_relu_square_backward_post_only(k, 200, 200, 136);  // ragged C, H and T
        test_linear_relu_square_backward_post_only(k, 3, 8, 32);
        test_mlp_post_only(k, 136, 128, 512);
        test_mlp_fp8_forward_post_only(k, 200, 144, 136);
    }
    test_fc_kernels_agree(256, 128, 512);  // tiny preset
    test_fc_kernels_agree(144, 768, 3072);  // record width, ragged T; 12 k-steps: the ring wraps 3 times
    test_fc_kernels_agree(200, 200, 136);   // ragged C, H and T
    test_fc_kernels_agree(3, 8, 32);

    test_fp8_scale_division();
    test_mlp_fp8_shape_rules();
    test_mlp_fp8_quantize_weights(2, 512, 128, 2 * 512 * 128, -1);  // tiny preset's bank: c_fc and c_proj interleaved
    test_mlp_fp8_quantize_weights(3, 136, 144, 136 * 144 + 8, 1);    // ragged, a layer of zeros (the 1e-12 floor)
    test_mlp_fp8_quantize_weights(12, 3072, 768, 3072 * 768, -1);    // the record's bank
    test_mlp_fp8_forward(256, 128, 512);  // tiny preset
    test_mlp_fp8_forward(200, 144, 136);  // ragged T, H, and C: a 128-wide k-step and a partial one of 16
    test_mlp_fp8_forward(72, 768, 3072);  // record width, 6 k-steps
    test_mlp_fp8_forward(3, 16, 8);       // less than one of everything
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) test_mlp_forward_fp8(k, 136, 128, 512);
    // record 89
    test_mlp_fp8_down_weights(2, 512, 128, 2 * 512 * 128, -1, 4);  // tiny preset's bank: c_fc and c_proj interleaved
    test_mlp_fp8_down_weights(3, 144, 208, 144 * 208 + 8, 1, 5);   // ragged tiles, a zero layer, two bootstraps
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) {
        test_mlp_fp8_down_act(k, 256, 128, 512);  // tiny preset
        test_mlp_fp8_down_act(k, 200, 144, 136);  // ragged T, H and C
    }
    for (MlpKernel k : {MlpKernel::mma, MlpKernel::wgmma}) test_mlp_forward_fp8_down(k, 144, 128, 512);
    test_mlp_fp8_down_proj(256, 128, 512);  // tiny preset
    test_mlp_fp8_down_proj(48, 768, 3072);  // record width

    test_lambda_scaled_weight({3 * 128 * 128, 128 * 128});  // tiny preset's q, k, v and o
    test_lambda_scaled_weight({3 * 768 * 768, 768 * 768});  // the record's
    test_lambda_scaled_weight({768 * 768});
    test_lambda_scaled_weight({8 * 37, 8 * 5});
    test_lambda_scaled_weight({8 * 37});
    test_lambda_scaled_weight({2 * 128 * 128, 128 * 128, 128 * 128}, Lambdas::first_two_shared);  // record 80's banks
    test_lambda_scaled_weight({8 * 37, 8 * 5, 8 * 11}, Lambdas::first_two_shared);
    test_lambda_scaled_weight({8 * 5, 8 * 37, 8 * 11});
    test_lambda_scaled_weight_refusals();
    test_lambda_scaled_weight_finite_differences(8 * 64);
    return test::finish();
}
