// cuda_test_util.h: what the CUDA tests share: why there is no device here,
// host bytes of a matrix, the tiny test model.
#ifndef HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
#define HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "tests/common/value_comparison.h"
#include "server/model/random_model.h"
#include "tests/unit/float_states.h"
#include "server/runtime/engine.h"

namespace hsx::testing {

// HSX_TEST_SHAPES=small: the GPU tests use fewer and shorter samples and
// smaller GEMM batches, so that they finish under compute-sanitizer (10-100x
// slower kernels) and in a detail rerun (scripts/device_check: --from-report).
// Every check still runs; only sizes shrink.
inline bool SmallShapes() {
  const char* value = std::getenv("HSX_TEST_SHAPES");
  return value != nullptr && std::string(value) == "small";
}

// `normal`, or `small` under HSX_TEST_SHAPES=small.
inline int64_t TestSize(int64_t normal, int64_t small) { return SmallShapes() ? small : normal; }

// Empty when a CUDA device is usable, else "no CUDA device: <CUDA's reason>".
inline std::string NoCudaDeviceReason() {
  absl::StatusOr<int> count = CudaDeviceCount();
  return count.ok() ? std::string() : std::string(count.status().message());
}

// Host bytes of `values` as `type` (bf16 rounds).
inline std::vector<char> Encode(const std::vector<float>& values, ElementType type) {
  std::vector<char> bytes(values.size() * ElementSize(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == ElementType::kF32) {
      std::memcpy(&bytes[i * 4], &values[i], 4);
    } else {
      const uint16_t bits = FloatToBf16(values[i]);
      std::memcpy(&bytes[i * 2], &bits, 2);
    }
  }
  return bytes;
}

inline std::vector<float> Decode(const std::vector<char>& bytes, ElementType type) {
  std::vector<float> values(bytes.size() / ElementSize(type));
  for (size_t i = 0; i < values.size(); ++i) {
    if (type == ElementType::kF32) {
      std::memcpy(&values[i], &bytes[i * 4], 4);
    } else {
      uint16_t bits;
      std::memcpy(&bits, &bytes[i * 2], 2);
      values[i] = Bf16ToFloat(bits);
    }
  }
  return values;
}

// The whole-model tests' model: the tiny preset with 4 layers and a vocabulary
// of 512, `heads` attention heads.
inline ModelConfig TinyTestConfig(int64_t heads = 4) {
  ModelConfig config = *PresetConfig("tiny");
  config.num_hidden_layers = 4;
  config.vocab_size = 512;
  config.num_attention_heads = heads;
  config.num_key_value_heads = heads;
  return config;
}

// Writes a random checkpoint of `config` (generator seed `seed`) to `dir` and
// opens it; null, with a test failure, on error.
inline Checkpoint* WriteTestCheckpoint(const ModelConfig& config, const std::string& dir, uint64_t seed) {
  GeneratorOptions options;
  options.seed = seed;
  const absl::Status written = WriteRandomCheckpoint(config, dir, options);
  EXPECT_TRUE(written.ok()) << written;
  if (!written.ok()) return nullptr;
  absl::StatusOr<std::unique_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  EXPECT_TRUE(checkpoint.ok()) << checkpoint.status();
  return checkpoint.ok() ? checkpoint->release() : nullptr;
}

// Runs `samples` as one batch on `engine`, capturing every layer and the final
// norm; one FloatStates per sample (empty, with a test failure, on error).
inline std::vector<FloatStates> RunBatch(Engine& engine, const std::vector<std::vector<int32_t>>& samples) {
  Batch batch;
  for (const auto& s : samples) batch.AddSample(s);
  const CaptureSpec capture = CaptureSpec::All(static_cast<int>(engine.config().num_hidden_layers), true);
  absl::StatusOr<Captures> captures = engine.Run(batch, capture);
  EXPECT_TRUE(captures.ok()) << captures.status();
  if (!captures.ok()) return {};
  return SplitBySample(*captures, batch.cu_seqlens);
}

// One sample's captures and final norm against another's, bitwise or within
// tolerance (tests/common/value_comparison.h): a failure names `label`, the
// tensor ([tokens, layers, hidden] or [tokens, hidden]) and the elements at fault.
inline ::testing::AssertionResult StatesMatch(const std::string& label, const FloatStates& got,
                                              const FloatStates& want, double tolerance = 0) {
  const ComparedValues captures{absl::StrCat(label, ": hidden_states"),
                                {want.tokens, static_cast<int64_t>(want.capture_ids.size()), want.hidden}, "fp32"};
  ::testing::AssertionResult result = ValuesMatch(captures, got.hidden_states, want.hidden_states, tolerance);
  if (!result) return result;
  return ValuesMatch({absl::StrCat(label, ": final_norm"), {want.final_norm.empty() ? 0 : want.tokens, want.hidden},
                      "fp32"},
                     got.final_norm, want.final_norm, tolerance);
}

// Runs `samples` as one batch and then each alone, and expects every
// sample's states bitwise equal both ways (the contract's batch-invariance
// rule); `label` names the case in a failure.
inline void ExpectBatchedEqualsSolo(Engine& engine, const std::vector<std::vector<int32_t>>& samples,
                                    const std::string& label) {
  const std::vector<FloatStates> together = RunBatch(engine, samples);
  ASSERT_EQ(together.size(), samples.size());
  for (size_t i = 0; i < samples.size(); ++i) {
    const std::vector<FloatStates> solo = RunBatch(engine, {samples[i]});
    ASSERT_EQ(solo.size(), 1u);
    EXPECT_TRUE(StatesMatch(absl::StrCat(label, " sample ", i, " of ", samples.size(), " (", samples[i].size(),
                                         " tokens) in the batch vs alone"),
                            together[i], solo[0]));
  }
}

// Relative L2 error of each captured layer (and the final norm) of one sample.
inline std::vector<double> LayerErrors(const FloatStates& got, const FloatStates& want) {
  std::vector<double> errors;
  const size_t layer = static_cast<size_t>(want.hidden);
  const size_t layers = want.capture_ids.size();
  for (size_t l = 0; l <= layers; ++l) {
    double diff = 0, norm = 0;
    for (int64_t t = 0; t < want.tokens; ++t) {
      for (size_t c = 0; c < layer; ++c) {
        const size_t i = l < layers ? (t * layers + l) * layer + c : t * layer + c;
        const float g = l < layers ? got.hidden_states[i] : got.final_norm[i];
        const float w = l < layers ? want.hidden_states[i] : want.final_norm[i];
        diff += (double(g) - w) * (double(g) - w);
        norm += double(w) * w;
      }
    }
    errors.push_back(std::sqrt(diff / std::max(norm, 1e-30)));
  }
  return errors;
}

// The values of capture l (l == capture_ids.size(): the final norm) of one
// sample, [tokens, hidden].
inline std::vector<float> CaptureValues(const FloatStates& states, size_t l) {
  const size_t layers = states.capture_ids.size();
  if (l == layers) return states.final_norm;
  std::vector<float> values;
  values.reserve(static_cast<size_t>(states.tokens * states.hidden));
  for (int64_t t = 0; t < states.tokens; ++t) {
    const auto row = states.hidden_states.begin() + (t * static_cast<int64_t>(layers) + l) * states.hidden;
    values.insert(values.end(), row, row + states.hidden);
  }
  return values;
}

// Expects every captured layer's relative L2 error within `tolerance`; each
// layer that is not says so with its error and, element by element at the same
// relative tolerance, which values are at fault. Returns the worst error.
inline double ExpectLayersWithinL2(const std::string& label, const FloatStates& got, const FloatStates& want,
                                   double tolerance) {
  const std::vector<double> errors = LayerErrors(got, want);
  double worst = 0;
  for (size_t l = 0; l < errors.size(); ++l) {
    worst = std::max(worst, errors[l]);
    if (errors[l] <= tolerance) continue;
    const bool final_norm = l == want.capture_ids.size();
    const std::string what = final_norm ? "final_norm" : absl::StrCat("capture id ", want.capture_ids[l]);
    const Mismatches found = FindMismatches(CaptureValues(got, l), CaptureValues(want, l), tolerance);
    ADD_FAILURE() << label << ", " << what << ": relative L2 error " << errors[l] << " > " << tolerance << "; "
                  << DescribeMismatches({absl::StrCat(label, " ", what), {want.tokens, want.hidden}, "fp32"}, found);
  }
  return worst;
}

}  // namespace hsx::testing

#define HSX_SKIP_WITHOUT_CUDA()                                                       \
  do {                                                                              \
    if (const std::string hsx_why = ::hsx::testing::NoCudaDeviceReason(); !hsx_why.empty()) \
      GTEST_SKIP() << hsx_why;                                                      \
  } while (0)

#endif  // HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
