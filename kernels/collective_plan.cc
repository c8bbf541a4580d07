// collective_plan.cc: the slice arithmetic and its host execution.
#include "kernels/collective_plan.h"

#include <algorithm>
#include <cstring>

namespace hsx {

SliceRange ReduceSlice(int64_t elements, int ranks, int rank, int64_t granule) {
  const int64_t granules = (elements + granule - 1) / granule;
  const int64_t first = granules * rank / ranks;
  const int64_t last = granules * (rank + 1) / ranks;
  return {std::min(elements, first * granule), std::min(elements, last * granule)};
}

std::vector<int> SummationOrder(int ranks) {
  std::vector<int> order(ranks);
  for (int r = 0; r < ranks; ++r) order[r] = r;
  return order;
}

void AllReduceByPlan(std::span<float* const> partials, int64_t elements, int64_t granule) {
  const int ranks = static_cast<int>(partials.size());
  if (ranks <= 1) return;
  std::vector<float> sum;
  for (int owner = 0; owner < ranks; ++owner) {
    const SliceRange slice = ReduceSlice(elements, ranks, owner, granule);
    if (slice.size() == 0) continue;
    // Reduce-scatter: the owner sums everyone's partial of its slice in rank order.
    const std::vector<int> order = SummationOrder(ranks);
    sum.assign(partials[order[0]] + slice.begin, partials[order[0]] + slice.end);
    for (size_t k = 1; k < order.size(); ++k) {
      const float* in = partials[order[k]] + slice.begin;
      for (int64_t i = 0; i < slice.size(); ++i) sum[i] += in[i];
    }
    // All-gather: every rank takes the owner's result.
    for (int r = 0; r < ranks; ++r) std::memcpy(partials[r] + slice.begin, sum.data(), sizeof(float) * slice.size());
  }
}

}  // namespace hsx
