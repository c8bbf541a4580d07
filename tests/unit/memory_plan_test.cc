// memory_plan_test.cc: the CUDA engine's up-front memory plan
// (server/runtime/memory_plan.h) is plain arithmetic: rank layouts, the
// forward's buffers counted by hand on a small config, and the Kimi-K2 plan
// refused or accepted against given free memory.
#include "server/runtime/memory_plan.h"

#include <cstdio>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "kernels/staging_ring.h"
#include "server/model/random_model.h"
#include "server/model/tensor_specs.h"

namespace hsx {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;

TEST(RankLayoutTest, OneRankPerGpuOrAllOnOne) {
  absl::StatusOr<RankLayout> spread = MakeRankLayout(8, 1, 8);
  ASSERT_TRUE(spread.ok()) << spread.status();
  EXPECT_EQ(spread->devices(), 8);
  EXPECT_EQ(spread->device_of(5), 5);
  EXPECT_FALSE(spread->same_device());
  absl::StatusOr<RankLayout> shared = MakeRankLayout(8, 8, 1);
  ASSERT_TRUE(shared.ok()) << shared.status();
  EXPECT_EQ(shared->devices(), 1);
  EXPECT_EQ(shared->device_of(7), 0);
  EXPECT_TRUE(shared->same_device());
  EXPECT_FALSE(MakeRankLayout(1, 1, 1)->same_device());
}

TEST(RankLayoutTest, RefusesWhatItCannotPlace) {
  absl::StatusOr<RankLayout> partial = MakeRankLayout(8, 2, 8);
  EXPECT_EQ(partial.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(partial.status().message().find("--ranks-per-device 2"), std::string::npos) << partial.status();
  absl::StatusOr<RankLayout> too_few = MakeRankLayout(4, 1, 2);
  EXPECT_EQ(too_few.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(too_few.status().message().find("has 2 GPU(s)"), std::string::npos) << too_few.status();
  EXPECT_NE(too_few.status().message().find("--ranks-per-device 4"), std::string::npos) << too_few.status();
  EXPECT_FALSE(MakeRankLayout(0, 1, 1).ok());
}

// A one-layer dense model small enough to count its buffers by hand.
ModelConfig HandConfig() {
  ModelConfig c;
  c.hidden_size = 8;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.q_lora_rank = 4;
  c.kv_lora_rank = 4;
  c.qk_rope_head_dim = 2;
  c.qk_nope_head_dim = 2;
  c.v_head_dim = 2;
  c.intermediate_size = 6;
  c.n_routed_experts = 0;
  return c;
}

TEST(ForwardBytesTest, CountsTheForwardsBuffersByHand) {
  const ModelConfig c = HandConfig();
  // Per token, bf16: x, update (2 x 8); q_latent 4, q 2 x 4, compressed 4 + 2,
  // latent 4, kv 2 x 4, attention 2 x 2 (34); gate, up (2 x 6); residual and
  // final norm (2 x 8): (16 + 34 + 12 + 16) x 2 bytes, plus 16 staged.
  EXPECT_EQ(ForwardBytesPerRank(c, 1, 1, ElementType::kBf16), (16 + 34 + 12 + 16) * 2 + 16);
  EXPECT_EQ(ForwardBytesPerRank(c, 1, 1, ElementType::kF32), (16 + 34 + 12 + 16) * 4 + 16);
  // TP 2: half the heads and the intermediate, plus two f32 partials of [8].
  // Attention per token: 4 + 4 + 6 + 4 + 4 + 2 = 24.
  EXPECT_EQ(ForwardBytesPerRank(c, 2, 1, ElementType::kBf16), (16 + 24 + 6 + 16) * 2 + 2 * 8 * 4 + 16);
  // The largest layer counts, not the sum: Model::Run frees each layer's scratch.
  ModelConfig deep = c;
  deep.num_hidden_layers = 5;
  EXPECT_EQ(ForwardBytesPerRank(deep, 1, 1, ElementType::kBf16), ForwardBytesPerRank(c, 1, 1, ElementType::kBf16));
  // Linear in tokens.
  EXPECT_EQ(ForwardBytesPerRank(c, 2, 1000, ElementType::kBf16), 1000 * ForwardBytesPerRank(c, 2, 1, ElementType::kBf16));
}

TEST(ForwardBytesTest, MoeScratchHoldsTheRanksDequantisedExperts) {
  const ModelConfig c = *PresetConfig("kimi-k2");
  // 48 experts of 3 x 2048 x 7168 bf16 per rank at TP 8 (4.2 GB) and the
  // capture staging ring, at least.
  EXPECT_GE(BackendScratchBytesPerRank(c, 8, 1, ElementType::kBf16),
            int64_t{48} * 3 * 2048 * 7168 * 2 + kCaptureStagingBytes);
  EXPECT_GT(BackendScratchBytesPerRank(c, 8, 32768, ElementType::kBf16),
            BackendScratchBytesPerRank(c, 8, 8192, ElementType::kBf16));
}

TEST(MemoryPlanTest, KimiK2AtTp8IsRefusedOrAcceptedByTheNumbers) {
  const ModelConfig c = *PresetConfig("kimi-k2");
  const RankLayout layout = *MakeRankLayout(8, 1, 8);
  const std::vector<int64_t> weights = BytesPerRank(c, 8);
  // Roughly 71 GiB of INT4 experts plus the BF16 rest per GPU (gpu-notes.md §1).
  EXPECT_GT(weights[0], 60 * kGiB);
  EXPECT_LT(weights[0], 90 * kGiB);

  const std::vector<int64_t> h200(8, 139 * kGiB);
  std::vector<DevicePlan> plans;
  const absl::Status small_batch = CheckMemoryPlan(c, layout, 1024, ElementType::kBf16, h200, &plans);
  EXPECT_TRUE(small_batch.ok()) << small_batch;
  ASSERT_EQ(plans.size(), 8u);
  EXPECT_EQ(plans[3].ranks, std::vector<int>{3});
  EXPECT_EQ(plans[3].weights, weights[3]);

  const std::vector<int64_t> small_gpus(8, 40 * kGiB);
  const absl::Status refused = CheckMemoryPlan(c, layout, 1024, ElementType::kBf16, small_gpus);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("cuda:0 rank 0: weights"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("40.00 GiB free"), std::string::npos) << refused;
  EXPECT_NE(refused.message().find("use more GPUs"), std::string::npos) << refused;
}

TEST(MemoryPlanTest, NamesTheLargestBatchThatFits) {
  const ModelConfig c = *PresetConfig("kimi-k2");
  const RankLayout layout = *MakeRankLayout(8, 1, 8);
  const std::vector<int64_t> h200(8, 139 * kGiB);
  const int64_t fitting = LargestFittingBatch(c, layout, 1 << 20, ElementType::kBf16, h200);
  ASSERT_GT(fitting, 0);
  ASSERT_LT(fitting, 1 << 20);
  std::vector<DevicePlan> plans;
  (void)CheckMemoryPlan(c, layout, 8192, ElementType::kBf16, h200, &plans);
  std::printf("Kimi-K2, TP 8, 139 GiB free per GPU: the largest batch that fits is %lld tokens; at 8192: %s\n",
              static_cast<long long>(fitting), DescribeDevicePlan(plans[0], 8192).c_str());
  EXPECT_TRUE(CheckMemoryPlan(c, layout, fitting, ElementType::kBf16, h200).ok());
  const absl::Status over = CheckMemoryPlan(c, layout, fitting + 1, ElementType::kBf16, h200);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(over.message().find(absl::StrCat("--max-batch-tokens ", fitting, " would fit")), std::string::npos)
      << over;
}

TEST(MemoryPlanTest, RanksSharingAGpuAddUp) {
  const ModelConfig c = *PresetConfig("tiny");
  const std::vector<int64_t> free = {64 * kGiB};
  const std::vector<DevicePlan> one = PlanDeviceMemory(c, *MakeRankLayout(1, 1, 1), 512, ElementType::kF32, free);
  const std::vector<DevicePlan> four = PlanDeviceMemory(c, *MakeRankLayout(4, 4, 1), 512, ElementType::kF32, free);
  ASSERT_EQ(four.size(), 1u);
  EXPECT_EQ(four[0].ranks, (std::vector<int>{0, 1, 2, 3}));
  const std::vector<int64_t> weights = BytesPerRank(c, 4);
  EXPECT_EQ(four[0].weights, weights[0] + weights[1] + weights[2] + weights[3]);
  EXPECT_GE(four[0].weights, one[0].weights);  // the replicated parts count once per rank
  EXPECT_EQ(four[0].scratch, 4 * BackendScratchBytesPerRank(c, 4, 512, ElementType::kF32));
  EXPECT_NE(DescribeDevicePlan(four[0], 512).find("cuda:0 ranks 0-3: weights"), std::string::npos);
}

}  // namespace
}  // namespace hsx
