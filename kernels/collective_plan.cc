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

namespace {

// Staging block of `peer`'s partial at `owner`: the peers in rank order, the
// owner skipped.
int StagingBlock(int owner, int peer) { return peer < owner ? peer : peer - 1; }

}  // namespace

std::vector<Summand> ReduceSources(int ranks, int owner, bool received) {
  std::vector<Summand> sources;
  for (int r : SummationOrder(ranks)) {
    sources.push_back({r, received && r != owner ? StagingBlock(owner, r) : -1});
  }
  return sources;
}

std::vector<PeerExchange> ReduceScatterExchanges(int64_t elements, int ranks, int rank, int64_t granule) {
  std::vector<PeerExchange> exchanges;
  const SliceRange own = ReduceSlice(elements, ranks, rank, granule);
  for (int peer = 0; peer < ranks; ++peer) {
    if (peer == rank) continue;
    exchanges.push_back({peer, ReduceSlice(elements, ranks, peer, granule), own, StagingBlock(rank, peer)});
  }
  return exchanges;
}

std::vector<PeerExchange> AllGatherExchanges(int64_t elements, int ranks, int rank, int64_t granule) {
  std::vector<PeerExchange> exchanges;
  const SliceRange own = ReduceSlice(elements, ranks, rank, granule);
  for (int peer = 0; peer < ranks; ++peer) {
    if (peer == rank) continue;
    exchanges.push_back({peer, own, ReduceSlice(elements, ranks, peer, granule), -1});
  }
  return exchanges;
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
