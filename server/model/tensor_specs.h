// tensor_specs.h: the one list of a DeepSeek-V3-family text model's weights.
//
// Everything that needs to know which tensors a checkpoint holds (the
// generator, the loader's validation, hsx-inspect's counts and the
// tensor-parallel memory plan) derives it from TextModelWeights(), so the
// naming (model-spec.md §3) lives in exactly one place.
#ifndef HSX_SERVER_MODEL_TENSOR_SPECS_H_
#define HSX_SERVER_MODEL_TENSOR_SPECS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "server/model/config.h"
#include "format/safetensors.h"

namespace hsx {

// How a weight is initialised by the generator and split by tensor parallelism.
enum class WeightRole {
  kEmbedding,         // [vocab, hidden]
  kNorm,              // RMSNorm scale
  kInputProjection,   // a Linear reading the normalised stream (or a latent)
  kOutputProjection,  // a Linear writing into the residual stream (o_proj, down_proj)
  kRouter,            // mlp.gate.weight, [experts, hidden]
  kRouterBias,        // mlp.gate.e_score_correction_bias, F32 [experts]
  kLmHead,
};

// How tensor parallelism divides a weight among ranks (docs/design.md, "Backends"):
// attention heads and MLP intermediate dimensions are split, routed experts
// are placed whole, small tensors are replicated, lm_head is never loaded
// (prefill stops before it).
enum class TpSplit {
  kReplicated,
  kRows,       // output dimension split (q_b/kv_b by head, gate/up by intermediate)
  kCols,       // input dimension split (o_proj, down_proj)
  kExpert,     // a routed expert's weight, held whole by one rank
  kVocabRows,  // embedding rows split by vocabulary
  kNotLoaded,  // lm_head
};

struct WeightSpec {
  // For a Linear: the module name (e.g. "model.layers.1.mlp.experts.0.up_proj");
  // its tensors are name + ".weight", or name + ".weight_{packed,scale,shape}".
  // For anything else: the full tensor name.
  std::string name;
  bool is_linear = false;
  bool quantized = false;      // Linear stored INT4 pack-quantized
  DType dtype = DType::kBF16;  // of the (unquantized) tensor
  std::vector<int64_t> shape;  // logical shape; [out, in] for a Linear
  WeightRole role = WeightRole::kInputProjection;
  TpSplit split = TpSplit::kReplicated;
  int64_t layer = -1;   // decoder layer, -1 for embeddings / final norm / lm_head
  int64_t expert = -1;  // routed expert id, -1 otherwise

  int64_t num_elements() const;
  // Bytes on disk (packed + scales + shape for an INT4 Linear).
  int64_t stored_bytes(int group_size) const;
  // Bytes a backend places for the whole weight (packed + scales for an INT4
  // Linear: its weight_shape is read at load, not placed).
  int64_t placed_bytes(int group_size) const;
};

// The weights of the text model in checkpoint order (embeddings, layers,
// final norm, lm_head unless tied), names carrying the layout's prefix.
std::vector<WeightSpec> TextModelWeights(const ModelConfig& config);

// Checks that `tp` ranks can split this model (heads and intermediate sizes
// divisible by tp); the error names the field.
absl::Status CheckTensorParallelDegree(const ModelConfig& config, int tp);

// The rank (0..tp-1) that owns routed expert `expert`: contiguous, balanced blocks.
int ExpertOwner(int64_t expert, int64_t num_experts, int tp);

// The part of a weight that rank `rank` of `tp` holds. This is the one table
// of tensor-parallel placement: the loader slices by it and hsx-inspect's
// per-rank plan counts by it.
struct RankShare {
  bool held = false;  // false: kNotLoaded, or another rank's routed expert
  // Along the split dimension (output rows for kRows and kVocabRows, input
  // columns for kCols): [begin, begin + count). The whole dimension otherwise.
  int64_t begin = 0;
  int64_t count = 0;
};
RankShare ShareOf(const WeightSpec& spec, const ModelConfig& config, int rank, int tp);

// Bytes of `spec` that rank `rank` of `tp` places (INT4 stays INT4).
int64_t BytesOnRank(const WeightSpec& spec, const ModelConfig& config, int rank, int tp);
// Bytes every rank places, summed over the model's weights: the memory plan.
std::vector<int64_t> BytesPerRank(const ModelConfig& config, int tp);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_TENSOR_SPECS_H_
