// encoding_test.cc: value encoding and digests, encode -> decode round trips.
#include "format/encoding.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace hsx {
namespace {

std::span<const uint8_t> Bytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

uint16_t Bits16(const std::string& s, size_t i) {
  uint16_t v;
  std::memcpy(&v, s.data() + 2 * i, 2);
  return v;
}

// Every finite 16-bit pattern decodes to a float that encodes back to the same
// pattern: decode is exact and encode is its inverse on representable values.
void ExpectEveryHalfPatternRoundTrips(OutputDType dtype, uint16_t exponent_mask) {
  std::string all;
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const uint16_t h = static_cast<uint16_t>(bits);
    if ((h & exponent_mask) == exponent_mask) continue;  // inf / NaN
    all.append(reinterpret_cast<const char*>(&h), 2);
  }
  const std::vector<float> values = DecodeValues(Bytes(all), dtype);
  ASSERT_EQ(values.size(), all.size() / 2);
  std::string again;
  AppendEncoded(values, dtype, &again);
  ASSERT_EQ(again.size(), all.size());
  for (size_t i = 0; i < values.size(); ++i) {
    ASSERT_EQ(Bits16(again, i), Bits16(all, i)) << OutputDTypeName(dtype) << " value " << values[i];
  }
}

TEST(EncodingTest, Bf16RoundTripsEveryFinitePattern) { ExpectEveryHalfPatternRoundTrips(OutputDType::kBf16, 0x7f80); }

TEST(EncodingTest, Fp16RoundTripsEveryFinitePattern) { ExpectEveryHalfPatternRoundTrips(OutputDType::kFp16, 0x7c00); }

TEST(EncodingTest, Fp32RoundTripsBitForBit) {
  const std::vector<float> values = {0.0f, -0.0f, 1.0f, -3.5f, 1e-40f, 3.4e38f, 0.1f};
  std::string bytes;
  AppendEncoded(values, OutputDType::kFp32, &bytes);
  ASSERT_EQ(bytes.size(), values.size() * 4);
  const std::vector<float> back = DecodeValues(Bytes(bytes), OutputDType::kFp32);
  ASSERT_EQ(back.size(), values.size());
  for (size_t i = 0; i < values.size(); ++i) EXPECT_EQ(std::memcmp(&back[i], &values[i], 4), 0) << i;
}

TEST(EncodingTest, KnownBitPatterns) {
  struct Case {
    float value;
    uint16_t bf16;
    uint16_t fp16;
  };
  const Case cases[] = {
      {1.0f, 0x3f80, 0x3c00},
      {-2.0f, 0xc000, 0xc000},
      {0.0f, 0x0000, 0x0000},
      {std::ldexp(1.0f, -24), 0x3380, 0x0001},  // fp16's smallest subnormal
      {65504.0f, 0x4780, 0x7bff},               // fp16's largest finite; bf16 rounds up
  };
  for (const Case& c : cases) {
    std::string bf16;
    std::string fp16;
    AppendEncoded(std::span<const float>(&c.value, 1), OutputDType::kBf16, &bf16);
    AppendEncoded(std::span<const float>(&c.value, 1), OutputDType::kFp16, &fp16);
    EXPECT_EQ(Bits16(bf16, 0), c.bf16) << c.value;
    EXPECT_EQ(Bits16(fp16, 0), c.fp16) << c.value;
  }
}

TEST(EncodingTest, RoundsToNearestEven) {
  // 1 + 2^-8 lies halfway between bf16 1.0 and 1 + 2^-7: ties go to the even 1.0;
  // 1 + 3 * 2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: to the even 1 + 2^-6.
  const float values[] = {1.0f + std::ldexp(1.0f, -8), 1.0f + 3 * std::ldexp(1.0f, -8)};
  std::string bf16;
  AppendEncoded(values, OutputDType::kBf16, &bf16);
  EXPECT_EQ(Bits16(bf16, 0), 0x3f80);
  EXPECT_EQ(Bits16(bf16, 1), 0x3f82);
  // fp16: 1 + 2^-11 is halfway between 1.0 and 1 + 2^-10.
  const float half_tie = 1.0f + std::ldexp(1.0f, -11);
  std::string fp16;
  AppendEncoded(std::span<const float>(&half_tie, 1), OutputDType::kFp16, &fp16);
  EXPECT_EQ(Bits16(fp16, 0), 0x3c00);
}

TEST(EncodingTest, DTypeNamesParseBack) {
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    absl::StatusOr<OutputDType> parsed = ParseOutputDType(OutputDTypeName(dtype));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, dtype);
    EXPECT_EQ(DTypeSize(ToSafetensorsDType(dtype)), OutputDTypeSize(dtype));
  }
  EXPECT_FALSE(ParseOutputDType("int8").ok());
}

TEST(DigestTest, Xxh64OfKnownInputs) {
  // XXH64 (seed 0) of the empty input, from the reference implementation.
  EXPECT_EQ(Xxh64("", 0), 0xef46db3751d8e999ull);
  EXPECT_EQ(Xxh64Hex("", 0), "ef46db3751d8e999");
}

TEST(DigestTest, TokenHashIsOverLittleEndianInt64) {
  const std::vector<int32_t> ids = {1, -2, 70000};
  const std::vector<int64_t> wide = {1, -2, 70000};
  EXPECT_EQ(TokenIdsHash(ids), Xxh64(wide.data(), wide.size() * 8));
  const std::vector<int32_t> other = {1, -2, 70001};
  EXPECT_NE(TokenIdsHash(ids), TokenIdsHash(other));
}

}  // namespace
}  // namespace hsx
