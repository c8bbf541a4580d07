// sample_file.cc: encoding, checksums and the atomic write of one sample.
#include "format/sample_file.h"

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/safetensors_writer.h"
#include "format/tensor_encoding.h"
#include "format/xxh64_stream.h"

namespace hsx {
namespace {


std::span<const uint8_t> AsBytes(const std::vector<int64_t>& v) {
  return {reinterpret_cast<const uint8_t*>(v.data()), v.size() * sizeof(int64_t)};
}

}  // namespace

std::string SampleFileName(int64_t index) { return absl::StrCat("hs_", index, ".safetensors"); }

std::string Int64Xxh64Hex(std::span<const int64_t> values) {
  return Xxh64Hex(values.data(), values.size() * sizeof(int64_t));
}

EncodedSample EncodeSampleStates(const SampleStates& states, OutputDType dtype) {
  EncodedSample sample;
  sample.capture_ids = states.capture_ids;
  sample.tokens = states.tokens;
  sample.hidden = states.hidden;
  sample.dtype = dtype;
  const size_t size = static_cast<size_t>(OutputDTypeSize(dtype));
  sample.hidden_states = StateBytes(states.hidden_states.size() * size);
  EncodeValues(states.hidden_states, dtype, sample.hidden_states.data());
  sample.has_final_norm = !states.final_norm.empty();
  if (sample.has_final_norm) {
    sample.final_norm = StateBytes(states.final_norm.size() * size);
    EncodeValues(states.final_norm, dtype, sample.final_norm.data());
  }
  return sample;
}

absl::Status CheckEncodedValues(std::span<const uint8_t> bytes, OutputDType dtype, int64_t tokens,
                                int64_t layers, int64_t hidden,
                                const std::vector<std::string>& names) {
  const int64_t size = OutputDTypeSize(dtype);
  if (static_cast<int64_t>(bytes.size()) != tokens * layers * hidden * size) {
    return absl::DataLossError(absl::StrCat(bytes.size(), " bytes for [", tokens, ", ", layers, ", ",
                                            hidden, "] values of ", OutputDTypeName(dtype)));
  }
  std::vector<char> nonzero(static_cast<size_t>(layers), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t l = 0; l < layers; ++l) {
      const uint8_t* row = bytes.data() + ((t * layers + l) * hidden) * size;
      bool any = false;
      if (const int64_t i = CheckEncoded(row, hidden, dtype, &any); i >= 0) {
        const float value = DecodeValues(std::span<const uint8_t>(row + size * i, size), dtype)[0];
        return absl::DataLossError(absl::StrCat("non-finite value (", value, ") in ", names[l], " row ", t,
                                                " column ", i));
      }
      nonzero[l] |= any;
    }
  }
  for (int64_t l = 0; l < layers; ++l) {
    if (!nonzero[l]) return absl::DataLossError(absl::StrCat(names[l], " is all zeros"));
  }
  return absl::OkStatus();
}

namespace {

// CheckEncodedValues' errors, from a receiver's findings for `count` tensors
// starting at `first`, with CheckEncodedValues' order: the first non-finite
// value by row, then by layer; then the first all-zero layer.
absl::Status CheckedStatus(const EncodedSample& sample, size_t first, size_t count,
                           const std::vector<std::string>& names) {
  const EncodedValueCheck& check = *sample.values_checked;
  int64_t bad_row = -1;
  size_t bad = 0;
  for (size_t l = 0; l < count; ++l) {
    const int64_t at = check.first_bad[first + l];
    if (at >= 0 && (bad_row < 0 || at / sample.hidden < bad_row)) {
      bad_row = at / sample.hidden;
      bad = l;
    }
  }
  if (bad_row >= 0) {
    return absl::DataLossError(absl::StrCat("non-finite value (", check.bad_value[first + bad], ") in ", names[bad],
                                            " row ", bad_row, " column ", check.first_bad[first + bad] % sample.hidden));
  }
  for (size_t l = 0; l < count; ++l) {
    if (!check.nonzero[first + l]) return absl::DataLossError(absl::StrCat(names[l], " is all zeros"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckSampleValues(const EncodedSample& sample) {
  std::vector<std::string> names;
  for (int id : sample.capture_ids) names.push_back(absl::StrCat("capture id ", id));
  return CheckSampleValues(sample, names);
}

absl::Status CheckSampleValues(const EncodedSample& sample, const std::vector<std::string>& names) {
  const size_t layers = sample.capture_ids.size();
  const std::vector<std::string> final_name = {"the final-norm state"};
  const size_t tensors = layers + (sample.has_final_norm ? 1 : 0);
  if (sample.values_checked && sample.values_checked->nonzero.size() == tensors &&
      sample.values_checked->first_bad.size() == tensors && sample.values_checked->bad_value.size() == tensors) {
    if (absl::Status s = CheckedStatus(sample, 0, layers, names); !s.ok()) return s;
    if (sample.has_final_norm) return CheckedStatus(sample, layers, 1, final_name);
    return absl::OkStatus();
  }
  if (sample.dropped) return absl::DataLossError("the states were dropped without a record of their value check");
  if (absl::Status s = CheckEncodedValues(sample.hidden_states.bytes(), sample.dtype, sample.tokens,
                                          static_cast<int64_t>(layers), sample.hidden, names);
      !s.ok()) {
    return s;
  }
  if (sample.has_final_norm) {
    return CheckEncodedValues(sample.final_norm.bytes(), sample.dtype, sample.tokens, 1, sample.hidden, final_name);
  }
  return absl::OkStatus();
}

namespace {

// The sample's hidden states and final norm as pieces in file order: its
// blocks, or the received pieces, hidden_states' rows walked t-major (row t
// of every layer, then row t + 1). False when the received tensors are
// misshapen.
bool FilePieces(const EncodedSample& sample, std::vector<BytePiece>* hidden, std::vector<BytePiece>* final_norm) {
  if (!sample.received) {
    hidden->push_back(sample.hidden_states.bytes());
    if (sample.has_final_norm) final_norm->push_back(sample.final_norm.bytes());
    return true;
  }
  const ReceivedStates& received = *sample.received;
  const size_t layers = sample.capture_ids.size();
  const int64_t row = sample.hidden * OutputDTypeSize(sample.dtype);
  if (received.tensors.size() != layers + (sample.has_final_norm ? 1 : 0)) return false;
  for (size_t i = 0; i < received.tensors.size(); ++i) {
    if (received.bytes(i, 1) != sample.tokens * row) return false;
  }
  if (sample.has_final_norm) *final_norm = received.tensors[layers];
  if (layers == 1) {
    *hidden = received.tensors[0];
    return true;
  }
  std::vector<PieceReader> readers;
  for (size_t l = 0; l < layers; ++l) readers.emplace_back(received.tensors[l]);
  hidden->reserve(static_cast<size_t>(sample.tokens) * layers);
  for (int64_t t = 0; t < sample.tokens; ++t) {
    for (PieceReader& reader : readers) {
      if (!reader.Take(static_cast<uint64_t>(row), hidden)) return false;
    }
  }
  return true;
}

std::string PiecesXxh64Hex(const std::vector<BytePiece>& pieces) {
  Xxh64Stream hash;
  for (const BytePiece& piece : pieces) hash.Update(piece.data(), piece.size());
  return hash.HexDigest();
}

}  // namespace

absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const EncodedSample& sample, const SampleFileInfo& info,
                             WrittenDigest* digest) {
  const int64_t tokens = sample.tokens;
  const int64_t layers = static_cast<int64_t>(sample.capture_ids.size());
  const int64_t size = OutputDTypeSize(sample.dtype);
  std::vector<BytePiece> hidden_pieces, final_pieces;
  if (tokens != static_cast<int64_t>(input.input_ids.size()) || sample.dropped ||
      sample.hidden_states_bytes() != tokens * layers * sample.hidden * size ||
      (sample.has_final_norm && sample.final_norm_bytes() != tokens * sample.hidden * size) ||
      !FilePieces(sample, &hidden_pieces, &final_pieces)) {
    return absl::InternalError(absl::StrCat("sample ", input.index, ": ", tokens,
                                            " rows of states for ", input.input_ids.size(),
                                            " tokens, or misshapen states"));
  }
  SafetensorsWriter writer;
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  // The writer writes these pieces straight to the file (no copy of the
  // states); `sample`, `ids` and `input` outlive writer.Write below.
  auto add = [&](const std::string& name, DType type, std::vector<int64_t> shape,
                 std::vector<BytePiece> pieces, std::optional<uint64_t> known = std::nullopt) {
    checksums[name] = known ? absl::StrFormat("%016x", *known) : PiecesXxh64Hex(pieces);
    writer.AddPieces(name, type, std::move(shape), std::move(pieces));
  };
  const DType type = ToSafetensorsDType(sample.dtype);
  add("hidden_states", type, {tokens, layers, sample.hidden}, std::move(hidden_pieces), sample.hidden_states_xxh64);
  const std::vector<int64_t> ids(input.input_ids.begin(), input.input_ids.end());
  add("token_ids", DType::kI64, {tokens}, {AsBytes(ids)});
  if (input.loss_mask) add("loss_mask", DType::kI64, {tokens}, {AsBytes(*input.loss_mask)});
  if (sample.has_final_norm) {
    add("final_norm_hidden_states", type, {tokens, sample.hidden}, std::move(final_pieces), sample.final_norm_xxh64);
  }
  const bool has_last = !sample.capture_ids.empty() && sample.capture_ids.back() == info.num_layers;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("hsx_format", "1");
  writer.SetMetadata("sample_id", input.id);
  writer.SetMetadata("sample_index", std::to_string(input.index));
  writer.SetMetadata("capture_ids", nlohmann::json(sample.capture_ids).dump());
  writer.SetMetadata("layer_convention", kLayerConvention);
  writer.SetMetadata("last_layer_state", has_last ? "pre-norm" : "not captured");
  writer.SetMetadata("final_norm", sample.has_final_norm ? "post-norm (lm_head input)" : "absent");
  writer.SetMetadata("model", info.model_name);
  if (!info.model_revision.empty()) writer.SetMetadata("model_revision", info.model_revision);
  if (!info.compute_precision.empty()) writer.SetMetadata("compute_precision", info.compute_precision);
  writer.SetMetadata("num_layers", std::to_string(info.num_layers));
  writer.SetMetadata("dtype", OutputDTypeName(sample.dtype));
  writer.SetMetadata("checksums_xxh64", checksums.dump());
  return writer.Write(path, digest);
}

}  // namespace hsx
