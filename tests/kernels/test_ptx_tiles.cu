// mma_m16n8k16_bf16_from_smem, a warp's tile product fed straight from shared memory: bit for bit
// the loop of single ldmatrix x4 loads and mma.sync products it stands for, and within fp32
// accumulation of a double-precision product. The rows sit at shuffled places in shared memory,
// so only the lanes' row addresses tell the primitive where its operands are.
#include "../../kernels/common.cuh"
#include "../../kernels/ptx.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <string>
#include <vector>

using bf16 = __nv_bfloat16;

// A is 16M x 16S (rows m, columns k), Bt is 8N x 16S (rows n, columns k: B transposed), C and D
// are 16M x 8N fp32, all row-major in global memory. In shared memory row r of A lies at slot
// a_slot[r] and row r of Bt at b_slot[r], kPitch(S) elements apart.
template <int S>
constexpr int kPitch = 16 * S + 8;  // padded: consecutive slots do not start at the same bank

// This lane's row addresses: A fragments "rows first" (lanes 0-15 rows 16m + lane at column 16s,
// lanes 16-31 the same rows at 16s + 8), B pairs "cols first" (lanes 0-7 rows 16p + lane at 16s,
// 8-15 the same rows at 16s + 8, 16-23 rows 16p + 8 + (lane - 16) at 16s, 24-31 those at 16s + 8).
template <int S, int M, int N>
__device__ void tile_row_addresses(const void* (&a_rows)[S][M], const void* (&b_rows)[S][N / 2], const bf16* sa,
                                   const bf16* sb, const int* a_slot, const int* b_slot) {
    const int lane = threadIdx.x;
    for (int s = 0; s < S; ++s) {
        for (int m = 0; m < M; ++m)
            a_rows[s][m] = sa + a_slot[16 * m + (lane & 15)] * kPitch<S> + 16 * s + ((lane >> 4) << 3);
        for (int p = 0; p < N / 2; ++p)
            b_rows[s][p] = sb + b_slot[16 * p + (lane & 7) + ((lane >> 4) << 3)] * kPitch<S> + 16 * s +
                           (((lane >> 3) & 1) << 3);
    }
}

// One warp: d = c + a @ bt^T, by the primitive (Fused) or by the single loads and products.
template <int S, int M, int N, bool Fused>
__global__ void warp_tile_product(float* d, const bf16* a, const bf16* bt, const float* c, const int* a_slot,
                                  const int* b_slot) {
    bf16* sa = dynamic_smem<bf16>();
    bf16* sb = sa + 16 * M * kPitch<S>;
    const int lane = threadIdx.x, g = lane / 4, t = lane % 4;
    for (int i = lane; i < 16 * M * 16 * S; i += 32)
        sa[a_slot[i / (16 * S)] * kPitch<S> + i % (16 * S)] = a[i];
    for (int i = lane; i < 8 * N * 16 * S; i += 32)
        sb[b_slot[i / (16 * S)] * kPitch<S> + i % (16 * S)] = bt[i];
    __syncwarp();

    float acc[M][N][4];
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n)
            for (int e = 0; e < 4; ++e)
                acc[m][n][e] = c[(16 * m + g + 8 * (e / 2)) * 8 * N + 8 * n + 2 * t + e % 2];
    const void* a_rows[S][M];
    const void* b_rows[S][N / 2];
    tile_row_addresses<S, M, N>(a_rows, b_rows, sa, sb, a_slot, b_slot);
    if (Fused) {
        mma_m16n8k16_bf16_from_smem<S, M, N>(acc, a_rows, b_rows);
    } else {
        for (int s = 0; s < S; ++s) {
            uint32_t fa[M][4], fb[N / 2][4];
            for (int m = 0; m < M; ++m) ldmatrix<4>(fa[m], a_rows[s][m]);
            for (int p = 0; p < N / 2; ++p) ldmatrix<4>(fb[p], b_rows[s][p]);
            for (int m = 0; m < M; ++m)
                for (int n = 0; n < N; ++n) {
                    const uint32_t b[2] = {fb[n / 2][2 * (n % 2)], fb[n / 2][2 * (n % 2) + 1]};
                    mma_m16n8k16_bf16(acc[m][n], fa[m], b, acc[m][n]);
                }
        }
    }
    for (int m = 0; m < M; ++m)
        for (int n = 0; n < N; ++n)
            for (int e = 0; e < 4; ++e) d[(16 * m + g + 8 * (e / 2)) * 8 * N + 8 * n + 2 * t + e % 2] = acc[m][n][e];
}

std::vector<int> shuffled_slots(int n) {
    std::vector<int> slots(n);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), test::rng());
    return slots;
}

template <int S, int M, int N>
void check_tile_product() {
    const int rows = 16 * M, cols = 8 * N, K = 16 * S;
    const std::string what = "mma_m16n8k16_bf16_from_smem<" + std::to_string(S) + ", " + std::to_string(M) + ", " +
                             std::to_string(N) + ">";
    const auto a = test::normal_bf16(size_t(rows) * K), bt = test::normal_bf16(size_t(cols) * K);
    const auto c = test::uniform_vector(size_t(rows) * cols, -4, 4);
    const auto a_slot = shuffled_slots(rows), b_slot = shuffled_slots(cols);
    test::DeviceBuffer<bf16> da(a), db(bt);
    test::DeviceBuffer<float> dc(c), fused(c.size()), single(c.size());
    test::DeviceBuffer<int> das(a_slot), dbs(b_slot);
    const size_t smem = size_t(rows + cols) * kPitch<S> * sizeof(bf16);
    launch(warp_tile_product<S, M, N, true>, dim3(1), dim3(32), smem, nullptr, fused.ptr,
           static_cast<const bf16*>(da.ptr), static_cast<const bf16*>(db.ptr), static_cast<const float*>(dc.ptr),
           static_cast<const int*>(das.ptr), static_cast<const int*>(dbs.ptr));
    CUDA_CHECK_LAUNCH();
    launch(warp_tile_product<S, M, N, false>, dim3(1), dim3(32), smem, nullptr, single.ptr,
           static_cast<const bf16*>(da.ptr), static_cast<const bf16*>(db.ptr), static_cast<const float*>(dc.ptr),
           static_cast<const int*>(das.ptr), static_cast<const int*>(dbs.ptr));
    CUDA_CHECK_LAUNCH();
    const auto got = fused.download();
    test::check(test::same_bits(got, single.download()), "%s: the same bits as its ldmatrix + mma loop", what.c_str());

    // fp32 accumulation of K exact products onto c: a few ulps (2^-24 each) of the running magnitude
    std::vector<double> want(got.size()), tol(got.size()), gotd(got.begin(), got.end());
    for (int i = 0; i < rows; ++i)
        for (int j = 0; j < cols; ++j) {
            double sum = c[size_t(i) * cols + j], mag = std::fabs(sum);
            for (int k = 0; k < K; ++k) {
                const double p = test::value(a[size_t(i) * K + k]) * test::value(bt[size_t(j) * K + k]);
                sum += p;
                mag += std::fabs(p);
            }
            want[size_t(i) * cols + j] = sum;
            tol[size_t(i) * cols + j] = 0x1p-24 * (K + 1) * mag;
        }
    test::check_within(what + " vs double", gotd, want, tol);
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv))
        return bench::nothing_to_bench(*o, "the warp tile product: linear_relu_square_forward times it in test_mlp");
    test::seed();
    check_tile_product<1, 1, 2>();
    check_tile_product<2, 2, 4>();
    check_tile_product<3, 1, 8>();
    check_tile_product<4, 4, 4>();  // linear_relu_square_forward's warp tile
    return test::finish();
}
