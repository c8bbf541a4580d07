// config.cc: config.json <-> ModelConfig, with field-level validation.
#include "server/model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/file_util.h"
#include "format/capture_spec.h"

namespace hsx {
namespace {

using json = nlohmann::json;

// Reads typed fields out of one JSON object, remembering the first error.
class FieldReader {
 public:
  FieldReader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  void Int(const char* key, int64_t* out, bool required) {
    if (!Present(key, required)) return;
    if (!object_[key].is_number_integer()) return Fail(key, "must be an integer");
    *out = object_[key].get<int64_t>();
  }
  // An integer that may be null (stored as 0).
  void NullableInt(const char* key, int64_t* out) {
    if (object_.contains(key) && object_[key].is_null()) {
      *out = 0;
      return;
    }
    Int(key, out, false);
  }
  void Double(const char* key, double* out, bool required) {
    if (!Present(key, required)) return;
    if (!object_[key].is_number()) return Fail(key, "must be a number");
    *out = object_[key].get<double>();
  }
  void Bool(const char* key, bool* out) {
    if (!Present(key, false)) return;
    if (!object_[key].is_boolean()) return Fail(key, "must be true or false");
    *out = object_[key].get<bool>();
  }
  void String(const char* key, std::string* out) {
    if (!Present(key, false)) return;
    if (!object_[key].is_string()) return Fail(key, "must be a string");
    *out = object_[key].get<std::string>();
  }
  void Fail(const std::string& key, const std::string& what) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(where_, ": field '", key, "' ", what));
    }
  }
  const absl::Status& status() const { return status_; }

 private:
  bool Present(const char* key, bool required) {
    if (object_.contains(key) && !object_[key].is_null()) return true;
    if (required) Fail(key, "is missing (required)");
    return false;
  }

  const json& object_;
  std::string where_;
  absl::Status status_;
};

void ReadRopeScaling(const json& text, FieldReader& fields, ModelConfig& config,
                     const std::string& where) {
  const char* key = text.contains("rope_scaling") ? "rope_scaling" : "rope_parameters";
  if (!text.contains(key) || text[key].is_null()) return;
  const json& rope = text[key];
  if (!rope.is_object()) return fields.Fail(key, "must be an object or null");
  FieldReader rope_fields(rope, absl::StrCat(where, ": ", key));
  RopeScaling& scaling = config.rope_scaling;
  std::string type = rope.contains("rope_type") ? "" : "none";
  rope_fields.String(rope.contains("rope_type") ? "rope_type" : "type", &type);
  if (type == "default") type = "none";
  scaling.type = type;
  if (type == "yarn") {
    rope_fields.Double("factor", &scaling.factor, true);
    rope_fields.Int("original_max_position_embeddings", &scaling.original_max_position_embeddings,
                    true);
    rope_fields.Double("beta_fast", &scaling.beta_fast, false);
    rope_fields.Double("beta_slow", &scaling.beta_slow, false);
    rope_fields.Double("mscale", &scaling.mscale, false);
    rope_fields.Double("mscale_all_dim", &scaling.mscale_all_dim, false);
  } else if (type != "none") {
    rope_fields.Fail("type", absl::StrCat("is '", type, "'; hsx supports 'yarn' or none"));
  }
  if (std::string(key) == "rope_parameters") rope_fields.Double("rope_theta", &config.rope_theta, false);
  if (!rope_fields.status().ok()) fields.Fail(key, std::string(rope_fields.status().message()));
}

// Cross-field checks: sizes positive and consistent with each other.
absl::Status CheckConsistency(const ModelConfig& c, const std::string& where) {
  auto fail = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": ", what));
  };
  const std::pair<const char*, int64_t> positive[] = {
      {"vocab_size", c.vocab_size}, {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers}, {"num_attention_heads", c.num_attention_heads},
      {"kv_lora_rank", c.kv_lora_rank}, {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim}, {"v_head_dim", c.v_head_dim},
      {"intermediate_size", c.intermediate_size}, {"num_experts_per_tok", c.num_experts_per_tok},
      {"n_group", c.n_group}, {"topk_group", c.topk_group}};
  for (const auto& [name, value] : positive) {
    if (value <= 0) return fail(absl::StrCat("field '", name, "' must be positive, got ", value));
  }
  if (c.q_lora_rank < 0) return fail("field 'q_lora_rank' must be positive or null");
  if (c.qk_rope_head_dim % 2 != 0) return fail("field 'qk_rope_head_dim' must be even");
  if (c.num_hidden_layers > 4096) return fail("field 'num_hidden_layers' is implausibly large");
  if (c.first_k_dense_replace < 0) return fail("field 'first_k_dense_replace' must be >= 0");
  if (c.num_nextn_predict_layers < 0 || c.num_nextn_predict_layers > 16) {
    return fail("field 'num_nextn_predict_layers' must be in 0..16");
  }
  if (c.moe_layer_freq != 1) {
    return fail(absl::StrCat("field 'moe_layer_freq' is ", c.moe_layer_freq,
                             "; only 1 is supported (HF DeepseekV3 ignores it)"));
  }
  if (c.n_routed_experts > 0) {
    if (c.moe_intermediate_size <= 0) return fail("field 'moe_intermediate_size' must be positive");
    if (c.n_shared_experts < 0) return fail("field 'n_shared_experts' must be >= 0");
    if (c.num_experts_per_tok > c.n_routed_experts) {
      return fail("field 'num_experts_per_tok' exceeds 'n_routed_experts'");
    }
    if (c.n_routed_experts % c.n_group != 0) {
      return fail("field 'n_routed_experts' must be a multiple of 'n_group'");
    }
    if (c.topk_group > c.n_group) return fail("field 'topk_group' exceeds 'n_group'");
    if (c.scoring_func != "sigmoid" && c.scoring_func != "softmax") {
      return fail(absl::StrCat("field 'scoring_func' is '", c.scoring_func,
                               "'; expected 'sigmoid' or 'softmax'"));
    }
    if (c.topk_method != "noaux_tc") {
      return fail(absl::StrCat("field 'topk_method' is '", c.topk_method,
                               "'; hsx supports 'noaux_tc' (DeepSeek-V3 routing)"));
    }
  }
  if (c.hidden_act != "silu") {
    return fail(absl::StrCat("field 'hidden_act' is '", c.hidden_act, "'; expected 'silu'"));
  }
  if (c.quantization.has_value()) {
    const int64_t group = c.quantization->group_size;
    for (const auto& [name, size] : {std::pair<const char*, int64_t>{"hidden_size", c.hidden_size},
                                     {"moe_intermediate_size", c.moe_intermediate_size}}) {
      if (size % group != 0) {
        return fail(absl::StrCat("field '", name, "' (", size,
                                 ") is not a multiple of the quantization group size ", group));
      }
    }
  }
  return absl::OkStatus();
}

// Numbers whose absurd values would otherwise surface only as a SERVING
// server that refuses every request, or as non-finite states.
absl::Status CheckNumericRanges(const ModelConfig& c, const std::string& where) {
  auto fail = [&](const std::string& what) { return absl::InvalidArgumentError(absl::StrCat(where, ": ", what)); };
  if (c.max_position_embeddings <= 0) {
    return fail(absl::StrCat("field 'max_position_embeddings' must be positive, got ", c.max_position_embeddings));
  }
  const auto in_range = [](double v, double low, double high) { return std::isfinite(v) && v > low && v <= high; };
  if (!in_range(c.rms_norm_eps, 0.0, 0.1)) {
    return fail(absl::StrCat("field 'rms_norm_eps' must be in (0, 0.1], got ", c.rms_norm_eps));
  }
  if (!in_range(c.rope_theta, 0.0, 1e12)) {
    return fail(absl::StrCat("field 'rope_theta' must be positive and finite, got ", c.rope_theta));
  }
  if (c.n_routed_experts > 0 && !in_range(c.routed_scaling_factor, 0.0, 100.0)) {
    return fail(absl::StrCat("field 'routed_scaling_factor' must be in (0, 100], got ", c.routed_scaling_factor));
  }
  const RopeScaling& r = c.rope_scaling;
  if (r.type == "yarn") {
    if (!in_range(r.factor, 0.0, 1e6)) {
      return fail(absl::StrCat("field 'rope_scaling.factor' must be positive and finite, got ", r.factor));
    }
    if (r.original_max_position_embeddings <= 0) {
      return fail(absl::StrCat("field 'rope_scaling.original_max_position_embeddings' must be positive, got ",
                               r.original_max_position_embeddings));
    }
    if (!std::isfinite(r.beta_fast) || !std::isfinite(r.beta_slow) || r.beta_fast <= 0 || r.beta_slow <= 0) {
      return fail("fields 'rope_scaling.beta_fast' and 'beta_slow' must be positive and finite");
    }
  }
  return absl::OkStatus();
}

// hsx computes DeepSeek-V3-family models only: refuse a config that names another architecture.
absl::Status CheckFamily(const json& root, const ModelConfig& c, const std::string& file, const std::string& where) {
  static const char* const kModelTypes[] = {"deepseek_v3", "kimi_k2"};
  if (!c.model_type.empty() && std::find(std::begin(kModelTypes), std::end(kModelTypes), c.model_type) ==
                                   std::end(kModelTypes)) {
    return absl::InvalidArgumentError(absl::StrCat(where, ": field 'model_type' is '", c.model_type,
                                                   "'; hsx runs the DeepSeek-V3 family (deepseek_v3, kimi_k2)"));
  }
  if (c.layout == CheckpointLayout::kNestedK25 && root.contains("model_type") && root["model_type"] != "kimi_k25") {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": field 'model_type' is ", root["model_type"].dump(), "; a nested config is kimi_k25"));
  }
  // The text config's architectures (flat layout) and the root's (nested K2.5).
  std::vector<std::string> names = c.architectures;
  if (c.layout == CheckpointLayout::kNestedK25 && root.contains("architectures") && root["architectures"].is_array()) {
    for (const json& name : root["architectures"]) {
      if (name.is_string()) names.push_back(name.get<std::string>());
    }
  }
  for (const std::string& name : names) {
    if (!absl::StartsWith(name, "DeepseekV3") && !absl::StartsWith(name, "KimiK2")) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": 'architectures' names ", name, "; hsx runs DeepseekV3* and KimiK2* models"));
    }
  }
  return absl::OkStatus();
}

// The architecture's fields of config.json (of text_config in K2.5's
// layout), with HF's defaults where HF has one; errors collect in `fields`.
void ReadArchitecture(const json& t, FieldReader& fields, ModelConfig& config) {
  fields.String("model_type", &config.model_type);
  if (t.contains("architectures") && t["architectures"].is_array()) {
    config.architectures.clear();
    for (const json& name : t["architectures"]) {
      if (name.is_string()) config.architectures.push_back(name.get<std::string>());
    }
  }
  fields.Int("vocab_size", &config.vocab_size, true);
  fields.Int("hidden_size", &config.hidden_size, true);
  fields.Int("num_hidden_layers", &config.num_hidden_layers, true);
  fields.Int("num_nextn_predict_layers", &config.num_nextn_predict_layers, false);
  fields.Int("intermediate_size", &config.intermediate_size, true);
  fields.Int("moe_intermediate_size", &config.moe_intermediate_size, true);
  fields.Int("n_routed_experts", &config.n_routed_experts, true);
  fields.Int("n_shared_experts", &config.n_shared_experts, false);
  fields.Int("num_experts_per_tok", &config.num_experts_per_tok, true);
  fields.Int("first_k_dense_replace", &config.first_k_dense_replace, false);
  fields.Int("moe_layer_freq", &config.moe_layer_freq, false);
  fields.Int("num_attention_heads", &config.num_attention_heads, true);
  config.num_key_value_heads = config.num_attention_heads;
  fields.Int("num_key_value_heads", &config.num_key_value_heads, false);
  config.q_lora_rank = 1536;  // HF's default when the key is absent
  fields.NullableInt("q_lora_rank", &config.q_lora_rank);
  fields.Int("kv_lora_rank", &config.kv_lora_rank, true);
  fields.Int("qk_nope_head_dim", &config.qk_nope_head_dim, true);
  fields.Int("qk_rope_head_dim", &config.qk_rope_head_dim, true);
  fields.Int("v_head_dim", &config.v_head_dim, true);
  config.n_group = 8;  // HF defaults
  config.topk_group = 4;
  fields.Int("n_group", &config.n_group, false);
  fields.Int("topk_group", &config.topk_group, false);
  fields.Int("max_position_embeddings", &config.max_position_embeddings, false);
  fields.Double("rms_norm_eps", &config.rms_norm_eps, false);
  fields.Double("rope_theta", &config.rope_theta, false);
  fields.Double("routed_scaling_factor", &config.routed_scaling_factor, false);
  fields.Bool("norm_topk_prob", &config.norm_topk_prob);
  fields.Bool("tie_word_embeddings", &config.tie_word_embeddings);
  fields.String("scoring_func", &config.scoring_func);
  fields.String("topk_method", &config.topk_method);
  fields.String("hidden_act", &config.hidden_act);
}

// quantization_config: at the top level, or (K2.5's layout) under
// `text_config` when that is given. Absent or null: none.
absl::Status ReadQuantization(const json& root, const json* text_config, const std::string& file,
                              const std::string& where, ModelConfig& config) {
  const json* quant = nullptr;
  std::string quant_where;
  if (root.contains("quantization_config")) {
    quant = &root["quantization_config"];
    quant_where = absl::StrCat(file, ": quantization_config");
  } else if (text_config != nullptr && text_config->contains("quantization_config")) {
    quant = &(*text_config)["quantization_config"];
    quant_where = absl::StrCat(where, ".quantization_config");
  }
  if (quant != nullptr && !quant->is_null()) {
    absl::StatusOr<QuantizationConfig> parsed = ParseQuantizationConfig(*quant, quant_where);
    if (!parsed.ok()) return parsed.status();
    config.quantization = *std::move(parsed);
  }
  return absl::OkStatus();
}

// The media placeholders (kMediaPlaceholderFields) of one JSON object: each
// present, non-null key must hold a token id; an id already read is skipped.
absl::Status ReadMediaPlaceholders(const json& object, const std::string& where, ModelConfig& config) {
  for (const char* key : kMediaPlaceholderFields) {
    if (!object.contains(key) || object[key].is_null()) continue;
    const json& value = object[key];
    if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > INT32_MAX) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": field '", key,
                                                     "' must be a token id (an integer in 0..2147483647), got ",
                                                     value.dump()));
    }
    const auto id = static_cast<int32_t>(value.get<int64_t>());
    std::vector<MediaPlaceholder>& known = config.media_placeholders;
    if (std::none_of(known.begin(), known.end(), [id](const MediaPlaceholder& p) { return p.id == id; })) {
      known.push_back({id, key});
    }
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<int> ModelConfig::Eagle3CaptureIds() const {
  return CaptureSpec::Eagle3(static_cast<int>(num_hidden_layers)).ids();
}

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& file) {
  json root = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(file, ": not valid JSON"));
  if (!root.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": top level is not a JSON object"));
  }
  ModelConfig config;
  const json* text_config = &root;
  std::string where = file;
  if (root.contains("text_config")) {
    if (!root["text_config"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": 'text_config' is not an object"));
    }
    config.layout = CheckpointLayout::kNestedK25;
    text_config = &root["text_config"];
    where = absl::StrCat(file, ": text_config");
  }
  const json& t = *text_config;
  FieldReader fields(t, where);
  ReadArchitecture(t, fields, config);
  ReadRopeScaling(t, fields, config, where);
  if (!fields.status().ok()) return fields.status();

  if (absl::Status s = ReadQuantization(root, text_config != &root ? &t : nullptr, file, where, config); !s.ok()) {
    return s;
  }
  // K2.5 keeps its placeholder at the top level; look under text_config too.
  if (absl::Status s = ReadMediaPlaceholders(root, file, config); !s.ok()) return s;
  if (text_config != &root) {
    if (absl::Status s = ReadMediaPlaceholders(t, where, config); !s.ok()) return s;
  }
  if (absl::Status s = CheckConsistency(config, where); !s.ok()) return s;
  if (absl::Status s = CheckNumericRanges(config, where); !s.ok()) return s;
  if (absl::Status s = CheckFamily(root, config, file, where); !s.ok()) return s;
  return config;
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFileToString(path);
  if (!text.ok()) return text.status();
  return ParseModelConfig(*text, path);
}

json ModelConfigToJson(const ModelConfig& c) {
  json t = {
      {"architectures", c.architectures},
      {"model_type", c.model_type},
      {"vocab_size", c.vocab_size},
      {"hidden_size", c.hidden_size},
      {"num_hidden_layers", c.num_hidden_layers},
      {"intermediate_size", c.intermediate_size},
      {"moe_intermediate_size", c.moe_intermediate_size},
      {"n_routed_experts", c.n_routed_experts},
      {"n_shared_experts", c.n_shared_experts},
      {"num_experts_per_tok", c.num_experts_per_tok},
      {"first_k_dense_replace", c.first_k_dense_replace},
      {"moe_layer_freq", c.moe_layer_freq},
      {"num_attention_heads", c.num_attention_heads},
      {"num_key_value_heads", c.num_key_value_heads},
      {"q_lora_rank", c.has_q_lora() ? json(c.q_lora_rank) : json(nullptr)},
      {"kv_lora_rank", c.kv_lora_rank},
      {"qk_nope_head_dim", c.qk_nope_head_dim},
      {"qk_rope_head_dim", c.qk_rope_head_dim},
      {"v_head_dim", c.v_head_dim},
      {"n_group", c.n_group},
      {"topk_group", c.topk_group},
      {"topk_method", c.topk_method},
      {"scoring_func", c.scoring_func},
      {"norm_topk_prob", c.norm_topk_prob},
      {"routed_scaling_factor", c.routed_scaling_factor},
      {"max_position_embeddings", c.max_position_embeddings},
      {"rms_norm_eps", c.rms_norm_eps},
      {"rope_theta", c.rope_theta},
      {"hidden_act", c.hidden_act},
      {"attention_bias", false},
      {"tie_word_embeddings", c.tie_word_embeddings},
      {"num_nextn_predict_layers", c.num_nextn_predict_layers},
      {"torch_dtype", "bfloat16"},
  };
  if (c.rope_scaling.type == "yarn") {
    const RopeScaling& r = c.rope_scaling;
    t["rope_scaling"] = {{"type", "yarn"},
                         {"factor", r.factor},
                         {"original_max_position_embeddings", r.original_max_position_embeddings},
                         {"beta_fast", r.beta_fast},
                         {"beta_slow", r.beta_slow},
                         {"mscale", r.mscale},
                         {"mscale_all_dim", r.mscale_all_dim}};
  } else {
    t["rope_scaling"] = nullptr;
  }
  if (c.layout == CheckpointLayout::kFlat) {
    if (c.quantization) t["quantization_config"] = QuantizationConfigToJson(*c.quantization);
    for (const MediaPlaceholder& p : c.media_placeholders) t[p.field] = p.id;
    return t;
  }
  // K2.5: a multimodal wrapper whose text model sits under text_config.
  json root = {{"architectures", {"KimiK25ForConditionalGeneration"}},
               {"model_type", "kimi_k25"},
               {"tie_word_embeddings", c.tie_word_embeddings},
               {"text_config", t}};
  if (c.quantization) root["quantization_config"] = QuantizationConfigToJson(*c.quantization);
  for (const MediaPlaceholder& p : c.media_placeholders) root[p.field] = p.id;  // where K2.5 has it
  return root;
}

}  // namespace hsx
