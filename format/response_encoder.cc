// response_encoder.cc: the one-pass encoding, then header, framed chunks,
// summary and trailer.
#include "format/response_encoder.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/proto_dtype.h"
#include "format/response_framing.h"
#include "format/tensor_encoding.h"

namespace hsx {

absl::StatusOr<std::unique_ptr<ResponseEncoder>> ResponseEncoder::Create(SampleView view, EncoderOptions options,
                                                                         const Allocator& allocate) {
  std::unique_ptr<ResponseEncoder> encoder(new ResponseEncoder(std::move(options), view.capture_ids,
                                                               view.final_norm != nullptr, view.tokens, view.hidden));
  if (absl::Status status = encoder->EncodeAll(view, allocate); !status.ok()) return status;
  return encoder;
}

ResponseEncoder::ResponseEncoder(EncoderOptions options, std::vector<int> capture_ids, bool final_norm,
                                 int64_t tokens, int64_t hidden)
    : options_(std::move(options)),
      capture_ids_(std::move(capture_ids)),
      final_norm_(final_norm),
      tokens_(tokens),
      hidden_(hidden) {
  const int64_t row_bytes = hidden_ * OutputDTypeSize(options_.dtype);
  rows_per_chunk_ = std::max<int64_t>(1, options_.max_chunk_bytes / std::max<int64_t>(1, row_bytes));
}

int64_t ResponseEncoder::held_bytes() const { return held_bytes_; }

int ResponseEncoder::capture_id(int tensor) const {
  return tensor < static_cast<int>(capture_ids_.size()) ? capture_ids_[tensor] : -1;
}

int64_t ResponseEncoder::tensor_bytes() const { return tokens_ * hidden_ * OutputDTypeSize(options_.dtype); }

const char* ResponseEncoder::tensor_data(int tensor) const { return tensors_[tensor]; }

namespace {

absl::Status BadValue(int id, int64_t index, int64_t hidden, float value) {
  return absl::InternalError(absl::StrCat("capture id ", id, ": value ", value, " at row ", index / hidden, ", column ",
                                          index % hidden,
                                          std::isfinite(value) ? " overflows fp16 (ask for bf16 or fp32)"
                                                               : " is not finite"));
}

absl::Status AllZero(int id) { return absl::InternalError(absl::StrCat("capture id ", id, ": every value is zero")); }

// The rows can be sent as they are: already in the output dtype (bf16 -> bf16,
// f32 -> fp32: the conversion is the identity), and their owner keeps no
// more than the rows sent (so holding it is the bound docs/api.md states).
bool SendInPlace(const SampleView& view, OutputDType dtype) {
  return SentAsIs(view.type, dtype) && view.owner != nullptr && view.held_bytes == view.view_bytes();
}

// The capture copy's findings for these rows, when it checked and hashed them
// as `options` asks.
const std::vector<TensorEncoding>* CheckedInCopy(const SampleView& view, const EncoderOptions& options) {
  const bool usable = view.checked.has_value() && view.checked->check == RowCheck{options.dtype, options.checksum} &&
                      static_cast<int>(view.checked->tensors.size()) == view.num_tensors();
  return usable ? &view.checked->tensors : nullptr;
}

}  // namespace

absl::Status ResponseEncoder::EncodeAll(const SampleView& view, const Allocator& allocate) {
  std::vector<const void*> sources = view.layers;
  if (view.final_norm != nullptr) sources.push_back(view.final_norm);
  if (SendInPlace(view, options_.dtype)) return CheckInPlace(view, sources);
  const size_t bytes = sources.size() * static_cast<size_t>(tensor_bytes());
  absl::StatusOr<std::unique_ptr<HostBuffer>> buffer = allocate(std::max<size_t>(bytes, 1));
  if (!buffer.ok()) return buffer.status();
  std::shared_ptr<HostBuffer> encoded = *std::move(buffer);
  for (size_t k = 0; k < sources.size(); ++k) {
    const int id = capture_id(static_cast<int>(k));
    char* dst = static_cast<char*>(encoded->data()) + k * tensor_bytes();
    const TensorEncoding e = EncodeTensor(sources[k], view.type, tokens_ * hidden_, options_.dtype, dst, options_.checksum);
    if (e.bad_index >= 0) return BadValue(id, e.bad_index, hidden_, e.bad_value);
    if (!e.nonzero) return AllZero(id);
    checksums_.push_back(e.checksum);
    tensors_.push_back(dst);
  }
  held_bytes_ = static_cast<int64_t>(encoded->bytes());
  owner_ = std::move(encoded);
  return absl::OkStatus();
}

absl::Status ResponseEncoder::CheckInPlace(const SampleView& view, const std::vector<const void*>& sources) {
  const std::vector<TensorEncoding>* checked = CheckedInCopy(view, options_);
  for (size_t k = 0; k < sources.size(); ++k) {
    const int id = capture_id(static_cast<int>(k));
    const TensorEncoding e = checked != nullptr ? (*checked)[k]
                                                : CheckTensor(sources[k], tokens_ * hidden_, options_.dtype,
                                                              options_.checksum);
    if (e.bad_index >= 0) return BadValue(id, e.bad_index, hidden_, e.bad_value);
    if (!e.nonzero) return AllZero(id);
    checksums_.push_back(e.checksum);
    tensors_.push_back(static_cast<const char*>(sources[k]));
  }
  held_bytes_ = view.held_bytes;
  owner_ = view.owner;
  return absl::OkStatus();
}

void ResponseEncoder::FillSummary(v1::Summary* summary) const {
  const int64_t row_bytes = hidden_ * OutputDTypeSize(options_.dtype);
  for (int k = 0; k < num_tensors(); ++k) {
    double sum = 0, sum_sq = 0, lo = INFINITY, hi = -INFINITY;
    v1::TensorStats* stats = summary->add_tensors();
    stats->set_capture_id(capture_id(k));
    for (int64_t t = 0; t < tokens_; ++t) {
      const std::vector<float> values = DecodeValues(
          std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(tensor_data(k)) + t * row_bytes, row_bytes),
          options_.dtype);
      for (float v : values) {
        sum += v;
        sum_sq += static_cast<double>(v) * v;
        lo = std::min<double>(lo, v);
        hi = std::max<double>(hi, v);
      }
      if (t == 0) {
        for (int64_t j = 0; j < std::min<int64_t>(kSummaryFirstValues, hidden_); ++j) stats->add_first_values(values[j]);
      }
    }
    const double count = static_cast<double>(tokens_ * hidden_);
    const double mean = sum / count;
    stats->set_mean(mean);
    stats->set_std(std::sqrt(std::max(0.0, sum_sq / count - mean * mean)));
    stats->set_min(lo);
    stats->set_max(hi);
  }
}

bool ResponseEncoder::Next(grpc::ByteBuffer* out) {
  v1::ExtractResponse message;
  switch (stage_) {
    case Stage::kHeader: {
      v1::Header* header = message.mutable_header();
      header->set_sample_id(options_.sample_id);
      header->set_num_tokens(tokens_);
      header->set_token_ids_xxh64(options_.token_ids_hash);
      header->set_token_ids_xxh64_hex(absl::StrFormat("%016x", options_.token_ids_hash));
      for (int id : capture_ids_) header->add_capture_ids(id);
      header->set_final_norm(final_norm_);
      header->set_hidden_size(static_cast<int32_t>(hidden_));
      header->set_dtype(OutputDTypeToProto(options_.dtype));
      header->set_layer_convention(options_.layer_convention);
      header->set_model_name(options_.model_name);
      header->set_num_layers(static_cast<int32_t>(options_.num_layers));
      header->set_checksum(ChecksumKindToProto(options_.checksum));
      stage_ = options_.summary ? Stage::kSummary : num_tensors() == 0 ? Stage::kTrailer : Stage::kBody;
      break;
    }
    case Stage::kSummary: {
      FillSummary(message.mutable_summary());
      stage_ = Stage::kTrailer;
      break;
    }
    case Stage::kBody: {
      const int64_t count = std::min(rows_per_chunk_, tokens_ - next_row_);
      const int64_t row_bytes = hidden_ * OutputDTypeSize(options_.dtype);
      *out = ChunkResponse(capture_id(tensor_), next_row_, count, tensor_data(tensor_) + next_row_ * row_bytes,
                           static_cast<size_t>(count * row_bytes), owner_);
      next_row_ += count;
      if (next_row_ == tokens_) {
        next_row_ = 0;
        if (++tensor_ == num_tensors()) stage_ = Stage::kTrailer;
      }
      return true;
    }
    case Stage::kTrailer: {
      v1::Trailer* trailer = message.mutable_trailer();
      for (int k = 0; k < num_tensors(); ++k) {
        v1::TensorChecksum* checksum = trailer->add_checksums();
        checksum->set_capture_id(capture_id(k));
        const std::string hex = absl::StrFormat("%016x", checksums_[k]);
        if (options_.checksum == ChecksumKind::kXxh3) {
          checksum->set_xxh3_64(checksums_[k]);
          checksum->set_xxh3_64_hex(hex);
        } else {
          checksum->set_xxh64(checksums_[k]);
          checksum->set_xxh64_hex(hex);
        }
      }
      trailer->set_token_ids_xxh64(options_.token_ids_hash);
      trailer->set_token_ids_xxh64_hex(absl::StrFormat("%016x", options_.token_ids_hash));
      stage_ = Stage::kDone;
      break;
    }
    case Stage::kDone:
      return false;
  }
  *out = SerializeResponse(message);
  return true;
}

}  // namespace hsx
