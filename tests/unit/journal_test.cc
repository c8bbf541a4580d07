// Tests manifest.jsonl line parsing (numbers must be JSON integers in range)
// and the redo rule (a line with "supersedes" replaces its sample's entry).
#include "client/dump/journal.h"

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "format/safetensors_writer.h"
#include "format/sample_file.h"
#include "tests/unit/test_util.h"

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

// hsx-dump journals the digest the writer hashed while writing (no
// read-back): it must be byte for byte DigestFile's of the written file.
TEST(WrittenDigest, EqualsTheDigestOfTheFileReadBack) {
  ::hsx::testing::TempDir dir;
  InputSample input;
  input.index = 5;
  input.id = "s5";
  const int64_t tokens = 300, hidden = 1000;  // > one 256 KiB hashing block
  for (int64_t t = 0; t < tokens; ++t) input.input_ids.push_back(static_cast<int32_t>(t * 7 + 1));
  input.loss_mask = std::vector<int64_t>(tokens, 1);
  // hidden_states [T, 2, H] in one block, each layer's rows pieces of it; the final norm its own block.
  auto blocks = std::make_shared<std::vector<std::string>>(2);
  std::string& states = (*blocks)[0];
  states.resize(static_cast<size_t>(tokens * 2 * hidden * 2));
  for (size_t i = 0; i < states.size(); ++i) states[i] = static_cast<char>(i * 131 + 7);
  (*blocks)[1] = std::string(static_cast<size_t>(tokens * hidden * 2), '\x3f');
  SampleTensors sample;
  sample.capture_ids = {0, 2};
  sample.tokens = tokens;
  sample.hidden = hidden;
  sample.dtype = OutputDType::kBf16;
  const auto* rows = reinterpret_cast<const uint8_t*>(states.data());
  const size_t row = static_cast<size_t>(hidden * 2);
  for (int l = 0; l < 2; ++l) {
    SampleTensor& layer = sample.tensors.emplace_back();
    layer.capture_id = sample.capture_ids[l];
    for (int64_t t = 0; t < tokens; ++t) layer.pieces.emplace_back(rows + (t * 2 + l) * row, row);
    layer.bytes = tokens * static_cast<int64_t>(row);
  }
  sample.AddTensor(-1, (*blocks)[1].data());
  sample.owner = blocks;
  SampleFileInfo info;
  info.model_name = "m";
  info.num_layers = 2;
  const std::string path = dir / "hs_5.safetensors";
  WrittenDigest written;
  ASSERT_TRUE(WriteSampleFile(path, input, sample, info, &written).ok());
  absl::StatusOr<FileDigest> read = DigestFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  const FileDigest from_write = ToFileDigest(written);
  EXPECT_EQ(from_write.bytes, read->bytes);
  EXPECT_EQ(from_write.xxh64, read->xxh64);
  EXPECT_GT(read->bytes, tokens * 3 * hidden * 2);
}

// The same with every kind of tensor source: a view, a fill and a hole.
TEST(WrittenDigest, CoversFillsViewsAndHoles) {
  ::hsx::testing::TempDir dir;
  const std::vector<float> view = {1.5f, -2.0f, 3.25f, 0.0f};
  SafetensorsWriter writer;
  writer.AddView("v", DType::kF32, {4}, {reinterpret_cast<const uint8_t*>(view.data()), 16});
  writer.Add("f", DType::kBF16, {3}, [](std::span<uint8_t> out) { std::memset(out.data(), 0x41, out.size()); });
  writer.Add("hole", DType::kF32, {40000}, [](std::span<uint8_t>) {});
  writer.ZeroTensorsFrom(1000);
  writer.SetMetadata("format", "pt");
  const std::string path = dir / "mixed.safetensors";
  WrittenDigest written;
  ASSERT_TRUE(writer.Write(path, &written).ok());
  absl::StatusOr<FileDigest> read = DigestFile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(ToFileDigest(written).bytes, read->bytes);
  EXPECT_EQ(ToFileDigest(written).xxh64, read->xxh64);
}

TEST(WrittenDigest, AViewOfTheWrongSizeIsAnError) {
  ::hsx::testing::TempDir dir;
  const std::vector<float> view = {1.5f, -2.0f, 3.25f};
  SafetensorsWriter writer;
  writer.AddView("v", DType::kF32, {4}, {reinterpret_cast<const uint8_t*>(view.data()), 12});
  const absl::Status status = writer.Write(dir / "bad.safetensors");
  EXPECT_EQ(status.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(status.message()), ::testing::HasSubstr("tensor v has 12 bytes"));
  EXPECT_FALSE(std::filesystem::exists(dir / "bad.safetensors"));
}

}  // namespace
}  // namespace hsx
