// Tests manifest.jsonl line parsing (numbers must be JSON integers in range)
// and the redo rule (a line with "supersedes" replaces its sample's entry).
#include "client/dump/journal.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace hsx {
namespace {

JournalEntry Entry() {
  JournalEntry e;
  e.index = 3;
  e.id = "a";
  e.file = "hs_3.safetensors";
  e.tokens = 17;
  e.bytes = 4096;
  e.xxh64 = "0123456789abcdef";
  e.capture_ids = {2, 30, 58};
  e.dtype = "bf16";
  return e;
}

// The line of Entry() with `field`'s value text replaced.
std::string LineWith(const std::string& field, const std::string& value) {
  std::string line = JournalLine(Entry());
  line.pop_back();  // the newline
  const std::string key = "\"" + field + "\":";
  const size_t begin = line.find(key) + key.size();
  const size_t end = field == "capture_ids" ? line.find(']', begin) + 1 : line.find(',', begin);
  return line.replace(begin, end - begin, value);
}

TEST(Journal, LineRoundTrips) {
  std::string line = JournalLine(Entry());
  line.pop_back();
  absl::StatusOr<JournalEntry> parsed = ParseJournalLine(line);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(*parsed, Entry());
}

TEST(Journal, NumbersMustBeIntegersInRange) {
  // journal_fuzzer found the first: a huge number was converted to int64 (undefined behaviour).
  for (const auto& [field, value] : std::initializer_list<std::pair<std::string, std::string>>{
           {"tokens", "177777777777777777777777777777777777777777777777"},
           {"tokens", "17.5"},
           {"bytes", "18446744073709551615"},
           {"index", "3.0"},
           {"capture_ids", "[2,30.5,58]"},
           {"capture_ids", "[2,30,4294967298]"}}) {
    absl::StatusOr<JournalEntry> parsed = ParseJournalLine(LineWith(field, value));
    ASSERT_FALSE(parsed.ok()) << field << " = " << value;
    EXPECT_THAT(std::string(parsed.status().message()),
                ::testing::StartsWith("\"" + field + "\" has the wrong type: "));
  }
}

JournalEntry EntryFor(int64_t index, int64_t supersedes = 0) {
  JournalEntry e = Entry();
  e.index = index;
  e.file = "hs_" + std::to_string(index) + ".safetensors";
  e.supersedes = supersedes;
  return e;
}

TEST(Journal, SupersedesRoundTripsAndIsWrittenOnlyOnRedos) {
  EXPECT_EQ(JournalLine(Entry()).find("supersedes"), std::string::npos);
  std::string line = JournalLine(EntryFor(3, 7));
  line.pop_back();
  absl::StatusOr<JournalEntry> parsed = ParseJournalLine(line);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->supersedes, 7);
  line.replace(line.find("\"supersedes\":7"), 14, "\"supersedes\":0");
  EXPECT_FALSE(ParseJournalLine(line).ok());
}

TEST(Journal, ASupersedingLineReplacesTheSamplesEntry) {
  const std::string text = JournalLine(EntryFor(0)) + JournalLine(EntryFor(1)) + JournalLine(EntryFor(1, 2)) +
                           JournalLine(EntryFor(2)) + JournalLine(EntryFor(1, 3));
  absl::StatusOr<JournalScan> scan = ParseJournal(text, 1, "m");
  ASSERT_TRUE(scan.ok()) << scan.status();
  std::vector<std::pair<int64_t, int64_t>> lines;  // (line number, index)
  for (const JournalScan::Line& l : scan->lines) lines.emplace_back(l.number, l.entry.index);
  EXPECT_EQ(lines, (std::vector<std::pair<int64_t, int64_t>>{{1, 0}, {4, 2}, {5, 1}}));
  EXPECT_EQ(scan->superseded, 2);
}

TEST(Journal, ASupersedingLineMustNameTheSamplesCurrentEntry) {
  for (const std::string& text : {
           JournalLine(EntryFor(0)) + JournalLine(EntryFor(1, 1)),                             // another sample's
           JournalLine(EntryFor(1)) + JournalLine(EntryFor(1, 1)) + JournalLine(EntryFor(1, 1)),  // replaced already
           JournalLine(EntryFor(1)) + JournalLine(EntryFor(1, 2)),                             // itself
           JournalLine(EntryFor(1, 5)),                                                          // nothing
       }) {
    absl::StatusOr<JournalScan> scan = ParseJournal(text, 1, "m");
    ASSERT_FALSE(scan.ok()) << text;
    EXPECT_THAT(std::string(scan.status().message()), ::testing::HasSubstr("supersedes line "));
  }
  // Parsed from line 10 on (what another process appended): an earlier target is the caller's to check.
  absl::StatusOr<JournalScan> tail = ParseJournal(JournalLine(EntryFor(1, 4)), 10, "m");
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_EQ(tail->lines.size(), 1u);
}

}  // namespace
}  // namespace hsx
