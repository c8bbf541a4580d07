// fp8_kernels_test.cc: the AVX-512 row loops (format/fp8_kernels.h) give the
// bytes of the scalar contract, FloatToFp8E4m3(value / scale) (which
// fp8_test.cc checks against a nearest-value search): for every finite bf16
// value under a set of scales, for random float32 values and scales, at every
// row tail length (writing nothing past the row), and for the largest
// |value|, the dequantisation and the whole tensor encoder against the
// portable loops. Skipped where the CPU lacks AVX-512.
#include "format/fp8_kernels.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "format/fp8.h"
#include "format/uncached_copy.h"

namespace hsx {
namespace {

float FromBits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Every finite bf16 bit pattern (both signs, zeros and subnormals included).
std::vector<uint16_t> AllFiniteBf16() {
  std::vector<uint16_t> v;
  for (uint32_t b = 0; b < 0x10000u; ++b) {
    if ((b & 0x7f80u) != 0x7f80u) v.push_back(static_cast<uint16_t>(b));
  }
  return v;
}

// Scales the encoder can choose (amax / 448, FLT_MIN, 1) and a few more.
std::vector<float> Scales() {
  std::vector<float> s = {1.0f, FLT_MIN, 448.0f / 448.0f, 3.0f / 448.0f, 0.0123f / 448.0f, 1e30f / 448.0f,
                          FLT_MAX / 448.0f, 0.5f, 0.1f, 1.0f / 3.0f, 7.0f, 2e-30f};
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> exponent(-40.0f, 40.0f);
  for (int i = 0; i < 12; ++i) s.push_back(std::exp2(exponent(rng)) * 1.2345f);
  return s;
}

#define SKIP_WITHOUT_AVX512() \
  if (Avx512Fp8Kernels() == nullptr) GTEST_SKIP() << "no AVX-512 on this CPU"

TEST(Fp8KernelsTest, EveryBf16ValueUnderEachScale) {
  SKIP_WITHOUT_AVX512();
  const Fp8RowKernels& k = *Avx512Fp8Kernels();  // after SKIP_WITHOUT_AVX512
  const std::vector<uint16_t> in = AllFiniteBf16();
  std::vector<uint32_t> wide(in.size());
  for (size_t i = 0; i < in.size(); ++i) wide[i] = uint32_t{in[i]} << 16;
  std::vector<uint8_t> got_bf16(in.size()), got_f32(in.size());
  for (float scale : Scales()) {
    k.quantize_bf16(in.data(), static_cast<int64_t>(in.size()), scale, got_bf16.data());
    k.quantize_f32(wide.data(), static_cast<int64_t>(wide.size()), scale, got_f32.data());
    int wrong = 0;
    for (size_t i = 0; i < in.size() && wrong < 5; ++i) {
      const uint8_t want = FloatToFp8E4m3(FromBits(wide[i]) / scale);
      if (got_bf16[i] != want || got_f32[i] != want) {
        ++wrong;
        ADD_FAILURE() << "bf16 0x" << std::hex << in[i] << " scale " << scale << ": want 0x" << int{want}
                      << ", bf16 loop 0x" << int{got_bf16[i]} << ", f32 loop 0x" << int{got_f32[i]};
      }
    }
  }
}

TEST(Fp8KernelsTest, RandomFloat32ValuesAndScales) {
  SKIP_WITHOUT_AVX512();
  const Fp8RowKernels& k = *Avx512Fp8Kernels();  // after SKIP_WITHOUT_AVX512
  std::mt19937 rng(11);
  std::vector<uint32_t> in(1 << 16);
  std::vector<uint8_t> got(in.size());
  for (int round = 0; round < 8; ++round) {
    for (uint32_t& u : in) {
      do u = static_cast<uint32_t>(rng()); while ((u & 0x7f800000u) == 0x7f800000u);
    }
    // A row's own scale (so quotients fill [-448, 448]) and a random one.
    const float amax = FromBits(PortableFp8Kernels().abs_max_f32(in.data(), static_cast<int64_t>(in.size())));
    for (float scale : {Fp8RowScale(amax), FromBits((static_cast<uint32_t>(rng()) & 0x7effffffu) | 0x00800000u)}) {
      k.quantize_f32(in.data(), static_cast<int64_t>(in.size()), scale, got.data());
      for (size_t i = 0; i < in.size(); ++i) {
        ASSERT_EQ(got[i], FloatToFp8E4m3(FromBits(in[i]) / scale)) << "bits 0x" << std::hex << in[i] << " scale " << scale;
      }
    }
  }
}

TEST(Fp8KernelsTest, EveryTailLengthWritesOnlyTheRow) {
  SKIP_WITHOUT_AVX512();
  const Fp8RowKernels& k = *Avx512Fp8Kernels();  // after SKIP_WITHOUT_AVX512
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  for (int64_t n = 0; n <= 80; ++n) {
    std::vector<uint32_t> f32(n + 1);
    std::vector<uint16_t> bf16(n + 1);
    for (int64_t i = 0; i <= n; ++i) {
      uint32_t u;
      const float x = normal(rng);
      std::memcpy(&u, &x, sizeof(u));
      f32[i] = u;
      bf16[i] = static_cast<uint16_t>(u >> 16);
    }
    // Unaligned input (offset 1) and output with guard bytes after the row.
    std::vector<uint8_t> a(n + 16, 0xcc), b(n + 16, 0xcc);
    k.quantize_f32(f32.data() + 1, n, 0.01f, a.data());
    k.quantize_bf16(bf16.data() + 1, n, 0.01f, b.data());
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(a[i], FloatToFp8E4m3(FromBits(f32[i + 1]) / 0.01f)) << "n " << n << " i " << i;
      ASSERT_EQ(b[i], FloatToFp8E4m3(FromBits(uint32_t{bf16[i + 1]} << 16) / 0.01f)) << "n " << n << " i " << i;
    }
    for (int64_t i = n; i < n + 16; ++i) ASSERT_TRUE(a[i] == 0xcc && b[i] == 0xcc) << "n " << n << " wrote " << i;
    EXPECT_EQ(k.abs_max_f32(f32.data() + 1, n), PortableFp8Kernels().abs_max_f32(f32.data() + 1, n)) << n;
    EXPECT_EQ(k.abs_max_bf16(bf16.data() + 1, n), PortableFp8Kernels().abs_max_bf16(bf16.data() + 1, n)) << n;
  }
}

TEST(Fp8KernelsTest, AbsMaxSeesTheLargestAndNonFiniteValuesAnywhere) {
  SKIP_WITHOUT_AVX512();
  const Fp8RowKernels& k = *Avx512Fp8Kernels();  // after SKIP_WITHOUT_AVX512
  for (int64_t n : {1, 31, 32, 33, 100, 7168}) {
    for (int64_t at : {int64_t{0}, n / 2, n - 1}) {
      for (uint32_t special : {0xc2f60000u, 0x7f800000u, 0xffc00000u, 0x00010000u}) {  // -123, inf, NaN, tiny
        std::vector<uint32_t> f32(n, 0x80000000u);  // -0
        std::vector<uint16_t> bf16(n, 0x8000u);  // -0
        f32[at] = special;
        bf16[at] = static_cast<uint16_t>(special >> 16);
        EXPECT_EQ(k.abs_max_f32(f32.data(), n), special & 0x7fffffffu) << n << " " << at;
        EXPECT_EQ(k.abs_max_bf16(bf16.data(), n), special & 0x7fff0000u) << n << " " << at;
      }
    }
  }
}

TEST(Fp8KernelsTest, DequantizationGivesThePortableValues) {
  SKIP_WITHOUT_AVX512();
  const Fp8RowKernels& k = *Avx512Fp8Kernels();  // after SKIP_WITHOUT_AVX512
  // Every code, in rows of every length up to 300 (tails), under scales
  // small, large and subnormal-making; guard values after the row.
  std::vector<uint8_t> codes(300);
  for (size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<uint8_t>(i * 37 + i / 256);
  // Uncached, also into every alignment (the streaming stores start at the
  // first 64-byte boundary).
  for (float scale : {1.0f, 0.0123f, 3.7e5f, 1e-37f, FLT_MIN, 7.6e34f}) {
    for (int64_t n = 0; n <= 300; n += (n < 70 ? 1 : 23)) {
      std::vector<uint16_t> slow(n + 32, 0xcccc);
      PortableFp8Kernels().dequantize_bf16(codes.data(), n, scale, slow.data(), false);
      for (const bool uncached : {false, true}) {
        for (size_t shift = 0; shift < (uncached ? 32u : 1u); ++shift) {
          alignas(64) uint16_t fast[300 + 64];
          std::fill(std::begin(fast), std::end(fast), 0xcccc);
          k.dequantize_bf16(codes.data(), n, scale, fast + shift, uncached);
          FenceUncachedCopies();
          ASSERT_TRUE(std::equal(slow.begin(), slow.end(), fast + shift))
              << "scale " << scale << " n " << n << " uncached " << uncached << " shift " << shift;
          ASSERT_TRUE(std::all_of(fast, fast + shift, [](uint16_t v) { return v == 0xcccc; }));
        }
      }
    }
  }
}

TEST(Fp8KernelsTest, TensorEncoderGivesThePortableBytes) {
  SKIP_WITHOUT_AVX512();
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const int64_t tokens = 9, hidden = 7168 + 5;
  std::vector<float> f32(tokens * hidden);
  std::vector<uint16_t> bf16(f32.size());
  for (size_t i = 0; i < f32.size(); ++i) {
    f32[i] = normal(rng) * std::exp2(static_cast<float>(i / hidden) * 4.0f - 20.0f);
    uint32_t u;
    std::memcpy(&u, &f32[i], sizeof(u));
    bf16[i] = static_cast<uint16_t>(u >> 16);
  }
  for (int row = 0; row < hidden; ++row) f32[3 * hidden + row] = 0.0f;  // a row of zeros
  for (auto [src, type] : {std::pair<const void*, ElementType>{f32.data(), ElementType::kF32},
                           std::pair<const void*, ElementType>{bf16.data(), ElementType::kBf16}}) {
    std::string fast(tokens * (hidden + kFp8ScaleBytes), '\0'), slow = fast;
    const TensorFindings a =
        EncodeFp8TensorWith(*Avx512Fp8Kernels(), src, type, tokens, hidden, fast.data(), ChecksumKind::kXxh3);
    const TensorFindings b =
        EncodeFp8TensorWith(PortableFp8Kernels(), src, type, tokens, hidden, slow.data(), ChecksumKind::kXxh3);
    EXPECT_TRUE(fast == slow);
    EXPECT_EQ(a.checksum, b.checksum);
    EXPECT_EQ(a.nonzero, b.nonzero);
    EXPECT_EQ(a.bad_index, -1);
  }
  EXPECT_STREQ(BestFp8Kernels().name, "avx512");
}

}  // namespace
}  // namespace hsx
