// kernels/finite.cuh: the non-finite flag of fp32 and bf16 buffers against std::isfinite on the host,
// and the CPU build's host scan (runtime/finite.h's has_nonfinite, in 4 MiB chunks) against the same,
// on fresh random data with NaNs and infinities planted at random places (or none), ragged sizes and
// sizes past the grid's 4096 x 256 threads, and the edge values: the largest finite numbers, the
// subnormals and negative zero are finite; buffers that do not start 16-byte aligned.
#include "../../kernels/finite.cuh"
#include "../../runtime/finite.h"
#include "../bench_util.h"
#include "../device_util.h"

#include <cmath>
#include <limits>
#include <string>
#include <vector>

// x: random normal values, `planted` of them replaced by `bad` at random positions (or the last one
// at the very end), plus the edge values; the flag must be 1 exactly when std::isfinite fails
// somewhere, and an already set flag stays.
// `skip` > 0: the check starts `skip` elements in, at an address not 16-byte aligned (the scalar path).
template <class T>
void check_flag(int64_t n, int planted, float bad, bool last_at_end = false, int skip = 0) {
    std::vector<T> x(static_cast<size_t>(n));
    for (T& v : x) v = static_cast<T>(static_cast<float>(test::normal(0.0, 1e3)));
    const float edges[] = {std::numeric_limits<float>::denorm_min(), -0.0f, 3.3e38f, -3.3e38f};
    for (float e : edges) x[size_t(test::randint(0, int(n - 1)))] = static_cast<T>(e);
    for (int k = 0; k < planted; ++k) x[size_t(test::randint(0, int(n - 1)))] = static_cast<T>(bad);
    if (last_at_end) x.back() = static_cast<T>(bad);
    bool want = false;
    for (size_t i = size_t(skip); i < x.size(); ++i) want |= !std::isfinite(test::value(x[i]));
    test::DeviceBuffer<T> whole(x);
    const T* const dx = whole.ptr + skip;
    n -= skip;
    test::DeviceBuffer<int> flag(std::vector<int>{0});
    flag_nonfinite(dx, n, sizeof(T) == 4, flag.ptr, nullptr);
    const std::string what = std::string(sizeof(T) == 4 ? "fp32" : "bf16") + " n=" + std::to_string(n) + " " +
                             std::to_string(planted) + " x " + std::to_string(bad) + " skip " + std::to_string(skip);
    test::check(flag.download()[0] == int(want), "%s: flag %d, want %d", what.c_str(), flag.download()[0], int(want));
    const bool scanned = has_nonfinite(dx, n, sizeof(T) == 4);
    test::check(scanned == want, "%s: has_nonfinite %d, want %d", what.c_str(), int(scanned), int(want));
    test::DeviceBuffer<int> set(std::vector<int>{1});
    flag_nonfinite(dx, n, sizeof(T) == 4, set.ptr, nullptr);
    test::check(set.download()[0] == 1, "%s: a set flag was cleared", what.c_str());
}

// ---- benchmark: the check over the largest parameter and a large optimizer-state shard ----
int bench_finite(const bench::Options& o) {
    bench::Bench b(o);
    const bench::Preset& p = b.preset();
    const int64_t n_bigram = int64_t(p.bigram_vocab) * p.C, n_state = int64_t(5) * p.V * p.C / p.ranks;
    test::DeviceBuffer<__nv_bfloat16> bigram(static_cast<size_t>(n_bigram));
    bench::fill_tiled(bigram, test::normal_bf16(size_t(1) << 20));
    test::DeviceBuffer<float> state(test::uniform_vector(static_cast<size_t>(n_state), -1, 1));
    test::DeviceBuffer<int> flag(std::vector<int>{0});
    b.run("flag_nonfinite", bench::fmt("bf16 bigram_embed (%d, %d)", p.bigram_vocab, p.C),
          [&](cudaStream_t s) { flag_nonfinite(bigram.ptr, n_bigram, false, flag.ptr, s); });
    b.run("flag_nonfinite", bench::fmt("fp32 Adam moment shard n=%lld", (long long)n_state),
          [&](cudaStream_t s) { flag_nonfinite(state.ptr, n_state, true, flag.ptr, s); });
    return b.finish();
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv)) return bench_finite(*o);
    test::seed();
    const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
    for (int64_t n : {5, 1000, 70001}) {
        for (float bad : {nan, inf, -inf})
            for (int planted : {0, 1, 3}) {
                check_flag<float>(n, planted, bad);
                check_flag<__nv_bfloat16>(n, planted, bad);
            }
    }
    // Past the grid's 4096 x 256 threads: the grid-stride loop must reach the last elements (and, in
    // fp32, the host scan its second chunk).
    const int64_t big = int64_t(4096) * 256 + 77;
    check_flag<float>(big, 0, nan, true);
    check_flag<__nv_bfloat16>(big, 0, inf, true);
    check_flag<float>(big, 0, nan);
    // Not 16-byte aligned (a buffer starting one element in): every element by the scalar loop, the values
    // before the start left out (a NaN there must not count)
    for (int planted : {0, 2}) {
        check_flag<float>(70001, planted, nan, false, 1);
        check_flag<__nv_bfloat16>(70001, planted, inf, false, 3);
    }
    check_flag<float>(big, 0, nan, true, 1);
    return test::finish();
}
