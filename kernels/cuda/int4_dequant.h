// int4_dequant.h: CUDA dequantization of compressed-tensors "pack-quantized"
// INT4 weights (model-spec.md §2.3) to bfloat16.
//
// Layout, as in kernels/cpu/int4_dequant.h: a weight W [rows, cols] is stored as
//   packed [rows, cols / 8] int32, element c in word c / 8 at bits 4 * (c % 8)
//          (element 0 in the low nibble), stored nibble u, q = u - 8;
//   scale  [rows, cols / group_size] bfloat16 (raw bits);
// and W[r][c] = bf16(float(q) * float(scale[r][c / group_size])).
//
// Guarantee: for finite scales the output is bit-identical to
// hsx::DequantizeInt4Rows (the kernel does the same single fp32 multiply, with
// IEEE rounding and denormals kept, then the same round-to-nearest-even). A NaN
// output (NaN scale, or 0 * inf) is a NaN on both sides, but its sign and
// payload may differ.
//
// This header needs no CUDA headers: streams are passed as CUstream_st*, which
// is what cudaStream_t is, and errors are returned as int (a cudaError_t value;
// 0 is cudaSuccess). All pointers are device pointers.
#ifndef HSX_KERNELS_CUDA_INT4_DEQUANT_H_
#define HSX_KERNELS_CUDA_INT4_DEQUANT_H_

#include <cstdint>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hsx {

// Dequantizes one weight [rows, cols] into `out` (bfloat16 bits, row-major,
// rows * cols values) asynchronously on `stream` (nullptr: the legacy default
// stream). Requires 0 < cols <= INT32_MAX, cols % 8 == 0, group_size > 0,
// cols % group_size == 0, and `out` 16-byte aligned (each thread stores its 8
// outputs with one 16-byte store); otherwise returns cudaErrorInvalidValue
// without launching anything (never a sticky code such as
// cudaErrorMisalignedAddress, which callers classify as a lost device). rows
// == 0 is a no-op. Otherwise returns the launch status (cudaGetLastError()).
int LaunchDequantizeInt4(const int32_t* packed, const uint16_t* scale, int64_t rows,
                         int64_t cols, int64_t group_size, uint16_t* out,
                         CUstream_st* stream);

// The same for `count` weights of one shape (e.g. the experts of a layer),
// each with its own buffers: packed[i], scale[i] and out[i] are device arrays
// of `count` device pointers. Every out[i] must be 16-byte aligned (not
// checked here: the pointers live on the device). count <= 65535.
int LaunchDequantizeInt4Batched(const int32_t* const* packed, const uint16_t* const* scale,
                                uint16_t* const* out, int64_t count, int64_t rows,
                                int64_t cols, int64_t group_size, CUstream_st* stream);

}  // namespace hsx

#endif  // HSX_KERNELS_CUDA_INT4_DEQUANT_H_
