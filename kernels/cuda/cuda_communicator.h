// cuda_communicator.h: the CUDA communicators, meeting the all-reduce rule of
// kernels/communicator.h (each element summed in rank order, the same on
// every rank whatever the matrix's size) with the bytes of a ring all-reduce,
// by the plan of kernels/collective_plan.h: rank r receives every rank's f32
// partial of its own slice, sums them in rank order (LaunchSumInRankOrder,
// ops.h), and the sums are gathered back. Everything is enqueued on the
// ranks' own streams (CudaRankOf), ordered with their ops; the host only
// meets the other ranks at a barrier that Abort() breaks, so a failed rank
// never leaves the others waiting.
//
// Two transports:
//  * Same device (MakeSameDeviceGroup): every rank on one GPU, as the one-GPU
//    device check runs TP 2/4/8. Per all-reduce: each rank records an event
//    after its partial; barrier; the owner of each slice waits for every
//    rank's event, sums the slice from their buffers into its own and copies
//    the sum into every other rank's buffer, all on its own stream, then
//    records a second event; barrier; each rank waits for every other rank's
//    second event before its next op. Every region (rank s's buffer, slice r)
//    is touched only by rank r's stream between the two events, so no copy
//    races another.
//  * NCCL (MakeNcclGroup): one rank per GPU, communicators from
//    ncclCommInitAll in this process, libnccl loaded with dlopen
//    (nccl_api.h). Per all-reduce: a barrier (so that an aborted group fails
//    at once), grouped ncclSend/ncclRecv of the partials into a staging buffer
//    (ReduceScatterExchanges), the rank-order sum, grouped ncclSend/ncclRecv
//    of the sums in place (AllGatherExchanges: the all-gather, with slices of
//    unequal size). Abort() also aborts the NCCL communicators (ncclCommAbort
//    ends kernels waiting for a rank that will not come); Reset() makes new
//    ones. A rank enqueues holding its communicator's lock, and Abort takes
//    each lock before it aborts, so no communicator is freed under a rank
//    still inside it (unless a rank stays inside NCCL for seconds, blocked on
//    a peer: then aborting is the only way out; cuda_communicator.cc). This
//    path needs two GPUs and has not run on them yet (docs/BENCHMARKS.md).
#ifndef HSX_KERNELS_CUDA_CUDA_COMMUNICATOR_H_
#define HSX_KERNELS_CUDA_CUDA_COMMUNICATOR_H_

#include <memory>
#include <span>

#include "absl/status/statusor.h"
#include "kernels/backend.h"
#include "kernels/communicator.h"

namespace hsx {

// backends[r] is rank r's CUDA backend; all on one device, at most
// cuda::kMaxCollectiveRanks of them. InvalidArgument otherwise.
absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeSameDeviceGroup(std::span<Backend* const> backends);

// backends[r] is rank r's CUDA backend, each on its own device (NCCL refuses
// two ranks on one device). FailedPrecondition when NCCL cannot be loaded or
// initialised, naming why.
absl::StatusOr<std::unique_ptr<CommunicatorGroup>> MakeNcclGroup(std::span<Backend* const> backends);

}  // namespace hsx

#endif  // HSX_KERNELS_CUDA_CUDA_COMMUNICATOR_H_
