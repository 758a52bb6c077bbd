// emu refuses what an H100 would punish: ldmatrix rows and cp.async operands that are misaligned or in
// the wrong memory, or that run past their shared object or device allocation; launches with more
// threads than the kernel's __launch_bounds__. Each planted bug runs in a child process (a faulting
// kernel leaves a sticky error) and must stop with emu's message; the correct variant must run and
// give the right values. Also: EMU_LAUNCH_LOG records each distinct launch configuration.
#include "../../emu/launch_bounds.h"
#include "../../kernels/attention.cuh"
#include "../../kernels/mlp.cuh"
#include "../../kernels/norm.cuh"
#include "../../kernels/transpose.cuh"
#include "../device_util.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

using test::DeviceBuffer;

// ---- ldmatrix ----
// Lane l gives row l of a 32x8 bf16 tile (16 bytes per row) `shift` bytes into a static or dynamic
// shared buffer, or straight from global memory; out gets each lane's four registers.
enum class RowsFrom { static_smem, dynamic_smem, global };
__global__ void ldmatrix_rows(uint32_t* out, const uint32_t* in, RowsFrom from, int shift) {
    __shared__ __align__(16) uint32_t tile[32 * 4 + 4];
    uint32_t* buf = from == RowsFrom::dynamic_smem ? dynamic_smem<uint32_t>() : tile;
    for (int j = 0; j < 4; ++j) buf[4 * threadIdx.x + j] = in[4 * threadIdx.x + j];
    __syncthreads();
    const unsigned char* base = from == RowsFrom::global ? reinterpret_cast<const unsigned char*>(in)
                                                         : reinterpret_cast<const unsigned char*>(buf);
    uint32_t r[4];
    ldmatrix<4>(r, base + 16 * threadIdx.x + shift);
    for (int j = 0; j < 4; ++j) out[4 * threadIdx.x + j] = r[j];
}
void run_ldmatrix(RowsFrom from, int shift, bool check_values = false) {
    std::vector<uint32_t> in(32 * 4);
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    DeviceBuffer<uint32_t> din(in), dout(in.size());
    launch(ldmatrix_rows, dim3(1), dim3(32), from == RowsFrom::dynamic_smem ? 32 * 16 : 0, nullptr, dout.ptr,
           static_cast<const uint32_t*>(din.ptr), from, shift);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaDeviceSynchronize());
    if (!check_values) return;
    // Independently of the twin: lane l, register i holds M_i[l/4][2(l%4)..+1], M_i being rows 8i..8i+7.
    const auto out = dout.download();
    int bad = 0;
    for (int l = 0; l < 32; ++l)
        for (int i = 0; i < 4; ++i) bad += out[4 * l + i] != in[4 * (8 * i + l / 4) + l % 4];
    test::check(bad == 0, "ldmatrix from %s shared memory: %d registers wrong",
                from == RowsFrom::static_smem ? "static" : "dynamic", bad);
}

void test_ldmatrix_checks() {
    run_ldmatrix(RowsFrom::static_smem, 0, true);
    run_ldmatrix(RowsFrom::dynamic_smem, 0, true);
    test::check_emu_stops_with("misaligned ldmatrix row", "ldmatrix row: address", [] {
        run_ldmatrix(RowsFrom::static_smem, 4);
    });
    test::check_emu_stops_with("misaligned ldmatrix row names its fault", "is not 16-byte aligned", [] {
        run_ldmatrix(RowsFrom::static_smem, 4);
    });
    test::check_emu_stops_with("ldmatrix from global memory", "is not inside one of the block's shared memory objects", [] {
        run_ldmatrix(RowsFrom::global, 0);
    });
    // 16 bytes past the 512-byte dynamic buffer: the last lane's row crosses its end.
    test::check_emu_stops_with("ldmatrix past the dynamic buffer", "is not inside one of the block's shared memory objects", [] {
        run_ldmatrix(RowsFrom::dynamic_smem, 16);
    });
}

// ---- cp.async ----
// Thread i copies 16 bytes from `src` + 16 i + src_shift (global memory, or the block's own static tile
// when from_shared) into the tile + dst_shift, then writes the tile out.
__global__ void cp_async_rows(uint32_t* out, const uint32_t* src, bool from_shared, int src_shift, int dst_shift) {
    __shared__ __align__(16) uint32_t tile[32 * 4 + 4], other[32 * 4];
    for (int j = 0; j < 4; ++j) other[4 * threadIdx.x + j] = 0;
    __syncthreads();
    const unsigned char* s = from_shared ? reinterpret_cast<const unsigned char*>(other) : reinterpret_cast<const unsigned char*>(src);
    cp_async16(reinterpret_cast<unsigned char*>(tile) + 16 * threadIdx.x + dst_shift, s + 16 * threadIdx.x + src_shift, true);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    for (int j = 0; j < 4; ++j) out[4 * threadIdx.x + j] = tile[4 * threadIdx.x + j];
}
struct CpAsyncCase {
    bool from_shared = false;
    int src_shift = 0, dst_shift = 0;
    size_t src_words = 32 * 4;  // the source allocation
};
void run_cp_async(const CpAsyncCase& c, bool check_values = false) {
    std::vector<uint32_t> in(c.src_words);
    for (auto& x : in) x = static_cast<uint32_t>(test::randint(0, 1 << 30));
    DeviceBuffer<uint32_t> din(in), dout(32 * 4);
    launch(cp_async_rows, dim3(1), dim3(32), 0, nullptr, dout.ptr, static_cast<const uint32_t*>(din.ptr), c.from_shared,
           c.src_shift, c.dst_shift);
    CUDA_CHECK_LAUNCH();
    CUDA_CHECK(cudaDeviceSynchronize());
    if (check_values) test::check(test::same_bits(dout.download(), std::vector<uint32_t>(in.begin(), in.begin() + 32 * 4)),
                                  "cp.async global -> shared copied wrong words");
}

void test_cp_async_checks() {
    run_cp_async({}, true);
    test::check_emu_stops_with("cp.async from shared to shared", "lies in shared memory: cp.async copies global memory to shared",
                           [] { run_cp_async({true, 0, 0}); });
    // The allocation holds 31.5 rows: the last thread's 16 bytes run 8 past its end.
    test::check_emu_stops_with("cp.async past the end of an allocation", "is not inside one device allocation", [] {
        run_cp_async({false, 0, 0, 32 * 4 - 2});
    });
    test::check_emu_stops_with("misaligned cp.async source", "cp.async source: address", [] { run_cp_async({false, 8, 0, 32 * 4 + 4}); });
    test::check_emu_stops_with("misaligned cp.async destination", "cp.async destination: address", [] { run_cp_async({false, 0, 4}); });
}

// ---- launch bounds ----
// The table the build read from the sources agrees with the constants nvcc compiles.
void test_launch_bound_table() {
    const struct {
        const char* kernel;
        unsigned want;
    } spot[] = {{"relu_square_forward_kernel", kPackThreads}, {"rmsnorm_forward_kernel", kNormThreads},
                {"attention_forward_kernel", kAttnThreads},   {"transpose_kernel", kTransposeThreads},
                {"linear_relu_square_kernel", kFcThreads}};
    for (const auto& s : spot) {
        unsigned got = 0;
        for (size_t i = 0; i < emu::kLaunchBoundCount; ++i)
            if (std::string(emu::kLaunchBounds[i].kernel) == s.kernel) got = emu::kLaunchBounds[i].max_threads;
        test::check(got == s.want, "launch bound of %s: table says %u, the source %u", s.kernel, got, s.want);
    }
}

__global__ void unbounded_kernel(int* out) { out[threadIdx.x] = static_cast<int>(threadIdx.x); }

void test_launch_bounds() {
    test_launch_bound_table();
    const int64_t n = 8 * 512;
    DeviceBuffer<__nv_bfloat16> pre(test::normal_bf16(n)), post(n);
    // Within the bound: runs.
    launch(relu_square_forward_kernel, dim3(2), dim3(kPackThreads), 0, nullptr, post.ptr,
           static_cast<const __nv_bfloat16*>(pre.ptr), n);
    test::check(cudaGetLastError() == cudaSuccess, "relu_square_forward_kernel with its own %d threads failed", kPackThreads);
    // Planted: twice the bound, which nvcc compiled the kernel for, fails as on the GPU.
    launch(relu_square_forward_kernel, dim3(1), dim3(2 * kPackThreads), 0, nullptr, post.ptr,
           static_cast<const __nv_bfloat16*>(pre.ptr), n);
    const cudaError_t e = cudaGetLastError();
    test::check(e == cudaErrorLaunchOutOfResources &&
                    std::string(emu::last_kernel_error()).find("its __launch_bounds__ allow 256") != std::string::npos,
                "512 threads of a kernel bounded at 256: %s, '%s'", cudaGetErrorName(e), emu::last_kernel_error());
    // A kernel without bounds takes the device's 1024.
    DeviceBuffer<int> ints(1024);
    launch(unbounded_kernel, dim3(1), dim3(1024), 0, nullptr, ints.ptr);
    test::check(cudaGetLastError() == cudaSuccess, "1024 threads of a kernel without bounds failed");
}


// ---- fork after the device was used ----
// CUDA's context does not survive fork(): a child of a process that has used the device fails at its
// first allocation, stream, launch or cuBLASLt handle (both GPU runs' death tests found it); emu
// refuses the same, and only emu's own stop tests (check_emu_stops_with) may opt out.
__global__ void write_one(int* p) { *p = 1; }
void test_fork_after_device_use() {
    DeviceBuffer<int> used(1);  // this process has now used the device
    const char* phrase = "CUDA's context does not survive fork";
    test::check_fails_with("cudaMalloc in a forked child", phrase, [] { DeviceBuffer<int> b(1); });
    test::check_fails_with("cudaStreamCreate in a forked child", phrase, [] {
        cudaStream_t s;
        CUDA_CHECK(cudaStreamCreate(&s));
    });
    test::check_fails_with("a launch in a forked child", phrase, [&] {
        launch(write_one, dim3(1), dim3(1), 0, nullptr, used.ptr);
        CUDA_CHECK_LAUNCH();
    });
    test::check_fails_with("cublasLtCreate in a forked child", phrase, [] { CublasLt lt; });
    // An emu-only stop test's child may use the device: it allocates and launches, then stops as planted.
    test::check_emu_stops_with("an emu stop test's child", "planted stop after a launch", [] {
        DeviceBuffer<int> b(1);
        launch(write_one, dim3(1), dim3(1), 0, nullptr, b.ptr);
        CUDA_CHECK_LAUNCH();
        if (b.download()[0] == 1) std::fprintf(stderr, "planted stop after a launch\n");  // else no phrase: fails
        std::exit(1);
    });
    // The parent is untouched.
    launch(write_one, dim3(1), dim3(1), 0, nullptr, used.ptr);
    CUDA_CHECK_LAUNCH();
    test::check(used.download()[0] == 1, "the parent still launches after its children failed");
}
// ---- EMU_LAUNCH_LOG ----
// main() points EMU_LAUNCH_LOG at `path` before the first launch; each distinct (kernel symbol, threads,
// dynamic shared bytes) is one line.
void test_launch_log(const std::string& path) {
    DeviceBuffer<int> ints(1024);
    for (int i = 0; i < 3; ++i) launch(unbounded_kernel, dim3(1), dim3(64), 0, nullptr, ints.ptr);
    launch(unbounded_kernel, dim3(2), dim3(128), 0, nullptr, ints.ptr);
    CUDA_CHECK(cudaDeviceSynchronize());
    Dl_info info{};
    test::check(dladdr(reinterpret_cast<const void*>(&unbounded_kernel), &info) && info.dli_sname, "no symbol for a kernel");
    const std::string sym = info.dli_sname ? info.dli_sname : "?";
    std::set<std::string> lines;
    std::ifstream f(path);
    for (std::string line; std::getline(f, line);) lines.insert(line);
    test::check(lines.count(sym + " 64 0") == 1 && lines.count(sym + " 128 0") == 1,
                "EMU_LAUNCH_LOG lacks %s with 64 and 128 threads", sym.c_str());
    test::check(lines.count(sym + " 1024 0") == 1, "EMU_LAUNCH_LOG lacks the 1024-thread launch");
    int mine = 0;
    std::ifstream again(path);
    for (std::string line; std::getline(again, line);) mine += line.rfind(sym + " ", 0) == 0;
    test::check(mine == 3, "EMU_LAUNCH_LOG holds %d lines of %s, want one per distinct configuration (3)", mine, sym.c_str());
}

int main() {
    test::seed();
    const std::string log = "/tmp/emu_test_rules_launches." + std::to_string(getpid());
    setenv("EMU_LAUNCH_LOG", log.c_str(), 1);  // read at the first launch
    test_ldmatrix_checks();
    test_cp_async_checks();
    test_launch_bounds();
    test_fork_after_device_use();
    test_launch_log(log);
    std::remove(log.c_str());
    return test::finish();
}
