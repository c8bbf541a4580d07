// response_stream_test.cc: the server's zero-copy response path against the
// generated protobuf code and today's encoding (issue 13): hand-framed chunks
// parse as the generated ExtractResponse, field by field and byte for byte;
// one-pass encoding is bit-identical to AppendEncoded and its checksums to
// XXH64 of those bytes; bad values are found where they are; pooled buffers
// are reused and released when the last slice goes.
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
#include "format/stream_assembler.h"
#include "format/tensor_encoding.h"
#include "kernels/bf16.h"
#include "server/model/host_buffer_pool.h"
#include "format/sample_view.h"
#include "server/model/capture_views.h"

namespace hsx {
namespace {

std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Values that exercise rounding: ties, subnormals, signed zeros, large ones.
std::vector<float> TrickyValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 8) {
      case 0: {  // a bf16 tie: low half exactly 0x8000
        uint32_t bits = (rng() & 0x3fff0000u) | 0x8000u;
        std::memcpy(&v[i], &bits, 4);
        break;
      }
      case 1: v[i] = (i % 16 == 1) ? -0.0f : 0.0f; break;
      case 2: v[i] = std::ldexp(normal(rng), -130); break;  // float subnormal
      case 3: v[i] = std::ldexp(normal(rng), -20); break;   // fp16 subnormal range
      case 4: v[i] = 60000.0f + normal(rng); break;         // near fp16's top
      case 5: {  // an fp16 tie: the 13 bits fp16 drops are exactly half
        uint32_t bits = ((0x38800000u + rng() % 0x0e000000u) & ~0x1fffu) | 0x1000u | (rng() & 0x80000000u);
        std::memcpy(&v[i], &bits, 4);
        break;
      }
      default: v[i] = normal(rng); break;
    }
  }
  return v;
}

std::string Encoded(const std::vector<float>& values, OutputDType dtype) {
  std::string out;
  AppendEncoded(values, dtype, &out);
  return out;
}

TEST(TensorEncodingTest, BitIdenticalToAppendEncodedWithChecksum) {
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    for (size_t n : {size_t{1}, size_t{7}, size_t{4096}, size_t{4097}, size_t{3 * 4096 + 5}}) {
      const std::vector<float> values = TrickyValues(n, static_cast<uint32_t>(n));
      const std::string want = Encoded(values, dtype);
      std::string got(want.size(), '\0');
      const TensorEncoding e = EncodeTensor(values.data(), ElementType::kF32, static_cast<int64_t>(n), dtype, got.data());
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
    const TensorEncoding e = EncodeTensor(bf16.data(), ElementType::kBf16, 5000, dtype, got.data());
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
  TensorEncoding e = EncodeTensor(values.data(), ElementType::kF32, 10000, OutputDType::kBf16, out.data());
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
    const TensorEncoding want_b = EncodeTensor(b.data(), ElementType::kBf16, n, OutputDType::kBf16, out.data());
    const TensorEncoding got_b = CheckTensor(b.data(), n, OutputDType::kBf16);
    const TensorEncoding want_f = EncodeTensor(f.data(), ElementType::kF32, n, OutputDType::kFp32, out.data());
    const TensorEncoding got_f = CheckTensor(f.data(), n, OutputDType::kFp32);
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
      const TensorEncoding want_b = CheckTensor(b.data(), n, OutputDType::kBf16, kind);
      const TensorEncoding want_f = CheckTensor(f.data(), n, OutputDType::kFp32, kind);
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

TEST(ResponseFramingTest, ChunkBytesAreTheGeneratedSerialization) {
  const std::string data(100000, '\x5a');
  for (int32_t capture_id : {0, 3, 61, -1}) {
    for (int64_t first_row : {int64_t{0}, int64_t{1}, int64_t{300}, int64_t{1} << 40}) {
      for (size_t size : {size_t{0}, size_t{1}, size_t{127}, size_t{128}, size_t{100000}}) {
        const int64_t num_rows = static_cast<int64_t>(size % 7);
        v1::ExtractResponse want;
        v1::Chunk* chunk = want.mutable_chunk();
        chunk->set_capture_id(capture_id);
        chunk->set_first_row(first_row);
        chunk->set_num_rows(num_rows);
        chunk->set_data(data.substr(0, size));
        const std::string bytes =
            Flatten(ChunkResponse(capture_id, first_row, num_rows, data.data(), size, nullptr));
        EXPECT_EQ(bytes, want.SerializeAsString()) << capture_id << " " << first_row << " " << size;
        v1::ExtractResponse got;
        ASSERT_TRUE(got.ParseFromString(bytes));
        ASSERT_TRUE(got.has_chunk());
        EXPECT_EQ(got.chunk().capture_id(), capture_id);
        EXPECT_EQ(got.chunk().first_row(), first_row);
        EXPECT_EQ(got.chunk().num_rows(), num_rows);
        EXPECT_EQ(got.chunk().data(), data.substr(0, size));
      }
    }
  }
}

TEST(ResponseFramingTest, TheSliceKeepsItsOwnerUntilDestroyed) {
  auto owner = std::make_shared<std::string>(4096, 'x');
  std::weak_ptr<std::string> watch = owner;
  {
    grpc::ByteBuffer message = ChunkResponse(1, 0, 1, owner->data(), owner->size(), owner);
    owner.reset();
    EXPECT_FALSE(watch.expired()) << "released while gRPC still holds the slice";
    grpc::ByteBuffer copy(message);  // gRPC's own references
    message.Clear();
    EXPECT_FALSE(watch.expired());
  }
  EXPECT_TRUE(watch.expired()) << "never released";
}

// A view of float32 rows [layers][tokens][hidden] (+ final norm), as the batcher gives.
struct FakeSample {
  std::vector<std::vector<float>> tensors;
  SampleView view;
};

FakeSample MakeSample(std::vector<int> ids, bool final_norm, int64_t tokens, int64_t hidden) {
  FakeSample s;
  const size_t count = ids.size() + (final_norm ? 1 : 0);
  for (size_t k = 0; k < count; ++k) s.tensors.push_back(TrickyValues(tokens * hidden, 100 + k));
  s.view.capture_ids = std::move(ids);
  s.view.tokens = tokens;
  s.view.hidden = hidden;
  s.view.type = ElementType::kF32;
  for (size_t k = 0; k < s.view.capture_ids.size(); ++k) s.view.layers.push_back(s.tensors[k].data());
  if (final_norm) s.view.final_norm = s.tensors.back().data();
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
// per-sample buffer holds them; the view owns the block.
SampleView Bf16View(const FakeSample& floats, std::weak_ptr<std::vector<uint16_t>>* watch) {
  auto rows = std::make_shared<std::vector<uint16_t>>();
  for (const std::vector<float>& t : floats.tensors) {
    for (float v : t) rows->push_back(FloatToBf16(v));
  }
  *watch = rows;
  SampleView view = floats.view;
  view.type = ElementType::kBf16;
  const int64_t count = view.tokens * view.hidden;
  for (size_t k = 0; k < view.layers.size(); ++k) view.layers[k] = rows->data() + k * count;
  if (view.final_norm != nullptr) view.final_norm = rows->data() + view.layers.size() * count;
  view.held_bytes = static_cast<int64_t>(rows->size() * 2);
  view.owner = rows;
  return view;
}

TEST(ResponseEncoderTest, RowsAlreadyInTheOutputDtypeAreSentFromTheirOwnBuffer) {
  const int64_t tokens = 19, hidden = 64;
  FakeSample floats = MakeSample({0, 3}, true, tokens, hidden);
  std::weak_ptr<std::vector<uint16_t>> watch;
  SampleView view = Bf16View(floats, &watch);
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
  SampleView copied = view;
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
  SampleView view = Bf16View(floats, &watch);
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

// What the capture copy found (SampleView::checked) stands for the encoder's
// own pass when it was made for the request's dtype and checksum, and only then.
TEST(ResponseEncoderTest, TheCaptureCopysFindingsAreUsedWhenTheyAnswerTheRequest) {
  const int64_t tokens = 6, hidden = 16;
  FakeSample floats = MakeSample({1, 4}, true, tokens, hidden);
  std::weak_ptr<std::vector<uint16_t>> watch;
  EncoderOptions options;
  options.checksum = ChecksumKind::kXxh3;
  auto trailer_of = [&](SampleView view) -> absl::StatusOr<v1::Trailer> {
    auto encoder = ResponseEncoder::Create(std::move(view), options, HostBufferPool::HeapAllocator());
    if (!encoder.ok()) return encoder.status();
    return Drain(**encoder).back().trailer();
  };
  const absl::StatusOr<v1::Trailer> own = trailer_of(Bf16View(floats, &watch));
  ASSERT_TRUE(own.ok()) << own.status();
  // Findings that differ from the rows (a checksum off by one) show which pass was used.
  CheckedRows found{RowCheck{OutputDType::kBf16, ChecksumKind::kXxh3}, {}};
  for (int k = 0; k < 3; ++k) {
    TensorEncoding e;
    e.nonzero = true;
    e.checksum = own->checksums(k).xxh3_64() + 1;
    found.tensors.push_back(e);
  }
  SampleView view = Bf16View(floats, &watch);
  view.checked = found;
  const absl::StatusOr<v1::Trailer> used = trailer_of(view);
  ASSERT_TRUE(used.ok()) << used.status();
  for (int k = 0; k < 3; ++k) EXPECT_EQ(used->checksums(k).xxh3_64(), own->checksums(k).xxh3_64() + 1) << k;
  // Made for another checksum, another dtype, or other tensors: the encoder reads the rows itself.
  for (int change = 0; change < 3; ++change) {
    view = Bf16View(floats, &watch);
    view.checked = found;
    if (change == 0) view.checked->check.checksum = ChecksumKind::kXxh64;
    if (change == 1) view.checked->check.dtype = OutputDType::kFp32;
    if (change == 2) view.checked->tensors.pop_back();
    const absl::StatusOr<v1::Trailer> ignored = trailer_of(view);
    ASSERT_TRUE(ignored.ok()) << ignored.status();
    for (int k = 0; k < 3; ++k) EXPECT_EQ(ignored->checksums(k).xxh3_64(), own->checksums(k).xxh3_64()) << change;
  }
  // A bad value or all zeros the copy found fail the sample as the encoder's own check would.
  view = Bf16View(floats, &watch);
  view.checked = found;
  view.checked->tensors[1].bad_index = 2 * hidden + 3;
  view.checked->tensors[1].bad_value = std::numeric_limits<float>::quiet_NaN();
  EXPECT_NE(trailer_of(view).status().message().find("capture id 4: value nan at row 2, column 3 is not finite"),
            std::string::npos);
  view = Bf16View(floats, &watch);
  view.checked = found;
  view.checked->tensors[2].nonzero = false;
  EXPECT_NE(trailer_of(view).status().message().find("capture id -1: every value is zero"), std::string::npos);
}

// A host buffer that records its release.
class WatchedBuffer : public HostBuffer {
 public:
  WatchedBuffer(size_t bytes, int* released) : data_(bytes), released_(released) {}
  ~WatchedBuffer() override { ++*released_; }
  void* data() const override { return const_cast<char*>(data_.data()); }
  size_t bytes() const override { return data_.size(); }

 private:
  std::vector<char> data_;
  int* released_;
};

TEST(CaptureViewsTest, EachSampleOwnsItsBufferAlone) {
  Captures captures;
  captures.ids = {0, 2};
  captures.has_final_norm = true;
  captures.hidden = 4;
  captures.type = ElementType::kF32;
  captures.cu_seqlens = {0, 3, 4, 9};
  captures.tokens = 9;
  int released = 0;
  for (int64_t s = 0; s < captures.num_samples(); ++s) {
    captures.samples.push_back(std::make_unique<WatchedBuffer>(captures.SampleBytes(s), &released));
    float* rows = static_cast<float*>(captures.samples.back()->data());
    const int64_t count = captures.SampleBytes(s) / 4;
    for (int64_t i = 0; i < count; ++i) rows[i] = static_cast<float>(1000 * s + i);
  }
  float row[4];
  captures.LayerRow(1, 5, row);  // sample 2, its row 1, of tensor 1: [tensor][5 rows][4]
  EXPECT_EQ(row[0], 2000.0f + (1 * 5 + 1) * 4);
  captures.FinalNormRow(3, row);  // sample 1's only row of tensor 2
  EXPECT_EQ(row[3], 1000.0f + 2 * 4 + 3);
  std::vector<SampleView> views = ViewBySample(std::move(captures));
  ASSERT_EQ(views.size(), 3u);
  for (size_t s = 0; s < views.size(); ++s) {
    EXPECT_EQ(views[s].held_bytes, views[s].view_bytes()) << s;
    EXPECT_EQ(static_cast<const float*>(views[s].layers[0])[0], 1000.0f * s);
  }
  EXPECT_EQ(views[2].tokens, 5);
  EXPECT_EQ(static_cast<const float*>(views[2].final_norm)[0], 2000.0f + 2 * 5 * 4);
  views[1] = SampleView();
  EXPECT_EQ(released, 1) << "a sample's buffer must go back as soon as its view does";
  SampleView subset = SelectCaptures(std::move(views[0]), *CaptureSpec::Make({2}, false, 2));
  EXPECT_EQ(subset.view_bytes() * 3, subset.held_bytes) << "a subset still holds the whole sample";
}

// The capture copy's findings follow the tensors a request keeps.
TEST(CaptureViewsTest, TheCopysFindingsAreSelectedWithTheirTensors) {
  SampleView view;
  view.capture_ids = {0, 2, 5};
  view.tokens = 1;
  view.hidden = 1;
  static const float rows[4] = {1, 2, 3, 4};
  view.layers = {&rows[0], &rows[1], &rows[2]};
  view.final_norm = &rows[3];
  view.checked = CheckedRows{};
  for (uint64_t k = 0; k < 4; ++k) view.checked->tensors.push_back(TensorEncoding{.checksum = 100 + k});
  struct Case {
    std::vector<int> ids;
    bool final_norm;
    std::vector<uint64_t> want;
  };
  for (const Case& c : {Case{{0, 2, 5}, true, {100, 101, 102, 103}}, Case{{0, 2, 5}, false, {100, 101, 102}},
                        Case{{5}, true, {102, 103}}, Case{{0, 5}, false, {100, 102}}}) {
    SampleView subset = SelectCaptures(view, *CaptureSpec::Make(c.ids, c.final_norm, 5));
    ASSERT_TRUE(subset.checked.has_value());
    std::vector<uint64_t> got;
    for (const TensorEncoding& e : subset.checked->tensors) got.push_back(e.checksum);
    EXPECT_EQ(got, c.want) << c.ids.size() << " ids, final norm " << c.final_norm;
    EXPECT_EQ(static_cast<int>(got.size()), subset.num_tensors());
  }
  view.checked->tensors.pop_back();  // findings that do not match the view are dropped, not misassigned
  EXPECT_FALSE(SelectCaptures(view, *CaptureSpec::Make({2}, true, 5)).checked.has_value());
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
    const EncodedSample a = parsed.Take(), b = raw.Take(), c = sliced.Take();
    EXPECT_EQ(a.hidden_states, b.hidden_states);
    EXPECT_EQ(a.hidden_states, c.hidden_states);
    EXPECT_EQ(a.final_norm, c.final_norm);
    // And that is the file layout of the values themselves.
    SampleStates states = sample.view.ToStates();
    EXPECT_EQ(c.hidden_states, EncodeSampleStates(states, dtype).hidden_states);
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

TEST(HostBufferPoolTest, ReusesAndBoundsIdleBuffers) {
  HostBufferPool pool(HostBufferPool::HeapAllocator(), 3 << 20);
  void* first;
  {
    auto a = pool.Get(2 << 20);
    ASSERT_TRUE(a.ok());
    first = (*a)->data();
    EXPECT_EQ((*a)->bytes(), size_t{2} << 20);
  }
  EXPECT_GE(pool.idle_bytes(), size_t{2} << 20);
  {
    auto b = pool.Get(1 << 20);  // fits in the idle one: no new allocation
    ASSERT_TRUE(b.ok());
    EXPECT_EQ((*b)->data(), first);
    EXPECT_EQ((*b)->bytes(), size_t{1} << 20);
    EXPECT_EQ(pool.idle_bytes(), 0u);
  }
  EXPECT_EQ(pool.allocations(), 1);
  {
    auto c = pool.Get(2 << 20);
    auto d = pool.Get(2 << 20);  // two at once: a second buffer
    EXPECT_NE((*c)->data(), (*d)->data());
  }
  EXPECT_EQ(pool.allocations(), 2);
  EXPECT_LE(pool.idle_bytes(), size_t{3} << 20) << "kept more idle than the cap";
  EXPECT_GT(pool.idle_bytes(), 0u);
}

TEST(HostBufferPoolTest, ARaisedCapKeepsAWholeBatchOfBuffers) {
  // A batch's captures are one buffer per sample: with the cap raised to the
  // batch's total, the next batch of the same shape allocates nothing.
  HostBufferPool pool(HostBufferPool::HeapAllocator(), 1 << 20);
  auto batch = [&pool] {
    std::vector<std::unique_ptr<HostBuffer>> buffers;
    for (int i = 0; i < 4; ++i) buffers.push_back(*pool.Get(1 << 20));
  };
  batch();
  batch();
  EXPECT_EQ(pool.allocations(), 7) << "the default cap keeps one of the four";
  pool.RaiseIdleCap(4 << 20);
  batch();
  const int64_t before = pool.allocations();
  batch();
  EXPECT_EQ(pool.allocations(), before);
  EXPECT_EQ(pool.idle_bytes(), size_t{4} << 20);
  pool.RaiseIdleCap(1 << 20);  // never lowers it
  batch();
  EXPECT_EQ(pool.allocations(), before);
}

TEST(HostBufferPoolTest, BuffersMayOutliveThePool) {
  std::unique_ptr<HostBuffer> kept;
  {
    HostBufferPool pool(HostBufferPool::HeapAllocator(), 1 << 20);
    kept = *pool.Get(4096);
    std::memset(kept->data(), 1, 4096);
  }
  kept.reset();  // freed, not returned to a destroyed pool (ASan would object)
}

}  // namespace
}  // namespace hsx
