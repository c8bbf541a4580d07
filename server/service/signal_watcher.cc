// signal_watcher.cc: sigtimedwait loop.
#include "server/service/signal_watcher.h"

#include <pthread.h>
#include <signal.h>

#include <cerrno>
#include <ctime>

namespace hsx {
namespace {

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);  // a closed terminal or a supervisor's hang-up: drain, do not die mid-stream
  return set;
}

}  // namespace

void BlockStopSignals() {
  const sigset_t set = StopSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

SignalWatcher::SignalWatcher(std::function<void(int, int)> on_signal)
    : on_signal_(std::move(on_signal)), thread_([this] { Loop(); }) {}

SignalWatcher::~SignalWatcher() {
  stop_.store(true);
  thread_.join();
}

void SignalWatcher::Loop() {
  const sigset_t set = StopSignals();
  int count = 0;
  while (!stop_.load()) {
    const timespec timeout = {0, 100 * 1000 * 1000};
    const int signal = sigtimedwait(&set, nullptr, &timeout);
    if (signal < 0) continue;  // EAGAIN (timeout) or EINTR
    on_signal_(signal, ++count);
  }
}

}  // namespace hsx
