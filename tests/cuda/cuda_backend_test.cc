// cuda_backend_test.cc: the CUDA backend against the CPU backend (the
// reference) at the real Kimi-K2 head dims and GEMM shapes, what the
// conformance suite's small shapes do not reach: matrices with a row stride
// (column slices), GEMM row independence at M = 8192, group-limited routing
// over 64 experts, and the error paths (bad sizes, out of memory, weights that
// do not fit, no device, --device cuda with --tp > 1).
//
// GPU tests skip, printing CUDA's reason, where there is no device; the
// error-path tests that need no GPU always run.
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/backend.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/lt_api.h"
#include "kernels/cuda/nccl_api.h"
#include "server/runtime/device_factory.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"

namespace hsx {
namespace {

// Cheap deterministic values (millions are needed for the GEMM shapes).
class Values {
 public:
  explicit Values(uint64_t seed) : state_(seed * 0x9E3779B97F4A7C15ull + 1) {}
  // Roughly uniform in [-scale, scale).
  float Next(float scale = 1.0f) {
    state_ ^= state_ << 13;
    state_ ^= state_ >> 7;
    state_ ^= state_ << 17;
    return scale * (static_cast<float>(state_ >> 40) / static_cast<float>(1 << 23) - 1.0f);
  }
  std::vector<uint16_t> Bf16(size_t n, float scale) {
    std::vector<uint16_t> out(n);
    for (uint16_t& v : out) v = FloatToBf16(Next(scale));
    return out;
  }

 private:
  uint64_t state_;
};

using ::hsx::testing::Decode;
using ::hsx::testing::Encode;

// One backend's copy of a matrix, kept alive by the fixture.
struct Side {
  Backend* backend;
  std::vector<std::unique_ptr<Buffer>> buffers;

  Matrix Upload(const std::vector<float>& values, int64_t rows, int64_t cols, ElementType type) {
    auto buffer = backend->Allocate(rows, cols, type);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    const Matrix m = (*buffer)->matrix();
    const std::vector<char> bytes = Encode(values, type);
    backend->CopyFromHost(bytes.data(), m);
    buffers.push_back(*std::move(buffer));
    return m;
  }
  std::vector<float> Download(const Matrix& m) {
    std::vector<char> bytes(static_cast<size_t>(m.rows * m.cols) * ElementSize(m.type));
    backend->CopyToHost(m, bytes.data());
    const absl::Status status = backend->Synchronize();
    EXPECT_TRUE(status.ok()) << status;
    return Decode(bytes, m.type);
  }
};

using ::hsx::testing::ValuesMatch;
using ::hsx::testing::ValuesWithinUlps;

class CudaVsCpuTest : public ::testing::TestWithParam<ElementType> {
 protected:
  void SetUp() override {
    HSX_SKIP_WITHOUT_CUDA();
    absl::StatusOr<std::unique_ptr<Backend>> gpu = MakeCudaBackend(0, GetParam());
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    gpu_backend_ = *std::move(gpu);
    cpu_backend_ = MakeCpuBackend(GetParam(), 2);
    gpu_.backend = gpu_backend_.get();
    cpu_.backend = cpu_backend_.get();
  }
  void TearDown() override {
    gpu_.buffers.clear();
    cpu_.buffers.clear();
  }
  bool bf16() const { return GetParam() == ElementType::kBf16; }
  const char* Dtype() const { return bf16() ? "bf16" : "fp32"; }
  static const char* DtypeName(ElementType type) { return type == ElementType::kBf16 ? "bf16" : "fp32"; }
  ElementType act() const { return GetParam(); }
  std::vector<float> Random(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (float& x : v) x = bf16() ? RoundToBf16(values_.Next(scale)) : values_.Next(scale);
    return v;
  }

  Values values_{42};
  std::unique_ptr<Backend> gpu_backend_, cpu_backend_;
  Side gpu_, cpu_;
};

// The ops whose arithmetic is the CPU's operation for operation, on column
// slices with a row stride, as the forward pass calls them.
TEST_P(CudaVsCpuTest, ElementwiseOpsAreBitwiseOnSlices) {
  const int64_t rows = 33, cols = 600;
  const std::vector<float> a = Random(rows * cols, 3.0f), b = Random(rows * cols, 3.0f);
  const std::vector<uint16_t> weight = values_.Bf16(512, 1.5f);
  for (Side* side : {&gpu_, &cpu_}) {
    Backend& be = *side->backend;
    const Matrix x = side->Upload(a, rows, cols, act());
    const Matrix y = side->Upload(b, rows, cols, act());
    const uint16_t* w = static_cast<const uint16_t*>(*be.PlaceTensor(weight.data(), weight.size() * 2));
    be.RmsNorm(x.Cols(4, 512), w, 1e-6f, y.Cols(80, 512));  // strided in and out
    be.Add(x, y, x);
    be.Round(side->Upload(a, rows, cols, ElementType::kF32), y);
  }
  const char* ops[2] = {"Add (after RmsNorm on column slices)", "RmsNorm on column slices, then Round"};
  for (size_t m = 0; m < 2; ++m) {
    EXPECT_TRUE(ValuesMatch({ops[m], {rows, cols}, Dtype()}, gpu_.Download(gpu_.buffers[m]->matrix()),
                            cpu_.Download(cpu_.buffers[m]->matrix()), 0));
  }
}

TEST_P(CudaVsCpuTest, RopeAndEmbedAreBitwise) {
  // 4 q heads of 192 (128 nope + 64 rope) per row, three samples.
  const std::vector<int32_t> tokens = {5, 9, 1, 0, 7, 7, 3, 2, 8, 6, 4};
  const std::vector<int64_t> cu = {0, 4, 5, 11};
  const int64_t half = 32, positions = 16;
  std::vector<float> cos(positions * half), sin(positions * half);
  for (size_t i = 0; i < cos.size(); ++i) {
    cos[i] = std::cos(0.01f * i);
    sin[i] = std::sin(0.01f * i);
    if (bf16()) cos[i] = RoundToBf16(cos[i]), sin[i] = RoundToBf16(sin[i]);
  }
  const std::vector<float> q = Random(11 * 4 * 192, 2.0f);
  const std::vector<uint16_t> table = values_.Bf16(8 * 96, 1.0f);  // vocabulary rows [2, 10)
  std::vector<std::vector<float>> results[2];
  Side* sides[2] = {&gpu_, &cpu_};
  for (int s = 0; s < 2; ++s) {
    Backend& be = *sides[s]->backend;
    auto staged = be.Stage(tokens, cu);
    ASSERT_TRUE(staged.ok()) << staged.status();
    auto rope = be.PlaceRopeTable(cos, sin, half);
    ASSERT_TRUE(rope.ok()) << rope.status();
    const Matrix x = sides[s]->Upload(q, 11, 4 * 192, act());
    be.Rope(x, 4, 192, 128, **staged, **rope);
    const Matrix k = sides[s]->Upload(q, 11, 4 * 192, act()).Cols(700, 64);  // a k_rope-like slice
    be.Rope(k, 1, 64, 0, **staged, **rope);
    const Matrix e = sides[s]->Upload(std::vector<float>(11 * 96, 0.0f), 11, 96, ElementType::kF32);
    be.Embed(**staged, static_cast<const uint16_t*>(*be.PlaceTensor(table.data(), table.size() * 2)), 2, 8, e);
    for (size_t m = 0; m < 3; ++m) results[s].push_back(sides[s]->Download(sides[s]->buffers[m]->matrix()));
  }
  const hsx::testing::ComparedValues what[3] = {{"Rope (4 q heads of 192, rope at 128)", {11, 4 * 192}, Dtype()},
                                                 {"Rope (a k_rope slice of 64 at column 700)", {11, 4 * 192}, Dtype()},
                                                 {"Embed (vocabulary rows [2, 10))", {11, 96}, "fp32"}};
  for (size_t m = 0; m < 3; ++m) EXPECT_TRUE(ValuesMatch(what[m], results[0][m], results[1][m], 0));
}

// SiluMul calls exp: CUDA's double exp rounded to float against glibc's
// expf. Both are within about half an ulp, so at most the last bit differs.
TEST_P(CudaVsCpuTest, SiluMulWithinOneUlp) {
  const std::vector<float> g = Random(64 * 1000, 12.0f), u = Random(64 * 1000, 2.0f);
  for (Side* side : {&gpu_, &cpu_}) {
    const Matrix gate = side->Upload(g, 64, 1000, act());
    side->backend->SiluMul(gate, side->Upload(u, 64, 1000, act()), gate);
  }
  const std::vector<float> got = gpu_.Download(gpu_.buffers[0]->matrix());
  const std::vector<float> want = cpu_.Download(cpu_.buffers[0]->matrix());
  // bf16: one bf16 ulp is 2^16 float ulps.
  EXPECT_TRUE(ValuesWithinUlps({"SiluMul", {64, 1000}, Dtype()}, got, want, bf16() ? 1 << 16 : 1));
  std::printf("SiluMul %s: %lld values differ from the CPU\n", Dtype(),
              static_cast<long long>(hsx::testing::FindMismatches(got, want, 0).outside));
}

// Attention at Kimi-K2's head dims (192 / 128), ragged, samples across
// several query and key tiles.
TEST_P(CudaVsCpuTest, AttentionAtKimiHeadDims) {
  const int64_t heads = 2, nope = 128, rope = 64, v = 128;
  const std::vector<int64_t> cu = {0, 1, 18, 118, 418};
  const int64_t t = cu.back();
  const std::vector<float> q = Random(t * heads * (nope + rope)), kv = Random(t * heads * (nope + v)),
                           kr = Random(t * rope);
  for (Side* side : {&gpu_, &cpu_}) {
    Backend& be = *side->backend;
    auto staged = be.Stage(std::vector<int32_t>(t, 0), cu);
    ASSERT_TRUE(staged.ok());
    const Matrix out = side->Upload(std::vector<float>(t * heads * v, 0.0f), t, heads * v, act());
    be.Attention(side->Upload(q, t, heads * (nope + rope), act()), side->Upload(kv, t, heads * (nope + v), act()),
                 side->Upload(kr, t, rope, act()), heads, nope, rope, v, **staged, 0.1352f, out);
  }
  const std::vector<float> got = gpu_.Download(gpu_.buffers[0]->matrix());
  const std::vector<float> want = cpu_.Download(cpu_.buffers[0]->matrix());
  EXPECT_TRUE(ValuesMatch({"Attention (2 heads, 192/128, 4 samples)", {t, heads * v}, Dtype()}, got, want,
                          bf16() ? 1e-2 : 1e-5));
  std::printf("Attention %s: %lld of %lld values differ from the CPU\n", Dtype(),
              static_cast<long long>(hsx::testing::FindMismatches(got, want, 0).outside),
              static_cast<long long>(t * heads * v));
}

// The row-independence rule at the GEMM shapes of one Kimi-K2 rank (TP8):
// rows computed alone and in a 3-row batch equal the same rows of an
// 8192-row product, bitwise; and the product is within tolerance of the CPU.
TEST_P(CudaVsCpuTest, GemmRowsDoNotDependOnM) {
  struct Shape {
    int64_t n, k;
  };
  const Shape shapes[] = {{1536, 7168}, {576, 7168}, {2048, 512}, {7168, 1024}, {4096, 7168}, {7168, 2048}};
  const int64_t big = ::hsx::testing::TestSize(8192, 512);
  const int64_t picked[] = {0, big / 2 - 1, big - 1};
  Backend& be = *gpu_backend_;
  for (const Shape& s : shapes) {
    for (const bool partial : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "N=" << s.n << " K=" << s.k << (partial ? " partial" : ""));
      const std::vector<uint16_t> w = values_.Bf16(static_cast<size_t>(s.n * s.k), 1.0f / std::sqrt(float(s.k)));
      LinearWeight host;
      host.bf16 = w.data();
      host.ld = host.in = s.k;
      host.out = s.n;
      auto placed = be.PlaceLinear(host);
      ASSERT_TRUE(placed.ok()) << placed.status();
      const std::vector<float> x = Random(static_cast<size_t>(big * s.k));
      const ElementType out_type = partial ? ElementType::kF32 : act();
      const Matrix xb = gpu_.Upload(x, big, s.k, act());
      const Matrix yb = gpu_.Upload(std::vector<float>(big * s.n, 0.0f), big, s.n, out_type);
      be.Linear(xb, *placed, yb, partial);
      const std::vector<float> y_big = gpu_.Download(yb);
      std::vector<float> three_x;
      for (int64_t r : picked) three_x.insert(three_x.end(), x.begin() + r * s.k, x.begin() + (r + 1) * s.k);
      const Matrix y3 = gpu_.Upload(std::vector<float>(3 * s.n, 0.0f), 3, s.n, out_type);
      be.Linear(gpu_.Upload(three_x, 3, s.k, act()), *placed, y3, partial);
      const std::vector<float> y_three = gpu_.Download(y3);
      for (int i = 0; i < 3; ++i) {
        const int64_t r = picked[i];
        const std::vector<float> x1(x.begin() + r * s.k, x.begin() + (r + 1) * s.k);
        const Matrix y1 = gpu_.Upload(std::vector<float>(s.n, 0.0f), 1, s.n, out_type);
        be.Linear(gpu_.Upload(x1, 1, s.k, act()), *placed, y1, partial);
        const std::vector<float> want(y_big.begin() + r * s.n, y_big.begin() + (r + 1) * s.n);
        const std::string op = absl::StrCat("Linear N=", s.n, " K=", s.k, partial ? " partial" : "", ": row ", r,
                                            " of ", big);
        EXPECT_TRUE(ValuesMatch({op + " vs alone", {1, s.n}, DtypeName(out_type)}, gpu_.Download(y1), want, 0));
        const std::vector<float> in_three(y_three.begin() + i * s.n, y_three.begin() + (i + 1) * s.n);
        EXPECT_TRUE(ValuesMatch({op + " vs in 3 rows", {1, s.n}, DtypeName(out_type)}, in_three, want, 0));
      }
      // Against the CPU on the three rows (the CPU GEMM at M = 8192 would be slow).
      const Matrix yc = cpu_.Upload(std::vector<float>(3 * s.n, 0.0f), 3, s.n, out_type);
      cpu_backend_->Linear(cpu_.Upload(three_x, 3, s.k, act()), host, yc, partial);
      EXPECT_TRUE(ValuesMatch({absl::StrCat("Linear N=", s.n, " K=", s.k, partial ? " partial" : "",
                                            ": rows 0, ", big / 2 - 1, ", ", big - 1, " vs the CPU"),
                               {3, s.n}, DtypeName(out_type)},
                              y_three, cpu_.Download(yc), bf16() && !partial ? 1e-2 : 1e-4));
      gpu_.buffers.clear();
      cpu_.buffers.clear();
    }
  }
}

// DeepSeek-V3-style routing (sigmoid, bias, 8 groups keeping 4, top 8,
// scaling) over 64 bf16 experts: the same experts as the CPU, and the MoE
// output within tolerance.
TEST_P(CudaVsCpuTest, GroupLimitedRoutingAndBf16Experts) {
  const int64_t experts = 64, hidden = 256, inter = 128, tokens = 300, top_k = 8;
  const std::vector<uint16_t> router_weight = values_.Bf16(experts * hidden, 0.2f);
  std::vector<float> bias(experts);
  for (float& b : bias) b = values_.Next(0.05f);
  std::vector<std::vector<uint16_t>> storage;
  std::vector<ExpertWeights> host(experts);
  std::vector<char> held(experts);
  for (int64_t e = 0; e < experts; ++e) {
    held[e] = e % 3 != 1;  // some experts live on other ranks
    LinearWeight* parts[3] = {&host[e].gate, &host[e].up, &host[e].down};
    for (int i = 0; i < 3; ++i) {
      const int64_t out = i == 2 ? hidden : inter, in = i == 2 ? inter : hidden;
      storage.push_back(values_.Bf16(static_cast<size_t>(out * in), 1.0f / std::sqrt(float(in))));
      parts[i]->bf16 = storage.back().data();
      parts[i]->out = out;
      parts[i]->in = parts[i]->ld = in;
    }
  }
  const std::vector<float> x = Random(tokens * hidden);
  std::vector<int32_t> chosen[2];
  std::vector<float> weights[2];
  Side* sides[2] = {&gpu_, &cpu_};
  for (int s = 0; s < 2; ++s) {
    Backend& be = *sides[s]->backend;
    RouterParams router;
    router.weight = static_cast<const uint16_t*>(*be.PlaceTensor(router_weight.data(), router_weight.size() * 2));
    router.bias = static_cast<const float*>(*be.PlaceTensor(bias.data(), bias.size() * 4));
    router.num_experts = experts;
    router.top_k = top_k;
    router.n_group = 8;
    router.topk_group = 4;
    router.scaling = 2.827f;
    const std::unique_ptr<bool[]> flags(new bool[experts]);
    for (int64_t e = 0; e < experts; ++e) flags[e] = held[e];
    auto table = be.PlaceExperts(host, std::span<const bool>(flags.get(), experts));
    ASSERT_TRUE(table.ok()) << table.status();
    auto routing = be.AllocateRouting(tokens, top_k);
    ASSERT_TRUE(routing.ok());
    const Matrix xm = sides[s]->Upload(x, tokens, hidden, act());
    be.Route(xm, router, **routing);
    chosen[s].resize(tokens * top_k);
    weights[s].resize(tokens * top_k);
    be.CopyRoutingToHost(**routing, chosen[s].data(), weights[s].data());
    const Matrix out = sides[s]->Upload(std::vector<float>(tokens * hidden, 0.0f), tokens, hidden, act());
    be.MoeExperts(xm, **routing, **table, out, false);
    ASSERT_TRUE(be.Synchronize().ok());
  }
  const std::vector<float> gpu_ids(chosen[0].begin(), chosen[0].end()), cpu_ids(chosen[1].begin(), chosen[1].end());
  EXPECT_TRUE(ValuesMatch({"Route (expert ids, 8 of 64, 4 of 8 groups)", {tokens, top_k}, "int32"}, gpu_ids, cpu_ids, 0));
  EXPECT_TRUE(ValuesMatch({"Route (expert weights)", {tokens, top_k}, "fp32"}, weights[0], weights[1], 1e-5));
  EXPECT_TRUE(ValuesMatch({"MoeExperts (64 bf16 experts, 2 of 3 held)", {tokens, hidden}, Dtype()},
                          gpu_.Download(gpu_.buffers[1]->matrix()), cpu_.Download(cpu_.buffers[1]->matrix()),
                          bf16() ? 2e-2 : 1e-5));
}

TEST_P(CudaVsCpuTest, BadSizesAreReportedWithTheOpAndSizes) {
  Backend& be = *gpu_backend_;
  const Matrix x = gpu_.Upload(std::vector<float>(3 * 12, 0.0f), 3, 12, act());
  const Matrix y = gpu_.Upload(std::vector<float>(3 * 8, 0.0f), 3, 8, act());
  const std::vector<uint16_t> w(8 * 16, 0);
  LinearWeight host;
  host.bf16 = w.data();
  host.out = 8;
  host.in = host.ld = 16;
  be.Linear(x, *be.PlaceLinear(host), y, false);
  be.Add(x, y, x);
  const absl::Status status = be.Synchronize();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("cuda:0 Linear: x [3, 12]"), std::string::npos) << status;
  EXPECT_TRUE(be.Synchronize().ok()) << "the error was cleared";
}

TEST_P(CudaVsCpuTest, OutOfMemorySaysHowMuch) {
  Backend& be = *gpu_backend_;
  auto huge = be.Allocate(int64_t{1} << 22, int64_t{1} << 22, ElementType::kF32);  // 64 TiB
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kResourceExhausted) << huge.status();
  EXPECT_NE(huge.status().message().find("asked 67108864.0 MiB"), std::string::npos) << huge.status();
  EXPECT_NE(huge.status().message().find("free of"), std::string::npos) << huge.status();
  // A weight larger than the device: refused before anything is read.
  const std::vector<uint16_t> w(16, 0);
  LinearWeight host;
  host.bf16 = w.data();
  host.out = int64_t{1} << 20;
  host.in = host.ld = int64_t{1} << 20;  // 2 TiB of bf16
  auto placed = be.PlaceLinear(host);
  ASSERT_FALSE(placed.ok());
  EXPECT_NE(placed.status().message().find("the weights do not fit"), std::string::npos) << placed.status();
  // The backend still works.
  const Matrix m = gpu_.Upload({1.0f, 2.0f}, 1, 2, act());
  EXPECT_EQ(gpu_.Download(m), (std::vector<float>{1.0f, 2.0f}));
}

std::string PrecisionName(const ::testing::TestParamInfo<ElementType>& param) {
  return param.param == ElementType::kBf16 ? "bf16" : "fp32";
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaVsCpuTest, ::testing::Values(ElementType::kF32, ElementType::kBf16),
                         PrecisionName);

// ---- No GPU needed ---------------------------------------------------------------

TEST(CudaBackendNoDeviceTest, NoDeviceGivesAClearError) {
  if (::hsx::testing::NoCudaDeviceReason().empty()) GTEST_SKIP() << "a CUDA device exists here";
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(0, ElementType::kBf16);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(backend.status().message().rfind("no CUDA device: ", 0), 0u) << backend.status();
  absl::StatusOr<std::unique_ptr<DeviceFactory>> factory = MakeDeviceFactory(Device::kCuda, ElementType::kBf16, 1, 0);
  ASSERT_FALSE(factory.ok());
  EXPECT_EQ(factory.status().message().rfind("--device cuda: no CUDA device: ", 0), 0u) << factory.status();
}

// cuBLASLt is loaded with dlopen (lt_api.h): it must load from the toolkit,
// and afterwards a thread with a small fixed stack (as civetweb starts them)
// must still start. Linked instead, its ~92 KiB of static TLS would sit on
// every thread's stack and pthread_create would fail with EINVAL.
TEST(CudaBackendNoDeviceTest, CublasLtLoadsLazilyAndSmallStackThreadsStillStart) {
  absl::StatusOr<const cuda::LtApi*> api = cuda::LoadLtApi();
  ASSERT_TRUE(api.ok()) << api.status();
  int version = static_cast<int>((*api)->cublasLtMatmul != nullptr);
  EXPECT_EQ(version, 1);
  pthread_attr_t attr;
  ASSERT_EQ(pthread_attr_init(&attr), 0);
  ASSERT_EQ(pthread_attr_setstacksize(&attr, 64 * 1024), 0);
  pthread_t thread;
  const int created = pthread_create(&thread, &attr, [](void*) -> void* { return nullptr; }, nullptr);
  EXPECT_EQ(created, 0) << "pthread_create with a 64 KiB stack: " << std::strerror(created);
  if (created == 0) pthread_join(thread, nullptr);
  pthread_attr_destroy(&attr);
}

TEST(CudaBackendNoDeviceTest, TensorParallelismWithoutAGpuSaysSo) {
  if (::hsx::testing::NoCudaDeviceReason().empty()) GTEST_SKIP() << "a CUDA device exists here";
  for (const int ranks_per_device : {1, 2}) {
    absl::StatusOr<std::unique_ptr<DeviceFactory>> factory =
        MakeDeviceFactory(Device::kCuda, ElementType::kBf16, 2, 0, ranks_per_device);
    ASSERT_FALSE(factory.ok());
    EXPECT_EQ(factory.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(factory.status().message().rfind("--device cuda: no CUDA device: ", 0), 0u) << factory.status();
  }
}

TEST(CudaBackendNoDeviceTest, NcclLoadsLazily) {
  // The toolkit here has libnccl (gpu-notes.md §8: so has the device machine's).
  absl::StatusOr<const cuda::NcclApi*> api = cuda::LoadNcclApi();
  ASSERT_TRUE(api.ok()) << api.status();
  int version = 0;
  ASSERT_EQ((*api)->ncclGetVersion(&version), ncclSuccess);
  EXPECT_GE(version, 20000) << "NCCL " << version;
}

}  // namespace
}  // namespace hsx
