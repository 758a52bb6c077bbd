// Tiled matrix transpose, for the tied embedding (embed = lm_head^T, and lm_head's gradient taking
// embed's gradient transposed) and for resharding Adam state at the untie step.
#pragma once
#include "common.cuh"
#include "platform.cuh"

#include <cstdint>
#include <string>

constexpr int kTransposeTile = 64, kTransposeThreads = 256;

// N consecutive elements moved by one global load or store (16 bytes on the vector path).
template <class T, int N>
struct alignas(sizeof(T) * N) TransposeVec {
    T v[N];
};

// out (cols, rows; leading dim out_ld) = in (rows, cols; leading dim in_ld)^T, or out += in^T when
// `add` (fp32 sum of the stored value and the new one, rounded once). A 64x64 tile goes through
// shared memory so that both the reads and the writes are row-contiguous, each access N elements
// (N = transpose_vector_width's choice: every vector lies wholly inside or outside the matrix).
template <class T, int N>
__global__ void __launch_bounds__(kTransposeThreads)
    transpose_kernel(T* out, const T* in, int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld, bool add) {
    using Vec = TransposeVec<T, N>;
    constexpr int per_row = kTransposeTile / N;  // vectors per tile row
    __shared__ float tile[kTransposeTile][kTransposeTile + 1];  // +1: fewer bank conflicts on the transposed read
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile, c0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
    for (int i = threadIdx.x; i < kTransposeTile * per_row; i += blockDim.x) {
        const int rr = i / per_row, cc = (i % per_row) * N;
        const int64_t r = r0 + rr, c = c0 + cc;
        if (r >= rows || c >= cols) continue;
        const Vec x = *reinterpret_cast<const Vec*>(in + r * in_ld + c);
#pragma unroll
        for (int k = 0; k < N; ++k) tile[rr][cc + k] = static_cast<float>(x.v[k]);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < kTransposeTile * per_row; i += blockDim.x) {
        const int cc = i / per_row, rr = (i % per_row) * N;  // out row c0 + cc, columns r0 + rr ...
        const int64_t c = c0 + cc, r = r0 + rr;
        if (r >= rows || c >= cols) continue;
        Vec* o = reinterpret_cast<Vec*>(out + c * out_ld + r);
        Vec y;
        if (add) y = *o;
#pragma unroll
        for (int k = 0; k < N; ++k) {
            const float v = tile[rr + k][cc];
            y.v[k] = static_cast<T>(add ? static_cast<float>(y.v[k]) + v : v);
        }
        *o = y;
    }
}

// 16 / sizeof(T) elements per access where both matrices allow 16-byte accesses: aligned pointers,
// leading dimensions, rows and cols all multiples of that width (the trainer's transposes are);
// otherwise 1 (element by element, any shape).
template <class T>
inline int transpose_vector_width(const T* out, const T* in, int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld) {
    constexpr int64_t n = 16 / sizeof(T);
    const bool whole = rows % n == 0 && cols % n == 0 && in_ld % n == 0 && out_ld % n == 0;
    return whole && is_aligned16(out) && is_aligned16(in) ? static_cast<int>(n) : 1;
}

inline std::string transpose_shape_error(int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld) {
    if (rows < 0 || cols < 0) return "negative shape " + std::to_string(rows) + " x " + std::to_string(cols);
    if (in_ld < cols || out_ld < rows)
        return "leading dimensions (in " + std::to_string(in_ld) + ", out " + std::to_string(out_ld) +
               ") are smaller than the rows they hold";
    if (ceil_div<int64_t>(rows, kTransposeTile) > 65535) return std::to_string(rows) + " rows exceed the grid";
    return "";
}

// Reads in (and out when adding, with an add per element); writes out.
template <class T>
inline Work transpose_work(int64_t rows, int64_t cols, bool add) {
    const double n = static_cast<double>(rows) * cols, bytes = n * sizeof(T);
    return Work{.name = "transpose", .flops = add ? n : 0, .bytes_read = add ? 2 * bytes : bytes,
                .bytes_written = bytes};
}
// out = in^T (add: out += in^T) for in (rows, cols) read with leading dimension in_ld (a column
// slice of a wider matrix when in_ld > cols) and out (cols, rows) with leading dimension out_ld;
// 16-byte accesses where transpose_vector_width allows them.
template <class T>
inline void transpose(T* out, const T* in, int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld, bool add,
                      cudaStream_t stream) {
    require_shape(transpose_shape_error(rows, cols, in_ld, out_ld), "transpose");
    if (rows == 0 || cols == 0) return;
    const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(cols, kTransposeTile)),
                    static_cast<unsigned>(ceil_div<int64_t>(rows, kTransposeTile)));
    constexpr int n = 16 / sizeof(T);
    if (transpose_vector_width(out, in, rows, cols, in_ld, out_ld) == n)
        launch(transpose_work<T>(rows, cols, add), transpose_kernel<T, n>, grid, dim3(kTransposeThreads), 0, stream,
               out, in, rows, cols, in_ld, out_ld, add);
    else
        launch(transpose_work<T>(rows, cols, add), transpose_kernel<T, 1>, grid, dim3(kTransposeThreads), 0, stream,
               out, in, rows, cols, in_ld, out_ld, add);
    CUDA_CHECK_LAUNCH();
}
