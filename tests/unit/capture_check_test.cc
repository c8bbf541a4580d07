// capture_check_test.cc: the capture check's fp8 encoding (CaptureCheck::
// EncodeFp8). Fed the rows piece by piece as the CPU engine's capture copy
// writes them, it hands the sample on as exactly the fp8 bytes and findings
// EncodeSample gives over the same rows (the old path, the streaming thread's
// encoding), only the tensors the sample asked for; EncodeSample then takes
// them in place, allocating nothing. Pieces that are not whole rows, rows not
// all fed, a failed allocation, or a sample not asked for fp8 leave the sample
// as it was (its consumer encodes it).
#include "server/runtime/capture_check.h"

#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "gtest/gtest.h"
#include "format/capture_spec.h"
#include "format/sample_encoding.h"
#include "format/test_values.h"
#include "kernels/bf16.h"
#include "format/test_files.h"
#include "server/model/capture_views.h"
#include "server/model/checkpoint.h"
#include "server/model/random_model.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"

namespace hsx {
namespace {

using ::hsx::testing::HeapBuffers;
using ::hsx::testing::TempDir;
using ::hsx::testing::TrickyValues;

constexpr int kLayers = 6;
constexpr int64_t kHidden = 24;

// One sample's captured rows as the engine leaves them: `tensors` tensors of
// `tokens` rows each, in one buffer the sample owns.
SampleTensors CapturedRows(ElementType type, const CaptureSpec& batch, int64_t tokens, uint32_t seed) {
  const size_t tensors = batch.ids().size() + (batch.final_norm() ? 1 : 0);
  std::vector<float> values = TrickyValues(tensors * tokens * kHidden, seed);
  for (float& v : values) v = std::min(std::max(v, -1e30f), 1e30f);
  auto block = std::make_shared<std::string>();
  for (float v : values) {
    if (type == ElementType::kBf16) {
      const uint16_t b = FloatToBf16(v);
      block->append(reinterpret_cast<const char*>(&b), 2);
    } else {
      block->append(reinterpret_cast<const char*>(&v), 4);
    }
  }
  SampleTensors rows;
  rows.capture_ids = batch.ids();
  rows.tokens = tokens;
  rows.hidden = kHidden;
  rows.dtype = DTypeOfRows(type);
  const int64_t tensor_bytes = tokens * rows.row_bytes();
  for (size_t k = 0; k < tensors; ++k) {
    rows.AddTensor(k < batch.ids().size() ? batch.ids()[k] : -1, block->data() + k * tensor_bytes);
  }
  rows.held_bytes = static_cast<int64_t>(block->size());
  rows.owner = block;
  return rows;
}

// Feeds every tensor of `rows` to `check` as sample `s`, `piece_rows` rows a piece.
void Feed(CaptureCheck& check, int64_t s, const SampleTensors& rows, int64_t piece_rows) {
  for (size_t k = 0; k < rows.tensors.size(); ++k) {
    const char* data = reinterpret_cast<const char*>(rows.tensors[k].pieces[0].data());
    for (int64_t r = 0; r < rows.tokens; r += piece_rows) {
      const int64_t n = std::min(piece_rows, rows.tokens - r);
      check.Written(s, k, data + r * rows.row_bytes(), n * kHidden);
    }
  }
}

// What the streaming thread sends for `rows` (the old path).
SampleTensors OldPath(const SampleTensors& rows, const CaptureSpec& wanted, ChecksumKind checksum) {
  absl::StatusOr<SampleTensors> encoded =
      EncodeSample(SelectCaptures(rows, wanted), OutputDType::kFp8, checksum, HeapBuffers());
  EXPECT_TRUE(encoded.ok()) << encoded.status();
  return *std::move(encoded);
}

void ExpectSame(const SampleTensors& got, const SampleTensors& want) {
  ASSERT_EQ(got.dtype, OutputDType::kFp8);
  ASSERT_EQ(got.capture_ids, want.capture_ids);
  ASSERT_EQ(got.tensors.size(), want.tensors.size());
  for (size_t k = 0; k < got.tensors.size(); ++k) {
    SCOPED_TRACE(::testing::Message() << "tensor " << k);
    EXPECT_EQ(got.tensors[k].capture_id, want.tensors[k].capture_id);
    ASSERT_TRUE(got.tensors[k].findings.has_value());
    const TensorFindings& g = *got.tensors[k].findings;
    const TensorFindings& w = *want.tensors[k].findings;
    EXPECT_EQ(g.checksum_kind, w.checksum_kind);
    EXPECT_EQ(g.bad_index, w.bad_index);
    if (w.bad_index >= 0) continue;  // the sample fails; the bytes after it are not sent
    EXPECT_EQ(g.checksum, w.checksum);
    EXPECT_EQ(g.nonzero, w.nonzero);
    EXPECT_EQ(TensorString(got.tensors[k]), TensorString(want.tensors[k]));
  }
}

TEST(CaptureCheckFp8, EncodesThePiecesIntoTheBytesTheStreamingPathSends) {
  const CaptureSpec batch = *CaptureSpec::Make({1, 2, 4, 6}, true, kLayers);
  const std::vector<CaptureSpec> wanted = {*CaptureSpec::Make({2, 6}, true, kLayers),
                                           *CaptureSpec::Make({1, 2, 4, 6}, false, kLayers),
                                           *CaptureSpec::Make({4}, true, kLayers)};
  const std::vector<int64_t> tokens = {7, 1, 33};
  for (const ElementType type : {ElementType::kBf16, ElementType::kF32}) {
    for (const int64_t piece_rows : {int64_t{1}, int64_t{5}, int64_t{64}}) {
      SCOPED_TRACE(::testing::Message() << (type == ElementType::kBf16 ? "bf16" : "f32") << " pieces of "
                                        << piece_rows);
      const std::vector<std::optional<RowCheck>> checks = {RowCheck{OutputDType::kFp8, ChecksumKind::kXxh3},
                                                           RowCheck{OutputDType::kFp8, ChecksumKind::kXxh64},
                                                           RowCheck{OutputDType::kFp8, ChecksumKind::kXxh3}};
      CaptureCheck check(checks, type, 5, {7 * kHidden, kHidden, 33 * kHidden});
      int allocations = 0;
      std::vector<SampleTensors> rows;
      for (int64_t s = 0; s < 3; ++s) {
        check.EncodeFp8(s, batch, wanted[s], tokens[s], kHidden, HeapBuffers(&allocations));
        rows.push_back(CapturedRows(type, batch, tokens[s], static_cast<uint32_t>(11 + s)));
        Feed(check, s, rows[s], piece_rows);
      }
      EXPECT_EQ(allocations, 3);  // one buffer per sample
      for (int64_t s = 0; s < 3; ++s) {
        SCOPED_TRACE(::testing::Message() << "sample " << s);
        SampleTensors sample = rows[s];
        check.AttachFindings(s, sample);
        SampleTensors selected = SelectCaptures(std::move(sample), wanted[s]);
        ExpectSame(selected, OldPath(rows[s], wanted[s], checks[s]->checksum));
        int more = 0;
        absl::StatusOr<SampleTensors> sent =
            EncodeSample(selected, OutputDType::kFp8, checks[s]->checksum, HeapBuffers(&more));
        ASSERT_TRUE(sent.ok()) << sent.status();
        EXPECT_EQ(more, 0) << "EncodeSample encoded again";
        ExpectSame(*sent, selected);
      }
    }
  }
}

// A non-finite value: the same first bad value as the streaming path finds
// (the sample then fails there), counted from the tensor's first value.
TEST(CaptureCheckFp8, FindsTheFirstNonFiniteValueAsTheStreamingPathDoes) {
  const CaptureSpec batch = *CaptureSpec::Make({0, 3}, true, kLayers);
  const std::vector<std::optional<RowCheck>> checks = {RowCheck{OutputDType::kFp8, ChecksumKind::kXxh64}};
  SampleTensors rows = CapturedRows(ElementType::kF32, batch, 9, 5);
  float* tensor1 = reinterpret_cast<float*>(const_cast<uint8_t*>(rows.tensors[1].pieces[0].data()));
  tensor1[6 * kHidden + 5] = std::numeric_limits<float>::infinity();
  tensor1[7 * kHidden + 1] = std::numeric_limits<float>::quiet_NaN();
  CaptureCheck check(checks, ElementType::kF32, 3, {9 * kHidden});
  check.EncodeFp8(0, batch, batch, 9, kHidden, HeapBuffers());
  Feed(check, 0, rows, 4);
  SampleTensors sample = rows;
  check.AttachFindings(0, sample);
  ASSERT_EQ(sample.dtype, OutputDType::kFp8);
  EXPECT_EQ(sample.tensors[1].findings->bad_index, 6 * kHidden + 5);
  ExpectSame(sample, OldPath(rows, batch, ChecksumKind::kXxh64));
}

// Whatever keeps the sink from encoding the whole sample leaves it as the
// engine captured it, without findings: its consumer encodes it.
TEST(CaptureCheckFp8, LeavesTheSampleToItsConsumerWhenItCannotEncodeItAll) {
  const CaptureSpec batch = *CaptureSpec::Make({2, 5}, false, kLayers);
  const SampleTensors rows = CapturedRows(ElementType::kBf16, batch, 6, 3);
  const std::vector<std::optional<RowCheck>> fp8 = {RowCheck{OutputDType::kFp8, ChecksumKind::kXxh64}};
  const auto failing = [](size_t) -> absl::StatusOr<std::unique_ptr<HostBuffer>> {
    return absl::ResourceExhaustedError("no memory");
  };
  for (const std::string_view how :
       {"half rows", "a row too many", "a tensor not fed", "no buffer", "not asked to encode", "bf16"}) {
    SCOPED_TRACE(how);
    const std::vector<std::optional<RowCheck>> checks =
        how == "bf16" ? std::vector<std::optional<RowCheck>>{RowCheck{OutputDType::kBf16, ChecksumKind::kXxh64}}
                      : fp8;
    CaptureCheck check(checks, ElementType::kBf16, 2, {6 * kHidden});
    if (how != "not asked to encode") {
      check.EncodeFp8(0, batch, batch, 6, kHidden, how == "no buffer" ? BufferAllocator(failing) : HeapBuffers());
    }
    if (how == "half rows") {
      const char* data = reinterpret_cast<const char*>(rows.tensors[0].pieces[0].data());
      check.Written(0, 0, data, kHidden / 2);
      check.Written(0, 0, data + kHidden, 6 * kHidden - kHidden / 2);
      check.Written(0, 1, rows.tensors[1].pieces[0].data(), 6 * kHidden);
    } else if (how == "a row too many") {
      Feed(check, 0, rows, 6);
      check.Written(0, 1, rows.tensors[1].pieces[0].data(), kHidden);  // a seventh row
    } else if (how == "a tensor not fed") {
      check.Written(0, 0, rows.tensors[0].pieces[0].data(), 6 * kHidden);
    } else {
      Feed(check, 0, rows, 2);
    }
    SampleTensors sample = rows;
    check.AttachFindings(0, sample);
    if (how == "bf16") {  // checked, not encoded
      EXPECT_EQ(sample.dtype, OutputDType::kBf16);
      EXPECT_TRUE(sample.tensors[0].findings.has_value());
      continue;
    }
    EXPECT_EQ(sample.dtype, OutputDType::kBf16);
    EXPECT_EQ(sample.owner, rows.owner);
    for (const SampleTensor& tensor : sample.tensors) EXPECT_FALSE(tensor.findings.has_value());
  }
}

// The samples of `lengths` tokens (token t of sample i: 1 + (7 i + t) % 50),
// each submitted twice, as they reach their consumer: [i][0] with a buffer to
// encode fp8 into, [i][1] without, each asking for `wanted[i]` in fp8.
std::vector<std::vector<SampleTensors>> Delivered(Batcher& batcher, const std::vector<int64_t>& lengths,
                                                  const std::vector<CaptureSpec>& wanted) {
  std::mutex mutex;
  std::condition_variable done;
  std::vector<std::vector<SampleTensors>> got(lengths.size(), std::vector<SampleTensors>(2));
  size_t delivered = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (int with_buffer : {1, 0}) {
      WorkItem item;
      for (int64_t t = 0; t < lengths[i]; ++t) item.tokens.push_back(static_cast<int32_t>(1 + (7 * i + t) % 50));
      item.capture = wanted[i];
      item.row_check = RowCheck{OutputDType::kFp8, i % 2 ? ChecksumKind::kXxh64 : ChecksumKind::kXxh3};
      if (with_buffer) item.encode_buffer = HeapBuffers();
      item.deliver = [&, i, with_buffer](absl::StatusOr<SampleTensors> rows) {
        EXPECT_TRUE(rows.ok()) << rows.status();
        std::lock_guard<std::mutex> lock(mutex);
        if (rows.ok()) got[i][1 - with_buffer] = *std::move(rows);
        ++delivered;
        done.notify_all();
      };
      EXPECT_TRUE(batcher.Submit(std::move(item)).ok());
    }
  }
  std::unique_lock<std::mutex> lock(mutex);
  if (!done.wait_for(lock, std::chrono::seconds(60), [&] { return delivered == 2 * lengths.size(); })) {
    ADD_FAILURE() << "samples were never delivered";
    std::abort();
  }
  return got;
}

// Through the batcher on the CPU engine, whose copy tells the sink of each
// 128 KiB piece: samples of several capture sets in one batch, one long
// enough for several pieces and a partial one. Each sample whose consumer gave
// a buffer arrives as fp8 rows with findings, which EncodeSample sends as they
// are, allocating nothing: the bytes and findings it gives for the same
// sample delivered without a buffer (the streaming path's encoding).
TEST(CaptureCheckFp8, TheBatcherDeliversTheRowsTheStreamingPathWouldSend) {
  TempDir dir;
  ModelConfig config = *PresetConfig("tiny");
  config.num_hidden_layers = 3;
  ASSERT_TRUE(WriteRandomCheckpoint(config, dir / "m", GeneratorOptions{}).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir / "m");
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const int64_t long_sample = 5 * (int64_t{128} << 10) / (config.hidden_size * 2) / 2 + 3;
  const std::vector<int64_t> lengths = {7, 3, long_sample};
  const std::vector<CaptureSpec> wanted = {CaptureSpec::All(3, true), *CaptureSpec::Make({1}, false, 3),
                                           *CaptureSpec::Make({0, 3}, true, 3)};
  for (const ElementType precision : {ElementType::kBf16, ElementType::kF32}) {
    SCOPED_TRACE(precision == ElementType::kBf16 ? "bf16" : "f32");
    absl::StatusOr<std::unique_ptr<Engine>> engine =
        Engine::Create(**checkpoint, EngineOptions{.tp = 1, .precision = precision, .threads = 1});
    ASSERT_TRUE(engine.ok()) << engine.status();
    std::vector<std::vector<SampleTensors>> got;
    {
      Batcher batcher(**engine, BatcherOptions{.max_batch_tokens = 4096});
      got = Delivered(batcher, lengths, wanted);
    }
    for (size_t i = 0; i < lengths.size(); ++i) {
      SCOPED_TRACE(::testing::Message() << "sample " << i);
      const ChecksumKind checksum = i % 2 ? ChecksumKind::kXxh64 : ChecksumKind::kXxh3;
      ASSERT_EQ(got[i][0].dtype, OutputDType::kFp8) << "not encoded in the capture copy";
      ASSERT_EQ(got[i][1].dtype, DTypeOfRows(precision));
      int allocations = 0;
      absl::StatusOr<SampleTensors> sent =
          EncodeSample(got[i][0], OutputDType::kFp8, checksum, HeapBuffers(&allocations));
      ASSERT_TRUE(sent.ok()) << sent.status();
      EXPECT_EQ(allocations, 0) << "EncodeSample encoded again";
      ExpectSame(*sent, OldPath(got[i][1], wanted[i], checksum));
    }
  }
}

}  // namespace
}  // namespace hsx
