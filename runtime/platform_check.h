// `--check-platform`: a kernel, a cuBLASLt matmul and an NCCL all-reduce on every rank, compared with
// the host, so a broken driver, library or interconnect shows before a long run; and the wgmma guard
// (run before every training run too): the Hopper kernels a run selected against the mma.sync kernels.
#pragma once
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "../kernels/attention.cuh"
#include "../kernels/common.cuh"
#include "../kernels/comms.cuh"
#include "../kernels/matmul.cuh"
#include "../kernels/mlp.cuh"
#include "host_comm.h"

// ---- the wgmma guard ----
// The wgmma kernels (attention_wgmma.cuh, linear_relu_square_wgmma_kernel) are verified under emu,
// whose twins decode descriptors, swizzles and TMA boxes as the PTX ISA describes them; a detail the
// hardware reads differently would train on garbage without a word. So before training, every rank
// runs each kernel the run selected as wgmma beside its mma.sync twin on a small problem of fresh
// random data and stops on a disagreement, naming the flag that falls back.
struct HopperKernels {
    AttentionKernel attention;
    MlpKernel mlp;
};

// Under emu the two kernels give the same bits. On a GPU both round fp32 sums to bf16 once per output
// (and the attention kernels round P to bf16 before P V), but the hardware's accumulation order within
// a wgmma is not specified, so a sum may round to the neighbouring bf16, and a score a last-bit apart
// may give a neighbouring bf16 P: a few ulps (2^-8 relative each) of a typical value. The tolerance is
// 8 ulps, 2^-5, of |want| + rms(want); a misread descriptor, swizzle or box gives errors of order 1.
constexpr double kWgmmaGuardTolerance = 0x1p-5;

// A device buffer for the guard's problems, freed with it.
template <class T>
struct GuardBuffer {
    T* ptr = nullptr;
    size_t n = 0;
    explicit GuardBuffer(size_t count) : n(count) { CUDA_CHECK(cudaMalloc(&ptr, n * sizeof(T))); }
    GuardBuffer(const std::vector<T>& host, cudaStream_t s) : GuardBuffer(host.size()) {
        CUDA_CHECK(cudaMemcpyAsync(ptr, host.data(), n * sizeof(T), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaStreamSynchronize(s));  // `host` may be a temporary
    }
    GuardBuffer(const GuardBuffer&) = delete;
    GuardBuffer& operator=(const GuardBuffer&) = delete;
    ~GuardBuffer() { CUDA_CHECK(cudaFree(ptr)); }
    std::vector<T> read(cudaStream_t s) const {
        std::vector<T> host(n);
        CUDA_CHECK(cudaMemcpyAsync(host.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
        return host;
    }
};

std::vector<__nv_bfloat16> guard_normal_bf16(std::mt19937_64& rng, size_t n) {
    std::normal_distribution<float> normal;
    std::vector<__nv_bfloat16> v(n);
    for (auto& x : v) x = __float2bfloat16(normal(rng));
    return v;
}

inline float guard_value(__nv_bfloat16 x) { return __bfloat162float(x); }
inline float guard_value(float x) { return x; }

// One output of both kernels compared: the worst |got - want| / (|want| + rms(want)), and whether the
// bits are equal (emu's criterion).
struct GuardDiff {
    std::string tensor;
    double worst = 0;
    bool same_bits = true;
};
template <class T>
GuardDiff guard_diff(const char* tensor, const GuardBuffer<T>& got_d, const GuardBuffer<T>& want_d, cudaStream_t s) {
    const std::vector<T> got = got_d.read(s), want = want_d.read(s);
    double sq = 0;
    for (T w : want) sq += double(guard_value(w)) * guard_value(w);
    const double rms = std::sqrt(sq / double(want.size()));
    GuardDiff d{tensor};
    d.same_bits = std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0;
    for (size_t i = 0; i < got.size(); ++i) {
        const double g = guard_value(got[i]), w = guard_value(want[i]);
        const double e = std::isfinite(g) ? std::fabs(g - w) / (std::fabs(w) + rms) : INFINITY;
        d.worst = std::max(d.worst, e);
    }
    return d;
}

// The worst of several outputs' differences, and whether all agree (bits under emu, else the tolerance).
struct GuardResult {
    GuardDiff worst;
    bool agree = true;
};
GuardResult guard_result(const std::vector<GuardDiff>& diffs) {
    GuardResult r;
    for (const GuardDiff& d : diffs) {
        const bool agree = kEmulated ? d.same_bits : d.worst <= kWgmmaGuardTolerance;
        if (r.agree && !agree) r.worst = d;
        if (r.agree && agree && d.worst >= r.worst.worst) r.worst = d;
        r.agree = r.agree && agree;
    }
    return r;
}

// The CPU build's planted fault for tests: TRAIN_GPT_PLANT_WGMMA_FAULT=attention|mlp changes one input
// element of that wgmma kernel's run (not the mma.sync reference's), as a misread operand would.
void guard_plant_fault(const char* kernel, __nv_bfloat16* input, cudaStream_t s) {
    if constexpr (kEmulated) {
        const char* planted = std::getenv("TRAIN_GPT_PLANT_WGMMA_FAULT");
        if (!planted || std::strcmp(planted, kernel) != 0) return;
        const __nv_bfloat16 wrong = __float2bfloat16(3.0f);
        CUDA_CHECK(cudaMemcpyAsync(input, &wrong, sizeof(wrong), cudaMemcpyHostToDevice, s));
        CUDA_CHECK(cudaStreamSynchronize(s));
    }
}

// Attention, forward and deterministic backward, on the model's layout at its smallest: D = 128,
// paired heads (H = 4 heads of T = 96 tokens: a view of 2 heads over 192 rows), 3 documents of random
// lengths and a 48-row sliding window.
GuardResult attention_guard(std::mt19937_64& rng, cudaStream_t s) {
    constexpr int T = 96, H = 4, D = 128, window = 48;
    constexpr float scale = 0.12f;
    constexpr size_t n = size_t(T) * H * D;
    std::uniform_int_distribution<int> cut(1, T - 1);
    int a = cut(rng), b = cut(rng);
    if (a == b) b = a == 1 ? 2 : a - 1;
    const std::vector<int> cu_host = {0, std::min(a, b), std::max(a, b), T};
    const GuardBuffer<int> cu(cu_host, s);
    const GuardBuffer<__nv_bfloat16> q(guard_normal_bf16(rng, n), s), k(guard_normal_bf16(rng, n), s),
        v(guard_normal_bf16(rng, n), s), dout(guard_normal_bf16(rng, n), s);
    const size_t ws_bytes = attention_backward_workspace_bytes(T, H, D, AttentionBackwardMode::deterministic);
    GuardBuffer<char> ws(ws_bytes);
    struct Outputs {
        GuardBuffer<__nv_bfloat16> out{n}, dq{n}, dk{n}, dv{n};
        GuardBuffer<float> lse{size_t(T) * H};
    } mma, wgmma;
    auto run = [&](Outputs& o, AttentionKernel kernel) {
        attention_forward(o.out.ptr, o.lse.ptr, q.ptr, k.ptr, v.ptr, cu.ptr, 4, T, H, D, window, true, scale, s,
                          cu_host.data(), kernel);
        attention_backward(o.dq.ptr, o.dk.ptr, o.dv.ptr, dout.ptr, o.out.ptr, o.lse.ptr, q.ptr, k.ptr, v.ptr, cu.ptr,
                           4, T, H, D, window, true, scale, ws.ptr, ws_bytes, s,
                           AttentionBackwardMode::deterministic, cu_host.data(), kernel);
        CUDA_CHECK_LAUNCH();
    };
    run(mma, AttentionKernel::mma);
    guard_plant_fault("attention", q.ptr, s);
    run(wgmma, AttentionKernel::wgmma);
    return guard_result({guard_diff("out", wgmma.out, mma.out, s), guard_diff("lse", wgmma.lse, mma.lse, s),
                         guard_diff("dq", wgmma.dq, mma.dq, s), guard_diff("dk", wgmma.dk, mma.dk, s),
                         guard_diff("dv", wgmma.dv, mma.dv, s)});
}

// The MLP's fused c_fc GEMMs, forward (pre, post) and backward (dpre), on ragged shapes: T, H and C
// not multiples of the 128 x 256 tiles or the 64-wide k-steps, so every edge of TMA's boxes is read.
GuardResult mlp_guard(std::mt19937_64& rng, cudaStream_t s) {
    const int T = 200, C = 136, H = 264;
    const GuardBuffer<__nv_bfloat16> x(guard_normal_bf16(rng, size_t(T) * C), s),
        w(guard_normal_bf16(rng, size_t(H) * C), s), g(guard_normal_bf16(rng, size_t(T) * C), s);
    struct Outputs {
        GuardBuffer<__nv_bfloat16> pre, post, dpre;
    };
    const size_t th = size_t(T) * H;
    Outputs mma{GuardBuffer<__nv_bfloat16>(th), GuardBuffer<__nv_bfloat16>(th), GuardBuffer<__nv_bfloat16>(th)};
    Outputs wgmma{GuardBuffer<__nv_bfloat16>(th), GuardBuffer<__nv_bfloat16>(th), GuardBuffer<__nv_bfloat16>(th)};
    // both backwards read the reference's pre, so they differ only by the kernel
    auto run = [&](Outputs& o, MlpKernel kernel) {
        linear_relu_square_forward(kernel, o.pre.ptr, o.post.ptr, x.ptr, w.ptr, T, C, H, s);
        linear_relu_square_backward(kernel, o.dpre.ptr, g.ptr, w.ptr, mma.pre.ptr, T, C, H, s);
    };
    run(mma, MlpKernel::mma);
    guard_plant_fault("mlp", x.ptr, s);
    guard_plant_fault("mlp", g.ptr, s);
    run(wgmma, MlpKernel::wgmma);
    return guard_result({guard_diff("pre", wgmma.pre, mma.pre, s), guard_diff("post", wgmma.post, mma.post, s),
                         guard_diff("dpre", wgmma.dpre, mma.dpre, s)});
}

// One kernel family's verdict: "" when it agrees, else what stops the run.
std::string guard_error(const char* what, const char* fallback, const GuardResult& r, uint64_t seed) {
    if (r.agree) return "";
    char text[512];
    std::snprintf(text, sizeof text,
                  "the wgmma %s disagree with the mma.sync kernels on a random problem (seed %llu): %s's worst "
                  "error %.3g of |value| + rms, %s; the Hopper kernels may misread their operands on this "
                  "platform; nothing was trained: run with %s",
                  what, static_cast<unsigned long long>(seed), r.worst.tensor.c_str(), r.worst.worst,
                  kEmulated ? "the CPU build requires the same bits" : "tolerance 2^-5", fallback);
    return text;
}

// The guard: "" when every kernel selected as wgmma agrees with its mma.sync twin, else the message.
// `seconds` (optional) gets the time it took.
std::string wgmma_guard_error(const HopperKernels& k, cudaStream_t s, double* seconds = nullptr) {
    const auto t0 = std::chrono::steady_clock::now();
    const uint64_t seed = std::random_device{}();
    std::mt19937_64 rng(seed);
    std::string e;
    if (k.attention == AttentionKernel::wgmma)
        e = guard_error("attention kernels (forward and backward)", "--attention mma", attention_guard(rng, s), seed);
    if (e.empty() && k.mlp == MlpKernel::wgmma)
        e = guard_error("MLP kernels (c_fc forward and dpre backward)", "--mlp-kernel mma", mlp_guard(rng, s), seed);
    if (seconds) *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return e;
}

// ---- --check-platform ----
// x[i] = sin(0.01*i + offset): distinct, known data on every rank.
__global__ void fill_sine_pattern(__nv_bfloat16* x, int n, float offset) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = __float2bfloat16(sinf(0.01f * i + offset));
}

// On every rank: a kernel, a cuBLASLt matmul and an NCCL all-reduce, compared with the host; then
// the wgmma guard for the kernels the flags select.
int platform_check(int rank, int world, ncclComm_t comm, cudaStream_t stream, const HopperKernels& kernels) {
    const int M = 64, N = 48, K = 96;
    __nv_bfloat16 *a, *b;
    float* out;
    CUDA_CHECK(cudaMalloc(&a, M * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&b, N * K * sizeof(__nv_bfloat16)));
    CUDA_CHECK(cudaMalloc(&out, M * N * sizeof(float)));
    launch(fill_sine_pattern, dim3(ceil_div(M * K, 256)), dim3(256), 0, stream, a, M * K, float(rank));
    launch(fill_sine_pattern, dim3(ceil_div(N * K, 256)), dim3(256), 0, stream, b, N * K, float(1000 + rank));
    CUDA_CHECK_LAUNCH();
    CublasLt lt;
    matmul_forward(lt, out, a, b, M, N, K, stream);
    NCCL_CHECK(ncclAllReduce(out, out, M * N, ncclFloat32, ncclSum, comm, stream));
    std::vector<float> got(M * N);
    CUDA_CHECK(cudaMemcpyAsync(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto bf16_round = [](float v) { return __bfloat162float(__float2bfloat16(v)); };
    double worst = 0;
    for (int i = 0; i < M; ++i)
        for (int j = 0; j < N; ++j) {
            double want = 0;
            for (int r = 0; r < world; ++r)
                for (int k = 0; k < K; ++k)
                    want += double(bf16_round(std::sin(0.01f * (i * K + k) + float(r)))) *
                            bf16_round(std::sin(0.01f * (j * K + k) + float(1000 + r)));
            worst = std::max(worst, std::fabs(got[i * N + j] - want) / (1.0 + std::fabs(want)));
        }
    const double worst_all = host_max(worst);
    const bool ok = worst_all < 1e-4;  // fp32 accumulation of K products, summed over ranks
    if (rank == 0)
        std::printf("platform check %s: kernel, cuBLASLt matmul and NCCL all-reduce on %d rank(s) "
                    "(max relative error %.2e)\n", ok ? "passed" : "FAILED", world, worst_all);
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaFree(out));
    double seconds = 0;
    const std::string guard = wgmma_guard_error(kernels, stream, &seconds);
    if (!guard.empty()) std::fprintf(stderr, "train_gpt: rank %d: %s\n", rank, guard.c_str());
    const int failed_ranks = host_sum(int(!guard.empty()));
    if (rank == 0)
        std::printf("wgmma guard %s: the kernels selected as wgmma (attention: %s, MLP: %s) against mma.sync on %d "
                    "rank(s) (%.2f s on rank 0)\n",
                    failed_ranks ? "FAILED" : "passed", attention_kernel_name(kernels.attention),
                    mlp_kernel_name(kernels.mlp), world, seconds);
    return ok && !failed_ranks ? 0 : 1;
}
