// attention.cu: the reference attention kernel (causal, ragged, head dims from
// the arguments), arithmetic for arithmetic the CPU backend's
// (kernels/cpu/cpu_attention.cc):
//
//   s_ij = R(R(sum_d fma(q_id, k_jd)) * scale)     d ascending, from 0
//   m_i  = max_j s_ij                              (exact in any order)
//   z_i  = sum_j exp(s_ij - m_i)                   j ascending, one thread
//   p_ij = R(exp(s_ij - m_i) / z_i)
//   o_id = R(sum_j fma(p_ij, v_jd))                j ascending, from 0
//
// with j over the sample's keys up to i. A block owns kAttentionQueryTile
// query rows of one sample and one head and streams the keys through shared
// memory in tiles of kKeyTile, three times: for the maxima, for the sums, and
// for the probabilities and outputs (scores are recomputed rather than
// stored, so memory does not grow with the sample length). Every row's
// arithmetic depends only on its own sample's rows up to itself: batch
// invariant by construction. A reference, not a fast path: it runs on the
// SIMT pipes, at a fraction of what cuDNN's SDPA would reach.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/cuda/device_matrix.cuh"
#include "kernels/cuda/ops.h"

namespace hsx::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kQueryTile = static_cast<int>(kAttentionQueryTile);
constexpr int kKeyTile = 32;

struct Dims {
  int heads, nope, rope, v, qk, kv_head;
};

// Shared memory, in floats: Q [kQueryTile][qk], K [kKeyTile][qk + 1] (padded:
// lanes read different keys at the same d), V [kKeyTile][v], S [kQueryTile]
// [kKeyTile], O [kQueryTile][v], row max and sum [kQueryTile] each.
__host__ __device__ int64_t SharedFloats(int64_t qk, int64_t v) {
  return kQueryTile * qk + kKeyTile * (qk + 1) + kKeyTile * v + kQueryTile * kKeyTile + kQueryTile * v +
         2 * kQueryTile;
}

// One block's work and its shared memory: head h of query rows
// [q0, q0 + rows) of the sample whose rows are [begin, begin + len), against
// keys [0, keys). The steps below run on every thread of the block.
struct AttentionTileState {
  DeviceMatrix kv, k_rope;
  Dims dims;
  int qk, vd, h, rows, tid;
  int64_t begin, q0, keys;
  float scale;
  bool round;
  float *Qs, *Ks, *Vs, *S, *O, *row_max, *row_sum;
};

// Q rows into Qs (zero past the sample), O zeroed, the row maxima and sums started.
__device__ __forceinline__ void StartTile(const AttentionTileState& t, const DeviceMatrix& q) {
  const int qk = t.qk, vd = t.vd, tid = t.tid;
  for (int idx = tid; idx < kQueryTile * qk; idx += kThreads) {
    const int i = idx / qk, d = idx % qk;
    t.Qs[idx] = i < t.rows ? Load(q, t.begin + t.q0 + i, static_cast<int64_t>(t.h) * qk + d) : 0.0f;
  }
  for (int idx = tid; idx < kQueryTile * vd; idx += kThreads) t.O[idx] = 0.0f;
  if (tid < kQueryTile) {
    t.row_max[tid] = -INFINITY;
    t.row_sum[tid] = 0.0f;
  }
}

// Scores of the tile's rows against keys [k0, k0 + kKeyTile) into S; -inf
// where masked (causal, or past the sample). Ks must be loaded.
__device__ __forceinline__ void Scores(const AttentionTileState& t, int64_t k0) {
  const int qk = t.qk;
  for (int pair = t.tid; pair < kQueryTile * kKeyTile; pair += kThreads) {
    const int i = pair / kKeyTile, j = pair % kKeyTile;
    const int64_t key = k0 + j;
    float s = -INFINITY;
    if (i < t.rows && key < t.keys && key <= t.q0 + i) {
      float dot = 0.0f;
      for (int d = 0; d < qk; ++d) dot = fmaf(t.Qs[i * qk + d], t.Ks[j * (qk + 1) + d], dot);
      s = R(t.round, R(t.round, dot) * t.scale);
    }
    t.S[pair] = s;
  }
}

__device__ __forceinline__ void LoadKeys(const AttentionTileState& t, int64_t k0, bool values) {
  const int qk = t.qk, vd = t.vd, h = t.h;
  const Dims& dims = t.dims;
  for (int idx = t.tid; idx < kKeyTile * qk; idx += kThreads) {
    const int j = idx / qk, d = idx % qk;
    const int64_t row = t.begin + k0 + j;
    float value = 0.0f;
    if (k0 + j < t.keys) {
      value = d < dims.nope ? Load(t.kv, row, static_cast<int64_t>(h) * dims.kv_head + d)
                            : Load(t.k_rope, row, d - dims.nope);  // K_h = [k_nope | k_rope]
    }
    t.Ks[j * (qk + 1) + d] = value;
  }
  if (!values) return;
  for (int idx = t.tid; idx < kKeyTile * vd; idx += kThreads) {
    const int j = idx / vd, d = idx % vd;
    t.Vs[idx] = k0 + j < t.keys
                    ? Load(t.kv, t.begin + k0 + j, static_cast<int64_t>(h) * dims.kv_head + dims.nope + d)
                    : 0.0f;
  }
}

// Loads key tile k0 (and its values) and fills S with its scores; on return
// every thread sees them, and the previous tile is no longer read.
__device__ __forceinline__ void TileScores(const AttentionTileState& t, int64_t k0, bool values) {
  __syncthreads();
  LoadKeys(t, k0, values);
  __syncthreads();
  Scores(t, k0);
  __syncthreads();
}

// Pass 1: row maxima (std::max's comparison, so NaNs behave as on the CPU).
__device__ __forceinline__ void RowMaxima(const AttentionTileState& t) {
  const int tid = t.tid;
  for (int64_t k0 = 0; k0 < t.keys; k0 += kKeyTile) {
    TileScores(t, k0, false);
    if (tid < t.rows) {
      float m = t.row_max[tid];
      for (int j = 0; j < kKeyTile && k0 + j <= t.q0 + tid; ++j) {
        m = m < t.S[tid * kKeyTile + j] ? t.S[tid * kKeyTile + j] : m;
      }
      t.row_max[tid] = m;
    }
  }
}

// Pass 2: sums of exp(s - max), keys ascending.
__device__ __forceinline__ void RowSums(const AttentionTileState& t) {
  const int tid = t.tid;
  for (int64_t k0 = 0; k0 < t.keys; k0 += kKeyTile) {
    TileScores(t, k0, false);
    for (int pair = tid; pair < kQueryTile * kKeyTile; pair += kThreads) {
      const int i = pair / kKeyTile;
      if (i < t.rows) t.S[pair] = Exp(t.S[pair] - t.row_max[i]);  // masked: exp(-inf) = 0, not added below
    }
    __syncthreads();
    if (tid < t.rows) {
      float sum = t.row_sum[tid];
      for (int j = 0; j < kKeyTile && k0 + j <= t.q0 + tid; ++j) sum += t.S[tid * kKeyTile + j];
      t.row_sum[tid] = sum;
    }
  }
}

// Pass 3: probabilities, and the outputs accumulated over keys ascending.
__device__ __forceinline__ void AccumulateOutputs(const AttentionTileState& t) {
  const int vd = t.vd;
  for (int64_t k0 = 0; k0 < t.keys; k0 += kKeyTile) {
    TileScores(t, k0, true);
    for (int pair = t.tid; pair < kQueryTile * kKeyTile; pair += kThreads) {
      const int i = pair / kKeyTile;
      if (i < t.rows) t.S[pair] = R(t.round, Exp(t.S[pair] - t.row_max[i]) / t.row_sum[i]);
    }
    __syncthreads();
    for (int idx = t.tid; idx < kQueryTile * vd; idx += kThreads) {
      const int i = idx / vd, d = idx % vd;
      if (i >= t.rows) continue;
      float o = t.O[idx];
      // Masked keys carry probability 0 on the CPU, and fma(0, v, o) == o: skipping them is identical.
      for (int j = 0; j < kKeyTile && k0 + j <= t.q0 + i; ++j) o = fmaf(t.S[i * kKeyTile + j], t.Vs[j * vd + d], o);
      t.O[idx] = o;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    AttentionKernel(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, Dims dims,
                    const int64_t* __restrict__ cu_seqlens, const AttentionTile* __restrict__ tiles, float scale,
                    bool round, DeviceMatrix out) {
  extern __shared__ float shared[];
  AttentionTileState t;
  t.kv = kv;
  t.k_rope = k_rope;
  t.dims = dims;
  t.qk = dims.qk;
  t.vd = dims.v;
  t.Qs = shared;
  t.Ks = t.Qs + kQueryTile * t.qk;
  t.Vs = t.Ks + kKeyTile * (t.qk + 1);
  t.S = t.Vs + kKeyTile * t.vd;
  t.O = t.S + kQueryTile * kKeyTile;
  t.row_max = t.O + kQueryTile * t.vd;
  t.row_sum = t.row_max + kQueryTile;

  const AttentionTile tile = tiles[blockIdx.x];
  t.h = blockIdx.y;
  t.begin = cu_seqlens[tile.sample];
  const int64_t len = cu_seqlens[tile.sample + 1] - t.begin;
  t.q0 = tile.q0;
  t.rows = static_cast<int>(len - t.q0 < kQueryTile ? len - t.q0 : kQueryTile);
  t.keys = t.q0 + t.rows;  // keys [0, q0 + rows) are visible to some row of the tile
  t.tid = threadIdx.x;
  t.scale = scale;
  t.round = round;

  StartTile(t, q);
  RowMaxima(t);
  RowSums(t);
  AccumulateOutputs(t);
  __syncthreads();
  for (int idx = t.tid; idx < kQueryTile * t.vd; idx += kThreads) {
    const int i = idx / t.vd, d = idx % t.vd;
    if (i < t.rows) Store(out, t.begin + t.q0 + i, static_cast<int64_t>(t.h) * t.vd + d, R(t.round, t.O[idx]));
  }
}

// One thread per element of the three packed operands (grid-stride); raw
// bf16 bits are copied, so the packing is exact.
__global__ void PackSdpaKernel(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, Dims dims, int64_t tokens,
                               uint16_t* q_out, uint16_t* k_out, uint16_t* v_out) {
  const int64_t qk_row = static_cast<int64_t>(dims.heads) * dims.qk;
  const int64_t v_row = static_cast<int64_t>(dims.heads) * dims.v;
  const int64_t per_token = 2 * qk_row + v_row;
  const auto* qs = static_cast<const uint16_t*>(q.data);
  const auto* kvs = static_cast<const uint16_t*>(kv.data);
  const auto* ropes = static_cast<const uint16_t*>(k_rope.data);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < tokens * per_token;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / per_token;
    int64_t c = i % per_token;
    if (c < qk_row) {
      q_out[t * qk_row + c] = qs[t * q.ld + c];
    } else if ((c -= qk_row) < qk_row) {
      const int64_t h = c / dims.qk, d = c % dims.qk;
      k_out[t * qk_row + c] = d < dims.nope ? kvs[t * kv.ld + h * dims.kv_head + d] : ropes[t * k_rope.ld + d - dims.nope];
    } else {
      c -= qk_row;
      const int64_t h = c / dims.v, d = c % dims.v;
      v_out[t * v_row + c] = kvs[t * kv.ld + h * dims.kv_head + dims.nope + d];
    }
  }
}

__global__ void SdpaOffsetsKernel(const int64_t* cu_seqlens, int64_t samples, int64_t slots, int64_t qk_row,
                                  int64_t v_row, int32_t* offsets_qk, int32_t* offsets_v, int32_t* lengths) {
  for (int64_t s = threadIdx.x; s <= slots; s += blockDim.x) {
    const int64_t begin = cu_seqlens[s < samples ? s : samples];
    offsets_qk[s] = static_cast<int32_t>(begin * qk_row);
    offsets_v[s] = static_cast<int32_t>(begin * v_row);
    if (s < slots) lengths[s] = s < samples ? static_cast<int32_t>(cu_seqlens[s + 1] - begin) : 0;
  }
}

__global__ void UnpackRowsKernel(const uint16_t* packed, DeviceMatrix out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < out.rows * out.cols;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    Store(out, i / out.cols, i % out.cols, Bf16ToFloat(packed[i]));
  }
}

}  // namespace

int LaunchAttention(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, int64_t heads, int64_t nope_dim,
                    int64_t rope_dim, int64_t v_dim, const int64_t* cu_seqlens, const AttentionTile* tiles,
                    int64_t num_tiles, float scale, bool round, DeviceMatrix out, CUstream_st* stream) {
  if (num_tiles == 0 || heads == 0) return cudaSuccess;
  if (heads > 65535 || num_tiles > INT32_MAX) return cudaErrorInvalidValue;
  const size_t bytes = static_cast<size_t>(SharedFloats(nope_dim + rope_dim, v_dim)) * sizeof(float);
  int device = 0;
  int limit = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) status = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (status != cudaSuccess) return status;
  if (bytes > static_cast<size_t>(limit)) return cudaErrorInvalidValue;  // head dims too large for one block
  status = cudaFuncSetAttribute(AttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (status != cudaSuccess) return status;
  const Dims dims{static_cast<int>(heads), static_cast<int>(nope_dim), static_cast<int>(rope_dim),
                  static_cast<int>(v_dim), static_cast<int>(nope_dim + rope_dim), static_cast<int>(nope_dim + v_dim)};
  const dim3 grid(static_cast<unsigned int>(num_tiles), static_cast<unsigned int>(heads));
  AttentionKernel<<<grid, kThreads, bytes, stream>>>(q, kv, k_rope, dims, cu_seqlens, tiles, scale, round, out);
  return cudaGetLastError();
}

int LaunchPackSdpa(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, int64_t heads, int64_t nope_dim,
                   int64_t rope_dim, int64_t v_dim, const int64_t* cu_seqlens, int64_t samples, int64_t slots,
                   uint16_t* q_out, uint16_t* k_out, uint16_t* v_out, int32_t* offsets_qk, int32_t* offsets_v,
                   int32_t* lengths, CUstream_st* stream) {
  if (!q.bf16 || !kv.bf16 || !k_rope.bf16) return cudaErrorInvalidValue;  // the cuDNN path is bf16 only
  const Dims dims{static_cast<int>(heads), static_cast<int>(nope_dim), static_cast<int>(rope_dim),
                  static_cast<int>(v_dim), static_cast<int>(nope_dim + rope_dim), static_cast<int>(nope_dim + v_dim)};
  const int64_t tokens = q.rows;
  const int64_t per_token = heads * (2 * (nope_dim + rope_dim) + v_dim);
  if (tokens > 0) {
    PackSdpaKernel<<<GridFor(tokens * per_token, kThreads), kThreads, 0, stream>>>(q, kv, k_rope, dims, tokens, q_out,
                                                                                   k_out, v_out);
  }
  SdpaOffsetsKernel<<<1, kThreads, 0, stream>>>(cu_seqlens, samples, slots, heads * (nope_dim + rope_dim),
                                                heads * v_dim, offsets_qk, offsets_v, lengths);
  return cudaGetLastError();
}

int LaunchUnpackRows(const uint16_t* packed, DeviceMatrix out, CUstream_st* stream) {
  if (out.rows * out.cols == 0) return cudaSuccess;
  UnpackRowsKernel<<<GridFor(out.rows * out.cols, kThreads), kThreads, 0, stream>>>(packed, out);
  return cudaGetLastError();
}

}  // namespace hsx::cuda
