// random_model.cc: presets, deterministic weight values and shard layout.
#include "server/model/random_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <thread>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kernels/bf16.h"
#include "format/safetensors_writer.h"
#include "server/model/tensor_specs.h"

namespace hsx {
namespace {

namespace fs = std::filesystem;

ModelConfig TinyConfig() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.vocab_size = 2048;
  c.hidden_size = 128;
  c.num_hidden_layers = 8;
  c.intermediate_size = 256;
  c.moe_intermediate_size = 64;
  c.n_routed_experts = 16;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 4;
  c.first_k_dense_replace = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.q_lora_rank = 64;
  c.kv_lora_rank = 32;
  c.qk_nope_head_dim = 32;
  c.qk_rope_head_dim = 16;
  c.v_head_dim = 32;
  c.n_group = 1;
  c.topk_group = 1;
  c.routed_scaling_factor = 2.827;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 50000.0;
  c.max_position_embeddings = 4096;
  c.rope_scaling = {"yarn", 32.0, 128, 1.0, 1.0, 1.0, 1.0};
  return c;
}

ModelConfig SmallConfig() {
  ModelConfig c = TinyConfig();
  c.vocab_size = 32000;
  c.hidden_size = 1024;
  c.num_hidden_layers = 6;
  c.intermediate_size = 2816;
  c.moe_intermediate_size = 512;
  c.n_routed_experts = 64;
  c.num_experts_per_tok = 6;
  c.num_attention_heads = 16;
  c.num_key_value_heads = 16;
  c.q_lora_rank = 384;
  c.kv_lora_rank = 128;
  c.qk_nope_head_dim = 64;
  c.qk_rope_head_dim = 32;
  c.v_head_dim = 64;
  c.max_position_embeddings = 32768;
  c.rope_scaling = {"yarn", 32.0, 4096, 1.0, 1.0, 1.0, 1.0};
  return c;
}

// Kimi-K2-Thinking's dimensions (model-spec.md §1).
ModelConfig KimiK2Config() {
  ModelConfig c;
  c.model_type = "deepseek_v3";
  c.vocab_size = 163840;
  c.hidden_size = 7168;
  c.num_hidden_layers = 61;
  c.intermediate_size = 18432;
  c.moe_intermediate_size = 2048;
  c.n_routed_experts = 384;
  c.n_shared_experts = 1;
  c.num_experts_per_tok = 8;
  c.first_k_dense_replace = 1;
  c.num_attention_heads = 64;
  c.num_key_value_heads = 64;
  c.q_lora_rank = 1536;
  c.kv_lora_rank = 512;
  c.qk_nope_head_dim = 128;
  c.qk_rope_head_dim = 64;
  c.v_head_dim = 128;
  c.n_group = 1;
  c.topk_group = 1;
  c.routed_scaling_factor = 2.827;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 50000.0;
  c.max_position_embeddings = 262144;
  c.rope_scaling = {"yarn", 64.0, 4096, 1.0, 1.0, 1.0, 1.0};
  return c;
}

// splitmix64's finaliser: a bijective mix, so (key + index) gives independent streams.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [-1, 1), exactly representable, identical on every machine.
float UniformSym(uint64_t bits) {
  return static_cast<float>(bits >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

uint64_t TensorKey(uint64_t seed, const std::string& name) {
  return XXH64(name.data(), name.size(), seed);
}

// Runs fn(begin, end) over [0, count) split across threads.
template <typename Fn>
void ParallelFor(int64_t count, int threads, Fn fn) {
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(threads, count / 65536 + 1));
  if (workers == 1) return fn(int64_t{0}, count);
  std::vector<std::thread> pool;
  const int64_t chunk = (count + workers - 1) / workers;
  for (int64_t w = 0; w < workers; ++w) {
    const int64_t begin = w * chunk;
    const int64_t end = std::min(count, begin + chunk);
    if (begin < end) pool.emplace_back([=] { fn(begin, end); });
  }
  for (std::thread& t : pool) t.join();
}

// Standard deviation (or, for norms, the centre) of each weight role.
float RoleScale(const WeightSpec& spec, const ModelConfig& c) {
  const float fan_in = spec.shape.size() == 2 ? static_cast<float>(spec.shape[1]) : 1.0f;
  switch (spec.role) {
    case WeightRole::kEmbedding: return 1.0f;
    case WeightRole::kNorm: return 1.0f;
    case WeightRole::kRouterBias: return 0.05f;
    case WeightRole::kOutputProjection:
      // Each layer adds two such outputs to the residual stream; keep the sum
      // of their variances over all layers comparable to the embedding's.
      return 1.0f / std::sqrt(fan_in * 2.0f * static_cast<float>(c.num_hidden_layers));
    case WeightRole::kInputProjection:
    case WeightRole::kRouter:
    case WeightRole::kLmHead: return 1.0f / std::sqrt(fan_in);
  }
  return 1.0f;
}

// Fills bf16 or f32 values: norms around 1 (0.9..1.1), everything else
// uniform with the role's standard deviation.
SafetensorsWriter::Fill DenseFill(const WeightSpec& spec, float scale, uint64_t key, int threads) {
  const bool is_norm = spec.role == WeightRole::kNorm;
  const DType dtype = spec.dtype;
  const float amplitude = is_norm ? 0.1f : scale * std::sqrt(3.0f);
  return [=](std::span<uint8_t> out) {
    const int64_t count = static_cast<int64_t>(out.size()) / DTypeSize(dtype);
    ParallelFor(count, threads, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const float value = (is_norm ? 1.0f : 0.0f) + amplitude * UniformSym(Mix(key + i));
        if (dtype == DType::kF32) {
          reinterpret_cast<float*>(out.data())[i] = value;
        } else {
          reinterpret_cast<uint16_t*>(out.data())[i] = FloatToBf16(value);
        }
      }
    });
  };
}

void AddQuantizedLinear(const WeightSpec& spec, float scale, uint64_t seed, int group_size,
                        DType shape_dtype, int threads, SafetensorsWriter& writer) {
  const int64_t rows = spec.shape[0];
  const int64_t cols = spec.shape[1];
  const uint64_t packed_key = TensorKey(seed, spec.name + ".weight_packed");
  const uint64_t scale_key = TensorKey(seed, spec.name + ".weight_scale");
  // Uniform nibbles give q uniform in [-8, 7], standard deviation ~4.61.
  writer.Add(spec.name + ".weight_packed", DType::kI32, {rows, cols / 8},
             [=](std::span<uint8_t> out) {
               ParallelFor(rows * cols / 8, threads, [&](int64_t begin, int64_t end) {
                 for (int64_t i = begin; i < end; ++i) {
                   reinterpret_cast<uint32_t*>(out.data())[i] =
                       static_cast<uint32_t>(Mix(packed_key + i));
                 }
               });
             });
  const float base = scale / 4.61f;
  writer.Add(spec.name + ".weight_scale", DType::kBF16, {rows, cols / group_size},
             [=](std::span<uint8_t> out) {
               ParallelFor(rows * cols / group_size, threads, [&](int64_t begin, int64_t end) {
                 for (int64_t i = begin; i < end; ++i) {
                   const float jitter = 1.0f + 0.25f * UniformSym(Mix(scale_key + i));
                   reinterpret_cast<uint16_t*>(out.data())[i] = FloatToBf16(base * jitter);
                 }
               });
             });
  std::vector<uint8_t> shape_bytes(2 * DTypeSize(shape_dtype));
  for (int i = 0; i < 2; ++i) {
    if (shape_dtype == DType::kI32) {
      reinterpret_cast<int32_t*>(shape_bytes.data())[i] = static_cast<int32_t>(spec.shape[i]);
    } else {
      reinterpret_cast<int64_t*>(shape_bytes.data())[i] = spec.shape[i];
    }
  }
  writer.AddBytes(spec.name + ".weight_shape", shape_dtype, {2}, shape_bytes);
}

void AddWeight(const WeightSpec& spec, const ModelConfig& c, const GeneratorOptions& options,
               SafetensorsWriter& writer) {
  const float scale = RoleScale(spec, c);
  if (spec.quantized) {
    const DType shape_dtype =
        c.layout == CheckpointLayout::kNestedK25 ? DType::kI32 : DType::kI64;  // as released
    AddQuantizedLinear(spec, scale, options.seed, c.quantization->group_size, shape_dtype,
                       options.threads, writer);
    return;
  }
  const std::string name = spec.is_linear ? spec.name + ".weight" : spec.name;
  writer.Add(name, spec.dtype, spec.shape,
             DenseFill(spec, scale, TensorKey(options.seed, name), options.threads));
}

absl::Status PrepareOutputDir(const std::string& out_dir) {
  std::error_code error;
  if (fs::exists(out_dir, error)) {
    if (!fs::is_directory(out_dir, error)) {
      return absl::AlreadyExistsError(absl::StrCat(out_dir, ": exists and is not a directory"));
    }
    if (!fs::is_empty(out_dir, error)) {
      return absl::AlreadyExistsError(
          absl::StrCat(out_dir, ": directory is not empty; refusing to overwrite it"));
    }
    return absl::OkStatus();
  }
  if (!fs::create_directories(out_dir, error)) {
    return absl::InternalError(absl::StrCat(out_dir, ": cannot create: ", error.message()));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> PresetNames() { return {"tiny", "small", "kimi-k2"}; }

absl::StatusOr<ModelConfig> PresetConfig(absl::string_view name) {
  ModelConfig config;
  if (name == "tiny") {
    config = TinyConfig();
  } else if (name == "small") {
    config = SmallConfig();
  } else if (name == "kimi-k2") {
    config = KimiK2Config();
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown preset '", name, "'; expected one of ",
                                                   absl::StrJoin(PresetNames(), ", ")));
  }
  config.architectures = {"DeepseekV3ForCausalLM"};
  config.quantization = KimiQuantizationConfig();
  return config;
}

std::vector<std::string> LayoutNames() { return {"deepseek_v3", "k2", "k2.5"}; }

absl::Status ApplyLayoutName(absl::string_view name, ModelConfig& config) {
  if (name == "deepseek_v3" || name == "k2") {
    ApplyLayout(CheckpointLayout::kFlat, config);
    config.model_type = name == "k2" ? "kimi_k2" : "deepseek_v3";
    return absl::OkStatus();
  }
  if (name == "k2.5") {
    ApplyLayout(CheckpointLayout::kNestedK25, config);
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat("layout '", name, "': expected one of ",
                                                 absl::StrJoin(LayoutNames(), ", ")));
}

void ApplyLayout(CheckpointLayout layout, ModelConfig& config) {
  config.layout = layout;
  const bool kimi_dims = config.hidden_size == 7168 && config.n_routed_experts == 384;
  if (layout == CheckpointLayout::kNestedK25 && kimi_dims) {
    config.rms_norm_eps = 1e-5;  // K2.5's values (model-spec.md §1)
    config.rope_scaling.beta_fast = 32.0;
  }
}

absl::Status WriteRandomCheckpoint(ModelConfig config, const std::string& out_dir,
                                   const GeneratorOptions& given) {
  GeneratorOptions options = given;
  if (options.threads <= 0) options.threads = std::max(1u, std::thread::hardware_concurrency());
  if (!config.quantization) config.quantization = KimiQuantizationConfig();
  if (absl::Status s = PrepareOutputDir(out_dir); !s.ok()) return s;

  const std::vector<WeightSpec> specs = TextModelWeights(config);
  // Plan shards: weights in checkpoint order, a new shard when the next weight
  // would push the current one past shard_bytes.
  std::vector<std::vector<const WeightSpec*>> shards(1);
  int64_t current = 0;
  for (const WeightSpec& spec : specs) {
    const int64_t bytes = spec.stored_bytes(config.quantization->group_size);
    if (current > 0 && current + bytes > options.shard_bytes) {
      shards.emplace_back();
      current = 0;
    }
    shards.back().push_back(&spec);
    current += bytes;
  }

  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t total_size = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file =
        shards.size() == 1 ? "model.safetensors"
                           : absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, shards.size());
    SafetensorsWriter writer;
    writer.SetMetadata("format", "pt");
    if (options.zero_weights) writer.ZeroTensorsFrom(64);  // weight_shape tensors are 8 or 16 bytes
    for (const WeightSpec* spec : shards[i]) AddWeight(*spec, config, options, writer);
    if (absl::Status s = writer.Write((fs::path(out_dir) / file).string()); !s.ok()) return s;
    total_size += writer.data_bytes();
    for (const WeightSpec* spec : shards[i]) {
      if (!spec->quantized) {
        weight_map[spec->is_linear ? spec->name + ".weight" : spec->name] = file;
        continue;
      }
      for (const char* suffix : {".weight_packed", ".weight_scale", ".weight_shape"}) {
        weight_map[spec->name + suffix] = file;
      }
    }
  }
  const std::string config_text = ModelConfigToJson(config).dump(2) + "\n";
  if (absl::Status s = WriteFileAtomically((fs::path(out_dir) / "config.json").string(), config_text);
      !s.ok()) {
    return s;
  }
  // An index even for one shard: some trainers (SpecForge's target head) find
  // the embedding and lm_head through it.
  nlohmann::ordered_json index = {{"metadata", {{"total_size", total_size}}},
                                  {"weight_map", weight_map}};
  return WriteFileAtomically((fs::path(out_dir) / "model.safetensors.index.json").string(),
                             index.dump(2) + "\n");
}

}  // namespace hsx
