// bf16.h: bfloat16 <-> float32 conversion shared by the CPU and CUDA code.
//
// bfloat16 is stored as its raw 16 bits (uint16_t) so that host code needs no
// CUDA headers. Rounding is round-to-nearest-even with NaN preserved, which is
// what PyTorch's `tensor.to(torch.bfloat16)` does; the HF reference rounds at
// exactly these points, so matching it bit for bit starts here.
#ifndef HSX_KERNELS_BF16_H_
#define HSX_KERNELS_BF16_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HSX_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HSX_HOST_DEVICE inline
#endif

namespace hsx {

HSX_HOST_DEVICE float Bf16ToFloat(uint16_t bits) {
  uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
#if defined(__CUDA_ARCH__)
  value = __uint_as_float(word);
#else
  std::memcpy(&value, &word, sizeof(value));
#endif
  return value;
}

HSX_HOST_DEVICE uint16_t FloatToBf16(float value) {
  uint32_t word;
#if defined(__CUDA_ARCH__)
  word = __float_as_uint(value);
#else
  std::memcpy(&word, &value, sizeof(word));
#endif
  if ((word & 0x7f800000u) == 0x7f800000u && (word & 0x007fffffu) != 0) {
    return static_cast<uint16_t>((word >> 16) | 0x0040u);  // quiet NaN
  }
  const uint32_t rounding_bias = 0x7fffu + ((word >> 16) & 1u);
  return static_cast<uint16_t>((word + rounding_bias) >> 16);
}

// Rounds a float to the nearest bfloat16 and returns it as a float.
HSX_HOST_DEVICE float RoundToBf16(float value) { return Bf16ToFloat(FloatToBf16(value)); }

}  // namespace hsx

#endif  // HSX_KERNELS_BF16_H_
