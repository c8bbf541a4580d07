// log.h: one-line, human-readable logs on stderr.
//
// Every line reads "<UTC time> <level> hsx-server: <message>", e.g.
//   2025-01-02T03:04:05.678Z I hsx-server: listening on 127.0.0.1:50051
// Lines are written with a single fwrite under a lock, so concurrent threads
// never interleave within a line. Every message is escaped (EscapeForLog)
// before it is written, so text a client controls (a sample id, a peer name
// inside an error) can never start a line of its own, move the cursor or
// colour the terminal. Safe to call from any thread, including
// gRPC reactions and the batcher thread (it never blocks on anything but the
// lock and stderr itself).
#ifndef HSX_SERVER_SERVICE_LOG_H_
#define HSX_SERVER_SERVICE_LOG_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace hsx {

enum class LogLevel { kInfo, kWarning, kError };

// `text` with control characters (bytes < 0x20 and 0x7f) and bytes that are
// not valid UTF-8 written as \xNN, and a backslash as \\; cut to at most
// `max_bytes` of input at a UTF-8 character boundary, with "..." appended when
// cut.
std::string EscapeForLog(absl::string_view text, size_t max_bytes = 4096);
// The first at most `max_bytes` bytes of `text`, cut at a UTF-8 character
// boundary, with "..." appended when cut (no escaping: LogLine does that).
std::string TruncateForLog(absl::string_view text, size_t max_bytes);

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
