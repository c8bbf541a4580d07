// backend.h: the operations the model's forward graph is written against
// (contract v2).
//
// The forward pass (server/model/forward.h) is written once against this
// interface. The CPU backend (kernels/cpu/) is the reference; a CUDA backend
// implements the same contract on device memory. kernels/reference/ holds a
// plain-loop reference for every op, and tests/conformance/ checks any backend
// against it, op by op.
//
// The contract, for every implementation:
//
//  * Who calls. A backend belongs to one tensor-parallel rank and is called
//    from that rank's thread only (the engine's rank worker, which creates it
//    and destroys it). Nothing in it is thread-safe, and nothing needs to be.
//
//  * Ordering and completion. Ops are enqueued in call order; each sees the
//    results of every op enqueued before it. An op may return before it has
//    run (a CUDA backend queues it on one stream; the CPU backend runs it at
//    once). Results reach host memory only through CopyToHost (or
//    CopyToHostFp8), and are visible there once Synchronize() has returned OK.
//
//  * Errors. Ops return nothing: an op that fails (bad sizes, an injected
//    fault, a device error) records the error, and Synchronize() returns the
//    first error recorded since the previous Synchronize() (then clears it).
//    Every call that can fail before anything is enqueued (allocation,
//    placement, staging) returns its Status at once.
//
//  * Ownership. Every Buffer, HostBuffer, StagedBatch, RopeTable, Routing and
//    ExpertTable a backend returns is owned by the caller and must be
//    destroyed before the backend. Destroying one releases its memory in
//    stream order: ops already enqueued that use it still see it. Weights
//    placed with Place*() live until the backend is destroyed. Matrix,
//    LinearWeight and RouterParams are non-owning views.
//
//  * Element types. Activations are row-major matrices of the activation type:
//    bf16 in ElementType::kBf16, f32 in kF32. In kBf16 every value an op writes
//    to an activation is rounded where the Hugging Face BF16 reference rounds
//    (model-spec.md §4); in kF32 nothing is rounded. Partial sums (a
//    tensor-parallel rank's share of a split block, `partial` outputs) are
//    always f32 and stay unrounded until Round().
//
//  * Batch invariance (a). Each output element's arithmetic, including the
//    order of every sum, depends only on the op's non-row sizes (K, N, heads,
//    head dims, top_k) and on the values of its own row (for Attention: the
//    rows of its own sample up to itself). It never depends on the number of
//    rows, on the row's position in the batch, on the other samples in the
//    batch, or on the thread or block count. A GEMM library must therefore be
//    pinned to one algorithm per (N, K, types), with no split-K or stream-K
//    whose split varies with M. This is what makes a sample's hidden states
//    bitwise identical whichever samples share its batch.
//
//  * Batch invariance (b), for communicators (kernels/communicator.h): an
//    all-reduce sums each element over ranks in one fixed order (rank 0 +
//    rank 1 + ...), identical on every rank and independent of the matrix's
//    size. A ring or tree all-reduce that chunks by buffer length does not
//    meet this.
#ifndef HSX_KERNELS_BACKEND_H_
#define HSX_KERNELS_BACKEND_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace hsx {

// The element type of a matrix in backend memory, and a backend's precision:
// the type its activations are stored in.
enum class ElementType { kF32, kBf16 };

inline size_t ElementSize(ElementType type) { return type == ElementType::kF32 ? 4 : 2; }
const char* ElementTypeName(ElementType type);

// A non-owning view of a row-major matrix in backend memory, with row stride
// `ld` in elements.
struct Matrix {
  void* data = nullptr;
  ElementType type = ElementType::kF32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t ld = 0;

  // The address of element (r, c). Host-side arithmetic only: on a device
  // backend the result is a device address.
  void* at(int64_t r, int64_t c) const {
    return static_cast<char*>(data) + (r * ld + c) * static_cast<int64_t>(ElementSize(type));
  }
  // Columns [begin, begin + count) of every row.
  Matrix Cols(int64_t begin, int64_t count) const { return {at(0, begin), type, rows, count, ld}; }
  // Rows [begin, begin + count).
  Matrix Rows(int64_t begin, int64_t count) const { return {at(begin, 0), type, count, cols, ld}; }
};

// A Linear weight W [out, in]. Before placement it describes a rank's share in
// host memory (a view into the checkpoint mapping); after Backend::PlaceLinear
// it describes where the backend keeps it.
struct LinearWeight {
  enum class Kind { kBf16, kInt4 };
  Kind kind = Kind::kBf16;
  const uint16_t* bf16 = nullptr;  // kBf16: W[o][i] = bf16[o * ld + i] (ld > in: a column slice)
  int64_t ld = 0;
  const int32_t* packed = nullptr;  // kInt4: pack-quantized rows, see kernels/cpu/int4_dequant.h
  const uint16_t* scale = nullptr;  // kInt4: bf16 [out, in / group_size]
  int64_t group_size = 0;
  int64_t out = 0;
  int64_t in = 0;

  // Bytes of the weight itself (a column slice counts its own columns only).
  int64_t bytes() const;
};

// One routed expert's SiLU-gated MLP.
struct ExpertWeights {
  LinearWeight gate;  // [moe_intermediate, hidden]
  LinearWeight up;    // [moe_intermediate, hidden]
  LinearWeight down;  // [hidden, moe_intermediate]
};

// One MoE layer's routed experts as the backend keeps them: indexed by global
// expert id, holding only this rank's experts (expert parallelism).
class ExpertTable {
 public:
  virtual ~ExpertTable() = default;
  virtual int64_t num_experts() const = 0;
  virtual bool holds(int64_t expert) const = 0;
};

// The MoE router of one layer (model-spec.md §4 item 7). Pointers are placed.
struct RouterParams {
  const uint16_t* weight = nullptr;  // bf16 [experts, hidden]
  const float* bias = nullptr;       // e_score_correction_bias [experts], for selection only; may be null
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool softmax_scores = false;  // false: sigmoid
  bool normalize = true;        // norm_topk_prob
  float scaling = 1.0f;         // routed_scaling_factor
};

// Per token, the chosen experts (ascending id) and their combine weights, in
// backend memory. Opaque: routing never has to leave the backend.
class Routing {
 public:
  virtual ~Routing() = default;
  virtual int64_t tokens() const = 0;
  virtual int64_t top_k() const = 0;
};

// A ragged batch staged in backend memory once per batch: token ids, each
// token's position within its sample, and cu_seqlens (sample s covers rows
// [cu[s], cu[s + 1])). The host-side sizes stay readable.
class StagedBatch {
 public:
  virtual ~StagedBatch() = default;
  virtual int64_t tokens() const = 0;
  virtual int64_t num_samples() const = 0;
  virtual int64_t longest() const = 0;  // the longest sample's length
};

// Rotary embedding table in backend memory: cos/sin [positions, half_dim],
// float32 (already bf16-rounded in kBf16 mode, as HF casts them to the
// activation dtype).
class RopeTable {
 public:
  virtual ~RopeTable() = default;
  virtual int64_t positions() const = 0;
  virtual int64_t half_dim() const = 0;
};

// Owns one matrix in backend memory.
class Buffer {
 public:
  virtual ~Buffer() = default;
  virtual Matrix matrix() const = 0;
};

// Owns host memory a backend can copy into asynchronously (pinned on CUDA).
class HostBuffer {
 public:
  virtual ~HostBuffer() = default;
  virtual void* data() const = 0;
  virtual size_t bytes() const = 0;
};

// The end of the capture copies (CopyToHost) a backend enqueued before its
// FenceCopies(). Wait() blocks until they have landed in host memory and
// returns their first error, the same on every call. Unlike the backend, a
// fence may be waited on from any thread (the batcher's delivery thread), and
// by several at once. It must be destroyed before its backend.
class CopyFence {
 public:
  virtual ~CopyFence() = default;
  virtual absl::Status Wait() = 0;
};

// A fence with nothing left to wait for; Wait() returns `status`.
std::shared_ptr<CopyFence> CompletedCopyFence(absl::Status status = absl::OkStatus());

class Backend {
 public:
  virtual ~Backend() = default;
  // The element type of the activations this backend computes in.
  virtual ElementType precision() const = 0;
  // "cpu", "cuda:0", ...: for logs and errors.
  virtual std::string name() const = 0;

  // ---- Memory ------------------------------------------------------------
  // A rows x cols matrix of `type` (contents unspecified).
  virtual absl::StatusOr<std::unique_ptr<Buffer>> Allocate(int64_t rows, int64_t cols,
                                                           ElementType type) = 0;
  // Host memory for CopyToHost targets (contents unspecified).
  virtual absl::StatusOr<std::unique_ptr<HostBuffer>> AllocateHost(size_t bytes) = 0;
  // Enqueues a copy of `src` to host memory, rows packed (src.cols elements
  // per row, in src's element type). `dst` must stay valid until the next
  // Synchronize() returns, or the fence of the next FenceCopies() completes;
  // on CUDA it must lie in a HostBuffer of this backend.
  virtual void CopyToHost(const Matrix& src, void* dst) = 0;
  // Enqueues src's rows encoded as fp8 rows into host memory at `dst`, as
  // CopyToHost does (the same rules for `dst`, Synchronize and FenceCopies):
  // per row kFp8ScaleBytes + src.cols bytes, its float32 scale then one e4m3
  // byte per value, by the rule of kernels/fp8_e4m3.h, so that every backend
  // writes the bytes the host encoder (format/fp8.h, EncodeFp8Tensor) writes
  // for the same finite rows. A row holding a non-finite value is marked,
  // not encoded (kernels/fp8_e4m3.h): its scale is that value (the first in
  // the row), so every fp8 reader refuses it, and the value bytes say where
  // it was (CheckFp8Tensor reports it as the value at that index). Not an
  // error: the sample it belongs to fails, its batch does not.
  // Why: a device backend's copies cross PCIe, and fp8 rows are hidden + 4
  // bytes instead of 2 * hidden; the host then only checks and hashes them.
  virtual void CopyToHostFp8(const Matrix& src, void* dst) = 0;
  // True when CopyToHost and CopyToHostFp8 have written `dst` by the time
  // they return (the CPU backend): the caller may read the rows at once,
  // while they are in cache.
  virtual bool copies_land_on_return() const { return false; }
  // Enqueues a copy of host rows (packed, dst.cols elements of dst's type per
  // row) into `dst`. `src` must stay valid until the next Synchronize().
  virtual void CopyFromHost(const void* src, const Matrix& dst) = 0;
  // Waits for every enqueued op; returns the first error recorded since the
  // previous call, and clears it.
  virtual absl::Status Synchronize() = 0;
  // Synchronize() for everything but the capture copies, so that the next
  // batch can start while they finish: waits for every other op and returns
  // (and clears) the first error, as Synchronize() does. On success the
  // copies may still run: their destinations are written, and must stay
  // valid, until the returned fence completes. On error every copy has ended
  // too. The default, right for a backend whose copies are done when
  // CopyToHost returns (the CPU backend), is Synchronize() and a completed
  // fence. Wrappers (ForwardingBackend) keep the default, so that their own
  // Synchronize() still runs.
  virtual absl::StatusOr<std::shared_ptr<CopyFence>> FenceCopies();

  // ---- Placement (at load; the results live as long as the backend) --------
  // Places a rank's share of a Linear weight (host view, see LinearWeight).
  virtual absl::StatusOr<LinearWeight> PlaceLinear(const LinearWeight& host) = 0;
  // Places a small tensor (norm weights, router bias, embedding rows).
  virtual absl::StatusOr<const void*> PlaceTensor(const void* host, size_t bytes) = 0;
  // Places one MoE layer's experts: `host[e]` for every global expert id e
  // with held[e]; the others are not this rank's and are not read.
  virtual absl::StatusOr<std::unique_ptr<ExpertTable>> PlaceExperts(
      std::span<const ExpertWeights> host, std::span<const bool> held) = 0;
  // Bytes of weights placed so far (the memory plan's unit).
  virtual int64_t placed_bytes() const = 0;

  // ---- Per batch -----------------------------------------------------------
  // Stages a ragged batch; positions restart at 0 in every sample.
  virtual absl::StatusOr<std::unique_ptr<StagedBatch>> Stage(std::span<const int32_t> tokens,
                                                             std::span<const int64_t> cu_seqlens) = 0;
  // Places a rotary table built on the host (cos and sin, [positions, half_dim]).
  virtual absl::StatusOr<std::unique_ptr<RopeTable>> PlaceRopeTable(std::span<const float> cos,
                                                                   std::span<const float> sin,
                                                                   int64_t half_dim) = 0;
  virtual absl::StatusOr<std::unique_ptr<Routing>> AllocateRouting(int64_t tokens, int64_t top_k) = 0;

  // ---- Ops -------------------------------------------------------------------
  // out[t] = embedding row of token t (bf16 table [vocab_rows, hidden] holding
  // vocabulary rows [vocab_begin, vocab_begin + vocab_rows)); tokens outside
  // that range give zero rows (vocabulary-split tensor parallelism: the
  // all-reduce completes them). `out` may be f32 or the activation type (the
  // values are bf16 either way, so nothing rounds).
  virtual void Embed(const StagedBatch& batch, const uint16_t* table, int64_t vocab_begin,
                     int64_t vocab_rows, const Matrix& out) = 0;
  // y = x · Wᵀ with float32 accumulation. x is an activation. Unless
  // `partial`, y is an activation (rounded once in kBf16); a `partial` y (one
  // rank's share of a split product, to be all-reduced) is f32, unrounded.
  virtual void Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) = 0;
  // out = the f32 `partial` rounded to the activation type, as the unsplit op
  // would have written it. `out` may be `partial` itself when both are f32.
  virtual void Round(const Matrix& partial, const Matrix& out) = 0;
  // y = RMSNorm(x) * weight (bf16 [cols]); x and y may be the same matrix.
  virtual void RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) = 0;
  // out = a + b (out may alias a or b).
  virtual void Add(const Matrix& a, const Matrix& b, const Matrix& out) = 0;
  // out = silu(gate) * up (out may alias gate or up).
  virtual void SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) = 0;
  // Interleaved (DeepSeek) rotary embedding in place on `heads` vectors of
  // rope_dim = 2 * half_dim columns per row, head h at columns
  // [offset + h * stride, + rope_dim), at each row's staged position. Output
  // in half-split order [x0', x2', ..., x1', x3', ...] as HF's
  // apply_rotary_pos_emb_interleave.
  virtual void Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset,
                    const StagedBatch& batch, const RopeTable& table) = 0;
  // Multi-head latent attention, causal within each staged sample. For head h:
  //   Q_h = q[:, h * (nope + rope) : (h + 1) * (nope + rope)]
  //   K_h = [kv[:, h * (nope + v_dim) : + nope] | k_rope]   (k_rope shared by all heads)
  //   V_h = kv[:, h * (nope + v_dim) + nope : + v_dim]
  //   out[:, h * v_dim : + v_dim] = softmax(Q_h K_hᵀ * scale, causal) V_h
  virtual void Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads,
                         int64_t nope_dim, int64_t rope_dim, int64_t v_dim, const StagedBatch& batch,
                         float scale, const Matrix& out) = 0;
  // Chooses top_k experts per token of x: float32 logits, sigmoid or softmax
  // scores, the bias added for selection only, group-limited top-k (ties:
  // lower id first), renormalised and scaled weights.
  virtual void Route(const Matrix& x, const RouterParams& router, Routing& routing) = 0;
  // out[t] = sum over token t's chosen experts e that `experts` holds, in
  // ascending expert id, of weight * expert_e(x[t]); experts held elsewhere
  // contribute nothing (the all-reduce completes the sum). `partial` as for
  // Linear.
  virtual void MoeExperts(const Matrix& x, const Routing& routing, const ExpertTable& experts,
                          const Matrix& out, bool partial) = 0;
  // Enqueues a copy of the routing to host memory ([tokens, top_k] each), for
  // tests and debugging; visible after Synchronize().
  virtual void CopyRoutingToHost(const Routing& routing, int32_t* experts, float* weights) = 0;
};

// A CPU backend (the reference): `threads` <= 0 uses every hardware thread.
std::unique_ptr<Backend> MakeCpuBackend(ElementType precision, int threads);

}  // namespace hsx

#endif  // HSX_KERNELS_BACKEND_H_
