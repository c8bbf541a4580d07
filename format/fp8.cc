// fp8.cc: e4m3 conversion, the scale rule and the row encoding. The loops
// are branch-free over uint32_t so that GCC vectorises them (-O3, see
// format/CMakeLists.txt).
#include "format/fp8.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstring>

namespace hsx {
namespace {

constexpr uint32_t kMinNormalBits = 0x3c800000u;  // 2^-6, e4m3's smallest normal
constexpr uint32_t kMaxBits = 0x43e00000u;        // 448

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// FloatToFp8E4m3 on bits, written for the vectoriser.
inline uint8_t ToE4m3(uint32_t u) {
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits.
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal (|x| < 2^-6): multiples of 2^-9; adding 2^23 rounds |x| * 512
  // to the nearest even integer (0..8; 8 is the smallest normal's bits).
  const uint32_t sub = Bits(FromBits(a) * 512.0f + 8388608.0f) - 0x4b000000u;
  const uint32_t m = a >= kMaxBits ? 0x7eu : (a < kMinNormalBits ? sub : normal);
  return static_cast<uint8_t>(sign | m);
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

// Row `t` as float32 into `wide`; the index of its first non-finite value or
// -1; its largest absolute value into *amax.
int64_t WidenRow(const void* src, ElementType type, int64_t t, int64_t hidden, float* wide, float* amax) {
  uint32_t* out = reinterpret_cast<uint32_t*>(wide);
  if (type == ElementType::kBf16) {
    const uint16_t* in = static_cast<const uint16_t*>(src) + t * hidden;
    for (int64_t i = 0; i < hidden; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
  } else {
    std::memcpy(out, static_cast<const float*>(src) + t * hidden, static_cast<size_t>(hidden) * 4);
  }
  uint32_t largest = 0;
  for (int64_t i = 0; i < hidden; ++i) largest = std::max(largest, out[i] & 0x7fffffffu);
  if (largest >= 0x7f800000u) {
    for (int64_t i = 0; i < hidden; ++i) {
      if ((out[i] & 0x7fffffffu) >= 0x7f800000u) return i;
    }
  }
  *amax = FromBits(largest);
  return -1;
}

}  // namespace

uint8_t FloatToFp8E4m3(float value) { return ToE4m3(Bits(value)); }

float Fp8E4m3ToFloat(uint8_t bits) { return Table()[bits]; }

float Fp8RowScale(float amax) {
  if (!(amax > 0)) return 1.0f;
  return std::max(amax / kFp8Max, FLT_MIN);
}

void EncodeFp8Row(const float* values, int64_t hidden, char* out) {
  float amax = 0;
  for (int64_t i = 0; i < hidden; ++i) amax = std::max(amax, std::fabs(values[i]));
  const float scale = Fp8RowScale(amax);
  std::memcpy(out, &scale, sizeof(scale));
  auto* payload = reinterpret_cast<uint8_t*>(out + kFp8ScaleBytes);
  for (int64_t i = 0; i < hidden; ++i) payload[i] = ToE4m3(Bits(values[i] / scale));
}

void DecodeFp8Row(const uint8_t* row, int64_t hidden, float* out) {
  float scale;
  std::memcpy(&scale, row, sizeof(scale));
  const std::array<float, 256>& table = Table();
  for (int64_t i = 0; i < hidden; ++i) out[i] = table[row[kFp8ScaleBytes + i]] * scale;
}

TensorFindings EncodeFp8Tensor(const void* src, ElementType type, int64_t tokens, int64_t hidden, char* dst,
                               ChecksumKind checksum) {
  TensorFindings result;
  result.checksum_kind = checksum;
  TensorHash hash(checksum);
  std::vector<float> wide(static_cast<size_t>(hidden));
  const int64_t row_bytes = hidden + kFp8ScaleBytes;
  for (int64_t t = 0; t < tokens; ++t) {
    float amax = 0;
    if (const int64_t bad = WidenRow(src, type, t, hidden, wide.data(), &amax); bad >= 0) {
      result.bad_index = t * hidden + bad;
      result.bad_value = wide[bad];
      break;
    }
    result.nonzero |= amax > 0;
    char* out = dst + t * row_bytes;
    EncodeFp8Row(wide.data(), hidden, out);
    hash.Update(out, static_cast<size_t>(row_bytes));
  }
  result.checksum = hash.Digest();
  return result;
}

int64_t CheckFp8Bytes(const void* bytes, int64_t count, bool* nonzero) {
  const auto* in = static_cast<const uint8_t*>(bytes);
  uint8_t largest = 0;
  for (int64_t i = 0; i < count; ++i) largest = std::max<uint8_t>(largest, in[i] & 0x7fu);
  *nonzero = *nonzero || largest != 0;
  if (largest != 0x7fu) return -1;
  for (int64_t i = 0; i < count; ++i) {
    if ((in[i] & 0x7fu) == 0x7fu) return i;
  }
  return -1;
}

}  // namespace hsx
