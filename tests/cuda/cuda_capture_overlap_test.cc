// cuda_capture_overlap_test.cc: captures copied to the host on a second
// stream through the staging ring (kernels/cuda/cuda_backend.h, "Captures")
// hold exactly what the source held when CopyToHost was called, as the copy
// on the compute stream does:
//  * op level: a residual-like matrix (a column slice, so its rows are
//    strided) is updated in place by a device Add right after each capture;
//    several CopyToHost calls per "layer" on sub-ranges of rows (one per
//    sample, as forward.cc does), whole-matrix ones, hundreds of single rows
//    (more than the backend's pending-copy events), a source freed and its
//    memory rewritten right after the copy; with overlap off, with the
//    default ring, and with a ring of a few rows (chunks, wraps and waits);
//    bf16 and f32; several batches with a Synchronize between;
//  * model level: the tiny model's captures with HSX_CUDA_CAPTURE_OVERLAP=1
//    and =0 are bitwise equal, over several batches; and through the
//    batcher (copies fenced, waited for on its delivery thread) each sample
//    equals its solo run.
// The option and environment checks need no GPU; the rest skip, with CUDA's
// reason, where there is none.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/unit/float_states.h"
#include "server/runtime/batcher.h"
#include "server/runtime/engine.h"
#include "tests/common/value_comparison.h"
#include "tests/cuda/cuda_test_util.h"
#include "tests/unit/test_util.h"

namespace hsx {
namespace {

// Sets an environment variable for one scope, restoring the old value.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    const char* old = std::getenv(name);
    had_ = old != nullptr;
    if (had_) old_ = old;
    if (value == nullptr) {
      unsetenv(name);
    } else {
      setenv(name, value, 1);
    }
  }
  ~ScopedEnv() {
    if (had_) {
      setenv(name_, old_.c_str(), 1);
    } else {
      unsetenv(name_);
    }
  }

 private:
  const char* name_;
  bool had_ = false;
  std::string old_;
};

TEST(CudaCaptureOptionsTest, EnvironmentSwitchesTheOverlap) {
  {
    ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", nullptr);
    absl::StatusOr<CudaCaptureOptions> options = CudaCaptureOptionsFromEnv();
    ASSERT_TRUE(options.ok()) << options.status();
    EXPECT_TRUE(options->overlap);
    EXPECT_EQ(options->staging_bytes, kCaptureStagingBytes);
  }
  {
    ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", "0");
    absl::StatusOr<CudaCaptureOptions> options = CudaCaptureOptionsFromEnv();
    ASSERT_TRUE(options.ok()) << options.status();
    EXPECT_FALSE(options->overlap);
  }
  {
    ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", "1");
    EXPECT_TRUE(CudaCaptureOptionsFromEnv()->overlap);
  }
}

TEST(CudaCaptureOptionsTest, BadEnvironmentValueIsRefusedBeforeAnyDevice) {
  ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", "yes");
  absl::StatusOr<CudaCaptureOptions> options = CudaCaptureOptionsFromEnv();
  ASSERT_FALSE(options.ok());
  EXPECT_EQ(options.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(options.status().message().find("HSX_CUDA_CAPTURE_OVERLAP='yes'"), std::string::npos) << options.status();
  // MakeCudaBackend says so too, with or without a GPU.
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(0, ElementType::kBf16);
  ASSERT_FALSE(backend.ok());
  EXPECT_EQ(backend.status(), options.status());
}

TEST(CudaCaptureOptionsTest, OnlyACudaBackendTakesOptions) {
  std::unique_ptr<Backend> cpu = MakeCpuBackend(ElementType::kF32, 1);
  const absl::Status status = SetCudaCaptureOptions(*cpu, CudaCaptureOptions{});
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("not a CUDA backend"), std::string::npos) << status;
}

// Small integers: exact in bf16 and f32 through a few additions, so the
// expected captures are plain host arithmetic.
std::vector<float> SmallIntegers(std::mt19937& random, size_t n, int range) {
  std::vector<float> values(n);
  for (float& v : values) v = static_cast<float>(static_cast<int>(random() % (2 * range + 1)) - range);
  return values;
}

using ::hsx::testing::Decode;
using ::hsx::testing::Encode;

struct Case {
  const char* name;
  CudaCaptureOptions options;
};

class CudaCaptureOverlapTest : public ::testing::TestWithParam<ElementType> {
 protected:
  void SetUp() override { HSX_SKIP_WITHOUT_CUDA(); }
};

// Each capture's bytes in the pinned buffer at `base` against the values the
// source held when it was copied (bitwise); appends what arrived to `captures`.
void CheckCaptures(const char* base, const std::vector<std::pair<size_t, std::vector<char>>>& expected,
                   ElementType type, int64_t cols, const std::string& label, std::vector<std::vector<char>>* captures) {
  const size_t row_bytes = static_cast<size_t>(cols) * ElementSize(type);
  for (size_t i = 0; i < expected.size(); ++i) {
    const char* got = base + expected[i].first;
    const std::vector<char>& want = expected[i].second;
    captures->emplace_back(got, got + want.size());
    EXPECT_TRUE(::hsx::testing::ValuesMatch(
        {absl::StrCat(label, ", capture ", i, " vs the source when copied"),
         {static_cast<int64_t>(want.size() / row_bytes), cols}, type == ElementType::kBf16 ? "bf16" : "fp32"},
        Decode(captures->back(), type), Decode(want, type), 0));
  }
}

// Runs the capture pattern on one backend with `options`; returns every
// capture's bytes in order (empty, with a failure, on error) after checking
// each against the values the source held when it was captured.
std::vector<std::vector<char>> CaptureEverything(ElementType precision, const CudaCaptureOptions& options) {
  absl::StatusOr<std::unique_ptr<Backend>> made = MakeCudaBackend(0, precision);
  EXPECT_TRUE(made.ok()) << made.status();
  if (!made.ok()) return {};
  Backend& backend = **made;
  EXPECT_TRUE(SetCudaCaptureOptions(backend, options).ok());
  const ElementType type = backend.precision();
  const size_t element = ElementSize(type);
  constexpr int64_t kCols = 40, kWide = 48, kOffset = 3, kLayers = 5;
  std::vector<std::vector<char>> captures;
  std::mt19937 random(11);
  // Batches of different sizes and sample splits, one backend throughout.
  const std::vector<std::vector<int64_t>> batches = {{0, 1, 17, 50, 97}, {0, 300}, {0, 5, 6, 7, 64}};
  for (const std::vector<int64_t>& cu : batches) {
    const int64_t rows = cu.back();
    auto wide = backend.Allocate(rows, kWide, type);
    auto delta = backend.Allocate(rows, kCols, type);
    EXPECT_TRUE(wide.ok() && delta.ok());
    if (!wide.ok() || !delta.ok()) return {};
    const Matrix h = (*wide)->matrix().Cols(kOffset, kCols);  // strided rows: ld 48, 40 columns
    std::vector<float> current = SmallIntegers(random, static_cast<size_t>(rows * kCols), 40);
    const std::vector<float> step = SmallIntegers(random, current.size(), 3);
    const std::vector<char> current_bytes = Encode(current, type), step_bytes = Encode(step, type);
    backend.CopyFromHost(current_bytes.data(), h);
    backend.CopyFromHost(step_bytes.data(), (*delta)->matrix());
    // One pinned buffer for the batch's captures, handed out in order: per
    // layer the samples and the whole matrix, once every single row, and
    // the freed source at the end.
    const size_t row_bytes = static_cast<size_t>(kCols) * element;
    const size_t host_bytes = static_cast<size_t>(2 * kLayers * rows + 2 * rows) * row_bytes;
    auto host = backend.AllocateHost(host_bytes);
    EXPECT_TRUE(host.ok()) << host.status();
    if (!host.ok()) return {};
    char* const base = static_cast<char*>((*host)->data());
    std::memset(base, 0x5a, host_bytes);
    size_t used = 0;
    std::vector<std::pair<size_t, std::vector<char>>> expected;  // (offset in the host buffer, bytes)
    auto capture = [&](const Matrix& rows_view, int64_t first_row) {
      const size_t bytes = static_cast<size_t>(rows_view.rows) * row_bytes;
      EXPECT_LE(used + bytes, host_bytes);
      backend.CopyToHost(rows_view, base + used);
      const std::vector<char> all = Encode(current, type);
      expected.emplace_back(used, std::vector<char>(all.begin() + first_row * row_bytes,
                                                    all.begin() + first_row * row_bytes + bytes));
      used += bytes;
    };
    for (int64_t layer = 0; layer < kLayers; ++layer) {
      // Per sample, as forward.cc captures; then the whole matrix; then
      // single rows (more copies in flight than the backend has events).
      for (size_t s = 0; s + 1 < cu.size(); ++s) capture(h.Rows(cu[s], cu[s + 1] - cu[s]), cu[s]);
      capture(h, 0);
      if (layer == 2) {
        for (int64_t r = 0; r < rows; ++r) capture(h.Rows(r, 1), r);
      }
      // The in-place update of the residual stream, right after the copies.
      backend.Add(h, (*delta)->matrix(), h);
      for (size_t i = 0; i < current.size(); ++i) current[i] += step[i];
    }
    // A source freed right after its copy, its memory then rewritten.
    {
      auto temp = backend.Allocate(rows, kCols, type);
      EXPECT_TRUE(temp.ok());
      const std::vector<char> temp_bytes = Encode(current, type);
      backend.CopyFromHost(temp_bytes.data(), (*temp)->matrix());
      capture((*temp)->matrix(), 0);
      temp->reset();
      auto reuse = backend.Allocate(rows, kCols, type);
      EXPECT_TRUE(reuse.ok());
      backend.CopyFromHost(step_bytes.data(), (*reuse)->matrix());
      const absl::Status status = backend.Synchronize();  // before temp_bytes and the buffers go
      EXPECT_TRUE(status.ok()) << status;
    }
    EXPECT_EQ(used, host_bytes);
    CheckCaptures(base, expected, type, kCols, absl::StrCat("batch of ", rows, " rows"), &captures);
  }
  return captures;
}

TEST_P(CudaCaptureOverlapTest, CapturesHoldTheSourceAsItWasWhenCopied) {
  const size_t row = 40 * ElementSize(GetParam());
  const std::vector<Case> cases = {
      {"overlap off", {false, kCaptureStagingBytes}},
      {"overlap on, default ring", {true, kCaptureStagingBytes}},
      {"overlap on, ring of 3.5 rows", {true, static_cast<int64_t>(row * 7 / 2)}},
      {"overlap on, ring of 40 rows", {true, static_cast<int64_t>(row * 40)}},
  };
  std::vector<std::vector<char>> reference;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::vector<std::vector<char>> got = CaptureEverything(GetParam(), c.options);
    ASSERT_FALSE(got.empty());
    if (reference.empty()) {
      reference = got;
      continue;
    }
    ASSERT_EQ(got.size(), reference.size());
    const ElementType type = GetParam();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(::hsx::testing::ValuesMatch(
          {absl::StrCat(c.name, ": capture ", i, " vs overlap off"),
           {static_cast<int64_t>(got[i].size() / (40 * ElementSize(type))), 40},
           type == ElementType::kBf16 ? "bf16" : "fp32"},
          Decode(got[i], type), Decode(reference[i], type), 0));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, CudaCaptureOverlapTest, ::testing::Values(ElementType::kF32, ElementType::kBf16),
                         [](const ::testing::TestParamInfo<ElementType>& param_info) {
                           return param_info.param == ElementType::kBf16 ? "bf16" : "fp32";
                         });

// The whole tiny model, every layer and the final norm captured, a few
// batches: captures with the overlap on equal those with it off, bitwise.
TEST(CudaCaptureOverlapModelTest, OverlapOnEqualsOverlapOffBitwise) {
  HSX_SKIP_WITHOUT_CUDA();
  ::hsx::testing::TempDir dir;
  std::unique_ptr<Checkpoint> checkpoint(
      ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(), dir / "m", 23));
  ASSERT_NE(checkpoint, nullptr);
  std::mt19937 random(3);
  std::vector<std::vector<std::vector<int32_t>>> batches;
  for (const std::vector<int64_t>& lengths :
       std::vector<std::vector<int64_t>>{{1, 37, 130}, {300}, {5, 64, 2, 17, 200}}) {
    std::vector<std::vector<int32_t>> batch;
    for (int64_t length : lengths) {
      std::vector<int32_t> tokens(length);
      for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint->config().vocab_size);
      batch.push_back(tokens);
    }
    batches.push_back(batch);
  }
  for (const ElementType precision : {ElementType::kF32, ElementType::kBf16}) {
    SCOPED_TRACE(precision == ElementType::kBf16 ? "bf16" : "fp32");
    std::vector<std::vector<testing::FloatStates>> runs[2];
    for (int overlap = 0; overlap < 2; ++overlap) {
      ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", overlap ? "1" : "0");
      EngineOptions options;
      options.precision = precision;
      options.device = Device::kCuda;
      absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint, options);
      ASSERT_TRUE(engine.ok()) << engine.status();
      for (const auto& batch : batches) runs[overlap].push_back(::hsx::testing::RunBatch(**engine, batch));
    }
    for (size_t b = 0; b < batches.size(); ++b) {
      ASSERT_EQ(runs[0][b].size(), batches[b].size());
      ASSERT_EQ(runs[1][b].size(), batches[b].size());
      for (size_t s = 0; s < batches[b].size(); ++s) {
        EXPECT_TRUE(::hsx::testing::StatesMatch(absl::StrCat("batch ", b, " sample ", s, ": overlap on vs off"),
                                                runs[1][b][s], runs[0][b][s]));
      }
    }
  }
}

// Through the batcher, which lets the next batch start before the last
// copies have landed (Engine::Copies::kFence) and waits for them on its
// delivery thread: every sample, delivered from one of several batches,
// equals the same sample run alone with Run waiting for its copies, bitwise.
TEST(CudaCaptureOverlapModelTest, TheBatcherDeliversOnlyLandedRows) {
  HSX_SKIP_WITHOUT_CUDA();
  ::hsx::testing::TempDir dir;
  std::unique_ptr<Checkpoint> checkpoint(
      ::hsx::testing::WriteTestCheckpoint(::hsx::testing::TinyTestConfig(), dir / "m", 29));
  ASSERT_NE(checkpoint, nullptr);
  ScopedEnv env("HSX_CUDA_CAPTURE_OVERLAP", "1");
  EngineOptions options;
  options.precision = ElementType::kBf16;
  options.device = Device::kCuda;
  absl::StatusOr<std::unique_ptr<Engine>> engine = Engine::Create(*checkpoint, options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937 random(5);
  std::vector<std::vector<int32_t>> samples;
  for (int i = 0; i < 24; ++i) {
    std::vector<int32_t> tokens(1 + random() % 300);
    for (int32_t& t : tokens) t = static_cast<int32_t>(random() % checkpoint->config().vocab_size);
    samples.push_back(tokens);
  }
  const CaptureSpec capture = CaptureSpec::All(static_cast<int>(checkpoint->config().num_hidden_layers), true);
  std::vector<absl::StatusOr<testing::FloatStates>> got(samples.size(), absl::UnknownError("not delivered"));
  {
    Batcher batcher(**engine, BatcherOptions{.max_batch_tokens = 512});
    for (size_t i = 0; i < samples.size(); ++i) {
      WorkItem item{samples[i], capture,
                    [&got, i](absl::StatusOr<SampleTensors> s) { got[i] = testing::Widen(s); }, nullptr};
      ASSERT_TRUE(batcher.Submit(std::move(item)).ok());
    }
  }
  for (size_t i = 0; i < samples.size(); ++i) {
    ASSERT_TRUE(got[i].ok()) << got[i].status();
    const std::vector<testing::FloatStates> solo = ::hsx::testing::RunBatch(**engine, {samples[i]});
    ASSERT_EQ(solo.size(), 1u);
    EXPECT_TRUE(::hsx::testing::StatesMatch(
        absl::StrCat("sample ", i, " (", samples[i].size(), " tokens) from the batcher vs alone"), *got[i], solo[0]));
  }
}

}  // namespace
}  // namespace hsx
