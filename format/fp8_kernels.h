// fp8_kernels.h: the row loops of the fp8 encoding (format/fp8.h): the
// largest |value| of a row and the quantisation of a row by its scale, for
// float32 and bf16 rows, and the receiver's dequantisation of a row to bf16.
//
// Two sets that give the same results bit for bit: the portable one (plain
// loops that GCC vectorises, with AVX-512 and AVX2 clones) and an AVX-512
// one written with intrinsics (a division, then e4m3 rounding on the
// quotient's bits, 32 bf16 values a step; dequantisation through a table of
// the row's 128 magnitudes), which is faster (bench/fp8_encode_bench).
// BestFp8Kernels() is what EncodeFp8Tensor, EncodeFp8Row and
// DequantizeFp8ToBf16 use; the tests check the AVX-512 set against the
// scalar contract and the portable set.
#ifndef HSX_FORMAT_FP8_KERNELS_H_
#define HSX_FORMAT_FP8_KERNELS_H_

#include <cstdint>

#include "format/tensor_encoding.h"
#include "format/tensor_hash.h"

namespace hsx {

struct Fp8RowKernels {
  const char* name;
  // The largest |value| of n values as float32 bits (inf or NaN bits when a
  // value is not finite; for finite values the integer order is the float order).
  uint32_t (*abs_max_f32)(const uint32_t* in, int64_t n);
  uint32_t (*abs_max_bf16)(const uint16_t* in, int64_t n);
  // out[i] = FloatToFp8E4m3(value_i / scale) for n values.
  void (*quantize_f32)(const uint32_t* in, int64_t n, float scale, uint8_t* out);
  void (*quantize_bf16)(const uint16_t* in, int64_t n, float scale, uint8_t* out);
  // The receiving side: out[i] = bf16 of e4m3 in[i] times scale (what
  // DequantizeFp8ToBf16 does for each row). `uncached`: a hint to write
  // `out` with non-temporal stores (the AVX-512 loop does, from its first
  // 64-byte boundary on), which the caller must fence (FenceUncachedCopies,
  // format/uncached_copy.h) before another thread reads `out`.
  void (*dequantize_bf16)(const uint8_t* in, int64_t n, float scale, uint16_t* out, bool uncached);
};

const Fp8RowKernels& PortableFp8Kernels();
// Null where the CPU lacks AVX-512 (F, BW, DQ, VL) or the build is not for x86-64.
const Fp8RowKernels* Avx512Fp8Kernels();
// The AVX-512 set where there is one, else the portable set.
const Fp8RowKernels& BestFp8Kernels();

// EncodeFp8Tensor (format/fp8.h) with the given set (the tests and the bench).
TensorFindings EncodeFp8TensorWith(const Fp8RowKernels& kernels, const void* src, ElementType type, int64_t tokens,
                                   int64_t hidden, char* dst, ChecksumKind checksum);

}  // namespace hsx

#endif  // HSX_FORMAT_FP8_KERNELS_H_
