// Tests config.json parsing: both layouts, HF defaults, and precise errors.
#include "server/model/config.h"

#include <fstream>

#include <nlohmann/json.hpp>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/random_model.h"

namespace hsx {
namespace {

using ::testing::HasSubstr;
using json = nlohmann::json;

ModelConfig Tiny() { return *PresetConfig("tiny"); }

TEST(Config, FlatRoundTrip) {
  const ModelConfig tiny = Tiny();
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(ModelConfigToJson(tiny).dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->layout, CheckpointLayout::kFlat);
  EXPECT_EQ(parsed->tensor_prefix(), "");
  EXPECT_EQ(parsed->hidden_size, tiny.hidden_size);
  EXPECT_EQ(parsed->q_lora_rank, tiny.q_lora_rank);
  EXPECT_EQ(parsed->rope_scaling.type, "yarn");
  EXPECT_EQ(parsed->rope_scaling.original_max_position_embeddings,
            tiny.rope_scaling.original_max_position_embeddings);
  ASSERT_TRUE(parsed->quantization.has_value());
  EXPECT_EQ(parsed->quantization->group_size, 32);
  EXPECT_EQ(parsed->quantization->ignore(), tiny.quantization->ignore());
}

TEST(Config, NestedK25Layout) {
  ModelConfig tiny = Tiny();
  ApplyLayout(CheckpointLayout::kNestedK25, tiny);
  const json root = ModelConfigToJson(tiny);
  EXPECT_EQ(root["model_type"], "kimi_k25");
  EXPECT_TRUE(root.contains("text_config"));
  EXPECT_TRUE(root.contains("quantization_config"));
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->layout, CheckpointLayout::kNestedK25);
  EXPECT_EQ(parsed->tensor_prefix(), "language_model.");
  EXPECT_EQ(parsed->num_hidden_layers, tiny.num_hidden_layers);
}

TEST(Config, NullQLoraMeansNoQLora) {
  json root = ModelConfigToJson(Tiny());
  root["q_lora_rank"] = nullptr;
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_FALSE(parsed->has_q_lora());
}

TEST(Config, AbsentOptionalFieldsTakeHfDefaults) {
  json root = ModelConfigToJson(Tiny());
  for (const char* key : {"n_group", "topk_group", "rms_norm_eps", "routed_scaling_factor",
                          "first_k_dense_replace", "q_lora_rank"}) {
    root.erase(key);
  }
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->n_group, 8);
  EXPECT_EQ(parsed->topk_group, 4);
  EXPECT_EQ(parsed->rms_norm_eps, 1e-6);
  EXPECT_EQ(parsed->routed_scaling_factor, 2.5);
  EXPECT_EQ(parsed->first_k_dense_replace, 3);
  EXPECT_EQ(parsed->q_lora_rank, 1536);
}

TEST(Config, MissingRequiredFieldNamesFileAndField) {
  json root = ModelConfigToJson(Tiny());
  root.erase("hidden_size");
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "dir/config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("dir/config.json: field 'hidden_size' is missing (required)"));
}

TEST(Config, MissingFieldInsideTextConfigSaysSo) {
  ModelConfig tiny = Tiny();
  ApplyLayout(CheckpointLayout::kNestedK25, tiny);
  json root = ModelConfigToJson(tiny);
  root["text_config"].erase("kv_lora_rank");
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("config.json: text_config: field 'kv_lora_rank' is missing"));
}

TEST(Config, WrongTypeAndInconsistentValuesAreRejected) {
  struct Case {
    const char* key;
    json value;
    const char* message;
  };
  const Case cases[] = {
      {"hidden_size", "7168", "field 'hidden_size' must be an integer"},
      {"num_hidden_layers", 0, "field 'num_hidden_layers' must be positive"},
      {"qk_rope_head_dim", 15, "field 'qk_rope_head_dim' must be even"},
      {"num_experts_per_tok", 99, "'num_experts_per_tok' exceeds 'n_routed_experts'"},
      {"n_group", 3, "'n_routed_experts' must be a multiple of 'n_group'"},
      {"scoring_func", "relu", "field 'scoring_func' is 'relu'"},
      {"moe_layer_freq", 2, "field 'moe_layer_freq' is 2"},
      {"hidden_size", 100, "not a multiple of the quantization group size 32"},
  };
  for (const Case& c : cases) {
    json root = ModelConfigToJson(Tiny());
    root[c.key] = c.value;
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "config.json");
    ASSERT_FALSE(parsed.ok()) << c.key;
    EXPECT_THAT(parsed.status().message(), HasSubstr(c.message)) << c.key;
  }
}

TEST(Config, UnsupportedQuantizationIsRejected) {
  json root = ModelConfigToJson(Tiny());
  root["quantization_config"]["format"] = "float-quantized";
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(),
              HasSubstr("quantization_config: 'format' is \"float-quantized\""));
  root = ModelConfigToJson(Tiny());
  root["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8;
  parsed = ParseModelConfig(root.dump(), "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(), HasSubstr("'num_bits' is 8"));
  root = ModelConfigToJson(Tiny());
  root["quantization_config"]["ignore"] = {"re:(unclosed"};
  parsed = ParseModelConfig(root.dump(), "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(), HasSubstr("not a valid regular expression"));
}

TEST(Config, NotJson) {
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig("{\"hidden_size\": ", "config.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_THAT(parsed.status().message(), HasSubstr("config.json: not valid JSON"));
}

TEST(Config, IgnoreListMatchesLikeCompressedTensors) {
  const QuantizationConfig q = KimiQuantizationConfig();
  EXPECT_TRUE(q.IsQuantized("model.layers.1.mlp.experts.0.gate_proj"));
  EXPECT_TRUE(q.IsQuantized("language_model.model.layers.1.mlp.experts.383.down_proj"));
  EXPECT_FALSE(q.IsQuantized("model.layers.1.mlp.shared_experts.up_proj"));
  EXPECT_FALSE(q.IsQuantized("model.layers.0.mlp.down_proj"));
  EXPECT_FALSE(q.IsQuantized("model.layers.3.self_attn.q_a_proj"));
  EXPECT_FALSE(q.IsQuantized("lm_head"));
}

TEST(Config, NoMediaPlaceholderKeyMeansNone) {
  json root = ModelConfigToJson(Tiny());
  root["image_token_id"] = nullptr;  // HF writes null for "none"
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_TRUE(parsed->media_placeholders.empty());
}

TEST(Config, MediaPlaceholdersAreReadUnderEveryAcceptedKey) {
  json root = ModelConfigToJson(Tiny());  // flat
  int32_t id = 1000;
  std::vector<MediaPlaceholder> expected;
  for (const char* key : kMediaPlaceholderFields) {
    root[key] = id;
    expected.push_back({id++, key});
  }
  root["video_token_id"] = 1000;  // one id under two keys counts once, under the first
  expected.erase(expected.begin() + 3);
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->media_placeholders, expected);
  // Written back where a real checkpoint has them, and read again alike.
  absl::StatusOr<ModelConfig> again = ParseModelConfig(ModelConfigToJson(*parsed).dump(), "c.json");
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->media_placeholders, expected);
}

TEST(Config, NestedMediaPlaceholdersAtTheTopAndInTextConfig) {
  ModelConfig tiny = Tiny();
  ApplyLayout(CheckpointLayout::kNestedK25, tiny);
  json root = ModelConfigToJson(tiny);
  root["media_placeholder_token_id"] = 1500;
  root["text_config"]["image_token_id"] = 1501;
  absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "c.json");
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->media_placeholders,
            (std::vector<MediaPlaceholder>{{1500, "media_placeholder_token_id"}, {1501, "image_token_id"}}));
}

TEST(Config, MalformedMediaPlaceholderNamesTheField) {
  for (const json& bad : {json("163605"), json(-1), json(1.5), json(int64_t{1} << 31), json(true), json::array()}) {
    json root = ModelConfigToJson(Tiny());
    root["media_placeholder_token_id"] = bad;
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(root.dump(), "dir/config.json");
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().message(),
              "dir/config.json: field 'media_placeholder_token_id' must be a token id (an integer in 0..2147483647), "
              "got " + bad.dump());
  }
  ModelConfig tiny = Tiny();
  ApplyLayout(CheckpointLayout::kNestedK25, tiny);
  json nested = ModelConfigToJson(tiny);
  nested["text_config"]["audio_token_id"] = "x";
  EXPECT_THAT(ParseModelConfig(nested.dump(), "c.json").status().message(),
              HasSubstr("c.json: text_config: field 'audio_token_id' must be a token id"));
}

TEST(Config, Eagle3CaptureIds) {
  ModelConfig c = Tiny();
  c.num_hidden_layers = 61;
  EXPECT_EQ(c.Eagle3CaptureIds(), (std::vector<int>{2, 30, 58, 61}));
  c.num_hidden_layers = 4;  // {2, 2, 1, 4}: sorted, deduplicated
  EXPECT_EQ(c.Eagle3CaptureIds(), (std::vector<int>{1, 2, 4}));
}

}  // namespace
}  // namespace hsx

namespace hsx {
namespace {

// The released configs, typed in (tests/fixtures/README.md names the sources).
std::string Fixture(const std::string& name) { return std::string(HSX_SOURCE_DIR) + "/tests/fixtures/" + name; }

void ExpectKimiArchitecture(const ModelConfig& c) {
  EXPECT_EQ(c.vocab_size, 163840);
  EXPECT_EQ(c.hidden_size, 7168);
  EXPECT_EQ(c.num_hidden_layers, 61);
  EXPECT_EQ(c.intermediate_size, 18432);
  EXPECT_EQ(c.moe_intermediate_size, 2048);
  EXPECT_EQ(c.n_routed_experts, 384);
  EXPECT_EQ(c.n_shared_experts, 1);
  EXPECT_EQ(c.num_experts_per_tok, 8);
  EXPECT_EQ(c.first_k_dense_replace, 1);
  EXPECT_EQ(c.num_attention_heads, 64);
  EXPECT_EQ(c.q_lora_rank, 1536);
  EXPECT_EQ(c.kv_lora_rank, 512);
  EXPECT_EQ(c.qk_nope_head_dim, 128);
  EXPECT_EQ(c.qk_rope_head_dim, 64);
  EXPECT_EQ(c.v_head_dim, 128);
  EXPECT_EQ(c.rope_theta, 50000.0);
  EXPECT_EQ(c.routed_scaling_factor, 2.827);
  EXPECT_EQ(c.rope_scaling.type, "yarn");
  EXPECT_EQ(c.rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_EQ(c.scoring_func, "sigmoid");
  EXPECT_EQ(c.topk_method, "noaux_tc");
}

TEST(ReleasedConfigs, KimiK25IsReadWithItsOwnEpsAndYarn) {
  absl::StatusOr<ModelConfig> c = ReadModelConfig(Fixture("kimi-k2.5/config.json"));
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout, CheckpointLayout::kNestedK25);
  ExpectKimiArchitecture(*c);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_EQ(c->rope_scaling.factor, 64.0);
  EXPECT_EQ(c->rope_scaling.beta_fast, 32.0);
  EXPECT_EQ(c->rope_scaling.beta_slow, 1.0);
  EXPECT_EQ(c->max_position_embeddings, 262144);
  ASSERT_TRUE(c->quantization.has_value());
  EXPECT_EQ(c->quantization->group_size, 32);
  EXPECT_FALSE(c->quantization->IsQuantized("language_model.model.layers.3.self_attn.q_a_proj"));
  EXPECT_TRUE(c->quantization->IsQuantized("language_model.model.layers.3.mlp.experts.7.down_proj"));
  // Its top-level media_placeholder_token_id: samples holding it are refused (request_validator.h).
  EXPECT_EQ(c->media_placeholders, (std::vector<MediaPlaceholder>{{163605, "media_placeholder_token_id"}}));
}

TEST(ReleasedConfigs, KimiK2InstructFp8IsRefusedNamingTheField) {
  // K2-Instruct ships FP8 weights; hsx reads INT4 (compressed-tensors) or BF16.
  const std::string path = Fixture("kimi-k2-instruct/config.json");
  absl::StatusOr<ModelConfig> c = ReadModelConfig(path);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().message(),
            path + ": quantization_config: 'quant_method' is \"fp8\"; hsx supports only \"compressed-tensors\"");
}

TEST(ReleasedConfigs, KimiK2InstructAsBf16IsReadWithItsOwnEpsAndYarn) {
  // The BF16 conversion of K2-Instruct (DeepSeek's fp8_cast_bf16.py) is the same file without
  // quantization_config.
  std::ifstream in(Fixture("kimi-k2-instruct/config.json"));
  json root = json::parse(in);
  root.erase("quantization_config");
  absl::StatusOr<ModelConfig> c = ParseModelConfig(root.dump(), "k2-bf16/config.json");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->layout, CheckpointLayout::kFlat);
  ExpectKimiArchitecture(*c);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  EXPECT_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->rope_scaling.beta_fast, 1.0);
  EXPECT_EQ(c->max_position_embeddings, 131072);
  EXPECT_FALSE(c->quantization.has_value());
}

}  // namespace
}  // namespace hsx
