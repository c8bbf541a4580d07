// cpu_attention.cc: CpuBackend::Attention, causal multi-head attention of
// each sample with itself (MLA head layout: K_h = [k_nope | k_rope], V_h from
// kv). One task per (sample, head), each on one thread with its own scratch,
// so results do not depend on the thread count. Scores and outputs round
// where the BF16 reference's matmuls and softmax cast (kBf16 mode only).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/bf16.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/cpu_staged_batch.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/row_io.h"
#include "kernels/op_checks.h"

namespace hsx {
namespace {

// The head layout of one Attention call.
struct HeadDims {
  int64_t nope_dim;
  int64_t rope_dim;
  int64_t v_dim;
  int64_t qk_dim;   // nope_dim + rope_dim
  int64_t kv_head;  // one head's columns of kv: nope_dim + v_dim
};

// One task: head h of the sample whose rows are [begin, begin + len).
struct HeadTask {
  int64_t begin;
  int64_t len;
  int64_t h;
};

// Float32 rows with their stride: read-only inputs and a computed output.
struct InputRows {
  const float* data;
  int64_t ld;
};
struct OutputRows {
  float* data;
  int64_t ld;
};

void Grow(std::vector<float>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

// K_h = [k_nope | k_rope] of the task's rows, as HF concatenates them.
void GatherKeys(const Matrix& kv, const Matrix& k_rope, const HeadDims& d, const HeadTask& t,
                std::vector<float>& keys) {
  for (int64_t j = 0; j < t.len; ++j) {
    const float* kv_row = ReadRow(kv, t.begin + j, ThreadRow(0, kv.cols));
    std::memcpy(&keys[j * d.qk_dim], kv_row + t.h * d.kv_head, sizeof(float) * d.nope_dim);
    const float* rope_row = ReadRow(k_rope, t.begin + j, ThreadRow(1, d.rope_dim));
    std::memcpy(&keys[j * d.qk_dim + d.nope_dim], rope_row, sizeof(float) * d.rope_dim);
  }
}

// Columns [col, col + width) of the task's rows of m in float32: in place when
// m is f32, else converted into `copy`.
InputRows ReadColumns(const Matrix& m, const HeadTask& t, int64_t col, int64_t width, std::vector<float>& copy) {
  if (m.type == ElementType::kF32) return {static_cast<const float*>(m.at(t.begin, col)), m.ld};
  Grow(copy, t.len * width);
  for (int64_t j = 0; j < t.len; ++j) {
    const uint16_t* bits = static_cast<const uint16_t*>(m.at(t.begin + j, col));
    for (int64_t c = 0; c < width; ++c) copy[j * width + c] = Bf16ToFloat(bits[c]);
  }
  return {copy.data(), width};
}

// Where columns [col, col + width) of the task's rows of out are computed: in
// place when out is f32, else in `copy` (StoreColumns rounds it into out).
OutputRows OutputColumns(const Matrix& out, const HeadTask& t, int64_t col, int64_t width,
                         std::vector<float>& copy) {
  if (out.type == ElementType::kF32) return {static_cast<float*>(out.at(t.begin, col)), out.ld};
  Grow(copy, t.len * width);
  return {copy.data(), width};
}

void StoreColumns(const Matrix& out, const HeadTask& t, int64_t col, int64_t width, const std::vector<float>& copy) {
  if (out.type == ElementType::kF32) return;
  for (int64_t j = 0; j < t.len; ++j) {
    uint16_t* bits = static_cast<uint16_t*>(out.at(t.begin + j, col));
    for (int64_t c = 0; c < width; ++c) bits[c] = FloatToBf16(copy[j * width + c]);
  }
}

// Scales and softmaxes the score block of query rows [q0, q0 + rows), row
// stride keys_seen, in place: query i keeps keys 0..i, the others become
// exactly 0.
void CausalSoftmax(float* scores, int64_t q0, int64_t rows, int64_t keys_seen, float scale, bool bf16) {
  auto R = [bf16](float value) { return bf16 ? RoundToBf16(value) : value; };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = q0 + r;
    float* row = scores + r * keys_seen;
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
}

// Causal attention in blocks of query rows: block [q0, q0 + rows) needs
// keys [0, q0 + rows) only, which skips most of the masked triangle. A
// row's result does not depend on the blocking: the keys a block sees
// past row i carry probability exactly 0, and fma(0, v, acc) == acc.
void AttendInBlocks(const InputRows& q, const std::vector<float>& keys, const InputRows& v, const HeadDims& d,
                    int64_t len, float scale, bool bf16, std::vector<float>& scores, const OutputRows& o) {
  constexpr int64_t kQueryBlock = 64;
  for (int64_t q0 = 0; q0 < len; q0 += kQueryBlock) {
    const int64_t rows = std::min(kQueryBlock, len - q0);
    const int64_t keys_seen = q0 + rows;
    // scores = Q_h · K_hᵀ (a bf16 matmul output in the reference).
    GemmB key_matrix{GemmB::Kind::kF32, keys.data(), d.qk_dim, nullptr, 0, keys_seen, d.qk_dim};
    Gemm(q.data + q0 * q.ld, q.ld, rows, key_matrix, scores.data(), keys_seen, bf16, nullptr);
    CausalSoftmax(scores.data(), q0, rows, keys_seen, scale, bf16);
    GemmB value_matrix{GemmB::Kind::kF32Transposed, v.data, v.ld, nullptr, 0, d.v_dim, keys_seen};
    Gemm(scores.data(), keys_seen, rows, value_matrix, o.data + q0 * o.ld, o.ld, bf16, nullptr);
  }
}

// One (sample, head) task on the calling thread.
void AttendHead(const Matrix& q, const Matrix& kv, const Matrix& k_rope, const HeadDims& d, const HeadTask& t,
                float scale, bool bf16, const Matrix& out) {
  // Per-thread scratch, grown as needed and reused: a fresh multi-megabyte
  // score matrix per head would cost a page fault per 4 KiB every time.
  thread_local std::vector<float> keys, scores, queries, values, outputs;
  Grow(keys, t.len * d.qk_dim);
  Grow(scores, t.len * t.len);
  GatherKeys(kv, k_rope, d, t, keys);
  // Q_h, V_h and the output in float32: in place when f32, else converted copies.
  const InputRows q_rows = ReadColumns(q, t, t.h * d.qk_dim, d.qk_dim, queries);
  const InputRows v_rows = ReadColumns(kv, t, t.h * d.kv_head + d.nope_dim, d.v_dim, values);
  const OutputRows o_rows = OutputColumns(out, t, t.h * d.v_dim, d.v_dim, outputs);
  AttendInBlocks(q_rows, keys, v_rows, d, t.len, scale, bf16, scores, o_rows);
  StoreColumns(out, t, t.h * d.v_dim, d.v_dim, outputs);
}

}  // namespace

void CpuBackend::Attention(const Matrix& q, const Matrix& kv, const Matrix& k_rope, int64_t heads,
                           int64_t nope_dim, int64_t rope_dim, int64_t v_dim, const StagedBatch& staged,
                           float scale, const Matrix& out) {
  const auto& batch = static_cast<const CpuStagedBatch&>(staged);
  const int64_t samples = batch.num_samples();
  const HeadDims dims{nope_dim, rope_dim, v_dim, nope_dim + rope_dim, nope_dim + v_dim};
  if (!Check(CheckAttention(q, kv, k_rope, heads, nope_dim, rope_dim, v_dim, batch, out))) return;
  const bool bf16 = precision_ == ElementType::kBf16;
  const std::vector<int64_t>& cu_seqlens = batch.cu_seqlens;
  pool_.ParallelFor(samples * heads, [&](int64_t task) {
    const int64_t s = task / heads;
    const HeadTask t{cu_seqlens[s], cu_seqlens[s + 1] - cu_seqlens[s], task % heads};
    AttendHead(q, kv, k_rope, dims, t, scale, bf16, out);
  });
}

}  // namespace hsx
