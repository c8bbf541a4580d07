// signal_watcher.h: SIGTERM and SIGINT, handled without signal handlers.
//
// BlockStopSignals() must run first in main(), before any thread exists, so
// every thread inherits the blocked mask and the signals stay pending for
// the watcher. The watcher thread collects them with sigtimedwait and calls
// `on_signal(signal, count)` on that ordinary thread (count: 1 for the first
// stop signal, 2 for the second, ...), where any code may run.
#ifndef HSX_SERVER_SERVICE_SIGNAL_WATCHER_H_
#define HSX_SERVER_SERVICE_SIGNAL_WATCHER_H_

#include <atomic>
#include <functional>
#include <thread>

namespace hsx {

void BlockStopSignals();

class SignalWatcher {
 public:
  explicit SignalWatcher(std::function<void(int signal, int count)> on_signal);
  // Stops watching (within ~100 ms) and joins the thread.
  ~SignalWatcher();
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

 private:
  void Loop();

  std::function<void(int, int)> on_signal_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_SIGNAL_WATCHER_H_
