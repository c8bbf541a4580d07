// model_weights.cc: resolves names to views and takes this rank's slices.
#include "server/model/model_weights.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

// Looks up weights by name relative to the layout's prefix; the checkpoint was
// validated on open, so a failure here is a programming error, reported anyway.
class WeightResolver {
 public:
  explicit WeightResolver(const Checkpoint& checkpoint)
      : checkpoint_(checkpoint), prefix_(checkpoint.config().tensor_prefix()) {}

  absl::StatusOr<const uint16_t*> Bf16(const std::string& name) {
    absl::StatusOr<TensorRef> ref = checkpoint_.Tensor(prefix_ + name);
    if (!ref.ok()) return ref.status();
    return reinterpret_cast<const uint16_t*>(ref->bytes().data());
  }

  absl::StatusOr<const float*> F32(const std::string& name) {
    absl::StatusOr<TensorRef> ref = checkpoint_.Tensor(prefix_ + name);
    if (!ref.ok()) return ref.status();
    return reinterpret_cast<const float*>(ref->bytes().data());
  }

  absl::StatusOr<LinearWeight> Linear(const std::string& module) {
    const WeightSpec* spec = checkpoint_.FindWeight(prefix_ + module);
    if (spec == nullptr || !spec->is_linear) {
      return absl::NotFoundError(absl::StrCat("no Linear '", prefix_, module, "'"));
    }
    LinearWeight w;
    w.out = spec->shape[0];
    w.in = spec->shape[1];
    if (spec->quantized) {
      absl::StatusOr<Int4Weight> q = checkpoint_.QuantizedLinear(*spec);
      if (!q.ok()) return q.status();
      w.kind = LinearWeight::Kind::kInt4;
      w.packed = q->packed;
      w.scale = q->scale;
      w.group_size = q->group_size;
      return w;
    }
    absl::StatusOr<const uint16_t*> data = Bf16(module + ".weight");
    if (!data.ok()) return data.status();
    w.bf16 = *data;
    w.ld = w.in;
    return w;
  }

 private:
  const Checkpoint& checkpoint_;
  std::string prefix_;
};

// Output rows [begin, begin + count) of a dense weight.
absl::StatusOr<LinearWeight> RowSlice(absl::StatusOr<LinearWeight> w, int64_t begin, int64_t count) {
  if (!w.ok() || (begin == 0 && count == w->out)) return w;
  if (w->kind != LinearWeight::Kind::kBf16) {
    return absl::UnimplementedError("tensor-parallel slicing of an INT4 dense weight");
  }
  w->bf16 += begin * w->ld;
  w->out = count;
  return w;
}

// Input columns [begin, begin + count) of a dense weight.
absl::StatusOr<LinearWeight> ColSlice(absl::StatusOr<LinearWeight> w, int64_t begin, int64_t count) {
  if (!w.ok() || (begin == 0 && count == w->in)) return w;
  if (w->kind != LinearWeight::Kind::kBf16) {
    return absl::UnimplementedError("tensor-parallel slicing of an INT4 dense weight");
  }
  w->bf16 += begin;
  w->in = count;
  return w;
}

#define HSX_ASSIGN(lhs, expr)              \
  do {                                     \
    auto hsx_value = (expr);               \
    if (!hsx_value.ok()) return hsx_value.status(); \
    lhs = *std::move(hsx_value);           \
  } while (0)

absl::Status LoadMlp(WeightResolver& r, const std::string& module, int64_t intermediate, int rank,
                     int tp, MlpWeights* mlp) {
  const int64_t local = intermediate / tp;
  HSX_ASSIGN(mlp->gate, RowSlice(r.Linear(module + ".gate_proj"), rank * local, local));
  HSX_ASSIGN(mlp->up, RowSlice(r.Linear(module + ".up_proj"), rank * local, local));
  HSX_ASSIGN(mlp->down, ColSlice(r.Linear(module + ".down_proj"), rank * local, local));
  return absl::OkStatus();
}

absl::Status LoadAttention(WeightResolver& r, const ModelConfig& c, const std::string& p, int rank,
                           int tp, AttentionWeights* a) {
  const int64_t heads = c.num_attention_heads / tp;
  const int64_t first = rank * heads;
  a->has_q_lora = c.has_q_lora();
  if (a->has_q_lora) {
    HSX_ASSIGN(a->q_a, r.Linear(p + "q_a_proj"));
    HSX_ASSIGN(a->q_a_norm, r.Bf16(p + "q_a_layernorm.weight"));
    HSX_ASSIGN(a->q_b, RowSlice(r.Linear(p + "q_b_proj"), first * c.qk_head_dim(), heads * c.qk_head_dim()));
  } else {
    HSX_ASSIGN(a->q_b, RowSlice(r.Linear(p + "q_proj"), first * c.qk_head_dim(), heads * c.qk_head_dim()));
  }
  HSX_ASSIGN(a->kv_a, r.Linear(p + "kv_a_proj_with_mqa"));
  HSX_ASSIGN(a->kv_a_norm, r.Bf16(p + "kv_a_layernorm.weight"));
  const int64_t kv_head = c.qk_nope_head_dim + c.v_head_dim;
  HSX_ASSIGN(a->kv_b, RowSlice(r.Linear(p + "kv_b_proj"), first * kv_head, heads * kv_head));
  HSX_ASSIGN(a->o, ColSlice(r.Linear(p + "o_proj"), first * c.v_head_dim, heads * c.v_head_dim));
  return absl::OkStatus();
}

absl::Status LoadMoe(WeightResolver& r, const ModelConfig& c, const std::string& p, int rank, int tp,
                     LayerWeights* layer) {
  RouterParams& router = layer->router;
  HSX_ASSIGN(router.weight, r.Bf16(p + "gate.weight"));
  HSX_ASSIGN(router.bias, r.F32(p + "gate.e_score_correction_bias"));
  router.num_experts = c.n_routed_experts;
  router.top_k = c.num_experts_per_tok;
  router.n_group = c.n_group;
  router.topk_group = c.topk_group;
  router.softmax_scores = c.scoring_func == "softmax";
  router.normalize = c.norm_topk_prob;
  router.scaling = static_cast<float>(c.routed_scaling_factor);
  layer->experts.resize(c.n_routed_experts);
  layer->owned.assign(c.n_routed_experts, nullptr);
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    if (ExpertOwner(e, c.n_routed_experts, tp) != rank) continue;
    const std::string module = absl::StrCat(p, "experts.", e);
    ExpertWeights& expert = layer->experts[e];
    HSX_ASSIGN(expert.gate, r.Linear(module + ".gate_proj"));
    HSX_ASSIGN(expert.up, r.Linear(module + ".up_proj"));
    HSX_ASSIGN(expert.down, r.Linear(module + ".down_proj"));
    layer->owned[e] = &expert;
  }
  layer->has_shared = c.n_shared_experts > 0;
  if (layer->has_shared) {
    return LoadMlp(r, p + "shared_experts", c.moe_intermediate_size * c.n_shared_experts, rank, tp,
                   &layer->shared);
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ModelWeights> LoadModelWeights(const Checkpoint& checkpoint, int rank, int tp) {
  const ModelConfig& c = checkpoint.config();
  if (absl::Status s = CheckTensorParallelDegree(c, tp); !s.ok()) return s;
  WeightResolver r(checkpoint);
  ModelWeights weights;
  weights.rank = rank;
  weights.tp = tp;
  weights.local_heads = c.num_attention_heads / tp;
  HSX_ASSIGN(weights.embedding, r.Bf16("model.embed_tokens.weight"));
  HSX_ASSIGN(weights.final_norm, r.Bf16("model.norm.weight"));
  weights.layers.resize(c.num_hidden_layers);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    LayerWeights& layer = weights.layers[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    HSX_ASSIGN(layer.input_norm, r.Bf16(p + "input_layernorm.weight"));
    HSX_ASSIGN(layer.post_attention_norm, r.Bf16(p + "post_attention_layernorm.weight"));
    if (absl::Status s = LoadAttention(r, c, p + "self_attn.", rank, tp, &layer.attention); !s.ok()) return s;
    layer.is_moe = c.IsMoeLayer(l);
    absl::Status s = layer.is_moe ? LoadMoe(r, c, p + "mlp.", rank, tp, &layer)
                                  : LoadMlp(r, p + "mlp", c.intermediate_size, rank, tp, &layer.dense);
    if (!s.ok()) return s;
  }
  return weights;
}

}  // namespace hsx
