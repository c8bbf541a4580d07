// staging_ring.cc: see staging_ring.h.
#include "kernels/staging_ring.h"

#include <algorithm>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace hsx {

StagingRing::StagingRing(int64_t capacity, int64_t max_pending)
    : capacity_(std::max<int64_t>(capacity, 1)), max_pending_(std::max<int64_t>(max_pending, 1)) {}

absl::StatusOr<StagingRing::Reservation> StagingRing::Reserve(int64_t bytes) {
  if (bytes < 1 || bytes > capacity_) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging ring: a copy of ", bytes, " bytes does not fit a ring of ", capacity_, " bytes"));
  }
  // A region never straddles the end: when it would, the tail [head_,
  // capacity_) is skipped and the region starts at 0.
  const bool wraps = head_ + bytes > capacity_;
  const int64_t begin = wraps ? 0 : head_;
  const int64_t end = begin + bytes;
  Reservation r;
  r.offset = begin;
  r.ticket = next_ticket_++;
  // Retire, oldest first, every pending copy the region runs into, every one
  // in a skipped tail (those are older than any at the start of the ring),
  // and enough to keep at most max_pending_ pending with this one.
  while (!pending_.empty()) {
    const Pending& oldest = pending_.front();
    const bool overlaps = oldest.begin < end && begin < oldest.end;
    const bool skipped = wraps && oldest.begin >= head_;
    const bool too_many = static_cast<int64_t>(pending_.size()) >= max_pending_;
    if (!overlaps && !skipped && !too_many) break;
    r.wait_for = oldest.ticket;  // ascending: the last one retired is the newest
    pending_.pop_front();
  }
  pending_.push_back({r.ticket, begin, end});
  head_ = end;
  return r;
}

}  // namespace hsx
