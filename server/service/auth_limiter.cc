// auth_limiter.cc: the per-address token buckets and the log sampler.
#include "server/service/auth_limiter.h"

#include <algorithm>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"

namespace hsx {

std::string PeerAddress(absl::string_view peer) {
  const bool v4 = absl::StartsWith(peer, "ipv4:");
  if (!v4 && !absl::StartsWith(peer, "ipv6:")) return std::string(peer);
  const size_t colon = peer.rfind(':');
  const absl::string_view port = peer.substr(colon + 1);
  const absl::string_view host = peer.substr(0, colon);
  // An IPv6 host is in brackets, which newer gRPC writes URI-escaped ("ipv6:%5B::1%5D:5123").
  const bool bracketed = absl::EndsWith(host, "]") || absl::EndsWith(host, "%5D");
  const bool numeric_port = !port.empty() && std::all_of(port.begin(), port.end(), absl::ascii_isdigit);
  if (colon <= 4 || !numeric_port || (!v4 && !bracketed)) return std::string(peer);
  return std::string(host);
}

double AuthLimiter::TriesAt(const Bucket& bucket, absl::Time now) const {
  const double earned = std::max(0.0, absl::FDivDuration(now - bucket.updated, limits_.refill));
  return std::min<double>(limits_.burst, bucket.tries + earned);
}

absl::Duration AuthLimiter::Wait(const std::string& address, absl::Time now) {
  auto it = buckets_.find(address);
  if (it == buckets_.end()) return absl::ZeroDuration();
  const double tries = TriesAt(it->second, now);
  if (tries >= limits_.burst) {  // refilled: nothing left to remember
    by_age_.erase(it->second.age);
    buckets_.erase(it);
    return absl::ZeroDuration();
  }
  if (tries >= 1) return absl::ZeroDuration();
  return limits_.refill * (1 - tries);
}

void AuthLimiter::Failed(const std::string& address, absl::Time now) {
  auto [it, inserted] = buckets_.try_emplace(address);
  Bucket& bucket = it->second;
  if (inserted) {
    bucket.tries = limits_.burst;
    by_age_.push_front(address);
    bucket.age = by_age_.begin();
  } else {
    bucket.tries = TriesAt(bucket, now);
    by_age_.splice(by_age_.begin(), by_age_, bucket.age);
  }
  // Concurrent calls may all pass Wait() before any fails: never below zero,
  // so that the address's wait stays at most one refill.
  bucket.tries = std::max(0.0, bucket.tries - 1);
  bucket.updated = now;
  if (buckets_.size() > limits_.max_addresses) {
    buckets_.erase(by_age_.back());
    by_age_.pop_back();
  }
}

bool AuthLogSampler::Sample(const std::string& address, bool rate_limited, absl::Time now) {
  EndIntervalIfOver(now);
  if (!open_) {
    open_ = true;
    start_ = now;
  }
  if (logged_ < limits_.log_total) {
    int& by_address = logged_by_address_[address];  // bounded: at most log_total addresses get here
    if (by_address < limits_.log_per_address) {
      ++by_address;
      ++logged_;
      return true;
    }
  }
  ++left_out_;
  if (rate_limited) ++left_out_limited_;
  last_left_out_ = address;
  return false;
}

std::vector<std::string> AuthLogSampler::TakeSummaries(absl::Time now) {
  EndIntervalIfOver(now);
  return std::exchange(summaries_, {});
}

void AuthLogSampler::EndIntervalIfOver(absl::Time now) {
  if (!open_ || now < start_ + limits_.log_interval) return;
  if (left_out_ > 0) {
    summaries_.push_back(absl::StrFormat(
        "authentication: %d more failed attempts in the %s from %s were not logged (%d of them refused unchecked, "
        "rate-limited; the last from %s); at most %d lines per client address and %d in all are logged per %s, "
        "hsx_auth_failures_total counts every one",
        left_out_, absl::FormatDuration(limits_.log_interval),
        absl::FormatTime("%Y-%m-%dT%H:%M:%E3SZ", start_, absl::UTCTimeZone()),
        left_out_limited_, last_left_out_, limits_.log_per_address, limits_.log_total,
        absl::FormatDuration(limits_.log_interval)));
  }
  open_ = false;
  logged_ = 0;
  logged_by_address_.clear();
  left_out_ = 0;
  left_out_limited_ = 0;
  last_left_out_.clear();
}

}  // namespace hsx
