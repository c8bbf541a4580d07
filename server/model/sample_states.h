// sample_states.h: a batch's captures split into one SampleStates per sample
// (the value itself lives in format/sample_states.h).
#ifndef HSX_SERVER_MODEL_SAMPLE_STATES_H_
#define HSX_SERVER_MODEL_SAMPLE_STATES_H_

#include <cstdint>
#include <span>
#include <vector>

#include "format/sample_states.h"
#include "server/model/forward.h"

namespace hsx {

// Splits a batch's captures per sample by cu_seqlens: sample s gets exactly
// rows [cu[s], cu[s + 1]) of every captured layer, nothing else.
std::vector<SampleStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens);

}  // namespace hsx

#endif  // HSX_SERVER_MODEL_SAMPLE_STATES_H_
