// sample_states.cc: the per-sample split, [layers, T_batch, H] -> [T, layers, H].
#include "server/model/sample_states.h"

#include <memory>

#include "server/model/capture_views.h"

namespace hsx {

std::vector<SampleStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens) {
  // Row by row through the batch's row index (cu_seqlens need not be the
  // captures' own: tests split wrongly on purpose), widened to float32.
  std::vector<SampleStates> samples;
  const int64_t hidden = captures.hidden;
  const int64_t n = static_cast<int64_t>(captures.ids.size());
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    SampleStates out;
    out.capture_ids = captures.ids;
    out.tokens = cu_seqlens[s + 1] - cu_seqlens[s];
    out.hidden = hidden;
    out.hidden_states.resize(out.tokens * n * hidden);
    if (captures.has_final_norm) out.final_norm.resize(out.tokens * hidden);
    for (int64_t t = 0; t < out.tokens; ++t) {
      for (int64_t l = 0; l < n; ++l) {
        captures.LayerRow(l, cu_seqlens[s] + t, &out.hidden_states[(t * n + l) * hidden]);
      }
      if (captures.has_final_norm) captures.FinalNormRow(cu_seqlens[s] + t, &out.final_norm[t * hidden]);
    }
    samples.push_back(std::move(out));
  }
  return samples;
}

}  // namespace hsx
