// What every test program shares: a seeded generator (fresh each run, reproducible with
// TEST_SEED), checks that count, comparison against double-precision references (and the few
// references several tests need: sigmoid, RMSNorm), central differences, and the closing
// "N passed, M failed" line. Host code only; device buffers and bf16 helpers are in device_util.h.
#pragma once
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#ifndef __CUDACC__
namespace emu {
void allow_device_after_fork();  // emu/runtime_state.h
}
#endif

namespace test {

inline int& passed() { static int n = 0; return n; }
inline int& failed() { static int n = 0; return n; }

// The run's seed: TEST_SEED if set, else fresh; printed so a failure can be replayed.
inline uint64_t seed() {
    static const uint64_t s = [] {
        const char* env = std::getenv("TEST_SEED");
        uint64_t v = env ? std::strtoull(env, nullptr, 10) : (uint64_t(std::random_device{}()) << 32 | std::random_device{}());
        std::printf("TEST_SEED=%" PRIu64 "\n", v);
        return v;
    }();
    return s;
}
inline std::mt19937_64& rng() {
    static std::mt19937_64 g(seed());
    return g;
}
inline double uniform(double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng()); }
inline double normal(double mean = 0.0, double std = 1.0) { return std::normal_distribution<double>(mean, std)(rng()); }
inline int randint(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng()); }  // inclusive
inline std::vector<float> uniform_vector(size_t n, double lo, double hi) {
    std::vector<float> v(n);
    for (auto& x : v) x = static_cast<float>(uniform(lo, hi));
    return v;
}

// Records one check; prints the message when it fails.
inline bool check(bool ok, const char* fmt, ...) {
    if (ok) {
        ++passed();
        return true;
    }
    ++failed();
    std::va_list ap;
    va_start(ap, fmt);
    std::printf("FAIL: ");
    std::vprintf(fmt, ap);
    std::printf("\n");
    va_end(ap);
    return false;
}

// got[i] within atol + rtol*|want[i]| of want[i] for all i (NaN never matches); one check.
template <class G, class W>
bool check_close(const std::string& what, const G* got, const W* want, size_t n, double atol, double rtol) {
    double max_abs = 0.0;
    size_t bad = 0, first_bad = n;
    for (size_t i = 0; i < n; ++i) {
        const double g = static_cast<double>(got[i]), w = static_cast<double>(want[i]);
        const double err = std::fabs(g - w);
        if (!(err <= atol + rtol * std::fabs(w))) {
            if (!bad) first_bad = i;
            ++bad;
        }
        if (err > max_abs || err != err) max_abs = err;
    }
    if (bad)
        return check(false, "%s: %zu of %zu values off (max abs err %.3g); first at %zu: got %.8g want %.8g", what.c_str(),
                     bad, n, max_abs, first_bad, static_cast<double>(got[first_bad]), static_cast<double>(want[first_bad]));
    return check(true, "");
}
template <class G, class W>
bool check_close(const std::string& what, const std::vector<G>& got, const std::vector<W>& want, double atol, double rtol) {
    if (!check(got.size() == want.size(), "%s: size %zu, want %zu", what.c_str(), got.size(), want.size())) return false;
    return check_close(what, got.data(), want.data(), got.size(), atol, rtol);
}

// |got[i] - want[i]| <= tol[i] for all i (NaN never matches), each element with its own tolerance; one
// check, which reports the worst offender (relative to its tolerance).
inline bool check_within(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                         const std::vector<double>& tol) {
    if (got.size() != want.size() || tol.size() != want.size())
        return check(false, "%s: %zu values and %zu tolerances, want %zu", what.c_str(), got.size(), tol.size(),
                     want.size());
    if (got.empty()) return check(true, "");
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
    return check(bad == 0, "%s: %zu of %zu values off; worst at %zu: got %.9g want %.9g tol %.3g", what.c_str(), bad,
                 got.size(), worst, got[worst], want[worst], tol[worst]);
}

// |got - want| <= bound * scale element by element (scale: each value's expected error size, so a
// zero scale demands equality); returns the largest |got - want| / scale, for the log.
inline double check_within_scale(const std::string& what, const std::vector<double>& got, const std::vector<double>& want,
                                 const std::vector<double>& scale, double bound) {
    std::vector<double> tol(scale.size());
    double worst = 0.0;
    for (size_t i = 0; i < scale.size(); ++i) {
        tol[i] = bound * scale[i];
        if (scale[i] > 0 && i < got.size() && i < want.size()) worst = std::max(worst, std::fabs(got[i] - want[i]) / scale[i]);
    }
    check_within(what, got, want, tol);
    return worst;
}

// The same elements, bit for bit.
template <class T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

// d loss / d v by central differences with step h: `v` (a coordinate that loss() reads) is moved, then restored.
template <class F>
double central_difference(double& v, double h, F&& loss) {
    const double v0 = v;
    v = v0 + h;
    const double up = loss();
    v = v0 - h;
    const double down = loss();
    v = v0;
    return (up - down) / (2 * h);
}

// ---- double-precision references that more than one test needs ----
inline double sigmoid(double z) { return 1.0 / (1.0 + std::exp(-z)); }

constexpr double kRefRmsNormEps = 1.1920928955078125e-07;  // FLT_EPSILON, as F.rms_norm uses for fp32 compute

// y = x / sqrt(mean(x^2) + eps) over each of the T rows of C, and each row's rstd = 1 / sqrt(mean(x^2) + eps).
inline void ref_rmsnorm(const std::vector<double>& x, int T, int C, std::vector<double>& y, std::vector<double>& rstd) {
    y.assign(x.size(), 0.0);
    rstd.assign(T, 0.0);
    for (int t = 0; t < T; ++t) {
        const size_t o = size_t(t) * C;
        double ss = 0.0;
        for (int c = 0; c < C; ++c) ss += x[o + c] * x[o + c];
        rstd[t] = 1.0 / std::sqrt(ss / C + kRefRmsNormEps);
        for (int c = 0; c < C; ++c) y[o + c] = x[o + c] * rstd[t];
    }
}
// dx of L = sum dy * rmsnorm(x), the chain rule through both x and rstd(x); `magnitude` gets the size of the
// two terms of each element (what fp32 rounding errors are relative to).
inline void ref_rmsnorm_backward(const std::vector<double>& dy, const std::vector<double>& x, int T, int C,
                                 std::vector<double>& dx, std::vector<double>& magnitude) {
    dx.assign(x.size(), 0.0);
    magnitude.assign(x.size(), 0.0);
    for (int t = 0; t < T; ++t) {
        const size_t o = size_t(t) * C;
        double ss = 0.0, dot = 0.0;
        for (int c = 0; c < C; ++c) {
            ss += x[o + c] * x[o + c];
            dot += dy[o + c] * x[o + c];
        }
        const double ms = ss / C + kRefRmsNormEps, r = 1.0 / std::sqrt(ms);
        for (int c = 0; c < C; ++c) {  // d rstd / d x_c = -x_c / (C * ms^1.5)
            const double through_rstd = -dot * x[o + c] / (C * ms * std::sqrt(ms));
            dx[o + c] = dy[o + c] * r + through_rstd;
            magnitude[o + c] = std::fabs(dy[o + c] * r) + std::fabs(through_rstd);
        }
    }
}
// sum dy * rmsnorm(x): the loss whose gradient ref_rmsnorm_backward gives.
inline double ref_rmsnorm_dot(const std::vector<double>& dy, const std::vector<double>& x, int T, int C) {
    std::vector<double> y, rstd;
    ref_rmsnorm(x, T, C, y, rstd);
    double s = 0.0;
    for (size_t i = 0; i < y.size(); ++i) s += dy[i] * y[i];
    return s;
}

// Whether the child may use the device: never on a GPU (CUDA's context does not survive fork, and emu
// refuses it the same way), or, for an emu-only test of one of emu's own stops, which needs a kernel run.
enum class ChildDevice { as_on_gpu, emu_stop };
// Runs fn in a child process; checks that it exits non-zero with `phrase` in what it printed to
// stderr (bad input must stop with a clear message).
template <class F>
bool check_child_fails_with(const char* what, const char* phrase, F fn, ChildDevice device) {
    std::fflush(stdout);
    std::fflush(stderr);
    int fds[2];
    if (pipe(fds) != 0) return check(false, "%s: pipe failed", what);
    const pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        unsetenv("EMU_LAUNCH_LOG");  // a planted failure's launches are not the GPU build's (emu/exec.cpp)
#ifndef __CUDACC__
        if (device == ChildDevice::emu_stop) ::emu::allow_device_after_fork();
#else
        (void)device;
#endif
        fn();
        std::fflush(stderr);
        _exit(0);
    }
    close(fds[1]);
    std::string err;
    char buf[512];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(n));
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    const bool failed = WIFEXITED(status) && WEXITSTATUS(status) != 0;
    return check(failed && err.find(phrase) != std::string::npos,
                 "%s: expected a non-zero exit mentioning '%s'; got %s, stderr: %s", what, phrase,
                 failed ? "a failure" : "success", err.c_str());
}
// Bad input stops before any CUDA call: the child may make none (as on a GPU).
template <class F>
bool check_fails_with(const char* what, const char* phrase, F fn) {
    return check_child_fails_with(what, phrase, fn, ChildDevice::as_on_gpu);
}
// One of emu's own stops (a planted misuse that emu catches while a kernel runs): emu-only tests.
template <class F>
bool check_emu_stops_with(const char* what, const char* phrase, F fn) {
    return check_child_fails_with(what, phrase, fn, ChildDevice::emu_stop);
}

// Prints the closing line and gives the exit code.
inline int finish() {
    std::printf("%d passed, %d failed\n", passed(), failed());
    return failed() ? 1 : 0;
}

}  // namespace test
