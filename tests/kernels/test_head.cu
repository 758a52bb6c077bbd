// kernels/head.cuh: FP8 quantization bit for bit against a reference written from the formats'
// definitions, the FP8 lm_head forward/backward and the bf16 eval lm_head against double GEMMs of
// the exact (dequantized) operands, the softcapped multi-token-prediction loss forward/backward
// and the eval loss against double-precision loops, a finite-difference check of the loss
// backward, and the fused e5m2 loss backward against the bf16 backward then the quantization, byte
// for byte; record 80's cross-entropy (forward, fused e5m2 backward) against a double-precision
// reference, codes equal except within the kernels' error of an e5m2 rounding boundary.
#include "../../kernels/head.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;
using e4m3 = __nv_fp8_e4m3;
using e5m2 = __nv_fp8_e5m2;

using test::check_within;
using test::DeviceBuffer;
using test::normal_bf16;
using test::to_bf16;
using test::value;
using test::values;

template <class T>
std::vector<unsigned char> bytes_of(const std::vector<T>& v) {
    std::vector<unsigned char> b(v.size() * sizeof(T));
    std::memcpy(b.data(), v.data(), b.size());
    return b;
}

// ============================ FP8 reference, from the definitions ============================
// A format 1.E.M with bias b: exponent field e, mantissa m. e = 0 is subnormal: m 2^(1-b-M);
// otherwise (1 + m 2^-M) 2^(e-b). e4m3fn: only S.1111.111 is NaN (no inf). e5m2: e = 31 is inf
// (m = 0) or NaN.
struct Fp8Ref {
    int E, M, bias;
    bool has_inf;
    unsigned max_code() const { return has_inf ? 0x7Bu : 0x7Eu; }  // largest finite
    // The value of a code read as if the exponent range went on (also for the code after max_code).
    double extended(unsigned code) const {
        const unsigned e = (code >> M) & ((1u << E) - 1), m = code & ((1u << M) - 1);
        const double mag =
            e == 0 ? std::ldexp(double(m), 1 - bias - M) : std::ldexp(1.0 + std::ldexp(double(m), -M), int(e) - bias);
        return (code & 0x80u) ? -mag : mag;
    }
    // extended(0 .. max_code + 1), computed once per format
    const std::vector<double>& non_negative_values() const {
        static std::vector<double> cache[2];  // [has_inf]: e4m3, e5m2
        std::vector<double>& g = cache[has_inf ? 1 : 0];
        if (g.empty())
            for (unsigned c = 0; c <= max_code() + 1; ++c) g.push_back(extended(c));
        return g;
    }
    double decode(unsigned code) const {
        const unsigned e = (code >> M) & ((1u << E) - 1), m = code & ((1u << M) - 1);
        if (has_inf && e == (1u << E) - 1) return m == 0 ? ((code & 0x80u) ? -INFINITY : INFINITY) : NAN;
        if (!has_inf && (code & 0x7Fu) == 0x7Fu) return NAN;
        return extended(code);
    }
    // Nearest code with ties to even (even mantissa = even code), rounding as if unbounded; a result
    // past the largest finite value overflows to NaN (e4m3) / inf (e5m2), or to +-max when saturating.
    unsigned encode(float v, bool saturate) const {
        const unsigned sign = std::signbit(v) ? 0x80u : 0u;
        if (std::isnan(v)) return sign | 0x7Fu;
        const double a = std::fabs(double(v));
        const unsigned past = max_code() + 1;  // its extended value is the next step above max
        // non-negative codes in order are values in increasing order: find the neighbours of a
        const std::vector<double>& grid = non_negative_values();
        unsigned best = past;
        if (a <= grid[past]) {
            const unsigned hi = static_cast<unsigned>(std::lower_bound(grid.begin(), grid.end(), a) - grid.begin());
            best = hi;
            if (hi > 0) {
                const double below = a - grid[hi - 1], above = grid[hi] - a;
                if (below < above || (below == above && (hi - 1) % 2 == 0)) best = hi - 1;
            }
        }
        if (best == past) best = saturate ? max_code() : (has_inf ? 0x7Cu : 0x7Fu);
        return sign | best;
    }
};
constexpr Fp8Ref kRefE4M3{4, 3, 7, false}, kRefE5M2{5, 2, 15, true};
template <class F8>
const Fp8Ref& ref_of() {
    if constexpr (std::is_same_v<F8, e4m3>)
        return kRefE4M3;
    else
        return kRefE5M2;
}
template <Fp8Overflow o>
constexpr bool saturates = o == Fp8Overflow::saturate;

// The reference decoder agrees with CUDA's fp8 types (which the GEMMs read) on all 256 codes.
template <class F8>
void check_decoding(const char* name) {
    size_t bad = 0;
    for (unsigned c = 0; c < 256; ++c) {
        F8 f;
        f.__x = static_cast<__nv_fp8_storage_t>(c);
        const double mine = ref_of<F8>().decode(c), cuda = static_cast<float>(f);
        if (!(mine == cuda || (std::isnan(mine) && std::isnan(cuda)))) ++bad;
    }
    test::check(bad == 0, "%s: %zu of 256 codes decode differently from CUDA's type", name, bad);
    const double max = ref_of<F8>().decode(ref_of<F8>().max_code());
    test::check(max == (std::is_same_v<F8, e4m3> ? 448.0 : 57344.0), "%s: largest finite %g", name, max);
}

template <class F8, Fp8Overflow overflow>
__global__ void fp8_codes_of_floats(unsigned char* codes, const float* v, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) codes[i] = fp8_code_from_float<F8, overflow>(v[i]);
}

// Every finite value, every midpoint between neighbours (ties) and the floats on either side of
// it, the overflow thresholds, zeros, infinities, NaNs, fp32 subnormals and random floats.
template <class F8>
std::vector<float> conversion_cases() {
    const Fp8Ref& f = ref_of<F8>();
    std::vector<float> v;
    const auto add_signed = [&](float x) {
        v.push_back(x);
        v.push_back(-x);
    };
    for (unsigned c = 0; c <= f.max_code() + 1; ++c) {
        const float x = static_cast<float>(f.extended(c));
        add_signed(x);
        add_signed(std::nextafter(x, 0.0f));
        add_signed(std::nextafter(x, INFINITY));
        if (c > 0) {
            const float mid = static_cast<float>((f.extended(c - 1) + f.extended(c)) / 2);  // exact in fp32
            add_signed(mid);
            add_signed(std::nextafter(mid, 0.0f));
            add_signed(std::nextafter(mid, INFINITY));
        }
    }
    for (float x :
         {0.0f,   INFINITY, NAN,     1e-45f, 1e-40f, 1.1754942e-38f, FLT_MIN,  1e-12f,   1e30f,    FLT_MAX,  449.0f,
          464.0f, 465.0f,   479.99f, 480.0f, 500.0f, 57344.0f,       61439.0f, 61440.0f, 61441.0f, 65536.0f, 1e5f})
        add_signed(x);
    for (int i = 0; i < 20000; ++i) {
        add_signed(static_cast<float>(std::ldexp(test::uniform(1.0, 2.0), test::randint(-30, 20))));
        uint32_t bits = static_cast<uint32_t>(test::rng()());
        float x;
        std::memcpy(&x, &bits, 4);
        v.push_back(x);
    }
    return v;
}

template <class F8, Fp8Overflow overflow>
void check_conversion(const char* name) {
    const auto cases = conversion_cases<F8>();
    DeviceBuffer<float> d_in(cases);
    DeviceBuffer<unsigned char> d_codes(cases.size());
    const int n = static_cast<int>(cases.size());
    launch(fp8_codes_of_floats<F8, overflow>, dim3(ceil_div(n, 256)), dim3(256), 0, nullptr, d_codes.ptr, d_in.ptr, n);
    CUDA_CHECK_LAUNCH();
    const auto got = d_codes.download();
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < cases.size(); ++i)
        if (got[i] != ref_of<F8>().encode(cases[i], saturates<overflow>)) {
            if (!bad) first = i;
            ++bad;
        }
    test::check(
        bad == 0, "%s: %zu of %zu floats convert wrongly; first %.9g (bits %08x): got %02x want %02x", name, bad,
        cases.size(), bad ? cases[first] : 0.0f,
        [&] {
            uint32_t b;
            std::memcpy(&b, &cases[first], 4);
            return b;
        }(),
        bad ? got[first] : 0, bad ? ref_of<F8>().encode(cases[first], saturates<overflow>) : 0);
}

// Spot checks of the thresholds the two semantics are known for (torch eager and Triton's satfinite).
void check_known_values() {
    const auto code = [](auto f) { return static_cast<unsigned>(f); };
    test::check(code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(464.0f)) == 0x7E &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(464.0001f)) == 0x7F &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(-1e9f)) == 0xFF &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::saturate>(-1e9f)) == 0xFE &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::saturate>(INFINITY)) == 0x7E,
                "e4m3 overflow: 464 -> 448, above -> NaN (eager) or 448 (saturate)");
    test::check(code(fp8_code_from_float<e5m2, Fp8Overflow::nan_or_inf>(61439.99f)) == 0x7B &&
                    code(fp8_code_from_float<e5m2, Fp8Overflow::nan_or_inf>(61440.0f)) == 0x7C &&
                    code(fp8_code_from_float<e5m2, Fp8Overflow::nan_or_inf>(-INFINITY)) == 0xFC &&
                    code(fp8_code_from_float<e5m2, Fp8Overflow::saturate>(61440.0f)) == 0x7B,
                "e5m2 overflow: 61440 (a tie, odd max) -> inf (eager) or 57344 (saturate)");
    test::check(code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(std::ldexp(1.0f, -10))) == 0x00 &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(std::ldexp(1.5f, -9))) == 0x02 &&
                    code(fp8_code_from_float<e4m3, Fp8Overflow::nan_or_inf>(-std::ldexp(1.0f, -11))) == 0x80 &&
                    code(fp8_code_from_float<e5m2, Fp8Overflow::nan_or_inf>(std::ldexp(1.0f, -17))) == 0x00 &&
                    code(fp8_code_from_float<e5m2, Fp8Overflow::nan_or_inf>(std::ldexp(1.5f, -16))) == 0x02,
                "subnormal ties round to even, negative underflow keeps its sign");
}

// quantize_fp8_two_layouts on a bf16 matrix with a scale: both layouts, every element bit for bit.
template <class F8, Fp8Overflow overflow>
void check_quantize(const char* name, int rows, int cols, float scale) {
    auto x = normal_bf16(size_t(rows) * cols, 0.0, 1.0);
    // a sprinkling of values for every rounding regime: tiny, huge, infinities, NaN, signed zero
    for (size_t i = 0; i < x.size(); i += 7) {
        const double special[] = {1e-6, -3e-5, 1e6, -1e5, 70000.0, INFINITY, -INFINITY, NAN, -0.0, 0.0, 480.0, -470.0};
        x[i] = to_bf16(special[test::randint(0, 11)] * (test::randint(0, 1) ? scale : 1.0));
    }
    DeviceBuffer<bf16> d_x(x);
    DeviceBuffer<float> d_scale(std::vector<float>{scale});
    DeviceBuffer<F8> d_out(x.size()), d_out_t(x.size());
    quantize_fp8_two_layouts<F8, overflow>(d_out.ptr, d_out_t.ptr, d_x.ptr, d_scale.ptr, rows, cols, nullptr);
    const auto out = bytes_of(d_out.download()), out_t = bytes_of(d_out_t.download());
    size_t bad = 0, bad_t = 0;
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
            const float q = static_cast<float>(value(x[size_t(r) * cols + c])) / scale;  // the fp32 quotient
            const unsigned want = ref_of<F8>().encode(q, saturates<overflow>);
            bad += out[size_t(r) * cols + c] != want;
            bad_t += out_t[size_t(c) * rows + r] != want;
        }
    test::check(bad == 0 && bad_t == 0, "quantize %s %dx%d scale %g: %zu codes wrong, %zu transposed codes wrong", name,
                rows, cols, scale, bad, bad_t);
}

void test_quantization() {
    check_decoding<e4m3>("e4m3 decode");
    check_decoding<e5m2>("e5m2 decode");
    check_known_values();
    check_conversion<e4m3, Fp8Overflow::nan_or_inf>("e4m3 eager (NaN on overflow)");
    check_conversion<e4m3, Fp8Overflow::saturate>("e4m3 saturating");
    check_conversion<e5m2, Fp8Overflow::nan_or_inf>("e5m2 eager (inf on overflow)");
    check_conversion<e5m2, Fp8Overflow::saturate>("e5m2 saturating");
    const LmHeadFp8Scales s = lm_head_fp8_scales(2.0);  // record 71's grad_scale, one step
    check_quantize<e4m3, Fp8Overflow::nan_or_inf>("e4m3 eager", 64, 64, s.x);
    check_quantize<e4m3, Fp8Overflow::saturate>("e4m3 saturating", 48, 80, s.w);  // ragged tiles both ways
    check_quantize<e5m2, Fp8Overflow::nan_or_inf>("e5m2 eager", 80, 208, s.grad);
    check_quantize<e5m2, Fp8Overflow::saturate>("e5m2 saturating", 144, 16, 3.0f);
    check_quantize<e4m3, kLmHeadFp8Overflow>("e4m3 lm_head mode", 128, 768, s.x);
}

// ============================ the lm_head ============================
// The tolerance of an fp32-accumulated GEMM element: the accumulation error grows like sqrt(K)
// against sum_k |a b| (more on the GPU with fast accumulation), plus the bf16 output's rounding
// (at most 2^-9 relative: 2^-8 allowed).
// On a GPU, fp8 tensor cores add with fewer bits than fp32 (fast accumulation, and between cuBLASLt's
// promotions without it: the H200 run of 2026-11-29 found 2 of 6.4 million dw outputs just past 1e-5),
// and a bf16 output accumulated in place may have its product rounded to bf16 before the old value is
// added (as test_matmul's bf16 accumulation: docs/gpu-runs/2026-11-28-h100-80gb-hbm3-73ba680). Emu's
// cuBLASLt accumulates in fp32 in k order in both modes and rounds once.
double gemm_tolerance(double mag, double want, double product, int K, bool fast_accum) {
    double accum_rtol = 1e-5, product_rounding = 0;
    if constexpr (!kEmulated) {
        accum_rtol = fast_accum ? 1e-4 : 3e-5;
        product_rounding = std::fabs(product) / 256;
    }
    return accum_rtol * std::sqrt(double(K) + 1) * mag + std::fabs(want) / 256 + product_rounding + 1e-30;
}

// out(M, N) = sum_k a(i, k) b(k, j) in double against got, with the magnitude-based tolerance.
void check_gemm(const std::string& what, int M, int N, int K, const std::function<double(int, int)>& a,
                const std::function<double(int, int)>& b, const std::function<double(int, int)>& old,
                const std::vector<bf16>& got, bool fast_accum) {
    std::vector<double> g(size_t(M) * N), want(g.size()), tol(g.size());
    std::vector<double> brow(size_t(K) * N);
    for (int k = 0; k < K; ++k)
        for (int j = 0; j < N; ++j) brow[size_t(k) * N + j] = b(k, j);
    std::vector<double> sum(N), mag(N);
    for (int i = 0; i < M; ++i) {
        std::fill(sum.begin(), sum.end(), 0.0);
        std::fill(mag.begin(), mag.end(), 0.0);
        for (int k = 0; k < K; ++k) {
            const double aik = a(i, k);
            if (aik == 0.0) continue;
            const double* br = &brow[size_t(k) * N];
            for (int j = 0; j < N; ++j) {
                sum[j] += aik * br[j];
                mag[j] += std::fabs(aik * br[j]);
            }
        }
        for (int j = 0; j < N; ++j) {
            const size_t e = size_t(i) * N + j;
            const double o = old(i, j);
            want[e] = sum[j] + o;
            tol[e] = gemm_tolerance(mag[j] + std::fabs(o), want[e], o != 0.0 ? sum[j] : 0.0, K, fast_accum);
            g[e] = value(got[e]);
        }
    }
    check_within(what, g, want, tol);
}

void test_lm_head_fp8(int T, int C, int V, int grad_accum, double w_std) {
    const std::string shape = " T " + std::to_string(T) + " C " + std::to_string(C) + " V " + std::to_string(V);
    const LmHeadFp8Scales s = lm_head_fp8_scales(2.0 / grad_accum);
    test::check(s.x == static_cast<float>(100.0 / 448) && s.w == static_cast<float>(1.6 / 448) &&
                    s.grad == static_cast<float>(2.0 / grad_accum * 0.75 / 448),
                "lm_head scales for grad_accum %d", grad_accum);
    const auto x = normal_bf16(size_t(T) * C, 0.0, 1.0), w = normal_bf16(size_t(C) * V, 0.0, w_std);
    const auto dlogits = normal_bf16(size_t(T) * V, 0.0, 2e-3);
    const auto dw_old = normal_bf16(size_t(C) * V, 0.0, 0.5);
    DeviceBuffer<bf16> d_x(x), d_w(w), d_dlogits(dlogits), d_logits(size_t(T) * V), d_dx(size_t(T) * C), d_dw(dw_old);
    DeviceBuffer<LmHeadFp8Scales> d_scales(std::vector<LmHeadFp8Scales>{s});
    DeviceBuffer<e4m3> x_f8(size_t(T) * C), x_f8_t(size_t(T) * C), w_f8(size_t(C) * V), w_f8_t(size_t(C) * V);
    DeviceBuffer<e5m2> g_f8(size_t(T) * V), g_f8_t(size_t(T) * V);
    const LmHeadFp8Buffers buf{x_f8.ptr, x_f8_t.ptr, w_f8.ptr, w_f8_t.ptr, g_f8.ptr, g_f8_t.ptr};
    CublasLt lt;

    // host quantization by the reference (codes), and the values the GEMMs must use
    constexpr bool sat = saturates<kLmHeadFp8Overflow>;
    const auto codes = [&](const std::vector<bf16>& v, const Fp8Ref& f, float scale) {
        std::vector<unsigned char> c(v.size());
        for (size_t i = 0; i < v.size(); ++i) c[i] = f.encode(static_cast<float>(value(v[i])) / scale, sat);
        return c;
    };
    const auto xq = codes(x, kRefE4M3, s.x), wq = codes(w, kRefE4M3, s.w), gq = codes(dlogits, kRefE5M2, s.grad);
    std::vector<double> xv(xq.size()), wv(wq.size()), gv(gq.size());
    for (size_t i = 0; i < xq.size(); ++i) xv[i] = kRefE4M3.decode(xq[i]) * s.x;
    for (size_t i = 0; i < wq.size(); ++i) wv[i] = kRefE4M3.decode(wq[i]) * s.w;
    for (size_t i = 0; i < gq.size(); ++i) gv[i] = kRefE5M2.decode(gq[i]) * s.grad;

    // one quantized weight serves every micro-step of a training step: another micro-step's x first
    lm_head_fp8_quantize_weight(buf, d_w.ptr, d_scales.ptr, C, V, nullptr);
    const auto x2 = normal_bf16(size_t(T) * C, 0.0, 1.0);
    DeviceBuffer<bf16> d_x2(x2);
    lm_head_fp8_forward(lt, d_logits.ptr, buf, d_x2.ptr, d_scales.ptr, T, C, V, nullptr);
    lm_head_fp8_forward(lt, d_logits.ptr, buf, d_x.ptr, d_scales.ptr, T, C, V, nullptr);
    const auto transposed = [](const std::vector<unsigned char>& m, int rows, int cols) {
        std::vector<unsigned char> t(m.size());
        for (int r = 0; r < rows; ++r)
            for (int c = 0; c < cols; ++c) t[size_t(c) * rows + r] = m[size_t(r) * cols + c];
        return t;
    };
    test::check(bytes_of(x_f8.download()) == xq && bytes_of(x_f8_t.download()) == transposed(xq, T, C),
                "lm_head forward: x_f8 and x_f8_t bit-exact%s", shape.c_str());
    test::check(bytes_of(w_f8.download()) == wq && bytes_of(w_f8_t.download()) == transposed(wq, C, V),
                "lm_head_fp8_quantize_weight: w_f8 and w_f8_t bit-exact%s", shape.c_str());
    {  // while embed is tied: the same codes, and embed = w^T (V, C) bit for bit in the same pass
        DeviceBuffer<e4m3> w2(size_t(C) * V), w2_t(size_t(C) * V);
        DeviceBuffer<bf16> embed(size_t(C) * V);
        const LmHeadFp8Buffers buf2{x_f8.ptr, x_f8_t.ptr, w2.ptr, w2_t.ptr, g_f8.ptr, g_f8_t.ptr};
        lm_head_fp8_quantize_weight(buf2, d_w.ptr, d_scales.ptr, C, V, nullptr, embed.ptr);
        std::vector<uint16_t> want(size_t(C) * V), got(size_t(C) * V);
        const std::vector<bf16> e = embed.download();
        for (int r = 0; r < C; ++r)
            for (int c = 0; c < V; ++c) std::memcpy(&want[size_t(c) * C + r], &w[size_t(r) * V + c], 2);
        std::memcpy(got.data(), e.data(), got.size() * 2);
        test::check(bytes_of(w2.download()) == wq && bytes_of(w2_t.download()) == transposed(wq, C, V) && got == want,
                    "lm_head_fp8_quantize_weight with embed: both codes and embed = w^T bit-exact%s", shape.c_str());
    }
    const auto zero = [](int, int) { return 0.0; };
    check_gemm(
        "lm_head fp8 forward logits" + shape, T, V, C, [&](int t, int k) { return xv[size_t(t) * C + k]; },
        [&](int k, int v) { return wv[size_t(k) * V + v]; }, zero, d_logits.download(), true);

    for (bool accumulate : {false, true}) {
        d_dw.upload(dw_old);
        quantize_fp8_two_layouts(g_f8.ptr, g_f8_t.ptr, d_dlogits.ptr, &d_scales.ptr->grad, T, V, nullptr);
        const std::string what = shape + (accumulate ? " (accumulate dw)" : "");
        test::check(bytes_of(g_f8.download()) == gq && bytes_of(g_f8_t.download()) == transposed(gq, T, V),
                    "lm_head backward: g_f8 and g_f8_t bit-exact%s", what.c_str());
        lm_head_fp8_backward(lt, d_dx.ptr, d_dw.ptr, accumulate, buf, d_scales.ptr, T, C, V, nullptr);
        check_gemm(
            "lm_head fp8 backward dx" + what, T, C, V, [&](int t, int v) { return gv[size_t(t) * V + v]; },
            [&](int v, int c) { return wv[size_t(c) * V + v]; }, zero, d_dx.download(), false);
        check_gemm(
            "lm_head fp8 backward dw" + what, C, V, T, [&](int c, int t) { return xv[size_t(t) * C + c]; },
            [&](int t, int v) { return gv[size_t(t) * V + v]; },
            [&](int c, int v) { return accumulate ? value(dw_old[size_t(c) * V + v]) : 0.0; }, d_dw.download(), false);
    }
}

void test_lm_head_bf16(int T, int C, int V) {
    const auto x = normal_bf16(size_t(T) * C, 0.0, 1.0), w = normal_bf16(size_t(C) * V, 0.0, 0.02);
    DeviceBuffer<bf16> d_x(x), d_w(w), d_logits(size_t(T) * V);
    CublasLt lt;
    lm_head_bf16_forward(lt, d_logits.ptr, d_x.ptr, d_w.ptr, T, C, V, nullptr);
    check_gemm(
        "lm_head bf16 (eval) T " + std::to_string(T) + " C " + std::to_string(C) + " V " + std::to_string(V), T, V, C,
        [&](int t, int k) { return value(x[size_t(t) * C + k]); },
        [&](int k, int v) { return value(w[size_t(k) * V + v]); }, [](int, int) { return 0.0; }, d_logits.download(),
        false);
}

// ============================ softcapped losses ============================
double softcap_sigmoid_ref(double logit) { return 1.0 / (1.0 + std::exp(-(logit + 5.0) / 7.5)); }

// Upstream's training loss in double: per row lse and loss (weights read as fp32, as on the device).
struct MtpRef {
    std::vector<double> lse, loss;
};
MtpRef mtp_forward_ref(const std::vector<double>& logits, const std::vector<int>& targets,
                       const std::vector<float>& weights, int T, int V) {
    MtpRef r{std::vector<double>(T), std::vector<double>(T)};
    const int n_predict = static_cast<int>(weights.size());
    for (int t = 0; t < T; ++t) {
        double sum = 0.0;
        for (int v = 0; v < V; ++v) sum += std::exp(23.0 * softcap_sigmoid_ref(logits[size_t(t) * V + v]));
        r.lse[t] = std::log(sum);
        double loss = 0.0;
        for (int k = 0; k < n_predict && t + k < T; ++k) {
            const int target = targets[t + k];
            if (weights[k] > 0 && target >= 0 && target < V)
                loss += weights[k] * (r.lse[t] - 23.0 * softcap_sigmoid_ref(logits[size_t(t) * V + target]));
        }
        r.loss[t] = loss;
    }
    return r;
}

// dlogits in double, with a tolerance per element: 2^-8 relative for the bf16 output, plus 1e-4 of
// the two terms' magnitudes (fp32 and fast exp before their difference).
void mtp_backward_ref(const std::vector<double>& logits, const std::vector<int>& targets,
                      const std::vector<float>& weights, double g, const MtpRef& fwd, int T, int V,
                      std::vector<double>& want, std::vector<double>& tol) {
    want.assign(size_t(T) * V, 0.0);
    tol.assign(want.size(), 0.0);
    const int n_predict = static_cast<int>(weights.size());
    for (int t = 0; t < T; ++t) {
        double s_w = 0.0;
        for (int k = 0; k < n_predict && t + k < T; ++k) s_w += weights[k];
        for (int v = 0; v < V; ++v) {
            double hit = 0.0;
            for (int k = 0; k < n_predict && t + k < T; ++k)
                if (targets[t + k] == v) hit += weights[k];
            const double s = softcap_sigmoid_ref(logits[size_t(t) * V + v]), z = 23.0 * s;
            const double p = std::exp(z - fwd.lse[t]), dz = z * (1.0 - s) / 7.5;
            const size_t e = size_t(t) * V + v;
            want[e] = g * (s_w * p - hit) * dz;
            tol[e] =
                std::fabs(want[e]) / 256 + 1e-4 * std::fabs(g * dz) * (std::fabs(s_w * p) + std::fabs(hit)) + 1e-30;
        }
    }
}

// Logits like a trained model's: mostly N(0, 2.5), a few large ones per row so rows are peaked.
std::vector<bf16> random_logits(int T, int V) {
    auto l = normal_bf16(size_t(T) * V, 0.0, 2.5);
    for (int t = 0; t < T; ++t)
        for (int j = 0; j < 4; ++j) l[size_t(t) * V + test::randint(0, V - 1)] = to_bf16(test::uniform(8.0, 25.0));
    return l;
}

// The fused backward (softcap_mtp_loss_backward_fp8) against the two-step path (the bf16 backward, then
// quantize_fp8_two_layouts): both e5m2 layouts byte for byte, on the test's fresh logits with the
// forward's lse, at the scale of a 3-step accumulation.
void check_mtp_fp8_fused(const std::vector<bf16>& logits, const DeviceBuffer<float>& d_lse,
                         const DeviceBuffer<int>& d_targets, const DeviceBuffer<float>& d_weights,
                         const DeviceBuffer<float>& d_g, int n_predict, int T, int V, const std::string& what) {
    const float grad_s = lm_head_fp8_scales(2.0 / 3).grad;
    DeviceBuffer<bf16> d_logits(logits), d_dlogits(logits.size());
    DeviceBuffer<float> d_grad_s(std::vector<float>{grad_s});
    DeviceBuffer<e5m2> two_step(logits.size()), two_step_t(logits.size()), fused(logits.size()), fused_t(logits.size());
    softcap_mtp_loss_backward(d_dlogits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, d_weights.ptr, n_predict, d_g.ptr,
                              T, V, nullptr);
    quantize_fp8_two_layouts(two_step.ptr, two_step_t.ptr, d_dlogits.ptr, d_grad_s.ptr, T, V, nullptr);
    softcap_mtp_loss_backward_fp8(fused.ptr, fused_t.ptr, d_grad_s.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr,
                                  d_weights.ptr, n_predict, d_g.ptr, T, V, nullptr);
    const auto want = bytes_of(two_step.download()), want_t = bytes_of(two_step_t.download());
    size_t nonzero = 0;
    for (unsigned char b : want) nonzero += (b & 0x7Fu) != 0;
    test::check(nonzero > want.size() / 2, "mtp fused fp8 backward%s: only %zu of %zu codes nonzero", what.c_str(),
                nonzero, want.size());
    test::check(bytes_of(fused.download()) == want && bytes_of(fused_t.download()) == want_t,
                "mtp fused fp8 backward%s: g_f8 and g_f8_t equal the two-step path's bytes", what.c_str());
}

void test_mtp_loss(int T, int V, const std::vector<float>& weights, bool invalid_targets, float g) {
    std::string what = " T " + std::to_string(T) + " V " + std::to_string(V) + " weights {";
    for (float w : weights) what += std::to_string(w).substr(0, 4) + " ";
    what += "} dloss " + std::to_string(g).substr(0, 5) + (invalid_targets ? " with invalid targets" : "");
    const int n_predict = static_cast<int>(weights.size());
    const auto logits = random_logits(T, V);
    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    if (invalid_targets)
        for (int t = 0; t < T; t += 3) targets[t] = test::randint(0, 1) ? -1 : V + test::randint(0, 100);
    // point some targets at the row's own large logits, so target columns carry large gradients
    for (int t = 1; t < T; t += 2)
        if (targets[t] >= 0 && targets[t] < V) {
            int best = 0;
            for (int v = 1; v < V; ++v)
                if (value(logits[size_t(t - 1) * V + v]) > value(logits[size_t(t - 1) * V + best])) best = v;
            targets[t] = best;
        }
    DeviceBuffer<bf16> d_logits(logits), d_dlogits(size_t(T) * V);
    DeviceBuffer<int> d_targets(targets);
    DeviceBuffer<float> d_weights(weights), d_losses(T), d_lse(T), d_total(std::vector<float>{1.5f}),
        d_g(std::vector<float>{g});

    const auto l = values(logits);
    const MtpRef ref = mtp_forward_ref(l, targets, weights, T, V);
    double total = 0.0, total_mag = 0.0;
    for (double x : ref.loss) {
        total += x;
        total_mag += std::fabs(x);
    }
    for (bool accumulate : {true, false}) {
        softcap_mtp_loss_forward(d_total.ptr, accumulate, d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr,
                                 d_weights.ptr, n_predict, T, V, nullptr);
        const auto losses = d_losses.download(), lse = d_lse.download();
        const double want_total = total + (accumulate ? 1.5 : 0.0);
        test::check_close("mtp loss forward lse" + what, lse.data(), ref.lse.data(), T, 1e-4, 1e-5);
        test::check_close("mtp loss forward rows" + what, losses.data(), ref.loss.data(), T, 1e-4, 1e-5);
        const double got_total = d_total.download()[0];
        test::check(std::fabs(got_total - want_total) <= 1e-5 * (total_mag + 1.5) + 1e-4,
                    "mtp loss total%s%s: got %.9g want %.9g", what.c_str(), accumulate ? " (accumulate)" : "",
                    got_total, want_total);
    }

    softcap_mtp_loss_backward(d_dlogits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, d_weights.ptr, n_predict, d_g.ptr,
                              T, V, nullptr);
    std::vector<double> want, tol;
    mtp_backward_ref(l, targets, weights, g, ref, T, V, want, tol);
    const auto dlogits = d_dlogits.download();
    check_within("mtp loss backward" + what, values(dlogits), want, tol);
    // in place: dlogits written over the logits gives the same bits
    softcap_mtp_loss_backward(d_logits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, d_weights.ptr, n_predict, d_g.ptr,
                              T, V, nullptr);
    test::check(bytes_of(d_logits.download()) == bytes_of(dlogits), "mtp loss backward in place%s", what.c_str());
    if (T % 16 == 0 && V % 16 == 0) check_mtp_fp8_fused(logits, d_lse, d_targets, d_weights, d_g, n_predict, T, V, what);
}

// The backward against central differences of the double forward L = g sum_t loss_t, at every logit.
void test_mtp_loss_finite_differences(int T, int V, const std::vector<float>& weights) {
    const int n_predict = static_cast<int>(weights.size());
    const float g = 0.75f;
    auto logits = normal_bf16(size_t(T) * V, 0.0, 4.0);
    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    DeviceBuffer<bf16> d_logits(logits), d_dlogits(size_t(T) * V);
    DeviceBuffer<int> d_targets(targets);
    DeviceBuffer<float> d_weights(weights), d_losses(T), d_lse(T), d_total(1), d_g(std::vector<float>{g});
    softcap_mtp_loss_forward(d_total.ptr, false, d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, d_weights.ptr,
                             n_predict, T, V, nullptr);
    softcap_mtp_loss_backward(d_dlogits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, d_weights.ptr, n_predict, d_g.ptr,
                              T, V, nullptr);
    const auto got = values(d_dlogits.download());
    auto l = values(logits);
    const auto total = [&](const std::vector<double>& x) {
        const MtpRef r = mtp_forward_ref(x, targets, weights, T, V);
        double s = 0.0;
        for (double v : r.loss) s += v;
        return g * s;
    };
    const MtpRef ref = mtp_forward_ref(l, targets, weights, T, V);
    std::vector<double> analytic, tol, fd(l.size());
    mtp_backward_ref(l, targets, weights, g, ref, T, V, analytic, tol);
    for (size_t i = 0; i < l.size(); ++i) {
        fd[i] = test::central_difference(l[i], 1e-4, [&] { return total(l); });
        tol[i] += 1e-7;  // the difference quotient's own error (O(h^2) and cancellation)
    }
    check_within("mtp loss backward vs finite differences, T " + std::to_string(T) + " V " + std::to_string(V), got, fd,
                 tol);
}

// Eval: z rounded to bf16 before the fp32 cross-entropy. Logits whose z lies within 1e-5 (relative)
// of a bf16 rounding boundary are redrawn, so fp32 and fast-exp error cannot flip the rounding.
void test_eval_loss(int T, int V) {
    const std::string what = " T " + std::to_string(T) + " V " + std::to_string(V);
    auto logits = random_logits(T, V);
    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    std::vector<double> want(T);
    double mean = 0.0;
    for (int t = 0; t < T; ++t) {
        const auto zb = [&](int v) { return 23.0 * softcap_sigmoid_ref(value(logits[size_t(t) * V + v])); };
        double sum = 0.0;
        for (int v = 0; v < V; ++v) sum += std::exp(zb(v));
        want[t] = std::log(sum) - zb(targets[t]);
        mean += want[t] / T;
    }
    DeviceBuffer<bf16> d_logits(logits);
    DeviceBuffer<int> d_targets(targets);
    DeviceBuffer<float> d_rows(T), d_loss(std::vector<float>{2.0f});
    softcap_eval_loss(d_loss.ptr, false, 1.0f / T, d_rows.ptr, d_logits.ptr, d_targets.ptr, T, V, nullptr);
    test::check_close("eval loss rows" + what, d_rows.download().data(), want.data(), T, 5e-5, 1e-5);
    const double got = d_loss.download()[0];
    test::check(std::fabs(got - mean) <= 1e-5 * std::fabs(mean) + 5e-5, "eval loss mean%s: got %.9g want %.9g",
                what.c_str(), got, mean);
    // two halves accumulated with scale 1/T give the same mean
    softcap_eval_loss(d_loss.ptr, false, 1.0f / T, d_rows.ptr, d_logits.ptr, d_targets.ptr, T / 2, V, nullptr);
    softcap_eval_loss(d_loss.ptr, true, 1.0f / T, d_rows.ptr, d_logits.ptr + size_t(T / 2) * V, d_targets.ptr + T / 2,
                      T - T / 2, V, nullptr);
    const double got2 = d_loss.download()[0];
    test::check(std::fabs(got2 - mean) <= 1e-5 * std::fabs(mean) + 5e-5,
                "eval loss mean over two calls%s: got %.9g want %.9g", what.c_str(), got2, mean);
}

// ============================ record 80's cross-entropy ============================
// The reference, in double from the kernel's fp32 inputs: u = fma(l, 1/C, B/C) in fp32 (std::fmaf, the
// kernel's own rounding), s = 0.5 + 0.5 tanh(u / 2) with the accurate tanh, rounded to bf16 for z = 23 s;
// lse = log sum exp(z); the loss and the gradient as ce_r80_loss_forward/_backward_fp8 state them.
// How far the kernel's s (before its bf16 rounding) may be from the reference's: the GPU's tanh.approx is
// within 2^-10.987 relative of tanh (PTX ISA), so s within 2^-11.987 |tanh|; emu's twin is the accurate
// tanh (a few fp32 ulps). Both add the fp32 roundings of the FMA (2^-24 of s).
#ifdef __CUDACC__
constexpr double kCeTanhRelError = 5.0e-4;  // above 2^-10.987 = 4.93e-4
#else
constexpr double kCeTanhRelError = 0x1p-21;
#endif
struct CeSigmoidRef {
    double s_raw, s;  // before and after the bf16 rounding
    bool near_tie;    // s_raw within the kernel's error of a bf16 rounding boundary: its s may round either way
};
CeSigmoidRef ce_sigmoid_ref(double logit) {
    const float inv_c = 1.0f / 7.5f, b_div_c = 5.0f * inv_c;
    const double th = std::tanh(0.5 * double(std::fmaf(float(logit), inv_c, b_div_c)));
    const double s_raw = 0.5 + 0.5 * th;
    int e;
    std::frexp(s_raw, &e);  // s_raw in [2^(e-1), 2^e): bf16 steps of 2^(e-8)
    const double step = std::ldexp(1.0, e - 8), frac = s_raw / step - std::floor(s_raw / step);
    const double error = 0.5 * std::fabs(th) * kCeTanhRelError + 0x1p-23 * s_raw;
    return {s_raw, test::round_bf16(s_raw), std::fabs(frac - 0.5) * step <= error};
}

// Logits like random_logits (a few large ones per row), each redrawn until its s is clear of a bf16
// rounding boundary by the kernel's error (ce_sigmoid_ref), so the kernel's bf16 s is the reference's.
std::vector<bf16> ce_logits(int T, int V) {
    auto l = random_logits(T, V);
    size_t redrawn = 0;
    for (auto& x : l)
        for (int tries = 0; ce_sigmoid_ref(value(x)).near_tie; ++tries, ++redrawn) {
            if (tries == 1000) {
                test::check(false, "ce_logits: no logit clear of a bf16 tie near %g", value(x));
                break;
            }
            x = to_bf16(value(x) + test::uniform(-1.0, 1.0));
        }
    test::check(redrawn < l.size() / 2, "ce_logits: %zu of %zu logits redrawn", redrawn, l.size());
    return l;
}

struct CeRef {
    std::vector<double> lse, loss;
    std::vector<double> dlogit, tol;  // the gradient before the e5m2 rounding, and its error bound
};
// Record 88's prefix term as the reference takes it: table (any length) and pw; no table, no term.
struct CePrefixRef {
    const std::vector<int>* table = nullptr;
    float weight = 0.0f;
    int target(const std::vector<int>& targets, int t, int V) const {  // P_t, or -1
        if (!table || targets[t] < 0 || targets[t] >= V) return -1;
        const int p = (*table)[size_t(targets[t])];
        return p >= 0 && p < V ? p : -1;
    }
};
CeRef ce_r80_ref(const std::vector<bf16>& logits, const std::vector<int>& targets, const std::vector<float>& weights,
                 float grad_scale, float grad_s, int T, int V, const CePrefixRef& prefix = {}) {
    const int n = static_cast<int>(weights.size());
    CeRef r;
    r.lse.resize(T);
    r.loss.resize(T);
    r.dlogit.resize(size_t(T) * V);
    r.tol.resize(size_t(T) * V);
    // the scale's three factors as the kernel multiplies them (fp32); on the GPU its reciprocals are the
    // approximate ones (within 2 ulps, PTX ISA div.approx), which the tolerance allows
    const float inv_c = 1.0f / 7.5f, scale = grad_scale * (inv_c * 23.0f) * (1.0f / grad_s);
    double s_w = 0.0;
    for (float w : weights) s_w += w;  // every weight, also where t + k >= T
    std::vector<double> s(V);
    for (int t = 0; t < T; ++t) {
        double sum = 0.0;
        for (int v = 0; v < V; ++v) {
            s[v] = ce_sigmoid_ref(value(logits[size_t(t) * V + v])).s;
            sum += std::exp(23.0 * s[v]);
        }
        const double lse = r.lse[t] = std::log(sum);
        double loss = 0.0;
        for (int k = 0; k < n && t + k < T; ++k)
            if (targets[t + k] >= 0 && targets[t + k] < V) loss += weights[k] * (lse - 23.0 * s[targets[t + k]]);
        const int pt = prefix.target(targets, t, V);
        const double pw = pt >= 0 ? prefix.weight : 0.0;
        if (pt >= 0) loss += pw * (lse - 23.0 * s[pt]);
        r.loss[t] = loss;
        for (int v = 0; v < V; ++v) {
            double term2 = v == pt ? pw : 0.0;
            for (int k = 0; k < std::min(n, 3) && t + k < T; ++k)  // upstream's term2 loop: k < 3
                if (targets[t + k] == v) term2 += weights[k];
            const double p = std::exp(23.0 * s[v] - lse), factor = scale * s[v] * (1.0 - s[v]);
            const size_t e = size_t(t) * V + v;
            r.dlogit[e] = factor * ((s_w + pw) * p - term2);
            // p: the kernel's lse (an fp32 sum of V fast exps, __logf) and its fp32 z - lse and __expf,
            // within 1e-5 relative; the difference and the four multiplies and the scale's roundings: 2^-20.
            r.tol[e] = factor * (s_w + pw) * p * 1e-5 + std::fabs(r.dlogit[e]) * 0x1p-20 + 1e-30;
        }
    }
    return r;
}

// Byte i of the kernel's e5m2 dlogits against the reference: equal, or where [want - tol, want + tol] spans
// an e5m2 rounding boundary, either code of that interval. Counts the ambiguous and the wrong bytes.
struct CeCodeCheck {
    size_t ambiguous = 0, bad = 0, first_bad = SIZE_MAX;
    void add(size_t i, unsigned char got, double want, double tol) {
        const unsigned lo = kRefE5M2.encode(float(want - tol), true), hi = kRefE5M2.encode(float(want + tol), true);
        bool ok = got == lo;
        if (lo != hi) {
            ++ambiguous;
            const double g = kRefE5M2.decode(got);
            ok = g >= kRefE5M2.decode(lo) && g <= kRefE5M2.decode(hi);
        }
        if (!ok && bad++ == 0) first_bad = i;
    }
};

// Record 80's forward and fused e5m2 backward against ce_r80_ref on fresh logits; targets: every third
// one repeats the previous (term2 with two or three weights on a column), some point at the row's largest
// logit (large target gradients, cancellation in S_w p - term2), and with `invalid_targets` some outside
// [0, V) (the loss skips them, no column matches). With a prefix weight (record 88): a random prefix table of V + 24
// rows, about a fifth -1 and a few entries at or past V (no term), some rows' prefix at their k = 0 or k = 1 target
// (term2 adds two weights), and a table value of 0 (the first column).
void test_ce_r80(int T, int V, const std::vector<float>& weights, bool invalid_targets, double grad_scale,
                 std::optional<float> prefix_weight = std::nullopt) {
    std::string what = " T " + std::to_string(T) + " V " + std::to_string(V) + " weights {";
    for (float w : weights) what += std::to_string(w).substr(0, 5) + " ";
    what += "} grad_scale " + std::to_string(grad_scale).substr(0, 5) + (invalid_targets ? " with invalid targets" : "");
    if (prefix_weight) what += " prefix weight " + std::to_string(*prefix_weight).substr(0, 6);
    const int n_predict = static_cast<int>(weights.size());
    const auto logits = ce_logits(T, V);
    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    for (int t = 1; t < T; t += 2) {  // the row t - 1's largest logit: its k = 1 target
        int best = 0;
        for (int v = 1; v < V; ++v)
            if (value(logits[size_t(t - 1) * V + v]) > value(logits[size_t(t - 1) * V + best])) best = v;
        targets[t] = best;
    }
    for (int t = 2; t < T; t += 3) targets[t] = targets[t - 1];
    if (invalid_targets)
        for (int t = 0; t < T; t += 5) targets[t] = test::randint(0, 1) ? -1 : V + test::randint(0, 100);
    std::vector<int> table(size_t(V) + 24);
    for (auto& p : table) {
        const int kind = test::randint(0, 19);
        p = kind < 4 ? -1 : kind == 4 ? V + test::randint(0, 23) : test::randint(0, V - 1);
    }
    for (int t = 0; t + 1 < T; t += 4) {  // rows whose prefix is their own target or the next row's
        if (targets[t] < 0 || targets[t] >= V) continue;
        table[size_t(targets[t])] = t % 8 == 0 ? targets[t + 1] : targets[t];
    }
    table[size_t(test::randint(0, V - 1))] = 0;
    const CePrefixRef prefix_ref{prefix_weight ? &table : nullptr, prefix_weight.value_or(0.0f)};
    const float grad_scale_f = static_cast<float>(grad_scale), grad_s = lm_head_fp8_scales(grad_scale).grad;
    const CeRef ref = ce_r80_ref(logits, targets, weights, grad_scale_f, grad_s, T, V, prefix_ref);

    DeviceBuffer<bf16> d_logits(logits);
    DeviceBuffer<int> d_targets(targets), d_table(table);
    DeviceBuffer<float> d_weights(weights), d_losses(T), d_lse(T), d_total(std::vector<float>{1.5f}),
        d_grad_scale(std::vector<float>{grad_scale_f}), d_grad_s(std::vector<float>{grad_s}),
        d_prefix_weight(std::vector<float>{prefix_weight.value_or(0.0f)});
    const CePrefix prefix = prefix_weight ? CePrefix{d_table.ptr, d_prefix_weight.ptr, int64_t(table.size())} : CePrefix{};
    if (prefix_weight) {  // the table must make a difference: rows with a prefix term
        int with = 0;
        for (int t = 0; t < T; ++t) with += prefix_ref.target(targets, t, V) >= 0;
        test::check(with >= T / 3, "r80 ce%s: only %d of %d rows with a prefix", what.c_str(), with, T);
    }
    double total = 0.0, total_mag = 0.0;
    for (double x : ref.loss) {
        total += x;
        total_mag += std::fabs(x);
    }
    for (bool accumulate : {true, false}) {
        ce_r80_loss_forward(d_total.ptr, accumulate, d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr,
                            d_weights.ptr, n_predict, T, V, nullptr, prefix);
        // lse: an fp32 sum of V exps (about 20 roundings deep: 1.2e-6 relative), __logf (2^-21.4 absolute
        // on the GPU) and the final add (half an ulp, 1e-6 at 24): 4e-6; the loss: that times sum w
        test::check_close("r80 ce forward lse" + what, d_lse.download().data(), ref.lse.data(), T, 4e-6, 2e-7);
        test::check_close("r80 ce forward rows" + what, d_losses.download().data(), ref.loss.data(), T, 8e-6, 4e-7);
        const double got = d_total.download()[0], want = total + (accumulate ? 1.5 : 0.0);
        test::check(std::fabs(got - want) <= 1e-6 * (total_mag + 1.5) + 1e-5, "r80 ce total%s%s: got %.9g want %.9g",
                    what.c_str(), accumulate ? " (accumulate)" : "", got, want);
    }
    if (T % 16 != 0 || V % 16 != 0) return;  // the fp8 layouts' shape rules

    DeviceBuffer<e5m2> g(size_t(T) * V), g_t(size_t(T) * V);
    ce_r80_loss_backward_fp8(g.ptr, g_t.ptr, d_grad_scale.ptr, d_grad_s.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr,
                             d_weights.ptr, n_predict, T, V, nullptr, prefix);
    const auto codes = bytes_of(g.download()), codes_t = bytes_of(g_t.download());
    // the last n_predict - 1 rows separately: their S_w counts weights whose targets lie past T
    const int last = std::max(T - (n_predict - 1), 0);
    CeCodeCheck body, tail;
    size_t nonzero = 0, transposed_bad = 0;
    for (int t = 0; t < T; ++t)
        for (int v = 0; v < V; ++v) {
            const size_t e = size_t(t) * V + v;
            (t < last ? body : tail).add(e, codes[e], ref.dlogit[e], ref.tol[e]);
            nonzero += (codes[e] & 0x7Fu) != 0;
            transposed_bad += codes_t[size_t(v) * T + t] != codes[e];
        }
    const auto report = [&](const CeCodeCheck& c, const char* rows) {
        const size_t i = c.first_bad == SIZE_MAX ? 0 : c.first_bad;
        test::check(c.bad == 0,
                    "r80 ce e5m2 dlogits%s, %s: %zu codes wrong (%zu ambiguous); first [%zu][%zu] got %g want %.9g +- %.3g",
                    what.c_str(), rows, c.bad, c.ambiguous, i / V, i % V, kRefE5M2.decode(codes[i]), ref.dlogit[i],
                    ref.tol[i]);
    };
    report(body, "rows with every target");
    report(tail, "the last rows (S_w over all k)");
    test::check(body.ambiguous + tail.ambiguous <= codes.size() / 50,
                "r80 ce e5m2 dlogits%s: %zu of %zu codes within tolerance of a rounding boundary", what.c_str(),
                body.ambiguous + tail.ambiguous, codes.size());
    test::check(nonzero > codes.size() / 2, "r80 ce e5m2 dlogits%s: only %zu of %zu codes nonzero", what.c_str(),
                nonzero, codes.size());
    test::check(transposed_bad == 0, "r80 ce e5m2 dlogits%s: %zu bytes of g_f8_t differ from g_f8 transposed",
                what.c_str(), transposed_bad);
}

void test_shape_rules() {
    test::check(lm_head_shape_error(64, 768, 50304).empty() && !lm_head_shape_error(40, 768, 50304).empty() &&
                    !lm_head_shape_error(64, 100, 50304).empty() && !lm_head_shape_error(64, 768, 50257).empty(),
                "lm_head shape rules (multiples of 16)");
    float* p = nullptr;
    test::check(quantize_fp8_shape_error(64, 64, {p}).empty() && !quantize_fp8_shape_error(64, 72, {p}).empty() &&
                    !quantize_fp8_shape_error(0, 64, {p}).empty() &&
                    !quantize_fp8_shape_error(64, 64, {reinterpret_cast<char*>(p) + 8}).empty(),
                "quantization shape rules (multiples of 16, 16-byte alignment)");
    test::check(
        mtp_shape_error(256, 50304, p, 3).empty() && !mtp_shape_error(256, 50257, p, 3).empty() &&
            !mtp_shape_error(256, 50304, p, 0).empty() && !mtp_shape_error(256, 50304, p, kMaxMtpWeights + 1).empty() &&
            !loss_shape_error(0, 50304, p).empty() && !loss_shape_error(8, 64, reinterpret_cast<char*>(p) + 2).empty(),
        "loss shape rules (V multiple of 8, 1..%d weights, aligned logits)", kMaxMtpWeights);
    test::check(mtp_fp8_shape_error(64, 1024, 3, p, p, p).empty() && !mtp_fp8_shape_error(40, 1024, 3, p, p, p).empty() &&
                    !mtp_fp8_shape_error(64, 1000, 3, p, p, p).empty() &&
                    !mtp_fp8_shape_error(64, 1024, 0, p, p, p).empty() &&
                    !mtp_fp8_shape_error(64, 1024, 3, p, reinterpret_cast<char*>(p) + 8, p).empty(),
                "fused fp8 loss backward shape rules (T and V multiples of 16, 1..%d weights, aligned buffers)",
                kMaxMtpWeights);
}

// Record 80's launchers refuse bad shapes naming themselves: V not a multiple of 16 for the e5m2 layouts,
// n_predict outside 1..kMaxMtpWeights, V not a multiple of 8 for the forward.
void test_ce_r80_shape_errors() {
    DeviceBuffer<bf16> logits(size_t(32) * 1008);
    DeviceBuffer<e5m2> g(size_t(32) * 1008), g_t(size_t(32) * 1008);
    DeviceBuffer<float> f(32);
    DeviceBuffer<int> targets(32);
    test::check_fails_with("ce_r80_loss_backward_fp8 V 1000", "ce_r80_loss_backward_fp8", [&] {
        ce_r80_loss_backward_fp8(g.ptr, g_t.ptr, f.ptr, f.ptr, logits.ptr, f.ptr, targets.ptr, f.ptr, 1, 32, 1000,
                                 nullptr);
    });
    test::check_fails_with("ce_r80_loss_backward_fp8 n_predict 0", "n_predict 0", [&] {
        ce_r80_loss_backward_fp8(g.ptr, g_t.ptr, f.ptr, f.ptr, logits.ptr, f.ptr, targets.ptr, f.ptr, 0, 32, 1008,
                                 nullptr);
    });
    test::check_fails_with("ce_r80_loss_forward V 1004", "ce_r80_loss_forward", [&] {
        ce_r80_loss_forward(f.ptr, false, f.ptr, f.ptr, logits.ptr, targets.ptr, f.ptr, 1, 32, 1004, nullptr);
    });
    // record 88's prefix term: a table shorter than V, a table without its weight, a weight without a table
    test::check_fails_with("ce_r80_loss_forward short prefix table", "prefix table of 1000 rows for V 1008", [&] {
        ce_r80_loss_forward(f.ptr, false, f.ptr, f.ptr, logits.ptr, targets.ptr, f.ptr, 1, 32, 1008, nullptr,
                            CePrefix{targets.ptr, f.ptr, 1000});
    });
    test::check_fails_with("ce_r80_loss_backward_fp8 table without weight", "a prefix table without its weight", [&] {
        ce_r80_loss_backward_fp8(g.ptr, g_t.ptr, f.ptr, f.ptr, logits.ptr, f.ptr, targets.ptr, f.ptr, 1, 32, 1008,
                                 nullptr, CePrefix{targets.ptr, nullptr, 1008});
    });
    test::check_fails_with("ce_r80_loss_backward_fp8 weight without table", "a prefix weight without a prefix table",
                           [&] {
                               ce_r80_loss_backward_fp8(g.ptr, g_t.ptr, f.ptr, f.ptr, logits.ptr, f.ptr, targets.ptr,
                                                        f.ptr, 1, 32, 1008, nullptr, CePrefix{nullptr, f.ptr, 0});
                           });
}

// ---- benchmark: the head of one training micro-step and of an eval batch ----
int bench_head(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int T = p.T(), C = p.C, V = p.V;
    const std::string at = bench::fmt("T=%d C=%d V=%d", T, C, V);
    DeviceBuffer<bf16> x(normal_bf16(size_t(T) * C)), w(normal_bf16(size_t(C) * V, 0.0, 0.02)), dx(size_t(T) * C),
        dw(size_t(C) * V), logits(size_t(T) * V), dlogits(size_t(T) * V);
    bench::fill_tiled(logits, random_logits(16, V));
    DeviceBuffer<LmHeadFp8Scales> scales(std::vector<LmHeadFp8Scales>{lm_head_fp8_scales(2.0 / (8 / p.ranks))});  // record 71's grad_scale
    DeviceBuffer<e4m3> x_f8(size_t(T) * C), x_f8_t(size_t(T) * C), w_f8(size_t(C) * V), w_f8_t(size_t(C) * V);
    DeviceBuffer<e5m2> g_f8(size_t(T) * V), g_f8_t(size_t(T) * V);
    const LmHeadFp8Buffers buf{x_f8.ptr, x_f8_t.ptr, w_f8.ptr, w_f8_t.ptr, g_f8.ptr, g_f8_t.ptr};
    CublasLt lt;
    b.run("lm_head_fp8_quantize_weight", bench::fmt("C=%d V=%d", C, V),
          [&](cudaStream_t s) { lm_head_fp8_quantize_weight(buf, w.ptr, scales.ptr, C, V, s); });
    b.run("lm_head_fp8_forward", at,
          [&](cudaStream_t s) { lm_head_fp8_forward(lt, dlogits.ptr, buf, x.ptr, scales.ptr, T, C, V, s); });
    b.run("lm_head_fp8_backward", at,
          [&](cudaStream_t s) { lm_head_fp8_backward(lt, dx.ptr, dw.ptr, false, buf, scales.ptr, T, C, V, s); });
    b.run("lm_head_bf16_forward", at,
          [&](cudaStream_t s) { lm_head_bf16_forward(lt, dlogits.ptr, x.ptr, w.ptr, T, C, V, s); });

    std::vector<int> targets(T);
    for (auto& t : targets) t = test::randint(0, V - 1);
    std::vector<float> weights(p.n_predict);  // 1, 1/2, 1/4: stage 1's first step
    for (int k = 0; k < p.n_predict; ++k) weights[k] = 1.0f / float(1 << k);
    DeviceBuffer<int> d_targets(targets);
    DeviceBuffer<float> d_weights(weights), rows(T), lse(T), loss(1), dloss(std::vector<float>{2.0f});
    const std::string mtp = bench::fmt("T=%d V=%d, %d MTP weights", T, V, p.n_predict);
    b.run("softcap_mtp_loss_forward", mtp, [&](cudaStream_t s) {
        softcap_mtp_loss_forward(loss.ptr, false, rows.ptr, lse.ptr, logits.ptr, d_targets.ptr, d_weights.ptr,
                                 p.n_predict, T, V, s);
    });
    b.run("softcap_mtp_loss_backward", mtp, [&](cudaStream_t s) {
        softcap_mtp_loss_backward(dlogits.ptr, logits.ptr, lse.ptr, d_targets.ptr, d_weights.ptr, p.n_predict,
                                  dloss.ptr, T, V, s);
    });
    b.run("softcap_mtp_loss_backward_fp8", mtp, [&](cudaStream_t s) {
        softcap_mtp_loss_backward_fp8(g_f8.ptr, g_f8_t.ptr, &scales.ptr->grad, logits.ptr, lse.ptr, d_targets.ptr,
                                      d_weights.ptr, p.n_predict, dloss.ptr, T, V, s);
    });
    const double r80_grad_scale = 1.0 / (8 / p.ranks);  // record 80's 1 / grad_accum
    DeviceBuffer<float> r80_scales(std::vector<float>{float(r80_grad_scale), lm_head_fp8_scales(r80_grad_scale).grad});
    b.run("ce_r80_loss_forward", mtp, [&](cudaStream_t s) {
        ce_r80_loss_forward(loss.ptr, false, rows.ptr, lse.ptr, logits.ptr, d_targets.ptr, d_weights.ptr, p.n_predict,
                            T, V, s);
    });
    b.run("ce_r80_loss_backward_fp8", mtp, [&](cudaStream_t s) {
        ce_r80_loss_backward_fp8(g_f8.ptr, g_f8_t.ptr, r80_scales.ptr, r80_scales.ptr + 1, logits.ptr, lse.ptr,
                                 d_targets.ptr, d_weights.ptr, p.n_predict, T, V, s);
    });
    b.run("softcap_eval_loss", bench::fmt("T=%d V=%d", T, V), [&](cudaStream_t s) {
        softcap_eval_loss(loss.ptr, false, 1.0f / T, rows.ptr, logits.ptr, d_targets.ptr, T, V, s);
    });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_head(*o);
    test::seed();
    test_shape_rules();
    test_quantization();

    test_lm_head_fp8(64, 128, 1024, 1, 0.005);  // tiny preset's width
    test_lm_head_fp8(32, 128, 50304, 8, 0.02);  // the real vocabulary
    test_lm_head_fp8(48, 768, 2048, 2, 0.01);   // record width
    test_lm_head_bf16(64, 128, 1024);
    test_lm_head_bf16(32, 128, 50304);
    test_lm_head_bf16(48, 768, 2048);

    test_mtp_loss(256, 50304, {1.0f, 0.5f, 0.25f}, false, 2.0f);  // tiny preset, stage 1 weights
    test_mtp_loss(64, 1024, {1.0f, 0.5f, 0.0f}, false, 0.25f);    // a weight decayed to 0
    test_mtp_loss(64, 1024, {1.0f, 0.0f, 0.125f}, true, 1.0f);
    test_mtp_loss(33, 200, {1.0f, 0.3f}, true, 2.0f);
    test_mtp_loss(16, 8 * 96, {1.0f}, false, 2.0f);
    test_mtp_loss(48, 208, {1.0f, 0.5f, 0.25f}, true, 2.0f);  // ragged tiles of the fused backward both ways
    test_mtp_loss(3, 24, {1.0f, 0.5f, 0.25f}, false, 1.0f);  // every row near the end
    test_mtp_loss_finite_differences(6, 16, {1.0f, 0.5f, 0.25f});
    test_mtp_loss_finite_differences(5, 24, {0.8f, 0.3f});

    // record 80: r80's grad scale (1 / grad_accum), stage weights, n_predict 1..4 (term2's k < 3 at 4),
    // ragged tiles (208 = 3 * 64 + 16; T below a tile), the real vocabulary, and forward-only shapes
    test_ce_r80(64, 1024, {1.0f, 0.5f, 0.25f}, false, 1.0);
    test_ce_r80(48, 208, {1.0f, 0.5f}, true, 0.125);
    test_ce_r80(32, 96, {1.0f}, false, 0.5);
    test_ce_r80(32, 160, {0.8f, 0.3f, 0.1f, 0.05f}, true, 1.0);
    test_ce_r80(16, 50304, {1.0f, 0.5f, 0.0f}, false, 1.0);
    test_ce_r80(7, 40, {1.0f, 0.5f, 0.25f}, true, 1.0);
    // record 88's prefix term: stage 1's pw, one in stage 2's decay with invalid targets, pw 0 (stage 3), the
    // real vocabulary, the ragged tiles and the rows near the end
    test_ce_r80(64, 1024, {1.0f, 0.5f, 0.25f}, false, 1.0, 0.25f);
    test_ce_r80(48, 208, {1.0f, 0.5f}, true, 0.125, 0.1368f);
    test_ce_r80(32, 160, {1.0f, 0.5f, 0.0f}, true, 0.5, 0.0f);
    test_ce_r80(16, 50304, {1.0f, 0.5f, 0.25f}, false, 1.0, 0.25f);
    test_ce_r80(7, 40, {1.0f}, true, 1.0, 0.25f);
    test_ce_r80_shape_errors();

    test_eval_loss(64, 1024);
    test_eval_loss(16, 50304);
    test_eval_loss(7, 40);
    return test::finish();
}
