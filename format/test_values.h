// test_values.h: values and byte helpers the tests share (header-only, for
// tests): floats that exercise every rounding case of the output dtypes,
// their AppendEncoded bytes, a ByteBuffer's bytes in one string, the file
// layout of a sample's hidden states, and a sample's states as float32
// (FloatStates) to and from SampleTensors.
#ifndef HSX_FORMAT_TEST_VALUES_H_
#define HSX_FORMAT_TEST_VALUES_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "format/encoding.h"
#include "format/sample_encoding.h"
#include "format/sample_tensors.h"

namespace hsx::testing {

inline std::string Flatten(const grpc::ByteBuffer& buffer) {
  std::vector<grpc::Slice> slices;
  EXPECT_TRUE(buffer.Dump(&slices).ok());
  std::string out;
  for (const grpc::Slice& s : slices) out.append(reinterpret_cast<const char*>(s.begin()), s.size());
  return out;
}

// Values that exercise rounding: ties, subnormals, signed zeros, large ones.
inline std::vector<float> TrickyValues(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) {
    switch (i % 8) {
      case 0: {  // a bf16 tie: low half exactly 0x8000
        uint32_t bits = (rng() & 0x3fff0000u) | 0x8000u;
        std::memcpy(&v[i], &bits, 4);
        break;
      }
      case 1: v[i] = (i % 16 == 1) ? -0.0f : 0.0f; break;
      case 2: v[i] = std::ldexp(normal(rng), -130); break;  // float subnormal
      case 3: v[i] = std::ldexp(normal(rng), -20); break;   // fp16 subnormal range
      case 4: v[i] = 60000.0f + normal(rng); break;         // near fp16's top
      case 5: {  // an fp16 tie: the 13 bits fp16 drops are exactly half
        uint32_t bits = ((0x38800000u + rng() % 0x0e000000u) & ~0x1fffu) | 0x1000u | (rng() & 0x80000000u);
        std::memcpy(&v[i], &bits, 4);
        break;
      }
      default: v[i] = normal(rng); break;
    }
  }
  return v;
}

inline std::string Encoded(const std::vector<float>& values, OutputDType dtype) {
  std::string out;
  AppendEncoded(values, dtype, &out);
  return out;
}

// Rows of `hidden` values encoded one by one (what fp8 needs: a scale per row).
inline std::string EncodedRows(const std::vector<float>& values, int64_t hidden, OutputDType dtype) {
  if (dtype != OutputDType::kFp8 || hidden < 1) return Encoded(values, dtype);
  std::string out;
  for (size_t at = 0; at < values.size(); at += static_cast<size_t>(hidden)) {
    AppendEncoded(std::span<const float>(values.data() + at, static_cast<size_t>(hidden)), dtype, &out);
  }
  return out;
}

// Tensors of [T, H] rows of `row_bytes` each, as the file's [T, L, H]
// hidden_states holds them: row t of every tensor, then row t + 1.
inline std::string InterleaveRows(const std::vector<std::string>& tensors, int64_t row_bytes) {
  std::string out;
  const size_t row = static_cast<size_t>(row_bytes);
  const size_t rows = tensors.empty() || row == 0 ? 0 : tensors[0].size() / row;
  for (size_t t = 0; t < rows; ++t) {
    for (const std::string& tensor : tensors) out.append(tensor, t * row, row);
  }
  return out;
}

// The sample's hidden states as the file holds them, [T, L, H].
inline std::string FileHiddenStates(const SampleTensors& sample) {
  std::vector<std::string> layers;
  for (size_t l = 0; l < sample.capture_ids.size(); ++l) layers.push_back(TensorString(sample.tensors[l]));
  return InterleaveRows(layers, sample.row_bytes());
}

// A sample's states as float32 values, for tests that compare values.
struct FloatStates {
  std::vector<int> capture_ids;
  int64_t tokens = 0;
  int64_t hidden = 0;
  std::vector<float> hidden_states;  // [tokens, capture_ids.size(), hidden]
  std::vector<float> final_norm;     // [tokens, hidden], empty unless captured
};

inline std::vector<float> TensorValues(const SampleTensor& tensor, OutputDType dtype, int64_t hidden = 0) {
  const std::string bytes = TensorString(tensor);
  if (dtype == OutputDType::kFp8) {  // row by row: each has its scale
    std::vector<float> out;
    const size_t row = static_cast<size_t>(RowBytes(dtype, hidden));
    for (size_t at = 0; at + row <= bytes.size(); at += row) {
      const std::vector<float> v =
          DecodeValues(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()) + at, row), dtype);
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }
  return DecodeValues(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), dtype);
}

// The sample's values, widened to float32 (exact from bf16 and fp16).
inline FloatStates Widen(const SampleTensors& sample) {
  FloatStates out;
  out.capture_ids = sample.capture_ids;
  out.tokens = sample.tokens;
  out.hidden = sample.hidden;
  const int64_t n = static_cast<int64_t>(sample.capture_ids.size());
  out.hidden_states.resize(static_cast<size_t>(sample.tokens * n * sample.hidden));
  for (int64_t l = 0; l < n; ++l) {
    const std::vector<float> values = TensorValues(sample.tensors[l], sample.dtype, sample.hidden);
    for (int64_t t = 0; t < sample.tokens; ++t) {
      std::copy_n(values.begin() + t * sample.hidden, sample.hidden,
                  out.hidden_states.begin() + (t * n + l) * sample.hidden);
    }
  }
  if (sample.has_final_norm()) out.final_norm = TensorValues(sample.tensors.back(), sample.dtype, sample.hidden);
  return out;
}

inline absl::StatusOr<FloatStates> Widen(const absl::StatusOr<SampleTensors>& sample) {
  if (!sample.ok()) return sample.status();
  return Widen(*sample);
}

// `states` encoded into `dtype` (AppendEncoded) as a SampleTensors that owns
// its bytes: each tensor one piece, unchecked.
inline SampleTensors EncodeStates(const FloatStates& states, OutputDType dtype) {
  SampleTensors out;
  out.capture_ids = states.capture_ids;
  out.tokens = states.tokens;
  out.hidden = states.hidden;
  out.dtype = dtype;
  auto blocks = std::make_shared<std::vector<std::string>>();
  const size_t n = states.capture_ids.size();
  for (size_t l = 0; l < n; ++l) {
    std::vector<float> rows;
    for (int64_t t = 0; t < states.tokens; ++t) {
      const auto row = states.hidden_states.begin() + (t * n + l) * states.hidden;
      rows.insert(rows.end(), row, row + states.hidden);
    }
    blocks->push_back(EncodedRows(rows, states.hidden, dtype));
  }
  if (!states.final_norm.empty()) blocks->push_back(EncodedRows(states.final_norm, states.hidden, dtype));
  for (size_t k = 0; k < blocks->size(); ++k) out.AddTensor(k < n ? states.capture_ids[k] : -1, (*blocks)[k].data());
  for (const std::string& block : *blocks) out.held_bytes += static_cast<int64_t>(block.size());
  out.owner = std::move(blocks);
  return out;
}

// Plain heap memory for EncodeSample and ResponseEncoder, counting what it
// hands out in `*allocations` when given.
inline BufferAllocator HeapBuffers(int* allocations = nullptr) {
  struct Heap : HostBuffer {
    explicit Heap(size_t n) : bytes_(n, '\0') {}
    void* data() const override { return const_cast<char*>(bytes_.data()); }
    size_t bytes() const override { return bytes_.size(); }
    std::string bytes_;
  };
  return [allocations](size_t bytes) -> absl::StatusOr<std::unique_ptr<HostBuffer>> {
    if (allocations != nullptr) ++*allocations;
    return std::unique_ptr<HostBuffer>(new Heap(bytes));
  };
}

}  // namespace hsx::testing

#endif  // HSX_FORMAT_TEST_VALUES_H_
