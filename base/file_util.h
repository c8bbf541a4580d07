// file_util.h: the one read-whole-file helper, and the one write-all loop.
// A missing or unreadable file is NOT_FOUND naming the path; a read that fails
// midway is DATA_LOSS, never a short string. A write error names the path,
// what failed and errno's text.
#ifndef HSX_BASE_FILE_UTIL_H_
#define HSX_BASE_FILE_UTIL_H_

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace hsx {

inline absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return std::move(text).str();
}

// INTERNAL "PATH: WHAT: strerror(errno)", for a failed system call on `path`.
inline absl::Status ErrnoStatus(const std::string& path, absl::string_view what) {
  return absl::InternalError(absl::StrCat(path, ": ", what, ": ", std::strerror(errno)));
}

// Writes all of `bytes` to `fd` (retrying short writes and EINTR); an error is
// ErrnoStatus(path, what). What was written before an error stays written.
inline absl::Status WriteAll(int fd, absl::string_view bytes, const std::string& path, absl::string_view what) {
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(path, what);
    written += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace hsx

#endif  // HSX_BASE_FILE_UTIL_H_
