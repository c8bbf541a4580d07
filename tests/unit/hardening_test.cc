// hardening_test.cc: checkpoints and configs that lie (issue "Hardening"):
// absurd numbers, another architecture, tensors the config does not account
// for. Each is refused at load with the field or tensor named.
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "gtest/gtest.h"
#include "server/model/checkpoint.h"
#include "server/model/config.h"
#include "server/model/random_model.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using nlohmann::json;
using ::hsx::testing::ReadFile;
using ::hsx::testing::TempDir;
using ::hsx::testing::WriteFile;

ModelConfig Tiny() { return *PresetConfig("tiny"); }

std::string ErrorOf(const json& root) {
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "config.json");
  return parsed.ok() ? "accepted" : std::string(parsed.status().message());
}

TEST(Hardening, AbsurdNumbersAreRefusedWithTheFieldNamed) {
  const struct {
    const char* field;
    json value;
  } cases[] = {{"max_position_embeddings", 0},  {"max_position_embeddings", -5}, {"rms_norm_eps", 0.0},
               {"rms_norm_eps", -1e-6},          {"rope_theta", 0.0},             {"rope_theta", -10000.0},
               {"routed_scaling_factor", 1e9},   {"routed_scaling_factor", 0.0}, {"num_nextn_predict_layers", -1}};
  for (const auto& c : cases) {
    json root = ModelConfigToJson(Tiny());
    root[c.field] = c.value;
    const std::string error = ErrorOf(root);
    EXPECT_NE(error.find(std::string("'") + c.field + "'"), std::string::npos) << c.field << "=" << c.value << ": "
                                                                              << error;
  }
}

TEST(Hardening, AbsurdYarnValuesAreRefused) {
  ModelConfig yarn = Tiny();
  yarn.rope_scaling.type = "yarn";
  yarn.rope_scaling.factor = 32.0;
  for (const char* field : {"factor", "original_max_position_embeddings"}) {
    json root = ModelConfigToJson(yarn);
    ASSERT_TRUE(root.contains("rope_scaling"));
    root["rope_scaling"][field] = 0;
    EXPECT_NE(ErrorOf(root).find(std::string("rope_scaling.") + field), std::string::npos) << ErrorOf(root);
  }
}

TEST(Hardening, OtherArchitecturesAreRefused) {
  json root = ModelConfigToJson(Tiny());
  root["model_type"] = "llama";
  EXPECT_NE(ErrorOf(root).find("'model_type' is 'llama'"), std::string::npos) << ErrorOf(root);
  root = ModelConfigToJson(Tiny());
  root["architectures"] = {"LlamaForCausalLM"};
  EXPECT_NE(ErrorOf(root).find("LlamaForCausalLM"), std::string::npos) << ErrorOf(root);
  root = ModelConfigToJson(Tiny());
  root["model_type"] = "kimi_k2";
  root["architectures"] = {"DeepseekV3ForCausalLM"};
  EXPECT_EQ(ErrorOf(root), "accepted");
}

class ExtraTensors : public ::testing::Test {
 protected:
  void SetUp() override {
    ModelConfig config = Tiny();
    config.num_hidden_layers = 4;
    ASSERT_TRUE(WriteRandomCheckpoint(config, dir_ / "m", GeneratorOptions{}).ok());
  }
  void EditConfig(const std::function<void(json&)>& edit) {
    const std::string path = dir_ / "m/config.json";
    json root = json::parse(ReadFile(path));
    edit(root);
    WriteFile(path, root.dump());
  }
  TempDir dir_;
};

TEST_F(ExtraTensors, AConfigThatUnderReportsLayersIsRefused) {
  EditConfig([](json& root) { root["num_hidden_layers"] = 2; });
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_ / "m");
  ASSERT_FALSE(checkpoint.ok());
  const std::string message(checkpoint.status().message());
  EXPECT_NE(message.find("belongs to layer 2"), std::string::npos) << message;
  EXPECT_NE(message.find("num_hidden_layers 2"), std::string::npos) << message;
}

TEST_F(ExtraTensors, DeclaredMtpLayersAreAllowed) {
  // The same tensors read as 2 decoder layers + 2 multi-token-prediction layers.
  EditConfig([](json& root) {
    root["num_hidden_layers"] = 2;
    root["num_nextn_predict_layers"] = 2;
  });
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_ / "m");
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ((*checkpoint)->config().num_hidden_layers, 2);
}

// Adds a zero-length tensor to the first shard (and, with `indexed`, to the index).
void AddExtraTensor(const std::string& model, const std::string& name, bool indexed) {
  const std::string index_path = model + "/model.safetensors.index.json";
  std::string shard = model + "/model.safetensors";
  json index;
  if (std::filesystem::exists(index_path)) {
    index = json::parse(ReadFile(index_path));
    shard = model + "/" + index["weight_map"].begin().value().get<std::string>();
  }
  ::hsx::testing::EditSafetensorsHeader(shard, [&](json& header) {
    header[name] = {{"dtype", "BF16"}, {"shape", {0}}, {"data_offsets", {0, 0}}};
  });
  if (indexed && !index.is_null()) {
    index["weight_map"][name] = std::filesystem::path(shard).filename().string();
    WriteFile(index_path, index.dump());
  }
}

TEST_F(ExtraTensors, AnUnknownTensorIsRefusedByName) {
  AddExtraTensor(dir_ / "m", "model.layers.0.self_attn.unexpected_bias", /*indexed=*/true);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_ / "m");
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_NE(checkpoint.status().message().find("unexpected tensor 'model.layers.0.self_attn.unexpected_bias'"),
            std::string::npos)
      << checkpoint.status();
}

TEST_F(ExtraTensors, AShardTensorTheIndexDoesNotMapIsRefused) {
  if (!std::filesystem::exists(dir_ / "m/model.safetensors.index.json")) GTEST_SKIP() << "single-file checkpoint";
  AddExtraTensor(dir_ / "m", "model.layers.0.self_attn.hidden_extra", /*indexed=*/false);
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir_ / "m");
  ASSERT_FALSE(checkpoint.ok());
  EXPECT_NE(checkpoint.status().message().find("'model.layers.0.self_attn.hidden_extra', which"), std::string::npos)
      << checkpoint.status();
}

}  // namespace
}  // namespace hsx
