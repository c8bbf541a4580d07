// int4_dequant.cc: CPU reference INT4 dequantization and packing.
#include "kernels/cpu/int4_dequant.h"

#include <cstring>

namespace hsx {

void DequantizeInt4Rows(const int32_t* packed, const uint16_t* scale, int64_t cols,
                        int64_t group_size, int64_t row_begin, int64_t row_end, uint16_t* out) {
  const int64_t words_per_row = cols / 8;
  const int64_t groups_per_row = cols / group_size;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int32_t* packed_row = packed + r * words_per_row;
    const uint16_t* scale_row = scale + r * groups_per_row;
    uint16_t* out_row = out + (r - row_begin) * cols;
    for (int64_t c = 0; c < cols; ++c) {
      out_row[c] = DequantInt4Element(packed_row, scale_row, c, group_size);
    }
  }
}

void DequantizeInt4RowsToFloat(const int32_t* packed, const uint16_t* scale, int64_t cols,
                               int64_t group_size, int64_t row_begin, int64_t row_end,
                               float* out) {
  // Same values as DequantInt4Element, organised by group so that the inner
  // loop has no division and vectorises: 8 nibbles per word, one scale per group.
  const int64_t words_per_row = cols / 8;
  const int64_t groups_per_row = cols / group_size;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint32_t* words = reinterpret_cast<const uint32_t*>(packed + r * words_per_row);
    const uint16_t* scale_row = scale + r * groups_per_row;
    float* out_row = out + (r - row_begin) * cols;
    for (int64_t g = 0; g < groups_per_row; ++g) {
      const float s = Bf16ToFloat(scale_row[g]);
      const int64_t begin = g * group_size;
      for (int64_t c = begin; c < begin + group_size; ++c) {
        const int q = static_cast<int>((words[c >> 3] >> (4 * (c & 7))) & 0xFu) - 8;
        // Round to nearest even bfloat16 without FloatToBf16's NaN branch, so
        // the loop vectorises. Equal to it for every finite product; a NaN
        // scale still yields NaN (or inf for a signalling NaN).
        uint32_t bits;
        const float product = static_cast<float>(q) * s;
        std::memcpy(&bits, &product, sizeof(bits));
        bits = (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
        std::memcpy(&out_row[c], &bits, sizeof(bits));
      }
    }
  }
}

void PackInt4(const int8_t* values, int64_t rows, int64_t cols, int32_t* packed) {
  const int64_t words_per_row = cols / 8;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t w = 0; w < words_per_row; ++w) {
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i) {
        const uint32_t nibble = static_cast<uint32_t>(values[r * cols + w * 8 + i] + 8) & 0xFu;
        word |= nibble << (4 * i);
      }
      packed[r * words_per_row + w] = static_cast<int32_t>(word);
    }
  }
}

}  // namespace hsx
