// cli_test.cc: the process set-up the streaming binaries share (base/cli.h).
#include "base/cli.h"

#include <cstdlib>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"

namespace hsx {
namespace {

// Takes two mutexes in one order, then in the other: a lock-order cycle
// (no deadlock: one thread), which Debian's Abseil reports and dies of by default.
void TakeTwoLocksBothWays() {
  absl::Mutex a;
  absl::Mutex b;
  {
    absl::MutexLock first(&a);
    absl::MutexLock second(&b);
  }
  {
    absl::MutexLock first(&b);
    absl::MutexLock second(&a);
  }
}

TEST(CliTest, WithoutDeadlockDetectionALockOrderCycleIsNotFatal) {
  // In a child process, since the setting is process-wide; a re-executed one
  // ("threadsafe"): a child forked from this multi-threaded binary can inherit
  // an Abseil lock held by another thread and hang.
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        SkipMutexDeadlockDetection();
        TakeTwoLocksBothWays();
        std::exit(0);
      },
      testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace hsx
