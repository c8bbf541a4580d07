#include "client/dump/run_lease.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/dump/dump_dir.h"

namespace hsx {
namespace {

std::string LeaseText() { return absl::StrCat("host=", HostName(), "\npid=", ::getpid(), "\n"); }

// The "host=" line of a lease file, or "" when it cannot be read.
std::string LeaseHost(int fd) {
  char text[512] = {};
  const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
  if (n <= 0) return "";
  const std::string content(text, static_cast<size_t>(n));
  if (!absl::StartsWith(content, "host=")) return "";
  return content.substr(5, content.find('\n') - 5);
}

}  // namespace

absl::StatusOr<std::unique_ptr<RunLease>> RunLease::Acquire(const std::string& dir, const std::string& token) {
  const std::string path = (std::filesystem::path(dir) / absl::StrCat(kPrefix, token)).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return absl::InternalError(absl::StrCat(path, ": cannot create: ", std::strerror(errno)));
  const std::string text = LeaseText();
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 ||
      ::write(fd, text.data(), text.size()) != static_cast<ssize_t>(text.size())) {
    const std::string reason = std::strerror(errno);
    ::close(fd);
    ::unlink(path.c_str());
    return absl::InternalError(absl::StrCat(path, ": cannot lock or write: ", reason));
  }
  return std::unique_ptr<RunLease>(new RunLease(path, fd));
}

RunLease::~RunLease() {
  ::unlink(path_.c_str());  // while still locked: nobody mistakes it for abandoned
  ::close(fd_);
}

int RunLease::RemoveAbandoned(const std::string& dir) {
  const std::string host = HostName();
  // Relative to dir: its files, and those of the nested layout's subdirectories.
  const std::vector<std::string> names = ListDumpFiles(dir);
  std::error_code error;
  int removed = 0;
  for (const std::string& name : names) {
    if (!absl::StartsWith(name, kPrefix)) continue;
    const std::string path = (std::filesystem::path(dir) / name).string();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    // Locked: its run is alive. Another host: its lock may not reach us.
    if (host.empty() || ::flock(fd, LOCK_EX | LOCK_NB) != 0 || LeaseHost(fd) != host) {
      ::close(fd);
      continue;
    }
    const std::string marker = absl::StrCat(".partial.", name.substr(std::strlen(kPrefix)));
    for (const std::string& other : names) {
      if (absl::StrContains(other, marker) &&
          std::filesystem::remove(std::filesystem::path(dir) / other, error)) {
        ++removed;
      }
    }
    if (::unlink(path.c_str()) == 0) ++removed;  // under the lock, so no second cleaner races us
    ::close(fd);
  }
  return removed;
}

}  // namespace hsx
