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

#include "work.cuh"

#include <utility>

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

// How launchers launch: the same, with the launch's work described for the step profiler (recorded
// while a recording is on, and only recorded in a dry run).
template <class... P, class... A>
inline void launch(const Work& work, void (*kernel)(P...), dim3 grid, dim3 block, size_t smem_bytes,
                   cudaStream_t stream, A&&... args) {
    WorkRecorder& rec = work_recorder();
    if (rec.on) {
        rec.add(OpKind::kernel, rec.stream_index(stream), -1, work);
        if (rec.dry_run) return;
    }
    launch(kernel, grid, block, smem_bytes, stream, std::forward<A>(args)...);
}

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
