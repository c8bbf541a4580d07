// fp8_kernels_avx512.cc: the AVX-512 row loops of format/fp8_kernels.h.
// Each step divides 16 values by the scale (vdivps: the quotient is the
// same float32 as the scalar division's) and rounds the quotient's bits to
// e4m3 as FloatToFp8E4m3 does (kernels/fp8_e4m3.h, Fp8E4m3OfBits): normal quotients by
// adding the rounding bias and shifting, subnormal ones (below 2^-6) by a
// float add that rounds at 2^-9, selected by a mask, and saturation to 448 as
// a minimum (the normal code only grows with the magnitude). Row tails use
// masked loads and stores.
#include "format/fp8_kernels.h"

#include <algorithm>
#include <array>
#include <cstdint>

#include "format/fp8.h"

#if defined(__x86_64__) && defined(__GNUC__)
// GCC 12's AVX-512 headers start intrinsics from a deliberately uninitialised
// vector, which -O3 reports as a false -Wmaybe-uninitialized.
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#pragma GCC diagnostic pop
#define HSX_FP8_AVX512 1
#endif

namespace hsx {

#ifdef HSX_FP8_AVX512
namespace {

#define HSX_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

// e4m3 codes of 16 float32 quotients without their signs (0..0x7e, one a
// 32-bit lane).
HSX_AVX512 inline __m512i MagnitudeCodes(__m512 q) {
  // |q|, at most 448 (vrangeps 0b1010: the smaller magnitude, sign cleared).
  const __m512 m = _mm512_range_ps(q, _mm512_set1_ps(kFp8Max), 0x0a);
  const __m512i a = _mm512_castps_si512(m);
  // Normal: the rounding bias 0x7ffff, plus 1 where the lowest kept mantissa
  // bit (bit 20) is set, and the exponent's rebias (127 -> 7) in one constant.
  __m512i normal = _mm512_add_epi32(a, _mm512_set1_epi32(0x7ffff - (120 << 23)));
  normal = _mm512_mask_add_epi32(normal, _mm512_test_epi32_mask(a, _mm512_set1_epi32(1 << 20)), normal,
                                 _mm512_set1_epi32(1));
  normal = _mm512_srli_epi32(normal, 20);
  // Subnormal (below 2^-6): |q| * 512 + 2^23 rounds to the nearest even integer.
  const __m512 shifted = _mm512_fmadd_ps(m, _mm512_set1_ps(512.0f), _mm512_set1_ps(8388608.0f));
  const __mmask16 is_sub = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32(0x3c800000));
  return _mm512_mask_sub_epi32(normal, is_sub, _mm512_castps_si512(shifted), _mm512_set1_epi32(0x4b000000));
}

// The full codes (sign in bit 7) of 16 float32 quotients.
HSX_AVX512 inline __m512i E4m3Codes(__m512 q) {
  const __m512i sign = _mm512_srli_epi32(_mm512_castps_si512(q), 24);
  return _mm512_ternarylogic_epi32(MagnitudeCodes(q), sign, _mm512_set1_epi32(0x80), 0xf8);  // a | (b & c)
}

// The codes of 32 bf16 values `x` divided by `s`, one a 16-bit lane: the
// values widened by interleaving with zeros (lanes out of order within each
// 128-bit block, put back in order by the pack), the sign from the input.
HSX_AVX512 inline __m512i Bf16Codes(__m512i x, __m512 s) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i low = MagnitudeCodes(_mm512_div_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x)), s));
  const __m512i high = MagnitudeCodes(_mm512_div_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x)), s));
  const __m512i sign = _mm512_srli_epi16(x, 8);
  return _mm512_ternarylogic_epi32(_mm512_packus_epi32(low, high), sign, _mm512_set1_epi16(0x80), 0xf8);
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

HSX_AVX512 void QuantizeBf16(const uint16_t* in, int64_t n, float scale, uint8_t* out) {
  const __m512 s = _mm512_set1_ps(scale);
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512i codes = Bf16Codes(_mm512_loadu_si512(in + i), s);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi16_epi8(codes));
  }
  if (i < n) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1u);
    _mm512_mask_cvtepi16_storeu_epi8(out + i, m, Bf16Codes(_mm512_maskz_loadu_epi16(m, in + i), s));
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

// Dequantisation by a table: the row's 128 magnitudes (codes 0..127, by the
// portable loop, so the same bf16 bits), looked up 32 codes a step
// (vpermt2w over two 64-entry halves, chosen by bit 6), the sign (bit 7)
// moved to bf16's bit 15.
HSX_AVX512 inline __m512i Bf16Values(__m512i codes, const __m512i table[4]) {
  const __m512i low = _mm512_permutex2var_epi16(table[0], codes, table[1]);
  const __m512i high = _mm512_permutex2var_epi16(table[2], codes, table[3]);
  const __m512i magnitude = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), low, high);
  return _mm512_ternarylogic_epi32(magnitude, _mm512_slli_epi16(codes, 8), _mm512_set1_epi16(-0x8000), 0xf8);
}

HSX_AVX512 void DequantizeBf16(const uint8_t* in, int64_t n, float scale, uint16_t* out, bool uncached) {
  static constexpr std::array<uint8_t, 128> kCodes = [] {
    std::array<uint8_t, 128> codes{};
    for (int c = 0; c < 128; ++c) codes[c] = static_cast<uint8_t>(c);
    return codes;
  }();
  alignas(64) uint16_t magnitudes[128];
  PortableFp8Kernels().dequantize_bf16(kCodes.data(), 128, scale, magnitudes, false);
  __m512i table[4];
  for (int k = 0; k < 4; ++k) table[k] = _mm512_load_si512(magnitudes + 32 * k);
  int64_t i = 0;
  if (uncached) {  // streaming stores need a 64-byte boundary: the values before it are stored as usual
    const int64_t head = std::min<int64_t>(n, static_cast<int64_t>((-reinterpret_cast<uintptr_t>(out) & 63) / 2));
    if (head > 0) {
      const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << head) - 1u);
      const __m512i codes = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, in));
      _mm512_mask_storeu_epi16(out, m, Bf16Values(codes, table));
      i = head;
    }
  }
  for (; i + 32 <= n; i += 32) {
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)));
    if (uncached) {
      _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), Bf16Values(codes, table));
    } else {
      _mm512_storeu_si512(out + i, Bf16Values(codes, table));
    }
  }
  if (i < n) {
    const __mmask32 m = static_cast<__mmask32>((uint64_t{1} << (n - i)) - 1u);
    const __m512i codes = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(m, in + i));
    _mm512_mask_storeu_epi16(out + i, m, Bf16Values(codes, table));
  }
}

#undef HSX_AVX512

bool CpuHasAvx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
}

}  // namespace

const Fp8RowKernels* Avx512Fp8Kernels() {
  static const Fp8RowKernels kernels{"avx512", AbsMaxF32, AbsMaxBf16, QuantizeF32, QuantizeBf16, DequantizeBf16};
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
