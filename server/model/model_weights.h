// model_weights.h: views of one tensor-parallel rank's weights, pointing into
// the checkpoint's memory mapping (nothing is copied).
//
// Rank r of tp holds: attention heads [r * H/tp, (r + 1) * H/tp) (q_b / q_proj
// and kv_b by output rows, o_proj by input columns; q_a, kv_a and the norms
// replicated), the dense and shared MLPs split along the intermediate
// dimension, the routed experts ExpertOwner() assigns to it (whole), the
// router and the embeddings replicated. Each row- or column-split block ends
// in a partial sum that the forward pass all-reduces.
#ifndef HSX_SERVER_MODEL_MODEL_WEIGHTS_H_
#define HSX_SERVER_MODEL_MODEL_WEIGHTS_H_

#include <cstdint>
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

// Not copyable: `owned` points into `experts`.
struct LayerWeights {
  LayerWeights() = default;
  LayerWeights(const LayerWeights&) = delete;
  LayerWeights& operator=(const LayerWeights&) = delete;
  LayerWeights(LayerWeights&&) = default;
  LayerWeights& operator=(LayerWeights&&) = default;

  const uint16_t* input_norm = nullptr;
  const uint16_t* post_attention_norm = nullptr;
  AttentionWeights attention;
  bool is_moe = false;
  MlpWeights dense;                         // dense layers
  RouterParams router;                      // MoE layers
  std::vector<ExpertWeights> experts;       // all routed experts (views)
  std::vector<const ExpertWeights*> owned;  // per expert id: non-null when this rank holds it
  bool has_shared = false;
  MlpWeights shared;
};

struct ModelWeights {
  int rank = 0;
  int tp = 1;
  int64_t local_heads = 0;
  const uint16_t* embedding = nullptr;  // [vocab, hidden], replicated
  std::vector<LayerWeights> layers;
  const uint16_t* final_norm = nullptr;
};

// Rank `rank` of `tp` (checked with CheckTensorParallelDegree).
absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, int rank, int tp);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_MODEL_WEIGHTS_H_
