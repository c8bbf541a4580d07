// Tests manifest.jsonl line parsing: numbers must be JSON integers in range.
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

}  // namespace
}  // namespace hsx
