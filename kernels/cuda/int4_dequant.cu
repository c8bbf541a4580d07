// int4_dequant.cu: INT4 (pack-quantized) -> bfloat16 dequantization on the GPU.
//
// One thread per packed int32 word: it reads the word (8 weights) and its
// scale, and writes the 8 bfloat16 results with one 16-byte store. The math is
// the CPU reference's (kernels/cpu/int4_dequant.h), using the same bf16.h
// helpers, so results match it bit for bit (see int4_dequant.h for the NaN
// caveat). Do not build this file with --use_fast_math or -ftz=true: denormal
// scales must not be flushed.
#include "kernels/cuda/int4_dequant.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kernels/bf16.h"

namespace hsx {
namespace {

constexpr int kBlockSize = 256;
constexpr int64_t kMaxBlocksX = 1 << 16;  // the grid-stride loop covers the rest

// Dequantizes packed word `word` (row-major over [rows, cols / 8]) of one
// weight and stores its 8 outputs with one 16-byte store. Host and device, so
// the per-word math can also be checked without a GPU.
HSX_HOST_DEVICE void DequantWord(const int32_t* __restrict__ packed,
                                 const uint16_t* __restrict__ scale, uint16_t* __restrict__ out,
                                 int64_t word, int64_t words_per_row, int64_t groups_per_row,
                                 uint32_t group_size) {
  const int64_t row = word / words_per_row;
  const uint32_t col0 = static_cast<uint32_t>(word - row * words_per_row) * 8;  // cols < 2^31
  const uint32_t bits = static_cast<uint32_t>(packed[word]);
  const uint16_t* scale_row = scale + row * groups_per_row;

  // With group_size % 8 == 0 (every real checkpoint) the 8 weights share one
  // scale; otherwise each looks up its own. The branch is uniform per launch.
  const bool one_scale = group_size % 8 == 0;
  float s = Bf16ToFloat(scale_row[col0 / group_size]);
  uint32_t pairs[4] = {0, 0, 0, 0};
  for (uint32_t i = 0; i < 8; ++i) {
    if (!one_scale) s = Bf16ToFloat(scale_row[(col0 + i) / group_size]);
    const int q = static_cast<int>((bits >> (4 * i)) & 0xFu) - 8;
    const uint32_t w = FloatToBf16(static_cast<float>(q) * s);
    pairs[i / 2] |= w << (16 * (i % 2));  // the lower column in the low half
  }
  reinterpret_cast<uint4*>(out)[word] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}

__global__ void DequantInt4Kernel(const int32_t* __restrict__ packed,
                                  const uint16_t* __restrict__ scale, uint16_t* __restrict__ out,
                                  int64_t total_words, int64_t words_per_row,
                                  int64_t groups_per_row, uint32_t group_size) {
  for (int64_t word = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       word < total_words; word += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    DequantWord(packed, scale, out, word, words_per_row, groups_per_row, group_size);
  }
}

// blockIdx.y selects the weight.
__global__ void DequantInt4BatchedKernel(const int32_t* const* __restrict__ packed,
                                         const uint16_t* const* __restrict__ scale,
                                         uint16_t* const* __restrict__ out, int64_t total_words,
                                         int64_t words_per_row, int64_t groups_per_row,
                                         uint32_t group_size) {
  const int32_t* p = packed[blockIdx.y];
  const uint16_t* s = scale[blockIdx.y];
  uint16_t* o = out[blockIdx.y];
  for (int64_t word = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
       word < total_words; word += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    DequantWord(p, s, o, word, words_per_row, groups_per_row, group_size);
  }
}

bool ValidShape(int64_t rows, int64_t cols, int64_t group_size) {
  return rows >= 0 && cols > 0 && cols <= INT32_MAX && cols % 8 == 0 && group_size > 0 &&
         cols % group_size == 0;
}

unsigned int BlocksFor(int64_t total_words) {
  return static_cast<unsigned int>(
      std::min<int64_t>((total_words + kBlockSize - 1) / kBlockSize, kMaxBlocksX));
}

}  // namespace

int LaunchDequantizeInt4(const int32_t* packed, const uint16_t* scale, int64_t rows,
                         int64_t cols, int64_t group_size, uint16_t* out,
                         CUstream_st* stream) {
  if (!ValidShape(rows, cols, group_size)) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  if (packed == nullptr || scale == nullptr || out == nullptr) return cudaErrorInvalidValue;
  // cudaErrorInvalidValue, not cudaErrorMisalignedAddress: that code is one of
  // the sticky errors (cuda_errors.h), and the backend would report a rejected
  // argument as a lost device.
  if (reinterpret_cast<uintptr_t>(out) % 16 != 0) return cudaErrorInvalidValue;
  const int64_t words_per_row = cols / 8;
  const int64_t total_words = rows * words_per_row;
  DequantInt4Kernel<<<BlocksFor(total_words), kBlockSize, 0, stream>>>(
      packed, scale, out, total_words, words_per_row, cols / group_size,
      static_cast<uint32_t>(group_size));
  return cudaGetLastError();
}

int LaunchDequantizeInt4Batched(const int32_t* const* packed, const uint16_t* const* scale,
                                uint16_t* const* out, int64_t count, int64_t rows,
                                int64_t cols, int64_t group_size, CUstream_st* stream) {
  if (!ValidShape(rows, cols, group_size) || count < 0 || count > 65535) {
    return cudaErrorInvalidValue;
  }
  if (rows == 0 || count == 0) return cudaSuccess;
  if (packed == nullptr || scale == nullptr || out == nullptr) return cudaErrorInvalidValue;
  const int64_t words_per_row = cols / 8;
  const int64_t total_words = rows * words_per_row;
  const dim3 grid(BlocksFor(total_words), static_cast<unsigned int>(count));
  DequantInt4BatchedKernel<<<grid, kBlockSize, 0, stream>>>(
      packed, scale, out, total_words, words_per_row, cols / group_size,
      static_cast<uint32_t>(group_size));
  return cudaGetLastError();
}

}  // namespace hsx
