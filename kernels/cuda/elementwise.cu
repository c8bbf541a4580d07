// elementwise.cu: Embed, conversions/Round, RMSNorm, Add, SiluMul and RoPE.
// Each kernel does, per element, exactly the float32 operations of the CPU
// backend's loop of the same name (kernels/cpu/cpu_backend.cc), so results
// agree bit for bit; the comments say where the HF BF16 reference rounds.
#include <cuda_runtime.h>

#include "kernels/cuda/device_matrix.cuh"
#include "kernels/cuda/ops.h"

namespace hsx::cuda {
namespace {

constexpr int kThreads = 256;

// Blocks over columns (x) and rows (y, grid-stride): one launch shape for
// every row-wise elementwise op.
dim3 RowGrid(int64_t rows, int64_t cols) {
  return dim3(GridFor(cols, kThreads), static_cast<unsigned int>(rows < 1 ? 1 : (rows > 65535 ? 65535 : rows)));
}

__global__ void EmbedKernel(const int32_t* __restrict__ tokens, const uint16_t* __restrict__ table,
                            int64_t vocab_begin, int64_t vocab_rows, DeviceMatrix out) {
  for (int64_t r = blockIdx.y; r < out.rows; r += gridDim.y) {
    const int64_t local = tokens[r] - vocab_begin;
    const bool here = local >= 0 && local < vocab_rows;
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Store(out, r, c, here ? Bf16ToFloat(table[local * out.cols + c]) : 0.0f);  // bf16 values: exact
    }
  }
}

__global__ void ConvertKernel(DeviceMatrix in, DeviceMatrix out) {
  for (int64_t r = blockIdx.y; r < out.rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Store(out, r, c, Load(in, r, c));
    }
  }
}

__global__ void AddKernel(DeviceMatrix a, DeviceMatrix b, bool round, DeviceMatrix out) {
  for (int64_t r = blockIdx.y; r < out.rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Store(out, r, c, R(round, Load(a, r, c) + Load(b, r, c)));
    }
  }
}

__global__ void SiluMulKernel(DeviceMatrix gate, DeviceMatrix up, bool round, DeviceMatrix out) {
  for (int64_t r = blockIdx.y; r < out.rows; r += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      // HF: bf16(bf16(silu(gate)) * up).
      Store(out, r, c, R(round, R(round, Silu(Load(gate, r, c))) * Load(up, r, c)));
    }
  }
}

// RMSNorm, 64 rows per block of 256 threads. Phase 1: four threads per row,
// thread `lane` sums the squares of columns lane, lane + 4, ... in double, in
// ascending order (lane 0 then adds the columns past the last multiple of 4),
// which is the reference's four-lane order exactly. Phase 2: every thread
// writes columns of the block's rows.
constexpr int kNormRows = kThreads / 4;

__global__ void RmsNormKernel(DeviceMatrix x, const uint16_t* __restrict__ weight, float eps, bool round,
                              DeviceMatrix y) {
  __shared__ double lanes[kNormRows][4];
  __shared__ float inv[kNormRows];
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kNormRows;
  const int local = threadIdx.x / 4;
  const int lane = threadIdx.x % 4;
  const int64_t row = first + local;
  if (row < x.rows) {
    const int64_t full = x.cols / 4 * 4;
    double sum = 0.0;
    for (int64_t c = lane; c < full; c += 4) {
      const double v = Load(x, row, c);
      sum += v * v;  // exact product; a contracted fma gives the same bits
    }
    if (lane == 0) {
      for (int64_t c = full; c < x.cols; ++c) {
        const double v = Load(x, row, c);
        sum += v * v;
      }
    }
    lanes[local][lane] = sum;
  }
  __syncthreads();
  if (row < x.rows && lane == 0) {
    const double total = (lanes[local][0] + lanes[local][1]) + (lanes[local][2] + lanes[local][3]);
    inv[local] = 1.0f / sqrtf(static_cast<float>(total / x.cols) + eps);  // IEEE div and sqrt (no fast math)
  }
  __syncthreads();
  const int64_t rows = x.rows - first < kNormRows ? x.rows - first : kNormRows;
  for (int64_t r = 0; r < rows; ++r) {
    const float scale = inv[r];
    for (int64_t c = threadIdx.x; c < x.cols; c += blockDim.x) {
      const float w = Bf16ToFloat(weight[c]);
      const float v = Load(x, first + r, c);
      // HF: bf16(weight * bf16(x * rsqrt(mean(x²) + eps))).
      Store(y, first + r, c, round ? RoundToBf16(w * RoundToBf16(v * scale)) : w * (v * scale));
    }
  }
}

// RoPE: one block per (row, head), thread i handles pair i. All threads read
// their pair before any writes (the output is half-split, so it overwrites
// other threads' inputs).
__global__ void RopeKernel(DeviceMatrix x, int64_t stride, int64_t offset, int64_t half,
                           const int32_t* __restrict__ positions, const float* __restrict__ cos_table,
                           const float* __restrict__ sin_table, bool round) {
  const int64_t h = blockIdx.y;
  const int64_t i = threadIdx.x;
  for (int64_t r = blockIdx.x; r < x.rows; r += gridDim.x) {
    const int64_t base = offset + h * stride;
    float even = 0.0f, odd = 0.0f, c = 0.0f, s = 0.0f;
    if (i < half) {
      even = Load(x, r, base + 2 * i);
      odd = Load(x, r, base + 2 * i + 1);
      c = cos_table[positions[r] * half + i];
      s = sin_table[positions[r] * half + i];
    }
    __syncthreads();
    if (i < half) {
      // HF: bf16(bf16(x1 * cos) - bf16(x2 * sin)) and bf16(bf16(x2 * cos) + bf16(x1 * sin)).
      Store(x, r, base + i, R(round, R(round, even * c) - R(round, odd * s)));
      Store(x, r, base + half + i, R(round, R(round, odd * c) + R(round, even * s)));
    }
    __syncthreads();
  }
}

__global__ void Bf16ToF32Kernel(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = Bf16ToFloat(in[i]);
  }
}

__global__ void FillPatternKernel(void* data, int64_t count, bool bf16, uint32_t seed) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t h = static_cast<uint32_t>(i) * 0x9E3779B1u ^ static_cast<uint32_t>(i >> 32) ^ seed;  // a small hash
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    const float v = static_cast<float>(h >> 8) / static_cast<float>(1 << 23) - 1.0f;
    if (bf16) {
      static_cast<uint16_t*>(data)[i] = FloatToBf16(v);
    } else {
      static_cast<float*>(data)[i] = v;
    }
  }
}

}  // namespace

int LaunchFillPattern(void* data, int64_t count, bool bf16, uint32_t seed, CUstream_st* stream) {
  if (count == 0) return cudaSuccess;
  FillPatternKernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(data, count, bf16, seed);
  return cudaGetLastError();
}

int LaunchEmbed(const int32_t* tokens, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
                DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  EmbedKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(tokens, table, vocab_begin, vocab_rows, out);
  return cudaGetLastError();
}

int LaunchConvert(DeviceMatrix in, DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  ConvertKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(in, out);
  return cudaGetLastError();
}

int LaunchRmsNorm(DeviceMatrix x, const uint16_t* weight, float eps, bool round, DeviceMatrix y,
                  CUstream_st* stream) {
  if (x.rows == 0 || x.cols == 0) return cudaSuccess;
  if ((x.rows + kNormRows - 1) / kNormRows > 65535 * 16) return cudaErrorInvalidValue;  // one block per 64 rows
  RmsNormKernel<<<GridFor(x.rows, kNormRows), kThreads, 0, stream>>>(x, weight, eps, round, y);
  return cudaGetLastError();
}

int LaunchAdd(DeviceMatrix a, DeviceMatrix b, bool round, DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  AddKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(a, b, round, out);
  return cudaGetLastError();
}

int LaunchSiluMul(DeviceMatrix gate, DeviceMatrix up, bool round, DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  SiluMulKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(gate, up, round, out);
  return cudaGetLastError();
}

int LaunchRope(DeviceMatrix x, int64_t heads, int64_t stride, int64_t offset, int64_t half_dim,
               const int32_t* positions, const float* cos, const float* sin, bool round, CUstream_st* stream) {
  if (x.rows == 0 || heads == 0 || half_dim == 0) return cudaSuccess;
  if (half_dim > 1024 || heads > 65535) return cudaErrorInvalidValue;
  const unsigned int threads = static_cast<unsigned int>((half_dim + 31) / 32 * 32);
  const dim3 grid(static_cast<unsigned int>(x.rows < 65535 * 16 ? x.rows : 65535 * 16),
                  static_cast<unsigned int>(heads));
  RopeKernel<<<grid, threads, 0, stream>>>(x, stride, offset, half_dim, positions, cos, sin, round);
  return cudaGetLastError();
}

int LaunchBf16ToF32(const uint16_t* in, float* out, int64_t count, CUstream_st* stream) {
  if (count == 0) return cudaSuccess;
  Bf16ToF32Kernel<<<GridFor(count, kThreads), kThreads, 0, stream>>>(in, out, count);
  return cudaGetLastError();
}

}  // namespace hsx::cuda
