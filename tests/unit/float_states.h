// float_states.h: a batch's Captures split into float32 states per sample
// by any cu_seqlens (the invariance tests split wrongly on purpose), for the
// tests that compare values; FloatStates and Widen (from SampleTensors) are
// in format/test_values.h.
#ifndef HSX_TESTS_UNIT_FLOAT_STATES_H_
#define HSX_TESTS_UNIT_FLOAT_STATES_H_

#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "format/test_values.h"
#include "server/model/forward.h"

namespace hsx::testing {

// Splits a batch's captures per sample by `cu_seqlens`: sample s gets exactly
// rows [cu[s], cu[s + 1]) of every captured layer, nothing else.
inline std::vector<FloatStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens) {
  std::vector<FloatStates> samples;
  const int64_t hidden = captures.hidden;
  const int64_t n = static_cast<int64_t>(captures.ids.size());
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    FloatStates out;
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

}  // namespace hsx::testing

#endif  // HSX_TESTS_UNIT_FLOAT_STATES_H_
