// kernels/common.cuh: warp and block reductions and the 128-bit vector helpers, against
// double-precision host loops on fresh random data; the fused last-block sums against the second
// launch they replace (the same bits).
#include "../../kernels/common.cuh"
#include "../../kernels/residual.cuh"  // the benchmark's partial-sum shapes
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
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

// block_sum_as as a block of blockDim.x threads plays a `threads`-thread summing block.
__global__ void sum_as(float* out, const float* x, int n, int stride, int threads) {
    const float s = block_sum_as(x, n, stride, threads);
    if (threadIdx.x == blockDim.x - 1) *out = s;  // every thread holds it: the last reports
}
// Each block copies its nv values of x as its partials (`stride` apart); the last block to finish sums them.
__global__ void copy_then_last_block_sum(LastBlockSum sum, const float* x, int nv, int stride) {
    for (int v = threadIdx.x; v < nv; v += blockDim.x)
        sum.scratch.partials[blockIdx.x * stride + v] = x[blockIdx.x * nv + v];
    last_block_sum(sum, stride);
}
// Which block drew the last ticket, and what it saw: the sum of every block's partial.
__global__ void last_block_probe(float* partials, unsigned int* done, float* sum, int* last) {
    if (threadIdx.x == 0) partials[blockIdx.x] = static_cast<float>(blockIdx.x + 1);
    if (!last_block_done(done)) return;
    const float s = block_sum_as(partials, gridDim.x, 1, sum_threads(gridDim.x, kSumPartialsThreads));
    if (threadIdx.x == 0) *sum = s, *last = blockIdx.x;
}

// Values of magnitudes 1e-3 .. 1e3: the summation order shows in the bits.
std::vector<float> wide_values(size_t n) {
    std::vector<float> x(n);
    for (float& v : x) v = static_cast<float>(test::uniform(-1, 1) * std::pow(10.0, test::uniform(-3, 3)));
    return x;
}

// block_sum_as, by blocks of 32 to 1024 threads, against block_sum_fixed_order by the block it plays
// (sum_block_partials_kernel, one value): the same bits; and a wrong `threads` gives other bits.
void check_block_sum_as() {
    int order_shows = 0, cases = 0;
    for (int n : {1, 7, 33, 300, 1000, 3000})
        for (int stride : {1, 13})
            for (int most : {kSumPartialsThreads, kSumFixedOrderThreads}) {
                const int threads = sum_threads(n, most);
                const auto x = wide_values(size_t(n) * stride);
                test::DeviceBuffer<float> dx(x), want(1), got(1);
                launch(sum_block_partials_kernel, dim3(1), dim3(threads), 0, nullptr, SumTargets().add(want.ptr),
                       static_cast<const float*>(dx.ptr), n, stride, 1.0f, false);
                CUDA_CHECK_LAUNCH();
                const float w = want.download()[0];
                double exact = 0;
                for (int i = 0; i < n; ++i) exact += x[size_t(i) * stride];
                for (int block : {32, 128, 256, 1024}) {
                    launch(sum_as, dim3(1), dim3(block), 0, nullptr, got.ptr, static_cast<const float*>(dx.ptr), n,
                           stride, threads);
                    CUDA_CHECK_LAUNCH();
                    const float g = got.download()[0];
                    test::check(test::bits(g) == test::bits(w),
                                "block_sum_as n=%d stride=%d as %d threads by %d: %.9g, the summing block's %.9g", n,
                                stride, threads, block, g, w);
                    test::check(std::fabs(g - exact) <= 1e-5 * n * 1e3, "block_sum_as n=%d: %.9g, exact %.9g", n, g,
                                exact);
                }
                if (threads >= 64) {  // another order: the test would see a wrong emulation
                    launch(sum_as, dim3(1), dim3(256), 0, nullptr, got.ptr, static_cast<const float*>(dx.ptr), n,
                           stride, threads / 2);
                    CUDA_CHECK_LAUNCH();
                    ++cases;
                    order_shows += test::bits(got.download()[0]) != test::bits(w);
                }
            }
    // each case shows a different order in the bits about half the time (8 of 16 seen): any one
    // proves the bit checks above can fail; a fixed majority would make the test flaky
    test::check(order_shows >= 2, "the order shows in the bits in %d of %d cases", order_shows, cases);
}

// last_block_sum against sum_block_partials over the same partials: the same bits, into bf16, fp32 and
// bf16-rounded fp32 targets, overwriting and accumulating; the counter is back at zero after each launch. The
// cases take every team width of block_sums_as (4 to 32 lanes a value: values against the producer's threads),
// one to several rounds of values and of summing lanes (blocks past 128), odd block counts and partials with
// gaps between blocks' rows (stride > nv).
void check_last_block_sum() {
    struct Case {
        int blocks, nv, threads, gap;
    };
    const Case cases[] = {{1, 1, 32, 0},     {5, 14, 64, 0},    {37, 3, 128, 2},  {128, 144, 128, 0},
                          {129, 72, 128, 5}, {300, 14, 256, 0}, {1024, 2, 64, 0}, {127, 300, 256, 1},
                          {33, 40, 32, 0},   {7, 144, 32, 3},   {256, 13, 256, 0}, {97, 9, 64, 0},
                          {200, 33, 128, 0}, {64, 5, 32, 0}};
    for (const Case& c : cases)
        for (bool acc : {false, true}) {
            const int nv = c.nv, stride = nv + c.gap, n_f32 = nv / 4, n_rounded = nv / 5, n_bf16 = nv - n_f32 - n_rounded;
            const auto x = wide_values(size_t(c.blocks) * nv);
            const auto old_h = test::normal_bf16(n_bf16);
            const auto old_f = test::uniform_vector(n_f32 + n_rounded, -1, 1);
            std::vector<float> strided(size_t(c.blocks) * stride, 0.0f);  // the layout the summing launch reads
            for (int b = 0; b < c.blocks; ++b)
                for (int v = 0; v < nv; ++v) strided[size_t(b) * stride + v] = x[size_t(b) * nv + v];
            test::DeviceBuffer<float> dx(x), want_partials(strided), partials(strided.size()), f(old_f), f_want(old_f);
            test::DeviceBuffer<__nv_bfloat16> h(old_h), h_want(old_h);
            test::DeviceBuffer<unsigned int> done(1);
            const auto targets = [&](__nv_bfloat16* hp, float* fp) {
                return SumTargets().add(hp, n_bf16).add(fp, n_f32).add_bf16_rounded(fp + n_f32, n_rounded);
            };
            const LastBlockSum sum{targets(h.ptr, f.ptr), {partials.ptr, done.ptr}, acc};
            launch(copy_then_last_block_sum, dim3(c.blocks), dim3(c.threads), 0, nullptr, sum,
                   static_cast<const float*>(dx.ptr), nv, stride);
            CUDA_CHECK_LAUNCH();
            sum_block_partials(targets(h_want.ptr, f_want.ptr), want_partials.ptr, c.blocks, stride, acc, nullptr);
            test::check(test::same_bits(h.download(), h_want.download()) &&
                            test::same_bits(f.download(), f_want.download()),
                        "last_block_sum of %d values over %d blocks of %d threads (stride %d)%s: sum_block_partials' "
                        "bits", nv, c.blocks, c.threads, stride, acc ? ", accumulating" : "");
            test::check(done.download()[0] == 0, "last_block_sum over %d blocks leaves the counter at zero", c.blocks);
        }
}

// Every launch's last block sees all the partials and resets the counter; under EMU_RANDOM_ORDER (blocks
// run in a shuffled order) the last ticket goes to different blocks.
void check_last_block_done() {
    const int blocks = 37, launches = 40;
    test::DeviceBuffer<float> partials(blocks), sum(1);
    test::DeviceBuffer<unsigned int> done(1);
    test::DeviceBuffer<int> last(1);
    std::vector<bool> seen(blocks, false);
    int distinct = 0;
    for (int i = 0; i < launches; ++i) {
        launch(last_block_probe, dim3(blocks), dim3(64), 0, nullptr, partials.ptr, done.ptr, sum.ptr, last.ptr);
        CUDA_CHECK_LAUNCH();
        const int l = last.download()[0];
        test::check(sum.download()[0] == blocks * (blocks + 1) / 2 && done.download()[0] == 0 && l >= 0 && l < blocks,
                    "launch %d: the last block (%d) saw every partial and reset the counter", i, l);
        if (l >= 0 && l < blocks && !seen[l]) seen[l] = true, ++distinct;
    }
    const char* random = std::getenv("EMU_RANDOM_ORDER");
    if (random && std::atoi(random) != 0)
        test::check(distinct > 1, "EMU_RANDOM_ORDER: %d launches, %d different last blocks", launches, distinct);
    std::printf("last_block_done: %d launches, %d different last blocks\n", launches, distinct);
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
    test::DeviceBuffer<__nv_bfloat16> gate(kGateWidth);
    b.run("sum_block_partials", bench::fmt("%d values x %d blocks (T=%d C=%d)", kValues, blocks, T, C),
          [&](cudaStream_t s) {
              sum_block_partials(SumTargets().add(gate.ptr, kGateWidth).add(lambda.ptr), partials.ptr, blocks,
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
    check_block_sum_as();
    check_last_block_sum();
    check_last_block_done();
    return test::finish();
}
