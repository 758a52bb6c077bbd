// What emu's parts share about the device's state: errors and per-kernel attributes.
#pragma once
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>

namespace emu {
// A launch that could not start (bad shape, too much shared memory): reported once by
// cudaGetLastError/cudaPeekAtLastError, as CUDA does.
void set_launch_error(cudaError_t e, const std::string& message);
// A kernel that failed while running (deadlock, divergent barrier): every later call
// reports it, as a sticky CUDA error, until cudaDeviceReset.
void set_sticky_error(cudaError_t e, const std::string& message);
cudaError_t sticky_error();
// CUDA's context does not survive fork(): in a child of a process that has used the device, every call
// that needs the device fails (cudaErrorInitializationError; cuBLASLt: CUBLAS_STATUS_NOT_INITIALIZED),
// as the first H100 and H200 runs showed of the death tests' children. device_use(fn) marks this process
// as a user of the device, or, in such a child, returns that error with a message naming fn.
// allow_device_after_fork() lifts it in this process: emu-only tests whose child must run a kernel
// (test::check_emu_stops_with; no GPU build compiles them).
cudaError_t device_use(const char* fn);
void allow_device_after_fork();
size_t max_dynamic_smem(const void* kernel);  // 48 KiB unless raised by cudaFuncSetAttribute
// EMU_RANDOM_ORDER read now (0 when unset); a value that is not a whole number stops the program.
// The one parser of the switch: random_order_seed() is its value at first use.
uint64_t read_random_order_seed();
// Runs task(i) for every i in [0, tasks) on emu's workers (the caller among them); one piece of
// parallel work at a time.
void parallel_for(int64_t tasks, const std::function<void(int64_t)>& task);
// EMU_PROFILE=1: wall time summed per kernel and per kind of cuBLASLt matmul, printed at exit,
// so that a slow CPU-build run shows which work to make cheaper. profile_since adds the time since
// `start` to `name` (a function, so that the name is only made when profiling).
void profile_since(std::chrono::steady_clock::time_point start, const std::function<std::string()>& name);
}  // namespace emu
