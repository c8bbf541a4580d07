// cuda_test_util.h: what the CUDA tests share: why there is no device here,
// host bytes of a matrix, the tiny test model.
#ifndef HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
#define HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/cuda/cuda_backend.h"
#include "server/model/random_model.h"
#include "tests/unit/float_states.h"
#include "server/runtime/engine.h"

namespace hsx::testing {

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
    EXPECT_TRUE(solo[0].hidden_states == together[i].hidden_states && solo[0].final_norm == together[i].final_norm)
        << label << " sample " << i << " (" << samples[i].size() << " tokens)";
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

}  // namespace hsx::testing

#define HSX_SKIP_WITHOUT_CUDA()                                                       \
  do {                                                                              \
    if (const std::string hsx_why = ::hsx::testing::NoCudaDeviceReason(); !hsx_why.empty()) \
      GTEST_SKIP() << hsx_why;                                                      \
  } while (0)

#endif  // HSX_TESTS_CUDA_CUDA_TEST_UTIL_H_
