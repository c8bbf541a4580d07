// thread_pool.h: a fixed pool of worker threads for data-parallel loops.
//
// ParallelFor hands out indices dynamically, so which thread runs an index
// varies, but every kernel built on it computes each output element entirely
// inside one index, in a fixed order: results never depend on the thread count
// or on scheduling.
#ifndef HSX_KERNELS_CPU_THREAD_POOL_H_
#define HSX_KERNELS_CPU_THREAD_POOL_H_

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace hsx {

class ThreadPool {
 public:
  // threads <= 0: one per hardware thread. The calling thread also works.
  explicit ThreadPool(int threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return static_cast<int>(workers_.size()) + 1; }

  // Calls fn(i) for every i in [0, count), in parallel; returns when all are done.
  // Not reentrant: fn must not call ParallelFor on the same pool.
  void ParallelFor(int64_t count, const std::function<void(int64_t)>& fn);

 private:
  void WorkerLoop();
  void RunShare();

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_;
  std::condition_variable done_;
  const std::function<void(int64_t)>* job_ = nullptr;
  int64_t count_ = 0;
  int64_t next_ = 0;
  int64_t grain_ = 1;
  int busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace hsx

#endif  // HSX_KERNELS_CPU_THREAD_POOL_H_
