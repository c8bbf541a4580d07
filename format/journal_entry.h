// journal_entry.h: one line of a dump's journal (manifest.jsonl) as a plain
// value: what was written for one sample. client/dump/journal.h reads and
// appends the lines; format/sample_file_checker.h checks a file against one.
#ifndef HSX_FORMAT_JOURNAL_ENTRY_H_
#define HSX_FORMAT_JOURNAL_ENTRY_H_

#include <cstdint>
#include <string>
#include <vector>

namespace hsx {

struct JournalEntry {
  int64_t index = -1;
  std::string id;
  std::string file;
  int64_t tokens = 0;
  int64_t bytes = 0;
  std::string xxh64;  // of the whole file, 16 hex digits
  std::vector<int> capture_ids;
  bool final_norm = false;
  std::string dtype;
  std::string model;
  std::string model_revision;
  std::string compute_precision;
  std::string token_ids_xxh64;
  std::string loss_mask_xxh64;  // empty: the sample has no loss mask
  std::string input_xxh64;

  bool operator==(const JournalEntry&) const = default;
};

}  // namespace hsx

#endif  // HSX_FORMAT_JOURNAL_ENTRY_H_
