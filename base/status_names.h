// status_names.h: how a status code is spelt ("UNAVAILABLE"), the one table
// for gRPC and absl codes (the same numbers, 0..16): metrics labels, the
// server's request log and hsx-dump's messages all use it.
#ifndef HSX_BASE_STATUS_NAMES_H_
#define HSX_BASE_STATUS_NAMES_H_

#include <iterator>
#include <string>

#include "absl/strings/str_cat.h"

namespace hsx {

inline std::string StatusCodeName(int code) {
  static const char* const kNames[] = {
      "OK",        "CANCELLED",         "UNKNOWN",          "INVALID_ARGUMENT", "DEADLINE_EXCEEDED",
      "NOT_FOUND", "ALREADY_EXISTS",    "PERMISSION_DENIED", "RESOURCE_EXHAUSTED",
      "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",     "UNIMPLEMENTED",    "INTERNAL",
      "UNAVAILABLE", "DATA_LOSS",       "UNAUTHENTICATED"};
  if (code >= 0 && code < static_cast<int>(std::size(kNames))) return kNames[code];
  return absl::StrCat("code ", code);
}

}  // namespace hsx

#endif  // HSX_BASE_STATUS_NAMES_H_
