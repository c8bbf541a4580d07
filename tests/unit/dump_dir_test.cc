// Tests the bookkeeping of an output directory (client/dump/dump_dir.h): the
// journals of all shards merge into one view, a sample in two journals is an
// error naming both lines, the latest quarantine line wins, status files round
// trip, the nested layout's names; and the progress line's moving average
// (client/dump/progress.h).
#include "client/dump/dump_dir.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/dump/progress.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

namespace fs = std::filesystem;

class DumpDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::path(::testing::TempDir()) / ("dump_dir_" + std::to_string(::getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(fs::path(dir_) / kJournalDirName);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::string Line(int64_t index) {
    JournalEntry e;
    e.index = index;
    e.id = std::to_string(index);
    e.file = SampleRelativePath(index, SampleLayout::kFlat);
    e.tokens = 1;
    e.bytes = 10;
    return JournalLine(e);
  }
  void Write(const std::string& relative, const std::string& text) {
    std::ofstream(fs::path(dir_) / relative) << text;
  }

  std::string dir_;
};

TEST_F(DumpDirTest, JournalsOfAllShardsMerge) {
  Write(kJournalFileName, Line(0) + Line(4));  // an older dump's shared journal
  Write("journal/shard-1-of-2.jsonl", Line(1) + Line(3));
  Write("journal/shard-0-of-2.jsonl", Line(2) + "{\"torn");
  absl::StatusOr<DumpJournals> merged = ReadDumpJournals(dir_);
  ASSERT_TRUE(merged.ok()) << merged.status();
  EXPECT_EQ(merged->paths.size(), 3u);
  EXPECT_EQ(merged->current.size(), 5u);
  EXPECT_EQ(merged->torn_bytes, 6u);
  EXPECT_EQ(merged->current.at(3).path, (fs::path(dir_) / "journal/shard-1-of-2.jsonl").string());
  EXPECT_EQ(merged->current.at(3).line, 2);
}

TEST_F(DumpDirTest, ASampleInTwoJournalsNamesBothLines) {
  Write("journal/shard-0-of-2.jsonl", Line(0) + Line(2));
  Write("journal/shard-0-of-4.jsonl", Line(4) + Line(2));
  absl::StatusOr<DumpJournals> merged = ReadDumpJournals(dir_);
  ASSERT_FALSE(merged.ok());
  EXPECT_NE(merged.status().message().find("shard-0-of-4.jsonl:2: sample 2 is journaled twice (also at "),
            std::string::npos) << merged.status();
  EXPECT_NE(merged.status().message().find("shard-0-of-2.jsonl:2)"), std::string::npos) << merged.status();
}

TEST_F(DumpDirTest, ShardFilesAreNamedByShard) {
  EXPECT_EQ(ShardJournalPath(dir_, {0, 1}), (fs::path(dir_) / "manifest.jsonl").string());
  EXPECT_EQ(ShardJournalPath(dir_, {2, 4}), (fs::path(dir_) / "journal/shard-2-of-4.jsonl").string());
  EXPECT_EQ(ShardQuarantinePath(dir_, {0, 1}), (fs::path(dir_) / "quarantine/shard-0-of-1.jsonl").string());
  EXPECT_EQ(ShardStatusPath(dir_, {3, 4}), (fs::path(dir_) / "status/shard-3-of-4.json").string());
}

TEST_F(DumpDirTest, TheLatestQuarantineLineWinsAndACorruptOneIsNamed) {
  const std::string path = ShardQuarantinePath(dir_, {1, 2});
  ASSERT_TRUE(AppendQuarantine(path, {7, "s7", 3, "INVALID_ARGUMENT", "first"}).ok());
  ASSERT_TRUE(AppendQuarantine(path, {7, "s7", 3, "DATA_LOSS", "second"}).ok());
  ASSERT_TRUE(AppendQuarantine(path, {9, "s9", 1, "INTERNAL", "x"}).ok());
  absl::StatusOr<std::map<int64_t, QuarantineEntry>> entries = ReadQuarantine(dir_);
  ASSERT_TRUE(entries.ok()) << entries.status();
  ASSERT_EQ(entries->size(), 2u);
  EXPECT_EQ(entries->at(7).reason, "second");
  EXPECT_EQ(entries->at(7).code, "DATA_LOSS");
  std::ofstream(path, std::ios::app) << "{\"index\": -1}\n";
  entries = ReadQuarantine(dir_);
  ASSERT_FALSE(entries.ok());
  EXPECT_NE(entries.status().message().find("shard-1-of-2.jsonl:4: corrupt quarantine line"), std::string::npos)
      << entries.status();
}

TEST_F(DumpDirTest, StatusFilesRoundTrip) {
  ShardStatus s;
  s.shard = "1/4";
  s.state = "running";
  s.input_samples = 100;
  s.input_tokens = 5000;
  s.retries = 3;
  s.tokens_per_s = 12.5;
  ASSERT_TRUE(WriteShardStatus(ShardStatusPath(dir_, {1, 4}), s).ok());
  absl::StatusOr<std::vector<ShardStatus>> read = ReadShardStatuses(dir_);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ(ShardStatusJson((*read)[0]), ShardStatusJson(s));
  EXPECT_EQ(std::distance(fs::directory_iterator(fs::path(dir_) / kStatusDirName), fs::directory_iterator()), 1)
      << "no temporary left";
}

TEST(SampleLayoutTest, NestedNamesAndJournalFiles) {
  EXPECT_EQ(SampleRelativePath(12345, SampleLayout::kFlat), "hs_12345.safetensors");
  EXPECT_EQ(SampleRelativePath(12345, SampleLayout::kNested), "00012/hs_12345.safetensors");
  EXPECT_EQ(SampleRelativePath(999, SampleLayout::kNested), "00000/hs_999.safetensors");
  EXPECT_TRUE(IsSamplePath("00012/hs_12345.safetensors", 12345));
  EXPECT_FALSE(IsSamplePath("00013/hs_12345.safetensors", 12345));
  JournalEntry e;
  e.index = 12345;
  e.file = "00012/hs_12345.safetensors";
  e.tokens = 1;
  e.bytes = 1;
  std::string line = JournalLine(e);
  line.pop_back();
  EXPECT_TRUE(ParseJournalLine(line).ok());
  for (const char* bad : {"sub/hs_1.safetensors", "/hs_1.safetensors", "1/2/hs_1.safetensors", "00/..", "../x"}) {
    e.file = bad;
    line = JournalLine(e);
    line.pop_back();
    EXPECT_FALSE(ParseJournalLine(line).ok()) << bad;
  }
}

TEST(EwmaTest, ASteadyRateIsExactFromTheStartAndAPauseMovesItLittle) {
  Ewma rate(60.0);
  for (int i = 0; i < 4; ++i) rate.Add(25.0, 0.25);  // 100 per second
  EXPECT_NEAR(rate.Rate(), 100.0, 1e-9);
  for (int i = 0; i < 240; ++i) rate.Add(25.0, 0.25);
  for (int i = 0; i < 20; ++i) rate.Add(0.0, 0.25);  // a 5 s stall
  // Continuous form: 61 s at 100/s weigh W = 60 (1 - e^(-61/60)) = 38.6 s; 5 s later the amount is
  // 100 W e^(-1/12) = 3551 over W e^(-1/12) + 60 (1 - e^(-1/12)) = 40.3 s: 88.1 per second (a 5 s
  // window, the progress line's old rate, would say 0).
  EXPECT_NEAR(rate.Rate(), 88.1, 0.3);
}

}  // namespace
}  // namespace hsx
