// Where the GPU build and the CPU build (emu/) differ for kernel code: which headers provide CUDA,
// how a kernel is launched, where dynamic shared memory is, how a warp butterfly exchanges values.
// (The inline PTX of kernels/ptx.cuh has its CPU twins in emu/ptx_twins.h.) Code that compiles on
// both sides and only chooses differently tests kEmulated with `if constexpr`, not the preprocessor.
#pragma once

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>
#else
#include "../emu/cuda_emu.h"
#endif

#include "../profiler/op_timer.h"
#include "../profiler/work.h"

#ifdef __CUDACC__
#include <nvtx3/nvToolsExt.h>
#endif

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

// True in the CPU build: kernels run on emu's fibers, on data small enough for tests.
#ifdef __CUDACC__
constexpr bool kEmulated = false;
#else
constexpr bool kEmulated = true;
#endif

// The only way kernels are launched (the CPU build runs them on emu's fibers).
template <class... P, class... A>
inline void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   A&&... args) {
#ifdef __CUDACC__
    kernel<<<grid, block, smem_bytes, stream>>>(std::forward<A>(args)...);
#else
    emu::launch_kernel(kernel, grid, block, smem_bytes, stream, std::forward<A>(args)...);
#endif
}

// ---- operations the step profiler sees (profiler/work.h): recorded while a recording is on, skipped in a
// dry run. Each helper below replaces one CUDA call and returns what that call returns (cudaSuccess
// when skipped), so call sites keep their CUDA_CHECK. ----

// Records an op of `kind` enqueued on `stream`; returns whether to execute it (false in a dry run).
// While the timer is on the op's start event is recorded here.
inline bool record_op(OpKind kind, const Work& work, cudaStream_t stream) {
    WorkRecorder& rec = work_recorder();
    if (!rec.on) return true;
    rec.add(kind, rec.stream_index(stream), -1, work);
    if (rec.dry_run) return false;
    if (op_timer().on) op_timer().begin(rec.ops.size() - 1, stream);
    return true;
}
// Ends the timing of the op record_op began (its end event), if any.
inline void end_op() {
    if (op_timer().on) op_timer().end_open();
}

// How launchers launch: the same, with the launch's work described for the step profiler.
template <class... P, class... A>
inline void launch(const Work& work, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, A&&... args) {
    if (!record_op(OpKind::kernel, work, stream)) return;
    launch(kernel, grid, block, smem_bytes, stream, std::forward<A>(args)...);
    end_op();
}

// cudaEventRecord(e, s) and cudaStreamWaitEvent(s, e): the stream graph between recorded ops.
inline cudaError_t record_event(cudaEvent_t e, cudaStream_t s) {
    WorkRecorder& rec = work_recorder();
    end_op();
    if (rec.on) rec.add(OpKind::event_record, rec.stream_index(s), rec.event_index(e), Work{.name = "event_record"});
    return rec.dry_run ? cudaSuccess : cudaEventRecord(e, s);
}
inline cudaError_t wait_event(cudaStream_t s, cudaEvent_t e) {
    WorkRecorder& rec = work_recorder();
    end_op();
    if (rec.on) rec.add(OpKind::event_wait, rec.stream_index(s), rec.event_index(e), Work{.name = "event_wait"});
    return rec.dry_run ? cudaSuccess : cudaStreamWaitEvent(s, e, 0);
}

// cudaMemcpyAsync with an explicit direction (copy_h2d, copy_d2h, copy_d2d; cudaMemcpyDefault and
// host-to-host are refused with cudaErrorInvalidMemcpyDirection). Bytes count global memory only: an
// upload writes them, a download reads them, a device copy does both.
inline cudaError_t copy_async(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t s) {
    const double n = static_cast<double>(bytes);
    Work w;
    switch (kind) {
        case cudaMemcpyHostToDevice: w = Work{.name = "copy_h2d", .bytes_written = n}; break;
        case cudaMemcpyDeviceToHost: w = Work{.name = "copy_d2h", .bytes_read = n}; break;
        case cudaMemcpyDeviceToDevice: w = Work{.name = "copy_d2d", .bytes_read = n, .bytes_written = n}; break;
        default: return cudaErrorInvalidMemcpyDirection;
    }
    if (!record_op(OpKind::copy, w, s)) return cudaSuccess;
    const cudaError_t r = cudaMemcpyAsync(dst, src, bytes, kind, s);
    end_op();
    return r;
}
// cudaMemsetAsync.
inline cudaError_t memset_async(void* p, int value, size_t bytes, cudaStream_t s) {
    const Work w{.name = "memset", .bytes_written = static_cast<double>(bytes)};
    if (!record_op(OpKind::memset, w, s)) return cudaSuccess;
    const cudaError_t r = cudaMemsetAsync(p, value, bytes, s);
    end_op();
    return r;
}

// The host's wait in `wait` (a CUDA host wait), timed while the timer is on.
template <class Wait>
inline cudaError_t timed_host_wait(Wait&& wait) {
    end_op();
    if (!op_timer().on) return wait();
    const auto t0 = std::chrono::steady_clock::now();
    const cudaError_t r = wait();
    op_timer().host_wait_ms += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    return r;
}

// Host waits, named by why the host waits. cudaStreamSynchronize(s):
inline cudaError_t sync_stream(cudaStream_t s, const char* why) {
    WorkRecorder& rec = work_recorder();
    if (rec.on) rec.add(OpKind::host_sync, rec.stream_index(s), -1, Work{.name = why});
    return rec.dry_run ? cudaSuccess : timed_host_wait([&] { return cudaStreamSynchronize(s); });
}
// cudaDeviceSynchronize():
inline cudaError_t sync_device(const char* why) {
    WorkRecorder& rec = work_recorder();
    if (rec.on) rec.add(OpKind::host_sync, -1, -1, Work{.name = why});
    return rec.dry_run ? cudaSuccess : timed_host_wait([] { return cudaDeviceSynchronize(); });
}
// cudaEventSynchronize(e): recorded as a wait for the stream of e's latest record in this recording
// (the contract has no finer host wait); an event last recorded before the recording began waits on
// work the recording treats as done, and is not recorded.
inline cudaError_t sync_event(cudaEvent_t e, const char* why) {
    WorkRecorder& rec = work_recorder();
    for (size_t i = rec.on ? rec.ops.size() : 0; i-- > 0;) {
        const StepOp& op = rec.ops[i];
        if (op.kind == OpKind::event_record && rec.events[static_cast<size_t>(op.event)] == e) {
            rec.add(OpKind::host_sync, op.stream, -1, Work{.name = why});
            break;
        }
    }
    return rec.dry_run ? cudaSuccess : timed_host_wait([&] { return cudaEventSynchronize(e); });
}
// A blocking host call that waits for other ranks (an MPI wait or collective): recorded as a wait on
// the whole device, named mpi_<call>. The caller makes the call, in a dry run too.
inline void record_host_wait(const char* name) {
    WorkRecorder& rec = work_recorder();
    end_op();
    if (rec.on) rec.add(OpKind::host_sync, -1, -1, Work{.name = name});
}

// A named range of the program (forward, backward, optimizer, layer 3): while a recording is on the
// open ranges name its ops (StepOp.range, "forward/layer 3"), and the GPU build marks it for Nsight
// Systems (NVTX). Nothing else happens in the CPU build.
class Range {
public:
    explicit Range(const char* name, int index = -1) {
        WorkRecorder& rec = work_recorder();
        pushed_ = rec.on;
        if (!pushed_ && kEmulated) return;
        const std::string text = index < 0 ? std::string(name) : std::string(name) + " " + std::to_string(index);
        if (pushed_) rec.ranges.push_back(text);
#ifdef __CUDACC__
        nvtxRangePushA(text.c_str());
#endif
    }
    ~Range() {
        WorkRecorder& rec = work_recorder();
        if (pushed_ && !rec.ranges.empty()) rec.ranges.pop_back();
#ifdef __CUDACC__
        nvtxRangePop();
#endif
    }
    Range(const Range&) = delete;
    Range& operator=(const Range&) = delete;

private:
    bool pushed_;
};

// Names a range of device memory for emu's diagnostics: EMU_STREAMS=deferred's race detector
// names buffers by it and takes a kernel's pointer argument to reach to the end of the range
// that holds it. Nothing on the GPU.
inline void name_device_range(const void* p, size_t bytes, const char* name) {
#ifdef __CUDACC__
    (void)p, (void)bytes, (void)name;
#else
    emu::name_range(p, bytes, name);
#endif
}

// The block's dynamic shared memory (its size is the launch's smem_bytes), 16-byte aligned.
template <class T>
__device__ __forceinline__ T* dynamic_smem() {
#ifdef __CUDACC__
    extern __shared__ __align__(16) unsigned char dynamic_smem_bytes[];
    return reinterpret_cast<T*>(dynamic_smem_bytes);
#else
    return reinterpret_cast<T*>(emu::t_block->dyn_smem);
#endif
}

// The operations of warp butterflies.
struct WarpSum {
    __device__ static float apply(float a, float b) { return a + b; }
};
struct WarpMax {
    __device__ static float apply(float a, float b) { return fmaxf(a, b); }
};
// For offset = First, First/2, ..., 1 in turn, v = Op::apply(v, v of lane ^ offset) over a full warp:
// every lane of an aligned group of 2*First lanes ends with the same bits. The GPU shuffles once
// per round; emu does the whole butterfly in one meeting of the warp, with the same arithmetic.
template <class Op, int First>
__device__ __forceinline__ float warp_butterfly(float v) {
#ifdef __CUDACC__
#pragma unroll
    for (int offset = First; offset > 0; offset >>= 1) v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
#else
    return emu::butterfly<Op, First>(v);
#endif
}
