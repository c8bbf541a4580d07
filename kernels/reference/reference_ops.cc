// reference_ops.cc: the plain loops. Written from the contract and
// model-spec.md §4, not from the CPU backend's tiled code.
#include "kernels/reference/reference_ops.h"

#include <cmath>
#include <limits>

#include "kernels/bf16.h"

namespace hsx::reference {
namespace {

float R(ElementType precision, float v) { return precision == ElementType::kBf16 ? RoundToBf16(v) : v; }

float Silu(float x) { return x / (1.0f + std::exp(-x)); }

// The dot product of the contract: fma over k ascending, starting from 0.
template <typename A, typename B>
float Dot(int64_t n, A a, B b, SumOrder order = SumOrder::kAscending) {
  float acc = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = order == SumOrder::kAscending ? i : n - 1 - i;
    acc = std::fma(a(k), b(k), acc);
  }
  return acc;
}

// The index of the largest value not yet taken (ties: the lowest index).
int64_t ArgMax(const std::vector<float>& values, const std::vector<bool>& taken) {
  int64_t best = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(values.size()); ++i) {
    if (taken[i]) continue;
    if (best < 0 || values[i] > values[best]) best = i;
  }
  return best;
}

}  // namespace

float WeightAt(const LinearWeight& w, int64_t o, int64_t i) {
  if (w.kind == LinearWeight::Kind::kBf16) return Bf16ToFloat(w.bf16[o * w.ld + i]);
  const uint32_t word = static_cast<uint32_t>(w.packed[o * (w.in / 8) + i / 8]);
  const int q = static_cast<int>((word >> (4 * (i % 8))) & 0xFu) - 8;
  const float scale = Bf16ToFloat(w.scale[o * (w.in / w.group_size) + i / w.group_size]);
  return RoundToBf16(static_cast<float>(q) * scale);
}

void Embed(std::span<const int32_t> tokens, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
           HostMatrix* out) {
  for (int64_t t = 0; t < out->rows; ++t) {
    const int64_t local = tokens[t] - vocab_begin;
    for (int64_t c = 0; c < out->cols; ++c) {
      out->at(t, c) = local >= 0 && local < vocab_rows ? Bf16ToFloat(table[local * out->cols + c]) : 0.0f;
    }
  }
}

void Linear(const HostMatrix& x, const LinearWeight& w, bool round_bf16, HostMatrix* y, SumOrder order) {
  for (int64_t t = 0; t < x.rows; ++t) {
    for (int64_t o = 0; o < w.out; ++o) {
      const float sum = Dot(
          w.in, [&](int64_t k) { return x.at(t, k); }, [&](int64_t k) { return WeightAt(w, o, k); }, order);
      y->at(t, o) = round_bf16 ? RoundToBf16(sum) : sum;
    }
  }
}

void Round(ElementType precision, HostMatrix* x) {
  for (float& v : x->values) v = R(precision, v);
}

void RmsNorm(ElementType precision, const HostMatrix& x, const uint16_t* weight, float eps, HostMatrix* y) {
  for (int64_t t = 0; t < x.rows; ++t) {
    double lanes[4] = {0.0, 0.0, 0.0, 0.0};
    for (int64_t c = 0; c < x.cols; ++c) {
      const int lane = c < x.cols / 4 * 4 ? static_cast<int>(c % 4) : 0;
      lanes[lane] += static_cast<double>(x.at(t, c)) * x.at(t, c);
    }
    const double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    const float inv = 1.0f / std::sqrt(static_cast<float>(sum / x.cols) + eps);
    for (int64_t c = 0; c < x.cols; ++c) {
      // HF: bf16(weight * bf16(x * rsqrt(mean(x²) + eps))).
      y->at(t, c) = R(precision, Bf16ToFloat(weight[c]) * R(precision, x.at(t, c) * inv));
    }
  }
}

void Add(ElementType precision, const HostMatrix& a, const HostMatrix& b, HostMatrix* out) {
  for (size_t i = 0; i < a.values.size(); ++i) out->values[i] = R(precision, a.values[i] + b.values[i]);
}

void SiluMul(ElementType precision, const HostMatrix& gate, const HostMatrix& up, HostMatrix* out) {
  for (size_t i = 0; i < gate.values.size(); ++i) {
    out->values[i] = R(precision, R(precision, Silu(gate.values[i])) * up.values[i]);
  }
}

void Rope(ElementType precision, HostMatrix* x, int64_t heads, int64_t stride, int64_t offset,
          std::span<const int32_t> positions, std::span<const float> cos, std::span<const float> sin,
          int64_t half_dim) {
  std::vector<float> rotated(2 * half_dim);
  for (int64_t t = 0; t < x->rows; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      float* v = &x->at(t, offset + h * stride);
      for (int64_t i = 0; i < half_dim; ++i) {
        const float c = cos[positions[t] * half_dim + i];
        const float s = sin[positions[t] * half_dim + i];
        // Interleaved pairs (x_2i, x_2i+1) rotate; the output is half-split.
        rotated[i] = R(precision, R(precision, v[2 * i] * c) - R(precision, v[2 * i + 1] * s));
        rotated[half_dim + i] = R(precision, R(precision, v[2 * i + 1] * c) + R(precision, v[2 * i] * s));
      }
      for (int64_t i = 0; i < 2 * half_dim; ++i) v[i] = rotated[i];
    }
  }
}

void Attention(ElementType precision, const HostMatrix& q, const HostMatrix& kv, const HostMatrix& k_rope,
               int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
               std::span<const int64_t> cu_seqlens, float scale, HostMatrix* out) {
  const int64_t qk_dim = nope_dim + rope_dim;
  const int64_t kv_head = nope_dim + v_dim;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t begin = cu_seqlens[s];
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = begin; i < cu_seqlens[s + 1]; ++i) {
        // Scores against keys begin..i (causal), as a bf16 matmul output, then scaled.
        std::vector<float> p(i - begin + 1);
        float max = -std::numeric_limits<float>::infinity();
        for (int64_t j = begin; j <= i; ++j) {
          auto key = [&](int64_t d) { return d < nope_dim ? kv.at(j, h * kv_head + d) : k_rope.at(j, d - nope_dim); };
          const float dot = Dot(qk_dim, [&](int64_t d) { return q.at(i, h * qk_dim + d); }, key);
          p[j - begin] = R(precision, R(precision, dot) * scale);
          max = std::max(max, p[j - begin]);
        }
        float sum = 0.0f;
        for (float& v : p) sum += (v = std::exp(v - max));
        for (float& v : p) v = R(precision, v / sum);
        for (int64_t d = 0; d < v_dim; ++d) {
          const float o = Dot(static_cast<int64_t>(p.size()), [&](int64_t j) { return p[j]; },
                              [&](int64_t j) { return kv.at(begin + j, h * kv_head + nope_dim + d); });
          out->at(i, h * v_dim + d) = R(precision, o);
        }
      }
    }
  }
}

void Route(const HostMatrix& x, const RouterParams& router, std::vector<int32_t>* experts,
           std::vector<float>* weights) {
  const int64_t n = router.num_experts;
  const int64_t per_group = n / router.n_group;
  experts->assign(x.rows * router.top_k, 0);
  weights->assign(x.rows * router.top_k, 0.0f);
  for (int64_t t = 0; t < x.rows; ++t) {
    std::vector<float> scores(n);
    for (int64_t e = 0; e < n; ++e) {
      scores[e] = Dot(x.cols, [&](int64_t k) { return x.at(t, k); },
                      [&](int64_t k) { return Bf16ToFloat(router.weight[e * x.cols + k]); });
    }
    if (router.softmax_scores) {
      float max = -std::numeric_limits<float>::infinity();
      for (float s : scores) max = std::max(max, s);
      float sum = 0.0f;
      for (float& s : scores) sum += (s = std::exp(s - max));
      for (float& s : scores) s /= sum;
    } else {
      for (float& s : scores) s = 1.0f / (1.0f + std::exp(-s));
    }
    std::vector<float> choice(n);
    for (int64_t e = 0; e < n; ++e) choice[e] = scores[e] + (router.bias ? router.bias[e] : 0.0f);
    if (router.n_group > 1) {  // keep the topk_group groups with the best two-expert sums
      std::vector<float> group_score(router.n_group);
      for (int64_t g = 0; g < router.n_group; ++g) {
        std::vector<float> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
        std::vector<bool> taken(per_group, false);
        const int64_t first = ArgMax(members, taken);
        taken[first] = true;
        group_score[g] = per_group >= 2 ? members[first] + members[ArgMax(members, taken)] : members[first];
      }
      std::vector<bool> kept(router.n_group, false);
      for (int64_t k = 0; k < router.topk_group; ++k) kept[ArgMax(group_score, kept)] = true;
      for (int64_t e = 0; e < n; ++e) {
        if (!kept[e / per_group]) choice[e] = -std::numeric_limits<float>::infinity();
      }
    }
    std::vector<bool> chosen(n, false);
    for (int64_t k = 0; k < router.top_k; ++k) chosen[ArgMax(choice, chosen)] = true;
    float sum = 0.0f;
    for (int64_t e = 0; e < n; ++e) sum += chosen[e] ? scores[e] : 0.0f;
    int64_t slot = 0;
    for (int64_t e = 0; e < n; ++e) {  // ascending id
      if (!chosen[e]) continue;
      float w = scores[e];
      if (router.normalize) w /= (sum + 1e-20f);
      (*experts)[t * router.top_k + slot] = static_cast<int32_t>(e);
      (*weights)[t * router.top_k + slot] = w * router.scaling;
      ++slot;
    }
  }
}

void MoeExperts(ElementType precision, const HostMatrix& x, std::span<const int32_t> experts,
                std::span<const float> weights, int64_t top_k, std::span<const ExpertWeights> table,
                std::span<const bool> held, bool partial, HostMatrix* out) {
  const bool bf16 = precision == ElementType::kBf16;
  for (int64_t t = 0; t < x.rows; ++t) {
    std::vector<float> acc(x.cols, 0.0f);
    for (int64_t i = 0; i < top_k; ++i) {
      const int32_t e = experts[t * top_k + i];
      if (!held[e]) continue;
      const ExpertWeights& w = table[e];
      std::vector<float> act(w.gate.out);
      for (int64_t j = 0; j < w.gate.out; ++j) {
        auto row = [&](int64_t k) { return x.at(t, k); };
        float g = Dot(x.cols, row, [&](int64_t k) { return WeightAt(w.gate, j, k); });
        float u = Dot(x.cols, row, [&](int64_t k) { return WeightAt(w.up, j, k); });
        if (bf16) {
          g = RoundToBf16(g);
          u = RoundToBf16(u);
        }
        act[j] = R(precision, R(precision, Silu(g)) * u);
      }
      for (int64_t c = 0; c < x.cols; ++c) {
        float y = Dot(w.down.in, [&](int64_t j) { return act[j]; }, [&](int64_t j) { return WeightAt(w.down, c, j); });
        if (bf16) y = RoundToBf16(y);
        acc[c] += y * weights[t * top_k + i];
      }
    }
    for (int64_t c = 0; c < x.cols; ++c) out->at(t, c) = partial ? acc[c] : R(precision, acc[c]);
  }
}

}  // namespace hsx::reference
