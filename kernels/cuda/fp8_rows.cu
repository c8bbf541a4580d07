// fp8_rows.cu: the capture copy's fp8 encoding on the device
// (Backend::CopyToHostFp8): per row its largest |value|, its scale and its
// e4m3 bytes, by the functions of kernels/fp8_e4m3.h, which the host encoder
// calls too, so the bytes are the CPU's (EncodeFp8RowScalar). The division
// value / scale is IEEE float division (nvcc's default; this directory uses
// no fast math), and -fmad=false contracts nothing.
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/device_matrix.cuh"
#include "kernels/cuda/ops.h"
#include "kernels/fp8_e4m3.h"

namespace hsx::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

// Value c of row r as float32 bits (a bf16 value widened exactly).
__device__ __forceinline__ uint32_t Bits(const DeviceMatrix& m, int64_t r, int64_t c) {
  const int64_t i = r * m.ld + c;
  return m.bf16 ? static_cast<uint32_t>(static_cast<const uint16_t*>(m.data)[i]) << 16
                : static_cast<const uint32_t*>(m.data)[i];
}

// One block per row (grid-stride over rows). Pass 1 reduces the row's
// largest |value| (as bits: for finite values the integer order is the float
// order) and its first non-finite column (cols: none); pass 2 writes the
// scale and the bytes, reading the row again from cache.
__global__ void __launch_bounds__(kThreads) Fp8RowsKernel(DeviceMatrix src, uint8_t* __restrict__ dst) {
  __shared__ uint32_t warp_largest[kWarps];
  __shared__ uint32_t warp_first_bad[kWarps];
  const uint32_t cols = static_cast<uint32_t>(src.cols);
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  for (int64_t r = blockIdx.x; r < src.rows; r += gridDim.x) {
    uint32_t largest = 0;
    uint32_t first_bad = cols;
    for (uint32_t c = threadIdx.x; c < cols; c += kThreads) {
      const uint32_t u = Bits(src, r, c);
      largest = max(largest, u & 0x7fffffffu);
      if (Fp8NonFiniteBits(u)) first_bad = min(first_bad, c);
    }
    largest = __reduce_max_sync(0xffffffffu, largest);
    first_bad = __reduce_min_sync(0xffffffffu, first_bad);
    if (lane == 0) {
      warp_largest[warp] = largest;
      warp_first_bad[warp] = first_bad;
    }
    __syncthreads();
    for (int w = 0; w < kWarps; ++w) {
      largest = max(largest, warp_largest[w]);
      first_bad = min(first_bad, warp_first_bad[w]);
    }
    __syncthreads();  // every thread has read the slots before the next row writes them
    const bool bad = first_bad < cols;
    // A marked row's scale is its first non-finite value, bit for bit.
    const uint32_t scale_bits = bad ? Bits(src, r, first_bad) : Fp8FloatBits(Fp8RowScale(Fp8BitsFloat(largest)));
    const float scale = Fp8BitsFloat(scale_bits);
    uint8_t* out = dst + r * (static_cast<int64_t>(cols) + kFp8ScaleBytes);
    if (threadIdx.x < kFp8ScaleBytes) out[threadIdx.x] = static_cast<uint8_t>(scale_bits >> (8 * threadIdx.x));
    for (uint32_t c = threadIdx.x; c < cols; c += kThreads) {
      const uint32_t u = Bits(src, r, c);
      out[kFp8ScaleBytes + c] =
          bad ? (Fp8NonFiniteBits(u) ? kFp8NanByte : uint8_t{0}) : Fp8Quantize(Fp8BitsFloat(u), scale);
    }
  }
}

__global__ void Fp8QuantizeKernel(const uint16_t* __restrict__ values, int64_t count, float scale,
                                  uint8_t* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Fp8Quantize(Bf16ToFloat(values[i]), scale);
  }
}

}  // namespace

int LaunchFp8Rows(DeviceMatrix src, void* dst, CUstream_st* stream) {
  if (src.rows < 1 || src.cols < 1) return cudaSuccess;
  Fp8RowsKernel<<<GridFor(src.rows, 1), kThreads, 0, stream>>>(src, static_cast<uint8_t*>(dst));
  return cudaGetLastError();
}

int LaunchFp8Quantize(const uint16_t* values, int64_t count, float scale, uint8_t* out, CUstream_st* stream) {
  if (count < 1) return cudaSuccess;
  Fp8QuantizeKernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(values, count, scale, out);
  return cudaGetLastError();
}

}  // namespace hsx::cuda
