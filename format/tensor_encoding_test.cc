// tensor_encoding_test.cc: one-pass encoding against AppendEncoded: bit-identical
// bytes, checksums equal to XXH64 (or XXH3) of those bytes, bad values found
// where they are; the in-place check equals the identity encoding, and the
// piecewise checker equals one pass.
#include "format/tensor_encoding.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "format/encoding.h"
#include "format/test_values.h"
#include "kernels/bf16.h"

namespace hsx {
namespace {

using ::hsx::testing::Encoded;
using ::hsx::testing::TrickyValues;

TEST(TensorEncodingTest, BitIdenticalToAppendEncodedWithChecksum) {
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    for (size_t n : {size_t{1}, size_t{7}, size_t{4096}, size_t{4097}, size_t{3 * 4096 + 5}}) {
      const std::vector<float> values = TrickyValues(n, static_cast<uint32_t>(n));
      const std::string want = Encoded(values, dtype);
      std::string got(want.size(), '\0');
      const TensorFindings e = EncodeTensor(values.data(), ElementType::kF32, static_cast<int64_t>(n), dtype, got.data());
      ASSERT_EQ(e.bad_index, -1) << OutputDTypeName(dtype) << " n=" << n << " value " << e.bad_value;
      EXPECT_EQ(got, want) << OutputDTypeName(dtype) << " n=" << n;
      EXPECT_EQ(e.checksum, Xxh64(want.data(), want.size()));
      EXPECT_TRUE(e.nonzero);
    }
  }
}

TEST(TensorEncodingTest, Bf16SourceMatchesItsFloatValues) {
  // A bf16 capture (the BF16 engine's) encodes as its exact float32 values do.
  const std::vector<float> wide = TrickyValues(5000, 9);
  std::vector<uint16_t> bf16(wide.size());
  std::vector<float> exact(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) {
    bf16[i] = FloatToBf16(wide[i]);
    exact[i] = Bf16ToFloat(bf16[i]);
  }
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    const std::string want = Encoded(exact, dtype);
    std::string got(want.size(), '\0');
    const TensorFindings e = EncodeTensor(bf16.data(), ElementType::kBf16, 5000, dtype, got.data());
    ASSERT_EQ(e.bad_index, -1);
    EXPECT_EQ(got, want) << OutputDTypeName(dtype);
    EXPECT_EQ(e.checksum, Xxh64(want.data(), want.size()));
  }
}

TEST(TensorEncodingTest, FindsTheFirstBadValue) {
  std::vector<float> values(10000, 1.0f);
  std::string out(values.size() * 4, '\0');
  values[9000] = std::numeric_limits<float>::infinity();
  values[6001] = std::nanf("");
  TensorFindings e = EncodeTensor(values.data(), ElementType::kF32, 10000, OutputDType::kBf16, out.data());
  EXPECT_EQ(e.bad_index, 6001);
  EXPECT_TRUE(std::isnan(e.bad_value));
  values[6001] = 65519.0f;  // fits fp16 (rounds to 65504)
  e = EncodeTensor(values.data(), ElementType::kF32, 10000, OutputDType::kFp16, out.data());
  EXPECT_EQ(e.bad_index, 9000);
  values[9000] = 1.0f;
  values[7] = -65520.0f;  // rounds to fp16 -inf
  e = EncodeTensor(values.data(), ElementType::kF32, 10000, OutputDType::kFp16, out.data());
  EXPECT_EQ(e.bad_index, 7);
  EXPECT_EQ(e.bad_value, -65520.0f);
  e = EncodeTensor(values.data(), ElementType::kF32, 10000, OutputDType::kFp32, out.data());
  EXPECT_EQ(e.bad_index, -1);  // fine as fp32

  std::vector<uint16_t> bf16(5000, FloatToBf16(2.0f));
  bf16[4321] = 0x7f80;  // +inf
  e = EncodeTensor(bf16.data(), ElementType::kBf16, 5000, OutputDType::kBf16, out.data());
  EXPECT_EQ(e.bad_index, 4321);
}

// A float32 value that rounds to bf16's infinity is bad, as AppendEncoded's
// bytes (an infinity) would be; bf16's largest finite value is not.
TEST(TensorEncodingTest, AFloatThatRoundsToBf16InfinityIsBad) {
  std::vector<float> values(5000, 1.0f);
  std::string out(values.size() * 2, '\0');
  const uint32_t largest = 0x7f7f7fffu, rounds_up = 0x7f7f8000u;
  std::memcpy(&values[100], &largest, 4);
  TensorFindings e = EncodeTensor(values.data(), ElementType::kF32, 5000, OutputDType::kBf16, out.data());
  EXPECT_EQ(e.bad_index, -1);
  EXPECT_EQ(Encoded(values, OutputDType::kBf16), out);
  std::memcpy(&values[4000], &rounds_up, 4);
  values[4000] = -values[4000];
  e = EncodeTensor(values.data(), ElementType::kF32, 5000, OutputDType::kBf16, out.data());
  EXPECT_EQ(e.bad_index, 4000);
  EXPECT_TRUE(std::isfinite(e.bad_value));
  EXPECT_EQ(Encoded({values[4000]}, OutputDType::kBf16), std::string("\x80\xff", 2));  // -inf in bf16
}

TEST(TensorEncodingTest, SignedZerosAreZero) {
  std::vector<float> zeros(5000, 0.0f);
  for (size_t i = 0; i < zeros.size(); i += 3) zeros[i] = -0.0f;
  std::string out(zeros.size() * 4, '\0');
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    EXPECT_FALSE(EncodeTensor(zeros.data(), ElementType::kF32, 5000, dtype, out.data()).nonzero);
  }
  zeros[4999] = 1e-30f;
  EXPECT_TRUE(EncodeTensor(zeros.data(), ElementType::kF32, 5000, OutputDType::kFp32, out.data()).nonzero);
}

TEST(TensorEncodingTest, CheckTensorIsTheIdentityEncodingWithoutTheCopy) {
  // bf16 rows to bf16 and float32 rows to fp32: the same checks, digest and
  // verdicts as EncodeTensor, read in place.
  const std::vector<float> wide = TrickyValues(3 * 4096 + 5, 4);
  std::vector<uint16_t> bf16(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) bf16[i] = FloatToBf16(wide[i]);
  const int64_t n = static_cast<int64_t>(wide.size());
  std::string out(wide.size() * 4, '\0');
  for (int trial = 0; trial < 3; ++trial) {
    // 0: all fine; 1: a bad value late in a block; 2: all zero
    if (trial == 1) {
      bf16[2 * 4096 + 17] = 0xff80;  // -inf
      uint32_t nan = 0x7fc00001u;
      std::memcpy(const_cast<float*>(&wide[4096 + 3]), &nan, 4);
    }
    std::vector<uint16_t> b = trial == 2 ? std::vector<uint16_t>(bf16.size(), 0x8000) : bf16;
    std::vector<float> f = trial == 2 ? std::vector<float>(wide.size(), -0.0f) : wide;
    const TensorFindings want_b = EncodeTensor(b.data(), ElementType::kBf16, n, OutputDType::kBf16, out.data());
    const TensorFindings got_b = CheckTensor(b.data(), n, OutputDType::kBf16);
    const TensorFindings want_f = EncodeTensor(f.data(), ElementType::kF32, n, OutputDType::kFp32, out.data());
    const TensorFindings got_f = CheckTensor(f.data(), n, OutputDType::kFp32);
    for (auto [want, got] : {std::pair{want_b, got_b}, std::pair{want_f, got_f}}) {
      EXPECT_EQ(got.bad_index, want.bad_index) << "trial " << trial;
      EXPECT_EQ(got.nonzero, want.nonzero) << "trial " << trial;
      if (want.bad_index < 0) {
        EXPECT_EQ(got.checksum, want.checksum) << "trial " << trial;
      } else {
        EXPECT_EQ(std::isnan(got.bad_value), std::isnan(want.bad_value));
        if (!std::isnan(want.bad_value)) { EXPECT_EQ(got.bad_value, want.bad_value); }
      }
    }
    if (trial == 0) { EXPECT_EQ(got_b.checksum, Xxh64(b.data(), b.size() * 2)); }
    if (trial == 1) { EXPECT_EQ(got_b.bad_index, 2 * 4096 + 17); }
    if (trial == 1) { EXPECT_EQ(got_f.bad_index, 4096 + 3); }
    if (trial == 2) { EXPECT_FALSE(got_b.nonzero); }
  }
}

// The capture copy feeds a tensor's rows piece by piece: any cut gives what
// one pass gives, and a bad value is counted from the tensor's first.
TEST(TensorCheckerTest, PiecesGiveWhatOnePassGives) {
  const std::vector<float> wide = TrickyValues(3 * 4096 + 5, 9);
  std::vector<uint16_t> bf16(wide.size());
  for (size_t i = 0; i < wide.size(); ++i) bf16[i] = FloatToBf16(wide[i]);
  const int64_t n = static_cast<int64_t>(wide.size());
  std::mt19937 rng(3);
  for (const ChecksumKind kind : {ChecksumKind::kXxh64, ChecksumKind::kXxh3}) {
    for (const int64_t bad_at : {int64_t{-1}, int64_t{2 * 4096 + 17}}) {
      std::vector<uint16_t> b = bf16;
      std::vector<float> f = wide;
      if (bad_at >= 0) {
        b[bad_at] = 0x7fc1;  // NaN
        f[bad_at + 1] = -std::numeric_limits<float>::infinity();
      }
      const TensorFindings want_b = CheckTensor(b.data(), n, OutputDType::kBf16, kind);
      const TensorFindings want_f = CheckTensor(f.data(), n, OutputDType::kFp32, kind);
      for (int trial = 0; trial < 6; ++trial) {
        SCOPED_TRACE(::testing::Message() << ChecksumKindName(kind) << " bad at " << bad_at << " trial " << trial);
        TensorChecker checker_b(OutputDType::kBf16, kind);
        TensorChecker checker_f(RowCheck{OutputDType::kFp32, kind});
        for (int64_t at = 0; at < n;) {  // pieces of 1 value to a few blocks, some not a block's multiple
          const int64_t piece = std::min<int64_t>(n - at, trial == 0 ? 1 : 1 + rng() % (trial * 3000));
          checker_b.Update(b.data() + at, piece);
          checker_f.Update(f.data() + at, piece);
          at += piece;
        }
        for (auto [want, got] : {std::pair{want_b, checker_b.Finish()}, std::pair{want_f, checker_f.Finish()}}) {
          EXPECT_EQ(got.bad_index, want.bad_index);
          EXPECT_EQ(got.nonzero, want.nonzero);
          if (want.bad_index < 0) { EXPECT_EQ(got.checksum, want.checksum); }
        }
      }
      EXPECT_EQ(want_b.bad_index, bad_at);
      EXPECT_EQ(want_f.bad_index, bad_at < 0 ? -1 : bad_at + 1);
      if (bad_at >= 0) { EXPECT_EQ(want_f.bad_value, -std::numeric_limits<float>::infinity()); }
    }
  }
}

}  // namespace
}  // namespace hsx
