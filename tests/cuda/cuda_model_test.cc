// cuda_model_test.cc: whole-model tests of --device cuda on a generated tiny
// model (INT4 routed experts, MLA attention, group-limited routing):
//  * the CUDA engine's hidden states equal the CPU engine's within fp32 1e-5
//    and bf16 2e-2 (relative L2 error per captured layer);
//  * a sample's states are bitwise the same solo or in any batch (20 seeds,
//    samples up to 2048 tokens), on the GPU.
// Skipped, with CUDA's reason, where there is no device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>

#include "server/model/random_model.h"
#include "tests/unit/float_states.h"
#include "server/runtime/engine.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::TempDir;

class CudaModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    checkpoint_ = ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(), (*dir_) / "m", 17);
    ASSERT_NE(checkpoint_, nullptr);
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }
  void SetUp() override { HSX_SKIP_WITHOUT_CUDA(); }

  static std::unique_ptr<Engine> MakeEngine(Device device, ElementType precision) {
    EngineOptions options;
    options.precision = precision;
    options.device = device;
    options.threads = 2;
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  static std::vector<testing::FloatStates> Run(Engine& engine, const std::vector<std::vector<int32_t>>& samples) {
    return ::hsx::testing::RunBatch(engine, samples);
  }

  static std::vector<int32_t> Tokens(std::mt19937& random, int64_t length) {
    std::vector<int32_t> tokens(length);
    for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint_->config().vocab_size);
    return tokens;
  }

  static TempDir* dir_;
  static Checkpoint* checkpoint_;
};

TempDir* CudaModelTest::dir_ = nullptr;
Checkpoint* CudaModelTest::checkpoint_ = nullptr;

TEST_F(CudaModelTest, MatchesTheCpuBackend) {
  for (const ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    SCOPED_TRACE(precision == ElementType::kBf16 ? "bf16" : "fp32");
    const double tolerance = precision == ElementType::kBf16 ? 2e-2 : 1e-5;
    std::unique_ptr<Engine> gpu = MakeEngine(Device::kCuda, precision);
    std::unique_ptr<Engine> cpu = MakeEngine(Device::kCpu, precision);
    ASSERT_TRUE(gpu && cpu);
    std::mt19937 random(5);
    std::vector<std::vector<int32_t>> samples = {Tokens(random, 1), Tokens(random, 37)};
    if (!::hsx::testing::SmallShapes()) samples.push_back(Tokens(random, 130));
    const std::vector<testing::FloatStates> got = Run(*gpu, samples);
    const std::vector<testing::FloatStates> want = Run(*cpu, samples);
    ASSERT_EQ(got.size(), samples.size());
    ASSERT_EQ(want.size(), samples.size());
    for (size_t s = 0; s < samples.size(); ++s) {
      const double worst = ::hsx::testing::ExpectLayersWithinL2(
          absl::StrCat(precision == ElementType::kBf16 ? "bf16" : "fp32", " sample ", s, " (", samples[s].size(),
                       " tokens), CUDA vs CPU"),
          got[s], want[s], tolerance);
      std::printf("sample %zu: worst layer error %.3g\n", s, worst);
    }
  }
}

TEST_F(CudaModelTest, BatchedEqualsSoloBitForBit) {
  for (const ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    SCOPED_TRACE(precision == ElementType::kBf16 ? "bf16" : "fp32");
    std::unique_ptr<Engine> engine = MakeEngine(Device::kCuda, precision);
    ASSERT_TRUE(engine);
    const int64_t seeds = ::hsx::testing::TestSize(20, 3);
    for (int seed = 0; seed < seeds; ++seed) {
      std::mt19937 random(seed);
      std::vector<std::vector<int32_t>> samples;
      const int count = 2 + static_cast<int>(random() % 5);
      const int64_t longest = ::hsx::testing::TestSize(seed < 4 ? 2048 : 300, 64);
      for (int i = 0; i < count; ++i) samples.push_back(Tokens(random, 1 + random() % longest));
      ::hsx::testing::ExpectBatchedEqualsSolo(*engine, samples, absl::StrCat("seed ", seed));
    }
  }
}

}  // namespace
}  // namespace hsx
