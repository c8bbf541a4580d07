// fp8_kernels_avx512.cc: the AVX-512 row loops of format/fp8_kernels.h.
// Each step divides 16 values by the scale (vdivps: the quotient is the
// same float32 as the scalar division's) and rounds the quotient's bits to
// e4m3 as FloatToFp8E4m3 does (format/fp8.cc, ToE4m3): normal quotients by
// adding the rounding bias and shifting, subnormal ones (below 2^-6) by a
// float add that rounds at 2^-9, selected by a mask, and saturation to 448 as
// a minimum (the normal code only grows with the magnitude). Row tails use
// masked loads and stores.
#include "format/fp8_kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers start intrinsics from a deliberately uninitialised
// vector, which -O3 reports as a false -Wmaybe-uninitialized.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#define HSX_FP8_AVX512 1
#endif

namespace hsx {

#ifdef HSX_FP8_AVX512
namespace {

#define HSX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// e4m3 codes (in the low byte of each lane) of 16 float32 quotients.
HSX_AVX512 inline __m512i E4m3Codes(__m512 q) {
  const __m512i u = _mm512_castps_si512(q);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i a = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, 20), _mm512_set1_epi32(1));
  __m512i normal = _mm512_add_epi32(_mm512_add_epi32(a, _mm512_set1_epi32(0x7ffff)), odd);
  normal = _mm512_sub_epi32(_mm512_srli_epi32(normal, 20), _mm512_set1_epi32(120 << 3));
  normal = _mm512_min_epu32(normal, _mm512_set1_epi32(0x7e));
  const __m512 shifted = _mm512_add_ps(_mm512_mul_ps(_mm512_castsi512_ps(a), _mm512_set1_ps(512.0f)),
                                       _mm512_set1_ps(8388608.0f));
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(shifted), _mm512_set1_epi32(0x4b000000));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000));
  return _mm512_or_si512(_mm512_mask_blend_epi32(is_sub, normal, sub), sign);
}

// The largest of 16 unsigned lanes (stored and scanned: GCC 12's reduction
// intrinsics warn about their own uninitialised temporaries).
HSX_AVX512 inline uint32_t MaxLane(__m512i v) {
  alignas(64) uint32_t lanes[16];
  _mm512_store_si512(lanes, v);
  uint32_t largest = 0;
  for (uint32_t lane : lanes) largest = lane > largest ? lane : largest;
  return largest;
}

HSX_AVX512 inline __mmask16 TailMask(int64_t left) {
  return left >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << left) - 1u);
}

HSX_AVX512 void QuantizeF32(const uint32_t* in, int64_t n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 q = _mm512_div_ps(_mm512_loadu_ps(in + i), s);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(E4m3Codes(q)));
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    const __m512 q = _mm512_div_ps(_mm512_maskz_loadu_ps(m, in + i), s);
    _mm512_mask_cvtepi32_storeu_epi8(out + i, m, E4m3Codes(q));
  }
}

HSX_AVX512 inline __m512 WidenBf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

HSX_AVX512 void QuantizeBf16(const uint16_t* in, int64_t n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = WidenBf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(E4m3Codes(_mm512_div_ps(x, s))));
  }
  if (i < n) {
    const __mmask16 m = TailMask(n - i);
    const __m512 x = WidenBf16(_mm256_maskz_loadu_epi16(m, in + i));
    _mm512_mask_cvtepi32_storeu_epi8(out + i, m, E4m3Codes(_mm512_div_ps(x, s)));
  }
}

HSX_AVX512 uint32_t AbsMaxF32(const uint32_t* in, int64_t n) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  __m512i largest = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    largest = _mm512_max_epu32(largest, _mm512_and_si512(_mm512_loadu_si512(in + i), magnitude));
  }
  if (i < n) {
    const __m512i v = _mm512_maskz_loadu_epi32(TailMask(n - i), in + i);
    largest = _mm512_max_epu32(largest, _mm512_and_si512(v, magnitude));
  }
  return MaxLane(largest);
}

HSX_AVX512 uint32_t AbsMaxBf16(const uint16_t* in, int64_t n) {
  const __m512i magnitude = _mm512_set1_epi16(0x7fff);
  __m512i largest = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    largest = _mm512_max_epu16(largest, _mm512_and_si512(_mm512_loadu_si512(in + i), magnitude));
  }
  if (i < n) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1u);
    largest = _mm512_max_epu16(largest, _mm512_and_si512(_mm512_maskz_loadu_epi16(m, in + i), magnitude));
  }
  // The larger 16-bit half of each 32-bit lane; bf16 bits are float32's top half.
  const __m512i halves = _mm512_max_epu32(_mm512_srli_epi32(largest, 16),
                                          _mm512_and_si512(largest, _mm512_set1_epi32(0xffff)));
  return MaxLane(halves) << 16;
}

#undef HSX_AVX512

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

}  // namespace

const Fp8RowKernels* Avx512Fp8Kernels() {
  static const Fp8RowKernels kernels{"avx512", AbsMaxF32, AbsMaxBf16, QuantizeF32, QuantizeBf16};
  static const bool available = CpuHasAvx512();
  return available ? &kernels : nullptr;
}

#else

const Fp8RowKernels* Avx512Fp8Kernels() { return nullptr; }

#endif  // HSX_FP8_AVX512

const Fp8RowKernels& BestFp8Kernels() {
  static const Fp8RowKernels& best = Avx512Fp8Kernels() ? *Avx512Fp8Kernels() : PortableFp8Kernels();
  return best;
}

}  // namespace hsx
