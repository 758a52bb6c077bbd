// kernels/common.cuh: warp and block reductions and the 128-bit vector helpers, against
// double-precision host loops on fresh random data.
#include "../../kernels/common.cuh"
#include "../../kernels/residual.cuh"  // the benchmark's partial-sum shapes
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <vector>

__global__ void warp_sums_and_maxes(float* out, const float* x) {  // one value per thread, one result pair per warp
    const float v = x[blockIdx.x * blockDim.x + threadIdx.x];
    const float s = warp_reduce_sum(v), m = warp_reduce_max(v);
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    // every lane holds the result: lane 31 reports it, so a lane-0-only result would fail
    if (threadIdx.x % 32 == 31) {
        out[2 * warp] = s;
        out[2 * warp + 1] = m;
    }
}

__global__ void block_max_then_sum(float* out, const float* x, int n) {  // one block per row of n
    float m = -INFINITY, s = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        m = fmaxf(m, x[blockIdx.x * n + i]);
        s += x[blockIdx.x * n + i];
    }
    m = block_reduce_max(m);
    s = block_reduce_sum(s);
    if (threadIdx.x == blockDim.x - 1) {
        out[2 * blockIdx.x] = m;
        out[2 * blockIdx.x + 1] = s;
    }
}

// y = 2x + 1 on 16-byte packs, streaming and plain forms on alternate packs.
template <class T>
__global__ void affine_by_packs(T* y, const T* x, int n) {
    using P = Pack128<T>;
    const int i = (blockIdx.x * blockDim.x + threadIdx.x) * P::size;
    if (i >= n) return;
    const bool streaming = (i / P::size) % 2;
    const P in = streaming ? load128cs(x + i) : load128(x + i);
    P out;
    for (int k = 0; k < P::size; ++k) out[k] = static_cast<T>(2.0f * static_cast<float>(in[k]) + 1.0f);
    if (streaming) store128cs(y + i, out);
    else store128(y + i, out);
}

template <class T>
void check_packs(const char* name) {
    const int n = 64 * Pack128<T>::size * 5;
    std::vector<T> x(n);
    std::vector<double> want(n);
    for (int i = 0; i < n; ++i) {
        x[i] = static_cast<T>(static_cast<float>(test::uniform(-4, 4)));
        // the kernel rounds 2x+1 (computed in fp32) to T once
        want[i] = static_cast<float>(static_cast<T>(2.0f * static_cast<float>(x[i]) + 1.0f));
    }
    test::DeviceBuffer<T> dx(x), dy(n);
    launch(affine_by_packs<T>, dim3(ceil_div(n / Pack128<T>::size, 64)), dim3(64), 0, nullptr, dy.ptr, dx.ptr, n);
    CUDA_CHECK_LAUNCH();
    test::check_close(std::string("Pack128 load/store, ") + name, test::values(dy.download()), want, 0, 0);
}

// ---- benchmark: the second pass of the residual backwards' parameter gradients, and the loss sum ----
int bench_common(const bench::Options& o) {
    bench::Bench b(o);
    const int T = b.preset().T(), C = b.preset().C;
    // the gated skip's backward: 12 bf16 skip_gate gradients and the fp32 skip lambda's, one partial per block
    constexpr int kValues = kResidualMaxPartials;
    const int blocks = residual_backward_blocks(T);
    test::DeviceBuffer<float> partials(test::uniform_vector(size_t(blocks) * kValues, -1, 1)), lambda(1),
        rows(test::uniform_vector(size_t(T), 0, 10)), loss(1);
    test::DeviceBuffer<__nv_bfloat16> gate(kSkipGateWidth);
    b.run("sum_block_partials", bench::fmt("%d values x %d blocks (T=%d C=%d)", kValues, blocks, T, C),
          [&](cudaStream_t s) {
              sum_block_partials(SumTargets().add(gate.ptr, kSkipGateWidth).add(lambda.ptr), partials.ptr, blocks,
                                 kValues, true, s);
          });
    b.run("sum_fixed_order", bench::fmt("n=%d (a loss over T rows)", T),
          [&](cudaStream_t s) { sum_fixed_order(loss.ptr, rows.ptr, T, 1.0f, false, s); });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_common(*o);
    test::seed();
    test::check(ceil_div(10, 3) == 4 && ceil_div(9, 3) == 3 && ceil_div<size_t>(1, 128) == 1, "ceil_div");
    static_assert(Pack128<float>::size == 4 && Pack128<__nv_bfloat16>::size == 8 && sizeof(Pack128<__nv_bfloat16>) == 16);

    const int warps = 12;
    auto x = test::uniform_vector(warps * 32, -10, 10);
    test::DeviceBuffer<float> dx(x), dout(2 * warps);
    launch(warp_sums_and_maxes, dim3(3), dim3(128), 0, nullptr, dout.ptr, dx.ptr);
    const std::vector<float> out = dout.download();
    std::vector<double> want(2 * warps);
    for (int w = 0; w < warps; ++w) {
        double s = 0, m = -1e30;
        for (int l = 0; l < 32; ++l) {
            s += x[w * 32 + l];
            m = std::max(m, double(x[w * 32 + l]));
        }
        want[2 * w] = s;
        want[2 * w + 1] = m;
    }
    test::check_close("warp_reduce_sum/max", out, want, 1e-4, 1e-6);

    for (int threads : {64, 256, 1024}) {
        const int rows = 6, n = 3000;
        auto m = test::uniform_vector(rows * n, -3, 3);
        test::DeviceBuffer<float> dm(m), dmo(2 * rows);
        launch(block_max_then_sum, dim3(rows), dim3(threads), 0, nullptr, dmo.ptr, dm.ptr, n);
        const std::vector<float> got = dmo.download();
        std::vector<double> w(2 * rows);
        for (int r = 0; r < rows; ++r) {
            double s = 0, mx = -1e30;
            for (int i = 0; i < n; ++i) {
                s += m[r * n + i];
                mx = std::max(mx, double(m[r * n + i]));
            }
            w[2 * r] = mx;
            w[2 * r + 1] = s;
        }
        test::check_close("block_reduce_max then block_reduce_sum, " + std::to_string(threads) + " threads", got, w, 1e-3, 1e-5);
    }
    check_packs<float>("float");
    check_packs<__nv_bfloat16>("bf16");
    return test::finish();
}
