// sample_states.h: one sample's captured hidden states, split out of a batch.
//
// This is the unit everything downstream handles (files, gRPC responses,
// verification): hidden_states is [tokens, layers, hidden] in ascending
// capture id, the layout speculators' trainer reads.
#ifndef HSX_SERVER_MODEL_SAMPLE_STATES_H_
#define HSX_SERVER_MODEL_SAMPLE_STATES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "server/model/forward.h"

namespace hsx {

struct SampleStates {
  std::vector<int> capture_ids;
  int64_t tokens = 0;
  int64_t hidden = 0;
  std::vector<float> hidden_states;  // [tokens, capture_ids.size(), hidden]
  std::vector<float> final_norm;     // [tokens, hidden], empty unless requested
};

// Splits a batch's captures per sample by cu_seqlens: sample s gets exactly
// rows [cu[s], cu[s + 1]) of every captured layer, nothing else.
std::vector<SampleStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_SAMPLE_STATES_H_
