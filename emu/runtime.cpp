// The CUDA runtime calls our programs make, on the CPU. Device memory is host memory; copies
// and memsets are stream work (streams.cpp decides when it runs). The device reports an H100 SXM.
#include "cuda_emu.h"
#include "poison.h"
#include "runtime_state.h"
#include "streams.h"

#include <sys/uio.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

struct State {
    std::mutex m;
    cudaError_t last = cudaSuccess;
    cudaError_t sticky = cudaSuccess;
    std::string message;
    size_t device_bytes = 0, peak_device_bytes = 0;  // the buffers themselves: emu::note_allocation
    std::unordered_map<const void*, int> max_dyn_smem;
    int device = 0;
};
State& state() {
    static State s;
    return s;
}

constexpr size_t kTotalMemory = 85520809984ull;  // an H100 80GB HBM3
constexpr size_t kDefaultDynSmem = 48 * 1024;
constexpr size_t kOptinSmem = 227 * 1024;

cudaError_t fail(cudaError_t e, const std::string& message) {
    emu::set_launch_error(e, message);
    return e;
}
cudaError_t check_sticky() { return state().sticky; }

// The process that first used the device (0: none yet), and whether a forked child may use it anyway.
std::atomic<pid_t> device_user{0};
std::atomic<bool> device_after_fork_allowed{false};

void* alloc_bytes(size_t bytes, bool device) {
    void* p = nullptr;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return nullptr;
    emu::poison_fresh(p, bytes);
    emu::note_allocation(p, bytes, device ? emu::Memory::device : emu::Memory::pinned);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    if (device) {
        s.device_bytes += bytes;
        s.peak_device_bytes = std::max(s.peak_device_bytes, s.device_bytes);
    }
    return p;
}
// Freeing synchronizes the device, as CUDA's cudaFree and cudaFreeHost do: no queued work still uses p.
cudaError_t free_bytes(void* p, const char* what) {
    if (!p) return cudaSuccess;
    emu::synchronize_device();
    size_t bytes = 0;
    emu::Memory kind{};
    if (!emu::forget_allocation(p, &bytes, &kind))
        return fail(cudaErrorInvalidValue, std::string("emu: ") + what + " of a pointer it did not allocate");
    if (kind == emu::Memory::device) {
        State& s = state();
        std::lock_guard<std::mutex> lock(s.m);
        s.device_bytes -= bytes;
    }
    std::free(p);
    return cudaSuccess;
}

// ---- copies and memsets: stream work ----

// The bytes [p, p + bytes) of this process, or false where they are no longer mapped (a freed
// large block goes back to the system): read through the kernel, which reports what a plain
// read would crash on.
bool read_host(void* to, const void* from, size_t bytes) {
    iovec local{to, bytes}, remote{const_cast<void*>(from), bytes};
    return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == static_cast<ssize_t>(bytes);
}

// The host side of a copy that runs after its call returns, as emu saw it at the call. When the
// copy runs, the host memory must be as it was: a GPU reads (or writes) it then, so a host that
// changed it in between (freed, reused, refilled it) raced with the copy.
struct HostSide {
    const char* fn;
    const void* p;
    size_t bytes;
    bool is_source;
    emu::Memory kind;
    std::vector<unsigned char> seen;
    void check() const {
        std::vector<unsigned char> now(bytes);
        const bool mapped = read_host(now.data(), p, bytes);
        if (mapped && now == seen) return;
        char where[32];
        std::snprintf(where, sizeof where, "%p", p);
        emu::fatal(std::string(fn) + " of " + std::to_string(bytes) + " bytes " + (is_source ? "from" : "to") + " " +
                   (kind == emu::Memory::pinned ? "pinned" : "pageable") + " host memory at " + where + ": the host " +
                   (mapped ? "changed" : "unmapped") + " that buffer (freed or reused it?) before its stream ran the "
                   "copy; keep it alive and unchanged until the stream is synchronized past the copy");
    }
};

// Copies `height` rows of `width` bytes between pitched buffers, as work on stream s: a blocking
// call runs it now and waits for the legacy stream; a copy with pageable host memory waits for
// the stream's next work or synchronization; in deferred mode every copy waits until needed.
cudaError_t copy_2d(const char* fn, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                    size_t height, cudaStream_t s, bool blocking) {
    if (check_sticky()) return check_sticky();
    if (const cudaError_t e = emu::device_use(fn)) return e;
    if (width > dpitch || width > spitch)
        return fail(cudaErrorInvalidValue, std::string("emu: ") + fn + ": width exceeds a pitch");
    if (width == 0 || height == 0) return cudaSuccess;
    const size_t dst_span = dpitch * (height - 1) + width, src_span = spitch * (height - 1) + width;
    const emu::Memory dst_kind = emu::memory_of(dst), src_kind = emu::memory_of(src);
    const bool pageable = dst_kind == emu::Memory::pageable || src_kind == emu::Memory::pageable;
    const emu::RunAt at = blocking ? emu::RunAt::now : pageable ? emu::RunAt::at_sync : emu::RunAt::by_mode;
    std::vector<HostSide> host;
    if (at == emu::RunAt::at_sync || (at == emu::RunAt::by_mode && emu::stream_mode() == emu::StreamMode::deferred)) {
        const auto watch = [&](const void* p, size_t bytes, bool is_source, emu::Memory kind) {
            if (kind == emu::Memory::device) return;
            const auto* b = static_cast<const unsigned char*>(p);
            host.push_back({fn, p, bytes, is_source, kind, std::vector<unsigned char>(b, b + bytes)});
        };
        watch(src, src_span, true, src_kind);
        watch(dst, dst_span, false, dst_kind);
    }
    emu::StreamWork w;
    w.what = [=] {
        char buf[160];
        std::snprintf(buf, sizeof buf, "%s of %zu bytes (%p to %p)", fn, width * height, src, dst);
        return std::string(buf);
    };
    w.accesses = {{src, src_span, false}, {dst, dst_span, true}};
    w.run = [=, host = std::move(host)] {
        for (const HostSide& h : host) h.check();
        for (size_t r = 0; r < height; ++r)
            std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    };
    if (blocking && emu::nccl_group_depth() > 0)
        emu::fatal(std::string(fn) + " inside ncclGroupStart/ncclGroupEnd: a blocking call there can wait forever on a GPU");
    emu::submit(s, std::move(w), at);
    if (blocking) emu::synchronize_stream(nullptr);
    return check_sticky();
}

cudaError_t set_bytes(const char* fn, void* p, int value, size_t bytes, cudaStream_t s) {
    if (check_sticky()) return check_sticky();
    if (const cudaError_t e = emu::device_use(fn)) return e;
    if (bytes == 0) return cudaSuccess;
    emu::StreamWork w;
    w.what = [=] {
        char buf[128];
        std::snprintf(buf, sizeof buf, "%s of %zu bytes at %p", fn, bytes, p);
        return std::string(buf);
    };
    w.accesses = {{p, bytes, true}};
    w.run = [=] { std::memset(p, value, bytes); };
    emu::submit(s, std::move(w), emu::RunAt::by_mode);
    return check_sticky();
}

}  // namespace

namespace emu {
void set_launch_error(cudaError_t e, const std::string& message) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.last = e;
    s.message = message;
    std::fprintf(stderr, "%s\n", message.c_str());
}
void set_sticky_error(cudaError_t e, const std::string& message) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.last = s.sticky = e;
    s.message = message;
    std::fprintf(stderr, "%s\n", message.c_str());
}
cudaError_t sticky_error() { return state().sticky; }
cudaError_t device_use(const char* fn) {
    pid_t user = 0;
    const pid_t me = getpid();
    if (device_user.compare_exchange_strong(user, me) || user == me || device_after_fork_allowed) return cudaSuccess;
    return fail(cudaErrorInitializationError,
                std::string("emu: ") + fn + " in a process forked from one that had used the device (pid " +
                    std::to_string(user) + "): CUDA's context does not survive fork, so this call fails on a GPU "
                    "(initialization error); make the child stop before any CUDA call");
}
void allow_device_after_fork() { device_after_fork_allowed = true; }
size_t max_dynamic_smem(const void* kernel) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.max_dyn_smem.find(kernel);
    return it == s.max_dyn_smem.end() ? kDefaultDynSmem : static_cast<size_t>(it->second);
}
const char* last_kernel_error() { return state().message.c_str(); }
size_t peak_device_bytes() { return state().peak_device_bytes; }
}  // namespace emu

extern "C" {

cudaError_t cudaGetLastError(void) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    cudaError_t e = s.last;
    s.last = s.sticky;
    return e;
}
cudaError_t cudaPeekAtLastError(void) { return state().last; }

const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
        case cudaErrorNotReady: return "cudaErrorNotReady";
        case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
        case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
        case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
        default: return "cudaErrorUnknown";
    }
}
const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidConfiguration: return "invalid configuration argument";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorInvalidResourceHandle: return "invalid resource handle";
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorLaunchFailure: return "unspecified launch failure";
        case cudaErrorInvalidDeviceFunction: return "invalid device function";
        case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
        default: return "unknown error";
    }
}

cudaError_t cudaGetDeviceCount(int* count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice, "emu: only device 0 exists (one emulated GPU per process)");
    return check_sticky();
}
cudaError_t cudaGetDevice(int* device) {
    *device = state().device;
    return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) {
    emu::synchronize_device();
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.last = s.sticky = cudaSuccess;
    s.message.clear();
    s.max_dyn_smem.clear();
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
    if (device != 0) return fail(cudaErrorInvalidDevice, "emu: only device 0 exists");
    *p = cudaDeviceProp{};
    std::snprintf(p->name, sizeof p->name, "NVIDIA H100 80GB HBM3 (emulated on the CPU)");
    p->totalGlobalMem = kTotalMemory;
    p->sharedMemPerBlock = kDefaultDynSmem;
    p->sharedMemPerBlockOptin = kOptinSmem;
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->reservedSharedMemPerBlock = 1024;
    p->regsPerBlock = 65536;
    p->regsPerMultiprocessor = 65536;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024;
    p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = 65535;
    p->maxGridSize[2] = 65535;
    p->totalConstMem = 65536;
    p->major = 9;
    p->minor = 0;
    p->multiProcessorCount = 132;
    p->maxThreadsPerMultiProcessor = 2048;
    p->maxBlocksPerMultiProcessor = 32;
    p->l2CacheSize = 50 * 1024 * 1024;
    p->memoryBusWidth = 5120;
    p->concurrentKernels = 1;
    p->asyncEngineCount = 2;
    p->unifiedAddressing = 1;
    p->canMapHostMemory = 1;
    p->streamPrioritiesSupported = 1;
    p->cooperativeLaunch = 1;
    p->clusterLaunch = 1;
    p->textureAlignment = 512;
    p->memPitch = 2147483647;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    if (cudaError_t e = cudaGetDeviceProperties(&p, device)) return e;
    switch (attr) {
        case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; break;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = static_cast<int>(p.sharedMemPerBlockOptin); break;
        case cudaDevAttrMaxSharedMemoryPerBlock: *value = static_cast<int>(p.sharedMemPerBlock); break;
        case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = static_cast<int>(p.sharedMemPerMultiprocessor); break;
        case cudaDevAttrMaxThreadsPerBlock: *value = p.maxThreadsPerBlock; break;
        case cudaDevAttrMaxThreadsPerMultiProcessor: *value = p.maxThreadsPerMultiProcessor; break;
        case cudaDevAttrWarpSize: *value = 32; break;
        case cudaDevAttrComputeCapabilityMajor: *value = p.major; break;
        case cudaDevAttrComputeCapabilityMinor: *value = p.minor; break;
        case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; break;
        case cudaDevAttrMaxRegistersPerBlock: *value = p.regsPerBlock; break;
        default: return fail(cudaErrorInvalidValue, "emu: cudaDeviceGetAttribute: attribute " + std::to_string(attr) + " is not emulated");
    }
    return cudaSuccess;
}
cudaError_t cudaDriverGetVersion(int* v) {
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int* v) {
    *v = CUDART_VERSION;
    return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total) {
    *total = kTotalMemory;
    *free_bytes = kTotalMemory - std::min(kTotalMemory, state().device_bytes);
    return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize && attr != cudaFuncAttributePreferredSharedMemoryCarveout)
        return fail(cudaErrorInvalidValue, "emu: cudaFuncSetAttribute: attribute " + std::to_string(attr) + " is not emulated");
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
        if (value < 0 || static_cast<size_t>(value) > kOptinSmem)
            return fail(cudaErrorInvalidValue, "emu: cudaFuncSetAttribute: " + std::to_string(value) +
                                                   " bytes of dynamic shared memory exceed the device's " +
                                                   std::to_string(kOptinSmem));
        std::lock_guard<std::mutex> lock(state().m);
        state().max_dyn_smem[func] = value;
    }
    // The carveout is a hint emu has no cache to apply it to, but its value is checked as CUDA's: a percentage of
    // the SM's shared memory, or cudaSharedmemCarveoutDefault (-1).
    if (attr == cudaFuncAttributePreferredSharedMemoryCarveout && (value < -1 || value > 100))
        return fail(cudaErrorInvalidValue, "emu: cudaFuncSetAttribute: shared memory carveout " + std::to_string(value) +
                                               " is neither a percentage (0..100) nor cudaSharedmemCarveoutDefault (-1)");
    return check_sticky();
}

// ---- memory ----
cudaError_t cudaMalloc(void** p, size_t bytes) {
    if (check_sticky()) return check_sticky();
    if (const cudaError_t e = emu::device_use("cudaMalloc")) return e;
    if (state().device_bytes + bytes > kTotalMemory || !(*p = alloc_bytes(bytes, true)))
        return fail(cudaErrorMemoryAllocation, "emu: cudaMalloc of " + std::to_string(bytes) + " bytes: out of memory");
    return cudaSuccess;
}
cudaError_t cudaFree(void* p) { return free_bytes(p, "cudaFree"); }
cudaError_t cudaMallocHost(void** p, size_t bytes) {
    if (const cudaError_t e = emu::device_use("cudaMallocHost")) return e;
    if (!(*p = alloc_bytes(bytes, false)))
        return fail(cudaErrorMemoryAllocation, "emu: cudaMallocHost of " + std::to_string(bytes) + " bytes failed");
    return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFreeHost(void* p) { return free_bytes(p, "cudaFreeHost"); }
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
    return copy_2d("cudaMemcpy", dst, bytes, src, bytes, bytes, 1, nullptr, true);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind, cudaStream_t s) {
    return copy_2d("cudaMemcpyAsync", dst, bytes, src, bytes, bytes, 1, s, false);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         cudaMemcpyKind) {
    return copy_2d("cudaMemcpy2D", dst, dpitch, src, spitch, width, height, nullptr, true);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind, cudaStream_t s) {
    return copy_2d("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, s, false);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) { return set_bytes("cudaMemset", p, value, bytes, nullptr); }
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t s) {
    return set_bytes("cudaMemsetAsync", p, value, bytes, s);
}

}  // extern "C"
