// thread_pool.cc: workers sleep on a condition variable between loops.
#include "kernels/cpu/thread_pool.h"

#include <algorithm>

#include "base/thread_name.h"

namespace hsx {

ThreadPool::ThreadPool(int threads) {
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  start_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

void ThreadPool::RunShare() {
  for (;;) {
    int64_t begin, end;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (next_ >= count_) return;
      begin = next_;
      end = std::min(count_, next_ + grain_);
      next_ = end;
    }
    for (int64_t i = begin; i < end; ++i) (*job_)(i);
  }
}

void ThreadPool::WorkerLoop() {
  NameThisThread("hsx-engine-cpu");  // the CPU backend's compute
  uint64_t seen = 0;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      ++busy_;
    }
    RunShare();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --busy_;
    }
    done_.notify_all();
  }
}

void ThreadPool::ParallelFor(int64_t count, const std::function<void(int64_t)>& fn) {
  if (count <= 0) return;
  if (workers_.empty() || count == 1) {
    for (int64_t i = 0; i < count; ++i) fn(i);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = &fn;
    count_ = count;
    next_ = 0;
    // Several indices per lock for long loops (row-wise ops over thousands of
    // tokens); one at a time for short ones (GEMM panels), which balance better.
    grain_ = std::max<int64_t>(1, count / (8 * size()));
    ++generation_;
  }
  start_.notify_all();
  RunShare();
  std::unique_lock<std::mutex> lock(mutex_);
  done_.wait(lock, [&] { return busy_ == 0 && next_ >= count_; });
  job_ = nullptr;
}

}  // namespace hsx
