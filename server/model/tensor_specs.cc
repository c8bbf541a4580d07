// tensor_specs.cc: weight names and shapes per model-spec.md §3.
#include "server/model/tensor_specs.h"

#include "absl/strings/str_cat.h"

namespace hsx {
namespace {

// Appends weights of one model, tracking the current layer and the prefix.
class SpecBuilder {
 public:
  SpecBuilder(const ModelConfig& config, std::vector<WeightSpec>* out)
      : config_(config), out_(out), prefix_(config.tensor_prefix()) {}

  void Tensor(const std::string& name, std::vector<int64_t> shape, WeightRole role,
              TpSplit split = TpSplit::kReplicated, DType dtype = DType::kBF16) {
    WeightSpec spec;
    spec.split = split;
    spec.name = absl::StrCat(prefix_, name);
    spec.dtype = dtype;
    spec.shape = std::move(shape);
    spec.role = role;
    spec.layer = layer_;
    out_->push_back(std::move(spec));
  }

  void Linear(const std::string& module, int64_t out, int64_t in, WeightRole role, TpSplit split,
              int64_t expert = -1) {
    WeightSpec spec;
    spec.split = expert >= 0 ? TpSplit::kExpert : split;
    spec.name = absl::StrCat(prefix_, module);
    spec.is_linear = true;
    spec.quantized = config_.quantization.has_value() && config_.quantization->IsQuantized(spec.name);
    spec.shape = {out, in};
    spec.role = role;
    spec.layer = layer_;
    spec.expert = expert;
    out_->push_back(std::move(spec));
  }

  // gate/up/down of a SiLU-gated MLP under `module`.
  void GatedMlp(const std::string& module, int64_t intermediate, int64_t expert = -1) {
    const int64_t hidden = config_.hidden_size;
    Linear(module + ".gate_proj", intermediate, hidden, WeightRole::kInputProjection,
           TpSplit::kRows, expert);
    Linear(module + ".up_proj", intermediate, hidden, WeightRole::kInputProjection, TpSplit::kRows,
           expert);
    Linear(module + ".down_proj", hidden, intermediate, WeightRole::kOutputProjection,
           TpSplit::kCols, expert);
  }

  void set_layer(int64_t layer) { layer_ = layer; }

 private:
  const ModelConfig& config_;
  std::vector<WeightSpec>* out_;
  std::string prefix_;
  int64_t layer_ = -1;
};

void AddAttention(const ModelConfig& c, const std::string& p, SpecBuilder& b) {
  const int64_t heads = c.num_attention_heads;
  if (c.has_q_lora()) {
    b.Linear(p + "q_a_proj", c.q_lora_rank, c.hidden_size, WeightRole::kInputProjection,
             TpSplit::kReplicated);
    b.Tensor(p + "q_a_layernorm.weight", {c.q_lora_rank}, WeightRole::kNorm);
    b.Linear(p + "q_b_proj", heads * c.qk_head_dim(), c.q_lora_rank, WeightRole::kInputProjection,
             TpSplit::kRows);
  } else {
    b.Linear(p + "q_proj", heads * c.qk_head_dim(), c.hidden_size, WeightRole::kInputProjection,
             TpSplit::kRows);
  }
  b.Linear(p + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, c.hidden_size,
           WeightRole::kInputProjection, TpSplit::kReplicated);
  b.Tensor(p + "kv_a_layernorm.weight", {c.kv_lora_rank}, WeightRole::kNorm);
  b.Linear(p + "kv_b_proj", heads * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank,
           WeightRole::kInputProjection, TpSplit::kRows);
  b.Linear(p + "o_proj", c.hidden_size, heads * c.v_head_dim, WeightRole::kOutputProjection,
           TpSplit::kCols);
}

void AddMoe(const ModelConfig& c, const std::string& p, SpecBuilder& b) {
  b.Tensor(p + "gate.weight", {c.n_routed_experts, c.hidden_size}, WeightRole::kRouter);
  b.Tensor(p + "gate.e_score_correction_bias", {c.n_routed_experts}, WeightRole::kRouterBias,
           TpSplit::kReplicated, DType::kF32);
  for (int64_t e = 0; e < c.n_routed_experts; ++e) {
    b.GatedMlp(absl::StrCat(p, "experts.", e), c.moe_intermediate_size, e);
  }
  if (c.n_shared_experts > 0) {
    b.GatedMlp(p + "shared_experts", c.moe_intermediate_size * c.n_shared_experts);
  }
}

}  // namespace

int64_t WeightSpec::num_elements() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

int64_t WeightSpec::stored_bytes(int group_size) const {
  if (!quantized) return num_elements() * DTypeSize(dtype);
  const int64_t packed = num_elements() / 2;
  const int64_t scales = num_elements() / group_size * 2;
  return packed + scales + 2 * 8;
}

int64_t WeightSpec::placed_bytes(int group_size) const {
  return quantized ? stored_bytes(group_size) - 2 * 8 : stored_bytes(group_size);
}

std::vector<WeightSpec> TextModelWeights(const ModelConfig& c) {
  std::vector<WeightSpec> specs;
  SpecBuilder b(c, &specs);
  b.Tensor("model.embed_tokens.weight", {c.vocab_size, c.hidden_size}, WeightRole::kEmbedding,
           TpSplit::kVocabRows);
  for (int64_t layer = 0; layer < c.num_hidden_layers; ++layer) {
    b.set_layer(layer);
    const std::string p = absl::StrCat("model.layers.", layer, ".");
    b.Tensor(p + "input_layernorm.weight", {c.hidden_size}, WeightRole::kNorm);
    AddAttention(c, p + "self_attn.", b);
    b.Tensor(p + "post_attention_layernorm.weight", {c.hidden_size}, WeightRole::kNorm);
    if (c.IsMoeLayer(layer)) {
      AddMoe(c, p + "mlp.", b);
    } else {
      b.GatedMlp(p + "mlp", c.intermediate_size);
    }
  }
  b.set_layer(-1);
  b.Tensor("model.norm.weight", {c.hidden_size}, WeightRole::kNorm);
  if (!c.tie_word_embeddings) {
    b.Tensor("lm_head.weight", {c.vocab_size, c.hidden_size}, WeightRole::kLmHead,
             TpSplit::kNotLoaded);
  }
  return specs;
}

absl::Status CheckTensorParallelDegree(const ModelConfig& c, int tp) {
  if (tp < 1) return absl::InvalidArgumentError(absl::StrCat("--tp ", tp, " must be at least 1"));
  const std::pair<const char*, int64_t> divisible[] = {
      {"num_attention_heads", c.num_attention_heads},
      {"intermediate_size", c.intermediate_size},
      {"moe_intermediate_size * n_shared_experts", c.moe_intermediate_size * c.n_shared_experts}};
  for (const auto& [name, value] : divisible) {
    if (value % tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tp ", tp, ": ", name, " (", value, ") is not divisible by ", tp));
    }
  }
  return absl::OkStatus();
}

int ExpertOwner(int64_t expert, int64_t num_experts, int tp) {
  return static_cast<int>(expert * tp / num_experts);
}

RankShare ShareOf(const WeightSpec& spec, const ModelConfig& c, int rank, int tp) {
  const int64_t rows = spec.shape.empty() ? 0 : spec.shape[0];
  switch (spec.split) {
    case TpSplit::kNotLoaded: return {false, 0, 0};
    case TpSplit::kReplicated: return {true, 0, rows};
    case TpSplit::kExpert:
      return {ExpertOwner(spec.expert, c.n_routed_experts, tp) == rank, 0, rows};
    case TpSplit::kRows:  // divisibility checked by CheckTensorParallelDegree
      return {true, rows / tp * rank, rows / tp};
    case TpSplit::kCols: {
      const int64_t cols = spec.shape[1];
      return {true, cols / tp * rank, cols / tp};
    }
    case TpSplit::kVocabRows: {
      const int64_t begin = rows * rank / tp;
      return {true, begin, rows * (rank + 1) / tp - begin};
    }
  }
  return {true, 0, rows};
}

int64_t BytesOnRank(const WeightSpec& spec, const ModelConfig& c, int rank, int tp) {
  const RankShare share = ShareOf(spec, c, rank, tp);
  if (!share.held) return 0;
  const int group = c.quantization ? c.quantization->group_size : 32;
  const int64_t whole = spec.placed_bytes(group);
  const int64_t dimension = spec.split == TpSplit::kCols ? spec.shape[1] : spec.shape[0];
  return dimension == 0 ? whole : whole / dimension * share.count;
}

std::vector<int64_t> BytesPerRank(const ModelConfig& c, int tp) {
  std::vector<int64_t> bytes(tp, 0);
  for (const WeightSpec& spec : TextModelWeights(c)) {
    for (int rank = 0; rank < tp; ++rank) bytes[rank] += BytesOnRank(spec, c, rank, tp);
  }
  return bytes;
}

}  // namespace hsx
