// emu's kernel execution: thread indexing, shared memory, barriers, every warp collective,
// atomics, launch checks, deadlock detection, stacks reused after threads exit, bf16 rounding.
// Each expectation is computed on the host from CUDA's documented semantics, independently of
// emu's code.
#include "../../kernels/common.cuh"
#include "../device_util.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

using test::DeviceBuffer;

// ---- indexing ----
__global__ void write_coordinates(int* out) {
    const int tx = threadIdx.x, ty = threadIdx.y, tz = threadIdx.z;
    const int block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int thread = tx + blockDim.x * (ty + blockDim.y * tz);
    const int threads = blockDim.x * blockDim.y * blockDim.z;
    int* o = out + 4 * (block * threads + thread);
    o[0] = tx + 100 * ty + 10000 * tz;
    o[1] = blockIdx.x + 100 * blockIdx.y + 10000 * blockIdx.z;
    o[2] = blockDim.x + 100 * blockDim.y + 10000 * blockDim.z;
    o[3] = gridDim.x + 100 * gridDim.y + 10000 * gridDim.z;
}

void test_indexing() {
    const dim3 grid(3, 2, 2), block(5, 4, 3);
    const int blocks = 12, threads = 60;
    DeviceBuffer<int> out(4 * blocks * threads);
    launch(write_coordinates, grid, block, 0, nullptr, out.ptr);
    CUDA_CHECK_LAUNCH();
    auto h = out.download();
    int bad = 0;
    for (int bz = 0; bz < 2; ++bz)
        for (int by = 0; by < 2; ++by)
            for (int bx = 0; bx < 3; ++bx)
                for (int tz = 0; tz < 3; ++tz)
                    for (int ty = 0; ty < 4; ++ty)
                        for (int tx = 0; tx < 5; ++tx) {
                            const int* o = &h[4 * (((bz * 2 + by) * 3 + bx) * threads + (tz * 4 + ty) * 5 + tx)];
                            bad += o[0] != tx + 100 * ty + 10000 * tz || o[1] != bx + 100 * by + 10000 * bz ||
                                   o[2] != 5 + 400 + 30000 || o[3] != 3 + 200 + 20000;
                        }
    test::check(bad == 0, "indexing: %d threads saw wrong coordinates", bad);
}

// ---- elementwise and reductions ----
__global__ void axpy(float* y, const float* x, float a, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) y[i] = a * x[i] + y[i];
}

__global__ void row_sums(float* out, const float* x, int cols) {  // one block per row
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += x[blockIdx.x * cols + c];
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

__global__ void row_max_and_sum(float* out, const float* x, int cols) {  // two reductions in a row reuse scratch
    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        m = fmaxf(m, x[blockIdx.x * cols + c]);
        s += x[blockIdx.x * cols + c];
    }
    m = block_reduce_max(m);
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) {
        out[2 * blockIdx.x] = m;
        out[2 * blockIdx.x + 1] = s;
    }
}

void test_elementwise_and_reductions() {
    const int n = 10007;
    auto x = test::uniform_vector(n, -1, 1), y = test::uniform_vector(n, -1, 1);
    DeviceBuffer<float> dx(x), dy(y);
    launch(axpy, dim3(7), dim3(96), 0, nullptr, dy.ptr, dx.ptr, 0.5f, n);
    std::vector<double> want(n);
    for (int i = 0; i < n; ++i) want[i] = 0.5 * x[i] + y[i];
    test::check_close("axpy", dy.download(), want, 1e-6, 1e-6);

    for (int threads : {32, 128, 1024}) {
        const int rows = 9, cols = 777;
        auto m = test::uniform_vector(rows * cols, -1, 1);
        DeviceBuffer<float> dm(m), out(rows), out2(2 * rows);
        launch(row_sums, dim3(rows), dim3(threads), 0, nullptr, out.ptr, dm.ptr, cols);
        launch(row_max_and_sum, dim3(rows), dim3(threads), 0, nullptr, out2.ptr, dm.ptr, cols);
        std::vector<double> sums(rows), pairs(2 * rows);
        for (int r = 0; r < rows; ++r) {
            double s = 0, mx = -1e30;
            for (int c = 0; c < cols; ++c) {
                s += m[r * cols + c];
                mx = std::max(mx, double(m[r * cols + c]));
            }
            sums[r] = s;
            pairs[2 * r] = mx;
            pairs[2 * r + 1] = s;
        }
        test::check_close("block_reduce_sum, " + std::to_string(threads) + " threads", out.download(), sums, 1e-4, 1e-5);
        test::check_close("block_reduce_max then sum", out2.download(), pairs, 1e-4, 1e-5);
    }
}

// ---- shuffles ----
enum ShflKind { kIdx, kUp, kDown, kXor };

// Each lane shuffles (lane, value) pairs; args[lane] is its srcLane/delta/laneMask.
template <class T>
__global__ void shuffle_kernel(T* out, const T* in, const int* args, int kind, int width, unsigned mask) {
    const int lane = threadIdx.x % 32;
    if (!((mask >> lane) & 1u)) return;
    const T v = in[threadIdx.x];
    const int a = args[threadIdx.x];
    T r;
    if (kind == kIdx) r = __shfl_sync(mask, v, a, width);
    else if (kind == kUp) r = __shfl_up_sync(mask, v, a, width);
    else if (kind == kDown) r = __shfl_down_sync(mask, v, a, width);
    else r = __shfl_xor_sync(mask, v, a, width);
    out[threadIdx.x] = r;
}

// Source lane for `lane` from the programming guide's definitions, written segment-wise.
int expected_source(int kind, int lane, int arg, int width) {
    const int base = lane - lane % width, pos = lane % width;
    switch (kind) {
        case kIdx: return base + ((arg % width) + width) % width;
        case kUp: return pos - arg >= 0 ? lane - arg : lane;
        case kDown: return pos + arg <= width - 1 ? lane + arg : lane;
        default: {
            const int src = lane ^ arg;
            return src < base + width ? src : lane;  // earlier segments are readable, later ones are not
        }
    }
}

template <class T>
void check_shuffles(const char* type) {
    const int threads = 64;
    int bad = 0, cases = 0;
    for (int kind = kIdx; kind <= kXor; ++kind)
        for (int width : {2, 4, 8, 16, 32}) {
            const unsigned mask = 0xffffffffu;
            std::vector<T> in(threads);
            std::vector<int> args(threads);
            for (int i = 0; i < threads; ++i) {
                in[i] = static_cast<T>(test::randint(-1000000, 1000000));
                // per-lane arguments may differ for idx; delta and laneMask are warp-uniform in practice
                args[i] = kind == kIdx ? test::randint(0, 63) : 0;
            }
            const int uniform = kind == kXor ? test::randint(1, 31) : test::randint(1, width);
            for (int i = 0; i < threads; ++i)
                if (kind != kIdx) args[i] = uniform;
            DeviceBuffer<T> din(in), dout(threads);
            DeviceBuffer<int> dargs(args);
            launch(shuffle_kernel<T>, dim3(1), dim3(threads), 0, nullptr, dout.ptr, din.ptr, dargs.ptr, kind, width, mask);
            auto out = dout.download();
            for (int i = 0; i < threads; ++i) {
                const int lane = i % 32, warp = i / 32;
                const T want = in[warp * 32 + expected_source(kind, lane, args[i], width)];
                bad += !(out[i] == want);
                ++cases;
            }
        }
    test::check(bad == 0, "shuffles of %s: %d of %d lanes got the wrong value", type, bad, cases);
}

// Two half-warps shuffle independently with disjoint masks.
__global__ void half_warp_shuffles(int* out) {
    const int lane = threadIdx.x % 32;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    int v = lane * 3;
    v += __shfl_down_sync(mask, v, 1, 16);
    out[threadIdx.x] = __shfl_sync(mask, v, lane < 16 ? 5 : 21);
}

void test_shuffles() {
    check_shuffles<int>("int");
    check_shuffles<float>("float");
    check_shuffles<double>("double");
    check_shuffles<unsigned long long>("unsigned long long");
    DeviceBuffer<int> out(32);
    launch(half_warp_shuffles, dim3(1), dim3(32), 0, nullptr, out.ptr);
    auto h = out.download();
    // lane 5 holds 15 + 18, lane 21 holds 63 + 66
    int bad = 0;
    for (int l = 0; l < 32; ++l) bad += h[l] != (l < 16 ? 33 : 129);
    test::check(bad == 0, "half-warp shuffles with disjoint masks: %d lanes wrong", bad);
}

// ---- butterflies: one meeting of the warp, the same bits as a __shfl_xor_sync per round ----
template <class Op, int First>
__global__ void butterfly_pair(float* fused, float* rounds, const float* in) {
    const float v = in[threadIdx.x];
    fused[threadIdx.x] = warp_butterfly<Op, First>(v);
    float r = v;
    for (int offset = First; offset > 0; offset >>= 1) r = Op::apply(r, __shfl_xor_sync(0xffffffffu, r, offset));
    rounds[threadIdx.x] = r;
}

template <class Op, int First>
void check_butterfly(const char* op, int threads, bool specials) {
    std::vector<float> in = test::uniform_vector(size_t(threads), -1e3, 1e3);
    if (specials)
        for (int i = 0; i < threads; i += 7) in[size_t(i)] = i % 3 == 0 ? INFINITY : i % 3 == 1 ? -INFINITY : NAN;
    DeviceBuffer<float> din(in), fused(threads), rounds(threads);
    launch(butterfly_pair<Op, First>, dim3(1), dim3(threads), 0, nullptr, fused.ptr, rounds.ptr, din.ptr);
    CUDA_CHECK_LAUNCH();
    const auto a = fused.download(), b = rounds.download();
    int bad = 0;
    for (int i = 0; i < threads; ++i)  // NaN payloads depend on the compiler's operand order (a GPU has one NaN)
        bad += std::memcmp(&a[size_t(i)], &b[size_t(i)], sizeof(float)) != 0 && !(std::isnan(a[size_t(i)]) && std::isnan(b[size_t(i)]));
    // independently: a full aligned group of 2 * First lanes ends with the group's sum or max
    double worst = 0;
    for (int g = 0; !specials && g + 2 * First <= threads && (g + 2 * First - 1) / 32 == g / 32; g += 2 * First) {
        double want = std::is_same_v<Op, WarpSum> ? 0.0 : -INFINITY;
        for (int i = g; i < g + 2 * First; ++i) want = std::is_same_v<Op, WarpSum> ? want + in[size_t(i)] : std::max(want, double(in[size_t(i)]));
        for (int i = g; i < g + 2 * First; ++i) worst = std::max(worst, std::fabs(a[size_t(i)] - want));
    }
    test::check(bad == 0 && worst <= 1e-2, "warp_butterfly %s from offset %d, %d threads%s: %d lanes differ from the shuffle rounds, "
                "worst error %g", op, First, threads, specials ? " with inf and NaN" : "", bad, worst);
}

__global__ void butterflies_disagree(float* out) {
    out[threadIdx.x] = threadIdx.x < 8 ? warp_butterfly<WarpSum, 4>(1.0f) : warp_butterfly<WarpSum, 8>(1.0f);
}

void test_butterflies() {
    for (bool specials : {false, true})
        for (int threads : {64, 48}) {  // 48: the second warp is partial, its missing lanes read all ones
            check_butterfly<WarpSum, 16>("sum", threads, specials);
            check_butterfly<WarpSum, 8>("sum", threads, specials);
            check_butterfly<WarpSum, 2>("sum", threads, specials);
            check_butterfly<WarpSum, 1>("sum", threads, specials);
            check_butterfly<WarpMax, 16>("max", threads, specials);
            check_butterfly<WarpMax, 4>("max", threads, specials);
        }
    cudaError_t e;
    std::string msg;
    {
        DeviceBuffer<float> out(32);  // freed before the reset below
        launch(butterflies_disagree, dim3(1), dim3(32), 0, nullptr, out.ptr);
        cudaDeviceSynchronize();  // the failure is known once the kernel has run
        e = cudaGetLastError();
        msg = emu::last_kernel_error();
    }
    test::check(e == cudaErrorLaunchFailure && msg.find("divergent") != std::string::npos &&
                    msg.find("warp_butterfly(8)") != std::string::npos,
                "lanes at butterflies of different widths fail as a divergent warp: %s", msg.c_str());
    CUDA_CHECK(cudaDeviceReset());
}

// ---- votes ----
__global__ void votes(unsigned* out, const int* pred) {
    const int p = pred[threadIdx.x];
    const unsigned b = __ballot_sync(0xffffffffu, p);
    const int any = __any_sync(0xffffffffu, p), all = __all_sync(0xffffffffu, p);
    const unsigned half = threadIdx.x % 32 < 8 ? __ballot_sync(0x000000ffu, p) : 0u;
    out[4 * threadIdx.x] = b;
    out[4 * threadIdx.x + 1] = any;
    out[4 * threadIdx.x + 2] = all;
    out[4 * threadIdx.x + 3] = half;
}

void test_votes() {
    const int threads = 80;  // the last warp is partial: 16 lanes
    for (int trial = 0; trial < 4; ++trial) {
        std::vector<int> pred(threads);
        for (auto& p : pred) p = trial == 0 ? 1 : (trial == 1 ? 0 : test::randint(0, 1) * test::randint(1, 9));
        DeviceBuffer<int> dp(pred);
        DeviceBuffer<unsigned> out(4 * threads);
        launch(votes, dim3(1), dim3(threads), 0, nullptr, out.ptr, dp.ptr);
        auto h = out.download();
        int bad = 0;
        for (int i = 0; i < threads; ++i) {
            const int w = i / 32, lanes = std::min(32, threads - 32 * w);
            unsigned b = 0, half = 0;
            for (int l = 0; l < lanes; ++l) {
                if (pred[32 * w + l]) b |= 1u << l;
                if (l < 8 && pred[32 * w + l]) half |= 1u << l;
            }
            const unsigned existing = lanes == 32 ? ~0u : (1u << lanes) - 1;
            bad += h[4 * i] != b || h[4 * i + 1] != (b != 0) || h[4 * i + 2] != (b == existing) ||
                   h[4 * i + 3] != (i % 32 < 8 ? half : 0u);
        }
        test::check(bad == 0, "votes (trial %d): %d threads wrong", trial, bad);
    }
}

// ---- shared memory ----
__global__ void reverse_in_static_smem(int* data) {
    __shared__ int tile[256];
    tile[threadIdx.x] = data[blockIdx.x * 256 + threadIdx.x];
    __syncthreads();
    data[blockIdx.x * 256 + threadIdx.x] = tile[255 - threadIdx.x];
}

__global__ void rotate_in_dynamic_smem(float* data, int n) {  // n floats per block, rotated by one
    float* buf = dynamic_smem<float>();
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = data[blockIdx.x * n + i];
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) data[blockIdx.x * n + i] = buf[(i + 1) % n];
}

void test_shared_memory() {
    std::vector<int> v(3 * 256);
    for (auto& x : v) x = test::randint(0, 1 << 30);
    DeviceBuffer<int> d(v);
    launch(reverse_in_static_smem, dim3(3), dim3(256), 0, nullptr, d.ptr);
    auto h = d.download();
    int bad = 0;
    for (int b = 0; b < 3; ++b)
        for (int i = 0; i < 256; ++i) bad += h[b * 256 + i] != v[b * 256 + 255 - i];
    test::check(bad == 0, "static shared memory: %d wrong", bad);

    const int n = 40000;  // 160 KB: more than the default 48 KB, needs the opt-in
    auto f = test::uniform_vector(2 * n, -1, 1);
    DeviceBuffer<float> df(f);
    launch(rotate_in_dynamic_smem, dim3(2), dim3(512), n * sizeof(float), nullptr, df.ptr, n);
    test::check(cudaGetLastError() == cudaErrorInvalidValue, "160 KB of dynamic smem without the opt-in must fail");
    test::check(std::string(emu::last_kernel_error()).find("cudaFuncSetAttribute") != std::string::npos,
                "the message must say how to raise the limit: %s", emu::last_kernel_error());
    CUDA_CHECK(cudaFuncSetAttribute(rotate_in_dynamic_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, n * 4));
    launch(rotate_in_dynamic_smem, dim3(2), dim3(512), n * sizeof(float), nullptr, df.ptr, n);
    CUDA_CHECK_LAUNCH();
    auto g = df.download();
    bad = 0;
    for (int b = 0; b < 2; ++b)
        for (int i = 0; i < n; ++i) bad += g[b * n + i] != f[b * n + (i + 1) % n];
    test::check(bad == 0, "dynamic shared memory: %d wrong", bad);
    test::check(cudaFuncSetAttribute(rotate_in_dynamic_smem, cudaFuncAttributeMaxDynamicSharedMemorySize, 300000) ==
                    cudaErrorInvalidValue,
                "more than 227 KB of dynamic smem cannot be enabled");
    cudaGetLastError();
    // the shared memory carveout: a percentage or cudaSharedmemCarveoutDefault, anything else refused as CUDA does
    for (const int ok : {int(cudaSharedmemCarveoutDefault), int(cudaSharedmemCarveoutMaxL1), 50,
                         int(cudaSharedmemCarveoutMaxShared)})
        CUDA_CHECK(cudaFuncSetAttribute(rotate_in_dynamic_smem, cudaFuncAttributePreferredSharedMemoryCarveout, ok));
    for (const int bad_value : {-2, 101})
        test::check(cudaFuncSetAttribute(rotate_in_dynamic_smem, cudaFuncAttributePreferredSharedMemoryCarveout,
                                         bad_value) == cudaErrorInvalidValue,
                    "a carveout of %d%% is refused", bad_value);
    cudaGetLastError();
    launch(rotate_in_dynamic_smem, dim3(2), dim3(512), n * sizeof(float), nullptr, df.ptr, n);
    CUDA_CHECK_LAUNCH();  // a refused attribute leaves no sticky error behind
}

// ---- barriers with predicates ----
__global__ void barrier_predicates(int* out, const int* pred) {
    const int p = pred[blockIdx.x * blockDim.x + threadIdx.x];
    const int count = __syncthreads_count(p), all = __syncthreads_and(p), any = __syncthreads_or(p);
    if (threadIdx.x == 7) {
        out[3 * blockIdx.x] = count;
        out[3 * blockIdx.x + 1] = all;
        out[3 * blockIdx.x + 2] = any;
    }
}

void test_barrier_predicates() {
    const int blocks = 5, threads = 200;
    std::vector<int> pred(blocks * threads);
    for (int b = 0; b < blocks; ++b)
        for (int t = 0; t < threads; ++t)
            pred[b * threads + t] = b == 0 ? 0 : (b == 1 ? 3 : test::randint(0, 1));
    DeviceBuffer<int> dp(pred), out(3 * blocks);
    launch(barrier_predicates, dim3(blocks), dim3(threads), 0, nullptr, out.ptr, dp.ptr);
    auto h = out.download();
    int bad = 0;
    for (int b = 0; b < blocks; ++b) {
        int c = 0;
        for (int t = 0; t < threads; ++t) c += pred[b * threads + t] != 0;
        bad += h[3 * b] != c || h[3 * b + 1] != (c == threads) || h[3 * b + 2] != (c > 0);
    }
    test::check(bad == 0, "__syncthreads_count/and/or: %d blocks wrong", bad);
}

// ---- atomics across blocks ----
__global__ void histogram(int* bins, unsigned* ubins, const int* keys, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        atomicAdd(&bins[keys[i]], 1);
        atomicAdd(&ubins[keys[i]], 2u);
    }
}
__global__ void float_atomics(float* sum, double* dsum, int* imax, int* imin, unsigned long long* umax, float* fmax_,
                              const float* x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        atomicAdd(sum, x[i]);
        atomicAdd(dsum, static_cast<double>(x[i]));
        atomicMax(imax, __float2int_rn(x[i] * 1000));
        atomicMin(imin, __float2int_rn(x[i] * 1000));
        atomicMax(umax, static_cast<unsigned long long>(i) * 3);
        // float max through compare-and-swap on the bits, as CUDA code does it
        int old = __float_as_int(*fmax_);
        while (__int_as_float(old) < x[i]) {
            const int seen = atomicCAS(reinterpret_cast<int*>(fmax_), old, __float_as_int(x[i]));
            if (seen == old) break;
            old = seen;
        }
    }
}
__global__ void exchange_tickets(int* slot, int* got, float* fslot) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    got[i] = atomicExch(slot, i);
    atomicExch(fslot, static_cast<float>(i));
}

void test_atomics() {
    const int n = 50000, nbins = 37;
    std::vector<int> keys(n);
    for (auto& k : keys) k = test::randint(0, nbins - 1);
    DeviceBuffer<int> dk(keys), bins(nbins);
    DeviceBuffer<unsigned> ubins(nbins);
    CUDA_CHECK(cudaMemset(bins.ptr, 0, nbins * 4));
    CUDA_CHECK(cudaMemset(ubins.ptr, 0, nbins * 4));
    launch(histogram, dim3(64), dim3(128), 0, nullptr, bins.ptr, ubins.ptr, dk.ptr, n);
    std::vector<int> want(nbins);
    for (int k : keys) ++want[k];
    auto hb = bins.download();
    auto hu = ubins.download();
    int bad = 0;
    for (int b = 0; b < nbins; ++b) bad += hb[b] != want[b] || hu[b] != 2u * want[b];
    test::check(bad == 0, "atomicAdd int/unsigned histogram from 64 blocks: %d bins wrong", bad);

    auto x = test::uniform_vector(n, -1, 1);
    DeviceBuffer<float> dx(x), sum(1), fmx(1);
    DeviceBuffer<double> dsum(1);
    DeviceBuffer<int> imax(1), imin(1);
    DeviceBuffer<unsigned long long> umax(1);
    sum.upload({0.0f});
    fmx.upload({-2.0f});
    dsum.upload({0.0});
    imax.upload({-1 << 30});
    imin.upload({1 << 30});
    umax.upload({0});
    launch(float_atomics, dim3(50), dim3(64), 0, nullptr, sum.ptr, dsum.ptr, imax.ptr, imin.ptr, umax.ptr, fmx.ptr, dx.ptr, n);
    double s = 0, mx = -2, mn = 2;
    for (float v : x) {
        s += v;
        mx = std::max(mx, double(v));
        mn = std::min(mn, double(v));
    }
    test::check(std::fabs(sum.download()[0] - s) < 1e-2, "atomicAdd float: %f vs %f", sum.download()[0], s);
    test::check(std::fabs(dsum.download()[0] - s) < 1e-9, "atomicAdd double: %f vs %f", dsum.download()[0], s);
    test::check(imax.download()[0] == int(std::nearbyint(mx * 1000)), "atomicMax int");
    test::check(imin.download()[0] == int(std::nearbyint(mn * 1000)), "atomicMin int");
    test::check(umax.download()[0] == 3ull * (n - 1), "atomicMax unsigned long long");
    test::check(fmx.download()[0] == float(mx), "atomicCAS float max: %f vs %f", fmx.download()[0], mx);

    const int threads = 64 * 32;
    DeviceBuffer<int> slot(1), got(threads);
    DeviceBuffer<float> fslot(1);
    slot.upload({-1});
    launch(exchange_tickets, dim3(64), dim3(32), 0, nullptr, slot.ptr, got.ptr, fslot.ptr);
    // Exchanges form one chain: every ticket but the last is received exactly once, plus the initial -1.
    std::vector<int> seen(threads + 1, 0);
    for (int v : got.download()) ++seen[v + 1];
    ++seen[slot.download()[0] + 1];
    bad = 0;
    for (int v : seen) bad += v != 1;
    test::check(bad == 0, "atomicExch chain: %d tickets lost or duplicated", bad);
    const float f = fslot.download()[0];
    test::check(f >= 0 && f < threads && f == std::floor(f), "atomicExch float left a written value (%f)", f);
}

// ---- launch checks, deadlocks, divergence ----
__global__ void early_exit_before_barrier(int* out) {
    if (threadIdx.x < 32) return;  // undefined behaviour on a GPU: these threads never reach the barrier
    __syncthreads();
    out[threadIdx.x] = 1;
}
__global__ void lane_exits_before_shuffle(int* out) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}
__global__ void divergent_collectives(int* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __shfl_sync(0xffffffffu, 1, 0);
    else out[threadIdx.x] = static_cast<int>(__ballot_sync(0xffffffffu, 1));
}
__global__ void big_stack_frame(float* out) {  // 16 KB of locals per thread fits the fiber stacks
    float local[4096];
    for (int i = 0; i < 4096; ++i) local[i] = static_cast<float>(i + threadIdx.x);
    float s = 0;
    for (int i = 0; i < 4096; i += 1000) s += local[i];
    out[threadIdx.x] = s;
}

void expect_kernel_failure(const char* what, const char* kernel, const char* phrase) {
    // As on a GPU, a kernel's failure is known once the host waits for it (deferred streams run it then).
    test::check(cudaDeviceSynchronize() == cudaErrorLaunchFailure, "%s: the synchronize must report the failure", what);
    const cudaError_t e = cudaGetLastError();
    const std::string msg = emu::last_kernel_error();
    test::check(e == cudaErrorLaunchFailure, "%s: expected cudaErrorLaunchFailure, got %s", what, cudaGetErrorName(e));
    test::check(msg.find(kernel) != std::string::npos && msg.find(phrase) != std::string::npos,
                "%s: message should name %s and say '%s': %s", what, kernel, phrase, msg.c_str());
    test::check(cudaDeviceSynchronize() == cudaErrorLaunchFailure, "%s: the error must be sticky", what);
    CUDA_CHECK(cudaDeviceReset());
}

void test_failures() {
    DeviceBuffer<int> out(1024);
    launch(early_exit_before_barrier, dim3(2), dim3(1025), 0, nullptr, out.ptr);
    test::check(cudaGetLastError() == cudaErrorInvalidConfiguration, "1025 threads per block must be rejected");
    launch(early_exit_before_barrier, dim3(1, 70000), dim3(32), 0, nullptr, out.ptr);
    test::check(cudaGetLastError() == cudaErrorInvalidConfiguration, "grid.y of 70000 must be rejected");

    launch(early_exit_before_barrier, dim3(3), dim3(128), 0, nullptr, out.ptr);
    expect_kernel_failure("barrier deadlock", "early_exit_before_barrier", "deadlock");
    launch(lane_exits_before_shuffle, dim3(1), dim3(32), 0, nullptr, out.ptr);
    expect_kernel_failure("warp deadlock", "lane_exits_before_shuffle", "__shfl_xor_sync");
    launch(divergent_collectives, dim3(1), dim3(32), 0, nullptr, out.ptr);
    expect_kernel_failure("divergent warp", "divergent_collectives", "divergent");

    DeviceBuffer<float> f(256);
    launch(big_stack_frame, dim3(2), dim3(256), 0, nullptr, f.ptr);
    CUDA_CHECK_LAUNCH();
    auto h = f.download();
    int bad = 0;
    for (int t = 0; t < 256; ++t) bad += h[t] != float(0 + 1000 + 2000 + 3000 + 4000 + 5 * t);
    test::check(bad == 0, "large per-thread stack frames: %d wrong", bad);
}

// ---- a thread's stack is handed on when it exits ----
// Odd threads exit at once, so the even threads after them start on the stacks they left; each even
// thread fills 8 KB of locals, waits at a __syncwarp of the even lanes while later odd threads start
// and exit, then checks its locals (volatile: they must live in the stack's memory).
__global__ void locals_survive_exits(int* out) {
    const int t = static_cast<int>(threadIdx.x), id = static_cast<int>(blockIdx.x * blockDim.x) + t;
    if (t % 2) {
        out[id] = -1;
        return;
    }
    volatile int local[2048];
    for (int i = 0; i < 2048; ++i) local[i] = id * 7 + i;
    __syncwarp(0x55555555u);
    int wrong = 0;
    for (int i = 0; i < 2048; ++i) wrong += local[i] != id * 7 + i;
    out[id] = wrong;
}
void test_stack_reuse() {
    const int blocks = 6, threads = 96;
    DeviceBuffer<int> out(blocks * threads);
    launch(locals_survive_exits, dim3(blocks), dim3(threads), 0, nullptr, out.ptr);
    CUDA_CHECK_LAUNCH();
    const std::vector<int> h = out.download();
    int bad = 0;
    for (int i = 0; i < blocks * threads; ++i) bad += h[i] != (i % 2 ? -1 : 0);
    test::check(bad == 0, "locals of live threads while others exit and new ones start: %d threads wrong", bad);
}

// ---- bf16 rounding: emu's __float2bfloat16 family against the CUDA header's host functions ----
// A function name in parentheses is not a macro call, so (__float2bfloat16)(x) is the header's own.
bool same_bits(const void* a, const void* b, size_t n) { return std::memcmp(a, b, n) == 0; }
void test_bf16_rounding() {
    std::vector<uint32_t> patterns = {
        0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffc00001u,
        0xffffffffu, 0x7f7fffffu, 0xff7fffffu, 0x7f7f8000u, 0x00000001u, 0x807fffffu, 0x3f808000u,
        0x3f818000u, 0x3f808001u, 0x3f807fffu, 0xbf808000u, 0xbf818000u};  // zeros, inf, NaNs, max, ties
    for (uint64_t u = 0; u < (uint64_t(1) << 32); u += 4093) patterns.push_back(static_cast<uint32_t>(u));
    for (int i = 0; i < (1 << 20); ++i) patterns.push_back(static_cast<uint32_t>(test::rng()()));
    int bad = 0;
    for (const uint32_t bits : patterns) {
        float f;
        std::memcpy(&f, &bits, sizeof f);
        const __nv_bfloat16 a = __float2bfloat16(f), b = (__float2bfloat16)(f);
        const __nv_bfloat16 c = __float2bfloat16_rn(f), d = (__float2bfloat16_rn)(f);
        const __nv_bfloat162 p = __floats2bfloat162_rn(f, -f), q = (__floats2bfloat162_rn)(f, -f);
        const __nv_bfloat162 r = __float22bfloat162_rn(make_float2(-f, f)), w = (__float22bfloat162_rn)(make_float2(-f, f));
        bad += !same_bits(&a, &b, 2) || !same_bits(&c, &d, 2) || !same_bits(&p, &q, 4) || !same_bits(&r, &w, 4);
    }
    test::check(bad == 0, "bf16 rounding differs from the CUDA header's for %d of %zu floats", bad, patterns.size());
}

// ---- streams ordered by events ----
void test_streams_and_events() {
    cudaStream_t s1, s2;
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    CUDA_CHECK(cudaStreamCreate(&s2));
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreateWithFlags(&e1, cudaEventDisableTiming));
    const int n = 1 << 16;
    auto x = test::uniform_vector(n, -1, 1);
    DeviceBuffer<float> dx(x), dy(n);
    CUDA_CHECK(cudaDeviceSynchronize());  // s1 does not wait for the legacy stream's upload by itself
    CUDA_CHECK(cudaEventRecord(e0, s1));
    CUDA_CHECK(cudaMemsetAsync(dy.ptr, 0, n * 4, s1));
    launch(axpy, dim3(16), dim3(256), 0, s1, dy.ptr, dx.ptr, 2.0f, n);
    CUDA_CHECK(cudaEventRecord(e1, s1));
    CUDA_CHECK(cudaStreamWaitEvent(s2, e1, 0));
    launch(axpy, dim3(16), dim3(256), 0, s2, dy.ptr, dx.ptr, 1.0f, n);
    std::vector<float> h(n);
    CUDA_CHECK(cudaMemcpyAsync(h.data(), dy.ptr, n * 4, cudaMemcpyDeviceToHost, s2));
    CUDA_CHECK(cudaStreamSynchronize(s2));
    std::vector<double> want(n);
    for (int i = 0; i < n; ++i) want[i] = 3.0 * x[i];
    test::check_close("two streams ordered by an event", h, want, 1e-6, 1e-6);
    cudaEvent_t e2;
    CUDA_CHECK(cudaEventCreate(&e2));
    CUDA_CHECK(cudaEventRecord(e2, s2));
    float ms = -1;
    CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e2));
    test::check(ms >= 0, "elapsed time between events is non-negative (%f ms)", ms);
    test::check(cudaEventElapsedTime(&ms, e0, e1) == cudaErrorInvalidResourceHandle,
                "timing an event created with cudaEventDisableTiming fails");
    cudaGetLastError();
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    test::check(prop.multiProcessorCount == 132 && prop.major == 9 && prop.sharedMemPerBlockOptin == 227 * 1024,
                "device properties report an H100 SXM");
    for (auto e : {e0, e1, e2}) CUDA_CHECK(cudaEventDestroy(e));
    CUDA_CHECK(cudaStreamDestroy(s1));
    CUDA_CHECK(cudaStreamDestroy(s2));
    test::check(cudaFree(reinterpret_cast<void*>(0x1000)) == cudaErrorInvalidValue, "freeing a foreign pointer fails");
    cudaGetLastError();
}

int main() {
    test::seed();
    test_indexing();
    test_elementwise_and_reductions();
    test_shuffles();
    test_butterflies();
    test_votes();
    test_shared_memory();
    test_barrier_predicates();
    test_atomics();
    test_failures();
    test_stack_reuse();
    test_bf16_rounding();
    test_streams_and_events();
    return test::finish();
}
