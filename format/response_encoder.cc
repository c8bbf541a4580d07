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

namespace {

absl::Status BadValue(int id, int64_t index, int64_t hidden, float value, OutputDType dtype) {
  const std::string overflow =
      absl::StrCat(" overflows ", OutputDTypeName(dtype), dtype == OutputDType::kFp16 ? " (ask for bf16 or fp32)" : "");
  return absl::InternalError(absl::StrCat("capture id ", id, ": value ", value, " at row ", index / hidden, ", column ",
                                          index % hidden, std::isfinite(value) ? overflow : " is not finite"));
}

absl::Status AllZero(int id) { return absl::InternalError(absl::StrCat("capture id ", id, ": every value is zero")); }

// The sample's verdict from its findings: the first tensor with a bad value
// or only zeros fails it.
absl::Status Verdict(const SampleTensors& sample) {
  for (const SampleTensor& tensor : sample.tensors) {
    const TensorFindings& found = *tensor.findings;
    if (found.bad_index >= 0 && found.bad_scale) {
      return absl::InternalError(absl::StrCat("capture id ", tensor.capture_id, ": row ", found.bad_index / sample.hidden,
                                              " has fp8 scale ", found.bad_value, " (not finite and positive)"));
    }
    if (found.bad_index >= 0) {
      return BadValue(tensor.capture_id, found.bad_index, sample.hidden, found.bad_value, sample.dtype);
    }
    if (!found.nonzero) return AllZero(tensor.capture_id);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ResponseEncoder>> ResponseEncoder::Create(SampleTensors rows, EncoderOptions options,
                                                                         const Allocator& allocate) {
  absl::StatusOr<SampleTensors> encoded = EncodeSample(std::move(rows), options.dtype, options.checksum, allocate);
  if (!encoded.ok()) return encoded.status();
  if (absl::Status status = Verdict(*encoded); !status.ok()) return status;
  return std::unique_ptr<ResponseEncoder>(new ResponseEncoder(std::move(options), *std::move(encoded)));
}

ResponseEncoder::ResponseEncoder(EncoderOptions options, SampleTensors sample)
    : options_(std::move(options)), sample_(std::move(sample)) {
  rows_per_chunk_ = std::max<int64_t>(1, options_.max_chunk_bytes / std::max<int64_t>(1, sample_.row_bytes()));
}

int64_t ResponseEncoder::held_bytes() const { return sample_.held_bytes; }

const char* ResponseEncoder::tensor_data(int tensor) const {
  return reinterpret_cast<const char*>(sample_.tensors[tensor].pieces[0].data());
}

void ResponseEncoder::FillSummary(v1::Summary* summary) const {
  const int64_t tokens = sample_.tokens, hidden = sample_.hidden;
  const int64_t row_bytes = sample_.row_bytes();
  for (int k = 0; k < num_tensors(); ++k) {
    double sum = 0, sum_sq = 0, lo = INFINITY, hi = -INFINITY;
    v1::TensorStats* stats = summary->add_tensors();
    stats->set_capture_id(capture_id(k));
    for (int64_t t = 0; t < tokens; ++t) {
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
        for (int64_t j = 0; j < std::min<int64_t>(kSummaryFirstValues, hidden); ++j) stats->add_first_values(values[j]);
      }
    }
    const double count = static_cast<double>(tokens * hidden);
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
      header->set_num_tokens(sample_.tokens);
      header->set_token_ids_xxh64(options_.token_ids_hash);
      header->set_token_ids_xxh64_hex(absl::StrFormat("%016x", options_.token_ids_hash));
      for (int id : sample_.capture_ids) header->add_capture_ids(id);
      header->set_final_norm(sample_.has_final_norm());
      header->set_hidden_size(static_cast<int32_t>(sample_.hidden));
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
      const int64_t count = std::min(rows_per_chunk_, sample_.tokens - next_row_);
      const int64_t row_bytes = sample_.row_bytes();
      *out = ChunkResponse(capture_id(tensor_), next_row_, count, tensor_data(tensor_) + next_row_ * row_bytes,
                           static_cast<size_t>(count * row_bytes), sample_.owner);
      next_row_ += count;
      if (next_row_ == sample_.tokens) {
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
        const uint64_t digest = sample_.tensors[k].findings->checksum;
        const std::string hex = absl::StrFormat("%016x", digest);
        if (options_.checksum == ChecksumKind::kXxh3) {
          checksum->set_xxh3_64(digest);
          checksum->set_xxh3_64_hex(hex);
        } else {
          checksum->set_xxh64(digest);
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
