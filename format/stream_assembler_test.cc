// stream_assembler_test.cc: the Extract stream's encoder and assembler side by
// side. A stream the ResponseEncoder produces assembles into exactly the bytes
// the values encode to (every dtype); every way of breaking that stream is
// refused with DATA_LOSS naming what was wrong, and nothing is accepted after.
#include "format/stream_assembler.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "format/fp8.h"
#include "format/layer_convention.h"
#include "format/response_encoder.h"
#include "format/sample_file.h"
#include "format/state_bytes_pool.h"
#include "format/test_values.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

// This process's scratch directory (ctest runs the tests as parallel processes).
std::string OwnDir() {
  const std::string dir = ::testing::TempDir() + "/hsx_assembler_" + std::to_string(getpid());
  std::filesystem::create_directories(dir);
  return dir;
}

using ::hsx::testing::EncodeStates;
using ::hsx::testing::FileHiddenStates;
using ::hsx::testing::FloatStates;
using ::testing::HasSubstr;

constexpr int64_t kTokens = 5;
constexpr int64_t kHidden = 4;
const std::vector<int> kIds = {2, 3, 7};
const std::vector<int32_t> kTokenIds = {11, 12, 13, 14, 15};

// A sample's size: these tests' small one by default.
struct Shape {
  int64_t tokens = kTokens;
  int64_t hidden = kHidden;
};

// Token ids 11, 12, ...: kTokenIds for kTokens.
std::vector<int32_t> TokenIds(int64_t tokens) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int32_t>(11 + i);
  return ids;
}

FloatStates MakeStates(bool final_norm, const std::vector<int>& ids = kIds, Shape shape = {}) {
  FloatStates s;
  s.capture_ids = ids;
  s.tokens = shape.tokens;
  s.hidden = shape.hidden;
  const int64_t layers = static_cast<int64_t>(ids.size());
  // Rows of seven magnitudes, so that fp8's scales differ from row to row (in every layer).
  for (int64_t i = 0; i < shape.tokens * layers * shape.hidden; ++i) {
    s.hidden_states.push_back((0.25f * (i % 17) - 1.5f) * static_cast<float>(1 + i / shape.hidden % 7));
  }
  if (final_norm) {
    for (int64_t i = 0; i < shape.tokens * shape.hidden; ++i) s.final_norm.push_back(0.5f * (i % 5) + 0.125f);
  }
  return s;
}

StreamExpectation Expect(OutputDType dtype, bool final_norm, const std::vector<int>& ids = kIds,
                         ChecksumKind checksum = ChecksumKind::kXxh64, Shape shape = {}) {
  StreamExpectation e;
  e.checksum = checksum;
  e.sample_id = "s-1";
  e.num_tokens = shape.tokens;
  e.token_ids_xxh64 = TokenIdsHash(TokenIds(shape.tokens));
  e.capture_ids = ids;
  e.final_norm = final_norm;
  e.dtype = dtype;
  e.hidden_size = shape.hidden;
  e.num_layers = 7;
  e.model_name = "tiny";
  return e;
}

// The stream the server would send: two rows per chunk, so tensors span chunks.
std::vector<v1::ExtractResponse> Stream(OutputDType dtype, bool final_norm, const std::vector<int>& ids = kIds,
                                        ChecksumKind checksum = ChecksumKind::kXxh64, Shape shape = {}) {
  EncoderOptions o;
  o.checksum = checksum;
  o.sample_id = "s-1";
  o.dtype = dtype;
  o.max_chunk_bytes = 2 * RowBytes(dtype, shape.hidden);
  o.token_ids_hash = TokenIdsHash(TokenIds(shape.tokens));
  o.model_name = "tiny";
  o.num_layers = 7;
  o.layer_convention = kLayerConvention;
  // The states as the engine holds them: each tensor's [T, H] float32 rows contiguous.
  const SampleTensors view = EncodeStates(MakeStates(final_norm, ids, shape), OutputDType::kFp32);
  absl::StatusOr<std::unique_ptr<ResponseEncoder>> encoder =
      ResponseEncoder::Create(view, o, ::hsx::testing::HeapBuffers());
  EXPECT_TRUE(encoder.ok()) << encoder.status();
  std::vector<v1::ExtractResponse> out;
  if (!encoder.ok()) return out;
  grpc::ByteBuffer message;
  while ((*encoder)->Next(&message)) {
    std::vector<grpc::Slice> slices;
    EXPECT_TRUE(message.Dump(&slices).ok());
    std::string bytes;
    for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    v1::ExtractResponse r;
    EXPECT_TRUE(r.ParseFromString(bytes));
    out.push_back(std::move(r));
  }
  return out;
}

// The sample's bytes as the file holds them: hidden_states [T, L, H], and
// the final norm (empty without one).
std::string HiddenBytes(const SampleTensors& s) { return FileHiddenStates(s); }
std::string FinalBytes(const SampleTensors& s) { return s.has_final_norm() ? TensorString(s.tensors.back()) : ""; }

// The XXH64 of tensor k a receiver hands on (its findings), if it has one.
std::optional<uint64_t> HandedOnXxh64(const SampleTensors& s, size_t k) {
  const std::optional<TensorFindings>& found = s.tensors[k].findings;
  if (!found.has_value() || found->checksum_kind != ChecksumKind::kXxh64) return std::nullopt;
  return found->checksum;
}

// `size` bytes from where `piece` starts.
std::string Bytes(const BytePiece& piece, size_t size) {
  return std::string(reinterpret_cast<const char*>(piece.data()), size);
}

// fp8 rows as sent (a 4-byte scale, then `hidden` values, each) as the
// file's two tensors: (the values, the scales).
std::pair<std::string, std::string> SplitRows(const std::string& rows, int64_t hidden) {
  std::pair<std::string, std::string> out;
  const size_t row = static_cast<size_t>(hidden) + 4;
  for (size_t at = 0; at + row <= rows.size(); at += row) {
    out.second.append(rows, at, 4);
    out.first.append(rows, at + 4, row - 4);
  }
  return out;
}

absl::Status Feed(StreamAssembler& a, const std::vector<v1::ExtractResponse>& stream) {
  for (const v1::ExtractResponse& r : stream) {
    if (absl::Status s = a.Consume(r); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Files record XXH64: a one-layer sample's wire checksums are its file
// checksums only when the stream carried XXH64. With XXH3 the file writer
// must hash the bytes itself, so the assembler hands on none.
TEST(StreamAssemblerTest, OnlyAnXxh64StreamLendsItsChecksumsToTheFile) {
  const std::vector<int> one = {3};
  const SampleTensors want = EncodeStates(MakeStates(true, one), OutputDType::kBf16);
  for (ChecksumKind kind : {ChecksumKind::kXxh64, ChecksumKind::kXxh3}) {
    for (StreamAssembler::Mode mode : {StreamAssembler::Mode::kAssemble, StreamAssembler::Mode::kKeepReceived}) {
      SCOPED_TRACE(std::string(ChecksumKindName(kind)) + (mode == StreamAssembler::Mode::kAssemble ? " assembled" : " kept"));
      StreamAssembler a(Expect(OutputDType::kBf16, true, one, kind), mode);
      ASSERT_TRUE(Feed(a, Stream(OutputDType::kBf16, true, one, kind)).ok());
      ASSERT_TRUE(a.complete());
      const SampleTensors got = a.Take();
      if (kind == ChecksumKind::kXxh64) {
        ASSERT_TRUE(HandedOnXxh64(got, 0).has_value());
        ASSERT_TRUE(HandedOnXxh64(got, 1).has_value());
        const std::string hidden = HiddenBytes(want), final_norm = FinalBytes(want);
        EXPECT_EQ(*HandedOnXxh64(got, 0), Xxh64(hidden.data(), hidden.size()));
        EXPECT_EQ(*HandedOnXxh64(got, 1), Xxh64(final_norm.data(), final_norm.size()));
      } else {
        EXPECT_FALSE(HandedOnXxh64(got, 0).has_value());
        EXPECT_FALSE(HandedOnXxh64(got, 1).has_value());
      }
    }
  }
}

TEST(StreamAssemblerTest, EncoderStreamAssemblesToTheFileBytes) {
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32, OutputDType::kFp8}) {
    for (bool final_norm : {false, true}) {
      SCOPED_TRACE(OutputDTypeName(dtype) + (final_norm ? " with final norm" : ""));
      const std::vector<v1::ExtractResponse> stream = Stream(dtype, final_norm);
      // header, 3 chunks per tensor (rows 0-1, 2-3, 4), trailer
      ASSERT_EQ(stream.size(), 2 + 3 * (kIds.size() + (final_norm ? 1 : 0)));
      StreamAssembler a(Expect(dtype, final_norm));
      ASSERT_TRUE(Feed(a, stream).ok());
      ASSERT_TRUE(a.complete());
      const SampleTensors got = a.Take();
      const SampleTensors want = EncodeStates(MakeStates(final_norm), dtype);
      EXPECT_EQ(got.capture_ids, want.capture_ids);
      EXPECT_EQ(got.tokens, want.tokens);
      EXPECT_EQ(got.hidden, want.hidden);
      EXPECT_EQ(got.has_final_norm(), want.has_final_norm());
      const std::string hidden = HiddenBytes(got);
      EXPECT_EQ(hidden, HiddenBytes(want));  // [T, L, H], not layer-major
      EXPECT_EQ(FinalBytes(got), FinalBytes(want));
      // the assembled block is that layout itself: layer 0's first row starts it
      if (dtype != OutputDType::kFp8) {
        EXPECT_EQ(Bytes(got.tensors[0].pieces[0], hidden.size()), hidden);
      } else {  // the file's two tensors: row 0's scale starts the scales, its values the values
        const auto [values, scales] = SplitRows(hidden, kHidden);
        EXPECT_EQ(Bytes(got.tensors[0].pieces[1], values.size()), values);
        EXPECT_EQ(Bytes(got.tensors[0].pieces[0], scales.size()), scales);
        if (final_norm) {
          const auto [final_values, final_scales] = SplitRows(FinalBytes(want), kHidden);
          EXPECT_EQ(Bytes(got.tensors.back().pieces[1], final_values.size()), final_values);
          EXPECT_EQ(Bytes(got.tensors.back().pieces[0], final_scales.size()), final_scales);
        }
      }
      // and the values decode back to the states (exact in fp32)
      if (dtype == OutputDType::kFp32) {
        const std::vector<float> values =
            DecodeValues({reinterpret_cast<const uint8_t*>(hidden.data()), hidden.size()}, dtype);
        EXPECT_EQ(values, MakeStates(false).hidden_states);
      }
    }
  }
}

TEST(StreamAssemblerTest, EndWithoutTrailerIsIncomplete) {
  std::vector<v1::ExtractResponse> stream = Stream(OutputDType::kBf16, false);
  stream.pop_back();
  StreamAssembler a(Expect(OutputDType::kBf16, false));
  ASSERT_TRUE(Feed(a, stream).ok());
  EXPECT_FALSE(a.complete());
  EXPECT_EQ(a.EndOfStream(), absl::DataLossError("the stream ended without a trailer (3 of 3 tensors complete)"));
  StreamAssembler whole(Expect(OutputDType::kBf16, false));
  ASSERT_TRUE(Feed(whole, Stream(OutputDType::kBf16, false)).ok());
  EXPECT_TRUE(whole.EndOfStream().ok());
}

// A request without capture ids leaves the final norm to the server
// (--final-norm): an unset expectation takes either header, a set one only its own.
TEST(StreamAssemblerTest, AnUnsetFinalNormTakesWhatTheServerSends) {
  for (const bool sent : {false, true}) {
    SCOPED_TRACE(sent ? "final norm sent" : "no final norm");
    StreamExpectation expect = Expect(OutputDType::kBf16, sent);
    expect.final_norm.reset();
    StreamAssembler a(expect);
    ASSERT_TRUE(Feed(a, Stream(OutputDType::kBf16, sent)).ok());
    ASSERT_TRUE(a.complete());
    EXPECT_EQ(a.Take().has_final_norm(), sent);
    StreamAssembler b(Expect(OutputDType::kBf16, !sent));
    EXPECT_THAT(std::string(Feed(b, Stream(OutputDType::kBf16, sent)).message()), HasSubstr("final_norm"));
  }
}

// With a pool the sample is written into pooled blocks, the same bytes as
// without; the blocks go back when the sample is gone and serve the next one.
TEST(StreamAssemblerTest, APooledSampleHasTheSameBytesAndItsBlocksComeBack) {
  StreamAssembler plain(Expect(OutputDType::kBf16, true));
  ASSERT_TRUE(Feed(plain, Stream(OutputDType::kBf16, true)).ok());
  const SampleTensors want = plain.Take();
  auto pool = StateBytesPool::Create(1 << 20);
  const uint8_t* block = nullptr;
  for (int round = 0; round < 2; ++round) {
    StreamAssembler a(Expect(OutputDType::kBf16, true), StreamAssembler::Mode::kAssemble, pool);
    ASSERT_TRUE(Feed(a, Stream(OutputDType::kBf16, true)).ok());
    ASSERT_TRUE(a.complete());
    const SampleTensors got = a.Take();
    EXPECT_EQ(HiddenBytes(got), HiddenBytes(want));
    EXPECT_EQ(FinalBytes(got), FinalBytes(want));
    EXPECT_EQ(pool->idle_blocks(), 0u);
    if (round == 1) { EXPECT_EQ(got.tensors[0].pieces[0].data(), block); }  // the first sample's block again
    block = got.tensors[0].pieces[0].data();
  }
  EXPECT_EQ(pool->idle_blocks(), 2u);
}

// One way of breaking a valid stream (bf16 with the final norm: tensors 2, 3, 7, -1;
// messages: 0 header, 1-3 capture id 2, 4-6 id 3, 7-9 id 7, 10-12 final norm, 13 trailer).
struct Corruption {
  const char* name;
  std::function<void(std::vector<v1::ExtractResponse>&, StreamExpectation&)> apply;
  const char* message;  // a substring of the error
};

v1::Header& H(std::vector<v1::ExtractResponse>& s) { return *s[0].mutable_header(); }
v1::Chunk& C(std::vector<v1::ExtractResponse>& s, size_t i) { return *s[i].mutable_chunk(); }
v1::Trailer& T(std::vector<v1::ExtractResponse>& s) { return *s.back().mutable_trailer(); }

const Corruption kCorruptions[] = {
    {"second header", [](auto& s, auto&) { s.insert(s.begin() + 1, s[0]); }, "a second header"},
    {"chunk before header", [](auto& s, auto&) { s.erase(s.begin()); }, "a chunk before the header"},
    {"trailer before header", [](auto& s, auto&) { s = {s.back()}; }, "a trailer before the header"},
    {"message after trailer", [](auto& s, auto&) { s.push_back(s[1]); }, "a message after the trailer"},
    {"duplicate trailer", [](auto& s, auto&) { s.push_back(s.back()); }, "a message after the trailer"},
    {"summary", [](auto& s, auto&) { s[1].mutable_summary(); }, "a summary, which was not requested"},
    {"empty message", [](auto& s, auto&) { s[1].Clear(); }, "an empty response message"},
    {"wrong sample id", [](auto& s, auto&) { H(s).set_sample_id("s-2"); }, "sample_id 's-2'"},
    {"wrong token count", [](auto& s, auto&) { H(s).set_num_tokens(kTokens + 1); }, "the header has 6 tokens"},
    {"wrong header token hash", [](auto& s, auto&) { H(s).set_token_ids_xxh64(1); }, "states of other tokens"},
    {"wrong capture ids", [](auto& s, auto&) { H(s).set_capture_ids(2, 8); }, "capture ids [2,3,8], requested [2,3,7]"},
    {"final norm not sent", [](auto& s, auto&) { H(s).set_final_norm(false); }, "the header has final_norm false"},
    {"wrong dtype", [](auto& s, auto&) { H(s).set_dtype(v1::DTYPE_FP16); }, "dtype DTYPE_FP16, requested DTYPE_BF16"},
    {"wrong hidden size", [](auto& s, auto&) { H(s).set_hidden_size(kHidden + 1); }, "hidden size 5, the model 4"},
    {"zero hidden size", [](auto& s, auto& e) { e.hidden_size = 0; H(s).set_hidden_size(0); }, "hidden size 0"},
    {"wrong layer count", [](auto& s, auto&) { H(s).set_num_layers(8); }, "8 layers, the model 7"},
    {"wrong model", [](auto& s, auto&) { H(s).set_model_name("other"); }, "from model 'other'"},
    {"tensors out of order", [](auto& s, auto&) { std::swap(s[1], s[4]); }, "a chunk of capture id 3 while capture id 2"},
    {"gap", [](auto& s, auto&) { s.erase(s.begin() + 2); }, "(a gap)"},
    {"overlap", [](auto& s, auto&) { s.insert(s.begin() + 2, s[1]); }, "(an overlap)"},
    {"zero rows", [](auto& s, auto&) { C(s, 1).set_num_rows(0); }, "are outside [0, 5)"},
    {"rows beyond the end", [](auto& s, auto&) { C(s, 3).set_num_rows(2); }, "are outside [0, 5)"},
    {"short chunk data", [](auto& s, auto&) { C(s, 1).mutable_data()->pop_back(); }, "holds 15 bytes, expected 16"},
    {"chunk after every tensor", [](auto& s, auto&) { s.insert(s.end() - 1, s[1]); }, "after every tensor was complete"},
    {"trailer too early", [](auto& s, auto&) { s.erase(s.end() - 2); }, "the trailer came while the final-norm state had 4 of 5 rows"},
    {"wrong trailer token hash", [](auto& s, auto&) { T(s).set_token_ids_xxh64(1); }, "the trailer's token-id hash"},
    {"checksum of a tensor not sent", [](auto& s, auto&) { T(s).mutable_checksums(0)->set_capture_id(5); }, "checksum for capture id 5, which was not sent"},
    {"two checksums for a tensor", [](auto& s, auto&) { T(s).mutable_checksums(1)->set_capture_id(2); }, "two checksums for capture id 2"},
    {"missing checksum", [](auto& s, auto&) { T(s).mutable_checksums()->RemoveLast(); }, "no checksum for the final-norm state"},
    {"corrupted bytes", [](auto& s, auto&) { (*C(s, 5).mutable_data())[0] ^= 1; }, "capture id 3: the received bytes hash to"},
    {"wrong checksum", [](auto& s, auto&) { T(s).mutable_checksums(2)->set_xxh64(7); }, "capture id 7: the received bytes hash to"},
};

TEST(StreamAssemblerTest, EveryCorruptionIsRefused) {
  for (const Corruption& c : kCorruptions) {
    SCOPED_TRACE(c.name);
    std::vector<v1::ExtractResponse> stream = Stream(OutputDType::kBf16, true);
    ASSERT_EQ(stream.size(), 14u);
    StreamExpectation expect = Expect(OutputDType::kBf16, true);
    c.apply(stream, expect);
    StreamAssembler a(expect);
    const absl::Status s = Feed(a, stream);
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    // Sticky: nothing is accepted after an error, not even a valid header.
    EXPECT_EQ(a.Consume(Stream(OutputDType::kBf16, true)[0]).code(), absl::StatusCode::kDataLoss);
  }
}

// (tensor index, row, column) of values set to all-ones bytes (NaN in every
// dtype); a row of -1 zeroes the whole tensor.
using Edit = std::vector<std::tuple<int, int64_t, int64_t>>;

// The value errors each edit leads to ("" when none).
const std::vector<std::pair<Edit, std::string>>& ValueCases() {
  static const auto* cases = new std::vector<std::pair<Edit, std::string>>{
      {{}, ""},
      {{{2, 1, 3}, {0, 3, 0}}, "non-finite value (nan) in capture id 7 row 1 column 3"},
      {{{1, 2, 1}, {0, 2, 2}}, "non-finite value (nan) in capture id 2 row 2 column 2"},
      {{{1, 0, 0}, {1, 4, 1}}, "non-finite value (nan) in capture id 3 row 0 column 0"},
      {{{1, -1, 0}}, "capture id 3 is all zeros"},
      {{{1, -1, 0}, {2, 4, 3}}, "non-finite value (nan) in capture id 7 row 4 column 3"},
      {{{3, 2, 1}}, "non-finite value (nan) in the final-norm state row 2 column 1"},
      {{{3, -1, 0}}, "the final-norm state is all zeros"},
  };
  return *cases;
}

// Stream(dtype, true) with `edits` made in its chunks' bytes and the
// trailer's checksums recomputed, as a sender that does not check would send it.
// In fp8 a value is a byte after its row's scale, and a zeroed row keeps a
// valid scale (1, as the encoder gives a row of zeros).
std::vector<v1::ExtractResponse> EditedStream(OutputDType dtype, const Edit& edits) {
  std::vector<v1::ExtractResponse> stream = Stream(dtype, true);
  const int64_t size = OutputDTypeSize(dtype);
  const int64_t row_bytes = RowBytes(dtype, kHidden);
  const int64_t first_value = dtype == OutputDType::kFp8 ? kFp8ScaleBytes : 0;
  for (const auto& [tensor, row, column] : edits) {
    for (int c = 0; c < 3; ++c) {  // chunks hold rows 0-1, 2-3, 4
      std::string* data = stream[1 + 3 * tensor + c].mutable_chunk()->mutable_data();
      if (row < 0) {
        std::fill(data->begin(), data->end(), '\0');
        for (size_t at = 0; first_value > 0 && at < data->size(); at += static_cast<size_t>(row_bytes)) {
          const float one = 1.0f;
          data->replace(at, sizeof(one), reinterpret_cast<const char*>(&one), sizeof(one));
        }
      } else if (row / 2 == c) {
        data->replace(static_cast<size_t>((row % 2) * row_bytes + first_value + column * size), size, size, '\xff');
      }
    }
  }
  for (int k = 0; k < 4; ++k) {
    std::string bytes;
    for (int c = 0; c < 3; ++c) bytes += stream[1 + 3 * k + c].chunk().data();
    stream.back().mutable_trailer()->mutable_checksums(k)->set_xxh64(Xxh64(bytes.data(), bytes.size()));
  }
  return stream;
}

const std::vector<std::string> kNames = {"capture id 2", "capture id 3", "capture id 7"};

// The assembler checks each piece's values as it lands (the tensors'
// findings); the errors they lead to must be exactly those of reading the
// states again.
TEST(StreamAssemblerTest, ValuesCheckedOnArrivalGiveTheSameErrorsAsACheckAfterwards) {
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32, OutputDType::kFp8}) {
    for (const auto& [edits, message] : ValueCases()) {
      SCOPED_TRACE(OutputDTypeName(dtype) + ": " + message);
      const std::vector<v1::ExtractResponse> stream = EditedStream(dtype, edits);
      StreamAssembler a(Expect(dtype, true));
      ASSERT_TRUE(Feed(a, stream).ok()) << Feed(a, stream);
      SampleTensors got = a.Take();
      for (const SampleTensor& tensor : got.tensors) ASSERT_TRUE(tensor.findings.has_value());
      const absl::Status on_arrival = CheckSampleValues(got, kNames);
      for (SampleTensor& tensor : got.tensors) tensor.findings.reset();
      const absl::Status afterwards = CheckSampleValues(got, kNames);
      EXPECT_EQ(on_arrival, afterwards);
      EXPECT_EQ(std::string(on_arrival.message()), message);
    }
  }
}

// The serialized messages of `stream`, each cut into slices whose lengths
// follow `cuts` cyclically (as a transport may deliver them): with odd
// lengths, values and rows are split between slices.
std::vector<grpc::ByteBuffer> Sliced(const std::vector<v1::ExtractResponse>& stream, const std::vector<size_t>& cuts) {
  std::vector<grpc::ByteBuffer> out;
  size_t k = 0;
  for (const v1::ExtractResponse& r : stream) {
    const std::string bytes = r.SerializeAsString();
    std::vector<grpc::Slice> slices;
    for (size_t at = 0; at < bytes.size();) {
      const size_t n = std::min(bytes.size() - at, cuts[k++ % cuts.size()]);
      slices.emplace_back(bytes.data() + at, n);
      at += n;
    }
    out.emplace_back(slices.data(), slices.size());
  }
  return out;
}

// A sample of at least StreamAssembler's uncached-copy size (2 MiB) is
// copied into its blocks with streaming stores (uncached_copy.h): the same
// bytes as the encoder's, whatever alignment the received pieces give each
// copy (slices cut at odd lengths, rows interleaved across layers).
TEST(StreamAssemblerTest, ALargeSampleAssemblesToTheFileBytesFromPiecesCutAnywhere) {
  const Shape large{300, 1792};  // bf16: 3 layers of 300 x 1792 = 3.2 MB, and a final norm
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32, OutputDType::kFp8}) {
    const Shape shape = dtype == OutputDType::kFp8 ? Shape{600, 1792} : large;  // fp8: half the bytes a row
    const std::vector<v1::ExtractResponse> stream = Stream(dtype, true, kIds, ChecksumKind::kXxh3, shape);
    const SampleTensors want = EncodeStates(MakeStates(true, kIds, shape), dtype);
    ASSERT_GE(want.layer_bytes(), int64_t{2} << 20);
    for (const std::vector<size_t>& cuts : std::vector<std::vector<size_t>>{{size_t{1} << 20}, {4093, 7, 1}}) {
      SCOPED_TRACE(OutputDTypeName(dtype) + ", cuts of " + std::to_string(cuts[0]) + "...");
      StreamAssembler a(Expect(dtype, true, kIds, ChecksumKind::kXxh3, shape));
      for (const grpc::ByteBuffer& message : Sliced(stream, cuts)) ASSERT_TRUE(a.Consume(message).ok());
      ASSERT_TRUE(a.complete());
      const SampleTensors got = a.Take();
      EXPECT_TRUE(HiddenBytes(got) == HiddenBytes(want));  // not EXPECT_EQ: it would print megabytes
      EXPECT_TRUE(FinalBytes(got) == FinalBytes(want));
    }
  }
}

// fp8 rows as sent (a scale, then `hidden` e4m3 values, each) dequantized to bf16 bytes.
std::string Dequantized(const std::string& rows, int64_t hidden) {
  const auto [values, scales] = SplitRows(rows, hidden);
  std::string out(values.size() * 2, '\0');
  DequantizeFp8ToBf16(reinterpret_cast<const uint8_t*>(values.data()), reinterpret_cast<const float*>(scales.data()),
                      static_cast<int64_t>(scales.size() / 4), hidden, reinterpret_cast<uint16_t*>(out.data()));
  return out;
}

// kAssembleDequantized: an fp8 stream's values are dequantized as they arrive into bf16 blocks (from a
// pool or not), which hold what DequantizeFp8ToBf16 makes of the file's e4m3 values and scales, bit for
// bit, however the pieces cut the rows (a scale split across pieces included). (For the other dtypes
// the mode is kAssemble: the fuzzer compares them.)
TEST(StreamAssemblerTest, DequantizedOnArrivalIsTheDequantizedFile) {
  auto pool = StateBytesPool::Create(size_t{64} << 20);
  for (const Shape shape : {Shape{}, Shape{600, 1792}}) {  // the second takes the uncached path
    for (const bool final_norm : {false, true}) {
      const auto stream = Stream(OutputDType::kFp8, final_norm, kIds, ChecksumKind::kXxh64, shape);
      const SampleTensors file = EncodeStates(MakeStates(final_norm, kIds, shape), OutputDType::kFp8);
      const std::string want = Dequantized(HiddenBytes(file), shape.hidden);
      const std::string want_final = Dequantized(FinalBytes(file), shape.hidden);
      for (const std::vector<size_t>& cuts : std::vector<std::vector<size_t>>{{size_t{1} << 20}, {4093, 7, 1}, {3}}) {
        SCOPED_TRACE(::testing::Message() << shape.tokens << " tokens, norm " << final_norm << ", cut " << cuts[0]);
        StreamAssembler a(Expect(OutputDType::kFp8, final_norm, kIds, ChecksumKind::kXxh64, shape),
                          StreamAssembler::Mode::kAssembleDequantized, cuts.size() > 1 ? pool : nullptr);
        for (const grpc::ByteBuffer& message : Sliced(stream, cuts)) ASSERT_TRUE(a.Consume(message).ok());
        ASSERT_TRUE(a.complete());
        const SampleTensors got = a.Take();
        ASSERT_TRUE(CheckSampleValues(got).ok());
        EXPECT_TRUE(Bytes(got.tensors.front().pieces.front(), want.size()) == want);  // not EXPECT_EQ: megabytes
        EXPECT_TRUE(!final_norm || Bytes(got.tensors.back().pieces.front(), want_final.size()) == want_final);
      }
    }
  }
}

// What one mode concludes about a stream: the first error, else the value
// checks' verdict; and the sample it delivers.
struct Outcome {
  absl::Status status;
  bool has_sample = false;
  SampleTensors sample{};
};

Outcome Judge(StreamAssembler& a, absl::Status fed) {
  if (!fed.ok()) return {fed};
  if (!a.complete()) return {absl::DataLossError("incomplete")};
  Outcome o{absl::OkStatus(), true, a.Take()};
  o.status = CheckSampleValues(o.sample, kNames);
  return o;
}

// hsx-dump --discard verifies chunks in the received slices without
// assembling them (kVerifyOnly), carrying the bytes of a value split between
// two slices. Cut at odd offsets, every stream must get the verdict the
// assembling path gives its parsed messages: the same value errors (row,
// column and value), the same checksum errors (which print the digest), the
// same digests handed on, and the byte counts of what it dropped.
TEST(StreamAssemblerTest, VerifyOnlyFromSlicesCutMidValueGivesTheAssemblingVerdicts) {
  const std::vector<std::vector<size_t>> cut_patterns = {{1}, {3}, {5, 1, 7, 3}, {13, 2, 9}, {1000}};
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32}) {
    // The value cases, and two whose checksums no longer match (bytes changed
    // after the trailer was made).
    std::vector<std::pair<std::string, std::vector<v1::ExtractResponse>>> streams;
    for (const auto& [edits, message] : ValueCases()) streams.emplace_back(message, EditedStream(dtype, edits));
    streams.emplace_back("flipped bit", Stream(dtype, true));
    (*streams.back().second[5].mutable_chunk()->mutable_data())[3] ^= 0x10;
    streams.emplace_back("NaN, trailer not updated", Stream(dtype, true));
    streams.back().second[11].mutable_chunk()->mutable_data()->replace(1, 4, 4, '\xff');
    for (const auto& [what, stream] : streams) {
      for (const std::vector<size_t>& cuts : cut_patterns) {
        SCOPED_TRACE(OutputDTypeName(dtype) + ": " + what + ", cuts of " + std::to_string(cuts[0]) + "...");
        StreamAssembler assembling(Expect(dtype, true));
        StreamAssembler verifying(Expect(dtype, true), StreamAssembler::Mode::kVerifyOnly);
        StreamAssembler keeping(Expect(dtype, true), StreamAssembler::Mode::kKeepReceived);
        absl::Status fed, kept;
        for (const grpc::ByteBuffer& message : Sliced(stream, cuts)) {
          if (fed = verifying.Consume(message); !fed.ok()) break;
        }
        for (const grpc::ByteBuffer& message : Sliced(stream, cuts)) {
          if (kept = keeping.Consume(message); !kept.ok()) break;
        }
        const Outcome want = Judge(assembling, Feed(assembling, stream));
        const Outcome got = Judge(verifying, fed);
        EXPECT_EQ(got.status, want.status);
        EXPECT_EQ(Judge(keeping, kept).status, want.status);  // kKeepReceived: the same checks
        if (what.empty()) { EXPECT_TRUE(got.status.ok()) << got.status; }
        ASSERT_EQ(got.has_sample, want.has_sample);
        if (!want.has_sample) continue;  // refused at the trailer
        ASSERT_TRUE(got.sample.dropped);
        for (const SampleTensor& tensor : got.sample.tensors) EXPECT_TRUE(tensor.pieces.empty());
        const std::string want_final = FinalBytes(want.sample);
        EXPECT_EQ(got.sample.layer_bytes(), static_cast<int64_t>(HiddenBytes(want.sample).size()));
        EXPECT_EQ(got.sample.tensors.back().bytes, static_cast<int64_t>(want_final.size()));
        EXPECT_EQ(HandedOnXxh64(got.sample, 3), HandedOnXxh64(want.sample, 3));
        ASSERT_TRUE(HandedOnXxh64(got.sample, 3).has_value());
        EXPECT_EQ(*HandedOnXxh64(got.sample, 3), Xxh64(want_final.data(), want_final.size()));
      }
    }
  }
  // One layer: its digest is handed on too.
  StreamAssembler assembling(Expect(OutputDType::kBf16, false, {3}));
  StreamAssembler verifying(Expect(OutputDType::kBf16, false, {3}), StreamAssembler::Mode::kVerifyOnly);
  const std::vector<v1::ExtractResponse> stream = Stream(OutputDType::kBf16, false, {3});
  ASSERT_TRUE(Feed(assembling, stream).ok());
  for (const grpc::ByteBuffer& message : Sliced(stream, {3, 1})) ASSERT_TRUE(verifying.Consume(message).ok());
  ASSERT_TRUE(assembling.complete() && verifying.complete());
  const SampleTensors a = assembling.Take(), v = verifying.Take();
  ASSERT_TRUE(HandedOnXxh64(v, 0).has_value());
  EXPECT_EQ(HandedOnXxh64(v, 0), HandedOnXxh64(a, 0));
  EXPECT_EQ(v.layer_bytes(), static_cast<int64_t>(HiddenBytes(a).size()));
}

// The input line and model facts of the files these tests write.
InputSample FileInput() {
  InputSample input;
  input.id = "s-1";
  input.input_ids = kTokenIds;
  return input;
}

SampleFileInfo FileInfo() {
  SampleFileInfo info;
  info.model_name = "tiny";
  info.num_layers = 7;
  return info;
}

std::string FileBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// hsx-dump's disk path keeps the received slices (kKeepReceived) and writes
// the file from them: hidden_states' rows walked t-major across the layers'
// pieces, a row often split between two slices (cuts at odd offsets), the
// final norm's pieces as they are. The file must be byte for byte the one
// written from the assembled copy, with the same digest, for every dtype,
// one or several layers, with and without the final norm; after the
// messages themselves are gone (the sample holds the slices). The parsed
// path (a copy of each chunk's data) must write the same file too.
TEST(StreamAssemblerTest, KeptSlicesWriteTheFileTheAssembledCopyWrites) {
  const std::vector<std::vector<size_t>> cut_patterns = {{1}, {3}, {5, 1, 7, 3}, {13, 2, 9}, {1000}};
  InputSample input = FileInput();
  input.index = 4;
  input.loss_mask = std::vector<int64_t>{0, 1, 1, 0, 1};
  const SampleFileInfo info = FileInfo();
  const std::string dir = OwnDir();
  for (OutputDType dtype : {OutputDType::kBf16, OutputDType::kFp16, OutputDType::kFp32, OutputDType::kFp8}) {
    for (const std::vector<int>& ids : {kIds, std::vector<int>{3}}) {
      for (bool final_norm : {true, false}) {
        const std::vector<v1::ExtractResponse> stream = Stream(dtype, final_norm, ids);
        StreamAssembler assembling(Expect(dtype, final_norm, ids));
        ASSERT_TRUE(Feed(assembling, stream).ok());
        ASSERT_TRUE(assembling.complete());
        const SampleTensors want = assembling.Take();
        WrittenDigest want_digest;
        ASSERT_TRUE(WriteSampleFile(dir + "/copy.safetensors", input, want, info, &want_digest).ok());
        const std::string want_bytes = FileBytes(dir + "/copy.safetensors");
        ASSERT_EQ(want_digest.bytes, want_bytes.size());
        for (size_t pattern = 0; pattern <= cut_patterns.size(); ++pattern) {
          const bool parsed = pattern == cut_patterns.size();
          SCOPED_TRACE(OutputDTypeName(dtype) + ", " + std::to_string(ids.size()) + " layers" +
                       (final_norm ? " + final norm" : "") +
                       (parsed ? ", parsed messages" : ", cuts of " + std::to_string(cut_patterns[pattern][0]) + "..."));
          StreamAssembler keeping(Expect(dtype, final_norm, ids), StreamAssembler::Mode::kKeepReceived);
          if (parsed) {
            ASSERT_TRUE(Feed(keeping, stream).ok());
          } else {
            for (const grpc::ByteBuffer& message : Sliced(stream, cut_patterns[pattern])) {
              ASSERT_TRUE(keeping.Consume(message).ok());
            }
          }  // the messages are gone
          ASSERT_TRUE(keeping.complete());
          const SampleTensors got = keeping.Take();
          ASSERT_FALSE(got.dropped);
          ASSERT_NE(got.owner, nullptr);  // the received slices
          EXPECT_EQ(got.layer_bytes(), static_cast<int64_t>(HiddenBytes(want).size()));
          EXPECT_EQ(got.bytes() - got.layer_bytes(), static_cast<int64_t>(FinalBytes(want).size()));
          for (size_t k = 0; k < got.tensors.size(); ++k) EXPECT_EQ(HandedOnXxh64(got, k), HandedOnXxh64(want, k));
          EXPECT_TRUE(CheckSampleValues(got, kNames).ok());
          WrittenDigest got_digest;
          ASSERT_TRUE(WriteSampleFile(dir + "/kept.safetensors", input, got, info, &got_digest).ok());
          const std::string got_bytes = FileBytes(dir + "/kept.safetensors");
          EXPECT_TRUE(got_bytes == want_bytes) << "the files differ (" << got_bytes.size() << " and "
                                               << want_bytes.size() << " bytes)";
          EXPECT_EQ(got_digest.bytes, want_digest.bytes);
          EXPECT_EQ(got_digest.xxh64, want_digest.xxh64);
          EXPECT_EQ(got_digest.xxh64, Xxh64(got_bytes.data(), got_bytes.size()));
        }
      }
    }
  }
}

// Kept pieces that do not make up the tensors' shape are refused, and no
// file is left behind.
TEST(StreamAssemblerTest, MisshapenKeptPiecesWriteNoFile) {
  StreamAssembler keeping(Expect(OutputDType::kBf16, true), StreamAssembler::Mode::kKeepReceived);
  ASSERT_TRUE(Feed(keeping, Stream(OutputDType::kBf16, true)).ok());
  SampleTensors sample = keeping.Take();
  const std::string path = OwnDir() + "/misshapen.safetensors";
  // one layer's row moved to another: the totals match, the layers do not
  sample.tensors[1].pieces.push_back(sample.tensors[0].pieces.back());
  sample.tensors[0].pieces.pop_back();
  const absl::Status s = WriteSampleFile(path, FileInput(), sample, FileInfo());
  EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(s.message(), HasSubstr("misshapen states"));
  EXPECT_TRUE(FileBytes(path).empty());
}

// The digests the assembler verified are handed on with every tensor (the
// file's checksums take them where the tensor lies in the file as it is: one
// layer; the final norm), and the file is byte for byte the one written
// without them.
TEST(StreamAssemblerTest, HandsOnTheVerifiedDigestsOfContiguousTensors) {
  for (const std::vector<int>& ids : {std::vector<int>{3}, kIds}) {
    SCOPED_TRACE(ids.size());
    StreamAssembler a(Expect(OutputDType::kBf16, true, ids));
    ASSERT_TRUE(Feed(a, Stream(OutputDType::kBf16, true, ids)).ok());
    SampleTensors got = a.Take();
    for (size_t k = 0; k < got.tensors.size(); ++k) {
      const std::string bytes = TensorString(got.tensors[k]);
      ASSERT_TRUE(HandedOnXxh64(got, k).has_value()) << k;
      EXPECT_EQ(*HandedOnXxh64(got, k), Xxh64(bytes.data(), bytes.size())) << k;
    }
    if (ids.size() == 1) {
      const std::string hidden = HiddenBytes(got);
      EXPECT_EQ(*HandedOnXxh64(got, 0), Xxh64(hidden.data(), hidden.size()));
    }
    const InputSample input = FileInput();
    const SampleFileInfo info = FileInfo();
    const std::string dir = OwnDir();
    WrittenDigest with, without;
    ASSERT_TRUE(WriteSampleFile(dir + "/with.safetensors", input, got, info, &with).ok());
    for (SampleTensor& tensor : got.tensors) tensor.findings.reset();
    ASSERT_TRUE(WriteSampleFile(dir + "/without.safetensors", input, got, info, &without).ok());
    EXPECT_EQ(with.xxh64, without.xxh64);
    EXPECT_EQ(with.bytes, without.bytes);
  }
}

}  // namespace
}  // namespace hsx
