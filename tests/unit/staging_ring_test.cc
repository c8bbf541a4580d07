// staging_ring_test.cc: the capture staging ring's bookkeeping
// (kernels/staging_ring.h): where regions go, which copy each must wait for,
// and, against a byte-by-byte simulation of the ring, that a region is never
// written while a copy that still reads it is pending.
#include "kernels/staging_ring.h"

#include <algorithm>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

StagingRing::Reservation Take(StagingRing& ring, int64_t bytes) {
  absl::StatusOr<StagingRing::Reservation> r = ring.Reserve(bytes);
  EXPECT_TRUE(r.ok()) << r.status();
  return r.ok() ? *r : StagingRing::Reservation{};
}

TEST(StagingRingTest, PacksRegionsAndWaitsOnlyWhenItRunsIntoAPendingCopy) {
  StagingRing ring(100, 16);
  StagingRing::Reservation a = Take(ring, 40), b = Take(ring, 40);
  EXPECT_EQ(a.offset, 0);
  EXPECT_EQ(b.offset, 40);
  EXPECT_EQ(a.wait_for, -1);
  EXPECT_EQ(b.wait_for, -1);
  EXPECT_EQ(b.ticket, a.ticket + 1);
  // 40 more do not fit before the end: back to 0, over the first copy.
  StagingRing::Reservation c = Take(ring, 40);
  EXPECT_EQ(c.offset, 0);
  EXPECT_EQ(c.wait_for, a.ticket);
  StagingRing::Reservation d = Take(ring, 40);
  EXPECT_EQ(d.offset, 40);
  EXPECT_EQ(d.wait_for, b.ticket);
  // A region that exactly fills the rest of the ring does not wrap.
  StagingRing::Reservation e = Take(ring, 20);
  EXPECT_EQ(e.offset, 80);
  EXPECT_EQ(e.wait_for, -1);
}

TEST(StagingRingTest, WrappingRetiresTheCopiesInTheSkippedTail) {
  StagingRing ring(100, 16);
  Take(ring, 60);                                  // t0 [0, 60)
  const auto t1 = Take(ring, 40);                  // t1 [60, 100)
  EXPECT_EQ(Take(ring, 30).wait_for, 0);           // t2 [0, 30) over t0
  EXPECT_EQ(Take(ring, 20).wait_for, -1);          // t3 [30, 50): t1 is further on
  // 60 bytes from 50 do not fit: the region is [0, 60), which runs into t2
  // and t3; t1, in the skipped tail [50, 100), is older and retires first.
  const StagingRing::Reservation t4 = Take(ring, 60);
  EXPECT_EQ(t4.offset, 0);
  EXPECT_EQ(t4.wait_for, 3);
  EXPECT_EQ(ring.pending(), 1);
  EXPECT_EQ(t1.ticket, 1);
}

TEST(StagingRingTest, KeepsAtMostMaxPendingCopies) {
  StagingRing ring(1 << 20, 3);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(Take(ring, 8).wait_for, -1);
  EXPECT_EQ(ring.pending(), 3);
  // Room in the ring, but the fourth pending copy would need a fourth event.
  EXPECT_EQ(Take(ring, 8).wait_for, 0);
  EXPECT_EQ(Take(ring, 8).wait_for, 1);
  EXPECT_EQ(ring.pending(), 3);
}

TEST(StagingRingTest, ClearForgetsFinishedCopies) {
  StagingRing ring(100, 16);
  Take(ring, 100);
  ring.Clear();
  EXPECT_EQ(ring.pending(), 0);
  const StagingRing::Reservation r = Take(ring, 100);
  EXPECT_EQ(r.offset, 0);
  EXPECT_EQ(r.wait_for, -1);
  EXPECT_EQ(r.ticket, 1);  // tickets keep counting: events are indexed by them
}

TEST(StagingRingTest, RefusesEmptyAndOversizedCopies) {
  StagingRing ring(100, 16);
  for (int64_t bytes : {int64_t{0}, int64_t{-1}, int64_t{101}}) {
    absl::StatusOr<StagingRing::Reservation> r = ring.Reserve(bytes);
    ASSERT_FALSE(r.ok()) << bytes;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(r.status().message().find(absl::StrCat(bytes, " bytes")), std::string::npos) << r.status();
  }
  EXPECT_EQ(ring.pending(), 0);
}

// Simulates the two streams byte by byte: owner[i] is the ticket whose copy
// reads byte i, done_upto the newest ticket the compute stream has waited
// for. Every region must hold only bytes whose reader is done once the
// compute stream waits for wait_for; pending copies never exceed the limit;
// and a ring with room never makes anyone wait.
TEST(StagingRingTest, NeverOverwritesAPendingCopy) {
  for (uint32_t seed = 1; seed <= 20; ++seed) {
    std::mt19937 random(seed);
    const int64_t capacity = 50 + random() % 400;
    const int64_t max_pending = 1 + random() % 12;
    StagingRing ring(capacity, max_pending);
    std::vector<int64_t> owner(capacity, -1);
    int64_t done_upto = -1;
    int64_t waits = 0;
    for (int step = 0; step < 2000; ++step) {
      if (random() % 97 == 0) {  // a Synchronize: every copy has finished
        ring.Clear();
        std::fill(owner.begin(), owner.end(), -1);
        continue;
      }
      const int64_t bytes = 1 + random() % (random() % 4 == 0 ? capacity : capacity / 4 + 1);
      const StagingRing::Reservation r = Take(ring, bytes);
      ASSERT_GE(r.offset, 0);
      ASSERT_LE(r.offset + bytes, capacity) << "seed " << seed << " step " << step;
      ASSERT_LT(r.wait_for, r.ticket);
      done_upto = std::max(done_upto, r.wait_for);
      if (r.wait_for >= 0) ++waits;
      for (int64_t i = r.offset; i < r.offset + bytes; ++i) {
        ASSERT_LE(owner[i], done_upto) << "seed " << seed << " step " << step << ": byte " << i << " of ticket "
                                       << owner[i] << " overwritten, waited only for " << r.wait_for;
        owner[i] = r.ticket;
      }
      ASSERT_LE(ring.pending(), max_pending);
    }
    EXPECT_GT(waits, 0) << "seed " << seed << ": the ring never filled";
  }
  // A ring large enough for every copy never waits.
  StagingRing roomy(1000, 100);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(Take(roomy, 20).wait_for, -1);
}

}  // namespace
}  // namespace hsx
