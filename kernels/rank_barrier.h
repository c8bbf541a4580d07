// rank_barrier.h: the host rendezvous of a communicator group's rank threads.
//
// Every rank of a group calls ArriveAndWait(); it returns OK once all have
// arrived, or the abort status once Abort() was called (at once for a later
// caller), until Reset(). This is what keeps a failed rank from leaving the
// others waiting forever in a collective (kernels/communicator.h, Abort).
#ifndef HSX_KERNELS_RANK_BARRIER_H_
#define HSX_KERNELS_RANK_BARRIER_H_

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "absl/status/status.h"

namespace hsx {

class RankBarrier {
 public:
  explicit RankBarrier(int ranks) : ranks_(ranks) {}

  absl::Status ArriveAndWait() {
    std::unique_lock<std::mutex> lock(mutex_);
    if (!aborted_.ok()) return aborted_;
    const int64_t generation = generation_;
    if (++arrived_ == ranks_) {
      arrived_ = 0;
      ++generation_;
      changed_.notify_all();
      return absl::OkStatus();
    }
    changed_.wait(lock, [&] { return generation_ != generation || !aborted_.ok(); });
    return generation_ != generation ? absl::OkStatus() : aborted_;
  }

  void Abort(const absl::Status& why) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_.ok()) aborted_ = why.ok() ? absl::AbortedError("collective aborted") : why;
    changed_.notify_all();
  }

  bool aborted() {
    std::lock_guard<std::mutex> lock(mutex_);
    return !aborted_.ok();
  }

  // Re-arms the barrier; called when no rank is waiting in it.
  void Reset() {
    std::lock_guard<std::mutex> lock(mutex_);
    aborted_ = absl::OkStatus();
    arrived_ = 0;
    ++generation_;
  }

 private:
  const int ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  absl::Status aborted_;
};

}  // namespace hsx

#endif  // HSX_KERNELS_RANK_BARRIER_H_
