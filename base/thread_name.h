// thread_name.h: names the calling thread, as `top -H`, `perf` and
// /proc/PID/task/TID/comm show it. The names are how the streaming benchmark
// (bench/stream_cost.py) tells the engine's CPU from the rest of the server's:
// every thread that runs the model is named "hsx-engine...".
#ifndef HSX_BASE_THREAD_NAME_H_
#define HSX_BASE_THREAD_NAME_H_

#include <pthread.h>

#include <string>

namespace hsx {

// Linux keeps 15 characters; longer names are cut there.
inline void NameThisThread(const std::string& name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name.substr(0, 15).c_str());
#else
  (void)name;
#endif
}

}  // namespace hsx

#endif  // HSX_BASE_THREAD_NAME_H_
