// ops.h: launchers of the CUDA backend's hand-written kernels (elementwise.cu,
// attention.cu, moe.cu, fp8_rows.cu, collective.cu). Each kernel sits beside
// the CPU reference it mirrors (kernels/cpu/cpu_backend.cc,
// kernels/reference/reference_ops.cc) and does the same float32 operations in
// the same order, so that most ops agree with the CPU backend bit for bit
// (the .cu files are built with -fmad=false: nothing is contracted into an
// FMA unless the reference calls fma).
//
// Conventions, for every launcher:
//  * All pointers are device pointers; `stream` is a cudaStream_t.
//  * Shapes were checked by the caller (CudaBackend); launchers only launch.
//  * The return value is the launch status as an int (a cudaError_t; 0 is
//    cudaSuccess). Errors while the kernel runs surface at the next sync.
//  * `round` is true in ElementType::kBf16: intermediate values are rounded to
//    bf16 exactly where the HF BF16 reference rounds (R() in the CPU code).
//  * Every sum's order depends only on the op's non-row sizes, never on the
//    row count or the launch geometry (backend.h, batch invariance (a)).
#ifndef HSX_KERNELS_CUDA_OPS_H_
#define HSX_KERNELS_CUDA_OPS_H_

#include <cstdint>

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hsx::cuda {

// A row-major matrix in device memory whose element type is a run-time flag
// (one kernel serves f32 and bf16: the branch is uniform per launch, and the
// ops are memory-bound).
struct DeviceMatrix {
  void* data = nullptr;
  bool bf16 = false;  // else f32
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;
};

// ---- elementwise.cu -----------------------------------------------------------

// out[t] = table[tokens[t] - vocab_begin] (bf16 rows of out.cols), or zeros
// when the token is outside [vocab_begin, vocab_begin + vocab_rows).
int LaunchEmbed(const int32_t* tokens, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
                DeviceMatrix out, CUstream_st* stream);
// out = in converted to out's type (rounding to bf16 when out is bf16).
int LaunchConvert(DeviceMatrix in, DeviceMatrix out, CUstream_st* stream);
// y = RMSNorm(x) * weight; the sum of squares in double over four interleaved
// lanes, ((l0 + l1) + (l2 + l3)), as the reference. x and y may alias.
int LaunchRmsNorm(DeviceMatrix x, const uint16_t* weight, float eps, bool round, DeviceMatrix y,
                  CUstream_st* stream);
int LaunchAdd(DeviceMatrix a, DeviceMatrix b, bool round, DeviceMatrix out, CUstream_st* stream);
// out = R(R(silu(gate)) * up); out may alias gate or up.
int LaunchSiluMul(DeviceMatrix gate, DeviceMatrix up, bool round, DeviceMatrix out, CUstream_st* stream);
// In-place interleaved rotary embedding (see Backend::Rope); cos/sin are
// float [positions, half_dim], positions[r] is row r's position.
int LaunchRope(DeviceMatrix x, int64_t heads, int64_t stride, int64_t offset, int64_t half_dim,
               const int32_t* positions, const float* cos, const float* sin, bool round, CUstream_st* stream);
// `count` pseudo-random values in [-1, 1) (bf16 bits or f32), a function of
// (seed, index): test data generated on the device.
int LaunchFillPattern(void* data, int64_t count, bool bf16, uint32_t seed, CUstream_st* stream);
// Raw bf16 -> f32 (exact), `count` values.
int LaunchBf16ToF32(const uint16_t* in, float* out, int64_t count, CUstream_st* stream);

// ---- attention.cu -------------------------------------------------------------

// Query rows per attention block; Stage() builds the tile table for it.
constexpr int64_t kAttentionQueryTile = 16;

// One attention work item: sample `sample`, query rows [q0, q0 + tile) of it
// (clipped to the sample).
struct AttentionTile {
  int32_t sample;
  int32_t q0;  // relative to the sample's first row
};

// Causal attention within each sample (Backend::Attention), as the CPU
// reference computes it: each score a fma dot product over d ascending,
// rounded and scaled as the contract says, a two-pass softmax (max, then the
// sum of exp over keys ascending), probabilities rounded, then each output a
// fma dot product over keys ascending. Scores are recomputed per pass instead
// of stored. `tiles` has `num_tiles` entries, one per kAttentionQueryTile
// query rows of each sample; heads are the grid's second dimension.
int LaunchAttention(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, int64_t heads, int64_t nope_dim,
                    int64_t rope_dim, int64_t v_dim, const int64_t* cu_seqlens, const AttentionTile* tiles,
                    int64_t num_tiles, float scale, bool round, DeviceMatrix out, CUstream_st* stream);

// Packs the operands of cuDNN's SDPA (cudnn_attention.h), bf16: q_out and
// k_out [tokens, heads, nope + rope] (K_h = [k_nope_h | k_rope]), v_out
// [tokens, heads, v_dim]. Also writes, for `slots` >= samples sample slots,
// offsets_qk / offsets_v [slots + 1] (element offsets of each sample's first
// row, = tokens for unused slots) and lengths [slots] (0 for unused slots).
int LaunchPackSdpa(DeviceMatrix q, DeviceMatrix kv, DeviceMatrix k_rope, int64_t heads, int64_t nope_dim,
                   int64_t rope_dim, int64_t v_dim, const int64_t* cu_seqlens, int64_t samples, int64_t slots,
                   uint16_t* q_out, uint16_t* k_out, uint16_t* v_out, int32_t* offsets_qk, int32_t* offsets_v,
                   int32_t* lengths, CUstream_st* stream);
// out = packed [rows, cols] bf16 (contiguous), converted to out's type.
int LaunchUnpackRows(const uint16_t* packed, DeviceMatrix out, CUstream_st* stream);

// ---- moe.cu -------------------------------------------------------------------

// The largest top_k and expert count Route supports.
constexpr int64_t kMaxTopK = 64;
constexpr int64_t kMaxExperts = 1024;

struct RouterArgs {
  const float* bias = nullptr;  // may be null
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool softmax_scores = false;
  bool normalize = true;
  float scaling = 1.0f;
};

// From float32 logits [tokens, num_experts] (row stride num_experts): scores,
// group-limited top-k (ties: lower id), renormalised and scaled weights.
// experts/weights: [tokens, top_k], ascending id per token.
int LaunchRoute(const float* logits, int64_t tokens, RouterArgs router, int32_t* experts, float* weights,
                CUstream_st* stream);

// counts[e] = number of tokens that chose expert e, for every e with held[e]
// (0 for the others). One block per expert; no atomics.
int LaunchExpertCounts(const int32_t* experts, int64_t tokens, int64_t top_k, const uint8_t* held,
                       int64_t num_experts, int32_t* counts, CUstream_st* stream);
// A stable counting sort of the (token, slot) pairs by expert: held experts in
// ascending id, each expert's tokens in ascending order. offsets[e] is the
// first row of expert e (the exclusive prefix sum of counts over held
// experts, computed on the host). Writes rows[offset + i] = token and
// slot_row[t * top_k + slot] = its row (-1 for experts held elsewhere); a slot
// whose id is outside [0, num_experts) is not written (the caller fills
// slot_row with -1 first).
int LaunchExpertRows(const int32_t* experts, int64_t tokens, int64_t top_k, const uint8_t* held,
                     int64_t num_experts, const int32_t* offsets, int32_t* rows, int32_t* slot_row,
                     CUstream_st* stream);
// out[i] = x[rows[i]] for i < out.rows (same element type).
int LaunchGatherRows(DeviceMatrix x, const int32_t* rows, DeviceMatrix out, CUstream_st* stream);
// out[t] = sum over slots i (ascending, i.e. ascending expert id) with
// slot_row >= 0 of y[slot_row] * weight, rounded unless `partial`.
int LaunchCombine(DeviceMatrix y, const int32_t* slot_row, const float* weights, int64_t top_k, bool round,
                  DeviceMatrix out, CUstream_st* stream);

// ---- fp8_rows.cu -----------------------------------------------------------------

// Each row of `src` (bf16 or f32) encoded as an fp8 row into `dst` (device
// memory, src.rows * (4 + src.cols) bytes, packed, any alignment) by the
// rule of kernels/fp8_e4m3.h, a row with a non-finite value marked as it
// says: the bytes EncodeFp8RowScalar writes. One block per row (the largest
// |value| reduced in the block, then the quotients); src.cols < 2^31.
int LaunchFp8Rows(DeviceMatrix src, void* dst, CUstream_st* stream);
// out[i] = Fp8Quantize(bf16 values[i], scale) for i < count: the device's
// division and rounding alone, for the tests (every bf16 value under a scale).
int LaunchFp8Quantize(const uint16_t* values, int64_t count, float scale, uint8_t* out, CUstream_st* stream);

// ---- collective.cu --------------------------------------------------------------

// The most ranks a collective kernel sums (its pointers travel by value).
constexpr int kMaxCollectiveRanks = 16;

// out[i] = ((sources[0][i] + sources[1][i]) + sources[2][i]) + ... for i <
// count: the contract's rank-order sum (kernels/communicator.h), one thread
// per element, the same arithmetic whatever count or the launch geometry.
// `out` may be one of the sources (each element is read before it is
// written, by the same thread). 1 <= n <= kMaxCollectiveRanks.
int LaunchSumInRankOrder(const float* const* sources, int n, float* out, int64_t count, CUstream_st* stream);

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_OPS_H_
