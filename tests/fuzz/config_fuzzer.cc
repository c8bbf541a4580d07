// libFuzzer target: the config.json parser must return a status, never crash;
// a config it accepts must survive a round trip through its own writer.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "server/model/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<hsx::ModelConfig> config = hsx::ParseModelConfig(text, "fuzz/config.json");
  if (!config.ok()) return 0;
  // What hsx writes for an accepted config must parse to the same architecture.
  absl::StatusOr<hsx::ModelConfig> again =
      hsx::ParseModelConfig(hsx::ModelConfigToJson(*config).dump(), "fuzz/again.json");
  if (!again.ok() || again->layout != config->layout || again->hidden_size != config->hidden_size ||
      again->num_hidden_layers != config->num_hidden_layers || again->q_lora_rank != config->q_lora_rank ||
      again->rms_norm_eps != config->rms_norm_eps ||
      again->rope_scaling.beta_fast != config->rope_scaling.beta_fast) {
    __builtin_trap();
  }
  return 0;
}
