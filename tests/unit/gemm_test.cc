// Tests the CPU GEMM against its reference bit for bit, and row independence.
#include "kernels/cpu/gemm.h"

#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kernels/bf16.h"
#include "kernels/cpu/int4_dequant.h"
#include "kernels/cpu/thread_pool.h"

namespace hsx {
namespace {

struct Weights {
  std::vector<uint16_t> bf16;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scale;
  std::vector<float> f32;
};

Weights RandomWeights(int64_t n, int64_t k, std::mt19937& random) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  Weights w;
  for (int64_t i = 0; i < n * k; ++i) w.bf16.push_back(FloatToBf16(uniform(random)));
  for (int64_t i = 0; i < n * k; ++i) w.f32.push_back(uniform(random));
  for (int64_t i = 0; i < n * k / 8; ++i) w.packed.push_back(static_cast<int32_t>(random()));
  for (int64_t i = 0; i < n * k / 32; ++i) w.scale.push_back(FloatToBf16(0.01f + 0.1f * std::abs(uniform(random))));
  return w;
}

std::vector<GemmB> AllKinds(const Weights& w, int64_t n, int64_t k) {
  return {GemmB{GemmB::Kind::kBf16, w.bf16.data(), k, nullptr, 0, n, k},
          GemmB{GemmB::Kind::kInt4, w.packed.data(), 0, w.scale.data(), 32, n, k},
          GemmB{GemmB::Kind::kF32, w.f32.data(), k, nullptr, 0, n, k},
          GemmB{GemmB::Kind::kF32Transposed, w.f32.data(), n, nullptr, 0, n, k}};
}

// scripts/test.sh runs this binary once per kernel with HSX_CPU_GEMM set; this
// proves the variable took effect, so the runs are not three of the same.
TEST(GemmKernel, IsTheOneRequestedByHsxCpuGemm) {
  const char* requested = std::getenv("HSX_CPU_GEMM");
  std::printf("GEMM kernel: %s\n", GemmKernelName(ActiveGemmKernel()));
  if (requested == nullptr || *requested == '\0') GTEST_SKIP() << "HSX_CPU_GEMM not set";
  EXPECT_STREQ(GemmKernelName(ActiveGemmKernel()), requested);
}

TEST(GemmKernel, UnknownNamesAreRejectedWithTheVariableNamed) {
  GemmKernel kernel = GemmKernel::kAvx2;
  std::string error;
  EXPECT_FALSE(ResolveGemmKernel("avx", &kernel, &error));
  EXPECT_EQ(error, "HSX_CPU_GEMM=avx: unknown kernel (expected avx512, avx2 or scalar)");
  ASSERT_TRUE(ResolveGemmKernel("scalar", &kernel, &error)) << error;
  EXPECT_EQ(kernel, GemmKernel::kScalar);
  ASSERT_TRUE(ResolveGemmKernel("", &kernel, &error)) << error;  // empty: the widest supported
  ASSERT_TRUE(ResolveGemmKernel(nullptr, &kernel, &error)) << error;
#if defined(__x86_64__)
  if (!__builtin_cpu_supports("avx512f")) {
    EXPECT_FALSE(ResolveGemmKernel("avx512", &kernel, &error));
    EXPECT_EQ(error, "HSX_CPU_GEMM=avx512: this CPU does not support the avx512 kernel");
  }
#endif
}

TEST(GemmKernelDeathTest, AnUnknownHsxCpuGemmEndsTheProcessWithAMessage) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // a fresh process: the choice is made once
  EXPECT_EXIT(
      {
        setenv("HSX_CPU_GEMM", "sse", 1);
        ActiveGemmKernel();
      },
      testing::ExitedWithCode(2), "HSX_CPU_GEMM=sse: unknown kernel");
}

TEST(Gemm, EqualsTheReferenceBitForBit) {
  std::mt19937 random(11);
  ThreadPool pool(3);
  for (auto [m, n, k] : {std::tuple<int64_t, int64_t, int64_t>{1, 16, 32}, {5, 37, 64}, {13, 100, 96},
                         {64, 48, 256}}) {
    Weights w = RandomWeights(n, k, random);
    std::vector<float> a(m * k);
    std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
    for (float& v : a) v = uniform(random);
    for (const GemmB& b : AllKinds(w, n, k)) {
      for (bool round : {false, true}) {
        std::vector<float> fast(m * n), slow(m * n);
        Gemm(a.data(), k, m, b, fast.data(), n, round, &pool);
        GemmReference(a.data(), k, m, b, slow.data(), n, round);
        ASSERT_EQ(fast, slow) << "m=" << m << " n=" << n << " k=" << k << " kind="
                              << static_cast<int>(b.kind) << " round=" << round;
      }
    }
  }
}

TEST(Gemm, RowsDoNotDependOnTheOtherRowsOrThreads) {
  std::mt19937 random(5);
  const int64_t n = 70, k = 128;
  Weights w = RandomWeights(n, k, random);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<float> a(23 * k);
  for (float& v : a) v = uniform(random);
  ThreadPool pool(2);
  for (const GemmB& b : AllKinds(w, n, k)) {
    std::vector<float> all(23 * n);
    Gemm(a.data(), k, 23, b, all.data(), n, false, &pool);
    for (int64_t row : {0, 3, 4, 22}) {  // first, last of a block, first of the next, tail
      std::vector<float> alone(n);
      Gemm(a.data() + row * k, k, 1, b, alone.data(), n, false, nullptr);
      ASSERT_EQ(alone, std::vector<float>(all.begin() + row * n, all.begin() + (row + 1) * n));
    }
  }
}

}  // namespace
}  // namespace hsx
