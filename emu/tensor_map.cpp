// The driver's tensor-map encoding for TMA (cuTensorMapEncodeTiled), with the driver's checks of its
// arguments, and the runtime's entry-point query that hands it out (the only driver function emu has).
// A rejected argument is named on stderr; the call returns CUDA_ERROR_INVALID_VALUE as the driver does.
#include "tensor_map.h"

#include <cuda_runtime.h>

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace emu {
namespace {
CUresult refuse(const char* fmt, ...) {
    std::va_list args;
    va_start(args, fmt);
    std::fprintf(stderr, "emu: cuTensorMapEncodeTiled: ");
    std::vfprintf(stderr, fmt, args);
    std::fprintf(stderr, "\n");
    va_end(args);
    return CUDA_ERROR_INVALID_VALUE;
}

int element_bytes(CUtensorMapDataType t) {
    switch (t) {
        case CU_TENSOR_MAP_DATA_TYPE_UINT8: return 1;
        case CU_TENSOR_MAP_DATA_TYPE_UINT16:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT16:
        case CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: return 2;
        case CU_TENSOR_MAP_DATA_TYPE_UINT32:
        case CU_TENSOR_MAP_DATA_TYPE_INT32:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT32:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ:
        case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32:
        case CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ: return 4;
        case CU_TENSOR_MAP_DATA_TYPE_UINT64:
        case CU_TENSOR_MAP_DATA_TYPE_INT64:
        case CU_TENSOR_MAP_DATA_TYPE_FLOAT64: return 8;
        default: return 0;
    }
}
bool is_float(CUtensorMapDataType t) {
    return t == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_FLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32 ||
           t == CU_TENSOR_MAP_DATA_TYPE_TFLOAT32_FTZ || t == CU_TENSOR_MAP_DATA_TYPE_FLOAT64;
}
int swizzle_span(CUtensorMapSwizzle s) {
    switch (s) {
        case CU_TENSOR_MAP_SWIZZLE_NONE: return 0;
        case CU_TENSOR_MAP_SWIZZLE_32B: return 32;
        case CU_TENSOR_MAP_SWIZZLE_64B: return 64;
        case CU_TENSOR_MAP_SWIZZLE_128B: return 128;
        default: return -1;
    }
}
}  // namespace
}  // namespace emu

extern "C" CUresult cuTensorMapEncodeTiled(CUtensorMap* map, CUtensorMapDataType type, cuuint32_t rank, void* address,
                                           const cuuint64_t* dims, const cuuint64_t* strides, const cuuint32_t* box,
                                           const cuuint32_t* element_strides, CUtensorMapInterleave interleave,
                                           CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                           CUtensorMapFloatOOBfill fill) {
    using emu::refuse;
    if (!map || !dims || !box || !element_strides || (rank > 1 && !strides)) return refuse("a null pointer argument");
    const int elem = emu::element_bytes(type);
    if (elem == 0) return refuse("data type %d is not one emu implements", int(type));
    if (interleave != CU_TENSOR_MAP_INTERLEAVE_NONE) return refuse("emu implements interleave NONE only");
    if (rank < 1 || rank > 5) return refuse("tensorRank %u is not in 1..5", rank);
    if (reinterpret_cast<uintptr_t>(address) % 16) return refuse("globalAddress %p is not 16-byte aligned", address);
    const int span = emu::swizzle_span(swizzle);
    if (span < 0) return refuse("swizzle %d is not a CUtensorMapSwizzle", int(swizzle));
    if (l2 < CU_TENSOR_MAP_L2_PROMOTION_NONE || l2 > CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
        return refuse("l2Promotion %d is not a CUtensorMapL2promotion", int(l2));
    if (fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE && fill != CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA)
        return refuse("oobFill %d is not a CUtensorMapFloatOOBfill", int(fill));
    if (fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA && !emu::is_float(type))
        return refuse("oobFill NAN_REQUEST_ZERO_FMA needs a floating-point data type");
    for (cuuint32_t i = 0; i < rank; ++i) {
        if (dims[i] == 0 || dims[i] > (1ull << 32)) return refuse("globalDim[%u] = %llu is not in 1..2^32", i, (unsigned long long)dims[i]);
        if (box[i] == 0 || box[i] > 256) return refuse("boxDim[%u] = %u is not in 1..256", i, box[i]);
        if (element_strides[i] == 0 || element_strides[i] > 8)
            return refuse("elementStrides[%u] = %u is not in 1..8", i, element_strides[i]);
        if (element_strides[i] != 1) return refuse("elementStrides[%u] = %u: emu implements strides of 1 only", i, element_strides[i]);
    }
    for (cuuint32_t i = 0; i + 1 < rank; ++i)
        if (strides[i] % 16 || strides[i] >= (1ull << 40))
            return refuse("globalStrides[%u] = %llu is not a multiple of 16 below 2^40", i, (unsigned long long)strides[i]);
    const uint64_t row_bytes = uint64_t(box[0]) * elem;
    if (row_bytes % 16) return refuse("boxDim[0] * element size = %llu bytes is not a multiple of 16", (unsigned long long)row_bytes);
    if (span > 0 && row_bytes > uint64_t(span))
        return refuse("boxDim[0] * element size = %llu bytes exceeds the %d-byte swizzle span", (unsigned long long)row_bytes, span);
    if (span > 0 && row_bytes != uint64_t(span))
        return refuse("boxDim[0] * element size = %llu bytes: emu implements swizzled boxes whose rows fill the %d-byte span",
                      (unsigned long long)row_bytes, span);
    emu::TensorMapFields f{};
    f.magic = emu::kTensorMapMagic;
    f.rank = static_cast<uint8_t>(rank);
    f.elem_bytes = static_cast<uint8_t>(elem);
    f.swizzle_bytes = static_cast<uint8_t>(span);
    f.nan_fill = fill == CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA;
    f.base = static_cast<const unsigned char*>(address);
    f.strides[0] = static_cast<uint64_t>(elem);
    for (cuuint32_t i = 0; i < rank; ++i) {
        f.dims[i] = dims[i];
        f.box[i] = box[i];
        if (i > 0) f.strides[i] = strides[i - 1];
    }
    std::memset(map, 0, sizeof *map);
    std::memcpy(map, &f, sizeof f);
    return CUDA_SUCCESS;
}

namespace {
cudaError_t entry_point(const char* symbol, void** fn, cudaDriverEntryPointQueryResult* status) {
    const bool known = symbol && std::strcmp(symbol, "cuTensorMapEncodeTiled") == 0;
    if (fn) *fn = known ? reinterpret_cast<void*>(&cuTensorMapEncodeTiled) : nullptr;
    if (status) *status = known ? cudaDriverEntryPointSuccess : cudaDriverEntryPointSymbolNotFound;
    return fn ? cudaSuccess : cudaErrorInvalidValue;
}
}  // namespace

#if CUDART_VERSION >= 12050
cudaError_t cudaGetDriverEntryPointByVersion(const char* symbol, void** fn, unsigned int, unsigned long long,
                                             cudaDriverEntryPointQueryResult* status) {
    return entry_point(symbol, fn, status);
}
#endif
cudaError_t cudaGetDriverEntryPoint(const char* symbol, void** fn, unsigned long long,
                                    cudaDriverEntryPointQueryResult* status) {
    return entry_point(symbol, fn, status);
}
