// Tests which failed samples hsx-dump quarantines (client/dump/fault.h): the
// sample's own faults by status code, the environment's by code or by the
// mark on a failed write (a full disk is the environment's whatever code the
// writer chose); and, through RunDump with an extractor that fails on
// purpose, that a sample at fault is quarantined while a busy server stops
// the run, marked as the environment's, with no quarantine line for it.
#include "client/dump/fault.h"

#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <string>
#include <vector>

#include "base/file_util.h"
#include "client/dump/dump_dir.h"
#include "client/dump/dump_job.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

namespace fs = std::filesystem;
using absl::StatusCode;

TEST(FaultTest, CodesThatSpeakOfTheSampleAreItsFault) {
  for (StatusCode code : {StatusCode::kInvalidArgument, StatusCode::kOutOfRange, StatusCode::kDataLoss,
                          StatusCode::kInternal, StatusCode::kUnknown, StatusCode::kNotFound,
                          StatusCode::kAlreadyExists}) {
    EXPECT_EQ(FaultOfCode(code), Fault::kSample) << absl::StatusCodeToString(code);
    EXPECT_EQ(FaultOf(absl::Status(code, "x")), Fault::kSample) << absl::StatusCodeToString(code);
  }
}

TEST(FaultTest, CodesThatSpeakOfServersNetworkOrCredentialsAreTheEnvironments) {
  for (StatusCode code : {StatusCode::kResourceExhausted, StatusCode::kUnavailable, StatusCode::kDeadlineExceeded,
                          StatusCode::kCancelled, StatusCode::kAborted, StatusCode::kFailedPrecondition,
                          StatusCode::kPermissionDenied, StatusCode::kUnauthenticated,
                          StatusCode::kUnimplemented}) {
    EXPECT_EQ(FaultOfCode(code), Fault::kEnvironment) << absl::StatusCodeToString(code);
  }
}

// Every errno of a failed write, fsync or rename (the writers report them as
// INTERNAL, a sample code) is the environment's once marked.
TEST(FaultTest, AFailedWriteIsTheEnvironmentsWhateverTheErrno) {
  for (int error : {ENOSPC, EIO, EDQUOT, EROFS, EFBIG, EACCES, ENOENT}) {
    errno = error;
    const absl::Status written = ErrnoStatus("/out/hs_0.safetensors.partial.x", "write failed");
    EXPECT_EQ(FaultOf(written), Fault::kSample) << "unmarked: by its code";
    EXPECT_FALSE(IsEnvironmentFault(written));
    const absl::Status marked = EnvironmentFault(written);
    EXPECT_EQ(FaultOf(marked), Fault::kEnvironment) << written;
    EXPECT_TRUE(IsEnvironmentFault(marked));
    EXPECT_EQ(marked.message(), written.message());
  }
  EXPECT_TRUE(EnvironmentFault(absl::OkStatus()).ok());
  EXPECT_FALSE(IsEnvironmentFault(absl::OkStatus()));
}

TEST(FaultTest, TheStopSaysWhatHappenedWhatIsKeptAndThatARerunResumes) {
  errno = ENOSPC;
  const absl::Status stop =
      EnvironmentStop(EnvironmentFault(ErrnoStatus("/out/hs_3.safetensors", "write failed")), "/out");
  EXPECT_TRUE(IsEnvironmentFault(stop));
  for (const char* part : {"stopped by the environment, not by a sample (nothing quarantined for it)",
                           "/out/hs_3.safetensors: write failed: No space left on device",
                           "journaled in /out", "rerun the same command to resume", "the file system has room"}) {
    EXPECT_NE(stop.message().find(part), std::string::npos) << part << " in " << stop.message();
  }
  const absl::Status busy = EnvironmentStop(absl::ResourceExhaustedError("server a: busy"), "/out");
  EXPECT_TRUE(IsEnvironmentFault(busy));
  EXPECT_EQ(busy.code(), StatusCode::kResourceExhausted);
  EXPECT_NE(busy.message().find("the servers answer"), std::string::npos) << busy.message();
}

// Fails every sample with the code its index picks.
class FailingExtractor : public Extractor {
 public:
  explicit FailingExtractor(std::vector<absl::Status> by_index) : by_index_(std::move(by_index)) {}
  void Extract(const InputSample& sample, const ExtractSpec&, Done done) override {
    done(by_index_[static_cast<size_t>(sample.index)]);
  }

 private:
  std::vector<absl::Status> by_index_;
};

class FaultRunTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::path(::testing::TempDir()) / ("fault_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    for (int64_t i = 0; i < 2; ++i) samples_.push_back({i, i + 1, "s" + std::to_string(i), {1, 2, 3}, {}});
    options_.out_dir = dir_;
    options_.capture = CaptureSpec::Eagle3(4);
    options_.hidden_size = 8;
    options_.concurrency = 1;  // in order: the sample at fault first
    options_.progress = ProgressMode::kNone;
    options_.max_failures = 100;
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string dir_;
  std::vector<InputSample> samples_;
  DumpOptions options_;
};

TEST_F(FaultRunTest, TheSampleAtFaultIsQuarantinedABusyServerStopsTheRun) {
  FailingExtractor extractor({absl::InvalidArgumentError("input_ids[1] = 9999 is outside the vocabulary"),
                              absl::ResourceExhaustedError("gave up after 9 attempts; the last: busy")});
  DumpStats stats;
  const absl::Status status = RunDump(samples_, extractor, options_, &stats);
  EXPECT_TRUE(IsEnvironmentFault(status)) << status;
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("sample 1 (id s1)"), std::string::npos) << status;
  EXPECT_EQ(stats.quarantined, 1);
  EXPECT_EQ(stats.failed, 1) << "the busy server's sample is not a failed sample";
  absl::StatusOr<std::map<int64_t, QuarantineEntry>> quarantined = ReadQuarantine(dir_);
  ASSERT_TRUE(quarantined.ok()) << quarantined.status();
  ASSERT_EQ(quarantined->size(), 1u);
  EXPECT_EQ(quarantined->begin()->first, 0);
  EXPECT_EQ(quarantined->begin()->second.code, "INVALID_ARGUMENT");
}

TEST_F(FaultRunTest, WithoutMaxFailuresTheSamplesFaultIsAnOrdinaryError) {
  options_.max_failures = 0;
  FailingExtractor extractor({absl::InvalidArgumentError("bad"), absl::InvalidArgumentError("bad too")});
  DumpStats stats;
  const absl::Status status = RunDump(samples_, extractor, options_, &stats);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status;
  EXPECT_FALSE(IsEnvironmentFault(status)) << status;
}

}  // namespace
}  // namespace hsx
