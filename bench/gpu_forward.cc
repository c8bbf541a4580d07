// gpu_forward: one tensor-parallel rank's share of Kimi-K2 decoder layers on
// one GPU, through the CUDA backend (kernels/cuda), at the real dimensions:
// 8 of 64 attention heads and 48 of 384 routed experts (rank 0 of TP 8),
// INT4 routed experts, the shared expert split 8 ways. Reports, at each
// --tokens value (packed samples of --sample-length), tokens/s of the layers
// and TFLOP/s per op class, against a cuBLASLt BF16 GEMM (8192^3, through the
// same backend and its pinned algorithm) measured in the same run,
// interleaved with the forwards: median and range over --repeats.
//
// At --capture-tokens it also times the captures: the forward with the
// residual stream copied to pinned host memory before every layer and after
// the last (one CopyToHost per sample), with the capture overlap off and on
// (kernels/cuda/cuda_backend.h, "Captures"), against the same forward without
// captures, interleaved; and the copies alone. The difference is the copy
// time the forward pays.
//
// What it leaves out: the all-reduces (one rank, no communicator: their
// per-layer volume is printed) and the embedding. Dense weights are generated on the device; the
// routed experts are generated once on the host (one expert's INT4 data) and
// placed 48 times per layer through PlaceExperts, the loader's path.
//
// Where there is no GPU it prints "gpu_forward: no GPU: <reason>" and exits 0.
// A last line "RESULT {json}" is what the device check's runner reads.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "kernels/backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/int4_dequant.h"
#include "kernels/cuda/ops.h"
#include "server/model/forward.h"
#include "server/model/random_model.h"
#include "base/cli.h"

ABSL_FLAG(std::string, tokens, "8192,32768", "Tokens per forward, comma-separated.");
ABSL_FLAG(int64_t, sample_length, 4096, "Tokens per packed sample (the last one may be shorter).");
ABSL_FLAG(int, layers, 2, "MoE decoder layers per forward.");
ABSL_FLAG(int, repeats, 3, "Timed repeats of each measurement (after one warm-up).");
ABSL_FLAG(double, max_seconds, 150, "Stop starting new repeats after this many seconds (results so far are kept).");
ABSL_FLAG(int, device, 0, "CUDA device.");
ABSL_FLAG(int64_t, capture_tokens, 32768,
          "Tokens of the capture-copy measurement (the residual stream copied to pinned host memory before every "
          "layer and after the last, one copy per sample, with the overlap off and on); 0 skips it.");
ABSL_FLAG(std::string, attention, "reference",
          "Attention kernel: reference (the tiled kernel) or cudnn (cuDNN's SDPA; not yet validated on a GPU).");

namespace hsx {
namespace {

using Clock = std::chrono::steady_clock;

constexpr int kTp = 8;  // the production degree whose rank-0 share is measured

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

std::string Range(const std::vector<double>& v) {
  if (v.empty()) return "-";
  return absl::StrFormat("%.3g..%.3g", *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
}

#define BENCH_RETURN_IF_ERROR(expr)        \
  do {                                     \
    absl::Status _s = (expr);              \
    if (!_s.ok()) return _s;               \
  } while (0)

// Device memory the bench owns: a Buffer of the backend, filled on the device.
class Weights {
 public:
  explicit Weights(Backend& backend) : backend_(backend) {}

  absl::StatusOr<LinearWeight> Linear(int64_t out, int64_t in, uint32_t seed) {
    absl::StatusOr<std::unique_ptr<Buffer>> buffer = backend_.Allocate(out, in, ElementType::kBf16);
    if (!buffer.ok()) return buffer.status();
    const Matrix m = (*buffer)->matrix();
    if (m.ld != in) return absl::InternalError(absl::StrCat("weight [", out, ", ", in, "] has ld ", m.ld));
    // The pool allocates in the backend's stream order: wait for it before
    // the default stream writes the memory.
    if (absl::Status s = backend_.Synchronize(); !s.ok()) return s;
    if (int s = cuda::LaunchFillPattern(m.data, out * in, true, seed, nullptr); s != 0) {
      return absl::InternalError(absl::StrCat("LaunchFillPattern [", out, ", ", in, "]: ",
                                              cudaGetErrorString(static_cast<cudaError_t>(s))));
    }
    owned_.push_back(*std::move(buffer));
    LinearWeight w;
    w.kind = LinearWeight::Kind::kBf16;
    w.bf16 = static_cast<const uint16_t*>(m.data);
    w.ld = in;
    w.out = out;
    w.in = in;
    return w;
  }

 private:
  Backend& backend_;
  std::vector<std::unique_ptr<Buffer>> owned_;
};

struct Layer {
  LinearWeight q_a, q_b, kv_a, kv_b, o, shared_gate, shared_up, shared_down;
  const uint16_t* q_a_norm = nullptr;
  const uint16_t* kv_a_norm = nullptr;
  const uint16_t* input_norm = nullptr;
  const uint16_t* post_norm = nullptr;
  RouterParams router;
  std::unique_ptr<ExpertTable> experts;
};

// One routed expert in the checkpoint's INT4 layout, on the host: placed for
// every held expert (the values do not change the work).
struct HostExpert {
  std::vector<int32_t> packed[3];
  std::vector<uint16_t> scale[3];
  ExpertWeights weights;

  HostExpert(int64_t hidden, int64_t inter, int64_t group) {
    std::mt19937 random(7);
    const int64_t shapes[3][2] = {{inter, hidden}, {inter, hidden}, {hidden, inter}};
    LinearWeight* views[3] = {&weights.gate, &weights.up, &weights.down};
    for (int i = 0; i < 3; ++i) {
      const int64_t out = shapes[i][0], in = shapes[i][1];
      packed[i].resize(static_cast<size_t>(out * in / 8));
      for (int32_t& word : packed[i]) word = static_cast<int32_t>(random());
      scale[i].assign(static_cast<size_t>(out * in / group), 0x3c00);  // bf16 0.0078125
      LinearWeight& w = *views[i];
      w.kind = LinearWeight::Kind::kInt4;
      w.packed = packed[i].data();
      w.scale = scale[i].data();
      w.group_size = group;
      w.out = out;
      w.in = in;
    }
  }
};

// Seconds of each op class, summed over the layers of one forward.
using ClassTimes = std::map<std::string, double>;

class Bench {
 public:
  Bench(const ModelConfig& config, Backend& backend) : c_(config), backend_(backend), weights_(backend) {}

  absl::Status Build(int layers) {
    const int64_t h = c_.hidden_size, heads = c_.num_attention_heads / kTp;
    const int64_t shared_inter = c_.moe_intermediate_size * c_.n_shared_experts / kTp;
    std::vector<uint16_t> ones(static_cast<size_t>(std::max(h, c_.q_lora_rank)), 0x3f80);  // bf16 1.0
    std::vector<float> bias(static_cast<size_t>(c_.n_routed_experts), 0.0f);
    const HostExpert expert(h, c_.moe_intermediate_size, c_.quantization ? c_.quantization->group_size : 32);
    std::vector<ExpertWeights> host(static_cast<size_t>(c_.n_routed_experts), expert.weights);
    std::vector<bool> held_vector(static_cast<size_t>(c_.n_routed_experts));
    for (int64_t e = 0; e < c_.n_routed_experts; ++e) held_vector[e] = e < c_.n_routed_experts / kTp;
    std::unique_ptr<bool[]> held(new bool[held_vector.size()]);
    for (size_t e = 0; e < held_vector.size(); ++e) held[e] = held_vector[e];
    uint32_t seed = 1;
    for (int l = 0; l < layers; ++l) {
      Layer layer;
      auto linear = [&](LinearWeight* w, int64_t out, int64_t in) -> absl::Status {
        absl::StatusOr<LinearWeight> made = weights_.Linear(out, in, seed++);
        if (!made.ok()) return made.status();
        *w = *made;
        return absl::OkStatus();
      };
      BENCH_RETURN_IF_ERROR(linear(&layer.q_a, c_.q_lora_rank, h));
      BENCH_RETURN_IF_ERROR(linear(&layer.q_b, heads * c_.qk_head_dim(), c_.q_lora_rank));
      BENCH_RETURN_IF_ERROR(linear(&layer.kv_a, c_.kv_lora_rank + c_.qk_rope_head_dim, h));
      BENCH_RETURN_IF_ERROR(linear(&layer.kv_b, heads * (c_.qk_nope_head_dim + c_.v_head_dim), c_.kv_lora_rank));
      BENCH_RETURN_IF_ERROR(linear(&layer.o, h, heads * c_.v_head_dim));
      BENCH_RETURN_IF_ERROR(linear(&layer.shared_gate, shared_inter, h));
      BENCH_RETURN_IF_ERROR(linear(&layer.shared_up, shared_inter, h));
      BENCH_RETURN_IF_ERROR(linear(&layer.shared_down, h, shared_inter));
      for (const uint16_t** norm : {&layer.q_a_norm, &layer.kv_a_norm, &layer.input_norm, &layer.post_norm}) {
        absl::StatusOr<const void*> placed = backend_.PlaceTensor(ones.data(), ones.size() * 2);
        if (!placed.ok()) return placed.status();
        *norm = static_cast<const uint16_t*>(*placed);
      }
      LinearWeight router_weight;
      BENCH_RETURN_IF_ERROR(linear(&router_weight, c_.n_routed_experts, h));
      absl::StatusOr<const void*> placed_bias = backend_.PlaceTensor(bias.data(), bias.size() * 4);
      if (!placed_bias.ok()) return placed_bias.status();
      layer.router.weight = router_weight.bf16;
      layer.router.bias = static_cast<const float*>(*placed_bias);
      layer.router.num_experts = c_.n_routed_experts;
      layer.router.top_k = c_.num_experts_per_tok;
      layer.router.n_group = c_.n_group;
      layer.router.topk_group = c_.topk_group;
      layer.router.normalize = c_.norm_topk_prob;
      layer.router.scaling = static_cast<float>(c_.routed_scaling_factor);
      absl::StatusOr<std::unique_ptr<ExpertTable>> table =
          backend_.PlaceExperts(host, std::span<const bool>(held.get(), held_vector.size()));
      if (!table.ok()) return table.status();
      layer.experts = *std::move(table);
      layers_.push_back(std::move(layer));
    }
    if (cudaError_t s = cudaDeviceSynchronize(); s != cudaSuccess) {  // the fills ran on the default stream
      return absl::InternalError(absl::StrCat("filling the weights: ", cudaGetErrorString(s)));
    }
    return backend_.Synchronize();
  }

  // One forward of the layers over `tokens` tokens; per-class seconds (the
  // stream is drained between classes) and the routed (token, slot) pairs
  // that chose a held expert, summed over the layers (the same every time:
  // the inputs are a fixed pattern).
  absl::StatusOr<ClassTimes> Forward(int64_t tokens, int64_t sample_length, int64_t* held_pairs) {
    absl::StatusOr<std::unique_ptr<Activations>> made = Prepare(tokens, sample_length);
    if (!made.ok()) return made.status();
    Activations& a = **made;
    ClassTimes times;
    Clock::time_point mark = Clock::now();
    // Drains the stream and books the time since the last mark to `op_class`.
    auto book = [&](const char* op_class) -> absl::Status {
      BENCH_RETURN_IF_ERROR(backend_.Synchronize());
      const Clock::time_point now = Clock::now();
      times[op_class] += std::chrono::duration<double>(now - mark).count();
      mark = now;
      return absl::OkStatus();
    };
    *held_pairs = 0;
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    mark = Clock::now();
    for (const Layer& layer : layers_) {
      BENCH_RETURN_IF_ERROR(RunLayer(layer, a, book));
      *held_pairs += HeldPairs(*a.routing, tokens);
      mark = Clock::now();  // the routing copy is not the forward's
    }
    return times;
  }

  // How CapturedForward copies the residual stream to the host.
  enum class CaptureMode { kNone, kInline, kOverlapped };

  // One forward of the layers with no drains between ops, capturing the
  // residual stream before every layer and after the last (forward.cc's
  // `--capture all`), one CopyToHost per sample into pinned memory, with
  // the copies on the compute stream (kInline) or overlapped on the copy
  // stream (kOverlapped), or not at all: seconds to the final Synchronize.
  // With `copies_only`, the captures alone, no layers: the copy time itself.
  // Also the bytes copied.
  absl::StatusOr<double> CapturedForward(int64_t tokens, int64_t sample_length, CaptureMode mode, bool copies_only,
                                         double* bytes) {
    absl::StatusOr<std::unique_ptr<Activations>> made = Prepare(tokens, sample_length);
    if (!made.ok()) return made.status();
    Activations& a = **made;
    const int64_t points = static_cast<int64_t>(layers_.size()) + 1;
    const size_t layer_bytes = static_cast<size_t>(tokens * c_.hidden_size) * 2;
    *bytes = static_cast<double>(layer_bytes) * points;
    if (mode != CaptureMode::kNone) {
      CudaCaptureOptions options;
      options.overlap = mode == CaptureMode::kOverlapped;
      BENCH_RETURN_IF_ERROR(SetCudaCaptureOptions(backend_, options));
      if (captures_ == nullptr || captures_->bytes() < layer_bytes * points) {
        captures_.reset();
        absl::StatusOr<std::unique_ptr<HostBuffer>> host = backend_.AllocateHost(layer_bytes * points);
        if (!host.ok()) return host.status();
        captures_ = *std::move(host);
      }
    }
    const std::vector<int64_t>& cu = a.cu;
    auto capture = [&](int64_t point) {
      if (mode == CaptureMode::kNone) return;
      char* base = static_cast<char*>(captures_->data()) + static_cast<size_t>(point) * layer_bytes;
      for (size_t s = 0; s + 1 < cu.size(); ++s) {
        backend_.CopyToHost(a.h.Rows(cu[s], cu[s + 1] - cu[s]), base + static_cast<size_t>(cu[s]) * c_.hidden_size * 2);
      }
    };
    auto no_drain = [](const char*) { return absl::OkStatus(); };
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    const Clock::time_point start = Clock::now();
    for (size_t l = 0; l < layers_.size(); ++l) {
      capture(static_cast<int64_t>(l));
      if (!copies_only) BENCH_RETURN_IF_ERROR(RunLayer(layers_[l], a, no_drain));
    }
    capture(points - 1);
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  // y[8192, 8192] = x · Wᵀ, bf16, through the backend: seconds of one.
  absl::StatusOr<double> PeakGemm() {
    constexpr int64_t n = 8192;
    if (peak_x_ == nullptr) {
      absl::StatusOr<std::unique_ptr<Buffer>> x = backend_.Allocate(n, n, ElementType::kBf16);
      absl::StatusOr<std::unique_ptr<Buffer>> y = backend_.Allocate(n, n, ElementType::kBf16);
      if (!x.ok()) return x.status();
      if (!y.ok()) return y.status();
      peak_x_ = *std::move(x);
      peak_y_ = *std::move(y);
      BENCH_RETURN_IF_ERROR(backend_.Synchronize());
      absl::StatusOr<LinearWeight> w = weights_.Linear(n, n, 4242);
      if (!w.ok()) return w.status();
      peak_w_ = *w;
      if (cuda::LaunchFillPattern(peak_x_->matrix().data, n * n, true, 4343, nullptr) != 0 ||
          cudaDeviceSynchronize() != cudaSuccess) {
        return absl::InternalError("filling the peak GEMM's input");
      }
      backend_.Linear(peak_x_->matrix(), peak_w_, peak_y_->matrix(), false);  // plans the shape
      BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    }
    const Clock::time_point start = Clock::now();
    backend_.Linear(peak_x_->matrix(), peak_w_, peak_y_->matrix(), false);
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

  // The INT4 -> bf16 dequantisation of the held experts of one layer (what
  // MoeExperts does when every held expert has tokens), alone: seconds, and
  // the bytes it reads and writes.
  absl::StatusOr<double> Dequant(double* bytes) {
    const int64_t h = c_.hidden_size, inter = c_.moe_intermediate_size;
    const int64_t group = c_.quantization ? c_.quantization->group_size : 32;
    const int64_t experts = c_.n_routed_experts / kTp;
    const int64_t count = 3 * experts;  // gate, up, down: gate/up [inter, h], down [h, inter]
    if (dequant_block_ == nullptr) {
      // One allocation for the packed words, the scales and the bf16 output
      // of each weight (the values are whatever the pool held: the kernel's
      // work does not depend on them).
      const int64_t elements = inter * h;
      const int64_t per_bytes = elements / 2 + elements / group * 2 + elements * 2;
      absl::StatusOr<std::unique_ptr<Buffer>> block =
          backend_.Allocate(count, (per_bytes + 1) / 2, ElementType::kBf16);
      if (!block.ok()) return block.status();
      dequant_block_ = *std::move(block);
      char* base = static_cast<char*>(dequant_block_->matrix().data);
      const int64_t stride = dequant_block_->matrix().ld * 2;
      std::vector<const void*> pointers(static_cast<size_t>(3 * count));
      for (int64_t i = 0; i < count; ++i) {
        char* w = base + i * stride;
        pointers[i] = w;                                                    // packed
        pointers[count + i] = w + elements / 2;                             // scales
        pointers[2 * count + i] = w + elements / 2 + elements / group * 2;  // out (16-byte aligned below)
        if (reinterpret_cast<uintptr_t>(pointers[2 * count + i]) % 16 != 0) {
          return absl::InternalError("dequant output not 16-byte aligned");
        }
      }
      absl::StatusOr<std::unique_ptr<Buffer>> table =
          backend_.Allocate(1, static_cast<int64_t>(pointers.size()) * 4, ElementType::kBf16);
      if (!table.ok()) return table.status();
      dequant_pointers_ = *std::move(table);
      BENCH_RETURN_IF_ERROR(backend_.Synchronize());  // the allocations, before the default stream uses them
      if (cudaMemcpy(dequant_pointers_->matrix().data, pointers.data(), pointers.size() * sizeof(void*),
                     cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("copying the dequant pointers");
      }
    }
    auto* p = static_cast<void**>(dequant_pointers_->matrix().data);
    *bytes = static_cast<double>(count) * (inter * h / 2 + inter * h / group * 2 + inter * h * 2);
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    const Clock::time_point start = Clock::now();
    // gate and up as one batch of [inter, h]; down [h, inter].
    const int64_t gu = 2 * experts;
    int s = LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p),
                                        reinterpret_cast<const uint16_t* const*>(p + count),
                                        reinterpret_cast<uint16_t* const*>(p + 2 * count), gu, inter, h, group,
                                        nullptr);
    if (s == 0) {
      s = LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p + gu),
                                      reinterpret_cast<const uint16_t* const*>(p + count + gu),
                                      reinterpret_cast<uint16_t* const*>(p + 2 * count + gu), experts, h, inter,
                                      group, nullptr);
    }
    if (s != 0) return absl::InternalError(absl::StrCat("LaunchDequantizeInt4Batched: ", s));
    if (cudaError_t e = cudaDeviceSynchronize(); e != cudaSuccess) {
      return absl::InternalError(absl::StrCat("dequant: ", cudaGetErrorString(e)));
    }
    return std::chrono::duration<double>(Clock::now() - start).count();
  }

 private:
  // One forward's staged batch and activation buffers.
  struct Activations {
    std::unique_ptr<StagedBatch> batch;
    std::vector<int64_t> cu;  // the packed samples' cu_seqlens
    std::vector<std::unique_ptr<Buffer>> buffers;
    Matrix h, x, update, q_lat, q, compressed, latent, kv, attn, partial, gate, up;
    std::unique_ptr<Routing> routing;
  };

  // Stages `tokens` tokens in samples of `sample_length` and allocates the
  // activations, the residual stream filled with a fixed pattern.
  absl::StatusOr<std::unique_ptr<Activations>> Prepare(int64_t tokens, int64_t sample_length) {
    const int64_t h = c_.hidden_size, heads = c_.num_attention_heads / kTp;
    auto a = std::make_unique<Activations>();
    std::vector<int32_t> ids(static_cast<size_t>(tokens), 1);
    a->cu = {0};
    while (a->cu.back() < tokens) a->cu.push_back(std::min(tokens, a->cu.back() + sample_length));
    absl::StatusOr<std::unique_ptr<StagedBatch>> batch = backend_.Stage(ids, a->cu);
    if (!batch.ok()) return batch.status();
    a->batch = *std::move(batch);
    if (rope_ == nullptr || rope_->positions() < sample_length) {
      const RopeValues values = Model::MakeRopeValues(c_, sample_length, ElementType::kBf16);
      absl::StatusOr<std::unique_ptr<RopeTable>> rope =
          backend_.PlaceRopeTable(values.cos, values.sin, values.half_dim);
      if (!rope.ok()) return rope.status();
      rope_ = *std::move(rope);
      BENCH_RETURN_IF_ERROR(backend_.Synchronize());
    }
    const ElementType act = ElementType::kBf16;
    auto alloc = [&](int64_t cols, ElementType type, Matrix* m) -> absl::Status {
      absl::StatusOr<std::unique_ptr<Buffer>> b = backend_.Allocate(tokens, cols, type);
      if (!b.ok()) return b.status();
      *m = (*b)->matrix();
      a->buffers.push_back(*std::move(b));
      return absl::OkStatus();
    };
    BENCH_RETURN_IF_ERROR(alloc(h, act, &a->h));
    BENCH_RETURN_IF_ERROR(alloc(h, act, &a->x));
    BENCH_RETURN_IF_ERROR(alloc(h, act, &a->update));
    BENCH_RETURN_IF_ERROR(alloc(c_.q_lora_rank, act, &a->q_lat));
    BENCH_RETURN_IF_ERROR(alloc(heads * c_.qk_head_dim(), act, &a->q));
    BENCH_RETURN_IF_ERROR(alloc(c_.kv_lora_rank + c_.qk_rope_head_dim, act, &a->compressed));
    BENCH_RETURN_IF_ERROR(alloc(c_.kv_lora_rank, act, &a->latent));
    BENCH_RETURN_IF_ERROR(alloc(heads * (c_.qk_nope_head_dim + c_.v_head_dim), act, &a->kv));
    BENCH_RETURN_IF_ERROR(alloc(heads * c_.v_head_dim, act, &a->attn));
    BENCH_RETURN_IF_ERROR(alloc(2 * h, ElementType::kF32, &a->partial));  // routed | shared
    BENCH_RETURN_IF_ERROR(alloc(layers_[0].shared_gate.out, act, &a->gate));
    BENCH_RETURN_IF_ERROR(alloc(layers_[0].shared_gate.out, act, &a->up));
    BENCH_RETURN_IF_ERROR(backend_.Synchronize());  // the allocations, before the default stream writes
    if (int s = cuda::LaunchFillPattern(a->h.data, tokens * h, true, 99, nullptr); s != 0) {
      return absl::InternalError("LaunchFillPattern (hidden states)");
    }
    if (cudaError_t s = cudaDeviceSynchronize(); s != cudaSuccess) {
      return absl::InternalError(absl::StrCat("filling the hidden states: ", cudaGetErrorString(s)));
    }
    absl::StatusOr<std::unique_ptr<Routing>> routing = backend_.AllocateRouting(tokens, c_.num_experts_per_tok);
    if (!routing.ok()) return routing.status();
    a->routing = *std::move(routing);
    return a;
  }

  // Enqueues one decoder layer on `a`; `book(op_class)` after each class of
  // ops (Forward drains the stream there to time it).
  template <typename Book>
  absl::Status RunLayer(const Layer& layer, Activations& a, Book&& book) {
    const int64_t h = c_.hidden_size, heads = c_.num_attention_heads / kTp;
    const float eps = static_cast<float>(c_.rms_norm_eps);
    const float scale = Model::SoftmaxScale(c_);
    const StagedBatch& batch = *a.batch;
    backend_.RmsNorm(a.h, layer.input_norm, eps, a.x);
    BENCH_RETURN_IF_ERROR(book("other"));
    backend_.Linear(a.x, layer.q_a, a.q_lat, false);
    BENCH_RETURN_IF_ERROR(book("attention projections"));
    backend_.RmsNorm(a.q_lat, layer.q_a_norm, 1e-6f, a.q_lat);
    BENCH_RETURN_IF_ERROR(book("other"));
    backend_.Linear(a.q_lat, layer.q_b, a.q, false);
    backend_.Linear(a.x, layer.kv_a, a.compressed, false);
    BENCH_RETURN_IF_ERROR(book("attention projections"));
    backend_.RmsNorm(a.compressed.Cols(0, c_.kv_lora_rank), layer.kv_a_norm, 1e-6f, a.latent);
    BENCH_RETURN_IF_ERROR(book("other"));
    backend_.Linear(a.latent, layer.kv_b, a.kv, false);
    BENCH_RETURN_IF_ERROR(book("attention projections"));
    const Matrix k_rope = a.compressed.Cols(c_.kv_lora_rank, c_.qk_rope_head_dim);
    backend_.Rope(a.q, heads, c_.qk_head_dim(), c_.qk_nope_head_dim, batch, *rope_);
    backend_.Rope(k_rope, 1, c_.qk_rope_head_dim, 0, batch, *rope_);
    BENCH_RETURN_IF_ERROR(book("other"));
    backend_.Attention(a.q, a.kv, k_rope, heads, c_.qk_nope_head_dim, c_.qk_rope_head_dim, c_.v_head_dim, batch,
                       scale, a.attn);
    BENCH_RETURN_IF_ERROR(book("attention"));
    backend_.Linear(a.attn, layer.o, a.partial.Cols(0, h), true);
    BENCH_RETURN_IF_ERROR(book("attention projections"));
    backend_.Round(a.partial.Cols(0, h), a.update);
    backend_.Add(a.h, a.update, a.h);
    backend_.RmsNorm(a.h, layer.post_norm, eps, a.x);
    BENCH_RETURN_IF_ERROR(book("other"));
    backend_.Route(a.x, layer.router, *a.routing);
    BENCH_RETURN_IF_ERROR(book("router"));
    backend_.MoeExperts(a.x, *a.routing, *layer.experts, a.partial.Cols(0, h), true);
    BENCH_RETURN_IF_ERROR(book("routed experts"));
    backend_.Linear(a.x, layer.shared_gate, a.gate, false);
    backend_.Linear(a.x, layer.shared_up, a.up, false);
    backend_.SiluMul(a.gate, a.up, a.gate);
    backend_.Linear(a.gate, layer.shared_down, a.partial.Cols(h, h), true);
    BENCH_RETURN_IF_ERROR(book("shared expert"));
    backend_.Round(a.partial.Cols(0, h), a.update);
    backend_.Add(a.h, a.update, a.h);
    backend_.Round(a.partial.Cols(h, h), a.update);
    backend_.Add(a.h, a.update, a.h);
    return book("other");
  }

  // (token, slot) pairs of the routing whose expert this rank holds.
  int64_t HeldPairs(const Routing& routing, int64_t tokens) {
    std::vector<int32_t> experts(static_cast<size_t>(tokens * routing.top_k()));
    std::vector<float> weights(experts.size());
    backend_.CopyRoutingToHost(routing, experts.data(), weights.data());
    if (!backend_.Synchronize().ok()) return 0;
    int64_t pairs = 0;
    for (int32_t e : experts) pairs += e < c_.n_routed_experts / kTp ? 1 : 0;
    return pairs;
  }

  const ModelConfig& c_;
  Backend& backend_;
  Weights weights_;
  std::vector<Layer> layers_;
  std::unique_ptr<RopeTable> rope_;
  std::unique_ptr<Buffer> peak_x_, peak_y_, dequant_block_, dequant_pointers_;
  std::unique_ptr<HostBuffer> captures_;  // CapturedForward's pinned targets
  LinearWeight peak_w_;
};

// FLOPs of one forward's op classes (multiply-add = 2).
struct Flops {
  double projections = 0, attention = 0, routed = 0, shared = 0, router = 0;
};

Flops CountFlops(const ModelConfig& c, int64_t tokens, int64_t sample_length, int layers, int64_t held_pairs) {
  const double t = static_cast<double>(tokens), h = static_cast<double>(c.hidden_size);
  const double heads = static_cast<double>(c.num_attention_heads / kTp);
  Flops f;
  const double projection_params = c.q_lora_rank * h + heads * c.qk_head_dim() * c.q_lora_rank +
                                   (c.kv_lora_rank + c.qk_rope_head_dim) * h +
                                   heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank +
                                   h * heads * c.v_head_dim;
  f.projections = 2 * t * projection_params * layers;
  // Causal: a sample of L rows has L (L + 1) / 2 (query, key) pairs, each
  // d_qk + d_v multiply-adds per head.
  double pairs = 0;
  for (int64_t begin = 0; begin < tokens; begin += sample_length) {
    const double l = static_cast<double>(std::min(sample_length, tokens - begin));
    pairs += l * (l + 1) / 2;
  }
  f.attention = 2 * pairs * heads * (c.qk_head_dim() + c.v_head_dim) * layers;
  f.routed = 2 * static_cast<double>(held_pairs) * 3 * c.moe_intermediate_size * h;  // summed over layers already
  f.shared = 2 * t * 3 * (c.moe_intermediate_size * c.n_shared_experts / kTp) * h * layers;
  f.router = 2 * t * c.n_routed_experts * h * layers;
  return f;
}

int Main() {
  const int device = absl::GetFlag(FLAGS_device);
  std::vector<int64_t> token_counts;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_tokens), ',', absl::SkipEmpty())) {
    int64_t value = 0;
    if (!absl::SimpleAtoi(part, &value) || value < 1) {
      std::fprintf(stderr, "gpu_forward: --tokens: '%s' is not a positive count\n", std::string(part).c_str());
      return 2;
    }
    token_counts.push_back(value);
  }
  const int layers = absl::GetFlag(FLAGS_layers);
  const int repeats = absl::GetFlag(FLAGS_repeats);
  const int64_t sample_length = absl::GetFlag(FLAGS_sample_length);
  if (absl::GetFlag(FLAGS_capture_tokens) < 0) {
    std::fprintf(stderr, "gpu_forward: --capture-tokens must be 0 (skip) or a positive count\n");
    return 2;
  }
  if (token_counts.empty() || layers < 1 || repeats < 1 || sample_length < 1) {
    std::fprintf(stderr, "gpu_forward: --tokens, --layers, --repeats and --sample-length must be positive\n");
    return 2;
  }
  const std::string attention = absl::GetFlag(FLAGS_attention);
  if (attention != "reference" && attention != "cudnn") {
    std::fprintf(stderr, "gpu_forward: --attention '%s': expected reference or cudnn\n", attention.c_str());
    return 2;
  }
  absl::StatusOr<int> count = CudaDeviceCount();
  if (!count.ok()) {
    std::printf("gpu_forward: no GPU: %s\n", std::string(count.status().message()).c_str());
    std::printf("RESULT {\"gpu\": false}\n");
    return 0;
  }
  absl::StatusOr<std::string> described = DescribeCudaDevice(device);
  if (!described.ok()) {
    std::fprintf(stderr, "gpu_forward: %s\n", std::string(described.status().message()).c_str());
    return 1;
  }
  std::printf("gpu_forward: %s\n", described->c_str());
  const ModelConfig config = *PresetConfig("kimi-k2");
  std::printf("gpu_forward: %s attention\n", attention.c_str());
  absl::StatusOr<std::unique_ptr<Backend>> backend = MakeCudaBackend(
      device, ElementType::kBf16, attention == "cudnn" ? CudaAttention::kCudnn : CudaAttention::kReference);
  if (!backend.ok()) {
    std::fprintf(stderr, "gpu_forward: %s\n", std::string(backend.status().message()).c_str());
    return 1;
  }
  const Clock::time_point start = Clock::now();
  Bench bench(config, **backend);
  auto fail = [](const absl::Status& s) {
    std::fprintf(stderr, "gpu_forward: %s\n", std::string(s.message()).c_str());
    return 1;
  };
  if (absl::Status s = bench.Build(layers); !s.ok()) return fail(s);
  std::printf("gpu_forward: %d Kimi-K2 MoE layers, rank 0 of TP %d (%lld heads, %lld experts), built in %.1f s\n",
              layers, kTp, static_cast<long long>(config.num_attention_heads / kTp),
              static_cast<long long>(config.n_routed_experts / kTp),
              std::chrono::duration<double>(Clock::now() - start).count());

  // Warm-up: plans every GEMM shape (gemm.h) and fills the pool.
  std::vector<double> peak;
  std::vector<double> dequant;
  double dequant_bytes = 0;
  std::map<int64_t, std::vector<ClassTimes>> runs;
  std::map<int64_t, int64_t> pairs;
  if (absl::StatusOr<double> s = bench.PeakGemm(); !s.ok()) return fail(s.status());
  if (absl::StatusOr<double> s = bench.Dequant(&dequant_bytes); !s.ok()) return fail(s.status());
  for (int64_t tokens : token_counts) {
    if (absl::StatusOr<ClassTimes> s = bench.Forward(tokens, sample_length, &pairs[tokens]); !s.ok()) {
      return fail(s.status());
    }
  }
  // The capture measurement: five runs per repeat, in rotating order.
  const int64_t capture_tokens = absl::GetFlag(FLAGS_capture_tokens);
  struct CaptureRun {
    const char* name;
    Bench::CaptureMode mode;
    bool copies_only;
  };
  const std::vector<CaptureRun> capture_runs = {
      {"forward, no captures", Bench::CaptureMode::kNone, false},
      {"forward + captures, overlap off", Bench::CaptureMode::kInline, false},
      {"forward + captures, overlap on", Bench::CaptureMode::kOverlapped, false},
      {"captures alone, compute stream", Bench::CaptureMode::kInline, true},
      {"captures alone, overlapped path", Bench::CaptureMode::kOverlapped, true},
  };
  std::vector<std::vector<double>> capture_seconds(capture_runs.size());
  double capture_bytes = 0;
  if (capture_tokens > 0) {
    for (const CaptureRun& run : capture_runs) {  // warm-up: pinned memory, the ring, the pool
      if (absl::StatusOr<double> s =
              bench.CapturedForward(capture_tokens, sample_length, run.mode, run.copies_only, &capture_bytes);
          !s.ok()) {
        return fail(s.status());
      }
    }
  }
  const double budget = absl::GetFlag(FLAGS_max_seconds);
  int done = 0;
  for (int r = 0; r < repeats; ++r) {
    if (std::chrono::duration<double>(Clock::now() - start).count() > budget) {
      std::printf("gpu_forward: --max-seconds %.0f reached after %d repeat(s)\n", budget, done);
      break;
    }
    absl::StatusOr<double> p = bench.PeakGemm();
    if (!p.ok()) return fail(p.status());
    peak.push_back(*p);
    absl::StatusOr<double> d = bench.Dequant(&dequant_bytes);
    if (!d.ok()) return fail(d.status());
    dequant.push_back(*d);
    for (int64_t tokens : token_counts) {
      absl::StatusOr<ClassTimes> times = bench.Forward(tokens, sample_length, &pairs[tokens]);
      if (!times.ok()) return fail(times.status());
      runs[tokens].push_back(*times);
    }
    for (size_t i = 0; capture_tokens > 0 && i < capture_runs.size(); ++i) {
      const size_t k = (i + static_cast<size_t>(r)) % capture_runs.size();
      const CaptureRun& run = capture_runs[k];
      absl::StatusOr<double> seconds =
          bench.CapturedForward(capture_tokens, sample_length, run.mode, run.copies_only, &capture_bytes);
      if (!seconds.ok()) return fail(seconds.status());
      capture_seconds[k].push_back(*seconds);
    }
    ++done;
  }
  if (done == 0) return fail(absl::DeadlineExceededError("no repeat finished within --max-seconds"));

  std::vector<double> peak_tflops;
  for (double s : peak) peak_tflops.push_back(2.0 * 8192.0 * 8192.0 * 8192.0 / s / 1e12);
  const double peak_median = Median(peak_tflops);
  std::vector<double> dequant_gbs;
  for (double s : dequant) dequant_gbs.push_back(dequant_bytes / s / 1e9);
  std::printf("\ncuBLASLt BF16 GEMM 8192^3 (pinned algorithm): %.1f TFLOP/s median (%s), %d repeats\n", peak_median,
              Range(peak_tflops).c_str(), done);
  std::printf("INT4 -> bf16 dequant of %lld experts: %.2f ms median, %.0f GB/s (%s)\n",
              static_cast<long long>(config.n_routed_experts / kTp), Median(dequant) * 1e3, Median(dequant_gbs),
              Range(dequant_gbs).c_str());
  std::string json = absl::StrFormat(
      "{\"gpu\": true, \"device\": \"%s\", \"layers\": %d, \"repeats\": %d, \"peak_tflops\": %.1f, "
      "\"dequant_ms\": %.3f, \"dequant_gbs\": %.0f, \"forwards\": [",
      *described, layers, done, peak_median, Median(dequant) * 1e3, Median(dequant_gbs));
  bool first = true;
  for (int64_t tokens : token_counts) {
    const std::vector<ClassTimes>& times = runs[tokens];
    const Flops flops = CountFlops(config, tokens, sample_length, layers, pairs[tokens]);
    std::vector<double> totals;
    for (const ClassTimes& t : times) {
      double total = 0;
      for (const auto& [name, seconds] : t) total += seconds;
      totals.push_back(total);
    }
    const double total = Median(totals);
    std::vector<double> rates;
    for (double t : totals) rates.push_back(static_cast<double>(tokens) / t);
    std::printf("\n%lld tokens (samples of %lld), %d layers: %.3f s median (%s) per forward, %.0f tokens/s "
                "(rank-0 share, no all-reduce)\n",
                static_cast<long long>(tokens), static_cast<long long>(sample_length), layers, total,
                Range(totals).c_str(), Median(rates));
    std::printf("  %-24s %10s %8s %10s %8s\n", "op class", "ms", "share", "TFLOP/s", "of peak");
    const std::map<std::string, double> class_flops = {{"attention projections", flops.projections},
                                                       {"attention", flops.attention},
                                                       {"routed experts", flops.routed},
                                                       {"shared expert", flops.shared},
                                                       {"router", flops.router},
                                                       {"other", 0}};
    absl::StrAppend(&json, first ? "" : ", ", "{\"tokens\": ", tokens, ", \"seconds\": ", total,
                    ", \"tokens_per_s\": ", Median(rates), ", \"classes\": {");
    first = false;
    bool first_class = true;
    for (const auto& [name, class_flop] : class_flops) {
      std::vector<double> seconds;
      for (const ClassTimes& t : times) seconds.push_back(t.count(name) ? t.at(name) : 0.0);
      const double s = Median(seconds);
      const double tflops = s > 0 ? class_flop / s / 1e12 : 0;
      std::printf("  %-24s %10.2f %7.1f%% %10.1f %7.1f%%\n", name.c_str(), s * 1e3, 100 * s / total,
                  class_flop > 0 ? tflops : 0.0, class_flop > 0 ? 100 * tflops / peak_median : 0.0);
      absl::StrAppendFormat(&json, "%s\"%s\": {\"ms\": %.3f, \"tflops\": %.1f}", first_class ? "" : ", ", name,
                            s * 1e3, tflops);
      first_class = false;
    }
    // The routed experts' GEMMs alone, estimated: MoeExperts' time less the
    // standalone dequant of all held experts, per layer.
    std::vector<double> routed;
    for (const ClassTimes& t : times) routed.push_back(t.count("routed experts") ? t.at("routed experts") : 0.0);
    const double gemm_s = Median(routed) - layers * Median(dequant);
    std::printf("  routed experts: %lld (token, expert) rows per layer on this rank; GEMMs alone (MoeExperts less "
                "the dequant) %.1f TFLOP/s\n",
                static_cast<long long>(pairs[tokens] / layers),
                gemm_s > 0 ? flops.routed / gemm_s / 1e12 : 0.0);
    // What the left-out all-reduces would move at TP 8 (forward.cc): per
    // layer the attention output [T, hidden] and the MoE's routed | shared
    // halves [T, 2 hidden], f32 partials; each rank sends and receives 7/8
    // of each matrix twice (reduce-scatter, all-gather).
    const double reduce_bytes = 3.0 * static_cast<double>(tokens) * config.hidden_size * 4;
    std::printf("  all-reduce per layer at TP %d (not run here): %.0f MB of f32 partials, %.0f MB sent and as much "
                "received per rank\n",
                kTp, reduce_bytes / 1e6, reduce_bytes * 2 * (kTp - 1) / kTp / 1e6);
    absl::StrAppendFormat(&json, "}, \"routed_gemm_tflops\": %.1f, \"allreduce_mb_per_layer\": %.0f}",
                          gemm_s > 0 ? flops.routed / gemm_s / 1e12 : 0.0, reduce_bytes / 1e6);
  }
  absl::StrAppend(&json, "]");
  if (capture_tokens > 0) {
    // Exposed copy time: what the captures add to the forward, against the
    // forward without captures measured in the same repeats.
    std::vector<double> ms(capture_runs.size());
    for (size_t k = 0; k < capture_runs.size(); ++k) ms[k] = Median(capture_seconds[k]) * 1e3;
    std::printf("\ncapture copies at %lld tokens (samples of %lld): %d points (every layer's input and the last "
                "output), one CopyToHost per sample, %.0f MB to pinned memory per forward\n",
                static_cast<long long>(capture_tokens), static_cast<long long>(sample_length), layers + 1,
                capture_bytes / 1e6);
    for (size_t k = 0; k < capture_runs.size(); ++k) {
      std::vector<double> v;
      for (double x : capture_seconds[k]) v.push_back(x * 1e3);
      std::printf("  %-34s %9.2f ms median (%s)", capture_runs[k].name, ms[k], Range(v).c_str());
      if (capture_runs[k].copies_only) std::printf(", %.1f GB/s", capture_bytes / (ms[k] / 1e3) / 1e9);
      std::printf("\n");
    }
    const double exposed_off = ms[1] - ms[0], exposed_on = ms[2] - ms[0];
    std::printf("  copy time the forward pays: %.2f ms with the overlap off, %.2f ms with it on (%.0f%% of the "
                "copies' own %.2f ms hidden)\n",
                exposed_off, exposed_on, ms[3] > 0 ? 100 * (1 - exposed_on / ms[3]) : 0.0, ms[3]);
    absl::StrAppendFormat(&json,
                          ", \"captures\": {\"tokens\": %d, \"mb\": %.0f, \"copy_ms\": %.3f, "
                          "\"copy_overlapped_path_ms\": %.3f, \"forward_ms\": %.3f, \"forward_overlap_off_ms\": "
                          "%.3f, \"forward_overlap_on_ms\": %.3f, \"exposed_overlap_off_ms\": %.3f, "
                          "\"exposed_overlap_on_ms\": %.3f}",
                          capture_tokens, capture_bytes / 1e6, ms[3], ms[4], ms[0], ms[1], ms[2], exposed_off,
                          exposed_on);
  }
  absl::StrAppend(&json, "}");
  std::printf("\nRESULT %s\n", json.c_str());
  return 0;
}

}  // namespace
}  // namespace hsx

int main(int argc, char** argv) {
  hsx::AcceptDashedFlags(argc, argv);
  absl::SetProgramUsageMessage(
      "gpu_forward [--tokens=8192,32768] [--layers=2] [--repeats=3] [--max-seconds=150] [--capture-tokens=32768]");
  absl::ParseCommandLine(argc, argv);
  return hsx::Main();
}
