// libFuzzer target: manifest.jsonl. Whatever the bytes, ParseJournal returns
// a status; when it accepts them, the complete lines end at valid_bytes, the
// rest is the torn tail, and every entry written back by JournalLine parses to
// the same entry.
#include <cstddef>
#include <cstdint>
#include <string>

#include "client/dump/journal.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string bytes(reinterpret_cast<const char*>(data), size);
  absl::StatusOr<hsx::JournalScan> scan = hsx::ParseJournal(bytes, 1, "fuzz/manifest.jsonl");
  if (!scan.ok()) return 0;
  if (scan->valid_bytes + scan->torn_bytes != size) __builtin_trap();
  if (scan->valid_bytes > 0 && bytes[scan->valid_bytes - 1] != '\n') __builtin_trap();
  if (bytes.find('\n', scan->valid_bytes) != std::string::npos) __builtin_trap();
  for (const hsx::JournalScan::Line& line : scan->lines) {
    std::string text = hsx::JournalLine(line.entry);
    if (text.empty() || text.back() != '\n') __builtin_trap();
    text.pop_back();
    absl::StatusOr<hsx::JournalEntry> again = hsx::ParseJournalLine(text);
    if (!again.ok() || !(*again == line.entry)) __builtin_trap();
  }
  return 0;
}
