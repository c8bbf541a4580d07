// backend.h: the operations the model's forward graph is written against.
//
// The forward pass (server/model/forward.h) is written once against this
// interface; the CPU backend (kernels/cpu/) is the reference and the CUDA
// backend implements the same contract on device memory. Contract for every
// implementation:
//   * Activations are row-major float32 matrices (Matrix) in backend memory,
//     one row per token of a ragged batch. In Precision::kBf16 every value an
//     op writes is a bfloat16 value, rounded where the Hugging Face BF16
//     reference rounds (model-spec.md §4); in kFp32 nothing is rounded.
//   * Row independence: row t of any output depends only on row t of the
//     inputs (and, for Attention, on the rows of t's own sample), computed in
//     an order fixed by the op's sizes, never by the batch. This is what makes
//     a sample's hidden states identical whichever samples share its batch.
//   * Weights are read in place from the checkpoint mapping (bf16 or INT4);
//     nothing is expanded to float32 in full.
//   * Calls are ordered: an op sees the results of every earlier op (a CUDA
//     backend queues them on one stream).
#ifndef HSX_KERNELS_BACKEND_H_
#define HSX_KERNELS_BACKEND_H_

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace hsx {

enum class Precision { kFp32, kBf16 };

// A view of a row-major float32 matrix with row stride `ld`.
struct Matrix {
  float* data = nullptr;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;

  float* row(int64_t r) const { return data + r * ld; }
  // Columns [begin, begin + count) of every row.
  Matrix Cols(int64_t begin, int64_t count) const { return {data + begin, rows, count, ld}; }
  Matrix Rows(int64_t begin, int64_t count) const { return {data + begin * ld, count, cols, ld}; }
};

// A Linear weight W [out, in], as stored in the checkpoint.
struct LinearWeight {
  enum class Kind { kBf16, kInt4 };
  Kind kind = Kind::kBf16;
  const uint16_t* bf16 = nullptr;  // kBf16: W[o][i] = bf16[o * ld + i] (ld > in: a column slice)
  int64_t ld = 0;
  const int32_t* packed = nullptr;  // kInt4: pack-quantized rows, see kernels/cpu/int4_dequant.h
  const uint16_t* scale = nullptr;
  int64_t group_size = 0;
  int64_t out = 0;
  int64_t in = 0;
};

// One routed expert's SiLU-gated MLP.
struct ExpertWeights {
  LinearWeight gate;  // [moe_intermediate, hidden]
  LinearWeight up;    // [moe_intermediate, hidden]
  LinearWeight down;  // [hidden, moe_intermediate]
};

// The MoE router of one layer (model-spec.md §4 item 7).
struct RouterParams {
  const uint16_t* weight = nullptr;  // bf16 [experts, hidden]
  const float* bias = nullptr;       // e_score_correction_bias [experts], used for selection only
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool softmax_scores = false;  // false: sigmoid
  bool normalize = true;        // norm_topk_prob
  float scaling = 1.0f;         // routed_scaling_factor
};

// Per token, the chosen experts and their combine weights.
struct Routing {
  int64_t top_k = 0;
  std::vector<int32_t> experts;  // [tokens, top_k]
  std::vector<float> weights;    // [tokens, top_k]
};

// Rotary embedding table: cos/sin [positions, rope_dim / 2], float32 (already
// bf16-rounded in kBf16 mode, as HF casts them to the activation dtype).
struct RopeTable {
  int64_t half_dim = 0;
  std::vector<float> cos;
  std::vector<float> sin;
};

// Owns one activation buffer in backend memory.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual Matrix matrix() const = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual Precision precision() const = 0;

  // A rows x cols buffer (contents unspecified).
  virtual std::unique_ptr<Buffer> Allocate(int64_t rows, int64_t cols) = 0;
  // Copies a matrix to host memory (row-major, cols floats per row).
  virtual void CopyToHost(const Matrix& src, float* dst) = 0;

  // out[t] = embedding row tokens[t] (bf16 table [vocab, hidden]); rows
  // outside [vocab_begin, vocab_begin + vocab_rows) are zero (vocabulary-split
  // tensor parallelism; the all-reduce completes them).
  virtual void Embed(std::span<const int32_t> tokens, const uint16_t* table, int64_t vocab_begin,
                     int64_t vocab_rows, const Matrix& out) = 0;
  // y = x · Wᵀ. A `partial` output (one tensor-parallel rank's share, to be
  // all-reduced) is left unrounded; Round() after the all-reduce rounds it
  // once, as the unsplit GEMM would have.
  virtual void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) = 0;
  // Rounds to the activation dtype in place (bfloat16 in kBf16, nothing in kFp32).
  virtual void Round(const Matrix& x) = 0;
  // y = RMSNorm(x) * weight (bf16 [cols]).
  virtual void RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) = 0;
  // out = a + b.
  virtual void Add(const Matrix& a, const Matrix& b, const Matrix& out) = 0;
  // out = silu(gate) * up.
  virtual void SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) = 0;
  // Interleaved (DeepSeek) rotary embedding in place on `heads` vectors of
  // rope_dim = 2 * half_dim columns per row, head h at columns
  // [offset + h * stride, + rope_dim). Output in half-split order
  // [x0', x2', ..., x1', x3', ...] as HF's apply_rotary_pos_emb_interleave.
  virtual void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset,
                    std::span<const int32_t> positions, const RopeTable& table) = 0;
  // Multi-head latent attention, causal within each sample of a ragged batch
  // (cu_seqlens: sample s covers rows [cu[s], cu[s + 1])). For head h:
  //   Q_h = q[:, h * (nope + rope) : (h + 1) * (nope + rope)]
  //   K_h = [kv[:, h * (nope + v_dim) : + nope] | k_rope]   (k_rope shared by all heads)
  //   V_h = kv[:, h * (nope + v_dim) + nope : + v_dim]
  //   out[:, h * v_dim : + v_dim] = softmax(Q_h K_hᵀ * scale, causal) V_h
  virtual void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads,
                         int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
                         std::span<const int64_t> cu_seqlens, float scale, const Matrix& out) = 0;
  // Chooses experts per token; logits and weights in float32.
  virtual void Route(const Matrix& x, const RouterParams& router, Routing* routing) = 0;
  // out[t] = sum over token t's chosen experts e held here (experts[e] non-null
  // entry in `experts`, indexed by global expert id) of weight * expert_e(x[t]),
  // accumulated in ascending expert id; experts not held contribute nothing
  // (expert-parallel ranks; the all-reduce completes the sum).
  // `partial` as for Linear: the float32 sum is left unrounded.
  virtual void MoeExperts(const Matrix& x, const Routing& routing,
                          std::span<const ExpertWeights* const> experts, const Matrix& out,
                          bool partial) = 0;
};

// A CPU backend (the reference): `threads` <= 0 uses every hardware thread.
std::unique_ptr<Backend> MakeCpuBackend(Precision precision, int threads);

}  // namespace hsx

#endif  // HSX_KERNELS_BACKEND_H_
