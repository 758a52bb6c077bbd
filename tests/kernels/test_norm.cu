// kernels/norm.cuh: RMSNorm forward and backward against double-precision loops on fresh random data
// (tiny and record widths, ragged row counts, a zero row and a large-scale row), the backward's
// reference against central finite differences, accumulation into an existing gradient, bitwise
// reproducibility, and the shape rules.
#include "../../kernels/norm.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

using test::check_within;
using test::DeviceBuffer;
using test::normal_bf16;
using test::same_bits;
using test::values;

// ---- checks ----
// Data for T rows of width C: row 0 all zeros (rstd = 1/sqrt(eps)), row 1 at a large scale.
std::vector<bf16> norm_input(int T, int C) {
    auto x = normal_bf16(size_t(T) * C);
    if (T > 2) {
        for (int c = 0; c < C; ++c) x[c] = __float2bfloat16(0.0f);
        for (int c = 0; c < C; ++c) x[C + c] = __float2bfloat16(300.0f * __bfloat162float(x[C + c]));
    }
    return x;
}

void check_shape(int T, int C) {
    const std::string at = " T=" + std::to_string(T) + " C=" + std::to_string(C);
    const auto x = norm_input(T, C), dy = normal_bf16(size_t(T) * C), old = normal_bf16(size_t(T) * C);
    const auto xd = values(x), dyd = values(dy), oldd = values(old);
    DeviceBuffer<bf16> dx_in(x), d_dy(dy), d_y(x.size()), d_dx(x.size());
    DeviceBuffer<float> d_rstd(T);

    // forward: y within its bf16 rounding (at most 2^-8 relative, plus fp32 and rsqrt error: rtol 2^-7);
    // rstd is fp32 (rtol 1e-5)
    rmsnorm_forward(d_y.ptr, d_rstd.ptr, dx_in.ptr, T, C, nullptr);
    std::vector<double> y_ref, rstd_ref;
    test::ref_rmsnorm(xd, T, C, y_ref, rstd_ref);
    const auto y = d_y.download();
    const auto rstd = d_rstd.download();
    std::vector<double> tol(y_ref.size());
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = std::fabs(y_ref[i]) / 128 + 1e-30;
    check_within("rmsnorm_forward y" + at, values(y), y_ref, tol);
    std::vector<double> rtol(T);
    for (int t = 0; t < T; ++t) rtol[t] = 1e-5 * rstd_ref[t];
    check_within("rmsnorm_forward rstd" + at, values(rstd), rstd_ref, rtol);

    // backward: bf16 output rounding (rtol 2^-7) plus fp32 error against the terms' magnitude (1e-5)
    std::vector<double> dx_ref, scale;
    test::ref_rmsnorm_backward(dyd, xd, T, C, dx_ref, scale);
    rmsnorm_backward(d_dx.ptr, d_dy.ptr, dx_in.ptr, d_rstd.ptr, T, C, false, nullptr);
    const auto dx = d_dx.download();
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = std::fabs(dx_ref[i]) / 128 + 1e-5 * scale[i] + 1e-30;
    check_within("rmsnorm_backward dx" + at, values(dx), dx_ref, tol);

    // accumulate: dx = bf16(old + grad), one rounding of the sum
    d_dx.upload(old);
    rmsnorm_backward(d_dx.ptr, d_dy.ptr, dx_in.ptr, d_rstd.ptr, T, C, true, nullptr);
    const auto dx_acc = d_dx.download();
    std::vector<double> acc_ref(dx_ref.size());
    for (size_t i = 0; i < tol.size(); ++i) {
        acc_ref[i] = oldd[i] + dx_ref[i];
        tol[i] = std::fabs(acc_ref[i]) / 128 + 1e-5 * (scale[i] + std::fabs(oldd[i])) + 1e-30;
    }
    check_within("rmsnorm_backward accumulate" + at, values(dx_acc), acc_ref, tol);

    // the same inputs give the same bits
    rmsnorm_forward(d_y.ptr, d_rstd.ptr, dx_in.ptr, T, C, nullptr);
    rmsnorm_backward(d_dx.ptr, d_dy.ptr, dx_in.ptr, d_rstd.ptr, T, C, false, nullptr);
    test::check(same_bits(d_y.download(), y) && same_bits(d_rstd.download(), rstd) && same_bits(d_dx.download(), dx),
                "rmsnorm forward/backward reproducible%s", at.c_str());
}

// The reference backward against central differences of the reference forward (in double), and the
// kernel's backward against the same differences at bf16 tolerance.
void check_finite_differences() {
    const int T = 3, C = 16;
    const auto x = normal_bf16(T * C), dy = normal_bf16(T * C);
    auto xd = values(x);
    const auto dyd = values(dy);
    std::vector<double> dx_ref, scale, fd(xd.size());
    test::ref_rmsnorm_backward(dyd, xd, T, C, dx_ref, scale);
    for (size_t i = 0; i < xd.size(); ++i)
        fd[i] = test::central_difference(xd[i], 1e-5, [&] { return test::ref_rmsnorm_dot(dyd, xd, T, C); });
    std::vector<double> tol(fd.size());
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = 1e-7 * (scale[i] + 1.0);
    check_within("rmsnorm reference backward vs finite differences", dx_ref, fd, tol);

    DeviceBuffer<bf16> d_x(x), d_dy(dy), d_y(x.size()), d_dx(x.size());
    DeviceBuffer<float> d_rstd(T);
    rmsnorm_forward(d_y.ptr, d_rstd.ptr, d_x.ptr, T, C, nullptr);
    rmsnorm_backward(d_dx.ptr, d_dy.ptr, d_x.ptr, d_rstd.ptr, T, C, false, nullptr);
    for (size_t i = 0; i < tol.size(); ++i) tol[i] = std::fabs(fd[i]) / 128 + 1e-5 * scale[i] + 1e-7;
    check_within("rmsnorm_backward kernel vs finite differences", values(d_dx.download()), fd, tol);
}

void check_shape_rules() {
    test::check(norm_rows_shape_error(256, 128) == nullptr && norm_rows_shape_error(1, 8) == nullptr &&
                    norm_rows_shape_error(7, 768) == nullptr && norm_rows_shape_error(3, 1024) == nullptr,
                "supported shapes accepted");
    test::check(norm_rows_shape_error(0, 128) != nullptr, "T = 0 rejected");
    test::check(norm_rows_shape_error(4, 0) != nullptr && norm_rows_shape_error(4, 12) != nullptr &&
                    norm_rows_shape_error(4, 100) != nullptr,
                "C not a positive multiple of 8 rejected");
    test::check(norm_rows_shape_error(4, 1032) != nullptr, "C wider than a warp's registers rejected");
}

// ---- benchmark ----
int bench_norm(const bench::Options& o) {
    bench::Bench b(o);
    const int T = b.preset().T(), C = b.preset().C;
    const std::string shape = bench::fmt("T=%d C=%d", T, C);
    DeviceBuffer<bf16> x(norm_input(T, C)), dy(normal_bf16(size_t(T) * C)), y(size_t(T) * C), dx(size_t(T) * C);
    DeviceBuffer<float> rstd(T);
    b.run("rmsnorm_forward", shape, [&](cudaStream_t s) { rmsnorm_forward(y.ptr, rstd.ptr, x.ptr, T, C, s); });
    b.run("rmsnorm_backward", shape,
          [&](cudaStream_t s) { rmsnorm_backward(dx.ptr, dy.ptr, x.ptr, rstd.ptr, T, C, false, s); });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_norm(*o);
    test::seed();
    check_shape_rules();
    // tiny preset widths and lengths, a record-width ragged T, the widest row, the narrowest, an odd width
    const int shapes[][2] = {{256, 128}, {1024, 128}, {77, 768}, {19, 1024}, {5, 8}, {13, 136}};
    for (const auto& s : shapes) check_shape(s[0], s[1]);
    check_finite_differences();
    return test::finish();
}
