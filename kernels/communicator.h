// communicator.h: the collective operations tensor-parallel ranks use.
//
// One rank thread per GPU (or per CPU shard) calls these in lockstep. The
// forward pass calls AllReduceSum after each row- or column-split block, so
// after it every rank holds the full residual stream (DESIGN.md principle 2).
// Implementations: an in-process one for CPU ranks (fixed reduction order:
// rank 0 + rank 1 + ..., so results are deterministic) and NCCL on CUDA.
#ifndef HSX_KERNELS_COMMUNICATOR_H_
#define HSX_KERNELS_COMMUNICATOR_H_

#include "kernels/backend.h"

namespace hsx {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Every rank passes a matrix of the same shape; on return each holds the
  // element-wise sum over ranks, added in rank order.
  virtual void AllReduceSum(const Matrix& data) = 0;
  // Blocks until every rank has called Barrier.
  virtual void Barrier() = 0;
};

}  // namespace hsx

#endif  // HSX_KERNELS_COMMUNICATOR_H_
