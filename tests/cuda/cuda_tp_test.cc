// cuda_tp_test.cc: tensor parallelism on CUDA (kernels/cuda/cuda_communicator.h)
// at the whole-model level, on a generated tiny model whose heads,
// intermediate sizes, experts and vocabulary split 8 ways:
//  * TP 2, 4 and 8 with every rank on one GPU (the same-device transport)
//    equal TP 1 within fp32 1e-5 (relative L2 per captured layer);
//  * at TP 8 a sample's states are bitwise the same solo or in a batch;
//  * the NCCL transport (one rank per GPU) equals TP 1 where >= 2 GPUs exist.
// Each test also runs with --device cpu (same harness, the CPU backend and the
// in-process communicator), so the harness and the model's TP-8 split are
// checked here, where CUDA ones skip with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>

#include "server/model/random_model.h"
#include "tests/unit/float_states.h"
#include "server/model/tensor_specs.h"
#include "server/runtime/engine.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

using ::hsx::testing::TempDir;

class TensorParallelTest : public ::testing::TestWithParam<Device> {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    // 8 heads: split 8 ways.
    checkpoint_ = ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(8), (*dir_) / "m", 23);
    ASSERT_NE(checkpoint_, nullptr);
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }
  void SetUp() override {
    ASSERT_TRUE(CheckTensorParallelDegree(checkpoint_->config(), 8).ok());
    if (GetParam() == Device::kCuda) HSX_SKIP_WITHOUT_CUDA();
  }

  // TP `tp` on this test's device; on CUDA every rank on GPU 0 unless `spread`.
  static std::unique_ptr<Engine> MakeEngine(int tp, bool spread = false) {
    EngineOptions options;
    options.precision = ElementType::kF32;
    options.device = GetParam();
    options.tp = tp;
    options.threads = tp;
    options.ranks_per_device = GetParam() == Device::kCuda && !spread ? tp : 1;
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }

  static std::vector<testing::FloatStates> Run(Engine& engine, const std::vector<std::vector<int32_t>>& samples) {
    return ::hsx::testing::RunBatch(engine, samples);
  }

  static std::vector<std::vector<int32_t>> Samples(uint32_t seed, int count, int64_t longest) {
    std::mt19937 random(seed);
    std::vector<std::vector<int32_t>> samples;
    for (int i = 0; i < count; ++i) {
      std::vector<int32_t> tokens(1 + random() % longest);
      for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint_->config().vocab_size);
      samples.push_back(std::move(tokens));
    }
    return samples;
  }

  // Expects every sample's captured layers (and final norm) within relative L2
  // `tolerance` of `want`, naming the values at fault; the worst error.
  static double ExpectWithin(const std::string& label, const std::vector<testing::FloatStates>& got,
                             const std::vector<testing::FloatStates>& want, double tolerance) {
    EXPECT_EQ(got.size(), want.size());
    double worst = 0;
    for (size_t s = 0; s < std::min(got.size(), want.size()); ++s) {
      worst = std::max(worst, ::hsx::testing::ExpectLayersWithinL2(absl::StrCat(label, " sample ", s, " (",
                                                                                 want[s].tokens, " tokens)"),
                                                                    got[s], want[s], tolerance));
    }
    return worst;
  }

  static TempDir* dir_;
  static Checkpoint* checkpoint_;
};

TempDir* TensorParallelTest::dir_ = nullptr;
Checkpoint* TensorParallelTest::checkpoint_ = nullptr;

TEST_P(TensorParallelTest, TpOnOneDeviceEqualsTp1) {
  const std::vector<std::vector<int32_t>> samples = Samples(3, 3, ::hsx::testing::TestSize(200, 40));
  std::unique_ptr<Engine> one = MakeEngine(1);
  ASSERT_TRUE(one);
  const std::vector<testing::FloatStates> want = Run(*one, samples);
  for (const int tp : {2, 4, 8}) {
    SCOPED_TRACE(::testing::Message() << "TP " << tp);
    std::unique_ptr<Engine> split = MakeEngine(tp);
    ASSERT_TRUE(split);
    const double worst = ExpectWithin(absl::StrCat(DeviceName(GetParam()), " TP ", tp, " vs TP 1"),
                                      Run(*split, samples), want, 1e-5);
    std::printf("%s TP %d against TP 1: worst layer error %.3g\n", DeviceName(GetParam()), tp, worst);
  }
}

TEST_P(TensorParallelTest, Tp8BatchedEqualsSoloBitForBit) {
  std::unique_ptr<Engine> engine = MakeEngine(8);
  ASSERT_TRUE(engine);
  for (uint32_t seed = 0; seed < ::hsx::testing::TestSize(4, 1); ++seed) {
    const std::vector<std::vector<int32_t>> samples =
        Samples(100 + seed, 4, ::hsx::testing::TestSize(seed == 0 ? 1024 : 300, 40));
    ::hsx::testing::ExpectBatchedEqualsSolo(*engine, samples, absl::StrCat("seed ", seed));
  }
}

TEST_P(TensorParallelTest, NcclAcrossGpusEqualsTp1) {
  if (GetParam() == Device::kCpu) GTEST_SKIP() << "NCCL is the CUDA transport";
  absl::StatusOr<int> gpus = CudaDeviceCount();
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  if (*gpus < 2) GTEST_SKIP() << "NCCL needs 2 or more GPUs (it refuses two ranks on one); this machine has " << *gpus;
  const std::vector<std::vector<int32_t>> samples = Samples(5, 3, 200);
  std::unique_ptr<Engine> one = MakeEngine(1);
  ASSERT_TRUE(one);
  const std::vector<testing::FloatStates> want = Run(*one, samples);
  for (const int tp : {2, 4, 8}) {
    if (tp > *gpus) break;
    SCOPED_TRACE(::testing::Message() << "NCCL TP " << tp);
    std::unique_ptr<Engine> split = MakeEngine(tp, /*spread=*/true);
    ASSERT_TRUE(split);
    const double worst = ExpectWithin(absl::StrCat("NCCL TP ", tp, " vs TP 1"), Run(*split, samples), want, 1e-5);
    std::printf("NCCL TP %d against TP 1: worst layer error %.3g\n", tp, worst);
  }
}

TEST_P(TensorParallelTest, MoreRanksThanGpusIsRefusedWithTheFlagToUse) {
  if (GetParam() == Device::kCpu) GTEST_SKIP() << "GPU placement only";
  absl::StatusOr<int> gpus = CudaDeviceCount();
  ASSERT_TRUE(gpus.ok()) << gpus.status();
  if (*gpus >= 8) GTEST_SKIP() << "this machine has " << *gpus << " GPUs: TP 8 fits one per GPU";
  EngineOptions options;
  options.device = Device::kCuda;
  options.tp = 8;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
  ASSERT_FALSE(engine.ok());
  EXPECT_EQ(engine.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(engine.status().message().find("--ranks-per-device 8"), std::string::npos) << engine.status();
}

INSTANTIATE_TEST_SUITE_P(Devices, TensorParallelTest, ::testing::Values(Device::kCpu, Device::kCuda),
                         [](const auto& param_info) { return std::string(DeviceName(param_info.param)); });

}  // namespace
}  // namespace hsx
