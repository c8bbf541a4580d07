// journal.h: a journal (manifest.jsonl, or journal/shard-I-of-N.jsonl of a
// sharded run: dump_dir.h), the record of which samples of an output
// directory are complete (docs/design.md, "On-disk format").
//
// One JSON object per line, appended and fsynced after the sample's file was
// atomically written and renamed into place:
//   {"index", "id", "file", "tokens", "bytes", "xxh64" (of the file's bytes),
//    "capture_ids", "final_norm", "dtype", "model", "model_revision",
//    "compute_precision", "token_ids_xxh64", "loss_mask_xxh64" ("" = none),
//    "input_xxh64" (the whole input file, informational),
//    "supersedes" (only on a redo: the line number of the entry it replaces)}
// Every line carries the run's settings, so each line stands alone.
//
// A sample is done if and only if it has a line: resume reads the journal,
// never a directory listing, and never rewrites a journaled file whose size
// is the journaled one. A journaled file found missing or of another size is
// redone: the new file is renamed over it and a line with "supersedes": N
// replaces line N (the sample's current entry). A sample on two lines without
// that link is corruption. A crash in the middle of an append leaves an
// unterminated last line (a "torn" line):
// readers ignore it, and the writer truncates it away (under the lock) before
// appending. Any other line that does not parse is corruption and an error.
//
// Shard I of N > 1 has a journal of its own (no lock shared between hosts).
// Several processes may still append to one journal (the same shard started
// twice, or a directory from before per-shard journals): appends and
// repairs hold an exclusive flock() on the journal, and a sample's file is
// renamed into place under the same lock, only after checking that no other
// process journaled that sample meanwhile.
#ifndef HSX_CLIENT_DUMP_JOURNAL_H_
#define HSX_CLIENT_DUMP_JOURNAL_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "format/journal_entry.h"
#include "format/safetensors_writer.h"

namespace hsx {

inline constexpr char kJournalFileName[] = "manifest.jsonl";

// One line (JSON and the newline).
std::string JournalLine(const JournalEntry& entry);
// One line's text without the newline.
absl::StatusOr<JournalEntry> ParseJournalLine(absl::string_view text);

struct JournalScan {
  struct Line {
    int64_t number = 0;  // 1-based line in the file
    JournalEntry entry;
  };
  // The current entries in file order: a line that another supersedes is
  // left out (a "supersedes" that points before `first_line` is kept for
  // the caller, who holds the earlier lines, to resolve).
  std::vector<Line> lines;
  int64_t superseded = 0;    // lines left out because a later one replaced them
  uint64_t valid_bytes = 0;  // end of the last complete line
  uint64_t torn_bytes = 0;   // bytes after it: an unterminated last line (0: none)
  int64_t next_line = 1;     // number the next complete line will have
};

// Parses journal bytes (a whole file, or what follows a previous scan:
// `first_line` numbers the first line). `path` names the file in errors.
absl::StatusOr<JournalScan> ParseJournal(absl::string_view bytes, int64_t first_line,
                                         const std::string& path);
// Reads and parses `path` without changing it. A missing file is NotFound.
absl::StatusOr<JournalScan> ReadJournal(const std::string& path);

// The size and XXH64 of a file's bytes.
struct FileDigest {
  int64_t bytes = 0;
  std::string xxh64;
};
absl::StatusOr<FileDigest> DigestFile(const std::string& path);
// The same digest from what the writer hashed while writing the file.
FileDigest ToFileDigest(const WrittenDigest& written);

// fsync of a directory, so that a rename or a creation inside it is durable.
absl::Status SyncDirectory(const std::string& dir);

// The writer's side: one per process, shared by its threads.
class Journal {
 public:
  // Opens (creating, with its directory) the journal at `path` (one of
  // dump_dir.h's: DIR/manifest.jsonl or DIR/journal/shard-I-of-N.jsonl),
  // truncates a torn last line, parses the rest. Fails on a corrupt line,
  // naming it.
  static absl::StatusOr<std::unique_ptr<Journal>> Open(const std::string& path);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  const std::string& path() const { return path_; }
  // The complete lines found by Open.
  const JournalScan& initial() const { return initial_; }
  // Bytes of a torn last line that Open removed (0: none).
  uint64_t repaired_torn_bytes() const { return repaired_; }
  bool IsJournaled(int64_t index) const;
  // The line number of the sample's current entry (0: not journaled).
  int64_t JournaledLine(int64_t index) const;

  // Checks a line appended by another process since Open (same settings?).
  using CheckEntry = std::function<absl::Status(const JournalEntry& entry, int64_t line)>;

  // Declares one sample done. Under the lock: reads what other processes
  // appended meanwhile (passing each new line to `check`); if entry.index is
  // journaled by now (for a redo, entry.supersedes: if its current entry is
  // not that line any more), returns false without calling `publish`; otherwise calls
  // `publish` (which must make the file durable under its final name) and
  // appends and fsyncs the entry's line, then returns true.
  absl::StatusOr<bool> Commit(const JournalEntry& entry, const std::function<absl::Status()>& publish,
                              const CheckEntry& check);

 private:
  Journal() = default;
  // With mutex_ and the flock held: parses bytes appended after scanned_,
  // truncating a torn tail.
  absl::Status CatchUp(const CheckEntry& check, uint64_t* repaired);
  int64_t JournaledLineLocked(int64_t index) const {
    auto it = journaled_.find(index);
    return it == journaled_.end() ? 0 : it->second;
  }

  std::string path_;
  int fd_ = -1;
  JournalScan initial_;
  uint64_t repaired_ = 0;
  mutable std::mutex mutex_;
  uint64_t scanned_ = 0;  // bytes parsed so far
  int64_t next_line_ = 1;
  std::map<int64_t, int64_t> journaled_;  // index -> line of its current entry
};

}  // namespace hsx

#endif  // HSX_CLIENT_DUMP_JOURNAL_H_
