// test_values.h: values and byte helpers the format tests share (header-only,
// for tests): floats that exercise every rounding case of the output dtypes,
// their AppendEncoded bytes, and a ByteBuffer's bytes in one string.
#ifndef HSX_FORMAT_TEST_VALUES_H_
#define HSX_FORMAT_TEST_VALUES_H_

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <grpcpp/support/byte_buffer.h>
#include <gtest/gtest.h>

#include "format/encoding.h"

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

}  // namespace hsx::testing

#endif  // HSX_FORMAT_TEST_VALUES_H_
