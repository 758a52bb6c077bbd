// Matmuls through cuBLASLt, in row-major terms: every matrix is stored row-major, and each call
// computes out(MxN) = op(a)(MxK) @ op(b)(KxN). cuBLASLt is column-major, so a call asks it for
// out^T = op(b)^T @ op(a)^T, which is the same memory: its A is our b, its B is our a.
// Descriptors and the algorithm are made once per problem shape and cached, so a training step
// makes no heuristic queries after the first. Each call is recorded for the step profiler as a
// `gemm` op named by its caller's purpose (`gemm_<what>`, default gemm_bf16 / gemm_fp8); a dry run
// records it and makes no plan and no call.
#pragma once
#include "common.cuh"

#include <cublasLt.h>

#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <type_traits>
#include <unordered_map>

// ---- error check: a failed call names itself, its file and line, then exits ----
inline void cublaslt_check(cublasStatus_t s, const char* what, const char* file, int line) {
    if (s != CUBLAS_STATUS_SUCCESS) {
        std::fprintf(stderr, "cuBLASLt error at %s:%d: %s: %s (%s)\n", file, line, what, cublasLtGetStatusString(s),
                     cublasLtGetStatusName(s));
        std::exit(EXIT_FAILURE);
    }
}
#define CUBLASLT_CHECK(call) cublaslt_check((call), #call, __FILE__, __LINE__)

// The cudaDataType of each element type the wrapper takes.
template <class T>
constexpr cudaDataType_t cuda_data_type() {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, float> || std::is_same_v<T, __nv_fp8_e4m3> ||
                      std::is_same_v<T, __nv_fp8_e5m2>,
                  "matmul element types: bf16, fp32, fp8 e4m3, fp8 e5m2");
    if constexpr (std::is_same_v<T, __nv_bfloat16>) return CUDA_R_16BF;
    if constexpr (std::is_same_v<T, float>) return CUDA_R_32F;
    if constexpr (std::is_same_v<T, __nv_fp8_e4m3>) return CUDA_R_8F_E4M3;
    return CUDA_R_8F_E5M2;
}

inline double cuda_data_type_bytes(cudaDataType_t t) {
    switch (t) {
        case CUDA_R_32F: return 4;
        case CUDA_R_16BF: return 2;
        default: return 1;  // the fp8 formats
    }
}

// Strided batch: matrix i of an operand starts i * stride elements after matrix 0 (a stride of 0
// shares one matrix across the batch); a separate c uses out's stride.
struct MatmulBatch {
    int count = 1;
    int64_t stride_a = 0, stride_b = 0, stride_out = 0;
};

// The cuBLASLt handle, its workspace and the per-shape plans. One per device; not thread-safe.
class CublasLt {
public:
    static constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper

    explicit CublasLt(size_t workspace_bytes = kWorkspaceBytes) : workspace_bytes_(workspace_bytes) {
        CUBLASLT_CHECK(cublasLtCreate(&handle_));
        CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
    }
    ~CublasLt() {
        for (auto& [shape, plan] : plans_) {
            CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(plan.a));
            CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(plan.b));
            CUBLASLT_CHECK(cublasLtMatrixLayoutDestroy(plan.d));
            CUBLASLT_CHECK(cublasLtMatmulDescDestroy(plan.desc));
        }
        CUDA_CHECK(cudaFree(workspace_));
        CUBLASLT_CHECK(cublasLtDestroy(handle_));
    }
    CublasLt(const CublasLt&) = delete;
    CublasLt& operator=(const CublasLt&) = delete;

    size_t plan_count() const { return plans_.size(); }  // one per distinct shape met so far

    // One problem in cuBLASLt's column-major terms: D(mxn) = op(A)(mxk) @ op(B)(kxn), C shaped as D.
    struct Shape {
        cudaDataType_t a_type, b_type, d_type;
        bool trans_a, trans_b, scaled, fast_accum;
        int m, n, k;
        int64_t lda, ldb, ldd;
        int batch;
        int64_t stride_a, stride_b, stride_d;
        std::array<int64_t, 17> key() const {
            return {a_type, b_type, d_type, trans_a, trans_b, scaled, fast_accum, m, n, k, lda, ldb, ldd, batch,
                    stride_a, stride_b, stride_d};
        }
        bool operator==(const Shape& o) const { return key() == o.key(); }
    };

    // What a call computes and moves: 2 m n k per matrix of the batch on the tensor cores; each distinct
    // operand read once (one with batch stride 0 once for the whole batch; X X^T reads X once), C only
    // when beta != 0 (c: null otherwise), the fp8 scales; D written. name: the caller's gemm_<what>, or
    // nullptr for gemm_bf16 / gemm_fp8.
    static Work gemm_work(const Shape& s, const void* a, const void* b, const void* c, const char* name) {
        const auto operand = [&s](cudaDataType_t type, int rows, int cols, int64_t stride) {
            return cuda_data_type_bytes(type) * rows * cols * (stride == 0 ? 1 : s.batch);
        };
        const double d = cuda_data_type_bytes(s.d_type) * s.m * s.n * s.batch;
        const double read = operand(s.a_type, s.m, s.k, s.stride_a) +
                            (b != a ? operand(s.b_type, s.k, s.n, s.stride_b) : 0) + (c && c != a && c != b ? d : 0);
        return Work{.name = name ? name : (s.scaled ? "gemm_fp8" : "gemm_bf16"),
                    .tc_flops = 2.0 * s.m * s.n * s.k * s.batch,
                    .bytes_read = read + (s.scaled ? 2 * sizeof(float) : 0),
                    .bytes_written = d,
                    .gemm = s.scaled ? GemmType::fp8 : GemmType::bf16,
                    .m = s.m, .n = s.n, .k = s.k, .batch = s.batch};
    }

    // D = alpha * scale_a * scale_b * op(A) @ op(B) + beta * C (scales only for fp8, else NULL)
    void run(const Shape& s, const void* A, const void* B, const void* C, void* D, float alpha, float beta,
             const float* scale_a, const float* scale_b, cudaStream_t stream, const char* name = nullptr) {
        if (!record_op(OpKind::gemm, gemm_work(s, A, B, beta != 0.0f ? C : nullptr, name), stream)) return;
        Plan& p = plan(s, scale_a, scale_b);
        if (s.scaled) {
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a,
                                                          sizeof(scale_a)));
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b,
                                                          sizeof(scale_b)));
        }
        CUBLASLT_CHECK(cublasLtMatmul(handle_, p.desc, &alpha, A, p.a, B, p.b, &beta, C, p.d, D, p.d, &p.algo,
                                      workspace_, workspace_bytes_, stream));
    }

private:
    struct Plan {
        cublasLtMatmulDesc_t desc;
        cublasLtMatrixLayout_t a, b, d;
        cublasLtMatmulAlgo_t algo;
    };
    struct ShapeHash {  // FNV-1a over the shape's fields
        size_t operator()(const Shape& s) const {
            uint64_t h = 1469598103934665603ull;
            for (int64_t v : s.key()) h = (h ^ static_cast<uint64_t>(v)) * 1099511628211ull;
            return static_cast<size_t>(h);
        }
    };

    static cublasLtMatrixLayout_t make_layout(cudaDataType_t type, int rows, int cols, int64_t ld, int batch,
                                              int64_t stride) {
        cublasLtMatrixLayout_t l;
        CUBLASLT_CHECK(cublasLtMatrixLayoutCreate(&l, type, rows, cols, ld));
        if (batch > 1) {
            CUBLASLT_CHECK(cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch, sizeof(batch)));
            CUBLASLT_CHECK(
                cublasLtMatrixLayoutSetAttribute(l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
        }
        return l;
    }

    // The cached plan for `s`, made on first use. Scale pointers are set before the heuristic
    // because their presence (not their address) can change the algorithm.
    Plan& plan(const Shape& s, const float* scale_a, const float* scale_b) {
        auto it = plans_.find(s);
        if (it != plans_.end()) return it->second;
        Plan p;
        CUBLASLT_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        const int32_t ta = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, tb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta)));
        CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb)));
        if (s.scaled) {
            const int8_t fast = s.fast_accum ? 1 : 0;
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &scale_a,
                                                          sizeof(scale_a)));
            CUBLASLT_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &scale_b,
                                                          sizeof(scale_b)));
        }
        p.a = make_layout(s.a_type, s.trans_a ? s.k : s.m, s.trans_a ? s.m : s.k, s.lda, s.batch, s.stride_a);
        p.b = make_layout(s.b_type, s.trans_b ? s.n : s.k, s.trans_b ? s.k : s.n, s.ldb, s.batch, s.stride_b);
        p.d = make_layout(s.d_type, s.m, s.n, s.ldd, s.batch, s.stride_d);

        cublasLtMatmulPreference_t pref;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        const uint64_t ws = workspace_bytes_;
        CUBLASLT_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
        cublasLtMatmulHeuristicResult_t result{};
        int found = 0;
        CUBLASLT_CHECK(cublasLtMatmulAlgoGetHeuristic(handle_, p.desc, p.a, p.b, p.d, p.d, pref, 1, &result, &found));
        CUBLASLT_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0) {
            std::fprintf(stderr, "cuBLASLt has no algorithm for D(%dx%d) = op(A) @ op(B), k %d, batch %d, types %d x %d -> %d\n",
                         s.m, s.n, s.k, s.batch, s.a_type, s.b_type, s.d_type);
            std::exit(EXIT_FAILURE);
        }
        p.algo = result.algo;
        return plans_.emplace(s, p).first->second;
    }

    cublasLtHandle_t handle_ = nullptr;
    void* workspace_ = nullptr;
    size_t workspace_bytes_;
    std::unordered_map<Shape, Plan, ShapeHash> plans_;
};

// out(MxN) = alpha * scale_a * scale_b * op(a) @ op(b) + beta * c, row-major; c defaults to out
template <class Out, class A, class B>
void matmul_rowmajor(CublasLt& lt, Out* out, const A* a, bool trans_a, const B* b, bool trans_b, int M, int N, int K,
                     float alpha, float beta, const Out* c, const float* scale_a, const float* scale_b,
                     bool fast_accum, const MatmulBatch& batch, cudaStream_t stream, const char* name) {
    // Row-major a (MxK) is column-major a^T (KxM, ld K); stored transposed (KxM) it is column-major MxK, ld M.
    CublasLt::Shape s{};
    s.a_type = cuda_data_type<B>();
    s.b_type = cuda_data_type<A>();
    s.d_type = cuda_data_type<Out>();
    s.trans_a = trans_b;
    s.trans_b = trans_a;
    s.scaled = scale_a != nullptr;
    s.fast_accum = fast_accum;
    s.m = N;
    s.n = M;
    s.k = K;
    s.lda = trans_b ? K : N;
    s.ldb = trans_a ? M : K;
    s.ldd = N;
    s.batch = batch.count;
    s.stride_a = batch.stride_b;
    s.stride_b = batch.stride_a;
    s.stride_d = batch.stride_out;
    lt.run(s, b, a, c ? c : out, out, alpha, beta, scale_b, scale_a, stream, name);
}

// ---- bf16 ----
// out(MxN) = alpha * op(a) @ op(b) + beta * c; a is MxK (KxM if trans_a), b is KxN (NxK if trans_b),
// out and c (default: out) are bf16 or fp32; with a batch, each matrix i at its stride. name: the
// profiler's gemm_<what> (default gemm_bf16), as for every wrapper below.
template <class Out>
void matmul_bf16(CublasLt& lt, Out* out, const __nv_bfloat16* a, bool trans_a, const __nv_bfloat16* b, bool trans_b,
                 int M, int N, int K, cudaStream_t stream, float alpha = 1.0f, float beta = 0.0f,
                 const std::type_identity_t<Out>* c = nullptr, const MatmulBatch& batch = {},
                 const char* name = nullptr) {
    matmul_rowmajor(lt, out, a, trans_a, b, trans_b, M, N, K, alpha, beta, c, static_cast<const float*>(nullptr),
                    static_cast<const float*>(nullptr), false, batch, stream, name);
}

// out(MxN) = x(MxK) @ w(NxK)^T (+ out when accumulating): a linear layer's forward
template <class Out>
void matmul_forward(CublasLt& lt, Out* out, const __nv_bfloat16* x, const __nv_bfloat16* w, int M, int N, int K,
                    cudaStream_t stream, bool accumulate = false, const char* name = nullptr) {
    matmul_bf16(lt, out, x, false, w, true, M, N, K, stream, 1.0f, accumulate ? 1.0f : 0.0f, nullptr, {}, name);
}

// dx(MxK) = dy(MxN) @ w(NxK) (+ dx when accumulating): a linear layer's gradient to its input
template <class Out>
void matmul_backward_input(CublasLt& lt, Out* dx, const __nv_bfloat16* dy, const __nv_bfloat16* w, int M, int N, int K,
                           cudaStream_t stream, bool accumulate = false, const char* name = nullptr) {
    matmul_bf16(lt, dx, dy, false, w, false, M, K, N, stream, 1.0f, accumulate ? 1.0f : 0.0f, nullptr, {}, name);
}

// dw(NxK) = dy(MxN)^T @ x(MxK) (+ dw when accumulating): a linear layer's gradient to its weight
template <class Out>
void matmul_backward_weight(CublasLt& lt, Out* dw, const __nv_bfloat16* dy, const __nv_bfloat16* x, int M, int N, int K,
                            cudaStream_t stream, bool accumulate = false, const char* name = nullptr) {
    matmul_bf16(lt, dw, dy, true, x, false, N, K, M, stream, 1.0f, accumulate ? 1.0f : 0.0f, nullptr, {}, name);
}

// ---- fp8 ----
// out(MxN) = (*scale_a * a(MxK)) @ (*scale_b * b(NxK))^T + beta * out, scales on the device.
// Hopper's fp8 GEMMs take only this form (both operands K-contiguous) and need 16-byte aligned matrix
// pointers; we also keep M, N and K multiples of 16 and each scale 16-byte aligned (emu refuses less:
// an H100 refused scales 4 bytes off). A8, B8: e4m3 or e5m2, not both e5m2; Out: bf16 or fp32.
// fast_accum trades accuracy for speed on the GPU (emu always accumulates exactly in fp32).
template <class Out, class A8, class B8>
void matmul_fp8(CublasLt& lt, Out* out, const A8* a, const float* scale_a, const B8* b, const float* scale_b, int M,
                int N, int K, cudaStream_t stream, bool fast_accum = false, float beta = 0.0f,
                const char* name = nullptr) {
    static_assert(!std::is_same_v<A8, __nv_fp8_e5m2> || !std::is_same_v<B8, __nv_fp8_e5m2>,
                  "cuBLASLt has no e5m2 x e5m2 matmul");
    static_assert((std::is_same_v<A8, __nv_fp8_e4m3> || std::is_same_v<A8, __nv_fp8_e5m2>) &&
                      (std::is_same_v<B8, __nv_fp8_e4m3> || std::is_same_v<B8, __nv_fp8_e5m2>),
                  "matmul_fp8 takes fp8 operands");
    static_assert(std::is_same_v<Out, __nv_bfloat16> || std::is_same_v<Out, float>, "matmul_fp8 writes bf16 or fp32");
    matmul_rowmajor(lt, out, a, false, b, true, M, N, K, 1.0f, beta, static_cast<const Out*>(nullptr), scale_a, scale_b,
                    fast_accum, MatmulBatch{}, stream, name);
}
