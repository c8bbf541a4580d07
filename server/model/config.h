// config.h: the architecture of a DeepSeek-V3-family model (DeepSeek-V3,
// Kimi-K2, K2-Thinking, K2.5), read from a Hugging Face config.json.
//
// Two layouts exist: the flat one (DeepSeek-V3, K2, K2-Thinking) and K2.5's,
// where the text model's fields sit under "text_config" and every text tensor
// name carries the prefix "language_model.". Fields that HF's
// DeepseekV3Config gives a default take that default here too; the structural
// sizes are required, and a missing or ill-typed one is an error that names
// the file and the field.
//
// A multimodal model (K2.5) also names the token ids that stand for an image,
// video or audio input (media_placeholders): hsx runs the text model only, so
// a sample holding one would get states computed as if it were text
// (format/media_placeholder.h).
#ifndef HSX_SERVER_MODEL_CONFIG_H_
#define HSX_SERVER_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "absl/status/statusor.h"
#include "format/media_placeholder.h"
#include "server/model/quantization.h"

namespace hsx {

enum class CheckpointLayout { kFlat, kNestedK25 };

// YaRN rope scaling (model-spec.md §4.1). type "none" means plain RoPE.
struct RopeScaling {
  std::string type = "none";
  double factor = 1.0;
  int64_t original_max_position_embeddings = 4096;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  double mscale = 1.0;
  double mscale_all_dim = 0.0;
};

// The keys read as media placeholders, at the top level of config.json (and,
// in K2.5's layout, also under text_config). Absent or null: none.
inline constexpr const char* kMediaPlaceholderFields[] = {
    "media_placeholder_token_id", "image_token_id", "image_token_index", "video_token_id", "audio_token_id"};

struct ModelConfig {
  CheckpointLayout layout = CheckpointLayout::kFlat;
  std::string model_type = "deepseek_v3";
  std::vector<std::string> architectures = {"DeepseekV3ForCausalLM"};

  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_nextn_predict_layers = 0;  // MTP layers N.. stored after the decoder (not run)
  int64_t intermediate_size = 0;
  int64_t moe_intermediate_size = 0;
  int64_t n_routed_experts = 0;
  int64_t n_shared_experts = 1;
  int64_t num_experts_per_tok = 8;
  int64_t first_k_dense_replace = 3;
  int64_t moe_layer_freq = 1;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t q_lora_rank = 0;  // 0: no q LoRA (config value null); q_proj is used
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  int64_t max_position_embeddings = 4096;

  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  double routed_scaling_factor = 2.5;
  bool norm_topk_prob = true;
  bool tie_word_embeddings = false;
  std::string scoring_func = "sigmoid";  // or "softmax"
  std::string topk_method = "noaux_tc";
  std::string hidden_act = "silu";
  RopeScaling rope_scaling;

  std::optional<QuantizationConfig> quantization;
  std::vector<MediaPlaceholder> media_placeholders;  // distinct ids; none for a text-only model

  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  bool has_q_lora() const { return q_lora_rank > 0; }
  bool IsMoeLayer(int64_t layer) const {
    return n_routed_experts > 0 && layer >= first_k_dense_replace;
  }
  // "language_model." for K2.5, "" otherwise.
  std::string tensor_prefix() const {
    return layout == CheckpointLayout::kNestedK25 ? "language_model." : "";
  }
  // The default EAGLE-3 capture set {2, N/2, N-3, N}, sorted, without duplicates
  // and without ids outside 0..N.
  std::vector<int> Eagle3CaptureIds() const;
};

// Parses the text of a config.json. `file` names it in error messages.
absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& file);

// Reads and parses a config.json from disk.
absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& path);

// The config.json a real checkpoint of this layout would carry.
nlohmann::json ModelConfigToJson(const ModelConfig& config);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_CONFIG_H_
