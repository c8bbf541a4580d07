// cudnn_attention_test.cc: --attention=cudnn (cuDNN's SDPA) against the
// reference attention kernel, on the GPU:
//  * one Attention op at Kimi-K2's head dims (192 / 128, 8 heads of a TP8
//    rank), ragged, with a YaRN-style softmax scale: within the contract's
//    bf16 tolerance (2e-2 of max(1, |value|)) of the reference kernel;
//  * batch invariance: a sample's rows are bitwise the same solo or packed
//    with other samples (different graph buckets included), op and model;
//  * the whole tiny model: cudnn within bf16 2e-2 (relative L2 per captured
//    layer) of the reference kernel's engine.
// Also, without a GPU: the flag's parsing and refusals.
// GPU tests skip with CUDA's reason where there is no device.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>

#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/cudnn_attention.h"
#include "server/model/random_model.h"
#include "tests/unit/float_states.h"
#include "server/runtime/device_factory.h"
#include "server/runtime/engine.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

constexpr int64_t kHeads = 8, kNope = 128, kRope = 64, kV = 128;
// 1/sqrt(192) times a YaRN mscale² of ~1.87 (Kimi-K2's factor 32, mscale 1).
constexpr float kScale = 0.1352f;

std::vector<uint16_t> RandomBf16(std::mt19937& random, int64_t n) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<uint16_t> v(n);
  for (uint16_t& x : v) x = FloatToBf16(u(random));
  return v;
}

// One bf16 backend and the buffers it was given.
struct Gpu {
  std::unique_ptr<Backend> backend;
  std::vector<std::unique_ptr<Buffer>> buffers;

  Matrix Upload(const std::vector<uint16_t>& host, int64_t rows, int64_t cols) {
    buffers.push_back(*backend->Allocate(rows, cols, ElementType::kBf16));
    backend->CopyFromHost(host.data(), buffers.back()->matrix());
    return buffers.back()->matrix();
  }
  // Attention of rows [first, first + cu.back()) of the operands, packed as `cu`.
  std::vector<uint16_t> Attention(const std::vector<uint16_t>& q, const std::vector<uint16_t>& kv,
                                  const std::vector<uint16_t>& kr, int64_t first, const std::vector<int64_t>& cu) {
    const int64_t t = cu.back();
    auto rows = [&](const std::vector<uint16_t>& m, int64_t cols) {
      return std::vector<uint16_t>(m.begin() + first * cols, m.begin() + (first + t) * cols);
    };
    auto staged = backend->Stage(std::vector<int32_t>(t, 0), cu);
    EXPECT_TRUE(staged.ok()) << staged.status();
    const Matrix out = Upload(std::vector<uint16_t>(t * kHeads * kV, 0), t, kHeads * kV);
    backend->Attention(Upload(rows(q, kHeads * (kNope + kRope)), t, kHeads * (kNope + kRope)),
                       Upload(rows(kv, kHeads * (kNope + kV)), t, kHeads * (kNope + kV)), Upload(rows(kr, kRope), t, kRope),
                       kHeads, kNope, kRope, kV, **staged, kScale, out);
    std::vector<uint16_t> host(t * kHeads * kV);
    backend->CopyToHost(out, host.data());
    const absl::Status s = backend->Synchronize();
    EXPECT_TRUE(s.ok()) << s;
    return host;
  }
};

Gpu MakeGpu(CudaAttention attention) {
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(0, ElementType::kBf16, attention);
  EXPECT_TRUE(backend.ok()) << backend.status();
  return Gpu{backend.ok() ? *std::move(backend) : nullptr, {}};
}

TEST(CudnnAttentionTest, MatchesTheReferenceKernelAtKimiHeadDims) {
  HSX_SKIP_WITHOUT_CUDA();
  const std::vector<int64_t> cu = {0, 1, 18, 118, 418, 1442};
  const int64_t t = cu.back();
  std::mt19937 random(3);
  const auto q = RandomBf16(random, t * kHeads * (kNope + kRope));
  const auto kv = RandomBf16(random, t * kHeads * (kNope + kV));
  const auto kr = RandomBf16(random, t * kRope);
  Gpu reference = MakeGpu(CudaAttention::kReference), cudnn = MakeGpu(CudaAttention::kCudnn);
  ASSERT_TRUE(reference.backend && cudnn.backend);
  const std::vector<uint16_t> want = reference.Attention(q, kv, kr, 0, cu);
  const std::vector<uint16_t> got = cudnn.Attention(q, kv, kr, 0, cu);
  ASSERT_EQ(got.size(), want.size());
  std::vector<float> g(got.size()), w(want.size());
  for (size_t i = 0; i < want.size(); ++i) g[i] = Bf16ToFloat(got[i]), w[i] = Bf16ToFloat(want[i]);
  const ::hsx::testing::Mismatches differing = ::hsx::testing::FindMismatches(g, w, 0);
  std::printf("cuDNN SDPA vs reference kernel (bf16, %lld values): max error %.3g, %lld differ\n",
              static_cast<long long>(want.size()), differing.worst.error, static_cast<long long>(differing.outside));
  EXPECT_TRUE(::hsx::testing::ValuesMatch({"Attention: cuDNN SDPA vs the reference kernel",
                                           {cu.back(), kHeads * kV}, "bf16"}, g, w, 2e-2));
}

// A sample solo (one slot, its own length bucket) and packed among others
// (eight slots, the longest neighbour's bucket): bitwise the same rows.
TEST(CudnnAttentionTest, ASampleIsBitwiseTheSameSoloOrInABatch) {
  HSX_SKIP_WITHOUT_CUDA();
  Gpu cudnn = MakeGpu(CudaAttention::kCudnn);
  ASSERT_TRUE(cudnn.backend);
  for (int seed = 0; seed < ::hsx::testing::TestSize(6, 2); ++seed) {
    std::mt19937 random(seed);
    std::vector<int64_t> cu = {0};
    const int count = 2 + static_cast<int>(random() % 6);
    for (int i = 0; i < count; ++i) cu.push_back(cu.back() + 1 + static_cast<int64_t>(random() % ::hsx::testing::TestSize(seed < 2 ? 2048 : 300, 64)));
    const int64_t t = cu.back();
    const auto q = RandomBf16(random, t * kHeads * (kNope + kRope));
    const auto kv = RandomBf16(random, t * kHeads * (kNope + kV));
    const auto kr = RandomBf16(random, t * kRope);
    const std::vector<uint16_t> together = cudnn.Attention(q, kv, kr, 0, cu);
    for (int i = 0; i < count; ++i) {
      const int64_t len = cu[i + 1] - cu[i];
      const std::vector<uint16_t> solo = cudnn.Attention(q, kv, kr, cu[i], {0, len});
      const auto begin = together.begin() + cu[i] * kHeads * kV;
      EXPECT_TRUE(::hsx::testing::Bf16BitsMatch(
          {absl::StrCat("cuDNN attention, seed ", seed, ": sample ", i, " alone vs rows [", cu[i], ", ", cu[i + 1],
                        ") of ", t),
           {len, kHeads * kV}, "bf16"},
          solo, std::span<const uint16_t>(&*begin, solo.size())));
    }
    cudnn.buffers.clear();
  }
}

// The whole tiny model (4 layers, MLA head dims 48 / 32).
class CudnnModelTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ::hsx::testing::TempDir();
    checkpoint_ = ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(), (*dir_) / "m", 23);
    ASSERT_NE(checkpoint_, nullptr);
  }
  static void TearDownTestSuite() {
    delete checkpoint_;
    delete dir_;
  }
  void SetUp() override { HSX_SKIP_WITHOUT_CUDA(); }

  static std::unique_ptr<Engine> MakeEngine(CudaAttention attention) {
    EngineOptions options;
    options.device = Device::kCuda;
    options.attention = attention;
    absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint_, options);
    EXPECT_TRUE(engine.ok()) << engine.status();
    return engine.ok() ? *std::move(engine) : nullptr;
  }
  static std::vector<int32_t> Tokens(std::mt19937& random, int64_t length) {
    std::vector<int32_t> tokens(length);
    for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint_->config().vocab_size);
    return tokens;
  }

  static ::hsx::testing::TempDir* dir_;
  static Checkpoint* checkpoint_;
};

::hsx::testing::TempDir* CudnnModelTest::dir_ = nullptr;
Checkpoint* CudnnModelTest::checkpoint_ = nullptr;

TEST_F(CudnnModelTest, MatchesTheReferenceKernelEngine) {
  std::unique_ptr<Engine> reference = MakeEngine(CudaAttention::kReference);
  std::unique_ptr<Engine> cudnn = MakeEngine(CudaAttention::kCudnn);
  ASSERT_TRUE(reference && cudnn);
  std::mt19937 random(5);
  std::vector<std::vector<int32_t>> samples;
  for (int64_t length : {1, 7, 64, 300, 1000}) samples.push_back(Tokens(random, length));
  const auto want = ::hsx::testing::RunBatch(*reference, samples);
  const auto got = ::hsx::testing::RunBatch(*cudnn, samples);
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, ::hsx::testing::ExpectLayersWithinL2(
                                absl::StrCat("tiny model, cudnn vs reference attention, sample ", i, " (",
                                             samples[i].size(), " tokens)"),
                                got[i], want[i], 2e-2));
  }
  std::printf("tiny model, cudnn vs reference attention (bf16): max relative L2 error per layer %.3g\n", worst);
  EXPECT_LE(worst, 2e-2);
}

TEST_F(CudnnModelTest, BatchedEqualsSoloBitForBit) {
  std::unique_ptr<Engine> engine = MakeEngine(CudaAttention::kCudnn);
  ASSERT_TRUE(engine);
  for (int seed = 0; seed < ::hsx::testing::TestSize(10, 2); ++seed) {
    std::mt19937 random(seed);
    std::vector<std::vector<int32_t>> samples;
    const int count = 2 + static_cast<int>(random() % 5);
    for (int i = 0; i < count; ++i) samples.push_back(Tokens(random, 1 + random() % ::hsx::testing::TestSize(seed < 3 ? 2048 : 300, 64)));
    const auto together = ::hsx::testing::RunBatch(*engine, samples);
    ASSERT_EQ(together.size(), samples.size());
    for (size_t i = 0; i < samples.size(); ++i) {
      const auto solo = ::hsx::testing::RunBatch(*engine, {samples[i]});
      ASSERT_EQ(solo.size(), 1u);
      EXPECT_TRUE(::hsx::testing::StatesMatch(absl::StrCat("cudnn model, seed ", seed, " sample ", i, " (",
                                                           samples[i].size(), " tokens) in the batch vs alone"),
                                              together[i], solo[0]));
    }
  }
}

// ---- no GPU needed ------------------------------------------------------------

TEST(CudnnAttentionFlagTest, ParsesAndRefusesWhatItCannotServe) {
  EXPECT_EQ(*ParseAttentionKernel("reference"), CudaAttention::kReference);
  EXPECT_EQ(*ParseAttentionKernel("cudnn"), CudaAttention::kCudnn);
  const absl::StatusOr<CudaAttention> bad = ParseAttentionKernel("flash");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("--attention 'flash'"), std::string::npos) << bad.status();
  const auto cpu = MakeDeviceFactory(Device::kCpu, ElementType::kBf16, 1, 1, 1, CudaAttention::kCudnn);
  ASSERT_FALSE(cpu.ok());
  EXPECT_EQ(cpu.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(cpu.status().message().find("--device cuda only"), std::string::npos) << cpu.status();
}

// This build has the frontend (scripts/setup.sh installs it), and libcudnn is
// opened only when asked for: without a device, creation fails at cudnnCreate
// (after the library loaded) or at the load, with the reason.
TEST(CudnnAttentionFlagTest, CreationSaysWhyWithoutADevice) {
  if (::hsx::testing::NoCudaDeviceReason().empty()) GTEST_SKIP() << "a CUDA device exists here";
  if (const std::string missing = cuda::CudnnAttentionMissing(); !missing.empty()) {
    GTEST_SKIP() << "built without the cuDNN frontend: " << missing;
  }
  const auto cudnn = cuda::CudnnAttention::Create(nullptr);
  ASSERT_FALSE(cudnn.ok());
  EXPECT_EQ(cudnn.status().code(), absl::StatusCode::kFailedPrecondition);
  std::printf("cuDNN without a device: %s\n", std::string(cudnn.status().message()).c_str());
  const auto backend = MakeCudaBackend(0, ElementType::kBf16, CudaAttention::kCudnn);
  ASSERT_FALSE(backend.ok());
  EXPECT_NE(backend.status().message().find("no CUDA device"), std::string::npos) << backend.status();
}

}  // namespace
}  // namespace hsx
