// communicator.h: the collectives tensor-parallel ranks use (contract v2).
//
// One rank thread per device calls these in lockstep, on the same thread that
// drives the rank's backend. A communicator is created for a backend (see
// CommunicatorGroup) and its collectives are enqueued in the order of that
// backend's ops: a collective sees every op enqueued before it, and every op
// enqueued after it sees its result. The forward pass all-reduces after each
// row- or column-split block, so afterwards every rank holds the full residual
// stream and rank 0 can capture it directly (docs/design.md, principle 2).
//
// Summation order (the batch-invariance rule (b) of kernels/backend.h): each
// element is summed over ranks in rank order, ((r0 + r1) + r2) + ..., the same
// on every rank and whatever the matrix's size. Matrices are f32 partials; the
// sum is exact float32 arithmetic and rounding to the activation type is the
// caller's (Backend::Round), so a split block rounds once, as unsplit.
#ifndef HSX_KERNELS_COMMUNICATOR_H_
#define HSX_KERNELS_COMMUNICATOR_H_

#include "absl/status/status.h"
#include "kernels/backend.h"

namespace hsx {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes an f32 matrix of the same shape; afterwards each holds
  // the element-wise sum over ranks. Returns an error (and leaves `data`
  // unspecified) when the group was aborted or the transport failed.
  virtual absl::Status AllReduceSum(const Matrix& data) = 0;
};

// The communicators of one group of ranks (rank r's belongs to backend r).
class CommunicatorGroup {
 public:
  virtual ~CommunicatorGroup() = default;
  virtual int size() const = 0;
  virtual Communicator* rank(int rank) = 0;
  // Makes every collective of the group that is waiting, or that starts later,
  // return `why` at once, until Reset(). The engine calls it when one rank
  // fails mid-batch, so that no other rank waits forever for it.
  virtual void Abort(const absl::Status& why) = 0;
  // Re-arms the group after an abort; called when no rank is in a collective.
  virtual absl::Status Reset() = 0;
};

}  // namespace hsx

#endif  // HSX_KERNELS_COMMUNICATOR_H_
