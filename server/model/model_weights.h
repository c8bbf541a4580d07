// model_weights.h: one tensor-parallel rank's weights, placed by its backend.
//
// The loader takes each weight's share from the placement table
// (ShareOf in tensor_specs.h, the same table hsx-inspect's per-rank plan
// counts), slices it on the host (views into the checkpoint's memory mapping)
// and hands it to the backend's Place*() calls: the CPU backend keeps the
// mapping's pointers (zero copy), a device backend copies. So rank r of tp
// holds attention heads [r * H/tp, (r + 1) * H/tp) (q_b / q_proj and kv_b by
// output rows, o_proj by input columns; q_a, kv_a and the norms replicated),
// the dense and shared MLPs split along the intermediate dimension, the routed
// experts ExpertOwner() assigns to it (whole), the router replicated, and
// vocabulary rows [V * r / tp, V * (r + 1) / tp) of the embedding. Each split
// block ends in a partial sum that the forward pass all-reduces.
#ifndef HSX_SERVER_MODEL_MODEL_WEIGHTS_H_
#define HSX_SERVER_MODEL_MODEL_WEIGHTS_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "server/model/checkpoint.h"

namespace hsx {

struct AttentionWeights {
  bool has_q_lora = false;
  LinearWeight q_a;            // [q_lora, hidden]       (with q LoRA)
  const uint16_t* q_a_norm = nullptr;
  LinearWeight q_b;            // [local heads * qk, q_lora]  or q_proj [local heads * qk, hidden]
  LinearWeight kv_a;           // [kv_lora + rope, hidden]
  const uint16_t* kv_a_norm = nullptr;
  LinearWeight kv_b;           // [local heads * (nope + v), kv_lora]
  LinearWeight o;              // [hidden, local heads * v] (a column slice)
};

struct MlpWeights {
  LinearWeight gate;
  LinearWeight up;
  LinearWeight down;
};

struct LayerWeights {
  const uint16_t* input_norm = nullptr;
  const uint16_t* post_attention_norm = nullptr;
  AttentionWeights attention;
  bool is_moe = false;
  MlpWeights dense;                      // dense layers
  RouterParams router;                   // MoE layers
  std::unique_ptr<ExpertTable> experts;  // MoE layers: this rank's routed experts
  bool has_shared = false;
  MlpWeights shared;
};

// Everything placed lives as long as the backend that placed it.
struct ModelWeights {
  int rank = 0;
  int tp = 1;
  int64_t local_heads = 0;
  const uint16_t* embedding = nullptr;  // vocabulary rows [vocab_begin, + vocab_rows) x hidden
  int64_t vocab_begin = 0;
  int64_t vocab_rows = 0;
  std::vector<LayerWeights> layers;
  const uint16_t* final_norm = nullptr;
};

// Places rank `rank` of `tp` (checked with CheckTensorParallelDegree) on `backend`.
absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, int rank, int tp,
                                              Backend& backend);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_MODEL_WEIGHTS_H_
