// emu's cuBLASLt beyond what tests/kernels/test_matmul.cu checks on both builds: each GEMM
// kernel (EMU_GEMM), results that do not depend on the worker count, bf16 rounding, descriptor
// edge cases, the statuses of what emu does not emulate, the wrapper's failure message, and the
// GEMM's speed. Children that need their own emu settings are forked before this process starts
// emu's GEMM threads (a forked child would not have them).
#include "../../kernels/matmul.cuh"
#include "../device_util.h"

#include <sys/wait.h>
#include <unistd.h>

#include <ctime>
#include <functional>
#include <string>
#include <utility>
#include <vector>

using bf16 = __nv_bfloat16;
using e4m3 = __nv_fp8_e4m3;
using e5m2 = __nv_fp8_e5m2;

using test::bits;
using test::DeviceBuffer;
using test::value;

template <class T>
std::vector<T> random_values(size_t n, double range, std::mt19937_64& g) {
    std::uniform_real_distribution<double> u(-range, range);
    std::vector<T> v(n);
    for (auto& x : v) x = T(static_cast<float>(u(g)));
    return v;
}

// ---- children: a function run in a forked process with its own environment ----
struct Child {
    int status;
    std::string out;  // what it wrote to the captured descriptor
};
Child run_child(const std::vector<std::pair<const char*, const char*>>& env, const std::function<int()>& fn,
                int capture_fd = STDOUT_FILENO) {
    int fds[2];
    if (pipe(fds) != 0) return {-1, "pipe failed"};
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], capture_fd);
        for (auto& [k, v] : env) setenv(k, v, 1);
        const int rc = fn();
        std::fflush(stdout);
        std::fflush(stderr);
        _exit(rc);
    }
    close(fds[1]);
    std::string out;
    char buf[4096];
    for (ssize_t n; (n = read(fds[0], buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
    close(fds[0]);
    int st = 0;
    waitpid(pid, &st, 0);
    return {WIFEXITED(st) ? WEXITSTATUS(st) : -1, out};
}

// out = alpha op(a) @ op(b) + beta out through the wrapper, against a double GEMM; failures counted.
template <class Out>
int check_bf16_gemm(CublasLt& lt, bool ta, bool tb, int M, int N, int K, int batch, float alpha, float beta,
                    std::mt19937_64& g) {
    const int64_t sa = int64_t(M) * K, sb = int64_t(K) * N, so = int64_t(M) * N;
    const auto ha = random_values<bf16>(size_t(sa * batch), 1.0, g), hb = random_values<bf16>(size_t(sb * batch), 1.0, g);
    const auto hc = random_values<Out>(size_t(so * batch), 1.0, g);
    DeviceBuffer<bf16> a(ha), b(hb);
    DeviceBuffer<Out> out(hc);
    matmul_bf16(lt, out.ptr, a.ptr, ta, b.ptr, tb, M, N, K, 0, alpha, beta, static_cast<const Out*>(nullptr),
                MatmulBatch{batch, sa, sb, so});
    const auto got = out.download();
    const double out_rtol = std::is_same_v<Out, bf16> ? 1.0 / 256 : 1e-7;
    size_t bad = 0;
    for (int bi = 0; bi < batch; ++bi)
        for (int i = 0; i < M; ++i)
            for (int j = 0; j < N; ++j) {
                double want = 0, mag = 0;
                for (int p = 0; p < K; ++p) {
                    const double t = value(ha[bi * sa + (ta ? int64_t(p) * M + i : int64_t(i) * K + p)]) *
                                     value(hb[bi * sb + (tb ? int64_t(j) * K + p : int64_t(p) * N + j)]);
                    want += t;
                    mag += std::fabs(t);
                }
                const double c = value(hc[bi * so + int64_t(i) * N + j]);
                want = alpha * want + beta * c;
                mag = std::fabs(alpha) * mag + std::fabs(beta * c);
                const double err = std::fabs(value(got[bi * so + int64_t(i) * N + j]) - want);
                if (!(err <= 1e-5 * std::sqrt(K + 1.0) * mag + out_rtol * std::fabs(want))) ++bad;
            }
    return test::check(bad == 0, "%s%s %dx%dx%d batch %d -> %s: %zu values off", ta ? "T" : "N", tb ? "T" : "N", M, N,
                       K, batch, std::is_same_v<Out, bf16> ? "bf16" : "fp32", bad)
               ? 0
               : 1;
}

// out = sa a @ (sb b)^T through matmul_fp8, against a double GEMM of the fp8 values.
template <class Out, class A8, class B8>
int check_fp8_gemm(CublasLt& lt, int M, int N, int K, float sa, float sb, std::mt19937_64& g) {
    const std::vector<A8> ha = random_values<A8>(size_t(M) * K, 400.0, g);
    const std::vector<B8> hb = random_values<B8>(size_t(N) * K, 400.0, g);
    DeviceBuffer<A8> a(ha);
    DeviceBuffer<B8> b(hb);
    DeviceBuffer<Out> out(size_t(M) * N);
    DeviceBuffer<float> scales(std::vector<float>{sa, 0, 0, 0, sb});  // each scale 16-byte aligned, as fp8 needs
    matmul_fp8(lt, out.ptr, a.ptr, scales.ptr, b.ptr, scales.ptr + 4, M, N, K, 0);
    const auto got = out.download();
    size_t bad = 0;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            double want = 0, mag = 0;
            for (int p = 0; p < K; ++p) {
                const double t = double(sa) * value(ha[size_t(i) * K + p]) * double(sb) * value(hb[size_t(j) * K + p]);
                want += t;
                mag += std::fabs(t);
            }
            const double err = std::fabs(value(got[size_t(i) * N + j]) - want);
            if (!(err <= 1e-5 * std::sqrt(K + 1.0) * mag + (std::is_same_v<Out, bf16> ? 1.0 / 256 : 1e-7) * std::fabs(want)))
                ++bad;
        }
    return test::check(bad == 0, "fp8 %dx%dx%d: %zu values off", M, N, K, bad) ? 0 : 1;
}

// The shapes that reach every path of a kernel: ragged edges, several k blocks, batches, fp8.
int kernel_cases() {
    std::mt19937_64 g(test::seed() + 1);
    CublasLt lt;
    int failed = 0;
    for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb) {
            failed += check_bf16_gemm<bf16>(lt, ta, tb, 45, 37, 300, 1, 1.0f, 0.0f, g);
            failed += check_bf16_gemm<float>(lt, ta, tb, 70, 19, 33, 3, -0.5f, 1.5f, g);
        }
    failed += check_bf16_gemm<bf16>(lt, false, true, 5, 3, 600, 2, 1.0f, 1.0f, g);
    // fp8: M and N multiples of 16 (emu's rule for cuBLASLt's fp8 kernels); ragged edges are the bf16 cases'
    failed += check_fp8_gemm<bf16, e4m3, e4m3>(lt, 48, 48, 272, 0.01f, 0.02f, g);
    failed += check_fp8_gemm<float, e5m2, e4m3>(lt, 16, 32, 32, 0.5f, 0.001f, g);
    return failed;
}

// One fp32 result of each form, as raw bytes: for comparing runs with different worker counts.
int determinism_case() {
    std::mt19937_64 g(test::seed() + 2);
    CublasLt lt;
    std::string bytes;
    for (int form = 0; form < 3; ++form) {
        const int M = 150, N = 77, K = 700, batch = 2;
        const auto ha = random_values<bf16>(size_t(M) * K * batch, 1.0, g), hb = random_values<bf16>(size_t(K) * N * batch, 1.0, g);
        DeviceBuffer<bf16> a(ha), b(hb);
        DeviceBuffer<float> out(size_t(M) * N * batch);
        matmul_bf16(lt, out.ptr, a.ptr, form == 1, b.ptr, form != 2, M, N, K, 0, 1.0f, 0.0f,
                    static_cast<const float*>(nullptr), MatmulBatch{batch, int64_t(M) * K, int64_t(K) * N, int64_t(M) * N});
        const auto h = out.download();
        bytes.append(reinterpret_cast<const char*>(h.data()), h.size() * sizeof(float));
    }
    std::fwrite(bytes.data(), 1, bytes.size(), stdout);
    return 0;
}

// The speed of a 2048x768x768 bf16 GEMM on the CPU time of one worker.
int speed_case() {
    const int M = 2048, N = 768, K = 768;
    std::mt19937_64 g(test::seed() + 3);
    CublasLt lt;
    DeviceBuffer<bf16> x(random_values<bf16>(size_t(M) * K, 1.0, g)), w(random_values<bf16>(size_t(N) * K, 1.0, g));
    DeviceBuffer<bf16> out(size_t(M) * N);
    matmul_forward(lt, out.ptr, x.ptr, w.ptr, M, N, K, 0);
    double best = 1e30;
    for (int rep = 0; rep < 5; ++rep) {
        const std::clock_t c0 = std::clock();
        matmul_forward(lt, out.ptr, x.ptr, w.ptr, M, N, K, 0);
        best = std::min(best, double(std::clock() - c0) / CLOCKS_PER_SEC);
    }
    std::printf("%.1f", 2.0 * M * N * K / best / 1e9);
    return 0;
}

void test_children() {
    for (const char* kernel : {"avx512", "avx2", "generic"}) {
        const Child c = run_child({{"EMU_GEMM", kernel}, {"EMU_WORKERS", "2"}}, kernel_cases);
        test::check(c.status == 0, "EMU_GEMM=%s: %d cases failed:\n%s", kernel, c.status, c.out.c_str());
    }
    const Child one = run_child({{"EMU_WORKERS", "1"}}, determinism_case);
    for (const char* workers : {"2", "3"}) {
        const Child many = run_child({{"EMU_WORKERS", workers}}, determinism_case);
        test::check(one.status == 0 && many.status == 0 && !one.out.empty() && one.out == many.out,
                    "results with EMU_WORKERS=1 and %s differ", workers);
    }
    // The wrapper's check names the call, the status and emu's reason, then exits.
    const Child bad = run_child(
        {},
        [] {
            CublasLt lt;
            DeviceBuffer<e4m3> a(64 * 40);
            DeviceBuffer<bf16> out(64 * 64);
            DeviceBuffer<float> s(8);
            matmul_fp8(lt, out.ptr, a.ptr, s.ptr, a.ptr, s.ptr + 4, 64, 64, 40, 0);  // K = 40: not fp8-aligned
            return 0;
        },
        STDERR_FILENO);
    test::check(bad.status == EXIT_FAILURE && bad.out.find("cuBLASLt error at") != std::string::npos &&
                    bad.out.find("cublasLtMatmulAlgoGetHeuristic") != std::string::npos &&
                    bad.out.find("CUBLAS_STATUS_NOT_SUPPORTED") != std::string::npos &&
                    bad.out.find("emu: cublasLtMatmulAlgoGetHeuristic: fp8 needs k (40)") != std::string::npos,
                "fp8 K=40 through the wrapper: exit %d, stderr:\n%s", bad.status, bad.out.c_str());
    const Child speed = run_child({{"EMU_WORKERS", "1"}}, speed_case);
    test::check(speed.status == 0 && !speed.out.empty(), "speed run failed");
    std::printf("emu GEMM 2048x768x768 bf16, one worker: %s GFLOP/s of CPU time\n", speed.out.c_str());
}

// ---- one matmul through the raw API with everything spelled out ----
struct Call {
    cudaDataType_t ta = CUDA_R_16BF, tb = CUDA_R_16BF, tc = CUDA_R_16BF, td = CUDA_R_16BF;
    bool trans_a = false, trans_b = false;
    uint64_t m = 16, n = 16, k = 16;
    int64_t lda = 0, ldb = 0, ldc = 0, ldd = 0;  // 0: the tight value
    cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
    cudaDataType_t scale = CUDA_R_32F;
    const void *a = nullptr, *b = nullptr, *c = nullptr;
    void* d = nullptr;
    float alpha = 1.0f, beta = 0.0f;
    std::function<void(cublasLtMatmulDesc_t)> tweak_desc;
    std::function<void(cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t)>
        tweak_layouts;
    uint32_t min_alignment[4] = {256, 256, 256, 256};  // the preferences for A, B, C, D
    bool use_heuristic_algo = true;
    const cublasLtMatmulAlgo_t* algo = nullptr;
};
cublasStatus_t run_call(cublasLtHandle_t h, const Call& x) {
    cublasLtMatmulDesc_t desc;
    CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, x.compute, x.scale));
    const int32_t oa = x.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, ob = x.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &oa, sizeof oa));
    CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &ob, sizeof ob));
    if (x.tweak_desc) x.tweak_desc(desc);
    const uint64_t ar = x.trans_a ? x.k : x.m, ac = x.trans_a ? x.m : x.k, br = x.trans_b ? x.n : x.k,
                   bc = x.trans_b ? x.k : x.n;
    cublasLtMatrixLayout_t A, B, C, D;
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&A, x.ta, ar, ac, x.lda ? x.lda : int64_t(ar)));
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&B, x.tb, br, bc, x.ldb ? x.ldb : int64_t(br)));
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&C, x.tc, x.m, x.n, x.ldc ? x.ldc : int64_t(x.m)));
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&D, x.td, x.m, x.n, x.ldd ? x.ldd : int64_t(x.m)));
    if (x.tweak_layouts) x.tweak_layouts(A, B, C, D);
    cublasLtMatmulPreference_t pref;
    CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const cublasLtMatmulPreferenceAttributes_t align_attrs[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; ++i)
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, align_attrs[i], &x.min_alignment[i], sizeof(uint32_t)));
    cublasLtMatmulHeuristicResult_t r{};
    int found = 0;
    cublasStatus_t s = cublasLtMatmulAlgoGetHeuristic(h, desc, A, B, C, D, pref, 1, &r, &found);
    if (s == CUBLAS_STATUS_SUCCESS)
        s = cublasLtMatmul(h, desc, &x.alpha, x.a, A, x.b, B, &x.beta, x.c, C, x.d, D,
                           x.use_heuristic_algo ? &r.algo : x.algo, nullptr, 0, 0);
    for (auto l : {A, B, C, D}) CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(l));
    CUBLASLT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    CUBLASLT_CHECK(cublasLtMatmulDescDestroy(desc));
    return s;
}
#define EXPECT_STATUS(expr, want)                                                                              \
    do {                                                                                                        \
        const cublasStatus_t got_ = (expr);                                                                     \
        test::check(got_ == (want), "%s: %s, want %s", #expr, cublasLtGetStatusName(got_), cublasLtGetStatusName(want)); \
    } while (0)

void test_descriptors(cublasLtHandle_t h) {
    cublasLtMatrixLayout_t l;
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, 7, 5, 9));
    size_t written = 0;
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, nullptr, 0, &written), CUBLAS_STATUS_SUCCESS);
    test::check(written == sizeof(int64_t), "size query of LD gave %zu", written);
    int64_t ld = 0;
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld, &written), CUBLAS_STATUS_SUCCESS);
    test::check(ld == 9, "LD read back as %lld", static_cast<long long>(ld));
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, &ld, 4, nullptr), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_LD, nullptr, 0, nullptr), CUBLAS_STATUS_INVALID_VALUE);
    const int32_t batch = 3;
    const int64_t stride = 100;
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof batch), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride), CUBLAS_STATUS_SUCCESS);
    int32_t batch_back = 0;
    int64_t stride_back = 0;
    uint64_t rows = 0;
    uint32_t type = 0;
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch_back, sizeof batch_back, nullptr), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride_back, sizeof stride_back, nullptr), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows, nullptr), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_TYPE, &type, sizeof type, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(batch_back == 3 && stride_back == 100 && rows == 7 && type == CUDA_R_16BF, "layout attributes read back wrong");
    const int32_t zero = 0, row_order = CUBLASLT_ORDER_ROW;
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &zero, sizeof zero), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_ORDER, &row_order, sizeof row_order), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_PLANE_OFFSET, &stride, sizeof stride), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatrixLayoutGetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_MODE, &type, sizeof type, nullptr), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatrixLayoutDestroy(l), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutDestroy(nullptr), CUBLAS_STATUS_SUCCESS);

    cublasLtMatmulDesc_t d;
    CUBLASLT_CHECK(cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F_FAST_TF32, CUDA_R_32F));
    int32_t compute = 0, trans = 0;
    EXPECT_STATUS(cublasLtMatmulDescGetAttribute(d, CUBLASLT_MATMUL_DESC_COMPUTE_TYPE, &compute, sizeof compute, nullptr), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulDescGetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(compute == CUBLAS_COMPUTE_32F_FAST_TF32 && trans == CUBLAS_OP_N, "descriptor defaults read back wrong");
    const float* scale = reinterpret_cast<const float*>(uintptr_t(64));
    const float* scale_back = nullptr;
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &scale, sizeof scale), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulDescGetAttribute(d, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &scale_back, sizeof scale_back, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(scale_back == scale, "D scale pointer read back wrong");
    const int8_t fast = 1;
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof fast), CUBLAS_STATUS_SUCCESS);
    const uint32_t bias = CUBLASLT_EPILOGUE_BIAS, def = CUBLASLT_EPILOGUE_DEFAULT;
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &bias, sizeof bias), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &def, sizeof def), CUBLAS_STATUS_SUCCESS);
    const void* ptr = nullptr;
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof ptr), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &ptr, sizeof ptr), CUBLAS_STATUS_NOT_SUPPORTED);
    const int32_t vec = CUBLASLT_POINTER_MODE_DEVICE_VECTOR, bad_op = 7;
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_POINTER_MODE, &vec, sizeof vec), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, &bad_op, sizeof bad_op), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_TRANSB, nullptr, 4), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatmulDescDestroy(d), CUBLAS_STATUS_SUCCESS);

    cublasLtMatmulPreference_t p;
    CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&p));
    const uint64_t ws = 1 << 20;
    uint64_t ws_back = 0;
    EXPECT_STATUS(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulPreferenceGetAttribute(p, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_back, sizeof ws_back, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(ws_back == ws, "workspace preference read back as %llu", static_cast<unsigned long long>(ws_back));
    const uint32_t align = 16;
    uint32_t align_back = 0;
    EXPECT_STATUS(cublasLtMatmulPreferenceGetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_back, sizeof align_back, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(align_back == 256, "the default minimum alignment is %u, want cuBLASLt's 256", align_back);
    EXPECT_STATUS(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align, sizeof align), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulPreferenceGetAttribute(p, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_back, sizeof align_back, nullptr), CUBLAS_STATUS_SUCCESS);
    test::check(align_back == align, "minimum alignment of A read back as %u", align_back);
    EXPECT_STATUS(cublasLtMatmulPreferenceSetAttribute(p, CUBLASLT_MATMUL_PREF_SEARCH_MODE, &align, sizeof align), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_STATUS(cublasLtMatmulPreferenceDestroy(p), CUBLAS_STATUS_SUCCESS);

    // Storage that no Create or Init made is not a descriptor.
    cublasLtMatrixLayoutOpaque_t never{};
    cublasLtMatmulDescOpaque_t never_desc{};
    cublasLtMatmulPreferenceOpaque_t never_pref{};
    EXPECT_STATUS(cublasLtMatrixLayoutSetAttribute(&never, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatmulDescGetAttribute(&never_desc, CUBLASLT_MATMUL_DESC_TRANSA, &trans, sizeof trans, nullptr), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatmulPreferenceSetAttribute(&never_pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws), CUBLAS_STATUS_INVALID_VALUE);

    // The header's Init forms build descriptors in caller storage; a matmul runs on them.
    cublasLtMatrixLayoutOpaque_t la, lb, lc;
    cublasLtMatmulDescOpaque_t od;
    cublasLtMatmulPreferenceOpaque_t op;
    EXPECT_STATUS(cublasLtMatrixLayoutInit(&la, CUDA_R_16BF, 4, 3, 4), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutInit(&lb, CUDA_R_16BF, 3, 2, 3), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutInit(&lc, CUDA_R_32F, 4, 2, 4), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulDescInit(&od, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatmulPreferenceInit(&op), CUBLAS_STATUS_SUCCESS);
    EXPECT_STATUS(cublasLtMatrixLayoutInit_internal(&la, 8, CUDA_R_16BF, 4, 3, 4), CUBLAS_STATUS_ALLOC_FAILED);
    std::vector<bf16> ha(12), hb(6);
    for (int i = 0; i < 12; ++i) ha[i] = __float2bfloat16(float(i));
    for (int i = 0; i < 6; ++i) hb[i] = __float2bfloat16(float(i % 3 - 1));
    DeviceBuffer<bf16> da(ha), db(hb);
    DeviceBuffer<float> dc(8);
    cublasLtMatmulHeuristicResult_t r[2]{};
    int found = 0;
    EXPECT_STATUS(cublasLtMatmulAlgoGetHeuristic(h, &od, &la, &lb, &lc, &lc, &op, 0, r, &found), CUBLAS_STATUS_INVALID_VALUE);
    EXPECT_STATUS(cublasLtMatmulAlgoGetHeuristic(h, &od, &la, &lb, &lc, &lc, &op, 2, r, &found), CUBLAS_STATUS_SUCCESS);
    test::check(found == 1 && r[0].state == CUBLAS_STATUS_SUCCESS && r[0].workspaceSize == 0,
                "heuristic gave %d results, state %d, workspace %zu", found, r[0].state, r[0].workspaceSize);
    const float one = 1.0f, zero_f = 0.0f;
    EXPECT_STATUS(cublasLtMatmul(h, &od, &one, da.ptr, &la, db.ptr, &lb, &zero_f, dc.ptr, &lc, dc.ptr, &lc, &r[0].algo,
                                 nullptr, 0, 0),
                  CUBLAS_STATUS_SUCCESS);
    // D(i,j) = sum_p A(i,p) B(p,j), A(i,p) = i + 4p, B(p,j) = (p + 3j) % 3 - 1
    const auto got = dc.download();
    bool ok = true;
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 2; ++j) {
            double want = 0;
            for (int p = 0; p < 3; ++p) want += double(i + 4 * p) * double((p + 3 * j) % 3 - 1);
            ok = ok && got[i + 4 * j] == want;
        }
    test::check(ok, "matmul on Init-made descriptors");

    test::check(std::string(cublasLtGetStatusName(CUBLAS_STATUS_NOT_SUPPORTED)) == "CUBLAS_STATUS_NOT_SUPPORTED" &&
                    std::string(cublasLtGetStatusName(CUBLAS_STATUS_SUCCESS)) == "CUBLAS_STATUS_SUCCESS",
                "status names");
    for (int s : {0, 1, 3, 7, 8, 11, 13, 14, 15, 16})
        test::check(std::string(cublasLtGetStatusString(cublasStatus_t(s))) != "unknown status" &&
                        std::string(cublasLtGetStatusName(cublasStatus_t(s))) != "CUBLAS_STATUS_UNKNOWN",
                    "status %d has no name or string", s);
    EXPECT_STATUS(cublasLtDestroy(nullptr), CUBLAS_STATUS_NOT_INITIALIZED);
    EXPECT_STATUS(cublasLtCreate(nullptr), CUBLAS_STATUS_INVALID_VALUE);
}

void test_semantics(cublasLtHandle_t h) {
    std::mt19937_64 g(test::seed() + 4);
    DeviceBuffer<bf16> a(random_values<bf16>(64 * 64, 1.0, g)), b(random_values<bf16>(64 * 64, 1.0, g));
    DeviceBuffer<e4m3> a8(random_values<e4m3>(64 * 64, 100.0, g)), b8(random_values<e4m3>(64 * 64, 100.0, g));
    DeviceBuffer<bf16> d(64 * 64), d2(64 * 64);
    DeviceBuffer<float> f(64 * 64);
    DeviceBuffer<float> scalars(std::vector<float>{2.0f, 0.0f, 7.0f});

    Call base;
    base.a = a.ptr;
    base.b = b.ptr;
    base.c = d.ptr;
    base.d = d.ptr;
    EXPECT_STATUS(run_call(h, base), CUBLAS_STATUS_SUCCESS);
    const auto plain = d.download();

    {  // alpha and beta from device memory
        cublasLtMatmulDesc_t desc;
        CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const int32_t mode = CUBLASLT_POINTER_MODE_DEVICE;
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof mode));
        cublasLtMatrixLayout_t l;
        CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, 16, 16, 16));
        EXPECT_STATUS(cublasLtMatmul(h, desc, scalars.ptr, a.ptr, l, b.ptr, l, scalars.ptr + 1, d2.ptr, l, d2.ptr, l,
                                     nullptr, nullptr, 0, 0),
                      CUBLAS_STATUS_SUCCESS);
        const auto twice = d2.download();
        bool ok = true;
        for (int i = 0; i < 256; ++i) ok = ok && value(twice[i]) == value(__float2bfloat16(2.0f * float(value(plain[i]))));
        test::check(ok, "alpha = 2 from device memory");
        CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(l));
        CUBLASLT_CHECK(cublasLtMatmulDescDestroy(desc));
    }
    {  // beta = 0: C is never read, so NaNs in it do not reach D
        std::vector<bf16> nans(64 * 64, __float2bfloat16(NAN));
        DeviceBuffer<bf16> c(nans);
        Call x = base;
        x.c = c.ptr;
        x.d = d2.ptr;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        const auto got = d2.download();
        test::check(std::equal(got.begin(), got.begin() + 256, plain.begin(),
                               [](bf16 p, bf16 q) { return bits(p) == bits(q); }),
                    "beta = 0 read C");
    }
    {  // k = 0: D = beta C
        Call x = base;
        x.k = 0;
        x.lda = 16;
        x.ldb = 1;
        x.beta = 0.5f;
        x.c = d.ptr;
        x.d = d2.ptr;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        const auto got = d2.download();
        bool ok = true;
        for (int i = 0; i < 256; ++i) ok = ok && value(got[i]) == 0.5 * value(plain[i]);
        test::check(ok, "k = 0 gives beta * C");
    }
    {  // an empty D: nothing to do
        Call x = base;
        x.m = 0;
        x.lda = 1;
        x.ldc = x.ldd = 1;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
    }
    {  // fp8: the D scale applies only to fp8 D, so a bf16 D ignores it
        Call x = base;
        x.ta = x.tb = CUDA_R_8F_E4M3;
        x.trans_a = true;
        x.a = a8.ptr;
        x.b = b8.ptr;
        x.c = x.d = d2.ptr;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        const auto unscaled = d2.download();
        const float* dscale = scalars.ptr + 2;
        x.tweak_desc = [dscale](cublasLtMatmulDesc_t desc) {
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &dscale, sizeof dscale));
        };
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        const auto with_d_scale = d2.download();
        test::check(std::equal(unscaled.begin(), unscaled.begin() + 256, with_d_scale.begin(),
                               [](bf16 p, bf16 q) { return bits(p) == bits(q); }),
                    "a D scale changed a bf16 D");
        x.compute = CUBLAS_COMPUTE_32F_FAST_TF32;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
        x.compute = CUBLAS_COMPUTE_32F;
        x.a = reinterpret_cast<const unsigned char*>(a8.ptr) + 8;  // fp8 pointers must be 16-byte aligned
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
        x.a = a8.ptr;
        x.td = x.tc = CUDA_R_8F_E4M3;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
        x.td = x.tc = CUDA_R_16BF;
        x.tweak_layouts = [](cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                             cublasLtMatrixLayout_t D) {
            const int32_t two = 2;
            const int64_t odd = 264, even = 256;
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(A, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &odd, sizeof odd));
            for (auto l : {A, B, C, D}) {
                CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two));
                if (l != A)
                    CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &even, sizeof even));
            }
        };
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);  // batch stride 264 bytes breaks 16-byte alignment
    }
    {  // scale pointers belong to fp8 matmuls
        Call x = base;
        const float* s = scalars.ptr;
        x.tweak_desc = [s](cublasLtMatmulDesc_t desc) {
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &s, sizeof s));
        };
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);
    }
    {  // type combinations emu does not emulate
        Call x = base;
        x.tc = CUDA_R_32F;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);  // C and D differ
        x = base;
        x.tb = CUDA_R_8F_E4M3;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);  // bf16 x e4m3
        x = base;
        x.ta = x.tb = CUDA_R_32F;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);  // fp32 inputs
        x = base;
        x.compute = CUBLAS_COMPUTE_16F;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
        x = base;
        x.scale = CUDA_R_16BF;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
    }
    {  // malformed calls
        Call x = base;
        x.a = reinterpret_cast<const unsigned char*>(a.ptr) + 1;  // not element-aligned
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);
        x = base;
        x.ldd = 32;  // C == D but their layouts differ
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);
        x = base;
        x.tweak_layouts = [](cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t) {
            const int32_t two = 2;
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(A, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two));
        };
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);  // batch counts differ
        x = base;
        x.tweak_layouts = [](cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                             cublasLtMatrixLayout_t D) {
            const int32_t two = 2;
            const int64_t back = -256;
            for (auto l : {A, B, C, D})
                CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two));
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(B, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &back, sizeof back));
        };
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);  // negative stride
        x = base;
        cublasLtMatmulAlgo_t forged{};
        x.use_heuristic_algo = false;
        x.algo = &forged;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);
        x.algo = nullptr;  // cuBLASLt chooses itself
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        x = base;
        x.b = nullptr;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);
    }
}

// The real heuristic's alignment model (emu/cublaslt.cpp): under the default 256-byte preferences the
// algorithm may rely on 256-byte aligned pointers, less only where a leading dimension or batch stride
// (in bytes) or a lower preference says so; below what the kernels take there is no algorithm. Scales
// live in device memory; alpha and beta where the pointer mode says.
void test_alignment_rules(cublasLtHandle_t h) {
    std::mt19937_64 g(test::seed() + 5);
    DeviceBuffer<e4m3> a8(random_values<e4m3>(64 * 64 + 256, 100.0, g)), b8(random_values<e4m3>(64 * 64, 100.0, g));
    DeviceBuffer<bf16> d(64 * 64), d_moved(64 * 64 + 256);
    DeviceBuffer<float> scales(std::vector<float>{0.5f, 4.0f});
    const unsigned char* a16 = reinterpret_cast<const unsigned char*>(a8.ptr) + 16;  // 16- but not 256-byte aligned

    Call fp8;  // k = 256: A's and B's leading dimensions are 256 bytes
    fp8.ta = fp8.tb = CUDA_R_8F_E4M3;
    fp8.trans_a = true;
    fp8.k = 256;
    fp8.a = a16;
    fp8.b = b8.ptr;
    fp8.c = fp8.d = d.ptr;
    EXPECT_STATUS(run_call(h, fp8), CUBLAS_STATUS_NOT_SUPPORTED);  // planted: the default preference promised 256
    fp8.min_alignment[0] = 16;  // stated, as PyTorch does: the same call runs
    EXPECT_STATUS(run_call(h, fp8), CUBLAS_STATUS_SUCCESS);
    const auto from_a16 = d.download();
    {  // the same operand bytes at an aligned address under the defaults: the same product
        std::vector<e4m3> host(256 * 16);
        CUDA_CHECK(cudaMemcpy(host.data(), a16, host.size(), cudaMemcpyDeviceToHost));
        DeviceBuffer<e4m3> aligned(host);
        Call x = fp8;
        x.a = aligned.ptr;
        x.min_alignment[0] = 256;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        const auto want = d.download();
        test::check(test::same_bits(from_a16, want), "fp8 from a 16-byte aligned A differs from the aligned copy");
    }
    fp8.min_alignment[0] = 8;  // fp8 kernels need 16 bytes: no algorithm
    EXPECT_STATUS(run_call(h, fp8), CUBLAS_STATUS_NOT_SUPPORTED);
    fp8.min_alignment[0] = 16;
    fp8.min_alignment[3] = 32;
    fp8.d = d_moved.ptr + 8;  // 16 bytes in: below the 32 promised for D
    fp8.c = fp8.d;
    EXPECT_STATUS(run_call(h, fp8), CUBLAS_STATUS_NOT_SUPPORTED);
    fp8.min_alignment[2] = fp8.min_alignment[3] = 16;
    EXPECT_STATUS(run_call(h, fp8), CUBLAS_STATUS_SUCCESS);

    // bf16: a leading dimension of 17 elements (34 bytes) allows only 2-byte alignment, so the algorithm
    // cannot rely on more, and an element-aligned pointer is enough.
    DeviceBuffer<bf16> a(random_values<bf16>(4096, 1.0, g)), b(random_values<bf16>(16 * 16, 1.0, g));
    Call bf;
    bf.a = a.ptr + 1;
    bf.b = b.ptr;
    bf.c = bf.d = d.ptr;
    EXPECT_STATUS(run_call(h, bf), CUBLAS_STATUS_NOT_SUPPORTED);  // tight ld 16: 32 bytes
    bf.lda = 17;
    EXPECT_STATUS(run_call(h, bf), CUBLAS_STATUS_SUCCESS);
    bf.lda = 0;
    bf.min_alignment[0] = 1;  // below the element size: no algorithm
    EXPECT_STATUS(run_call(h, bf), CUBLAS_STATUS_NOT_SUPPORTED);
    {  // lda 128 (256 bytes) and a batch stride of 272 elements (544 bytes) allow 32-byte alignment: a
       // pointer 32 bytes in runs, 16 does not
        Call x;
        x.lda = 128;
        x.b = b.ptr;
        x.c = x.d = d.ptr;
        x.tweak_layouts = [](cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C,
                             cublasLtMatrixLayout_t D) {
            const int32_t two = 2;
            const int64_t strides[4] = {272, 0, 256, 256};
            cublasLtMatrixLayout_t ls[4] = {A, B, C, D};
            for (int i = 0; i < 4; ++i) {
                CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &two, sizeof two));
                CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(ls[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                                                                &strides[i], sizeof strides[i]));
            }
        };
        x.a = a.ptr + 16;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
        x.a = a.ptr + 8;
        EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_NOT_SUPPORTED);
    }

    // Scale pointers in host memory, alpha in the wrong memory for its pointer mode.
    std::vector<float> host_scales{0.5f, 4.0f};
    Call x = fp8;
    x.a = a8.ptr;
    x.min_alignment[0] = 256;
    const float* host_scale = host_scales.data();
    x.tweak_desc = [host_scale](cublasLtMatmulDesc_t desc) {
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &host_scale, sizeof host_scale));
    };
    EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_INVALID_VALUE);  // planted: a host scale
    const float* device_scale = scales.ptr;
    x.tweak_desc = [device_scale](cublasLtMatmulDesc_t desc) {
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &device_scale, sizeof device_scale));
    };
    EXPECT_STATUS(run_call(h, x), CUBLAS_STATUS_SUCCESS);
    cublasLtMatrixLayout_t l;
    CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&l, CUDA_R_16BF, 16, 16, 16));
    for (const int32_t mode : {CUBLASLT_POINTER_MODE_HOST, CUBLASLT_POINTER_MODE_DEVICE}) {
        cublasLtMatmulDesc_t desc;
        CUBLASLT_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof mode));
        const bool device = mode == CUBLASLT_POINTER_MODE_DEVICE;
        const float* right = device ? scales.ptr : host_scales.data();
        const float* wrong = device ? host_scales.data() : scales.ptr;
        EXPECT_STATUS(cublasLtMatmul(h, desc, right, a.ptr, l, b.ptr, l, right, d.ptr, l, d.ptr, l, nullptr, nullptr, 0, 0),
                      CUBLAS_STATUS_SUCCESS);
        EXPECT_STATUS(cublasLtMatmul(h, desc, wrong, a.ptr, l, b.ptr, l, right, d.ptr, l, d.ptr, l, nullptr, nullptr, 0, 0),
                      CUBLAS_STATUS_INVALID_VALUE);
        CUBLASLT_CHECK(cublasLtMatmulDescDestroy(desc));
    }
    CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(l));
}

// D = alpha * 1 for many alphas: the epilogue's bf16 rounding (vector lanes and the scalar tail)
// must match __float2bfloat16 bit for bit, ties to even, NaN and overflow included.
void test_bf16_rounding(cublasLtHandle_t h) {
    const int m = 40;
    DeviceBuffer<bf16> ones(std::vector<bf16>(m, __float2bfloat16(1.0f)));
    DeviceBuffer<bf16> one(std::vector<bf16>(1, __float2bfloat16(1.0f)));
    DeviceBuffer<bf16> d(m);
    std::vector<float> alphas = {1.0f + 0x1p-8f,  1.0f + 3 * 0x1p-8f, -(1.0f + 0x1p-8f), 1.0f + 0x1p-8f + 0x1p-20f,
                                 3.3895314e38f,   INFINITY,            -INFINITY,          NAN,
                                 1e-40f,          -0.0f,               65505.0f};
    std::mt19937_64 g(test::seed() + 5);
    for (int i = 0; i < 40; ++i) {
        float f;
        const uint32_t u = static_cast<uint32_t>(g());
        std::memcpy(&f, &u, 4);
        alphas.push_back(f);
    }
    size_t bad = 0;
    for (float alpha : alphas) {
        Call x;
        x.m = m;
        x.n = 1;
        x.k = 1;
        x.a = ones.ptr;
        x.b = one.ptr;
        x.c = x.d = d.ptr;
        x.alpha = alpha;
        if (run_call(h, x) != CUBLAS_STATUS_SUCCESS) {
            ++bad;
            continue;
        }
        const uint16_t want = bits(__float2bfloat16(alpha * 1.0f));
        for (bf16 v : d.download()) bad += bits(v) != want;
    }
    test::check(bad == 0, "bf16 rounding of D: %zu mismatches", bad);
}

int main() {
    test::seed();  // printed once, before the children
    test_children();
    cublasLtHandle_t h;
    CUBLASLT_CHECK(cublasLtCreate(&h));
    test_descriptors(h);
    test_semantics(h);
    test_alignment_rules(h);
    test_bf16_rounding(h);
    CUBLASLT_CHECK(cublasLtDestroy(h));
    return test::finish();
}
