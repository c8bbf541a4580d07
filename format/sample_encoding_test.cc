// sample_encoding_test.cc: EncodeSample's one choice. Rows already in the
// output dtype whose owner holds only them are used where they are, checked
// in place unless their findings were made with the asked checksum; any other
// rows are encoded into one new buffer; either way every tensor leaves with
// findings equal to EncodeTensor's over the rows, and the bytes are
// AppendEncoded's.
#include "format/sample_encoding.h"

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <xxhash.h>

#include "format/tensor_encoding.h"
#include "format/test_values.h"
#include "kernels/bf16.h"

namespace hsx {
namespace {

using ::hsx::testing::Encoded;
using ::hsx::testing::HeapBuffers;
using ::hsx::testing::TrickyValues;

constexpr int64_t kTokens = 6, kHidden = 40;

// Two layers and the final norm as bf16 rows, [tensor][T][H] in one block
// that the sample owns (as the engine's per-sample buffer).
SampleTensors Bf16Rows(std::vector<std::vector<float>>* floats) {
  auto block = std::make_shared<std::vector<uint16_t>>();
  for (int k = 0; k < 3; ++k) {
    floats->push_back(TrickyValues(kTokens * kHidden, 7 + k));
    for (float& v : floats->back()) v = Bf16ToFloat(FloatToBf16(v));  // exactly bf16 values
    for (float v : floats->back()) block->push_back(FloatToBf16(v));
  }
  SampleTensors rows;
  rows.capture_ids = {1, 3};
  rows.tokens = kTokens;
  rows.hidden = kHidden;
  rows.dtype = OutputDType::kBf16;
  for (int k = 0; k < 3; ++k) rows.AddTensor(k < 2 ? rows.capture_ids[k] : -1, block->data() + k * kTokens * kHidden);
  rows.held_bytes = static_cast<int64_t>(block->size() * 2);
  rows.owner = block;
  return rows;
}

TEST(EncodeSampleTest, RowsInTheOutputDtypeHeldAloneAreUsedWhereTheyAre) {
  std::vector<std::vector<float>> floats;
  const SampleTensors rows = Bf16Rows(&floats);
  int allocations = 0;
  absl::StatusOr<SampleTensors> sample = EncodeSample(rows, OutputDType::kBf16, ChecksumKind::kXxh3,
                                                      HeapBuffers(&allocations));
  ASSERT_TRUE(sample.ok()) << sample.status();
  EXPECT_EQ(allocations, 0);
  EXPECT_EQ(sample->owner, rows.owner);
  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE(k);
    EXPECT_EQ(sample->tensors[k].pieces[0].data(), rows.tensors[k].pieces[0].data());
    const std::string want = Encoded(floats[k], OutputDType::kBf16);
    ASSERT_TRUE(sample->tensors[k].findings.has_value());
    EXPECT_EQ(sample->tensors[k].findings->checksum_kind, ChecksumKind::kXxh3);
    EXPECT_EQ(sample->tensors[k].findings->checksum, XXH3_64bits(want.data(), want.size()));
    EXPECT_EQ(TensorString(sample->tensors[k]), want);
  }
}

TEST(EncodeSampleTest, OtherRowsAreEncodedIntoOneNewBuffer) {
  std::vector<std::vector<float>> floats;
  SampleTensors shared = Bf16Rows(&floats);
  shared.held_bytes += 1;  // the owner keeps more than these rows
  for (const OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    for (const bool held_alone : {false, true}) {
      if (dtype == OutputDType::kBf16 && held_alone) continue;  // used in place (above)
      SCOPED_TRACE(OutputDTypeName(dtype) + (held_alone ? " held alone" : " shared"));
      std::vector<std::vector<float>> unused;
      const SampleTensors rows = held_alone ? Bf16Rows(&unused) : shared;
      int allocations = 0;
      absl::StatusOr<SampleTensors> sample = EncodeSample(rows, dtype, ChecksumKind::kXxh64, HeapBuffers(&allocations));
      ASSERT_TRUE(sample.ok()) << sample.status();
      EXPECT_EQ(allocations, 1);
      EXPECT_EQ(sample->dtype, dtype);
      EXPECT_NE(sample->owner, rows.owner);
      EXPECT_EQ(sample->held_bytes, 3 * kTokens * kHidden * OutputDTypeSize(dtype));
      for (int k = 0; k < 3; ++k) {
        const std::string want = Encoded(floats[k], dtype);
        EXPECT_EQ(TensorString(sample->tensors[k]), want) << k;
        EXPECT_EQ(sample->tensors[k].capture_id, rows.tensors[k].capture_id);
        EXPECT_EQ(sample->tensors[k].findings->checksum, Xxh64(want.data(), want.size())) << k;
      }
    }
  }
}

// Findings made with the asked checksum stand for the in-place pass; others
// are made again.
TEST(EncodeSampleTest, FindingsWithTheAskedChecksumStand) {
  std::vector<std::vector<float>> floats;
  SampleTensors rows = Bf16Rows(&floats);
  for (SampleTensor& tensor : rows.tensors) tensor.findings = TensorFindings{.checksum_kind = ChecksumKind::kXxh64,
                                                                             .checksum = 42, .nonzero = true};
  absl::StatusOr<SampleTensors> kept = EncodeSample(rows, OutputDType::kBf16, ChecksumKind::kXxh64, HeapBuffers());
  absl::StatusOr<SampleTensors> redone = EncodeSample(rows, OutputDType::kBf16, ChecksumKind::kXxh3, HeapBuffers());
  ASSERT_TRUE(kept.ok() && redone.ok());
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(kept->tensors[k].findings->checksum, 42u);
    const std::string bytes = TensorString(rows.tensors[k]);
    EXPECT_EQ(redone->tensors[k].findings->checksum, XXH3_64bits(bytes.data(), bytes.size()));
  }
}

TEST(EncodeSampleTest, RowsItCannotReadAreRefused) {
  std::vector<std::vector<float>> floats;
  SampleTensors split = Bf16Rows(&floats);
  const BytePiece whole = split.tensors[1].pieces[0];
  split.tensors[1].pieces = {whole.subspan(0, 10), whole.subspan(10)};
  EXPECT_EQ(EncodeSample(split, OutputDType::kFp32, ChecksumKind::kXxh64, HeapBuffers()).status().code(),
            absl::StatusCode::kInternal);
  SampleTensors fp16 = Bf16Rows(&floats);
  fp16.dtype = OutputDType::kFp16;
  fp16.held_bytes += 1;
  EXPECT_EQ(EncodeSample(fp16, OutputDType::kBf16, ChecksumKind::kXxh64, HeapBuffers()).status().code(),
            absl::StatusCode::kInternal);
}

}  // namespace
}  // namespace hsx
