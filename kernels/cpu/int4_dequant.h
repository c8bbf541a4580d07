// int4_dequant.h: the CPU reference for compressed-tensors "pack-quantized"
// INT4 weights (model-spec.md §2.3).
//
// A weight W of shape [rows, cols] is stored as
//   packed [rows, cols / 8] int32: element c of a row sits in word c / 8 at
//          bits 4 * (c % 8) .. 4 * (c % 8) + 3 (element 0 in the low nibble);
//          the stored nibble u is offset binary, q = u - 8;
//   scale  [rows, cols / group_size] bfloat16.
// Dequantization is W[r][c] = bf16(float(q) * float(scale[r][c / group_size])),
// i.e. rounded to bfloat16 exactly as compressed-tensors computes it. This file
// is the reference the CUDA kernel and every tiled CPU path are tested against.
#ifndef HSX_KERNELS_CPU_INT4_DEQUANT_H_
#define HSX_KERNELS_CPU_INT4_DEQUANT_H_

#include <cstdint>

#include "kernels/bf16.h"

namespace hsx {

// Signed INT4 value of column `col` within a packed row.
inline int Int4At(const int32_t* packed_row, int64_t col) {
  const uint32_t word = static_cast<uint32_t>(packed_row[col / 8]);
  return static_cast<int>((word >> (4 * (col % 8))) & 0xFu) - 8;
}

// The dequantized weight of one element, as bfloat16 bits.
inline uint16_t DequantInt4Element(const int32_t* packed_row, const uint16_t* scale_row,
                                   int64_t col, int64_t group_size) {
  const float scale = Bf16ToFloat(scale_row[col / group_size]);
  return FloatToBf16(static_cast<float>(Int4At(packed_row, col)) * scale);
}

// Dequantizes rows [row_begin, row_end) of a packed weight with `cols` columns
// into `out` (bfloat16 bits, row-major, (row_end - row_begin) * cols values).
// Requires cols % 8 == 0 and cols % group_size == 0 (the checkpoint reader
// validates both before any call).
void DequantizeInt4Rows(const int32_t* packed, const uint16_t* scale, int64_t cols,
                        int64_t group_size, int64_t row_begin, int64_t row_end, uint16_t* out);

// Same, producing float32 (each value is exactly a bfloat16).
void DequantizeInt4RowsToFloat(const int32_t* packed, const uint16_t* scale, int64_t cols,
                               int64_t group_size, int64_t row_begin, int64_t row_end,
                               float* out);

// Packs signed values q in [-8, 7] (row-major [rows, cols]) into the layout
// above. The inverse of Int4At; used by the checkpoint generator.
void PackInt4(const int8_t* values, int64_t rows, int64_t cols, int32_t* packed);

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_INT4_DEQUANT_H_
