// file_util.h: the one read-whole-file helper. A missing or unreadable file is
// NOT_FOUND naming the path; a read that fails midway is DATA_LOSS, never a
// short string.
#ifndef HSX_BASE_FILE_UTIL_H_
#define HSX_BASE_FILE_UTIL_H_

#include <fstream>
#include <sstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace hsx {

inline absl::StatusOr<std::string> ReadFileToString(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return absl::DataLossError(absl::StrCat(path, ": read error"));
  return std::move(text).str();
}

}  // namespace hsx

#endif  // HSX_BASE_FILE_UTIL_H_
