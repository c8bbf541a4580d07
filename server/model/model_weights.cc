// model_weights.cc: resolves names to host views, takes this rank's share
// from the placement table, and places it on the backend.
#include "server/model/model_weights.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "server/model/tensor_specs.h"

namespace hsx {
namespace {

// Looks up weights by name relative to the layout's prefix, slices this rank's
// share (ShareOf) on the host and places it. The checkpoint was validated on
// open, so a lookup failure here is a programming error, reported anyway.
class WeightPlacer {
 public:
  WeightPlacer(const Checkpoint& checkpoint, int rank, int tp, Backend& backend)
      : checkpoint_(checkpoint), prefix_(checkpoint.config().tensor_prefix()), rank_(rank), tp_(tp),
        backend_(backend) {}

  // The share of a non-Linear tensor (norm, router, bias, embedding rows).
  struct PlacedTensor {
    const void* data = nullptr;
    RankShare share;
  };
  absl::StatusOr<PlacedTensor> Tensor(const std::string& name) {
    HSX_ASSIGN_OR_RETURN(const WeightSpec* spec, Spec(name));
    HSX_ASSIGN_OR_RETURN(TensorRef ref, checkpoint_.Tensor(prefix_ + name));
    const RankShare share = ShareOf(*spec, checkpoint_.config(), rank_, tp_);
    const std::span<const uint8_t> bytes = ref.bytes();
    const int64_t rows = spec->shape.empty() ? 1 : spec->shape[0];
    const size_t row_bytes = bytes.size() / static_cast<size_t>(rows);
    HSX_ASSIGN_OR_RETURN(const void* placed,
                         backend_.PlaceTensor(bytes.data() + share.begin * row_bytes, share.count * row_bytes));
    return PlacedTensor{placed, share};
  }

  absl::StatusOr<const uint16_t*> Bf16(const std::string& name) {
    HSX_ASSIGN_OR_RETURN(PlacedTensor t, Tensor(name));
    return static_cast<const uint16_t*>(t.data);
  }

  absl::StatusOr<const float*> F32(const std::string& name) {
    HSX_ASSIGN_OR_RETURN(PlacedTensor t, Tensor(name));
    return static_cast<const float*>(t.data);
  }

  // This rank's share of a Linear, placed.
  absl::StatusOr<LinearWeight> Linear(const std::string& module) {
    HSX_ASSIGN_OR_RETURN(LinearWeight host, HostLinear(module));
    return backend_.PlaceLinear(host);
  }

  // This rank's share of a Linear as a host view (routed experts are placed
  // together, per layer).
  absl::StatusOr<LinearWeight> HostLinear(const std::string& module) {
    HSX_ASSIGN_OR_RETURN(const WeightSpec* spec, Spec(module));
    if (!spec->is_linear) return absl::InternalError(absl::StrCat("'", prefix_, module, "' is not a Linear"));
    LinearWeight w;
    w.out = spec->shape[0];
    w.in = spec->shape[1];
    if (spec->quantized) {
      HSX_ASSIGN_OR_RETURN(Int4Weight q, checkpoint_.QuantizedLinear(*spec));
      w.kind = LinearWeight::Kind::kInt4;
      w.packed = q.packed;
      w.scale = q.scale;
      w.group_size = q.group_size;
    } else {
      HSX_ASSIGN_OR_RETURN(TensorRef ref, checkpoint_.Tensor(prefix_ + module + ".weight"));
      w.bf16 = reinterpret_cast<const uint16_t*>(ref.bytes().data());
      w.ld = w.in;
    }
    const RankShare share = ShareOf(*spec, checkpoint_.config(), rank_, tp_);
    const bool whole = spec->split != TpSplit::kRows && spec->split != TpSplit::kCols;
    if (whole || (share.begin == 0 && share.count == (spec->split == TpSplit::kRows ? w.out : w.in))) return w;
    if (w.kind != LinearWeight::Kind::kBf16) {
      return absl::UnimplementedError(
          absl::StrCat("tensor-parallel slicing of the INT4 dense weight '", prefix_, module, "'"));
    }
    if (spec->split == TpSplit::kRows) {
      w.bf16 += share.begin * w.ld;
      w.out = share.count;
    } else {
      w.bf16 += share.begin;
      w.in = share.count;
    }
    return w;
  }

  bool Holds(const std::string& module) {
    absl::StatusOr<const WeightSpec*> spec = Spec(module);
    return spec.ok() && ShareOf(**spec, checkpoint_.config(), rank_, tp_).held;
  }

  Backend& backend() { return backend_; }

 private:
  absl::StatusOr<const WeightSpec*> Spec(const std::string& name) {
    const WeightSpec* spec = checkpoint_.FindWeight(prefix_ + name);
    if (spec == nullptr) return absl::NotFoundError(absl::StrCat("no weight '", prefix_, name, "'"));
    return spec;
  }

  const Checkpoint& checkpoint_;
  std::string prefix_;
  int rank_;
  int tp_;
  Backend& backend_;
};

absl::Status LoadMlp(WeightPlacer& p, const std::string& module, MlpWeights* mlp) {
  HSX_ASSIGN_OR_RETURN(mlp->gate, p.Linear(module + ".gate_proj"));
  HSX_ASSIGN_OR_RETURN(mlp->up, p.Linear(module + ".up_proj"));
  HSX_ASSIGN_OR_RETURN(mlp->down, p.Linear(module + ".down_proj"));
  return absl::OkStatus();
}

absl::Status LoadAttention(WeightPlacer& p, const ModelConfig& c, const std::string& prefix,
                           AttentionWeights* a) {
  a->has_q_lora = c.has_q_lora();
  if (a->has_q_lora) {
    HSX_ASSIGN_OR_RETURN(a->q_a, p.Linear(prefix + "q_a_proj"));
    HSX_ASSIGN_OR_RETURN(a->q_a_norm, p.Bf16(prefix + "q_a_layernorm.weight"));
    HSX_ASSIGN_OR_RETURN(a->q_b, p.Linear(prefix + "q_b_proj"));
  } else {
    HSX_ASSIGN_OR_RETURN(a->q_b, p.Linear(prefix + "q_proj"));
  }
  HSX_ASSIGN_OR_RETURN(a->kv_a, p.Linear(prefix + "kv_a_proj_with_mqa"));
  HSX_ASSIGN_OR_RETURN(a->kv_a_norm, p.Bf16(prefix + "kv_a_layernorm.weight"));
  HSX_ASSIGN_OR_RETURN(a->kv_b, p.Linear(prefix + "kv_b_proj"));
  HSX_ASSIGN_OR_RETURN(a->o, p.Linear(prefix + "o_proj"));
  return absl::OkStatus();
}

absl::Status LoadMoe(WeightPlacer& p, const ModelConfig& c, const std::string& prefix, LayerWeights* layer) {
  RouterParams& router = layer->router;
  HSX_ASSIGN_OR_RETURN(router.weight, p.Bf16(prefix + "gate.weight"));
  HSX_ASSIGN_OR_RETURN(router.bias, p.F32(prefix + "gate.e_score_correction_bias"));
  router.num_experts = c.n_routed_experts;
  router.top_k = c.num_experts_per_tok;
  router.n_group = c.n_group;
  router.topk_group = c.topk_group;
  router.softmax_scores = c.scoring_func == "softmax";
  router.normalize = c.norm_topk_prob;
  router.scaling = static_cast<float>(c.routed_scaling_factor);
  std::vector<ExpertWeights> experts(c.n_routed_experts);
  std::unique_ptr<bool[]> held(new bool[c.n_routed_experts]);
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    const std::string module = absl::StrCat(prefix, "experts.", e);
    held[e] = p.Holds(module + ".gate_proj");
    if (!held[e]) continue;
    HSX_ASSIGN_OR_RETURN(experts[e].gate, p.HostLinear(module + ".gate_proj"));
    HSX_ASSIGN_OR_RETURN(experts[e].up, p.HostLinear(module + ".up_proj"));
    HSX_ASSIGN_OR_RETURN(experts[e].down, p.HostLinear(module + ".down_proj"));
  }
  HSX_ASSIGN_OR_RETURN(layer->experts, p.backend().PlaceExperts(
                                           experts, std::span<const bool>(held.get(), c.n_routed_experts)));
  layer->has_shared = c.n_shared_experts > 0;
  if (layer->has_shared) return LoadMlp(p, prefix + "shared_experts", &layer->shared);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, int rank, int tp, Backend& backend) {
  const ModelConfig& c = checkpoint.config();
  HSX_RETURN_IF_ERROR(CheckTensorParallelDegree(c, tp));
  WeightPlacer p(checkpoint, rank, tp, backend);
  ModelWeights weights;
  weights.rank = rank;
  weights.tp = tp;
  weights.local_heads = c.num_attention_heads / tp;
  HSX_ASSIGN_OR_RETURN(WeightPlacer::PlacedTensor embedding, p.Tensor("model.embed_tokens.weight"));
  weights.embedding = static_cast<const uint16_t*>(embedding.data);
  weights.vocab_begin = embedding.share.begin;
  weights.vocab_rows = embedding.share.count;
  HSX_ASSIGN_OR_RETURN(weights.final_norm, p.Bf16("model.norm.weight"));
  weights.layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& layer = weights.layers[l];
    const std::string prefix = absl::StrCat("model.layers.", l, ".");
    HSX_ASSIGN_OR_RETURN(layer.input_norm, p.Bf16(prefix + "input_layernorm.weight"));
    HSX_ASSIGN_OR_RETURN(layer.post_attention_norm, p.Bf16(prefix + "post_attention_layernorm.weight"));
    HSX_RETURN_IF_ERROR(LoadAttention(p, c, prefix + "self_attn.", &layer.attention));
    layer.is_moe = c.IsMoeLayer(l);
    HSX_RETURN_IF_ERROR(layer.is_moe ? LoadMoe(p, c, prefix + "mlp.", &layer)
                                     : LoadMlp(p, prefix + "mlp", &layer.dense));
  }
  return weights;
}

}  // namespace hsx
