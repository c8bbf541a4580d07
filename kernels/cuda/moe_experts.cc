// moe_experts.cc: the CudaBackend's mixture-of-experts path: routing (the
// router GEMM and the top-k kernel), the placement of routed experts (INT4
// words and scales kept as they are, or bf16 rows), and MoeExperts, which
// permutes the tokens' rows by expert, dequantises the active INT4 experts,
// runs each expert's MLP as cuBLASLt GEMMs and combines the results per token
// in ascending expert id (the CPU reference's order).
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "kernels/cuda/cuda_backend_internal.h"
#include "kernels/cuda/int4_dequant.h"
#include "kernels/cuda/ops.h"
#include "kernels/op_checks.h"

namespace hsx {

class CudaRouting : public Routing {
 public:
  ~CudaRouting() override { FreeAsync(experts, stream); }
  int64_t tokens() const override { return num_tokens; }
  int64_t top_k() const override { return k; }

  cudaStream_t stream = nullptr;
  int32_t* experts = nullptr;  // [tokens, top_k], then the weights in the same block
  float* weights = nullptr;
  int64_t num_tokens = 0;
  int64_t k = 0;
};

// One held expert in device memory: INT4 (packed + scales per projection) or bf16.
struct DeviceExpert {
  bool int4 = false;
  const int32_t* packed[3] = {nullptr, nullptr, nullptr};  // gate, up, down
  const uint16_t* scale[3] = {nullptr, nullptr, nullptr};
  const uint16_t* gate_up = nullptr;  // bf16: [2 * inter, hidden], gate rows then up rows
  const uint16_t* down = nullptr;     // bf16: [hidden, inter]
};

class CudaExpertTable : public ExpertTable {
 public:
  int64_t num_experts() const override { return static_cast<int64_t>(held.size()); }
  bool holds(int64_t expert) const override { return held[expert]; }

  std::vector<bool> held;
  std::vector<DeviceExpert> experts;  // by global id; only held ones are filled
  const uint8_t* held_device = nullptr;
  int64_t hidden = 0;
  int64_t inter = 0;
  int64_t group_size = 0;
};

namespace {

// The shape rule of an expert table: every held expert's gate and up are
// [inter, hidden], its down is [hidden, inter], and all are INT4 (whole
// packed words and groups of the table's group size) or all bf16.
absl::Status CheckExpertShapes(const ExpertWeights& w, const CudaExpertTable& table, const std::string& backend,
                               const std::string& what) {
  const bool int4 = w.gate.kind == LinearWeight::Kind::kInt4;
  const LinearWeight* parts[3] = {&w.gate, &w.up, &w.down};
  for (const LinearWeight* p : parts) {
    const bool is_down = p == &w.down;
    const int64_t out = is_down ? table.hidden : table.inter;
    const int64_t in = is_down ? table.inter : table.hidden;
    if (p->out != out || p->in != in || (p->kind == LinearWeight::Kind::kInt4) != int4 ||
        (int4 && (p->group_size != table.group_size || in % 8 != 0 || in % p->group_size != 0))) {
      return absl::InvalidArgumentError(absl::StrCat(
          backend, " PlaceExperts: ", what, " has a projection of [", p->out, ", ", p->in, "] (",
          p->kind == LinearWeight::Kind::kInt4 ? "INT4" : "bf16", "), expected [", out, ", ", in,
          "] like expert 0 of the table, INT4 with whole packed words and groups or bf16"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ExpertTable>> CudaBackend::PlaceExperts(std::span<const ExpertWeights> host,
                                                                       std::span<const bool> held) {
  if (host.size() != held.size()) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceExperts: one held flag per expert expected"));
  }
  if (static_cast<int64_t>(host.size()) > cuda::kMaxExperts) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " PlaceExperts: ", host.size(), " experts, at most ",
                                                   cuda::kMaxExperts, " supported"));
  }
  auto table = std::make_unique<CudaExpertTable>();
  table->held.assign(held.begin(), held.end());
  table->experts.resize(host.size());
  bool first = true;
  for (size_t e = 0; e < host.size(); ++e) {
    if (!held[e]) continue;
    const ExpertWeights& w = host[e];
    const std::string what = absl::StrCat("expert ", e);
    if (first) {
      table->hidden = w.gate.in;
      table->inter = w.gate.out;
      table->group_size = w.gate.group_size;
      first = false;
    }
    if (absl::Status s = CheckExpertShapes(w, *table, name(), what); !s.ok()) return s;
    DeviceExpert& d = table->experts[e];
    d.int4 = w.gate.kind == LinearWeight::Kind::kInt4;
    const absl::Status placed = d.int4 ? PlaceInt4Expert(w, what, d) : PlaceBf16Expert(w, *table, what, d);
    if (!placed.ok()) return placed;
  }
  std::vector<uint8_t> flags(held.begin(), held.end());
  absl::StatusOr<const void*> flags_device = Upload(flags.data(), flags.size(), "expert flags");
  if (!flags_device.ok()) return flags_device.status();
  table->held_device = static_cast<const uint8_t*>(*flags_device);
  return table;
}

absl::Status CudaBackend::PlaceInt4Expert(const ExpertWeights& w, const std::string& what, DeviceExpert& d) {
  const LinearWeight* parts[3] = {&w.gate, &w.up, &w.down};
  for (int i = 0; i < 3; ++i) {
    const LinearWeight& p = *parts[i];
    absl::StatusOr<const void*> packed = Upload(p.packed, static_cast<size_t>(p.out * p.in / 8) * 4, what.c_str());
    if (!packed.ok()) return packed.status();
    absl::StatusOr<const void*> scale =
        Upload(p.scale, static_cast<size_t>(p.out * (p.in / p.group_size)) * 2, what.c_str());
    if (!scale.ok()) return scale.status();
    d.packed[i] = static_cast<const int32_t*>(*packed);
    d.scale[i] = static_cast<const uint16_t*>(*scale);
  }
  return absl::OkStatus();
}

// bf16 experts: gate and up stacked into one [2 * inter, hidden] weight,
// rows compacted (hidden % 8 == 0 keeps them 16-byte aligned; else the
// GEMM copies).
absl::Status CudaBackend::PlaceBf16Expert(const ExpertWeights& w, const CudaExpertTable& table,
                                          const std::string& what, DeviceExpert& d) {
  const LinearWeight* parts[2] = {&w.gate, &w.up};
  const size_t gu_bytes = static_cast<size_t>(2 * table.inter * table.hidden) * 2;
  absl::StatusOr<void*> gate_up = PlaceBytes(gu_bytes, what.c_str());
  if (!gate_up.ok()) return gate_up.status();
  for (int i = 0; i < 2; ++i) {
    const LinearWeight& p = *parts[i];
    char* dst = static_cast<char*>(*gate_up) + static_cast<size_t>(i * table.inter * table.hidden) * 2;
    if (cudaError_t s = cudaMemcpy2DAsync(dst, static_cast<size_t>(p.in) * 2, p.bf16, static_cast<size_t>(p.ld) * 2,
                                          static_cast<size_t>(p.in) * 2, static_cast<size_t>(p.out),
                                          cudaMemcpyHostToDevice, stream_);
        s != cudaSuccess) {
      return CudaError(s, "PlaceExperts", what);
    }
  }
  absl::StatusOr<void*> down = PlaceBytes(static_cast<size_t>(table.hidden * table.inter) * 2, what.c_str());
  if (!down.ok()) return down.status();
  if (cudaError_t s = cudaMemcpy2DAsync(*down, static_cast<size_t>(w.down.in) * 2, w.down.bf16,
                                        static_cast<size_t>(w.down.ld) * 2, static_cast<size_t>(w.down.in) * 2,
                                        static_cast<size_t>(w.down.out), cudaMemcpyHostToDevice, stream_);
      s != cudaSuccess) {
    return CudaError(s, "PlaceExperts", what);
  }
  d.gate_up = static_cast<const uint16_t*>(*gate_up);
  d.down = static_cast<const uint16_t*>(*down);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<Routing>> CudaBackend::AllocateRouting(int64_t tokens, int64_t top_k) {
  if (tokens < 0 || top_k < 1 || top_k > cuda::kMaxTopK) {
    return absl::InvalidArgumentError(absl::StrCat(name(), " AllocateRouting: ", tokens, " tokens x top ", top_k,
                                                   " (top_k must be in [1, ", cuda::kMaxTopK, "])"));
  }
  absl::StatusOr<Scratch> block = Take(static_cast<size_t>(tokens * top_k) * 8, "AllocateRouting");
  if (!block.ok()) return block.status();
  auto routing = std::make_unique<CudaRouting>();
  routing->stream = stream_;
  routing->num_tokens = tokens;
  routing->k = top_k;
  routing->experts = static_cast<int32_t*>(block->release());  // now owned by the routing
  routing->weights = reinterpret_cast<float*>(routing->experts + tokens * top_k);
  return routing;
}

void CudaBackend::Route(const Matrix& x, const RouterParams& router, Routing& routing_handle) {
  auto& routing = static_cast<CudaRouting&>(routing_handle);
  const int64_t tokens = x.rows;
  const int64_t experts = router.num_experts;
  if (!Check(CheckRoute(x, router, routing, precision()))) return;
  if (!Check(experts >= 1 && experts <= cuda::kMaxExperts && router.top_k >= 1 && router.top_k <= experts &&
                 router.n_group >= 1 && router.n_group <= 64 && experts % router.n_group == 0 &&
                 router.topk_group >= 1 && router.topk_group <= router.n_group,
             "Route", absl::StrCat(experts, " experts, top ", router.top_k, ", ", router.n_group, " groups keeping ",
                                   router.topk_group, " (supported: up to ", cuda::kMaxExperts,
                                   " experts in up to 64 equal groups)"))) {
    return;
  }
  if (tokens == 0) return;
  // Router logits in float32 (HF keeps the gate in float32 in every mode).
  absl::StatusOr<Scratch> logits = Take(static_cast<size_t>(tokens * experts) * 4, "Route");
  if (!logits.ok()) return Record(logits.status());
  const Matrix logit_matrix{logits->get(), ElementType::kF32, tokens, experts, experts};
  Gemm(x, router.weight, experts, x.cols, x.cols, logit_matrix, "Route");
  cuda::RouterArgs args;
  args.bias = router.bias;
  args.num_experts = experts;
  args.top_k = router.top_k;
  args.n_group = router.n_group;
  args.topk_group = router.topk_group;
  args.softmax_scores = router.softmax_scores;
  args.normalize = router.normalize;
  args.scaling = router.scaling;
  Cuda(cuda::LaunchRoute(static_cast<const float*>(logits->get()), tokens, args, routing.experts, routing.weights,
                         stream_),
       "Route", absl::StrCat(tokens, " tokens, ", experts, " experts"));
}

// One MoeExperts call: its operands, the permutation of its rows by expert
// and the scratch it holds. The scratch is freed (in stream order) when the
// call ends, in the reverse order of the members below.
struct CudaBackend::MoeCall {
  MoeCall(const Matrix& x_in, const CudaRouting& routing_in, const CudaExpertTable& table_in,
          const std::string& what_in)
      : x(x_in), routing(routing_in), table(table_in), what(what_in), tokens(x_in.rows), top_k(routing_in.top_k()),
        num_experts(table_in.num_experts()), hidden(x_in.cols), inter(table_in.inter) {}

  const Matrix& x;
  const CudaRouting& routing;
  const CudaExpertTable& table;
  const std::string& what;  // the operands' shapes, for errors
  const int64_t tokens;
  const int64_t top_k;
  const int64_t num_experts;
  const int64_t hidden;
  const int64_t inter;

  std::vector<int32_t> offsets;  // by expert: its first row in the permuted order
  std::vector<int64_t> active;   // held experts with tokens, ascending id
  int64_t rows = 0;              // the permuted rows: one per (token, held expert)
  int32_t* rows_device = nullptr;  // permuted row -> token
  int32_t* slot_row = nullptr;     // (token, slot) -> permuted row, or -1
  Matrix xg;                       // the gathered rows [rows, hidden]
  Matrix y_matrix;                 // the experts' outputs [rows, hidden]
  std::vector<const uint16_t*> gate_up_w, down_w;  // by active expert: bf16 weights

  Scratch counts, index, gathered, gate_up, y, weights, pointers;
};

void CudaBackend::MoeExperts(const Matrix& x, const Routing& routing_handle, const ExpertTable& table_handle,
                             const Matrix& out, bool partial) {
  const auto& routing = static_cast<const CudaRouting&>(routing_handle);
  const auto& table = static_cast<const CudaExpertTable&>(table_handle);
  const int64_t tokens = x.rows;
  const int64_t top_k = routing.top_k();
  const std::string what = absl::StrCat("x ", ShapeOf(x), ", out ", ShapeOf(out), ", routing for ", routing.tokens(),
                                        " tokens", partial ? " (partial: f32)" : "");
  if (!Check(CheckMoeExperts(x, routing, out, partial, precision()))) return;
  if (!Check(table.hidden == 0 || table.hidden == x.cols, "MoeExperts", absl::StrCat(what, ", experts of hidden ",
                                                                                      table.hidden))) {
    return;
  }
  if (tokens == 0) return;
  MoeCall call(x, routing, table, what);
  if (!CountExpertRows(call) || !PermuteRows(call)) return;
  if (call.rows > 0 && (!GatherRows(call) || !DequantizeExperts(call) || !RunExpertMlps(call))) return;
  // 6. Combine per token over its slots (ascending expert id).
  Cuda(cuda::LaunchCombine(Dev(call.y_matrix), call.slot_row, routing.weights, top_k, !partial && bf16(), Dev(out),
                           stream_),
       "MoeExperts", what);
}

// 1. Tokens per held expert, brought to the host: GEMM sizes are host
//    arguments (a device-side grouped GEMM would remove this sync).
bool CudaBackend::CountExpertRows(MoeCall& call) {
  absl::StatusOr<Scratch> counts = Take(static_cast<size_t>(call.num_experts) * 4, "MoeExperts");
  if (!counts.ok()) {
    Record(counts.status());
    return false;
  }
  call.counts = *std::move(counts);
  auto* counts_device = static_cast<int32_t*>(call.counts.get());
  return Cuda(cuda::LaunchExpertCounts(call.routing.experts, call.tokens, call.top_k, call.table.held_device,
                                       call.num_experts, counts_device, stream_),
              "MoeExperts", call.what) &&
         Cuda(cudaMemcpyAsync(host_counts_, counts_device, static_cast<size_t>(call.num_experts) * 4,
                              cudaMemcpyDeviceToHost, stream_),
              "MoeExperts", "expert counts") &&
         Cuda(cudaStreamSynchronize(stream_), "MoeExperts", "waiting for expert counts");
}

// 2. The permutation: rows of each active expert, and each slot's row.
bool CudaBackend::PermuteRows(MoeCall& call) {
  const int64_t num_experts = call.num_experts;
  call.offsets.assign(static_cast<size_t>(num_experts), 0);
  for (int64_t e = 0; e < num_experts; ++e) {
    call.offsets[e] = static_cast<int32_t>(call.rows);
    if (!call.table.held[e] || host_counts_[e] == 0) continue;
    call.active.push_back(e);
    call.rows += host_counts_[e];
  }
  call.y_matrix = Matrix{nullptr, precision(), call.rows, call.hidden, call.hidden};
  const int64_t slots = call.tokens * call.top_k;
  const size_t index_bytes = static_cast<size_t>(num_experts + std::max<int64_t>(call.rows, 1) + slots) * 4;
  absl::StatusOr<Scratch> index = Take(index_bytes, "MoeExperts");
  if (!index.ok()) {
    Record(index.status());
    return false;
  }
  call.index = *std::move(index);
  auto* offsets_device = static_cast<int32_t*>(call.index.get());
  call.rows_device = offsets_device + num_experts;
  call.slot_row = call.rows_device + std::max<int64_t>(call.rows, 1);
  // Every slot starts as -1 ("no row"): ExpertRows writes only the slots whose
  // expert id is in [0, num_experts), so a routing that never got written (a
  // Route that failed, and recorded it, before this op) would otherwise leave
  // pool garbage for Combine to use as a row index of y: an out-of-bounds read
  // that poisons the context and turns one failed batch into a lost device.
  return Cuda(cudaMemsetAsync(call.slot_row, 0xff, static_cast<size_t>(slots) * 4, stream_), "MoeExperts",
              "slot rows") &&
         Cuda(cudaMemcpyAsync(offsets_device, call.offsets.data(), call.offsets.size() * 4, cudaMemcpyHostToDevice,
                              stream_),
              "MoeExperts", "offsets") &&
         Cuda(cuda::LaunchExpertRows(call.routing.experts, call.tokens, call.top_k, call.table.held_device,
                                     num_experts, offsets_device, call.rows_device, call.slot_row, stream_),
              "MoeExperts", call.what);
}

// 3. Gather the rows, expert by expert.
bool CudaBackend::GatherRows(MoeCall& call) {
  const ElementType act = precision();
  absl::StatusOr<Scratch> block =
      Take(static_cast<size_t>(call.rows * call.hidden) * ElementSize(act), "MoeExperts");
  if (!block.ok()) {
    Record(block.status());
    return false;
  }
  call.gathered = *std::move(block);
  call.xg = Matrix{call.gathered.get(), act, call.rows, call.hidden, call.hidden};
  return Cuda(cuda::LaunchGatherRows(Dev(call.x), call.rows_device, Dev(call.xg), stream_), "MoeExperts", call.what);
}

namespace {

// The INT4 projections of the active experts to dequantise in one batched
// launch each: gate and up (two per expert) and down.
struct DequantJobs {
  std::vector<const int32_t*> gu_packed, d_packed;
  std::vector<const uint16_t*> gu_scale, d_scale;
  std::vector<uint16_t*> gu_out, d_out;
};

// Pointer arrays for the batched kernel: gate/up (2 per expert) then down.
std::vector<const void*> DequantPointers(const DequantJobs& jobs) {
  std::vector<const void*> host_pointers;
  for (auto* p : jobs.gu_packed) host_pointers.push_back(p);
  for (auto* p : jobs.gu_scale) host_pointers.push_back(p);
  for (auto* p : jobs.gu_out) host_pointers.push_back(p);
  for (auto* p : jobs.d_packed) host_pointers.push_back(p);
  for (auto* p : jobs.d_scale) host_pointers.push_back(p);
  for (auto* p : jobs.d_out) host_pointers.push_back(p);
  return host_pointers;
}

}  // namespace

// 4. Dequantise the active INT4 experts into bf16 scratch: per expert a
//    [2 * inter, hidden] gate-up weight then a [hidden, inter] down weight.
bool CudaBackend::DequantizeExperts(MoeCall& call) {
  const int64_t inter = call.inter, hidden = call.hidden;
  const int64_t expert_elements = 3 * inter * hidden;
  call.gate_up_w.resize(call.active.size());
  call.down_w.resize(call.active.size());
  DequantJobs jobs;
  int64_t int4_count = 0;
  for (int64_t e : call.active) int4_count += call.table.experts[e].int4 ? 1 : 0;
  if (int4_count > 0) {
    absl::StatusOr<Scratch> w_block = Take(static_cast<size_t>(int4_count * expert_elements) * 2, "MoeExperts");
    if (!w_block.ok()) {
      Record(w_block.status());
      return false;
    }
    call.weights = *std::move(w_block);
  }
  int64_t slot = 0;
  for (size_t a = 0; a < call.active.size(); ++a) {
    const DeviceExpert& d = call.table.experts[call.active[a]];
    if (!d.int4) {
      call.gate_up_w[a] = d.gate_up;
      call.down_w[a] = d.down;
      continue;
    }
    uint16_t* base = static_cast<uint16_t*>(call.weights.get()) + slot++ * expert_elements;
    call.gate_up_w[a] = base;
    call.down_w[a] = base + 2 * inter * hidden;
    for (int i = 0; i < 2; ++i) {
      jobs.gu_packed.push_back(d.packed[i]);
      jobs.gu_scale.push_back(d.scale[i]);
      jobs.gu_out.push_back(base + i * inter * hidden);
    }
    jobs.d_packed.push_back(d.packed[2]);
    jobs.d_scale.push_back(d.scale[2]);
    jobs.d_out.push_back(base + 2 * inter * hidden);
  }
  if (int4_count == 0) return true;
  return LaunchDequantize(call, DequantPointers(jobs), int4_count);
}

bool CudaBackend::LaunchDequantize(MoeCall& call, const std::vector<const void*>& host_pointers,
                                   int64_t int4_count) {
  const int64_t inter = call.inter, hidden = call.hidden;
  absl::StatusOr<Scratch> p_block = Take(host_pointers.size() * sizeof(void*), "MoeExperts");
  if (!p_block.ok()) {
    Record(p_block.status());
    return false;
  }
  call.pointers = *std::move(p_block);
  if (!Cuda(cudaMemcpyAsync(call.pointers.get(), host_pointers.data(), host_pointers.size() * sizeof(void*),
                            cudaMemcpyHostToDevice, stream_),
            "MoeExperts", "dequant pointers")) {
    return false;
  }
  auto* p = static_cast<void**>(call.pointers.get());
  const int64_t gu = 2 * int4_count, dn = int4_count;
  const std::string shapes = absl::StrCat(int4_count, " experts, inter ", inter, ", hidden ", hidden);
  return Cuda(LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p),
                                          reinterpret_cast<const uint16_t* const*>(p + gu),
                                          reinterpret_cast<uint16_t* const*>(p + 2 * gu), gu, inter, hidden,
                                          call.table.group_size, stream_),
              "MoeExperts dequantise gate/up", shapes) &&
         Cuda(LaunchDequantizeInt4Batched(reinterpret_cast<const int32_t* const*>(p + 3 * gu),
                                          reinterpret_cast<const uint16_t* const*>(p + 3 * gu + dn),
                                          reinterpret_cast<uint16_t* const*>(p + 3 * gu + 2 * dn), dn, hidden, inter,
                                          call.table.group_size, stream_),
              "MoeExperts dequantise down", shapes);
}

// 5. Per expert: [gate | up] = x_e · W_guᵀ (each rounded as the CPU's
//    separate GEMMs), then silu(gate) * up in place, then y_e = h_e · W_dᵀ.
bool CudaBackend::RunExpertMlps(MoeCall& call) {
  const ElementType act = precision();
  const size_t element = ElementSize(act);
  const int64_t rows = call.rows, inter = call.inter, hidden = call.hidden;
  absl::StatusOr<Scratch> gu_block = Take(static_cast<size_t>(rows * 2 * inter) * element, "MoeExperts");
  if (!gu_block.ok()) {
    Record(gu_block.status());
    return false;
  }
  call.gate_up = *std::move(gu_block);
  const Matrix gu_matrix{call.gate_up.get(), act, rows, 2 * inter, 2 * inter};
  absl::StatusOr<Scratch> y_block = Take(static_cast<size_t>(rows * hidden) * element, "MoeExperts");
  if (!y_block.ok()) {
    Record(y_block.status());
    return false;
  }
  call.y = *std::move(y_block);
  call.y_matrix.data = call.y.get();
  for (size_t a = 0; a < call.active.size(); ++a) {
    const int64_t e = call.active[a];
    Gemm(call.xg.Rows(call.offsets[e], host_counts_[e]), call.gate_up_w[a], 2 * inter, hidden, hidden,
         gu_matrix.Rows(call.offsets[e], host_counts_[e]), "MoeExperts gate/up");
  }
  const Matrix gate = gu_matrix.Cols(0, inter);
  if (!Cuda(cuda::LaunchSiluMul(Dev(gate), Dev(gu_matrix.Cols(inter, inter)), bf16(), Dev(gate), stream_),
            "MoeExperts", call.what)) {
    return false;
  }
  for (size_t a = 0; a < call.active.size(); ++a) {
    const int64_t e = call.active[a];
    Gemm(gate.Rows(call.offsets[e], host_counts_[e]), call.down_w[a], hidden, inter, inter,
         call.y_matrix.Rows(call.offsets[e], host_counts_[e]), "MoeExperts down");
  }
  return true;
}

void CudaBackend::CopyRoutingToHost(const Routing& routing_handle, int32_t* experts, float* weights) {
  const auto& routing = static_cast<const CudaRouting&>(routing_handle);
  const size_t n = static_cast<size_t>(routing.tokens() * routing.top_k());
  if (n == 0) return;
  Cuda(cudaMemcpyAsync(experts, routing.experts, n * 4, cudaMemcpyDeviceToHost, stream_), "CopyRoutingToHost",
       "experts");
  Cuda(cudaMemcpyAsync(weights, routing.weights, n * 4, cudaMemcpyDeviceToHost, stream_), "CopyRoutingToHost",
       "weights");
}

}  // namespace hsx
