// memory_plan.h: the up-front device memory plan of a CUDA engine, and where
// its ranks run.
//
// Before any weight is loaded, the engine adds up for each GPU, over the ranks
// placed on it: the weights each rank places (BytesPerRank, the one placement
// table), the fixed scratch of a backend (cuBLASLt workspace, the GEMM plan
// check, the dequantised experts of one MoE layer and the other transient
// buffers of the largest op) and the batch budget (every activation the
// forward pass keeps while a batch of max_batch_tokens runs, per
// server/model/forward.cc). It compares the sum with the GPU's free memory and
// refuses to load what does not fit, naming the numbers. This file is plain
// arithmetic, tested on the CPU (tests/unit/memory_plan_test.cc); the CUDA
// device factory feeds it cudaMemGetInfo.
//
// The estimates are upper bounds where the real size depends on the data: the
// MoE buffers assume every routed slot of the batch picks one of this rank's
// experts. Where forward.cc's allocation pattern changes, ForwardBytesPerRank
// changes with it (its comment lists what it counts).
#ifndef HSX_SERVER_RUNTIME_MEMORY_PLAN_H_
#define HSX_SERVER_RUNTIME_MEMORY_PLAN_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/model/config.h"

namespace hsx {

// Where the `tp` ranks run: rank r on GPU r / ranks_per_device. Either one
// rank per GPU (ranks on GPUs 0..tp-1) or all ranks on one GPU (the testing
// layout of the same-device transport); InvalidArgument naming the flags
// otherwise, or when the machine has fewer GPUs than the layout needs.
struct RankLayout {
  int tp = 1;
  int ranks_per_device = 1;
  int devices() const { return (tp + ranks_per_device - 1) / ranks_per_device; }
  int device_of(int rank) const { return rank / ranks_per_device; }
  // True when every rank shares GPU 0 (and there is more than one rank).
  bool same_device() const { return tp > 1 && ranks_per_device == tp; }
};
absl::StatusOr<RankLayout> MakeRankLayout(int tp, int ranks_per_device, int device_count);

// Device bytes of activations and per-batch buffers one rank keeps while the
// forward pass runs a batch of `tokens` tokens: the scratch of the largest
// layer of forward.cc's RunLayer (x, update, the attention's q, latent,
// compressed kv, kv, output and f32 partial; the MLP's or MoE's gate, up and
// partials; Model::Run releases each layer's scratch after the layer), plus
// the residual stream, the final norm and the staged batch.
int64_t ForwardBytesPerRank(const ModelConfig& config, int tp, int64_t tokens, ElementType precision);

// Device bytes one rank's backend takes besides weights and the forward's
// buffers: the cuBLASLt workspace, the largest GEMM plan check (kPlanRows
// rows of the widest shape), the largest op's transient scratch, which
// for a MoE model is MoeExperts at `tokens` (router logits, the expert
// permutation, gathered rows, gate/up, outputs, and the rank's experts
// dequantised to bf16), and the capture staging ring (kCaptureStagingBytes).
int64_t BackendScratchBytesPerRank(const ModelConfig& config, int tp, int64_t tokens, ElementType precision);

// The plan of one GPU.
struct DevicePlan {
  int device = 0;
  std::vector<int> ranks;
  int64_t weights = 0;  // sum over its ranks
  int64_t scratch = 0;
  int64_t batch = 0;
  int64_t free = 0;  // what the GPU reported free before loading
  int64_t total() const { return weights + scratch + batch; }
  bool fits() const { return total() <= free; }
};

// The plan of every GPU of `layout`; free_bytes[d] is GPU d's free memory.
std::vector<DevicePlan> PlanDeviceMemory(const ModelConfig& config, const RankLayout& layout,
                                         int64_t max_batch_tokens, ElementType precision,
                                         std::span<const int64_t> free_bytes);

// "cuda:0 ranks 0-7: weights 71.3 GiB + scratch 6.2 GiB + batch (8192 tokens)
// 20.1 GiB = 97.6 GiB of 139.0 GiB free".
std::string DescribeDevicePlan(const DevicePlan& plan, int64_t max_batch_tokens);

// The largest batch budget (tokens, at most max_batch_tokens) whose plan fits
// on every GPU; 0 when not even the weights and fixed scratch fit.
int64_t LargestFittingBatch(const ModelConfig& config, const RankLayout& layout, int64_t max_batch_tokens,
                            ElementType precision, std::span<const int64_t> free_bytes);

// Plans every GPU (into *plans when given) and checks the plans: OK when each
// fits, else ResourceExhausted naming, for the first GPU that does not, each
// term, the free memory, and the largest --max-batch-tokens that would fit (or
// that the weights alone do not).
absl::Status CheckMemoryPlan(const ModelConfig& config, const RankLayout& layout, int64_t max_batch_tokens,
                             ElementType precision, std::span<const int64_t> free_bytes,
                             std::vector<DevicePlan>* plans = nullptr);

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_MEMORY_PLAN_H_
