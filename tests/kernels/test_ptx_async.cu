// cp.async: copies land by the wait that covers their group, zero-fill writes zeros, and
// wait_group<N> retires all but the N newest groups (checked by multi-stage pipelines that read a
// stage right after its wait). Under emu copies complete as late as the ISA allows, at the wait,
// which the last check relies on to show that reading before the wait is caught there.
// (EMU_RANDOM_ORDER completes some copies at issue instead, to expose overwritten buffers.)
#include "../../kernels/common.cuh"
#include "../../kernels/ptx.cuh"
#include "../bench_util.h"
#include "../device_util.h"

#include <cstdlib>
#include <cstring>
#include <vector>

constexpr int kRows = 64;            // 16-byte rows per tile
constexpr uint32_t kSentinel = 0xdeadbeefu;

// Thread i copies row i (or zero-fills it when fill[i] is 0); after the wait and a barrier,
// thread i reads the row thread 63 - i copied: visibility to other threads needs both.
__global__ void copy_rows(uint32_t* out, const uint32_t* in, const int* fill) {
    __shared__ __align__(16) uint32_t tile[kRows * 4];
    const int i = threadIdx.x;
    for (int j = 0; j < 4; ++j) tile[4 * i + j] = kSentinel;
    __syncthreads();
    cp_async16(&tile[4 * i], &in[4 * i], fill[i] != 0);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int j = 0; j < 4; ++j) out[4 * i + j] = tile[4 * (kRows - 1 - i) + j];
}

void check_copy_rows() {
    std::vector<uint32_t> in(kRows * 4);
    std::vector<int> fill(kRows);
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    for (auto& f : fill) f = test::randint(0, 3) != 0;
    test::DeviceBuffer<uint32_t> din(in), dout(in.size());
    test::DeviceBuffer<int> dfill(fill);
    launch(copy_rows, dim3(1), dim3(kRows), 0, nullptr, dout.ptr, static_cast<const uint32_t*>(din.ptr),
           static_cast<const int*>(dfill.ptr));
    CUDA_CHECK_LAUNCH();
    const std::vector<uint32_t> out = dout.download();
    int bad = 0;
    for (int i = 0; i < kRows; ++i) {
        const int src = kRows - 1 - i;
        for (int j = 0; j < 4; ++j) bad += out[4 * i + j] != (fill[src] ? in[4 * src + j] : 0u);
    }
    test::check(bad == 0, "cp.async copy / zero-fill: %d words wrong", bad);
}

// Streams `tiles` tiles of 32 rows through a ring of STAGES slots, keeping STAGES - 1 tiles in
// flight: after wait<STAGES - 1> the oldest tile must be complete. Each thread reads the row of
// its neighbour (lane ^ 1) right away. Groups past the last tile are committed empty, as a
// uniform loop does.
template <int STAGES>
__global__ void pipeline(uint32_t* out, const uint32_t* in, int tiles) {
    __shared__ __align__(16) uint32_t ring[STAGES][32 * 4];
    const int lane = threadIdx.x;
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < tiles) cp_async16(&ring[s][4 * lane], &in[(s * 32 + lane) * 4], true);
        cp_async_commit();
    }
    for (int i = 0; i < tiles; ++i) {
        const int next = i + STAGES - 1;
        if (next < tiles) cp_async16(&ring[next % STAGES][4 * lane], &in[(next * 32 + lane) * 4], true);
        cp_async_commit();
        cp_async_wait<STAGES - 1>();
        __syncthreads();
        for (int j = 0; j < 4; ++j) out[(i * 32 + lane) * 4 + j] = ring[i % STAGES][4 * (lane ^ 1) + j];
        __syncthreads();  // slot i % STAGES is refilled at iteration i + 1
    }
}

template <int STAGES>
void check_pipeline(int tiles) {
    std::vector<uint32_t> in(tiles * 32 * 4);
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    test::DeviceBuffer<uint32_t> din(in), dout(in.size());
    launch(pipeline<STAGES>, dim3(1), dim3(32), 0, nullptr, dout.ptr, static_cast<const uint32_t*>(din.ptr), tiles);
    CUDA_CHECK_LAUNCH();
    const std::vector<uint32_t> out = dout.download();
    int bad = 0;
    for (int i = 0; i < tiles; ++i)
        for (int lane = 0; lane < 32; ++lane)
            for (int j = 0; j < 4; ++j) bad += out[(i * 32 + lane) * 4 + j] != in[(i * 32 + (lane ^ 1)) * 4 + j];
    test::check(bad == 0, "cp.async %d-stage pipeline over %d tiles: %d words wrong", STAGES, tiles, bad);
}

// One thread, two groups A and B: reads its destinations before any wait, after wait<1> (A
// retired, B may still be in flight) and after wait<0>.
__global__ void wait_points(uint32_t* seen, const uint32_t* in) {
    __shared__ __align__(16) uint32_t dst[8];
    for (int j = 0; j < 8; ++j) dst[j] = kSentinel;
    cp_async16(&dst[0], &in[0], true);
    cp_async_commit();
    cp_async16(&dst[4], &in[4], true);
    cp_async_commit();
    seen[0] = dst[0];
    seen[1] = dst[4];
    cp_async_wait<1>();
    seen[2] = dst[0];
    seen[3] = dst[4];
    cp_async_wait<0>();
    seen[4] = dst[0];
    seen[5] = dst[4];
}

void check_wait_points() {
    std::vector<uint32_t> in(8);
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    test::DeviceBuffer<uint32_t> din(in), dseen(6);
    launch(wait_points, dim3(1), dim3(1), 0, nullptr, dseen.ptr, static_cast<const uint32_t*>(din.ptr));
    CUDA_CHECK_LAUNCH();
    const std::vector<uint32_t> seen = dseen.download();
    // guaranteed everywhere: a retired group's data is there
    test::check(seen[2] == in[0] && seen[4] == in[0] && seen[5] == in[4],
                "cp.async wait_group: retired groups not visible (%08x %08x %08x)", seen[2], seen[4], seen[5]);
    // emu completes at the wait (unless EMU_RANDOM_ORDER makes some copies early), so a read
    // that skips the wait sees the old contents
    if constexpr (kEmulated)
        if (!std::getenv("EMU_RANDOM_ORDER"))
            test::check(seen[0] == kSentinel && seen[1] == kSentinel && seen[3] == kSentinel,
                        "emu cp.async: data visible before its wait (%08x %08x %08x)", seen[0], seen[1], seen[3]);
}

// prefetch.global.L2 is a hint: a kernel that prefetches every line of a buffer, then copies it, gets its words.
// Under emu an address outside global memory stops the kernel (.global requires one); a GPU would take it silently.
__global__ void prefetch_then_copy(uint32_t* out, const uint32_t* in, int n) {
    for (int i = threadIdx.x * 32; i < n; i += blockDim.x * 32) prefetch_l2(in + i);  // a 128-byte line each
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = in[i];
}
__global__ void prefetch_at(const uint32_t* p) { prefetch_l2(p); }
void check_prefetch() {
    std::vector<uint32_t> in(4096 + test::randint(0, 64));
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    test::DeviceBuffer<uint32_t> din(in), dout(in.size());
    launch(prefetch_then_copy, dim3(1), dim3(128), 0, nullptr, dout.ptr, static_cast<const uint32_t*>(din.ptr),
           static_cast<int>(in.size()));
    CUDA_CHECK_LAUNCH();
    test::check(dout.download() == in, "prefetch_l2 then a copy: words wrong");
}
template <bool Emulated>
void check_emu_prefetch_stop() {
    if constexpr (Emulated) {
        static const uint32_t host_word = 0;
        test::check_emu_stops_with("prefetch_l2 of a host address", "prefetch.global.L2 address", [] {
            launch(prefetch_at, dim3(1), dim3(1), 0, nullptr, &host_word);
            CUDA_CHECK(cudaDeviceSynchronize());
        });
    }
}

int main(int argc, char** argv) {
    if (const auto o = bench::parse(argc, argv))
        return bench::nothing_to_bench(*o, "cp.async primitives: the attention kernels time them in test_attention");
    test::seed();
    check_copy_rows();
    check_pipeline<2>(7);
    check_pipeline<3>(7);
    check_pipeline<4>(2);  // fewer tiles than stages: the prologue commits empty groups
    check_wait_points();
    check_prefetch();
    check_emu_prefetch_stop<kEmulated>();
    return test::finish();
}
