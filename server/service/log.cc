// log.cc: the stderr line writer.
#include "server/service/log.h"

#include <cstdio>
#include <mutex>

#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace hsx {

void LogLine(LogLevel level, const std::string& message) {
  static std::mutex mutex;
  const char tag = level == LogLevel::kInfo ? 'I' : level == LogLevel::kWarning ? 'W' : 'E';
  const std::string line =
      absl::StrFormat("%s %c hsx-server: %s\n",
                      absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", absl::Now(), absl::UTCTimeZone()), tag,
                      message);
  std::lock_guard<std::mutex> lock(mutex);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

}  // namespace hsx
