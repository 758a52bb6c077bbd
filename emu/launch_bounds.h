// Each kernel's __launch_bounds__ maximum of threads per block, for emu's launch check. g++ erases the
// attribute (cuda_emu.h), so the build reads it from the sources instead: emu/launch_bounds.cmake scans
// the kernels' headers and the trainer into a generated table, keyed by the kernel's plain name. The
// bound stays one fact in one place, the attribute nvcc compiles; a launch with more threads fails
// under emu as it does on the GPU.
#pragma once
#include <cstddef>

namespace emu {
struct LaunchBound {
    const char* kernel;  // plain identifier: every instantiation of a template shares its bound
    unsigned max_threads;
};
extern const LaunchBound kLaunchBounds[];
extern const size_t kLaunchBoundCount;
}  // namespace emu
