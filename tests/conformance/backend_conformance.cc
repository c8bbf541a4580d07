// backend_conformance.cc: the suite's tests (see backend_conformance.h).
#include "tests/conformance/backend_conformance.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/reference/reference_ops.h"
#include "tests/common/value_comparison.h"

namespace hsx::conformance {

using reference::HostMatrix;
namespace {

// Host storage behind a LinearWeight view (bf16 or INT4 pack-quantized).
struct HostLinear {
  std::vector<uint16_t> bf16;
  std::vector<int32_t> packed;
  std::vector<uint16_t> scale;
  LinearWeight view;
};

std::string DtypeName(ElementType type) { return type == ElementType::kBf16 ? "bf16" : "fp32"; }

// got against want within tolerance (0: bitwise); a failure names the op, the
// shape, the dtype and the elements at fault (tests/common/value_comparison.h).
::testing::AssertionResult Conforms(std::string_view op, ElementType type, const HostMatrix& got,
                                    const HostMatrix& want, double tolerance) {
  const hsx::testing::ComparedValues what{std::string(op), {want.rows, want.cols}, DtypeName(type)};
  if (got.rows != want.rows || got.cols != want.cols) {
    return ::testing::AssertionFailure() << what.op << ": shape [" << got.rows << ", " << got.cols << "], the reference ["
                                         << want.rows << ", " << want.cols << "]";
  }
  return hsx::testing::ValuesMatch(what, got.values, want.values, tolerance);
}

}  // namespace

// Runs ops of one case on fresh random inputs.
class Harness {
 public:
  Harness(Backend& backend, ElementType precision, uint32_t seed)
      : backend_(backend), precision_(precision), random_(seed) {}

  ElementType precision() const { return precision_; }
  ElementType activation() const { return precision_; }

  float Value(float scale = 1.0f) {
    std::normal_distribution<float> normal(0.0f, scale);
    return normal(random_);
  }

  // Random values, bf16-exact when `type` is bf16.
  HostMatrix Random(int64_t rows, int64_t cols, ElementType type, float scale = 1.0f) {
    HostMatrix m(rows, cols);
    for (float& v : m.values) v = type == ElementType::kBf16 ? RoundToBf16(Value(scale)) : Value(scale);
    return m;
  }
  HostMatrix RandomActivation(int64_t rows, int64_t cols, float scale = 1.0f) {
    return Random(rows, cols, activation(), scale);
  }

  std::vector<uint16_t> RandomBf16(size_t n, float scale) {
    std::vector<uint16_t> v(n);
    for (uint16_t& x : v) x = FloatToBf16(Value(scale));
    return v;
  }

  HostLinear RandomLinear(int64_t out, int64_t in, bool int4, int64_t ld = 0) {
    HostLinear w;
    w.view.out = out;
    w.view.in = in;
    const float scale = 1.0f / std::sqrt(static_cast<float>(in));
    if (!int4) {
      w.view.ld = ld > 0 ? ld : in;
      w.bf16 = RandomBf16(static_cast<size_t>(out * w.view.ld), scale);
      w.view.bf16 = w.bf16.data();
      return w;
    }
    w.view.kind = LinearWeight::Kind::kInt4;
    w.view.group_size = 32;
    w.packed.resize(static_cast<size_t>(out * in / 8));
    for (int32_t& word : w.packed) word = static_cast<int32_t>(random_());
    w.scale = RandomBf16(static_cast<size_t>(out * in / 32), scale / 4);
    for (uint16_t& s : w.scale) s = FloatToBf16(std::abs(Bf16ToFloat(s)));
    w.view.packed = w.packed.data();
    w.view.scale = w.scale.data();
    return w;
  }

  // A matrix of `type` in backend memory holding `values`.
  Matrix Upload(const HostMatrix& values, ElementType type) {
    absl::StatusOr<std::unique_ptr<Buffer>> buffer = backend_.Allocate(values.rows, values.cols, type);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    const Matrix m = (*buffer)->matrix();
    std::vector<char> bytes(values.values.size() * ElementSize(type));
    for (size_t i = 0; i < values.values.size(); ++i) {
      if (type == ElementType::kF32) {
        std::memcpy(&bytes[i * 4], &values.values[i], 4);
      } else {
        const uint16_t bits = FloatToBf16(values.values[i]);
        std::memcpy(&bytes[i * 2], &bits, 2);
      }
    }
    backend_.CopyFromHost(bytes.data(), m);
    EXPECT_TRUE(backend_.Synchronize().ok());
    buffers_.push_back(*std::move(buffer));
    return m;
  }
  Matrix Allocate(int64_t rows, int64_t cols, ElementType type) { return Upload(HostMatrix(rows, cols), type); }

  HostMatrix Download(const Matrix& m) {
    std::vector<char> bytes(static_cast<size_t>(m.rows * m.cols) * ElementSize(m.type));
    backend_.CopyToHost(m, bytes.data());
    const absl::Status status = backend_.Synchronize();
    EXPECT_TRUE(status.ok()) << status;
    HostMatrix out(m.rows, m.cols);
    for (size_t i = 0; i < out.values.size(); ++i) {
      if (m.type == ElementType::kF32) {
        std::memcpy(&out.values[i], &bytes[i * 4], 4);
      } else {
        uint16_t bits;
        std::memcpy(&bits, &bytes[i * 2], 2);
        out.values[i] = Bf16ToFloat(bits);
      }
    }
    return out;
  }

  LinearWeight Place(const HostLinear& w) {
    absl::StatusOr<LinearWeight> placed = backend_.PlaceLinear(w.view);
    EXPECT_TRUE(placed.ok()) << placed.status();
    return *placed;
  }
  template <typename T>
  const T* Place(const std::vector<T>& host) {
    absl::StatusOr<const void*> placed = backend_.PlaceTensor(host.data(), host.size() * sizeof(T));
    EXPECT_TRUE(placed.ok()) << placed.status();
    return static_cast<const T*>(*placed);
  }

  std::unique_ptr<StagedBatch> Stage(const std::vector<int32_t>& tokens, const std::vector<int64_t>& cu) {
    absl::StatusOr<std::unique_ptr<StagedBatch>> staged = backend_.Stage(tokens, cu);
    EXPECT_TRUE(staged.ok()) << staged.status();
    return *std::move(staged);
  }

 private:
  Backend& backend_;
  ElementType precision_;
  std::mt19937 random_;
  std::vector<std::unique_ptr<Buffer>> buffers_;
};

BackendConformance::BackendConformance() = default;
BackendConformance::~BackendConformance() = default;

void BackendConformance::SetUp() {
  const ConformanceCase& c = GetParam();
  if (c.skip_reason) {
    if (const std::string why = c.skip_reason(); !why.empty()) GTEST_SKIP() << why;
  }
  absl::StatusOr<std::unique_ptr<Backend>> made = c.make();
  ASSERT_TRUE(made.ok()) << made.status();
  backend_ = *std::move(made);
  harness_ = std::make_unique<Harness>(*backend_, c.precision, 1234);
}

void BackendConformance::TearDown() {
  harness_.reset();
  backend_.reset();
}

namespace {

std::vector<int32_t> Positions(const std::vector<int64_t>& cu) {
  std::vector<int32_t> positions;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    for (int64_t t = cu[s]; t < cu[s + 1]; ++t) positions.push_back(static_cast<int32_t>(t - cu[s]));
  }
  return positions;
}

HostMatrix RowsOf(const HostMatrix& m, int64_t begin, int64_t count) {
  HostMatrix out(count, m.cols);
  std::copy(m.values.begin() + begin * m.cols, m.values.begin() + (begin + count) * m.cols, out.values.begin());
  return out;
}

TEST_P(BackendConformance, LinearMatchesReference) {
  for (const bool int4 : {false, true}) {
    for (const bool partial : {false, true}) {
      SCOPED_TRACE(absl::StrCat(int4 ? "INT4" : "bf16", partial ? ", partial" : ""));
      const HostLinear w = h().RandomLinear(48, 64, int4);
      const HostMatrix x = h().RandomActivation(13, 64);
      const Matrix y = h().Allocate(13, 48, partial ? ElementType::kF32 : h().activation());
      b().Linear(h().Upload(x, h().activation()), h().Place(w), y, partial);
      HostMatrix want(13, 48);
      reference::Linear(x, w.view, bf16() && !partial, &want);
      EXPECT_TRUE(Conforms(int4 ? "Linear (INT4)" : "Linear", y.type, h().Download(y), want, tol().linear));
    }
  }
}

TEST_P(BackendConformance, LinearOnAColumnSlice) {
  // A kCols tensor-parallel share: 40 of 96 input columns, row stride 96.
  HostLinear w = h().RandomLinear(24, 96, false);
  w.view.bf16 += 32;
  w.view.in = 40;
  const HostMatrix x = h().RandomActivation(7, 40);
  const Matrix y = h().Allocate(7, 24, h().activation());
  b().Linear(h().Upload(x, h().activation()), h().Place(w), y, false);
  HostMatrix want(7, 24);
  reference::Linear(x, w.view, bf16(), &want);
  EXPECT_TRUE(Conforms("Linear (column slice)", y.type, h().Download(y), want, tol().linear));
}

// The suite must notice a different summation order: a reference that sums k
// descending disagrees with the backend (for a bitwise case).
TEST_P(BackendConformance, GuardCatchesASwappedSummationOrder) {
  if (tol().linear != 0) GTEST_SKIP() << "the case is not bitwise for GEMMs";
  const HostLinear w = h().RandomLinear(48, 64, false);
  const HostMatrix x = h().RandomActivation(13, 64);
  const Matrix y = h().Allocate(13, 48, ElementType::kF32);
  b().Linear(h().Upload(x, h().activation()), h().Place(w), y, /*partial=*/true);
  HostMatrix swapped(13, 48);
  reference::Linear(x, w.view, false, &swapped, reference::SumOrder::kDescending);
  EXPECT_FALSE(Conforms("Linear", y.type, h().Download(y), swapped, 0));
}

TEST_P(BackendConformance, EmbedZeroesRowsOutsideTheVocabularyShare) {
  const std::vector<uint16_t> table = h().RandomBf16(20 * 16, 1.0f);  // vocabulary rows [10, 30)
  const std::vector<int32_t> tokens = {0, 10, 29, 30, 15, 39, 12};
  const std::vector<int64_t> cu = {0, 3, 7};
  const auto staged = h().Stage(tokens, cu);
  for (const ElementType type : {ElementType::kF32, h().activation()}) {
    const Matrix out = h().Allocate(7, 16, type);
    b().Embed(*staged, h().Place(table), 10, 20, out);
    HostMatrix want(7, 16);
    reference::Embed(tokens, table.data(), 10, 20, &want);
    EXPECT_TRUE(Conforms("Embed", out.type, h().Download(out), want, tol().elementwise));
  }
}

TEST_P(BackendConformance, ElementwiseOpsMatchReference) {
  const ElementType p = h().precision();
  const ElementType act = h().activation();
  const HostMatrix a = h().RandomActivation(9, 70);  // 70: not a multiple of RMSNorm's 4 lanes
  const HostMatrix c = h().RandomActivation(9, 70);
  const std::vector<uint16_t> weight = h().RandomBf16(70, 1.0f);
  {
    const Matrix y = h().Allocate(9, 70, act);
    b().RmsNorm(h().Upload(a, act), h().Place(weight), 1e-5f, y);
    HostMatrix want(9, 70);
    reference::RmsNorm(p, a, weight.data(), 1e-5f, &want);
    EXPECT_TRUE(Conforms("RmsNorm", y.type, h().Download(y), want, tol().elementwise));
  }
  {
    const Matrix y = h().Allocate(9, 70, act);
    b().Add(h().Upload(a, act), h().Upload(c, act), y);
    HostMatrix want(9, 70);
    reference::Add(p, a, c, &want);
    EXPECT_TRUE(Conforms("Add", y.type, h().Download(y), want, tol().elementwise));
  }
  {
    const Matrix gate = h().Upload(a, act);
    b().SiluMul(gate, h().Upload(c, act), gate);  // in place, as the forward pass does
    HostMatrix want(9, 70);
    reference::SiluMul(p, a, c, &want);
    EXPECT_TRUE(Conforms("SiluMul", gate.type, h().Download(gate), want, tol().elementwise));
  }
  {
    const HostMatrix partial = h().Random(9, 70, ElementType::kF32);  // not bf16-exact
    const Matrix y = h().Allocate(9, 70, act);
    b().Round(h().Upload(partial, ElementType::kF32), y);
    HostMatrix want = partial;
    reference::Round(p, &want);
    EXPECT_TRUE(Conforms("Round", y.type, h().Download(y), want, tol().elementwise));
  }
}

TEST_P(BackendConformance, RopeMatchesReference) {
  const int64_t half = 4, heads = 3, stride = 12, offset = 4;  // rope dims at [4 + 12h, + 8)
  const std::vector<int64_t> cu = {0, 3, 10};
  std::vector<float> cos(16 * half), sin(16 * half);
  for (size_t i = 0; i < cos.size(); ++i) {
    cos[i] = bf16() ? RoundToBf16(std::cos(0.3f * i)) : std::cos(0.3f * i);
    sin[i] = bf16() ? RoundToBf16(std::sin(0.3f * i)) : std::sin(0.3f * i);
  }
  absl::StatusOr<std::unique_ptr<RopeTable>> table = b().PlaceRopeTable(cos, sin, half);
  ASSERT_TRUE(table.ok()) << table.status();
  const auto staged = h().Stage(std::vector<int32_t>(10, 1), cu);
  const HostMatrix x = h().RandomActivation(10, heads * stride + offset);
  const Matrix m = h().Upload(x, h().activation());
  b().Rope(m, heads, stride, offset, *staged, **table);
  HostMatrix want = x;
  reference::Rope(h().precision(), &want, heads, stride, offset, Positions(cu), cos, sin, half);
  EXPECT_TRUE(Conforms("Rope", m.type, h().Download(m), want, tol().elementwise));
}

struct AttentionShape {
  int64_t heads = 2, nope = 16, rope = 8, v = 12;
  float scale = 0.25f;
};

TEST_P(BackendConformance, AttentionMatchesReferenceAcrossQueryBlocks) {
  const AttentionShape s;
  const std::vector<int64_t> cu = {0, 1, 6, 76};  // 70 tokens: more than one 64-row block
  const int64_t t = cu.back();
  const ElementType act = h().activation();
  const HostMatrix q = h().RandomActivation(t, s.heads * (s.nope + s.rope));
  const HostMatrix kv = h().RandomActivation(t, s.heads * (s.nope + s.v));
  const HostMatrix k_rope = h().RandomActivation(t, s.rope);
  const auto staged = h().Stage(std::vector<int32_t>(t, 0), cu);
  const Matrix out = h().Allocate(t, s.heads * s.v, act);
  b().Attention(h().Upload(q, act), h().Upload(kv, act), h().Upload(k_rope, act), s.heads, s.nope, s.rope, s.v,
                *staged, s.scale, out);
  HostMatrix want(t, s.heads * s.v);
  reference::Attention(h().precision(), q, kv, k_rope, s.heads, s.nope, s.rope, s.v, cu, s.scale, &want);
  EXPECT_TRUE(Conforms("Attention", out.type, h().Download(out), want, tol().attention));
}

RouterParams Router(const std::vector<uint16_t>& weight, const std::vector<float>* bias, bool softmax) {
  RouterParams r;
  r.weight = weight.data();
  r.bias = bias ? bias->data() : nullptr;
  r.num_experts = 16;
  r.top_k = 3;
  r.n_group = softmax ? 1 : 4;
  r.topk_group = softmax ? 1 : 2;
  r.softmax_scores = softmax;
  r.normalize = !softmax;
  r.scaling = softmax ? 1.0f : 2.5f;
  return r;
}

TEST_P(BackendConformance, RoutingMatchesReference) {
  const std::vector<uint16_t> weight = h().RandomBf16(16 * 32, 0.2f);
  std::vector<float> bias(16);
  for (float& v : bias) v = h().Value(0.05f);
  for (const bool softmax : {false, true}) {
    SCOPED_TRACE(softmax ? "softmax, one group" : "sigmoid, bias, 2 of 4 groups");
    const HostMatrix x = h().RandomActivation(11, 32);
    RouterParams placed = Router(weight, softmax ? nullptr : &bias, softmax);
    placed.weight = h().Place(weight);
    if (!softmax) placed.bias = h().Place(bias);
    absl::StatusOr<std::unique_ptr<Routing>> routing = b().AllocateRouting(11, 3);
    ASSERT_TRUE(routing.ok()) << routing.status();
    b().Route(h().Upload(x, h().activation()), placed, **routing);
    std::vector<int32_t> experts(33);
    std::vector<float> weights(33);
    b().CopyRoutingToHost(**routing, experts.data(), weights.data());
    ASSERT_TRUE(b().Synchronize().ok());
    std::vector<int32_t> want_experts;
    std::vector<float> want_weights;
    reference::Route(x, Router(weight, softmax ? nullptr : &bias, softmax), &want_experts, &want_weights);
    const std::vector<float> got_ids(experts.begin(), experts.end());
    const std::vector<float> want_ids(want_experts.begin(), want_experts.end());
    EXPECT_TRUE(hsx::testing::ValuesMatch({"Route (expert ids)", {11, 3}, "int32"}, got_ids, want_ids, 0));
    HostMatrix got_w(11, 3), want_w(11, 3);
    got_w.values = weights;
    want_w.values = want_weights;
    EXPECT_TRUE(Conforms("Route (expert weights)", ElementType::kF32, got_w, want_w, tol().linear));
  }
}

// Eight INT4 experts (hidden 32, intermediate 64: whole quantization groups of 32).
struct MoeSetup {
  std::vector<HostLinear> storage;
  std::vector<ExpertWeights> host;
  std::vector<uint16_t> router_weight;
};

MoeSetup MakeMoe(Harness& h) {
  MoeSetup m;
  for (int e = 0; e < 8; ++e) {
    m.storage.push_back(h.RandomLinear(64, 32, true));
    m.storage.push_back(h.RandomLinear(64, 32, true));
    m.storage.push_back(h.RandomLinear(32, 64, true));
  }
  for (int e = 0; e < 8; ++e) {
    m.host.push_back({m.storage[3 * e].view, m.storage[3 * e + 1].view, m.storage[3 * e + 2].view});
  }
  m.router_weight = h.RandomBf16(8 * 32, 0.3f);
  return m;
}

TEST_P(BackendConformance, MoeExpertsMatchReference) {
  const MoeSetup moe = MakeMoe(h());
  RouterParams router;
  router.weight = h().Place(moe.router_weight);
  router.num_experts = 8;
  router.top_k = 2;
  const bool all[8] = {true, true, true, true, true, true, true, true};
  const bool some[8] = {false, true, true, false, false, true, false, true};
  for (const bool* held : {all, some}) {
    absl::StatusOr<std::unique_ptr<ExpertTable>> table = b().PlaceExperts(moe.host, std::span<const bool>(held, 8));
    ASSERT_TRUE(table.ok()) << table.status();
    for (const bool partial : {false, true}) {
      SCOPED_TRACE(absl::StrCat(held == all ? "all experts" : "4 of 8 experts", partial ? ", partial" : ""));
      const HostMatrix x = h().RandomActivation(23, 32);
      const Matrix xm = h().Upload(x, h().activation());
      absl::StatusOr<std::unique_ptr<Routing>> routing = b().AllocateRouting(23, 2);
      ASSERT_TRUE(routing.ok());
      b().Route(xm, router, **routing);
      std::vector<int32_t> experts(46);
      std::vector<float> weights(46);
      b().CopyRoutingToHost(**routing, experts.data(), weights.data());
      const Matrix out = h().Allocate(23, 32, partial ? ElementType::kF32 : h().activation());
      b().MoeExperts(xm, **routing, **table, out, partial);
      const HostMatrix got = h().Download(out);
      HostMatrix want(23, 32);
      reference::MoeExperts(h().precision(), x, experts, weights, 2, moe.host, std::span<const bool>(held, 8),
                            partial, &want);
      EXPECT_TRUE(Conforms("MoeExperts", out.type, got, want, tol().moe));
    }
  }
}

// Row independence (contract rule (a)), bitwise for every backend: a row
// alone equals the same row at another position of a larger ragged batch.
TEST_P(BackendConformance, RowsDoNotDependOnTheBatch) {
  const ElementType act = h().activation();
  const HostLinear w = h().RandomLinear(40, 64, true);
  const HostMatrix batch = h().RandomActivation(37, 64);
  const HostMatrix alone = RowsOf(batch, 23, 1);
  const LinearWeight placed = h().Place(w);
  const Matrix y_batch = h().Allocate(37, 40, act);
  const Matrix y_alone = h().Allocate(1, 40, act);
  b().Linear(h().Upload(batch, act), placed, y_batch, false);
  b().Linear(h().Upload(alone, act), placed, y_alone, false);
  EXPECT_TRUE(Conforms("Linear: row 23 alone vs in a batch of 37", act, h().Download(y_alone),
                       RowsOf(h().Download(y_batch), 23, 1), 0));

  const std::vector<uint16_t> norm = h().RandomBf16(64, 1.0f);
  const uint16_t* norm_placed = h().Place(norm);
  const Matrix n_batch = h().Allocate(37, 64, act);
  const Matrix n_alone = h().Allocate(1, 64, act);
  b().RmsNorm(h().Upload(batch, act), norm_placed, 1e-6f, n_batch);
  b().RmsNorm(h().Upload(alone, act), norm_placed, 1e-6f, n_alone);
  EXPECT_TRUE(Conforms("RmsNorm: row 23 alone vs in a batch of 37", act, h().Download(n_alone),
                       RowsOf(h().Download(n_batch), 23, 1), 0));

  // A 9-token sample alone, and as the middle sample of 5 + 9 + 70 tokens.
  const AttentionShape s;
  const std::vector<int64_t> cu_batch = {0, 5, 14, 84};
  const std::vector<int64_t> cu_alone = {0, 9};
  const HostMatrix q = h().RandomActivation(84, s.heads * (s.nope + s.rope));
  const HostMatrix kv = h().RandomActivation(84, s.heads * (s.nope + s.v));
  const HostMatrix k_rope = h().RandomActivation(84, s.rope);
  const Matrix a_batch = h().Allocate(84, s.heads * s.v, act);
  const Matrix a_alone = h().Allocate(9, s.heads * s.v, act);
  const auto staged_batch = h().Stage(std::vector<int32_t>(84, 0), cu_batch);
  const auto staged_alone = h().Stage(std::vector<int32_t>(9, 0), cu_alone);
  b().Attention(h().Upload(q, act), h().Upload(kv, act), h().Upload(k_rope, act), s.heads, s.nope, s.rope, s.v,
                *staged_batch, s.scale, a_batch);
  b().Attention(h().Upload(RowsOf(q, 5, 9), act), h().Upload(RowsOf(kv, 5, 9), act),
                h().Upload(RowsOf(k_rope, 5, 9), act), s.heads, s.nope, s.rope, s.v, *staged_alone, s.scale,
                a_alone);
  EXPECT_TRUE(Conforms("Attention: a 9-token sample alone vs between 5 and 70", act, h().Download(a_alone),
                       RowsOf(h().Download(a_batch), 5, 9), 0));

  const MoeSetup moe = MakeMoe(h());
  const bool all[8] = {true, true, true, true, true, true, true, true};
  absl::StatusOr<std::unique_ptr<ExpertTable>> table = b().PlaceExperts(moe.host, std::span<const bool>(all, 8));
  ASSERT_TRUE(table.ok());
  RouterParams router;
  router.weight = h().Place(moe.router_weight);
  router.num_experts = 8;
  router.top_k = 2;
  const HostMatrix tokens = h().RandomActivation(29, 32);
  const Matrix m_batch = h().Allocate(29, 32, act);
  const Matrix m_alone = h().Allocate(1, 32, act);
  for (const auto& [input, rows, out] : {std::tuple{tokens, int64_t{29}, m_batch},
                                         std::tuple{RowsOf(tokens, 17, 1), int64_t{1}, m_alone}}) {
    const Matrix x = h().Upload(input, act);
    absl::StatusOr<std::unique_ptr<Routing>> routing = b().AllocateRouting(rows, 2);
    ASSERT_TRUE(routing.ok());
    b().Route(x, router, **routing);
    b().MoeExperts(x, **routing, **table, out, false);
    ASSERT_TRUE(b().Synchronize().ok());
  }
  EXPECT_TRUE(Conforms("MoeExperts: row 17 alone vs in a batch of 29", act, h().Download(m_alone),
                       RowsOf(h().Download(m_batch), 17, 1), 0));
}

TEST_P(BackendConformance, BadSizesAreReportedBySynchronize) {
  const HostLinear w = h().RandomLinear(8, 16, false);
  const Matrix x = h().Allocate(3, 12, h().activation());  // 12 columns for a W of 16 inputs
  const Matrix y = h().Allocate(3, 8, h().activation());
  b().Linear(x, h().Place(w), y, false);
  const absl::Status status = b().Synchronize();
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("Linear"), std::string::npos) << status;
  EXPECT_TRUE(b().Synchronize().ok()) << "Synchronize clears the error it returned";
}

}  // namespace
}  // namespace hsx::conformance
