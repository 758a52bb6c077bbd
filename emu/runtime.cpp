// The CUDA runtime calls our programs make, on the CPU. Device memory is host memory;
// every stream executes its work at issue time, so streams run in issue order and an
// event records the moment its stream reached it. The device reports an H100 SXM.
#include "cuda_emu.h"
#include "poison.h"
#include "runtime_state.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <unordered_map>

struct CUstream_st {
    unsigned flags;
    int priority;
};
struct CUevent_st {
    std::chrono::steady_clock::time_point when;
    bool recorded;
    unsigned flags;
};

namespace {

struct State {
    std::mutex m;
    cudaError_t last = cudaSuccess;
    cudaError_t sticky = cudaSuccess;
    std::string message;
    struct Allocation {
        size_t bytes;
        bool device;  // cudaMalloc; else cudaMallocHost
    };
    std::map<const unsigned char*, Allocation> allocations;  // ordered: an address finds its allocation
    std::atomic<uint64_t> allocations_changed{0};            // bumped by every allocation and free
    size_t device_bytes = 0, peak_device_bytes = 0;
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

void* alloc_bytes(size_t bytes, bool device) {
    void* p = nullptr;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) return nullptr;
    emu::poison_fresh(p, bytes);
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.allocations[static_cast<const unsigned char*>(p)] = {bytes, device};
    ++s.allocations_changed;
    if (device) {
        s.device_bytes += bytes;
        s.peak_device_bytes = std::max(s.peak_device_bytes, s.device_bytes);
    }
    return p;
}
cudaError_t free_bytes(void* p, const char* what) {
    if (!p) return cudaSuccess;
    State& s = state();
    bool known;
    {
        std::lock_guard<std::mutex> lock(s.m);
        auto it = s.allocations.find(static_cast<const unsigned char*>(p));
        known = it != s.allocations.end();
        if (known) {
            if (it->second.device) s.device_bytes -= it->second.bytes;
            s.allocations.erase(it);
            ++s.allocations_changed;
        }
    }
    if (!known) return fail(cudaErrorInvalidValue, std::string("emu: ") + what + " of a pointer it did not allocate");
    std::free(p);
    return cudaSuccess;
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
size_t max_dynamic_smem(const void* kernel) {
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    auto it = s.max_dyn_smem.find(kernel);
    return it == s.max_dyn_smem.end() ? kDefaultDynSmem : static_cast<size_t>(it->second);
}
const char* last_kernel_error() { return state().message.c_str(); }
bool in_device_allocation(const void* p, size_t bytes) {
    // The PTX twins ask for every 16-byte copy: the last allocation found is remembered per thread
    // until the next allocation or free.
    struct Found {
        const unsigned char *begin = nullptr, *end = nullptr;
        uint64_t version = ~0ull;
    };
    static thread_local Found last;
    State& s = state();
    const auto* q = static_cast<const unsigned char*>(p);
    const uint64_t version = s.allocations_changed.load(std::memory_order_acquire);
    if (last.version != version) last = Found{nullptr, nullptr, version};
    if (!(q >= last.begin && q + bytes <= last.end)) {
        std::lock_guard<std::mutex> lock(s.m);
        auto it = s.allocations.upper_bound(q);
        if (it == s.allocations.begin()) return false;
        --it;
        if (!it->second.device) return false;
        last.begin = it->first;
        last.end = it->first + it->second.bytes;
    }
    return q >= last.begin && q + bytes <= last.end;
}
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
    State& s = state();
    std::lock_guard<std::mutex> lock(s.m);
    s.last = s.sticky = cudaSuccess;
    s.message.clear();
    s.max_dyn_smem.clear();
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize(void) { return check_sticky(); }

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
    return check_sticky();
}

// ---- memory ----
cudaError_t cudaMalloc(void** p, size_t bytes) {
    if (check_sticky()) return check_sticky();
    if (state().device_bytes + bytes > kTotalMemory || !(*p = alloc_bytes(bytes, true)))
        return fail(cudaErrorMemoryAllocation, "emu: cudaMalloc of " + std::to_string(bytes) + " bytes: out of memory");
    return cudaSuccess;
}
cudaError_t cudaFree(void* p) { return free_bytes(p, "cudaFree"); }
cudaError_t cudaMallocHost(void** p, size_t bytes) {
    if (!(*p = alloc_bytes(bytes, false)))
        return fail(cudaErrorMemoryAllocation, "emu: cudaMallocHost of " + std::to_string(bytes) + " bytes failed");
    return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFreeHost(void* p) { return free_bytes(p, "cudaFreeHost"); }
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind) {
    if (check_sticky()) return check_sticky();
    if (bytes) std::memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t) {
    return cudaMemcpy(dst, src, bytes, kind);
}
cudaError_t cudaMemcpy2D(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                         cudaMemcpyKind) {
    if (check_sticky()) return check_sticky();
    if (width > dpitch || width > spitch) return fail(cudaErrorInvalidValue, "emu: cudaMemcpy2D: width exceeds a pitch");
    for (size_t r = 0; r < height; ++r)
        std::memmove(static_cast<char*>(dst) + r * dpitch, static_cast<const char*>(src) + r * spitch, width);
    return cudaSuccess;
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t) {
    return cudaMemcpy2D(dst, dpitch, src, spitch, width, height, kind);
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
    if (check_sticky()) return check_sticky();
    if (bytes) std::memset(p, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) { return cudaMemset(p, value, bytes); }

// ---- streams and events ----
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned flags, int priority) {
    *s = new CUstream_st{flags, priority};
    return check_sticky();
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned flags) { return cudaStreamCreateWithPriority(s, flags, 0); }
cudaError_t cudaStreamCreate(cudaStream_t* s) { return cudaStreamCreateWithPriority(s, 0, 0); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    delete s;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetStreamPriorityRange(int* least, int* greatest) {
    *least = 0;
    *greatest = -5;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return check_sticky(); }
cudaError_t cudaStreamQuery(cudaStream_t) { return check_sticky(); }
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t e, unsigned) {
    if (!e) return fail(cudaErrorInvalidResourceHandle, "emu: cudaStreamWaitEvent on a null event");
    return check_sticky();
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned flags) {
    *e = new CUevent_st{{}, false, flags};
    return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* e) { return cudaEventCreateWithFlags(e, 0); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t) {
    if (!e) return fail(cudaErrorInvalidResourceHandle, "emu: cudaEventRecord on a null event");
    e->when = std::chrono::steady_clock::now();
    e->recorded = true;
    return check_sticky();
}
cudaError_t cudaEventRecordWithFlags(cudaEvent_t e, cudaStream_t s, unsigned) { return cudaEventRecord(e, s); }
cudaError_t cudaEventSynchronize(cudaEvent_t) { return check_sticky(); }
cudaError_t cudaEventQuery(cudaEvent_t) { return check_sticky(); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
    if (!start || !end || !start->recorded || !end->recorded)
        return fail(cudaErrorInvalidResourceHandle, "emu: cudaEventElapsedTime on an event never recorded");
    if ((start->flags | end->flags) & cudaEventDisableTiming)
        return fail(cudaErrorInvalidResourceHandle, "emu: cudaEventElapsedTime on an event created with cudaEventDisableTiming");
    *ms = std::chrono::duration<float, std::milli>(end->when - start->when).count();
    return cudaSuccess;
}

}  // extern "C"
