// Memory that nobody wrote reads as NaN (EMU_POISON=1, and in EMU_RANDOM_ORDER's random mode):
// cudaMalloc and cudaMallocHost memory, a block's dynamic shared memory and its static __shared__
// objects at every block start. Every byte becomes 0xFF, so a bf16 (0xFFFF), an fp32 (0xFFFFFFFF) and
// an fp8 e4m3 (0xFF) read from it are NaN, and an int read as an index is -1.
//
// Static __shared__ objects are, under emu, function-local `static thread_local` variables (see
// cuda_emu.h); emu finds them in the program's symbol table (every such TLS symbol outside namespace
// emu) and knows where each worker thread's copies lie. The same table tells the PTX twins whether an
// address is shared memory.
#pragma once
#include <cstddef>
#include <memory>
#include <string>

namespace emu {
constexpr unsigned char kPoisonByte = 0xFF;
bool poison_enabled();
// Fills [p, p + bytes) with the poison pattern when poisoning is on.
void poison_fresh(void* p, size_t bytes);
// The static __shared__ objects a block of the kernel with this mangled symbol can reach: its own
// (local to its body) and the __device__ helpers', not those local to the other kernels launched so
// far (a block start poisons ~290 KB of objects otherwise, most of them never in its reach); every
// object when the symbol is unknown. Null when poisoning is off. Computed at a launch, shared by its
// blocks.
struct StaticPoison;
std::shared_ptr<const StaticPoison> static_poison_for(const std::string& kernel_symbol);
// The calling worker thread's copies of the objects in `list` poisoned (nothing for a null list).
void poison_static_shared(const StaticPoison* list);
// True if [p, p + bytes) lies inside one static __shared__ object of the calling worker thread.
bool in_static_shared(const void* p, size_t bytes);
}  // namespace emu
