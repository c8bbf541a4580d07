// tensor_encoding.cc: the block loops. Each loop accumulates its checks as
// integer ORs (no early exit), which is what lets it vectorise; a block that
// failed is rescanned to find the first bad value.
#include "format/tensor_encoding.h"

#include <algorithm>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#include "format/fp8.h"
#include "kernels/fp16.h"

// The loops are built for AVX-512 (x86-64-v4: F, BW, VL, ...) and AVX2 as well
// as the baseline, picked at load time (GCC function multiversioning): two and
// four times the baseline's vector width where the CPU has them. With the
// AVX-512 clone hsx-dump --discard cost 0.89-0.95x its CPU per byte with AVX2
// alone (bench/dump_ab.py, docs/BENCHMARKS.md); the server, whose check of
// rows in place waits on memory, gained nothing measurable.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define HSX_VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define HSX_VECTOR_CLONES
#endif

namespace hsx {
namespace {

constexpr uint32_t kF32Inf = 0x7f800000u;   // |bits| at or above: inf or NaN
constexpr uint32_t kFp16Limit = 0x477ff000u;  // 65520.0f: rounds to fp16 inf
constexpr uint32_t kBf16Limit = 0x7f7f8000u;  // rounds to bf16 inf (ties to even from bf16's largest)

// float32 bits -> bf16, round to nearest even (FloatToBf16 for every non-NaN).
// Returns the OR of "bad" flags; ORs |bits| into *nonzero.
HSX_VECTOR_CLONES uint32_t F32ToBf16(const uint32_t* in, int64_t n, uint16_t* out, uint32_t limit, uint32_t* nonzero) {
  uint32_t bad = 0, nz = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = in[i];
    const uint32_t a = u & 0x7fffffffu;
    bad |= a >= limit;
    nz |= a;
    out[i] = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  *nonzero |= nz;
  return bad;
}

HSX_VECTOR_CLONES uint32_t CheckF32(const uint32_t* in, int64_t n, uint32_t limit, uint32_t* nonzero) {
  uint32_t bad = 0, nz = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t a = in[i] & 0x7fffffffu;
    bad |= a >= limit;
    nz |= a;
  }
  *nonzero |= nz;
  return bad;
}

// bf16 -> bf16 is the identity (a bf16 value rounds to itself): copy and check.
HSX_VECTOR_CLONES uint32_t CopyBf16(const uint16_t* in, int64_t n, uint16_t* out, uint32_t* nonzero) {
  uint16_t bad = 0, nz = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t h = in[i];
    const uint16_t a = h & 0x7fffu;
    bad |= a >= 0x7f80u;
    nz |= a;
    out[i] = h;
  }
  *nonzero |= nz;
  return bad;
}

HSX_VECTOR_CLONES void WidenBf16(const uint16_t* in, int64_t n, uint32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(in[i]) << 16;
}

void F32ToFp16Scalar(const uint32_t* in, int64_t n, uint16_t* out) {
  for (int64_t i = 0; i < n; ++i) {
    float v;
    std::memcpy(&v, &in[i], sizeof(v));
    out[i] = FloatToHalf(v);
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
// F16C's conversion rounds to nearest even, subnormal results included, as
// FloatToHalf does; the values reaching here are finite and below 65520
// (checked first), where the two agree bit for bit (the tests compare them).
__attribute__((target("avx,f16c"))) void F32ToFp16F16c(const uint32_t* in, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(reinterpret_cast<const float*>(in + i));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  F32ToFp16Scalar(in + i, n - i, out + i);
}

// F16C from CPUID leaf 1 (clang's __builtin_cpu_supports does not know
// "f16c"); "avx" also says the OS saves the YMM registers.
bool HasF16c() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __builtin_cpu_supports("avx") && __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_F16C) != 0;
}

void F32ToFp16(const uint32_t* in, int64_t n, uint16_t* out) {
  static const bool f16c = HasF16c();
  if (f16c) {
    F32ToFp16F16c(in, n, out);
  } else {
    F32ToFp16Scalar(in, n, out);
  }
}
#else
void F32ToFp16(const uint32_t* in, int64_t n, uint16_t* out) { F32ToFp16Scalar(in, n, out); }
#endif

// The receiver's checks read values where they arrived, at any byte offset
// (a value may start at an odd address in a gRPC slice): loaded with memcpy,
// which the vectoriser turns into unaligned loads, not through a cast.
uint16_t Load16(const unsigned char* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

uint32_t Load32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Encoded 16-bit values (bf16: exponent 0x7f80; fp16: 0x7c00). A value is
// non-finite when all its exponent bits are set; since v & exponent never
// exceeds exponent, the largest v & exponent equals it exactly when some value
// is. A running maximum and a running OR are one instruction each per vector
// (a compare into a mask and a masked merge were three): 0.022 against 0.028
// CPU-ns per byte over 16 KiB in cache (AVX-512, docs/BENCHMARKS.md).
HSX_VECTOR_CLONES uint32_t CheckHalfBits(const unsigned char* in, int64_t n, uint16_t exponent, uint32_t* nonzero) {
  uint16_t largest = 0, any = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t v = Load16(in + 2 * i);
    largest = std::max<uint16_t>(largest, v & exponent);
    any |= v;
  }
  *nonzero |= any & 0x7fffu;
  return largest == exponent;
}

// fp32 values, as CheckHalfBits.
HSX_VECTOR_CLONES uint32_t CheckFloatBits(const unsigned char* in, int64_t n, uint32_t* nonzero) {
  uint32_t largest = 0, any = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t v = Load32(in + 4 * i);
    largest = std::max<uint32_t>(largest, v & 0x7f800000u);
    any |= v;
  }
  *nonzero |= any & 0x7fffffffu;
  return largest == 0x7f800000u;
}


}  // namespace

int64_t CheckEncoded(const void* bytes, int64_t count, OutputDType dtype, bool* nonzero) {
  if (dtype == OutputDType::kFp8) return CheckFp8Bytes(bytes, count, nonzero);
  const auto* in = static_cast<const unsigned char*>(bytes);
  uint32_t nz = 0;
  uint32_t bad;
  const uint16_t exponent = dtype == OutputDType::kBf16 ? 0x7f80u : 0x7c00u;
  // The common case (all fine) takes one vectorised pass; a bad value is then located.
  if (dtype == OutputDType::kFp32) {
    bad = CheckFloatBits(in, count, &nz);
  } else {
    bad = CheckHalfBits(in, count, exponent, &nz);
  }
  *nonzero = *nonzero || nz != 0;
  if (!bad) return -1;
  for (int64_t i = 0; i < count; ++i) {
    if (dtype == OutputDType::kFp32) {
      if ((Load32(in + 4 * i) & 0x7f800000u) == 0x7f800000u) return i;
    } else if ((Load16(in + 2 * i) & exponent) == exponent) {
      return i;
    }
  }
  return -1;
}

TensorChecker::TensorChecker(OutputDType dtype, ChecksumKind checksum) : dtype_(dtype), hash_(checksum) {}

void TensorChecker::Update(const void* values, int64_t count) {
  const int64_t size = OutputDTypeSize(dtype_);
  for (int64_t begin = 0; begin < count && bad_index_ < 0; begin += kEncodeBlock) {
    const int64_t n = std::min(kEncodeBlock, count - begin);
    const auto* block = static_cast<const unsigned char*>(values) + begin * size;
    const uint32_t bad = dtype_ == OutputDType::kFp32 ? CheckFloatBits(block, n, &nonzero_)
                                                      : CheckHalfBits(block, n, 0x7f80u, &nonzero_);
    if (bad) {  // rare: locate the value, the stream fails
      bool ignored = false;
      const int64_t i = CheckEncoded(block, n, dtype_, &ignored);
      const uint32_t u = dtype_ == OutputDType::kFp32 ? Load32(block + 4 * i) : uint32_t{Load16(block + 2 * i)} << 16;
      bad_index_ = fed_ + begin + i;
      std::memcpy(&bad_value_, &u, sizeof(u));
      break;
    }
    hash_.Update(block, n * size);
  }
  fed_ += count;
}

TensorFindings TensorChecker::Finish() const {
  TensorFindings result;
  result.nonzero = nonzero_ != 0;
  result.bad_index = bad_index_;
  result.bad_value = bad_value_;
  result.checksum_kind = hash_.kind();
  result.checksum = hash_.Digest();
  return result;
}

bool SentAsIs(ElementType type, OutputDType dtype) {
  return (type == ElementType::kBf16 && dtype == OutputDType::kBf16) ||
         (type == ElementType::kF32 && dtype == OutputDType::kFp32);
}

OutputDType DTypeOfRows(ElementType type) {
  return type == ElementType::kBf16 ? OutputDType::kBf16 : OutputDType::kFp32;
}

ElementType RowsOfDType(OutputDType dtype) {
  return dtype == OutputDType::kBf16 ? ElementType::kBf16 : ElementType::kF32;
}

TensorFindings CheckTensor(const void* src, int64_t count, OutputDType dtype, ChecksumKind checksum) {
  TensorChecker checker(dtype, checksum);
  checker.Update(src, count);
  return checker.Finish();
}

TensorFindings EncodeTensor(const void* src, ElementType type, int64_t count, OutputDType dtype, char* dst,
                            ChecksumKind checksum) {
  TensorFindings result;
  TensorHash hash(checksum);
  const uint32_t limit = dtype == OutputDType::kFp16 ? kFp16Limit : dtype == OutputDType::kBf16 ? kBf16Limit : kF32Inf;
  const int64_t out_size = OutputDTypeSize(dtype);
  alignas(64) uint32_t wide[kEncodeBlock];
  uint32_t nonzero = 0;
  for (int64_t begin = 0; begin < count; begin += kEncodeBlock) {
    const int64_t n = std::min(kEncodeBlock, count - begin);
    char* out = dst + begin * out_size;
    // The block as float32 bits: in place for f32 input, widened for bf16.
    const uint32_t* bits = wide;
    uint32_t bad = 0;
    if (type == ElementType::kBf16) {
      const uint16_t* in = static_cast<const uint16_t*>(src) + begin;
      if (dtype == OutputDType::kBf16) {
        bad = CopyBf16(in, n, reinterpret_cast<uint16_t*>(out), &nonzero);
      } else {
        WidenBf16(in, n, wide);
      }
    } else {
      bits = static_cast<const uint32_t*>(src) + begin;
    }
    if (!(type == ElementType::kBf16 && dtype == OutputDType::kBf16)) {
      switch (dtype) {
        case OutputDType::kBf16:
          bad = F32ToBf16(bits, n, reinterpret_cast<uint16_t*>(out), limit, &nonzero);
          break;
        case OutputDType::kFp16:
          bad = CheckF32(bits, n, limit, &nonzero);
          if (!bad) F32ToFp16(bits, n, reinterpret_cast<uint16_t*>(out));
          break;
        case OutputDType::kFp32:
          bad = CheckF32(bits, n, limit, &nonzero);
          std::memcpy(out, bits, n * 4);
          break;
        case OutputDType::kFp8:  // rows with scales: EncodeFp8Tensor (fp8.h)
          break;
      }
    }
    if (bad) {
      // Find the first bad value of the block (rare: the stream fails).
      for (int64_t i = 0; i < n; ++i) {
        uint32_t u;
        if (type == ElementType::kBf16) {
          u = static_cast<uint32_t>(static_cast<const uint16_t*>(src)[begin + i]) << 16;
        } else {
          u = bits[i];
        }
        if ((u & 0x7fffffffu) >= limit) {
          result.bad_index = begin + i;
          std::memcpy(&result.bad_value, &u, sizeof(u));
          break;
        }
      }
      break;
    }
    hash.Update(out, n * out_size);
  }
  result.nonzero = nonzero != 0;
  result.checksum_kind = checksum;
  result.checksum = hash.Digest();
  return result;
}

}  // namespace hsx
