// fp16.h: float32 -> IEEE half conversion (round to nearest even), for output
// tensors requested as fp16. Host only.
#ifndef HSX_KERNELS_FP16_H_
#define HSX_KERNELS_FP16_H_

#include <cstdint>
#include <cstring>

namespace hsx {

inline uint16_t FloatToHalf(float value) {
  uint32_t x;
  std::memcpy(&x, &value, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0));
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // subnormal half (or zero)
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
    const int shift = 126 - static_cast<int>(abs >> 23);  // 14..24
    const uint32_t half = mantissa >> shift;
    const uint32_t rest = mantissa & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    const uint32_t rounded = half + ((rest > halfway || (rest == halfway && (half & 1))) ? 1 : 0);
    return static_cast<uint16_t>(sign | rounded);
  }
  const uint32_t rebased = abs - 0x38000000u;  // exponent 127 -> 15
  const uint32_t half = rebased >> 13;
  const uint32_t rest = rebased & 0x1fffu;
  const uint32_t rounded = half + ((rest > 0x1000u || (rest == 0x1000u && (half & 1))) ? 1 : 0);
  return static_cast<uint16_t>(sign | rounded);
}

}  // namespace hsx

#endif  // HSX_KERNELS_FP16_H_
