// stall_watchdog.h: cancels Extract streams whose client stopped reading.
//
// A client may keep its HTTP/2 connection alive yet never open its
// flow-control window: the stream's write never completes, and it would hold
// its concurrency slot and its states forever while other clients are turned
// away. The watchdog looks at every live stream once per period and cancels
// those whose write in flight is older than the limit (--stream-stall-timeout);
// the stream then ends with CANCELLED and a log line that says why.
#ifndef HSX_SERVER_SERVICE_STALL_WATCHDOG_H_
#define HSX_SERVER_SERVICE_STALL_WATCHDOG_H_

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "absl/time/time.h"
#include "server/service/extract_reactor.h"

namespace hsx {

class StallWatchdog {
 public:
  // `limit` <= 0: watch nothing (no thread).
  explicit StallWatchdog(absl::Duration limit);
  ~StallWatchdog();

  void Watch(const std::shared_ptr<ExtractReactor>& reactor);

 private:
  void Loop();

  const absl::Duration limit_;
  std::mutex mutex_;
  std::condition_variable stop_;
  bool stopping_ = false;
  std::vector<std::weak_ptr<ExtractReactor>> watched_;
  std::thread thread_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_STALL_WATCHDOG_H_
