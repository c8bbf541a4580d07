// cudnn_attention.h: causal ragged attention through cuDNN's SDPA (graph API,
// cuDNN frontend), the CUDA backend's fast attention path (--attention=cudnn).
//
// Operands are packed THD tensors in bf16: Q and K [tokens, heads, qk_dim],
// V and O [tokens, heads, v_dim], each sample's rows contiguous, addressed
// through ragged offsets (elements, int32, samples + 1 entries) and per-sample
// lengths (int32). The softmax runs in float32 with the caller's scale (the
// reference kernel's, YaRN mscale² included); masking is causal, top-left
// aligned, within each sample.
//
// libcudnn is loaded with dlopen (the frontend's dynamic-loading mode) when an
// instance is created, so binaries neither link nor carry it. Graphs are built
// once per shape key and cached; the key buckets the sample count and the
// longest sample to powers of two, so a server sees a handful of graphs, not
// one per batch (unused sample slots have length 0).
//
// Batch invariance (gpu-notes §9): cuDNN does not document that a sample's
// output is independent of the other samples in a ragged batch. Its flash
// forward tiles each (sample, head, query block) separately and has no
// split over keys, so it should hold; but the plan is chosen per graph, and
// the solo and batched calls of one sample can use different graphs (other
// buckets) and so different engines. tests/cuda/cuda_conformance_test.cc
// checks it on the GPU; until that has run, the reference kernel stays the
// default.
#ifndef HSX_KERNELS_CUDA_CUDNN_ATTENTION_H_
#define HSX_KERNELS_CUDA_CUDNN_ATTENTION_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*

namespace hsx::cuda {

// One attention call's shape. `samples` and `longest` are the graph's
// (bucketed) sample count and maximum length; `tokens` is the packed rows.
struct SdpaShape {
  int64_t samples = 0;
  int64_t longest = 0;
  int64_t heads = 0;
  int64_t qk_dim = 0;
  int64_t v_dim = 0;
  float scale = 0.0f;
};

// Device pointers of one call (see the file comment for layouts).
struct SdpaOperands {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  const int32_t* offsets_qk = nullptr;  // Q and K, [samples + 1]
  const int32_t* offsets_v = nullptr;   // V and O, [samples + 1]
  const int32_t* lengths = nullptr;     // [samples]
};

// Why the cuDNN path is not compiled in ("" when it is).
std::string CudnnAttentionMissing();

// A cuDNN handle on one stream and its cache of built graphs. Not thread-safe
// (the backend runs one op at a time).
class CudnnAttention {
 public:
  // Loads libcudnn and creates a handle on `stream`; FailedPrecondition with
  // the reason (not compiled in, library missing, too old, no device).
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(CUstream_st* stream);
  virtual ~CudnnAttention() = default;

  // One line naming the loaded cuDNN version.
  virtual std::string Describe() const = 0;
  // Builds (or finds) the graph for `shape`; returns its workspace bytes, or
  // Unimplemented naming the shape and cuDNN's reason when no engine supports
  // it (check_support / build_plans).
  virtual absl::StatusOr<int64_t> Prepare(const SdpaShape& shape) = 0;
  // Enqueues the graph prepared for `shape` on the stream.
  virtual absl::Status Run(const SdpaShape& shape, const SdpaOperands& operands, void* workspace) = 0;
};

}  // namespace hsx::cuda

#endif  // HSX_KERNELS_CUDA_CUDNN_ATTENTION_H_
