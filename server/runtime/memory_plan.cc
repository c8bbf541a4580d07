// memory_plan.cc: the arithmetic of the device memory plan (memory_plan.h).
#include "server/runtime/memory_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/staging_ring.h"
#include "server/model/tensor_specs.h"

namespace hsx {
namespace {

// Mirrors kernels/cuda: the cuBLASLt workspace (cuda_device.cc) and the rows
// a GEMM plan is checked with (gemm.h, LtGemm::kPlanRows).
constexpr int64_t kWorkspaceBytes = int64_t{32} << 20;
constexpr int64_t kPlanRows = 16384;

std::string GiB(int64_t bytes) { return absl::StrFormat("%.2f GiB", static_cast<double>(bytes) / (int64_t{1} << 30)); }

// Routed experts rank `rank` holds (ExpertOwner: contiguous blocks).
int64_t HeldExperts(const ModelConfig& c, int tp, int rank) {
  int64_t held = 0;
  for (int64_t e = 0; e < c.n_routed_experts; ++e) held += ExpertOwner(e, c.n_routed_experts, tp) == rank ? 1 : 0;
  return held;
}

int64_t MaxHeldExperts(const ModelConfig& c, int tp) {
  int64_t most = 0;
  for (int r = 0; r < tp; ++r) most = std::max(most, HeldExperts(c, tp, r));
  return most;
}

bool HasMoe(const ModelConfig& c) {
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (c.IsMoeLayer(l)) return true;
  }
  return false;
}

bool HasDense(const ModelConfig& c) {
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsMoeLayer(l)) return true;
  }
  return false;
}

}  // namespace

absl::StatusOr<RankLayout> MakeRankLayout(int tp, int ranks_per_device, int device_count) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp ", tp, ": must be at least 1"));
  if (ranks_per_device != 1 && ranks_per_device != tp) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--ranks-per-device ", ranks_per_device, " with --tp ", tp,
        ": give 1 (rank r on GPU r) or ", tp, " (every rank on GPU 0, for testing tensor parallelism on one GPU)"));
  }
  RankLayout layout{tp, ranks_per_device};
  if (layout.devices() > device_count) {
    return absl::InvalidArgumentError(absl::StrCat("--tp ", tp, " puts one rank on each of GPUs 0..", tp - 1,
                                                   " but this machine has ", device_count,
                                                   " GPU(s); use --ranks-per-device ", tp,
                                                   " to run every rank on GPU 0"));
  }
  return layout;
}

int64_t ForwardBytesPerRank(const ModelConfig& c, int tp, int64_t tokens, ElementType precision) {
  const int64_t a = static_cast<int64_t>(ElementSize(precision));
  const int64_t h = c.hidden_size;
  const int64_t heads = c.num_attention_heads / tp;
  const bool split = tp > 1;
  // A split block's f32 partial, when the output is not f32 already (Model::PartialFor).
  const int64_t partial = split && a != 4 ? 4 : 0;
  const int64_t attention = (c.has_q_lora() ? c.q_lora_rank : 0) + heads * c.qk_head_dim() + c.kv_lora_rank +
                            c.qk_rope_head_dim + c.kv_lora_rank + heads * (c.qk_nope_head_dim + c.v_head_dim) +
                            heads * c.v_head_dim;
  const int64_t layer_common = (2 * h + attention) * a + h * partial;  // x, update; attention; o_proj partial
  const int64_t dense_mlp = 2 * (c.intermediate_size / tp) * a + h * partial;
  const int64_t shared_inter = c.moe_intermediate_size * c.n_shared_experts / tp;
  const int64_t moe_mlp = c.n_shared_experts > 0 ? 2 * h * a + 2 * h * partial + 2 * shared_inter * a : h * partial;
  // Model::Run releases a layer's scratch once the layer is enqueued: the
  // largest layer's counts (the embedding's f32 partial is smaller).
  int64_t per_token = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    per_token = std::max(per_token, layer_common + (c.IsMoeLayer(l) ? moe_mlp : dense_mlp));
  }
  per_token += 2 * h * a;  // the residual stream and the final norm
  per_token += 16;         // the staged batch: token id, position, a share of cu_seqlens and tiles
  return per_token * tokens;
}

int64_t BackendScratchBytesPerRank(const ModelConfig& c, int tp, int64_t tokens, ElementType precision) {
  const int64_t a = static_cast<int64_t>(ElementSize(precision));
  const int64_t h = c.hidden_size;
  const int64_t heads = c.num_attention_heads / tp;
  // The GEMM shapes (N, K) a rank multiplies; the plan check of each takes
  // W [N, K] + X [kPlanRows, K] + Y [kPlanRows, N], once, at its first use.
  std::vector<std::pair<int64_t, int64_t>> shapes = {
      {c.kv_lora_rank + c.qk_rope_head_dim, h},
      {heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank},
      {h, heads * c.v_head_dim},
  };
  if (c.has_q_lora()) {
    shapes.push_back({c.q_lora_rank, h});
    shapes.push_back({heads * c.qk_head_dim(), c.q_lora_rank});
  } else {
    shapes.push_back({heads * c.qk_head_dim(), h});
  }
  if (HasDense(c)) {
    shapes.push_back({c.intermediate_size / tp, h});
    shapes.push_back({h, c.intermediate_size / tp});
  }
  int64_t moe = 0;
  if (HasMoe(c)) {
    const int64_t inter = c.moe_intermediate_size;
    shapes.push_back({2 * inter, h});
    shapes.push_back({h, inter});
    shapes.push_back({c.n_routed_experts, h});  // the router (f32 out: counted as a below, a bound for bf16)
    // MoeExperts at worst: every (token, slot) on this rank's experts.
    const int64_t rows = tokens * c.num_experts_per_tok;
    const int64_t experts = c.n_routed_experts;
    const int64_t index = 4 * (experts + rows + tokens * c.num_experts_per_tok) + 4 * experts;
    const int64_t dequantised = MaxHeldExperts(c, tp) * 3 * inter * h * 2;
    moe = index + rows * h * a + rows * 2 * inter * a + rows * h * a + dequantised;
    moe = std::max(moe, tokens * experts * 4);  // Route's f32 logits
    moe += tokens * c.num_experts_per_tok * 8;  // the routing itself
  }
  int64_t plan_check = 0;
  int64_t f32_weight_copy = 0;  // kF32: a bf16 weight widened to f32 for one GEMM
  for (const auto& [n, k] : shapes) {
    plan_check = std::max(plan_check, (n * k + kPlanRows * k + kPlanRows * n) * 4);
    if (precision == ElementType::kF32) f32_weight_copy = std::max(f32_weight_copy, n * k * 4);
  }
  // The capture staging ring (kernels/cuda/cuda_backend.h): only the rank
  // that captures allocates it; counted for every rank, an upper bound.
  return kWorkspaceBytes + std::max(plan_check, moe) + f32_weight_copy + kCaptureStagingBytes;
}

namespace {

// PlanDeviceMemory with the weights per rank counted already (BytesPerRank
// walks every tensor of the model: slow for Kimi-K2's 23k experts).
std::vector<DevicePlan> Plan(const ModelConfig& c, const RankLayout& layout, int64_t max_batch_tokens,
                             ElementType precision, std::span<const int64_t> free_bytes,
                             const std::vector<int64_t>& weights) {
  std::vector<DevicePlan> plans(layout.devices());
  for (int d = 0; d < layout.devices(); ++d) {
    plans[d].device = d;
    plans[d].free = d < static_cast<int>(free_bytes.size()) ? free_bytes[d] : 0;
  }
  for (int r = 0; r < layout.tp; ++r) {
    DevicePlan& plan = plans[layout.device_of(r)];
    plan.ranks.push_back(r);
    plan.weights += weights[r];
    plan.scratch += BackendScratchBytesPerRank(c, layout.tp, max_batch_tokens, precision);
    plan.batch += ForwardBytesPerRank(c, layout.tp, max_batch_tokens, precision);
  }
  return plans;
}

}  // namespace

std::vector<DevicePlan> PlanDeviceMemory(const ModelConfig& c, const RankLayout& layout, int64_t max_batch_tokens,
                                         ElementType precision, std::span<const int64_t> free_bytes) {
  return Plan(c, layout, max_batch_tokens, precision, free_bytes, BytesPerRank(c, layout.tp));
}

std::string DescribeDevicePlan(const DevicePlan& plan, int64_t max_batch_tokens) {
  const std::string ranks = plan.ranks.size() == 1
                                ? absl::StrCat("rank ", plan.ranks.front())
                                : absl::StrCat("ranks ", plan.ranks.front(), "-", plan.ranks.back());
  return absl::StrCat("cuda:", plan.device, " ", ranks, ": weights ", GiB(plan.weights), " + scratch ",
                      GiB(plan.scratch), " + batch (", max_batch_tokens, " tokens) ", GiB(plan.batch), " = ",
                      GiB(plan.total()), " of ", GiB(plan.free), " free");
}

int64_t LargestFittingBatch(const ModelConfig& c, const RankLayout& layout, int64_t max_batch_tokens,
                            ElementType precision, std::span<const int64_t> free_bytes) {
  const std::vector<int64_t> weights = BytesPerRank(c, layout.tp);
  auto fits = [&](int64_t tokens) {
    for (const DevicePlan& plan : Plan(c, layout, tokens, precision, free_bytes, weights)) {
      if (!plan.fits()) return false;
    }
    return true;
  };
  if (!fits(1)) return 0;
  // Every term grows with the budget: bisect for the largest that fits.
  int64_t low = 1, high = max_batch_tokens;
  while (low < high) {
    const int64_t mid = low + (high - low + 1) / 2;
    if (fits(mid)) {
      low = mid;
    } else {
      high = mid - 1;
    }
  }
  return low;
}

absl::Status CheckMemoryPlan(const ModelConfig& c, const RankLayout& layout, int64_t max_batch_tokens,
                             ElementType precision, std::span<const int64_t> free_bytes,
                             std::vector<DevicePlan>* plans_out) {
  std::vector<DevicePlan> plans = PlanDeviceMemory(c, layout, max_batch_tokens, precision, free_bytes);
  if (plans_out != nullptr) *plans_out = plans;
  for (const DevicePlan& plan : plans) {
    if (plan.fits()) continue;
    const int64_t fitting = LargestFittingBatch(c, layout, max_batch_tokens, precision, free_bytes);
    const std::string advice =
        fitting > 0 ? absl::StrCat("; --max-batch-tokens ", fitting, " would fit, or use more GPUs (--tp)")
                    : "; not even a one-token batch fits beside the weights: use more GPUs (--tp)";
    return absl::ResourceExhaustedError(
        absl::StrCat("the memory plan does not fit: ", DescribeDevicePlan(plan, max_batch_tokens), advice));
  }
  return absl::OkStatus();
}

}  // namespace hsx
