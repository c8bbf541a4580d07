// cpu_backend.cc: the reference ops but Attention (cpu_attention.cc). Each
// loop's comment says where the BF16 reference rounds; R() applies that
// rounding in kBf16 mode only. Matrices of either element type are read and
// written through float32 rows (row_io.h): an f32 row is used in place, a
// bf16 row is converted.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "kernels/bf16.h"
#include "kernels/cpu/cpu_staged_batch.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/row_io.h"
#include "kernels/fp8_e4m3.h"
#include "kernels/op_checks.h"

namespace hsx {

// Reuses host blocks across batches: fresh multi-megabyte allocations come
// from mmap and cost a page fault per 4 KiB on every batch otherwise. Holds at
// most the peak of what was in use at once.
class CpuBackend::BlockPool {
 public:
  struct Block {
    std::unique_ptr<char[]> data;
    size_t capacity = 0;
  };

  Block Take(size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity >= bytes && (best == free_.end() || it->capacity < best->capacity)) best = it;
    }
    if (best == free_.end()) return {std::unique_ptr<char[]>(new char[bytes]), bytes};
    Block block = std::move(*best);
    free_.erase(best);
    return block;
  }

  void Give(Block block) {
    std::lock_guard<std::mutex> lock(mutex_);
    free_.push_back(std::move(block));
  }

 private:
  std::mutex mutex_;
  std::vector<Block> free_;
};

namespace {

// Host memory from the pool, left uninitialised (every op writes its whole output).
class PooledBuffer : public Buffer {
 public:
  PooledBuffer(CpuBackend::BlockPool* pool, int64_t rows, int64_t cols, ElementType type)
      : pool_(pool), matrix_{nullptr, type, rows, cols, cols},
        block_(pool->Take(static_cast<size_t>(rows * cols) * ElementSize(type))) {
    matrix_.data = block_.data.get();
  }
  ~PooledBuffer() override { pool_->Give(std::move(block_)); }
  Matrix matrix() const override { return matrix_; }

 private:
  CpuBackend::BlockPool* pool_;
  Matrix matrix_;
  CpuBackend::BlockPool::Block block_;
};

class CpuHostBuffer : public HostBuffer {
 public:
  explicit CpuHostBuffer(size_t bytes) : data_(new char[bytes]), bytes_(bytes) {}
  void* data() const override { return data_.get(); }
  size_t bytes() const override { return bytes_; }

 private:
  std::unique_ptr<char[]> data_;
  size_t bytes_;
};

class CpuExpertTable : public ExpertTable {
 public:
  CpuExpertTable(std::span<const ExpertWeights> experts, std::span<const bool> held)
      : experts_(experts.begin(), experts.end()), held_(held.begin(), held.end()) {}
  int64_t num_experts() const override { return static_cast<int64_t>(experts_.size()); }
  bool holds(int64_t expert) const override { return held_[expert]; }
  const ExpertWeights& expert(int64_t e) const { return experts_[e]; }

 private:
  std::vector<ExpertWeights> experts_;
  std::vector<bool> held_;
};

class CpuRopeTable : public RopeTable {
 public:
  int64_t positions() const override { return half == 0 ? 0 : static_cast<int64_t>(cos.size()) / half; }
  int64_t half_dim() const override { return half; }

  int64_t half = 0;
  std::vector<float> cos;
  std::vector<float> sin;
};

class CpuRouting : public Routing {
 public:
  CpuRouting(int64_t tokens, int64_t top_k)
      : tokens_(tokens), top_k_(top_k), experts(tokens * top_k), weights(tokens * top_k) {}
  int64_t tokens() const override { return tokens_; }
  int64_t top_k() const override { return top_k_; }

  int64_t tokens_;
  int64_t top_k_;
  std::vector<int32_t> experts;  // [tokens, top_k], ascending id per token
  std::vector<float> weights;
};

GemmB ToGemmB(const LinearWeight& w) {
  GemmB b;
  b.n = w.out;
  b.k = w.in;
  if (w.kind == LinearWeight::Kind::kBf16) {
    b.kind = GemmB::Kind::kBf16;
    b.data = w.bf16;
    b.ld = w.ld;
  } else {
    b.kind = GemmB::Kind::kInt4;
    b.data = w.packed;
    b.scale = w.scale;
    b.group_size = w.group_size;
  }
  return b;
}

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// Indices of the `k` largest values (ties: lower index first), ascending index order.
std::vector<int32_t> TopK(const std::vector<float>& values, int64_t k) {
  std::vector<int32_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return values[a] != values[b] ? values[a] > values[b] : a < b;
  });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

// Group-limited selection (DeepSeek-V3 noaux_tc): keep the topk_group groups
// with the largest sum of their two best scores; mask the others.
void MaskGroups(const RouterParams& router, std::vector<float>& choice) {
  if (router.n_group <= 1) return;
  const int64_t per_group = router.num_experts / router.n_group;
  std::vector<float> group_scores(router.n_group);
  for (int64_t g = 0; g < router.n_group; ++g) {
    std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
    std::partial_sort(members.begin(), members.begin() + std::min<int64_t>(2, per_group),
                      members.end(), std::greater<>());
    group_scores[g] = per_group >= 2 ? members[0] + members[1] : members[0];
  }
  const std::vector<int32_t> kept = TopK(group_scores, router.topk_group);
  for (int64_t g = 0; g < router.n_group; ++g) {
    if (std::find(kept.begin(), kept.end(), g) != kept.end()) continue;
    std::fill(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group,
              -std::numeric_limits<float>::infinity());
  }
}

// A float32 view of a whole matrix for the GEMM: the matrix itself when it is
// f32, else a converted copy in a pooled block (converted back by Store()).
class FloatMatrix {
 public:
  FloatMatrix(CpuBackend::BlockPool* blocks, ThreadPool* pool, const Matrix& m, bool load)
      : blocks_(blocks), matrix_(m) {
    if (m.type == ElementType::kF32) {
      data_ = static_cast<float*>(m.data);
      ld_ = m.ld;
      return;
    }
    block_ = blocks->Take(static_cast<size_t>(m.rows * m.cols) * sizeof(float));
    data_ = reinterpret_cast<float*>(block_.data.get());
    ld_ = m.cols;
    if (!load) return;
    pool->ParallelFor(m.rows, [&](int64_t r) {
      const uint16_t* bits = static_cast<const uint16_t*>(m.at(r, 0));
      for (int64_t c = 0; c < m.cols; ++c) data_[r * ld_ + c] = Bf16ToFloat(bits[c]);
    });
  }
  ~FloatMatrix() {
    if (block_.data) blocks_->Give(std::move(block_));
  }
  float* data() const { return data_; }
  int64_t ld() const { return ld_; }
  // Writes the float copy back into the matrix (bf16), if it is a copy.
  void Store(ThreadPool* pool) const {
    if (matrix_.type == ElementType::kF32) return;
    pool->ParallelFor(matrix_.rows, [&](int64_t r) { Commit(matrix_, r, data_ + r * ld_); });
  }

 private:
  CpuBackend::BlockPool* blocks_;
  Matrix matrix_;
  CpuBackend::BlockPool::Block block_;
  float* data_ = nullptr;
  int64_t ld_ = 0;
};

}  // namespace

CpuBackend::CpuBackend(ElementType precision, int threads)
    : precision_(precision), pool_(threads), blocks_(std::make_unique<BlockPool>()) {}

CpuBackend::~CpuBackend() = default;

float CpuBackend::R(float value) const {
  return precision_ == ElementType::kBf16 ? RoundToBf16(value) : value;
}

bool CpuBackend::Check(const absl::Status& status) {
  if (!status.ok() && error_.ok()) error_ = absl::InvalidArgumentError(absl::StrCat("cpu ", status.message()));
  return status.ok();
}

// ---- Memory -----------------------------------------------------------------

absl::StatusOr<std::unique_ptr<Buffer>> CpuBackend::Allocate(int64_t rows, int64_t cols, ElementType type) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat("cpu Allocate: bad shape [", rows, ", ", cols, "]"));
  }
  return std::make_unique<PooledBuffer>(blocks_.get(), rows, cols, type);
}

absl::StatusOr<std::unique_ptr<HostBuffer>> CpuBackend::AllocateHost(size_t bytes) {
  return std::make_unique<CpuHostBuffer>(bytes);
}

void CpuBackend::CopyToHost(const Matrix& src, void* dst) {
  const size_t row_bytes = static_cast<size_t>(src.cols) * ElementSize(src.type);
  for (int64_t r = 0; r < src.rows; ++r) {
    std::memcpy(static_cast<char*>(dst) + r * row_bytes, src.at(r, 0), row_bytes);
  }
}

void CpuBackend::CopyToHostFp8(const Matrix& src, void* dst) {
  const int64_t row_bytes = src.cols + kFp8ScaleBytes;
  for (int64_t r = 0; r < src.rows; ++r) {
    uint8_t* out = static_cast<uint8_t*>(dst) + r * row_bytes;
    if (src.type == ElementType::kBf16) {
      const auto* in = static_cast<const uint16_t*>(src.at(r, 0));
      EncodeFp8RowScalar([in](int64_t i) { return uint32_t{in[i]} << 16; }, src.cols, out);
    } else {
      const auto* in = static_cast<const float*>(src.at(r, 0));
      EncodeFp8RowScalar([in](int64_t i) { return Fp8FloatBits(in[i]); }, src.cols, out);
    }
  }
}

void CpuBackend::CopyFromHost(const void* src, const Matrix& dst) {
  const size_t row_bytes = static_cast<size_t>(dst.cols) * ElementSize(dst.type);
  for (int64_t r = 0; r < dst.rows; ++r) {
    std::memcpy(dst.at(r, 0), static_cast<const char*>(src) + r * row_bytes, row_bytes);
  }
}

absl::Status CpuBackend::Synchronize() {
  absl::Status error = std::move(error_);
  error_ = absl::OkStatus();
  return error;
}

// ---- Placement: zero copy ---------------------------------------------------

absl::StatusOr<LinearWeight> CpuBackend::PlaceLinear(const LinearWeight& host) {
  placed_bytes_ += host.bytes();
  return host;
}

absl::StatusOr<const void*> CpuBackend::PlaceTensor(const void* host, size_t bytes) {
  placed_bytes_ += static_cast<int64_t>(bytes);
  return host;
}

absl::StatusOr<std::unique_ptr<ExpertTable>> CpuBackend::PlaceExperts(std::span<const ExpertWeights> host,
                                                                      std::span<const bool> held) {
  if (host.size() != held.size()) {
    return absl::InvalidArgumentError("cpu PlaceExperts: one held flag per expert expected");
  }
  for (size_t e = 0; e < host.size(); ++e) {
    if (held[e]) placed_bytes_ += host[e].gate.bytes() + host[e].up.bytes() + host[e].down.bytes();
  }
  return std::make_unique<CpuExpertTable>(host, held);
}

// ---- Per batch ----------------------------------------------------------------

absl::StatusOr<std::unique_ptr<StagedBatch>> CpuBackend::Stage(std::span<const int32_t> tokens,
                                                               std::span<const int64_t> cu_seqlens) {
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 ||
      cu_seqlens.back() != static_cast<int64_t>(tokens.size())) {
    return absl::InvalidArgumentError("cpu Stage: cu_seqlens must run from 0 to the token count");
  }
  auto batch = std::make_unique<CpuStagedBatch>();
  batch->token_ids.assign(tokens.begin(), tokens.end());
  batch->cu_seqlens.assign(cu_seqlens.begin(), cu_seqlens.end());
  batch->positions.resize(tokens.size());
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    if (cu_seqlens[s + 1] <= cu_seqlens[s]) {
      return absl::InvalidArgumentError(absl::StrCat("cpu Stage: sample ", s, " is empty"));
    }
    batch->longest_length = std::max(batch->longest_length, cu_seqlens[s + 1] - cu_seqlens[s]);
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) {
      batch->positions[t] = static_cast<int32_t>(t - cu_seqlens[s]);
    }
  }
  return batch;
}

absl::StatusOr<std::unique_ptr<RopeTable>> CpuBackend::PlaceRopeTable(std::span<const float> cos,
                                                                     std::span<const float> sin,
                                                                     int64_t half_dim) {
  if (half_dim <= 0 || cos.size() != sin.size() || cos.size() % half_dim != 0) {
    return absl::InvalidArgumentError("cpu PlaceRopeTable: cos and sin must be [positions, half_dim]");
  }
  auto table = std::make_unique<CpuRopeTable>();
  table->half = half_dim;
  table->cos.assign(cos.begin(), cos.end());
  table->sin.assign(sin.begin(), sin.end());
  return table;
}

absl::StatusOr<std::unique_ptr<Routing>> CpuBackend::AllocateRouting(int64_t tokens, int64_t top_k) {
  return std::make_unique<CpuRouting>(tokens, top_k);
}

// ---- Ops ------------------------------------------------------------------------

void CpuBackend::Embed(const StagedBatch& staged, const uint16_t* table, int64_t vocab_begin,
                       int64_t vocab_rows, const Matrix& out) {
  const auto& batch = static_cast<const CpuStagedBatch&>(staged);
  if (!Check(CheckEmbed(out, batch.tokens()))) return;
  pool_.ParallelFor(out.rows, [&](int64_t t) {
    const int64_t local = batch.token_ids[t] - vocab_begin;
    const bool here = local >= 0 && local < vocab_rows;
    const uint16_t* source = table + local * out.cols;
    if (out.type == ElementType::kBf16) {
      uint16_t* row = static_cast<uint16_t*>(out.at(t, 0));
      if (here) {
        std::memcpy(row, source, sizeof(uint16_t) * out.cols);
      } else {
        std::fill(row, row + out.cols, uint16_t{0});
      }
      return;
    }
    float* row = static_cast<float*>(out.at(t, 0));
    for (int64_t i = 0; i < out.cols; ++i) row[i] = here ? Bf16ToFloat(source[i]) : 0.0f;
  });
}

void CpuBackend::Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) {
  if (!Check(CheckLinear(x, w, y, partial, precision()))) return;
  const FloatMatrix a(blocks_.get(), &pool_, x, /*load=*/true);
  const FloatMatrix c(blocks_.get(), &pool_, y, /*load=*/false);
  Gemm(a.data(), a.ld(), x.rows, ToGemmB(w), c.data(), c.ld(), !partial && precision_ == ElementType::kBf16,
       &pool_);
  c.Store(&pool_);
}

void CpuBackend::Round(const Matrix& partial, const Matrix& out) {
  if (!Check(CheckRound(partial, out, precision()))) return;
  if (out.data == partial.data && out.ld == partial.ld) return;  // f32 in place: nothing rounds
  pool_.ParallelFor(out.rows, [&](int64_t r) {
    const float* in = static_cast<const float*>(partial.at(r, 0));
    float* o = WriteTarget(out, r, ThreadRow(0, out.cols));
    for (int64_t i = 0; i < out.cols; ++i) o[i] = R(in[i]);
    Commit(out, r, o);
  });
}

void CpuBackend::RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) {
  if (!Check(CheckRmsNorm(x, y, precision()))) return;
  pool_.ParallelFor(x.rows, [&](int64_t r) {
    const float* in = ReadRow(x, r, ThreadRow(0, x.cols));
    float* out = WriteTarget(y, r, ThreadRow(1, y.cols));
    // Four double accumulators in a fixed order: deterministic, vectorisable.
    double lanes[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t i = 0;
    for (; i + 4 <= x.cols; i += 4) {
      for (int k = 0; k < 4; ++k) lanes[k] += static_cast<double>(in[i + k]) * in[i + k];
    }
    for (; i < x.cols; ++i) lanes[0] += static_cast<double>(in[i]) * in[i];
    const double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / x.cols) + eps);
    // HF: bf16(x * rsqrt(...)), then bf16(weight * that).
    if (precision_ == ElementType::kBf16) {
      for (int64_t c = 0; c < x.cols; ++c) out[c] = RoundToBf16(Bf16ToFloat(weight[c]) * RoundToBf16(in[c] * inv));
    } else {
      for (int64_t c = 0; c < x.cols; ++c) out[c] = Bf16ToFloat(weight[c]) * (in[c] * inv);
    }
    Commit(y, r, out);
  });
}

void CpuBackend::Add(const Matrix& a, const Matrix& b, const Matrix& out) {
  if (!Check(CheckAdd(a, b, out))) return;
  const bool bf16 = precision_ == ElementType::kBf16;
  pool_.ParallelFor(a.rows, [&](int64_t r) {
    const float* x = ReadRow(a, r, ThreadRow(0, a.cols));
    const float* y = ReadRow(b, r, ThreadRow(1, b.cols));
    float* z = WriteTarget(out, r, ThreadRow(2, out.cols));
    if (bf16) {
      for (int64_t i = 0; i < a.cols; ++i) z[i] = RoundToBf16(x[i] + y[i]);
    } else {
      for (int64_t i = 0; i < a.cols; ++i) z[i] = x[i] + y[i];
    }
    Commit(out, r, z);
  });
}

void CpuBackend::SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) {
  if (!Check(CheckSiluMul(gate, up, out))) return;
  pool_.ParallelFor(gate.rows, [&](int64_t r) {
    const float* g = ReadRow(gate, r, ThreadRow(0, gate.cols));
    const float* u = ReadRow(up, r, ThreadRow(1, up.cols));
    float* o = WriteTarget(out, r, ThreadRow(2, out.cols));
    // HF: bf16(bf16(silu(gate)) * up).
    for (int64_t i = 0; i < gate.cols; ++i) o[i] = R(R(Silu(g[i])) * u[i]);
    Commit(out, r, o);
  });
}

void CpuBackend::Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset,
                      const StagedBatch& staged, const RopeTable& rope) {
  const auto& batch = static_cast<const CpuStagedBatch&>(staged);
  const auto& table = static_cast<const CpuRopeTable&>(rope);
  const int64_t half = table.half;
  if (!Check(CheckRope(x, heads, stride, offset, half, batch, table))) return;
  std::vector<float> rotated(2 * half);
  std::vector<float> row(x.cols);
  for (int64_t r = 0; r < x.rows; ++r) {
    const float* cos = table.cos.data() + batch.positions[r] * half;
    const float* sin = table.sin.data() + batch.positions[r] * half;
    float* values = WriteTarget(x, r, row.data());
    if (values == row.data()) ReadRow(x, r, row.data());
    for (int64_t h = 0; h < heads; ++h) {
      float* v = values + offset + h * stride;
      for (int64_t i = 0; i < half; ++i) {
        const float even = v[2 * i];
        const float odd = v[2 * i + 1];
        // HF: bf16(bf16(x1 * cos) - bf16(x2 * sin)) and bf16(bf16(x2 * cos) + bf16(x1 * sin)).
        rotated[i] = R(R(even * cos[i]) - R(odd * sin[i]));
        rotated[i + half] = R(R(odd * cos[i]) + R(even * sin[i]));
      }
      std::memcpy(v, rotated.data(), sizeof(float) * 2 * half);
    }
    Commit(x, r, values);
  }
}

void CpuBackend::Route(const Matrix& x, const RouterParams& router, Routing& routing_handle) {
  auto& routing = static_cast<CpuRouting&>(routing_handle);
  const int64_t tokens = x.rows;
  const int64_t experts = router.num_experts;
  if (!Check(CheckRoute(x, router, routing, precision()))) return;
  std::vector<float> logits(tokens * experts);
  // Router logits in float32 (HF keeps the gate in float32 in every mode).
  GemmB gate{GemmB::Kind::kBf16, router.weight, x.cols, nullptr, 0, experts, x.cols};
  const FloatMatrix a(blocks_.get(), &pool_, x, /*load=*/true);
  Gemm(a.data(), a.ld(), tokens, gate, logits.data(), experts, /*round_bf16=*/false, &pool_);
  pool_.ParallelFor(tokens, [&](int64_t t) {
    std::vector<float> scores(logits.begin() + t * experts, logits.begin() + (t + 1) * experts);
    if (router.softmax_scores) {
      const float max = *std::max_element(scores.begin(), scores.end());
      float sum = 0.0f;
      for (float& s : scores) sum += (s = std::exp(s - max));
      for (float& s : scores) s /= sum;
    } else {
      for (float& s : scores) s = 1.0f / (1.0f + std::exp(-s));
    }
    std::vector<float> choice = scores;
    if (router.bias != nullptr) {
      for (int64_t e = 0; e < experts; ++e) choice[e] += router.bias[e];
    }
    MaskGroups(router, choice);
    const std::vector<int32_t> chosen = TopK(choice, router.top_k);
    float sum = 0.0f;
    for (int32_t e : chosen) sum += scores[e];
    for (int64_t i = 0; i < router.top_k; ++i) {
      float w = scores[chosen[i]];
      if (router.normalize) w /= (sum + 1e-20f);
      routing.experts[t * router.top_k + i] = chosen[i];
      routing.weights[t * router.top_k + i] = w * router.scaling;
    }
  });
}

void CpuBackend::RunExpert(const Matrix& x, const std::vector<int64_t>& rows, const ExpertWeights& expert,
                           std::vector<float>& y) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t hidden = x.cols;
  const int64_t inter = expert.gate.out;
  const bool bf16 = precision_ == ElementType::kBf16;
  std::vector<float> input(n * hidden), gate(n * inter), up(n * inter);
  for (int64_t i = 0; i < n; ++i) {
    const float* row = ReadRow(x, rows[i], &input[i * hidden]);
    if (row != &input[i * hidden]) std::memcpy(&input[i * hidden], row, sizeof(float) * hidden);
  }
  Gemm(input.data(), hidden, n, ToGemmB(expert.gate), gate.data(), inter, bf16, nullptr);
  Gemm(input.data(), hidden, n, ToGemmB(expert.up), up.data(), inter, bf16, nullptr);
  for (int64_t i = 0; i < n * inter; ++i) gate[i] = R(R(Silu(gate[i])) * up[i]);
  y.resize(n * hidden);
  Gemm(gate.data(), inter, n, ToGemmB(expert.down), y.data(), hidden, bf16, nullptr);
}

void CpuBackend::MoeExperts(const Matrix& x, const Routing& routing_handle, const ExpertTable& table,
                            const Matrix& out, bool partial) {
  const auto& routing = static_cast<const CpuRouting&>(routing_handle);
  const auto& experts = static_cast<const CpuExpertTable&>(table);
  const int64_t tokens = x.rows;
  const int64_t top_k = routing.top_k();
  if (!Check(CheckMoeExperts(x, routing, out, partial, precision()))) return;
  const int64_t num_experts = experts.num_experts();
  // Rows per expert, in ascending token order.
  std::vector<std::vector<int64_t>> rows(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < top_k; ++i) rows[routing.experts[t * top_k + i]].push_back(t);
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (experts.holds(e) && !rows[e].empty()) active.push_back(e);
  }
  std::vector<std::vector<float>> results(num_experts);
  pool_.ParallelFor(static_cast<int64_t>(active.size()), [&](int64_t a) {
    const int64_t e = active[a];
    RunExpert(x, rows[e], experts.expert(e), results[e]);
  });
  // Combine per token in ascending expert id. The reference (transformers 5.x
  // grouped_mm experts) multiplies each bf16 expert output by its float32
  // weight, sums the top-k terms in float32 and rounds once at the end.
  std::vector<size_t> cursor(num_experts, 0);
  std::vector<float> row(out.cols);
  for (int64_t t = 0; t < tokens; ++t) {
    float* acc = WriteTarget(out, t, row.data());
    std::fill(acc, acc + out.cols, 0.0f);
    for (int64_t i = 0; i < top_k; ++i) {  // chosen experts are stored in ascending id
      const int32_t e = routing.experts[t * top_k + i];
      if (!experts.holds(e)) continue;
      const float w = routing.weights[t * top_k + i];
      const float* y = results[e].data() + cursor[e]++ * out.cols;
      for (int64_t c = 0; c < out.cols; ++c) acc[c] += y[c] * w;
    }
    if (!partial) {
      for (int64_t c = 0; c < out.cols; ++c) acc[c] = R(acc[c]);
    }
    Commit(out, t, acc);
  }
}

void CpuBackend::CopyRoutingToHost(const Routing& routing_handle, int32_t* experts, float* weights) {
  const auto& routing = static_cast<const CpuRouting&>(routing_handle);
  std::copy(routing.experts.begin(), routing.experts.end(), experts);
  std::copy(routing.weights.begin(), routing.weights.end(), weights);
}

std::unique_ptr<Backend> MakeCpuBackend(ElementType precision, int threads) {
  return std::make_unique<CpuBackend>(precision, threads);
}

}  // namespace hsx
