// Tests the generator: determinism, sharding, scaling and routing spread.
#include "server/model/random_model.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/checkpoint.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::ReadFile;
using ::hsx::testing::TempDir;
using ::testing::HasSubstr;

std::vector<std::string> ListFiles(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    names.push_back(entry.path().filename().string());
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST(RandomModel, ByteIdenticalForASeedWhateverTheThreadCount) {
  TempDir dir;
  GeneratorOptions options;
  options.seed = 42;
  options.shard_bytes = 300'000;
  options.threads = 1;
  ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "a", options).ok());
  options.threads = 4;
  ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "b", options).ok());
  options.seed = 43;
  ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "c", options).ok());
  const std::vector<std::string> files = ListFiles(dir / "a");
  ASSERT_EQ(files, ListFiles(dir / "b"));
  EXPECT_GT(files.size(), 3u);  // config, index and several shards
  bool any_differs = false;
  for (const std::string& name : files) {
    EXPECT_EQ(ReadFile(dir / ("a/" + name)), ReadFile(dir / ("b/" + name))) << name;
    if (name.ends_with(".safetensors")) {
      any_differs |= ReadFile(dir / ("a/" + name)) != ReadFile(dir / ("c/" + name));
    }
  }
  EXPECT_TRUE(any_differs) << "a different seed must give different weights";
}

TEST(RandomModel, RefusesANonEmptyDirectory) {
  TempDir dir;
  ASSERT_TRUE(WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "m", {}).ok());
  const absl::Status again = WriteRandomCheckpoint(*PresetConfig("tiny"), dir / "m", {});
  EXPECT_THAT(again.message(), HasSubstr("not empty; refusing to overwrite"));
}

TEST(RandomModel, UnknownPreset) {
  EXPECT_THAT(PresetConfig("huge").status().message(),
              HasSubstr("unknown preset 'huge'; expected one of tiny, small, kimi-k2"));
}

TEST(RandomModel, KimiPresetHasTheRealDimensions) {
  ModelConfig k2 = *PresetConfig("kimi-k2");
  EXPECT_EQ(k2.hidden_size, 7168);
  EXPECT_EQ(k2.n_routed_experts, 384);
  EXPECT_EQ(k2.num_hidden_layers, 61);
  EXPECT_EQ(k2.Eagle3CaptureIds(), (std::vector<int>{2, 30, 58, 61}));
  int64_t params = 0;
  for (const WeightSpec& spec : TextModelWeights(k2)) params += spec.num_elements();
  // model-spec.md §6: 1,026.41 B parameters in the text model.
  EXPECT_NEAR(static_cast<double>(params) / 1e9, 1026.41, 0.01);
  ApplyLayout(CheckpointLayout::kNestedK25, k2);
  EXPECT_EQ(k2.rms_norm_eps, 1e-5);
  EXPECT_EQ(k2.rope_scaling.beta_fast, 32.0);
}

float Rms(const std::vector<float>& v, size_t begin, size_t count) {
  double sum = 0;
  for (size_t i = begin; i < begin + count; ++i) sum += double(v[i]) * v[i];
  return static_cast<float>(std::sqrt(sum / count));
}

// Routing on a few hundred random tokens reaches every expert. The router input
// is approximated by the normalised embedding (the attention update is small
// next to it by construction of the output-projection scale).
void ExpectRoutingSpreads(const ModelConfig& config) {
  TempDir dir;
  ASSERT_TRUE(WriteRandomCheckpoint(config, dir / "m", {}).ok());
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir / "m");
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  const Checkpoint& ckpt = **checkpoint;
  const std::string p = config.tensor_prefix();
  const std::string layer = p + "model.layers." + std::to_string(config.first_k_dense_replace) + ".";
  const std::vector<float> embed = *ckpt.ReadAsFloat(*ckpt.FindWeight(p + "model.embed_tokens.weight"));
  const std::vector<float> norm = *ckpt.ReadAsFloat(*ckpt.FindWeight(layer + "post_attention_layernorm.weight"));
  const std::vector<float> gate = *ckpt.ReadAsFloat(*ckpt.FindWeight(layer + "mlp.gate.weight"));
  const std::vector<float> bias = *ckpt.ReadAsFloat(*ckpt.FindWeight(layer + "mlp.gate.e_score_correction_bias"));
  const int64_t h = config.hidden_size, e = config.n_routed_experts;
  std::vector<int> hits(e, 0);
  std::mt19937 random(3);
  for (int t = 0; t < 300; ++t) {
    const int64_t token = random() % config.vocab_size;
    const float rms = Rms(embed, token * h, h);
    EXPECT_GT(rms, 0.3f);
    EXPECT_LT(rms, 3.0f);
    std::vector<std::pair<float, int>> scores;
    for (int64_t j = 0; j < e; ++j) {
      double logit = 0;
      for (int64_t i = 0; i < h; ++i) logit += embed[token * h + i] / rms * norm[i] * gate[j * h + i];
      scores.push_back({1.0f / (1.0f + std::exp(-static_cast<float>(logit))) + bias[j], int(j)});
    }
    std::partial_sort(scores.begin(), scores.begin() + config.num_experts_per_tok, scores.end(),
                      std::greater<>());
    for (int k = 0; k < config.num_experts_per_tok; ++k) ++hits[scores[k].second];
  }
  for (int64_t j = 0; j < e; ++j) EXPECT_GT(hits[j], 0) << "expert " << j << " never routed to";
}

TEST(RandomModel, RoutingReachesEveryExpertTiny) { ExpectRoutingSpreads(*PresetConfig("tiny")); }

TEST(RandomModel, RoutingReachesEveryExpertWithManyExperts) {
  ModelConfig config = *PresetConfig("tiny");
  config.n_routed_experts = 128;
  config.num_experts_per_tok = 8;
  config.num_hidden_layers = 2;
  config.hidden_size = 256;
  ExpectRoutingSpreads(config);
}

}  // namespace
}  // namespace hsx
