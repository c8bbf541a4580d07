// quantization.h: the compressed-tensors quantization_config of a checkpoint.
//
// hsx supports exactly the scheme Kimi-K2-Thinking / K2.5 ship: format
// "pack-quantized", one config group targeting Linear layers with 4-bit,
// symmetric, group-wise integer weights (model-spec.md §2.1). Anything else is
// rejected when the config is parsed, with the offending field named, so that
// a checkpoint we cannot read exactly never loads approximately.
#ifndef HSX_SERVER_MODEL_QUANTIZATION_H_
#define HSX_SERVER_MODEL_QUANTIZATION_H_

#include <memory>
#include <regex>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsx {

struct QuantizationConfig {
  int num_bits = 4;
  int group_size = 32;

  // Entries as written in the config: exact module names or "re:<regex>".
  const std::vector<std::string>& ignore() const { return ignore_; }
  // Sets the ignore list; fails on an invalid regular expression.
  absl::Status SetIgnore(std::vector<std::string> entries);

  // True when a Linear module with this full name (prefix included, e.g.
  // "language_model.model.layers.3.mlp.experts.7.up_proj") is stored packed.
  // Matches compressed-tensors: "re:" entries use re.match semantics (anchored
  // at the start), other entries must equal the name.
  bool IsQuantized(const std::string& module_name) const;

 private:
  std::vector<std::string> ignore_;
  std::shared_ptr<const std::vector<std::regex>> patterns_;  // compiled "re:" entries
};

// The Kimi-K2.5 scheme: routed experts INT4 with group 32, everything else BF16.
QuantizationConfig KimiQuantizationConfig();

// Parses a "quantization_config" object. `where` prefixes error messages
// (e.g. "model/config.json: quantization_config").
absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const nlohmann::json& json,
                                                           const std::string& where);

nlohmann::json QuantizationConfigToJson(const QuantizationConfig& config);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_QUANTIZATION_H_
