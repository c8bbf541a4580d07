// sample_file.cc: encoding, checksums and the atomic write of one sample.
#include "client/dump/sample_file.h"

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "server/model/safetensors_writer.h"

namespace hsx {

std::string SampleFileName(int64_t index) { return absl::StrCat("hs_", index, ".safetensors"); }

absl::Status WriteSampleFile(const std::string& path, const InputSample& input,
                             const SampleStates& states, OutputDType dtype,
                             const SampleFileInfo& info) {
  const int64_t tokens = states.tokens;
  if (tokens != static_cast<int64_t>(input.input_ids.size())) {
    return absl::InternalError(absl::StrCat("sample ", input.index, ": ", tokens,
                                            " rows of states for ", input.input_ids.size(),
                                            " tokens"));
  }
  const int64_t layers = static_cast<int64_t>(states.capture_ids.size());
  SafetensorsWriter writer;
  nlohmann::ordered_json checksums = nlohmann::ordered_json::object();
  auto add = [&](const std::string& name, DType type, std::vector<int64_t> shape,
                 const std::vector<uint8_t>& bytes) {
    checksums[name] = Xxh64Hex(bytes.data(), bytes.size());
    writer.AddBytes(name, type, std::move(shape), bytes);
  };
  add("hidden_states", ToSafetensorsDType(dtype), {tokens, layers, states.hidden},
      EncodeValues(states.hidden_states, dtype));
  std::vector<int64_t> ids(input.input_ids.begin(), input.input_ids.end());
  const auto as_bytes = [](const std::vector<int64_t>& v) {
    const uint8_t* b = reinterpret_cast<const uint8_t*>(v.data());
    return std::vector<uint8_t>(b, b + v.size() * sizeof(int64_t));
  };
  add("token_ids", DType::kI64, {tokens}, as_bytes(ids));
  if (input.loss_mask) add("loss_mask", DType::kI64, {tokens}, as_bytes(*input.loss_mask));
  if (!states.final_norm.empty()) {
    add("final_norm_hidden_states", ToSafetensorsDType(dtype), {tokens, states.hidden},
        EncodeValues(states.final_norm, dtype));
  }
  const bool has_last = !states.capture_ids.empty() && states.capture_ids.back() == info.num_layers;
  writer.SetMetadata("format", "pt");
  writer.SetMetadata("hsx_format", "1");
  writer.SetMetadata("sample_id", input.id);
  writer.SetMetadata("sample_index", std::to_string(input.index));
  writer.SetMetadata("capture_ids", nlohmann::json(states.capture_ids).dump());
  writer.SetMetadata("layer_convention", kLayerConvention);
  writer.SetMetadata("last_layer_state", has_last ? "pre-norm" : "not captured");
  writer.SetMetadata("final_norm", states.final_norm.empty() ? "absent" : "post-norm (lm_head input)");
  writer.SetMetadata("model", info.model_name);
  writer.SetMetadata("num_layers", std::to_string(info.num_layers));
  writer.SetMetadata("dtype", OutputDTypeName(dtype));
  writer.SetMetadata("checksums_xxh64", checksums.dump());
  return writer.Write(path);
}

}  // namespace hsx
