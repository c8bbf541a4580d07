// device_matrix.cuh: element access of a DeviceMatrix inside kernels, and the
// scalar helpers the kernels share with the CPU reference (R, Silu, Exp).
#ifndef HSX_KERNELS_CUDA_DEVICE_MATRIX_CUH_
#define HSX_KERNELS_CUDA_DEVICE_MATRIX_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/bf16.h"
#include "kernels/cuda/ops.h"

namespace hsx::cuda {

__device__ __forceinline__ float Load(const DeviceMatrix& m, int64_t r, int64_t c) {
  const int64_t i = r * m.ld + c;
  return m.bf16 ? Bf16ToFloat(static_cast<const uint16_t*>(m.data)[i]) : static_cast<const float*>(m.data)[i];
}

// Stores a value; a bf16 matrix rounds it (exact for values already rounded).
__device__ __forceinline__ void Store(const DeviceMatrix& m, int64_t r, int64_t c, float v) {
  const int64_t i = r * m.ld + c;
  if (m.bf16) {
    static_cast<uint16_t*>(m.data)[i] = FloatToBf16(v);
  } else {
    static_cast<float*>(m.data)[i] = v;
  }
}

// R() of the CPU backend: bf16 rounding in kBf16 mode only.
__device__ __forceinline__ float R(bool round, float v) { return round ? RoundToBf16(v) : v; }

// exp with float32 arguments, rounded once from double: correctly rounded
// except in vanishingly rare cases. CUDA's expf (2 ulp) would be further from
// the CPU reference, but glibc's expf (which it calls) is not correctly
// rounded either (at most ~0.502 ulp): measured over every float in
// 2^-8 <= |x| < 2^7 (glibc 2.36), about 6e-4 of arguments (up to 1.4e-3 for
// -2^-6 < x <= -2^-8) give results one float ulp apart. Ops that call exp
// (SiluMul, Attention, Route) therefore agree with the CPU to within that
// last bit, not bitwise; the CUDA tests' tolerances allow it.
__device__ __forceinline__ float Exp(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

// The reference's silu: x / (1 + exp(-x)).
__device__ __forceinline__ float Silu(float x) { return x / (1.0f + Exp(-x)); }

// A grid size for `work` items at `per_block` items per block, capped: the
// kernels loop over the rest (grid-stride), so any size works.
inline unsigned int GridFor(int64_t work, int64_t per_block) {
  int64_t blocks = (work + per_block - 1) / per_block;
  if (blocks < 1) blocks = 1;
  if (blocks > 65535 * 16) blocks = 65535 * 16;
  return static_cast<unsigned int>(blocks);
}

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_DEVICE_MATRIX_CUH_
