// staging_ring.h: the bookkeeping of a device backend's capture staging ring:
// which bytes of the ring a copy may use next, and which earlier copy must
// have finished before those bytes may be written again.
//
// The CUDA backend (kernels/cuda/capture_staging.cc) snapshots captured rows into
// a device ring on its compute stream and copies them to pinned host memory on
// a second stream, so the copy overlaps the layers that follow. Each snapshot
// reserves a region here and gets a ticket (0, 1, 2, ...); the copy stream
// marks the ticket done when its device-to-host copy has finished. Copies run
// in ticket order on one stream, so "ticket t is done" means every earlier
// ticket is done too. Before writing a reserved region, the compute stream
// waits for `wait_for`: the newest ticket whose region overlaps it (or is
// skipped when the ring wraps, or must be retired to stay within max_pending).
//
// Guarantees, for every sequence of Reserve/Clear calls:
//  * a region lies inside [0, capacity) and holds `bytes` contiguous bytes;
//  * no byte of it belongs to a ticket newer than wait_for that is still
//    pending (so waiting for wait_for makes the whole region free);
//  * at most max_pending tickets are pending, so a backend can keep one event
//    per ticket in an array indexed by ticket % max_pending.
// Plain arithmetic, no device: tested on the CPU (tests/unit/staging_ring_test.cc).
#ifndef HSX_KERNELS_STAGING_RING_H_
#define HSX_KERNELS_STAGING_RING_H_

#include <cstdint>
#include <deque>

#include "absl/status/statusor.h"

namespace hsx {

// Device bytes of the CUDA backend's capture staging ring (allocated by a rank
// the first time it captures with overlap on); the memory plan counts it.
inline constexpr int64_t kCaptureStagingBytes = int64_t{512} << 20;
// Copies a CUDA backend keeps in flight at most (one event each).
inline constexpr int64_t kCaptureMaxPendingCopies = 256;

class StagingRing {
 public:
  // capacity >= 1 bytes, max_pending >= 1 tickets.
  StagingRing(int64_t capacity, int64_t max_pending);

  struct Reservation {
    int64_t offset = 0;     // the region is [offset, offset + bytes)
    int64_t ticket = 0;     // this copy's ticket
    int64_t wait_for = -1;  // the ticket whose copy must finish before the region is written; -1: none
  };
  // The next region of `bytes` (1 <= bytes <= capacity, else InvalidArgument):
  // right after the previous one, or at 0 when it would not fit before the end.
  absl::StatusOr<Reservation> Reserve(int64_t bytes);
  // Every reserved copy has finished (the backend has synchronised both
  // streams): nothing is pending any more.
  void Clear() { pending_.clear(); }

  int64_t capacity() const { return capacity_; }
  int64_t pending() const { return static_cast<int64_t>(pending_.size()); }

 private:
  struct Pending {
    int64_t ticket = 0;
    int64_t begin = 0;
    int64_t end = 0;
  };

  const int64_t capacity_;
  const int64_t max_pending_;
  // Oldest first. They lie in ring order from head_ onwards (wrapping), so the
  // ones a new region runs into are always at the front.
  std::deque<Pending> pending_;
  int64_t head_ = 0;  // where the next region starts unless it wraps
  int64_t next_ticket_ = 0;
};

}  // namespace hsx

#endif  // HSX_KERNELS_STAGING_RING_H_
