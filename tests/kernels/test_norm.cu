// kernels/norm.cuh: RMSNorm forward and backward against double-precision loops on fresh random data
// (tiny and record widths, ragged row counts, a zero row and a large-scale row), the backward's
// reference against central finite differences, accumulation into an existing gradient, bitwise
// reproducibility, and the shape rules.
#include "../../kernels/norm.cuh"
#include "../test_util.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

template <class T>
struct DeviceBuffer {  // test-only owner of device memory
    T* ptr = nullptr;
    size_t n;
    explicit DeviceBuffer(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T))); }
    explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
    ~DeviceBuffer() { cudaFree(ptr); }
    DeviceBuffer(const DeviceBuffer&) = delete;
    DeviceBuffer& operator=(const DeviceBuffer&) = delete;
    void upload(const std::vector<T>& h) {
        CUDA_CHECK(cudaMemcpy(ptr, h.data(), n * sizeof(T), cudaMemcpyHostToDevice));
    }
    std::vector<T> download() const {
        std::vector<T> h(n);
        CUDA_CHECK(cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost));
        return h;
    }
};

std::vector<bf16> random_bf16(size_t n, double std) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(static_cast<float>(test::normal(0.0, std)));
    return v;
}
std::vector<double> values(const std::vector<bf16>& v) {
    std::vector<double> d(v.size());
    for (size_t i = 0; i < v.size(); ++i) d[i] = __bfloat162float(v[i]);
    return d;
}
std::vector<double> values(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }
template <class T>
bool bitwise_equal(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// One check: |got[i] - want[i]| <= tol[i] for every i; reports the worst offender.
bool check_within(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                  const std::vector<double>& tol) {
    if (!test::check(got.size() == want.size(), "%s: %zu values, want %zu", what.c_str(), got.size(), want.size()))
        return false;
    size_t bad = 0, worst = 0;
    double worst_ratio = -1.0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double err = std::fabs(got[i] - want[i]), ratio = err / tol[i];
        if (!(err <= tol[i])) ++bad;
        if (!(ratio <= worst_ratio)) {  // NaN counts as worst
            worst_ratio = ratio;
            worst = i;
        }
    }
    return test::check(bad == 0, "%s: %zu of %zu values off; worst at %zu: got %.8g want %.8g tol %.3g", what.c_str(),
                       bad, got.size(), worst, got[worst], want[worst], tol[worst]);
}

// ---- the double-precision reference ----
constexpr double kEps = 1.1920928955078125e-07;  // FLT_EPSILON, as F.rms_norm uses for fp32 compute

void ref_rmsnorm(const std::vector<double>& x, int T, int C, std::vector<double>& y, std::vector<double>& rstd) {
    y.assign(x.size(), 0.0);
    rstd.assign(T, 0.0);
    for (int t = 0; t < T; ++t) {
        double ss = 0.0;
        for (int c = 0; c < C; ++c) ss += x[size_t(t) * C + c] * x[size_t(t) * C + c];
        rstd[t] = 1.0 / std::sqrt(ss / C + kEps);
        for (int c = 0; c < C; ++c) y[size_t(t) * C + c] = x[size_t(t) * C + c] * rstd[t];
    }
}

// dx of L = sum dy * y(x), the chain rule through both x and rstd(x); `scale` gets the magnitude of the
// two terms of each element (what fp32 rounding errors are relative to).
void ref_rmsnorm_backward(const std::vector<double>& dy, const std::vector<double>& x, int T, int C,
                          std::vector<double>& dx, std::vector<double>& scale) {
    dx.assign(x.size(), 0.0);
    scale.assign(x.size(), 0.0);
    for (int t = 0; t < T; ++t) {
        const double* xr = &x[size_t(t) * C];
        const double* dyr = &dy[size_t(t) * C];
        double ss = 0.0, dot = 0.0;
        for (int c = 0; c < C; ++c) {
            ss += xr[c] * xr[c];
            dot += dyr[c] * xr[c];
        }
        const double ms = ss / C + kEps, r = 1.0 / std::sqrt(ms);
        // d rstd / d x_c = -x_c / (C * ms^1.5)
        for (int c = 0; c < C; ++c) {
            const double through_rstd = dot * (-xr[c] / (C * ms * std::sqrt(ms)));
            dx[size_t(t) * C + c] = dyr[c] * r + through_rstd;
            scale[size_t(t) * C + c] = std::fabs(dyr[c] * r) + std::fabs(through_rstd);
        }
    }
}

double loss_of(const std::vector<double>& dy, const std::vector<double>& x, int T, int C) {
    std::vector<double> y, rstd;
    ref_rmsnorm(x, T, C, y, rstd);
    double l = 0.0;
    for (size_t i = 0; i < y.size(); ++i) l += dy[i] * y[i];
    return l;
}

// ---- checks ----
// Data for T rows of width C: row 0 all zeros (rstd = 1/sqrt(eps)), row 1 at a large scale.
std::vector<bf16> norm_input(int T, int C) {
    auto x = random_bf16(size_t(T) * C, 1.0);
    if (T > 2) {
        for (int c = 0; c < C; ++c) x[c] = __float2bfloat16(0.0f);
        for (int c = 0; c < C; ++c) x[C + c] = __float2bfloat16(300.0f * __bfloat162float(x[C + c]));
    }
    return x;
}

void check_shape(int T, int C) {
    const std::string at = " T=" + std::to_string(T) + " C=" + std::to_string(C);
    const auto x = norm_input(T, C), dy = random_bf16(size_t(T) * C, 1.0), old = random_bf16(size_t(T) * C, 1.0);
    const auto xd = values(x), dyd = values(dy), oldd = values(old);
    DeviceBuffer<bf16> dx_in(x), d_dy(dy), d_y(x.size()), d_dx(x.size());
    DeviceBuffer<float> d_rstd(T);

    // forward: y within its bf16 rounding (at most 2^-8 relative, plus fp32 and rsqrt error: rtol 2^-7);
    // rstd is fp32 (rtol 1e-5)
    rmsnorm_forward(d_y.ptr, d_rstd.ptr, dx_in.ptr, T, C, nullptr);
    std::vector<double> y_ref, rstd_ref;
    ref_rmsnorm(xd, T, C, y_ref, rstd_ref);
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
    ref_rmsnorm_backward(dyd, xd, T, C, dx_ref, scale);
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
    test::check(bitwise_equal(d_y.download(), y) && bitwise_equal(d_rstd.download(), rstd) &&
                    bitwise_equal(d_dx.download(), dx),
                "rmsnorm forward/backward reproducible%s", at.c_str());
}

// The reference backward against central differences of the reference forward (in double), and the
// kernel's backward against the same differences at bf16 tolerance.
void check_finite_differences() {
    const int T = 3, C = 16;
    const auto x = random_bf16(T * C, 1.0), dy = random_bf16(T * C, 1.0);
    const auto xd = values(x), dyd = values(dy);
    std::vector<double> dx_ref, scale, fd(xd.size());
    ref_rmsnorm_backward(dyd, xd, T, C, dx_ref, scale);
    for (size_t i = 0; i < xd.size(); ++i) {
        const double h = 1e-5;
        auto xp = xd, xm = xd;
        xp[i] += h;
        xm[i] -= h;
        fd[i] = (loss_of(dyd, xp, T, C) - loss_of(dyd, xm, T, C)) / (2 * h);
    }
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

int main() {
    test::seed();
    check_shape_rules();
    // tiny preset widths and lengths, a record-width ragged T, the widest row, the narrowest, an odd width
    const int shapes[][2] = {{256, 128}, {1024, 128}, {77, 768}, {19, 1024}, {5, 8}, {13, 136}};
    for (const auto& s : shapes) check_shape(s[0], s[1]);
    check_finite_differences();
    return test::finish();
}
