// quantization.cc: parse, match and emit the compressed-tensors scheme.
#include "server/model/quantization.h"

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

using json = nlohmann::json;

absl::Status Invalid(const std::string& where, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
}

// Checks that `json[key]` exists and equals `expected` (a JSON scalar).
absl::Status Expect(const json& object, const std::string& key, const json& expected,
                    const std::string& where) {
  if (!object.contains(key)) return Invalid(where, absl::StrCat("missing field '", key, "'"));
  if (object[key] != expected) {
    return Invalid(where, absl::StrCat("'", key, "' is ", object[key].dump(), "; hsx supports only ",
                                       expected.dump()));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status QuantizationConfig::SetIgnore(std::vector<std::string> entries) {
  auto patterns = std::make_shared<std::vector<std::regex>>();
  for (const std::string& entry : entries) {
    if (!absl::StartsWith(entry, "re:")) continue;
    try {
      patterns->emplace_back(entry.substr(3));
    } catch (const std::regex_error&) {
      return absl::InvalidArgumentError(
          absl::StrCat("'ignore' entry \"", entry, "\" is not a valid regular expression"));
    }
  }
  ignore_ = std::move(entries);
  patterns_ = std::move(patterns);
  return absl::OkStatus();
}

bool QuantizationConfig::IsQuantized(const std::string& module_name) const {
  for (const std::string& entry : ignore_) {
    if (!absl::StartsWith(entry, "re:") && entry == module_name) return false;
  }
  if (patterns_ == nullptr) return true;
  for (const std::regex& pattern : *patterns_) {
    std::smatch match;
    // re.match semantics: anchored at the start of the name only.
    if (std::regex_search(module_name, match, pattern, std::regex_constants::match_continuous)) {
      return false;
    }
  }
  return true;
}

QuantizationConfig KimiQuantizationConfig() {
  QuantizationConfig config;
  absl::Status status = config.SetIgnore({"lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                          "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"});
  (void)status;  // constant patterns, known valid
  return config;
}

absl::StatusOr<QuantizationConfig> ParseQuantizationConfig(const json& config,
                                                           const std::string& where) {
  if (!config.is_object()) return Invalid(where, "is not a JSON object");
  if (absl::Status s = Expect(config, "quant_method", "compressed-tensors", where); !s.ok()) return s;
  if (absl::Status s = Expect(config, "format", "pack-quantized", where); !s.ok()) return s;
  if (!config.contains("config_groups") || !config["config_groups"].is_object()) {
    return Invalid(where, "missing object 'config_groups'");
  }
  const json& groups = config["config_groups"];
  if (groups.size() != 1) {
    return Invalid(where, absl::StrCat("config_groups has ", groups.size(),
                                       " groups; hsx supports exactly one"));
  }
  const std::string group_where = absl::StrCat(where, ".config_groups.", groups.begin().key());
  const json& group = groups.begin().value();
  if (!group.is_object()) return Invalid(group_where, "is not a JSON object");
  if (!group.contains("targets") || group["targets"] != json::array({"Linear"})) {
    return Invalid(group_where, "'targets' must be [\"Linear\"]");
  }
  for (const char* activations : {"input_activations", "output_activations"}) {
    if (group.contains(activations) && !group[activations].is_null()) {
      return Invalid(group_where, absl::StrCat("'", activations,
                                               "' must be null (weight-only quantization)"));
    }
  }
  if (!group.contains("weights") || !group["weights"].is_object()) {
    return Invalid(group_where, "missing object 'weights'");
  }
  const json& weights = group["weights"];
  const std::string weights_where = absl::StrCat(group_where, ".weights");
  if (absl::Status s = Expect(weights, "num_bits", 4, weights_where); !s.ok()) return s;
  if (absl::Status s = Expect(weights, "type", "int", weights_where); !s.ok()) return s;
  if (absl::Status s = Expect(weights, "symmetric", true, weights_where); !s.ok()) return s;
  if (absl::Status s = Expect(weights, "strategy", "group", weights_where); !s.ok()) return s;
  if (weights.contains("actorder") && !weights["actorder"].is_null()) {
    return Invalid(weights_where, "'actorder' must be null (no g_idx support)");
  }
  if (weights.contains("dynamic") && weights["dynamic"] != false) {
    return Invalid(weights_where, "'dynamic' must be false");
  }
  if (!weights.contains("group_size") || !weights["group_size"].is_number_integer()) {
    return Invalid(weights_where, "missing integer 'group_size'");
  }
  QuantizationConfig result;
  const int64_t group_size = weights["group_size"].get<int64_t>();
  if (group_size <= 0 || group_size % 8 != 0 || group_size > (1 << 20)) {
    return Invalid(weights_where, absl::StrCat("'group_size' ", group_size,
                                               " must be a positive multiple of 8"));
  }
  result.group_size = static_cast<int>(group_size);
  if (config.contains("ignore")) {
    std::vector<std::string> entries;
    if (!config["ignore"].is_array()) return Invalid(where, "'ignore' must be a list of strings");
    for (const json& entry : config["ignore"]) {
      if (!entry.is_string()) return Invalid(where, "'ignore' must be a list of strings");
      entries.push_back(entry.get<std::string>());
    }
    if (absl::Status s = result.SetIgnore(std::move(entries)); !s.ok()) {
      return Invalid(where, std::string(s.message()));
    }
  }
  return result;
}

json QuantizationConfigToJson(const QuantizationConfig& config) {
  json weights = {{"actorder", nullptr},   {"block_structure", nullptr},
                  {"dynamic", false},      {"group_size", config.group_size},
                  {"num_bits", config.num_bits}, {"observer", "minmax"},
                  {"observer_kwargs", json::object()}, {"strategy", "group"},
                  {"symmetric", true},     {"type", "int"}};
  json group = {{"input_activations", nullptr}, {"output_activations", nullptr},
                {"targets", json::array({"Linear"})}, {"weights", weights}};
  return {{"config_groups", {{"group_0", group}}},
          {"format", "pack-quantized"},
          {"ignore", config.ignore()},
          {"kv_cache_scheme", nullptr},
          {"quant_method", "compressed-tensors"},
          {"quantization_status", "compressed"}};
}

}  // namespace hsx
