// log.h: one-line, human-readable logs on stderr.
//
// Every line reads "<UTC time> <level> hsx-server: <message>", e.g.
//   2025-01-02T03:04:05.678Z I hsx-server: listening on 127.0.0.1:50051
// Lines are written with a single fwrite under a lock, so concurrent threads
// never interleave within a line. Safe to call from any thread, including
// gRPC reactions and the batcher thread (it never blocks on anything but the
// lock and stderr itself).
#ifndef HSX_SERVER_SERVICE_LOG_H_
#define HSX_SERVER_SERVICE_LOG_H_

#include <string>

#include "absl/strings/str_format.h"

namespace hsx {

enum class LogLevel { kInfo, kWarning, kError };

void LogLine(LogLevel level, const std::string& message);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kError, absl::StrFormat(format, args...));
}

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_LOG_H_
