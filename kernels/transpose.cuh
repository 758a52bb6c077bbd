// Tiled matrix transpose, for the tied embedding (embed = lm_head^T, and lm_head's gradient taking
// embed's gradient transposed) and for resharding Adam state at the untie step.
#pragma once
#include "common.cuh"
#include "platform.cuh"

#include <cstdint>
#include <string>

constexpr int kTransposeTile = 64;
constexpr int kTransposeRows = 4;  // threads per tile column: each thread moves 16 elements

// out (cols, rows; leading dim out_ld) = in (rows, cols; leading dim in_ld)^T, or out += in^T when
// `add` (fp32 sum of the stored value and the new one, rounded once). A 32x32 tile goes through
// shared memory so that both the reads and the writes are row-contiguous.
template <class T>
__global__ void __launch_bounds__(kTransposeTile* kTransposeRows)
    transpose_kernel(T* out, const T* in, int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld, bool add) {
    __shared__ float tile[kTransposeTile][kTransposeTile + 1];  // +1: no bank conflicts on the transposed read
    const int64_t r0 = static_cast<int64_t>(blockIdx.y) * kTransposeTile, c0 = static_cast<int64_t>(blockIdx.x) * kTransposeTile;
    for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
        const int64_t r = r0 + i, c = c0 + threadIdx.x;
        if (r < rows && c < cols) tile[i][threadIdx.x] = static_cast<float>(in[r * in_ld + c]);
    }
    __syncthreads();
    for (int i = threadIdx.y; i < kTransposeTile; i += kTransposeRows) {
        const int64_t c = c0 + i, r = r0 + threadIdx.x;  // out row c, column r
        if (r < rows && c < cols) {
            T* o = out + c * out_ld + r;
            const float v = tile[threadIdx.x][i];
            *o = static_cast<T>(add ? static_cast<float>(*o) + v : v);
        }
    }
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
// slice of a wider matrix when in_ld > cols) and out (cols, rows) with leading dimension out_ld.
template <class T>
inline void transpose(T* out, const T* in, int64_t rows, int64_t cols, int64_t in_ld, int64_t out_ld, bool add,
                      cudaStream_t stream) {
    require_shape(transpose_shape_error(rows, cols, in_ld, out_ld), "transpose");
    if (rows == 0 || cols == 0) return;
    const dim3 grid(static_cast<unsigned>(ceil_div<int64_t>(cols, kTransposeTile)),
                    static_cast<unsigned>(ceil_div<int64_t>(rows, kTransposeTile)));
    launch(transpose_work<T>(rows, cols, add), transpose_kernel<T>, grid, dim3(kTransposeTile, kTransposeRows), 0,
           stream, out, in, rows, cols, in_ld, out_ld, add);
    CUDA_CHECK_LAUNCH();
}
