// What emu's cuTensorMapEncodeTiled (tensor_map.cpp) stores in the 128 opaque bytes of a CUtensorMap,
// for the TMA twin (hopper_twins.h) to read back. A map emu did not encode lacks the magic word.
#pragma once
#include <cuda.h>

#include <cstdint>

namespace emu {
constexpr uint32_t kTensorMapMagic = 0x544d4150u;  // "TMAP"
struct TensorMapFields {
    uint32_t magic;
    uint8_t rank, elem_bytes;
    uint8_t swizzle_bytes;  // 0 (none), 32, 64 or 128
    uint8_t nan_fill;       // out-of-bounds elements read as NaN instead of zero
    const unsigned char* base;
    uint64_t dims[5];
    uint64_t strides[5];  // bytes; strides[0] is the element size
    uint32_t box[5];
};
static_assert(sizeof(TensorMapFields) <= sizeof(CUtensorMap), "the fields must fit the opaque tensor map");
}  // namespace emu
