// response_encoder_test.cc: one sample's captured rows as the Extract
// response stream: the messages parse, with chunk boundaries, data and
// checksums as the encoding gives them; bad samples fail before any message;
// rows already in the output dtype are sent from their own buffer; the raw
// slices of an encoded stream assemble as the parsed messages do.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>
#include <xxhash.h>

#include "absl/strings/str_format.h"
#include "format/encoding.h"
#include "format/response_encoder.h"
#include "format/response_framing.h"
#include "format/sample_file.h"
#include "format/sample_tensors.h"
#include "format/stream_assembler.h"
#include "format/tensor_encoding.h"
#include "format/test_values.h"
#include "kernels/bf16.h"
#include "server/model/host_buffer_pool.h"

namespace hsx {
namespace {

using ::hsx::testing::Encoded;
using ::hsx::testing::FileHiddenStates;
using ::hsx::testing::Flatten;
using ::hsx::testing::InterleaveRows;
using ::hsx::testing::TrickyValues;

// float32 rows [layers][tokens][hidden] (+ final norm), as the batcher gives
// them (without an owner: the test keeps `tensors`).
struct FakeSample {
  std::vector<std::vector<float>> tensors;
  SampleTensors view;
};

FakeSample MakeSample(std::vector<int> ids, bool final_norm, int64_t tokens, int64_t hidden) {
  FakeSample s;
  const size_t count = ids.size() + (final_norm ? 1 : 0);
  for (size_t k = 0; k < count; ++k) s.tensors.push_back(TrickyValues(tokens * hidden, 100 + k));
  s.view.capture_ids = std::move(ids);
  s.view.tokens = tokens;
  s.view.hidden = hidden;
  s.view.dtype = OutputDType::kFp32;
  for (size_t k = 0; k < count; ++k) {
    s.view.AddTensor(k < s.view.capture_ids.size() ? s.view.capture_ids[k] : -1, s.tensors[k].data());
  }
  return s;
}

std::vector<v1::ExtractResponse> Drain(ResponseEncoder& encoder) {
  std::vector<v1::ExtractResponse> out;
  grpc::ByteBuffer buffer;
  while (encoder.Next(&buffer)) {
    out.emplace_back();
    EXPECT_TRUE(out.back().ParseFromString(Flatten(buffer)));
  }
  return out;
}

TEST(ResponseEncoderTest, StreamParsesWithChunkBoundariesDataAndChecksums) {
  HostBufferPool pool(HostBufferPool::HeapAllocator(), 1 << 20);
  ResponseEncoder::Allocator allocate = [&pool](size_t n) { return pool.Get(n); };
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    const int64_t tokens = 37, hidden = 96;
    FakeSample sample = MakeSample({0, 5}, true, tokens, hidden);
    EncoderOptions options;
    options.sample_id = "s1";
    options.dtype = dtype;
    options.max_chunk_bytes = 1000;  // several rows per chunk, and a short last chunk
    const int64_t row_bytes = hidden * OutputDTypeSize(dtype);
    const int64_t rows_per_chunk = std::max<int64_t>(1, 1000 / row_bytes);
    auto encoder = ResponseEncoder::Create(sample.view, options, allocate);
    ASSERT_TRUE(encoder.ok()) << encoder.status();
    EXPECT_EQ((*encoder)->held_bytes(), 3 * tokens * row_bytes);
    const std::vector<v1::ExtractResponse> messages = Drain(**encoder);
    ASSERT_GE(messages.size(), 3u);
    ASSERT_TRUE(messages.front().has_header());
    EXPECT_EQ(messages.front().header().sample_id(), "s1");
    ASSERT_TRUE(messages.back().has_trailer());
    const std::vector<int> ids = {0, 5, -1};
    size_t m = 1;
    for (size_t k = 0; k < ids.size(); ++k) {
      std::string data;
      int64_t next = 0;
      while (next < tokens) {
        ASSERT_TRUE(messages[m].has_chunk());
        const v1::Chunk& c = messages[m++].chunk();
        EXPECT_EQ(c.capture_id(), ids[k]);
        EXPECT_EQ(c.first_row(), next);
        EXPECT_EQ(c.num_rows(), std::min(rows_per_chunk, tokens - next));
        EXPECT_EQ(static_cast<int64_t>(c.data().size()), c.num_rows() * row_bytes);
        data += c.data();
        next += c.num_rows();
      }
      EXPECT_EQ(data, Encoded(sample.tensors[k], dtype)) << OutputDTypeName(dtype) << " tensor " << k;
      const v1::TensorChecksum& checksum = messages.back().trailer().checksums(static_cast<int>(k));
      EXPECT_EQ(checksum.capture_id(), ids[k]);
      EXPECT_EQ(checksum.xxh64(), Xxh64(data.data(), data.size()));
    }
    EXPECT_EQ(m + 1, messages.size());
  }
}

TEST(ResponseEncoderTest, BadSamplesFailBeforeAnyMessage) {
  ResponseEncoder::Allocator allocate = HostBufferPool::HeapAllocator();
  FakeSample sample = MakeSample({2}, false, 4, 8);
  sample.tensors[0][3 * 8 + 5] = std::numeric_limits<float>::infinity();
  auto encoder = ResponseEncoder::Create(sample.view, EncoderOptions(), allocate);
  ASSERT_FALSE(encoder.ok());
  EXPECT_EQ(encoder.status().code(), absl::StatusCode::kInternal);
  EXPECT_NE(encoder.status().message().find("capture id 2: value inf at row 3, column 5 is not finite"),
            std::string::npos)
      << encoder.status();
  std::fill(sample.tensors[0].begin(), sample.tensors[0].end(), 0.0f);
  encoder = ResponseEncoder::Create(sample.view, EncoderOptions(), allocate);
  ASSERT_FALSE(encoder.ok());
  EXPECT_NE(encoder.status().message().find("capture id 2: every value is zero"), std::string::npos);
}

// The bytes of a chunk message's last slice (the rows) and where they lie.
std::pair<const char*, size_t> RowsSlice(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(message.Dump(&slices).ok());
  return {reinterpret_cast<const char*>(slices.back().begin()), slices.back().size()};
}

// bf16 rows [tensors][tokens][hidden] in one heap block, as the engine's
// per-sample buffer holds them; the sample owns the block.
SampleTensors Bf16View(const FakeSample& floats, std::weak_ptr<std::vector<uint16_t>>* watch) {
  auto rows = std::make_shared<std::vector<uint16_t>>();
  for (const std::vector<float>& t : floats.tensors) {
    for (float v : t) rows->push_back(FloatToBf16(v));
  }
  *watch = rows;
  SampleTensors view;
  view.capture_ids = floats.view.capture_ids;
  view.tokens = floats.view.tokens;
  view.hidden = floats.view.hidden;
  view.dtype = OutputDType::kBf16;
  const int64_t count = view.tokens * view.hidden;
  for (size_t k = 0; k < floats.view.tensors.size(); ++k) {
    view.AddTensor(floats.view.tensors[k].capture_id, rows->data() + k * count);
  }
  view.held_bytes = static_cast<int64_t>(rows->size() * 2);
  view.owner = rows;
  return view;
}

TEST(ResponseEncoderTest, RowsAlreadyInTheOutputDtypeAreSentFromTheirOwnBuffer) {
  const int64_t tokens = 19, hidden = 64;
  FakeSample floats = MakeSample({0, 3}, true, tokens, hidden);
  std::weak_ptr<std::vector<uint16_t>> watch;
  SampleTensors view = Bf16View(floats, &watch);
  const char* begin = reinterpret_cast<const char*>(watch.lock()->data());
  const char* end = begin + view.held_bytes;
  int allocations = 0;
  ResponseEncoder::Allocator allocate = [&allocations](size_t n) {
    ++allocations;
    return HostBufferPool::HeapAllocator()(n);
  };
  EncoderOptions options;
  options.max_chunk_bytes = 5 * hidden * 2;
  // The reference: the same rows with an owner that holds more than them, so they are copied.
  SampleTensors copied = view;
  copied.held_bytes += 1;
  auto reference = ResponseEncoder::Create(std::move(copied), options, allocate);
  ASSERT_TRUE(reference.ok()) << reference.status();
  EXPECT_EQ(allocations, 1);
  auto encoder = ResponseEncoder::Create(std::move(view), options, allocate);
  ASSERT_TRUE(encoder.ok()) << encoder.status();
  EXPECT_EQ(allocations, 1) << "rows already in bf16 were copied";
  EXPECT_EQ((*encoder)->held_bytes(), 3 * tokens * hidden * 2);
  grpc::ByteBuffer want, got;
  int chunks = 0;
  while ((*reference)->Next(&want)) {
    ASSERT_TRUE((*encoder)->Next(&got));
    EXPECT_EQ(Flatten(got), Flatten(want)) << "message " << chunks;
    v1::ExtractResponse parsed;
    ASSERT_TRUE(parsed.ParseFromString(Flatten(got)));
    if (parsed.has_chunk()) {
      const auto [data, size] = RowsSlice(got);
      EXPECT_TRUE(data >= begin && data + size <= end) << "chunk " << chunks << " does not alias the rows";
      ++chunks;
    }
  }
  EXPECT_FALSE((*encoder)->Next(&got));
  EXPECT_EQ(chunks, 3 * 4);  // 19 rows in chunks of 5, per tensor
  reference->reset();
  EXPECT_FALSE(watch.expired()) << "the rows went while the encoder sends them";
  encoder->reset();
  got.Clear();
  want.Clear();
  EXPECT_TRUE(watch.expired()) << "the rows outlived the encoder and its slices";
}

// ExtractRequest.checksum = XXH3: the header names it and the trailer carries
// XXH3 of each tensor's bytes (and no XXH64), on the copying path (f32 rows
// sent as bf16) and on the in-place path (bf16 rows sent as they are).
TEST(ResponseEncoderTest, AnXxh3RequestGetsXxh3ChecksumsNamedInTheHeader) {
  const int64_t tokens = 23, hidden = 48;
  FakeSample floats = MakeSample({1, 4}, true, tokens, hidden);
  std::weak_ptr<std::vector<uint16_t>> watch;
  int allocations = 0;
  ResponseEncoder::Allocator allocate = [&allocations](size_t n) {
    ++allocations;
    return HostBufferPool::HeapAllocator()(n);
  };
  EncoderOptions options;
  options.checksum = ChecksumKind::kXxh3;
  options.max_chunk_bytes = 7 * hidden * 2;
  for (const bool in_place : {false, true}) {
    SCOPED_TRACE(in_place ? "in place" : "copied");
    const int before = allocations;
    auto encoder = ResponseEncoder::Create(in_place ? Bf16View(floats, &watch) : floats.view, options, allocate);
    ASSERT_TRUE(encoder.ok()) << encoder.status();
    EXPECT_EQ(allocations - before, in_place ? 0 : 1);
    const std::vector<v1::ExtractResponse> messages = Drain(**encoder);
    ASSERT_TRUE(messages.front().has_header());
    EXPECT_EQ(messages.front().header().checksum(), v1::CHECKSUM_XXH3_64);
    ASSERT_TRUE(messages.back().has_trailer());
    std::vector<std::string> data(3);
    const std::vector<int> ids = {1, 4, -1};
    for (const v1::ExtractResponse& m : messages) {
      if (m.has_chunk()) data[std::find(ids.begin(), ids.end(), m.chunk().capture_id()) - ids.begin()] += m.chunk().data();
    }
    ASSERT_EQ(messages.back().trailer().checksums_size(), 3);
    for (int k = 0; k < 3; ++k) {
      const v1::TensorChecksum& c = messages.back().trailer().checksums(k);
      EXPECT_EQ(c.capture_id(), ids[k]);
      EXPECT_EQ(data[k], Encoded(floats.tensors[k], OutputDType::kBf16)) << "tensor " << k;
      EXPECT_EQ(c.xxh3_64(), XXH3_64bits(data[k].data(), data[k].size())) << "tensor " << k;
      EXPECT_EQ(c.xxh3_64_hex(), absl::StrFormat("%016x", c.xxh3_64()));
      EXPECT_EQ(c.xxh64(), 0u);
      EXPECT_TRUE(c.xxh64_hex().empty());
    }
  }
}

TEST(ResponseEncoderTest, RowsInPlaceAreCheckedAsWhenCopied) {
  FakeSample floats = MakeSample({2}, false, 4, 8);
  floats.tensors[0][3 * 8 + 5] = std::numeric_limits<float>::infinity();
  std::weak_ptr<std::vector<uint16_t>> watch;
  SampleTensors view = Bf16View(floats, &watch);
  auto encoder = ResponseEncoder::Create(view, EncoderOptions(), HostBufferPool::HeapAllocator());
  ASSERT_FALSE(encoder.ok());
  EXPECT_NE(encoder.status().message().find("capture id 2: value inf at row 3, column 5 is not finite"),
            std::string::npos)
      << encoder.status();
  std::fill(watch.lock()->begin(), watch.lock()->end(), uint16_t{0x8000});  // -0.0
  encoder = ResponseEncoder::Create(view, EncoderOptions(), HostBufferPool::HeapAllocator());
  ASSERT_FALSE(encoder.ok());
  EXPECT_NE(encoder.status().message().find("capture id 2: every value is zero"), std::string::npos);
}

// What the capture check found (SampleTensor::findings) stands for the
// encoder's own pass when it was made for the rows as they are sent and the
// request's checksum, and only then.
TEST(ResponseEncoderTest, TheCaptureCopysFindingsAreUsedWhenTheyAnswerTheRequest) {
  const int64_t tokens = 6, hidden = 16;
  FakeSample floats = MakeSample({1, 4}, true, tokens, hidden);
  std::weak_ptr<std::vector<uint16_t>> watch;
  EncoderOptions options;
  options.checksum = ChecksumKind::kXxh3;
  auto trailer_of = [&](SampleTensors view) -> absl::StatusOr<v1::Trailer> {
    auto encoder = ResponseEncoder::Create(std::move(view), options, HostBufferPool::HeapAllocator());
    if (!encoder.ok()) return encoder.status();
    return Drain(**encoder).back().trailer();
  };
  const absl::StatusOr<v1::Trailer> own = trailer_of(Bf16View(floats, &watch));
  ASSERT_TRUE(own.ok()) << own.status();
  // Findings that differ from the rows (a checksum off by one) show which pass was used.
  auto with_findings = [&](ChecksumKind kind) {
    SampleTensors view = Bf16View(floats, &watch);
    for (int k = 0; k < 3; ++k) {
      TensorFindings e;
      e.checksum_kind = kind;
      e.nonzero = true;
      e.checksum = own->checksums(k).xxh3_64() + 1;
      view.tensors[k].findings = e;
    }
    return view;
  };
  const absl::StatusOr<v1::Trailer> used = trailer_of(with_findings(ChecksumKind::kXxh3));
  ASSERT_TRUE(used.ok()) << used.status();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(used->checksums(k).xxh3_64(), own->checksums(k).xxh3_64() + 1) << k;
  // Made with another checksum: the encoder reads the rows itself.
  absl::StatusOr<v1::Trailer> ignored = trailer_of(with_findings(ChecksumKind::kXxh64));
  ASSERT_TRUE(ignored.ok()) << ignored.status();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(ignored->checksums(k).xxh3_64(), own->checksums(k).xxh3_64()) << k;
  // Rows sent in another dtype are encoded again: their findings do not stand for the new bytes.
  options.dtype = OutputDType::kFp32;
  const absl::StatusOr<v1::Trailer> own_fp32 = trailer_of(Bf16View(floats, &watch));
  ignored = trailer_of(with_findings(ChecksumKind::kXxh3));
  ASSERT_TRUE(own_fp32.ok() && ignored.ok()) << ignored.status();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(ignored->checksums(k).xxh3_64(), own_fp32->checksums(k).xxh3_64()) << k;
  options.dtype = OutputDType::kBf16;
  // A tensor without findings is read; the others' findings stand.
  SampleTensors view = with_findings(ChecksumKind::kXxh3);
  view.tensors[2].findings.reset();
  ignored = trailer_of(view);
  ASSERT_TRUE(ignored.ok()) << ignored.status();
  for (int k = 0; k < 3; ++k) {
    EXPECT_EQ(ignored->checksums(k).xxh3_64(), own->checksums(k).xxh3_64() + (k < 2 ? 1 : 0)) << k;
  }
  // A bad value or all zeros the check found fail the sample as the encoder's own check would.
  view = with_findings(ChecksumKind::kXxh3);
  view.tensors[1].findings->bad_index = 2 * hidden + 3;
  view.tensors[1].findings->bad_value = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(trailer_of(view).status().message().find("capture id 4: value nan at row 2, column 3 is not finite"),
            std::string::npos);
  view = with_findings(ChecksumKind::kXxh3);
  view.tensors[2].findings->nonzero = false;
  EXPECT_NE(trailer_of(view).status().message().find("capture id -1: every value is zero"), std::string::npos);
}

// The same bytes, cut into slices of 1..`most` bytes (as a transport may deliver them).
grpc::ByteBuffer Recut(const std::string& bytes, size_t most, std::mt19937* rng) {
  std::vector<grpc::Slice> slices;
  for (size_t at = 0; at < bytes.size();) {
    const size_t n = std::min<size_t>(bytes.size() - at, 1 + (*rng)() % most);
    slices.emplace_back(bytes.data() + at, n);
    at += n;
  }
  return grpc::ByteBuffer(slices.data(), slices.size());
}

TEST(StreamAssemblerRawTest, SlicedBytesAssembleAsTheParsedMessages) {
  // Two layers (rows interleave in the file layout) and the final norm; bf16 and fp32.
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp32}) {
    const int64_t tokens = 23, hidden = 40;
    FakeSample sample = MakeSample({1, 4}, true, tokens, hidden);
    EncoderOptions options;
    options.sample_id = "raw";
    options.dtype = dtype;
    options.max_chunk_bytes = 7 * hidden * OutputDTypeSize(dtype);
    auto encoder = ResponseEncoder::Create(sample.view, options, HostBufferPool::HeapAllocator());
    ASSERT_TRUE(encoder.ok()) << encoder.status();
    StreamExpectation expect;
    expect.sample_id = "raw";
    expect.num_tokens = tokens;
    expect.capture_ids = {1, 4};
    expect.final_norm = true;
    expect.dtype = dtype;
    StreamAssembler parsed(expect), raw(expect), sliced(expect);
    std::mt19937 rng(3);
    grpc::ByteBuffer message;
    while ((*encoder)->Next(&message)) {
      const std::string bytes = Flatten(message);
      v1::ExtractResponse response;
      ASSERT_TRUE(response.ParseFromString(bytes));
      ASSERT_TRUE(parsed.Consume(response).ok());
      ASSERT_TRUE(raw.Consume(message).ok());
      const absl::Status status = sliced.Consume(Recut(bytes, 5, &rng));
      ASSERT_TRUE(status.ok()) << status;
    }
    ASSERT_TRUE(parsed.complete() && raw.complete() && sliced.complete());
    const SampleTensors a = parsed.Take(), b = raw.Take(), c = sliced.Take();
    EXPECT_EQ(FileHiddenStates(a), FileHiddenStates(b));
    EXPECT_EQ(FileHiddenStates(a), FileHiddenStates(c));
    EXPECT_EQ(TensorString(a.tensors.back()), TensorString(c.tensors.back()));
    // And that is the file layout of the values themselves.
    const std::string want = InterleaveRows({Encoded(sample.tensors[0], dtype), Encoded(sample.tensors[1], dtype)},
                                            hidden * OutputDTypeSize(dtype));
    EXPECT_EQ(FileHiddenStates(c), want);
  }
}

TEST(StreamAssemblerRawTest, CorruptChunksAreDataLoss) {
  const int64_t tokens = 4, hidden = 8;
  FakeSample sample = MakeSample({0}, false, tokens, hidden);
  EncoderOptions options;
  options.sample_id = "bad";
  auto encoder = ResponseEncoder::Create(sample.view, options, HostBufferPool::HeapAllocator());
  ASSERT_TRUE(encoder.ok());
  StreamExpectation expect;
  expect.sample_id = "bad";
  expect.num_tokens = tokens;
  expect.capture_ids = {0};
  std::vector<std::string> messages;
  grpc::ByteBuffer message;
  while ((*encoder)->Next(&message)) messages.push_back(Flatten(message));
  ASSERT_EQ(messages.size(), 3u);  // header, one chunk, trailer
  {
    StreamAssembler a(expect);
    std::mt19937 rng(1);
    ASSERT_TRUE(a.Consume(Recut(messages[0], 1000, &rng)).ok());
    std::string flipped = messages[1];
    flipped[flipped.size() - 3] ^= 1;  // a data byte: the checksum catches it at the trailer
    ASSERT_TRUE(a.Consume(grpc::ByteBuffer(std::vector<grpc::Slice>{grpc::Slice(flipped)}.data(), 1)).ok());
    grpc::Slice trailer(messages[2]);
    const absl::Status status = a.Consume(grpc::ByteBuffer(&trailer, 1));
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  }
  {
    StreamAssembler a(expect);
    grpc::Slice header(messages[0]);
    ASSERT_TRUE(a.Consume(grpc::ByteBuffer(&header, 1)).ok());
    grpc::Slice cut(messages[1].substr(0, messages[1].size() - 5));  // truncated
    const absl::Status status = a.Consume(grpc::ByteBuffer(&cut, 1));
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
  }
}

}  // namespace
}  // namespace hsx
