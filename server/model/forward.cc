// forward.cc: embeddings, MLA attention, dense / MoE MLPs, capture.
#include "server/model/forward.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/status_macros.h"
#include "format/encoding.h"
#include "format/fp8.h"
#include "kernels/bf16.h"

namespace hsx {
namespace {

// Idle capture buffers the model keeps at least (more when a batch's captures
// add up to more: HostBufferPool::RaiseIdleCap).
constexpr size_t kIdleCaptureBytes = size_t{1} << 30;

// Rows the capture copy writes before it tells the sink (Model::CopyToSink):
// few enough to be read back from L2, enough that each copy call is worth it.
constexpr int64_t kSinkPieceBytes = int64_t{128} << 10;

// HF's yarn_get_mscale.
double YarnMscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

// The per-frequency inverse frequencies, float32, as HF's _compute_yarn_parameters.
std::vector<float> InverseFrequencies(const ModelConfig& c, double* attention_factor) {
  const int64_t dim = c.qk_rope_head_dim;
  const float base = static_cast<float>(c.rope_theta);
  std::vector<float> inv(dim / 2);
  std::vector<float> pos_freqs(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    pos_freqs[i] = std::pow(base, static_cast<float>(2 * i) / static_cast<float>(dim));
  }
  *attention_factor = 1.0;
  const RopeScaling& r = c.rope_scaling;
  if (r.type != "yarn") {
    for (int64_t i = 0; i < dim / 2; ++i) inv[i] = 1.0f / pos_freqs[i];
    return inv;
  }
  if (r.mscale != 0.0 && r.mscale_all_dim != 0.0) {
    *attention_factor = YarnMscale(r.factor, r.mscale) / YarnMscale(r.factor, r.mscale_all_dim);
  } else {
    *attention_factor = YarnMscale(r.factor, 1.0);
  }
  const double beta_fast = r.beta_fast != 0.0 ? r.beta_fast : 32.0;
  const double beta_slow = r.beta_slow != 0.0 ? r.beta_slow : 1.0;
  auto correction_dim = [&](double rotations) {
    return (dim * std::log(r.original_max_position_embeddings / (rotations * 2 * M_PI))) /
           (2 * std::log(c.rope_theta));
  };
  double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
  double high = std::min(std::ceil(correction_dim(beta_slow)), static_cast<double>(dim - 1));
  if (low == high) high += 0.001;
  const float factor = static_cast<float>(r.factor);
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float extrapolation = 1.0f / pos_freqs[i];
    const float interpolation = 1.0f / (factor * pos_freqs[i]);
    const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) /
                                      static_cast<float>(high - low), 0.0f, 1.0f);
    const float extrapolation_factor = 1.0f - ramp;
    inv[i] = interpolation * (1.0f - extrapolation_factor) + extrapolation * extrapolation_factor;
  }
  return inv;
}

// Widens a row of `type` to float32 (exact: bf16 is a float32 prefix).
void DecodeRow(ElementType type, const char* row, int64_t n, float* dst) {
  if (type == ElementType::kF32) {
    std::memcpy(dst, row, sizeof(float) * n);
    return;
  }
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(row);
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(bits[i]);
}

}  // namespace

void Batch::AddSample(const std::vector<int32_t>& sample) {
  tokens.insert(tokens.end(), sample.begin(), sample.end());
  cu_seqlens.push_back(static_cast<int64_t>(tokens.size()));
}

float Model::SoftmaxScale(const ModelConfig& c) {
  double scale = 1.0 / std::sqrt(static_cast<double>(c.qk_head_dim()));
  if (c.rope_scaling.type == "yarn" && c.rope_scaling.mscale_all_dim != 0.0) {
    const double m = YarnMscale(c.rope_scaling.factor, c.rope_scaling.mscale_all_dim);
    scale *= m * m;
  }
  return static_cast<float>(scale);
}

RopeValues Model::MakeRopeValues(const ModelConfig& config, int64_t positions, ElementType precision) {
  double attention_factor;
  const std::vector<float> inv = InverseFrequencies(config, &attention_factor);
  RopeValues table;
  table.half_dim = static_cast<int64_t>(inv.size());
  table.cos.resize(positions * table.half_dim);
  table.sin.resize(positions * table.half_dim);
  const float factor = static_cast<float>(attention_factor);
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < table.half_dim; ++i) {
      const float angle = static_cast<float>(p) * inv[i];
      float cos = std::cos(angle) * factor;
      float sin = std::sin(angle) * factor;
      if (precision == ElementType::kBf16) {  // HF casts cos/sin to the activation dtype
        cos = RoundToBf16(cos);
        sin = RoundToBf16(sin);
      }
      table.cos[p * table.half_dim + i] = cos;
      table.sin[p * table.half_dim + i] = sin;
    }
  }
  return table;
}

Captures& Captures::operator=(Captures&& other) noexcept {
  if (this == &other) return *this;
  (void)WaitForCopies();  // before this one's buffers go (every field below)
  ids = std::move(other.ids);
  has_final_norm = other.has_final_norm;
  tokens = other.tokens;
  hidden = other.hidden;
  type = other.type;
  cu_seqlens = std::move(other.cu_seqlens);
  samples = std::move(other.samples);
  copies = std::move(other.copies);
  fp8 = std::move(other.fp8);
  return *this;
}

size_t Captures::TensorBytes(int64_t s) const {
  const int64_t row = IsFp8(s) ? RowBytes(OutputDType::kFp8, hidden) : hidden * static_cast<int64_t>(ElementSize(type));
  return static_cast<size_t>((cu_seqlens[s + 1] - cu_seqlens[s]) * row);
}

size_t Captures::SampleBytes(int64_t s) const {
  const size_t tensors = IsFp8(s) ? fp8[s]->ids().size() + (fp8[s]->final_norm() ? 1 : 0)
                                  : ids.size() + (has_final_norm ? 1 : 0);
  return tensors * TensorBytes(s);
}

int64_t Captures::Slot(int64_t s, size_t k) const {
  if (!IsFp8(s)) return static_cast<int64_t>(k);
  const std::vector<int>& held = fp8[s]->ids();
  if (k >= ids.size()) return fp8[s]->final_norm() ? static_cast<int64_t>(held.size()) : -1;
  const auto it = std::find(held.begin(), held.end(), ids[k]);
  return it == held.end() ? -1 : it - held.begin();
}

void* Captures::Tensor(int64_t s, size_t k) const {
  const int64_t slot = Slot(s, k);
  if (slot < 0) return nullptr;
  return static_cast<char*>(samples[s]->data()) + static_cast<size_t>(slot) * TensorBytes(s);
}

namespace {

// The sample holding batch row t, and t's row within it.
std::pair<int64_t, int64_t> SampleOfRow(const std::vector<int64_t>& cu_seqlens, int64_t t) {
  const int64_t s = std::upper_bound(cu_seqlens.begin(), cu_seqlens.end(), t) - cu_seqlens.begin() - 1;
  return {s, t - cu_seqlens[s]};
}

}  // namespace

void Captures::LayerRow(size_t index, int64_t t, float* dst) const {
  const auto [s, row] = SampleOfRow(cu_seqlens, t);
  const char* tensor = static_cast<const char*>(Tensor(s, index));
  if (tensor == nullptr) {
    std::fill(dst, dst + hidden, std::numeric_limits<float>::quiet_NaN());
  } else if (IsFp8(s)) {
    DecodeFp8Row(reinterpret_cast<const uint8_t*>(tensor) + row * RowBytes(OutputDType::kFp8, hidden), hidden, dst);
  } else {
    DecodeRow(type, tensor + row * hidden * ElementSize(type), hidden, dst);
  }
}

void Captures::FinalNormRow(int64_t t, float* dst) const { LayerRow(ids.size(), t, dst); }

Model::Model(const ModelConfig& config, const ModelWeights& weights, Backend& backend,
             Communicator* communicator)
    : config_(config),
      weights_(weights),
      backend_(backend),
      communicator_(communicator),
      softmax_scale_(SoftmaxScale(config)),
      host_pool_(std::make_unique<HostBufferPool>([&backend](size_t bytes) { return backend.AllocateHost(bytes); },
                                                  kIdleCaptureBytes)) {}

absl::StatusOr<Matrix> Model::Scratch(int64_t rows, int64_t cols) {
  return Scratch(rows, cols, backend_.precision());
}

absl::StatusOr<Matrix> Model::Scratch(int64_t rows, int64_t cols, ElementType type) {
  HSX_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> buffer, backend_.Allocate(rows, cols, type));
  scratch_.push_back(std::move(buffer));
  return scratch_.back()->matrix();
}

bool Model::split() const { return communicator_ != nullptr && communicator_->size() > 1; }

absl::StatusOr<Matrix> Model::PartialFor(const Matrix& out) {
  if (!split() || out.type == ElementType::kF32) return out;
  return Scratch(out.rows, out.cols, ElementType::kF32);
}

absl::Status Model::Reduce(const Matrix& partial, const Matrix& out) {
  if (!split()) return absl::OkStatus();  // unsplit outputs were rounded by the op itself
  HSX_RETURN_IF_ERROR(communicator_->AllReduceSum(partial));
  backend_.Round(partial, out);
  return absl::OkStatus();
}

absl::Status Model::CheckBatch(const Batch& batch) const {
  if (batch.num_samples() < 1) return absl::InvalidArgumentError("empty batch");
  for (int64_t s = 0; s < batch.num_samples(); ++s) {
    const int64_t begin = batch.cu_seqlens[s];
    const int64_t end = batch.cu_seqlens[s + 1];
    if (end <= begin) return absl::InvalidArgumentError(absl::StrCat("sample ", s, " is empty"));
    for (int64_t t = begin; t < end; ++t) {
      if (batch.tokens[t] < 0 || batch.tokens[t] >= config_.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat("sample ", s, " position ", t - begin,
                                                       ": token id ", batch.tokens[t],
                                                       " is outside [0, ", config_.vocab_size, ")"));
      }
    }
  }
  if (batch.cu_seqlens.back() != static_cast<int64_t>(batch.tokens.size())) {
    return absl::InvalidArgumentError("cu_seqlens does not cover the batch's tokens");
  }
  return absl::OkStatus();
}

namespace {

// Run's fp8 samples: one entry per sample (or none), each a subset of `capture`.
absl::Status CheckFp8Samples(const Fp8Samples& fp8, const CaptureSpec& capture, int64_t samples) {
  if (!fp8.empty() && static_cast<int64_t>(fp8.size()) != samples) {
    return absl::InvalidArgumentError(absl::StrCat("fp8 samples: ", fp8.size(), " entries for ", samples, " samples"));
  }
  for (size_t s = 0; s < fp8.size(); ++s) {
    if (!fp8[s].has_value()) continue;
    for (int id : fp8[s]->ids()) {
      if (std::find(capture.ids().begin(), capture.ids().end(), id) == capture.ids().end()) {
        return absl::InvalidArgumentError(
            absl::StrCat("fp8 sample ", s, ": capture id ", id, " is not among the batch's captures"));
      }
    }
    if (fp8[s]->final_norm() && !capture.final_norm()) {
      return absl::InvalidArgumentError(absl::StrCat("fp8 sample ", s, ": the final norm is not captured"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status Model::TakeCaptureBuffers(Captures& result) {
  // A batch's captures are one buffer per sample: the pool keeps a whole
  // batch's worth idle, so the next batch allocates nothing (a fresh
  // pinned buffer on CUDA costs far more than a memcpy).
  size_t batch_bytes = 0;
  for (int64_t s = 0; s < result.num_samples(); ++s) batch_bytes += result.SampleBytes(s);
  host_pool_->RaiseIdleCap(batch_bytes);
  for (int64_t s = 0; s < result.num_samples(); ++s) {
    HSX_ASSIGN_OR_RETURN(std::unique_ptr<HostBuffer> buffer, host_pool_->Get(result.SampleBytes(s)));
    result.samples.push_back(std::move(buffer));
  }
  return absl::OkStatus();
}

absl::Status Model::EnsureRope(int64_t positions) {
  if (rope_ != nullptr && rope_->positions() >= positions) return absl::OkStatus();
  const RopeValues values = MakeRopeValues(config_, std::max<int64_t>(positions, 256), backend_.precision());
  HSX_ASSIGN_OR_RETURN(rope_, backend_.PlaceRopeTable(values.cos, values.sin, values.half_dim));
  // The host vectors may go: PlaceRopeTable copied them (stream-ordered).
  return backend_.Synchronize();
}

absl::Status Model::Embed(const StagedBatch& batch, const Matrix& h) {
  HSX_ASSIGN_OR_RETURN(Matrix partial, PartialFor(h));
  backend_.Embed(batch, weights_.embedding, weights_.vocab_begin, weights_.vocab_rows, partial);
  return Reduce(partial, h);
}

absl::Status Model::RunAttention(const LayerWeights& layer, const Matrix& x, const StagedBatch& batch,
                                 const Matrix& out) {
  const ModelConfig& c = config_;
  const AttentionWeights& a = layer.attention;
  const int64_t tokens = x.rows;
  const int64_t heads = weights_.local_heads;
  HSX_ASSIGN_OR_RETURN(Matrix q, Scratch(tokens, heads * c.qk_head_dim()));
  if (a.has_q_lora) {
    HSX_ASSIGN_OR_RETURN(Matrix q_latent, Scratch(tokens, c.q_lora_rank));
    backend_.Linear(x, a.q_a, q_latent, false);
    backend_.RmsNorm(q_latent, a.q_a_norm, 1e-6f, q_latent);  // HF builds it without eps: 1e-6
    backend_.Linear(q_latent, a.q_b, q, false);
  } else {
    backend_.Linear(x, a.q_b, q, false);
  }
  HSX_ASSIGN_OR_RETURN(Matrix compressed, Scratch(tokens, c.kv_lora_rank + c.qk_rope_head_dim));
  backend_.Linear(x, a.kv_a, compressed, false);
  HSX_ASSIGN_OR_RETURN(Matrix latent, Scratch(tokens, c.kv_lora_rank));
  backend_.RmsNorm(compressed.Cols(0, c.kv_lora_rank), a.kv_a_norm, 1e-6f, latent);
  HSX_ASSIGN_OR_RETURN(Matrix kv, Scratch(tokens, heads * (c.qk_nope_head_dim + c.v_head_dim)));
  backend_.Linear(latent, a.kv_b, kv, false);
  backend_.Rope(q, heads, c.qk_head_dim(), c.qk_nope_head_dim, batch, *rope_);
  const Matrix k_rope = compressed.Cols(c.kv_lora_rank, c.qk_rope_head_dim);
  backend_.Rope(k_rope, 1, c.qk_rope_head_dim, 0, batch, *rope_);
  HSX_ASSIGN_OR_RETURN(Matrix attention, Scratch(tokens, heads * c.v_head_dim));
  backend_.Attention(q, kv, k_rope, heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, batch,
                     softmax_scale_, attention);
  HSX_ASSIGN_OR_RETURN(Matrix partial, PartialFor(out));
  backend_.Linear(attention, a.o, partial, split());
  return Reduce(partial, out);
}

absl::Status Model::RunMlp(const MlpWeights& mlp, const Matrix& x, const Matrix& out) {
  HSX_ASSIGN_OR_RETURN(Matrix gate, Scratch(x.rows, mlp.gate.out));
  HSX_ASSIGN_OR_RETURN(Matrix up, Scratch(x.rows, mlp.up.out));
  backend_.Linear(x, mlp.gate, gate, false);
  backend_.Linear(x, mlp.up, up, false);
  backend_.SiluMul(gate, up, gate);
  HSX_ASSIGN_OR_RETURN(Matrix partial, PartialFor(out));
  backend_.Linear(gate, mlp.down, partial, split());
  return Reduce(partial, out);
}

absl::Status Model::RunMoe(const LayerWeights& layer, const Matrix& x, const Matrix& out) {
  HSX_ASSIGN_OR_RETURN(std::unique_ptr<Routing> routing, backend_.AllocateRouting(x.rows, layer.router.top_k));
  backend_.Route(x, layer.router, *routing);
  if (!layer.has_shared) {
    HSX_ASSIGN_OR_RETURN(Matrix partial, PartialFor(out));
    backend_.MoeExperts(x, *routing, *layer.experts, partial, split());
    return Reduce(partial, out);
  }
  // HF: bf16(routed) + shared_experts(x). Both halves are reduced in one
  // collective and rounded separately, so the split sum rounds where the
  // unsplit one does.
  HSX_ASSIGN_OR_RETURN(Matrix both, Scratch(x.rows, 2 * x.cols));
  HSX_ASSIGN_OR_RETURN(Matrix partial, PartialFor(both));
  backend_.MoeExperts(x, *routing, *layer.experts, partial.Cols(0, x.cols), split());
  HSX_ASSIGN_OR_RETURN(Matrix gate, Scratch(x.rows, layer.shared.gate.out));
  HSX_ASSIGN_OR_RETURN(Matrix up, Scratch(x.rows, layer.shared.up.out));
  backend_.Linear(x, layer.shared.gate, gate, false);
  backend_.Linear(x, layer.shared.up, up, false);
  backend_.SiluMul(gate, up, gate);
  backend_.Linear(gate, layer.shared.down, partial.Cols(x.cols, x.cols), split());
  HSX_RETURN_IF_ERROR(Reduce(partial, both));
  backend_.Add(both.Cols(0, x.cols), both.Cols(x.cols, x.cols), out);
  return absl::OkStatus();
}

absl::Status Model::RunLayer(const LayerWeights& layer, const StagedBatch& batch, const Matrix& h) {
  const float eps = static_cast<float>(config_.rms_norm_eps);
  HSX_ASSIGN_OR_RETURN(Matrix x, Scratch(h.rows, h.cols));
  HSX_ASSIGN_OR_RETURN(Matrix update, Scratch(h.rows, h.cols));
  backend_.RmsNorm(h, layer.input_norm, eps, x);
  HSX_RETURN_IF_ERROR(RunAttention(layer, x, batch, update));
  backend_.Add(h, update, h);
  backend_.RmsNorm(h, layer.post_attention_norm, eps, x);
  HSX_RETURN_IF_ERROR(layer.is_moe ? RunMoe(layer, x, update) : RunMlp(layer.dense, x, update));
  backend_.Add(h, update, h);
  return absl::OkStatus();
}

void Model::CopyToSink(const Matrix& rows, void* dst, CaptureSink& sink, int64_t s, size_t k) {
  const int64_t row_bytes = rows.cols * static_cast<int64_t>(ElementSize(rows.type));
  const int64_t step = std::max<int64_t>(1, kSinkPieceBytes / row_bytes);
  for (int64_t r = 0; r < rows.rows; r += step) {
    const int64_t n = std::min(step, rows.rows - r);
    char* out = static_cast<char*>(dst) + r * row_bytes;
    backend_.CopyToHost(rows.Rows(r, n), out);
    sink.Written(s, k, out, n * rows.cols);
  }
}

absl::StatusOr<Captures> Model::Run(const Batch& batch, const CaptureSpec& capture, CaptureSink* sink,
                                    const Fp8Samples& fp8) {
  HSX_RETURN_IF_ERROR(CheckBatch(batch));
  HSX_RETURN_IF_ERROR(CheckFp8Samples(fp8, capture, batch.num_samples()));
  scratch_.clear();
  const ModelConfig& c = config_;
  const int64_t tokens = static_cast<int64_t>(batch.tokens.size());
  const int64_t hidden = c.hidden_size;
  HSX_ASSIGN_OR_RETURN(std::unique_ptr<StagedBatch> staged, backend_.Stage(batch.tokens, batch.cu_seqlens));
  HSX_RETURN_IF_ERROR(EnsureRope(staged->longest()));
  // With tensor parallelism every rank holds the same residual stream; only
  // rank 0 copies it out.
  const bool captures_here = communicator_ == nullptr || communicator_->rank() == 0;
  Captures result;
  result.ids = capture.ids();
  result.has_final_norm = capture.final_norm();
  result.tokens = tokens;
  result.hidden = hidden;
  result.type = backend_.precision();
  result.cu_seqlens = batch.cu_seqlens;
  // Where copies land on return the sink encodes fp8 as they land; elsewhere
  // the device does (only the fp8 rows cross the bus).
  if (!backend_.copies_land_on_return()) result.fp8 = fp8;
  if (captures_here) HSX_RETURN_IF_ERROR(TakeCaptureBuffers(result));
  // The sink reads the rows as they land: only where they land on return.
  CaptureSink* const told = backend_.copies_land_on_return() ? sink : nullptr;
  // Copies m's rows of every sample into tensor k of that sample's buffer
  // (encoded, for an fp8 sample that holds it).
  auto copy_out = [&](const Matrix& m, size_t k) {
    for (int64_t s = 0; s < result.num_samples(); ++s) {
      const Matrix rows = m.Rows(batch.cu_seqlens[s], batch.cu_seqlens[s + 1] - batch.cu_seqlens[s]);
      void* dst = result.Tensor(s, k);
      if (result.IsFp8(s)) {
        if (dst != nullptr) backend_.CopyToHostFp8(rows, dst);
      } else if (told != nullptr) {
        CopyToSink(rows, dst, *told, s, k);
      } else {
        backend_.CopyToHost(rows, dst);
      }
    }
  };
  const int64_t last_layer = capture.final_norm() ? c.num_hidden_layers : (capture.ids().empty() ? 0 : capture.ids().back());

  HSX_ASSIGN_OR_RETURN(std::unique_ptr<Buffer> residual, backend_.Allocate(tokens, hidden, result.type));
  const Matrix h = residual->matrix();
  HSX_RETURN_IF_ERROR(Embed(*staged, h));
  auto capture_if_wanted = [&](int64_t id) {
    auto it = std::find(capture.ids().begin(), capture.ids().end(), id);
    if (captures_here && it != capture.ids().end()) copy_out(h, it - capture.ids().begin());
  };
  for (int64_t l = 0; l < last_layer; ++l) {
    capture_if_wanted(l);
    HSX_RETURN_IF_ERROR(RunLayer(weights_.layers[l], *staged, h));
    scratch_.clear();
  }
  capture_if_wanted(last_layer);  // the stream after the last layer run (N, or the largest id)
  std::unique_ptr<Buffer> normed;
  if (capture.final_norm() && captures_here) {
    HSX_ASSIGN_OR_RETURN(normed, backend_.Allocate(tokens, hidden, result.type));
    backend_.RmsNorm(h, weights_.final_norm, static_cast<float>(c.rms_norm_eps), normed->matrix());
    copy_out(normed->matrix(), capture.ids().size());
  }
  // The compute is done; the copies into the buffers may still run (CUDA),
  // and end with result.copies, which every reader waits for.
  HSX_ASSIGN_OR_RETURN(result.copies, backend_.FenceCopies());
  return result;
}

}  // namespace hsx
