// fp8_e4m3.h: the fp8 rounding rule (docs/formats.md, "fp8"), defined once
// for host and device code: float32 to e4m3 (OCP "e4m3fn") rounded to
// nearest even with saturation to 448, and a row's scale. format/fp8.cc (the
// host encoder's loops; its AVX-512 twin is tested against them bit for bit)
// and the CUDA backend's capture kernel (kernels/cuda/fp8_rows.cu) both call
// these functions, so a row encodes to the same bytes on either side. On the
// device, value / scale must be IEEE float division: nvcc's default
// (-prec-div=true, no fast math, no flush to zero), which kernels/cuda keeps;
// the multiply-add below is exact, so FMA contraction cannot change it.
//
// An encoded row is its scale (4 bytes, little-endian float32) followed by
// one e4m3 byte per value: Fp8E4m3 of value / scale.
//
// A row holding a non-finite value has no encoding. Where a backend encodes
// rows (Backend::CopyToHostFp8) it marks such a row instead, so that every
// fp8 reader refuses it (the scale is not finite) and the host can still
// say which value it was: the scale is the row's first non-finite value
// itself (its float32 bits: inf, -inf or the NaN), and each value byte is
// kFp8NanByte where the value is non-finite, 0 elsewhere (EncodeFp8RowScalar).
#ifndef HSX_KERNELS_FP8_E4M3_H_
#define HSX_KERNELS_FP8_E4M3_H_

#include <cfloat>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define HSX_FP8_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HSX_FP8_HOST_DEVICE inline
#endif

namespace hsx {

inline constexpr float kFp8Max = 448.0f;         // e4m3's largest finite value
inline constexpr int64_t kFp8ScaleBytes = 4;     // before each row's values
inline constexpr uint8_t kFp8NanByte = 0x7f;     // e4m3 NaN (0xff is the other)
inline constexpr uint32_t kFp8MinNormalBits = 0x3c800000u;  // 2^-6, e4m3's smallest normal
inline constexpr uint32_t kFp8MaxBits = 0x43e00000u;        // 448

HSX_FP8_HOST_DEVICE uint32_t Fp8FloatBits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

HSX_FP8_HOST_DEVICE float Fp8BitsFloat(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

// True for the bits of an infinity or a NaN.
HSX_FP8_HOST_DEVICE bool Fp8NonFiniteBits(uint32_t u) { return (u & 0x7fffffffu) >= 0x7f800000u; }

// The e4m3 code of the finite float32 whose bits are `u`, rounded to nearest
// even; magnitudes of 448 or more give +-448 (0x7e, 0xfe). Branch-free (the
// three cases selected with masks) so that host loops vectorise.
HSX_FP8_HOST_DEVICE uint8_t Fp8E4m3OfBits(uint32_t u) {
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Normal: rebias the exponent (127 -> 7) and round the mantissa to 3 bits.
  const uint32_t normal = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
  // Subnormal (|x| < 2^-6): multiples of 2^-9; adding 2^23 rounds |x| * 512
  // (exact) to the nearest even integer (0..8; 8 is the smallest normal's bits).
  const uint32_t sub = Fp8FloatBits(Fp8BitsFloat(a) * 512.0f + 8388608.0f) - 0x4b000000u;
  const uint32_t is_sub = 0u - static_cast<uint32_t>(a < kFp8MinNormalBits);
  const uint32_t is_max = 0u - static_cast<uint32_t>(a >= kFp8MaxBits);
  const uint32_t m = (((sub & is_sub) | (normal & ~is_sub)) & ~is_max) | (0x7eu & is_max);
  return static_cast<uint8_t>(sign | m);
}

// The scale of a row whose largest absolute value is `amax` (finite, >= 0):
// amax / 448, at least FLT_MIN (the smallest normal float32), and 1 for a
// row of zeros. Always finite and positive.
HSX_FP8_HOST_DEVICE float Fp8RowScale(float amax) {
  if (!(amax > 0)) return 1.0f;
  const float scale = amax / kFp8Max;
  return scale < FLT_MIN ? FLT_MIN : scale;
}

// The stored byte of `value` (finite) in a row of scale `scale`.
HSX_FP8_HOST_DEVICE uint8_t Fp8Quantize(float value, float scale) { return Fp8E4m3OfBits(Fp8FloatBits(value / scale)); }

// One row of `n` values, their float32 bits given by load(i), encoded into
// `out` (kFp8ScaleBytes + n bytes, any alignment) by the rule above, a row
// with a non-finite value marked as the header says. The scalar form of what
// the CUDA capture kernel does in parallel; the CPU backend's CopyToHostFp8.
template <typename Load>
inline void EncodeFp8RowScalar(Load load, int64_t n, uint8_t* out) {
  uint32_t largest = 0;
  int64_t first_bad = -1;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = load(i);
    if (first_bad < 0 && Fp8NonFiniteBits(u)) first_bad = i;
    const uint32_t a = u & 0x7fffffffu;
    largest = a > largest ? a : largest;
  }
  uint8_t* values = out + kFp8ScaleBytes;
  if (first_bad >= 0) {
    const uint32_t bad = load(first_bad);
    std::memcpy(out, &bad, sizeof(bad));
    for (int64_t i = 0; i < n; ++i) values[i] = Fp8NonFiniteBits(load(i)) ? kFp8NanByte : 0;
    return;
  }
  const float scale = Fp8RowScale(Fp8BitsFloat(largest));
  std::memcpy(out, &scale, sizeof(scale));
  for (int64_t i = 0; i < n; ++i) values[i] = Fp8Quantize(Fp8BitsFloat(load(i)), scale);
}

}  // namespace hsx

#endif  // HSX_KERNELS_FP8_E4M3_H_
