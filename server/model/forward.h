// forward.h: the DeepSeek-V3 / Kimi-K2 prefill forward pass with layer capture.
//
// Written once against kernels/backend.h. A batch is a ragged pack of whole
// samples (cu_seqlens), causal attention within each sample and positions
// restarting at 0 per sample. Capture id k (0 <= k <= N) is R_k, the residual
// stream entering decoder layer k; k = N is the last layer's raw output
// (pre-norm); the post-final-norm state is a separate output (docs/design.md,
// "Layer convention"). The pass stops after the last layer a capture needs,
// and never computes lm_head.
#ifndef HSX_SERVER_MODEL_FORWARD_H_
#define HSX_SERVER_MODEL_FORWARD_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "format/capture_spec.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "server/model/config.h"
#include "server/model/host_buffer_pool.h"
#include "server/model/model_weights.h"

namespace hsx {

// A ragged batch: samples concatenated, sample s = tokens[cu_seqlens[s], cu_seqlens[s+1]).
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> cu_seqlens = {0};

  void AddSample(const std::vector<int32_t>& sample);
  int64_t num_samples() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

// Captured states of one batch, one host buffer per sample (pinned on CUDA,
// from the model's pool), in the activation element type (bf16 in BF16 mode:
// exactly the values the model computed, half the bytes of float32). Sample s
// holds [ids.size() + F][T_s][hidden] (F = 1 with the final norm, last): every
// tensor of a sample is contiguous, and a sample's buffer can be released on
// its own, so a consumer that keeps one sample (a stalled stream) holds that
// sample only, never its batch. Must be released before the engine that
// produced it.
//
// A sample whose consumer sends fp8 rows may instead hold only the tensors
// it asked for, already encoded as fp8 rows (Captures::fp8): Model::Run does
// so where copies cross a bus (Backend::CopyToHostFp8), so that only fp8
// rows cross it and no host thread encodes them.
//
// The copies into the buffers may still run when Model::Run returns (CUDA,
// Backend::FenceCopies): read the rows only after WaitForCopies() returned
// OK. The destructor waits for them too, so no buffer goes back to its pool
// while a copy still writes it.
struct Captures {
  Captures() = default;
  Captures(Captures&&) = default;
  Captures& operator=(Captures&& other) noexcept;  // waits for this one's copies first
  ~Captures() { (void)WaitForCopies(); }
  // OK once every copy into `samples` has landed; the copies' first error otherwise.
  absl::Status WaitForCopies() const { return copies == nullptr ? absl::OkStatus() : copies->Wait(); }

  std::vector<int> ids;
  bool has_final_norm = false;
  int64_t tokens = 0;  // of the batch
  int64_t hidden = 0;
  ElementType type = ElementType::kF32;
  std::vector<int64_t> cu_seqlens = {0};           // the batch's samples
  std::vector<std::unique_ptr<HostBuffer>> samples;  // per sample, as above
  std::shared_ptr<CopyFence> copies;                 // their end (null: nothing to wait for)
  // Per sample, or empty for none: set for a sample copied out as fp8 rows.
  // Its buffer then holds only these tensors (a subset of the batch's: ids
  // ascending, then the final norm if set), each T_s rows of
  // RowBytes(kFp8, hidden) bytes as Backend::CopyToHostFp8 writes them.
  std::vector<std::optional<CaptureSpec>> fp8;

  int64_t num_samples() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
  bool IsFp8(int64_t s) const { return s < static_cast<int64_t>(fp8.size()) && fp8[s].has_value(); }
  // Tensor k (index into ids, or ids.size() for the final norm) of sample s:
  // [T_s, hidden] in `type`, or its fp8 rows; null for a tensor an fp8
  // sample does not hold.
  void* Tensor(int64_t s, size_t k) const;
  // Row t of the batch (any sample) of captured layer `index`, or of the
  // final norm, as float32 into dst[hidden] (an fp8 row decoded: e4m3 *
  // scale; NaN for a tensor its sample does not hold).
  void LayerRow(size_t index, int64_t t, float* dst) const;
  void FinalNormRow(int64_t t, float* dst) const;
  // Bytes of one sample's buffer, and of one tensor in it.
  size_t SampleBytes(int64_t s) const;
  size_t TensorBytes(int64_t s) const;
  // The index of tensor k (as for Tensor) in sample s's buffer, or -1.
  int64_t Slot(int64_t s, size_t k) const;
};

// Per sample of a batch, the capture set of a sample whose consumer sends
// fp8 rows (a subset of the batch's), unset for the others; or empty: none.
using Fp8Samples = std::vector<std::optional<CaptureSpec>>;

// Told of the captured rows as they are written to host memory, a piece at
// a time, while the piece just written is still in cache: the batcher's
// capture check (server/runtime/capture_check.h) reads them there. Only a
// backend whose copies land on return (the CPU) tells it; on the others the
// rows are read after the copies' fence.
class CaptureSink {
 public:
  virtual ~CaptureSink() = default;
  // The next `values` values of tensor `tensor` (index into the capture ids,
  // or their count for the final norm) of sample `sample`, just written at
  // `rows` in the activation type; each tensor's pieces come in row order.
  virtual void Written(int64_t sample, size_t tensor, const void* rows, int64_t values) = 0;
};

// Host-side rotary table: cos/sin [positions, half_dim] exactly as HF computes
// them (model-spec.md §4.1), bf16-rounded in BF16 mode.
struct RopeValues {
  int64_t half_dim = 0;
  std::vector<float> cos;
  std::vector<float> sin;
};

// One rank's forward pass. Every call runs on the rank's own thread (the
// backend's contract); with tensor parallelism every rank runs the same batch
// and meets the others in the communicator's all-reduces.
class Model {
 public:
  // `weights`, `backend` and `communicator` must outlive the model; the
  // communicator is null for tp = 1.
  Model(const ModelConfig& config, const ModelWeights& weights, Backend& backend,
        Communicator* communicator);

  // Runs the batch. With tensor parallelism every rank calls Run with the same
  // batch; rank 0 returns the captures (the others return empty ones). An
  // error from the backend or a collective fails the whole batch. `sink`,
  // when set, is told of the rows rank 0 captures (see CaptureSink).
  // `fp8` (one entry per sample, or empty) names the samples sent as fp8 and
  // the tensors each wants: on a backend whose copies do not land on return
  // (CUDA) exactly those are copied out, encoded on the device
  // (Backend::CopyToHostFp8, Captures::fp8); where they land on return (the
  // CPU) it changes nothing: the sink encodes them as they land.
  // InvalidArgument for a wrong count or a tensor the batch does not capture.
  absl::StatusOr<Captures> Run(const Batch& batch, const CaptureSpec& capture, CaptureSink* sink = nullptr,
                               const Fp8Samples& fp8 = {});

  // The softmax scale: qk_head_dim^-0.5 times YaRN's mscale² (model-spec.md §4.2).
  static float SoftmaxScale(const ModelConfig& config);
  // cos/sin for positions [0, positions) exactly as HF computes them (§4.1).
  static RopeValues MakeRopeValues(const ModelConfig& config, int64_t positions, ElementType precision);

 private:
  absl::Status CheckBatch(const Batch& batch) const;
  // Run's capture buffers, one per sample from the pool (rank 0 only), for
  // `result`'s layout (its fp8 samples included).
  absl::Status TakeCaptureBuffers(Captures& result);
  absl::Status EnsureRope(int64_t positions);
  absl::Status RunLayer(const LayerWeights& layer, const StagedBatch& batch, const Matrix& h);
  absl::Status RunAttention(const LayerWeights& layer, const Matrix& x, const StagedBatch& batch,
                            const Matrix& out);
  absl::Status RunMlp(const MlpWeights& mlp, const Matrix& x, const Matrix& out);
  absl::Status RunMoe(const LayerWeights& layer, const Matrix& x, const Matrix& out);
  absl::Status Embed(const StagedBatch& batch, const Matrix& h);
  // CopyToHost of `rows` into `dst` a piece at a time, `sink` told of each
  // piece right after it is written (sample `s`, tensor `k`).
  void CopyToSink(const Matrix& rows, void* dst, CaptureSink& sink, int64_t s, size_t k);
  // True when this model is one rank of several: split blocks end in partial sums.
  bool split() const;
  // Where a split block writes its partial sum for `out`: `out` itself when
  // nothing is split or it is already f32, else an f32 scratch of its shape.
  absl::StatusOr<Matrix> PartialFor(const Matrix& out);
  // Sums a partial over ranks, then rounds it into `out` as the unsplit op
  // would have (nothing to do unsplit: the op wrote `out` itself).
  absl::Status Reduce(const Matrix& partial, const Matrix& out);
  // A scratch matrix that lives until the end of the current layer.
  absl::StatusOr<Matrix> Scratch(int64_t rows, int64_t cols);
  absl::StatusOr<Matrix> Scratch(int64_t rows, int64_t cols, ElementType type);

  const ModelConfig& config_;
  const ModelWeights& weights_;
  Backend& backend_;
  Communicator* communicator_;
  std::unique_ptr<RopeTable> rope_;
  float softmax_scale_;
  std::vector<std::unique_ptr<Buffer>> scratch_;  // released after each layer, in stream order
  // Capture buffers (pinned on CUDA), reused from batch to batch: a fresh
  // buffer per batch costs a page fault per 4 KiB. Captures hold leases.
  std::unique_ptr<HostBufferPool> host_pool_;
};

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_FORWARD_H_
