// hsx-inspect: what a checkpoint holds and how tensor parallelism would place
// it; optionally writes one dequantized weight for cross-checking.
#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "server/model/checkpoint.h"
#include "format/safetensors_writer.h"
#include "base/cli.h"

ABSL_FLAG(std::string, model, "", "Checkpoint directory (config.json + safetensors).");
ABSL_FLAG(int, tp, 1, "Tensor-parallel degree for the per-rank memory plan.");
ABSL_FLAG(bool, json, false, "Print the report as JSON instead of text.");
ABSL_FLAG(std::string, dequant, "", "Write this one weight (a Linear's module name, or any tensor "
          "name) as float32 to --out; INT4 weights are dequantized exactly as compressed-tensors "
          "does.");
ABSL_FLAG(std::string, out, "", "Output .safetensors file for --dequant.");
ABSL_FLAG(bool, full_digest, false,
          "Print the XXH64 of config.json, the index and every byte of every shard (reads the whole "
          "model), the digest to record beside data made from it; model_revision, which hsx-server and "
          "hsx-dump record, samples each shard's ends and size only.");
ABSL_FLAG(std::string, config, "", "Only parse this config.json (no weights needed) and print, as JSON, "
          "every architecture field as hsx read it (defaults filled in).");

namespace {

using json = nlohmann::ordered_json;

std::string Category(const hsx::WeightSpec& spec, const hsx::ModelConfig& config) {
  switch (spec.role) {
    case hsx::WeightRole::kEmbedding: return "embedding";
    case hsx::WeightRole::kLmHead: return "lm_head";
    case hsx::WeightRole::kNorm: return absl::StrContains(spec.name, "self_attn") ? "attention" : "norms";
    case hsx::WeightRole::kRouter:
    case hsx::WeightRole::kRouterBias: return "routers";
    default: break;
  }
  if (absl::StrContains(spec.name, ".self_attn.")) return "attention";
  if (spec.expert >= 0) return "routed_experts";
  if (absl::StrContains(spec.name, ".shared_experts.")) return "shared_experts";
  return "dense_mlp";
}

// hsx-make-model's --layout name of the checkpoint.
std::string LayoutName(const hsx::ModelConfig& c) {
  if (c.layout == hsx::CheckpointLayout::kNestedK25) return "k2.5";
  if (c.model_type == "deepseek_v3") return "deepseek_v3";
  if (c.model_type == "kimi_k2") return "k2";
  return absl::StrCat("flat (model_type ", c.model_type, ")");
}

// Whether transformers' Auto classes know the model type without remote code.
std::string TransformersLoad(const hsx::ModelConfig& c) {
  if (c.layout == hsx::CheckpointLayout::kFlat && c.model_type == "deepseek_v3") {
    return "Auto classes load it without remote code (model_type deepseek_v3)";
  }
  return absl::StrCat("needs the checkpoint's remote code (model_type ",
                      c.layout == hsx::CheckpointLayout::kNestedK25 ? "kimi_k25" : c.model_type,
                      " is not built into transformers)");
}

json Report(const hsx::Checkpoint& checkpoint, int tp) {
  const hsx::ModelConfig& c = checkpoint.config();
  const int group = c.quantization ? c.quantization->group_size : 32;
  std::map<std::string, json> categories;
  int64_t total_params = 0, int4_bytes = 0, bf16_bytes = 0, other_bytes = 0;
  // The per-rank plan comes from the same table the loader places by.
  const std::vector<int64_t> rank_bytes = hsx::BytesPerRank(c, tp);
  for (const hsx::WeightSpec& spec : checkpoint.weights()) {
    json& entry = categories[Category(spec, c)];
    if (entry.is_null()) entry = {{"params", 0}, {"bytes", 0}};
    const int64_t bytes = spec.stored_bytes(group);
    entry["params"] = entry["params"].get<int64_t>() + spec.num_elements();
    entry["bytes"] = entry["bytes"].get<int64_t>() + bytes;
    total_params += spec.num_elements();
    if (spec.quantized) {
      int4_bytes += bytes;
    } else if (spec.dtype == hsx::DType::kBF16) {
      bf16_bytes += bytes;
    } else {
      other_bytes += bytes;
    }
  }
  json ranks = json::array();
  for (int rank = 0; rank < tp; ++rank) {
    int64_t experts = 0;
    for (int64_t e = 0; e < c.n_routed_experts; ++e) experts += hsx::ExpertOwner(e, c.n_routed_experts, tp) == rank;
    ranks.push_back({{"rank", rank},
                     {"bytes", rank_bytes[rank]},
                     {"attention_heads", c.num_attention_heads / tp},
                     {"routed_experts_per_layer", experts}});
  }
  absl::StatusOr<std::string> revision = hsx::CheckpointRevision(checkpoint.dir());
  return {
      {"model", checkpoint.dir()},
      {"name", hsx::CheckpointName(checkpoint.dir())},
      {"revision", revision.ok() ? *revision : std::string(revision.status().message())},
      {"architecture", {{"model_type", c.model_type},
                        {"layout", LayoutName(c)},
                        {"transformers", TransformersLoad(c)},
                        {"num_hidden_layers", c.num_hidden_layers},
                        {"hidden_size", c.hidden_size},
                        {"vocab_size", c.vocab_size},
                        {"num_attention_heads", c.num_attention_heads},
                        {"q_lora_rank", c.q_lora_rank},
                        {"kv_lora_rank", c.kv_lora_rank},
                        {"qk_head_dim", c.qk_head_dim()},
                        {"v_head_dim", c.v_head_dim},
                        {"first_k_dense_replace", c.first_k_dense_replace},
                        {"n_routed_experts", c.n_routed_experts},
                        {"n_shared_experts", c.n_shared_experts},
                        {"num_experts_per_tok", c.num_experts_per_tok},
                        {"n_group", c.n_group},
                        {"topk_group", c.topk_group},
                        {"scoring_func", c.scoring_func},
                        {"rope", c.rope_scaling.type},
                        {"quantization", c.quantization ? absl::StrCat("int4 pack-quantized, group ", group)
                                                        : std::string("none")},
                        {"eagle3_capture_ids", c.Eagle3CaptureIds()}}},
      {"shards", checkpoint.shards().size()},
      {"params", total_params},
      {"bytes", {{"int4", int4_bytes}, {"bf16", bf16_bytes}, {"other", other_bytes},
                 {"total", int4_bytes + bf16_bytes + other_bytes}}},
      {"categories", categories},
      {"tensor_parallel", {{"tp", tp}, {"lm_head_loaded", false}, {"ranks", ranks}}},
  };
}

std::string Human(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  return absl::StrFormat("%.2f %s", value, units[unit]);
}

void PrintText(const json& r) {
  std::printf("model      %s\n", r["model"].get<std::string>().c_str());
  for (const auto& [key, value] : r["architecture"].items()) {
    std::printf("  %-22s %s\n", key.c_str(), value.dump().c_str());
  }
  std::printf("shards     %s\nparams     %s\n", r["shards"].dump().c_str(), r["params"].dump().c_str());
  std::printf("bytes      int4 %s, bf16 %s, other %s, total %s\n",
              Human(r["bytes"]["int4"].get<int64_t>()).c_str(),
              Human(r["bytes"]["bf16"].get<int64_t>()).c_str(),
              Human(r["bytes"]["other"].get<int64_t>()).c_str(),
              Human(r["bytes"]["total"].get<int64_t>()).c_str());
  std::printf("%-16s %16s %14s\n", "category", "params", "bytes");
  for (const auto& [name, entry] : r["categories"].items()) {
    std::printf("%-16s %16lld %14s\n", name.c_str(),
                static_cast<long long>(entry["params"].get<int64_t>()),
                Human(entry["bytes"].get<int64_t>()).c_str());
  }
  const json& tp = r["tensor_parallel"];
  std::printf("tensor parallel: tp=%d (heads and MLP intermediates split, routed experts whole, "
              "lm_head not loaded)\n", tp["tp"].get<int>());
  for (const json& rank : tp["ranks"]) {
    std::printf("  rank %d: %s, %d heads, %d routed experts per MoE layer\n", rank["rank"].get<int>(),
                Human(rank["bytes"].get<int64_t>()).c_str(), rank["attention_heads"].get<int>(),
                rank["routed_experts_per_layer"].get<int>());
  }
}

absl::Status Dequant(const hsx::Checkpoint& checkpoint, std::string name, const std::string& out) {
  if (out.empty()) return absl::InvalidArgumentError("--dequant needs --out FILE.safetensors");
  const hsx::WeightSpec* spec = checkpoint.FindWeight(name);
  for (const char* suffix : {".weight_packed", ".weight_scale", ".weight"}) {
    if (spec == nullptr && absl::EndsWith(name, suffix)) {
      spec = checkpoint.FindWeight(name.substr(0, name.size() - absl::string_view(suffix).size()));
    }
  }
  if (spec == nullptr) {
    return absl::NotFoundError(absl::StrCat("--dequant: no weight '", name, "' in ", checkpoint.dir()));
  }
  absl::StatusOr<std::vector<float>> values = checkpoint.ReadAsFloat(*spec);
  if (!values.ok()) return values.status();
  hsx::SafetensorsWriter writer;
  writer.SetMetadata("source", spec->name);
  writer.SetMetadata("quantized", spec->quantized ? "int4" : "no");
  writer.AddBytes(spec->is_linear ? spec->name + ".weight" : spec->name, hsx::DType::kF32,
                  spec->shape,
                  {reinterpret_cast<const uint8_t*>(values->data()), values->size() * sizeof(float)});
  return writer.Write(out);
}

// The parsed config as hsx would write it (defaults filled in), flat: K2.5's
// text_config fields at the top, plus "layout". What the Python tests compare
// with transformers' DeepseekV3Config.
nlohmann::json ConfigReport(const hsx::ModelConfig& c) {
  nlohmann::json written = hsx::ModelConfigToJson(c);
  nlohmann::json flat = written.contains("text_config") ? written["text_config"] : written;
  flat["layout"] = c.layout == hsx::CheckpointLayout::kFlat ? "flat" : "nested_k25";
  return flat;
}

absl::Status Run() {
  if (const std::string path = absl::GetFlag(FLAGS_config); !path.empty()) {
    absl::StatusOr<hsx::ModelConfig> config = hsx::ReadModelConfig(path);
    if (!config.ok()) return config.status();
    std::printf("%s\n", ConfigReport(*config).dump(2).c_str());
    return absl::OkStatus();
  }
  const std::string model = absl::GetFlag(FLAGS_model);
  if (model.empty()) return absl::InvalidArgumentError("--model is required");
  absl::StatusOr<std::unique_ptr<hsx::Checkpoint>> checkpoint = hsx::Checkpoint::Open(model);
  if (!checkpoint.ok()) return checkpoint.status();
  if (!absl::GetFlag(FLAGS_dequant).empty()) {
    return Dequant(**checkpoint, absl::GetFlag(FLAGS_dequant), absl::GetFlag(FLAGS_out));
  }
  if (absl::GetFlag(FLAGS_full_digest)) {
    absl::StatusOr<std::string> digest = hsx::FullCheckpointDigest(model);
    if (!digest.ok()) return digest.status();
    std::printf("%s  %s (xxh64 of config.json, the index and every shard byte)\n", digest->c_str(), model.c_str());
    return absl::OkStatus();
  }
  const int tp = absl::GetFlag(FLAGS_tp);
  if (absl::Status s = hsx::CheckTensorParallelDegree((*checkpoint)->config(), tp); !s.ok()) return s;
  const json report = Report(**checkpoint, tp);
  if (absl::GetFlag(FLAGS_json)) {
    std::printf("%s\n", report.dump(2).c_str());
  } else {
    PrintText(report);
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Describes a checkpoint: architecture, parameter and byte counts (INT4 and BF16), and what\n"
      "each tensor-parallel rank would hold. Every tensor is validated on the way.\n\n"
      "  hsx-inspect --model DIR [--tp 8] [--json]\n"
      "  hsx-inspect --model DIR --dequant model.layers.1.mlp.experts.0.up_proj --out w.safetensors\n"
      "  hsx-inspect --config config.json   (the architecture as hsx reads it, as JSON)");
  hsx::AcceptDashedFlags(argc, argv);
  absl::ParseCommandLine(argc, argv);
  return hsx::ExitWithStatus("hsx-inspect", Run());
}
