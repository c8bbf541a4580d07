// Tests the bf16 conversions and the INT4 reference against hand-computed values.
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/cpu/int4_dequant.h"

namespace hsx {
namespace {

TEST(Bf16, RoundsToNearestEven) {
  EXPECT_EQ(FloatToBf16(1.0f), 0x3f80);
  // 1 + 2^-8 is halfway between bf16(1) and the next value: ties to even (1).
  EXPECT_EQ(FloatToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3 * 2^-8 is halfway between odd 0x3f81 and even 0x3f82: rounds up.
  EXPECT_EQ(FloatToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(FloatToBf16(-2.0f), 0xc000);
  EXPECT_EQ(Bf16ToFloat(0x3f80), 1.0f);
  EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::quiet_NaN()))));
  EXPECT_TRUE(std::isinf(Bf16ToFloat(FloatToBf16(std::numeric_limits<float>::infinity()))));
}

TEST(Int4, LowNibbleIsElementZeroAndOffsetIsEight) {
  // Word 0x76543210: nibble i holds i, so q = i - 8.
  const int32_t packed[1] = {0x76543210};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(Int4At(packed, c), c - 8);
  const int32_t high[1] = {static_cast<int32_t>(0xFEDCBA98u)};
  for (int c = 0; c < 8; ++c) EXPECT_EQ(Int4At(high, c), c);
}

TEST(Int4, PackIsTheInverseOfUnpack) {
  std::mt19937 random(7);
  const int64_t rows = 5, cols = 64;
  std::vector<int8_t> values(rows * cols);
  for (int8_t& v : values) v = static_cast<int8_t>(static_cast<int>(random() % 16) - 8);
  std::vector<int32_t> packed(rows * cols / 8);
  PackInt4(values.data(), rows, cols, packed.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(Int4At(packed.data() + r * cols / 8, c), values[r * cols + c]) << r << "," << c;
    }
  }
}

TEST(Int4, DequantizesAsBf16OfProductWithGroupScale) {
  const int64_t rows = 2, cols = 64, group = 32;
  std::vector<int8_t> values(rows * cols);
  for (int64_t i = 0; i < rows * cols; ++i) values[i] = static_cast<int8_t>(i % 16 - 8);
  std::vector<int32_t> packed(rows * cols / 8);
  PackInt4(values.data(), rows, cols, packed.data());
  // Scales chosen so that q * scale needs rounding: 0.1 is not a bf16 value.
  const std::vector<uint16_t> scale = {FloatToBf16(0.1f), FloatToBf16(0.37f), FloatToBf16(1.5f),
                                       FloatToBf16(-0.003f)};
  std::vector<uint16_t> out(rows * cols);
  DequantizeInt4Rows(packed.data(), scale.data(), cols, group, 0, rows, out.data());
  std::vector<float> out_float(rows * cols);
  DequantizeInt4RowsToFloat(packed.data(), scale.data(), cols, group, 0, rows, out_float.data());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = Bf16ToFloat(scale[r * 2 + c / group]);
      const uint16_t expected = FloatToBf16(static_cast<float>(values[r * cols + c]) * s);
      ASSERT_EQ(out[r * cols + c], expected);
      ASSERT_EQ(out_float[r * cols + c], Bf16ToFloat(expected));
    }
  }
  // A row range starts at its own row.
  std::vector<uint16_t> second(cols);
  DequantizeInt4Rows(packed.data(), scale.data(), cols, group, 1, 2, second.data());
  EXPECT_EQ(std::vector<uint16_t>(out.begin() + cols, out.end()), second);
}

}  // namespace
}  // namespace hsx
