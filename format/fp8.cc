// fp8.cc: e4m3 conversion and the row encoding, by the rounding rule of
// kernels/fp8_e4m3.h (the one definition, which the CUDA capture kernel uses
// too). The loops are branch-free over uint32_t so that GCC vectorises them
// (-O3, see format/CMakeLists.txt); they are the portable set of
// format/fp8_kernels.h, which the encoder uses where the CPU lacks AVX-512.
#include "format/fp8.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>

#include "format/fp8_kernels.h"

// As in tensor_encoding.cc: AVX-512 and AVX2 clones of the row loops beside
// the baseline, picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HSX_FP8_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define HSX_FP8_CLONES
#endif

namespace hsx {
namespace {

uint32_t Bits(float f) { return Fp8FloatBits(f); }
float FromBits(uint32_t u) { return Fp8BitsFloat(u); }

// The largest |value| of n float32 values (as bits: for finite values the
// integer order is the float order).
HSX_FP8_CLONES uint32_t AbsMaxBits(const uint32_t* in, int64_t n) {
  uint32_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max(largest, in[i] & 0x7fffffffu);
  return largest;
}

// The largest e4m3 magnitude code (sign cleared) of n codes: 0x7f when one
// is NaN. The receivers' check of every streamed byte, hence the clones.
HSX_FP8_CLONES uint8_t LargestFp8Magnitude(const uint8_t* in, int64_t n) {
  uint8_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint8_t>(largest, in[i] & 0x7fu);
  return largest;
}

HSX_FP8_CLONES void QuantizeRow(const uint32_t* in, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fp8Quantize(FromBits(in[i]), scale);
}

// The same two loops over bf16 rows, widened on the fly.
HSX_FP8_CLONES uint32_t AbsMaxBf16Bits(const uint16_t* in, int64_t n) {
  uint16_t largest = 0;
  for (int64_t i = 0; i < n; ++i) largest = std::max<uint16_t>(largest, in[i] & 0x7fffu);
  return static_cast<uint32_t>(largest) << 16;
}

HSX_FP8_CLONES void QuantizeBf16Row(const uint16_t* in, int64_t n, float scale, uint8_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = Fp8Quantize(FromBits(static_cast<uint32_t>(in[i]) << 16), scale);
}

// e4m3 bytes times `scale`, as bf16. The byte's exponent and mantissa bits
// shifted into float32's (<< 20) read as 2^(e - 127) (1 + m / 8), or for
// e = 0 as the subnormal m 2^-129; either times 2^120 is the e4m3 value.
HSX_FP8_CLONES void DequantizeRow(const uint8_t* in, int64_t n, float scale, uint16_t* out, bool /*uncached*/) {
  const float factor = 0x1p120f;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = in[i];
    const float magnitude = FromBits((b & 0x7fu) << 20) * factor;
    const uint32_t u = Bits(magnitude * scale) | ((b & 0x80u) << 24);
    out[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

// A row of finite values whose largest |value| is `amax`, encoded into `out`.
void EncodeRow(const uint32_t* bits, int64_t hidden, float amax, char* out) {
  const float scale = Fp8RowScale(amax);
  std::memcpy(out, &scale, sizeof(scale));
  BestFp8Kernels().quantize_f32(bits, hidden, scale, reinterpret_cast<uint8_t*>(out + kFp8ScaleBytes));
}

std::array<float, 256> MakeTable() {
  std::array<float, 256> t{};
  for (int b = 0; b < 256; ++b) {
    const int exponent = (b >> 3) & 0xf, mantissa = b & 7;
    float v = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                            : std::ldexp(1.0f + mantissa / 8.0f, exponent - 7);
    if ((b & 0x7f) == 0x7f) v = NAN;
    t[b] = (b & 0x80) ? -v : v;
  }
  return t;
}

const std::array<float, 256>& Table() {
  static const std::array<float, 256> table = MakeTable();
  return table;
}

// Row `t` of `src` (kBf16 or kF32): the largest |value|'s float32 bits
// (inf or NaN bits when some value is not finite).
uint32_t RowAbsMaxBits(const Fp8RowKernels& k, const void* src, ElementType type, int64_t t, int64_t hidden) {
  return type == ElementType::kBf16 ? k.abs_max_bf16(static_cast<const uint16_t*>(src) + t * hidden, hidden)
                                    : k.abs_max_f32(static_cast<const uint32_t*>(src) + t * hidden, hidden);
}

// Value i of row t as float32.
float RowValue(const void* src, ElementType type, int64_t t, int64_t hidden, int64_t i) {
  if (type == ElementType::kBf16) return FromBits(uint32_t{static_cast<const uint16_t*>(src)[t * hidden + i]} << 16);
  return static_cast<const float*>(src)[t * hidden + i];
}

}  // namespace

const Fp8RowKernels& PortableFp8Kernels() {
  static const Fp8RowKernels kernels{"portable", AbsMaxBits, AbsMaxBf16Bits, QuantizeRow, QuantizeBf16Row,
                                     DequantizeRow};
  return kernels;
}

uint8_t FloatToFp8E4m3(float value) { return Fp8E4m3OfBits(Bits(value)); }

float Fp8E4m3ToFloat(uint8_t bits) { return Table()[bits]; }

void EncodeFp8Row(const float* values, int64_t hidden, char* out) {
  const auto* bits = reinterpret_cast<const uint32_t*>(values);
  EncodeRow(bits, hidden, FromBits(BestFp8Kernels().abs_max_f32(bits, hidden)), out);
}

void DecodeFp8Row(const uint8_t* row, int64_t hidden, float* out) {
  float scale;
  std::memcpy(&scale, row, sizeof(scale));
  const std::array<float, 256>& table = Table();
  for (int64_t i = 0; i < hidden; ++i) out[i] = table[row[kFp8ScaleBytes + i]] * scale;
}

void DequantizeFp8ToBf16(const uint8_t* values, const float* scales, int64_t count, int64_t hidden, uint16_t* out,
                         bool uncached) {
  const Fp8RowKernels& kernels = BestFp8Kernels();
  for (int64_t r = 0; r < count; ++r) {
    kernels.dequantize_bf16(values + r * hidden, hidden, scales[r], out + r * hidden, uncached);
  }
}

TensorFindings EncodeFp8Tensor(const void* src, ElementType type, int64_t tokens, int64_t hidden, char* dst,
                               ChecksumKind checksum) {
  return EncodeFp8TensorWith(BestFp8Kernels(), src, type, tokens, hidden, dst, checksum);
}

TensorFindings EncodeFp8TensorWith(const Fp8RowKernels& kernels, const void* src, ElementType type, int64_t tokens,
                                   int64_t hidden, char* dst, ChecksumKind checksum) {
  Fp8TensorEncoder encoder(type, hidden, checksum, dst, &kernels);
  encoder.Update(src, tokens);
  return encoder.Finish();
}

Fp8TensorEncoder::Fp8TensorEncoder(ElementType type, int64_t hidden, ChecksumKind checksum, char* dst,
                                   const Fp8RowKernels* kernels)
    : kernels_(kernels != nullptr ? *kernels : BestFp8Kernels()),
      type_(type),
      hidden_(hidden),
      dst_(dst),
      hash_(checksum) {}

void Fp8TensorEncoder::Update(const void* src, int64_t rows) {
  const int64_t row_bytes = hidden_ + kFp8ScaleBytes;
  for (int64_t t = 0; t < rows && bad_index_ < 0; ++t) {
    const uint32_t largest = RowAbsMaxBits(kernels_, src, type_, t, hidden_);
    if (largest >= 0x7f800000u) {  // rare: locate the value, the sample fails
      for (int64_t i = 0; i < hidden_; ++i) {
        const float v = RowValue(src, type_, t, hidden_, i);
        if (!std::isfinite(v)) {
          bad_index_ = (rows_ + t) * hidden_ + i;
          bad_value_ = v;
          break;
        }
      }
      break;
    }
    nonzero_ |= largest != 0;
    char* out = dst_ + (rows_ + t) * row_bytes;
    const float scale = Fp8RowScale(FromBits(largest));
    std::memcpy(out, &scale, sizeof(scale));
    auto* payload = reinterpret_cast<uint8_t*>(out + kFp8ScaleBytes);
    if (type_ == ElementType::kBf16) {
      kernels_.quantize_bf16(static_cast<const uint16_t*>(src) + t * hidden_, hidden_, scale, payload);
    } else {
      kernels_.quantize_f32(static_cast<const uint32_t*>(src) + t * hidden_, hidden_, scale, payload);
    }
    hash_.Update(out, static_cast<size_t>(row_bytes));
  }
  rows_ += rows;
}

TensorFindings Fp8TensorEncoder::Finish() const {
  TensorFindings result;
  result.checksum_kind = hash_.kind();
  result.checksum = hash_.Digest();
  result.nonzero = nonzero_;
  result.bad_index = bad_index_;
  result.bad_value = bad_value_;
  return result;
}

namespace {

// CheckFp8Tensor's loop; `hash` (may be null) takes every good row.
TensorFindings CheckFp8RowsInto(const void* rows, int64_t tokens, int64_t hidden, TensorHash* hash) {
  TensorFindings found;
  const int64_t row_bytes = hidden + kFp8ScaleBytes;
  for (int64_t t = 0; t < tokens && found.bad_index < 0; ++t) {
    const uint8_t* row = static_cast<const uint8_t*>(rows) + t * row_bytes;
    float scale;
    std::memcpy(&scale, row, sizeof(scale));
    const int64_t nan_at = CheckFp8Bytes(row + kFp8ScaleBytes, hidden, &found.nonzero);
    if (!ValidFp8Scale(scale)) {
      const bool marked = nan_at >= 0 && !std::isfinite(scale);  // the value was not finite
      found.bad_index = t * hidden + (marked ? nan_at : 0);
      found.bad_value = scale;
      found.bad_scale = !marked;
    } else if (nan_at >= 0) {
      found.bad_index = t * hidden + nan_at;
      found.bad_value = Fp8E4m3ToFloat(row[kFp8ScaleBytes + nan_at]);
    } else if (hash != nullptr) {
      hash->Update(row, static_cast<size_t>(row_bytes));
    }
  }
  return found;
}

}  // namespace

TensorFindings CheckFp8Tensor(const void* rows, int64_t tokens, int64_t hidden, ChecksumKind checksum) {
  TensorHash hash(checksum);
  TensorFindings found = CheckFp8RowsInto(rows, tokens, hidden, &hash);
  found.checksum_kind = hash.kind();
  found.checksum = hash.Digest();
  return found;
}

TensorFindings CheckFp8Rows(const void* rows, int64_t tokens, int64_t hidden) {
  return CheckFp8RowsInto(rows, tokens, hidden, nullptr);
}

int64_t CheckFp8Bytes(const void* bytes, int64_t count, bool* nonzero) {
  const auto* in = static_cast<const uint8_t*>(bytes);
  const uint8_t largest = LargestFp8Magnitude(in, count);
  *nonzero = *nonzero || largest != 0;
  if (largest != 0x7fu) return -1;
  for (int64_t i = 0; i < count; ++i) {
    if ((in[i] & 0x7fu) == 0x7fu) return i;
  }
  return -1;
}

}  // namespace hsx
