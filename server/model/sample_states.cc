// sample_states.cc: the per-sample split, [layers, T_batch, H] -> [T, layers, H].
#include "server/model/sample_states.h"

#include <memory>

#include "server/model/capture_views.h"

namespace hsx {

std::vector<SampleStates> SplitBySample(const Captures& captures, std::span<const int64_t> cu_seqlens) {
  // Views that do not own the captures (the caller does), widened one by one.
  std::shared_ptr<const Captures> unowned(&captures, [](const Captures*) {});
  std::vector<SampleStates> samples;
  for (const SampleView& view : ViewBySample(unowned, cu_seqlens)) samples.push_back(view.ToStates());
  return samples;
}

}  // namespace hsx
