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

namespace hsx {
namespace {

std::span<const uint8_t> AsBytes(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

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
  AppendEncoded(states.hidden_states, dtype, &sample.hidden_states);
  sample.has_final_norm = !states.final_norm.empty();
  if (sample.has_final_norm) AppendEncoded(states.final_norm, dtype, &sample.final_norm);
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

absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const EncodedSample& sample, const SampleFileInfo& info,
                             WrittenDigest* digest) {
  const int64_t tokens = sample.tokens;
  const int64_t layers = static_cast<int64_t>(sample.capture_ids.size());
  const int64_t size = OutputDTypeSize(sample.dtype);
  if (tokens != static_cast<int64_t>(input.input_ids.size()) ||
      static_cast<int64_t>(sample.hidden_states.size()) != tokens * layers * sample.hidden * size ||
      (sample.has_final_norm &&
       static_cast<int64_t>(sample.final_norm.size()) != tokens * sample.hidden * size)) {
    return absl::InternalError(absl::StrCat("sample ", input.index, ": ", tokens,
                                            " rows of states for ", input.input_ids.size(),
                                            " tokens, or misshapen states"));
  }
  SafetensorsWriter writer;
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  // The writer writes these views straight to the file (no copy of the
  // states); `sample`, `ids` and `input` outlive writer.Write below.
  auto add = [&](const std::string& name, DType type, std::vector<int64_t> shape,
                 std::span<const uint8_t> bytes) {
    checksums[name] = Xxh64Hex(bytes.data(), bytes.size());
    writer.AddView(name, type, std::move(shape), bytes);
  };
  const DType type = ToSafetensorsDType(sample.dtype);
  add("hidden_states", type, {tokens, layers, sample.hidden}, AsBytes(sample.hidden_states));
  const std::vector<int64_t> ids(input.input_ids.begin(), input.input_ids.end());
  add("token_ids", DType::kI64, {tokens}, AsBytes(ids));
  if (input.loss_mask) add("loss_mask", DType::kI64, {tokens}, AsBytes(*input.loss_mask));
  if (sample.has_final_norm) {
    add("final_norm_hidden_states", type, {tokens, sample.hidden}, AsBytes(sample.final_norm));
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
