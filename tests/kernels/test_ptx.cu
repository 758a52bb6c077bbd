// The inline-PTX primitives: ldmatrix fragments checked element by element against the PTX
// ISA's layout (written out on the host), and a 16x8x16 mma.sync product, fed both by
// hand-built fragments and by ldmatrix, against a double-precision matmul.
#include "../../kernels/common.cuh"
#include "../../kernels/ptx.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <vector>

constexpr int kRowStride = 24;  // elements between rows in shared memory: rows are not contiguous

__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
    return uint32_t(__bfloat16_as_ushort(lo)) | uint32_t(__bfloat16_as_ushort(hi)) << 16;
}

// Four 8x8 matrices with rows kRowStride apart; matrix i starts at row 8*perm[i] (so the
// lanes' addresses, not memory order, decide which matrix lands in which register).
template <int N, bool Trans>
__global__ void load_fragments(uint32_t* out, const __nv_bfloat16* in, const int* perm) {
    __shared__ __align__(16) __nv_bfloat16 tile[32 * kRowStride];
    for (int i = threadIdx.x; i < 32 * kRowStride; i += 32) tile[i] = in[i];
    __syncwarp();
    const int lane = threadIdx.x, matrix = lane / 8, row = lane % 8;
    const __nv_bfloat16* addr = &tile[(8 * perm[matrix % 4] + row) * kRowStride];
    uint32_t r[N];
    if (Trans) ldmatrix_trans<N>(r, addr);
    else ldmatrix<N>(r, addr);
    for (int i = 0; i < N; ++i) out[lane * N + i] = r[i];
}

template <int N, bool Trans>
void check_ldmatrix() {
    std::vector<__nv_bfloat16> tile(32 * kRowStride);
    std::vector<float> value(tile.size());
    for (size_t i = 0; i < tile.size(); ++i) {
        value[i] = static_cast<float>(test::randint(-256, 256));  // integers: exact in bf16
        tile[i] = __float2bfloat16(value[i]);
    }
    std::vector<int> perm = {0, 1, 2, 3};
    std::shuffle(perm.begin(), perm.end(), test::rng());
    test::DeviceBuffer<__nv_bfloat16> din(tile);
    test::DeviceBuffer<int> dperm(perm);
    test::DeviceBuffer<uint32_t> dout(32 * N);
    launch(load_fragments<N, Trans>, dim3(1), dim3(32), 0, nullptr, dout.ptr, din.ptr, dperm.ptr);
    CUDA_CHECK_LAUNCH();
    const std::vector<uint32_t> out = dout.download();
    int bad = 0;
    for (int lane = 0; lane < 32; ++lane)
        for (int i = 0; i < N; ++i) {
            // element (r, c) of matrix i, as the ISA numbers it
            auto M = [&](int r, int c) { return value[(8 * perm[i] + r) * kRowStride + c]; };
            const int g = lane / 4, t = lane % 4;
            const float lo = Trans ? M(2 * t, g) : M(g, 2 * t);
            const float hi = Trans ? M(2 * t + 1, g) : M(g, 2 * t + 1);
            const uint32_t reg = out[lane * N + i];
            const float got_lo = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(reg & 0xffff)));
            const float got_hi = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(reg >> 16)));
            bad += got_lo != lo || got_hi != hi;
        }
    test::check(bad == 0, "ldmatrix x%d%s: %d registers differ from the ISA layout", N, Trans ? ".trans" : "", bad);
}

// D = A @ B + C for A 16x16 row-major, B 16x8 row-major (k x n), C and D 16x8 fp32.
// Fragments built by hand from the ISA's layout.
__global__ void mma_from_hand_fragments(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    uint32_t fa[4], fb[2];
    float fc[4], fd[4];
    const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
    for (int i = 0; i < 4; ++i) fa[i] = pack_bf16(a[ar[i] * 16 + ac[i]], a[ar[i] * 16 + ac[i] + 1]);
    for (int i = 0; i < 2; ++i) fb[i] = pack_bf16(b[(2 * t + 8 * i) * 8 + g], b[(2 * t + 8 * i + 1) * 8 + g]);
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    for (int i = 0; i < 4; ++i) fc[i] = c[cr[i] * 8 + cc[i]];
    mma_m16n8k16_bf16(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[cr[i] * 8 + cc[i]] = fd[i];
}

// The same product as a kernel would do it: tiles in shared memory, fragments by ldmatrix
// (A directly, B transposed since the mma wants it column-major).
__global__ void mma_from_ldmatrix(float* d, const __nv_bfloat16* a, const __nv_bfloat16* b, const float* c) {
    __shared__ __align__(16) __nv_bfloat16 sa[16 * 16];
    __shared__ __align__(16) __nv_bfloat16 sb[16 * 8];
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    for (int i = lane; i < 256; i += 32) sa[i] = a[i];
    for (int i = lane; i < 128; i += 32) sb[i] = b[i];
    __syncwarp();
    uint32_t fa[4], fb[2];
    ldmatrix<4>(fa, &sa[(lane % 16) * 16 + (lane / 16) * 8]);
    ldmatrix_trans<2>(fb, &sb[(lane % 16) * 8]);
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float fc[4], fd[4];
    for (int i = 0; i < 4; ++i) fc[i] = c[cr[i] * 8 + cc[i]];
    mma_m16n8k16_bf16(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[cr[i] * 8 + cc[i]] = fd[i];
}

void check_mma(void (*kernel)(float*, const __nv_bfloat16*, const __nv_bfloat16*, const float*), const char* name) {
    const std::vector<float> c = test::uniform_vector(128, -1, 1);
    const std::vector<__nv_bfloat16> a = test::normal_bf16(256), b = test::normal_bf16(128);
    std::vector<double> want(128);
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            double s = c[i * 8 + j];
            for (int k = 0; k < 16; ++k) s += double(__bfloat162float(a[i * 16 + k])) * __bfloat162float(b[k * 8 + j]);
            want[i * 8 + j] = s;
        }
    test::DeviceBuffer<__nv_bfloat16> da(a), db(b);
    test::DeviceBuffer<float> dc(c), dd(128);
    launch(kernel, dim3(1), dim3(32), 0, nullptr, dd.ptr, da.ptr, db.ptr, dc.ptr);
    CUDA_CHECK_LAUNCH();
    // fp32 accumulation of 16 exact products: a few ulps of the largest partial sum
    test::check_close(name, dd.download(), want, 1e-5, 1e-5);
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv))
        return bench::nothing_to_bench(*o, "inline PTX primitives: test_attention and test_mlp time the kernels "
                                           "built on them");
    test::seed();
    check_ldmatrix<1, false>();
    check_ldmatrix<2, false>();
    check_ldmatrix<4, false>();
    check_ldmatrix<1, true>();
    check_ldmatrix<2, true>();
    check_ldmatrix<4, true>();
    for (int trial = 0; trial < 3; ++trial) {
        check_mma(mma_from_hand_fragments, "mma m16n8k16 from hand-built fragments");
        check_mma(mma_from_ldmatrix, "mma m16n8k16 from ldmatrix fragments");
    }
    return test::finish();
}
