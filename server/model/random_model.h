// random_model.h: random-weight checkpoints in exactly the real Kimi format.
//
// Writes config.json (with the compressed-tensors quantization_config),
// safetensors shards (model.safetensors when everything fits in one) with
// model.safetensors.index.json (always, also for one shard), routed experts
// INT4 pack-quantized and the rest BF16. The presets' config says
// model_type "deepseek_v3" (the layout "deepseek_v3"), which transformers'
// Auto classes load without remote code; the layouts "k2" (model_type
// "kimi_k2", as Kimi-K2 ships it) and "k2.5" need the real checkpoint's remote
// code to load in transformers. Every value is a pure function of
// (seed, tensor name, element index), so the output is byte-identical for a
// given seed whatever the thread count. Scales are chosen so the residual
// stream stays O(1) through the layers and routing spreads over all experts.
#ifndef HSX_SERVER_MODEL_RANDOM_MODEL_H_
#define HSX_SERVER_MODEL_RANDOM_MODEL_H_

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "server/model/config.h"

namespace hsx {

// The presets of hsx-make-model: "tiny", "small", "kimi-k2".
std::vector<std::string> PresetNames();
absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name);

// The layout names of hsx-make-model --layout: "deepseek_v3" (flat, model_type
// deepseek_v3), "k2" (flat, model_type kimi_k2), "k2.5" (nested, kimi_k25).
std::vector<std::string> LayoutNames();
absl::Status ApplyLayoutName(absl::string_view name, ModelConfig& config);

// Switches a config to the K2 (flat) or K2.5 (nested) layout. For the kimi-k2
// preset numbers this also applies K2.5's rms_norm_eps and YaRN betas.
void ApplyLayout(CheckpointLayout layout, ModelConfig& config);

struct GeneratorOptions {
  uint64_t seed = 0;
  int64_t shard_bytes = 5'000'000'000;  // a shard closes once it would exceed this
  int threads = 0;                      // 0: all hardware threads
  // Every weight zero, written as file holes (INT4 weight_shape tensors keep
  // their values): a structurally exact checkpoint at real dimensions in
  // seconds, for placement and memory-plan checks. Not for forward passes.
  bool zero_weights = false;
};

// Writes the checkpoint into `out_dir`, which must not exist or be empty.
// A config without quantization_config gets the Kimi scheme.
absl::Status WriteRandomCheckpoint(ModelConfig config, const std::string& out_dir,
                                   const GeneratorOptions& options);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_RANDOM_MODEL_H_
