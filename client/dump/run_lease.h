// RunLease: one hsx-dump run's claim on the temporaries it stages in an output
// directory that several writers may share (shards, pods on one volume).
//
// A run writes ".hsx-run.TOKEN" (its host name and PID, for people) and holds
// an exclusive flock(2) on it until the run ends; its staging files are named
// "*.partial.TOKEN*" (in DIR, or in a DIGITS subdirectory: the nested layout). A later run on the same host that can take the lock of
// such a file knows its writer is gone (the kernel drops a dead process's
// locks, kill -9 included) and removes that run's temporaries and lease.
// Leases from other hosts are left alone: a network filesystem need not carry
// flock between hosts, so an unlocked lease there proves nothing.
#ifndef HSX_CLIENT_DUMP_RUN_LEASE_H_
#define HSX_CLIENT_DUMP_RUN_LEASE_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"

namespace hsx {

class RunLease {
 public:
  // Creates and locks DIR/.hsx-run.TOKEN.
  static absl::StatusOr<std::unique_ptr<RunLease>> Acquire(const std::string& dir, const std::string& token);
  ~RunLease();  // removes the lease file, then drops the lock
  RunLease(const RunLease&) = delete;
  RunLease& operator=(const RunLease&) = delete;

  // Removes the temporaries and lease files of this host's runs that ended
  // without cleaning up (their lease is unlocked). Returns how many files it
  // removed. Never touches a lease that is locked or names another host.
  static int RemoveAbandoned(const std::string& dir);

  static constexpr const char kPrefix[] = ".hsx-run.";

 private:
  RunLease(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  std::string path_;
  int fd_;
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_RUN_LEASE_H_
