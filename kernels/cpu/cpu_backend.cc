// cpu_backend.cc: the reference ops. Each loop's comment says where the BF16
// reference rounds; R() applies that rounding in kBf16 mode only.
#include "kernels/cpu/cpu_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>

#include "kernels/bf16.h"
#include "kernels/cpu/gemm.h"

namespace hsx {
namespace {

}  // namespace

// Reuses host blocks across batches: fresh multi-megabyte allocations come
// from mmap and cost a page fault per 4 KiB on every batch otherwise. Holds at
// most the peak of what was in use at once.
class CpuBackend::BlockPool {
 public:
  struct Block {
    std::unique_ptr<float[]> data;
    size_t capacity = 0;
  };

  Block Take(size_t count) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto best = free_.end();
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->capacity >= count && (best == free_.end() || it->capacity < best->capacity)) best = it;
    }
    if (best == free_.end()) return {std::unique_ptr<float[]>(new float[count]), count};
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
class HostBuffer : public Buffer {
 public:
  HostBuffer(CpuBackend::BlockPool* pool, int64_t rows, int64_t cols)
      : pool_(pool), rows_(rows), cols_(cols), block_(pool->Take(static_cast<size_t>(rows * cols))) {}
  ~HostBuffer() override { pool_->Give(std::move(block_)); }
  Matrix matrix() const override { return {block_.data.get(), rows_, cols_, cols_}; }

 private:
  CpuBackend::BlockPool* pool_;
  int64_t rows_;
  int64_t cols_;
  CpuBackend::BlockPool::Block block_;
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

}  // namespace

CpuBackend::CpuBackend(Precision precision, int threads)
    : precision_(precision), pool_(threads), blocks_(std::make_unique<BlockPool>()) {}

CpuBackend::~CpuBackend() = default;

float CpuBackend::R(float value) const {
  return precision_ == Precision::kBf16 ? RoundToBf16(value) : value;
}

std::unique_ptr<Buffer> CpuBackend::Allocate(int64_t rows, int64_t cols) {
  return std::make_unique<HostBuffer>(blocks_.get(), rows, cols);
}

void CpuBackend::CopyToHost(const Matrix& src, float* dst) {
  for (int64_t r = 0; r < src.rows; ++r) std::memcpy(dst + r * src.cols, src.row(r), sizeof(float) * src.cols);
}

void CpuBackend::Embed(std::span<const int32_t> tokens, const uint16_t* table, int64_t vocab_begin,
                       int64_t vocab_rows, const Matrix& out) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    float* row = out.row(static_cast<int64_t>(t));
    const int64_t local = tokens[t] - vocab_begin;
    if (local < 0 || local >= vocab_rows) {
      std::fill(row, row + out.cols, 0.0f);
      continue;
    }
    const uint16_t* source = table + local * out.cols;
    for (int64_t i = 0; i < out.cols; ++i) row[i] = Bf16ToFloat(source[i]);
  }
}

void CpuBackend::Linear(const Matrix& x, const LinearWeight& w, const Matrix& y, bool partial) {
  Gemm(x.data, x.ld, x.rows, ToGemmB(w), y.data, y.ld, !partial && precision_ == Precision::kBf16,
       &pool_);
}

void CpuBackend::Round(const Matrix& x) {
  if (precision_ != Precision::kBf16) return;
  for (int64_t r = 0; r < x.rows; ++r) {
    for (int64_t i = 0; i < x.cols; ++i) x.row(r)[i] = RoundToBf16(x.row(r)[i]);
  }
}

void CpuBackend::RmsNorm(const Matrix& x, const uint16_t* weight, float eps, const Matrix& y) {
  pool_.ParallelFor(x.rows, [&](int64_t r) {
    const float* in = x.row(r);
    float* out = y.row(r);
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
    if (precision_ == Precision::kBf16) {
      for (int64_t c = 0; c < x.cols; ++c) out[c] = RoundToBf16(Bf16ToFloat(weight[c]) * RoundToBf16(in[c] * inv));
    } else {
      for (int64_t c = 0; c < x.cols; ++c) out[c] = Bf16ToFloat(weight[c]) * (in[c] * inv);
    }
  });
}

void CpuBackend::Add(const Matrix& a, const Matrix& b, const Matrix& out) {
  const bool bf16 = precision_ == Precision::kBf16;
  pool_.ParallelFor(a.rows, [&](int64_t r) {
    const float* x = a.row(r);
    const float* y = b.row(r);
    float* z = out.row(r);
    if (bf16) {
      for (int64_t i = 0; i < a.cols; ++i) z[i] = RoundToBf16(x[i] + y[i]);
    } else {
      for (int64_t i = 0; i < a.cols; ++i) z[i] = x[i] + y[i];
    }
  });
}

void CpuBackend::SiluMul(const Matrix& gate, const Matrix& up, const Matrix& out) {
  pool_.ParallelFor(gate.rows, [&](int64_t r) {
    // HF: bf16(bf16(silu(gate)) * up).
    for (int64_t i = 0; i < gate.cols; ++i) out.row(r)[i] = R(R(Silu(gate.row(r)[i])) * up.row(r)[i]);
  });
}

void CpuBackend::Rope(const Matrix& x, int64_t heads, int64_t stride, int64_t offset,
                      std::span<const int32_t> positions, const RopeTable& table) {
  const int64_t half = table.half_dim;
  std::vector<float> rotated(2 * half);
  for (int64_t r = 0; r < x.rows; ++r) {
    const float* cos = table.cos.data() + positions[r] * half;
    const float* sin = table.sin.data() + positions[r] * half;
    for (int64_t h = 0; h < heads; ++h) {
      float* v = x.row(r) + offset + h * stride;
      for (int64_t i = 0; i < half; ++i) {
        const float even = v[2 * i];
        const float odd = v[2 * i + 1];
        // HF: bf16(bf16(x1 * cos) - bf16(x2 * sin)) and bf16(bf16(x2 * cos) + bf16(x1 * sin)).
        rotated[i] = R(R(even * cos[i]) - R(odd * sin[i]));
        rotated[i + half] = R(R(odd * cos[i]) + R(even * sin[i]));
      }
      std::memcpy(v, rotated.data(), sizeof(float) * 2 * half);
    }
  }
}

void CpuBackend::Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads,
                           int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
                           std::span<const int64_t> cu_seqlens, float scale, const Matrix& out) {
  const int64_t samples = static_cast<int64_t>(cu_seqlens.size()) - 1;
  const int64_t qk_dim = nope_dim + rope_dim;
  const int64_t kv_head = nope_dim + v_dim;
  const bool bf16 = precision_ == Precision::kBf16;
  pool_.ParallelFor(samples * heads, [&](int64_t task) {
    const int64_t s = task / heads;
    const int64_t h = task % heads;
    const int64_t begin = cu_seqlens[s];
    const int64_t len = cu_seqlens[s + 1] - begin;
    // Per-thread scratch, grown as needed and reused: a fresh multi-megabyte
    // score matrix per head would cost a page fault per 4 KiB every time.
    thread_local std::vector<float> keys;
    thread_local std::vector<float> scores;
    if (keys.size() < static_cast<size_t>(len * qk_dim)) keys.resize(static_cast<size_t>(len * qk_dim));
    if (scores.size() < static_cast<size_t>(len * len)) scores.resize(static_cast<size_t>(len * len));
    // K_h = [k_nope | k_rope], as HF concatenates them.
    for (int64_t j = 0; j < len; ++j) {
      std::memcpy(&keys[j * qk_dim], kv.row(begin + j) + h * kv_head, sizeof(float) * nope_dim);
      std::memcpy(&keys[j * qk_dim + nope_dim], k_rope.row(begin + j), sizeof(float) * rope_dim);
    }
    // Causal attention in blocks of query rows: block [q0, q0 + rows) needs
    // keys [0, q0 + rows) only, which skips most of the masked triangle. A
    // row's result does not depend on the blocking: the keys a block sees
    // past row i carry probability exactly 0, and fma(0, v, acc) == acc.
    constexpr int64_t kQueryBlock = 64;
    for (int64_t q0 = 0; q0 < len; q0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, len - q0);
      const int64_t keys_seen = q0 + rows;
      // scores = Q_h · K_hᵀ (a bf16 matmul output in the reference).
      GemmB key_matrix{GemmB::Kind::kF32, keys.data(), qk_dim, nullptr, 0, keys_seen, qk_dim};
      Gemm(q.row(begin + q0) + h * qk_dim, q.ld, rows, key_matrix, scores.data(), keys_seen, bf16, nullptr);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = q0 + r;
        float* row = scores.data() + r * keys_seen;
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = R(row[j] * scale);
          max = std::max(max, row[j]);
        }
        float sum = 0.0f;
        for (int64_t j = 0; j <= i; ++j) {
          row[j] = std::exp(row[j] - max);
          sum += row[j];
        }
        // Softmax in float32, then cast to the activation dtype; masked keys are exactly 0.
        for (int64_t j = 0; j <= i; ++j) row[j] = R(row[j] / sum);
        std::fill(row + i + 1, row + keys_seen, 0.0f);
      }
      GemmB values{GemmB::Kind::kF32Transposed, kv.row(begin) + h * kv_head + nope_dim, kv.ld,
                   nullptr, 0, v_dim, keys_seen};
      Gemm(scores.data(), keys_seen, rows, values, out.row(begin + q0) + h * v_dim, out.ld, bf16, nullptr);
    }
  });
}

void CpuBackend::Route(const Matrix& x, const RouterParams& router, Routing* routing) {
  const int64_t tokens = x.rows;
  const int64_t experts = router.num_experts;
  std::vector<float> logits(tokens * experts);
  // Router logits in float32 (HF keeps the gate in float32 in every mode).
  GemmB gate{GemmB::Kind::kBf16, router.weight, x.cols, nullptr, 0, experts, x.cols};
  Gemm(x.data, x.ld, tokens, gate, logits.data(), experts, /*round_bf16=*/false, &pool_);
  routing->top_k = router.top_k;
  routing->experts.assign(tokens * router.top_k, 0);
  routing->weights.assign(tokens * router.top_k, 0.0f);
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
      routing->experts[t * router.top_k + i] = chosen[i];
      routing->weights[t * router.top_k + i] = w * router.scaling;
    }
  });
}

void CpuBackend::RunExpert(const Matrix& x, const std::vector<int64_t>& rows,
                           const ExpertWeights& expert, std::vector<float>& y) {
  const int64_t n = static_cast<int64_t>(rows.size());
  const int64_t hidden = x.cols;
  const int64_t inter = expert.gate.out;
  const bool bf16 = precision_ == Precision::kBf16;
  std::vector<float> input(n * hidden), gate(n * inter), up(n * inter);
  for (int64_t i = 0; i < n; ++i) std::memcpy(&input[i * hidden], x.row(rows[i]), sizeof(float) * hidden);
  Gemm(input.data(), hidden, n, ToGemmB(expert.gate), gate.data(), inter, bf16, nullptr);
  Gemm(input.data(), hidden, n, ToGemmB(expert.up), up.data(), inter, bf16, nullptr);
  for (int64_t i = 0; i < n * inter; ++i) gate[i] = R(R(Silu(gate[i])) * up[i]);
  y.resize(n * hidden);
  Gemm(gate.data(), inter, n, ToGemmB(expert.down), y.data(), hidden, bf16, nullptr);
}

void CpuBackend::MoeExperts(const Matrix& x, const Routing& routing,
                            std::span<const ExpertWeights* const> experts, const Matrix& out,
                            bool partial) {
  const int64_t tokens = x.rows;
  const int64_t top_k = routing.top_k;
  // Rows per expert, in ascending token order.
  std::vector<std::vector<int64_t>> rows(experts.size());
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < top_k; ++i) rows[routing.experts[t * top_k + i]].push_back(t);
  }
  std::vector<int64_t> active;
  for (size_t e = 0; e < experts.size(); ++e) {
    if (experts[e] != nullptr && !rows[e].empty()) active.push_back(static_cast<int64_t>(e));
  }
  std::vector<std::vector<float>> results(experts.size());
  pool_.ParallelFor(static_cast<int64_t>(active.size()), [&](int64_t a) {
    const int64_t e = active[a];
    RunExpert(x, rows[e], *experts[e], results[e]);
  });
  // Combine per token in ascending expert id. The reference (transformers 5.x
  // grouped_mm experts) multiplies each bf16 expert output by its float32
  // weight, sums the top-k terms in float32 and rounds once at the end.
  std::vector<size_t> cursor(experts.size(), 0);
  for (int64_t t = 0; t < tokens; ++t) {
    float* acc = out.row(t);
    std::fill(acc, acc + out.cols, 0.0f);
    for (int64_t i = 0; i < top_k; ++i) {  // chosen experts are stored in ascending id
      const int32_t e = routing.experts[t * top_k + i];
      if (experts[e] == nullptr) continue;
      const float w = routing.weights[t * top_k + i];
      const float* y = results[e].data() + cursor[e]++ * out.cols;
      for (int64_t c = 0; c < out.cols; ++c) acc[c] += y[c] * w;
    }
    if (!partial) {
      for (int64_t c = 0; c < out.cols; ++c) acc[c] = R(acc[c]);
    }
  }
}

std::unique_ptr<Backend> MakeCpuBackend(Precision precision, int threads) {
  return std::make_unique<CpuBackend>(precision, threads);
}

}  // namespace hsx
