// Tests checkpoint loading on generated models, and each class of corruption.
#include "server/model/checkpoint.h"

#include <filesystem>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/cpu/int4_dequant.h"
#include "server/model/random_model.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::EditSafetensorsHeader;
using ::hsx::testing::ReadFile;
using ::hsx::testing::TempDir;
using ::hsx::testing::WriteFile;
using ::testing::HasSubstr;
using json = nlohmann::json;

// Writes the tiny preset in `layout`, split into several shards.
std::string MakeTiny(const TempDir& dir, CheckpointLayout layout = CheckpointLayout::kFlat) {
  ModelConfig config = *PresetConfig("tiny");
  ApplyLayout(layout, config);
  GeneratorOptions options;
  options.seed = 1;
  options.shard_bytes = 200'000;
  const std::string out = dir / "model";
  const absl::Status status = WriteRandomCheckpoint(config, out, options);
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

absl::Status OpenStatus(const std::string& dir) { return Checkpoint::Open(dir).status(); }

// The shard file holding `tensor`, per the index.
std::string ShardOf(const std::string& model, const std::string& tensor) {
  const json index = json::parse(ReadFile(model + "/model.safetensors.index.json"));
  return model + "/" + index["weight_map"][tensor].get<std::string>();
}

TEST(Checkpoint, OpensBothLayouts) {
  for (CheckpointLayout layout : {CheckpointLayout::kFlat, CheckpointLayout::kNestedK25}) {
    TempDir dir;
    const std::string model = MakeTiny(dir, layout);
    absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(model);
    ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
    EXPECT_GT((*checkpoint)->shards().size(), 1u);
    const std::string prefix = layout == CheckpointLayout::kFlat ? "" : "language_model.";
    const WeightSpec* expert = (*checkpoint)->FindWeight(prefix + "model.layers.1.mlp.experts.3.up_proj");
    ASSERT_NE(expert, nullptr);
    EXPECT_TRUE(expert->quantized);
    const WeightSpec* attention = (*checkpoint)->FindWeight(prefix + "model.layers.1.self_attn.o_proj");
    ASSERT_NE(attention, nullptr);
    EXPECT_FALSE(attention->quantized);
    // weight_shape is I32 in the K2.5 layout (as released) and I64 otherwise.
    absl::StatusOr<TensorRef> shape =
        (*checkpoint)->Tensor(prefix + "model.layers.1.mlp.experts.3.up_proj.weight_shape");
    ASSERT_TRUE(shape.ok());
    EXPECT_EQ(shape->info->dtype, layout == CheckpointLayout::kFlat ? DType::kI64 : DType::kI32);
  }
}

TEST(Checkpoint, SingleFileCheckpoint) {
  TempDir dir;
  GeneratorOptions options;
  ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "m", options).ok());
  EXPECT_TRUE(std::filesystem::exists(dir / "m/model.safetensors"));
  // An index even for one shard (SpecForge finds lm_head through it).
  const json index = json::parse(ReadFile(dir / "m/model.safetensors.index.json"));
  ASSERT_TRUE(index.contains("weight_map"));
  EXPECT_TRUE(index["weight_map"].contains("lm_head.weight"));
  for (const auto& [name, file] : index["weight_map"].items()) EXPECT_EQ(file, "model.safetensors") << name;
  EXPECT_TRUE(OpenStatus(dir / "m").ok());
  // Real single-file checkpoints have no index: that loads too.
  std::filesystem::remove(dir / "m/model.safetensors.index.json");
  EXPECT_TRUE(OpenStatus(dir / "m").ok());
}

TEST(Checkpoint, LayoutNamesSetModelType) {
  ModelConfig config = *PresetConfig("tiny");
  EXPECT_EQ(config.model_type, "deepseek_v3");  // the default: transformers' Auto classes know it
  ASSERT_TRUE(ApplyLayoutName("k2", config).ok());
  EXPECT_EQ(config.model_type, "kimi_k2");
  EXPECT_EQ(config.layout, CheckpointLayout::kFlat);
  ASSERT_TRUE(ApplyLayoutName("deepseek_v3", config).ok());
  EXPECT_EQ(config.model_type, "deepseek_v3");
  ASSERT_TRUE(ApplyLayoutName("k2.5", config).ok());
  EXPECT_EQ(config.layout, CheckpointLayout::kNestedK25);
  EXPECT_EQ(ModelConfigToJson(config)["model_type"], "kimi_k25");
  const absl::Status bad = ApplyLayoutName("kimi", config);
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.message(), HasSubstr("deepseek_v3, k2, k2.5"));
}

TEST(Checkpoint, DequantizedWeightsMatchTheReference) {
  TempDir dir;
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(MakeTiny(dir));
  ASSERT_TRUE(checkpoint.ok());
  const WeightSpec* spec = (*checkpoint)->FindWeight("model.layers.2.mlp.experts.0.down_proj");
  ASSERT_NE(spec, nullptr);
  absl::StatusOr<Int4Weight> w = (*checkpoint)->QuantizedLinear(*spec);
  ASSERT_TRUE(w.ok());
  absl::StatusOr<std::vector<float>> values = (*checkpoint)->ReadAsFloat(*spec);
  ASSERT_TRUE(values.ok());
  ASSERT_EQ(values->size(), static_cast<size_t>(w->rows * w->cols));
  int distinct_q = 0;
  bool seen[16] = {};
  for (int64_t r = 0; r < w->rows; ++r) {
    for (int64_t c = 0; c < w->cols; ++c) {
      const int q = Int4At(w->packed + r * w->cols / 8, c);
      if (!seen[q + 8]) ++distinct_q;
      seen[q + 8] = true;
      const float scale = Bf16ToFloat(w->scale[r * (w->cols / w->group_size) + c / w->group_size]);
      ASSERT_EQ((*values)[r * w->cols + c], RoundToBf16(static_cast<float>(q) * scale));
    }
  }
  EXPECT_EQ(distinct_q, 16);  // the generator uses the full nibble range, -8 included
}

TEST(Checkpoint, TruncatedShard) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string shard = ShardOf(model, "model.layers.1.mlp.experts.0.up_proj.weight_packed");
  const std::string bytes = ReadFile(shard);
  WriteFile(shard, bytes.substr(0, bytes.size() / 2));
  const absl::Status status = OpenStatus(model);
  EXPECT_THAT(status.message(), HasSubstr(shard));
  EXPECT_THAT(status.message(), HasSubstr("run past the end of the data section"));
}

TEST(Checkpoint, OffsetsPastTheEnd) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.1.self_attn.o_proj.weight";
  const std::string shard = ShardOf(model, name);
  EditSafetensorsHeader(shard, [&](json& h) {
    const uint64_t size = h[name]["data_offsets"][1].get<uint64_t>() - h[name]["data_offsets"][0].get<uint64_t>();
    h[name]["data_offsets"] = {1ull << 40, (1ull << 40) + size};
  });
  EXPECT_THAT(OpenStatus(model).message(),
              HasSubstr("tensor '" + name + "': data_offsets [1099511627776"));
}

TEST(Checkpoint, OverlappingTensors) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.1.input_layernorm.weight";
  const std::string shard = ShardOf(model, name);
  EditSafetensorsHeader(shard, [&](json& h) {
    const uint64_t size = h[name]["data_offsets"][1].get<uint64_t>() - h[name]["data_offsets"][0].get<uint64_t>();
    h[name]["data_offsets"] = {2, 2 + size};  // inside whatever tensor starts at 0
  });
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("overlap tensor"));
}

TEST(Checkpoint, MissingTensor) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.3.mlp.experts.5.gate_proj.weight_scale";
  EditSafetensorsHeader(ShardOf(model, name), [&](json& h) { h.erase(name); });
  json index = json::parse(ReadFile(model + "/model.safetensors.index.json"));
  index["weight_map"].erase(name);
  WriteFile(model + "/model.safetensors.index.json", index.dump());
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("missing tensor '" + name + "'"));
}

TEST(Checkpoint, IndexPointsToTheWrongShard) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.3.mlp.experts.5.gate_proj.weight_scale";
  EditSafetensorsHeader(ShardOf(model, name), [&](json& h) { h.erase(name); });
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("does not contain it"));
}

TEST(Checkpoint, WrongShape) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.2.self_attn.kv_b_proj.weight";
  EditSafetensorsHeader(ShardOf(model, name), [&](json& h) {
    json shape = h[name]["shape"];
    h[name]["shape"] = {shape[1], shape[0]};  // same byte count, transposed
  });
  const absl::Status status = OpenStatus(model);
  EXPECT_THAT(status.message(), HasSubstr("tensor '" + name + "' has shape [32, 256], expected [256, 32]"));
}

TEST(Checkpoint, WrongDtype) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.2.mlp.gate.e_score_correction_bias";
  EditSafetensorsHeader(ShardOf(model, name), [&](json& h) {
    h[name]["dtype"] = "I32";  // same element size
  });
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("has dtype I32, expected F32"));
}

TEST(Checkpoint, WrongWeightShapeValues) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.layers.1.mlp.experts.0.up_proj.weight_shape";
  const std::string shard = ShardOf(model, name);
  // Flip the stored [64, 128] to [128, 64] in place.
  std::string bytes = ReadFile(shard);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | static_cast<uint8_t>(bytes[i]);
  const json header = json::parse(bytes.substr(8, length));
  const uint64_t begin = 8 + length + header[name]["data_offsets"][0].get<uint64_t>();
  int64_t values[2] = {128, 64};
  bytes.replace(begin, 16, reinterpret_cast<const char*>(values), 16);
  WriteFile(shard, bytes);
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("holds [128, 64], expected [64, 128]"));
}

TEST(Checkpoint, UnknownDtype) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string name = "model.norm.weight";
  EditSafetensorsHeader(ShardOf(model, name), [&](json& h) { h[name]["dtype"] = "BF17"; });
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("tensor '" + name + "': unknown dtype 'BF17'"));
}

TEST(Checkpoint, HugeHeaderLength) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  const std::string shard = ShardOf(model, "model.norm.weight");
  std::string bytes = ReadFile(shard);
  for (int i = 0; i < 8; ++i) bytes[i] = 0;
  bytes[7] = 0x10;  // 2^60
  WriteFile(shard, bytes);
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("header length 1152921504606846976 exceeds"));
}

TEST(Checkpoint, ConfigMissingRequiredField) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  json config = json::parse(ReadFile(model + "/config.json"));
  config.erase("num_attention_heads");
  WriteFile(model + "/config.json", config.dump());
  EXPECT_THAT(OpenStatus(model).message(),
              HasSubstr("config.json: field 'num_attention_heads' is missing (required)"));
}

TEST(Checkpoint, IndexEscapingTheDirectory) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  json index = json::parse(ReadFile(model + "/model.safetensors.index.json"));
  index["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors";
  WriteFile(model + "/model.safetensors.index.json", index.dump());
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("outside the checkpoint directory"));
}

TEST(Checkpoint, NoWeightsAtAll) {
  TempDir dir;
  const std::string model = MakeTiny(dir);
  for (const auto& entry : std::filesystem::directory_iterator(model)) {
    if (entry.path().filename() != "config.json") std::filesystem::remove(entry.path());
  }
  EXPECT_THAT(OpenStatus(model).message(), HasSubstr("neither model.safetensors.index.json nor"));
}

}  // namespace
}  // namespace hsx

namespace hsx {
namespace {

TEST(CheckpointIdentity, RevisionSeparatesWeightsNotJustConfigs) {
  TempDir dir;
  for (const char* name : {"a", "b", "c"}) {
    GeneratorOptions options;
    options.seed = std::string(name) == "c" ? 2 : 1;
    ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / name, options).ok());
  }
  absl::StatusOr<std::string> a = CheckpointRevision(dir / "a");
  absl::StatusOr<std::string> b = CheckpointRevision(dir / "b");
  absl::StatusOr<std::string> c = CheckpointRevision(dir / "c");
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->size(), 16u);
  EXPECT_EQ(*a, *b);  // same bytes
  EXPECT_NE(*a, *c);  // same config, other weights
  EXPECT_EQ(CheckpointName(dir / "a"), "a");
  EXPECT_EQ(CheckpointName((dir / "a") + "/"), "a");
  EXPECT_FALSE(CheckpointRevision(dir / "missing").ok());
}

}  // namespace
}  // namespace hsx
