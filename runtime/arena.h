// Arenas: one device allocation per kind of tensor (parameters, gradients, activations, optimizer
// state). A layout function takes every tensor from an arena by name, shape and element type; run
// once to measure, once more to place. The names and shapes make `--print-memory` and the memory
// plan readable. In a dry run (profiler/work.h: --plan-step) an arena is address space reserved on
// the host and never touched (no access is allowed there: a stray read or write faults), so the record
// preset's 30 GB per rank plans on a machine of any size.
#pragma once
#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "../kernels/common.cuh"

enum class DType { bf16, f32, i32, u16, f8, bytes };
inline const char* dtype_name(DType t) {
    return t == DType::bf16 ? "bf16" : t == DType::f32 ? "fp32" : t == DType::i32 ? "int32" : t == DType::u16 ? "uint16"
           : t == DType::f8 ? "fp8" : "bytes";
}
inline size_t dtype_size(DType t) {
    return t == DType::f32 || t == DType::i32 ? 4 : t == DType::bf16 || t == DType::u16 ? 2 : 1;
}
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<__nv_bfloat16>() { return DType::bf16; }
template <> constexpr DType dtype_of<float>() { return DType::f32; }
template <> constexpr DType dtype_of<int32_t>() { return DType::i32; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::u16; }
template <> constexpr DType dtype_of<__nv_fp8_e4m3>() { return DType::f8; }
template <> constexpr DType dtype_of<__nv_fp8_e5m2>() { return DType::f8; }
template <> constexpr DType dtype_of<unsigned char>() { return DType::bytes; }

class Arena {
public:
    struct Entry {
        std::string name;
        DType dtype;
        std::vector<int64_t> shape;
        size_t offset, bytes;
    };
    explicit Arena(const char* kind) : kind_(kind) {}
    ~Arena() {
        if (reserved_) munmap(base_, reserved_);
        else if (base_) cudaFree(base_);
    }
    Arena(const Arena&) = delete;
    Arena& operator=(const Arena&) = delete;

    // The next tensor: 256-byte aligned; null while measuring.
    template <class T>
    T* take(const std::string& name, std::vector<int64_t> shape) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        const size_t bytes = static_cast<size_t>(n) * sizeof(T), at = used_;
        used_ += (bytes + 255) / 256 * 256;
        if (!base_) entries_.push_back({name, dtype_of<T>(), std::move(shape), at, bytes});
        if (base_) name_device_range(base_ + at, bytes, name.c_str());
        return base_ ? reinterpret_cast<T*>(base_ + at) : nullptr;
    }
    // Raw bytes (workspaces).
    void* take_bytes(const std::string& name, size_t bytes) {
        return take<unsigned char>(name, {static_cast<int64_t>(bytes)});
    }
    // A region two layouts share (used only one at a time): both measure from the same start.
    size_t mark() const { return used_; }
    void rewind_to(size_t at, size_t high_water) {
        peak_ = std::max(peak_, high_water);
        used_ = at;
    }
    size_t bytes() const { return std::max(used_, peak_); }
    void* base() const { return base_; }

    // Allocate what the measuring pass counted, zeroed; the caller then runs its layout again.
    void allocate() {
        const size_t total = bytes();
        if (dry_running()) {
            reserved_ = std::max<size_t>(total, 1);
            void* p = mmap(nullptr, reserved_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
            if (p == MAP_FAILED) {
                std::fprintf(stderr, "train_gpt: cannot reserve %zu bytes of address space for the %s arena\n", total,
                             kind_);
                std::exit(EXIT_FAILURE);
            }
            base_ = static_cast<unsigned char*>(p);
        } else {
            CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&base_), total));
            CUDA_CHECK(cudaMemset(base_, 0, total));
        }
        used_ = peak_ = 0;
    }
    void print(FILE* f, bool tensors) const {
        std::fprintf(f, "%-12s %10.1f MiB\n", kind_, bytes() / 1048576.0);
        if (!tensors) return;
        for (const Entry& e : entries_) {
            std::string shape;
            for (int64_t d : e.shape) shape += (shape.empty() ? "" : " x ") + std::to_string(d);
            std::fprintf(f, "    %-28s %-5s %-24s %10.2f MiB\n", e.name.c_str(), dtype_name(e.dtype), shape.c_str(),
                         e.bytes / 1048576.0);
        }
    }

private:
    const char* kind_;
    unsigned char* base_ = nullptr;
    size_t reserved_ = 0;  // a dry run's reservation (bytes), else 0
    size_t used_ = 0, peak_ = 0;
    std::vector<Entry> entries_;
};

// One tensor of a group's optimizer state, registered when the optimizer is laid out: reset zeroes
// it, checkpoints save and load it as "<name>.<label>" with this dtype and shape, and the finite
// check scans it (floats only: NorMuon's mantissa is integer bits).
struct StateTensor {
    const char* name;
    DType dtype;
    std::vector<int64_t> shape;
    void* data;
    int64_t elems() const {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        return n;
    }
    size_t bytes() const { return size_t(elems()) * dtype_size(dtype); }
};

// Places a layout: measure, allocate, place (the layout function fills its struct's pointers).
template <class Layout>
void place(Arena& arena, Layout layout) {
    layout(arena);
    arena.allocate();
    layout(arena);
}
