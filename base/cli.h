// cli.h: small helpers shared by the command-line tools (error reporting,
// byte sizes, process set-up), so that every tool fails the same way: one
// line on stderr naming the tool and what went wrong, exit status 1.
#ifndef HSX_BASE_CLI_H_
#define HSX_BASE_CLI_H_

#include <cstdint>
#include <cstdio>
#include "absl/strings/string_view.h"

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"

namespace hsx {

inline int ExitWithStatus(absl::string_view tool, const absl::Status& status) {
  if (status.ok()) return 0;
  std::fprintf(stderr, "%.*s: error: %.*s\n", static_cast<int>(tool.size()), tool.data(),
               static_cast<int>(status.message().size()), status.message().data());
  return 1;
}

// "5GB" -> 5e9, "500MB", "64KiB", "1GiB", "1234" (bytes).
inline absl::StatusOr<int64_t> ParseByteSize(absl::string_view text) {
  struct Unit {
    absl::string_view suffix;
    int64_t factor;
  };
  constexpr Unit kUnits[] = {{"GiB", 1LL << 30}, {"MiB", 1LL << 20}, {"KiB", 1LL << 10},
                             {"GB", 1000000000}, {"MB", 1000000},   {"KB", 1000},
                             {"B", 1}};
  int64_t factor = 1;
  absl::string_view number = text;
  for (const Unit& unit : kUnits) {
    if (number.size() > unit.suffix.size() &&
        number.substr(number.size() - unit.suffix.size()) == unit.suffix) {
      number.remove_suffix(unit.suffix.size());
      factor = unit.factor;
      break;
    }
  }
  int64_t value = 0;
  if (!absl::SimpleAtoi(number, &value) || value <= 0 || value > INT64_MAX / factor) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", text, "' is not a positive size (e.g. 500MB, 5GB, 1048576)"));
  }
  return value * factor;
}

// Lets every flag be spelled with dashes (--final-norm) as well as with the
// underscores Abseil requires (--final_norm): rewrites "--a-b[=v]" in place.
inline void AcceptDashedFlags(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    char* arg = argv[i];
    if (arg[0] != '-' || arg[1] != '-') continue;
    if (arg[2] == '\0') break;  // "--": the rest are positional
    for (char* c = arg + 2; *c != '\0' && *c != '='; ++c) {
      if (*c == '-') *c = '_';
    }
  }
}

// Debian builds Abseil without NDEBUG, which leaves absl::Mutex's deadlock
// detection on: every lock taken while another is held (gRPC's own, per
// message) updates a process-wide lock-order graph under a global lock, and a
// cycle in that graph aborts the process. Abseil's release builds skip it;
// the processes that stream (hsx-server, hsx-dump, the Python module) do too.
inline void SkipMutexDeadlockDetection() {
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
}

}  // namespace hsx

#endif  // HSX_BASE_CLI_H_
