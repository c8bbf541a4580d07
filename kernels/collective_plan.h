// collective_plan.h: how an all-reduce is divided among ranks so that it meets
// the contract's summation rule (kernels/communicator.h) with the bytes of a
// ring all-reduce.
//
// A matrix of `elements` f32 values is cut into one contiguous slice per rank
// (ReduceSlice: as even as possible, in whole granules so that device copies
// stay aligned). Reduce-scatter: rank r receives every rank's partial of its
// own slice and sums them in rank order, p0 + p1 + ... + p(n-1), starting from
// p0 itself. All-gather: every rank copies each finished slice from its owner.
// Each rank sends and receives (n - 1) / n of the matrix twice, as a ring does,
// but an element's sum never depends on where the slice boundaries fall, so
// it is the same on every rank and for every matrix size. This file is plain
// index arithmetic, shared by every transport (in-process, same-device, NCCL)
// and tested on the CPU.
#ifndef HSX_KERNELS_COLLECTIVE_PLAN_H_
#define HSX_KERNELS_COLLECTIVE_PLAN_H_

#include <cstdint>
#include <span>
#include <vector>

namespace hsx {

// Elements per granule: 64 f32 values = 256 bytes.
inline constexpr int64_t kCollectiveGranule = 64;

struct SliceRange {
  int64_t begin = 0;
  int64_t end = 0;  // exclusive
  int64_t size() const { return end - begin; }
};

// The slice rank `rank` of `ranks` reduces. Slices partition [0, elements) in
// rank order; each starts at a multiple of `granule`; their sizes differ by at
// most one granule (the last may be shorter, and some may be empty when there
// are fewer granules than ranks).
SliceRange ReduceSlice(int64_t elements, int ranks, int rank, int64_t granule = kCollectiveGranule);

// The order in which the owner of a slice adds the ranks' partials: 0, 1, ...,
// ranks - 1, whoever the owner is (its own partial at its own place).
std::vector<int> SummationOrder(int ranks);

// Where the owner of a slice reads each summand from, in summation order:
// rank `rank`'s partial, either straight from that rank's matrix (staging < 0:
// the owner's own partial, and every partial on the same-device transport,
// where ranks read each other's memory) or, for a transport that receives
// partials (NCCL), from block `staging` of the owner's staging buffer, which
// holds ranks - 1 blocks of the owner's slice size.
struct Summand {
  int rank = 0;
  int staging = -1;
};
std::vector<Summand> ReduceSources(int ranks, int owner, bool received);

// One rank's exchange with one peer in a send/receive transport (NCCL). In
// the reduce-scatter it sends the peer its partial of the peer's slice and
// receives the peer's partial of its own slice into staging block
// `staging` (offset staging * own slice size); in the all-gather it sends its
// reduced slice and receives the peer's reduced slice in place.
struct PeerExchange {
  int peer = 0;
  SliceRange send;     // elements of this rank's matrix sent
  SliceRange receive;  // reduce-scatter: a count only (into staging); all-gather: where in the matrix
  int staging = -1;    // reduce-scatter only
};
std::vector<PeerExchange> ReduceScatterExchanges(int64_t elements, int ranks, int rank,
                                                 int64_t granule = kCollectiveGranule);
std::vector<PeerExchange> AllGatherExchanges(int64_t elements, int ranks, int rank,
                                             int64_t granule = kCollectiveGranule);

// The whole plan run on host memory: every rank's partials[r] (all the same
// size) replaced by the sum, slice by slice, exactly as a transport would do
// it. Used by the in-process communicator, and by tests as the model of the
// device transports.
void AllReduceByPlan(std::span<float* const> partials, int64_t elements, int64_t granule = kCollectiveGranule);

}  // namespace hsx

#endif  // HSX_KERNELS_COLLECTIVE_PLAN_H_
