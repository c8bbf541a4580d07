// reference_ops.h: a plain-loop reference for every backend op, on host
// float32 matrices (llm.c style: each op as the simplest loops that state its
// arithmetic, nothing tiled, nothing parallel).
//
// These are the oracle of the conformance suite (tests/conformance/): a
// backend's op is compared with the function of the same name here, bitwise
// where kernels/backend.h promises it, otherwise within a stated tolerance.
// Values are float32; in ElementType::kBf16 inputs hold bf16-exact values and
// every function rounds where the contract (and the HF BF16 reference) rounds.
// Sums run in the order the contract fixes: a dot product as fma over k
// ascending from 0; RMSNorm's sum of squares in double over four interleaved
// lanes, ((l0 + l1) + (l2 + l3)); a softmax's sum over keys ascending; the MoE
// combine over a token's experts in ascending id. `SumOrder::kDescending`
// exists only to show that the suite notices a different order.
#ifndef HSX_KERNELS_REFERENCE_REFERENCE_OPS_H_
#define HSX_KERNELS_REFERENCE_REFERENCE_OPS_H_

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"

namespace hsx::reference {

// A row-major float32 matrix in host memory.
struct HostMatrix {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<float> values;

  HostMatrix() = default;
  HostMatrix(int64_t r, int64_t c) : rows(r), cols(c), values(static_cast<size_t>(r * c), 0.0f) {}
  float& at(int64_t r, int64_t c) { return values[r * cols + c]; }
  float at(int64_t r, int64_t c) const { return values[r * cols + c]; }
};

enum class SumOrder { kAscending, kDescending };

// W[o][i] of a host weight view, as float (INT4 dequantized to bf16 first).
float WeightAt(const LinearWeight& w, int64_t o, int64_t i);

void Embed(std::span<const int32_t> tokens, const uint16_t* table, int64_t vocab_begin, int64_t vocab_rows,
           HostMatrix* out);
// y = x · Wᵀ, rounded to bf16 when `round_bf16` (a non-partial output in kBf16).
void Linear(const HostMatrix& x, const LinearWeight& w, bool round_bf16, HostMatrix* y,
            SumOrder order = SumOrder::kAscending);
void Round(ElementType precision, HostMatrix* x);
void RmsNorm(ElementType precision, const HostMatrix& x, const uint16_t* weight, float eps, HostMatrix* y);
void Add(ElementType precision, const HostMatrix& a, const HostMatrix& b, HostMatrix* out);
void SiluMul(ElementType precision, const HostMatrix& gate, const HostMatrix& up, HostMatrix* out);
// cos/sin: [positions, half_dim]; positions[t] is row t's position.
void Rope(ElementType precision, HostMatrix* x, int64_t heads, int64_t stride, int64_t offset,
          std::span<const int32_t> positions, std::span<const float> cos, std::span<const float> sin,
          int64_t half_dim);
void Attention(ElementType precision, const HostMatrix& q, const HostMatrix& kv, const HostMatrix& k_rope,
               int64_t heads, int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
               std::span<const int64_t> cu_seqlens, float scale, HostMatrix* out);
// Router params with host pointers; experts/weights: [tokens, top_k], ascending id per token.
void Route(const HostMatrix& x, const RouterParams& router, std::vector<int32_t>* experts,
           std::vector<float>* weights);
// The routed experts' sum for each token over the experts with held[e].
void MoeExperts(ElementType precision, const HostMatrix& x, std::span<const int32_t> experts,
                std::span<const float> weights, int64_t top_k, std::span<const ExpertWeights> table,
                std::span<const bool> held, bool partial, HostMatrix* out);

}  // namespace hsx::reference

#endif  // HSX_KERNELS_REFERENCE_REFERENCE_OPS_H_
