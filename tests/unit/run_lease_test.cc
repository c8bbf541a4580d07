// Tests RunLease: a killed run's temporaries are removed by the next run on
// the same host, and nothing of a live run or another host's run is touched.
#include "client/dump/run_lease.h"

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "gtest/gtest.h"

namespace hsx {
namespace {

namespace fs = std::filesystem;

class RunLeaseTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::path(::testing::TempDir()) / ("run_lease_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  void Write(const std::string& name, const std::string& text = "x") { std::ofstream(dir_ / name) << text; }
  std::set<std::string> Names() const {
    std::set<std::string> names;
    for (const auto& item : fs::directory_iterator(dir_)) names.insert(item.path().filename().string());
    return names;
  }
  static std::string Host() {
    char name[256] = {};
    ::gethostname(name, sizeof(name) - 1);
    return name;
  }

  fs::path dir_;
};

TEST_F(RunLeaseTest, AKilledRunsTemporariesOnThisHostAreRemovedAndNothingElse) {
  // A run killed with -9 on this host: its lease is there, nobody holds its lock.
  Write(".hsx-run.dead01", "host=" + Host() + "\npid=123\n");
  Write("hs_3.safetensors.partial.dead01");
  Write("hs_3.safetensors.partial.dead01.tmp.abcd");
  // Another host's killed (or live) run, and a temporary with no lease at all.
  Write(".hsx-run.far02", "host=not-" + Host() + "\npid=7\n");
  Write("hs_4.safetensors.partial.far02");
  Write("hs_1.safetensors.partial.999999");
  Write("hs_0.safetensors");

  EXPECT_EQ(RunLease::RemoveAbandoned(dir_.string()), 3);
  EXPECT_EQ(Names(), (std::set<std::string>{".hsx-run.far02", "hs_4.safetensors.partial.far02",
                                            "hs_1.safetensors.partial.999999", "hs_0.safetensors"}));
}

TEST_F(RunLeaseTest, ALiveRunIsLeftAloneUntilItEnds) {
  {
    absl::StatusOr<std::unique_ptr<RunLease>> lease = RunLease::Acquire(dir_.string(), "live03");
    ASSERT_TRUE(lease.ok()) << lease.status();
    Write("hs_5.safetensors.partial.live03");
    EXPECT_EQ(RunLease::RemoveAbandoned(dir_.string()), 0);  // locked (another open file description)
    EXPECT_EQ(Names(), (std::set<std::string>{".hsx-run.live03", "hs_5.safetensors.partial.live03"}));
    EXPECT_FALSE(RunLease::Acquire(dir_.string(), "live03").ok());  // a token is never shared
  }
  // The run ended and removed its lease; a temporary it left is not provably
  // abandoned by the lease rule any more (the journal rule covers done samples).
  EXPECT_EQ(Names(), (std::set<std::string>{"hs_5.safetensors.partial.live03"}));
}

TEST_F(RunLeaseTest, ALockHeldByAnotherProcessProtectsItsTemporaries) {
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // a writer in another process: takes its lease, then waits to be killed
    auto lease = RunLease::Acquire(dir_.string(), "child04");
    (void)!::write(ready[1], lease.ok() ? "1" : "0", 1);
    ::pause();
    ::_exit(0);
  }
  char answer = 0;
  ASSERT_EQ(::read(ready[0], &answer, 1), 1);
  ASSERT_EQ(answer, '1');
  Write("hs_6.safetensors.partial.child04");
  EXPECT_EQ(RunLease::RemoveAbandoned(dir_.string()), 0);
  ::kill(child, SIGKILL);  // kill -9: the kernel drops its lock, its lease stays behind
  ::waitpid(child, nullptr, 0);
  EXPECT_EQ(RunLease::RemoveAbandoned(dir_.string()), 2);
  EXPECT_TRUE(Names().empty());
  ::close(ready[0]);
  ::close(ready[1]);
}

}  // namespace
}  // namespace hsx
