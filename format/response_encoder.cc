// response_encoder.cc: header, lazily encoded chunks, summary and trailer.
#include "format/response_encoder.h"

#include <algorithm>
#include <cmath>
#include <span>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/proto_dtype.h"

namespace hsx {
namespace {

// Largest float that rounds to a finite fp16 (65504 is the largest fp16).
constexpr float kFp16Limit = 65520.0f;

}  // namespace

ResponseEncoder::ResponseEncoder(SampleStates states, EncoderOptions options)
    : states_(std::move(states)), options_(std::move(options)), hash_(XXH64_createState()) {
  const int64_t row_bytes = states_.hidden * OutputDTypeSize(options_.dtype);
  rows_per_chunk_ = std::max<int64_t>(1, options_.max_chunk_bytes / std::max<int64_t>(1, row_bytes));
  XXH64_reset(hash_, 0);
}

ResponseEncoder::~ResponseEncoder() { XXH64_freeState(hash_); }

int64_t ResponseEncoder::state_bytes() const {
  return static_cast<int64_t>((states_.hidden_states.size() + states_.final_norm.size()) * sizeof(float));
}

int ResponseEncoder::num_tensors() const {
  return static_cast<int>(states_.capture_ids.size()) + (states_.final_norm.empty() ? 0 : 1);
}

int ResponseEncoder::capture_id(int tensor) const {
  return tensor < static_cast<int>(states_.capture_ids.size()) ? states_.capture_ids[tensor] : -1;
}

const float* ResponseEncoder::row(int tensor, int64_t t) const {
  const int64_t layers = static_cast<int64_t>(states_.capture_ids.size());
  if (tensor < layers) return &states_.hidden_states[(t * layers + tensor) * states_.hidden];
  return &states_.final_norm[t * states_.hidden];
}

absl::Status ResponseEncoder::EncodeRows(int tensor, int64_t first, int64_t count, std::string* out) {
  const int64_t h = states_.hidden;
  const size_t start = out->size();
  out->reserve(start + count * h * OutputDTypeSize(options_.dtype));
  const float limit = options_.dtype == OutputDType::kFp16 ? kFp16Limit : INFINITY;
  for (int64_t t = first; t < first + count; ++t) {
    const float* values = row(tensor, t);
    for (int64_t j = 0; j < h; ++j) {
      const float v = values[j];
      if (!(std::fabs(v) < limit)) {
        return absl::InternalError(absl::StrCat(
            "capture id ", capture_id(tensor), ": value ", v, " at row ", t, ", column ", j,
            std::isfinite(v) ? " overflows fp16 (ask for bf16 or fp32)" : " is not finite"));
      }
      tensor_nonzero_ |= v != 0.0f;
    }
    AppendEncoded(std::span<const float>(values, h), options_.dtype, out);
  }
  XXH64_update(hash_, out->data() + start, out->size() - start);
  return absl::OkStatus();
}

absl::Status ResponseEncoder::FinishTensor(int tensor) {
  if (!tensor_nonzero_) {
    return absl::InternalError(absl::StrCat("capture id ", capture_id(tensor), ": every value is zero"));
  }
  checksums_.push_back(XXH64_digest(hash_));
  XXH64_reset(hash_, 0);
  tensor_nonzero_ = false;
  return absl::OkStatus();
}

absl::Status ResponseEncoder::FillSummary(v1::Summary* summary) {
  const int64_t h = states_.hidden;
  std::string bytes;
  for (int k = 0; k < num_tensors(); ++k) {
    double sum = 0, sum_sq = 0, lo = INFINITY, hi = -INFINITY;
    v1::TensorStats* stats = summary->add_tensors();
    stats->set_capture_id(capture_id(k));
    for (int64_t t = 0; t < states_.tokens; ++t) {
      bytes.clear();
      if (absl::Status s = EncodeRows(k, t, 1, &bytes); !s.ok()) return s;
      const std::vector<float> values =
          DecodeValues(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()),
                       options_.dtype);
      for (float v : values) {
        sum += v;
        sum_sq += static_cast<double>(v) * v;
        lo = std::min<double>(lo, v);
        hi = std::max<double>(hi, v);
      }
      if (t == 0) {
        for (int64_t j = 0; j < std::min<int64_t>(kSummaryFirstValues, h); ++j) stats->add_first_values(values[j]);
      }
    }
    if (absl::Status s = FinishTensor(k); !s.ok()) return s;
    const double count = static_cast<double>(states_.tokens * h);
    const double mean = sum / count;
    stats->set_mean(mean);
    stats->set_std(std::sqrt(std::max(0.0, sum_sq / count - mean * mean)));
    stats->set_min(lo);
    stats->set_max(hi);
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> ResponseEncoder::Next(v1::ExtractResponse* out) {
  switch (stage_) {
    case Stage::kHeader: {
      v1::Header* header = out->mutable_header();
      header->set_sample_id(options_.sample_id);
      header->set_num_tokens(states_.tokens);
      header->set_token_ids_xxh64(options_.token_ids_hash);
      header->set_token_ids_xxh64_hex(absl::StrFormat("%016x", options_.token_ids_hash));
      for (int id : states_.capture_ids) header->add_capture_ids(id);
      header->set_final_norm(!states_.final_norm.empty());
      header->set_hidden_size(static_cast<int32_t>(states_.hidden));
      header->set_dtype(OutputDTypeToProto(options_.dtype));
      header->set_layer_convention(options_.layer_convention);
      header->set_model_name(options_.model_name);
      header->set_num_layers(static_cast<int32_t>(options_.num_layers));
      stage_ = options_.summary ? Stage::kSummary : num_tensors() == 0 ? Stage::kTrailer : Stage::kBody;
      return true;
    }
    case Stage::kSummary: {
      if (absl::Status s = FillSummary(out->mutable_summary()); !s.ok()) return s;
      stage_ = Stage::kTrailer;
      return true;
    }
    case Stage::kBody: {
      v1::Chunk* chunk = out->mutable_chunk();
      const int64_t count = std::min(rows_per_chunk_, states_.tokens - next_row_);
      chunk->set_capture_id(capture_id(tensor_));
      chunk->set_first_row(next_row_);
      chunk->set_num_rows(count);
      if (absl::Status s = EncodeRows(tensor_, next_row_, count, chunk->mutable_data()); !s.ok()) return s;
      next_row_ += count;
      if (next_row_ == states_.tokens) {
        if (absl::Status s = FinishTensor(tensor_); !s.ok()) return s;
        next_row_ = 0;
        if (++tensor_ == num_tensors()) stage_ = Stage::kTrailer;
      }
      return true;
    }
    case Stage::kTrailer: {
      v1::Trailer* trailer = out->mutable_trailer();
      for (int k = 0; k < num_tensors(); ++k) {
        v1::TensorChecksum* checksum = trailer->add_checksums();
        checksum->set_capture_id(capture_id(k));
        checksum->set_xxh64(checksums_[k]);
        checksum->set_xxh64_hex(absl::StrFormat("%016x", checksums_[k]));
      }
      trailer->set_token_ids_xxh64(options_.token_ids_hash);
      trailer->set_token_ids_xxh64_hex(absl::StrFormat("%016x", options_.token_ids_hash));
      stage_ = Stage::kDone;
      return true;
    }
    case Stage::kDone:
      return false;
  }
  return false;
}

}  // namespace hsx
