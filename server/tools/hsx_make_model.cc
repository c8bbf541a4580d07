// hsx-make-model: writes a random-weight checkpoint in the real Kimi format.
//
// Tests, the demo and the benchmarks generate their models with it; real
// checkpoints load through the same reader. See --help.
#include <cstdio>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "server/model/checkpoint.h"
#include "server/model/random_model.h"
#include "base/cli.h"

ABSL_FLAG(std::string, preset, "", "Model preset: tiny (a few MB), small (a few hundred MB, CPU "
          "benchmarks) or kimi-k2 (the real dimensions; cut the depth with --layers).");
ABSL_FLAG(std::string, config, "", "A DeepSeek-V3-family config.json to generate instead of a "
          "preset (flat or with text_config). Without a quantization_config, routed experts "
          "are INT4 as in Kimi-K2.5.");
ABSL_FLAG(std::string, out, "", "Output directory (created; must be empty if it exists).");
ABSL_FLAG(std::string, layout, "", "Checkpoint layout: deepseek_v3 (flat config, model_type deepseek_v3, "
          "'model.' tensors: transformers' Auto classes load it without remote code), k2 (the same "
          "with model_type kimi_k2, as Kimi-K2 ships it: needs Kimi's remote code in transformers) or "
          "k2.5 (text_config, 'language_model.' tensors). Default: deepseek_v3 for presets, the "
          "config's own layout for --config.");
ABSL_FLAG(int64_t, layers, 0, "Number of decoder layers (0: the preset's or config's own).");
ABSL_FLAG(uint64_t, seed, 0, "Random seed; the output is byte-identical for a given seed.");
ABSL_FLAG(std::string, shard_size, "5GB", "Largest shard, e.g. 500MB, 5GB or a byte count.");
ABSL_FLAG(int, threads, 0, "Worker threads (0: all cores). Does not change the output.");
ABSL_FLAG(bool, zero_weights, false,
          "Write every weight as zeros (file holes, no disk space): the exact structure at real "
          "dimensions in seconds, for hsx-inspect memory plans and placement checks. Such a model's "
          "forward pass is all zeros, which hsx-server's self-check refuses.");

namespace {

absl::StatusOr<hsx::ModelConfig> ChooseConfig() {
  const std::string preset = absl::GetFlag(FLAGS_preset);
  const std::string config_path = absl::GetFlag(FLAGS_config);
  if (preset.empty() == config_path.empty()) {
    return absl::InvalidArgumentError("give exactly one of --preset or --config");
  }
  absl::StatusOr<hsx::ModelConfig> config =
      preset.empty() ? hsx::ReadModelConfig(config_path) : hsx::PresetConfig(preset);
  if (!config.ok()) return config.status();
  if (const std::string layout = absl::GetFlag(FLAGS_layout); !layout.empty()) {
    if (absl::Status s = hsx::ApplyLayoutName(layout, *config); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", s.message()));
    }
  }
  if (const int64_t layers = absl::GetFlag(FLAGS_layers); layers != 0) {
    if (layers < 1) return absl::InvalidArgumentError("--layers must be at least 1");
    config->num_hidden_layers = layers;
  }
  return config;
}

absl::Status Run() {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (out.empty()) return absl::InvalidArgumentError("--out is required");
  absl::StatusOr<hsx::ModelConfig> config = ChooseConfig();
  if (!config.ok()) return config.status();
  absl::StatusOr<int64_t> shard_bytes = hsx::ParseByteSize(absl::GetFlag(FLAGS_shard_size));
  if (!shard_bytes.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--shard_size: ", shard_bytes.status().message()));
  }
  hsx::GeneratorOptions options;
  options.seed = absl::GetFlag(FLAGS_seed);
  options.shard_bytes = *shard_bytes;
  options.threads = absl::GetFlag(FLAGS_threads);
  options.zero_weights = absl::GetFlag(FLAGS_zero_weights);
  if (absl::Status s = hsx::WriteRandomCheckpoint(*config, out, options); !s.ok()) return s;
  // Read back through the loader: what we wrote must validate.
  absl::StatusOr<std::unique_ptr<hsx::Checkpoint>> checkpoint = hsx::Checkpoint::Open(out);
  if (!checkpoint.ok()) {
    return absl::InternalError(absl::StrCat("written checkpoint does not validate: ",
                                            checkpoint.status().message()));
  }
  std::printf("wrote %s: %lld layers, hidden %lld, %zu shard(s), seed %llu\n", out.c_str(),
              static_cast<long long>(config->num_hidden_layers),
              static_cast<long long>(config->hidden_size), (*checkpoint)->shards().size(),
              static_cast<unsigned long long>(options.seed));
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Writes a random-weight DeepSeek-V3 / Kimi-K2 checkpoint in the real format:\n"
      "config.json with a compressed-tensors quantization_config, safetensors shards with\n"
      "an index (also for one shard), routed experts INT4 pack-quantized (group 32), everything\n"
      "else BF16. Presets say model_type deepseek_v3 (transformers' Auto classes load them);\n"
      "--layout k2 writes Kimi-K2's own model_type kimi_k2.\n\n"
      "  hsx-make-model --preset tiny --out /tmp/tiny\n"
      "  hsx-make-model --preset kimi-k2 --layers 2 --layout k2.5 --out /data/k2-2layer\n"
      "  hsx-make-model --config my_config.json --out DIR --seed 7");
  hsx::AcceptDashedFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return hsx::ExitWithStatus("hsx-make-model", Run());
}
