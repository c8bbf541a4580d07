// stall_watchdog.cc: the scan loop.
#include "server/service/stall_watchdog.h"

#include <algorithm>

#include "absl/time/clock.h"

namespace hsx {

StallWatchdog::StallWatchdog(absl::Duration limit) : limit_(limit) {
  if (limit_ > absl::ZeroDuration()) thread_ = std::thread([this] { Loop(); });
}

StallWatchdog::~StallWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void StallWatchdog::Watch(const std::shared_ptr<ExtractReactor>& reactor) {
  if (limit_ <= absl::ZeroDuration()) return;
  std::lock_guard<std::mutex> lock(mutex_);
  watched_.push_back(reactor);
}

void StallWatchdog::Loop() {
  // A quarter of the limit (at most a second): a stall is cut within 1.25 x the limit.
  const absl::Duration period = std::min(absl::Seconds(1), limit_ / 4);
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_.wait_for(lock, absl::ToChronoMilliseconds(period), [&] { return stopping_; })) {
    std::vector<std::shared_ptr<ExtractReactor>> live;
    std::erase_if(watched_, [&](const std::weak_ptr<ExtractReactor>& weak) {
      std::shared_ptr<ExtractReactor> reactor = weak.lock();
      if (reactor == nullptr) return true;
      live.push_back(std::move(reactor));
      return false;
    });
    lock.unlock();
    const absl::Time now = absl::Now();
    for (const auto& reactor : live) reactor->CancelIfStalled(now, limit_);
    live.clear();
    lock.lock();
  }
}

}  // namespace hsx
