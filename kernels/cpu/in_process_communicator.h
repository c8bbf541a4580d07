// in_process_communicator.h: collectives between the rank threads of one
// process, on host memory (the CPU backend's stand-in for NCCL).
//
// AllReduceSum follows the plan of kernels/collective_plan.h: every rank
// posts its matrix, rank r sums its slice of everyone's in rank order
// (((r0 + r1) + r2) + ...), and every rank copies the result back: exact
// float32 arithmetic, identical on all ranks, independent of the matrix's size. The CPU backend runs its ops synchronously, so a collective
// called after an op is already ordered after it.
//
// Abort() wakes every rank waiting in a collective (and fails later ones) with
// the given status, so a rank that fails mid-batch never leaves the others
// blocked; Reset() re-arms the group for the next batch.
#ifndef HSX_KERNELS_CPU_IN_PROCESS_COMMUNICATOR_H_
#define HSX_KERNELS_CPU_IN_PROCESS_COMMUNICATOR_H_

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/communicator.h"
#include "kernels/rank_barrier.h"

namespace hsx {

class InProcessGroup : public CommunicatorGroup {
 public:
  explicit InProcessGroup(int size);
  ~InProcessGroup() override;

  int size() const override { return size_; }
  Communicator* rank(int rank) override { return ranks_[rank].get(); }
  void Abort(const absl::Status& why) override;
  absl::Status Reset() override;

 private:
  friend class InProcessCommunicator;
  // Waits until all ranks have arrived (or the group is aborted).
  absl::Status ArriveAndWait() { return barrier_.ArriveAndWait(); }

  const int size_;
  RankBarrier barrier_;
  std::vector<Matrix> posted_;  // each rank's matrix during an all-reduce
  std::vector<float> result_;
  std::vector<std::unique_ptr<Communicator>> ranks_;
};

class InProcessCommunicator : public Communicator {
 public:
  InProcessCommunicator(InProcessGroup* group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_->size(); }
  absl::Status AllReduceSum(const Matrix& data) override;

 private:
  InProcessGroup* group_;
  int rank_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_IN_PROCESS_COMMUNICATOR_H_
