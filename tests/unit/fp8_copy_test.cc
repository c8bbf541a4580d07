// fp8_copy_test.cc: the CPU backend's CopyToHostFp8 (kernels/backend.h)
// writes exactly the bytes the host encoder writes (format/fp8.h,
// EncodeFp8Tensor, the streaming path's and the capture sink's), for bf16 and
// f32 rows of several widths (one not a multiple of 16, one of Kimi-K2's
// 7168), strided sources, a row of zeros, rows of tiny and huge values; and a
// row holding a non-finite value comes out marked (its scale that value,
// 0x7f where it was, 0 elsewhere) without disturbing the rows around it, so
// that CheckFp8Tensor finds what the host encoder finds in the same rows.
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "format/fp8.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/fp8_e4m3.h"

namespace hsx {
namespace {

constexpr int64_t kRows = 7;

// kRows rows of `hidden` float32 values: normal values of growing magnitude,
// row 2 all zeros, row 4 tiny (the FLT_MIN scale), row 5 near float32's top.
std::vector<float> TestRows(int64_t hidden, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> v(kRows * hidden);
  for (int64_t t = 0; t < kRows; ++t) {
    const float magnitude = t == 4 ? 1e-42f : t == 5 ? 1e37f : std::ldexp(1.0f, static_cast<int>(6 * t) - 12);
    for (int64_t i = 0; i < hidden; ++i) v[t * hidden + i] = t == 2 ? 0.0f : normal(rng) * magnitude;
  }
  return v;
}

// The rows as a [kRows, hidden] matrix of `type` in a backend buffer with a
// row stride of hidden + 3 (a column slice), and packed on the host.
struct Source {
  std::unique_ptr<Buffer> buffer;
  Matrix rows;
  std::string packed;
};

Source MakeSource(Backend& backend, ElementType type, const std::vector<float>& values, int64_t hidden) {
  Source s;
  s.buffer = *backend.Allocate(kRows, hidden + 3, type);
  s.rows = s.buffer->matrix().Cols(1, hidden);
  for (int64_t t = 0; t < kRows; ++t) {
    for (int64_t i = 0; i < hidden; ++i) {
      const float v = values[t * hidden + i];
      if (type == ElementType::kBf16) {
        const uint16_t b = FloatToBf16(v);
        std::memcpy(s.rows.at(t, i), &b, 2);
        s.packed.append(reinterpret_cast<const char*>(&b), 2);
      } else {
        std::memcpy(s.rows.at(t, i), &v, 4);
        s.packed.append(reinterpret_cast<const char*>(&v), 4);
      }
    }
  }
  return s;
}

std::string CopyFp8(Backend& backend, const Matrix& rows) {
  std::string out(rows.rows * (rows.cols + kFp8ScaleBytes) + 8, '\xcc');  // guard bytes after the rows
  backend.CopyToHostFp8(rows, out.data());
  EXPECT_TRUE(backend.Synchronize().ok());
  EXPECT_EQ(out.substr(out.size() - 8), std::string(8, '\xcc')) << "wrote past the rows";
  out.resize(out.size() - 8);
  return out;
}

const char* Name(ElementType type) { return type == ElementType::kBf16 ? "bf16" : "f32"; }

TEST(CpuCopyToHostFp8, WritesTheHostEncodersBytes) {
  for (ElementType type : {ElementType::kBf16, ElementType::kF32}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(type, 1);
    for (int64_t hidden : {1, 7, 16, 24, 45, 7168}) {
      SCOPED_TRACE(::testing::Message() << Name(type) << " hidden " << hidden);
      Source src = MakeSource(*backend, type, TestRows(hidden, static_cast<uint32_t>(hidden)), hidden);
      const std::string got = CopyFp8(*backend, src.rows);
      std::string want(got.size(), '\0');
      const TensorFindings found =
          EncodeFp8Tensor(src.packed.data(), type, kRows, hidden, want.data(), ChecksumKind::kXxh3);
      ASSERT_EQ(found.bad_index, -1);
      EXPECT_TRUE(got == want);
      const TensorFindings checked = CheckFp8Tensor(got.data(), kRows, hidden, ChecksumKind::kXxh3);
      EXPECT_EQ(checked.checksum, found.checksum);
      EXPECT_EQ(checked.bad_index, -1);
      float zero_row_scale;
      std::memcpy(&zero_row_scale, got.data() + 2 * (hidden + 4), 4);
      EXPECT_EQ(zero_row_scale, 1.0f);
      // Any sub-range of rows, as Model::Run copies one sample at a time.
      EXPECT_EQ(CopyFp8(*backend, src.rows.Rows(3, 2)), got.substr(3 * (hidden + 4), 2 * (hidden + 4)));
    }
  }
}

TEST(CpuCopyToHostFp8, MarksARowWithANonFiniteValue) {
  const int64_t hidden = 45;
  const float inf = std::numeric_limits<float>::infinity();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (ElementType type : {ElementType::kBf16, ElementType::kF32}) {
    std::unique_ptr<Backend> backend = MakeCpuBackend(type, 1);
    for (float bad : {inf, -inf, nan}) {
      SCOPED_TRACE(::testing::Message() << Name(type) << " " << bad);
      std::vector<float> values = TestRows(hidden, 3);
      values[3 * hidden + 17] = bad;
      values[3 * hidden + 40] = nan;
      Source src = MakeSource(*backend, type, values, hidden);
      const std::string got = CopyFp8(*backend, src.rows);
      // The other rows: the host encoder's bytes.
      std::vector<float> fine = values;
      fine[3 * hidden + 17] = fine[3 * hidden + 40] = 1.0f;
      Source fine_src = MakeSource(*backend, type, fine, hidden);
      const std::string want = CopyFp8(*backend, fine_src.rows);
      const int64_t row = hidden + kFp8ScaleBytes;
      EXPECT_EQ(got.substr(0, 3 * row), want.substr(0, 3 * row));
      EXPECT_EQ(got.substr(4 * row), want.substr(4 * row));
      // Row 3: its scale is the first non-finite value (as the source held it), then 0x7f where one was.
      uint32_t scale_bits, bad_bits;
      std::memcpy(&scale_bits, got.data() + 3 * row, 4);
      if (type == ElementType::kBf16) {
        bad_bits = uint32_t{FloatToBf16(bad)} << 16;
      } else {
        std::memcpy(&bad_bits, &bad, 4);
      }
      EXPECT_EQ(scale_bits, bad_bits);
      std::string bytes(hidden, '\0');
      bytes[17] = bytes[40] = static_cast<char>(kFp8NanByte);
      EXPECT_EQ(got.substr(3 * row + 4, hidden), bytes);
      // Checked in place it gives what the host encoder finds before encoding.
      std::string scratch(got.size(), '\0');
      const TensorFindings want_found =
          EncodeFp8Tensor(src.packed.data(), type, kRows, hidden, scratch.data(), ChecksumKind::kXxh64);
      const TensorFindings found = CheckFp8Tensor(got.data(), kRows, hidden, ChecksumKind::kXxh64);
      EXPECT_EQ(found.bad_index, 3 * hidden + 17);
      EXPECT_EQ(found.bad_index, want_found.bad_index);
      EXPECT_EQ(std::memcmp(&found.bad_value, &want_found.bad_value, 4), 0);
      EXPECT_FALSE(found.bad_scale);
    }
  }
}

}  // namespace
}  // namespace hsx
