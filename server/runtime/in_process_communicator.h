// in_process_communicator.h: collectives between rank threads of one process.
//
// The CPU stand-in for NCCL, with the same semantics: AllReduceSum leaves the
// element-wise sum over ranks in every rank's matrix. The sum is taken in rank
// order (((r0 + r1) + r2) + ...) for every element, so the result is
// deterministic and identical on all ranks. The sum is exact float32
// arithmetic; rounding to the activation dtype is the caller's (Model::AllReduce).
#ifndef HSX_SERVER_RUNTIME_IN_PROCESS_COMMUNICATOR_H_
#define HSX_SERVER_RUNTIME_IN_PROCESS_COMMUNICATOR_H_

#include <barrier>
#include <memory>
#include <vector>

#include "kernels/communicator.h"

namespace hsx {

// State shared by the ranks of one group.
class InProcessGroup {
 public:
  explicit InProcessGroup(int size);
  int size() const { return size_; }
  // The communicator of rank `rank` (owned by the group).
  Communicator* rank(int rank) const { return ranks_[rank].get(); }

 private:
  friend class InProcessCommunicator;
  int size_;
  std::barrier<> barrier_;
  std::vector<Matrix> posted_;  // each rank's matrix during an all-reduce
  std::vector<float> result_;
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  void AllReduceSum(const Matrix& data) override;
  void Barrier() override { group_->barrier_.arrive_and_wait(); }

 private:
  InProcessGroup* group_;
  int rank_;
};

}  // namespace hsx

#endif  // HSX_SERVER_RUNTIME_IN_PROCESS_COMMUNICATOR_H_
