// forward.h: the DeepSeek-V3 / Kimi-K2 prefill forward pass with layer capture.
//
// Written once against kernels/backend.h. A batch is a ragged pack of whole
// samples (cu_seqlens), causal attention within each sample and positions
// restarting at 0 per sample. Capture id k (0 <= k <= N) is R_k, the residual
// stream entering decoder layer k; k = N is the last layer's raw output
// (pre-norm); the post-final-norm state is a separate output (DESIGN.md,
// "Layer convention"). The pass stops after the last layer a capture needs,
// and never computes lm_head.
#ifndef HSX_SERVER_MODEL_FORWARD_H_
#define HSX_SERVER_MODEL_FORWARD_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"
#include "server/model/config.h"
#include "server/model/model_weights.h"

namespace hsx {

// What to capture: ids sorted, unique, in [0, N].
struct CaptureSpec {
  std::vector<int> ids;
  bool final_norm = false;
};

// Parses "eagle3" ({2, N/2, N-3, N}), "all" (0..N) or a comma-separated list;
// errors name the offending id.
absl::StatusOr<CaptureSpec> ParseCaptureSpec(const std::string& text, const ModelConfig& config,
                                             bool final_norm);

// A ragged batch: samples concatenated, sample s = tokens[cu_seqlens[s], cu_seqlens[s+1]).
struct Batch {
  std::vector<int32_t> tokens;
  std::vector<int64_t> cu_seqlens = {0};

  void AddSample(const std::vector<int32_t>& sample);
  int64_t num_samples() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }
};

// An allocator whose resize() leaves floats uninitialised: capture buffers
// are written in full right after, and zeroing gigabytes first costs a pass
// over memory (and its page faults) for nothing.
template <typename T>
struct UninitializedAllocator : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = UninitializedAllocator<U>;
  };
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(p)) U;
    } else {
      ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
    }
  }
};
using UninitializedFloats = std::vector<float, UninitializedAllocator<float>>;

// Captured states in host memory, float32 (bfloat16-exact in BF16 mode).
struct Captures {
  std::vector<int> ids;
  int64_t tokens = 0;
  int64_t hidden = 0;
  UninitializedFloats layers;      // [ids.size(), tokens, hidden]
  UninitializedFloats final_norm;  // [tokens, hidden] when requested

  const float* layer(size_t index) const { return layers.data() + index * tokens * hidden; }
};

class Model {
 public:
  // `weights` and `backend` must outlive the model; `communicator` is null for tp = 1.
  Model(const ModelConfig& config, const ModelWeights& weights, Backend& backend,
        Communicator* communicator);

  // Runs the batch. With tensor parallelism every rank calls Run with the same
  // batch; every rank returns the same captures.
  absl::StatusOr<Captures> Run(const Batch& batch, const CaptureSpec& capture);

  // The softmax scale: qk_head_dim^-0.5 times YaRN's mscale² (model-spec.md §4.2).
  static float SoftmaxScale(const ModelConfig& config);
  // cos/sin for positions [0, positions) exactly as HF computes them (§4.1).
  static RopeTable MakeRopeTable(const ModelConfig& config, int64_t positions, Precision precision);

 private:
  absl::Status CheckBatch(const Batch& batch) const;
  void RunAttention(const LayerWeights& layer, const Matrix& x, const Batch& batch,
                    const std::vector<int32_t>& positions, const Matrix& out);
  void RunMlp(const MlpWeights& mlp, const Matrix& x, const Matrix& out);
  void RunMoe(const LayerWeights& layer, const Matrix& x, const Matrix& out);
  // True when this model is one rank of several: split blocks end in partial sums.
  bool split() const;
  // Sums a partial result over ranks, then rounds it as the unsplit op would.
  void AllReduce(const Matrix& partial);
  Matrix Scratch(int64_t rows, int64_t cols);

  const ModelConfig& config_;
  const ModelWeights& weights_;
  Backend& backend_;
  Communicator* communicator_;
  RopeTable rope_;
  float softmax_scale_;
  std::vector<std::unique_ptr<Buffer>> scratch_;  // live for one Run
};

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_FORWARD_H_
