// sample_states.h: one sample's captured hidden states in float32, the unit
// everything downstream of the engine handles (files, gRPC responses,
// verification). A plain value: hidden_states is [tokens, layers, hidden] in
// ascending capture id, the layout speculators' trainer reads.
#ifndef HSX_FORMAT_SAMPLE_STATES_H_
#define HSX_FORMAT_SAMPLE_STATES_H_

#include <cstdint>
#include <vector>

namespace hsx {

struct SampleStates {
  std::vector<int> capture_ids;
  int64_t tokens = 0;
  int64_t hidden = 0;
  std::vector<float> hidden_states;  // [tokens, capture_ids.size(), hidden]
  std::vector<float> final_norm;     // [tokens, hidden], empty unless requested
};

}  // namespace hsx

#endif  // HSX_FORMAT_SAMPLE_STATES_H_
