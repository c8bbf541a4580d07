// fp8_test.cc: the e4m3 conversion against a brute-force nearest-value search
// (ties to even), the scale rule (amax / 448, 1 for zeros, at least
// FLT_MIN), the row layout (scale, then values), the tensor encoder's
// findings and checksum, the in-place check of encoded rows (a backend's
// marked rows included), the receiver's NaN check, dequantisation and the
// split of rows into scales and values.
#include "format/fp8.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "format/encoding.h"
#include "kernels/bf16.h"

namespace hsx {
namespace {

uint64_t TensorHashOf(ChecksumKind kind, const std::string& bytes) {
  TensorHash hash(kind);
  hash.Update(bytes.data(), bytes.size());
  return hash.Digest();
}

// The e4m3 code nearest to x among the finite ones, ties to the even code
// (the one whose lowest mantissa bit is clear); |x| >= 448 gives +-448.
uint8_t NearestByValue(float x) {
  if (std::fabs(x) >= 448.0f) return x < 0 ? 0xfe : 0x7e;
  int best = -1;
  double best_d = INFINITY;
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f || ((b & 0x80) != 0) != std::signbit(x)) continue;
    const double d = std::fabs(static_cast<double>(Fp8E4m3ToFloat(static_cast<uint8_t>(b))) - x);
    if (d < best_d || (d == best_d && (b & 1) == 0)) {
      best = b;
      best_d = d;
    }
  }
  return static_cast<uint8_t>(best);
}

TEST(Fp8Test, KnownCodes) {
  EXPECT_EQ(Fp8E4m3ToFloat(0x7e), 448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0xfe), -448.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x38), 1.0f);
  EXPECT_EQ(Fp8E4m3ToFloat(0x08), std::ldexp(1.0f, -6));  // smallest normal
  EXPECT_EQ(Fp8E4m3ToFloat(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0x7f)));
  EXPECT_TRUE(std::isnan(Fp8E4m3ToFloat(0xff)));
  EXPECT_EQ(FloatToFp8E4m3(1.0625f), 0x38);  // a tie: to the even code
  EXPECT_EQ(FloatToFp8E4m3(1.1875f), 0x3a);
  EXPECT_EQ(FloatToFp8E4m3(460.0f), 0x7e);   // saturates
  EXPECT_EQ(FloatToFp8E4m3(-1e30f), 0xfe);
}

TEST(Fp8Test, EveryCodeRoundTripsExactly) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;
    const float v = Fp8E4m3ToFloat(static_cast<uint8_t>(b));
    if (v == 0) continue;  // -0 and +0 both fine
    EXPECT_EQ(FloatToFp8E4m3(v), b) << v;
  }
}

TEST(Fp8Test, RoundsToTheNearestCodeTiesToEven) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-14, 9.5);
  for (int i = 0; i < 20000; ++i) {
    const float x = std::exp2(exponent(rng)) * (rng() & 1 ? -1.0f : 1.0f);
    ASSERT_EQ(FloatToFp8E4m3(x), NearestByValue(x)) << x;
  }
  // Every midpoint between neighbouring codes.
  for (int b = 0; b < 0x7e; ++b) {
    const float mid = (Fp8E4m3ToFloat(static_cast<uint8_t>(b)) + Fp8E4m3ToFloat(static_cast<uint8_t>(b + 1))) / 2;
    ASSERT_EQ(FloatToFp8E4m3(mid), NearestByValue(mid)) << mid;
  }
}

TEST(Fp8Test, ScaleRule) {
  EXPECT_EQ(Fp8RowScale(0), 1.0f);     // a row of zeros
  EXPECT_EQ(Fp8RowScale(896), 2.0f);   // amax / 448
  EXPECT_EQ(Fp8RowScale(1e-44f), FLT_MIN);
  EXPECT_TRUE(ValidFp8Scale(FLT_MIN));
  for (float bad : {0.0f, -0.0f, -1.0f, INFINITY, -INFINITY, NAN, FLT_TRUE_MIN * 0}) EXPECT_FALSE(ValidFp8Scale(bad));
}

TEST(Fp8Test, RowLayoutAndError) {
  const std::vector<float> row = {-3.5f, 0.0f, 1e-3f, 896.0f, 100.25f, -0.0625f};
  std::string bytes;
  AppendEncoded(row, OutputDType::kFp8, &bytes);
  ASSERT_EQ(bytes.size(), row.size() + 4);
  float scale;
  std::memcpy(&scale, bytes.data(), 4);
  EXPECT_EQ(scale, 2.0f);
  EXPECT_EQ(static_cast<uint8_t>(bytes[4 + 3]), 0x7e);  // the largest value is 448 * scale
  const std::vector<float> back =
      DecodeValues(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
                   OutputDType::kFp8);
  ASSERT_EQ(back.size(), row.size());
  for (size_t i = 0; i < row.size(); ++i) {
    // 3 mantissa bits: within 2^-4 relative for normals, 2^-10 * scale below.
    EXPECT_LE(std::fabs(back[i] - row[i]), std::max(std::fabs(row[i]) / 16, std::ldexp(scale, -10))) << i;
  }
  std::string zeros;
  AppendEncoded(std::vector<float>(5, 0.0f), OutputDType::kFp8, &zeros);
  EXPECT_EQ(zeros, std::string("\x00\x00\x80\x3f", 4) + std::string(5, '\0'));  // scale 1.0f, then zeros
}

TEST(Fp8Test, TensorEncoderMatchesRowsChecksAndHashes) {
  const int64_t tokens = 3, hidden = 5;
  std::vector<uint16_t> rows;
  std::vector<float> wide;
  for (int64_t i = 0; i < tokens * hidden; ++i) {
    rows.push_back(FloatToBf16(static_cast<float>(i % 7) - 2.5f));
    wide.push_back(Bf16ToFloat(rows.back()));
  }
  std::string want;
  for (int64_t t = 0; t < tokens; ++t) {
    AppendEncoded(std::span<const float>(wide.data() + t * hidden, hidden), OutputDType::kFp8, &want);
  }
  std::string got(want.size(), '\0');
  const TensorFindings f = EncodeFp8Tensor(rows.data(), ElementType::kBf16, tokens, hidden, got.data(),
                                           ChecksumKind::kXxh64);
  EXPECT_EQ(got, want);
  EXPECT_EQ(f.checksum, Xxh64(want.data(), want.size()));
  EXPECT_EQ(f.bad_index, -1);
  EXPECT_TRUE(f.nonzero);
  std::string from_f32(want.size(), '\0');  // float32 rows (fp32 compute) give the same bytes
  const TensorFindings g = EncodeFp8Tensor(wide.data(), ElementType::kF32, tokens, hidden, from_f32.data(),
                                           ChecksumKind::kXxh3);
  EXPECT_EQ(from_f32, want);
  EXPECT_EQ(g.checksum, TensorHashOf(ChecksumKind::kXxh3, want));
  wide[4] = -INFINITY;
  EXPECT_EQ(EncodeFp8Tensor(wide.data(), ElementType::kF32, tokens, hidden, from_f32.data(), ChecksumKind::kXxh64)
                .bad_index, 4);
  rows[2 * hidden + 3] = 0x7fc0;  // NaN at row 2, column 3
  const TensorFindings bad = EncodeFp8Tensor(rows.data(), ElementType::kBf16, tokens, hidden, got.data(),
                                             ChecksumKind::kXxh64);
  EXPECT_EQ(bad.bad_index, 2 * hidden + 3);
  EXPECT_TRUE(std::isnan(bad.bad_value));
}

TEST(Fp8Test, DequantizeToBf16IsDecodeThenRound) {
  // Every code (NaN aside) under scales small, large and subnormal-making, in rows of 255.
  const int64_t hidden = 254;
  std::string rows;  // as sent: each row's scale, then its values
  std::vector<uint8_t> values;  // as the file holds them: the values, and the scales apart
  std::vector<float> scales;
  for (float scale : {1.0f, 0.0123f, 3.7e5f, 1e-37f}) {
    rows.append(reinterpret_cast<const char*>(&scale), 4);
    scales.push_back(scale);
    for (int b = 0; b < 256; ++b) {
      if ((b & 0x7f) != 0x7f) {
        rows.push_back(static_cast<char>(b));
        values.push_back(static_cast<uint8_t>(b));
      }
    }
  }
  const auto* bytes = reinterpret_cast<const uint8_t*>(rows.data());
  std::vector<uint16_t> got(4 * hidden);
  DequantizeFp8ToBf16(values.data(), scales.data(), 4, hidden, got.data());
  std::vector<float> want(hidden);
  for (int64_t r = 0; r < 4; ++r) {
    DecodeFp8Row(bytes + r * (hidden + 4), hidden, want.data());
    for (int64_t i = 0; i < hidden; ++i) ASSERT_EQ(got[r * hidden + i], FloatToBf16(want[i])) << r << " " << i;
  }
}

// Rows cut into pieces of every size (each piece walked on its own, from
// its position) come apart into exactly the rows' scales and values, each
// part within one row's scale or values, with its row and offset.
TEST(Fp8Test, RowPartsSplitRowsCutAnywhere) {
  const int64_t hidden = 5, rows = 4, row_bytes = hidden + kFp8ScaleBytes;
  std::string bytes;
  for (int i = 0; i < rows * row_bytes; ++i) bytes.push_back(static_cast<char>(i));
  for (size_t cut = 1; cut <= static_cast<size_t>(row_bytes) + 1; ++cut) {
    SCOPED_TRACE("pieces of " + std::to_string(cut));
    std::string scales, values;
    for (size_t at = 0; at < bytes.size(); at += cut) {
      const size_t n = std::min(cut, bytes.size() - at);
      ForEachFp8RowPart(static_cast<int64_t>(at), bytes.data() + at, n, hidden,
                        [&](int64_t row, int64_t in_row, const char* part, size_t size) {
                          const bool scale = in_row < kFp8ScaleBytes;
                          ASSERT_EQ(part - bytes.data(), row * row_bytes + in_row);
                          ASSERT_LE(in_row + static_cast<int64_t>(size), scale ? kFp8ScaleBytes : row_bytes);
                          (scale ? scales : values).append(part, size);
                        });
    }
    std::string want_scales, want_values;
    for (int64_t r = 0; r < rows; ++r) {
      want_scales.append(bytes, r * row_bytes, kFp8ScaleBytes);
      want_values.append(bytes, r * row_bytes + kFp8ScaleBytes, hidden);
    }
    EXPECT_EQ(scales, want_scales);
    EXPECT_EQ(values, want_values);
  }
}

uint32_t BitsOf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

// CheckFp8Tensor over rows encoded already gives what EncodeFp8Tensor gave
// while encoding them: the checksum, all-zero, and for rows a backend marked
// (kernels/fp8_e4m3.h: EncodeFp8RowScalar, the CPU backend's and the CUDA
// kernel's rule) the first non-finite value's index and bits. Scales and
// bytes no encoder writes are reported as they are.
TEST(Fp8Test, CheckingEncodedRowsGivesTheEncodersFindings) {
  const int64_t tokens = 6, hidden = 37;
  std::vector<float> values(tokens * hidden);
  for (size_t i = 0; i < values.size(); ++i) values[i] = std::sin(static_cast<float>(i)) * std::ldexp(1.0f, i % 9);
  const auto encode_marked = [&](const std::vector<float>& v) {
    std::string bytes(tokens * (hidden + kFp8ScaleBytes), '\0');
    for (int64_t t = 0; t < tokens; ++t) {
      EncodeFp8RowScalar([&](int64_t i) { return BitsOf(v[t * hidden + i]); }, hidden,
                         reinterpret_cast<uint8_t*>(bytes.data()) + t * (hidden + kFp8ScaleBytes));
    }
    return bytes;
  };
  for (ChecksumKind kind : {ChecksumKind::kXxh64, ChecksumKind::kXxh3}) {
    std::string encoded(tokens * (hidden + kFp8ScaleBytes), '\0');
    const TensorFindings want = EncodeFp8Tensor(values.data(), ElementType::kF32, tokens, hidden, encoded.data(), kind);
    EXPECT_EQ(encode_marked(values), encoded);  // the scalar rule writes the encoder's bytes
    const TensorFindings got = CheckFp8Tensor(encoded.data(), tokens, hidden, kind);
    EXPECT_EQ(got.checksum_kind, kind);
    EXPECT_EQ(got.checksum, want.checksum);
    EXPECT_TRUE(got.nonzero);
    EXPECT_EQ(got.bad_index, -1);
  }
  const std::vector<float> zeros(tokens * hidden, -0.0f);
  EXPECT_FALSE(CheckFp8Tensor(encode_marked(zeros).data(), tokens, hidden, ChecksumKind::kXxh64).nonzero);
  for (float bad : {INFINITY, -INFINITY, NAN, -NAN}) {
    std::vector<float> v = values;
    v[3 * hidden + 30] = bad;
    v[3 * hidden + 31] = INFINITY;  // a later one in the same row
    v[4 * hidden + 2] = NAN;        // and in a later row
    std::string scratch(tokens * (hidden + kFp8ScaleBytes), '\0');
    const TensorFindings want = EncodeFp8Tensor(v.data(), ElementType::kF32, tokens, hidden, scratch.data(),
                                                ChecksumKind::kXxh64);
    const std::string marked = encode_marked(v);
    EXPECT_EQ(marked.substr(3 * (hidden + 4), 4), std::string(reinterpret_cast<const char*>(&bad), 4));
    const TensorFindings got = CheckFp8Tensor(marked.data(), tokens, hidden, ChecksumKind::kXxh64);
    EXPECT_EQ(got.bad_index, want.bad_index) << bad;
    EXPECT_EQ(BitsOf(got.bad_value), BitsOf(want.bad_value)) << bad;
    EXPECT_FALSE(got.bad_scale);
  }
  std::string encoded(tokens * (hidden + kFp8ScaleBytes), '\0');
  EncodeFp8Tensor(values.data(), ElementType::kF32, tokens, hidden, encoded.data(), ChecksumKind::kXxh64);
  for (float scale : {0.0f, -2.0f, INFINITY, NAN}) {  // no NaN byte in the row: a bad scale
    std::string bytes = encoded;
    std::memcpy(bytes.data() + 2 * (hidden + 4), &scale, 4);
    const TensorFindings got = CheckFp8Tensor(bytes.data(), tokens, hidden, ChecksumKind::kXxh64);
    EXPECT_EQ(got.bad_index, 2 * hidden) << scale;
    EXPECT_TRUE(got.bad_scale) << scale;
    EXPECT_EQ(BitsOf(got.bad_value), BitsOf(scale));
  }
  std::string nan_byte = encoded;
  nan_byte[5 * (hidden + 4) + 4 + 9] = static_cast<char>(0xff);
  const TensorFindings got = CheckFp8Tensor(nan_byte.data(), tokens, hidden, ChecksumKind::kXxh64);
  EXPECT_EQ(got.bad_index, 5 * hidden + 9);
  EXPECT_TRUE(std::isnan(got.bad_value));
  EXPECT_FALSE(got.bad_scale);
}

TEST(Fp8Test, ReceiverFindsNaNBytes) {
  std::vector<uint8_t> bytes(100, 0x00);
  bool nonzero = false;
  EXPECT_EQ(CheckFp8Bytes(bytes.data(), 100, &nonzero), -1);
  EXPECT_FALSE(nonzero);
  bytes[10] = 0x80;  // -0
  EXPECT_EQ(CheckFp8Bytes(bytes.data(), 100, &nonzero), -1);
  EXPECT_FALSE(nonzero);
  bytes[20] = 0x01;
  bytes[60] = 0xff;
  bytes[70] = 0x7f;
  EXPECT_EQ(CheckFp8Bytes(bytes.data(), 100, &nonzero), 60);
  EXPECT_TRUE(nonzero);
}

// Every position of a vector step and of the tail (the check's loop has
// AVX-512 and AVX2 clones), in counts around a step's 64 bytes.
TEST(Fp8Test, ReceiverFindsANaNOrANonzeroByteAnywhere) {
  for (const int64_t count : {1, 63, 64, 65, 200}) {
    for (int64_t at = 0; at < count; ++at) {
      std::vector<uint8_t> bytes(count, 0x80);  // -0
      bytes[at] = 0x01;
      bool nonzero = false;
      EXPECT_EQ(CheckFp8Bytes(bytes.data(), count, &nonzero), -1) << count << " " << at;
      EXPECT_TRUE(nonzero) << count << " " << at;
      bytes[at] = (at % 2 == 0) ? 0x7f : 0xff;
      EXPECT_EQ(CheckFp8Bytes(bytes.data(), count, &nonzero), at) << count << " " << at;
    }
  }
}

}  // namespace
}  // namespace hsx
