// The Hopper primitives of kernels/ptx.cuh: wgmma (A from shared memory and from registers, N = 64,
// 128, 256, every swizzle mode of the descriptors), mbarrier and TMA, checked against a CPU fp32
// reference that adds the products in k order from the accumulator: bit for bit under emu (the order
// emu documents), within fp32 accumulation's error bound on a GPU (whose tensor cores add in their own
// order and precision); and a GEMM on all of them (TMA loads with 128-byte swizzle -> mbarrier -> wgmma m64n128k16) against
// that reference and against double within fp32's accumulation bound, on ragged shapes (TMA fills the
// out-of-bounds rows and columns with zeros). Planted bugs: a tile written with the wrong swizzle gives
// wrong products; under emu, reading an accumulator before its wgmma_wait and a missing expect_tx (a
// deadlock) stop the kernel with their messages; bad tensor maps are refused naming the argument.
#include "../../kernels/common.cuh"
#include "../../kernels/ptx.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <cmath>
#include <cstring>
#include <vector>

// ---- the swizzle pattern: known chunks and a permutation of each repeat ----
void check_swizzle_address() {
    struct Case {
        Swizzle s;
        uint32_t addr, want;
    };
    // 128B: chunk c of 128-byte row r goes to c ^ (r % 8); 64B: chunk c of 64-byte row r to c ^ (r / 2 % 4);
    // 32B: chunk c of 32-byte row r to c ^ (r / 4 % 2). Bytes within a chunk stay.
    const Case cases[] = {{Swizzle::b128, 1 * 128 + 0 * 16, 1 * 128 + 1 * 16}, {Swizzle::b128, 7 * 128 + 3 * 16 + 5, 7 * 128 + 4 * 16 + 5},
                          {Swizzle::b128, 1024 + 2 * 128 + 16, 1024 + 2 * 128 + 3 * 16}, {Swizzle::b64, 1 * 64, 1 * 64},
                          {Swizzle::b64, 2 * 64, 2 * 64 + 16},  {Swizzle::b64, 7 * 64 + 16, 7 * 64 + 2 * 16},
                          {Swizzle::b32, 3 * 32, 3 * 32},      {Swizzle::b32, 4 * 32, 4 * 32 + 16},
                          {Swizzle::none, 5 * 16 + 3, 5 * 16 + 3}};
    for (const Case& c : cases)
        test::check(swizzle_address(c.addr, c.s) == c.want, "swizzle_address(%u, %u-byte) = %u, want %u", c.addr,
                    swizzle_bytes(c.s), swizzle_address(c.addr, c.s), c.want);
    for (Swizzle s : {Swizzle::b32, Swizzle::b64, Swizzle::b128}) {
        const uint32_t repeat = 8 * swizzle_bytes(s);
        std::vector<int> hit(repeat / 16, 0);
        for (uint32_t a = 0; a < repeat; a += 16) {
            const uint32_t to = swizzle_address(repeat + a, s);
            if (to >= repeat && to < 2 * repeat) ++hit[(to - repeat) / 16];
        }
        int bad = 0;
        for (int h : hit) bad += h != 1;
        test::check(bad == 0, "swizzle %u: not a permutation of the chunks of one repeat", swizzle_bytes(s));
    }
}

// ---- one wgmma on hand-written shared memory ----
// A (64 x 16) and B (N x 16) K-major at the layout ptx.cuh documents for swizzle `desc_sw`, written with
// `write_sw` (a different one is the planted bug); the initial accumulator C from `c` in the D layout.
constexpr uint32_t kLbo = 128, kSbo = 256;  // no swizzle: K halves 128 bytes apart, 8-row groups 256 bytes
__host__ __device__ uint32_t operand_offset(int r, int k, Swizzle s) {
    if (s == Swizzle::none) return (r / 8) * kSbo + (r % 8) * 16 + (k / 8) * kLbo + (k % 8) * 2;
    const uint32_t span = swizzle_bytes(s);
    return swizzle_address((r / 8) * 8 * span + (r % 8) * span + 2 * k, s);
}
constexpr uint32_t kBOffset = 8192;  // B's tile in shared memory (A's is at 0, at most 64 rows of 128 bytes)
// The dynamic shared memory's first 1024-byte aligned byte: CUDA aligns its start to 16 bytes only,
// and the swizzle patterns repeat every 1024 bytes of the shared address (launches add 1024 bytes).
__device__ unsigned char* aligned_smem() {
    unsigned char* raw = dynamic_smem<unsigned char>();
    return raw + (1024 - smem_address(raw) % 1024) % 1024;
}

template <int N, bool ARegs>
__global__ void __launch_bounds__(128) one_wgmma(float* out, const __nv_bfloat16* a, const __nv_bfloat16* b,
                                                 const float* c, Swizzle desc_sw, Swizzle write_sw) {
    unsigned char* smem = aligned_smem();
    const int tid = threadIdx.x, w = tid / 32, g = (tid % 32) / 4, t = tid % 4;
    for (int i = tid; i < 64 * 16; i += 128)
        std::memcpy(smem + operand_offset(i / 16, i % 16, write_sw), &a[i], 2);
    for (int i = tid; i < N * 16; i += 128)
        std::memcpy(smem + kBOffset + operand_offset(i / 16, i % 16, write_sw), &b[i], 2);
    fence_proxy_async();
    __syncthreads();
    const uint32_t lbo = desc_sw == Swizzle::none ? kLbo : 0, sbo = desc_sw == Swizzle::none ? kSbo : 8 * swizzle_bytes(desc_sw);
    const uint64_t da = make_smem_desc(smem, lbo, sbo, desc_sw), db = make_smem_desc(smem + kBOffset, lbo, sbo, desc_sw);
    WgmmaAcc<N> acc;
    for (int i = 0; i < N / 8; ++i)
        for (int j = 0; j < 4; ++j) acc[4 * i + j] = c[(16 * w + g + 8 * (j / 2)) * N + 8 * i + 2 * t + j % 2];
    uint32_t fa[4];
    for (int j = 0; j < 4; ++j) {
        const int row = 16 * w + g + 8 * (j % 2), col = 2 * t + 8 * (j / 2);
        uint16_t lo, hi;
        std::memcpy(&lo, &a[row * 16 + col], 2);
        std::memcpy(&hi, &a[row * 16 + col + 1], 2);
        fa[j] = uint32_t(lo) | uint32_t(hi) << 16;
    }
    wgmma_fence(acc);
    if constexpr (ARegs) {
        wgmma_rs(acc, fa, db, true);
    } else {
        wgmma_ss(acc, da, db, true);
    }
    wgmma_commit();
    wgmma_wait<0>(acc);
    for (int i = 0; i < N / 8; ++i)
        for (int j = 0; j < 4; ++j) out[(16 * w + g + 8 * (j / 2)) * N + 8 * i + 2 * t + j % 2] = acc[4 * i + j];
}

// One wgmma against c + sum over k ascending of a[r][k] b[n][k] in fp32: the outputs that differ from
// it in bits, and those outside the error bound of fp32 accumulation around the exact (double) value,
// doubled for adders that truncate. A wrong layout misses the bound by orders of magnitude.
struct WgmmaErrors {
    int wrong_bits = 0, outside = 0;
};
template <int N, bool ARegs>
WgmmaErrors one_wgmma_errors(Swizzle desc_sw, Swizzle write_sw) {
    const std::vector<__nv_bfloat16> a = test::normal_bf16(64 * 16), b = test::normal_bf16(size_t(N) * 16);
    std::vector<float> c(size_t(64) * N);
    for (auto& x : c) x = static_cast<float>(test::normal(0, 4));
    test::DeviceBuffer<__nv_bfloat16> da(a), db(b);
    test::DeviceBuffer<float> dc(c), dout(c.size());
    launch(one_wgmma<N, ARegs>, dim3(1), dim3(128), 1024 + kBOffset + N * 128, nullptr, dout.ptr,
           static_cast<const __nv_bfloat16*>(da.ptr), static_cast<const __nv_bfloat16*>(db.ptr),
           static_cast<const float*>(dc.ptr), desc_sw, write_sw);
    CUDA_CHECK_LAUNCH();
    const std::vector<float> out = dout.download();
    WgmmaErrors e;
    for (int r = 0; r < 64; ++r)
        for (int n = 0; n < N; ++n) {
            float want = c[r * N + n];
            double exact = c[r * N + n], mag = std::fabs(exact);
            for (int k = 0; k < 16; ++k) {
                const double p = test::value(a[r * 16 + k]) * test::value(b[n * 16 + k]);
                want += static_cast<float>(p);
                exact += p;
                mag += std::fabs(p);
            }
            e.wrong_bits += test::bits(out[r * N + n]) != test::bits(want);
            e.outside += !(std::fabs(out[r * N + n] - exact) <= 2 * 17 * std::ldexp(mag, -24));
        }
    return e;
}

template <int N, bool ARegs>
void check_one_wgmma() {
    for (Swizzle s : {Swizzle::none, Swizzle::b32, Swizzle::b64, Swizzle::b128}) {
        const WgmmaErrors e = one_wgmma_errors<N, ARegs>(s, s);
        const char* a_from = ARegs ? "registers" : "shared memory";
        // An H100 differed from the k order in a third of the outputs' bits (docs/gpu-runs/2026-11-28-*).
        if constexpr (kEmulated)
            test::check(e.wrong_bits == 0, "wgmma m64n%dk16 (A from %s, swizzle %u): %d of %d outputs differ in bits", N,
                        a_from, swizzle_bytes(s), e.wrong_bits, 64 * N);
        test::check(e.outside == 0, "wgmma m64n%dk16 (A from %s, swizzle %u): %d of %d outputs outside fp32's bound", N,
                    a_from, swizzle_bytes(s), e.outside, 64 * N);
    }
}

// ---- the GEMM: out[M][N] (fp32) = A[M][K] B[N][K]^T, bf16 K-major, 64 x 128 tiles, k-chunks of 64 ----
constexpr int kBM = 64, kBN = 128, kBK = 64, kStages = 2;
constexpr uint32_t kATileBytes = kBM * kBK * 2, kBTileBytes = kBN * kBK * 2;
constexpr size_t kGemmSmem = 1024 + kStages * (kATileBytes + kBTileBytes);  // 1024: room to align the tiles
enum class Planted { none, no_expect_tx, acc_before_wait };

// The A fragment of rows 16w.., k 16 kk.. from a 128-byte-swizzled A tile, as wgmma_rs wants it.
__device__ void load_a_fragment(uint32_t (&fa)[4], const unsigned char* tile, int kk) {
    const int w = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    const uint32_t base = smem_address(tile);
    for (int j = 0; j < 4; ++j) {
        const int row = 16 * w + g + 8 * (j % 2), col = 16 * kk + 2 * t + 8 * (j / 2);
        const uint32_t at = swizzle_address(base + row * 128 + col * 2, Swizzle::b128) - base;
        std::memcpy(&fa[j], tile + at, 4);
    }
}

template <bool ARegs, Planted P>
__global__ void __launch_bounds__(128) gemm_tma_wgmma(float* out, const __grid_constant__ CUtensorMap map_a,
                                                      const __grid_constant__ CUtensorMap map_b, int M, int N, int K) {
    __shared__ uint64_t full[kStages];
    unsigned char* raw = dynamic_smem<unsigned char>();
    unsigned char* tiles = raw + ((1024 - smem_address(raw) % 1024) % 1024);
    const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN, chunks = (K + kBK - 1) / kBK;
    auto a_tile = [&](int s) { return tiles + s * (kATileBytes + kBTileBytes); };
    auto b_tile = [&](int s) { return a_tile(s) + kATileBytes; };
    auto issue = [&](int chunk) {
        const int s = chunk % kStages;
        if constexpr (P != Planted::no_expect_tx) mbarrier_arrive_expect_tx(&full[s], kATileBytes + kBTileBytes);
        tma_load_2d(a_tile(s), &map_a, chunk * kBK, m0, &full[s]);
        tma_load_2d(b_tile(s), &map_b, chunk * kBK, n0, &full[s]);
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < kStages; ++s) mbarrier_init(&full[s], 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int c = 0; c < kStages && c < chunks; ++c) issue(c);
    WgmmaAcc<kBN> acc;
    for (int c = 0; c < chunks; ++c) {
        const int s = c % kStages;
        mbarrier_wait(&full[s], (c / kStages) % 2);
        uint32_t fa[kBK / 16][4];  // A's registers are written before the fence, as wgmma requires
        if constexpr (ARegs)
            for (int kk = 0; kk < kBK / 16; ++kk) load_a_fragment(fa[kk], a_tile(s), kk);
        wgmma_fence(acc);
        for (int kk = 0; kk < kBK / 16; ++kk) {
            const uint64_t db = make_smem_desc(b_tile(s) + 32 * kk, 0, 1024, Swizzle::b128);
            if constexpr (ARegs) {
                wgmma_rs(acc, fa[kk], db, c > 0 || kk > 0);
            } else {
                wgmma_ss(acc, make_smem_desc(a_tile(s) + 32 * kk, 0, 1024, Swizzle::b128), db, c > 0 || kk > 0);
            }
        }
        wgmma_commit();
        if constexpr (P == Planted::acc_before_wait)
            if (c == chunks - 1) out[threadIdx.x] = acc[0];
        wgmma_wait<0>(acc);
        __syncthreads();  // every warp is done with stage s before TMA refills it
        if (threadIdx.x == 0 && c + kStages < chunks) issue(c + kStages);
    }
    const int w = threadIdx.x / 32, g = (threadIdx.x % 32) / 4, t = threadIdx.x % 4;
    for (int i = 0; i < kBN / 8; ++i)
        for (int j = 0; j < 4; ++j) {
            const int row = m0 + 16 * w + g + 8 * (j / 2), col = n0 + 8 * i + 2 * t + j % 2;
            if (row < M && col < N) out[size_t(row) * N + col] = acc[4 * i + j];
        }
}

struct GemmData {
    int M, N, K;
    std::vector<__nv_bfloat16> a, b;
};

template <bool ARegs, Planted P>
std::vector<float> run_gemm(const GemmData& g) {
    test::DeviceBuffer<__nv_bfloat16> da(g.a), db(g.b);
    test::DeviceBuffer<float> dout(size_t(g.M) * g.N);
    const CUtensorMap map_a = encode_tensor_map<2>(da.ptr, {uint64_t(g.K), uint64_t(g.M)}, {uint64_t(g.K) * 2}, {kBK, kBM},
                                                   Swizzle::b128);
    const CUtensorMap map_b = encode_tensor_map<2>(db.ptr, {uint64_t(g.K), uint64_t(g.N)}, {uint64_t(g.K) * 2}, {kBK, kBN},
                                                   Swizzle::b128);
    CUDA_CHECK(cudaFuncSetAttribute(gemm_tma_wgmma<ARegs, P>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kGemmSmem)));
    launch(gemm_tma_wgmma<ARegs, P>, dim3((g.N + kBN - 1) / kBN, (g.M + kBM - 1) / kBM), dim3(128), kGemmSmem, nullptr,
           dout.ptr, map_a, map_b, g.M, g.N, g.K);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaDeviceSynchronize());
    return dout.download();
}

GemmData gemm_data(int M, int N, int K) { return {M, N, K, test::normal_bf16(size_t(M) * K), test::normal_bf16(size_t(N) * K)}; }

template <bool ARegs>
void check_gemm(int M, int N, int K) {
    const GemmData g = gemm_data(M, N, K);
    const std::vector<float> out = run_gemm<ARegs, Planted::none>(g);
    int wrong_bits = 0, outside = 0;
    double worst = 0;
    for (int r = 0; r < M; ++r)
        for (int n = 0; n < N; ++n) {
            float f = 0;  // the documented order: k ascending from +0 (the first wgmma has scale-d off)
            double d = 0, mag = 0;
            for (int k = 0; k < K; ++k) {
                const double x = test::value(g.a[size_t(r) * K + k]), y = test::value(g.b[size_t(n) * K + k]);
                f += static_cast<float>(x * y);
                d += x * y;
                mag += std::fabs(x * y);
            }
            const float got = out[size_t(r) * N + n];
            wrong_bits += test::bits(got) != test::bits(f);
            const double err = std::fabs(got - d), bound = K * std::ldexp(1.0, -24) * mag;  // fp32 accumulation's bound
            outside += !(err <= bound);
            worst = std::max(worst, err / std::max(bound, 1e-30));
        }
    const char* a_from = ARegs ? "registers" : "shared memory";
    if constexpr (kEmulated)
        test::check(wrong_bits == 0, "TMA + wgmma GEMM %dx%dx%d (A from %s): %d outputs differ in bits from the k-order fp32 reference",
                    M, N, K, a_from, wrong_bits);
    test::check(outside == 0, "TMA + wgmma GEMM %dx%dx%d (A from %s): %d outputs outside fp32's bound of double (worst %.2f of it)",
                M, N, K, a_from, outside, worst);
}

// ---- a 3-D TMA box with out-of-bounds parts, no swizzle: every element against the tensor or zero ----
// The box lands at the dynamic shared memory's first 1024-byte aligned byte, or (the planted bug, which
// faulted with "misaligned address" on an H100) at its start, which follows `bar` and is 16-byte aligned.
enum class BoxAt { aligned, dynamic_start };
__global__ void __launch_bounds__(32) tma_box_3d(__nv_bfloat16* out, const __grid_constant__ CUtensorMap map, int c0, int c1,
                                                 int c2, int box_elems, BoxAt at) {
    __shared__ uint64_t bar;
    __nv_bfloat16* box = reinterpret_cast<__nv_bfloat16*>(at == BoxAt::aligned ? aligned_smem()
                                                                                : dynamic_smem<unsigned char>());
    if (threadIdx.x == 0) {
        mbarrier_init(&bar, 1);
        fence_mbarrier_init();
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        mbarrier_arrive_expect_tx(&bar, box_elems * 2);
        tma_load_3d(box, &map, c0, c1, c2, &bar);
    }
    mbarrier_wait(&bar, 0);
    for (int i = threadIdx.x; i < box_elems; i += 32) out[i] = box[i];
}

void run_tma_box_3d(BoxAt at) {
    const int D0 = 40, D1 = 7, D2 = 5, B0 = 16, B1 = 4, B2 = 3;
    const std::vector<__nv_bfloat16> t = test::normal_bf16(D0 * D1 * D2);
    test::DeviceBuffer<__nv_bfloat16> dt(t), dout(B0 * B1 * B2);
    const CUtensorMap map = encode_tensor_map<3>(dt.ptr, {D0, D1, D2}, {D0 * 2, D0 * D1 * 2}, {B0, B1, B2}, Swizzle::none);
    const int corner[3] = {32, -2, 3};  // past the end in dims 0 and 2, before the start in dim 1
    launch(tma_box_3d, dim3(1), dim3(32), 1024 + B0 * B1 * B2 * 2, nullptr, dout.ptr, map, corner[0], corner[1], corner[2],
           B0 * B1 * B2, at);
    CUDA_CHECK_LAUNCH();
    const std::vector<__nv_bfloat16> out = dout.download();
    int bad = 0;
    for (int i2 = 0; i2 < B2; ++i2)
        for (int i1 = 0; i1 < B1; ++i1)
            for (int i0 = 0; i0 < B0; ++i0) {
                const int x = corner[0] + i0, y = corner[1] + i1, z = corner[2] + i2;
                const bool in = x < D0 && y >= 0 && y < D1 && z < D2;
                const uint16_t want = in ? test::bits(t[(z * D1 + y) * D0 + x]) : 0;
                bad += test::bits(out[(i2 * B1 + i1) * B0 + i0]) != want;
            }
    test::check(bad == 0, "TMA 3-D box with out-of-bounds parts: %d of %d elements wrong", bad, B0 * B1 * B2);
}
void check_tma_3d() { run_tma_box_3d(BoxAt::aligned); }

// ---- planted bugs ----
void check_wrong_swizzle() {
    for (Swizzle wrong : {Swizzle::b64, Swizzle::none})
        test::check(one_wgmma_errors<128, false>(Swizzle::b128, wrong).outside > 0,
                    "a tile written with %u-byte swizzle read as 128-byte must give wrong products", swizzle_bytes(wrong));
}
// Emu's stops; a template so that the GPU build (which would hang or read garbage) never compiles them.
template <bool Emulated>
void check_emu_stops() {
    if constexpr (Emulated) {
        test::check_emu_stops_with("accumulator read before wgmma_wait", "accessed while its wgmma is in flight",
                               [] { run_gemm<false, Planted::acc_before_wait>(gemm_data(64, 128, 128)); });
        test::check_emu_stops_with("TMA without arrive_expect_tx", "deadlock: 128 threads wait at mbarrier_try_wait",
                               [] { run_gemm<false, Planted::no_expect_tx>(gemm_data(64, 128, 128)); });
        test::DeviceBuffer<__nv_bfloat16> buf(256 * 256);
        test::check_fails_with("a box of 300 rows", "boxDim[1] = 300 is not in 1..256", [&] {
            encode_tensor_map<2>(buf.ptr, {256, 256}, {512}, {64, 300}, Swizzle::b128);
        });
        test::check_fails_with("a row stride of 200 bytes", "globalStrides[0] = 200 is not a multiple of 16", [&] {
            encode_tensor_map<2>(buf.ptr, {100, 256}, {200}, {64, 64}, Swizzle::b128);
        });
        test::check_fails_with("a misaligned base", "is not 16-byte aligned", [&] {
            encode_tensor_map<2>(buf.ptr + 1, {64, 64}, {512}, {64, 64}, Swizzle::b128);
        });
        test::check_fails_with("a box row wider than the swizzle span", "exceeds the 64-byte swizzle span", [&] {
            encode_tensor_map<2>(buf.ptr, {256, 256}, {512}, {64, 64}, Swizzle::b64);
        });
        test::check_emu_stops_with("a TMA box at the dynamic shared memory's start", "is not 128-byte aligned",
                               [] { run_tma_box_3d(BoxAt::dynamic_start); });
    }
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench::nothing_to_bench(*o, "Hopper primitives: unit checks only");
    test::seed();
    check_swizzle_address();
    check_one_wgmma<64, false>();
    check_one_wgmma<128, false>();
    check_one_wgmma<256, false>();
    check_one_wgmma<64, true>();
    check_one_wgmma<256, true>();
    check_tma_3d();
    check_gemm<false>(128, 256, 256);
    check_gemm<false>(100, 300, 200);  // ragged: partial tiles in M, N and K
    check_gemm<true>(100, 300, 200);
    check_wrong_swizzle();
    check_emu_stops<kEmulated>();
    return test::finish();
}
