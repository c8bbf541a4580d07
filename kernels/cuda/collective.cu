// collective.cu: the rank-order sum of the CUDA communicators (ops.h).
#include <cuda_runtime.h>

#include "kernels/cuda/ops.h"

namespace hsx::cuda {
namespace {

struct Sources {
  const float* p[kMaxCollectiveRanks];
};

__global__ void SumInRankOrder(Sources sources, int n, float* out, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    float sum = sources.p[0][i];
    for (int k = 1; k < n; ++k) sum += sources.p[k][i];
    out[i] = sum;
  }
}

}  // namespace

int LaunchSumInRankOrder(const float* const* sources, int n, float* out, int64_t count, CUstream_st* stream) {
  if (n < 1 || n > kMaxCollectiveRanks || count < 0) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  Sources s{};
  for (int k = 0; k < n; ++k) s.p[k] = sources[k];
  constexpr int kThreads = 256;
  const int64_t blocks = (count + kThreads - 1) / kThreads;
  SumInRankOrder<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(s, n, out, count);
  return cudaGetLastError();
}

}  // namespace hsx::cuda
