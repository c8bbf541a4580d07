// encoding.cc: dtype conversion and hashing.
#include "format/encoding.h"

#include <cstring>

#include <xxhash.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "format/fp8.h"
#include "kernels/bf16.h"
#include "kernels/fp16.h"

namespace hsx {
namespace {

float HalfToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mantissa <<= 1;
      } while ((mantissa & 0x400u) == 0);
      bits = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mantissa & 0x3ffu) << 13;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | mantissa << 13;
  } else {
    bits = sign | (exponent + 112) << 23 | mantissa << 13;
  }
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

}  // namespace

absl::StatusOr<OutputDType> ParseOutputDType(const std::string& name) {
  if (name == "bf16" || name == "bfloat16") return OutputDType::kBf16;
  if (name == "fp16" || name == "float16") return OutputDType::kFp16;
  if (name == "fp32" || name == "float32") return OutputDType::kFp32;
  if (name == "fp8" || name == "fp8_e4m3" || name == "float8_e4m3fn") return OutputDType::kFp8;
  return absl::InvalidArgumentError(absl::StrCat("dtype '", name, "': expected bf16, fp16, fp32 or fp8"));
}

std::string OutputDTypeName(OutputDType dtype) {
  switch (dtype) {
    case OutputDType::kBf16: return "bf16";
    case OutputDType::kFp16: return "fp16";
    case OutputDType::kFp32: return "fp32";
    case OutputDType::kFp8: return "fp8";
  }
  return "?";
}

DType ToSafetensorsDType(OutputDType dtype) {
  switch (dtype) {
    case OutputDType::kBf16: return DType::kBF16;
    case OutputDType::kFp16: return DType::kF16;
    case OutputDType::kFp32: return DType::kF32;
    case OutputDType::kFp8: return DType::kF8E4M3;
  }
  return DType::kF32;
}

int64_t OutputDTypeSize(OutputDType dtype) {
  return dtype == OutputDType::kFp32 ? 4 : dtype == OutputDType::kFp8 ? 1 : 2;
}

int64_t RowBytes(OutputDType dtype, int64_t hidden) {
  return hidden * OutputDTypeSize(dtype) + (dtype == OutputDType::kFp8 ? kFp8ScaleBytes : 0);
}

void AppendEncoded(std::span<const float> values, OutputDType dtype, std::string* out) {
  const size_t start = out->size();
  out->resize(start + RowBytes(dtype, static_cast<int64_t>(values.size())));
  EncodeValues(values, dtype, out->data() + start);
}

void EncodeValues(std::span<const float> values, OutputDType dtype, char* dst) {
  if (dtype == OutputDType::kFp8) {
    EncodeFp8Row(values.data(), static_cast<int64_t>(values.size()), dst);
    return;
  }
  if (dtype == OutputDType::kFp32) {
    std::memcpy(dst, values.data(), values.size() * sizeof(float));
    return;
  }
  for (size_t i = 0; i < values.size(); ++i) {
    const uint16_t half = dtype == OutputDType::kBf16 ? FloatToBf16(values[i]) : FloatToHalf(values[i]);
    std::memcpy(dst + 2 * i, &half, 2);
  }
}

std::vector<float> DecodeValues(std::span<const uint8_t> bytes, OutputDType dtype) {
  if (dtype == OutputDType::kFp8) {
    if (bytes.size() < static_cast<size_t>(kFp8ScaleBytes)) return {};
    std::vector<float> row(bytes.size() - kFp8ScaleBytes);
    DecodeFp8Row(bytes.data(), static_cast<int64_t>(row.size()), row.data());
    return row;
  }
  const size_t count = bytes.size() / OutputDTypeSize(dtype);
  std::vector<float> values(count);
  if (dtype == OutputDType::kFp32) {
    std::memcpy(values.data(), bytes.data(), count * sizeof(float));
    return values;
  }
  for (size_t i = 0; i < count; ++i) {
    uint16_t half;
    std::memcpy(&half, bytes.data() + 2 * i, 2);
    values[i] = dtype == OutputDType::kBf16 ? Bf16ToFloat(half) : HalfToFloat(half);
  }
  return values;
}

uint64_t Xxh64(const void* data, size_t size) { return XXH64(data, size, 0); }

std::string Xxh64Hex(const void* data, size_t size) { return absl::StrFormat("%016x", Xxh64(data, size)); }

uint64_t TokenIdsHash(std::span<const int32_t> token_ids) {
  std::vector<int64_t> wide(token_ids.begin(), token_ids.end());
  return Xxh64(wide.data(), wide.size() * sizeof(int64_t));
}

}  // namespace hsx
