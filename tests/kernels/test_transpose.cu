// kernels/transpose.cuh: plain, accumulating and column-slice transposes of bf16 and fp32 matrices,
// ragged against the 64x64 tile, with 16-byte accesses and element by element, against host loops on
// fresh random data.
#include "../../kernels/transpose.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <string>
#include <vector>

// in (rows, in_ld) holds the matrix in columns [col0, col0 + cols); out (cols, out_ld) starts with
// random contents so that the untouched tail and the add are both checked.
// `width`: the elements per access the shapes allow (transpose_vector_width), so each path is covered.
template <class T>
void check_transpose(int rows, int cols, int in_ld, int out_ld, bool add, int width, int col0 = 0) {
    std::vector<T> in(size_t(rows) * in_ld), out(size_t(cols) * out_ld);
    for (T& v : in) v = static_cast<T>(static_cast<float>(test::normal()));
    for (T& v : out) v = static_cast<T>(static_cast<float>(test::normal()));
    std::vector<double> want(out.size());
    for (size_t i = 0; i < out.size(); ++i) want[i] = test::value(out[i]);
    for (int r = 0; r < rows; ++r)
        for (int c = 0; c < cols; ++c) {
            const double x = test::value(in[size_t(r) * in_ld + col0 + c]);
            double& o = want[size_t(c) * out_ld + r];
            // the kernel adds in fp32 and rounds once to T
            o = add ? test::value(static_cast<T>(static_cast<float>(o) + static_cast<float>(x))) : x;
        }
    test::DeviceBuffer<T> din(in), dout(out);
    const std::string what = std::string(sizeof(T) == 2 ? "bf16" : "fp32") + " transpose " + std::to_string(rows) +
                             "x" + std::to_string(cols) + " (ld " + std::to_string(in_ld) + ", " +
                             std::to_string(out_ld) + ", from column " + std::to_string(col0) + ")" +
                             (add ? " add" : "");
    test::check(transpose_vector_width(dout.ptr, din.ptr + col0, rows, cols, in_ld, out_ld) == width,
                "%s: %d elements per access", what.c_str(), width);
    transpose(dout.ptr, din.ptr + col0, rows, cols, in_ld, out_ld, add, nullptr);
    const std::vector<double> got = test::values(dout.download());
    test::check_close(what, got, want, 0.0, 0.0);
}

// ---- benchmark: the trainer's three transposes ----
int bench_transpose(const bench::Options& o) {
    bench::Bench b(o);
    const int64_t C = b.preset().C, V = b.preset().V, shard = V / b.preset().ranks;
    using bf16 = __nv_bfloat16;
    test::DeviceBuffer<bf16> embed(test::normal_bf16(size_t(V * C))), lm_head(test::normal_bf16(size_t(V * C)));
    test::DeviceBuffer<float> moments(test::uniform_vector(size_t(C * V), -1, 1)), shard_out(size_t(shard * C));
    // Adam steps while tied: lm_head's gradient (C, V) += embed's gradient (V, C) transposed
    b.run("transpose", bench::fmt("bf16 add (%lld, %lld)^T", (long long)V, (long long)C), [&](cudaStream_t s) {
        transpose(lm_head.ptr, embed.ptr, V, C, C, V, true, s);
    });
    // then embed = lm_head^T
    b.run("transpose", bench::fmt("bf16 (%lld, %lld)^T", (long long)C, (long long)V), [&](cudaStream_t s) {
        transpose(embed.ptr, lm_head.ptr, C, V, V, C, false, s);
    });
    // the untie step: a rank's columns of lm_head's gathered fp32 moments into embed's rows
    b.run("transpose", bench::fmt("fp32 columns (%lld, %lld of %lld)^T", (long long)C, (long long)shard, (long long)V),
          [&](cudaStream_t s) { transpose(shard_out.ptr, moments.ptr, C, shard, V, C, false, s); });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_transpose(*o);
    test::seed();
    for (bool add : {false, true}) {
        // 16-byte accesses (8 bf16, 4 fp32): rows, cols, leading dimensions and pointers allow them
        check_transpose<__nv_bfloat16>(64, 96, 96, 64, add, 8);
        check_transpose<__nv_bfloat16>(72, 200, 208, 80, add, 8);  // ragged tiles both ways
        check_transpose<float>(36, 68, 200, 40, add, 4, 8);       // a column slice (the untie step's)
        // element by element where they do not
        check_transpose<__nv_bfloat16>(37, 70, 70, 37, add, 1);     // ragged in both directions
        check_transpose<__nv_bfloat16>(128, 300, 512, 130, add, 1); // a column slice into padded rows
        check_transpose<__nv_bfloat16>(72, 200, 208, 80, add, 1, 3); // a slice not 16-byte aligned
        check_transpose<float>(33, 65, 200, 40, add, 1);
        check_transpose<float>(36, 68, 200, 40, add, 1, 2);  // 8-byte aligned
        check_transpose<float>(36, 68, 200, 42, add, 1);     // out's rows not a multiple of 4 elements
    }
    test::check_fails_with("a leading dimension shorter than a row", "leading dimensions", [] {
        transpose<float>(nullptr, nullptr, 4, 8, 4, 4, false, nullptr);
    });
    return test::finish();
}
