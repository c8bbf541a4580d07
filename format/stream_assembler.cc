// stream_assembler.cc: the checks and the reassembly of one response stream.
#include "format/stream_assembler.h"

#include <google/protobuf/io/coded_stream.h>

#include <algorithm>
#include <cstring>
#include <span>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "format/fp8.h"
#include "format/tensor_encoding.h"
#include "format/uncached_copy.h"

namespace hsx {
namespace {

std::string IdsText(const std::vector<int>& ids) { return absl::StrCat("[", absl::StrJoin(ids, ","), "]"); }

std::string TensorName(int capture_id) {
  return capture_id < 0 ? std::string("the final-norm state") : absl::StrCat("capture id ", capture_id);
}

// The stream's checksum: what the header says, which must be what was asked;
// no value at all is a server older than the field, which sends XXH64.
absl::StatusOr<ChecksumKind> HeaderChecksum(int said, ChecksumKind asked) {
  if (said == v1::CHECKSUM_UNSPECIFIED) return ChecksumKind::kXxh64;
  absl::StatusOr<ChecksumKind> kind = ChecksumKindFromProto(said);
  if (!kind.ok()) return absl::DataLossError(absl::StrCat("the header has an unknown checksum ", said));
  if (*kind != asked) {
    return absl::DataLossError(absl::StrCat("the header has checksum ", ChecksumKindName(*kind), ", requested ",
                                            ChecksumKindName(asked)));
  }
  return *kind;
}

}  // namespace

StreamAssembler::StreamAssembler(StreamExpectation expect, Mode mode, std::shared_ptr<StateBytesPool> pool)
    : expect_(std::move(expect)), mode_(mode), pool_(std::move(pool)) {}

StateBytes StreamAssembler::Allocate(int64_t bytes) const {
  const size_t size = static_cast<size_t>(bytes);
  return pool_ != nullptr ? pool_->Take(size) : StateBytes(size);
}

void StreamAssembler::AllocateSample() {
  // Not zero-filled: the chunks write every byte before the trailer is accepted.
  const int64_t tokens = sample_.tokens;
  const int64_t layers = static_cast<int64_t>(sample_.capture_ids.size());
  const bool fp8 = sample_.dtype == OutputDType::kFp8;
  // A row's values (all of it but fp8's scale), which the file's states
  // tensors hold; dequantized fp8, as bf16.
  const bool dequantized = dequantizing();
  const bool scaled = fp8 && !dequantized;  // rows with a scale piece
  const int64_t values = dequantized ? sample_.hidden * 2 : fp8 ? sample_.hidden : row_bytes_;
  auto blocks = std::make_shared<AssembledBlocks>();
  blocks->hidden_states = Allocate(tokens * layers * values);
  if (sample_.has_final_norm()) blocks->final_norm = Allocate(tokens * values);
  if (scaled) {
    blocks->hidden_scales = Allocate(tokens * layers * kFp8ScaleBytes);
    if (sample_.has_final_norm()) blocks->final_scales = Allocate(tokens * kFp8ScaleBytes);
  }
  // Row `slot` of a tensor whose rows lie `stride` rows apart from `first`:
  // its scale (fp8), then its values.
  auto add_rows = [&](std::vector<BytePiece>& pieces, const StateBytes& states, const StateBytes& scales,
                      int64_t first, int64_t stride) {
    const auto* at = reinterpret_cast<const uint8_t*>(states.data());
    if (!scaled && stride == 1) {  // the tensor is the whole block
      pieces.emplace_back(at, states.size());
      return;
    }
    pieces.reserve(static_cast<size_t>(tokens * (scaled ? 2 : 1)));
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t slot = t * stride + first;
      if (scaled) pieces.emplace_back(reinterpret_cast<const uint8_t*>(scales.data()) + slot * kFp8ScaleBytes,
                                   static_cast<size_t>(kFp8ScaleBytes));
      pieces.emplace_back(at + slot * values, static_cast<size_t>(values));
    }
  };
  for (int64_t l = 0; l < layers; ++l) {
    add_rows(sample_.tensors[l].pieces, blocks->hidden_states, blocks->hidden_scales, l, layers);
  }
  if (sample_.has_final_norm()) add_rows(sample_.tensors.back().pieces, blocks->final_norm, blocks->final_scales, 0, 1);
  const size_t held = blocks->hidden_states.size() + blocks->final_norm.size() + blocks->hidden_scales.size() +
                      blocks->final_scales.size();
  uncached_ = held >= kUncachedCopyMinBytes;
  sample_.held_bytes = static_cast<int64_t>(held);
  blocks_ = blocks.get();
  sample_.owner = std::move(blocks);
}

StreamAssembler::~StreamAssembler() = default;

absl::Status StreamAssembler::EndOfStream() const {
  if (trailer_) return absl::OkStatus();
  return absl::DataLossError(absl::StrCat("the stream ended without a trailer (", current_, " of ",
                                          tensors_.size(), " tensors complete)"));
}

absl::Status StreamAssembler::Consume(const v1::ExtractResponse& response) {
  if (!error_.ok()) return error_;  // nothing is accepted after an error
  error_ = Dispatch(response);
  return error_;
}

absl::Status StreamAssembler::Dispatch(const v1::ExtractResponse& response) {
  if (trailer_) return absl::DataLossError("a message after the trailer");
  switch (response.part_case()) {
    case v1::ExtractResponse::kHeader: return OnHeader(response.header());
    case v1::ExtractResponse::kChunk: return OnChunk(response.chunk());
    case v1::ExtractResponse::kTrailer: return OnTrailer(response.trailer());
    case v1::ExtractResponse::kSummary: return absl::DataLossError("a summary, which was not requested");
    default: return absl::DataLossError("an empty response message");
  }
}

absl::Status StreamAssembler::OnHeader(const v1::Header& h) {
  if (header_) return absl::DataLossError("a second header");
  const int64_t tokens = expect_.num_tokens;
  const std::vector<int> ids(h.capture_ids().begin(), h.capture_ids().end());
  if (h.sample_id() != expect_.sample_id) {
    return absl::DataLossError(absl::StrCat("the header is for sample_id '", h.sample_id(), "', requested '",
                                            expect_.sample_id, "'"));
  }
  if (h.num_tokens() != tokens) {
    return absl::DataLossError(absl::StrCat("the header has ", h.num_tokens(), " tokens, the request ", tokens));
  }
  if (h.token_ids_xxh64() != expect_.token_ids_xxh64) {
    return absl::DataLossError(absl::StrFormat(
        "the header's token-id hash %016x differs from the request's %016x (states of other tokens)",
        h.token_ids_xxh64(), expect_.token_ids_xxh64));
  }
  if (ids != expect_.capture_ids) {
    return absl::DataLossError(absl::StrCat("the header has capture ids ", IdsText(ids), ", requested ",
                                            IdsText(expect_.capture_ids)));
  }
  if (expect_.final_norm.has_value() && h.final_norm() != *expect_.final_norm) {
    return absl::DataLossError(absl::StrCat("the header has final_norm ", h.final_norm() ? "true" : "false",
                                            ", requested the opposite"));
  }
  if (h.dtype() != OutputDTypeToProto(expect_.dtype)) {
    return absl::DataLossError(absl::StrCat("the header has dtype ", v1::DType_Name(h.dtype()), ", requested ",
                                            v1::DType_Name(OutputDTypeToProto(expect_.dtype))));
  }
  absl::StatusOr<ChecksumKind> checksum = HeaderChecksum(h.checksum(), expect_.checksum);
  if (!checksum.ok()) return checksum.status();
  const int64_t expected_hidden = expect_.hidden_size;
  if (h.hidden_size() < 1 || h.hidden_size() > (1 << 20) ||
      (expected_hidden > 0 && h.hidden_size() != expected_hidden)) {
    return absl::DataLossError(absl::StrCat("the header has hidden size ", h.hidden_size(),
                                            expected_hidden > 0 ? absl::StrCat(", the model ", expected_hidden) : ""));
  }
  if (expect_.num_layers > 0 && h.num_layers() != 0 && h.num_layers() != expect_.num_layers) {
    return absl::DataLossError(absl::StrCat("the header has ", h.num_layers(), " layers, the model ",
                                            expect_.num_layers));
  }
  if (!expect_.model_name.empty() && !h.model_name().empty() && h.model_name() != expect_.model_name) {
    return absl::DataLossError(absl::StrCat("the header is from model '", h.model_name(), "', expected '",
                                            expect_.model_name, "'"));
  }
  header_ = true;
  sample_.capture_ids = ids;
  sample_.tokens = tokens;
  sample_.hidden = h.hidden_size();
  sample_.dtype = expect_.dtype;
  row_bytes_ = sample_.row_bytes();
  tensors_ = ids;
  if (h.final_norm()) tensors_.push_back(-1);
  for (int id : tensors_) {
    SampleTensor& tensor = sample_.tensors.emplace_back();
    tensor.capture_id = id;
    tensor.findings.emplace().checksum_kind = *checksum;
  }
  if (assembling()) {
    AllocateSample();
  } else if (mode_ == Mode::kKeepReceived) {
    kept_ = std::make_shared<std::vector<std::vector<grpc::Slice>>>();
    sample_.owner = kept_;
  } else {
    sample_.dropped = true;
  }
  hash_.emplace(*checksum);
  return absl::OkStatus();
}

absl::Status StreamAssembler::OnChunk(const v1::Chunk& c) {
  std::vector<grpc::Slice> slices;
  BytePiece data(reinterpret_cast<const uint8_t*>(c.data().data()), c.data().size());
  if (mode_ == Mode::kKeepReceived) {  // the message dies: keep a copy of its data
    slices.emplace_back(c.data().data(), c.data().size());
    data = BytePiece(slices[0].begin(), slices[0].size());
  }
  return OnChunkData(c.capture_id(), c.first_row(), c.num_rows(), {data}, &slices);
}

absl::Status StreamAssembler::OnChunkData(int32_t capture_id, int64_t first_row, int64_t num_rows,
                                          const Pieces& data, std::vector<grpc::Slice>* slices) {
  if (trailer_) return absl::DataLossError("a message after the trailer");
  if (!header_) return absl::DataLossError("a chunk before the header");
  if (current_ >= tensors_.size()) {
    return absl::DataLossError(absl::StrCat("a chunk of ", TensorName(capture_id),
                                            " after every tensor was complete"));
  }
  const int want = tensors_[current_];
  const int64_t tokens = sample_.tokens;
  if (capture_id != want) {
    return absl::DataLossError(absl::StrCat(
        "a chunk of ", TensorName(capture_id), " while ", TensorName(want), " has ", rows_, " of ", tokens,
        " rows (expected layer after layer: capture ids ascending, then the final norm)"));
  }
  if (first_row != rows_) {
    return absl::DataLossError(absl::StrCat("chunk rows [", first_row, ", ", first_row + num_rows,
                                            ") of ", TensorName(want), ": expected first row ", rows_,
                                            first_row > rows_ ? " (a gap)" : " (an overlap)"));
  }
  if (num_rows < 1 || num_rows > tokens - rows_) {
    return absl::DataLossError(absl::StrCat("chunk rows [", first_row, ", ", first_row + num_rows,
                                            ") of ", TensorName(want), " are outside [0, ", tokens, ")"));
  }
  size_t size = 0;
  for (const BytePiece& piece : data) size += piece.size();
  if (static_cast<int64_t>(size) != num_rows * row_bytes_) {
    return absl::DataLossError(absl::StrCat("a chunk of ", num_rows, " rows of ", TensorName(want), " holds ",
                                            size, " bytes, expected ", num_rows * row_bytes_,
                                            " (whole rows of ", sample_.hidden, " values)"));
  }
  // Block by block, so that the copy, the hash and the check read bytes
  // still in L1.
  constexpr size_t kBlock = 16 << 10;
  int64_t offset = 0;
  for (const BytePiece& piece : data) {
    const char* bytes = reinterpret_cast<const char*>(piece.data());
    for (size_t done = 0; done < piece.size();) {
      const size_t n = std::min(piece.size() - done, kBlock);
      if (assembling()) CopyIntoSample(bytes + done, n, offset);
      HashAndCheck(bytes + done, n);
      done += n;
      offset += static_cast<int64_t>(n);
    }
  }
  SampleTensor& tensor = sample_.tensors[current_];
  if (mode_ == Mode::kKeepReceived) {
    // The pieces stay valid: moving the vector keeps its elements in place.
    tensor.pieces.insert(tensor.pieces.end(), data.begin(), data.end());
    kept_->push_back(std::move(*slices));
    sample_.held_bytes += offset;
  }
  tensor.bytes += offset;
  rows_ += num_rows;
  if (rows_ == tokens) {
    tensor.findings->checksum = hash_->Digest();
    hash_->Reset();
    ++current_;
    rows_ = 0;
    values_ = 0;
  }
  return absl::OkStatus();
}

void StreamAssembler::CopyIntoSample(const char* bytes, size_t length, int64_t offset) {
  if (sample_.dtype == OutputDType::kFp8) {
    CopyFp8IntoSample(bytes, length, offset);
    return;
  }
  // Rows of one tensor are contiguous in the final norm, interleaved with
  // the other layers in hidden_states: there, copy row piece by row piece.
  const int want = tensors_[current_];
  const int64_t layers = static_cast<int64_t>(sample_.capture_ids.size());
  const bool contiguous = want < 0 || layers == 1;
  for (size_t done = 0; done < length;) {
    const int64_t at = offset + static_cast<int64_t>(done);
    const int64_t row = rows_ + at / row_bytes_;
    char* base = want < 0 ? blocks_->final_norm.data() + row * row_bytes_
                          : blocks_->hidden_states.data() + (row * layers + static_cast<int64_t>(current_)) * row_bytes_;
    const size_t n = contiguous ? length - done
                                : std::min<size_t>(length - done, static_cast<size_t>(row_bytes_ - at % row_bytes_));
    CopyBytes(base + at % row_bytes_, bytes + done, n);
    done += n;
  }
}

void StreamAssembler::CopyFp8IntoSample(const char* bytes, size_t length, int64_t offset) {
  // The file's layout: a row's scale to the scales, its values to the states.
  const bool final_norm = tensors_[current_] < 0;
  const int64_t layers = static_cast<int64_t>(sample_.capture_ids.size());
  const int64_t hidden = sample_.hidden;
  char* states = final_norm ? blocks_->final_norm.data() : blocks_->hidden_states.data();
  char* scales = final_norm ? blocks_->final_scales.data() : blocks_->hidden_scales.data();
  const bool dequantize = dequantizing();
  ForEachFp8RowPart(rows_ * row_bytes_ + offset, bytes, length, hidden,
                    [&](int64_t row, int64_t at, const char* part, size_t n) {
                      const int64_t slot = final_norm ? row : row * layers + static_cast<int64_t>(current_);
                      if (at < kFp8ScaleBytes) {  // the scale comes first: whole before the values
                        std::memcpy(dequantize ? row_scale_ + at : scales + slot * kFp8ScaleBytes + at, part, n);
                      } else if (dequantize) {
                        float scale;
                        std::memcpy(&scale, row_scale_, sizeof(scale));
                        DequantizeFp8ToBf16(reinterpret_cast<const uint8_t*>(part), &scale, 1,
                                            static_cast<int64_t>(n),
                                            reinterpret_cast<uint16_t*>(states) + slot * hidden +
                                                (at - kFp8ScaleBytes),
                                            uncached_);
                      } else {
                        CopyBytes(states + slot * hidden + (at - kFp8ScaleBytes), part, n);
                      }
                    });
}

void StreamAssembler::CopyBytes(char* to, const char* from, size_t n) const {
  if (uncached_) {
    CopyUncached(to, from, n);
  } else {
    std::memcpy(to, from, n);
  }
}

void StreamAssembler::HashAndCheck(const char* bytes, size_t length) {
  hash_->Update(bytes, length);
  if (sample_.dtype == OutputDType::kFp8) {
    CheckFp8Rows(bytes, length);
    return;
  }
  const size_t size = static_cast<size_t>(OutputDTypeSize(sample_.dtype));
  if (carried_ > 0) {  // complete the value the last piece began
    const size_t n = std::min(size - carried_, length);
    std::memcpy(carry_ + carried_, bytes, n);
    carried_ += n;
    bytes += n;
    length -= n;
    if (carried_ < size) return;
    CheckValues(carry_, 1);
    carried_ = 0;
  }
  CheckValues(bytes, static_cast<int64_t>(length / size));
  carried_ = length % size;
  std::memcpy(carry_, bytes + length - carried_, carried_);
}

void StreamAssembler::CheckValues(const char* bytes, int64_t count) {
  TensorFindings& found = *sample_.tensors[current_].findings;
  // After a bad value the tensor is an error already: CheckSampleValues
  // reports its first one.
  if (count > 0 && found.bad_index < 0) {
    bool any = false;
    const int64_t bad = CheckEncoded(bytes, count, sample_.dtype, &any);
    found.nonzero |= any;
    if (bad >= 0) {
      const size_t size = static_cast<size_t>(OutputDTypeSize(sample_.dtype));
      found.bad_index = values_ + bad;
      found.bad_value = DecodeValues(
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes) + bad * static_cast<int64_t>(size), size),
          sample_.dtype)[0];
    }
  }
  values_ += count;
}

void StreamAssembler::CheckFp8Rows(const char* bytes, size_t length) {
  // values_ counts the tensor's bytes here; a row is its scale, then its values.
  TensorFindings& found = *sample_.tensors[current_].findings;
  ForEachFp8RowPart(values_, bytes, length, sample_.hidden, [&](int64_t row, int64_t at, const char* part, size_t n) {
    if (at < kFp8ScaleBytes) {  // the scale, which may be split between pieces
      std::memcpy(carry_ + at, part, n);
      float scale;
      std::memcpy(&scale, carry_, sizeof(scale));
      if (at + static_cast<int64_t>(n) == kFp8ScaleBytes && found.bad_index < 0 && !ValidFp8Scale(scale)) {
        found.bad_index = row * sample_.hidden;
        found.bad_value = scale;
        found.bad_scale = true;
      }
      return;
    }
    bool any = false;
    const int64_t bad = CheckFp8Bytes(part, static_cast<int64_t>(n), &any);
    found.nonzero |= any;
    if (bad >= 0 && found.bad_index < 0) {
      found.bad_index = row * sample_.hidden + (at - kFp8ScaleBytes) + bad;
      found.bad_value = Fp8E4m3ToFloat(static_cast<uint8_t>(part[bad]));
    }
  });
  values_ += static_cast<int64_t>(length);
}

absl::Status StreamAssembler::Consume(const grpc::ByteBuffer& message) {
  if (!error_.ok()) return error_;
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) return error_ = absl::DataLossError("an unreadable response message");
  // The fast path: exactly ExtractResponse{chunk: {fields 1-4}}.
  std::vector<BytePiece> received;
  received.reserve(slices.size());
  for (const grpc::Slice& slice : slices) received.emplace_back(slice.begin(), slice.size());
  PieceReader reader(received);
  uint8_t tag = 0;
  uint64_t length = 0;
  if (reader.Byte(&tag) && tag == ((2 << 3) | 2) && reader.Varint(&length) && length == message.Length() -
      (1 + google::protobuf::io::CodedOutputStream::VarintSize64(length))) {
    uint64_t fields[4] = {0, 0, 0, 0};
    Pieces data;
    bool known = true;
    while (known && !reader.done()) {
      uint64_t key;
      if (!reader.Varint(&key)) return error_ = absl::DataLossError("a truncated chunk message");
      const uint64_t field = key >> 3, wire = key & 7;
      if (field >= 1 && field <= 3 && wire == 0) {
        if (!reader.Varint(&fields[field])) return error_ = absl::DataLossError("a truncated chunk message");
      } else if (field == 4 && wire == 2 && data.empty()) {
        uint64_t size;
        if (!reader.Varint(&size) || !reader.Take(size, &data)) {
          return error_ = absl::DataLossError("a truncated chunk message");
        }
      } else {
        known = false;  // something else: let the generated parser decide
      }
    }
    if (known) {
      error_ = OnChunkData(static_cast<int32_t>(fields[1]), static_cast<int64_t>(fields[2]),
                           static_cast<int64_t>(fields[3]), data, &slices);
      return error_;
    }
  }
  std::string bytes;
  for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  v1::ExtractResponse response;
  if (!response.ParseFromString(bytes)) return error_ = absl::DataLossError("a response message that does not parse");
  return Consume(response);
}

absl::Status StreamAssembler::OnTrailer(const v1::Trailer& t) {
  if (!header_) return absl::DataLossError("a trailer before the header");
  if (current_ < tensors_.size()) {
    return absl::DataLossError(absl::StrCat("the trailer came while ", TensorName(tensors_[current_]), " had ",
                                            rows_, " of ", sample_.tokens, " rows"));
  }
  if (t.token_ids_xxh64() != expect_.token_ids_xxh64) {
    return absl::DataLossError(absl::StrFormat("the trailer's token-id hash %016x differs from the request's %016x",
                                               t.token_ids_xxh64(), expect_.token_ids_xxh64));
  }
  std::vector<int> seen(tensors_.size(), 0);
  for (const v1::TensorChecksum& checksum : t.checksums()) {
    const auto it = std::find(tensors_.begin(), tensors_.end(), checksum.capture_id());
    if (it == tensors_.end()) {
      return absl::DataLossError(absl::StrCat("the trailer has a checksum for ", TensorName(checksum.capture_id()),
                                              ", which was not sent"));
    }
    const size_t i = static_cast<size_t>(it - tensors_.begin());
    if (seen[i]++) {
      return absl::DataLossError(absl::StrCat("the trailer has two checksums for ", TensorName(tensors_[i])));
    }
    const bool xxh3 = hash_->kind() == ChecksumKind::kXxh3;
    const uint64_t said = xxh3 ? checksum.xxh3_64() : checksum.xxh64();
    const uint64_t digest = sample_.tensors[i].findings->checksum;
    if (said != digest) {
      return absl::DataLossError(absl::StrFormat(
          "%s: the received bytes hash to %016x (%s), the trailer says %016x (corrupted in transit or assembled wrongly)",
          TensorName(tensors_[i]), digest, ChecksumKindName(hash_->kind()), said));
    }
  }
  for (size_t i = 0; i < tensors_.size(); ++i) {
    if (!seen[i]) return absl::DataLossError(absl::StrCat("the trailer has no checksum for ", TensorName(tensors_[i])));
  }
  // The sample is whole: from here on it may be read on another thread.
  if (uncached_) FenceUncachedCopies();
  trailer_ = true;
  return absl::OkStatus();
}

}  // namespace hsx
