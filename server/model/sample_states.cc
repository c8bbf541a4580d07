// sample_states.cc: the per-sample split, [layers, T_batch, H] -> [T, layers, H].
#include "server/model/sample_states.h"

#include <cstring>

namespace hsx {

std::vector<SampleStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens) {
  const int64_t layers = static_cast<int64_t>(captures.ids.size());
  const int64_t hidden = captures.hidden;
  std::vector<SampleStates> samples(cu_seqlens.size() - 1);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    SampleStates& sample = samples[s];
    const int64_t begin = cu_seqlens[s];
    sample.capture_ids = captures.ids;
    sample.tokens = cu_seqlens[s + 1] - begin;
    sample.hidden = hidden;
    sample.hidden_states.resize(sample.tokens * layers * hidden);
    for (int64_t t = 0; t < sample.tokens; ++t) {
      for (int64_t l = 0; l < layers; ++l) {
        captures.LayerRow(l, begin + t, &sample.hidden_states[(t * layers + l) * hidden]);
      }
    }
    if (captures.final_norm != nullptr) {
      sample.final_norm.resize(sample.tokens * hidden);
      for (int64_t t = 0; t < sample.tokens; ++t) {
        captures.FinalNormRow(begin + t, &sample.final_norm[t * hidden]);
      }
    }
  }
  return samples;
}

}  // namespace hsx
