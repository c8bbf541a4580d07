// moe.cu: routing, the stable permutation of (token, expert) pairs by expert,
// the gather of each expert's rows, and the combine that sums a token's
// experts in ascending expert id. Mirrors CpuBackend::Route and
// CpuBackend::MoeExperts (kernels/cpu/cpu_backend.cc); no float atomics
// anywhere, and the only integer counting is exact.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/device_matrix.cuh"
#include "kernels/cuda/ops.h"

namespace hsx::cuda {
namespace {

constexpr int kWarpsPerRouteBlock = 4;
constexpr int kMaxGroups = 64;

// The selection order: larger value first, then lower id (TopK's comparator).
__device__ __forceinline__ bool Before(float v, int e, float best, int best_e) {
  return best_e < 0 || v > best || (v == best && e < best_e);
}

// The warp's best (value, id) under Before(); ids < 0 are "none".
__device__ __forceinline__ void WarpBest(float& v, int& e) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float ov = __shfl_down_sync(0xffffffffu, v, offset);
    const int oe = __shfl_down_sync(0xffffffffu, e, offset);
    if (oe >= 0 && Before(ov, oe, v, e)) {
      v = ov;
      e = oe;
    }
  }
  v = __shfl_sync(0xffffffffu, v, 0);
  e = __shfl_sync(0xffffffffu, e, 0);
}

// Per warp in shared memory: scores [E], choice [E], taken [E] bytes, group
// scores [kMaxGroups], chosen [kMaxTopK].
// Rounded up to 16 bytes so every warp's floats stay aligned.
__host__ __device__ size_t RouteWarpBytes(int64_t experts) {
  return (static_cast<size_t>(experts) * 9 + kMaxGroups * 4 + kMaxTopK * 4 + 15) / 16 * 16;
}

// The steps of RouteKernel, for one token on one warp. Each ends with the
// warp's lanes agreeing on what it wrote (__syncwarp).

// scores[e]: softmax or sigmoid of the token's logits `row`.
__device__ __forceinline__ void RouteScores(const float* row, int n, int lane, bool softmax, float* scores) {
  if (softmax) {
    float max = -INFINITY;
    for (int e = lane; e < n; e += 32) max = max < row[e] ? row[e] : max;
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, max, offset);
      max = max < other ? other : max;
    }
    for (int e = lane; e < n; e += 32) scores[e] = Exp(row[e] - max);
    __syncwarp();
    float sum = 0.0f;
    if (lane == 0) {
      for (int e = 0; e < n; ++e) sum += scores[e];  // ascending, as the CPU
    }
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int e = lane; e < n; e += 32) scores[e] /= sum;
  } else {
    for (int e = lane; e < n; e += 32) scores[e] = 1.0f / (1.0f + Exp(-row[e]));
  }
}

// Keep the topk_group groups with the largest sum of their two best
// choices (DeepSeek-V3 noaux_tc); mask the others.
__device__ __forceinline__ void MaskGroups(RouterArgs router, int n, int lane, float* choice,
                                           float* group_score) {
  const int groups = static_cast<int>(router.n_group);
  const int per_group = n / groups;
  for (int g = lane; g < groups; g += 32) {
    float first = -INFINITY, second = -INFINITY;
    for (int e = g * per_group; e < (g + 1) * per_group; ++e) {
      const float v = choice[e];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = per_group >= 2 ? first + second : first;
  }
  __syncwarp();
  if (lane == 0) {
    unsigned long long kept = 0;  // groups <= kMaxGroups = 64
    for (int k = 0; k < router.topk_group; ++k) {
      int best = -1;
      for (int g = 0; g < groups; ++g) {
        if (!((kept >> g) & 1ull) && Before(group_score[g], g, best < 0 ? 0.0f : group_score[best], best)) best = g;
      }
      kept |= 1ull << best;
    }
    for (int e = 0; e < n; ++e) {
      if (!((kept >> (e / per_group)) & 1ull)) choice[e] = -INFINITY;
    }
  }
  __syncwarp();
}

// top_k rounds of a warp-wide best choice not yet taken, into chosen.
__device__ __forceinline__ void ChooseTopK(const float* choice, int n, int top_k, int lane, unsigned char* taken,
                                           int* chosen) {
  for (int k = 0; k < top_k; ++k) {
    float best = 0.0f;
    int best_e = -1;
    for (int e = lane; e < n; e += 32) {
      if (!taken[e] && Before(choice[e], e, best, best_e)) {
        best = choice[e];
        best_e = e;
      }
    }
    WarpBest(best, best_e);
    if (lane == 0) {
      taken[best_e] = 1;
      chosen[k] = best_e;
    }
    __syncwarp();
  }
}

// On one thread: the chosen experts in ascending id and their weights.
__device__ __forceinline__ void WriteRouting(RouterArgs router, const float* scores, int top_k, int* chosen,
                                             int32_t* experts_out, float* weights_out) {
  for (int i = 1; i < top_k; ++i) {  // ascending id
    const int e = chosen[i];
    int j = i - 1;
    for (; j >= 0 && chosen[j] > e; --j) chosen[j + 1] = chosen[j];
    chosen[j + 1] = e;
  }
  float sum = 0.0f;
  for (int i = 0; i < top_k; ++i) sum += scores[chosen[i]];
  for (int i = 0; i < top_k; ++i) {
    float w = scores[chosen[i]];
    if (router.normalize) w /= (sum + 1e-20f);
    experts_out[i] = chosen[i];
    weights_out[i] = w * router.scaling;
  }
}

// One warp per token. Sequential sums (softmax denominator, renormalisation)
// run on lane 0 in the CPU's order; maxima and selections are exact in any
// order.
__global__ void RouteKernel(const float* __restrict__ logits, int64_t tokens, RouterArgs router,
                            int32_t* __restrict__ experts_out, float* __restrict__ weights_out) {
  extern __shared__ __align__(16) unsigned char route_shared[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int n = static_cast<int>(router.num_experts);
  unsigned char* base = route_shared + warp * RouteWarpBytes(n);
  float* scores = reinterpret_cast<float*>(base);
  float* choice = scores + n;
  float* group_score = choice + n;
  int* chosen = reinterpret_cast<int*>(group_score + kMaxGroups);
  unsigned char* taken = reinterpret_cast<unsigned char*>(chosen + kMaxTopK);
  const int top_k = static_cast<int>(router.top_k);

  for (int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerRouteBlock + warp; t < tokens;
       t += static_cast<int64_t>(gridDim.x) * kWarpsPerRouteBlock) {
    RouteScores(logits + t * n, n, lane, router.softmax_scores, scores);
    for (int e = lane; e < n; e += 32) {
      choice[e] = router.bias != nullptr ? scores[e] + router.bias[e] : scores[e];
      taken[e] = 0;
    }
    __syncwarp();
    if (router.n_group > 1) MaskGroups(router, n, lane, choice, group_score);
    ChooseTopK(choice, n, top_k, lane, taken, chosen);
    if (lane == 0) WriteRouting(router, scores, top_k, chosen, experts_out + t * top_k, weights_out + t * top_k);
    __syncwarp();
  }
}

constexpr int kThreads = 256;

// Block sum of one int per thread (exact).
__device__ int BlockSum(int value) {
  __shared__ int warp_sums[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = value;
  __syncthreads();
  int total = 0;
  for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
  return total;
}

// The slot of token t that chose expert e, or -1.
__device__ __forceinline__ int SlotOf(const int32_t* experts, int64_t t, int64_t top_k, int e) {
  for (int64_t s = 0; s < top_k; ++s) {
    if (experts[t * top_k + s] == e) return static_cast<int>(s);
  }
  return -1;
}

__global__ void ExpertCountsKernel(const int32_t* __restrict__ experts, int64_t tokens, int64_t top_k,
                                   const uint8_t* __restrict__ held, int32_t* __restrict__ counts) {
  const int e = blockIdx.x;
  int count = 0;
  if (held[e]) {
    for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) count += SlotOf(experts, t, top_k, e) >= 0;
  }
  const int total = BlockSum(count);
  if (threadIdx.x == 0) counts[e] = total;
}

// Block e walks the tokens in chunks of kThreads, in order; a ballot and
// popcount give each flagged token its rank within the chunk, so rows keep
// ascending token order (a stable sort, independent of scheduling).
__global__ void ExpertRowsKernel(const int32_t* __restrict__ experts, int64_t tokens, int64_t top_k,
                                 const uint8_t* __restrict__ held, const int32_t* __restrict__ offsets,
                                 int32_t* __restrict__ rows, int32_t* __restrict__ slot_row) {
  __shared__ int warp_counts[kThreads / 32];
  const int e = blockIdx.x;
  const bool here = held[e] != 0;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  int64_t next = here ? offsets[e] : 0;
  for (int64_t chunk = 0; chunk < tokens; chunk += kThreads) {
    const int64_t t = chunk + threadIdx.x;
    const int slot = t < tokens ? SlotOf(experts, t, top_k, e) : -1;
    const unsigned int ballot = __ballot_sync(0xffffffffu, slot >= 0);
    __syncthreads();  // warp_counts of the previous chunk are consumed
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      before += w < warp ? warp_counts[w] : 0;
      total += warp_counts[w];
    }
    if (slot >= 0) {
      if (here) {
        const int64_t row = next + before + __popc(ballot & ((1u << lane) - 1u));
        rows[row] = static_cast<int32_t>(t);
        slot_row[t * top_k + slot] = static_cast<int32_t>(row);
      } else {
        slot_row[t * top_k + slot] = -1;  // held by another rank
      }
    }
    next += total;
  }
}

__global__ void GatherRowsKernel(DeviceMatrix x, const int32_t* __restrict__ rows, DeviceMatrix out) {
  for (int64_t r = blockIdx.y; r < out.rows; r += gridDim.y) {
    const int64_t source = rows[r];
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      Store(out, r, c, Load(x, source, c));  // same element type: a copy
    }
  }
}

// The CPU's combine: acc += y * w over a token's slots (ascending expert id),
// float32 from 0, one rounding at the end unless the output is partial.
__global__ void CombineKernel(DeviceMatrix y, const int32_t* __restrict__ slot_row,
                              const float* __restrict__ weights, int64_t top_k, bool round, DeviceMatrix out) {
  for (int64_t t = blockIdx.y; t < out.rows; t += gridDim.y) {
    for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < out.cols;
         c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      float acc = 0.0f;
      for (int64_t i = 0; i < top_k; ++i) {
        const int32_t row = slot_row[t * top_k + i];
        if (row < 0) continue;
        acc += Load(y, row, c) * weights[t * top_k + i];  // -fmad=false: a product, then a sum
      }
      Store(out, t, c, R(round, acc));
    }
  }
}

dim3 RowGrid(int64_t rows, int64_t cols) {
  return dim3(GridFor(cols, kThreads), static_cast<unsigned int>(rows < 1 ? 1 : (rows > 65535 ? 65535 : rows)));
}

}  // namespace

int LaunchRoute(const float* logits, int64_t tokens, RouterArgs router, int32_t* experts, float* weights,
                CUstream_st* stream) {
  if (tokens == 0) return cudaSuccess;
  if (router.num_experts < 1 || router.num_experts > kMaxExperts || router.top_k < 1 ||
      router.top_k > kMaxTopK || router.top_k > router.num_experts || router.n_group < 1 ||
      router.n_group > kMaxGroups || router.num_experts % router.n_group != 0 || router.topk_group < 1 ||
      router.topk_group > router.n_group) {
    return cudaErrorInvalidValue;
  }
  const size_t bytes = kWarpsPerRouteBlock * RouteWarpBytes(router.num_experts);
  cudaError_t status = cudaFuncSetAttribute(RouteKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  RouteKernel<<<GridFor(tokens, kWarpsPerRouteBlock), 32 * kWarpsPerRouteBlock, bytes, stream>>>(
      logits, tokens, router, experts, weights);
  return cudaGetLastError();
}

int LaunchExpertCounts(const int32_t* experts, int64_t tokens, int64_t top_k, const uint8_t* held,
                       int64_t num_experts, int32_t* counts, CUstream_st* stream) {
  if (num_experts == 0) return cudaSuccess;
  ExpertCountsKernel<<<static_cast<unsigned int>(num_experts), kThreads, 0, stream>>>(experts, tokens, top_k,
                                                                                      held, counts);
  return cudaGetLastError();
}

int LaunchExpertRows(const int32_t* experts, int64_t tokens, int64_t top_k, const uint8_t* held,
                     int64_t num_experts, const int32_t* offsets, int32_t* rows, int32_t* slot_row,
                     CUstream_st* stream) {
  if (num_experts == 0 || tokens == 0) return cudaSuccess;
  ExpertRowsKernel<<<static_cast<unsigned int>(num_experts), kThreads, 0, stream>>>(experts, tokens, top_k, held,
                                                                                    offsets, rows, slot_row);
  return cudaGetLastError();
}

int LaunchGatherRows(DeviceMatrix x, const int32_t* rows, DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  GatherRowsKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(x, rows, out);
  return cudaGetLastError();
}

int LaunchCombine(DeviceMatrix y, const int32_t* slot_row, const float* weights, int64_t top_k, bool round,
                  DeviceMatrix out, CUstream_st* stream) {
  if (out.rows == 0 || out.cols == 0) return cudaSuccess;
  CombineKernel<<<RowGrid(out.rows, out.cols), kThreads, 0, stream>>>(y, slot_row, weights, top_k, round, out);
  return cudaGetLastError();
}

}  // namespace hsx::cuda
