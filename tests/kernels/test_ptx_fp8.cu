// The FP8 primitives of kernels/ptx.cuh: cvt_e4m3x2 on every bf16 value and on random fp32 against a
// host reference that picks the nearest of the 256 codes by their values (ties to the even code,
// satfinite, NaN to 0x7F); mma.sync m16n8k32 .e4m3 from hand-built fragments, from ldmatrix loads and
// through mma_m16n8k32_e4m3_from_smem against a double matmul (and, under emu, the two paths bit for
// bit); wgmma m64nNk32 .e4m3 on a 128-byte swizzled tile against double. Planted misuses stop under
// emu as the bf16 twins' do: a lane missing from the mma, lanes of the tile product at different
// shapes, a misaligned ldmatrix row, an e4m3 wgmma without its fence, its accumulator read in flight.
#include "../../kernels/common.cuh"
#include "../../kernels/ptx.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <cmath>
#include <cstring>
#include <vector>

// ---- the host reference: e4m3 codes by their values ----
double e4m3_code_value(int c) {
    const int e = (c >> 3) & 15, m = c & 7;
    const double mag = e == 0 ? std::ldexp(m, -9) : std::ldexp(8 + m, e - 10);
    return c & 0x80 ? -mag : mag;
}
// The code cvt.rn.satfinite.e4m3x2.f32 gives v: the nearest finite code by value (ties: the even
// code), anything past 448 (inf included) 448 with v's sign, NaN 0x7F.
int e4m3_reference(float v) {
    if (std::isnan(v)) return 0x7f;
    const double x = std::fabs(static_cast<double>(v));
    int best = 0;
    for (int c = 1; c <= 0x7e; ++c) {  // the non-negative finite codes, in increasing value
        const double d = std::fabs(e4m3_code_value(c) - x), db = std::fabs(e4m3_code_value(best) - x);
        if (d < db || (d == db && c % 2 == 0)) best = c;
    }
    return (std::signbit(v) ? 0x80 : 0) | best;
}

__global__ void convert_e4m3(uint16_t* out, const float* in, int pairs) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < pairs) out[i] = cvt_e4m3x2(in[2 * i], in[2 * i + 1]);
}

float float_from_bits(uint32_t b) {
    float f;
    std::memcpy(&f, &b, sizeof f);
    return f;
}

void check_cvt_e4m3() {
    std::vector<float> in;
    for (uint32_t b = 0; b < 65536; ++b) in.push_back(float_from_bits(b << 16));  // every bf16: ties, subnormals, inf, NaN
    for (int i = 0; i < 65536; ++i) in.push_back(float_from_bits(static_cast<uint32_t>(test::randint(0, 0x7fffffff)) |
                                                                 (i % 2 ? 0x80000000u : 0u)));
    for (int i = 0; i < 4096; ++i) in.push_back(static_cast<float>(test::uniform_vector(1, -500.0, 500.0)[0]));
    const int pairs = static_cast<int>(in.size() / 2);
    test::DeviceBuffer<float> d_in(in);
    test::DeviceBuffer<uint16_t> d_out(static_cast<size_t>(pairs));
    launch(convert_e4m3, dim3(ceil_div(pairs, 256)), dim3(256), 0, nullptr, d_out.ptr, d_in.ptr, pairs);
    CUDA_CHECK_LAUNCH();
    const std::vector<uint16_t> out = d_out.download();
    int bad = 0, shown = 0;
    for (size_t i = 0; i < in.size(); ++i) {
        const int got = (out[i / 2] >> (8 * (i % 2))) & 0xff, want = e4m3_reference(in[i]);
        if (got != want && shown++ < 5)
            std::printf("  cvt_e4m3x2(%a): got 0x%02x, want 0x%02x\n", static_cast<double>(in[i]), got, want);
        bad += got != want;
    }
    test::check(bad == 0, "cvt_e4m3x2 on %zu values (every bf16, random fp32): %d codes wrong", in.size(), bad);
    // the corners by name
    const struct {
        float v;
        int want;
    } corners[] = {{448.0f, 0x7e}, {464.0f, 0x7e}, {1e30f, 0x7e}, {-INFINITY, 0xfe}, {INFINITY, 0x7e},
                   {1.0625f, 0x38}, {1.1875f, 0x3a}, {std::ldexp(1.0f, -10), 0x00}, {std::ldexp(3.0f, -10), 0x02},
                   {std::ldexp(1.0f, -9), 0x01}, {-0.0f, 0x80}, {std::ldexp(15.0f, -10), 0x08}};
    for (const auto& c : corners)
        test::check(e4m3_reference(c.v) == c.want, "the reference's e4m3(%a) = 0x%02x, want 0x%02x",
                    static_cast<double>(c.v), e4m3_reference(c.v), c.want);
}

// ---- mma.sync m16n8k32 .e4m3 ----
// A 16x32 row-major, B 32x8 row-major (k x n), as e4m3 codes; C and D 16x8 fp32.
__global__ void mma_e4m3_from_hand_fragments(float* d, const uint8_t* a, const uint8_t* b, const float* c) {
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    uint32_t fa[4] = {}, fb[2] = {};
    const int ar[4] = {g, g + 8, g, g + 8}, ac[4] = {4 * t, 4 * t, 4 * t + 16, 4 * t + 16};
    for (int i = 0; i < 4; ++i)
        for (int e = 0; e < 4; ++e) fa[i] |= uint32_t(a[ar[i] * 32 + ac[i] + e]) << (8 * e);
    for (int i = 0; i < 2; ++i)
        for (int e = 0; e < 4; ++e) fb[i] |= uint32_t(b[(4 * t + 16 * i + e) * 8 + g]) << (8 * e);
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float fc[4], fd[4];
    for (int i = 0; i < 4; ++i) fc[i] = c[cr[i] * 8 + cc[i]];
    mma_m16n8k32_e4m3(fd, fa, fb, fc);
    for (int i = 0; i < 4; ++i) d[cr[i] * 8 + cc[i]] = fd[i];
}

// The product as a kernel does it: A's rows and B^T's rows (B's columns, K-major) in shared memory,
// fragments by ldmatrix x4 / x2 (rows of 16 e4m3), or all of it by the tile product.
template <bool FromSmem>
__global__ void mma_e4m3_from_ldmatrix(float* d, const uint8_t* a, const uint8_t* b, const float* c) {
    __shared__ __align__(16) uint8_t sa[16 * 32];
    __shared__ __align__(16) uint8_t sbt[8 * 32];  // B^T: row n holds B[0..31][n]
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    for (int i = lane; i < 16 * 32; i += 32) sa[i] = a[i];
    for (int i = lane; i < 8 * 32; i += 32) sbt[(i % 8) * 32 + i / 8] = b[i];
    __syncwarp();
    const int cr[4] = {g, g, g + 8, g + 8}, cc[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
    float acc[1][2][4];  // n-tiles 0 and 1: the second has a zero B (its result is C)
    for (int i = 0; i < 4; ++i) acc[0][0][i] = acc[0][1][i] = c[cr[i] * 8 + cc[i]];
    if constexpr (FromSmem) {
        __shared__ __align__(16) uint8_t zeros[8 * 32];
        for (int i = lane; i < 8 * 32; i += 32) zeros[i] = 0;
        __syncwarp();
        // B pair 0: lanes 0-7 rows of n-tile 0 at k 0, 8-15 at k 16, 16-23 n-tile 1 at k 0, 24-31 at k 16
        const void* a_rows[1][1] = {{&sa[(lane % 16) * 32 + (lane / 16) * 16]}};
        const uint8_t* bt = lane < 16 ? sbt : zeros;
        const void* b_rows[1][1] = {{bt + (lane % 8) * 32 + ((lane / 8) % 2) * 16}};
        mma_m16n8k32_e4m3_from_smem<1, 1, 2>(acc, a_rows, b_rows);
    } else {
        uint32_t fa[4], fb[2];
        ldmatrix<4>(fa, &sa[(lane % 16) * 32 + (lane / 16) * 16]);
        ldmatrix<2>(fb, &sbt[(lane % 8) * 32 + ((lane / 8) % 2) * 16]);
        mma_m16n8k32_e4m3(acc[0][0], fa, fb, acc[0][0]);
    }
    for (int i = 0; i < 4; ++i) d[cr[i] * 8 + cc[i]] = acc[0][0][i];
    if constexpr (FromSmem)
        for (int i = 0; i < 4; ++i) d[128 + cr[i] * 8 + cc[i]] = acc[0][1][i];
}

std::vector<uint8_t> random_e4m3(size_t n) {
    std::vector<uint8_t> v(n);
    for (auto& x : v) {
        int c;
        do c = test::randint(0, 255);
        while ((c & 0x7f) == 0x7f);  // no NaN
        x = static_cast<uint8_t>(c);
    }
    return v;
}

std::vector<float> run_mma_e4m3(void (*kernel)(float*, const uint8_t*, const uint8_t*, const float*),
                                const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, const std::vector<float>& c) {
    test::DeviceBuffer<uint8_t> da(a), db(b);
    test::DeviceBuffer<float> dc(c), dd(256);
    launch(kernel, dim3(1), dim3(32), 0, nullptr, dd.ptr, da.ptr, db.ptr, dc.ptr);
    CUDA_CHECK_LAUNCH();
    return dd.download();
}

void check_mma_e4m3() {
    const auto a = random_e4m3(16 * 32), b = random_e4m3(32 * 8);
    const std::vector<float> c = test::uniform_vector(128, -100, 100);
    std::vector<double> want(128);
    double mag = 0;
    for (int i = 0; i < 16; ++i)
        for (int j = 0; j < 8; ++j) {
            double s = c[i * 8 + j];
            for (int k = 0; k < 32; ++k) {
                const double p = e4m3_code_value(a[i * 32 + k]) * e4m3_code_value(b[k * 8 + j]);
                s += p;
                mag = std::max(mag, std::fabs(p));
            }
            want[i * 8 + j] = s;
        }
    const auto hand = run_mma_e4m3(mma_e4m3_from_hand_fragments, a, b, c);
    const auto ld = run_mma_e4m3(mma_e4m3_from_ldmatrix<false>, a, b, c);
    const auto tile = run_mma_e4m3(mma_e4m3_from_ldmatrix<true>, a, b, c);
    // fp32 accumulation of 32 exact products (up to 448^2): a few ulps of the largest partial sum
    const double tol = 32 * 100 * mag * 1.2e-7;
    test::check_close("mma m16n8k32 e4m3 from hand-built fragments", std::vector<float>(hand.begin(), hand.begin() + 128),
                      want, tol, 0);
    test::check_close("mma m16n8k32 e4m3 from ldmatrix fragments", std::vector<float>(ld.begin(), ld.begin() + 128), want,
                      tol, 0);
    test::check_close("mma_m16n8k32_e4m3_from_smem", std::vector<float>(tile.begin(), tile.begin() + 128), want, tol, 0);
    test::check(std::memcmp(tile.data() + 128, c.data(), 128 * sizeof(float)) == 0,
                "mma_m16n8k32_e4m3_from_smem: a zero B n-tile leaves C's bits");
    if constexpr (kEmulated)  // both add the 32 products in k order from C
        test::check(std::memcmp(hand.data(), tile.data(), 128 * sizeof(float)) == 0 &&
                        std::memcmp(hand.data(), ld.data(), 128 * sizeof(float)) == 0,
                    "mma m16n8k32 e4m3: the single mma and the tile product give the same bits under emu");
}

// ---- wgmma m64nNk32 .e4m3: A (64 x 32) and B (N x 32) K-major e4m3, 128-byte swizzle (rows of 128
// bytes: k 0..127, the wgmma reads k0..k0+31 of them) ----
enum class WgmmaMisuse { none, no_fence, acc_in_flight };
__device__ unsigned char* aligned_smem_1k() {
    unsigned char* raw = dynamic_smem<unsigned char>();
    return raw + (1024 - smem_address(raw) % 1024) % 1024;
}
constexpr uint32_t kE4m3BOffset = 8192;
__host__ __device__ uint32_t e4m3_offset(int r, int k) { return swizzle_address(uint32_t(r) * 128 + k, Swizzle::b128); }

template <int N, WgmmaMisuse Misuse>
__global__ void __launch_bounds__(128) one_wgmma_e4m3(float* out, const uint8_t* a, const uint8_t* b, int k0) {
    unsigned char* smem = aligned_smem_1k();
    const int tid = threadIdx.x, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    for (int i = tid; i < 64 * 128; i += 128) smem[e4m3_offset(i / 128, i % 128)] = a[i];
    for (int i = tid; i < N * 128; i += 128) smem[kE4m3BOffset + e4m3_offset(i / 128, i % 128)] = b[i];
    fence_proxy_async();
    __syncthreads();
    const uint64_t da = make_smem_desc(smem + k0, 0, 1024, Swizzle::b128),
                   db = make_smem_desc(smem + kE4m3BOffset + k0, 0, 1024, Swizzle::b128);
    WgmmaAcc<N> acc;
    if constexpr (Misuse != WgmmaMisuse::no_fence) wgmma_fence(acc);
    wgmma_ss_e4m3(acc, da, db, false);
    wgmma_commit();
    if constexpr (Misuse == WgmmaMisuse::acc_in_flight) out[0] = acc[0];
    wgmma_wait<0>(acc);
    for (int i = 0; i < N / 8; ++i)
        for (int j = 0; j < 4; ++j) out[(16 * w + g + 8 * (j / 2)) * N + 8 * i + 2 * t + j % 2] = acc[4 * i + j];
}

template <int N, WgmmaMisuse Misuse = WgmmaMisuse::none>
void check_one_wgmma_e4m3(int k0) {
    const auto a = random_e4m3(64 * 128), b = random_e4m3(size_t(N) * 128);
    test::DeviceBuffer<uint8_t> da(a), db(b);
    test::DeviceBuffer<float> dout(64 * size_t(N));
    launch(one_wgmma_e4m3<N, Misuse>, dim3(1), dim3(128), 1024 + kE4m3BOffset + N * 128, nullptr, dout.ptr, da.ptr, db.ptr,
           k0);
    CUDA_CHECK_LAUNCH();
    const std::vector<float> out = dout.download();
    std::vector<double> want(out.size());
    double mag = 0;
    for (int r = 0; r < 64; ++r)
        for (int n = 0; n < N; ++n) {
            double s = 0;
            for (int k = k0; k < k0 + 32; ++k) {
                const double p = e4m3_code_value(a[r * 128 + k]) * e4m3_code_value(b[n * 128 + k]);
                s += p;
                mag = std::max(mag, std::fabs(p));
            }
            want[size_t(r) * N + n] = s;
        }
    // Emu adds in fp32; an H200's fp8 tensor cores keep about 13 bits of the running sum (2026-11-29: errors
    // up to 2e-4 of the largest product), as DeepSeek-V3's report (section 3.3.2) describes. A wrong
    // swizzle or fragment misses either bound by orders of magnitude.
    const double rel = kEmulated ? 1.2e-7 : std::ldexp(1.0, -13);
    test::check_close(("wgmma m64n" + std::to_string(N) + "k32 e4m3 at k " + std::to_string(k0)).c_str(), out, want,
                      32 * mag * rel + 1e-30, 0);
}

// ---- planted misuses (emu's stops; never compiled for the GPU, where they would hang or read garbage) ----
__global__ void mma_e4m3_missing_lane(float* d) {
    if (threadIdx.x == 5) return;
    const uint32_t a[4] = {0x38383838u, 0, 0, 0}, b[2] = {0x38383838u, 0};
    const float c[4] = {};
    float out[4];
    mma_m16n8k32_e4m3(out, a, b, c);
    d[threadIdx.x] = out[0];
}
template <bool Misaligned>
__global__ void tile_product_misuse(float* d) {
    __shared__ __align__(16) uint8_t s[32 * 32];
    for (int i = threadIdx.x; i < 32 * 32; i += 32) s[i] = 0x38;
    __syncwarp();
    float acc1[1][2][4] = {}, acc2[2][2][4] = {};
    const int lane = threadIdx.x;
    if constexpr (Misaligned) {  // every lane's A row 8 bytes off a 16-byte boundary
        const void* a_rows[1][1] = {{&s[lane * 16 + 8]}};
        const void* b_rows[1][1] = {{&s[lane * 16]}};
        mma_m16n8k32_e4m3_from_smem<1, 1, 2>(acc1, a_rows, b_rows);
    } else if (lane < 16) {  // half the warp at one shape, half at another
        const void* a_rows[1][1] = {{&s[lane * 16]}};
        const void* b_rows[1][1] = {{&s[lane * 16]}};
        mma_m16n8k32_e4m3_from_smem<1, 1, 2>(acc1, a_rows, b_rows);
    } else {
        const void* a_rows[1][2] = {{&s[lane * 16], &s[lane * 16]}};
        const void* b_rows[1][1] = {{&s[lane * 16]}};
        mma_m16n8k32_e4m3_from_smem<1, 2, 2>(acc2, a_rows, b_rows);
    }
    d[lane] = acc1[0][0][0] + acc2[0][0][0];
}
template <class Kernel>
void run_planted(Kernel kernel) {
    test::DeviceBuffer<float> d(64);
    launch(kernel, dim3(1), dim3(32), 0, nullptr, d.ptr);
    CUDA_CHECK_LAUNCH();
    (void)d.download();
}
template <bool Emulated>
void check_emu_stops() {
    if constexpr (Emulated) {
        test::check_emu_stops_with("an e4m3 mma with lane 5 gone", "mma.sync.m16n8k32.e4m3",
                               [] { run_planted(mma_e4m3_missing_lane); });
        test::check_emu_stops_with("the e4m3 tile product at two shapes", "divergent warp",
                               [] { run_planted(tile_product_misuse<false>); });
        test::check_emu_stops_with("the e4m3 tile product from a misaligned row", "is not 16-byte aligned",
                               [] { run_planted(tile_product_misuse<true>); });
        test::check_emu_stops_with("an e4m3 wgmma without wgmma_fence", "without a wgmma_fence",
                               [] { check_one_wgmma_e4m3<64, WgmmaMisuse::no_fence>(0); });
        test::check_emu_stops_with("an e4m3 wgmma's accumulator read in flight", "accessed while its wgmma is in flight",
                               [] { check_one_wgmma_e4m3<64, WgmmaMisuse::acc_in_flight>(0); });
    }
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench::nothing_to_bench(*o, "FP8 PTX primitives: unit checks only");
    test::seed();
    check_cvt_e4m3();
    for (int trial = 0; trial < 3; ++trial) check_mma_e4m3();
    check_one_wgmma_e4m3<64>(0);
    check_one_wgmma_e4m3<128>(32);
    check_one_wgmma_e4m3<256>(96);
    check_emu_stops<kEmulated>();
    return test::finish();
}
