// auth_limiter.h: how often a client address may fail bearer-token
// authentication, and which of the failures are logged.
//
// A client guessing tokens made ~2,200 checked attempts a second on one
// connection, each logged (1 MB of log in 5 s). Two pieces stop that:
//
//   AuthLimiter     a token bucket per client address (the port dropped, so a
//                   new connection starts no fresh bucket): `burst` failures
//                   at once, then one more per `refill`. While an address has
//                   no try left its calls are refused without checking their
//                   token. Successes spend nothing. At most `max_addresses`
//                   are remembered: the one that failed longest ago is
//                   forgotten first (an address with a full bucket carries no
//                   state anyway).
//   AuthLogSampler  per `log_interval` (from the first failure after a quiet
//                   one): the first `log_per_address` failures of each
//                   address are logged in full, at most `log_total` in all;
//                   the rest are counted, and summed up in one line once the
//                   interval ends.
//
// Both take the time from the caller (unit-tested with a fake clock) and are
// thread-compatible: TokenAuth (auth.h) locks around them.
#ifndef HSX_SERVER_SERVICE_AUTH_LIMITER_H_
#define HSX_SERVER_SERVICE_AUTH_LIMITER_H_

#include <cstdint>
#include <list>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"

namespace hsx {

struct AuthLimits {
  int burst = 20;
  absl::Duration refill = absl::Seconds(1);
  size_t max_addresses = 4096;
  absl::Duration log_interval = absl::Seconds(10);
  int log_per_address = 3;
  int log_total = 20;
};

// The client address of a gRPC peer string, its port dropped:
// "ipv4:10.0.0.1:5123" -> "ipv4:10.0.0.1", "ipv6:[::1]:5123" -> "ipv6:[::1]";
// anything else ("unix:/path") unchanged.
std::string PeerAddress(absl::string_view peer);

class AuthLimiter {
 public:
  explicit AuthLimiter(const AuthLimits& limits) : limits_(limits) {}

  // Zero when a call from `address` may have its token checked at `now`;
  // otherwise how long until it may.
  absl::Duration Wait(const std::string& address, absl::Time now);
  // A call from `address` failed authentication at `now`: spends one try.
  void Failed(const std::string& address, absl::Time now);

  size_t addresses() const { return buckets_.size(); }

 private:
  struct Bucket {
    double tries = 0;
    absl::Time updated;
    std::list<std::string>::iterator age;  // in by_age_
  };
  // The bucket's tries at `now` (refilled since it was last updated).
  double TriesAt(const Bucket& bucket, absl::Time now) const;

  AuthLimits limits_;
  absl::flat_hash_map<std::string, Bucket> buckets_;
  std::list<std::string> by_age_;  // addresses, the latest failure first
};

class AuthLogSampler {
 public:
  explicit AuthLogSampler(const AuthLimits& limits) : limits_(limits) {}

  // Whether this failure (refused unchecked when `rate_limited`) is logged in full.
  bool Sample(const std::string& address, bool rate_limited, absl::Time now);
  // The summary lines of the intervals ended by `now` that left failures out
  // of the log (each returned once).
  std::vector<std::string> TakeSummaries(absl::Time now);

 private:
  void EndIntervalIfOver(absl::Time now);

  AuthLimits limits_;
  bool open_ = false;  // an interval runs (since start_)
  absl::Time start_;
  int logged_ = 0;
  absl::flat_hash_map<std::string, int> logged_by_address_;  // at most log_total entries
  int64_t left_out_ = 0;
  int64_t left_out_limited_ = 0;
  std::string last_left_out_;
  std::vector<std::string> summaries_;
};

}  // namespace hsx

#endif  // HSX_SERVER_SERVICE_AUTH_LIMITER_H_
